"""Ops whose result's shape depends on the values: `nonzero` (`argwhere`, one-argument `where`), indexing by a
boolean mask (`x[mask]`), `masked_select`, `unique` and `unique_consecutive`, `bincount`, and `repeat_interleave`
by a tensor of counts (torch tags them `dynamic_output_shape`).

Why the rule holds: the length of such a result depends on values anywhere in the tensor, so it has no even blocks
to shard over a mesh dim (a device's part of `x[mask]` is as long as its block has true entries). Every operand is
made replicated (an all-gather of each sharded one, which `explain` lists) and each device computes the whole
result, replicated — once for all the devices of this process. Every client of a multi-client mesh computes it from
the same values, so all agree on its shape. The outputs' shapes are read off each call's result, never cached.
A graph that `spmd.function` traces breaks at these ops, as torch.compile's graphs do at them on plain tensors: they
run eagerly between two compiled graphs. A single-controller mesh's session runs them on its workers, which tell it
the results' shapes (`shaped_by_values` names them).
"""

from __future__ import annotations

import torch
from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_tensor import DynamicOutputShapeException
from torch.utils._python_dispatch import _disable_current_modes

from spmd.collectives.local import share, traced
from spmd.engine.decision import Decision, OpCall, unsupported
from spmd.engine.registry import register
from spmd.engine.rules.common import generic_kernel, replace_tensors

aten = torch.ops.aten
_OPS = (aten.nonzero.default, aten.masked_select.default, aten._unique.default, aten._unique2.default,
        aten.unique_consecutive.default, aten.unique_dim.default, aten.bincount.default, aten.repeat_interleave.Tensor)
_MASKS = (torch.bool, torch.uint8)


def masked(indices) -> bool:
    """Whether advanced indices (tensors, their TensorSpecs, or None) hold a boolean mask."""
    return any(t is not None and t.dtype in _MASKS for t in indices)


def shaped_by_values(func, args) -> bool:
    """Whether `func(*args)` is one of these ops: its results' shapes depend on the values."""
    return func in _OPS or (func is aten.index.Tensor and masked(args[1]))


@register(*_OPS)
def value_shaped_rule(call: OpCall) -> Decision:
    """Operands replicated; the op runs once on one device's (whole) components and every device holds its
    result."""
    if call.mesh.torch_device.type == "meta":  # the shadows of a single-controller mesh (its session runs these
        raise unsupported(call, "its result's shape depends on the values, which only the workers of a "  # ops)
                                "single-controller mesh hold")
    ranks = _output_ranks(call)
    local = generic_kernel(call.func)
    single = len(call.func._schema.returns) == 1

    def on_every_device(out: torch.Tensor) -> torch.Tensor:
        return share(out.unsqueeze(0), call.num_local)

    def kernel(locals_, args, kwargs):
        if any(traced(x) for x in locals_):  # Dynamo breaks the graph here (the rules take no symbolic sizes)
            raise DynamicOutputShapeException(call.func)
        out = local([x[0] for x in locals_], args, kwargs)
        return on_every_device(out) if single else tuple(on_every_device(o) for o in out)
    return Decision(tuple((None,) * s.rank for s in call.specs), tuple((None,) * r for r in ranks), kernel,
                    single=single, value_shaped=True)


def _output_ranks(call: OpCall) -> list[int]:
    """The rank of each result. Ranks depend on neither sizes nor values, and these ops have no meta kernels: they
    are read off the op run on one-element zeros of the arguments' ranks and dtypes (torch's argument checks run
    too, and raise torch's errors)."""
    with _disable_current_modes(), no_python_dispatcher():  # (inside a trace: plain tensors, run as eagerly)
        zeros = [torch.zeros((1,) * s.rank, dtype=s.dtype) for s in call.specs]
        args, kwargs = replace_tensors(call.args, call.kwargs, zeros)
        kwargs.pop("output_size", None)  # (repeat_interleave's: a count that the zeros do not add up to)
        out = call.func(*args, **kwargs)
    return [o.dim() for o in (out if isinstance(out, (tuple, list)) else (out,))]
