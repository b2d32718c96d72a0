"""Sharding rules, one module per algebraic family; importing this package registers them all
(`spmd.engine.registry` finds the rule of an op)."""

from spmd.engine.rules import (complex_numbers, contraction, conv, elementwise, fft, indexing, linalg, loss,  # noqa: F401
                               nn, pointwise, random_ops, ranges, rearrange, reduction, scans, tensor_ops, view,
                               view_copies, view_scatters, vocab_parallel)
