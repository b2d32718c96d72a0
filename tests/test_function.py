"""Function mode: `spmd.function` / `torch.compile` over DTensors equals eager spmd and plain torch (values,
gradients, every device's component), traces once per signature, and `explain` lists the exact collectives.

Most cases compile with the `aot_eager` backend: it runs the whole trace (Dynamo, AOTAutograd with the rules
expanding every op, forward and backward) without inductor's code generation, which a few cases cover."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

import spmd
from spmd import UNSHARDED, Layout
from spmd.engine import dispatch
from sweep import all_layouts, components, gather

U = UNSHARDED


def _fn_cases():
    return {
        "mlp": (lambda x, w: torch.relu(x @ w).sum(-1), [(4, 8), (8, 4)]),
        "softmax_mean": (lambda x, w: (F.softmax(x @ w, -1) * 2).mean(0), [(4, 8), (8, 4)]),
        "view_transpose": (lambda x, w: (x.reshape(2, 2, 8).transpose(0, 1) + 1).sum(1) @ w, [(4, 8), (8, 4)]),
        "mse_loss": (lambda x, w: F.mse_loss(x @ w, x[:, :4].detach()), [(4, 8), (8, 4)]),
    }


@pytest.mark.parametrize("name", list(_fn_cases()))
def test_compiled_equals_eager_for_every_layout(mesh22, name):
    fn, shapes = _fn_cases()[name]
    torch.manual_seed(0)
    plain = [torch.randn(s, dtype=torch.float64) for s in shapes]
    compiled = spmd.function(fn, backend="aot_eager")
    for la in all_layouts(mesh22, shapes[0])[::2]:
        for lb in all_layouts(mesh22, shapes[1])[::3]:
            xs = [spmd.copy_to_mesh(p, l).requires_grad_() for p, l in zip(plain, (la, lb))]
            eager_xs = [spmd.copy_to_mesh(p, l).requires_grad_() for p, l in zip(plain, (la, lb))]
            out, eager = compiled(*xs), fn(*eager_xs)
            assert spmd.fetch_layout(out) == spmd.fetch_layout(eager)
            for got, want in zip(spmd.unpack(out), spmd.unpack(eager)):  # every device's component, to the last
                torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)  # bits (vectorised sums differ by CPU)
            torch.testing.assert_close(gather(out), fn(*plain))
            out.sum().backward()
            eager.sum().backward()
            for x, e in zip(xs, eager_xs):
                assert spmd.fetch_layout(x.grad) == spmd.fetch_layout(e.grad)
                torch.testing.assert_close(gather(x.grad), gather(e.grad))


def test_dynamic_shapes_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="static shapes"):
        spmd.function(lambda a: a + 1, dynamic=True)


def test_retraces_once_per_layout(mesh22):
    f = spmd.function(lambda x: (x * 2).sum(0), backend="aot_eager")
    value = torch.randn(4, 4)
    for layout in [Layout(["x", U], mesh22), Layout(["x", U], mesh22), Layout([U, "y"], mesh22),
                   Layout(["x", U], mesh22)]:
        f(spmd.copy_to_mesh(value, layout))
    assert f.experimental_get_tracing_count() == 2
    f(spmd.copy_to_mesh(torch.randn(8, 4), Layout(["x", U], mesh22)))  # a new shape traces again
    assert f.experimental_get_tracing_count() == 3


def test_explain_megatron_mlp_forward_has_one_all_reduce(mesh22):
    x = spmd.copy_to_mesh(torch.randn(8, 16), Layout(["x", U], mesh22))
    w1 = spmd.copy_to_mesh(torch.randn(16, 32), Layout([U, "y"], mesh22))
    w2 = spmd.copy_to_mesh(torch.randn(32, 16), Layout(["y", U], mesh22))
    mlp = spmd.function(lambda x, w1, w2: F.gelu(x @ w1) @ w2)
    e = mlp.explain(x, w1, w2)
    assert [(c.kind, c.mesh_dims, c.bytes) for c in e.collectives] == [("all_reduce", ("y",), 4 * 16 * 4)]
    # the row-parallel product's sum stays pending until the function returns it
    assert [(o.op, o.outputs) for o in e.ops] == [("mm", (("x", "y"),)), ("gelu", (("x", "y"),)),
                                                  ("mm", (("x", None),)), ("(result)", (("x", None),))]
    assert e.collectives[0].op_index == 3
    assert "all_reduce(y)" in str(e)


def test_explain_data_parallel_backward_reduces_each_gradient_over_batch():
    mesh = spmd.create_mesh([("batch", 4)])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    spmd.distribute_module(model, mesh)
    x = spmd.copy_to_mesh(torch.randn(16, 8), Layout(["batch", U], mesh))
    e = spmd.function(lambda x: model(x).pow(2).mean()).explain(x, backward=True)
    forward = [(c.kind, c.mesh_dims) for c in e.collectives if not c.backward]
    backward = [(c.kind, c.mesh_dims) for c in e.collectives if c.backward]
    assert forward == [("all_reduce", ("batch",))]  # the loss's mean over the sharded batch
    assert backward == [("all_reduce", ("batch",))] * 4  # one per parameter gradient
    assert sorted(c.bytes for c in e.collectives if c.backward) == sorted(
        p.numel() * 4 for p in model.parameters())


def test_explain_2d_mesh_collectives():
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    x = spmd.copy_to_mesh(torch.randn(8, 16), Layout(["batch", U], mesh))
    w1 = spmd.copy_to_mesh(torch.randn(16, 32), Layout([U, "model"], mesh))
    w2 = spmd.copy_to_mesh(torch.randn(32, 16), Layout(["model", U], mesh))
    e = spmd.function(lambda x, w1, w2: (torch.relu(x @ w1) @ w2).sum()).explain(x, w1, w2)
    assert [(c.kind, c.mesh_dims) for c in e.collectives] == [("all_reduce", ("model",)),
                                                              ("all_reduce", ("batch",))]


def test_relayout_inside_function_is_traced(mesh22):
    src = spmd.copy_to_mesh(torch.arange(16.).reshape(4, 4), Layout(["x", U], mesh22))

    def f(t):
        return spmd.relayout(t * 2, Layout([U, "x"], mesh22))

    compiled = spmd.function(f, backend="aot_eager", fullgraph=True)
    out = compiled(src)
    assert spmd.fetch_layout(out) == Layout([U, "x"], mesh22)
    assert components(out) == components(f(src))
    e = spmd.function(f).explain(src)
    assert [(c.kind, c.mesh_dims) for c in e.collectives] == [("all_to_all", ("x",))]


def test_out_layouts_and_autobroadcast(mesh22):
    a = spmd.copy_to_mesh(torch.arange(8.).reshape(4, 2), Layout(["x", U], mesh22))
    f = spmd.function(lambda a, b: (a + b, a * b), backend="aot_eager",
                      out_layouts=(Layout.replicated(mesh22, 2), None))
    total, prod = f(a, torch.ones(2))  # the plain tensor becomes a replicated DTensor
    assert spmd.fetch_layout(total) == Layout.replicated(mesh22, 2)
    assert spmd.fetch_layout(prod) == Layout(["x", U], mesh22)
    torch.testing.assert_close(gather(total), torch.arange(8.).reshape(4, 2) + 1)
    small = spmd.function(lambda a, b: a + b, max_autobroadcast_elements=1)
    with pytest.raises(TypeError, match="max_autobroadcast_elements=1"):
        small(a, torch.ones(2))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_tensors_made_inside_take_the_layout_propagation_gives(mesh22, backend):
    """The seeds' rule: `torch.arange`/`torch.ones` inside the function, without a layout, meet DTensors as
    replicated values (eagerly the same line raises MixedTensorError); no collective is added for them."""
    def masked_rows(a):
        keep = torch.arange(4).unsqueeze(1) % 2 == 0  # made inside, plain
        return torch.where(keep, a, torch.zeros(4, 2)) + torch.ones(2)
    a = spmd.copy_to_mesh(torch.arange(8.).reshape(4, 2), Layout(["x", U], mesh22))
    with pytest.raises(spmd.MixedTensorError):
        masked_rows(a)
    f = spmd.function(masked_rows, backend=backend)
    out = f(a)
    assert spmd.fetch_layout(out) == Layout(["x", U], mesh22)
    torch.testing.assert_close(gather(out), masked_rows(torch.arange(8.).reshape(4, 2)))
    assert f.explain(a).collectives == []
    with pytest.raises(spmd.MixedTensorError):  # and the scope ends with the call
        masked_rows(a)


def _made_with_layouts(mesh):
    """Every way to make a DTensor with `layout=` from nothing, one layout each (a mix of shardings)."""
    xy, y_, yx = Layout(["x", "y"], mesh), Layout(["y", U], mesh), Layout(["y", "x"], mesh)
    return {
        "zeros": lambda: spmd.zeros(4, 2, layout=xy),
        "ones": lambda: spmd.ones((4, 2), dtype=torch.float64, layout=yx),
        "fill": lambda: spmd.fill((4, 2), 7.0, None, y_),  # the layout given by position
        "full": lambda: spmd.full((4, 2), 3, layout=xy),
        "ones_like": lambda: spmd.ones_like(torch.empty(4, 2), layout=y_),
        "arange": lambda: spmd.call_with_layout(torch.arange, Layout(["x"], mesh), 2, 10, 2),
        "torch.full": lambda: spmd.call_with_layout(torch.full, yx, (4, 2), 1.5),
        "own function": lambda: spmd.call_with_layout(lambda: torch.ones(4, 2) * 2, xy),
        "stateless_uniform": lambda: spmd.random.stateless_uniform((4, 2), seed=(1, 2), layout=yx),
        "stateless_normal": lambda: spmd.random.stateless_normal((4, 2), seed=3, layout=y_),
        "truncated_normal": lambda: spmd.random.stateless_truncated_normal((4, 2), seed=3, layout=xy),
        "copy_to_mesh": lambda: spmd.copy_to_mesh(torch.arange(8.).reshape(4, 2), Layout([U, "x"], mesh)),
    }


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_tensors_made_with_a_layout_inside_keep_it(mesh22, backend):
    """The seeds' rule: a tensor made inside the function with `layout=` keeps that layout. Each is one node of
    the graph; every device makes only its own shard, as eagerly (every component equal), with no collective."""
    made = _made_with_layouts(mesh22)
    f = spmd.function(lambda a: (a, *(make() for make in made.values())), backend=backend)
    a = spmd.copy_to_mesh(torch.ones(4), Layout(["x"], mesh22))
    for name, got, eager in zip(made, f(a)[1:], (make() for make in made.values())):
        assert spmd.fetch_layout(got) == spmd.fetch_layout(eager), name
        assert components(got) == components(eager), name
    assert f.explain(a).collectives == []
    assert f.experimental_get_tracing_count() == 1


def test_default_mesh_scope_inside_and_around_a_function(mesh22):
    def made_inside(a):
        with spmd.default_mesh(mesh22):
            return a + spmd.ones(4, 2), torch.zeros(3)

    def made_in_scope(a):
        return a * spmd.full((4, 2), 2.0)

    a = spmd.copy_to_mesh(torch.arange(8.).reshape(4, 2), Layout(["x", U], mesh22))
    out, zeros = spmd.function(made_inside, backend="aot_eager")(a)
    assert gather(out).tolist() == (torch.arange(8.).reshape(4, 2) + 1).tolist()
    assert spmd.fetch_layout(zeros) == Layout.replicated(mesh22, 1) and spmd.get_default_mesh() is None
    with spmd.default_mesh(mesh22):
        doubled = spmd.function(made_in_scope, backend="aot_eager")(a)
    assert gather(doubled).tolist() == (torch.arange(8.).reshape(4, 2) * 2).tolist()


def test_a_data_parallel_step_computes_and_updates_replicated_parameters_once():
    """Under spmd.function, a parameter replicated over the whole mesh enters every graph as one copy: its gradient's
    all-reduce and its update run once, not once per device, and it stays one shared copy, as in eager mode."""
    mesh = spmd.create_mesh([("x", 4)])
    torch.manual_seed(0)
    w0, x0 = torch.randn(8, 8), torch.randn(16, 8)
    x = spmd.copy_to_mesh(x0, Layout(["x", U], mesh))
    inputs = []

    def record(gm, example_inputs):
        inputs.extend(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor))
        return gm

    def make_step():
        w = spmd.DVariable(w0, layout=Layout([U, U], mesh))

        def step(x):
            loss = torch.tanh(x @ w).square().mean()
            grad, = torch.autograd.grad(loss, [w])
            with torch.no_grad():
                w.sub_(grad, alpha=0.5)
            return loss
        return w, step

    w, step = make_step()
    backend = aot_autograd(fw_compiler=record, bw_compiler=record, partition_fn=min_cut_rematerialization_partition)
    compiled = spmd.function(step, backend=backend, fullgraph=False)
    ref_w, ref_step = make_step()
    for _ in range(3):
        torch.testing.assert_close(spmd.to_global(compiled(x)), spmd.to_global(ref_step(x)))
    assert w._stack.stride(0) == 0 and ref_w._stack.stride(0) == 0
    torch.testing.assert_close(spmd.to_global(w), spmd.to_global(ref_w))
    assert (1, 8, 8) in inputs and (4, 8, 8) not in inputs  # the weight, its gradient: one copy each
    assert compiled.experimental_get_tracing_count() == 1


def test_adam_on_a_two_dim_mesh_with_replicated_and_sharded_parameters():
    """Dynamo fakes a parameter's gradient with the parameter's symbolic context when both look alike, else with
    dynamic sizes (which the dispatcher cannot key on): a shared bias's gradient and a sharded weight's agree."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])

    def make_step():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        spmd.distribute_module(model, mesh, spmd.LayoutMap({"0.weight": Layout(["model", U], mesh),
                                                            "0.bias": Layout(["model"], mesh),
                                                            "2.weight": Layout([U, "model"], mesh)}))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)

        def step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return model, step

    model, step = make_step()
    compiled = spmd.function(step, backend="aot_eager", fullgraph=False)
    ref_model, ref_step = make_step()
    assert model[2].bias._stack.stride(0) == 0
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = (spmd.copy_to_mesh(torch.randn(8, 8, generator=g), Layout(["batch", U], mesh)) for _ in range(2))
        torch.testing.assert_close(compiled(x, y).item(), ref_step(x, y).item(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(gather(p), gather(q), rtol=1e-5, atol=1e-6)
    assert model[2].bias._stack.stride(0) == 0


def test_factories_inside_a_function_raise_spmds_errors(mesh22):
    a = spmd.copy_to_mesh(torch.ones(4), Layout(["x"], mesh22))
    with pytest.raises(spmd.IndivisibleError, match=r"shape \[4, 3\]"):
        spmd.function(lambda t: spmd.ones(4, 3, layout=Layout(["y", "x"], mesh22)).sum() + t, backend="eager")(a)
    with pytest.raises(spmd.LayoutError, match="rank 1"):
        spmd.function(lambda t: spmd.zeros(4, layout=Layout(["y", "x"], mesh22)) + t, backend="eager")(a)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_random_ops_inside_a_function_draw_anew_at_each_call(mesh22, backend):
    """Dropout and `rand(layout=)` inside a compiled function: the graph draws the seed at each call (it is not
    baked in at trace time), and the values do not depend on the layout."""
    x = torch.randn(8, 4)

    def step(a):
        return F.dropout(a, 0.5), spmd.call_with_layout(torch.rand, spmd.fetch_layout(a), 8, 4)

    results = []
    for specs in (["x", U], [U, "y"], ["y", "x"]):
        f = spmd.function(step, backend=backend)
        a = spmd.copy_to_mesh(x, Layout(specs, mesh22))
        torch.manual_seed(0)
        first = [gather(t) for t in f(a)]
        second = [gather(t) for t in f(a)]
        results.append(first)
        assert not torch.equal(first[0], second[0]) and not torch.equal(first[1], second[1])
        kept = first[0] != 0
        torch.testing.assert_close(first[0][kept], 2 * x[kept])
        assert 0.1 < kept.float().mean() < 0.9 and 0 <= first[1].min() and first[1].max() < 1
    for other in results[1:]:
        torch.testing.assert_close(other, results[0])


def test_untraceable_function_names_the_line(mesh22):
    a = spmd.copy_to_mesh(torch.ones(4), Layout(["x"], mesh22))

    def branchy(t):
        if t.sum() > 0:  # Python control flow on a value
            return t * 2
        return t

    with pytest.raises(spmd.TraceError, match="branchy"):
        spmd.function(branchy, backend="aot_eager")(a)
    relaxed = spmd.function(branchy, backend="aot_eager", fullgraph=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = relaxed(a)
    assert any("graph breaks" in str(w.message) for w in caught)
    assert gather(out).tolist() == [2.0] * 4


def _gpt(mesh):
    from spmd.demo.model import GPT, GPTConfig, megatron_layouts
    torch.manual_seed(0)
    ref = GPT(GPTConfig(n_layer=1, d_model=32, block_size=8))
    model = copy.deepcopy(ref)
    spmd.distribute_module(model, mesh, spmd.LayoutMap({k: Layout(v, mesh) for k, v in megatron_layouts().items()}))
    return ref, model


def test_demo_gpt_forward_has_no_graph_break():
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    ref, model = _gpt(mesh)
    dl = Layout(["batch", U], mesh)
    pos = spmd.copy_to_mesh(torch.arange(8), Layout([U], mesh))
    x, y = torch.randint(0, 96, (4, 8)), torch.randint(0, 96, (4, 8))
    loss = spmd.function(lambda x, y: model(x, pos, y), backend="aot_eager", fullgraph=True)(
        spmd.copy_to_mesh(x, dl), spmd.copy_to_mesh(y, dl))
    torch.testing.assert_close(loss.item(), ref(x, torch.arange(8), y).item(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_training_step_matches_plain_torch(backend):
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    ref, model = _gpt(mesh)
    # SGD with momentum: Adam would turn the rounding noise of k's bias gradient (exactly 0 in theory) into steps
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    dl = Layout(["batch", U], mesh)
    pos = spmd.copy_to_mesh(torch.arange(8), Layout([U], mesh))

    def step(x, y):
        loss = model(x, pos, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    compiled = spmd.function(step, backend=backend, fullgraph=False)
    # inductor's kernels sum in their own order: a few float32 ulps per step (by step 3 on torch 2.11, 2.8e-5
    # relative in the loss, 3e-5 absolute in a weight), where aot_eager runs torch's own kernels
    rtol, atol = (1e-4, 1e-4) if backend == "inductor" else (1e-5, 1e-5)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randint(0, 96, (4, 8), generator=g), torch.randint(0, 96, (4, 8), generator=g)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = compiled(spmd.copy_to_mesh(x, dl), spmd.copy_to_mesh(y, dl))
        # backward and the optimizer are torch's own graph breaks: spmd does not warn about them
        assert not [w for w in caught if "graph breaks" in str(w.message)]
        ref_loss = ref(x, torch.arange(8), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.item(), ref_loss.item(), rtol=rtol, atol=1e-6)
    assert compiled.experimental_get_tracing_count() == 1
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert isinstance(p, spmd.DVariable), name
        torch.testing.assert_close(gather(p), q.detach(), rtol=1e-4, atol=atol)


@pytest.mark.parametrize("layout", [["x", U], [U, U]])
def test_an_output_the_backward_does_not_reach_gets_a_zero_gradient(mesh22, layout):
    """Autograd gives such an output plain zeros as its gradient, where the compiled backward expects the DTensor it
    traced: torch raised ("Expected a DTensor tangent but got a plain Tensor")."""
    value = torch.randn(4, 4, dtype=torch.float64)
    x, eager_x = (spmd.copy_to_mesh(value, Layout(layout, mesh22)).requires_grad_() for _ in range(2))
    a, b = spmd.function(lambda t: (t * 2).split(2, dim=1), backend="aot_eager")(x)
    a.sum().backward()
    eager_a, _ = (eager_x * 2).split(2, dim=1)
    eager_a.sum().backward()
    assert spmd.fetch_layout(x.grad) == spmd.fetch_layout(eager_x.grad)
    assert components(x.grad) == components(eager_x.grad)
    assert gather(x.grad).tolist() == [[2.0, 2.0, 0.0, 0.0]] * 4


def test_a_training_step_may_return_what_its_loss_was_computed_from(mesh22):
    """A step returning (logits, loss): the forward graph before `loss.backward()` outputs both, and the backward
    reaches only the loss."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    model = spmd.distribute_module(copy.deepcopy(ref), mesh22)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)

    def step(x, y):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return logits, loss

    compiled = spmd.function(step, backend="aot_eager", fullgraph=False)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    dx, dy = spmd.copy_to_mesh(x, Layout(["x", U], mesh22)), spmd.copy_to_mesh(y, Layout(["x"], mesh22))
    for _ in range(2):
        logits, loss = compiled(dx, dy)
        ref_logits = ref(x)
        ref_loss = F.cross_entropy(ref_logits, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(gather(logits), ref_logits.detach())
        torch.testing.assert_close(loss.item(), ref_loss.item())
    torch.testing.assert_close(gather(model.weight), ref.weight.detach())


def test_a_cast_with_gradients_traces_before_any_eager_call(mesh22, monkeypatch):
    """Checking the backward's `_to_copy` on meta tensors under the trace's Python dispatcher recursed without end;
    an empty dispatch cache makes every op a first call, whatever ran earlier in the process."""
    monkeypatch.setattr(dispatch, "_CACHE", {})
    value = torch.randn(4, 4, dtype=torch.float64)
    x = spmd.copy_to_mesh(value, Layout(["x", U], mesh22)).requires_grad_()
    out = spmd.function(lambda t: t.float() * 3, backend="aot_eager")(x)
    assert out.dtype == torch.float32 and gather(out).tolist() == (value.float() * 3).tolist()
    out.sum().backward()
    assert x.grad.dtype == torch.float64 and gather(x.grad).tolist() == [[3.0] * 4] * 4


# -- what users meet: errors as eagerly, arguments written in place, nesting, limits ----------------------------------
def test_a_plain_argument_written_in_place_is_updated_for_the_caller(mesh22):
    """The seeds' autobroadcast replicates a plain tensor argument for the call; a write into it reaches the
    caller's tensor, as under torch.compile."""
    x = spmd.copy_to_mesh(torch.randn(4, 8), Layout(["x", "y"], mesh22))
    p = torch.zeros(8)

    def bump(x, p):
        p.add_(1)
        return x + p
    out = spmd.function(bump, backend="aot_eager")(x, p)
    assert torch.equal(p, torch.ones(8))
    torch.testing.assert_close(gather(out), gather(x) + 1)


def test_an_error_the_function_raises_is_raised_as_eagerly(mesh22):
    x = spmd.copy_to_mesh(torch.randn(4, 8), Layout(["x", "y"], mesh22))

    def refuses(x):
        raise ValueError("the function says no")
    with pytest.raises(ValueError, match="the function says no"):
        spmd.function(refuses, backend="aot_eager")(x)
    with pytest.raises(spmd.LayoutError, match=r"rank 2\) the layout \['unsharded'\] of rank 1"):
        spmd.function(lambda x: spmd.relayout(x + 1, Layout([U], mesh22)), backend="aot_eager")(x)


def test_a_value_read_in_python_is_a_trace_error_naming_its_line(mesh22):
    x = spmd.copy_to_mesh(torch.randn(4, 8), Layout(["x", "y"], mesh22))
    for fn in (lambda x: x * x.sum().item(), lambda x: x + int(x.argmax())):
        with pytest.raises(spmd.TraceError, match=r"reads a tensor's value in Python .*test_function\.py"):
            spmd.function(fn, backend="aot_eager")(x)


def test_explain_of_a_function_with_a_graph_break_raises_as_its_call_does(mesh22):
    def branches(x):
        return x * 2 if x.sum() > 0 else x
    x = spmd.copy_to_mesh(torch.randn(4, 8), Layout(["x", "y"], mesh22))
    with pytest.raises(spmd.TraceError, match="Data-dependent branching"):
        spmd.function(branches, backend="aot_eager").explain(x)


def test_an_spmd_function_called_inside_another_is_part_of_its_trace(mesh22):
    inner = spmd.function(lambda t: t * 2, backend="aot_eager")
    outer = spmd.function(lambda t: inner(t) + 1, backend="aot_eager")
    x = spmd.copy_to_mesh(torch.randn(4, 8), Layout(["x", "y"], mesh22))
    torch.testing.assert_close(gather(outer(x)), gather(x) * 2 + 1)
    assert outer.experimental_get_tracing_count() == 1 and inner.experimental_get_tracing_count() == 0


def test_past_its_trace_limit_a_function_runs_eagerly_with_a_warning(mesh22):
    """Also with fullgraph=True (the default), where torch's own limit is a hard failure."""
    scale = spmd.function(lambda x, s: x * s, backend="aot_eager")
    x = spmd.copy_to_mesh(torch.randn(4, 8), Layout(["x", "y"], mesh22))
    with torch._dynamo.config.patch(recompile_limit=2):
        scale(x, 2.0), scale(x, 3.0)
        with pytest.warns(UserWarning, match="its limit: it now runs eagerly"):
            out = scale(x, 4.0)
    torch.testing.assert_close(gather(out), gather(x) * 4)
    assert scale.experimental_get_tracing_count() == 2


