"""Function mode on a controller mesh: `spmd.function` traces on the controller and compiles on the workers.

Dynamo traces the function on the controller over fakes of its controller DTensors (the rule engine decides on
metadata, as for an eager op). Each graph it captures is a torch-level program, the same for every process; it
goes to the workers once, and each compiles it as a multi-client `spmd.function` over its real components
(collectives worker to worker, traceable). What Dynamo keeps stays on the controller: its guards (a new layout
retraces), its graph breaks (`loss.backward()`, the optimizer's step: each of their graphs is sent the same way)
and the Python side effects it replays (an optimizer's new state, `param.grad`), so the controller's objects are
those of an eager run.

A call of a graph is one instruction to every worker; the results' metadata (layouts, shapes, strides) come from
the workers' first run of the graph and are reused after it (one round trip per graph, not per call). A call
whose inputs require grad is an autograd function on the controller: its backward is one instruction, which runs
the workers' compiled backward, and the gradients' metadata come back the same way once per kind of gradient.
"""

from __future__ import annotations

import pickle

import torch
import torch.fx
import torch.utils._pytree as pytree

from spmd.controller import protocol
from spmd.controller.errors import ControllerError
from spmd.controller.remote import RemoteDTensor, shadow
from spmd.dtensor import DTensor


def compile_graph(session, function, gm, example_inputs):
    """What runs a graph `function` traced on `session`'s meshes: the workers' compiled graph (and its part on
    tensors of the controller process, here), or, where a plain tensor depends on a DTensor, the graph itself,
    op by op (each op on controller DTensors sent to the workers, as eagerly)."""
    if not isinstance(function.options["backend"], str):
        raise ControllerError(f"spmd.function({function.__name__}) on a controller mesh compiles on the workers: "
                              f"name its backend ('inductor', 'aot_eager', ...) rather than pass "
                              f"{function.options['backend']!r}")
    host = _host_part(gm, example_inputs)
    if host is None:
        return gm.forward
    return GraphOnWorkers(session, gm, function.options, host)


class GraphOnWorkers:
    """One captured graph: compiled by every worker, called with one instruction.

    Plain tensors of the controller process the graph reads (an optimizer's step counts) go with each call, by
    value; the graph's part that computes on them alone also runs here, so that they change here as they would
    eagerly, and the graph's plain results are the controller's own."""

    def __init__(self, session, gm: torch.fx.GraphModule, options: dict, host: torch.fx.GraphModule):
        self.session = session
        self.host = host
        self.id = session.new_id(self)  # the workers drop their compiled graph with this object
        meshes = {mesh.to_string(): mesh.mesh_id for mesh in session.meshes()}
        program, self.captured = _program(gm)
        session.send((protocol.GRAPH, self.id, pickle.dumps(program), meshes, options))
        self.results: list | None = None  # each DTensor result's metadata (the workers' first run)
        self.gradients: dict = {}  # the inputs' gradients' metadata, by the kinds of the results' gradients

    def __call__(self, *inputs):
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            return _Call.apply(self, *inputs)
        return self.launch(inputs)

    def launch(self, inputs, call_id=None, needs_grad=()):
        session = self.session
        sent = [t.clone() if _is_plain(t) else t for t in (*inputs, *self.captured)]  # (values as of now)
        plain = self.host(*inputs)
        handles = [None if p is not None else h for p, h in zip(plain, session.reserve(len(plain)))]
        session.send((protocol.RUN_GRAPH, self.id, session.encode(sent), handles, call_id,
                      tuple(needs_grad) + (False,) * len(self.captured)))
        if self.results is None:
            self.results = session.call("graph_results", handles)[0]
        return tuple(p if p is not None else _remote(session, meta, h)
                     for p, meta, h in zip(plain, self.results, handles))

    def backward(self, call_id: int, grads, needs_grad) -> list:
        session = self.session
        kinds = tuple(None if g is None else g._key for g in grads)
        handles = session.reserve(sum(needs_grad))
        session.send((protocol.GRAPH_BACKWARD, call_id, session.encode(list(grads)), handles))
        if kinds not in self.gradients:
            self.gradients[kinds] = session.call("graph_results", handles)[0]
        got = iter(_remote(session, meta, h) for meta, h in zip(self.gradients[kinds], handles))
        return [next(got) if need else None for need in needs_grad]


def _host_part(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule | None:
    """The part of a graph that computes on plain tensors only, as a graph of the same inputs returning the
    graph's plain results (None in place of the others); None where a plain tensor depends on a DTensor."""
    values = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs))
    on_workers = set()
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        value = getattr(gm, node.target) if node.op == "get_attr" else values.get(node, node.meta.get("example_value"))
        leaves = pytree.tree_leaves(value)
        if any(isinstance(v, DTensor) for v in leaves) or any(a in on_workers for a in node.all_input_nodes):
            if any(_is_plain(v) for v in leaves):
                return None
            on_workers.add(node)
    graph, env = torch.fx.Graph(), {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
        elif node.op == "output":
            graph.output(tuple(None if o in on_workers else env[o] for o in node.args[0]))
        elif node not in on_workers:
            env[node] = graph.node_copy(node, env.__getitem__)
    return torch.fx.GraphModule(gm, graph)


def _is_plain(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor)


def _program(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list]:
    """What the workers compile: a copy of Dynamo's graph, without Dynamo's records and with the tensors it
    holds as attributes (an optimizer's parameters, state and step counts) made its last inputs, so that they
    travel with each call (DTensors as handles: the workers' graph writes their real memory); and those
    tensors."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    captured = []
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        value = getattr(gm, node.target)
        if isinstance(value, torch.Tensor):
            with graph.inserting_after(last):
                last = graph.placeholder(f"captured_{len(captured)}")
            node.replace_all_uses_with(last)
            graph.erase_node(node)
            captured.append(value)
    for node in graph.nodes:
        node.type, node.meta = None, {}  # (annotations name the controller's classes; metadata holds fakes)
    return torch.fx.GraphModule(gm, graph), captured


class _Call(torch.autograd.Function):
    """A graph called with inputs that require grad: the workers keep its autograd state until the backward."""

    @staticmethod
    def forward(ctx, graph: GraphOnWorkers, *inputs):
        ctx.set_materialize_grads(False)
        ctx.graph = graph
        ctx.needs_grad = [isinstance(t, torch.Tensor) and t.requires_grad for t in inputs]
        ctx.token = _Token()  # the workers drop the call's autograd state with it
        ctx.call_id = graph.session.new_id(ctx.token)
        outs = graph.launch(inputs, ctx.call_id, ctx.needs_grad)
        ctx.mark_non_differentiable(*[o for o, meta in zip(outs, graph.results) if meta is None or not meta[-1]])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        if all(g is None for g in grads):
            return (None,) * (len(ctx.needs_grad) + 1)
        return (None, *ctx.graph.backward(ctx.call_id, grads, ctx.needs_grad))


class _Token:
    """Lives as long as a call's autograd state on the controller."""


def _remote(session, meta, handle):
    """The controller's DTensor for a result the workers hold under `handle`."""
    if meta is None:
        return None
    stack_shape, stride, dtype, layout_ref, shape, _ = meta
    layout = protocol.decode(layout_ref, {}, session.mesh_table(), None)
    stack_shape = (layout.mesh.num_local_devices(),) + stack_shape[1:]  # every device's, not one worker's
    with shadow():
        t = DTensor.__new__(RemoteDTensor, torch.empty_strided(stack_shape, stride, dtype=dtype, device="meta"),
                            layout, shape)
    session.bind(t, handle)
    return t


def results_metadata(table: dict, handles, mesh_ids: dict) -> list:
    """The workers' side of `graph_results`: what the controller needs to mirror each result."""
    out = []
    for h in handles:
        t = table.get(h)
        if t is None:
            out.append(None)
        else:
            stack = t._local
            out.append((tuple(stack.shape), stack.stride(), stack.dtype,
                        protocol.LayoutRef(mesh_ids[t._layout.mesh.to_string()], tuple(t._layout.sharding_specs)),
                        tuple(t.shape), t.requires_grad))
    return out

