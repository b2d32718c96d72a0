"""Function mode: training steps compiled with `spmd.function` vs plain torch eager and `torch.compile`, and
spmd eager, in one process; plus compile times.

Models: the residual MLP of issue #9's CPU target (D=64 H=256 L=4 B=32, GELU blocks, SGD) and the demo GPT
(AdamW). spmd runs on a 1-device mesh and on 8 virtual devices (batch 4 × model 2, Megatron layouts), eagerly,
under `spmd.function` (torch.compile's graphs between backward() and the optimizer) and under
`spmd.function(whole_step=True)` (forward, backward and update one graph). Every variant's losses are checked
against plain torch's.

usage: python benchmarks/bench_function.py [--quick] [--steps N] [--reps R] [--out DIR]
       python benchmarks/bench_function.py --readme-only   # README.md's table from results/function.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import tempfile
import time
import types

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from benchmarks._common import environment, fmt, md_table, output_arguments, ratio, update_readme, write_results
from spmd import UNSHARDED, Layout
from spmd.demo.model import GPT, GPTConfig, megatron_layouts

VARIANTS = ("plain", "plain_compiled", "spmd1", "spmd1_function", "spmd1_whole", "spmd8", "spmd8_function",
            "spmd8_whole")
LABELS = {"plain": "plain torch", "plain_compiled": "plain torch.compile", "spmd1": "spmd eager, 1 device",
          "spmd1_function": "spmd.function, 1 device", "spmd1_whole": "spmd.function whole step, 1 device",
          "spmd8": "spmd eager, 8 devices", "spmd8_function": "spmd.function, 8 devices",
          "spmd8_whole": "spmd.function whole step, 8 devices"}
COMPILED = ("plain_compiled", "spmd1_function", "spmd1_whole", "spmd8_function", "spmd8_whole")


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return x + self.w2(F.gelu(self.w1(x)))


class MLP(nn.Module):
    def __init__(self, d, h, n):
        super().__init__()
        self.layers = nn.Sequential(*(Block(d, h) for _ in range(n)))

    def forward(self, x, y):
        return F.mse_loss(self.layers(x), y)


def mlp_case(quick: bool):
    d, h, n, b = (16, 32, 2, 8) if quick else (64, 256, 4, 32)
    torch.manual_seed(0)
    model = MLP(d, h, n)
    data = [(torch.randn(b, d), torch.randn(b, d)) for _ in range(4)]
    megatron = {r"w1\.weight$": ["model", UNSHARDED], r"w1\.bias$": ["model"], r"w2\.weight$": [UNSHARDED, "model"]}
    return f"residual MLP D={d} H={h} L={n} B={b}, SGD", model, data, megatron, \
        lambda params: torch.optim.SGD(params, lr=0.01)


def gpt_case(quick: bool):
    cfg = GPTConfig(n_layer=1, d_model=32, block_size=8) if quick else GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg)
    b = 8 if quick else 32
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=g),
             torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=g)) for _ in range(4)]
    positions = torch.arange(cfg.block_size)

    class WithPositions(nn.Module):  # the demo GPT takes positions as a third input
        def __init__(self, gpt):
            super().__init__()
            self.gpt = gpt

        def forward(self, x, y):
            return self.gpt(x, self.positions, y)

    wrapped = WithPositions(model)
    wrapped.positions = positions
    # the wrapper's names start with "gpt.": a pattern anchored at the start must say so
    layouts = {(r"^gpt\." + k[1:] if k.startswith("^") else k): v for k, v in megatron_layouts().items()}
    return f"demo GPT ({sum(p.numel() for p in model.parameters()) // 1000}k params), batch {b}×{cfg.block_size}, " \
           "AdamW", wrapped, data, layouts, lambda params: torch.optim.AdamW(params, lr=3e-3)


def make_step(model, opt):
    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    # a code object of its own: Dynamo keeps its compiled code (and the resume functions after backward() and the
    # optimizer's step) per code object, and the variants timed in turn must not walk each other's entries
    return types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__, None, step.__closure__)


def build(variant: str, case):
    """(step function, batches) of one variant; the model is a fresh copy of the case's."""
    _, base, data, megatron, optimizer = case
    model = copy.deepcopy(base)
    if variant.startswith("plain"):
        step = make_step(model, optimizer(model.parameters()))
        return (torch.compile(step) if variant == "plain_compiled" else step), data
    mesh = spmd.create_mesh([("batch", 1)] if variant.startswith("spmd1") else [("batch", 4), ("model", 2)])
    layouts = {} if variant.startswith("spmd1") else {k: Layout(v, mesh) for k, v in megatron.items()}
    spmd.distribute_module(model, mesh, spmd.LayoutMap(layouts))
    if hasattr(model, "positions"):
        model.positions = spmd.copy_to_mesh(model.positions, Layout([UNSHARDED], mesh))
    step = make_step(model, optimizer(model.parameters()))
    if variant.endswith("function"):
        step = spmd.function(step, fullgraph=False)
    elif variant.endswith("whole"):
        step = spmd.function(step, whole_step=True)
    layout = Layout(["batch"] + [UNSHARDED] * (data[0][0].dim() - 1), mesh)
    return step, [(spmd.copy_to_mesh(x, layout), spmd.copy_to_mesh(y, layout)) for x, y in data]


@contextlib.contextmanager
def cold_inductor_cache():
    """Inductor's caches empty and on disk in a temporary directory: each variant's first call compiles from
    nothing, whatever ran before it in this process or on this machine (kernels compiled earlier would otherwise be
    reused and its compile time would depend on the order of the variants and on earlier runs)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    except ImportError:  # (an older torch: its caches stay as they are)
        yield
        return
    with tempfile.TemporaryDirectory(prefix="spmd-bench-inductor-") as directory, temporary_cache_dir(directory):
        yield


def loss_value(loss) -> float:
    return spmd.to_global(loss).item() if spmd.is_dtensor(loss) else loss.item()


def measure(case, steps: int, reps: int) -> dict:
    """Each variant's first call (compile time) and losses, then its step time: the variants timed in turn, one
    repetition each per round, so that the machine's drift reaches all of them alike."""
    out, built = {}, {}
    with cold_inductor_cache():  # inductor's one-time start (imports, compile workers), which the first variant
        # would otherwise pay
        torch.compile(lambda x: (x * 2).sin())(torch.randn(4))
    for variant in VARIANTS:
        step, data = build(variant, case)
        with cold_inductor_cache():
            start = time.perf_counter()
            # compiles the compiled variants (a whole step on its second call: the first runs eagerly)
            losses = [loss_value(step(*data[i])) for i in range(2 if variant.endswith("whole") else 1)]
            compile_s = time.perf_counter() - start
        losses += [loss_value(step(*data[i % len(data)])) for i in range(len(losses), 4)]
        built[variant] = step, data
        out[variant] = {"runs": [], "first_call_s": compile_s, "losses": losses}
    for _ in range(reps):
        for variant, (step, data) in built.items():
            t = time.perf_counter()
            for i in range(steps):
                step(*data[i % len(data)])
            if spmd.is_dtensor(data[0][0]):
                spmd.to_global(data[0][0])  # nothing is asynchronous on CPU; kept symmetric for GPUs
            out[variant]["runs"].append((time.perf_counter() - t) / steps * 1e3)
    ref = out["plain"]["losses"]
    for v in VARIANTS:
        out[v]["ms"] = statistics.median(out[v]["runs"])
        out[v]["max_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(out[v]["losses"], ref))
    return out


def caption(data: dict) -> str:
    return (f"{data['environment']}; median of {data['reps']} repetitions of {data['steps']} steps; "
            "variants timed in turn; each variant's first call compiles with inductor's caches empty; "
            "`benchmarks/bench_function.py`.")


def readme_table(data: dict) -> str:
    header = ["training step", "plain torch, ms", "plain torch.compile"] + \
             [LABELS[v] for v in VARIANTS[2:]]
    rows, compile_rows = [], []
    for name, res in data["cases"].items():
        plain = res["plain"]["ms"]
        rows.append([name, fmt(plain, 2)] + [f"{fmt(res[v]['ms'], 2)} ({ratio(res[v]['ms'], plain)})"
                                             for v in VARIANTS[1:]])
        compile_rows.append([name] + [fmt(res[v]["first_call_s"], 1) for v in COMPILED]
                            + [ratio(res["spmd1_function"]["first_call_s"], res["plain_compiled"]["first_call_s"])])
    worst = max(res[v]["max_loss_rel_diff"] for res in data["cases"].values() for v in VARIANTS)
    return "\n\n".join([
        caption(data),
        md_table(header, rows),
        "First call (trace + compile; a whole step's first two calls, the first eager), seconds:",
        md_table(["model"] + [LABELS[v] for v in COMPILED] + ["spmd.function 1 device / plain"], compile_rows),
        f"Every variant's losses equal plain torch's (largest relative difference {worst:.1e})."])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny models and few steps: a smoke run")
    p.add_argument("--steps", type=int, default=None, help="steps per timing repetition (default 20)")
    p.add_argument("--reps", type=int, default=None, help="repetitions, median reported (default 9)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    output_arguments(p, "function")
    a = p.parse_args(argv)
    if a.readme_only:
        return update_readme("function", readme_table, a.out)
    torch.set_num_threads(a.threads)
    steps = a.steps or (2 if a.quick else 20)
    reps = a.reps or (1 if a.quick else 9)
    cases = {}
    for make in (mlp_case, gpt_case):
        case = make(a.quick)
        print(f"measuring {case[0]} ...", flush=True)
        cases[case[0]] = measure(case, steps, reps)
    data = {"environment": environment(), "steps": steps, "reps": reps, "quick": a.quick, "cases": cases}
    write_results("function", readme_table(data), data, a.out, readme=readme_table)
    return data


if __name__ == "__main__":
    main()
