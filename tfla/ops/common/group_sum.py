"""Sum over each key head's group of value heads (grouped value heads, GVA), with the cast to the output dtype, in one
pass: ``x [B, T, HV, D]`` (gradients per value head, in the input dtype or fp32) -> ``[B, T, H, D]``. The gradients of
q and k with HV > H are formed per value head and summed here once in fp32 (except on Hopper at K = V = 128, where the
chunk-gradient kernel sums them itself: ``chunk_dqkw_ws.py``'s ``gva_sum``) (instead of a strided PyTorch ``sum`` plus
a dtype copy: two passes). With ``use_qk_l2norm_in_kernel`` the l2norm's backward follows in the same pass
(``dx = r (dy - y (y . dy))``, ``y = x r``: ``tfla/ops/common/l2norm.py``), so the summed gradient of the normalized
rows is never written."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.grid import flat_grid
from tfla.ops.common.utils import cdiv, next_pow2


@triton.jit
def _group_sum_kernel(x, y, R, l2x, l2r, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                      L2: tl.constexpr):
    """Rows r of y (``[R, D]``, R = B*T*H) = sum over g < G of rows r*G + g of x (``[R*G, D]``), fp32 inside; with
    ``L2`` the sum is the gradient of l2norm's output and y its input's: ``r (dy - z (z . dy))``, ``z = l2x r``
    (``l2x [R, D]`` the l2norm's input, ``l2r [R]`` fp32 its ``1 / sqrt(sum x^2 + eps)``)."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < R)[:, None] & (o_d < D)[None, :]
    acc = tl.zeros([BR, BD], dtype=tl.float32)
    for g in range(G):
        acc += tl.load(x + (o_r * G + g)[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    if L2:
        b_r = tl.load(l2r + o_r, mask=o_r < R, other=0.0)
        b_z = tl.load(l2x + o_r[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32) * b_r[:, None]
        acc = b_r[:, None] * (acc - b_z * tl.sum(b_z * acc, 1)[:, None])
    tl.store(y + o_r[:, None] * D + o_d[None, :], acc.to(y.dtype.element_ty), mask=m)


def group_sum(x: torch.Tensor, H: int, dtype: torch.dtype, l2: tuple | None = None) -> torch.Tensor:
    """``x [B, T, HV, D]`` contiguous, HV a multiple of H -> ``[B, T, H, D]`` in ``dtype``: the sum over the HV / H
    consecutive value heads of each key head (float64 inputs stay float64 inside). ``l2 = (x0, rstd)``: the sum is
    the gradient of ``l2norm(x0)`` (x0 ``[B, T, H, D]`` contiguous, rstd ``[B, T, H]`` fp32 from ``l2norm_fwd``);
    returns x0's gradient instead."""
    B, T, HV, D = x.shape
    if x.dtype == torch.float64:  # verification dtype: exact in PyTorch
        y = x.view(B, T, H, HV // H, D).sum(3)
        if l2 is not None:
            x0, r = l2[0].double(), l2[1].double()[..., None]
            z = x0 * r
            y = r * (y - z * (z * y).sum(-1, keepdim=True))
        return y.to(dtype)
    x = x.contiguous()
    y = torch.empty(B, T, H, D, dtype=dtype, device=x.device)
    R = B * T * H
    if R == 0 or D == 0:
        return y
    BD = max(16, next_pow2(D))
    BR = max(1, min(64, 4096 // BD))
    _group_sum_kernel[flat_grid(cdiv(R, BR))](x, y, R, l2[0] if l2 is not None else y, l2[1] if l2 is not None else y,
                                              G=HV // H, D=D, BD=BD, BR=BR, L2=l2 is not None, num_warps=4)
    return y
