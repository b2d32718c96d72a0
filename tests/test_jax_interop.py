"""Meshes, layouts and DTensors converted to and from JAX (`jax.sharding.Mesh`, `NamedSharding`, `jax.Array`)."""

from __future__ import annotations

import itertools
import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
if len(jax.devices()) < 8:
    pytest.skip(f"jax was imported before XLA_FLAGS could give it 8 CPU devices ({len(jax.devices())})",
                allow_module_level=True)

from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding  # noqa: E402

import spmd  # noqa: E402
from spmd import MATCH, UNSHARDED as U, Layout, Mesh  # noqa: E402
from spmd.dtensor import make  # noqa: E402
from spmd.interop import from_jax_array, to_jax_array  # noqa: E402
from spmd.jax_sharding import import_jax  # noqa: E402

MESHES = [[("x", 2), ("y", 4)], [("x", 2), ("y", 2), ("z", 2)], [("x", 8)]]
PERMUTATION = [3, 1, 2, 0, 7, 5, 6, 4]


def every_layout(mesh, rank, multi=False):
    """Every layout of rank `rank` (with `multi`, also axes sharded over ordered tuples of several mesh dims)."""
    names = mesh.dim_names
    options = [None, *names]
    if multi:
        options += [p for k in range(2, len(names) + 1) for p in itertools.permutations(names, k)]
    for axes in itertools.product(options, repeat=rank):
        used = [d for a in axes if a is not None for d in ((a,) if isinstance(a, str) else a)]
        if len(used) == len(set(used)):
            yield Layout.from_axes(axes, mesh)


def permuted_jax_mesh(shape, names):
    return jax.sharding.Mesh(np.array(jax.devices())[PERMUTATION].reshape(shape), names)


# -- meshes ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dims", MESHES)
def test_mesh_round_trips(dims):
    mesh = spmd.create_mesh(dims)
    jax_mesh = mesh.to_jax()
    assert jax_mesh.axis_names == tuple(n for n, _ in dims)
    assert jax_mesh.devices.shape == tuple(s for _, s in dims)
    assert [d.id for d in jax_mesh.devices.flat] == list(range(8))
    assert Mesh.from_jax(jax_mesh) == mesh


@pytest.mark.parametrize("dims", MESHES)
def test_a_permuted_jax_mesh_keeps_its_order(dims):
    jax_mesh = permuted_jax_mesh(tuple(s for _, s in dims), tuple(n for n, _ in dims))
    mesh = Mesh.from_jax(jax_mesh)
    assert mesh.dim_names == [n for n, _ in dims] and mesh.shape() == [s for _, s in dims]
    assert [spmd.mesh.short_device_name(d) for d in mesh.local_devices()] == [f"CPU:{i}" for i in PERMUTATION]
    assert mesh.local_device_ids() == list(range(8))
    assert mesh.to_jax() == jax_mesh


def test_mesh_to_jax_devices():
    mesh = spmd.create_mesh([("a", 2), ("b", 2)])
    chosen = [jax.devices()[i] for i in (7, 6, 5, 4)]
    assert [d.id for d in mesh.to_jax(chosen).devices.flat] == [7, 6, 5, 4]
    assert mesh.to_jax(np.array(chosen).reshape(2, 2)).devices.tolist() == [chosen[:2], chosen[2:]]
    with pytest.raises(spmd.LayoutError, match=r"needs 4 jax devices, got 3"):
        mesh.to_jax(chosen[:3])
    # device indices jax does not have: its first devices, in order
    odd = spmd.create_mesh([("x", 2)], devices=["CPU:10", "CPU:11"])
    assert [d.id for d in odd.to_jax().devices.flat] == [0, 1]


def test_mesh_larger_than_jax():
    with pytest.raises(spmd.LayoutError, match=r"16 devices but jax sees 8 \(cpu\).*"
                                               r"XLA_FLAGS=--xla_force_host_platform_device_count=16"):
        spmd.create_mesh([("x", 4), ("y", 4)]).to_jax()


def test_mesh_from_jax_device_type_and_bad_input():
    jax_mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    assert Mesh.from_jax(jax_mesh, device_type="GPU").local_devices()[1].endswith("/device:GPU:1")
    with pytest.raises(TypeError, match="expected a jax.sharding.Mesh, got Mesh"):
        Mesh.from_jax(spmd.create_mesh([("x", 2)]))
    with pytest.raises(spmd.LayoutError, match=r"named by strings.*axis names \[0\]"):
        Mesh.from_jax(jax.sharding.Mesh(np.array(jax.devices()[:2]), (0,)))


def test_without_jax_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)
    with pytest.raises(ImportError, match=r"needs jax \(`pip install jax`\)"):
        import_jax()


# -- layouts ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dims", MESHES)
def test_every_layout_round_trips(dims):
    mesh = spmd.create_mesh(dims)
    jax_mesh = mesh.to_jax()
    for rank in range(4):
        for layout in every_layout(mesh, rank, multi=rank < 3):
            sharding = layout.to_jax()
            assert isinstance(sharding, NamedSharding) and sharding.mesh == jax_mesh
            assert tuple(sharding.spec) == layout.axes  # one entry per axis, trailing Nones kept
            assert layout.to_jax(jax_mesh) == sharding
            assert Layout.from_jax(sharding) == layout
            assert Layout.from_jax(sharding.spec, mesh, rank) == layout


def test_from_jax_specs():
    mesh = spmd.create_mesh([("x", 2), ("y", 4)])
    sharding = NamedSharding(mesh.to_jax(), P("y"))
    assert Layout.from_jax(sharding).sharding_specs == ["y"]
    assert Layout.from_jax(sharding, rank=3).sharding_specs == ["y", U, U]  # missing trailing entries: unsharded
    assert Layout.from_jax(P(("x",), (), None, "y"), mesh).sharding_specs == ["x", U, U, "y"]
    assert Layout.from_jax(P(), mesh, rank=2) == Layout.replicated(mesh, 2)
    assert Layout.from_jax(sharding, mesh) == Layout(["y"], mesh)
    # several mesh axes split one tensor axis, the first major
    assert Layout.from_jax(P(None, ("y", "x")), mesh).sharding_specs == [U, "y+x"]
    assert Layout.from_jax(P(None, ("y", "x")), mesh).axes == (None, ("y", "x"))
    assert tuple(Layout([("x", "y")], mesh).to_jax().spec) == (("x", "y"),)


def test_from_jax_errors():
    mesh = spmd.create_mesh([("x", 2), ("y", 4)])
    with pytest.raises(spmd.LayoutError, match=r"entry 1 of P\(None, \('x', None\)\) is \('x', None\): a tuple "
                                               "lists the mesh axes"):
        Layout.from_jax(P(None, ("x", None)), mesh)
    with pytest.raises(spmd.LayoutError, match=r"entry 0 of P\(\('x', 'z'\),\) is 'z', which is not an axis"):
        Layout.from_jax(P(("x", "z")), mesh)
    with pytest.raises(spmd.LayoutError, match="entry 0 of P.UNCONSTRAINED.* is UNCONSTRAINED"):
        Layout.from_jax(P(P.UNCONSTRAINED), mesh)
    with pytest.raises(spmd.LayoutError, match=r"entry 0 of P\('z',\) is 'z', which is not an axis of the mesh "
                                               r"\(axes \['x', 'y'\]\)"):
        Layout.from_jax(P("z"), mesh)
    with pytest.raises(spmd.LayoutError, match=r"P\('x', 'y'\) has 2 entries, more than the rank 1"):
        Layout.from_jax(P("x", "y"), mesh, rank=1)
    with pytest.raises(spmd.LayoutError, match=r"needs mesh=: a PartitionSpec names mesh axes but carries no mesh"):
        Layout.from_jax(P("x"))
    with pytest.raises(spmd.LayoutError, match="Mesh dimension x was repeated"):
        Layout.from_jax(P("x", "x"), mesh)
    other = spmd.create_mesh([("y", 4), ("x", 2)])
    with pytest.raises(spmd.LayoutError, match=r"jax mesh \{'x': 2, 'y': 4\} does not match mesh .*\{'y': 4, 'x': 2\}"):
        Layout.from_jax(NamedSharding(mesh.to_jax(), P("x")), other)
    with pytest.raises(TypeError, match="expected a jax NamedSharding or PartitionSpec, got SingleDeviceSharding"):
        Layout.from_jax(SingleDeviceSharding(jax.devices()[0]))


def test_to_jax_errors():
    mesh = spmd.create_mesh([("x", 2), ("y", 4)])
    with pytest.raises(spmd.LayoutError, match=r"jax mesh \{'a': 2, 'b': 4\} does not match layout"):
        Layout(["x"], mesh).to_jax(jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b")))
    with pytest.raises(spmd.LayoutError, match="MATCH only serves relayout"):
        Layout([MATCH], mesh).to_jax()


# -- arrays ----------------------------------------------------------------------------------------------------------
def _shards(array) -> dict:
    """jax device id -> that device's shard as a numpy array."""
    return {s.device.id: np.asarray(s.data) for s in array.addressable_shards}


@pytest.mark.parametrize("dims, spec", [([("x", 2), ("y", 4)], P("y", "x")), ([("x", 2), ("y", 4)], P(None, "y")),
                                        ([("x", 2), ("y", 2), ("z", 2)], P("z", None, "x")),
                                        ([("x", 8)], P("x")), ([("x", 8)], P()),
                                        ([("x", 2), ("y", 4)], P(("x", "y"))), ([("x", 2), ("y", 4)], P(("y", "x"))),
                                        ([("x", 2), ("y", 2), ("z", 2)], P(("z", "x"), "y"))])
@pytest.mark.parametrize("permuted", [False, True])
def test_jax_array_to_dtensor_and_back(dims, spec, permuted):
    shape, names = tuple(s for _, s in dims), tuple(n for n, _ in dims)
    jax_mesh = permuted_jax_mesh(shape, names) if permuted else jax.sharding.Mesh(
        np.array(jax.devices()).reshape(shape), names)
    rank = max(len(spec), 1) + (len(dims) == 3)
    value = np.arange(8 ** rank, dtype=np.float32).reshape((8,) * rank)
    array = jax.device_put(value, NamedSharding(jax_mesh, spec))
    t = from_jax_array(array)
    assert t._layout == Layout.from_jax(NamedSharding(jax_mesh, spec), rank=rank)
    shards = _shards(array)
    for k, device in enumerate(jax_mesh.devices.flat):  # component k is the shard of jax's device at position k
        np.testing.assert_array_equal(t._stack[k].numpy(), shards[device.id])
    np.testing.assert_array_equal(spmd.to_global(t).numpy(), value)
    back = to_jax_array(t)
    assert back.sharding.mesh == jax_mesh and back.shape == array.shape
    assert tuple(back.sharding.spec) == tuple(spec) + (None,) * (rank - len(spec))  # one entry per axis
    assert back.sharding.is_equivalent_to(array.sharding, rank)
    got = _shards(back)
    assert got.keys() == shards.keys()
    for device_id, shard in shards.items():
        np.testing.assert_array_equal(got[device_id], shard)


def test_dtensor_to_jax_array_components():
    mesh = spmd.create_mesh([("x", 2), ("y", 4)])
    x = torch.arange(64, dtype=torch.int32).reshape(8, 8)
    t = spmd.copy_to_mesh(x, Layout(["x", "y"], mesh))
    array = to_jax_array(t)
    assert array.sharding.spec == P("x", "y") and array.dtype == np.int32
    shards = _shards(array)
    for k in range(8):
        np.testing.assert_array_equal(shards[k], t._stack[k].numpy())
    np.testing.assert_array_equal(np.asarray(array), x.numpy())
    t._stack.add_(100)  # the jax array holds a copy, also on jax's device 0 where dlpack could alias
    np.testing.assert_array_equal(_shards(array)[0], x[:4, :2].numpy())


def test_pending_reduction_is_resolved():
    mesh = spmd.create_mesh([("x", 2), ("y", 4)])
    x = torch.arange(32.0).reshape(8, 4)
    t = spmd.copy_to_mesh(x, Layout(["x", "y"], mesh))
    product = t.T @ t
    assert product._pending
    array = to_jax_array(product)
    np.testing.assert_array_equal(np.asarray(array), (x.T @ x).numpy())
    for k, shard in _shards(array).items():
        np.testing.assert_array_equal(shard, product._stack[k].numpy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.bool, torch.int8, torch.float16])
def test_dtypes_both_ways(dtype):
    mesh = spmd.create_mesh([("x", 8)])
    x = (torch.arange(16) % 3).to(dtype)
    t = spmd.copy_to_mesh(x, Layout(["x"], mesh))
    back = from_jax_array(to_jax_array(t))
    assert back.dtype == dtype and back._layout == t._layout and torch.equal(back._stack, t._stack)


def test_64_bit_types_need_jax_x64():
    mesh = spmd.create_mesh([("x", 8)])
    t = spmd.copy_to_mesh(torch.arange(8.0, dtype=torch.float64), Layout(["x"], mesh))
    assert not jax.config.jax_enable_x64
    with pytest.raises(TypeError, match=r"torch.float64 components would be narrowed.*jax_enable_x64"):
        to_jax_array(t)
    jax.config.update("jax_enable_x64", True)
    try:
        array = to_jax_array(t)
        assert array.dtype == np.float64
        back = from_jax_array(array)
        assert back.dtype == torch.float64 and torch.equal(back._stack, t._stack)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_array_errors():
    remote = Mesh(["x"], [0, 1], [0], ["CPU:0"])  # a multi-client mesh: this process holds one of its devices
    with pytest.raises(spmd.LayoutError, match="spans several clients.*spmd.to_global"):
        to_jax_array(make(torch.zeros(1, 2), Layout.replicated(remote, 1)))
    with pytest.raises(TypeError, match="expects an spmd DTensor, got Tensor"):
        to_jax_array(torch.zeros(2))
    with pytest.raises(TypeError, match="expects a jax.Array, got ndarray"):
        from_jax_array(np.zeros(2))
    with pytest.raises(TypeError, match="got SingleDeviceSharding"):
        from_jax_array(jax.numpy.zeros(2))
    mesh = spmd.create_mesh([("x", 2), ("y", 4)])
    t = spmd.copy_to_mesh(torch.ones(4), Layout(["x"], mesh))
    wrong = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    with pytest.raises(spmd.LayoutError, match=r"jax mesh \{'x': 4, 'y': 2\} does not match layout"):
        to_jax_array(t, wrong)
