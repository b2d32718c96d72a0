"""Multi-client spmd (2 processes, gloo on 127.0.0.1, 1 thread each) vs raw torch.distributed, torch DTensor
(world size 2) and DistributedDataParallel.

(a) relayout throughput on a 1-D mesh of 2 clients x 1 device: all-gather (S0->R), all-to-all (S0->S1),
    reduce-scatter (pending sum -> S0), all-reduce (pending sum -> R), for N x N fp32.
(b) a data-parallel training step of benchmarks/bench_mlp.py's residual MLP at two sizes (D=512 H=2048 and
    D=256 H=1024, 4 blocks, per-rank batch 32): spmd (mesh
    batch=2, `distribute_module` with its gradient buckets, data sharded on batch), spmd without buckets
    (`bucket_cap_mb=0`: each gradient all-reduced when read), the step under `spmd.function` and as one graph
    under `spmd.function(whole_step=True)` (inductor; aot_eager with --quick) vs DDP vs torch DT (Replicate params,
    Shard(0) data).

usage: python benchmarks/bench_multiclient.py [--quick] [--sizes 64 512 2048] [--reps R] [--steps N] [--out DIR]
       python benchmarks/bench_multiclient.py --readme-only   # README.md's table from results/multiclient.json
The script launches its own 2 worker processes (hard timeout); client 0 reports. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks._common import (
    environment,
    fmt,
    launch_clients,
    md_table,
    output_arguments,
    ratio,
    time_cases,
    update_readme,
    write_results,
)

KINDS = ("all_gather", "all_to_all", "reduce_scatter", "all_reduce")
KIND_LABEL = {"all_gather": "all-gather S0→R", "all_to_all": "all-to-all S0→S1",
              "reduce_scatter": "reduce-scatter P→S0", "all_reduce": "all-reduce P→R"}
RAW_CALL = {"all_gather": "`all_gather`", "all_to_all": "`all_to_all_single`",
            "reduce_scatter": "`all_reduce`: on gloo faster than `reduce_scatter_tensor`",
            "all_reduce": "`all_reduce`"}
# raw torch.distributed doing what spmd's relayout does: moving the same data (where the plain call above moves other
# data) into a tensor of its own (the plain call above writes into one buffer allocated once)
RAW_SAME = {"all_gather": "`all_gather` into a new N×N tensor",
            "all_to_all": "column blocks stacked contiguous, then `all_to_all_single` into a new tensor"}
# D, H, L, per-rank batch: a compute-heavier MLP, then a smaller one where the per-op cost weighs more
MLPS = ((512, 2048, 4, 32), (256, 1024, 4, 32))
QUICK_MLPS = ((16, 32, 2, 4),)


# -- the worker (one per client) -------------------------------------------------------------------------------------
class _TimedDist:
    """Stands in for `torch.distributed` inside spmd's collectives modules: forwards everything, and adds up the
    time spent in the torch.distributed calls and in waiting for point-to-point messages (to split spmd's time into
    the communication and the rest)."""

    def __init__(self, dist):
        self._dist = dist
        self.seconds = 0.0

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
        return timed

    def __getattr__(self, name):
        fn = getattr(self._dist, name)
        if name in ("all_reduce", "all_gather", "all_to_all_single"):
            return self._timed(fn)
        if name in ("isend", "irecv"):
            def started(*args, **kwargs):
                work = self._timed(fn)(*args, **kwargs)
                return types.SimpleNamespace(wait=self._timed(work.wait))
            return started
        return fn


def _relayout_cases(n: int, rank: int, mesh, dmesh) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor as TDT, Partial, Replicate, Shard
    import spmd
    from spmd import UNSHARDED as U, Layout
    from spmd.engine.planner import plan_on, run
    g = torch.Generator().manual_seed(0)
    value = torch.randn(n, n, generator=g)
    half = value.chunk(2, 0)[rank].contiguous()
    partial_value = value + rank  # each client's summand of a pending sum
    s0 = spmd.copy_to_mesh(value, Layout(["x", U], mesh))
    pending = partial_value.unsqueeze(0).contiguous()  # spmd's stacked components (1 local device)
    to_r, to_s0 = plan_on(mesh, (None, None), (None, None), ("x",)), plan_on(mesh, (None, None), ("x", None), ("x",))
    dt_s0 = TDT.from_local(half, dmesh, [Shard(0)], run_check=False)
    dt_p = TDT.from_local(partial_value, dmesh, [Partial()], run_check=False)
    parts = [torch.empty_like(half) for _ in range(2)]
    a2a_out = torch.empty_like(half)

    # the same relayouts in raw torch.distributed, each returning a new tensor as a relayout does (a fresh buffer costs
    # its first touch: on this CPU's allocator about as much as gloo's own copy)
    def raw_same_gather():  # S0->R
        out = torch.empty(n, n)
        dist.all_gather(list(out.chunk(2, 0)), half)
        return out

    def raw_same_relayout():  # S0->S1: column blocks made contiguous, then exchanged
        blocks = torch.empty(2, n // 2, n // 2)
        dist.all_to_all_single(blocks, torch.stack(half.chunk(2, 1)))
        return blocks.view(n, n // 2)
    ar = partial_value.clone()
    held = {"sum": spmd.DTensor(pending.clone(), Layout([U, U], mesh), (n, n), pending=("x",))}

    def read_pending_sum():  # an op reading a pending sum that nothing else holds resolves it where it is
        total = held.pop("sum")._local
        held["sum"] = spmd.DTensor(total, Layout([U, U], mesh), (n, n), pending=("x",))  # the next call's summand
    cases = {
        "all_gather": {"spmd": lambda: spmd.relayout(s0, Layout([U, U], mesh)),
                       "raw": lambda: dist.all_gather(parts, half),
                       "raw_same": raw_same_gather,
                       "dt": lambda: dt_s0.redistribute(dmesh, [Replicate()])},
        "all_to_all": {"spmd": lambda: spmd.relayout(s0, Layout([U, "x"], mesh)),
                       "raw": lambda: dist.all_to_all_single(a2a_out, half),
                       "raw_same": raw_same_relayout,
                       "dt": lambda: dt_s0.redistribute(dmesh, [Shard(1)])},
        "reduce_scatter": {"spmd": lambda: run(pending, mesh, to_s0),
                           "raw": lambda: dist.all_reduce(ar),  # gloo's reduce_scatter_tensor is slower: spmd's way
                           "dt": lambda: dt_p.redistribute(dmesh, [Shard(0)])},
        "all_reduce": {"spmd": read_pending_sum,
                       "raw": lambda: dist.all_reduce(ar),
                       "dt": lambda: dt_p.redistribute(dmesh, [Replicate()])},
    }
    # correctness, once: every variant gives the same values
    checks = {
        "all_gather": (spmd.to_global(cases["all_gather"]["spmd"]()), cases["all_gather"]["dt"]().to_local(), value),
        "all_to_all": (spmd.unpack(cases["all_to_all"]["spmd"]())[0], cases["all_to_all"]["dt"]().to_local(),
                       value.chunk(2, 1)[rank]),
        "reduce_scatter": (run(pending, mesh, to_s0)[0], cases["reduce_scatter"]["dt"]().to_local(),
                           (value + (value + 1)).chunk(2, 0)[rank]),
        "all_reduce": (run(pending, mesh, to_r)[0], cases["all_reduce"]["dt"]().to_local(), value + (value + 1)),
    }
    ok = {k: bool(torch.allclose(a, c, atol=1e-6) and torch.allclose(b, c, atol=1e-6)) for k, (a, b, c) in checks.items()}
    ok["all_gather"] &= bool(torch.equal(raw_same_gather(), value))
    ok["all_to_all"] &= bool(torch.equal(raw_same_relayout(), value.chunk(2, 1)[rank]))
    return cases, ok


def _relayouts(args, rank, mesh, dmesh) -> dict:
    import spmd.collectives.distributed as sd
    from spmd.collectives import groups, p2p
    out = {}
    for n in args.sizes:
        cases, ok = _relayout_cases(n, rank, mesh, dmesh)
        nbytes = n * n * 4
        iters = max(5, min(200, int(2e8 / max(nbytes, 1) / 20))) if not args.quick else 2  # >= 50 ms a repetition
        warm = 3 if args.quick else max(3, iters // 2)
        flat = {f"{k}/{v}": fn for k, variants in cases.items() for v, fn in variants.items()}
        res = time_cases(flat, iters, args.reps, warm=warm)
        # where spmd's time goes: the torch.distributed call vs the rest (local combine, write-back, dispatch)
        timed = sd.dist = groups.dist = p2p.dist = _TimedDist(sd.dist)
        try:
            split = {}
            for k in KINDS:
                fn = cases[k]["spmd"]
                timed.seconds = 0.0
                t = time.perf_counter()
                for _ in range(iters):
                    fn()
                total = (time.perf_counter() - t) / iters * 1e6
                split[k] = {"total": total, "dist_call": timed.seconds / iters * 1e6}
        finally:
            sd.dist = groups.dist = p2p.dist = timed._dist
        out[str(n)] = {"bytes": nbytes, "iters": iters, "results": res, "ok": ok, "split": split}
    return out


def _mlp_step_variants(args, config, rank, mesh, dmesh):
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor as TDT, Shard, distribute_module
    from torch.nn.parallel import DistributedDataParallel as DDP
    import spmd
    from spmd import UNSHARDED as U, Layout
    from benchmarks.bench_mlp import Net, make_opt
    import copy
    d, h, L, b = config
    torch.manual_seed(0)
    x, y = torch.randn(2 * b, d), torch.randn(2 * b, d)
    torch.manual_seed(1)
    base = Net(d, h, L)
    xl, yl = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
    variants = {}
    for opt_name in ("sgd", "adamw"):
        data = Layout(["batch", U], mesh)
        sx, sy = spmd.copy_to_mesh(x, data), spmd.copy_to_mesh(y, data)
        for name, cap in (("spmd", 25), ("spmd_nb", 0), ("fn", 25), ("ws", 25)):  # DDP's default bucket size
            net = spmd.distribute_module(copy.deepcopy(base), mesh, bucket_cap_mb=cap)
            variants[f"{name}/{opt_name}"] = (net, make_opt(opt_name, net.parameters(), foreach=None), sx, sy)
        ddp = DDP(copy.deepcopy(base))
        variants[f"ddp/{opt_name}"] = (ddp, make_opt(opt_name, ddp.parameters(), foreach=None), xl, yl)
        dt = distribute_module(copy.deepcopy(base), dmesh)  # every parameter Replicate()
        tx, ty = (TDT.from_local(t, dmesh, [Shard(0)], run_check=False) for t in (xl, yl))
        variants[f"dt/{opt_name}"] = (dt, make_opt(opt_name, dt.parameters(), foreach=None), tx, ty)
    losses = {name: [] for name in variants}
    _mlp_step_variants.last = variants

    def step_fn(name):
        model, opt, sx, sy = variants[name]

        def body(sx, sy):
            opt.zero_grad()
            loss = F.mse_loss(model(sx), sy)
            loss.backward()
            opt.step()
            return loss
        backend = "aot_eager" if args.quick else "inductor"
        if name.startswith("fn/"):  # function mode: one compiled forward+backward graph, one optimizer graph
            body = spmd.function(body, backend=backend, fullgraph=False)
        elif name.startswith("ws/"):  # the whole step one graph
            body = spmd.function(body, backend=backend, whole_step=True)

        def step():
            losses[name].append(body(sx, sy).detach())
        return step
    return {name: step_fn(name) for name in variants}, losses, (d, h, L, b)


def _loss_value(loss) -> float:
    import torch.distributed as dist
    import spmd
    if isinstance(loss, spmd.DTensor):
        return float(loss.item())
    if hasattr(loss, "full_tensor"):
        return float(loss.full_tensor())
    t = loss.clone()
    dist.all_reduce(t)  # DDP: each client's loss is the mean over its half of the batch
    return float(t) / 2


def _mlp(args, config, rank, mesh, dmesh) -> dict:
    steps, losses, config = _mlp_step_variants(args, config, rank, mesh, dmesh)
    res = time_cases(steps, args.steps, args.reps, warm=args.warm)
    for r in res.values():
        if "median" in r:
            r["median"] /= 1000  # ms per step
            r["runs"] = [v / 1000 for v in r["runs"]]
    # the losses of the first warm-up steps, the same data and initial weights for every variant
    values = {name: [_loss_value(v) for v in ls[:args.warm]] for name, ls in losses.items()}
    diffs = {}
    for name, vals in values.items():
        ref = values["ddp/" + name.split("/")[1]]
        diffs[name] = max((abs(a - b) for a, b in zip(vals, ref)), default=0.0)
    grads = {}
    for name, (model, *_rest) in _mlp_step_variants.last.items():
        if name.startswith("dt/"):
            g = next(iter(model.parameters())).grad
            grads[name] = str(getattr(g, "placements", None))
    return {"config": config, "results": res, "losses": values, "max_loss_diff_vs_ddp": diffs,
            "dt_grad_placements": grads}


def worker(args) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import spmd
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=1)
    rank = spmd.client_id()
    data = {"environment": environment(), "quick": args.quick}
    mesh = spmd.create_distributed_mesh([("x", 2)])
    dmesh = init_device_mesh("cpu", (2,))
    if not args.no_relayout:
        data["relayout"] = _relayouts(args, rank, mesh, dmesh)
    if not args.no_mlp:
        dp = spmd.create_distributed_mesh([("batch", 2)], mesh_name="dp")
        data["mlp"] = [_mlp(args, config, rank, dp, dmesh) for config in (QUICK_MLPS if args.quick else MLPS)]
    dist.barrier()
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump(data, f, default=str)


# -- the launcher and the report -------------------------------------------------------------------------------------
def _gbps(nbytes: int, us: float | None) -> str:
    return "–" if not us else f"{nbytes / us / 1e3:.2f}"


def caption(data: dict) -> str:
    return (f"{data['environment']}; 2 clients on 127.0.0.1, gloo, 1 thread each. Medians over the repetitions "
            "(round-robin).")


def readme_table(data: dict) -> str:
    """README.md's table from multiclient.json: the relayouts at the largest N (µs), the MLP step (ms)."""
    us = lambda x: "–" if x is None else f"{x:,.0f}"  # noqa: E731
    slash = " / ".join
    rows, unit = [], ""
    if "relayout" in data:
        n = max(data["relayout"], key=int)
        unit = f" Relayouts of {n}×{n} fp32 in µs per call (P = a pending sum)."
        res = data["relayout"][n]["results"]
        for k in KINDS:
            s, raw, dt = (res.get(f"{k}/{v}", {}).get("median") for v in ("spmd", "raw", "dt"))
            rows.append([KIND_LABEL[k], f"{us(raw)} ({RAW_CALL[k]})", us(s), us(dt), ratio(s, raw), ratio(s, dt)])
            same = res.get(f"{k}/raw_same", {}).get("median")
            if same is not None:
                rows.append([f"{KIND_LABEL[k]}, raw doing the same relayout", f"{us(same)} ({RAW_SAME[k]})", us(s),
                             us(dt), ratio(s, same), ratio(s, dt)])
    for m in data.get("mlp", ()):
        s, nb, ddp, dt = ([m["results"].get(f"{v}/{o}", {}).get("median") for o in ("sgd", "adamw")]
                          for v in ("spmd", "spmd_nb", "ddp", "dt"))
        rows.append([f"data-parallel MLP step D={m['config'][0]} H={m['config'][1]} (ms), SGD / AdamW",
                     "DDP " + slash(map(fmt, ddp)), slash(map(fmt, s)), slash(map(fmt, dt)),
                     slash(map(ratio, s, ddp)) + " of DDP", slash(map(ratio, s, dt))])
        if any(nb):
            rows.append(["the same step, spmd without gradient buckets (`bucket_cap_mb=0`)", "DDP " +
                         slash(map(fmt, ddp)), slash(map(fmt, nb)), slash(map(fmt, dt)),
                         slash(map(ratio, nb, ddp)) + " of DDP", slash(map(ratio, nb, dt))])
        fn = [m["results"].get(f"fn/{o}", {}).get("median") for o in ("sgd", "adamw")]
        if any(fn):
            rows.append(["the same step under `spmd.function` (inductor; the gradients' all-reduces in one bucket)",
                         "DDP " + slash(map(fmt, ddp)), slash(map(fmt, fn)), slash(map(fmt, dt)),
                         slash(map(ratio, fn, ddp)) + " of DDP", slash(map(ratio, fn, dt))])
        ws = [m["results"].get(f"ws/{o}", {}).get("median") for o in ("sgd", "adamw")]
        if any(ws):
            rows.append(["the same step as one graph, `spmd.function(whole_step=True)` (inductor)",
                         "DDP " + slash(map(fmt, ddp)), slash(map(fmt, ws)), slash(map(fmt, dt)),
                         slash(map(ratio, ws, ddp)) + " of DDP", slash(map(ratio, ws, dt))])
    hdr = ["", "raw `torch.distributed`", "spmd", "torch DT", "spmd / raw", "spmd / torch DT"]
    return caption(data) + unit + "\n\n" + md_table(hdr, rows)


def report(data: dict) -> str:
    lines = ["# Multi-client: spmd vs torch.distributed, torch DTensor and DDP (2 processes, gloo)", "",
             f"{caption(data)} `python benchmarks/bench_multiclient.py`" + (" **(--quick: numbers are noise)**"
                                                                          if data.get("quick") else ""), ""]
    if "relayout" in data:
        lines += ["## Relayout on a 1-D mesh of 2 clients × 1 device (fp32 N×N global)", "",
                  "µs per call; GB/s = global tensor bytes / time. raw = the torch.distributed collective on the "
                  "same bytes (`all_gather` of the local half; `all_to_all_single` of the local half, split into row "
                  "blocks; both into buffers allocated once; and, as the same relayouts, returning a new tensor per "
                  "call: `all_gather` into a new N×N tensor, `all_to_all_single` of the column blocks stacked "
                  "contiguous into a new tensor; `all_reduce` "
                  "of the full summand for both pending-sum cases, since gloo has no reduce-scatter and spmd "
                  "all-reduces then slices). torch DT = `DTensor.redistribute` at world size 2. spmd S0→R and S0→S1 "
                  "are `spmd.relayout`; the pending-sum cases run spmd's relayout engine "
                  "(`spmd.engine.planner.run`) on the stacked components, since a pending sum is not a public "
                  "layout; P→R resolves a pending DTensor that nothing else holds, as an op reading it does (gloo "
                  "then reduces its components in place, as raw `all_reduce` does).", ""]
        rows = []
        for n, r in data["relayout"].items():
            res, nbytes = r["results"], r["bytes"]
            for k in KINDS:
                s, raw, dt = (res.get(f"{k}/{v}", {}).get("median") for v in ("spmd", "raw", "dt"))
                rows.append([f"{n}×{n}", KIND_LABEL[k], fmt(raw), fmt(s), fmt(dt), _gbps(nbytes, raw),
                             _gbps(nbytes, s), _gbps(nbytes, dt), ratio(s, raw), ratio(s, dt),
                             "yes" if r["ok"][k] else "**NO**"])
                same = res.get(f"{k}/raw_same", {}).get("median")
                if same is not None:
                    rows.append([f"{n}×{n}", f"{KIND_LABEL[k]}, raw doing the same relayout", fmt(same), fmt(s),
                                 fmt(dt), _gbps(nbytes, same), _gbps(nbytes, s), _gbps(nbytes, dt), ratio(s, same),
                                 ratio(s, dt), "yes" if r["ok"][k] else "**NO**"])
        lines += [md_table(["N", "relayout", "raw µs", "spmd µs", "torch DT µs", "raw GB/s", "spmd GB/s",
                            "DT GB/s", "spmd/raw", "spmd/DT", "values agree"], rows), ""]
        lines += ["Where spmd's time goes (one timed pass, µs per call): the torch.distributed call(s) inside "
                  "spmd's collective vs the rest (dispatch, local combine of the components, padding/indexing, "
                  "write-back into the output, the DTensor wrap).", ""]
        rows = []
        for n, r in data["relayout"].items():
            for k in KINDS:
                sp = r["split"][k]
                rows.append([f"{n}×{n}", KIND_LABEL[k], fmt(sp["total"]), fmt(sp["dist_call"]),
                             fmt(sp["total"] - sp["dist_call"])])
        lines += [md_table(["N", "relayout", "spmd total", "in torch.distributed", "rest"], rows), ""]
    for m in data.get("mlp", ()):
        d, h, L, b = m["config"]
        lines += [f"## Data-parallel training step (residual MLP D={d} H={h} L={L}, batch {b} per client, fp32)", "",
                  "ms per step (median). spmd: mesh batch=2 over the 2 clients, `distribute_module` (every "
                  "parameter a replicated DVariable; gradients reduced in 25 MB buckets during backward, one async "
                  "all-reduce each), data sharded on batch; spmd no buckets: `bucket_cap_mb=0`; spmd.function: the same step "
                  "compiled with `spmd.function(fullgraph=False)` (inductor merges the backward graph's gradient "
                  "all-reduces into 25 MB buckets); DDP: `DistributedDataParallel` on each client's half; torch DT: "
                  "`distribute_module` (parameters `Replicate()`), data `DTensor.from_local(..., [Shard(0)])`. "
                  "Optimisers on torch.optim's default path (the for-loop on CPU; spmd runs it on the stacked "
                  "components). Loss diff: max |loss − DDP's loss| over the first "
                  "steps (same data, same initial weights).", ""]
        rows = []
        for opt in ("sgd", "adamw"):
            get = lambda v: m["results"].get(f"{v}/{opt}", {}).get("median")  # noqa: E731
            s, nb, fn, ws, ddp, dt = (get(v) for v in ("spmd", "spmd_nb", "fn", "ws", "ddp", "dt"))
            errs = [f"{v}: {m['results'][f'{v}/{opt}']['error']}" for v in ("spmd", "spmd_nb", "fn", "ws", "ddp", "dt")
                    if "error" in m["results"].get(f"{v}/{opt}", {})]
            rows.append([opt.upper() if opt == "sgd" else "AdamW", fmt(ddp, 2), fmt(s, 2), fmt(nb, 2), fmt(fn, 2),
                         fmt(ws, 2), fmt(dt, 2), ratio(s, ddp), ratio(nb, ddp), ratio(fn, ddp), ratio(ws, ddp),
                         ratio(s, dt)] + [f"{m['max_loss_diff_vs_ddp'].get(f'{v}/{opt}', float('nan')):.1e}"
                                          for v in ("spmd", "fn", "ws", "dt")] + (["; ".join(errs)] if errs else []))
        lines += [md_table(["optimizer", "DDP ms", "spmd ms", "spmd no buckets ms", "spmd.function ms",
                            "whole step ms", "torch DT ms", "spmd/DDP", "no buckets/DDP", "spmd.function/DDP",
                            "whole step/DDP", "spmd/DT", "spmd loss diff", "spmd.function loss diff",
                            "whole step loss diff", "DT loss diff"], rows), ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny sizes and few iterations")
    p.add_argument("--sizes", type=int, nargs="+", default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="training steps per repetition")
    p.add_argument("--warm", type=int, default=None, help="warm-up training steps (their losses are compared)")
    p.add_argument("--no-relayout", action="store_true")
    p.add_argument("--no-mlp", action="store_true")
    p.add_argument("--timeout", type=float, default=None, help="hard limit for the 2 clients, seconds")
    output_arguments(p, "multiclient")
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.readme_only:
        return update_readme("multiclient", readme_table, args.out)
    if args.sizes is None:
        args.sizes = [16] if args.quick else [64, 512, 2048]
    args.reps = args.reps or (1 if args.quick else 11)  # this machine varies by ±20 % between runs
    args.steps = args.steps or (2 if args.quick else 10)
    args.warm = args.warm or (2 if args.quick else 5)
    if args.worker_out:
        worker(args)
        return {}
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if a]
    data = launch_clients(__file__, passthrough, 2, args.timeout or (60 if args.quick else 580))
    markdown = report(data)
    write_results("multiclient", markdown, data, args.out, readme=readme_table)
    return data


if __name__ == "__main__":
    main()
