"""Row-wise L2 normalisation ``y = x / sqrt(sum x^2 + eps)`` over the last dimension, forward and backward in
Triton (FLA's ``use_qk_l2norm_in_kernel`` semantics). One read and one write of the tensor each way; fp32 inside.

Backward: with ``r = (sum x^2 + eps)^(-1/2)`` and ``y = x r``, ``dx = r (dy - y (y . dy))`` (exact for any eps).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.grid import flat_grid
from tfla.ops.common.utils import autograd_call, cdiv, next_pow2, on_input_device

L2NORM_EPS = 1e-6


@triton.jit
def _l2norm_fwd_kernel(x, y, rstd, eps, R, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < R)[:, None] & (o_d < D)[None, :]
    p = o_r[:, None] * D + o_d[None, :]
    b_x = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
    b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, 1) + eps)
    tl.store(y + p, (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + o_r, b_r, mask=o_r < R)


@triton.jit
def _l2norm_bwd_kernel(x, rstd, dy, dx, R, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < R)[:, None] & (o_d < D)[None, :]
    p = o_r[:, None] * D + o_d[None, :]
    b_r = tl.load(rstd + o_r, mask=o_r < R, other=0.0)
    b_y = tl.load(x + p, mask=m, other=0.0).to(tl.float32) * b_r[:, None]
    b_dy = tl.load(dy + p, mask=m, other=0.0).to(tl.float32)
    b_dx = b_r[:, None] * (b_dy - b_y * tl.sum(b_y * b_dy, 1)[:, None])
    tl.store(dx + p, b_dx.to(dx.dtype.element_ty), mask=m)


def _rows(D: int) -> tuple[int, int]:
    BD = max(16, next_pow2(D))
    return BD, max(1, min(64, 4096 // BD))


def l2norm_fwd(x: torch.Tensor, eps: float = L2NORM_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: y like x, rstd fp32 with x's shape less the last dimension. x contiguous."""
    D = x.shape[-1]
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    R = rstd.numel()
    if R == 0:
        return y, rstd
    BD, BR = _rows(D)
    _l2norm_fwd_kernel[flat_grid(cdiv(R, BR))](x, y, rstd, eps, R, D=D, BD=BD, BR=BR, num_warps=4)
    return y, rstd


def l2norm_bwd(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dx (x's dtype) from the forward's input x, its rstd and the gradient of y."""
    D = x.shape[-1]
    dx = torch.empty_like(x)
    R = rstd.numel()
    if R == 0:
        return dx
    BD, BR = _rows(D)
    _l2norm_bwd_kernel[flat_grid(cdiv(R, BR))](x, rstd, dy.contiguous(), dx, R, D=D, BD=BD, BR=BR, num_warps=4)
    return dx


class L2NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        x = x.contiguous()
        y, rstd = l2norm_fwd(x, eps)
        ctx.save_for_backward(x, rstd)
        return y

    @staticmethod
    @on_input_device
    def backward(ctx, dy):
        x, rstd = ctx.saved_tensors
        return l2norm_bwd(x, rstd, dy), None


@torch.library.custom_op("tfla::l2norm_fwd", mutates_args=())
@on_input_device
def _l2norm_fwd_op(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return l2norm_fwd(x.contiguous(), eps)


@_l2norm_fwd_op.register_fake
def _(x, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("tfla::l2norm_bwd", mutates_args=())
@on_input_device
def _l2norm_bwd_op(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return l2norm_bwd(x.contiguous(), rstd, dy)


@_l2norm_bwd_op.register_fake
def _(x, rstd, dy):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _l2norm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1])


def _l2norm_backward(ctx, dy, _drstd):
    x, rstd = ctx.saved_tensors
    return _l2norm_bwd_op(x, rstd, dy), None


_l2norm_fwd_op.register_autograd(_l2norm_backward, setup_context=_l2norm_setup)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2, -1) + eps)`` in x's dtype (fp32 inside), differentiable; FLA's in-kernel l2norm. Under
    ``torch.compile`` a custom op pair (``tfla::l2norm_fwd`` / ``tfla::l2norm_bwd``) the compiler does not trace."""
    if torch.compiler.is_compiling():
        return _l2norm_fwd_op(x, eps)[0]
    return autograd_call(L2NormFunction)(x, eps)  # (no autograd node where no gradient is needed: decode steps)
