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
from typing import NamedTuple

import torch

from spmd import explain
from spmd.collectives import backend_for


class Step(NamedTuple):
    kind: str  # all_reduce | reduce_scatter | all_gather | shard | all_to_all
    mesh_dim: str
    axis: int = -1  # gathered axis (all_gather, all_to_all) or the sharded one (shard, reduce_scatter)
    to_axis: int = -1  # all_to_all: the axis that becomes sharded
    op: str = "sum"


@functools.lru_cache(maxsize=4096)
def plan(src: tuple, dst: tuple, pending: tuple = (), op: str = "sum") -> tuple[Step, ...]:
    """Steps from per-axis mesh dims `src` (with a pending `op` reduction over `pending`) to `dst`."""
    cur = list(src)
    steps = []
    for m in pending:
        if m in dst and cur[dst.index(m)] is None and m not in cur:
            b = dst.index(m)
            steps.append(Step("reduce_scatter", m, b, op=op))
            cur[b] = m
        else:
            steps.append(Step("all_reduce", m, op=op))
    while tuple(cur) != dst:
        progressed = False
        for m in _mesh_dims(cur, dst):
            a = cur.index(m) if m in cur else None
            b = dst.index(m) if m in dst else None
            if a == b:
                continue
            if a is not None and b is not None and cur[b] is None:
                steps.append(Step("all_to_all", m, a, b))
                cur[a], cur[b] = None, m
            elif a is not None and b is None:
                steps.append(Step("all_gather", m, a))
                cur[a] = None
            elif a is None and cur[b] is None:
                steps.append(Step("shard", m, b))
                cur[b] = m
            else:
                continue
            progressed = True
        if not progressed:  # a cycle (e.g. [x,y] -> [y,x]): free one axis by gathering
            blocked = next(m for m in cur if m is not None and (m not in dst or dst.index(m) != cur.index(m)))
            steps.append(Step("all_gather", blocked, cur.index(blocked)))
            cur[cur.index(blocked)] = None
    return tuple(steps)


@functools.lru_cache(maxsize=4096)
def plan_on(mesh, src: tuple, dst: tuple, pending: tuple = (), op: str = "sum") -> tuple[Step, ...]:
    """`plan` without the steps over mesh dims of size 1 (they move nothing)."""
    return tuple(s for s in plan(src, dst, pending, op) if mesh.dim_size(s.mesh_dim) > 1)


def _mesh_dims(cur, dst):
    seen = []
    for m in list(cur) + list(dst):
        if m is not None and m not in seen:
            seen.append(m)
    return seen


def run(local: torch.Tensor, mesh, steps: tuple[Step, ...]) -> torch.Tensor:
    """Applies `steps` to stacked components `local` of a tensor on `mesh`."""
    if not steps:
        return local
    comm = backend_for(mesh)
    for s in steps:
        if explain.RECORDERS and s.kind != "shard":
            explain.collective(s.kind, (s.mesh_dim,), local)
        if s.kind == "all_reduce":
            local = comm.all_reduce(local, mesh, (s.mesh_dim,), s.op)
        elif s.kind == "reduce_scatter":
            local = comm.reduce_scatter(local, mesh, s.mesh_dim, s.axis, s.op)
        elif s.kind == "all_gather":
            local = comm.all_gather(local, mesh, s.mesh_dim, s.axis)
        elif s.kind == "shard":
            local = comm.shard(local, mesh, s.mesh_dim, s.axis)
        else:
            local = comm.all_to_all(local, mesh, s.mesh_dim, s.axis, s.to_axis)
    return local
