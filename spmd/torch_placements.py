"""Layouts in the terms of torch's own DTensor (`torch.distributed.tensor`): one placement per mesh dimension.

spmd says per tensor axis which mesh dim shards it; torch says per mesh dim what it does to the tensor:
`Shard(i)` (splits tensor axis i), `Replicate()`, or `Partial(op)` (each device holds a term of a pending
reduction, which spmd keeps beside the layout as `_pending`/`_pending_op`). `Layout.to_torch`/`from_torch` are the
public entry points; `spmd.interop` converts tensors. torch.distributed.tensor is imported when first needed
(it takes most of a second).
"""

from __future__ import annotations

from typing import Sequence

from spmd.errors import LayoutError
from spmd.mesh import axis_dims

REDUCE_OPS = ("sum", "avg", "max", "min")  # spmd's pending reductions, each one a torch Partial's reduce_op


def _types():
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard
    return Partial, Replicate, Shard, _StridedShard


def to_placements(dim_names: Sequence[str], axes: Sequence, pending: Sequence[str] = (),
                  pending_op: str = "sum") -> tuple:
    """One placement per mesh dim, in `dim_names` order: `Shard(i)` where tensor axis i is sharded over it,
    `Partial(pending_op)` where a reduction over it is pending, else `Replicate()`. An axis sharded over several
    mesh dims is a `Shard(i)` on each: torch splits it over them in mesh order (the first major), so their order
    in the layout must be the mesh's."""
    Partial, Replicate, Shard, _ = _types()
    axis_of = {}
    for i, axis in enumerate(axes):
        dims = axis_dims(axis)
        if list(dims) != sorted(dims, key=list(dim_names).index):
            raise LayoutError(f"tensor axis {i} is sharded over mesh dims {dims} in that order (the first major), "
                              f"but torch's Shard placements split an axis over mesh dims in mesh order "
                              f"{list(dim_names)}; relayout to {tuple(sorted(dims, key=list(dim_names).index))} "
                              "first")
        axis_of.update((d, i) for d in dims)
    out = []
    for name in dim_names:
        if name in pending:
            out.append(Partial(pending_op))
        elif name in axis_of:
            out.append(Shard(axis_of[name]))
        else:
            out.append(Replicate())
    return tuple(out)


def split(dim_names: Sequence[str], placements: Sequence, rank: int) -> tuple[list, tuple, str]:
    """`(axes, pending mesh dims, pending op)` of torch placements for a tensor of rank `rank`."""
    Partial, Replicate, Shard, StridedShard = _types()
    placements = tuple(placements)
    if len(placements) != len(dim_names):
        raise LayoutError(f"{len(placements)} placements {_show(placements)} for a mesh of {len(dim_names)} dims "
                          f"{list(dim_names)}: torch gives one placement per mesh dim")
    axes: list = [None] * rank
    pending, ops = [], set()
    for name, p in zip(dim_names, placements):
        if isinstance(p, StridedShard):
            raise LayoutError(f"placement {p} on mesh dim {name!r} is a strided shard (torch's record of an axis "
                              f"sharded over several mesh dims in an order other than the mesh's, in "
                              f"{_show(placements)}); spmd reads plain Shard placements: redistribute the torch "
                              "DTensor first")
        if isinstance(p, Shard):
            _shard(axes, p.dim, name, placements)
        elif isinstance(p, Partial):
            pending.append(name)
            ops.add(p.reduce_op)
        elif not isinstance(p, Replicate):
            raise LayoutError(f"unknown placement {p!r} on mesh dim {name!r}: spmd understands Shard, Replicate "
                              "and Partial")
    return axes, tuple(pending), _one_op(ops, placements)


def _shard(axes: list, dim: int, name: str, placements) -> None:
    rank = len(axes)
    if not -rank <= dim < rank:
        raise LayoutError(f"Shard({dim}) on mesh dim {name!r} is out of range for a tensor of rank {rank} "
                          f"(placements {_show(placements)})")
    dim %= rank
    # several Shard(dim) split that axis over their mesh dims in mesh order (the first major)
    axes[dim] = name if axes[dim] is None else axis_dims(axes[dim]) + (name,)


def _one_op(ops: set, placements) -> str:
    if not ops:
        return "sum"
    if len(ops) > 1:
        raise LayoutError(f"placements {_show(placements)} are partial with several reductions {sorted(ops)}; "
                          "spmd keeps one pending reduction per tensor: reduce one of them first")
    op = ops.pop()
    if op not in REDUCE_OPS:
        raise LayoutError(f"Partial({op!r}) in placements {_show(placements)}: spmd's pending reductions are "
                          f"{list(REDUCE_OPS)}")
    return op


def layout_axes(dim_names: Sequence[str], placements: Sequence, rank: int) -> list:
    """The per-axis mesh dims of placements that describe a layout (no `Partial`)."""
    axes, pending, op = split(dim_names, placements, rank)
    if pending:
        raise LayoutError(f"placements {_show(placements)} are Partial({op!r}) over mesh dims {list(pending)}: "
                          "that is a pending reduction, not a layout; convert the tensor with "
                          "spmd.interop.from_torch_dtensor (it keeps the reduction pending), or redistribute it "
                          "to Replicate() first")
    return axes


def _show(placements) -> str:
    return "(" + ", ".join(map(str, placements)) + ")"
