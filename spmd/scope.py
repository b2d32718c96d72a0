"""Scopes that change how ops treat plain tensors: `default_mesh` (the mesh that factories use) and
`implicit_replication` (plain tensors mixed with DTensors taken as replicated)."""

from __future__ import annotations

import contextlib

import torch
import torch.fx.traceback as fx_traceback

from spmd.creation import FactoryMode, get_default_mesh
from spmd.engine import dispatch
from spmd.errors import LayoutError
from spmd.mesh import Mesh

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
    of raising `MixedTensorError` — for tensors that torch makes inside an op's own implementation (`F.one_hot`'s
    `arange`, the causal mask of the math attention kernel). It holds a global value, so results stay exact; the
    price is one copy of it per device. An op writing into a plain tensor still raises. (Derivative formulas that
    make plain tensors are always taken this way.)

    >>> mesh = create_mesh([("x", 2)])
    >>> labels = copy_to_mesh(torch.tensor([0, 2, 1, 2]), Layout(["x"], mesh))
    >>> with implicit_replication():
    ...     one_hot = torch.nn.functional.one_hot(labels, 3)
    >>> fetch_layout(one_hot).sharding_specs, to_global(one_hot).sum(0).tolist()
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
