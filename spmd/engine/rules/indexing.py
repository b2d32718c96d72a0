"""Ops that address elements by index tensors or masks: `index_fill`, flat indexing (`take`, `put`), masked
scatters and the masked gather of upsampling's decompositions (`_unsafe_masked_index`).

Why the rules hold: an index along one dim addresses the whole of that axis, so it is whole on each device while
the other axes keep their sharding (`index_fill`, like `index_select` in `view`). A flat index addresses the whole
tensor: `take` reads a replicated tensor at each device's block of indices, so the indices (and the result) stay
sharded. A masked scatter consumes its source in the order of the whole mask, and `put` and the masked index ops
write wherever their indices point: their operands are replicated, and each device computes its (whole) component.
"""

from __future__ import annotations

import torch

from spmd.engine.registry import register
from spmd.engine.decision import Decision, OpCall
from spmd.engine.rules.common import generic_kernel, norm_dim, replace_tensors, zero_d_as_one_element
from spmd.engine.rules.reduction import arg

aten = torch.ops.aten


@register(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
@zero_d_as_one_element
def index_fill_rule(call: OpCall) -> Decision:
    """Fills the slices at replicated indices along `dim` (whole on each device); other axes keep their sharding.
    A tensor value is 0-d, the same on every device."""
    spec, index = call.specs[:2]
    dim = norm_dim(arg(call, "dim"), spec.rank)
    axes = tuple(None if i == dim else m for i, m in enumerate(spec.axes))
    value_axes = tuple((None,) * s.rank for s in call.specs[2:])

    def kernel(locals_, args, kwargs):
        value = locals_[2] if len(locals_) > 2 else args[3]
        if isinstance(value, torch.Tensor):  # stacked components (or a plain 0-d tensor): one element each
            value = value.reshape(-1)[0]
        return call.func(locals_[0], dim + 1, locals_[1][0].reshape(-1), value)
    return Decision((axes, (None,) * index.rank) + value_axes, (axes,), kernel)


@register(aten.take.default)
def take_rule(call: OpCall) -> Decision:
    """`self` replicated; each device reads it at its block of the (sharded) indices."""
    spec, index = call.specs
    return Decision(((None,) * spec.rank, index.axes), (index.axes,), lambda l, a, k: torch.take(l[0][0], l[1]))


@register(aten.put.default, aten.masked_scatter.default, aten.masked_scatter_backward.default,
          aten._unsafe_masked_index.default, aten._unsafe_masked_index_put_accumulate.default)
def whole_rule(call: OpCall) -> Decision:
    """Operands replicated; each device runs the op on its own (whole) components."""
    metas = [torch.empty(s.shape, dtype=s.dtype, device="meta") for s in call.specs]
    meta_args, meta_kwargs = replace_tensors(call.args, call.kwargs, metas)
    out_rank = call.func(*meta_args, **meta_kwargs).dim()
    local = generic_kernel(call.func)

    def kernel(locals_, args, kwargs):
        return torch.stack([local([x[j] for x in locals_], args, kwargs) for j in range(call.num_local)])
    return Decision(tuple((None,) * s.rank for s in call.specs), ((None,) * out_rank,), kernel)
