"""Function mode: `spmd.function` / `torch.compile` over DTensors equals eager spmd and plain torch (values,
gradients, every device's component), traces once per signature, and `explain` lists the exact collectives.

Most cases compile with the `aot_eager` backend: it runs the whole trace (Dynamo, AOTAutograd with the rules
expanding every op, forward and backward) without inductor's code generation, which a few cases cover."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.variables import optimizer
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCachePickler

import spmd
from spmd import UNSHARDED, Layout, function_mode, tracing
from spmd.collectives.local import shared
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
            assert components(out) == components(eager)  # every device's component, bit for bit
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


def test_the_guards_on_a_dtensor_argument_leave_out_what_its_own_guards_imply(mesh22, monkeypatch):
    """No guard on a DTensor argument's inner tensor or its name (each would cost every call); what they would
    check still retraces: the inner tensor's strides (a transposed value), its size (a shared replicated stack of
    one copy, or a stack of one per device), its dtype."""
    made, kept, needed = [], [], function_mode._needed_guards

    def recorded(guards):
        keep = needed(guards)
        made.extend(g.name for g in guards)
        kept.extend(g.name for g, k in zip(guards, keep) if k)
        return keep
    monkeypatch.setattr(function_mode, "_needed_guards", recorded)
    f = spmd.function(lambda x: x * 2, backend="aot_eager")
    value, replicated = torch.randn(4, 4), Layout([U, U], mesh22)
    calls = [spmd.copy_to_mesh(value, replicated), spmd.copy_to_mesh(value, replicated),
             spmd.copy_to_mesh(value.t().contiguous(), replicated).t(), spmd.pack([value] * 4, replicated),
             spmd.copy_to_mesh(value.double(), replicated)]
    assert shared(calls[0]._stack) and not shared(calls[3]._stack)
    for i, x in enumerate(calls):
        torch.testing.assert_close(spmd.unpack(f(x))[0], 2 * spmd.unpack(x)[0])
        assert f.experimental_get_tracing_count() == max(i, 1)
    assert "args[0]._inner" in made and "args[0]" in kept  # (the traced frame is `Function._body(*args)`)
    assert not any(name.startswith("args[0].") for name in kept)


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


_BARE_COMPILE = """
import sys
import torch
if sys.argv[1] == "dynamo first":
    import torch._dynamo
import spmd
mesh = spmd.create_mesh([("x", 2)], devices=["CPU:0", "CPU:1"])
layout = spmd.Layout(["x", spmd.UNSHARDED], mesh)
made = torch.compile(lambda: spmd.ones((4, 3), layout=layout) * 2, fullgraph=True, backend="aot_eager")()
assert spmd.fetch_layout(made) == layout and spmd.to_global(made).tolist() == [[2.0] * 3] * 4
"""


@pytest.mark.parametrize("order", ["spmd first", "dynamo first"])
def test_bare_torch_compile_makes_a_dtensor_before_meeting_one(order):
    """A function whose first DTensor is one it makes with `layout=` compiles under a bare torch.compile, whether
    torch.compile loads Dynamo after spmd's import or Dynamo was loaded before it (a fresh interpreter each)."""
    result = subprocess.run([sys.executable, "-c", _BARE_COMPILE, order], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


_CACHED_STEP = """
import sys
import torch
import spmd
from spmd import Layout, UNSHARDED
mesh = spmd.create_mesh([("x", 2)])
dtype = getattr(torch, sys.argv[1])
w = spmd.DVariable(torch.ones(4, 4, dtype=dtype), layout=Layout([UNSHARDED, UNSHARDED], mesh))
x = spmd.copy_to_mesh(torch.ones(8, 4, dtype=dtype), Layout(["x", UNSHARDED], mesh))

def step(x):
    loss = (x @ w).relu().sum()
    loss.backward()
    return loss

assert spmd.function(step, fullgraph=False)(x).dtype == dtype
"""


def test_compiled_graphs_on_disk_are_not_reused_for_other_dtypes(tmp_path):
    """torch.compile's caches (AOTAutograd's, inductor's) key a graph on each DTensor input's dtype, shapes and
    layout: a float32 run and then a bfloat16 run of the same step, sharing one cache folder, each get their own."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    for dtype in ("float32", "bfloat16"):
        result = subprocess.run([sys.executable, "-c", _CACHED_STEP, dtype], capture_output=True, text=True,
                                timeout=300, env=env)
        assert result.returncode == 0, (dtype, result.stderr[-3000:])


def test_the_compile_cache_key_of_a_dtensor_names_what_a_graph_was_traced_for(mesh22):
    def key(t):
        return t._stable_hash_for_caching()

    x = spmd.copy_to_mesh(torch.ones(4, 4), Layout(["x", UNSHARDED], mesh22))
    others = [x.to(torch.bfloat16), spmd.copy_to_mesh(torch.ones(8, 4), Layout(["x", UNSHARDED], mesh22)),
              spmd.relayout(x, Layout(["y", UNSHARDED], mesh22)), x.detach().requires_grad_()]
    assert len({key(t) for t in [x] + others}) == 5
    assert key(x) == key(spmd.copy_to_mesh(torch.zeros(4, 4), Layout(["x", UNSHARDED], mesh22)))


def test_the_autograd_cache_keys_a_dtensor_input_on_what_the_graph_was_traced_for(mesh22):
    """AOTAutograd's on-disk cache pickles a graph's inputs into its key: a DTensor is keyed on its layout, shapes
    and dtype (spmd teaches torch 2.11's pickler so), never refused (which would bypass the cache)."""
    def key(t):
        return AOTAutogradCachePickler(torch.fx.GraphModule({}, torch.fx.Graph())).dumps(t)

    x = spmd.copy_to_mesh(torch.ones(4, 4), Layout(["x", UNSHARDED], mesh22))
    assert key(x) == key(spmd.copy_to_mesh(torch.zeros(4, 4), Layout(["x", UNSHARDED], mesh22)))
    assert key(x) != key(spmd.relayout(x, Layout(["y", UNSHARDED], mesh22))) != key(x.to(torch.bfloat16))


def test_the_cuda_graph_check_of_an_optimizer_step_asks_a_dtensors_components(mesh22, monkeypatch):
    """Under CUDA graphs Dynamo asks whether each gradient lives in CUDA-graph memory; a DTensor's answer is its
    stacked components' (asking the DTensor itself reads a storage it does not have: tests/test_cuda.py runs it)."""
    asked = []
    monkeypatch.setattr(optimizer, "_is_static_for_cudagraphs", lambda t: asked.append(t) or True)
    tracing._check_subclass_grads_by_their_inner_tensors()
    grad = spmd.copy_to_mesh(torch.ones(4, 4), Layout(["x", UNSHARDED], mesh22))
    assert optimizer._is_static_for_cudagraphs(grad) and asked == [grad._inner]
    assert optimizer._is_static_for_cudagraphs(torch.ones(2)) and len(asked) == 2


def test_flattening_a_shared_dtensor_for_a_graph_gives_its_one_copy(mesh22):
    """A stack every device shares (stride 0) enters a graph as its one copy and comes back shared; a pending sum is
    resolved as the tensor is flattened (guards flatten DTensor arguments at every call)."""
    shared = spmd.copy_to_mesh(torch.arange(4.0), Layout.replicated(mesh22, 1))
    assert shared._stack.stride(0) == 0
    names, meta = shared.__tensor_flatten__()
    one = shared._inner
    assert names == ["_inner"] and meta == (shared._layout, (0, 1), 4)
    assert one.shape == (1, 4) and not one._is_view() and one.data_ptr() == shared._stack.data_ptr()
    back = type(shared).__tensor_unflatten__({"_inner": one}, meta, shared.shape, shared.stride())
    assert back._stack.stride(0) == 0 and torch.equal(spmd.to_global(back), torch.arange(4.0))
    own = spmd.copy_to_mesh(torch.ones(4, 4), Layout(["x", U], mesh22))
    assert own.__tensor_flatten__() == (["_inner"], (own._layout, (8, 4, 1), None))
    assert own._inner.shape == own._stack.shape and own._inner.data_ptr() == own._stack.data_ptr()
    a = spmd.copy_to_mesh(torch.ones(4, 8), Layout([UNSHARDED, "x"], mesh22))
    b = spmd.copy_to_mesh(torch.ones(8, 4), Layout(["x", UNSHARDED], mesh22))
    pending = a @ b
    assert pending._pending
    pending.__tensor_flatten__()
    assert not pending._pending and torch.equal(spmd.to_global(pending), torch.full((4, 4), 8.0))


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


def test_torch_compile_directly_on_dtensors(mesh22):
    a = spmd.copy_to_mesh(torch.randn(4, 4), Layout(["x", "y"], mesh22))
    fn = torch.compile(lambda t: torch.tanh(t) @ t.T, fullgraph=True, backend="inductor")
    out = fn(a)
    assert spmd.fetch_layout(out) == spmd.fetch_layout(torch.tanh(a) @ a.T)
    torch.testing.assert_close(gather(out), torch.tanh(gather(a)) @ gather(a).T)


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


def test_torch_compile_on_dtensors_recompiles_for_new_layouts_and_shapes_with_static_sizes(mesh22):
    """Dynamo makes a recompile's sizes dynamic, which spmd's rules do not take: a DTensor's dims (and its
    components') are marked static, so each new layout or shape is a static recompile."""
    f = torch.compile(lambda t: torch.relu(t) * 2, backend="aot_eager")
    cases = ((torch.randn(8, 16), ["x", U]), (torch.randn(8, 16), [U, U]), (torch.randn(16, 16), ["x", "y"]))
    for value, specs in cases:
        out = f(spmd.copy_to_mesh(value, Layout(specs, mesh22)))
        torch.testing.assert_close(gather(out), torch.relu(value) * 2)


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
