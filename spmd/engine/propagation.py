"""Layout constraints propagated backwards over a traced graph, before the graph is expanded op by op.

The dispatcher chooses layouts forwards: an op sees its inputs' layouts, never what a later `relayout` wants. In
`spmd.function`, Dynamo's graph is known whole first, so a constraint can move back to where it is cheaper. This
pass moves each `spmd::relayout` back over the elementwise ops that produce its input — `relayout(gelu(a + b), L)`
becomes `relayout(gelu(relayout(a, La) + relayout(b, Lb)), L)` — where that adds no data movement: every new
relayout only keeps a block of its input (a local slice, no traffic), and none sits where a gradient flows back
unless it turns a pending sum into a reduce-scatter (see `_backward_costs_nothing`). What it saves:
the elementwise ops compute on blocks instead of whole values, and a pending sum left by a contraction (`x @ w`
over a sharded contraction axis) meets the slice first, so it is one reduce-scatter instead of an all-reduce
and a slice (sequence parallelism's pattern, `relayout(x @ w + bias, sharded)`).

The original relayout stays in place (a copy when its input already has the layout), so the function's
results have exactly the layouts asked for whatever the pass did.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from spmd.collectives import Kind
from spmd.dtensor import is_dtensor
from spmd.engine import planner
from spmd.layout import Layout
from spmd.ops import parse_layout

_RELAYOUT = torch.ops.spmd.relayout.default

# elementwise (broadcasting) functions as Dynamo records them: the result's axis i depends only on axis i of each
# (broadcast) input, so slicing the inputs slices the result
_ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.abs, torch.exp, torch.tanh, torch.sigmoid,
    torch.relu, torch.square, torch.sqrt, torch.rsqrt, torch.sin, torch.cos, torch.where,
    F.gelu, F.relu, F.silu, F.sigmoid, F.tanh, torch._C._nn.gelu, torch._C._nn.silu,
}
_ELEMENTWISE_METHODS = {"add", "sub", "mul", "div", "neg", "pow", "abs", "exp", "tanh", "sigmoid", "relu", "square",
                        "sqrt", "rsqrt", "sin", "cos"}
# the elementwise ops that keep a sum of pending sums one pending sum (`x @ w + y @ v` is reduced once), and those
# that keep a pending sum scaled by a number one
_SUMS = {operator.add, operator.sub, torch.add, torch.sub, "add", "sub"}
_SCALINGS = {operator.mul, operator.truediv, operator.neg, torch.mul, torch.div, torch.neg, "mul", "div", "neg"}


def hoist_relayouts(gm: torch.fx.GraphModule) -> int:
    """Moves `spmd::relayout` constraints back over elementwise producers (see the module docstring); returns how
    many constraints moved."""
    graph, moved = gm.graph, 0
    for constraint in [n for n in graph.nodes if n.op == "call_function" and n.target is _RELAYOUT]:
        producer = constraint.args[0]
        if not _movable(producer):
            continue
        leaves = _leaves(producer, parse_layout(constraint.args[1]))
        if not leaves or not _backward_costs_nothing(leaves):
            continue
        for consumer, arg, layout in leaves:
            with graph.inserting_before(consumer):
                new = graph.call_function(_RELAYOUT, (arg, layout.to_string()))
            new.meta["example_value"] = arg.meta["example_value"]
            consumer.replace_input_with(arg, new)
        moved += 1
    if moved:
        graph.lint()
        gm.recompile()
    return moved


def _movable(node) -> bool:
    """An elementwise op whose only consumer is the constraint: computing it in another layout changes nothing
    else."""
    return _is_elementwise(node) and len(node.users) == 1


def _leaves(producer, layout: Layout):
    """Where the relayouts go so that `producer` computes in `layout`: (consumer, input, layout) triples, as far
    back over single-use elementwise ops as the constraint moves without moving data; None if it cannot move."""
    moves = _input_relayouts(producer, layout)
    if moves is None:
        return None
    leaves = []
    for arg, want in moves:
        # (not into a sum of pending sums: the constraint there is ONE reduce-scatter, one per summand below it)
        deeper = _leaves(arg, want) if _movable(arg) and not _sums_pending_sums(arg) else None
        leaves += deeper if deeper is not None else [(producer, arg, want)]
    return leaves


def _backward_costs_nothing(leaves) -> bool:
    # a slice's backward is an all-gather where the gradient arrives sharded; the constraint's own backward was
    # one, unless the gradient arrives replicated (then moving the slice adds it). A sum the slice turns into a
    # reduce-scatter pays for it: an all-reduce moves what a reduce-scatter and an all-gather do.
    with_grad = [arg for _, arg, _ in leaves if arg.meta["example_value"].requires_grad]
    return not with_grad or (len(with_grad) == 1 and _leaves_pending_sum(with_grad[0]))


def _is_elementwise(node) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_function":
        return node.target in _ELEMENTWISE_FUNCTIONS
    return node.op == "call_method" and node.target in _ELEMENTWISE_METHODS


def _input_relayouts(producer, layout: Layout):
    """The (input node, its layout) pairs that make `producer` compute in `layout`, or None where moving the
    constraint would move data."""
    out = producer.meta.get("example_value")
    if not is_dtensor(out) or out._layout.mesh != layout.mesh:
        return None
    moves = []
    for arg in producer.all_input_nodes:
        value = arg.meta.get("example_value")
        if not is_dtensor(value):
            if isinstance(value, torch.Tensor) and value.dim():
                return None  # a plain tensor made inside the function: its layout is chosen by the op, not here
            continue
        offset = out.dim() - value.dim()
        want = tuple(None if value.shape[i] != out.shape[i + offset] else layout.axes[i + offset]
                     for i in range(value.dim()))
        have = value._layout.axes
        if want == have:
            continue
        if any(s.kind is not Kind.SHARD for s in planner.plan_on(layout.mesh, have, want)):
            return None
        moves.append((arg, Layout.from_axes(want, layout.mesh)))
    return moves


def _sums_pending_sums(node) -> bool:
    """Whether `node` adds (or subtracts) pending sums: its result is one pending sum."""
    summands = _dtensor_inputs(node)
    return node.target in _SUMS and len(summands) > 1 and all(map(_leaves_pending_sum, summands))


def _scales_a_pending_sum(node) -> bool:
    """Whether `node` multiplies (or divides) a pending sum by a number, or negates it."""
    if node.target not in _SCALINGS or len(_dtensor_inputs(node)) != 1 or len(node.all_input_nodes) != 1:
        return False
    operand = node.all_input_nodes[0]
    divides = node.target in (operator.truediv, torch.div, "div")
    return (not divides or node.args[0] is operand) and _leaves_pending_sum(operand)  # (not `2 / sum`)


def _dtensor_inputs(node) -> list:
    return [n for n in node.all_input_nodes if is_dtensor(n.meta.get("example_value"))]


def _leaves_pending_sum(node) -> bool:
    """Whether `node` is a matrix product over a sharded contraction axis, a sum of such or one scaled by a number
    (its result is a pending sum)."""
    if _is_elementwise(node) and (_sums_pending_sums(node) or _scales_a_pending_sum(node)):
        return True
    if node.op != "call_function" or node.target not in _PRODUCTS or len(node.args) < 2:
        return False
    a, b = (getattr(n, "meta", {}).get("example_value") for n in node.args[:2])
    if not (is_dtensor(a) and is_dtensor(b)) or b.dim() < 2:
        return False
    contracted = a._layout.axes[-1]
    return contracted is not None and contracted == b._layout.axes[-2]


_PRODUCTS = {operator.matmul, torch.matmul, torch.mm, torch.bmm}
