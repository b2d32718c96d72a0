"""torch.optim over DTensor parameters: its foreach and fused updates run on the stacked components.

torch.optim's multi-tensor updates (`foreach=True`, `fused=True`) begin by grouping their tensor lists (parameters,
gradients, state) by device and dtype. Where every op of an update is elementwise over the parameters (Adam, AdamW,
SGD, Adagrad, RMSprop, Adamax, NAdam, RAdam, ASGD, Adadelta, Rprop: all but Adafactor, which factors its second
moment over rows and columns), spmd hands that grouping the DTensors' stacked components instead. The update then
runs torch's own multi-tensor kernels on plain tensors: no DTensor dispatch per op and list element, so its cost is
plain torch's over tensors of the stacks' size. Lists that do not line up (a gradient laid out unlike its parameter,
state not created yet, a plain tensor among DTensors) stay DTensors, and each op runs through engine/foreach.py.

The same optimizers take their foreach update by default for DTensor parameters, on every device (plain torch keeps
its for-loop on CPU, where for DTensors it would cost one dispatch per parameter and op).
"""

from __future__ import annotations

import importlib
import inspect
import operator
import sys

import torch
import torch.utils._foreach_utils
from torch.optim import optimizer

from spmd.dtensor import DTensor
from spmd.engine.foreach import once_where_shared, same_keys

_KEY, _STACK, _PENDING, _COPIED_VIEW = map(operator.attrgetter, ("_key", "_stack", "_pending", "_copied_view"))
_GROUP = optimizer.Optimizer._group_tensors_by_device_and_dtype  # torch's own grouping
_ELEMENTWISE_OPTIMIZERS = ("adam", "adamw", "sgd", "adagrad", "rmsprop", "adamax", "nadam", "radam", "asgd",
                           "adadelta", "rprop")


def let_torch_optim_take(*types) -> None:
    """Makes torch.optim and `clip_grad_norm_` choose their foreach paths for these tensor types where they would
    for plain tensors (on CUDA by default), as torch does for its own DTensor; has torch.optim's elementwise
    optimizers default to their foreach path for DTensor parameters on every device; and has their multi-tensor
    updates run on the stacked components (see above)."""
    for supported in (optimizer._foreach_supported_types, torch.utils._foreach_utils._foreach_supported_types):
        supported.extend(t for t in types if t not in supported)
    optimizer.Optimizer._group_tensors_by_device_and_dtype = staticmethod(_grouped)
    for module in _MODULES:
        if getattr(module, "_default_to_fused_or_foreach", None) is optimizer._default_to_fused_or_foreach:
            module._default_to_fused_or_foreach = _default_path


def _elementwise_modules() -> list:
    modules = []
    for name in _ELEMENTWISE_OPTIMIZERS:
        try:
            modules.append(importlib.import_module(f"torch.optim.{name}"))
        except ImportError:  # (a torch without it)
            pass
    return modules


def _update_functions() -> dict:
    """The code of torch.optim's elementwise multi-tensor update functions -> whether it is a fused kernel's (which
    writes the gradients too: it unscales them in place under a GradScaler)."""
    return {function.__code__: function_name.startswith("_fused_")
            for module in _MODULES for function_name, function in vars(module).items()
            if inspect.isfunction(function) and function_name.startswith(("_multi_tensor_", "_fused_"))}


_MODULES = _elementwise_modules()
_UPDATES = _update_functions()


def _grouped(tensorlistlist, with_indices: bool = False):
    """torch.optim's grouping of an update's tensor lists, given the DTensors' stacked components where the update
    is elementwise and the lists line up."""
    if not torch.compiler.is_compiling():
        fused = _UPDATES.get(sys._getframe(1).f_code)
        if fused is not None:
            tensorlistlist = _stacked(tensorlistlist, fused) or tensorlistlist
    return _GROUP(tensorlistlist, with_indices)


def _default_path(params, differentiable: bool, use_fused: bool = False) -> tuple[bool, bool]:
    """torch's choice of an update path where the user names none (`foreach=None`), but foreach on every device for
    DTensor parameters: on CPU plain torch keeps its for-loop (its foreach kernels loop over the tensors anyway),
    which for DTensors is one dispatch per parameter and op, where the foreach update is one kernel call per op on
    the stacks."""
    fused, foreach = optimizer._default_to_fused_or_foreach(params, differentiable, use_fused)
    if not (fused or foreach or differentiable or torch.compiler.is_compiling()) and params \
            and all(isinstance(p, DTensor) for p in params):
        foreach = True
    return fused, foreach


def _stacked(lists, fused: bool):
    """`lists` (parameters, gradients, then state) with each DTensor replaced by its stacked components (pending
    reductions resolved), or None unless they line up: at each position every DTensor has the parameter's layout,
    shape and dtype, and a list without DTensors holds one plain scalar per parameter (steps, step sizes)."""
    params = lists[0]
    if not params or not isinstance(params[0], DTensor) or params[0]._layout.mesh.remote is not None:
        return None
    try:
        keys = list(map(_KEY, params))
    except AttributeError:  # plain tensors among the parameters
        return None
    if any(map(_PENDING, params)):
        return None
    stacks, tensors, their_stacks, written = [], [], [], []  # all lists; the DTensor lists and their stacks
    for i, values in enumerate(lists):
        if not values or _plain_scalars(values):  # (an empty list: no max_exp_avg_sqs without amsgrad)
            stacks.append(values)
            continue
        lined_up = _lined_up(values, params, keys)
        if lined_up is None:
            return None
        if i != 1 or fused:  # every list is written but the gradients, which a fused kernel unscales in place
            written.append(len(tensors))
        stacks.append(lined_up)
        tensors.append(values)
        their_stacks.append(lined_up)
    if stacks[0][0].shape[0] > 1:
        once_where_shared(their_stacks, written, tensors)
    return stacks


def _plain_scalars(values) -> bool:
    return all(type(v) is torch.Tensor and v.dim() == 0 for v in values)


def _lined_up(values, params, keys):
    """The stacked components of `values`, each laid out as the parameter at its position, or None."""
    if len(values) != len(params):
        return None
    try:
        if same_keys(list(map(_KEY, values)), keys):
            return None if any(map(_COPIED_VIEW, values)) else list(map(_STACK, values))
    except AttributeError:  # None (state not created yet) or plain tensors
        return None
    for value, param in zip(values, params):  # pending gradients (a contraction's, or a bucket's across clients)
        if value._layout != param._layout or value.shape != param.shape or value.dtype != param.dtype \
                or value._copied_view:
            return None
    return [value._local for value in values]
