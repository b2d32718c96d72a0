"""The DTensor core API against TF DTensor: pack/unpack, numpy, repr, fetch/check_layout, copy_to_mesh
(reference §1.5, §2.1, §2.2, §3.5; seed 002)."""

import re

import numpy as np
import pytest
import torch

import spmd
from spmd import (
    UNSHARDED,
    DVariable,
    Layout,
    check_layout,
    copy_to_mesh,
    create_mesh,
    fetch_layout,
    is_dtensor,
    pack,
    relayout,
    unpack,
)
from tests.sweep import components, gather  # noqa: E402

U = UNSHARDED


A = torch.arange(16).reshape(4, 4)

# §3.5 (numpy_util_test.py): components in device order d0=(x0,y0), d1=(x0,y1), d2=(x1,y0), d3=(x1,y1).
PACK_TABLE = [
    ([U, U], [A, A, A, A]),
    (["x", U], [A[:2], A[:2], A[2:], A[2:]]),
    ([U, "y"], [A[:, :2], A[:, 2:], A[:, :2], A[:, 2:]]),
    (["y", U], [A[:2], A[2:], A[:2], A[2:]]),
    ([U, "x"], [A[:, :2], A[:, :2], A[:, 2:], A[:, 2:]]),
    (["x", "y"], [[[0, 1], [4, 5]], [[2, 3], [6, 7]], [[8, 9], [12, 13]], [[10, 11], [14, 15]]]),
    (["y", "x"], [[[0, 1], [4, 5]], [[8, 9], [12, 13]], [[2, 3], [6, 7]], [[10, 11], [14, 15]]]),
]


# -- pack / unpack -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("specs, parts", PACK_TABLE, ids=[",".join(s) for s, _ in PACK_TABLE])
def test_pack_table(mesh22, specs, parts):
    layout = Layout(specs, mesh22)
    parts = [torch.as_tensor(p) for p in parts]
    packed = pack(parts, layout)
    assert fetch_layout(packed) == layout
    assert packed.shape == (4, 4) and packed.dtype == torch.int64
    assert torch.equal(gather(packed), A)
    assert components(packed) == [p.tolist() for p in parts]
    # the inverse: distributing A gives exactly these components
    assert components(copy_to_mesh(A, layout)) == [p.tolist() for p in parts]


def test_unpacked_replicated_vector(mesh22):
    packed = pack([torch.arange(4)] * 4, Layout([U], mesh22))
    assert torch.equal(gather(packed), torch.arange(4))
    assert packed.numpy().tolist() == [0, 1, 2, 3]


def test_unpack_returns_components_on_the_mesh_device(mesh22):
    for part in unpack(copy_to_mesh(A, Layout(["x", "y"], mesh22))):
        assert isinstance(part, torch.Tensor) and not is_dtensor(part)
        assert part.device == torch.device("cpu")


@pytest.fixture(scope="module")
def mesh23():
    # the seed's [X(2), Y(3)] mesh: device i sits at (i // 3, i % 3)
    return create_mesh([("X", 2), ("Y", 3)])


def test_seed_mesh_locations(mesh23):
    assert [mesh23.device_location(i) for i in range(6)] == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]


def test_seed_vector_sharded_on_x(mesh23):
    t = copy_to_mesh(torch.arange(128), Layout(["X"], mesh23))
    expected = [list(range(0, 64))] * 3 + [list(range(64, 128))] * 3
    assert components(t) == expected
    assert all(c.shape == (64,) for c in unpack(t))
    assert torch.equal(gather(pack([torch.tensor(c) for c in expected], Layout(["X"], mesh23))), torch.arange(128))


def test_seed_two_element_vector_has_rank_one_components(mesh23):
    t = copy_to_mesh(torch.tensor([7.0, 8.0]), Layout(["X"], mesh23))
    assert [c.shape for c in unpack(t)] == [torch.Size([1])] * 6
    assert components(t) == [[7.0]] * 3 + [[8.0]] * 3


def test_seed_fully_sharded_matrix(mesh23):
    value = torch.arange(6.0).reshape(2, 3)
    t = copy_to_mesh(value, Layout(["X", "Y"], mesh23))
    assert components(t) == [[[float(i)]] for i in range(6)]
    assert torch.equal(gather(pack([[[float(i)]] for i in range(6)], Layout(["X", "Y"], mesh23))), value)


def test_seed_scalar(mesh23):
    t = pack([torch.tensor(123.0)] * 6, Layout([], mesh23))
    assert t.shape == () and t.dim() == 0
    assert components(t) == [123.0] * 6
    assert t.numpy() == 123.0
    assert components(copy_to_mesh(123.0, Layout([], mesh23))) == [123.0] * 6


def test_seed_rank3_sharded_on_x(mesh23):
    value = torch.arange(12.0).reshape(2, 2, 3)
    t = copy_to_mesh(value, Layout(["X", U, U], mesh23))
    low, high = torch.arange(6.0).reshape(1, 2, 3), torch.arange(6.0, 12.0).reshape(1, 2, 3)
    assert components(t) == [low.tolist()] * 3 + [high.tolist()] * 3
    assert torch.equal(gather(pack([low] * 3 + [high] * 3, Layout(["X", U, U], mesh23))), value)


def test_pack_and_unpack_are_inverse(mesh23):
    layout = Layout(["X", "Y"], mesh23)
    parts = [torch.full((2, 2), float(i)) for i in range(6)]
    assert all(torch.equal(a, b) for a, b in zip(unpack(pack(parts, layout)), parts))
    d = copy_to_mesh(torch.arange(24.0).reshape(4, 6), layout)
    again = pack(unpack(d), layout)
    assert fetch_layout(again) == layout and torch.equal(gather(again), gather(d))


def test_device_test_one_dimensional_mesh():
    mesh = create_mesh([("batch", 2)])
    t = pack([[1, 2], [3, 4]], Layout.batch_sharded(mesh, "batch", 1))
    assert t.shape == (4,) and components(t) == [[1, 2], [3, 4]]
    a = torch.tensor(5.0)
    assert pack([a, a], Layout([], mesh)).shape == ()
    block = torch.ones(2, 2, 3)
    assert pack([block, block], Layout(["batch", U, U], mesh)).shape == (4, 2, 3)
    assert [c.item() for c in unpack(copy_to_mesh(1.0, Layout.replicated(mesh, 0)))] == [1.0, 1.0]


def test_device_test_two_dimensional_mesh():
    mesh = create_mesh([("batch", 2), ("x", 4)])
    a, b = torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0], [4.0]])
    assert pack([torch.tensor(1.0)] * 8, Layout([], mesh)).shape == ()
    with pytest.raises(ValueError, match="Packed layout should have the same rank"):
        pack([torch.tensor(1.0)] * 8, Layout([U], mesh))
    sharded = pack([a] * 4 + [b] * 4, Layout.batch_sharded(mesh, "batch", 2))
    assert sharded.shape == (4, 1) and gather(sharded).tolist() == [[1.0], [2.0], [3.0], [4.0]]
    assert pack([a] * 8, Layout([U, U], mesh)).shape == (2, 1)
    filled = spmd.fill([4, 1], 1.0, layout=Layout.batch_sharded(mesh, "batch", 2))
    assert filled.shape == (4, 1) and components(filled) == [[[1.0], [1.0]]] * 8


def test_pack_accepts_array_likes_and_keeps_dtypes(mesh22):
    layout = Layout(["x"], mesh22)
    assert pack([[0.5], [0.5], [1.5], [1.5]], layout).dtype == torch.float32  # like torch.tensor
    assert pack([np.ones(1)] * 4, layout).dtype == torch.float64
    assert pack([np.ones(1, dtype=np.int32)] * 4, layout).dtype == torch.int32
    assert pack([torch.ones(1, dtype=torch.bfloat16)] * 4, layout).dtype == torch.bfloat16


@pytest.mark.parametrize("make, error, message", [
    (lambda m: pack([torch.zeros(2)] * 3, Layout(["x"], m)), ValueError, "expected 4 components"),
    (lambda m: pack([torch.zeros(2)] * 3, Layout(["x"], m)), ValueError, "got 3"),
    (lambda m: pack([torch.zeros(2)] * 5, Layout(["x"], m)), ValueError, "got 5"),
    (lambda m: pack([torch.zeros(2)] * 4, Layout(["x", U], m)), ValueError,
     "Packed layout should have the same rank"),
    (lambda m: pack([torch.zeros(2, 2)] * 4, Layout(["x"], m)), ValueError, "rank 2"),
    (lambda m: pack([torch.zeros(2)] * 3 + [torch.zeros(3)], Layout(["x"], m)), ValueError, "same shape"),
    (lambda m: pack([torch.zeros(2)] * 3 + [torch.zeros(2, dtype=torch.int32)], Layout(["x"], m)), ValueError,
     "same dtype"),
    (lambda m: pack([copy_to_mesh(torch.zeros(2), Layout([U], m))] * 4, Layout([U], m)), ValueError,
     "already a DTensor"),
    (lambda m: pack(copy_to_mesh(torch.zeros(4), Layout([U], m)), Layout([U], m)), ValueError, "already a DTensor"),
    (lambda m: pack([torch.zeros(2)] * 4, ["x"]), TypeError, "Layout"),
    (lambda m: unpack(torch.zeros(2)), TypeError, "Tensor"),
    (lambda m: unpack(np.zeros(2)), TypeError, "ndarray"),
    (lambda m: unpack([1, 2]), TypeError, "list"),
])
def test_pack_unpack_errors(mesh22, make, error, message):
    with pytest.raises(error, match=re.escape(message)):
        make(mesh22)


def test_pack_is_differentiable(mesh22):
    parts = [torch.full((1, 2), float(i), requires_grad=True) for i in range(4)]
    t = pack(parts, Layout(["x", "y"], mesh22))
    (t * t).sum().backward()
    for i, p in enumerate(parts):
        assert torch.equal(p.grad, torch.full((1, 2), 2.0 * i))


@pytest.mark.parametrize("specs, factor", [([U], 3.0), (["x"], 6.0), (["y"], 6.0)])
def test_pack_of_one_shared_leaf_gets_the_gradient_of_its_value(mesh22, specs, factor):
    # the DTensor's value is the first copy of each shard; a leaf packed into every copy is counted once per shard
    w = torch.ones(1, requires_grad=True)
    (pack([w] * 4, Layout(specs, mesh22)) * 3).sum().backward()
    assert w.grad.tolist() == [factor]


@pytest.mark.parametrize("index, rows", [(0, slice(0, 2)), (1, slice(0, 2)), (2, slice(2, 4)), (3, slice(2, 4))])
def test_unpack_gradient_from_any_copy(mesh22, index, rows):
    t = torch.arange(16.0).reshape(4, 4).requires_grad_()
    parts = unpack(copy_to_mesh(t, Layout(["x", U], mesh22)))
    parts[index].sum().backward()
    expected = torch.zeros(4, 4)
    expected[rows] = 1.0
    assert torch.equal(t.grad, expected)


def test_unpack_gradient_sums_the_copies(mesh22):
    t = torch.arange(16.0).reshape(4, 4).requires_grad_()
    parts = unpack(copy_to_mesh(t, Layout(["x", U], mesh22)))  # every row is held by 2 devices
    sum(p.sum() for p in parts).backward()
    assert torch.equal(t.grad, torch.full((4, 4), 2.0))


@pytest.mark.parametrize("specs", [[U, U], ["x", U], [U, "y"], ["y", "x"]])
def test_pack_of_unpack_passes_gradients_through(mesh22, specs):
    layout = Layout(specs, mesh22)
    d = copy_to_mesh(torch.arange(16.0).reshape(4, 4), layout).requires_grad_()
    (pack(unpack(d), layout) * 5).sum().backward()
    assert fetch_layout(d.grad) == layout
    assert torch.equal(gather(d.grad), torch.full((4, 4), 5.0))
    assert components(d.grad) == components(copy_to_mesh(torch.full((4, 4), 5.0), layout))  # every copy agrees


# -- numpy, repr -------------------------------------------------------------------------------------------------
def test_numpy_of_replicated(mesh22):
    t = copy_to_mesh(A, Layout.replicated(mesh22, 2))
    assert isinstance(t.numpy(), np.ndarray)
    assert np.array_equal(t.numpy(), A.numpy())
    assert np.array_equal(np.asarray(t), A.numpy())
    assert copy_to_mesh(torch.ones(2, requires_grad=True), Layout([U], mesh22)).numpy().tolist() == [1.0, 1.0]


@pytest.mark.parametrize("specs", [["x", "y"], ["x", U], [U, "y"]])
def test_numpy_of_sharded_raises_and_says_relayout(mesh22, specs):
    t = copy_to_mesh(A, Layout(specs, mesh22))
    with pytest.raises(ValueError, match="relayout"):
        t.numpy()
    with pytest.raises(ValueError, match="relayout"):
        np.asarray(t)
    assert np.array_equal(relayout(t, Layout.replicated(mesh22, 2)).numpy(), A.numpy())


def test_repr_of_sharded(mesh22):
    t = copy_to_mesh(A, Layout(["x", "y"], mesh22))
    expected = ('DTensor({"CPU:0": [[0 1] [4 5]], "CPU:1": [[2 3] [6 7]], "CPU:2": [[ 8  9] [12 13]], '
                '"CPU:3": [[10 11] [14 15]]}, layout="sharding_specs:x,y, mesh:' + mesh22.to_string()
                + '", shape=(4, 4), dtype=torch.int64)')
    assert repr(t) == expected
    assert str(t) == expected


def test_repr_of_replicated_prints_one_value(mesh22):
    t = copy_to_mesh(torch.tensor([0, 1]), Layout([U], mesh22))
    assert repr(t) == ('DTensor([0 1], layout="sharding_specs:unsharded, mesh:' + mesh22.to_string()
                       + '", shape=(2,), dtype=torch.int64)')
    scalar = copy_to_mesh(torch.tensor(2.5), Layout([], mesh22))
    assert repr(scalar).startswith('DTensor(2.5, layout="sharding_specs: mesh:|x=2,y=2|')
    assert repr(scalar).endswith('", shape=(), dtype=torch.float32)')


def test_repr_of_partially_replicated_prints_every_device(mesh22):
    t = copy_to_mesh(torch.arange(4.0), Layout(["x"], mesh22))
    assert repr(t).startswith('DTensor({"CPU:0": [0. 1.], "CPU:1": [0. 1.], "CPU:2": [2. 3.], "CPU:3": [2. 3.]}, '
                              'layout="sharding_specs:x, mesh:')


# -- fetch_layout, check_layout, is_dtensor ----------------------------------------------------------------------
@pytest.mark.parametrize("value", [-1024, 1.5, None, "text", [1, 2], {"a": 1}, np.zeros(2), object()])
def test_fetch_layout_of_a_python_value_is_none(value):
    assert fetch_layout(value) is None


def test_fetch_layout_of_a_plain_tensor_raises():
    with pytest.raises(TypeError, match="copy_to_mesh"):
        fetch_layout(torch.zeros(2))


def test_fetch_layout(mesh22):
    layout = Layout(["y", U], mesh22)
    assert fetch_layout(copy_to_mesh(A, layout)) == layout
    assert fetch_layout(DVariable(torch.zeros(4, 4), layout=layout)) == layout


def test_check_layout(mesh22):
    layout = Layout(["x", "y"], mesh22)
    t = copy_to_mesh(A, layout)
    check_layout(t, layout)  # no error
    other = Layout.replicated(mesh22, 2)
    with pytest.raises(ValueError) as info:
        check_layout(t, other)
    assert str(info.value) == f"Layout of tensor: {layout!r}, did not match expected layout: {other!r}"
    assert str(info.value).startswith("Layout of tensor: Layout.from_string(sharding_specs:x,y, mesh:|x=2,y=2|")


@pytest.mark.parametrize("value, expected", [
    (np.zeros(2), False), ([1, 2], False), ({"a": 1}, False), (3, False), (object(), False),
    (torch.zeros(2), False), (torch.nn.Parameter(torch.zeros(2)), False),
])
def test_is_dtensor_of_other_values(value, expected):
    assert is_dtensor(value) is expected


def test_is_dtensor(mesh22):
    assert is_dtensor(copy_to_mesh(A, Layout(["x", U], mesh22)))
    assert is_dtensor(DVariable(torch.zeros(4, 4), layout=Layout(["x", U], mesh22)))


# -- copy_to_mesh ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, dtype, shape", [
    ([0, 1], torch.int64, (2,)),
    ([[1.0, 2.0], [3.0, 4.0]], torch.float32, (2, 2)),
    (np.arange(4.0), torch.float64, (4,)),
    (np.arange(4, dtype=np.int32).reshape(2, 2), torch.int32, (2, 2)),
    (3, torch.int64, ()),
    (1.0, torch.float32, ()),
    (True, torch.bool, ()),
    (torch.arange(4, dtype=torch.int16), torch.int16, (4,)),
])
def test_copy_to_mesh_values(mesh22, value, dtype, shape):
    layout = Layout.replicated(mesh22, len(shape))
    t = copy_to_mesh(value, layout)
    assert fetch_layout(t) == layout
    assert t.dtype == dtype and t.shape == shape
    assert np.array_equal(t.numpy(), np.asarray(value))
    if len(shape) == 1 and shape[0] % 2 == 0:
        s = copy_to_mesh(value, Layout(["x"], mesh22))
        assert np.array_equal(gather(s).numpy(), np.asarray(value))


def test_copy_to_mesh_ignores_source_layout(mesh22):
    layout = Layout(["x", U], mesh22)
    t = copy_to_mesh(A, layout, source_layout=Layout.replicated(mesh22, 2))
    assert fetch_layout(t) == layout and torch.equal(gather(t), A)


def test_copy_to_mesh_of_a_dtensor_to_another_mesh(mesh22):
    other = create_mesh([("z", 4)])
    t = copy_to_mesh(copy_to_mesh(A, Layout.replicated(mesh22, 2)), Layout(["z", U], other))
    assert fetch_layout(t) == Layout(["z", U], other)
    assert components(t) == [[r] for r in A.tolist()]


def test_copy_to_mesh_errors(mesh22):
    with pytest.raises(ValueError, match=r"shape \[3\].*2 shards"):
        copy_to_mesh(torch.zeros(3), Layout(["x"], mesh22))
    with pytest.raises(ValueError, match="rank"):
        copy_to_mesh(torch.zeros(4, 2), Layout(["x"], mesh22))
    with pytest.raises(TypeError):
        copy_to_mesh(torch.zeros(4), ["x"])


def test_strides_follow_the_components_memory_order(mesh22):
    """A transposed DTensor has transposed strides, so `.contiguous()` and autograd's layout contract for
    `.grad` see the components as they are."""
    value = torch.randn(4, 6)
    w = spmd.copy_to_mesh(value, Layout(["x", UNSHARDED], mesh22)).requires_grad_()
    t = w.t()
    assert t.stride() == (1, 6) and not t.is_contiguous()
    c = t.contiguous()
    assert c.is_contiguous() and c._stack.is_contiguous()
    torch.testing.assert_close(spmd.to_global(c), value.t())
    (spmd.copy_to_mesh(torch.randn(3, 6), Layout([UNSHARDED, UNSHARDED], mesh22)) @ t).sum().backward()
    assert w.grad.is_contiguous() and w.grad._stack.is_contiguous()  # a weight gradient computed transposed


def test_compiled_function_retraces_for_components_in_another_memory_order(mesh22):
    f = spmd.function(lambda x: x * 2)
    value = torch.randn(6, 4)
    transposed = spmd.copy_to_mesh(value.t().contiguous(), Layout([UNSHARDED, "y"], mesh22)).t()
    straight = spmd.copy_to_mesh(value, Layout(["y", UNSHARDED], mesh22))
    for x in (transposed, straight):
        torch.testing.assert_close(spmd.to_global(f(x)), value * 2)
    assert f.experimental_get_tracing_count() == 2


@pytest.mark.parametrize("convert", [lambda t: t.to(memory_format=torch.channels_last),
                                     lambda t: t.contiguous(memory_format=torch.channels_last),
                                     lambda t: t.to(torch.float64, memory_format=torch.channels_last),
                                     lambda t: torch.zeros_like(t, memory_format=torch.channels_last)],
                         ids=["to", "contiguous", "to_dtype", "zeros_like"])
def test_channels_last_lays_out_every_component(mesh22, convert):
    """A channels-last request names the global rank: each component is channels last, and the DTensor reports
    plain torch's strides."""
    x = torch.randn(2, 4, 3, 2)
    d = convert(spmd.copy_to_mesh(x, Layout(["x", "y", UNSHARDED, UNSHARDED], mesh22)))
    want = convert(x)
    assert d.stride() == want.stride() and d.is_contiguous(memory_format=torch.channels_last)
    assert all(c.is_contiguous(memory_format=torch.channels_last) for c in spmd.unpack(d))
    torch.testing.assert_close(spmd.to_global(d), want)
