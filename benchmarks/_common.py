"""Shared helpers for the benchmark scripts: timing, an in-process torch.distributed group, markdown tables."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def launch_clients(script: str, argv: list[str], world: int, timeout: float) -> dict:
    """Runs `script argv --worker-out FILE` as `world` clients of one gloo group on 127.0.0.1 (1 thread each, the
    environment torchrun gives), all killed at `timeout` seconds; returns the JSON that client 0 writes to FILE."""
    name = os.path.basename(script)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        procs = []
        for rank in range(world):
            env = {k: v for k, v in os.environ.items() if not k.startswith(("DTENSOR_", "SPMD_"))}
            env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1", SPMD_COLLECTIVE_TIMEOUT="120",
                       PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(script), *argv, "--worker-out", out],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + timeout
        logs = []
        try:
            for p in procs:
                try:
                    logs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1)))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"{name}: a client ran past {timeout:g}s") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        if any(p.returncode for p in procs) or not os.path.exists(out):
            tail = "\n".join(f"client {r} (rc {p.returncode}):\n{logs[r][1][-3000:] if r < len(logs) else ''}"
                             for r, p in enumerate(procs))
            raise RuntimeError(f"{name}: the clients failed\n{tail}")
        with open(out) as f:
            return json.load(f)


@contextlib.contextmanager
def torch_dist_ws1(backend: str = "gloo"):
    """A process group of world size 1 in this process (reuses one that is already initialised); `backend` "nccl"
    for torch DTensor on a CUDA mesh."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        if owned:
            dist.destroy_process_group()


def time_once(fn: Callable[[], object], iters: int) -> float:
    """µs per call over `iters` calls (no warm-up)."""
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters * 1e6


def time_cases(cases: dict[str, Callable[[], object]], iters: int, reps: int, warm: int = 50) -> dict[str, dict]:
    """Round-robin timing: every repetition times each case once, so slow drift of the machine hits all cases
    alike. Returns per case the median µs/call over `reps` and the individual repetitions (or an error)."""
    out: dict[str, dict] = {}
    live = {}
    for name, fn in cases.items():
        try:
            for _ in range(warm):
                fn()
            live[name] = fn
            out[name] = {"runs": []}
        except Exception as e:  # a case spmd (or torch) cannot run is reported, not fatal
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    for _ in range(reps):
        for name, fn in live.items():
            out[name]["runs"].append(time_once(fn, iters))
    for name in live:
        out[name]["median"] = statistics.median(out[name]["runs"])
    return out


def med(res: dict, name: str) -> float | None:
    r = res.get(name)
    return None if r is None or "median" not in r else r["median"]


def fmt(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "–"
    return f"{a / b:.2f}×"


def diff(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "–"
    return f"{a - b:+.1f}"


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def status_kib(field: str) -> int | None:
    """VmRSS / VmHWM (peak RSS) of this process from /proc (Linux), in KiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_kib() -> int:
    """Peak resident memory of this process, in KiB. VmHWM, not getrusage's ru_maxrss (only where there is no
    /proc): ru_maxrss survives execve, so a child forked from a big parent reports the parent's peak."""
    return status_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def environment() -> str:
    return (f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()} ({cpu_name()}), "
            f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}")


def cpu_name() -> str:
    """The processor's model name (Linux's /proc/cpuinfo; else what `platform` knows): timings differ between the
    kinds of machine a benchmark may run on."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def write_results(stem: str, markdown: str, data: dict, out_dir: str | None = None,
                  readme: Callable[[dict], str] | None = None) -> list[str]:
    """Writes `<stem>.md` and `<stem>.json` into `out_dir` (default results/), prints the table and the paths.
    With `readme`, also README.md's `stem` section (see update_readme) — not for a --quick run or another out_dir."""
    out_dir = out_dir or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    md_path = os.path.join(out_dir, stem + ".md")
    js_path = os.path.join(out_dir, stem + ".json")
    with open(md_path, "w") as f:
        f.write(markdown.rstrip() + "\n")
    with open(js_path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    print(markdown)
    print(f"wrote {md_path}, {js_path}")
    if readme is not None and not data.get("quick") and os.path.abspath(out_dir) == RESULTS:
        update_readme(stem, readme)
    return [md_path, js_path]


def output_arguments(parser, stem: str) -> None:
    """Every benchmark's `--out` and `--readme-only` (README.md's table from results/<stem>.json, nothing run)."""
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    parser.add_argument("--readme-only", action="store_true",
                        help=f"README.md's table from results/{stem}.json; no run")


def update_readme(stem: str, readme: Callable[[dict], str], out_dir: str | None = None) -> dict:
    """README.md's `stem` section := readme(<out_dir>/<stem>.json): the stored numbers, nothing is rerun."""
    with open(os.path.join(out_dir or RESULTS, stem + ".json")) as f:
        data = json.load(f)
    if data.get("quick"):
        raise ValueError(f"{stem}.json holds a --quick run (noise); rerun the benchmark before updating README.md")
    write_readme_section(stem, readme(data))
    return data


def write_readme_section(name: str, markdown: str, path: str = README) -> None:
    """Replaces the text between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` in `path`, nothing else."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    with open(path) as f:
        text = f.read()
    i, j = text.find(start), text.find(end)
    if text.count(start) != 1 or text.count(end) != 1 or j < i:
        raise ValueError(f"{path} needs one pair of markers {start} ... {end} (in this order) for this table")
    with open(path, "w") as f:
        f.write(text[:i + len(start)] + "\n\n" + markdown.strip() + "\n\n" + text[j:])
    print(f"wrote the {name} section of {path}")
