"""Function mode's layout propagation: `relayout` constraints inside a traced function move back over the ops
before them where that saves a collective (a pending sum becomes one reduce-scatter), and stay where moving them
would move data; `forbid=` refuses a collective and names the constraints that need it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import UNSHARDED as U, Layout
from sweep import components, gather


def test_pending_sum_becomes_a_reduce_scatter_inside_a_trace(mesh22):
    """Sequence parallelism's pattern: a row-parallel product relayouted to a sharded layout is one reduce-scatter
    in the compiled graph too (not an all-reduce and a slice)."""
    x = spmd.copy_to_mesh(torch.randn(8, 16), Layout([U, "y"], mesh22))
    w = spmd.copy_to_mesh(torch.randn(16, 12), Layout(["y", U], mesh22))
    fn = spmd.function(lambda x, w: spmd.relayout(x @ w, Layout(["y", U], mesh22)), backend="aot_eager")
    e = fn.explain(x, w)
    assert [(c.kind, c.mesh_dims, c.op_index) for c in e.collectives] == [("reduce_scatter", ("y",), 1)]
    out, eager = fn(x, w), spmd.relayout(x @ w, Layout(["y", U], mesh22))
    assert spmd.fetch_layout(out) == Layout(["y", U], mesh22)
    torch.testing.assert_close(gather(out), spmd.to_global(x) @ spmd.to_global(w))
    for got, want in zip(components(out), components(eager), strict=True):
        torch.testing.assert_close(got, want)


def test_relayout_constraint_moves_back_over_elementwise_ops(mesh22):
    """`relayout(gelu(x @ w + b) * 2, sharded)`: the constraint moves back to the product, so its pending sum is one
    reduce-scatter (eager: an all-reduce at the add, then a slice) and the elementwise ops compute on blocks.
    Values, gradients and every component equal eager's."""
    def make():
        torch.manual_seed(0)
        return [spmd.copy_to_mesh(torch.randn(*shape), Layout(axes, mesh22)).requires_grad_()
                for shape, axes in (((8, 16), [U, "y"]), ((16, 12), ["y", U]), ((12,), [U]))]

    def f(x, w, b):
        return spmd.relayout(F.gelu(x @ w + b) * 2, Layout(["y", U], mesh22))

    fn = spmd.function(f, backend="aot_eager")
    e = fn.explain(*make())
    assert [(c.kind, c.mesh_dims) for c in e.collectives] == [("reduce_scatter", ("y",))]
    assert [(o.op, o.outputs) for o in e.ops] == [
        ("mm", ((None, None),)), ("spmd.relayout", (("y", None),)), ("add.Tensor", (("y", None),)),
        ("gelu", (("y", None),)), ("mul.Tensor", (("y", None),)), ("spmd.relayout", (("y", None),))]
    results = []
    for run in (f, fn):
        inputs = make()
        out = run(*inputs)
        (out * out).sum().backward()
        results.append([out] + [t.grad for t in inputs])
    for got, want in zip(*results, strict=True):
        assert spmd.fetch_layout(got) == spmd.fetch_layout(want)
        for g, w in zip(components(got), components(want), strict=True):  # (float32 values, as Python floats)
            scale = float(np.abs(np.asarray(w)).max())  # (fused kernels sum in another order: ulps of the largest)
            torch.testing.assert_close(g, w, rtol=1.3e-6, atol=4 * torch.finfo(torch.float32).eps * scale)


def test_relayout_constraint_stays_where_moving_it_would_move_data(mesh22):
    """Moved back over `a + b`, a gather would run twice; over a product of replicated values that require grad,
    each slice's backward would be an all-gather the constraint's own backward does not need."""
    a, b = (spmd.copy_to_mesh(torch.randn(8, 6), Layout(["x", U], mesh22)) for _ in range(2))
    e = spmd.function(lambda a, b: spmd.relayout(a + b, Layout([U, U], mesh22))).explain(a, b)
    assert [(c.kind, c.mesh_dims) for c in e.collectives] == [("all_gather", ("x",))]
    assert [o.op for o in e.ops] == ["add.Tensor", "spmd.relayout"]
    p = spmd.copy_to_mesh(torch.randn(8, 6), Layout([U, U], mesh22)).requires_grad_()
    q = spmd.copy_to_mesh(torch.randn(8, 6), Layout([U, U], mesh22))
    e = spmd.function(lambda p, q: spmd.relayout(p * q, Layout(["x", U], mesh22))).explain(p, q, backward=True)
    assert [o.op for o in e.ops if not o.backward][:2] == ["mul.Tensor", "spmd.relayout"]
    assert not [c for c in e.collectives if c.backward]


def test_forbid_refuses_a_collective_and_names_both_conflicting_constraints(mesh22):
    x = spmd.copy_to_mesh(torch.randn(8, 16), Layout(["x", U], mesh22))
    w = spmd.copy_to_mesh(torch.randn(16, 32), Layout([U, U], mesh22))

    def conflict(x, w):
        h = x @ w
        a = spmd.relayout(h, Layout(["x", "y"], mesh22))  # line A: a slice, free
        b = spmd.relayout(h, Layout([U, U], mesh22))  # line B: an all-gather over x
        return a, b

    first = conflict.__code__.co_firstlineno
    with pytest.raises(spmd.TraceError) as info:
        spmd.function(conflict, forbid="all_gather", backend="aot_eager")(x, w)
    message = str(info.value)
    assert "all_gather over mesh dim(s) ['x']" in message
    assert f"line {first + 3}" in message and f"line {first + 2}" in message  # both constraints' lines
    assert "['x', 'y']" in message and "['unsharded', 'unsharded']" in message
    assert "While executing" not in message
    a, b = spmd.function(conflict, forbid="all_to_all", backend="aot_eager")(x, w)  # allowed: it runs
    torch.testing.assert_close(gather(b), spmd.to_global(x) @ spmd.to_global(w))


def test_forbid_accepts_communication_free_layouts_and_checks_results(mesh22):
    x = spmd.copy_to_mesh(torch.randn(8, 16), Layout(["x", U], mesh22))
    w1 = spmd.copy_to_mesh(torch.randn(16, 32), Layout([U, "y"], mesh22))
    w2 = spmd.copy_to_mesh(torch.randn(32, 16), Layout(["y", U], mesh22))
    mlp = lambda x, w1, w2: torch.relu(x @ w1) @ w2  # noqa: E731  one all-reduce, at the result
    out = spmd.function(mlp, forbid=("all_gather", "all_to_all"), backend="aot_eager")(x, w1, w2)
    torch.testing.assert_close(gather(out), mlp(*(spmd.to_global(t) for t in (x, w1, w2))))
    with pytest.raises(spmd.TraceError, match="all_reduce over mesh dim.* as the function returns its result"):
        spmd.function(mlp, forbid="all", backend="aot_eager")(x, w1, w2)
    with pytest.raises(ValueError, match="forbid='gather'"):
        spmd.function(mlp, forbid="gather")


@pytest.mark.parametrize("name", ["sum of products + 3", "square of a product", "difference of scaled products"])
def test_a_constraint_after_a_sum_of_pending_sums_is_one_reduce_scatter(mesh22, name):
    """A constraint moves back over elementwise ops (pow too) down to a sum of pending sums (scaled by numbers or
    not), which stays one pending sum: one reduce-scatter, not one per summand."""
    h = spmd.copy_to_mesh(torch.randn(8, 8), Layout([U, "y"], mesh22))
    w = spmd.copy_to_mesh(torch.randn(8, 8), Layout(["y", U], mesh22))
    target = Layout(["y", U], mesh22)
    fn = {"sum of products + 3": lambda h, w: spmd.relayout(h @ w + h @ w + 3, target),
          "square of a product": lambda h, w: spmd.relayout((h @ w) ** 2, target),
          "difference of scaled products": lambda h, w: spmd.relayout((h @ w - h @ w * 2) * 3, target)}[name]
    f = spmd.function(fn, backend="aot_eager")
    assert [(c.kind, c.mesh_dims) for c in f.explain(h, w).collectives] == [("reduce_scatter", ("y",))]
    torch.testing.assert_close(gather(f(h, w)), gather(fn(h, w)))
