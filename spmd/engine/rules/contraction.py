"""Contractions (mm, bmm, addmm, baddbmm, addmv, addr, addbmm, mv, dot, vdot, `_trilinear`) through one
einsum-labelled rule, and pairwise distances (cdist), which contract like a matrix product.

Why the rule holds: a sharded contracted label turns each local product into a partial sum over that mesh
dim (one all-reduce completes it); a sharded free label simply carries to the output. Label priorities follow
TF DTensor's matmul rule: free labels beat contracted labels beat batch labels for a mesh dim, and two free
labels on one mesh dim both become unsharded. On a mesh whose devices all live in this process, the partial
products of a contraction over a sharded label are one product (`summed_product`). A distance ‖x1_p − x2_r‖ is
not a sum of products, so its feature axis is whole on each device; its gradient sums over r and is a partial sum
like a contraction.
"""

from __future__ import annotations

import math

import torch

from spmd.collectives.local import one_copy, shared, spread, traced
from spmd.engine.registry import register
from spmd.engine.decision import Decision, OpCall, unsupported
from spmd.engine.rules.common import REDUCED_PRECISION, first_device, per_device

aten = torch.ops.aten
_FREE, _CONTRACTED, _BATCH = 2, 1, 0


def einsum_axes(equation: str, operands: list[tuple]) -> tuple[list[tuple], tuple, tuple]:
    """For an einsum `equation` and per-operand axes: (required axes per operand, output axes, reduced dims)."""
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    kind, choice = {}, {}
    for label in dict.fromkeys(lhs.replace(",", "")):
        users = sum(label in t for t in terms)
        kind[label] = _CONTRACTED if label not in out else (_BATCH if users > 1 else _FREE)
        sharded = [axes[t.index(label)] for t, axes in zip(terms, operands)
                   if label in t and axes[t.index(label)] is not None]
        # batch labels prefer the last operand's sharding (TF: "b's spec if sharded, else a's")
        choice[label] = (sharded[-1] if kind[label] == _BATCH else sharded[0]) if sharded else None
    by_dim: dict = {}
    for label, m in choice.items():
        if m is not None:
            by_dim.setdefault(m, []).append(label)
    for m, labels in by_dim.items():
        if len(labels) < 2:
            continue
        best = max(kind[l] for l in labels)
        winners = [l for l in labels if kind[l] == best]
        keep = None if (best == _FREE and len(winners) > 1) else winners[0]
        for l in labels:
            if l != keep:
                choice[l] = None
    required = [tuple(choice.get(l) for l in term) for term in terms]
    reduced = tuple(choice[l] for l in dict.fromkeys(lhs.replace(",", "")) if kind[l] == _CONTRACTED
                    and choice.get(l) is not None)
    return required, tuple(choice.get(l) for l in out), reduced


def summed_product(call: OpCall, equation: str, reduced: tuple):
    """For a mesh whose devices all live in this process: `(a, b) -> stacked sums` of the two-operand
    `equation`, contracted over the sharded label AND over the devices of the `reduced` mesh dims, as one product
    with the devices' blocks side by side along the contracted axis (the product plain torch runs) instead of one
    small product per device. Every device of a reduced group gets the group's sum (one copy, where the group is
    the whole mesh): the output's pending reduction is then `same` (`spmd/collectives/local.py`), which the
    all-reduce or reduce-scatter completing it only reads. None where it does not apply (several clients, or
    nothing reduced, or an input sharded over several mesh dims: the reduction then spans dims the rule does not
    see)."""
    mesh = call.mesh
    grid = tuple(mesh.shape())
    summed = {mesh.axis_index(m) for m in reduced if mesh.dim_size(m) > 1}
    if not summed or call.multi_axis or not mesh.is_fully_local():
        return None
    labels = _LETTERS.upper()[:len(grid)]
    kept = "".join(label if i not in summed else "" for i, label in enumerate(labels))
    terms, out = equation.split("->")
    grid_equation = ",".join(labels + term for term in terms.split(",")) + f"->{kept}{out}"
    sizes = tuple(1 if i in summed else n for i, n in enumerate(grid))

    def product(a, b):
        total = torch.einsum(grid_equation, a.reshape(grid + a.shape[1:]), b.reshape(grid + b.shape[1:]))
        local = total.shape[len(kept):]
        return spread(total.reshape(sizes + local), grid, (call.num_local,) + local)

    return product


def folded_mm(call: OpCall, a_axes: tuple, b_axes: tuple):
    """For a mesh whose devices all live in this process: `(a, b) -> stacked products` of the matrices `a` (L, M, K)
    and `b` (L, K, N) with the devices folded into the product's own dimensions, where `stacked_mm` would run one
    small product per device. Per mesh dim: its devices are rows of one product where only `a` is sharded over it
    (data parallel's batch: `b` is the same on each), products side by side that read `a` once where only `b` is
    (a weight's columns), summed inside the product where both are (the contracted axis: the output's pending sum
    is then `same`, as with `summed_product`), and one product where neither is. None where `stacked_mm` does as
    well (at most one mesh dim of several devices and nothing summed) or where this does not apply (see
    `summed_product`)."""
    mesh = call.mesh
    grid = tuple(mesh.shape())
    if call.multi_axis or not mesh.is_fully_local() or a_axes[1] != b_axes[0]:
        return None
    names = mesh.dim_names
    rows, columns, contracted = ([i for i in range(len(grid)) if names[i] == m] for m in (a_axes[0], b_axes[1],
                                                                                         a_axes[1]))
    several = [i for i, n in enumerate(grid) if n > 1]
    summed = any(i in contracted for i in several)
    if not summed and (len(several) < 2 or not any(i in rows + columns for i in several)):
        return None
    in_a, in_b = rows + contracted, columns + contracted
    kept_a = tuple(slice(None) if i in in_a else 0 for i in range(len(grid)))
    kept_b = tuple(slice(None) if i in in_b else 0 for i in range(len(grid)))
    order_a = _positions(sorted(in_a), rows, contracted)  # (rows..., m, contracted..., k)
    order_b = _positions(sorted(in_b), columns, contracted)  # (columns..., contracted..., k, n)
    order_a = order_a[:len(rows)] + [len(in_a)] + order_a[len(rows):] + [len(in_a) + 1]
    order_b += [len(in_b), len(in_b) + 1]
    placed = sorted(rows + columns)
    order_out = _positions(columns + rows, placed, []) + [len(placed), len(placed) + 1]
    size = lambda axes: math.prod(grid[i] for i in axes)  # noqa: E731
    sizes = tuple(n if i in placed else 1 for i, n in enumerate(grid))

    def product(a, b):
        (n, m, k), cols = a.shape, b.shape[-1]
        r, kt, c = size(rows) * m, size(contracted) * k, size(columns)
        a2 = a.reshape(grid + (m, k))[kept_a].permute(order_a).reshape(r, kt)
        b3 = b.reshape(grid + (k, cols))[kept_b].permute(order_b).reshape(c, kt, cols)
        # (a graph traced for the CPU takes the batched product for one product too, see `stacked_mm`)
        one = c == 1 and not (traced(a) and a.device.type == "cpu")
        out = torch.mm(a2, b3[0]) if one else torch.bmm(a2.expand(c, r, kt), b3)
        part = out.reshape(tuple(grid[i] for i in columns + rows) + (m, cols)).permute(order_out)
        return spread(part.reshape(sizes + (m, cols)), grid, (n, m, cols))

    return product


def _positions(present: list, *groups: list) -> list:
    """The positions in `present` of the mesh dims of `groups`, one group after another."""
    return [present.index(i) for group in groups for i in group]


def _contraction(call: OpCall, equation: str, product) -> Decision:
    specs = call.specs
    required, out_axes, reduced = einsum_axes(equation, [s.axes for s in specs])
    summed = _summed(call, equation, required, reduced, product)
    run = summed or product
    return Decision(tuple(required), (out_axes,), lambda locals_, args, kwargs: run(*locals_),
                    reduce=(reduced,) if reduced else (), reduce_op="same" if summed and reduced else "sum")


# In a traced graph a matrix product folds the devices only from this many multiply-adds per device: its copies
# into and out of the folded order are kernels of their own for inductor to compile (on this project's CPU
# machine ~1 s each: a residual MLP D=64 on batch 4 x model 2 compiled in 28 s instead of 20 for a 6 % faster
# step), which pays off for large products only (2-layer MLP 1024 wide: a 15 % faster step).
FOLD_IN_GRAPHS_FROM = 1 << 20


def _summed(call: OpCall, equation: str, required: list, reduced: tuple, product):
    """The in-process product that folds the devices into one product (matrix products), or sums the contracted
    mesh dims inside it (other contractions); None where neither applies. `product`: the per-device product."""
    folded = folded_mm(call, *required) if equation == "mk,kn->mn" else None
    if folded is None:
        return summed_product(call, equation, reduced)
    (a, b), (a_axes, b_axes) = call.specs[-2:], required
    if math.prod(call.local_shape(a, a_axes)) * call.local_shape(b, b_axes)[1] >= FOLD_IN_GRAPHS_FROM:
        return folded
    unfolded = summed_product(call, equation, reduced) or product
    return lambda a, b: unfolded(a, b) if traced(a) else folded(a, b)


def stacked_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each device's matrix product of the stacked components `a` (L, M, K) and `b` (L, K, N). Where every device
    holds the same `b` (one device, or a replicated weight held once) it is one matrix product of all devices'
    rows, the kernel plain torch runs (on CPU a batched product of the same shapes takes ~10-20 % longer); else a
    batched product. A graph traced for the CPU takes the batched product for one device too (inductor's CPU
    code for it measured ~15 % faster there)."""
    tracing = traced(a)
    if shared(b) and not shared(a):
        return torch.matmul(a, b[0])  # (folds the devices' rows into one product where `a`'s memory allows)
    if tracing and a.device.type == "cpu":
        return torch.bmm(a, b)
    if b.shape[0] == 1:  # (in eager mode not a view: a view as the components costs copies, e.g. before gloo)
        product = torch.mm(a[0], b[0])
        return product.unsqueeze(0) if tracing else product.unsqueeze_(0)
    return torch.bmm(a, b)


@register(aten.mm.default, blockwise=True)
def mm_rule(call: OpCall) -> Decision:
    return _contraction(call, "mk,kn->mn", stacked_mm)


@register(aten.bmm.default, blockwise=True)
def bmm_rule(call: OpCall) -> Decision:
    return _contraction(call, "bmk,bkn->bmn", torch.matmul)


@register(torch.ops.spmd.batched_matmul.default, blockwise=True)
def batched_matmul_rule(call: OpCall) -> Decision:
    """`bmm` over any number of batch axes, each keeping its own sharding (see spmd/ops.py)."""
    batch = _LETTERS[:call.specs[0].rank - 2]  # (and x, y, z for the matrix axes; a mesh's dims are upper case)
    return _contraction(call, f"{batch}xy,{batch}yz->{batch}xz", torch.matmul)


@register(aten.mv.default, blockwise=True)
def mv_rule(call: OpCall) -> Decision:
    return _contraction(call, "mk,k->m", lambda m, v: torch.matmul(m, v.unsqueeze(-1)).squeeze(-1))


@register(aten.dot.default, blockwise=True)
def dot_rule(call: OpCall) -> Decision:
    return _contraction(call, "k,k->", lambda u, v: (u * v).sum(-1, dtype=u.dtype))  # (an int32 sum stays int32)


@register(aten.vdot.default, blockwise=True)
def vdot_rule(call: OpCall) -> Decision:
    required, out_axes, reduced = einsum_axes("k,k->", [s.axes for s in call.specs])
    # conj_physical: inside a dispatch the lazy conjugate bit of `conj()` would be ignored by the product
    return Decision(tuple(required), (out_axes,),
                    lambda l, a, k: (l[0].conj_physical() * l[1]).sum(-1, dtype=l[0].dtype),
                    reduce=(reduced,) if reduced else ())


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@register(aten._trilinear.default)
def trilinear_rule(call: OpCall) -> Decision:
    """`_trilinear` (F.bilinear and its gradients): three operands unsqueezed at `expand1..3` to one rank, multiplied
    and summed over `sumdim` -- an einsum whose labels are the axes of that rank. An axis of size 1 that broadcasts
    is unsharded (every device holds it whole)."""
    specs = call.specs
    expands = [set(call.args[i]) for i in (3, 4, 5)]
    rank = specs[0].rank + len(expands[0])
    terms = ["".join(_LETTERS[i] for i in range(rank) if i not in e) for e in expands]
    sumdim = set(call.args[6])
    out = "".join(_LETTERS[i] for i in range(rank) if i not in sumdim)
    sizes = {}
    for term, s in zip(terms, specs):
        for label, size in zip(term, s.shape):
            sizes[label] = max(sizes.get(label, 1), size)
    operands = [tuple(None if s.shape[j] == 1 and sizes[label] != 1 else s.axes[j] for j, label in enumerate(term))
                for term, s in zip(terms, specs)]
    required, out_axes, reduced = einsum_axes(",".join(terms) + "->" + out, operands)
    required = [tuple(None if size == 1 and sizes[label] != 1 else m for m, label, size in zip(req, term, s.shape))
                for req, term, s in zip(required, terms, specs)]
    if not reduced:  # each device's result is torch's op on its blocks (its own order of products)
        return Decision(tuple(required), (out_axes,), lambda l, a, k: per_device(call.func, l, a, k, len(l[0])))
    stacked = f"{','.join('Z' + t for t in terms)}->Z{out}"
    return Decision(tuple(required), (out_axes,), lambda l, a, k: torch.einsum(stacked, *l), reduce=(reduced,))


# op: (the einsum of its product, the product of stacked local operands)
_PRODUCTS = {
    aten.addmm.default: ("mk,kn->mn", stacked_mm),
    aten.baddbmm.default: ("bmk,bkn->bmn", torch.matmul),
    aten.addmv.default: ("mk,k->m", lambda m, v: torch.matmul(m, v.unsqueeze(-1)).squeeze(-1)),
    aten.addr.default: ("m,n->mn", lambda u, v: u.unsqueeze(-1) * v.unsqueeze(-2)),
    # one product over (batch, k) together: torch's sequential sum of the batches rounds about as finely
    aten.addbmm.default: ("bmk,bkn->mn", lambda a, b: torch.matmul(a.transpose(1, 2).flatten(2), b.flatten(1, 2))),
}


def _once(out: torch.Tensor) -> torch.Tensor:
    """What an in-place step writes: one copy where every device shares it (stride 0 over the stack axis)."""
    return one_copy(out) if shared(out) else out


@register(*_PRODUCTS, blockwise=True)
def addmm_rule(call: OpCall) -> Decision:
    """out = beta * bias + alpha * product(a, b). With a sum over devices the bias joins the summand of one device
    per group, and the sum stays pending (a sequence-parallel relayout after a row-parallel layer with a bias is one
    reduce-scatter); where the product is one over all devices' rows and every device holds the whole bias, it is
    torch's addmm."""
    equation, local_product = _PRODUCTS[call.func]
    if len(call.specs) == 2:  # a plain 0-d bias (a scalar every device adds): torch's op on each device
        required, out_axes, reduced = einsum_axes(equation, [s.axes for s in call.specs])
        if reduced:
            raise unsupported(call, "a plain 0-d bias with a sum over devices: distribute the bias first "
                                    "(spmd.copy_to_mesh)")
        return Decision(tuple(required), (out_axes,), lambda l, a, k: per_device(call.func, l, a, k, len(l[0])))
    bias, a, b = call.specs
    required, out_axes, reduced = einsum_axes(equation, [a.axes, b.axes])
    summed = _summed(call, equation, required, reduced, local_product)
    local_product = summed or local_product
    reduce_op = "same" if summed and reduced else "sum"
    terms, out = equation.split("->")
    sizes = {label: size for term, s in zip(terms.split(","), (a, b)) for label, size in zip(term, s.shape)}
    out_shape = tuple(sizes[label] for label in out)
    r = len(out_shape)
    bias_axes = tuple(None if (bias.shape[j] == 1 and out_shape[j + r - bias.rank] != 1)
                      else out_axes[j + r - bias.rank] for j in range(bias.rank))
    bias_view = (call.num_local,) + (1,) * (r - bias.rank) + call.local_shape(bias, bias_axes)
    fixed = tuple(m for m in bias_axes if m is not None)  # (the bias view's shape is of their blocks)

    def product(locals_, args, kwargs):
        out = local_product(locals_[1], locals_[2])
        alpha = kwargs.get("alpha", 1)
        if alpha != 1:
            _once(out).mul_(alpha)
        return out

    def add_bias(out, locals_, kwargs):
        beta = kwargs.get("beta", 1)
        if beta != 0:  # (a sum shared by every device is replicated, and so is the bias added to it)
            bias = locals_[0].view(bias_view)
            _once(out).add_(bias[:1] if shared(out) else bias, alpha=beta)
        return out

    if reduced and reduce_op == "same":  # each device holds its group's whole sum: the bias joins it everywhere
        return Decision((bias_axes, *required), (out_axes,), lambda l, a, k: add_bias(product(l, a, k), l, k),
                        reduce=(reduced,), reduce_op=reduce_op, fixed=fixed)
    if reduced and call.multi_axis:  # (the rule sees the outer of several mesh dims summed: the bias after the sum)
        return Decision((bias_axes, *required), (out_axes,), product, reduce=(reduced,),
                        epilogue=lambda outs, locals_, args, kwargs: [add_bias(outs[0], locals_, kwargs)],
                        fixed=fixed)
    if reduced:  # the bias joins one summand of each group: the sum stays pending for its consumer to resolve
        first = first_device(call, reduced, r)

        def summand(locals_, args, kwargs):
            out, beta = product(locals_, args, kwargs), kwargs.get("beta", 1)
            if beta != 0:
                out.add_(locals_[0].view(bias_view) * first(out), alpha=beta)
            return out
        return Decision((bias_axes, *required), (out_axes,), summand, reduce=(reduced,), fixed=fixed)
    # a bias every device holds whole (no row axis to fold): where the product is one over all devices' rows, it is
    # plain torch's addmm
    one_bias = call.func is aten.addmm.default and all(axes is None for axes in bias_axes) \
        and (bias.rank < 2 or bias.shape[0] == 1)
    low_precision = a.dtype in REDUCED_PRECISION

    # no sum over devices: each device's result is torch's op on its blocks, the bias added inside the product
    def kernel(locals_, args, kwargs):
        if one_bias and _one_weight(*locals_[1:]):
            return _addmm_once(*locals_, kwargs.get("beta", 1), kwargs.get("alpha", 1))
        if call.func is aten.addmm.default:  # every device's at once; where the devices fold into one product,
            if summed is not None and not low_precision:  # that product, then the bias (float32 rounds alike)
                return add_bias(product(locals_, args, kwargs), locals_, kwargs)
            return torch.baddbmm(locals_[0].view(bias_view), *locals_[1:],
                                 beta=kwargs.get("beta", 1), alpha=kwargs.get("alpha", 1))
        return per_device(call.func, locals_, args, kwargs, len(locals_[1]))
    return Decision((bias_axes, *required), (out_axes,), kernel, fixed=fixed)


def _one_weight(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the eager product of `a` and `b` is one matrix product of all devices' rows (see `stacked_mm`)."""
    return not traced(a) and (b.shape[0] == 1 or (shared(b) and not shared(a)))


def _addmm_once(bias, a, b, beta, alpha) -> torch.Tensor:
    """`addmm` of all devices' rows `a` (L, M, K) with the weight `b` and the bias that every device holds: plain
    torch's kernel, which adds the bias inside the product, so the result rounds as plain torch's."""
    rows = a[0] if a.shape[0] == 1 else a.reshape(-1, a.shape[-1])
    out = torch.addmm(bias[0], rows, b[0], beta=beta, alpha=alpha)
    return aten._unsafe_view(out, (a.shape[0], a.shape[1], out.shape[-1]))  # (not a view: see stacked_mm)


@register(aten._cdist_forward.default)
def cdist_rule(call: OpCall) -> Decision:
    """Distances between the rows of x1 (…, P, M) and x2 (…, R, M): batch, P and R axes sharded like a matrix
    product's labels, M whole. The algorithm torch picks by the global P and R is pinned, so that no shard picks
    another."""
    x1, x2 = call.specs
    required, out_axes = _distance_axes(x1, x2, "bpm,brm->bpr")[:2]
    p, mode = call.args[2], call.args[3] or 0
    if mode == 0:  # torch: the matrix-product algorithm (p=2) if P or R exceeds 25
        mode = 1 if x1.shape[-2] > 25 or x2.shape[-2] > 25 else 2
    as1, as2 = (_batch_aligned(call, s, axes, max(x1.rank, x2.rank)) for s, axes in zip((x1, x2), required))
    return Decision(tuple(required), (out_axes,),
                    lambda l, a, k: aten._cdist_forward(l[0].reshape(as1), l[1].reshape(as2), p, mode))


@register(aten._cdist_backward.default)
def cdist_backward_rule(call: OpCall) -> Decision:
    """x1's gradient sums over the R axis: sharded, it leaves a pending sum over its mesh dim."""
    grad, x1, x2, cdist = call.specs
    required, out_axes, reduced = _distance_axes(x1, x2, "bpr,bpm,brm,bpr->bpm", grad, cdist)
    p = call.args[3]
    as1, as2 = (_batch_aligned(call, s, axes, grad.rank) for s, axes in zip((x1, x2), required[1:3]))
    return Decision(tuple(required), (out_axes,), lambda l, a, k: aten._cdist_backward(  # it wants dense operands
        l[0].contiguous(), l[1].reshape(as1).contiguous(), l[2].reshape(as2).contiguous(), p, l[3].contiguous()),
        reduce=(reduced,) if reduced else ())


def _batch_aligned(call: OpCall, spec, axes, rank: int) -> tuple:
    """The shape of `spec`'s stacked components with ones inserted after the stack axis up to `rank`: torch
    broadcasts batch axes from the right, and the stack axis must stay the first batch axis."""
    return (call.num_local,) + (1,) * (rank - spec.rank) + call.local_shape(spec, axes)


def _distance_axes(x1, x2, equation: str, *others):
    """einsum_axes for cdist's operands in `equation`'s order: x1, x2 and the (…, P, R) tensors `others` (the
    gradient before them, the distances after). Batch axes ("b") are shared labels when every batch shape
    agrees, else unsharded; the feature axes M are unsharded."""
    batch = x1.shape[:-2]
    specs = list(others[:1]) + [x1, x2] + list(others[1:])
    features = [False] * len(others[:1]) + [True, True] + [False] * len(others[1:])  # an M axis: whole
    shared = all(s.shape[:-2] == batch for s in specs)
    operands = [(s.axes[:-2] if shared else ()) + s.axes[-2:-1] + ((None,) if f else s.axes[-1:])
                for s, f in zip(specs, features)]
    required, out_axes, reduced = einsum_axes(equation.replace("b", _LETTERS.upper()[:len(batch)] if shared else ""),
                                              operands)
    if not shared:
        required = [(None,) * (s.rank - 2) + tuple(req) for s, req in zip(specs, required)]
        out_axes = (None,) * (max(x1.rank, x2.rank) - 2) + out_axes
    return required, out_axes, reduced
