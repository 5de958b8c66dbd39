"""The tiled product under a vector gate (GLA: a log decay per key channel; ULA Section 2.2, Eqs. 4-7): the looped
side's factors, the state term and the diagonal square in 16-row blocks, for ``chunk_output._chunk_tiled_kernel``.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _vec_side(p_gv, s_gv, b_gvm, o_t, m_t, o_gd, m_gd, REVERSE: tl.constexpr):
    """Looped-side factor of the vector gate through the reference row m: ``2^(GV_m - GV_s)`` (forward,
    s <= m) or ``2^(GV_s - GV_m)`` (reverse, s >= m), ``[rows, gated dim]``, 0 on masked rows."""
    m = m_t[:, None] & m_gd[None, :]
    b_g = tl.load(p_gv + o_t[:, None] * s_gv + o_gd[None, :], mask=m, other=0.0)
    if REVERSE:
        b_e = b_g - b_gvm[None, :]
    else:
        b_e = b_gvm[None, :] - b_g
    return tl.exp2(tl.where(m, b_e, float("-inf")))


@triton.jit
def _gop(x, dt, F32: tl.constexpr):
    """An operand of a tensor-core product: kept in fp32 (``F32``: with 16-bit inputs the product then runs
    in TF32, 10 mantissa bits per operand, as FLA's ``chunk_gla`` forms its intra-chunk scores) or rounded to
    the input dtype (bf16: 7 bits)."""
    if F32:
        return x.to(tl.float32)
    else:
        return x.to(dt)


@triton.jit
def _vec_state_term(a, h, p_gv, s_gv, bos, boh, i_hv, i_ch, o_tq, m_tq, o_c, m_c, HA: tl.constexpr,
                    HV: tl.constexpr, DA: tl.constexpr, DC: tl.constexpr, H_SA: tl.constexpr, H_SC: tl.constexpr,
                    HS: tl.constexpr, BT: tl.constexpr, BQ: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr,
                    BAS: tl.constexpr, DOT_PREC: tl.constexpr, ACC: tl.constexpr):
    """``(a_r * 2^GV_r) S_c`` with the vector gate on the contraction dim (in BAS-wide pieces)."""
    dt = a.dtype.element_ty
    b_o = tl.zeros([BQ, BC], dtype=ACC)
    for i_as in tl.static_range(0, BA, BAS):
        o_as = i_as + tl.arange(0, BAS)
        m_as = o_as < DA
        m_qa = m_tq[:, None] & m_as[None, :]
        b_ap = tl.load(a + (bos * HA + i_hv // (HV // HA)) * DA + o_tq[:, None] * (HA * DA) + o_as[None, :],
                       mask=m_qa, other=0.0)  # [BQ, BAS]
        b_gp = tl.load(p_gv + o_tq[:, None] * s_gv + o_as[None, :], mask=m_qa, other=0.0)
        b_ap = (b_ap * tl.exp2(tl.where(m_qa, b_gp, float("-inf")))).to(dt)
        p_hs = h + ((boh + i_ch * (BT // HS)) * HV + i_hv) * DA * DC + o_as[:, None] * H_SA + o_c[None, :] * H_SC
        b_st = tl.load(p_hs, mask=m_as[:, None] & m_c[None, :], other=0.0).to(dt)  # [BAS, BC]
        b_o = tl.dot(b_ap, b_st, b_o, input_precision=DOT_PREC)
    return b_o


@triton.jit
def _vec_diag(b_o, b_a, p_b, p_c, p_gv, s_gv, b_gvq, t_q0, o_tq, m_tq, m_a, m_c, o_gd, m_gd, T, SB, SC,
              BQ: tl.constexpr, VEC_G: tl.constexpr, REVERSE: tl.constexpr, SPLIT_DIAG: tl.constexpr,
              DOT_PREC: tl.constexpr, ACC: tl.constexpr, SPAN: tl.constexpr = 0, F32: tl.constexpr = 0):
    """The diagonal BQ x BQ square (rows t_q0 ..) under the vector gate: ``_vec_diag_factored`` when
    ``SPAN > 0`` and the gate spans at most SPAN (log2) over the tile's rows in every channel (checked per
    tile at run time), else ``_vec_diag_steps`` (exact for any decay)."""
    if SPAN > 0:  # X = GV_r - GV_ref, ref the tile's first row; 0 on masked lanes
        b_gr = tl.load(p_gv + t_q0 * s_gv + o_gd, mask=m_gd, other=0.0)
        b_x = tl.where(m_tq[:, None] & m_gd[None, :], b_gvq - b_gr[None, :], 0.0)
        fast = tl.max(tl.max(tl.abs(b_x), 1), 0) <= SPAN
    else:
        b_x = b_gvq
        fast = False
    if fast:
        b_o, b_sd, b_cd = _vec_diag_factored(b_o, b_a, p_b, p_c, b_x, o_tq, m_tq, m_a, m_c, SB, SC, BQ, VEC_G,
                                             REVERSE, SPLIT_DIAG, DOT_PREC, F32)
    else:
        b_o, b_sd, b_cd = _vec_diag_steps(b_o, b_a, p_b, p_c, p_gv, s_gv, b_gvq, t_q0, o_tq, m_tq, m_a, m_c, o_gd,
                                          m_gd, T, SB, SC, BQ, VEC_G, REVERSE, SPLIT_DIAG, DOT_PREC, ACC, F32)
    return b_o, b_sd, b_cd


@triton.jit
def _vec_diag_factored(b_o, b_a, p_b, p_c, b_x, o_tq, m_tq, m_a, m_c, SB, SC, BQ: tl.constexpr,
                       VEC_G: tl.constexpr, REVERSE: tl.constexpr, SPLIT_DIAG: tl.constexpr, DOT_PREC: tl.constexpr,
                       F32: tl.constexpr):
    """The diagonal square as one masked tensor-core product, for a gate that spans at most SPAN over
    the tile: ``2^(GV_r - GV_s) = 2^(X_r) 2^(-X_s)`` with ``X = GV - GV_ref`` in ``[-SPAN, 0]`` (forward;
    ``2^(-X_r) 2^(X_s)`` reverse), so each factor lies in ``[2^-SPAN, 2^SPAN]``: no overflow or underflow,
    and 2 exponentials per element of the [BQ, gated dim] tile instead of the 16-row blocks' ~18 (pairs on
    the wrong side of the diagonal are computed, at most 2^SPAN |a . b| in size, and masked out)."""
    dt = b_a.dtype
    b_bt = tl.load(p_b + o_tq[:, None] * SB, mask=m_tq[:, None] & m_a[None, :], other=0.0)  # [BQ, BA]
    b_ct = tl.load(p_c + o_tq[:, None] * SC, mask=m_tq[:, None] & m_c[None, :], other=0.0)  # [BQ, BC]
    if REVERSE:
        b_fo = tl.exp2(-b_x)  # output rows' factor
        b_fl = tl.exp2(b_x)  # looped rows' factor
        m_s = (o_tq[:, None] <= o_tq[None, :]) & m_tq[:, None] & m_tq[None, :]
    else:
        b_fo = tl.exp2(b_x)
        b_fl = tl.exp2(-b_x)
        m_s = (o_tq[:, None] >= o_tq[None, :]) & m_tq[:, None] & m_tq[None, :]
    m_d = o_tq[:, None] == o_tq[None, :]
    if VEC_G == 1:
        b_s = tl.dot(_gop(b_a * b_fo, dt, F32 > 0), tl.trans(_gop(b_bt * b_fl, dt, F32 > 0)), input_precision=DOT_PREC)
        b_sd = tl.sum(tl.zeros_like(b_s), 1)  # (as the steps: no r = s scores kept under VEC_G = 1)
    else:
        b_s = tl.dot(b_a, tl.trans(b_bt), input_precision=DOT_PREC)  # [BQ, BQ]: a_r . b_s
        b_sd = tl.sum(tl.where(m_d & m_s, b_s, 0.0), 1)
    if SPLIT_DIAG:
        m_s = m_s & (o_tq[:, None] != o_tq[None, :])
    if VEC_G == 1:
        b_o = tl.dot(_gop(tl.where(m_s, b_s, 0.0), dt, F32 > 1), _gop(b_ct, dt, F32 > 1), b_o, input_precision=DOT_PREC)
    else:
        b_s = _gop(tl.where(m_s, b_s, 0.0), dt, F32 > 0)
        b_o += tl.dot(b_s, _gop(b_ct * b_fl, dt, F32 > 0), input_precision=DOT_PREC) * b_fo
    if SPLIT_DIAG:
        b_cd = b_ct
    else:
        b_cd = b_o
    return b_o, b_sd, b_cd


@triton.jit
def _vec_diag_steps(b_o, b_a, p_b, p_c, p_gv, s_gv, b_gvq, t_q0, o_tq, m_tq, m_a, m_c, o_gd, m_gd, T, SB, SC,
                    BQ: tl.constexpr, VEC_G: tl.constexpr, REVERSE: tl.constexpr, SPLIT_DIAG: tl.constexpr,
                    DOT_PREC: tl.constexpr, ACC: tl.constexpr, F32: tl.constexpr):
    """The diagonal BQ x BQ square (rows t_q0 ..) under the vector gate, in 16-row blocks.

    Level 1, pairs in different blocks: for each block j of looped rows, the row m at its edge (last
    row forward, first row reverse) lies between every looped row of j and every output row on the
    other side of j, so ``2^(GV_r - GV_s) = 2^(GV_r - GV_m) 2^(GV_m - GV_s)`` with both factors <= 1,
    applied elementwise to the operands (VEC_G = 1: a and b; VEC_G = 2: the output and c) around a
    [BQ, 16] tensor-core product. Level 2, pairs in one block: 16 steps, step d pairing every output
    row r with row s = 16 (r // 16) + d of its own block, the weight ``2^(GV_r - GV_s)`` elementwise
    (exponent <= 0 on every unmasked lane). With SPLIT_DIAG (VEC_G = 2) the r = s terms stay out and
    come back as ``(a_r . b_r, c rows)``."""
    BD: tl.constexpr = 16
    dt = b_a.dtype
    o_d = tl.arange(0, BD)
    if REVERSE:
        j_lo = 1
        j_hi = BQ // BD
    else:
        j_lo = 0
        j_hi = BQ // BD - 1
    for j in range(j_lo, j_hi):
        o_tl = t_q0 + j * BD + o_d
        m_tl = o_tl < T
        if REVERSE:  # output rows before block j, m its first row
            m_o = m_tq & (o_tq < t_q0 + j * BD)
            b_gm = tl.load(p_gv + tl.minimum(t_q0 + j * BD, T - 1) * s_gv + o_gd, mask=m_gd, other=0.0)
            b_fo = tl.exp2(tl.where(m_o[:, None] & m_gd[None, :], b_gm[None, :] - b_gvq, float("-inf")))
        else:  # output rows after block j, m its last row
            m_o = m_tq & (o_tq >= t_q0 + (j + 1) * BD)
            b_gm = tl.load(p_gv + (tl.minimum(t_q0 + (j + 1) * BD, T) - 1) * s_gv + o_gd, mask=m_gd, other=0.0)
            b_fo = tl.exp2(tl.where(m_o[:, None] & m_gd[None, :], b_gvq - b_gm[None, :], float("-inf")))
        b_fl = _vec_side(p_gv, s_gv, b_gm, o_tl, m_tl, o_gd, m_gd, REVERSE)  # [BD, BG]
        b_bl = tl.load(p_b + o_tl[:, None] * SB, mask=m_tl[:, None] & m_a[None, :], other=0.0)  # [BD, BA]
        b_cl = tl.load(p_c + o_tl[:, None] * SC, mask=m_tl[:, None] & m_c[None, :], other=0.0)  # [BD, BC]
        if VEC_G == 1:
            b_s = tl.dot(_gop(b_a * b_fo, dt, F32 > 0), tl.trans(_gop(b_bl * b_fl, dt, F32 > 0)),
                         input_precision=DOT_PREC)
            b_o = tl.dot(_gop(b_s, dt, F32 > 1), _gop(b_cl, dt, F32 > 1), b_o, input_precision=DOT_PREC)
        else:
            b_s = tl.dot(b_a, tl.trans(b_bl), input_precision=DOT_PREC)  # [BQ, BD]
            b_o += tl.dot(_gop(b_s, dt, F32 > 0), _gop(b_cl * b_fl, dt, F32 > 0), input_precision=DOT_PREC) * b_fo
    o_tb = t_q0 + ((o_tq - t_q0) // BD) * BD  # first row of each output row's block
    b_sd = tl.zeros([BQ], dtype=ACC)
    for d in range(BD):
        o_ts = o_tb + d
        if REVERSE:
            m_p = m_tq & (o_ts >= o_tq) & (o_ts < T)
        else:
            m_p = m_tq & (o_ts <= o_tq)
        if SPLIT_DIAG:
            m_w = m_p & (o_ts != o_tq)
        else:
            m_w = m_p
        m_wg = m_w[:, None] & m_gd[None, :]
        b_bs = tl.load(p_b + o_ts[:, None] * SB, mask=m_p[:, None] & m_a[None, :], other=0.0).to(ACC)  # [BQ, BA]
        b_cs = tl.load(p_c + o_ts[:, None] * SC, mask=m_p[:, None] & m_c[None, :], other=0.0).to(ACC)  # [BQ, BC]
        b_gs = tl.load(p_gv + o_ts[:, None] * s_gv + o_gd[None, :], mask=m_wg, other=0.0)
        if REVERSE:
            b_e = tl.exp2(tl.where(m_wg, b_gs - b_gvq, float("-inf")))
        else:
            b_e = tl.exp2(tl.where(m_wg, b_gvq - b_gs, float("-inf")))
        if VEC_G == 1:
            b_w = tl.sum(b_a.to(ACC) * b_bs * b_e, 1)  # [BQ]
            b_o += b_w[:, None] * b_cs
        else:
            b_w = tl.sum(b_a.to(ACC) * b_bs, 1)
            b_o += b_w[:, None] * b_cs * b_e
            if SPLIT_DIAG:
                b_sd += tl.where(o_ts == o_tq, b_w, 0.0)
    if SPLIT_DIAG:
        b_cd = tl.load(p_c + o_tq[:, None] * SC, mask=m_tq[:, None] & m_c[None, :], other=0.0)
    else:
        b_cd = b_o
    return b_o, b_sd, b_cd
