"""The delta rule's reverse state-gradient recurrence (``chunk_state_bwd._delta_state_bwd_kernel``) as a
warp-specialized Gluon kernel for Hopper (sm_90), chosen by ``chunk_state_bwd.chunk_state_bwd`` where
``state_bwd_ws_supported`` holds; same results up to the order of fp32 additions.

Notation as ``fused_delta_ws.py``: 64-row chunks, BV value columns per consumer warpgroup. Per chunk, last first
(``docs/gdn-math.md`` section 6), with dS the gradient of the state after the chunk:

- ``A = causal(k q^T) o 2^(G_r - G_s)`` (keys s in rows, queries r in columns) and ``dvo = scale A dO``;
- ``dU = dvo + 2^(G_n - G) (k dS)`` (stored, 16-bit), dS stored before the chunk's update (16-bit);
- ``dS <- 2^(G_n) dS - W^T dU + q^T (scale 2^G dO)``, the last product as two 16-bit products of dO's rows
  scaled in fp32 and split into a high and a low bf16 part (the ``tl`` kernel's ``_rowscaled_qdot``). W is not
  read: with ``W = Tm X_k`` (``X_k = beta 2^G k``, ``ut_transform.py``), ``W^T dU = k^T (beta 2^G o (Tm^T dU))``,
  one ``[64, 64] x [64, BV]`` product more per chunk on the chain and no W recomputed before the recurrence.

One CTA per (sequence, value head, NCONS x BV value columns): a one-warp producer streams k, q, Tm (``[64, 64]``)
and dO (``[64, BV]`` per consumer) of each chunk, last chunk first, into a STAGES-deep ring with TMA; NCONS consumer
warpgroups keep their ``[K, BV]`` fp32 dS in registers, run the products on asynchronous wgmma and send dS and dU
out with TMA stores from the shared memory the products read them from (a chunk cut by the sequence's end: masked
register stores of dU).
"""
from __future__ import annotations

import torch
import triton.language as tl

from tfla.ops.common.fused_delta_ws import HAVE_GLUON, _is_sm90, context_current, tma_desc
from tfla.ops.common.utils import ALL_CHUNKS, num_sequences, varlen_mode

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from tfla.ops.common.fused_delta_ws import _chunk_rows, _seq_rows, _tma_load, _tma_store

BS = 64  # rows per chunk
# two consumer warpgroups of 32 columns per CTA; sequences cut in pieces take two of 64 (chunk.py). H100, torch 2.11,
# Triton 3.6, bf16, kernel time 1 x 64 / 2 x 32 / 2 x 64 columns (2026-11-25): MVE 0.396 / 0.363 / 0.456 ms, the
# Qwen3-Next-style layer 0.779 / 0.751 / 0.912, B = 1, T = 65536 in 17 pieces (both passes) 1.530 / 1.471 / 1.218
STATE_BWD_WS_DEFAULTS = {"BV": 32, "NCONS": 2, "STAGES": 2}


if HAVE_GLUON:

    @gluon.jit
    def _sbw_producer(k_desc, q_desc, tm_desc, do_desc, k_s, q_s, tm_s, do_s, ready, empty, row0, col_k, col_t,
                      col_v, n_chunks, BV: gl.constexpr, NCONS: gl.constexpr, STAGES: gl.constexpr):
        """One warp: chunk ``n_chunks - 1 - j``'s tiles into ring slot j % STAGES once the consumers released it."""
        nbytes: gl.constexpr = (k_desc.block_type.nbytes + q_desc.block_type.nbytes + tm_desc.block_type.nbytes
                                + NCONS * do_desc.block_type.nbytes)
        for j in range(n_chunks):
            s = j % STAGES
            mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)  # the first pass over the ring does not wait
            mbarrier.expect(ready.index(s), nbytes)
            r = row0 + (n_chunks - 1 - j) * 64
            _tma_load(k_desc, [r, col_k], ready.index(s), k_s.index(s))
            _tma_load(q_desc, [r, col_k], ready.index(s), q_s.index(s))
            _tma_load(tm_desc, [r, col_t], ready.index(s), tm_s.index(s))
            for c in gl.static_range(NCONS):
                _tma_load(do_desc, [r, col_v + c * BV], ready.index(s), do_s.index(NCONS * s + c))

    @gluon.jit
    def _sbw_consumer(k_s, q_s, tm_s, do_s, ready, empty, st_s, du_s, nd_s, hi_s, lo_s, dh_desc, du_desc,
                      g, beta, du, dht, dh0, row0, boh, i_nh, i_hv, col_v, col_h, n_chunks, T, scale,
                      CID: gl.constexpr, NCONS: gl.constexpr, HV: gl.constexpr, V: gl.constexpr, K: gl.constexpr,
                      BV: gl.constexpr, STAGES: gl.constexpr, USE_DHT: gl.constexpr, STORE_DH0: gl.constexpr,
                      STORE: gl.constexpr):
        """Consumer warpgroup CID: value columns ``col_v + CID BV ..`` of dO / dU (``[.., HV * V]`` rows) and
        ``col_h + CID BV ..`` of dS (dht / dh0 ``[N, HV, K, V]`` fp32, dh rows ``((boh + c) HV + i_hv) K``)."""
        L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
        LR: gl.constexpr = gl.SliceLayout(1, L)
        LC: gl.constexpr = gl.SliceLayout(0, L)
        LS: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        LSR: gl.constexpr = gl.SliceLayout(1, LS)  # A's [64, 64] tile: rows (keys), columns (queries)
        LSC: gl.constexpr = gl.SliceLayout(0, LS)
        LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L, k_width=2)  # A as the A operand
        dt: gl.constexpr = st_s.dtype
        st = st_s.index(CID)
        dus = du_s.index(CID)
        nds = nd_s.index(CID)
        his = hi_s.index(CID)
        los = lo_s.index(CID)
        o_r = gl.arange(0, 64, layout=LR)
        o_k = gl.arange(0, K, layout=LR)
        o_c = gl.arange(0, BV, layout=LC)
        col = col_v + CID * BV
        p_h = i_nh * K * V + o_k[:, None] * V + col_h + CID * BV + o_c[None, :]
        if USE_DHT:
            b_dh = gl.load(dht + p_h).to(gl.float32)  # [K, BV]
        else:
            b_dh = gl.zeros([K, BV], dtype=gl.float32, layout=L)
        zc = gl.zeros([64, BV], dtype=gl.float32, layout=L)
        zs = gl.zeros([64, 64], dtype=gl.float32, layout=LS)
        o_sr = gl.arange(0, 64, layout=LSR)
        o_sc = gl.arange(0, 64, layout=LSC)
        nb_g, nb_gn, nb_b = _chunk_rows(g, beta, row0 + (n_chunks - 1) * 64, (n_chunks - 1) * 64, T, i_hv, HV, LR)
        # loop-invariant code left inside the loop: hoisted, it stayed live across the chunk steps (spills of the
        # pieces' two 64-column consumers 172-284 -> 40-160 B, one consumer 52-104 -> 0; the pieces' recurrence at
        # B = 1, T = 65536 1.07 -> 0.95 ms, the layer's 0.67 -> 0.64, H200, bitwise the same)
        for j in tl.range(n_chunks, disable_licm=True):
            s = j % STAGES
            c = n_chunks - 1 - j
            r = row0 + c * 64
            m_r = (c * 64 + o_r) < T  # rows past the sequence: no part in dU, dS or the stores
            full = (c + 1) * 64 <= T
            b_g, b_gn, b_b = nb_g, nb_gn, nb_b
            nb_g, nb_gn, nb_b = _chunk_rows(g, beta, r - 64, (c - 1) * 64, T, i_hv, HV, LR)  # the next chunk's
            b_gr = gl.convert_layout(b_g, LSR)  # (A's rows, columns)
            b_gc = gl.convert_layout(b_g, LSC)
            b_sk = b_b * gl.exp2(gl.where(m_r, b_g, float("-inf")))  # X_k's row factors beta 2^G
            mbarrier.wait(ready.index(s), (j // STAGES) & 1)
            # A = k q^T of the chunk: off dS's chain, issued first
            b_a = warpgroup_mma(k_s.index(s), q_s.index(s).permute((1, 0)), zs, use_acc=False, is_async=True)
            if STORE:  # the previous chunk's dS store has left st (its dU store, a TMA store only if that chunk was
                # whole, may still run; only the first chunk taken, the sequence's last, can be cut)
                if (c + 2) * 64 <= T:
                    tma.store_wait(1)
                else:
                    tma.store_wait(0)
            st.store(b_dh.to(dt))
            fence_async_shared()
            if STORE:
                _tma_store(dh_desc, [((boh + c) * HV + i_hv) * K, col_h + CID * BV], st)
            b_kd = warpgroup_mma(k_s.index(s), st, zc, use_acc=False, is_async=True)  # k dS [64, BV]
            b_a = warpgroup_mma_wait(num_outstanding=1, deps=(b_a,))
            m_a = (o_sr[:, None] <= o_sc[None, :]) & ((c * 64 + o_sr) < T)[:, None] & ((c * 64 + o_sc) < T)[None, :]
            b_a = b_a * gl.exp2(gl.where(m_a, b_gc[None, :] - b_gr[:, None], float("-inf")))
            b_a = gl.convert_layout(b_a.to(dt), LA)
            b_dvo = warpgroup_mma(b_a, do_s.index(NCONS * s + CID), zc, use_acc=False, is_async=True)
            # dO's rows times scale 2^G (fp32), split in a high and a low 16-bit part for q^T (..)
            b_sr = gl.where(m_r, scale * gl.exp2(b_g), 0.0)
            b_xs = do_s.index(NCONS * s + CID).load(L).to(gl.float32) * b_sr[:, None]
            b_hi = b_xs.to(dt)
            his.store(b_hi)
            los.store((b_xs - b_hi.to(gl.float32)).to(dt))
            b_dvo, b_kd = warpgroup_mma_wait(num_outstanding=0, deps=(b_dvo, b_kd))
            b_du = b_dvo * scale + b_kd * gl.exp2(gl.where(m_r, b_gn - b_g, float("-inf")))[:, None]
            b_dud = b_du.to(dt)
            if STORE:  # the previous chunk's dU store has read dus (this chunk's dS store may still run)
                tma.store_wait(1)
                dus.store(b_dud)
            nds.store(-b_dud)
            fence_async_shared()
            # -W^T dU = k^T (beta 2^G o (Tm^T (-dU))): Tm^T (-dU) first, its rows scaled, back into nds
            b_y = warpgroup_mma(tm_s.index(s).permute((1, 0)), nds, zc, use_acc=False)
            nds.store((b_y * b_sk[:, None]).to(dt))
            fence_async_shared()
            # dS <- 2^(G_n) dS - W^T dU + q^T (hi + lo)
            b_dh = warpgroup_mma(k_s.index(s).permute((1, 0)), nds, b_dh * gl.exp2(b_gn), is_async=True)
            b_dh = warpgroup_mma(q_s.index(s).permute((1, 0)), his, b_dh, is_async=True)
            b_dh = warpgroup_mma(q_s.index(s).permute((1, 0)), los, b_dh, is_async=True)
            if STORE:
                if full:
                    _tma_store(du_desc, [r, col], dus)
                else:
                    gl.store(du + (r + o_r)[:, None] * (HV * V) + col + o_c[None, :], b_dud, mask=m_r[:, None])
            b_dh = warpgroup_mma_wait(num_outstanding=0, deps=(b_dh,))
            mbarrier.arrive(empty.index(s), count=1)
        tma.store_wait(0)
        if STORE_DH0:
            gl.store(dh0 + p_h, b_dh)

    @gluon.jit
    def _delta_state_bwd_ws_kernel(k_desc, q_desc, tm_desc, do_desc, dh_desc, du_desc, g, beta, du, dht, dh0,
                                   cu_seqlens, sub_offsets, seq_order, keep, T, scale, H: gl.constexpr,
                                   HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                                   NCONS: gl.constexpr, STAGES: gl.constexpr, IS_VARLEN: gl.constexpr,
                                   USE_DHT: gl.constexpr, STORE_DH0: gl.constexpr, STORE: gl.constexpr,
                                   ORDERED: gl.constexpr = False):
        """Grid ``(V / (NCONS BV), N HV)``; dense rows ``[B T, ..]`` or packed varlen (B = 1, ``cu_seqlens``);
        ``ORDERED``: program row i runs sequence ``seq_order[i // HV]`` (``varlen.longest_first_order``). Without
        STORE (a piece's summary) the first ``keep[i_n HV + i_hv]`` chunks only (``fused_delta_fwd.piece_cutoffs``)."""
        i_v = gl.program_id(0)
        i_nh = gl.program_id(1)
        i_n = i_nh // HV
        i_hv = i_nh % HV
        if ORDERED:
            i_n = gl.load(seq_order + i_n)
            i_nh = i_n * HV + i_hv
        i_h = i_hv // (HV // H)
        row0, T, boh = _seq_rows(cu_seqlens, sub_offsets, i_n, T, IS_VARLEN, True)  # (boh: dh's slots)
        if not STORE:  # the chunks that reach the piece's start above e^-80
            T = gl.minimum(T, gl.load(keep + i_nh) * 64)
        n_chunks = gl.cdiv(T, 64)
        dt: gl.constexpr = k_desc.dtype
        k_s = gl.allocate_shared_memory(dt, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        q_s = gl.allocate_shared_memory(dt, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        tm_s = gl.allocate_shared_memory(dt, [STAGES] + tm_desc.block_type.shape, tm_desc.layout)
        do_s = gl.allocate_shared_memory(dt, [NCONS * STAGES] + do_desc.block_type.shape, do_desc.layout)
        st_s = gl.allocate_shared_memory(dt, [NCONS, K, BV], gl.NVMMASharedLayout.get_default_for([K, BV], dt))
        tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BV], dt)
        du_s = gl.allocate_shared_memory(dt, [NCONS, 64, BV], tile)
        nd_s = gl.allocate_shared_memory(dt, [NCONS, 64, BV], tile)
        hi_s = gl.allocate_shared_memory(dt, [NCONS, 64, BV], tile)
        lo_s = gl.allocate_shared_memory(dt, [NCONS, 64, BV], tile)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=NCONS)
        col_h = i_v * NCONS * BV
        col_v = i_hv * V + col_h
        C0: gl.constexpr = 0  # partition arguments that are constants must be named constexprs
        C1: gl.constexpr = 1
        if NCONS == 2:
            gl.warp_specialize([
                (_sbw_consumer, (k_s, q_s, tm_s, do_s, ready, empty, st_s, du_s, nd_s, hi_s, lo_s, dh_desc, du_desc,
                                 g, beta, du, dht, dh0, row0, boh, i_nh, i_hv, col_v, col_h, n_chunks, T, scale, C0, NCONS,
                                 HV, V, K, BV, STAGES, USE_DHT, STORE_DH0, STORE)),
                (_sbw_consumer, (k_s, q_s, tm_s, do_s, ready, empty, st_s, du_s, nd_s, hi_s, lo_s, dh_desc, du_desc,
                                 g, beta, du, dht, dh0, row0, boh, i_nh, i_hv, col_v, col_h, n_chunks, T, scale, C1, NCONS,
                                 HV, V, K, BV, STAGES, USE_DHT, STORE_DH0, STORE)),
                (_sbw_producer, (k_desc, q_desc, tm_desc, do_desc, k_s, q_s, tm_s, do_s, ready, empty, row0, i_h * K,
                                 i_hv * 64, col_v, n_chunks, BV, NCONS, STAGES)),
            ], [4, 1], [232, 40])
        else:
            gl.warp_specialize([
                (_sbw_consumer, (k_s, q_s, tm_s, do_s, ready, empty, st_s, du_s, nd_s, hi_s, lo_s, dh_desc, du_desc,
                                 g, beta, du, dht, dh0, row0, boh, i_nh, i_hv, col_v, col_h, n_chunks, T, scale, C0, NCONS,
                                 HV, V, K, BV, STAGES, USE_DHT, STORE_DH0, STORE)),
                (_sbw_producer, (k_desc, q_desc, tm_desc, do_desc, k_s, q_s, tm_s, do_s, ready, empty, row0, i_h * K,
                                 i_hv * 64, col_v, n_chunks, BV, NCONS, STAGES)),
            ], [1], [40])


def state_bwd_ws_supported(q, k, ai, beta, do, g_cum, dht, cu_seqlens, config: dict | None = None) -> bool:
    """Whether the warp-specialized kernel takes the delta rule's state-gradient recurrence: an sm_90 GPU, Gluon, bf16
    q, k, Tm (``ai [B, T, HV, 64]``) and dO (fp16 keeps the ``tl`` kernel: its fp32 q-term product there has no
    16-bit split), beta ``[B, T, HV]``, K = 128, V a multiple of the launch's columns, a gate, contiguous tensors
    whose row offsets fit int32, 1 to 65,535 (sequence, head) pairs, an fp32 final-state cotangent if any.
    ``config``: the launch keys (``STATE_BWD_WS_DEFAULTS``)."""
    cfg = {**STATE_BWD_WS_DEFAULTS, **(config or {})}
    if not HAVE_GLUON or g_cum is None or ai is None or beta is None:
        return False
    if not (q.is_cuda and _is_sm90(q.device.index or 0)):
        return False
    if any(x.dtype != torch.bfloat16 for x in (q, k, ai, do)):
        return False
    B, T, H, K = k.shape
    HV, V = do.shape[2], do.shape[3]
    N = num_sequences(cu_seqlens, B)
    if K != 128 or V % (cfg["BV"] * cfg["NCONS"]) != 0 or N * HV > 65535 or N * HV == 0:
        return False
    if tuple(ai.shape) != (B, T, HV, 64) or tuple(beta.shape) != (B, T, HV):
        return False
    if not all(x.is_contiguous() for x in (q, k, ai, beta, do, g_cum)):
        return False
    if dht is not None and (dht.dtype != torch.float32 or not dht.is_contiguous()):
        return False
    return B * T * max(H * K, HV * K, HV * V) < 2 ** 31 and N * HV * K * V < 2 ** 31


def delta_state_bwd_ws(q, k, ai, beta, do, g_cum, scale, dht=None, need_dh0=False, cu_seqlens=None, sub_offsets=None,
                       num_sub_chunks=None, store=True, config: dict | None = None, du_out=None, seq_order=None,
                       summary_chunks=None):
    """``chunk_state_bwd`` for the delta rule (64-row chunks, dvo formed in the kernel) on the warp-specialized
    kernel, from Tm (``ai``) and beta instead of W. Call only where ``state_bwd_ws_supported`` holds. ``cu_seqlens``:
    offsets or (first row, end row) pairs (``utils.varlen_mode``); ``du_out``: du's buffer (the sequences' rows
    written, the rest untouched); ``seq_order``: the order in which the programs take the sequences given by offsets
    (``varlen.longest_first_order``, ``[N]`` int32; None: in order); ``summary_chunks`` (``store`` False): the
    chunks to run from each (sequence, value head)'s start (``[N HV]`` int32), None: all. Returns ``(dh, du, dh0)``
    as that function does: dh ``[B, NS, HV, K, V]`` and du ``[B, T, HV, V]`` in k's dtype (None with ``store``
    False), dh0 ``[N, HV, K, V]`` fp32 or None."""
    cfg = {**STATE_BWD_WS_DEFAULTS, **(config or {})}
    BV, NCONS = cfg["BV"], cfg["NCONS"]
    B, T, H, K = k.shape
    HV, V = do.shape[2], do.shape[3]
    N = num_sequences(cu_seqlens, B)
    NS = (T + BS - 1) // BS if cu_seqlens is None else num_sub_chunks
    dh = torch.empty(B, NS, HV, K, V, dtype=k.dtype, device=k.device) if store else None
    du = (du_out if du_out is not None else torch.empty(B, T, HV, V, dtype=k.dtype, device=k.device)) if store \
        else None
    dh0 = torch.empty(N, HV, K, V, dtype=torch.float32, device=k.device) if need_dh0 else None
    bf16 = k.dtype == torch.bfloat16

    def desc(x, rows, cols, block):  # a 2-D [rows, heads * dim] view, one chunk of one head per block
        return tma_desc(x, rows, cols, block, bf16)

    context_current(k.device)
    if not store and summary_chunks is None:
        summary_chunks = torch.full((N * HV,), ALL_CHUNKS, dtype=torch.int32, device=k.device)
    do_desc = desc(do, B * T, HV * V, [BS, BV])
    du_desc = desc(du, B * T, HV * V, [BS, BV]) if store else do_desc  # (store False: never stored to)
    dh_desc = desc(dh, B * NS * HV * K, V, [K, BV]) if store else do_desc
    _delta_state_bwd_ws_kernel[(V // (NCONS * BV), N * HV)](
        desc(k, B * T, H * K, [BS, K]), desc(q, B * T, H * K, [BS, K]), desc(ai, B * T, HV * 64, [BS, 64]), do_desc,
        dh_desc, du_desc, g_cum, beta, du if store else do, dht if dht is not None else do,
        dh0 if dh0 is not None else do, cu_seqlens if cu_seqlens is not None else do,
        sub_offsets if sub_offsets is not None else do, seq_order if seq_order is not None else do,
        summary_chunks if summary_chunks is not None and not store else do, T, scale, H=H,
        HV=HV, K=K, V=V, BV=BV, NCONS=NCONS, STAGES=cfg["STAGES"], IS_VARLEN=varlen_mode(cu_seqlens),
        USE_DHT=dht is not None, STORE_DH0=need_dh0, STORE=store, ORDERED=seq_order is not None, num_warps=4)
    return dh, du, dh0
