"""Grouped matrix products (`torch._grouped_mm`, `F.grouped_mm`): the experts of a mixture-of-experts layer, as
HuggingFace's MoE models run them, forward and backward.

Its forms: `(M, K) @ (E, K, N)` with `offs` (E,) — the rows sorted by expert, expert `e` multiplying rows
`offs[e-1]:offs[e]`; `(M, K) @ (K, N)` with `offs` over K — per expert the product of its columns and rows (the
experts' weight gradient, `(E, M, N)`); `(E, M, N) @ (N, K)` with `offs` over K — expert `e` giving output columns
`offs[e-1]:offs[e]` (that gradient's backward); `(B, M, K) @ (B, K, N)` without `offs` — a batched product.

Why the rules hold: the offsets index the grouped axis as a whole, so that axis is whole on each device; the
other axes contract like a matrix product (a sharded K leaves a partial sum, a sharded N or M carries to the
output). Experts sharded over a mesh dim (expert parallelism) are a contraction over the experts: each device
multiplies only its own experts' rows and leaves zeros in the others', and the output is a partial sum over that
mesh dim — one all-reduce (or a reduce-scatter, when the next op wants the rows sharded) completes it.
torch's kernel takes matrices whose rows start every 16 bytes only; a sharded K or N can make a device's rows
shorter than that, and such components are multiplied zero-padded (see `_product`).
"""

from __future__ import annotations

import torch

from spmd.engine.decision import Decision, OpCall, TensorSpec, unsupported
from spmd.engine.registry import register
from spmd.engine.rules.common import block_starts
from spmd.engine.rules.contraction import einsum_axes

aten = torch.ops.aten


@register(aten._grouped_mm.default)
def grouped_mm_rule(call: OpCall) -> Decision:
    a, b = call.args[0], call.args[1]
    offs = call.args[2] if len(call.args) > 2 else call.kwargs.get("offs")
    bias = call.args[3] if len(call.args) > 3 else call.kwargs.get("bias")
    if bias is not None:
        raise unsupported(call, "a bias (torch's kernels take none yet)")
    has_offs = offs is not None  # (a DTensor: the dispatcher takes short plain offsets as replicated)
    forms = {(2, 3, True): _rows_by_expert, (2, 2, True): _columns_by_expert, (3, 2, True): _outputs_by_expert,
             (3, 3, False): _batched}
    form = forms.get((a.rank, b.rank, has_offs))
    if form is None:
        raise unsupported(call, f"the form {a.rank}-D @ {b.rank}-D {'with' if has_offs else 'without'} offsets",
                          any_layout=True)
    return form(call, a, b)


def _rows_by_expert(call: OpCall, a: TensorSpec, b: TensorSpec) -> Decision:
    """(M, K) @ (E, K, N) with offsets over M: M whole; a sharded E or K leaves a partial sum."""
    required, (_, n), reduced = einsum_axes("mk,ekn->mn", [(None, a.axes[1]), b.axes])
    experts = required[1][0]
    if experts is None:
        kernel = _each_device
    else:
        block = b.shape[0] // call.shards(experts)
        kernel = _own_experts(block_starts(call, experts, block), block)
    return Decision((required[0], required[1], (None,)), ((None, n),), kernel, reduce=(reduced,) if reduced else ())


def _columns_by_expert(call: OpCall, a: TensorSpec, b: TensorSpec) -> Decision:
    """(M, K) @ (K, N) with offsets over K, giving (E, M, N): K whole, M and N keep their sharding."""
    required, (m, n), _ = einsum_axes("mk,kn->mn", [(a.axes[0], None), (None, b.axes[1])])
    return Decision((*required, (None,)), ((None, m, n),), _each_device)


def _outputs_by_expert(call: OpCall, a: TensorSpec, b: TensorSpec) -> Decision:
    """(E, M, N) @ (N, K) with offsets over K, expert e giving output columns `offs[e-1]:offs[e]` (the backward of
    the experts' weight gradient): E and K whole, a sharded N leaves a partial sum."""
    required, (m, _), reduced = einsum_axes("mn,nk->mk", [a.axes[1:], (b.axes[0], None)])
    return Decision(((None, *required[0]), required[1], (None,)), ((m, None),), _each_device,
                    reduce=(reduced,) if reduced else ())


def _batched(call: OpCall, a: TensorSpec, b: TensorSpec) -> Decision:
    """(B, M, K) @ (B, K, N): a batched matrix product, each device's batches in one grouped product."""
    required, out, reduced = einsum_axes("bmk,bkn->bmn", [a.axes, b.axes])

    def kernel(locals_, args, kwargs):
        x, w = locals_
        return _product(x.flatten(0, 1), w.flatten(0, 1), None, _options(args, kwargs)).unflatten(0, x.shape[:2])
    return Decision(tuple(required), (out,), kernel, reduce=(reduced,) if reduced else ())


def _options(args, kwargs) -> dict:
    """The call's `out_dtype` (its only other setting once a bias is refused)."""
    out_dtype = args[4] if len(args) > 4 else kwargs.get("out_dtype")
    return {} if out_dtype is None else {"out_dtype": out_dtype}


def _each_device(locals_, args, kwargs):
    options = _options(args, kwargs)
    x, w, offs = locals_
    return torch.stack([_product(x[d], w[d], offs[d], options) for d in range(x.shape[0])])


def _own_experts(starts: list[int], block: int):
    """Each device's product of its own experts' rows (its block of E, starting at `starts[device]`); zeros in
    the other experts' rows. Its rows are rotated to the front (their first row read off the offsets as a tensor:
    no value leaves the device, and a trace records the same ops), multiplied, the others zeroed, rotated back."""
    def kernel(locals_, args, kwargs):
        x, w, offs = locals_
        count, options = x.shape[1], _options(args, kwargs)
        rows = torch.arange(count, device=x.device)
        firsts = torch.nn.functional.pad(offs[0], (1, 0))  # expert e's first row; (the offsets are whole)
        outs = []
        for device, first in enumerate(starts):
            start, stop = firsts[first], firsts[first + block]
            mine = x[device].index_select(0, (rows + start) % count)
            product = _product(mine, w[device], offs[device, first:first + block] - start, options)
            product = torch.where((rows < stop - start).unsqueeze(1), product, 0)  # (rows past them: not written)
            outs.append(product.index_select(0, (rows - start) % count))
        return torch.stack(outs)
    return kernel


def _product(x: torch.Tensor, w: torch.Tensor, offs, options: dict) -> torch.Tensor:
    """torch's grouped product of one device's components. torch's kernel takes only matrices whose rows (or, for
    a transposed one, columns) start every 16 bytes; where sharding made a device's components narrower than that
    they are copied with K and N zero-padded to whole 16 bytes (zero columns of `x` meet zero rows of `w`; the
    padded output columns are cut off)."""
    align = max(16 // x.element_size(), 1)
    k, n = x.shape[-1], w.shape[-1]
    pad_k, pad_n = -k % align, -n % align
    if pad_k or pad_n or not (_aligned(x, align) and _aligned(w, align)):
        x = torch.nn.functional.pad(x, (0, pad_k)).contiguous()
        w = torch.nn.functional.pad(w, (0, pad_n, 0, pad_k)).contiguous()
    return aten._grouped_mm.default(x, w, offs, **options)[..., :n]


def _aligned(t: torch.Tensor, align: int) -> bool:
    return all(stride % align == 0 for stride, size in zip(t.stride(), t.shape) if stride != 1 and size > 1)
