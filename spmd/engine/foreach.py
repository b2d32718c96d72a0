"""`torch._foreach_*` ops (what `torch.optim` runs with `foreach=True`) on lists of DTensors.

Each foreach op is the element op applied pairwise over its list arguments, so spmd runs the element op per
position through the ordinary dispatcher: every element keeps its own layout and sharding rule.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def is_foreach(func) -> bool:
    return func._schema.name.startswith("aten::_foreach_")


_ELEMENT_NAMES = {"norm": "linalg_vector_norm"}  # `_foreach_norm(ord, dtype)` has linalg's signature


def _element_op(func):
    name = func._schema.name[len("aten::_foreach_"):]
    return getattr(aten, _ELEMENT_NAMES.get(name, name))  # a packet: overloads resolve from the arguments


def run(func, args, kwargs):
    """Applies the element op of `func` at every position of its list arguments; in-place ops return None."""
    op = _element_op(func)
    n = len(args[0])

    def pick(a, i):
        if isinstance(a, (list, tuple)) and len(a) == n:
            return a[i]
        if isinstance(a, torch.Tensor) and not hasattr(a, "_layout") and a.dim() == 1 and a.numel() == n:
            return a[i].item()  # a tensor of per-element scalars (e.g. `_foreach_addcdiv_.Tensor`)
        return a

    # foreach ops pass some scalars positionally that the element op takes as keywords (addcmul_'s `value`)
    schema = getattr(op, op.overloads()[0])._schema
    n_positional = sum(not a.kwarg_only for a in schema.arguments)
    keyword_names = [a.name for a in schema.arguments if a.kwarg_only]
    extra = dict(zip(keyword_names, args[n_positional:]))
    results = []
    for i in range(n):
        element_kwargs = {k: pick(v, i) for k, v in {**extra, **kwargs}.items()}
        results.append(op(*[pick(a, i) for a in args[:n_positional]], **element_kwargs))
    return None if not func._schema.returns else results
