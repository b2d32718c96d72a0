"""Scopes that change how ops treat plain tensors: `default_mesh` (the mesh that factories use) and
`implicit_replication` (plain tensors mixed with DTensors taken as replicated), which the composite ops that make
plain tensors inside their own implementation enter by themselves."""

from __future__ import annotations

import contextlib

import torch
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree

from spmd.collectives.local import traced
from spmd.creation import FactoryMode
from spmd.dtensor import DTensor
from spmd.engine import dispatch
from spmd.engine.rules.host_values import below, empty_matrix_rank, register_above_autograd
from spmd.errors import LayoutError, UnsupportedOpError
from spmd.mesh import Mesh, get_default_mesh

__all__ = ["default_mesh", "get_default_mesh", "implicit_replication"]


class default_mesh(contextlib.ContextDecorator):
    """Makes `mesh` the default inside a `with` block (or a decorated function); nesting restores the outer
    mesh, also when the block raises.

    Inside the scope, torch's factories (`torch.zeros`, `torch.ones`, `torch.full`, `torch.empty`,
    `torch.rand`, `torch.randn`, `torch.arange`) and spmd's own return DTensors replicated on `mesh`.

    >>> mesh = create_mesh([("x", 2)])
    >>> with default_mesh(mesh):
    ...     print(get_default_mesh() == mesh, is_dtensor(torch.zeros(3)))
    True True
    >>> print(get_default_mesh())
    None
    """

    def __init__(self, mesh: Mesh):
        if not isinstance(mesh, Mesh):
            raise LayoutError(f"Expect `mesh` to be `Mesh`, got {type(mesh)}")
        self.mesh = mesh
        self._modes: list = []  # one per entry: a decorated function may be re-entered

    def __enter__(self):
        mode = FactoryMode(None, self.mesh)
        mode.__enter__()
        self._modes.append(mode)
        return self.mesh

    def __exit__(self, *exc):
        self._modes.pop().__exit__(*exc)
        return False


@contextlib.contextmanager
def implicit_replication():
    """Inside the block, a plain tensor that meets DTensors in an op is taken as replicated on their mesh instead
    of raising `MixedTensorError` — for code that makes plain tensors holding global values (a mask from
    `torch.arange`). The price is one copy of it per device. An op writing DTensors into a plain tensor (a cache
    a model allocated for itself) writes their global values, gathered (each such op warns once).
    (Derivative formulas and the composite ops that make plain tensors inside, such as `F.one_hot` and the math
    attention kernel, take them this way by themselves.)

    >>> mesh = create_mesh([("x", 2)])
    >>> labels = copy_to_mesh(torch.tensor([0, 2, 1, 2]), Layout(["x"], mesh))
    >>> with implicit_replication():
    ...     hits = labels.unsqueeze(1) == torch.arange(3)
    >>> fetch_layout(hits).sharding_specs, to_global(hits).sum(0).tolist()
    (['x', 'unsharded'], [1, 1, 2])

    Inside `spmd.function` (or `torch.compile`) the scope covers the ops traced inside the block.
    """
    if torch.compiler.is_compiling():  # Dynamo would apply the counter's updates only after the traced ops
        with fx_traceback.annotate({dispatch.TRACED_SCOPE: True}):
            yield
        return
    with EAGER_IMPLICIT_REPLICATION:
        yield


class _EagerImplicitReplication:
    """`implicit_replication()` outside a trace, without a generator's cost (a distributed module's every call)."""

    __slots__ = ()

    def __enter__(self) -> None:
        dispatch.IMPLICIT_REPLICATION[0] += 1

    def __exit__(self, *exc) -> bool:
        dispatch.IMPLICIT_REPLICATION[0] -= 1
        return False


EAGER_IMPLICIT_REPLICATION = _EagerImplicitReplication()


def replicates_plain() -> bool:
    """Whether a plain tensor meeting DTensors is taken as replicated here (inside `implicit_replication`, the
    forward of a distributed module, or a derivative formula)."""
    return dispatch._replicates_plain()


# -- composite ops that make plain tensors inside: implicit replication by themselves ------------------------------
# torch decomposes these CompositeImplicitAutograd ops in C++, at the autograd key, into ops that mix a plain
# tensor it made (one_hot's zeros, the math attention kernel's causal mask, quantile's ranks, combinations' mask,
# matrix_rank's tolerance, the target lengths by which ctc_loss divides its losses when given them as a list) with
# the DTensor inputs; `__torch_dispatch__` then sees the plain tensor but not who made it. A kernel above autograd
# (see engine/rules/host_values.py; no other op pays anything) runs them under implicit replication, after checking
# that no plain tensor came from the caller, and any check torch runs only for plain inputs.


def _check_labels(labels: DTensor, num_classes: int = -1) -> None:
    """torch checks one_hot's labels only for plain tensors (a traced one asserts in the graph): the same checks
    on each device's components."""
    stack = labels._local
    if traced(stack):
        return
    if bool((stack < 0).any()):
        raise RuntimeError("Class values must be non-negative.")
    if num_classes != -1 and bool((stack >= num_classes).any()):
        raise RuntimeError("Class values must be smaller than num_classes.")


# op -> the check of its arguments that torch skips for a tensor subclass (None: none)
_MAKE_PLAIN_TENSORS = {torch.ops.aten.one_hot.default: _check_labels,
                       torch.ops.aten.scaled_dot_product_attention.default: None,
                       torch.ops.aten.quantile.scalar: None, torch.ops.aten.quantile.default: None,
                       torch.ops.aten.combinations.default: None, torch.ops.aten.ctc_loss.IntList: None}


def _replicating_inside(overload, check):
    def kernel(keyset, *args, **kwargs):
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        dtensors = [t for t in tensors if isinstance(t, DTensor)]
        if not dtensors:
            return overload.redispatch(below(keyset), *args, **kwargs)
        for t in tensors:  # the caller's: its layout is the caller's choice, unless plain tensors replicate here
            if not isinstance(t, DTensor) and t.dim() > 0 and not replicates_plain():
                raise dispatch.mixed_tensor_error(t)
        if dtensors[0]._layout.mesh.remote is not None:
            raise UnsupportedOpError(
                f"{overload} makes plain tensors inside its torch implementation on its input's device, which for "
                "a DTensor of a single-controller mesh is 'meta' (the components live on the workers): they "
                "would hold no values. Not supported on controller meshes yet; relayout the input to a mesh of "
                "this process first (spmd.relayout)")
        if check is not None:
            check(*args, **kwargs)
        with EAGER_IMPLICIT_REPLICATION:  # (also while traced: this runs when the op is, not when Dynamo records
            return overload.redispatch(below(keyset), *args, **kwargs)  # a call)
    return kernel


def _matrix_rank(overload):
    """`linalg.matrix_rank`: torch makes its tolerance a plain tensor (taken as replicated); an empty batch's
    ranks are made whole (engine/rules/host_values.py)."""
    inside = _replicating_inside(overload, None)

    def kernel(keyset, *args, **kwargs):
        if isinstance(args[0], DTensor) and args[0].numel() == 0:
            return empty_matrix_rank(overload, args, kwargs)
        return inside(keyset, *args, **kwargs)
    return kernel


for _overload, _check in _MAKE_PLAIN_TENSORS.items():
    register_above_autograd(_overload, _replicating_inside(_overload, _check))
_RANK = torch.ops.aten.linalg_matrix_rank
for _overload in (_RANK.default, _RANK.tol_tensor, _RANK.atol_rtol_tensor, _RANK.atol_rtol_float):
    register_above_autograd(_overload, _matrix_rank(_overload))
