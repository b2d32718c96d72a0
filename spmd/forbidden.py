"""`spmd.function(..., forbid=kinds)`: a traced function must not communicate in ways the user ruled out.

Layouts are meant to make a program's communication explicit; a layout that silently needs an all-gather is a
performance bug that no value check catches. With `forbid`, each trace's forward graph is first run op by op on
fake components (every rule decides, nothing computes), and a collective of a forbidden kind is a `TraceError`
naming the op, the line of the user's function it comes from, and — where the collective only exists because one
value is constrained to two layouts — both constraints' lines. A whole step (spmd/whole_step.py) is checked while
it is traced (`Forbidding`).
"""

from __future__ import annotations

import os
import pathlib
import traceback

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from spmd.collectives import Kind
from spmd.dtensor import pending_dtensors
from spmd.engine import dispatch
from spmd.errors import TraceError
from spmd.explain import RESULT, Recorder
from spmd.ops import parse_layout

_RELAYOUT = torch.ops.spmd.relayout.default


def forbidden_kinds(forbid) -> frozenset:
    """The `Kind`s named by `forbid`: a kind's name, a sequence of them, or "all" (every data-moving kind)."""
    if forbid is None:
        return frozenset()
    names = [forbid] if isinstance(forbid, str) else list(forbid)
    if "all" in names:
        return frozenset(k for k in Kind if k is not Kind.SHARD)
    try:
        return frozenset(Kind(n) for n in names)
    except ValueError:
        raise ValueError(f"forbid={forbid!r}: expected collective kinds among "
                         f"{[k.value for k in Kind if k is not Kind.SHARD]}, or 'all'") from None


def check_forbidden(gm: torch.fx.GraphModule, example_inputs, kinds: frozenset, name: str) -> None:
    """Raises `TraceError` at the first op of `gm` whose expansion runs a collective of one of `kinds`."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    watcher = _Watcher(gm, kinds, name)
    try:
        with fake_mode, Recorder() as watcher.explanation, torch.no_grad():
            watcher.run(*inputs)
    except _Forbidden as e:  # raised afresh: fx's interpreter annotates exceptions that pass through it
        raise TraceError(e.message) from None


class Forbidding(Recorder):
    """Records what a whole step traced with `make_fx` runs (spmd/whole_step.py), and refuses as it happens a
    collective of `kinds` outside autograd's backward (in the step's forward or its update), naming the user's
    line that runs it."""

    def __init__(self, kinds: frozenset, name: str):
        super().__init__()
        self.kinds, self.name = kinds, name

    def collective(self, kind, mesh_dims, local) -> None:
        super().collective(kind, mesh_dims, local)
        c = self.explanation.collectives[-1]
        if c.kind in self.kinds and not c.backward:
            returning = self._open and self._open[-1][0] == RESULT
            where = "as the step returns its result" if returning else f"at {_caller_line()}"
            raise TraceError(f"spmd.function({self.name}, whole_step=True): {c.kind} over mesh dim(s) "
                             f"{list(c.mesh_dims)} ({c.bytes:,} B per device) {where}, but "
                             f"forbid={sorted(k.value for k in self.kinds)}. Change the layouts so that the op needs "
                             "no communication, or allow this kind of collective.")


def _caller_line() -> str:
    """The innermost frame of the running code outside spmd and torch (and the code they generate)."""
    library = (_PACKAGE[1:], f"{pathlib.Path(torch.__file__).parent}{os.sep}", "<string>", "<eval_with_key>")
    frame = next((f for f in reversed(traceback.extract_stack()) if not f.filename.startswith(library)), None)
    return "an unknown line" if frame is None else f'File "{frame.filename}", line {frame.lineno}: {frame.line}'


class _Forbidden(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class _Watcher(torch.fx.Interpreter):
    def __init__(self, gm, kinds, name):
        super().__init__(gm)
        self.kinds, self.name, self.explanation = kinds, name, None

    def run_node(self, node):
        before = len(self.explanation.collectives)
        out = super().run_node(node)
        if node.op == "output":  # a result's pending reduction runs as the graph returns it
            for t in pending_dtensors(out):
                dispatch.resolve(t)
        for c in self.explanation.collectives[before:]:
            if c.kind in self.kinds:
                raise _Forbidden(self._message(node, c))
        return out

    def _message(self, node, collective) -> str:
        where = "as the function returns its result" if node.op == "output" else f"at {_line(node)}"
        message = (f"spmd.function({self.name}): {collective.kind} over mesh dim(s) {list(collective.mesh_dims)} "
                   f"({collective.bytes:,} B per device) {where}, but forbid={sorted(k.value for k in self.kinds)}.")
        other = _other_constraint(node)
        if other is not None:
            message += (f" The value is constrained to two layouts: {_layout_of(other)} at {_line(other)} and "
                        f"{_layout_of(node)} at {_line(node)}; no single layout satisfies both without it.")
        return message + (" Change the layouts so that the op needs no communication, or allow this kind of "
                          "collective.")


def _other_constraint(node):
    """Another relayout of the same value with a different target, where `node` is a relayout."""
    if node.op != "call_function" or node.target is not _RELAYOUT:
        return None
    source = node.args[0]
    return next((u for u in source.users if u is not node and u.op == "call_function" and u.target is _RELAYOUT
                 and u.args[1] != node.args[1]), None)


def _layout_of(relayout_node) -> list:
    return parse_layout(relayout_node.args[1]).sharding_specs


def _line(node) -> str:
    """The user's source line of a graph node: the innermost frame of its stack trace outside spmd."""
    frames = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines() if line.strip()]
    files = [i for i, line in enumerate(frames) if line.startswith("File ") and _PACKAGE not in line]
    if not files:
        return f"op {node.name}"
    i = files[-1]
    code = frames[i + 1] if i + 1 < len(frames) and not frames[i + 1].startswith("File ") else ""
    return frames[i] + (f": {code}" if code else "")


_PACKAGE = f'"{pathlib.Path(__file__).parent}{os.sep}'
