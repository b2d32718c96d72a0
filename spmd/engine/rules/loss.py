"""Elementwise losses (`mse_loss`, `huber_loss`, `smooth_l1_loss`, `soft_margin_loss`, `binary_cross_entropy`,
`binary_cross_entropy_with_logits`) and their backward ops.

Why the rules hold: each of these losses is an elementwise term (torch's own op with `reduction='none'`) of its
broadcast operands — input, target and any weights — then summed or averaged. The term is computed where the
elements are (any layout, as a pointwise op); a sum is a sum of per-device partial sums, left pending over the
mesh dims sharding the term (one all-reduce, or a reduce-scatter, for whoever reads it); a mean is the same
pending sum of the partial sums divided by the global element count (a data-parallel step that never reads its
loss never reduces it). The gradient of a
sum or a mean is the elementwise backward term (torch's backward op with `reduction='none'`) with the incoming
scalar gradient broadcast (divided by the element count for a mean): no collective.
A loss is one entry of `_LOSSES`: its op and its backward op.
"""

from __future__ import annotations

import math

import torch

from spmd.engine.registry import register
from spmd.engine.decision import Decision, OpCall, TensorSpec
from spmd.engine.rules.common import generic_kernel
from spmd.engine.rules.pointwise import aligned_inputs, broadcast_shape, merge_axes
from spmd.engine.rules.reduction import arg, arg_index

aten = torch.ops.aten
_NONE, _MEAN = 0, 1

# loss op -> its backward op (None: torch's backward is composite, made of ops with rules of their own)
_LOSSES = {
    aten.mse_loss.default: aten.mse_loss_backward.default,
    aten.huber_loss.default: aten.huber_loss_backward.default,
    aten.smooth_l1_loss.default: aten.smooth_l1_loss_backward.default,
    aten.soft_margin_loss.default: aten.soft_margin_loss_backward.default,
    aten.binary_cross_entropy.default: aten.binary_cross_entropy_backward.default,
    aten.binary_cross_entropy_with_logits.default: None,
}


def _elementwise_term(call: OpCall, operands) -> tuple:
    """(axes of the broadcast term, its global shape, the operands' axes, a kernel computing the term on the
    operands' aligned components): the op itself at `reduction='none'`."""
    shape = broadcast_shape([s.shape for s in operands])
    axes = merge_axes(operands, shape)
    inputs, pads = aligned_inputs(operands, axes, shape)
    term = generic_kernel(call.func, arg_overrides={arg_index(call.func, "reduction"): _NONE}, pads=pads)
    return axes, shape, inputs, term


@register(*_LOSSES, floats_at_run_time=True)
def elementwise_loss_rule(call: OpCall) -> Decision:
    axes, shape, inputs, term = _elementwise_term(call, call.specs)
    reduction = arg(call, "reduction")
    if reduction == _NONE:
        return Decision(inputs, (axes,), term)

    def kernel(l, a, k):
        t = term(l, a, k)
        return t.reshape(t.shape[0], -1).sum(1)
    dims, count = tuple(m for m in axes if m), math.prod(shape)
    if reduction != _MEAN:
        return Decision(inputs, ((),), kernel, reduce=(dims,))
    return Decision(inputs, ((),), lambda l, a, k: kernel(l, a, k) / count, reduce=(dims,))


@register(*filter(None, _LOSSES.values()), floats_at_run_time=True)
def elementwise_loss_backward_rule(call: OpCall) -> Decision:
    """The gradient's term is laid out like the forward's; a sum's or mean's scalar gradient is replicated and
    broadcast to each component."""
    reduction = arg(call, "reduction")
    if reduction == _NONE:
        axes, _, inputs, term = _elementwise_term(call, call.specs)
        return Decision(inputs, (axes,), term)
    grad, operands = call.specs[0], call.specs[1:]
    rank = len(broadcast_shape([s.shape for s in operands]))
    scalar = TensorSpec((None,) * rank, (1,) * rank, grad.dtype)  # the 0-d gradient, broadcast like the term
    axes, shape, inputs, term = _elementwise_term(call, [scalar, *operands])
    scale = 1 / math.prod(shape) if reduction == _MEAN else 1
    local = call.local_shape(shape, axes)

    def kernel(l, a, k):
        n = l[0].shape[0]
        g = (l[0] * scale).view((n,) + (1,) * rank).expand((n,) + local)
        return term([g, *l[1:]], a, k)
    return Decision(((),) + inputs[1:], (axes,), kernel)
