"""``chunk_dqkw._gdn_dqkw_kernel`` for Hopper (sm_90, fp16 / bf16, K = 128): one CTA of two warpgroups per
(64-row chunk, batch x value head) over all K, its tiles brought in by TMA and every product on wgmma. Chosen by
``chunk_dqkw.chunk_dqkw_bwd`` where ``dqkw_ws_supported`` holds; same results up to the order of fp32 additions.

Per chunk, as in ``chunk_dqkw`` (notation there): the products over the value columns, 64 at a time (dO, Vnew and
dU ``[64, 64]``, S and dS ``[K, 64]``, loaded again into the same shared memory for the next 64 columns),

    s = dO Vnew^T,  dq_state = dO S^T,  dW = -dU S^T,  dk_state = Vnew dS^T,  <S, dS>,

then, once per chunk, ``q k^T``, the scores ``P = s o 2^(G_r - G_s)`` (strictly lower), ``dq = scale (2^G dq_state +
P k + diag(s) k)``, ``dk = scale (P^T q + diag(s) q) + 2^(G_n - G) dk_state`` and the gate gradient's row sums.
The warpgroups split the key columns (accumulators ``[64, 128]`` over 8 warps: 32 fp32 registers per thread each);
the ``tl`` kernel's key tiles in the grid re-read dO, Vnew and dU and formed the scores once per key tile, and wrote
the row sums in per-tile parts the host summed. Whole chunks leave through TMA stores, a chunk cut by its
sequence's end through masked stores.
"""
from __future__ import annotations

import torch

from tfla.ops.common.fused_delta_ws import HAVE_GLUON, _is_sm90, _smem_layout

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from tfla.ops.common.fused_delta_ws import _chunk_gates, _seq_rows, _tma_load, _tma_store

    # a CTA-wide barrier: ``gl.thread_barrier`` in Triton 3.6, ``gl.barrier`` in newer releases
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

BS = 64  # rows per chunk
BVC = 64  # value columns per load
DQKW_WS_DEFAULTS = {"num_warps": 8, "maxnreg": 128}  # 128 registers: two CTAs per SM (shared memory 112 KiB)
GDN_BWD_WS_DEFAULTS = {"num_warps": 8, "maxnreg": None}


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
    def _wait_store(full):
        """Before a TMA store's source is written again: the store has read it."""
        if full:
            tma.store_wait(0)
            _cta_barrier()

    @gluon.jit
    def _to_smem(buf, b_x):
        """``b_x`` into ``buf`` as a wgmma operand (every warp's part written and visible to the async proxy)."""
        _cta_barrier()  # the buffer's previous readers (both warpgroups) are done
        buf.store(b_x.to(buf.dtype))
        fence_async_shared()
        _cta_barrier()

    @gluon.jit
    def _wy_stage(q_s, k_s, tm_s, tmp_s, out_s, b_dw, b_duv, b_db, b_g, b_gr, b_gc, beta, r, t0, T, i_hv,
                  HV: gl.constexpr, K: gl.constexpr, L: gl.constexpr, LS: gl.constexpr):
        """The UT / WY backward of one chunk (``wy_bwd._wy_bwd_kernel``'s delta rule, module docstring) from dW
        (``b_dw = dU S^T``, dW = -b_dw) and ``b_duv = dU V^T``: ``dTm = dW X_k^T + dU X_v^T`` (X_k = beta 2^G k,
        X_v = beta v: the row factors taken as column scales of ``dW K^T`` and ``dU V^T``), ``dA = -Tm^T dTm Tm^T``
        (strictly lower), ``M = dA o E o beta``, dk's WY part ``beta 2^G (Tm^T dW) + M K + M^T K`` (left in out_s,
        16-bit), dbeta's rows (returned with ``b_db``'s) and ``dgr`` (the rows' gate-gradient terms whose reverse
        sums enter dg). tm_s: Tm, tmp_s: a free ``[64, 64]`` buffer."""
        LR: gl.constexpr = gl.SliceLayout(1, L)
        LSR: gl.constexpr = gl.SliceLayout(1, LS)
        LSC: gl.constexpr = gl.SliceLayout(0, LS)
        o_r = gl.arange(0, 64, layout=LR)
        o_sr = gl.arange(0, 64, layout=LSR)
        o_sc = gl.arange(0, 64, layout=LSC)
        m_r = (t0 + o_r) < T
        m_sr = (t0 + o_sr) < T
        m_sc = (t0 + o_sc) < T
        b_b = gl.load(beta + (r + o_r) * HV + i_hv, mask=m_r, other=0.0).to(gl.float32)
        b_br = gl.load(beta + (r + o_sr) * HV + i_hv, mask=m_sr, other=0.0).to(gl.float32)
        b_bc = gl.load(beta + (r + o_sc) * HV + i_hv, mask=m_sc, other=0.0).to(gl.float32)
        b_sk = b_b * gl.exp2(gl.where(m_r, b_g, float("-inf")))  # beta 2^G per row
        b_skc = b_bc * gl.exp2(gl.where(m_sc, b_gc, float("-inf")))
        zs = gl.zeros([64, 64], dtype=gl.float32, layout=LS)
        _to_smem(out_s, -b_dw)  # dW
        b_dwk = warpgroup_mma(out_s, k_s.permute((1, 0)), zs, use_acc=False)  # dW K^T
        b_dtm = b_duv * b_bc[None, :] + b_dwk * b_skc[None, :]
        _to_smem(tmp_s, b_dtm)
        b_x = warpgroup_mma(tm_s.permute((1, 0)), tmp_s, zs, use_acc=False)  # Tm^T dTm
        _to_smem(tmp_s, b_x)
        b_da = warpgroup_mma(tmp_s, tm_s.permute((1, 0)), zs, use_acc=False)  # (Tm^T dTm) Tm^T
        m_lo = (o_sr[:, None] > o_sc[None, :]) & m_sr[:, None] & m_sc[None, :]
        b_e = gl.exp2(gl.where(m_lo, b_gr[:, None] - b_gc[None, :], float("-inf")))
        b_kk = warpgroup_mma(k_s, k_s.permute((1, 0)), zs, use_acc=False)
        b_dae = -b_da * b_e  # dA o E (E zero off the strictly lower part)
        b_dakk = b_dae * b_kk
        b_db += gl.sum(b_dakk, 1)
        b_daa = b_dakk * b_br[:, None]  # dA o A
        b_dgr = gl.sum(b_daa, 1) - gl.convert_layout(gl.sum(b_daa, 0), LSR)
        _to_smem(tmp_s, b_dae * b_br[:, None])  # M
        b_dxk = warpgroup_mma(tm_s.permute((1, 0)), out_s, gl.zeros([64, K], dtype=gl.float32, layout=L),
                              use_acc=False)  # Tm^T dW
        b_dxkk = gl.sum(b_dxk * k_s.load(L).to(gl.float32), 1)  # dX_k . k per row
        b_db = gl.convert_layout(b_db, LR) + b_dxkk * gl.exp2(gl.where(m_r, b_g, float("-inf")))
        b_dgr = gl.convert_layout(b_dgr, LR) + b_dxkk * b_sk
        b_dkw = b_dxk * b_sk[:, None]
        b_dkw = warpgroup_mma(tmp_s, k_s, b_dkw)  # + M K
        b_dkw = warpgroup_mma(tmp_s.permute((1, 0)), k_s, b_dkw)  # + M^T K
        _to_smem(out_s, b_dkw)
        return b_db, b_dgr

    @gluon.jit
    def _gdn_dqkw_ws_kernel(q_desc, k_desc, vn_desc, do_desc, du_desc, h_desc, dh_desc, dq_desc, dk_desc, dw_desc,
                            v_desc, tm_desc, dv_desc, g, beta, dq, dk, dw, dv, dgd, pst, sds, dbeta, dgam,
                            cu_seqlens, tile_indices, sub_offsets, scale, T, H: gl.constexpr, HV: gl.constexpr,
                            K: gl.constexpr, V: gl.constexpr, IS_VARLEN: gl.constexpr, WY: gl.constexpr):
        """Grid ``(64-row chunks, B x HV)`` (varlen: chunks from ``tile_indices``, B = 1); 8 warps. Without WY the
        outputs of ``chunk_dqkw._gdn_dqkw_kernel`` with one key tile: dq, dk (tiled and state parts), dw ``[B T, HV
        K]``, dgd and pst ``[B T, HV]``, sds ``[slots, HV]`` (fp32). WY: the UT / WY backward too (``_wy_stage``):
        dq, the whole dk, dv ``[B T, HV V]``, dgd, dbeta and dgam (the chunk's reverse-summed gate gradient of the
        WY and state parts, ``wy_bwd``'s) ``[B T, HV]`` fp32; dw, pst and sds are not written."""
        i_t = gl.program_id(0)
        i_bh = gl.program_id(1)
        i_hv = i_bh % HV
        i_h = i_hv // (HV // H)
        if IS_VARLEN:
            i_n = gl.load(tile_indices + i_t * 2).to(gl.int32)
            i_t = gl.load(tile_indices + i_t * 2 + 1).to(gl.int32)
        else:
            i_n = i_bh // HV
        row0, T, boh = _seq_rows(cu_seqlens, sub_offsets, i_n, T, IS_VARLEN, True)
        t0 = i_t * 64
        r = row0 + t0
        full = t0 + 64 <= T
        slot = (boh + i_t) * HV + i_hv  # this chunk's state slot (states every 64 rows)

        L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 64, 16])
        LS: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
        LR: gl.constexpr = gl.SliceLayout(1, L)
        LSR: gl.constexpr = gl.SliceLayout(1, LS)
        LSC: gl.constexpr = gl.SliceLayout(0, LS)
        LB: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # [32, 64] slices of S and dS
        dt: gl.constexpr = q_desc.dtype

        q_s = gl.allocate_shared_memory(dt, q_desc.block_type.shape, q_desc.layout)
        k_s = gl.allocate_shared_memory(dt, k_desc.block_type.shape, k_desc.layout)
        do_s = gl.allocate_shared_memory(dt, do_desc.block_type.shape, do_desc.layout)  # (WY: dv out in pass 1)
        vn_s = gl.allocate_shared_memory(dt, vn_desc.block_type.shape, vn_desc.layout)  # (WY: v in pass 1)
        du_s = gl.allocate_shared_memory(dt, du_desc.block_type.shape, du_desc.layout)  # (WY: dTm, M after pass 1)
        h_s = gl.allocate_shared_memory(dt, h_desc.block_type.shape, h_desc.layout)
        dh_s = gl.allocate_shared_memory(dt, dh_desc.block_type.shape, dh_desc.layout)
        p_s = gl.allocate_shared_memory(dt, [64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], dt))  # (WY: Tm)
        out_s = gl.allocate_shared_memory(dt, dq_desc.block_type.shape, dq_desc.layout)
        bar_qk = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        bar_v = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        bar_w = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar_qk, count=1)
        mbarrier.init(bar_v, count=1)
        mbarrier.init(bar_w, count=1)

        BVC: gl.constexpr = h_desc.block_type.shape[1]  # value columns per load (64)
        NV: gl.constexpr = V // BVC
        nb_w: gl.constexpr = du_desc.block_type.nbytes + h_desc.block_type.nbytes + dh_desc.block_type.nbytes
        nb_wy: gl.constexpr = nb_w + v_desc.block_type.nbytes
        nb_v: gl.constexpr = do_desc.block_type.nbytes + vn_desc.block_type.nbytes
        col_v = i_hv * V
        # pass 1 (dW, <S, dS>; WY: dU V^T, dv) over the value columns first to last, pass 2 (the rest) last to first:
        # pass 2 starts on the S and dS columns pass 1 ended with, its first dO and Vnew columns fetched with pass 1's
        # first tiles (WY: after pass 1, whose v takes Vnew's buffer)
        if WY:
            mbarrier.expect(bar_w, nb_wy + tm_desc.block_type.nbytes)
            _tma_load(tm_desc, [r, i_hv * 64], bar_w, p_s)
            _tma_load(v_desc, [r, col_v], bar_w, vn_s)
        else:
            mbarrier.expect(bar_w, nb_w)
        _tma_load(du_desc, [r, col_v], bar_w, du_s)
        _tma_load(h_desc, [slot * K, 0], bar_w, h_s)
        _tma_load(dh_desc, [slot * K, 0], bar_w, dh_s)
        mbarrier.expect(bar_qk, q_desc.block_type.nbytes + k_desc.block_type.nbytes)
        _tma_load(q_desc, [r, i_h * K], bar_qk, q_s)
        _tma_load(k_desc, [r, i_h * K], bar_qk, k_s)
        if not WY:
            mbarrier.expect(bar_v, nb_v)
            _tma_load(do_desc, [r, col_v + (NV - 1) * BVC], bar_v, do_s)
            _tma_load(vn_desc, [r, col_v + (NV - 1) * BVC], bar_v, vn_s)

        o_r = gl.arange(0, 64, layout=LR)
        m_r = (t0 + o_r) < T
        o_sr = gl.arange(0, 64, layout=LSR)
        m_sr = (t0 + o_sr) < T
        b_dw = gl.zeros([64, K], dtype=gl.float32, layout=L)  # dU S^T
        b_sds = gl.zeros([32, BVC], dtype=gl.float32, layout=LB)  # <S, dS>
        b_duv = gl.zeros([64, 64], dtype=gl.float32, layout=LS)  # dU V^T (WY)
        b_db = gl.zeros([64], dtype=gl.float32, layout=LSR)  # dbeta's rows (WY)
        if WY:
            b_bv = gl.load(beta + (r + o_sr) * HV + i_hv, mask=m_sr, other=0.0).to(gl.float32)
        for iv in gl.static_range(NV):
            if iv > 0:  # the previous columns' products have read the buffers
                _cta_barrier()
                if WY:
                    mbarrier.expect(bar_w, nb_wy)
                    _tma_load(v_desc, [r, col_v + iv * BVC], bar_w, vn_s)
                else:
                    mbarrier.expect(bar_w, nb_w)
                _tma_load(du_desc, [r, col_v + iv * BVC], bar_w, du_s)
                _tma_load(h_desc, [slot * K, iv * BVC], bar_w, h_s)
                _tma_load(dh_desc, [slot * K, iv * BVC], bar_w, dh_s)
            mbarrier.wait(bar_w, iv & 1)
            if WY and iv == 0 and not full:  # Tm's rows past the sequence (the next one's) must not enter Tm^T (..)
                _to_smem(p_s, gl.where(m_sr[:, None], p_s.load(LS).to(gl.float32), 0.0))
            b_dw = warpgroup_mma(du_s, h_s.permute((1, 0)), b_dw, is_async=True)
            if WY:
                b_duv = warpgroup_mma(du_s, vn_s.permute((1, 0)), b_duv, is_async=True)
                b_dxv = warpgroup_mma(p_s.permute((1, 0)), du_s, gl.zeros([64, 64], dtype=gl.float32, layout=LS),
                                      use_acc=False, is_async=True)  # Tm^T dU
            for i in gl.static_range(K // 32):
                b_sds += (h_s.slice(i * 32, 32).load(LB).to(gl.float32)
                          * dh_s.slice(i * 32, 32).load(LB).to(gl.float32))
            if WY:
                b_dw, b_duv, b_dxv = warpgroup_mma_wait(num_outstanding=0, deps=(b_dw, b_duv, b_dxv))
                b_db += gl.sum(b_dxv * vn_s.load(LS).to(gl.float32), 1)
                _wait_store(full)  # the previous columns' dv store has read do_s
                _store_tile(dv_desc, do_s, dv, b_dxv * b_bv[:, None], r, col_v + iv * BVC, m_sr, full, HV * V, LS)
            else:
                b_dw = warpgroup_mma_wait(num_outstanding=0, deps=(b_dw,))
        b_sdsum = gl.sum(gl.sum(b_sds, 1), 0)
        b_g, b_gn, b_gr, b_gc = _chunk_gates(g, r, t0, T, i_hv, HV, LR, LSR, LSC)
        if WY:
            _wait_store(full)
            _cta_barrier()
            mbarrier.expect(bar_v, nb_v)
            _tma_load(do_desc, [r, col_v + (NV - 1) * BVC], bar_v, do_s)
            _tma_load(vn_desc, [r, col_v + (NV - 1) * BVC], bar_v, vn_s)
            mbarrier.wait(bar_qk, 0)
            b_db, b_dgr = _wy_stage(q_s, k_s, p_s, du_s, out_s, b_dw, b_duv, b_db, b_g, b_gr, b_gc, beta, r, t0, T,
                                    i_hv, HV, K, L, LS)
            gl.store(dbeta + (r + o_r) * HV + i_hv, b_db, mask=m_r)
        else:
            _store_tile(dw_desc, out_s, dw, -b_dw, r, i_hv * K, m_r, full, HV * K, L)
            gl.store(sds + slot, b_sdsum)

        b_s = gl.zeros([64, 64], dtype=gl.float32, layout=LS)  # dO Vnew^T
        b_dq = gl.zeros([64, K], dtype=gl.float32, layout=L)  # dO S^T
        b_dks = gl.zeros([64, K], dtype=gl.float32, layout=L)  # Vnew dS^T
        for j in gl.static_range(NV):
            iv = NV - 1 - j
            if j > 0:
                _cta_barrier()
                mbarrier.expect(bar_v, nb_v + h_desc.block_type.nbytes + dh_desc.block_type.nbytes)
                _tma_load(do_desc, [r, col_v + iv * BVC], bar_v, do_s)
                _tma_load(vn_desc, [r, col_v + iv * BVC], bar_v, vn_s)
                _tma_load(dh_desc, [slot * K, iv * BVC], bar_v, dh_s)
                _tma_load(h_desc, [slot * K, iv * BVC], bar_v, h_s)
            mbarrier.wait(bar_v, j & 1)
            b_s = warpgroup_mma(do_s, vn_s.permute((1, 0)), b_s, is_async=True)
            b_dq = warpgroup_mma(do_s, h_s.permute((1, 0)), b_dq, is_async=True)
            b_dks = warpgroup_mma(vn_s, dh_s.permute((1, 0)), b_dks, is_async=True)
            b_s, b_dq, b_dks = warpgroup_mma_wait(num_outstanding=0, deps=(b_s, b_dq, b_dks))

        # the scores P (queries r in rows, keys s in columns) and diag(s)
        o_sc = gl.arange(0, 64, layout=LSC)
        m_sc = (t0 + o_sc) < T
        b_sd = gl.sum(gl.where((o_sr[:, None] == o_sc[None, :]) & m_sr[:, None], b_s, 0.0), 1)  # dO_r . Vnew_r
        m_lo = (o_sr[:, None] > o_sc[None, :]) & m_sr[:, None] & m_sc[None, :]
        b_p = b_s * gl.exp2(gl.where(m_lo, b_gr[:, None] - b_gc[None, :], float("-inf")))
        _to_smem(p_s, b_p)
        b_sd = gl.convert_layout(b_sd, LR) * scale
        b_dq = b_dq * gl.exp2(gl.where(m_r, b_g, float("-inf")))[:, None]
        b_dks = b_dks * gl.exp2(gl.where(m_r, b_gn - b_g, float("-inf")))[:, None]

        mbarrier.wait(bar_qk, 0)
        # the gate gradient's rows: q . dq_state, and sum_s P_rs (q_r . k_s) - sum_r P_rs (q_r . k_s) from the fp32
        # scores and an fp32 q k^T (chunk_dqkw's kernel: not from the 16-bit P in dq / dk)
        b_qk = warpgroup_mma(q_s, k_s.permute((1, 0)), gl.zeros([64, 64], dtype=gl.float32, layout=LS),
                             use_acc=False)
        b_pa = b_p * b_qk
        b_pd = gl.sum(b_pa, 1) - gl.convert_layout(gl.sum(b_pa, 0), LSR)
        b_dg = (gl.sum(q_s.load(L).to(gl.float32) * b_dq, 1) + gl.convert_layout(b_pd, LR)) * scale
        gl.store(dgd + (r + o_r) * HV + i_hv, b_dg, mask=m_r)
        b_pst = gl.sum(k_s.load(L).to(gl.float32) * b_dks, 1)  # k_s . dk_state_s
        if WY:
            # the chunk's gate gradient of the state and WY parts, reverse-summed (wy_bwd's): for rows t,
            # sum_{s < t} P_s + sum_{r >= t} dgr_r + 2^(G_n) <S, dS>, sums over masks
            b_pc = gl.convert_layout(b_pst, LSC)
            b_dgc = gl.convert_layout(b_dgr, LSC)
            m_ge = o_sc[None, :] >= o_sr[:, None]  # [t, r]: r >= t
            b_dgm = gl.sum(gl.where(m_ge, 0.0, b_pc[None, :]) + gl.where(m_ge, b_dgc[None, :], 0.0), 1)
            b_dgm += gl.exp2(b_gn) * b_sdsum
            gl.store(dgam + (r + o_sr) * HV + i_hv, b_dgm, mask=m_sr)
            b_dks += out_s.load(L).to(gl.float32)  # + dk's WY part
            _cta_barrier()  # out_s read by every warp before dq's store writes it
        else:
            gl.store(pst + (r + o_r) * HV + i_hv, b_pst, mask=m_r)
            _wait_store(full)
        b_dq = warpgroup_mma(p_s, k_s, b_dq)
        b_dq = b_dq * scale + b_sd[:, None] * k_s.load(L).to(gl.float32)
        _store_tile(dq_desc, out_s, dq, b_dq, r, i_hv * K, m_r, full, HV * K, L)
        b_dk = warpgroup_mma(p_s.permute((1, 0)), q_s, gl.zeros([64, K], dtype=gl.float32, layout=L), use_acc=False)
        b_dk = b_dk * scale + b_sd[:, None] * q_s.load(L).to(gl.float32) + b_dks  # (q loaded again: registers)
        _wait_store(full)
        _store_tile(dk_desc, out_s, dk, b_dk, r, i_hv * K, m_r, full, HV * K, L)
        _wait_store(full)


def dqkw_ws_supported(q, k, v_new, do, du, h_sub, g_cum, dq_dtype, dk_dtype, dw, config: dict | None = None) -> bool:
    """Whether ``_gdn_dqkw_ws_kernel`` takes ``chunk_dqkw_bwd``: an sm_90 GPU, Gluon, fp16 / bf16 inputs of one dtype
    (dq, dk and dW in it too), K = 128, V a multiple of 64, a gate, contiguous tensors whose row offsets fit int32,
    at most 65,535 batch x value-head pairs. ``config``: ``DQKW_WS_DEFAULTS`` keys or None."""
    if not HAVE_GLUON or g_cum is None:
        return False
    if not (q.is_cuda and _is_sm90(q.device.index or 0)):
        return False
    dt = q.dtype
    if dt not in (torch.float16, torch.bfloat16) or (dq_dtype or dt) != dt or (dk_dtype or dt) != dt:
        return False
    if any(x.dtype != dt for x in (k, v_new, do, du, h_sub)) or (dw is not None and dw.dtype != dt):
        return False
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    if K != 128 or V % BVC != 0 or B * HV > 65535 or B * HV == 0:
        return False
    tensors = (q, k, v_new, do, du, h_sub, g_cum) + ((dw,) if dw is not None else ())
    if not all(x.is_contiguous() for x in tensors):
        return False
    return B * T * max(H * K, HV * K, HV * V) < 2 ** 31 and h_sub.numel() < 2 ** 31


def gdn_bwd_ws_supported(q, k, v, beta, ai, v_new, do, du, h_sub, g_cum) -> bool:
    """Whether ``gdn_bwd_chunk_ws`` (the dq / dk / dW stage and the UT / WY backward in one kernel) takes the delta
    rule's chunk gradients: ``dqkw_ws_supported``'s conditions, v and Tm (``ai [B, T, HV, 64]``) in q's dtype and
    beta ``[B, T, HV]``, all contiguous."""
    if not dqkw_ws_supported(q, k, v_new, do, du, h_sub, g_cum, None, None, None):
        return False
    B, T, HV = beta.shape[:3] if beta.dim() == 3 else (None, None, None)
    if beta.dim() != 3 or tuple(ai.shape) != (B, T, HV, 64) or tuple(v.shape) != tuple(v_new.shape):
        return False
    return v.dtype == q.dtype and ai.dtype == q.dtype and all(x.is_contiguous() for x in (v, ai, beta))


def _launch(q, k, v_new, do, du, h_sub, dh_sub, g_cum, scale, dq, dk, dw, dgd, pst, sds, cu_seqlens, tile_indices,
            sub_offsets, NT, config, wy=None):
    """``_gdn_dqkw_ws_kernel`` over NT chunks; ``wy``: ``(v, beta, ai, dv, dbeta, dgam)`` for the WY mode."""
    cfg = {**(DQKW_WS_DEFAULTS if wy is None else GDN_BWD_WS_DEFAULTS), **(config or {})}
    cfg.pop("WY", None)
    launch = {"num_warps": cfg["num_warps"]} | ({"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {})
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    bf16 = q.dtype == torch.bfloat16
    nrow = h_sub.numel() // V

    def desc(x, rows, cols, block):  # a 2-D [rows, cols] view, one chunk of one head per block
        return TensorDescriptor(x.view(rows, cols), [rows, cols], [cols, 1], block, _smem_layout(tuple(block), bf16))

    dq_d, dk_d = desc(dq, B * T, HV * K, [BS, K]), desc(dk, B * T, HV * K, [BS, K])
    if wy is not None:
        v, beta, ai, dv, dbeta, dgam = wy
        v_d, tm_d, dv_d = (desc(v, B * T, HV * V, [BS, BVC]), desc(ai, B * T, HV * 64, [BS, 64]),
                           desc(dv, B * T, HV * V, [BS, BVC]))
        dw_d, dw, pst, sds = dq_d, dq, dgd, dgd  # (not written in this mode)
    else:
        dw_d = desc(dw, B * T, HV * K, [BS, K])
        v_d = tm_d = dv_d = dq_d  # (not read in this mode)
        beta, dv, dbeta, dgam = g_cum, dq, dgd, dgd
    _gdn_dqkw_ws_kernel[(NT, B * HV)](
        desc(q, B * T, H * K, [BS, K]), desc(k, B * T, H * K, [BS, K]), desc(v_new, B * T, HV * V, [BS, BVC]),
        desc(do, B * T, HV * V, [BS, BVC]), desc(du, B * T, HV * V, [BS, BVC]), desc(h_sub, nrow, V, [K, BVC]),
        desc(dh_sub, nrow, V, [K, BVC]), dq_d, dk_d, dw_d, v_d, tm_d, dv_d, g_cum, beta, dq, dk, dw, dv, dgd, pst,
        sds, dbeta, dgam, cu_seqlens if cu_seqlens is not None else g_cum,
        tile_indices if tile_indices is not None else g_cum, sub_offsets if sub_offsets is not None else g_cum,
        scale, T, H=H, HV=HV, K=K, V=V, IS_VARLEN=cu_seqlens is not None, WY=wy is not None,
        **launch)


def chunk_dqkw_ws(q, k, v_new, do, du, h_sub, dh_sub, g_cum, scale, dq, dk, dw, dgd, pst, sds, cu_seqlens,
                  tile_indices, sub_offsets, NT: int, config: dict | None = None) -> None:
    """Launch ``_gdn_dqkw_ws_kernel`` into the given outputs (``chunk_dqkw_bwd``'s, with one key tile: dgd / pst
    ``[B, T, HV]``, sds ``[slots, HV]``). Call only where ``dqkw_ws_supported`` holds."""
    _launch(q, k, v_new, do, du, h_sub, dh_sub, g_cum, scale, dq, dk, dw, dgd, pst, sds, cu_seqlens, tile_indices,
            sub_offsets, NT, config)


def gdn_bwd_chunk_ws(q, k, v, beta, ai, v_new, do, du, h_sub, dh_sub, g_cum, scale, cu_seqlens=None,
                     tile_indices=None, sub_offsets=None, config: dict | None = None):
    """The delta rule's gradients after the state-gradient recurrence in one launch: ``chunk_dqkw_bwd`` and
    ``wy_bwd`` (delta rule) together, for ``chunk.chunk_gated_delta_rule_bwd``. Call only where
    ``gdn_bwd_ws_supported`` holds.

    Args: as ``chunk_dqkw_bwd`` (q, k ``[B, T, H, K]``; v_new, do, du ``[B, T, HV, V]``; h_sub / dh_sub ``[B, NS,
    HV, K, V]``; g_cum ``[B, T, HV]``), with v ``[B, T, HV, V]``, beta ``[B, T, HV]`` and ai (Tm) ``[B, T, HV, 64]``.
    Returns ``(dq, dk, dv, dbeta, dgd, dgam)``: dq, dk ``[B, T, HV, K]`` per value head in q's dtype, dv like v,
    dbeta ``[B, T, HV]`` fp32, dgd (``q . dq - k . dk`` of the tiled product, ``chunk_dqkw_bwd``'s) and dgam (the
    state and WY parts of the gate gradient, the chunk's reverse sum included, ``wy_bwd``'s) ``[B, T, HV]`` fp32."""
    B, T, H, K = q.shape
    HV = do.shape[2]
    NT = (T + BS - 1) // BS if cu_seqlens is None else tile_indices.shape[0]
    dq = torch.empty(B, T, HV, K, dtype=q.dtype, device=q.device)
    dk = torch.empty_like(dq)
    dv = torch.empty_like(v)
    dbeta, dgd, dgam = (torch.empty(B, T, HV, dtype=torch.float32, device=q.device) for _ in range(3))
    if NT > 0:
        _launch(q, k, v_new, do, du, h_sub, dh_sub, g_cum, scale, dq, dk, None, dgd, None, None, cu_seqlens,
                tile_indices, sub_offsets, NT, config, wy=(v, beta, ai, dv, dbeta, dgam))
    return dq, dk, dv, dbeta, dgd, dgam
