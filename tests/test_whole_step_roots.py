"""Whole steps (`spmd.function(step, whole_step=True)`) find the modules and optimizers they train where the step
reaches them (an object's attributes, default arguments, a dict entry, a global), and use what is put there later."""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
from torch import nn

import spmd
from spmd import UNSHARDED as U, Layout
from sweep import gather


def test_a_step_reaching_its_model_through_an_object_or_a_default_argument():
    """A trainer object's `self.model`/`self.opt` named by the step, or the model and optimizer as default
    arguments: the whole step finds them and trains as eager."""
    mesh = spmd.create_mesh([("batch", 2)])
    torch.manual_seed(0)
    base = nn.Linear(8, 4)
    x = torch.randn(8, 8)
    plain = copy.deepcopy(base)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)

    class Trainer:
        pass
    trainer = Trainer()
    trainer.model = spmd.distribute_module(copy.deepcopy(base), mesh)
    trainer.opt = torch.optim.SGD(trainer.model.parameters(), lr=0.1, momentum=0.9)
    model = spmd.distribute_module(copy.deepcopy(base), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def by_attribute(x):
        loss = trainer.model(x).pow(2).mean()
        loss.backward()
        trainer.opt.step()
        trainer.opt.zero_grad()
        return loss

    def by_default(x, model=model, opt=opt):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    steps = [spmd.function(f, whole_step=True, backend="aot_eager") for f in (by_attribute, by_default)]
    data = spmd.copy_to_mesh(x, Layout(["batch", U], mesh))
    for _ in range(4):
        want = plain(x).pow(2).mean()
        want.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        for step in steps:
            torch.testing.assert_close(gather(step(data)), want.detach())
    assert all(step.experimental_get_tracing_count() == 1 for step in steps)


@pytest.mark.parametrize("where", ["dict", "attribute", "global"])
def test_an_optimizer_replaced_where_the_step_finds_it_is_the_one_the_step_uses(where):
    """A step that reaches its optimizer through a dict entry, an object's attribute or a global: a new optimizer
    put there (here one with lr=0) is traced anew, where the graph kept updating with the old one's settings."""
    mesh = spmd.create_mesh([("batch", 2)])
    torch.manual_seed(0)
    model = spmd.distribute_module(nn.Linear(8, 4), mesh)
    holder = {"opt": None} if where == "dict" else types.SimpleNamespace(opt=None)
    put = {"dict": lambda o: holder.__setitem__("opt", o), "attribute": lambda o: setattr(holder, "opt", o),
           "global": lambda o: globals().__setitem__("_GLOBAL_OPT", o)}[where]
    get = {"dict": lambda: holder["opt"], "attribute": lambda: holder.opt, "global": lambda: _GLOBAL_OPT}[where]
    put(torch.optim.SGD(model.parameters(), lr=0.1))

    if where == "global":
        def step(x):
            loss = model(x).pow(2).mean()
            loss.backward()
            _GLOBAL_OPT.step()
            _GLOBAL_OPT.zero_grad()
            return loss
    else:
        def step(x):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt = holder["opt"] if where == "dict" else holder.opt
            opt.step()
            opt.zero_grad()
            return loss
    whole = spmd.function(step, whole_step=True, backend="aot_eager")
    data = spmd.copy_to_mesh(torch.randn(8, 8), Layout(["batch", U], mesh))
    for _ in range(3):
        whole(data)
    before = gather(model.weight).clone()
    put(torch.optim.SGD(model.parameters(), lr=0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the retrace's warning)
        whole(data)
        whole(data)
    assert get().param_groups[0]["lr"] == 0.0
    torch.testing.assert_close(gather(model.weight), before, rtol=0, atol=0)


_GLOBAL_OPT = None
