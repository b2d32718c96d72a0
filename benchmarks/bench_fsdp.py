"""Sharded parameters on N gloo processes: spmd's `shard_parameters` (FSDP / ZeRO-3 from layouts) vs torch's
`fully_shard` (FSDP2), with the replicated-parameter runs (spmd data parallel with gradient buckets, DDP) beside.

benchmarks/bench_mlp.py's residual MLP, built on the `meta` device and materialised by each library as it shards
(spmd: `distribute_module(..., shard_parameters="batch")`; FSDP2: `fully_shard` per block and on the root, then
`to_empty` + `reset_parameters`), AdamW, per-process batch B. Each (variant, N) runs in its own launch of N
processes, so a process's peak memory is its own. Reported per process (client 0; memory: the largest client):
- step: median ms per training step (zero_grad, forward, MSE loss, backward, AdamW step) over the repetitions;
- peak: the peak resident memory during setup and training minus the resident memory before the model was made;
- state: bytes of the parameters, gradients and optimizer state this process holds.
The `_accum` variants split each step's rows into 4 micro-batches, the gradients reduce-scattered after the last
only (spmd: the first three under `spmd.no_sync`; FSDP2: under `set_requires_gradient_sync(False)`).

usage: python benchmarks/bench_fsdp.py [--quick] [--worlds 2 4] [--reps R] [--steps N] [--out DIR]
       python benchmarks/bench_fsdp.py --readme-only   # README.md's table from results/fsdp.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks._common import (
    environment, fmt, launch_clients, md_table, output_arguments, ratio, update_readme, write_results)

VARIANTS = ("spmd_fsdp", "fsdp2", "spmd_dp", "ddp", "spmd_fsdp_accum", "fsdp2_accum")
LABELS = {"spmd_fsdp": "spmd `shard_parameters`", "fsdp2": "torch FSDP2 `fully_shard`",
          "spmd_dp": "spmd data parallel (buckets)", "ddp": "torch DDP",
          "spmd_fsdp_accum": "spmd `shard_parameters`, 4 micro-batches (`spmd.no_sync`)",
          "fsdp2_accum": "torch FSDP2, 4 micro-batches (`set_requires_gradient_sync(False)`)"}
MICRO = 4  # micro-batches per step of the `_accum` variants (the same rows per step, in quarters)
MLP = (768, 3072, 4, 16)  # D, H, L, per-process batch
QUICK_MLP = (16, 32, 2, 4)


# -- the worker (one per client) -------------------------------------------------------------------------------------
def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _local_bytes(t) -> int:
    """The bytes this process holds of `t`: spmd's components, torch DTensor's local shard, or a plain tensor."""
    if t is None:
        return 0
    local = getattr(t, "_stack", None)
    if local is None:
        local = getattr(t, "_local_tensor", t)
    return local.numel() * local.element_size()


def _state_bytes(model, opt) -> int:
    params = list(model.parameters())
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    return sum(_local_bytes(p) + _local_bytes(p.grad) for p in params) + sum(map(_local_bytes, states))


def _build(variant: str, config, world: int):
    """(model, step inputs) of `variant`, the model materialised from `meta` as the library shards it; the inputs
    are a list of (x, y) micro-batches, each process's rows in quarters for the `_accum` variants."""
    import spmd
    from benchmarks.bench_mlp import Net
    d, h, L, b = config
    torch.manual_seed(0)
    x, y = torch.randn(world * b, d), torch.randn(world * b, d)
    with torch.device("meta"):
        net = Net(d, h, L)
    micro = MICRO if variant.endswith("_accum") else 1
    if variant.startswith("spmd"):
        mesh = spmd.create_distributed_mesh([("batch", world)])
        spmd.distribute_module(net, mesh, shard_parameters="batch" if variant.startswith("spmd_fsdp") else None)
        data = spmd.Layout(["batch", spmd.UNSHARDED], mesh)
        quarters = [t.view(world, micro, b // micro, d) for t in (x, y)]  # (each process's j-th part: its rows)
        return net, [tuple(spmd.copy_to_mesh(q[:, j].reshape(-1, d), data) for q in quarters) for j in range(micro)]
    rank = torch.distributed.get_rank()
    local = list(zip(x[rank * b:(rank + 1) * b].chunk(micro), y[rank * b:(rank + 1) * b].chunk(micro)))
    if variant.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        dmesh = init_device_mesh("cpu", (world,))
        for block in net.layers:
            fully_shard(block, mesh=dmesh)
        fully_shard(net, mesh=dmesh)
    net.to_empty(device="cpu")
    for module in net.modules():
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()
    if variant == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(net)
    return net, local


def _trainer(model, batches):
    """A training step over the micro-batches `batches`, the gradients reduced after the last only."""
    import contextlib
    import torch.nn.functional as F
    import spmd
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []

    def accumulating(last: bool):
        if last:
            return contextlib.nullcontext()
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
            return _fsdp2_no_sync(model)
        return spmd.no_sync(model)

    def step():
        opt.zero_grad()
        for i, (x, y) in enumerate(batches):
            with accumulating(i == len(batches) - 1):
                loss = F.mse_loss(model(x), y) / len(batches)
                loss.backward()
        opt.step()
        losses.append(loss.detach())
    return step, opt, losses


@contextlib.contextmanager
def _fsdp2_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def worker(args) -> None:
    torch.set_num_threads(1)
    import gc
    import json
    import torch.distributed as dist
    import spmd
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=1)  # also the gloo group torch's use
    world = dist.get_world_size()
    warm_model, warm_batches = _build(args.variant, QUICK_MLP, world)
    _trainer(warm_model, warm_batches)[0]()  # imports and one-time setup, before the baseline
    del warm_model, warm_batches
    gc.collect()
    before = _resident_mb()
    model, batches = _build(args.variant, QUICK_MLP if args.quick else MLP, world)
    step, opt, losses = _trainer(model, batches)
    for _ in range(args.warm):
        step()
    runs = []
    for _ in range(args.reps):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        runs.append((time.perf_counter() - t) / args.steps * 1e3)
    memory = torch.tensor([_peak_mb() - before, _state_bytes(model, opt) / 2 ** 20], dtype=torch.float64)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    first = losses[0]
    first = first.item() if isinstance(first, spmd.DTensor) else getattr(first, "full_tensor", lambda: first)()
    if dist.get_rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"step_ms": statistics.median(runs), "runs": runs, "peak_mb": memory[0].item(),
                       "state_mb": memory[1].item(), "first_loss": float(first), "environment": environment()}, f)


# -- the launcher and the report -------------------------------------------------------------------------------------
def readme_table(data: dict) -> str:
    d, h, L, b = data["config"]
    header = ["N processes", "variant", "step ms", "vs FSDP2", "peak MB", "state MB"]
    rows = []
    for world, results in data["worlds"].items():
        for v in VARIANTS:
            r = results.get(v)
            if r is None:
                continue
            base = results.get("fsdp2_accum" if v.endswith("_accum") else "fsdp2", {})  # (the same kind of step)
            rows.append([world, LABELS[v], fmt(r["step_ms"]), ratio(r["step_ms"], base.get("step_ms")),
                         fmt(r["peak_mb"], 0), fmt(r["state_mb"], 1)])
    return "\n".join([
        f"Residual MLP D={d} H={h} L={L}, {b} rows per process, AdamW, fp32; {data['environment']} (per "
        "process); gloo on 127.0.0.1. step: median ms per training step; peak: peak resident memory of a "
        "process minus its memory before the model was made; state: its parameters + gradients + AdamW state. "
        f"Rows with {MICRO} micro-batches: {b // MICRO} rows each per process, the gradients reduce-scattered "
        "after the last only; their ratio is to FSDP2's same step.",
        "", md_table(header, rows)])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, few steps, 2 processes")
    p.add_argument("--worlds", type=int, nargs="+", default=None, help="process counts (default 2 4)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="training steps per repetition")
    p.add_argument("--warm", type=int, default=None)
    p.add_argument("--timeout", type=float, default=300, help="hard limit per launch, seconds")
    output_arguments(p, "fsdp")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.readme_only:
        return update_readme("fsdp", readme_table, args.out)
    args.reps = args.reps or (1 if args.quick else 5)
    args.steps = args.steps or (2 if args.quick else 10)
    args.warm = args.warm or (1 if args.quick else 3)
    if args.worker_out:
        worker(args)
        return {}
    worlds = args.worlds or ([2] if args.quick else [2, 4])
    # blocks of 1 MB and more come from mmap and go back to the system when freed, so that resident memory follows
    # what the tensors hold rather than what malloc kept (the same for every variant)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(2 ** 20))
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if a]
    data = {"quick": args.quick, "config": QUICK_MLP if args.quick else MLP, "worlds": {}}
    for world in worlds:
        data["worlds"][str(world)] = {
            v: launch_clients(__file__, [*passthrough, "--variant", v], world, args.timeout) for v in VARIANTS}
    data["environment"] = data["worlds"][str(worlds[0])]["fsdp2"]["environment"]
    write_results("fsdp", readme_table(data), data, args.out, readme=readme_table)
    return data


if __name__ == "__main__":
    main()
