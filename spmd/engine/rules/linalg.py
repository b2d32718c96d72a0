"""Batched linear algebra: factorizations, solves, inverses, determinants, decompositions of each matrix of a batch.

Why the rule holds: these ops act on each matrix (the last one or two axes of an operand, its "core") alone, so
the leading batch axes may stay sharded, while the core axes must be whole on each device (a relayout gathers
them). The stacked component axis is one more batch axis for torch's batched kernels, so the kernel calls the op
on the stacked components directly; each device gets the per-matrix results plain torch computes.
Operands' batch axes broadcast like a pointwise op's (`cholesky_solve`, `linalg.solve`), so their layout merges
by TF's elementwise rule; each output is its batch axes (right-aligned to the broadcast batch) and whole core axes
(`pivots`, `info`, `S`, eigenvalues have fewer of them than the matrix). The kernel reads no mesh coordinate
or block size, so a batch axis sharded over several mesh dims stays so (the rule is `blockwise`).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from spmd.engine.decision import Decision, OpCall, TensorSpec
from spmd.engine.registry import register
from spmd.engine.rules.common import replace_tensors
from spmd.engine.rules.pointwise import broadcast_shape, merge_axes

aten = torch.ops.aten

# per op, the number of core (matrix) axes of each output; "B": as many as the right-hand side `B`
_OUTPUT_CORES = {
    aten.linalg_cholesky_ex.default: (2, 0),  # L, info
    aten.cholesky.default: (2,),
    aten.cholesky_inverse.default: (2,),
    aten.cholesky_solve.default: (2,),
    aten.linalg_solve_triangular.default: (2,),
    aten.triangular_solve.default: (2, 2),  # solution, cloned_coefficient
    aten._linalg_det.default: (0, 2, 1),  # det, LU, pivots
    aten._linalg_slogdet.default: (0, 0, 2, 1),  # sign, logabsdet, LU, pivots
    aten.linalg_inv_ex.default: (2, 0),
    aten._linalg_svd.default: (2, 1, 2),  # U, S, Vh
    aten._linalg_eigh.default: (1, 2),
    aten.linalg_eig.default: (1, 2),
    aten.linalg_lu.default: (2, 2, 2),  # P, L, U
    aten.linalg_lu_factor_ex.default: (2, 1, 0),  # LU, pivots, info
    aten.linalg_lu_solve.default: (2,),
    aten.lu_unpack.default: (2, 2, 2),
    aten._linalg_solve_ex.default: ("B", 2, 1, 0),  # result, LU, pivots, info
    aten.linalg_ldl_factor_ex.default: (2, 1, 0),
    aten.linalg_ldl_solve.default: (2,),
    aten.linalg_matrix_exp.default: (2,),
    aten.linalg_qr.default: (2, 2),
    aten.linalg_pinv.atol_rtol_tensor: (2,),
    aten.geqrf.default: (2, 1),  # a, tau
}
# input arguments whose core is not a matrix: pivots are one vector per matrix, tolerances one value
_INPUT_CORES = {"pivots": 1, "LU_pivots": 1, "atol": 0, "rtol": 0}


def _named_specs(call: OpCall) -> list[tuple[str, TensorSpec]]:
    """The DTensor arguments with their schema names, in the dispatcher's order."""
    names = [a.name for a in call.func._schema.arguments]
    named = [(names[i], a) for i, a in enumerate(call.args) if isinstance(a, TensorSpec)]
    return named + [(k, v) for k, v in call.kwargs.items() if isinstance(v, TensorSpec)]


def _is_vector_rhs(a: TensorSpec, b: TensorSpec) -> bool:
    """torch's reading of `linalg.solve(A, B)`: B is a (batch of) vector(s) when it is 1-D or A's shape without
    its last axis."""
    return b.rank == 1 or (b.rank == a.rank - 1 and b.shape == a.shape[:-1])


def _input_cores(call: OpCall, named: list) -> dict[str, int]:
    cores = {name: _INPUT_CORES.get(name, 2) for name, _ in named}
    if call.func is aten._linalg_solve_ex.default and "B" in cores:
        specs = dict(named)
        cores["B"] = 1 if _is_vector_rhs(specs["A"], specs["B"]) else 2
    return cores


# ops without a meta kernel: their outputs' global shapes from the input's
_SHAPES_WITHOUT_META = {aten.geqrf.default: lambda a: [a, a[:-2] + (min(a[-2:]),)]}  # a, tau


def _output_shapes(call: OpCall) -> list[tuple[int, ...]]:
    """The outputs' global shapes, from torch's meta kernel on the global shapes (placeholders included: the
    empty `U` of an SVD without vectors)."""
    if call.func in _SHAPES_WITHOUT_META:
        return _SHAPES_WITHOUT_META[call.func](tuple(call.specs[0].shape))
    def meta(a):  # a DTensor's spec, or a plain 0-d tensor (the tolerance `linalg.pinv` makes of a float)
        if isinstance(a, (TensorSpec, torch.Tensor)):
            return torch.empty(a.shape, dtype=a.dtype, device="meta")
        return a

    with _disable_current_modes():
        out = call.func(*[meta(a) for a in call.args], **{k: meta(v) for k, v in call.kwargs.items()})
    return [tuple(o.shape) for o in ((out,) if isinstance(out, torch.Tensor) else out)]


def _output_axes(shape: tuple, core: int, batch_shape: tuple, batch_axes: tuple) -> tuple:
    """An output's batch axes, right-aligned to the broadcast batch (sharded where they have its size), and whole
    core axes; a placeholder with fewer axes than its core is whole."""
    n_batch = len(shape) - core
    if n_batch < 0:
        return (None,) * len(shape)
    offset = len(batch_shape) - n_batch
    batch = tuple(batch_axes[offset + i] if shape[i] == batch_shape[offset + i] else None for i in range(n_batch))
    return batch + (None,) * core


@register(*_OUTPUT_CORES, blockwise=True)
def batched_matrix_rule(call: OpCall) -> Decision:
    """Batch axes keep their (broadcast-merged) sharding, matrix axes are gathered; one batched call on the
    stacked components."""
    named = _named_specs(call)
    cores = _input_cores(call, named)
    batch_specs = [TensorSpec(s.axes[:s.rank - cores[n]], s.shape[:s.rank - cores[n]], s.dtype) for n, s in named]
    batch_shape = broadcast_shape([b.shape for b in batch_specs])
    batch_axes = merge_axes(batch_specs, batch_shape)
    inputs = []
    for (name, _), batch in zip(named, batch_specs):
        offset = len(batch_shape) - batch.rank
        inputs.append(tuple(None if size == 1 and batch_shape[offset + i] != 1 else batch_axes[offset + i]
                            for i, size in enumerate(batch.shape)) + (None,) * cores[name])
    out_cores = [cores["B"] if c == "B" else c for c in _OUTPUT_CORES[call.func]]
    outputs = tuple(_output_axes(shape, core, batch_shape, batch_axes)
                    for shape, core in zip(_output_shapes(call), out_cores))
    pads = tuple(len(batch_shape) - b.rank for b in batch_specs)
    vectors = tuple(name == "B" and cores[name] == 1 for name, _ in named)
    broadcasts = any(b.shape != batch_shape for b in batch_specs)
    kernel = _stacked_kernel(call.func, pads, vectors, outputs, call.num_local, broadcasts)
    return Decision(tuple(inputs), outputs, kernel, single=len(outputs) == 1)


def _stacked_kernel(func, pads: tuple, vectors: tuple, outputs: tuple, stack: int, broadcasts: bool):
    """The op on stacked components, their batch ranks padded with ones after the stack axis so that they
    broadcast as the global operands do, and a vector right-hand side made a one-column matrix (a padded vector
    would read as a matrix); each output is brought back to its own rank."""
    op = getattr(func, "_op", func)
    ranks = tuple(len(axes) + 1 for axes in outputs)

    def kernel(locals_, args, kwargs):
        xs = []
        for x, pad, vector in zip(locals_, pads, vectors):
            if broadcasts:  # torch's `lu_solve` misreads a column-major LU broadcast along a size-1 axis
                x = x.contiguous()
            x = x.view(x.shape[:1] + (1,) * pad + x.shape[1:]) if pad else x
            xs.append(x.unsqueeze(-1) if vector else x)
        a, kw = replace_tensors(args, kwargs, xs)
        out = op(*a, **kw)
        outs = [_with_rank(o, r, any(vectors) and i == 0, stack) for i, (o, r) in
                enumerate(zip((out,) if isinstance(out, torch.Tensor) else out, ranks))]
        return outs[0] if len(outs) == 1 else tuple(outs)
    return kernel


def _with_rank(out: torch.Tensor, rank: int, vector: bool, stack: int) -> torch.Tensor:
    """A stacked output with `rank` axes: a vector solution's column axis dropped, the padding ones after the
    stack axis merged into it, a placeholder (the same empty tensor for the whole stack) given a stack axis."""
    if vector:
        out = out.squeeze(-1)
    if out.dim() == rank:
        return out
    if out.dim() < rank:
        return out.new_empty((stack,) + tuple(out.shape))
    return out.flatten(0, out.dim() - rank)
