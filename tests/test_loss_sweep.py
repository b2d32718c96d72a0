"""Layout sweeps of the regression losses (values and gradients against plain torch)."""

import pytest
import torch
import torch.nn.functional as F

from tests.sweep import check_op


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(4, 6), (4, 2, 2)])
def test_mse_loss(reduction, shape):
    torch.manual_seed(0)
    x, target = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    assert check_op(lambda a, b: F.mse_loss(a, b, reduction=reduction), [x, target]) > 0
