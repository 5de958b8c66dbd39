"""UT/WY transform of the (gated) delta rule on 64-row sub-chunks: the level-2 stage of TFLA-GDN.

Notation: B batch, T time, H key heads, HV value heads (a multiple of H), K/V head dims,
BT outer chunk (L, where states live), BS = 64 sub-chunk rows, BC = 16 block rows,
BK/BV head-dim tiles. Gates are cumulative within the outer chunk, in log2 units (``G``).

For the sub-chunk of rows r = 1..64 that starts after row c (c = the last row of the previous
sub-chunk in the same outer chunk; G_c = 0 at an outer-chunk start):

    A[r, i] = beta_r (k_r . k_i) 2^(G_r - G_i)     for i < r, else 0     (64 x 64)
    Tm      = (I + A)^-1                                               (unit lower triangular)
    W       = Tm @ (beta 2^(G - G_c) * K)                              [64, K]
    U       = Tm @ (beta * V)                                          [64, V]

``Tm`` is built from 16 x 16 blocks: diagonal blocks by forward substitution, off-diagonal blocks
by block forward substitution ``Tm_ji = -Tm_jj sum_{m=i..j-1} A_jm Tm_mi`` (design note
``gdn-two-level.md``, "Level 2", way 1), all in fp32 with IEEE dots. Every exponent used is
``<= 0`` for ``g <= 0``; nothing divides by ``2^G``.

The outer-chunk (L x L) UT transform is never formed: the state stage applies it by block
forward substitution over these sub-chunks, with the running state as the accumulator.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.utils import SUB_CHUNK, cdiv, dot_precision, next_pow2


@triton.jit
def _unit_lower_inverse(b_A, BC: tl.constexpr):
    """``(I + A)^-1`` of a strictly lower-triangular fp32 ``[BC, BC]`` block, row by row:
    ``X[r] = e_r - sum_{s < r} A[r, s] X[s]``."""
    o = tl.arange(0, BC)
    b_X = tl.where(o[:, None] == o[None, :], 1.0, 0.0)
    for r in range(1, BC):
        b_a = tl.sum(tl.where(o[:, None] == r, b_A, 0.0), 0)  # [BC] row r of A
        b_X = tl.where(o[:, None] == r, b_X - tl.sum(b_a[:, None] * b_X, 0)[None, :], b_X)
    return b_X


@triton.jit
def _gdn_ut_fwd_kernel(
    k,
    v,
    g,
    beta,
    w,
    u,
    ai,
    cu_seqlens,
    chunk_indices,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_G: tl.constexpr,
    STORE_AI: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    BS: tl.constexpr = 64
    BC: tl.constexpr = 16
    i_s, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_s * 2).to(tl.int64)
        i_s = tl.load(chunk_indices + i_s * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_b * T
    t0 = i_s * BS
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    t_0 = t0 + o_c
    t_1 = t_0 + BC
    t_2 = t_1 + BC
    t_3 = t_2 + BC
    m_0 = t_0 < T
    m_1 = t_1 < T
    m_2 = t_2 < T
    m_3 = t_3 < T

    # keys of the four 16-row blocks  [BC, BK]
    p_k = k + (bos * H + i_h) * K + o_k[None, :]
    b_k0 = tl.load(p_k + t_0[:, None] * (H * K), mask=m_0[:, None] & m_k[None, :], other=0.0)
    b_k1 = tl.load(p_k + t_1[:, None] * (H * K), mask=m_1[:, None] & m_k[None, :], other=0.0)
    b_k2 = tl.load(p_k + t_2[:, None] * (H * K), mask=m_2[:, None] & m_k[None, :], other=0.0)
    b_k3 = tl.load(p_k + t_3[:, None] * (H * K), mask=m_3[:, None] & m_k[None, :], other=0.0)
    p_b = beta + bos * HV + i_hv
    b_b0 = tl.load(p_b + t_0 * HV, mask=m_0, other=0.0).to(tl.float32)
    b_b1 = tl.load(p_b + t_1 * HV, mask=m_1, other=0.0).to(tl.float32)
    b_b2 = tl.load(p_b + t_2 * HV, mask=m_2, other=0.0).to(tl.float32)
    b_b3 = tl.load(p_b + t_3 * HV, mask=m_3, other=0.0).to(tl.float32)

    # A = beta (K K^T) * gate, strictly lower: 4 diagonal and 6 off-diagonal [BC, BC] blocks
    b_A00 = tl.dot(b_k0, tl.trans(b_k0), input_precision=DOT_PREC)
    b_A10 = tl.dot(b_k1, tl.trans(b_k0), input_precision=DOT_PREC)
    b_A11 = tl.dot(b_k1, tl.trans(b_k1), input_precision=DOT_PREC)
    b_A20 = tl.dot(b_k2, tl.trans(b_k0), input_precision=DOT_PREC)
    b_A21 = tl.dot(b_k2, tl.trans(b_k1), input_precision=DOT_PREC)
    b_A22 = tl.dot(b_k2, tl.trans(b_k2), input_precision=DOT_PREC)
    b_A30 = tl.dot(b_k3, tl.trans(b_k0), input_precision=DOT_PREC)
    b_A31 = tl.dot(b_k3, tl.trans(b_k1), input_precision=DOT_PREC)
    b_A32 = tl.dot(b_k3, tl.trans(b_k2), input_precision=DOT_PREC)
    b_A33 = tl.dot(b_k3, tl.trans(b_k3), input_precision=DOT_PREC)

    m_lo = o_c[:, None] > o_c[None, :]
    if USE_G:
        p_g = g + bos * HV + i_hv
        b_g0 = tl.load(p_g + t_0 * HV, mask=m_0, other=0.0)
        b_g1 = tl.load(p_g + t_1 * HV, mask=m_1, other=0.0)
        b_g2 = tl.load(p_g + t_2 * HV, mask=m_2, other=0.0)
        b_g3 = tl.load(p_g + t_3 * HV, mask=m_3, other=0.0)
        # G_c: cumulative gate of the row before this sub-chunk (0 at an outer-chunk start)
        b_gc = tl.load(p_g + (t0 - 1) * HV, mask=(t0 % BT) != 0, other=0.0)
        # masked lanes get 2^-inf = 0: no overflow (and no inf * 0) for rows past T or above the diagonal
        b_A00 = b_A00 * tl.exp2(tl.where(m_lo & m_0[:, None], b_g0[:, None] - b_g0[None, :], float("-inf")))
        b_A11 = b_A11 * tl.exp2(tl.where(m_lo & m_1[:, None], b_g1[:, None] - b_g1[None, :], float("-inf")))
        b_A22 = b_A22 * tl.exp2(tl.where(m_lo & m_2[:, None], b_g2[:, None] - b_g2[None, :], float("-inf")))
        b_A33 = b_A33 * tl.exp2(tl.where(m_lo & m_3[:, None], b_g3[:, None] - b_g3[None, :], float("-inf")))
        b_A10 = b_A10 * tl.exp2(tl.where(m_1[:, None], b_g1[:, None] - b_g0[None, :], float("-inf")))
        b_A20 = b_A20 * tl.exp2(tl.where(m_2[:, None], b_g2[:, None] - b_g0[None, :], float("-inf")))
        b_A21 = b_A21 * tl.exp2(tl.where(m_2[:, None], b_g2[:, None] - b_g1[None, :], float("-inf")))
        b_A30 = b_A30 * tl.exp2(tl.where(m_3[:, None], b_g3[:, None] - b_g0[None, :], float("-inf")))
        b_A31 = b_A31 * tl.exp2(tl.where(m_3[:, None], b_g3[:, None] - b_g1[None, :], float("-inf")))
        b_A32 = b_A32 * tl.exp2(tl.where(m_3[:, None], b_g3[:, None] - b_g2[None, :], float("-inf")))
    else:
        b_A00 = tl.where(m_lo & m_0[:, None], b_A00, 0.0)
        b_A11 = tl.where(m_lo & m_1[:, None], b_A11, 0.0)
        b_A22 = tl.where(m_lo & m_2[:, None], b_A22, 0.0)
        b_A33 = tl.where(m_lo & m_3[:, None], b_A33, 0.0)
        b_A10 = tl.where(m_1[:, None], b_A10, 0.0)
        b_A20 = tl.where(m_2[:, None], b_A20, 0.0)
        b_A21 = tl.where(m_2[:, None], b_A21, 0.0)
        b_A30 = tl.where(m_3[:, None], b_A30, 0.0)
        b_A31 = tl.where(m_3[:, None], b_A31, 0.0)
        b_A32 = tl.where(m_3[:, None], b_A32, 0.0)
    b_A00 *= b_b0[:, None]
    b_A11 *= b_b1[:, None]
    b_A22 *= b_b2[:, None]
    b_A33 *= b_b3[:, None]
    b_A10 *= b_b1[:, None]
    b_A20 *= b_b2[:, None]
    b_A21 *= b_b2[:, None]
    b_A30 *= b_b3[:, None]
    b_A31 *= b_b3[:, None]
    b_A32 *= b_b3[:, None]

    # Tm = (I + A)^-1: diagonal blocks by substitution, the rest by block forward substitution
    b_T00 = _unit_lower_inverse(b_A00, BC)
    b_T11 = _unit_lower_inverse(b_A11, BC)
    b_T22 = _unit_lower_inverse(b_A22, BC)
    b_T33 = _unit_lower_inverse(b_A33, BC)
    b_T10 = -tl.dot(b_T11, tl.dot(b_A10, b_T00, input_precision="ieee"), input_precision="ieee")
    b_T21 = -tl.dot(b_T22, tl.dot(b_A21, b_T11, input_precision="ieee"), input_precision="ieee")
    b_T32 = -tl.dot(b_T33, tl.dot(b_A32, b_T22, input_precision="ieee"), input_precision="ieee")
    b_T20 = -tl.dot(b_T22, tl.dot(b_A20, b_T00, input_precision="ieee")
                    + tl.dot(b_A21, b_T10, input_precision="ieee"), input_precision="ieee")
    b_T31 = -tl.dot(b_T33, tl.dot(b_A31, b_T11, input_precision="ieee")
                    + tl.dot(b_A32, b_T21, input_precision="ieee"), input_precision="ieee")
    b_T30 = -tl.dot(b_T33, tl.dot(b_A30, b_T00, input_precision="ieee")
                    + tl.dot(b_A31, b_T10, input_precision="ieee")
                    + tl.dot(b_A32, b_T20, input_precision="ieee"), input_precision="ieee")

    if STORE_AI:
        # Tm in [B, T, HV, BS] layout (row r of the sub-chunk holds Tm[r, :])
        p_ai = ai + (bos * HV + i_hv) * BS + o_c[None, :]
        tl.store(p_ai + t_0[:, None] * (HV * BS), b_T00, mask=m_0[:, None])
        tl.store(p_ai + t_1[:, None] * (HV * BS), b_T10, mask=m_1[:, None])
        tl.store(p_ai + t_1[:, None] * (HV * BS) + BC, b_T11, mask=m_1[:, None])
        tl.store(p_ai + t_2[:, None] * (HV * BS), b_T20, mask=m_2[:, None])
        tl.store(p_ai + t_2[:, None] * (HV * BS) + BC, b_T21, mask=m_2[:, None])
        tl.store(p_ai + t_2[:, None] * (HV * BS) + 2 * BC, b_T22, mask=m_2[:, None])
        tl.store(p_ai + t_3[:, None] * (HV * BS), b_T30, mask=m_3[:, None])
        tl.store(p_ai + t_3[:, None] * (HV * BS) + BC, b_T31, mask=m_3[:, None])
        tl.store(p_ai + t_3[:, None] * (HV * BS) + 2 * BC, b_T32, mask=m_3[:, None])
        tl.store(p_ai + t_3[:, None] * (HV * BS) + 3 * BC, b_T33, mask=m_3[:, None])

    dt = k.dtype.element_ty
    c00 = b_T00.to(dt)
    c10 = b_T10.to(dt)
    c11 = b_T11.to(dt)
    c20 = b_T20.to(dt)
    c21 = b_T21.to(dt)
    c22 = b_T22.to(dt)
    c30 = b_T30.to(dt)
    c31 = b_T31.to(dt)
    c32 = b_T32.to(dt)
    c33 = b_T33.to(dt)

    # W = Tm @ (beta 2^(G - G_c) K)
    if USE_G:
        b_x0 = (b_k0 * (b_b0 * tl.exp2(b_g0 - b_gc))[:, None]).to(dt)
        b_x1 = (b_k1 * (b_b1 * tl.exp2(b_g1 - b_gc))[:, None]).to(dt)
        b_x2 = (b_k2 * (b_b2 * tl.exp2(b_g2 - b_gc))[:, None]).to(dt)
        b_x3 = (b_k3 * (b_b3 * tl.exp2(b_g3 - b_gc))[:, None]).to(dt)
    else:
        b_x0 = (b_k0 * b_b0[:, None]).to(dt)
        b_x1 = (b_k1 * b_b1[:, None]).to(dt)
        b_x2 = (b_k2 * b_b2[:, None]).to(dt)
        b_x3 = (b_k3 * b_b3[:, None]).to(dt)
    b_w0 = tl.dot(c00, b_x0, input_precision=DOT_PREC)
    b_w1 = tl.dot(c11, b_x1, tl.dot(c10, b_x0, input_precision=DOT_PREC), input_precision=DOT_PREC)
    b_w2 = tl.dot(c22, b_x2, tl.dot(c21, b_x1, tl.dot(c20, b_x0, input_precision=DOT_PREC),
                                   input_precision=DOT_PREC), input_precision=DOT_PREC)
    b_w3 = tl.dot(c33, b_x3, tl.dot(c32, b_x2, tl.dot(c31, b_x1, tl.dot(c30, b_x0, input_precision=DOT_PREC),
                                                     input_precision=DOT_PREC), input_precision=DOT_PREC),
                  input_precision=DOT_PREC)
    p_w = w + (bos * HV + i_hv) * K + o_k[None, :]
    tl.store(p_w + t_0[:, None] * (HV * K), b_w0.to(w.dtype.element_ty), mask=m_0[:, None] & m_k[None, :])
    tl.store(p_w + t_1[:, None] * (HV * K), b_w1.to(w.dtype.element_ty), mask=m_1[:, None] & m_k[None, :])
    tl.store(p_w + t_2[:, None] * (HV * K), b_w2.to(w.dtype.element_ty), mask=m_2[:, None] & m_k[None, :])
    tl.store(p_w + t_3[:, None] * (HV * K), b_w3.to(w.dtype.element_ty), mask=m_3[:, None] & m_k[None, :])

    # U = Tm @ (beta V), one value tile at a time
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_v = v + (bos * HV + i_hv) * V + o_v[None, :]
        b_y0 = (tl.load(p_v + t_0[:, None] * (HV * V), mask=m_0[:, None] & m_v[None, :], other=0.0)
                * b_b0[:, None]).to(dt)
        b_y1 = (tl.load(p_v + t_1[:, None] * (HV * V), mask=m_1[:, None] & m_v[None, :], other=0.0)
                * b_b1[:, None]).to(dt)
        b_y2 = (tl.load(p_v + t_2[:, None] * (HV * V), mask=m_2[:, None] & m_v[None, :], other=0.0)
                * b_b2[:, None]).to(dt)
        b_y3 = (tl.load(p_v + t_3[:, None] * (HV * V), mask=m_3[:, None] & m_v[None, :], other=0.0)
                * b_b3[:, None]).to(dt)
        b_u0 = tl.dot(c00, b_y0, input_precision=DOT_PREC)
        b_u1 = tl.dot(c11, b_y1, tl.dot(c10, b_y0, input_precision=DOT_PREC), input_precision=DOT_PREC)
        b_u2 = tl.dot(c22, b_y2, tl.dot(c21, b_y1, tl.dot(c20, b_y0, input_precision=DOT_PREC),
                                       input_precision=DOT_PREC), input_precision=DOT_PREC)
        b_u3 = tl.dot(c33, b_y3, tl.dot(c32, b_y2, tl.dot(c31, b_y1, tl.dot(c30, b_y0, input_precision=DOT_PREC),
                                                         input_precision=DOT_PREC), input_precision=DOT_PREC),
                      input_precision=DOT_PREC)
        p_u = u + (bos * HV + i_hv) * V + o_v[None, :]
        tl.store(p_u + t_0[:, None] * (HV * V), b_u0.to(u.dtype.element_ty), mask=m_0[:, None] & m_v[None, :])
        tl.store(p_u + t_1[:, None] * (HV * V), b_u1.to(u.dtype.element_ty), mask=m_1[:, None] & m_v[None, :])
        tl.store(p_u + t_2[:, None] * (HV * V), b_u2.to(u.dtype.element_ty), mask=m_2[:, None] & m_v[None, :])
        tl.store(p_u + t_3[:, None] * (HV * V), b_u3.to(u.dtype.element_ty), mask=m_3[:, None] & m_v[None, :])


def ut_transform_fwd(
    k: torch.Tensor,
    v: torch.Tensor,
    g_cum: torch.Tensor | None,
    beta: torch.Tensor,
    chunk_size: int,
    cu_seqlens: torch.Tensor | None = None,
    sub_indices: torch.Tensor | None = None,
    store_ai: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """W, U of every 64-row sub-chunk (and optionally Tm).

    Args:
        k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; beta: ``[B, T, HV]``.
        g_cum: ``[B, T, HV]`` fp32 cumulative gate within outer chunks of ``chunk_size``, log2 units
            (or None for the ungated delta rule).
        sub_indices: varlen table of (sequence, sub-chunk) from ``prepare_chunk_indices(.., 64)``.
    Returns:
        ``w [B, T, HV, K]`` and ``u [B, T, HV, V]`` in k's dtype; ``ai [B, T, HV, 64]`` fp32 or None.
    """
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    w = torch.empty(B, T, HV, K, dtype=k.dtype, device=k.device)
    u = torch.empty(B, T, HV, V, dtype=k.dtype, device=k.device)
    ai = torch.zeros(B, T, HV, SUB_CHUNK, dtype=torch.float32, device=k.device) if store_ai else None
    NS = sub_indices.shape[0] if cu_seqlens is not None else cdiv(T, SUB_CHUNK)
    if NS == 0 or B * HV == 0:
        return w, u, ai
    BK = max(16, next_pow2(K))
    BV = min(max(16, next_pow2(V)), 64)
    _gdn_ut_fwd_kernel[(NS, B * HV)](
        k, v, g_cum, beta, w, u, ai, cu_seqlens, sub_indices, T,
        H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=BK, BV=BV,
        USE_G=g_cum is not None, STORE_AI=store_ai, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=dot_precision(k.dtype),
        num_warps=4 if K <= 128 else 8,
    )
    return w, u, ai
