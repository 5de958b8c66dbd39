"""TFLA-tiled chunk output: inter-chunk (state) plus intra-chunk (causal, gated) contributions.

Notation: B batch, T time, H key heads, HV value heads, K/V head dims, BT outer chunk (L),
BQ query-row tile (B_Lhq), BKV key-row tile (B_Lkv), BK key-dim tile (B_dqk), BV value tile (B_dhv).
G is the cumulative gate within the outer chunk, log2 units.

For query row r of outer chunk c with state S_c (materialized at the chunk start):

    o_r = scale * ( 2^(G_r) q_r S_c  +  sum_{s in chunk c, s <= r} (q_r . k_s) 2^(G_r - G_s) v_s )

Work partitioning (TFLA, Section 3 and Table 1): one program per (BQ query rows, BV value columns,
batch x head); it loops over the BKV key tiles of its outer chunk up to the diagonal. For the
delta rule ``v`` is the new values (``Vnew``) of the state stage; for linear attention it is V.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.utils import cdiv, dot_precision, next_pow2


@triton.jit
def _chunk_output_fwd_kernel(
    q,
    k,
    v,
    h,
    g,
    o,
    cu_seqlens,
    tile_indices,
    chunk_offsets,
    scale,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BQ: tl.constexpr,
    BKV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_G: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_v, i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        i_n = tl.load(tile_indices + i_t * 2).to(tl.int64)
        i_t = tl.load(tile_indices + i_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_b * T
        boh = i_b * tl.cdiv(T, BT)
    t_q0 = i_t * BQ
    i_c = t_q0 // BT  # outer chunk of this query tile
    o_tq = t_q0 + tl.arange(0, BQ)
    m_tq = o_tq < T
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    dt = q.dtype.element_ty

    p_q = q + (bos * H + i_h) * K + o_tq[:, None] * (H * K) + o_k[None, :]
    b_q = tl.load(p_q, mask=m_tq[:, None] & m_k[None, :], other=0.0)  # [BQ, BK]
    # inter-chunk part: q @ S_c
    p_h = h + ((boh + i_c) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0.0).to(dt)  # [BK, BV]
    b_o = tl.dot(b_q, b_s, input_precision=DOT_PREC)  # [BQ, BV]
    if USE_G:
        p_g = g + bos * HV + i_hv
        b_gq = tl.load(p_g + o_tq * HV, mask=m_tq, other=0.0)
        b_o *= tl.exp2(b_gq)[:, None]

    # intra-chunk part (level-2 tiling): key tiles of this outer chunk before the query tile, then
    # the diagonal tiles. Before the diagonal, every key row s precedes every query row r, so with m
    # the key tile's last row, 2^(G_r - G_s) = 2^(G_r - G_m) 2^(G_m - G_s): two exponent vectors
    # (both exponents <= 0) instead of BQ x BKV exponentials.
    p_k = k + (bos * H + i_h) * K + o_k[None, :]
    p_v = v + (bos * HV + i_hv) * V + o_v[None, :]
    for t_k0 in range(i_c * BT, t_q0, BKV):
        o_tk = t_k0 + tl.arange(0, BKV)
        b_k = tl.load(p_k + o_tk[:, None] * (H * K), mask=m_k[None, :], other=0.0)  # [BKV, BK]
        b_a = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)  # [BQ, BKV]
        if USE_G:
            b_gm = tl.load(p_g + (t_k0 + BKV - 1) * HV)
            b_gk = tl.load(p_g + o_tk * HV)
            b_a *= tl.exp2(tl.where(m_tq, b_gq - b_gm, float("-inf")))[:, None] * tl.exp2(b_gm - b_gk)[None, :]
        b_vv = tl.load(p_v + o_tk[:, None] * (HV * V), mask=m_v[None, :], other=0.0)  # [BKV, BV]
        b_o = tl.dot(b_a.to(dt), b_vv.to(dt), b_o, input_precision=DOT_PREC)
    for t_k0 in range(t_q0, t_q0 + BQ, BKV):
        o_tk = t_k0 + tl.arange(0, BKV)
        m_tk = o_tk < T
        b_k = tl.load(p_k + o_tk[:, None] * (H * K), mask=m_tk[:, None] & m_k[None, :], other=0.0)  # [BKV, BK]
        b_a = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)  # [BQ, BKV]
        m_a = (o_tq[:, None] >= o_tk[None, :]) & m_tq[:, None] & m_tk[None, :]
        if USE_G:
            b_gk = tl.load(p_g + o_tk * HV, mask=m_tk, other=0.0)
            b_a = b_a * tl.exp2(tl.where(m_a, b_gq[:, None] - b_gk[None, :], float("-inf")))
        else:
            b_a = tl.where(m_a, b_a, 0.0)
        b_vv = tl.load(p_v + o_tk[:, None] * (HV * V), mask=m_tk[:, None] & m_v[None, :], other=0.0)  # [BKV, BV]
        b_o = tl.dot(b_a.to(dt), b_vv.to(dt), b_o, input_precision=DOT_PREC)

    p_o = o + (bos * HV + i_hv) * V + o_tq[:, None] * (HV * V) + o_v[None, :]
    tl.store(p_o, (b_o * scale).to(o.dtype.element_ty), mask=m_tq[:, None] & m_v[None, :])


def output_config(chunk_size: int, K: int, V: int, config: dict | None = None) -> dict:
    """Tile sizes and launch shape of the output kernel: a fixed heuristic, overridable per key
    (``BQ``, ``BKV``, ``BV``, ``num_warps``, ``num_stages``)."""
    # defaults measured on an H200 (docs/perf.md): full-width value tiles, 4 warps, 2 stages
    cfg = {"BQ": 64, "BKV": 64, "BV": 128 if K <= 128 else 64, "num_warps": 4, "num_stages": 2, **(config or {})}
    cfg["BQ"] = min(cfg["BQ"], chunk_size)
    cfg["BKV"] = min(cfg["BKV"], chunk_size)
    cfg["BV"] = min(max(16, next_pow2(V)), cfg["BV"])
    if chunk_size % cfg["BQ"] or chunk_size % cfg["BKV"] or cfg["BQ"] % cfg["BKV"]:
        raise ValueError(f"output tiles BQ={cfg['BQ']}, BKV={cfg['BKV']} must divide chunk_size={chunk_size} "
                         "and BKV must divide BQ")
    return cfg


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
) -> torch.Tensor:
    """``o [B, T, HV, V]`` from q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, states
    ``h [B, NT, HV, K, V]`` at outer-chunk starts, and ``g_cum [B, T, HV]`` (log2, chunk-local).

    ``tile_indices`` (varlen) is ``prepare_chunk_indices(.., cfg["BQ"])`` for the query tile size of
    ``output_config(chunk_size, K, V, config)``.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cfg = output_config(chunk_size, K, V, config)
    o = torch.empty(B, T, HV, V, dtype=out_dtype or q.dtype, device=q.device)
    NQ = cdiv(T, cfg["BQ"]) if cu_seqlens is None else tile_indices.shape[0]
    if NQ == 0 or B * HV == 0:
        return o
    BK = max(16, next_pow2(K))
    _chunk_output_fwd_kernel[(cdiv(V, cfg["BV"]), NQ, B * HV)](
        q, k, v, h, g_cum, o, cu_seqlens, tile_indices, chunk_offsets, scale, T,
        H=H, HV=HV, K=K, V=V, BT=chunk_size, BQ=cfg["BQ"], BKV=cfg["BKV"], BK=BK, BV=cfg["BV"],
        USE_G=g_cum is not None, IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o
