"""The backward's first step for an output divided by a normalizer dot, ``h = o / d`` per row, shared by the
mLSTM and FLA's normalized linear attention: from the output's cotangent dh and h it forms, in one pass over
both, the numerator's cotangent ``dh / d`` (as a row factor or written) and the cotangent of the dot ``den``.

Notation: B batch, T time, H heads, V value head dim, R = B T H rows, BR rows / BV columns per program.

    mLSTM (SIGNED off):   d = max(|den|, lo) + eps     (lo: per-row lower bound e^{-m}, or 1)
    FLA (SIGNED on):      d = den + eps                (sign kept, eps added; fla 0.6.0 normalize_with_z_state)

``den`` is the forward's ``chunk_tiled(normalizer=..)`` dot (``scale q . n``), fp32 ``[B, T, H]``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.utils import cdiv, next_pow2


@triton.jit
def _normalizer_bwd_prep_kernel(dh, h, den, lo, sd, dden, rl, dos, R, eps, V: tl.constexpr, BR: tl.constexpr,
                                BV: tl.constexpr, HAS_LO: tl.constexpr, EXACT: tl.constexpr, SIGNED: tl.constexpr,
                                ACC: tl.constexpr):
    """Per row r of ``h = o / d``, ``sd = (dh . h) / d``. SIGNED off: ``d = max(|den|, lo) + eps``, ``rl = -log2 d``
    (the numerator's cotangent is ``dh / d = dh 2^rl``, applied as a row factor by the kernels that read dh), ``sd``
    stored and, for the exact gradient, ``dden = -sd sign(den)`` where ``|den| > lo`` (else 0). SIGNED on:
    ``d = den + eps`` (no log2 of a signed d: ``dos = dh / d`` is written in dos' dtype) and ``dden = -sd``."""
    i_r = tl.program_id(0).to(tl.int64)
    o_r = i_r * BR + tl.arange(0, BR)
    m_r = o_r < R
    o_v = tl.arange(0, BV)
    m = m_r[:, None] & (o_v < V)[None, :]
    b_dh = tl.load(dh + o_r[:, None] * V + o_v[None, :], mask=m, other=0.0).to(ACC)  # [BR, BV]
    b_h = tl.load(h + o_r[:, None] * V + o_v[None, :], mask=m, other=0.0).to(ACC)
    b_den = tl.load(den + o_r, mask=m_r, other=1.0)  # [BR]
    if SIGNED:
        b_d = b_den + eps
        tl.store(dos + o_r[:, None] * V + o_v[None, :], (b_dh / b_d[:, None]).to(dos.dtype.element_ty), mask=m)
        tl.store(dden + o_r, -tl.sum(b_dh * b_h, 1) / b_d, mask=m_r)
    else:
        if HAS_LO:
            b_lo = tl.load(lo + o_r, mask=m_r, other=1.0)
        else:
            b_lo = tl.full([BR], 1.0, dtype=ACC)
        b_d = tl.maximum(tl.abs(b_den), b_lo) + eps
        tl.store(rl + o_r, -tl.log2(b_d), mask=m_r)
        b_sd = tl.sum(b_dh * b_h, 1) / b_d
        tl.store(sd + o_r, b_sd, mask=m_r)
        if EXACT:
            b_sg = tl.where(b_den > 0, 1.0, tl.where(b_den < 0, -1.0, 0.0))
            tl.store(dden + o_r, tl.where(tl.abs(b_den) > b_lo, -b_sd * b_sg, 0.0), mask=m_r)


def normalizer_bwd_prep(dh: torch.Tensor, h: torch.Tensor, den: torch.Tensor, lo: torch.Tensor | None, eps: float,
                        exact: bool = True, signed: bool = False, do_dtype: torch.dtype | None = None):
    """For ``h = o / d`` (``dh``, ``h`` ``[B, T, H, V]`` contiguous, ``den`` ``[B, T, H]`` fp32; module docstring):

    - ``signed=False`` (the mLSTM): ``(rl, sd, dden or None)``, each ``[B, T, H]`` fp32 (float64 for float64 dh):
      the numerator's cotangent is ``dh 2^rl`` per row, ``sd = (dh . h) / d``, ``dden`` only with ``exact``;
      ``lo`` the per-row lower bound or None (1).
    - ``signed=True`` (FLA's linear attention, ``lo`` None): ``(do [B, T, H, V] = dh / d in do_dtype (default dh's),
      dden [B, T, H] fp32 = -(dh . h) / d)``.
    """
    B, T, H, V = dh.shape
    acc = torch.float64 if dh.dtype == torch.float64 else torch.float32
    if signed and lo is not None:
        raise ValueError("the signed normalizer (d = den + eps) has no lower bound `lo`")
    dden = torch.empty(B, T, H, dtype=acc, device=dh.device) if (exact or signed) else None
    if signed:
        dos = torch.empty(B, T, H, V, dtype=do_dtype or dh.dtype, device=dh.device)
        rl = sd = None
    else:
        dos = None
        rl = torch.empty(B, T, H, dtype=acc, device=dh.device)
        sd = torch.empty(B, T, H, dtype=acc, device=dh.device)
    R = B * T * H
    BV = max(16, next_pow2(V))
    BR = max(1, 4096 // BV)
    if R > 0:
        _normalizer_bwd_prep_kernel[(cdiv(R, BR),)](
            dh, h, den, lo, sd, dden, rl, dos, R, eps, V=V, BR=BR, BV=BV, HAS_LO=lo is not None, EXACT=exact,
            SIGNED=signed, ACC=tl.float64 if acc == torch.float64 else tl.float32)
    return (dos, dden) if signed else (rl, sd, dden)
