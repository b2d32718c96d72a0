"""Ops that return Python values rather than tensors: `item()`, `torch.equal`, `is_same_size`."""

from __future__ import annotations

import torch

from spmd.rules import register
from spmd.rules.common import Decision, OpCall

aten = torch.ops.aten


@register(aten._local_scalar_dense.default)
def item_rule(call: OpCall) -> Decision:
    # a one-element tensor is replicated after gathering; every component then holds the value
    spec = call.specs[0]
    return Decision(((None,) * spec.rank,), (None,), lambda l, a, k: l[0][0].item())


@register(aten.equal.default)
def equal_rule(call: OpCall) -> Decision:
    a, b = call.specs
    same = a.shape == b.shape
    return Decision((a.axes, a.axes if same else b.axes), (None,),
                    lambda l, args, k: same and torch.equal(l[0], l[1]))


@register(aten.is_same_size.default)
def same_size_rule(call: OpCall) -> Decision:
    a, b = call.specs
    same = a.shape == b.shape
    return Decision((a.axes, b.axes), (None,), lambda l, args, k: same)


@register(aten.is_pinned.default)
def is_pinned_rule(call: OpCall) -> Decision:
    # memory metadata of the components (they share one torch device and allocator)
    spec = call.specs[0]
    return Decision((spec.axes,), (None,), lambda l, a, k: l[0].is_pinned())
