"""`spmd.register_sharding`: a torch.library op's sharding declared by a factor rule — values, gradients and every
device's component against plain torch for every layout, the collectives each layout costs, function mode, and
the errors of a wrong rule."""

import pytest
import torch

import spmd
from spmd import UNSHARDED as U, Layout
from tests.sweep import MESH, all_layouts, check_op, check_replicas, issued, rand

_CALLS = {"norm": 0, "gelu": 0}


def _norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.library.custom_op("spmd_test::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    _CALLS["norm"] += 1
    return _norm(x, w, eps)


@rms_norm.register_fake
def _(x, w, eps):
    return torch.empty_like(x)


def _norm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.eps = inputs[2]


def _norm_backward(ctx, grad):
    x, w = ctx.saved_tensors
    with torch.enable_grad():
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        gx, gw = torch.autograd.grad(_norm(x, w, ctx.eps), (x, w), grad)
    return gx, gw, None


rms_norm.register_autograd(_norm_backward, setup_context=_norm_setup)
spmd.register_sharding(rms_norm, "... h, h -> ... h", need_replication_factors=("h",))


@torch.library.custom_op("spmd_test::matmul", mutates_args=())
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@matmul.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


matmul.register_autograd(lambda ctx, g: (g @ ctx.b.T, ctx.a.T @ g),
                         setup_context=lambda ctx, inputs, output: setattr(ctx, "a", inputs[0]) or
                         setattr(ctx, "b", inputs[1]))
spmd.register_sharding(matmul, "i j, j k -> i k", reduction_factors=("j",))


@torch.library.custom_op("spmd_test::scaled_gelu", mutates_args=())
def scaled_gelu(x: torch.Tensor, scale: float) -> torch.Tensor:
    _CALLS["gelu"] += 1
    return torch.nn.functional.gelu(x) * scale


scaled_gelu.register_fake(lambda x, scale: torch.empty_like(x))
spmd.register_sharding(scaled_gelu, "... -> ...")


@torch.library.custom_op("spmd_test::row_stats", mutates_args=())
def row_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return 2 * x, x.sum(-1)


row_stats.register_fake(lambda x: (torch.empty_like(x), x.new_empty(x.shape[:-1])))
spmd.register_sharding(row_stats, "i j -> i j, i", reduction_factors=("j",))


def test_a_norm_matches_torch_for_every_layout_values_gradients_and_components():
    assert check_op(lambda x, w: rms_norm(x, w, 1e-5), [rand(4, 2, 6), rand(6, seed=1)]) > 20


def test_a_contraction_matches_torch_for_every_layout():
    assert check_op(matmul, [rand(4, 6), rand(6, 2, seed=1)]) > 20


def test_an_elementwise_op_and_two_results_match_torch_for_every_layout():
    check_op(lambda x: scaled_gelu(x, 0.5), [rand(4, 2, 6)], grad=False)
    check_op(row_stats, [rand(4, 6)], grad=False)


@pytest.mark.parametrize("specs, collectives, out", [
    (["x", "y", U], [], ["x", "y", U]),  # rows sharded: each device normalises its own rows
    ([U, U, "y"], [("all_gather", ("y",))], [U, U, U]),  # the normalised axis: gathered
    (["x", U, "y"], [("all_gather", ("y",))], ["x", U, U]),
    ([("x", "y"), U, U], [], [("x", "y"), U, U]),  # rows sharded over both mesh dims
])
def test_a_norm_gathers_only_its_normalised_axis(specs, collectives, out):
    x = spmd.copy_to_mesh(rand(4, 2, 6), Layout(specs, MESH))
    w = spmd.copy_to_mesh(rand(6, seed=1), Layout([U], MESH))
    y, got = issued(lambda: rms_norm(x, w, 1e-5))
    assert got == collectives
    assert spmd.fetch_layout(y) == Layout(out, MESH)
    torch.testing.assert_close(spmd.to_global(y), _norm(rand(4, 2, 6), rand(6, seed=1), 1e-5))


def test_a_sharded_weight_is_gathered_to_the_rows_layout():
    x = spmd.copy_to_mesh(rand(4, 2, 6), Layout(["x", U, U], MESH))
    w = spmd.copy_to_mesh(rand(6, seed=1), Layout(["y"], MESH))
    y, got = issued(lambda: rms_norm(x, w, 1e-5))
    assert got == [("all_gather", ("y",))] and spmd.fetch_layout(y) == Layout(["x", U, U], MESH)


def test_a_reduction_factor_stays_sharded_and_leaves_the_sum_pending():
    a, b = rand(4, 6), rand(6, 2, seed=1)
    da, db = spmd.copy_to_mesh(a, Layout(["x", "y"], MESH)), spmd.copy_to_mesh(b, Layout(["y", U], MESH))
    c, got = issued(lambda: matmul(da, db))
    assert got == [] and c._pending == ("y",) and spmd.fetch_layout(c) == Layout(["x", U], MESH)
    # the consumer decides: a relayout sharded over the summed dim reduce-scatters
    c, got = issued(lambda: spmd.relayout(c, Layout(["x", "y"], MESH)))
    assert got == [("reduce_scatter", ("y",))]
    torch.testing.assert_close(spmd.to_global(c), a @ b)


def test_a_result_that_keeps_a_reduction_factor_stays_sharded_where_the_other_is_pending():
    x = spmd.copy_to_mesh(rand(4, 6), Layout([U, "y"], MESH))
    (twice, sums), got = issued(lambda: row_stats(x))
    assert got == [] and spmd.fetch_layout(twice) == Layout([U, "y"], MESH) and not twice._pending
    assert sums._pending == ("y",)
    torch.testing.assert_close(spmd.to_global(sums), rand(4, 6).sum(-1))


def test_an_all_ellipsis_rule_calls_the_op_once_on_the_stack_of_every_devices_components():
    x = spmd.copy_to_mesh(rand(4, 2, 6), Layout(["x", U, "y"], MESH))
    before = _CALLS["gelu"]
    y = scaled_gelu(x, 0.5)
    assert _CALLS["gelu"] - before == 1 and spmd.fetch_layout(y) == spmd.fetch_layout(x)
    before = _CALLS["norm"]
    rms_norm(x, spmd.copy_to_mesh(rand(6, seed=1), Layout([U], MESH)), 1e-5)
    assert _CALLS["norm"] - before == MESH.num_local_devices()  # a weight without `...`: once per device


def test_a_broadcast_ellipsis_axis_is_not_sharded():
    @torch.library.custom_op("spmd_test::add_bias", mutates_args=())
    def add_bias(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return x + b
    spmd.register_sharding(add_bias, "... h, ... h -> ... h")
    x, b = rand(4, 6), rand(1, 6, seed=1)
    dx, db = spmd.copy_to_mesh(x, Layout(["x", "y"], MESH)), spmd.copy_to_mesh(b, Layout([U, U], MESH))
    out, got = issued(lambda: add_bias(dx, db))
    assert spmd.fetch_layout(out) == Layout(["x", "y"], MESH) and got == []
    torch.testing.assert_close(spmd.to_global(out), x + b)
    check_op(add_bias, [rand(2, 4, 6), rand(1, 6, seed=1)], grad=False)
    check_op(add_bias, [rand(2, 4, 6), rand(4, 6, seed=1)], grad=False)


def test_under_function_mode_the_op_is_traced_with_its_decision():
    x = spmd.copy_to_mesh(rand(4, 2, 6), Layout(["x", "y", U], MESH))
    w = spmd.copy_to_mesh(rand(6, seed=1), Layout([U], MESH))

    def f(x, w):
        return rms_norm(x, w, 1e-5).sum(-1)
    fn = spmd.function(f, backend="aot_eager")
    out = fn(x, w)
    torch.testing.assert_close(spmd.to_global(out), f(rand(4, 2, 6), rand(6, seed=1)))
    explanation = fn.explain(x, w)
    assert explanation.collectives == [] and "spmd_test.rms_norm" in str(explanation)


def test_a_callable_rule_reads_the_arguments():
    @torch.library.custom_op("spmd_test::norm_over", mutates_args=())
    def norm_over(x: torch.Tensor, dim: int) -> torch.Tensor:
        return x / x.norm(dim=dim, keepdim=True)

    @spmd.register_sharding(norm_over, need_replication_factors=("n",))
    def _rule(x, dim):
        assert x.device.type == "meta"
        names = [f"a{i}" for i in range(x.dim())]
        names[dim] = "n"
        return " ".join(names) + " -> " + " ".join(names)
    for dim in (0, 1):
        x = spmd.copy_to_mesh(rand(4, 6), Layout(["x", "y"], MESH))
        out, got = issued(lambda: norm_over(x, dim))
        assert got == [("all_gather", (("x", "y")[dim],))]
        torch.testing.assert_close(spmd.to_global(out), norm_over(rand(4, 6), dim))


def test_registering_replaces_the_replicated_fallback_already_cached():
    @torch.library.custom_op("spmd_test::late", mutates_args=())
    def late(x: torch.Tensor) -> torch.Tensor:
        return x * 3
    x = spmd.copy_to_mesh(rand(4, 6), Layout(["x", U], MESH))
    with pytest.warns(UserWarning, match="no sharding rule"):
        _, before = issued(lambda: late(x))
    assert before == [("all_gather", ("x",))]
    spmd.register_sharding(late, "... -> ...")
    out, after = issued(lambda: late(x))
    assert after == [] and spmd.fetch_layout(out) == Layout(["x", U], MESH)


def _op(name: str, schema: str, impl=lambda *a: a[0].clone() if len(a) == 1 else a[0] + a[1]):
    """An op without a fake (meta) kernel, defined by the low-level torch.library API."""
    lib = torch.library.Library("spmd_test_bad", "FRAGMENT")
    lib.define(schema)
    lib.impl(name, impl, "CPU")
    _op.libs.append(lib)
    return getattr(torch.ops.spmd_test_bad, name).default


_op.libs = []


@pytest.mark.parametrize("rule, message", [
    ("i j", "is not 'operands -> results'"),
    ("i j -> i -> j", "is not 'operands -> results'"),
    ("i 2 -> i", "'2' is not a factor name"),
    ("i ... -> i", "'...' is not a factor name"),
    ("i i -> i", "a factor names one axis"),
])
def test_a_malformed_rule_is_refused_when_registered(rule, message):
    op = _op(f"malformed{abs(hash(rule))}", f"malformed{abs(hash(rule))}(Tensor x) -> Tensor")
    with pytest.raises(ValueError, match=message):
        spmd.register_sharding(op, rule)


def test_factor_lists_must_name_factors_of_the_rule():
    op = _op("factors", "factors(Tensor x, Tensor y) -> Tensor")
    with pytest.raises(ValueError, match="reduction factor 'i'.*a result lacks"):
        spmd.register_sharding(op, "i j, j -> i j", reduction_factors=("i",))
    with pytest.raises(ValueError, match="need_replication factor 'k' is not in the rule"):
        spmd.register_sharding(op, "i j, j -> i j", need_replication_factors=("k",))


@pytest.mark.parametrize("op, message", [
    (torch.ops.aten.add.Tensor, "already has a sharding rule"),
    (torch.ops.aten.linear.default, "CompositeImplicitAutograd"),
    (lambda x: x, "takes a torch.library op"),
])
def test_ops_spmd_shards_already_and_python_functions_are_refused(op, message):
    with pytest.raises((ValueError, TypeError), match=message):
        spmd.register_sharding(op, "i -> i")


def test_ops_that_return_views_or_take_lists_or_return_more_than_tensors_are_refused():
    for name, schema, message in [("aliases", "aliases(Tensor(a) x) -> Tensor(a)", "returns a view"),
                                  ("lists", "lists(Tensor[] xs) -> Tensor", "list of tensors"),
                                  ("counts", "counts(Tensor x) -> int", "returns more than tensors")]:
        with pytest.raises(ValueError, match=message):
            spmd.register_sharding(_op(name, schema), "i -> i")


def test_a_rule_that_does_not_fit_the_call_names_the_argument_and_shapes():
    op = _op("fits", "fits(Tensor x, Tensor y) -> Tensor")
    spmd.register_sharding(op, "i j, j -> i j")
    x = spmd.copy_to_mesh(rand(4, 6), Layout(["x", U], MESH))
    with pytest.raises(ValueError, match=r"argument 'y' has shape \[2, 6\], the term 'j' names 1 axes"):
        op(x, spmd.copy_to_mesh(rand(2, 6), Layout([U, U], MESH)))
    with pytest.raises(ValueError, match=r"factor 'j' is 6 and 5 long"):
        op(x, spmd.copy_to_mesh(rand(5), Layout([U], MESH)))


def test_a_rule_that_does_not_describe_the_op_is_caught_by_the_result_shapes():
    op = _op("sums", "sums(Tensor x) -> Tensor", lambda x: x.sum(-1, keepdim=True))
    spmd.register_sharding(op, "i j -> i j")  # wrong: the op sums over j
    x = spmd.copy_to_mesh(rand(4, 6), Layout(["x", "y"], MESH))
    with pytest.raises(ValueError, match=r"result 0 has shape \[2, 1\] on each device, the rule implies \[2, 3\]"):
        op(x)


@pytest.mark.parametrize("a_specs, b_specs, collectives, out, pending", [
    ([U, U], ["y", U], [], [U, U], ("y",)),  # j sharded in b only: a is sliced, the product's sum pending
    ([U, U], [U, "x"], [], [U, "x"], ()),
    (["x", U], ["y", U], [], ["x", U], ("y",)),
    (["x", U], [U, "x"], [("all_gather", ("x",))], ["x", U], ()),  # i took x first: b's k gives it up
    (["x", U], ["x", U], [("all_gather", ("x",))], ["x", U], ()),
    ([U, "y"], ["y", U], [], [U, U], ("y",)),
    ([U, "y"], [U, "x"], [], [U, "x"], ("y",)),
    ([U, "y"], ["x", U], [("all_gather", ("x",))], [U, U], ("y",)),  # j over y (a first): b's j moved there
    (["x", "y"], [U, U], [], ["x", U], ("y",)),
])
def test_a_contraction_costs_what_its_rule_implies(a_specs, b_specs, collectives, out, pending):
    a, b = spmd.copy_to_mesh(rand(4, 6), Layout(a_specs, MESH)), spmd.copy_to_mesh(rand(6, 2, seed=1),
                                                                                    Layout(b_specs, MESH))
    c, got = issued(lambda: matmul(a, b))
    assert got == collectives and spmd.fetch_layout(c) == Layout(out, MESH) and c._pending == pending
    torch.testing.assert_close(spmd.to_global(c), rand(4, 6) @ rand(6, 2, seed=1))


def test_an_optional_tensor_given_none_skips_its_term_and_a_changed_float_is_read_at_each_call():
    @torch.library.custom_op("spmd_test::affine", mutates_args=())
    def affine(x: torch.Tensor, bias: torch.Tensor | None, scale: float) -> torch.Tensor:
        return x * scale + (0 if bias is None else bias)
    spmd.register_sharding(affine, "... h, h -> ... h")
    x, b = rand(4, 6), rand(6, seed=1)
    dx = spmd.copy_to_mesh(x, Layout(["x", "y"], MESH))
    for scale in (0.5, 2.0):
        out, got = issued(lambda: affine(dx, None, scale))
        assert got == [] and spmd.fetch_layout(out) == Layout(["x", "y"], MESH)
        torch.testing.assert_close(spmd.to_global(out), x * scale)
    out, got = issued(lambda: affine(dx, spmd.copy_to_mesh(b, Layout([U], MESH)), 2.0))
    assert got == []
    torch.testing.assert_close(spmd.to_global(out), x * 2.0 + b)


# -- ops that write their arguments -----------------------------------------------------------------------------------
@torch.library.custom_op("spmd_test::add_rms_norm_", mutates_args=("x", "residual"))
def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> None:
    """residual += x; x = rms_norm(residual) * w: a fused kernel of the kind inference libraries write."""
    residual.add_(x)
    x.copy_(_norm(residual, w, eps))


add_rms_norm_.register_fake(lambda x, residual, w, eps: None)
spmd.register_sharding(add_rms_norm_, "... h, ... h, h -> ", need_replication_factors=("h",))


def _plain_add_rms_norm(x, r, w):
    x, r = x.clone(), r.clone()
    add_rms_norm_(x, r, w, 1e-5)
    return x, r


def test_an_op_writing_its_arguments_writes_each_devices_components_for_every_layout():
    """Every layout of the written activations and the read weight: sharded rows stay where they are; a sharded
    normalised axis is gathered for the op (both written arguments) and its new values sliced back into each
    device's block (no collective); a sharded weight is gathered."""
    x, r, w = rand(4, 2, 6), rand(4, 2, 6, seed=1), rand(6, seed=2)
    want_x, want_r = _plain_add_rms_norm(x, r, w)
    ran = 0
    for layout in all_layouts(MESH, x.shape):
        for w_layout in all_layouts(MESH, w.shape):
            dx, dr, dw = (spmd.copy_to_mesh(t, l) for t, l in ((x, layout), (r, layout), (w, w_layout)))
            out, got = issued(lambda: add_rms_norm_(dx, dr, dw, 1e-5))
            h, w_dim = layout.sharding_specs[-1], w_layout.sharding_specs[0]
            assert out is None and got == ([("all_gather", (h,))] * 2 if h != U else []) + (
                [("all_gather", (w_dim,))] if w_dim != U else [])
            for d, want in ((dx, want_x), (dr, want_r)):
                assert spmd.fetch_layout(d) == layout
                torch.testing.assert_close(spmd.to_global(d), want)
                for got_c, want_c in zip(spmd.unpack(d), spmd.unpack(spmd.copy_to_mesh(want, layout))):
                    torch.testing.assert_close(got_c, want_c)
                check_replicas(d)
            ran += 1
    assert ran == 13 * 3  # every layout of the activations (each axis U, x or y, a mesh dim once) and the weight's


@torch.library.custom_op("spmd_test::scale_into", mutates_args=("out",))
def scale_into(out: torch.Tensor, x: torch.Tensor, s: float) -> None:
    out.copy_(x * s)


scale_into.register_fake(lambda out, x, s: None)
spmd.register_sharding(scale_into, "i j, i j -> ")


@pytest.mark.parametrize("out_specs, x_specs, collectives", [
    (["x", U], ["x", U], []),
    (["x", U], [U, "x"], [("all_to_all", ("x",))]),  # the written buffer keeps its layout: x moves to it
    ([U, "y"], ["x", U], [("all_gather", ("x",))]),
    ([U, U], ["x", "y"], [("all_gather", ("x",)), ("all_gather", ("y",))]),
])
def test_a_written_output_buffer_keeps_its_layout_and_the_inputs_are_relayouted_to_it(out_specs, x_specs,
                                                                                     collectives):
    x = rand(4, 6)
    out = spmd.copy_to_mesh(torch.zeros(4, 6, dtype=x.dtype), Layout(out_specs, MESH))
    result, got = issued(lambda: scale_into(out, spmd.copy_to_mesh(x, Layout(x_specs, MESH)), 3.0))
    assert result is None and sorted(got) == collectives
    assert spmd.fetch_layout(out) == Layout(out_specs, MESH)
    torch.testing.assert_close(spmd.to_global(out), 3 * x)


@pytest.mark.parametrize("residual_specs, collectives", [
    ([("x", "y"), U, U], []),
    (["x", U, U], [("all_gather", ("y",))]),  # sliced to the rows' layout (free), gathered back after
    ([U, U, U], [("all_gather", ("y",)), ("all_gather", ("x",))]),
])
def test_a_written_argument_in_another_layout_is_written_through_a_relayouted_copy(residual_specs, collectives):
    """The first written argument (rows over x and y) decides; the other written one is relayouted to it for the
    op, and its new values relayouted back into its own layout."""
    x, r, w = rand(4, 2, 6), rand(4, 2, 6, seed=1), rand(6, seed=2)
    dx = spmd.copy_to_mesh(x, Layout([("x", "y"), U, U], MESH))
    dr = spmd.copy_to_mesh(r, Layout(residual_specs, MESH))
    _, got = issued(lambda: add_rms_norm_(dx, dr, spmd.copy_to_mesh(w, Layout([U], MESH)), 1e-5))
    assert got == collectives and spmd.fetch_layout(dr) == Layout(residual_specs, MESH)
    for d, want in zip((dx, dr), _plain_add_rms_norm(x, r, w)):
        torch.testing.assert_close(spmd.to_global(d), want)
        check_replicas(d)


def test_an_in_place_op_returning_its_target_returns_the_dtensor_itself():
    op = _op("double_", "double_(Tensor(a!) x) -> Tensor(a!)", lambda x: x.mul_(2))
    spmd.register_sharding(op, "... -> ...")
    dx = spmd.copy_to_mesh(rand(4, 6), Layout(["x", "y"], MESH))
    assert op(dx) is dx
    torch.testing.assert_close(spmd.to_global(dx), 2 * rand(4, 6))


def test_a_pending_sum_written_is_reduced_first_and_a_factor_the_target_lacks_is_gathered():
    @torch.library.custom_op("spmd_test::add_row_sums_", mutates_args=("acc",))
    def inc(acc: torch.Tensor, x: torch.Tensor) -> None:
        acc.add_(x.sum(-1, keepdim=True))
    spmd.register_sharding(inc, "i k, i j -> ")
    a, b = rand(4, 6), rand(6, 2, seed=1)
    acc = matmul(spmd.copy_to_mesh(a, Layout([U, "y"], MESH)), spmd.copy_to_mesh(b, Layout(["y", U], MESH)))
    assert acc._pending == ("y",)
    x = rand(4, 6, seed=2)
    _, got = issued(lambda: inc(acc, spmd.copy_to_mesh(x, Layout([U, "y"], MESH))))
    # acc's pending sum reduced in place; x's j gathered (acc, written in place, cannot hold a partial sum)
    assert sorted(got) == [("all_gather", ("y",)), ("all_reduce", ("y",))]
    torch.testing.assert_close(spmd.to_global(acc), a @ b + x.sum(-1, keepdim=True))


def test_a_copied_view_is_not_written():
    x = spmd.copy_to_mesh(rand(4, 6), Layout(["x", "y"], MESH))
    view = x.view(24)  # each device's block is not contiguous in the flat view: its components are a copy
    @torch.library.custom_op("spmd_test::inc_", mutates_args=("x",))
    def op(x: torch.Tensor) -> None:
        x.add_(1)
    spmd.register_sharding(op, "i -> ")
    with pytest.raises(spmd.UnsupportedOpError, match="writes a view"):
        op(view)


@pytest.mark.parametrize("per_device", [True, False], ids=["per-device", "stacked"])
def test_an_op_writing_its_arguments_inside_spmd_function_updates_them(per_device):
    """Compiled by inductor (whose reinplacing miscompiles writes into each device's view of one stack, and clones
    of them): the written intermediate and the written input equal plain torch's, also on the next call."""
    if per_device:
        op, w = add_rms_norm_, rand(6, seed=2)
    else:
        op, w = _add_scaled_, rand(2, 6, seed=2)

    def step(a, b, w):
        a = a * 2
        op(a, b, w, 1e-5)
        return a + 1

    fn = spmd.function(step)
    dw = spmd.copy_to_mesh(w, Layout([U] * w.dim(), MESH))
    for seed in (0, 1):
        x, r = rand(4, 2, 6, seed=seed), rand(4, 2, 6, seed=seed + 5)
        dr = spmd.copy_to_mesh(r, Layout(["x", "y", U], MESH))
        out = fn(spmd.copy_to_mesh(x, Layout(["x", "y", U], MESH)), dr, dw)
        torch.testing.assert_close(spmd.to_global(out), step(x, r, w))  # (r written in place too)
        torch.testing.assert_close(spmd.to_global(dr), r)
    assert fn.experimental_get_tracing_count() == 1


@torch.library.custom_op("spmd_test::add_scaled_", mutates_args=("x", "residual"))
def _add_scaled_(x: torch.Tensor, residual: torch.Tensor, s: torch.Tensor, eps: float) -> None:
    residual.add_(x)
    x.copy_(residual * s + eps)


_add_scaled_.register_fake(lambda x, residual, s, eps: None)
spmd.register_sharding(_add_scaled_, "... h, ... h, ... h -> ")  # every term `...`: one call on the stacks
