"""Every example of the DTensor concepts tutorial (seed 003) with `tf.` replaced by torch/spmd.

Each test follows one cell of the tutorial and asserts the layouts, shapes and components the tutorial prints.
Differences that come from torch itself: `tf.range`/`[0, 1]` give int32 in TF and int64 in torch; a torch float
prints as `1.`; `.numpy()` of a sharded DTensor raises a ValueError (TF: UnimplementedError); random values come
from spmd's own layout-invariant generator, not TF's Philox, so only their layout and invariance are checked.
"""

import pytest
import torch

import spmd
from spmd import UNSHARDED, DVariable, Layout, call_with_layout, create_mesh, fetch_layout, pack, unpack

DEVICES = [f"CPU:{i}" for i in range(6)]
HOST = "/job:localhost/replica:0/task:0"
CPUS = ",".join(f"{HOST}/device:CPU:{i}" for i in range(6))


def dtensor_from_array(arr, layout, shape=None, dtype=None):
    """Convert a DTensor from something that looks like an array or Tensor (the tutorial's helper)."""
    if shape is not None or dtype is not None:
        arr = torch.tensor(arr, dtype=dtype).reshape(shape)
    # replicate the input to the mesh
    a = spmd.copy_to_mesh(arr, layout=Layout.replicated(layout.mesh, rank=layout.rank))
    # shard the copy to the desirable layout
    return spmd.relayout(a, layout=layout)


def components(t):
    return [c.tolist() for c in unpack(t)]


# -- Mesh --------------------------------------------------------------------------------------------------------
def test_mesh_1d():
    mesh_1d = create_mesh([("x", 6)], devices=DEVICES)
    assert str(mesh_1d) == f"Mesh.from_string(|x=6|0,1,2,3,4,5|0,1,2,3,4,5|{CPUS})"


def test_mesh_2d():
    mesh_2d = create_mesh([("x", 3), ("y", 2)], devices=DEVICES)
    assert str(mesh_2d) == f"Mesh.from_string(|x=3,y=2|0,1,2,3,4,5|0,1,2,3,4,5|{CPUS})"


# -- Layout ------------------------------------------------------------------------------------------------------
def test_layouts():
    mesh_1d = create_mesh([("x", 6)], devices=DEVICES)
    mesh_2d = create_mesh([("x", 3), ("y", 2)], devices=DEVICES)
    replicated = Layout([UNSHARDED, UNSHARDED], mesh_1d)  # rank-2, replicated across 6 devices
    assert replicated.is_fully_replicated() and replicated.rank == 2
    second = Layout([UNSHARDED, "x"], mesh_1d)  # the second axis across the 6 devices
    assert [second.num_shards(i) for i in range(2)] == [1, 6]
    yx = Layout(["y", "x"], mesh_2d)  # first axis over y, second over x
    assert [yx.num_shards(i) for i in range(2)] == [2, 3]
    hybrid = Layout(["x", UNSHARDED], mesh_2d)  # replicated across y, first axis over x
    assert [hybrid.num_shards(i) for i in range(2)] == [3, 1]
    assert hybrid.offset_to_shard() == [(0, 0), (0, 0), (1, 0), (1, 0), (2, 0), (2, 0)]


# -- DTensor as a sharded tensor ---------------------------------------------------------------------------------
@pytest.fixture
def first():
    mesh = create_mesh([("x", 6)], devices=DEVICES)
    layout = Layout([UNSHARDED], mesh)
    return mesh, layout, dtensor_from_array([0, 1], layout)


def test_my_first_dtensor(first):
    mesh, layout, my_first_dtensor = first
    assert str(my_first_dtensor) == (
        f'DTensor([0 1], layout="sharding_specs:unsharded, mesh:|x=6|0,1,2,3,4,5|0,1,2,3,4,5|{CPUS}", '
        "shape=(2,), dtype=torch.int64)")
    assert my_first_dtensor.shape == (2,)
    assert my_first_dtensor.dtype == torch.int64


def test_fetch_layout(first):
    mesh, layout, my_first_dtensor = first
    assert str(fetch_layout(my_first_dtensor)) == (
        f"Layout.from_string(sharding_specs:unsharded, mesh:|x=6|0,1,2,3,4,5|0,1,2,3,4,5|{CPUS})")
    assert layout == fetch_layout(my_first_dtensor)


def test_unpack_components(first):
    mesh, layout, my_first_dtensor = first
    parts = unpack(my_first_dtensor)
    assert mesh.local_devices() == [f"{HOST}/device:CPU:{i}" for i in range(6)]
    assert len(parts) == 6
    for component_tensor in parts:
        assert component_tensor.tolist() == [0, 1]
        assert component_tensor.shape == (2,) and component_tensor.dtype == torch.int64


def test_pack(first):
    mesh, layout, my_first_dtensor = first
    packed_dtensor = pack([[0, 1], [0, 1], [0, 1], [0, 1], [0, 1], [0, 1]], layout=layout)
    assert str(packed_dtensor) == str(my_first_dtensor)
    assert fetch_layout(packed_dtensor) == layout


@pytest.fixture
def mesh32():
    return create_mesh([("x", 3), ("y", 2)], devices=DEVICES)


def test_fully_sharded(mesh32):
    fully_sharded_dtensor = dtensor_from_array(torch.arange(6).reshape(3, 2), layout=Layout(["x", "y"], mesh32))
    assert components(fully_sharded_dtensor) == [[[0]], [[1]], [[2]], [[3]], [[4]], [[5]]]
    assert all(c.shape == (1, 1) for c in unpack(fully_sharded_dtensor))  # the rank is kept


def test_fully_replicated(mesh32):
    fully_replicated_dtensor = dtensor_from_array(torch.arange(6).reshape(3, 2),
                                                  layout=Layout([UNSHARDED, UNSHARDED], mesh32))
    assert components(fully_replicated_dtensor) == [[[0, 1], [2, 3], [4, 5]]] * 6
    assert fetch_layout(fully_replicated_dtensor) == Layout.replicated(mesh32, rank=2)


def test_hybrid(mesh32):
    hybrid_sharded_dtensor = dtensor_from_array(torch.arange(6).reshape(3, 2),
                                                layout=Layout(["x", UNSHARDED], mesh32))
    assert components(hybrid_sharded_dtensor) == [[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]], [[4, 5]], [[4, 5]]]


def test_numpy_of_sharded_dtensors(mesh32):
    value = torch.arange(6).reshape(3, 2)
    fully_replicated_dtensor = dtensor_from_array(value, layout=Layout([UNSHARDED, UNSHARDED], mesh32))
    fully_sharded_dtensor = dtensor_from_array(value, layout=Layout(["x", "y"], mesh32))
    hybrid_sharded_dtensor = dtensor_from_array(value, layout=Layout(["x", UNSHARDED], mesh32))
    assert fully_replicated_dtensor.numpy().tolist() == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError):
        fully_sharded_dtensor.numpy()
    with pytest.raises(ValueError):
        hybrid_sharded_dtensor.numpy()


def test_dtensor_from_array_with_shape_and_dtype(mesh32):
    t = dtensor_from_array(list(range(6)), Layout(["x", UNSHARDED], mesh32), shape=(3, 2), dtype=torch.float32)
    assert t.dtype == torch.float32 and t.shape == (3, 2)
    assert components(t) == [[[0.0, 1.0]]] * 2 + [[[2.0, 3.0]]] * 2 + [[[4.0, 5.0]]] * 2


# -- DTensor as operands: the three matmuls ----------------------------------------------------------------------
def test_matmul_fully_replicated():
    mesh = create_mesh([("x", 6)], devices=DEVICES)
    layout = Layout([UNSHARDED, UNSHARDED], mesh)
    a = dtensor_from_array([[1, 2, 3], [4, 5, 6]], layout=layout)
    b = dtensor_from_array([[6, 5], [4, 3], [2, 1]], layout=layout)
    c = torch.matmul(a, b)  # runs 6 identical matmuls in parallel on 6 devices
    assert fetch_layout(c).sharding_specs == ["unsharded", "unsharded"]
    assert components(c) == [[[20, 14], [56, 41]]] * 6


def test_matmul_sharded_on_the_contracted_axis(mesh32):
    a = dtensor_from_array([[1, 2, 3], [4, 5, 6]], layout=Layout([UNSHARDED, "x"], mesh32))
    b = dtensor_from_array([[6, 5], [4, 3], [2, 1]], layout=Layout(["x", UNSHARDED], mesh32))
    c = torch.matmul(a, b)  # local matmuls, then a sum over x
    assert fetch_layout(c).sharding_specs == ["unsharded", "unsharded"]
    assert components(c) == [[[20, 14], [56, 41]]] * 6


def test_matmul_additional_sharding(mesh32):
    a = dtensor_from_array([[1, 2, 3], [4, 5, 6]], layout=Layout(["y", "x"], mesh32))
    b = dtensor_from_array([[6, 5], [4, 3], [2, 1]], layout=Layout(["x", UNSHARDED], mesh32))
    c = torch.matmul(a, b)
    # The sharding of `a` on the first axis is carried to `c`
    assert fetch_layout(c).sharding_specs == ["y", "unsharded"]
    assert components(c) == [[[20, 14]], [[56, 41]], [[20, 14]], [[56, 41]], [[20, 14]], [[56, 41]]]


# -- DTensor as output -------------------------------------------------------------------------------------------
ONES_COMPONENTS = [[[1.0, 1.0], [1.0, 1.0]]] * 6


def test_call_with_layout_ones(mesh32):
    ones = call_with_layout(torch.ones, Layout(["x", "y"], mesh32), shape=(6, 4))
    assert str(ones) == (
        'DTensor({"CPU:0": [[1. 1.] [1. 1.]], "CPU:1": [[1. 1.] [1. 1.]], "CPU:2": [[1. 1.] [1. 1.]], '
        '"CPU:3": [[1. 1.] [1. 1.]], "CPU:4": [[1. 1.] [1. 1.]], "CPU:5": [[1. 1.] [1. 1.]]}, '
        f'layout="sharding_specs:x,y, mesh:|x=3,y=2|0,1,2,3,4,5|0,1,2,3,4,5|{CPUS}", shape=(6, 4), '
        "dtype=torch.float32)")
    assert components(ones) == ONES_COMPONENTS


def test_call_with_layout_stateless_normal(mesh32):
    layout = Layout(["x", "y"], mesh32)
    ones = call_with_layout(spmd.random.stateless_normal, layout, shape=(6, 4), seed=(1, 1))
    assert fetch_layout(ones) == layout and ones.shape == (6, 4)
    assert all(c.shape == (2, 2) for c in unpack(ones))
    assert str(ones).startswith('DTensor({"CPU:0": [[')
    assert str(ones).endswith(f'layout="sharding_specs:x,y, mesh:{mesh32.to_string()}", shape=(6, 4), '
                              "dtype=torch.float32)")
    plain = spmd.random.stateless_normal((6, 4), seed=(1, 1))
    assert torch.equal(spmd.to_global(ones), plain)
    parts = unpack(ones)  # every device holds a different 2x2 block of the same global tensor
    assert all(not torch.equal(parts[i], parts[j]) for i in range(6) for j in range(i))


def test_call_with_layout_of_a_function_wrapping_ones(mesh32):
    # the tutorial's `tf.function(tf.ones)`: any Python function built from torch's factories
    def ones_fn(shape):
        return torch.ones(shape)

    ones = call_with_layout(ones_fn, Layout(["x", "y"], mesh32), shape=(6, 4))
    assert fetch_layout(ones) == Layout(["x", "y"], mesh32)
    assert components(ones) == ONES_COMPONENTS


# -- From tf.Variable to DVariable -------------------------------------------------------------------------------
def test_dvariable():
    mesh = create_mesh([("x", 6)], devices=DEVICES)
    layout = Layout([UNSHARDED, UNSHARDED], mesh)
    v = DVariable(initial_value=call_with_layout(spmd.random.stateless_normal, layout=layout,
                                                 shape=torch.Size([64, 32]), seed=[1, 1], dtype=torch.float32))
    assert layout == fetch_layout(v)
    assert v.shape == (64, 32) and v.dtype == torch.float32

    # add a DVariable and a DTensor
    a = call_with_layout(torch.ones, layout=layout, shape=(64, 32))
    b = v + a
    assert fetch_layout(b) == layout and not isinstance(b, DVariable)
    assert torch.allclose(spmd.to_global(b), spmd.random.stateless_normal((64, 32), seed=[1, 1]) + 1)
    text = str(b)
    assert text.startswith("DTensor([[") and "..." in text  # a replicated tensor prints one (summarised) value
    # a DVariable requires grad like an nn.Parameter, so the sum does too
    assert text.endswith(f'layout="sharding_specs:unsharded,unsharded, mesh:{mesh.to_string()}", '
                         "shape=(64, 32), dtype=torch.float32, requires_grad=True)")

    # assign a DTensor to a DVariable
    v.assign(a)
    assert torch.equal(torch.as_tensor(v.numpy()), torch.ones(64, 32))
    assert str(a).startswith("DTensor([[1. 1. 1. ... 1. 1. 1.] [1. 1. 1. ... 1. 1. 1.]")
    assert fetch_layout(v) == layout

    # the variable's layout is immutable: assigning a DTensor of another mesh raises
    another_mesh = create_mesh([("x", 3), ("y", 2)], devices=DEVICES)
    b = call_with_layout(torch.ones, layout=Layout([UNSHARDED, UNSHARDED], another_mesh), shape=(64, 32))
    with pytest.raises(ValueError, match="mesh"):
        v.assign(b)
    assert fetch_layout(v) == layout
