"""`torch._foreach_*` ops on DTensors: torch.optim with foreach=True and gradient clipping."""

import pytest
import torch

import spmd
from spmd import Layout

MESH = spmd.create_mesh([("b", 2), ("m", 2)])
LAYOUTS = [Layout(["b", "m"], MESH), Layout(["m"], MESH), Layout(["unsharded", "b"], MESH)]


def _params():
    torch.manual_seed(0)
    plain = [torch.randn(4, 6, dtype=torch.float64), torch.randn(6, dtype=torch.float64),
             torch.randn(3, 4, dtype=torch.float64)]
    dist = [spmd.DVariable(p, layout=layout) for p, layout in zip(plain, LAYOUTS)]
    return dist, [p.clone().requires_grad_() for p in plain]


def _loss(ps):
    return (ps[0] * ps[1]).sin().sum() + (ps[2] @ ps[0]).square().mean()


@pytest.mark.parametrize("name,kwargs", [("SGD", {"lr": 0.1, "momentum": 0.9}), ("Adam", {"lr": 0.05}),
                                         ("AdamW", {"lr": 0.05, "weight_decay": 0.1}),
                                         ("RMSprop", {"lr": 0.01}), ("Adagrad", {"lr": 0.1})])
def test_foreach_optimizers_match_plain_torch(name, kwargs):
    dist, plain = _params()
    opts = [getattr(torch.optim, name)(ps, foreach=True, **kwargs) for ps in (dist, plain)]
    for _ in range(3):
        for ps, opt in zip((dist, plain), opts):
            _loss(ps).backward()
            opt.step()
            opt.zero_grad()
    for d, p, layout in zip(dist, plain, LAYOUTS):
        assert spmd.fetch_layout(d) == layout
        torch.testing.assert_close(spmd.to_global(d), p.detach(), rtol=1e-10, atol=1e-12)
    for state in opts[0].state.values():
        for value in state.values():
            if spmd.is_dtensor(value) and value.dim() > 0:
                assert spmd.fetch_layout(value) in LAYOUTS


@pytest.mark.parametrize("foreach", [True, False])
def test_clip_grad_norm(foreach):
    dist, plain = _params()
    for ps in (dist, plain):
        _loss(ps).backward()
    norms = [torch.nn.utils.clip_grad_norm_(ps, max_norm=0.5, foreach=foreach) for ps in (dist, plain)]
    assert float(norms[0]) == pytest.approx(float(norms[1]), rel=1e-12)
    for d, p in zip(dist, plain):
        torch.testing.assert_close(spmd.to_global(d.grad), p.grad, rtol=1e-10, atol=1e-12)
