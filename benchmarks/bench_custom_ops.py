"""A custom op (torch.library) on DTensors: the replicated fallback, a rule declared with `spmd.register_sharding`,
`spmd.local_map`, against plain torch and torch DTensor's `register_sharding`; in one process (8 virtual devices)
and over 2 gloo clients.

usage: python benchmarks/bench_custom_ops.py [--quick] [--iters N] [--reps R] [--out DIR]
       python benchmarks/bench_custom_ops.py --readme-only   # README.md's table from results/, runs nothing

The op: an RMS norm over the last axis of a (batch, sequence, hidden) activation with a weight, as a Triton or C++
kernel would be registered (here torch ops inside, the same for every variant), with its backward. The activation
is sharded over the batch; each variant runs forward + backward.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import spmd
from benchmarks._common import (
    environment, fmt, launch_clients, md_table, med, output_arguments, ratio, time_cases, torch_dist_ws1, update_readme,
    write_results)
from spmd import UNSHARDED as U, Layout
from spmd.explain import Recorder

SHAPE = (32, 64, 256)  # batch, sequence, hidden: 2 MB of fp32
QUICK_SHAPE = (8, 4, 16)


def _norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _define(name: str):
    """A custom RMS norm op with its backward (recomputed, as a fused kernel's backward would)."""
    @torch.library.custom_op(f"spmd_bench::{name}", mutates_args=())
    def op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _norm(x, w)
    op.register_fake(lambda x, w: torch.empty_like(x))

    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
            return torch.autograd.grad(_norm(x, w), (x, w), grad)
    op.register_autograd(backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))
    return op


NORM = _define("rms_norm")
UNRULED = _define("rms_norm_without_rule")  # the same op, left to the replicated fallback
spmd.register_sharding(NORM, "... h, h -> ... h", need_replication_factors=("h",))


def _step(op, x, w):
    def step():
        op(x, w).sum().backward()
        x.grad = w.grad = None
    return step


def _spmd_inputs(x, w, mesh):
    dx = spmd.copy_to_mesh(x, Layout(["batch", U, U], mesh)).requires_grad_()
    return dx, spmd.copy_to_mesh(w, Layout([U], mesh)).requires_grad_()


def _torch_dt_inputs(x, w):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.experimental import register_sharding
    mesh = init_device_mesh("cpu", (1,))
    op = _define("rms_norm_torch_dt")

    @register_sharding(op._opoverload)
    def _strategies(x, w):  # rows sharded over any axis but the last, or everything replicated
        rows = [([Shard(d)], [Shard(d), Replicate()]) for d in range(len(x.shape) - 1)]
        return rows + [([Replicate()], [Replicate(), Replicate()])]
    dx = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    return op, dx, distribute_tensor(w, mesh, [Replicate()]).requires_grad_()


def cases(shape, with_dt: bool) -> dict:
    """One process: plain torch on the whole batch, spmd on 1 and 8 virtual devices, torch DT (ws=1)."""
    torch.manual_seed(0)
    x, w = torch.randn(shape), torch.randn(shape[-1])
    out = {"plain": _step(NORM, x.clone().requires_grad_(), w.clone().requires_grad_()),
           "rule1": _step(NORM, *_spmd_inputs(x, w, spmd.create_mesh([("batch", 1)])))}
    out.update(_sharded_cases(*_spmd_inputs(x, w, spmd.create_mesh([("batch", 8)])), "8"))
    if with_dt:
        op, dx, dw = _torch_dt_inputs(x, w)
        out["dt"] = _step(op, dx, dw)
    return out


def _sharded_cases(dx, dw, suffix: str) -> dict:
    mapped = spmd.local_map(lambda a, b: NORM(a, b), out_layouts=spmd.fetch_layout(dx))
    return {"rule" + suffix: _step(NORM, dx, dw), "fallback" + suffix: _step(UNRULED, dx, dw),
            "local_map" + suffix: _step(mapped, dx, dw)}


def moved(step) -> tuple[int, int]:
    """(collectives, bytes moved per device) of one forward + backward."""
    with Recorder() as r:
        step()
    return len(r.collectives), sum(c.bytes for c in r.collectives)


def worker(args) -> None:
    """One of 2 gloo clients (1 device each, the batch sharded over them): client 0 writes the results."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=1)
    shape = QUICK_SHAPE if args.quick else SHAPE
    torch.manual_seed(0)
    x, w = torch.randn(shape), torch.randn(shape[-1])
    half = x.chunk(2)[spmd.client_id()]
    steps = {"plain2": _step(NORM, half.clone().requires_grad_(), w.clone().requires_grad_())}
    steps.update(_sharded_cases(*_spmd_inputs(x, w, spmd.create_distributed_mesh([("batch", 2)])), "2"))
    res = time_cases(steps, args.iters, args.reps, args.warm)
    comm = {k: moved(v) for k, v in steps.items() if k != "plain2"}
    dist.barrier()
    if spmd.client_id() == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"results": res, "moved": comm}, f, default=str)


_ROWS = {  # key: (label, the key of its baseline)
    "plain": ("1 process: plain torch (the op on the whole batch)", "plain"),
    "dt": ("torch DT ws=1, `register_sharding` (batch sharded)", "plain"),
    "rule1": ("spmd 1-device mesh, `register_sharding`", "plain"),
    "rule8": ("spmd 8 virtual devices, `register_sharding`", "plain"),
    "local_map8": ("spmd 8 virtual devices, `local_map`", "plain"),
    "fallback8": ("spmd 8 virtual devices, no rule (replicated fallback)", "plain"),
    "plain2": ("2 gloo clients: plain torch on a client's half (no communication)", "plain2"),
    "rule2": ("spmd, `register_sharding`", "plain2"),
    "local_map2": ("spmd, `local_map`", "plain2"),
    "fallback2": ("spmd, no rule (replicated fallback)", "plain2"),
}


def readme_table(data: dict) -> str:
    res, comm = data["results"], data["moved"]
    rows = []
    for key, (label, base) in _ROWS.items():
        n, b = comm.get(key, (None, None))
        rows.append([label, fmt(med(res, key)), ratio(med(res, key), med(res, base)), "–" if n is None else str(n),
                     "–" if b is None else f"{b / 2**20:.2f}"])
    shape = "×".join(map(str, data["shape"]))
    return (f"{data['environment']}. RMS norm as a custom op, activation {shape} fp32 sharded over the batch, "
            f"forward + backward; medians of {data['reps']} repetitions × {data['iters']} calls, round-robin; "
            "2 clients on 127.0.0.1, 1 thread each.\n\n"
            + md_table(["variant", "µs per call", "vs plain", "collectives", "MB moved per device"], rows))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, few iterations: a smoke run")
    p.add_argument("--iters", type=int, default=None, help="calls per timing repetition (default 20)")
    p.add_argument("--reps", type=int, default=None, help="repetitions, the median is reported (default 7)")
    p.add_argument("--no-dt", action="store_true", help="skip torch.distributed.tensor")
    output_arguments(p, "custom_ops")
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.readme_only:
        return update_readme("custom_ops", readme_table, a.out)
    a.iters, a.reps = a.iters or (2 if a.quick else 20), a.reps or (2 if a.quick else 7)
    a.warm = 1 if a.quick else 5
    if a.worker_out:
        worker(a)
        return {}
    shape = QUICK_SHAPE if a.quick else SHAPE
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)  # (the fallback's warning)
    t0 = time.time()
    with torch_dist_ws1("gloo") if not a.no_dt else contextlib.nullcontext():
        steps = cases(shape, not a.no_dt)
        res = time_cases(steps, a.iters, a.reps, a.warm)
        comm = {k: moved(v) for k, v in steps.items() if k not in ("plain", "dt")}
    clients = launch_clients(__file__, [x for x in (argv if argv is not None else sys.argv[1:]) if x], 2,
                             90 if a.quick else 300)
    data = {"environment": environment(), "shape": list(shape), "iters": a.iters, "reps": a.reps, "quick": a.quick,
            "results": {**res, **clients["results"]}, "moved": {**comm, **clients["moved"]},
            "seconds": time.time() - t0}
    write_results("custom_ops", readme_table(data), data, a.out, readme=readme_table)
    return data


if __name__ == "__main__":
    main()
