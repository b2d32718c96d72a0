"""spmd.checkpoint: sharded DCP checkpoints that reshard on load."""

import doctest
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import spmd
import spmd.checkpoint as ck
from spmd import UNSHARDED, Layout
from spmd.mesh import Mesh

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "checkpoint.md"
SHAPE = (8, 12)


def _mesh(kind):
    if kind == "2x2":
        return spmd.create_mesh([("x", 2), ("y", 2)])
    if kind == "2x4":
        return spmd.create_mesh([("a", 2), ("b", 4)])
    if kind == "8":
        return spmd.create_mesh([("d", 8)])
    if kind == "2x2x2":
        return spmd.create_mesh([("p", 2), ("q", 2), ("r", 2)])
    if kind == "1":
        return spmd.create_mesh([("x", 1)])
    raise ValueError(kind)


def _value(dtype=torch.float64, shape=SHAPE):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape).to(dtype) - 7


def _make(where, value):
    """`where` is None for a plain tensor, else (mesh kind, sharding specs)."""
    if where is None:
        return value.clone()
    mesh_kind, specs = where
    return spmd.copy_to_mesh(value, Layout(specs, _mesh(mesh_kind)))


def _empty_like(where, value):
    if where is None:
        return torch.zeros_like(value)
    mesh_kind, specs = where
    return spmd.zeros(tuple(value.shape), dtype=value.dtype, layout=Layout(specs, _mesh(mesh_kind)))


def _global(t):
    return spmd.to_global(t) if spmd.is_dtensor(t) else t


def _components_consistent(t):
    """Every local component equals its slice of the global value (replicas included)."""
    if not spmd.is_dtensor(t):
        return True
    full = spmd.to_global(t)
    for block in ck.local_blocks(t._layout, t.shape):
        index = tuple(slice(o, o + s) for o, s in zip(block.offsets, block.sizes))
        for position in block.positions:
            if not torch.equal(t._local[position], full[index]):
                return False
    return True


SAVED = [
    ("2x2", ["x", "y"]),
    ("2x2", ["y", UNSHARDED]),
    ("2x2", [UNSHARDED, UNSHARDED]),
    ("2x4", ["a", "b"]),
    ("2x2x2", ["r", "p"]),
    ("1", ["x", UNSHARDED]),
    None,
]
LOADED = [
    ("2x4", [UNSHARDED, "b"]),
    ("2x4", ["b", "a"]),
    ("2x2", ["x", "y"]),
    ("8", ["d", UNSHARDED]),
    ("2x2x2", ["q", UNSHARDED]),
    ("1", [UNSHARDED, "x"]),
    None,
]


@pytest.mark.parametrize("saved", SAVED, ids=str)
def test_round_trip_across_meshes_and_layouts(tmp_path, saved):
    value = _value()
    ints = _value(torch.int64)
    ck.save({"w": _make(saved, value), "i": _make(saved, ints), "nested": {"step": 3, "lr": 0.25, "betas": (0.9, 0.99)},
             "scalar": torch.tensor(2.5)}, tmp_path / "ckpt")
    for loaded in LOADED:
        target = {"w": _empty_like(loaded, value), "i": _empty_like(loaded, ints),
                  "nested": {"step": 0, "lr": 0.0, "betas": None}, "scalar": torch.tensor(0.0)}
        nested = target["nested"]
        ck.load(target, tmp_path / "ckpt")
        for key, expected in (("w", value), ("i", ints)):
            assert torch.equal(_global(target[key]), expected), (saved, loaded, key)
            assert target[key].dtype == expected.dtype
            assert _components_consistent(target[key]), (saved, loaded, key)
        if loaded is not None:
            assert target["w"]._layout.sharding_specs == loaded[1]  # loaded in the template's layout
        assert target["nested"] is nested and nested == {"step": 3, "lr": 0.25, "betas": (0.9, 0.99)}
        assert target["scalar"].item() == 2.5


def test_zero_dim_and_one_dim_dtensors(tmp_path):
    mesh = _mesh("2x2")
    sd = {"s": spmd.copy_to_mesh(torch.tensor(4.0), Layout([], mesh)),
          "v": spmd.copy_to_mesh(torch.arange(4.0), Layout(["y"], mesh))}
    ck.save(sd, tmp_path / "c")
    target = {"s": torch.tensor(0.0), "v": spmd.zeros((4,), layout=Layout(["b"], _mesh("2x4")))}
    ck.load(target, tmp_path / "c")
    assert target["s"].item() == 4.0 and spmd.to_global(target["v"]).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("where, chunks", [
    (("2x2", ["x", "y"]), {((0, 0), (4, 6)), ((0, 6), (4, 6)), ((4, 0), (4, 6)), ((4, 6), (4, 6))}),
    (("2x2", ["y", UNSHARDED]), {((0, 0), (4, 12)), ((4, 0), (4, 12))}),
    (("2x2", [UNSHARDED, "x"]), {((0, 0), (8, 6)), ((0, 6), (8, 6))}),
    (("2x2", [UNSHARDED, UNSHARDED]), {((0, 0), (8, 12))}),
    (("2x2x2", ["q", "p"]), {((r, c), (4, 6)) for r in (0, 4) for c in (0, 6)}),
    (None, {((0, 0), (8, 12))}),
])
def test_each_shard_is_written_once(tmp_path, where, chunks):
    ck.save({"w": _make(where, _value())}, tmp_path / "c")
    metadata = dcp.FileSystemReader(str(tmp_path / "c")).read_metadata()
    md = metadata.state_dict_metadata["w"]
    saved = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
    assert len(saved) == len(chunks) and set(saved) == chunks
    assert tuple(md.size) == SHAPE and md.properties.dtype == torch.float64
    stored = [index for index in metadata.storage_data if index.fqn == "w"]
    assert len(stored) == len(chunks)  # one stored item per chunk: no replica was written


@pytest.mark.parametrize("specs", [["x", "y"], ["y", UNSHARDED], [UNSHARDED, "x"], [UNSHARDED, UNSHARDED]])
def test_which_shards_are_mine_comes_from_the_local_devices(specs):
    """Split a 2x2 mesh over two clients (as a multi-process mesh would): the clients' writers cover every
    distinct shard exactly once, and each client reads every shard its devices hold once."""
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)]
    ids = torch.arange(4).reshape(2, 2).numpy()
    full = spmd.create_mesh([("x", 2), ("y", 2)])
    expected = {b.offsets for b in ck.local_blocks(Layout(specs, full), (4, 6))}
    written = []
    for local in ([0, 1], [2, 3]), ([0, 3], [1, 2]):
        written = []
        for client in local:
            mesh = Mesh(["x", "y"], ids, client, [devices[i] for i in client], global_devices=devices)
            blocks = ck.local_blocks(Layout(specs, mesh), (4, 6))
            written += [b.offsets for b in blocks if b.writer]
            held = sorted(p for b in blocks for p in b.positions)
            assert held == list(range(len(client)))  # every local device is in exactly one block
        assert sorted(written) == sorted(expected)


def test_each_device_reads_only_its_shard(tmp_path):
    ck.save({"w": _make(("2x2", ["x", "y"]), _value())}, tmp_path / "c")
    target = {"w": _empty_like(("2x4", [UNSHARDED, "b"]), _value())}
    metadata = dcp.FileSystemReader(str(tmp_path / "c")).read_metadata()
    planner = ck.LoadPlanner()
    planner.set_up_planner(target, metadata, True)
    plan = planner.create_local_plan()
    read = sum(torch.Size(item.lengths).numel() for item in plan.items)
    assert read == 8 * 12  # 4 distinct column blocks of 8x3 (not 8 devices' worth), no full copy per device
    assert all(tuple(item.lengths)[1] == 3 for item in plan.items)


def test_shape_mismatch_is_a_clear_error(tmp_path):
    ck.save({"model": {"fc.weight": _make(("2x2", ["x", "y"]), _value())}}, tmp_path / "c")
    target = {"model": {"fc.weight": spmd.zeros((8, 6), dtype=torch.float64, layout=Layout(["x", "y"], _mesh("2x2")))}}
    with pytest.raises(ValueError, match=r"'model\.fc\.weight'.*\[8, 12\].*\[8, 6\]"):
        ck.load(target, tmp_path / "c")
    with pytest.raises(ValueError, match=r"'model\.fc\.weight'.*\[8, 12\].*\[12, 8\]"):
        ck.load({"model": {"fc.weight": torch.zeros(12, 8)}}, tmp_path / "c")


def test_missing_key_is_a_clear_error(tmp_path):
    ck.save({"model": {"fc.weight": torch.ones(2)}}, tmp_path / "c")
    with pytest.raises(KeyError, match=r"model\.fc\.bias"):
        ck.load({"model": {"fc.weight": torch.zeros(2), "fc.bias": torch.zeros(2)}}, tmp_path / "c")
    target = {"model": {"fc.weight": torch.zeros(2), "fc.bias": torch.zeros(2)}}
    ck.load(target, tmp_path / "c", strict=False)  # a partial load
    assert target["model"]["fc.weight"].tolist() == [1, 1] and target["model"]["fc.bias"].tolist() == [0, 0]
    with pytest.raises(ValueError, match="'model.fc.weight'.* holds a tensor but .* a value of type int"):
        ck.load({"model": {"fc.weight": 3}}, tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ck.load({}, tmp_path / "nothing")


# -- crash safety ---------------------------------------------------------------------------------------------------
def _failing(monkeypatch, method):
    original = getattr(dcp.FileSystemWriter, method)

    def fail(self, *args, **kwargs):
        out = original(self, *args, **kwargs) if method == "write_data" else None
        if method == "write_data":
            out.wait()  # the shards are on disk
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(dcp.FileSystemWriter, method, fail)


@pytest.mark.parametrize("method", ["write_data", "finish"])
def test_a_failed_save_leaves_no_checkpoint(tmp_path, monkeypatch, method):
    sd = {"w": _make(("2x2", ["x", "y"]), _value())}
    with monkeypatch.context() as patch:
        _failing(patch, method)
        with pytest.raises(Exception, match="simulated"):
            ck.save(sd, tmp_path / "c")
    assert os.listdir(tmp_path) == []  # no `c`, and the temporary directory is removed
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ck.load({"w": torch.zeros(SHAPE, dtype=torch.float64)}, tmp_path / "c")


def test_a_failed_overwrite_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ck.save({"w": _make(("2x2", ["x", "y"]), _value())}, tmp_path / "c")
    with monkeypatch.context() as patch:
        _failing(patch, "finish")
        with pytest.raises(Exception, match="simulated"):
            ck.save({"w": _make(("2x2", ["x", "y"]), _value() * 0)}, tmp_path / "c")
    assert os.listdir(tmp_path) == ["c"]
    target = {"w": torch.zeros(SHAPE, dtype=torch.float64)}
    ck.load(target, tmp_path / "c")
    assert torch.equal(target["w"], _value())
    ck.save({"w": _make(("2x2", ["y", "x"]), _value() * 2)}, tmp_path / "c")  # a successful overwrite
    ck.load(target, tmp_path / "c")
    assert torch.equal(target["w"], _value() * 2) and os.listdir(tmp_path) == ["c"]


def test_a_killed_save_leaves_no_checkpoint(tmp_path):
    """The process dies (no exception handler runs) after DCP wrote the shards: `path` must not exist."""
    script = textwrap.dedent(f"""
        import os, sys, torch, spmd
        assert "torch.distributed.checkpoint" not in sys.modules  # `import spmd` does not pay for DCP
        ck = spmd.checkpoint
        import torch.distributed.checkpoint as dcp
        original = dcp.FileSystemWriter.write_data
        def die(self, plan, planner):
            original(self, plan, planner).wait()
            os._exit(3)
        dcp.FileSystemWriter.write_data = die
        mesh = spmd.create_mesh([("x", 2)])
        ck.save({{"w": spmd.copy_to_mesh(torch.ones(4), spmd.Layout(["x"], mesh))}}, {str(tmp_path / "c")!r})
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    assert not (tmp_path / "c").exists()
    leftovers = os.listdir(tmp_path)
    assert len(leftovers) == 1 and leftovers[0].startswith(".c.tmp-")  # hidden, and not a checkpoint
    assert not ck.is_checkpoint(tmp_path / leftovers[0])
    with pytest.raises(FileNotFoundError):
        ck.load({"w": torch.zeros(4)}, tmp_path / "c")
    ck.save({"w": torch.ones(4)}, tmp_path / "c")  # the killed save's process is gone: its leftovers go
    assert os.listdir(tmp_path) == ["c"]


def test_save_never_overwrites_something_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        ck.save({"w": torch.ones(2)}, tmp_path / "c")
    assert (tmp_path / "c" / "notes.txt").read_text() == "mine"


# -- models and optimizers ------------------------------------------------------------------------------------------
LAYOUT_MAP = {r"0\.weight": ["y", UNSHARDED], r"0\.bias": ["y"], r"2\.weight": [UNSHARDED, "y"]}


def _build(seed, mesh=None, layout_map=LAYOUT_MAP, optimizer=torch.optim.AdamW):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4),
                                torch.nn.BatchNorm1d(4)).double()
    if mesh is not None:
        spmd.distribute_module(model, mesh, layout_map)
    kwargs = {"momentum": 0.9} if optimizer is torch.optim.SGD else {"weight_decay": 0.1}
    return model, optimizer(model.parameters(), lr=0.05, **kwargs)


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64))
            for _ in range(n)]


def _train(model, optimizer, batches, mesh=None, batch_dim=None, scheduler=None):
    losses = []
    for x, y in batches:
        if mesh is not None:
            x, y = (spmd.copy_to_mesh(t, Layout([batch_dim, UNSHARDED], mesh)) for t in (x, y))
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


@pytest.mark.filterwarnings("ignore:spmd. no sharding rule")
@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.SGD])
@pytest.mark.parametrize("style", ["objects", "state_dicts"])
def test_resumed_training_matches_an_uninterrupted_run(tmp_path, optimizer, style):
    mesh = _mesh("2x2")
    data = _batches(6)
    schedule = (lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)) if style == "objects" \
        else (lambda opt: None)
    model, opt = _build(0, mesh, optimizer=optimizer)
    reference = _train(model, opt, data, mesh, "x", schedule(opt))

    model, opt = _build(0, mesh, optimizer=optimizer)
    scheduler = schedule(opt)
    assert _train(model, opt, data[:3], mesh, "x", scheduler) == reference[:3]
    saved = {name: _global(t).clone() for name, t in model.state_dict().items()}
    if style == "objects":
        ck.save({"model": model, "optim": opt, "sched": scheduler, "epoch": 3}, tmp_path / "c")
    else:
        ck.save({"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}, tmp_path / "c")

    fresh_model, fresh_opt = _build(1, mesh, optimizer=optimizer)  # other initial values, no optimizer state
    fresh_scheduler = schedule(fresh_opt)
    assert not fresh_opt.state
    target = {"model": fresh_model, "optim": fresh_opt, "epoch": 0}
    if style == "objects":
        target["sched"] = fresh_scheduler
    ck.load(target, tmp_path / "c")
    assert target["epoch"] == 3 and target["model"] is fresh_model
    loaded = fresh_model.state_dict()
    assert loaded.keys() == saved.keys()  # parameters and BatchNorm's buffers (num_batches_tracked is plain)
    for name, value in saved.items():
        assert torch.equal(_global(loaded[name]), value), name
    for p in fresh_model.parameters():
        for name, value in fresh_opt.state[p].items():
            if name != "step":
                assert spmd.fetch_layout(value) == spmd.fetch_layout(p), name  # laid out like its parameter
    assert _train(fresh_model, fresh_opt, data[3:], mesh, "x", fresh_scheduler) == reference[3:]  # bitwise, float64
    if style == "objects":
        assert fresh_scheduler.last_epoch == 6 and fresh_opt.param_groups[0]["lr"] == 0.05 * 0.5 ** 3


@pytest.mark.filterwarnings("ignore:spmd. no sharding rule")
def test_explicit_state_dicts_of_a_fresh_optimizer(tmp_path):
    """The manual route: load into the state dicts, then load_state_dict (a fresh optimizer's state is filled
    from the checkpoint by `optimizer_template`'s logic only when the optimizer itself is given)."""
    mesh = _mesh("2x2")
    data = _batches(4)
    reference = _train(*_build(0, mesh), data, mesh, "x")
    model, opt = _build(0, mesh)
    _train(model, opt, data[:2], mesh, "x")
    ck.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "c")
    model2, opt2 = _build(5, mesh)
    _train(model2, opt2, data[:1], mesh, "x")  # an optimizer with state: its state dict is a full template
    sd = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    ck.load(sd, tmp_path / "c")
    model2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["optim"])
    assert _train(model2, opt2, data[2:], mesh, "x") == reference[2:]


@pytest.mark.filterwarnings("ignore:spmd. no sharding rule")
@pytest.mark.parametrize("target", [("2x4", {r"0\.weight": [UNSHARDED, "b"], r"2\.weight": ["b", UNSHARDED]}, "a"),
                                    ("1", {}, "x"), None], ids=["2x4", "1-device", "plain"])
def test_resume_on_another_mesh_or_in_plain_torch(tmp_path, target):
    mesh = _mesh("2x2")
    data = _batches(5)
    reference = _train(*_build(0, mesh), data, mesh, "x")
    model, opt = _build(0, mesh)
    _train(model, opt, data[:2], mesh, "x")
    ck.save({"model": model, "optim": opt}, tmp_path / "c")
    if target is None:
        model2, opt2 = _build(1)
        ck.load({"model": model2, "optim": opt2}, tmp_path / "c")
        losses = _train(model2, opt2, data[2:])
    else:
        mesh2 = _mesh(target[0])
        model2, opt2 = _build(1, mesh2, target[1])
        ck.load({"model": model2, "optim": opt2}, tmp_path / "c")
        losses = _train(model2, opt2, data[2:], mesh2, target[2])
    assert losses == pytest.approx(reference[2:], rel=1e-12)


def test_raw_dcp_with_spmd_planners_fills_replicas(tmp_path):
    target = {"w": _empty_like(("2x4", [UNSHARDED, "b"]), _value())}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": _make(("2x2", ["x", UNSHARDED]), _value())}, storage_writer=dcp.FileSystemWriter(
            str(tmp_path / "c")), planner=ck.SavePlanner())
        assert len(dcp.FileSystemReader(str(tmp_path / "c")).read_metadata().state_dict_metadata["w"].chunks) == 2
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path / "c")), planner=ck.LoadPlanner())
    assert torch.equal(spmd.to_global(target["w"]), _value()) and _components_consistent(target["w"])


@pytest.mark.parametrize("specs", [["x", UNSHARDED], [UNSHARDED, UNSHARDED], ["y", "x"]])
def test_raw_dcp_without_spmd_planners(tmp_path, specs):
    """DCP's tensor-subclass protocol (`__create_write_items__`, ...) lets plain dcp.save/load handle DTensors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": _make(("2x2", specs), _value())}, checkpoint_id=str(tmp_path / "c"))
        chunks = dcp.FileSystemReader(str(tmp_path / "c")).read_metadata().state_dict_metadata["w"].chunks
        assert len(chunks) == len(ck.local_blocks(Layout(specs, _mesh("2x2")), SHAPE))  # each shard once
        for loaded in (("2x4", [UNSHARDED, "b"]), ("2x2x2", ["q", "r"]), ("2x2", ["x", "y"])):
            target = {"w": _empty_like(loaded, _value())}
            dcp.load(target, checkpoint_id=str(tmp_path / "c"))
            assert torch.equal(spmd.to_global(target["w"]), _value()) and _components_consistent(target["w"])


def test_loads_what_plain_dcp_saved(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": _value()}, "step": 4}, checkpoint_id=str(tmp_path / "c"))
    target = {"model": {"w": _empty_like(("2x2x2", ["q", "r"]), _value())}, "step": 0}
    ck.load(target, tmp_path / "c")
    assert torch.equal(spmd.to_global(target["model"]["w"]), _value()) and target["step"] == 4
    assert _components_consistent(target["model"]["w"])


def test_importable_as_submodule():
    import spmd.checkpoint
    assert spmd.checkpoint.save is ck.save and spmd.checkpoint.load is ck.load and spmd.checkpoint is ck


def test_doc_examples():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        failed, attempted = doctest.testfile(str(DOC), module_relative=False, verbose=False, report=True,
                                             optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, globs={})
    assert attempted >= 10
    assert failed == 0, f"{failed} of {attempted} examples of {DOC.name} failed (see the output above)"


def test_load_into_expanded_replicated_components(tmp_path):
    """Components sharing one storage (an expanded replicated stack) get their own memory before the load."""
    from spmd.dtensor import make
    mesh = spmd.create_mesh([("x", 4)])
    ck.save({"t": spmd.copy_to_mesh(torch.arange(3.), Layout.replicated(mesh, 1))}, tmp_path / "c")
    target = make(torch.ones(1, 3).expand(4, 3), Layout.replicated(mesh, 1))
    ck.load({"t": target}, tmp_path / "c")
    assert [c.tolist() for c in spmd.unpack(target)] == [[0.0, 1.0, 2.0]] * 4
