"""The WY / UT backward per 64-row sub-chunk (``wy_bwd``): the delta rule's gradients through Tm, W and U, and the
state terms (dW, dk's state part, the gate gradient's ``<S, dS>`` rows) that linear attention (simple GLA, GLA, the
mLSTM) needs as well. Notation as ``ut_transform.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.grid import check_varlen_batch, chunk_rows, program_rows, tile_grid
from tfla.ops.common.utils import SUB_CHUNK, acc_dtype, cdiv, dot_precision, dot_tile, next_pow2

@triton.jit
def _state_terms(v_new, dh, b_en, p_tv0, p_h, p_dh, o_t, m_t, o_k, m_k, V: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, DOT_PREC: tl.constexpr, ACC: tl.constexpr, WITH_SDS: tl.constexpr = True):
    """Linear attention, one key tile: ``dk_state = 2^(g_n - g) Vnew dS^T`` and (WITH_SDS) the tile's rows of
    ``<S, dS>`` (``[BK]``, summed over V), looping over value tiles (S, dS: the sub-chunk's start state and the
    gradient of the state after it). S is read only for <S, dS>. (The delta rule's state terms come from
    ``chunk_dqkw``.)"""
    dt = dh.dtype.element_ty
    b_dks = tl.zeros([64, BK], dtype=ACC)
    b_sds = tl.zeros([BK], dtype=ACC)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        if WITH_SDS:
            b_s = tl.load(p_h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)  # [BK, BV]
        b_vn = tl.load(v_new + p_tv0 + o_v[None, :], mask=m_tv, other=0.0)
        b_ds = tl.load(p_dh + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        b_dks = tl.dot((b_vn * b_en[:, None]).to(dt), tl.trans(b_ds), b_dks, input_precision=DOT_PREC)
        if WITH_SDS:
            b_sds += tl.sum(b_s.to(ACC) * b_ds.to(ACC), 1)
    return b_dks, b_sds


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
    BKK: tl.constexpr = 0,
    FLAT: tl.constexpr = False,
):
    """Delta-rule gradients of one 64-row sub-chunk (W = Tm X_k, U = Tm X_v, Tm = (I + A)^-1,
    Vnew = U - W S, S' = 2^(g_n) S + K^T 2^(g_n - g) Vnew): the state terms ``dW = -dU S^T``,
    ``dk_state = 2^(g_n - g) Vnew dS^T`` and the state parts of the gate gradient come precomputed
    (``chunk_dqkw.chunk_dqkw_bwd``: dW from ``dwp``, dk_state already inside ``dka``, the rows
    ``P_s = k_s . dk_state_s`` from ``pst`` and ``<S, dS>`` from ``sdst``; neither S nor dS is read); this kernel
    does the UT/WY backward ``dTm = dW X_k^T + dU X_v^T``, ``dA = -Tm^T dTm Tm^T``, giving dk, dv, dbeta and this
    part's gradient of g. Key and value dims in BK/BV tiles.

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
    BKK > 0 (>= K, delta rule): K K^T from one [64, BKK] load of k before the first key pass instead of inside it
    (that pass then holds dW's product alone)."""
    BS: tl.constexpr = 64
    i_s, i_bh = program_rows(T, BS, HV, IS_VARLEN, FLAT)  # (64-row sub-chunk, batch x head): 2-D or flat grid
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    # this sub-chunk's row among all of them: the varlen table's rows are in (sequence, sub-chunk) order
    if IS_VARLEN:
        i_sub = i_s
    else:
        i_sub = i_b * tl.cdiv(T, BS) + i_s
    i_s, bos, T = chunk_rows(i_s, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
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
            b_dw = tl.load(dwp + p_tk + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
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
        if DELTA:  # dW stored by chunk_dqkw; dk_state is in dka already
            b_dw = tl.load(dwp + p_tk + o_k[None, :], mask=m_tk, other=0.0)
        else:
            b_dks, b_sds_k = _state_terms(v_new, dh, b_en, p_tv0, p_h, p_dh, o_t, m_t, o_k, m_k, V, BK, BV,
                                          DOT_PREC, ACC, DG and NVS == 0)
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
            b_dxk_k = tl.sum(b_dxk * b_kf, 1)
            b_db += b_dxk_k * b_eg
            b_dxx += b_dxk_k * b_sk
        else:
            b_dk = b_dks
        if ADD_DK:
            b_dk += tl.load(dka + p_tk + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
        tl.store(dk + p_tk + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)
        if not DELTA:
            b_p += tl.sum(b_kf * b_dks, 1)
        if KDOT:
            b_kdk += tl.sum(b_kf * b_dk, 1)
    if DELTA:
        tl.store(dbeta + (bos + o_t) * HV + i_hv, b_db.to(dbeta.dtype.element_ty), mask=m_t)
    if KDOT:
        tl.store(kdk + (bos + o_t) * HV + i_hv, b_kdk, mask=m_t)
    if DELTA and DG:  # the state parts of the gate gradient, from chunk_dqkw
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
    if delta != (dw is not None) or (delta and (pst is None or sdst is None or dk_add is None)):
        raise ValueError("the delta rule (ai) takes its state terms precomputed by chunk_dqkw (dw, pst, sdst and "
                         "dk_add, all four), linear attention none of them")
    n_state = dhn_sub is not None
    if sds_sub is not None and (delta or sds_sub.dim() != 5 or sds_sub.shape[:3] != dh_sub.shape[:3]):
        raise ValueError("sds_sub [B, NS, HV, NV, K] serves linear attention (no delta rule)")
    if h_sub is None and not delta and (g_cum is not None or gv_cum is not None) and need_dg and sds_sub is None:
        raise ValueError("h_sub is needed unless sds_sub is given or no gate gradient is (need_dg=False)")
    if n_state and (delta or gv_cum is not None or hn_sub is None):
        raise ValueError("hn_sub / dhn_sub (both) serve linear attention with scalar gates")
    B, T, H, K = k.shape
    HV, V = v_new.shape[2], v_new.shape[3]
    if delta and (tuple(dw.shape) != (B, T, HV, K) or tuple(pst.shape) != (B, T, HV) or sdst.shape[2] != HV):
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
    kk_full = delta and (config or {}).get("kk_full", True) and next_pow2(K) <= 128
    stages = 1 if delta and not kk_full else 3
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
        H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=dot_tile(K, cfg["BK"], k.dtype),
        BV=dot_tile(V, cfg["BV"], k.dtype), USE_G=g_cum is not None, SPLIT_G=gk_cum is not None,
        HAS_GB=gb is not None, DELTA=delta,
        IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(k.dtype), ACC=acc_dtype(k.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        gv=gv_cum, dgv=dgam if gv_cum is not None else None, VEC_G=gv_cum is not None,
        hn=hn_sub, dhn=dhn_sub, N_STATE=n_state, dka=dk_add, kdk=kdk, ADD_DK=dk_add is not None, KDOT=kdot,
        DG=need_dg, sds=sds_sub, NVS=sds_sub.shape[3] if sds_sub is not None else 0,
        dwp=dw, pst=pst, sdst=sdst, BKK=max(bkk, 16) if bkk else 0, FLAT=flat,
    )
    return rets
