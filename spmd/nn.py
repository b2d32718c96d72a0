"""Distributing `nn.Module`s: `LayoutMap`, `distribute_module` and the high-level `Strategy`.

`distribute_module(model, mesh, layout_map)` turns every parameter of a model into a `DVariable` (and every
buffer into a DTensor) with the layout its name maps to, in place. A model built on the `meta` device is
materialised shard by shard: each device allocates only its own shard and the module's own
`reset_parameters()` initialises it; spmd's random ops are layout-invariant, so the values do not depend on the
mesh or the layouts. The forward of every distributed (sub)module runs under `spmd.implicit_replication()`: a plain
tensor it makes itself (position ids, a causal mask) holds a global value and is taken as replicated, so models
from the ecosystem run unchanged; the plain tensor arguments of the outermost call still raise `MixedTensorError`.
`Strategy` bundles a mesh, a batch dimension and a layout map (the seeds' `DTensorStrategy`).
"""

from __future__ import annotations

import collections
import inspect
import re
import types
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn

from spmd import local_functions, sharded_batch
from spmd.api import copy_to_mesh, relayout
from spmd.buckets import DEFAULT_BUCKET_CAP_MB, bucket_gradients
from spmd.creation import empty, zeros
from spmd.data import DTensorDataset
from spmd.dtensor import DTensor
from spmd.errors import IndivisibleError, LayoutError, MixedTensorError
from spmd.fsdp import Precision, gather_on_use, sharded_layout
from spmd.layout import UNSHARDED, Layout
from spmd.mesh import Mesh
from spmd.scope import EAGER_IMPLICIT_REPLICATION, default_mesh, implicit_replication, replicates_plain
from spmd.variable import DVariable

__all__ = ["LayoutMap", "distribute_module", "Strategy"]


# -- LayoutMap -----------------------------------------------------------------------------------------------------
class LayoutMap(collections.abc.MutableMapping):
    """An ordered mapping from regular expressions to layouts (the seeds' / Keras' `LayoutMap`).

    Keys are regular expressions matched against parameter and buffer names (as `named_parameters()` gives
    them, e.g. `"blocks.0.attn.qkv.weight"`) with `re.search`; values are a `Layout`, or a list of sharding
    specs (`["model", UNSHARDED]`) that `distribute_module` resolves against its mesh (or `mesh=` here).

    `layout_map[name]` returns the value of a key equal to `name` if there is one, else of the first key (in
    insertion order) whose regex matches `name`, else None; it never raises `KeyError`.

    Args:
      mapping: optional initial `{regex: Layout or specs}` (insertion order is kept); a `Mesh` in its place is
        taken as `mesh=` (Keras' `LayoutMap(mesh)`).
      mesh: optional mesh that spec lists are resolved against when stored.

    >>> mesh = create_mesh([("batch", 2), ("model", 2)])
    >>> layout_map = LayoutMap({r"fc1\\.weight": ["model", UNSHARDED], r"fc1\\.bias": ["model"]})
    >>> layout_map[r".*\\.weight$"] = Layout.replicated(mesh, 2)  # every other weight
    >>> layout_map["fc1.weight"], layout_map["fc1.bias"], layout_map["fc2.bias"]
    (['model', 'unsharded'], ['model'], None)
    >>> layout_map.layout_for("fc1.weight", (8, 4), mesh).sharding_specs
    ['model', 'unsharded']
    """

    def __init__(self, mapping: Mapping[str, Any] | Mesh | None = None, mesh: Mesh | None = None):
        if isinstance(mapping, Mesh) and mesh is None:
            mapping, mesh = None, mapping
        if mapping is not None and not isinstance(mapping, collections.abc.Mapping):
            raise TypeError(f"LayoutMap takes a mapping of regular expressions to layouts, got a "
                            f"{type(mapping).__name__}: "
                            "LayoutMap({r'fc1\\.weight': ['model', UNSHARDED]}, mesh=mesh)")
        if mesh is not None and not isinstance(mesh, Mesh):
            raise LayoutError(f"LayoutMap's mesh must be a spmd.Mesh, got {type(mesh).__name__}")
        self.mesh = mesh
        self._map: dict[str, Any] = {}
        self._patterns: dict[str, re.Pattern] = {}
        for key, value in (mapping or {}).items():
            self[key] = value

    def __setitem__(self, key: str, value) -> None:
        if not isinstance(key, str):
            raise TypeError(f"LayoutMap keys are regular expressions (str), got {type(key).__name__} {key!r}")
        try:
            pattern = re.compile(key)
        except re.error as e:
            raise ValueError(f"LayoutMap key {key!r} is not a valid regular expression: {e}") from None
        if isinstance(value, Layout):
            stored = value
        elif isinstance(value, (list, tuple)) and all(
                isinstance(s, str) or (isinstance(s, (list, tuple)) and all(isinstance(d, str) for d in s))
                for s in value):  # a spec: a mesh dim, UNSHARDED, or a tuple of mesh dims sharding one axis
            stored = Layout(value, self.mesh) if self.mesh is not None else list(value)
        else:
            raise TypeError(f"LayoutMap values must be a spmd.Layout or a list of sharding specs, got "
                            f"{value!r} for key {key!r}")
        self._map[key] = stored
        self._patterns[key] = pattern

    def __getitem__(self, key: str):
        if key in self._map:
            return self._map[key]
        for k, pattern in self._patterns.items():
            if pattern.search(key):
                return self._map[k]
        return None

    def __delitem__(self, key: str) -> None:
        del self._map[key]
        del self._patterns[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key) -> bool:  # the keys themselves, not "has a match" (Mapping's default would ask [])
        return key in self._map

    def get(self, key, default=None):
        value = self[key]
        return default if value is None else value

    def __repr__(self) -> str:
        items = ", ".join(f"{k!r}: {v.sharding_specs if isinstance(v, Layout) else v!r}" for k, v in self.items())
        return f"LayoutMap({{{items}}})"

    def unmatched(self, names: Sequence[str]) -> list[str]:
        """The keys that match none of `names` (a misspelt or misplaced pattern: its layout would go unused)."""
        return [k for k, pattern in self._patterns.items() if not any(n == k or pattern.search(n) for n in names)]

    def layout_for(self, name: str, shape: Sequence[int], mesh: Mesh | None = None) -> Layout | None:
        """The `Layout` for a tensor `name` of global `shape` (spec lists resolved on `mesh`), or None.

        Raises:
          ValueError: the matched layout's rank differs from the tensor's, or a spec list without any mesh.
        """
        value = self[name]
        if value is None:
            return None
        if not isinstance(value, Layout):
            mesh = mesh if mesh is not None else self.mesh
            if mesh is None:
                raise LayoutError(f"the LayoutMap entry for {name!r} is a spec list {value!r}; give a mesh to "
                                  "resolve it (LayoutMap(..., mesh=mesh) or distribute_module(module, mesh, ...))")
            value = Layout(value, mesh)
        if value.rank != len(shape):
            raise LayoutError(f"the layout {value.sharding_specs} mapped to {name!r} has rank {value.rank}, but "
                              f"{name!r} has shape {list(shape)} (rank {len(shape)})")
        return value


def _as_layout_map(layout_map) -> LayoutMap:
    if layout_map is None:
        return LayoutMap()
    if isinstance(layout_map, LayoutMap):
        return layout_map
    if isinstance(layout_map, Mapping):
        return LayoutMap(layout_map)
    raise TypeError(f"layout_map must be a spmd.LayoutMap or a dict {{regex: layout}}, got "
                    f"{type(layout_map).__name__}")


# -- distribute_module ---------------------------------------------------------------------------------------------
def _reset_method(module: nn.Module):
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return None


def _plan(module: nn.Module, mesh: Mesh, layout_map: LayoutMap, kind: str):
    """[(tensor, [(owner, attr, qualified name), ...], layout)] for every distinct parameter or buffer."""
    named = module.named_parameters if kind == "parameter" else module.named_buffers
    groups: dict[int, list] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in named(remove_duplicate=False):
        if tensor is None:
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        groups.setdefault(id(tensor), []).append((owner, attr, name))
        tensors[id(tensor)] = tensor
    plan = []
    for key, places in groups.items():
        tensor = tensors[key]
        if kind == "buffer" and not tensor.is_floating_point() and tensor.dim() == 0:
            plan.append((tensor, places, None))  # an integer counter: stays plain (0-d tensors mix freely)
            continue
        shape = tuple(tensor.shape)
        layout, source = None, None
        for _, _, name in places:  # a tied tensor takes the layout its names map to; they must agree
            found = layout_map.layout_for(name, shape, mesh)
            if found is not None and layout is not None and found != layout:
                raise LayoutError(f"the {kind} shared as {source!r} and {name!r} is mapped to two layouts: "
                                  f"{layout.sharding_specs} and {found.sharding_specs}")
            if found is not None and layout is None:
                layout, source = found, name
        layout = layout or Layout.replicated(mesh, len(shape))
        try:
            layout.check_divisible(shape)
        except IndivisibleError as e:
            raise IndivisibleError(f"{kind} {places[0][2]!r} of shape {list(shape)}: {e}") from None
        plan.append((tensor, places, layout))
    return plan


def _warn_unmatched(layout_map: LayoutMap, module: nn.Module, plans) -> None:
    names = [name for _, places, _ in plans for _, _, name in places]
    for key in layout_map.unmatched(names):
        example = f" such as {names[-1]!r}" if names else ""
        warnings.warn(f"LayoutMap key '{key}' matches no parameter or buffer name of {type(module).__name__} "
                      f"(keys are regexes searched in names{example}), so its layout is not used", stacklevel=3)


def _set(places, value, kind: str) -> None:
    for owner, attr, _ in places:
        (owner._parameters if kind == "parameter" else owner._buffers)[attr] = value


def distribute_module(module: nn.Module, mesh: Mesh, layout_map=None,
                      init_fn: Callable[[str, DTensor], Any] | None = None, *,
                      bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, shard_parameters: str | None = None,
                      mp_policy=None, reshard_after_forward: bool = True) -> nn.Module:
    """Distributes `module` in place: parameters become `DVariable`s, buffers DTensors; returns `module`.

    Every parameter takes the layout `layout_map` maps its name to (see `LayoutMap`; a dict works too), or is
    replicated on `mesh`; its `requires_grad` is kept. Floating (and non-scalar) buffers become DTensors the same
    way, keeping their persistence; integer scalar buffers (counters such as BatchNorm's `num_batches_tracked`)
    stay plain tensors on the mesh's device, since 0-d tensors mix freely with DTensors. A tensor shared by
    several submodules (tied weights) stays shared: one DVariable under all its names.

    The forward of `module` and of each of its submodules then runs under `spmd.implicit_replication()` (their
    `forward` becomes an instance attribute wrapping the class's): a plain tensor the forward makes (positions
    from `arange`, a causal mask, an empty cache) holds a global value, and meeting DTensors it is taken as
    replicated. The plain tensor arguments (of rank > 0) of the outermost call, the one made from outside any
    distributed forward, raise `MixedTensorError`: data comes onto the mesh by the user's choice of layout
    (`copy_to_mesh`, `Strategy.distribute_batch`); plain tensors passed between submodules are inside and work.
    Traced by `spmd.function`, the scope holds as in eager and the arguments are not checked (the function's own
    plain arguments are broadcast).

    Parameters and buffers on a real device are copied onto the mesh (each device keeps its shard). Those on the
    `meta` device (a model built under `with torch.device("meta"):`) are materialised shard by shard: each
    device allocates only its shard (`spmd.empty`), then

    * without `init_fn`, the `reset_parameters()` (or `_reset_parameters()`) of every submodule that defines
      one is called under `torch.no_grad()`, children before parents (the order construction initialises
      them in; a tied tensor keeps the value of the first module that resets it, as with plain torch's
      construction followed by tying). `nn.init` runs on the DTensors with
      spmd's layout-invariant random ops, so the values depend on `torch.manual_seed` only, not on the mesh or
      the layouts (they differ from what plain torch draws). A meta buffer whose module has no reset method is
      set to zeros, with a warning naming it; a meta parameter whose module and ancestors have none raises.
    * with `init_fn(name, tensor)`, it is called instead, once per materialised parameter and buffer, with the
      qualified name and the uninitialised DVariable/DTensor; it fills `tensor` in place (returning None) or
      returns its value (a DTensor of the same layout, or a plain tensor that is copied onto the layout).
      Use layout-invariant initialisers (`nn.init.*`, `spmd.random.stateless_*` with `layout=`).

    Raises:
      ValueError (`LayoutError`): a mapped layout whose rank differs from the tensor's (naming it, its shape and
        the layout), a tied tensor mapped to two layouts, a meta parameter nothing initialises.
      ValueError (`IndivisibleError`): a sharded axis that does not divide by its number of shards.
      TypeError (`MixedTensorError`, when the module is called): a plain tensor argument of the outermost call.

    Warns:
      UserWarning: a `layout_map` key that matches no parameter or buffer name (a misspelt or misplaced
        pattern, whose tensors would silently stay replicated).

    On a mesh spanning several clients, gradients whose pending sum crosses clients are reduced during backward
    in buckets of `bucket_cap_mb` MB, one asynchronous all-reduce each, as DDP does (`spmd.buckets`;
    `spmd.no_sync(module)` accumulates micro-batches); `bucket_cap_mb=0` reduces each gradient when it is read.

    `shard_parameters="batch"` also shards every parameter over that mesh dim (FSDP / ZeRO-3; `spmd.fsdp`): on its
    first unsharded axis that divides (else as the minor mesh dim of a sharded one; else it stays as mapped), so
    parameters, gradients and optimizer state take 1/N of the memory per device; each submodule gathers its own
    parameters to their mapped layouts just before its forward and frees them after, gathering again in backward;
    gradients are reduce-scattered onto the shards. `mp_policy` (torch's FSDP2 `MixedPrecisionPolicy`) gathers them
    in its `param_dtype` and reduce-scatters gradients in its `reduce_dtype`; parameters, gradients and optimizer
    state keep their own dtype. `reshard_after_forward=False` keeps what backward needs of the gathered parameters
    from the forward instead of gathering them again (more memory, fewer gathers).

    Nothing is modified when a layout is invalid: every layout is checked before the first tensor moves.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"distribute_module expects an nn.Module, got {type(module).__name__}")
    if not isinstance(mesh, Mesh):
        raise LayoutError(f"distribute_module expects a spmd.Mesh, got {type(mesh).__name__}")
    layout_map = _as_layout_map(layout_map)
    params = _plan(module, mesh, layout_map, "parameter")
    buffers = _plan(module, mesh, layout_map, "buffer")
    _warn_unmatched(layout_map, module, params + buffers)
    compute_layouts = [layout for _, _, layout in params]
    precision = Precision.of(mp_policy)
    if shard_parameters is None and (precision is not None or not reshard_after_forward):
        raise ValueError("mp_policy and reshard_after_forward say how sharded parameters are gathered: give "
                         "shard_parameters=<the batch mesh dim> (for data parallelism's mixed precision, use "
                         "torch.autocast)")
    if shard_parameters is not None:
        params = [(t, places, sharded_layout(layout, tuple(t.shape), shard_parameters))
                  for t, places, layout in params]

    if init_fn is None:
        _check_initialisable(module, params)

    fresh: list[tuple[str, DTensor, list]] = []  # meta tensors materialised uninitialised
    gathered_to = {}  # id of a parameter -> its compute layout
    with torch.no_grad():
        for (tensor, places, layout), compute in zip(params, compute_layouts):
            gathered_to[id(tensor)] = compute
            if isinstance(tensor, DVariable) and tensor._layout == layout:
                continue
            requires_grad = tensor.requires_grad
            if tensor.is_meta:
                # dtype= makes DVariable adopt the fresh shards instead of copying them
                value = DVariable(empty(tuple(tensor.shape), dtype=tensor.dtype, layout=layout),
                                  requires_grad=requires_grad, dtype=tensor.dtype)
                fresh.append((places[0][2], value, places))
            else:
                value = DVariable(copy_to_mesh(tensor.detach(), layout), requires_grad=requires_grad,
                                  dtype=tensor.dtype)
            gathered_to[id(value)] = compute
            _set(places, value, "parameter")
        for tensor, places, layout in buffers:
            if layout is None:  # an integer counter
                device = mesh.torch_device
                value = torch.zeros((), dtype=tensor.dtype, device=device) if tensor.is_meta else \
                    tensor.to(device)
                if tensor.is_meta:
                    fresh.append((places[0][2], value, places))
            elif isinstance(tensor, DTensor) and tensor._layout == layout:
                continue
            elif tensor.is_meta:
                value = empty(tuple(tensor.shape), dtype=tensor.dtype, layout=layout)
                fresh.append((places[0][2], value, places))
            else:
                value = copy_to_mesh(tensor.detach(), layout)
            _set(places, value, "buffer")
    _forwards_on_mesh(module)
    gather_on_use(module, gathered_to, precision, reshard_after_forward)
    if not mesh.is_fully_local():
        bucket_gradients(module, bucket_cap_mb)

    if not fresh:
        return module
    with torch.no_grad():
        if init_fn is not None:
            for name, value, places in fresh:
                _apply_init(init_fn, name, value, places)
        else:
            _reset(module, fresh)
    return module


class _MeshForward:
    """The forward of a distributed module: the class's (or an earlier instance-level) forward, run under
    implicit replication, after checking the arguments of a call made from outside any distributed forward.

    An object rather than a closure: `copy.deepcopy(module)` copies it bound to the copy."""

    __slots__ = ("module", "inner")

    def __init__(self, module: nn.Module, inner: Callable | None):
        self.module, self.inner = module, inner

    @property
    def __wrapped__(self) -> Callable:  # `inspect.signature(module.forward)` is the module's own (HF reads it)
        return self.inner if self.inner is not None else types.MethodType(type(self.module).forward, self.module)

    def __call__(self, *args, **kwargs):
        if local_functions.running():  # one device's call inside spmd.local_map: its components, plain torch
            return self._call(args, kwargs)
        if torch.compiler.is_compiling():
            with implicit_replication():
                return self._forward(args, kwargs)
        if not replicates_plain():  # the outermost call
            _check_arguments(self, args, kwargs)
        with EAGER_IMPLICIT_REPLICATION:
            return self._forward(args, kwargs)

    def _forward(self, args, kwargs):
        if isinstance(self.module, sharded_batch.MODULES) and self.inner is None:
            out = sharded_batch.forward(self.module, args, kwargs)
            if out is not None:
                return out
        if isinstance(self.module, (nn.RNNBase, nn.RNNCellBase)):
            args, kwargs = _with_initial_state(self.module, args, kwargs)
            if not torch.compiler.is_compiling() and any(isinstance(a, DTensor) for a in args):
                # the CPU's fused oneDNN layer has no sharding rule: torch's step-by-step cells keep the batch
                # sharded where the fused layer would run replicated (an all-gather of the sequence)
                enabled = torch._C._get_mkldnn_enabled()  # (torch.backends.mkldnn.flags warns about TF32)
                torch._C._set_mkldnn_enabled(False)
                try:
                    return self._call(args, kwargs)
                finally:
                    torch._C._set_mkldnn_enabled(enabled)
        return self._call(args, kwargs)

    def _call(self, args, kwargs):
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)  # (Dynamo cannot trace MethodType)


def _with_initial_state(rnn: nn.Module, args, kwargs) -> tuple:
    """The arguments of a recurrent module's call, given zeros as initial state laid out like the input's batch
    where the call has none: torch makes plain zeros, whole on every device, so the first step's gate sums
    (in-place, into the state's layout) would gather the batch-sharded input's gates."""
    if not args or not isinstance(args[0], DTensor) or len(args) > 1 or kwargs.get("hx") is not None:
        return args, kwargs
    kwargs = {k: v for k, v in kwargs.items() if k != "hx"}  # (`hx=None`: the state given below)
    x = args[0]
    cell = isinstance(rnn, nn.RNNCellBase)
    if x.dim() != (2 if cell else 3):  # unbatched: no batch axis to follow
        return args, kwargs
    batch_axis = 0 if cell or rnn.batch_first else 1
    batch_spec = x._layout.sharding_specs[batch_axis]
    lead = () if cell else (rnn.num_layers * (2 if rnn.bidirectional else 1),)
    specs = [UNSHARDED] * len(lead) + [batch_spec, UNSHARDED]
    sizes = [rnn.hidden_size] if cell or not rnn.proj_size else [rnn.proj_size]
    if isinstance(rnn, (nn.LSTM, nn.LSTMCell)):
        sizes.append(rnn.hidden_size)  # the cell state
    states = tuple(zeros(*lead, x.shape[batch_axis], size, dtype=x.dtype, layout=Layout(specs, x._layout.mesh))
                   for size in sizes)
    return (x, states if len(states) > 1 else states[0]), kwargs


def _forwards_on_mesh(module: nn.Module) -> None:
    for sub in module.modules():
        if type(sub).forward is nn.Module.forward:  # containers (ModuleList, ModuleDict) have no forward
            continue
        inner = sub.__dict__.get("forward")
        if not isinstance(inner, _MeshForward):
            sub.forward = _MeshForward(sub, inner)


def _check_arguments(forward: _MeshForward, args, kwargs) -> None:
    if not any(_is_plain(t) for t in pytree.tree_leaves((args, kwargs))):
        return
    module = forward.module
    try:
        bound = inspect.signature(forward).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):  # no signature, or arguments it does not take: name them by position
        bound = {f"argument {i}": a for i, a in enumerate(args)} | kwargs
    for name, value in bound.items():
        for path, leaf in pytree.tree_leaves_with_path(value):
            if _is_plain(leaf):
                raise MixedTensorError(
                    f"{type(module).__name__}.forward got a plain torch.Tensor of shape {list(leaf.shape)} as "
                    f"`{name}{pytree.keystr(path)}`; the inputs of a distributed module are DTensors: copy it onto "
                    "the mesh with the layout it should have (spmd.copy_to_mesh(tensor, layout), "
                    "Strategy.distribute_batch). Plain tensors the forward makes itself are taken as replicated")


def _is_plain(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.dim() > 0


def _owner_chain(module: nn.Module, name: str) -> list[nn.Module]:
    parts = name.split(".")[:-1]
    chain = [module]
    for p in parts:
        chain.append(chain[-1].get_submodule(p))
    return chain


def _check_initialisable(module: nn.Module, params) -> None:
    missing = []
    for tensor, places, _ in params:
        if tensor.is_meta and not any(_reset_method(m) for _, _, name in places
                                      for m in _owner_chain(module, name)):
            missing.append(places[0][2])
    if missing:
        raise LayoutError(f"cannot initialise the meta parameters {missing}: no module owning them defines "
                          "reset_parameters(). Pass init_fn=(name, tensor) to distribute_module (with a "
                          "layout-invariant initialiser, e.g. nn.init or spmd.random.stateless_normal(..., "
                          "layout=spmd.fetch_layout(tensor))), or build the model on a real device")


def _post_order(module: nn.Module, seen: set) -> Iterator[nn.Module]:
    """Submodules children first, as construction initialises them (a parent's reset runs after its children's)."""
    if id(module) in seen:
        return
    seen.add(id(module))
    for child in module.children():
        yield from _post_order(child, seen)
    yield module


def _reset(module: nn.Module, fresh) -> None:
    done: set[int] = set()
    for sub in _post_order(module, set()):
        reset = _reset_method(sub)
        if reset is None:
            continue
        # a tensor tied to one an earlier module already initialised (e.g. an LM head tied to the embedding) keeps
        # that value, as in plain torch where the later module initialised its own tensor before the tying: this
        # reset writes into a scratch shard-sized tensor instead (drawing the same random numbers)
        swapped = {}
        for store in (sub._parameters, sub._buffers):
            for attr, t in store.items():
                if t is not None and id(t) in done and isinstance(t, DTensor):
                    scratch = empty(tuple(t.shape), dtype=t.dtype, layout=t._layout)
                    store[attr] = DVariable(scratch, dtype=t.dtype, requires_grad=t.requires_grad) \
                        if isinstance(t, DVariable) else scratch
                    swapped[(id(store), attr)] = (store, t)
        try:
            reset()
        finally:
            for (_, attr), (store, t) in swapped.items():
                store[attr] = t
        done.update(id(t) for store in (sub._parameters, sub._buffers) for t in store.values() if t is not None)
    covered = {id(m) for m in module.modules() if _reset_method(m) is not None}
    unreset = []
    for name, value, places in fresh:
        if isinstance(value, DVariable):
            continue  # checked up front: some owner (or ancestor) resets it
        if not any(id(owner) in covered for owner, _, _ in places):
            value.zero_()
            unreset.append(name)
    if unreset:
        warnings.warn(f"buffers {unreset} were on the meta device and no module owning them defines "
                      "reset_parameters(): they were set to zeros. Create such buffers with an explicit device "
                      "(e.g. torch.tril(torch.ones(n, n, device='cpu'))), recompute them in reset_parameters(), "
                      "or pass init_fn to distribute_module", stacklevel=3)


def _apply_init(init_fn, name: str, value, places) -> None:
    out = init_fn(name, value)
    if out is None or out is value:
        return
    if isinstance(value, DTensor):
        if not isinstance(out, DTensor):
            out = copy_to_mesh(out, value._layout)
        elif out._layout != value._layout:
            out = relayout(out, value._layout)
        value.copy_(out.to(value.dtype))
    else:
        value.copy_(torch.as_tensor(out, dtype=value.dtype))


# -- Strategy ------------------------------------------------------------------------------------------------------
class Strategy:
    """A mesh, a batch dimension and a layout map in one object (the seeds' `DTensorStrategy`), fitted to torch.

    * `distribute_model(module)`: `distribute_module(module, mesh, layout_map)`;
    * `distribute_batch(batch)`: every plain tensor of a (nested) tuple/list/dict copied onto the mesh, axis 0
      sharded over `batch_dim` and the other axes unsharded (replicated without `batch_dim`);
    * `distribute_dataset(dataset, global_batch_size)`: a `spmd.DTensorDataset` of batches split over `batch_dim`;
    * `scope()`: `spmd.default_mesh(mesh)`, so torch factories make DTensors on the mesh;
    * `run(step_fn, *args, **kwargs)`: `step_fn` on the distributed batch, inside `scope()`.

    Args:
      mesh: the `Mesh`. batch_dim: the mesh dimension that shards batches (None: replicated batches).
      layout_map: a `LayoutMap` or dict for `distribute_model` (None: every parameter replicated).
      bucket_cap_mb: the gradient bucket size of `distribute_model` on a multi-client mesh (0: no buckets).
      shard_parameters: `distribute_model` also shards parameters, gradients and optimizer state over
        `batch_dim` (FSDP / ZeRO-3; see `distribute_module`), with `mp_policy` and `reshard_after_forward`.
    """

    def __init__(self, mesh: Mesh, batch_dim: str | None = None, layout_map=None, *,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, shard_parameters: bool = False, mp_policy=None,
                 reshard_after_forward: bool = True):
        if not isinstance(mesh, Mesh):
            raise LayoutError(f"Strategy expects a spmd.Mesh, got {type(mesh).__name__}")
        if batch_dim is not None and batch_dim not in mesh:
            raise LayoutError(f"batch_dim {batch_dim!r} is not a dimension of the mesh (dimensions: "
                              f"{mesh.dim_names})")
        self.mesh = mesh
        self.batch_dim = batch_dim
        self.layout_map = _as_layout_map(layout_map)
        if shard_parameters and batch_dim is None:
            raise LayoutError("shard_parameters=True shards parameters over the batch dimension: give batch_dim")
        self.bucket_cap_mb = bucket_cap_mb
        self.shard_parameters = shard_parameters
        self.mp_policy, self.reshard_after_forward = mp_policy, reshard_after_forward

    def __repr__(self) -> str:
        return f"Strategy(mesh={self.mesh!r}, batch_dim={self.batch_dim!r}, layout_map={self.layout_map!r})"

    def batch_layout(self, rank: int) -> Layout:
        """The layout of a batch tensor of `rank`: axis 0 over `batch_dim`, the rest unsharded."""
        if self.batch_dim is None or rank == 0:
            return Layout.replicated(self.mesh, rank)
        return Layout.batch_sharded(self.mesh, self.batch_dim, rank)

    def distribute_model(self, module: nn.Module, init_fn=None) -> nn.Module:
        """`distribute_module(module, self.mesh, self.layout_map, init_fn, bucket_cap_mb=..., shard_parameters=...,
        mp_policy=..., reshard_after_forward=...)` (in place)."""
        return distribute_module(module, self.mesh, self.layout_map, init_fn=init_fn,
                                 bucket_cap_mb=self.bucket_cap_mb,
                                 shard_parameters=self.batch_dim if self.shard_parameters else None,
                                 mp_policy=self.mp_policy, reshard_after_forward=self.reshard_after_forward)

    def distribute_batch(self, batch):
        """Copies every plain tensor in `batch` (a tensor, or nested tuples, lists and dicts) onto the mesh with
        `batch_layout`; DTensors and non-tensors are returned unchanged."""
        if isinstance(batch, DTensor):
            return batch
        if isinstance(batch, torch.Tensor):
            return copy_to_mesh(batch, self.batch_layout(batch.dim()))
        if isinstance(batch, dict):
            return type(batch)((k, self.distribute_batch(v)) for k, v in batch.items())
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
            return type(batch)(*(self.distribute_batch(v) for v in batch))
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.distribute_batch(v) for v in batch)
        return batch

    def distribute_dataset(self, dataset, global_batch_size: int, layouts=None, **kwargs):
        """A `spmd.DTensorDataset` of `dataset` on this strategy's mesh, batches split over `batch_dim`.

        `layouts` defaults to `batch_layout` for every tensor of an element (derived from `dataset[0]`, so a
        map-style dataset is needed for the default; pass `layouts=` for an iterable). Other keyword arguments
        (`dataset_already_batched`, `prefetch`) go to `DTensorDataset`.
        """
        if layouts is None:
            if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
                raise TypeError(f"distribute_dataset derives the layouts from dataset[0], but a "
                                f"{type(dataset).__name__} has no random access: pass layouts= (one Layout per "
                                "tensor of an element, in its structure)")
            extra = 0 if kwargs.get("dataset_already_batched") else 1
            layouts = self._layouts_of(dataset[0], extra)
        return DTensorDataset(dataset, mesh=self.mesh, layouts=layouts, global_batch_size=global_batch_size,
                              batch_dim=self.batch_dim, **kwargs)

    def _layouts_of(self, element, extra: int):
        if isinstance(element, dict):
            return type(element)((k, self._layouts_of(v, extra)) for k, v in element.items())
        if isinstance(element, (list, tuple)):  # as DTensorDataset reads an element: a sequence of leaves
            return [self._layouts_of(v, extra) for v in element]
        return self.batch_layout(torch.as_tensor(element).dim() + extra)

    def scope(self) -> default_mesh:
        """A context manager making `self.mesh` the default mesh (`spmd.default_mesh`)."""
        return default_mesh(self.mesh)

    def run(self, step_fn: Callable, *args, **kwargs):
        """Calls `step_fn` on `distribute_batch(args)` and `distribute_batch(kwargs)` inside `scope()`."""
        args, kwargs = self.distribute_batch(args), self.distribute_batch(kwargs)
        with self.scope():
            return step_fn(*args, **kwargs)

