"""Softmax, log-softmax and the negative log-likelihood with the class axis sharded (vocabulary parallelism).

Why the rules hold: log_softmax(x) = x - max - log(sum(exp(x - max))); the max and the sum over a sharded axis
are one all-reduce each, so every device keeps its block of classes and the logits are never gathered. The
target's log-probability lives on one device; masked local picks summed over the class mesh dim give it to all.
Without a sharded class axis these ops use the rules of `reduction` and `nn`.
"""

from __future__ import annotations

import torch

from spmd.collectives import Collective, Kind
from spmd.engine.registry import register
from spmd.engine.decision import Decision, OpCall
from spmd.engine.rules.common import check_in_range, raise_if_kernel_refuses, shard_starts
from spmd.engine.rules.nn import nll_loss_backward_rule, nll_loss_rule
from spmd.engine.rules.reduction import scan_rule, softmax_backward_rule

aten = torch.ops.aten
_NONE, _MEAN = 0, 1


def _class_dim(call: OpCall, dim) -> tuple[int, str | None]:
    spec = call.specs[0]
    d = dim % spec.rank if spec.rank else 0
    return d, (spec.axes[d] if spec.rank else None)


@register(aten._log_softmax.default, aten._softmax.default, blockwise=True)
def softmax_rule(call: OpCall) -> Decision:
    d, m = _class_dim(call, call.args[1])
    spec = call.specs[0]
    if m is None or spec.shape[d] == 0:
        return scan_rule(call)
    if not spec.dtype.is_floating_point:  # (an integer dtype= of F.softmax casts the input first)
        raise_if_kernel_refuses(call.func, spec.dtype, spec.rank, 0, False)
    axes, log = spec.axes, call.func is aten._log_softmax.default

    def kernel(l, a, k, run):
        x = l[0].float() if a[2] else l[0]  # half_to_float
        z = x - run(0, x.amax(d + 1, keepdim=True))
        total = run(1, z.exp().sum(d + 1, keepdim=True))
        return z - total.log() if log else z.exp() / total
    return Decision((axes,), (axes,), kernel, collectives=(_all_reduce(m, "max"), _all_reduce(m, "sum")))


@register(aten._log_softmax_backward_data.default, aten._softmax_backward_data.default, blockwise=True)
def softmax_backward(call: OpCall) -> Decision:
    d, m = _class_dim(call, call.args[2])
    if m is None:
        return softmax_backward_rule(call)
    axes, log = call.specs[0].axes, call.func is aten._log_softmax_backward_data.default

    def kernel(l, a, k, run):
        grad, out = l
        if log:  # d/dx of log_softmax: grad - softmax * sum(grad)
            return grad - out.exp() * run(0, grad.sum(d + 1, keepdim=True))
        return out * (grad - run(0, (grad * out).sum(d + 1, keepdim=True)))
    return Decision((axes, axes), (axes,), kernel, collectives=(_all_reduce(m, "sum"),))


def _nll_layout(call: OpCall):
    x, target = call.specs[0], call.specs[1]
    m = x.axes[-1]
    batch = x.axes[0] if x.rank == 2 and target.axes[0] in (x.axes[0], None) else None
    return m, batch, (batch, m) if x.rank == 2 else (m,), (batch,) if x.rank == 2 else ()


@register(aten.nll_loss_forward.default, blockwise=True)
def nll_rule(call: OpCall) -> Decision:
    x = call.specs[0]
    m, batch, x_axes, t_axes = _nll_layout(call)
    if m is None:
        return nll_loss_rule(call)
    weight, reduction, ignore_index = call.args[2:5]
    n_local = call.num_local
    block = x.shape[-1] // call.shards(m)
    starts = shard_starts(call, m, block, len(t_axes))
    classes = x.shape[-1]

    def kernel(l, a, k, run):
        xl, t = l[0], l[1]
        check_in_range(t, classes, IndexError, "Target {} is out of bounds.", ignored=ignore_index)
        w = l[2][0] if weight is not None else None
        xl = xl.view(n_local, -1, block)  # (L, N, C/k)
        t = t.view(n_local, -1)
        local_t = t - starts(t).view(n_local, 1)
        inside = (local_t >= 0) & (local_t < block)
        picked = xl.gather(2, local_t.clamp(0, block - 1).unsqueeze(-1)).squeeze(-1) * inside
        picked = run(0, picked)  # every device now has logp[target] of its rows
        keep = t != ignore_index
        row_w = (w[t.clamp(min=0)] if w is not None else torch.ones_like(picked)) * keep
        per_row = -picked * row_w
        if reduction == _NONE:
            return per_row.view(l[1].shape), xl.new_zeros(n_local)
        return per_row.sum(1), row_w.sum(1)
    reduced = (batch,) if batch is not None and reduction != _NONE else ()
    inputs = (x_axes, t_axes) + (((None,),) if weight is not None else ())
    return Decision(inputs, (t_axes if reduction == _NONE else (), ()), kernel, collectives=(_all_reduce(m, "sum"),),
                    reduce=(reduced, reduced) if reduced else (), single=False, fixed=(m,),
                    epilogue=(lambda outs, l, a, k: [outs[0] / outs[1], outs[1]]) if reduction == _MEAN else None)


@register(aten.nll_loss_backward.default, blockwise=True)
def nll_backward_rule(call: OpCall) -> Decision:
    x = call.specs[1]
    call_x = OpCall(call.func, call.args[1:], call.kwargs, call.mesh, call.num_local)
    m, batch, x_axes, t_axes = _nll_layout(call_x)
    if m is None:
        return nll_loss_backward_rule(call)
    weight, reduction, ignore_index = call.args[3:6]
    n_local = call.num_local
    block = x.shape[-1] // call.shards(m)
    starts = shard_starts(call, m, block, 1)
    g_axes = t_axes if reduction == _NONE else ()

    def kernel(l, a, k):
        g, xl, t = l[0], l[1], l[2]
        w = l[3][0] if weight is not None else None
        total = l[-1]
        t = t.view(n_local, -1)
        local_t = t - starts(t)
        inside = (local_t >= 0) & (local_t < block) & (t != ignore_index)
        scale = -(w[t.clamp(min=0)] if w is not None else torch.ones(t.shape, dtype=xl.dtype, device=xl.device))
        if reduction == _NONE:
            scale = scale * g.view(n_local, -1)
        else:
            scale = scale * g.view(n_local, 1)
            if reduction == _MEAN:
                scale = scale / total.view(n_local, 1)
        out = torch.zeros((n_local, t.shape[1], block), dtype=xl.dtype, device=xl.device)
        out.scatter_(2, local_t.clamp(0, block - 1).unsqueeze(-1), (scale * inside).unsqueeze(-1).to(xl.dtype))
        return out.view(xl.shape)
    inputs = (g_axes, x_axes, t_axes) + (((None,),) if weight is not None else ()) + ((),)
    return Decision(inputs, (x_axes,), kernel, fixed=(m,))


def _all_reduce(mesh_dim: str, op: str) -> Collective:
    return Collective(Kind.ALL_REDUCE, (mesh_dim,), op=op)
