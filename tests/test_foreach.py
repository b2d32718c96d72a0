"""Multi-tensor ops on DTensors: `torch._foreach_*` (torch.optim with foreach=True, gradient clipping) and the fused
optimizer kernels (fused=True), run as one kernel per list on the stacked components where the lists line up; and
torch.optim's elementwise updates, run on the stacked components themselves."""

import pytest
import torch
from torch.optim import adam, optimizer, sgd

import spmd
from spmd import UNSHARDED, Layout
from spmd.collectives import Kind
from spmd.collectives.local import shared
from sweep import check_replicas
from test_engine import issued

MESH = spmd.create_mesh([("b", 2), ("m", 2)])
LAYOUTS = [Layout(["b", "m"], MESH), Layout(["m"], MESH), Layout(["unsharded", "b"], MESH)]


def _params():
    torch.manual_seed(0)
    plain = [torch.randn(4, 6, dtype=torch.float64), torch.randn(6, dtype=torch.float64),
             torch.randn(3, 4, dtype=torch.float64)]
    dist = [spmd.DVariable(p, layout=layout) for p, layout in zip(plain, LAYOUTS)]
    return dist, [p.clone().requires_grad_() for p in plain]


def _loss(ps):
    return (ps[0] * ps[1]).sin().sum() + (ps[2] @ ps[0]).square().mean()


OPTIMIZERS = [("SGD", {"lr": 0.1, "momentum": 0.9}), ("Adam", {"lr": 0.05}),
              ("AdamW", {"lr": 0.05, "weight_decay": 0.1, "amsgrad": True}), ("Adagrad", {"lr": 0.1})]


@pytest.mark.parametrize("mode", ["foreach", "fused"])
@pytest.mark.parametrize("name,kwargs", OPTIMIZERS + [("RMSprop", {"lr": 0.01})])
def test_multi_tensor_optimizers_match_plain_torch(name, kwargs, mode):
    if mode == "fused" and name == "RMSprop":
        pytest.skip("torch has no fused RMSprop")
    dist, plain = _params()
    opts = [getattr(torch.optim, name)(ps, **{mode: True}, **kwargs) for ps in (dist, plain)]
    for _ in range(3):
        for ps, opt in zip((dist, plain), opts):
            _loss(ps).backward()
            opt.step()
            opt.zero_grad()
    for d, p, layout in zip(dist, plain, LAYOUTS):
        assert spmd.fetch_layout(d) == layout
        torch.testing.assert_close(spmd.to_global(d), p.detach(), rtol=1e-10, atol=1e-12)
    for state in opts[0].state.values():
        for value in state.values():
            if spmd.is_dtensor(value) and value.dim() > 0:
                assert spmd.fetch_layout(value) in LAYOUTS


@pytest.mark.parametrize("foreach", [True, False])
def test_clip_grad_norm(foreach):
    dist, plain = _params()
    for ps in (dist, plain):
        _loss(ps).backward()
    norms = [torch.nn.utils.clip_grad_norm_(ps, max_norm=0.5, foreach=foreach) for ps in (dist, plain)]
    assert float(norms[0]) == pytest.approx(float(norms[1]), rel=1e-12)
    for d, p in zip(dist, plain):
        torch.testing.assert_close(spmd.to_global(d.grad), p.grad, rtol=1e-10, atol=1e-12)


def _kernel_counts(fn):
    """How often each aten op ran in `fn` (the DTensor-level call and the calls on components alike)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


_VIEWS = {"aten::view", "aten::as_strided", "aten::slice", "aten::narrow", "aten::expand", "aten::expand_as"}


@pytest.mark.parametrize("mode", ["foreach", "fused"])
@pytest.mark.parametrize("once_per_group", [False, True])
def test_an_optimizer_step_runs_the_kernels_plain_torch_runs(mode, once_per_group, monkeypatch):
    """torch.optim's update runs on the stacked components: exactly the aten ops of plain torch's step, each as
    often (CPU's foreach kernels loop over the tensors) — no multi-tensor op called on DTensors first, no dispatch
    per parameter and element op. (Where the foreach update of a parameter replicated over a mesh dim runs on one
    copy per group of devices holding it, it copies the result to the others: one `copy_` per written list —
    parameter, exp_avg, exp_avg_sq — and parameter; torch's fused kernels take the whole stacks.)"""
    if once_per_group:  # (the test's stacks are below the size from which it pays)
        monkeypatch.setattr(spmd.engine.optim, "ONCE_PER_GROUP_MIN_ELEMENTS", 0)
    counts = []
    for ps in _params():
        opt = torch.optim.AdamW(ps, lr=0.1, **{mode: True})
        _loss(ps).backward()
        opt.step()
        counts.append({op: n for op, n in _kernel_counts(opt.step).items() if op.startswith("aten::")})
    if not once_per_group:
        assert counts[0] == counts[1]
    dist, plain = ({op: n for op, n in c.items() if op not in _VIEWS} for c in counts)
    copies = dist.pop("aten::copy_", 0) - plain.pop("aten::copy_", 0)
    assert dist == plain
    assert copies == (3 * 2 if mode == "foreach" and once_per_group else 0)


class _LerpSizes(torch.utils._python_dispatch.TorchDispatchMode):
    """The element counts of the tensors that Adam's moment update (`lerp_`, one per tensor or per list) writes."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.lerp_.Scalar, torch.ops.aten._foreach_lerp_.Scalar):
            targets = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.sizes += [t.numel() for t in targets]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("foreach", [False, True])
def test_a_replicated_parameter_is_updated_once_per_group_of_devices_holding_it(foreach, monkeypatch):
    """A parameter replicated over a mesh dim (each device holding its own copy) is updated at coordinate 0 of that
    dim only, then copied to the others: the update's element ops see half of its stacks, and every device's
    components of the parameters and the state equal plain torch's values."""
    monkeypatch.setattr(spmd.engine.optim, "ONCE_PER_GROUP_MIN_ELEMENTS", 0)  # (small stacks, as if large)
    dist, plain = _params()
    opts = [torch.optim.AdamW(ps, lr=0.05, amsgrad=True, foreach=foreach) for ps in (dist, plain)]
    for _ in range(3):
        for ps, opt in zip((dist, plain), opts):
            _loss(ps).backward()
            opt.step()
            opt.zero_grad()
    for d, p in zip(dist, plain):
        torch.testing.assert_close(spmd.to_global(d), p.detach(), rtol=1e-10, atol=1e-12)
        check_replicas(d)
    for state in opts[0].state.values():
        for value in state.values():
            if spmd.is_dtensor(value) and value.dim() > 0:
                check_replicas(value)
    _loss(dist).backward()
    with _LerpSizes() as update:
        opts[0].step()
    # 4 devices: [4, 6] sharded over b and m (24 elements, no replica); [6] over m, replicated over b (2 groups
    # of 3); [3, 4] over b, replicated over m (2 groups of 6)
    assert sorted(update.sizes) == [6, 12, 24]


def test_optimizers_take_plain_torchs_default_path_and_run_it_on_the_stacks():
    """Where the user names no path, an optimizer takes the one it takes for plain tensors (the for-loop on CPU),
    and runs it on the stacked components: the same element kernels as plain torch's step, each as often (no
    dispatch per parameter and op), and the same values."""
    dist, plain = _params()
    assert adam._default_to_fused_or_foreach(dist, False) == adam._default_to_fused_or_foreach(plain, False)
    assert adam._default_to_fused_or_foreach(plain, False) == (False, False)
    opts = [torch.optim.AdamW(ps, lr=0.1) for ps in (dist, plain)]
    counts = []
    for ps, opt in zip((dist, plain), opts):
        for _ in range(2):
            _loss(ps).backward()
            counts.append(_update_counts(opt.step, "loop"))
            opt.zero_grad()
    assert counts[1] == counts[3] and counts[1]
    for d, p in zip(dist, plain):
        torch.testing.assert_close(spmd.to_global(d), p.detach(), rtol=1e-10, atol=1e-12)


def test_a_differentiable_update_records_its_ops_on_the_dtensors():
    """An update that autograd records (`differentiable=True`, which SGD's for-loop is not told) stays on the
    DTensors: the gradient through the update equals plain torch's."""
    grads = []
    for to_param in (lambda v: spmd.DVariable(v, layout=LAYOUTS[0]), lambda v: v.clone().requires_grad_()):
        w = to_param(torch.arange(24, dtype=torch.float64).reshape(4, 6) / 10)
        p = w * 1  # (a non-leaf, as differentiable optimizers update)
        with torch.enable_grad():
            sgd.sgd([p], [w.square()], [], foreach=False, weight_decay=0.0, momentum=0.0, lr=0.1,
                    dampening=0.0, nesterov=False, maximize=False)
        p.sum().backward()
        grads.append(spmd.to_global(w.grad) if spmd.is_dtensor(w.grad) else w.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[1], 1 - 0.2 * torch.arange(24, dtype=torch.float64).reshape(4, 6) / 10)


MESH24 = spmd.create_mesh([("b", 2), ("m", 4)])
# sharded over the whole mesh; over one dim (replicated over the other); replicated (one copy shared by all)
LAYOUTS24 = [Layout(["b", "m"], MESH24), Layout(["m"], MESH24), Layout([UNSHARDED, UNSHARDED], MESH24)]
ELEMENTWISE_OPTIMIZERS = [  # (name, options, modes): every branch of the updates that spmd runs on the stacks
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}, ["loop", "foreach", "fused"]),
    ("Adam", {"lr": 0.05, "amsgrad": True, "maximize": True}, ["loop", "foreach", "fused"]),
    ("AdamW", {"lr": 0.05, "weight_decay": 0.1}, ["loop", "foreach", "fused"]),
    ("Adagrad", {"lr": 0.1, "weight_decay": 0.01}, ["loop", "foreach", "fused"]),
    ("RMSprop", {"lr": 0.01, "momentum": 0.5, "centered": True}, ["loop", "foreach"]),
    ("Adamax", {"lr": 0.05, "weight_decay": 0.01}, ["loop", "foreach"]),
    ("NAdam", {"lr": 0.05, "weight_decay": 0.01, "decoupled_weight_decay": True}, ["loop", "foreach"]),
    ("RAdam", {"lr": 0.05}, ["loop", "foreach"]),
    ("ASGD", {"lr": 0.05, "t0": 1.0}, ["loop", "foreach"]),
    ("Adadelta", {"lr": 1.0, "weight_decay": 0.01}, ["loop", "foreach"]),
    ("Rprop", {"lr": 0.01}, ["loop", "foreach"]),
]
PATHS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _update_counts(fn, mode: str) -> dict:
    """How often `fn` ran each kernel of an optimizer's update: the multi-tensor ones, or for the for-loop its
    in-place element ops (not `copy_` and `fill_`, which resolving a pending gradient and creating state use)."""
    if mode != "loop":
        return {op: n for op, n in _kernel_counts(fn).items() if op.startswith(("aten::_foreach_", "aten::_fused_"))}
    return {op: n for op, n in _kernel_counts(fn).items()
            if op.startswith("aten::") and op.endswith("_") and op not in ("aten::copy_", "aten::fill_")}


@pytest.mark.parametrize("name,options,mode", [(name, options, mode) for name, options, modes in
                                               ELEMENTWISE_OPTIMIZERS for mode in modes])
def test_elementwise_optimizers_update_the_stacks_as_plain_torch_updates_its_tensors(name, options, mode):
    """On 8 devices, with parameters sharded, partially replicated and replicated (one shared copy), and gradients
    that arrive as pending sums: every device's component equals plain torch's after each step, the state keeps
    the parameters' layouts, and from the second step on (when the state exists) each kernel of the update (the
    for-loop's element ops, the multi-tensor ones) runs on the stacks, as often as in plain torch's step."""
    torch.manual_seed(0)
    values = [torch.randn(4, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64),
              torch.randn(3, 4, dtype=torch.float64)]
    x = torch.randn(6, 8, dtype=torch.float64)
    plain = [v.clone().requires_grad_() for v in values]
    dist = [spmd.DVariable(v, layout=layout) for v, layout in zip(values, LAYOUTS24)]
    inputs = (x, spmd.copy_to_mesh(x, Layout(["b", UNSHARDED], MESH24)))
    opts = [getattr(torch.optim, name)(ps, **PATHS[mode], **options) for ps in (dist, plain)]
    for step in range(3):
        counts = []
        for ps, opt, xs in zip((dist, plain), opts, reversed(inputs)):
            loss = ((xs * ps[1]).tanh() @ ps[0].T @ ps[2].T).square().mean() + (ps[2] @ ps[0]).sin().sum()
            loss.backward()
            counts.append(_update_counts(opt.step, mode))
            opt.zero_grad()
        for d, p, layout in zip(dist, plain, LAYOUTS24):
            assert spmd.fetch_layout(d) == layout
            torch.testing.assert_close(spmd.to_global(d), p.detach(), rtol=1e-10, atol=1e-12)
            check_replicas(d)
        if step:
            assert counts[0] == counts[1]
    for p, state in opts[0].state.items():
        for value in state.values():
            if spmd.is_dtensor(value) and value.dim() > 0:
                assert spmd.fetch_layout(value) == spmd.fetch_layout(p)


@pytest.mark.parametrize("mode", ["foreach", "fused"])
def test_a_shared_parameter_sharded_over_a_mesh_dim_of_one_device_is_not_written_through_its_expanded_view(mode):
    """Sharded over a mesh dim of size 1 is the same on every device: the parameter starts as one shared copy, which
    the update on the stacks never writes through its expanded view (torch refuses that write)."""
    mesh = spmd.create_mesh([("b", 4), ("m", 1)])
    torch.manual_seed(6)
    value, x = torch.randn(4, 6, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    ps = [spmd.DVariable(value, layout=Layout([UNSHARDED, "m"], mesh)), value.clone().requires_grad_()]
    inputs = [spmd.copy_to_mesh(x, Layout(["b", UNSHARDED], mesh)), x]
    assert shared(ps[0]._stack)
    opts = [torch.optim.AdamW([p], lr=0.05, **{mode: True}) for p in ps]
    for _ in range(2):
        for p, xs, opt in zip(ps, inputs, opts):
            (xs @ p).tanh().sum().backward()
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(spmd.to_global(ps[0]), ps[1].detach(), rtol=1e-10, atol=1e-12)
    check_replicas(ps[0])


def test_a_factored_optimizer_runs_op_by_op_on_dtensors(mesh22):
    """Adafactor's update reduces over rows and columns, so it is not run on the stacks (where a row of a component
    is not a row of the parameter): with the last axis sharded it still matches plain torch."""
    torch.manual_seed(5)
    value = torch.randn(4, 8, dtype=torch.float64)
    ps = [spmd.DVariable(value, layout=Layout(["x", "y"], mesh22)), value.clone().requires_grad_()]
    opts = [torch.optim.Adafactor([p], lr=0.05, foreach=True) for p in ps]
    for _ in range(2):
        for p, opt in zip(ps, opts):
            p.sin().sum().backward()
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(spmd.to_global(ps[0]), ps[1].detach(), rtol=1e-10, atol=1e-12)


def test_in_place_foreach_relayouts_the_lists_it_reads(mesh22):
    """`_foreach_add_(xs, ys)` keeps the xs' layouts; a y laid out otherwise is relayouted first, with exactly the
    collectives the element op `add_` issues."""
    torch.manual_seed(1)
    values = [torch.randn(4, 4) for _ in range(4)]
    x_layouts = [Layout(["x", "y"], mesh22), Layout([UNSHARDED, "x"], mesh22)]
    y_layouts = [Layout(["y", "x"], mesh22), Layout([UNSHARDED, "x"], mesh22)]
    xs = [spmd.copy_to_mesh(v, layout) for v, layout in zip(values[:2], x_layouts)]
    ys = [spmd.copy_to_mesh(v, layout) for v, layout in zip(values[2:], y_layouts)]
    _, collectives = issued(torch._foreach_add_, xs, ys)
    xs_elementwise = [spmd.copy_to_mesh(v, layout) for v, layout in zip(values[:2], x_layouts)]
    _, element_collectives = issued(lambda: [x.add_(y) for x, y in zip(xs_elementwise, ys)])
    assert collectives == element_collectives and collectives  # (the first y needs a relayout)
    for x, v, w, layout in zip(xs, values[:2], values[2:], x_layouts):
        assert spmd.fetch_layout(x) == layout
        torch.testing.assert_close(spmd.to_global(x), v + w)


def test_lists_that_lined_up_before_are_checked_again_position_by_position(mesh22):
    """The line-up remembers key lists it found equal: a later list that starts like one of them (the same first
    layout object) but is laid out otherwise further on is relayouted there, not taken as lined up."""
    torch.manual_seed(4)
    values = [torch.randn(4, 4) for _ in range(6)]
    shared, other = Layout(["x", "y"], mesh22), Layout([UNSHARDED, "x"], mesh22)
    xs = [spmd.copy_to_mesh(v, Layout(["x", "y"], mesh22)) for v in values[:2]]  # equal layouts, distinct objects
    torch._foreach_add_(xs, [spmd.copy_to_mesh(v, shared) for v in values[2:4]])
    ys = [spmd.copy_to_mesh(values[4], shared), spmd.copy_to_mesh(values[5], other)]
    _, collectives = issued(torch._foreach_add_, xs, ys)
    assert collectives  # (the second y needs a relayout)
    for x, v, w, u in zip(xs, values[:2], values[2:4], values[4:]):
        assert spmd.fetch_layout(x) == shared
        torch.testing.assert_close(spmd.to_global(x), v + w + u)


def test_out_of_place_foreach_on_lists_that_do_not_line_up_takes_the_element_rules(mesh22):
    torch.manual_seed(2)
    a = [spmd.copy_to_mesh(torch.randn(4, 4), Layout(["x", UNSHARDED], mesh22))]
    b = [spmd.copy_to_mesh(torch.randn(4, 4), Layout([UNSHARDED, "y"], mesh22))]
    (out,), collectives = issued(torch._foreach_mul, a, b)
    expected, expected_collectives = issued(torch.mul, a[0], b[0])
    assert spmd.fetch_layout(out) == spmd.fetch_layout(expected) and collectives == expected_collectives
    torch.testing.assert_close(spmd.to_global(out), spmd.to_global(expected))


def test_foreach_on_pending_sums_keeps_them_as_the_element_rules_do(mesh22):
    """A pending sum (x @ w over a sharded contraction) scaled by `_foreach_mul` stays pending: no collective."""
    x = spmd.copy_to_mesh(torch.randn(4, 4), Layout([UNSHARDED, "y"], mesh22))
    w = spmd.copy_to_mesh(torch.randn(4, 4), Layout(["y", UNSHARDED], mesh22))
    (out,), collectives = issued(torch._foreach_mul, [x @ w], 2.0)
    assert collectives == [] and out._pending == ("y",)
    torch.testing.assert_close(spmd.to_global(out), 2 * spmd.to_global(x) @ spmd.to_global(w))


def test_fused_step_relayouts_a_gradient_laid_out_otherwise(mesh22):
    torch.manual_seed(3)
    value, grad = torch.randn(4, 4), torch.randn(4, 4)
    p = spmd.DVariable(value, layout=Layout(["x", "y"], mesh22))
    p.grad = spmd.copy_to_mesh(grad, Layout([UNSHARDED, "x"], mesh22))
    plain = value.clone().requires_grad_()
    plain.grad = grad.clone()
    opts = [torch.optim.Adam([t], lr=0.1, fused=True) for t in (p, plain)]
    _, collectives = issued(opts[0].step)
    opts[1].step()
    assert collectives == [(Kind.ALL_TO_ALL, ("x",), False)]  # x moves from axis 1 to axis 0; y is a local slice
    torch.testing.assert_close(spmd.to_global(p), plain.detach())
    assert spmd.fetch_layout(opts[0].state[p]["exp_avg"]) == spmd.fetch_layout(p)


def test_fused_step_refuses_a_plain_gradient_with_a_clear_error(mesh22):
    p = spmd.DVariable(torch.zeros(4, 4), layout=Layout(["x", "y"], mesh22))
    p.grad = torch.ones(4, 4)
    with pytest.raises(spmd.MixedTensorError, match=r"_fused_adam_.*grads holds a plain tensor \(shape \[4, 4\]\)"):
        torch.optim.Adam([p], lr=0.1, fused=True).step()


def test_torch_optim_defaults_to_foreach_for_dtensors_where_it_does_for_plain_tensors(monkeypatch):
    """On CUDA torch.optim picks its foreach path by default for the tensor types it knows; spmd's are among them."""
    monkeypatch.setattr(optimizer, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    dist, plain = _params()
    assert optimizer._default_to_fused_or_foreach(plain, differentiable=False) == (False, True)
    assert optimizer._default_to_fused_or_foreach(dist, differentiable=False) == (False, True)


@pytest.mark.parametrize("mode", ["foreach", "fused"])
def test_grad_scaler_steps_and_skips_as_plain_torch(mode):
    """torch.amp.GradScaler unscales and checks the gradients with one multi-tensor kernel; an infinity skips the
    step and lowers the scale exactly as for plain tensors."""
    dist, plain = _params()
    runs = []
    for ps in (dist, plain):
        opt = torch.optim.Adam(ps, lr=0.05, **{mode: True})
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        for poison in (0.0, float("inf"), 0.0):
            scaler.scale(_loss(ps) + poison * ps[1][0]).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs.append(scaler.get_scale())
    assert runs[0] == runs[1] == 8.0 * 0.5
    for d, p, layout in zip(dist, plain, LAYOUTS):
        assert spmd.fetch_layout(d) == layout
        torch.testing.assert_close(spmd.to_global(d), p.detach(), rtol=1e-10, atol=1e-12)


def test_autocast_and_bfloat16_modules(mesh22):
    """autocast runs the distributed model's matmuls in bfloat16 like plain torch's; `.to(torch.bfloat16)` keeps
    parameters distributed with their layouts."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))

    plain, dist = model(), model()
    spmd.distribute_module(dist, mesh22, spmd.LayoutMap({r"0\.weight": Layout(["y", UNSHARDED], mesh22),
                                                          r"0\.bias": Layout(["y"], mesh22)}))
    x = torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = plain(x), dist(spmd.copy_to_mesh(x, Layout(["x", UNSHARDED], mesh22)))
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(spmd.to_global(got), want, rtol=2e-2, atol=2e-2)
    dist.to(torch.bfloat16)
    weight = dist[0].weight
    assert spmd.fetch_layout(weight) == Layout(["y", UNSHARDED], mesh22) and isinstance(weight, torch.nn.Parameter)
    assert weight.dtype == torch.bfloat16 and "dtype=torch.bfloat16" in repr(weight)
