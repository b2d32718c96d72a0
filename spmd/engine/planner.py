"""Plans and runs layout A -> layout B as a short list of collectives.

Per mesh dimension the transition table is:

| A shards axis | B shards axis | step                                                  |
|---------------|---------------|-------------------------------------------------------|
| a             | a             | nothing                                               |
| a             | -             | all_gather(a)                                         |
| -             | b             | shard(b): a local slice, no traffic                   |
| a             | b != a        | all_to_all(a -> b), once axis b is free               |
| pending sum   | -  / b        | all_reduce / reduce_scatter(b)                        |

Mesh dims of one size that only change axes (`[x, y] -> [y, x]`) are one permute: each device's block is another's.

A sum pending over several mesh dims that the target does not shard is one all-reduce over all of them, after
the slices the target takes over other mesh dims (a partial sum's block is the block's partial sum).

Steps are ordered so that every intermediate state is a valid layout (one mesh dimension per tensor axis).
Plans depend only on immutable values and are cached.

When either side shards an axis over several mesh dims, the steps act on the minor (last) mesh dim of an axis
(gathered or moved away by all_gather / all_to_all, added by shard / reduce_scatter / all_to_all), and a permute
reorders an axis's mesh dims; the plan is then the cheapest path found by a search over those steps: fewest
collectives, then fewest bytes per device.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math

import torch

from spmd import explain
from spmd.collectives import Collective, Kind, backend_for
from spmd.collectives.local import share
from spmd.layout import axis_dims


@functools.lru_cache(maxsize=4096)
def plan(src: tuple, dst: tuple, pending: tuple = (), op: str = "sum") -> tuple[Collective, ...]:
    """Steps from per-axis mesh dims `src` (with a pending `op` reduction over `pending`) to `dst`."""
    cur = list(src)
    steps = []
    summed = []  # the pending dims that no axis of dst takes: one all-reduce over all of them, after the scatters
    for m in pending:
        if m in dst and cur[dst.index(m)] is None and m not in cur:
            b = dst.index(m)
            steps.append(Collective(Kind.REDUCE_SCATTER, (m,), b, op=op))
            cur[b] = m
        else:
            summed.append(m)
    if summed:  # slicing first (each device's block of the partial sums: no traffic) shrinks the all-reduce
        for b, m in enumerate(dst):
            if m is not None and cur[b] is None and m not in cur and m not in pending:
                steps.append(Collective(Kind.SHARD, (m,), b))
                cur[b] = m
        steps.append(Collective(Kind.ALL_REDUCE, tuple(summed), op=op))
    while tuple(cur) != dst:
        progressed = False
        for m in _mesh_dims(cur, dst):
            a = cur.index(m) if m in cur else None
            b = dst.index(m) if m in dst else None
            if a == b:
                continue
            if a is not None and b is not None and cur[b] is None:
                steps.append(Collective(Kind.ALL_TO_ALL, (m,), a, b))
                cur[a], cur[b] = None, m
            elif a is not None and b is None:
                steps.append(Collective(Kind.ALL_GATHER, (m,), a))
                cur[a] = None
            elif a is None and cur[b] is None:
                steps.append(Collective(Kind.SHARD, (m,), b))
                cur[b] = m
            else:
                continue
            progressed = True
        if not progressed:  # a cycle (e.g. [x,y] -> [y,x]): free one axis by gathering
            blocked = next(m for m in cur if m is not None and (m not in dst or dst.index(m) != cur.index(m)))
            steps.append(Collective(Kind.ALL_GATHER, (blocked,), cur.index(blocked)))
            cur[cur.index(blocked)] = None
    return tuple(steps)


@functools.lru_cache(maxsize=4096)
def plan_on(mesh, src: tuple, dst: tuple, pending: tuple = (), op: str = "sum") -> tuple[Collective, ...]:
    """`plan` without the steps over mesh dims of size 1 (they move nothing); `search` where an axis of `src`
    or `dst` is sharded over several mesh dims."""
    if any(type(a) is tuple for a in src) or any(type(a) is tuple for a in dst):
        return search(mesh, src, dst, pending, op)
    pending = tuple(d for d in pending if mesh.dim_size(d) > 1)
    swap = None if pending else _swap(mesh, src, dst)
    if swap is not None:
        return (swap,)
    return tuple(s for s in plan(src, dst, pending, op) if mesh.dim_size(s.mesh_dims[0]) > 1)


def _swap(mesh, src: tuple, dst: tuple) -> Collective | None:
    """Where `dst` only moves mesh dims of one size between the axes that `src` shards (`[x, y] -> [y, x]`), each
    device's block is whole another device's: one permute of the components. None otherwise."""
    moved = [a for a, (s, d) in enumerate(zip(src, dst)) if s != d]
    if not moved or any(src[a] is None or dst[a] is None for a in moved):
        return None
    from_dims, to_dims = tuple(src[a] for a in moved), tuple(dst[a] for a in moved)
    if set(from_dims) != set(to_dims) or len({mesh.dim_size(m) for m in from_dims}) != 1 or \
            mesh.dim_size(from_dims[0]) == 1:
        return None
    return Collective(Kind.PERMUTE, to_dims, moved[0], from_dims=from_dims)


def search(mesh, src: tuple, dst: tuple, pending: tuple = (), op: str = "sum") -> tuple[Collective, ...]:
    """The cheapest steps from `src` (with a pending `op` reduction over `pending`) to `dst`, any axis sharded over
    any number of mesh dims: Dijkstra over layouts, costed (collectives, bytes per device as a fraction of the
    global tensor, steps). Mesh dims of size 1 are left out (they split nothing)."""
    def real(axis):
        return tuple(d for d in axis_dims(axis) if mesh.dim_size(d) > 1)

    start = (tuple(real(a) for a in src), tuple(d for d in pending if mesh.dim_size(d) > 1))
    goal = (tuple(real(a) for a in dst), ())
    # the plan does not know the tensor's shape, only that src's and dst's shard counts divide each axis: every
    # layout on the way splits an axis into a divisor of one of them
    ends = [(mesh.shard_count(s), mesh.shard_count(d)) for s, d in zip(start[0], goal[0])]
    frontier = [((0, 0.0, 0), 0, start, ())]
    done = set()
    tie = itertools.count(1)
    while frontier:
        cost, _, state, steps = heapq.heappop(frontier)
        if state == goal:
            return steps
        if state in done:
            continue
        done.add(state)
        for step, nxt, (n, moved) in _moves(mesh, *state, goal[0], op):
            if nxt not in done and all(a % c == 0 or b % c == 0
                                       for (a, b), c in zip(ends, (mesh.shard_count(dims) for dims in nxt[0]))):
                heapq.heappush(frontier, ((cost[0] + n, cost[1] + moved, cost[2] + 1), next(tie), nxt,
                                          steps + (step,)))
    raise AssertionError(f"no relayout from {src} to {dst}")  # unreachable: gathering all, then sharding, works


def _moves(mesh, axes: tuple, pending: tuple, goal: tuple, op: str):
    """(step, next state, (collectives, bytes moved per device)) from layout `axes` with `pending` reductions.
    Dims are added only where `goal` wants them; every step is valid on an unreduced sum, since it moves whole
    blocks between devices that agree on the pending dims."""
    size = mesh.dim_size
    block = 1.0 / math.prod(mesh.shard_count(dims) for dims in axes)  # a device's share of the global tensor
    wanted = {d: b for b, dims in enumerate(goal) for d in dims}
    summed = tuple(m for m in pending if m not in wanted)  # the dims no reduce-scatter can take: one all-reduce
    if len(summed) > 1:
        k = mesh.shard_count(summed)
        rest = tuple(m for m in pending if m in wanted)
        yield Collective(Kind.ALL_REDUCE, summed, op=op), (axes, rest), (1, 2 * (k - 1) / k * block)
    for m in pending:
        rest = tuple(p for p in pending if p != m)
        k = size(m)
        yield Collective(Kind.ALL_REDUCE, (m,), op=op), (axes, rest), (1, 2 * (k - 1) / k * block)
        if m in wanted:
            b = wanted[m]
            yield (Collective(Kind.REDUCE_SCATTER, (m,), b, op=op), (_add(axes, b, m), rest),
                   (1, (k - 1) / k * block))
    used = {d for dims in axes for d in dims}
    for m, b in wanted.items():
        if m not in used and m not in pending:
            yield Collective(Kind.SHARD, (m,), b), (_add(axes, b, m), pending), (0, 0.0)
    for a, dims in enumerate(axes):
        if not dims:
            continue
        m, k = dims[-1], size(dims[-1])
        popped = axes[:a] + (dims[:-1],) + axes[a + 1:]
        yield Collective(Kind.ALL_GATHER, (m,), a), (popped, pending), (1, (k - 1) * block)
        b = wanted.get(m)
        if b is not None and b != a:
            yield Collective(Kind.ALL_TO_ALL, (m,), a, b), (_add(popped, b, m), pending), (1, (k - 1) / k * block)
        for order in itertools.permutations(dims):
            if order != dims:
                yield (Collective(Kind.PERMUTE, order, a, from_dims=dims),
                       (axes[:a] + (order,) + axes[a + 1:], pending), (1, block))


def _add(axes: tuple, b: int, m: str) -> tuple:
    return axes[:b] + (axes[b] + (m,),) + axes[b + 1:]


def _mesh_dims(cur, dst):
    seen = []
    for m in list(cur) + list(dst):
        if m is not None and m not in seen:
            seen.append(m)
    return seen


def run(local: torch.Tensor, mesh, steps: tuple[Collective, ...], donate: bool = False) -> torch.Tensor:
    """Applies `steps` to stacked components `local` of a tensor on `mesh`; with `donate` the caller gives `local`
    up (the first step may write its result into that memory)."""
    if not steps:
        return local
    comm = backend_for(mesh)
    for s in steps:
        local, donate = execute(comm, s, local, mesh, donate), False
    return local


def execute(comm, step: Collective, local: torch.Tensor, mesh, donate: bool = False) -> torch.Tensor:
    """Runs one collective on stacked components (and reports it to an active `explain` recorder)."""
    kind = step.kind
    if explain.RECORDERS and kind is not Kind.SHARD:
        explain.collective(kind, step.mesh_dims, local)
    if kind is Kind.ALL_REDUCE:
        return comm.all_reduce(local, mesh, step.mesh_dims, step.op, donate)
    if kind is Kind.PERMUTE:
        return comm.permute(local, mesh, step.from_dims, step.mesh_dims)
    (mesh_dim,) = step.mesh_dims
    if kind is Kind.REDUCE_SCATTER:
        return comm.reduce_scatter(local, mesh, mesh_dim, step.axis, step.op)
    if kind is Kind.ALL_GATHER:
        return comm.all_gather(local, mesh, mesh_dim, step.axis)
    if kind is Kind.SHARD:
        return comm.shard(local, mesh, mesh_dim, step.axis)
    if kind is Kind.ALL_TO_ALL:
        return comm.all_to_all(local, mesh, mesh_dim, step.axis, step.to_axis)
    raise NotImplementedError(f"the planner cannot run {step}")


def distribute(value: torch.Tensor, mesh, axes: tuple) -> torch.Tensor:
    """The stacked components of a plain global `value` laid out by `axes`: each device keeps its shard (one
    copy per shard, never an alias of `value`)."""
    value = value.detach().to(mesh.torch_device)
    replicated = value.unsqueeze(0).expand((mesh.num_local_devices(),) + tuple(value.shape))
    steps = plan_on(mesh, (None,) * len(axes), axes)
    if steps:  # collectives return fresh memory
        return run(replicated, mesh, steps)
    # replicated over the whole mesh: one copy that every device shares
    return share(value.clone(memory_format=torch.contiguous_format).unsqueeze(0), replicated.shape[0])
