"""torch's chunked linear + cross-entropy (`F.linear_cross_entropy` with `options=`, torch ≥ 2.13): a custom op
that computes a classifier's logits a block of rows at a time, so that the `(N, C)` logits are never whole.

`_linear_cross_entropy_batch_chunked` (reduction 'sum' or 'mean') returns the loss and, computed in the same pass,
the gradients of the input, the classifier's weight and its bias. (Reduction 'none', whose backward is Python,
runs per device above autograd: spmd/chunked_losses.py.)

Why the rule holds: rows are independent, so each device runs torch's op on the rows it holds, with the
classifier (and the class weights) whole on it. A sum over rows is then each device's partial sum, left pending
over the mesh dim sharding the rows — the loss and the two parameter gradients alike; each row's input gradient
is its own. A mean is that sum divided by the total weight of the rows that count (torch divides by the same
total, the class weights of the targets not ignored): each device sums its rows' and one all-reduce of that scalar
makes it global. Label smoothing never reaches these ops (torch runs them at 0 only).
"""

from __future__ import annotations

import torch

from spmd.collectives import Collective, Kind
from spmd.engine.decision import Decision, OpCall, TensorSpec
from spmd.engine.registry import register
from spmd.engine.rules.pointwise import merge_axes

try:  # defines the ops (torch imports it only on the first chunked call)
    from torch.nn.modules import linear_cross_entropy as torch_ops
except ImportError:  # torch < 2.13
    torch_ops = None
_SCALAR = getattr(torch_ops, "_linear_cross_entropy_batch_chunked", None)


def _operand_axes(call: OpCall) -> tuple:
    """(the mesh dim of the rows or None, the axes of each DTensor operand): the input `(N, D)` and the target
    `(N,)` keep the rows' sharding (the input's first), the rest whole."""
    x, target = call.args[0], call.args[2]
    rows = merge_axes([TensorSpec(x.axes[:1], target.shape, x.dtype), target], target.shape)[0] \
        if isinstance(target, TensorSpec) else x.axes[0]
    axes = []
    for i, a in enumerate(call.args[:5]):
        if isinstance(a, TensorSpec):
            axes.append((rows, None) if i == 0 else (rows,) if i == 2 else (None,) * a.rank)
    return rows, tuple(axes)


def _operands(l: list, call: OpCall, d: int) -> list:
    """Device `d`'s components in the op's argument order (plain arguments as they are)."""
    it = iter(c[d] for c in l)
    return [next(it) if isinstance(a, TensorSpec) else a for a in call.args[:5]]


def _counted_weight(x: torch.Tensor, target: torch.Tensor, class_weight, ignore_index: int) -> torch.Tensor:
    """The total weight of the rows that count: their targets' class weights (1 without), the ignored left out."""
    keep = target != ignore_index
    if class_weight is None:
        return keep.sum().to(x.dtype)
    return (class_weight[target.clamp(min=0)] * keep).sum().to(x.dtype)


if _SCALAR is not None:
    @register(_SCALAR._opoverload)
    def chunked_loss_rule(call: OpCall) -> Decision:
        """Outputs (loss, input grad, weight grad, bias grad); a gradient not asked for is an empty `(0, 0)`."""
        rows, inputs = _operand_axes(call)
        reduction, ignore_index, rest = call.args[5], call.args[6], call.args[7:]
        wants_input, wants_weight, wants_bias = rest[-3:]
        op, n_local = _SCALAR._opoverload, call.num_local
        summed = (rows,) if rows is not None else ()
        grad_axes = (rows, None) if wants_input else (None, None)

        def per_device(l, local_reduction):
            outs = [op(*_operands(l, call, d), local_reduction, ignore_index, *rest) for d in range(n_local)]
            return [torch.stack(o) for o in zip(*outs)]

        if not summed or reduction == "sum":  # (not summed: every device holds every row, torch's op as it is)
            kernel, collectives = (lambda l, a, k: per_device(l, reduction)), ()
        else:  # mean: the partial sums divided by the total weight of every device's rows
            def kernel(l, a, k, run):
                loss, *grads = per_device(l, "sum")
                counted = []
                for d in range(n_local):
                    x, _, target, _, class_weight = _operands(l, call, d)
                    counted.append(_counted_weight(x, target, class_weight, ignore_index))
                total = run(0, torch.stack(counted))
                return [loss / total] + [g / total.view(-1, *(1,) * (g.dim() - 1)) for g in grads]
            collectives = (Collective(Kind.ALL_REDUCE, summed, op="sum"),)
        pending = (summed, (), summed if wants_weight else (), summed if wants_bias else ())
        return Decision(inputs, ((), grad_axes, (None, None), (None,)), kernel, collectives=collectives,
                        reduce=pending if summed else (), single=False)

