"""The rule engine: rules only decide (frozen decisions, one rule per op), the planner's step lists, the exact
collectives each op issues, and pending reductions carried by DTensors until a consumer resolves them (an
all-reduce, or a reduce-scatter where the consumer wants the reduced mesh dim sharded)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import UNSHARDED, Layout
from spmd.collectives import Collective, Kind
from spmd.engine import planner, registry
from spmd.engine.decision import Decision, OpCall, TensorSpec
from spmd.explain import Recorder
from sweep import check_op, components, gather, reduce_gradients

U = UNSHARDED
aten = torch.ops.aten


def issued(fn, *args):
    """The result of `fn(*args)` and the (kind, mesh dims, backward) of every collective it ran, in order."""
    with Recorder() as e:
        out = fn(*args)
    return out, [(c.kind, c.mesh_dims, c.backward) for c in e.collectives]


def _row_parallel(mesh22, value_x, value_w):
    """x [4, 8] with its contraction axis sharded over y, w [8, 4] likewise: x @ w is pending over y."""
    x = spmd.copy_to_mesh(value_x, Layout([U, "y"], mesh22))
    w = spmd.copy_to_mesh(value_w, Layout(["y", U], mesh22))
    return x, w


# -- the registry and decisions ------------------------------------------------------------------------------------
def test_register_refuses_a_second_rule_for_an_op():
    with pytest.raises(ValueError, match=r"aten\.mm\.default already has the rule .*contraction.*one op, one rule"):
        registry.register(aten.mm.default)(lambda call: None)


def test_every_op_has_one_rule_and_decisions_are_frozen(mesh22):
    ops = registry.registered_ops()
    assert len(ops) == len(set(ops))
    x = spmd.copy_to_mesh(torch.randn(4, 4), Layout(["x", U], mesh22))
    decision = registry.lookup(aten.mm.default).rule(_call(aten.mm.default, x, x))
    assert isinstance(decision, Decision)
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.kernel = None


def _call(func, *tensors):
    specs = tuple(TensorSpec(t._layout.axes, tuple(t.shape), t.dtype) for t in tensors)
    mesh = tensors[0]._layout.mesh
    return OpCall(func, specs, {}, mesh, mesh.num_local_devices())


def test_floats_read_at_run_time_only_for_rules_that_say_so():
    assert registry.lookup(aten.add.Tensor).floats_at_run_time  # the pointwise family
    assert not registry.lookup(aten.native_dropout.default).floats_at_run_time  # dropout's p decides


# -- the planner's step lists --------------------------------------------------------------------------------------
@pytest.mark.parametrize("src, dst, pending, steps", [
    (("x", None), (None, None), (), [Collective(Kind.ALL_GATHER, ("x",), 0)]),
    ((None, None), (None, "y"), (), [Collective(Kind.SHARD, ("y",), 1)]),
    (("x", None), (None, "x"), (), [Collective(Kind.ALL_TO_ALL, ("x",), 0, 1)]),
    (("x", "y"), ("y", "x"), (), [Collective(Kind.ALL_GATHER, ("x",), 0), Collective(Kind.ALL_TO_ALL, ("y",), 1, 0),
                                  Collective(Kind.SHARD, ("x",), 1)]),
    ((None, None), (None, None), ("y",), [Collective(Kind.ALL_REDUCE, ("y",))]),
    ((None, None), ("y", None), ("y",), [Collective(Kind.REDUCE_SCATTER, ("y",), 0)]),
    (("x", None), (None, "y"), ("y",), [Collective(Kind.REDUCE_SCATTER, ("y",), 1),
                                        Collective(Kind.ALL_GATHER, ("x",), 0)]),
    ((None, None), ("x", None), ("y",), [Collective(Kind.SHARD, ("x",), 0),  # slice first: a smaller all-reduce
                                         Collective(Kind.ALL_REDUCE, ("y",))]),
])
def test_planner_steps(src, dst, pending, steps):
    assert list(planner.plan(src, dst, pending)) == steps


@pytest.mark.parametrize("dims, src, dst, steps", [
    ([("x", 2), ("y", 2)], ("x", "y"), ("y", "x"),
     [Collective(Kind.PERMUTE, ("y", "x"), 0, from_dims=("x", "y"))]),
    ([("a", 2), ("b", 2), ("c", 2)], ("a", None, "b", "c"), ("b", None, "c", "a"),
     [Collective(Kind.PERMUTE, ("b", "c", "a"), 0, from_dims=("a", "b", "c"))]),
    ([("x", 2), ("y", 4)], ("x", "y"), ("y", "x"),  # blocks of other shapes: not a permute
     [Collective(Kind.ALL_GATHER, ("x",), 0), Collective(Kind.ALL_TO_ALL, ("y",), 1, 0),
      Collective(Kind.SHARD, ("x",), 1)]),
])
def test_mesh_dims_of_one_size_that_only_change_axes_are_one_permute(dims, src, dst, steps):
    """Each device's block is whole another device's: one permute, and the components are dst's."""
    mesh = spmd.create_mesh(dims)
    assert list(planner.plan_on(mesh, src, dst)) == steps
    value = torch.arange(8 ** len(src), dtype=torch.float32).reshape((8,) * len(src))
    src_layout, dst_layout = Layout.from_axes(src, mesh), Layout.from_axes(dst, mesh)
    moved = spmd.relayout(spmd.copy_to_mesh(value, src_layout), dst_layout)
    want = spmd.copy_to_mesh(value, dst_layout)
    assert all(torch.equal(a, b) for a, b in zip(spmd.unpack(moved), spmd.unpack(want)))


def test_collective_kinds_compare_as_their_names():
    assert Kind.REDUCE_SCATTER == "reduce_scatter" and repr(Kind.ALL_REDUCE) == "'all_reduce'"


# -- the collectives each op issues ---------------------------------------------------------------------------------
def test_contraction_over_a_sharded_axis_leaves_its_reduction_pending(mesh22):
    torch.manual_seed(0)
    vx, vw = torch.randn(4, 8), torch.randn(8, 4)
    x, w = _row_parallel(mesh22, vx, vw)
    y, collectives = issued(torch.mm, x, w)
    assert collectives == []  # nothing moves until a consumer decides how to reduce
    assert y._pending == ("y",) and spmd.fetch_layout(y) == Layout([U, U], mesh22)
    z, collectives = issued(torch.relu, y)
    assert collectives == [("all_reduce", ("y",), False)]
    torch.testing.assert_close(gather(z), torch.relu(vx @ vw))
    assert not y._pending  # resolved into y itself: a second consumer reduces nothing
    _, collectives = issued(torch.neg, y)
    assert collectives == []


def test_relayout_of_a_pending_reduction_is_one_reduce_scatter(mesh22):
    torch.manual_seed(0)
    vx, vw = torch.randn(4, 8), torch.randn(8, 4)
    x, w = _row_parallel(mesh22, vx, vw)
    out, collectives = issued(lambda: spmd.relayout(x @ w, Layout(["y", U], mesh22)))
    assert collectives == [("reduce_scatter", ("y",), False)]
    expected = spmd.copy_to_mesh(vx @ vw, Layout(["y", U], mesh22))
    for got, want in zip(components(out), components(expected)):
        torch.testing.assert_close(got, want)


def test_relayout_of_a_pending_sum_to_another_dims_sharding_reduces_only_the_block(mesh22):
    """A vocabulary-parallel embedding's table gradient, pending over the batch's dim, relayouted to the table's
    layout sharded over the other dim: each device slices its block of the partial sums, still pending, and reading
    it is one all-reduce of the block (not of the whole table, then a slice)."""
    torch.manual_seed(0)
    value, ids = torch.randn(16, 4), torch.randint(0, 16, (4, 6))
    table = spmd.copy_to_mesh(value, Layout(["y", U], mesh22)).requires_grad_()
    with Recorder() as seen:
        (F.embedding(spmd.copy_to_mesh(ids, Layout(["x", U], mesh22)), table) ** 2).sum().backward()
        reduce_gradients([table])
    backward = [(c.kind, c.mesh_dims, c.bytes) for c in seen.collectives if c.backward]
    assert backward == [("all_reduce", ("x",), 8 * 4 * 4)]  # each device's 8 rows of 4 floats
    plain = value.clone().requires_grad_()
    (F.embedding(ids, plain) ** 2).sum().backward()
    torch.testing.assert_close(gather(table.grad), plain.grad)
    assert spmd.fetch_layout(table.grad) == Layout(["y", U], mesh22)


def test_a_recorder_changes_nothing_it_records(mesh22):
    """Recording (explain, forbid, a Recorder) runs what an unrecorded call runs: a data-parallel gradient stays
    pending on its way into `.grad` either way."""
    x = spmd.copy_to_mesh(torch.randn(8, 4), Layout(["x", U], mesh22))
    pending = []
    for record in (False, True):
        w = spmd.copy_to_mesh(torch.randn(4, 2), Layout([U, U], mesh22)).requires_grad_()
        with Recorder() if record else contextlib.nullcontext():
            (x @ w).sum().backward()
        pending.append(w.grad._pending)
    assert pending == [("x",), ("x",)]


def test_gradient_accumulation_reduces_each_gradient_once(mesh22):
    """Micro-batches' gradients accumulate as pending sums (their sum is the sum's sum): no backward reduces one,
    and reading each gradient afterwards is one all-reduce for all micro-batches."""
    torch.manual_seed(0)
    model = spmd.distribute_module(torch.nn.Linear(8, 16), mesh22)
    plain = copy.deepcopy(torch.nn.Linear(8, 16))
    plain.load_state_dict({k: gather(v.detach()) for k, v in model.state_dict().items()})
    for _ in range(3):
        x = torch.randn(8, 8)
        with Recorder() as seen:
            model(spmd.copy_to_mesh(x, Layout(["x", U], mesh22))).pow(2).mean().backward()
        assert [c for c in seen.collectives if c.backward] == []
        plain(x).pow(2).mean().backward()
    for got, want in ((model.weight.grad, plain.weight.grad), (model.bias.grad, plain.bias.grad)):
        value, collectives = issued(lambda: gather(got))
        assert collectives == [("all_reduce", ("x",), True)]  # (a gradient's sum: counted as backward's work)
        torch.testing.assert_close(value, want)


def test_a_gradient_stays_pending_through_a_relayout_back_to_its_leaf(mesh22):
    """A weight sharded over "y", relayouted to replicated in the forward, gets its gradient as a sum pending over
    the batch's "x", replicated over "y". Relayouted back to the leaf's layout, the sum stays pending (slicing a sum
    gives the slice's sum): micro-batches accumulate without a collective, and reading the gradient is one
    all-reduce, of the slice."""
    torch.manual_seed(0)
    vw = torch.randn(4, 3)
    w = spmd.DVariable(vw, layout=Layout(["y", U], mesh22))
    want = torch.zeros(4, 3)
    for _ in range(2):
        vx = torch.randn(4, 4)
        x = spmd.copy_to_mesh(vx, Layout(["x", U], mesh22))
        with Recorder() as seen:
            (x @ spmd.relayout(w, Layout([U, U], mesh22))).sum().backward()
        assert [(c.kind, c.mesh_dims) for c in seen.collectives] == [("all_gather", ("y",))]
        want += vx.sum(0, keepdim=True).T.expand(4, 3)
    assert w.grad._pending == ("x",) and w.grad._layout == w._layout
    value, collectives = issued(lambda: gather(w.grad))
    assert collectives == [("all_reduce", ("x",), True)]
    torch.testing.assert_close(value, want)


def test_an_op_wanting_the_reduced_dim_sharded_gets_a_reduce_scatter(mesh22):
    torch.manual_seed(0)
    vx, vw, vb = torch.randn(4, 8), torch.randn(8, 4), torch.randn(4, 4)
    x, w = _row_parallel(mesh22, vx, vw)
    b = spmd.copy_to_mesh(vb, Layout(["y", U], mesh22))  # e.g. a sequence-parallel residual
    out, collectives = issued(lambda: b + x @ w)
    assert collectives == [("reduce_scatter", ("y",), False)]
    assert spmd.fetch_layout(out) == Layout(["y", U], mesh22)
    torch.testing.assert_close(gather(out), vb + vx @ vw)


@pytest.mark.parametrize("name, fn, pending, reductions", [
    # linear in the pending sums: they stay pending, one all-reduce when the result is read
    ("sum of two products", lambda p, q, r: p + q, ("y",), 1),
    ("difference, scaled", lambda p, q, r: (p - q) * 2 / 3, ("y",), 1),
    ("negated", lambda p, q, r: -p, ("y",), 1),
    ("times a replicated factor", lambda p, q, r: p * r, ("y",), 1),
    ("divided by a replicated value", lambda p, q, r: p / (r.abs() + 1), ("y",), 1),
    ("summed over an unsharded axis", lambda p, q, r: p.sum(0), ("y",), 1),
    ("a view, transposed", lambda p, q, r: p.view(2, 8).t(), ("y",), 1),
    # not linear: each sum is resolved first
    ("plus a replicated value", lambda p, q, r: p + r, (), 1),
    ("product of two sums", lambda p, q, r: p * q, (), 2),
    ("divided by a sum", lambda p, q, r: r / (q.abs() + 1), (), 1),
    # reads only the layout and shape: nothing to reduce at all
    ("ones_like", lambda p, q, r: torch.ones_like(p), (), 0),
])
def test_pending_sums_pass_through_linear_ops(mesh22, name, fn, pending, reductions):
    torch.manual_seed(0)
    vx, vw, vu, vv, vr = torch.randn(4, 8), torch.randn(8, 4), torch.randn(4, 8), torch.randn(8, 4), torch.randn(4)
    x, w = _row_parallel(mesh22, vx, vw)
    u, v = _row_parallel(mesh22, vu, vv)
    r = spmd.copy_to_mesh(vr, Layout([U], mesh22))
    out, collectives = issued(lambda: fn(x @ w, u @ v, r))
    assert out._pending == pending
    read, more = issued(gather, out)
    assert collectives + more == [("all_reduce", ("y",), False)] * reductions
    torch.testing.assert_close(read, fn(vx @ vw, vu @ vv, vr))


def test_a_linear_op_keeps_the_sum_pending_for_a_reduce_scatter(mesh22):
    torch.manual_seed(0)
    vx, vw = torch.randn(4, 8), torch.randn(8, 4)
    x, w = _row_parallel(mesh22, vx, vw)
    out, collectives = issued(lambda: spmd.relayout((x @ w) * 0.5, Layout(["y", U], mesh22)))
    assert collectives == [("reduce_scatter", ("y",), False)]
    expected = spmd.copy_to_mesh(vx @ vw * 0.5, Layout(["y", U], mesh22))
    for got, want in zip(components(out), components(expected), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["3-D matmul", "3-D linear", "2-D linear with a bias", "3-D linear with a bias"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "spmd.function"])
def test_a_row_parallel_layer_leaves_its_sum_for_a_sequence_parallel_reduce_scatter(mesh22, name, compiled):
    """Megatron's sequence parallelism: a row-parallel layer's result relayouted to sequence-sharded rows is one
    reduce-scatter (not an all-reduce and a slice), where torch folds a 3-D input's rows into a matrix product and
    views the result back, and where the layer adds a bias (to one summand per group); its backward gathers the
    result's gradient, nothing more. Values, gradients and components equal plain torch's."""
    torch.manual_seed(0)
    rows = (2, 8) if name.startswith("3-D") else (16,)
    vx, vw, vb = torch.randn(*rows, 8), torch.randn(4, 8), torch.randn(4)
    target = Layout([U] * (len(rows) - 1) + ["y", U], mesh22)
    fn = {"3-D matmul": lambda x, w, b: x @ w.t(), "3-D linear": lambda x, w, b: F.linear(x, w),
          "2-D linear with a bias": F.linear, "3-D linear with a bias": F.linear}[name]
    inputs = [spmd.copy_to_mesh(v, Layout(axes, mesh22)).requires_grad_()
              for v, axes in ((vx, [U] * len(rows) + ["y"]), (vw, [U, "y"]), (vb, [U]))]

    def step(x, w, b):
        return spmd.relayout(fn(x, w, b), target)
    if compiled:  # (a compiled graph's collectives are listed by `explain`; they run unrecorded)
        step = spmd.function(step, backend="aot_eager")
        assert [(c.kind, c.mesh_dims) for c in step.explain(*inputs).collectives] == [("reduce_scatter", ("y",))]
    with Recorder() as seen:
        out = step(*inputs)
        (out ** 2).sum().backward()
    if not compiled:
        assert [(c.kind, c.mesh_dims, c.backward) for c in seen.collectives] == [
            ("reduce_scatter", ("y",), False), ("all_gather", ("y",), True)]
    plain = [v.clone().requires_grad_() for v in (vx, vw, vb)]
    expected = fn(*plain)
    (expected ** 2).sum().backward()
    for got, want in zip(components(out), components(spmd.copy_to_mesh(expected.detach(), target)), strict=True):
        torch.testing.assert_close(got, want)
    for t, p in zip(inputs, plain, strict=True):
        assert (t.grad is None) == (p.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(gather(t.grad), p.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", [["x+y", U], ["x", U], [U, U]])
def test_a_bias_is_added_once_to_a_sum_over_several_mesh_dims(mesh22, target):
    """A layer whose contraction axis is sharded over both mesh dims ("x+y") adds its bias once to the sum, whatever
    layout reads the result."""
    torch.manual_seed(0)
    vx, vw, vb = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4)
    x, w = (spmd.copy_to_mesh(v, Layout([U, "x+y"], mesh22)) for v in (vx, vw))
    out = spmd.relayout(F.linear(x, w, spmd.copy_to_mesh(vb, Layout([U], mesh22))), Layout(target, mesh22))
    torch.testing.assert_close(gather(out), F.linear(vx, vw, vb))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "spmd.function"])
def test_a_sequence_parallel_megatron_block_gathers_and_reduce_scatters_once_each_way(compiled):
    """Megatron's sequence-parallel MLP block on [batch, seq, hidden], the sequence sharded over `model` between
    blocks: forward one all-gather (into the column-parallel layer) and one reduce-scatter (out of the row-parallel
    layer, its bias included); backward the same two, mirrored; the rest is data parallelism's gradient sums over
    `batch` (and over both dims for the norm's weight, replicated over the sequence's shards). Values and gradients
    equal plain torch's."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    torch.manual_seed(0)
    values = [torch.randn(4, 8, 6), torch.randn(16, 6), torch.randn(16), torch.randn(6, 16), torch.randn(6),
              torch.randn(6)]
    layouts = [["batch", "model", U], ["model", U], ["model"], [U, "model"], [U], [U]]
    inputs = [spmd.copy_to_mesh(v, Layout(axes, mesh)).requires_grad_() for v, axes in zip(values, layouts)]
    sequence_sharded, whole_sequence = Layout(["batch", "model", U], mesh), Layout(["batch", U, U], mesh)

    def loss(x, w1, b1, w2, b2, g, relayout=spmd.relayout):
        h = relayout(F.layer_norm(x, (6,), g), whole_sequence)
        h = F.gelu(F.linear(h, w1, b1))
        return ((x + relayout(F.linear(h, w2, b2), sequence_sharded)) ** 2).sum()
    step = spmd.function(loss, backend="aot_eager") if compiled else loss
    with Recorder() as seen:  # (a compiled graph's collectives run unrecorded: `explain` lists them)
        total = step(*inputs)
        total.backward()
    listed = step.explain(*inputs, backward=True) if compiled else seen
    collectives = [(c.kind, c.mesh_dims, c.backward) for c in listed.collectives]
    model = [(kind, backward) for kind, dims, backward in collectives if dims == ("model",)]
    assert model == [("all_gather", False), ("reduce_scatter", False), ("all_gather", True),
                     ("reduce_scatter", True)]
    assert {dims for _, dims, _ in collectives} <= {("model",), ("batch",), ("batch", "model")}
    plain = [v.clone().requires_grad_() for v in values]
    expected = loss(*plain, relayout=lambda t, layout: t)
    expected.backward()
    torch.testing.assert_close(spmd.to_global(total), expected.detach())
    for t, p in zip(inputs, plain, strict=True):
        torch.testing.assert_close(spmd.to_global(t.grad), p.grad, rtol=1e-5, atol=1e-5)


def _written_through_a_view(h, sharded):
    v = h.view(16)
    v.add_(1)
    return [h, v]


def _overwritten_through_a_view(h, sharded):
    v = h.t()
    v.copy_(torch.arange(16.0).view(4, 4) if not isinstance(h, spmd.DTensor) else spmd.copy_to_mesh(
        torch.arange(16.0).view(4, 4), spmd.fetch_layout(v)))
    return [h, v]


def _zeroed_through_a_view(h, sharded):
    v = h.view(2, 8)
    v.zero_()
    return [h, v]


def _base_written_first(h, sharded):
    v = h.view(16)
    h.add_(1)
    return [v, h]


def _base_scaled_first(h, sharded):
    v = h.view(16)
    h.mul_(2)  # (linear in the sum: still pending, in the memory the view shares)
    return [v, h]


# name: (fn(product, relayout to sharded rows) -> the tensors read, in order; the collectives reading them runs)
_VIEW_OF_A_SUM = {
    "the view read first": (lambda h, sharded: [h.view(2, 8), h], [("all_reduce", ("y",))]),
    "the base read first": (lambda h, sharded: [h, h.t()], [("all_reduce", ("y",))]),
    "a view of a view": (lambda h, sharded: [h.view(2, 8).t(), h], [("all_reduce", ("y",))]),
    "written through the view": (_written_through_a_view, [("all_reduce", ("y",))]),
    "overwritten through the view": (_overwritten_through_a_view, [("all_reduce", ("y",))]),
    "zeroed through the view": (_zeroed_through_a_view, [("all_reduce", ("y",))]),
    "the base written first": (_base_written_first, [("all_reduce", ("y",))]),
    "the base scaled first": (_base_scaled_first, [("all_reduce", ("y",))]),
    "the view relayouted to sharded rows": (lambda h, sharded: [sharded(h.view(2, 8)), h],
                                            [("reduce_scatter", ("y",)), ("all_reduce", ("y",))]),
}


@pytest.mark.parametrize("name", _VIEW_OF_A_SUM)
def test_a_view_of_a_pending_sum_shares_one_reduction_and_every_write_with_its_base(mesh22, name):
    """A view (`view`, `t`) of a product over a sharded contraction axis keeps the sum pending (a consumer may
    reduce-scatter it); reading it reduces its base in place and takes the view again, so one all-reduce serves
    both and they share memory, as torch's view and base do: writes through either reach the other."""
    fn, expected = _VIEW_OF_A_SUM[name]
    torch.manual_seed(0)
    vx, vw = torch.randn(4, 8), torch.randn(8, 4)
    x, w = _row_parallel(mesh22, vx, vw)
    rows = Layout(["y", U], mesh22)
    values, collectives = issued(lambda: [gather(t) for t in fn(x @ w, lambda t: spmd.relayout(t, rows))])
    assert [(kind, dims) for kind, dims, _ in collectives] == expected
    for got, want in zip(values, fn(vx @ vw, lambda t: t), strict=True):
        torch.testing.assert_close(got, want)


def test_vocab_parallel_softmax_declares_its_collectives(mesh22):
    x = spmd.copy_to_mesh(torch.randn(4, 8), Layout([U, "y"], mesh22))
    decision = registry.lookup(aten._softmax.default).rule(_call_with(aten._softmax.default, x, -1, False))
    assert decision.collectives == (Collective(Kind.ALL_REDUCE, ("y",), op="max"),
                                    Collective(Kind.ALL_REDUCE, ("y",), op="sum"))
    out, collectives = issued(F.softmax, x, -1)
    assert collectives == [("all_reduce", ("y",), False)] * 2
    torch.testing.assert_close(gather(out), F.softmax(gather(x), -1))


def _call_with(func, tensor, *static):
    mesh = tensor._layout.mesh
    spec = TensorSpec(tensor._layout.axes, tuple(tensor.shape), tensor.dtype)
    return OpCall(func, (spec, *static), {}, mesh, mesh.num_local_devices())


def test_sum_over_a_sharded_axis_reduces_once_when_read(mesh22):
    value = torch.arange(16.).reshape(4, 4)
    t = spmd.copy_to_mesh(value, Layout(["x", "y"], mesh22))
    total, collectives = issued(torch.sum, t)
    assert collectives == []
    (got, collectives) = issued(total.item)
    assert got == value.sum().item()
    assert collectives == [("all_reduce", ("x", "y"), False)]  # one all-reduce over both dims, not one per dim


# -- pending reductions: every way a value is read sees the reduced value -------------------------------------------
@pytest.mark.parametrize("read", ["unpack", "to_global", "repr", "numpy", "view_then_inplace", "inplace", "twice"])
def test_a_pending_reduction_is_resolved_by_every_reader(mesh22, read):
    torch.manual_seed(0)
    vx, vw = torch.randn(4, 8), torch.randn(8, 4)
    x, w = _row_parallel(mesh22, vx, vw)
    y, expected = x @ w, vx @ vw
    if read == "unpack":
        for c in spmd.unpack(y):
            torch.testing.assert_close(c, expected)
    elif read == "to_global":
        torch.testing.assert_close(spmd.to_global(y), expected)
    elif read == "repr":
        assert repr(y).startswith("DTensor([[") and not y._pending
        torch.testing.assert_close(gather(y), expected)
    elif read == "numpy":
        torch.testing.assert_close(torch.from_numpy(y.numpy()), expected)
    elif read == "view_then_inplace":
        v = y.view(-1)
        v.add_(1)  # the view shares the resolved components: the update reaches y
        torch.testing.assert_close(gather(y), expected + 1)
    elif read == "inplace":
        y.mul_(2)
        torch.testing.assert_close(gather(y), expected * 2)
    else:
        _, collectives = issued(torch.mul, y, y)
        assert collectives == [("all_reduce", ("y",), False)]


def test_weight_gradient_reduce_scatters_into_a_sharded_parameter(mesh22):
    """Data parallel over x with the weight sharded over x (ZeRO-style): the weight gradient's reduction over
    the batch dim arrives as one reduce-scatter, not an all-reduce and a slice."""
    torch.manual_seed(0)
    vx, vw = torch.randn(8, 4), torch.randn(4, 6)
    x = spmd.copy_to_mesh(vx, Layout(["x", U], mesh22))
    w = spmd.copy_to_mesh(vw, Layout(["x", U], mesh22)).requires_grad_()
    w_full = spmd.relayout(w, Layout([U, U], mesh22))
    loss = (x @ w_full).square().sum()
    _, collectives = issued(loss.backward)
    assert [c for c in collectives if c[2]] == [("reduce_scatter", ("x",), True)]
    plain = vw.clone().requires_grad_()
    (vx @ plain).square().sum().backward()
    assert spmd.fetch_layout(w.grad) == Layout(["x", U], mesh22)
    torch.testing.assert_close(gather(w.grad), plain.grad)


def test_a_detached_pending_tensor_is_reduced_once(mesh22, monkeypatch):
    """Autograd's detach has a fast path outside the recorder, so this counts what the planner executes."""
    torch.manual_seed(0)
    vx, vw = torch.randn(4, 8), torch.randn(8, 4)
    x, w = _row_parallel(mesh22, vx, vw)
    y = x @ w
    executed = []
    run_one = planner.execute
    monkeypatch.setattr(planner, "execute", lambda comm, step, *rest: executed.append(step.kind) or
                        run_one(comm, step, *rest))
    d = y.detach()
    d + 1, y + 1
    assert executed == [Kind.ALL_REDUCE]
    torch.testing.assert_close(gather(d), vx @ vw)


TWO_STEP_REDUCTIONS = {  # op -> (the all-reduces over a sharded reduced axis)
    "logsumexp": (lambda x: torch.logsumexp(x, 1), ["max", "sum"]),
    "var": (lambda x: x.var(1), ["sum", "sum"]),
    "std keepdim, no correction": (lambda x: x.std(1, correction=0, keepdim=True), ["sum", "sum"]),
    "var_mean": (lambda x: torch.var_mean(x, (0, 1)), ["sum", "sum"]),
    "std_mean": (lambda x: torch.std_mean(x, 1), ["sum", "sum"]),
    "any": (lambda x: (x > 0.5).any(1), ["max"]),
    "all": (lambda x: x.isfinite().all(), ["min"]),
}


@pytest.mark.parametrize("name", TWO_STEP_REDUCTIONS)
def test_reductions_in_two_steps_all_reduce_partial_results(name, mesh22):
    """logsumexp, var/std (and with the mean), any/all over a sharded axis: each device's partial result, all-reduced
    (no gather of the tensor); values in every layout as torch's."""
    fn, ops = TWO_STEP_REDUCTIONS[name]
    value = torch.randn(4, 8, dtype=torch.float64)
    value[1, 2] = float("-inf") if name == "logsumexp" else value[1, 2]
    assert check_op(fn, [value], mesh=mesh22) > 1
    x = spmd.copy_to_mesh(value, Layout([U, ("x", "y")], mesh22))
    with Recorder() as seen:
        fn(x)
    assert [(c.kind, c.mesh_dims) for c in seen.collectives] == [("all_reduce", ("x", "y"))] * len(ops)


@pytest.mark.parametrize("fn, gathered", [
    (torch.prod, ["x", "y"]), (lambda x: x.prod(1), ["y"]), (lambda x: x.prod(0, keepdim=True), ["x"]),
    (lambda x: x.prod(-1, dtype=torch.float64), ["y"])], ids=["all", "dim", "keepdim", "dtype"])
def test_a_product_over_sharded_axes_gathers_one_value_per_device(fn, gathered, mesh22):
    """The blocks' products, all-gathered (one per device and row) and multiplied: values (zeros and signs
    included) and gradients as torch's, for every layout of a 2x2 mesh."""
    value = torch.tensor([[1.5, -0.5, 2.0, 0.75], [0.0, 1.25, -2.0, 0.5], [-1.0, 0.5, 1.5, -1.25],
                          [0.5, 0.0, 0.0, 2.0]])
    assert check_op(fn, [value], mesh=mesh22) > 1
    assert check_op(fn, [(value * 4).to(torch.int32)], mesh=mesh22) > 1
    x = spmd.copy_to_mesh(value.repeat(4, 4), Layout(["x", "y"], mesh22))  # blocks of 8 x 8
    with Recorder() as seen:
        out = fn(x)
    assert [(c.kind, c.mesh_dims) for c in seen.collectives] == [("all_gather", (m,)) for m in gathered]
    assert all(c.bytes <= 8 * out.element_size() for c in seen.collectives)  # a value per row of a block of 8


@pytest.mark.parametrize("fn", [lambda x: torch.argmax(x, 1), lambda x: torch.argmin(x, -1, keepdim=True),
                                lambda x: torch.max(x, 1), lambda x: torch.min(x, 1, keepdim=True)],
                         ids=["argmax", "argmin keepdim", "max.dim", "min.dim keepdim"])
def test_argmax_over_a_sharded_axis_gathers_one_value_per_device(fn, mesh22):
    """Each device's extreme and its global index, all-gathered (one of each per device and row): the first index
    of the whole axis on a tie and NaN propagating, as torch's."""
    value = torch.tensor([[1.0, 3, 3, 0, 3, 1, 0, 3], [0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0],
                          [2, 2, 2, 2, 2, 2, 2, 2]], dtype=torch.float64)
    assert check_op(fn, [value], mesh=mesh22) > 1
    with_nan = value.clone()
    with_nan[1, 5] = with_nan[2, 6] = float("nan")
    assert check_op(fn, [with_nan], mesh=mesh22, grad=False) > 1
    x = spmd.copy_to_mesh(value, Layout([U, "y"], mesh22))
    with Recorder() as seen:
        fn(x)
    assert [(c.kind, c.mesh_dims, c.bytes) for c in seen.collectives] == [("all_gather", ("y",), 4 * 8)] * 2
