"""spmd on CUDA: the layout sweeps, every fused attention kernel, optimizers, mixed precision, training parity and
function mode on virtual devices sharing one GPU. Skipped without a GPU (the CPU suite is complete on its own)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.optim import optimizer

import spmd
from spmd import UNSHARDED, Layout
from spmd.demo.train import DemoArgs, run
from spmd.explain import Recorder
from sweep import Const, Plain, all_layouts, check_op, issued
from test_ops_sweep import CASES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def mesh():
    """2 x 2 virtual devices sharing GPU 0."""
    return spmd.create_mesh([("x", 2), ("y", 2)], devices=[f"GPU:{i}" for i in range(4)])


@pytest.fixture(autouse=True)
def exact_matmuls():
    """float32 matmuls in full precision, so that layouts are compared, not TF32 rounding."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_a_gpu_mesh_holds_its_components_on_the_gpu(mesh):
    assert mesh.torch_device == torch.device("cuda", 0)
    x = torch.randn(4, 6, device=CUDA)
    d = spmd.copy_to_mesh(x, Layout(["x", "y"], mesh))
    assert d.device.type == "cuda" and all(c.is_cuda for c in spmd.unpack(d))
    torch.testing.assert_close(spmd.to_global(spmd.relayout(d, Layout(["y", UNSHARDED], mesh))), x)


# -- the layout sweeps of tests/test_ops_sweep.py, on the GPU --------------------------------------------------------
def _on_gpu(value):
    if isinstance(value, torch.Tensor):
        return value.to(CUDA)
    if isinstance(value, (Const, Plain)):
        return type(value)(value.value.to(CUDA))
    return value


@pytest.mark.parametrize("case", [pytest.param(v, id=k) for k, v in CASES.items() if not hasattr(v, "marks")])
def test_op_sweep_on_the_gpu(case, mesh):
    fn, inputs, *layouts = case
    inputs = [_on_gpu(x) for x in inputs]
    if layouts:
        layouts = [[Layout(layout.sharding_specs, mesh) for layout in sweep] for sweep in layouts[0]]
    assert check_op(fn, inputs, mesh=mesh, layouts=layouts or None, sample=6) >= 1


# -- scaled_dot_product_attention on every backend -------------------------------------------------------------------
_KERNELS = {SDPBackend.FLASH_ATTENTION: "_scaled_dot_product_flash_attention",
            SDPBackend.EFFICIENT_ATTENTION: "_scaled_dot_product_efficient_attention",
            SDPBackend.CUDNN_ATTENTION: "_scaled_dot_product_cudnn_attention",
            SDPBackend.MATH: None}


def _attention_inputs(case, dtype):
    g = torch.Generator(device=CUDA).manual_seed(0)
    heads_kv = 2 if case == "gqa" else 4
    q = torch.randn(4, 4, 128, 64, device=CUDA, dtype=dtype, generator=g)
    k, v = (torch.randn(4, heads_kv, 128, 64, device=CUDA, dtype=dtype, generator=g) for _ in range(2))
    kwargs = {"causal": dict(is_causal=True), "gqa": dict(enable_gqa=True, is_causal=True),
              "mask": dict(attn_mask=torch.randn(4, 1, 128, 128, device=CUDA, dtype=dtype, generator=g)),
              "plain": {}}[case]
    return (q, k, v), kwargs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", ["plain", "causal", "mask", "gqa"])
@pytest.mark.parametrize("backend", list(_KERNELS), ids=lambda b: b.name)
def test_sdpa_runs_the_fused_kernel_plain_torch_runs_with_no_collective(backend, case, dtype, mesh):
    (q, k, v), kwargs = _attention_inputs(case, dtype)
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    try:
        with sdpa_kernel(backend):
            want = F.scaled_dot_product_attention(*plain, **kwargs)
    except RuntimeError as e:
        pytest.skip(f"plain torch has no {backend.name} kernel for this case: {str(e)[:120]}")
    want.backward(torch.ones_like(want))
    layout = Layout(["x", "y", UNSHARDED, UNSHARDED], mesh)
    mask = kwargs.get("attn_mask")
    if mask is not None:
        kwargs["attn_mask"] = spmd.copy_to_mesh(mask, Layout(["x", UNSHARDED, UNSHARDED, UNSHARDED], mesh))
    dist = [spmd.copy_to_mesh(t, layout).requires_grad_() for t in (q, k, v)]
    with Recorder() as explanation, sdpa_kernel(backend):
        got = F.scaled_dot_product_attention(*dist, **kwargs)
        got.backward(torch.ones_like(got))
    kernel = _KERNELS[backend]
    if kernel is not None:  # (the math kernel's bmm merges the batch and head axes: one of them is gathered)
        assert explanation.collectives == []
        assert kernel in {r.op for r in explanation.ops}, [r.op for r in explanation.ops]
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(spmd.to_global(got), want, **tol)
    for d, p in zip(dist, plain):
        assert spmd.fetch_layout(d.grad) == layout
        torch.testing.assert_close(spmd.to_global(d.grad), p.grad, **tol)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_sdpa_picks_the_backend_plain_torch_picks(dtype, grad, mesh):
    (q, k, v), _ = _attention_inputs("causal", dtype)
    q, k, v = (t.requires_grad_(grad) for t in (q, k, v))
    want = _KERNELS[SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=True))]
    dist = [spmd.copy_to_mesh(t, Layout(["x", "y", UNSHARDED, UNSHARDED], mesh)) for t in (q, k, v)]
    with Recorder() as explanation:
        F.scaled_dot_product_attention(*dist, is_causal=True)
    assert [r.op for r in explanation.ops if "attention" in r.op] == [want]


def test_dropout_on_the_gpu_is_layout_invariant(mesh):
    x = torch.ones(8, 4, 4, device=CUDA)
    results = []
    for layout in all_layouts(mesh, x.shape)[::3]:
        torch.manual_seed(7)
        out = F.dropout(spmd.copy_to_mesh(x, layout), p=0.5)
        assert spmd.fetch_layout(out) == layout
        results.append(spmd.to_global(out))
    assert all(torch.equal(r, results[0]) for r in results[1:])
    assert 0 < int((results[0] != 0).sum()) < x.numel()


# -- optimizers, mixed precision ------------------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)).to(CUDA)


_TP = {r"0\.weight": ["y", UNSHARDED], r"0\.bias": ["y"], r"2\.weight": [UNSHARDED, "y"]}


def _train(model, put, opt, steps=3, scaler=None, autocast=None):
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 32, device=CUDA), torch.randn(8, 16, device=CUDA)
        with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
            loss = F.mse_loss(model(put(x)).float(), put(y))
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _pair(mesh):
    plain, dist = _model(), _model()
    spmd.distribute_module(dist, mesh, spmd.LayoutMap(_TP))
    data = Layout(["x", UNSHARDED], mesh)
    return plain, dist, (lambda t: t), (lambda t: spmd.copy_to_mesh(t, data))


@pytest.mark.parametrize("mode", ["foreach", "fused"])
@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_foreach_and_fused_optimizers_on_the_gpu(name, mode, mesh):
    plain, dist, put_plain, put_dist = _pair(mesh)
    kwargs = {"lr": 0.01, mode: True} | ({"momentum": 0.9} if name == "SGD" else {})
    want = _train(plain, put_plain, getattr(torch.optim, name)(plain.parameters(), **kwargs))
    got = _train(dist, put_dist, getattr(torch.optim, name)(dist.parameters(), **kwargs))
    assert got == pytest.approx(want, rel=1e-5)
    for (n, d), p in zip(dist.named_parameters(), plain.parameters()):
        torch.testing.assert_close(spmd.to_global(d), p.detach(), rtol=1e-5, atol=1e-6, msg=n)


def test_torch_optim_takes_its_foreach_path_for_gpu_dtensors(mesh):
    _, dist, _, _ = _pair(mesh)
    assert optimizer._default_to_fused_or_foreach(list(dist.parameters()), differentiable=False) == (False, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast_and_grad_scaler_on_the_gpu(dtype, mesh):
    plain, dist, put_plain, put_dist = _pair(mesh)
    runs = []
    for model, put in ((plain, put_plain), (dist, put_dist)):
        scaler = torch.amp.GradScaler("cuda", init_scale=1024.0) if dtype == torch.float16 else None
        runs.append(_train(model, put, torch.optim.AdamW(model.parameters(), lr=0.01), scaler=scaler,
                           autocast=dtype))
    assert runs[1] == pytest.approx(runs[0], rel=2e-2)


def test_a_bfloat16_model_keeps_its_layouts(mesh):
    _, dist, _, put = _pair(mesh)
    dist.to(torch.bfloat16)
    assert spmd.fetch_layout(dist[0].weight).sharding_specs == ["y", UNSHARDED]
    out = dist(put(torch.randn(8, 32, device=CUDA)).to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.device.type == "cuda"


# -- the demo GPT: training parity, function mode ----------------------------------------------------------------
def test_demo_trains_on_the_gpu_with_the_cpu_loss_curve():
    quiet = Console(quiet=True)
    gpu = run(DemoArgs(device="cuda", steps=20), quiet)
    cpu = run(DemoArgs(device="cpu", steps=20, check=False), quiet)
    assert gpu["parity"], gpu["max_rel_diff"]
    assert gpu["losses"] == pytest.approx(cpu["losses"], rel=1e-4)


@pytest.mark.parametrize("backend, mode, whole_step", [("aot_eager", None, False), ("inductor", None, False),
                                                      ("inductor", "reduce-overhead", False), ("inductor", None, True)])
def test_a_compiled_training_step_matches_eager_on_the_gpu(backend, mode, whole_step, mesh):
    """mode="reduce-overhead": the forward, backward and optimizer graphs run as CUDA graphs, none skipped.
    whole_step: the step one graph."""
    plain, dist, _, put = _pair(mesh)

    def stepper(model, opt):
        def step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step

    compiled = spmd.function(stepper(dist, torch.optim.AdamW(dist.parameters(), lr=0.01)), backend=backend,
                             mode=mode, fullgraph=False, whole_step=whole_step)
    eager = stepper(plain, torch.optim.AdamW(plain.parameters(), lr=0.01))
    skips = counters["inductor"]["cudagraph_skips"]
    torch.manual_seed(1)
    for _ in range(5):  # CUDA graphs: warm-up, recording, then replays
        x, y = torch.randn(8, 32, device=CUDA), torch.randn(8, 16, device=CUDA)
        got, want = compiled(put(x), put(y)), eager(x, y)
        assert got.item() == pytest.approx(want.item(), rel=1e-4)
    assert counters["inductor"]["cudagraph_skips"] == skips


def test_compiled_attention_runs_the_fused_kernel_with_no_collective(mesh):
    (q, k, v), _ = _attention_inputs("causal", torch.bfloat16)
    layout = Layout(["x", "y", UNSHARDED, UNSHARDED], mesh)
    dist = [spmd.copy_to_mesh(t, layout) for t in (q, k, v)]
    attend = spmd.function(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    got, collectives = issued(lambda: attend(*dist))
    assert collectives == []
    torch.testing.assert_close(spmd.to_global(got), F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: one per client")
def test_the_demo_trains_over_nccl_with_one_gpu_per_client():
    done = subprocess.run([sys.executable, "-m", "spmd.cli", "demo", "--device", "cuda", "--clients", "2", "--steps",
                          "20"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loss curves equal" in done.stdout
