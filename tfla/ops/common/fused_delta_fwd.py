"""The gated delta rule's forward in one pass per (sequence, value head, value tile): the first step of the fused
design of issue 23 (``docs/gdn-math.md``). Not yet the op's path: it is tested against the recurrence and waits for
its measurement on the GPU (``docs/performance.md``).

Per 64-row chunk, with the state S (fp32, ``[K, BV]``) on chip, G the gate cumulated within the chunk (log2) and Tm
the chunk's UT inverse from the prep kernel (``ut_transform``):

    Vnew = Tm (beta V - (beta 2^G K) S)        (= U - W S with W = Tm (beta 2^G K), U = Tm (beta V))
    o = scale (2^G (q S) + (causal (q k^T) 2^(G_r - G_s)) Vnew)
    S <- 2^(G_n) S + (K 2^(G_n - G))^T Vnew

W, U, Vnew and the per-chunk states never reach HBM; the pass writes o and the final state. Its chain has one step
per 64 rows and B * HV * ceil(V / BV) programs (the segment split of ``docs/gdn-math.md`` section 6 is the next step).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.chunk_state import _idx64, _row_split, _sequence_slots
from tfla.ops.common.cumsum import chunk_local_cumsum
from tfla.ops.common.grid import check_varlen_batch, program_pair, tile_grid
from tfla.ops.common.utils import LOG_DECAY_FLOOR, RCP_LN2, SUB_CHUNK, acc_dtype, cdiv, dot_precision, next_pow2
from tfla.ops.common.ut_transform import _ut_launch
from tfla.ops.common.varlen import VarlenIndex


@triton.jit
def _fused_delta_fwd_kernel(q, k, v, g, beta, ai, o, h0, ht, cu_seqlens, scale, T,
                            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
                            USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
                            IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, ACC: tl.constexpr,
                            IDX64: tl.constexpr, FLAT: tl.constexpr):
    BS: tl.constexpr = 64
    i_v, i_nh = program_pair((V + BV - 1) // BV, FLAT)  # (value tile, sequence x head)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, T, _ = _sequence_slots(cu_seqlens, cu_seqlens, i_n, T, BS, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, BS)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    dt = k.dtype.element_ty
    b_h = tl.zeros([BK, BV], dtype=ACC)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + i_nh * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0).to(ACC)
    for i_c in range(0, tl.cdiv(T, BS)):
        t0 = i_c * BS
        r0, o_r = _row_split(bos, t0, o_c, IDX64)
        m_t = (t0 + o_c) < T
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_qk = (r0 * H + i_h) * K + o_r[:, None] * (H * K) + o_k[None, :]
        b_k = tl.load(k + p_qk, mask=m_tk, other=0.0)  # [BS, BK]
        b_q = tl.load(q + p_qk, mask=m_tk, other=0.0)
        p_tv = (r0 * HV + i_hv) * V + o_r[:, None] * (HV * V) + o_v[None, :]
        b_v = tl.load(v + p_tv, mask=m_tv, other=0.0).to(ACC)  # [BS, BV]
        b_b = tl.load(beta + r0 * HV + i_hv + o_r * HV, mask=m_t, other=0.0).to(ACC)
        b_tm = tl.load(ai + (r0 * HV + i_hv) * BS + o_r[:, None] * (HV * BS) + o_c[None, :], mask=m_t[:, None],
                       other=0.0).to(dt)  # [BS, BS]
        if USE_G:
            b_g = tl.load(g + r0 * HV + i_hv + o_r * HV, mask=m_t, other=0.0)
            b_gn = tl.load(g + (bos + tl.minimum(t0 + BS, T) - 1) * HV + i_hv)
            b_eg = tl.exp2(b_g)
        else:
            b_eg = tl.full([BS], 1.0, dtype=ACC)
        # Vnew = U - W S = Tm (beta V - (beta 2^G K) S): W is never formed (a [BS, BK] fp32 tile less on chip)
        b_hd = b_h.to(dt)  # the state as the products' operand, shared by Vnew and the output
        b_y = b_v * b_b[:, None] - tl.dot((b_k * (b_b * b_eg)[:, None]).to(dt), b_hd, input_precision=DOT_PREC)
        b_vd = tl.dot(b_tm, b_y.to(dt), input_precision=DOT_PREC).to(dt)  # [BS, BV]
        # output: the state's part with its row factor 2^G applied after the product, then the causal part
        b_o = tl.dot(b_q, b_hd, input_precision=DOT_PREC) * b_eg[:, None]
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)  # [BS, BS]
        m_s = (o_c[:, None] >= o_c[None, :]) & m_t[:, None] & m_t[None, :]
        if USE_G:
            b_s = b_s * tl.exp2(tl.where(m_s, b_g[:, None] - b_g[None, :], float("-inf")))
        else:
            b_s = tl.where(m_s, b_s, 0.0)
        b_o = tl.dot(b_s.to(dt), b_vd, b_o, input_precision=DOT_PREC) * scale
        tl.store(o + p_tv, b_o.to(o.dtype.element_ty), mask=m_tv)
        # the state after the chunk
        if USE_G:
            b_h *= tl.exp2(b_gn)
            b_kw = (b_k * tl.exp2(tl.where(m_t, b_gn - b_g, float("-inf")))[:, None]).to(dt)
        else:
            b_kw = b_k
        b_h = tl.dot(tl.trans(b_kw), b_vd, b_h, input_precision=DOT_PREC)
    if STORE_FINAL_STATE:
        tl.store(ht + i_nh * K * V + o_k[:, None] * V + o_v[None, :], b_h, mask=m_kv)


def fused_delta_fwd(q, k, v, g, beta, scale, initial_state=None, output_final_state=False, cu_seqlens=None,
                    sub_indices=None, config=None):
    """``(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] fp32 or None)`` of the gated delta rule, with the
    arguments of ``chunk_gated_delta_rule`` (q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g ``[B, T, HV]`` natural-log
    decay or None, beta ``[B, T, HV]``); varlen: ``cu_seqlens`` with B = 1 and ``sub_indices`` its (sequence,
    64-row chunk) table. ``config``: ``BV``, ``num_warps``, ``num_stages`` of the fused pass, ``ut`` of the prep."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    # 32-wide value tiles: the fewest spills of a local sm_90 compile (Triton 3.6, bf16, K = V = 128: 44 B at 4 warps,
    # 2 stages; 64 columns 232 B, 184 B at 8 warps); not yet timed
    cfg = {"BV": 32, "num_warps": 4, "num_stages": 2, **(config or {})}
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    g_cum = None if g is None else chunk_local_cumsum(g, SUB_CHUNK, scale=RCP_LN2, cu_seqlens=cu_seqlens,
                                                      chunk_indices=sub_indices, out_dtype=acc, floor=LOG_DECAY_FLOOR)
    _, _, ai = _ut_launch(k, None, g_cum, beta, SUB_CHUNK, cu_seqlens, sub_indices, cfg.get("ut"), fuse=False)
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    final = torch.empty(N, HV, K, V, dtype=acc, device=q.device) if output_final_state else None
    if N * HV == 0:
        return o, final
    check_varlen_batch(B, cu_seqlens)
    BK = max(16, next_pow2(K))
    BV = min(max(16, next_pow2(V)), cfg["BV"])
    grid, flat = tile_grid(cdiv(V, BV), N * HV, force_flat=cfg.get("flat", False))
    _fused_delta_fwd_kernel[grid](
        q, k, v, g_cum, beta, ai, o, initial_state, final, cu_seqlens, scale, T,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, USE_G=g_cum is not None, USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=output_final_state, IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(q.dtype),
        ACC=acc_dtype(q.dtype), IDX64=cfg.get("idx64", False) or _idx64(T, H, HV, K, V), FLAT=flat,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o, final


def segment_bounds(bounds: list[int], segments: int) -> tuple[list[int], list[int]]:
    """Cut each sequence ``[bounds[n], bounds[n + 1])`` into at most ``segments`` pieces whose lengths are multiples
    of 64 (the last one takes the rest; an empty sequence keeps one empty piece). Returns ``(cuts, first)``: the
    pieces' offsets (a ``cu_seqlens``) and the index of each sequence's first piece (``first[-1]`` = their count).
    Raises ValueError for ``segments`` not a positive int."""
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"`segments` must be a positive int, got {segments!r}")
    cuts, first = [bounds[0]], [0]
    for b, e in zip(bounds[:-1], bounds[1:]):
        step = max(SUB_CHUNK, cdiv(cdiv(e - b, segments), SUB_CHUNK) * SUB_CHUNK)
        cuts.extend(list(range(b + step, e, step)) + [e])
        first.append(len(cuts) - 1)
    return cuts, first


def fused_delta_fwd_segmented(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
                              cu_seqlens=None, segments: int = 2, config=None):
    """``fused_delta_fwd`` with each sequence cut into up to ``segments`` pieces that run in parallel, exactly
    (``docs/gdn-math.md`` section 6): one pass over every piece with the state ``[I | 0]`` and the values ``[0 | v]``
    gives its transition and input ``[M | N]`` (``S_end = M S_start + N``), a short scan over the pieces gives each
    its start state, and a second pass gives the outputs. Arguments and returns as ``fused_delta_fwd``; the offsets
    are read on the host (``cu_seqlens.tolist()``)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is None:
        bounds = [i * T for i in range(B + 1)]
        q, k, v, beta = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, beta))
        g = g.reshape(1, B * T, HV) if g is not None else None
    else:
        check_varlen_batch(B, cu_seqlens)
        bounds = [int(x) for x in cu_seqlens.tolist()]
    N = len(bounds) - 1
    cuts, first = segment_bounds(bounds, segments)
    dev = q.device
    seg_cu = torch.tensor(cuts, dtype=torch.int64, device=dev)
    sub = VarlenIndex.build(seg_cu, SUB_CHUNK, bounds=cuts).sub_indices
    P = len(cuts) - 1
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    # pass 1: [M | N] of every piece
    v_aug = torch.cat([torch.zeros(*v.shape[:3], K, dtype=v.dtype, device=dev), v], -1)
    h_aug = torch.zeros(P, HV, K, K + V, dtype=acc, device=dev)
    h_aug[..., :K] = torch.eye(K, dtype=acc, device=dev)
    _, mn = fused_delta_fwd(q, k, v_aug, g, beta, scale, h_aug, True, cu_seqlens=seg_cu, sub_indices=sub,
                            config=config)
    m, n = mn[..., :K], mn[..., K:]
    # the scan over each sequence's pieces (host loop over pieces, batched over heads)
    starts = torch.empty(P, HV, K, V, dtype=acc, device=dev)
    finals = torch.empty(N, HV, K, V, dtype=acc, device=dev)
    for i in range(N):
        s = initial_state[i].to(acc) if initial_state is not None else torch.zeros(HV, K, V, dtype=acc, device=dev)
        for j in range(first[i], first[i + 1]):
            starts[j] = s
            s = torch.matmul(m[j], s) + n[j]
        finals[i] = s
    # pass 2: every piece's outputs from its exact start state
    o, _ = fused_delta_fwd(q, k, v, g, beta, scale, starts, False, cu_seqlens=seg_cu, sub_indices=sub, config=config)
    return o.reshape(B, T, HV, V), (finals if output_final_state else None)
