"""What `torch.compile` needs to know about spmd, set up when torch.compile first imports Dynamo (or when spmd is
imported, if Dynamo is loaded already): importing Dynamo takes over a second, which `import spmd` does not pay.

- Layouts and meshes are immutable values: Dynamo may read them as constants (when a layout is made inside a
  compiled function, or read from an intermediate DTensor).
- A call that makes a DTensor from plain values and a layout (`spmd.ones(..., layout=)`, `copy_to_mesh`) enters
  the graph whole (`ops.born_with_layout`).
- spmd's own Python (the dispatcher, rules, planner, collectives) runs at trace time inside AOTAutograd, never as
  a Dynamo frame of its own: where a user's function has a graph break, Dynamo would otherwise try to compile
  `__torch_dispatch__` called from the eager part.
- spmd's rules decide what a traced graph holds, so torch.compile's on-disk caches (FX graphs, AOTAutograd)
  are keyed on spmd's source too: a changed rule never reuses a graph traced with the old one.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.util
import pathlib
import sys
import types

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from spmd.layout import Layout
from spmd.mesh import Mesh
from spmd.ops import call_born_with_layout

_READY = False
_CONSTANT_TYPES = [Layout, Mesh]


def register_constant_type(cls: type) -> None:
    """Lets Dynamo read values of `cls` (an immutable Mesh or Layout subclass) as constants."""
    _CONSTANT_TYPES.append(cls)
    if _READY:
        _register_constant_types()


def prepare_dynamo() -> None:
    global _READY
    if _READY:
        return
    _READY = True
    _register_constant_types()
    torch.compiler.allow_in_graph(call_born_with_layout)
    _skip_spmd_frames()
    _check_subclass_grads_by_their_inner_tensors()
    _key_subclasses_in_the_autograd_cache()
    _take_plain_tangents_for_subclass_outputs()
    _keep_step_counts_of_controller_parameters()
    tag = f"spmd-{source_digest()}"
    if tag not in torch.compiler.config.cache_key_tag:
        torch.compiler.config.cache_key_tag += tag


def prepare_when_dynamo_loads() -> None:
    """Prepares Dynamo now if it is loaded, else right after the import that loads it (torch.compile's first call),
    so that a compiled function may make a DTensor with a layout before it meets any DTensor."""
    if "torch._dynamo" in sys.modules:
        prepare_dynamo()
    elif not any(isinstance(finder, _DynamoImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DynamoImportHook())


class _DynamoImportHook(importlib.abc.MetaPathFinder):
    """Finds `torch._dynamo` as the other finders do, and prepares it once its module has run."""

    def find_spec(self, name, path, target=None):
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def run_then_prepare(module):
            run_module(module)
            torch._dynamo = module  # (the import binds it only after this returns)
            prepare_dynamo()

        spec.loader.exec_module = run_then_prepare
        return spec


@functools.cache
def source_digest() -> str:
    """A digest of spmd's Python source (all of it: rules, planner, collectives, the DTensor)."""
    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _register_constant_types() -> None:
    try:  # a private table of torch; without it a layout read inside a compiled function is a graph break
        from torch._dynamo.variables.builder import SourcelessBuilder
        from torch._dynamo.variables.user_defined import UserDefinedObjectVariable
        for cls in _CONSTANT_TYPES:
            SourcelessBuilder._type_handlers[cls] = lambda tx, value: UserDefinedObjectVariable(value)
    except (ImportError, AttributeError):
        pass


def _check_subclass_grads_by_their_inner_tensors() -> None:
    """Under CUDA graphs (mode="reduce-overhead") Dynamo asks, for a compiled optimizer step, whether each gradient
    lives in CUDA-graph memory by reading its storage's address, which a wrapper subclass (a DTensor) does not have:
    it raised. A wrapper's gradient is asked about its inner tensors instead (the answer only decides a hint)."""
    try:  # a private function of torch; without it CUDA graphs stay unusable for a DTensor optimizer step
        from torch._dynamo.variables import optimizer
        is_static = optimizer._is_static_for_cudagraphs
    except (ImportError, AttributeError):
        return

    def is_static_by_inner_tensors(x):
        if is_traceable_wrapper_subclass(x):
            return all(is_static_by_inner_tensors(getattr(x, name)) for name in x.__tensor_flatten__()[0])
        return is_static(x)

    optimizer._is_static_for_cudagraphs = is_static_by_inner_tensors


def _key_subclasses_in_the_autograd_cache() -> None:
    """AOTAutograd's on-disk cache keys a graph on its example inputs, pickled. In torch 2.11 its pickler has no rule
    for tensor subclasses, so a DTensor input reached `DTensor.__reduce_ex__`, which refuses, and every graph
    of `spmd.function` was compiled anew in each process (with a warning). Such a pickler is taught what later
    ones do: a subclass that has `_stable_hash_for_caching` is keyed on it (a DTensor's names its layout, shapes,
    strides, dtype and pending sum)."""
    try:  # private classes of torch
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCachePickler
        from torch._inductor.codecache import _ident
    except ImportError:
        return
    if getattr(AOTAutogradCachePickler, "reducer_override", None) is not None:
        return  # torch keys subclasses itself

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and hasattr(obj, "_stable_hash_for_caching") and \
                is_traceable_wrapper_subclass(obj):
            return _ident, (obj._stable_hash_for_caching(),)
        return NotImplemented

    AOTAutogradCachePickler.reducer_override = reducer_override


def _take_plain_tangents_for_subclass_outputs() -> None:
    """A compiled function's output that the backward does not reach (`a, b = f(x); a.sum().backward()`, or a step
    that returns its logits with the loss it differentiates) gets a plain tensor of zeros as its gradient from
    autograd, where AOTAutograd expects the subclass it traced: it raised (torch issue 172556). A subclass that
    defines `__tangent_from_plain__(plain, meta)` (a DTensor: the plain tensor is a global value, laid out as traced)
    is given the plain tangent to convert."""
    try:  # a private class of torch; without it such a backward raises torch's error
        from torch._functorch._aot_autograd.runtime_wrappers import AOTDispatchAutograd
        from torch._functorch._aot_autograd.schemas import SubclassCreationMeta
        process = AOTDispatchAutograd.process_runtime_tangent
    except (ImportError, AttributeError):
        return

    def process_runtime_tangent(x, meta, *args, **kwargs):
        if type(x) is torch.Tensor and isinstance(meta, SubclassCreationMeta):
            from_plain = getattr(meta.original_subclass_type, "__tangent_from_plain__", None)
            if from_plain is not None:
                x = from_plain(x, meta.meta)
        return process(x, meta, *args, **kwargs)

    AOTDispatchAutograd.process_runtime_tangent = staticmethod(process_runtime_tangent)


def _keep_step_counts_of_controller_parameters() -> None:
    """Dynamo, tracing an optimizer's step, moves each parameter's step count from the CPU to the parameter's device,
    in the optimizer's own state. A controller DTensor's device is 'meta' (its components are on the workers), so
    the count lost its value for good, and the graph could not run. Such a count stays where it is: the controller's
    graph reads it as a plain CPU tensor and sends it with each call, as it does eagerly."""
    try:  # a private method of torch; without it a compiled optimizer step on a controller mesh raises
        from torch._dynamo.variables.optimizer import OptimizerVariable
        move = OptimizerVariable.move_step_if_cpu
    except (ImportError, AttributeError):
        return

    def move_step_if_cpu(self):
        on_meta = {p: state["step"] for p, state in self.value.state.items()
                   if "step" in state and isinstance(p, torch.Tensor) and p.is_meta}
        move(self)
        for p, step in on_meta.items():
            self.value.state[p]["step"] = step

    OptimizerVariable.move_step_if_cpu = move_step_if_cpu


def _skip_spmd_frames() -> None:
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:
        return
    skip = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)  # the frame and every frame it calls
    seen: set = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith(_RUNTIME):
            continue
        for value in vars(module).values():
            if getattr(value, "__module__", None) != name:
                continue
            members = vars(value).items() if isinstance(value, type) else [("", value)]
            for member_name, member in members:
                for function in _functions_of(member_name, member):
                    code = getattr(getattr(function, "__func__", function), "__code__", None)
                    if code is not None:
                        _skip_code_tree(code, lambda c: set_code_exec_strategy(c, skip), seen)


# the modules that run inside `__torch_dispatch__` or torch.compile's own runtime (this one's hook into AOTAutograd,
# called from a backward that a graph break leaves eager); the user-facing API, e.g. relayout, is inlined by Dynamo
_RUNTIME = ("spmd.engine", "spmd.collectives", "spmd.dtensor",
            "spmd.api", "spmd.ops", "spmd.controller", "spmd.tracing")
# properties that torch's compiled code reads at run time (a DTensor's inner tensor, `__tensor_flatten__`)
_READ_BY_COMPILED_CODE = ("_inner",)


def _functions_of(name: str, member) -> tuple:
    if isinstance(member, property):  # Dynamo inlines a property (`t._local`), unless compiled code reads it
        return (member.fget, member.fset) if name in _READ_BY_COMPILED_CODE else ()
    return (member,)


def _skip_code_tree(code: types.CodeType, skip, seen: set) -> None:
    stack = [code]
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        skip(c)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
