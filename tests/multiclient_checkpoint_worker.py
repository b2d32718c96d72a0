"""One client of a multi-client checkpoint test (started by tests/test_multiclient_checkpoint.py with torchrun's
environment, 2 clients x 2 virtual CPU devices, mesh batch=2 x model=2).

Usage: python multiclient_checkpoint_worker.py SCENARIO PATH; the last stdout line is `RESULT <json>`.
Scenarios: `save` (train 3 steps, save, train 3 more: the uninterrupted losses; client 0 also writes the global
values at the save to PATH.ref.pt), `resume` (fresh model and optimizer, load, train 3 steps), `crash` (client 1
dies after writing its shards, before the save completes).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

D, H, O, BATCH = 8, 16, 4, 16
# Megatron-like: fc1 column-parallel (weight and bias sharded on the output features over "model"), fc2
# row-parallel (weight sharded on its input features, bias replicated); the table is sharded over both mesh dims,
# so client 1 holds the first replica of some shards and must write them
LAYOUTS = {r"fc1\.weight": ["model", "unsharded"], r"fc1\.bias": ["model"], r"fc2\.weight": ["unsharded", "model"]}


def _result(value) -> None:
    print("RESULT " + json.dumps(value), flush=True)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(D, H)
        self.fc2 = torch.nn.Linear(H, O)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def build(seed: int, mesh, layouts=LAYOUTS):
    """The model (float64) distributed on `mesh` with `layouts`, and a fresh AdamW (mesh None: plain torch)."""
    import spmd
    torch.manual_seed(seed)
    model = Net().double()
    if mesh is not None:
        spmd.distribute_module(model, mesh, layouts)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def table_value() -> torch.Tensor:
    return torch.arange(48, dtype=torch.float64).reshape(8, 6) / 7


def train_step(model, opt, mesh, i: int, batch_dim: str = "batch") -> float:
    import spmd
    from spmd import UNSHARDED as U, Layout
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(BATCH, D, generator=g, dtype=torch.float64)
    y = torch.randn(BATCH, O, generator=g, dtype=torch.float64)
    if mesh is not None:
        x, y = (spmd.copy_to_mesh(t, Layout([batch_dim, U], mesh)) for t in (x, y))
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    return loss.item()


def _setup():
    import spmd
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=2)
    return spmd.create_distributed_mesh([("batch", 2), ("model", 2)])


def _state(model, opt, table, step):
    return {"model": model, "optim": opt, "table": table, "step": step}


def save(path):
    import spmd
    from spmd import Layout
    mesh = _setup()
    model, opt = build(0, mesh)
    table = spmd.copy_to_mesh(table_value(), Layout(["batch", "model"], mesh))
    losses = [train_step(model, opt, mesh, i) for i in range(3)]
    start = time.monotonic()
    spmd.checkpoint.save(_state(model, opt, table, 3), path)
    elapsed = time.monotonic() - start
    exists = spmd.checkpoint.is_checkpoint(path)  # on every client, right after save returns
    # the global values at the save, for the single-process load to compare against
    params = dict(model.named_parameters())
    ref = {"model": {k: spmd.to_global(v.detach()) for k, v in params.items()},
           "optim": {k: {n: (spmd.to_global(s) if isinstance(s, spmd.DTensor) else s.clone())
                         for n, s in opt.state[p].items()} for k, p in params.items()},
           "table": spmd.to_global(table)}
    if spmd.client_id() == 0:
        torch.save(ref, str(path) + ".ref.pt")
    spmd.barrier(mesh)
    uninterrupted = [train_step(model, opt, mesh, i) for i in range(3, 6)]
    _result({"client": spmd.client_id(), "losses": losses, "uninterrupted": uninterrupted, "exists": exists,
             "save_s": elapsed})


def resume(path):
    import spmd
    from spmd import Layout
    mesh = _setup()
    model, opt = build(1, mesh)  # other initial values: everything must come from the checkpoint
    table = spmd.zeros((8, 6), dtype=torch.float64, layout=Layout(["batch", "model"], mesh))
    state = _state(model, opt, table, 0)
    spmd.checkpoint.load(state, path)
    layouts = {k: spmd.fetch_layout(s).sharding_specs for k, s in opt.state[model.fc1.weight].items()
               if isinstance(s, spmd.DTensor)}
    table_ok = torch.equal(spmd.to_global(table), table_value())
    resumed = [train_step(model, opt, mesh, i) for i in range(3, 6)]
    _result({"client": spmd.client_id(), "step": state["step"], "resumed": resumed, "state_layouts": layouts,
             "table_ok": table_ok})


def crash(path):
    """Client 1 dies after writing its shards (before DCP's metadata and the rename); client 0 reports what
    its save raised and how long it took."""
    import torch.distributed.checkpoint as dcp
    import spmd
    from spmd import Layout
    mesh = _setup()
    model, opt = build(0, mesh)
    table = spmd.copy_to_mesh(table_value(), Layout(["batch", "model"], mesh))
    train_step(model, opt, mesh, 0)
    if spmd.client_id() == 1:
        write_data = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            future = write_data(self, plan, planner)
            future.wait()
            os._exit(1)  # killed mid-save: its files are written, the save is not complete
        dcp.FileSystemWriter.write_data = write_then_die
    start = time.monotonic()
    try:
        spmd.checkpoint.save(_state(model, opt, table, 1), path)
        error = None
    except BaseException as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {e}"
    _result({"client": spmd.client_id(), "error": error, "elapsed": time.monotonic() - start,
             "exists": spmd.checkpoint.is_checkpoint(path)})
    sys.stdout.flush()
    os._exit(0)  # the peer is gone: skip the exit-time meeting


def fail(path):
    """Client 1's storage fails while writing its shards: every client's save raises that error."""
    import torch.distributed.checkpoint as dcp
    import spmd
    from spmd import Layout
    mesh = _setup()
    table = spmd.copy_to_mesh(table_value(), Layout(["batch", "model"], mesh))
    if spmd.client_id() == 1:
        def disk_full(self, plan, planner):
            raise OSError(28, "No space left on device (injected)")
        dcp.FileSystemWriter.write_data = disk_full
    try:
        spmd.checkpoint.save({"table": table}, path)
        error = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {e}"
    spmd.barrier(mesh)  # the clients are still in step: training could go on
    _result({"client": spmd.client_id(), "error": error, "exists": spmd.checkpoint.is_checkpoint(path),
             "table_sum": table.sum().item()})


if __name__ == "__main__":
    globals()[sys.argv[1]](sys.argv[2])
