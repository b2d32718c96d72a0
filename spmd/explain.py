"""What a traced function does on a mesh: the layout of every op's result and every collective it issues.

The dispatcher and the collective backends report to the innermost active `Recorder` (none is active in
ordinary eager runs: a report costs one truthiness check). `spmd.function(fn).explain(...)` fills one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from spmd.collectives import Kind

RECORDERS: list = []  # the active recorders, innermost last
RESULT = "(result)"  # the row of a graph's result whose pending reduction is resolved as the graph returns it


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective: its kind (a `spmd.collectives.Kind`, equal to its name: `"all_reduce"`, `"all_gather"`,
    `"reduce_scatter"`, `"all_to_all"`, `"permute"`), the mesh dims it runs over, the bytes of each device's input
    component, and whether autograd's backward issued it."""
    kind: Kind
    mesh_dims: tuple
    bytes: int
    backward: bool = False
    op_index: int = -1  # the index in `Explanation.ops` of the op whose expansion issued it

    def __str__(self) -> str:
        phase = " (backward)" if self.backward else ""
        return f"{self.kind} over {','.join(self.mesh_dims)}: {self.bytes:,} B per device{phase}"


@dataclass(frozen=True)
class OpRecord:
    """One op as expanded: its name, the layouts (sharding specs) of its DTensor inputs and outputs."""
    op: str
    inputs: tuple
    outputs: tuple
    backward: bool = False


@dataclass
class Explanation:
    """The ops and collectives of one trace. `str()` is a readable table."""
    ops: list = field(default_factory=list)
    collectives: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = ["op | input layouts | output layouts | collectives", "---|---|---|---"]
        by_op: dict = {}
        for c in self.collectives:
            by_op.setdefault(c.op_index, []).append(c)
        for i, r in enumerate(self.ops):
            issued = by_op.get(i, [])
            lines.append(f"{r.op}{' (bwd)' if r.backward else ''} | {_specs(r.inputs)} | {_specs(r.outputs)} | "
                         + "; ".join(f"{c.kind}({','.join(c.mesh_dims)}) {c.bytes:,} B" for c in issued))
        total = sum(c.bytes for c in self.collectives)
        ops = sum(r.op != RESULT for r in self.ops)
        lines.append(f"\n{ops} ops, {len(self.collectives)} collectives, {total:,} B per device moved")
        return "\n".join(lines)


def _specs(layouts) -> str:
    return " ".join("[" + ",".join("+".join(a) if type(a) is tuple else a or "-" for a in axes) + "]"
                    for axes in layouts)


class Recorder:
    def __init__(self):
        self.explanation = Explanation()
        self._open: list = []  # (name, input layouts) of the ops being expanded (foreach ops nest)
        self._backward = None  # set while the results of a backward graph are recorded (see `results`)

    def __enter__(self):
        RECORDERS.append(self)
        return self.explanation

    def __exit__(self, *exc):
        RECORDERS.remove(self)

    def op_started(self, func, tensors) -> None:
        name = str(func).replace("aten.", "").replace(".default", "")
        self._open.append((name, tuple(t._layout.axes for t in tensors)))

    def op_finished(self, out) -> None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        name, inputs = self._open.pop()
        layouts = tuple(o._layout.axes for o in outs if hasattr(o, "_layout"))
        self.explanation.ops.append(OpRecord(name, inputs, layouts, self._in_backward()))

    def collective(self, kind: Kind, mesh_dims: tuple, local: torch.Tensor) -> None:
        per_device = local[0].numel() * local.element_size() if local.dim() else local.element_size()
        op_index = len(self.explanation.ops)  # the op being expanded is recorded when it finishes
        self.explanation.collectives.append(
            CollectiveRecord(kind, tuple(mesh_dims), per_device, self._in_backward(), op_index))

    def result(self, tensor, resolve, backward: bool) -> None:
        """Records a graph's result whose pending reduction is resolved as the graph returns it (`resolve`), as a
        row `(result)`."""
        self._backward = backward
        try:
            self.op_started(RESULT, (tensor,))
            resolve(tensor)
            self.op_finished(tensor)
        finally:
            self._backward = None

    @contextlib.contextmanager
    def as_backward(self):
        """Records what runs inside as backward work (a gradient's pending sum, reduced where it is read)."""
        saved, self._backward = self._backward, True
        try:
            yield
        finally:
            self._backward = saved

    def _in_backward(self) -> bool:
        return torch._C._current_autograd_node() is not None if self._backward is None else self._backward


def collective(kind: Kind, mesh_dims, local: torch.Tensor) -> None:
    """Called by the planner for every collective it runs."""
    if RECORDERS:
        RECORDERS[-1].collective(kind, mesh_dims, local)
