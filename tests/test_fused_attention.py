"""The fused attention kernels torch's scaled_dot_product_attention picks on CUDA (flash, memory-efficient, cuDNN),
forward and backward, on DTensors: every layout gives plain torch's answer and no collective runs.

These ops have CUDA kernels only. To test their sharding rule on any machine, the module registers reference CPU
kernels for them (the attention formula, with each op's signature and outputs); tests/test_cuda.py runs the real
kernels when a GPU is present.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import spmd
from spmd.errors import UnsupportedOpError
from sweep import MESH, Const, all_layouts, check_op, distribute, issued, rand

aten = torch.ops.aten
_Q = all_layouts(MESH, (2, 2, 4, 2))


# -- reference CPU kernels --------------------------------------------------------------------------------------
def _scores(q, k, bias, causal, scale):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    w = q @ k.transpose(-2, -1) * scale
    if bias is not None:
        w = w + bias
    if causal:
        w = w.masked_fill(torch.ones(w.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return w, scale


def _forward(q, k, v, bias, causal, scale):
    w, _ = _scores(q, k, bias, causal, scale)
    lse = w.logsumexp(-1)
    return (w - lse[..., None]).exp() @ v, lse


def _backward(g, q, k, v, bias, out, causal, scale):
    w, scale = _scores(q, k, bias, causal, scale)
    p = w.softmax(-1)
    gw = p * (g @ v.transpose(-2, -1) - (g * out).sum(-1, keepdim=True))
    return gw @ k * scale, gw.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ g


def _none(dtype=torch.int64):
    return torch.empty(0, dtype=dtype)


def flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    out, lse = _forward(q, k, v, None, is_causal, scale)
    return (out, lse, _none(), _none(), q.shape[2], k.shape[2], torch.zeros(2, dtype=torch.uint64),
            torch.zeros((), dtype=torch.uint64), _none(q.dtype))


def flash_backward(g, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
                   scale=None):
    return _backward(g, q, k, v, None, out, is_causal, scale)


def efficient(q, k, v, bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    out, lse = _forward(q, k, v, bias, is_causal, scale)
    return out, lse, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)


def efficient_backward(g, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal=False, *,
                       scale=None):
    return _backward(g, q, k, v, bias, out, is_causal, scale) + (_none(q.dtype),)


def cudnn(q, k, v, bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
          scale=None):
    out, lse = _forward(q, k, v, bias, is_causal, scale)
    return (out, lse[..., None], _none(), _none(), q.shape[2], k.shape[2], torch.zeros((), dtype=torch.int64),
            torch.zeros((), dtype=torch.int64), _none(q.dtype))


def cudnn_backward(g, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, *,
                   scale=None):
    return _backward(g, q, k, v, bias, out, is_causal, scale)


@pytest.fixture(scope="module", autouse=True)
def reference_kernels():
    """The reference kernels as the ops' CPU kernels, for this module only (not on a torch that has CPU kernels)."""
    lib = torch.library.Library("aten", "IMPL")
    for name, fn in [("_scaled_dot_product_flash_attention", flash),
                     ("_scaled_dot_product_flash_attention_backward", flash_backward),
                     ("_scaled_dot_product_efficient_attention", efficient),
                     ("_scaled_dot_product_efficient_attention_backward", efficient_backward),
                     ("_scaled_dot_product_cudnn_attention", cudnn),
                     ("_scaled_dot_product_cudnn_attention_backward", cudnn_backward)]:
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CPU"):
            pytest.skip(f"this torch has a CPU kernel for aten::{name}")
        lib.impl(name, fn, "CPU")
    yield
    lib._destroy()


# -- the ops on DTensors: (out, logsumexp), the values the backward needs ------------------------------------------
def flash_op(causal):
    return lambda q, k, v: aten._scaled_dot_product_flash_attention(q, k, v, is_causal=causal)[:2]


def efficient_op(causal):
    return lambda q, k, v, bias=None: aten._scaled_dot_product_efficient_attention(q, k, v, bias, True,
                                                                                   is_causal=causal)[:2]


def cudnn_op(causal):
    return lambda q, k, v, bias=None: aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True,
                                                                               is_causal=causal)[:2]


QKV = [rand(2, 2, 4, 2), rand(2, 2, 4, 2, seed=1), rand(2, 2, 4, 2, seed=2)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("make", [flash_op, efficient_op, cudnn_op], ids=["flash", "efficient", "cudnn"])
def test_fused_attention_matches_plain_torch_for_every_layout_of_query(make, causal):
    check_op(make(causal), QKV, layouts=[_Q, _Q[::7], _Q[::8]])


@pytest.mark.parametrize("make", [efficient_op, cudnn_op], ids=["efficient", "cudnn"])
def test_fused_attention_with_a_broadcast_bias(make):
    bias = Const(rand(2, 1, 4, 4, seed=3))
    check_op(make(False), QKV + [bias], layouts=[_Q[::3], _Q[::10], _Q[1::10], all_layouts(MESH, (2, 1, 4, 4))[::2]])


@pytest.mark.parametrize("make", [flash_op, efficient_op, cudnn_op], ids=["flash", "efficient", "cudnn"])
def test_batch_and_head_sharded_attention_runs_no_collective(make):
    layout = spmd.Layout(["x", "y", spmd.UNSHARDED, spmd.UNSHARDED], MESH)
    q, k, v = (distribute(t, layout).requires_grad_() for t in QKV)
    (out, lse), forward = issued(lambda: make(True)(q, k, v))
    _, backward = issued(lambda: out.sum().backward())
    assert (forward, backward) == ([], [])
    assert spmd.fetch_layout(out) == layout and spmd.fetch_layout(q.grad) == layout
    assert spmd.fetch_layout(lse).sharding_specs[:3] == ["x", "y", spmd.UNSHARDED]


def test_attention_dropout_is_refused_with_the_way_out():
    q = distribute(QKV[0], spmd.Layout(["x", "y", spmd.UNSHARDED, spmd.UNSHARDED], MESH))
    with pytest.raises(UnsupportedOpError, match="SDPBackend.MATH"):
        aten._scaled_dot_product_efficient_attention(q, q, q, None, True, 0.1)


def test_attention_dropout_under_the_math_kernel_is_layout_invariant():
    """The way out the refusal names: the math kernel's dropout is spmd's, the same mask for every layout."""
    x = rand(4, 4, 8, 8)
    outs = []
    u = spmd.UNSHARDED
    for specs in (["x", "y", u, u], [u] * 4, ["y", u, "x", u]):
        q = distribute(x, spmd.Layout(specs, MESH))
        torch.manual_seed(0)
        with sdpa_kernel(SDPBackend.MATH):
            outs.append(spmd.to_global(F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)))
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0])
    assert not torch.allclose(outs[0], F.scaled_dot_product_attention(x, x, x))  # dropout took place


# -- context parallelism: the query's rows kept sharded (torch's CPU kernel) ------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cpu_attention_matches_plain_torch_for_every_layout_of_query(causal):
    """torch's CPU flash kernel, every layout of the query (its rows sharded too) against a few of the keys' and
    values': values and gradients as plain torch's; a causal mask is each device's own where the rows are sharded."""
    check_op(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), QKV,
             layouts=[_Q, _Q[::7], _Q[::8]])


def test_cpu_attention_with_a_mask_over_sharded_rows():
    mask = Const(rand(4, 4, seed=5))
    check_op(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), QKV + [mask],
             layouts=[_Q[::2], _Q[::9], _Q[1::9], all_layouts(MESH, (4, 4))])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sequence_sharded_attention_is_context_parallel(causal):
    """Query, key and value sharded along the sequence over "x" (and the batch over "y"): each device attends its
    own query rows to the gathered keys and values — an all-gather of each in forward (again in backward), the
    output and the query's gradient sharded as the query, the key's and value's gradients reduce-scattered."""
    layout = spmd.Layout(["y", spmd.UNSHARDED, "x", spmd.UNSHARDED], MESH)
    plain = [t.clone().requires_grad_() for t in QKV]
    q, k, v = (distribute(t, layout).requires_grad_() for t in QKV)
    out, forward = issued(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    _, backward = issued(lambda: out.sum().backward())
    assert forward == [("all_gather", ("x",))] * 2
    assert backward == [("all_gather", ("x",))] * 2 + [("reduce_scatter", ("x",))] * 2
    want = F.scaled_dot_product_attention(*plain, is_causal=causal)
    want.sum().backward()
    assert spmd.fetch_layout(out) == layout and all(spmd.fetch_layout(t.grad) == layout for t in (q, k, v))
    torch.testing.assert_close(spmd.to_global(out), want)
    for got, expected in zip((q, k, v), plain):
        torch.testing.assert_close(spmd.to_global(got.grad), expected.grad)
