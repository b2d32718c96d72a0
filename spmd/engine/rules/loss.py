"""Regression losses: `mse_loss` and its backward.

Why the rule holds: a mean/sum of squared errors is a sum of per-device partial sums (one all-reduce over the
mesh dims sharding the inputs); the mean then divides by the global element count.
"""

from __future__ import annotations

import math

import torch

from spmd.engine.registry import register
from spmd.engine.decision import Decision, OpCall, unsupported
from spmd.engine.rules.pointwise import aligned_inputs, broadcast_shape, merge_axes

aten = torch.ops.aten
_NONE, _MEAN = 0, 1


def _reduction(call: OpCall, position: int) -> int:
    return call.args[position] if len(call.args) > position else call.kwargs.get("reduction", _MEAN)


@register(aten.mse_loss.default)
def mse_loss_rule(call: OpCall) -> Decision:
    x, target = call.specs
    shape = broadcast_shape([x.shape, target.shape])
    axes = merge_axes([x, target], shape)
    inputs, views = aligned_inputs(call, [x, target], axes, shape)
    reduction = _reduction(call, 2)

    def squared_error(l):
        a, b = (t if v is None else t.view(v) for t, v in zip(l, views))
        return (a - b).square()

    if reduction == _NONE:
        return Decision(inputs, (axes,), lambda l, a, k: squared_error(l))
    count = math.prod(shape)

    def kernel(l, a, k):
        err = squared_error(l)
        return err.reshape(err.shape[0], -1).sum(1)
    mean = reduction == _MEAN
    return Decision(inputs, ((),), kernel, reduce=(tuple(m for m in axes if m),),
                    epilogue=(lambda outs, l, a, k: [outs[0] / count]) if mean else None)


@register(aten.mse_loss_backward.default)
def mse_loss_backward_rule(call: OpCall) -> Decision:
    grad, x, target = call.specs
    if x.shape != target.shape:
        raise unsupported(call, "mse_loss with broadcasting inputs (torch warns about it too); expand the target")
    shape = x.shape
    axes = merge_axes([x, target], shape)
    (x_axes, t_axes), views = aligned_inputs(call, [x, target], axes, shape)
    reduction = _reduction(call, 3)
    scale = 2.0 / math.prod(shape) if reduction == _MEAN else 2.0
    g_axes = axes if reduction == _NONE else ()
    g_view = None if reduction == _NONE else (call.num_local,) + (1,) * len(shape)

    def kernel(l, a, k):
        g, xl, tl = l
        xl, tl = (t if v is None else t.view(v) for t, v in zip((xl, tl), views))
        return (xl - tl) * (g if g_view is None else g.view(g_view)) * scale
    return Decision((g_axes, x_axes, t_axes), (axes,), kernel)
