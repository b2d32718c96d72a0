"""Per-op eager overhead, one process: plain torch vs spmd (1- and 8-virtual-device meshes) vs torch DTensor (ws=1).

usage: python benchmarks/bench_ops.py [--quick] [--iters N] [--reps R] [--n 64] [--no-profile] [--out DIR]
       python benchmarks/bench_ops.py --readme-only   # README.md's table from results/ops.json, runs nothing

Cases follow the peers' per-op benchmark (64x64 fp32, torch.set_num_threads(1)); see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time
import warnings

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import spmd
from benchmarks._common import (
    diff,
    environment,
    fmt,
    md_table,
    med,
    output_arguments,
    ratio,
    time_cases,
    torch_dist_ws1,
    update_readme,
    write_results,
)
from spmd import UNSHARDED, Layout

NDEV = (1, 8)


# -- the operands ------------------------------------------------------------------------------------------------
class SpmdSide:
    """The DTensors of one spmd mesh of `ndev` virtual CPU devices (mesh dim 'x')."""

    def __init__(self, ndev: int, A: torch.Tensor, B: torch.Tensor):
        self.ndev = ndev
        self.mesh = mesh = spmd.create_mesh([("x", ndev)])
        self.R = Layout([UNSHARDED, UNSHARDED], mesh)
        self.S0 = Layout(["x", UNSHARDED], mesh)
        self.S1 = Layout([UNSHARDED, "x"], mesh)
        cp = spmd.copy_to_mesh
        self.aR, self.bR = cp(A, self.R), cp(B, self.R)
        self.aS0, self.bS0 = cp(A, self.S0), cp(B, self.S0)
        self.aS1 = cp(A, self.S1)
        self.mS0 = cp(A > 0, self.S0)  # a boolean mask
        self.a_g = spmd.DVariable(A, layout=self.S0)  # a leaf that requires grad
        self.comps = list(spmd.unpack(self.aS0))  # plain components, for pack
        # a pending (partial) sum over 'x', resolved by the in-process all-reduce the dispatcher inserts after
        # a contraction over a sharded axis; spmd has no public Partial layout, so this times the collective
        from spmd.engine import planner as redistribute
        self._redistribute = redistribute
        self.partial = torch.randn((ndev,) + tuple(A.shape))
        self.ar_steps = redistribute.plan((None, None), (None, None), ("x",))

    def all_reduce(self):
        return self._redistribute.run(self.partial, self.mesh, self.ar_steps)


class _Rewrap(torch.Tensor):
    """The least a wrapper tensor subclass can do per op: unwrap the arguments, run the op, wrap the results. What
    it costs beyond plain torch is torch's own price for a Python subclass (the floor under spmd's and torch
    DTensor's eager overhead)."""
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor, requires_grad: bool = False):
        out = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                  device=inner.device, requires_grad=requires_grad)
        out.inner = inner
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*[_unwrapped(a) for a in args], **{k: _unwrapped(v) for k, v in (kwargs or {}).items()})
        return cls(out) if isinstance(out, torch.Tensor) else out


def _unwrapped(arg):
    if isinstance(arg, _Rewrap):
        return arg.inner
    if isinstance(arg, (list, tuple)):  # (the indices of `x[mask]`)
        return [_unwrapped(a) for a in arg]
    return arg


def op_cases(n: int, A, B, sides: dict[int, SpmdSide], dt) -> list[tuple[str, dict]]:
    """[(op name, {column: fn})]: columns 'plain', 'floor' (`_Rewrap`), 'spmd1', 'spmd8', 'stack8' (the stacked
    local kernel spmd runs on 8 devices, i.e. the work with zero overhead) and 'dt' (torch DTensor ws=1)."""
    a, b = A.clone(), B.clone()
    a_g = A.clone().requires_grad_()
    fa, fb, fa_g, fmask = _Rewrap(A.clone()), _Rewrap(B.clone()), _Rewrap(A.clone(), requires_grad=True), _Rewrap(A > 0)
    floors = {"mm R@R": lambda: torch.mm(fa, fb), "add S0+S0": lambda: fa + fb, "relu S0": lambda: torch.relu(fa),
              "view S0 → (n, n/2, 2)": lambda: fa.view(n, n // 2, 2), "t() S0 → S1": lambda: fa.t(),
              "mm S0@R fwd, requires_grad": lambda: torch.mm(fa_g, fb)}
    floors.update({"mm S0@R": floors["mm R@R"], "mm S1@S0 (contraction; spmd all-reduces, DT → Partial)":
                   floors["mm R@R"], "sum S0 → scalar (spmd all-reduces, DT → Partial)": lambda: fa.sum(),
                   "x[mask] S0 (a replicated result: spmd gathers both, DT raises)": lambda: fa[fmask]})
    s1, s8 = sides.get(1), sides.get(8)
    rows = []

    def row(name, plain, spmd_fn, stack_fn, dt_fn):
        cols = {"plain": plain}
        if name in floors:
            cols["floor"] = floors[name]
        for k, s in (("spmd1", s1), ("spmd8", s8)):
            if s is not None:
                cols[k] = (lambda s=s: spmd_fn(s))
        if s8 is not None:
            cols["stack8"] = (lambda s=s8: stack_fn(s))
        if dt is not None:
            cols["dt"] = dt_fn
        rows.append((name, cols))

    def ar(o):  # what the in-process all-reduce does to stacked partial results
        return o.sum(0, keepdim=True).expand(o.shape).reshape(o.shape)

    L = lambda t: t._local  # noqa: E731
    row("mm R@R", lambda: torch.mm(a, b), lambda s: torch.mm(s.aR, s.bR),
        lambda s: torch.bmm(L(s.aR), L(s.bR)), dt and (lambda: torch.mm(dt["aR"], dt["bR"])))
    row("mm S0@R", lambda: torch.mm(a, b), lambda s: torch.mm(s.aS0, s.bR),
        lambda s: torch.bmm(L(s.aS0), L(s.bR)), dt and (lambda: torch.mm(dt["aS0"], dt["bR"])))
    row("mm S1@S0 (contraction; spmd all-reduces, DT → Partial)", lambda: torch.mm(a, b),
        lambda s: torch.mm(s.aS1, s.bS0), lambda s: ar(torch.bmm(L(s.aS1), L(s.bS0))),
        dt and (lambda: torch.mm(dt["aS1"], dt["bS0"])))
    row("add S0+S0", lambda: a + b, lambda s: s.aS0 + s.bS0, lambda s: L(s.aS0) + L(s.bS0),
        dt and (lambda: dt["aS0"] + dt["bS0"]))
    row("relu S0", lambda: torch.relu(a), lambda s: torch.relu(s.aS0), lambda s: torch.relu(L(s.aS0)),
        dt and (lambda: torch.relu(dt["aS0"])))
    row("sum S0 → scalar (spmd all-reduces, DT → Partial)", lambda: a.sum(), lambda s: s.aS0.sum(),
        lambda s: ar(L(s.aS0).sum((1, 2))), dt and (lambda: dt["aS0"].sum()))
    row("view S0 → (n, n/2, 2)", lambda: a.view(n, n // 2, 2), lambda s: s.aS0.view(n, n // 2, 2),
        lambda s: L(s.aS0).view(s.ndev, n // s.ndev, n // 2, 2), dt and (lambda: dt["aS0"].view(n, n // 2, 2)))
    row("t() S0 → S1", lambda: a.t(), lambda s: s.aS0.t(), lambda s: L(s.aS0).transpose(1, 2),
        dt and (lambda: dt["aS0"].t()))
    row("mm S0@R fwd, requires_grad", lambda: torch.mm(a_g, b), lambda s: torch.mm(s.a_g, s.bR),
        lambda s: torch.bmm(L(s.a_g).detach(), L(s.bR)), dt and (lambda: torch.mm(dt["a_g"], dt["bR"])))
    mask = A > 0
    row("x[mask] S0 (a replicated result: spmd gathers both, DT raises)", lambda: a[mask],
        lambda s: s.aS0[s.mS0], lambda s: L(s.aS0).reshape(n, n)[mask], dt and (lambda: dt["aS0"][dt["mS0"]]))
    row("wrap local → DTensor (spmd.pack / DT.from_local no check)", lambda: None,
        lambda s: spmd.pack(s.comps, s.S0), lambda s: None,
        dt and (lambda: dt["DTensor"].from_local(dt["la"], dt["mesh"], dt["S0"], run_check=False)))
    row("unwrap DTensor → local (spmd.unpack / DT.to_local)", lambda: None, lambda s: spmd.unpack(s.aS0),
        lambda s: None, dt and (lambda: dt["aS0"].to_local()))
    return rows


def relayout_cases(n: int, A, sides: dict[int, SpmdSide], dt) -> list[tuple[str, dict]]:
    """[(relayout, {column: fn})]: 'raw1'/'raw8' are the same data movement done by hand on plain tensors
    (chunk, cat, sum over n partial results), 'spmd1'/'spmd8' the spmd relayout, 'dt' DT.redistribute."""
    rows = []
    chunks = {k: [c.clone() for c in torch.chunk(A, k, 0)] for k in NDEV}
    parts = {k: torch.randn(k, n, n) for k in NDEV}

    def row(name, raw_fn, spmd_fn, dt_fn):
        cols = {}
        for k, s in sides.items():
            cols[f"raw{k}"] = (lambda k=k: raw_fn(k))
            cols[f"spmd{k}"] = (lambda s=s: spmd_fn(s))
        if dt is not None:
            cols["dt"] = dt_fn
        rows.append((name, cols))

    row("R → S0 (local slice)", lambda k: torch.chunk(A, k, 0), lambda s: spmd.relayout(s.aR, s.S0),
        dt and (lambda: dt["aR"].redistribute(dt["mesh"], dt["S0"])))
    row("S0 → R (all-gather)", lambda k: torch.cat(chunks[k], 0), lambda s: spmd.relayout(s.aS0, s.R),
        dt and (lambda: dt["aS0"].redistribute(dt["mesh"], dt["R"])))
    row("S0 → S1 (all-to-all)", lambda k: torch.cat(chunks[k], 0).chunk(k, 1), lambda s: spmd.relayout(s.aS0, s.S1),
        dt and (lambda: dt["aS0"].redistribute(dt["mesh"], dt["S1"])))
    row("partial → R (contraction all-reduce)", lambda k: parts[k].sum(0), lambda s: s.all_reduce(),
        dt and (lambda: dt["P"].redistribute(dt["mesh"], dt["R"])))
    row("S0 → global plain tensor (spmd.to_global / DT.full_tensor)", lambda k: torch.cat(chunks[k], 0),
        lambda s: spmd.to_global(s.aS0), dt and (lambda: dt["aS0"].full_tensor()))
    return rows


def make_dt(A, B):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("x",))
    R, S0, S1 = [Replicate()], [Shard(0)], [Shard(1)]
    d = dict(mesh=mesh, R=R, S0=S0, S1=S1, DTensor=DTensor,
             aR=distribute_tensor(A, mesh, R), bR=distribute_tensor(B, mesh, R),
             aS0=distribute_tensor(A, mesh, S0), bS0=distribute_tensor(B, mesh, S0),
             aS1=distribute_tensor(A, mesh, S1), mS0=distribute_tensor(A > 0, mesh, S0),
             P=DTensor.from_local(torch.randn_like(A), mesh, [Partial()], run_check=False))
    d["a_g"] = distribute_tensor(A, mesh, S0).requires_grad_()
    d["la"] = d["aS0"].to_local()
    d["distribute"] = distribute_tensor
    return d


# -- cache miss / hit -------------------------------------------------------------------------------------------
def cache_costs(reps: int, shapes: int, sides: dict[int, SpmdSide], dt) -> dict[str, dict]:
    """µs per first `mm` S0@R on `shapes` fresh (m x k)@(k x 8) shapes (a sharding-cache miss), then per call on
    the same shapes again (a hit). Every repetition uses shapes never seen before."""
    out: dict[str, dict] = {}

    def record(key, value):
        out.setdefault(key, {"runs": []})["runs"].append(value)

    for rep in range(reps):
        k = 8 + rep  # the contracted size makes every repetition's shapes fresh
        plain = [(torch.randn(64 + 8 * i, k), torch.randn(k, 8)) for i in range(shapes)]  # rows divisible by 8
        record("plain", _first_then_again(plain, torch.mm)[0])
        for k, s in sides.items():
            pairs = [(spmd.copy_to_mesh(x, s.S0), spmd.copy_to_mesh(y, s.R)) for x, y in plain]
            before = spmd.cache_stats()
            miss, hit = _first_then_again(pairs, torch.mm)
            after = spmd.cache_stats()
            record(f"spmd{k} miss", miss)
            record(f"spmd{k} hit", hit)
            record(f"spmd{k} new cache entries", (after["misses"] - before["misses"]) / shapes)
        if dt is not None:
            pairs = [(dt["distribute"](x, dt["mesh"], dt["S0"]), dt["distribute"](y, dt["mesh"], dt["R"]))
                     for x, y in plain]
            miss, hit = _first_then_again(pairs, torch.mm)
            record("dt miss", miss)
            record("dt hit", hit)
    for v in out.values():
        v["median"] = statistics.median(v["runs"])
    return out


def _first_then_again(pairs, fn):
    t = time.perf_counter()
    for x, y in pairs:
        fn(x, y)
    first = (time.perf_counter() - t) / len(pairs) * 1e6
    t = time.perf_counter()
    for x, y in pairs:
        fn(x, y)
    return first, (time.perf_counter() - t) / len(pairs) * 1e6


# -- where the time of one spmd op goes -------------------------------------------------------------------------
class _Null(torch.Tensor):
    """The cheapest possible wrapper subclass: __torch_dispatch__ returns a prebuilt tensor (the floor of
    torch's Python-subclass dispatch, before any spmd code runs)."""
    __torch_function__ = torch._C._disabled_torch_function_impl
    RESULT = None

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return cls.RESULT


def breakdown(side: SpmdSide, iters: int, reps: int) -> dict[str, dict]:
    """Times the pieces of spmd's cache-hit path separately, for add and mm S0@R on a 1-device mesh.

    Reads spmd.engine.dispatch's private cache and `_execute`; the dispatcher is being optimised, so every piece that
    no longer exists is reported as an error instead of failing the run. The cache key is found by diffing the
    cache around a first call on operands of a fresh mesh (a mesh name no other case uses)."""
    from spmd.engine import dispatch as D
    from spmd.dtensor import DTensor
    aten = torch.ops.aten
    mesh = spmd.create_mesh([("x", 1)], mesh_name="breakdown")
    A = side.aS0.shape
    a = spmd.copy_to_mesh(torch.randn(A), Layout(["x", UNSHARDED], mesh))
    b = spmd.copy_to_mesh(torch.randn(A), Layout(["x", UNSHARDED], mesh))
    r = spmd.copy_to_mesh(torch.randn(A), Layout([UNSHARDED, UNSHARDED], mesh))
    null_a = _Null(A)
    _Null.RESULT = null_a
    result = {}
    for name, func, torch_fn, raw_fn, args in (
            ("add S0+S0", aten.add.Tensor, torch.add, torch.add, (a, b)),
            ("mm S0@R", aten.mm.default, torch.mm, torch.bmm, (a, r))):
        cache = getattr(D, "_CACHE", {})
        before = set(cache)
        torch_fn(*args)  # fill the cache
        new = [k for k in cache if k not in before]
        key = new[0] if len(new) == 1 else None
        plan = cache.get(key) if key is not None else None
        locals_ = [x._local for x in args]
        kw = {}
        cases = {
            "whole op: torch.add / torch.mm on DTensors": lambda: torch_fn(*args),
            "  floor: empty __torch_dispatch__ (a subclass returning a prebuilt tensor)":
                lambda: torch_fn(null_a, null_a),
            "  spmd.engine.dispatch.dispatch(func, args, {}) called directly": lambda: D.dispatch(func, args, kw),
            "    cache lookup (dict.get with the prebuilt key)": lambda: cache.get(key),
        }
        if plan is not None:
            out_local = plan.decision.kernel(locals_, args, kw)
            layout = plan.out_layouts[0]
            shape = tuple(layout.global_shape_from_local_shape(out_local.shape[1:]))
            cases.update({
                "    _execute(plan, ...) (kernel + wrap)": lambda: D._execute(plan, args, kw, list(args)),
                "      decision.kernel (the local kernel through spmd's wrapper)":
                    lambda: plan.decision.kernel(locals_, args, kw),
                "      raw torch kernel on the stacked local": lambda: raw_fn(*locals_),
                "      wrap: DTensor(local, layout, shape)": lambda: DTensor(out_local, layout, shape),
                "      _make_wrapper_subclass alone": lambda: torch.Tensor._make_wrapper_subclass(
                    DTensor, shape, dtype=out_local.dtype, device=out_local.device, requires_grad=False),
            })
        res = time_cases(cases, iters, reps, warm=20)
        if plan is None:
            res["    _execute(plan, ...) (kernel + wrap)"] = {
                "error": f"could not find the cache entry (new keys: {len(new)})"}
        d, lk, ex = (med(res, k) for k in ("  spmd.engine.dispatch.dispatch(func, args, {}) called directly",
                                            "    cache lookup (dict.get with the prebuilt key)",
                                            "    _execute(plan, ...) (kernel + wrap)"))
        if None not in (d, lk, ex):
            res["    key build + rest of dispatch() (derived: dispatch − lookup − _execute)"] = {
                "median": d - lk - ex, "runs": []}
        w, fl = med(res, "whole op: torch.add / torch.mm on DTensors"), med(
            res, "  floor: empty __torch_dispatch__ (a subclass returning a prebuilt tensor)")
        if None not in (w, d, fl):
            res["  torch → __torch_dispatch__ entry beyond the floor (derived: whole − dispatch() − floor)"] = {
                "median": w - d - fl, "runs": []}
        result[name] = res
    return result


def profile_ops(side: SpmdSide, calls: int, top: int = 20) -> dict[str, str]:
    """cProfile of `calls` cache-hit calls of add and mm S0@R on 1 device; per function tottime in µs/call."""
    out = {}
    for name, fn in (("add S0+S0", lambda: side.aS0 + side.bS0), ("mm S0@R", lambda: torch.mm(side.aS0, side.bR))):
        for _ in range(100):
            fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        st = pstats.Stats(prof)
        rows = []
        total = 0.0
        for (file, line, func), (cc, nc, tt, ct, callers) in st.stats.items():
            total += tt
            rows.append((tt, ct, nc, f"{os.path.basename(file)}:{line}({func})" if line else func))
        rows.sort(reverse=True)
        lines = [f"{name}: {calls} calls under cProfile, {total / calls * 1e6:.1f} µs/call profiled "
                 "(cProfile inflates Python-heavy code ~2x; use the proportions)",
                 f"{'tottime µs/call':>16} {'cumtime µs/call':>16} {'calls/op':>9}  function"]
        for tt, ct, nc, fname in rows[:top]:
            lines.append(f"{tt / calls * 1e6:16.2f} {ct / calls * 1e6:16.2f} {nc / calls:9.2f}  {fname}")
        out[name] = "\n".join(lines)
    return out


# -- report -------------------------------------------------------------------------------------------------------
README_ROWS = (  # (README label, section of ops.json, cases shown as "a / b / c")
    ("`mm` S0@R", "ops", ("mm S0@R",)),
    ("`mm` S1@S0 (sharded contraction)", "ops", ("mm S1@S0 (contraction; spmd all-reduces, DT → Partial)",)),
    ("`add` / `relu` / `sum`", "ops", ("add S0+S0", "relu S0", "sum S0 → scalar (spmd all-reduces, DT → Partial)")),
    ("`view` / `t()`", "ops", ("view S0 → (n, n/2, 2)", "t() S0 → S1")),
    ("`mm` forward with `requires_grad`", "ops", ("mm S0@R fwd, requires_grad",)),
    ("`x[mask]` (the result's shape depends on the values; torch DT raises)", "ops",
     ("x[mask] S0 (a replicated result: spmd gathers both, DT raises)",)),
    ("cache miss: first `mm` on a new shape", "cache", ("miss",)),
    ("relayout S0→R / S0→S1 / R→S0", "relayout",
     ("S0 → R (all-gather)", "S0 → S1 (all-to-all)", "R → S0 (local slice)")),
)


def caption(data: dict) -> str:
    return (f"{data['env']}. {data['n']}×{data['n']} fp32, medians of {data['reps']} repetitions × {data['iters']} "
            f"calls (cache-miss rows: {data['reps']} × {data['shapes']} fresh shapes), µs per call.")


def readme_table(data: dict) -> str:
    """README.md's per-op table (plain torch, spmd on 1 device, torch DT at ws=1) from ops.json."""
    def medians(section, case):  # µs: plain torch (relayouts: the raw data movement), floor, spmd 1-dev, torch DT
        if section == "cache":
            return tuple(med(data["cache"], k) for k in ("plain", "floor", f"spmd1 {case}", f"dt {case}"))
        r = data[section][case]
        return med(r, "raw1" if section == "relayout" else "plain"), med(r, "floor"), med(r, "spmd1"), med(r, "dt")

    def cell(values):
        return " / ".join(map(fmt, values)) if any(v is not None for v in values) else "–"

    rows = []
    for label, section, cases in README_ROWS:
        plain, floor, s, d = zip(*(medians(section, c) for c in cases))
        rows.append([label, cell(plain) + (" (raw)" if section == "relayout" else ""), cell(floor), cell(s), cell(d),
                     " / ".join(map(ratio, s, d)), " / ".join(map(ratio, s, floor)) if any(floor) else "–"])
    n = data["n"]
    hdr = [f"op, {n}×{n} fp32, µs per call", "plain torch", "Python subclass floor", "spmd, 1 device",
           "torch DT, ws=1", "spmd / torch DT", "spmd / floor"]
    return caption(data) + "\n\n" + md_table(hdr, rows)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few iterations: a smoke run, numbers are noise")
    p.add_argument("--iters", type=int, default=None, help="calls per timing repetition (default 1000)")
    p.add_argument("--reps", type=int, default=None, help="repetitions, the median is reported (default 5)")
    p.add_argument("--shapes", type=int, default=None, help="fresh shapes per cache-miss repetition (100)")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--no-dt", action="store_true", help="skip torch.distributed.tensor")
    p.add_argument("--no-profile", action="store_true")
    output_arguments(p, "ops")
    a = p.parse_args(argv)
    if a.readme_only:
        return update_readme("ops", readme_table, a.out)
    iters = a.iters or (20 if a.quick else 1000)
    reps = a.reps or (3 if a.quick else 5)
    shapes = a.shapes or (5 if a.quick else 100)
    warm = 3 if a.quick else 50
    n = a.n
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)
    torch.manual_seed(0)
    A, B = torch.randn(n, n), torch.randn(n, n)
    sides = {k: SpmdSide(k, A, B) for k in NDEV}
    t0 = time.time()
    with torch_dist_ws1() if not a.no_dt else contextlib.nullcontext():
        dt = None if a.no_dt else make_dt(A, B)
        ops = [(name, time_cases(cols, iters, reps, warm)) for name, cols in op_cases(n, A, B, sides, dt)]
        rel = [(name, time_cases(cols, iters, reps, warm)) for name, cols in relayout_cases(n, A, sides, dt)]
        cache = cache_costs(reps, shapes, sides, dt)
    bd = breakdown(sides[1], iters, reps)
    prof = {} if a.no_profile else profile_ops(sides[1], 200 if a.quick else 20000)
    elapsed = time.time() - t0

    # per-op table
    hdr = ["op", "plain torch", "subclass floor", "spmd 1-dev", "spmd 8-dev", "8-dev stacked kernel", "torch DT ws=1",
           "spmd1/torch", "spmd1/floor", "spmd1/DT", "spmd8/DT", "ovh spmd1 (−plain)", "ovh spmd8 (−stacked)",
           "ovh DT (−plain)"]
    rows = []
    for name, r in ops:
        pl, fl, s1, s8, st, d = (med(r, c) for c in ("plain", "floor", "spmd1", "spmd8", "stack8", "dt"))
        if name.startswith(("wrap", "unwrap")):
            pl = st = None
        rows.append([name, fmt(pl), fmt(fl), fmt(s1), fmt(s8), fmt(st), fmt(d), ratio(s1, pl), ratio(s1, fl),
                     ratio(s1, d), ratio(s8, d), diff(s1, pl), diff(s8, st), diff(d, pl)])
    plain_mm_small = cache["plain"]["median"]
    for label in ("hit", "miss"):
        s1, s8 = cache[f"spmd1 {label}"]["median"], cache[f"spmd8 {label}"]["median"]
        d = cache.get(f"dt {label}", {}).get("median")
        rows.append([f"cache {label.upper()}: mm S0@R (m×k)@(k×8), {'same shapes again' if label == 'hit' else f'first call on {shapes} fresh shapes'}",
                     fmt(plain_mm_small), "–", fmt(s1), fmt(s8), "–", fmt(d), ratio(s1, plain_mm_small), "–",
                     ratio(s1, d), ratio(s8, d), diff(s1, plain_mm_small), "–", diff(d, plain_mm_small)])
    errors = [f"- {name} / {col}: {v['error']}" for name, r in ops + rel for col, v in r.items() if "error" in v]
    ops_md = md_table(hdr, rows)

    rhdr = ["relayout", "raw 1", "spmd 1-dev", "raw 8", "spmd 8-dev", "torch DT ws=1 redistribute", "spmd1/DT",
            "spmd8/DT", "ovh spmd1 (−raw1)", "ovh spmd8 (−raw8)", "ovh DT (−raw1)"]
    rrows = []
    for name, r in rel:
        r1, s1, r8, s8, d = (med(r, c) for c in ("raw1", "spmd1", "raw8", "spmd8", "dt"))
        rrows.append([name, fmt(r1), fmt(s1), fmt(r8), fmt(s8), fmt(d), ratio(s1, d), ratio(s8, d), diff(s1, r1),
                      diff(s8, r8), diff(d, r1)])
    rel_md = md_table(rhdr, rrows)

    bhdr = ["piece of the cache-hit path (1-dev)", "add S0+S0 µs", "mm S0@R µs"]
    names = list(dict.fromkeys(list(bd["add S0+S0"]) + list(bd["mm S0@R"])))
    brows = [[nm.replace("  ", "&nbsp;&nbsp;"), fmt(med(bd["add S0+S0"], nm), 2), fmt(med(bd["mm S0@R"], nm), 2)]
             for nm in names]
    bd_md = md_table(bhdr, brows)

    cstats = spmd.cache_stats()
    data = {"env": environment(), "n": n, "iters": iters, "reps": reps, "shapes": shapes, "quick": a.quick,
            "ops": dict(ops), "relayout": dict(rel), "cache": cache, "breakdown": bd, "profile": prof,
            "cache_stats": cstats, "errors": errors}
    md = "\n".join([
        "# spmd per-op eager overhead", "",
        f"{caption(data)} Run time {elapsed:.0f} s" + (" — QUICK smoke run, numbers are noise." if a.quick else "."),
        "",
        "spmd: 1-device mesh `create_mesh([('x',1)])` and 8 virtual CPU devices `[('x',8)]` in one process; torch "
        "DT: `torch.distributed.tensor` on a gloo group of world size 1 in the same process. *Subclass floor*: a "
        "wrapper tensor subclass whose `__torch_dispatch__` only unwraps, runs the op and wraps (torch's own cost of "
        "a Python subclass, which spmd and torch DT both pay). *8-dev stacked kernel* "
        "is the torch op spmd runs on the stacked components `(8, *local)` (the work with zero overhead); an op "
        "on a replicated tensor does 8× the FLOPs on 8 virtual devices. Ratios: spmd/torch = spmd ÷ plain, "
        "spmd/DT = spmd ÷ torch DT; ovh = time − baseline in µs.", "",
        "## Ops (cache hit unless stated)", "", ops_md, "",
        "## Relayout / redistribute", "",
        "raw k = the same data movement by hand on plain tensors for k devices: `torch.chunk(A, k)` (R→S0), "
        "`torch.cat(k chunks)` (S0→R), `cat(...).chunk(k, 1)` (S0→S1), `stack(k partials).sum(0)` (all-reduce). "
        "spmd has no public Partial layout, so the all-reduce row times `spmd.engine.planner.run` with the pending-sum "
        "plan the dispatcher uses after a sharded contraction.", "", rel_md, "",
        "## Where an spmd op's time goes (1-device mesh, cache hit)", "",
        "Each piece timed on its own (same medians); indented rows are parts of the row above. *Derived* rows "
        "are differences of three medians and carry their noise (a negative value means noise, not a saving).",
        "", bd_md, "",
        f"spmd cache after the run: {cstats}", ""])
    if prof:
        md += "\n## cProfile of the 1-device cache-hit path\n\n" + "\n\n".join(
            "```\n" + v + "\n```" for v in prof.values()) + "\n"
    if errors:
        md += "\n## Failures\n\n" + "\n".join(errors) + "\n"
    write_results("ops", md, data, a.out, readme=readme_table)
    return data


if __name__ == "__main__":
    main()
