"""One client of a multi-client failure test (started by tests/test_multiclient_failures.py with torchrun's
environment): clients that die, stall, or run different programs.

Usage: python multiclient_failure_worker.py SCENARIO; the last stdout line is `RESULT <json>`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def _result(value) -> None:
    print("RESULT " + json.dumps(value), flush=True)


def _error(e: Exception, start: float | None = None) -> dict:
    elapsed = {} if start is None else {"elapsed": time.monotonic() - start}
    return {"error": str(e), "type": type(e).__name__} | elapsed


def dead_client():
    import torch
    import spmd
    from spmd import Layout
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=2)
    mesh = spmd.create_distributed_mesh([("x", 4)])
    t = spmd.pack([torch.ones(2), torch.ones(2)], Layout(["x"], mesh))
    t.sum().item()  # both clients are alive here
    if spmd.client_id() == 1:
        if os.environ.get("SPMD_TEST_FAULT") == "stall":
            time.sleep(60)
        if os.environ.get("SPMD_TEST_FAULT") == "raise":
            raise RuntimeError("a bug in client 1")  # an unhandled exception: the client exits with an error
        os._exit(0)  # dies without a word
    start = time.monotonic()
    try:
        spmd.relayout(t, Layout.replicated(mesh, 1))
        _result({"error": None})
    except spmd.CollectiveError as e:
        _result(_error(e, start))


def mismatch():
    import spmd
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=2)
    dims = [("x", 4)] if spmd.client_id() == 0 else [("x", 2), ("y", 2)]
    try:
        spmd.create_distributed_mesh(dims, mesh_name="m")
        _result({"error": None})
    except ValueError as e:
        _result(_error(e))


def disagreeing_sizes():
    """The clients all-gather tensors of different sizes (4 and 8 rows) with SPMD_CHECK_COLLECTIVES=1: every client
    raises a CollectiveError naming both (without the check, gloo aborts one process)."""
    import torch
    import spmd
    from spmd import UNSHARDED as U, Layout
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=1)
    mesh = spmd.create_distributed_mesh([("x", 2)])
    rows = 4 if spmd.client_id() == 0 else 8
    t = spmd.pack([torch.ones(rows)], Layout(["x"], mesh))
    try:
        spmd.relayout(t, Layout([U], mesh))
        _result({"error": None})
    except spmd.CollectiveError as e:
        _result(_error(e))


def extra_collective_before_to_global():
    """Client 0 runs a reduction the other does not, then both call to_global, with SPMD_CHECK_COLLECTIVES=1: each
    raises a CollectiveError naming what the other runs (without the check, gloo aborts one)."""
    import torch
    import spmd
    from spmd import UNSHARDED as U, Layout
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=1)
    mesh = spmd.create_distributed_mesh([("x", 2)])
    t = spmd.copy_to_mesh(torch.arange(8.).reshape(4, 2), Layout(["x", U], mesh))
    try:
        if spmd.client_id() == 0:
            t.sum().item()
        spmd.to_global(t)
        _result({"error": None})
    except spmd.CollectiveError as e:
        _result(_error(e))


def killed_in_backward():
    """Client 1 dies in the middle of a bucketed backward (after its first bucket started): client 0 fails with a
    CollectiveError, within the collective timeout."""
    import torch
    import spmd
    from spmd import UNSHARDED as U, Layout
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=1)
    mesh = spmd.create_distributed_mesh([("batch", 2)])
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    spmd.distribute_module(model, mesh, bucket_cap_mb=1e-6)  # one gradient per bucket
    if spmd.client_id() == 1:
        model[0].weight.register_post_accumulate_grad_hook(lambda p: os._exit(0))
    dx = spmd.copy_to_mesh(torch.randn(4, 8), Layout(["batch", U], mesh))
    spmd.barrier(mesh)  # both clients are alive here
    start = time.monotonic()
    try:
        model(dx).sum().backward()
        [spmd.to_global(p.grad) for p in model.parameters()]
        _result({"error": None})
    except spmd.CollectiveError as e:
        _result(_error(e, start))


def unequal_device_counts():
    """Client 1 holds 4 virtual devices, client 0 two: both ask for a 4-device mesh, which only client 0's count
    fits. Every client gets the ValueError at once (none waits for the others until the timeout)."""
    import spmd
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=2 + 2 * spmd.client_id())
    start = time.monotonic()
    try:
        spmd.create_distributed_mesh([("x", 4)])
        _result({"error": None})
    except ValueError as e:
        _result(_error(e, start))


def _one_client_only(call):
    """Client 0 makes `call` (which every client must make together), client 1 does what SPMD_TEST_OTHER says:
    "exit" (leaves normally) or "op" (runs a reduction instead)."""
    import torch
    import spmd
    from spmd import UNSHARDED as U, Layout
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=1)
    mesh = spmd.create_distributed_mesh([("x", 2)])
    t = spmd.copy_to_mesh(torch.arange(8.).reshape(4, 2), Layout(["x", U], mesh))
    spmd.barrier(mesh)
    start = time.monotonic()
    try:
        if spmd.client_id() == 0:
            call(t)
        elif os.environ["SPMD_TEST_OTHER"] == "op":
            t.sum().item()
        _result({"error": None})
    except spmd.CollectiveError as e:
        _result(_error(e, start))


def save_on_one_client():
    import spmd
    _one_client_only(lambda t: spmd.checkpoint.save({"t": t}, os.path.join(tempfile.mkdtemp(), "ckpt")))


def compiled_step_on_one_client():
    import spmd

    @spmd.function(backend="aot_eager")
    def total(t):
        return (t * 2).sum()
    _one_client_only(lambda t: total(t).item())


if __name__ == "__main__":
    globals()[sys.argv[1]]()
