"""The inverses of views: ops that place a view's values into a tensor of the base's shape, the rest zeros
(`diag_embed`, the gradients `diagonal_backward` and `unfold_backward`) or a given base (`diagonal_scatter`,
`select_scatter`, `slice_scatter`, what functionalisation turns writes through views into).

Why the rules hold: the view picks elements along the axes it touches (the diagonal's two, the selected or
sliced one, the unfolded one) and takes every other axis whole and in order, so the placement moves elements
along the touched axes only. Those are whole on each device (with the view's own trailing axis where it has
one); the others keep their sharding, the same in the base and the view, and each device places its block.
"""

from __future__ import annotations

import torch

from spmd.engine.decision import Decision, OpCall
from spmd.engine.registry import register
from spmd.engine.rules.common import generic_kernel, norm_dim
from spmd.engine.rules.reduction import arg, arg_index

aten = torch.ops.aten


def _first_wins(*candidates: tuple) -> tuple:
    """Per axis the first operand's mesh dim that is not None; a mesh dim that two axes claim shards neither."""
    out = [next((m for m in axis if m is not None), None) for axis in zip(*candidates)]
    return tuple(None if m is not None and out.count(m) > 1 else m for m in out)


def _untouched(axes: tuple, touched) -> tuple:
    return tuple(m for i, m in enumerate(axes) if i not in touched)


def _insert_whole(kept: tuple, touched, rank: int) -> tuple:
    """The axes of a rank-`rank` tensor: None at `touched`, `kept` in order at the others."""
    it = iter(kept)
    return tuple(None if i in touched else next(it) for i in range(rank))


def _shifted(call: OpCall, **dims) -> dict:
    """Argument overrides for generic_kernel: each named dim argument shifted past the stack axis."""
    return {arg_index(call.func, name): d + 1 for name, d in dims.items()}


@register(aten.diag_embed.default)
def diag_embed_rule(call: OpCall) -> Decision:
    """The input's last axis becomes the diagonal of the output's (dim1, dim2): whole; the others keep theirs."""
    spec = call.specs[0]
    rank = spec.rank + 1
    d1, d2 = norm_dim(arg(call, "dim1"), rank), norm_dim(arg(call, "dim2"), rank)
    axes = spec.axes[:-1] + (None,)
    return Decision((axes,), (_insert_whole(axes[:-1], {d1, d2}, rank),),
                    generic_kernel(call.func, arg_overrides=_shifted(call, dim1=d1, dim2=d2)))


@register(aten.diagonal_backward.default)
def diagonal_backward_rule(call: OpCall) -> Decision:
    """The gradient of `diagonal`: its last axis (the diagonal) whole, placed on the whole (dim1, dim2)."""
    grad = call.specs[0]
    sizes = tuple(arg(call, "input_sizes"))
    d1, d2 = norm_dim(arg(call, "dim1"), len(sizes)), norm_dim(arg(call, "dim2"), len(sizes))
    axes = grad.axes[:-1] + (None,)
    out = _insert_whole(axes[:-1], {d1, d2}, len(sizes))
    local = (call.num_local,) + call.local_shape(sizes, out)
    offset = arg(call, "offset")
    return Decision((axes,), (out,), lambda l, a, k: aten.diagonal_backward(l[0], local, offset, d1 + 1, d2 + 1))


@register(aten.unfold_backward.default)
def unfold_backward_rule(call: OpCall) -> Decision:
    """The gradient of `unfold`: the unfolded axis and the windows' trailing axis whole, the others kept."""
    grad = call.specs[0]
    sizes = tuple(arg(call, "input_sizes"))
    if not sizes:  # the gradient of a 0-d input's one-element window
        return Decision(((None,),), ((),), lambda l, a, k: l[0].reshape(l[0].shape[:1]).clone())
    dim, size, step = norm_dim(arg(call, "dim"), len(sizes)), arg(call, "size"), arg(call, "step")
    out = tuple(None if i == dim else m for i, m in enumerate(grad.axes[:-1]))
    local = (call.num_local,) + call.local_shape(sizes, out)
    return Decision((out + (None,),), (out,), lambda l, a, k: aten.unfold_backward(l[0], local, dim + 1, size, step))


def _scatter(call: OpCall, touched: set, view_rank_touched: set, **dims) -> Decision:
    """`self` and `src` sharded alike on the untouched axes (first wins), whole on the touched ones."""
    base, src = call.specs[:2]
    kept = _first_wins(_untouched(base.axes, touched), _untouched(src.axes, view_rank_touched))
    axes = _insert_whole(kept, touched, base.rank)
    return Decision((axes, _insert_whole(kept, view_rank_touched, src.rank)), (axes,),
                    generic_kernel(call.func, arg_overrides=_shifted(call, **dims)))


@register(aten.diagonal_scatter.default)
def diagonal_scatter_rule(call: OpCall) -> Decision:
    rank = call.specs[0].rank
    d1, d2 = norm_dim(arg(call, "dim1"), rank), norm_dim(arg(call, "dim2"), rank)
    return _scatter(call, {d1, d2}, {rank - 2}, dim1=d1, dim2=d2)


@register(aten.select_scatter.default)
def select_scatter_rule(call: OpCall) -> Decision:
    dim = norm_dim(arg(call, "dim"), call.specs[0].rank)
    return _scatter(call, {dim}, set(), dim=dim)


@register(aten.slice_scatter.default)
def slice_scatter_rule(call: OpCall) -> Decision:
    dim = norm_dim(arg(call, "dim"), call.specs[0].rank)
    return _scatter(call, {dim}, {dim}, dim=dim)
