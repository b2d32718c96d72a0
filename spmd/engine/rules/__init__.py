"""Sharding rules, one module per algebraic family, and the table that finds the rule of an op.

A rule is registered for aten overloads with `@register(aten.op.overload, ...)` (or a whole packet).
Pointwise ops need no registration: ops carrying `torch.Tag.pointwise` use the pointwise rule.
"""

from __future__ import annotations

import torch

_RULES: dict = {}


def register(*ops):
    """Registers the decorated rule for each aten overload (a packet registers all its overloads)."""
    def deco(rule):
        for op in ops:
            if isinstance(op, torch._ops.OpOverloadPacket):
                for name in op.overloads():
                    _RULES[getattr(op, name)] = rule
            else:
                _RULES[op] = rule
        return rule
    return deco


def lookup(func):
    """The rule for `func`, or None (the dispatcher then tries a replicated fallback or raises)."""
    rule = _RULES.get(func)
    if rule is None and (torch.Tag.pointwise in func.tags or _pointwise_family(func)):
        from spmd.engine.rules.pointwise import pointwise_rule
        rule = _RULES[func] = pointwise_rule
    return rule


def _pointwise_family(func) -> bool:
    """Untagged ops of the pointwise family: in-place overloads of pointwise ops (`masked_fill_.Scalar`) and the
    gradients of elementwise maps with one output (`softplus_backward`: the derivative is elementwise too)."""
    name = func._schema.name.split("::")[-1]
    if name.endswith("_"):
        packet = getattr(torch.ops.aten, name[:-1], None)
        functional = getattr(packet, func._overloadname, None) if packet is not None else None
        return functional is not None and torch.Tag.pointwise in functional.tags
    if name.endswith("_backward") and len(func._schema.returns) == 1:
        forward = getattr(torch.ops.aten, name[:-len("_backward")], None)
        return forward is not None and any(torch.Tag.pointwise in getattr(forward, o).tags
                                           for o in forward.overloads())
    return False


def registered_ops() -> list:
    return sorted(_RULES, key=str)


from spmd.engine.rules import contraction, loss, nn, pointwise, random_ops, reduction, tensor_ops, view  # noqa: E402,F401
from spmd.engine.rules import vocab_parallel  # noqa: E402,F401  (after nn/reduction: overrides their rules)
