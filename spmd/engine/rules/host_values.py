"""Composite ops whose torch implementation reads tensor values on the host or makes its result from scratch
(circular padding writes into a fresh tensor of its own), and torch's question whether a tensor can become a nested
tensor.

Why not a rule: the composite ops are CompositeImplicitAutograd, so torch decomposes them in C++ at the autograd
key, before `__torch_dispatch__` could see them; the question returns a bool, which a rule cannot. `tensor_split`
with a tensor of indices reads the indices' memory (a DTensor's wrapper has none); `linalg.matrix_rank` of an empty
batch fills an `at::empty` of its own, a plain tensor (`empty_matrix_rank`: spmd/scope.py's kernel for matrix_rank
calls it). So spmd registers, for these overloads only, a kernel at the `PythonTLSSnapshot` key, which only tensor
subclasses (and active Python modes) reach, above autograd: with no DTensor argument it passes the call on
unchanged; with one it runs the op in DTensor terms, and torch's own decomposition does the rest.
"""

from __future__ import annotations

import torch

from spmd.dtensor import DTensor
from spmd.layout import Layout

aten = torch.ops.aten
_KEY = torch._C.DispatchKey.PythonTLSSnapshot
_LIBRARY = torch.library.Library("aten", "IMPL")  # kept alive: dropping it would unregister the kernels


def below(keyset):
    """The keys the call goes on to after a kernel at this key (autograd, where torch decomposes the op)."""
    return keyset.remove(_KEY)


def register_above_autograd(overload, kernel) -> None:
    """Registers `kernel(keyset, *args, **kwargs)` for `overload` at the PythonTLSSnapshot key (see above): it
    passes the call on with `overload.redispatch(below(keyset), ...)`."""
    _LIBRARY.impl(overload.name().split("::")[-1], kernel, _KEY.name, with_keyset=True)


def _global_value(t: DTensor) -> torch.Tensor:
    """`t`'s global value as a plain tensor: gathered (and any pending sum resolved) by the dispatcher, so the
    collectives are spmd's own, seen by `explain` and its recorders."""
    replicated = Layout.replicated(t._layout.mesh, t.dim()).to_string()
    return torch.ops.spmd.relayout(t, replicated)._local[0]


def _tensor_split_by_tensor(keyset, self, indices, dim=0):
    # torch reads the indices' values on the host: a DTensor gives its global value (torch then checks its
    # dtype, rank and device itself, and splits `self` by the Python ints)
    if isinstance(indices, DTensor) and type(indices._local) is torch.Tensor:  # (fake components hold no values)
        indices = _global_value(indices)
    return aten.tensor_split.tensor_indices_or_sections.redispatch(below(keyset), self, indices, dim)


def _meta(a):
    return torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) else a


def empty_matrix_rank(overload, args, kwargs) -> DTensor:
    """Rank 0 for every matrix of an empty batch (torch's value), laid out like the batch axes."""
    metas = tuple(_meta(a) for a in args), {k: _meta(v) for k, v in kwargs.items()}
    overload(*metas[0], **metas[1])  # torch's own checks of the call (not a batch of matrices, a bad dtype)
    return torch.zeros_like(args[0].sum((-2, -1)), dtype=torch.int64)


register_above_autograd(aten.tensor_split.tensor_indices_or_sections, _tensor_split_by_tensor)


def _never_nested(keyset, t, mask):
    # TransformerEncoder asks, with a key padding mask, whether the batch can become a nested tensor (its fused
    # inference path): a DTensor cannot, so the answer is no and torch takes its regular path
    if isinstance(t, DTensor) or isinstance(mask, DTensor):
        return False
    return aten._nested_tensor_from_mask_left_aligned.default.redispatch(below(keyset), t, mask)


register_above_autograd(aten._nested_tensor_from_mask_left_aligned.default, _never_nested)


def _pad_circular(keyset, x, pad):
    # torch writes the padded tensor into a `new_empty` of its own, which a DTensor can only lay out replicated
    # (the batch would be gathered into it): a DTensor is padded by concatenating its wrapped-around slices
    # instead, each axis as it is laid out (an axis padded circularly is whole, as a window crossing it needs)
    if not isinstance(x, DTensor):
        return aten._pad_circular.default.redispatch(below(keyset), x, pad)
    aten._pad_circular.default(torch.empty(x.shape, dtype=x.dtype, device="meta"), pad)  # torch's own checks
    for i in range(len(pad) // 2):
        dim, before, after = x.dim() - 1 - i, pad[2 * i], pad[2 * i + 1]
        size = x.shape[dim]
        x = x.narrow(dim, max(-before, 0), size - max(-before, 0) - max(-after, 0))  # (negative pads crop)
        parts = ([x.narrow(dim, x.shape[dim] - before, before)] if before > 0 else []) + [x] + (
            [x.narrow(dim, 0, after)] if after > 0 else [])
        x = torch.cat(parts, dim) if len(parts) > 1 else x.contiguous()
    return x


register_above_autograd(aten._pad_circular.default, _pad_circular)
