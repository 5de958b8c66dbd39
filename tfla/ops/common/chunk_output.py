"""One TFLA-tiled chunk product that serves the output and the q/k/v gradients (ULA, Algorithms 1-4):
the same gated causal product with permuted arguments and, for key-side gradients, reversed time.

Notation: B batch, T time, H key heads, HV value heads, BT outer chunk (L), BQ rows of the output
tile (B_Lhq), BKV rows of the looped tile (B_Lkv), BA contraction-dim tile (B_dqk, whole dim),
BC output-column tile (B_dhv). G is the cumulative gate within the outer chunk, log2 units.

Forward form (REVERSE = False), for row r of outer chunk c with state S_c (HAS_STATE):

    out_r = scale * ( 2^(G_r) a_r S_c  +  sum_{s in chunk c, s <= r} (a_r . b_s) 2^(G_r - G_s) c_s )

Reverse form (REVERSE = True), for row s:

    out_s = scale * sum_{r in chunk c, r >= s} (a_s . b_r) 2^(G_r - G_s) c_r

    output  o   = fwd(a=q,    b=k,    c=Vnew, state S)        (contract K, out V)
    grad    dq  = fwd(a=dO,   b=Vnew, c=k,    state S^T)      (contract V, out K)
    grad    dv  = rev(a=k,    b=q,    c=dO)                   (contract K, out V)
    grad    dk  = rev(a=Vnew, b=dO,   c=q)                    (contract V, out K)

Work partitioning (TFLA Section 3, Table 1): one program per (BQ rows, BC columns, batch x head);
it loops over the BKV-row tiles of its outer chunk on the other side of the diagonal. Tiles off the
diagonal use the factorized gate 2^(G_r - G_m) 2^(G_m - G_s) (m between them, both exponents <= 0).
``ROWDOT`` additionally writes ``sum_j x_rj out_rj`` per row without the diagonal (r = s) terms
(used for the gate gradient dG = q.dq - k.dk, in which the diagonal terms cancel exactly); it needs
the whole output row in one program (BC >= output dim) and BKV = BQ.

Vector gate (``VEC_G``, GLA: a log decay per key channel, ``GV [B, T, HV, K]`` cumulative within the
outer chunk, log2 units; ULA Section 2.2, Eqs. 4-7): the pair weight is per channel,
``2^(GV_rk - GV_sk)``. For o and dv (``VEC_G = 1``) it multiplies the contraction dim (a_r . b_s becomes
``sum_k a_rk b_sk 2^(GV_rk - GV_sk)``); for dq and dk (``VEC_G = 2``) it multiplies the output
columns (``out_rk`` gets ``c_sk 2^(GV_rk - GV_sk)``). Off-diagonal tiles use one reference row m
between the two sides, applied elementwise: ``a_r * 2^(GV_r - GV_m)`` and ``b_s * 2^(GV_m - GV_s)``
(or on c and the output for ``VEC_G = 2``). The diagonal BQ x BQ square goes in 16-row blocks
(``_vec_diag``): pairs in different blocks through the row m at the block edge, pairs in one block
elementwise, one looped row per step. Every exponent evaluated is <= 0 (masked lanes read -inf), so
any decay is exact up to underflow of weights that are themselves below fp32's range. ``VEC_ROWDOT``
writes the per-channel ``x_rk out_rk`` (without the r = s terms) for the gate gradient
``dGV = q * dq - k * dk``; the scalar ``USE_G`` and ``ROWDOT`` paths are off then.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.chunk_output_vec import _gop, _vec_diag, _vec_side, _vec_state_term
from tfla.ops.common.chunk_state import _sequence_slots, _tile_of
from tfla.ops.common.grid import check_varlen_batch, program_tile, tile_grid
from tfla.ops.common.utils import acc_dtype, cdiv, dot_precision, next_pow2, prepare_chunk_indices, seqlens_to_list


@triton.jit
def _diag_tile(b_o, b_a, p_b, p_c, p_g, b_gq, t_k0, o_tq, m_tq, m_a, m_c, T, HB: tl.constexpr, HC: tl.constexpr,
               HV: tl.constexpr, DA: tl.constexpr, DC: tl.constexpr, BKV: tl.constexpr, USE_G: tl.constexpr,
               REVERSE: tl.constexpr, SPLIT_DIAG: tl.constexpr, DOT_PREC: tl.constexpr, b_addq=None, p_add=None,
               ROWADD: tl.constexpr = 0):
    """One tile on the diagonal: per-element gates and the causal mask. With SPLIT_DIAG the r = s
    terms stay out of the accumulator and come back as ``(a_r . b_r, c tile)``. ``ROWADD`` adds a
    constant to the scores before gating: per output row (1, ``b_addq``) or per looped row (2, read
    at ``p_add``)."""
    dt = b_a.dtype
    o_tk = t_k0 + tl.arange(0, BKV)
    m_tk = o_tk < T
    b_b = tl.load(p_b + o_tk[:, None] * (HB * DA), mask=m_tk[:, None] & m_a[None, :], other=0.0)  # [BKV, BA]
    b_s = tl.dot(b_a, tl.trans(b_b), input_precision=DOT_PREC)  # [BQ, BKV]
    if ROWADD == 1:
        b_s += b_addq[:, None]
    if ROWADD == 2:
        b_s += tl.load(p_add + o_tk * HV, mask=m_tk, other=0.0)[None, :]
    if REVERSE:
        m_s = (o_tq[:, None] <= o_tk[None, :]) & m_tq[:, None] & m_tk[None, :]
    else:
        m_s = (o_tq[:, None] >= o_tk[None, :]) & m_tq[:, None] & m_tk[None, :]
    b_sd = tl.sum(tl.where((o_tq[:, None] == o_tk[None, :]) & m_s, b_s, 0.0), 1)  # [BQ]: a_r . b_r
    if SPLIT_DIAG:
        m_s = m_s & (o_tq[:, None] != o_tk[None, :])
    if USE_G:
        b_gk = tl.load(p_g + o_tk * HV, mask=m_tk, other=0.0)
        if REVERSE:
            b_s = b_s * tl.exp2(tl.where(m_s, b_gk[None, :] - b_gq[:, None], float("-inf")))
        else:
            b_s = b_s * tl.exp2(tl.where(m_s, b_gq[:, None] - b_gk[None, :], float("-inf")))
    else:
        b_s = tl.where(m_s, b_s, 0.0)
    b_cc = tl.load(p_c + o_tk[:, None] * (HC * DC), mask=m_tk[:, None] & m_c[None, :], other=0.0)  # [BKV, BC]
    b_ps = b_s.to(dt)
    b_o = tl.dot(b_ps, b_cc.to(dt), b_o, input_precision=DOT_PREC)
    return b_o, b_sd, b_cc, tl.sum(b_s, 1), b_ps


@triton.jit
def _chunk_tiled_kernel(
    a,
    b,
    c,
    h,
    g,
    gk,
    gb,
    out,
    x,
    xdot,
    cu_seqlens,
    tile_indices,
    chunk_offsets,
    hn,
    lo,
    den,
    scale,
    eps,
    T,
    HV: tl.constexpr,
    HA: tl.constexpr,
    HB: tl.constexpr,
    HC: tl.constexpr,
    HX: tl.constexpr,
    DA: tl.constexpr,
    DC: tl.constexpr,
    H_SA: tl.constexpr,
    H_SC: tl.constexpr,
    HS: tl.constexpr,
    BT: tl.constexpr,
    BQ: tl.constexpr,
    BKV: tl.constexpr,
    BA: tl.constexpr,
    BC: tl.constexpr,
    USE_G: tl.constexpr,
    SPLIT_G: tl.constexpr,
    HAS_GB: tl.constexpr,
    REVERSE: tl.constexpr,
    HAS_STATE: tl.constexpr,
    ROWDOT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    ACC: tl.constexpr,
    NORM: tl.constexpr,
    BAS: tl.constexpr,
    gv=None,
    VEC_G: tl.constexpr = 0,
    VEC_ROWDOT: tl.constexpr = False,
    add=None,
    ROWADD: tl.constexpr = 0,
    VEC_SPAN: tl.constexpr = 0,
    out2=None,
    xdot2=None,
    DUAL: tl.constexpr = False,
    VEC_F32: tl.constexpr = 0,
    FLAT: tl.constexpr = False,
):
    # (column tile, row tile, batch x head): a 3-D grid, or its flat form past CUDA's axis limits (grid.py)
    i_c_, i_t, i_bh = program_tile(T, (DC + BC - 1) // BC, BQ, HV, IS_VARLEN, FLAT)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_n, i_t = _tile_of(tile_indices, i_t, i_b, IS_VARLEN)
    bos, T, boh = _sequence_slots(cu_seqlens, chunk_offsets, i_n, T, HS, IS_VARLEN)
    t_q0 = i_t * BQ
    i_ch = t_q0 // BT  # outer chunk of this tile
    o_tq = t_q0 + tl.arange(0, BQ)
    m_tq = o_tq < T
    o_a = tl.arange(0, BA)
    m_a = o_a < DA
    o_c = i_c_ * BC + tl.arange(0, BC)
    m_c = o_c < DC
    dt = a.dtype.element_ty
    # per-tensor head of this value head (grouped heads read key head i_hv // (HV // H))
    p_a = a + (bos * HA + i_hv // (HV // HA)) * DA + o_a[None, :]
    p_b = b + (bos * HB + i_hv // (HV // HB)) * DA + o_a[None, :]
    p_c = c + (bos * HC + i_hv // (HV // HC)) * DC + o_c[None, :]

    b_a = tl.load(p_a + o_tq[:, None] * (HA * DA), mask=m_tq[:, None] & m_a[None, :], other=0.0)  # [BQ, BA]
    # ROWADD: the scores a_r . b_s get a constant per output row r (1) or per looped row s (2) before
    # gating: the mLSTM normalizer's cotangent, the extra column of c = [v, 1] folded into dq / dk
    if ROWADD > 0:
        p_add = add + bos * HV + i_hv
    else:
        p_add = add
    if ROWADD == 1:
        b_addq = tl.load(p_add + o_tq * HV, mask=m_tq, other=0.0)
    else:
        b_addq = tl.zeros([BQ], dtype=ACC)
    if USE_G:
        # p_g: gate of the output rows, p_gc: gate of the looped rows (the same tensor unless SPLIT_G;
        # the host passes the key-side gate as the row gate in reverse mode)
        p_g = g + bos * HV + i_hv
        if SPLIT_G:
            p_gc = gk + bos * HV + i_hv
        else:
            p_gc = p_g
        b_gq = tl.load(p_g + o_tq * HV, mask=m_tq, other=0.0)
    else:  # placeholders for the helper's arguments (unused without gates)
        p_g = g
        p_gc = g
        b_gq = tl.zeros([BQ], dtype=ACC)
    if VEC_G > 0:  # the vector gate of the output rows, on the contraction dim (1) or the output columns (2)
        if VEC_G == 1:
            p_gv = gv + (bos * HV + i_hv) * DA
            o_gd = o_a
            m_gd = m_a
            s_gv = HV * DA
        else:
            p_gv = gv + (bos * HV + i_hv) * DC
            o_gd = o_c
            m_gd = m_c
            s_gv = HV * DC
        b_gvq = tl.load(p_gv + o_tq[:, None] * s_gv + o_gd[None, :], mask=m_tq[:, None] & m_gd[None, :], other=0.0)
    if HAS_STATE:
        # inter-chunk part: a @ S_c (S read with strides H_SA along the contraction dim, H_SC along out)
        # states are stored every HS rows (HS = BT, or 64 in the backward pass)
        p_h = h + ((boh + i_ch * (BT // HS)) * HV + i_hv) * DA * DC + o_a[:, None] * H_SA + o_c[None, :] * H_SC
        if BAS == BA:
            b_st = tl.load(p_h, mask=m_a[:, None] & m_c[None, :], other=0.0).to(dt)  # [BA, BC]
            b_o = tl.dot(b_a, b_st, input_precision=DOT_PREC)  # [BQ, BC]
        else:  # the contraction in BAS-wide pieces (fp32 states of 256 x 256 do not fit shared memory)
            b_o = tl.zeros([BQ, BC], dtype=ACC)
            for i_as in tl.static_range(0, BA, BAS):
                o_as = i_as + tl.arange(0, BAS)
                m_as = o_as < DA
                b_ap = tl.load(a + (bos * HA + i_hv // (HV // HA)) * DA + o_tq[:, None] * (HA * DA) + o_as[None, :],
                               mask=m_tq[:, None] & m_as[None, :], other=0.0)  # [BQ, BAS]
                p_hs = h + ((boh + i_ch * (BT // HS)) * HV + i_hv) * DA * DC + o_as[:, None] * H_SA + o_c[None, :] * H_SC
                b_st = tl.load(p_hs, mask=m_as[:, None] & m_c[None, :], other=0.0).to(dt)  # [BAS, BC]
                b_o = tl.dot(b_ap, b_st, b_o, input_precision=DOT_PREC)
        if ROWADD == 1:  # the added column's state term: add_r n_c (n: [.., DC] fp32, the output dim)
            b_o += b_addq[:, None] * tl.load(hn + ((boh + i_ch * (BT // HS)) * HV + i_hv) * DC + o_c, mask=m_c,
                                             other=0.0)[None, :]
        if NORM > 0:  # the normalizer's state term a_r . n_c (n: [.., DA] fp32, same stride as h / DC)
            b_nst = tl.load(hn + ((boh + i_ch * (BT // HS)) * HV + i_hv) * DA + o_a, mask=m_a, other=0.0)
            b_den = tl.sum(b_a.to(ACC) * b_nst[None, :], 1)
        if USE_G:
            if HAS_GB:  # the state's own stabilizer: the gate of the row before the outer chunk
                b_gs = b_gq - tl.load(gb + (bos + i_ch * BT) * HV + i_hv)
                b_fs = tl.exp2(tl.where(m_tq, b_gs, float("-inf")))
            else:
                b_fs = tl.exp2(b_gq)
            b_o *= b_fs[:, None]
            if NORM > 0:
                b_den *= b_fs
        if VEC_G == 1:  # (a * 2^GV) S_c, replacing the ungated product above (dead code then)
            b_o = _vec_state_term(a, h, p_gv, s_gv, bos, boh, i_hv, i_ch, o_tq, m_tq, o_c, m_c, HA, HV, DA, DC, H_SA,
                                  H_SC, HS, BT, BQ, BA, BC, BAS, DOT_PREC, ACC)
        if VEC_G == 2:  # 2^GV * (a S_c): the gate on the output columns
            b_o *= tl.exp2(tl.where(m_tq[:, None] & m_gd[None, :], b_gvq, float("-inf")))
    else:
        b_o = tl.zeros([BQ, BC], dtype=ACC)
        if NORM > 0:
            b_den = tl.zeros([BQ], dtype=ACC)

    # the diagonal tiles (per-element gates and causal mask). With ROWDOT the diagonal (r = s) terms
    # are kept out of the accumulator: they enter both row dots of dG = q.dq - k.dk and cancel exactly
    # there, so leaving them out of the row dot avoids a catastrophic cancellation under strong decay;
    # they are added to the output after the row dot (BKV = BQ: one diagonal tile, its c rows are the
    # output rows).
    if VEC_G > 0:  # the vector gate's diagonal square: 16-row blocks, exact for any decay
        b_o, b_sd, b_cd = _vec_diag(b_o, b_a, p_b, p_c, p_gv, s_gv, b_gvq, t_q0, o_tq, m_tq, m_a, m_c, o_gd, m_gd, T,
                                    HB * DA, HC * DC, BQ, VEC_G, REVERSE, VEC_ROWDOT, DOT_PREC, ACC, VEC_SPAN, VEC_F32)
    elif ROWDOT:
        b_o, b_sd, b_cd, _, b_ps = _diag_tile(b_o, b_a, p_b, p_c, p_gc, b_gq, t_q0, o_tq, m_tq, m_a, m_c, T, HB, HC,
                                              HV, DA, DC, BKV, USE_G, REVERSE, True, DOT_PREC, b_addq, p_add, ROWADD)
    else:
        for t_k0 in range(t_q0, t_q0 + BQ, BKV):
            b_o, _, _, b_rs, _ = _diag_tile(b_o, b_a, p_b, p_c, p_gc, b_gq, t_k0, o_tq, m_tq, m_a, m_c, T, HB, HC, HV,
                                            DA, DC, BKV, USE_G, REVERSE, False, DOT_PREC, b_addq, p_add, ROWADD)
            if NORM > 0:
                b_den += b_rs

    # off-diagonal tiles of the same outer chunk (level-2 tiling): before the diagonal (forward) or
    # after it (reverse), with the factorized gate through the row m between the two tiles
    if REVERSE:
        t_lo = t_q0 + BQ
        t_hi = tl.minimum((i_ch + 1) * BT, T)
        if USE_G:
            if SPLIT_G:  # the smallest key-side gate of the tile: both factors <= 1 again
                b_gm = tl.min(tl.where(m_tq, b_gq, float("inf")), 0)
            else:  # clamped into the sequence: the last tile's rows then see exponents <= 0 as well
                b_gm = tl.load(p_g + (tl.minimum(t_q0 + BQ, T) - 1) * HV)
            b_fq = tl.exp2(tl.where(m_tq, b_gm - b_gq, float("-inf")))  # [BQ]
    else:
        t_lo = i_ch * BT
        t_hi = t_q0
    if VEC_G > 0:  # one reference row m for every off-diagonal pair: the tile's first row (forward,
        # looped rows s < m <= r) or its last row in the sequence (reverse, r <= m < s)
        if REVERSE:
            b_gvm = tl.load(p_gv + (tl.minimum(t_q0 + BQ, T) - 1) * s_gv + o_gd, mask=m_gd, other=0.0)
            b_fv = tl.exp2(tl.where(m_tq[:, None] & m_gd[None, :], b_gvm[None, :] - b_gvq, float("-inf")))
        else:
            b_gvm = tl.load(p_gv + t_q0 * s_gv + o_gd, mask=m_gd, other=0.0)
            b_fv = tl.exp2(tl.where(m_tq[:, None] & m_gd[None, :], b_gvq - b_gvm[None, :], float("-inf")))
        if VEC_G == 1:  # a_r * 2^(GV_r - GV_m) (forward; 2^(GV_m - GV_r) reverse), [BQ, BA]
            b_a = _gop(b_a * b_fv, dt, VEC_F32 > 0)
        else:  # the off-diagonal sum is gated on its output columns once, after the loop
            b_ov = b_o
            b_o = tl.zeros([BQ, BC], dtype=ACC)
    # VEC_F32: the scores in fp32 when c is gated (VEC_G = 2) or for dv (VEC_F32 = 2, reverse VEC_G = 1)
    F32C: tl.constexpr = VEC_F32 > 1 or (VEC_F32 > 0 and VEC_G == 2)
    for t_k0 in range(t_lo, t_hi, BKV):
        o_tk = t_k0 + tl.arange(0, BKV)
        m_tk = o_tk < T
        b_b = tl.load(p_b + o_tk[:, None] * (HB * DA), mask=m_tk[:, None] & m_a[None, :], other=0.0)  # [BKV, BA]
        if VEC_G == 1:
            b_b = _gop(b_b * _vec_side(p_gv, s_gv, b_gvm, o_tk, m_tk, o_gd, m_gd, REVERSE), dt, VEC_F32 > 0)
        b_s = tl.dot(b_a, tl.trans(b_b), input_precision=DOT_PREC)  # [BQ, BKV]
        if ROWADD == 1:
            b_s += b_addq[:, None]
        if ROWADD == 2:
            b_s += tl.load(p_add + o_tk * HV, mask=m_tk, other=0.0)[None, :]
        if USE_G:
            b_gk = tl.load(p_gc + o_tk * HV, mask=m_tk, other=0.0)
            if REVERSE:  # rows s of this tile precede m = t_q0 + BQ - 1 < r
                b_s *= b_fq[:, None] * tl.exp2(tl.where(m_tk, b_gk - b_gm, float("-inf")))[None, :]
            else:  # m = t_k0 + BKV - 1 lies between s and r (split gates: the tile's smallest key gate)
                if SPLIT_G:
                    b_gm = tl.min(b_gk, 0)  # the tile lies before the output rows: all rows valid
                else:
                    b_gm = tl.load(p_g + (t_k0 + BKV - 1) * HV)
                b_s *= tl.exp2(tl.where(m_tq, b_gq - b_gm, float("-inf")))[:, None] * tl.exp2(b_gm - b_gk)[None, :]
        if NORM > 0:
            b_den += tl.sum(b_s, 1)
        b_cc = tl.load(p_c + o_tk[:, None] * (HC * DC), mask=m_tk[:, None] & m_c[None, :], other=0.0)  # [BKV, BC]
        if VEC_G == 2:
            b_cc = b_cc * _vec_side(p_gv, s_gv, b_gvm, o_tk, m_tk, o_gd, m_gd, REVERSE)
        b_o = tl.dot(_gop(b_s, dt, F32C), _gop(b_cc, dt, F32C), b_o, input_precision=DOT_PREC)
    if VEC_G == 2:
        b_o = b_ov + b_o * b_fv

    b_o *= scale
    if NORM > 0:  # the normalized output: out divided per row by a function of den = scale a.n
        b_den *= scale
        if NORM == 3:  # FLA's normalized linear attention: out / (den + eps), the sign kept
            b_o = b_o / (b_den + eps)[:, None]
        else:  # the mLSTM's: out / (max(|den|, lower bound) + eps)
            if NORM == 2:  # per-row lower bound (e^{-m})
                b_lo = tl.load(lo + (bos + o_tq) * HV + i_hv, mask=m_tq, other=1.0)
            else:
                b_lo = tl.full([BQ], 1.0, dtype=ACC)
            b_o = b_o / (tl.maximum(tl.abs(b_den), b_lo) + eps)[:, None]
        tl.store(den + (bos + o_tq) * HV + i_hv, b_den, mask=m_tq & ((o_tq * 0 + i_c_) == 0))
    if VEC_ROWDOT:  # per channel x * out without the diagonal terms (they cancel in q * dq - k * dk), then add them
        m_qc = m_tq[:, None] & m_c[None, :]
        b_x = tl.load(x + (bos * HX + i_hv // (HV // HX)) * DC + o_tq[:, None] * (HX * DC) + o_c[None, :], mask=m_qc,
                      other=0.0).to(ACC)
        tl.store(xdot + (bos * HV + i_hv) * DC + o_tq[:, None] * (HV * DC) + o_c[None, :], b_x * b_o, mask=m_qc)
        b_o += (scale * b_sd)[:, None] * b_cd.to(ACC)
    if ROWDOT:  # x . out without the diagonal terms, then add them to the output
        p_x = x + (bos * HX + i_hv // (HV // HX)) * DC + o_tq[:, None] * (HX * DC) + o_c[None, :]
        b_xr = tl.load(p_x, mask=m_tq[:, None] & m_c[None, :], other=0.0)
        b_x = b_xr.to(ACC)
        tl.store(xdot + (bos + o_tq) * HV + i_hv, tl.sum(b_x * b_o, 1), mask=m_tq)
        if SPLIT_G:  # the diagonal's own gate 2^(GQ_r - GK_r) (1 with one shared gate)
            b_gd = tl.load(p_gc + o_tq * HV, mask=m_tq, other=0.0)
            if REVERSE:
                b_sd *= tl.exp2(tl.where(m_tq, b_gd - b_gq, float("-inf")))
            else:
                b_sd *= tl.exp2(tl.where(m_tq, b_gq - b_gd, float("-inf")))
        b_o += (scale * b_sd)[:, None] * b_cd.to(ACC)
    p_o = out + (bos * HV + i_hv) * DC + o_tq[:, None] * (HV * DC) + o_c[None, :]
    tl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_tq[:, None] & m_c[None, :])
    if DUAL:  # the reverse form from the same gated scores (one diagonal tile, BT = BQ = BKV, ROWDOT): with
        # a = dO, b = Vnew, c = k, x = q it is dk_s = scale sum_{r >= s} P_rs q_r, with its row dot with k (the
        # c tile's rows) without the r = s terms, then those terms (the same a_r . b_r and diagonal gate)
        b_o = tl.dot(tl.trans(b_ps), b_xr.to(dt), input_precision=DOT_PREC) * scale
        tl.store(xdot2 + (bos + o_tq) * HV + i_hv, tl.sum(b_cd.to(ACC) * b_o, 1), mask=m_tq)
        b_o += (scale * b_sd)[:, None] * b_x
        tl.store(out2 + (bos * HV + i_hv) * DC + o_tq[:, None] * (HV * DC) + o_c[None, :],
                 b_o.to(out2.dtype.element_ty), mask=m_tq[:, None] & m_c[None, :])


def tiled_config(chunk_size: int, DA: int, DC: int, config: dict | None = None) -> dict:
    """Tile sizes and launch shape of the tiled kernel: a fixed heuristic, overridable per key
    (``BQ``, ``BKV``, ``BV`` (output columns), ``num_warps``, ``num_stages``)."""
    # defaults measured on an H200 (docs/performance.md): full-width output tiles, 4 warps
    cfg = {"BQ": 64, "BKV": 64, "BV": 128 if DA <= 128 else 64, "num_warps": 4, **(config or {})}
    cfg["BQ"] = min(cfg["BQ"], chunk_size)
    cfg["BKV"] = min(cfg["BKV"], chunk_size)
    # 2 stages only where the off-diagonal loop can run 2 or more tiles: at fewer (L = 64 with 64-row
    # tiles: none) the pipeliner's prologue just holds the next tile's loads, in shared memory and
    # registers (sm_90 compile, Triton 3.6, bf16 K = V = 128, L = 64: 98560-115976 B of shared memory
    # and up to 268 B of spill stores per launch with 2 stages, 32768-49664 B and none of the GDN /
    # simple GLA launches with 1; commit message has the table). H100, whole fwd+bwd calls (docs/performance.md,
    # 2026-11-23): GDN 4.07 -> 3.86 ms, mLSTM sigmoid (V = 256) 11.61 -> 10.44 ms with 1 stage
    cfg.setdefault("num_stages", 2 if (chunk_size - cfg["BQ"]) // cfg["BKV"] >= 2 else 1)
    # tiles at least 32 wide: 16-wide 16-bit operands made Triton 3.6's dots read shared memory out of bounds
    # (H100, compute-sanitizer, head dim 16, 2026-11-24: an illegal memory access); the masks pad them
    cfg["BV"] = max(32, min(next_pow2(DC), cfg["BV"]))
    if chunk_size % cfg["BQ"] or chunk_size % cfg["BKV"] or cfg["BQ"] % cfg["BKV"]:
        raise ValueError(f"tiles BQ={cfg['BQ']}, BKV={cfg['BKV']} must divide chunk_size={chunk_size} "
                         "and BKV must divide BQ")
    return cfg


output_config = tiled_config


def dual_supported(chunk_size: int, DA: int, DC: int, dtype: torch.dtype, config: dict | None = None) -> bool:
    """Whether ``chunk_tiled(.., dual_dtype=..)`` applies: the chunk is one diagonal tile (``BQ = BKV =
    chunk_size``, so L = 64 with the default tiles; fp32 tiles at dims above 128 use 32 rows and do not)."""
    cfg = tiled_config(chunk_size, DA, DC, config)
    if dtype.itemsize >= 4 and max(next_pow2(DA), next_pow2(DC)) > 128 \
            and not (config and "BQ" in config):
        return False
    return cfg["BQ"] == cfg["BKV"] == chunk_size


def chunk_tiled(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    g_cum: torch.Tensor | None,
    scale: float,
    chunk_size: int,
    h: torch.Tensor | None = None,
    state_every: int | None = None,
    state_transposed: bool = False,
    reverse: bool = False,
    rowdot_with: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    cu_seqlens: torch.Tensor | None = None,
    tile_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    config: dict | None = None,
    gk_cum: torch.Tensor | None = None,
    gb: torch.Tensor | None = None,
    normalizer: dict | None = None,
    gv_cum: torch.Tensor | None = None,
    gv_on_out: bool = False,
    row_add: torch.Tensor | None = None,
    row_add_n: torch.Tensor | None = None,
    dual_dtype: torch.dtype | None = None,
):
    """The tiled chunk product (module docstring) for ``a, b: [B, T, *, DA]``, ``c: [B, T, *, DC]``
    (each with H or HV heads), ``g_cum [B, T, HV]``; output ``[B, T, HV, DC]``.

    ``h [B, NT, HV, K, V]``: states every ``state_every`` rows (default: at outer-chunk starts; 64 with
    the backward's per-sub-chunk states, then ``chunk_offsets`` counts 64-row sub-chunks);
    ``state_transposed`` reads S^T (for dq).
    ``rowdot_with [B, T, *, DC]``: also return ``sum_j x_rj out_rj`` as ``[B, T, HV]`` fp32.
    ``tile_indices`` (varlen) is ``prepare_chunk_indices(.., cfg["BQ"])``.
    Split gates (the mLSTM's input gate and max state): ``g_cum`` is then the query-side gate GQ and
    ``gk_cum [B, T, HV]`` the key-side gate GK, the pair weight is ``2^(GQ_r - GK_s)`` (both log2,
    restarting every L, ``GQ_r <= GK_s`` for s <= r); ``gb [B, T, HV]`` holds at each outer-chunk start
    the gate of the row before it (the state's stabilizer; 0 when None), so the state term is
    ``2^(GQ_r - gb) a_r S_c``.
    ``normalizer`` (forward only, with ``h``): ``dict(hn=[B, NT, HV, DA] fp32 normalizer states,
    lo=[B, T, HV] fp32 lower bound or None (then 1), eps=float, signed=bool (default False))``: the row sums of
    the same gated product with c = 1, ``den_r = scale (2^(..) a_r . n_c + sum_s w_rs a_r . b_s)``, are formed in
    the same pass and the output is ``out_r / (max(|den_r|, lo_r) + eps)`` (the mLSTM, TFLA paper Section 2) or,
    with ``signed`` (no ``lo``), ``out_r / (den_r + eps)`` (FLA 0.6.0's normalized linear attention, sign kept);
    ``den [B, T, HV]`` fp32 is returned as well.
    Vector gate (GLA): ``gv_cum [B, T, HV, D]`` fp32 cumulative log2 gate per channel within outer chunks
    (``g_cum`` None), on the contraction dim (D = DA; o, dv) or, with ``gv_on_out``, on the output
    columns (D = DC; dq, dk); ``rowdot_with`` then returns the per-channel ``x * out`` as
    ``[B, T, HV, DC]`` fp32 (without the r = s terms, as the scalar row dot). Config key ``VEC_F32``
    (16-bit inputs): the gated operands, and the scores they meet, stay fp32 in TF32 products (FLA's
    precision for GLA; the reverse contraction-dim form, dv, keeps its scores fp32 too).
    ``row_add [B, T, HV]`` fp32: a constant added to the scores ``a_r . b_s`` before gating, per output row
    (forward form) or per looped row (reverse form); with states (forward form) the state term gains
    ``row_add_r n_c`` from ``row_add_n [B, NT, HV, DC]`` fp32. This is the product with one more column
    ``[b, 1]`` / ``[a, row_add]`` and state ``[S, n]``: the mLSTM normalizer's cotangent folded into dq
    (``fwd(a=dO, b=v, c=k)``, ``row_add`` = d den) and dk (``rev(a=v, b=dO, c=q)``).
    ``dual_dtype`` (forward form with ``rowdot_with``, one diagonal tile per chunk: ``dual_supported``): also
    the reverse form ``rev(a=b, b=a, c=rowdot_with)`` of the same call and its row dot with ``c``, from the same
    gated score tile (dq and dk in one launch: ``fwd(dO, Vnew, k; x=q)`` gives dk = ``rev(Vnew, dO, q; x=k)``);
    returns ``(out, rowdot, out2, rowdot2)`` then, ``out2 [B, T, HV, DC]`` in ``dual_dtype``.
    Returns ``out``, ``(out, rowdot)`` or ``(out, den)``.
    """
    B, T, HA, DA = a.shape
    HB, HC, DC = b.shape[2], c.shape[2], c.shape[3]
    HV = max(HA, HB, HC)
    cfg = tiled_config(chunk_size, DA, DC, config)
    bq_tiles = cfg["BQ"]  # the row tiles the caller's varlen tile_indices were built for
    if rowdot_with is not None:
        cfg["BV"] = max(32, next_pow2(DC))  # the row dot needs the whole row in one program
        cfg["BKV"] = cfg["BQ"]  # and the diagonal tile's rows to be the output rows
    if a.element_size() >= 4 and max(next_pow2(DA), cfg["BV"]) > 128 and not (config and "BQ" in config):
        # fp32 tiles of 256 columns: 64-row tiles need more shared memory than an H200 has (tf32x3
        # operands are staged there; 262144 B requested vs 232448 B at K = 100, V = 200)
        cfg["BQ"] = cfg["BKV"] = 32
    BA = max(32, next_pow2(DA))
    bas = BA  # the state term's contraction piece: fp32 state tiles of more than 64 KiB go in pieces
    if h is not None and a.element_size() >= 4 and BA * cfg["BV"] > 16384:
        bas = max(16, 16384 // cfg["BV"])
    out = torch.empty(B, T, HV, DC, dtype=out_dtype or a.dtype, device=a.device)
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    xdot = torch.empty(B, T, HV, dtype=acc, device=a.device) if rowdot_with is not None else None
    vec = 0 if gv_cum is None else (2 if gv_on_out else 1)
    if cu_seqlens is not None and cfg["BQ"] != bq_tiles:  # the overrides above changed the row tiles:
        # rebuild the (sequence, tile) table for them (one host read of cu_seqlens; fp32 at dims > 128 only)
        tile_indices = prepare_chunk_indices(seqlens_to_list(cu_seqlens), cfg["BQ"], a.device)
    if vec:
        if g_cum is not None or gk_cum is not None or gb is not None or normalizer is not None:
            raise ValueError("a vector gate (gv_cum) excludes the scalar gates and the normalizer")
        if tuple(gv_cum.shape) != (B, T, HV, DC if gv_on_out else DA) or cfg["BQ"] % 16:
            raise ValueError(f"gv_cum must be [B, T, HV, {'DC' if gv_on_out else 'DA'}] and BQ a multiple of 16")
        if rowdot_with is not None:
            xdot = torch.empty(B, T, HV, DC, dtype=acc, device=a.device)
    norm = normalizer or {}
    if normalizer is not None and (h is None or reverse or rowdot_with is not None):
        raise ValueError("normalizer needs the forward form with states (h) and no rowdot")
    if norm.get("signed") and norm.get("lo") is not None:
        raise ValueError("the signed normalizer (out / (den + eps)) takes no lower bound `lo`")
    rowadd = 0 if row_add is None else (2 if reverse else 1)
    if rowadd and (vec or normalizer is not None or tuple(row_add.shape) != (B, T, HV)
                   or (rowadd == 1 and h is not None and row_add_n is None)):
        raise ValueError("row_add [B, T, HV] excludes the vector gate and the normalizer; with states it "
                         "needs row_add_n")
    den = torch.empty(B, T, HV, dtype=acc, device=a.device) if normalizer is not None else None
    dual = dual_dtype is not None
    if dual and (reverse or rowdot_with is None or vec or normalizer is not None
                 or not cfg["BQ"] == cfg["BKV"] == chunk_size or c.shape[2] != rowdot_with.shape[2]):
        raise ValueError("dual_dtype needs the forward form with rowdot_with, no vector gate or normalizer, "
                         "one diagonal tile per chunk (BQ = BKV = chunk_size) and c, rowdot_with of one head count")
    out2 = torch.empty(B, T, HV, DC, dtype=dual_dtype, device=a.device) if dual else None
    xdot2 = torch.empty(B, T, HV, dtype=acc, device=a.device) if dual else None
    # VEC_F32 (16-bit inputs, vector gate): 1 keeps the gated operands and the scores they meet in fp32 (TF32
    # products), 2 also the scores of the reverse VEC_G = 1 form (dv: scores x dO, which FLA forms in fp32)
    vec_f32 = 0
    if vec and cfg.get("VEC_F32", False) and a.element_size() < 4:
        vec_f32 = 2 if (reverse and vec == 1) else 1
    NQ = cdiv(T, cfg["BQ"]) if cu_seqlens is None else tile_indices.shape[0]
    if NQ > 0 and B * HV > 0:
        check_varlen_batch(B, cu_seqlens)
        grid, flat = tile_grid(cdiv(DC, cfg["BV"]), NQ, B * HV, force_flat=cfg.get("flat", False))
        _chunk_tiled_kernel[grid](
            a, b, c, h, gk_cum if (reverse and gk_cum is not None) else g_cum,
            g_cum if (reverse and gk_cum is not None) else gk_cum, gb,
            out, rowdot_with, xdot, cu_seqlens, tile_indices, chunk_offsets,
            row_add_n if rowadd == 1 else norm.get("hn"), norm.get("lo"), den,
            scale, float(norm.get("eps", 0.0)), T,
            HV=HV, HA=HA, HB=HB, HC=HC, HX=rowdot_with.shape[2] if rowdot_with is not None else HV,
            DA=DA, DC=DC, H_SA=1 if state_transposed else DC, H_SC=DA if state_transposed else 1,
            HS=state_every or chunk_size,
            BT=chunk_size, BQ=cfg["BQ"], BKV=cfg["BKV"], BA=BA, BC=cfg["BV"],
            USE_G=g_cum is not None, SPLIT_G=gk_cum is not None, HAS_GB=gb is not None, REVERSE=reverse, HAS_STATE=h is not None, ROWDOT=rowdot_with is not None and not vec,
            IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(a.dtype), ACC=acc_dtype(a.dtype),
            NORM=0 if normalizer is None else (3 if norm.get("signed") else (2 if norm.get("lo") is not None else 1)),
            BAS=bas,
            gv=gv_cum, VEC_G=vec, VEC_ROWDOT=bool(vec) and rowdot_with is not None, add=row_add, ROWADD=rowadd,
            VEC_SPAN=cfg.get("VEC_SPAN", 0), out2=out2, xdot2=xdot2, DUAL=dual, VEC_F32=vec_f32, FLAT=flat,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    if dual:
        return out, xdot, out2, xdot2
    if rowdot_with is not None:
        return out, xdot
    return (out, den) if normalizer is not None else out


def chunk_output_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    h: torch.Tensor,
    g_cum: torch.Tensor | None,
    scale: float,
    chunk_size: int,
    out_dtype: torch.dtype | None = None,
    cu_seqlens: torch.Tensor | None = None,
    tile_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    config: dict | None = None,
    gk_cum: torch.Tensor | None = None,
    gb: torch.Tensor | None = None,
    normalizer: dict | None = None,
):
    """``o [B, T, HV, V] = scale (2^G q S_c + causal-gated (q k^T) v)`` from q, k ``[B, T, H, K]``,
    v ``[B, T, HV, V]`` (the delta rule's Vnew), states ``h [B, NT, HV, K, V]`` and ``g_cum`` (split
    gates ``gk_cum``, ``gb``, and the mLSTM's ``normalizer``, then ``(o, den)``: see ``chunk_tiled``)."""
    return chunk_tiled(q, k, v, g_cum, scale, chunk_size, h=h, out_dtype=out_dtype, cu_seqlens=cu_seqlens,
                       tile_indices=tile_indices, chunk_offsets=chunk_offsets, config=config, gk_cum=gk_cum, gb=gb,
                       normalizer=normalizer)
