"""Custom ops with sharding rules, importable by the workers of a single-controller job (tests/test_controller.py)."""

import torch

import spmd


@torch.library.custom_op("spmd_test_controller::scaled_square", mutates_args=())
def scaled_square(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x * x * scale


scaled_square.register_fake(lambda x, scale: torch.empty_like(x))
spmd.register_sharding(scaled_square, "... -> ...")


@torch.library.custom_op("spmd_test_controller::add_scaled_", mutates_args=("x",))
def add_scaled_(x: torch.Tensor, y: torch.Tensor, scale: float) -> None:
    x.add_(y * scale)


add_scaled_.register_fake(lambda x, y, scale: None)
spmd.register_sharding(add_scaled_, "i j, i j -> ")  # writes x; one call per device
