"""Optimizer steps over DTensor parameters: torch.optim's for-loop, foreach and fused paths, plain torch vs spmd
(1-device mesh, and 8 virtual devices with every parameter sharded) vs torch DTensor (ws=1).

usage: python benchmarks/bench_optim.py [--quick] [--iters N] [--reps R] [--device cpu|cuda] [--out DIR]
       python benchmarks/bench_optim.py --readme-only [--device cuda]   # README.md's table from results/, runs nothing

`--device cuda` times the steps on the GPU (each step synchronised) and writes results/optim_cuda.*.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import spmd
from benchmarks._common import (
    environment, fmt, md_table, med, output_arguments, ratio, time_cases, torch_dist_ws1, update_readme, write_results)
from spmd import UNSHARDED, Layout

# (name, parameter shapes): the 100 small tensors, and a transformer-like set (weights and vectors)
PARAM_SETS = {
    "100 × 64×64": [(64, 64)] * 100,
    "GPT-like, 8 layers d=256 (6.3M)": [(768, 256), (256, 256), (1024, 256), (256, 1024), (256,), (256,)] * 8,
}
OPTIMIZERS = {  # (label, optimizer class, kwargs)
    "AdamW for-loop": (torch.optim.AdamW, {"foreach": False}),
    "AdamW foreach": (torch.optim.AdamW, {"foreach": True}),
    "AdamW fused": (torch.optim.AdamW, {"fused": True}),
    "SGD momentum foreach": (torch.optim.SGD, {"foreach": True, "momentum": 0.9}),
}


def _values(shapes, device: str):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(device) for s in shapes]


def _stepper(params, cls, kwargs):
    """opt.step for `params` whose gradients are set once (a step reads them, as after backward); on a GPU each step
    waits for its kernels, so that a step's time is its whole cost."""
    for p in params:
        p.grad = torch.ones_like(p) * 1e-3
    opt = cls(params, lr=1e-3, **kwargs)
    if params[0].device.type != "cuda":
        return opt.step
    return lambda: (opt.step(), torch.cuda.synchronize())


def _spmd_params(values, ndev: int, device: str):
    kind = "GPU" if device == "cuda" else "CPU"
    mesh = spmd.create_mesh([("x", ndev)], devices=[f"{kind}:{i}" for i in range(ndev)])
    return [spmd.DVariable(v, layout=Layout(["x"] + [UNSHARDED] * (v.dim() - 1), mesh)) for v in values]


def _dt_params(values, device: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    mesh = init_device_mesh(device, (1,))
    return [torch.nn.Parameter(distribute_tensor(v, mesh, [Replicate()])) for v in values]


def cases(shapes, cls, kwargs, with_dt: bool, device: str) -> dict:
    values = _values(shapes, device)
    out = {"plain": _stepper([torch.nn.Parameter(v.clone()) for v in values], cls, kwargs),
           "spmd1": _stepper(_spmd_params(values, 1, device), cls, kwargs),
           "spmd8": _stepper(_spmd_params(values, 8, device), cls, kwargs)}
    if with_dt:
        out["dt"] = _stepper(_dt_params(values, device), cls, kwargs)
    return out


def readme_table(data: dict) -> str:
    hdr = ["optimizer step, ms", "parameters", "plain torch", "spmd 1-dev", "spmd 8-dev (sharded)", "torch DT ws=1",
           "spmd 1-dev / plain", "spmd 8-dev / plain", "spmd 1-dev / torch DT"]
    rows = []
    for r in data["rows"]:
        pl, s1, s8, d = (r.get(c) for c in ("plain", "spmd1", "spmd8", "dt"))
        rows.append([r["optimizer"], r["params"], fmt(pl, 2), fmt(s1, 2), fmt(s8, 2), fmt(d, 2), ratio(s1, pl),
                     ratio(s8, pl), ratio(s1, d)])
    where = f"{data['gpu']}, " if data.get("gpu") else ""
    return (f"{where}{data['environment']}. Medians of {data['reps']} repetitions × {data['iters']} steps, variants "
            f"timed round-robin; gradients set once, fp32.\n\n" + md_table(hdr, rows))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few iterations: a smoke run, numbers are noise")
    p.add_argument("--iters", type=int, default=None, help="steps per timing repetition (default 20)")
    p.add_argument("--reps", type=int, default=None, help="repetitions, the median is reported (default 5)")
    p.add_argument("--no-dt", action="store_true", help="skip torch.distributed.tensor")
    output_arguments(p, "optim")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the parameters live")
    a = p.parse_args(argv)
    stem = "optim" if a.device == "cpu" else "optim_cuda"
    if a.readme_only:
        return update_readme(stem, readme_table, a.out)
    iters, reps, warm = a.iters or (2 if a.quick else 20), a.reps or (2 if a.quick else 5), 1 if a.quick else 3
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)
    t0 = time.time()
    rows = []
    backend = "nccl" if a.device == "cuda" else "gloo"
    with torch_dist_ws1(backend) if not a.no_dt else contextlib.nullcontext():
        for params, shapes in PARAM_SETS.items():
            for label, (cls, kwargs) in OPTIMIZERS.items():
                res = time_cases(cases(shapes, cls, kwargs, not a.no_dt, a.device), iters, reps, warm)
                row = {"optimizer": label, "params": params}
                row.update({k: med(res, k) / 1e3 for k in res if med(res, k) is not None})
                row["errors"] = {k: v["error"] for k, v in res.items() if "error" in v}
                rows.append(row)
                print(row, flush=True)
    data = {"environment": environment(), "iters": iters, "reps": reps, "quick": a.quick, "rows": rows,
            "seconds": time.time() - t0, "device": a.device}
    if a.device == "cuda":
        data["gpu"] = f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    write_results(stem, readme_table(data), data, a.out, readme=readme_table)
    return data


if __name__ == "__main__":
    main()
