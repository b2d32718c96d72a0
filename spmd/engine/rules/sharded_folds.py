"""Contractions that torch folds into one matrix product: `linear` and `matmul` of a rank >= 3 input, and
`einsum`, merge several axes into one (`[S, B, E]` -> `[S*B, E]`, a batch `[B, H]` -> `[B*H]`) before `mm`/`bmm`.

A merged axis is block-sharded only where the sharded axes lead: merging `[S, B]` with B sharded and S whole gives
each device every S-th run of rows, which no layout describes, so the view would gather the whole tensor (and every
device would compute the whole product). Sequence-first activations with a sharded batch, sequence-parallel rows,
attention with sharded heads and a whole batch all meet it. These composite ops are decomposed by torch above
`__torch_dispatch__` (CompositeImplicitAutograd), so spmd takes them first (engine/rules/host_values.py's
`register_above_autograd`): where a sharded axis follows a whole one among the axes torch merges, it moves the
sharded axes first (a view), lets torch fold that, and moves the result's axes back — no collective; torch then
copies the permuted input to fold it and the result back to torch's contiguous order, local copies where the
gather moved and computed everything. Where several batch axes are sharded (attention's `[B, H]` over batch and
heads), no order folds: the product is one `spmd::batched_matmul`, whose rule keeps each batch axis. The kernels
are registered once a layout that needs them exists, since they cost every call.
"""

from __future__ import annotations

import math

import torch

from spmd.dtensor import DTensor
from spmd.engine.rules.host_values import below, register_above_autograd
from spmd.layout import on_inner_axis_sharded
from spmd.ops import batched_matmul

aten = torch.ops.aten


def _sharded(t, axis: int) -> bool:
    return isinstance(t, DTensor) and axis >= 0 and t._layout.num_shards(axis) > 1


def _sharded_first(sharded: list[bool]) -> list[int] | None:
    """The order that puts the sharded axes of a group that torch merges first (stable), or None if they lead."""
    order = [i for i, s in enumerate(sharded) if s] + [i for i, s in enumerate(sharded) if not s]
    return None if order == sorted(order) else order


def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, axis in enumerate(order):
        inverse[axis] = position
    return inverse


def _lead_order(t, lead: int) -> list[int] | None:
    """The order of `t`'s first `lead` axes (those torch folds into rows) that puts its sharded ones first."""
    return _sharded_first([_sharded(t, i) for i in range(lead)]) if isinstance(t, DTensor) and lead > 1 else None


def _linear(keyset, input, weight, bias=None):
    order = _lead_order(input, input.dim() - 1)
    if order is None:
        return aten.linear.default.redispatch(below(keyset), input, weight, bias)
    out = aten.linear.default(input.permute(order + [input.dim() - 1]), weight, bias)
    return out.permute(_inverse(order) + [out.dim() - 1]).contiguous()  # (torch's result is contiguous)


def _matmul(keyset, a, b):
    if a.dim() >= 3 and b.dim() <= 2:  # a's leading axes fold into rows
        order = _lead_order(a, a.dim() - 1)
        if order is not None:
            out = aten.matmul.default(a.permute(order + [a.dim() - 1]), b)
            return out.permute(_inverse(order) + list(range(len(order), out.dim()))).contiguous()
    elif a.dim() >= 3 and b.dim() >= 3:  # batched: the broadcast batch axes fold into one
        if a.shape[:-2] == b.shape[:-2] and _several_sharded(a, b):  # no fold can keep them: one op over them all
            return batched_matmul(a, b)
        rank = max(a.dim(), b.dim())
        order = _sharded_first([_sharded(a, i + a.dim() - rank) or _sharded(b, i + b.dim() - rank)
                                for i in range(rank - 2)])
        if order is not None:
            a, b = (x.reshape((1,) * (rank - x.dim()) + tuple(x.shape)) for x in (a, b))  # broadcast ranks alike
            tail = [rank - 2, rank - 1]
            out = aten.matmul.default(a.permute(order + tail), b.permute(order + tail))
            return out.permute(_inverse(order) + tail).contiguous()
    return aten.matmul.default.redispatch(below(keyset), a, b)


def _several_sharded(a, b) -> bool:
    """Whether more than one batch axis of `a` or `b` (of one batch shape) is sharded."""
    return sum(_sharded(a, i) or _sharded(b, i) for i in range(a.dim() - 2)) > 1


def _einsum(keyset, equation, tensors, *, path=None):
    pair = _sharded_batch_pair(equation, tensors)
    if pair is not None:
        return _einsum_as_batched_matmul(*pair, *tensors)
    output_order = _einsum_output_order(equation, tensors)
    if output_order is None:
        return aten.einsum.default.redispatch(below(keyset), equation, tensors, path=path)
    inputs, output = equation.replace(" ", "").split("->")
    out = aten.einsum.default(f"{inputs}->{''.join(output[i] for i in output_order)}", tensors, path=path)
    return out.permute(_inverse(output_order)).contiguous()


def _sharded_batch_pair(equation: str, tensors):
    """(a's labels, b's labels, the output's) of a two-operand einsum whose batch labels (in both operands and the
    output) are sharded more than once, which no fold keeps; None for any other einsum (or one with an ellipsis, an
    implicit output, a label repeated in a term, or a label summed within one operand)."""
    if len(tensors) != 2 or "->" not in equation or "." in equation:
        return None
    (a, b), out = equation.replace(" ", "").split("->")[0].split(","), equation.replace(" ", "").split("->")[1]
    if any(len(set(t)) != len(t) for t in (a, b, out)) or any(l not in b and l not in out for l in a) or \
            any(l not in a and l not in out for l in b):
        return None
    batch = [l for l in out if l in a and l in b]
    sharded = sum(_sharded(tensors[0], a.index(l)) or _sharded(tensors[1], b.index(l)) for l in batch)
    return (a, b, out) if sharded > 1 else None


def _einsum_as_batched_matmul(a: str, b: str, out: str, x, y):
    """The einsum as one `spmd::batched_matmul` over its batch labels: each operand's own labels and the contracted
    ones are folded into one matrix axis each (whole axes, in the usual case of sharded batch labels)."""
    batch = [l for l in out if l in a and l in b]
    rows, cols, summed = [l for l in out if l not in b], [l for l in out if l not in a], [l for l in a if l not in out]
    sizes = {**dict(zip(a, x.shape)), **dict(zip(b, y.shape))}
    lead = [sizes[l] for l in batch]
    left = x.permute([a.index(l) for l in batch + rows + summed]).reshape(
        lead + [math.prod(sizes[l] for l in rows), math.prod(sizes[l] for l in summed)])
    right = y.permute([b.index(l) for l in batch + summed + cols]).reshape(
        lead + [math.prod(sizes[l] for l in summed), math.prod(sizes[l] for l in cols)])
    product = batched_matmul(left, right).reshape(lead + [sizes[l] for l in rows + cols])
    return product.permute([(batch + rows + cols).index(l) for l in out])  # (strides as torch's einsum gives)


def _einsum_output_order(equation: str, tensors) -> list[int] | None:
    """torch's einsum merges the output's labels in their order (batch labels, then each operand's own): an
    output order with the sharded labels first, or None if they lead (or the equation has no explicit output, or
    an ellipsis)."""
    if "->" not in equation or "." in equation or not any(isinstance(t, DTensor) for t in tensors):
        return None
    inputs, output = equation.replace(" ", "").split("->")
    sharded = {label for operand, t in zip(inputs.split(","), tensors) if isinstance(t, DTensor)
               for i, label in enumerate(operand) if _sharded(t, i)}
    return _sharded_first([label in sharded for label in output])


def _register() -> None:
    register_above_autograd(aten.linear.default, _linear)
    register_above_autograd(aten.matmul.default, _matmul)
    register_above_autograd(aten.einsum.default, _einsum)


on_inner_axis_sharded(_register)  # a kernel above autograd costs each call ~10 us: only where it can matter
