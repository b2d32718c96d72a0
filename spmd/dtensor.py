"""The DTensor: a `torch.Tensor` with a global shape outside, a Layout and one component per device inside.

Components of all local devices are stored stacked in one tensor `_local` of shape `(L, *local_shape)`
(`L = mesh.num_local_devices()`), so that an op on 8 virtual devices is one kernel, not eight.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from spmd.errors import LayoutError
from spmd.layout import Layout
from spmd.mesh import short_device_name
from spmd.tracing import prepare_dynamo


class DTensor(torch.Tensor):
    """A distributed tensor. Create one with `pack`, `copy_to_mesh`, `relayout` or a factory with `layout=`.

    Torch ops on DTensors run on every device's component (SPMD expansion) with the collectives inserted
    for you; autograd, `nn.Module` and `torch.optim` work unchanged.
    """

    _local: torch.Tensor
    _layout: Layout
    _copied_view = False  # set on outputs of view ops that had to relayout (see dispatch)

    # Ops reach `__torch_dispatch__` directly: no Python-level `__torch_function__` on the hot path.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local: torch.Tensor, layout: Layout, shape: Sequence[int], requires_grad: bool = False):
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device,
                                                  requires_grad=requires_grad)
        out._local = local
        out._layout = layout
        out._key = (layout, tuple(shape), local.dtype)  # the dispatcher's cache-key part for this tensor
        return out

    # `__torch_dispatch__` is installed by spmd.dispatch (kept there to avoid an import cycle).

    # -- torch.compile: a traceable wrapper subclass --------------------------------------------------------------
    # Dynamo and AOTAutograd see the stacked components as the one inner tensor and the layout as static
    # metadata (guarded on), so a compiled graph holds plain kernels over `_local` and the collectives.
    def __tensor_flatten__(self):
        prepare_dynamo()
        return ["_local"], self._layout

    @classmethod
    def __tensor_unflatten__(cls, inner, layout, outer_size, outer_stride):
        return DTensor.__new__(cls, inner["_local"], layout, tuple(outer_size))

    def __coerce_same_metadata_as_tangent__(self, expected_layout, expected_type=None):
        """A gradient arriving at a compiled backward with another layout than the one traced is relayouted."""
        if expected_type is not None and not issubclass(expected_type, DTensor):
            return None
        if expected_layout == self._layout:
            return self
        from spmd.api import relayout
        return relayout(self, expected_layout)

    def _stable_hash_for_caching(self) -> str:
        return self._layout.to_string()

    # -- what a user sees ----------------------------------------------------------------------------------------
    def __repr__(self, *, tensor_contents=None) -> str:
        layout = self._layout
        if type(self._local) is not torch.Tensor:  # fake or traced components (torch.compile logs them): no values
            value = f"<{type(self._local).__name__}>"
        elif layout.is_fully_replicated():
            value = _format(self._local[0])
        else:
            names = [short_device_name(d) for d in layout.mesh.local_devices()]
            value = "{" + ", ".join(f'"{n}": {_format(c)}' for n, c in zip(names, self._local)) + "}"
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (f'DTensor({value}, layout="{layout.to_string()}", shape={tuple(self.shape)}, '
                f"dtype={self.dtype}{grad})")

    def __str__(self) -> str:
        return self.__repr__()

    def numpy(self, *, force: bool = False) -> np.ndarray:
        """The global value as a numpy array; only for a fully replicated DTensor, as in TF."""
        if not self._layout.is_fully_replicated():
            raise LayoutError(
                f"Trying to copy a non-replicated DTensor to numpy is not supported (it would gather every "
                f"shard onto the host). Layout: {self._layout.sharding_specs}, shape {list(self.shape)}. "
                f"relayout it first: spmd.relayout(t, spmd.Layout.replicated(mesh, rank={self.dim()})).")
        return self._local[0].detach().cpu().numpy()

    def tolist(self):
        """The global value as (nested) Python lists; only for a fully replicated DTensor, as `numpy()`."""
        return self.numpy().tolist()

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        copy = DTensor.__new__(type(self), self._local.detach().clone(), self._layout, self.shape,
                               self.requires_grad)
        skip = ("_local", "_layout", "_grad_layout_hook")
        copy.__dict__.update({k: v for k, v in self.__dict__.items() if k not in skip})
        if copy.requires_grad:
            keep_grad_layout(copy)
        memo[id(self)] = copy
        return copy

    def requires_grad_(self, requires_grad: bool = True):
        super().requires_grad_(requires_grad)
        if requires_grad and self.is_leaf:
            keep_grad_layout(self)
        return self

    def __reduce_ex__(self, protocol):
        raise TypeError("a DTensor cannot be pickled directly; save it with spmd.checkpoint or unpack it first")


def _operator(torch_fn, reflected: bool = False):
    # torch's C operator slots turn a TypeError into NotImplemented, which would hide spmd's MixedTensorError
    # behind Python's generic "unsupported operand" (and make `dtensor == plain` silently False)
    if reflected:
        return lambda self, other: torch_fn(other, self)
    return lambda self, other: torch_fn(self, other)


for _name, _fn in {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "truediv": torch.div,
                   "matmul": torch.matmul, "pow": torch.pow, "eq": torch.eq, "ne": torch.ne, "lt": torch.lt,
                   "le": torch.le, "gt": torch.gt, "ge": torch.ge}.items():
    setattr(DTensor, f"__{_name}__", _operator(_fn))
for _name, _fn in {"radd": torch.add, "rmul": torch.mul, "rmatmul": torch.matmul, "rpow": torch.pow}.items():
    setattr(DTensor, f"__{_name}__", _operator(_fn, reflected=True))
DTensor.__rsub__ = lambda self, other: torch.rsub(self, other)
DTensor.__rtruediv__ = lambda self, other: torch.reciprocal(self) * other  # as torch.Tensor.__rtruediv__
DTensor.__hash__ = torch.Tensor.__hash__  # defining __eq__ would otherwise make DTensors unhashable


def _format(component: torch.Tensor) -> str:
    return np.array2string(component.detach().cpu().numpy(), separator=" ", threshold=64).replace("\n", "")


def keep_grad_layout(leaf: DTensor) -> None:
    """Relayouts gradients arriving at `leaf` to `leaf`'s layout, so `leaf.grad` has the leaf's layout."""
    if getattr(leaf, "_grad_layout_hook", None) is not None:
        return
    layout = leaf._layout

    def to_leaf_layout(grad):
        if not isinstance(grad, DTensor):
            return grad
        if grad._layout != layout:
            from spmd.api import relayout
            grad = relayout(grad, layout)
        if not grad._local.is_contiguous():
            # e.g. a weight gradient computed transposed: plain torch makes accumulated grads contiguous too,
            # and optimizers' in-place updates are several times slower on strided storage
            grad = make(grad._local.contiguous(), layout)
        return grad

    leaf._grad_layout_hook = leaf.register_hook(to_leaf_layout)


def make(local: torch.Tensor, layout: Layout, requires_grad: bool = False) -> DTensor:
    """Wraps stacked components `(L, *local_shape)`; the global shape follows from the layout."""
    shape = layout.global_shape_from_local_shape(local.shape[1:])
    return DTensor(local, layout, shape, requires_grad)


# -- the seeds' functions ----------------------------------------------------------------------------------------
def is_dtensor(tensor: Any) -> bool:
    """True for a DTensor (and a DVariable)."""
    return isinstance(tensor, DTensor)


def fetch_layout(tensor: Any) -> Layout | None:
    """The layout of a DTensor; None for a non-tensor Python value.

    Raises:
      TypeError: for a plain torch.Tensor (it has no layout; `copy_to_mesh` gives it one).
    """
    if isinstance(tensor, DTensor):
        return tensor._layout
    if isinstance(tensor, torch.Tensor):
        raise TypeError(f"fetch_layout expects a DTensor, got a plain torch.Tensor of shape {list(tensor.shape)}; "
                        "use spmd.copy_to_mesh(tensor, layout) to distribute it")
    return None


def check_layout(tensor: DTensor, layout: Layout) -> None:
    """Raises ValueError unless `tensor` has exactly `layout`."""
    actual = fetch_layout(tensor)
    if actual != layout:
        raise LayoutError(f"Layout of tensor: {actual!r}, did not match expected layout: {layout!r}")


def pack(tensors: Sequence[Any], layout: Layout) -> DTensor:
    """Packs one component per local device (in `layout.mesh.local_devices()` order) into a DTensor.

    Components may be tensors or array-likes; they are moved to the mesh's device. Differentiable: gradients
    flow back to components that require grad.

    Raises:
      ValueError: wrong number of components, or components whose rank, shape or dtype disagree.

    >>> mesh = create_mesh([("x", 2)], devices=["CPU:0", "CPU:1"])
    >>> t = pack([[1, 2], [3, 4]], Layout(["x"], mesh))
    >>> t.shape, [c.tolist() for c in unpack(t)]
    (torch.Size([4]), [[1, 2], [3, 4]])
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"pack expects a Layout, got {type(layout).__name__}")
    if isinstance(tensors, DTensor) or any(isinstance(t, DTensor) for t in tensors):
        raise LayoutError("pack expects plain components; this is already a DTensor (use relayout to change "
                          "its layout)")
    mesh = layout.mesh
    expected = mesh.num_local_devices()
    if len(tensors) != expected:
        share = "" if mesh.is_fully_local() else (
            f"; this client holds {expected} of the mesh's {mesh.size} devices and packs only their components")
        raise LayoutError(f"pack expected {expected} components (one per local device of {mesh!r}), "
                          f"but got {len(tensors)}{share}")
    components = [t if isinstance(t, torch.Tensor) else torch.as_tensor(t) for t in tensors]
    first = components[0]
    for i, c in enumerate(components):
        if c.dim() != layout.rank:
            raise LayoutError(f"Packed layout should have the same rank as each component: component {i} has "
                              f"rank {c.dim()} (shape {list(c.shape)}) while layout {layout.sharding_specs} has "
                              f"rank {layout.rank}")
        if c.shape != first.shape:
            raise LayoutError(f"Components of a DTensor must all have the same shape: component 0 has "
                              f"{list(first.shape)}, component {i} has {list(c.shape)}")
        if c.dtype != first.dtype:
            raise LayoutError(f"Components of a DTensor must all have the same dtype: component 0 is "
                              f"{first.dtype}, component {i} is {c.dtype}")
    from spmd.api import Pack
    return Pack.apply(layout, *components)


def unpack(tensor: DTensor) -> list[torch.Tensor]:
    """The components of `tensor`, one per local device in `mesh.local_devices()` order (differentiable)."""
    if not isinstance(tensor, DTensor):
        raise TypeError(f"unpack expects a DTensor, got {type(tensor).__name__}")
    from spmd.api import Unpack
    return list(Unpack.apply(tensor))
