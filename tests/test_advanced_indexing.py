"""Advanced indexing (`x[idx]`, `x[i, j]`, `x[:, idx]`, `x[idx] = v`, accumulate) and scans / top-k along a
sharded axis on DTensors: every layout of self, indices and values gives plain torch's values, gradients (index's
backward is an accumulating index_put) and components; kept axes and index axes stay sharded; a scan along a
sharded axis costs one all-gather of the block totals."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd import UNSHARDED as U
from spmd import Layout
from tests.sweep import MESH, issued, check_op, rand

aten = torch.ops.aten
ROWS = torch.tensor([[0, 3], [2, -1]])  # (2, 2) into an axis of 4, a negative one among them
COLS = torch.tensor([[1, 5], [0, 5]])  # (2, 2) into an axis of 6, a duplicate among them

INDEXING = {
    "x[i]": (lambda x, i: x[i], [rand(4, 6, 4), ROWS]),
    "x[:, i]": (lambda x, i: x[:, i], [rand(4, 6, 4), COLS]),
    "x[i, j]": (lambda x, i, j: x[i, j], [rand(4, 6, 4), ROWS, COLS]),
    "x[i, :, j] separated": (lambda x, i, j: x[i, :, j], [rand(4, 6, 4), ROWS, ROWS]),
    "x[:, i, j] broadcast": (lambda x, i, j: x[:, i, j], [rand(4, 6, 4), COLS, torch.tensor([3, 0])]),
    "index_put": (lambda x, i, v: torch.index_put(x, (i,), v), [rand(4, 6, 4), ROWS, rand(2, 2, 6, 4, seed=1)]),
    "index_put broadcast values": (lambda x, i, v: aten.index_put(x, [None, i], v), [rand(4, 6, 4), COLS,
                                                                                      rand(4, seed=1)]),
    "index_put accumulate": (lambda x, i, v: torch.index_put(x, (i,), v, accumulate=True),
                             [rand(4, 6, 4), ROWS, rand(2, 2, 6, 4, seed=1)]),
    "index_put accumulate two indices": (lambda x, i, j, v: aten.index_put(x, [i, None, j], v, True),
                                         [rand(4, 6, 4), ROWS, ROWS, rand(2, 2, 6, seed=1)]),
}


def _set_masked(x, m, v, columns=False):
    y = x.clone()
    if columns:
        y[:, m] = v
    else:
        y[m] = v
    return y


MASK, ROW_MASK, COLUMN_MASK = rand(4, 6) > 0, rand(4, seed=2) > 0, rand(6, seed=3) > 0
# `x[mask] = value` of one value: a masked fill, elementwise, in any layout of x and mask (no gather)
MASKED_FILLS = {
    "x[mask] = 2": (lambda x, m: _set_masked(x, m, 2.0), [rand(4, 6), MASK]),
    "x[row mask] = 2": (lambda x, m: _set_masked(x, m, 2.0), [rand(4, 6), ROW_MASK]),
    "x[:, column mask] = v": (lambda x, m, v: _set_masked(x, m, v, columns=True),
                              [rand(4, 6), COLUMN_MASK, rand(seed=4)]),
    "index_put mask, accumulate": (lambda x, m, v: aten.index_put(x, [m], v, True), [rand(4, 6), MASK, rand()]),
    "x[mask] = one integer": (lambda x, m: _set_masked(x, m, 7), [rand(4, 6, dtype=torch.int64), MASK]),
}


@pytest.mark.parametrize("name", list(MASKED_FILLS))
def test_masked_fill_by_indexing_matches_torch_for_every_layout(name):
    fn, inputs = MASKED_FILLS[name]
    assert check_op(fn, inputs) > 1


def test_masked_fill_by_indexing_keeps_the_layouts_and_issues_no_collective():
    x = spmd.copy_to_mesh(rand(4, 6), Layout(["x", "y"], MESH))
    for mask in (spmd.copy_to_mesh(MASK, Layout(["x", "y"], MESH)), spmd.copy_to_mesh(MASK, Layout([U, U], MESH))):
        _, collectives = issued(lambda: x.__setitem__(mask, 0.0))
        assert collectives == []
    assert spmd.fetch_layout(x) == Layout(["x", "y"], MESH)
    want = rand(4, 6)
    want[MASK] = 0.0
    assert torch.equal(spmd.to_global(x), want)


@pytest.mark.parametrize("name", list(INDEXING))
def test_indexing_matches_torch_for_every_layout(name):
    fn, inputs = INDEXING[name]
    assert check_op(fn, inputs, sample=24) >= 16


SCANS = {
    "cumsum": (lambda x: x.cumsum(1), [rand(4, 8)]),
    "cumsum dtype": (lambda x: x.cumsum(0, dtype=torch.float64), [rand(4, 8, dtype=torch.int64)]),
    "cumsum int": (lambda x: x.cumsum(-1), [rand(4, 8, dtype=torch.int64)]),
    "logcumsumexp": (lambda x: x.logcumsumexp(1), [rand(4, 8)]),
    "topk": (lambda x: torch.topk(x, 2, 1), [rand(4, 8)]),
    "topk smallest": (lambda x: torch.topk(x, 3, 0, largest=False), [rand(8, 4)]),
    "topk k above block": (lambda x: torch.topk(x, 5, 1), [rand(4, 8)]),
    "topk unsorted": (lambda x: torch.topk(x, 2, 1, sorted=False), [rand(4, 8)]),
}


@pytest.mark.parametrize("name", list(SCANS))
def test_scans_along_any_axis_match_torch_for_every_layout(name):
    fn, inputs = SCANS[name]
    assert check_op(fn, inputs) >= 4


def test_cumprod_with_zeros_in_blocks_along_a_sharded_axis():
    """Gradients too: torch's cumprod gradient scatters into a tensor laid out like the input, sharded along the axis
    (each device writes the indices in its block)."""
    for x in (rand(4, 8), rand(4, 8) * (rand(4, 8, seed=1) > -0.5)):
        assert check_op(lambda t: t.cumprod(1), [x]) >= 4


def _layout(*specs):
    return Layout(list(specs), MESH)


def _components_match(out, want):
    """Each device's component is its block of torch's result."""
    layout = spmd.fetch_layout(out)
    got = spmd.unpack(out)
    for device, component in zip(MESH.local_device_ids(), got):
        loc = MESH.device_location(device - MESH.min_global_device_id())
        block = want
        for axis, spec in enumerate(layout.sharding_specs):
            if spec != U:
                n = MESH.dim_size(spec)
                size = want.shape[axis] // n
                block = block.narrow(axis, loc[MESH.axis_index(spec)] * size, size)
        torch.testing.assert_close(component, block)


def test_columns_of_a_row_sharded_tensor_issue_no_collective():
    x = spmd.copy_to_mesh(rand(4, 6), _layout("x", "y"))
    idx = spmd.copy_to_mesh(COLS[0], _layout(U))
    out, collectives = issued(lambda: x[:, idx])
    assert collectives == [("all_gather", ("y",))]  # the indexed axis only
    x = spmd.copy_to_mesh(rand(4, 6), _layout("x", U))
    out, collectives = issued(lambda: x[:, idx])
    assert collectives == []
    assert spmd.fetch_layout(out).sharding_specs == ["x", U]
    _components_match(out, rand(4, 6)[:, COLS[0]])


def test_sharded_indices_keep_their_sharding_and_self_its_kept_axes():
    x = spmd.copy_to_mesh(rand(4, 6), _layout(U, "y"))
    idx = spmd.copy_to_mesh(ROWS, _layout("x", U))
    out, collectives = issued(lambda: x[idx])
    assert collectives == []
    assert spmd.fetch_layout(out).sharding_specs == ["x", U, "y"]
    _components_match(out, rand(4, 6)[ROWS])


def test_a_mesh_dim_on_both_self_and_the_indices_is_resolved():
    x = spmd.copy_to_mesh(rand(4, 6), _layout(U, "x"))
    idx = spmd.copy_to_mesh(ROWS, _layout("x", U))
    out = x[idx]
    assert spmd.fetch_layout(out).sharding_specs == [U, U, "x"]
    _components_match(out, rand(4, 6)[ROWS])


def test_plain_indices_under_implicit_replication_and_their_gradient():
    x = spmd.copy_to_mesh(rand(4, 6), _layout("x", "y")).requires_grad_()
    plain = rand(4, 6).requires_grad_()
    with spmd.implicit_replication():
        out = x[:, COLS[0]] * 2
    (out * out).sum().backward()
    want = plain[:, COLS[0]] * 2
    (want * want).sum().backward()
    torch.testing.assert_close(spmd.to_global(out), want.detach())
    assert spmd.fetch_layout(x.grad) == spmd.fetch_layout(x)
    _components_match(x.grad, plain.grad)


def test_accumulating_sharded_indices_leave_a_pending_sum():
    """index's backward: each device adds its share of the gradient rows; one reduction completes them."""
    zeros = spmd.copy_to_mesh(torch.zeros(4, 6, dtype=torch.float64), _layout(U, "y"))
    idx = spmd.copy_to_mesh(torch.tensor([0, 0, 3, 1]), _layout("x"))
    values = spmd.copy_to_mesh(rand(4, 6), _layout("x", "y"))
    out, collectives = issued(lambda: torch.index_put(zeros, (idx,), values, accumulate=True))
    assert collectives == [] and out._pending == ("x",)
    want = torch.zeros(4, 6, dtype=torch.float64).index_put((torch.tensor([0, 0, 3, 1]),), rand(4, 6), True)
    torch.testing.assert_close(spmd.to_global(out), want)
    _components_match(out, want)


def test_in_place_writes_keep_a_sharded_target():
    x = spmd.copy_to_mesh(rand(4, 6), _layout("x", "y"))
    want = rand(4, 6)
    with spmd.implicit_replication():
        x[ROWS[:, 0]] = 5.0
        x[ROWS[0]] += torch.ones(6, dtype=torch.float64)
    want[ROWS[:, 0]] = 5.0
    want[ROWS[0]] += 1
    assert spmd.fetch_layout(x).sharding_specs == ["x", "y"]
    _components_match(x, want)


@pytest.mark.parametrize("op", [torch.cumsum, torch.cumprod, torch.logcumsumexp])
def test_a_scan_along_a_sharded_axis_gathers_only_the_block_totals(op):
    x = spmd.copy_to_mesh(rand(4, 8), _layout("x", "y"))
    out, collectives = issued(lambda: op(x, 1))
    assert collectives == [("all_gather", ("y",))]
    assert spmd.fetch_layout(out).sharding_specs == ["x", "y"]
    _components_match(out, op(rand(4, 8), 1))


def test_topk_along_a_sharded_axis_gathers_the_candidates():
    x = spmd.copy_to_mesh(rand(4, 8), _layout("x", "y"))
    (values, indices), collectives = issued(lambda: torch.topk(x, 2, 1))
    assert collectives == [("all_gather", ("y",))] * 2
    want = torch.topk(rand(4, 8), 2, 1)
    _components_match(values, want.values)
    _components_match(indices, want.indices)


def test_an_identity_index_over_the_sharded_batch_keeps_it_sharded():
    """`x[arange(B)[:, None, None, None], kv[None, None, None, :]]` (a padding mask's construction) reads each
    batch row at its own position: the batch stays sharded, with no collective. Another first index (a
    permutation) still gathers, and both equal torch's values."""
    value = rand(4, 6)
    x = spmd.copy_to_mesh(value, Layout(["x", U], MESH))
    kv = torch.tensor([0, 5, 2])
    for first, gathers in ((torch.arange(4), False), (torch.tensor([0, 1, 3, 2]), True)):
        index = (first[:, None, None, None], kv[None, None, None, :])
        with spmd.implicit_replication():
            out, collectives = issued(lambda: x[index])
        torch.testing.assert_close(spmd.to_global(out), value[index])
        assert (collectives == [("all_gather", ("x",))]) == gathers and (collectives == []) != gathers
        assert spmd.fetch_layout(out).sharding_specs[0] == (U if gathers else "x")
