"""Inter-chunk state recurrence (the level-1 stage of TFLA): states are materialized in HBM only
at the start of every outer chunk of BT = L tokens; inside an outer chunk the state advances over
64-row sub-chunks in registers.

Notation: B batch, T time, H key heads, HV value heads, K/V head dims, N sequences,
BT outer chunk (L), BS = 64 sub-chunk, BK/BV head-dim tiles, G cumulative gate within the outer
chunk in log2 units, c the row before the sub-chunk (G_c = 0 at an outer-chunk start), n its last row.

Per sub-chunk, with state S (fp32, ``[K, V]``) after row c and values V (the delta rule's: its Vnew, kept by the
forward's fused pass):

    S <- 2^(G_n - G_c) S + (K * 2^(G_n - G))^T @ V

Vector gate (``VEC_G``, GLA, plain linear attention only): ``GV [B, T, HV, K]`` (log2, cumulative within
the outer chunk) decays each key row of the state: ``S <- diag(2^(GV_n - GV_c)) S + (K * 2^(GV_n - GV))^T V``
(elementwise on K, exponents <= 0); the backward's dU gets ``(K * 2^(GV_n - GV)) dS`` and its output term
``scale (Q * 2^GV)^T dO``. The scalar gate (``USE_G``) is off then.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.grid import needs_int64, ordered_row, program_pair, tile_grid
from tfla.ops.common.utils import SUB_CHUNK, acc_dtype, cdiv, dot_precision, dot_tile, num_sequences, varlen_mode


@triton.jit
def _state_substep(b_h, b_n, t0, T, bos, i_h, i_hv, k, v, g, gk, gb,
                   o_c, o_k, o_v, m_k, m_v, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, USE_G: tl.constexpr,
                   SPLIT_G: tl.constexpr, HAS_GB: tl.constexpr,
                   DOT_PREC: tl.constexpr, ACC: tl.constexpr, N_STATE: tl.constexpr,
                   gv=None, VEC_G: tl.constexpr = False, IDX64: tl.constexpr = False, KEY_W: tl.constexpr = False):
    """Advance the state ``b_h [BK, BV]`` (and with N_STATE the normalizer state ``b_n [BK]``, the same
    recurrence with v = 1) over the sub-chunk of rows ``t0 .. t0 + BS``."""
    dt = k.dtype.element_ty
    o_t = t0 + o_c
    m_t = o_t < T
    r0, o_r = _row_split(bos, t0, o_c, IDX64)
    b_k = tl.load(k + (r0 * H + i_h) * K + o_r[:, None] * (H * K) + o_k[None, :],
                  mask=m_t[:, None] & m_k[None, :], other=0.0)  # [BS, BK]
    b_v = tl.load(v + (r0 * HV + i_hv) * V + o_r[:, None] * (HV * V) + o_v[None, :],
                  mask=m_t[:, None] & m_v[None, :], other=0.0).to(ACC)  # [BS, BV]
    if USE_G:
        # clamped so a sub-chunk past T reads G_n = G_c = G[T - 1]: decay 1, no-op
        b_gn = tl.load(g + (bos + tl.minimum(t0 + BS, T) - 1) * HV + i_hv)
        b_gc = tl.load(g + (bos + tl.minimum(t0, T) - 1) * HV + i_hv, mask=(t0 % BT) != 0, other=0.0)
        if HAS_GB:  # at an outer-chunk start: the gate of the row before it (the state's stabilizer)
            b_gc += tl.load(gb + (bos + tl.minimum(t0, T - 1)) * HV + i_hv, mask=(t0 % BT) == 0, other=0.0)
        if SPLIT_G:  # key weights 2^(GQ_n - GK_s)
            b_g = tl.load(gk + r0 * HV + i_hv + o_r * HV, mask=m_t, other=0.0)
        else:
            b_g = tl.load(g + r0 * HV + i_hv + o_r * HV, mask=m_t, other=0.0)
    if USE_G:
        b_wk = tl.exp2(tl.where(m_t, b_gn - b_g, float("-inf")))  # [BS] key weights
        b_h *= tl.exp2(b_gn - b_gc)
        if N_STATE:
            b_n = b_n * tl.exp2(b_gn - b_gc) + tl.sum(b_k.to(ACC) * b_wk[:, None], 0)
        if KEY_W:  # the weights on K, not on V: the product then takes V as stored (the delta rule: the backward's
            # linear pass over the kept Vnew rebuilds the forward's states bit for bit; weighting Vnew rounded it twice)
            b_k = (b_k * b_wk[:, None]).to(dt)
        else:
            b_v = b_v * b_wk[:, None]
    elif N_STATE:
        b_n += tl.sum(b_k.to(ACC), 0)
    if VEC_G:  # per key row: keys weighted 2^(GV_n - GV_s), the state's rows decayed 2^(GV_n - GV_c)
        b_wv, b_rd, _ = _vec_decays(gv, r0, o_r, i_hv, t0, T, bos, m_t, o_k, m_k, HV, K, BT, BS)
        b_k = (b_k * b_wv).to(dt)
        b_h *= b_rd[:, None]
    return tl.dot(tl.trans(b_k), b_v.to(dt), b_h, input_precision=DOT_PREC), b_n


@triton.jit
def _row_split(bos, t0, o_c, IDX64: tl.constexpr):
    """Rows ``t0 + o_c`` of the sequence that starts at token ``bos``, as a scalar row and in-tile row offsets
    ``(r0, o_r)`` with ``r0 + o_r`` the row: ``(bos + t0, o_c)`` with IDX64 (r0 int64: ``o_r * stride`` stays
    small, ``r0 * stride`` cannot wrap), else ``(bos, t0 + o_c)`` (32-bit ``(t0 + o_c) * stride``: fine while every
    tensor's offsets fit in 31 bits, which the host checks; fewer registers in the pipelined loops)."""
    if IDX64:
        return bos + t0, o_c
    else:
        return bos, t0 + o_c


@triton.jit
def _vec_decays(gv, r0, o_r, i_hv, t0, T, bos, m_t, o_k, m_k, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                BS: tl.constexpr):
    """The vector gate of one sub-chunk (rows t0 .., c the row before it, n its last row in the
    sequence): key weights ``2^(GV_n - GV_s)`` ``[BS, BK]`` (0 past T) and row decays ``2^(GV_n - GV_c)``
    ``[BK]`` (GV_c = 0 at an outer-chunk start), and the rows' own ``2^GV_s`` (the output's use of the
    outer chunk's start state)."""
    b_gn = tl.load(gv + ((bos + tl.minimum(t0 + BS, T) - 1) * HV + i_hv) * K + o_k, mask=m_k, other=0.0)
    m_c = m_k & (((o_k * 0 + t0) % BT) != 0)  # (a vector mask: the interpreter rejects vector & scalar masks)
    b_gc = tl.load(gv + ((bos + tl.minimum(t0, T) - 1) * HV + i_hv) * K + o_k, mask=m_c, other=0.0)
    m_tk = m_t[:, None] & m_k[None, :]
    b_g = tl.load(gv + (r0 * HV + i_hv) * K + o_r[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.0)
    return (tl.exp2(tl.where(m_tk, b_gn[None, :] - b_g, float("-inf"))), tl.exp2(b_gn - b_gc),
            tl.exp2(tl.where(m_tk, b_g, float("-inf"))))


@triton.jit
def _tile_of(tile_indices, i_t, i_b, IS_VARLEN: tl.constexpr):
    """The sequence and the tile within it of program row ``i_t``: ``(i_b, i_t)`` for B equal sequences, else the
    (sequence, tile) pair of the varlen table."""
    i_n = i_b
    if IS_VARLEN:
        i_n = tl.load(tile_indices + i_t * 2).to(tl.int64)
        i_t = tl.load(tile_indices + i_t * 2 + 1).to(tl.int64)
    return i_n, i_t


@triton.jit
def _sequence_slots(cu_seqlens, offsets, i_n, T, SLOT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Sequence i_n's first token ``bos``, its length ``T`` and its first state slot ``boh`` for states stored
    every SLOT rows (varlen: the offsets table of that slot size; else B equal sequences of length T). ``bos`` and
    ``boh`` are int64; T stays int32 (loops over it stay 32-bit): a kernel forms a row's offset as the int64 scalar
    ``(bos + t0) * stride`` of its tile's first row plus int32 in-tile offsets, never ``t * stride`` in 32 bits."""
    if IS_VARLEN == 2:  # (first row, end row) pairs: parts of sequences (varlen.row_pairs)
        bos = tl.load(cu_seqlens + 2 * i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + 2 * i_n + 1).to(tl.int64) - bos).to(tl.int32)
        boh = tl.load(offsets + i_n).to(tl.int64)
    elif IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        boh = tl.load(offsets + i_n).to(tl.int64)
    else:
        bos = i_n * T
        boh = i_n * tl.cdiv(T, SLOT)
    return bos, T, boh


@triton.jit
def _state_tile(cu_seqlens, offsets, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, SLOT: tl.constexpr, IS_VARLEN: tl.constexpr, FLAT: tl.constexpr,
                seq_order=None, ORDERED: tl.constexpr = False):
    """The ``[BK, BV]`` state tile of a (value tile, sequence x value head) program of the state recurrences (forward
    and reverse): ``(i_v, i_nh, i_h, i_hv, bos, T, boh, o_k, o_v, m_k, m_v, m_kv, o_kv)`` with the sequence's rows
    and state slots as ``_sequence_slots``, o_kv the tile's offsets in a ``[K, V]`` state; ORDERED: the sequences in
    ``seq_order`` (``grid.ordered_row``)."""
    i_v, i_nh = program_pair((V + BV - 1) // BV, FLAT)  # (value tile, sequence x head): 2-D or flat grid
    i_nh = ordered_row(i_nh, seq_order, HV, ORDERED)
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos, T, boh = _sequence_slots(cu_seqlens, offsets, i_nh // HV, T, SLOT, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    return i_v, i_nh, i_h, i_hv, bos, T, boh, o_k, o_v, m_k, m_v, m_kv, o_k[:, None] * V + o_v[None, :]


@triton.jit
def _chunk_state_fwd_kernel(
    k,
    v,
    g,
    h,
    h0,
    ht,
    gk,
    gb,
    cu_seqlens,
    chunk_offsets,
    hn,
    hn0,
    hnt,
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
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UNROLL: tl.constexpr,
    STORE_SUB: tl.constexpr,
    ACC: tl.constexpr,
    N_STATE: tl.constexpr,
    gv=None,
    VEC_G: tl.constexpr = False,
    IDX64: tl.constexpr = False,
    FLAT: tl.constexpr = False,
    KEY_W: tl.constexpr = False,
    seq_order=None,
    ORDERED: tl.constexpr = False,
):
    BS: tl.constexpr = 64
    SLOT: tl.constexpr = BS if STORE_SUB else BT  # rows per stored state
    i_v, i_nh, i_h, i_hv, bos, T, boh, o_k, o_v, m_k, m_v, m_kv, o_kv = _state_tile(
        cu_seqlens, chunk_offsets, T, H, HV, K, V, BK, BV, SLOT, IS_VARLEN, FLAT, seq_order, ORDERED)
    o_c = tl.arange(0, BS)

    b_h = tl.zeros([BK, BV], dtype=ACC)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + i_nh * K * V + o_kv, mask=m_kv, other=0.0).to(ACC)
    # N_STATE: the normalizer state n (every value tile computes it, the first one stores it)
    b_n = tl.zeros([BK], dtype=ACC)
    m_n = m_k & ((o_k * 0 + i_v) == 0)
    if N_STATE and USE_INITIAL_STATE:
        b_n += tl.load(hn0 + i_nh * K + o_k, mask=m_k, other=0.0).to(ACC)

    # level 1: one iteration per outer chunk, the only place a state touches HBM;
    # level 2: its BT // BS sub-chunks, state on chip (a sub-chunk past T is a no-op). Unrolled, the
    # loads of a whole outer chunk can be in flight at once (shared memory grows with BT); otherwise
    # the inner loop is the one the compiler pipelines.
    # (STORE_SUB, for the backward pass: the state at every sub-chunk start instead)
    for i_c in range(0, tl.cdiv(T, BT)):
        if not STORE_SUB:
            tl.store(h + ((boh + i_c) * HV + i_hv) * K * V + o_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
            if N_STATE:
                tl.store(hn + ((boh + i_c) * HV + i_hv) * K + o_k, b_n, mask=m_n)
        if UNROLL:
            for j in tl.static_range(BT // BS):
                b_h, b_n = _state_substep(
                    b_h, b_n, i_c * BT + j * BS, T, bos, i_h, i_hv, k, v, g, gk, gb,
                    o_c, o_k, o_v, m_k, m_v, H, HV, K, V, BT, BS, USE_G, SPLIT_G, HAS_GB, DOT_PREC, ACC,
                    N_STATE, gv, VEC_G, IDX64, KEY_W)
        else:
            for j in range(BT // BS):
                if STORE_SUB:
                    if i_c * BT + j * BS < T:
                        tl.store(h + ((boh + i_c * (BT // BS) + j) * HV + i_hv) * K * V + o_kv,
                                 b_h.to(h.dtype.element_ty), mask=m_kv)
                        if N_STATE:
                            tl.store(hn + ((boh + i_c * (BT // BS) + j) * HV + i_hv) * K + o_k, b_n, mask=m_n)
                b_h, b_n = _state_substep(
                    b_h, b_n, i_c * BT + j * BS, T, bos, i_h, i_hv, k, v, g, gk, gb,
                    o_c, o_k, o_v, m_k, m_v, H, HV, K, V, BT, BS, USE_G, SPLIT_G, HAS_GB, DOT_PREC, ACC,
                    N_STATE, gv, VEC_G, IDX64, KEY_W)

    if STORE_FINAL_STATE:
        tl.store(ht + i_nh * K * V + o_kv, b_h, mask=m_kv)
        if N_STATE:
            tl.store(hnt + i_nh * K + o_k, b_n, mask=m_n)


def _idx64(T: int, H: int, HV: int, K: int, V: int) -> bool:
    """The state kernels' IDX64: a row offset ``t * stride`` of a ``[B, T, heads, dim]`` tensor (q, k, v, W, Vnew,
    Tm's 64 columns, the vector gate) can pass 2^31 within one sequence of up to T tokens."""
    return needs_int64(T * max(H * K, HV * max(K, V, SUB_CHUNK)))


def _state_acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_state_fwd(
    k: torch.Tensor,
    v: torch.Tensor,
    g_cum: torch.Tensor | None,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_dtype: torch.dtype | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    num_chunks: int | None = None,
    config: dict | None = None,
    store_every_sub_chunk: bool = False,
    gk_cum: torch.Tensor | None = None,
    gb: torch.Tensor | None = None,
    n_state: bool = False,
    initial_n: torch.Tensor | None = None,
    gv_cum: torch.Tensor | None = None,
    key_weights: bool = False,
    seq_order: torch.Tensor | None = None,
):
    """States at every outer-chunk start (or every 64 rows) of the linear recurrence over the values v: linear
    attention's, the mLSTM's, and the delta rule's over its kept Vnew (the GDN backward). (The delta rule's own chain
    from W and U went on 2026-11-28: the GDN backward runs its fused forward pass again instead.)

    Args:
        k: ``[B, T, H, K]``. v: ``[B, T, HV, V]``.
        g_cum: ``[B, T, HV]`` fp32 cumulative gate within outer chunks, log2 units, or None.
        initial_state: ``[N, HV, K, V]``, any float dtype (read as fp32).
        state_dtype: dtype of the materialized states (default: k's dtype; the recurrence is fp32).
        cu_seqlens: varlen offsets (B = 1), or an ``[N, 2]`` table of (first row, end row) pairs: parts of sequences
            (``utils.varlen_mode``; the GDN backward's slabs).
        chunk_offsets / num_chunks: varlen ``prepare_chunk_offsets(.., chunk_size)`` and its total (with
            ``store_every_sub_chunk``: the same for 64-row sub-chunks; with pairs, each pair's first state slot).
        config: overrides of ``BV``, ``num_warps``, ``num_stages``, ``unroll``; ``flat`` / ``idx64`` force the 1-D
            grid and the 64-bit row offsets that very large inputs take (``tfla/ops/common/grid.py``; for tests).
        store_every_sub_chunk: materialize the state at every 64-row sub-chunk start (backward pass).
        gk_cum, gb: split gates (linear attention only; see ``chunk_output.chunk_tiled``): ``g_cum`` is
            the query-side gate GQ, key weights are ``2^(GQ_n - GK_s)``, and at an outer-chunk start the
            previous row's gate is ``gb`` instead of 0; every state is then stabilized by its own ``gb``.
        n_state: also run the normalizer state ``n`` (the same recurrence with v = 1: the mLSTM's
            denominator, TFLA paper Section 2) in the same pass; ``initial_n [N, HV, K]`` its start.
        gv_cum: vector gate ``[B, T, HV, K]`` fp32 (log2, cumulative within outer chunks; GLA), instead
            of ``g_cum``; plain linear attention only.
        key_weights: the scalar gate's weights ``2^(G_n - G)`` go on K instead of V in the state update (as the
            delta rule's fused pass does: the GDN backward's states over its kept Vnew then equal the forward's bit
            for bit).
        seq_order: ``[N]`` int32, the order in which the programs take the sequences of ``cu_seqlens`` offsets
            (``varlen.longest_first_order``: the longest chains start first) or None (in order).
    Returns:
        ``h [B, NT, HV, K, V]`` (varlen: ``[1, total chunks, HV, K, V]``) and ``final_state [N, HV, K, V]`` fp32
        or None; with ``n_state`` two more:
        ``hn [B, NT, HV, K]`` fp32 and ``final_n [N, HV, K]`` fp32 or None.
    """
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    N = num_sequences(cu_seqlens, B)
    NT = cdiv(T, SUB_CHUNK if store_every_sub_chunk else chunk_size) if cu_seqlens is None else num_chunks
    if (gk_cum is not None or gb is not None) and g_cum is None:
        raise ValueError("split gates (gk_cum, gb) need g_cum")
    if gv_cum is not None and (g_cum is not None or n_state or tuple(gv_cum.shape) != (B, T, HV, K)):
        raise ValueError("a vector gate gv_cum [B, T, HV, K] serves plain linear attention without g_cum / n_state")
    h = torch.empty(B, NT, HV, K, V, dtype=state_dtype or k.dtype, device=k.device)
    final_state = torch.empty(N, HV, K, V, dtype=_state_acc(k.dtype), device=k.device) if output_final_state else None
    hn = torch.empty(B, NT, HV, K, dtype=_state_acc(k.dtype), device=k.device) if n_state else None
    final_n = torch.empty(N, HV, K, dtype=_state_acc(k.dtype), device=k.device) if n_state and output_final_state \
        else None
    if initial_n is not None and initial_state is None:
        raise ValueError("initial_n needs initial_state (pass zeros for C)")
    rets = (h, final_state) + ((hn, final_n) if n_state else ())
    if N * HV == 0:
        return rets
    # defaults measured on an H200 at K = V = 128 (docs/performance.md); 3 stages do not fit K = 256
    cfg = {"BV": 64 if K <= 128 else 32, "num_warps": 4, "num_stages": 3 if K <= 128 else 2, "unroll": False,
           **(config or {})}
    if chunk_size == 128 and K <= 128 and not config:
        cfg.update(unroll=True, num_stages=2)
    if store_every_sub_chunk:
        cfg["unroll"] = False
    # the vector gate's [64, K] fp32 tile per stage: 263168 B > 232448 B of shared memory at K = V = 128,
    # 3 stages (H100); a config that sets num_stages wins
    if gv_cum is not None and "num_stages" not in (config or {}):
        cfg.update(unroll=False, num_stages=1 if K > 64 else 2)
    BK = dot_tile(K, 1 << 20, k.dtype)
    BV = dot_tile(V, cfg["BV"], k.dtype)
    grid, flat = tile_grid(cdiv(V, BV), N * HV, force_flat=cfg.get("flat", False))
    _chunk_state_fwd_kernel[grid](
        k, v, g_cum, h, initial_state, final_state, gk_cum, gb, cu_seqlens, chunk_offsets,
        hn, initial_n if initial_n is not None else (torch.zeros(N, HV, K, dtype=hn.dtype, device=k.device)
                                                      if n_state and initial_state is not None else None), final_n, T,
        H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=BK, BV=BV,
        USE_G=g_cum is not None, SPLIT_G=gk_cum is not None, HAS_GB=gb is not None,
        USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=output_final_state,
        IS_VARLEN=varlen_mode(cu_seqlens), DOT_PREC=dot_precision(k.dtype), ACC=acc_dtype(k.dtype),
        UNROLL=cfg["unroll"], STORE_SUB=store_every_sub_chunk, N_STATE=n_state,
        gv=gv_cum, VEC_G=gv_cum is not None, IDX64=cfg.get("idx64", False) or _idx64(T, H, HV, K, V), FLAT=flat,
        KEY_W=key_weights, seq_order=seq_order, ORDERED=seq_order is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return rets


def intra_supported(chunk_size: int, gv_cum: torch.Tensor | None = None) -> bool:
    """Whether ``chunk_state_bwd`` can form the output's intra-chunk dvo itself (``dvo=None``): one 64-row
    diagonal tile per chunk (L = 64) and a scalar or no gate."""
    return chunk_size == SUB_CHUNK and gv_cum is None
