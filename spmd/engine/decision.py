"""What a sharding rule sees (`OpCall`, `TensorSpec`) and what it decides (`Decision`): plain, frozen values.

A rule is a pure function of an `OpCall` — the op, its static arguments, and for each DTensor argument a
`TensorSpec` (per-axis mesh dims, global shape, dtype) — returning a `Decision`. It runs nothing: the
dispatcher and the planner execute decisions, so a cached or traced decision can be listed (`explain`) as well
as run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from spmd.collectives import Collective
from spmd.errors import UnsupportedOpError

Axes = tuple  # per tensor axis: a mesh dim name or None (a tuple of several only for rules registered multi_axis)


class TensorSpec(NamedTuple):
    axes: Axes
    shape: tuple[int, ...]
    dtype: torch.dtype
    pending: tuple = ()  # the mesh dims of a pending sum the tensor carries (see `Decision.keeps`)
    gradient: bool = False  # the pending sum was made by autograd's backward: a gradient on its way to its leaf

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class OpCall:
    func: Any
    args: tuple  # DTensors replaced by TensorSpec
    kwargs: dict
    mesh: Any
    num_local: int  # L, the stack size
    multi_axis: bool = False  # an input is sharded over several mesh dims: the rule sees its outer dims only

    @property
    def specs(self) -> list[TensorSpec]:
        """The TensorSpecs in the order the dispatcher numbers DTensor inputs (args, then kwargs, lists inline)."""
        out = []
        for a in list(self.args) + list(self.kwargs.values()):
            if isinstance(a, TensorSpec):
                out.append(a)
            elif isinstance(a, (list, tuple)):
                out.extend(x for x in a if isinstance(x, TensorSpec))
        return out

    def local_shape(self, spec_or_shape, axes: Axes) -> tuple[int, ...]:
        shape = spec_or_shape.shape if isinstance(spec_or_shape, TensorSpec) else spec_or_shape
        return tuple(s // self.shards(m) for s, m in zip(shape, axes))

    def shards(self, mesh_dim) -> int:
        """How many blocks an axis sharded over `mesh_dim` has (None: 1; a tuple of mesh dims: their product)."""
        return self.mesh.shard_count(mesh_dim)

    def describe(self) -> str:
        def part(a) -> str:
            if isinstance(a, TensorSpec):
                return f"{list(a.shape)}:{[m or 'unsharded' for m in a.axes]}"
            if isinstance(a, (list, tuple)):  # (index lists)
                return "[" + ", ".join(map(part, a)) + "]"
            return repr(a)
        return f"{self.func}({', '.join(map(part, self.args))})"


# (stacked local inputs, args, kwargs) -> local output(s); with declared collectives also a runner (see Decision)
Kernel = Callable[..., Any]


@dataclass(frozen=True)
class Decision:
    """A rule's decision, in the stages the dispatcher executes:

    1. `inputs`: the axes each DTensor input (flat order) must have; the planner relayouts inputs to them,
       resolving pending reductions on the way (`None`: any layout, pending reductions resolved).
    2. `kernel`: the local op on stacked components `(L, *local_shape)`. A kernel that needs collectives between
       its local steps (vocabulary-parallel softmax) declares them in `collectives` and receives a runner as
       fourth argument: `run(i, x)` executes `collectives[i]` on stacked components `x`.
    3. `reduce`: per output, the mesh dims whose components still have to be reduced with `reduce_op`. The
       output DTensor carries them as a pending reduction, resolved by whatever consumes it (an all-reduce, or a
       reduce-scatter when it is relayouted to a layout sharded over them) — at once when there is an epilogue.
    4. `epilogue`: a local step on the reduced outputs (addmm's bias, the mean of a loss).

    `outputs` are the axes of each output (`None` for a non-tensor result); `value_shaped`: their shapes depend on
    the values (`nonzero`), so the dispatcher reads them off each call's result instead of caching them.
    `inplace`: the op mutated input 0 and returns it. `rebinds`: an in-place view op (`squeeze_`): input 0 takes
    the output's components and layout.
    `keeps`: the inputs whose pending sum stays unresolved, because the kernel is linear in them (`a + b` of two
    sums over the same dims is their sum's sum; `reduce` then leaves the output pending) or does not read values
    (`ones_like`). `fixed`: the mesh dims whose coordinates or block sizes the kernel was built for (a vocabulary
    shard's first row, a bias's local shape): a blockwise rule's decision is run on finer blocks of the other mesh
    dims only (see engine/multi_axis.py).
    """
    inputs: tuple
    outputs: tuple
    kernel: Kernel
    collectives: tuple[Collective, ...] = ()
    reduce: tuple = ()
    reduce_op: str = "sum"
    epilogue: Callable | None = None
    inplace: bool = False
    rebinds: bool = False
    single: bool = True  # the op returns one tensor rather than a tuple
    keeps: tuple[int, ...] = ()
    copies: bool = False  # a view op whose result does not share the input's memory: in-place ops on it are refused
    writes: tuple[int, ...] = ()  # inputs the kernel writes beside an in-place target (a batch norm's running stats)
    fixed: tuple[str, ...] = ()
    value_shaped: bool = False


def written_arguments(func) -> frozenset[str]:
    """The names of the arguments `func` writes, as its schema's alias annotations say (`Tensor(a!)`)."""
    return frozenset(a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write)


def is_inplace(func) -> bool:
    """Whether `func` writes its first argument (`add_`, `copy_`, `masked_fill_`), as its schema says."""
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def returns_alias(func) -> bool:
    """Whether `func` returns a view of (or writes and returns) one of its inputs."""
    return any(r.alias_info is not None for r in func._schema.returns)


def unsupported(call: OpCall, why: str = "", *, any_layout: bool = False) -> UnsupportedOpError:
    """The error for an op spmd cannot run in the inputs' layouts (`any_layout`: in none of them)."""
    remedy = ("No layout of its inputs is supported: run it on plain tensors (spmd.to_global, then "
              "spmd.copy_to_mesh the result), or file an issue with this message." if any_layout else
              "Relayout the inputs (spmd.relayout) to a supported layout, or file an issue with this message.")
    return UnsupportedOpError(
        f"spmd has no sharding rule for {call.describe()} on mesh {call.mesh.dim_names}={call.mesh.shape()}"
        + (f": {why}" if why else "") + ". " + remedy)
