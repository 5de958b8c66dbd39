"""The delta rule's chunk gradients after the state-gradient recurrence on Hopper (sm_90, fp16 / bf16, K = 128,
V = 64 or 128): ``chunk_dqkw._gdn_dqkw_kernel`` (dq, dk's tiled and state parts, dW, the state terms of the gate
gradient) and ``wy_bwd._wy_bwd_kernel``'s delta rule (the UT / WY backward: dk's WY part, dv, dbeta, the gate
gradient's WY part) in one Gluon kernel, chosen by ``chunk.chunk_gated_delta_rule_bwd`` where
``gdn_bwd_ws_supported`` holds; the same results up to the order of fp32 additions and where 16-bit roundings fall
(dk's WY part is rounded once before it joins the rest; dW, dk's parts and the state terms never reach HBM).

A persistent grid of one CTA per SM walks the (64-row chunk, batch x value head) tiles; in each CTA two consumer
warpgroups (8 warps; the key columns split between them: ``[64, 128]`` fp32 accumulators of 32 registers per
thread) run the tiles one after another and a producer warp loads the next tile's inputs. Per tile, with S the state
at the chunk's start, dS the gradient of the state after it, G the cumulative gate (log2, restarting every 64 rows),
n the last row, Tm = (I + A)^-1 (``ut_transform.py``), X_k = beta 2^G k, X_v = beta v (notation of ``chunk_dqkw``,
``wy_bwd``):

1. pass 1 over the value columns (64 at a time): ``dX_v = Tm^T dU`` (dv = beta dX_v, stored), then from dX_v
   (16-bit, over dU's buffer) ``Tm^T dW = -dX_v S^T`` (dW = -dU S^T is never formed) and ``dX_v V^T``;
   ``<S, dS>``;
2. the UT / WY backward (``_wy_stage``): ``Tm^T dTm = (Tm^T dW) X_k^T + dX_v X_v^T`` (dTm = dW X_k^T + dU X_v^T
   times Tm^T, the row factors applied as column scales), ``dA = -(Tm^T dTm) Tm^T``, dk's WY part
   ``beta 2^G Tm^T dW + M K + M^T K`` with ``M = dA o E o beta``, dbeta;
3. pass 2: ``s = dO Vnew^T``, ``dq_state = dO S^T``, ``dk_state = Vnew dS^T``;
4. ``q k^T``, the scores ``P = s o 2^(G_r - G_s)`` (strictly lower), ``dq = scale (2^G dq_state + P k + diag(s) k)``,
   ``dk = scale (P^T q + diag(s) q) + 2^(G_n - G) dk_state +`` the WY part, and the gate gradient's rows: the
   reverse sums that form it within the chunk (``sum_{s < t} k_s . dk_state_s``, ``sum_{r >= t}`` of the WY rows) are
   left to the epilogue's reverse cumsum (rows ``- k . dk_state`` and the WY rows, the chunk's last row carrying the
   whole chunk's ``k . dk_state`` sum and ``2^(G_n) <S, dS>``), so no ``[64, 64]`` masked sums run here.

Every input tile of a chunk has one buffer in shared memory (200 KB at V = 128, so one CTA per SM). The producer
refills each group of buffers for the next tile as soon as the consumers have released it (``_bwd_producer``): v, dU
and Tm after the UT / WY backward, S, dS, dO and Vnew after pass 2, q and k after the last product; it also places
the tile's indices and row vectors (gate, beta, l2norm's 1 / norm) in shared memory, so a tile starts without a
global load and its loads overlap the previous tile's later stages. The consumers' tile loop keeps loop-invariant
code inside (``disable_licm``: hoisted, it kept values live across the loop and spilled 40 B at the 240 registers the
consumers get). Against one CTA per tile with all loads at its start (f5ba0b2's form; a persistent form issuing the
next tile's loads from the consumers spilled and was slower): docs/performance.md, "The chunk gradients
persistent". Whole chunks leave through TMA stores, a chunk cut by its sequence's end through masked stores; Tm's
rows past the sequence's end (the next sequence's) are zeroed in shared memory before they enter a product.

Grouped value heads (``gva_sum``, K = V = 128): a CTA runs the value heads of one key head's chunk as consecutive
tiles; each but the last stores its dq and dk (16-bit) to the CTA's rows of a scratch tensor (L2-resident), the
producer loads them back into dO's and Vnew's buffers once the next tile's pass 2 has read those, and the last adds
them, takes l2norm's backward of the sum and writes ``[B, T, H, K]`` (no ``group_sum`` pass; docs/performance.md, "The
GVA sum inside the chunk-gradient kernel").
"""
from __future__ import annotations

import torch
import triton.language as tl

from tfla.ops.common.fused_delta_ws import HAVE_GLUON, _is_sm90, context_current, tma_desc
from tfla.ops.common.utils import sm_count, varlen_mode

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from tfla.ops.common.fused_delta_ws import _chunk_rows, _seq_rows, _tma_load, _tma_store

    # a CTA-wide barrier: ``gl.thread_barrier`` in Triton 3.6, ``gl.barrier`` in newer releases
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

    # a [64, 128] tile (desc's layout) over a buffer of two [64, 64] ones (the same bytes: 128-byte swizzle atoms of
    # 64 columns):
    # ``_reinterpret`` in Triton 3.6, ``reinterpret`` in newer releases
    if hasattr(gl.shared_memory_descriptor, "reinterpret"):
        @gluon.jit
        def _as_tile(buf, desc):
            return buf.reinterpret(buf.dtype, [64, 128], desc.layout)
    else:
        @gluon.jit
        def _as_tile(buf, desc):
            return buf._reinterpret(buf.dtype, [64, 128], desc.layout)

BS = 64  # rows per chunk
BVC = 64  # value columns per load
GDN_BWD_WS_DEFAULTS = {"num_warps": 8}


if HAVE_GLUON:

    @gluon.jit
    def _store_tile(desc, out_s, ptr, b_x, r, col, m_r, full, C: gl.constexpr, L: gl.constexpr):
        """``b_x [64, W]`` (layout L) to rows ``r ..`` and columns ``col ..`` of a ``[rows, C]`` tensor: through
        ``out_s`` and a TMA store for a whole chunk (the caller waits before out_s is written again), else masked
        (m_r: the rows inside the sequence)."""
        if full:
            out_s.store(b_x.to(out_s.dtype))
            fence_async_shared()
            _cta_barrier()
            _tma_store(desc, [r, col], out_s)
        else:
            o_r = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
            o_c = gl.arange(0, b_x.shape[1], layout=gl.SliceLayout(0, L))
            gl.store(ptr + (r + o_r)[:, None] * C + col + o_c[None, :], b_x.to(ptr.dtype.element_ty),
                     mask=m_r[:, None])

    @gluon.jit
    def _tma_stores_done():
        """Every TMA store this thread issued has reached global memory (``tma.store_wait`` waits only until the
        stores have read their sources), so another TMA load may read what they wrote."""
        gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\nmov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _wait_store(full):
        """Before a TMA store's source is written again: the store has read it."""
        if full:
            tma.store_wait(0)
            _cta_barrier()

    @gluon.jit
    def _to_smem(buf, b_x):
        """``b_x`` into ``buf`` as a wgmma operand (every warp's part written and visible to the async proxy)."""
        _cta_barrier()  # the buffer's previous readers (both warpgroups) are done
        _to_free_smem(buf, b_x)

    @gluon.jit
    def _to_free_smem(buf, b_x):
        """``_to_smem`` where a CTA barrier has passed since the buffer's last readers finished."""
        buf.store(b_x.to(buf.dtype))
        fence_async_shared()
        _cta_barrier()

    @gluon.jit
    def _wy_stage(k_s, tm_s, tmp_s, out_s, b_dxk, b_xv, b_db, b_g, b_gr, b_gc, b_br, o_sr, o_sc, m_r, m_sr, m_sc,
                  K: gl.constexpr, L: gl.constexpr, LS: gl.constexpr):
        """The UT / WY backward of one chunk (``wy_bwd._wy_bwd_kernel``'s delta rule, module docstring) from
        ``b_dxk = Tm^T dW`` (``[64, K]``) and ``b_xv = (Tm^T dU) V^T`` (both fp32, from pass 1): ``Tm^T dTm = (Tm^T
        dW) X_k^T + (Tm^T dU) X_v^T`` (X_k = beta 2^G k, X_v = beta v: the row factors taken as column scales of
        ``(Tm^T dW) K^T`` and ``b_xv``; dTm = dW X_k^T + dU X_v^T itself is not formed, which keeps one product and
        one trip through shared memory off the stage's chain), ``dA = -(Tm^T dTm) Tm^T`` (strictly lower), ``M = dA
        o E o beta``, dk's WY part ``beta 2^G (Tm^T dW) + M K + M^T K`` (left in out_s, 16-bit), dbeta's rows
        (returned with ``b_db``'s) and ``dgr`` (the rows' gate-gradient terms whose reverse sums enter dg). tm_s: Tm,
        tmp_s: a free ``[64, 64]`` buffer, b_br: beta's rows (0 past the end); o_sr, o_sc: the chunk's row indices in
        the sequence in the scores' row / column layouts; m_r, m_sr, m_sc: the rows inside the sequence (the
        kernel's)."""
        LR: gl.constexpr = gl.SliceLayout(1, L)
        LSR: gl.constexpr = gl.SliceLayout(1, LS)
        LSC: gl.constexpr = gl.SliceLayout(0, LS)
        b_b = gl.convert_layout(b_br, LR)
        b_bc = gl.convert_layout(b_br, LSC)
        b_sk = b_b * gl.exp2(gl.where(m_r, b_g, float("-inf")))  # beta 2^G per row
        b_skc = b_bc * gl.exp2(gl.where(m_sc, b_gc, float("-inf")))
        zs = gl.zeros([64, 64], dtype=gl.float32, layout=LS)
        _to_free_smem(out_s, b_dxk)  # (out_s free: the caller's wait for its last store ends in a barrier)
        b_dwk = warpgroup_mma(out_s, k_s.permute((1, 0)), zs, use_acc=False, is_async=True)  # (Tm^T dW) K^T
        b_kk = warpgroup_mma(k_s, k_s.permute((1, 0)), zs, use_acc=False, is_async=True)  # K K^T, off the chain
        b_dxkk = gl.sum(b_dxk * k_s.load(L).to(gl.float32), 1)  # dX_k . k per row (while the products run)
        b_dkw = b_dxk * b_sk[:, None]
        b_dwk = warpgroup_mma_wait(num_outstanding=1, deps=(b_dwk,))
        b_x = b_xv * b_bc[None, :] + b_dwk * b_skc[None, :]  # Tm^T dTm
        _to_free_smem(tmp_s, b_x)  # (tmp_s, dU's first buffer, last read by pass 1: a barrier since, in out_s's)
        b_da = warpgroup_mma(tmp_s, tm_s.permute((1, 0)), zs, use_acc=False, is_async=True)  # (Tm^T dTm) Tm^T
        m_lo = (o_sr[:, None] > o_sc[None, :]) & m_sr[:, None] & m_sc[None, :]
        b_e = gl.exp2(gl.where(m_lo, b_gr[:, None] - b_gc[None, :], float("-inf")))
        b_da, b_kk = warpgroup_mma_wait(num_outstanding=0, deps=(b_da, b_kk))
        b_dae = -b_da * b_e  # dA o E (E zero off the strictly lower part)
        _to_smem(tmp_s, b_dae * b_br[:, None])  # M
        b_dkw = warpgroup_mma(tmp_s, k_s, b_dkw, is_async=True)  # + M K
        b_dkw = warpgroup_mma(tmp_s.permute((1, 0)), k_s, b_dkw, is_async=True)  # + M^T K
        # dbeta's and the gate gradient's WY rows while M K and M^T K run
        b_dakk = b_dae * b_kk
        b_db += gl.sum(b_dakk, 1)
        b_daa = b_dakk * b_br[:, None]  # dA o A
        b_dgr = gl.sum(b_daa, 1) - gl.convert_layout(gl.sum(b_daa, 0), LSR)
        b_db = gl.convert_layout(b_db, LR) + b_dxkk * gl.exp2(gl.where(m_r, b_g, float("-inf")))
        b_dgr = gl.convert_layout(b_dgr, LR) + b_dxkk * b_sk
        b_dkw = warpgroup_mma_wait(num_outstanding=0, deps=(b_dkw,))
        _to_smem(out_s, b_dkw)
        return b_db, b_dgr

    @gluon.jit
    def _work_range(n_tiles, H: gl.constexpr, HV: gl.constexpr, GVA: gl.constexpr):
        """``(start, end, step)`` of this CTA's loop over its work: tiles i, i + grid, .. of the ``n_tiles``; with
        ``GVA`` units of the HV / H tiles of a key head's chunk (its value heads), run back to back, counted 0, 1, ..
        (``_tile_rows``)."""
        if GVA:
            n_units = n_tiles // (HV // H)
            n_mine = (n_units - gl.program_id(0) + gl.num_programs(0) - 1) // gl.num_programs(0)
            return 0, n_mine * (HV // H), 1
        else:
            return gl.program_id(0), n_tiles, gl.num_programs(0)

    @gluon.jit
    def _tile_rows(it, NT, T, cu_seqlens, tile_indices, sub_offsets, H: gl.constexpr, HV: gl.constexpr,
                   IS_VARLEN: gl.constexpr, GVA: gl.constexpr):
        """The tile of loop index ``it`` (``_work_range``; tiles chunk-major within a batch x value head): its first
        row r, the chunk's first row t0 in a sequence of T rows, its state slot, and the value and key head."""
        if GVA:
            unit = gl.program_id(0) + (it // (HV // H)) * gl.num_programs(0)
            i_t = unit % NT
            i_bh = (unit // NT) * (HV // H) + it % (HV // H)  # batch x key head's value heads in turn
        else:
            i_t = it % NT
            i_bh = it // NT
        i_hv = i_bh % HV
        if IS_VARLEN:
            i_n = gl.load(tile_indices + i_t * 2).to(gl.int32)
            i_t = gl.load(tile_indices + i_t * 2 + 1).to(gl.int32)
        else:
            i_n = i_bh // HV
        row0, T, boh = _seq_rows(cu_seqlens, sub_offsets, i_n, T, IS_VARLEN, True)
        return row0 + i_t * 64, i_t * 64, T, (boh + i_t) * HV + i_hv, i_hv, i_hv // (HV // H)

    @gluon.jit
    def _load_partials(sc_desc, do_s, vn_s, f_p):
        """The CTA's partial dq and dk (its two row blocks of the GVA scratch) into dO's and Vnew's buffers, on
        ``f_p``."""
        mbarrier.expect(f_p, 2 * sc_desc.block_type.nbytes)
        _tma_load(sc_desc, [gl.program_id(0) * 64, 0], f_p, _as_tile(do_s, sc_desc))
        _tma_load(sc_desc, [(gl.num_programs(0) + gl.program_id(0)) * 64, 0], f_p, _as_tile(vn_s, sc_desc))

    @gluon.jit
    def _bwd_producer(q_desc, k_desc, v_desc, du_desc, h_desc, dh_desc, tm_desc, do_desc, vn_desc, q_s, k_s, v_s,
                      du_s, h_s, dh_s, tm_s, do_s, vn_s, rows_s, idx_s, f_r, f_a, f_c, f_d, f_e, f_p, e_r, e_a, e_c,
                      e_e, sc_desc, g, beta, rstd_q, rstd_k, cu_seqlens, tile_indices, sub_offsets, T, NT, n_tiles,
                      H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, IS_VARLEN: gl.constexpr,
                      L2: gl.constexpr, GVA: gl.constexpr):
        """One warp: each of the CTA's tiles' inputs into the single buffers, each group as soon as the consumers
        have released the previous tile's: v, dU and Tm (``f_a``) after the WY stage, S and dS (``f_c``, per 64
        columns) and dO and Vnew (``f_d``) after pass 2, q and k (``f_e``) after the tile's last product; and the
        tile's row vectors (the gate and beta rows, l2norm's 1 / norm) and indices through shared memory (``f_r``),
        so the consumers' tiles start without a global load. With ``GVA``, a tile after the first of its key head
        also needs the partial dq and dk of the value heads before it (the CTA's rows of the scratch ``sc_desc``):
        they go into dO's and Vnew's buffers once its pass 2 is done (``f_p``), and the next tile's dO and Vnew
        wait until its last product has read them; its q and k are the tile before's, left in their buffers (the
        consumers only read them; ``f_e`` completes without a load)."""
        NV: gl.constexpr = V // 64
        LP: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
        LI: gl.constexpr = gl.BlockedLayout([8], [32], [1], [0])
        nb_a: gl.constexpr = tm_desc.block_type.nbytes + NV * (v_desc.block_type.nbytes + du_desc.block_type.nbytes)
        nb_c: gl.constexpr = h_desc.block_type.nbytes + dh_desc.block_type.nbytes
        nb_d: gl.constexpr = do_desc.block_type.nbytes + vn_desc.block_type.nbytes
        nb_e: gl.constexpr = q_desc.block_type.nbytes + k_desc.block_type.nbytes
        lo, hi, step = _work_range(n_tiles, H, HV, GVA)
        n = 0
        for it in range(lo, hi, step):
            r, t0, Tn, slot, i_hv, i_h = _tile_rows(it, NT, T, cu_seqlens, tile_indices, sub_offsets, H, HV,
                                                    IS_VARLEN, GVA)
            ph = (n & 1) ^ 1  # (the first tile does not wait)
            b_g, b_gn, b_b = _chunk_rows(g, beta, r, t0, Tn, i_hv, HV, LP)  # (0 past the sequence's end)
            if L2:
                o = gl.arange(0, 64, layout=LP)
                m = (t0 + o) < Tn
                b_rq = gl.load(rstd_q + (r + o) * H + i_h, mask=m, other=0.0)
                b_rk = gl.load(rstd_k + (r + o) * H + i_h, mask=m, other=0.0)
            o8 = gl.arange(0, 8, layout=LI)
            b_i = gl.where(o8 == 0, r, gl.where(o8 == 1, t0, gl.where(o8 == 2, Tn, gl.where(
                o8 == 3, i_hv, gl.where(o8 == 4, i_h, b_gn.to(gl.int32, bitcast=True))))))
            mbarrier.wait(e_r, ph)
            rows_s.slice(0, 64).store(b_g)
            rows_s.slice(64, 64).store(b_b)
            if L2:
                rows_s.slice(128, 64).store(b_rq)
                rows_s.slice(192, 64).store(b_rk)
            idx_s.store(b_i)
            _cta_barrier()  # (this warp's stores before its arrive)
            mbarrier.arrive(f_r, count=1)
            mbarrier.wait(e_a, ph)
            mbarrier.expect(f_a, nb_a)
            _tma_load(tm_desc, [r, i_hv * 64], f_a, tm_s)
            for iv in gl.static_range(NV):
                _tma_load(v_desc, [r, i_hv * V + iv * 64], f_a, v_s.index(iv))
                _tma_load(du_desc, [r, i_hv * V + iv * 64], f_a, du_s.index(iv))
            mbarrier.wait(e_c, ph)
            if GVA:  # (nested: tested at run time outside it, the partial sums' loads would still be built at V = 64,
                # a [64, 128] view of a [64, 64] buffer that Triton 3.9 rejects)
                # the previous tile adds the partial sums of its key head's value heads before it
                part = (n > 0) & ((n - 1) % (HV // H) != 0)
                if part:
                    _load_partials(sc_desc, do_s, vn_s, f_p)
            for iv in gl.static_range(NV):
                mbarrier.expect(f_c.index(iv), nb_c)
                _tma_load(h_desc, [slot * K, iv * 64], f_c.index(iv), h_s.index(iv))
                _tma_load(dh_desc, [slot * K, iv * 64], f_c.index(iv), dh_s.index(iv))
            if GVA:
                if part:
                    mbarrier.wait(e_e, ph)  # the previous tile's last product has read the partial sums
            for iv in gl.static_range(NV):
                mbarrier.expect(f_d.index(iv), nb_d)
                _tma_load(do_desc, [r, i_hv * V + iv * 64], f_d.index(iv), do_s.index(iv))
                _tma_load(vn_desc, [r, i_hv * V + iv * 64], f_d.index(iv), vn_s.index(iv))
            mbarrier.wait(e_e, ph)
            same_qk = False  # q and k in their buffers already: the tile before was the same chunk's key head
            if GVA:
                same_qk = n % (HV // H) != 0
            if same_qk:
                mbarrier.arrive(f_e, count=1)
            else:
                mbarrier.expect(f_e, nb_e)
                _tma_load(q_desc, [r, i_h * K], f_e, q_s)
                _tma_load(k_desc, [r, i_h * K], f_e, k_s)
            n += 1
        if GVA:  # the CTA's last tile is a key head's last value head: its partial sums after its pass 2
            if n > 0:
                mbarrier.wait(e_c, (n & 1) ^ 1)
                _load_partials(sc_desc, do_s, vn_s, f_p)

    @gluon.jit
    def _release(bar):
        """Every warp of the consumers is done with the buffers ``bar`` guards: the producer may refill them."""
        _cta_barrier()
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def _l2norm_rows(b_x, y_s, b_r, L: gl.constexpr):
        """l2norm's backward of ``[64, K]`` rows (layout L): ``r (dx - y (y . dx))``, y the normalized rows in y_s
        (the forward's output, 16-bit), b_r the rows' ``1 / norm`` (rstd, fp32; ``l2norm.py``)."""
        b_y = y_s.load(L).to(gl.float32)
        return b_r[:, None] * (b_x - b_y * gl.sum(b_y * b_x, 1)[:, None])

    @gluon.jit
    def _bwd_consumer(q_s, k_s, v_s, du_s, h_s, dh_s, tm_s, do_s, vn_s, p_s, dv_s, out_s, rows_s, idx_s, f_r, f_a,
                      f_c, f_d, f_e, f_p, e_r, e_a, e_c, e_e, dq_desc, dk_desc, dv_desc, sc_desc, dq, dk, dv, dgd,
                      dbeta, scale, n_tiles, H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
                      V: gl.constexpr, L2: gl.constexpr, GVA: gl.constexpr):
        """Two warpgroups: the CTA's tiles one after another (module docstring), each buffer group released to the
        producer after its last reader. With ``GVA`` (the value heads of a key head's chunk in turn), dq and dk of
        a value head before the last go to the CTA's scratch rows (16-bit, TMA) and the next value head's tile adds
        them (from the producer); the last writes the sum (with l2norm's backward) to dq and dk ``[.., H K]``."""
        L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 64, 16])
        LS: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
        LR: gl.constexpr = gl.SliceLayout(1, L)
        LSR: gl.constexpr = gl.SliceLayout(1, LS)
        LSC: gl.constexpr = gl.SliceLayout(0, LS)
        LB: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # [32, 64] slices of S and dS
        LI: gl.constexpr = gl.BlockedLayout([8], [32], [8], [0])  # the tile's indices, all in every thread
        NV: gl.constexpr = V // 64
        HQ: gl.constexpr = H if GVA else HV  # dq's and dk's heads
        o8 = gl.arange(0, 8, layout=LI)
        lo, hi, step = _work_range(n_tiles, H, HV, GVA)
        n = 0
        for it in tl.range(lo, hi, step, disable_licm=True):
            ph = n & 1
            sub = 0  # the value head's place in its key head's group (GVA), 0 .. HV / H - 1
            if GVA:
                sub = n % (HV // H)
            # the tile's indices and row vectors, from the producer (_bwd_producer)
            mbarrier.wait(f_r, ph)
            b_i = idx_s.load(LI)
            r = gl.sum(gl.where(o8 == 0, b_i, 0), 0)
            t0 = gl.sum(gl.where(o8 == 1, b_i, 0), 0)
            Tn = gl.sum(gl.where(o8 == 2, b_i, 0), 0)
            i_hv = gl.sum(gl.where(o8 == 3, b_i, 0), 0)
            i_h = gl.sum(gl.where(o8 == 4, b_i, 0), 0)
            b_gn = gl.sum(gl.where(o8 == 5, b_i, 0), 0).to(gl.float32, bitcast=True)
            b_g = rows_s.slice(0, 64).load(LR)
            b_gr = rows_s.slice(0, 64).load(LSR)
            b_gc = rows_s.slice(0, 64).load(LSC)
            b_bv = rows_s.slice(64, 64).load(LSR)
            if L2:
                b_rq = rows_s.slice(128, 64).load(LR)
                b_rk = rows_s.slice(192, 64).load(LR)
            _release(e_r)
            full = t0 + 64 <= Tn
            # row indices in the sequence
            o_r = t0 + gl.arange(0, 64, layout=LR)
            o_sr = t0 + gl.arange(0, 64, layout=LSR)
            o_sc = t0 + gl.arange(0, 64, layout=LSC)
            m_r = o_r < Tn
            m_sr = o_sr < Tn
            m_sc = o_sc < Tn

            # 1. pass 1: dX_v = Tm^T dU (dv = beta dX_v), then b_z = dX_v S^T (Tm^T dW = -b_z) and dX_v V^T,
            # <S, dS>
            b_z = gl.zeros([64, K], dtype=gl.float32, layout=L)
            b_xv = gl.zeros([64, 64], dtype=gl.float32, layout=LS)
            b_db = gl.zeros([64], dtype=gl.float32, layout=LSR)
            b_sds = gl.zeros([32, 64], dtype=gl.float32, layout=LB)
            mbarrier.wait(f_a, ph)
            if not full:  # Tm's rows past the sequence (the next one's) must not enter Tm^T (..)
                _to_smem(tm_s, gl.where(m_sr[:, None], tm_s.load(LS).to(gl.float32), 0.0))
            for iv in gl.static_range(NV):
                b_dxv = warpgroup_mma(tm_s.permute((1, 0)), du_s.index(iv),
                                      gl.zeros([64, 64], dtype=gl.float32, layout=LS), use_acc=False,
                                      is_async=True)  # Tm^T dU
                mbarrier.wait(f_c.index(iv), ph)
                for i in gl.static_range(K // 32):
                    b_sds += (h_s.index(iv).slice(i * 32, 32).load(LB).to(gl.float32)
                              * dh_s.index(iv).slice(i * 32, 32).load(LB).to(gl.float32))
                b_z, b_xv, b_dxv = warpgroup_mma_wait(num_outstanding=0, deps=(b_z, b_xv, b_dxv))
                b_db += gl.sum(b_dxv * v_s.index(iv).load(LS).to(gl.float32), 1)
                _to_smem(du_s.index(iv), b_dxv)  # (over dU's columns: their last reader was Tm^T dU)
                b_z = warpgroup_mma(du_s.index(iv), h_s.index(iv).permute((1, 0)), b_z, is_async=True)
                b_xv = warpgroup_mma(du_s.index(iv), v_s.index(iv).permute((1, 0)), b_xv, is_async=True)
                _wait_store(full)  # the previous dv store has read dv_s
                _store_tile(dv_desc, dv_s, dv, b_dxv * b_bv[:, None], r, i_hv * V + iv * 64, m_sr, full, HV * V,
                            LS)
            b_sdsum = gl.sum(gl.sum(b_sds, 1), 0)
            b_z, b_xv = warpgroup_mma_wait(num_outstanding=0, deps=(b_z, b_xv))

            # 2. the UT / WY backward (dk's WY part left in out_s); then v, dU, Tm are free
            mbarrier.wait(f_e, ph)
            _wait_store(True)  # the previous tile's dk store has read out_s
            b_db, b_dgr = _wy_stage(k_s, tm_s, du_s.index(0), out_s, -b_z, b_xv, b_db, b_g, b_gr, b_gc, b_bv,
                                    o_sr, o_sc, m_r, m_sr, m_sc, K, L, LS)
            _release(e_a)
            gl.store(dbeta + (r - t0 + o_r) * HV + i_hv, b_db, mask=m_r)

            # 3. pass 2: dO Vnew^T, dO S^T, Vnew dS^T; then S, dS, dO, Vnew are free
            b_s = gl.zeros([64, 64], dtype=gl.float32, layout=LS)
            b_dq = gl.zeros([64, K], dtype=gl.float32, layout=L)
            b_dks = gl.zeros([64, K], dtype=gl.float32, layout=L)
            for iv in gl.static_range(NV):
                mbarrier.wait(f_d.index(iv), ph)
                b_s = warpgroup_mma(do_s.index(iv), vn_s.index(iv).permute((1, 0)), b_s, is_async=True)
                b_dq = warpgroup_mma(do_s.index(iv), h_s.index(iv).permute((1, 0)), b_dq, is_async=True)
                b_dks = warpgroup_mma(vn_s.index(iv), dh_s.index(iv).permute((1, 0)), b_dks, is_async=True)
            b_s, b_dq, b_dks = warpgroup_mma_wait(num_outstanding=0, deps=(b_s, b_dq, b_dks))
            if GVA:
                if sub > 0:  # the previous tile's partial sums written before the producer loads them
                    _tma_stores_done()
            _release(e_c)
            # 4. the scores P (queries r in rows, keys s in columns), dq, dk, the gate gradient's rows
            b_sd = gl.sum(gl.where((o_sr[:, None] == o_sc[None, :]) & m_sr[:, None], b_s, 0.0), 1)  # dO_r . Vnew_r
            m_lo = (o_sr[:, None] > o_sc[None, :]) & m_sr[:, None] & m_sc[None, :]
            b_p = b_s * gl.exp2(gl.where(m_lo, b_gr[:, None] - b_gc[None, :], float("-inf")))
            _to_free_smem(p_s, b_p)  # (P last read by the previous tile's products: barriers since)
            b_sd = gl.convert_layout(b_sd, LR) * scale
            b_dq = b_dq * gl.exp2(gl.where(m_r, b_g, float("-inf")))[:, None]
            b_dks = b_dks * gl.exp2(gl.where(m_r, b_gn - b_g, float("-inf")))[:, None]
            # q . dq_state, and sum_s P_rs (q_r . k_s) - sum_r P_rs (q_r . k_s) from the fp32 scores and an fp32
            # q k^T (chunk_dqkw's kernel: not from the 16-bit P in dq / dk)
            b_qk = warpgroup_mma(q_s, k_s.permute((1, 0)), gl.zeros([64, 64], dtype=gl.float32, layout=LS),
                                 use_acc=False)
            b_pa = b_p * b_qk
            b_pd = gl.sum(b_pa, 1) - gl.convert_layout(gl.sum(b_pa, 0), LSR)
            # the gate gradient's rows x, whose reverse sum over the chunk the epilogue takes (gate_act /
            # cumsum): q . dq - k . dk of the tiled product, + the WY part's rows dgr, - k . dk_state; the chunk's
            # last row also carries sum_s k_s . dk_state_s + 2^(G_n) <S, dS>, so that the reverse sum gives
            # sum_{r >= t} (dgd_r + dgr_r) + sum_{s < t} k_s . dk_state_s + 2^(G_n) <S, dS> for every row t
            b_pc = gl.sum(k_s.load(L).to(gl.float32) * b_dks, 1)  # k . dk_state per row
            b_x = (gl.sum(q_s.load(L).to(gl.float32) * b_dq, 1) + gl.convert_layout(b_pd, LR)) * scale
            b_x += b_dgr - b_pc
            b_last = gl.sum(b_pc, 0) + gl.exp2(b_gn) * b_sdsum
            b_x += gl.where(o_r == gl.minimum(Tn, t0 + 64) - 1, b_last, 0.0)
            gl.store(dgd + (r - t0 + o_r) * HV + i_hv, b_x, mask=m_r)
            b_dks += out_s.load(L).to(gl.float32)  # + dk's WY part
            _cta_barrier()  # out_s read by every warp before dq's store writes it
            b_dq = warpgroup_mma(p_s, k_s, b_dq)
            b_dq = b_dq * scale + b_sd[:, None] * k_s.load(L).to(gl.float32)
            last = True  # dq and dk complete after this tile (else partial sums for the next value head)
            col = i_hv * K
            if GVA:
                last = sub == HV // H - 1
                col = i_h * K
                if sub > 0:  # + the partial sums of the value heads before (the previous tile's)
                    mbarrier.wait(f_p, (n - n // (HV // H) - 1) & 1)
                    b_dq += _as_tile(do_s, sc_desc).load(L).to(gl.float32)
            if L2:
                if last:
                    b_dq = _l2norm_rows(b_dq, q_s, b_rq, L)
            if last:
                _store_tile(dq_desc, out_s, dq, b_dq, r, col, m_r, full, HQ * K, L)
            else:
                _store_tile(sc_desc, out_s, dq, b_dq, gl.program_id(0) * 64, 0, m_r, True, K, L)
            b_dk = warpgroup_mma(p_s.permute((1, 0)), q_s, gl.zeros([64, K], dtype=gl.float32, layout=L),
                                 use_acc=False)
            b_dk = b_dk * scale + b_sd[:, None] * q_s.load(L).to(gl.float32) + b_dks  # (q loaded again: registers)
            if GVA:
                if sub > 0:
                    b_dk += _as_tile(vn_s, sc_desc).load(L).to(gl.float32)
            if L2:
                if last:
                    b_dk = _l2norm_rows(b_dk, k_s, b_rk, L)
            _release(e_e)  # q, k (and the partial sums) read by every warp
            tma_st = full  # (dk's store below goes through out_s and TMA)
            if GVA:
                tma_st = full | (sub != HV // H - 1)
            _wait_store(tma_st)
            if last:
                _store_tile(dk_desc, out_s, dk, b_dk, r, col, m_r, full, HQ * K, L)
            else:
                _store_tile(sc_desc, out_s, dk, b_dk, (gl.num_programs(0) + gl.program_id(0)) * 64, 0, m_r, True,
                            K, L)
            n += 1
        tma.store_wait(0)

    @gluon.jit
    def _gdn_bwd_ws_kernel(q_desc, k_desc, vn_desc, do_desc, du_desc, h_desc, dh_desc, dq_desc, dk_desc, v_desc,
                           tm_desc, dv_desc, sc_desc, g, beta, dq, dk, dv, dgd, dbeta, rstd_q, rstd_k,
                           cu_seqlens, tile_indices, sub_offsets, scale, T, NT, n_tiles, H: gl.constexpr,
                           HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, IS_VARLEN: gl.constexpr,
                           L2: gl.constexpr, GVA: gl.constexpr):
        """Persistent grid of at most one CTA per SM over the ``n_tiles = NT B HV`` tiles (64-row chunk, batch x value
        head; chunk-major, varlen: NT chunks from ``tile_indices``, B = 1), CTA i taking tiles i, i + grid, ..
        (``GVA``: units of a key head's HV / H value heads, ``_work_range``); 8 consumer warps and a producer warp.
        Writes dq, dk ``[B T, HV K]`` (per value head; ``GVA``: ``[B T, H K]``, summed over each key head's value
        heads through the scratch ``sc_desc``, ``[2 grid 64, K]``; with L2 the gradients of l2norm's inputs), dv
        ``[B T, HV V]``, and fp32 ``[B T, HV]`` rows: dbeta and dgd (the gate gradient's rows whose reverse sum
        within each chunk is its delta part: ``gdn_bwd_chunk_ws``)."""
        dt: gl.constexpr = q_desc.dtype
        NV: gl.constexpr = V // 64
        q_s = gl.allocate_shared_memory(dt, q_desc.block_type.shape, q_desc.layout)
        k_s = gl.allocate_shared_memory(dt, k_desc.block_type.shape, k_desc.layout)
        v_s = gl.allocate_shared_memory(dt, [NV] + v_desc.block_type.shape, v_desc.layout)
        du_s = gl.allocate_shared_memory(dt, [NV] + du_desc.block_type.shape, du_desc.layout)  # (then dTm, M)
        h_s = gl.allocate_shared_memory(dt, [NV] + h_desc.block_type.shape, h_desc.layout)
        dh_s = gl.allocate_shared_memory(dt, [NV] + dh_desc.block_type.shape, dh_desc.layout)
        do_s = gl.allocate_shared_memory(dt, [NV] + do_desc.block_type.shape, do_desc.layout)
        vn_s = gl.allocate_shared_memory(dt, [NV] + vn_desc.block_type.shape, vn_desc.layout)
        tm_s = gl.allocate_shared_memory(dt, tm_desc.block_type.shape, tm_desc.layout)
        p_s = gl.allocate_shared_memory(dt, tm_desc.block_type.shape, tm_desc.layout)
        dv_s = gl.allocate_shared_memory(dt, dv_desc.block_type.shape, dv_desc.layout)
        out_s = gl.allocate_shared_memory(dt, dq_desc.block_type.shape, dq_desc.layout)
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        rows_s = gl.allocate_shared_memory(gl.float32, [4 * 64], plain)
        idx_s = gl.allocate_shared_memory(gl.int32, [8], plain)
        # full (loads landed) and empty (buffers released) barriers of the buffer groups (_bwd_producer)
        f_r = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        e_r = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        f_a = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        f_c = gl.allocate_shared_memory(gl.int64, [NV, 1], mbarrier.MBarrierLayout())
        f_d = gl.allocate_shared_memory(gl.int64, [NV, 1], mbarrier.MBarrierLayout())
        f_e = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        e_a = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        e_c = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        e_e = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        f_p = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(f_p, count=1)
        mbarrier.init(f_r, count=1)
        mbarrier.init(e_r, count=1)
        mbarrier.init(f_a, count=1)
        mbarrier.init(f_e, count=1)
        mbarrier.init(e_a, count=1)
        mbarrier.init(e_c, count=1)
        mbarrier.init(e_e, count=1)
        for iv in gl.static_range(NV):
            mbarrier.init(f_c.index(iv), count=1)
            mbarrier.init(f_d.index(iv), count=1)
        gl.warp_specialize([
            (_bwd_consumer, (q_s, k_s, v_s, du_s, h_s, dh_s, tm_s, do_s, vn_s, p_s, dv_s, out_s, rows_s, idx_s, f_r,
                             f_a, f_c, f_d, f_e, f_p, e_r, e_a, e_c, e_e, dq_desc, dk_desc, dv_desc, sc_desc, dq, dk,
                             dv, dgd, dbeta, scale, n_tiles, H, HV, K, V, L2, GVA)),
            (_bwd_producer, (q_desc, k_desc, v_desc, du_desc, h_desc, dh_desc, tm_desc, do_desc, vn_desc, q_s, k_s,
                             v_s, du_s, h_s, dh_s, tm_s, do_s, vn_s, rows_s, idx_s, f_r, f_a, f_c, f_d, f_e, f_p, e_r,
                             e_a, e_c, e_e, sc_desc, g, beta, rstd_q, rstd_k, cu_seqlens, tile_indices, sub_offsets, T,
                             NT, n_tiles, H, HV, K, V, IS_VARLEN, L2, GVA)),
        ], [1], [40])


def gdn_bwd_ws_supported(q, k, v, beta, ai, v_new, do, du, h_sub, g_cum) -> bool:
    """Whether ``gdn_bwd_chunk_ws`` takes the delta rule's chunk gradients: an sm_90 GPU, Gluon, fp16 / bf16 q, k, v,
    Vnew, dO, dU, the states and Tm (``ai [B, T, HV, 64]``) of one dtype, K = 128, V = 64 or 128, a gate, beta
    ``[B, T, HV]``, contiguous tensors whose row offsets fit int32, at most 65,535 batch x value-head pairs."""
    if not HAVE_GLUON or g_cum is None:
        return False
    if not (q.is_cuda and _is_sm90(q.device.index or 0)):
        return False
    dt = q.dtype
    if dt not in (torch.float16, torch.bfloat16) or any(x.dtype != dt for x in (k, v, v_new, do, du, h_sub, ai)):
        return False
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    if K != 128 or V not in (64, 128) or B * HV > 65535 or B * HV == 0:
        return False
    if beta.shape != (B, T, HV) or tuple(ai.shape) != (B, T, HV, 64) or v.shape != v_new.shape:
        return False
    if not all(x.is_contiguous() for x in (q, k, v, beta, ai, v_new, do, du, h_sub, g_cum)):
        return False
    return B * T * max(H * K, HV * K, HV * V) < 2 ** 31 and h_sub.numel() < 2 ** 31


def gdn_bwd_chunk_ws(q, k, v, beta, ai, v_new, do, du, h_sub, dh_sub, g_cum, scale, cu_seqlens=None,
                     tile_indices=None, sub_offsets=None, l2=None, dv_into_du: bool = False,
                     dq_into_v_new: bool = False, gva_sum: bool = False, config: dict | None = None, out=None):
    """The delta rule's gradients after the state-gradient recurrence in one launch (module docstring), for
    ``chunk.chunk_gated_delta_rule_bwd``. Call only where ``gdn_bwd_ws_supported`` holds.

    Args: q, k ``[B, T, H, K]``; v, v_new (Vnew), do, du (the recurrence's gradient of Vnew) ``[B, T, HV, V]``;
    beta, g_cum (log2 cumulative gate restarting every 64 rows) ``[B, T, HV]``; ai (Tm) ``[B, T, HV, 64]``;
    h_sub / dh_sub: the state at / the state gradient after every 64-row chunk ``[B, NS, HV, K, V]``
    (``[1, NS_total, HV, K, V]`` varlen); cu_seqlens, tile_indices, sub_offsets: varlen (B = 1), the (sequence,
    64-row chunk) table and each sequence's first chunk; l2: ``(rstd_q, rstd_k)`` (``[B, T, H]`` fp32, from
    ``l2norm_fwd``) when q and k are l2norm's outputs and HV = H or ``gva_sum``: dq and dk are then the gradients of
    its inputs;
    out: ``(dq, dk, dbeta, dgd)`` buffers to write into (the tiles' rows written, the rest untouched; with
    ``cu_seqlens`` as (first row, end row) pairs, ``utils.varlen_mode``: the GDN backward's slabs);
    dv_into_du: dv is written over du (the caller's dU is dead after this call; one tensor of v's size less at the
    backward's peak): each CTA stores a dv tile only after its own TMA load of the same dU tile has landed; a CTA
    whose chunk a sequence's end cuts also loads the next rows (the next sequence's, dU or already dv: finite
    either way), which Tm's zeroed rows keep out of every product it stores; dq_into_v_new: dq is written over Vnew
    (the caller's Vnew is dead after this call and K = V: one tensor of v's size less at the peak), on the same terms:
    a CTA stores its dq tile after pass 2 has waited for its own loads of that Vnew tile, and the rows past a cut
    chunk's end (Vnew or already dq, finite) enter only products the row masks multiply by zero or drop;
    gva_sum: grouped value heads (HV a multiple of H, HV > H; K = V = 128) summed in the kernel: dq and dk
    ``[B, T, H, K]`` (with ``l2``, whose rows are then the key heads', l2norm's backward after the sum), no
    ``group_sum`` after it; a CTA runs a key head's value heads of a chunk in turn, passing the partial sums (16-bit,
    as ``group_sum``'s inputs) through its rows of a scratch tensor that stays in L2;
    config: ``num_warps``.
    Returns ``(dq, dk, dv, dbeta, dgd)``: dq, dk ``[B, T, HV, K]`` per value head (``[B, T, H, K]`` with
    ``gva_sum``) in q's dtype, dv like v, dbeta ``[B, T, HV]`` fp32, and dgd ``[B, T, HV]`` fp32: rows whose reverse
    cumsum within each 64-row chunk (``chunk_local_cumsum(dgd, 64, reverse=True)``) is the gate gradient's delta
    part, ``chunk_dqkw_bwd``'s dgd reverse-summed plus ``wy_bwd``'s dgam: the tiled product's ``q . dq - k . dk``,
    the WY part's rows and ``-k . dk_state``, the chunk's last row also carrying ``sum k . dk_state + 2^(G_n) <S,
    dS>`` (module docstring, step 4).
    Raises ValueError for ``l2`` with HV != H without ``gva_sum`` (the grouped heads' sum comes first:
    ``group_sum``), for ``gva_sum`` where it does not apply (HV = H, K or V not 128, with ``dq_into_v_new``)."""
    cfg = {**GDN_BWD_WS_DEFAULTS, **(config or {})}
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    NT = (T + BS - 1) // BS if cu_seqlens is None else tile_indices.shape[0]
    if gva_sum and (HV == H or HV % H or K != 128 or V != 128 or dq_into_v_new):
        raise ValueError(f"gva_sum needs HV a multiple of H above it and K = V = 128, without dq_into_v_new; got "
                         f"H = {H}, HV = {HV}, K = {K}, V = {V}, dq_into_v_new = {dq_into_v_new}")
    if l2 is not None and HV != H and not gva_sum:
        raise ValueError(f"l2 needs one value head per key head or gva_sum, got H = {H}, HV = {HV}")
    HQ = H if gva_sum else HV  # dq's and dk's heads
    if dq_into_v_new and (out is not None or K != V or v_new.dtype != q.dtype or not v_new.is_contiguous()):
        raise ValueError("dq_into_v_new needs no `out`, K = V and a contiguous Vnew in q's dtype")
    if out is not None:
        dq, dk, dbeta, dgd = out
    else:
        dq = v_new.view(B, T, HV, K) if dq_into_v_new else torch.empty(B, T, HQ, K, dtype=q.dtype, device=q.device)
        dk = torch.empty(B, T, HQ, K, dtype=q.dtype, device=q.device)
        dbeta, dgd = (torch.empty(B, T, HV, dtype=torch.float32, device=q.device) for _ in range(2))
    dv = du if dv_into_du else torch.empty_like(v)
    if NT == 0:
        return dq, dk, dv, dbeta, dgd
    bf16 = q.dtype == torch.bfloat16
    nrow = h_sub.numel() // V

    def desc(x, rows, cols, block):  # a 2-D [rows, cols] view, one chunk of one head per block
        return tma_desc(x, rows, cols, block, bf16)

    n_tiles = NT * B * HV
    grid = min(n_tiles // (HV // H) if gva_sum else n_tiles, sm_count(q))
    context_current(q.device)
    dq_desc = desc(dq, B * T, HQ * K, [BS, K])
    if gva_sum:  # each CTA's rows of partial dq, then of partial dk (L2-resident: 4.3 MB on 132 SMs)
        sc = torch.empty(2 * grid * BS, K, dtype=q.dtype, device=q.device)
        sc_desc = desc(sc, 2 * grid * BS, K, [BS, K])
    else:
        sc_desc = dq_desc  # (not used)
    _gdn_bwd_ws_kernel[(grid,)](
        desc(q, B * T, H * K, [BS, K]), desc(k, B * T, H * K, [BS, K]), desc(v_new, B * T, HV * V, [BS, BVC]),
        desc(do, B * T, HV * V, [BS, BVC]), desc(du, B * T, HV * V, [BS, BVC]), desc(h_sub, nrow, V, [K, BVC]),
        desc(dh_sub, nrow, V, [K, BVC]), dq_desc, desc(dk, B * T, HQ * K, [BS, K]),
        desc(v, B * T, HV * V, [BS, BVC]), desc(ai, B * T, HV * 64, [BS, 64]), desc(dv, B * T, HV * V, [BS, BVC]),
        sc_desc, g_cum, beta, dq, dk, dv, dgd, dbeta, l2[0] if l2 is not None else g_cum,
        l2[1] if l2 is not None else g_cum, cu_seqlens if cu_seqlens is not None else g_cum,
        tile_indices if tile_indices is not None else g_cum, sub_offsets if sub_offsets is not None else g_cum,
        scale, T, NT, n_tiles, H=H, HV=HV, K=K, V=V, IS_VARLEN=varlen_mode(cu_seqlens), L2=l2 is not None,
        GVA=gva_sum, num_warps=cfg["num_warps"])
    return dq, dk, dv, dbeta, dgd
