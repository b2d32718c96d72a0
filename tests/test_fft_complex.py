"""FFTs and complex numbers on DTensors: every layout gives plain torch's values and gradients, the axes a transform
does not touch stay sharded, and a transform over a sharded axis moves it with exactly the relayout it needs."""

from __future__ import annotations

import pytest
import torch

import spmd
from spmd import UNSHARDED as U
from spmd import Layout
from tests.sweep import MESH, issued, Const, check_op, rand


def _real(z: torch.Tensor) -> torch.Tensor:
    """A complex result as reals (its trailing pair of parts), so the sweep compares it to tolerance and
    differentiates it; a real one as it is."""
    return torch.view_as_real(z.resolve_conj()) if z.is_complex() else z


def _complex(x: torch.Tensor) -> torch.Tensor:
    """A real tensor of shape (..., 2) as complex numbers, through `view_as_complex` (a copy: it is a leaf's view)."""
    return torch.view_as_complex(x.clone())


FFTS = {  # name: (fn of a real input, input shape); inputs ending in 2 are read as complex where the op wants it
    "fft_dim0": (lambda x: _real(torch.fft.fft(x, dim=0)), (4, 6)),
    "fft_last_norm": (lambda x: _real(torch.fft.fft(x, norm="ortho")), (4, 6)),
    "ifft_complex": (lambda x: _real(torch.fft.ifft(_complex(x), dim=1)), (4, 4, 2)),
    "fft2": (lambda x: _real(torch.fft.fft2(x)), (2, 4, 6)),
    "fftn_complex_n": (lambda x: _real(torch.fft.fftn(_complex(x), s=(6,), dim=(0,))), (4, 4, 2)),
    "rfft": (lambda x: _real(torch.fft.rfft(x, dim=0)), (6, 4)),
    "rfftn": (lambda x: _real(torch.fft.rfftn(x, dim=(1, 2))), (2, 4, 6)),
    "irfft": (lambda x: torch.fft.irfft(_complex(x), n=6), (4, 4, 2)),
    "irfft2": (lambda x: torch.fft.irfft2(_complex(x)), (2, 4, 4, 2)),
    "hfft": (lambda x: torch.fft.hfft(_complex(x), dim=0), (4, 2, 2)),
    "ihfft": (lambda x: _real(torch.fft.ihfft(x)), (4, 6)),
    "stft": (lambda x, w: _real(torch.stft(x, 4, hop_length=2, window=w, return_complex=True, center=False)),
             (2, 8)),
}


@pytest.mark.parametrize("name", list(FFTS))
def test_fft_matches_torch_for_every_layout(name):
    fn, shape = FFTS[name]
    stft = name == "stft"  # stft frames its input with as_strided, whose gradient spmd cannot take (index_add_)
    window = [Const(torch.hann_window(4, dtype=torch.float64))] if stft else []
    assert check_op(fn, [rand(*shape)] + window, grad=not stft, sample=16) >= 4


COMPLEX = {
    "complex": (lambda re, im: torch.view_as_real(torch.complex(re, im)), [(4, 6), (4, 6)]),
    "complex_broadcast": (lambda re, im: torch.view_as_real(torch.complex(re, im)), [(4, 6), (6,)]),
    "polar": (lambda r, theta: torch.view_as_real(torch.polar(r, theta)), [(4, 2), (4, 2)]),
    "view_as_complex_abs": (lambda x: _complex(x).abs(), [(4, 4, 2)]),
    "view_as_real_of_a_product": (lambda re, im: torch.view_as_real(torch.complex(re, im) * torch.complex(im, re)),
                                  [(2, 4), (2, 4)]),
}


@pytest.mark.parametrize("name", list(COMPLEX))
def test_complex_views_and_constructors_match_torch_for_every_layout(name):
    fn, shapes = COMPLEX[name]
    inputs = [rand(*s, seed=i).abs() + 0.1 for i, s in enumerate(shapes)]
    assert check_op(fn, inputs, sample=16) >= 4


def _layout(*specs):
    return Layout(list(specs), MESH)


def _assert_components(out, want: torch.Tensor) -> None:
    """The global value, and each device's component the block of `want` its layout assigns it."""
    layout = spmd.fetch_layout(out)
    torch.testing.assert_close(spmd.to_global(out), want)
    for got, block in zip(spmd.unpack(out), spmd.unpack(spmd.copy_to_mesh(want, layout))):
        torch.testing.assert_close(got, block)


def test_an_fft_over_an_unsharded_axis_keeps_the_others_sharded_without_collectives():
    x = rand(4, 4, 6)
    dx = spmd.copy_to_mesh(x, _layout("x", "y", U))
    for fn in (lambda t: torch.fft.fft(t), lambda t: torch.fft.rfft(t), lambda t: torch.fft.ihfft(t)):
        out, collectives = issued(lambda: fn(dx))
        assert collectives == []
        assert spmd.fetch_layout(out).sharding_specs == ["x", "y", U]
        _assert_components(out, fn(x))
    spectrum = torch.fft.rfft(x)
    out, collectives = issued(lambda: torch.fft.irfft(spmd.copy_to_mesh(spectrum, _layout("x", "y", U)), n=6))
    assert collectives == []
    _assert_components(out, torch.fft.irfft(spectrum, n=6))


def test_an_fft_over_a_sharded_axis_moves_its_mesh_dim_to_a_free_axis_in_one_all_to_all():
    x = rand(4, 6)
    dx = spmd.copy_to_mesh(x, _layout("x", U))
    out, collectives = issued(lambda: torch.fft.fft(dx, dim=0))
    assert collectives == [("all_to_all", ("x",))]
    assert spmd.fetch_layout(out).sharding_specs == [U, "x"]
    _assert_components(out, torch.fft.fft(x, dim=0))


def test_an_fft_over_every_sharded_axis_gathers_them():
    x = rand(4, 6)
    out, collectives = issued(lambda: torch.fft.fft2(spmd.copy_to_mesh(x, _layout("x", "y"))))
    assert sorted(collectives) == [("all_gather", ("x",)), ("all_gather", ("y",))]
    assert spmd.fetch_layout(out).sharding_specs == [U, U]
    _assert_components(out, torch.fft.fft2(x))
    # no free axis divides by the mesh dim (3 rows on 2 devices): gathered too
    y = rand(3, 4)
    out, collectives = issued(lambda: torch.fft.fft(spmd.copy_to_mesh(y, _layout(U, "x"))))
    assert collectives == [("all_gather", ("x",))]
    _assert_components(out, torch.fft.fft(y))


def test_the_gradient_of_a_batched_fft_issues_no_collective():
    x = rand(4, 6)
    dx = spmd.copy_to_mesh(x, _layout("x", U)).requires_grad_()
    out, forward = issued(lambda: torch.view_as_real(torch.fft.rfft(dx)))
    _, backward = issued(lambda: out.square().sum().backward())
    assert forward == [] and backward == []
    ref = x.clone().requires_grad_()
    torch.view_as_real(torch.fft.rfft(ref)).square().sum().backward()
    _assert_components(dx.grad, ref.grad)


def test_complex_constructors_keep_the_operands_layout():
    re, im = rand(4, 6), rand(4, 6, seed=1)
    layout = _layout("x", "y")
    out, collectives = issued(lambda: torch.complex(spmd.copy_to_mesh(re, layout), spmd.copy_to_mesh(im, layout)))
    assert collectives == [] and spmd.fetch_layout(out).sharding_specs == ["x", "y"]
    _assert_components(out, torch.complex(re, im))
    out, collectives = issued(lambda: torch.polar(spmd.copy_to_mesh(re.abs(), layout), spmd.copy_to_mesh(im, layout)))
    assert collectives == []
    _assert_components(out, torch.polar(re.abs(), im))


def test_view_as_real_is_a_view_that_writes_through_to_its_base():
    z = torch.complex(rand(4, 6), rand(4, 6, seed=1))
    dz = spmd.copy_to_mesh(z, _layout("x", "y"))
    parts, collectives = issued(lambda: torch.view_as_real(dz))
    assert collectives == [] and spmd.fetch_layout(parts).sharding_specs == ["x", "y", U]
    parts.mul_(2)
    _assert_components(dz, 2 * z)
    back, collectives = issued(lambda: torch.view_as_complex(parts))
    assert collectives == [] and spmd.fetch_layout(back).sharding_specs == ["x", "y"]
    back.add_(1)
    _assert_components(dz, 2 * z + 1)


def test_view_as_complex_of_a_sharded_pair_axis_gathers_it_and_refuses_in_place_writes():
    x = rand(4, 2)
    z, collectives = issued(lambda: torch.view_as_complex(spmd.copy_to_mesh(x, _layout("x", "y"))))
    assert collectives == [("all_gather", ("y",))]
    assert spmd.fetch_layout(z).sharding_specs == ["x"]
    _assert_components(z, torch.view_as_complex(x))
    with pytest.raises(spmd.UnsupportedOpError):
        z.mul_(2)


def test_no_fft_or_complex_op_runs_replicated():
    assert not any(op in f for f in spmd.cache_stats()["fallbacks"]
                   for op in ("fft", "view_as_", "complex", "polar"))
