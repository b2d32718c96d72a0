"""Random ops (dropout's `bernoulli_`, `native_dropout`, `uniform_`, `normal_`, `rand_like`, ...).

Why the rules hold: each call draws one seed from torch's generator and every device computes its values from
(seed, global index) with `spmd.random`, so the result is the same for every layout and device count.
"""

from __future__ import annotations

import torch

from spmd import random as srandom
from spmd.engine.registry import register
from spmd.engine.decision import Decision, OpCall

aten = torch.ops.aten


def _uniform(call: OpCall, spec, generator, dtype):
    index = srandom.global_index(spec.shape, spec.axes, call.mesh, call.mesh.torch_device)
    return srandom.uniform01(index, srandom.draw_seed(generator), 0, dtype)


def _normal(call: OpCall, spec, generator, dtype):
    index = srandom.global_index(spec.shape, spec.axes, call.mesh, call.mesh.torch_device)
    return srandom.normal01(index, srandom.draw_seed(generator), dtype)


def _random_decision(call: OpCall, kernel, inplace: bool, outputs=None) -> Decision:
    axes = call.specs[0].axes
    return Decision(tuple(axes for _ in call.specs), outputs or (axes,), kernel, inplace=inplace,
                    single=outputs is None)


@register(aten.bernoulli_.float, aten.bernoulli_.Tensor, multi_axis=True)
def bernoulli_inplace_rule(call: OpCall) -> Decision:
    spec = call.specs[0]

    def kernel(l, a, k):
        u = _uniform(call, spec, k.get("generator"), torch.float64)
        p = l[1] if len(l) > 1 else (a[1] if len(a) > 1 else k.get("p", 0.5))
        return l[0].copy_(u < p)
    return _random_decision(call, kernel, True)


@register(aten.bernoulli.default, aten.bernoulli.p, multi_axis=True)
def bernoulli_rule(call: OpCall) -> Decision:
    spec = call.specs[0]

    def kernel(l, a, k):
        p = l[0] if call.func is aten.bernoulli.default else a[1]
        return (_uniform(call, spec, k.get("generator"), torch.float64) < p).to(l[0].dtype)
    return _random_decision(call, kernel, False)


@register(aten.uniform_.default, multi_axis=True)
def uniform_rule(call: OpCall) -> Decision:
    spec = call.specs[0]

    def kernel(l, a, k):
        low = a[1] if len(a) > 1 else k.get("from", 0.0)
        high = a[2] if len(a) > 2 else k.get("to", 1.0)
        u = _uniform(call, spec, k.get("generator"), torch.float64 if l[0].dtype == torch.float64 else
                     torch.float32)
        return l[0].copy_(u * (high - low) + low)
    return _random_decision(call, kernel, True)


@register(aten.normal_.default, multi_axis=True)
def normal_rule(call: OpCall) -> Decision:
    spec = call.specs[0]

    def kernel(l, a, k):
        mean = a[1] if len(a) > 1 else k.get("mean", 0.0)
        std = a[2] if len(a) > 2 else k.get("std", 1.0)
        return l[0].copy_(_normal(call, spec, k.get("generator"), torch.float64) * std + mean)
    return _random_decision(call, kernel, True)


@register(aten.rand_like.default, aten.randn_like.default, multi_axis=True)
def rand_like_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    draw = _uniform if call.func is aten.rand_like.default else _normal

    def kernel(l, a, k):
        dtype = k.get("dtype") or l[0].dtype
        return draw(call, spec, k.get("generator"), torch.float64).to(dtype)
    return _random_decision(call, kernel, False)


@register(aten.native_dropout.default, multi_axis=True)
def native_dropout_rule(call: OpCall) -> Decision:
    spec = call.specs[0]
    p, train = call.args[1], call.args[2]

    def kernel(l, a, k):
        x = l[0]
        if train is False:
            return x.clone(), torch.ones_like(x, dtype=torch.bool)
        keep = _uniform(call, spec, None, torch.float64) >= p
        return x * keep / (1.0 - p) if p < 1 else x * 0, keep
    return _random_decision(call, kernel, False, outputs=(spec.axes, spec.axes))
