"""Bad input raises a clear, typed error in the user's terms, at once: meshes, layouts and their strings, pack and
unpack, relayout, creation, random values, DVariables, datasets, checkpoints, the CLI and clients that disagree.

Each case names the exact error type (torch's own where torch would raise) and what the message must say. Bad `dim`s
and shapes of torch ops are in test_torch_errors.py.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import time
from types import SimpleNamespace

import pytest
import torch

import spmd
from spmd import MATCH, UNSHARDED as U, Layout, Mesh
from spmd.errors import (CheckpointError, IndivisibleError, LayoutError, MeshMismatchError, MixedTensorError)

DEVICES2 = ",".join(f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2))


@pytest.fixture(scope="module")
def env(mesh22):
    """What the cases act on: a 2x2 mesh, a 1-D mesh of 4, a (4, 4) DTensor sharded over x, a DVariable."""
    return SimpleNamespace(
        mesh=mesh22, mesh4=spmd.create_mesh([("a", 4)]),
        d=spmd.copy_to_mesh(torch.zeros(4, 4), Layout(["x", U], mesh22)),
        var=spmd.DVariable(torch.zeros(4, 4), layout=Layout(["x", U], mesh22)))


def _raises(cases: dict, name: str, env):
    build, error, says = cases[name]
    with pytest.raises(error, match=says) as info:
        build(env)
    assert info.type is error, f"{name}: raised {info.type.__name__}, not {error.__name__}"


# -- meshes ----------------------------------------------------------------------------------------------------------
MESHES = {
    "size 0": (lambda e: spmd.create_mesh([("x", 0)]), LayoutError,
               r"mesh dimension 'x' has size 0: sizes must be positive \(or -1 once"),
    "size -2": (lambda e: spmd.create_mesh([("x", -2)]), LayoutError, "mesh dimension 'x' has size -2"),
    "two sizes -1": (lambda e: spmd.create_mesh([("x", -1), ("y", -1)]), LayoutError,
                     "only one mesh dimension may have size -1"),
    "name not a str": (lambda e: spmd.create_mesh([(3, 2)]), LayoutError,
                       r"mesh_dims must be \(name, size\) pairs or a dict, got \[\(3, 2\)\]"),
    "size a float": (lambda e: spmd.create_mesh([("x", 2.5)]), LayoutError, r"\(name, size\) pairs"),
    "size a bool": (lambda e: spmd.create_mesh([("x", True)]), LayoutError, r"\(name, size\) pairs"),
    "mesh_dims a str": (lambda e: spmd.create_mesh("x=2"), LayoutError, "got 'x=2'"),
    "repeated name": (lambda e: spmd.create_mesh([("x", 2), ("x", 2)]), LayoutError,
                      r"mesh dimension names must be unique, got \['x', 'x'\]"),
    "devices do not fill it": (lambda e: spmd.create_mesh([("x", 3)], devices=["CPU:0", "CPU:1"]), LayoutError,
                               r"length of devices \(2\) must be equal to total size of the mesh of shape \[3\]"),
    "devices of another type": (lambda e: spmd.create_mesh([("x", 1)], devices=["CPU:0"], device_type="GPU"),
                                LayoutError, "Conflicting devices .* and device_type GPU"),
    "too many devices": (lambda e: spmd.create_mesh([("x", 10 ** 10)]), LayoutError,
                         "10,000,000,000 devices; this process holds every virtual device's component"),
    "ids of another rank": (lambda e: Mesh(["x"], [[0, 1], [2, 3]], [0, 1, 2, 3], [f"CPU:{i}" for i in range(4)]),
                            LayoutError, r"Number of mesh dimensions \(2, shape \[2, 2\]\) does not match"),
}


@pytest.mark.parametrize("case", list(MESHES))
def test_bad_meshes(env, case):
    _raises(MESHES, case, env)


@pytest.mark.parametrize("name", ["unsharded", "match", "a,b", "a|b", "a=b", "a+b", ""])
def test_mesh_dimension_names_that_layouts_cannot_tell_apart_are_refused(name):
    with pytest.raises(LayoutError, match=re.escape(f"mesh dimension name {name!r} is not allowed")):
        spmd.create_mesh([(name, 2)])


def test_a_mesh_survives_its_string_and_pickle(mesh22):
    assert Mesh.from_string(mesh22.to_string()) == mesh22 and pickle.loads(pickle.dumps(mesh22)) == mesh22


# -- layouts ---------------------------------------------------------------------------------------------------------
LAYOUTS = {
    "unknown mesh dim": (lambda e: Layout(["z"], e.mesh), LayoutError,
                         r"z: A dimension sharding must either be a valid mesh dimension or UNSHARDED. Mesh "
                         r"dimensions: \['x', 'y'\]"),
    "repeated mesh dim": (lambda e: Layout(["x", "x"], e.mesh), LayoutError,
                          r"Mesh dimension x was repeated in sharding specification \['x', 'x'\]"),
    "unknown dim in a multi-axis spec": (lambda e: Layout([("x", "z")], e.mesh), LayoutError,
                                         r"in the multi-axis spec \('x', 'z'\)"),
    "repeated dim in a multi-axis spec": (lambda e: Layout([("x", "x")], e.mesh), LayoutError, "x was repeated"),
    "spec not a str": (lambda e: Layout([3], e.mesh), LayoutError, r"sharding_specs must be a list of strings"),
    "mesh not a Mesh": (lambda e: Layout(["x"], "mesh"), LayoutError, "mesh is not a valid Mesh object: got str"),
    "negative rank": (lambda e: Layout.replicated(e.mesh, -1), LayoutError,
                      "rank must be a non-negative integer, got -1"),
    "rank of copy_to_mesh": (lambda e: spmd.copy_to_mesh(torch.zeros(4, 4), Layout(["x"], e.mesh)), LayoutError,
                             r"cannot give a tensor of shape \[4, 4\] \(rank 2\) the layout \['x'\] of rank 1"),
    "indivisible copy_to_mesh": (lambda e: spmd.copy_to_mesh(torch.zeros(3), Layout(["x"], e.mesh)),
                                 IndivisibleError, r"axis 0 of a tensor of shape \[3\] has size 3, which does not "
                                 r"divide by the 2 shards of mesh dimension 'x'"),
    "copy_to_mesh without a Layout": (lambda e: spmd.copy_to_mesh(torch.zeros(4), "x"), TypeError,
                                      "copy_to_mesh expects a Layout, got str"),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_bad_layouts(env, case):
    _raises(LAYOUTS, case, env)


# -- strings ---------------------------------------------------------------------------------------------------------
STRINGS = {
    "Mesh.from_string(None)": (lambda e: Mesh.from_string(None), TypeError,
                               "Mesh.from_string expects a str, got NoneType"),
    "Layout.from_string(3)": (lambda e: Layout.from_string(3), TypeError, "Layout.from_string expects a str, got int"),
    "a mesh string of garbage": (lambda e: Mesh.from_string("garbage"), LayoutError,
                                 "Input string is invalid: garbage"),
    "a negative size": (lambda e: Mesh.from_string(f"|x=-2|0,1|0,1|{DEVICES2}"), LayoutError,
                        r"sizes must be positive, got \[-2\]"),
    "a size that is no number": (lambda e: Mesh.from_string(f"|x=a|0,1|0,1|{DEVICES2}"), LayoutError,
                                 r"Input string is invalid: .*invalid literal for int\(\)"),
    "sizes and ids that differ": (lambda e: Mesh.from_string(f"|x=4|0,1|0,1|{DEVICES2}"), LayoutError,
                                  "mesh size doesn't match number of devices: |x=4|"),
    "a layout string of garbage": (lambda e: Layout.from_string("garbage"), LayoutError,
                                   "Expected 'sharding_specs:<specs>, mesh:<mesh>', got 'garbage'"),
    "a layout string's unknown dim": (lambda e: Layout.from_string("sharding_specs:z, mesh:" + e.mesh.to_string()),
                                      LayoutError, "z: A dimension sharding must either be a valid mesh dimension"),
    "a layout string's bad mesh": (lambda e: Layout.from_string("sharding_specs:x, mesh:garbage"), LayoutError,
                                   "Input string is invalid: garbage"),
}


@pytest.mark.parametrize("case", list(STRINGS))
def test_bad_strings(env, case):
    _raises(STRINGS, case, env)


# -- MATCH, pack and unpack, relayout ------------------------------------------------------------------------------
MATCH_USES = {
    "zeros": lambda l: spmd.zeros((4,), layout=l),
    "ones": lambda l: spmd.ones((4,), layout=l),
    "fill": lambda l: spmd.fill((4,), 1.0, layout=l),
    "zeros_like": lambda l: spmd.zeros_like(torch.zeros(4), layout=l),
    "pack": lambda l: spmd.pack([torch.zeros(1)] * 4, l),
    "copy_to_mesh": lambda l: spmd.copy_to_mesh(torch.zeros(4), l),
    "call_with_layout": lambda l: spmd.call_with_layout(torch.zeros, l, (4,)),
    "DVariable": lambda l: spmd.DVariable(torch.zeros(4), layout=l),
}


@pytest.mark.parametrize("use", list(MATCH_USES))
def test_match_only_serves_relayout(mesh22, use):
    with pytest.raises(LayoutError, match=r"layout \['match'\] has MATCH on axis 0: MATCH only serves relayout"):
        MATCH_USES[use](Layout([MATCH], mesh22))


def test_match_in_relayout_still_keeps_the_axis(mesh22):
    t = spmd.copy_to_mesh(torch.zeros(4, 4), Layout(["x", U], mesh22))
    assert spmd.fetch_layout(spmd.relayout(t, Layout([MATCH, "y"], mesh22))).sharding_specs == ["x", "y"]


MOVES = {
    "pack: too few components": (lambda e: spmd.pack([torch.zeros(2)] * 3, Layout(["x"], e.mesh)), LayoutError,
                                 r"pack expected 4 components \(one per local device of the mesh x=2,y=2\), but "
                                 r"got 3"),
    "pack: shapes differ": (lambda e: spmd.pack([torch.zeros(2)] * 3 + [torch.zeros(3)], Layout(["x"], e.mesh)),
                            LayoutError, r"same shape: component 0 has \[2\], component 3 has \[3\]"),
    "pack: dtypes differ": (lambda e: spmd.pack([torch.zeros(2)] * 3 + [torch.zeros(2, dtype=torch.int64)],
                                                Layout(["x"], e.mesh)), LayoutError,
                            "same dtype: component 0 is torch.float32, component 3 is torch.int64"),
    "pack: rank of the layout": (lambda e: spmd.pack([torch.zeros(2, 2)] * 4, Layout(["x"], e.mesh)), LayoutError,
                                 r"component 0 has rank 2 \(shape \[2, 2\]\) while layout \['x'\] has rank 1"),
    "pack: a DTensor": (lambda e: spmd.pack([e.d] * 4, Layout([U, U], e.mesh)), LayoutError,
                        "pack expects plain components; this is already a DTensor"),
    "pack: no Layout": (lambda e: spmd.pack([torch.zeros(1)] * 4, "x"), TypeError, "pack expects a Layout, got str"),
    "unpack: a plain tensor": (lambda e: spmd.unpack(torch.zeros(2)), TypeError,
                               "unpack expects a DTensor, got Tensor"),
    "to_global: a plain tensor": (lambda e: spmd.to_global(torch.zeros(2)), TypeError,
                                  "to_global expects a DTensor, got Tensor"),
    "fetch_layout: a plain tensor": (lambda e: spmd.fetch_layout(torch.zeros(2)), TypeError,
                                     r"fetch_layout expects a DTensor, got a plain torch.Tensor of shape \[2\]"),
    "relayout: a plain tensor": (lambda e: spmd.relayout(torch.zeros(4), Layout(["x"], e.mesh)), TypeError,
                                 r"relayout expects a DTensor, got Tensor; to distribute a plain tensor use "
                                 r"spmd.copy_to_mesh"),
    "relayout: no Layout": (lambda e: spmd.relayout(e.d, "x"), TypeError, "expected a Layout, got str"),
    "relayout: rank": (lambda e: spmd.relayout(e.d, Layout(["x"], e.mesh)), LayoutError,
                       r"cannot give a tensor of shape \[4, 4\] \(rank 2\) the layout \['x'\] of rank 1"),
    "relayout: indivisible": (lambda e: spmd.relayout(e.d[:3], Layout(["x", U], e.mesh)), IndivisibleError,
                              r"axis 0 of a tensor of shape \[3, 4\] has size 3"),
    "relayout_like: a plain tensor": (lambda e: spmd.relayout_like(e.d, torch.zeros(4, 4)), TypeError,
                                      "expected a DTensor, got Tensor"),
    "an op mixing a plain tensor": (lambda e: e.d + torch.ones(4, 4), MixedTensorError,
                                    r"a plain torch.Tensor of shape \[4, 4\] was mixed with DTensors"),
    "an op across meshes": (lambda e: e.d + spmd.copy_to_mesh(torch.zeros(4, 4), Layout(["a", U], e.mesh4)),
                            MeshMismatchError, "aten.add.Tensor got DTensors on different meshes"),
}


@pytest.mark.parametrize("case", list(MOVES))
def test_bad_packs_and_relayouts(env, case):
    _raises(MOVES, case, env)


# -- creation and random values --------------------------------------------------------------------------------------
CREATION = {
    "zeros: rank": (lambda e: spmd.zeros((4, 4), layout=Layout([U], e.mesh)), LayoutError,
                    r"shape \[4, 4\] \(rank 2\) does not match layout \['unsharded'\] of rank 1"),
    "zeros: indivisible": (lambda e: spmd.zeros((3,), layout=Layout(["x"], e.mesh)), IndivisibleError,
                           r"axis 0 of a tensor of shape \[3\] has size 3"),
    "zeros: negative size": (lambda e: spmd.zeros((-4,), layout=Layout([U], e.mesh)), RuntimeError,
                             r"negative dimension -4: \[-4\]"),
    "ones: negative size (the global shape)": (lambda e: spmd.ones(2, -4, layout=Layout([U, U], e.mesh)),
                                               RuntimeError, r"negative dimension -4: \[2, -4\]$"),
    "fill: rank": (lambda e: spmd.fill((4,), 1.0, layout=Layout([U, U], e.mesh)), LayoutError,
                   r"shape \[4\] \(rank 1\) does not match layout"),
    "zeros: layout not a Layout": (lambda e: spmd.zeros((4,), layout="x"), TypeError,
                                   "layout must be a spmd.Layout, got str"),
    "normal: negative size": (lambda e: spmd.random.stateless_normal((-4,), seed=1), RuntimeError,
                              r"Trying to create tensor with negative dimension -4: \[-4\]"),
    "uniform: negative size": (lambda e: spmd.random.stateless_uniform((2, -1), seed=1, layout=Layout([U, U], e.mesh)),
                               RuntimeError, r"negative dimension -1: \[2, -1\]"),
    "truncated normal: negative size": (lambda e: spmd.random.stateless_truncated_normal((-3,), seed=1),
                                        RuntimeError, "negative dimension -3"),
    "normal: a float size": (lambda e: spmd.random.stateless_normal((4.5,), seed=1), TypeError,
                             r"shape must be a sequence of ints, got \(4.5,\)"),
    "normal: a str seed": (lambda e: spmd.random.stateless_normal((4,), seed="abc"), TypeError,
                           "seed must be an int or a pair of ints"),
    "normal: rank of the layout": (lambda e: spmd.random.stateless_normal((4, 4), seed=1, layout=Layout(["x"], e.mesh)),
                                   LayoutError, r"a tensor of shape \[4, 4\] \(rank 2\) cannot take layout"),
    "normal: indivisible": (lambda e: spmd.random.stateless_normal((3,), seed=1, layout=Layout(["x"], e.mesh)),
                            IndivisibleError, "does not divide by the 2 shards of mesh dimension 'x'"),
    "uniform: integers without maxval": (lambda e: spmd.random.stateless_uniform((4,), seed=1, dtype=torch.int32),
                                         ValueError, "stateless_uniform with an integer dtype needs maxval"),
    "uniform: an empty integer range": (lambda e: spmd.random.stateless_uniform((4,), seed=1, minval=3, maxval=3,
                                                                                dtype=torch.int32),
                                        ValueError, "needs minval < maxval, got minval=3 and maxval=3"),
    "uniform: minval above maxval": (lambda e: spmd.random.stateless_uniform((4,), seed=1, minval=2, maxval=1),
                                     ValueError, "needs minval <= maxval, got minval=2 and maxval=1"),
}


@pytest.mark.parametrize("case", list(CREATION))
def test_bad_creation_and_random_values(env, case):
    _raises(CREATION, case, env)


# a reduction without identity over an empty dim: torch's error, not one about the stacked components
EMPTY_REDUCTIONS = {"amax(0)": lambda t: t.amax(0), "amin(0)": lambda t: t.amin(0), "max(0)": lambda t: t.max(0),
                    "min(0)": lambda t: t.min(0), "max()": lambda t: t.max(), "aminmax(dim=0)":
                    lambda t: torch.aminmax(t, dim=0)}


@pytest.mark.parametrize("op", list(EMPTY_REDUCTIONS))
def test_reductions_over_an_empty_dim_raise_torchs_error(mesh22, op):
    value = torch.zeros(0, 4)
    with pytest.raises(Exception) as expected:
        EMPTY_REDUCTIONS[op](value)
    t = spmd.copy_to_mesh(value, Layout([U, "y"], mesh22))
    with pytest.raises(expected.type) as info:
        EMPTY_REDUCTIONS[op](t)
    assert info.type is expected.type and str(info.value) == str(expected.value)


# -- DVariable -------------------------------------------------------------------------------------------------------
VARIABLES = {
    "assign a plain tensor": (lambda e: e.var.assign(torch.zeros(3, 4)), TypeError,
                              r"cannot assign a plain Tensor of shape \[3, 4\] to a DVariable; only scalars are "
                              r"broadcast"),
    "assign_add a plain tensor": (lambda e: e.var.assign_add(torch.zeros(2)), TypeError,
                                  r"cannot assign_add a plain Tensor of shape \[2\]"),
    "assign_sub a list": (lambda e: e.var.assign_sub([1.0, 2.0]), TypeError,
                          r"cannot assign_sub a plain list of shape \[2\]"),
    "assign another layout": (lambda e: e.var.assign(spmd.copy_to_mesh(torch.zeros(4, 4), Layout([U, "y"], e.mesh))),
                              LayoutError, r"cannot assign a value of layout \['unsharded', 'y'\] to a DVariable "
                                           r"of layout \['x', 'unsharded'\]: a DVariable's layout is fixed"),
    "assign another mesh": (lambda e: e.var.assign(spmd.copy_to_mesh(torch.zeros(4, 4), Layout(["a", U], e.mesh4))),
                            MeshMismatchError, "cannot assign a value on mesh .* to a DVariable on"),
    "assign another shape": (lambda e: e.var.assign(spmd.copy_to_mesh(torch.zeros(8, 4), Layout(["x", U], e.mesh))),
                             LayoutError, r"Cannot assign a value of shape \[8, 4\] to a DVariable of shape \[4, 4\]"),
    "rank of the layout": (lambda e: spmd.DVariable(torch.zeros(4, 4), layout=Layout(["x"], e.mesh)), LayoutError,
                           r"cannot give a tensor of shape \[4, 4\] \(rank 2\) the layout \['x'\] of rank 1"),
    "indivisible": (lambda e: spmd.DVariable(torch.zeros(3), layout=Layout(["x"], e.mesh)), IndivisibleError,
                    r"axis 0 of a tensor of shape \[3\] has size 3"),
    "no layout": (lambda e: spmd.DVariable(torch.zeros(3)), LayoutError,
                  "Neither layout nor DTensor initial value are provided: pass layout= or a DTensor"),
}


@pytest.mark.parametrize("case", list(VARIABLES))
def test_bad_dvariables(env, case):
    _raises(VARIABLES, case, env)


# -- DTensorDataset ------------------------------------------------------------------------------------------------
ROWS = [torch.full((4,), float(i)) for i in range(16)]


def _dataset(e, data=ROWS, specs=("x", U), **kwargs):
    kwargs.setdefault("global_batch_size", 4)
    layouts = kwargs.pop("layouts", Layout(list(specs), e.mesh))
    return spmd.DTensorDataset(data, mesh=kwargs.pop("mesh", e.mesh), layouts=layouts, **kwargs)


DATASETS = {
    "batch size 0": (lambda e: _dataset(e, global_batch_size=0), ValueError,
                     "global_batch_size must be a positive integer, got 0"),
    "batch size a float": (lambda e: _dataset(e, global_batch_size=4.0), ValueError,
                           "global_batch_size must be a positive integer, got 4.0"),
    "batch size not divisible": (lambda e: _dataset(e, global_batch_size=3, batch_dim="x"), ValueError,
                                 "global_batch_size 3 is not divisible by the 2 shards of batch_dim 'x'"),
    "unknown batch_dim": (lambda e: _dataset(e, batch_dim="z"), LayoutError,
                          r"batch_dim 'z' is not a dimension of the mesh \(dimensions \['x', 'y'\]\)"),
    "batch_dim not in the layout": (lambda e: _dataset(e, specs=("y", U), batch_dim="x"), LayoutError,
                                    "batch_dim x was specified but at least one layout did not contain it"),
    "rank of the layout": (lambda e: _dataset(e, specs=("x",)), LayoutError,
                           r"Expected layout with rank 2 for element spec TensorSpec\(shape=\(4,\)"),
    "structure of the layouts": (lambda e: _dataset(e, layouts=[Layout(["x", U], e.mesh)] * 2), ValueError,
                                 r"the structure of layouts \[\*, \*\] does not match the structure of the dataset"),
    "layouts on another mesh": (lambda e: _dataset(e, mesh=e.mesh4), LayoutError, "layouts is on mesh"),
    "indivisible rows": (lambda e: _dataset(e, data=[torch.zeros(3)] * 8, specs=("x", "y")), IndivisibleError,
                         r"the batches of element \(global shape \[4, 3\], layout \['x', 'y'\]\) cannot be sharded"),
    "mesh not a Mesh": (lambda e: _dataset(e, mesh="m"), TypeError, "mesh must be a spmd.Mesh, got str"),
    "a dict dataset": (lambda e: _dataset(e, data={"a": 1}), TypeError,
                       "dataset must be a map-style dataset .* got dict"),
    "an empty dataset": (lambda e: _dataset(e, data=[]), ValueError,
                         "DTensorDataset got an empty dataset: cannot infer the element shapes"),
    "negative prefetch": (lambda e: _dataset(e, prefetch=-1), ValueError,
                          "prefetch must be None or a non-negative number of batches, got -1"),
    "ragged examples": (lambda e: list(_dataset(e, data=[torch.zeros(4)] * 3 + [torch.zeros(5)] * 5)), ValueError,
                        r"element 3 of the dataset cannot be batched with the first: element has shape \(5,\)"),
    "strings": (lambda e: _dataset(e, data=["ab"] * 8, specs=("x",)), TypeError,
                "dataset element of type str cannot be made a tensor"),
}


@pytest.mark.parametrize("case", list(DATASETS))
def test_bad_datasets(env, case):
    _raises(DATASETS, case, env)


# -- checkpoints -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory, mesh22):
    """A checkpoint of {"w": (4, 8) DTensor, "step": 3} to copy and damage."""
    path = tmp_path_factory.mktemp("pristine") / "ck"
    w = spmd.copy_to_mesh(torch.arange(32.).reshape(4, 8), Layout(["x", "y"], mesh22))
    spmd.checkpoint.save({"w": w, "step": 3}, path)
    return path


def _shard(path):
    return next(path.glob("*.distcp"))


def _cut(file, keep):
    file.write_bytes(file.read_bytes()[:keep])


DAMAGE = {
    "a shard cut in half": (lambda p: _cut(_shard(p), _shard(p).stat().st_size // 2), "__0_0.distcp",
                            r"is truncated \([\d,]+ of [\d,]+ bytes\) \(EOFError"),
    "a shard cut to 10 bytes": (lambda p: _cut(_shard(p), 10), "__0_0.distcp",
                                r"is truncated \(10 of .* bytes\) \(RuntimeError: PytorchStreamReader failed reading "
                                r"zip archive: not a ZIP archive\)"),
    "an empty shard": (lambda p: _cut(_shard(p), 0), "__0_0.distcp", r"is truncated \(0 of"),
    "a shard's header overwritten": (lambda p: _shard(p).write_bytes(b"\0" * _shard(p).stat().st_size),
                                     "__0_0.distcp", "is corrupted"),
    "a missing shard": (lambda p: _shard(p).unlink(), "__0_0.distcp", "is missing"),
    "garbage metadata": (lambda p: (p / ".metadata").write_bytes(b"garbage!"), ".metadata",
                         r"is corrupted \(UnpicklingError"),
    "empty metadata": (lambda p: _cut(p / ".metadata", 0), ".metadata", r"is corrupted \(EOFError: Ran out of input"),
    "metadata of another kind": (lambda p: (p / ".metadata").write_bytes(pickle.dumps([1, 2])), ".metadata",
                                 r"is corrupted \(AttributeError: 'list' object has no attribute"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_names_itself_and_the_file(saved, tmp_path, damage):
    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    hurt, file, says = DAMAGE[damage]
    hurt(path)
    with pytest.raises(CheckpointError, match=says) as info:
        spmd.checkpoint.load({"w": torch.zeros(4, 8), "step": 0}, path)
    assert f"cannot read the checkpoint at {str(path)!r}: its file {file!r}" in str(info.value)


CHECKPOINTS = {
    "load: no checkpoint": (lambda p, t: spmd.checkpoint.load({}, t / "nope"), FileNotFoundError,
                            "no checkpoint at .*nope: it does not exist"),
    "load: a directory without metadata": (lambda p, t: spmd.checkpoint.load({}, t), FileNotFoundError,
                                           r"has no .metadata file \(not a complete checkpoint\)"),
    "load: not a dict": (lambda p, t: spmd.checkpoint.load([1], p), TypeError,
                         r"load expects a dict \(state_dict\), got list"),
    "load: another shape": (lambda p, t: spmd.checkpoint.load({"w": torch.zeros(8, 4)}, p), ValueError,
                            r"'w': the checkpoint at .* holds a tensor of shape \[4, 8\], but the state dict to load "
                            r"into has shape \[8, 4\]"),
    "load: an entry it lacks": (lambda p, t: spmd.checkpoint.load({"bias": torch.zeros(8)}, p), KeyError,
                                "has no entry 'bias' that the state dict to load into has"),
    "load: a tensor for a value": (lambda p, t: spmd.checkpoint.load({"step": torch.zeros(1)}, p), ValueError,
                                   "'step': the checkpoint at .* holds a non-tensor value but the state dict"),
    "save: not a dict": (lambda p, t: spmd.checkpoint.save([1], t / "new"), TypeError,
                         r"save expects a dict \(state_dict\), got list"),
    "save: over a directory that is no checkpoint": (lambda p, t: spmd.checkpoint.save({"a": 1}, t), FileExistsError,
                                                     "exists and is not a checkpoint; spmd.checkpoint.save will not "
                                                     "overwrite it"),
}


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_bad_checkpoint_calls(saved, tmp_path, case):
    call, error, says = CHECKPOINTS[case]
    with pytest.raises(error, match=says) as info:
        call(saved, tmp_path)
    assert info.type is error


def test_a_save_removes_what_killed_saves_left(tmp_path, mesh22):
    from spmd.checkpoint import _HOST
    path = tmp_path / "ck"
    dead = tmp_path / f".ck.tmp-{_HOST}-99999999-0123456789ab"  # this host, a pid no process has
    running = tmp_path / f".ck.tmp-{_HOST}-{os.getpid()}-0123456789ab"  # a save in progress
    old = tmp_path / ".ck.tmp-0123456789ab"  # an older name, untouched for two hours
    recent = tmp_path / ".ck.tmp-ba9876543210"  # ... and one just written: it may be in progress elsewhere
    other = tmp_path / ".other.tmp-0123456789ab"  # another checkpoint's
    for d in (dead, running, old, recent, other):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"partial")
    two_hours_ago = time.time() - 7200
    for f in (old, old / "__0_0.distcp", other, other / "__0_0.distcp"):
        os.utime(f, (two_hours_ago, two_hours_ago))
    spmd.checkpoint.save({"step": 1}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ck", running.name, recent.name, other.name])


# -- the CLI ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, says", [
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--steps", "-1"], "--steps must be at least 1, got -1"),
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--n-layer", "0"], "--n-layer must be at least 1, got 0"),
    (["--n-head", "5"], "--d-model 64 must divide into --n-head 5 heads"),
    (["--mesh", "batch=3"], "mesh dimension batch=3 (--mesh 'batch=3') must divide --batch-size (32)"),
    (["--mesh", "model=5"], "mesh dimension model=5 (--mesh 'model=5') must divide --n-head (4)"),
    (["--mesh", "foo"], "--mesh must look like 'batch=4,model=2', got 'foo'"),
    (["--mesh", "batch=x"], "--mesh must look like 'batch=4,model=2', got 'batch=x'"),
    (["--mesh", "batch=0"], "--mesh 'batch=0' needs distinct dimension names with sizes of at least 1"),
    (["--mesh", "batch=2,batch=2"], "needs distinct dimension names"),
    (["--mesh", "foo=2"], "--mesh 'foo=2': the demo's mesh dimensions are 'batch' and 'model', got ['foo']"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1), got 1.5"),
    (["--lr", "-1"], "--lr must be positive, got -1.0"),
    (["--clients", "3"], "--mesh batch=4,model=2 has 8 devices, which do not split over 3 clients"),
    (["--clients", "2", "--steps", "0"], "--steps must be at least 1, got 0"),  # once, before any client starts
])
def test_demo_flags_are_checked_before_training(flags, says):
    from spmd.cli import main
    with pytest.raises(SystemExit) as info:
        main(["demo", *flags])
    message = str(info.value.code)  # one line, no traceback
    assert message.startswith("spmd demo: error: ") and says in message and "\n" not in message


@pytest.mark.parametrize("argv, says", [(["tour", "--steps", "0"], "spmd tour: error: argument --steps: must be at "
                                                                  "least 1, got 0"),
                                        (["demo", "--clients", "-2"], "argument --clients: must be at least 1")])
def test_counts_below_one_are_refused_by_the_parser(argv, says, capsys):
    from spmd.cli import main
    with pytest.raises(SystemExit):
        main(argv)
    assert says in capsys.readouterr().err


# -- operators and other misuses ---------------------------------------------------------------------------------------
def test_bitwise_operators_with_a_plain_tensor_raise_spmds_error_not_pythons():
    """torch's operator slots turn a TypeError into NotImplemented; `plain | dtensor` (HF generate's stopping
    criteria) would otherwise read "unsupported operand type(s)" without saying why or how to fix it."""
    mesh = spmd.create_mesh([("x", 2)])
    d = spmd.copy_to_mesh(torch.ones(40, dtype=torch.bool), spmd.Layout(["x"], mesh))
    p = torch.zeros(40, dtype=torch.bool)
    for op in (lambda: p | d, lambda: d & p, lambda: p ^ d, lambda: d | p):
        with pytest.raises(spmd.MixedTensorError, match="implicit_replication"):
            op()
    with spmd.implicit_replication():
        assert spmd.to_global(p | d).all()
    i = spmd.copy_to_mesh(torch.arange(4), spmd.Layout(["x"], mesh))
    assert spmd.to_global(i << 1).tolist() == [0, 2, 4, 6] and spmd.to_global(1 << i).tolist() == [1, 2, 4, 8]


def test_a_dtensor_copied_into_a_plain_tensor_says_to_gather_it():
    """A plain module loading a distributed module's state_dict: the plain tensor is the destination, so
    `copy_to_mesh` (the advice for a plain operand) would not help."""
    mesh = spmd.create_mesh([("x", 2)])
    model = spmd.distribute_module(torch.nn.Linear(8, 4), mesh, {"weight": ["x", spmd.UNSHARDED]})
    plain = torch.nn.Linear(8, 4)
    with pytest.raises(RuntimeError, match=r"spmd.to_global\(v\) for k, v in state.items\(\)"):
        plain.load_state_dict(model.state_dict())
    plain.load_state_dict({k: spmd.to_global(v) for k, v in model.state_dict().items()})
    assert torch.equal(plain.weight, spmd.to_global(model.weight))


def test_an_op_no_layout_supports_says_to_run_it_on_plain_tensors():
    mesh = spmd.create_mesh([("x", 2)])
    replicated = lambda t: spmd.copy_to_mesh(t, spmd.Layout.replicated(mesh, t.dim()))  # noqa: E731
    with pytest.raises(spmd.UnsupportedOpError, match="No layout of its inputs is supported: run it on plain"):
        torch.histogramdd(replicated(torch.randn(4, 3)), bins=[2, 2, 2])  # (its result is a list of tensors)
