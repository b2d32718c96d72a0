"""The sharding-decision cache: float arguments a rule decides on are part of the key; pointwise ops' are not."""

import contextlib

import pytest
import torch

import spmd
from spmd import UNSHARDED, Layout
from tests.sweep import issued

MESH = spmd.create_mesh([("x", 2)])


def test_rules_that_read_a_float_see_each_value():
    x = torch.randn(8, 4, dtype=torch.float64)
    d = spmd.copy_to_mesh(x, Layout(["x", UNSHARDED], MESH))
    for order in (1.0, 2.0, float("inf"), 2.0, 1.0):  # the same call shape with another order: a different plan
        assert float(torch.linalg.vector_norm(d, ord=order)) == pytest.approx(float(torch.linalg.vector_norm(
            x, ord=order)), rel=1e-12)


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0])
def test_native_dropout_uses_each_probability(p):
    d = spmd.copy_to_mesh(torch.ones(64, 8), Layout(["x", UNSHARDED], MESH))
    out, mask = torch.ops.aten.native_dropout(d, p, True)
    kept = spmd.to_global(mask).float().mean().item()
    assert kept == pytest.approx(1 - p, abs=0.15)


def test_pointwise_float_arguments_do_not_grow_the_cache():
    d = spmd.copy_to_mesh(torch.zeros(8, 4), Layout(["x", UNSHARDED], MESH))
    d.add_(d, alpha=0.5)
    size = spmd.cache_stats()["size"]
    for step in range(1, 50):  # an optimizer's changing step size
        d.add_(d, alpha=1.0 / step)
    assert spmd.cache_stats()["size"] == size


def test_ops_that_fell_back_are_listed(mesh22):
    t = spmd.copy_to_mesh(torch.randn(4, 4), spmd.Layout(["x", "y"], mesh22))
    with pytest.warns(UserWarning, match="no sharding rule for aten.block_diag.default") if \
            "aten.block_diag.default" not in spmd.cache_stats()["fallbacks"] else contextlib.nullcontext():
        torch.testing.assert_close(spmd.to_global(torch.block_diag(t, t)), torch.block_diag(*[spmd.to_global(t)] * 2))
    assert "aten.block_diag.default" in spmd.cache_stats()["fallbacks"]
    assert "aten.mm.default" not in spmd.cache_stats()["fallbacks"]


@pytest.mark.filterwarnings("ignore:spmd. no sharding rule")
def test_an_op_without_a_meta_kernel_falls_back_with_its_shapes_read_off_each_call():
    """torch has no meta kernel for `histogram` or `lstsq`: the fallback learns their results' ranks from one run on
    sample inputs and reads the shapes off each call (a histogram's length is its argument, not its input's)."""
    x = torch.randn(8, 4, dtype=torch.float64)
    d = spmd.copy_to_mesh(x, Layout(["x", UNSHARDED], MESH))
    for bins in (5, 7):  # the same input with another bin count: the result's shape follows it
        (hist, edges), collectives = issued(lambda: torch.histogram(d, bins=bins))
        assert collectives == [("all_gather", ("x",))]
        want = torch.histogram(x, bins=bins)
        torch.testing.assert_close(spmd.to_global(hist), want.hist)
        torch.testing.assert_close(spmd.to_global(edges), want.bin_edges)
    b = torch.randn(8, 2, dtype=torch.float64)
    got = torch.linalg.lstsq(d, spmd.copy_to_mesh(b, Layout(["x", UNSHARDED], MESH)))
    torch.testing.assert_close(spmd.to_global(got.solution), torch.linalg.lstsq(x, b).solution)
    assert {"aten.histogram.bin_ct", "aten.linalg_lstsq.default"} <= set(spmd.cache_stats()["fallbacks"])
