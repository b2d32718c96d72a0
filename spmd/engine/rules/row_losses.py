"""Losses whose term is one per row of the input, read from the whole row: `multi_margin_loss` and
`multilabel_margin_loss` (the score of each row's target classes against all its others), and their backward ops.

Why the rules hold: rows are independent, so each device computes the terms of the rows it holds (torch's own op at
`reduction='none'`, on its rows) once the class axis is whole on it (gathered if it was sharded); a sum is the
per-device partial sums, left pending over the mesh dim sharding the rows, and a mean that pending sum divided by
the global row count. The gradient is torch's backward op on the same rows, with a sum's or mean's scalar gradient
given to every row (divided by the row count for a mean): no collective.
"""

from __future__ import annotations

import torch

from spmd.engine.registry import register
from spmd.engine.decision import Decision, OpCall
from spmd.engine.rules.common import generic_kernel
from spmd.engine.rules.reduction import arg, arg_index

aten = torch.ops.aten
_NONE, _MEAN = 0, 1

_ROW_LOSSES = {aten.multi_margin_loss.default: aten.multi_margin_loss_backward.default,
               aten.multilabel_margin_loss_forward.default: aten.multilabel_margin_loss_backward.default}
_MULTILABEL = (aten.multilabel_margin_loss_forward.default, aten.multilabel_margin_loss_backward.default)


def _rows(call: OpCall, first: int) -> tuple:
    """(the mesh dim of the rows, the operands' axes, the position of a class weight or None): `call.specs[first]`
    is the input, (N, C) or (C,); after it come a target (and an is_target) shaped like it (multilabel), or a
    target per row and an optional class weight (multi_margin); before it a backward's gradient."""
    x = call.specs[first]
    rows = x.axes[0] if x.rank == 2 else None
    like_input = (rows, None)[:x.rank]
    multilabel = call.func in _MULTILABEL
    weight = None if multilabel or len(call.specs) <= first + 2 else first + 2
    axes = []
    for i, spec in enumerate(call.specs):
        if i < first:  # the gradient: one per row at reduction 'none', else one scalar
            axes.append(like_input[:spec.rank])
        elif i == weight:
            axes.append((None,))
        else:
            axes.append(like_input if i == first or multilabel else like_input[:-1])
    return rows, tuple(axes), weight


def _term(call: OpCall, first: int, weight: int | None):
    """The op at reduction 'none' on every device's rows at once, as one batch of rows; its results
    `(L, *per-device shape)`: each row's loss, or a tensor shaped like the input."""
    op = generic_kernel(call.func, arg_overrides={arg_index(call.func, "reduction"): _NONE})
    x = call.specs[first]
    local = call.local_shape(x, (x.axes[0], None)[:x.rank] if x.rank == 2 else (None,))
    ranks = [s.rank for s in call.specs]

    def flat(i: int, component: torch.Tensor) -> torch.Tensor:
        if i == weight:
            return component[0]  # replicated: every device's copy is the same
        return component.reshape(-1, local[-1]) if ranks[i] == x.rank else component.reshape(-1)

    def term(locals_, args, kwargs):
        n = locals_[first].shape[0]
        out = op([flat(i, c) for i, c in enumerate(locals_)], args, kwargs)
        return tuple(o.view((n,) + (local if o.dim() == 2 else local[:-1]))
                     for o in (out if isinstance(out, tuple) else (out,)))
    return term


@register(*_ROW_LOSSES, floats_at_run_time=True)
def row_loss_rule(call: OpCall) -> Decision:
    rows, inputs, weight = _rows(call, 0)
    term, reduction = _term(call, 0, weight), arg(call, "reduction")
    multilabel = call.func in _MULTILABEL
    extra = inputs[:1] if multilabel else ()  # multilabel's is_target, laid out as the input
    count = call.specs[0].shape[0] if reduction == _MEAN and call.specs[0].rank == 2 else 1

    def kernel(l, a, k):
        out = term(l, a, k)
        loss = out[0] if reduction == _NONE else out[0].reshape(out[0].shape[0], -1).sum(1) / count
        return (loss, *out[1:]) if multilabel else loss
    if reduction == _NONE:
        return Decision(inputs, ((rows,)[:call.specs[0].rank - 1], *extra), kernel, single=not multilabel)
    return Decision(inputs, ((), *extra), kernel, reduce=(tuple(m for m in (rows,) if m), *((),) * len(extra)),
                    single=not multilabel)


@register(*_ROW_LOSSES.values(), floats_at_run_time=True)
def row_loss_backward_rule(call: OpCall) -> Decision:
    _, inputs, weight = _rows(call, 1)
    term, reduction = _term(call, 1, weight), arg(call, "reduction")
    x = call.specs[1]
    if reduction == _NONE or x.rank == 1:
        return Decision(inputs, inputs[1:2], lambda l, a, k: term(l, a, k)[0])
    scale = 1 / x.shape[0] if reduction == _MEAN else 1

    def kernel(l, a, k):
        g = l[0] * scale  # (L,): each device's copy of the scalar gradient, given to each of its rows
        per_row = g.view(-1, 1).expand(l[1].shape[:2])
        return term([per_row, *l[1:]], a, k)[0]
    return Decision(((), *inputs[1:]), inputs[1:2], kernel)
