"""A 1-device mesh (one process per GPU is this case) takes fused kernel paths: check them against plain torch."""

import pytest
import torch
import torch.nn.functional as F

from tests.sweep import check_op

MESH1 = __import__("spmd").create_mesh([("x", 1)])


@pytest.mark.parametrize("shape,normalized", [((4, 6, 8), (8,)), ((4, 6, 8), (6, 8)), ((5, 8), (8,))])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_on_one_device(shape, normalized, affine):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    params = [torch.randn(normalized, dtype=torch.float64), torch.randn(normalized, dtype=torch.float64)]
    fn = (lambda a, w, b: F.layer_norm(a, normalized, w, b)) if affine else (lambda a: F.layer_norm(a, normalized))
    assert check_op(fn, [x] + (params if affine else []), mesh=MESH1) > 0
