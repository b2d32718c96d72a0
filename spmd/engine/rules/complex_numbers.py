"""Complex numbers as pairs of reals: the views `view_as_real`/`view_as_complex`, and the constructors `complex`
and `polar`.

Why the rules hold: `view_as_real` gives each complex element a trailing axis of its two parts, so every axis
of the input keeps its sharding and the new one, of size 2, is whole; `view_as_complex` reads that pair back,
so it needs the trailing axis whole (a relayout makes the result a copy, and the dispatcher then refuses in-place
ops on it) and drops it. Both are views of each component, so in-place writes reach the base, and they pass a
gradient's pending sum through as the other views do (a view of a sum is the sum of the views).
`complex(real, imag)` and `polar(abs, angle)` build each element from the same element of two real operands:
the pointwise rule, with its broadcasting and first-operand-wins layout, holds as it is.
"""

from __future__ import annotations

import torch

from spmd.engine.decision import Decision, OpCall
from spmd.engine.registry import register
from spmd.engine.rules.pointwise import pointwise_rule
from spmd.engine.rules.view import keeps_pending

aten = torch.ops.aten


@register(aten.view_as_real.default, multi_axis=True)  # (any axes: tuples too)
@keeps_pending
def view_as_real_rule(call: OpCall) -> Decision:
    axes = call.specs[0].axes
    return Decision((axes,), (axes + (None,),), lambda l, a, k: torch.view_as_real(l[0]))


@register(aten.view_as_complex.default, multi_axis=True)
@keeps_pending
def view_as_complex_rule(call: OpCall) -> Decision:
    axes = call.specs[0].axes[:-1]
    return Decision((axes + (None,),), (axes,), lambda l, a, k: torch.view_as_complex(l[0]))


register(aten.complex.default, aten.polar.default, floats_at_run_time=True, blockwise=True)(pointwise_rule)
