"""DTensors under `torch.compile` itself: compiled without spmd.function, recompiled per layout and shape, keyed
in torch's compile caches (on disk too) on what a graph was traced for, flattened into graphs as their components,
and guarded on no more than they need."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.variables import optimizer
from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCachePickler

import spmd
from spmd import UNSHARDED, Layout, function_mode, tracing
from spmd.collectives.local import shared
from sweep import gather

U = UNSHARDED


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


def test_torch_compile_directly_on_dtensors(mesh22):
    a = spmd.copy_to_mesh(torch.randn(4, 4), Layout(["x", "y"], mesh22))
    fn = torch.compile(lambda t: torch.tanh(t) @ t.T, fullgraph=True, backend="inductor")
    out = fn(a)
    assert spmd.fetch_layout(out) == spmd.fetch_layout(torch.tanh(a) @ a.T)
    torch.testing.assert_close(gather(out), torch.tanh(gather(a)) @ gather(a).T)


def test_torch_compile_on_dtensors_recompiles_for_new_layouts_and_shapes_with_static_sizes(mesh22):
    """Dynamo makes a recompile's sizes dynamic, which spmd's rules do not take: a DTensor's dims (and its
    components') are marked static, so each new layout or shape is a static recompile."""
    f = torch.compile(lambda t: torch.relu(t) * 2, backend="aot_eager")
    cases = ((torch.randn(8, 16), ["x", U]), (torch.randn(8, 16), [U, U]), (torch.randn(16, 16), ["x", "y"]))
    for value, specs in cases:
        out = f(spmd.copy_to_mesh(value, Layout(specs, mesh22)))
        torch.testing.assert_close(gather(out), torch.relu(value) * 2)
