"""Values replicated over the whole mesh are held once (a stack shared by every device, stride 0) and computed once,
and a contraction's partial products on an in-process mesh are one product (a `same` pending sum). Neither may
change a value, a component or the collectives an op issues."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd
from spmd import UNSHARDED as U, Layout
from spmd.collectives.local import shared
from sweep import check_op, check_replicas, components, gather, issued, rand, reduce_gradients


@pytest.fixture
def mesh4():
    return spmd.create_mesh([("batch", 4)])


def _storage_bytes(t) -> int:
    return t._stack.untyped_storage().nbytes()


def test_a_replicated_value_is_one_copy_and_ops_on_it_run_once(mesh4):
    x = torch.randn(8, 6)
    d = spmd.copy_to_mesh(x, Layout([U, U], mesh4))
    assert shared(d._stack) and _storage_bytes(d) == x.numel() * 4  # one copy, not four
    x.add_(1)  # the DTensor does not alias the user's tensor
    torch.testing.assert_close(gather(d), x - 1)
    y, collectives = issued(lambda: (d * 2).exp().sum(0))
    assert shared(y._stack) and collectives == []
    assert torch.allclose(gather(y), ((x - 1) * 2).exp().sum(0))
    check_replicas(y)


def test_in_place_ops_write_the_shared_copy_once(mesh4):
    x = torch.randn(8, 6)
    d = spmd.copy_to_mesh(x, Layout([U, U], mesh4))
    view = d[2:]  # a view shares the copy: the write reaches it
    d.mul_(3).add_(1)
    assert shared(d._stack) and torch.equal(gather(d), x * 3 + 1) and torch.equal(gather(view), (x * 3 + 1)[2:])
    check_replicas(d)


def test_a_write_per_device_gives_each_device_its_own_memory(mesh4):
    """A batch norm sharded over the batch writes its (replicated) running statistics in its kernel."""
    bn = nn.BatchNorm1d(6)
    ref = nn.BatchNorm1d(6)
    spmd.distribute_module(bn, mesh4)
    assert shared(bn.running_mean._stack)
    x = torch.randn(8, 6)
    bn(spmd.copy_to_mesh(x, Layout(["batch", U], mesh4)))
    ref(x)
    assert not shared(bn.running_mean._stack)
    torch.testing.assert_close(gather(bn.running_mean), ref.running_mean)
    torch.testing.assert_close(gather(bn.running_var), ref.running_var)
    check_replicas(bn.running_var)


def test_data_parallel_weight_gradient_is_one_product_and_one_all_reduce(mesh4):
    x, g = torch.randn(8, 4), torch.randn(8, 3)
    dx, dg = (spmd.copy_to_mesh(t, Layout(["batch", U], mesh4)) for t in (x, g))
    grad, collectives = issued(lambda: dx.t() @ dg)
    assert collectives == [] and grad._pending == ("batch",) and grad._pending_op == "same"
    resolved, collectives = issued(lambda: grad + 0)  # `grad + 0` is not linear in a sum: resolved first
    assert collectives == [("all_reduce", ("batch",))]
    assert shared(resolved._stack)
    torch.testing.assert_close(gather(resolved), x.t() @ g)
    # a sequence-parallel consumer: the same pending sum is one reduce-scatter
    out, collectives = issued(lambda: spmd.relayout(dx.t() @ dg, Layout(["batch", U], mesh4)))
    assert collectives == [("reduce_scatter", ("batch",))]
    torch.testing.assert_close(gather(out), x.t() @ g)


@pytest.mark.parametrize("kind", ["mm", "addmm"])
def test_a_product_with_a_weight_every_device_holds_is_one_matrix_product(mesh4, kind):
    """x sharded over the batch times a replicated weight (held once): one `mm` (or `addmm`, the bias added inside
    the product) of all devices' rows, no collective, each device's rows as plain torch computes them; on one
    device, plain torch's kernel bit for bit."""
    x, w, b = torch.randn(8, 16), torch.randn(16, 32), torch.randn(32)
    op = (lambda x, w, b: x @ w) if kind == "mm" else (lambda x, w, b: torch.addmm(b, x, w))
    mesh1 = spmd.create_mesh([("batch", 1)], devices=["CPU:0"])
    for mesh in (mesh4, mesh1):
        dx = spmd.copy_to_mesh(x, Layout(["batch", U], mesh))
        dw, db = (spmd.copy_to_mesh(t, Layout([U] * t.dim(), mesh)) for t in (w, b))
        assert mesh is mesh1 or shared(dw._stack)
        with torch.profiler.profile() as prof:  # (it sees the kernels run on the stacked components too)
            out, collectives = issued(lambda: op(dx, dw, db))
        assert collectives == [] and spmd.fetch_layout(out) == Layout(["batch", U], mesh)
        kernels = {event.name for event in prof.events()}
        assert "aten::bmm" not in kernels and "aten::add_" not in kernels
        assert not out._stack._is_view()  # (a view as the components would cost copies later: gloo, buckets)
        for block, component in zip(x.chunk(mesh.size), spmd.unpack(out)):
            torch.testing.assert_close(component, op(block, w, b))
    assert torch.equal(spmd.unpack(out)[0], op(x, w, b))  # (the one-device product is plain torch's kernel)


def test_a_same_sum_passes_linear_ops_and_meets_a_sum(mesh4):
    x, w, v = torch.randn(4, 8), torch.randn(8, 3), torch.randn(8, 3)
    dx = spmd.copy_to_mesh(x, Layout([U, "batch"], mesh4))
    dw, dv = (spmd.copy_to_mesh(t, Layout(["batch", U], mesh4)) for t in (w, v))
    both, collectives = issued(lambda: (dx @ dw - dx @ dv) * 2)
    assert collectives == [] and both._pending == ("batch",) and both._pending_op == "same"
    torch.testing.assert_close(gather(both), (x @ w - x @ v) * 2)
    # a `sum` (partial sums per device) added to a `same` sum: the `same` one is resolved (which only reads it),
    # and a replicated value plus a sum is not linear in the sum: resolved too
    partial = spmd.copy_to_mesh(torch.randn(4, 3, 8), Layout([U, U, "batch"], mesh4)).sum(-1)
    assert partial._pending_op == "sum"
    mixed, collectives = issued(lambda: dx @ dw + partial)
    assert collectives == [("all_reduce", ("batch",))] * 2 and not mixed._pending
    torch.testing.assert_close(gather(mixed), x @ w + gather(partial))


@pytest.mark.parametrize("dims", [[("batch", 4)], [("batch", 2), ("model", 2)]])
def test_megatron_and_2d_products_match_torch_in_every_component(dims):
    mesh = spmd.create_mesh(dims)
    model = "model" if len(dims) > 1 else "batch"
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(8, 6), torch.randn(6, 8), torch.randn(8, 6)
    dx = spmd.copy_to_mesh(x, Layout(["batch", U] if model != "batch" else [U, U], mesh)).requires_grad_()
    d1 = spmd.copy_to_mesh(w1, Layout([U, model], mesh)).requires_grad_()
    d2 = spmd.copy_to_mesh(w2, Layout([model, U], mesh)).requires_grad_()
    out = torch.tanh(dx @ d1) @ d2
    ref = [t.clone().requires_grad_() for t in (x, w1, w2)]
    want = torch.tanh(ref[0] @ ref[1]) @ ref[2]
    torch.testing.assert_close(gather(out), want)
    (out * out).sum().backward()
    (want * want).sum().backward()
    for got, r in zip((dx, d1, d2), ref):
        torch.testing.assert_close(gather(got.grad), r.grad)
        check_replicas(got.grad)


@pytest.mark.parametrize("kind", ["loop", "foreach", "fused"])
def test_a_data_parallel_step_updates_each_shared_parameter_once(mesh4, kind):
    torch.manual_seed(0)
    model, ref = nn.Linear(6, 4), nn.Linear(6, 4)
    ref.load_state_dict(model.state_dict())
    spmd.distribute_module(model, mesh4)
    options = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[kind]
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, **options)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, **options)
    x = torch.randn(8, 6)
    for _ in range(3):
        model(spmd.copy_to_mesh(x, Layout(["batch", U], mesh4))).square().sum().backward()
        ref(x).square().sum().backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert shared(p._stack), "the parameter stays one copy"
        torch.testing.assert_close(gather(p), q.detach())
        assert components(p)[0] == components(p)[3]


def test_a_compiled_graph_takes_writes_and_returns_the_one_copy(mesh4):
    """A shared stack enters a compiled graph as its one copy, which the graph writes in place (not through the
    expanded view: functionalization would replay that write as `base + sum(new - base)`, which rounds 1e8 -> 1
    to 0), and results replicated over the mesh leave it shared."""
    w = spmd.copy_to_mesh(torch.full((4, 4), 1e8), Layout([U, U], mesh4))

    @spmd.function(backend="aot_eager")
    def reset(w):
        w.mul_(0).add_(1)
        return w.sum(), w * 3

    total, tripled = reset(w)
    assert shared(w._stack) and shared(tripled._stack) and _storage_bytes(w) == 16 * 4
    assert torch.equal(gather(w), torch.ones(4, 4)) and torch.equal(gather(tripled), torch.full((4, 4), 3.0))
    assert gather(total).item() == 16
    check_replicas(w)


def test_a_variable_of_a_replicated_value_is_one_copy(mesh4):
    v = spmd.DVariable(torch.randn(4, 4), layout=Layout([U, U], mesh4))
    half = spmd.DVariable(spmd.copy_to_mesh(torch.ones(4), Layout([U], mesh4)), dtype=torch.float16)
    assert shared(v._stack) and _storage_bytes(v) == 16 * 4
    assert shared(half._stack) and half.dtype == torch.float16 and torch.equal(gather(half), torch.ones(4).half())


def test_a_shared_gradient_coerced_to_a_traced_per_device_tangent_stays_per_device(mesh4):
    """AOTAutograd makes a coerced tangent contiguous when its strides are not: the coerced gradient must already be
    contiguous, since our own `contiguous` of a replicated value would share it again (a batch-size mismatch in the
    compiled backward, seen on torch 2.11)."""
    grad = spmd.copy_to_mesh(torch.ones(()), Layout([], mesh4)).expand(4, 4)  # what `sum`'s backward gives
    value = spmd.copy_to_mesh(torch.randn(4, 4), Layout([U, U], mesh4))
    traced = spmd.DTensor(value._stack.contiguous(), value._layout, value.shape)  # (each device's own memory)
    coerced = grad.__coerce_same_metadata_as_tangent__(traced.__tensor_flatten__()[1])
    assert coerced.is_contiguous() and not shared(coerced._stack)
    assert coerced.__tensor_flatten__()[1] == traced.__tensor_flatten__()[1]
    torch.testing.assert_close(gather(coerced), torch.ones(4, 4))


@pytest.mark.parametrize("kind", ["mm", "addmm"])
def test_products_on_a_3d_mesh_match_torch_in_every_component(kind):
    """Every layout pair of a matrix product on a 2×2×2 in-process mesh, whose products fold the devices into rows,
    side-by-side products and the contracted axis (see `folded_mm`): values, gradients, replicas."""
    mesh = spmd.create_mesh([("a", 2), ("b", 2), ("c", 2)])
    x, w, bias = rand(4, 8, seed=1), rand(8, 4, seed=2), rand(4, seed=3)
    if kind == "mm":
        assert check_op(torch.mm, [x, w], mesh=mesh) == 13 * 13
    else:
        assert check_op(torch.addmm, [bias, x, w], mesh=mesh, sample=60) > 50  # (drawn, duplicates dropped)


def test_a_megatron_mlp_on_batch_x_model_runs_the_one_device_products():
    """batch 4 × model 2: each matrix product of the forward and backward is the 1-device step's product (the
    batch's devices are its rows; the model's are two products side by side, or the contracted axis), not eight
    small products; the collectives are the layouts' (one forward all-reduce over `model`, the weight gradients'
    over `batch`); every component as torch computes it."""
    mesh = spmd.create_mesh([("batch", 4), ("model", 2)])
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(16, 8), torch.randn(8, 12), torch.randn(12, 8)
    dx = spmd.copy_to_mesh(x, Layout(["batch", U], mesh))
    d1 = spmd.copy_to_mesh(w1, Layout([U, "model"], mesh)).requires_grad_()
    d2 = spmd.copy_to_mesh(w2, Layout(["model", U], mesh)).requires_grad_()
    with torch.profiler.profile(record_shapes=True) as prof:
        loss, forward = issued(lambda: (torch.relu(dx @ d1) @ d2).square().mean())
        _, backward = issued(lambda: (loss.backward(), reduce_gradients([d1, d2])))
    assert forward == [("all_reduce", ("model",))]
    assert backward == [("all_reduce", ("batch",))] * 3  # the loss's mean, then each weight's gradient
    products = [e.input_shapes for e in prof.events() if e.name in ("aten::mm", "aten::bmm")]
    assert products and all(shapes[0][0] in (1, 2) or len(shapes[0]) == 2 for shapes in products), products
    ref = [t.clone().requires_grad_() for t in (w1, w2)]
    want = (torch.relu(x @ ref[0]) @ ref[1]).square().mean()
    want.backward()
    torch.testing.assert_close(gather(loss), want)
    for got, r in zip((d1, d2), ref):
        torch.testing.assert_close(gather(got.grad), r.grad)
        check_replicas(got.grad)


def test_a_traced_step_folds_large_products_and_equals_eager(monkeypatch):
    """In a traced graph matrix products fold from `FOLD_IN_GRAPHS_FROM` multiply-adds per device (lowered here to
    fold the small ones): the graph's products are the 1-device step's, and the updated weights equal eager spmd's."""
    from spmd.engine import dispatch
    from spmd.engine.rules import contraction
    monkeypatch.setattr(contraction, "FOLD_IN_GRAPHS_FROM", 0)
    monkeypatch.setattr(dispatch, "_CACHE", {})  # (decisions cached by earlier tests were made with the default)
    mesh = spmd.create_mesh([("batch", 4), ("model", 2)])
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(16, 8), torch.randn(8, 12), torch.randn(12, 8)
    dx = spmd.copy_to_mesh(x, Layout(["batch", U], mesh))

    def weights():
        return [spmd.DVariable(w1, layout=Layout([U, "model"], mesh)),
                spmd.DVariable(w2, layout=Layout(["model", U], mesh))]

    def make_step(ws):
        def step(x):
            loss = (torch.relu(x @ ws[0]) @ ws[1]).square().mean()
            grads = torch.autograd.grad(loss, ws)
            with torch.no_grad():
                for w, g in zip(ws, grads):
                    w.sub_(g, alpha=0.1)
            return loss
        return step

    products = []

    def backend(gm, inputs):
        products.extend(n.meta["val"].shape for n in gm.graph.nodes if n.target in (
            torch.ops.aten.mm.default, torch.ops.aten.bmm.default))
        return gm.forward

    eager, traced = weights(), weights()
    eager_step, traced_step = make_step(eager), spmd.function(make_step(traced), whole_step=True, backend=backend)
    for _ in range(3):
        torch.testing.assert_close(gather(traced_step(dx)), gather(eager_step(dx)))
    assert traced_step.experimental_get_tracing_count() == 1
    assert len(products) == 5 and all(len(s) == 2 or s[0] in (1, 2) for s in products), products
    for got, want in zip(traced, eager):
        torch.testing.assert_close(gather(got), gather(want))
        check_replicas(got)


def test_running_statistics_of_per_device_copies_are_updated_on_every_device():
    """A batch-sharded step leaves the running statistics each device's own copy; a later step on a replicated
    batch must update every copy, not the first one alone."""
    mesh = spmd.create_mesh([("batch", 4)])
    bn = spmd.distribute_module(torch.nn.BatchNorm1d(3), mesh, {})
    plain = torch.nn.BatchNorm1d(3)
    x = torch.randn(8, 3)
    for layout in (["batch", U], [U, U]):
        bn(spmd.copy_to_mesh(x, spmd.Layout(layout, mesh)))
        plain(x)
    for name in ("running_mean", "running_var"):
        check_replicas(getattr(bn, name))
        torch.testing.assert_close(spmd.to_global(getattr(bn, name)), getattr(plain, name))
