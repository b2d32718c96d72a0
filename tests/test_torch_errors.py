"""Bad arguments raise what plain torch raises, naming the global shapes and dims, never a silent answer.

Rules work on stacked components `(L, *local)`, where a dim one past the global rank is still in range; each new
call signature is therefore checked on meta tensors of the global shapes first (spmd/engine/validate.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd import UNSHARDED as U, Layout

# (name, op on a 4x4 tensor): each is invalid for a 2-D tensor
BAD_DIMS = {
    "sum(2)": lambda t: t.sum(2), "sum(-3)": lambda t: t.sum(-3), "mean(2)": lambda t: t.mean(2),
    "amax(2)": lambda t: t.amax(2), "argmax(2)": lambda t: t.argmax(2), "softmax(2)": lambda t: t.softmax(2),
    "log_softmax(-3)": lambda t: t.log_softmax(-3), "cumsum(2)": lambda t: t.cumsum(2),
    "cat(dim=2)": lambda t: torch.cat([t, t], dim=2), "stack(dim=3)": lambda t: torch.stack([t, t], 3),
    "unsqueeze(3)": lambda t: t.unsqueeze(3), "transpose(0, 2)": lambda t: t.transpose(0, 2),
    "select(2, 0)": lambda t: t.select(2, 0), "flip(2)": lambda t: t.flip(2), "sort(2)": lambda t: t.sort(2),
    "narrow(2, 0, 1)": lambda t: t.narrow(2, 0, 1), "var(2)": lambda t: t.var(2), "topk(1, 2)": lambda t: t.topk(1, 2),
    "movedim(2, 0)": lambda t: t.movedim(2, 0), "glu(dim=2)": lambda t: F.glu(t, 2),
    # torch 2.11's meta kernels of these raise an AssertionError for a bad dim
    "argmin(2)": lambda t: t.argmin(2), "cummax(2)": lambda t: t.cummax(2),
    "kthvalue(1, 2)": lambda t: t.kthvalue(1, 2), "logcumsumexp(2)": lambda t: t.logcumsumexp(2),
}

# (op, shape of a, shape of b, what the error must say): torch's meta kernels word some errors differently from
# its CPU kernels, but both name the global shapes
BAD_SHAPES = {
    "mm (6x10) @ (12x4)": (lambda a, b: a @ b, (6, 10), (12, 4), "[6, 10] X [12, 4]"),
    "view(5, 3) of 16 elements": (lambda a, b: a.view(5, 3), (4, 4), (1,),
                                  "shape '[5, 3]' is invalid for input of size 16"),
    "expand(3, 4) of (4, 4)": (lambda a, b: a.expand(3, 4), (4, 4), (1,),
                               "Target sizes: [3, 4].  Tensor sizes: [4, 4]"),
    "add (4x4) + (3x4)": (lambda a, b: a + b, (4, 4), (3, 4), "torch.Size([3, 4])"),
}


def _torch_error(fn, *args):
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.type, str(info.value)


@pytest.mark.parametrize("layout", [[U, U], ["x", U], [U, "y"]], ids=str)
@pytest.mark.parametrize("name", list(BAD_DIMS))
def test_dim_out_of_range_is_torchs_index_error(mesh22, name, layout):
    value = torch.randn(4, 4)
    kind, message = _torch_error(BAD_DIMS[name], value)
    assert kind is IndexError
    t = spmd.copy_to_mesh(value, Layout(layout, mesh22))
    with pytest.raises(IndexError) as info:
        BAD_DIMS[name](t)
    assert str(info.value) == message


@pytest.mark.parametrize("name", list(BAD_SHAPES))
def test_shape_errors_name_the_global_shapes(mesh22, name):
    fn, sa, sb, says = BAD_SHAPES[name]
    a, b = torch.randn(*sa), torch.randn(*sb)
    kind, _ = _torch_error(fn, a, b)
    da = spmd.copy_to_mesh(a, Layout(["x"] + [U] * (a.dim() - 1), mesh22))
    db = spmd.copy_to_mesh(b, Layout.replicated(mesh22, b.dim()))
    with pytest.raises(kind) as info:
        fn(da, db)
    assert says in str(info.value)


def test_valid_dims_still_work(mesh22):
    value = torch.randn(4, 4)
    t = spmd.copy_to_mesh(value, Layout(["x", U], mesh22))
    for op in (lambda t: t.sum(-2), lambda t: t.softmax(-1), lambda t: t.unsqueeze(2), lambda t: t.sort(1).values,
               lambda t: torch.cat([t, t], dim=-1)):
        torch.testing.assert_close(spmd.to_global(op(t)), op(value))


# (op, input) that torch's CPU kernels refuse for the input's dtype (their meta kernels do not check dtypes)
BAD_DTYPES = {
    "softmax(0, dtype=uint8)": (lambda t: torch.softmax(t, 0, dtype=torch.uint8), torch.randn(4, 2)),
    "log_softmax of int64": (lambda t: torch.log_softmax(t, 0), torch.arange(8).reshape(4, 2)),
    "trace of bool": (lambda t: t.trace(), torch.eye(4, dtype=torch.bool)),
}


@pytest.mark.parametrize("layout", [[U, U], ["x", U], [("x", "y"), U]], ids=str)
@pytest.mark.parametrize("name", list(BAD_DTYPES))
def test_dtypes_torchs_kernels_refuse_are_refused_alike(mesh22, name, layout):
    fn, value = BAD_DTYPES[name]
    kind, message = _torch_error(fn, value)
    with pytest.raises(kind) as info:
        fn(spmd.copy_to_mesh(value, Layout(layout, mesh22)))
    assert str(info.value) == message


def test_softmax_over_an_empty_sharded_axis_is_empty(mesh22):
    for shape, layout, dim in (((0, 4), ["x", U], 0), ((4, 0), [U, "y"], 1)):
        t = spmd.copy_to_mesh(torch.zeros(shape), Layout(layout, mesh22))
        assert t.softmax(dim).shape == shape and t.log_softmax(dim).shape == shape


# (name, op on a 4x8 tensor and an index tensor, the index): an index out of bounds, found as the kernel runs
BAD_INDICES = {
    "x[i]": (lambda t, i: t[i], [0, 7]),
    "x[:, i]": (lambda t, i: t[:, i], [0, 9]),
    "x[i] = 1": (lambda t, i: t.index_put_((i,), torch.tensor(1.0)), [0, 7]),
    "x[i] = 1, negative": (lambda t, i: t.index_put_((i,), torch.tensor(1.0)), [0, -5]),
    "x[:, i] = 1": (lambda t, i: t.__setitem__((slice(None), i), 1.0), [0, 9]),
    "gather(1)": (lambda t, i: torch.gather(t, 1, i.expand(4, 2)), [0, 9]),
    "index_add(1)": (lambda t, i: t.index_add(1, i, t[:, :2]), [0, 9]),
    "index_fill(1)": (lambda t, i: t.index_fill(1, i, 0.0), [0, 9]),
    "scatter_(1)": (lambda t, i: t.scatter_(1, i.expand(4, 2), 1.0), [0, 9]),
    "embedding": (lambda t, i: F.embedding(i, t), [0, 4]),
    "embedding, negative": (lambda t, i: F.embedding(i, t), [0, -1]),
    "cross_entropy": (lambda t, i: F.cross_entropy(t, i.repeat(2)), [1, 9]),
}


@pytest.mark.parametrize("layout", [[U, U], ["x", U], [U, "y"], ["x", "y"]], ids=str)
@pytest.mark.parametrize("name", list(BAD_INDICES))
def test_index_out_of_bounds_is_torchs_error_never_a_dropped_write(mesh22, name, layout):
    """Kernels on a sharded axis map each index to a device's block: one outside the axis was dropped (a write that
    went nowhere, a zero embedding, a loss without that row) where torch raises; and an error that a kernel on the
    stacked components raised named their axis, one past the user's."""
    op, index = BAD_INDICES[name]
    value = torch.arange(32.0).reshape(4, 8)
    kind, message = _torch_error(op, value.clone(), torch.tensor(index))
    t = spmd.copy_to_mesh(value, Layout(layout, mesh22))
    i = spmd.copy_to_mesh(torch.tensor(index), Layout([U], mesh22))
    with pytest.raises(kind) as info:
        op(t, i)
    assert str(info.value) == message


# (name, lookup of a 4x8 table at 2 indices sharded over x, with 2 rows of source sharded alike)
SHARDED_LOOKUPS = {
    "index_select": lambda t, i, rows: t.index_select(0, i),
    "index_add": lambda t, i, rows: t.index_add(0, i, rows),
    "gather": lambda t, i, rows: t.gather(0, i.view(2, 1).expand(2, 8).contiguous()),
}


@pytest.mark.parametrize("index", [[0, 4], [0, -1]], ids=["too large", "negative"])
@pytest.mark.parametrize("name", list(SHARDED_LOOKUPS))
def test_a_lookup_at_sharded_indices_refuses_what_torch_refuses(mesh22, name, index):
    """Each device reads at its own indices by advanced indexing, which would take -1 as the last row."""
    value, rows = torch.arange(32.0).reshape(4, 8), torch.ones(2, 8)
    kind, message = _torch_error(SHARDED_LOOKUPS[name], value, torch.tensor(index), rows)
    with pytest.raises(kind) as info:
        SHARDED_LOOKUPS[name](spmd.copy_to_mesh(value, Layout([U, U], mesh22)),
                              spmd.copy_to_mesh(torch.tensor(index), Layout(["x"], mesh22)),
                              spmd.copy_to_mesh(rows, Layout(["x", U], mesh22)))
    assert str(info.value) == message


def test_index_out_of_bounds_in_a_compiled_function_is_an_error(mesh22):
    """Inside a trace the values are unknown: the check is an asynchronous assert in the graph, as torch's CUDA
    kernels check, and it fires when the graph runs."""
    table = spmd.copy_to_mesh(torch.randn(8, 4), Layout(["x", U], mesh22))
    lookup = spmd.function(lambda w, i: F.embedding(i, w), backend="aot_eager")
    ids = lambda values: spmd.copy_to_mesh(torch.tensor(values), Layout([U], mesh22))  # noqa: E731
    torch.testing.assert_close(spmd.to_global(lookup(table, ids([0, 7]))), spmd.to_global(table)[[0, 7]])
    with pytest.raises(RuntimeError, match="index out of range in self"):
        lookup(table, ids([0, 8]))
