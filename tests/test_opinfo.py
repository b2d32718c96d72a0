"""OpInfo sweep: torch's own op database, run on DTensors, must give plain torch's answers.

`tests/test_ops_sweep.py` checks the ops a training step needs, chosen by hand. This module checks spmd against
every op of `torch.testing._internal.common_methods_invocations.op_db` that supports float32 on the CPU, on the
samples torch itself tests each op with, so the ops nobody thought of are checked too (ops whose values are
random or uninitialised, and sparse ones, are skipped). Up to three samples per op run on a 2x2 mesh in up to
three layout variants (replicated; the first tensor sharded over "x" on one axis; over "x" and "y" on two), and
each case ends in exactly one outcome:

- equal: the global value, the shape, the dtype and every device's component equal plain torch's (and so do
  the gradients, for floating outputs);
- unsupported: spmd raised `UnsupportedOpError` or `MixedTensorError` -- allowed only where
  `opinfo_expected.UNSUPPORTED` lists the (op, phase);
- torch's error: plain torch raised, and spmd raised the same exception type;
- a bug: a wrong value, a wrong component, or any other exception. Known bugs are `opinfo_expected.KNOWN_BUGS`,
  run as strict xfails: a fix fails the test until the entry is removed, and a new bug fails CI.

The default run checks `opinfo_expected.DEFAULT_OPS`, 90 ops across the families (about 20 s on two cores).
The full sweep of the other ~590 ops is marked `slow` and runs only with `SPMD_OPINFO_FULL=1` (about a minute
more), because CI's plain `pytest -q` runs slow tests too:

    SPMD_OPINFO_FULL=1 python -m pytest -q tests/test_opinfo.py

`python tests/test_opinfo.py [FIRST:LAST]` sweeps all ops (or a slice of them) outside pytest and prints a
markdown report: the outcome counts, the bugs, and which expectation entries are out of date;
`python tests/test_opinfo.py --docs` writes docs/ops.md (which ops have sharded rules, run replicated, raise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pathlib
import sys
import time
import warnings

import pytest
import torch
import torch.utils._pytree as pytree

import spmd
from spmd import UNSHARDED, Layout
from spmd.engine import fallback
from spmd.errors import MixedTensorError, UnsupportedOpError

import opinfo_expected as expected

FULL_SWEEP = os.environ.get("SPMD_OPINFO_FULL") == "1"
SAMPLES_PER_OP = 3
SAMPLES_LOOKED_AT = 40  # the first samples of an op, of which the most shardable are taken
# float32 sums in another order, and batched linalg kernels, differ from torch's in the last bits
RTOL, ATOL = 1e-4, 1e-5
BUG_KINDS = ("wrong value", "wrong component", "crash")


@functools.cache
def ops() -> dict:
    """The OpInfos of torch's op database that support float32 on the CPU, by id (`name.variant`). Loaded when
    first asked for (it takes seconds), not when pytest collects the default tests (it needs `expecttest`, one
    of the test extras)."""
    from torch.testing._internal.common_methods_invocations import op_db
    return {_op_id(op): op for op in op_db if torch.float32 in op.supported_dtypes("cpu")}


def _op_id(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


# -- samples and layouts ----------------------------------------------------------------------------------------------
def _tensors(sample) -> list[torch.Tensor]:
    """The sample's tensors in a fixed order: input, args, kwargs, lists and tuples looked into."""
    leaves = pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _shardable_axes(t: torch.Tensor) -> list[int]:
    return [axis for axis, size in enumerate(t.shape) if size >= 2 and size % 2 == 0]


def pick_samples(op) -> list:
    """Up to SAMPLES_PER_OP of the op's first samples (drawn with a fixed seed), those whose first tensor can be
    sharded on two axes first, then on one. Samples without tensors, with sparse ones, or with random values (a
    `dropout_p` above 0: spmd's random streams are its own) are left out."""
    samples = []
    with torch.random.fork_rng(devices=[]):  # a fixed seed, and the other tests' random state left as it was
        torch.manual_seed(0)
        for sample in op.sample_inputs("cpu", torch.float32, requires_grad=True):
            tensors = _tensors(sample)
            if tensors and all(t.layout == torch.strided for t in tensors) and not sample.kwargs.get("dropout_p"):
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


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(str(text).split())[:limit]


def _assert_tensor_close(got: torch.Tensor, want: torch.Tensor, kind: str, what: str) -> None:
    if got.shape != want.shape or got.dtype != want.dtype:
        raise Mismatch(kind, f"{what}: {got.dtype}{list(got.shape)}, torch gives {want.dtype}{list(want.shape)}")
    try:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, equal_nan=True)
    except AssertionError as e:
        raise Mismatch(kind, f"{what}: {_one_line(e)}") from None


def assert_same(got, want, what: str) -> None:
    """`got` (from DTensors) equals `want` (from plain tensors), looking into tuples and lists: a tensor globally
    and in each device's component, which must be the block of torch's value that its layout gives the device."""
    if isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            raise Mismatch("wrong value", f"{what}: {type(got).__name__} of {len(got)}, torch gives "
                                          f"{type(want).__name__} of {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{what}[{i}]")
    elif isinstance(want, torch.Tensor):
        if not spmd.is_dtensor(got):
            raise Mismatch("wrong value", f"{what}: a {type(got).__name__}, not a DTensor")
        want = want.detach()
        _assert_tensor_close(spmd.to_global(got).detach(), want, "wrong value", f"{what}, global value")
        layout = spmd.fetch_layout(got)
        blocks = spmd.unpack(spmd.copy_to_mesh(want, layout))
        for device, (component, block) in enumerate(zip(spmd.unpack(got), blocks)):
            _assert_tensor_close(component.detach(), block, "wrong component",
                                 f"{what}, component of device {device} (layout {layout.sharding_specs})")
    elif isinstance(got, torch.Tensor) or not (got == want or got != got and want != want):  # NaN == NaN here
        raise Mismatch("wrong value", f"{what}: {got!r}, torch gives {want!r}")


# -- running one case -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    """The outcome of one phase of one sample of an op in one layout variant."""

    op: str
    sample: int
    variant: str
    phase: str  # "forward" or "backward"
    kind: str  # "equal", "unsupported", "torch's error", or one of BUG_KINDS
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.op} sample {self.sample} {self.variant} {self.phase}: {self.kind}: {self.detail}"


def _call(fn):
    """(result, None) or (None, the exception fn raised)."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 -- every exception is an outcome here
        return None, e


def _outcome(want, want_error, got, got_error, what: str) -> tuple[str, str]:
    """The (kind, detail) of one phase: torch's result or error against spmd's."""
    if want_error is not None:
        if isinstance(got_error, type(want_error)):
            return "torch's error", type(want_error).__name__
        spmd_gives = f"{type(got_error).__name__}: {got_error}" if got_error else "a result"
        return "crash", _one_line(f"torch raises {type(want_error).__name__}, spmd gives {spmd_gives}")
    if isinstance(got_error, Mismatch):
        return got_error.kind, str(got_error)
    if got_error is not None:
        kind = "unsupported" if isinstance(got_error, (UnsupportedOpError, MixedTensorError)) else "crash"
        return kind, _one_line(f"{type(got_error).__name__}: {got_error}")
    try:
        assert_same(got, want, what)
    except Mismatch as e:
        return e.kind, str(e)
    except Exception as e:  # noqa: BLE001 -- a malformed result
        return "crash", _one_line(f"reading spmd's {what}: {type(e).__name__}: {e}")
    return "equal", ""


def _invoke(op, sample, tensors):
    inp, args, kwargs = _with_tensors(sample, tensors)
    return op(inp, *args, **kwargs)


def _loss_output(sample, out):
    """The first floating output (after the sample's own post-processing for gradients) that has a gradient."""
    for o in pytree.tree_leaves(sample.output_process_fn_grad(out)):
        if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad:
            return o
    return None


def _gradients(sample, out, leaves: list, weight: torch.Tensor) -> tuple:
    """Gradients of sum(output * weight) for the leaves that require grad (None where unused)."""
    o = _loss_output(sample, out)
    if o is None:
        raise Mismatch("wrong value", "no floating output has a gradient, torch's has")
    if spmd.is_dtensor(o):
        weight = spmd.copy_to_mesh(weight, spmd.fetch_layout(o))
    inputs = [leaf for leaf in leaves if leaf.requires_grad]
    return torch.autograd.grad((o * weight).sum(), inputs, allow_unused=True)


def run_case(op, sample, layouts: list[Layout]) -> list[tuple[str, str, str]]:
    """The (phase, kind, detail) outcomes of one sample in one layout variant: the forward, then the backward
    where torch's output is floating and has a gradient and the forward was equal."""
    tensors = _tensors(sample)
    plain = [_plain_leaf(t) for t in tensors]
    dist = [_dtensor_leaf(t, layout) for t, layout in zip(tensors, layouts)]
    want, want_error = _call(lambda: _invoke(op, sample, plain))
    got, got_error = _call(lambda: _invoke(op, sample, dist))
    outcomes = [("forward", *_outcome(want, want_error, got, got_error, "output"))]
    loss_output = _loss_output(sample, want) if want_error is None else None
    if outcomes[0][1] != "equal" or loss_output is None:
        return outcomes
    g = torch.Generator().manual_seed(1234)
    weight = torch.randn(loss_output.shape, generator=g, dtype=loss_output.dtype)
    want, want_error = _call(lambda: _gradients(sample, want, plain, weight))
    got, got_error = _call(lambda: _gradients(sample, got, dist, weight))
    outcomes.append(("backward", *_outcome(want, want_error, got, got_error, "gradients")))
    return outcomes


def sweep_op(name: str, mesh) -> list[Case]:
    """Every case of op `name`: each picked sample in each layout variant, forward and backward."""
    op = ops()[name]
    cases = []
    with warnings.catch_warnings():  # spmd's replicated-fallback notes and torch's deprecations: expected here
        warnings.simplefilter("ignore")
        for i, sample in enumerate(pick_samples(op)):
            for variant, layouts in layout_variants(_tensors(sample), mesh).items():
                for phase, kind, detail in run_case(op, sample, layouts):
                    cases.append(Case(name, i, variant, phase, kind, detail))
    return cases


# -- the tests --------------------------------------------------------------------------------------------------------
def assert_expected(name: str, cases: list[Case]) -> None:
    """No bug among the cases, and spmd's unsupported errors in exactly the phases `UNSUPPORTED` lists."""
    bugs = [c for c in cases if c.kind in BUG_KINDS]
    assert not bugs, f"{len(bugs)} of {len(cases)} cases differ from torch:\n" + "\n".join(map(str, bugs[:5]))
    unsupported = {c.phase for c in cases if c.kind == "unsupported"}
    allowed = set(expected.UNSUPPORTED.get(name, ()))
    unexpected = [c for c in cases if c.kind == "unsupported" and c.phase not in allowed]
    assert not unexpected, "unsupported, and not in opinfo_expected.UNSUPPORTED:\n" + "\n".join(
        map(str, unexpected[:5]))
    assert allowed <= unsupported, (f"{name} now supports its {sorted(allowed - unsupported)} cases: remove them from "
                                    "opinfo_expected.UNSUPPORTED")


def _params(names) -> list:
    """One pytest param per op: skipped ones with their reason, known bugs as strict xfails."""
    params = []
    for name in names:
        marks = []
        if name in expected.SKIPPED:
            marks.append(pytest.mark.skip(reason=expected.SKIPPED[name]))
        elif name in expected.KNOWN_BUGS:
            marks.append(pytest.mark.xfail(strict=True, reason=expected.KNOWN_BUGS[name]))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def _check(name: str, mesh) -> None:
    cases = sweep_op(name, mesh)
    if not cases:
        pytest.skip("no sample has a tensor to distribute (a factory)")
    assert_expected(name, cases)


@pytest.mark.parametrize("name", _params(expected.DEFAULT_OPS))
def test_opinfo_default_ops(mesh22, name):
    _check(name, mesh22)


_FULL_SWEEP_PARAMS = (_params(n for n in ops() if n not in expected.DEFAULT_OPS) if FULL_SWEEP
                      else [pytest.param(None, marks=pytest.mark.skip(reason="set SPMD_OPINFO_FULL=1"))])


@pytest.mark.slow
@pytest.mark.parametrize("name", _FULL_SWEEP_PARAMS)
def test_opinfo_full_sweep(mesh22, name):
    _check(name, mesh22)


def test_the_oracle_sees_a_wrong_value_and_a_wrong_component(mesh22):
    """The comparison itself: a wrong global value, and a right global value whose replicas disagree."""
    value = torch.arange(8.).reshape(2, 4)
    replicated = Layout.replicated(mesh22, 2)
    assert_same(spmd.copy_to_mesh(value, replicated), value, "output")
    with pytest.raises(Mismatch) as info:
        assert_same(spmd.copy_to_mesh(value + 1, replicated), value, "output")
    assert info.value.kind == "wrong value"
    diverged = spmd.pack([value, value, value, value + 1], replicated)  # device 3's replica is off
    with pytest.raises(Mismatch) as info:
        assert_same(diverged, value, "output")
    assert info.value.kind == "wrong component" and "device 3" in str(info.value)


def test_expectations_name_real_ops():
    """A misspelt or renamed op in the expectation lists would silently expect nothing."""
    listed = set(expected.SKIPPED) | set(expected.UNSUPPORTED) | set(expected.KNOWN_BUGS) | set(expected.DEFAULT_OPS)
    assert not listed - set(ops()), f"not in torch's op_db: {sorted(listed - set(ops()))}"


# -- the report -------------------------------------------------------------------------------------------------------
def _stale_entries(results: dict[str, list[Case]]) -> list[str]:
    """How the expectation lists differ from what the sweep saw."""
    notes = []
    for name, cases in results.items():
        bugs = [c for c in cases if c.kind in BUG_KINDS]
        unsupported = {c.phase for c in cases if c.kind == "unsupported"}
        listed = set(expected.UNSUPPORTED.get(name, ()))
        if bugs and name not in expected.KNOWN_BUGS:
            notes.append(f"`{name}`: a new bug, not in KNOWN_BUGS")
        if not bugs and name in expected.KNOWN_BUGS:
            notes.append(f"`{name}`: fixed, still in KNOWN_BUGS")
        if unsupported != listed:
            notes.append(f"`{name}`: unsupported in {sorted(unsupported)}, UNSUPPORTED lists {sorted(listed)}")
    return notes


def _outcome_table(cases: list[Case]) -> list[str]:
    """Markdown rows: per outcome, the number of forward and of backward cases."""
    def listed(c):
        return c.phase in expected.UNSUPPORTED.get(c.op, ())

    outcomes = {"equal": lambda c: c.kind == "equal",
                "torch's error, raised by spmd too": lambda c: c.kind == "torch's error",
                "unsupported, expected (listed)": lambda c: c.kind == "unsupported" and listed(c),
                "unsupported, not listed": lambda c: c.kind == "unsupported" and not listed(c),
                **{kind: lambda c, kind=kind: c.kind == kind for kind in BUG_KINDS}}
    rows = ["| outcome | forward | backward |", "|---|---|---|"]
    for outcome, matches in outcomes.items():
        counts = [sum(c.phase == phase and matches(c) for c in cases) for phase in ("forward", "backward")]
        rows.append(f"| {outcome} | {counts[0]} | {counts[1]} |")
    return rows


def _bug_lines(results: dict[str, list[Case]]) -> list[str]:
    """One line per op with a bug: its kinds, the reviewed reason where it is a known bug, the first case."""
    lines = []
    for name, cases in results.items():
        bugs = [c for c in cases if c.kind in BUG_KINDS]
        if bugs:
            kinds = ", ".join(sorted({c.kind for c in bugs}))
            first = bugs[0]
            reason = expected.KNOWN_BUGS.get(name, "NEW")
            lines.append(f"- `{name}` ({kinds}; {len(bugs)} of {len(cases)} cases): {reason}. First: {first.phase}, "
                         f"sample {first.sample}, {first.variant}: {first.detail[:160]}")
    return lines


def report(names: list[str], mesh) -> str:
    """A markdown report of the sweep of the ops `names`: outcome counts, the bugs, the stale expectations."""
    swept = [n for n in names if n not in expected.SKIPPED]
    started = time.perf_counter()
    results = {name: cases for name in swept if (cases := sweep_op(name, mesh))}
    seconds = time.perf_counter() - started
    everything = [c for cases in results.values() for c in cases]
    clean = [n for n, cases in results.items() if all(c.kind in ("equal", "torch's error") for c in cases)]
    buggy = _bug_lines(results)
    return "\n".join([
        f"# OpInfo sweep of spmd (torch {torch.__version__})", "",
        f"{len(names)} ops of op_db with float32 on the CPU: {len(names) - len(swept)} skipped (random, "
        f"uninitialised or sparse), {len(swept) - len(results)} without a tensor sample (factories); "
        f"**{len(results)} ops swept**, {len(everything)} cases (up to {SAMPLES_PER_OP} samples x 3 layout "
        f"variants x forward/backward) in {seconds:.0f} s on a 2x2 mesh.", "",
        *_outcome_table(everything), "",
        "Cases per layout variant (of them bugs): " + ", ".join(
            f"{variant} {sum(c.variant == variant for c in everything)} "
            f"({sum(c.variant == variant and c.kind in BUG_KINDS for c in everything)})"
            for variant in ("replicated", "sharded x", "sharded x,y")) + ".", "",
        f"Ops whose every case passes (equal, or torch's own error): {len(clean)} of {len(results)} "
        f"({100 * len(clean) / len(results):.1f}%); with unsupported cases but no bug: "
        f"{len(results) - len(clean) - len(buggy)}; with a bug: {len(buggy)}.", "",
        "## Wrong answers and crashes", "", *buggy, "",
        "## Expectation lists out of date", "", *[f"- {note}" for note in _stale_entries(results) or ["none"]],
    ])


# -- the docs page ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _fallbacks():
    """The aten ops that ran through spmd's replicated fallback inside the block."""
    saved, seen = set(fallback.FELL_BACK), set()
    fallback.FELL_BACK.clear()
    try:
        yield seen
    finally:
        seen.update(fallback.FELL_BACK)
        fallback.FELL_BACK.update(saved)


def docs_page(mesh) -> str:
    """docs/ops.md: which ops of torch's op database have sharded rules, which run replicated, which raise."""
    swept = [n for n in ops() if n not in expected.SKIPPED]
    results, fell = {}, {}
    for name in swept:
        with _fallbacks() as seen:
            cases = sweep_op(name, mesh)
        if cases:
            results[name], fell[name] = cases, seen
    unsupported = {n: sorted({c.phase for c in cases if c.kind == "unsupported"}) for n, cases in results.items()}
    unsupported = {n: phases for n, phases in unsupported.items() if phases}
    replicated = {n: sorted(str(f) for f in seen) for n, seen in fell.items() if seen and n not in unsupported}
    sharded = len(results) - len(unsupported) - len(replicated) - len(expected.KNOWN_BUGS)
    return "\n".join([
        "# Op support", "",
        f"Written by `python tests/test_opinfo.py --docs` (torch {torch.__version__}): every op of torch's op "
        f"database that supports float32 on the CPU, {len(results)} of them with tensor samples, swept on a 2x2 mesh "
        "replicated and sharded over one and two mesh dimensions, forward and backward, against plain torch "
        "(values, gradients and every device's component). What an op does on DTensors:", "",
        "| | ops |", "|---|---|",
        f"| sharded rules: runs where the data is, collectives only where the math needs them | {sharded} |",
        f"| replicated fallback: correct, but gathers sharded inputs on every device | {len(replicated)} |",
        f"| raises `UnsupportedOpError` / `MixedTensorError` (in some phase) | {len(unsupported)} |",
        f"| known bugs (strict xfails in the tests) | {len(expected.KNOWN_BUGS)} |",
        f"| not swept: random, uninitialised or sparse | {len(ops()) - len(swept)} |", "",
        "`spmd.cache_stats()['fallbacks']` lists the aten ops that ran replicated in a program, and each warns "
        "once.", "",
        "## Ops that raise", "", *[f"- `{n}`: {', '.join(p)}" for n, p in sorted(unsupported.items())], "",
        "## Known bugs", "", *([f"- `{n}`: {why}" for n, why in sorted(expected.KNOWN_BUGS.items())]
                               or ["None: every swept case ends equal to plain torch or in the clear errors above."]), "",
        "## Ops that run replicated (the aten ops without a sharded rule they reach)", "",
        *[f"- `{n}`: {', '.join(f'`{f}`' for f in fs)}" for n, fs in sorted(replicated.items())], ""])


if __name__ == "__main__":
    mesh = spmd.create_mesh([("x", 2), ("y", 2)])
    if sys.argv[1:] == ["--docs"]:
        page = pathlib.Path(__file__).resolve().parent.parent / "docs" / "ops.md"
        page.write_text(docs_page(mesh))
        print(f"wrote {page}")
        sys.exit()
    first, _, last = (sys.argv[1] if len(sys.argv) > 1 else ":").partition(":")
    names = list(ops())[int(first or 0):int(last) if last else None]
    print(report(names, mesh))
