"""`DVariable`: a DTensor whose layout is fixed at creation; a leaf parameter for `nn.Module` and `torch.optim`."""

from __future__ import annotations

import numpy as np
import torch

from spmd.api import copy_to_mesh, relayout
from spmd.collectives.local import one_copy, share, shared
from spmd.dtensor import DTensor, keep_grad_layout, make_parameters
from spmd.engine import optim
from spmd.errors import LayoutError, MeshMismatchError
from spmd.layout import Layout


class DVariable(DTensor):
    """A mutable DTensor with an immutable layout (the seeds' `dtensor.DVariable`).

    It behaves as an `nn.Parameter`: a leaf that requires grad by default, registered by `nn.Module` when set
    as an attribute, updated in place by `torch.optim`; its gradient has its layout.

    Args:
      initial_value: a DTensor (its layout is kept), or a tensor/array-like/callable with `layout=`.
      layout: the layout; must equal the initial value's if that is a DTensor.
      requires_grad: as for `nn.Parameter` (default True).

    Raises:
      ValueError: neither a DTensor value nor a layout; a layout that conflicts with the value's.

    >>> mesh = create_mesh([("x", 2)])
    >>> v = DVariable(torch.zeros(4, 2), layout=Layout(["x", UNSHARDED], mesh))
    >>> v.assign_add(ones((4, 2), layout=Layout(["x", UNSHARDED], mesh))).read_value().sum().item()
    8.0
    >>> isinstance(v, torch.nn.Parameter), v.requires_grad
    (True, True)
    """

    def __new__(cls, initial_value, layout: Layout | None = None, requires_grad: bool = True, name=None,
                dtype=None):
        if callable(initial_value) and not isinstance(initial_value, torch.Tensor):
            initial_value = initial_value()
        if isinstance(initial_value, DTensor):
            if layout is not None and layout != initial_value._layout:
                raise LayoutError(f"Conflicting layouts are provided for initial value layout "
                                  f"({initial_value._layout.sharding_specs}) and variable ({layout.sharding_specs}).")
            value = initial_value
        elif layout is None:
            raise LayoutError("Neither layout nor DTensor initial value are provided: pass layout= or a DTensor.")
        else:
            value = copy_to_mesh(initial_value, layout)
        local = value._local.detach()
        if shared(local):  # a replicated value stays one copy that every device shares
            local = share(_copied(one_copy(local), dtype), local.shape[0])
        else:
            local = _copied(local, dtype)
        var = DTensor.__new__(cls, local, value._layout, value.shape, requires_grad)
        var.variable_name = name
        if requires_grad:
            keep_grad_layout(var)
        return var

    _is_param = True  # nn.Module registers it as a parameter

    def __init__(self, *args, **kwargs):
        pass

    @property
    def layout_(self) -> Layout:
        return self._layout

    def _check(self, value, verb: str):
        if isinstance(value, DTensor):
            if value._layout.mesh != self._layout.mesh:
                raise MeshMismatchError(f"cannot {verb} a value on mesh {value._layout.mesh!r} to a DVariable on "
                                        f"{self._layout.mesh!r}; a DVariable's layout is fixed (relayout the value)")
            if value._layout != self._layout:
                raise LayoutError(f"cannot {verb} a value of layout {value._layout.sharding_specs} to a DVariable of "
                                  f"layout {self._layout.sharding_specs}: a DVariable's layout is fixed; relayout "
                                  "the value first (spmd.relayout(value, spmd.fetch_layout(variable)))")
            if value.shape != self.shape:
                raise LayoutError(f"Cannot {verb} a value of shape {list(value.shape)} to a DVariable of shape "
                                  f"{list(self.shape)}")
        elif np.ndim(value) > 0:  # a plain tensor, numpy array or list
            raise TypeError(f"cannot {verb} a plain {type(value).__name__} of shape {list(np.shape(value))} to a "
                            "DVariable; only scalars are broadcast. Use spmd.copy_to_mesh(value, "
                            "spmd.fetch_layout(variable))")

    def _data_value(self, value: DTensor) -> DTensor:
        """`v.data = value` keeps the variable's layout: the value is relayouted to it."""
        if value._layout.mesh != self._layout.mesh:
            raise MeshMismatchError(f"cannot assign a value on mesh {value._layout.mesh!r} to the .data of a "
                                    f"DVariable on {self._layout.mesh!r}; a DVariable's layout is fixed (move the "
                                    "value with spmd.copy_to_mesh)")
        if value._layout == self._layout:
            return value
        return relayout(value, Layout(self._layout.sharding_specs, self._layout.mesh)).detach()

    def assign(self, value) -> "DVariable":
        """Overwrites the value in place; the layout must stay the same."""
        self._check(value, "assign")
        with torch.no_grad():
            if isinstance(value, DTensor):
                self.copy_(value)
            else:
                self.fill_(value)
        return self

    def assign_add(self, value) -> "DVariable":
        self._check(value, "assign_add")
        with torch.no_grad():
            self.add_(value)
        return self

    def assign_sub(self, value) -> "DVariable":
        self._check(value, "assign_sub")
        with torch.no_grad():
            self.sub_(value)
        return self

    def detach(self) -> "DVariable":
        """A DVariable sharing this one's components, outside autograd (not a parameter). `nn.Parameter` asks a
        tensor subclass for a detached instance of its own type: `model.to(device)` and `.float()`, which leave a
        parameter as it is, wrap it anew."""
        out = super().detach()
        if type(out) is DTensor:  # (a controller mesh's is its remote twin's class: left as it is)
            out.__class__ = DVariable
        return out

    def read_value(self) -> DTensor:
        """A copy of the current value (differentiable)."""
        return torch.Tensor.clone(self)

    def __repr__(self, *, tensor_contents=None) -> str:
        return "DVariable(" + super().__repr__()[len("DTensor("):]


optim.let_torch_optim_take(DTensor, DVariable)
make_parameters(DVariable)


def _copied(local: torch.Tensor, dtype) -> torch.Tensor:
    return local.to(dtype, copy=True) if dtype is not None else local.clone()
