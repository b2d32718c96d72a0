"""Ops on DTensors with an axis sharded over several mesh dims (`Layout(["x+y", ...])`).

Sharding rules reason about one mesh dim per tensor axis: the dispatcher shows them each multi-axis input as its
`Layout.outer_axes` (every axis sharded over its major mesh dim alone), and the planner relayouts the input to
whatever the rule then asks (at the least, gathering the minor mesh dims). A rule registered `blockwise` (its
kernel acts per element or block and reads no mesh coordinate: pointwise ops, copies, sums, matrix products) is
exact on the finer blocks too, so its decision is renamed back instead: each outer mesh dim becomes the full
tuple again. `a + b` of two `("x", "y")`-sharded tensors runs on the components as they are, and a sum over a
`("x", "y")`-sharded axis leaves a sum pending over both mesh dims.
"""

from __future__ import annotations

import dataclasses

from spmd.engine.decision import Decision
from spmd.layout import axis_dims


def adapt(decision: Decision, entry, tensors) -> Decision:
    """The decision a rule made on the outer axes of `tensors`, for their multi-axis layouts where it holds."""
    if entry is not None and entry.multi_axis:  # the rule saw the real axes: "any layout" keeps them
        return dataclasses.replace(decision, inputs=tuple(t._layout.axes if want is None else want
                                                          for t, want in zip(tensors, decision.inputs)))
    if entry is None or not entry.blockwise or decision.collectives or decision.keeps:
        return decision  # (a pending input is resolved before the kernel: only a kept one would see its dims)
    names = _renaming(tensors)
    if names is None:
        return decision
    inputs = [t._layout.outer_axes if want is None else tuple(want) for t, want in zip(tensors, decision.inputs)]
    outputs = [axes for axes in decision.outputs if axes is not None]
    rank = max((len(axes) for axes in outputs), default=0)
    if any(t.dim() < rank and any(m in names for m in want) for t, want in zip(tensors, inputs)):
        return decision  # a pointwise rule shapes the broadcast view of a lower-rank input from its outer blocks
    minor = {d for dims in names.values() for d in dims[1:]}
    if any(m in minor for axes in inputs + outputs + list(decision.reduce) for m in axes):
        return decision  # a minor mesh dim shards another axis: the renamed layouts would use it twice

    def rename(axes):
        return None if axes is None else tuple(names.get(m, m) for m in axes)

    renamed = tuple(rename(a) for a in inputs)
    if decision.inplace and renamed[0] != tensors[0]._layout.axes:
        return decision  # the target keeps its layout: the others are relayouted to what the rule asked
    # a reduction over an outer dim (a sum over the axis, a contraction) becomes one over all of its mesh dims
    reduce = tuple(tuple(d for m in dims for d in axis_dims(names.get(m, m))) for dims in decision.reduce)
    return dataclasses.replace(decision, inputs=renamed,
                               outputs=tuple(rename(a) for a in decision.outputs), reduce=reduce)


def _renaming(tensors) -> dict | None:
    """outer mesh dim -> the tuple it stands for, if every multi-axis input agrees and no two tuples share a mesh
    dim (`("c", "a")` and `("b", "a")`: renamed back, `a` would shard two axes); None otherwise."""
    names: dict = {}
    for t in tensors:
        for axis in t._layout.axes:
            dims = axis_dims(axis)
            if len(dims) > 1 and names.setdefault(dims[0], dims) != dims:
                return None
    used = [d for dims in names.values() for d in dims]
    return names if len(used) == len(set(used)) else None
