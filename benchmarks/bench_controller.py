"""Single-controller mode (2 workers x 2 CPU devices, gloo between the workers, 1 torch thread) on each engine.

- cold start: `Controller(...)` until the workers have joined each other and answered;
- a tiny op (`x + 1.0` on a 4-element DTensor): waited (the op, then a round trip to every worker) and pipelined
  (many ops sent without waiting, divided by their number);
- host -> workers: `copy_to_mesh` of a 64 MiB fp32 tensor sharded on batch (each worker gets its half, once per device), until the workers hold it;
- a training step of a 2-layer MLP (D=256, H=1024, global batch 64, mesh batch=2 x model=2, Adam): controller
  eager (steps sent without waiting, one read at the end) and under `spmd.function` (traced on the controller,
  compiled by the workers; inductor, aot_eager with --quick), vs the same step, eager and under `spmd.function`,
  in multi-client mode (2 processes).

usage: python benchmarks/bench_controller.py [--quick] [--engines monarch ray] [--out DIR]
       python benchmarks/bench_controller.py --readme-only   # README.md's table from results/controller.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from torch import nn

import spmd
from benchmarks._common import (
    environment, fmt, free_port, md_table, output_arguments, ratio, update_readme, write_results)
from spmd import UNSHARDED as U, Layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, H, BATCH = 256, 1024, 64
PACKAGES = {"monarch": "monarch", "ray": "ray"}


def mlp_step_fn(mesh, steps_seed: int = 0):
    """One Adam step of the MLP on `mesh` (batch x model), built alike in every mode: (step, x, y)."""
    torch.manual_seed(steps_seed)
    model = nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D))
    layouts = spmd.LayoutMap({"0.weight": Layout(["model", U], mesh), "0.bias": Layout(["model"], mesh),
                              "2.weight": Layout([U, "model"], mesh)})
    spmd.distribute_module(model, mesh, layouts)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = spmd.copy_to_mesh(torch.randn(BATCH, D), Layout(["batch", U], mesh))
    y = spmd.copy_to_mesh(torch.randn(BATCH, D), Layout(["batch", U], mesh))

    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step, x, y


def step_ms(mesh, steps: int, quick: bool) -> dict:
    """The step's time eagerly and under `spmd.function` (each on a fresh model), steps sent without waiting."""
    out = {}
    for mode in ("eager", "function"):
        step, x, y = mlp_step_fn(mesh)
        if mode == "function":
            step = spmd.function(step, backend="aot_eager" if quick else "inductor", fullgraph=False)
        for _ in range(3):  # traced and compiled (the optimizer's state appears in the first step)
            step(x, y).item()
        out[mode] = min(per_call_ms(lambda: step(x, y), steps, lambda: step(x, y).item()) for _ in range(3))
    return out


def per_call_ms(fn, n: int, finish=lambda: None) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    finish()
    return (time.perf_counter() - start) / n * 1e3


def bench_engine(engine: str, quick: bool) -> dict:
    from spmd.controller import Controller
    start = time.perf_counter()
    ctl = Controller(num_workers=2, devices_per_worker=2, engine=engine, collective_timeout=60)
    cold = time.perf_counter() - start
    try:
        mesh = ctl.create_mesh([("batch", 2), ("model", 2)])
        x = spmd.ones(4, layout=Layout(["batch"], mesh))
        n = 50 if quick else 500

        def waited():
            x + 1.0
            ctl.sync()
        waited_ms = min(per_call_ms(waited, n // 5) for _ in range(3))
        pipelined_ms = min(per_call_ms(lambda: x + 1.0, n, ctl.sync) for _ in range(3))
        big = torch.randn(4 << 20 if quick else 16 << 20)  # 16 MiB / 64 MiB fp32
        seconds = []
        for _ in range(3):
            t = time.perf_counter()
            spmd.copy_to_mesh(big, Layout(["batch"], mesh))
            ctl.sync()
            seconds.append(time.perf_counter() - t)
        mib_s = big.numel() * 4 / 2 ** 20 / min(seconds)
        steps = step_ms(mesh, 5 if quick else 100, quick)
    finally:
        ctl.shutdown()
    return {"cold_start_s": cold, "op_waited_ms": waited_ms, "op_pipelined_ms": pipelined_ms,
            "host_to_workers_mib_s": mib_s, "step_ms": steps["eager"], "function_step_ms": steps["function"]}


def client_main(steps: int, quick: bool) -> None:
    """One multi-client process: the same MLP steps, timed on client 0."""
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=2)
    torch.set_num_threads(1)
    mesh = spmd.create_distributed_mesh([("batch", 2), ("model", 2)])
    times = step_ms(mesh, steps, quick)
    if spmd.client_id() == 0:
        print("RESULT " + json.dumps(times))


def bench_multiclient(quick: bool) -> dict:
    port, procs = free_port(), []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--client",
                                       str(5 if quick else 100)] + (["--quick"] if quick else []), env=env,
                                      stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    line = next(l for l in outs[0].splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def readme(data: dict) -> str:
    mc, mc_fn = data["multiclient_step_ms"], data["multiclient_function_step_ms"]
    rows = []
    for engine, r in data["engines"].items():
        rows.append([engine, fmt(r["cold_start_s"], 1), fmt(r["op_waited_ms"], 2), fmt(r["op_pipelined_ms"], 2),
                     fmt(r["host_to_workers_mib_s"], 0), fmt(r["step_ms"], 1), fmt(mc, 1), ratio(r["step_ms"], mc),
                     fmt(r["function_step_ms"], 1), fmt(mc_fn, 1), ratio(r["function_step_ms"], mc_fn)])
    table = md_table(["engine", "cold start (s)", "tiny op waited (ms)", "tiny op pipelined (ms)",
                      "host→workers (MiB/s)", "MLP step, controller (ms)", "same step, multi-client (ms)",
                      "controller / multi-client", "`spmd.function` step, controller (ms)",
                      "same, multi-client (ms)", "controller / multi-client, function"], rows)
    return (f"Single-controller mode, 2 workers × 2 CPU devices (`benchmarks/bench_controller.py`; "
            f"{data['environment']}):\n\n{table}")


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--engines", nargs="+", default=list(PACKAGES))
    output_arguments(parser, "controller")
    parser.add_argument("--client", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client is not None:
        return client_main(args.client, args.quick)
    if args.readme_only:
        update_readme("controller", readme, args.out)
        return
    torch.set_num_threads(1)
    engines = {e: bench_engine(e, args.quick) for e in args.engines if importlib.util.find_spec(PACKAGES[e])}
    multiclient = bench_multiclient(args.quick)
    data = {"quick": args.quick, "environment": environment(), "engines": engines,
            "multiclient_step_ms": multiclient["eager"], "multiclient_function_step_ms": multiclient["function"]}
    write_results("controller", readme(data), data, args.out, readme=readme)
    return data


if __name__ == "__main__":
    main()
