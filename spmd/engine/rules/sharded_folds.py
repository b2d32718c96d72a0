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
gather moved and computed everything. Two sharded axes of several elements per device each (a batch of 2 rows
per device and a sharded sequence) are in no order one block per device: each is split into its shards and each
shard's elements (views), and the shards' axes go first. Where several batch axes are sharded (attention's
`[B, H]` over batch and heads), no order folds: the product is one `spmd::batched_matmul`, whose rule keeps each
batch axis. The kernels are registered once a layout that needs them exists, since they cost every call.
"""

from __future__ import annotations

import math
from typing import NamedTuple

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


def _one_block(sizes: list[int], shards: list[int]) -> bool:
    """Whether each device's part of axes of these sizes, split in these numbers of shards, is one block of their
    merged (row-major) order: past the leading axes of one element per device, at most one axis is split."""
    first = next((i for i, (s, n) in enumerate(zip(sizes, shards)) if -(-s // n) > 1), len(sizes))
    return all(n == 1 for n in shards[first + 1:])


def _fold_plan(sizes: list[int], shards: list[int], merges: list[list[int]] | None = None):
    """How to present axes of these sizes, split in these numbers of shards, that torch merges (`merges`: the
    positions merged together, in their order; default: all into one), so that each device's part is one block of
    each merge: None where it is as they come (or no presentation keeps it); else `(shape, order)`: the axes viewed
    as `shape`, then permuted by `order`. The sharded axes first where that suffices; else, with two sharded axes
    of several elements per device each in one merge (a batch of 2 rows per device and a sharded sequence), each
    sharded axis split in two, its shards then each shard's elements, the shards first."""
    merges = merges or [list(range(len(sizes)))]

    def blocks(order: list[int]) -> bool:
        return all(_one_block([sizes[i] for i in order if i in m], [shards[i] for i in order if i in m])
                   for m in merges)
    if blocks(list(range(len(sizes)))):
        return None
    order = _sharded_first([n > 1 for n in shards])
    if order is not None and blocks(order):
        return sizes, order
    if any(s % n for s, n in zip(sizes, shards)):
        return None  # (uneven shards do not split: torch's fold gathers them)
    shape, outer, inner = [], [], []
    for s, n in zip(sizes, shards):
        if n > 1:
            outer.append(len(shape))
            shape.append(n)
        inner.append(len(shape))
        shape.append(s // n)
    return shape, outer + inner


def _row_fold(t, lead: int) -> tuple[list[int], list[int]] | None:
    """`_fold_plan` of `t`'s first `lead` axes, which torch folds into the rows of one matrix product."""
    if not isinstance(t, DTensor) or lead < 2:
        return None
    return _fold_plan(list(t.shape[:lead]), [t._layout.num_shards(i) for i in range(lead)])


def _folded(t, fold, lead: int):
    """`t`'s first `lead` axes presented as `fold` (see `_fold_plan`) says; the others follow."""
    shape, order = fold
    if len(shape) != lead:
        t = t.reshape(shape + list(t.shape[lead:]))
    return t.permute(order + list(range(len(order), t.dim())))


def _unfolded(out, fold, lead_shape):
    """The product of a `_folded` operand, its lead axes back in `lead_shape` (contiguous, as torch's result)."""
    shape, order = fold
    back = out.permute(_inverse(order) + list(range(len(order), out.dim()))).contiguous()
    return back if len(shape) == len(lead_shape) else back.view(list(lead_shape) + list(out.shape[len(order):]))


def _linear(keyset, input, weight, bias=None):
    lead = input.dim() - 1
    fold = _row_fold(input, lead)
    if fold is None:
        return aten.linear.default.redispatch(below(keyset), input, weight, bias)
    return _unfolded(aten.linear.default(_folded(input, fold, lead), weight, bias), fold, input.shape[:lead])


def _matmul(keyset, a, b):
    if a.dim() >= 3 and b.dim() <= 2:  # a's leading axes fold into rows
        lead = a.dim() - 1
        fold = _row_fold(a, lead)
        if fold is not None:
            return _unfolded(aten.matmul.default(_folded(a, fold, lead), b), fold, a.shape[:lead])
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
    fold = _einsum_fold(equation, tensors)
    if fold is None:
        return aten.einsum.default.redispatch(below(keyset), equation, tensors, path=path)
    operands = [t.reshape([fold.sizes[label] for label in term]) if len(term) != t.dim() else t
                for term, t in zip(fold.terms, tensors)]
    out = aten.einsum.default(f"{','.join(fold.terms)}->{''.join(fold.output[i] for i in fold.order)}", operands,
                              path=path)
    return _unfolded(out, ([fold.sizes[label] for label in fold.output], fold.order), fold.shape)


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


class _EinsumFold(NamedTuple):
    terms: list[str]  # the operands' terms of the einsum to run
    output: str  # its output's labels
    order: list[int]  # the order of `output` it is run in: the sharded labels first
    sizes: dict[str, int]  # every label's size
    shape: list[int]  # the given einsum's output shape


def _einsum_fold(equation: str, tensors) -> _EinsumFold | None:
    """torch's einsum merges the output's labels in their order (of a pair of operands: the batch labels, then each
    operand's own; of more, taken as one merge): None where each device's part of the output is one block of those
    merges as it comes (or the equation has no explicit output, or an ellipsis); else how to run it (see
    `_fold_plan`: a split label is a new label for its shards followed by its own for each shard's elements)."""
    if "->" not in equation or "." in equation or not any(isinstance(t, DTensor) for t in tensors):
        return None
    inputs, output = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    sizes, shards = {}, {}
    for term, t in zip(terms, tensors):
        for i, label in enumerate(term):
            sizes[label] = max(sizes.get(label, 1), t.shape[i])
            if _sharded(t, i):
                shards[label] = max(shards.get(label, 1), t._layout.num_shards(i))
    shape = [sizes[label] for label in output]
    merges = None
    if len(terms) == 2:  # a pair's product merges its batch labels, then each operand's own
        merges = [[i for i, label in enumerate(output) if (label in terms[0], label in terms[1]) == where]
                  for where in ((True, True), (True, False), (False, True))]
    plan = _fold_plan(shape, [shards.get(label, 1) for label in output], merges)
    if plan is None:
        return None
    if len(plan[0]) == len(output):
        return _EinsumFold(terms, output, plan[1], sizes, shape)
    if any(t.shape[term.index(label)] != sizes[label] for label in shards for term, t in zip(terms, tensors)
           if label in term and label in output):
        return None  # (a label broadcast from size 1 does not split: torch's fold gathers)
    fresh = (label for label in _LABELS if label not in equation)
    outer = {label: next(fresh) for label in output if shards.get(label, 1) > 1}
    for label, o in outer.items():
        sizes[o], sizes[label] = shards[label], sizes[label] // shards[label]
    *terms, output = ["".join(outer.get(label, "") + label for label in term) for term in terms + [output]]
    return _EinsumFold(terms, output, plan[1], sizes, shape)


_LABELS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _register() -> None:
    register_above_autograd(aten.linear.default, _linear)
    register_above_autograd(aten.matmul.default, _matmul)
    register_above_autograd(aten.einsum.default, _einsum)


on_inner_axis_sharded(_register)  # a kernel above autograd costs each call ~10 us: only where it can matter
