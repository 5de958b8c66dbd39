"""The gated delta rule's forward in one pass per (sequence or segment, value head, value tile) (issue 23,
``docs/gdn-math.md`` sections 4 and 6).

Per 64-row chunk, with the state S (fp32, ``[K, BV]``) on chip, G the gate cumulated within the chunk (log2) and Tm
the chunk's UT inverse from the prep pass (``ut_transform``):

    Vnew = Tm (beta o (V - 2^G o (K S)))            (= U - W S with W = Tm (beta 2^G K), U = Tm (beta V))
    o = scale 2^G o (q S) + A Vnew,  A = scale causal(q k^T) o 2^(G_r - G_s)  (from the prep)
    S <- 2^(G_n) S + (K 2^(G_n - G))^T Vnew

W, U and the per-chunk states stay on chip; the pass writes o, the final state and, for the backward, Vnew and the
state before every chunk when asked (``save``). Its chain has one step per 64 rows.

Segments (section 6): a long sequence is cut into pieces (multiples of 64 rows) that run in parallel, exactly. A
first pass over every piece with the state ``[I | 0]`` and the values ``[0 | v]`` (``TRANSITION``: no outputs) gives
the piece's transition and input ``[M | N]`` (``S_end = M S_start + N``); a scan kernel walks each sequence's pieces
(``S <- M S + N``) for their start states and the final state; the second pass runs every piece from its start.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tfla.ops.common.chunk_state import _idx64, _row_split, _sequence_slots
from tfla.ops.common.cumsum import chunk_local_cumsum
from tfla.ops.common.fused_delta_ws import (PASS_OUTPUT, PASS_STATES, PASS_TRANSITION, WS_DEFAULTS,
                                            fused_delta_pass_ws, ws_supported)
from tfla.ops.common.gate_act import NO_BETA, gate_prologue
from tfla.ops.common.grid import check_varlen_batch, ordered_row, program_pair, tile_grid
from tfla.ops.common.utils import (
    ALL_CHUNKS,
    LOG_DECAY_FLOOR,
    RCP_LN2,
    SUB_CHUNK,
    acc_dtype,
    cdiv,
    chunk_offset_rows,
    dot_precision,
    dot_tile,
    next_pow2,
    sm_count,
)
from tfla.ops.common.varlen import cached_bounds, chunk_tables, longest_first_order
from tfla.ops.common.ut_transform import ut_inverse, ut_inverse_and_scores, ut_inverse_with_cumsum

# launch of the fused pass (docs/performance.md). Value tiles: "BV" None picks 64 columns where the pass has
# programs for two per SM at that width, else 32 (wide_tiles); 8 warps or 3 stages measured slower; the transition
# pass (no output) at 64 columns, 2 stages (3 fit two programs per SM there, 99 KB, but measured no faster: H100,
# Triton 3.6, bf16, B = 1, T = 65536, H = 16, forward 1.815 / 1.815 ms at 2 against 1.836 / 1.828 at 3, 2026-11-24)
FUSED_DEFAULTS = {"BV": None, "num_warps": 4, "num_stages": 2, "mn_BV": 64, "mn_warps": 4, "mn_stages": 2}


class Split(NamedTuple):
    """A forward's cut of its sequences into pieces (``fused_delta_fwd``), for a backward over the same pieces:
    ``cu_seqlens`` / ``sub_offsets`` of the pieces (a packed batch of ``B * T`` rows), ``first`` (each sequence's
    first piece, ``[N + 1]``), ``num_chunks`` (64-row chunks in all), ``mn [P, HV, K, K + V]`` (each piece's
    ``[M | N]``, fp32) and ``starts [P, HV, K, V]`` (each piece's exact start state from the scan, fp32: the
    backward's pass over the pieces starts there when the forward kept neither Vnew nor the states); ``seq_order``
    the pieces longest first (``varlen.longest_first_order``, int32) or None; ``keep`` (``[P HV]`` int32) the chunks
    from each piece's start whose map to it stays above e^-80 (``piece_cutoffs``), None: all."""

    cu_seqlens: torch.Tensor
    sub_offsets: torch.Tensor
    first: torch.Tensor
    num_chunks: int
    mn: torch.Tensor
    starts: torch.Tensor
    seq_order: torch.Tensor | None = None
    keep: torch.Tensor | None = None


def wide_tiles(pairs: int, V: int, sms: int) -> int:
    """The fused pass's value-tile width for ``pairs`` (sequence or piece) x value-head programs per tile column: 64
    when ``pairs * ceil(V / 64)`` fills two programs per SM, else 32. An SM runs two of these programs at once and
    hides one's latency behind the other's; a 64-column program loads q, k, Tm and the scores once for twice the
    columns. H100, torch 2.11, Triton 3.6, bf16, K = V = 128, whole forward without grad, tfla alone, median
    do_bench (2026-11-24): 64 programs (B = 4, T = 8192, H = 16) 0.73 ms at 32 columns, 1.23 at 64; 384 (the
    Qwen3-Next-style layer, 6 sequences x 32 heads) 2.17 / 2.03; 16 pieces x 16 heads 2.54 / 2.31."""
    return 64 if pairs * cdiv(V, 64) >= 2 * sms else 32


SAVE_NONE, SAVE_V_NEW, SAVE_STATES = 0, 1, 2
# the Gluon kernels' launch for pieces: the forward pass here, the state-gradient recurrence in the GDN's chunk.py
PIECE_WS = {"BV": 64, "NCONS": 2}


def piece_ws(ws, V: int):
    """The Gluon launch of a kernel run over pieces: ``PIECE_WS`` where ``ws`` (a stage config's ``ws`` key) is the
    default (True, or None for absent) and V is a multiple of its columns per CTA; else ``ws`` as given (False: the
    ``tl`` kernel; a dict: the caller's launch)."""
    return PIECE_WS if (ws is True or ws is None) and V % (PIECE_WS["BV"] * PIECE_WS["NCONS"]) == 0 else ws


# T not specialized: Triton compiles an int argument equal to 1 as a constant, and that build of this kernel (dense,
# 32-column tiles, 16-bit, states kept) hit an illegal memory access on an H100 under Triton 3.6 (2026-11-25;
# varlen T = 1 and dense T = 200 were fine)
@triton.jit(do_not_specialize=["T"])
def _fused_delta_fwd_kernel(q, k, v, g, beta, ai, a, o, v_new, h, h0, ht, cu_seqlens, chunk_offsets, scale, T,
                            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
                            USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
                            IS_VARLEN: tl.constexpr, SAVE: tl.constexpr, PASS: tl.constexpr,
                            DOT_PREC: tl.constexpr, ACC: tl.constexpr, IDX64: tl.constexpr, FLAT: tl.constexpr,
                            seq_order=None, ORDERED: tl.constexpr = False, warm=None):
    """One program: value columns ``[i_v BV, (i_v + 1) BV)`` of one (sequence, value head). PASS 1 (the
    transition): the columns run over ``K + V`` (the first K: the state starts as the identity and the values are 0;
    the rest: v's columns from a zero state), only the final ``[M | N]`` is written (``ht [N, HV, K, K + V]``). PASS 2:
    no q, no output (SAVE's tensors and the final state only). SAVE 1: Vnew; 2: also the state before each chunk
    (``h``, k's dtype, slots from ``chunk_offsets``). ORDERED: the sequences in ``seq_order`` (``grid.ordered_row``).
    PASS 1 starts ``warm[i_n HV + i_hv]`` chunks into the piece (``piece_cutoffs``); where that is past the first
    chunk, a program whose columns are all M's stores M = 0 (the map from there to the end is below e^-80)."""
    BS: tl.constexpr = 64
    TRANSITION: tl.constexpr = PASS == 1
    NCOL: tl.constexpr = K + V if TRANSITION else V
    i_v, i_nh = program_pair((NCOL + BV - 1) // BV, FLAT)  # (value tile, sequence x head)
    i_nh = ordered_row(i_nh, seq_order, HV, ORDERED)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, T, boh = _sequence_slots(cu_seqlens, chunk_offsets, i_n, T, BS, IS_VARLEN)
    if TRANSITION:  # the chunks left out at the piece's start
        n_warm = tl.load(warm + i_nh)
        bos += n_warm * BS
        T -= n_warm * BS
        # after a cut the map from there to the piece's end is below e^-80: a program of M's columns alone stores
        # M = 0 without running the chunks
        zero_m = ((n_warm > 0) & ((i_v + 1) * BV <= K)).to(tl.int32)
        T *= 1 - zero_m
    o_k = tl.arange(0, BK)
    o_j = i_v * BV + tl.arange(0, BV)  # the program's columns of the state
    o_c = tl.arange(0, BS)
    m_k = o_k < K
    m_j = o_j < NCOL
    m_kv = m_k[:, None] & m_j[None, :]
    if TRANSITION:  # value column of each state column (negative: an identity column, whose value is 0)
        o_v = o_j - K
        m_v = m_j & (o_v >= 0)
    else:
        o_v = o_j
        m_v = m_j
    dt = k.dtype.element_ty
    b_h = tl.zeros([BK, BV], dtype=ACC)
    if TRANSITION:
        b_h += tl.where(o_k[:, None] == o_j[None, :], 1.0 - zero_m, 0.0).to(ACC)
    elif USE_INITIAL_STATE:
        b_h += tl.load(h0 + i_nh * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0).to(ACC)
    for i_c in range(0, tl.cdiv(T, BS)):
        t0 = i_c * BS
        r0, o_r = _row_split(bos, t0, o_c, IDX64)
        m_t = (t0 + o_c) < T
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_qk = (r0 * H + i_h) * K + o_r[:, None] * (H * K) + o_k[None, :]
        b_k = tl.load(k + p_qk, mask=m_tk, other=0.0)  # [BS, BK]
        p_tv = (r0 * HV + i_hv) * V + o_r[:, None] * (HV * V) + o_v[None, :]
        b_v = tl.load(v + p_tv, mask=m_tv, other=0.0).to(ACC)  # [BS, BV]
        b_b = tl.load(beta + r0 * HV + i_hv + o_r * HV, mask=m_t, other=0.0).to(ACC)
        b_tm = tl.load(ai + (r0 * HV + i_hv) * BS + o_r[:, None] * (HV * BS) + o_c[None, :], mask=m_t[:, None],
                       other=0.0)
        if USE_G:
            b_g = tl.load(g + r0 * HV + i_hv + o_r * HV, mask=m_t, other=0.0)
            b_gn = tl.load(g + (bos + tl.minimum(t0 + BS, T) - 1) * HV + i_hv)
            b_eg = tl.exp2(b_g)
        else:
            b_eg = tl.full([BS], 1.0, dtype=ACC)
        b_hd = b_h.to(dt)  # the state as the products' operand, shared by Vnew and the output
        if SAVE == 2:
            tl.store(h + ((boh + i_c) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :], b_hd, mask=m_kv)
        # Vnew = Tm (beta o (V - 2^G o (K S))): W is never formed
        b_y = (b_v - tl.dot(b_k, b_hd, input_precision=DOT_PREC) * b_eg[:, None]) * b_b[:, None]
        b_vd = tl.dot(b_tm, b_y.to(dt), input_precision=DOT_PREC).to(dt)  # [BS, BV]
        if SAVE > 0 and BV < 64:
            tl.store(v_new + p_tv, b_vd, mask=m_tv)
        if PASS == 0:  # the output: the state's part with its row factor 2^G after the product, the prep's
            # gated causal scores (scale included) times Vnew
            b_q = tl.load(q + p_qk, mask=m_tk, other=0.0)
            b_o = tl.dot(b_q, b_hd, input_precision=DOT_PREC) * (b_eg * scale)[:, None]
            b_a = tl.load(a + (r0 * HV + i_hv) * BS + o_r[:, None] * (HV * BS) + o_c[None, :], mask=m_t[:, None],
                          other=0.0)
            b_o = tl.dot(b_a, b_vd, b_o, input_precision=DOT_PREC)
            tl.store(o + p_tv, b_o.to(o.dtype.element_ty), mask=m_tv)
        if SAVE > 0 and BV >= 64:  # after the output at 64 columns: the store's layout conversion then reuses the
            # state operand's shared memory (115 instead of 123 KB: two programs per SM)
            tl.store(v_new + p_tv, b_vd, mask=m_tv)
        # the state after the chunk (gate weights on the keys: the backward's state pass over the saved Vnew,
        # chunk_state_fwd with key_weights, rebuilds these states bit for bit)
        if USE_G:
            b_h *= tl.exp2(b_gn)
            b_kw = (b_k * tl.exp2(tl.where(m_t, b_gn - b_g, float("-inf")))[:, None]).to(dt)
        else:
            b_kw = b_k
        b_h = tl.dot(tl.trans(b_kw), b_vd, b_h, input_precision=DOT_PREC)
    if STORE_FINAL_STATE:
        tl.store(ht + i_nh * K * NCOL + o_k[:, None] * NCOL + o_j[None, :], b_h, mask=m_kv)


@triton.jit
def _segment_scan_kernel(mn, nn, h0, starts, ht, first, s_np, s_nr, HV: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
                         STORE_FINAL_STATE: tl.constexpr, REVERSE: tl.constexpr, DOT_PREC: tl.constexpr,
                         ACC: tl.constexpr, FLAT: tl.constexpr):
    """Per (sequence, value head, value tile), over the sequence's pieces p (``first``: each sequence's first piece;
    ``mn [P, HV, K, K + V]``: M_p in its first K columns; ``nn``: N_p, ``[K, V]`` per (piece, head) at strides
    ``s_np`` / ``s_nr`` per piece-head / row): forward ``S <- M_p S + N_p`` in order, writing each piece's start
    state and the final state; REVERSE (the state gradient): ``dS <- M_p^T dS + N_p`` from the last piece back,
    writing each piece's end adjoint and (as the final state) the sequence's initial-state gradient."""
    i_v, i_nh = program_pair((V + BV - 1) // BV, FLAT)
    i_n, i_hv = i_nh // HV, i_nh % HV
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_kv = m_k[:, None] & (o_v < V)[None, :]
    b_s = tl.zeros([BK, BV], dtype=ACC)
    if USE_INITIAL_STATE:
        b_s += tl.load(h0 + i_nh * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0).to(ACC)
    p0 = tl.load(first + i_n).to(tl.int64)
    p1 = tl.load(first + i_n + 1).to(tl.int64)
    for i_p in range(p0, p1):
        p = i_p
        if REVERSE:
            p = p1 - 1 - (i_p - p0)
        tl.store(starts + (p * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :], b_s, mask=m_kv)
        base = mn + (p * HV + i_hv) * K * (K + V)
        if REVERSE:  # M^T: element (i, j) = M[j, i]
            b_m = tl.load(base + o_k[None, :] * (K + V) + o_k[:, None], mask=m_k[:, None] & m_k[None, :], other=0.0)
        else:
            b_m = tl.load(base + o_k[:, None] * (K + V) + o_k[None, :], mask=m_k[:, None] & m_k[None, :], other=0.0)
        b_n = tl.load(nn + (p * HV + i_hv) * s_np + o_k[:, None] * s_nr + o_v[None, :], mask=m_kv, other=0.0)
        b_s = tl.dot(b_m, b_s, input_precision=DOT_PREC) + b_n
    if STORE_FINAL_STATE:
        tl.store(ht + i_nh * K * V + o_k[:, None] * V + o_v[None, :], b_s, mask=m_kv)


def fused_delta_prep(q, k, g, beta, scale, cu_seqlens=None, sub_indices=None, config=None, act=None,
                     scores: bool = True, log_bound=None):
    """The prep pass: ``(g_cum, ai, a, beta)``: g_cum ``[B, T, HV]`` fp32 log2 restarting every 64 rows (or None), Tm
    and the output's scores ``scale causal(q k^T) o 2^(G_r - G_s)`` ``[B, T, HV, 64]`` (``ut_inverse_and_scores``, one
    kernel; ``scores`` False: Tm alone, a None), and the beta used; g natural-log decay ``[B, T, HV]`` or None, floored
    at ``LOG_DECAY_FLOOR``. ``act`` (a ``GateAct``, g given): g and / or beta hold pre-activations, activated by the
    gate's cumsum kernel; without scores and a beta activation the inverse's kernel does the gate's activation and
    cumsum. ``log_bound`` (``[sub-chunks, HV]`` fp32, g given) or None: receives the log of a bound on each 64-row
    sub-chunk's map of the state (``ut_transform.ut_inverse_and_scores``; for ``piece_cutoffs``)."""
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    if not scores and g is not None and (act is None or act.beta == NO_BETA):
        # the gate's activation and cumsum inside the inverse's kernel
        g_cum, ai = ut_inverse_with_cumsum(k, g, beta, cu_seqlens, sub_indices, config,
                                           A_log=act.A_log if act is not None else None,
                                           dt_bias=act.dt_bias if act is not None else None, log_bound=log_bound)
        return g_cum, ai, None, beta
    if act is not None and g is not None:
        g_cum, beta = gate_prologue(g, beta, act, cu_seqlens=cu_seqlens, chunk_indices=sub_indices)
    else:
        g_cum = None if g is None else chunk_local_cumsum(g, SUB_CHUNK, scale=RCP_LN2, cu_seqlens=cu_seqlens,
                                                          chunk_indices=sub_indices, out_dtype=acc,
                                                          floor=LOG_DECAY_FLOOR)
    if scores:
        ai, a = ut_inverse_and_scores(q, k, g_cum, beta, scale, cu_seqlens, sub_indices, config, log_bound)
    else:
        ai, a = ut_inverse(k, g_cum, beta, cu_seqlens, sub_indices, config, log_bound), None
    return g_cum, ai, a, beta


def fused_delta_pass(q, k, v, g_cum, beta, ai, scale, initial_state=None, output_final_state=False,
                     cu_seqlens=None, chunk_offsets=None, num_chunks=None, save=SAVE_NONE, transition=False,
                     a=None, config=None, output: bool = True, seq_order=None, warm=None):
    """One fused pass over the sequences (or pieces) of ``cu_seqlens`` from the prep's ``g_cum``, ``ai`` and
    ``a`` (the output's scores; not read with ``transition`` or without ``output``). ``output`` False: no q read and
    no output formed (Vnew, the states and the final state only). ``seq_order``: ``[N]`` int32, the order in which
    the programs take the sequences (``varlen.longest_first_order``) or None (in order). ``warm`` (with
    ``transition``): ``piece_cutoffs``' chunks to leave out per (piece, value head); None: none.
    Returns ``(o, final, v_new, h)``: o ``[B, T, HV, V]`` in v's dtype (None with ``transition`` or without
    ``output``), final
    ``[N, HV, K, V]`` (``[N, HV, K, K + V]`` = ``[M | N]`` with ``transition``) in fp32 or None, v_new like v
    (``save`` >= 1) and h ``[B, NT, HV, K, V]`` in k's dtype, the state before each 64-row chunk (``save`` 2; varlen:
    ``chunk_offsets`` / ``num_chunks`` of 64-row chunks)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    cfg = {**FUSED_DEFAULTS, **(config or {})}
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    ncol = K + V if transition else V
    mode = PASS_TRANSITION if transition else PASS_OUTPUT if output else PASS_STATES
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device) if mode == PASS_OUTPUT else None
    final = torch.empty(N, HV, K, ncol, dtype=acc, device=q.device) if output_final_state or transition else None
    v_new = torch.empty_like(v) if save >= SAVE_V_NEW else None
    NT = cdiv(T, SUB_CHUNK) if cu_seqlens is None else num_chunks
    h = torch.empty(B, NT, HV, K, V, dtype=k.dtype, device=k.device) if save == SAVE_STATES else None
    if N * HV == 0:
        return o, final, v_new, h
    check_varlen_batch(B, cu_seqlens)
    BK = dot_tile(K, 1 << 20, q.dtype)
    # fp32 / fp64 at head dims past 128: one stage (two need 320 KB of shared memory at K = V = 256, fp32; sm_90
    # compile with Triton 3.6), unless the config sets it
    key = "mn_stages" if transition else "num_stages"
    stages = cfg[key] if key in (config or {}) or q.element_size() < 4 or BK <= 128 else 1
    if transition:
        width = cfg["mn_BV"]
    else:
        width = cfg["BV"] or wide_tiles(N * HV, V, sm_count(q))
    BV = dot_tile(ncol, width, q.dtype)
    grid, flat = tile_grid(cdiv(ncol, BV), N * HV, force_flat=cfg.get("flat", False))
    if transition and warm is None:
        warm = torch.zeros(N * HV, dtype=torch.int32, device=q.device)
    _fused_delta_fwd_kernel[grid](
        q, k, v, g_cum, beta, ai, a, o, v_new, h, initial_state, final, cu_seqlens, chunk_offsets, scale, T,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, USE_G=g_cum is not None, USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=final is not None, IS_VARLEN=cu_seqlens is not None, SAVE=save, PASS=mode,
        DOT_PREC=dot_precision(q.dtype), ACC=acc_dtype(q.dtype),
        IDX64=cfg.get("idx64", False) or _idx64(T, H, HV, K, V),
        FLAT=flat, seq_order=seq_order, ORDERED=seq_order is not None, warm=warm if transition else None,
        num_warps=cfg["mn_warps" if transition else "num_warps"], num_stages=stages,
    )
    return o, final, v_new, h


@triton.jit
def _cutoff_kernel(lb, chunk_offsets, warm, keep, HV: tl.constexpr, BHV: tl.constexpr, BC: tl.constexpr,
                   FLOOR: tl.constexpr):
    """One program per piece, all value heads at once: from the log bounds of the piece's 64-row chunks (``lb
    [chunks, HV]``, natural log), ``warm``: the largest c whose chunks c.. to the end sum to FLOOR or less (none: 0);
    ``keep``: c + 1 for the smallest c whose chunks ..c from the start sum to FLOOR or less (none: the piece's
    chunks). Prefix and suffix sums over BC chunks at a time."""
    i_n = tl.program_id(0)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    nc = (tl.load(chunk_offsets + i_n + 1).to(tl.int64) - c0).to(tl.int32)
    o_j = tl.arange(0, BC)
    o_h = tl.arange(0, BHV)
    m_h = o_h < HV
    suf = tl.zeros([BHV], dtype=tl.float32)
    pre = tl.zeros([BHV], dtype=tl.float32)
    b_warm = tl.zeros([BHV], dtype=tl.int32)
    b_keep = tl.zeros([BHV], dtype=tl.int32) + nc
    for j0 in range(0, nc, BC):
        j = j0 + o_j
        m = (j < nc)[:, None] & m_h[None, :]
        c = nc - 1 - j  # from the end
        b_s = tl.load(lb + (c0 + c)[:, None] * HV + o_h[None, :], mask=m, other=0.0)
        hit = m & (tl.cumsum(b_s, axis=0) + suf[None, :] <= FLOOR)
        b_warm = tl.maximum(b_warm, tl.max(tl.where(hit, c[:, None], 0), axis=0))
        suf += tl.sum(b_s, axis=0)
        b_p = tl.load(lb + (c0 + j)[:, None] * HV + o_h[None, :], mask=m, other=0.0)  # from the start
        hit = m & (tl.cumsum(b_p, axis=0) + pre[None, :] <= FLOOR)
        b_keep = tl.minimum(b_keep, tl.min(tl.where(hit, j[:, None] + 1, nc), axis=0))
        pre += tl.sum(b_p, axis=0)
    tl.store(warm + i_n * HV + o_h, b_warm, mask=m_h)
    tl.store(keep + i_n * HV + o_h, b_keep, mask=m_h)


def piece_cutoffs(log_bound, chunk_offsets, HV: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each piece's map falls below ``e^LOG_DECAY_FLOOR`` (e^-80 = 1.8e-35), per (piece, value head), from a
    bound on the norm of each token's map ``e^g_t (I - beta_t k_t k_t^T)``: ``e^g_t max(1, |1 - beta_t |k_t|^2|)``,
    multiplied over the piece's 64-row chunks (``log_bound [chunks, HV]`` fp32: each chunk's log of that product,
    formed by the prep's kernel, ``ut_transform.ut_inverse_and_scores``; chunks numbered as the pieces' in a row,
    ``chunk_offsets [P + 1]`` the pieces' first chunks).

    Returns ``(warm, keep)``, both ``[P HV]`` int32 (piece-major). ``warm`` (the forward's transition pass): the
    chunks at the piece's start that the pass may leave out, the map of the chunks after them being below the
    bound: the state entering them reaches the piece's end below that factor. ``keep`` (the backward's first pass
    over the pieces, the state gradient's summary ``dN``): the chunks from the start that pass must run, the map of
    those chunks being below the bound: the gradient entering them from later chunks reaches the piece's start below
    that factor. Either way what is left out is smaller than fp32's and float64's rounding of the states it joins, as
    a decay under that floor is a reset everywhere in tfla (``utils.LOG_DECAY_FLOOR``); FlashQLA's context-parallel
    split drops what is below ``e^-10`` (4.5e-5) the same way. Without gates (``log_bound`` None): nothing left out
    (``warm`` 0, ``keep`` ``ALL_CHUNKS``)."""
    P = chunk_offsets.numel() - 1
    dev = chunk_offsets.device
    if log_bound is None or P * HV == 0:
        return (torch.zeros(P * HV, dtype=torch.int32, device=dev),
                torch.full((P * HV,), ALL_CHUNKS, dtype=torch.int32, device=dev))
    warm = torch.empty(P * HV, dtype=torch.int32, device=dev)
    keep = torch.empty(P * HV, dtype=torch.int32, device=dev)
    _cutoff_kernel[(P,)](log_bound, chunk_offsets, warm, keep, HV=HV, BHV=max(16, next_pow2(HV)), BC=64,
                         FLOOR=LOG_DECAY_FLOOR, num_warps=4)
    return warm, keep


def segment_scan(mn, initial_state, first, V, output_final_state=True, config=None, dn=None):
    """Start states ``[P, HV, K, V]`` of the pieces and final states ``[N, HV, K, V]`` (fp32, or None) from the
    pieces' ``[M | N]`` (``mn [P, HV, K, K + V]``) and ``first`` (int tensor ``[N + 1]``: each sequence's first
    piece).

    With ``dn [P, HV, K, V]`` (each piece's state gradient at its start from a zero gradient at its end) the reverse
    scan of the state gradient (``docs/gdn-math.md`` section 6, backward): ``initial_state`` is then the final
    state's cotangent ``[N, HV, K, V]`` (or None), and the result is each piece's gradient at its end
    ``[P, HV, K, V]`` and each sequence's initial-state gradient ``[N, HV, K, V]`` (fp32)."""
    P, HV, K = mn.shape[0], mn.shape[1], mn.shape[2]
    N = first.numel() - 1
    reverse = dn is not None
    starts = torch.empty(P, HV, K, V, dtype=mn.dtype, device=mn.device)
    final = torch.empty(N, HV, K, V, dtype=mn.dtype, device=mn.device) if output_final_state else None
    if N * HV == 0:
        return starts, final
    BK = max(16, next_pow2(K))
    BV = min(max(16, next_pow2(V)), (config or {}).get("scan_BV", 32))
    grid, flat = tile_grid(cdiv(V, BV), N * HV)
    nn, s_np, s_nr = (dn, K * V, V) if reverse else (mn[..., K:], K * (K + V), K + V)
    _segment_scan_kernel[grid](
        mn, nn, initial_state, starts, final, first, s_np, s_nr, HV=HV, K=K, V=V, BK=BK, BV=BV,
        USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=final is not None, REVERSE=reverse,
        DOT_PREC=dot_precision(mn.dtype), ACC=acc_dtype(mn.dtype), FLAT=flat,
        num_warps=8 if BK >= 128 else 4,
    )
    return starts, final


def segment_bounds(bounds: list[int], segments: int | None = None, piece: int | None = None
                   ) -> tuple[list[int], list[int]]:
    """Cut each sequence ``[bounds[n], bounds[n + 1])`` into pieces whose lengths are multiples of 64 (the last one
    takes the rest; an empty sequence keeps one empty piece): into at most ``segments`` pieces, or into pieces of
    ``piece`` rows (a multiple of 64). Returns ``(cuts, first)``: the pieces' offsets (a ``cu_seqlens``) and the
    index of each sequence's first piece (``first[-1]`` = their count). Raises ValueError for ``segments`` not a
    positive int."""
    if piece is None:
        if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
            raise ValueError(f"`segments` must be a positive int, got {segments!r}")
    cuts, first = [bounds[0]], [0]
    for b, e in zip(bounds[:-1], bounds[1:]):
        step = piece if piece is not None else max(SUB_CHUNK, cdiv(cdiv(e - b, segments), SUB_CHUNK) * SUB_CHUNK)
        cuts.extend(list(range(b + step, e, step)) + [e])
        first.append(len(cuts) - 1)
    return cuts, first


def choose_piece(bounds: list[int], HV: int, V: int, sms: int, BV: int = 32,
                 cta_cols: int | None = None) -> int | None:
    """The piece length (rows, a multiple of 64) of the split, or None (no split).

    A pass's time is about the longest chain (``max_n c_n`` 64-row steps, c_n the chunks of sequence n) or the work
    spread over the resident programs (``sum_n c_n * HV * V / BV / (2 sms)`` steps, two programs per SM), whichever
    is larger. The split pays transitions, a scan and the backward's summary pass per piece, so it is taken only where
    the chain is more than twice the spread work.

    ``cta_cols`` (the Gluon pieces' launch, ``PIECE_WS``: one CTA of that many state columns per SM): the fewest
    pieces, of one length, that leave no SM idle: the shortest length for which the pieces' CTAs (``pieces x HV x V
    / cta_cols``) fit in one wave of ``sms``, a sequence shorter than that length counting as the fraction of it
    that it runs. Past one wave the last CTAs run a second chain (9 pieces of B = 1, T = 65536, H = 16: 144 CTAs on
    132 SMs); more waves of shorter pieces take as long in the pass and pay more transitions. H200, torch 2.11,
    Triton 3.6, bf16, K = V = 128, median ``do_bench``, one process, forward / forward + backward ms (2026-11-29,
    21b9f87): B = 1, T = 65536, H = 16: 17 pieces (the rule before) 0.873 / 3.376, 8 pieces 0.824 / 3.177, 9: 1.096
    / 3.862; T = 32768: 16 pieces 0.547 / 1.876, 8: 0.480 / 1.691; T = 131072: 17 pieces 1.541 / 6.283, 8: 1.457 /
    6.073; HV = 32: 9 pieces 1.485 / 6.209, 4: 1.396 / 6.030; B = 2, T = 65536: 18 pieces 1.627 / 6.810, 8: 1.424 /
    6.042 (``docs/performance.md``).

    Without ``cta_cols`` (the ``tl`` pass, two programs per SM): pieces for about ``8 sms`` programs of BV columns
    (H100, one sequence of 65,536 tokens, H = 16, K = V = 128, bf16, 2026-11-24: 3.78 ms unsplit, 3.56 / 2.81 / 2.69
    ms at 4 / 4 / 16 pieces with 32 / 64 / 64-wide transition tiles). Never below 1,024 rows."""
    chunks = [cdiv(e - b, SUB_CHUNK) for b, e in zip(bounds[:-1], bounds[1:])]
    if not chunks:
        return None
    work = sum(chunks) * HV * cdiv(V, BV)
    if max(chunks) <= 2 * work / (2 * sms):
        return None
    if cta_cols is None:
        piece = max(16, cdiv(work, 8 * sms))
    else:
        fit = max(1, sms // (HV * cdiv(V, cta_cols)))  # pieces in one wave

        def load(n):  # the wave's slots that pieces of n chunks take: a sequence shorter than n the fraction it runs
            return sum(cdiv(c, n) if c >= n else c / n for c in chunks)
        lo, hi = max(16, cdiv(sum(chunks), fit)), max(chunks)
        while lo < hi:  # the shortest length whose pieces fit (the load falls as the length grows)
            mid = (lo + hi) // 2
            if load(mid) <= fit:
                hi = mid
            else:
                lo = mid + 1
        piece = lo
    return piece * SUB_CHUNK if piece < max(chunks) else None


@functools.lru_cache(maxsize=64)
def _split_tables(cuts: tuple[int, ...], first: tuple[int, ...], device: torch.device):
    """The pieces' offsets (a ``cu_seqlens``), their first 64-row chunks and each sequence's first piece, int64 on
    the device from one host-to-device copy, and the pieces' ``longest_first_order`` (int32, None where they are in
    that order); cached per split, so a repeated call copies nothing (a copy waits for the device's queue)."""
    order = longest_first_order(cuts)
    flat = torch.tensor(list(cuts) + chunk_offset_rows(cuts, SUB_CHUNK) + list(first) + order,
                        dtype=torch.int64).to(device)
    n, m = len(cuts), len(first)
    return flat[:n], flat[n:2 * n], flat[2 * n:2 * n + m], flat[2 * n + m:].to(torch.int32) if order else None


def _slab_states(slab: int, save: int, bounds, q, v, out: dict) -> dict:
    """The Gluon pass's slab arguments (``fused_delta_fwd``'s ``slab``; ``bounds``: the sequences' row offsets on the
    host, None for tables built on the device: no slabs), the kept states recorded in ``out``."""
    HV, V = v.shape[2], v.shape[3]
    K = q.shape[3]
    if bounds is None or slab <= 0 or save not in (SAVE_NONE, SAVE_V_NEW):
        return {}
    n = max((cdiv(e - b, SUB_CHUNK) for b, e in zip(bounds[:-1], bounds[1:])), default=0)
    if n <= slab:
        return {}
    states = torch.empty(cdiv(n, slab) - 1, (len(bounds) - 1) * HV, K, V, dtype=torch.float32, device=q.device)
    out["slab"] = (slab, states)
    return dict(slab_states=states, slab=slab)


def states_from_pass(q, k, v, g_cum, beta, ai, scale, initial_state=None, cu_seqlens=None, chunk_offsets=None,
                     num_chunks: int | None = None, config=None, seq_order=None):
    """Vnew and the state before every 64-row chunk (``save`` 2's pair: ``(v_new, h)`` as ``fused_delta_pass``
    returns them) from the prep's ``g_cum``, Tm (``ai``) and the beta used: the forward's pass run again without its
    output (``PASS_STATES``: no q read, the scores' and the output's products skipped). The GDN backward's
    recomputation when the forward kept FLA's saved set (no Vnew): one pass of the forward's kind instead of W and U
    in HBM and the delta rule's state chain over them. ``config``: the pass's keys
    (``fused_delta_fwd``'s ``ws`` and the ``tl`` pass's). Arguments as ``fused_delta_pass``."""
    cfg = config or {}
    ws_cfg = cfg["ws"] if isinstance(cfg.get("ws"), dict) else None
    if cfg.get("ws", True) is not False and ws_supported(q, k, v, g_cum is not None, initial_state, cu_seqlens,
                                                         SAVE_STATES, ws_cfg):
        _, _, v_new, h = fused_delta_pass_ws(q, k, v, g_cum, beta, ai, scale, initial_state, False, cu_seqlens,
                                             SAVE_STATES, ws_cfg, chunk_offsets=chunk_offsets, num_chunks=num_chunks,
                                             output=False, seq_order=seq_order)
    else:
        _, _, v_new, h = fused_delta_pass(q, k, v, g_cum, beta, ai, scale, initial_state, False, cu_seqlens,
                                          chunk_offsets, num_chunks, SAVE_STATES, config=cfg, output=False,
                                          seq_order=seq_order)
    return v_new, h


def fused_delta_fwd(q, k, v, g, beta, scale, initial_state=None, output_final_state=False, cu_seqlens=None,
                    bounds: list[int] | None = None, segments: int | None = 1, save=SAVE_NONE, split_save=None,
                    sub_tables: tuple | None = None, act=None, config=None, slab: int = 0):
    """The gated delta rule's forward, fused. Arguments as ``chunk_gated_delta_rule``: q, k ``[B, T, H, K]``, v
    ``[B, T, HV, V]``, g ``[B, T, HV]`` natural-log decay or None, beta ``[B, T, HV]``, initial_state
    ``[N, HV, K, V]``; ``bounds``: the host copy of ``cu_seqlens`` (read from the device when None and
    ``sub_tables`` is None);
    ``sub_tables``: the caller's ``(sub_indices, sub_offsets, seq_order)`` of ``cu_seqlens`` at 64 rows
    (``VarlenIndex``; ``seq_order``: ``varlen.longest_first_order`` or None, the order in which the pass's programs
    take the sequences), built here when None; given with ``bounds`` None, the tables of ``VarlenIndex.on_device`` (no
    split then);
    ``segments``: pieces per sequence (1: no split; None: from the shape and the device, ``choose_piece``, at head
    dims K <= 128 only);
    ``split_save``: the ``save`` to use instead when a sequence is cut (a kept Vnew is consistent only with the
    forward's own states there: the pieces start from the scan's states, not from the recurrence a backward would
    run over Vnew from the initial state);
    ``act``: a ``GateAct`` (``gate_act.py``): g and / or beta hold pre-activations that the prep activates;
    ``config``: the ``tl`` pass's launch keys (``FUSED_DEFAULTS``), ``ut`` (the prep's) and ``ws``: True (default: the
    warp-specialized Gluon pass where ``fused_delta_ws.ws_supported`` holds), False (the ``tl`` pass always) or a
    dict of the Gluon pass's keys (``fused_delta_ws.WS_DEFAULTS``; pieces, transitions included, launch ``PIECE_WS``
    unless a dict is given);
    ``slab``: with ``save`` 0 or 1, unsplit, on the Gluon pass, the offsets on the host: also keep the fp32 state
    before every ``slab``-th 64-row chunk of each sequence, the starts of the backward's slabs (``chunk.py``: its
    states and their gradients, and without Vnew kept the Vnew it forms, then live one slab at a time).

    Returns a dict: ``o [B, T, HV, V]`` (v's dtype), ``final_state`` (fp32 or None), ``g_cum``, ``ai`` (the prep's
    log2 gates restarting every 64 rows and Tm, for the backward), ``beta`` (the one used: activated with ``act``), ``v_new`` (``save`` >= 1), ``h`` (``save`` 2:
    states before every 64-row chunk, ``[B, ceil(T/64), HV, K, V]``; varlen ``[1, chunks, HV, K, V]``), ``save``
    (the one used), ``split`` (a ``Split`` when a sequence was cut, else absent), ``slab`` (``(slab, states)``,
    states ``[S - 1, N HV, K, V]`` fp32 before chunks ``slab, 2 slab, ..`` of each sequence (slots past a shorter
    sequence's end unwritten), when kept, else absent)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cfg = config or {}
    dev = q.device
    if cu_seqlens is not None:
        check_varlen_batch(B, cu_seqlens)
        if sub_tables is None:
            bounds = cached_bounds(cu_seqlens) if bounds is None else bounds
            sub_tables = chunk_tables(bounds, SUB_CHUNK, dev)
        sub, offsets, order = sub_tables
        num_chunks = sub.shape[0]  # (with tables built on the device: a bound, its last rows padding)
    else:
        bounds = [i * T for i in range(B + 1)]
        sub = offsets = order = None
        num_chunks = B * cdiv(T, SUB_CHUNK)
    if bounds is None:  # tables built on the device (CUDA-graph capture): no lengths on the host to cut pieces by
        if segments not in (None, 1):
            raise ValueError(f"`segments={segments}` needs the sequence offsets on the host; under CUDA-graph capture "
                             "with `cu_seqlens` pass segments=None or 1")
        first = None
    elif segments is None:
        # the scan holds a K x K transition in registers: the automatic split stays at head dims up to 128 (the
        # ones measured; K = 256 would put a 256 x 256 fp32 tile there)
        sms = sm_count(q)
        # the pieces' CTA width where their pass will be the Gluon kernel's (fused_delta_ws; launch as below)
        p_ws = piece_ws(cfg["ws"] if isinstance(cfg.get("ws"), dict) else True, V)
        p_ws = {**WS_DEFAULTS, **(p_ws if isinstance(p_ws, dict) else {})}
        gluon = cfg.get("ws", True) is not False and ws_supported(q, k, v, g is not None, None, cu_seqlens,
                                                                  SAVE_NONE, p_ws)
        piece = choose_piece(bounds, HV, V, sms, cfg.get("BV") or 32,
                             p_ws["BV"] * p_ws["NCONS"] if gluon else None) if K <= 128 else None
        cuts, first = segment_bounds(bounds, piece=piece) if piece else (bounds, None)
    elif segments == 1:
        cuts, first = bounds, None
    else:
        cuts, first = segment_bounds(bounds, segments)
        if first == list(range(len(bounds))):  # no sequence was cut
            cuts, first = bounds, None
    if first is not None and split_save is not None:
        save = split_save
    # the pass over the sequences (or pieces): the warp-specialized Gluon kernel on Hopper where it applies
    # (fused_delta_ws.py; it forms the output's scores itself, so the prep forms Tm alone), else the tl kernel;
    # config key "ws": True (default), False (the tl kernel always) or a dict of the Gluon pass's launch keys
    ws_cfg = cfg["ws"] if isinstance(cfg.get("ws"), dict) else None
    use_ws = cfg.get("ws", True) is not False
    if first is None:
        ws = use_ws and ws_supported(q, k, v, g is not None, initial_state, cu_seqlens, save, ws_cfg)
    else:
        seg_cu, seg_off, first_t, seg_order = _split_tables(tuple(cuts), tuple(first), dev)
        # pieces: two 64-column consumer warpgroups per CTA unless the config sets the launch (H100, Triton 3.6, bf16,
        # one sequence of 65,536 tokens, H = 16, K = V = 128, forward, do_bench: 1.59 -> 1.24 ms; the layer unsplit
        # is faster with one: docs/performance.md)
        ws_cfg = piece_ws(ws_cfg, V)
        # (the pieces start from the scan's fp32 states)
        ws = use_ws and ws_supported(q, k, v, g is not None, None, seg_cu, save, ws_cfg)
        ws_mn = use_ws and ws_supported(q, k, v, g is not None, None, seg_cu, SAVE_NONE, ws_cfg)
    log_bound = None
    if first is not None and g is not None:  # the split's cutoffs (piece_cutoffs) from the prep's bound on each
        # 64-row chunk's map
        log_bound = torch.empty(num_chunks, HV, dtype=torch.float32, device=dev)
    g_cum, ai, a, beta = fused_delta_prep(q, k, g, beta, scale, cu_seqlens, sub, cfg.get("ut"), act=act,
                                          scores=not ws, log_bound=log_bound)
    out = dict(g_cum=g_cum, ai=ai, beta=beta, save=save)
    if first is None:
        if ws:
            o, final, v_new, h = fused_delta_pass_ws(
                q, k, v, g_cum, beta, ai, scale, initial_state, output_final_state, cu_seqlens, save, ws_cfg,
                chunk_offsets=offsets, num_chunks=num_chunks if save == SAVE_STATES else None, seq_order=order,
                **_slab_states(slab, save, bounds, q, v, out))
        else:
            o, final, v_new, h = fused_delta_pass(
                q, k, v, g_cum, beta, ai, scale, initial_state, output_final_state, cu_seqlens, offsets,
                num_chunks, save, a=a, config=cfg, seq_order=order)
        out.update(o=o, final_state=final, v_new=v_new, h=h)
        return out
    # pieces: B sequences of T rows become one packed batch
    flat = [x.reshape(1, B * T, *x.shape[2:]) if x is not None else None for x in (q, k, v, g_cum, beta, ai, a)]
    qf, kf, vf, gf, bf, af, sf = flat
    # each piece's transition starts at the last chunk from which the map to the piece's end is below e^-80
    # (piece_cutoffs): what enters the piece before that chunk reaches its end below that factor; the backward's
    # summary pass runs the chunks up to where the map to the piece's start falls below it (keep)
    warm, keep = piece_cutoffs(log_bound, seg_off, HV)
    if ws_mn:
        _, mn, _, _ = fused_delta_pass_ws(qf, kf, vf, gf, bf, af, scale, None, True, seg_cu, config=ws_cfg,
                                          transition=True, seq_order=seg_order, warm=warm)
    else:
        _, mn, _, _ = fused_delta_pass(qf, kf, vf, gf, bf, af, scale, None, True, seg_cu, seg_off, transition=True,
                                       config=cfg, seq_order=seg_order, warm=warm)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    h0 = initial_state.to(acc).contiguous() if initial_state is not None else None
    starts, final = segment_scan(mn, h0, first_t, V, output_final_state, cfg)
    num_chunks = sum(cdiv(e - b, SUB_CHUNK) for b, e in zip(cuts[:-1], cuts[1:]))
    if ws:
        o, _, v_new, h = fused_delta_pass_ws(qf, kf, vf, gf, bf, af, scale, starts, False, seg_cu, save, ws_cfg,
                                             chunk_offsets=seg_off, num_chunks=num_chunks, seq_order=seg_order)
    else:
        o, _, v_new, h = fused_delta_pass(qf, kf, vf, gf, bf, af, scale, starts, False, seg_cu, seg_off, num_chunks,
                                          save, a=sf, config=cfg, seq_order=seg_order)
    out.update(o=o.reshape(B, T, HV, V), final_state=final, v_new=None if v_new is None else v_new.reshape(v.shape),
               h=None if h is None else h.reshape(B, -1, HV, K, V),
               split=Split(seg_cu, seg_off, first_t, num_chunks, mn, starts, seg_order, keep))
    return out
