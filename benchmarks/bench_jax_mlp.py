"""The peers' JAX 2-layer MLP training step (batch 256, 1024 -> 1024 -> 1024, MSE, SGD) in spmd, JAX and plain
torch (eager and torch.compile), in one process: 1 device; data parallel on 8 virtual devices; batch=4 x model=2
(Megatron).

usage: python benchmarks/bench_jax_mlp.py [--quick] [--steps N] [--reps R] [--warm W] [--threads T] [--no-jax]
                                          [--out DIR]
       python benchmarks/bench_jax_mlp.py --readme-only   # README.md's table from results/jax_mlp.json, runs nothing

The model follows the peers' JAX MLP benchmark; see benchmarks/README.md. JAX is a peer, not a
dependency of spmd: without it (`pip install jax`) the JAX columns are skipped with a message.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

NDEV = 8


def _jax_flags(threads: int) -> str:
    """XLA_FLAGS for 8 virtual CPU devices; with one thread, XLA's CPU kernels do not use Eigen's thread pool
    (the 8 device programs of a sharded step may still run concurrently, see the README)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags += f" --xla_force_host_platform_device_count={NDEV}"
    if threads == 1 and "xla_cpu_multi_thread_eigen" not in flags:
        flags += " --xla_cpu_multi_thread_eigen=false"
    return flags.strip()


def import_jax(threads: int):
    """jax, or None with the reason. XLA_FLAGS must be set before jax is first imported."""
    if sys.modules.get("jax") is not None:
        import jax
        if len(jax.devices()) < NDEV:
            return None, f"jax was imported before XLA_FLAGS could be set ({len(jax.devices())} devices)"
        return jax, None
    os.environ["XLA_FLAGS"] = _jax_flags(threads)
    try:
        import jax
    except ImportError:
        return None, "jax is not installed (`.venv/bin/pip install jax`): JAX columns skipped"
    if len(jax.devices()) < NDEV:
        return None, f"jax sees {len(jax.devices())} devices, need {NDEV}: JAX columns skipped"
    return jax, None


if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

import spmd
from benchmarks._common import environment, fmt, md_table, output_arguments, ratio, update_readme, write_results
from spmd import UNSHARDED as U
from spmd import Layout

FULL = dict(B=256, D=1024, H=1024)
QUICK = dict(B=16, D=32, H=32)
LR = 1e-3
CONFIGS = ("1dev", "dp8", "2d")
LABELS = {"1dev": "1 device", "dp8": "data parallel (x=8)", "2d": "2D batch=4 × model=2 (Megatron)"}


def init(B, D, H):
    """The same initial values for every framework (numpy, seed 0): w ~ N(0, 0.02²), zero biases, x, y ~ N(0, 1).
    The peer script draws them with jax.random; only the values differ, not the work."""
    rng = np.random.RandomState(0)
    f = np.float32
    params = {"w1": (rng.standard_normal((D, H)) * 0.02).astype(f), "b1": np.zeros(H, f),
              "w2": (rng.standard_normal((H, D)) * 0.02).astype(f), "b2": np.zeros(D, f)}
    return params, rng.standard_normal((B, D)).astype(f), rng.standard_normal((B, D)).astype(f)


# -- torch and spmd ----------------------------------------------------------------------------------------------
def torch_loss(p, x, y):
    h = torch.relu(x @ p["w1"] + p["b1"])
    out = h @ p["w2"] + p["b2"]
    return ((out - y) ** 2).mean()


def torch_runner(params, x, y, config: str | None, compiled: bool | str = False):
    """step() -> loss tensor: value_and_grad, then p -= LR * g (in place), as the JAX step. `config` None is
    plain torch, eager or (`compiled`) under `torch.compile`; otherwise spmd on 1 device / data parallel x=8 /
    batch=4 × model=2, eager or under `spmd.function` (the gradient and the update run as compiled graphs;
    `autograd.grad` is torch's own break), or (`compiled="whole"`) `spmd.function(whole_step=True)` (the step one
    graph, as jax.jit's)."""
    p = {k: torch.from_numpy(v.copy()) for k, v in params.items()}
    x, y = torch.from_numpy(x.copy()), torch.from_numpy(y.copy())
    if config is not None:
        if config == "1dev":
            mesh = spmd.create_mesh([("x", 1)])
            specs = {"w1": [U, U], "b1": [U], "w2": [U, U], "b2": [U]}
            data = Layout([U, U], mesh)
        elif config == "dp8":
            mesh = spmd.create_mesh([("x", NDEV)])
            specs = {"w1": [U, U], "b1": [U], "w2": [U, U], "b2": [U]}
            data = Layout(["x", U], mesh)
        else:
            mesh = spmd.create_mesh([("batch", 4), ("model", 2)])
            specs = {"w1": [U, "model"], "b1": ["model"], "w2": ["model", U], "b2": [U]}
            data = Layout(["batch", U], mesh)
        p = {k: spmd.DVariable(v, layout=Layout(specs[k], mesh)) for k, v in p.items()}
        x, y = spmd.copy_to_mesh(x, data), spmd.copy_to_mesh(y, data)
    else:
        p = {k: v.requires_grad_() for k, v in p.items()}
    names = list(p)
    leaves = [p[k] for k in names]

    def step():
        loss = torch_loss(p, x, y)
        grads = torch.autograd.grad(loss, leaves)
        with torch.no_grad():
            for w, g in zip(leaves, grads):
                w.sub_(g, alpha=LR)
        return loss
    if not compiled:
        return step
    if config is None:
        return torch.compile(step)
    return spmd.function(step, whole_step=True) if compiled == "whole" else spmd.function(step, fullgraph=False)


def torch_value(loss) -> float:
    loss = loss.detach()
    return float(spmd.to_global(loss)) if spmd.is_dtensor(loss) else float(loss)


# -- JAX (the peer script's step) --------------------------------------------------------------------------------
def jax_runner(jax, params, x, y, config: str):
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    def loss_fn(prm, x, y):
        h = jax.nn.relu(x @ prm["w1"] + prm["b1"])
        out = h @ prm["w2"] + prm["b2"]
        return jnp.mean((out - y) ** 2)

    def jstep(prm, x, y):
        loss, g = jax.value_and_grad(loss_fn)(prm, x, y)
        return jax.tree.map(lambda a, b: a - LR * b, prm, g), loss

    devs = jax.devices()
    if config == "1dev":
        s = SingleDeviceSharding(devs[0])
        ps, xs = {k: s for k in params}, s
    elif config == "dp8":
        mesh = Mesh(np.array(devs[:NDEV]).reshape(NDEV), ("x",))
        rep = NamedSharding(mesh, P())
        ps, xs = {k: rep for k in params}, NamedSharding(mesh, P("x", None))
    else:
        mesh = Mesh(np.array(devs[:NDEV]).reshape(4, 2), ("batch", "model"))
        N = lambda *a: NamedSharding(mesh, P(*a))
        ps, xs = {"w1": N(None, "model"), "b1": N("model"), "w2": N("model", None), "b2": N()}, N("batch", None)
    prm = jax.device_put({k: jnp.asarray(v) for k, v in params.items()}, ps)
    x, y = jax.device_put(jnp.asarray(x), xs), jax.device_put(jnp.asarray(y), xs)
    f = jax.jit(jstep, in_shardings=(ps, xs, xs), out_shardings=(ps, None), donate_argnums=(0,))
    compiled = f.lower(prm, x, y).compile()
    state = {"p": prm}

    def step():
        state["p"], loss = compiled(state["p"], x, y)
        jax.block_until_ready((state["p"], loss))  # as the peer: every step waits for its result
        return loss
    return step, _collectives(compiled)


def _collectives(compiled) -> list[str]:
    import re
    txt = compiled.as_text()
    ops = re.findall(r"= (\([^)]*\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                     r"(?:-start)?\(", txt)
    layout = re.compile(r"\{[0-9,]*\}")
    return [op + ":" + layout.sub("", shape) for shape, op in ops]


# -- the benchmark -----------------------------------------------------------------------------------------------
def caption(data: dict) -> str:
    jax = f"JAX {data['jax']} ({NDEV} virtual CPU devices)" if data["jax"] else f"JAX: {data['jax_skipped']}"
    return (f"{data['env']}; {jax}; process on core(s) {data['cores']}. Medians of {data['reps']} repetitions × "
            f"{data['steps']} steps after {data['warm']} warm-up steps; all {len(data['results'])} runs timed "
            "round-robin in one process.")


def readme_table(data: dict) -> str:
    """README.md's table from jax_mlp.json: ms/step of plain torch, spmd and JAX per configuration."""
    m = lambda k: data["results"].get(k, {}).get("median_ms")  # noqa: E731
    rows = [[LABELS[c], fmt(m("torch/1dev")), fmt(m("torch.compile/1dev")), fmt(m(f"spmd/{c}")),
             fmt(m(f"spmd.function/{c}")), fmt(m(f"whole step/{c}")),
             fmt(m(f"jax/{c}")), ratio(m(f"spmd/{c}"), m(f"jax/{c}")), ratio(m(f"spmd.function/{c}"), m(f"jax/{c}")),
             ratio(m(f"whole step/{c}"), m(f"jax/{c}"))]
            for c in CONFIGS]
    s = data["shape"]
    hdr = [f"2-layer MLP, batch {s['B']}, {s['D']} → {s['H']} → {s['D']}, ms/step", "plain torch (1 device)",
           "plain torch.compile (1 device)", "spmd eager", "spmd.function", "spmd.function whole step", "JAX",
           "spmd eager / JAX", "spmd.function / JAX", "whole step / JAX"]
    return caption(data) + "\n\n" + md_table(hdr, rows)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny MLP and few steps: a smoke run")
    p.add_argument("--steps", type=int, default=None, help="steps per timing repetition (default 5)")
    p.add_argument("--reps", type=int, default=None, help="repetitions, median reported (default 7)")
    p.add_argument("--warm", type=int, default=None, help="warm-up steps (default 5, as the peer)")
    p.add_argument("--threads", type=int, default=1, help="torch threads; 1 also turns XLA's Eigen pool off")
    p.add_argument("--cpus", type=int, default=1,
                   help="pin the process to this many cores before JAX starts (0: no pinning; default 1)")
    p.add_argument("--no-jax", action="store_true", help="skip JAX even if it is installed")
    output_arguments(p, "jax_mlp")
    a = p.parse_args(argv)
    if a.readme_only:
        return update_readme("jax_mlp", readme_table, a.out)
    saved_affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        if a.cpus and saved_affinity is not None:
            # threads created from here on (XLA's pools among them) inherit the pinning; restored on return
            os.sched_setaffinity(0, sorted(saved_affinity)[:a.cpus])
        return _main(a)
    finally:
        if saved_affinity is not None:
            os.sched_setaffinity(0, saved_affinity)


def _main(a) -> dict:
    shape = QUICK if a.quick else FULL
    steps = a.steps or (1 if a.quick else 5)
    reps = a.reps or (2 if a.quick else 7)
    warm = a.warm or (1 if a.quick else 5)
    torch.set_num_threads(a.threads)
    warnings.simplefilter("ignore", UserWarning)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    jax, why = (None, "--no-jax: JAX columns skipped") if a.no_jax else import_jax(a.threads)
    if jax is None:
        print(f"NOTE: {why}")
    params, x, y = init(**shape)
    runners, collectives, errors = {}, {}, []
    runners[("torch", "1dev")] = torch_runner(params, x, y, None)
    runners[("torch.compile", "1dev")] = torch_runner(params, x, y, None, compiled=True)
    for c in CONFIGS:
        runners[("spmd", c)] = torch_runner(params, x, y, c)
        runners[("spmd.function", c)] = torch_runner(params, x, y, c, compiled=True)
        runners[("whole step", c)] = torch_runner(params, x, y, c, compiled="whole")
        if jax is not None:
            try:
                runners[("jax", c)], collectives[c] = jax_runner(jax, params, x, y, c)
            except Exception as e:
                errors.append(f"- JAX {LABELS[c]}: {type(e).__name__}: {str(e)[:200]}")
    t0 = time.time()
    res = {k: {"losses": [], "ms": [], "cpu_ms": []} for k in runners}
    for k, step in runners.items():
        for _ in range(warm):
            res[k]["losses"].append(float(step()) if k[0] == "jax" else torch_value(step()))
    for _ in range(reps):  # round-robin over every framework and configuration
        for k, step in runners.items():
            c0, t = time.process_time(), time.perf_counter()
            for _ in range(steps):
                loss = step()
            res[k]["ms"].append((time.perf_counter() - t) / steps * 1e3)
            res[k]["cpu_ms"].append((time.process_time() - c0) / steps * 1e3)
            res[k]["losses"].append(float(loss) if k[0] == "jax" else torch_value(loss))
    elapsed = time.time() - t0
    spmd_coll = {}
    for c in CONFIGS:  # spmd's collectives per step, counted at its in-process backend
        from types import SimpleNamespace

        from benchmarks.bench_demo import CountCollectives
        with CountCollectives(SimpleNamespace(phase="step")) as cc:
            runners[("spmd", c)]()
        spmd_coll[c] = [f"{k[1]}[{k[2]}] × {n} ({cc.bytes[k] / 2**20:.2f} MiB/device)"
                        for k, n in sorted(cc.calls.items())]
    for r in res.values():
        r["median_ms"], r["median_cpu_ms"] = statistics.median(r["ms"]), statistics.median(r["cpu_ms"])
    ref = res[("torch", "1dev")]["losses"]
    for k, r in res.items():
        r["max_rel_loss_diff"] = max(abs(u - v) / max(abs(v), 1e-12) for u, v in zip(r["losses"], ref))

    def m(fw, c, key="median_ms"):
        return res.get((fw, c), {}).get(key)
    t_plain = m("torch", "1dev")
    hdr = ["configuration", "spmd ms/step", "spmd.function ms/step", "whole step ms/step", "JAX ms/step",
           "plain torch ms/step (1 device)", "plain torch.compile ms/step (1 device)", "spmd/JAX",
           "spmd.function/JAX", "whole step/JAX", "spmd/torch", "JAX/torch", "spmd CPU ms/step", "JAX CPU ms/step",
           "spmd loss rel. Δ", "spmd.function loss rel. Δ", "whole step loss rel. Δ", "JAX loss rel. Δ"]
    rows = []
    for c in CONFIGS:
        rows.append([LABELS[c], fmt(m("spmd", c), 2), fmt(m("spmd.function", c), 2), fmt(m("whole step", c), 2),
                     fmt(m("jax", c), 2), fmt(t_plain, 2), fmt(m("torch.compile", "1dev"), 2),
                     ratio(m("spmd", c), m("jax", c)), ratio(m("spmd.function", c), m("jax", c)),
                     ratio(m("whole step", c), m("jax", c)),
                     ratio(m("spmd", c), t_plain), ratio(m("jax", c), t_plain),
                     fmt(m("spmd", c, "median_cpu_ms"), 1), fmt(m("jax", c, "median_cpu_ms"), 1),
                     f"{res[('spmd', c)]['max_rel_loss_diff']:.1e}",
                     f"{res[('spmd.function', c)]['max_rel_loss_diff']:.1e}",
                     f"{res[('whole step', c)]['max_rel_loss_diff']:.1e}",
                     f"{res[('jax', c)]['max_rel_loss_diff']:.1e}" if ("jax", c) in res else "–"])
    data = {"env": environment(), "jax": jax.__version__ if jax is not None else None, "jax_skipped": why,
            "threads": a.threads, "cores": cores, "shape": shape, "steps": steps, "reps": reps, "warm": warm,
            "quick": a.quick, "results": {f"{fw}/{c}": r for (fw, c), r in res.items()},
            "jax_collectives": collectives, "spmd_collectives": spmd_coll, "errors": errors}
    xla_flags = f" XLA_FLAGS=`{os.environ.get('XLA_FLAGS', '')}`." if jax is not None else ""
    threads_note = (
        f"Threads: torch.set_num_threads({a.threads}); process pinned to core(s) {cores} of "
        f"{os.cpu_count()} (`--cpus {a.cpus}`, `os.sched_setaffinity` before JAX starts, so XLA's threads are "
        "pinned too: " + ("both frameworks get exactly the same single core). " if a.cpus == 1 else "). ")
        + ("XLA's CPU kernels run without Eigen's intra-op thread pool (`--xla_cpu_multi_thread_eigen=false`); "
           "XLA still runs the programs of the 8 virtual devices of a sharded step concurrently (one per "
           "device) and keeps helper threads, so unpinned its CPU ms/step can exceed its wall ms/step." if a.threads == 1 else
           "XLA uses its default thread pools (as the peer script)."))
    md = "\n".join([
        "# JAX 2-layer MLP training step (ms/step)", "",
        f"{caption(data)}{xla_flags} Run time {elapsed:.0f} s"
        + (" — QUICK smoke run, numbers are noise." if a.quick else "."), "",
        f"Model (peer script `jax_mlp_bench.py`): `relu(x @ w1 + b1) @ w2 + b2`, batch {shape['B']}, "
        f"{shape['D']} → {shape['H']} → {shape['D']}, mean-squared error, `value_and_grad` then p ← p − {LR}·g. "
        "Same initial values (numpy seed 0) everywhere. JAX: `jax.jit` with in/out shardings, donated "
        "parameters, `block_until_ready` after every step. spmd/plain torch: `torch.autograd.grad` then in-place "
        "`sub_` under `no_grad`. 1 device: spmd on `create_mesh([('x', 1)])`, JAX on one device of the 8. Data "
        "parallel: mesh x=8, data sharded on the batch, parameters replicated. 2D: mesh batch=4 × model=2, "
        "w1 [U, 'model'], b1 ['model'], w2 ['model', U], b2 replicated, data on 'batch'. "
        "spmd/torch and JAX/torch divide by plain torch on one device. Loss rel. Δ: largest relative "
        "difference from plain torch's loss over all steps.", "", threads_note, "",
        md_table(hdr, rows), "",
        "spmd collectives per step (calls of its in-process backend, bytes of one device's input): "
        + "; ".join(f"{LABELS[c]}: {', '.join(spmd_coll[c]) or 'none'}" for c in CONFIGS) + ".", "",
        "JAX collectives per step (from the compiled HLO): "
        + ("; ".join(f"{LABELS[c]}: {collectives.get(c) or 'none'}" for c in CONFIGS) if collectives else "–"), ""])
    if errors:
        md += "\n## Failures\n\n" + "\n".join(errors) + "\n"
    write_results("jax_mlp", md, data, a.out, readme=readme_table)
    return data


if __name__ == "__main__":
    main()
