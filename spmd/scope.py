"""`default_mesh`: the mesh that ops with no DTensor input (factories) use inside a scope."""

from __future__ import annotations

import contextlib

from spmd.creation import FactoryMode, get_default_mesh
from spmd.errors import LayoutError
from spmd.mesh import Mesh

__all__ = ["default_mesh", "get_default_mesh"]


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
