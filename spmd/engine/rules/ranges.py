"""`linspace` and `logspace` with tensor endpoints (`.Tensor_Tensor`, `.Tensor_Scalar`, `.Scalar_Tensor`).

Why the rule holds: an endpoint is a 0-d tensor, replicated on every device (as every 0-d DTensor), so every
device computes the whole range from its replica: the result is replicated, with no collective.
"""

from __future__ import annotations

import torch

from spmd.engine.decision import Decision, OpCall
from spmd.engine.registry import register
from spmd.engine.rules.common import replace_tensors

aten = torch.ops.aten

_RANGES = [getattr(getattr(aten, name), overload) for name in ("linspace", "logspace")
           for overload in ("Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor")]


@register(*_RANGES)
def range_rule(call: OpCall) -> Decision:
    n_local = call.num_local

    def kernel(l, a, k):
        args, kwargs = replace_tensors(a, k, [t[0] for t in l])  # each endpoint: this process' first replica
        out = call.func(*args, **kwargs)
        return out.expand(n_local, *out.shape).contiguous()
    return Decision(tuple(() for _ in call.specs), ((None,),), kernel)
