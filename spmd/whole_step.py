"""Whole-step capture: `spmd.function(step, whole_step=True)` traces a training step — forward, autograd's backward
and the optimizer's update — into ONE graph over the stacked components, as the seeds' `tf.function` does, and
compiles it.

Without it a step is several graphs: torch.compile breaks at `loss.backward()` and at `optimizer.step()`, and the
DTensors cross each boundary through torch's tensor-subclass machinery (guards, flattening, AccumulateGrad's detach,
wrapping the results): a few hundred µs a step that plain tensors do not pay. Here the step is traced once at the
dispatch level (`make_fx` over fake components): backward and the update run during the trace like any other code,
and the graph holds the ops they issue on the components. The compiled graph takes the plain stacks of the
arguments and of the *state* the step uses (the parameters, buffers and gradients of its modules, the state of its
optimizers), updates the state in place (or hands back what the step rebinds) and returns its results' stacks: per
call no DTensor op is dispatched and no guard runs but one comparison of the state's identity and settings.

The contract is tf.function's: the step's Python runs when it is traced. A signature's first call runs eagerly (it
creates the optimizer's state); its second is traced. It is traced again when the arguments' layouts, shapes or
dtypes, the state's tensors' layouts, shapes or dtypes, which parameters require grad, the modules' structure or
training flags, or the optimizers' float settings (a new learning rate) differ from the trace's; a tensor setting
(`lr=torch.tensor(...)`, which a schedule fills) is an input. State tensors replaced by others like them
(`optimizer.load_state_dict`) are what the graph reads and updates from then on. Tensors it reads that are neither
arguments nor state are captured as constants, as are Python values. Its results are detached: its backward ran
inside.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import types
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from spmd.collectives.local import share, shared
from spmd import explain
from spmd.dtensor import DTensor, pending_dtensors
from spmd.engine import dispatch
from spmd.errors import TraceError
from spmd.explain import Explanation, Recorder
from spmd.forbidden import Forbidding


# -- the state a step uses -------------------------------------------------------------------------------------------
def _roots(fn, args, kwargs) -> tuple[list[nn.Module], list[torch.optim.Optimizer], list[DTensor], list]:
    """The modules, optimizers and DTensors (a DVariable) a step uses: among its arguments, its closure's
    variables, the globals its code names and, for a bound method or partial, its object's attributes and bound
    arguments (and in lists, tuples and dicts of those); and where each was found in something the user may rebind
    (a dict entry, a global, an attribute, a list item, a closure cell), as (container, key, object)."""
    seen: dict[int, Any] = {}
    bindings: list = []

    def visit(obj, depth: int, container=None, key=None) -> None:
        if isinstance(obj, (nn.Module, torch.optim.Optimizer, DTensor)):
            seen.setdefault(id(obj), obj)
            if container is not None:
                bindings.append((container, key, obj))
        elif isinstance(obj, (list, tuple)) and depth:
            for i, o in enumerate(obj):
                visit(o, depth - 1, *((obj, i) if isinstance(obj, list) else (None, None)))
        elif isinstance(obj, dict) and depth:
            for k, o in list(obj.items()):
                visit(o, depth - 1, obj, k)
        elif isinstance(obj, functools.partial) and depth:
            visit(obj.func, depth - 1)
            visit(obj.args, depth - 1)
            visit(obj.keywords, depth - 1)
        elif hasattr(obj, "__self__") and hasattr(obj, "__func__") and depth:  # a bound method
            visit(obj.__func__, depth - 1)
            visit(obj.__self__, depth - 1)  # (a module: its own parameters)
            visit(getattr(obj.__self__, "__dict__", {}), depth - 1)  # (its attributes: an optimizer)
        elif hasattr(obj, "__code__") and depth:  # a function
            for cell in obj.__closure__ or ():
                if _filled(cell):
                    visit(cell.cell_contents, depth - 1, cell)
            for name in obj.__code__.co_names:
                if name in obj.__globals__:
                    visit(obj.__globals__[name], depth - 1, obj.__globals__, name)
            visit([obj.__defaults__ or (), obj.__kwdefaults__ or {}], depth - 1)
        elif depth and _plain_object(obj):  # a user's object holding them (a trainer's `self.model`)
            visit(vars(obj), depth - 1)

    visit((args, kwargs), 3)
    bindings.clear()  # (a call's own arguments: the signature covers them)
    visit(fn, 4)  # (a function, its globals, a trainer object among them, its attributes)
    found = list(seen.values())
    return ([m for m in found if isinstance(m, nn.Module)], [o for o in found if isinstance(o, torch.optim.Optimizer)],
            [t for t in found if isinstance(t, DTensor)], bindings)


def _still_bound(bindings: list) -> bool:
    """Whether every place a step's module, optimizer or DTensor was found still holds that object (a step that
    reaches `state["optimizer"]` must not keep updating with the optimizer the entry held when it was traced)."""
    for container, key, obj in bindings:
        try:
            held = container.cell_contents if key is None else container[key]
        except (KeyError, IndexError, ValueError):
            return False
        if held is not obj:
            return False
    return True


def _plain_object(obj) -> bool:
    """An instance of a user's class (or a SimpleNamespace): not a module of code, a class, a callable or one of
    the builtins' and torch's own objects, whose attributes would be a walk through libraries."""
    module = type(obj).__module__
    return (isinstance(getattr(obj, "__dict__", None), dict) and not isinstance(obj, (types.ModuleType, type))
            and not callable(obj) and not module.startswith(("torch", "builtins", "spmd")))


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


class _State:
    """The tensors a step reads and may update besides its arguments: DTensors (parameters, buffers, optimizer
    state), plain tensors held in a dict (an optimizer's step counts, plain buffers) and the gradients the
    parameters have when the step starts (read from `.grad` at each call: a step may leave new ones)."""

    def __init__(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer], named: list[DTensor],
                 bindings: list):
        self.modules, self.optimizers, self.bindings = modules, optimizers, bindings
        params = {id(p): p for m in modules for p in m.parameters()}
        params |= {id(p): p for o in optimizers for g in o.param_groups for p in g["params"]}
        self.params = list(params.values())
        plain = [p for p in self.params if not isinstance(p, DTensor)]
        if plain:
            raise TypeError(f"spmd.function(whole_step=True): the step's modules or optimizers hold {len(plain)} plain "
                            f"parameter(s) (the first of shape {list(plain[0].shape)}); distribute the module "
                            "(spmd.distribute_module) so that every parameter is a DTensor")
        tensors = {id(p): p for p in [*self.params, *named]}
        self.slots: list[tuple[dict, Any]] = []  # plain tensors, as (container, key)
        for holder, key, t in self._held():
            if isinstance(t, DTensor):
                tensors.setdefault(id(t), t)
            elif isinstance(t, torch.Tensor):
                self.slots.append((holder, key))
        self.dtensors = list(tensors.values())
        self.graded = [p for p in self.params if p.grad is not None]
        self.submodules = list({id(sub): sub for m in modules for sub in m.modules()}.values())
        self.identity = self._identity()

    def _identity(self) -> tuple:
        """Which containers hold the state, and which DTensors it is (a plain tensor, rebound by each step, is
        read from its container at each call)."""
        return tuple((id(holder), id(t) if isinstance(t, DTensor) else None) for holder, _, t in self._held())

    def is_live(self) -> bool:
        """Whether the step still reaches these modules and optimizers, and they still hold this state
        (`load_state_dict` replaces it)."""
        return _still_bound(self.bindings) and self._identity() == self.identity

    def _held(self):
        for m in self.modules:
            for sub in m.modules():
                for name, b in sub._buffers.items():
                    yield sub._buffers, name, b
        for o in self.optimizers:
            for p in self.params:
                state = o.state.get(p)
                for key, t in (state or {}).items():
                    yield state, key, t
            for group in o.param_groups:  # a tensor setting (lr=torch.tensor(...)): an input, which a schedule fills
                for key, t in group.items():
                    if key != "params":
                        yield group, key, t

    def grads(self) -> list:
        return list(map(_GRAD, self.params))

    def components(self, unread: frozenset = frozenset()) -> list[torch.Tensor]:
        """What the graph takes for the state, in order: the DTensors', the plain tensors, the gradients' (but
        those at the positions `unread` in `graded`, which a graph replaces without reading them)."""
        return ([_component(t) for t in self.dtensors] + [holder[k] for holder, k in self.slots]
                + [_component(p.grad) for j, p in enumerate(self.graded) if j not in unread])

    def sharers(self) -> list[int | None]:
        return ([_sharers(t) for t in self.dtensors] + [None] * len(self.slots)
                + [_sharers(p.grad) for p in self.graded])

    def key(self) -> tuple:
        """What a trace assumes of the state (its components are read at each call): each tensor's layout, shape,
        dtype and strides, the modules' structure and training flags, the optimizers' settings, and each gradient's
        presence and layout, and which parameters require grad."""
        return (tuple(map(_dtensor_key, self.dtensors)), tuple(p.requires_grad for p in self.params),
                tuple(_plain_key(holder.get(k)) for holder, k in self.slots),
                tuple((m.training, *map(id, m._parameters.values()), *map(id, m._buffers.values()),
                       *map(id, m._modules.values())) for m in self.submodules),  # (a replaced submodule too)
                tuple((tuple(map(id, g["params"])), *((k, _setting(v)) for k, v in g.items() if k != "params"))
                      for o in self.optimizers for g in o.param_groups),
                tuple(len(o.state) for o in self.optimizers),
                tuple(None if g is None else _dtensor_key(g) for g in self.grads()))


def _plain_key(t) -> tuple | None:
    return (t.shape, t.dtype, t.device, t.stride()) if isinstance(t, torch.Tensor) else None


def _setting(value):
    """An optimizer setting as a trace assumes it: a Python value itself (baked into the graph), a tensor by its
    metadata (a graph input: its value is read at each call)."""
    return _plain_key(value) if isinstance(value, torch.Tensor) else value


# -- the components a graph takes and gives ---------------------------------------------------------------------------
def _component(t: DTensor) -> torch.Tensor:
    """What a graph takes for a DTensor: its resolved stack, or the one copy of a shared one."""
    if t._pending:
        t._local  # resolves it
    return t._inner


def _restacked(inner: torch.Tensor, sharers: int | None) -> torch.Tensor:
    """The stack a graph's component stands for: itself, or the one copy that `sharers` devices share."""
    return share(inner, sharers) if sharers else inner


def _dtensor_key(t: DTensor) -> tuple:
    """What a graph assumes of a DTensor it takes: layout, shape, dtype (and pending reduction), stack strides."""
    return t._key, t._stack.stride()


def _sharers(t: DTensor) -> int | None:
    return t._stack.shape[0] if shared(t._stack) else None


def _own(result: torch.Tensor) -> torch.Tensor:
    """A result in memory of its own: inductor may return a view of a larger buffer (a loss whose all-reduce it
    bucketed with the gradients'), which a caller keeping results (a list of losses) would keep whole."""
    return result.clone() if result.untyped_storage().nbytes() > result.nbytes else result


def _rebuilt(inner: torch.Tensor, meta) -> DTensor:
    layout, shape, strides, sharers = meta
    return DTensor(_restacked(inner, sharers), layout, shape, strides=strides)


def _meta(t: DTensor) -> tuple:
    return t._layout, tuple(t.shape), t.stride(), _sharers(t)


@contextlib.contextmanager
def _tracing_updates(optimizers):
    """While a step is traced: torch.optim's updates as torch.compile traces them (`capturable`: the step counts
    stay tensors in the graph rather than Python numbers read once). A `fused=True` kernel cannot be in a graph
    (torch has no fake kernel for some, and its functionalization refuses the others), and Adagrad's for-loop reads
    its step count as a Python number: those are traced as their multi-tensor (`foreach`) path, the same update."""
    saved = [(g, {k: g[k] for k in ("capturable", "foreach", "fused") if k in g})
             for o in optimizers for g in o.param_groups]
    flag = torch.compiler._is_compiling_flag
    schedule = torch.optim.lr_scheduler.LRScheduler.step
    try:
        torch.compiler._is_compiling_flag = True
        for o in optimizers:
            for g in o.param_groups:
                g.update({k: True for k in ("capturable",) if k in g})
                if g.get("fused") or (isinstance(o, torch.optim.Adagrad) and not g.get("foreach")):
                    g.update(fused=False, foreach=True)
        torch.optim.lr_scheduler.LRScheduler.step = _scheduler_step_in_a_trace
        yield
    finally:
        torch.compiler._is_compiling_flag = flag
        for g, before in saved:
            g.update(before)
        torch.optim.lr_scheduler.LRScheduler.step = schedule


def _scheduler_step_in_a_trace(scheduler, *args, **kwargs):
    raise TraceError(f"{type(scheduler).__name__}.step() inside a whole step: the step's Python runs once, when it "
                     "is traced, so the schedule would never advance (the learning rate would stay the traced "
                     "one). Call scheduler.step() after the step, outside the function (give the optimizer a tensor "
                     "lr, which the scheduler fills in place: the graph reads it at every call)")


class _Saved:
    """The Python state a trace may change (stacks, gradients, optimizer state dicts), put back afterwards."""

    def __init__(self, state: _State, args: list):
        dtensors = [*state.dtensors, *[p.grad for p in state.graded], *args]
        self.attrs = [(t, dict(t.__dict__)) for t in dtensors if isinstance(t, DTensor)]
        self.grads = list(zip(state.params, state.grads()))
        self.optimizer_states = [(o.state, {p: dict(s) for p, s in o.state.items()}) for o in state.optimizers]
        self.holders = [(holder, dict(holder)) for holder, _ in state.slots]
        self.created_state = False  # whether the trace made optimizer state that restore() took away

    def restore(self) -> None:
        for t, attrs in self.attrs:
            t.__dict__.clear()
            t.__dict__.update(attrs)
        for p, g in self.grads:
            p.grad = g
        for states, before in self.optimizer_states:
            for p in [p for p in states if p not in before]:
                self.created_state |= bool(states[p])  # (an empty entry holds nothing: SGD without momentum)
                del states[p]
            for p, s in before.items():
                self.created_state |= any(s.get(k) is None and v is not None for k, v in states[p].items())
                states[p].clear()
                states[p].update(s)
        for holder, before in self.holders:
            holder.clear()
            holder.update(before)


# -- a traced step -----------------------------------------------------------------------------------------------------
class _Trace:
    """One traced signature: the compiled graph, and what to do with its outputs."""

    def __init__(self, state: _State, state_key: tuple, compiled: Callable, outputs: dict):
        self.state, self.state_key, self.compiled = state, state_key, compiled
        self.results_spec, self.results = outputs["results_spec"], outputs["results"]
        self.rebinds, self.grads = outputs["rebinds"], outputs["grads"]
        self.created_state, self.unread = outputs["created_state"], outputs["unread"]
        graded = [i for i, g in enumerate(state_key[-1]) if g is not None]  # (the key's last part: the gradients)
        self._unread_params = {graded[j] for j in self.unread}

    def takes(self, key: tuple) -> bool:
        """Whether the graph runs on state of `key`: the state it was traced at, but for the layouts and strides
        of the gradients it replaces without reading them."""
        if key[:-1] != self.state_key[:-1]:
            return False
        return all(a == b or (i in self._unread_params and a is not None and b is not None)
                   for i, (a, b) in enumerate(zip(key[-1], self.state_key[-1])))

    def run(self, leaves: list):
        state = self.state  # (the live state: possibly another `_State` of the same key as the traced one)
        inputs = state.components(self.unread)
        inputs += [_component(t) if isinstance(t, DTensor) else t for t in leaves if isinstance(t, torch.Tensor)]
        for j in self.unread:  # dropped before the graph makes the new ones, as the step's `zero_grad()` drops them
            state.graded[j].grad = None
        outs = iter(self.compiled(*inputs))
        results = [_own(next(outs)) if kind == "tensor" else _rebuilt(_own(next(outs)), meta) if kind == "dtensor"
                   else meta for kind, meta in self.results]
        for i, sharers in self.rebinds:  # (a state DTensor's index, or a plain tensor's slot's after them)
            if i < len(state.dtensors):
                state.dtensors[i]._settle(_restacked(next(outs), sharers))
            else:
                holder, k = state.slots[i - len(state.dtensors)]
                holder[k] = next(outs)
        for p, meta in zip(state.params, self.grads):
            if meta is not _KEEP:
                p.grad = None if meta is None else _rebuilt(next(outs), meta)
        return pytree.tree_unflatten(results, self.results_spec)


_GRAD = operator.attrgetter("grad")
_KEEP = object()  # a gradient the step leaves as it was (or updates in place)


class WholeStep:
    """The whole-step traces of one `spmd.function` (see the module's docstring)."""

    def __init__(self, fn: Callable, body: Callable, name: str, compile_graph: Callable, max_traces: int,
                 forbid: frozenset = frozenset()):
        self._fn, self._body, self._name, self._compile, self._max = fn, body, name, compile_graph, max_traces
        self._forbid = forbid
        self._traces: dict[tuple, tuple[_State, dict]] = {}  # signature -> (its last trace's state, key -> trace)
        self._seen: set = set()  # signatures whose first call ran eagerly
        self.count = 0  # traces made
        self._warned = False  # about the limit of traces

    def __call__(self, args, kwargs):
        leaves, spec = _flatten(args, kwargs)
        signature = (spec, *map(_leaf_key, leaves))
        state, traces = self._traces.get(signature, (None, {}))
        live = state is None or state.is_live()
        if not live:  # the modules or optimizers hold other state tensors now
            state = _State(*_roots(self._fn, args, kwargs))
        trace = _matching(traces, state.key()) if state is not None else None
        if trace is not None and not live:
            trace.state = state  # (the same graph over the state they hold now)
        if trace is None:
            if signature not in self._seen or self.count >= self._max:  # eagerly: creates the optimizer's state
                if self.count >= self._max and signature in self._seen:
                    self._warn_limit()
                self._seen.add(signature)
                return self._body(*args, **kwargs)
            if traces:
                warnings.warn(f"spmd.function({self._name}, whole_step=True) traces the step again (trace "
                              f"{self.count + 1}): the state it updates, its modules' structure or training flags, "
                              "or an optimizer's settings (a learning rate) differ from its earlier traces'. For a "
                              "learning-rate schedule give the optimizer a tensor lr (lr=torch.tensor(...)): it is "
                              "then an input of the graph", stacklevel=3)
            trace = self._trace(leaves, spec)
            if trace.created_state:  # new parameters, momentum switched on: state made inside a trace would be made
                return self._body(*args, **kwargs)  # afresh by every call; made eagerly once, the next call traces
            traces[trace.state_key] = trace
        self._traces[signature] = (trace.state, traces)
        return trace.run(leaves)

    def explain(self, args, kwargs) -> Explanation:
        """The ops and collectives of the whole step (forward, backward, update), traced without running."""
        leaves, spec = _flatten(args, kwargs)
        recorder = Recorder()
        with recorder:
            self._graph(leaves, spec)
        return recorder.explanation

    def _warn_limit(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"spmd.function({self._name}, whole_step=True) was traced {self.count} times, its limit: "
                          "it now runs eagerly for new signatures and state", stacklevel=4)

    # -- tracing ----------------------------------------------------------------------------------------------------
    def _trace(self, leaves: list, spec) -> _Trace:
        with Forbidding(self._forbid, self._name) if self._forbid else contextlib.nullcontext():
            state, gm, inputs, outputs = self._graph(leaves, spec)
        outputs["unread"] = _drop_unread_gradients(gm, state, outputs["grads"])
        first = len(state.dtensors) + len(state.slots)
        inputs = [x for i, x in enumerate(inputs) if i - first not in outputs["unread"]]
        self.count += 1
        return _Trace(state, state.key(), self._compile(gm, inputs), outputs)

    def _graph(self, leaves: list, spec):
        """(state, the traced graph, its example inputs, what its outputs are)."""
        args, kwargs = _unflatten(leaves, spec)
        state = _State(*_roots(self._fn, args, kwargs))
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise ValueError(f"spmd.function({self._name}, whole_step=True): argument {i} (shape "
                                 f"{list(t.shape)}) requires grad; a whole step's arguments are its data (its "
                                 "parameters are those of the modules it calls), and their gradients would be lost")
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if any(isinstance(t, DTensor) and t._layout.mesh.remote is not None for t in [*state.dtensors, *tensors]):
            raise NotImplementedError(f"spmd.function({self._name}, whole_step=True) on a single-controller mesh: "
                                      "its workers compile torch.compile's graphs only; leave whole_step off there")
        inputs = state.components() + [_component(t) if isinstance(t, DTensor) else t for t in tensors]
        sharers = state.sharers() + [_sharers(t) if isinstance(t, DTensor) else None for t in tensors]
        outputs: dict = {}
        saved = _Saved(state, tensors)
        entry_grads = [p.grad for p in state.graded]  # (the objects the trace sees; not kept past it)

        def step(*components):
            try:
                installed = self._install(state, leaves, spec, components, sharers)
                out = self._body(*installed[0], **installed[1])
                return self._outputs(state, entry_grads, components, out, outputs)
            finally:
                saved.restore()

        try:
            with _tracing_updates(state.optimizers):
                gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*inputs)
        except Exception as e:
            if type(e).__module__.startswith("spmd."):
                raise
            where = _reading_line(e)
            raise self._error(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                              + (f" (at {where})" if where else "")) from e
        outputs["created_state"] = saved.created_state
        if any(n.target is torch.ops.aten._local_scalar_dense.default for n in gm.graph.nodes):
            raise self._error("it reads a tensor's value in Python")
        written = _written_constants(gm)
        if written:
            raise TraceError(f"spmd.function({self._name}, whole_step=True): the step writes into {len(written)} "
                             f"tensor(s) (the first of shape {list(written[0].shape)}) that are neither its arguments "
                             "nor state of the modules, optimizers or DTensors it names, so the graph would keep them "
                             "as constants; pass them as arguments, or name them in the step")
        return state, gm, inputs, outputs

    def _error(self, why: str) -> TraceError:
        return TraceError(f"spmd.function({self._name}, whole_step=True) could not trace the step as one graph: {why}. "
                          "A whole step runs its Python once, when traced: it must not read tensor values "
                          "(`.item()`, `if loss > x`); return tensors instead, or leave whole_step off")

    @staticmethod
    def _install(state: _State, leaves: list, spec, components, sharers):
        """Puts the traced components in place of the state's and builds the arguments around them."""
        it = iter(zip(components, sharers))
        for t in state.dtensors:
            t._stack = _restacked(*next(it))
        for holder, k in state.slots:
            holder[k] = next(it)[0]
        for p in state.graded:
            p.grad._stack = _restacked(*next(it))
        traced = []
        for t in leaves:
            if isinstance(t, DTensor):
                inner, n = next(it)
                traced.append(DTensor(_restacked(inner, n), t._layout, tuple(t.shape), strides=t.stride()))
            else:
                traced.append(next(it)[0] if isinstance(t, torch.Tensor) else t)
        return _unflatten(traced, spec)

    @staticmethod
    def _outputs(state: _State, entry_grads: list, components, out, outputs: dict) -> tuple:
        """The graph's outputs: the results, the state the step rebound, the parameters' new gradients; and in
        `outputs` what each is."""
        for t in pending_dtensors(out):  # resolved as the step returns them: explain's "(result)" rows
            if explain.RECORDERS:
                explain.RECORDERS[-1].result(t, dispatch.resolve, backward=False)
            else:
                dispatch.resolve(t)
        leaves, outputs["results_spec"] = pytree.tree_flatten(out)
        flat, results = [], []
        for r in leaves:
            if isinstance(r, DTensor):
                flat.append(_component(r))
                results.append(("dtensor", _meta(r)))
            elif isinstance(r, torch.Tensor):
                flat.append(r)
                results.append(("tensor", None))
            else:
                results.append(("value", r))
        outputs["results"], outputs["rebinds"], outputs["grads"] = results, [], []
        given = iter(components)
        for i, (t, mine) in enumerate(zip(state.dtensors, given)):
            now = _component(t)
            if now is not mine:  # rebound, not updated in place
                flat.append(now)
                outputs["rebinds"].append((i, _sharers(t)))
        for j, (holder, k) in enumerate(state.slots, len(state.dtensors)):
            if holder.get(k) is not next(given):
                if not isinstance(holder.get(k), torch.Tensor):
                    raise TraceError(f"spmd.function(whole_step=True): the step replaced the tensor {k!r} of an "
                                     "optimizer's state or a module's buffers with a non-tensor")
                flat.append(holder[k])
                outputs["rebinds"].append((j, None))
        entry = {id(g): mine for g, mine in zip(entry_grads, given)}
        for p in state.params:
            g = p.grad
            if g is not None and id(g) in entry and _component(g) is entry[id(g)]:
                outputs["grads"].append(_KEEP)  # the gradient it came with, updated in place
            elif g is None:
                outputs["grads"].append(None)
            else:
                flat.append(_component(g))
                outputs["grads"].append(_meta(g))
        return tuple(flat)


def _matching(traces: dict, key: tuple) -> _Trace | None:
    """The trace of state `key` among a signature's `traces` (kept under `key` too when found otherwise)."""
    trace = traces.get(key)
    if trace is None:
        trace = next((t for t in traces.values() if t.takes(key)), None)
        if trace is not None:
            traces[key] = trace
    return trace


def _drop_unread_gradients(gm, state: _State, grads: list) -> frozenset:
    """The positions in `state.graded` of the gradients the graph replaces (or drops) without reading them (the
    step's `zero_grad()` came first), their inputs taken out of `gm`: a call drops them before the graph runs, so
    that their memory holds the new ones, as in eager torch."""
    gm.graph.eliminate_dead_code()  # (a shared gradient's one copy is expanded to its stack, and that dropped)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][len(state.dtensors) + len(state.slots):]
    position = {id(p): i for i, p in enumerate(state.params)}
    unread = [j for j, (p, node) in enumerate(zip(state.graded, placeholders))
              if not node.users and grads[position[id(p)]] is not _KEEP]
    for j in unread:
        gm.graph.erase_node(placeholders[j])
    gm.recompile()
    return frozenset(unread)


def _reading_line(e: Exception) -> str | None:
    """The line of the traced step (the user's, or a torch module's: BatchNorm's `float(num_batches_tracked)`) where
    a trace failed, skipping torch's and spmd's own machinery."""
    internal = ("/torch/_", "/torch/fx/", "/torch/utils/", "/torch/autograd/", "/spmd/")
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not any(p in f.filename for p in internal)]
    return f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else None


def _written_constants(gm) -> list[torch.Tensor]:
    """The tensors a traced graph holds as constants (`get_attr`) and writes into."""
    out = []
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for arg, value in zip(schema.arguments, n.args):
            written = arg.alias_info is not None and arg.alias_info.is_write
            if written and isinstance(value, torch.fx.Node) and value.op == "get_attr":
                out.append(getattr(gm, value.target))
    return out


_POSITIONAL = "positional DTensors"  # the spec of the common arguments: no container, no keyword


def _flatten(args: tuple, kwargs: dict) -> tuple[list, Any]:
    if not kwargs and all(isinstance(a, DTensor) for a in args):
        return list(args), _POSITIONAL
    return pytree.tree_flatten((args, kwargs))


def _unflatten(leaves: list, spec) -> tuple[tuple, dict]:
    return (tuple(leaves), {}) if spec is _POSITIONAL else pytree.tree_unflatten(leaves, spec)


def _leaf_key(t) -> Any:
    """What a trace assumes of one argument: a DTensor's layout, shape, dtype and stack strides; a tensor's
    metadata; a Python value itself (by identity when it cannot be hashed)."""
    if isinstance(t, DTensor):
        return _dtensor_key(t)
    if isinstance(t, torch.Tensor):
        return type(t), t.shape, t.dtype, t.device, t.stride()
    try:
        hash(t)
    except TypeError:
        return "id", id(t)
    return type(t), t
