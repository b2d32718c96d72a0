"""Ops that return Python values rather than tensors (`item()`, `torch.equal`, `is_same_size`), and spmd's own
`relayout` op."""

from __future__ import annotations

import torch

from spmd.engine import planner
from spmd.ops import parse_layout
from spmd.engine.registry import register
from spmd.engine.decision import Decision, OpCall, unsupported

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


@register(aten._linalg_check_errors.default)
def check_errors_rule(call: OpCall) -> Decision:
    """linalg's check of its info codes (returns nothing): each component's codes are checked where they are."""
    def kernel(locals_, args, kwargs):
        for info in locals_[0]:  # each device's codes (the check reads a matrix's code as a scalar)
            call.func(info, *args[1:], **kwargs)
    return Decision((call.specs[0].axes,), (None,), kernel)


@register(aten._assert_async.default, aten._assert_async.msg)
def assert_rule(call: OpCall) -> Decision:
    """A check of a tensor's value that returns nothing (F.one_hot's, while traced): on every device's value."""
    spec = call.specs[0]
    return Decision(((None,) * spec.rank,), (None,), lambda l, args, k: call.func(l[0].all(), *args[1:], **k))


@register(torch.ops.spmd.relayout.default)
def relayout_rule(call: OpCall) -> Decision:
    """`spmd::relayout`: the input is relayouted to the target layout by the dispatcher's planner; the kernel
    only copies when the planner had nothing to move (collectives already return fresh memory)."""
    spec = call.specs[0]
    layout = parse_layout(call.args[1])
    if layout.mesh != call.mesh:
        raise unsupported(call, f"the target layout is on another mesh ({layout.mesh!r}); move a tensor between "
                                "meshes outside the compiled function")
    target = layout.axes
    moved = planner.plan_on(call.mesh, spec.axes, target)
    return Decision((target,), (target,), (lambda l, a, k: l[0]) if moved else (lambda l, a, k: l[0].clone()))
