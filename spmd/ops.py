"""spmd's own operators, so that a traced program records them like any aten op.

`spmd::relayout(Tensor x, str layout)` is `relayout` within a mesh. Under `torch.compile` Dynamo puts it in the
graph as an opaque op with a string argument (the layout in TF's format); AOTAutograd then dispatches it to the
DTensor, whose rule (engine/rules/tensor_ops.py) plans the collectives. Its gradient is the relayout back.
"""

from __future__ import annotations

import functools

import torch

from spmd.layout import Layout


@functools.lru_cache(maxsize=1024)
def parse_layout(layout_str: str) -> Layout:
    return Layout.from_string(layout_str)


@torch.library.custom_op("spmd::relayout", mutates_args=())
def relayout_op(x: torch.Tensor, layout: str) -> torch.Tensor:
    # reached only by a plain tensor (a DTensor is handled by its rule): it has no layout to change
    return x.clone()


@relayout_op.register_fake
def _(x, layout):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    ctx.source = getattr(inputs[0], "_layout", None)


def _backward(ctx, grad):
    if ctx.source is None or getattr(grad, "_layout", None) == ctx.source:
        return grad, None
    return relayout_op(grad, ctx.source.to_string()), None


relayout_op.register_autograd(_backward, setup_context=_setup_context)
