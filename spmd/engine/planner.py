"""Plans and runs layout A -> layout B as a short list of collectives.

Per mesh dimension the transition table is:

| A shards axis | B shards axis | step                                                  |
|---------------|---------------|-------------------------------------------------------|
| a             | a             | nothing                                               |
| a             | -             | all_gather(a)                                         |
| -             | b             | shard(b): a local slice, no traffic                   |
| a             | b != a        | all_to_all(a -> b), once axis b is free               |
| pending sum   | -  / b        | all_reduce / reduce_scatter(b)                        |

Steps are ordered so that every intermediate state is a valid layout (one mesh dimension per tensor axis).
Plans depend only on immutable values and are cached.
"""

from __future__ import annotations

import functools

import torch

from spmd import explain
from spmd.collectives import Collective, Kind, backend_for


@functools.lru_cache(maxsize=4096)
def plan(src: tuple, dst: tuple, pending: tuple = (), op: str = "sum") -> tuple[Collective, ...]:
    """Steps from per-axis mesh dims `src` (with a pending `op` reduction over `pending`) to `dst`."""
    cur = list(src)
    steps = []
    for m in pending:
        if m in dst and cur[dst.index(m)] is None and m not in cur:
            b = dst.index(m)
            steps.append(Collective(Kind.REDUCE_SCATTER, (m,), b, op=op))
            cur[b] = m
        else:
            steps.append(Collective(Kind.ALL_REDUCE, (m,), op=op))
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
    """`plan` without the steps over mesh dims of size 1 (they move nothing)."""
    return tuple(s for s in plan(src, dst, pending, op) if mesh.dim_size(s.mesh_dims[0]) > 1)


def _mesh_dims(cur, dst):
    seen = []
    for m in list(cur) + list(dst):
        if m is not None and m not in seen:
            seen.append(m)
    return seen


def run(local: torch.Tensor, mesh, steps: tuple[Collective, ...]) -> torch.Tensor:
    """Applies `steps` to stacked components `local` of a tensor on `mesh`."""
    if not steps:
        return local
    comm = backend_for(mesh)
    for s in steps:
        local = execute(comm, s, local, mesh)
    return local


def execute(comm, step: Collective, local: torch.Tensor, mesh) -> torch.Tensor:
    """Runs one collective on stacked components (and reports it to an active `explain` recorder)."""
    kind = step.kind
    if explain.RECORDERS and kind is not Kind.SHARD:
        explain.collective(kind, step.mesh_dims, local)
    if kind is Kind.ALL_REDUCE:
        return comm.all_reduce(local, mesh, step.mesh_dims, step.op)
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
    # collectives return fresh memory; without steps, copy
    return run(replicated, mesh, steps) if steps else replicated.clone(memory_format=torch.contiguous_format)
