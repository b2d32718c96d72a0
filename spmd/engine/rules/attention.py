"""Attention: every fused kernel torch's `scaled_dot_product_attention` may pick, forward and backward — batch and
head axes sharded as they are; on torch's CPU kernel also the query's rows (context parallelism)."""

from __future__ import annotations

import torch

from spmd.engine.registry import register
from spmd.engine.decision import Decision, OpCall, unsupported
from spmd.engine.rules.common import block_starts, constant, named_tensors, replace_tensors
from spmd.engine.rules.reduction import arg

aten = torch.ops.aten


# Every fused attention kernel torch's scaled_dot_product_attention may pick, with its backward: op -> the rank of
# its logsumexp (forward ops; cuDNN's keeps a trailing axis of 1) or None (backward ops: one gradient per q, k, v
# and, for the memory-efficient kernel, the bias)
_FUSED_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: 3,
    aten._scaled_dot_product_flash_attention.default: 3,
    aten._scaled_dot_product_efficient_attention.default: 3,
    aten._scaled_dot_product_cudnn_attention.default: 4,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: None,
    aten._scaled_dot_product_flash_attention_backward.default: None,
    aten._scaled_dot_product_efficient_attention_backward.default: None,
    aten._scaled_dot_product_cudnn_attention_backward.default: None,
}
_PER_HEAD = {"query", "key", "value", "grad_out", "grad_out_", "out", "logsumexp"}  # (B, H, ...) operands
_PER_QUERY_ROW = {"query", "grad_out", "out", "logsumexp"}  # (B, H, L, ...): a query row's own operands
# the kernels whose query rows may stay sharded (context parallelism): a causal mask then becomes each device's
# offset mask, which needs a kernel taking a mask, with a logsumexp of one row per query row (CUDA's kernels: untested)
_ROWS_SHARDABLE = {aten._scaled_dot_product_flash_attention_for_cpu.default,
                   aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
_MASKS = {"attn_mask", "attn_bias"}  # broadcast to (B, H, L, S); anything else (a seed, an offset) is one value


def _query_rows(call: OpCall, named, batch: tuple):
    """The mesh dim the query's rows (its axis 2) stay sharded over, or None (gathered)."""
    if call.func not in _ROWS_SHARDABLE:
        return None
    rows = dict(named)["query"].axes[2]
    return rows if isinstance(rows, str) and rows not in batch else None


def _batch_and_heads(specs) -> tuple:
    """The mesh dims of the batch and head axes: each operand's, merged (the first operand that shards one wins)."""
    batch = [None, None]
    for s in specs:
        for i in (0, 1):
            if batch[i] is None and s.axes[i] not in batch:
                batch[i] = s.axes[i]
    return tuple(batch)


@register(*_FUSED_ATTENTION, blockwise=True)
def attention_rule(call: OpCall) -> Decision:
    """Attention (B, H, L|S, E) and its backward: each (batch, head) is independent, so those axes keep their
    sharding (merged over the operands, first wins); sequence and embedding axes are whole on each device, except
    the query's rows on the kernels of `_ROWS_SHARDABLE` (each row is independent too: the keys' and values'
    gradients are then the devices' sums). A mask is broadcast to (B, H, L, S) and sharded like the batch axes
    and the query's rows. The kernel runs once on every device's components together (stack and batch axes
    flattened into one batch), so a seed or an offset it returns is one plain value, which its backward takes
    back."""
    if arg(call, "dropout_p", 0.0):
        raise unsupported(call, "a fused kernel's attention dropout would not be layout-invariant; run attention "
                                "with dropout under torch.nn.attention.sdpa_kernel(SDPBackend.MATH), whose "
                                "dropout is layout-invariant")
    if arg(call, "return_debug_mask", False) or any(arg(call, "grad_input_mask", (False,) * 4)[3:]):
        raise unsupported(call, "the attention weights' debug mask and a mask's gradient are not supported")
    named = named_tensors(call)
    batch = _batch_and_heads([s for n, s in named if n in _PER_HEAD])
    rows = _query_rows(call, named, batch)
    query, key = arg(call, "query"), arg(call, "key")
    full = query.shape[:3] + (key.shape[2],)  # (B, H, L, S)
    scores = batch + (rows, None)  # (B, H, L, S) of this decision
    required = []
    for n, s in named:
        if n in _PER_HEAD:
            required.append(batch + ((rows,) if n in _PER_QUERY_ROW else (None,)) + (None,) * (s.rank - 3))
        elif n in _MASKS:
            lead = 4 - s.rank  # the mask's axes line up with the last of (B, H, L, S); sized-1 ones broadcast
            required.append(tuple(scores[j + lead] if j + lead < 3 and s.shape[j] == full[j + lead] else None
                                  for j in range(s.rank)))
            mask_view = (call.num_local,) + (1,) * lead + call.local_shape(s, required[-1])
            mask_full = (call.num_local,) + call.local_shape(full, scores)
        else:
            required.append((None,) * s.rank)
    lse_rank = _FUSED_ATTENTION[call.func]
    reduce = ()
    if lse_rank is None:  # the gradients of query, key, value: their layouts
        by_name = dict(zip((n for n, _ in named), required))
        outputs = tuple(by_name[n] for n in ("query", "key", "value"))
        outputs += (None,) * (len(call.func._schema.returns) - 3)
        if rows is not None:  # each device's query rows' part of the key's and value's gradients: their sum
            reduce = ((), (rows,), (rows,)) + ((),) * (len(outputs) - 3)
    else:  # without compute_log_sumexp (no gradient needed) the logsumexp is empty or undefined: left plain
        lse = batch + (rows,) + (None,) * (lse_rank - 3) if arg(call, "compute_log_sumexp", True) else None
        outputs = (batch + (rows, None), lse) + (None,) * (len(call.func._schema.returns) - 2)
    kinds = ["head" if n in _PER_HEAD else "mask" if n in _MASKS else "one" for n, _ in named]
    masked = "mask" in kinds  # (its views are shaped by the batch axes' blocks)

    def local(x, kind):
        if kind == "head":  # (stack * B, H, ...): the kernels want 4-D operands, and (as torch's own front end
            x = x.flatten(0, 1)  # gives them) a last dim of stride 1: a gathered head dim may not have it
            return x if x.stride(-1) == 1 else x.contiguous()
        return x.view(mask_view).expand(mask_full).flatten(0, 1) if kind == "mask" else x[0]

    causal = rows is not None and arg(call, "is_causal", False)
    if causal:  # each device's rows start at its offset: the causal mask is its own (is_causal is top-left)
        mask = constant(lambda: _offset_causal_mask(call, rows, call.local_shape(full, scores), query.dtype))

    def kernel(l, a, k):
        stack, b = l[0].shape[:2]
        args, kwargs = replace_tensors(a, k, [local(x, kind) for x, kind in zip(l, kinds)])
        if causal:
            args, kwargs = _masked_not_causal(call, args, kwargs, mask(l[0]))
        outs = call.func(*args, **kwargs)
        return tuple(o if axes is None else o.unflatten(0, (stack, b)) for o, axes in zip(outs, outputs))
    fixed = tuple(m for m in batch if m is not None) if masked else ()
    return Decision(tuple(required), outputs, kernel, reduce=reduce, single=False,
                    fixed=fixed + ((rows,) if causal else ()))


def _offset_causal_mask(call: OpCall, rows: str, local: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The causal mask of each device's query rows at their global positions (`rows`: their mesh dim; `local`: the
    local (B, H, L, S)), additive and of the query's dtype as the kernel wants it: (stack * B, 1, L, S)."""
    batch, _, n_rows, n_cols = local
    device = call.mesh.torch_device
    starts = torch.tensor(block_starts(call, rows, n_rows), device=device).view(-1, 1, 1, 1, 1)
    allowed = torch.arange(n_cols, device=device) <= torch.arange(n_rows, device=device).view(n_rows, 1) + starts
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    return mask.expand(call.num_local, batch, 1, n_rows, n_cols).flatten(0, 1)


def _masked_not_causal(call: OpCall, args: tuple, kwargs: dict, mask: torch.Tensor):
    """The kernel's arguments with `is_causal` off and `mask` as its `attn_mask`."""
    at = [a.name for a in call.func._schema.arguments].index("is_causal")
    if at < len(args):
        return args[:at] + (False,) + args[at + 1:], dict(kwargs, attn_mask=mask)
    return args, dict(kwargs, is_causal=False, attn_mask=mask)
