"""UT/WY transform of the (gated) delta rule on 64-row sub-chunks: the prep of the GDN's fused pass.

Notation: B batch, T time, H key heads, HV value heads (a multiple of H), K/V head dims,
BT the chunk the gates are cumulative in (64 rows), BS = 64 sub-chunk rows, BC = 16 block rows,
BK head-dim tiles. Gates are cumulative within the chunk, in log2 units (``G``).

For the sub-chunk of rows r = 1..64 that starts after row c (c = the last row of the previous
sub-chunk in the same chunk; G_c = 0 at a chunk start):

    A[r, i] = beta_r (k_r . k_i) 2^(G_r - G_i)     for i < r, else 0     (64 x 64)
    Tm      = (I + A)^-1                                               (unit lower triangular)
    W       = Tm @ (beta 2^(G - G_c) * K)                              [64, K]

``_gdn_ut_inverse_kernel`` builds ``Tm`` from 16 x 16 blocks (diagonal blocks by forward substitution,
off-diagonal blocks by block forward substitution ``Tm_ji = -Tm_jj sum_{m=i..j-1} A_jm Tm_mi``,
``docs/gdn-math.md`` section 4.1), in fp32 with IEEE dots, on few warps (16 x 16 tiles waste wide programs),
and stores it in the input dtype, optionally with the output's intra-chunk scores and the gate's cumsum. W and U
are never stored by the forward: its fused pass forms ``Vnew = Tm (beta (V - 2^G K S))`` on chip.
``_gdn_wy_fwd_kernel`` forms W from a stored Tm for the backward's ``tl`` kernels. Every exponent used is ``<= 0``
for ``g <= 0``; nothing divides by ``2^G``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.gate_act import _softplus
from tfla.ops.common.grid import check_varlen_batch, chunk_rows, program_rows, tile_grid
from tfla.ops.common.utils import LOG_DECAY_FLOOR, RCP_LN2, SUB_CHUNK, acc_dtype, cdiv, dot_precision, dot_tile


@triton.jit
def _unit_lower_inverse4(b_A0, b_A1, b_A2, b_A3, BC: tl.constexpr, ACC: tl.constexpr):
    """``(I + A)^-1`` of four strictly lower-triangular fp32 ``[BC, BC]`` blocks.

    ``I + A = prod_j (I + a_j e_j^T)`` with ``a_j`` column j of A, so the inverse is
    ``prod_{j = BC-1 .. 0} (I - a_j e_j^T)``: starting from ``X = I``, ``X <- X - a_j (e_j^T X)`` for
    j = 0, 1, ... Column j of A comes out row-indexed and row j of X column-indexed, so every step
    is an outer-product update with no register-layout conversion. The four blocks take each step in one loop
    (four independent chains of reductions per step for the warp to overlap).
    """
    o = tl.arange(0, BC)
    b_I = tl.where(o[:, None] == o[None, :], 1.0, 0.0).to(ACC)
    b_X0 = b_I
    b_X1 = b_I
    b_X2 = b_I
    b_X3 = b_I
    for j in range(0, BC - 1):
        m_c = o[None, :] == j
        m_r = o[:, None] == j
        b_X0 -= tl.sum(tl.where(m_c, b_A0, 0.0), 1)[:, None] * tl.sum(tl.where(m_r, b_X0, 0.0), 0)[None, :]
        b_X1 -= tl.sum(tl.where(m_c, b_A1, 0.0), 1)[:, None] * tl.sum(tl.where(m_r, b_X1, 0.0), 0)[None, :]
        b_X2 -= tl.sum(tl.where(m_c, b_A2, 0.0), 1)[:, None] * tl.sum(tl.where(m_r, b_X2, 0.0), 0)[None, :]
        b_X3 -= tl.sum(tl.where(m_c, b_A3, 0.0), 1)[:, None] * tl.sum(tl.where(m_r, b_X3, 0.0), 0)[None, :]
    return b_X0, b_X1, b_X2, b_X3


@triton.jit
def _cumsum4(b_g0, b_g1, b_g2, b_g3, g_scale, FLOOR: tl.constexpr):
    """``g_scale * cumsum(max(g, FLOOR))`` over a sub-chunk held as four consecutive 16-row blocks (masked rows 0)."""
    if FLOOR is not None:  # raised to the floor (a comparison, so NaN stays NaN)
        b_g0 = tl.where(b_g0 < FLOOR, FLOOR, b_g0)
        b_g1 = tl.where(b_g1 < FLOOR, FLOOR, b_g1)
        b_g2 = tl.where(b_g2 < FLOOR, FLOOR, b_g2)
        b_g3 = tl.where(b_g3 < FLOOR, FLOOR, b_g3)
    s0 = tl.sum(b_g0, axis=0)
    s1 = s0 + tl.sum(b_g1, axis=0)
    s2 = s1 + tl.sum(b_g2, axis=0)
    return (tl.cumsum(b_g0, axis=0) * g_scale, (tl.cumsum(b_g1, axis=0) + s0) * g_scale,
            (tl.cumsum(b_g2, axis=0) + s1) * g_scale, (tl.cumsum(b_g3, axis=0) + s2) * g_scale)


@triton.jit
def _log_growth(b_A, b_b, o_c):
    """``sum_r log max(1, |1 - beta_r |k_r|^2|)`` over the rows of a diagonal ``K K^T`` block (rows past the end
    have beta 0: log 1): the log of a bound on how much the rows' maps ``I - beta_r k_r k_r^T`` may grow a state."""
    b_kk = tl.sum(tl.where(o_c[:, None] == o_c[None, :], b_A, 0.0), axis=1)
    return tl.sum(tl.log(tl.maximum(tl.abs(1.0 - b_b * b_kk), 1.0)), axis=0)


@triton.jit
def _gdn_ut_inverse_kernel(
    q,
    k,
    g,
    beta,
    ai,
    sc,
    cu_seqlens,
    chunk_indices,
    scale,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    USE_G: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    MERGE_PREC: tl.constexpr,
    ACC: tl.constexpr,
    WITH_SCORES: tl.constexpr = False,
    FLAT: tl.constexpr = False,
    SR: tl.constexpr = 64,
    SBK: tl.constexpr = 32,
    gc=None,
    g_scale=1.0,
    CUMSUM: tl.constexpr = False,
    FLOOR: tl.constexpr = None,
    A_log=None,
    dt_bias=None,
    GATE: tl.constexpr = False,
    HAS_BIAS: tl.constexpr = False,
    lb=None,
    BOUND: tl.constexpr = False,
):
    """Tm = (I + A)^-1 of one 64-row sub-chunk, A = beta (K K^T) 2^(G_r - G_i) strictly lower. WITH_SCORES: also
    the fused forward's output scores ``scale causal(q k^T) o 2^(G_r - G_s)`` of the sub-chunk (``sc``, layout as
    ``ai``), in ``[SR, 64]`` blocks over ``SBK``-wide key slices. CUMSUM: ``g`` holds the per-token gates (natural
    log); the kernel forms ``G = g_scale * cumsum(max(g, FLOOR))`` over the sub-chunk (as ``chunk_local_cumsum``) and
    stores it to ``gc`` (no separate cumsum launch); with GATE ``g`` holds the pre-activations ``a`` and the gates are
    ``-exp(A_log) softplus(a + dt_bias)`` (HAS_BIAS; ``gate_act.py``'s prologue). BOUND (with USE_G): also the log
    of a bound on the norm of the sub-chunk's map of the state, ``sum_r g_r + log max(1, |1 - beta_r |k_r|^2|)``
    (natural log, fp32) to ``lb [sub-chunks, HV]`` (sub-chunks numbered as the sequences' 64-row chunks in a row:
    ``fused_delta_fwd.piece_cutoffs``)."""
    tl.static_assert(not (CUMSUM and WITH_SCORES), "the scores read G back: cumsum in its own pass")
    tl.static_assert(USE_G or not BOUND, "the bound needs the gates")
    BS: tl.constexpr = 64
    BC: tl.constexpr = 16
    i_s, i_bh = program_rows(T, BS, HV, IS_VARLEN, FLAT)  # (64-row sub-chunk, batch x head): 2-D or flat grid
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:  # the sub-chunk's number among all sequences' (the bound's row)
        i_lb = i_s.to(tl.int64)
    else:
        i_lb = i_b.to(tl.int64) * tl.cdiv(T, BS) + i_s
    i_s, bos, T = chunk_rows(i_s, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
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
    if BOUND:  # |k_r|^2 from the diagonal blocks, before the gates and the mask clear their diagonals
        b_grow = (_log_growth(b_A00, b_b0, o_c) + _log_growth(b_A11, b_b1, o_c) + _log_growth(b_A22, b_b2, o_c)
                  + _log_growth(b_A33, b_b3, o_c))

    m_lo = o_c[:, None] > o_c[None, :]
    if USE_G:
        p_g = g + bos * HV + i_hv
        b_g0 = tl.load(p_g + t_0 * HV, mask=m_0, other=0.0).to(ACC)
        b_g1 = tl.load(p_g + t_1 * HV, mask=m_1, other=0.0).to(ACC)
        b_g2 = tl.load(p_g + t_2 * HV, mask=m_2, other=0.0).to(ACC)
        b_g3 = tl.load(p_g + t_3 * HV, mask=m_3, other=0.0).to(ACC)
        if CUMSUM:
            if GATE:  # the activation first (rows past T: finite, masked below)
                b_e = tl.exp(tl.load(A_log + i_hv).to(ACC))
                if HAS_BIAS:
                    b_db = tl.load(dt_bias + i_hv).to(ACC)
                    b_g0, b_g1, b_g2, b_g3 = b_g0 + b_db, b_g1 + b_db, b_g2 + b_db, b_g3 + b_db
                b_g0 = -b_e * _softplus(b_g0)
                b_g1 = -b_e * _softplus(b_g1)
                b_g2 = -b_e * _softplus(b_g2)
                b_g3 = -b_e * _softplus(b_g3)
            b_g0, b_g1, b_g2, b_g3 = _cumsum4(b_g0, b_g1, b_g2, b_g3, g_scale, FLOOR)
            p_gc = gc + bos * HV + i_hv
            tl.store(p_gc + t_0 * HV, b_g0, mask=m_0)
            tl.store(p_gc + t_1 * HV, b_g1, mask=m_1)
            tl.store(p_gc + t_2 * HV, b_g2, mask=m_2)
            tl.store(p_gc + t_3 * HV, b_g3, mask=m_3)
        if BOUND:  # the sub-chunk's summed gate: G at its last row (log2 -> natural log)
            t_l = tl.minimum(T, t0 + BS) - 1
            b_gl = (tl.sum(tl.where(t_0 == t_l, b_g0, 0.0), axis=0) + tl.sum(tl.where(t_1 == t_l, b_g1, 0.0), axis=0)
                    + tl.sum(tl.where(t_2 == t_l, b_g2, 0.0), axis=0) + tl.sum(tl.where(t_3 == t_l, b_g3, 0.0), axis=0))
            tl.store(lb + i_lb * HV + i_hv, (b_gl * 0.6931471805599453 + b_grow).to(tl.float32))
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
    b_T00, b_T11, b_T22, b_T33 = _unit_lower_inverse4(b_A00, b_A11, b_A22, b_A33, BC, ACC)
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
    if WITH_SCORES:
        o_s = tl.arange(0, BS)
        t_s = t0 + o_s
        m_s = t_s < T
        if USE_G:
            b_gs = tl.load(g + bos * HV + i_hv + t_s * HV, mask=m_s, other=0.0)
        p_q = q + (bos * H + i_h) * K
        o_sr = tl.arange(0, SR)
        for i_r in tl.static_range(BS // SR):  # SR rows of scores at a time
            t_r = t0 + i_r * SR + o_sr
            m_r = t_r < T
            b_s = tl.zeros([SR, BS], dtype=ACC)
            for i_k in range(tl.cdiv(K, SBK)):
                o_k = i_k * SBK + tl.arange(0, SBK)
                m_k = o_k < K
                b_q = tl.load(p_q + t_r[:, None] * (H * K) + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0.0)
                b_kt = tl.load(p_k + t_s[:, None] * (H * K) + o_k[None, :], mask=m_s[:, None] & m_k[None, :],
                               other=0.0)
                b_s = tl.dot(b_q, tl.trans(b_kt), b_s, input_precision=DOT_PREC)
            m_rs = ((i_r * SR + o_sr)[:, None] >= o_s[None, :]) & m_r[:, None] & m_s[None, :]
            if USE_G:
                b_gr = tl.load(g + bos * HV + i_hv + t_r * HV, mask=m_r, other=0.0)
                b_s = b_s * scale * tl.exp2(tl.where(m_rs, b_gr[:, None] - b_gs[None, :], float("-inf")))
            else:
                b_s = tl.where(m_rs, b_s * scale, 0.0)
            tl.store(sc + (bos * HV + i_hv) * BS + t_r[:, None] * (HV * BS) + o_s[None, :],
                     b_s.to(sc.dtype.element_ty), mask=m_r[:, None])


@triton.jit
def _wy_apply(k, g, beta, ai, w, t0, T, bos, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
              BT: tl.constexpr, BK: tl.constexpr, USE_G: tl.constexpr, DOT_PREC: tl.constexpr, ACC: tl.constexpr):
    """W = Tm @ (beta 2^(G - G_c) K) for the 64-row sub-chunk at ``t0``, with Tm read back from ``ai``; K in tiles
    of BK columns."""
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


@triton.jit
def _gdn_wy_fwd_kernel(
    k,
    g,
    beta,
    ai,
    w,
    cu_seqlens,
    chunk_indices,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    USE_G: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    ACC: tl.constexpr,
    FLAT: tl.constexpr = False,
):
    """W of one 64-row sub-chunk from a stored Tm."""
    i_s, i_bh = program_rows(T, 64, HV, IS_VARLEN, FLAT)  # (64-row sub-chunk, batch x head): 2-D or flat grid
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_s, bos, T = chunk_rows(i_s, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    _wy_apply(k, g, beta, ai, w, i_s * 64, T, bos, i_h, i_hv, H, HV, K, BT, BK, USE_G, DOT_PREC, ACC)


def ut_inverse_and_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    g_cum: torch.Tensor | None,
    beta: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    sub_indices: torch.Tensor | None = None,
    config: dict | None = None,
    log_bound: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused forward's prep in one kernel: Tm of every 64-row sub-chunk (k's dtype) and the output's intra-chunk
    scores ``scale causal(q k^T) o 2^(G_r - G_s)`` (q's dtype), both ``[B, T, HV, 64]`` (row r of a sub-chunk in
    row r), with ``g_cum`` the cumulative gates restarting every 64 rows (log2) or None. ``config``: overrides of
    ``UT_DEFAULTS``' ``inv_warps``, ``inv_stages``, ``inv_BK`` (key slice of the inverse's K K^T), ``sc_rows`` /
    ``sc_BK`` (rows and key slice of the scores tile). ``log_bound`` (``[sub-chunks, HV]`` fp32, g_cum given) or
    None: receives each 64-row sub-chunk's ``sum_r g_r + log max(1, |1 - beta_r |k_r|^2|)`` (natural log), the log of
    a bound on the norm of its map of the state (sub-chunks numbered as the sequences' 64-row chunks in a row; the
    split's cutoffs, ``fused_delta_fwd.piece_cutoffs``)."""
    return _ut_launch(k, g_cum, beta, cu_seqlens, sub_indices, config, q=q, scale=scale, log_bound=log_bound)


def ut_inverse(
    k: torch.Tensor,
    g_cum: torch.Tensor | None,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    sub_indices: torch.Tensor | None = None,
    config: dict | None = None,
    log_bound: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tm of every 64-row sub-chunk alone (``ut_inverse_and_scores`` without the scores: the prep of the Gluon
    forward pass, which forms them itself), ``[B, T, HV, 64]`` in k's dtype. Config keys as
    ``ut_inverse_and_scores``, ``log_bound`` as there."""
    return _ut_launch(k, g_cum, beta, cu_seqlens, sub_indices, config, log_bound=log_bound)[0]


def ut_inverse_with_cumsum(
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    sub_indices: torch.Tensor | None = None,
    config: dict | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    log_bound: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ut_inverse`` with the gate's cumsum in the same kernel: g ``[B, T, HV]`` holds the per-token log decays
    (natural log, any float dtype), or with ``A_log [HV]`` (and ``dt_bias [HV]`` or None) their pre-activations
    ``a``: the gates are then ``-exp(A_log) softplus(a + dt_bias)`` (``gate_act.gate_prologue``'s, beta as given).
    Returns ``(g_cum, ai)``: g_cum ``[B, T, HV]`` fp32 (float64 for float64 k) = ``cumsum(max(g, LOG_DECAY_FLOOR)) /
    ln 2`` restarting every 64 rows (``chunk_local_cumsum``'s values up to the order of the additions), and Tm as
    ``ut_inverse`` (``log_bound`` as ``ut_inverse_and_scores``', from the gates formed here)."""
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    g_cum = torch.empty(g.shape, dtype=acc, device=g.device)
    ai = _ut_launch(k, g, beta, cu_seqlens, sub_indices, config, g_cum_out=g_cum,
                    gate=(A_log, dt_bias) if A_log is not None else None, log_bound=log_bound)[0]
    return g_cum, ai


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
    """W = Tm (beta 2^(G - G_c) K) of every 64-row sub-chunk from a stored Tm (``ai``), for the
    backward's ``tl`` kernels (Hopper's read Tm instead). k ``[B, T, H, K]``, beta ``[B, T, HV]``, g_cum ``[B, T,
    HV]`` fp32 log2 cumulative within chunks of ``chunk_size`` or None, ``sub_indices`` the varlen (sequence,
    sub-chunk) table; config keys ``BK``, ``wy_warps``, ``wy_stages`` (``UT_DEFAULTS``). Returns ``w [B, T, HV, K]``
    in k's dtype."""
    cfg = {**UT_DEFAULTS, **(config or {})}
    B, T, H, K = k.shape
    HV = beta.shape[2]
    w = torch.empty(B, T, HV, K, dtype=k.dtype, device=k.device)
    NS = sub_indices.shape[0] if cu_seqlens is not None else cdiv(T, SUB_CHUNK)
    if NS == 0 or B * HV == 0:
        return w
    check_varlen_batch(B, cu_seqlens)
    grid, flat = tile_grid(NS, B * HV, force_flat=cfg.get("flat", False))
    _gdn_wy_fwd_kernel[grid](
        k, g_cum, beta, ai, w, cu_seqlens, sub_indices, T, H=H, HV=HV, K=K, BT=chunk_size, FLAT=flat,
        BK=dot_tile(K, cfg["BK"], k.dtype), USE_G=g_cum is not None, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=dot_precision(k.dtype), ACC=acc_dtype(k.dtype),
        num_warps=cfg["wy_warps"], num_stages=cfg["wy_stages"],
    )
    return w


# the inverse in one warp per sub-chunk (its 16 x 16 block products); W in a second kernel when a backward's tl
# kernels need it (the one-kernel Tm + W + U of the three-kernel forward went with it, 2026-11-24; U with the
# backward's delta-rule state chain, 2026-11-28)
# the output's scores as one [64, 64] tile over 32-wide key slices (H100, torch 2.11, Triton 3.6, bf16, K = V = 128,
# the kernel alone, 2026-11-24: MVE 225.6 -> 211.3 us, the Qwen3-Next-style heads 412.4 -> 364.7, B = 1, T = 65536
# 454.4 -> 438.4 against [16, 64] blocks over 64-wide slices; [32, 64] over 32: 233.6, [16, 64] over 32: 252.6)
# W's key tiles 64 wide: 0.128 ms vs 0.142 at 32 (H100, B=4 T=8192 H=16 K=128 bf16; 128: 0.124)
UT_DEFAULTS = {"inv_warps": 1, "inv_stages": 3, "inv_BK": 64, "sc_rows": 64, "sc_BK": 32, "wy_warps": 4,
               "wy_stages": 2, "BK": 64}


def _ut_launch(k, g_cum, beta, cu_seqlens, sub_indices, config, q=None, scale=1.0, g_cum_out=None, gate=None,
               log_bound=None):
    """``(ai, sc)``: Tm and, with q, the output's scores (else None). g_cum_out: the kernel cumsums ``g_cum`` (then
    the per-token gates, or with gate = (A_log, dt_bias) their pre-activations) into it. ``log_bound`` (gates
    given): the sub-chunks' bounds are written to it (``[sub-chunks, HV]`` fp32, ``_gdn_ut_inverse_kernel``'s
    BOUND)."""
    B, T, H, K = k.shape
    HV = beta.shape[2]
    cfg = {**UT_DEFAULTS, **(config or {})}
    NS = sub_indices.shape[0] if cu_seqlens is not None else cdiv(T, SUB_CHUNK)
    ai = torch.empty(B, T, HV, SUB_CHUNK, dtype=k.dtype, device=k.device)
    sc = torch.empty(B, T, HV, SUB_CHUNK, dtype=q.dtype, device=q.device) if q is not None else None
    if NS == 0 or B * HV == 0:
        return ai, sc
    check_varlen_batch(B, cu_seqlens)
    grid, flat = tile_grid(NS, B * HV, force_flat=cfg.get("flat", False))
    _gdn_ut_inverse_kernel[grid](
        q, k, g_cum, beta, ai, sc, cu_seqlens, sub_indices, scale, T, H=H, HV=HV, K=K, USE_G=g_cum is not None,
        IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(k.dtype), ACC=acc_dtype(k.dtype), FLAT=flat,
        WITH_SCORES=q is not None, SR=cfg["sc_rows"], SBK=dot_tile(K, cfg["sc_BK"], k.dtype),
        BK=dot_tile(K, cfg["inv_BK"], k.dtype),
        # Tm is rounded to k's dtype afterwards: TF32 merges suffice for 16-bit inputs, fp32 stays exact
        MERGE_PREC=dot_precision(k.dtype), num_warps=cfg["inv_warps"], num_stages=cfg["inv_stages"],
        gc=g_cum_out, g_scale=RCP_LN2, CUMSUM=g_cum_out is not None,
        FLOOR=LOG_DECAY_FLOOR if g_cum_out is not None else None,
        A_log=gate[0] if gate else None, dt_bias=gate[1] if gate else None, GATE=gate is not None,
        HAS_BIAS=gate is not None and gate[1] is not None, lb=log_bound, BOUND=log_bound is not None,
    )
    return ai, sc
