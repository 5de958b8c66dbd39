"""The delta rule's L = 64 backward after the state-gradient recurrence, in one launch: dq, dk's tiled and
state parts, dW and the state parts of the gate gradient, from one read of S and dS per 64-row chunk.

Notation: B batch, T time, H key heads, HV value heads, K/V head dims, N sequences, 64-row chunks (L = 64: the
chunk is the UT/WY sub-chunk), BK key tile (the grid's first axis), BV value tile (the loop). Per chunk with start
state S, gradient dS of the state after it, G its cumulative gate (log2, restarting every 64 rows), n its last
row, scores ``P_rs = (dO_r . Vnew_s) 2^(G_r - G_s)`` for s < r (the r = s terms are kept apart):

    dq_r  = scale (2^G_r dO_r S^T + sum_s P_rs k_s + (dO_r . Vnew_r) k_r)
    dk_s  = scale (sum_r P_rs q_r + (dO_s . Vnew_s) q_s) + 2^(G_n - G_s) Vnew_s dS^T
    dW    = -dU S^T                                         (Vnew = U - W S; dU the recurrence's gradient of Vnew)

and for the gate gradient, per row: ``q . dq - k . dk`` of the tiled product without the r = s terms (they
cancel exactly), ``k_s . (2^(G_n - G_s) Vnew_s dS^T)`` and per chunk ``<S, dS>``.

This is FLA's ``chunk_bwd_dqkwg`` division of work (key tiles in the grid, value tiles looped, the scores formed
again per key tile) applied to tfla's pipeline: ``wy_bwd(dw=..)`` then reads dW, the row dots and ``<S, dS>``
instead of S and dS (twice each, with dU four times, before). It replaced the same terms added to the dual tiled
launch (one program per chunk over all of K: 255 registers at 8 warps, slower; docs/performance.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.chunk_state import _sequence_slots, _tile_of
from tfla.ops.common.grid import check_varlen_batch, program_tile, tile_grid
from tfla.ops.common.utils import SUB_CHUNK, acc_dtype, cdiv, dot_precision, dot_tile


@triton.jit
def _gdn_dqkw_kernel(
    q,
    k,
    v_new,
    do,
    du,
    h,
    dh,
    g,
    dq,
    dk,
    dw,
    dgd,
    pst,
    sds,
    cu_seqlens,
    tile_indices,
    sub_offsets,
    scale,
    T,
    s_part,
    s_slot,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_G: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    ACC: tl.constexpr,
    FLAT: tl.constexpr = False,
):
    """One (key tile, 64-row chunk, batch x value head) program. Partial row dots per key tile go to
    ``dgd [NK, B, T, HV]`` (q . dq - k . dk of the tiled product, r = s terms out), ``pst [NK, B, T, HV]``
    (k . dk_state) and ``sds [NK, NS_total, HV]`` (<S, dS> over this key tile's rows), at strides ``s_part`` and
    ``s_slot`` per key tile; the host sums the NK parts."""
    BS: tl.constexpr = 64
    i_k, i_t, i_bh = program_tile(T, (K + BK - 1) // BK, BS, HV, IS_VARLEN, FLAT)  # 3-D or flat grid (grid.py)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t = _tile_of(tile_indices, i_t, i_b, IS_VARLEN)
    bos, T, boh = _sequence_slots(cu_seqlens, sub_offsets, i_n, T, BS, IS_VARLEN)
    t0 = i_t * BS
    o_c = tl.arange(0, BS)
    o_t = t0 + o_c
    m_t = o_t < T
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    dt = k.dtype.element_ty
    slot = (boh + i_t) * HV + i_hv  # this chunk's state slot (states every 64 rows)
    p_h = h + slot * K * V
    p_dh = dh + slot * K * V

    b_s = tl.zeros([BS, BS], dtype=ACC)  # dO Vnew^T
    b_dq = tl.zeros([BS, BK], dtype=ACC)  # dO S^T
    b_dw = tl.zeros([BS, BK], dtype=ACC)  # dU S^T
    b_dks = tl.zeros([BS, BK], dtype=ACC)  # Vnew dS^T
    b_sds = tl.zeros([BK], dtype=ACC)  # rows of <S, dS>
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        p_tv = (bos * HV + i_hv) * V + o_t[:, None] * (HV * V) + o_v[None, :]
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.0)  # [BS, BV]
        b_vn = tl.load(v_new + p_tv, mask=m_tv, other=0.0)
        b_du = tl.load(du + p_tv, mask=m_tv, other=0.0)
        b_h = tl.load(p_h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)  # [BK, BV]: S
        b_dh = tl.load(p_dh + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)  # dS
        b_s = tl.dot(b_do, tl.trans(b_vn), b_s, input_precision=DOT_PREC)
        b_dq = tl.dot(b_do, tl.trans(b_h), b_dq, input_precision=DOT_PREC)
        b_dw = tl.dot(b_du, tl.trans(b_h), b_dw, input_precision=DOT_PREC)
        b_dks = tl.dot(b_vn, tl.trans(b_dh), b_dks, input_precision=DOT_PREC)
        b_sds += tl.sum(b_h.to(ACC) * b_dh.to(ACC), 1)

    m_ss = m_t[:, None] & m_t[None, :]
    b_sd = tl.sum(tl.where((o_c[:, None] == o_c[None, :]) & m_ss, b_s, 0.0), 1)  # dO_r . Vnew_r
    m_lo = (o_c[:, None] > o_c[None, :]) & m_ss
    if USE_G:
        p_g = g + bos * HV + i_hv
        b_g = tl.load(p_g + o_t * HV, mask=m_t, other=0.0)
        b_gn = tl.load(p_g + (tl.minimum(t0 + BS, T) - 1) * HV)
        b_p = b_s * tl.exp2(tl.where(m_lo, b_g[:, None] - b_g[None, :], float("-inf")))
        b_dq *= tl.exp2(tl.where(m_t, b_g, float("-inf")))[:, None]
        b_dks *= tl.exp2(tl.where(m_t, b_gn - b_g, float("-inf")))[:, None]
    else:
        b_p = tl.where(m_lo, b_s, 0.0)
    b_pb = b_p.to(dt)
    p_qk = (bos * H + i_h) * K + o_t[:, None] * (H * K) + o_k[None, :]
    b_k = tl.load(k + p_qk, mask=m_tk, other=0.0)  # [BS, BK]
    b_q = tl.load(q + p_qk, mask=m_tk, other=0.0)
    p_tk = (bos * HV + i_hv) * K + o_t[:, None] * (HV * K) + o_k[None, :]
    tl.store(dw + p_tk, (-b_dw).to(dw.dtype.element_ty), mask=m_tk)
    b_kf = b_k.to(ACC)
    b_qf = b_q.to(ACC)
    # dq: state term + tiled part; the gate gradient's rows q . dq - k . dk: the state term's q . dq_state, and the
    # tiled part as sum_s P_rs (q_r . k_s) - sum_r P_rs (q_r . k_s) from the fp32 scores P and the fp32 q k^T of
    # this key tile (as FLA's chunk_bwd_dqkwg forms it), not from dq / dk, whose P went through the input dtype (with
    # Qwen3-Next-style gates that rounding put tfla's bf16 dg above FLA's and FlashQLA's; the r = s terms cancel)
    b_dg = tl.sum(b_qf * b_dq, 1) * scale
    b_pa = b_p * tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)  # [BS, BS], strictly lower
    b_dg += (tl.sum(b_pa, 1) - tl.sum(b_pa, 0)) * scale
    b_dq = tl.dot(b_pb, b_k, b_dq, input_precision=DOT_PREC) * scale
    b_dq += (scale * b_sd)[:, None] * b_kf
    tl.store(dq + p_tk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    # dk: the tiled part (rows s, the transposed scores), the r = s terms, the state term
    b_dki = tl.dot(tl.trans(b_pb), b_q, input_precision=DOT_PREC) * scale
    b_dki += (scale * b_sd)[:, None] * b_qf + b_dks
    tl.store(dk + p_tk, b_dki.to(dk.dtype.element_ty), mask=m_tk)
    p_row = i_k * s_part + (bos + o_t) * HV + i_hv
    tl.store(dgd + p_row, b_dg, mask=m_t)
    tl.store(pst + p_row, tl.sum(b_kf * b_dks, 1), mask=m_t)
    tl.store(sds + i_k * s_slot + slot, tl.sum(b_sds, 0))




def chunk_dqkw_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v_new: torch.Tensor,
    do: torch.Tensor,
    du: torch.Tensor,
    h_sub: torch.Tensor,
    dh_sub: torch.Tensor,
    g_cum: torch.Tensor | None,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    tile_indices: torch.Tensor | None = None,
    sub_offsets: torch.Tensor | None = None,
    dq_dtype: torch.dtype | None = None,
    dk_dtype: torch.dtype | None = None,
    dw: torch.Tensor | None = None,
    config: dict | None = None,
):
    """dq, dk, dW and the state parts of the gate gradient of the gated delta rule at L = 64 (module docstring).

    Args:
        q, k: ``[B, T, H, K]``; v_new, do, du: ``[B, T, HV, V]`` (du: the state-gradient recurrence's gradient of
            Vnew, ``chunk_state_bwd``); h_sub / dh_sub: the state at / the state gradient after every 64-row chunk,
            ``[B, NS, HV, K, V]`` (``[1, NS_total, HV, K, V]`` varlen); g_cum: ``[B, T, HV]`` log2 cumulative gate
            restarting every 64 rows, or None (no gate).
        cu_seqlens, tile_indices, sub_offsets: varlen (``B == 1``): the (sequence, 64-row chunk) table and the first
            chunk of each sequence.
        dq_dtype / dk_dtype: of dq and dk (default q's dtype); dw: ``[B, T, HV, K]`` to write dW into (e.g. W's
            buffer, dead by now), else a new tensor of k's dtype.
        config: ``BK``, ``BV``, ``num_warps``, ``num_stages``; ``flat`` forces the 1-D grid (``grid.py``; for tests).
            (On Hopper the GDN backward runs this stage and ``wy_bwd`` as one kernel, ``chunk_dqkw_ws.py``.)
    Returns:
        ``dq [B, T, HV, K]``, ``dk [B, T, HV, K]`` (per value head: tiled and state parts), ``dw [B, T, HV, K]``,
        ``dgd [B, T, HV]`` fp32 (q . dq - k . dk of the tiled product without the r = s terms), ``pst [B, T, HV]``
        fp32 (k . dk_state), ``sds [B, NS, HV]`` fp32 (<S, dS> per chunk and head).
    """
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    if tuple(h_sub.shape) != tuple(dh_sub.shape) or h_sub.shape[2:] != (HV, K, V) or tuple(du.shape) != (B, T, HV, V):
        raise ValueError("h_sub / dh_sub must be [B, NS, HV, K, V] and du [B, T, HV, V]")
    # launch defaults (docs/performance.md, 2026-11-23, 293a86c; H100, bf16, B=4 T=8192 H=16 K=V=128): 64-wide key
    # and value tiles, 4 warps, 3 stages: 0.696 ms (2 stages 0.720, 8 warps 0.999, BV 32 / 128 0.876 / 0.769, BK 32
    # 0.961); local sm_90 compile at 2 stages: 246 registers, no spills, 64 KiB shared memory
    cfg = {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 3, **(config or {})}
    BK = dot_tile(K, cfg["BK"], q.dtype)
    BV = dot_tile(V, cfg["BV"], q.dtype)
    NK = cdiv(K, BK)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.empty(B, T, HV, K, dtype=dq_dtype or q.dtype, device=q.device)
    dk = torch.empty(B, T, HV, K, dtype=dk_dtype or q.dtype, device=q.device)
    if dw is None:
        dw = torch.empty(B, T, HV, K, dtype=k.dtype, device=k.device)
    elif tuple(dw.shape) != (B, T, HV, K):
        raise ValueError(f"dw must be [B, T, HV, K] = {(B, T, HV, K)}, got {tuple(dw.shape)}")
    nslot = h_sub.shape[0] * h_sub.shape[1]
    dgd = torch.empty(NK, B, T, HV, dtype=acc, device=q.device)
    pst = torch.empty(NK, B, T, HV, dtype=acc, device=q.device)
    sds = torch.empty(NK, nslot, HV, dtype=acc, device=q.device)
    NT = cdiv(T, SUB_CHUNK) if cu_seqlens is None else tile_indices.shape[0]
    if NT > 0 and B * HV > 0:
        check_varlen_batch(B, cu_seqlens)
        grid, flat = tile_grid(NK, NT, B * HV, force_flat=cfg.get("flat", False))
        _gdn_dqkw_kernel[grid](
            q, k, v_new, do, du, h_sub, dh_sub, g_cum, dq, dk, dw, dgd, pst, sds, cu_seqlens, tile_indices,
            sub_offsets, scale, T, B * T * HV, nslot * HV,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, USE_G=g_cum is not None, IS_VARLEN=cu_seqlens is not None,
            DOT_PREC=dot_precision(q.dtype), ACC=acc_dtype(q.dtype), FLAT=flat,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    if NK > 1:
        dgd, pst, sds = dgd.sum(0), pst.sum(0), sds.sum(0)
    else:
        dgd, pst, sds = dgd[0], pst[0], sds[0]
    return dq, dk, dw, dgd, pst, sds.view(h_sub.shape[0], h_sub.shape[1], HV)
