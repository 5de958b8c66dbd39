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


@pytest.mark.parametrize("B,T,H,G,D", [(1, 37, 3, 2, 100), (2, 70, 2, 4, 128)])
def test_group_sum_with_l2norm_backward(device, B, T, H, G, D):
    """``l2=(x0, rstd)``: the sum is the gradient of ``l2norm(x0)``; the result is x0's gradient (autograd through
    the l2norm in float64)."""
    from tfla.ops.common.l2norm import L2NORM_EPS, l2norm_fwd

    gen = torch.Generator().manual_seed(T)
    x = torch.randn(B, T, H * G, D, generator=gen)
    x0 = torch.randn(B, T, H, D, generator=gen) * 3
    _, rstd = l2norm_fwd(x0.to(device))
    got = group_sum(x.to(device), H, torch.float32, l2=(x0.to(device), rstd))
    leaf = x0.double().requires_grad_()
    y = leaf / torch.sqrt((leaf * leaf).sum(-1, keepdim=True) + L2NORM_EPS)
    (want,) = torch.autograd.grad(y, leaf, x.double().view(B, T, H, G, D).sum(3))
    assert torch.allclose(got.double().cpu(), want, rtol=1e-5, atol=1e-5)
