"""OpInfo sweep: torch's own op database, run on DTensors, must give plain torch's answers.

`tests/test_ops_sweep.py` checks the ops a training step needs, chosen by hand. This module checks spmd against
every op of `torch.testing._internal.common_methods_invocations.op_db` that supports float32 on the CPU, on the
samples torch itself tests each op with, so the ops nobody thought of are checked too. Each sample runs on a
2x2 mesh in three layout variants (replicated; its first tensor sharded over "x" on one axis; over "x" and "y"
on two) and each case ends in exactly one outcome:

- equal: the global value, the shape, the dtype and every device's component equal plain torch's (and so do
  the gradients, for floating outputs);
- unsupported: spmd raised `UnsupportedOpError` or `MixedTensorError` -- allowed only where
  `opinfo_expected.UNSUPPORTED` lists the (op, phase);
- torch's error: plain torch raised, and spmd raised the same exception type;
- a bug: a wrong value, a wrong component, or any other exception. Known bugs are `KNOWN_BUGS`, run as strict
  xfails: a fix fails the test until the entry is removed, and a new bug fails CI.

The default run checks `opinfo_expected.DEFAULT_OPS` (about 60 ops across families, under 90 s on two cores).
The full sweep (~700 ops) is marked `slow` and runs only with `SPMD_OPINFO_FULL=1`, because CI's plain
`pytest -q` runs slow tests too:

    SPMD_OPINFO_FULL=1 python -m pytest -q tests/test_opinfo.py

`python tests/test_opinfo.py [FIRST:LAST]` sweeps the ops (a slice of them) outside pytest and prints a
markdown summary of the outcomes.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import types
import unittest
import warnings

import pytest
import torch
import torch.utils._pytree as pytree

import spmd
from spmd import UNSHARDED, Layout
from spmd.errors import MixedTensorError, UnsupportedOpError

import opinfo_expected as expected

FULL_SWEEP = os.environ.get("SPMD_OPINFO_FULL") == "1"
SAMPLES_PER_OP = 3
SAMPLES_LOOKED_AT = 12  # of which the first SAMPLES_PER_OP that can be sharded are taken
# float32 sums in another order, and batched linalg kernels, differ from torch's in the last bits
RTOL, ATOL = 1e-4, 1e-5
BUG_KINDS = ("wrong value", "wrong component", "crash")


def _load_op_db() -> list:
    """torch's op database. Its module imports `expecttest` for the base class of torch's own TestCase, which
    this sweep does not use: where that package is not installed, a stand-in module takes its place."""
    if "expecttest" not in sys.modules:
        try:
            import expecttest  # noqa: F401
        except ImportError:
            sys.modules["expecttest"] = types.SimpleNamespace(TestCase=unittest.TestCase)
    from torch.testing._internal.common_methods_invocations import op_db
    return [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]


def op_id(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


OPS = {op_id(op): op for op in _load_op_db()}


# -- samples and layouts ----------------------------------------------------------------------------------------------
def _tensors(sample) -> list[torch.Tensor]:
    """The sample's tensors in a fixed order: input, args, kwargs, lists and tuples looked into."""
    leaves = pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _shardable_axes(t: torch.Tensor) -> list[int]:
    return [axis for axis, size in enumerate(t.shape) if size >= 2 and size % 2 == 0]


def pick_samples(op) -> list:
    """Up to SAMPLES_PER_OP of the op's first samples (drawn with a fixed seed), those whose first tensor can be
    sharded on two axes first, then on one. Samples without tensors, or with sparse ones, are left out."""
    torch.manual_seed(0)
    samples = []
    for sample in op.sample_inputs("cpu", torch.float32, requires_grad=True):
        tensors = _tensors(sample)
        if tensors and all(t.layout == torch.strided for t in tensors):
            samples.append(sample)
        if len(samples) == SAMPLES_LOOKED_AT:
            break
    # two shardable axes make all three variants; a stable sort keeps torch's order otherwise
    samples.sort(key=lambda s: -min(len(_shardable_axes(_tensors(s)[0])), 2))
    return samples[:SAMPLES_PER_OP]


def layout_variants(tensors: list[torch.Tensor], mesh) -> dict[str, list[Layout]]:
    """Per variant, one layout per tensor. The first tensor is sharded on its first shardable axis (over "x")
    or two (over "x" and "y"); tensors of its shape get its layout, the others are replicated."""
    first = tensors[0]
    axes = _shardable_axes(first)
    variants = {"replicated": [Layout.replicated(mesh, t.dim()) for t in tensors]}
    for name, dims in (("sharded x", ["x"]), ("sharded x,y", ["x", "y"])):
        if len(axes) < len(dims):
            continue
        specs = [UNSHARDED] * first.dim()
        for axis, dim in zip(axes, dims):
            specs[axis] = dim
        sharded = Layout(specs, mesh)
        variants[name] = [sharded if t.shape == first.shape else Layout.replicated(mesh, t.dim()) for t in tensors]
    return variants


def _with_tensors(sample, new_tensors: list):
    """(input, args, kwargs) of `sample` with its tensors replaced, in `_tensors` order, by `new_tensors`."""
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    it = iter(new_tensors)
    return pytree.tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def _plain_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(t.requires_grad)


def _dtensor_leaf(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    return spmd.copy_to_mesh(t.detach(), layout).requires_grad_(t.requires_grad)


# -- comparison -------------------------------------------------------------------------------------------------------
class Mismatch(AssertionError):
    """A result that differs from plain torch's; `kind` is "wrong value" or "wrong component"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _flat(out) -> list:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _assert_tensor_close(got: torch.Tensor, want: torch.Tensor, kind: str, what: str) -> None:
    if got.shape != want.shape or got.dtype != want.dtype:
        raise Mismatch(kind, f"{what}: {got.dtype}{list(got.shape)}, torch gives {want.dtype}{list(want.shape)}")
    try:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, equal_nan=True, check_device=False)
    except AssertionError as e:
        raise Mismatch(kind, f"{what}: {' '.join(str(e).split())[:300]}") from None


def assert_same(got, want, what: str) -> None:
    """`got` (from DTensors) equals `want` (from plain tensors): globally, and each device's component equals the
    block of torch's value that the output's layout gives that device."""
    got_items, want_items = _flat(got), _flat(want)
    if type(got) is not type(want) and not isinstance(want, torch.Tensor) or len(got_items) != len(want_items):
        raise Mismatch("wrong value", f"{what}: {type(got).__name__} of {len(got_items)}, torch gives "
                                      f"{type(want).__name__} of {len(want_items)}")
    for i, (g, w) in enumerate(zip(got_items, want_items)):
        where = f"{what} {i}" if isinstance(want, (list, tuple)) else what
        if not isinstance(w, torch.Tensor):
            if not (g == w or g != g and w != w):  # NaN equals NaN here
                raise Mismatch("wrong value", f"{where}: {g!r}, torch gives {w!r}")
            continue
        if not spmd.is_dtensor(g):
            raise Mismatch("wrong value", f"{where}: a {type(g).__name__}, not a DTensor")
        w = w.detach()
        _assert_tensor_close(spmd.to_global(g).detach(), w, "wrong value", f"{where}, global value")
        layout = spmd.fetch_layout(g)
        blocks = spmd.unpack(spmd.copy_to_mesh(w, layout))
        for device, (component, block) in enumerate(zip(spmd.unpack(g), blocks)):
            _assert_tensor_close(component.detach(), block, "wrong component",
                                 f"{where}, component of device {device} (layout {layout.sharding_specs})")


# -- running one case -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    sample: int
    variant: str
    phase: str  # "forward" or "backward"
    kind: str  # "equal", "unsupported", "torch's error", or one of BUG_KINDS
    detail: str = ""


def _call(fn):
    """(result, None) or (None, the exception fn raised)."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 -- every exception is an outcome here
        return None, e


def _outcome(want, want_error, got, got_error, check) -> tuple[str, str]:
    """The outcome of one phase: torch's result or error against spmd's, compared by `check(got, want)`."""
    if want_error is not None:
        if isinstance(got_error, type(want_error)):
            return "torch's error", type(want_error).__name__
        got_what = f"{type(got_error).__name__}: {got_error}" if got_error else "a result"
        return "crash", f"torch raises {type(want_error).__name__}, spmd gives {got_what}"[:300]
    if isinstance(got_error, (UnsupportedOpError, MixedTensorError)):
        return "unsupported", f"{type(got_error).__name__}: {' '.join(str(got_error).split())[:200]}"
    if got_error is not None:
        return "crash", f"{type(got_error).__name__}: {' '.join(str(got_error).split())[:300]}"
    try:
        check(got, want)
    except Mismatch as e:
        return e.kind, str(e)
    return "equal", ""


def _loss_output(sample, out):
    """The first floating output (after the sample's own post-processing for gradients) that has a gradient."""
    for o in _flat(sample.output_process_fn_grad(out)):
        if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad:
            return o
    return None


def _grads(sample, out, leaves, weight):
    """Gradients of sum(output * weight) for the leaves that require grad (None where unused)."""
    o = _loss_output(sample, out)
    if spmd.is_dtensor(o):
        weight = spmd.copy_to_mesh(weight, spmd.fetch_layout(o))
    inputs = [leaf for leaf in leaves if leaf.requires_grad]
    return torch.autograd.grad((o * weight).sum(), inputs, allow_unused=True)


def _assert_same_grads(got, want) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None or g is None:
            if (w is None) != (g is None):
                raise Mismatch("wrong value", f"gradient {i}: {g!r}, torch gives {w!r}")
            continue
        assert_same(g, w, f"gradient {i}")


def run_case(op, sample, layouts: list[Layout]) -> list[tuple[str, str, str]]:
    """The (phase, kind, detail) outcomes of one sample in one layout variant: forward, then backward where the
    output is floating, has a gradient, and the forward was equal."""
    tensors = _tensors(sample)
    plain = [_plain_leaf(t) for t in tensors]
    want, want_error = _call(lambda: _invoke(op, sample, plain))
    dist, dist_error = _call(lambda: [_dtensor_leaf(t, layout) for t, layout in zip(tensors, layouts)])
    if dist_error is not None:
        raise dist_error  # the layouts are valid for the shapes: distributing them must work
    got, got_error = _call(lambda: _invoke(op, sample, dist))
    forward = _outcome(want, want_error, got, got_error, lambda g, w: assert_same(g, w, "output"))
    outcomes = [("forward",) + forward]
    if forward[0] != "equal" or _loss_output(sample, want) is None:
        return outcomes
    o = _loss_output(sample, want)
    weight = torch.randn(o.shape, generator=torch.Generator().manual_seed(1234), dtype=o.dtype)
    want_grads, want_error = _call(lambda: _grads(sample, want, plain, weight))
    got_grads, got_error = _call(lambda: _grads(sample, got, dist, weight))
    outcomes.append(("backward",) + _outcome(want_grads, want_error, got_grads, got_error, _assert_same_grads))
    return outcomes


def _invoke(op, sample, tensors):
    inp, args, kwargs = _with_tensors(sample, tensors)
    return op(inp, *args, **kwargs)


def sweep_op(name: str, mesh) -> list[Case]:
    """Every case of op `name`: each picked sample in each layout variant, forward and backward."""
    op = OPS[name]
    cases = []
    for i, sample in enumerate(pick_samples(op)):
        for variant, layouts in layout_variants(_tensors(sample), mesh).items():
            for phase, kind, detail in run_case(op, sample, layouts):
                cases.append(Case(name, i, variant, phase, kind, detail))
    return cases
