"""Layouts as torch DTensor placements, and tensors converted to and from `torch.distributed.tensor.DTensor`:
placements as plain values, a 1-device mesh in a world of one process, and a real 2-process gloo run."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import spmd
from spmd import MATCH, UNSHARDED as U, Layout
from spmd.dtensor import DTensor, make
from spmd.interop import from_torch_dtensor, to_torch_dtensor
from tests import clients

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
if dist.is_available():
    from torch.distributed.tensor import DTensor as TorchDTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

WORKER = Path(__file__).with_name("torch_dtensor_worker.py")


def every_layout(mesh, rank):
    """Every layout of a rank-`rank` tensor on `mesh`: each axis unsharded or on a mesh dim, no dim twice."""
    for axes in itertools.product([None, *mesh.dim_names], repeat=rank):
        used = [a for a in axes if a is not None]
        if len(used) == len(set(used)):
            yield Layout.from_axes(axes, mesh)


def expected_placements(layout):
    """Placements written per tensor axis (the converter goes per mesh dim)."""
    out = [Replicate()] * len(layout.mesh.dim_names)
    for axis, name in enumerate(layout.axes):
        if name is not None:
            out[layout.mesh.axis_index(name)] = Shard(axis)
    return tuple(out)


# -- layouts <-> placements ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dims", [[("x", 2), ("y", 4)], [("x", 2), ("y", 2), ("z", 2)]])
def test_every_layout_round_trips_through_placements(dims):
    mesh = spmd.create_mesh(dims)
    count = 0
    for rank in range(4):
        for layout in every_layout(mesh, rank):
            placements = layout.to_torch()
            assert placements == expected_placements(layout), layout
            assert Layout.from_torch(mesh, placements, rank) == layout
            count += 1
    assert count == (1 + 3 + 7 + 13 if len(dims) == 2 else 1 + 4 + 13 + 34)


def test_placements_examples():
    mesh = spmd.create_mesh([("x", 2), ("y", 2), ("z", 2)])
    assert Layout(["z", U, "x"], mesh).to_torch() == (Shard(2), Replicate(), Shard(0))
    assert Layout.replicated(mesh, 2).to_torch() == (Replicate(),) * 3
    assert Layout.from_torch(mesh, [Replicate(), Shard(-1), Replicate()], 3).sharding_specs == [U, U, "y"]
    assert Layout.from_torch(mesh, (Replicate(),) * 3, 0).sharding_specs == []
    # Shard(i) on several mesh dims splits axis i over them in mesh order, the first major
    assert Layout([("x", "z"), U, "y"], mesh).to_torch() == (Shard(0), Shard(2), Shard(0))
    assert Layout.from_torch(mesh, [Shard(0), Shard(0), Shard(0)], 1).axes == (("x", "y", "z"),)
    assert Layout.from_torch(mesh, [Shard(1), Replicate(), Shard(-1)], 2).sharding_specs == [U, "x+z"]


_OFFSETS = """
import json, sys
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore
cases, out = json.loads(sys.argv[1]), []
for rank in range(8):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("x", "y", "z"))
    out.append([compute_local_shape_and_global_offset((16, 8), mesh, [Shard(p) if p >= 0 else Replicate()
                                                                     for p in case])[1] for case in cases])
    dist.destroy_process_group()
print(json.dumps(out))
"""


def test_multi_axis_placements_match_torchs_offsets():
    """torch's own DTensor puts each rank's shard where the layout's block index says (a fake process group of 8
    ranks in a fresh process)."""
    import json
    import subprocess
    import sys
    mesh = spmd.create_mesh([("x", 2), ("y", 2), ("z", 2)])
    layouts = [Layout([("x", "y"), U], mesh), Layout([("x", "y", "z"), U], mesh), Layout(["y", ("x", "z")], mesh),
               Layout([("y", "z"), "x"], mesh)]
    cases = [[-1 if isinstance(p, Replicate) else p.dim for p in layout.to_torch()] for layout in layouts]
    done = subprocess.run([sys.executable, "-c", _OFFSETS, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    offsets = json.loads(done.stdout)
    for i, layout in enumerate(layouts):
        local = layout.local_shape_from_global_shape((16, 8))
        for rank in range(8):
            assert tuple(offsets[rank][i]) == tuple(b * s for b, s in zip(layout.offset_to_shard()[rank], local))


def test_placement_errors():
    mesh = spmd.create_mesh([("x", 2), ("y", 4)])
    with pytest.raises(spmd.LayoutError, match=r"Partial\('sum'\) over mesh dims \['y'\].*from_torch_dtensor"):
        Layout.from_torch(mesh, [Replicate(), Partial()], 2)
    with pytest.raises(spmd.LayoutError, match=r"tensor axis 0 is sharded over mesh dims \('y', 'x'\) in that "
                                               r"order.*mesh order \['x', 'y'\]; relayout to \('x', 'y'\) first"):
        Layout([("y", "x"), U], mesh).to_torch()
    with pytest.raises(spmd.LayoutError, match="strided shard"):
        Layout.from_torch(mesh, [_StridedShard(0, split_factor=2), Shard(0)], 2)
    with pytest.raises(spmd.LayoutError, match=r"1 placements \(S\(0\)\) for a mesh of 2 dims \['x', 'y'\]"):
        Layout.from_torch(mesh, [Shard(0)], 2)
    with pytest.raises(spmd.LayoutError, match=r"Shard\(2\) on mesh dim 'y' is out of range for a tensor of rank 2"):
        Layout.from_torch(mesh, [Replicate(), Shard(2)], 2)
    with pytest.raises(spmd.LayoutError, match="unknown placement 'S0' on mesh dim 'x'"):
        Layout.from_torch(mesh, ["S0", Replicate()], 2)
    with pytest.raises(spmd.LayoutError, match="rank must be a non-negative integer"):
        Layout.from_torch(mesh, [Replicate(), Replicate()], -1)
    with pytest.raises(spmd.LayoutError, match="MATCH"):
        Layout([MATCH, "x"], mesh).to_torch()


def test_partial_placements_split_into_a_pending_reduction():
    from spmd.torch_placements import split, to_placements
    names = ["x", "y", "z"]
    for op in ("sum", "avg", "max", "min"):
        placements = (Partial(op), Shard(1), Partial(op))
        assert split(names, placements, 2) == ([None, "y"], ("x", "z"), op)
        assert to_placements(names, [None, "y"], ("x", "z"), op) == placements
    with pytest.raises(spmd.LayoutError, match=r"several reductions \['max', 'sum'\]"):
        split(names, (Partial("sum"), Partial("max"), Replicate()), 1)
    with pytest.raises(spmd.LayoutError, match=r"Partial\('prod'\).*\['sum', 'avg', 'max', 'min'\]"):
        split(names, (Partial("prod"), Replicate(), Replicate()), 1)


# -- tensors: one process -------------------------------------------------------------------------------------------
def test_no_process_group_is_a_clear_error():
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    t = spmd.copy_to_mesh(torch.ones(2), Layout(["x"], spmd.create_mesh([("x", 1)])))
    with pytest.raises(RuntimeError, match=r"no default process group.*init_process_group\('gloo', rank=0"):
        to_torch_dtensor(t)
    assert not dist.is_initialized()  # nothing was created behind the user's back


def test_several_virtual_devices_are_refused():
    t = spmd.copy_to_mesh(torch.ones(4), Layout(["x"], spmd.create_mesh([("x", 2), ("y", 2)])))
    with pytest.raises(spmd.LayoutError, match=r"holds 4 devices of the in-process mesh \['x', 'y'\] \[2, 2\].*"
                                               r"torchrun.*spmd.to_global.*spmd.copy_to_mesh"):
        to_torch_dtensor(t)
    two_per_client = spmd.Mesh(["x"], [0, 1, 2, 3], [2, 3], ["CPU:0", "CPU:1"])  # client 1 of 2, two devices each
    with pytest.raises(spmd.LayoutError, match=r"holds 2 devices of the multi-client mesh \['x'\] \[4\]"):
        to_torch_dtensor(make(torch.zeros(2, 1), Layout(["x"], two_per_client)))
    with pytest.raises(TypeError, match="expects an spmd DTensor, got Tensor"):
        to_torch_dtensor(torch.ones(2))
    with pytest.raises(TypeError, match="expects a torch.distributed.tensor.DTensor, got DTensor"):
        from_torch_dtensor(t)


@pytest.fixture
def world_of_one():
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_one_device_mesh_both_ways(world_of_one):
    mesh = spmd.create_mesh([("x", 1), ("y", 1)])
    x = torch.arange(6.0).reshape(2, 3)
    t = spmd.copy_to_mesh(x, Layout(["y", "x"], mesh))
    d = to_torch_dtensor(t)
    assert isinstance(d, TorchDTensor) and d.placements == (Shard(1), Shard(0))
    assert d.device_mesh.mesh_dim_names == ("x", "y") and d.device_mesh.mesh.tolist() == [[0]]
    assert d.to_local().data_ptr() == t._stack.data_ptr()
    assert torch.equal(d.full_tensor(), x) and d.shape == x.shape
    back = from_torch_dtensor(d)
    assert back._layout == t._layout and back._stack.data_ptr() == t._stack.data_ptr()
    assert torch.equal(back._stack, x[None])
    product = from_torch_dtensor(d @ d.T)  # an op of torch's DTensor, read back by spmd
    assert torch.equal(spmd.to_global(product), x @ x.T)


def test_one_device_pending_reductions_are_partials(world_of_one):
    mesh = spmd.create_mesh([("x", 1)])
    component = torch.tensor([[1.0, -2.0]])
    for op in ("sum", "avg", "max", "min"):
        t = DTensor(component, Layout.replicated(mesh, 1), (2,), pending=("x",), pending_op=op)
        d = to_torch_dtensor(t)
        assert d.placements == (Partial(op),) and d.to_local().data_ptr() == component.data_ptr()
        back = from_torch_dtensor(d)
        assert back._pending == ("x",) and back._pending_op == op and back._stack.data_ptr() == component.data_ptr()
        assert d.full_tensor().tolist() == [1.0, -2.0] and spmd.to_global(back).tolist() == [1.0, -2.0]


def test_one_device_mesh_made_for_a_device_mesh_without_names(world_of_one):
    from torch.distributed.device_mesh import DeviceMesh
    d = TorchDTensor.from_local(torch.arange(4.0), DeviceMesh("cpu", [0]), [Shard(0)])
    t = from_torch_dtensor(d)
    assert t._layout.mesh == spmd.create_mesh([("dim0", 1)], devices=["CPU:0"])
    assert t._layout.sharding_specs == ["dim0"] and t._stack.data_ptr() == d.to_local().data_ptr()


def test_one_process_mismatches(world_of_one):
    from torch.distributed.device_mesh import DeviceMesh
    # a 2-device mesh of which this process holds the second device: a world of one process cannot hold it
    mesh = spmd.Mesh(["x"], [0, 1], [1], ["CPU:1"])
    t = make(torch.zeros(1, 2), Layout(["x"], mesh))
    with pytest.raises(spmd.LayoutError, match=r"has 2 devices, this process's at position 1, but "
                                               r"torch.distributed has 1 processes and this is rank 0"):
        to_torch_dtensor(t)
    one = spmd.copy_to_mesh(torch.ones(2), Layout([U], spmd.create_mesh([("x", 1)])))
    with pytest.raises(spmd.LayoutError, match=r"DeviceMesh \(dims \('y',\), shape \[1\].*spmd mesh \(dims \['x'\]"):
        to_torch_dtensor(one, DeviceMesh("cpu", [0], mesh_dim_names=("y",)))
    d = TorchDTensor.from_local(torch.ones(2), DeviceMesh("cpu", [0], mesh_dim_names=("x",)), [Replicate()])
    with pytest.raises(spmd.LayoutError, match=r"does not match the spmd mesh \(dims \['a', 'b'\], shape \[1, 1\]"):
        from_torch_dtensor(d, spmd.create_mesh([("a", 1), ("b", 1)]))


# -- tensors: two processes ------------------------------------------------------------------------------------------
def test_two_processes_convert_both_ways():
    results, _ = clients.launch([WORKER], hard_timeout=120, timeout_s=30, require_result=True)
    x = torch.arange(8.0).reshape(4, 2)
    for c, r in enumerate(results):
        assert r["client"] == c
        rows = x[2 * c:2 * c + 2]
        partial_of = {"sum": (rows.T @ rows), "avg": rows.mean(0), "max": rows.amax(0), "min": rows.amin(0)}
        want = {"shard": (["S(0)"], rows, x), "replicate": (["R"], x, x)}
        want.update({op: ([f"P({op})"], partial_of[op], reduce(x)) for op, reduce in
                     {"sum": lambda v: v.T @ v, "avg": lambda v: v.mean(0), "max": lambda v: v.amax(0),
                      "min": lambda v: v.amin(0)}.items()})
        for name, (placements, local, full) in want.items():
            got = r[name]
            assert got["placements"] == placements, name
            assert got["pending"] == ([["x"], name] if name in partial_of else [[], "sum"]), name
            assert got["shares"] is True, name
            assert got["local"] == local.tolist() and got["full"] == full.tolist() and got["spmd"] == full.tolist()
        assert r["torch_matmul"] == r["spmd_matmul"] == (x.T @ x).tolist()
        assert r["same_device_mesh"] is True

        y = torch.arange(12.0).reshape(2, 6)
        assert r["2d"] == {"placements": ["S(1)", "S(0)"], "dims": ["x", "y"], "local": y[:, 3 * c:3 * c + 3].tolist(),
                           "full": y.tolist(), "back_layout": True, "back_shares": True}

        z = torch.arange(8.0).reshape(2, 4)
        assert r["from_shard1"] == {"mesh": True, "specs": [U, "x"], "pending": [[], "sum"], "shares": True,
                                    "local": [z[:, 2 * c:2 * c + 2].tolist()], "global": z.tolist(),
                                    "torch_full": z.tolist()}
        assert r["from_replicate"] == {"mesh": True, "specs": [U, U], "pending": [[], "sum"], "shares": True,
                                       "local": [z.tolist()], "global": z.tolist(), "torch_full": z.tolist()}
        reduced = {"sum": [3.0, 30.0], "avg": [1.5, 15.0], "max": [2.0, 20.0], "min": [1.0, 10.0]}
        for op, value in reduced.items():
            assert r[f"from_partial_{op}"] == {"mesh": True, "specs": [U], "pending": [["x"], op], "shares": True,
                                               "local": [[c + 1.0, 10.0 * (c + 1)]], "global": value,
                                               "torch_full": value}, op
        assert "shape [3] has size 3, which does not divide by the 2 shards of mesh dimension 'x'" in r["uneven"]
