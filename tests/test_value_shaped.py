"""Ops whose result's shape depends on the values (`nonzero`, `x[mask]`, `masked_select`, `unique`, `bincount`,
`repeat_interleave` by counts): every layout gives torch's values, gradients and replicated components; the
sharded operands are gathered (exactly those collectives), the result is computed once per process, and its shape
is read off each call, never cached."""

from __future__ import annotations

import warnings

import pytest
import torch

import spmd
from spmd import UNSHARDED as U, Layout
from spmd.collectives.local import shared
from spmd.engine import dispatch, fallback
from tests.sweep import MESH, Const, check_op, issued, rand


def _mask(*shape, seed=0):
    return rand(*shape, seed=seed) > 0


def _counts(n, seed=0):
    return torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(seed))


CASES = {
    "x[x > 0]": (lambda x: x[x > 0], [rand(4, 4)]),
    "x[mask]": (lambda x, m: x[m], [rand(4, 4), Const(_mask(4, 4))]),
    "x[row mask]": (lambda x, m: x[m], [rand(4, 6), Const(_mask(4, seed=1))]),
    "x[:, column mask]": (lambda x, m: x[:, m] * 2, [rand(4, 6), Const(_mask(6, seed=2))]),
    "x[row mask, index]": (lambda x, m, i: x[m, i], [rand(4, 6), Const(_mask(4, seed=3)), Const(torch.tensor([5]))]),
    "masked_select": (torch.masked_select, [rand(4, 4), Const(_mask(4, 4, seed=4))]),
    "masked_select, broadcast mask": (torch.masked_select, [rand(4, 4), Const(_mask(4, seed=5))]),
    "nonzero": (torch.nonzero, [rand(4, 6, dtype=torch.int64)]),
    "nonzero as_tuple": (lambda x: torch.nonzero(x, as_tuple=True), [rand(4, 6, dtype=torch.int64)]),
    "argwhere": (torch.argwhere, [rand(2, 4, 2, dtype=torch.int64)]),
    "where(cond)": (lambda x: torch.where(x > 0.5), [rand(4, 4)]),
    "unique": (lambda x: torch.unique(x, return_inverse=True, return_counts=True),
               [rand(4, 6, dtype=torch.int64)]),
    "unique sorted only": (torch.unique, [rand(8, dtype=torch.int64)]),
    "unique dim": (lambda x: torch.unique(x, dim=0, return_inverse=True, return_counts=True),
                   [rand(8, 2, dtype=torch.int64) % 2]),
    "unique_consecutive": (lambda x: torch.unique_consecutive(x, return_inverse=True, return_counts=True),
                           [rand(8, dtype=torch.int64)]),
    "unique_consecutive dim": (lambda x: torch.unique_consecutive(x, dim=1, return_counts=True),
                               [rand(2, 8, dtype=torch.int64) % 2]),
    "bincount": (lambda x: torch.bincount(x, minlength=6), [rand(8, dtype=torch.int64)]),
    "bincount weights": (lambda x, w: torch.bincount(x, w), [rand(8, dtype=torch.int64), Const(rand(8))]),
    "repeat_interleave counts": (torch.repeat_interleave, [_counts(4)]),
    "repeat_interleave rows": (lambda x, r: x.repeat_interleave(r, dim=0), [rand(4, 6), Const(_counts(4, seed=1))]),
    "repeat_interleave output_size": (lambda x, r: x.repeat_interleave(r, dim=1, output_size=int(_counts(6).sum())),
                                      [rand(4, 6), Const(_counts(6))]),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_values_gradients_and_components_in_every_layout(case):
    fn, inputs = CASES[case]
    assert check_op(fn, inputs) > 1


def test_on_a_one_dim_mesh_and_a_three_dim_mesh():
    for mesh in (spmd.create_mesh([("x", 4)]), spmd.create_mesh([("a", 2), ("b", 2), ("c", 2)])):
        check_op(lambda x: x[x > 0], [rand(8, 4)], mesh=mesh)
        check_op(lambda x: torch.unique(x, return_counts=True), [rand(8, 4, dtype=torch.int64)], mesh=mesh)


def test_sharded_operands_are_gathered_and_nothing_else():
    x = spmd.copy_to_mesh(rand(4, 4), Layout(["x", "y"], MESH))
    mask = spmd.copy_to_mesh(_mask(4, 4), Layout(["x", U], MESH))
    _, collectives = issued(lambda: x[mask])
    assert collectives == [("all_gather", ("x",)), ("all_gather", ("y",)), ("all_gather", ("x",))]
    replicated = spmd.copy_to_mesh(rand(4, 4), Layout([U, U], MESH))
    out, collectives = issued(lambda: torch.nonzero(replicated))
    assert collectives == []
    assert spmd.fetch_layout(out) == Layout([U, U], MESH)


def test_gathering_sharded_operands_is_warned_about_once_per_op(monkeypatch):
    monkeypatch.setattr(fallback, "_GATHERED", set())
    monkeypatch.setattr(dispatch, "_CACHE", {})  # (plans made by the tests before warned then)
    x = spmd.copy_to_mesh(rand(4, 4), Layout(["x", U], MESH))
    with pytest.warns(UserWarning, match="masked_select.*gathered on every device"):
        torch.masked_select(x, x > 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.masked_select(x * 2, x > 1)  # another cache key: no second warning
        replicated = spmd.copy_to_mesh(rand(4, 4), Layout([U, U], MESH))
        torch.nonzero(replicated)  # nothing gathered: no warning


def test_result_is_computed_once_for_the_devices_of_this_process():
    x = spmd.copy_to_mesh(rand(4, 4), Layout(["x", U], MESH))
    out = x[x > 0]
    assert shared(out._stack)  # one copy: every device's component
    value = spmd.to_global(x)
    assert all(torch.equal(c, value[value > 0]) for c in spmd.unpack(out))


def test_shape_follows_the_values_of_each_call():
    layout = Layout(["x", U], MESH)
    base = torch.tensor([[1., -1.], [1., 1.], [-1., -1.], [1., -1.]])
    for i, value in enumerate([base, -base, torch.ones(4, 2), -torch.ones(4, 2)]):
        x = spmd.copy_to_mesh(value, layout)
        out = x[x > 0]
        assert out.shape == value[value > 0].shape and torch.equal(spmd.to_global(out), value[value > 0])
        if i == 0:
            misses = dispatch.cache_stats()["misses"]
    assert dispatch.cache_stats()["misses"] == misses  # planned once, whatever the result's shape


def test_bad_arguments_raise_torchs_errors():
    x = spmd.copy_to_mesh(rand(4, 2, dtype=torch.int64), Layout(["x", U], MESH))
    with pytest.raises(RuntimeError, match="1-d"):
        torch.bincount(x)
    with pytest.raises(IndexError):
        x[spmd.copy_to_mesh(_mask(2), Layout([U], MESH))]


def test_function_mode_breaks_the_graph_there():
    x = spmd.copy_to_mesh(rand(4, 4), Layout(["x", "y"], MESH))
    want = (x.detach()[x.detach() > 0] * 2).sum()
    with pytest.raises(spmd.TraceError, match="depends on the values"):
        spmd.function(lambda t: (t[t > 0] * 2).sum(), backend="aot_eager")(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = spmd.function(lambda t: (t[t > 0] * 2).sum(), backend="aot_eager", fullgraph=False)(x)
    assert any("graph breaks" in str(w.message) for w in caught)
    torch.testing.assert_close(spmd.to_global(got), spmd.to_global(want))
