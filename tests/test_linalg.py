"""Batched linear algebra on DTensors: every layout gives plain torch's values and gradients, the batch axes stay
sharded (no collective) and sharded matrix axes cost exactly the all-gathers that make them whole."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd import UNSHARDED as U
from spmd import Layout
from tests.sweep import MESH, all_layouts, issued, check_op, rand


def _shifted(a):
    """`a + 4 I`: well conditioned (the identity, a plain tensor, is replicated)."""
    with spmd.implicit_replication():
        return a + 4 * torch.eye(a.shape[-1], dtype=a.dtype)


def _spd(a):
    """A well-conditioned symmetric positive-definite batch from any square batch."""
    return _shifted(a @ a.mT)


_well_conditioned = _shifted


def _lu_solve(a, b):
    lu, pivots = torch.linalg.lu_factor(_well_conditioned(a))
    return torch.linalg.lu_solve(lu, pivots, b)


OPS = {
    "cholesky": (lambda a: torch.linalg.cholesky(_spd(a)), [(4, 2, 2)]),
    "cholesky_upper_ex": (lambda a: torch.linalg.cholesky_ex(_spd(a), upper=True), [(2, 2, 4, 4)]),
    "solve": (lambda a, b: torch.linalg.solve(_well_conditioned(a), b), [(4, 2, 2), (4, 2, 2)]),
    "solve_broadcast_batch": (lambda a, b: torch.linalg.solve(_well_conditioned(a), b), [(2, 2, 2), (4, 1, 2, 2)]),
    "solve_vector": (lambda a, b: torch.linalg.solve(_well_conditioned(a), b), [(4, 2, 2), (4, 2)]),
    "solve_one_vector_for_a_batch": (lambda a, b: torch.linalg.solve(_well_conditioned(a), b), [(4, 2, 2), (2,)]),
    "solve_left_false": (lambda a, b: torch.linalg.solve(_well_conditioned(a), b, left=False), [(2, 2), (4, 2)]),
    "svd": (lambda a: torch.linalg.svd(a, full_matrices=False), [(4, 4, 2)]),
    "svdvals": (lambda a: torch.linalg.svdvals(a), [(2, 4, 2)]),
    "eigh": (lambda a: torch.linalg.eigh(a + a.mT), [(4, 2, 2)]),
    "det": (lambda a: torch.linalg.det(_well_conditioned(a)), [(4, 2, 2)]),
    "slogdet": (lambda a: torch.linalg.slogdet(_well_conditioned(a)), [(2, 4, 4)]),
    "inv": (lambda a: torch.linalg.inv(_well_conditioned(a)), [(4, 2, 2)]),
    "qr": (lambda a: torch.linalg.qr(a), [(4, 4, 2)]),
    "lu_factor_and_solve": (_lu_solve, [(4, 2, 2), (4, 2, 4)]),
    "lu_solve_broadcast_rhs": (_lu_solve, [(2, 2), (4, 2, 2)]),
    "cholesky_solve": (lambda a, b: torch.cholesky_solve(b, torch.linalg.cholesky(_spd(a))), [(4, 2, 2), (2, 2)]),
    "solve_triangular": (lambda a, b: torch.linalg.solve_triangular(_well_conditioned(a).triu(), b, upper=True),
                         [(4, 2, 2), (4, 2, 4)]),
    "matrix_exp": (lambda a: torch.linalg.matrix_exp(a / 4), [(4, 2, 2)]),
    "pinv": (lambda a: torch.linalg.pinv(a), [(4, 4, 2)]),
    "geqrf": (lambda a: torch.geqrf(a.detach()), [(4, 4, 2)]),  # no gradient in torch, nor a meta kernel
}


@pytest.mark.parametrize("name", list(OPS))
def test_batched_linalg_matches_torch_for_every_layout(name):
    """Batch sharded, matrix axes sharded (relayouted) and replicated, values, gradients and every component."""
    fn, shapes = OPS[name]
    inputs = [rand(*shape, seed=i) for i, shape in enumerate(shapes)]
    assert check_op(fn, inputs, sample=16) >= 8


def _layout(*specs):
    return Layout(list(specs), MESH)


def _spd_batch(*shape):
    return _spd(rand(*shape))


def test_batch_sharded_factorizations_run_where_the_data_is():
    a = _spd_batch(4, 3, 3)
    x = spmd.copy_to_mesh(a, _layout("x", U, U))
    for fn in (torch.linalg.cholesky, torch.linalg.inv, torch.linalg.det, torch.linalg.eigh, torch.linalg.qr,
               torch.linalg.lu_factor, lambda t: torch.linalg.svd(t, full_matrices=False), torch.geqrf):
        out, collectives = issued(lambda: fn(x))
        assert collectives == []
        outs, wants = ((out,), (fn(a),)) if isinstance(out, torch.Tensor) else (tuple(out), tuple(fn(a)))
        for o, want in zip(outs, wants):
            assert spmd.fetch_layout(o).sharding_specs == ["x"] + [U] * (want.dim() - 1)
            torch.testing.assert_close(spmd.to_global(o), want)


def test_a_solve_keeps_the_batch_sharded_and_broadcasts_a_replicated_right_hand_side():
    a, b = _spd_batch(4, 3, 3), rand(3, seed=1)
    out, collectives = issued(lambda: torch.linalg.solve(spmd.copy_to_mesh(a, _layout("x", U, U)),
                                                          spmd.copy_to_mesh(b, _layout(U))))
    assert collectives == []
    assert spmd.fetch_layout(out).sharding_specs == ["x", U]
    torch.testing.assert_close(spmd.to_global(out), torch.linalg.solve(a, b))


def test_lu_factor_and_lu_solve_stay_batch_sharded_forward_and_backward():
    a, b = _spd_batch(4, 3, 3), rand(4, 3, 2, seed=1)
    x = spmd.copy_to_mesh(a, _layout("y", U, U)).requires_grad_()
    y = spmd.copy_to_mesh(b, _layout("y", U, U)).requires_grad_()
    out, forward = issued(lambda: torch.linalg.lu_solve(*torch.linalg.lu_factor(x), y))
    _, backward = issued(lambda: out.sum().backward())
    assert forward == [] and backward == []
    ref_a, ref_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    torch.linalg.lu_solve(*torch.linalg.lu_factor(ref_a), ref_b).sum().backward()
    torch.testing.assert_close(spmd.to_global(x.grad), ref_a.grad)
    torch.testing.assert_close(spmd.to_global(y.grad), ref_b.grad)


def test_sharded_matrix_axes_are_gathered_once_each():
    a = _spd_batch(4, 4, 4)
    out, collectives = issued(lambda: torch.linalg.cholesky(spmd.copy_to_mesh(a, _layout("x", "y", U))))
    assert collectives == [("all_gather", ("y",))]
    assert spmd.fetch_layout(out).sharding_specs == ["x", U, U]
    out, collectives = issued(lambda: torch.linalg.inv(spmd.copy_to_mesh(a, _layout(U, "x", "y"))))
    assert sorted(collectives) == [("all_gather", ("x",)), ("all_gather", ("y",))]
    assert spmd.fetch_layout(out).sharding_specs == [U, U, U]
    torch.testing.assert_close(spmd.to_global(out), torch.linalg.inv(a))


def test_a_batch_axis_sharded_over_both_mesh_dims_stays_so():
    a = _spd_batch(4, 3, 3)
    out, collectives = issued(lambda: torch.linalg.eigh(spmd.copy_to_mesh(a, _layout(("x", "y"), U, U))))
    assert collectives == []
    want = torch.linalg.eigh(a)
    for o, w in zip(out, want):
        assert spmd.fetch_layout(o).sharding_specs[0] == "x+y"
        torch.testing.assert_close(spmd.to_global(o), w)


def test_a_compiled_solve_keeps_the_batch_sharded():
    """The rule decides at trace time (on fake components) as it does eagerly."""
    a, b = _spd_batch(4, 3, 3), rand(3, seed=1)

    @spmd.function(backend="aot_eager")
    def solve_twice(x, y):
        return torch.linalg.solve(x, y) + torch.cholesky_solve(y.unsqueeze(-1), torch.linalg.cholesky(x)).squeeze(-1)

    out = solve_twice(spmd.copy_to_mesh(a, _layout("x", U, U)), spmd.copy_to_mesh(b, _layout(U)))
    assert spmd.fetch_layout(out).sharding_specs == ["x", U]
    torch.testing.assert_close(spmd.to_global(out), 2 * torch.linalg.solve(a, b))


@pytest.mark.parametrize("call", [lambda a: torch.linalg.matrix_rank(a),
                                  lambda a: torch.linalg.matrix_rank(a, hermitian=True),
                                  lambda a: torch.linalg.matrix_rank(a, atol=1.0, rtol=0.5),
                                  lambda a: torch.linalg.matrix_rank(a, tol=1.0)],
                         ids=["default", "hermitian", "atol_rtol", "tol"])
@pytest.mark.parametrize("layout", all_layouts(MESH, (4, 0, 0)), ids=lambda l: ",".join(map(str, l.sharding_specs)))
def test_matrix_rank_of_an_empty_batch_is_zero_laid_out_like_the_batch(layout, call):
    """torch fills a fresh tensor for matrices without elements: spmd gives a DTensor of zeros, its batch axis laid
    out as the input's, without a collective."""
    a = torch.empty(4, 0, 0, dtype=torch.float64)
    out, collectives = issued(lambda: call(spmd.copy_to_mesh(a, layout)))
    assert collectives == []
    assert spmd.is_dtensor(out) and spmd.fetch_layout(out).sharding_specs == layout.sharding_specs[:1]
    want = call(a)
    assert out.dtype == want.dtype == torch.int64
    torch.testing.assert_close(spmd.to_global(out), want)
    for component, block in zip(spmd.unpack(out), spmd.unpack(spmd.copy_to_mesh(want, spmd.fetch_layout(out)))):
        torch.testing.assert_close(component, block)


@pytest.mark.parametrize("call", [lambda a: torch.linalg.matrix_rank(a),
                                  lambda a: torch.linalg.matrix_rank(a, hermitian=True),
                                  lambda a: torch.linalg.matrix_rank(a, atol=0.5, rtol=0.1)],
                         ids=["default", "hermitian", "atol_rtol"])
def test_matrix_rank_takes_the_tolerance_torch_makes_inside_as_replicated(call):
    """torch makes the default tolerance a plain tensor inside the op: taken as replicated, the batch stays
    sharded with no collective, and every layout gives torch's ranks."""
    a = rand(4, 3, 3)
    a[1, 2] = a[1, 0] + a[1, 1]
    sym = a @ a.mT  # symmetric (for hermitian=True), the second matrix of rank 2
    out, collectives = issued(lambda: call(spmd.copy_to_mesh(sym, _layout("x", U, U))))
    assert collectives == [] and spmd.fetch_layout(out).sharding_specs == ["x"]
    torch.testing.assert_close(spmd.to_global(out), call(sym))
    check_op(call, [sym], grad=False)


def test_matrix_rank_of_an_empty_tensor_that_is_not_a_batch_of_matrices_is_torchs_error():
    with pytest.raises(RuntimeError) as want:
        torch.linalg.matrix_rank(torch.empty(0))
    with pytest.raises(RuntimeError) as got:
        torch.linalg.matrix_rank(spmd.copy_to_mesh(torch.empty(0), Layout.replicated(MESH, 1)))
    assert str(got.value) == str(want.value)
