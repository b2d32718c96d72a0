"""What travels from the controller to its workers: instructions whose arguments name worker-side objects.

A message is `pickle((freed_handles, [instruction, ...]))`; plain pickle, and the only code shipped is function
mode's traced graphs (FX graph modules: torch ops, no user code). In an instruction,
a controller DTensor becomes its `Handle`, a Layout or mesh of a controller mesh becomes a reference to the
worker's own mesh (`LayoutRef`, `MeshRef`), the `meta` device (where the controller keeps its metadata
shadows) becomes the worker's device (`DEVICE`), and an op travels as its qualified name (`aten.add.Tensor`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from spmd.layout import Layout

# instruction kinds: ("op", op_name, args, kwargs, out_handles), ("put", handle, layout_ref, shape, stack,
# replicated_value), ("mesh", mesh_id, dims, name), ("iter", dataset_id, iterator_id): a new epoch of a dataset,
# ("batch", iterator_id, out_handles): its next batch, ("call", function_name, args): a value sent back;
# function mode (spmd/controller/traced.py): ("graph", graph_id, pickled_graph_module, {controller mesh string:
# mesh_id}, compile options), ("run_graph", graph_id, args, out_handles, call_id, needs_grad): call_id names
# the autograd state kept for ("graph_backward", call_id, grads, grad_handles)
OP, PUT, MESH, ITER, BATCH, CALL = "op", "put", "mesh", "iter", "batch", "call"
GRAPH, RUN_GRAPH, GRAPH_BACKWARD = "graph", "run_graph", "graph_backward"


@dataclass(frozen=True)
class Handle:
    """A worker-side DTensor, by the id the controller gave it."""
    id: int


@dataclass(frozen=True)
class MeshRef:
    id: int


@dataclass(frozen=True)
class LayoutRef:
    mesh: int
    specs: tuple


@dataclass(frozen=True)
class LayoutString:
    """A layout passed as TF's string (`spmd::relayout`'s argument), on a controller mesh."""
    mesh: int
    specs: tuple


@dataclass(frozen=True)
class SmallTensor:
    """A plain tensor of a few elements (an optimizer's step count) as its values: pickling a tensor costs
    ~0.2 ms at each end, these ~10 us."""
    values: object
    dtype: torch.dtype

    SIZE = 64  # elements, at most

    def tensor(self) -> torch.Tensor:
        return torch.tensor(self.values, dtype=self.dtype)


class _Device:
    def __reduce__(self):
        return "DEVICE"


DEVICE = _Device()  # the device of the worker's components
_META = torch.device("meta")


def op_name(func) -> str:
    """`aten.add.Tensor` for `torch.ops.aten.add.Tensor` (an OpOverload pickles by name)."""
    return str(func)


@functools.lru_cache(maxsize=None)
def resolve_op(name: str):
    namespace, op, overload = name.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except AttributeError:
        raise LookupError(f"no op {namespace}::{op}.{overload} on this worker: a custom op is defined by the module "
                          "that registers it; start the Controller with imports=[that module]") from None


def encode(value, refs):
    """`value` with controller objects replaced by references; `refs(obj)` maps a DTensor, Layout or Mesh of a
    controller mesh to its reference (None for anything else)."""
    t = type(value)
    if t is int or t is float or t is bool or value is None or t is str:
        return value
    if t is list or t is tuple:
        return t(encode(v, refs) for v in value)
    if t is dict:
        return {k: encode(v, refs) for k, v in value.items()}
    if t is torch.device:
        return DEVICE if value == _META else value
    if t is torch.Tensor and value.numel() <= SmallTensor.SIZE and value.device.type == "cpu" \
            and not value.requires_grad:
        return SmallTensor(value.tolist(), value.dtype)
    ref = refs(value)
    return value if ref is None else ref


def decode(value, table, meshes, device):
    """The worker's objects for the references in `value`."""
    t = type(value)
    if t is Handle:
        return table[value.id]
    if t is list or t is tuple:
        return t(decode(v, table, meshes, device) for v in value)
    if t is dict:
        return {k: decode(v, table, meshes, device) for k, v in value.items()}
    if t is LayoutRef:
        return layout_on(meshes[value.mesh], value.specs)
    if t is SmallTensor:
        return value.tensor()
    if t is LayoutString:
        return layout_on(meshes[value.mesh], value.specs).to_string()
    if t is MeshRef:
        return meshes[value.mesh]
    if value is DEVICE:
        return device
    return value


@functools.lru_cache(maxsize=4096)
def layout_on(mesh, specs: tuple) -> Layout:
    """The Layout of `specs` on `mesh` (kept: instructions and graph results name the same few layouts again)."""
    return Layout(list(specs), mesh)
