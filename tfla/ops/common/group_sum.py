"""Sum over each key head's group of value heads (grouped value heads, GVA), with the cast to the output dtype, in one
pass: ``x [B, T, HV, D]`` (gradients per value head, in the input dtype or fp32) -> ``[B, T, H, D]``. The gradients of
q and k with HV > H are formed per value head and summed here once in fp32 (instead of a strided PyTorch ``sum`` plus
a dtype copy: two passes)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.grid import flat_grid
from tfla.ops.common.utils import cdiv, next_pow2


@triton.jit
def _group_sum_kernel(x, y, R, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """Rows r of y (``[R, D]``, R = B*T*H) = sum over g < G of rows r*G + g of x (``[R*G, D]``), fp32 inside."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < R)[:, None] & (o_d < D)[None, :]
    acc = tl.zeros([BR, BD], dtype=tl.float32)
    for g in range(G):
        acc += tl.load(x + (o_r * G + g)[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(y + o_r[:, None] * D + o_d[None, :], acc.to(y.dtype.element_ty), mask=m)


def group_sum(x: torch.Tensor, H: int, dtype: torch.dtype) -> torch.Tensor:
    """``x [B, T, HV, D]`` contiguous, HV a multiple of H -> ``[B, T, H, D]`` in ``dtype``: the sum over the HV / H
    consecutive value heads of each key head (float64 inputs stay float64 inside)."""
    B, T, HV, D = x.shape
    if x.dtype == torch.float64:  # verification dtype: exact in PyTorch
        return x.view(B, T, H, HV // H, D).sum(3).to(dtype)
    x = x.contiguous()
    y = torch.empty(B, T, H, D, dtype=dtype, device=x.device)
    R = B * T * H
    if R == 0 or D == 0:
        return y
    BD = max(16, next_pow2(D))
    BR = max(1, min(64, 4096 // BD))
    _group_sum_kernel[flat_grid(cdiv(R, BR))](x, y, R, G=HV // H, D=D, BD=BD, BR=BR, num_warps=4)
    return y
