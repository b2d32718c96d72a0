"""Discrete Fourier transforms: aten's `_fft_r2c`, `_fft_c2c` and `_fft_c2r`, which every `torch.fft` function
(and `stft`) reaches.

Why the rule holds: a transform over `dim` combines all the elements along those axes and none across the
others, so each device transforms its component on its own once the transformed axes are whole on it; every
other axis keeps its sharding. The sizes that change (r2c's onesided output halves the last transformed axis,
c2r's `last_dim_size` extends it) are those of whole axes, so the op's own size arguments hold locally.
A transformed axis that was sharded gives its mesh dim to an unsharded axis of the others where one divides
evenly (one all-to-all, the transpose of a distributed FFT) rather than gathering it: the output stays sharded.
"""

from __future__ import annotations

import torch

from spmd.engine.decision import Decision, OpCall, TensorSpec
from spmd.engine.registry import register
from spmd.engine.rules.common import generic_kernel, norm_dim
from spmd.engine.rules.reduction import arg

aten = torch.ops.aten


def transformed_axes(call: OpCall, spec: TensorSpec, dims: set) -> tuple:
    """The input's axes with the transformed `dims` unsharded, their mesh dims moved to free axes that divide."""
    axes = list(spec.axes)
    moved = [axes[i] for i in sorted(dims) if axes[i] is not None]
    for i in dims:
        axes[i] = None
    for m in moved:
        free = next((j for j in range(spec.rank) if j not in dims and axes[j] is None
                     and spec.shape[j] % call.shards(m) == 0 and spec.shape[j] > 0), None)
        if free is not None:
            axes[free] = m
    return tuple(axes)


@register(aten._fft_r2c.default, aten._fft_c2c.default, aten._fft_c2r.default)
def fft_rule(call: OpCall) -> Decision:
    """The transformed axes whole on each device, the others sharded; `dim` shifted past the stack axis (in its
    order: c2r's `last_dim_size` is the size of its last entry)."""
    spec = call.specs[0]
    dim = [norm_dim(d, spec.rank) for d in arg(call, "dim")]
    axes = transformed_axes(call, spec, set(dim))
    return Decision((axes,), (axes,), generic_kernel(call.func, arg_overrides={1: [d + 1 for d in dim]}))
