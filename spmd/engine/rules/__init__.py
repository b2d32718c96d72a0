"""Sharding rules, one module per algebraic family; importing this package registers them all
(`spmd.engine.registry` finds the rule of an op)."""

from spmd.engine.rules import (attention, complex_numbers, contraction, conv, ctc_loss, elementwise, fft,  # noqa: F401
                               fused_layers, grouped_mm, host_values, indexing, linalg, linear_cross_entropy, loss,
                               nn, pointwise, random_ops, ranges, rearrange, reduction, row_losses, scans,
                               sharded_folds, tensor_ops, value_shaped, view, view_copies, view_scatters,
                               vocab_parallel)
