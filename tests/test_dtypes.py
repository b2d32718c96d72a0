"""Result dtypes are torch's in every layout: the DTensor's dtype, its global value's and every device's component's.

Torch promotes a 0-d tensor more weakly than a dimensioned one (`bf16 * f32_0d` is bf16), and its integer sums and
scans widen to int64 unless given `dtype=`; the components of a DTensor have one more axis than it, and the
collectives combine partial results, so both have to be kept as the global tensor would have them.
"""

from __future__ import annotations

import pytest
import torch

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
    same(on(mesh22, x, "x", U) * total, x * v.sum())


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
