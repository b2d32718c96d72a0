"""Function mode against eager mode on every op case of the layout sweeps (`test_ops_sweep.CASES`).

Each case runs under `spmd.function` (backend "aot_eager": torch's own kernels, as eagerly) on
one combination of input layouts drawn for it, traced before the op ever ran eagerly (an empty dispatch cache:
every rule decides inside the trace), then eagerly on the same layouts. Outputs and the gradients of the first
output's sum must agree: layouts and every device's component (to a few ulps). Differentiating the first output
only also covers the outputs a backward does not reach."""

from __future__ import annotations

import random

import pytest
import torch

import spmd
from spmd.engine import dispatch
from sweep import MESH, Const, _flat, _run_dist, all_layouts
from test_ops_sweep import CASES


def _drawn_layouts(name: str, inputs, mesh=MESH, multi: bool = False) -> tuple:
    """One layout per distributed input, drawn with the case's name as the seed (the same draw at every run); with
    `multi`, one with an axis sharded over several mesh dims wherever the input's shape allows one."""
    rng = random.Random(name)
    tensors = [x.value if isinstance(x, Const) else x for x in inputs if isinstance(x, (torch.Tensor, Const))]
    options = [all_layouts(mesh, t.shape, multi=multi) for t in tensors]
    return tuple(rng.choice([l for l in o if multi and l.multi_axis] or o) for o in options)


def _run(fn, inputs, layouts):
    out, leaves = _run_dist(fn, inputs, layouts, grad=True)
    outs = _flat(out)
    first = outs[0] if outs else None
    if isinstance(first, torch.Tensor) and first.requires_grad:
        first.sum().backward()
    return outs, [leaf.grad for leaf in leaves]


def _assert_same(got, want, what: str) -> None:
    if not isinstance(want, torch.Tensor):
        assert got == want, f"{what}: {got!r} != {want!r}"
        return
    assert spmd.fetch_layout(got) == spmd.fetch_layout(want), (
        f"{what}: layout {spmd.fetch_layout(got).sharding_specs} != eager {spmd.fetch_layout(want).sharding_specs}")
    # the same kernels, but a graph may sum a gradient in another order: ulps apart (gradients that are 0 in theory)
    tol = 1e-12 if want.dtype == torch.float64 else 1e-6 if want.is_floating_point() or want.is_complex() else 0
    for device, (a, b) in enumerate(zip(spmd.unpack(got), spmd.unpack(want))):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True,
                                   msg=lambda m: f"{what}, device {device}: {m}")


def _case(name: str):
    case = CASES[name]
    return case.values[0] if hasattr(case, "values") else case


@pytest.mark.parametrize("name", [pytest.param(k, marks=v.marks) if hasattr(v, "marks") else k
                                  for k, v in CASES.items()])
def test_compiled_equals_eager(name, monkeypatch):
    fn, inputs, *given = _case(name)
    layouts = tuple(random.Random(name).choice(options) for options in given[0]) if given else \
        _drawn_layouts(name, inputs)
    _check_compiled_equals_eager(fn, inputs, layouts, monkeypatch)


MESH_2x2x2 = spmd.create_mesh([("a", 2), ("b", 2), ("c", 2)])


@pytest.mark.parametrize("name", [pytest.param(k, marks=v.marks) if hasattr(v, "marks") else k
                                  for k, v in CASES.items() if len(_case(k)) == 2])  # (cases without set layouts)
def test_compiled_equals_eager_multi_axis(name, monkeypatch):
    """The same with axes sharded over several mesh dims (`"a+b"`), on a 2×2×2 mesh."""
    fn, inputs = _case(name)
    _check_compiled_equals_eager(fn, inputs, _drawn_layouts(name, inputs, MESH_2x2x2, multi=True), monkeypatch)


def _check_compiled_equals_eager(fn, inputs, layouts, monkeypatch) -> None:
    monkeypatch.setattr(dispatch, "_CACHE", {})
    compiled_outs, compiled_grads = _run(spmd.function(fn, backend="aot_eager", fullgraph=False), inputs, layouts)
    eager_outs, eager_grads = _run(fn, inputs, layouts)
    assert len(compiled_outs) == len(eager_outs)
    for i, (got, want) in enumerate(zip(compiled_outs, eager_outs)):
        _assert_same(got, want, f"output {i} for input layouts {[l.sharding_specs for l in layouts]}")
    for i, (got, want) in enumerate(zip(compiled_grads, eager_grads)):
        assert (got is None) == (want is None), f"gradient of input {i}: {got is None} != eager {want is None}"
        if want is not None:
            _assert_same(got, want, f"gradient of input {i} for input layouts {[l.sharding_specs for l in layouts]}")
