"""Whole-step capture (`spmd.function(step, whole_step=True)`): forward, backward and the optimizer's update traced
into one graph equal eager spmd (every parameter's and optimizer state's components) and plain torch; the step is
traced once, and again exactly when what it assumed changes; `explain` lists the whole step's collectives."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd
from spmd import UNSHARDED, Layout
from spmd.errors import TraceError
from sweep import components, gather

U = UNSHARDED


class _MLP(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.w1, self.w2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, y):
        return F.mse_loss(self.w2(self.drop(F.gelu(self.w1(x)))), y)


def _megatron(mesh):
    return spmd.LayoutMap({r"w1\.weight": Layout(["model", U], mesh), r"w1\.bias": Layout(["model"], mesh),
                           r"w2\.weight": Layout([U, "model"], mesh)})


def _setup(mesh, make_opt, dropout=0.0, zero_grad_first=False):
    torch.manual_seed(0)
    model = _MLP(dropout)
    spmd.distribute_module(model, mesh, _megatron(mesh) if "model" in mesh.dim_names else spmd.LayoutMap({}))
    opt = make_opt(model.parameters())

    def step(x, y):
        if zero_grad_first:
            opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        if not zero_grad_first:
            opt.zero_grad()
        return loss
    return model, opt, step


def _batches(mesh, n=5):
    g = torch.Generator().manual_seed(1)
    layout = Layout(["batch", U], mesh)
    return [tuple(spmd.copy_to_mesh(torch.randn(8, 8, generator=g), layout) for _ in range(2)) for _ in range(n)]


def _assert_traced_once_and_equal(whole, model, ref_model) -> None:
    """One trace, and every parameter of `model` (stepped by `whole`) equal to `ref_model`'s (stepped eagerly)."""
    assert whole.experimental_get_tracing_count() == 1
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(gather(p), gather(q), rtol=1e-5, atol=1e-6)


OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "adam_foreach": lambda params: torch.optim.Adam(params, lr=1e-2, foreach=True),
    # traced as their foreach path: torch cannot put a fused kernel in a graph, and Adagrad's for-loop reads its
    # step count as a Python number
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
    "sgd_fused": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-2),
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_whole_step_equals_eager_spmd_on_every_component(optimizer):
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    model, opt, step = _setup(mesh, OPTIMIZERS[optimizer])
    ref_model, ref_opt, ref_step = _setup(mesh, OPTIMIZERS[optimizer])
    whole = spmd.function(step, backend="aot_eager", whole_step=True)
    for i, (x, y) in enumerate(_batches(mesh)):
        loss, ref_loss = whole(x, y), ref_step(x, y)
        assert spmd.fetch_layout(loss) == spmd.fetch_layout(ref_loss)
        torch.testing.assert_close(gather(loss), gather(ref_loss), rtol=1e-6, atol=1e-7)
        assert whole.experimental_get_tracing_count() == (0 if i == 0 else 1)  # the first call runs eagerly
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert spmd.fetch_layout(p) == spmd.fetch_layout(q), name
        assert p.grad is None and q.grad is None
        for a, b in zip(components(p), components(q)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for key, value in opt.state[p].items():  # the optimizer's state, updated in place
            if spmd.is_dtensor(value):
                torch.testing.assert_close(gather(value), gather(ref_opt.state[q][key]), rtol=1e-5, atol=1e-6)
            else:
                assert value.item() == ref_opt.state[q][key].item(), key


def test_a_whole_step_with_inductor_matches_plain_torch_and_keeps_shared_parameters_one_copy():
    mesh = spmd.create_mesh([("batch", 4)])
    model, _, step = _setup(mesh, OPTIMIZERS["adamw"])
    torch.manual_seed(0)
    plain = _MLP()
    plain_opt = OPTIMIZERS["adamw"](plain.parameters())
    whole = spmd.function(step, whole_step=True)
    for x, y in _batches(mesh):
        loss = whole(x, y)
        ref = plain(gather(x), gather(y))
        ref.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        torch.testing.assert_close(loss.item(), ref.item(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert p._stack.stride(0) == 0  # a replicated parameter stays one copy that every device shares
        torch.testing.assert_close(gather(p), q.detach(), rtol=1e-5, atol=1e-6)
    assert whole.experimental_get_tracing_count() == 1


def test_the_gradients_a_step_leaves_are_the_parameters_gradients():
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    model, _, step = _setup(mesh, OPTIMIZERS["sgd_momentum"], zero_grad_first=True)
    ref_model, _, ref_step = _setup(mesh, OPTIMIZERS["sgd_momentum"], zero_grad_first=True)
    whole = spmd.function(step, backend="aot_eager", whole_step=True)
    for x, y in _batches(mesh, 4):
        whole(x, y)
        ref_step(x, y)
    assert whole.experimental_get_tracing_count() == 1
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert spmd.fetch_layout(p.grad) == spmd.fetch_layout(q.grad)
        torch.testing.assert_close(gather(p.grad), gather(q.grad), rtol=1e-5, atol=1e-6)


def test_gradients_accumulated_over_calls_keep_one_trace_per_state():
    """A step without zero_grad accumulates into the gradients it finds (in place, in the graph); zero_grad between
    every other call alternates two states, each with its trace."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    model, opt, _ = _setup(mesh, OPTIMIZERS["sgd_momentum"])
    ref_model, ref_opt, _ = _setup(mesh, OPTIMIZERS["sgd_momentum"])

    def accumulate(m, o):
        def step(x, y):
            loss = m(x, y)
            loss.backward()
            return loss
        return step

    whole = spmd.function(accumulate(model, opt), backend="aot_eager", whole_step=True)
    ref_step = accumulate(ref_model, ref_opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(_batches(mesh, 8)):
            whole(x, y), ref_step(x, y)
            for p, q in zip(model.parameters(), ref_model.parameters()):
                torch.testing.assert_close(gather(p.grad), gather(q.grad), rtol=1e-5, atol=1e-6)
            if i % 2:
                for o in (opt, ref_opt):
                    o.step()
                    o.zero_grad()
    assert whole.experimental_get_tracing_count() == 2  # gradients present, and none: one trace each
    assert len([w for w in caught if "traces the step again" in str(w.message)]) == 1
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(gather(p), gather(q), rtol=1e-5, atol=1e-6)


def test_the_gradients_a_step_replaces_are_dropped_before_its_graph_runs():
    """As eager torch's `zero_grad()` drops them: the gradients a step replaces without reading them are not the
    graph's inputs, and no trace keeps those of the call it was traced at (one set of gradients, not three)."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    model, _, step = _setup(mesh, OPTIMIZERS["adamw"], zero_grad_first=True)
    whole = spmd.function(step, backend="aot_eager", whole_step=True)
    batches = _batches(mesh, 3)
    whole(*batches[0])  # eagerly: leaves gradients
    eager_grads = [weakref.ref(p.grad._stack) for p in model.parameters()]
    whole(*batches[1])  # traced
    gc.collect()
    assert [r() for r in eager_grads] == [None] * len(eager_grads)
    (trace,) = [t for _, by_state in whole._whole_step._traces.values() for t in by_state.values()]
    graph, alive = trace.compiled, []
    last_grads = [weakref.ref(p.grad._stack) for p in model.parameters()]

    def run(*inputs):
        alive.append(sum(r() is not None for r in last_grads))
        return graph(*inputs)
    trace.compiled = run
    whole(*batches[2])
    assert alive == [0]
    assert all(p.grad is not None for p in model.parameters())


def test_a_gradient_the_step_does_not_touch_is_left_as_it_is():
    """A parameter of the step's model that its optimizer neither zeroes nor its loss reaches keeps its gradient."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    torch.manual_seed(0)
    model = spmd.distribute_module(nn.ModuleDict({"used": nn.Linear(8, 8), "idle": nn.Linear(8, 8)}), mesh)
    opt = torch.optim.SGD(model["used"].parameters(), lr=0.1)
    x, y = _batches(mesh, 1)[0]
    model["idle"](x).sum().backward()
    idle_grads = [gather(p.grad) for p in model["idle"].parameters()]

    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model["used"](x), y)
        loss.backward()
        opt.step()
        return loss
    whole = spmd.function(step, backend="aot_eager", whole_step=True)
    for _ in range(3):
        whole(x, y)
    assert whole.experimental_get_tracing_count() == 1
    for p, g in zip(model["idle"].parameters(), idle_grads):
        torch.testing.assert_close(gather(p.grad), g)


def test_explain_lists_the_whole_steps_collectives():
    """Data parallel: the loss's mean over the batch, and one all-reduce over `batch` per parameter's gradient,
    in the backward; nothing else (the update runs on each device's replica)."""
    mesh = spmd.create_mesh([("batch", 4)])
    model, _, step = _setup(mesh, OPTIMIZERS["sgd_momentum"])
    x, y = _batches(mesh, 1)[0]
    whole = spmd.function(step, whole_step=True)
    before = [components(p) for p in model.parameters()]
    e = whole.explain(x, y)
    assert [components(p) for p in model.parameters()] == before  # explaining runs nothing
    kinds = [(c.kind, c.mesh_dims, c.backward) for c in e.collectives]
    assert kinds.count(("all_reduce", ("batch",), True)) == 4  # the four parameters' gradients
    assert [k for k in kinds if k != ("all_reduce", ("batch",), True)] == [("all_reduce", ("batch",), False)]
    assert whole.experimental_get_tracing_count() == 0


def test_a_new_learning_rate_retraces_and_is_applied():
    mesh = spmd.create_mesh([("batch", 2)])
    _, opt, step = _setup(mesh, OPTIMIZERS["sgd_momentum"])
    ref_model, ref_opt, ref_step = _setup(mesh, OPTIMIZERS["sgd_momentum"])
    model = opt.param_groups[0]["params"][0]  # (any parameter: compared below through the models)
    whole = spmd.function(step, backend="aot_eager", whole_step=True)
    batches = _batches(mesh, 6)
    for x, y in batches[:3]:
        whole(x, y), ref_step(x, y)
    with pytest.warns(UserWarning, match="traces the step again"):
        for o in (opt, ref_opt):
            o.param_groups[0]["lr"] = 0.01
        torch.testing.assert_close(gather(whole(*batches[3])), gather(ref_step(*batches[3])))
    assert whole.experimental_get_tracing_count() == 2
    torch.testing.assert_close(gather(whole(*batches[4])), gather(ref_step(*batches[4])))
    assert whole.experimental_get_tracing_count() == 2
    torch.testing.assert_close(gather(model), gather(ref_opt.param_groups[0]["params"][0]))
    del ref_model


def test_dropout_draws_new_masks_at_every_call():
    mesh = spmd.create_mesh([("batch", 2)])
    _, _, step = _setup(mesh, lambda params: torch.optim.SGD(params, lr=0.0), dropout=0.5)
    whole = spmd.function(step, backend="aot_eager", whole_step=True)
    x, y = _batches(mesh, 1)[0]
    losses = [whole(x, y).item() for _ in range(4)]
    assert whole.experimental_get_tracing_count() == 1
    assert losses[2] != losses[3]  # lr 0: only the masks differ


def test_a_new_argument_layout_is_a_new_signature():
    mesh = spmd.create_mesh([("batch", 2)])
    _, _, step = _setup(mesh, OPTIMIZERS["sgd_momentum"])
    whole = spmd.function(step, backend="aot_eager", whole_step=True)
    x, y = _batches(mesh, 1)[0]
    for _ in range(3):
        whole(x, y)
    assert whole.experimental_get_tracing_count() == 1
    replicated = [spmd.relayout(t, Layout.replicated(mesh, 2)) for t in (x, y)]
    whole(*replicated)  # a new signature's first call: eager
    assert whole.experimental_get_tracing_count() == 1
    whole(*replicated)
    assert whole.experimental_get_tracing_count() == 2


def test_reading_a_value_inside_a_whole_step_is_a_trace_error():
    mesh = spmd.create_mesh([("batch", 2)])
    model, opt, _ = _setup(mesh, OPTIMIZERS["sgd_momentum"])

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    whole = spmd.function(step, backend="aot_eager", whole_step=True)
    x, y = _batches(mesh, 1)[0]
    whole(x, y)
    before = [components(p) for p in model.parameters()]
    with pytest.raises(TraceError, match=r"must not read tensor values"):
        whole(x, y)
    assert [components(p) for p in model.parameters()] == before  # a failed trace changes nothing
    assert all(p.grad is None for p in model.parameters())


def test_a_value_read_inside_a_torch_module_names_its_line():
    """BatchNorm with `momentum=None` reads `float(num_batches_tracked)`: the error names that line."""
    mesh = spmd.create_mesh([("batch", 2)])
    model = spmd.distribute_module(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None)), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    whole = spmd.function(step, backend="aot_eager", whole_step=True)
    x = spmd.copy_to_mesh(torch.randn(8, 4), Layout(["batch", U], mesh))
    whole(x)
    with pytest.raises(TraceError, match=r"batchnorm\.py:\d+: .*float\(self\.num_batches_tracked\)"):
        whole(x)


def test_bad_whole_step_arguments_are_refused():
    mesh = spmd.create_mesh([("batch", 2)])
    _, _, step = _setup(mesh, OPTIMIZERS["sgd_momentum"])
    x, y = _batches(mesh, 1)[0]
    whole = spmd.function(step, backend="aot_eager", whole_step=True)
    whole(x, y)
    with pytest.raises(ValueError, match="argument 0 .* requires grad"):
        whole(x.detach().requires_grad_(), y)
    plain = nn.Linear(8, 8)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)

    def plain_step(x):
        plain(x).sum().backward()
        plain_opt.step()

    whole_plain = spmd.function(plain_step, backend="aot_eager", whole_step=True)
    whole_plain(torch.randn(2, 8))  # the first call runs eagerly: plain torch
    with pytest.raises(TypeError, match="distribute the module"):
        whole_plain(torch.randn(2, 8))
    for mode in ("reduce-overhead", "max-autotune"):  # CUDA graphs: refused rather than silently left out
        with pytest.raises(ValueError, match=f"whole_step=True, mode='{mode}'.* not captured as a CUDA graph"):
            spmd.function(step, whole_step=True, mode=mode)
    spmd.function(step, whole_step=True, mode="max-autotune-no-cudagraphs")


def test_a_module_put_in_eval_mode_retraces():
    """The training flag is Python the trace ran: dropout off after `model.eval()` needs a new trace."""
    mesh = spmd.create_mesh([("batch", 2)])
    model, _, step = _setup(mesh, lambda params: torch.optim.SGD(params, lr=0.0), dropout=0.5)
    whole = spmd.function(step, backend="aot_eager", whole_step=True)
    x, y = _batches(mesh, 1)[0]
    for _ in range(3):
        whole(x, y)
    model.eval()
    with pytest.warns(UserWarning, match="training flags"):
        loss = whole(x, y)
    assert whole.experimental_get_tracing_count() == 2
    torch.testing.assert_close(loss.item(), model(x, y).item())


def _traced(make_opt, n: int):
    """(model, optimizer, its step under whole_step after 3 calls: traced, `n` more batches) on a 2-device mesh."""
    mesh = spmd.create_mesh([("batch", 2)])
    model, opt, step = _setup(mesh, make_opt)
    whole = spmd.function(step, backend="aot_eager", whole_step=True)
    batches = _batches(mesh, 3 + n)
    for x, y in batches[:3]:
        whole(x, y)
    return model, opt, whole, batches[3:]


def test_an_optimizer_state_loaded_from_a_checkpoint_is_what_the_step_updates():
    """`optimizer.load_state_dict` replaces the state's tensors: the graph reads and updates the new ones (no
    retrace), so resuming from a snapshot repeats the losses after it, as eager spmd does."""
    model, opt, whole, batches = _traced(OPTIMIZERS["adamw"], 3)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = copy.deepcopy(opt.state_dict())
    first = [gather(whole(x, y)) for x, y in batches]
    model.load_state_dict(weights)
    opt.load_state_dict(moments)
    again = [gather(whole(x, y)) for x, y in batches]
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert whole.experimental_get_tracing_count() == 1
    assert opt.state[next(model.parameters())]["step"].item() == 6


def test_a_frozen_parameter_retraces_and_is_left_as_it_is():
    model, _, whole, batches = _traced(OPTIMIZERS["sgd_momentum"], 2)
    model.w1.weight.requires_grad_(False)
    frozen = gather(model.w1.weight).clone()
    with pytest.warns(UserWarning, match="traces the step again"):
        whole(*batches[0])
    whole(*batches[1])
    assert torch.equal(gather(model.w1.weight), frozen)
    assert whole.experimental_get_tracing_count() == 2


def test_a_method_of_a_module_is_a_step_over_its_own_parameters():
    mesh = spmd.create_mesh([("batch", 2)])

    class Trainer(_MLP):
        def __init__(self):
            super().__init__()
            self.opt = None

        def step(self, x, y):
            loss = self(x, y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            return loss

    def make():
        torch.manual_seed(0)
        t = Trainer()
        spmd.distribute_module(t, mesh)
        t.opt = OPTIMIZERS["adamw"](t.parameters())
        return t

    trainer, ref = make(), make()
    whole = spmd.function(trainer.step, backend="aot_eager", whole_step=True)
    for x, y in _batches(mesh, 4):
        torch.testing.assert_close(gather(whole(x, y)), gather(ref.step(x, y)), rtol=1e-6, atol=1e-7)
    _assert_traced_once_and_equal(whole, trainer, ref)


@pytest.mark.parametrize("optimizer", [
    lambda params: torch.optim.AdamW(params, lr=torch.tensor(1e-2)),
    # SGD's for-loop reads the tensor as a number: the step takes its multi-tensor update
    lambda params: torch.optim.SGD(params, lr=torch.tensor(0.1), momentum=0.9, foreach=False),
], ids=["adamw", "sgd"])
def test_a_tensor_learning_rate_is_an_input_that_a_schedule_fills(optimizer):
    """As with torch.compile: a tensor lr (filled in place by a schedule) is read at every call, with no retrace."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])

    def make():
        model, opt, step = _setup(mesh, optimizer)
        return model, step, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))

    (model, step, schedule), (ref_model, ref_step, ref_schedule) = make(), make()
    whole = spmd.function(step, backend="aot_eager", whole_step=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x, y in _batches(mesh):
            torch.testing.assert_close(gather(whole(x, y)), gather(ref_step(x, y)), rtol=1e-6, atol=1e-7)
            schedule.step(), ref_schedule.step()
    _assert_traced_once_and_equal(whole, model, ref_model)


def test_clipping_gradients_inside_a_whole_step():
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])

    def make():
        model, opt, _ = _setup(mesh, OPTIMIZERS["adamw"])

        def step(x, y):
            loss = model(x, y)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
            return loss, norm
        return model, step

    (model, step), (ref_model, ref_step) = make(), make()
    whole = spmd.function(step, backend="aot_eager", whole_step=True)
    for x, y in _batches(mesh):
        (loss, norm), (ref_loss, ref_norm) = whole(x, y), ref_step(x, y)
        torch.testing.assert_close(gather(loss), gather(ref_loss), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(gather(norm), gather(ref_norm), rtol=1e-5, atol=1e-7)
    _assert_traced_once_and_equal(whole, model, ref_model)


def test_forbid_refuses_a_collective_of_the_steps_forward_and_names_its_line():
    """The backward's all-reduces (data-parallel gradients) are not the forward's: forbid does not cover them."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    model, _, step = _setup(mesh, OPTIMIZERS["sgd_momentum"])
    x, y = _batches(mesh, 1)[0]
    allowed = spmd.function(step, backend="aot_eager", whole_step=True, forbid=["all_gather", "all_to_all"])
    for _ in range(3):
        allowed(x, y)
    assert allowed.experimental_get_tracing_count() == 1
    refused = spmd.function(step, backend="aot_eager", whole_step=True, forbid="all_reduce")
    refused(x, y)  # the first call runs eagerly
    before = [components(p) for p in model.parameters()]
    with pytest.raises(TraceError, match=r"all_reduce over mesh dim\(s\) \['model'\] .* at File .*test_whole_step"
                                         r".*F\.mse_loss.*forbid=\['all_reduce'\]"):  # the row-parallel sum
        refused(x, y)
    assert [components(p) for p in model.parameters()] == before
    dp_mesh = spmd.create_mesh([("batch", 2)])
    _, _, dp_step = _setup(dp_mesh, OPTIMIZERS["sgd_momentum"])
    refused = spmd.function(dp_step, backend="aot_eager", whole_step=True, forbid="all_reduce")
    refused(*_batches(dp_mesh, 1)[0])
    with pytest.raises(TraceError, match=r"\['batch'\] \(4 B per device\) as the step returns its result"):
        refused(*_batches(dp_mesh, 1)[0])  # the loss's mean over the batch


def test_autocast_inside_a_whole_step():
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])

    def make():
        model, opt, _ = _setup(mesh, OPTIMIZERS["adamw"])

        def step(x, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return model, step

    (model, step), (ref_model, ref_step) = make(), make()
    whole = spmd.function(step, backend="aot_eager", whole_step=True)
    for x, y in _batches(mesh):
        torch.testing.assert_close(gather(whole(x, y)), gather(ref_step(x, y)), rtol=1e-6, atol=1e-7)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    _assert_traced_once_and_equal(whole, model, ref_model)


@pytest.mark.parametrize("change", ["add_param_group", "momentum_on", "state_cleared"])
def test_optimizer_state_made_after_the_first_trace_persists(change):
    """A retrace that would make optimizer state (a parameter group added, momentum switched on, the state
    cleared) runs that call eagerly, so the state persists and later calls trace over it: as plain torch."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    x = torch.randn(8, 8)
    results = []
    for distributed in (False, True):
        model = copy.deepcopy(plain)
        if distributed:
            spmd.distribute_module(model, mesh)
        first = model[0].parameters() if change == "add_param_group" else model.parameters()
        opt = torch.optim.SGD(first, lr=0.1) if change == "momentum_on" else torch.optim.Adam(first, lr=0.01)

        def step(x):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        run = spmd.function(step, whole_step=True, backend="aot_eager") if distributed else step
        data = spmd.copy_to_mesh(x, Layout(["batch", U], mesh)) if distributed else x
        for i in range(5):
            if i == 2:
                if change == "add_param_group":
                    opt.add_param_group({"params": list(model[1].parameters())})
                elif change == "momentum_on":
                    opt.param_groups[0]["momentum"] = 0.9
                else:
                    opt.state.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the retrace's warning)
                run(data)
        results.append([gather(p) if distributed else p.detach() for p in model.parameters()])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want)


def test_a_scheduler_stepped_inside_a_whole_step_is_a_trace_error():
    """The step's Python runs once, when traced: a schedule stepped inside would never advance."""
    mesh = spmd.create_mesh([("batch", 2)])
    model = spmd.distribute_module(nn.Linear(4, 2), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (epoch + 1))

    @spmd.function(whole_step=True, backend="aot_eager")
    def step(x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
    x = spmd.copy_to_mesh(torch.randn(4, 4), Layout(["batch", U], mesh))
    step(x)  # (the first call runs eagerly)
    with pytest.raises(TraceError, match=r"LambdaLR.step\(\) inside a whole step.*outside the function"):
        step(x)
    schedule.step()  # torch's own step again, outside a trace
    assert schedule.last_epoch == 2


def _squares_step(model, opt):
    """A training step on the mean square of `model`'s output; `step(x, other_model, other_opt)` runs it on
    another model (plain torch's)."""
    def step(x, module=model, optimizer=opt):
        loss = module(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss
    return step


@pytest.mark.parametrize("table", ["replicated", "vocabulary_sharded"])
def test_an_embedding_with_max_norm_trains_in_a_whole_step_as_plain_torch(table):
    """`nn.Embedding(max_norm=...)` rescales the rows its indices name: inside a trace the named rows are a mask,
    not a list whose length depends on the values."""
    mesh = spmd.create_mesh([("batch", 2), ("model", 2)])
    torch.manual_seed(0)
    plain = nn.Embedding(10, 4, max_norm=1.0)
    model = spmd.distribute_module(copy.deepcopy(plain), mesh, spmd.LayoutMap(
        {"weight": Layout(["model" if table == "vocabulary_sharded" else U, U], mesh)}))
    plain_opt, opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, model))
    step = _squares_step(model, opt)
    whole = spmd.function(step, whole_step=True, backend="aot_eager")
    for i in range(4):
        ids = torch.tensor([[1, 2, 3, 1], [7, 2, 9, 9]][i % 2])
        want = step(ids, plain, plain_opt)
        torch.testing.assert_close(gather(whole(spmd.copy_to_mesh(ids, Layout(["batch"], mesh)))), want.detach())
    assert whole.experimental_get_tracing_count() == 1
    torch.testing.assert_close(gather(model.weight), plain.weight.detach())


def test_a_dtensor_the_step_reads_as_a_constant_may_index_a_sharded_table():
    """Indices held by a module attribute that is not state (a DTensor of positions) are constants of the trace:
    the check that they lie inside the table runs in the graph, as for any traced index."""
    mesh = spmd.create_mesh([("batch", 1)])
    torch.manual_seed(0)

    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(8, 4)

        def forward(self, x):
            return self.table(self.positions) + x
    plain = Positions()
    model = spmd.distribute_module(copy.deepcopy(plain), mesh)
    plain.positions = torch.arange(8) % 4
    model.positions = spmd.copy_to_mesh(plain.positions, Layout([U], mesh))
    plain_opt, opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, model))
    step = _squares_step(model, opt)
    whole = spmd.function(step, whole_step=True, backend="aot_eager")
    for _ in range(3):
        x = torch.randn(8, 4)
        torch.testing.assert_close(gather(whole(spmd.copy_to_mesh(x, Layout(["batch", U], mesh)))),
                                   step(x, plain, plain_opt).detach())
    assert whole.experimental_get_tracing_count() == 1
