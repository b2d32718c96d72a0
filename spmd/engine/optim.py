"""torch.optim over DTensor parameters: its updates run on the stacked components, whichever path it takes.

torch.optim's updates come in three kinds: a for-loop over the parameters (`foreach=False`, plain torch's default on
CPU), multi-tensor kernels (`foreach=True`, its default on CUDA) and fused kernels (`fused=True`). Where every op of
an update is elementwise over the parameters (Adam, AdamW, SGD, Adagrad, RMSprop, Adamax, NAdam, RAdam, ASGD,
Adadelta, Rprop: all but Adafactor, which factors its second moment over rows and columns), spmd hands the update
the DTensors' stacked components instead: the for-loop is called with them in place of the tensor lists, and the
multi-tensor and fused updates get them from torch's own grouping of the lists by device and dtype. The update then
runs torch's own kernels on plain tensors: no DTensor dispatch per op and parameter, so its cost is plain torch's
over tensors of the stacks' size, and the path torch picks by default is the one it picks for plain tensors (but for
a controller mesh's parameters, which live on its workers: there the foreach update, one message per op). A value
replicated over some mesh dims is updated once per group of devices holding it (the for-loop and foreach paths, on
an in-process mesh, stacks of 64k elements or more): on the copies at coordinate 0 of those dims, then copied to the
others. Lists that do not line up (a gradient laid out unlike its parameter, state not created yet, a plain tensor
among DTensors) stay DTensors, and each op runs through the dispatcher (the multi-tensor ones through
engine/foreach.py).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import operator
import sys

import torch
import torch.utils._foreach_utils
from torch.optim import optimizer

from spmd.collectives.local import shared
from spmd.dtensor import DTensor
from spmd.engine.dispatch import distributed
from spmd.engine.foreach import once_where_shared, same_keys
from spmd.ops import relayout_op

_KEY, _STACK, _PENDING, _COPIED_VIEW = map(operator.attrgetter, ("_key", "_stack", "_pending", "_copied_view"))
_GROUP = optimizer.Optimizer._group_tensors_by_device_and_dtype  # torch's own grouping
_ELEMENTWISE_OPTIMIZERS = ("adam", "adamw", "sgd", "adagrad", "rmsprop", "adamax", "nadam", "radam", "asgd",
                           "adadelta", "rprop")


def let_torch_optim_take(*types) -> None:
    """Makes torch.optim and `clip_grad_norm_` choose their foreach paths for these tensor types where they would
    for plain tensors (on CUDA by default), as torch does for its own DTensor; and has the elementwise optimizers'
    updates run on the stacked components (see above)."""
    for supported in (optimizer._foreach_supported_types, torch.utils._foreach_utils._foreach_supported_types):
        supported.extend(t for t in types if t not in supported)
    optimizer.Optimizer._group_tensors_by_device_and_dtype = staticmethod(_grouped)
    optimizer.Optimizer._process_value_according_to_param_policy = staticmethod(_laid_out_like_the_parameter)
    for module in _MODULES:
        for name, function in list(vars(module).items()):
            if not inspect.isfunction(function) or hasattr(function, "_spmd_update"):
                continue
            if name.startswith("_single_tensor_"):
                traceable = _TRACEABLE_WITH_A_TENSOR_LR.get(name)
                setattr(module, name, _loop_on_stacks(function, traceable and getattr(module, traceable)))
            elif name.startswith("_multi_tensor_"):
                setattr(module, name, _copying_to_replicas(function))
        if getattr(module, "_default_to_fused_or_foreach", None) is optimizer._default_to_fused_or_foreach:
            module._default_to_fused_or_foreach = _default_path


_PROCESS = optimizer.Optimizer._process_value_according_to_param_policy  # torch's own


def _laid_out_like_the_parameter(param, value, *args, **kwargs):
    """`Optimizer.load_state_dict` for a DTensor parameter: each state tensor shaped like the parameter is laid out
    like it, as torch moves it to the parameter's device and dtype — a plain one (a single-device checkpoint) is
    distributed, a DTensor of another layout (an optimizer of a model laid out otherwise) relayouted on its mesh."""
    value = _PROCESS(param, value, *args, **kwargs)
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return value
    if type(value) is torch.Tensor:
        return distributed(value, param._layout)
    if isinstance(value, DTensor) and value._layout != param._layout and value._layout.mesh == param._layout.mesh:
        return relayout_op(value, param._layout.to_string())
    return value


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
            stacked = _stacked(tensorlistlist, fused)
            if stacked is not None:
                tensorlistlist, copies = stacked
                _AFTER_UPDATE.extend(copies)
    return _GROUP(tensorlistlist, with_indices)


def _default_path(params, differentiable: bool, use_fused: bool = False) -> tuple[bool, bool]:
    """torch's choice of an update path where the user names none (`foreach=None`), but the foreach update for
    the parameters of a controller mesh: their stacks live on its workers, so a for-loop could not run on them, and
    would send one op per parameter and element op where the foreach update sends one per op."""
    fused, foreach = optimizer._default_to_fused_or_foreach(params, differentiable, use_fused)
    if not (fused or foreach or differentiable or torch.compiler.is_compiling()) and params \
            and all(isinstance(p, DTensor) and p._layout.mesh.remote is not None for p in params):
        foreach = True
    return fused, foreach


# SGD's for-loop reads a tensor learning rate as a Python number (`alpha=-lr`), which a traced graph cannot; its
# multi-tensor update multiplies by the tensor instead, the same arithmetic (one product, one sum per element)
_TRACEABLE_WITH_A_TENSOR_LR = {"_single_tensor_sgd": "_multi_tensor_sgd"}


def _loop_on_stacks(loop, traceable=None):
    """torch's for-loop update `loop`, called with the stacked components in place of the leading tensor lists
    (parameters, gradients, state) where they line up; as it is otherwise, while Dynamo traces it, and while autograd
    records (`differentiable=True`, which SGD's loop is not told). While traced with a tensor learning rate,
    `traceable` (the multi-tensor update) runs in its place where the loop could not be traced."""
    @functools.wraps(loop)
    def on_stacks(*args, **kwargs):
        if traceable and isinstance(kwargs.get("lr"), torch.Tensor) and torch.compiler.is_compiling():
            return traceable(*args, **kwargs)
        copies = ()
        if not (torch.is_grad_enabled() or torch.compiler.is_compiling()):
            n = next((i for i, a in enumerate(args) if not isinstance(a, list)), len(args))
            stacked = _stacked(list(args[:n]), fused=False) if n else None
            if stacked is not None:
                stacks, copies = stacked
                args = (*stacks, *args[n:])
        out = loop(*args, **kwargs)
        _copy_to_replicas(copies)
        return out
    on_stacks._spmd_update = loop
    return on_stacks


def _copying_to_replicas(update):
    """torch's multi-tensor `update`, followed by the copies to replicas of what it updated once per group of
    devices holding the same values (see `_once_per_replica_group`; `_grouped` found them)."""
    @functools.wraps(update)
    def then_copy(*args, **kwargs):
        del _AFTER_UPDATE[:]
        try:
            out = update(*args, **kwargs)
            _copy_to_replicas(_AFTER_UPDATE)
            return out
        finally:
            del _AFTER_UPDATE[:]
    then_copy._spmd_update = update
    return then_copy


_AFTER_UPDATE: list = []  # the copies to replicas that the running multi-tensor update owes (see _grouped)


def _stacked(lists, fused: bool):
    """`lists` (parameters, gradients, then state) with each DTensor replaced by its stacked components (pending
    reductions resolved), and the copies to replicas owed once the update ran (see `_once_per_replica_group`); or
    None unless they line up: at each position every DTensor has the parameter's layout, shape and dtype, and a list
    without DTensors holds one plain scalar per parameter (steps, step sizes)."""
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
    copies = []
    if stacks[0][0].shape[0] > 1:
        once_where_shared(their_stacks, written, tensors)
        if not fused:  # (torch's fused kernels want whole tensors)
            copies = _once_per_replica_group(their_stacks, written, tensors)
    return stacks, copies


# the stacks' size from which updating one copy per group and copying it is faster than updating every copy: on
# smaller stacks the views and copies (a few µs each per tensor) cost more than the element work they save (the
# demo GPT's 108k parameters on 8 devices: +1 ms per AdamW step; a 2M-parameter MLP: 3.7x faster)
ONCE_PER_GROUP_MIN_ELEMENTS = 1 << 16


def _once_per_replica_group(stacks: list[list], written: list[int], tensors: list[list]) -> list:
    """At the positions whose value is replicated over some mesh dims yet held in each device's own memory (a
    parameter replicated over `batch` of a batch x model mesh, its gradient and state), the update runs on one copy
    per group of devices holding the same values: every list's stack there becomes a view of the copies at
    coordinate 0 of those mesh dims. Returns what the caller copies back to the other devices once the update ran
    (`_copy_to_replicas`): the written stacks as grids over the mesh, with the mesh dims to copy along. (An
    elementwise update of every device's copy would compute the same values once per device of the group.)"""
    copies = []
    for i, reference in enumerate(tensors[0]):
        if stacks[0][i].numel() < ONCE_PER_GROUP_MIN_ELEMENTS:
            continue
        mesh = reference._layout.mesh
        sharding = reference._layout.sharded_mesh_dims
        replicas = [a for a, (name, size) in enumerate(zip(mesh.dim_names, mesh.shape()))
                    if size > 1 and name not in sharding]
        if not replicas or not mesh.is_fully_local() or any(shared(s[i]) or len(s[i]) != mesh.size for s in stacks):
            continue  # (one copy shared by every device, or made so: once_where_shared's)
        grid_shape = tuple(mesh.shape())
        first = tuple(slice(0, 1) if a in replicas else slice(None) for a in range(len(grid_shape)))
        for j, s in enumerate(stacks):
            grid = s[i].view(grid_shape + tuple(s[i].shape[1:]))
            s[i] = grid[first]
            if j in written:
                copies.append((grid, replicas))
    return copies


def _copy_to_replicas(copies) -> None:
    """Each grid's copies at coordinate 0 of its replica mesh dims, copied to the other coordinates, dim by dim."""
    for grid, replicas in copies:
        for a in replicas:
            rest = grid.narrow(a, 1, grid.shape[a] - 1)
            rest.copy_(grid.narrow(a, 0, 1).expand_as(rest))


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
