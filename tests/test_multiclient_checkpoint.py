"""Multi-client checkpoints: real 2-process runs on 127.0.0.1 (gloo), 2 clients x 2 virtual CPU devices on a
batch=2 x model=2 mesh, saving a model and its AdamW state with Megatron-like layouts.

- the checkpoint loads in ONE process without torch.distributed onto other meshes and layouts (8 devices,
  replicated, plain tensors) with exactly the saved values;
- 2 clients load it back and continue training with exactly the losses of the uninterrupted run (float64);
- DCP's metadata: every tensor's chunks tile it exactly once, each client's file holds only the shards of its
  own devices, and nothing unreferenced is written;
- a client killed mid-save leaves no loadable checkpoint at `path`, and its peer fails instead of hanging.

Every subprocess runs under a hard timeout and is killed when it overruns, so a bug can fail these tests but never
hang the suite.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import spmd
from spmd import UNSHARDED as U, Layout
from tests import clients

WORKER = Path(__file__).with_name("multiclient_checkpoint_worker.py")
HARD_TIMEOUT = 60  # seconds for a whole run (each takes ~4-8 s)

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

sys.path.insert(0, str(WORKER.parent))
import multiclient_checkpoint_worker as worker  # noqa: E402


def launch(scenario: str, path: Path, n: int = 2, timeout_s: float = 10, wait_for=None) -> list:
    """Runs `scenario` of the worker as `n` clients; returns each client's RESULT (None for a client without
    one). `wait_for`: the clients awaited (the others are killed after)."""
    results, _ = clients.launch([WORKER, scenario, path], n=n, timeout_s=timeout_s, wait_for=wait_for,
                                hard_timeout=HARD_TIMEOUT, require_result=True)
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint saved by 2 clients after 3 steps, and the losses of the 3 steps after it."""
    path = tmp_path_factory.mktemp("mc") / "ckpt"
    results = launch("save", path)
    return path, results


def test_save_on_two_clients(saved):
    path, results = saved
    assert all(r["exists"] for r in results)  # complete on every client when save returns
    assert results[0]["losses"] == results[1]["losses"] and results[0]["uninterrupted"] == results[1]["uninterrupted"]
    assert spmd.checkpoint.is_checkpoint(path)
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_load_in_one_process_on_other_meshes_and_layouts(saved):
    path, _ = saved
    assert not torch.distributed.is_initialized()
    ref = torch.load(str(path) + ".ref.pt")
    mesh8 = spmd.create_mesh([("a", 2), ("b", 4)])
    targets = {
        "8 devices, other layouts": (mesh8, {r"fc1\.weight": [U, "b"], r"fc2\.weight": ["a", "b"], r"fc2\.bias": ["a"]},
                                     Layout(["b", "a"], mesh8)),
        "8 devices, replicated": (mesh8, {}, Layout.replicated(mesh8, 2)),
        "plain tensors": (None, None, None),
    }
    for what, (mesh, layouts, table_layout) in targets.items():
        model, opt = worker.build(7, mesh, layouts)
        table = (spmd.zeros((8, 6), dtype=torch.float64, layout=table_layout) if mesh is not None
                 else torch.zeros(8, 6, dtype=torch.float64))
        state = {"model": model, "optim": opt, "table": table, "step": 0}
        spmd.checkpoint.load(state, path)
        glob = (lambda t: spmd.to_global(t)) if mesh is not None else (lambda t: t)
        assert state["step"] == 3, what
        assert torch.equal(glob(table), ref["table"]), what
        for name, p in model.named_parameters():
            assert torch.equal(glob(p.detach()), ref["model"][name]), (what, name)
            for key, want in ref["optim"][name].items():
                got = opt.state[p][key]
                if mesh is not None and key != "step":
                    assert spmd.fetch_layout(got) == spmd.fetch_layout(p), (what, name, key)
                assert torch.equal(glob(got) if isinstance(got, spmd.DTensor) else got, want), (what, name, key)


def test_two_clients_resume_with_the_uninterrupted_losses(saved):
    path, saved_results = saved
    results = launch("resume", path)
    for r in results:
        assert r["step"] == 3 and r["table_ok"]
        assert r["state_layouts"] == {"exp_avg": ["model", "unsharded"], "exp_avg_sq": ["model", "unsharded"]}
        assert r["resumed"] == saved_results[0]["uninterrupted"]  # float64, bitwise


def test_metadata_each_shard_written_once_by_its_owner(saved):
    path, _ = saved
    import torch.distributed.checkpoint as dcp
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    referenced: dict[str, int] = {}
    tensors = 0
    for fqn, md in metadata.state_dict_metadata.items():
        if not hasattr(md, "chunks"):
            continue
        tensors += 1
        cover = torch.zeros(tuple(md.size), dtype=torch.int32)
        for chunk in md.chunks:
            cover[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] += 1
        assert bool((cover == 1).all()), f"{fqn}: chunks overlap or leave holes: {md.chunks}"
    by_file: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append(index)
        referenced[info.relative_path] = referenced.get(info.relative_path, 0) + info.length
    # nothing unreferenced written: the files hold exactly the items the metadata points to
    for name, length in referenced.items():
        assert (path / name).stat().st_size == length, name
    # the table (8 x 6, sharded batch x model) has 4 shards; client c holds rows 4c..4c+3
    table = {tuple(i.offset): f for f, items in by_file.items() for i in items if i.fqn == "table"}
    assert table == {(0, 0): "__0_0.distcp", (0, 3): "__0_0.distcp", (4, 0): "__1_0.distcp", (4, 3): "__1_0.distcp"}
    # the model's shards (replicated over batch) are written by client 0, each once
    fc1 = sorted(tuple(i.offset) for i in metadata.storage_data if i.fqn == "model.fc1.weight")
    assert fc1 == [(0, 0), (8, 0)]
    assert all(f == "__0_0.distcp" for f, items in by_file.items() for i in items
               if i.fqn.startswith("optim.state") and not i.fqn.endswith(".step"))
    # plain tensors (AdamW's `step`), which every client holds, are written once, by one of them (DCP's dedup)
    for fqn in ("optim.state.0.step", "optim.state.3.step"):
        assert len([i for i in metadata.storage_data if i.fqn == fqn]) == 1, fqn
    assert tensors >= 12


def test_client_killed_mid_save_leaves_no_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    (r0,) = launch("crash", path, timeout_s=5, wait_for=(0,))[:1]
    assert r0 is not None and r0["error"] is not None, r0
    assert r0["error"].startswith("CollectiveError: client 0 of 2: spmd.checkpoint.save of"), r0["error"]
    assert "could not be reached" in r0["error"], r0["error"]
    assert r0["elapsed"] < 8, r0  # it fails at once; it does not wait out a timeout
    assert not r0["exists"]
    assert not [p.name for p in tmp_path.iterdir()]  # the surviving client removed the temporary directory
    assert not spmd.checkpoint.is_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        spmd.checkpoint.load({"step": 0}, path)


def test_a_failing_client_fails_the_save_on_every_client(tmp_path):
    path = tmp_path / "ckpt"
    results = launch("fail", path)
    for r in results:
        assert r["error"] == "OSError: [Errno 28] No space left on device (injected)", r
        assert not r["exists"] and r["table_sum"] == pytest.approx(worker.table_value().sum().item())
    assert not [p.name for p in tmp_path.iterdir()]
