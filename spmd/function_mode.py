"""Function mode: `spmd.function` traces a function over DTensors once per input signature, expands it onto the
mesh at trace time (the rules decide layouts and collectives once) and compiles the result.

It is `torch.compile` over DTensors (a DTensor is a traceable subclass: the compiled graph holds plain kernels on
the stacked components, and the collectives), plus the seeds' rules for functions: plain tensor arguments are
broadcast to replicated DTensors, `out_layouts=` constrains the results, `explain()` lists what a trace does,
`experimental_get_tracing_count()` says how often it traced.
"""

from __future__ import annotations

import functools
import types
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from spmd import clients
from spmd.api import copy_to_mesh, relayout
from spmd.collectives.distributed import FUNCTION_CALL, check_boundary
from spmd.collectives.groups import lost_peer, unreachable
from spmd.collectives.local import one_copy
from spmd.dtensor import DTensor, pending_dtensors
from spmd.engine import dispatch
from spmd.engine.propagation import hoist_relayouts
from spmd import errors
from spmd.errors import TraceError
from spmd.explain import Explanation, Recorder
from spmd.forbidden import check_forbidden, forbidden_kinds
from spmd.layout import Layout
from spmd.scope import EAGER_IMPLICIT_REPLICATION
from spmd.whole_step import WholeStep

# torch's own graph breaks in a training step: autograd's backward and the optimizer's step run between graphs
MAX_TRACES = 64  # traces of one function (torch's recompile limit) before it runs eagerly
# inductor merges the independent all-reduces of a graph (a data-parallel backward's gradients) into buckets of up
# to this size: one torch.distributed call per bucket rather than per gradient, as DDP's buckets (its default size)
GRAPH_BUCKET_CAP_MB = 25.0
_ACTIVE = [0]  # spmd.function calls running (see `active`)

_EXPECTED_BREAKS = ("Tensor.backward()", "torch._dynamo.graph_break()", "`Optimizer.")


def function(fn: Callable | None = None, *, backend: str | Callable = "inductor", mode: str | None = None,
             dynamic: bool = False, fullgraph: bool = True, out_layouts: Any = None,
             max_autobroadcast_elements: int = 1 << 16, forbid: str | Sequence[str] | None = None,
             whole_step: bool = False):
    """Compiles `fn` over DTensors (the seeds' `tf.function`). Use as `@spmd.function` or
    `spmd.function(fn, backend=...)`.

    Args:
      backend, mode: as for `torch.compile` (`mode="reduce-overhead"` uses CUDA graphs).
      dynamic: False only: spmd's rules decide on static shapes, so each new shape is a trace of its own (up to
        `MAX_TRACES` per function); True raises `NotImplementedError`.
      fullgraph: True (default) raises `TraceError` where `fn` cannot be traced as one graph; False runs the
        untraceable part eagerly, with a warning (a training step's `backward()` and `optimizer.step()` are
        torch's own graph breaks and are not warned about).
      out_layouts: a Layout, or a structure of Layouts (None for "any") matching `fn`'s results: the results
        are relayouted inside the traced graph.
      max_autobroadcast_elements: plain tensor arguments up to this size become replicated DTensors on the
        mesh of the DTensor arguments; larger ones raise `TypeError` (convert them with `copy_to_mesh`).
      forbid: collective kinds the function's forward must not run (`"all_gather"`, `"all_to_all"`, ..., or
        `"all"`): a trace that would is a `TraceError` naming the op and its line (and, for a value constrained
        to two layouts, both constraints' lines). A whole step's forward and update must not run them.
      whole_step: trace a training step (forward, `backward()`, the optimizer's update) into one graph over the
        components, as `tf.function` does, rather than the graphs between torch.compile's breaks; its Python runs
        when traced only. See spmd/whole_step.py and docs/function.md.

    >>> mesh = create_mesh([("x", 2)])
    >>> @function(backend="eager")
    ... def f(a, b):
    ...     return (a * b).sum()
    >>> a = copy_to_mesh(torch.arange(4.), Layout(["x"], mesh))
    >>> f(a, torch.ones(4)).item(), f.experimental_get_tracing_count()
    (6.0, 1)
    """
    if fn is None:
        return functools.partial(function, backend=backend, mode=mode, dynamic=dynamic, fullgraph=fullgraph,
                                 out_layouts=out_layouts, max_autobroadcast_elements=max_autobroadcast_elements,
                                 forbid=forbid, whole_step=whole_step)
    return Function(fn, backend=backend, mode=mode, dynamic=dynamic, fullgraph=fullgraph, out_layouts=out_layouts,
                    max_autobroadcast_elements=max_autobroadcast_elements, forbid=forbid, whole_step=whole_step)


class Function:
    """A function traced and compiled over DTensors; see `spmd.function`."""

    def __init__(self, fn, *, backend, mode, dynamic, fullgraph, out_layouts, max_autobroadcast_elements,
                 forbid=None, whole_step=False):
        if dynamic:
            raise NotImplementedError(
                f"spmd.function({getattr(fn, '__qualname__', fn)!r}, dynamic=True): spmd's sharding rules decide "
                "layouts and collectives on static shapes, so dynamic shapes are not traced; leave dynamic=False "
                f"(each new shape is then a trace of its own, up to {MAX_TRACES} per function)")
        if whole_step and mode is not None and _uses_cuda_graphs(mode):
            raise ValueError(
                f"spmd.function({getattr(fn, '__qualname__', fn)!r}, whole_step=True, mode={mode!r}): a whole step "
                "is not captured as a CUDA graph yet (its state is not the graph's static input, and optimizers "
                "keep their step counts on the CPU), so its graph would run without one; leave mode unset (or "
                "'max-autotune-no-cudagraphs'), or use CUDA graphs without whole_step")
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._out_layouts = out_layouts
        self._fullgraph = fullgraph
        self.options = dict(backend=backend, mode=mode, dynamic=dynamic)
        self._max_broadcast = max_autobroadcast_elements
        self._forbid = forbidden_kinds(forbid)
        self._traces = 0
        self._warned_limit = False
        self._top_frame = None
        self._compile = _backend(backend, mode, dynamic)
        # each new layout is a trace: allow more than torch's default of 8 per function before it stops compiling
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, MAX_TRACES)
        self._compiled = torch.compile(_own_code(self._body), backend=self._counting, fullgraph=fullgraph,
                                       dynamic=dynamic, options={"guard_filter_fn": _needed_guards})
        self._whole_step = None
        if whole_step:
            self._whole_step = WholeStep(fn, self._body, self.__name__, self._compile, MAX_TRACES, self._forbid)

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # called inside another spmd.function (or torch.compile): part of its trace
            return self._body(*args, **kwargs)
        given = (args, kwargs)
        args, kwargs = self._broadcast(args, kwargs)
        mesh = _multi_client_mesh(args, kwargs)
        if mesh is not None:
            check_boundary(FUNCTION_CALL, mesh)
        try:
            if self._whole_step is not None:
                with _running:
                    out = self._whole_step(args, kwargs)
            else:
                out = self._run(args, kwargs)
        except RuntimeError as e:  # a collective of a compiled graph failed: say which call, as eager ops do
            if mesh is not None and not isinstance(e, errors.CollectiveError) and lost_peer(e):
                raise unreachable(f"spmd.function({self.__name__})", e) from e
            raise
        if args is not given[0] or kwargs is not given[1]:
            _write_back_plain(given, (args, kwargs))
        return out

    def _run(self, args, kwargs):
        traces, breaks = self._traces, _graph_breaks()
        try:
            with _running:
                out = self._compiled(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            self._warn_limit()
            with _running:
                return self._body(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:
            if _raised_in_trace(e):  # the function's own code (or spmd's checks) raised: as eagerly, with its error
                with _running:  # (should it not raise eagerly, the trace's error below stands)
                    self._body(*args, **kwargs)
            raise _failed_trace(self._fn, e) from None
        if self._traces != traces:
            self._warn_breaks(breaks)
        return out

    def _warn_limit(self) -> None:
        if not self._warned_limit:
            self._warned_limit = True
            warnings.warn(f"spmd.function({self.__name__}) was traced {self._traces} times, its limit: it now runs "
                          "eagerly for new signatures (new layouts, shapes, dtypes or Python scalar values; pass a "
                          "changing number as a 0-d tensor to make it an input)", stacklevel=4)

    def __get__(self, obj, objtype=None):  # a decorated method binds like a function
        return self if obj is None else functools.partial(self, obj)

    def experimental_get_tracing_count(self) -> int:
        """How many times `fn` was traced: once per new signature (layouts, shapes, dtypes of the arguments)."""
        return self._traces if self._whole_step is None else self._whole_step.count

    def explain(self, *args, backward: bool = False, **kwargs) -> Explanation:
        """Traces `fn` for these arguments without running it, and returns what its expansion does: every op with
        the layouts of its inputs and outputs, and every collective (`.collectives`: kind, mesh dims, bytes).

        With `backward=True` the (first) result that requires grad is also differentiated, and the backward's
        ops and collectives are listed too (marked `backward`). A function with a graph break is explained up
        to its first break. A whole step (`whole_step=True`) is explained whole: its backward and update included.
        """
        args, kwargs = self._broadcast(args, kwargs)
        if self._whole_step is not None:  # the whole step: its backward and update are in it
            with _running:
                return self._whole_step.explain(args, kwargs)
        recorder = Recorder()

        def capture(gm, example_inputs):
            hoist_relayouts(gm)
            # the graph runs op by op on fake components: every rule decides, no kernel computes, nothing mutates
            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            inputs = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
            with fake_mode, recorder:
                outs = gm(*inputs)
                _resolve_results(recorder, outs, backward=False)
                if backward:
                    _resolve_results(recorder, _differentiate(outs, inputs), backward=True)
            raise _Captured

        try:
            with _running:
                torch.compile(_own_code(self._body), backend=capture, dynamic=self.options["dynamic"],
                              fullgraph=self._fullgraph)(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:
            if not isinstance(getattr(e, "inner_exception", None), _Captured):
                raise _failed_trace(self._fn, e) from None
        return recorder.explanation

    # -- what Dynamo traces -----------------------------------------------------------------------------------
    def _body(self, *args, **kwargs):
        out = self._fn(*args, **kwargs)
        return out if self._out_layouts is None else _constrain(out, self._out_layouts)

    def _counting(self, gm, example_inputs):
        frame = torch._guards.CompileContext.current_compile_id()
        frame_id = getattr(frame, "frame_id", None)
        if self._top_frame is None:
            self._top_frame = frame_id
        if frame_id == self._top_frame:
            self._traces += 1
        hoist_relayouts(gm)
        if self._forbid:
            check_forbidden(gm, example_inputs, self._forbid, self.__name__)
        remote = _remote_of(gm, example_inputs)
        if remote is not None:  # a single-controller mesh: its workers compile the graph (spmd.controller)
            return remote.compile_graph(self, gm, example_inputs)
        return self._compile(gm, example_inputs)

    def _broadcast(self, args, kwargs):
        """The seeds' autobroadcast: plain tensor arguments become replicated DTensors on the DTensors' mesh."""
        leaves = [*args, *kwargs.values()]
        if not all(map(_is_leaf, leaves)):  # (the common case: no containers)
            leaves = pytree.tree_leaves(leaves)
        mesh = next((t._layout.mesh for t in leaves if isinstance(t, DTensor)), None)
        if mesh is None or not any(_is_plain(t) for t in leaves):
            return args, kwargs

        def convert(t):
            if not _is_plain(t):
                return t
            if t.numel() > self._max_broadcast:
                raise TypeError(
                    f"{self.__name__}: a plain tensor argument of shape {list(t.shape)} ({t.numel()} elements) is "
                    f"larger than max_autobroadcast_elements={self._max_broadcast}, so it is not replicated on "
                    f"every device implicitly. Distribute it first: spmd.copy_to_mesh(t, layout), or raise the "
                    "limit with spmd.function(..., max_autobroadcast_elements=N)")
            dt = copy_to_mesh(t, Layout.replicated(mesh, t.dim()))
            dt._broadcast = (dt._stack, dt._stack._version)  # (to see whether the function writes it)
            return dt

        return pytree.tree_map(convert, (args, kwargs))

    def _warn_breaks(self, before: dict) -> None:
        new = [r for r, n in _graph_breaks().items() if n > before.get(r, 0)
               and not any(e in r for e in _EXPECTED_BREAKS)]
        if new:
            warnings.warn(f"spmd.function({self.__name__}): parts of the function run eagerly (graph breaks): "
                          + "; ".join(r.splitlines()[0] for r in new), stacklevel=3)


def active() -> bool:
    """Whether an `spmd.function` is running (tracing, or calling its compiled graphs)."""
    return _ACTIVE[0] > 0


class _Running:
    """An `spmd.function` running. The seeds' rule: a tensor the function makes without a layout (`torch.ones`,
    `torch.arange`) takes the layout propagation gives it where it meets DTensors — replicated, which the rules
    then shard as the ops need. (Traces run here, so the scope covers every traced op.) A class, not a generator:
    it is entered on every call."""

    __slots__ = ()

    def __enter__(self) -> None:
        _ACTIVE[0] += 1
        EAGER_IMPLICIT_REPLICATION.__enter__()

    def __exit__(self, *exc) -> bool:
        EAGER_IMPLICIT_REPLICATION.__exit__()
        _ACTIVE[0] -= 1
        return False


_running = _Running()


def _remote_of(gm, example_inputs):
    """The session of the single-controller mesh a graph's DTensors live on (None on a mesh of this process)."""
    attrs = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
    mesh = next((t._layout.mesh for t in [*example_inputs, *attrs] if isinstance(t, DTensor)), None)
    return None if mesh is None else mesh.remote


def _multi_client_mesh(args, kwargs):
    """The mesh of the arguments' DTensors when it spans several clients, else None."""
    if not clients.is_initialized() or clients.current().num_clients == 1:
        return None
    leaves = pytree.tree_leaves((args, kwargs))
    mesh = next((t._layout.mesh for t in leaves if isinstance(t, DTensor)), None)
    return mesh if mesh is not None and not mesh.is_fully_local() and mesh.remote is None else None


def _is_leaf(t) -> bool:
    return isinstance(t, torch.Tensor) or not (type(t) in pytree.SUPPORTED_NODES or isinstance(t, (tuple, list, dict)))


def _is_plain(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor)


def _constrain(out, layouts):
    if isinstance(layouts, Layout):
        return relayout(out, layouts)
    if layouts is None:
        return out
    if isinstance(layouts, dict):
        return type(out)({k: _constrain(v, layouts.get(k)) for k, v in out.items()})
    if isinstance(layouts, (list, tuple)) and isinstance(out, (list, tuple)) and len(layouts) == len(out):
        return type(out)(_constrain(o, l) for o, l in zip(out, layouts))
    raise TypeError(f"out_layouts {layouts!r} does not match the structure of the function's results")


def _backend(backend, mode, dynamic) -> Callable:
    """The compiler called on each captured graph (torch.compile's own resolution of backend and mode)."""
    if backend == "inductor":
        from torch._inductor import config, list_mode_options
        from torch._inductor.compile_fx import compile_fx
        patches = {"bucket_all_reduces_fx": "all",
                   "bucket_all_reduces_fx_bucket_size_determinator": graph_bucket_cap_mb}
        patches = {k: v for k, v in patches.items() if hasattr(config, k)}
        patches |= list_mode_options(mode, dynamic) if mode else {}
        return lambda gm, example_inputs: compile_fx(gm, example_inputs, config_patches=patches)
    if mode is not None:
        raise ValueError(f"mode={mode!r} applies to the inductor backend only, not {backend!r}")
    return torch._dynamo.lookup_backend(backend)


def _uses_cuda_graphs(mode: str) -> bool:
    from torch._inductor import list_mode_options
    return bool(list_mode_options(mode).get("triton.cudagraphs"))


def graph_bucket_cap_mb(bucket_index: int) -> float:
    """The size of each all-reduce bucket inductor forms in a compiled graph (a named function: the compiled
    graph cache pickles it)."""
    return GRAPH_BUCKET_CAP_MB


# guard type -> the source name (after a DTensor argument's own) of a guard that the argument's other guards imply
_IMPLIED_GUARDS = {"EQUALS_MATCH": ".__tensor_flatten__()[0]", "TENSOR_MATCH": "._inner"}


def _needed_guards(guards) -> list[bool]:
    """Dynamo's guards of a traced frame, less two per DTensor argument that its other guards imply: the one on the
    names of its inner tensors, which are always `["_inner"]`, and the one on its inner tensor, whose sizes, strides,
    dtype and device follow from the DTensor's own (guarded) sizes, dtype and device and its flattened metadata
    (layout, the stack's strides, how many devices share it). Each guard on a DTensor costs every call of the
    compiled code (a Python call, or an attribute read through a property)."""
    dtensors = {g.name for g in guards if g.guard_type == "TYPE_MATCH" and isinstance(g.value, DTensor)}

    def implied(g) -> bool:
        suffix = _IMPLIED_GUARDS.get(g.guard_type)
        return suffix is not None and g.name.endswith(suffix) and g.name[:-len(suffix)] in dtensors
    return [not implied(g) for g in guards]


def _own_code(method) -> Callable:
    """A function with a code object of its own: Dynamo caches traces (and counts recompiles) per code object,
    so each `spmd.function` and each `explain` keeps its own."""
    fn = method.__func__
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return types.MethodType(own, method.__self__)


def _write_back_plain(given, passed) -> None:
    """A plain tensor argument, replicated for the call (the seeds' autobroadcast), that the function wrote in
    place: its new value goes back into the caller's tensor, as torch.compile's own input mutations do."""
    for plain, dt in zip(pytree.tree_leaves(given), pytree.tree_leaves(passed)):
        if dt is not plain and isinstance(dt, DTensor) and (dt._stack, dt._stack._version) != dt._broadcast:
            with torch.no_grad():
                plain.copy_(one_copy(dt._local)[0])


def _raised_in_trace(e: Exception) -> bool:
    """Whether Dynamo stopped because the traced code raised an exception (which it cannot hand on as it was)."""
    cause = e
    while cause is not None:
        if isinstance(cause, torch._dynamo.exc.ObservedException):
            return True
        cause = getattr(cause, "inner_exception", None) or cause.__cause__ or cause.__context__
    return False


def _graph_breaks() -> dict:
    return dict(torch._dynamo.utils.counters["graph_break"])


def _failed_trace(fn, e: Exception) -> Exception:
    """What a failed trace raises, as eagerly: the error of spmd's own check that caused it (a rule's, a layout's, a
    forbidden collective's) or the exception the function's own code raised, both of which Dynamo wraps; else a
    TraceError for what Dynamo cannot trace; else Dynamo's error."""
    cause, raised = e, False
    while cause is not None:
        if type(cause).__module__ == errors.__name__ or (
                raised and not isinstance(cause, torch._dynamo.exc.TorchDynamoException)):
            return cause
        raised = raised or isinstance(cause, torch._dynamo.exc.ObservedException)
        cause = getattr(cause, "inner_exception", None) or cause.__cause__ or cause.__context__
    if isinstance(e, torch._dynamo.exc.Unsupported):
        return _trace_error(fn, e)
    if _reads_a_value(e):
        return _trace_error(fn, e, "it reads a tensor's value in Python (`.item()`, `int(t)`, `float(t)`)")
    return e


def _reads_a_value(e: Exception) -> bool:
    """Whether Dynamo failed on a Python number made from a tensor's value: a guard on it, or (as spmd's rules
    hash their arguments) an unbacked SymInt reaching an op on DTensors."""
    text = str(e)
    return (isinstance(e, torch._dynamo.exc.UserError) and "data-dependent" in text) or (
        isinstance(e, torch._dynamo.exc.TorchRuntimeError) and "SymInt" in text)


def _trace_error(fn, e: Exception, what: str | None = None) -> TraceError:
    lines = [line for line in str(e).splitlines() if line.strip()]
    where = [line.strip() for line in lines if line.strip().startswith("File ")]
    lines[0] = what or lines[0]
    if lines[0].startswith("Dynamic shape operator"):
        fix = (" (an op whose result's shape depends on the values: nonzero, x[mask], masked_select, unique, "
               "bincount). Call it outside the function, or pass fullgraph=False to run it eagerly between graphs.")
    elif lines[0].startswith("Attempted to wrap RNN"):
        fix = (": torch.compile does not trace recurrent modules (their fused kernels). Run the module outside the "
               "function (eager spmd keeps its batch sharded), or pass fullgraph=False to run it eagerly.")
    else:
        fix = (". Rewrite that line without Python control flow on tensor values, or pass fullgraph=False to run "
               "the untraceable part eagerly.")
    return TraceError(f"spmd.function could not trace {getattr(fn, '__qualname__', fn)!r} as one graph: {lines[0]}"
                      + (f" (at {where[-1]})" if where else "") + fix)


class _Captured(Exception):
    """Raised by explain's backend once the graph was expanded: nothing is compiled or run."""


def _differentiate(outs, inputs) -> tuple:
    """The gradients of the first result that requires grad, with respect to the inputs that require grad."""
    outs = outs if isinstance(outs, (list, tuple)) else (outs,)
    loss = next((o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad), None)
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if loss is None or not wrt:
        return ()
    return torch.autograd.grad(loss.sum() if loss.dim() else loss, wrt, allow_unused=True)


def _resolve_results(recorder: Recorder, results, backward: bool) -> None:
    """A compiled graph resolves the pending reductions of the DTensors it returns (see DTensor's flattening)."""
    for t in pending_dtensors(results):
        recorder.result(t, dispatch.resolve, backward)
