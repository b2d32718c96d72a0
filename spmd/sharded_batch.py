"""Modules whose torch forward folds a sharded batch away, run batch first by `distribute_module` instead.

- `nn.MultiheadAttention`: torch's attention (`F.multi_head_attention_forward`) works on `[L, B, E]` and folds the
  sequence and the batch into the rows of its output projection (`[L * B, E]`). A batch sharded behind a whole
  sequence has no block layout in that fold, so the fold all-gathered the attention's output in every layer,
  forward and backward (a ViT or a `TransformerEncoder` trained data-parallel paid it per layer). Here the same
  computation runs batch first, with the batch the outer axis of every fold: the projections, the per-head split,
  the attention (torch's `scaled_dot_product_attention`, or its explicit softmax where the weights are returned)
  and the output projection keep the batch sharded, with no collective. The masks are merged as torch merges them.
  Taken unless torch would take its fused inference kernel (which has a rule of its own); not for unbatched
  inputs, `add_bias_kv` or `add_zero_attn`.
- `nn.EmbeddingBag` of 2-D input (bags of one length): torch flattens the bags and makes their offsets itself, a
  list of positions that no rule can split by device, so the lookup ran replicated. Here each bag is an embedding
  lookup reduced over its row (sum, mean or max; padding entries left out, `per_sample_weights` applied), so the
  bags stay sharded with the batch and the table's gradient is a pending sum over it.
- `nn.InstanceNorm1d/2d/3d`: torch folds the batch into the channels (`[1, B * C, ...]`) to run a batch norm, a
  fold with no block layout when the channels are sharded (and one whose running statistics gathered a sharded
  batch). Here each sample's channels are normalised over their own spatial axes, as the fold computes them: no
  collective; the running statistics, where kept, take the batch's mean of the samples' statistics (a pending sum
  over the batch, one all-reduce of a value per channel).

Elsewhere torch's own forward runs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from spmd.dtensor import DTensor
from spmd.layout import UNSHARDED


MODULES = (nn.MultiheadAttention, nn.EmbeddingBag, nn.modules.instancenorm._InstanceNorm)  # what `forward` takes


def forward(module: nn.Module, args: tuple, kwargs: dict):
    """`module(*args, **kwargs)` batch first where the batch is sharded; None where torch's forward should run."""
    if isinstance(module, nn.MultiheadAttention):
        return _attention_forward(module, args, kwargs)
    if isinstance(module, nn.EmbeddingBag):
        return _bags_forward(module, *args, **kwargs)
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return _instance_norm_forward(module, *args, **kwargs)
    return None


def _attention_forward(mha: nn.MultiheadAttention, args: tuple, kwargs: dict):
    call = _bind(*args, **kwargs)
    query = call["query"]
    batch_axis = 0 if mha.batch_first else 1
    if not isinstance(query, DTensor) or query.dim() != 3 or mha.bias_k is not None or mha.add_zero_attn or \
            query._layout.sharding_specs[batch_axis] == UNSHARDED or _takes_the_fused_path(mha, call):
        return None
    query, key, value = _batch_first(mha, call["query"], call["key"], call["value"])
    out, weights = _attention(mha, query, key, value, call["key_padding_mask"], call["need_weights"],
                              call["attn_mask"], call["average_attn_weights"], call["is_causal"])
    return (out if mha.batch_first else out.transpose(0, 1)), weights


def _bind(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None, average_attn_weights=True,
          is_causal=False) -> dict:  # (nn.MultiheadAttention.forward's arguments)
    return locals()


def _takes_the_fused_path(mha, call: dict) -> bool:
    """Whether torch's forward would take its fused inference kernel (`_native_multi_head_attention`, which keeps
    the batch sharded: engine/rules/fused_layers.py), by its main conditions."""
    query = call["query"]
    masks = [m for m in (call["attn_mask"], call["key_padding_mask"]) if m is not None]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, *mha.parameters()))
    return not (mha.training or grad or torch.is_autocast_enabled() or any(m.is_floating_point() for m in masks)) \
        and query is call["key"] is call["value"] and mha.batch_first and mha._qkv_same_embed_dim \
        and mha.num_heads % 2 == 0 and torch.backends.mha.get_fastpath_enabled()


def _batch_first(mha, query, key, value):
    """The inputs `[B, L, E]`, each tensor passed twice still one object (the projections take the same path as
    torch's: one product for self-attention)."""
    if mha.batch_first:
        return query, key, value
    moved = {}
    return tuple(moved.setdefault(id(t), t.transpose(0, 1)) for t in (query, key, value))


def _attention(mha, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal):
    batch, length, embed = query.shape
    source, heads = key.shape[1], mha.num_heads
    head_dim = embed // heads
    key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                         other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                         target_type=query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                           "method `generate_square_subsequent_mask` to create this mask.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # (SDPA's causal kernel)
    else:
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                      target_type=query.dtype, check_other=False)
        if key_padding_mask is not None:
            is_causal = False
    q, k, v = _projected(mha, query, key, value)
    q, k, v = (t.view(batch, t.shape[1], heads, head_dim).transpose(1, 2) for t in (q, k, v))  # [B, H, L, hd]
    mask = _merged_mask(attn_mask, key_padding_mask, batch, heads, length, source)
    dropout = mha.dropout if mha.training else 0.0
    weights = None
    if need_weights:
        scores = torch.matmul(q * math.sqrt(1.0 / head_dim), k.transpose(-2, -1))
        weights = F.softmax(scores if mask is None else scores + mask, dim=-1)
        if dropout > 0.0:
            weights = F.dropout(weights, p=dropout)  # (returned so, as torch does)
        out = torch.matmul(weights, v)
        if average_attn_weights:
            weights = weights.mean(dim=1)
    else:
        out = F.scaled_dot_product_attention(q, k, v, mask, dropout, is_causal)
    out = F.linear(out.transpose(1, 2).reshape(batch, length, embed), mha.out_proj.weight, mha.out_proj.bias)
    return out, weights


def _projected(mha, query, key, value):
    if mha._qkv_same_embed_dim:
        return F._in_projection_packed(query, key, value, mha.in_proj_weight, mha.in_proj_bias)
    biases = (None,) * 3 if mha.in_proj_bias is None else mha.in_proj_bias.chunk(3)
    return F._in_projection(query, key, value, mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight, *biases)


def _merged_mask(attn_mask, key_padding_mask, batch, heads, length, source):
    """torch's merged mask, broadcastable to `[B, H, L, S]`: an `[L, S]` or `[B * H, L, S]` attention mask plus
    the `[B, S]` key padding mask."""
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if tuple(attn_mask.shape) != (length, source):
                raise RuntimeError(f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be "
                                   f"{(length, source)}.")
            attn_mask = attn_mask.view(1, 1, length, source)
        elif attn_mask.dim() == 3:
            if tuple(attn_mask.shape) != (batch * heads, length, source):
                raise RuntimeError(f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be "
                                   f"{(batch * heads, length, source)}.")
            attn_mask = attn_mask.view(batch, heads, length, source)
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
    if key_padding_mask is None:
        return attn_mask
    if tuple(key_padding_mask.shape) != (batch, source):
        raise AssertionError(f"expecting key_padding_mask shape of {(batch, source)}, but got "
                             f"{key_padding_mask.shape}")
    padding = key_padding_mask.view(batch, 1, 1, source)
    return padding if attn_mask is None else attn_mask + padding


def _bags_forward(bags: nn.EmbeddingBag, input, offsets=None, per_sample_weights=None):
    if not isinstance(input, DTensor) or input.dim() != 2 or offsets is not None or bags.sparse or \
            input._layout.sharding_specs[0] == UNSHARDED:
        return None
    if per_sample_weights is not None and (bags.mode != "sum" or per_sample_weights.shape != input.shape):
        return None  # (torch's own errors)
    rows = F.embedding(input, bags.weight, bags.padding_idx, bags.max_norm, bags.norm_type, bags.scale_grad_by_freq)
    kept = None if bags.padding_idx is None else (input != bags.padding_idx % bags.num_embeddings).unsqueeze(-1)
    if bags.mode == "max":
        if kept is None:
            return rows.amax(1)
        return rows.masked_fill(~kept, float("-inf")).amax(1).masked_fill(~kept.any(1), 0.0)  # (an empty bag: 0)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.unsqueeze(-1).to(rows.dtype)
    if kept is not None:
        rows = rows * kept
    total = rows.sum(1)
    if bags.mode == "sum":
        return total
    count = input.shape[1] if kept is None else kept.sum(1).clamp(min=1)
    return total / count


def _instance_norm_forward(norm: nn.modules.instancenorm._InstanceNorm, x):
    if not isinstance(x, DTensor) or x.dim() != norm._get_no_batch_dim() + 1 or x.shape[1] != norm.num_features \
            or x._layout.sharding_specs[:2] == [UNSHARDED, UNSHARDED]:
        return None  # (torch's forward: its checks and errors, an unbatched input)
    dims = tuple(range(2, x.dim()))
    count = math.prod(x.shape[2:])
    use_input_stats = norm.training or not norm.track_running_stats
    if use_input_stats and norm.training and count == 1:
        return None  # (torch's error: more than one spatial element to train on)
    upcast = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    per_channel = (1, -1) + (1,) * len(dims)
    if use_input_stats:
        var, mean = torch.var_mean(upcast, dims, correction=0, keepdim=True)
        if norm.training and norm.running_mean is not None:
            _update_running_stats(norm, mean, var * (count / (count - 1)))
    else:
        mean, var = norm.running_mean.view(per_channel), norm.running_var.view(per_channel)
    out = ((upcast - mean) * torch.rsqrt(var + norm.eps)).to(x.dtype)
    if norm.weight is not None:
        out = out * norm.weight.view(per_channel) + norm.bias.view(per_channel)
    return out


def _update_running_stats(norm, mean, unbiased_var) -> None:
    """torch's update: the batch's mean of the samples' statistics, weighted by `momentum` (None: 0, no update)."""
    momentum = norm.momentum if norm.momentum is not None else 0.0
    with torch.no_grad():
        for running, stat in ((norm.running_mean, mean), (norm.running_var, unbiased_var)):
            running.mul_(1 - momentum).add_(stat.mean(0).flatten().to(running.dtype), alpha=momentum)
