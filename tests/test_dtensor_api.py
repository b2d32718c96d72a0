"""The DTensor core API against TF DTensor: pack/unpack, numpy, repr, fetch/check_layout, copy_to_mesh,
call_with_layout and the `layout=` factories, default_mesh, layout-invariant random numbers, DVariable with
nn.Module and torch.optim, gradient layouts (reference §1.5, §1.8, §2.1, §2.2, §3.2, §3.5; seed 002)."""

import contextlib
import copy
import re

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

import spmd
from spmd import (UNSHARDED, DTensor, DVariable, Layout, call_with_layout, check_layout, copy_to_mesh,
                  create_mesh, default_mesh, fetch_layout, get_default_mesh, is_dtensor, pack, relayout, unpack)
from spmd import random as srandom

U = UNSHARDED


def gather(t: DTensor) -> torch.Tensor:
    """The global value of a DTensor (through spmd's own relayout to replicated)."""
    return spmd.to_global(t).detach()


def components(t: DTensor) -> list:
    return [c.tolist() for c in unpack(t)]


@pytest.fixture(scope="module")
def mesh22():
    return create_mesh([("x", 2), ("y", 2)])


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


# -- call_with_layout and the layout= factories ------------------------------------------------------------------
@pytest.fixture(scope="module")
def mesh32():
    return create_mesh([("x", 3), ("y", 2)])


@pytest.mark.parametrize("fn, args, kwargs, value", [
    (torch.ones, (), dict(shape=(6, 4)), torch.ones(6, 4)),
    (torch.zeros, (), dict(shape=(6, 4)), torch.zeros(6, 4)),
    (torch.ones, (6, 4), {}, torch.ones(6, 4)),
    (torch.ones, ((6, 4),), {}, torch.ones(6, 4)),
    (torch.zeros, ([6, 4],), dict(dtype=torch.int32), torch.zeros(6, 4, dtype=torch.int32)),
    (torch.ones, (), dict(size=(6, 4), dtype=torch.float64), torch.ones(6, 4, dtype=torch.float64)),
    (torch.full, ((6, 4), 2.5), {}, torch.full((6, 4), 2.5)),
    (torch.full, (), dict(size=(6, 4), fill_value=7), torch.full((6, 4), 7)),
    (torch.empty, (), dict(shape=(6, 4)), None),
    (torch.rand, (), dict(shape=(6, 4)), None),
    (torch.randn, (6, 4), {}, None),
])
def test_call_with_layout_torch_factories(mesh32, fn, args, kwargs, value):
    layout = Layout(["x", "y"], mesh32)
    t = call_with_layout(fn, layout, *args, **kwargs)
    assert isinstance(t, DTensor) and fetch_layout(t) == layout
    assert t.shape == (6, 4)
    assert all(c.shape == (2, 2) for c in unpack(t))
    if value is not None:
        assert t.dtype == value.dtype and torch.equal(gather(t), value)


def test_call_with_layout_tutorial_ones(mesh32):
    ones = call_with_layout(torch.ones, Layout(["x", "y"], mesh32), shape=(6, 4))
    assert components(ones) == [[[1.0, 1.0], [1.0, 1.0]]] * 6
    assert repr(ones).startswith('DTensor({"CPU:0": [[1. 1.] [1. 1.]], "CPU:1": [[1. 1.] [1. 1.]], ')
    assert repr(ones).endswith(f'layout="sharding_specs:x,y, mesh:{mesh32.to_string()}", shape=(6, 4), '
                               'dtype=torch.float32)')


@pytest.mark.parametrize("args, expected", [
    ((6,), torch.arange(6)),
    ((0, 12, 2), torch.arange(0, 12, 2)),
    ((6.0,), torch.arange(6.0)),
    ((1, 4, 0.5), torch.arange(1, 4, 0.5)),
])
def test_call_with_layout_arange(mesh32, args, expected):
    layout = Layout(["x"], mesh32)
    t = call_with_layout(torch.arange, layout, *args)
    assert fetch_layout(t) == layout and t.dtype == expected.dtype
    assert torch.equal(gather(t), expected)
    n = expected.numel() // 3
    assert components(t) == [expected[i * n:(i + 1) * n].tolist() for i in (0, 0, 1, 1, 2, 2)]


@pytest.mark.parametrize("specs", [["x", "y"], ["y", "x"], [U, "x"], [U, U]])
def test_call_with_layout_rand_is_layout_invariant(mesh32, specs):
    torch.manual_seed(1234)
    reference = gather(call_with_layout(torch.rand, Layout(["x", "y"], mesh32), shape=(6, 6)))
    torch.manual_seed(1234)
    t = call_with_layout(torch.rand, Layout(specs, mesh32), shape=(6, 6))
    assert fetch_layout(t) == Layout(specs, mesh32)
    assert torch.equal(gather(t), reference)
    assert reference.min() >= 0 and reference.max() < 1


@pytest.mark.parametrize("fn", [srandom.stateless_uniform, srandom.stateless_normal,
                                srandom.stateless_truncated_normal])
def test_call_with_layout_spmd_random(mesh32, fn):
    layout = Layout(["x", "y"], mesh32)
    t = call_with_layout(fn, layout, shape=(6, 4), seed=(1, 1))
    assert fetch_layout(t) == layout and t.shape == (6, 4)
    assert torch.equal(gather(t), fn((6, 4), seed=(1, 1)))


def test_call_with_layout_of_a_composite_function(mesh32):
    layout = Layout(["x", "y"], mesh32)
    t = call_with_layout(lambda: torch.ones(6, 4) * 2 + torch.zeros(6, 4), layout)
    assert fetch_layout(t) == layout
    assert torch.equal(gather(t), torch.full((6, 4), 2.0))


def test_call_with_layout_none_calls_plainly():
    t = call_with_layout(torch.ones, None, 2, 3)
    assert not is_dtensor(t) and torch.equal(t, torch.ones(2, 3))


def test_call_with_layout_errors(mesh32):
    with pytest.raises(ValueError, match="divide"):
        call_with_layout(torch.ones, Layout(["x", "y"], mesh32), shape=(5, 4))
    with pytest.raises(ValueError, match="rank"):
        call_with_layout(torch.ones, Layout(["x", "y"], mesh32), shape=(6,))
    with pytest.raises(TypeError):
        call_with_layout(torch.ones, "x,y", shape=(6, 4))


class RecordFactories(TorchFunctionMode):
    """Records the size of every torch factory call (the functions a layout= factory may use)."""

    FACTORIES = (torch.zeros, torch.ones, torch.full, torch.empty, torch.zeros_like, torch.ones_like,
                 torch.full_like, torch.empty_like, torch.tensor)

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self.FACTORIES and isinstance(out, torch.Tensor):
            self.sizes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("make, dtype, value", [
    (lambda L, src: spmd.zeros((12, 8), layout=L), torch.float32, 0.0),
    (lambda L, src: spmd.zeros(12, 8, layout=L), torch.float32, 0.0),
    (lambda L, src: spmd.ones((12, 8), layout=L, dtype=torch.int64), torch.int64, 1),
    (lambda L, src: spmd.fill((12, 8), 7.0, layout=L), torch.float32, 7.0),
    (lambda L, src: spmd.full((12, 8), 3, layout=L), torch.int64, 3),
    (lambda L, src: spmd.zeros_like(src["sharded"]), torch.float32, 0.0),
    (lambda L, src: spmd.ones_like(src["replicated"], layout=L), torch.float32, 1.0),
    (lambda L, src: spmd.ones_like(src["plain"], layout=L), torch.float32, 1.0),
], ids=["zeros", "zeros-varargs", "ones", "fill", "full", "zeros_like", "ones_like-relayout", "ones_like-plain"])
def test_layout_factories_create_only_local_shards(mesh32, make, dtype, value):
    layout = Layout(["x", "y"], mesh32)
    src = {"sharded": spmd.ones((12, 8), layout=layout), "plain": torch.zeros(12, 8),
           "replicated": spmd.zeros((12, 8), layout=Layout.replicated(mesh32, 2))}
    with RecordFactories() as recorder:
        t = make(layout, src)
    assert fetch_layout(t) == layout and t.shape == (12, 8) and t.dtype == dtype
    assert all(c.shape == (4, 4) for c in unpack(t))
    assert torch.equal(gather(t), torch.full((12, 8), value, dtype=dtype))
    # each device creates its (4, 4) shard; no tensor of the global shape (12, 8) is ever built
    assert recorder.sizes
    assert all(size[-2:] == (4, 4) for size in recorder.sizes), recorder.sizes


def test_zeros_like_keeps_the_layout(mesh32):
    layout = Layout([U, "y"], mesh32)
    t = spmd.zeros_like(copy_to_mesh(torch.arange(12.0).reshape(3, 4), layout))
    assert fetch_layout(t) == layout and torch.equal(gather(t), torch.zeros(3, 4))


def test_factories_without_layout_are_plain_tensors():
    assert not is_dtensor(spmd.zeros(2, 3)) and spmd.zeros(2, 3).shape == (2, 3)
    assert not is_dtensor(spmd.fill((2,), 1.0))


def test_zeros_and_zeros_like_agree(mesh22):
    rep = Layout.replicated(mesh22, 1)
    assert torch.equal(gather(spmd.zeros([10], layout=rep)), gather(spmd.zeros_like(torch.ones(10), layout=rep)))
    assert torch.equal(gather(spmd.ones([10], layout=rep)), gather(spmd.ones_like(torch.ones(10), layout=rep)))


# -- default_mesh ------------------------------------------------------------------------------------------------
def test_get_default_mesh_is_none_outside():
    assert get_default_mesh() is None


def test_default_mesh_context_manager(mesh22):
    with default_mesh(mesh22) as entered:
        assert entered == mesh22 and get_default_mesh() == mesh22
        r = torch.zeros(()) + 3.0
        assert is_dtensor(r) and r.numpy() == 3.0
        assert fetch_layout(r).mesh == mesh22 and fetch_layout(r).is_fully_replicated()
        z = spmd.zeros(2, 4)
        assert fetch_layout(z) == Layout.replicated(mesh22, 2)
    assert get_default_mesh() is None
    assert not is_dtensor(torch.zeros(()))


def test_default_mesh_decorator(mesh22):
    @default_mesh(mesh22)
    def func():
        return get_default_mesh(), torch.zeros(()) + 3.0

    for _ in range(2):  # reusable
        mesh, r = func()
        assert mesh == mesh22 and r.numpy() == 3.0 and fetch_layout(r).mesh == mesh22
        assert get_default_mesh() is None


def test_default_mesh_nesting(mesh22):
    other = create_mesh([("y", 4)], mesh_name="other")
    seen = [get_default_mesh()]
    with default_mesh(mesh22):
        seen.append(get_default_mesh())
        with default_mesh(other):
            seen.append(get_default_mesh())
            assert fetch_layout(torch.ones(2)).mesh == other
        seen.append(get_default_mesh())
        assert fetch_layout(torch.ones(2)).mesh == mesh22
    seen.append(get_default_mesh())
    assert seen == [None, mesh22, other, mesh22, None]


def test_default_mesh_is_restored_after_an_exception(mesh22):
    with pytest.raises(ValueError):
        with default_mesh(mesh22):
            relayout(copy_to_mesh(torch.zeros(3), Layout([U], mesh22)), Layout(["x"], mesh22))
    assert get_default_mesh() is None
    with default_mesh(mesh22):
        with contextlib.suppress(RuntimeError):
            with default_mesh(create_mesh([("z", 2)])):
                raise RuntimeError("boom")
        assert get_default_mesh() == mesh22
    assert get_default_mesh() is None
    assert not is_dtensor(torch.zeros(2))


@pytest.mark.parametrize("value, name", [("mesh", "str"), (None, "NoneType"), (3, "int")])
def test_default_mesh_of_a_non_mesh(value, name):
    with pytest.raises(ValueError, match=re.escape(f"Expect `mesh` to be `Mesh`, got <class '{name}'>")):
        default_mesh(value)


# -- layout-invariant random numbers -----------------------------------------------------------------------------
RANDOM_FNS = [srandom.stateless_uniform, srandom.stateless_normal, srandom.stateless_truncated_normal]
RANDOM_LAYOUTS = [
    ([("x", 2), ("y", 2)], ["x", "y"]), ([("x", 2), ("y", 2)], ["y", "x"]), ([("x", 2), ("y", 2)], [U, "x"]),
    ([("x", 2), ("y", 2)], ["x", U]), ([("x", 2), ("y", 2)], [U, U]), ([("a", 8)], ["a", U]),
    ([("a", 8)], [U, "a"]), ([("x", 2), ("y", 4)], ["y", "x"]), ([("x", 1)], ["x", U]),
]


@pytest.mark.parametrize("fn", RANDOM_FNS)
@pytest.mark.parametrize("dims, specs", RANDOM_LAYOUTS)
def test_random_is_the_same_for_every_layout(fn, dims, specs):
    plain = fn((8, 8), seed=(1, 2))
    assert not is_dtensor(plain) and plain.shape == (8, 8) and plain.dtype == torch.float32
    layout = Layout(specs, create_mesh(dims))
    t = fn((8, 8), seed=(1, 2), layout=layout)
    assert fetch_layout(t) == layout
    assert torch.equal(gather(t), plain)


@pytest.mark.parametrize("fn", RANDOM_FNS)
def test_random_depends_on_the_seed(fn):
    a = fn((64,), seed=(1, 2))
    assert torch.equal(a, fn((64,), seed=(1, 2)))
    assert torch.equal(a, fn((64,), seed=[1, 2]))
    assert torch.equal(a, fn((64,), seed=torch.tensor([1, 2])))
    assert not torch.equal(a, fn((64,), seed=(1, 3)))
    assert not torch.equal(a, fn((64,), seed=(2, 2)))
    assert not torch.equal(fn((64,), seed=7), fn((64,), seed=8))
    assert len(torch.unique(a)) > 60


def test_random_distributions():
    n = 200_000
    u = srandom.stateless_uniform((n,), seed=3, minval=-1.0, maxval=3.0)
    assert u.min() >= -1 and u.max() < 3
    assert abs(u.mean().item() - 1.0) < 0.02 and abs(u.std().item() - 4 / 12 ** 0.5) < 0.02
    g = srandom.stateless_normal((n,), seed=3, mean=1.0, stddev=2.0)
    assert abs(g.mean().item() - 1.0) < 0.03 and abs(g.std().item() - 2.0) < 0.03
    t = srandom.stateless_truncated_normal((n,), seed=3, mean=1.0, stddev=2.0)
    assert (t - 1.0).abs().max() <= 4.0  # within 2 standard deviations
    assert abs(t.mean().item() - 1.0) < 0.03
    assert abs(t.std().item() - 2.0 * 0.8796) < 0.03  # the std of a normal truncated at +-2 sigma
    ints = srandom.stateless_uniform((1000,), seed=3, minval=-1, maxval=3, dtype=torch.int32)
    assert ints.dtype == torch.int32 and set(ints.tolist()) == {-1, 0, 1, 2}


def test_random_dtype_and_zero_stddev(mesh22):
    rep = Layout.replicated(mesh22, 1)
    t = srandom.stateless_normal([10], seed=(1, 2), mean=0.0, stddev=0.0, layout=rep)
    assert t.shape == (10,) and fetch_layout(t) == rep and torch.equal(gather(t), torch.zeros(10))
    assert srandom.stateless_normal((4,), seed=1, dtype=torch.float64).dtype == torch.float64
    with pytest.raises(ValueError, match="maxval"):
        srandom.stateless_uniform((4,), seed=1, dtype=torch.int64)


def test_random_shards_are_generated_per_device(mesh22):
    """Each device's component is the matching slice of the global value (not a replica of one draw)."""
    layout = Layout(["x", "y"], mesh22)
    t = srandom.stateless_normal((4, 4), seed=5, layout=layout)
    plain = srandom.stateless_normal((4, 4), seed=5)
    expected = [plain[:2, :2], plain[:2, 2:], plain[2:, :2], plain[2:, 2:]]
    assert all(torch.equal(c, e) for c, e in zip(unpack(t), expected))


# -- DVariable ---------------------------------------------------------------------------------------------------
@pytest.fixture
def xy(mesh22):
    return Layout(["x", "y"], mesh22)


def test_dvariable_from_a_dtensor(xy):
    d = copy_to_mesh(torch.arange(16.0).reshape(4, 4), xy)
    v = DVariable(d)
    assert fetch_layout(v) == xy and torch.equal(gather(v), gather(d))
    assert is_dtensor(v) and isinstance(v, DTensor)
    assert isinstance(v, torch.nn.Parameter)
    assert v.requires_grad and v.is_leaf
    assert DVariable(d, layout=xy).shape == (4, 4)  # an equal layout is fine
    assert not DVariable(d, requires_grad=False).requires_grad


def test_dvariable_from_a_plain_value_with_layout(xy):
    for value in (torch.ones(4, 4), np.ones((4, 4), dtype=np.float32), lambda: torch.ones(4, 4)):
        v = DVariable(value, layout=xy)
        assert fetch_layout(v) == xy and torch.equal(gather(v), torch.ones(4, 4))
    assert DVariable(torch.ones(4, 4), layout=xy, dtype=torch.float64).dtype == torch.float64


def test_dvariable_errors(xy, mesh22):
    d = copy_to_mesh(torch.ones(4, 4), xy)
    with pytest.raises(ValueError, match="Conflicting layout"):
        DVariable(d, layout=Layout.replicated(mesh22, 2))
    with pytest.raises(ValueError, match="Neither layout nor DTensor initial value are provided"):
        DVariable(torch.ones(4, 4))


def test_dvariable_assign(xy, mesh22):
    v = DVariable(torch.zeros(4, 4), layout=xy)
    local = v._local
    assert v.assign(spmd.ones((4, 4), layout=xy)) is v
    assert torch.equal(gather(v), torch.ones(4, 4))
    v.assign_add(spmd.fill((4, 4), 2.0, layout=xy))
    assert torch.equal(gather(v), torch.full((4, 4), 3.0))
    v.assign_sub(spmd.ones((4, 4), layout=xy))
    assert torch.equal(gather(v), torch.full((4, 4), 2.0))
    v.assign(5.0)  # a Python scalar is broadcast
    assert torch.equal(gather(v), torch.full((4, 4), 5.0))
    v.assign_add(torch.tensor(1.0))  # so is a 0-d tensor
    assert torch.equal(gather(v), torch.full((4, 4), 6.0))
    assert fetch_layout(v) == xy and v._local is local  # in place, same layout
    r = v.read_value()
    assert not isinstance(r, DVariable) and fetch_layout(r) == xy and torch.equal(gather(r), gather(v))
    v.assign(0.0)
    assert torch.equal(gather(r), torch.full((4, 4), 6.0))  # read_value is a copy


def test_dvariable_assign_errors(xy, mesh22):
    v = DVariable(torch.zeros(4, 4), layout=xy)
    with pytest.raises(ValueError, match=r"layout \['unsharded', 'unsharded'\]"):
        v.assign(copy_to_mesh(torch.ones(4, 4), Layout.replicated(mesh22, 2)))
    other_mesh = create_mesh([("x", 2), ("y", 2)], mesh_name="other")
    with pytest.raises(ValueError, match="mesh"):
        v.assign(copy_to_mesh(torch.ones(4, 4), Layout(["x", "y"], other_mesh)))
    with pytest.raises(ValueError, match="mesh"):
        v.assign_add(copy_to_mesh(torch.ones(4, 4), Layout(["x", "y"], other_mesh)))
    with pytest.raises(ValueError, match=r"shape \[4, 8\]"):
        v.assign(copy_to_mesh(torch.ones(4, 8), xy))
    for plain in (torch.ones(4, 4), np.ones((4, 4)), [[1.0] * 4] * 4):
        with pytest.raises(TypeError, match="copy_to_mesh"):
            v.assign(plain)
    with pytest.raises(TypeError):
        v.assign_sub(torch.ones(4, 4))
    assert torch.equal(gather(v), torch.zeros(4, 4)) and fetch_layout(v) == xy


def test_dvariable_in_nn_module(xy):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = DVariable(torch.ones(4, 4), layout=xy)

    model = Model()
    params = dict(model.named_parameters())
    assert list(params) == ["w"] and params["w"] is model.w
    assert isinstance(model.w, DVariable)
    assert "w" in model.state_dict()
    clone = copy.deepcopy(model)
    assert isinstance(clone.w, DVariable) and fetch_layout(clone.w) == xy and clone.w is not model.w
    assert torch.equal(gather(clone.w), gather(model.w))


def test_dvariable_gradient_has_its_layout(xy, mesh22):
    w = DVariable(torch.ones(4, 4), layout=xy)
    x = copy_to_mesh(torch.arange(16.0).reshape(4, 4), Layout(["x", U], mesh22))
    (x @ w).sum().backward()
    assert fetch_layout(w.grad) == xy
    expected = torch.arange(16.0).reshape(4, 4).T @ torch.ones(4, 4)
    assert torch.allclose(gather(w.grad), expected)


OPTIMIZERS = [
    ("SGD", lambda p, fe: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=fe)),
    ("Adam", lambda p, fe: torch.optim.Adam(p, lr=0.05, foreach=fe)),
    ("AdamW", lambda p, fe: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1, foreach=fe)),
]


@pytest.mark.parametrize("foreach", [False, None], ids=["foreach=False", "default"])
@pytest.mark.parametrize("name, make", OPTIMIZERS, ids=[n for n, _ in OPTIMIZERS])
def test_optimizers_match_plain_torch(mesh22, name, make, foreach):
    gen = torch.Generator().manual_seed(0)
    W0, B0 = torch.randn(4, 4, generator=gen), torch.randn(4, generator=gen)
    X, Y = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)
    w_layout, b_layout = Layout([U, "y"], mesh22), Layout(["y"], mesh22)
    w, b = DVariable(W0.clone(), layout=w_layout), DVariable(B0.clone(), layout=b_layout)
    pw, pb = torch.nn.Parameter(W0.clone()), torch.nn.Parameter(B0.clone())
    opt, popt = make([w, b], foreach), make([pw, pb], foreach)
    x, y = copy_to_mesh(X, Layout(["x", U], mesh22)), copy_to_mesh(Y, Layout(["x", U], mesh22))
    storage = (w._local, b._local)
    for _ in range(4):
        opt.zero_grad()
        loss = ((x @ w + b - y) ** 2).mean()
        loss.backward()
        opt.step()
        popt.zero_grad()
        ploss = ((X @ pw + pb - Y) ** 2).mean()
        ploss.backward()
        popt.step()
        assert torch.allclose(gather(loss), ploss.detach(), atol=1e-5)
    assert isinstance(w, DVariable) and fetch_layout(w) == w_layout and fetch_layout(b) == b_layout
    assert w._local is storage[0] and b._local is storage[1]  # updated in place
    assert torch.allclose(gather(w), pw.detach(), atol=1e-5)
    assert torch.allclose(gather(b), pb.detach(), atol=1e-5)
    for state in opt.state.values():  # optimizer state is distributed like the parameter
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert is_dtensor(value)


# -- gradients of DTensor leaves ---------------------------------------------------------------------------------
LEAF_LOSSES = [  # (name, loss of a DTensor on mesh m, the same loss in plain torch)
    ("square", lambda t, m: (t * t).sum(), lambda t: (t * t).sum()),
    ("relayout", lambda t, m: relayout(t, Layout.replicated(m, 2)).sum(), lambda t: t.sum()),
    ("matmul", lambda t, m: (t @ copy_to_mesh(torch.ones(4, 4), Layout(["x", U], m))).sum(),
     lambda t: (t @ torch.ones(4, 4)).sum()),
    ("reduce", lambda t, m: (t.sum(0) ** 2).sum(), lambda t: (t.sum(0) ** 2).sum()),
    ("relayout-mean", lambda t, m: (relayout(t, Layout(["y", "x"], m)) * 2).mean(), lambda t: (t * 2).mean()),
]


@pytest.mark.parametrize("specs", [["x", "y"], ["y", "x"], ["x", U], [U, U]])
@pytest.mark.parametrize("name, loss, plain_loss", LEAF_LOSSES, ids=[n for n, _, _ in LEAF_LOSSES])
def test_leaf_gradient_has_the_leaf_layout(mesh22, specs, name, loss, plain_loss):
    layout = Layout(specs, mesh22)
    value = torch.arange(16.0).reshape(4, 4)
    leaf = copy_to_mesh(value, layout).requires_grad_()
    assert leaf.is_leaf and leaf.requires_grad
    loss(leaf, mesh22).backward()
    assert is_dtensor(leaf.grad) and fetch_layout(leaf.grad) == layout
    reference = value.clone().requires_grad_()
    plain_loss(reference).backward()
    assert torch.allclose(gather(leaf.grad), reference.grad)
