"""Sharding rules for one's own ops: `register_sharding(op, "b s h, h -> b s h")`.

An op spmd has no rule for (a `torch.library` custom op: a Triton kernel, a C++ extension) runs replicated, its
sharded inputs gathered on every device. `register_sharding` declares how it shards instead, in the einsum-like
notation of JAX's `custom_partitioning` and Shardy: one term per tensor argument and per result, a factor name per
axis, the same name where the axes correspond. From the inputs' layouts spmd then picks a mesh dim for each
factor, relayouts the inputs to it and calls the op on each device's components.

Why that holds: a factor every result has is one the op maps blockwise (a block of a result needs only the same
block of each input), so any sharding of it may stay. A factor a result lacks is one the op reduces over for that
result: gathered, unless declared among `reduction_factors` (the op sums over it, so each device's result is a
partial sum, left pending like a matrix product's). `need_replication_factors` are gathered even so (the op mixes
their elements: a norm over them, a sort along them).

Choosing the mesh dims: inputs earlier in the rule, and axes earlier in an input, win — a factor takes the first
mesh dim an input shards it over that no earlier factor took; the other inputs are relayouted to it. An argument
the op writes (`Tensor(a!)`) is a result too, which keeps its layout: it chooses first, a factor it holds whole
stays whole, and one it lacks cannot leave a partial sum in it. Where the rule still needs it in another layout (a
factor to gather), the op writes a relayouted copy, whose values the dispatcher relayouts back into it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch.utils import _pytree as pytree

from spmd.collectives.local import traced
from spmd.engine import dispatch, registry
from spmd.engine.decision import Decision, OpCall, TensorSpec, is_inplace, returns_alias, written_arguments
from spmd.engine.rules.common import generic_kernel, per_device
from spmd.mesh import axis_dims

_ELLIPSIS = "..."


class _Term(NamedTuple):
    """One operand or result of a rule: its factor names, after any number of leading axes (`...`)."""
    ellipsis: bool
    factors: tuple[str, ...]

    def __str__(self) -> str:
        return " ".join(((_ELLIPSIS,) if self.ellipsis else ()) + self.factors)


class _Rule(NamedTuple):
    operands: tuple[_Term, ...]
    results: tuple[_Term, ...]
    text: str


def register_sharding(op, sharding_rule: str | Callable[..., str] | None = None, *,
                      reduction_factors: tuple[str, ...] = (), need_replication_factors: tuple[str, ...] = ()):
    """Declares how `op` (a `torch.library` op: `torch.ops.ns.name`, one overload, or what
    `@torch.library.custom_op` returns) shards, so that spmd runs it where the data is instead of replicated.

    `sharding_rule` names a factor per axis: `"b s h, h -> b s h"` for an op of an activation and a weight. One
    comma-separated term per tensor argument of the op's schema, in order (an optional one given `None` is
    skipped), `->`, one per result; an empty term is a 0-d tensor, and a leading `...` stands for any number of
    leading axes, broadcast as in torch (size 1 against n). When every term has `...`, the op is called once on
    all of a process's devices' components (their stack is one more leading axis); otherwise once per device.
    `reduction_factors`: factors the op sums over (for the results that lack them) — they may stay sharded, those
    results then hold partial sums (pending, resolved by whatever reads them). A factor a result lacks and that is
    not among them is gathered; so are `need_replication_factors` (a norm's, a sort's axis).

    A callable instead of the string decides the rule per call from the op's arguments (DTensors given as meta
    tensors of their global shapes), e.g. from a `dim` argument; called without a rule, `register_sharding(op)`
    decorates that callable. The rule is a promise about the op: spmd checks the shapes it implies, not the math.
    An op writing some of its arguments names them in its terms like the others (and has no result term for
    them): they keep their layouts (the other inputs are relayouted to them; where the rule needs one gathered, it
    is written through a relayouted copy, relayouted back after).
    Register before the op first runs on DTensors in a traced `spmd.function` (a compiled graph keeps what it was
    traced with); an op can have one rule (spmd's ops have theirs).
    """
    if sharding_rule is None:
        def decorate(rule: Callable[..., str]) -> Callable[..., str]:
            register_sharding(op, rule, reduction_factors=reduction_factors,
                              need_replication_factors=need_replication_factors)
            return rule
        return decorate
    overloads = _overloads(op)
    static = None if callable(sharding_rule) else _parse(sharding_rule, op)
    if static is not None:
        _check_factor_names(static, reduction_factors, need_replication_factors)
    for overload in overloads:
        _check_op(overload)

    def decide(call: OpCall) -> Decision:
        rule = static if static is not None else _parse(_rule_text(sharding_rule, call), call.func)
        return _decide(call, rule, frozenset(reduction_factors), frozenset(need_replication_factors))

    # (a rule string reads no float argument: a scale that changes between calls reuses the decision)
    registry.register(*overloads, floats_at_run_time=static is not None, blockwise=True)(decide)
    for overload in overloads:
        dispatch.forget(overload)
    return op


def _overloads(op) -> list:
    op = getattr(op, "_opoverload", op)  # `@torch.library.custom_op`'s CustomOpDef
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    if isinstance(op, torch._ops.OpOverload):
        return [op]
    raise TypeError(f"register_sharding takes a torch.library op (torch.ops.<namespace>.<name>, one of its "
                    f"overloads, or a @torch.library.custom_op), not {type(op).__name__} {op!r}. For a Python "
                    "function, run it on each device's components with spmd.local_map")


def _check_op(op) -> None:
    schema = op._schema
    if registry.lookup(op) is not None:
        raise ValueError(f"{op} already has a sharding rule; an op has one rule")
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        raise ValueError(f"{op} is implemented by other ops (CompositeImplicitAutograd), which spmd shards one by "
                         "one: it needs no rule")
    if any(_is_tensor_list(a.type) for a in schema.arguments):
        raise ValueError(f"{op} takes a list of tensors ({schema}); a sharding rule names each tensor argument")
    returns_tensors = all(isinstance(r.type, torch.TensorType) for r in schema.returns)
    if not returns_tensors or not (schema.returns or schema.is_mutable):
        raise ValueError(f"{op} returns more than tensors ({schema}); a sharding rule describes tensor results")
    if returns_alias(op) and not _returns_its_target(schema):
        raise ValueError(f"{op} returns a view of an argument ({schema}); a sharding rule describes new results "
                         "(or an op writing its first argument and returning it, as torch's in-place ops do)")


def _returns_its_target(schema) -> bool:
    """Whether the op writes its first argument and returns it alone, as torch's in-place ops do."""
    target = schema.arguments[0].alias_info if schema.arguments else None
    result = schema.returns[0].alias_info if len(schema.returns) == 1 else None
    return target is not None and target.is_write and result is not None and result.before_set == target.before_set


def _is_tensor_list(t) -> bool:
    return isinstance(t, torch.ListType) and isinstance(t.getElementType(), (torch.TensorType, torch.OptionalType))


def _parse(text: str, op) -> _Rule:
    if not isinstance(text, str) or text.count("->") != 1:
        raise ValueError(f"sharding rule of {op}: {text!r} is not 'operands -> results' (e.g. 'b s h, h -> b s h')")
    left, right = text.split("->")
    results = right.split(",") if right.strip() else ()  # (nothing: an op that only writes its arguments)
    return _Rule(tuple(_term(t, text, op) for t in left.split(",")), tuple(_term(t, text, op) for t in results), text)


def _term(text: str, rule: str, op) -> _Term:
    names = text.split()
    ellipsis = bool(names) and names[0] == _ELLIPSIS
    factors = tuple(names[1:] if ellipsis else names)
    bad = [f for f in factors if not f.isidentifier()]
    if bad or len(set(factors)) != len(factors):
        why = f"{bad[0]!r} is not a factor name (letters, digits, _; '...' only first)" if bad else \
            "a factor names one axis of a term"
        raise ValueError(f"sharding rule of {op}: {rule!r}, term {text.strip()!r}: {why}")
    return _Term(ellipsis, factors)


def _check_factor_names(rule: _Rule, reduction: tuple, replicated: tuple) -> None:
    in_results = [set(t.factors) for t in rule.results]
    in_operands = {f for t in rule.operands for f in t.factors}
    for f in reduction:
        if f not in in_operands or all(f in r for r in in_results):
            raise ValueError(f"reduction factor {f!r} of {rule.text!r}: a reduction factor is one of the operands' "
                             "factors that a result lacks (the op sums over it for that result)")
    for f in replicated:
        if f not in in_operands.union(*in_results):
            raise ValueError(f"need_replication factor {f!r} is not in the rule {rule.text!r}")


def _rule_text(rule: Callable, call: OpCall) -> str:
    def meta(a):
        return torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, TensorSpec) else a
    args, kwargs = pytree.tree_map(meta, (call.args, call.kwargs), is_leaf=lambda a: isinstance(a, TensorSpec))
    return rule(*args, **kwargs)


class _Operand(NamedTuple):
    position: int  # of its term in the rule
    name: str  # of its argument in the op's schema
    spec: TensorSpec
    term: _Term
    factors: tuple[str, ...]  # per axis (a `...` axis named by its place from the right: '...0' the last)

    @property
    def ellipsis_rank(self) -> int:
        return len(self.factors) - len(self.term.factors)


def _operands(call: OpCall, rule: _Rule) -> list[_Operand]:
    """The op's DTensor arguments with their terms, in the dispatcher's order (positional, then keyword)."""
    tensor_args = []  # (name, TensorSpec or None) per tensor argument of the schema, in order
    for i, a in enumerate(call.func._schema.arguments):
        t = a.type.getElementType() if isinstance(a.type, torch.OptionalType) else a.type
        if isinstance(t, torch.TensorType):
            value = call.args[i] if i < len(call.args) else call.kwargs.get(a.name)
            tensor_args.append((a.name, value if isinstance(value, TensorSpec) else None))
    if len(tensor_args) != len(rule.operands):
        raise ValueError(f"sharding rule {rule.text!r} of {call.func} has {len(rule.operands)} operand term(s); the "
                         f"op has {len(tensor_args)} tensor argument(s): {', '.join(n for n, _ in tensor_args)}")
    given = []
    for position, ((name, spec), term) in enumerate(zip(tensor_args, rule.operands)):
        if spec is None:
            continue
        extra = spec.rank - len(term.factors)
        if extra < 0 or (extra and not term.ellipsis):
            raise ValueError(f"sharding rule {rule.text!r} of {call.func}: argument {name!r} has shape "
                             f"{list(spec.shape)}, the term {str(term)!r} names {len(term.factors)} axes")
        given.append(_Operand(position, name, spec, term, _ellipsis_factors(extra) + term.factors))
    return [next(g for g in given if g.spec is spec) for spec in call.specs]


def _ellipsis_factors(n: int) -> tuple[str, ...]:
    return tuple(f"{_ELLIPSIS}{n - 1 - j}" for j in range(n))


def _sizes(call: OpCall, operands: list[_Operand], rule: _Rule) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for o in operands:
        for f, n in zip(o.factors, o.spec.shape):
            have = sizes.setdefault(f, n)
            if have == n or (f.startswith(_ELLIPSIS) and 1 in (have, n)):
                sizes[f] = max(have, n)
                continue
            shapes = ", ".join(str(list(o.spec.shape)) for o in operands)
            raise ValueError(f"sharding rule {rule.text!r} of {call.func}: factor {f!r} is {have} and {n} long in "
                             f"arguments of shapes {shapes}")
    return sizes


def _decide(call: OpCall, rule: _Rule, reduction: frozenset, replicated: frozenset) -> Decision:
    operands = _operands(call, rule)
    if len(rule.results) != len(call.func._schema.returns):
        raise ValueError(f"sharding rule {rule.text!r} of {call.func} has {len(rule.results)} result term(s); the "
                         f"op returns {len(call.func._schema.returns)}")
    sizes = _sizes(call, operands, rule)
    ellipsis_rank = max((o.ellipsis_rank for o in operands), default=0)
    results = [_ellipsis_factors(ellipsis_rank if t.ellipsis else 0) + t.factors for t in rule.results]
    # an argument the op writes is a result too, whose layout cannot change: it chooses its factors' mesh dims
    # first (the dispatcher refuses a decision that would relayout it), and a sum it lacks cannot stay pending
    written = written_arguments(call.func)
    outcomes = results + [o.factors for o in operands if o.name in written]
    # a factor may stay sharded where every result has it (blockwise), or the others sum over it
    in_every_result = set.intersection(*map(set, outcomes)) if outcomes else set()
    summable = {f for f in reduction if all(f in o.factors for o in operands if o.name in written)}
    mesh_dim_of: dict[str, str | tuple | None] = {}  # (a tuple: a written multi-axis target's mesh dims)
    taken: set[str] = set()
    for o in sorted(operands, key=lambda o: (o.name not in written, o.position)):  # else the rule's order decides
        for m, f, n in zip(o.spec.axes, o.factors, o.spec.shape):
            if m is None and o.name in written and n == sizes[f]:
                mesh_dim_of.setdefault(f, None)  # (stays unsharded: the written argument holds it whole)
            elif m is not None and (f in in_every_result or f in summable) and f not in replicated and \
                    f not in mesh_dim_of and n == sizes[f] and taken.isdisjoint(axis_dims(m)):
                mesh_dim_of[f] = m
                taken.update(axis_dims(m))
    inputs = tuple(tuple(mesh_dim_of.get(f) if n == sizes[f] else None for f, n in zip(o.factors, o.spec.shape))
                   for o in operands)
    outputs = tuple(tuple(mesh_dim_of.get(f) for f in r) for r in results)
    summed = tuple(tuple(d for f in sorted(reduction) if f in mesh_dim_of and f not in r
                         for d in axis_dims(mesh_dim_of[f])) for r in results)
    inplace = is_inplace(call.func) and returns_alias(call.func)
    kernel = _kernel(call, rule, operands, results, ellipsis_rank,
                     tuple(j for j, o in enumerate(operands) if o.name in written), inplace)
    return Decision(inputs, outputs, kernel, reduce=summed if any(summed) else (), single=len(results) == 1,
                    inplace=inplace)


def _kernel(call: OpCall, rule: _Rule, operands: list[_Operand], results: list, ellipsis_rank: int,
            written: tuple[int, ...], inplace: bool):
    """Calls the op on the components (once on the stacks where every term has `...`), checking once that the
    results have the local shapes the rule implies. An op writing its arguments (`written`: their positions among
    `operands`) writes the components; its kernel returns no results (`()`), or its target's components when it
    returns its target."""
    func = call.func
    if all(t.ellipsis for t in rule.operands + rule.results):
        # the stack's axis is one more leading axis; shorter `...`s right-aligned by axes of 1 after it
        pads = tuple((ellipsis_rank - o.ellipsis_rank) or None for o in operands)
        run = generic_kernel(func, pads=pads if any(pads) else None)
    else:
        def run(locals_, args, kwargs):
            copied = written if written and traced(locals_[0]) else ()
            return per_device(func, locals_, args, kwargs, len(locals_[0]), copied)
    checked = []

    def kernel(locals_, args, kwargs):
        out = run(locals_, args, kwargs)
        if inplace or not results:
            return locals_[0] if inplace else ()
        if not checked:
            _check_result_shapes(call, rule, operands, results, locals_, (out,) if len(results) == 1 else out)
            checked.append(True)
        return out
    return kernel


def _check_result_shapes(call, rule, operands, results, locals_, outs) -> None:
    """Each result axis of a factor some input has must be as long locally as that input's axis (skipping the
    stack's leading axis)."""
    local_size = {}
    for o, x in zip(operands, locals_):
        for f, n in zip(o.factors, x.shape[-len(o.factors):] if o.factors else ()):
            if n != 1 or f not in local_size:
                local_size[f] = n
    for i, (names, out) in enumerate(zip(results, outs)):
        want = [local_size.get(f) for f in names]
        got = list(out.shape[1:])
        if len(got) != len(want) or any(w is not None and w != g for w, g in zip(want, got)):
            raise ValueError(
                f"sharding rule {rule.text!r} of {call.func}: result {i} has shape {got} on each device, the rule "
                f"implies {[w if w is not None else '?' for w in want]} (factors {' '.join(names)}): the rule does "
                "not describe the op")
