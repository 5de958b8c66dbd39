"""Reverse state-gradient recurrence of the level-1 stage (``chunk_state_bwd``) and the normalizer state's gradient;
notation and the forward recurrence in ``chunk_state.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.chunk_state import (_idx64, _row_split, _sequence_slots, _state_acc, _state_tile,
                                         _vec_decays, intra_supported)
from tfla.ops.common.grid import program_pair, tile_grid
from tfla.ops.common.state_bwd_ws import delta_state_bwd_ws, state_bwd_ws_supported
from tfla.ops.common.utils import ALL_CHUNKS, SUB_CHUNK, acc_dtype, cdiv, dot_precision, dot_tile

@triton.jit
def _rowscaled_qdot(b_q, b_x, b_sr, dt: tl.constexpr, ACC: tl.constexpr, DOT_PREC: tl.constexpr,
                    SPLIT: tl.constexpr = True):
    """``q^T diag(sr) x`` ([BK, BS] x [BS, C], ACC result) with the row factors kept unrounded: x sr
    split into bf16 hi + lo (about 16 mantissa bits) for bf16 inputs, two 16-bit tensor-core products
    with q as it is; an fp32 product otherwise (fp16 could underflow the split; fp32 keeps its
    precision). SPLIT off (bf16): x sr rounded to bf16, one product."""
    b_xs = b_x.to(ACC) * b_sr.to(ACC)[:, None]
    if dt == tl.bfloat16 and not SPLIT:
        b_r = tl.dot(tl.trans(b_q), b_xs.to(dt), input_precision=DOT_PREC, out_dtype=ACC)
    elif dt == tl.bfloat16:
        b_hi = b_xs.to(dt)
        b_lo = (b_xs - b_hi.to(ACC)).to(dt)
        b_r = tl.dot(tl.trans(b_q), b_hi, input_precision=DOT_PREC, out_dtype=ACC)
        b_r = tl.dot(tl.trans(b_q), b_lo, b_r, input_precision=DOT_PREC)
    else:
        b_r = tl.dot(tl.trans(b_q.to(ACC)), b_xs, input_precision=DOT_PREC)
    return b_r


@triton.jit
def _state_bwd_sub_chunk(q, k, w, do, dvo, g, du, dh, gk, gb, sds, rl, gv, scale, T, bos, boh, i_c, i_h, i_hv, i_v,
                         t0, o_c, o_k, o_v, m_k, m_v, m_kv, o_kv, b_dh, b_dhi,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, SPLIT_G: tl.constexpr,
                         HAS_GB: tl.constexpr, DELTA: tl.constexpr, DOT_PREC: tl.constexpr, ACC: tl.constexpr,
                         VEC_G: tl.constexpr, INTRA: tl.constexpr, SDS: tl.constexpr, QSPLIT: tl.constexpr,
                         ROWLOG: tl.constexpr, IDX64: tl.constexpr, STORE: tl.constexpr):
    """One 64-row sub-chunk of ``_chunk_state_bwd_kernel`` (rows ``[t0, t0 + 64)`` of outer chunk ``i_c``): returns
    the state gradient before it and the outer chunk's q-term accumulator ``b_dhi`` (BT > 64; else passed through)."""
    BS: tl.constexpr = 64
    dt = k.dtype.element_ty
    o_t = t0 + o_c
    m_t = o_t < T
    r0, o_r = _row_split(bos, t0, o_c, IDX64)
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    if SDS or STORE:
        p_dhs = dh + ((boh + t0 // BS) * HV + i_hv) * K * V + o_kv
    if SDS:  # S of this slot, read here and used below (its latency behind this step's loads and products)
        b_s = tl.load(p_dhs, mask=m_kv, other=0.0)
    elif STORE:
        tl.store(p_dhs, b_dh.to(dh.dtype.element_ty), mask=m_kv)
    b_k = tl.load(k + (r0 * H + i_h) * K + o_r[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
    b_q = tl.load(q + (r0 * H + i_h) * K + o_r[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
    p_tv = (r0 * HV + i_hv) * V + o_r[:, None] * (HV * V) + o_v[None, :]
    b_do = tl.load(do + p_tv, mask=m_tv, other=0.0)
    if USE_G:
        b_g = tl.load(g + r0 * HV + i_hv + o_r * HV, mask=m_t, other=0.0)
        if SPLIT_G:
            b_gkey = tl.load(gk + r0 * HV + i_hv + o_r * HV, mask=m_t, other=0.0)
        else:
            b_gkey = b_g
        if ROWLOG:  # dO's row factor 2^rl joins the gate of its (query) rows only
            b_g += tl.load(rl + r0 * HV + i_hv + o_r * HV, mask=m_t, other=0.0)
    if INTRA:  # dvo of this sub-chunk's diagonal tile: rows s (keys), columns r >= s (queries)
        b_a = tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PREC)  # [BS, BS]
        m_a = (o_c[:, None] <= o_c[None, :]) & m_t[:, None] & m_t[None, :]
        if USE_G:
            b_a *= tl.exp2(tl.where(m_a, b_g[None, :] - b_gkey[:, None], float("-inf")))
        else:
            b_a = tl.where(m_a, b_a, 0.0)
        b_du = tl.dot(b_a.to(dt), b_do, input_precision=DOT_PREC) * scale
    else:
        b_du = tl.load(dvo + p_tv, mask=m_tv, other=0.0).to(ACC)
    if VEC_G:  # per key row: K * 2^(GV_n - GV), Q * 2^GV, and dS's row decays 2^(GV_n - GV_c)
        b_wv, b_rd, b_wq = _vec_decays(gv, r0, o_r, i_hv, t0, T, bos, m_t, o_k, m_k, HV, K, BT, BS)
        b_k = (b_k * b_wv).to(dt)
        b_q = (b_q * b_wq).to(dt)
    b_kdh = tl.dot(b_k, b_dh.to(dt), input_precision=DOT_PREC)  # [BS, BV]
    if USE_G:
        b_gn = tl.load(g + (bos + tl.minimum(t0 + BS, T) - 1) * HV + i_hv)
        b_gc = tl.load(g + (bos + t0 - 1) * HV + i_hv, mask=(t0 % BT) != 0, other=0.0)
        b_du += b_kdh * tl.exp2(tl.where(m_t, b_gn - b_gkey, float("-inf")))[:, None]
        if HAS_GB:  # the outer chunk's start state is stabilized by gb at its first row
            b_gb = tl.load(gb + (bos + i_c * BT) * HV + i_hv)
            b_gc += tl.where((t0 % BT) == 0, b_gb, 0.0)
            b_sr = scale * tl.exp2(tl.where(m_t, b_g - b_gb, float("-inf")))
        else:
            b_sr = scale * tl.exp2(b_g)
    else:
        b_du += b_kdh
        b_sr = tl.full([BS], scale, dtype=tl.float32)
    if STORE:
        tl.store(du + p_tv, b_du.to(du.dtype.element_ty), mask=m_tv)
    # the output's q-term (scale 2^G q)^T dO with the row factor on dO's side ([BS, BV], not [BS, BK])
    b_qt = _rowscaled_qdot(b_q, b_do, b_sr, dt, ACC, DOT_PREC, QSPLIT)
    if BT > BS:
        b_dhi += b_qt
    if SDS:  # before b_dh changes: <S, dS> rows, then dS over S. Each stored element depends on its row's
        # sum, i.e. on every read of that row (a barrier there hit an illegal address in bf16 on the H100
        # under Triton 3.6). IEEE semantics keep the `+ 0.0 * sum` (no fast-math flags: it stays an fma with
        # 0 in the sm_90 PTX, Triton 3.9, checked locally)
        b_sdsr = tl.sum(b_s.to(ACC) * b_dh, 1)
        tl.store(sds + (((boh + t0 // BS) * HV + i_hv) * tl.cdiv(V, BV) + i_v) * K + o_k, b_sdsr, mask=m_k)
        tl.store(p_dhs, (b_dh + 0.0 * b_sdsr[:, None]).to(dh.dtype.element_ty), mask=m_kv)
    if USE_G:
        b_dh *= tl.exp2(b_gn - b_gc)
    if VEC_G:
        b_dh *= b_rd[:, None]
    if DELTA:
        b_w = tl.load(w + (r0 * HV + i_hv) * K + o_r[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.0)
        b_dh -= tl.dot(tl.trans(b_w), b_du.to(dt), input_precision=DOT_PREC)
    if BT == BS:  # one sub-chunk per chunk: no second accumulator (register pressure)
        b_dh += b_qt
    return b_dh, b_dhi


@triton.jit
def _linear_state_bwd(q, k, do, dvo, g, du, dh, dht, dh0, gk, gb, sds, rl, gv, cu_seqlens, sub_offsets, scale, T,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, SPLIT_G: tl.constexpr,
                      HAS_GB: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr,
                      STORE_INITIAL_STATE_GRADIENT: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
                      ACC: tl.constexpr, VEC_G: tl.constexpr, INTRA: tl.constexpr, SDS: tl.constexpr,
                      QSPLIT: tl.constexpr, ROWLOG: tl.constexpr, IDX64: tl.constexpr, FLAT: tl.constexpr,
                      seq_order, ORDERED: tl.constexpr):
    """Reverse state-gradient recurrence of linear attention (the delta rule's: ``_delta_state_bwd_kernel``, the same
    step helper with the W^T dU term). ``b_dh`` is the gradient of the state after the current sub-chunk; per
    sub-chunk (reverse): dU = dvo + 2^(G_n - G) (K dS) (the whole gradient of V), dS <- 2^(G_n - G_c) dS; at each
    outer-chunk start the output's use of the state adds scale (2^G Q)^T dO of the whole outer chunk. Stores dS at
    every sub-chunk (for the parallel gradient kernels) and dU. That product keeps the row factor scale 2^G
    unrounded on dO's side (``_rowscaled_qdot``): rounding 2^G q to bf16 made d initial_state 3-4x less accurate than FLA's (H100,
    bf16); the fp32 q tile that fixed it (a TF32 product) spilled registers (GDN on the H100: 0.49 -> 0.89 ms).

    The normalizer state's gradient (``chunk_state_bwd(dden=..)``) runs in its own launch
    (``_normalizer_state_bwd_kernel``).

    INTRA (BT = BS = 64, scalar or no gate): the output's intra-chunk gradient of Vnew,
    ``dvo_s = scale sum_{r >= s} (k_s . q_r) 2^(GQ_r - GK_s) dO_r`` over the sub-chunk, is formed here from
    the q, k and dO tiles this step loads anyway (two products) instead of read from ``dvo``: at L = 64
    it is one diagonal tile, so its separate tiled launch and the fp32 round trip of dvo go away.

    SDS (linear attention): ``dh`` holds the states S at every sub-chunk on entry (the forward recompute's
    ``h_sub``) and each dS overwrites the S of its own slot, after this program has read it for the rows of
    ``<S, dS>`` over its value tile (``sds [B, NS, HV, NV, K]`` fp32): the state-terms kernel then reads
    neither S nor a second ``[B, NS, HV, K, V]`` buffer (peak memory: one such buffer less)."""
    BS: tl.constexpr = 64
    i_v, i_nh, i_h, i_hv, bos, T, boh, o_k, o_v, m_k, m_v, m_kv, o_kv = _state_tile(
        cu_seqlens, sub_offsets, T, H, HV, K, V, BK, BV, BS, IS_VARLEN, FLAT, seq_order, ORDERED)
    o_c = tl.arange(0, BS)

    b_dh = tl.zeros([BK, BV], dtype=ACC)
    if USE_FINAL_STATE_GRADIENT:
        b_dh += tl.load(dht + i_nh * K * V + o_kv, mask=m_kv, other=0.0).to(ACC)
    if BT == BS:  # one loop over the 64-row chunks, last first: Triton pipelines the innermost loop, so the nested
        # form below (an inner loop of one sub-chunk per chunk at BT = 64) issued each step's loads at its own start
        NSUB = tl.cdiv(T, BS)
        for i_sr in range(0, NSUB):
            i_c = NSUB - 1 - i_sr
            b_dh, _ = _state_bwd_sub_chunk(
                q, k, None, do, dvo, g, du, dh, gk, gb, sds, rl, gv, scale, T, bos, boh, i_c, i_h, i_hv, i_v,
                i_c * BS, o_c, o_k, o_v, m_k, m_v, m_kv, o_kv, b_dh, b_dh, H, HV, K, V, BT, BK, BV, USE_G, SPLIT_G,
                HAS_GB, False, DOT_PREC, ACC, VEC_G, INTRA, SDS, QSPLIT, ROWLOG, IDX64, True)
    else:
        NT = tl.cdiv(T, BT)
        for i_cr in range(0, NT):
            i_c = NT - 1 - i_cr
            b_dhi = tl.zeros([BK, BV], dtype=ACC)  # the output's use of this chunk's start state, added at its end
            NS = tl.minimum(BT // BS, tl.cdiv(T - i_c * BT, BS))
            for i_jr in range(0, NS):
                t0 = i_c * BT + (NS - 1 - i_jr) * BS
                b_dh, b_dhi = _state_bwd_sub_chunk(
                    q, k, None, do, dvo, g, du, dh, gk, gb, sds, rl, gv, scale, T, bos, boh, i_c, i_h, i_hv, i_v, t0,
                    o_c, o_k, o_v, m_k, m_v, m_kv, o_kv, b_dh, b_dhi, H, HV, K, V, BT, BK, BV, USE_G, SPLIT_G,
                    HAS_GB, False, DOT_PREC, ACC, VEC_G, INTRA, SDS, QSPLIT, ROWLOG, IDX64, True)
            b_dh += b_dhi
    if STORE_INITIAL_STATE_GRADIENT:
        tl.store(dh0 + i_nh * K * V + o_kv, b_dh, mask=m_kv)


@triton.jit
def _chunk_state_bwd_kernel(q, k, do, dvo, g, du, dh, dht, dh0, gk, gb, sds, rl, cu_seqlens, sub_offsets, scale, T,
                            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, SPLIT_G: tl.constexpr,
                            HAS_GB: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr,
                            STORE_INITIAL_STATE_GRADIENT: tl.constexpr, IS_VARLEN: tl.constexpr,
                            DOT_PREC: tl.constexpr, ACC: tl.constexpr, INTRA: tl.constexpr, SDS: tl.constexpr,
                            QSPLIT: tl.constexpr, ROWLOG: tl.constexpr, IDX64: tl.constexpr = False,
                            FLAT: tl.constexpr = False, seq_order=None, ORDERED: tl.constexpr = False):
    """``_linear_state_bwd`` with a scalar gate, split gates (``gk``, ``gb``: the mLSTM) or none: simple GLA,
    linear attention and the mLSTM."""
    _linear_state_bwd(q, k, do, dvo, g, du, dh, dht, dh0, gk, gb, sds, rl, None, cu_seqlens, sub_offsets, scale, T,
                      H, HV, K, V, BT, BK, BV, USE_G, SPLIT_G, HAS_GB, USE_FINAL_STATE_GRADIENT,
                      STORE_INITIAL_STATE_GRADIENT, IS_VARLEN, DOT_PREC, ACC, False, INTRA, SDS, QSPLIT, ROWLOG,
                      IDX64, FLAT, seq_order, ORDERED)


@triton.jit
def _vec_state_bwd_kernel(q, k, do, dvo, du, dh, dht, dh0, gv, sds, cu_seqlens, sub_offsets, scale, T,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr,
                          STORE_INITIAL_STATE_GRADIENT: tl.constexpr, IS_VARLEN: tl.constexpr,
                          DOT_PREC: tl.constexpr, ACC: tl.constexpr, SDS: tl.constexpr, QSPLIT: tl.constexpr,
                          IDX64: tl.constexpr = False, FLAT: tl.constexpr = False, seq_order=None,
                          ORDERED: tl.constexpr = False):
    """``_linear_state_bwd`` with a vector gate ``gv [B, T, HV, K]`` (GLA; dvo from its own launch)."""
    _linear_state_bwd(q, k, do, dvo, None, du, dh, dht, dh0, None, None, sds, None, gv, cu_seqlens, sub_offsets, scale,
                      T, H, HV, K, V, BT, BK, BV, False, False, False, USE_FINAL_STATE_GRADIENT,
                      STORE_INITIAL_STATE_GRADIENT, IS_VARLEN, DOT_PREC, ACC, True, False, SDS, QSPLIT, False,
                      IDX64, FLAT, seq_order, ORDERED)


@triton.jit
def _delta_state_bwd_kernel(q, k, w, do, g, du, dh, dht, dh0, cu_seqlens, sub_offsets, scale, T, H: tl.constexpr,
                            HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            USE_G: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr,
                            STORE_INITIAL_STATE_GRADIENT: tl.constexpr, IS_VARLEN: tl.constexpr,
                            DOT_PREC: tl.constexpr, ACC: tl.constexpr, QSPLIT: tl.constexpr = True,
                            IDX64: tl.constexpr = False, FLAT: tl.constexpr = False, STORE: tl.constexpr = True,
                            seq_order=None, ORDERED: tl.constexpr = False, keep=None):
    """The delta rule's reverse state-gradient recurrence (the step helper shared with ``_chunk_state_bwd_kernel``,
    with its W^T dU term; 64-row chunks, a scalar gate or none): per chunk, last first, dU = dvo + 2^(G_n - G) (K dS)
    with the output's intra-chunk gradient of Vnew ``dvo`` formed from this step's q, k and dO tiles, and
    dS <- 2^(G_n) dS - W^T dU + scale (2^G q)^T dO. Stores dS at every chunk and dU (STORE; off: only the initial
    state's gradient, a segment's summary, over its first ``keep[i_nh]`` chunks: ``fused_delta_fwd.piece_cutoffs``).
    One loop over the chunks: Triton pipelines the innermost loop, so step
    i + 1's loads are issued during step i (a nested loop of one sub-chunk per chunk waited for its own loads)."""
    BS: tl.constexpr = 64
    i_v, i_nh, i_h, i_hv, bos, T, boh, o_k, o_v, m_k, m_v, m_kv, o_kv = _state_tile(
        cu_seqlens, sub_offsets, T, H, HV, K, V, BK, BV, BS, IS_VARLEN, FLAT, seq_order, ORDERED)
    o_c = tl.arange(0, BS)
    if not STORE:  # the chunks that reach the piece's start above e^-80
        T = tl.minimum(T, tl.load(keep + i_nh) * BS)
    b_dh = tl.zeros([BK, BV], dtype=ACC)
    if USE_FINAL_STATE_GRADIENT:
        b_dh += tl.load(dht + i_nh * K * V + o_kv, mask=m_kv, other=0.0).to(ACC)
    NSUB = tl.cdiv(T, BS)
    for i_sr in range(0, NSUB):
        i_c = NSUB - 1 - i_sr
        b_dh, _ = _state_bwd_sub_chunk(
            q, k, w, do, None, g, du, dh, None, None, None, None, None, scale, T, bos, boh, i_c, i_h, i_hv, i_v,
            i_c * BS, o_c, o_k, o_v, m_k, m_v, m_kv, o_kv, b_dh, b_dh, H, HV, K, V, BS, BK, BV, USE_G, False, False,
            True, DOT_PREC, ACC, False, True, False, QSPLIT, False, IDX64, STORE)
    if STORE_INITIAL_STATE_GRADIENT:
        tl.store(dh0 + i_nh * K * V + o_kv, b_dh, mask=m_kv)


@triton.jit
def _normalizer_state_bwd_kernel(q, g, gb, dden, dnt, dhn, dn0, cu_seqlens, sub_offsets, scale, T,
                                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                                 BK: tl.constexpr, USE_G: tl.constexpr, HAS_GB: tl.constexpr, USE_DNT: tl.constexpr,
                                 STORE_DN0: tl.constexpr, IS_VARLEN: tl.constexpr, ACC: tl.constexpr,
                                 IDX64: tl.constexpr = False, FLAT: tl.constexpr = False):
    """Reverse recurrence of the normalizer state's gradient dn (n is the state of v = 1, ``[K]`` per head; the
    mLSTM's normalizer), one key tile per program: per sub-chunk (reverse) ``dhn`` gets dn (the gradient of n
    after the sub-chunk), then ``dn <- 2^(G_n - G_c) dn`` and, at each outer-chunk start, ``+ scale sum_r
    2^(G_r) dden_r q_r`` over the outer chunk (``2^(G_r - gb)`` with split gates). The row sums do not depend
    on dn, so only one multiply-add per sub-chunk is sequential. It ran as a ``[BK, 16]`` column beside dS in
    the state-gradient recurrence before, which cost that kernel ~0.7 ms at the mLSTM's B = 8, T = 8192, H = 16,
    K = 128, V = 256 (H100: 3.25 vs 2.62 ms without it; docs/performance.md)."""
    BS: tl.constexpr = 64
    i_k, i_nh = program_pair((K + BK - 1) // BK, FLAT)  # (key tile, sequence x head): 2-D or flat grid
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, T, boh = _sequence_slots(cu_seqlens, sub_offsets, i_n, T, BS, IS_VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_c = tl.arange(0, BS)
    m_k = o_k < K
    b_dn = tl.zeros([BK], dtype=ACC)
    if USE_DNT:
        b_dn += tl.load(dnt + i_nh * K + o_k, mask=m_k, other=0.0).to(ACC)
    NT = tl.cdiv(T, BT)
    for i_cr in range(0, NT):
        i_c = NT - 1 - i_cr
        b_dni = tl.zeros([BK], dtype=ACC)  # the q-terms of this outer chunk's start state
        NS = tl.minimum(BT // BS, tl.cdiv(T - i_c * BT, BS))
        for i_jr in range(0, NS):
            t0 = i_c * BT + (NS - 1 - i_jr) * BS
            o_t = t0 + o_c
            m_t = o_t < T
            r0, o_r = _row_split(bos, t0, o_c, IDX64)
            tl.store(dhn + ((boh + t0 // BS) * HV + i_hv) * K + o_k, b_dn, mask=m_k)
            b_q = tl.load(q + (r0 * H + i_h) * K + o_r[:, None] * (H * K) + o_k[None, :],
                          mask=m_t[:, None] & m_k[None, :], other=0.0).to(ACC)
            b_dd = tl.load(dden + r0 * HV + i_hv + o_r * HV, mask=m_t, other=0.0).to(ACC)
            if USE_G:
                b_g = tl.load(g + r0 * HV + i_hv + o_r * HV, mask=m_t, other=0.0)
                b_gn = tl.load(g + (bos + tl.minimum(t0 + BS, T) - 1) * HV + i_hv)
                b_gc = tl.load(g + (bos + t0 - 1) * HV + i_hv, mask=(t0 % BT) != 0, other=0.0)
                if HAS_GB:  # the outer chunk's start state is stabilized by gb at its first row
                    b_gb = tl.load(gb + (bos + i_c * BT) * HV + i_hv)
                    b_gc += tl.where((t0 % BT) == 0, b_gb, 0.0)
                    b_sr = scale * tl.exp2(tl.where(m_t, b_g - b_gb, float("-inf")))
                else:
                    b_sr = scale * tl.exp2(tl.where(m_t, b_g, float("-inf")))
                b_dn *= tl.exp2(b_gn - b_gc)
            else:
                b_sr = tl.where(m_t, scale, 0.0)
            b_dni += tl.sum(b_q * (b_sr * b_dd)[:, None], 0)
        b_dn += b_dni
    if STORE_DN0:
        tl.store(dn0 + i_nh * K + o_k, b_dn, mask=m_k)




def chunk_state_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor | None,
    do: torch.Tensor,
    dvo: torch.Tensor | None,
    g_cum: torch.Tensor | None,
    scale: float,
    chunk_size: int,
    dht: torch.Tensor | None = None,
    need_dh0: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    sub_offsets: torch.Tensor | None = None,
    num_sub_chunks: int | None = None,
    config: dict | None = None,
    gk_cum: torch.Tensor | None = None,
    gb: torch.Tensor | None = None,
    gv_cum: torch.Tensor | None = None,
    dden: torch.Tensor | None = None,
    dnt: torch.Tensor | None = None,
    h_sub: torch.Tensor | None = None,
    sds: bool = False,
    do_row_log2: torch.Tensor | None = None,
    store: bool = True,
    ai: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    seq_order: torch.Tensor | None = None,
    summary_chunks: torch.Tensor | None = None,
):
    """State-gradient recurrence of the gated delta rule (reverse, 64-row sub-chunks, outer chunk L).

    Args:
        q, k: ``[B, T, H, K]``; w: ``[B, T, HV, K]`` WY keys (None: linear attention); do: ``[B, T, HV, V]``; dvo: the output's
            gradient of Vnew, ``[B, T, HV, V]``, or None to form it in the kernel (``intra_supported``:
            ``chunk_size`` 64, scalar or no gate); g_cum: ``[B, T, HV]`` (log2, restarting every L).
        dht: cotangent of the final state ``[N, HV, K, V]`` or None.
        gk_cum, gb: split gates (as ``chunk_state_fwd``).
        gv_cum: vector gate ``[B, T, HV, K]`` (as ``chunk_state_fwd``; linear attention, g_cum None).
        dden: ``[B, T, HV]`` fp32, the cotangent of the normalizer's dot (``chunk_state_fwd(n_state=True)``):
            also run the normalizer state's gradient (linear attention only); dnt ``[N, HV, K]`` its final
            cotangent or None.
        h_sub: the states at every sub-chunk ``[B, NS, HV, K, V]`` (``chunk_state_fwd(store_every_sub_chunk=True)``,
            k's dtype) or None; given, dh is written into it (S is overwritten; read what needs S first), and
            with ``sds`` (linear attention) the rows of ``<S, dS>`` are returned last: ``[B, NS, HV, NV, K]`` fp32,
            one partial per value tile (for ``wy_bwd(sds_sub=..)``), or None where that path is not used (16-bit
            inputs on a one-stage launch: Triton 3.6 faults there on the H100); dh is then a new buffer and
            h_sub keeps S.
        do_row_log2: ``[B, T, HV]`` (g_cum's dtype) or None: the output's cotangent is ``do * 2^do_row_log2`` per
            row, applied through the query rows' gate (needs ``g_cum`` and dvo None: formed here).
        store: False writes neither dh nor du (returned as None): the recurrence runs for ``dh0`` alone (a
            segment's state-gradient summary, ``need_dh0`` True); not with ``dden``, ``sds`` or ``h_sub``.
        ai, beta: Tm ``[B, T, HV, 64]`` and beta ``[B, T, HV]`` (the delta rule, both or neither): the recurrence
            runs on the warp-specialized Gluon kernel (``state_bwd_ws.py``) from them, without W, where
            ``state_bwd_ws.state_bwd_ws_supported`` holds and ``config`` does not set ``ws`` False; elsewhere the
            ``tl`` kernel runs from w, which must then be given.
        config: launch keys of the ``tl`` kernels (``BV``, ``num_warps``, ``num_stages``, ``qsplit``, ``flat``,
            ``idx64``, ``n_bk``, ``n_warps``, ``n_stages``) and ``ws``: True (default: the Gluon kernel where it
            applies, above), False (the ``tl`` kernel always) or a dict of that kernel's keys
            (``STATE_BWD_WS_DEFAULTS``).
        seq_order: ``[N]`` int32, the order in which the programs take the sequences of ``cu_seqlens`` offsets
            (``varlen.longest_first_order``: the longest chains start first; the normalizer state's launch ignores it)
            or None (in order).
        summary_chunks: with ``store`` False, ``[N HV]`` int32: the 64-row chunks to run from each (sequence, value
            head)'s start (``fused_delta_fwd.piece_cutoffs``: later ones reach the start below e^-80), None: all.
    Returns:
        ``dh [B, NS, HV, K, V]`` (gradient of the state after each 64-row sub-chunk, k's dtype),
        ``du [B, T, HV, V]`` (total gradient of U = Vnew's gradient, k's dtype), ``dh0 [N, HV, K, V]``
        fp32 or None; with ``dden`` two more: ``dhn [B, NS, HV, K]`` fp32 (the normalizer state's
        gradient after each sub-chunk) and ``dn0 [N, HV, K]`` fp32 or None.
    """
    B, T, H, K = k.shape
    HV, V = do.shape[2], do.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    NS = cdiv(T, SUB_CHUNK) if cu_seqlens is None else num_sub_chunks
    if (ai is None) != (beta is None):
        raise ValueError("ai (Tm) and beta come together (the delta rule's recurrence from Tm)")
    delta = w is not None or ai is not None
    if delta and not (dvo is None and chunk_size == SUB_CHUNK and gk_cum is None and gb is None
                      and gv_cum is None and dden is None and do_row_log2 is None):
        raise ValueError("the delta rule's state gradient (w given) runs at 64-row chunks with dvo=None (formed in the "
                         "kernel) and a scalar gate or none: no gk_cum, gb, gv_cum, dden or do_row_log2")
    if not store and (not delta or not need_dh0 or sds or h_sub is not None):
        raise ValueError("store=False (the delta rule's segment summary) runs the recurrence for dh0 alone: needs w "
                         "and need_dh0, no sds or h_sub")
    if sds and (h_sub is None or delta):
        raise ValueError("sds (the rows of <S, dS>) needs h_sub and serves linear attention (w None)")
    # the delta rule on Hopper: the warp-specialized Gluon kernel (state_bwd_ws.py), from Tm and beta, where it
    # applies; config key "ws": True (default), False (the tl kernel always) or a dict of that kernel's launch keys
    ws = (config or {}).get("ws", True)
    if ai is not None and ws is not False and h_sub is None and state_bwd_ws_supported(
            q, k, ai, beta, do, g_cum, dht, cu_seqlens, ws if isinstance(ws, dict) else None):
        return delta_state_bwd_ws(q, k, ai, beta, do, g_cum, scale, dht, need_dh0, cu_seqlens, sub_offsets,
                                  num_sub_chunks, store, ws if isinstance(ws, dict) else None, seq_order=seq_order,
                                  summary_chunks=summary_chunks)
    if ai is not None and w is None:
        raise ValueError("w is needed where the Gluon recurrence from Tm does not run (state_bwd_ws_supported)")
    # measured (docs/performance.md): the delta rule at K <= 128 runs best on 64-column value tiles with 8 warps
    # (H100: 0.53 vs 0.73 ms at 32 columns / 4 warps); linear attention keeps 32 columns and 4 warps (H100:
    # simple GLA 0.53 ms, other tiles 0.51-0.59; the mLSTM's V = 256 state backward 2.41 ms, others 2.50-3.95).
    # 16-bit inputs pipeline two stages at any K: one stage (the K > 128 default before) hit an illegal address
    # on the H100 under Triton 3.6 (bf16, K = 256: simple GLA; GDN / mLSTM at K = 256 run with two)
    # The delta rule's wide tiles at 64-row chunks (one flat loop) prefetch three stages: H100 fwd + bwd MVE 2.92 ->
    # 2.77 ms, long sequence 7.60 -> 7.14 (2026-11-24, 62b3092; sm_90 Triton 3.6: 198 KB shared memory, no spills)
    wide = w is not None and K <= 128 and k.element_size() == 2  # 16-bit only: fp32 tiles double the smem
    stages = (3 if wide and chunk_size == 64 else 2) if (K <= 128 or k.element_size() == 2) and gv_cum is None else 1
    cfg = {"BV": 64 if wide else 32, "num_warps": 8 if wide else 4, "num_stages": stages,
           **{n: x for n, x in (config or {}).items() if n != "ws"}}
    BK = dot_tile(K, 1 << 20, k.dtype)
    BV = dot_tile(V, cfg["BV"], k.dtype)
    # 16-bit inputs read S in this kernel only on pipelined launches (a config override to one stage keeps dS
    # apart: that launch faults under Triton 3.6 on the H100, 2026-11-23; fine under 3.9)
    sds_on = sds and (k.element_size() > 2 or cfg["num_stages"] >= 2)
    if h_sub is not None and (sds_on or not sds):
        if tuple(h_sub.shape) != (B, NS, HV, K, V) or h_sub.dtype != k.dtype or not h_sub.is_contiguous():
            raise ValueError(f"h_sub must be a contiguous {(B, NS, HV, K, V)} tensor of k's dtype")
        dh = h_sub  # in place: each slot's S is read (SDS) before its dS is stored
    elif store:
        dh = torch.empty(B, NS, HV, K, V, dtype=k.dtype, device=k.device)
    else:
        dh = None
    du = torch.empty(B, T, HV, V, dtype=k.dtype, device=k.device) if store else None
    dh0 = torch.empty(N, HV, K, V, dtype=_state_acc(k.dtype), device=k.device) if need_dh0 else None
    n_state = dden is not None
    intra = dvo is None
    if gv_cum is not None and (g_cum is not None or gk_cum is not None or gb is not None or do_row_log2 is not None):
        raise ValueError("gv_cum (a vector gate) runs alone: no g_cum, gk_cum, gb or do_row_log2 with it")
    if intra and not intra_supported(chunk_size, gv_cum):
        raise ValueError("dvo=None (formed in the kernel) needs chunk_size 64 and no vector gate")
    if do_row_log2 is not None and (not intra or g_cum is None
                                    or tuple(do_row_log2.shape) != (B, T, HV) or not do_row_log2.is_contiguous()):
        raise ValueError("do_row_log2 must be a contiguous [B, T, HV] tensor and needs g_cum and dvo=None")
    if n_state and (w is not None or gv_cum is not None):
        raise ValueError("the normalizer state's gradient (dden) serves linear attention with scalar gates")
    dhn = torch.empty(B, NS, HV, K, dtype=_state_acc(k.dtype), device=k.device) if n_state else None
    dn0 = torch.empty(N, HV, K, dtype=_state_acc(k.dtype), device=k.device) if n_state and need_dh0 else None
    sds_t = torch.empty(B, NS, HV, cdiv(V, BV), K, dtype=_state_acc(k.dtype), device=k.device) if sds_on else None
    rets = (dh, du, dh0) + ((dhn, dn0) if n_state else ()) + ((sds_t,) if sds else ())
    if N * HV == 0:
        if sds_t is not None:
            sds_t.zero_()
        if dh0 is not None:
            dh0.copy_(dht if dht is not None else torch.zeros_like(dh0))
        if dn0 is not None:
            dn0.copy_(dnt if dnt is not None else torch.zeros_like(dn0))
        return rets
    grid, flat = tile_grid(cdiv(V, BV), N * HV, force_flat=cfg.get("flat", False))
    idx64 = cfg.get("idx64", False) or _idx64(T, H, HV, K, V)
    if w is not None:  # the delta rule (GDN): its own kernel
        if not store and summary_chunks is None:
            summary_chunks = torch.full((N * HV,), ALL_CHUNKS, dtype=torch.int32, device=k.device)
        _delta_state_bwd_kernel[grid](
            q, k, w, do, g_cum, du, dh, dht, dh0, cu_seqlens, sub_offsets, scale, T, H=H, HV=HV, K=K, V=V, BK=BK,
            BV=BV, USE_G=g_cum is not None, USE_FINAL_STATE_GRADIENT=dht is not None,
            STORE_INITIAL_STATE_GRADIENT=need_dh0, IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(k.dtype),
            ACC=acc_dtype(k.dtype), QSPLIT=cfg.get("qsplit", True), IDX64=idx64, FLAT=flat, STORE=store,
            seq_order=seq_order, ORDERED=seq_order is not None, keep=None if store else summary_chunks,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    else:
        common = dict(H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=BK, BV=BV, USE_FINAL_STATE_GRADIENT=dht is not None,
                      STORE_INITIAL_STATE_GRADIENT=need_dh0, IS_VARLEN=cu_seqlens is not None,
                      DOT_PREC=dot_precision(k.dtype), ACC=acc_dtype(k.dtype), SDS=sds_on,
                      QSPLIT=cfg.get("qsplit", True), IDX64=idx64, FLAT=flat, seq_order=seq_order,
                      ORDERED=seq_order is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        if gv_cum is not None:  # GLA's vector gate (no scalar or split gate with it; dvo given)
            _vec_state_bwd_kernel[grid](q, k, do, dvo, du, dh, dht, dh0, gv_cum, sds_t, cu_seqlens, sub_offsets, scale,
                                        T, **common)
        else:
            _chunk_state_bwd_kernel[grid](
                q, k, do, dvo, g_cum, du, dh, dht, dh0, gk_cum, gb, sds_t, do_row_log2, cu_seqlens, sub_offsets,
                scale, T, USE_G=g_cum is not None, SPLIT_G=gk_cum is not None, HAS_GB=gb is not None, INTRA=intra,
                ROWLOG=do_row_log2 is not None, **common)
    if n_state:
        # its own launch config (config keys n_bk, n_warps, n_stages; H100, B=8 T=8192 H=16 K=128, scripts/tune.py:
        # 32-wide key tiles on one warp ~0.15 ms, two warps 0.21, 16 / 64-wide 0.16-0.28, stages no matter)
        BKN = min(cfg.get("n_bk", 32), BK)
        grid, flat = tile_grid(cdiv(K, BKN), N * HV, force_flat=cfg.get("flat", False))
        _normalizer_state_bwd_kernel[grid](
            q, g_cum, gb, dden, dnt, dhn, dn0, cu_seqlens, sub_offsets, scale, T, H=H, HV=HV, K=K, BT=chunk_size,
            BK=BKN, USE_G=g_cum is not None, HAS_GB=gb is not None, USE_DNT=dnt is not None, STORE_DN0=need_dh0,
            IS_VARLEN=cu_seqlens is not None, ACC=acc_dtype(k.dtype), IDX64=idx64, FLAT=flat,
            num_warps=cfg.get("n_warps", 1),
            num_stages=cfg.get("n_stages", 3))
    return rets
