"""Elementwise ops outside the pointwise family: ops that are elementwise except for one axis or one operand.

Why the rules hold: each output element still depends on the elements at its own position (after broadcasting),
so every axis may stay sharded, except where the op reads more than one position:
- an axis the op splits or normalises whole (`glu` halves its `dim`; `renorm` scales each slice along `dim` by
  the norm of the slice, which spans every other axis; `searchsorted` searches the last axis of its sequence)
  must be whole on each device (`cross` mixes the 3 components along its `dim`);
- an operand read whole by every element (`isin`'s test set, `bucketize`'s boundaries, a 1-D sorted sequence)
  is replicated, and each device reads one copy of it;
- a 0-d value (`masked_fill`'s, `fill`'s) is replicated (as every 0-d DTensor), read as one number.
"""

from __future__ import annotations

import torch

from spmd.engine.registry import register
from spmd.engine.decision import Decision, OpCall, TensorSpec
from spmd.engine.rules.common import broadcast_view, generic_kernel
from spmd.engine.rules.pointwise import aligned_inputs, broadcast_shape, is_inplace, merge_axes, pointwise_rule
from spmd.engine.rules.reduction import arg, arg_index

aten = torch.ops.aten


@register(aten.log_sigmoid_forward.default, aten.log_sigmoid_backward.default, blockwise=True)
def log_sigmoid_rule(call: OpCall) -> Decision:
    """torch's CPU kernel returns a buffer shaped like the input (elementwise, read back by the backward); the
    CUDA kernel's is empty (0 elements): it is replicated, and the backward passes it on as it is."""
    if call.func is aten.log_sigmoid_backward.default:
        grad, x, buffer = call.specs
        if buffer.shape == x.shape:
            return pointwise_rule(call)
        shape = broadcast_shape([grad.shape, x.shape])
        axes = merge_axes([grad, x], shape)
        inputs, pads = aligned_inputs([grad, x], axes, shape)

        def backward(l, a, k):
            g, xl = map(broadcast_view, l, pads)
            return call.func(g, xl, l[2][0])
        return Decision(inputs + ((None,),), (axes,), backward)
    axes = call.specs[0].axes
    if call.mesh.torch_device.type != "cuda":
        return Decision((axes,), (axes, axes), generic_kernel(call.func), single=False)

    def kernel(l, a, k):
        out, buffer = call.func(l[0])
        return out, buffer.expand(l[0].shape[0], *buffer.shape).contiguous()
    return Decision((axes,), (axes, (None,)), kernel, single=False)


@register(aten.glu.default, aten.glu_backward.default)
def glu_rule(call: OpCall) -> Decision:
    """glu splits its `dim` in halves (a value half and a gate half): that axis is whole on each device; every
    other axis keeps its sharding (the gradient's, of half the size, is laid out alike)."""
    x = call.specs[-1]
    dim = arg(call, "dim") % x.rank
    axes = tuple(None if i == dim else m for i, m in enumerate(x.axes))
    kernel = generic_kernel(call.func, arg_overrides={arg_index(call.func, "dim"): dim + 1})
    return Decision((axes,) * len(call.specs), (axes,), kernel)


@register(aten.renorm.default)
def renorm_rule(call: OpCall) -> Decision:
    """Each slice along `dim` is scaled by its own norm, over every other axis: those axes are whole on each
    device, `dim` keeps its sharding. The kernel runs torch's renorm on the slices as rows, so the stack axis
    never joins a norm."""
    x = call.specs[0]
    dim = arg(call, "dim") % x.rank
    axes = tuple(m if i == dim else None for i, m in enumerate(x.axes))

    def kernel(l, a, k):
        slices = l[0].movedim(dim + 1, 1)  # (L, slices, rest...)
        rows = aten.renorm.default(slices.reshape(slices.shape[0] * slices.shape[1], -1), a[1], 0, a[3])
        return rows.view(slices.shape).movedim(1, dim + 1).contiguous()
    return Decision((axes,), (axes,), kernel)


@register(aten.masked_fill.Tensor, aten.masked_fill_.Tensor, aten.fill.Tensor, blockwise=True)
def zero_d_value_rule(call: OpCall) -> Decision:
    """Elementwise in the other operands; the 0-d value (the last tensor) is read as one number: each device
    passes its replica (a plain 0-d value is passed as it is, as by the pointwise rule)."""
    value = arg(call, "value")
    if not isinstance(value, TensorSpec):
        return pointwise_rule(call)
    operands = call.specs[:-1]
    shape = operands[0].shape if is_inplace(call.func) else broadcast_shape([s.shape for s in operands])
    axes = operands[0].axes if is_inplace(call.func) else merge_axes(operands, shape)
    inputs, pads = aligned_inputs(operands, axes, shape)

    def kernel(l, a, k):
        return call.func(*map(broadcast_view, l[:-1], pads), l[-1][0])
    return Decision(inputs + ((),), (axes,), kernel, inplace=is_inplace(call.func))


@register(aten.linalg_cross.default)
def cross_rule(call: OpCall) -> Decision:
    """Pointwise over the broadcast operands, except the `dim` of 3 components each cross product mixes: that
    axis is whole on each device."""
    shape = broadcast_shape([s.shape for s in call.specs])
    dim = arg(call, "dim", -1) % len(shape)
    axes = tuple(None if i == dim else m for i, m in enumerate(merge_axes(call.specs, shape)))
    inputs, pads = aligned_inputs(call.specs, axes, shape)

    def kernel(l, a, k):
        return aten.linalg_cross.default(*map(broadcast_view, l, pads), dim=dim + 1)
    return Decision(inputs, (axes,), kernel)


# -- lookups in a whole table ----------------------------------------------------------------------------------------
def _lookup(call: OpCall, values: str, table_axes) -> Decision:
    """The op looks each element of `values` up in the other tensors (its table, the table's sorter), laid out
    `table_axes` each: `None` replicated (every device reads its own replica), else those axes (a batched
    table, kept stacked). The output is laid out like `values` (a plain 0-d `values`: replicated)."""
    element = arg(call, values)
    stacked = isinstance(element, TensorSpec)
    inputs = tuple(element.axes if s is element else table_axes or (None,) * s.rank for s in call.specs)
    inner = generic_kernel(call.func)
    whole = [s is not element and table_axes is None for s in call.specs]
    n_local = call.num_local

    def kernel(l, a, k):
        out = inner([t[0] if w else t for t, w in zip(l, whole)], a, k)
        return out if stacked else out.expand(n_local, *out.shape).contiguous()
    return Decision(inputs, (element.axes if stacked else (),), kernel)


@register(aten.isin.Tensor_Tensor)
def isin_rule(call: OpCall) -> Decision:
    return _lookup(call, "elements", None)


@register(aten.bucketize.Tensor)
def bucketize_rule(call: OpCall) -> Decision:
    return _lookup(call, "self", None)


@register(aten.searchsorted.Tensor)
def searchsorted_rule(call: OpCall) -> Decision:
    """A 1-D sorted sequence is a table read whole; a batched one (`(*batch, K)` against values `(*batch, M)`)
    is searched per batch: its batch axes follow the values', its sorted axis is whole."""
    sequence, values = arg(call, "sorted_sequence"), arg(call, "self")
    if sequence.rank == 1:
        return _lookup(call, "self", None)
    return _lookup(call, "self", values.axes[:-1] + (None,))
