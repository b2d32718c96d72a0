"""Scans and reductions along a dim, the add-a-product contractions, distances, and indexing ops on DTensors:
every layout gives plain torch's values, gradients and components, and the axes the op does not walk along stay
sharded, with exactly the collectives a decomposable reduction needs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import UNSHARDED as U
from spmd import Layout
from spmd.engine import registry
from tests.sweep import MESH, issued, Const, check_op, rand, reduce_gradients, torch_differentiates

aten = torch.ops.aten
pytestmark = pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")


def _with_nans(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x.view(-1)[::5] = float("nan")
    return x


SCANS_AND_REDUCTIONS = {
    "cummax": (lambda x: torch.cummax(x, 1), [rand(4, 4)]),
    "cummin_dim0": (lambda x: torch.cummin(x, 0), [rand(4, 4)]),
    "cummax_0d": (lambda x: torch.cummax(x, 0), [rand()]),
    "logcumsumexp": (lambda x: torch.logcumsumexp(x, -1), [rand(4, 4)]),
    "kthvalue": (lambda x: torch.kthvalue(x, 2, 1, keepdim=True), [rand(4, 4)]),
    "median_full": (lambda x: torch.median(x), [rand(4, 4)]),
    "nanmedian_full": (lambda x: torch.nanmedian(x), [_with_nans(rand(4, 4))]),
    "nanmedian_dim": (lambda x: torch.nanmedian(x, 0), [_with_nans(rand(4, 4))]),
    "nansum_dim": (lambda x: torch.nansum(x, 1), [_with_nans(rand(4, 4))]),
    "nanmean_full": (lambda x: torch.nanmean(x), [_with_nans(rand(4, 4))]),
    "count_nonzero_full": (lambda x: torch.count_nonzero(x), [rand(4, 4, dtype=torch.int64)]),
    "count_nonzero_dims": (lambda x: torch.count_nonzero(x, (0, 2)), [rand(4, 2, 4, dtype=torch.int64)]),
    "aminmax_dim": (lambda x: torch.aminmax(x, dim=0), [rand(4, 4)]),
    "aminmax_full_int": (lambda x: torch.aminmax(x), [rand(4, 4, dtype=torch.int64)]),
    "aminmax_keepdim": (lambda x: torch.aminmax(x, dim=1, keepdim=True), [rand(4, 4)]),
    "dist_p2_broadcast": (lambda a, b: torch.dist(a, b), [rand(4, 4), rand(4, seed=1)]),
    "dist_p1": (lambda a, b: torch.dist(a, b, 1), [rand(4, 4), rand(4, 4, seed=1)]),
    "dist_inf": (lambda a, b: torch.dist(a, b, float("inf")), [rand(4, 4), rand(4, 4, seed=1)]),
    "dist_p3": (lambda a, b: torch.dist(a, b, 3), [rand(4, 4), rand(4, 4, seed=1)]),
    "pairwise_distance": (lambda a, b: F.pairwise_distance(a, b), [rand(4, 4), rand(4, 4, seed=1)]),
    "norm_p1": (lambda x: torch.norm(x, 1, dim=1), [rand(4, 4)]),
    "vdot": (lambda a, b: torch.vdot(a, b), [rand(4), rand(4, seed=1)]),
    "trace_wide": (lambda x: torch.trace(x), [rand(4, 6)]),
    "trace_tall": (lambda x: torch.trace(x), [rand(6, 4)]),
}


@pytest.mark.parametrize("name", list(SCANS_AND_REDUCTIONS))
def test_scans_and_reductions_match_torch_for_every_layout(name):
    fn, inputs = SCANS_AND_REDUCTIONS[name]
    assert check_op(fn, inputs, grad=torch_differentiates(fn, inputs), sample=16) >= 1


CONTRACTIONS = {
    "addmv": (lambda b, m, v: torch.addmv(b, m, v, beta=0.5, alpha=2.0), [rand(4), rand(4, 6, seed=1),
                                                                         rand(6, seed=2)]),
    "addr": (lambda b, u, v: torch.addr(b, u, v, alpha=3.0), [rand(4, 2), rand(4, seed=1), rand(2, seed=2)]),
    "addbmm": (lambda b, x, y: torch.addbmm(b, x, y), [rand(4, 2), rand(2, 4, 4, seed=1), rand(2, 4, 2, seed=2)]),
    "bilinear": (lambda x1, x2, w, b: F.bilinear(x1, x2, w, b), [rand(4, 2), rand(4, 4, seed=1),
                                                                rand(2, 2, 4, seed=2), rand(2, seed=3)]),
    "cdist": (lambda a, b: torch.cdist(a, b), [rand(4, 6), rand(2, 6, seed=1)]),
    "cdist_batched_p1": (lambda a, b: torch.cdist(a, b, p=1), [rand(2, 4, 3), rand(2, 2, 3, seed=1)]),
    "cdist_broadcast_inf": (lambda a, b: torch.cdist(a, b, p=float("inf")), [rand(2, 4, 3), rand(2, 3, seed=1)]),
}


@pytest.mark.parametrize("name", list(CONTRACTIONS))
def test_contractions_and_distances_match_torch_for_every_layout(name):
    fn, inputs = CONTRACTIONS[name]
    assert check_op(fn, inputs, sample=16) >= 8


def _unique_index() -> torch.Tensor:
    return torch.tensor([[1, 0], [0, 3], [2, 2], [3, 1]])  # per row a permutation of some columns


def _replicated(t):
    return spmd.relayout(t, Layout.replicated(MESH, t.dim())) if spmd.is_dtensor(t) else t


def _ix(*values) -> Const:
    """An index tensor swept over its layouts too."""
    return Const(torch.tensor(values))


INDEXING = {
    "index_copy": (lambda x, i, s: x.index_copy(1, i, s), [rand(4, 4), _ix(3, 0), rand(4, 2, seed=1)]),
    "index_copy_0d_source": (lambda x, i, s: x.index_copy(0, i, s), [rand(4), Const(torch.tensor(2)), rand(seed=1)]),
    # in place into a replicated target (index_select's gradient with plain indices, as_strided's)
    "index_add_": (lambda x, i, s: x + _replicated(x.new_zeros(4, 4)).index_add_(1, i, s),
                   [rand(4, 4), _ix(3, 0), rand(4, 2, seed=1)]),
    "index_copy_": (lambda x, i, s: x * _replicated(x.new_ones(4, 4)).index_copy_(0, i, s),
                    [rand(4, 4), _ix(3, 0), rand(2, 4, seed=1)]),
    # rows added at their indices, both sharded alike: a pending sum (index_select's gradient)
    "index_add_rows": (lambda x, i, s: x.index_add(0, i, s, alpha=2.0), [rand(4, 4), _ix(3, 0, 3, 1),
                                                                         rand(4, 4, seed=1)]),
    # in place into a target of any layout: a sharded one keeps its layout, each device adding its own rows
    "index_add_into_rows": (lambda x, i, s: x.clone().index_add_(0, i, s, alpha=2.0),
                            [rand(4, 4), _ix(3, 0, 3, 1), rand(4, 4, seed=1)]),
    "scatter_add_rows": (lambda x, i, s: x.scatter_add(1, i, s), [rand(4, 4), _ix([0, 3], [1, 1], [2, 0], [3, 3]),
                                                                  rand(4, 2, seed=1)]),
    "index_fill": (lambda x, i: x.index_fill(0, i, -1.0), [rand(4, 4), _ix(1, 2)]),
    # the value's own gradient needs `_unique` (data-dependent, no rule): the value is not differentiated
    "index_fill_tensor": (lambda x, i, v: x.index_fill(1, i, v), [rand(4, 4), _ix(0), Const(rand(seed=1))]),
    "take": (lambda x, i: torch.take(x, i), [rand(4, 4), _ix([0, 15], [-1, 3], [7, 7], [2, 9])]),
    "put_accumulate": (lambda x, i, s: x.put(i, s, accumulate=True), [rand(4, 4), _ix(0, 5, 5, -1), rand(4, seed=1)]),
    "put": (lambda x, i, s: x.put(i, s), [rand(4, 4), _ix(0, 5, 9, -1), rand(4, seed=1)]),
    "masked_scatter": (lambda x, m, s: x.masked_scatter(m, s), [rand(4, 4), Const(rand(4, seed=1) > 0),
                                                                  rand(4, 4, seed=2)]),
    "unsafe_masked_index": (lambda x, m, i: aten._unsafe_masked_index(x, m, [i, None], 0.5),
                            [rand(4, 4), Const(rand(4, 4, seed=1) > 0), _ix(0, 3, 1, 1)]),
    "unsafe_masked_index_put_accumulate": (
        lambda x, m, i, v: aten._unsafe_masked_index_put_accumulate(x, m, [i], v),
        [rand(4, 4), Const(rand(4, 4, seed=1) > 0), _ix(0, 3, 1, 1), rand(4, 4, seed=2)]),
}
for _reduce in ("prod", "mean", "amax", "amin"):
    INDEXING[f"index_reduce_{_reduce}"] = (
        lambda x, i, s, r=_reduce: x.index_reduce(0, i, s, r, include_self=r != "mean"),
        [rand(4, 4), _ix(1, 3, 1, 0), rand(4, 4, seed=1)])
for _reduce in ("sum", "prod", "mean", "amax", "amin"):
    INDEXING[f"scatter_reduce_{_reduce}"] = (
        lambda x, i, s, r=_reduce: x.scatter_reduce(1, i, s, r),
        [rand(4, 4), Const(_unique_index()), rand(4, 2, seed=1)])


@pytest.mark.parametrize("name", list(INDEXING))
def test_indexing_matches_torch_for_every_layout(name):
    fn, inputs = INDEXING[name]
    assert check_op(fn, inputs, sample=16) >= 1


# -- the collectives ----------------------------------------------------------------------------------------------
def _dist(x, *specs):
    return spmd.copy_to_mesh(x, Layout(list(specs), MESH))


def _specs(t) -> list:
    return spmd.fetch_layout(t).sharding_specs


def test_a_scan_along_an_unsharded_dim_keeps_the_other_axis_sharded_without_collectives():
    x = _dist(rand(4, 4), "x", U)
    (values, indices), collectives = issued(lambda: torch.cummax(x, 1))
    assert collectives == [] and _specs(values) == _specs(indices) == ["x", U]
    want = torch.cummax(rand(4, 4), 1)
    torch.testing.assert_close(spmd.to_global(values), want.values)
    torch.testing.assert_close(spmd.to_global(indices), want.indices)


def test_counting_over_a_sharded_axis_is_one_all_reduce():
    x = _dist(rand(4, 4, dtype=torch.int64), "x", U)
    out, collectives = issued(lambda: spmd.to_global(torch.count_nonzero(x, 0)))
    assert collectives == [("all_reduce", ("x",))]
    torch.testing.assert_close(out, torch.count_nonzero(rand(4, 4, dtype=torch.int64), 0))


def test_nansum_over_both_axes_is_one_all_reduce_over_both_mesh_dims():
    x = _dist(_with_nans(rand(4, 4)), "x", "y")
    out, collectives = issued(lambda: spmd.to_global(torch.nansum(x)))
    assert collectives == [("all_reduce", ("x", "y"))]
    torch.testing.assert_close(out, torch.nansum(_with_nans(rand(4, 4))))


def test_aminmax_over_a_sharded_axis_is_one_min_and_one_max_all_reduce():
    x = _dist(rand(4, 4), U, "y")
    (low, high), collectives = issued(lambda: torch.aminmax(x, dim=1))
    assert collectives == [("all_reduce", ("y",)), ("all_reduce", ("y",))]
    torch.testing.assert_close(spmd.to_global(low), rand(4, 4).amin(1))
    torch.testing.assert_close(spmd.to_global(high), rand(4, 4).amax(1))


def test_dist_of_sharded_operands_is_one_all_reduce_over_both_mesh_dims_and_a_root():
    a, b = _dist(rand(4, 4), "x", "y"), _dist(rand(4, 4, seed=1), "x", "y")
    out, collectives = issued(lambda: torch.dist(a, b))
    assert collectives == [("all_reduce", ("x", "y"))]
    torch.testing.assert_close(spmd.to_global(out), torch.dist(rand(4, 4), rand(4, 4, seed=1)))


def test_trace_of_row_sharded_matrix_is_one_all_reduce_over_the_rows():
    x = _dist(rand(4, 6), "x", U)
    out, collectives = issued(lambda: spmd.to_global(torch.trace(x)))
    assert collectives == [("all_reduce", ("x",))]
    torch.testing.assert_close(out, torch.trace(rand(4, 6)))


def test_addmv_with_the_contracted_axis_sharded_is_one_all_reduce_and_the_bias_added_once():
    bias, m, v = _dist(rand(4), U), _dist(rand(4, 6, seed=1), U, "y"), _dist(rand(6, seed=2), "y")
    out, collectives = issued(lambda: spmd.to_global(torch.addmv(bias, m, v)))  # (a sum pending until read)
    assert collectives == [("all_reduce", ("y",))]
    torch.testing.assert_close(out, torch.addmv(rand(4), rand(4, 6, seed=1), rand(6, seed=2)))


def test_addbmm_with_the_batch_sharded_sums_the_batch_with_one_all_reduce():
    bias, x, y = _dist(rand(4, 2), U, U), _dist(rand(2, 4, 4, seed=1), "x", U, U), _dist(rand(2, 4, 2, seed=2),
                                                                                            "x", U, U)
    out, collectives = issued(lambda: spmd.to_global(torch.addbmm(bias, x, y)))  # (a sum pending until read)
    assert collectives == [("all_reduce", ("x",))]
    torch.testing.assert_close(out, torch.addbmm(rand(4, 2), rand(2, 4, 4, seed=1), rand(2, 4, 2, seed=2)))


def test_cdist_keeps_rows_sharded_and_its_gradient_sums_over_the_other_rows():
    a = _dist(rand(4, 3), "x", U).requires_grad_()
    b = _dist(rand(2, 3, seed=1), "y", U)
    out, forward = issued(lambda: torch.cdist(a, b))
    assert forward == [] and _specs(out) == ["x", "y"]
    weight = _dist(rand(4, 2, seed=2), "x", "y")
    _, backward = issued(lambda: (out.backward(weight), reduce_gradients([a])))  # a's pending sum, when read
    assert backward == [("all_reduce", ("y",))]
    ref = rand(4, 3).requires_grad_()
    want = torch.cdist(ref, rand(2, 3, seed=1))
    want.backward(rand(4, 2, seed=2))
    torch.testing.assert_close(spmd.to_global(out), want)
    torch.testing.assert_close(spmd.to_global(a.grad), ref.grad)


def test_indexing_along_an_unsharded_dim_keeps_the_other_axis_sharded_without_collectives():
    x, s = _dist(rand(4, 4), "x", U), _dist(rand(4, 2, seed=1), "x", U)
    rows, where = _dist(torch.tensor([3, 0]), U), _dist(_unique_index(), "x", U)
    for fn in (lambda: x.index_copy(1, rows, s), lambda: x.scatter_reduce(1, where, s, "amax"),
               lambda: x.index_fill(1, rows, 0.0), lambda: x.index_reduce(1, rows, s, "prod")):
        out, collectives = issued(fn)
        assert collectives == [] and _specs(out) == ["x", U]


@pytest.mark.parametrize("lookup", ["index_select", "gather"])
def test_a_lookup_at_sharded_indices_keeps_them_sharded_and_its_gradient_is_one_all_reduce(lookup):
    """A replicated table read at batch-sharded indices (as an embedding is): each device reads its own rows, and
    the table's gradient is their sum over the batch, one all-reduce, as data parallelism's is."""
    value = rand(4, 4)
    table = _dist(value, U, U).requires_grad_()
    plain = torch.tensor([3, 0, 3, 1])
    if lookup == "index_select":
        index, read = _dist(plain, "x"), lambda t, i: t.index_select(0, i)
    else:
        index, read = _dist(plain.view(4, 1).expand(4, 4).contiguous(), "x", U), lambda t, i: t.gather(0, i)
    out, collectives = issued(lambda: read(table, index))
    assert collectives == [] and _specs(out) == ["x", U]
    reference = value.clone().requires_grad_()
    read(reference, spmd.to_global(index)).backward(rand(4, 4, seed=1))
    _, collectives = issued(lambda: (out.backward(_dist(rand(4, 4, seed=1), "x", U)), spmd.to_global(table.grad)))
    assert collectives == [("all_reduce", ("x",))]
    torch.testing.assert_close(spmd.to_global(table.grad), reference.grad)


@pytest.mark.parametrize("inplace", [False, True])
def test_index_add_into_sharded_rows_keeps_them_sharded_without_collectives(inplace):
    """A mixture-of-experts layer adds each expert's outputs to its tokens' rows: with the rows sharded and the
    indices whole, each device adds the rows in its block (an index repeated, or in another block, included)."""
    x, rows, values = rand(4, 4), torch.tensor([3, 0, 3, 1, 2]), rand(5, 4, seed=1)
    target, source = _dist(x, "x", "y"), _dist(values, U, "y")
    add = torch.Tensor.index_add_ if inplace else torch.Tensor.index_add
    out, collectives = issued(lambda: add(target.clone(), 0, rows, source, alpha=2.0))
    assert collectives == []
    assert spmd.fetch_layout(out).sharding_specs == ["x", "y"]
    torch.testing.assert_close(spmd.to_global(out), x.index_add(0, rows, values, alpha=2.0))


def test_take_reads_a_replicated_tensor_at_sharded_indices_without_collectives():
    x = _dist(rand(4, 4), U, U)
    index = _dist(torch.tensor([[0, 15], [-1, 3], [7, 7], [2, 9]]), "x", "y")
    out, collectives = issued(lambda: torch.take(x, index))
    assert collectives == [] and _specs(out) == ["x", "y"]
    torch.testing.assert_close(spmd.to_global(out), torch.take(rand(4, 4), spmd.to_global(index)))


RULED = [aten.cummax.default, aten.cummin.default, aten.logcumsumexp.default, aten.kthvalue.default,
         aten.median.default, aten.nanmedian.default, aten.nanmedian.dim, aten.nansum.default,
         aten.count_nonzero.default, aten.count_nonzero.dim_IntList, aten.aminmax.default, aten.dist.default,
         aten.norm.ScalarOpt_dim, aten.vdot.default, aten.trace.default, aten.addmv.default, aten.addr.default,
         aten.addbmm.default, aten._trilinear.default, aten.index_copy.default, aten.index_reduce.default,
         aten.index_fill.int_Scalar, aten.index_fill.int_Tensor, aten.scatter_reduce.two, aten.take.default,
         aten.put.default, aten.masked_scatter.default, aten.masked_scatter_backward.default,
         aten._unsafe_masked_index.default, aten._unsafe_masked_index_put_accumulate.default,
         aten._cdist_forward.default, aten._cdist_backward.default]


@pytest.mark.parametrize("op", RULED, ids=str)
def test_the_op_has_a_rule_rather_than_the_replicated_fallback(op):
    assert registry.lookup(op) is not None
