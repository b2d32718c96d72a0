"""The replicated fallback: an op without a sharding rule runs on replicated inputs — each sharded input gathered,
the op run once and its result shared by every device — where that is safe (it writes nothing and draws no random
numbers); otherwise a named error. Correct but slow, so each op that takes it warns once and
`spmd.cache_stats()['fallbacks']` lists them. An op whose result's shape depends on the values gathers its sharded
operands too, and warns once (`warn_gathered`).
"""

from __future__ import annotations

import warnings

import torch

from spmd.engine.decision import Decision, OpCall, TensorSpec, returns_alias, unsupported
from spmd.engine.rules.common import generic_kernel, replace_tensors

FELL_BACK: set = set()  # ops that ran through the replicated fallback (each warned about once)


def fallback_decision(call: OpCall) -> Decision:
    """An op without a rule runs once on replicated inputs, if that is safe; else a named error."""
    func = call.func
    schema = func._schema
    if schema.is_mutable or torch.Tag.nondeterministic_seeded in func.tags:
        raise unsupported(call, "it mutates its inputs or draws random numbers, so it cannot run replicated",
                          any_layout=True)
    if not schema.returns or any(str(r.type) != "Tensor" for r in schema.returns):
        raise unsupported(call, "its outputs are not plain tensors", any_layout=True)
    out, value_shaped = _output_probe(call, _meta), False
    if out is None:  # no meta kernel: the outputs' ranks from a run on small stand-ins, the shapes from each result
        out, value_shaped = _output_probe(call, _sample), True
    single = len(schema.returns) == 1
    outs = (out,) if single else tuple(out)
    if func not in FELL_BACK:
        FELL_BACK.add(func)
        warnings.warn(f"spmd: no sharding rule for {func}; running it on replicated inputs (this gathers "
                      "sharded inputs on every device)", stacklevel=4)
    local = generic_kernel(func)
    n = call.num_local

    def kernel(locals_, args, kwargs):  # run on component 0 and broadcast: the components are identical
        res = local([x[0] for x in locals_], args, kwargs)
        res = (res,) if single else tuple(res)
        res = tuple(None if r is None else r.unsqueeze(0).expand((n,) + tuple(r.shape)).contiguous() for r in res)
        return res[0] if single else res

    # a view op computed this way returns a copy: an in-place op on it must be refused, not lost
    is_view = returns_alias(func)
    return Decision(tuple(tuple([None] * len(s.shape)) for s in call.specs),
                    tuple(None if o is None else (None,) * o.dim() for o in outs), kernel, single=single,
                    copies=is_view, value_shaped=value_shaped)  # a backward op's unneeded gradients are None


def _output_probe(call: OpCall, stand_in):
    """The op's outputs on `stand_in(spec)` for each DTensor input (meta tensors, or where torch has no meta
    kernel, real ones), or None where it has no meta kernel."""
    args, kwargs = replace_tensors(call.args, call.kwargs, [stand_in(s) for s in call.specs])
    try:
        return call.func(*args, **kwargs)
    except Exception as e:
        if stand_in is _meta:
            return None
        raise unsupported(call, f"it has no meta implementation, nor runs on sample inputs ({type(e).__name__}: {e})",
                          any_layout=True) from None


def _meta(spec: TensorSpec) -> torch.Tensor:
    return torch.empty(spec.shape, dtype=spec.dtype, device="meta")


def _sample(spec: TensorSpec) -> torch.Tensor:
    """A real stand-in: random floats (a matrix of full rank, for a solver), ones otherwise (a length, a count)."""
    if spec.dtype.is_floating_point or spec.dtype.is_complex:
        return torch.randn(spec.shape, dtype=spec.dtype, generator=torch.Generator().manual_seed(0))
    return torch.ones(spec.shape, dtype=spec.dtype)


_GATHERED: set = set()  # value-shaped ops that gathered sharded operands (each warned about once)


def warn_gathered(func) -> None:
    """Warns once per op that an op shaped by the values (engine/rules/value_shaped.py) gathered sharded
    operands."""
    if func not in _GATHERED:
        _GATHERED.add(func)
        warnings.warn(f"spmd: the shape of {func}'s result depends on the values, so its sharded operands are "
                      "gathered on every device (an all-gather each); a masked op (torch.where, masked_fill, a "
                      "loss's ignore_index) keeps them sharded", stacklevel=5)
