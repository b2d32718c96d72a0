"""Creating DTensors: call_with_layout, the `layout=` factories, default_mesh and layout-invariant random
numbers (reference §1.5, §3.2)."""

import contextlib
import re

import pytest
import torch
from torch.overrides import TorchFunctionMode

import spmd
from spmd import (
    UNSHARDED,
    DTensor,
    Layout,
    call_with_layout,
    copy_to_mesh,
    create_mesh,
    default_mesh,
    fetch_layout,
    get_default_mesh,
    is_dtensor,
    relayout,
    unpack,
)
from spmd import random as srandom
from tests.sweep import components, gather  # noqa: E402

U = UNSHARDED


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("low, high", [(0.0, 1.0), (-1.0, 1.0), (2.0, 3.0)])
def test_stateless_uniform_stays_below_maxval_in_every_float_dtype(dtype, low, high):
    """The range is half-open, as TF's: in a narrow dtype a value drawn with more bits than it holds, or scaled to
    the range, would round up to maxval."""
    values = srandom.stateless_uniform((200_000,), seed=(1, 2), minval=low, maxval=high, dtype=dtype)
    assert values.dtype == dtype and values.min() >= low and values.max() < high


def test_stateless_normal_refuses_an_integer_dtype_and_seeds_are_of_shape_two():
    for fn in (srandom.stateless_normal, srandom.stateless_truncated_normal):
        with pytest.raises(TypeError, match="dtype must be a floating type"):
            fn((4,), seed=(1, 2), dtype=torch.int32)
    with pytest.raises(TypeError, match="seed must be an int or a pair"):
        srandom.stateless_normal((4,), seed=[1, 2, 3])


def test_constants_made_in_a_default_mesh_scope_are_replicated_dtensors():
    """As TF's `constant` inside a default mesh: `torch.tensor`, `as_tensor`, `eye`, `linspace` are replicated
    DTensors there (and combine with DTensors), plain outside."""
    mesh = spmd.create_mesh([("x", 2), ("y", 2)])
    with spmd.default_mesh(mesh):
        made = [torch.tensor([3, 4]), torch.as_tensor([[1.0, 2.0]]), torch.eye(2), torch.linspace(0, 1, 4)]
        row = spmd.copy_to_mesh(torch.ones(4, 4), Layout(["x", UNSHARDED], mesh)) + torch.tensor([1.0, 2, 3, 4])
    assert all(spmd.fetch_layout(t) == Layout.replicated(mesh, t.dim()) for t in made)
    assert torch.equal(spmd.to_global(made[2]), torch.eye(2))
    assert gather(row)[0].tolist() == [2.0, 3.0, 4.0, 5.0]
    assert not spmd.is_dtensor(torch.tensor([3, 4]))


def test_zeros_and_ones_take_tfs_positional_dtype():
    mesh = spmd.create_mesh([("x", 2)])
    t = spmd.zeros((4, 4), torch.int32, layout=Layout(["x", UNSHARDED], mesh))
    assert t.dtype == torch.int32 and t.shape == (4, 4) and spmd.ones([2, 3], torch.float64).dtype == torch.float64
