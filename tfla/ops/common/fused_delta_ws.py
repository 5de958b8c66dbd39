"""The gated delta rule's fused forward pass as a warp-specialized Gluon kernel for Hopper (sm_90): the same pass
as ``fused_delta_fwd._fused_delta_fwd_kernel`` (module docstring there; ``docs/gdn-math.md`` section 4) for the
shapes most models run, chosen by ``fused_delta_fwd.fused_delta_fwd`` where ``ws_supported`` holds (before the
prep, which then forms Tm alone: this pass forms the output's scores itself).

Notation: B batch, T time, H key heads, HV value heads, K / V head dims, N sequences, 64-row chunks, BV value
columns per consumer warpgroup.

One CTA per (sequence, value head, NCONS x BV value columns), three roles (``gl.warp_specialize``):

- a one-warp producer streams each chunk's k and q (``[64, K]``), v (``[64, BV]`` per consumer) and Tm
  (``[64, 64]``, from the prep) into a STAGES-deep ring of shared memory with TMA, ahead of the consumers, which
  release a slot when its chunk is done (``ready`` / ``empty`` mbarriers);
- NCONS consumer warpgroups each keep their ``[K, BV]`` fp32 state in registers and per chunk run
  ``A = scale causal(q k^T) o 2^(G_r - G_s)`` (off the state's chain; in registers as the output product's A
  operand), ``kS, qS = k S, q S`` (S as 16-bit in shared memory), ``y = (v - 2^G kS) beta``, ``Vnew = Tm y``,
  ``o = scale 2^G qS + A Vnew`` and ``S <- 2^(G_n) S + k^T (2^(G_n - G) Vnew)`` on asynchronous wgmma; o and Vnew
  leave through TMA stores from shared memory (rows of a chunk cut by the sequence's end: masked stores).

Why: the ``tl`` pass issues a chunk's loads at the end of the previous step and waits for all of them at its start
(Triton's software pipeliner), so a program hides none of its own load latency (``docs/performance.md``, "Where the
fused pass waits"); the producer warp runs ahead instead. Kernel time, H100, Triton 3.6, bf16, K = V = 128, Vnew
kept (2026-11-24): MVE (B = 4, T = 8192, H = HV = 16) 335 us against 481 us for the ``tl`` pass; the
Qwen3-Next-style layer's pass (6 packed sequences, 32,768 tokens, HV = 32, initial states) 658 against 969 us.
Without the TMA stores (masked register stores of o and Vnew) it was slower than the ``tl`` pass (522 / 1041 us).
With the scores formed here (172dd1e) the prep kernel takes 116 instead of 212 us at the MVE and the forward call
the layer 1.100 instead of 1.162 ms (``docs/performance.md``).

Differences from the ``tl`` pass: the gate weights ``2^(G_n - G)`` multiply Vnew (fp32, rounded once), not k, in
the state update, so the states equal the ``tl`` pass's to rounding, not bitwise.

The same kernel runs the pieces' transition pass (``PASS`` 1: ``[M | N]`` over K + V state columns, no q, no
output, 98 KB of shared memory), the backward's recomputation of Vnew and the states (``PASS`` 2: no q, no output)
and keeps the per-chunk states for the backward (``SAVE`` 2: TMA stores of the
16-bit state operand already in shared memory). One sequence cut in pieces (H100, torch 2.11, Triton 3.6, bf16,
B = 1, T = 65536, H = 16, K = V = 128, forward without grad, median do_bench, tfla alone; 2026-11-25): 1.62 ms with
the ``tl`` transitions, 1.59 with these, 1.24 with two 64-column consumer warpgroups per CTA (``fused_delta_fwd``
takes that launch for pieces).
"""
from __future__ import annotations

import functools
import threading

import torch
import triton
import triton.language as tl

from tfla.ops.common.utils import num_sequences, varlen_mode

try:  # Gluon (triton.experimental.gluon); without it the tl pass runs everywhere
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Triton 3.9 names the TMA copies async_load / async_store (3.6: async_copy_global_to_shared / _shared_to_global)
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    _tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
    # the warp_specialize form used here ([(fn, args), ...], worker warps, worker registers): Triton 3.6 and 3.9 (the
    # versions checked); earlier Gluon releases spelled it differently
    HAVE_GLUON = hasattr(gl, "warp_specialize") and tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 6)
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

BS = 64  # rows per chunk
# what a run of the pass computes (the kernels' PASS): the output (the forward), the pieces' transitions [M | N] (no q,
# no output, the final map only), or Vnew and the states alone (no q, no output: the GDN backward's recomputation when
# the forward kept FLA's saved set, fused_delta_fwd.states_from_pass)
PASS_OUTPUT, PASS_TRANSITION, PASS_STATES = 0, 1, 2
WS_DEFAULTS = {"BV": 64, "NCONS": 1, "STAGES": 2}  # measured against 2 x 32 and 1 x 32 columns: docs/performance.md


if HAVE_GLUON:

    @gluon.jit
    def _seq_rows(cu_seqlens, offsets, i_n, T, IS_VARLEN: gl.constexpr, OFFSETS: gl.constexpr):
        """Sequence i_n's first row, its length and its first 64-row chunk among all sequences' chunks (varlen:
        ``offsets[i_n]`` where OFFSETS, else 0; dense: B sequences of T rows). IS_VARLEN 1: ``cu_seqlens`` holds
        N + 1 offsets; 2: N (first row, end row) pairs (``varlen.row_pairs``: parts of sequences)."""
        if IS_VARLEN == 2:
            row0 = gl.load(cu_seqlens + 2 * i_n).to(gl.int32)
            T = gl.load(cu_seqlens + 2 * i_n + 1).to(gl.int32) - row0
            if OFFSETS:
                boh = gl.load(offsets + i_n).to(gl.int32)
            else:
                boh = i_n * 0
        elif IS_VARLEN:
            row0 = gl.load(cu_seqlens + i_n).to(gl.int32)
            T = gl.load(cu_seqlens + i_n + 1).to(gl.int32) - row0
            if OFFSETS:
                boh = gl.load(offsets + i_n).to(gl.int32)
            else:
                boh = i_n * 0
        else:
            boh = i_n * gl.cdiv(T, 64)
            row0 = i_n * T
        return row0, T, boh

    @gluon.jit
    def _chunk_gates(g, r, t0, T, i_hv, HV: gl.constexpr, LR: gl.constexpr, LSR: gl.constexpr,
                     LSC: gl.constexpr):
        """The chunk at rows ``r ..`` (``t0 ..`` of a sequence of T rows): its log2 gates G (0 past the end), G at its
        last row, and G again in the rows and the columns of a ``[64, 64]`` tile's layout (the scores')."""
        o_r = gl.arange(0, 64, layout=LR)
        o_sr = gl.arange(0, 64, layout=LSR)
        o_sc = gl.arange(0, 64, layout=LSC)
        b_g = gl.load(g + (r + o_r) * HV + i_hv, mask=(t0 + o_r) < T, other=0.0)
        b_gn = gl.load(g + (r + gl.minimum(64, T - t0) - 1) * HV + i_hv)
        b_gr = gl.load(g + (r + o_sr) * HV + i_hv, mask=(t0 + o_sr) < T, other=0.0)
        b_gc = gl.load(g + (r + o_sc) * HV + i_hv, mask=(t0 + o_sc) < T, other=0.0)
        return b_g, b_gn, b_gr, b_gc

    @gluon.jit
    def _chunk_rows(g, beta, r, t0, T, i_hv, HV: gl.constexpr, LR: gl.constexpr):
        """The log2 gates G (0 past the end), G at the last row and beta (0 past the end) of the chunk at rows
        ``r ..`` (``t0 ..`` of a sequence of T rows), every load masked off for a chunk outside ``[0, T)``: the
        loop kernels issue the next chunk's with this chunk's work, so these strided global loads no longer stall
        each 64-row step (they were 30% of the chunk-gradient kernel's stall cycles in Nsight Compute, 2026-11-25;
        timings: docs/performance.md, "The gate rows a step ahead")."""
        o_r = gl.arange(0, 64, layout=LR)
        ok = (t0 >= 0) & (t0 < T)
        m = ok & ((t0 + o_r) < T)
        b_g = gl.load(g + (r + o_r) * HV + i_hv, mask=m, other=0.0)
        b_gn = gl.load(g + (r + gl.minimum(64, T - t0) - 1) * HV + i_hv, mask=ok, other=0.0)
        b_b = gl.load(beta + (r + o_r) * HV + i_hv, mask=m, other=0.0).to(gl.float32)
        return b_g, b_gn, b_b

    @gluon.jit
    def _ws_producer(k_desc, q_desc, v_desc, t_desc, k_s, q_s, v_s, t_s, ready, empty,
                     row0, col_k, col_v, col_t, n_chunks, has_v, BV: gl.constexpr, NCONS: gl.constexpr,
                     STAGES: gl.constexpr, PASS: gl.constexpr):
        """One warp: chunk i's tiles into ring slot i % STAGES once the consumers have released it. PASS 1 (the
        transition): no q, and v only where ``has_v`` (the program's columns are value columns, not the transition's
        identity ones); PASS 2 (Vnew and the states alone): no q."""
        nb_kt: gl.constexpr = k_desc.block_type.nbytes + t_desc.block_type.nbytes  # (byte counts: constants)
        nb_v: gl.constexpr = nb_kt + NCONS * v_desc.block_type.nbytes
        for i in range(n_chunks):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # the first pass over the ring does not wait
            r = row0 + i * 64
            if PASS == 1:
                mbarrier.expect(ready.index(s), nb_v, has_v)  # one of the two
                mbarrier.expect(ready.index(s), nb_kt, not has_v)
                _tma_load(k_desc, [r, col_k], ready.index(s), k_s.index(s))
                if has_v:
                    for c in gl.static_range(NCONS):
                        _tma_load(v_desc, [r, col_v + c * BV], ready.index(s), v_s.index(NCONS * s + c))
            elif PASS == 2:
                mbarrier.expect(ready.index(s), nb_v)
                _tma_load(k_desc, [r, col_k], ready.index(s), k_s.index(s))
                for c in gl.static_range(NCONS):
                    _tma_load(v_desc, [r, col_v + c * BV], ready.index(s), v_s.index(NCONS * s + c))
            else:
                mbarrier.expect(ready.index(s), nb_v + q_desc.block_type.nbytes)
                _tma_load(k_desc, [r, col_k], ready.index(s), k_s.index(s))
                _tma_load(q_desc, [r, col_k], ready.index(s), q_s.index(s))
                for c in gl.static_range(NCONS):
                    _tma_load(v_desc, [r, col_v + c * BV], ready.index(s), v_s.index(NCONS * s + c))
            _tma_load(t_desc, [r, col_t], ready.index(s), t_s.index(s))

    @gluon.jit
    def _ws_consumer(k_s, q_s, v_s, t_s, ready, empty, st_s, y_s, vn_s, vw_s, os_s, o_desc, vn_desc, h_desc,
                     g, beta, o, v_new, h0, ht, hs, row0, boh, i_nh, i_hv, col_v, col_h, n_chunks, T, scale, eye,
                     CID: gl.constexpr, NCONS: gl.constexpr, HV: gl.constexpr, V: gl.constexpr, K: gl.constexpr,
                     BV: gl.constexpr, STAGES: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr,
                     SAVE: gl.constexpr, PASS: gl.constexpr, SLAB: gl.constexpr):
        """Consumer warpgroup CID: value columns ``col_v + CID BV ..`` of v / o / Vnew (``[.., HV * V]`` rows),
        ``col_h + CID BV ..`` of the state (h0 / ht ``[N, HV, K, V]`` fp32). PASS 1 (the transition): state columns
        ``col_h + CID BV ..`` of ``[M | N]`` (``ht [N, HV, K, K + V]``): the first K start as the identity with values
        0, the rest are v's columns ``col_h - K ..`` from a zero state; no output, only the final state. PASS 2: no
        output (SAVE's tensors and the final state alone). SAVE 1: Vnew out; 2: also the 16-bit state before each
        chunk (the products' operand in shared memory, ``h_desc`` rows
        ``((boh + i) HV + i_hv) K``). SLAB > 0: the fp32 state before every chunk i = j SLAB, j >= 1, to
        ``hs [j - 1, i_nh]`` (``[.., N HV, K, V]``; the backward's slab starts)."""
        L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
        LR: gl.constexpr = gl.SliceLayout(1, L)
        LC: gl.constexpr = gl.SliceLayout(0, L)
        LS: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        LSR: gl.constexpr = gl.SliceLayout(1, LS)  # the scores' [64, 64] tile: rows, columns
        LSC: gl.constexpr = gl.SliceLayout(0, LS)
        LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L, k_width=2)  # scores as the A operand
        TRANSITION: gl.constexpr = PASS == 1
        OUT: gl.constexpr = PASS == 0  # the output formed (q read)
        NCOL: gl.constexpr = K + V if TRANSITION else V  # the state's columns
        dt: gl.constexpr = st_s.dtype
        st = st_s.index(CID)
        ys = y_s.index(CID)
        vns = vn_s.index(CID)
        vws = vw_s.index(CID)
        oss = os_s.index(CID)
        o_r = gl.arange(0, 64, layout=LR)
        o_k = gl.arange(0, K, layout=LR)
        o_c = gl.arange(0, BV, layout=LC)
        col = col_v + CID * BV
        p_h = i_nh * K * NCOL + o_k[:, None] * NCOL + col_h + CID * BV + o_c[None, :]
        if TRANSITION:  # identity columns (state column j < K) start as I (``eye`` 1; 0: M = 0, no chunks run),
            # value columns as 0
            b_h = gl.where(o_k[:, None] == (col_h + CID * BV + o_c)[None, :], 1.0, 0.0) * eye
        elif USE_H0:
            b_h = gl.load(h0 + p_h).to(gl.float32)  # [K, BV]
        else:
            b_h = gl.zeros([K, BV], dtype=gl.float32, layout=L)
        zc = gl.zeros([64, BV], dtype=gl.float32, layout=L)
        zs = gl.zeros([64, 64], dtype=gl.float32, layout=LS)
        o_sr = gl.arange(0, 64, layout=LSR)
        o_sc = gl.arange(0, 64, layout=LSC)
        nb_g, nb_gn, nb_b = _chunk_rows(g, beta, row0, 0, T, i_hv, HV, LR)
        # one consumer: its loop-invariant code left inside the loop (hoisted, it stayed live across the chunk steps
        # and spilled 4-52 B in the sm_90 build; without: none, pass 0.56 -> 0.51 ms on the Qwen3-Next-style layer,
        # 0.30 -> 0.25 at B = 4, T = 8192, H200, bitwise the same). Two consumers (pieces) measured no better so.
        for i in tl.range(n_chunks, disable_licm=NCONS == 1):
            s = i % STAGES
            r = row0 + i * 64
            m_r = (i * 64 + o_r) < T  # rows past the sequence: beta 0, weight 0 in the update, not stored
            full = (i + 1) * 64 <= T
            b_g, b_gn, b_b = nb_g, nb_gn, nb_b
            nb_g, nb_gn, nb_b = _chunk_rows(g, beta, r + 64, (i + 1) * 64, T, i_hv, HV, LR)  # the next chunk's
            b_gr = gl.convert_layout(b_g, LSR)  # (the scores' rows and columns)
            b_gc = gl.convert_layout(b_g, LSC)
            b_eg = gl.exp2(b_g)
            if SLAB > 0:
                if (i % SLAB == 0) & (i > 0):
                    gl.store(hs + (i // SLAB - 1) * gl.num_programs(1) * (K * V) + p_h, b_h)
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            if OUT:  # the output's scores q k^T of the chunk: off the state's chain, issued first
                b_sc = warpgroup_mma(q_s.index(s), k_s.index(s).permute((1, 0)), zs, use_acc=False, is_async=True)
            if SAVE == 2:  # the previous chunk's state has left st (its Vnew and o stores may still run)
                tma.store_wait(2 if OUT else 1)
            st.store(b_h.to(dt))
            fence_async_shared()
            if SAVE == 2:
                _tma_store(h_desc, [((boh + i) * HV + i_hv) * K, col_h + CID * BV], st)
            b_ks = warpgroup_mma(k_s.index(s), st, zc, use_acc=False, is_async=True)  # [64, BV]
            if TRANSITION:
                b_ks = warpgroup_mma_wait(num_outstanding=0, deps=(b_ks,))
                b_y = -(b_ks * (b_eg * b_b)[:, None])
                if col_h >= K:  # value columns
                    b_y += v_s.index(NCONS * s + CID).load(L).to(gl.float32) * b_b[:, None]
            else:
                if OUT:
                    b_qs = warpgroup_mma(q_s.index(s), st, zc, use_acc=False, is_async=True)
                    b_ks = warpgroup_mma_wait(num_outstanding=1, deps=(b_ks,))
                else:
                    b_ks = warpgroup_mma_wait(num_outstanding=0, deps=(b_ks,))
                b_v = v_s.index(NCONS * s + CID).load(L).to(gl.float32)
                b_y = (b_v - b_ks * b_eg[:, None]) * b_b[:, None]
            ys.store(b_y.to(dt))
            fence_async_shared()
            b_vn = warpgroup_mma(t_s.index(s), ys, zc, use_acc=False, is_async=True)  # Vnew = Tm y
            if TRANSITION:
                b_vn = warpgroup_mma_wait(num_outstanding=0, deps=(b_vn,))
                vws.store((b_vn * gl.exp2(gl.where(m_r, b_gn - b_g, float("-inf")))[:, None]).to(dt))
                fence_async_shared()
                b_h = warpgroup_mma(k_s.index(s).permute((1, 0)), vws, b_h * gl.exp2(b_gn), is_async=True)
                b_h = warpgroup_mma_wait(num_outstanding=0, deps=(b_h,))
                mbarrier.arrive(empty.index(s), count=1)
            else:
                if OUT:
                    b_vn, b_qs, b_sc = warpgroup_mma_wait(num_outstanding=0, deps=(b_vn, b_qs, b_sc))
                    # scores scale causal(q k^T) o 2^(G_r - G_s), in registers as the output product's A operand
                    m_rs = o_sr[:, None] >= o_sc[None, :]
                    b_a = b_sc * gl.exp2(gl.where(m_rs, b_gr[:, None] - b_gc[None, :], float("-inf"))) * scale
                    b_a = gl.convert_layout(b_a.to(dt), LA)
                else:
                    b_vn = warpgroup_mma_wait(num_outstanding=0, deps=(b_vn,))
                b_vnd = b_vn.to(dt)
                # the previous chunk's o / Vnew stores have read vns / oss (this chunk's state store may still run)
                tma.store_wait(1 if SAVE == 2 else 0)
                vns.store(b_vnd)
                vws.store((b_vn * gl.exp2(gl.where(m_r, b_gn - b_g, float("-inf")))[:, None]).to(dt))
                fence_async_shared()
                if OUT:
                    b_o = warpgroup_mma(b_a, vns, b_qs * (b_eg * scale)[:, None], is_async=True)
                b_h = warpgroup_mma(k_s.index(s).permute((1, 0)), vws, b_h * gl.exp2(b_gn), is_async=True)
                p_tv = (r + o_r)[:, None] * (HV * V) + col + o_c[None, :]
                if SAVE:
                    if full:
                        _tma_store(vn_desc, [r, col], vns)
                    else:
                        gl.store(v_new + p_tv, b_vnd, mask=m_r[:, None])
                if OUT:
                    b_o, b_h = warpgroup_mma_wait(num_outstanding=0, deps=(b_o, b_h))
                else:
                    b_h = warpgroup_mma_wait(num_outstanding=0, deps=(b_h,))
                mbarrier.arrive(empty.index(s), count=1)
                if OUT:
                    if full:
                        oss.store(b_o.to(dt))
                        fence_async_shared()
                        _tma_store(o_desc, [r, col], oss)
                    else:
                        gl.store(o + p_tv, b_o.to(o.dtype.element_ty), mask=m_r[:, None])
        tma.store_wait(0)
        if STORE_HT:
            gl.store(ht + p_h, b_h)

    @gluon.jit
    def _fused_delta_ws_kernel(k_desc, q_desc, v_desc, t_desc, o_desc, vn_desc, h_desc, g, beta, o, v_new, h0,
                               ht, hs, cu_seqlens, chunk_offsets, seq_order, warm, T, scale, H: gl.constexpr,
                               HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                               NCONS: gl.constexpr, STAGES: gl.constexpr, IS_VARLEN: gl.constexpr,
                               USE_H0: gl.constexpr, STORE_HT: gl.constexpr, SAVE: gl.constexpr, PASS: gl.constexpr,
                               SLAB: gl.constexpr = 0, ORDERED: gl.constexpr = False):
        """Grid ``(NCOL / (NCONS BV), N HV)`` (NCOL: V, or K + V with PASS 1, the transition); dense rows
        ``[B T, ..]`` or packed varlen (B = 1, ``cu_seqlens``); ``ORDERED``: program row i runs sequence
        ``seq_order[i // HV]`` (``varlen.longest_first_order``). PASS 1 starts ``warm[piece HV + head]`` chunks into
        its piece (``fused_delta_fwd.piece_cutoffs``); where that is past the first chunk, a CTA whose columns are all
        M's stores M = 0 (the map from there to the end is below e^-80) without running a chunk."""
        i_v = gl.program_id(0)
        i_nh = gl.program_id(1)
        i_n = i_nh // HV
        i_hv = i_nh % HV
        if ORDERED:
            i_n = gl.load(seq_order + i_n)
            i_nh = i_n * HV + i_hv
        i_h = i_hv // (HV // H)
        row0, T, boh = _seq_rows(cu_seqlens, chunk_offsets, i_n, T, IS_VARLEN, SAVE == 2)  # (boh: h's slots)
        TRANSITION: gl.constexpr = PASS == 1
        col_h = i_v * NCONS * BV  # the CTA's first state column
        zero_m = (i_v < 0).to(gl.int32)  # 0 (a runtime scalar for the partitions' arguments)
        if TRANSITION:  # the chunks left out at the piece's start
            n_warm = gl.load(warm + i_nh)
            row0 = row0 + n_warm * 64
            T = T - n_warm * 64
            # after a cut the map from there to the piece's end is below e^-80: a CTA of M's columns alone stores
            # M = 0 without running the chunks
            zero_m = ((n_warm > 0) & (col_h + NCONS * BV <= K)).to(gl.int32)
            T = T * (1 - zero_m)
        eye = 1.0 - zero_m.to(gl.float32)  # the transition's identity columns start as eye I
        n_chunks = gl.cdiv(T, 64)
        dt: gl.constexpr = k_desc.dtype
        k_s = gl.allocate_shared_memory(dt, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        if PASS != 0:  # no q: its slots are k's (never read)
            q_s = k_s
        else:
            q_s = gl.allocate_shared_memory(dt, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        v_s = gl.allocate_shared_memory(dt, [NCONS * STAGES] + v_desc.block_type.shape, v_desc.layout)
        t_s = gl.allocate_shared_memory(dt, [STAGES] + t_desc.block_type.shape, t_desc.layout)
        st_s = gl.allocate_shared_memory(dt, [NCONS, K, BV], gl.NVMMASharedLayout.get_default_for([K, BV], dt))
        tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BV], dt)
        y_s = gl.allocate_shared_memory(dt, [NCONS, 64, BV], tile)
        vw_s = gl.allocate_shared_memory(dt, [NCONS, 64, BV], tile)
        if TRANSITION:  # no o / Vnew out
            vn_s = vw_s
        else:
            vn_s = gl.allocate_shared_memory(dt, [NCONS, 64, BV], tile)
        if PASS != 0:  # no o out
            os_s = vw_s
        else:
            os_s = gl.allocate_shared_memory(dt, [NCONS, 64, BV], tile)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=NCONS)
        if TRANSITION:  # its value columns (identity columns: none)
            has_v = col_h >= K
            col_v = i_hv * V + gl.maximum(col_h - K, 0)
        else:
            has_v = col_h >= 0
            col_v = i_hv * V + col_h
        C0: gl.constexpr = 0  # partition arguments that are constants must be named constexprs
        C1: gl.constexpr = 1
        if NCONS == 2:
            gl.warp_specialize([
                (_ws_consumer, (k_s, q_s, v_s, t_s, ready, empty, st_s, y_s, vn_s, vw_s, os_s, o_desc, vn_desc,
                                h_desc, g, beta, o, v_new, h0, ht, hs, row0, boh, i_nh, i_hv, col_v, col_h, n_chunks, T,
                                scale, eye, C0, NCONS, HV, V, K, BV, STAGES, USE_H0, STORE_HT, SAVE, PASS, SLAB)),
                (_ws_consumer, (k_s, q_s, v_s, t_s, ready, empty, st_s, y_s, vn_s, vw_s, os_s, o_desc, vn_desc,
                                h_desc, g, beta, o, v_new, h0, ht, hs, row0, boh, i_nh, i_hv, col_v, col_h, n_chunks, T,
                                scale, eye, C1, NCONS, HV, V, K, BV, STAGES, USE_H0, STORE_HT, SAVE, PASS, SLAB)),
                (_ws_producer, (k_desc, q_desc, v_desc, t_desc, k_s, q_s, v_s, t_s, ready, empty,
                                row0, i_h * K, col_v, i_hv * 64, n_chunks, has_v, BV, NCONS, STAGES, PASS)),
            ], [4, 1], [232, 40])
        else:
            gl.warp_specialize([
                (_ws_consumer, (k_s, q_s, v_s, t_s, ready, empty, st_s, y_s, vn_s, vw_s, os_s, o_desc, vn_desc,
                                h_desc, g, beta, o, v_new, h0, ht, hs, row0, boh, i_nh, i_hv, col_v, col_h, n_chunks, T,
                                scale, eye, C0, NCONS, HV, V, K, BV, STAGES, USE_H0, STORE_HT, SAVE, PASS, SLAB)),
                (_ws_producer, (k_desc, q_desc, v_desc, t_desc, k_s, q_s, v_s, t_s, ready, empty,
                                row0, i_h * K, col_v, i_hv * 64, n_chunks, has_v, BV, NCONS, STAGES, PASS)),
            ], [1], [40])


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple[int, int], bf16: bool):
    """The NVMMA shared layout of a TMA block (cached: building one takes ~14 us of host time, five per call)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if bf16 else gl.float16)


def tma_desc(x: torch.Tensor, rows: int, cols: int, block: list, bf16: bool):
    """The Gluon kernels' TMA descriptor of ``x`` seen as a ``[rows, cols]`` matrix in blocks of ``block`` (16-bit
    elements; ``bf16``: bfloat16, else float16). Where x is contiguous with ``rows * cols`` 16-bit elements, rows > 0,
    its base 16-byte aligned and its rows a multiple of 16 bytes, the descriptor is filled in directly, with x itself
    as its base (the launcher reads the base's address and dtype only): ``TensorDescriptor``'s own checks of the same
    conditions cost ~3.7 us of host time each (H200 host, Triton 3.6; about 30 descriptors per GDN forward +
    backward). Otherwise the dataclass is built as usual, and its checks raise for what fails."""
    layout = _smem_layout(tuple(block), bf16)
    if (rows > 0 and x.element_size() == 2 and x.numel() == rows * cols and cols % 8 == 0 and x.is_contiguous()
            and x.data_ptr() % 16 == 0):
        d = TensorDescriptor.__new__(TensorDescriptor)
        d.base, d.shape, d.strides, d.block_shape, d.layout = x, [rows, cols], [cols, 1], list(block), layout
        return d
    return TensorDescriptor(x.view(rows, cols), [rows, cols], [cols, 1], list(block), layout)


_THREAD = threading.local()


def context_current(device: torch.device) -> None:
    """Make ``device``'s primary CUDA context current on the calling thread, once per thread and device. Triton
    encodes a Gluon launch's TMA descriptors (``cuTensorMapEncodeTiled``) before its launcher makes a context
    current, so on a thread whose first CUDA work is such a launch it raised "Failed to create tensor map descriptor:
    invalid device context": autograd's device thread in a fresh process when the GDN backward's first launch is the
    Gluon states pass (H200, torch 2.11, Triton 3.6, 2026-11-29). A stream query goes through the CUDA runtime,
    which binds the primary context to the thread; it does not wait for the stream."""
    if device.type != "cuda":  # (CPU tensors: the launch-recording scripts and tests)
        return
    done = _THREAD.__dict__.setdefault("devices", set())
    if device.index not in done:
        torch.cuda.current_stream(device).query()
        done.add(device.index)


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def ws_supported(q, k, v, has_gate: bool, initial_state, cu_seqlens, save: int, config: dict | None = None) -> bool:
    """Whether the warp-specialized pass takes a forward: an sm_90 GPU, Gluon available, fp16 / bf16 q, k and v of one
    dtype, K = 128, V a multiple of the launch's columns, a gate, ``save`` 0, 1 or 2 (Vnew, the per-chunk states),
    contiguous inputs whose row offsets fit int32, 1 to 65,535 (sequence, head) pairs, an fp32 initial state if any.
    ``config``: this pass's launch keys (``WS_DEFAULTS``) or None. Decided before the prep, which then forms Tm alone
    (the pass forms the output's scores)."""
    cfg = {**WS_DEFAULTS, **(config or {})}
    if not HAVE_GLUON or save not in (0, 1, 2) or not has_gate:
        return False
    if not (q.is_cuda and _is_sm90(q.device.index or 0)):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    N = num_sequences(cu_seqlens, B)
    cols = cfg["BV"] * cfg["NCONS"]  # a CTA's state columns (the transitions' identity ones included)
    if K != 128 or K % cols or V % cols or N * HV > 65535 or N * HV == 0:
        return False
    if not all(x.is_contiguous() for x in (q, k, v)):
        return False
    if initial_state is not None and (initial_state.dtype != torch.float32 or not initial_state.is_contiguous()):
        return False
    return B * T * max(H * K, HV * V) < 2 ** 31 and N * HV * K * V < 2 ** 31


def fused_delta_pass_ws(q, k, v, g_cum, beta, ai, scale, initial_state=None, output_final_state=False,
                        cu_seqlens=None, save: int = 0, config: dict | None = None, transition: bool = False,
                        chunk_offsets=None, num_chunks: int | None = None, slab_states=None, slab: int = 0,
                        output: bool = True, v_new_out=None, seq_order=None, warm=None):
    """``fused_delta_fwd.fused_delta_pass`` (no ``a``) on the warp-specialized kernel, from the prep's ``g_cum``
    (fp32, log2, restarting every 64 rows), Tm (``ai``, q's dtype) and beta (all contiguous); the output's scores are
    formed in the kernel. ``save``: 1 Vnew, 2 also the state before each 64-row chunk (varlen: ``chunk_offsets`` /
    ``num_chunks`` of 64-row chunks). ``transition``: the pieces' ``[M | N]`` (``[N, HV, K, K + V]``, fp32) instead
    of o, from no initial state, nothing saved. ``output`` False: no q read, no o (Vnew, the states and the final state
    alone; the scores' and the output's products skipped). ``slab`` > 0 with ``slab_states`` (fp32 ``[S - 1, N HV, K,
    V]``, S = ceil(the longest sequence's chunks / slab)): each sequence's state before every ``slab``-th 64-row chunk
    but the first goes there (the backward's slab starts, ``chunk.py``). ``cu_seqlens`` may also be an ``[N, 2]`` table of (first row, end row)
    pairs (``utils.varlen_mode`` 2: the backward's slabs, with ``chunk_offsets`` and ``num_chunks``); ``v_new_out``: a
    buffer like v that Vnew's rows are written into (the rows of the sequences or pairs given; the rest untouched)
    instead of a new one; ``seq_order``: the order in which the programs take the sequences given by offsets
    (``varlen.longest_first_order``, ``[N]`` int32; None: in order); ``warm`` (with ``transition``):
    ``piece_cutoffs``' chunks to leave out per (piece, value head), None: none. Call only where ``ws_supported``
    holds (same ``config``: launch keys ``BV``, ``NCONS`` consumer warpgroups of BV columns each, ``STAGES``).
    Returns ``(o, final, v_new, h)`` as that function does."""
    cfg = {**WS_DEFAULTS, **(config or {})}
    BV, NCONS = cfg["BV"], cfg["NCONS"]
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    N = num_sequences(cu_seqlens, B)
    ncol = K + V if transition else V
    save = 0 if transition else save
    mode = PASS_TRANSITION if transition else PASS_OUTPUT if output else PASS_STATES  # the kernel's PASS
    o = torch.empty_like(v) if mode == PASS_OUTPUT else None
    v_new = (v_new_out if v_new_out is not None else torch.empty_like(v)) if save else None
    NT = (T + BS - 1) // BS if cu_seqlens is None else num_chunks
    h = torch.empty(B, NT, HV, K, V, dtype=k.dtype, device=k.device) if save == 2 else None
    final = (torch.empty(N, HV, K, ncol, dtype=torch.float32, device=q.device)
             if output_final_state or transition else None)
    if N * HV == 0:
        return o, final, v_new, h
    bf16 = q.dtype == torch.bfloat16

    def desc(x, rows, cols, block):  # a 2-D [rows, heads * dim] view, one chunk of one head per block
        return tma_desc(x, rows, cols, block, bf16)

    context_current(q.device)
    if transition and warm is None:
        warm = torch.zeros(N * HV, dtype=torch.int32, device=q.device)
    v_desc = desc(v, B * T, HV * V, [BS, BV])
    o_desc = v_desc if o is None else desc(o, B * T, HV * V, [BS, BV])  # (no o: never stored to)
    vn_desc = desc(v_new, B * T, HV * V, [BS, BV]) if v_new is not None else o_desc
    h_desc = desc(h, B * NT * HV * K, V, [K, BV]) if h is not None else o_desc
    k_desc = desc(k, B * T, H * K, [BS, K])
    q_desc = desc(q, B * T, H * K, [BS, K]) if mode == PASS_OUTPUT else k_desc  # (no output: q never read)
    _fused_delta_ws_kernel[(ncol // (NCONS * BV), N * HV)](
        k_desc, q_desc, v_desc, desc(ai, B * T, HV * BS, [BS, BS]),
        o_desc, vn_desc, h_desc, g_cum, beta, o if o is not None else v, v_new if v_new is not None else v,
        initial_state if initial_state is not None else v, final if final is not None else v,
        slab_states if slab_states is not None else v,
        cu_seqlens if cu_seqlens is not None else v, chunk_offsets if chunk_offsets is not None else v,
        seq_order if seq_order is not None else v, warm if warm is not None else v, T, scale, H=H, HV=HV, K=K, V=V,
        BV=BV, NCONS=NCONS,
        STAGES=cfg["STAGES"], IS_VARLEN=varlen_mode(cu_seqlens), USE_H0=initial_state is not None and not transition,
        STORE_HT=final is not None, SAVE=save, PASS=mode, SLAB=slab if slab_states is not None else 0,
        ORDERED=seq_order is not None, num_warps=4)
    return o, final, v_new, h
