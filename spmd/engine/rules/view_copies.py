"""The `*_copy` variants of view ops (`permute_copy`, `view_copy`, `narrow_copy`, ...): the view's values in fresh
memory.

Why the rules hold: a copy has exactly its view's elements, so each takes its view's decision (the same input
relayouts, the same output layout) from the view's rule, and the kernel copies the view it computes. The result
is no view in torch's schema (it aliases nothing), so in-place ops on it are allowed and reach no base; the
copy is contiguous, as torch's is.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from spmd.engine.decision import Decision, OpCall
from spmd.engine.registry import lookup, register
from spmd.engine.rules.common import norm_dim
from spmd.engine.rules.reduction import arg

aten = torch.ops.aten

_VIEW_OF = {
    aten.alias_copy.default: aten.alias.default,
    aten.expand_copy.default: aten.expand.default,
    aten.permute_copy.default: aten.permute.default,
    aten.squeeze_copy.default: aten.squeeze.default,
    aten.squeeze_copy.dim: aten.squeeze.dim,
    aten.squeeze_copy.dims: aten.squeeze.dims,
    aten.t_copy.default: aten.t.default,
    aten.transpose_copy.int: aten.transpose.int,
    aten.unsqueeze_copy.default: aten.unsqueeze.default,
    aten.view_copy.default: aten.view.default,
    aten.diagonal_copy.default: aten.diagonal.default,
    aten.unfold_copy.default: aten.unfold.default,
    aten.split_copy.Tensor: aten.split.Tensor,
    aten.split_with_sizes_copy.default: aten.split_with_sizes.default,
    aten.unbind_copy.int: aten.unbind.int,
}


def _copied(decision: Decision) -> Decision:
    view = decision.kernel
    if decision.single:
        return replace(decision, kernel=lambda l, a, k: _copy(view(l, a, k)))
    return replace(decision, kernel=lambda l, a, k: tuple(_copy(t) for t in view(l, a, k)))


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


@register(*_VIEW_OF)
def view_copy_rule(call: OpCall) -> Decision:
    """The view's decision (its arguments are the copy's), with a kernel that copies."""
    view = _VIEW_OF[call.func]
    return _copied(lookup(view).rule(replace(call, func=view)))


@register(aten.narrow_copy.default)
def narrow_copy_rule(call: OpCall) -> Decision:
    """`narrow(dim, start, length)` is `slice(dim, start, start + length)` (a negative start counts from the end)."""
    spec = call.specs[0]
    dim = norm_dim(arg(call, "dim"), spec.rank)
    start, length = arg(call, "start"), arg(call, "length")
    if start < 0:
        start += spec.shape[dim]
    as_slice = replace(call, func=aten.slice.Tensor, args=(spec, dim, start, start + length, 1), kwargs={})
    return _copied(lookup(aten.slice.Tensor).rule(as_slice))
