"""Result dtypes and roundings are torch's in every layout: the DTensor's dtype, its global value's and every
device's component's; and where an op needs no sum over devices, its values bit for bit (bfloat16 and float16
included), since each device computes exactly the block torch computes.

Torch promotes a 0-d tensor more weakly than a dimensioned one (`bf16 * f32_0d` is bf16), its integer sums and
scans widen to int64 unless given `dtype=`, and its reduced-precision kernels compute in float32 and round once;
the components of a DTensor have one more axis than it, and the collectives combine partial results, so all of
this has to be kept as the global tensor would have it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import UNSHARDED as U, Layout


def on(mesh, t, *specs):
    return spmd.copy_to_mesh(t, Layout(list(specs), mesh))


def same(got, want):
    """Values, dtype and every component's dtype equal to plain torch's."""
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert {c.dtype for c in spmd.unpack(got)} == {want.dtype}
    value = spmd.to_global(got)
    assert value.dtype == want.dtype and torch.equal(value, want), (value, want)


MATRIX_LAYOUTS = [(U, U), ("x", U), (U, "y"), ("x", "y"), (("x", "y"), U)]
VECTOR_LAYOUTS = [(U,), ("x",), (("x", "y"),)]


@pytest.mark.parametrize("layout", MATRIX_LAYOUTS)
@pytest.mark.parametrize("dims_dtype, zero_d_dtype", [
    (torch.bfloat16, torch.float32), (torch.float16, torch.float64), (torch.int8, torch.int64),
    (torch.uint8, torch.int32), (torch.float32, torch.float64), (torch.int32, torch.float64)])
def test_a_0d_dtensor_promotes_as_torchs_0d_tensors_do(mesh22, layout, dims_dtype, zero_d_dtype):
    x = (torch.arange(16).reshape(4, 4) * 37 % 120).to(dims_dtype)
    s = torch.tensor(100, dtype=zero_d_dtype)
    dx, ds = on(mesh22, x, *layout), on(mesh22, s)
    same(dx + ds, x + s)
    same(ds * dx, s * x)
    same(torch.maximum(dx, ds), torch.maximum(x, s))
    same(torch.where(dx > 50, dx, ds), torch.where(x > 50, x, s))
    same(dx == ds, x == s)
    if torch.can_cast(torch.result_type(x, s), dims_dtype):
        dx.add_(ds)
        x.add_(s)
        same(dx, x)


def test_a_pending_0d_sum_of_another_dtype_is_promoted_as_one_value(mesh22):
    v = torch.arange(8.)
    total = on(mesh22, v, "x").sum()  # a partial sum on each device until it is read
    x = torch.ones(4, 4, dtype=torch.bfloat16)
    # (the other operand not sharded over the sum's mesh dim, so that the product could stay pending)
    same(on(mesh22, x, "y", U) * total, x * v.sum())
    same(on(mesh22, v, "x").sum() * on(mesh22, x, U, U), v.sum() * x)  # (the pending sum first)


@pytest.mark.parametrize("layout", [("x", U), (("x", "y"), U), ("x", "y")])
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32])
def test_integer_sums_and_scans_over_sharded_axes_keep_the_requested_dtype(mesh22, layout, dtype):
    t = torch.arange(16, dtype=torch.int32).reshape(4, 4) * 21  # int8 sums wrap, as torch's
    d = on(mesh22, t, *layout)
    same(d.sum(0, dtype=dtype), t.sum(0, dtype=dtype))
    same(d.sum((0, 1), dtype=dtype), t.sum((0, 1), dtype=dtype))
    same(d.cumsum(0, dtype=dtype), t.cumsum(0, dtype=dtype))
    same(d.cumprod(0, dtype=dtype), t.cumprod(0, dtype=dtype))


@pytest.mark.parametrize("layout", VECTOR_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32])
def test_integer_products_of_vectors_keep_their_dtype(mesh22, layout, dtype):
    v = torch.full((4,), 100, dtype=dtype)  # int8: 40000 wraps to 64, as torch's
    d = on(mesh22, v, *layout)
    same(torch.dot(d, d), torch.dot(v, v))
    same(torch.inner(d, d), torch.inner(v, v))
    same(d @ d, v @ v)
    same(torch.vdot(d, d), torch.vdot(v, v))


@pytest.mark.parametrize("layout", VECTOR_LAYOUTS)
def test_vdot_conjugates_its_first_operand(mesh22, layout):
    a = torch.tensor([1 + 2j, 3 - 1j, 1j, 2 + 0j])
    b = torch.tensor([1 - 1j, 2 + 2j, 1 + 0j, 3j])
    same(torch.vdot(on(mesh22, a, *layout), on(mesh22, b, *layout)), torch.vdot(a, b))


@pytest.mark.parametrize("x_layout, w_layout, b_layout", [
    ((U, U), ("x", U), ("x",)),  # column-parallel: each device's rows of the weight and the bias
    (("y", U), ("x", U), ("x",)),  # and batch-sharded
    (("x", U), (U, U), (U,)),  # batch-sharded, every device the whole weight and bias
    (("x", U), ("y", U), (U,)),  # the bias replicated over the weight's sharded dim
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_with_a_bias_rounds_once_as_torchs(mesh22, x_layout, w_layout, b_layout, dtype):
    """torch's addmm adds the bias inside the product (one rounding); so does each device's, where the product
    needs no sum over devices."""
    torch.manual_seed(0)
    x, w, b = torch.randn(32, 16, dtype=dtype), torch.randn(32, 16, dtype=dtype), torch.randn(32, dtype=dtype)
    got = torch.nn.functional.linear(on(mesh22, x, *x_layout), on(mesh22, w, *w_layout), on(mesh22, b, *b_layout))
    same(got, torch.nn.functional.linear(x, w, b))


def _bf16(*shape, seed=0, positive=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return (t.abs() + 0.5 if positive else t).to(torch.bfloat16)


# (name, op, inputs, their layouts on the 2x2 mesh): ops needing no sum over devices in these layouts
EXACT = {
    "baddbmm, batch sharded": (torch.baddbmm, [_bf16(4, 4, 4), _bf16(4, 4, 8, seed=1), _bf16(4, 8, 4, seed=2)],
                               [("x", U, U)] * 3),
    "addmv, rows sharded": (torch.addmv, [_bf16(8), _bf16(8, 16, seed=1), _bf16(16, seed=2)], [("x",), ("x", U), (U,)]),
    "addbmm, replicated": (torch.addbmm, [_bf16(4, 4), _bf16(4, 4, 8, seed=1), _bf16(4, 8, 4, seed=2)],
                           [(U, U), (U, U, U), (U, U, U)]),
    "bilinear, batch sharded": (F.bilinear, [_bf16(8, 6), _bf16(8, 5, seed=1), _bf16(4, 6, 5, seed=2)],
                                [("x", U), ("x", U), (U, U, U)]),
    "cross_entropy mean, replicated": (lambda x, t: F.cross_entropy(x, t), [_bf16(8, 10), torch.arange(8) % 10],
                                       [(U, U), (U,)]),
    "batch_norm eval, channels sharded": (
        lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b, training=False),
        [_bf16(8, 8, 6), _bf16(8, seed=1), _bf16(8, seed=2, positive=True), _bf16(8, seed=3), _bf16(8, seed=4)],
        [("x", "y", U), ("y",), ("y",), ("y",), ("y",)]),
    "batch_norm eval, fp32 statistics": (
        lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b, training=False),
        [_bf16(8, 8, 6), torch.randn(8), torch.rand(8) + 0.5, torch.randn(8), torch.randn(8)],
        [("x", U, U), (U,), (U,), (U,), (U,)]),
    "batch_norm training, whole batch": (  # (the running statistics after the update, too)
        lambda x, m, v, w, b: torch.cat([F.batch_norm(x, m, v, w, b, training=True).float().flatten(), m, v]),
        [_bf16(8, 8, 6), torch.randn(8), torch.rand(8) + 0.5, torch.randn(8), torch.randn(8)],
        [(U, "y", U), ("y",), ("y",), ("y",), ("y",)]),
}


@pytest.mark.parametrize("name", list(EXACT))
def test_ops_without_a_sum_over_devices_round_as_torchs(mesh22, name):
    fn, values, layouts = EXACT[name]
    distributed = [on(mesh22, v, *layout) for v, layout in zip(values, layouts)]  # (before fn updates `values`)
    same(fn(*distributed), fn(*values))


@pytest.mark.parametrize("x_layout", [(U, U, U, U), ("x", U, U, U)])
def test_group_norm_weight_and_bias_gradients_sum_as_torchs(mesh22, x_layout):
    """torch sums a bfloat16 input's gradients into float32 parameters' gradients in float32."""
    x, go = _bf16(4, 8, 4, 4), _bf16(4, 8, 4, 4, seed=1)
    w, b = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    F.group_norm(x, 2, w, b).backward(go)
    dw, db = on(mesh22, w.detach(), U).requires_grad_(), on(mesh22, b.detach(), U).requires_grad_()
    F.group_norm(on(mesh22, x, *x_layout), 2, dw, db).backward(on(mesh22, go, *x_layout))
    if x_layout[0] is U:
        same(dw.grad, w.grad)
        same(db.grad, b.grad)
    else:  # (each device's samples summed as torch's kernel sums them, then summed over devices)
        torch.testing.assert_close(spmd.to_global(db.grad), b.grad)
        torch.testing.assert_close(spmd.to_global(dw.grad), w.grad)


def test_batch_norm_over_a_sharded_batch_computes_in_float32_and_returns_torchs_dtypes(mesh22):
    x, stats = _bf16(8, 4, 6), [torch.zeros(4), torch.ones(4)]
    w, b = torch.randn(4), torch.randn(4)
    d_stats = [on(mesh22, t, U) for t in stats]
    want = torch.ops.aten.native_batch_norm(x, w, b, *stats, True, 0.1, 1e-5)  # (updates `stats`)
    got = torch.ops.aten.native_batch_norm(on(mesh22, x, "x", U, U), on(mesh22, w, U), on(mesh22, b, U), *d_stats,
                                           True, 0.1, 1e-5)
    assert [t.dtype for t in got] == [t.dtype for t in want] == [torch.bfloat16, torch.float32, torch.float32]
    for g, t in zip(got, want):
        torch.testing.assert_close(spmd.to_global(g), t)
    for d, t in zip(d_stats, stats):
        torch.testing.assert_close(spmd.to_global(d), t)


def test_a_plain_0d_bias_is_added_by_every_device(mesh22):
    m, v = torch.randn(8, 16), torch.randn(16)
    same(torch.addmv(torch.tensor(1.5), on(mesh22, m, "x", U), on(mesh22, v, U)), torch.addmv(torch.tensor(1.5), m, v))
