"""The `spmd demo` GPT training step: plain torch vs spmd (1-device mesh; 8 devices batch=4 x model=2, Megatron
layouts) vs torch DTensor tensor parallel at world size 1, in one process; memory per device and collectives.

usage: python benchmarks/bench_demo.py [--quick] [--steps N] [--reps R] [--warm W] [--no-dt] [--no-rss] [--out DIR]
       python benchmarks/bench_demo.py --readme-only   # README.md's table from results/demo.json, runs nothing

The model, data, layouts and optimiser are those of `spmd demo` (spmd/demo/train.py); see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import spmd
from benchmarks._common import (
    environment,
    fmt,
    md_table,
    output_arguments,
    peak_rss_kib,
    ratio,
    status_kib,
    torch_dist_ws1,
    update_readme,
    write_results,
)
from spmd.demo.model import GPT, GPTConfig, megatron_layouts
from spmd.demo.train import batches, load_corpus
from spmd.layout import UNSHARDED, Layout

VARIANTS = ("plain", "spmd1", "spmd8", "dt")
LABELS = {"plain": "plain torch (1 device)", "spmd1": "spmd 1-dev mesh", "spmd8": "spmd 8-dev batch=4 × model=2",
          "dt": "torch DT TP ws=1 (1-D mesh)"}
DEMO = dict(batch_size=32, block_size=32, n_layer=2, n_head=4, d_model=64, lr=3e-3)  # spmd demo's defaults
QUICK = dict(batch_size=8, block_size=8, n_layer=1, n_head=2, d_model=16, lr=3e-3)
PHASES = ("forward", "backward", "optimizer", "loss.item")


# -- building the variants ---------------------------------------------------------------------------------------
def make_config(shape: dict, vocab: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, block_size=shape["block_size"], n_layer=shape["n_layer"],
                     n_head=shape["n_head"], d_model=shape["d_model"], dropout=0.0)


def to_dt(model: GPT, n_layer: int, device_type: str = "cpu") -> GPT:
    """torch DT tensor parallel: ColwiseParallel q/k/v/fc, RowwiseParallel proj/fc2 on a 1-D mesh of the world
    (size 1 here). Embeddings, layer norms and the LM head stay plain (replicated) tensors."""
    from torch.distributed.tensor import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),), mesh_dim_names=("tp",))
    plan = {}
    for i in range(n_layer):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.fc2"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


class Variant:
    """A model, its optimiser and a `step(x, y)` that does what one step of `spmd demo` does: forward (inputs
    copied onto the mesh), backward, AdamW step, zero_grad, loss.item()."""

    def __init__(self, name: str, reference: GPT, shape: dict):
        self.name = name
        self.model = model = copy.deepcopy(reference)
        self.mesh = None
        T = shape["block_size"]
        if name == "plain":
            self.positions, self.put = torch.arange(T), (lambda t: t)
        elif name == "dt":
            self.model = model = to_dt(model, shape["n_layer"])
            self.positions, self.put = torch.arange(T), (lambda t: t)
        else:
            dims = [("batch", 1)] if name == "spmd1" else [("batch", 4), ("model", 2)]
            self.mesh = mesh = spmd.create_mesh(dims)
            spmd.distribute_module(model, mesh, spmd.LayoutMap(megatron_layouts("model" if name == "spmd8" else None)))
            data_layout = Layout(["batch", UNSHARDED], mesh)
            self.positions = spmd.copy_to_mesh(torch.arange(T), Layout([UNSHARDED], mesh))
            self.put = lambda t: spmd.copy_to_mesh(t, data_layout)
        self.opt = torch.optim.AdamW(model.parameters(), lr=shape["lr"])  # as the demo: torch's defaults
        self.losses: list[float] = []
        self.ms: list[float] = []
        self.phases: dict[str, list[float]] = {p: [] for p in PHASES}
        self.phase = None  # set while instrumented: the phase name the collective counter files calls under

    def step(self, x, y, inspect=None) -> float:
        t0 = time.perf_counter()
        self.phase = "forward"
        loss = self.model(self.put(x), self.positions, self.put(y))
        t1 = time.perf_counter()
        self.phase = "backward"
        loss.backward()
        if inspect is not None:
            inspect(self)  # gradients are alive here
        t2 = time.perf_counter()
        self.phase = "optimizer"
        self.opt.step()
        self.opt.zero_grad()
        t3 = time.perf_counter()
        self.phase = "loss.item"
        value = loss.item()
        t4 = time.perf_counter()
        self.phase = None
        for p, a, b in zip(PHASES, (t0, t1, t2, t3), (t1, t2, t3, t4)):
            self.phases[p].append((b - a) * 1e3)
        self.losses.append(value)
        return value


# -- memory ------------------------------------------------------------------------------------------------------
def per_device_bytes(t) -> int:
    """Bytes one device holds for `t`: an spmd DTensor's component, a torch DTensor's local shard, a tensor."""
    if spmd.is_dtensor(t):
        local = t._local[0]
    elif hasattr(t, "to_local") and hasattr(t, "placements"):
        local = t.to_local()
    else:
        local = t
    return local.numel() * local.element_size()


def _storage_key(t):
    base = t._local if spmd.is_dtensor(t) else (t.to_local() if hasattr(t, "placements") else t)
    try:
        return base.untyped_storage().data_ptr(), tuple(base.shape), tuple(base.stride())
    except Exception:
        return id(t)


def state_memory(v: Variant, grads_bytes: int) -> dict:
    params = list(v.model.parameters())
    state = [s for st in v.opt.state.values() for s in st.values() if isinstance(s, torch.Tensor) and s.dim() > 0]
    return {"parameters": sum(per_device_bytes(p) for p in params), "gradients": grads_bytes,
            "optimizer state": sum(per_device_bytes(s) for s in state)}


def saved_activations(v: Variant, x, y) -> int:
    """Bytes per device of the tensors autograd saves for backward in one forward (deduplicated by storage):
    the activation memory alive at the end of the forward, on top of parameters. Parameters themselves are not
    counted (they are saved for the weight gradient of every Linear but are not activations)."""
    param_keys = {_storage_key(p) for p in v.model.parameters()}
    seen, total = set(), [0]

    def pack(t):
        k = _storage_key(t)
        if k not in seen and k not in param_keys:
            seen.add(k)
            total[0] += per_device_bytes(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = v.model(v.put(x), v.positions, v.put(y))
    del loss
    return total[0]


def rss_child(variant: str, shape: dict, steps: int) -> dict:
    """Peak RSS of a fresh process that builds `variant` and trains `steps` steps (spmd 8-dev: all 8 virtual
    devices live in that one process)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_rss", variant, "--_shape", json.dumps(shape),
           "--steps", str(steps)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RSS ")]
    if not line:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]}
    return json.loads(line[-1][4:])


def _rss_main(variant: str, shape: dict, steps: int) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    data, vocab = load_corpus()
    torch.manual_seed(0)
    reference = GPT(make_config(shape, vocab))
    ctx = torch_dist_ws1() if variant == "dt" else contextlib.nullcontext()
    with ctx:
        v = Variant(variant, reference, shape)
        del reference
        before = status_kib("VmRSS")
        for x, y in batches(data, steps, shape["batch_size"], shape["block_size"], 0):
            v.step(x, y)
        peak = peak_rss_kib()
    print("RSS " + json.dumps({"peak_kib": peak, "before_steps_kib": before}))


# -- counting ops and collectives --------------------------------------------------------------------------------
class CountOps(TorchDispatchMode):
    """aten ops seen at the top of the dispatcher (for a DTensor model: the DTensor-level ops)."""

    def __init__(s):
        super().__init__()
        s.ops = collections.Counter()

    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        s.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


FAMILIES = [
    ("matmul (mm/addmm/bmm/linear)", {"mm", "addmm", "bmm", "matmul", "linear"}),
    ("attention (SDPA fwd/bwd)", None),
    ("AdamW + grad accumulation (in-place x_)", None),
    ("views (view/t/transpose/expand/detach/...)", {"view", "t", "transpose", "_unsafe_view", "reshape", "expand",
                                                   "permute", "select", "slice", "detach", "unsqueeze", "squeeze",
                                                   "as_strided", "alias", "split", "split_with_sizes", "unbind",
                                                   "_reshape_alias", "contiguous"}),
    ("copies (copy_/_to_copy/clone)", {"copy_", "_to_copy", "clone", "to", "_copy_from"}),
    ("layer norm fwd/bwd", {"native_layer_norm", "native_layer_norm_backward"}),
    ("gelu fwd/bwd", {"gelu", "gelu_backward"}),
    ("embedding fwd/bwd", {"embedding", "embedding_dense_backward"}),
    ("cross-entropy (log_softmax/nll fwd/bwd)", {"_log_softmax", "_log_softmax_backward_data", "nll_loss_forward",
                                                "nll_loss_backward", "nll_loss", "nll_loss_nd"}),
    ("reductions (sum/mean)", {"sum", "mean"}),
    ("other elementwise (add/mul/div/sqrt/...)", {"add", "mul", "div", "sqrt", "sub", "neg", "ones_like",
                                                 "zeros_like", "fill", "where", "masked_fill", "rsub", "pow"}),
    ("item (_local_scalar_dense)", {"_local_scalar_dense"}),
]


def family(op: str) -> str:
    if "scaled_dot_product" in op:
        return FAMILIES[1][0]
    for name, ops in FAMILIES:
        if ops and op in ops:
            return name
    if op.endswith("_") and not op.startswith("_"):
        return FAMILIES[2][0]
    return "other ops"


class TimeOps(TorchDispatchMode):
    """Wall time of every aten op seen at the top of the dispatcher, by op family; for a DTensor it includes
    the whole __torch_dispatch__ (sharding decision, local kernels, collectives, wrapping)."""

    def __init__(s):
        super().__init__()
        s.seconds = collections.Counter()
        s.calls = collections.Counter()

    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        t = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        f = family(func.overloadpacket.__name__)
        s.seconds[f] += time.perf_counter() - t
        s.calls[f] += 1
        return out


def time_by_family(v: Variant, chunk) -> dict:
    mode = TimeOps()
    t = time.perf_counter()
    with mode:
        for x, y in chunk:
            v.step(x, y)
    total = (time.perf_counter() - t) / len(chunk) * 1e3
    fam = {f: {"ms": sec / len(chunk) * 1e3, "calls": mode.calls[f] / len(chunk)} for f, sec in mode.seconds.items()}
    fam["outside aten ops (autograd engine, optimizer and module Python)"] = {
        "ms": total - sum(r["ms"] for r in fam.values()), "calls": 0}
    return {"total_ms": total, "families": fam}


class CountCollectives:
    """Wraps the methods of spmd's in-process collective backend: every collective spmd issues (relayouts,
    the dispatcher's implicit all-reduces and gathers, vocab-parallel rules) goes through one of them. Files
    each call under (phase, kind, mesh dims) with the bytes per device of its input."""

    KINDS = ("all_reduce", "all_gather", "shard", "all_to_all", "reduce_scatter", "assemble")

    def __init__(self, variant: Variant):
        from spmd.collectives import backend_for
        mesh = getattr(variant, "mesh", None) or spmd.create_mesh([("x", 1)])
        self.backend = backend_for(mesh)  # the in-process backend (one instance for every local mesh)
        self.variant = variant
        self.calls = collections.Counter()
        self.bytes = collections.Counter()
        self.seconds = collections.Counter()

    def __enter__(self):
        for kind in self.KINDS:
            orig = getattr(self.backend, kind)

            def wrapped(x, mesh, *args, _orig=orig, _kind=kind, **kw):
                if _kind == "all_reduce":
                    dims = tuple(args[0])
                elif _kind == "assemble":
                    dims = tuple(sorted({m for m in args[0] if m is not None}))
                else:
                    dims = (args[0],)
                key = (self.variant.phase or "other", _kind, ",".join(dims) or "-")
                self.calls[key] += 1
                self.bytes[key] += x[0].numel() * x.element_size()
                t = time.perf_counter()
                out = _orig(x, mesh, *args, **kw)
                self.seconds[key] += time.perf_counter() - t
                return out
            setattr(self.backend, kind, wrapped)
        return self

    def __exit__(self, *exc):
        for kind in self.KINDS:
            delattr(self.backend, kind)  # back to the class's method
        return False


class _GlobalOnlyTracker:
    name, is_bw, activation_checkpointing = "Global", False, False
    module_helper_dict, parent_dict = {}, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def dt_collectives(v: Variant, x, y) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode
    mode = CommDebugMode()
    # CommDebugMode's per-module tracker fails on a module called twice in one forward (the demo's Attention
    # reuses its `drop`): 'pop from empty list'. Counting needs no module attribution, so it gets a stub.
    mode.advanced_module_tracker = _GlobalOnlyTracker()
    with mode:
        v.step(x, y)
    return {str(k): n for k, n in mode.get_comm_counts().items() if n}


# -- the benchmark -----------------------------------------------------------------------------------------------
def run(shape: dict, steps: int, reps: int, warm: int, variants, rss: bool) -> dict:
    data, vocab = load_corpus()
    cfg = make_config(shape, vocab)
    torch.manual_seed(0)
    reference = GPT(cfg)
    n_batches = warm + reps * steps + 7
    all_batches = list(batches(data, n_batches, shape["batch_size"], shape["block_size"], 0))
    runs: dict[str, Variant] = {}
    errors = {}
    for name in variants:
        try:
            v = Variant(name, reference, shape)
            for x, y in all_batches[:warm]:
                v.step(x, y)
            runs[name] = v
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
    for r in range(reps):  # round-robin: every variant sees the same machine state and the same batches
        chunk = all_batches[warm + r * steps: warm + (r + 1) * steps]
        for v in runs.values():
            t = time.perf_counter()
            for x, y in chunk:
                v.step(x, y)
            v.ms.append((time.perf_counter() - t) / steps * 1e3)
    import inspect

    from spmd.demo import model as demo_model
    src = inspect.getsource(demo_model.Attention.forward)
    attention = "`F.scaled_dot_product_attention`" if "scaled_dot_product_attention" in src else "explicit softmax(QKᵀ)V"
    out = {"config": dict(shape, vocab_size=vocab, parameters=sum(p.numel() for p in reference.parameters()),
                          attention=attention),
           "variants": {}, "errors": errors}
    extra = all_batches[warm + reps * steps:]
    for name, v in runs.items():
        res = {"ms": v.ms, "median_ms": statistics.median(v.ms), "losses": list(v.losses),
               "phases_median_ms": {p: statistics.median(ts) for p, ts in v.phases.items()}}
        # memory: gradients counted while alive (after backward), activations saved for backward
        grads = {}
        v.step(*extra[0], inspect=lambda vv: grads.setdefault("b", sum(
            per_device_bytes(p.grad) for p in vv.model.parameters() if p.grad is not None)))
        res["memory"] = state_memory(v, grads.get("b", 0))
        try:
            res["memory"]["activations saved for backward"] = saved_activations(v, *extra[1])
        except Exception as e:
            res["memory_error"] = f"{type(e).__name__}: {e}"
        # aten ops per step (top of the dispatcher), collectives per step
        c = CountOps()
        if name == "spmd8":
            with CountCollectives(v) as cc, c:
                v.step(*extra[2])
            res["collectives"] = [{"phase": k[0], "kind": k[1], "mesh_dims": k[2], "calls": n,
                                   "bytes_per_device": cc.bytes[k], "ms": cc.seconds[k] * 1e3}
                                  for k, n in sorted(cc.calls.items())]
        elif name == "dt":
            try:
                res["collectives"] = dt_collectives(v, *extra[2])
            except Exception as e:  # CommDebugMode's module tracker is fragile across torch versions
                res["collectives_error"] = f"{type(e).__name__}: {str(e)[:160]}"
            with c:
                v.step(*extra[3])
        else:
            with c:
                v.step(*extra[2])
        res["by_family"] = time_by_family(v, extra[4:7])
        res["aten_ops"] = sum(c.ops.values())
        res["aten_op_counts"] = dict(c.ops.most_common())
        out["variants"][name] = res
    ref = out["variants"].get("plain", {}).get("losses")
    for name, res in out["variants"].items():
        if ref is not None and name != "plain":
            n = min(len(ref), len(res["losses"]))
            res["max_rel_loss_diff"] = max(abs(a - b) / max(abs(b), 1e-12)
                                           for a, b in zip(res["losses"][:n], ref[:n]))
            res["loss_steps_compared"] = n
    if rss:
        for name in variants:
            out["variants"].setdefault(name, {})["rss"] = rss_child(name, shape, warm + 2)
    return out


def kib(b) -> str:
    return "–" if b is None else f"{b / 1024:,.1f}"


def caption(data: dict) -> str:
    cfg = data["config"]
    return (f"{data['env']}. GPT {cfg['n_layer']} layers, d_model {cfg['d_model']}, {cfg['n_head']} heads, vocabulary "
            f"{cfg['vocab_size']}, {cfg['parameters']:,} parameters; batch {cfg['batch_size']} × {cfg['block_size']} "
            f"tokens; attention {cfg.get('attention', '?')}; AdamW lr {cfg['lr']} (torch defaults, as the demo). "
            f"Medians of {data['reps']} repetitions × {data['steps']} steps after {data['warm']} warm-up steps, "
            "variants timed round-robin on the same batches.")


def readme_table(data: dict) -> str:
    """README.md's table from demo.json: ms per step of every variant, against plain torch and torch DT."""
    m = {n: data["variants"][n]["median_ms"] for n in VARIANTS if "median_ms" in data["variants"].get(n, {})}
    rows = [[LABELS[n], fmt(t), ratio(t, m.get("plain")), ratio(t, m.get("dt"))] for n, t in m.items()]
    hdr = ["demo GPT training step", "ms/step", "× plain torch", "× torch DT"]
    return caption(data) + "\n\n" + md_table(hdr, rows)


def report(data: dict, elapsed) -> str:
    V = data["variants"]
    names = [n for n in VARIANTS if n in V and "median_ms" in V[n]]
    m = {n: V[n]["median_ms"] for n in names}
    hdr = ["variant", "ms/step (median)", "× plain", "× torch DT", "forward", "backward", "optimizer",
           "loss.item", "aten ops/step", "max rel. Δloss vs plain"]
    rows = []
    for n in names:
        ph = V[n]["phases_median_ms"]
        rows.append([LABELS[n], fmt(m[n], 1), ratio(m[n], m.get("plain")), ratio(m[n], m.get("dt"))]
                    + [fmt(ph[p], 1) for p in PHASES] + [V[n]["aten_ops"],
                    "–" if n == "plain" else f"{V[n]['max_rel_loss_diff']:.1e}"])
    mem_hdr = ["variant", "parameters KiB/dev", "gradients KiB/dev", "AdamW state KiB/dev", "params+grads+state",
               "activations saved for bwd KiB/dev", "process peak RSS MiB", "RSS growth during steps MiB"]
    mem_rows = []
    for n in names:
        mem = V[n].get("memory", {})
        pgs = sum(mem.get(k, 0) for k in ("parameters", "gradients", "optimizer state"))
        r = V[n].get("rss", {})
        mem_rows.append([LABELS[n], kib(mem.get("parameters")), kib(mem.get("gradients")),
                         kib(mem.get("optimizer state")), kib(pgs), kib(mem.get("activations saved for backward")),
                         fmt(r["peak_kib"] / 1024, 0) if "peak_kib" in r else "–",
                         fmt((r["peak_kib"] - r["before_steps_kib"]) / 1024, 0) if r.get("before_steps_kib") else "–"])
    lines = [
        "# `spmd demo` GPT training step", "",
        f"{caption(data)} Run time {elapsed:.0f} s"
        + (" — QUICK smoke run, numbers are noise." if data["quick"] else "."), "",
        "A step is what `spmd demo` does per step: forward (spmd: inputs `copy_to_mesh`'d onto the data layout), "
        "backward, `opt.step()`, `opt.zero_grad()`, `loss.item()`. Phase columns are medians of the per-step "
        "phase times (ms). torch DT: `parallelize_module` with ColwiseParallel q/k/v/fc and RowwiseParallel "
        "proj/fc2 on a **world-size-1** gloo group and a 1-D mesh — torch DTensor cannot simulate 8 devices in "
        "one process, so its row is the DTensor overhead with no sharding at all; embeddings, layer norms and the "
        "LM head stay plain tensors there (spmd 8-dev also shards the token embedding and the LM head over "
        "'model', vocabulary-parallel). aten ops/step: ops seen by a `TorchDispatchMode` at the top of the "
        "dispatcher (for the DTensor variants, the DTensor-level ops, not the local kernels).", "",
        md_table(hdr, rows), "",
        "## Memory per device", "",
        "Parameters, gradients (measured after `backward`, while alive) and AdamW state (`exp_avg`, "
        "`exp_avg_sq`): bytes of one device's component (spmd), local shard (torch DT) or tensor (plain). "
        "Activations: tensors autograd saves for backward in one forward, deduplicated by storage, parameters "
        "excluded — what is alive at the end of the forward besides the model state. Peak RSS: a fresh "
        f"subprocess per variant that builds the model and trains {data['warm'] + 2} steps (VmHWM of "
        "/proc/self/status); it is the whole process (Python, torch, the corpus), and for spmd 8-dev all 8 "
        "virtual devices together; growth = peak − RSS after building the model, before the first step.", "",
        md_table(mem_hdr, mem_rows), ""]
    if "spmd8" in V and "collectives" in V["spmd8"]:
        cols = V["spmd8"]["collectives"]
        by_kind = collections.Counter()
        for c in cols:
            if c["phase"] != "loss.item":
                by_kind[(c["kind"], c["mesh_dims"])] += c["calls"]
        lines += ["## Collectives per step", "",
                  "spmd 8-dev (batch=4 × model=2): calls of spmd's in-process collective backend "
                  "(`spmd.collectives.InProcessCollectives`; every relayout, implicit all-reduce/all-gather of "
                  "the dispatcher and the vocabulary-parallel rules go through it), per phase, kind and mesh "
                  "dimension; bytes = one device's input component. `assemble` (to-global, for `loss.item()`) "
                  "is not a collective of a real multi-device run's training step but a read-back.", "",
                  md_table(["phase", "kind", "mesh dims", "calls", "KiB per device (sum)", "ms (in-process)"],
                           [[c["phase"], c["kind"], c["mesh_dims"], c["calls"], kib(c["bytes_per_device"]),
                             fmt(c["ms"], 2)] for c in cols]), "",
                  "Totals per step (excluding loss.item): " + ", ".join(
                      f"{k[0]}[{k[1]}] × {n}" for k, n in sorted(by_kind.items())) + ".", ""]
    if "dt" in V and "collectives" in V["dt"]:
        dtc = V["dt"]["collectives"]
        lines += [f"torch DT TP ws=1, `CommDebugMode` over one step: {dtc if dtc else 'no collectives'}"
                  " (at world size 1 nothing needs communicating; at ws=2 the peers' MLP issues one all-reduce "
                  "per RowwiseParallel output forward and one per ColwiseParallel input gradient backward).", ""]
    fam_names = [n for n in names if "by_family" in V[n]]
    if fam_names:
        keys = sorted({f for n in fam_names for f in V[n]["by_family"]["families"]},
                      key=lambda f: -max(V[n]["by_family"]["families"].get(f, {}).get("ms", 0) for n in fam_names))
        def cell(n, f):
            r = V[n]["by_family"]["families"].get(f)
            if r is None:
                return "–"
            return f"{r['ms']:.1f}" + (f" ({r['calls']:.0f})" if r["calls"] else "")
        lines += ["## Where the time goes", "",
                  "ms per step by aten op family (calls per step in brackets), timed by a `TorchDispatchMode` "
                  "around every op at the top of the dispatcher over 3 steps — for a DTensor the whole "
                  "`__torch_dispatch__`: sharding decision, local kernels, collectives, wrapping. The mode adds "
                  "a few µs per op to every column, so totals exceed the table above.", "",
                  md_table(["op family"] + [LABELS[n] for n in fam_names],
                           [[f] + [cell(n, f) for n in fam_names] for f in keys]
                           + [["total"] + [f"{V[n]['by_family']['total_ms']:.1f}" for n in fam_names]]), ""]
    lines += ["## Loss check", ""]
    for n in names:
        if n != "plain":
            lines.append(f"- {LABELS[n]}: {V[n]['loss_steps_compared']} steps, final loss {V[n]['losses'][-1]:.6f} "
                         f"(plain {V['plain']['losses'][-1]:.6f}), max relative difference "
                         f"{V[n]['max_rel_loss_diff']:.2e} — {'OK' if V[n]['max_rel_loss_diff'] <= 1e-5 else 'FAIL'} "
                         "(tolerance 1e-5)")
    if "plain" in V:
        top = list(V["plain"]["aten_op_counts"].items())[:12]
        lines += ["", "aten ops per plain step, most frequent: " + ", ".join(f"{k} {n}" for k, n in top) + "."]
    errs = dict(data["errors"])
    for n, r in V.items():
        if "error" in r.get("rss", {}):
            errs[n + " (rss)"] = r["rss"]["error"]
        if "collectives_error" in r:
            errs[n + " (CommDebugMode)"] = r["collectives_error"]
        if "memory_error" in r:
            errs[n + " (memory)"] = r["memory_error"]
    if errs:
        lines += ["", "## Failures", ""] + [f"- {k}: {e}" for k, e in errs.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny GPT and few steps: a smoke run")
    p.add_argument("--steps", type=int, default=None, help="steps per timing repetition (default 5)")
    p.add_argument("--reps", type=int, default=None, help="repetitions, median reported (default 5)")
    p.add_argument("--warm", type=int, default=None, help="warm-up steps (default 3)")
    p.add_argument("--no-dt", action="store_true", help="skip torch.distributed.tensor")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    output_arguments(p, "demo")
    p.add_argument("--_rss", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_shape", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.readme_only:
        return update_readme("demo", readme_table, a.out)
    if a._rss:
        _rss_main(a._rss, json.loads(a._shape), a.steps)
        return {}
    shape = QUICK if a.quick else DEMO
    steps = a.steps or (1 if a.quick else 5)
    reps = a.reps or (2 if a.quick else 5)
    warm = a.warm or (1 if a.quick else 3)
    variants = tuple(v for v in VARIANTS if not (a.no_dt and v == "dt"))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)
    t0 = time.time()
    with torch_dist_ws1() if "dt" in variants else contextlib.nullcontext():
        out = run(shape, steps, reps, warm, variants, rss=not a.no_rss)
    elapsed = time.time() - t0
    data = {"env": environment(), "steps": steps, "reps": reps, "warm": warm, "quick": a.quick, **out}
    write_results("demo", report(data, elapsed), data, a.out, readme=readme_table)
    return data


if __name__ == "__main__":
    main()
