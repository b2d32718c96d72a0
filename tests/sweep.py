"""Layout-sweep oracle: an op on DTensors must give the plain-tensor answer for every input layout.

"Layouts do not affect results, only performance": `check_op` runs `fn` on DTensors for every combination
of valid input layouts, gathers the outputs and compares them (and the gradients of every floating input)
with `fn` on plain tensors.
"""

from __future__ import annotations

import itertools
import math
import random

import torch

import spmd
from spmd import UNSHARDED, Layout
from spmd.explain import Recorder

MESH = spmd.create_mesh([("x", 2), ("y", 2)])
RTOL, ATOL = 1e-9, 1e-11


class Plain:
    """Marks an input of `check_op` that is passed as a plain tensor (a 0-d tensor) rather than distributed."""

    def __init__(self, value):
        self.value = value


class Const:
    """Marks a tensor input of `check_op` that is distributed (and swept) but not differentiated (class weights)."""

    def __init__(self, value):
        self.value = value


def issued(fn):
    """The result of `fn()` and the (kind, mesh dims) of every collective it ran, in order."""
    with Recorder() as r:
        out = fn()
    return out, [(c.kind, c.mesh_dims) for c in r.collectives]


def all_layouts(mesh, shape, multi: bool = False) -> list[Layout]:
    """Every valid layout of a tensor of `shape` on `mesh`: per axis UNSHARDED or a mesh dim (unused by another
    axis) whose size divides the axis; with `multi` also ordered tuples of several mesh dims."""
    names = list(mesh.dim_names)
    if multi:
        names += [p for k in range(2, len(mesh.dim_names) + 1) for p in itertools.permutations(mesh.dim_names, k)]
    out = []
    for specs in itertools.product([UNSHARDED] + names, repeat=len(shape)):
        used = [d for s in specs if s != UNSHARDED for d in ((s,) if isinstance(s, str) else s)]
        if len(used) == len(set(used)):
            layout = Layout(list(specs), mesh)
            if all(size % n == 0 for size, n in zip(shape, layout.num_shards_per_axis())):
                out.append(layout)
    return out


def distribute(x: torch.Tensor, layout: Layout):
    return spmd.copy_to_mesh(x, layout)


def gather(t) -> torch.Tensor:
    """The global value of a DTensor as a plain tensor (detached)."""
    return spmd.to_global(t).detach()


def components(t) -> list:
    """Each local device's component as nested lists, in `mesh.local_devices()` order."""
    return [c.tolist() for c in spmd.unpack(t)]


def check_replicas(t) -> None:
    """Components of devices that differ only along mesh dims the layout does not name must be equal."""
    layout = spmd.fetch_layout(t)
    mesh = layout.mesh
    comps = t._local.detach()
    free = [mesh.axis_index(d) for d in mesh.dim_names if d not in layout.sharded_mesh_dims]
    locs = [mesh.device_location(i - mesh.min_global_device_id()) for i in mesh.local_device_ids()]
    first: dict = {}
    for comp, loc in zip(comps, locs):
        key = tuple(c for i, c in enumerate(loc) if i not in free)
        if key not in first:
            first[key] = (comp, loc)
            continue
        ref, ref_loc = first[key]
        assert torch.equal(ref, comp) or (ref.is_floating_point() and torch.allclose(ref, comp, equal_nan=True)
                                          and torch.equal(ref.isnan(), comp.isnan())), (
            f"Mismatched value: replicas at mesh coords {ref_loc} and {loc} differ for layout "
            f"{layout.sharding_specs}")


def _flat(out) -> list:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {list(got.shape)} != {list(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if want.is_floating_point():  # float64 to 1e-9; a lower precision to its own (layouts reorder sums)
        tol = dict(rtol=RTOL, atol=ATOL) if want.dtype == torch.float64 else {}
        torch.testing.assert_close(got, want, **tol, equal_nan=True, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, want), f"{what}: {got} != {want}"


def _weights(outs) -> list:
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device) if isinstance(o, torch.Tensor) and
            o.is_floating_point() else None for o in outs]


def torch_differentiates(fn, inputs) -> bool:
    """Whether this torch has a derivative for what `fn` calls (torch 2.11 has none for `aminmax`,
    `narrow_copy`): where it has not, a sweep compares values only."""
    try:
        outs = [o for o in _flat(fn(*[x.clone().requires_grad_(x.is_floating_point()) for x in inputs]))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if outs:
            sum(o.sum() for o in outs).backward()
    except RuntimeError as e:
        if "derivative for" in str(e) and "is not implemented" in str(e):
            return False
        raise
    return True


def _run_plain(fn, inputs, grad: bool):
    leaves = []
    args = []
    for x in inputs:
        if isinstance(x, Plain):
            args.append(x.value)
        elif isinstance(x, Const):
            args.append(x.value)
        elif isinstance(x, torch.Tensor):
            leaf = x.clone().requires_grad_(grad and x.is_floating_point())
            leaves.append(leaf)
            args.append(leaf)
        else:
            args.append(x)
    return fn(*args), leaves


def _run_dist(fn, inputs, layouts, grad: bool):
    leaves = []
    args = []
    it = iter(layouts)
    for x in inputs:
        if isinstance(x, Plain):
            args.append(x.value)
        elif isinstance(x, Const):
            args.append(distribute(x.value, next(it)))
        elif isinstance(x, torch.Tensor):
            leaf = distribute(x, next(it)).detach()
            if grad and x.is_floating_point():
                leaf.requires_grad_()
            leaves.append(leaf)
            args.append(leaf)
        else:
            args.append(x)
    return fn(*args), leaves


def _loss(outs, weights):
    total = None
    for o, w in zip(outs, weights):
        if w is None or not o.requires_grad:
            continue
        if spmd.is_dtensor(o):
            w = distribute(w, spmd.fetch_layout(o))
        term = (o * w).sum()
        total = term if total is None else total + term
    return total


def check_op(fn, inputs, mesh=MESH, grad: bool = True, layouts=None, sample: int | None = None,
             max_failures: int = 5) -> int:
    """Runs `fn` on DTensors for every combination of valid layouts of the tensor `inputs` and compares values
    (and, for floating outputs, the gradients of floating inputs) with `fn` on plain tensors.

    `inputs`: tensors (distributed), `Const(t)` (distributed, not differentiated), `Plain(t)` (passed as a plain
    tensor), or other values (passed as they are).
    `layouts`: optionally, per tensor input, the list of layouts to sweep (default: `all_layouts`).
    `sample`: check only this many combinations, drawn (with a fixed seed) from all of them.
    Returns the number of layout combinations checked.
    """
    tensors = [x.value if isinstance(x, Const) else x for x in inputs if isinstance(x, (torch.Tensor, Const))]
    want, plain_leaves = _run_plain(fn, inputs, grad)
    want_outs = _flat(want)
    weights = _weights(want_outs)
    do_grad = grad and any(l.requires_grad for l in plain_leaves) and any(w is not None for w in weights)
    want_grads = []
    if do_grad:
        loss = _loss(want_outs, weights)
        if loss is None:
            do_grad = False
        else:
            loss.backward()
            want_grads = [l.grad for l in plain_leaves]
    sweeps = layouts or [all_layouts(mesh, t.shape) for t in tensors]
    failures = []
    count = 0
    combos = itertools.product(*sweeps)
    if sample is not None and math.prod(len(s) for s in sweeps) > sample:
        rng = random.Random(sum(len(s) for s in sweeps))
        combos = list(dict.fromkeys(tuple(rng.choice(s) for s in sweeps) for _ in range(sample)))
    for combo in combos:
        count += 1
        where = f"input layouts {[l.sharding_specs for l in combo]}"
        try:
            got, leaves = _run_dist(fn, inputs, combo, do_grad)
            got_outs = _flat(got)
            assert len(got_outs) == len(want_outs), f"{len(got_outs)} outputs, expected {len(want_outs)}"
            for i, (g, w) in enumerate(zip(got_outs, want_outs)):
                if isinstance(w, torch.Tensor):
                    assert spmd.is_dtensor(g), f"output {i} is a {type(g).__name__}, not a DTensor"
                    check_replicas(g)
                    _assert_close(gather(g).detach(), w.detach(), f"output {i}")
                else:
                    assert g == w, f"output {i}: {g!r} != {w!r}"
            if do_grad:
                _loss(got_outs, weights).backward()
                for i, (leaf, wg) in enumerate(zip(leaves, want_grads)):
                    if wg is None:
                        assert leaf.grad is None, f"input {i}: a gradient where plain torch has none"
                        continue
                    assert leaf.grad is not None, f"input {i}: no gradient"
                    assert spmd.fetch_layout(leaf.grad) == spmd.fetch_layout(leaf), (
                        f"input {i}: grad layout {spmd.fetch_layout(leaf.grad).sharding_specs} != leaf layout "
                        f"{spmd.fetch_layout(leaf).sharding_specs}")
                    check_replicas(leaf.grad)
                    _assert_close(gather(leaf.grad), wg, f"grad of input {i}")
        except Exception as e:  # collect a few failing combinations, so one report shows the pattern
            failures.append(f"{where}: {type(e).__name__}: {str(e)[:600]}")
            if len(failures) >= max_failures:
                break
    assert not failures, f"{len(failures)} failing layout combination(s) (of {count} so far):\n" + "\n".join(
        failures)
    return count


def rand(*shape, dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 7919 * len(shape) + math.prod(shape))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(0, 4, shape, generator=g, dtype=dtype)


def reduce_gradients(params) -> None:
    """Reads each parameter's gradient where it is: its pending sum reduced (an all-reduce), nothing gathered — for
    a test to record the reductions that a backward leaves to whoever reads the gradients."""
    for p in params:
        if isinstance(p.grad, spmd.DTensor):
            p.grad._local
