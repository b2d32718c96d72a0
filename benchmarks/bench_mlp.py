"""Residual-MLP training step: plain torch vs spmd (1-device mesh; 8 devices batch=4 x model=2, Megatron layouts)
vs torch DTensor tensor parallel at world size 1, in one process.

usage: python benchmarks/bench_mlp.py [--quick] [--steps N] [--reps R] [--configs D,H,L,B ...] [--out DIR]
       python benchmarks/bench_mlp.py --readme-only   # README.md's table from results/mlp.json, runs nothing

The model, data and optimisers follow the peers' MLP benchmark; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
import warnings

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import spmd
from benchmarks._common import (
    environment, fmt, md_table, output_arguments, ratio, torch_dist_ws1, update_readme, write_results)
from spmd import UNSHARDED, Layout

CONFIGS = [(64, 256, 4, 32), (256, 1024, 4, 32)]
QUICK_CONFIGS = [(16, 32, 2, 8)]
OPTIMIZERS = ("sgd", "adamw")
VARIANTS = ("plain", "spmd1", "spmd8", "dt")
LABELS = {"plain": "plain torch", "spmd1": "spmd 1-dev", "spmd8": "spmd 8-dev (batch 4 × model 2)",
          "dt": "torch DT TP ws=1"}


class Block(nn.Module):
    def __init__(s, d, h):
        super().__init__()
        s.w1 = nn.Linear(d, h)
        s.w2 = nn.Linear(h, d)

    def forward(s, x):
        return x + s.w2(F.relu(s.w1(x)))


class Net(nn.Module):
    def __init__(s, d, h, L):
        super().__init__()
        s.layers = nn.ModuleList([Block(d, h) for _ in range(L)])

    def forward(s, x):
        for layer in s.layers:
            x = layer(x)
        return x


class CountOps(TorchDispatchMode):
    def __init__(s):
        super().__init__()
        s.n = 0

    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        s.n += 1
        return func(*args, **(kwargs or {}))


def make_opt(name, params, foreach: bool | None = False):
    """`foreach=None` is torch.optim's default path (on CPU the for-loop, which spmd runs on the stacks)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=foreach)
    return torch.optim.AdamW(params, lr=1e-3, foreach=foreach)


def to_spmd(net: Net, mesh, model_dim: str | None) -> Net:
    """Replaces every parameter by a DVariable. With `model_dim`, Megatron layouts: w1 (H, D) sharded on its
    output features, its bias too; w2 (D, H) sharded on its input features, its bias replicated."""
    m = model_dim or UNSHARDED
    for blk in net.layers:
        blk.w1.weight = spmd.DVariable(blk.w1.weight.detach(), layout=Layout([m, UNSHARDED], mesh))
        blk.w1.bias = spmd.DVariable(blk.w1.bias.detach(), layout=Layout([m], mesh))
        blk.w2.weight = spmd.DVariable(blk.w2.weight.detach(), layout=Layout([UNSHARDED, m], mesh))
        blk.w2.bias = spmd.DVariable(blk.w2.bias.detach(), layout=Layout([UNSHARDED], mesh))
    return net


def to_dt(net: Net, L: int) -> Net:
    from torch.distributed.tensor import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    plan = {}
    for i in range(L):
        plan[f"layers.{i}.w1"] = ColwiseParallel()
        plan[f"layers.{i}.w2"] = RowwiseParallel()
    return parallelize_module(net, mesh, plan)


def loss_value(loss) -> float:
    loss = loss.detach()
    if isinstance(loss, spmd.DTensor):
        return float(spmd.to_global(loss))
    if hasattr(loss, "full_tensor"):
        return float(loss.full_tensor())
    return float(loss)


def build(variant: str, base: Net, x, y, d, h, L):
    """(model, x, y) for a variant; every variant starts from a deep copy of the same initial weights."""
    net = copy.deepcopy(base)
    if variant == "plain":
        return net, x, y
    if variant == "dt":
        return to_dt(net, L), x, y
    if variant == "spmd1":
        mesh = spmd.create_mesh([("x", 1)])
        rep = Layout([UNSHARDED, UNSHARDED], mesh)
        return to_spmd(net, mesh, None), spmd.copy_to_mesh(x, rep), spmd.copy_to_mesh(y, rep)
    mesh = spmd.create_mesh([("batch", 4), ("model", 2)])
    data = Layout(["batch", UNSHARDED], mesh)
    return to_spmd(net, mesh, "model"), spmd.copy_to_mesh(x, data), spmd.copy_to_mesh(y, data)


def _noncontiguous_grads(model) -> str:
    """How many parameters have a gradient whose storage is not contiguous (for a DTensor: its stacked
    components). torch.optim's per-parameter update on a transposed gradient is a slow strided kernel."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    def storage(g):
        if isinstance(g, spmd.DTensor):
            return g._local
        return g.to_local() if hasattr(g, "to_local") else g  # torch DTensor: the local shard
    bad = [g for g in grads if not storage(g).is_contiguous()]
    return f"{len(bad)}/{len(grads)}"


def run_config(d, h, L, B, steps, reps, warm, variants) -> dict:
    torch.manual_seed(0)
    x, y = torch.randn(B, d), torch.randn(B, d)
    torch.manual_seed(1)
    base = Net(d, h, L)
    out = {}
    for optname in OPTIMIZERS:
        runs = {}
        for v in variants:
            try:
                model, xx, yy = build(v, base, x, y, d, h, L)
                opt = make_opt(optname, model.parameters())

                def step(model=model, opt=opt, xx=xx, yy=yy):
                    opt.zero_grad(set_to_none=True)
                    loss = F.mse_loss(model(xx), yy)
                    loss.backward()
                    opt.step()
                    return loss

                losses = [loss_value(step()) for _ in range(warm)]
                runs[v] = {"step": step, "losses": losses, "ms": [],
                           "noncontiguous_grads": _noncontiguous_grads(model)}
            except Exception as e:
                runs[v] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        live = [v for v in variants if "step" in runs[v]]
        for _ in range(reps):  # round-robin, so every variant sees the same machine state
            for v in live:
                step = runs[v]["step"]
                t = time.perf_counter()
                for _ in range(steps):
                    loss = step()
                runs[v]["ms"].append((time.perf_counter() - t) / steps * 1e3)
                runs[v]["losses"].append(loss_value(loss))
        if "plain" in live:
            c = CountOps()
            with c:
                runs["plain"]["step"]()
            runs["plain"]["aten_ops"] = c.n
        for v in live:
            r = runs[v]
            r.pop("step")
            r["median_ms"] = statistics.median(r["ms"])
        ref = runs.get("plain", {}).get("losses")
        for v in live:
            if ref is not None:
                la = runs[v]["losses"]
                runs[v]["max_loss_diff"] = max(abs(p - q) for p, q in zip(la, ref))
                runs[v]["loss_equal"] = la == ref
        out[optname] = runs
    return out


def caption(data: dict) -> str:
    return (f"{data['env']}. Medians of {data['reps']} repetitions × {data['steps']} steps after {data['warm']} "
            "warm-up steps; variants timed round-robin.")


def readme_table(data: dict) -> str:
    """README.md's table from mlp.json: ms/step of every variant per config and optimizer."""
    rows = []
    for cfg, per_opt in data["results"].items():
        d, h, L, b = cfg.split(",")
        for optname, runs in per_opt.items():
            m = {v: runs.get(v, {}).get("median_ms") for v in VARIANTS}
            rows.append([f"D={d} H={h} L={L} B={b}", optname] + [fmt(m[v]) for v in VARIANTS]
                        + [ratio(m["spmd1"], m["dt"])])
    hdr = ["residual MLP, ms/step", "optimizer"] + [LABELS[v] for v in VARIANTS] + ["spmd 1-dev / torch DT"]
    return caption(data) + "\n\n" + md_table(hdr, rows)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model and few steps: a smoke run")
    p.add_argument("--steps", type=int, default=None, help="steps per timing repetition (default 10)")
    p.add_argument("--reps", type=int, default=None, help="repetitions, median reported (default 5)")
    p.add_argument("--warm", type=int, default=None, help="warm-up steps (default 3)")
    p.add_argument("--configs", nargs="*", default=None, help="D,H,L,B (default 64,256,4,32 256,1024,4,32)")
    p.add_argument("--no-dt", action="store_true", help="skip torch.distributed.tensor")
    output_arguments(p, "mlp")
    a = p.parse_args(argv)
    if a.readme_only:
        return update_readme("mlp", readme_table, a.out)
    configs = ([tuple(int(v) for v in c.split(",")) for c in a.configs] if a.configs
               else QUICK_CONFIGS if a.quick else CONFIGS)
    steps = a.steps or (2 if a.quick else 10)
    reps = a.reps or (3 if a.quick else 5)
    warm = a.warm or (2 if a.quick else 3)
    variants = tuple(v for v in VARIANTS if not (a.no_dt and v == "dt"))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)
    t0 = time.time()
    results = {}
    with torch_dist_ws1() if not a.no_dt else contextlib.nullcontext():
        for cfg in configs:
            results[cfg] = run_config(*cfg, steps, reps, warm, variants)
    elapsed = time.time() - t0

    hdr = ["config", "optimizer", "aten ops/step (plain)"] + [LABELS[v] + " ms" for v in variants] + [
        "spmd1/torch", "spmd8/torch", "DT/torch", "spmd1/DT", "spmd8/DT", "spmd1 µs/op over plain",
        "DT µs/op over plain"]
    rows, checks, errors, diags = [], [], [], []
    for cfg, per_opt in results.items():
        for optname, runs in per_opt.items():
            m = {v: runs[v].get("median_ms") for v in variants}
            nops = runs.get("plain", {}).get("aten_ops")

            def per_op(v):
                if m.get(v) is None or m.get("plain") is None or not nops:
                    return "–"
                return f"{(m[v] - m['plain']) / nops * 1e3:.1f}"
            rows.append([f"D={cfg[0]} H={cfg[1]} L={cfg[2]} B={cfg[3]}", optname, nops or "–"]
                        + [fmt(m[v], 2) for v in variants]
                        + [ratio(m.get("spmd1"), m.get("plain")), ratio(m.get("spmd8"), m.get("plain")),
                           ratio(m.get("dt"), m.get("plain")), ratio(m.get("spmd1"), m.get("dt")),
                           ratio(m.get("spmd8"), m.get("dt")), per_op("spmd1"), per_op("dt")])
            for v in variants:
                r = runs[v]
                if "error" in r:
                    errors.append(f"- D={cfg[0]} {optname} {LABELS[v]}: {r['error']}")
                else:
                    diags.append(f"- D={cfg[0]} H={cfg[1]} {optname} {LABELS[v]}: parameters with a non-contiguous "
                                 f"gradient (local storage) after a step: {r['noncontiguous_grads']}")
                if v != "plain" and "max_loss_diff" in r:
                    checks.append(f"- D={cfg[0]} H={cfg[1]} {optname} {LABELS[v]}: loss after {len(r['losses'])} "
                                  f"steps {r['losses'][-1]:.6f} (plain {runs['plain']['losses'][-1]:.6f}); "
                                  f"bitwise equal to plain at every step: {r['loss_equal']}; max |Δloss| "
                                  f"{r['max_loss_diff']:.2e}")
    table = md_table(hdr, rows)
    data = {"env": environment(), "steps": steps, "reps": reps, "warm": warm, "quick": a.quick,
            "results": {",".join(map(str, c)): v for c, v in results.items()}, "errors": errors}
    md = "\n".join([
        "# Residual-MLP training step (ms/step)", "",
        f"{caption(data)} Run time {elapsed:.0f} s" + (" — QUICK smoke run, numbers are noise." if a.quick else "."),
        "",
        "Model: L blocks `x + Linear(H→D)(relu(Linear(D→H)(x)))`, MSE loss, SGD / AdamW (lr 1e-3, foreach=False). "
        "spmd 1-dev: every parameter a replicated `DVariable` on `create_mesh([('x',1)])`; spmd 8-dev: mesh "
        "batch=4 × model=2, data sharded on batch, w1 weight/bias sharded on output features over 'model', w2 "
        "weight on input features. torch DT: `parallelize_module` with ColwiseParallel (w1) / RowwiseParallel "
        "(w2) on a 1-rank gloo group. µs/op over plain = (t − t_plain) / aten ops per plain step.", "",
        table, "", "## Loss check (same initial weights and data, same number of steps)", "", *checks, "",
        "## Gradient memory layout", "", *diags, ""])
    if errors:
        md += "\n## Failures\n\n" + "\n".join(errors) + "\n"
    write_results("mlp", md, data, a.out, readme=readme_table)
    return data


if __name__ == "__main__":
    main()
