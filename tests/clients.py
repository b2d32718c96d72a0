"""Launching real multi-client runs for tests: N processes on 127.0.0.1 with torchrun's (or TF's) environment.

Every run is under a hard timeout and its processes are killed when it overruns, so a bug can fail a test but
never hang the suite.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import spmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict:
    """This process's environment without any client configuration, one thread, spmd importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTENSOR_", "SPMD_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(spmd.__file__).parents[1]), env.get("PYTHONPATH")]))
    return env


def launch(argv: list, n: int = 2, timeout_s: float = 10, env: dict | None = None, dtensor_env: bool = False,
           wait_for: tuple[int, ...] | None = None, hard_timeout: float = 90, require_result: bool = False):
    """Runs `python *argv` as `n` clients; returns (each client's last `RESULT {json}` line or None, outputs).

    `timeout_s`: the collective timeout the clients use. `dtensor_env`: configure them with TF's variables instead
    of torchrun's. `wait_for`: the clients awaited (the others are killed once those are done); without it every
    client must exit 0. `require_result`: an awaited client without a RESULT line fails the test."""
    port = free_port()
    procs, logs = [], []
    for rank in range(n):
        e = clean_env()
        if dtensor_env:  # TF's variables: the rendezvous is client 0's address
            e.update(DTENSOR_JOBS=",".join(f"127.0.0.1:{port + i if i else port}" for i in range(n)),
                     DTENSOR_CLIENT_ID=str(rank))
        else:  # what torchrun sets
            e.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port))
        e["SPMD_COLLECTIVE_TIMEOUT"] = str(timeout_s)
        e.update(env or {})
        # output to files, not pipes: a client whose output outgrew a pipe would block until it is read, and the
        # clients are awaited one after the other
        logs.append((tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")))
        procs.append(subprocess.Popen([sys.executable, *map(str, argv)], env=e, stdout=logs[-1][0],
                                      stderr=logs[-1][1], text=True))
    deadline = time.monotonic() + hard_timeout
    awaited = wait_for if wait_for is not None else tuple(range(n))
    outputs: list = [None] * n
    try:
        for rank in awaited:
            try:
                procs[rank].wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"client {rank} of {argv} ran past {hard_timeout}s")
            outputs[rank] = tuple(_read(f) for f in logs[rank])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for files in logs:
            for f in files:
                f.close()
    results = []
    for rank, out in enumerate(outputs):
        if out is None:
            results.append(None)
            continue
        lines = [line for line in out[0].splitlines() if line.startswith("RESULT ")]
        if wait_for is None and procs[rank].returncode != 0:
            pytest.fail(f"client {rank} of {argv} exited with {procs[rank].returncode}:\n{out[1][-3000:]}")
        if require_result and not lines:
            pytest.fail(f"client {rank} of {argv} gave no result:\n{out[1][-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]) if lines else None)
    return results, outputs


def _read(f) -> str:
    f.seek(0)
    return f.read()
