"""Sharding rules, one module per algebraic family; importing this package registers them all
(`spmd.engine.registry` finds the rule of an op)."""

from spmd.engine.rules import (contraction, conv, loss, nn, pointwise, random_ops, reduction, tensor_ops, view,  # noqa: F401
                               vocab_parallel)
