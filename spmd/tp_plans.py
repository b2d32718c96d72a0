"""Tensor-parallel plans read as layouts: HuggingFace's `model.tp_plan` and torch's `parallelize_module` plans.

A plan names modules (or parameters) and a style: "colwise" shards a linear layer's output features, "rowwise" its
input features, "embedding_rowwise" a vocabulary. spmd needs no more than the parameters' layouts — an op's rule
decides its collectives from them, and a style's input and output handling (`colwise_gather_output`,
`rowwise_split_input`, `PrepareModuleInput`) is what the layouts imply anyway — so a plan becomes a `LayoutMap`.
Whatever the plan, results equal the model's on one device; a plan whose shardings fit the model's computation
(Megatron's pairs of column- and row-parallel layers) also costs the least.
"""

from __future__ import annotations

import re

from torch import nn

from spmd.layout import UNSHARDED
from spmd.nn import LayoutMap

# HuggingFace's style names (transformers' ParallelInterface) by the axis they shard
_COLUMNS = {"colwise", "colwise_rep", "colwise_gather_output", "packed_colwise"}
_ROWS = {"rowwise", "rowwise_rep", "rowwise_split_input", "packed_rowwise"}
_EXPERTS = {"grouped_gemm", "ep_dispatch_experts"}  # expert parallel: the experts' axis
_REPLICATED = {"sequence_parallel", "replicated_with_grad_allreduce", "all_reduce", "moe_tp_experts",
               "moe_identity_expert", "local_params", "replicate", "mla_kv_a_proj"}
_STYLES = {**{s: "colwise" for s in _COLUMNS}, **{s: "rowwise" for s in _ROWS}, **{s: "experts" for s in _EXPERTS},
           **{s: None for s in _REPLICATED}, "embedding_rowwise": "vocabulary", "embedding_colwise": "features"}
# torch.distributed.tensor.parallel's styles, by class name (read without importing torch.distributed)
_TORCH_STYLES = {"ColwiseParallel": "colwise", "RowwiseParallel": "rowwise", "SequenceParallel": None,
                 "PrepareModuleInput": None, "PrepareModuleOutput": None, "PrepareModuleInputOutput": None}


def layout_map_from_tp_plan(model: nn.Module, plan: dict | None = None, mesh_dim: str = "model") -> LayoutMap:
    """The `LayoutMap` of a tensor-parallel plan over `mesh_dim`, for `distribute_module(model, mesh, layout_map)`.

    `plan` maps module names (or parameter names) to styles; `*` in a name stands for one path component (a layer's
    index). Styles are HuggingFace's (`"colwise"`, `"rowwise"`, `"packed_colwise"`, `"embedding_rowwise"`, ...;
    default: the model's own `model.tp_plan`) or torch's `ColwiseParallel()` / `RowwiseParallel()` /
    `SequenceParallel()` / `PrepareModule*`. A column style shards the output features of the module's weights
    (axis -2 of a linear layer's `[out, in]` weight or of stacked experts' `[experts, out, in]`; axis 1 of an
    embedding) and its bias; a row style their input features (axis -1; axis 0 of an embedding, its vocabulary),
    leaving the bias replicated; expert-parallel styles the experts' axis 0 (then `spmd.expert_parallel` routes the
    tokens); the others leave parameters replicated. A style applies to the parameters of the module it names, not
    its submodules'; one naming a parameter applies to that parameter and wins over its module's.
    """
    if plan is None:
        plan = getattr(model, "tp_plan", None)
        if not plan:
            raise ValueError(f"{type(model).__name__} has no tensor-parallel plan (HuggingFace models have "
                             "`model.tp_plan`): pass plan={module name: style}")
    if not isinstance(plan, dict):
        raise TypeError(f"plan must be a dict of module names to styles, not {type(plan).__name__}")
    patterns = [(_pattern(key), _style(key, value)) for key, value in plan.items()]
    modules = dict(model.named_modules(remove_duplicate=False))
    layout_map = LayoutMap()
    for name, param in model.named_parameters(remove_duplicate=False):
        owner, _, _ = name.rpartition(".")
        found = _find(patterns, name) or _find(patterns, owner)
        axis = None if found is None else _axis(found[0], modules[owner], param.dim())
        if axis is not None:
            specs = [UNSHARDED] * param.dim()
            specs[axis] = mesh_dim
            layout_map["^" + re.escape(name) + "$"] = specs
    return layout_map


def _pattern(key: str) -> re.Pattern:
    if not isinstance(key, str):
        raise TypeError(f"plan keys are module names (str), not {key!r}")
    return re.compile("^" + r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in key.split(".")) + "$")


def _style(key: str, value) -> str | None:
    if isinstance(value, str):
        if value not in _STYLES:
            raise ValueError(f"plan[{key!r}] = {value!r} is not a tensor-parallel style spmd knows; known: "
                             f"{sorted(_STYLES)}")
        return _STYLES[value]
    cls = type(value)
    if cls.__module__.startswith("torch.distributed.tensor.parallel") and cls.__name__ in _TORCH_STYLES:
        return _TORCH_STYLES[cls.__name__]
    raise TypeError(f"plan[{key!r}] = {value!r}: a style is a HuggingFace style name or one of torch's "
                    f"{sorted(_TORCH_STYLES)}")


def _find(patterns, name: str) -> tuple | None:
    """(style,) of the last plan entry naming `name` exactly (HuggingFace's plans list general entries first)."""
    found = None
    for pattern, style in patterns:
        if pattern.match(name):
            found = (style,)
    return found


def _axis(style: str | None, module: nn.Module, rank: int) -> int | None:
    """The axis of a parameter of `rank` that `style` shards, on `module` (its owner), or None."""
    if style is None or rank == 0:
        return None
    if isinstance(module, nn.Embedding) and style in ("colwise", "rowwise"):  # torch's styles on an embedding
        style = "features" if style == "colwise" else "vocabulary"
    if style == "colwise":
        return rank - 2 if rank >= 2 else 0  # a weight's output features; a bias
    if style == "rowwise":
        return rank - 1 if rank >= 2 else None  # the bias of a row-parallel layer is added once, replicated
    return {"vocabulary": 0, "features": rank - 1, "experts": 0}[style]


__all__ = ["layout_map_from_tp_plan"]
