"""Layout sweeps: every op an MLP/transformer training step needs, forward and backward, gives the plain-torch
answer for every combination of input layouts on a 2x2 mesh (see `sweep.check_op`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from sweep import MESH, Const, Plain, all_layouts, check_op, distribute, gather, issued, rand

slow = pytest.mark.slow
i64 = torch.int64


def _targets(n, classes, ignore=None, seed=0):
    t = torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed))
    if ignore is not None:
        t[::3] = ignore
    return t


def _ids(shape, vocab, seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


_Q = all_layouts(MESH, (2, 2, 4, 2))

# name -> (fn, inputs[, layouts per input]) or pytest.param(..., marks=...); axes divide by 2 where they shard.
CASES = {
    # -- pointwise: unary, binary, broadcasting, scalars ------------------------------------------------------------
    "neg": (torch.neg, [rand(4, 2, 4)]),
    "exp": (torch.exp, [rand(4, 2, 4)]),
    "tanh": (torch.tanh, [rand(4, 2, 4)]),
    "sigmoid": (torch.sigmoid, [rand(4, 2, 4)]),
    "relu": (torch.relu, [rand(4, 2, 4)]),
    "F.relu": (F.relu, [rand(4, 4)]),
    "gelu": (F.gelu, [rand(4, 2, 4)]),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), [rand(4, 4)]),
    "silu": (F.silu, [rand(4, 2, 4)]),
    "rsqrt_abs": (lambda x: torch.rsqrt(x.abs() + 1), [rand(4, 4)]),
    "pow_scalar": (lambda x: x ** 2, [rand(4, 4)]),
    "rank4_unary": (torch.sin, [rand(2, 2, 2, 4)]),
    "add": (torch.add, [rand(4, 4), rand(4, 4, seed=1)]),
    "sub_alpha": (lambda a, b: torch.sub(a, b, alpha=0.5), [rand(4, 4), rand(4, 4, seed=1)]),
    "mul": (torch.mul, [rand(4, 4), rand(4, 4, seed=1)]),
    "div": (torch.div, [rand(4, 4), rand(4, 4, seed=1).abs() + 1]),
    "maximum": (torch.maximum, [rand(4, 4), rand(4, 4, seed=1)]),
    "add_rank3": (torch.add, [rand(4, 4, 4), rand(4, 4, 4, seed=1)]),
    "bcast_row": (torch.add, [rand(4, 4), rand(1, 4, seed=1)]),
    "bcast_col": (torch.mul, [rand(4, 4), rand(4, 1, seed=1)]),
    "bcast_rank_mismatch": (torch.mul, [rand(4, 2, 4), rand(4, seed=1)]),
    "bcast_rank_mismatch_lhs": (torch.sub, [rand(4), rand(4, 2, 4, seed=1)]),
    "bcast_rank_mismatch_2d": (torch.add, [rand(2, 4, 4), rand(4, 4, seed=1)]),
    "bcast_both_size1": (torch.add, [rand(4, 1, 4), rand(4, 2, 1, seed=1)]),
    "bcast_outer": (torch.mul, [rand(4, 1), rand(1, 4, seed=1)]),
    "scalar_mul": (lambda x: x * 2.5, [rand(4, 4)]),
    "scalar_rsub": (lambda x: 2 - x, [rand(4, 4)]),
    "scalar_div": (lambda x: x / 3, [rand(4, 4)]),
    "scalar_int_add": (lambda x: x + 1, [rand(4, 4)]),
    "plain_0d_tensor": (lambda x, s: x * s + s, [rand(4, 4), Plain(torch.tensor(1.5, dtype=torch.float64))]),
    "dtensor_0d": (torch.mul, [rand(4, 4), rand()]),
    "dtensor_0d_lhs": (torch.sub, [rand(), rand(4, 4)]),
    "where": (lambda c, a, b: torch.where(c > 0, a, b), [rand(4, 4, seed=2), rand(4, 4), rand(4, 4, seed=1)]),
    "where_scalar": (lambda c, a: torch.where(c > 0, a, 0.0), [rand(4, 4, seed=2), rand(4, 4)]),
    "where_bcast": (lambda c, a, b: torch.where(c > 0, a, b), [rand(4, 1, seed=2), rand(4, 4), rand(4, seed=1)]),
    "masked_fill": (lambda x, m: x.masked_fill(m > 0, -1e9), [rand(4, 4), rand(4, 4, seed=3)]),
    "masked_fill_bcast": (lambda x, m: x.masked_fill(m > 0, float("-inf")).softmax(-1),
                          [rand(2, 4, 4), rand(4, 4, seed=3)]),
    "compare": (lambda a, b: (a > b, a == b, a <= 0.5), [rand(4, 4), rand(4, 4, seed=1)]),
    "logical": (lambda a, b: (a > 0) & (b < 0) | ~(a > 1), [rand(4, 4), rand(4, 4, seed=1)]),
    # -- contractions ------------------------------------------------------------------------------------------------
    "mm": (torch.mm, [rand(4, 4), rand(4, 4, seed=1)]),
    "mm_rect": (torch.mm, [rand(2, 4), rand(4, 8, seed=1)]),
    "bmm": (torch.bmm, [rand(2, 4, 4), rand(2, 4, 2, seed=1)]),
    "addmm_vec_bias": (torch.addmm, [rand(4), rand(4, 4, seed=1), rand(4, 4, seed=2)]),
    "addmm_mat_bias": (lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
                       [rand(4, 4), rand(4, 4, seed=1), rand(4, 4, seed=2)]),
    "linear_bias": (F.linear, [rand(4, 4), rand(8, 4, seed=1), rand(8, seed=2)]),
    "linear_nobias": (F.linear, [rand(4, 4), rand(8, 4, seed=1)]),
    "linear_3d_bias": (F.linear, [rand(2, 4, 4), rand(4, 4, seed=1), rand(4, seed=2)]),
    "linear_3d_nobias": (F.linear, [rand(2, 4, 4), rand(4, 4, seed=1)]),
    "matmul_1d_1d": (torch.matmul, [rand(4), rand(4, seed=1)]),
    "matmul_1d_2d": (torch.matmul, [rand(4), rand(4, 4, seed=1)]),
    "matmul_2d_1d": (torch.matmul, [rand(4, 4), rand(4, seed=1)]),
    "matmul_2d_2d": (torch.matmul, [rand(4, 4), rand(4, 2, seed=1)]),
    "matmul_3d_3d": (torch.matmul, [rand(2, 4, 4), rand(2, 4, 2, seed=1)]),
    "matmul_3d_2d": (torch.matmul, [rand(2, 4, 4), rand(4, 2, seed=1)]),
    "matmul_2d_3d": (torch.matmul, [rand(4, 4), rand(2, 4, 2, seed=1)]),
    "matmul_3d_1d": (torch.matmul, [rand(2, 4, 4), rand(4, seed=1)]),
    "matmul_1d_3d": (torch.matmul, [rand(4), rand(2, 4, 2, seed=1)]),
    "matmul_4d_4d": (torch.matmul, [rand(2, 2, 4, 4), rand(2, 2, 4, 2, seed=1)]),
    "matmul_4d_2d": (torch.matmul, [rand(2, 2, 4, 4), rand(4, 2, seed=1)]),
    "einsum_ij_jk": (lambda a, b: torch.einsum("ij,jk->ik", a, b), [rand(4, 4), rand(4, 4, seed=1)]),
    "einsum_bsd_dnh": (lambda a, b: torch.einsum("bsd,dnh->bsnh", a, b),
                                    [rand(2, 4, 4), rand(4, 2, 2, seed=1)]),
    "einsum_bfi_bfd": (lambda a, b: torch.einsum("bfi,bfd->di", a, b), [rand(2, 4, 4), rand(2, 4, 2, seed=1)]),
    "einsum_bfnh_nhd": (lambda a, b: torch.einsum("bfnh,nhd->bfd", a, b),
                                     [rand(2, 4, 2, 2), rand(2, 2, 4, seed=1)]),
    "einsum_outer": (lambda a, b: torch.einsum("i,j->ij", a, b), [rand(4), rand(4, seed=1)]),
    "einsum_trace_like": (lambda a: torch.einsum("ij->j", a), [rand(4, 4)]),
    # -- reductions --------------------------------------------------------------------------------------------------
    **{f"{op}_dim{d}_keep{int(k)}": (lambda x, op=op, d=d, k=k: getattr(torch, op)(x, dim=d, keepdim=k),
                                     [rand(4, 2, 4)])
       for op in ("sum", "mean", "amax", "amin", "var", "std")
       for d in (0, 1, -1, (0, 2), (0, 1, 2))
       for k in (False, True)},
    "sum_all": (torch.sum, [rand(4, 2, 4)]),
    "mean_all": (torch.mean, [rand(4, 2, 4)]),
    "amax_all": (torch.amax, [rand(4, 2, 4)]),
    "amin_all": (lambda x: torch.amin(x), [rand(4, 2, 4)]),
    "max_all": (torch.max, [rand(4, 4)]),
    "var_all": (torch.var, [rand(4, 2, 4)]),
    "std_all": (torch.std, [rand(4, 2, 4)]),
    "var_unbiased0": (lambda x: torch.var(x, dim=1, unbiased=False), [rand(4, 4)]),
    "max_dim": (lambda x: torch.max(x, dim=1), [rand(4, 4)]),
    "sum_dtype": (lambda x: x.sum(-1, dtype=torch.float32), [rand(4, 4)]),
    "sum_dim_none_keep": (lambda x: x.sum(dim=None, keepdim=True), [rand(4, 4)]),
    "argmax": (lambda x: x.argmax(-1), [rand(4, 4)]),
    "norm": (lambda x: torch.linalg.vector_norm(x, dim=-1), [rand(4, 4)]),
    # a dim left to its default keeps torch's meaning (mode reduces the last axis, not all of them)
    "mode_default_dim": (lambda x: torch.mode(x.round()), [rand(4, 4)]),
    "median_all": (torch.median, [rand(4, 4)]),
    # 0-d inputs: each device's component is one element, not an axis of the stacked components
    **{f"{name}_0d": (fn, [rand()]) for name, fn in (
        ("sum", torch.sum), ("sum_dim0", lambda x: x.sum(0)), ("mean", torch.mean), ("nanmean", torch.nanmean),
        ("amax", torch.amax), ("amin_dim_neg1", lambda x: x.amin(-1)), ("var", lambda x: x.var(correction=0)),
        ("logsumexp", lambda x: x.logsumexp(0)), ("prod", torch.prod), ("max_dim0", lambda x: x.max(0)))},
    # torch 2.11 has no derivative for aminmax (it came with 2.12): there its forward alone is checked
    "aminmax_0d": (lambda x: torch.aminmax(x), [rand() if torch.__version__ >= "2.12" else Const(rand())]),
    "argmin_0d": (lambda x: x.argmin(), [rand()]),
    "count_0d": (lambda x: (x > 0).sum(), [rand()]),
    # -- softmax, layer norm, embedding, losses ----------------------------------------------------------------------
    **{f"{name}_dim{d}": (lambda x, fn=fn, d=d: fn(x, dim=d), [rand(4, 2, 4)])
       for name, fn in (("softmax", F.softmax), ("log_softmax", F.log_softmax)) for d in (0, 1, 2)},
    "layer_norm_affine": (lambda x, w, b: F.layer_norm(x, (4,), w, b), [rand(4, 2, 4), rand(4, seed=1),
                                                                       rand(4, seed=2)]),
    "layer_norm_plain": (lambda x: F.layer_norm(x, (4,)), [rand(4, 2, 4)]),
    "layer_norm_weight_only": (lambda x, w: F.layer_norm(x, (4,), w), [rand(4, 4), rand(4, seed=1)]),
    "layer_norm_2d": (lambda x: F.layer_norm(x, (2, 4)), [rand(4, 2, 4)]),
    "layer_norm_rank1": (lambda x, w, b: F.layer_norm(x, (4,), w, b), [rand(4), rand(4, seed=1), rand(4, seed=2)]),
    "layer_norm_2d_affine": pytest.param((lambda x, w, b: F.layer_norm(x, (2, 4), w, b),
                                          [rand(4, 2, 4), rand(2, 4, seed=1), rand(2, 4, seed=2)]), marks=slow),
    # channels sharded at group boundaries (4 groups over 2 or 4 devices) stay sharded; across a group, gathered
    "group_norm_affine": (lambda x, w, b: F.group_norm(x, 4, w, b), [rand(4, 4, 3), rand(4, seed=1),
                                                                     rand(4, seed=2)]),
    "group_norm_2_groups": (lambda x: F.group_norm(x, 2), [rand(4, 4, 3)]),
    "embedding_1d": (lambda t, i: F.embedding(i, t), [rand(8, 4), _ids((4,), 8)]),
    "embedding_2d": (lambda t, i: F.embedding(i, t), [rand(8, 4), _ids((4, 2), 8)]),
    "embedding_repeated": (lambda t, i: F.embedding(i, t), [rand(8, 4), torch.tensor([[1, 1], [6, 1]])]),
    "embedding_padding": (lambda t, i: F.embedding(i, t, padding_idx=2), [rand(8, 4), _ids((4, 2), 4)]),
    **{f"cross_entropy_{red}": (lambda x, t, red=red: F.cross_entropy(x, t, reduction=red),
                                [rand(4, 4), _targets(4, 4)]) for red in ("mean", "sum", "none")},
    **{f"cross_entropy_ignore_{red}": (lambda x, t, red=red: F.cross_entropy(x, t, reduction=red, ignore_index=-1),
                                       [rand(8, 4), _targets(8, 4, ignore=-1)]) for red in ("mean", "sum", "none")},
    **{f"cross_entropy_weight_{red}": (lambda x, t, w, red=red: F.cross_entropy(x, t, weight=w, reduction=red),
                                       [rand(4, 4), _targets(4, 4), Const(rand(4, seed=1).abs())])
       for red in ("mean", "sum", "none")},
    "cross_entropy_weight_ignore": (lambda x, t, w: F.cross_entropy(x, t, weight=w, ignore_index=3),
                                    [rand(8, 4), _targets(8, 4, ignore=3), Const(rand(4, seed=1).abs())]),
    "cross_entropy_1d": (lambda x, t: F.cross_entropy(x, t), [rand(4), torch.tensor(2)]),
    "cross_entropy_smoothing": (lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), [rand(4, 4), _targets(4, 4)]),
    "cross_entropy_probs": (lambda x, p: F.cross_entropy(x, p.softmax(-1)), [rand(4, 4), rand(4, 4, seed=1)]),
    **{f"nll_loss_{red}": (lambda x, t, red=red: F.nll_loss(F.log_softmax(x, -1), t, reduction=red),
                           [rand(4, 4), _targets(4, 4)]) for red in ("mean", "sum", "none")},
    "nll_loss_ignore": (lambda x, t: F.nll_loss(x, t, ignore_index=0), [rand(8, 4), _targets(8, 4)]),
    # -- views and shape ops -----------------------------------------------------------------------------------------
    "view_merge": (lambda x: x.view(16), [rand(4, 4)]),
    "view_split": (lambda x: x.view(4, 4), [rand(16)]),
    "view_split_uneven": (lambda x: x.view(2, 8), [rand(16)]),
    "reshape_merge_leading": (lambda x: x.reshape(8, 4), [rand(2, 4, 4)]),
    "reshape_merge_trailing": (lambda x: x.reshape(2, 16), [rand(2, 4, 4)]),
    "reshape_split_last": (lambda x: x.reshape(4, 2, 2), [rand(4, 4)]),
    "reshape_split_first": (lambda x: x.reshape(2, 2, 4), [rand(4, 4)]),
    "reshape_regroup": (lambda x: x.reshape(2, 8), [rand(4, 4)]),
    "reshape_heads": (lambda x: x.reshape(2, 4, 2, 2).transpose(1, 2), [rand(2, 4, 4)]),
    "reshape_infer": (lambda x: x.reshape(-1, 4), [rand(2, 2, 4)]),
    "reshape_size1": (lambda x: x.reshape(4, 1, 4), [rand(4, 4)]),
    "transpose": (lambda x: x.transpose(0, 2), [rand(4, 2, 4)]),
    "t": (lambda x: x.t(), [rand(4, 2)]),
    "mT": (lambda x: x.mT, [rand(2, 4, 4)]),
    "permute": (lambda x: x.permute(2, 0, 1), [rand(4, 2, 4)]),
    "squeeze_all": (lambda x: x.squeeze(), [rand(4, 1, 4)]),
    "squeeze_dim": (lambda x: x.squeeze(1), [rand(4, 1, 4)]),
    "squeeze_noop": (lambda x: x.squeeze(0), [rand(4, 1, 4)]),
    "unsqueeze": (lambda x: x.unsqueeze(1), [rand(4, 4)]),
    "unsqueeze_last": (lambda x: x.unsqueeze(-1), [rand(4, 4)]),
    "flatten": (lambda x: x.flatten(), [rand(4, 2, 4)]),
    "flatten_1": (lambda x: x.flatten(1), [rand(4, 2, 4)]),
    "expand": (lambda x: x.expand(4, 4, 4), [rand(4, 1, 4)]),
    "expand_new_axes": (lambda x: x.expand(2, 4, 4), [rand(4)]),
    "expand_as": (lambda x, y: x.expand_as(y) * y, [rand(1, 4), rand(4, 4, seed=1)]),
    "slice_rows": (lambda x: x[1:3], [rand(4, 4)]),
    "slice_full": (lambda x: x[:, 0:4], [rand(4, 4)]),
    "slice_step": (lambda x: x[:, ::2], [rand(4, 4)]),
    "slice_negative": (lambda x: x[..., -2:], [rand(4, 2, 4)]),
    "select": (lambda x: x[1], [rand(4, 4)]),
    "select_dim1": (lambda x: x.select(1, 2), [rand(4, 4)]),
    "index_last": (lambda x: x[:, -1], [rand(4, 2, 4)]),
    "cat0": (lambda a, b: torch.cat([a, b]), [rand(4, 4), rand(4, 4, seed=1)]),
    "cat1": (lambda a, b: torch.cat([a, b], dim=1), [rand(4, 4), rand(4, 2, seed=1)]),
    "cat_three": (lambda a, b, c: torch.cat([a, b, c], dim=-1), [rand(4, 2), rand(4, 2, seed=1), rand(4, 2, seed=2)]),
    "stack0": (lambda a, b: torch.stack([a, b]), [rand(4, 4), rand(4, 4, seed=1)]),
    "stack_last": (lambda a, b: torch.stack([a, b], dim=-1), [rand(4, 4), rand(4, 4, seed=1)]),
    "split": (lambda x: x.split(2, dim=1), [rand(4, 4)]),
    "split_uneven": (lambda x: x.split(3), [rand(4, 4)]),
    "split_sizes": (lambda x: x.split([1, 3], dim=-1), [rand(4, 4)]),
    "chunk": (lambda x: x.chunk(2, dim=0), [rand(4, 4)]),
    "chunk3": (lambda x: x.chunk(3, dim=2), [rand(4, 2, 4)]),
    "qkv_split": (lambda x: [t.reshape(2, 4, 2, 2) for t in x.split(4, dim=-1)], [rand(2, 4, 12)]),
    "unbind0": (lambda x: x.unbind(0), [rand(4, 4)]),
    "unbind1": (lambda x: x.unbind(1), [rand(4, 2, 4)]),
    "gather": (lambda x, i: torch.gather(x, 1, i), [rand(4, 4), _ids((4, 2), 4)]),
    "gather_dim0": (lambda x, i: torch.gather(x, 0, i), [rand(4, 4), _ids((4, 4), 4)]),
    "scatter": (lambda x, i, src: x.scatter(1, i, src), [rand(4, 4), torch.tensor([[0], [3], [1], [2]]),
                                                        rand(4, 1, seed=1)]),
    "scatter_add": (lambda x, i, src: x.scatter_add(0, i, src), [rand(4, 4), _ids((4, 4), 4), rand(4, 4, seed=1)]),
    "add_inplace": (lambda a, b: a.clone().add_(b), [rand(4, 4), rand(4, 4, seed=1)]),
    "mul_inplace_bcast": (lambda a, b: a.clone().mul_(b), [rand(4, 2, 4), rand(4, seed=1)]),
    "floor_divide_inplace": (lambda a, b: a.clone().floor_divide_(b), [_ids((4, 4), 50) - 25, _ids((4, 4), 5, 1) + 1]),
    "rshift_inplace": (lambda a, b: a.clone().__irshift__(b), [_ids((4, 4), 64), _ids((4, 4), 3)]),
    "masked_fill_inplace": (lambda x, m: x.clone().masked_fill_(m > 0, 0.5), [rand(4, 4), rand(4, 4, seed=3)]),
    "unflatten": (lambda x: x.unflatten(-1, (2, 2)), [rand(4, 4)]),
    "expand_minus1": (lambda x: x.expand(-1, 4), [rand(4, 1)]),
    "T": (lambda x: x.T, [rand(4, 2)]),
    # q, k, v: every layout of q, a spread of layouts of k, v and the mask (the full product is 9261 combinations)
    "sdpa": (F.scaled_dot_product_attention, [rand(2, 2, 4, 2), rand(2, 2, 4, 2, seed=1), rand(2, 2, 4, 2, seed=2)],
             [_Q[::2], _Q[::7], _Q[::8]]),
    "sdpa_causal": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                    [rand(2, 2, 4, 2), rand(2, 2, 4, 2, seed=1), rand(2, 2, 4, 2, seed=2)],
                    [_Q[1::2], _Q[1::7], _Q[2::9]]),
    "sdpa_mask": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m > 0),
                  [rand(2, 2, 4, 2), rand(2, 2, 4, 2, seed=1), rand(2, 2, 4, 2, seed=2), rand(4, 4, seed=3)],
                  [_Q[::4], _Q[::10], _Q[1::10], all_layouts(MESH, (4, 4))[::2]]),
    "sdpa_float_mask_bcast": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                              [rand(2, 2, 4, 2), rand(2, 2, 4, 2, seed=1), rand(2, 2, 4, 2, seed=2),
                               rand(2, 1, 4, 4, seed=3)],
                              [_Q[::4], _Q[::10], _Q[1::10], all_layouts(MESH, (2, 1, 4, 4))[::3]]),
    "pad": (lambda x: F.pad(x, (1, 2)), [rand(4, 2, 4)]),
    "pad_2d": (lambda x: F.pad(x, (0, 0, 2, 0), value=0.5), [rand(4, 2, 4)]),
    "roll": (lambda x: torch.roll(x, 1, 0), [rand(4, 4)]),
    "roll_flat": (lambda x: torch.roll(x, 3), [rand(4, 4)]),
    "roll_dims": (lambda x: torch.roll(x, (1, -1), (0, 2)), [rand(4, 2, 4)]),
    "flip": (lambda x: torch.flip(x, (0, -1)), [rand(4, 2, 4)]),
    "repeat": (lambda x: x.repeat(2, 1), [rand(4, 4)]),
    "repeat_new_axes": (lambda x: x.repeat(2, 1, 2), [rand(4, 4)]),
    "index_select": (lambda x, i: x.index_select(0, i), [rand(4, 4), torch.tensor([0, 2, 3, 3])]),
    "index_select_dim1": (lambda x, i: x.index_select(-1, i), [rand(4, 2, 4), torch.tensor([3, 1])]),
    "softplus": (F.softplus, [rand(4, 4)]),
    "elu": (F.elu, [rand(4, 4)]),
    "leaky_relu": (F.leaky_relu, [rand(4, 4)]),
    "hardtanh": (F.hardtanh, [rand(4, 4)]),
    "mish": (F.mish, [rand(4, 4)]),
    "tril": (torch.tril, [rand(4, 4)]),
    "tril_batched": (lambda x: torch.tril(x, diagonal=-1), [rand(2, 4, 4)]),
    "triu": (lambda x: torch.triu(x, 1), [rand(4, 4)]),
    "tril_wide": (lambda x: torch.tril(x, 3), [rand(4, 8)]),
    "triu_tall_batched": (lambda x: torch.triu(x, -2), [rand(2, 8, 4)]),
    "tril_in_place": (lambda x: (x * 1).tril_(-1), [rand(4, 4)]),
    "triu_in_place": (lambda x: (x * 1).triu_(2), [rand(2, 4, 8)]),
    "causal_mask": (lambda x: x.masked_fill(torch.ones_like(x).tril() == 0, float("-inf")).softmax(-1),
                    [rand(2, 4, 4)]),
    # -- dtype casts, copies -----------------------------------------------------------------------------------------
    "float": (lambda x: x.float(), [rand(4, 4)]),
    "double": (lambda x: x.float().double() * 2, [rand(4, 4)]),
    "to_dtype": (lambda x: x.to(torch.float32), [rand(4, 2, 4)]),
    "int_cast": (lambda x: (x * 10).long(), [rand(4, 4)]),
    "clone": (torch.clone, [rand(4, 4)]),
    "contiguous": (lambda x: x.t().contiguous(), [rand(4, 4)]),
    "detach": (lambda x: x.detach(), [rand(4, 4)]),
    "detach_mix": (lambda x: x * x.detach(), [rand(4, 4)]),
    "zeros_like": (lambda x: torch.zeros_like(x) + x, [rand(4, 4)]),
}


@pytest.mark.parametrize("case", [pytest.param(v.values[0], id=k, marks=v.marks) if hasattr(v, "marks")
                                  else pytest.param(v, id=k) for k, v in CASES.items()])
def test_op(case):
    fn, inputs, *layouts = case
    assert check_op(fn, inputs, layouts=layouts[0] if layouts else None) >= 1


MESH_LINE = spmd.create_mesh([("x", 2)])
MESH_2x4 = spmd.create_mesh([("x", 2), ("y", 4)])
MESH_2x2x2 = spmd.create_mesh([("a", 2), ("b", 2), ("c", 2)])


@pytest.mark.parametrize("mesh", [MESH_2x4, MESH_2x2x2], ids=["2x4", "2x2x2"])
@pytest.mark.parametrize("case", [pytest.param(v.values[0], id=k, marks=v.marks) if hasattr(v, "marks")
                                  else pytest.param(v, id=k) for k, v in CASES.items()])
def test_op_other_meshes(case, mesh):
    """The same ops on meshes with more or larger dims, on a sample of the layout combinations."""
    fn, inputs, *_ = case
    assert check_op(fn, inputs, mesh=mesh, sample=6) >= 1


@pytest.mark.parametrize("case", [pytest.param(v.values[0], id=k, marks=v.marks) if hasattr(v, "marks")
                                  else pytest.param(v, id=k) for k, v in CASES.items()])
def test_op_line_mesh(case):
    """The same ops on a 1-D mesh, every layout combination: there a gathered value is replicated over the whole
    mesh, held as one copy that every device shares (a stride-0 stack), which 2-D meshes rarely reach."""
    fn, inputs, *_ = case
    assert check_op(fn, inputs, mesh=MESH_LINE) >= 1


@pytest.mark.parametrize("mesh", [MESH, MESH_2x2x2], ids=["2x2", "2x2x2"])
@pytest.mark.parametrize("case", [pytest.param(v.values[0], id=k, marks=v.marks) if hasattr(v, "marks")
                                  else pytest.param(v, id=k) for k, v in CASES.items()])
def test_op_multi_axis(case, mesh):
    """The same ops with axes sharded over several mesh dims (`"x+y"`) among the layouts, on a sample."""
    fn, inputs, *_ = case
    tensors = [x.value if isinstance(x, Const) else x for x in inputs if isinstance(x, (torch.Tensor, Const))]
    layouts = [all_layouts(mesh, t.shape, multi=True) for t in tensors]
    assert check_op(fn, inputs, mesh=mesh, layouts=layouts, sample=6) >= 1


# -- a transformer block end to end -------------------------------------------------------------------------------
def _block(x, w_qkv, w_o, w1, w2, ln_w):
    b, s, d = x.shape
    h = F.layer_norm(x, (d,), ln_w)
    q, k, v = h.matmul(w_qkv).split(d, dim=-1)
    q, k, v = (t.reshape(b, s, 2, d // 2).transpose(1, 2) for t in (q, k, v))  # (B, nh, S, hs)
    att = (q @ k.transpose(-2, -1)) * (d // 2) ** -0.5
    att = att.masked_fill(torch.ones_like(att).triu(1) > 0, float("-inf"))  # causal
    y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
    x = x + F.linear(y, w_o)
    return x + F.gelu(x @ w1) @ w2


def test_transformer_block():
    d = 4
    x, w_qkv, w_o, w1, w2, ln_w = rand(2, 4, d), rand(d, 3 * d, seed=1), rand(d, d, seed=2), \
        rand(d, 8, seed=3), rand(8, d, seed=4), rand(d, seed=5)
    lay = lambda *s: spmd.Layout(list(s), MESH)  # noqa: E731
    U = spmd.UNSHARDED
    layouts = [[lay("x", U, U), lay(U, "y", U), lay("y", "x", U)],
               [lay(U, "y"), lay(U, U)], [lay("y", U), lay(U, U)], [lay(U, "y")], [lay("y", U)],
               [lay(U), lay("y")]]
    assert check_op(_block, [x, w_qkv, w_o, w1, w2, ln_w], layouts=layouts) == 3 * 2 * 2 * 2


def test_mlp_step_loss():
    """Embedding -> linear -> gelu -> linear -> cross entropy, the loss and every gradient, all layouts of the
    parameters (batch-sharded ids)."""
    def step(table, w1, w2, ids, targets):
        h = F.embedding(ids, table)
        logits = F.linear(F.gelu(F.linear(h, w1)), w2)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    inputs = [rand(8, 4), rand(8, 4, seed=1), rand(8, 8, seed=2), _ids((4, 2), 8), _ids((4, 2), 8, seed=1)]
    layouts = [all_layouts(MESH, (8, 4)), all_layouts(MESH, (8, 4)), all_layouts(MESH, (8, 8))[::3],
               [spmd.Layout(["x", spmd.UNSHARDED], MESH)], [spmd.Layout(["x", spmd.UNSHARDED], MESH)]]
    check_op(step, inputs, layouts=layouts)


# -- random ops are layout-invariant --------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [0.5, 0.1])
def test_dropout_mask_is_layout_invariant(p):
    x = torch.ones(4, 2, 4, dtype=torch.float64)
    results = []
    for layout in all_layouts(MESH, x.shape):
        torch.manual_seed(7)
        out = F.dropout(distribute(x, layout), p=p, training=True)
        assert spmd.fetch_layout(out) == layout
        results.append(gather(out))
    for r in results[1:]:
        assert torch.equal(r, results[0])
    kept = results[0] != 0
    assert torch.all(results[0][kept] == 1 / (1 - p))
    assert 0 < kept.sum() < x.numel()
    torch.manual_seed(8)
    assert not torch.equal(gather(F.dropout(distribute(x, all_layouts(MESH, x.shape)[0]), p=p)), results[0])


def test_dropout_gradient_uses_the_mask():
    x = rand(4, 4)
    for layout in all_layouts(MESH, x.shape):
        torch.manual_seed(3)
        leaf = distribute(x, layout).detach().requires_grad_()
        out = F.dropout(leaf, p=0.5)
        out.sum().backward()
        assert spmd.fetch_layout(leaf.grad) == layout
        assert torch.equal(gather(leaf.grad), (gather(out) != 0).double() * 2)


def test_dropout_eval_is_identity():
    x = rand(4, 4)
    for layout in all_layouts(MESH, x.shape):
        assert torch.equal(gather(F.dropout(distribute(x, layout), p=0.5, training=False)), x)


@pytest.mark.parametrize("init", [lambda t: torch.nn.init.normal_(t, 0.5, 2.0),
                                  lambda t: torch.nn.init.uniform_(t, -1.0, 3.0),
                                  lambda t: t.normal_(), lambda t: t.uniform_()], ids=["normal", "uniform",
                                                                                      "normal_", "uniform_"])
def test_init_is_layout_invariant(init):
    results = []
    for layout in all_layouts(MESH, (4, 2, 4)):
        t = spmd.zeros(4, 2, 4, dtype=torch.float64, layout=layout)
        torch.manual_seed(11)
        with torch.no_grad():
            out = init(t)
        assert out is t and spmd.fetch_layout(t) == layout
        results.append(gather(t))
    for r in results[1:]:
        assert torch.equal(r, results[0])
    assert results[0].std() > 0.25


def test_rand_like_is_layout_invariant():
    results = []
    for layout in all_layouts(MESH, (4, 4)):
        torch.manual_seed(5)
        results.append(gather(torch.rand_like(spmd.zeros(4, 4, layout=layout))))
    assert all(torch.equal(r, results[0]) for r in results)


# -- mixing DTensors with other things -----------------------------------------------------------------------------
def test_two_meshes_mismatch():
    other = spmd.create_mesh([("a", 4)])
    a = distribute(rand(4, 4), spmd.Layout(["x", spmd.UNSHARDED], MESH))
    b = distribute(rand(4, 4), spmd.Layout(["a", spmd.UNSHARDED], other))
    with pytest.raises(spmd.MeshMismatchError):
        a + b
    with pytest.raises(ValueError, match="different meshes"):
        torch.mm(a, b)


def test_plain_tensor_is_rejected():
    a = distribute(rand(4, 4), spmd.Layout(["x", spmd.UNSHARDED], MESH))
    with pytest.raises(spmd.MixedTensorError, match="copy_to_mesh"):
        torch.add(a, torch.ones(4, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="copy_to_mesh"):
        torch.mul(torch.ones(4, dtype=torch.float64), a)
    with pytest.raises(spmd.MixedTensorError, match="copy_to_mesh"):
        torch.mm(a, torch.ones(4, 4, dtype=torch.float64))
    # torch's operators turn a TypeError from an operand into NotImplemented: `+` raises a plain TypeError
    with pytest.raises(TypeError):
        a + torch.ones(4, 4, dtype=torch.float64)


def test_small_integer_tensors_broadcast_as_replicated_as_in_tf():
    """TF DTensor's rule: plain int32/int64 tensors of fewer than 20 elements (indices, shapes) are replicated;
    larger ones, and floating ones, are mixed tensors. Short bool tensors are indices too (a list of bools)."""
    value = rand(4, 6)
    a = distribute(value, spmd.Layout(["x", "y"], MESH)).requires_grad_()
    for index in ([0, 2], torch.tensor([3, 1]), torch.tensor([[1], [0]], dtype=torch.int32), [True, False, True, True]):
        assert torch.equal(gather(a[index]), value[index])
    columns = torch.tensor([0, 4])
    (torch.index_select(a, 1, columns) * 3).sum().backward()
    assert torch.equal(gather(a.grad), torch.zeros(4, 6).index_fill(1, columns, 3).double())
    with pytest.raises(spmd.MixedTensorError, match="fewer than 20"):
        a[torch.arange(20) % 4]
    with pytest.raises(spmd.MixedTensorError, match=r"shape \[6\]"):
        torch.add(a, torch.ones(6, dtype=torch.float64))


def test_scalars_broadcast():
    x = rand(4, 4)
    a = distribute(x, spmd.Layout(["x", "y"], MESH))
    zero_d = torch.tensor(3.0, dtype=torch.float64)
    out = (a + zero_d) * 2 - 1
    assert spmd.fetch_layout(out) == spmd.fetch_layout(a)
    torch.testing.assert_close(gather(out), (x + 3) * 2 - 1)
    torch.testing.assert_close(gather(torch.maximum(a, zero_d)), torch.maximum(x, zero_d))


# -- output layouts: TF DTensor's eager rules (reference §4 probes on a 2x2 mesh) -----------------------------------
U = spmd.UNSHARDED
TF_LAYOUTS = [  # (name, op, [(shape, specs) per input], expected output specs)
    ("add [x,U]+[U,y]", torch.add, [((4, 4), "xU"), ((4, 4), "Uy")], "xy"),
    ("add [U,U]+[x,y]", torch.add, [((4, 4), "UU"), ((4, 4), "xy")], "xy"),
    ("add [x,U]+[U,x]", torch.add, [((4, 4), "xU"), ((4, 4), "Ux")], "UU"),
    ("add [x,y]+[y,x]", torch.add, [((4, 4), "xy"), ((4, 4), "yx")], "UU"),
    ("add [x,U]+[y,U]", torch.add, [((4, 4), "xU"), ((4, 4), "yU")], "xU"),
    ("add [y,U]+[x,U]", torch.add, [((4, 4), "yU"), ((4, 4), "xU")], "yU"),
    ("add [x,y]+[y]", torch.add, [((4, 4), "xy"), ((4,), "y")], "xy"),
    ("add [x,y]+[x]", torch.add, [((4, 4), "xy"), ((4,), "x")], "UU"),
    ("mm [U,y]@[y,U]", torch.mm, [((4, 4), "Uy"), ((4, 4), "yU")], "UU"),
    ("mm [x,y]@[y,U]", torch.mm, [((4, 4), "xy"), ((4, 4), "yU")], "xU"),
    ("mm [x,U]@[U,y]", torch.mm, [((4, 4), "xU"), ((4, 4), "Uy")], "xy"),
    ("mm [x,U]@[y,U]", torch.mm, [((4, 4), "xU"), ((4, 4), "yU")], "xU"),
    ("mm [U,y]@[U,x]", torch.mm, [((4, 4), "Uy"), ((4, 4), "Ux")], "Ux"),
    ("mm [x,U]@[U,x]", torch.mm, [((4, 4), "xU"), ((4, 4), "Ux")], "UU"),
    ("mm [U,x]@[x,U]", torch.mm, [((4, 4), "Ux"), ((4, 4), "xU")], "UU"),
    ("einsum bsd,dnh->bsnh", lambda a, b: torch.einsum("bsd,dnh->bsnh", a, b),
     [((4, 4, 4), "xUy"), ((4, 4, 4), "UyU")], "xUyU"),
    ("einsum ij,jk [x,y][y,U]", lambda a, b: torch.einsum("ij,jk->ik", a, b), [((4, 4), "xy"), ((4, 4), "yU")], "xU"),
    ("einsum ij,jk [U,y][y,x]", lambda a, b: torch.einsum("ij,jk->ik", a, b), [((4, 4), "Uy"), ((4, 4), "yx")], "Ux"),
    ("sum [x,U] 0", lambda a: a.sum(0), [((4, 4), "xU")], "U"),
    ("sum [x,U] 1", lambda a: a.sum(1), [((4, 4), "xU")], "x"),
    ("sum [x,U] all", torch.sum, [((4, 4), "xU")], ""),
    ("sum [x,y] 0", lambda a: a.sum(0), [((4, 4), "xy")], "y"),
    ("amax [x,y] 0 keepdim", lambda a: a.amax(0, keepdim=True), [((4, 4), "xy")], "Uy"),
    ("mean [x,y]", torch.mean, [((4, 4), "xy")], ""),
    ("argmax [x,y] 1", lambda a: a.argmax(1), [((4, 4), "xy")], "x"),
    ("logsumexp [x,U] -1", lambda a: torch.logsumexp(a, -1), [((4, 4), "xU")], "x"),
    ("reshape [x,U] 4x4->16", lambda a: a.reshape(16), [((4, 4), "xU")], "x"),
    # TF gathers y in these two ([x,U] and [x]); spmd's reshape hands y to the first axis (an all-to-all), whose
    # blocks then shard the output over both dims
    ("reshape [x,y] 4x4->2x8", lambda a: a.reshape(2, 8), [((4, 4), "xy")], "xy"),
    ("reshape [U,y] 4x4->4x2x2", lambda a: a.reshape(4, 2, 2), [((4, 4), "Uy")], "UyU"),
    ("reshape [x,y] 4x4->16", lambda a: a.reshape(16), [((4, 4), "xy")], ["x+y"]),
    ("reshape [U,x,U] ->[2,16]", lambda a: a.reshape(2, 16), [((2, 4, 4), "UxU")], "Ux"),
    ("cumsum sharded axis", lambda a: a.cumsum(0), [((4, 4), "xU")], "xU"),  # blocks completed by their totals
    ("permute [U,y,x] (2,0,1)", lambda a: a.permute(2, 0, 1), [((4, 4, 4), "Uyx")], "xUy"),
    ("squeeze [U,x,U]", torch.squeeze, [((1, 2, 1), "UxU")], "x"),
    ("slice [x,U][0:1,0:2]", lambda a: a[0:1, 0:2], [((4, 4), "xU")], "UU"),
    ("slice [x,y][0:1]", lambda a: a[0:1], [((4, 4), "xy")], "Uy"),
    ("topk [x,y]", lambda a: a.topk(2)[0], [((4, 4), "xy")], "xU"),
    ("tril [x,y]", lambda a: a.tril(1), [((4, 4), "xy")], "xy"),  # each block keeps its side of the diagonal
    ("triu_ [U,y,x]", lambda a: a.triu_(-1), [((2, 4, 8), "Uyx")], "Uyx"),
    ("embedding [x,U] idx[y]", lambda t, i: F.embedding(i, t), [((8, 4), "xU"), ((4,), "y")], "yU"),
    ("embedding [U,y] idx[x]", lambda t, i: F.embedding(i, t), [((8, 4), "Uy"), ((4,), "x")], "xy"),
    ("embedding [x,y] idx[U]", lambda t, i: F.embedding(i, t), [((8, 4), "xy"), ((4,), "U")], "Uy"),
    # Where spmd deliberately differs from TF (values are the same; see each note):
    # TF keeps [x,y] (an inferred all-reduce on the softmax axis); so does spmd (engine/rules/vocab_parallel.py).
    ("softmax [x,y] (TF: [x,y])", lambda a: a.softmax(-1), [((4, 4), "xy")], "xy"),
    # TF merges the concat axis too (x then claims two axes and is dropped); spmd merges the other axes only.
    ("cat [U,x,y]+[x,U,U] (TF: [U,U,y])", lambda a, b: torch.cat([a, b], 1),
     [((4, 4, 4), "Uxy"), ((4, 4, 4), "xUU")], "xUy"),
    # TF all-gathers a vocabulary-sharded table and follows the ids; spmd looks up locally and all-reduces over
    # the vocabulary mesh dim, so ids cannot stay sharded on that dim.
    ("embedding [x,U] idx[x] (TF: [x,U])", lambda t, i: F.embedding(i, t), [((8, 4), "xU"), ((4,), "x")], "UU"),
    ("embedding [x,y] idx[x] (TF: [x,y])", lambda t, i: F.embedding(i, t), [((8, 4), "xy"), ((4,), "x")], "Uy"),
]


def _specs(s: str | list) -> list[str]:
    return s if isinstance(s, list) else [U if c == "U" else c for c in s]  # (a list: axes over several dims)


@pytest.mark.parametrize("name,fn,inputs,want", TF_LAYOUTS, ids=[t[0] for t in TF_LAYOUTS])
def test_output_layout(name, fn, inputs, want):
    args = []
    for i, (shape, specs) in enumerate(inputs):
        value = _ids(shape, 8) if name.startswith("embedding") and i == 1 else rand(*shape, seed=i)
        args.append(distribute(value, spmd.Layout(_specs(specs), MESH)))
    out = fn(*args)
    assert spmd.fetch_layout(out).sharding_specs == _specs(want)


@pytest.mark.parametrize("fn, inputs, grad", [
    (lambda t: t.as_strided((2, 2), (1, 2)), [rand(4, 4)], True),
    (lambda t: t.as_strided((3, 2), (4, 1), 2), [rand(4, 4)], True),
    (lambda t, s: torch.as_strided_scatter(t, s, (2, 2), (1, 4)), [rand(4, 4), rand(2, 2, seed=1)], True),
    # its backward builds a plain index tensor inside torch: a MixedTensorError, so forward only
    (lambda t: torch.as_strided_copy(t, (2, 3), (2, 1)), [rand(4, 4)], False),
], ids=["view", "offset", "scatter", "copy"])
def test_as_strided_addresses_the_global_tensor(fn, inputs, grad):
    """as_strided reads the global tensor's memory (its backward writes through a view of a fresh buffer): values
    and gradients equal torch's for every layout."""
    check_op(lambda *t: fn(*t) * 1, inputs, grad=grad)


@pytest.mark.parametrize("fn", [lambda t: torch.diagonal(t), lambda t: torch.diagonal(t, 1),
                                lambda t: t.diagonal(-1, 1, 0), lambda t: torch.linalg.qr(t).Q, lambda t: torch.linalg.qr(t).R,
                                lambda t: torch.linalg.svd(t).U.abs(), lambda t: torch.linalg.svdvals(t)],
                         ids=["diagonal", "diagonal_offset", "diagonal_transposed", "qr_Q", "qr_R", "svd_U", "svdvals"])
def test_linear_algebra_and_diagonal_views(fn):
    """Composite backwards write through views (`diagonal(...).mul_`): the views must be real."""
    check_op(fn, [rand(4, 4)])


@pytest.mark.parametrize("fn", [lambda z: z.conj() * 2, lambda z: torch.view_as_real(z.conj().resolve_conj()),
                                lambda z: (z.conj() + z).real, lambda z: torch.fft.ihfft(z.real).abs(),
                                lambda z: torch.polar(z.abs(), z.angle()).abs()],
                         ids=["conj_mul", "conj_view_as_real", "conj_add", "ihfft", "polar"])
def test_lazy_conjugation_is_computed(mesh22, fn):
    """torch's lazy conjugate is a bit its kernels read; a DTensor's components never carry it."""
    z = torch.randn(4, 4, dtype=torch.complex128, generator=torch.Generator().manual_seed(0))
    for layout in all_layouts(mesh22, (4, 4)):
        torch.testing.assert_close(gather(fn(spmd.copy_to_mesh(z, layout))), fn(z))


def test_tril_and_triu_of_a_matrix_sharded_both_ways_run_where_the_blocks_are():
    """Each device zeroes its block's dropped side of the diagonal, shifted by the block's first row and column: no
    collective, the layout kept, forward and backward."""
    x = rand(6, 8)
    d = distribute(x, spmd.Layout(["x", "y"], MESH)).requires_grad_()
    out, forward = issued(lambda: torch.tril(d, 1) * 2 + torch.triu(d, -3))
    _, backward = issued(lambda: out.sum().backward())
    assert forward == backward == [] and spmd.fetch_layout(out).sharding_specs == ["x", "y"]
    ref = x.clone().requires_grad_()
    (torch.tril(ref, 1) * 2 + torch.triu(ref, -3)).sum().backward()
    torch.testing.assert_close(gather(out), torch.tril(x, 1) * 2 + torch.triu(x, -3))
    torch.testing.assert_close(gather(d.grad), ref.grad)


def test_kernels_that_want_torchs_own_strides_get_them_from_a_gathered_axis():
    """A gather on a 1-D mesh leaves the shared copy's memory in the devices' order (the gathered axis not the
    fastest-moving one): attention's fused CPU kernels (a head dim of one column per device), group norm's (one
    channel per device) and a convolution's bias added after its sum over input channels get what plain torch gives
    them."""
    check_op(F.scaled_dot_product_attention, [rand(1, 2, 4, 2), rand(1, 2, 4, 2, seed=1), rand(1, 2, 4, 2, seed=2)],
             mesh=MESH_LINE)
    check_op(lambda x: F.group_norm(x, 2), [rand(3, 2, 5)], mesh=MESH_LINE)
    check_op(lambda x, w, b: F.conv1d(x, w, b), [rand(2, 4, 5), rand(3, 4, 3, seed=1), rand(3, seed=2)], mesh=MESH_LINE)
    check_op(lambda x, w, b: F.conv_transpose1d(x, w, b), [rand(2, 4, 5), rand(4, 3, 3, seed=1), rand(3, seed=2)],
             mesh=MESH_LINE)


@pytest.mark.parametrize("fn", [lambda t: t.cumsum(0), lambda t: t.cumprod(-1), lambda t: t.flip(0),
                                lambda t: t.softmax(0), lambda t: t.log_softmax(-1), lambda t: t.sort(0).values,
                                lambda t: t.topk(1).values],
                         ids=["cumsum", "cumprod", "flip", "softmax", "log_softmax", "sort", "topk"])
def test_ops_along_dim_0_of_a_0d_tensor(fn):
    """torch reads a 0-d tensor as one element along dim 0."""
    check_op(fn, [rand()])


def test_gather_along_dim_0_of_a_0d_tensor():
    check_op(lambda t, i: t.gather(0, i), [rand(), Const(torch.tensor(0))])


def test_scatter_into_a_plain_0d_tensor():
    """torch 2.11's gradient of `max(0)`, `sort`, `topk` of a 0-d tensor: a plain `zeros(())` scattered into."""
    check_op(lambda s, i: torch.zeros((), dtype=s.dtype).scatter(0, i, s), [rand(), Const(torch.tensor(0))])


@pytest.mark.parametrize("fn, grad", [
    (lambda t, e: torch.frexp(t).mantissa, False),  # two outputs
    (lambda t, e: t.clone().transpose_(0, 1), True),
    (lambda t, e: torch.linalg.inv(t + e), True),  # linalg checks its info codes
    (lambda t, e: torch.linalg.solve(t + e, t), True),
], ids=["frexp", "transpose_", "inv", "solve"])
def test_ops_torch_composes_unusually(fn, grad):
    check_op(fn, [rand(4, 4), Const(4 * torch.eye(4, dtype=torch.float64))], grad=grad)
