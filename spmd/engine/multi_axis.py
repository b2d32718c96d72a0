"""Ops on DTensors with an axis sharded over several mesh dims (`Layout(["x+y", ...])`).

Sharding rules reason about one mesh dim per tensor axis: the dispatcher shows them each multi-axis input as its
`Layout.outer_axes` (every axis sharded over its major mesh dim alone), and the planner relayouts the input to
whatever the rule then asks (at the least, gathering the minor mesh dims). A rule registered `blockwise` (its
kernels act per element or block and read no mesh coordinate: pointwise ops, copies, sums, matrix products, norms
and softmax over whole axes, attention, embeddings, losses) is exact on the finer blocks too, so its decision is
renamed back instead: each outer mesh dim becomes the full tuple again, in the layouts, the pending reductions and
the all-reduces the rule declares — unless the decision names that dim `fixed` (its kernel was built for the
dim's own blocks: a vocabulary shard's first row, a bias viewed by its local shape). `a + b` of two
`("x", "y")`-sharded tensors runs on the components as they are, a sum over a `("x", "y")`-sharded axis leaves a
sum pending over both mesh dims, and a batch sharded over `("x", "y")` passes through a whole transformer with
the gradients' sums pending over both. An in-place blockwise op on a multi-axis target (`y.mul_(w)`,
`y.copy_(w)`) keeps the target's layout whatever the other operands': its rule sees the real axes (it aligns the
operands to the target's axes, as given), and the others are relayouted to them.
"""

from __future__ import annotations

import dataclasses

from spmd.collectives import Kind
from spmd.dtensor import DTensor
from spmd.engine.decision import Decision, is_inplace
from spmd.layout import axis_dims


def sees_whole(entry, func, args) -> bool:
    """Whether the rule of `func` is shown multi-axis layouts as they are: one registered `multi_axis`, or a
    blockwise one writing in place into a multi-axis target (its decision keeps the target's layout)."""
    if entry is None:
        return False
    if entry.multi_axis:
        return True
    return entry.blockwise and bool(args) and isinstance(args[0], DTensor) and args[0]._layout.multi_axis and \
        is_inplace(func)


def adapt(decision: Decision, entry, tensors, native: bool) -> Decision:
    """The decision a rule made on the outer axes of `tensors` (the real ones where `native`), for their
    multi-axis layouts where it holds."""
    if native:  # the rule saw the real axes: "any layout" keeps them
        return dataclasses.replace(decision, inputs=tuple(t._layout.axes if want is None else want
                                                          for t, want in zip(tensors, decision.inputs)))
    if entry is None or not entry.blockwise or decision.keeps or \
            any(c.kind is not Kind.ALL_REDUCE for c in decision.collectives):
        return decision  # (a pending input is resolved before the kernel: only a kept one would see its dims)
    names = _renaming(tensors)
    if names is None or not names.keys().isdisjoint(decision.fixed):
        return decision  # (a kernel built for an outer dim's blocks, e.g. a vocabulary shard's rows, is not renamed)
    inputs = [t._layout.outer_axes if want is None else tuple(want) for t, want in zip(tensors, decision.inputs)]
    outputs = [axes for axes in decision.outputs if axes is not None]
    minor = {d for dims in names.values() for d in dims[1:]}
    if any(m in minor for axes in inputs + outputs + list(decision.reduce) for m in axes):
        return decision  # a minor mesh dim shards another axis: the renamed layouts would use it twice

    def rename(axes):
        return None if axes is None else tuple(names.get(m, m) for m in axes)

    def all_dims(dims):  # a reduction over an outer dim (a sum over the axis, a contraction) is one over its tuple
        return tuple(d for m in dims for d in axis_dims(names.get(m, m)))

    renamed = tuple(rename(a) for a in inputs)
    mesh = tensors[0]._layout.mesh
    if any(size % mesh.shard_count(m) for t, axes in zip(tensors, renamed) for size, m in zip(t.shape, axes)):
        return decision  # an axis the finer blocks do not divide (`a @ w`, `w` of 2 columns where `a` has 4 blocks)
    if decision.inplace and renamed[0] != tensors[0]._layout.axes:
        return decision  # the target keeps its layout: the others are relayouted to what the rule asked
    return dataclasses.replace(
        decision, inputs=renamed, outputs=tuple(rename(a) for a in decision.outputs),
        reduce=tuple(all_dims(dims) for dims in decision.reduce),
        collectives=tuple(c._replace(mesh_dims=all_dims(c.mesh_dims)) for c in decision.collectives))


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
