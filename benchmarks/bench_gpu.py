"""The 168M GPT training step on one GPU: plain torch, torch.compile, torch DTensor (world 1), spmd eager on a
1-device mesh and on 8 virtual devices (batch 4 × model 2), and spmd.function on both — ms/step, tokens/s, peak
memory and the first step's time, in one run.

usage: python benchmarks/bench_gpu.py [--variants a,b,...] [--warm W] [--steps N] [--timeout S] [--compile-timeout S]
                                      [--budget S] [--concurrent-compile] [--logs DIR] [--quick] [--out DIR]
       python benchmarks/bench_gpu.py --readme-only   # README.md's table from results/gpu.json, runs nothing

Every variant runs in a fresh subprocess of its own with its own timeout, so one that fails, hangs or runs out of
memory is reported (its error and the end of its traceback) and never stops the others, and each starts with an
empty GPU and an empty inductor cache; the results file is rewritten after every variant. Model:
`spmd.demo.model.GPT` (d_model 1024, 8 layers, 16 heads, vocabulary 32768, block 512), bf16 weights, AdamW (torch's
defaults), batch 16 × 512 random tokens. On a machine without CUDA it runs on the CPU in fp32 (`--quick`: a tiny
GPT, for the test suite). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch._dynamo.utils import counters
from torch.optim import adam
from torch.profiler import ProfilerActivity

import spmd
from benchmarks._common import (
    RESULTS,
    ROOT,
    environment,
    fmt,
    md_table,
    output_arguments,
    peak_rss_kib,
    ratio,
    torch_dist_ws1,
    update_readme,
    write_results,
)
from benchmarks.bench_demo import to_dt
from spmd import UNSHARDED, Layout
from spmd.demo.model import GPT, GPTConfig, megatron_layouts

STEM = "gpu"
# the default run, in order; "_cg": the compiled step with CUDA graphs (torch.compile's mode="reduce-overhead")
VARIANTS = ("plain", "compile", "compile_step", "dt", "spmd1", "spmd8", "fn1", "fn8", "ws1", "ws8", "compile_step_cg",
            "fn1_cg", "fn8_cg")
EXTRA = ("fn8aot",)  # on request (--variants): fn8 with the aot_eager backend, spmd demo's choice for 8 devices
LABELS = {"plain": "plain torch (eager)", "compile": "plain `torch.compile(model)`",
          "compile_step": "plain `torch.compile` of the step (as `spmd.function`)",
          "dt": "torch DTensor TP, world size 1", "spmd1": "spmd eager, 1-device mesh",
          "spmd8": "spmd eager, 8 virtual devices (batch 4 × model 2)", "fn1": "`spmd.function` step, 1-device mesh",
          "fn8": "`spmd.function` step, 8 virtual devices",
          "ws1": "`spmd.function(whole_step=True)`, 1-device mesh",
          "ws8": "`spmd.function(whole_step=True)`, 8 virtual devices",
          "fn8aot": "`spmd.function` (aot_eager), 8 virtual devices",
          "compile_step_cg": "plain `torch.compile` of the step, CUDA graphs",
          "fn1_cg": "`spmd.function` step, 1-device mesh, CUDA graphs",
          "fn8_cg": "`spmd.function` step, 8 virtual devices, CUDA graphs"}
COMPILED = {"compile", "compile_step", "fn1", "fn8", "ws1", "ws8", "fn8aot", "compile_step_cg", "fn1_cg",
            "fn8_cg"}  # run last
FULL = dict(vocab_size=32768, block_size=512, n_layer=8, n_head=16, d_model=1024, batch_size=16)
QUICK = dict(vocab_size=96, block_size=16, n_layer=1, n_head=2, d_model=16, batch_size=8)  # batch divisible by 4
MESHES = {1: [("batch", 1)], 8: [("batch", 4), ("model", 2)]}
LR = 1e-4
MARK = "BENCH_GPU_RESULT "  # the child's one result line on stdout
READY = "BENCH_GPU_READY"  # a gated child's line: warmed up (compiled), waiting for GO on stdin
DIVERGED = {"bfloat16": 0.05, "float32": 1e-4}  # a larger relative loss difference than this is reported as such
SAMPLE = 4096  # elements of each parameter whose updates are compared with plain torch's (see update_cosines)
MIN_COSINE = 0.5  # an update direction less aligned with plain torch's than this is reported as diverging
# left out of the update check: the key bias's gradient is zero in exact arithmetic (softmax over the keys does not
# change when every key moves by the same vector), so AdamW's update of it is normalised rounding noise
UNCHECKED = re.compile(r"attn\.k\.bias$")


def with_cuda_graphs(name: str) -> bool:
    """Whether variant `name` compiles its step with CUDA graphs (torch.compile's mode="reduce-overhead")."""
    return name.endswith("_cg")


# -- one variant (runs in the child process) ---------------------------------------------------------------------
def gpt_config(cfg: dict):
    return GPTConfig(vocab_size=cfg["vocab_size"], block_size=cfg["block_size"], n_layer=cfg["n_layer"],
                     n_head=cfg["n_head"], d_model=cfg["d_model"], dropout=0.0)


def make_batches(cfg: dict, n: int) -> list:
    """`n` batches of random token ids (inputs, targets), the same in every variant: a fixed generator seed."""
    g = torch.Generator().manual_seed(1)
    shape = (cfg["batch_size"], cfg["block_size"])
    return [(torch.randint(0, cfg["vocab_size"], shape, generator=g),
             torch.randint(0, cfg["vocab_size"], shape, generator=g)) for _ in range(n)]


def make_step(model, positions, opt):
    """One training step: forward, backward, AdamW step, zero_grad; returns the loss."""
    def step(x, y):
        loss = model(x, positions, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def spmd_model(model, n_devices: int, device: str):
    """distribute_module onto a mesh of `n_devices` (virtual devices beyond the GPU count share the GPU), Megatron
    layouts on 8 devices; returns (positions, the function that puts a batch tensor onto the data layout)."""
    kind = "GPU" if device == "cuda" else "CPU"
    mesh = spmd.create_mesh(MESHES[n_devices], devices=[f"{kind}:{i}" for i in range(n_devices)], device_type=kind)
    spmd.distribute_module(model, mesh, spmd.LayoutMap(megatron_layouts("model" if n_devices > 1 else None)))
    positions = spmd.copy_to_mesh(torch.arange(model.cfg.block_size), Layout([UNSHARDED], mesh))
    layout = Layout(["batch", UNSHARDED], mesh)
    return positions, lambda t: spmd.copy_to_mesh(t.to(mesh.torch_device), layout)


def build(name: str, cfg: dict):
    """(step, put, model) of variant `name`: the GPT built with torch.manual_seed(0) (the same weights in every
    process), converted to the run's dtype before it is moved or distributed."""
    device = cfg["device"]
    mode = "reduce-overhead" if with_cuda_graphs(name) else None
    name = name.removesuffix("_cg")
    torch.manual_seed(0)
    model = GPT(gpt_config(cfg)).to(getattr(torch, cfg["dtype"]))
    forward = model
    if name in ("plain", "compile", "compile_step", "dt"):
        model.to(device)
        if name == "dt":
            model = forward = to_dt(model, cfg["n_layer"], device)
        if name == "compile":
            forward = torch.compile(model)  # the forward as a new user compiles it; backward and AdamW run eagerly
        positions = torch.arange(cfg["block_size"], device=device)
        put = lambda t: t.to(device)  # noqa: E731
    else:
        positions, put = spmd_model(model, 8 if name.startswith(("fn8", "ws8")) or name == "spmd8" else 1, device)
    # torch DT keeps the embeddings and norms plain: its foreach AdamW (CUDA's default) refuses lists that mix plain
    # tensors and DTensors ("got mixed torch.Tensor and DTensor"), so it takes the for-loop
    opt = torch.optim.AdamW(model.parameters(), lr=LR, **({"foreach": False} if name == "dt" else {}))
    step = make_step(forward, positions, opt)
    if name == "compile_step":  # the scope spmd.function compiles: forward, backward and the optimizer step
        step = torch.compile(step, mode=mode)
    if name.startswith("fn"):
        step = spmd.function(step, fullgraph=False, backend="aot_eager" if name == "fn8aot" else "inductor", mode=mode)
    if name.startswith("ws"):  # forward, backward and the update one graph
        step = spmd.function(step, whole_step=True, mode=mode)
    return step, put, model, opt


def global_value(t) -> torch.Tensor:
    """The global value of an spmd DTensor, a torch DTensor or a tensor, as a plain tensor."""
    if spmd.is_dtensor(t):
        return spmd.to_global(t)
    if hasattr(t, "full_tensor"):  # a torch DTensor
        return t.full_tensor()
    return t


def loss_value(loss) -> float:
    return global_value(loss.detach()).item()


def sample_parameters(model) -> dict[str, torch.Tensor]:
    """The same SAMPLE elements (fixed indices into the flattened global value) of every parameter, float32 on
    the CPU: the update check compares what the steps did to them across variants."""
    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = global_value(p.detach()).reshape(-1)
            g = torch.Generator().manual_seed(2)
            idx = torch.randint(0, flat.numel(), (min(SAMPLE, flat.numel()),), generator=g)
            out[name] = flat[idx.to(flat.device)].float().cpu()
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def optimizer_path(opt) -> str:
    """Which AdamW implementation torch's defaults chose for these parameters (foreach on CUDA when it can)."""
    try:
        params = [p for g in opt.param_groups for p in g["params"]]
        fused, foreach = adam._default_to_fused_or_foreach(params, False, False)  # (what AdamW consults)
        return "fused" if fused else "foreach" if foreach else "for-loop"
    except Exception as e:  # a private helper of torch: report rather than fail
        return f"unknown ({type(e).__name__})"


def train(name: str, cfg: dict, res: dict) -> None:
    """Builds the variant and times its steps, filling `res` as it goes (a failure keeps what was measured)."""
    device, warm, steps = cfg["device"], cfg["warm"], cfg["steps"]
    t = time.perf_counter()
    step, put, model, opt = build(name, cfg)
    res["parameters"] = sum(p.numel() for p in model.parameters())
    batches = [(put(x), put(y)) for x, y in make_batches(cfg, warm + steps)]  # on the device before timing
    sync(device)
    before = sample_parameters(model)
    res["build_s"] = time.perf_counter() - t
    res["optimizer"] = optimizer_path(opt)
    emit(dict(res, partial=True))
    res["losses"], ms = [], []
    for i, (x, y) in enumerate(batches):
        if i == warm and cfg.get("gate"):  # compiled while the others compiled: time alone, once let go
            if device == "cuda":
                torch.cuda.empty_cache()  # while it waits, it holds only its model and optimizer state
            emit(dict(res, partial=True))
            print(READY, flush=True)
            sys.stdin.readline()
        if i == warm and device == "cuda":
            res["peak_warmup_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        sync(device)
        t = time.perf_counter()
        loss = step(x, y)
        sync(device)
        ms.append((time.perf_counter() - t) * 1e3)
        res["losses"].append(loss_value(loss))
        if i == 0:
            res["first_step_s"] = ms[0] / 1e3
        print(f"{name}: step {i} {ms[-1]:.1f} ms, loss {res['losses'][-1]:.4f}", file=sys.stderr, flush=True)
        emit(dict(res, partial=True))  # a variant killed at its timeout still reports the steps it made
    res["ms"] = ms[warm:] or ms
    res["warmup_s"] = sum(ms[:warm]) / 1e3  # compilation included, at whichever call compiles (whole step: the 2nd)
    res["median_ms"] = statistics.median(res["ms"])
    res["tokens_per_s"] = cfg["batch_size"] * cfg["block_size"] / (res["median_ms"] / 1e3)
    if device == "cuda":
        res["peak_bytes"] = torch.cuda.max_memory_allocated()
        if with_cuda_graphs(name):  # a graph's replay allocates nothing: its memory was allocated as it was recorded
            res["peak_bytes"] = max(res["peak_bytes"], res["peak_warmup_bytes"])
        res["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    else:
        res["peak_bytes"] = peak_rss_kib() * 1024  # the whole process, warm-up included: VmHWM cannot be reset
    if hasattr(step, "experimental_get_tracing_count"):
        res["traces"] = step.experimental_get_tracing_count()
    if with_cuda_graphs(name):  # graphs that could not be CUDA graphs, and inputs copied into a graph at each replay
        res["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
        res["cudagraph_copied_inputs"] = counters["inductor"]["cudagraph_recorded_non_static_inputs"]
    if cfg.get("scratch"):
        after = sample_parameters(model)
        torch.save({k: after[k] - before[k] for k in before}, os.path.join(cfg["scratch"], f"{name}.pt"))
    if cfg.get("profile") and device == "cuda":
        res["gpu_busy_ms"] = profile(step, batches[-1], name)


def profile(step, batch, name: str, steps: int = 3) -> float:
    """GPU kernel time per step under torch.profiler (a step far longer than it is CPU-bound: the GPU waits for
    Python); the busiest ops go to stderr (the variant's log)."""
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(*batch)
        torch.cuda.synchronize()
    events = prof.key_averages()
    print(f"{name}: profile of {steps} steps\n" + events.table(sort_by="self_cpu_time_total", row_limit=25),
          file=sys.stderr, flush=True)
    kernels = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return kernels / 1e3 / steps


def emit(res: dict) -> None:
    """The result so far as one stdout line; the parent reads the last one."""
    print(MARK + json.dumps(res, default=str), flush=True)


def device_info(device: str) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device}
    if device == "cuda":
        info["device_name"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def child_main(name: str, cfg: dict) -> int:
    """Runs one variant and prints its result as one JSON line (`MARK` + JSON), also after a failure."""
    warnings.simplefilter("ignore")
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    res: dict = {"variant": name, **device_info(cfg["device"])}
    backend = "nccl" if cfg["device"] == "cuda" else "gloo"
    try:
        with torch_dist_ws1(backend) if name == "dt" else contextlib.nullcontext():
            train(name, cfg, res)
        rc = 0
    except BaseException as e:  # reported by the parent; what was measured before is kept
        res["error"] = f"{type(e).__name__}: {str(e).strip()[:500]}"
        res["traceback_tail"] = traceback.format_exc().splitlines()[-12:]
        traceback.print_exc()  # the whole traceback, for --logs
        rc = 1
    emit(res)
    return rc


# -- the parent: one subprocess per variant ----------------------------------------------------------------------
def child_env(device: str, cache: str | None) -> dict:
    """The child's environment: this repository importable; one visible GPU (spmd maps GPU:i to cuda:i mod the GPU
    count, and a mesh's components must all live on one torch device); an empty inductor cache of its own, so that
    the first step is a cold compile."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    if cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
    if device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    return env


def _kill(proc: subprocess.Popen) -> None:
    """Kills the child and what it started (inductor's compile workers): its own process group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _tail(text: str, n: int = 15) -> list[str]:
    return [line for line in (text or "").splitlines() if line.strip()][-n:]


class Child:
    """One variant's process. Its stdout and stderr are read by threads as they come, so that several children can
    run at once; with `gate`, the child stops after its warm-up steps (compilation done) until `go()`."""

    def __init__(self, name: str, cfg: dict, timeout: float, logs: str | None, gate: bool = False):
        self.name, self.timeout, self.logs = name, timeout, logs
        self.cmd = [sys.executable, os.path.abspath(__file__), "--_variant", name,
                    "--_config", json.dumps(dict(cfg, gate=gate))]
        cache = os.path.join(cfg["scratch"], f"inductor-{name}") if cfg.get("scratch") else None
        self.start = time.monotonic()
        self.deadline = self.start + timeout
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE if gate else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=child_env(cfg["device"], cache), cwd=ROOT, start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self.ready = threading.Event()
        self.readers = [threading.Thread(target=self._read, args=(f, buf), daemon=True)
                        for f, buf in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for r in self.readers:
            r.start()

    def _read(self, stream, buf: list) -> None:
        for line in stream:
            buf.append(line)
            if line.strip() == READY:
                self.ready.set()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def wait_ready(self) -> None:
        """Until the child has compiled and waits, has exited, or its time is up."""
        while not self.ready.wait(0.2) and self.proc.poll() is None and self.left() > 0:
            pass

    def go(self, seconds: float) -> None:
        """Lets a gated child run its timed steps, for at most `seconds` from now."""
        self.timeout, self.deadline = seconds, time.monotonic() + seconds
        try:
            self.proc.stdin.write("GO\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):  # it has exited: finish() reports why
            pass

    def finish(self) -> dict:
        """Waits for the child (killed when its time is up); its result, or an error with the end of its log."""
        try:
            self.proc.wait(timeout=max(self.left(), 0.01))
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill(self.proc)
            self.proc.wait()
            timed_out = True
        for r in self.readers:
            r.join(timeout=10)
        out, err = "".join(self.out), "".join(self.err)
        if self.logs:
            os.makedirs(self.logs, exist_ok=True)
            with open(os.path.join(self.logs, f"{self.name}.log"), "w") as f:
                f.write(f"$ {' '.join(self.cmd)}\n--- stdout\n{out}\n--- stderr\n{err}\n")
        lines = [line[len(MARK):] for line in out.splitlines() if line.startswith(MARK)]
        res = json.loads(lines[-1]) if lines else {"variant": self.name}
        res["wall_s"] = time.monotonic() - self.start
        if timed_out:
            res["error"] = f"timed out after {self.timeout:.0f} s" + (f" ({res['error']})" if "error" in res else "")
        elif self.proc.returncode and "error" not in res:
            res["error"] = f"exit code {self.proc.returncode}" + (f": {_tail(err, 1)[0]}" if _tail(err, 1) else "")
        if "error" in res and "traceback_tail" not in res:
            res["traceback_tail"] = _tail(err)
        return res


def run_variant(name: str, cfg: dict, timeout: float, logs: str | None) -> dict:
    """Runs `name` in a fresh process for at most `timeout` seconds; its result, or an error with the end of its
    log."""
    return Child(name, cfg, timeout, logs).finish()


def run_gated(names: list[str], cfg: dict, timeouts: dict, run_timeout, logs: str | None, done) -> None:
    """The variants start together and compile concurrently (their first steps overlap), each for at most
    `timeouts[name]` seconds; once all have compiled, each is let go in turn while the others wait, for at most
    `run_timeout(name)` seconds (None: not run), so that every timed step has the machine to itself (none overlaps
    another's compilation). `done(name, result)` is called as each finishes."""
    children = [Child(n, cfg, timeouts[n], logs, gate=True) for n in names]
    for c in children:
        c.wait_ready()
    for c in children:
        if c.ready.is_set():  # (else it failed, or its compilation ran out of time: finish() says which)
            seconds = run_timeout(c.name)
            if seconds is None:
                _kill(c.proc)
                continue
            c.go(seconds)
        done(c.name, c.finish())


def loss_parity(res: dict, ref: list, dtype: str) -> None:
    """The largest relative difference of the variant's losses from plain torch's, over the steps both ran
    (reported, not asserted: bf16 losses differ slightly)."""
    pairs = list(zip(res["losses"], ref))
    diffs = [abs(a - b) / max(abs(b), 1e-12) if a == a else float("inf") for a, b in pairs]  # NaN: inf
    res["max_rel_loss_diff"] = max(diffs)
    res["loss_steps_compared"] = len(pairs)
    res["loss_diverged"] = res["max_rel_loss_diff"] > DIVERGED.get(dtype, 1e-4)


def update_cosines(res: dict, mine: dict, ref: dict) -> None:
    """The smallest cosine, over parameters, between the variant's update of the sampled elements and plain
    torch's. The losses cannot show a wrong optimizer step (at lr 1e-4 over ~13 steps on random tokens they
    hardly move, and bf16 rounds them to 2^-4), the update's direction does: ~1 when the steps agree, ~0 for a
    miscompiled one. Parameters in UNCHECKED are skipped, and so are those that one of the two runs did not change
    (bf16 rounds an update smaller than half a unit in the last place away): they are listed."""
    worst, where, one_sided = 1.0, None, []
    for name, r in ref.items():
        a = mine.get(name)
        if a is None or a.shape != r.shape:
            worst, where = 0.0, name + " (missing)"
            break
        na, nr = a.norm().item(), r.norm().item()
        if UNCHECKED.search(name) or (na == 0 and nr == 0):
            continue
        if na == 0 or nr == 0:
            one_sided.append(name)
            continue
        cos = (a @ r).item() / (na * nr)
        if not cos >= worst:  # NaN counts as the worst
            worst, where = cos, name
    res["min_update_cosine"], res["min_update_cosine_parameter"] = worst, where
    res["update_changed_in_one_run_only"] = one_sided
    res["update_diverged"] = not worst >= MIN_COSINE


def parity(variants: dict, dtype: str, scratch: str) -> None:
    """Loss and update checks of every variant against plain torch (a variant without either is left out)."""
    ref = variants.get("plain", {})
    ref_path = os.path.join(scratch, "plain.pt")
    ref_updates = torch.load(ref_path) if os.path.exists(ref_path) else None
    for name, res in variants.items():
        if name == "plain":
            continue
        if ref.get("losses") and res.get("losses"):
            loss_parity(res, ref["losses"], dtype)
        path = os.path.join(scratch, f"{name}.pt")
        if ref_updates is not None and os.path.exists(path):
            update_cosines(res, torch.load(path), ref_updates)


def order(names) -> list[str]:
    """Eager variants first, then the compiled ones: a budget that runs out costs the slowest."""
    return [n for n in names if n not in COMPILED] + [n for n in names if n in COMPILED]


def write_partial(data: dict, out_dir: str) -> None:
    """The results so far (json and md), rewritten after every variant; README.md is left to the final write."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, STEM + ".json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    with open(os.path.join(out_dir, STEM + ".md"), "w") as f:
        f.write(report(data))


def run_all(names, cfg: dict, a, data: dict) -> None:
    with tempfile.TemporaryDirectory() as scratch:  # the children's sampled parameter updates and inductor caches
        _run_all(names, dict(cfg, scratch=scratch), a, data)


def _run_all(names, cfg: dict, a, data: dict) -> None:
    start = time.monotonic()

    def timeout(name: str, seconds: float | None = None) -> float | None:
        t = seconds or (a.compile_timeout if name in COMPILED else a.timeout)
        if a.budget:
            left = a.budget - (time.monotonic() - start) - 5
            if left < 20:
                data["variants"][name] = {"variant": name, "error": f"skipped: --budget {a.budget:g} s spent"}
                return None
            t = min(t, left)
        print(f"{name}: running (timeout {t:.0f} s) ...", flush=True)
        return t

    def done(name: str, res: dict) -> None:
        record(data, name, res, cfg)
        write_partial(data, a.out or RESULTS)

    gated = [n for n in order(names) if n in COMPILED] if a.concurrent_compile else []
    data["concurrent_compile"] = gated
    for name in order(names):
        if name not in gated and (t := timeout(name)) is not None:
            done(name, run_variant(name, cfg, t, a.logs))
    # a gated variant's compilation has the compile timeout; its timed steps, once all have compiled, the eager one
    timeouts = {n: timeout(n) for n in gated}
    run_gated([n for n in gated if timeouts[n] is not None], cfg, timeouts, lambda n: timeout(n, a.timeout), a.logs,
              done)


def record(data: dict, name: str, res: dict, cfg: dict) -> None:
    """Files a finished variant's result, the run's device facts it reports, and the checks against plain torch."""
    data["variants"][name] = res
    for key in ("device_name", "torch", "cuda", "gpu_count", "parameters"):
        if key in res and key not in data:
            data[key] = res[key]
    try:
        parity(data["variants"], cfg["dtype"], cfg["scratch"])
    except Exception as e:  # the check is reported, never fatal to the run
        data["parity_error"] = f"{type(e).__name__}: {e}"
    print(f"{name}: " + (f"{res['median_ms']:.1f} ms/step" if "median_ms" in res else "no timing")
          + (f"; ERROR {res['error']}" if "error" in res else "") + f" ({res['wall_s']:.0f} s)", flush=True)


# -- tables ------------------------------------------------------------------------------------------------------
def _cell(text: str, n: int = 90) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= n else text[:n - 1] + "…"


def caption(data: dict) -> str:
    cfg = data["config"]
    where = (f"{data.get('device_name', 'GPU (name not reported)')}, CUDA {data.get('cuda')}"
             if data["device"] == "cuda" else "CPU (no CUDA)")
    params = f"{data['parameters']:,} parameters" if "parameters" in data else "parameters not reported"
    return (f"{where}, torch {data.get('torch', '?')}, {cfg['dtype']}. GPT {cfg['n_layer']} layers, d_model "
            f"{cfg['d_model']}, {cfg['n_head']} heads, vocabulary {cfg['vocab_size']}, {params}; batch "
            f"{cfg['batch_size']} × {cfg['block_size']} random tokens; AdamW lr {LR:g} (torch's defaults). Median of "
            f"{data['steps']} steps after {data['warm']} warm-up steps, each variant in a fresh process"
            + (f" ({', '.join(data['concurrent_compile'])} compiled at the same time, then, once all had compiled, "
               "timed one at a time: their warm-up includes that contention)"
               if data.get("concurrent_compile") else "")
            + "; `benchmarks/bench_gpu.py`.")


def rows(data: dict) -> list[list[str]]:
    V, cuda = data["variants"], data["device"] == "cuda"
    plain = V.get("plain", {}).get("tokens_per_s")
    out = []
    for name in [n for n in VARIANTS + EXTRA if n in V]:
        r = V[name]
        peak = r.get("peak_bytes")
        mem = None if peak is None else peak / (2 ** 30 if cuda else 2 ** 20)
        d, c = r.get("max_rel_loss_diff"), r.get("min_update_cosine")
        loss = "–" if d is None else f"{d:.1e}" + (" (diverges)" if r.get("loss_diverged") else "")
        cos = "–" if c is None else f"{c:.3f}" + (" (diverges)" if r.get("update_diverged") else "")
        out.append([LABELS[name], fmt(r.get("median_ms")), fmt(r.get("tokens_per_s"), 0),
                    ratio(r.get("tokens_per_s"), plain),
                    ratio(r.get("tokens_per_s"), V.get(same_mode_step(name), {}).get("tokens_per_s")),
                    fmt(r.get("gpu_busy_ms")),
                    fmt(mem, 2 if cuda else 0), fmt(r.get("warmup_s", r.get("first_step_s"))), loss, cos,
                    _cell(r.get("error", ""))])
    return out


def same_mode_step(name: str) -> str:
    """The plain compiled step a variant is compared with: the one with CUDA graphs where it has them."""
    return "compile_step_cg" if with_cuda_graphs(name) else "compile_step"


def readme_table(data: dict) -> str:
    """README.md's table from gpu.json: one row per variant."""
    unit = "GiB" if data["device"] == "cuda" else "MiB (process RSS)"
    header = ["GPT training step", "ms/step", "tokens/s", "vs plain torch", "vs compiled step (same mode)",
              "GPU kernels ms/step", f"peak memory {unit}",
              "warm-up s", "max rel. Δloss vs plain", "update cos vs plain", "error"]
    return caption(data) + "\n\n" + md_table(header, rows(data))


def report(data: dict) -> str:
    """results/gpu.md: the README table plus what it does not show (partial run, errors' tracebacks, traces)."""
    lines = ["# The GPT training step on one GPU", "", readme_table(data), ""]
    if not data.get("complete"):
        lines += ["**Partial results: the run is still going or was cut short.**", ""]
    if data.get("quick"):
        lines += ["QUICK smoke run: numbers are noise.", ""]
    lines += ["Peak memory: `torch.cuda.max_memory_allocated()` over the timed steps (peak statistics reset after the "
              "warm-up; with CUDA graphs the larger of that and the warm-up's peak, since a graph's replay allocates "
              "nothing: its memory was allocated as it was recorded); on CPU the process's peak RSS (VmHWM). \"Vs "
              "compiled step (same mode)\": against plain torch.compile of the step, with CUDA graphs for the "
              "CUDA-graph variants. Warm-up: the warm-up steps' wall time, compilation included (a whole-step function "
              "runs its first call eagerly and compiles at its second). Loss difference: the largest "
              "relative difference from plain torch's loss over all steps (bf16 losses near 10 are rounded to 2⁻⁴, "
              "≈0.6 %; more than "
              f"{DIVERGED.get(data['config']['dtype'], 1e-4):g} is marked as diverging). Update cosine: the "
              f"smallest, over parameters, cosine between the change the steps made to {SAMPLE} fixed elements of "
              "the parameter and plain torch's change (the losses barely move in so few steps, so a wrong optimizer "
              f"step shows here, not there; below {MIN_COSINE:g} is marked as diverging). Not checked: the key "
              "biases (zero gradient in exact arithmetic: their update is rounding noise) and parameters only one "
              "of the two runs changed (bf16 rounds small updates away; listed below).", ""]
    for name, r in data["variants"].items():
        extra = [f"{k} {r[k]}" for k in ("optimizer", "traces", "cudagraph_skips", "cudagraph_copied_inputs",
                                          "min_update_cosine_parameter") if k in r]
        if r.get("update_changed_in_one_run_only"):
            extra.append(f"changed in one run only: {', '.join(r['update_changed_in_one_run_only'])}")
        extra += [f"{k} {r[k]:.1f} s" for k in ("build_s", "wall_s") if k in r]
        lines.append(f"- {name}: " + ", ".join(extra))
        if "error" in r:
            lines += ["", "  ```"] + [f"  {t}" for t in r.get("traceback_tail", [])] + ["  ```", ""]
    return "\n".join(lines) + "\n"


# -- command line ------------------------------------------------------------------------------------------------
def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny GPT, 2 warm-up and 2 steps: a smoke run")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS + EXTRA)} (default: all but {EXTRA[0]})")
    p.add_argument("--warm", type=int, default=None, help="warm-up steps (default 3; --quick 2: a whole step compiles at its 2nd call)")
    p.add_argument("--steps", type=int, default=None, help="timed steps, median reported (default 10; --quick 2)")
    p.add_argument("--timeout", type=float, default=150, help="seconds per eager variant (default 150)")
    p.add_argument("--compile-timeout", type=float, default=240, help="seconds per compiled variant (default 240)")
    p.add_argument("--budget", type=float, default=0, help="seconds for the whole run: a variant's timeout is cut "
                   "to what is left, and a variant is skipped when < 20 s are (default: no limit)")
    p.add_argument("--concurrent-compile", action="store_true",
                   help="start the compiled variants together, so that they compile at the same time; each then "
                        "runs its timed steps alone (saves minutes; their first-step times include the contention)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="default: cuda if available")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--logs", default=None, help="folder for each variant's full stdout/stderr")
    p.add_argument("--profile", action="store_true", help="also profile 3 steps of each variant on the GPU: its "
                   "kernel time per step (the GPU kernels column) and its busiest ops in its log")
    output_arguments(p, STEM)
    p.add_argument("--_variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_config", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse(argv)
    if a.readme_only:
        return update_readme(STEM, readme_table, a.out)
    if a._variant:
        sys.exit(child_main(a._variant, json.loads(a._config)))
    names = [n.strip() for n in a.variants.split(",") if n.strip()]
    unknown = sorted(set(names) - set(VARIANTS + EXTRA))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS + EXTRA)}")
    device = "cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available()) else "cpu"
    dtype = a.dtype if a.dtype != "auto" else "bfloat16" if device == "cuda" else "float32"
    cfg = dict(QUICK if a.quick else FULL, device=device, dtype=dtype,
               warm=a.warm if a.warm is not None else (2 if a.quick else 3),
               steps=a.steps or (2 if a.quick else 10), threads=1 if device == "cpu" else None, profile=a.profile)
    data = {"env": environment(), "device": device, "config": cfg, "warm": cfg["warm"], "steps": cfg["steps"],
            "quick": a.quick, "complete": False, "variants": {}, "run_order": order(names)}
    t = time.time()
    run_all(names, cfg, a, data)
    data["complete"], data["elapsed_s"] = True, time.time() - t
    write_results(STEM, report(data), data, a.out, readme=readme_table)
    return data


if __name__ == "__main__":
    main()
