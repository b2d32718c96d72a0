"""Layout conformance, mirroring TF's `layout_test.py` (reference §1.3, §2.1, §3.1)."""

import copy
import pickle
import re

import pytest

from spmd import MATCH, UNSHARDED, Layout, create_mesh

U = UNSHARDED


@pytest.fixture(scope="module")
def mesh():
    return create_mesh([("x", 2), ("y", 4)])


@pytest.fixture(scope="module")
def bmesh():
    return create_mesh([("batch", 2), ("x", 2)])


# -- constructor -------------------------------------------------------------------------------------------------
def test_constants():
    assert UNSHARDED == "unsharded" and MATCH == "match"


@pytest.mark.parametrize("specs", [[], ["x"], ["x", "y"], ["y", "x"], [U, "x"], [U, U, U], [U, "y", U, "x"],
                                   ("x", "y"), [MATCH, MATCH, "x"], [U, U]])
def test_valid_layouts(mesh, specs):
    layout = Layout(specs, mesh)
    assert layout.sharding_specs == list(specs)
    assert layout.rank == len(specs)
    assert layout.mesh is mesh


@pytest.mark.parametrize("make, message", [
    (lambda m: Layout(["x"], "string_mesh"), "mesh is not a valid Mesh object"),
    (lambda m: Layout(["x"], None), "mesh is not a valid Mesh object"),
    (lambda m: Layout(["q"], m), "q: A dimension sharding must either be a valid mesh dimension or UNSHARDED."),
    (lambda m: Layout(["WRONG_SHARDING_SPEC", "UNSHARDED"], m),
     "WRONG_SHARDING_SPEC: A dimension sharding must either be a valid mesh dimension or UNSHARDED."),
    (lambda m: Layout(["x", "UNSHARDED"], m),  # the capitalised constant name is itself invalid
     "UNSHARDED: A dimension sharding must either be a valid mesh dimension or UNSHARDED."),
    (lambda m: Layout(["any"], m), "any: A dimension sharding must either be a valid mesh dimension or UNSHARDED."),
    (lambda m: Layout(["x", "x"], m), "Mesh dimension x was repeated in sharding specification ['x', 'x']. "
                                      "Mesh dimensions must be unique in a layout."),
    (lambda m: Layout(["y", U, "y"], m), "Mesh dimension y was repeated"),
    (lambda m: Layout.batch_sharded(m, "q", 2), "q: A dimension sharding must either be a valid mesh dimension"),
    (lambda m: Layout.replicated(m, -1), "-1"),
])
def test_constructor_errors(mesh, make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make(mesh)


def test_non_string_spec_is_rejected(mesh):
    with pytest.raises((TypeError, ValueError)):
        Layout([1], mesh)
    with pytest.raises((TypeError, ValueError)):
        Layout("x", mesh)  # a bare string is not a list of specs


# -- the class-method constructors -------------------------------------------------------------------------------
@pytest.mark.parametrize("make, specs", [
    (lambda m: Layout.replicated(m, 0), []),
    (lambda m: Layout.replicated(m, 1), [U]),
    (lambda m: Layout.replicated(m, 3), [U, U, U]),
    (lambda m: Layout.replicated(m, rank=2), [U, U]),
    (lambda m: Layout.batch_sharded(m, "x", 1), ["x"]),
    (lambda m: Layout.batch_sharded(m, "x", 3), ["x", U, U]),
    (lambda m: Layout.batch_sharded(m, "y", 3, axis=1), [U, "y", U]),
    (lambda m: Layout.batch_sharded(m, batch_dim="y", rank=2, axis=1), [U, "y"]),
    (lambda m: Layout.inner_sharded(m, "y", 1), ["y"]),
    (lambda m: Layout.inner_sharded(m, "x", 3), [U, U, "x"]),
])
def test_class_constructors(mesh, make, specs):
    assert make(mesh) == Layout(specs, mesh)


def test_batch_sharded_axis_out_of_range_raises(mesh):
    with pytest.raises(ValueError):
        Layout.batch_sharded(mesh, "x", 2, axis=2)


# -- members -----------------------------------------------------------------------------------------------------
def test_members(mesh):
    layout = Layout(["y", "x"], mesh)
    assert layout.rank == 2
    assert layout.shape == [2, 4]  # the mesh shape, as in TF
    assert layout.mesh == mesh
    assert layout.sharding_specs == ["y", "x"]


@pytest.mark.parametrize("specs, shards", [
    ([], []),
    ([U], [1]),
    (["x"], [2]),
    (["y", "x"], [4, 2]),
    (["x", U], [2, 1]),
    ([U, "y", U], [1, 4, 1]),
])
def test_num_shards(mesh, specs, shards):
    layout = Layout(specs, mesh)
    assert [layout.num_shards(i) for i in range(layout.rank)] == shards


def test_num_shards_of_batch_sharded(bmesh):
    layout = Layout.batch_sharded(bmesh, "batch", 2)
    assert layout.num_shards(0) == 2 and layout.num_shards(1) == 1


def test_num_shards_match_and_out_of_range(mesh):
    assert Layout([MATCH, "x"], mesh).num_shards(0) == 2 ** 64 - 1
    with pytest.raises((ValueError, IndexError, RuntimeError)):
        Layout(["x"], mesh).num_shards(1)


@pytest.mark.parametrize("specs, replicated, batch_parallel", [
    ([], True, False),
    ([U], True, False),
    ([U, U, U], True, False),
    (["x"], False, True),
    (["x", U], False, True),
    ([U, "x"], False, False),
    (["x", "y"], False, False),
])
def test_predicates(mesh, specs, replicated, batch_parallel):
    layout = Layout(specs, mesh)
    assert layout.is_fully_replicated() is replicated
    assert layout.is_batch_parallel() is batch_parallel
    assert layout.is_single_device() is False


@pytest.mark.parametrize("specs, global_shape, local_shape", [
    (["y", "x"], (12, 10), (3, 5)),
    (["y", "x"], (8, 6), (2, 3)),
    ([U, U], (8, 6), (8, 6)),
    (["x", U], (8, 6), (4, 6)),
    ([U, "y"], (8, 8), (8, 2)),
    ([], (), ()),
])
def test_shape_conversions(mesh, specs, global_shape, local_shape):
    layout = Layout(specs, mesh)
    assert layout.local_shape_from_global_shape(global_shape) == local_shape
    assert layout.global_shape_from_local_shape(local_shape) == global_shape
    assert isinstance(layout.local_shape_from_global_shape(list(global_shape)), tuple)
    assert isinstance(layout.global_shape_from_local_shape(list(local_shape)), tuple)


def test_shape_conversions_tf_examples(mesh, bmesh):
    yx = Layout(["y", "x"], mesh)
    assert yx.global_shape_from_local_shape([3, 5]) == (12, 10)
    assert yx.local_shape_from_global_shape([8, 6]) == (2, 3)
    assert yx.local_shape_from_global_shape([7, 5]) == (1, 2)  # floor division, no divisibility error
    assert yx.local_shape_from_global_shape([-1, 4]) == (-1, 2)  # an unknown size stays unknown
    layout = Layout(["batch", "x", U], bmesh)
    assert layout.local_shape_from_global_shape((2, 6, 5)) == (1, 3, 5)
    assert layout.global_shape_from_local_shape((1, 3, 5)) == (2, 6, 5)


def test_offset_to_shard_tf_examples(mesh):
    first = Layout(["x", U], mesh)
    assert first.offset_to_shard() == [(0, 0)] * 4 + [(1, 0)] * 4
    yx = Layout(["y", "x"], mesh)
    offsets = yx.offset_to_shard()
    assert offsets == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1)]
    assert [yx.offset_tuple_to_global_index(o) for o in offsets] == [0, 2, 4, 6, 1, 3, 5, 7]
    assert [first.offset_tuple_to_global_index(o) for o in first.offset_to_shard()] == [0] * 4 + [1] * 4


@pytest.mark.parametrize("specs, offsets", [
    ([U, U], [(0, 0)] * 8),
    (["x", "y"], [(i // 4, i % 4) for i in range(8)]),
    ([U, "y"], [(0, i % 4) for i in range(8)]),
    ([], [()] * 8),
])
def test_offset_to_shard(mesh, specs, offsets):
    assert Layout(specs, mesh).offset_to_shard() == offsets


def test_offset_tuple_to_global_index_is_row_major_over_the_shard_grid(mesh):
    layout = Layout(["x", "y"], mesh)
    assert [layout.offset_tuple_to_global_index((i, j)) for i in range(2) for j in range(4)] == list(range(8))


@pytest.mark.parametrize("specs, dims, remaining", [
    (["x", "y", U], 0, ["y", U]),
    (["x", "y", U], 1, ["x", U]),
    (["x", "y", U], [0, 2], ["y"]),
    (["x", "y", U], [0, 1, 2], []),
    (["x", "y", U], -1, ["x", "y"]),
])
def test_delete(mesh, specs, dims, remaining):
    layout = Layout(specs, mesh)
    assert layout.delete(dims) == Layout(remaining, mesh)
    assert layout.sharding_specs == specs  # a new layout; the original is unchanged


@pytest.mark.parametrize("dims", [3, -4, [0, 3]])
def test_delete_out_of_range(mesh, dims):
    with pytest.raises(ValueError, match="cannot delete axes"):
        Layout(["x", "y", U], mesh).delete(dims)


# -- the string format (§2.1) ------------------------------------------------------------------------------------
def test_to_string_exact(mesh):
    m = mesh.to_string()
    assert Layout(["x", U], mesh).to_string() == f"sharding_specs:x,unsharded, mesh:{m}"
    assert Layout(["y", "x"], mesh).to_string() == f"sharding_specs:y,x, mesh:{m}"
    assert Layout([U], mesh).to_string() == f"sharding_specs:unsharded, mesh:{m}"
    assert Layout([], mesh).to_string() == f"sharding_specs: mesh:{m}"
    assert Layout.replicated(mesh, 0).to_string() == f"sharding_specs: mesh:{m}"
    assert repr(Layout(["x", U], mesh)) == f"Layout.from_string(sharding_specs:x,unsharded, mesh:{m})"
    assert str(Layout(["x", U], mesh)) == repr(Layout(["x", U], mesh))


def test_rank_one_unsharded_differs_from_rank_zero(mesh):
    m = mesh.to_string()
    one = Layout.from_string("sharding_specs:unsharded, mesh:" + m)
    zero = Layout.from_string("sharding_specs: mesh:" + m)
    assert one != zero
    assert one.rank == 1 and zero.rank == 0
    assert Layout.replicated(mesh, 1) != Layout.replicated(mesh, 0)


@pytest.mark.parametrize("specs", ["batch,x,", "unsharded,unsharded,", "x,", "", "unsharded,batch,"])
def test_string_round_trip(bmesh, specs):
    s = f"sharding_specs:{specs} mesh:{bmesh.to_string()}"
    layout = Layout.from_string(s)
    assert layout.to_string() == s
    assert Layout.from_string(layout.to_string()) == layout
    assert layout.mesh == bmesh


def test_string_round_trip_with_named_mesh():
    mesh = create_mesh([("x", 2), ("y", 2)], mesh_name="my_mesh")
    layout = Layout(["y", U], mesh)
    assert layout.to_string().startswith("sharding_specs:y,unsharded, mesh:my_mesh|x=2,y=2|")
    assert Layout.from_string(layout.to_string()) == layout


@pytest.mark.parametrize("text, message", [
    ("garbage", "garbage"),
    ("sharding_specs:q, mesh:{m}", "q"),
    ("sharding_specs:x,x, mesh:{m}", "x"),
    ("sharding_specs: x, mesh:{m}", "x"),
    ("sharding_specs:x, mesh:garbage", "garbage"),
])
def test_from_string_errors(mesh, text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Layout.from_string(text.format(m=mesh.to_string()))


# -- value semantics ---------------------------------------------------------------------------------------------
def test_equality_and_hash(mesh):
    a = Layout(["x", U], mesh)
    b = Layout.batch_sharded(create_mesh([("x", 2), ("y", 4)]), "x", 2)
    assert a == b and hash(a) == hash(b)
    assert a != Layout([U, "x"], mesh)
    assert a != Layout(["x", U], create_mesh([("x", 2), ("y", 4)], mesh_name="other"))  # the mesh name counts
    assert a != Layout(["x", U, U], mesh)
    assert a != "sharding_specs:x,unsharded, mesh:" + mesh.to_string()
    assert len({a, b, Layout.replicated(mesh, 2)}) == 2


@pytest.mark.parametrize("make", [
    lambda m: Layout.replicated(m, 3),
    lambda m: Layout.batch_sharded(m, "x", 2),
    lambda m: Layout(["y", "x"], m),
    lambda m: Layout([], m),
])
def test_pickle_and_copy(mesh, make):
    layout = make(mesh)
    assert pickle.loads(pickle.dumps(layout)) == layout
    assert copy.copy(layout) == layout and copy.deepcopy(layout) == layout


def test_repr_names_the_specs(bmesh):
    assert "batch,unsharded" in repr(Layout.batch_sharded(bmesh, "batch", 2))
