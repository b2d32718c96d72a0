"""The last OpInfo ops that ran replicated, now with sharded rules: grid sampling, unpooling, patch extraction
(unfold/fold), group norm, `_batch_norm_with_update`'s backward, embedding bags, cross products, histograms,
`_chunk_cat`, `linspace`/`logspace` with tensor endpoints, segment reductions and pdist. Every layout gives plain
torch's values and gradients, and the axes a model shards stay sharded with exactly the collectives the math
needs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import UNSHARDED as U
from spmd import Layout
from spmd.engine import fallback
from tests.sweep import MESH, all_layouts, issued, Const, check_op, check_replicas, rand, reduce_gradients

aten = torch.ops.aten


def _layout(*specs):
    return Layout(list(specs), MESH)


def _grid(*shape, seed=5):
    return rand(*shape, seed=seed).tanh()  # sampling points inside [-1, 1]


def _unpool2d(x):
    return F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2)


def _unpool3d(x):
    return F.max_unpool3d(*F.max_pool3d(x, 2, return_indices=True), 2)


def _batch_norm_with_update(x, w, b, mean, var):
    return aten._batch_norm_with_update(x, w, b, mean.clone(), var.clone(), 0.1, 1e-5)[0]


def _bags(i, w, **kw):
    """F.embedding_bag of 2-D indices: torch makes their offsets (a plain arange), replicated."""
    with spmd.implicit_replication():
        return F.embedding_bag(i, w, **kw)


def _idx(*shape, high=10, seed=0):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


CASES = {
    "grid_sample_bilinear": (lambda x, g: F.grid_sample(x, g, align_corners=False),
                             [rand(4, 2, 3, 3), _grid(4, 2, 2, 2)]),
    "grid_sample_nearest_border": (lambda x, g: F.grid_sample(x, g, mode="nearest", padding_mode="border",
                                                                        align_corners=False),
                                   [rand(4, 2, 3, 3), _grid(4, 2, 2, 2)]),
    "grid_sample_3d": (lambda x, g: F.grid_sample(x, g, align_corners=True),
                       [rand(2, 2, 2, 3, 2), _grid(2, 2, 2, 2, 3)]),
    "max_unpool2d": (_unpool2d, [rand(4, 4, 4, 4)]),
    "max_unpool2d_unbatched": (_unpool2d, [rand(4, 4, 4)]),
    "max_unpool3d": (_unpool3d, [rand(2, 2, 2, 2, 4)]),
    "group_norm": (lambda x, w, b: F.group_norm(x, 2, w, b), [rand(4, 4, 3, 2), rand(4, seed=1), rand(4, seed=2)]),
    "group_norm_no_affine": (lambda x: F.group_norm(x, 4), [rand(4, 4, 2)]),
    "unfold": (lambda x: F.unfold(x, 2, padding=1), [rand(4, 4, 3, 3)]),
    "unfold_unbatched": (lambda x: F.unfold(x, (2, 1), stride=2), [rand(4, 4, 4)]),
    "fold": (lambda c: F.fold(c, (3, 3), 2), [rand(2, 8, 4)]),
    "fold_channels": (lambda c: F.fold(c, (3, 3), 2), [rand(4, 16, 4)]),
    "batch_norm_with_update": (_batch_norm_with_update, [rand(4, 4, 3), rand(4, seed=1), rand(4, seed=2),
                                                          Const(rand(4, seed=3)), Const(rand(4, seed=4).abs() + 1)]),
    "cross": (lambda a, b: torch.linalg.cross(a, b, dim=1), [rand(4, 3, 4), rand(1, 3, 4, seed=1)]),
    "cross_broadcast_last": (lambda a, b: torch.linalg.cross(a, b), [rand(4, 2, 3), rand(1, 2, 3, seed=1)]),
    "chunk_cat": (lambda a, b: torch._chunk_cat([a, b], 1, 2), [Const(rand(4, 4, 2)), Const(rand(4, 6, 2, seed=1))]),
    "embedding_bag_sum": (lambda w, i: _bags(i, w, mode="sum"), [rand(10, 4), _idx(4, 2)]),
    "embedding_bag_mean_offsets": (lambda w, i, o: F.embedding_bag(i, w, o, mode="mean"),
                                   [rand(10, 4), _idx(8), torch.tensor([0, 2, 2, 5])]),
    "embedding_bag_max_padding": (lambda w, i: _bags(i, w, mode="max", padding_idx=3),
                                  [rand(10, 4), _idx(4, 2, high=4)]),
    "embedding_bag_weighted": (lambda w, i, p: _bags(i, w, per_sample_weights=p, mode="sum"),
                               [rand(10, 4), _idx(4, 2), rand(4, 2, seed=3)]),
    "segment_sum_lengths": (lambda d, n: torch.segment_reduce(d, "sum", lengths=n),
                            [rand(6, 4), torch.tensor([1, 2, 3])]),
    "segment_max_axis1": (lambda d, n: torch.segment_reduce(d, "max", lengths=n, axis=1, unsafe=True),
                          [rand(2, 4, 4), torch.tensor([[1, 3], [2, 2]])]),
    "segment_mean_offsets": (lambda d, o: torch.segment_reduce(d, "mean", offsets=o),
                             [rand(4, 2, 2), torch.tensor([0, 1, 4])]),
    "pdist": (lambda x: F.pdist(x), [rand(4, 4)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch_for_every_layout(name):
    fn, inputs = CASES[name]
    assert check_op(fn, inputs, sample=24) >= 4


@pytest.mark.parametrize("name", ["histc_range", "histc_data_range"])
def test_histogram_matches_torch_for_every_layout(name):
    lo, hi = (-1.0, 1.0) if name == "histc_range" else (0, 0)
    assert check_op(lambda x: torch.histc(x, 5, lo, hi), [rand(4, 4)], grad=False) == 7


@pytest.mark.parametrize("fn", [torch.linspace, torch.logspace])
def test_ranges_with_tensor_endpoints_are_replicated(fn):
    start, end = spmd.copy_to_mesh(torch.tensor(-1.0), _layout()), spmd.copy_to_mesh(torch.tensor(2.0), _layout())
    for got, want in [(fn(start, end, 5), fn(torch.tensor(-1.0), torch.tensor(2.0), 5)),
                      (fn(start, 2.0, 4), fn(torch.tensor(-1.0), 2.0, 4)),
                      (fn(-1.0, end, 3), fn(-1.0, torch.tensor(2.0), 3))]:
        assert spmd.fetch_layout(got).sharding_specs == [U]
        torch.testing.assert_close(spmd.to_global(got), want)
        assert all(torch.equal(c, want) for c in spmd.unpack(got))


# -- collectives -----------------------------------------------------------------------------------------------------
def _no_fallback(fn):
    saved = set(fallback.FELL_BACK)
    fallback.FELL_BACK.clear()
    try:
        out = fn()
        assert not fallback.FELL_BACK, fallback.FELL_BACK
        return out
    finally:
        fallback.FELL_BACK.update(saved)


def _sharded(x, *specs, grad=False):
    out = spmd.copy_to_mesh(x, _layout(*specs))
    return out.requires_grad_() if grad else out


def test_batch_sharded_grid_sample_runs_no_collective_and_its_backward_none():
    x, g = rand(4, 2, 3, 3), _grid(4, 2, 2, 2)
    dx, dg = _sharded(x, "x", "y", U, U, grad=True), _sharded(g, "x", U, U, U, grad=True)
    out, forward = issued(lambda: _no_fallback(lambda: F.grid_sample(dx, dg, align_corners=False)))
    assert forward == [] and spmd.fetch_layout(out).sharding_specs == ["x", "y", U, U]
    weights = rand(*out.shape, seed=9)
    _, backward = issued(lambda: ((out * _sharded(weights, "x", "y", U, U)).sum().backward(), reduce_gradients([dg])))
    assert ("all_reduce", ("y",)) in backward  # the grid's gradient sums over the channel shards
    xr, gr = x.clone().requires_grad_(), g.clone().requires_grad_()
    want = F.grid_sample(xr, gr, align_corners=False)
    (want * weights).sum().backward()
    torch.testing.assert_close(spmd.to_global(out), want.detach())
    torch.testing.assert_close(spmd.to_global(dx.grad), xr.grad)
    torch.testing.assert_close(spmd.to_global(dg.grad), gr.grad)


def test_batch_sharded_group_norm_runs_no_collective_and_the_affine_gradients_one_all_reduce_each():
    x, w, b = rand(4, 4, 3), rand(4, seed=1), rand(4, seed=2)
    dx = _sharded(x, "x", U, U, grad=True)
    dw, db = _sharded(w, U, grad=True), _sharded(b, U, grad=True)
    out, forward = issued(lambda: _no_fallback(lambda: F.group_norm(dx, 2, dw, db)))
    assert forward == [] and spmd.fetch_layout(out).sharding_specs == ["x", U, U]
    _, backward = issued(lambda: (spmd.to_global(out).square().sum().backward(), reduce_gradients([dw, db])))
    assert sorted(backward) == [("all_reduce", ("x",))] * 2
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    want = F.group_norm(xr, 2, wr, br)
    want.square().sum().backward()
    torch.testing.assert_close(spmd.to_global(out), want.detach())
    for got, ref in [(dx, xr), (dw, wr), (db, br)]:
        torch.testing.assert_close(spmd.to_global(got.grad), ref.grad)


def test_embedding_bag_over_a_column_sharded_table_runs_no_collective():
    """Megatron's layout: the table sharded on its embedding axis gives each device its columns of every bag."""
    w, i = rand(10, 4), _idx(4, 3)
    dw = _sharded(w, U, "y", grad=True)
    di = _sharded(i, U, U)
    for mode in ("sum", "mean", "max"):
        out, forward = issued(lambda: _no_fallback(lambda: _bags(di, dw, mode=mode)))
        assert forward == [] and spmd.fetch_layout(out).sharding_specs == [U, "y"]
        torch.testing.assert_close(spmd.to_global(out), F.embedding_bag(i, w, mode=mode))
        _, backward = issued(lambda: _no_fallback(lambda: out.sum().backward()))
        assert backward == []
        wr = w.clone().requires_grad_()
        F.embedding_bag(i, wr, mode=mode).sum().backward()
        torch.testing.assert_close(spmd.to_global(dw.grad), wr.grad)
        assert spmd.fetch_layout(dw.grad).sharding_specs == [U, "y"]
        dw.grad = None


@pytest.mark.parametrize("specs, reads", [(("x", U), [("x",)]), ((U, "y"), [("y",)]),
                                          (("x", "y"), [("x", "y")])])
def test_histogram_of_a_sharded_tensor_is_one_all_reduce_when_read(specs, reads):
    """A pending sum of the shards' histograms, resolved when read (one all-reduce over the mesh dims sharding it)."""
    x = rand(4, 4)
    dx = _sharded(x, *specs)
    out, collectives = issued(lambda: _no_fallback(lambda: torch.histc(dx, 6, -1, 1)))
    assert collectives == []
    got, collectives = issued(lambda: spmd.to_global(out))
    assert collectives == [("all_reduce", dims) for dims in reads]
    torch.testing.assert_close(got, torch.histc(x, 6, -1, 1))


def test_histogram_over_the_data_range_gathers_its_input():
    dx = _sharded(rand(4, 4), "x", U)
    out, collectives = issued(lambda: _no_fallback(lambda: torch.histc(dx, 6)))
    assert collectives == [("all_gather", ("x",))] and spmd.fetch_layout(out).sharding_specs == [U]
    torch.testing.assert_close(spmd.to_global(out), torch.histc(rand(4, 4), 6))


def test_cross_keeps_the_other_axes_sharded():
    a, b = rand(4, 3, 4), rand(4, 3, 4, seed=1)
    da, db = _sharded(a, "x", U, "y"), _sharded(b, "x", U, "y")
    out, collectives = issued(lambda: _no_fallback(lambda: torch.linalg.cross(da, db, dim=1)))
    assert collectives == [] and spmd.fetch_layout(out).sharding_specs == ["x", U, "y"]
    torch.testing.assert_close(spmd.to_global(out), torch.linalg.cross(a, b, dim=1))


def test_unfold_and_fold_keep_batch_and_channels_sharded():
    x = rand(4, 4, 3, 3)
    dx = _sharded(x, "x", "y", U, U)
    cols, collectives = issued(lambda: _no_fallback(lambda: F.unfold(dx, 2)))
    assert collectives == [] and spmd.fetch_layout(cols).sharding_specs == ["x", "y", U]
    back, collectives = issued(lambda: _no_fallback(lambda: F.fold(cols, (3, 3), 2)))
    assert collectives == [] and spmd.fetch_layout(back).sharding_specs == ["x", "y", U, U]
    torch.testing.assert_close(spmd.to_global(back), F.fold(F.unfold(x, 2), (3, 3), 2))


def test_max_unpool_keeps_batch_and_channels_sharded():
    x = rand(4, 4, 4, 4)
    dx = _sharded(x, "x", "y", U, U)
    out, collectives = issued(lambda: _no_fallback(lambda: _unpool2d(dx)))
    assert collectives == [] and spmd.fetch_layout(out).sharding_specs == ["x", "y", U, U]
    torch.testing.assert_close(spmd.to_global(out), _unpool2d(x))


def test_segment_reduce_keeps_the_columns_sharded():
    d, n = rand(6, 4), torch.tensor([1, 2, 3])
    dd = _sharded(d, U, "y")
    out, collectives = issued(lambda: _no_fallback(lambda: torch.segment_reduce(dd, "sum", lengths=_sharded(n, U))))
    assert collectives == [] and spmd.fetch_layout(out).sharding_specs == [U, "y"]
    torch.testing.assert_close(spmd.to_global(out), torch.segment_reduce(d, "sum", lengths=n))


def test_batch_norm_with_update_backward_is_one_all_reduce():
    x, w, b = rand(4, 4, 3), rand(4, seed=1), rand(4, seed=2)
    dx = _sharded(x, "x", U, U, grad=True)
    dw, db = _sharded(w, U, grad=True), _sharded(b, U, grad=True)
    zeros, ones = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    mean, var = _sharded(zeros, U), _sharded(ones, U)
    out = _no_fallback(lambda: aten._batch_norm_with_update(dx, dw, db, mean, var, 0.1, 1e-5)[0])
    _, backward = issued(lambda: _no_fallback(lambda: spmd.to_global(out).square().sum().backward()))
    assert backward == [("all_reduce", ("x",))]  # the two per-channel sums, stacked
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    aten._batch_norm_with_update(xr, wr, br, zeros, ones, 0.1, 1e-5)[0].square().sum().backward()
    for got, ref in [(dx, xr), (dw, wr), (db, br)]:
        torch.testing.assert_close(spmd.to_global(got.grad), ref.grad)


def _assert_components(got, want):
    """`got`'s global value and every device's component are `want` and its blocks in `got`'s layout."""
    torch.testing.assert_close(spmd.to_global(got), want)
    for component, block in zip(spmd.unpack(got), spmd.unpack(spmd.copy_to_mesh(want, spmd.fetch_layout(got)))):
        torch.testing.assert_close(component, block)


@pytest.mark.parametrize("index_specs", [[U], ["x"], ["y"]])
@pytest.mark.parametrize("layout", all_layouts(MESH, (4, 6)), ids=lambda l: ",".join(map(str, l.sharding_specs)))
def test_tensor_split_by_a_tensor_of_indices_reads_their_global_value(layout, index_specs):
    """torch reads the indices on the host: a DTensor's are gathered once (none if replicated), then the split is
    the split by the Python ints, with its collectives and layouts."""
    x, indices = rand(4, 6), torch.tensor([1, 3, 3, 5])
    dx, di = spmd.copy_to_mesh(x, layout), _sharded(indices, *index_specs)
    out, collectives = issued(lambda: torch.tensor_split(dx, di, 1))
    by_ints, split_collectives = issued(lambda: torch.tensor_split(dx, indices.tolist(), 1))
    gather = [] if index_specs == [U] else [("all_gather", tuple(index_specs))]
    assert collectives == gather + split_collectives
    want = torch.tensor_split(x, indices, 1)
    assert len(out) == len(want) == 5
    for o, b, w in zip(out, by_ints, want):
        assert spmd.fetch_layout(o) == spmd.fetch_layout(b)
        _assert_components(o, w)


def test_tensor_split_by_a_0d_tensor_gives_that_many_sections():
    x = rand(5, 4)
    out = torch.tensor_split(_sharded(x, U, "x"), _sharded(torch.tensor(2)), 0)
    for o, w in zip(out, torch.tensor_split(x, 2, 0)):
        assert spmd.fetch_layout(o).sharding_specs == [U, "x"]
        _assert_components(o, w)


@pytest.mark.parametrize("indices", [torch.tensor([1., 2.]), torch.tensor([[1, 2]])], ids=["float", "2-d"])
def test_tensor_split_by_a_bad_tensor_of_indices_is_torchs_error(indices):
    x = rand(4, 6)
    with pytest.raises(RuntimeError) as want:
        torch.tensor_split(x, indices, 1)
    with pytest.raises(RuntimeError) as got:
        torch.tensor_split(_sharded(x, "x", U), _sharded(indices, *[U] * indices.dim()), 1)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("compare", [torch.equal, torch.allclose], ids=["equal", "allclose"])
def test_comparisons_of_every_layout_pair_and_their_one_all_reduce(compare):
    """Each device compares its blocks; the verdicts meet in one all-reduce over the mesh dims the blocks spread
    over (what makes every client of a multi-client mesh answer for the whole tensors)."""
    a = rand(4, 4)
    changed = a.clone()
    changed[3, 3] = 9.0
    for other in (a.clone(), a + 1e-9, changed):
        for la in all_layouts(MESH, a.shape):
            for lb in all_layouts(MESH, a.shape)[::3]:
                da, db = spmd.copy_to_mesh(a, la), spmd.copy_to_mesh(other, lb)
                got, collectives = issued(lambda: compare(da, db))
                assert got == compare(a, other), (la, lb)
                spread = tuple(d for d in MESH.dim_names if d in la.sharded_mesh_dims)
                reduced = [c for c in collectives if c[0] == "all_reduce"]  # (the rest relayouts b to a's layout)
                assert reduced == ([("all_reduce", spread)] if spread else []), (la, lb, collectives)
    assert compare(spmd.copy_to_mesh(a, Layout(["x", U], MESH)), spmd.copy_to_mesh(a[0], Layout([U], MESH))) == \
        compare(a, a[0])


def test_leaky_relu_is_pointwise_on_torch_versions_that_do_not_tag_it():
    """torch 2.11 lacks leaky_relu's `pointwise` tag (2.13 has it): it and its gradient still take the pointwise
    rule, so a sharded input stays sharded and no collective runs (a fallback would gather it)."""
    layout = Layout(["x", "y"], MESH)
    x = spmd.copy_to_mesh(rand(4, 4), layout).requires_grad_()
    y, forward = issued(lambda: F.leaky_relu(x, 0.1))
    _, backward = issued(lambda: y.backward(spmd.copy_to_mesh(torch.ones(4, 4, dtype=torch.float64), layout)))
    assert forward == backward == []
    assert spmd.fetch_layout(y) == spmd.fetch_layout(x.grad) == layout


@pytest.mark.parametrize("x_specs", [[U, U, U], ["x", U, U], [U, "y", U], ["y", "x", U]])
def test_running_statistics_in_any_layouts_are_updated_in_place(x_specs):
    """`_batch_norm_with_update` writes its running statistics: each is computed in the channels' layout the rule
    picks and its new values go back into its own layout, whatever the two are (a statistic relayouted for the
    kernel once kept its old values)."""
    x, w, b = rand(4, 4, 3), rand(4, seed=1), rand(4, seed=2)
    mean, var = rand(4, seed=3), rand(4, seed=4).abs()
    want_mean, want_var = mean.clone(), var.clone()
    aten._batch_norm_with_update(x, w, b, want_mean, want_var, 0.1, 1e-5)
    for mean_layout in all_layouts(MESH, (4,)):
        for var_layout in all_layouts(MESH, (4,)):
            dmean, dvar = spmd.copy_to_mesh(mean, mean_layout), spmd.copy_to_mesh(var, var_layout)
            aten._batch_norm_with_update(*(spmd.copy_to_mesh(t, Layout(specs, MESH)) for t, specs in
                                           ((x, x_specs), (w, [U]), (b, [U]))), dmean, dvar, 0.1, 1e-5)
            for got, want, layout in ((dmean, want_mean, mean_layout), (dvar, want_var, var_layout)):
                assert spmd.fetch_layout(got) == layout
                torch.testing.assert_close(spmd.to_global(got), want)
                check_replicas(got)
