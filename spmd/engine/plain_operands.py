"""Plain tensors among a DTensor op's operands: which ones are taken as global values, and writes into them.

TF DTensor's rule: plain integer tensors of fewer than `SMALL_INTEGER_TENSOR` elements (indices, shapes, axes:
`x[[0, 2]]`) are broadcast to DTensors as replicated; any other plain tensor of rank > 0 is an error, unless the op
runs under `spmd.implicit_replication()` (as a distributed module's forward does), where a plain tensor holds a
global value. There an op writing DTensor values into a plain tensor — a cache a model allocated for itself and
updates in place (Mamba's convolution and state caches, a static KV cache), the scratch buffers and running total
of torch's chunked linear cross-entropy in its backward — writes their global values into it. (A plain 0-d tensor
is a scalar operand elsewhere, and such a target too.)
"""

from __future__ import annotations

import warnings

import torch
import torch.utils._pytree as pytree

from spmd.dtensor import DTensor
from spmd.engine import planner
from spmd.engine.decision import is_inplace
from spmd.errors import MixedTensorError

# short bool tensors are indices too here (`x[[True, False, True]]`: torch makes the list a bool mask)
SMALL_INTEGER_TENSOR = 20
_WARNED: set = set()  # ops that wrote gathered values into a plain tensor (each warned about once)


def small_integers(args, kwargs) -> bool:
    """Whether every plain tensor of rank > 0 among the arguments is a small integer tensor (see above)."""
    return all(t.dtype in (torch.int32, torch.int64, torch.bool) and t.numel() < SMALL_INTEGER_TENSOR
               for t in pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.dim() > 0)


def mixed_tensor_error(plain: torch.Tensor) -> MixedTensorError:
    return MixedTensorError(
        f"a plain torch.Tensor of shape {list(plain.shape)} was mixed with DTensors; only Python scalars, 0-d "
        f"tensors and integer or bool tensors of fewer than {SMALL_INTEGER_TENSOR} elements are broadcast "
        "automatically. Distribute it first: spmd.copy_to_mesh(tensor, layout); where torch made it inside an op's own "
        "implementation, run the op under spmd.implicit_replication()")


def writes_plain(func, args) -> bool:
    """Whether `func` writes a plain first argument (a replicated copy of it would take the write instead)."""
    return bool(args) and not isinstance(args[0], DTensor) and is_inplace(func)


def write_into_plain(func, args, kwargs, error: MixedTensorError, replicating: bool):
    """`func` writing into a plain first argument with its DTensor operands' global values (an all-gather of each
    sharded one; warned about once per op) where plain tensors hold global values (`replicating`); else the error.
    (Autograd records the write as for plain tensors; a plain tensor that so requires grad is refused where it meets
    DTensors again, as any such plain tensor is.)"""
    target = args[0]
    if not replicating and func is torch.ops.aten.copy_.default:
        raise MixedTensorError(
            f"{func}: a DTensor cannot be copied into a plain tensor (of shape {list(target.shape)}); gather it "
            "first: plain.copy_(spmd.to_global(dtensor)). (A plain module loads a distributed one's state with "
            "module.load_state_dict({k: spmd.to_global(v) for k, v in state.items()}).)") from None
    if not replicating:
        raise MixedTensorError(f"{func}: {error}") from None
    if func not in _WARNED:
        _WARNED.add(func)
        warnings.warn(f"spmd: {func} writes DTensors into a plain tensor of shape {list(target.shape)}, which holds "
                      "a global value: their global values are written (an all-gather of each sharded one). Make the "
                      "buffer a DTensor (spmd.copy_to_mesh) to keep it sharded", stacklevel=3)

    def global_value(a):  # (one device's component, once relayouted to replicated)
        if not isinstance(a, DTensor):
            return a
        mesh, axes = a._layout.mesh, a._layout.axes
        return planner.run(a._local, mesh, planner.plan_on(mesh, axes, (None,) * len(axes)))[0]
    args, kwargs = pytree.tree_map(global_value, (args, kwargs))
    return func(*args, **kwargs)
