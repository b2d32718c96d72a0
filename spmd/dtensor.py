"""The DTensor: a `torch.Tensor` with a global shape outside, a Layout and one component per device inside.

Components of all local devices are stored stacked in one tensor `_local` of shape `(L, *local_shape)`
(`L = mesh.num_local_devices()`), so that an op on 8 virtual devices is one kernel, not eight.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.utils._mode_utils import no_dispatch

from spmd import shards
from spmd.collectives.local import one_copy, share, shared, traced
from spmd.errors import LayoutError, MixedTensorError, UnsupportedOpError
from spmd.layout import Layout
from spmd.mesh import short_device_names
from spmd.ops import relayout_op
from spmd.tracing import prepare_dynamo

# The rule engine (a floor above) executes ops: it installs itself with `install_engine` when imported.
_engine = None
_parameter_class = None  # what `nn.Parameter(dtensor)` makes: DVariable (spmd/variable.py, a floor above)
_FUNCTIONAL = torch._C._TorchDispatchModeKey.FUNCTIONAL


def install_engine(engine) -> None:
    """Plugs in the object that runs DTensor ops: `engine.dispatch(func, args, kwargs)` for every aten op
    (`engine.torch_dispatch` is the same with `__torch_dispatch__`'s signature), `engine.resolve(tensor)` to
    resolve a tensor's pending reduction in place (`tensor._settle`), and `engine.distributed(value, layout)` to lay
    a plain global value out."""
    global _engine
    _engine = engine
    DTensor.__torch_dispatch__ = classmethod(engine.torch_dispatch)



class _EveryDim:
    """Dynamo's set of a tensor's dims marked static (`torch._dynamo.mark_static`), holding every dim."""

    def __contains__(self, dim) -> bool:
        return True

    def add(self, dim) -> None:
        pass


_EVERY_DIM = _EveryDim()


# a DTensor's distribution state, its instance attributes beyond torch's (see `DTensor.data`)
_STATE = ("_stack", "_layout", "_pending", "_pending_op", "_key", "_copied_view", "_view_of", "_bucket")


class DTensor(torch.Tensor):
    """A distributed tensor. Create one with `pack`, `copy_to_mesh`, `relayout` or a factory with `layout=`.

    Torch ops on DTensors run on every device's component (SPMD expansion) with the collectives inserted
    for you; autograd, `nn.Module` and `torch.optim` work unchanged.

    Its distribution state: `_layout` (per-axis sharding), the stacked components `_stack`, and a pending
    reduction — mesh dims `_pending` over which the components still have to be reduced with `_pending_op`
    (a contraction over a sharded axis leaves one). The global value is always the reduced one; whatever
    consumes the tensor resolves the reduction (`_local` is the resolved components).
    """

    _stack: torch.Tensor
    _layout: Layout
    _pending: tuple = ()
    _pending_op: str = "sum"
    _copied_view = False  # set on outputs of view ops that had to relayout (see engine/dispatch.py)
    _view_of = None  # and for those with a scatter inverse: (base, view op, its other arguments, kwargs); for a
    # view sharing such a view's memory (also marked copied): (that view, None, (), {})
    _bucket = None  # the gradient bucket reducing `_pending` across clients, if any (see spmd/buckets.py)

    # Ops reach `__torch_dispatch__` directly: no Python-level `__torch_function__` on the hot path.
    __torch_function__ = torch._C._disabled_torch_function_impl
    # torch.compile: every dim static, as spmd.function compiles (Dynamo would make a recompile's sizes dynamic,
    # which spmd's rules do not take); the components a graph takes likewise (see `_inner`)
    _dynamo_static_indices = _EVERY_DIM

    @staticmethod
    def __new__(cls, local: torch.Tensor, layout: Layout, shape: Sequence[int], requires_grad: bool = False,
                pending: tuple = (), pending_op: str = "sum", *, strides: Sequence[int] | None = None):
        # the global tensor's strides follow the components' memory order (a transposed weight looks transposed),
        # so torch's own stride logic (AccumulateGrad's layout contract, `.contiguous()`, torch.compile's guards)
        # sees what the components are; a caller that knows them (a detach, torch.compile) passes `strides`
        if strides is None and not local.is_contiguous():
            strides = dense_strides(local, shape)
        out = torch.Tensor._make_wrapper_subclass(cls, shape, strides=strides, dtype=local.dtype,
                                                  device=local.device, requires_grad=requires_grad)
        out._stack = local
        out._layout = layout
        if pending:
            out._pending, out._pending_op = pending, pending_op
            # whether autograd's engine made it: view ops pass a gradient's pending sum through (engine/rules/view.py)
            out._key = (layout, tuple(shape), local.dtype, pending, pending_op, torch._C._current_graph_task_id() >= 0)
        else:
            out._key = (layout, tuple(shape), local.dtype)  # the dispatcher's cache-key part for this tensor
        remote = layout.mesh.remote
        if remote is not None:  # a single-controller mesh (spmd.controller): its workers take the components
            return remote.adopt(out)
        return out

    @property
    def _is_param(self) -> bool:
        return self.__dict__.get("_is_param", False)

    @_is_param.setter
    def _is_param(self, value: bool) -> None:
        # `nn.Parameter(dtensor)` marks a detached DTensor so: it becomes a DVariable, spmd's parameter, as do the
        # parameters that `module.double()` and `module.to(dtype)` swap in (subclasses, such as a controller mesh's
        # twin or an XLAShardedTensor, stay themselves)
        if value and type(self) is DTensor:
            self.__class__ = _parameter_class
            self.variable_name = None
        else:
            self.__dict__["_is_param"] = value

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # replaced by the engine's own function when it is installed (one Python frame less per op)
        return _engine.dispatch(func, args, kwargs)

    @property
    def _local(self) -> torch.Tensor:
        """The stacked components `(L, *local_shape)`, with any pending reduction resolved first."""
        if self._pending:
            _engine.resolve(self)
        return self._stack

    def _settle(self, local: torch.Tensor, layout: Layout | None = None) -> None:
        """Takes `local` as its components (the engine resolved its pending reduction, or rebound it)."""
        self._stack = local
        if layout is not None:  # rebound by an in-place view op, which may have changed the stack's strides in place
            self._layout = layout
            local.__dict__.pop("_spmd_flat", None)
        self._pending = ()
        self._key = (self._layout, tuple(self.shape), local.dtype)

    @property
    def data(self) -> "DTensor":
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value: "DTensor") -> None:
        """`t.data = value`, as torch's utilities rebind a parameter (`vector_to_parameters`, pruning's `remove`):
        `t` takes `value`'s components, layout and shape, staying the same object (torch swaps only the wrapper's
        own metadata: its components would otherwise stay the old ones)."""
        if not isinstance(value, DTensor):
            raise MixedTensorError(
                f"cannot assign a plain torch.Tensor of shape {list(value.shape)} to the .data of a DTensor (layout "
                f"{self._layout.sharding_specs}): distribute it first, spmd.copy_to_mesh(value, "
                "spmd.fetch_layout(t))")
        if self._layout.mesh.remote is not None:
            raise UnsupportedOpError("assigning .data of a DTensor on a controller mesh is not supported: copy the "
                                     "value in instead (`with torch.no_grad(): t.copy_(value)`)")
        value = self._data_value(value)
        torch.Tensor.data.__set__(self, value)
        for name in _STATE:
            if name in value.__dict__:
                self.__dict__[name] = value.__dict__[name]
            else:
                self.__dict__.pop(name, None)

    def _data_value(self, value: "DTensor") -> "DTensor":
        """What `t.data = value` takes (a DVariable's layout stays its own)."""
        return value

    # -- torch.compile: a traceable wrapper subclass --------------------------------------------------------------
    # Dynamo and AOTAutograd see the stacked components as the one inner tensor, and the layout and the
    # components' strides as static metadata (guarded on: a compiled graph assumes both), so a compiled graph holds
    # plain kernels over the components and the collectives. A stack that every device shares (a value replicated
    # over the whole mesh: see collectives/local.py) enters and leaves a graph as its one copy, with the number of
    # devices sharing it as metadata, so the graph computes, and updates, it once. A pending reduction never crosses
    # a graph boundary: it is resolved here.
    # Compiled code's guards flatten every DTensor argument on every call (twice): the result is kept on the stack it
    # describes, for this layout (`_settle` drops it where an in-place view op rebinds the DTensor).
    def __tensor_flatten__(self):
        stack, layout = self._stack, self._layout
        if not self._pending:
            flat = stack.__dict__.get("_spmd_flat")
            if flat is not None and flat[0] is layout:
                return flat[1]
        prepare_dynamo()  # (already done when torch.compile imported Dynamo, unless its loader was unusual)
        if self._pending:
            stack = self._prepare_for_graph()
        flat = ["_inner"], (layout, stack.stride(), stack.shape[0] if shared(stack) else None)
        if type(stack) is torch.Tensor:  # (a traced stack is flattened once per trace)
            stack._spmd_flat = (layout, flat)
        return flat

    @property
    def _inner(self) -> torch.Tensor:
        """What a graph takes: the stack, or the one copy of a shared one (`collectives.local.share`). The same name
        in both cases, and never a view of a real tensor: Dynamo fakes a parameter's gradient with the parameter's
        symbolic context where both look alike, and with dynamic sizes (which spmd's rules do not take) where not."""
        stack = self._stack
        if type(stack) is torch.Tensor or not traced(stack):
            if not stack._is_view() and not shared(stack):
                if "_dynamo_static_indices" not in stack.__dict__:
                    stack._dynamo_static_indices = _EVERY_DIM
                return stack
            inner = getattr(stack, "_spmd_inner", None)  # (kept: guards compare their inputs' identities)
            if inner is None:
                with no_dispatch():  # (Dynamo reads a graph's inputs under its fake mode)
                    inner = stack._spmd_inner = (one_copy(stack) if shared(stack) else stack).detach()
                inner._dynamo_static_indices = _EVERY_DIM
            return inner
        if not shared(stack):
            return stack
        with _functionalising(stack):
            return one_copy(stack)

    @_inner.setter
    def _inner(self, inner: torch.Tensor) -> None:  # (AOTAutograd gives a gradient's inner tensor the traced strides)
        self._stack = share(inner, self._stack.shape[0]) if shared(self._stack) else inner

    def _prepare_for_graph(self) -> torch.Tensor:
        """Resolves the pending reduction (a graph's inputs and results carry none)."""
        with _functionalising(self._stack):
            _engine.resolve(self)
        return self._stack

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        layout, _, sharers = meta
        stack = inner["_inner"] if sharers is None else share(inner["_inner"], sharers)
        return DTensor.__new__(cls, stack, layout, tuple(outer_size), strides=tuple(outer_stride))

    def __coerce_same_metadata_as_tangent__(self, expected_meta, expected_type=None):
        """A gradient arriving at a compiled backward with another layout than the one traced is relayouted
        (AOTAutograd itself gives the components the traced strides); one shared copy or each device's own memory,
        as traced."""
        if expected_type is not None and not issubclass(expected_type, DTensor):
            return None
        layout, _, sharers = expected_meta
        grad = self if layout == self._layout else relayout_op(self, layout.to_string())
        stack = grad._stack
        if shared(stack) != (sharers is not None):
            # contiguous outer strides: AOTAutograd then makes the gradient contiguous with an op of our own, whose
            # result for a replicated value would be shared again
            stack = stack.contiguous() if sharers is None else share(stack[:1].contiguous(), sharers)
            grad = DTensor(stack, grad._layout, grad.shape)
        return grad

    @classmethod
    def __tangent_from_plain__(cls, plain: torch.Tensor, expected_meta) -> DTensor:
        """The gradient autograd gives a compiled function's DTensor output that the backward did not reach: plain
        zeros of its global shape (see `spmd.tracing`), laid out as traced."""
        return _engine.distributed(plain, expected_meta[0]).__coerce_same_metadata_as_tangent__(expected_meta)

    def _stable_hash_for_caching(self) -> str:
        """What AOTAutograd's cache keys a compiled graph's DTensor input on: everything the graph was traced for
        (layout, shapes, strides, dtype, pending sum), so that no other input reuses it."""
        stack = self._stack
        return (f"{self._layout.to_string()}|{tuple(self.shape)}|{self.dtype}|{self.requires_grad}|"
                f"{tuple(stack.shape)}|{stack.stride()}|{stack.device.type}|{self._pending}|{self._pending_op}")

    # -- torch.distributed.checkpoint's tensor-subclass protocol (as torch's own DTensor has) ------------------------
    # For DCP's save/load called without spmd.checkpoint's planners: every local device is a chunk of its own.
    def __create_write_items__(self, fqn: str, obj) -> list:
        return shards.create_write_items(self, fqn, obj)

    def __create_chunk_list__(self) -> list:
        return shards.create_chunk_list(self)

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return shards.get_tensor_shard(self, index)

    # -- what a user sees ----------------------------------------------------------------------------------------
    def __repr__(self, *, tensor_contents=None) -> str:
        layout = self._layout
        if type(self._local) is not torch.Tensor:  # fake or traced components (torch.compile logs them): no values
            value = f"<{type(self._local).__name__}>"
        elif layout.is_fully_replicated():
            value = _format(self._local[0])
        else:
            names = short_device_names(layout.mesh.local_devices())
            value = "{" + ", ".join(f'"{n}": {_format(c)}' for n, c in zip(names, self._local)) + "}"
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (f'DTensor({value}, layout="{layout.to_string()}", shape={tuple(self.shape)}, '
                f"dtype={self.dtype}{grad})")

    def __str__(self) -> str:
        return self.__repr__()

    def numpy(self, *, force: bool = False) -> np.ndarray:
        """The global value as a numpy array; only for a fully replicated DTensor, as in TF."""
        self._check_replicated("copy a non-replicated DTensor to numpy")
        return self._local[0].detach().cpu().numpy()

    def tolist(self):
        """The global value as (nested) Python lists; only for a fully replicated DTensor, as `numpy()`."""
        self._check_replicated("turn a non-replicated DTensor into Python lists")
        return self.numpy().tolist()

    def _check_replicated(self, what: str) -> None:
        if not self._layout.is_fully_replicated():
            raise LayoutError(
                f"Trying to {what} is not supported (it would gather every shard onto the host). Layout: "
                f"{self._layout.sharding_specs}, shape {list(self.shape)}. relayout it first: spmd.relayout(t, "
                f"spmd.Layout.replicated(mesh, rank={self.dim()})), or take spmd.to_global(t).")

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        local = self._local.detach()
        # (a copy that every device shares stays one)
        local = share(one_copy(local).clone(), local.shape[0]) if shared(local) else local.clone()
        copy = DTensor.__new__(type(self), local, self._layout, self.shape, self.requires_grad)
        skip = ("_stack", "_layout", "_key", "_pending", "_pending_op", "_grad_layout_hook", "_bucket")
        copy.__dict__.update({k: v for k, v in self.__dict__.items() if k not in skip})
        if copy.requires_grad:
            keep_grad_layout(copy)
        memo[id(self)] = copy
        return copy

    def requires_grad_(self, requires_grad: bool = True):
        super().requires_grad_(requires_grad)
        if requires_grad and self.is_leaf:
            keep_grad_layout(self)
        return self

    def __reduce_ex__(self, protocol):
        raise TypeError("a DTensor cannot be pickled directly; save it with spmd.checkpoint or unpack it first")


def _functionalising(stack: torch.Tensor):
    """A functionalisation mode to work on traced components in, where they are met outside one: AOTAutograd
    unwraps a traced function's outputs after leaving its mode."""
    if isinstance(stack, FunctionalTensor) and torch._C._get_dispatch_mode(_FUNCTIONAL) is None:
        return FunctionalTensorMode()
    return contextlib.nullcontext()


def _operator(torch_fn, reflected: bool = False):
    # torch's C operator slots turn a TypeError into NotImplemented, which would hide spmd's MixedTensorError
    # behind Python's generic "unsupported operand" (and make `dtensor == plain` silently False)
    if reflected:
        return lambda self, other: torch_fn(other, self)
    return lambda self, other: torch_fn(self, other)


for _name, _fn in {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "truediv": torch.div,
                   "matmul": torch.matmul, "pow": torch.pow, "eq": torch.eq, "ne": torch.ne, "lt": torch.lt,
                   "le": torch.le, "gt": torch.gt, "ge": torch.ge, "and": torch.bitwise_and, "or": torch.bitwise_or,
                   "xor": torch.bitwise_xor, "lshift": torch.bitwise_left_shift,
                   "rshift": torch.bitwise_right_shift}.items():
    setattr(DTensor, f"__{_name}__", _operator(_fn))
for _name, _fn in {"radd": torch.add, "rmul": torch.mul, "rmatmul": torch.matmul, "rpow": torch.pow,
                   "rand": torch.bitwise_and, "ror": torch.bitwise_or, "rxor": torch.bitwise_xor,
                   "rlshift": torch.bitwise_left_shift, "rrshift": torch.bitwise_right_shift}.items():
    setattr(DTensor, f"__{_name}__", _operator(_fn, reflected=True))
DTensor.__rsub__ = lambda self, other: torch.rsub(self, other)
DTensor.__rtruediv__ = lambda self, other: torch.reciprocal(self) * other  # as torch.Tensor.__rtruediv__
DTensor.__hash__ = torch.Tensor.__hash__  # defining __eq__ would otherwise make DTensors unhashable


_DENSE_STRIDES: dict = {}  # (stack strides, global shape) -> dense_strides


def dense_strides(local: torch.Tensor, shape: Sequence[int]) -> tuple[int, ...]:
    """Contiguous strides for `shape` in the memory order of the component axes of the stack `local` (the stack
    axis left out): the global tensor's strides."""
    key = (local.stride(), tuple(shape))
    strides = _DENSE_STRIDES.get(key)
    if strides is None:
        if len(_DENSE_STRIDES) >= 4096:  # (bounded: shapes that keep changing)
            _DENSE_STRIDES.clear()
        strides = _DENSE_STRIDES[key] = _dense_strides(local.stride()[1:], shape)
    return strides


def _dense_strides(component_strides, shape) -> tuple[int, ...]:
    order = sorted(range(len(shape)), key=lambda a: (component_strides[a], a), reverse=True)  # outermost first
    strides, step = [0] * len(shape), 1
    for a in reversed(order):
        strides[a] = step
        step *= max(shape[a], 1)
    return tuple(strides)


def _format(component: torch.Tensor) -> str:
    component = component.detach().cpu()
    if component.dtype in _WIDER_FOR_NUMPY:  # dtypes numpy lacks (bfloat16, float8, ...) print as float32
        component = component.to(_WIDER_FOR_NUMPY[component.dtype])
    return np.array2string(component.numpy(), separator=" ", threshold=64).replace("\n", "")


_WIDER_FOR_NUMPY = {torch.complex32: torch.complex64, torch.bfloat16: torch.float32,
                    torch.float8_e4m3fn: torch.float32, torch.float8_e5m2: torch.float32}


def make_parameters(cls: type) -> None:
    """Sets the class that `nn.Parameter(dtensor)` turns a DTensor into (spmd/variable.py's DVariable)."""
    global _parameter_class
    _parameter_class = cls


def keep_grad_layout(leaf: DTensor) -> None:
    """Relayouts gradients arriving at `leaf` to `leaf`'s layout, so `leaf.grad` has the leaf's layout."""
    if getattr(leaf, "_grad_layout_hook", None) is not None:
        return
    layout, shape = leaf._layout, leaf.shape  # (not the leaf: a reference from its own hook would keep it alive
    # and make torch's in-place swaps of a module's parameters, `model.double()`, refuse it)

    def to_leaf_layout(grad):
        if grad is None:
            return grad
        if not isinstance(grad, DTensor):  # a formula made it from scratch (zeros): a global value, laid out
            return _engine.distributed(grad.expand(shape).contiguous(), layout)
        if grad._layout is not layout and grad._layout != layout:  # a pending reduction of `grad` becomes a
            grad = relayout_op(grad, layout.to_string())  # reduce-scatter where it can
        return grad  # (AccumulateGrad gives it the leaf's strides, as for plain tensors)

    leaf._grad_layout_hook = leaf.register_hook(to_leaf_layout)


def make(local: torch.Tensor, layout: Layout, requires_grad: bool = False) -> DTensor:
    """Wraps stacked components `(L, *local_shape)`; the global shape follows from the layout."""
    shape = layout.global_shape_from_local_shape(local.shape[1:])
    return DTensor(local, layout, shape, requires_grad)


# -- the seeds' functions ----------------------------------------------------------------------------------------
def is_dtensor(tensor: Any) -> bool:
    """True for a DTensor (and a DVariable)."""
    return isinstance(tensor, DTensor)


def pending_dtensors(results) -> list[DTensor]:
    """The DTensors in `results` (nested lists, tuples, dicts) that carry a pending reduction: what a graph
    resolves as it returns them."""
    return [t for t in pytree.tree_leaves(results) if isinstance(t, DTensor) and t._pending]


def fetch_layout(tensor: Any) -> Layout | None:
    """The layout of a DTensor; None for a non-tensor Python value.

    Raises:
      TypeError: for a plain torch.Tensor (it has no layout; `copy_to_mesh` gives it one).
    """
    if isinstance(tensor, DTensor):
        return tensor._layout
    if isinstance(tensor, torch.Tensor):
        raise TypeError(f"fetch_layout expects a DTensor, got a plain torch.Tensor of shape {list(tensor.shape)}; "
                        "use spmd.copy_to_mesh(tensor, layout) to distribute it")
    return None


def check_layout(tensor: DTensor, layout: Layout) -> None:
    """Raises ValueError unless `tensor` has exactly `layout`."""
    actual = fetch_layout(tensor)
    if actual != layout:
        raise LayoutError(f"Layout of tensor: {actual!r}, did not match expected layout: {layout!r}")
