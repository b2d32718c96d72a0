"""Ops that return Python values rather than tensors (`item()`, `torch.equal`, `is_same_size`), and spmd's own
`relayout` op."""

from __future__ import annotations

import torch

from spmd.collectives import Collective, Kind
from spmd.engine import planner
from spmd.ops import parse_layout
from spmd.engine.registry import register
from spmd.engine.decision import Decision, OpCall, unsupported
from spmd.layout import axis_dims

aten = torch.ops.aten


@register(aten._local_scalar_dense.default)
def item_rule(call: OpCall) -> Decision:
    # a one-element tensor is replicated after gathering; every component then holds the value
    spec = call.specs[0]
    return Decision(((None,) * spec.rank,), (None,), lambda l, a, k: l[0][0].item())


@register(aten.equal.default, aten.allclose.default)
def comparison_rule(call: OpCall) -> Decision:
    """`torch.equal` / `torch.allclose` of two tensors of one shape: each device compares its blocks (the second
    operand relayouted to the first's layout), and where the blocks differ over mesh dims one all-reduce (min) of
    the devices' verdicts gives every device, and every client, the verdict on the whole tensors. (Shapes that
    differ: equal is False at once; allclose broadcasts, on the replicated values.)"""
    a, b = call.specs
    compare = torch.equal if call.func is aten.equal.default else torch.allclose
    if a.shape != b.shape:
        if compare is torch.equal:
            return Decision((a.axes, b.axes), (None,), lambda l, args, k: False)
        whole = ((None,) * a.rank, (None,) * b.rank)
        return Decision(whole, (None,), lambda l, args, k: compare(l[0][0], l[1][0], *args[2:], **k))
    sharding = {d for m in a.axes if m is not None for d in axis_dims(m)}
    spread = tuple(d for d in call.mesh.dim_names if d in sharding)

    def verdicts(l, args, k):
        return torch.tensor([compare(x, y, *args[2:], **k) for x, y in zip(l[0], l[1])], dtype=torch.int32)
    if not spread:
        return Decision((a.axes, a.axes), (None,), lambda l, args, k: bool(verdicts(l, args, k).all()))
    return Decision((a.axes, a.axes), (None,), lambda l, args, k, run: bool(run(0, verdicts(l, args, k)).min()),
                    collectives=(Collective(Kind.ALL_REDUCE, spread, op="min"),))


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
    kernel = (lambda l, a, k: l[0]) if moved else (lambda l, a, k: l[0].clone())
    if spec.gradient and spec.pending and not set(spec.pending) & set(layout.sharded_mesh_dims):
        # a gradient's sum over mesh dims that the target does not shard stays pending (the steps over the other
        # mesh dims commute with it): reduced once where the gradient is read (in DDP-like buckets across clients,
        # once per accumulation), not at each relayout on its way to the leaf
        return Decision((target,), (target,), kernel, keeps=(0,), reduce=(spec.pending,))
    return Decision((target,), (target,), kernel)
