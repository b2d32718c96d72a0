"""The global value (`to_global`) and moves onto another mesh on multi-client meshes, moving only what is missing.

A layout cuts a tensor into distinct *shards*, one per combination of shard coordinates of its sharded axes
(an axis over mesh dims (a, b) has coordinate `a * size(b) + b`); devices that differ only on mesh dims that
shard nothing hold copies of one shard. Every client computes the same plan from the mesh alone:

- `assemble` (to_global: the whole value on every client). A client holding every shard (a replicated tensor,
  or one sharded only over mesh dims inside each client) sends nothing; otherwise each shard is sent once, by
  one of the clients holding it (spread evenly, a shard only one client holds sent by that client), in ONE
  all-gather. Gathering mesh dim by mesh dim instead would send every replica and run one call per dim (a
  tensor sharded over `batch` of a `batch x model` mesh would be gathered once per `model` coordinate).
- `move` (relayout onto another mesh). A target device needs only its own box of the global value, which
  overlaps a few source shards; each overlap a client lacks is cut by one holder of its source shard and sent
  to that client alone, all in one `all_to_all_single` with per-client sizes. Nothing is gathered whole.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.utils._python_dispatch import _disable_current_modes

from spmd.collectives import groups
from spmd.layout import axis_dims


# -- shards ----------------------------------------------------------------------------------------------------------
def _counts(mesh, axes) -> tuple[int, ...]:
    return tuple(mesh.shard_count(a) for a in axes)


def _shard_of(mesh, axes, position: int) -> tuple[int, ...]:
    loc = mesh.device_location(position)
    key = []
    for a in axes:
        i = 0
        for d in axis_dims(a):
            i = i * mesh.dim_size(d) + loc[mesh.axis_index(d)]
        key.append(i)
    return tuple(key)


@dataclass(frozen=True)
class _Shards:
    keys: tuple[tuple[int, ...], ...]  # the distinct shards, row-major over the per-axis counts
    clients: tuple[tuple[int, ...], ...]  # per shard: the clients holding it
    stack: dict  # shard key -> the stack index of this client's first device holding it
    provider: dict  # shard key -> the client that sends it
    targets: tuple[tuple[int, ...], ...]  # per local device: its shard key


def _shards(mesh, axes) -> _Shards:
    owners = groups.owners(mesh)
    me = dist.get_rank()
    base = mesh.min_global_device_id()
    stack_of = {i - base: j for j, i in enumerate(mesh.local_device_ids())}
    holders: dict[tuple, set] = {}
    stack: dict[tuple, int] = {}
    for p in range(mesh.size):
        key = _shard_of(mesh, axes, p)
        holders.setdefault(key, set()).add(owners[p])
        if owners[p] == me and key not in stack:
            stack[key] = stack_of[p]
    keys = tuple(sorted(holders))
    load = dict.fromkeys(sorted(set(owners)), 0)
    provider = {}
    for key in sorted(keys, key=lambda k: (len(holders[k]), k)):  # the least held first, then evenly
        r = min(sorted(holders[key]), key=lambda c: load[c])
        provider[key] = r
        load[r] += 1
    targets = tuple(_shard_of(mesh, axes, i - base) for i in mesh.local_device_ids())
    return _Shards(keys, tuple(tuple(sorted(holders[k])) for k in keys), stack, provider, targets)


def _index(values, like: torch.Tensor) -> torch.Tensor:
    return groups.const(torch.tensor(list(values), dtype=torch.long), like)


def _fail(e: Exception, what: str, mesh):
    raise groups.failure(e, what, mesh, tuple(mesh.dim_names), tuple(range(dist.get_world_size()))) from e


# -- assemble --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Assembly:
    counts: tuple[int, ...]
    communicate: bool  # some client lacks a shard
    send: tuple[int, ...]  # stack indices of the shards this client sends, in shard order
    per_client: int  # shards per client in the all-gather (fewer are padded)
    in_order: bool  # the gathered buffer is every shard in order (client r sends shards r*m .. (r+1)*m-1)
    local: tuple[tuple[int, int], ...]  # (shard index, stack index) read from this client's components
    received: tuple[tuple[int, int], ...]  # (shard index, index in the gathered buffer)


@functools.lru_cache(maxsize=1024)
def _assembly(mesh, axes: tuple) -> _Assembly:
    with _disable_current_modes():
        s = _shards(mesh, axes)
    me, world = dist.get_rank(), dist.get_world_size()
    communicate = any(len(c) < world for c in s.clients)
    sent = {r: [i for i, k in enumerate(s.keys) if s.provider[k] == r] for r in range(world)}
    m = max(len(v) for v in sent.values())
    slot = {i: r * m + j for r in range(world) for j, i in enumerate(sent[r])}
    in_order = communicate and [i for r in range(world) for i in sent[r]] == list(range(len(s.keys))) and \
        all(len(v) == m for v in sent.values())
    local = tuple((i, s.stack[k]) for i, k in enumerate(s.keys) if k in s.stack)
    received = tuple((i, slot[i]) for i, k in enumerate(s.keys) if k not in s.stack) if communicate else ()
    return _Assembly(_counts(mesh, axes), communicate, tuple(s.stack[s.keys[i]] for i in sent[me]), m, in_order,
                     local, received)


def assemble(x: torch.Tensor, mesh, axes: tuple) -> torch.Tensor:
    """The global value of stacked components `x` laid out by `axes` on a multi-client mesh (a fresh tensor)."""
    plan = _assembly(mesh, tuple(axes))
    local_shape = tuple(x.shape[1:])
    n = len(plan.local) + len(plan.received)
    if plan.communicate:
        send = x if plan.send == tuple(range(x.shape[0])) else x.index_select(0, _index(plan.send, x))
        if send.shape[0] < plan.per_client:  # pad to the same size on every client
            send = torch.cat([send, send.new_zeros((plan.per_client - send.shape[0],) + local_shape)])
        try:
            gathered = groups.all_gather(groups.wire(send), groups.group(tuple(range(dist.get_world_size()))),
                                      dist.get_world_size())
        except RuntimeError as e:
            _fail(e, "to_global (all_gather of the distinct shards)", mesh)
        gathered = gathered.to(x.dtype).view((-1,) + local_shape)
    if plan.in_order:
        table = gathered  # no copy: the gathered buffer is the shards in order
    elif not plan.received:  # every shard is here (`local` lists them in order): one copy
        table = x.index_select(0, _index([j for _, j in plan.local], x))
    else:
        table = torch.empty((n,) + local_shape, dtype=x.dtype, device=x.device)
        positions, stacks = zip(*plan.local) if plan.local else ((), ())
        if positions:
            table.index_copy_(0, _index(positions, x), x.index_select(0, _index(stacks, x)))
        if plan.received:
            positions, slots = zip(*plan.received)
            table.index_copy_(0, _index(positions, x), gathered.index_select(0, _index(slots, x)))
    return _place(table, plan.counts, local_shape)


def _place(table: torch.Tensor, counts: tuple[int, ...], local_shape: tuple[int, ...]) -> torch.Tensor:
    """(shards in row-major order of `counts`, *local) -> the global tensor (a view when the shards are already
    in place, i.e. only leading axes are sharded)."""
    r = len(counts)
    grid = table.reshape(tuple(counts) + local_shape)
    order = [i for a in range(r) for i in (a, r + a)]
    return grid.permute(order).reshape(tuple(c * s for c, s in zip(counts, local_shape)))


# -- move between meshes ---------------------------------------------------------------------------------------------
def _box(key, counts, shape):
    block = [s // c for s, c in zip(shape, counts)]
    return tuple((k * b, (k + 1) * b) for k, b in zip(key, block))


def _overlap(a, b):
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def _cut(box, origin):
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


@dataclass(frozen=True)
class _Move:
    communicate: bool
    sends: tuple  # per client: ((source stack index, slices of the source component), ...)
    receives: tuple  # per client: ((target index, slices of the target shard, shape), ...)
    local: tuple  # ((target index, slices of the target shard, source stack index, slices of the source), ...)
    targets: tuple[int, ...]  # per local target device: its index among this client's distinct target shards
    count: int  # distinct target shards of this client


@functools.lru_cache(maxsize=1024)
def _move_plan(src_mesh, src_axes: tuple, dst_mesh, dst_axes: tuple, shape: tuple) -> _Move:
    with _disable_current_modes():
        src, dst = _shards(src_mesh, src_axes), _shards(dst_mesh, dst_axes)
        dst_owners = groups.owners(dst_mesh)
        dst_positions = [_shard_of(dst_mesh, dst_axes, p) for p in range(dst_mesh.size)]
    me, world = dist.get_rank(), dist.get_world_size()
    src_counts, dst_counts = _counts(src_mesh, src_axes), _counts(dst_mesh, dst_axes)
    src_holders = dict(zip(src.keys, src.clients))
    wanted = {r: sorted({k for p, k in enumerate(dst_positions) if dst_owners[p] == r}) for r in range(world)}
    sends, receives, local = [[] for _ in range(world)], [[] for _ in range(world)], []
    communicate = False
    mine = wanted[me]
    for r in range(world):
        for t_index, t in enumerate(wanted[r]):
            t_box = _box(t, dst_counts, shape)
            for s in src.keys:
                piece = _overlap(_box(s, src_counts, shape), t_box)
                if piece is None:
                    continue
                s_box = _box(s, src_counts, shape)
                if r in src_holders[s]:  # the receiver holds this source shard: a local copy
                    if r == me:
                        local.append((t_index, _cut(piece, t_box), src.stack[s], _cut(piece, s_box)))
                    continue
                communicate = True
                sender = src.provider[s]
                if sender == me:
                    sends[r].append((src.stack[s], _cut(piece, s_box)))
                if r == me:
                    receives[sender].append((t_index, _cut(piece, t_box), tuple(hi - lo for lo, hi in piece)))
    targets = tuple(mine.index(t) for t in dst.targets)
    return _Move(communicate, tuple(map(tuple, sends)), tuple(map(tuple, receives)), tuple(local), targets,
                 len(mine))


def move(x: torch.Tensor, src_mesh, src_axes: tuple, dst_mesh, dst_axes: tuple, shape: tuple) -> torch.Tensor:
    """Stacked components `x` (laid out by `src_axes` on `src_mesh`, global `shape`) -> the stacked components
    of the same value laid out by `dst_axes` on `dst_mesh`; each client receives only the parts it lacks."""
    plan = _move_plan(src_mesh, tuple(src_axes), dst_mesh, tuple(dst_axes), tuple(shape))
    dst_local = tuple(s // c for s, c in zip(shape, _counts(dst_mesh, dst_axes)))
    shards = torch.empty((plan.count,) + dst_local, dtype=x.dtype, device=x.device)
    if plan.communicate:
        flat = [x[j][cut].reshape(-1) for pieces in plan.sends for j, cut in pieces]
        send = torch.cat(flat) if flat else x.new_empty((0,))
        in_sizes = [sum(math.prod(x[j][cut].shape) for j, cut in pieces) for pieces in plan.sends]
        out_sizes = [sum(math.prod(s) for *_, s in pieces) for pieces in plan.receives]
        group = groups.group(tuple(range(dist.get_world_size())))
        try:
            if groups.tracing(x):
                recv = funcol.all_to_all_single(groups.wire(send), out_sizes, in_sizes, group)
            else:
                recv = torch.empty((sum(out_sizes),), dtype=groups.wire(send).dtype, device=x.device)
                dist.all_to_all_single(recv, groups.wire(send), out_sizes, in_sizes, group=group)
        except RuntimeError as e:
            _fail(e, "relayout onto another mesh (all_to_all_single)", src_mesh)
        recv = recv.to(x.dtype)
        offset = 0
        for t, cut, piece_shape in itertools.chain.from_iterable(plan.receives):
            size = math.prod(piece_shape)
            shards[t][cut] = recv[offset:offset + size].view(piece_shape)
            offset += size
    for t, t_cut, j, s_cut in plan.local:
        shards[t][t_cut] = x[j][s_cut]
    if plan.targets == tuple(range(plan.count)):
        return shards
    return shards.index_select(0, _index(plan.targets, shards))
