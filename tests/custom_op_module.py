"""A custom op with a sharding rule, importable by the workers of a single-controller job (tests/test_controller.py)."""

import torch

import spmd


@torch.library.custom_op("spmd_test_controller::scaled_square", mutates_args=())
def scaled_square(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x * x * scale


scaled_square.register_fake(lambda x, scale: torch.empty_like(x))
spmd.register_sharding(scaled_square, "... -> ...")
