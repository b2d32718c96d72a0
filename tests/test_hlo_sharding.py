"""Layouts <-> XLA HLO shardings (`spmd.hlo_sharding`, `Layout.to_hlo_sharding`/`from_hlo_sharding`): the text
format, `OpSharding`, the mapping to mesh dims, and agreement with what JAX/XLA print (jax is optional)."""

import itertools
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from spmd import MATCH, UNSHARDED, Layout, LayoutError, create_mesh
from spmd.hlo_sharding import (HloSharding, OpSharding, OpShardingType, as_hlo_sharding, from_mesh_axes,
                               to_mesh_axes)

MESHES = {"2x4": [("x", 2), ("y", 4)], "4x2": [("x", 4), ("y", 2)], "2x2x2": [("x", 2), ("y", 2), ("z", 2)],
          "8": [("x", 8)]}
R, T = OpShardingType.REPLICATED, OpShardingType.OTHER


def _all_axes(names, rank):
    """Every per-axis choice of a mesh dim or None, no mesh dim twice."""
    for axes in itertools.product([None, *names], repeat=rank):
        used = [a for a in axes if a is not None]
        if len(set(used)) == len(used):
            yield axes


def _multi_axes(names, rank):
    """Every choice per axis of None, a mesh dim, or an ordered tuple of several, with a tuple somewhere."""
    options = [None, *names] + [p for k in range(2, len(names) + 1) for p in itertools.permutations(names, k)]
    for axes in itertools.product(options, repeat=rank):
        used = [d for a in axes if a is not None for d in ((a,) if isinstance(a, str) else a)]
        if len(set(used)) == len(used) and any(isinstance(a, tuple) for a in axes):
            yield axes


def _ids(layouts):
    return [f"{key}:{','.join('+'.join(a) if isinstance(a, tuple) else a or '_' for a in axes)}"
            for key, axes in layouts]


SINGLE = [(key, axes) for key, dims in MESHES.items() for rank in (1, 2, 3)
          for axes in _all_axes([n for n, _ in dims], rank)]
MULTI = [(key, axes) for key, dims in MESHES.items() for rank in (1, 2)
         for axes in _multi_axes([n for n, _ in dims], rank)]
LAYOUTS = SINGLE + MULTI
IDS = _ids(LAYOUTS)


def _layout(key, axes):
    return Layout.from_axes(axes, create_mesh(MESHES[key]))


def test_the_sweep_covers_every_layout():
    assert len(SINGLE) == 23 + 23 + 51 + 9
    # rank 1: 2 (2x4, 4x2 each) + 12 (2x2x2); rank 2: 2 * 2 (a tuple beside an unsharded axis), then 2x2x2: a pair
    # (6 ordered) beside None or the third dim, or a triple (6) beside None, on either axis
    assert len(MULTI) == (2 + 2 + 12) + (4 + 4 + 2 * (6 * 2 + 6))


# -- round trips --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, axes", LAYOUTS, ids=IDS)
def test_text_round_trip(key, axes):
    layout = _layout(key, axes)
    text = layout.to_hlo_sharding()
    assert Layout.from_hlo_sharding(text, layout.mesh, rank=layout.rank) == layout
    if not layout.is_fully_replicated():  # a tiled sharding tells the rank itself
        assert Layout.from_hlo_sharding(text, layout.mesh) == layout
    assert HloSharding.parse(text).to_text() == text


@pytest.mark.parametrize("key, axes", LAYOUTS, ids=IDS)
def test_op_sharding_round_trip(key, axes):
    layout = _layout(key, axes)
    op = layout.to_op_sharding()
    assert Layout.from_hlo_sharding(op, layout.mesh, rank=layout.rank) == layout
    assert HloSharding.from_op_sharding(op).to_text() == layout.to_hlo_sharding()
    explicit = from_mesh_axes(layout.mesh, axes).to_op_sharding(iota=False)
    assert Layout.from_hlo_sharding(explicit, layout.mesh, rank=layout.rank) == layout


@pytest.mark.parametrize("key", MESHES)
def test_permuted_device_ids_round_trip(key):
    mesh = create_mesh(MESHES[key])
    ids = np.random.default_rng(0).permutation(8) + 100
    for rank in (1, 2, 3):
        for axes in [*_all_axes(mesh.dim_names, rank), *_multi_axes(mesh.dim_names, rank)]:
            layout = Layout.from_axes(axes, mesh)
            text = layout.to_hlo_sharding(device_ids=ids)
            assert Layout.from_hlo_sharding(text, mesh, device_ids=ids, rank=rank) == layout
            op = layout.to_op_sharding(device_ids=ids.reshape(mesh.shape()))
            assert Layout.from_hlo_sharding(op, mesh, device_ids=ids, rank=rank) == layout


# -- exact strings ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, axes, text", [
    ("2x4", (None, None), "{replicated}"),
    ("2x4", ("y", None), "{devices=[4,1,2]<=[2,4]T(1,0) last_tile_dim_replicate}"),
    ("2x4", ("x", None), "{devices=[2,1,4]<=[8] last_tile_dim_replicate}"),
    ("2x4", (None, "y"), "{devices=[1,4,2]<=[2,4]T(1,0) last_tile_dim_replicate}"),
    ("2x4", ("x", "y"), "{devices=[2,4]<=[8]}"),
    ("2x4", ("y", "x"), "{devices=[4,2]<=[2,4]T(1,0)}"),
    ("4x2", ("y", "x", None), "{devices=[2,4,1]<=[4,2]T(1,0)}"),
    ("2x2x2", ("z",), "{devices=[2,4]<=[4,2]T(1,0) last_tile_dim_replicate}"),
    ("2x2x2", ("y", "z", "x"), "{devices=[2,2,2]<=[2,4]T(1,0)}"),
    ("2x2x2", (None, "z", "y"), "{devices=[1,2,2,2]<=[2,2,2]T(2,1,0) last_tile_dim_replicate}"),
    ("2x2x2", ("y", "x"), "{devices=[2,2,2]<=[2,2,2]T(1,0,2) last_tile_dim_replicate}"),
    ("8", (None, "x"), "{devices=[1,8]<=[8]}"),
    # an axis tiled over several mesh dims, the first major (JAX's P(("x", "y")))
    ("2x4", (("x", "y"), None), "{devices=[8,1]<=[8]}"),
    ("2x4", (("y", "x"),), "{devices=[8]<=[2,4]T(1,0)}"),
    ("2x2x2", (("x", "z"), None), "{devices=[4,1,2]<=[2,2,2]T(0,2,1) last_tile_dim_replicate}"),
    ("2x2x2", ("y", ("z", "x")), "{devices=[2,4]<=[2,4]T(1,0)}"),
])
def test_canonical_text(key, axes, text):
    layout = _layout(key, axes)
    assert layout.to_hlo_sharding() == text
    assert Layout.from_hlo_sharding(text, layout.mesh, rank=layout.rank) == layout


def test_custom_device_ids_text():
    mesh = create_mesh(MESHES["2x4"])
    reverse = list(range(7, -1, -1))
    assert Layout(["x", "y"], mesh).to_hlo_sharding(device_ids=reverse) == "{devices=[2,4]7,6,5,4,3,2,1,0}"
    # each replica group is sorted, as XLA keeps it
    assert Layout(["x", UNSHARDED], mesh).to_hlo_sharding(device_ids=reverse) == \
        "{devices=[2,1,4]4,5,6,7,0,1,2,3 last_tile_dim_replicate}"
    # a permutation that is an iota transposed prints as one
    strided = [0, 2, 4, 6, 1, 3, 5, 7]
    assert Layout(["x", "y"], mesh).to_hlo_sharding(device_ids=strided) == "{devices=[2,4]<=[4,2]T(1,0)}"
    assert from_mesh_axes(mesh, ["x", "y"], strided).to_text(iota=False) == "{devices=[2,4]0,2,4,6,1,3,5,7}"
    # a mesh whose ids do not start at 0 is no iota
    shifted = [8, 9, 10, 11, 12, 13, 14, 15]
    assert Layout(["y", UNSHARDED], mesh).to_hlo_sharding(device_ids=shifted) == \
        "{devices=[4,1,2]8,12,9,13,10,14,11,15 last_tile_dim_replicate}"
    # the same layout numbered differently reads back only with the same numbering
    with pytest.raises(LayoutError, match="order"):
        Layout.from_hlo_sharding("{devices=[2,4]7,6,5,4,3,2,1,0}", mesh)


def test_one_device_mesh():
    mesh = create_mesh([("x", 1)])
    assert Layout(["x", UNSHARDED], mesh).to_hlo_sharding() == "{replicated}"
    assert Layout.from_hlo_sharding("{replicated}", mesh, rank=2).sharding_specs == [UNSHARDED, UNSHARDED]
    assert Layout.from_hlo_sharding("{maximal device=0}", mesh, rank=1).sharding_specs == [UNSHARDED]
    with pytest.raises(LayoutError, match="maximal sharding puts the whole tensor on device 3"):
        Layout.from_hlo_sharding("{maximal device=3}", mesh, rank=1)


def test_rank_zero_layout():
    mesh = create_mesh(MESHES["2x4"])
    assert Layout([], mesh).to_hlo_sharding() == "{replicated}"
    assert Layout.from_hlo_sharding("{replicated}", mesh, rank=0) == Layout([], mesh)


# -- parsing ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("{replicated}", HloSharding(R)),
    ("{manual}", HloSharding(OpShardingType.MANUAL)),
    ("{maximal device=3}", HloSharding(OpShardingType.MAXIMAL, devices=(3,))),
    ("{devices=[2,1,2]0,1,2,3}", HloSharding(T, (2, 1, 2), (0, 1, 2, 3))),
    ("{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}", HloSharding(T, (2, 1, 2), (0, 1, 2, 3), True)),
    ("{devices=[2,2,2]0,1,2,3,4,5,6,7 last_tile_dims={manual}}",
     HloSharding(T, (2, 2, 2), range(8), last_tile_dims=(OpShardingType.MANUAL,))),
    ("{devices=[2,2,2]0,1,2,3,4,5,6,7 last_tile_dims={replicated}}",
     HloSharding(T, (2, 2, 2), range(8), last_tile_dims=(R,))),
    ("{devices=[4,2]<=[8]}", HloSharding(T, (4, 2), range(8))),
    ("{devices=[2,4]<=[4,2]T(1,0)}", HloSharding(T, (2, 4), (0, 2, 4, 6, 1, 3, 5, 7))),
    ("{devices=[4,1,2]<=[2,4]T(1,0) last_tile_dim_replicate}",
     HloSharding(T, (4, 1, 2), (0, 4, 1, 5, 2, 6, 3, 7), True)),
    ("{devices=[2,2,2]<=[8] last_tile_dims={manual, replicated}}",
     HloSharding(T, (2, 2, 2), range(8), last_tile_dims=(OpShardingType.MANUAL, R))),
    (' { devices=[2,1]0, 1  metadata={op_name="a{b\\"}" source_file="x.py"} } ', HloSharding(T, (2, 1), (0, 1))),
])
def test_parse(text, expected):
    assert HloSharding.parse(text) == expected
    assert as_hlo_sharding(text) == expected


def test_parsed_members():
    s = HloSharding.parse("{devices=[2,2,2]<=[8] last_tile_dims={manual}}")
    assert (s.data_tile_dims, s.num_subgroup_dims, s.subgroups()) == ((2, 2), 1, ((OpShardingType.MANUAL, 2),))
    s = HloSharding.parse("{devices=[2,1,4]<=[8] last_tile_dim_replicate}")
    assert (s.data_tile_dims, s.num_subgroup_dims, s.subgroups()) == ((2, 1), 1, ((R, 4),))
    assert str(s) == "{devices=[2,1,4]<=[8] last_tile_dim_replicate}"


@pytest.mark.parametrize("text, canonical", [
    ("{devices=[2,1,2]0,1,2,3}", "{devices=[2,1,2]<=[4]}"),
    ("{devices=[2,4]0,4,1,5,2,6,3,7}", "{devices=[2,4]<=[2,4]T(1,0)}"),
    ("{devices=[2,2,2]<=[8] last_tile_dims={manual}}", "{devices=[2,2,2]<=[8] last_tile_dims={manual}}"),
    ("{devices=[2,2]3,2,1,0}", "{devices=[2,2]3,2,1,0}"),  # no iota: a reversal
    ("{devices=[2,2]4,5,6,7}", "{devices=[2,2]4,5,6,7}"),  # no iota: not from 0
    ("{devices=[2,2]<=[2,2]T(0,1)}", "{devices=[2,2]<=[4]}"),
    # XLA's own canonicalisation examples
    ("{devices=[60]<=[3,4,5]T(0,1,2)}", "{devices=[60]<=[60]}"),
    ("{devices=[60]<=[3,4,5]T(1,2,0)}", "{devices=[60]<=[3,20]T(1,0)}"),
    ("{devices=[60]<=[3,4,5]T(2,0,1)}", "{devices=[60]<=[12,5]T(1,0)}"),
    ("{devices=[60]<=[3,4,5]T(2,1,0)}", "{devices=[60]<=[3,4,5]T(2,1,0)}"),
    ("{devices=[60]<=[3,4,5]T(1,0,2)}", "{devices=[60]<=[3,4,5]T(1,0,2)}"),
    ("{devices=[60]<=[1,3,1,4,1,5]T(4,3,2,5,1,0)}", "{devices=[60]<=[3,20]T(1,0)}"),
    ("{devices=[1,1]<=[1]}", "{devices=[1,1]<=[1]}"),
])
def test_canonical_iota(text, canonical):
    assert HloSharding.parse(text).to_text() == canonical
    assert HloSharding.parse(canonical) == HloSharding.parse(text)


def test_to_text_explicit():
    assert HloSharding.parse("{devices=[4,1,2]<=[2,4]T(1,0) last_tile_dim_replicate}").to_text(iota=False) == \
        "{devices=[4,1,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}"
    assert HloSharding.parse("{maximal device=5}").to_text(iota=False) == "{maximal device=5}"


@pytest.mark.parametrize("text, words", [
    ("replicated", "braces"),
    ("{bogus}", "cannot parse"),
    ("{}", "exactly one"),
    ("{replicated manual}", "exactly one"),
    ("{{replicated}, {manual}}", "tuple sharding"),
    ("{replicated last_tile_dim_replicate}", "only qualify"),
    ("{devices=[2,2]0,1,2}", "4 tiles"),
    ("{devices=[2,2]0,0,1,2}", "distinct"),
    ("{devices=[4]<=[4]T(0,0)}", "permute"),
    ("{devices=[4]<=[2,4]T(1,0)}", "cannot fill"),
    ("{devices=[2,2]<=[4] last_tile_dim_replicate last_tile_dims={manual}}", "exclude each other"),
    ("{devices=[2,2]<=[4] last_tile_dims={maximal}}", "manual and replicated"),
    ("{devices=[2,2]<=[4] last_tile_dims={manual, manual, manual}}", "3 subgroup dims but only 2"),
    ("{devices=[2]<=[2] last_tile_dim_replicate last_tile_dim_replicate}", "twice"),
    ("{devices=[2,1]0,1 metadata={x}", "balanced"),
])
def test_parse_errors(text, words):
    with pytest.raises(LayoutError, match=words):
        HloSharding.parse(text)


def test_parse_needs_a_string():
    with pytest.raises(TypeError, match="str"):
        HloSharding.parse(3)


# -- OpSharding ---------------------------------------------------------------------------------------------------
def test_to_op_sharding():
    assert HloSharding(R).to_op_sharding() == OpSharding(R)
    assert HloSharding.parse("{maximal device=3}").to_op_sharding() == OpSharding(1, tile_assignment_devices=(3,))
    assert HloSharding.parse("{manual}").to_op_sharding() == OpSharding(4)
    tiled = HloSharding.parse("{devices=[4,1,2]<=[2,4]T(1,0) last_tile_dim_replicate}")
    assert tiled.to_op_sharding() == OpSharding(T, (4, 1, 2), (), True, (), (2, 4), (1, 0))
    assert tiled.to_op_sharding(iota=False) == OpSharding(T, (4, 1, 2), (0, 4, 1, 5, 2, 6, 3, 7), True)
    manual = HloSharding.parse("{devices=[2,2,2]<=[8] last_tile_dims={manual}}").to_op_sharding()
    assert (manual.last_tile_dims, manual.iota_reshape_dims, manual.iota_transpose_perm) == \
        ((OpShardingType.MANUAL,), (8,), (0,))


def test_op_sharding_read_duck_typed():
    """Any object with the proto's fields converts; types may be numbers, names or enums with a name."""
    proto = types.SimpleNamespace(type=types.SimpleNamespace(name="OTHER"), tile_assignment_dimensions=[4, 2],
                                  tile_assignment_devices=[], replicate_on_last_tile_dim=False, last_tile_dims=[],
                                  iota_reshape_dims=[2, 4], iota_transpose_perm=[1, 0])
    mesh = create_mesh(MESHES["2x4"])
    assert Layout.from_hlo_sharding(proto, mesh).sharding_specs == ["y", "x"]
    partial = types.SimpleNamespace(type=3, tile_assignment_dimensions=[2, 1, 4], replicate_on_last_tile_dim=True,
                                    tile_assignment_devices=[0, 1, 2, 3, 4, 5, 6, 7])
    assert Layout.from_hlo_sharding(partial, mesh).sharding_specs == ["x", UNSHARDED]
    assert OpSharding.of(partial) == OpSharding(T, (2, 1, 4), tuple(range(8)), True)
    assert Layout.from_hlo_sharding(types.SimpleNamespace(type=0), mesh, rank=1).sharding_specs == [UNSHARDED]


def test_op_sharding_errors():
    with pytest.raises(LayoutError, match="type TUPLE"):
        HloSharding.from_op_sharding(OpSharding(OpShardingType.TUPLE))
    with pytest.raises(LayoutError, match="unknown OpSharding type 9"):
        OpSharding(9)
    with pytest.raises(TypeError, match="an OpSharding"):
        Layout.from_hlo_sharding(3.5, create_mesh(MESHES["2x4"]))


# -- what a Layout cannot express -------------------------------------------------------------------------------
@pytest.mark.parametrize("text, rank, words", [
    ("{maximal device=3}", 1, "maximal sharding puts the whole tensor on device 3"),
    ("{manual}", 1, "manual sharding"),
    ("{devices=[2,2,2]<=[8] last_tile_dims={manual}}", None, r"manual subgroups of \[2\] devices"),
    ("{devices=[4,2]<=[8]}", None, r"tensor axis 0 is split 4 ways over mesh dims \['x', 'y'\] \(x=2, y=4\) but "
                                   "its tiles do not run row-major over them in any order"),
    ("{devices=[2,1,4]<=[4,2]T(1,0) last_tile_dim_replicate}", None,
     r"tensor axis 0 is split 2 ways over a subset of mesh dim 'y' \(size 4\)"),
    ("{devices=[2,1,4]4,5,6,7,0,1,2,3 last_tile_dim_replicate}", None,
     r"tiles of tensor axis 0 lie along mesh dim 'x' in the order \[1, 0\]"),
    ("{devices=[2,1,4]<=[8] last_tile_dim_replicate}", 3, "it tiles 2 tensor axes but the tensor has rank 3"),
    ("{devices=[2]0,1}", None, "the sharding uses 2 devices but the mesh has 8"),
    ("{devices=[2,1,2]8,9,10,11 last_tile_dim_replicate}", None, r"devices \[8, 9, 10, 11\] are not in this mesh"),
    ("{replicated}", None, "pass rank="),
    ("{devices=[2,4]<=[8]}", -1, "non-negative"),
])
def test_unsupported(text, rank, words):
    mesh = create_mesh(MESHES["2x4"])
    with pytest.raises(LayoutError, match=words) as info:
        Layout.from_hlo_sharding(text, mesh, rank=rank)
    assert "on mesh x=2,y=4" in str(info.value) or rank == -1


def test_layout_side_errors():
    mesh = create_mesh(MESHES["2x4"])
    with pytest.raises(LayoutError, match="MATCH"):
        Layout([MATCH, "x"], mesh).to_hlo_sharding()
    with pytest.raises(LayoutError, match=r"device_ids of shape \[4\] do not fit mesh x=2,y=4"):
        Layout(["x", "y"], mesh).to_hlo_sharding(device_ids=[0, 1, 2, 3])
    with pytest.raises(LayoutError, match=r"device_ids of shape \[4, 2\]"):
        Layout(["x", "y"], mesh).to_op_sharding(device_ids=np.arange(8).reshape(4, 2))
    with pytest.raises(LayoutError, match="distinct non-negative"):
        Layout(["x", "y"], mesh).to_hlo_sharding(device_ids=[0, 0, 1, 2, 3, 4, 5, 6])
    with pytest.raises(LayoutError, match="'z' is not a dim of mesh x=2,y=4"):
        from_mesh_axes(mesh, ["z"])
    with pytest.raises(LayoutError, match="twice"):
        from_mesh_axes(mesh, ["x", "x"])
    with pytest.raises(LayoutError, match="expected a spmd Mesh"):
        to_mesh_axes("{replicated}", "mesh", rank=1)


# -- agreement with JAX and XLA ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def jax_parts():
    jax = pytest.importorskip("jax")
    from jax._src.lib import xla_client
    return jax, xla_client


@pytest.mark.parametrize("key, axes", LAYOUTS, ids=IDS)
def test_matches_jax(jax_parts, key, axes):
    """The same text and proto fields as JAX's HLO sharding of the NamedSharding (an abstract mesh numbers its
    devices 0..7 in mesh order, as spmd's default ids do), and jax's proto converts back to the layout."""
    jax, _ = jax_parts
    layout = _layout(key, axes)
    mesh = jax.sharding.AbstractMesh(tuple(layout.mesh.shape()), tuple(layout.mesh.dim_names))
    theirs = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes))._to_xla_hlo_sharding(len(axes))
    assert layout.to_hlo_sharding() == str(theirs)
    proto = theirs.to_proto()
    assert layout.to_op_sharding() == OpSharding.of(proto)
    assert Layout.from_hlo_sharding(proto, layout.mesh, rank=layout.rank) == layout


@pytest.mark.parametrize("key", MESHES)
def test_xla_reads_our_text_and_proto(jax_parts, key):
    """XLA's parser prints our texts back unchanged (they are canonical), also with custom device ids, and
    builds the same sharding from our OpSharding fields."""
    _, xc = jax_parts
    mesh = create_mesh(MESHES[key])
    for ids in (None, np.random.default_rng(1).permutation(8), [0, 2, 4, 6, 1, 3, 5, 7]):
        for axes in itertools.chain(*(_all_axes(mesh.dim_names, rank) for rank in (1, 2, 3))):
            ours = from_mesh_axes(mesh, axes, ids)
            assert str(xc.HloSharding.from_string(ours.to_text())) == ours.to_text()
            op, proto = ours.to_op_sharding(), xc.OpSharding()
            proto.type = xc.OpSharding.Type.__members__[op.type.name]
            for field in ("tile_assignment_dimensions", "tile_assignment_devices", "iota_reshape_dims",
                          "iota_transpose_perm"):
                setattr(proto, field, list(getattr(op, field)))
            proto.replicate_on_last_tile_dim = op.replicate_on_last_tile_dim
            assert str(xc.HloSharding.from_proto(proto)) == ours.to_text()


@pytest.mark.parametrize("shape", [(2, 3, 2), (2, 2, 2, 2), (1, 3, 1, 4, 1, 5)])
def test_iota_canonical_form_matches_xla(jax_parts, shape):
    """Every transpose of an iota: our canonical form (found from the device list) is the one XLA prints."""
    _, xc = jax_parts
    for perm in itertools.permutations(range(len(shape))):
        text = f"{{devices=[{np.prod(shape)}]<=[{','.join(map(str, shape))}]T({','.join(map(str, perm))})}}"
        assert HloSharding.parse(text).to_text() == str(xc.HloSharding.from_string(text)), text


@pytest.mark.parametrize("text", [
    "{replicated}", "{manual}", "{maximal device=3}", "{devices=[2,2,2]<=[8] last_tile_dims={manual}}",
    "{devices=[2,2,2]<=[2,2,2]T(0,2,1) last_tile_dims={manual, replicated}}", "{devices=[2,2]3,2,1,0}",
    "{devices=[4,1,2]<=[2,4]T(1,0) last_tile_dim_replicate}",
])
def test_text_and_proto_match_xla(jax_parts, text):
    _, xc = jax_parts
    theirs = xc.HloSharding.from_string(text)
    assert HloSharding.parse(text).to_text() == str(theirs)
    assert HloSharding.parse(text).to_op_sharding() == OpSharding.of(theirs.to_proto())
    assert HloSharding.from_op_sharding(theirs.to_proto()) == HloSharding.parse(text)


_CONCRETE = """
import json, sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
cases = json.loads(sys.argv[1])
devices = np.array(jax.devices())
out = [str(NamedSharding(Mesh(devices.reshape(shape), names), P(*axes))._to_xla_hlo_sharding(len(axes)))
       for shape, names, axes in cases]
print(json.dumps(out))
"""


def test_matches_jax_on_8_cpu_devices(jax_parts):
    """A real mesh of 8 CPU devices (a fresh process: XLA_FLAGS must be set before jax starts) prints the same."""
    cases = [(key, axes) for key, axes in LAYOUTS if len(axes) == 2]
    layouts = [_layout(key, axes) for key, axes in cases]
    args = [(layout.mesh.shape(), layout.mesh.dim_names, axes) for layout, (_, axes) in zip(layouts, cases)]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", _CONCRETE, json.dumps(args)], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [layout.to_hlo_sharding() for layout in layouts]
