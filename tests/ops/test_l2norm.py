"""The Triton l2norm (``tfla/ops/common/l2norm.py``) against the float64 formula, forward and backward."""
import pytest
import torch

from tfla.ops.common.l2norm import l2norm
from tfla.utils.testing import assert_rel_close, tolerance


def _ref(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


@pytest.mark.parametrize("shape", [(1, 1, 1, 16), (2, 37, 3, 20), (1, 70, 2, 128), (5, 256), (0, 4, 32)])
def test_l2norm_matches_float64(device, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen)
    x.view(-1, shape[-1])[:1] *= 1e-4  # a row whose sum of squares is near eps
    dy = torch.randn(shape, generator=gen)
    xd = x.double().requires_grad_()
    y_ref = _ref(xd)
    dx_ref, = torch.autograd.grad(y_ref, xd, dy.double())
    xt = x.to(device).requires_grad_()
    y = l2norm(xt)
    dx, = torch.autograd.grad(y, xt, dy.to(device))
    assert y.dtype == x.dtype and y.shape == x.shape
    if x.numel() == 0:
        return
    assert_rel_close("y", y.detach().cpu(), y_ref.detach(), tolerance(torch.float32))
    assert_rel_close("dx", dx.cpu(), dx_ref, tolerance(torch.float32))


def test_l2norm_fp16_noncontiguous(device):
    """16-bit input (fp32 inside, one rounding of y) and a non-contiguous view (q of a fused projection)."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 50, 3, 4, 32, generator=gen).half()
    q = qkv[:, :, 0].to(device)
    y = l2norm(q)
    assert_rel_close("y", y.float().cpu(), _ref(qkv[:, :, 0].double()), 1e-3)
