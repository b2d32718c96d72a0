"""Fused inference kernels of whole layers: `nn.MultiheadAttention`'s and `nn.TransformerEncoderLayer`'s fast
paths (taken in evaluation under no_grad, batch first).

Each row of the batch is computed on its own, so the batch axis keeps its sharding and the kernel runs once on
every device's rows together; the weights are whole on each device. Their masks are the layers' merged ones
(`MultiheadAttention.merge_masks`): mask type 1 (key padding, [B, S]) and 2 ([B, H, L, S]) lead with the batch
axis and are sharded like it; mask type 0 ([L, S]) is whole.
"""

from __future__ import annotations

import torch

from spmd.engine.registry import register
from spmd.engine.decision import Decision, OpCall
from spmd.engine.rules.common import named_tensors, replace_tensors
from spmd.engine.rules.reduction import arg

aten = torch.ops.aten

_ROWS = {"query", "key", "value", "src"}  # [B, L, E] operands
_BATCHED_MASKS = (1, 2)


@register(aten._native_multi_head_attention.default, aten._transformer_encoder_layer_fwd.default, blockwise=True)
def fused_layer_rule(call: OpCall) -> Decision:
    named = named_tensors(call)
    batched = {n for n, _ in named if n in _ROWS}
    if arg(call, "mask_type") in _BATCHED_MASKS:
        batched.add("mask")
    batch = next((s.axes[0] for n, s in named if n in batched and s.axes[0] is not None), None)
    required = tuple((batch,) + (None,) * (s.rank - 1) if n in batched else (None,) * s.rank for n, s in named)
    if call.func is aten._transformer_encoder_layer_fwd.default:
        outputs = ((batch, None, None),)
    else:  # the attention weights: [B, L, S] averaged over heads, [B, H, L, S], or none (need_weights=False)
        heads = () if arg(call, "average_attn_weights", True) else (None,)
        outputs = ((batch, None, None), (batch, None, None) + heads if arg(call, "need_weights", True) else None)
    rows = [n in batched for n, _ in named]

    def kernel(l, a, k):
        stack, b = l[0].shape[:2]
        args, kwargs = replace_tensors(a, k, [x.flatten(0, 1) if row else x[0] for x, row in zip(l, rows)])
        out = call.func(*args, **kwargs)
        if len(outputs) == 1:
            return out.unflatten(0, (stack, b))
        return tuple(None if axes is None else o.unflatten(0, (stack, b)) for o, axes in zip(out, outputs))
    return Decision(required, outputs, kernel, single=len(outputs) == 1)
