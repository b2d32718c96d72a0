"""Mesh conformance, mirroring TF's `layout_test.py` / `mesh_util_test.py` (reference §1.2, §1.4, §2.1, §3.1)."""

import copy
import itertools
import pickle
import re

import numpy as np
import pytest
import torch

import spmd
from spmd import Mesh, MeshDimension, create_mesh

HOST = "/job:localhost/replica:0/task:0"


def full(kind: str, n: int, host: str = HOST) -> list[str]:
    return [f"{host}/device:{kind}:{i}" for i in range(n)]


def mesh_string(dims: str, n: int, kind: str = "CPU", name: str = "") -> str:
    ids = ",".join(map(str, range(n)))
    return f"{name}|{dims}|{ids}|{ids}|{','.join(full(kind, n))}"


DEVICES6 = [f"CPU:{i}" for i in range(6)]


# -- create_mesh -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dims, devices, names, shape", [
    ([("x", 6)], DEVICES6, ["x"], [6]),
    ([("x", 3), ("y", 2)], DEVICES6, ["x", "y"], [3, 2]),
    ({"x": 3, "y": 2}, DEVICES6, ["x", "y"], [3, 2]),
    ({"x": 6, "y": 1}, DEVICES6, ["x", "y"], [6, 1]),
    (None, DEVICES6, ["x"], [6]),
    ([("b", -1)], DEVICES6, ["b"], [6]),
    ([("a", 2), ("b", -1)], DEVICES6, ["a", "b"], [2, 3]),
    ([("a", -1), ("b", 3)], DEVICES6, ["a", "b"], [2, 3]),
    ([("x", 2), ("y", 4)], None, ["x", "y"], [2, 4]),  # default devices: as many virtual CPUs as needed
    ([("batch", 2), ("x", 2), ("y", 2)], None, ["batch", "x", "y"], [2, 2, 2]),
])
def test_create_mesh_dims(dims, devices, names, shape):
    mesh = create_mesh(dims, devices=devices)
    n = int(np.prod(shape))
    assert mesh.dim_names == names
    assert mesh.shape() == shape
    assert mesh.size == n
    assert mesh.num_local_devices() == n
    assert mesh.local_device_ids() == list(range(n))
    assert mesh.global_device_ids().tolist() == np.arange(n).reshape(shape).tolist()
    assert mesh.local_devices() == full("CPU", n)
    assert mesh.device_type() == "CPU"
    assert mesh.name == ""


def test_create_mesh_default_is_one_dimension_x():
    mesh = create_mesh()
    assert mesh.dim_names == ["x"]
    assert mesh.num_local_devices() == mesh.size >= 1


def test_create_mesh_takes_all_the_devices_the_system_was_initialised_with():
    """As TF: `None` and a size of -1 mean every local device, here the virtual CPU devices
    `initialize_accelerator_system` made."""
    spmd.initialize_accelerator_system("CPU", num_logical_cpu_devices=8)
    try:
        assert create_mesh().shape() == [8]
        assert create_mesh([("b", -1)]).shape() == [8]
        assert create_mesh([("x", 2), ("y", -1)]).shape() == [2, 4]
    finally:
        spmd.shutdown_accelerator_system()
    assert create_mesh([("b", -1)]).shape() == [1]


def test_create_mesh_devices_keep_their_names_and_ids_are_positions():
    mesh = create_mesh(devices=["CPU:2", "CPU:5"])
    assert mesh.to_string() == f"|x=2|0,1|0,1|{HOST}/device:CPU:2,{HOST}/device:CPU:5"


def test_create_mesh_name_and_gpu_names():
    mesh = create_mesh([("x", 2)], mesh_name="my_mesh", devices=["cuda:0", "cuda:1"])
    assert mesh.name == "my_mesh"
    assert mesh.device_type() == "GPU"
    assert mesh.to_string() == mesh_string("x=2", 2, "GPU", name="my_mesh")
    assert create_mesh([("x", 2)], devices=["GPU:0", "GPU:1"], device_type="GPU") == \
        create_mesh([("x", 2)], devices=["cuda:0", "cuda:1"])


# -- the exact string format (tutorial, §2.1) --------------------------------------------------------------------
def test_tutorial_prints():
    mesh_1d = create_mesh([("x", 6)], devices=DEVICES6)
    assert str(mesh_1d) == (
        "Mesh.from_string(|x=6|0,1,2,3,4,5|0,1,2,3,4,5|/job:localhost/replica:0/task:0/device:CPU:0,"
        "/job:localhost/replica:0/task:0/device:CPU:1,/job:localhost/replica:0/task:0/device:CPU:2,"
        "/job:localhost/replica:0/task:0/device:CPU:3,/job:localhost/replica:0/task:0/device:CPU:4,"
        "/job:localhost/replica:0/task:0/device:CPU:5)")
    mesh_2d = create_mesh([("x", 3), ("y", 2)], devices=DEVICES6)
    assert str(mesh_2d) == (
        "Mesh.from_string(|x=3,y=2|0,1,2,3,4,5|0,1,2,3,4,5|/job:localhost/replica:0/task:0/device:CPU:0,"
        "/job:localhost/replica:0/task:0/device:CPU:1,/job:localhost/replica:0/task:0/device:CPU:2,"
        "/job:localhost/replica:0/task:0/device:CPU:3,/job:localhost/replica:0/task:0/device:CPU:4,"
        "/job:localhost/replica:0/task:0/device:CPU:5)")
    assert repr(mesh_2d) == str(mesh_2d)


def test_one_device_mesh_string():
    mesh = create_mesh([("x", 1)], devices=["CPU:0"])
    assert mesh.to_string() == "|x=1|0|0|/job:localhost/replica:0/task:0/device:CPU:0"
    assert not mesh.is_single_device()


ROUND_TRIPS = [
    mesh_string("x=2,y=4", 8),
    mesh_string("x=2,y=4", 8, name="my_mesh"),
    mesh_string("batch=2,x=2", 4, "TPU"),
    mesh_string("x=6", 6, "GPU"),
    "|x=1|0|0|/job:localhost/replica:0/task:0/device:CPU:0",
    # client 1 of 2: local ids 2,3 and the global device list
    "|x=4|0,1,2,3|2,3|/job:worker/replica:0/task:1/device:CPU:0,/job:worker/replica:0/task:1/device:CPU:1|"
    + ",".join(full("CPU", 2, "/job:worker/replica:0/task:0") + full("CPU", 2, "/job:worker/replica:0/task:1")),
    # remote only: no local ids or devices, global devices given
    "|x=2|0,1|||" + ",".join(full("CPU", 2)),
    # ids may start above 0
    "|x=2|2,3|2,3|" + ",".join(full("CPU", 2)),
]


@pytest.mark.parametrize("s", ROUND_TRIPS)
def test_string_round_trip(s):
    mesh = Mesh.from_string(s)
    assert mesh.to_string() == s
    assert Mesh.from_string(mesh.to_string()) == mesh
    assert hash(Mesh.from_string(s)) == hash(mesh)
    assert repr(mesh) == f"Mesh.from_string({s})"
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    assert copy.copy(mesh) == mesh and copy.deepcopy(mesh) == mesh


def test_multi_client_members():
    mesh = Mesh.from_string(ROUND_TRIPS[5])
    assert mesh.size == 4
    assert mesh.local_device_ids() == [2, 3]
    assert mesh.num_local_devices() == 2
    assert len(mesh.global_devices()) == 4
    assert not mesh.is_remote()
    assert mesh.local_device_locations() == [{"x": 2}, {"x": 3}]
    remote = Mesh.from_string(ROUND_TRIPS[6])
    assert remote.is_remote() and remote.local_devices() == [] and remote.device_type() == "CPU"


def test_global_devices_take_short_names():
    mesh = Mesh(["x"], np.arange(4), [0, 1], ["CPU:0", "CPU:1"], global_devices=[f"CPU:{i}" for i in range(4)])
    assert mesh.global_devices() == full("CPU", 4)
    assert mesh.to_string() == "|x=4|0,1,2,3|0,1|" + ",".join(full("CPU", 2)) + "|" + ",".join(full("CPU", 4))
    assert Mesh.from_string(mesh.to_string()) == mesh


def test_constructor_matches_from_string():
    s = mesh_string("batch=2,x=2", 4, "TPU")
    built = Mesh(["batch", "x"], np.arange(4).reshape(2, 2), [0, 1, 2, 3], full("TPU", 4))
    assert built == Mesh.from_string(s)
    assert built.to_string() == s
    assert built.device_type() == "TPU"


# -- members (values for create_mesh([('x',2),('y',4)]), §1.2) ---------------------------------------------------
@pytest.fixture
def mesh24():
    return create_mesh([("x", 2), ("y", 4)])


def test_members(mesh24):
    m = mesh24
    assert m.dim_names == ["x", "y"]
    assert m.name == ""
    assert m.size == 8
    assert m.shape() == [2, 4] and isinstance(m.shape(), list)
    assert m.dim_size("x") == 2 and m.dim_size("y") == 4
    assert m["x"] == MeshDimension(name="x", size=2)
    assert m["y"].size == 4 and m["y"].name == "y"
    assert "x" in m and "y" in m and "z" not in m
    assert m.contains_dim("x") and not m.contains_dim("z")
    ids = m.global_device_ids()
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int64
    assert ids.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert m.local_device_ids() == list(range(8))
    assert m.local_devices() == full("CPU", 8)
    assert m.local_devices()[0] == "/job:localhost/replica:0/task:0/device:CPU:0"
    assert m.num_local_devices() == 8
    assert m.global_devices() == []
    assert m.device_type() == "CPU"
    assert m.min_global_device_id() == 0
    assert not m.is_remote()
    assert not m.is_single_device()
    assert m.strides == [4, 1]


def test_unknown_dimension_message(mesh24):
    with pytest.raises(ValueError, match=re.escape("Dimension z does not exist in mesh.Available dimensions: x,y")):
        mesh24["z"]
    with pytest.raises(ValueError, match="Dimension z does not exist"):
        mesh24.dim_size("z")


def test_len_is_a_type_error(mesh24):
    with pytest.raises(TypeError):
        len(mesh24)


@pytest.mark.parametrize("shape, strides", [
    ((8,), [1]),
    ((2, 4), [4, 1]),
    ((2, 4, 2), [8, 2, 1]),
    ((8, 16, 2, 4), [128, 8, 4, 1]),
])
def test_strides(shape, strides):
    names = [f"d{i}" for i in range(len(shape))]
    mesh = create_mesh(list(zip(names, shape)))
    assert mesh.strides == strides


def test_coords_wrap_modulo_the_size():
    mesh = create_mesh([("a", 2), ("b", 4), ("c", 2)])
    expected = list(itertools.product(range(2), range(4), range(2)))
    for i in range(48):
        coords = mesh.coords(i)
        assert isinstance(coords, torch.Tensor) and coords.dtype == torch.int32
        assert coords.tolist() == list(expected[i % 16])
        assert mesh.device_location(i) == list(expected[i % 16])


def test_coords_and_unravel_index(mesh24):
    assert mesh24.coords(5).tolist() == [1, 1]
    assert mesh24.device_location(5) == [1, 1]
    assert mesh24.unravel_index() == {i: {"x": i // 4, "y": i % 4} for i in range(8)}
    assert list(mesh24.unravel_index()) == list(range(8))  # row-major order
    assert mesh24.local_device_locations() == [{"x": i // 4, "y": i % 4} for i in range(8)]


def test_unravel_index_with_ids_above_zero():
    mesh = Mesh(["x"], np.array([2, 3]), [2, 3], ["CPU:0", "CPU:1"])
    assert mesh.unravel_index() == {2: {"x": 0}, 3: {"x": 1}}
    assert mesh.min_global_device_id() == 2


def test_host_mesh():
    gpu = create_mesh([("batch", 2), ("x", 2)], mesh_name="name_not_preserved",
                      devices=[f"GPU:{i}" for i in range(4)])
    host = gpu.host_mesh()
    assert host == create_mesh([("batch", 2), ("x", 2)], devices=[f"CPU:{i}" for i in range(4)])
    assert host.name == "" and host.device_type() == "CPU"
    assert host.global_device_ids().tolist() == gpu.global_device_ids().tolist()
    cpu = create_mesh([("x", 2), ("y", 4)])
    assert cpu.host_mesh() == cpu


# -- equality, hashing, pickling ---------------------------------------------------------------------------------
def test_equality_and_hash():
    a = create_mesh([("x", 2), ("y", 4)])
    b = create_mesh({"x": 2, "y": 4})
    named = create_mesh([("x", 2), ("y", 4)], mesh_name="named")
    assert a == b and hash(a) == hash(b)
    assert a != named  # the name counts, as in TF
    assert a != create_mesh([("y", 2), ("x", 4)])
    assert a != create_mesh([("x", 4), ("y", 2)])
    assert a != create_mesh([("x", 2), ("y", 4)], devices=[f"CPU:{i}" for i in range(1, 9)])
    assert a != "not a mesh" and a != None  # noqa: E711
    assert len({a, b, named}) == 2
    assert {a: 1}[b] == 1


def test_pickle_and_repr():
    mesh = create_mesh([("batch", 4), ("x", 2)])
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    text = repr(mesh)
    assert "batch=4,x=2" in text and "CPU:0" in text and "CPU:7" in text
    named = create_mesh([("x", 2)], mesh_name="n")
    restored = pickle.loads(pickle.dumps(named))
    assert restored == named and restored.name == "n"


# -- errors: ValueError naming the bad value ---------------------------------------------------------------------
def _mesh(ids, devices, names=("x",), local_ids=None, **kw):
    ids = np.asarray(ids)
    return Mesh(list(names), ids, list(ids.ravel()) if local_ids is None else local_ids, devices, **kw)


ERRORS = [
    # create_mesh
    (lambda: create_mesh([("x", 3)], devices=[f"CPU:{i}" for i in range(8)]),
     "length of devices (8) must be equal to total size of the mesh of shape [3]"),
    (lambda: create_mesh([("x", 2), ("y", 4)], devices=DEVICES6),
     "length of devices (6) must be equal to total size of the mesh of shape [2, 4]"),
    (lambda: create_mesh([("x", 4), ("y", -1)], devices=DEVICES6),
     "length of devices (6) must be equal to total size of the mesh of shape [4, -1]"),
    (lambda: create_mesh([("x", 2)], devices=["CPU:0", "CPU:1"], device_type="GPU"),
     f"Conflicting devices ['{HOST}/device:CPU:0', '{HOST}/device:CPU:1'] and device_type GPU"),
    (lambda: create_mesh([("x", 2), ("x", 3)], devices=DEVICES6), "['x', 'x']"),
    (lambda: create_mesh([("x", 2)], mesh_name="a|b"), "mesh name 'a|b' is not allowed"),
    (lambda: create_mesh([("x", 2), ("y", 1), ("x", 3)], devices=DEVICES6), "repeated"),
    (lambda: create_mesh([("x", 2)], devices=["CPU:0", "CPU:0"]), "Duplicate devices found in mesh specification"),
    (lambda: create_mesh([("x", 2)], devices=["CPU:0", "XPU:1"]), "'XPU:1'"),
    (lambda: create_mesh([("x", 2)], devices=["CPU:0", "garbage"]), "'garbage'"),
    (lambda: create_mesh([("x", 2)], devices=["CPU:0", "CPU:one"]), "'CPU:one'"),
    (lambda: create_mesh(["x", 2]), "(name, size) pairs"),
    # the Mesh constructor, in TF's order
    (lambda: _mesh([], []), "Variable global_device_ids must be non-empty."),
    (lambda: _mesh([0, 2], ["CPU:0", "CPU:1"]), "global_device_ids must sequentially increase: [0, 2]"),
    (lambda: _mesh([1, 0], ["CPU:0", "CPU:1"]), "global_device_ids must sequentially increase: [1, 0]"),
    (lambda: _mesh([0, 1], ["CPU:0", "CPU:1"], names=("x", "y")),
     "does not match number of dimension names"),
    (lambda: _mesh([0, 1], ["CPU:0", "CPU:1"], local_ids=[0, "a"]), "local_device_ids must be a list of integers"),
    (lambda: _mesh([0, 1], ["CPU:0"]), "does not have same size as"),
    (lambda: _mesh([0, 1], ["CPU:0", "CPU:1", "CPU:2"], local_ids=[0, 1, 2]), "more local than global"),
    (lambda: _mesh([0, 1], ["CPU:0", "CPU:1"], local_ids=[0, 5]), "[5]"),
    (lambda: _mesh(np.arange(4).reshape(2, 2), [f"CPU:{i}" for i in (0, 1, 0, 1)], names=("x", "y")),
     "Duplicate devices found in mesh specification"),
    (lambda: _mesh([0, 1], ["CPU:0", "TPU:1"]), "Devices containing multiple device_types : ['CPU', 'TPU']"),
    (lambda: _mesh([0, 1], ["CPU:0", "CPU:1"], global_devices=full("GPU", 2)),
     "Devices containing multiple device_types"),
    (lambda: _mesh([0, 1, 2, 3], ["CPU:0", "CPU:1"], local_ids=[0, 1], global_devices=full("CPU", 3)),
     "global_devices has 3 devices but the mesh has 4"),
    (lambda: _mesh([0, 1], ["CPU:0", "CPU:1"], global_devices=["CPU:0", "bad"]), "'bad'"),
    # from_string
    (lambda: Mesh.from_string("garbage"), "Input string is invalid: garbage"),
    (lambda: Mesh.from_string(""), "Input string is invalid: "),
    (lambda: Mesh.from_string("|x=2|0,1|0,1|CPU:0,CPU:1"), "Failed to either identify host or device type"),
    (lambda: Mesh.from_string("|x=3|0,1|0,1|" + ",".join(full("CPU", 2))),
     "mesh size doesn't match number of devices"),
    (lambda: Mesh.from_string("|x=2|0,1|0,1|" + full("CPU", 1)[0]), "does not have same size as"),
    (lambda: Mesh.from_string("|x=a|0,1|0,1|" + ",".join(full("CPU", 2))), "Input string is invalid"),
]


@pytest.mark.parametrize("make, message", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_errors(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_from_string_checks_consecutive_ids():
    # stricter than TF's parser, which leaves that check to the Python constructor
    with pytest.raises(ValueError, match="sequentially increase"):
        Mesh.from_string("|x=2|0,2|0,2|" + ",".join(full("CPU", 2)))


def test_short_device_names_are_distinct():
    from spmd.mesh import short_device_names
    local = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2)]
    assert short_device_names(local) == ["CPU:0", "CPU:1"]
    workers = [f"/job:worker/replica:0/task:{t}/device:CPU:{i}" for t in range(2) for i in range(2)]
    assert short_device_names(workers) == ["task:0/CPU:0", "task:0/CPU:1", "task:1/CPU:0", "task:1/CPU:1"]
    assert short_device_names(["CPU:0", "CPU:0"]) == ["CPU:0", "CPU:0"]
