"""Collectives over `torch.distributed` for meshes that span several clients (processes).

A collective over mesh dims D acts on *groups*: the devices that share their coordinates on the other mesh dims.
A group's members may be spread over several clients, and one client may hold several members (of one group
or of several). Each collective therefore
  1. combines this client's members of each group locally (a partial sum, or its components in member order),
  2. runs one `torch.distributed` collective per distinct set of clients ("rank set") holding a group's members,
     batching every group with that rank set into that one call, and
  3. writes each group's result back to every local member.
A group held entirely by this client needs no communication at all.

The direct case skips steps 1 and 3: where client `ranks[i]` holds exactly member i of each group (one device
per client, as under torchrun, or one member per group of several groups), the components go straight into
the torch.distributed call: `all_reduce` in place on one copy of them, `all_gather` into one buffer whose
layout is already the result when the gather axis is the leading one (else one movedim+reshape), and, for
components of `p2p.SMALL` bytes or more, all-to-all and reduce-scatter as one message per piece (p2p.py; a
reduce-scatter then moves half the data of an all-reduce); smaller ones use one `all_to_all_single`. Booleans
take the general path.

`to_global` and relayouts onto another mesh send each distinct shard (or the part of it a client lacks) once
(assembly.py).

Ownership is TF's `create_distributed_mesh` convention: client `r` holds the `L` consecutive global ids
`r*L .. (r+1)*L-1` (`L = mesh.num_local_devices()`); global device names `/task:<r>/` are used when given.

Inside a trace (`torch.compile`, `spmd.function`) the same steps are recorded with the functional collectives
of `torch.distributed._functional_collectives`, which return new tensors instead of writing into buffers: the
compiled graph holds them as ops that inductor may reorder and overlap with computation.

Process groups: one per distinct rank set, created with `dist.new_group` by every client in the same (sorted)
order the first time a (mesh, dims) pair is used (the creation is collective), and cached by rank set; the
whole world uses the default group. Failures and timeouts become `spmd.CollectiveError`.

Clients that disagree (a different program, tensors of different sizes) send buffers of different sizes, and gloo
then aborts the receiving process (SIGABRT) rather than raising. With `SPMD_CHECK_COLLECTIVES=1` (every client must
set it) each collective first all-gathers a fixed-size summary of what each client sends (the collective, the
dtype, each device's component shape), so that every client raises a `CollectiveError` naming the difference: one
more small collective each, hence opt-in. Calls that run several collectives, or a compiled graph's (a checkpoint's
save and load, a call of an `spmd.function`), are checked the same way once before they start (`check_boundary`).
"""

from __future__ import annotations

import functools
import os
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.utils._python_dispatch import _disable_current_modes

from spmd.collectives import assembly, p2p
from spmd.collectives.groups import (all_gather as _all_gather, const as _const, failure, group as _group,
                                     owners as _owners, tracing as _tracing, unreachable, wire as _wire)
from spmd.collectives.base import Collectives, kept_dtype
from spmd.errors import CollectiveError

_OPS = {"sum": "sum", "avg": "sum", "max": "max", "min": "min"}  # avg: a sum, divided after


@dataclass(frozen=True)
class _Batch:
    """The groups (of one (mesh, dims) pair) that one rank set holds and that include this client."""
    ranks: tuple[int, ...]  # the clients holding members of these groups, sorted
    k: int  # members per group
    slots: int  # the most members one client holds of one group (contributions are padded to this)
    local: tuple[tuple[int, int, int], ...]  # per local member: (stack index, group index, member index)
    source: torch.Tensor  # (groups, k): where member i of group g is in a gathered (ranks * slots) axis
    mine: torch.Tensor  # (groups, slots): stack index of this client's member in each slot (-1: padding)
    member_of_slot: torch.Tensor  # (ranks, groups, slots): member index of each client's slot (0: padding)
    # the direct case: this client holds one member of each group, and client `ranks[i]` holds member i of every
    # group (e.g. one device per client); then the components go straight into torch.distributed
    direct: torch.Tensor | None  # (groups,): stack index of this client's member of each group; None otherwise
    identity: bool  # direct and `direct == arange(L)`: the stacked components are the groups' in order
    padded: bool  # some slot of `mine` is padding
    mine_list: tuple[tuple[int, ...], ...]  # `mine` as Python ints (read inside traces without a data dependency)


@dataclass(frozen=True)
class _Plan:
    batches: tuple[_Batch, ...]
    num_local: int


@functools.lru_cache(maxsize=1024)
def _plan(mesh, dims: tuple[str, ...]) -> _Plan:
    with _disable_current_modes():  # first met inside a trace: the cached plan still holds real tensors
        return _make_plan(mesh, dims)


def _make_plan(mesh, dims: tuple[str, ...]) -> _Plan:
    owners = _owners(mesh)
    rank = dist.get_rank()
    base = mesh.min_global_device_id()
    stack_index = {i - base: j for j, i in enumerate(mesh.local_device_ids())}
    axes = [mesh.axis_index(d) for d in dims]
    sizes = [mesh.dim_size(d) for d in dims]
    groups: dict[tuple, list] = {}
    for p in range(mesh.size):
        loc = mesh.device_location(p)
        key = tuple(c for a, c in enumerate(loc) if a not in axes)
        member = 0
        for a, s in zip(axes, sizes):
            member = member * s + loc[a]
        groups.setdefault(key, []).append((member, p))
    by_ranks: dict[tuple[int, ...], list] = {}
    for key in sorted(groups):
        members = [p for _, p in sorted(groups[key])]
        ranks = tuple(sorted({owners[p] for p in members}))
        by_ranks.setdefault(ranks, []).append(members)
    for ranks in sorted(by_ranks):  # every client creates the same groups in the same order
        _group(ranks)
    batches = []
    for ranks, group_list in sorted(by_ranks.items()):
        if rank not in ranks:
            continue
        k = len(group_list[0])
        slot = {}  # position -> (rank index, slot)
        slots = 0
        for members in group_list:
            used = dict.fromkeys(ranks, 0)
            for p in members:
                slot[p] = (ranks.index(owners[p]), used[owners[p]])
                used[owners[p]] += 1
            slots = max(slots, max(used.values()))
        source = torch.tensor([[slot[p][0] * slots + slot[p][1] for p in members] for members in group_list])
        mine = torch.full((len(group_list), slots), -1, dtype=torch.long)
        member_of_slot = torch.zeros((len(ranks), len(group_list), slots), dtype=torch.long)
        local = []
        for g, members in enumerate(group_list):
            for i, p in enumerate(members):
                r, s = slot[p]
                member_of_slot[r, g, s] = i
                if owners[p] == rank:
                    mine[g, s] = stack_index[p]
                    local.append((stack_index[p], g, i))
        direct = None
        if len(ranks) > 1 and slots == 1 and len(ranks) == k and bool((mine >= 0).all()) and \
                bool((source == torch.arange(k)).all()):
            direct = mine[:, 0].clone()
        identity = direct is not None and direct.tolist() == list(range(mesh.num_local_devices()))
        batches.append(_Batch(ranks, k, slots, tuple(local), source, mine, member_of_slot, direct, identity,
                              bool((mine < 0).any()), tuple(map(tuple, mine.tolist()))))
    return _Plan(tuple(batches), mesh.num_local_devices())


def _checking_enabled() -> bool:
    return os.environ.get("SPMD_CHECK_COLLECTIVES", "") not in ("", "0")


def _checking(x: torch.Tensor) -> bool:
    return _checking_enabled() and not _tracing(x)


_SUMMARY_RANK = 8  # component dims a summary holds (more are folded into the last)


def _summary(what: str, x: torch.Tensor) -> torch.Tensor:
    """int64 [collective, dtype, rank, *component shape padded to _SUMMARY_RANK], on x's device."""
    shape = list(x.shape[1:])
    if len(shape) > _SUMMARY_RANK:
        shape = shape[:_SUMMARY_RANK - 1] + [int(torch.Size(shape[_SUMMARY_RANK - 1:]).numel())]
    head = [zlib.crc32(what.encode()), zlib.crc32(str(x.dtype).encode()), x.dim() - 1]
    return torch.tensor(head + shape + [0] * (_SUMMARY_RANK - len(shape)), dtype=torch.int64, device=x.device)


# calls every client makes together that are not one collective (each runs several, or a compiled graph's)
CHECKPOINT_SAVE = "spmd.checkpoint.save"
CHECKPOINT_LOAD = "spmd.checkpoint.load"
FUNCTION_CALL = "a call of an spmd.function"
BOUNDARIES = (CHECKPOINT_SAVE, CHECKPOINT_LOAD, FUNCTION_CALL)


def _describe(summary: list[int], names: dict[int, str]) -> str:
    what, dtype, rank = summary[:3]
    if names.get(what) in BOUNDARIES:
        return names[what]
    return f"{names.get(what, 'another collective')} of {names.get(dtype, 'another dtype')} components of shape " \
           f"{summary[3:3 + min(rank, _SUMMARY_RANK)]}"


def _disagreement(mine: torch.Tensor, group, ranks: tuple[int, ...], what: str) -> str | None:
    """Every client of `group` (ranks `ranks`) shares its summary: None when all are `mine`, else what each runs."""
    every = _all_gather(mine, group, len(ranks)).tolist()
    if all(s == every[0] for s in every):
        return None
    axes = range(_SUMMARY_RANK)  # the collectives another client may run, by name (a summary holds a hash)
    words = [what, *BOUNDARIES, "all_reduce(sum) of a gradient bucket", *(f"all_reduce({op})" for op in _OPS),
             *(f"all_gather(axis {a})" for a in axes), *(f"all_to_all(axis {a} -> {b})" for a in axes for b in axes),
             *(str(d) for d in vars(torch).values() if isinstance(d, torch.dtype))]
    names = {zlib.crc32(w.encode()): w for w in words}
    return "; ".join(f"client {r}: {_describe(s, names)}" for r, s in zip(ranks, every))


def check_boundary(what: str, mesh=None) -> None:
    """With SPMD_CHECK_COLLECTIVES, before `what` (one of BOUNDARIES), which the clients of `mesh` (default: all)
    must call together: raises a CollectiveError on each of them when the others are about to run something else."""
    if not _checking_enabled() or not dist.is_initialized():
        return
    ranks = tuple(sorted(set(_owners(mesh)))) if mesh is not None else tuple(range(dist.get_world_size()))
    group = _group(ranks)
    if group is None:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    try:
        differs = _disagreement(_summary(what, torch.empty(1, 0, device=device)), group, ranks, what)
    except RuntimeError as e:
        raise unreachable(what, e) from e
    if differs:
        raise CollectiveError(f"client {dist.get_rank()} of {dist.get_world_size()}: the clients {list(ranks)} "
                              f"disagree on what runs next: {differs}. Every client must run the same program")


# the three calls of torch.distributed this backend makes, each eager (into a buffer) or traced (functional)
def _all_reduce(buf: torch.Tensor, op: str, group) -> torch.Tensor:
    """`buf` (contiguous, owned) reduced over `group` with `op` ("sum", "max", "min")."""
    if _tracing(buf):
        return funcol.all_reduce(buf, op, group)
    dist.all_reduce(buf, op=getattr(dist.ReduceOp, op.upper()), group=group)
    return buf


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    """Block i of `send`'s dim 0 goes to client i of `group`; block i of the result came from client i."""
    if _tracing(send):
        return funcol.all_to_all_single(send, None, None, group)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


class AsyncCollective:
    """A collective in flight; `wait()` returns its result (`finish` of the filled buffer)."""

    def __init__(self, work, buf: torch.Tensor, fail, finish=None):
        self._work, self._buf, self._fail, self._finish = work, buf, fail, finish

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as e:
                self._fail(e)
            self._work = None
            if self._finish is not None:
                self._buf, self._finish = self._finish(self._buf), None
        return self._buf


class DistributedCollectives(Collectives):
    """Collectives for a mesh whose devices are spread over the clients of a `torch.distributed` job."""

    # -- sums split into a local part and one asynchronous call (the gradient buckets of spmd/buckets.py) --------
    def cross_client_batch(self, mesh, dims) -> _Batch | None:
        """The groups of a sum over `dims` when it is one torch.distributed call across clients; None when it
        needs no communication or several calls (several client sets)."""
        batches = _plan(mesh, tuple(dims)).batches
        if len(batches) != 1 or _group(batches[0].ranks) is None:
            return None
        return batches[0]

    def partial_sums(self, x: torch.Tensor, batch: _Batch) -> torch.Tensor:
        """(groups, *local): the sum of this client's members of each group (no copy when it is `x` itself)."""
        if batch.identity:
            return x
        return self._contributions(x, batch).sum(1, dtype=kept_dtype(x))

    def spread(self, sums: torch.Tensor, batch: _Batch) -> torch.Tensor:
        """(L, *local): each local member's group's value of `sums` (groups, *local)."""
        if batch.identity:
            return sums
        group_of = [g for _, g, _ in sorted(batch.local)]
        return sums.index_select(0, torch.tensor(group_of, device=sums.device))

    def sum_async(self, buf: torch.Tensor, mesh, dims, batch: _Batch) -> AsyncCollective:
        """Starts summing `buf` (flat, contiguous, owned) over the clients of `batch`."""
        def fail(e):
            self._fail(e, "all_reduce(sum) of a gradient bucket", mesh, tuple(dims), batch)
        self._check_agreement(buf.unsqueeze(0), "all_reduce(sum) of a gradient bucket", mesh, tuple(dims), batch)
        try:
            work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=_group(batch.ranks), async_op=True)
        except RuntimeError as e:
            fail(e)
        return AsyncCollective(work, buf, fail)

    # -- helpers ---------------------------------------------------------------------------------------------------
    def _fail(self, e: Exception, what: str, mesh, dims, batch: _Batch):
        raise failure(e, what, mesh, dims, batch.ranks) from e

    def _check_agreement(self, x, what: str, mesh, dims, batch: _Batch) -> None:
        """With SPMD_CHECK_COLLECTIVES: raises a CollectiveError on every client of `batch` when they are not all
        about to run `what` on components of one shape and dtype (see the module's docstring)."""
        group = _group(batch.ranks)
        if group is None or not _checking(x):
            return
        try:
            sends = _disagreement(_summary(what, x), group, batch.ranks, what)
        except RuntimeError as e:
            self._fail(e, what, mesh, dims, batch)
        if sends is None:
            return
        raise CollectiveError(
            f"client {dist.get_rank()} of {dist.get_world_size()}: the clients {list(batch.ranks)} disagree on a "
            f"collective over mesh dim(s) {list(dims)} of mesh {dict(zip(mesh.dim_names, mesh.shape()))}: {sends}. "
            f"Every client must run the same ops on DTensors of the same global shapes and layouts")

    def _contributions(self, x, batch: _Batch) -> torch.Tensor:
        """(groups, slots, *local): this client's components of each group, padded with zeros."""
        mine = _const(batch.mine, x)
        out = x[mine.clamp(min=0)]
        return out.masked_fill((mine < 0).view(mine.shape + (1,) * (x.dim() - 1)), 0) if batch.padded else out

    def _gather(self, x, mesh, dims, batch: _Batch, what: str) -> torch.Tensor:
        """(groups, k, *local): every member's component of each group, in member order."""
        self._check_agreement(x, what, mesh, dims, batch)
        mine = self._contributions(x, batch)
        group = _group(batch.ranks)
        if group is None:
            gathered = mine.unsqueeze(0)
        else:
            try:
                gathered = _all_gather(_wire(mine), group, len(batch.ranks)).to(x.dtype)  # (ranks, groups, slots, ..)
            except RuntimeError as e:
                self._fail(e, what, mesh, dims, batch)
        G = mine.shape[0]
        flat = gathered.movedim(0, 1).reshape((G, len(batch.ranks) * batch.slots) + tuple(x.shape[1:]))
        source = _const(batch.source, x)
        return flat[torch.arange(G, device=x.device).unsqueeze(1), source]

    # the direct case (see `_Batch.direct`): no padding, no reordering, no per-member write-back
    def _members(self, x, batch: _Batch) -> torch.Tensor:
        """(groups, *local): this client's member of each group (`x` itself when its components are in order)."""
        return x if batch.identity else x.index_select(0, _const(batch.direct, x))

    def _direct_in(self, x, batch: _Batch, own: bool = False) -> torch.Tensor:
        """`_members`, contiguous (in its own memory if `own`)."""
        if batch.identity and own:
            return x.clone(memory_format=torch.contiguous_format)
        return self._members(x, batch).contiguous()

    def _direct_out(self, out, x, result, batch: _Batch) -> torch.Tensor:
        """Puts each group's `result` (groups, *out_local) at its local member's stack index."""
        if batch.identity:  # the only batch holding this client's devices
            return result
        if out is None:
            out = torch.empty((x.shape[0],) + tuple(result.shape[1:]), dtype=result.dtype, device=result.device)
        out.index_copy_(0, _const(batch.direct, result), result)
        return out

    def _point_to_point(self, out, x, batch: _Batch, what: str, mesh, dims, send) -> torch.Tensor:
        """Runs `send(this client's members, ranks, group)`, a point-to-point collective of p2p.py, for one batch
        of groups, and puts its result in place (see `_direct_out`)."""
        try:
            result = send(self._members(x, batch), batch.ranks, _group(batch.ranks))
        except RuntimeError as e:
            self._fail(e, what, mesh, dims, batch)
        return self._direct_out(out, x, result, batch)

    def _scatter_back(self, out, per_member, batch: _Batch):
        """Writes per local member `per_member(group, member)` into `out`."""
        for j, g, i in batch.local:
            out[j] = per_member(g, i)

    # -- the interface -------------------------------------------------------------------------------------------
    def all_reduce(self, x, mesh, mesh_dims, op="sum", donate=False):
        if not mesh_dims:
            return x
        if op not in _OPS:
            raise ValueError(f"unknown reduction {op!r}")
        dims = tuple(mesh_dims)
        plan = _plan(mesh, dims)
        out = None
        for batch in plan.batches:
            self._check_agreement(x, f"all_reduce({op})", mesh, dims, batch)
            if batch.direct is not None and x.dtype != torch.bool:  # reduce in place, on a copy unless donated
                try:  # (gloo reduces only in place: the copy costs ~20% at 16 MB; copying in chunks that
                    # overlap the reduction of the previous chunk measured slower, as does a reduce-scatter then
                    # an all-gather as point-to-point messages)
                    buf = _all_reduce(self._direct_in(x, batch, own=not donate), _OPS[op], _group(batch.ranks))
                except RuntimeError as e:
                    self._fail(e, f"all_reduce({op})", mesh, dims, batch)
                if op == "avg":
                    buf = buf.div_(batch.k) if buf.is_floating_point() else buf.floor_divide_(batch.k)
                out = self._direct_out(out, x, buf, batch)
                continue
            if out is None:
                out = torch.empty_like(x, memory_format=torch.contiguous_format)
            mine = self._contributions(x, batch)  # (groups, slots, *local)
            valid = (_const(batch.mine, x) >= 0).view(batch.mine.shape + (1,) * (x.dim() - 1))
            if op in ("sum", "avg"):
                partial = mine.sum(1, dtype=kept_dtype(x))
            else:
                fill = torch.finfo(x.dtype).min if x.dtype.is_floating_point else torch.iinfo(
                    x.dtype if x.dtype != torch.bool else torch.uint8).min
                if op == "min":
                    fill = torch.finfo(x.dtype).max if x.dtype.is_floating_point else torch.iinfo(
                        x.dtype if x.dtype != torch.bool else torch.uint8).max
                masked = mine.masked_fill(~valid, fill) if x.dtype != torch.bool else mine
                partial = masked.amax(1) if op == "max" else masked.amin(1)
            group = _group(batch.ranks)
            if group is not None:
                try:
                    partial = _all_reduce(_wire(partial), _OPS[op], group).to(x.dtype)
                except RuntimeError as e:
                    self._fail(e, f"all_reduce({op})", mesh, dims, batch)
            if op == "avg":
                partial = partial / batch.k if partial.is_floating_point() else partial // batch.k
            for j, g, _ in batch.local:
                out[j] = partial[g]
        return out if out is not None else x.clone(memory_format=torch.contiguous_format)

    def all_gather(self, x, mesh, mesh_dim, axis):
        dims = (mesh_dim,)
        out = None
        for batch in _plan(mesh, dims).batches:
            if batch.direct is not None and x.dtype != torch.bool:
                # gather into the rank-major buffer (ranks, groups, *local); member i is client i's
                self._check_agreement(x, f"all_gather(axis {axis})", mesh, dims, batch)
                try:
                    buf = _all_gather(self._direct_in(x, batch), _group(batch.ranks), len(batch.ranks))
                except RuntimeError as e:
                    self._fail(e, f"all_gather(axis {axis})", mesh, dims, batch)
                out = self._direct_out(out, x, self._concatenated(buf, axis), batch)
                continue
            full = self._gather(x, mesh, dims, batch, f"all_gather(axis {axis})")  # (groups, k, *local)
            full = full.movedim(1, 1 + axis)
            shape = list(full.shape)
            shape[1 + axis: 3 + axis] = [shape[1 + axis] * shape[2 + axis]]
            full = full.reshape(shape)  # (groups, *local with `axis` concatenated)
            if out is None:
                out = torch.empty((x.shape[0],) + tuple(shape[1:]), dtype=x.dtype, device=x.device)
            for j, g, _ in batch.local:
                out[j] = full[g]
        return out

    @staticmethod
    def _concatenated(buf: torch.Tensor, axis: int) -> torch.Tensor:
        """(groups, *local with `axis` concatenated) from the rank-major gathered buffer (ranks, groups, *local)."""
        full = buf.movedim(0, 1 + axis)  # a view; the reshape copies only if the members must interleave
        shape = list(full.shape)
        shape[1 + axis: 3 + axis] = [shape[1 + axis] * shape[2 + axis]]
        return full.reshape(shape).contiguous()

    def all_gather_async(self, x, mesh, mesh_dim, axis) -> AsyncCollective | None:
        """Starts `all_gather(x, mesh, mesh_dim, axis)` where it is one direct torch.distributed call (one member
        of each group per client, as under torchrun); None otherwise (the caller gathers when it needs the value).
        """
        dims = (mesh_dim,)
        batches = _plan(mesh, dims).batches
        if len(batches) != 1 or batches[0].direct is None or x.dtype == torch.bool or _tracing(x):
            return None
        batch, what = batches[0], f"all_gather(axis {axis})"
        self._check_agreement(x, what, mesh, dims, batch)
        send = self._direct_in(x, batch)
        buf = torch.empty((len(batch.ranks),) + tuple(send.shape), dtype=x.dtype, device=x.device)

        def fail(e):
            self._fail(e, what, mesh, dims, batch)
        try:
            work = dist.all_gather(list(buf.unbind(0)), send, group=_group(batch.ranks), async_op=True)
        except RuntimeError as e:
            fail(e)
        return AsyncCollective(work, buf, fail, lambda b: self._direct_out(None, x, self._concatenated(b, axis), batch))

    def shard(self, x, mesh, mesh_dim, axis):
        # no traffic: each local device keeps the block of its own coordinate
        k = mesh.dim_size(mesh_dim)
        base, d = mesh.min_global_device_id(), mesh.axis_index(mesh_dim)
        coords = torch.tensor([mesh.device_location(i - base)[d] for i in mesh.local_device_ids()],
                              device=x.device)
        shape = list(x.shape)
        shape[1 + axis: 2 + axis] = [k, shape[1 + axis] // k]
        blocks = x.reshape(shape).movedim(1 + axis, 1)  # (L, k, *local with the block)
        return blocks[torch.arange(x.shape[0], device=x.device), coords].contiguous()

    def all_to_all(self, x, mesh, mesh_dim, gather_axis, shard_axis):
        dims = (mesh_dim,)
        k = mesh.dim_size(mesh_dim)
        out = None
        for batch in _plan(mesh, dims).batches:
            self._check_agreement(x, f"all_to_all(axis {gather_axis} -> {shard_axis})", mesh, dims, batch)
            if batch.direct is not None and x.dtype != torch.bool and not _tracing(x) and not p2p.small(x):
                # one message per piece, each received into its place
                out = self._point_to_point(
                    out, x, batch, f"all_to_all(axis {gather_axis} -> {shard_axis})", mesh, dims,
                    lambda mine, ranks, group: p2p.all_to_all(mine, ranks, group, gather_axis, shard_axis))
                continue
            if batch.direct is not None and x.dtype != torch.bool:
                # send (k, groups, *piece): piece i of each component to client i (= member i), then concatenate
                # what arrives, in client order, along the gather axis
                mine = self._direct_in(x, batch)
                shape = list(mine.shape)
                shape[1 + shard_axis: 2 + shard_axis] = [k, shape[1 + shard_axis] // k]
                send = mine.view(shape).movedim(1 + shard_axis, 0).contiguous()  # no copy if shard_axis == 0
                try:
                    recv = _all_to_all(send, _group(batch.ranks))
                except RuntimeError as e:
                    self._fail(e, f"all_to_all(axis {gather_axis} -> {shard_axis})", mesh, dims, batch)
                full = recv.movedim(0, 1 + gather_axis)
                shape = list(full.shape)
                shape[1 + gather_axis: 3 + gather_axis] = [shape[1 + gather_axis] * shape[2 + gather_axis]]
                out = self._direct_out(out, x, full.reshape(shape).contiguous(), batch)
                continue
            mine = self._contributions(x, batch)  # (groups, slots, *local)
            G, S, R = mine.shape[0], batch.slots, len(batch.ranks)
            # split the shard axis into k pieces: (groups, slots, k, *local with the piece)
            shape = list(mine.shape)
            shape[2 + shard_axis: 3 + shard_axis] = [k, shape[2 + shard_axis] // k]
            pieces = mine.reshape(shape).movedim(2 + shard_axis, 2)
            # send[r, g, s, t]: to client r's slot t, the piece its member needs, of my slot s's component
            want = _const(batch.member_of_slot, x)  # (ranks, groups, slots)
            g_idx = torch.arange(G, device=x.device).view(1, G, 1, 1)
            s_idx = torch.arange(S, device=x.device).view(1, 1, S, 1)
            send = pieces[g_idx, s_idx, want.view(R, G, 1, S)]  # (ranks, groups, slots, slots, *piece)
            group = _group(batch.ranks)
            if group is None:
                recv = send
            else:
                try:
                    recv = _all_to_all(_wire(send), group).to(x.dtype)
                except RuntimeError as e:
                    self._fail(e, f"all_to_all(axis {gather_axis} -> {shard_axis})", mesh, dims, batch)
            # recv[r, g, s, t]: from client r's slot s to my slot t; order the senders by member index
            flat = recv.movedim(0, 1).reshape((G, R * S, S) + tuple(send.shape[4:]))
            ordered = flat[torch.arange(G, device=x.device).unsqueeze(1), _const(batch.source, x)]  # (G,k,S,..)
            ordered = ordered.movedim(1, 2).movedim(2, 2 + gather_axis)  # (G, S, *piece with k before gather)
            shape = list(ordered.shape)
            shape[2 + gather_axis: 4 + gather_axis] = [shape[2 + gather_axis] * shape[3 + gather_axis]]
            ordered = ordered.reshape(shape)
            if out is None:
                out = torch.empty((x.shape[0],) + tuple(shape[2:]), dtype=x.dtype, device=x.device)
            for g, slots in enumerate(batch.mine_list):
                for s, j in enumerate(slots):
                    if j >= 0:
                        out[j] = ordered[g, s]
        return out

    def reduce_scatter(self, x, mesh, mesh_dim, axis, op="sum"):
        dims = (mesh_dim,)
        batches = _plan(mesh, dims).batches
        if op not in _OPS or x.dtype == torch.bool or _tracing(x) or not batches or \
                any(b.direct is None for b in batches):
            # all-reduce, then each device keeps its block (a local slice)
            return self.shard(self.all_reduce(x, mesh, dims, op), mesh, mesh_dim, axis)
        out = None  # the direct case: each client receives only the pieces of its own block (p2p.py)
        for batch in batches:
            what = f"reduce_scatter({op}, axis {axis})"
            self._check_agreement(x, what, mesh, dims, batch)
            out = self._point_to_point(out, x, batch, what, mesh, dims,
                                       lambda mine, ranks, group: p2p.reduce_scatter(mine, ranks, group, axis, op))
        return out

    def permute(self, x, mesh, from_dims, to_dims):
        # each group gathers its members' components (in `from_dims` order) and every device keeps the one its
        # coordinates over `to_dims` name: k blocks received for the one kept, but one collective that also runs
        # traced (torch.distributed's point-to-point calls do not)
        dims = tuple(from_dims)
        base, ids = mesh.min_global_device_id(), mesh.local_device_ids()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        for batch in _plan(mesh, dims).batches:
            full = self._gather(x, mesh, dims, batch, f"permute({list(from_dims)} -> {list(to_dims)})")
            for j, g, _ in batch.local:
                location = mesh.device_location(ids[j] - base)
                index = 0
                for d in to_dims:
                    index = index * mesh.dim_size(d) + location[mesh.axis_index(d)]
                out[j] = full[g, index]
        return out

    def assemble(self, x, mesh, axes):
        if _checking(x):  # (every client of the mesh takes part)
            for batch in _plan(mesh, tuple(mesh.dim_names)).batches:
                self._check_agreement(x, f"assemble {list(axes)} (to_global)", mesh, tuple(mesh.dim_names), batch)
        return assembly.assemble(x, mesh, axes)  # each distinct shard sent once, by one client holding it

    def move(self, x, mesh, axes, dst_mesh, dst_axes, shape):
        """The components of `x` (by `axes` on `mesh`) laid out by `dst_axes` on `dst_mesh`, another multi-client
        mesh on the same torch device: each client receives only the parts of its own target shards."""
        return assembly.move(x, mesh, axes, dst_mesh, dst_axes, shape)


__all__ = ["DistributedCollectives"]
