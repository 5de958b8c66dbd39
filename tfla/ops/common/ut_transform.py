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

Two kernels: ``_gdn_ut_inverse_kernel`` builds ``Tm`` from 16 x 16 blocks (diagonal blocks by forward
substitution, off-diagonal blocks by block forward substitution ``Tm_ji = -Tm_jj sum_{m=i..j-1} A_jm
Tm_mi``, ``docs/gdn-math.md`` section 4.1), in fp32 with IEEE dots, on few warps
(16 x 16 tiles waste wide programs), and stores it in the input dtype; ``_gdn_wy_fwd_kernel`` then
forms W and U with full 64 x 64 products. Every exponent used is ``<= 0`` for ``g <= 0``; nothing
divides by ``2^G``.

The outer-chunk (L x L) UT transform is never formed: the state stage applies it by block
forward substitution over these sub-chunks, with the running state as the accumulator.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.grid import check_varlen_batch, program_rows, tile_grid
from tfla.ops.common.utils import SUB_CHUNK, acc_dtype, cdiv, dot_precision, next_pow2


@triton.jit
def _unit_lower_inverse(b_A, BC: tl.constexpr, ACC: tl.constexpr):
    """``(I + A)^-1`` of a strictly lower-triangular fp32 ``[BC, BC]`` block.

    ``I + A = prod_j (I + a_j e_j^T)`` with ``a_j`` column j of A, so the inverse is
    ``prod_{j = BC-1 .. 0} (I - a_j e_j^T)``: starting from ``X = I``, ``X <- X - a_j (e_j^T X)`` for
    j = 0, 1, ... Column j of A comes out row-indexed and row j of X column-indexed, so every step
    is an outer-product update with no register-layout conversion.
    """
    o = tl.arange(0, BC)
    b_X = tl.where(o[:, None] == o[None, :], 1.0, 0.0).to(ACC)
    for j in range(0, BC - 1):
        b_a = tl.sum(tl.where(o[None, :] == j, b_A, 0.0), 1)  # [BC] column j of A
        b_x = tl.sum(tl.where(o[:, None] == j, b_X, 0.0), 0)  # [BC] row j of X
        b_X -= b_a[:, None] * b_x[None, :]
    return b_X


@triton.jit
def _gdn_ut_inverse_kernel(
    k,
    v,
    g,
    beta,
    ai,
    w,
    u,
    cu_seqlens,
    chunk_indices,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BK2: tl.constexpr,
    BV: tl.constexpr,
    FUSE_WY: tl.constexpr,
    USE_G: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    MERGE_PREC: tl.constexpr,
    ACC: tl.constexpr,
    FLAT: tl.constexpr = False,
):
    """Tm = (I + A)^-1 of one 64-row sub-chunk, A = beta (K K^T) 2^(G_r - G_i) strictly lower
    (and, with FUSE_WY, W and U of the same sub-chunk)."""
    BS: tl.constexpr = 64
    BC: tl.constexpr = 16
    i_s, i_bh = program_rows(T, BS, HV, IS_VARLEN, FLAT)  # (64-row sub-chunk, batch x head): 2-D or flat grid
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
    t_0 = t0 + o_c
    t_1 = t_0 + BC
    t_2 = t_1 + BC
    t_3 = t_2 + BC
    m_0 = t_0 < T
    m_1 = t_1 < T
    m_2 = t_2 < T
    m_3 = t_3 < T

    p_b = beta + bos * HV + i_hv
    b_b0 = tl.load(p_b + t_0 * HV, mask=m_0, other=0.0).to(ACC)
    b_b1 = tl.load(p_b + t_1 * HV, mask=m_1, other=0.0).to(ACC)
    b_b2 = tl.load(p_b + t_2 * HV, mask=m_2, other=0.0).to(ACC)
    b_b3 = tl.load(p_b + t_3 * HV, mask=m_3, other=0.0).to(ACC)

    # K K^T in 4 diagonal and 6 off-diagonal [BC, BC] blocks, accumulated over BK-wide key slices
    b_A00 = tl.zeros([BC, BC], dtype=ACC)
    b_A10 = tl.zeros([BC, BC], dtype=ACC)
    b_A11 = tl.zeros([BC, BC], dtype=ACC)
    b_A20 = tl.zeros([BC, BC], dtype=ACC)
    b_A21 = tl.zeros([BC, BC], dtype=ACC)
    b_A22 = tl.zeros([BC, BC], dtype=ACC)
    b_A30 = tl.zeros([BC, BC], dtype=ACC)
    b_A31 = tl.zeros([BC, BC], dtype=ACC)
    b_A32 = tl.zeros([BC, BC], dtype=ACC)
    b_A33 = tl.zeros([BC, BC], dtype=ACC)
    p_k = k + (bos * H + i_h) * K
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_k0 = tl.load(p_k + t_0[:, None] * (H * K) + o_k[None, :], mask=m_0[:, None] & m_k[None, :], other=0.0)
        b_k1 = tl.load(p_k + t_1[:, None] * (H * K) + o_k[None, :], mask=m_1[:, None] & m_k[None, :], other=0.0)
        b_k2 = tl.load(p_k + t_2[:, None] * (H * K) + o_k[None, :], mask=m_2[:, None] & m_k[None, :], other=0.0)
        b_k3 = tl.load(p_k + t_3[:, None] * (H * K) + o_k[None, :], mask=m_3[:, None] & m_k[None, :], other=0.0)
        b_A00 = tl.dot(b_k0, tl.trans(b_k0), b_A00, input_precision=DOT_PREC)
        b_A10 = tl.dot(b_k1, tl.trans(b_k0), b_A10, input_precision=DOT_PREC)
        b_A11 = tl.dot(b_k1, tl.trans(b_k1), b_A11, input_precision=DOT_PREC)
        b_A20 = tl.dot(b_k2, tl.trans(b_k0), b_A20, input_precision=DOT_PREC)
        b_A21 = tl.dot(b_k2, tl.trans(b_k1), b_A21, input_precision=DOT_PREC)
        b_A22 = tl.dot(b_k2, tl.trans(b_k2), b_A22, input_precision=DOT_PREC)
        b_A30 = tl.dot(b_k3, tl.trans(b_k0), b_A30, input_precision=DOT_PREC)
        b_A31 = tl.dot(b_k3, tl.trans(b_k1), b_A31, input_precision=DOT_PREC)
        b_A32 = tl.dot(b_k3, tl.trans(b_k2), b_A32, input_precision=DOT_PREC)
        b_A33 = tl.dot(b_k3, tl.trans(b_k3), b_A33, input_precision=DOT_PREC)

    m_lo = o_c[:, None] > o_c[None, :]
    if USE_G:
        p_g = g + bos * HV + i_hv
        b_g0 = tl.load(p_g + t_0 * HV, mask=m_0, other=0.0)
        b_g1 = tl.load(p_g + t_1 * HV, mask=m_1, other=0.0)
        b_g2 = tl.load(p_g + t_2 * HV, mask=m_2, other=0.0)
        b_g3 = tl.load(p_g + t_3 * HV, mask=m_3, other=0.0)
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
    b_T00 = _unit_lower_inverse(b_A00, BC, ACC)
    b_T11 = _unit_lower_inverse(b_A11, BC, ACC)
    b_T22 = _unit_lower_inverse(b_A22, BC, ACC)
    b_T33 = _unit_lower_inverse(b_A33, BC, ACC)
    b_T10 = -tl.dot(b_T11, tl.dot(b_A10, b_T00, input_precision=MERGE_PREC), input_precision=MERGE_PREC)
    b_T21 = -tl.dot(b_T22, tl.dot(b_A21, b_T11, input_precision=MERGE_PREC), input_precision=MERGE_PREC)
    b_T32 = -tl.dot(b_T33, tl.dot(b_A32, b_T22, input_precision=MERGE_PREC), input_precision=MERGE_PREC)
    b_T20 = -tl.dot(b_T22, tl.dot(b_A20, b_T00, input_precision=MERGE_PREC)
                    + tl.dot(b_A21, b_T10, input_precision=MERGE_PREC), input_precision=MERGE_PREC)
    b_T31 = -tl.dot(b_T33, tl.dot(b_A31, b_T11, input_precision=MERGE_PREC)
                    + tl.dot(b_A32, b_T21, input_precision=MERGE_PREC), input_precision=MERGE_PREC)
    b_T30 = -tl.dot(b_T33, tl.dot(b_A30, b_T00, input_precision=MERGE_PREC)
                    + tl.dot(b_A31, b_T10, input_precision=MERGE_PREC)
                    + tl.dot(b_A32, b_T20, input_precision=MERGE_PREC), input_precision=MERGE_PREC)

    # Tm in [B, T, HV, BS] layout (row r of the sub-chunk holds Tm[r, :]); upper blocks are zero
    dt_ai = ai.dtype.element_ty
    p_ai = ai + (bos * HV + i_hv) * BS + o_c[None, :]
    z = tl.zeros([BC, BC], dtype=dt_ai)
    tl.store(p_ai + t_0[:, None] * (HV * BS), b_T00.to(dt_ai), mask=m_0[:, None])
    tl.store(p_ai + t_0[:, None] * (HV * BS) + BC, z, mask=m_0[:, None])
    tl.store(p_ai + t_0[:, None] * (HV * BS) + 2 * BC, z, mask=m_0[:, None])
    tl.store(p_ai + t_0[:, None] * (HV * BS) + 3 * BC, z, mask=m_0[:, None])
    tl.store(p_ai + t_1[:, None] * (HV * BS), b_T10.to(dt_ai), mask=m_1[:, None])
    tl.store(p_ai + t_1[:, None] * (HV * BS) + BC, b_T11.to(dt_ai), mask=m_1[:, None])
    tl.store(p_ai + t_1[:, None] * (HV * BS) + 2 * BC, z, mask=m_1[:, None])
    tl.store(p_ai + t_1[:, None] * (HV * BS) + 3 * BC, z, mask=m_1[:, None])
    tl.store(p_ai + t_2[:, None] * (HV * BS), b_T20.to(dt_ai), mask=m_2[:, None])
    tl.store(p_ai + t_2[:, None] * (HV * BS) + BC, b_T21.to(dt_ai), mask=m_2[:, None])
    tl.store(p_ai + t_2[:, None] * (HV * BS) + 2 * BC, b_T22.to(dt_ai), mask=m_2[:, None])
    tl.store(p_ai + t_2[:, None] * (HV * BS) + 3 * BC, z, mask=m_2[:, None])
    tl.store(p_ai + t_3[:, None] * (HV * BS), b_T30.to(dt_ai), mask=m_3[:, None])
    tl.store(p_ai + t_3[:, None] * (HV * BS) + BC, b_T31.to(dt_ai), mask=m_3[:, None])
    tl.store(p_ai + t_3[:, None] * (HV * BS) + 2 * BC, b_T32.to(dt_ai), mask=m_3[:, None])
    tl.store(p_ai + t_3[:, None] * (HV * BS) + 3 * BC, b_T33.to(dt_ai), mask=m_3[:, None])
    if FUSE_WY:
        # read Tm back as one [64, 64] tile (written by other threads of this program: barrier)
        tl.debug_barrier()
        _wy_apply(k, v, g, beta, ai, w, u, t0, T, bos, i_h, i_hv, H, HV, K, V, BT, BK2, BV, USE_G, DOT_PREC, ACC)


@triton.jit
def _wy_apply(k, v, g, beta, ai, w, u, t0, T, bos, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr,
              K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
              USE_G: tl.constexpr, DOT_PREC: tl.constexpr, ACC: tl.constexpr, WITH_U: tl.constexpr = True):
    """W = Tm @ (beta 2^(G - G_c) K), U = Tm @ (beta V) for the 64-row sub-chunk at ``t0``, with Tm
    read back from ``ai``; K and V in tiles of BK and BV columns. WITH_U off: W only (v, u unused)."""
    BS: tl.constexpr = 64
    o_t = t0 + tl.arange(0, BS)
    m_t = o_t < T
    o_c = tl.arange(0, BS)
    dt = k.dtype.element_ty
    b_tm = tl.load(ai + (bos * HV + i_hv) * BS + o_t[:, None] * (HV * BS) + o_c[None, :],
                   mask=m_t[:, None], other=0.0).to(dt)  # [BS, BS]
    b_b = tl.load(beta + (bos + o_t) * HV + i_hv, mask=m_t, other=0.0).to(ACC)
    if USE_G:
        p_g = g + bos * HV + i_hv
        b_gc = tl.load(p_g + (t0 - 1) * HV, mask=(t0 % BT) != 0, other=0.0)
        b_g = tl.load(p_g + o_t * HV, mask=m_t, other=0.0)
        b_sk = b_b * tl.exp2(tl.where(m_t, b_g - b_gc, float("-inf")))
    else:
        b_sk = b_b
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_k = tl.load(k + (bos * H + i_h) * K + o_t[:, None] * (H * K) + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0.0)  # [BS, BK]
        b_w = tl.dot(b_tm, (b_k * b_sk[:, None]).to(dt), input_precision=DOT_PREC)
        tl.store(w + (bos * HV + i_hv) * K + o_t[:, None] * (HV * K) + o_k[None, :], b_w.to(w.dtype.element_ty),
                 mask=m_t[:, None] & m_k[None, :])
    if WITH_U:
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            p_off = (bos * HV + i_hv) * V + o_t[:, None] * (HV * V) + o_v[None, :]
            b_v = tl.load(v + p_off, mask=m_t[:, None] & m_v[None, :], other=0.0)
            b_u = tl.dot(b_tm, (b_v * b_b[:, None]).to(dt), input_precision=DOT_PREC)
            tl.store(u + p_off, b_u.to(u.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


@triton.jit
def _gdn_wy_fwd_kernel(
    k,
    v,
    g,
    beta,
    ai,
    w,
    u,
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
    IS_VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    ACC: tl.constexpr,
    WITH_U: tl.constexpr = True,
    FLAT: tl.constexpr = False,
):
    """W and U (WITH_U off: W only) of one 64-row sub-chunk from a stored Tm."""
    i_s, i_bh = program_rows(T, 64, HV, IS_VARLEN, FLAT)  # (64-row sub-chunk, batch x head): 2-D or flat grid
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_s * 2).to(tl.int64)
        i_s = tl.load(chunk_indices + i_s * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_b * T
    _wy_apply(k, v, g, beta, ai, w, u, i_s * 64, T, bos, i_h, i_hv, H, HV, K, V, BT, BK, BV, USE_G, DOT_PREC, ACC,
              WITH_U)


def ut_transform_fwd(
    k: torch.Tensor,
    v: torch.Tensor,
    g_cum: torch.Tensor | None,
    beta: torch.Tensor,
    chunk_size: int,
    cu_seqlens: torch.Tensor | None = None,
    sub_indices: torch.Tensor | None = None,
    config: dict | None = None,
    ai: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W, U and Tm of every 64-row sub-chunk (Tm computed unless ``ai`` is given).

    Args:
        k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; beta: ``[B, T, HV]``.
        g_cum: ``[B, T, HV]`` fp32 cumulative gate within outer chunks of ``chunk_size``, log2 units
            (or None for the ungated delta rule).
        sub_indices: varlen table of (sequence, sub-chunk) from ``prepare_chunk_indices(.., 64)``.
        config: overrides of ``fuse`` (one kernel for Tm, W, U), ``inv_warps``, ``wy_warps``,
            ``wy_stages``, ``BK``, ``BV``.
    Returns:
        ``w [B, T, HV, K]``, ``u [B, T, HV, V]`` and ``ai [B, T, HV, 64]`` (Tm, row r of each sub-chunk
        in row r), all in k's dtype.
    """
    cfg = {**UT_DEFAULTS, **(config or {})}
    if ai is not None:
        cfg["fuse"] = False
    return _ut_launch(k, v, g_cum, beta, chunk_size, cu_seqlens, sub_indices, cfg, fuse=cfg["fuse"], ai=ai)


def w_from_tm(
    k: torch.Tensor,
    g_cum: torch.Tensor | None,
    beta: torch.Tensor,
    ai: torch.Tensor,
    chunk_size: int,
    cu_seqlens: torch.Tensor | None = None,
    sub_indices: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """W = Tm (beta 2^(G - G_c) K) of every 64-row sub-chunk from a stored Tm (``ai``), without U: the
    backward when the forward kept Vnew. Shapes and config keys as ``ut_transform_fwd``; returns
    ``w [B, T, HV, K]`` in k's dtype."""
    # 64-wide key tiles: 0.128 ms vs 0.142 at UT_DEFAULTS' 32 (H100, B=4 T=8192 H=16 K=128 bf16; 128: 0.124)
    cfg = {**UT_DEFAULTS, "BK": 64, **(config or {})}
    B, T, H, K = k.shape
    HV = beta.shape[2]
    w = torch.empty(B, T, HV, K, dtype=k.dtype, device=k.device)
    NS = sub_indices.shape[0] if cu_seqlens is not None else cdiv(T, SUB_CHUNK)
    if NS == 0 or B * HV == 0:
        return w
    check_varlen_batch(B, cu_seqlens)
    grid, flat = tile_grid(NS, B * HV, force_flat=cfg.get("flat", False))
    _gdn_wy_fwd_kernel[grid](
        k, None, g_cum, beta, ai, w, None, cu_seqlens, sub_indices, T, H=H, HV=HV, K=K, V=16, BT=chunk_size, FLAT=flat,
        BK=min(max(16, next_pow2(K)), cfg["BK"]), BV=16, USE_G=g_cum is not None, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=dot_precision(k.dtype), ACC=acc_dtype(k.dtype), WITH_U=False,
        num_warps=cfg["wy_warps"], num_stages=cfg["wy_stages"],
    )
    return w


# measured on an H200 (docs/performance.md): one single-warp kernel for Tm, W and U beats the split pair
UT_DEFAULTS = {"fuse": True, "inv_warps": 1, "wy_warps": 4, "wy_stages": 2, "BK": 32, "BV": 32}


def _ut_launch(k, v, g_cum, beta, chunk_size, cu_seqlens, sub_indices, config, fuse, ai=None):
    B, T, H, K = k.shape
    HV = beta.shape[2]
    V = v.shape[3] if v is not None else 16
    cfg = {**UT_DEFAULTS, **(config or {})}
    w = torch.empty(B, T, HV, K, dtype=k.dtype, device=k.device) if v is not None else None
    u = torch.empty(B, T, HV, V, dtype=k.dtype, device=k.device) if v is not None else None
    NS = sub_indices.shape[0] if cu_seqlens is not None else cdiv(T, SUB_CHUNK)
    compute_ai = ai is None
    if compute_ai:
        ai = torch.empty(B, T, HV, SUB_CHUNK, dtype=k.dtype, device=k.device)
    if NS == 0 or B * HV == 0:
        return w, u, ai
    check_varlen_batch(B, cu_seqlens)
    BK = min(max(16, next_pow2(K)), cfg["BK"])
    BV = min(max(16, next_pow2(V)), cfg["BV"])
    grid, flat = tile_grid(NS, B * HV, force_flat=cfg.get("flat", False))
    common = dict(H=H, HV=HV, K=K, V=V, BT=chunk_size, BV=BV, USE_G=g_cum is not None,
                  IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(k.dtype), ACC=acc_dtype(k.dtype), FLAT=flat)
    if compute_ai:
        _gdn_ut_inverse_kernel[grid](
            k, v, g_cum, beta, ai, w, u, cu_seqlens, sub_indices, T,
            BK=min(max(16, next_pow2(K)), 64), BK2=BK, FUSE_WY=fuse,
            # Tm is rounded to k's dtype afterwards: TF32 merges suffice for 16-bit inputs, fp32 stays exact
            MERGE_PREC=dot_precision(k.dtype), num_warps=cfg["inv_warps"], **common,
        )
    if v is not None and not (fuse and compute_ai):
        _gdn_wy_fwd_kernel[grid](
            k, v, g_cum, beta, ai, w, u, cu_seqlens, sub_indices, T, BK=BK,
            num_warps=cfg["wy_warps"], num_stages=cfg["wy_stages"], **common,
        )
    return w, u, ai


@triton.jit
def _state_terms(du, v_new, h, dh, b_en, p_tv0, p_h, p_dh, o_t, m_t, o_k, m_k, V: tl.constexpr, HV: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, WITH_DW: tl.constexpr, WITH_DK: tl.constexpr,
                 DOT_PREC: tl.constexpr, ACC: tl.constexpr, WITH_SDS: tl.constexpr = True):
    """For one key tile: ``dW = -dU S^T`` and (WITH_DK) ``dk_state = 2^(g_n - g) Vnew dS^T`` and (WITH_SDS) the
    tile's rows of ``<S, dS>`` (``[BK]``, summed over V), looping over value tiles (S, dS: the
    sub-chunk's start state and the gradient of the state after it). S is read only for dW or <S, dS>."""
    dt = dh.dtype.element_ty
    b_dw = tl.zeros([64, BK], dtype=ACC)
    b_dks = tl.zeros([64, BK], dtype=ACC)
    b_sds = tl.zeros([BK], dtype=ACC)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        if WITH_DW or WITH_SDS:
            b_s = tl.load(p_h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)  # [BK, BV]
        if WITH_DW:
            b_du = tl.load(du + p_tv0 + o_v[None, :], mask=m_tv, other=0.0)  # [BS, BV]
            b_dw -= tl.dot(b_du.to(dt), tl.trans(b_s), input_precision=DOT_PREC)
        if WITH_DK:
            b_vn = tl.load(v_new + p_tv0 + o_v[None, :], mask=m_tv, other=0.0)
            b_ds = tl.load(p_dh + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
            b_dks = tl.dot((b_vn * b_en[:, None]).to(dt), tl.trans(b_ds), b_dks, input_precision=DOT_PREC)
            if WITH_SDS:
                b_sds += tl.sum(b_s.to(ACC) * b_ds.to(ACC), 1)
    return b_dw, b_dks, b_sds


@triton.jit
def _vec_state_dg(b_dks, b_k, b_sds, gv, dgv, bos, i_hv, t0, T, o_t, m_t, o_k, m_k, HV: tl.constexpr,
                  K: tl.constexpr, BT: tl.constexpr, DOT_PREC: tl.constexpr, ACC: tl.constexpr):
    """Vector gate, one key tile of one 64-row sub-chunk (c the row before it, n its last row): gates
    the ungated ``Vnew dS^T`` to ``dk_state = 2^(GV_n - GV_s) * (Vnew dS^T)`` and stores this part of the
    gradient of the per-channel log decay itself (the sub-chunk's reverse cumsum done here):
    ``dg_t = sum_{s < t} k_s * dk_state_s + 2^(GV_n - GV_c) * rowsum(S * dS)`` per channel (a strictly
    lower 0/1 matrix product, never a total minus a prefix)."""
    BS: tl.constexpr = 64
    p_gv = gv + (bos * HV + i_hv) * K
    m_tk = m_t[:, None] & m_k[None, :]
    b_gn = tl.load(p_gv + (tl.minimum(t0 + BS, T) - 1) * (HV * K) + o_k, mask=m_k, other=0.0)
    b_gc = tl.load(p_gv + (t0 - 1) * (HV * K) + o_k, mask=m_k & (((o_k * 0 + t0) % BT) != 0), other=0.0)
    b_g = tl.load(p_gv + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.0)
    b_dks = b_dks * tl.exp2(tl.where(m_tk, b_gn[None, :] - b_g, float("-inf")))
    b_p = b_k.to(ACC) * b_dks  # [BS, BK]
    o_c = tl.arange(0, BS)
    b_lt = tl.where(o_c[:, None] > o_c[None, :], 1.0, 0.0).to(ACC)  # [t, s]: s < t
    b_dg = tl.dot(b_lt, b_p, input_precision=DOT_PREC) + (tl.exp2(b_gn - b_gc) * b_sds)[None, :]
    tl.store(dgv + (bos * HV + i_hv) * K + o_t[:, None] * (HV * K) + o_k[None, :], b_dg.to(dgv.dtype.element_ty),
             mask=m_tk)
    return b_dks


@triton.jit
def _wy_bwd_kernel(
    k,
    v,
    beta,
    g,
    ai,
    v_new,
    du,
    h,
    dh,
    dk,
    dv,
    dbeta,
    dgam,
    gk,
    gb,
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
    SPLIT_G: tl.constexpr,
    HAS_GB: tl.constexpr,
    DELTA: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    ACC: tl.constexpr,
    gv=None,
    dgv=None,
    VEC_G: tl.constexpr = False,
    hn=None,
    dhn=None,
    N_STATE: tl.constexpr = False,
    dka=None,
    kdk=None,
    ADD_DK: tl.constexpr = False,
    KDOT: tl.constexpr = False,
    DG: tl.constexpr = True,
    sds=None,
    NVS: tl.constexpr = 0,
    dwp=None,
    pst=None,
    sdst=None,
    PRE: tl.constexpr = False,
    BKK: tl.constexpr = 0,
    FLAT: tl.constexpr = False,
):
    """Delta-rule gradients of one 64-row sub-chunk (W = Tm X_k, U = Tm X_v, Tm = (I + A)^-1,
    Vnew = U - W S, S' = 2^(g_n) S + K^T 2^(g_n - g) Vnew):
    state terms ``dW = -dU S^T``, ``dk_state = 2^(g_n - g) Vnew dS^T``; then the UT/WY backward
    ``dTm = dW X_k^T + dU X_v^T``, ``dA = -Tm^T dTm Tm^T``, giving dk, dv, dbeta and this part's
    gradient of g. Key and value dims in BK/BV tiles; dW is recomputed per key tile in the second
    pass rather than stored (it would be an fp32 round trip through HBM).

    Without DELTA (plain linear attention, ``v_new`` = V) only the state terms remain: dk = dk_state
    and the gradient of g; there is no Tm, beta, W or U. Split gates (SPLIT_G, HAS_GB; linear
    attention only): key weights 2^(GQ_n - GK_r), the previous row's gate at an outer-chunk start is gb;
    the gate gradient is then that of a shift common to GQ and GK (the mLSTM's forget gate).
    Vector gate (VEC_G, linear attention, USE_G off): ``GV [B, T, HV, K]``, key weights
    ``2^(GV_n - GV_s)`` per channel; the per-channel gate gradient goes to ``dgv`` (``_vec_state_dg``).
    N_STATE (linear attention, scalar gates): the normalizer state n (the state of v = 1, ``hn``) and its
    gradient ``dhn`` (``[.., K]`` fp32 per sub-chunk) add the ones column's terms: ``dk_state += 2^(g_n - g) dn``
    and ``<S, dS> += n . dn``. ADD_DK: ``dk = dk_state (+ WY part) + dka`` (the tiled product's
    part) in one pass, stored in dk's dtype; KDOT: also ``kdk = k . dk`` per row (fp32, before rounding).
    DG off (linear attention with a constant decay, whose gradient nobody needs): no gradient of g; S is then
    not read at all (it only enters ``<S, dS>``) and ``dgam`` is not written.
    NVS > 0 (linear attention): ``<S, dS>`` per key row comes precomputed from the state-gradient recurrence
    (``sds [B, NS, HV, NVS, K]`` fp32, one partial per value tile of that kernel, summed here) and S is not
    read: ``h`` may then be None and ``dh`` the buffer where dS overwrote S (``chunk_state_bwd(h_sub=..)``).
    PRE (delta rule): the state terms come precomputed (``chunk_dqkw.chunk_dqkw_bwd``): dW from ``dwp``, dk_state
    already inside ``dka``, the rows ``P_s = k_s . dk_state_s`` from ``pst`` and ``<S, dS>`` from ``sdst``; neither S
    nor dS is read (``h``, ``dh`` unused). BKK > 0 (>= K): K K^T from one [64, BKK] load of k before the first key
    pass instead of inside it (that pass then holds dW's product alone)."""
    BS: tl.constexpr = 64
    i_s, i_bh = program_rows(T, BS, HV, IS_VARLEN, FLAT)  # (64-row sub-chunk, batch x head): 2-D or flat grid
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        i_sub = i_s  # sub-chunk rows of the varlen table are in (sequence, sub-chunk) order
        i_n = tl.load(chunk_indices + i_s * 2).to(tl.int64)
        i_s = tl.load(chunk_indices + i_s * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_b * T
        i_sub = i_b * tl.cdiv(T, BS) + i_s
    t0 = i_s * BS
    o_c = tl.arange(0, BS)
    o_t = t0 + o_c
    m_t = o_t < T
    dt = k.dtype.element_ty

    # products in the input dtype with fp32 accumulation (as FLA's WY backward); fp32 inputs stay IEEE fp32
    if DELTA:
        b_tm = tl.load(ai + (bos * HV + i_hv) * BS + o_t[:, None] * (HV * BS) + o_c[None, :],
                       mask=m_t[:, None], other=0.0).to(dt)  # [BS, BS]
        b_b = tl.load(beta + (bos + o_t) * HV + i_hv, mask=m_t, other=0.0).to(ACC)
    if USE_G:
        p_g = g + bos * HV + i_hv
        b_gc = tl.load(p_g + (t0 - 1) * HV, mask=(t0 % BT) != 0, other=0.0)
        if HAS_GB:
            b_gc += tl.load(gb + (bos + t0) * HV + i_hv, mask=(t0 % BT) == 0, other=0.0)
        if SPLIT_G:
            b_gam = tl.where(m_t, tl.load(gk + bos * HV + i_hv + o_t * HV, mask=m_t, other=0.0) - b_gc, 0.0)
        else:
            b_gam = tl.where(m_t, tl.load(p_g + o_t * HV, mask=m_t, other=0.0) - b_gc, 0.0)  # local cumulative gate
        b_gn = tl.load(p_g + (tl.minimum(t0 + BS, T) - 1) * HV) - b_gc
        if DELTA:
            b_eg = tl.exp2(tl.where(m_t, b_gam, float("-inf")))  # 2^(g_r)
        b_en = tl.exp2(tl.where(m_t, b_gn - b_gam, float("-inf")))  # 2^(g_n - g_r)
    else:
        b_eg = tl.where(m_t, 1.0, 0.0)
        b_en = b_eg
    if DELTA:
        b_sk = b_b * b_eg
    p_k = k + (bos * H + i_h) * K + o_t[:, None] * (H * K)
    p_tk = (bos * HV + i_hv) * K + o_t[:, None] * (HV * K)
    p_tv0 = (bos * HV + i_hv) * V + o_t[:, None] * (HV * V)
    p_h = h + (i_sub * HV + i_hv) * K * V
    p_dh = dh + (i_sub * HV + i_hv) * K * V

    if DELTA:
        # pass 1 over key tiles: dTm += dW X_k^T, K K^T
        b_dtm = tl.zeros([BS, BS], dtype=ACC)
        b_kk = tl.zeros([BS, BS], dtype=ACC)
        if BKK > 0:
            o_kk = tl.arange(0, BKK)
            b_kall = tl.load(p_k + o_kk[None, :], mask=m_t[:, None] & (o_kk < K)[None, :], other=0.0)
            b_kk = tl.dot(b_kall, tl.trans(b_kall), input_precision=DOT_PREC)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            b_k = tl.load(p_k + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)  # [BS, BK]
            if PRE:
                b_dw = tl.load(dwp + p_tk + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
            else:
                b_dw, _, _ = _state_terms(du, v_new, h, dh, b_en, p_tv0, p_h, p_dh, o_t, m_t, o_k, m_k, V, HV, BK, BV,
                                          True, False, DOT_PREC, ACC)
            b_dtm = tl.dot(b_dw.to(dt), tl.trans((b_k * b_sk[:, None]).to(dt)), b_dtm, input_precision=DOT_PREC)
            if BKK == 0:
                b_kk = tl.dot(b_k, tl.trans(b_k), b_kk, input_precision=DOT_PREC)
        # pass over value tiles: dTm += dU X_v^T; dX_v = Tm^T dU gives dv and part of dbeta
        b_db = tl.zeros([BS], dtype=ACC)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_tv = m_t[:, None] & (o_v < V)[None, :]
            b_du = tl.load(du + p_tv0 + o_v[None, :], mask=m_tv, other=0.0)  # [BS, BV]
            b_v = tl.load(v + p_tv0 + o_v[None, :], mask=m_tv, other=0.0)
            b_dtm = tl.dot(b_du, tl.trans((b_v * b_b[:, None]).to(dt)), b_dtm, input_precision=DOT_PREC)
            b_dxv = tl.dot(tl.trans(b_tm), b_du, input_precision=DOT_PREC)
            tl.store(dv + p_tv0 + o_v[None, :], (b_dxv * b_b[:, None]).to(dv.dtype.element_ty), mask=m_tv)
            b_db += tl.sum(b_dxv * b_v.to(ACC), 1)

        m_lo = (o_c[:, None] > o_c[None, :]) & m_t[:, None]
        b_da = -tl.dot(tl.dot(tl.trans(b_tm), b_dtm.to(dt), input_precision=DOT_PREC).to(dt), tl.trans(b_tm),
                       input_precision=DOT_PREC)
        b_da = tl.where(m_lo, b_da, 0.0)
        if USE_G:
            b_e = tl.exp2(tl.where(m_lo, b_gam[:, None] - b_gam[None, :], float("-inf")))
        else:
            b_e = tl.where(m_lo, 1.0, 0.0)
        b_dakk = b_da * b_kk * b_e  # dA * (k_r . k_s) E
        b_m = b_da * b_e * b_b[:, None]
        b_db += tl.sum(b_dakk, 1)

    # pass 2 over key tiles: dk = dk_state + (beta 2^g) Tm^T dW + M K + M^T K
    b_dxx = tl.zeros([BS], dtype=ACC)  # dX_k . X_k per row
    b_p = tl.zeros([BS], dtype=ACC)  # P_s = k_s . dk_state_s
    b_sds = tl.sum(tl.zeros([BS], dtype=ACC), 0)  # <S, dS>
    b_kdk = tl.zeros([BS], dtype=ACC)  # k . dk per row (KDOT)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_k = tl.load(p_k + o_k[None, :], mask=m_tk, other=0.0)
        if PRE:  # dW stored by chunk_dqkw; dk_state is in dka already
            b_dw = tl.load(dwp + p_tk + o_k[None, :], mask=m_tk, other=0.0)
        else:
            b_dw, b_dks, b_sds_k = _state_terms(du, v_new, h, dh, b_en, p_tv0, p_h, p_dh, o_t, m_t, o_k, m_k, V, HV,
                                                BK, BV, DELTA, True, DOT_PREC, ACC, DG and NVS == 0)
            if DG and NVS > 0:  # <S, dS> rows from the state-gradient recurrence's value tiles
                for i_p in range(NVS):
                    b_sds_k += tl.load(sds + ((i_sub * HV + i_hv) * NVS + i_p) * K + o_k, mask=m_k, other=0.0)
            if N_STATE:  # the ones column of [V, 1] against [dS, dn]
                b_dnk = tl.load(dhn + (i_sub * HV + i_hv) * K + o_k, mask=m_k, other=0.0)
                b_dks += b_en[:, None] * b_dnk[None, :]
                b_sds_k += tl.load(hn + (i_sub * HV + i_hv) * K + o_k, mask=m_k, other=0.0) * b_dnk
            if DG:
                b_sds += tl.sum(b_sds_k, 0)
            if VEC_G:  # vector gate: dk_state gated per channel, and this key tile's dg stored here
                b_dks = _vec_state_dg(b_dks, b_k, b_sds_k, gv, dgv, bos, i_hv, t0, T, o_t, m_t, o_k, m_k, HV, K, BT,
                                      DOT_PREC, ACC)
        b_kf = b_k.to(ACC)
        if DELTA:
            b_dxk = tl.dot(tl.trans(b_tm), b_dw.to(dt), input_precision=DOT_PREC)  # [BS, BK]
            b_md = b_m.to(dt)
            b_dk = b_dxk * b_sk[:, None] + tl.dot(b_md, b_k, input_precision=DOT_PREC) \
                + tl.dot(tl.trans(b_md), b_k, input_precision=DOT_PREC)
            if not PRE:
                b_dk += b_dks
            b_dxk_k = tl.sum(b_dxk * b_kf, 1)
            b_db += b_dxk_k * b_eg
            b_dxx += b_dxk_k * b_sk
        else:
            b_dk = b_dks
        if ADD_DK:
            b_dk += tl.load(dka + p_tk + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
        tl.store(dk + p_tk + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)
        if not PRE:
            b_p += tl.sum(b_kf * b_dks, 1)
        if KDOT:
            b_kdk += tl.sum(b_kf * b_dk, 1)
    if DELTA:
        tl.store(dbeta + (bos + o_t) * HV + i_hv, b_db.to(dbeta.dtype.element_ty), mask=m_t)
    if KDOT:
        tl.store(kdk + (bos + o_t) * HV + i_hv, b_kdk, mask=m_t)
    if PRE and DG:  # the state parts of the gate gradient, from chunk_dqkw
        b_p = tl.load(pst + (bos + o_t) * HV + i_hv, mask=m_t, other=0.0)
        b_sds = tl.load(sdst + i_sub * HV + i_hv)
    if USE_G and DG:
        # gradient of g itself (the sub-chunk's reverse cumsum done here): for rows t <= n,
        #   dg_t = sum_{r >= t} (rowsum - colsum of dA * A + dX_k . X_k)_r + sum_{s < t} P_s + 2^(g_n) <S, dS>
        # sums over masks, never a total minus a prefix
        m_ge = o_c[None, :] >= o_c[:, None]  # [t, r]: r >= t
        b_dg = tl.sum(tl.where(m_ge, 0.0, b_p[None, :]), 1)
        if DELTA:
            b_daa = b_dakk * b_b[:, None]  # dA * A
            b_dgr = tl.sum(b_daa, 1) - tl.sum(b_daa, 0) + b_dxx
            b_dg += tl.sum(tl.where(m_ge, b_dgr[None, :], 0.0), 1)
        b_dg += tl.exp2(b_gn) * b_sds
        tl.store(dgam + (bos + o_t) * HV + i_hv, b_dg, mask=m_t)




def wy_bwd(
    k: torch.Tensor,
    v: torch.Tensor | None,
    beta: torch.Tensor | None,
    g_cum: torch.Tensor | None,
    ai: torch.Tensor | None,
    v_new: torch.Tensor,
    du: torch.Tensor | None,
    h_sub: torch.Tensor,
    dh_sub: torch.Tensor,
    chunk_size: int,
    cu_seqlens: torch.Tensor | None = None,
    sub_indices: torch.Tensor | None = None,
    config: dict | None = None,
    gk_cum: torch.Tensor | None = None,
    gb: torch.Tensor | None = None,
    gv_cum: torch.Tensor | None = None,
    hn_sub: torch.Tensor | None = None,
    dhn_sub: torch.Tensor | None = None,
    dk_add: torch.Tensor | None = None,
    dk_dtype: torch.dtype | None = None,
    kdot: bool = False,
    need_dg: bool = True,
    sds_sub: torch.Tensor | None = None,
    dw: torch.Tensor | None = None,
    pst: torch.Tensor | None = None,
    sdst: torch.Tensor | None = None,
):
    """Per-64-row-sub-chunk gradients of the state recurrence: the state terms and (delta rule,
    ``ai`` given) the UT/WY backward, one kernel.

    Args: k ``[B, T, H, K]``; v, v_new, du ``[B, T, HV, V]`` (linear attention: ``v_new`` is V and
    v, beta, ai, du are None); beta, g_cum ``[B, T, HV]``; ai (Tm) ``[B, T, HV, 64]``; h_sub / dh_sub:
    states at / state gradients after every sub-chunk, ``[B, NS, HV, K, V]``.
    config: ``num_warps``, ``BK``, ``BV``. gk_cum, gb: split gates (linear attention only, as
    ``chunk_state.chunk_state_fwd``).
    Returns ``dk [B, T, HV, K]`` fp32 (per value head; the state and WY parts), ``dv [B, T, HV, V]``
    (v's dtype; None without the delta rule), ``dbeta [B, T, HV]`` fp32 (or None), ``dg_sub [B, T, HV]``
    fp32 (this part's gradient of g itself, the sub-chunk reverse cumsum included; None without gates).
    ``gv_cum [B, T, HV, K]``: vector gate (linear attention, ``g_cum`` None); ``dg_sub`` is then
    ``[B, T, HV, K]`` fp32.
    ``hn_sub`` / ``dhn_sub`` ``[B, NS, HV, K]`` fp32: the normalizer state at / its gradient after every
    sub-chunk (``chunk_state_fwd(n_state=True)``, ``chunk_state_bwd(dden=..)``; linear attention with
    scalar gates), whose terms join dk and dg_sub.
    ``dk_add [B, T, HV, K]`` (any gate) is added to dk in the kernel (the tiled product's part), dk is stored
    as ``dk_dtype`` (default fp32), in dk_add's memory when that has this dtype (dk_add is overwritten then);
    linear attention with scalar gates only: ``kdot`` appends ``k . dk`` per row ``[B, T, HV]`` fp32 (the mLSTM's
    input-gate gradient) to the returned tuple.
    ``need_dg=False`` (linear attention with a scalar gate only): no gradient of g (``dg_sub`` None), S not read.
    ``sds_sub [B, NS, HV, NV, K]`` fp32 (linear attention; ``chunk_state_bwd(.., h_sub=.., sds=True)``): the rows
    of ``<S, dS>`` per value tile, precomputed; S is then not read and ``h_sub`` may be None (``dh_sub`` is the
    buffer where dS overwrote S).
    ``dw [B, T, HV, K]``, ``pst [B, T, HV]``, ``sdst [B, NS, HV]`` (delta rule, all three; from
    ``chunk_dqkw.chunk_dqkw_bwd``, whose dk output then holds dk_state and is passed as ``dk_add``): the state terms
    precomputed, so S and dS are not read (``h_sub`` and ``dh_sub`` may be None); one pipeline stage by default
    (one pipeline stage then).
    """
    delta = ai is not None
    pre = dw is not None
    if pre and (not delta or pst is None or sdst is None or dk_add is None):
        raise ValueError("dw / pst / sdst (precomputed state terms) serve the delta rule, all three and dk_add")
    n_state = dhn_sub is not None
    if sds_sub is not None and (delta or sds_sub.dim() != 5 or sds_sub.shape[:3] != dh_sub.shape[:3]):
        raise ValueError("sds_sub [B, NS, HV, NV, K] serves linear attention (no delta rule)")
    if h_sub is None and not pre and (delta or ((g_cum is not None or gv_cum is not None) and need_dg
                                                and sds_sub is None)):
        raise ValueError("h_sub is needed unless sds_sub is given or no gate gradient is (need_dg=False)")
    if n_state and (delta or gv_cum is not None or hn_sub is None):
        raise ValueError("hn_sub / dhn_sub (both) serve linear attention with scalar gates")
    B, T, H, K = k.shape
    HV, V = v_new.shape[2], v_new.shape[3]
    if pre and (tuple(dw.shape) != (B, T, HV, K) or tuple(pst.shape) != (B, T, HV) or sdst.shape[2] != HV):
        raise ValueError("dw [B, T, HV, K], pst [B, T, HV], sdst [B, NS, HV]")
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    if kdot and (delta or gv_cum is not None):
        raise ValueError("kdot serves linear attention with scalar gates")
    if dk_add is not None and dk_add.dtype == (dk_dtype or acc) and dk_add.is_contiguous() \
            and tuple(dk_add.shape) == (B, T, HV, K):
        dk = dk_add  # in place: each program reads its dk_add tile before it stores the same tile (peak memory)
    else:
        dk = torch.empty(B, T, HV, K, dtype=dk_dtype or acc, device=k.device)
    kdk = torch.empty(B, T, HV, dtype=acc, device=k.device) if kdot else None
    dv = torch.empty_like(v) if delta else None
    dbeta = torch.empty(B, T, HV, dtype=acc, device=k.device) if delta else None
    if not need_dg and (delta or gv_cum is not None or n_state or kdot):
        raise ValueError("need_dg=False serves linear attention with a scalar gate (no normalizer, no kdot)")
    dgam = torch.empty(B, T, HV, dtype=acc, device=k.device) if g_cum is not None and need_dg else None
    if gv_cum is not None:
        if delta or g_cum is not None or tuple(gv_cum.shape) != (B, T, HV, K):
            raise ValueError("a vector gate gv_cum [B, T, HV, K] serves linear attention without g_cum")
        dgam = torch.empty(B, T, HV, K, dtype=acc, device=k.device)
    NS = sub_indices.shape[0] if cu_seqlens is not None else cdiv(T, SUB_CHUNK)
    rets = (dk, dv, dbeta, dgam) + ((kdk,) if kdot else ())
    if NS == 0 or B * HV == 0:
        return rets
    check_varlen_batch(B, cu_seqlens)
    # delta rule: 4 warps, 64-wide tiles, 3 stages (H100, B=4 T=8192 H=16 K=V=128: 1.04 ms; 32/32 1.25, 8 warps 1.46,
    # 1 / 2 stages 1.17 / 1.20; forming dk's S / dS terms in the first key pass (S and dU read once) 1.80,
    # with two more live fp32 [64, 64] accumulators in that pass;
    # 8 warps had also hit an illegal address with an earlier form of this kernel on an H200, Triton 3.6)
    # linear attention (no WY part) at K <= 128, 16-bit: one 128-wide key tile (H100, B=4 T=8192 H=16 K=V=128:
    # 0.46 vs 0.51 ms; mLSTM B=8 V=256: 1.45 vs 1.63 ms)
    one_k = not delta and gv_cum is None and K <= 128 and k.element_size() == 2
    # 3 pipeline stages for the key / value loops. With the state terms precomputed (pre) the key loops hold only
    # loads and two products each, and pipelined under Triton 3.6 on the H100 (bf16) they gave a wrong, run-to-run
    # varying K K^T (dbeta, dg ~2e-2 apart between identical calls at 2 and 3 stages; 2026-11-23, 293a86c; also with
    # K^T from a second, transposed load): K K^T from one full-width load of k before the first key pass (config key
    # ``kk_full``, K <= 128) leaves that pass dW's product alone, and it is bitwise reproducible at 3 stages and
    # bitwise equal to one stage (H100 fwd+bwd 3.383 -> 3.350 ms; 95b3700). K > 128 keeps K K^T in the key loop at
    # one stage.
    kk_full = pre and (config or {}).get("kk_full", True) and next_pow2(K) <= 128
    stages = 1 if pre and not kk_full else 3
    cfg = {"num_warps": 4, "num_stages": stages, "BK": 128 if one_k else 64, "BV": 64, **(config or {})}
    cfg.pop("kk_full", None)
    bkk = next_pow2(K) if kk_full else 0
    # h_sub None: S is never read (sds_sub, precomputed terms or no gate gradient); dh_sub (or, with the precomputed
    # terms, v_new) stands in for the unused pointer
    dh_arg = dh_sub if dh_sub is not None else v_new
    grid, flat = tile_grid(NS, B * HV, force_flat=cfg.get("flat", False))
    _wy_bwd_kernel[grid](
        k, v, beta, g_cum, ai, v_new, du, h_sub if h_sub is not None else dh_arg, dh_arg, dk, dv, dbeta, dgam, gk_cum,
        gb, cu_seqlens, sub_indices, T,
        H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=min(max(16, next_pow2(K)), cfg["BK"]),
        BV=min(max(16, next_pow2(V)), cfg["BV"]), USE_G=g_cum is not None, SPLIT_G=gk_cum is not None,
        HAS_GB=gb is not None, DELTA=delta,
        IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(k.dtype), ACC=acc_dtype(k.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        gv=gv_cum, dgv=dgam if gv_cum is not None else None, VEC_G=gv_cum is not None,
        hn=hn_sub, dhn=dhn_sub, N_STATE=n_state, dka=dk_add, kdk=kdk, ADD_DK=dk_add is not None, KDOT=kdot,
        DG=need_dg, sds=sds_sub, NVS=sds_sub.shape[3] if sds_sub is not None else 0,
        dwp=dw, pst=pst, sdst=sdst, PRE=pre, BKK=max(bkk, 16) if bkk else 0, FLAT=flat,
    )
    return rets
