"""The grouped value heads' sum of per-value-head gradients (``tfla/ops/common/group_sum.py``)."""
import pytest
import torch

from tfla.ops.common.group_sum import group_sum


@pytest.mark.parametrize("B,T,H,G,D", [(1, 1, 1, 2, 16), (2, 37, 3, 2, 100), (1, 130, 2, 4, 128), (1, 5, 2, 1, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_group_sum_matches_torch(device, B, T, H, G, D, dtype):
    gen = torch.Generator().manual_seed(B * T + G)
    x = torch.randn(B, T, H * G, D, generator=gen)
    want = x.double().view(B, T, H, G, D).sum(3)
    got = group_sum(x.to(device), H, dtype)
    assert got.dtype == dtype and got.shape == (B, T, H, D)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert torch.allclose(got.double().cpu(), want, rtol=tol, atol=tol)
