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
DQKW_WS_DEFAULTS = {"num_warps": 8}


if HAVE_GLUON:

    @gluon.jit
    def _store_tile(desc, out_s, ptr, b_x, r, col, m_r, full, C: gl.constexpr, L: gl.constexpr):
        """``b_x [64, 128]`` (layout L) to rows ``r ..`` and columns ``col ..`` of a ``[rows, C]`` tensor: through
        ``out_s`` and a TMA store for a whole chunk (the caller waits before out_s is written again), else masked."""
        if full:
            out_s.store(b_x.to(out_s.dtype))
            fence_async_shared()
            _cta_barrier()
            _tma_store(desc, [r, col], out_s)
        else:
            o_r = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
            o_c = gl.arange(0, 128, layout=gl.SliceLayout(0, L))
            gl.store(ptr + (r + o_r)[:, None] * C + col + o_c[None, :], b_x.to(ptr.dtype.element_ty),
                     mask=m_r[:, None])

    @gluon.jit
    def _wait_store(full):
        """Before ``out_s`` is written again: the previous TMA store has read it."""
        if full:
            tma.store_wait(0)
            _cta_barrier()

    @gluon.jit
    def _gdn_dqkw_ws_kernel(q_desc, k_desc, vn_desc, do_desc, du_desc, h_desc, dh_desc, dq_desc, dk_desc, dw_desc,
                            g, dq, dk, dw, dgd, pst, sds, cu_seqlens, tile_indices, sub_offsets, scale, T,
                            H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                            IS_VARLEN: gl.constexpr):
        """Grid ``(64-row chunks, B x HV)`` (varlen: chunks from ``tile_indices``, B = 1); 8 warps. Outputs as
        ``chunk_dqkw._gdn_dqkw_kernel``'s with one key tile: dq, dk, dw ``[B T, HV K]``, dgd and pst ``[B T, HV]``,
        sds ``[slots, HV]`` (fp32)."""
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
        do_s = gl.allocate_shared_memory(dt, do_desc.block_type.shape, do_desc.layout)
        vn_s = gl.allocate_shared_memory(dt, vn_desc.block_type.shape, vn_desc.layout)
        du_s = gl.allocate_shared_memory(dt, du_desc.block_type.shape, du_desc.layout)
        h_s = gl.allocate_shared_memory(dt, h_desc.block_type.shape, h_desc.layout)
        dh_s = gl.allocate_shared_memory(dt, dh_desc.block_type.shape, dh_desc.layout)
        p_s = gl.allocate_shared_memory(dt, [64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], dt))
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
        nb_v: gl.constexpr = do_desc.block_type.nbytes + vn_desc.block_type.nbytes
        col_v = i_hv * V
        # pass 1 (dW, <S, dS>) over the value columns first to last, pass 2 (the rest) last to first: pass 2 starts
        # on the S and dS columns pass 1 ended with, its first dO and Vnew columns fetched with pass 1's first tiles
        mbarrier.expect(bar_w, nb_w)
        _tma_load(du_desc, [r, col_v], bar_w, du_s)
        _tma_load(h_desc, [slot * K, 0], bar_w, h_s)
        _tma_load(dh_desc, [slot * K, 0], bar_w, dh_s)
        mbarrier.expect(bar_qk, q_desc.block_type.nbytes + k_desc.block_type.nbytes)
        _tma_load(q_desc, [r, i_h * K], bar_qk, q_s)
        _tma_load(k_desc, [r, i_h * K], bar_qk, k_s)
        mbarrier.expect(bar_v, nb_v)
        _tma_load(do_desc, [r, col_v + (NV - 1) * BVC], bar_v, do_s)
        _tma_load(vn_desc, [r, col_v + (NV - 1) * BVC], bar_v, vn_s)

        b_dw = gl.zeros([64, K], dtype=gl.float32, layout=L)  # dU S^T
        b_sds = gl.zeros([32, BVC], dtype=gl.float32, layout=LB)  # <S, dS>
        for iv in gl.static_range(NV):
            if iv > 0:  # the previous columns' product has read the buffers
                _cta_barrier()
                mbarrier.expect(bar_w, nb_w)
                _tma_load(du_desc, [r, col_v + iv * BVC], bar_w, du_s)
                _tma_load(h_desc, [slot * K, iv * BVC], bar_w, h_s)
                _tma_load(dh_desc, [slot * K, iv * BVC], bar_w, dh_s)
            mbarrier.wait(bar_w, iv & 1)
            b_dw = warpgroup_mma(du_s, h_s.permute((1, 0)), b_dw, is_async=True)
            for i in gl.static_range(K // 32):
                b_sds += (h_s.slice(i * 32, 32).load(LB).to(gl.float32)
                          * dh_s.slice(i * 32, 32).load(LB).to(gl.float32))
            b_dw = warpgroup_mma_wait(num_outstanding=0, deps=(b_dw,))
        o_r = gl.arange(0, 64, layout=LR)
        m_r = (t0 + o_r) < T
        _store_tile(dw_desc, out_s, dw, -b_dw, r, i_hv * K, m_r, full, HV * K, L)
        gl.store(sds + slot, gl.sum(gl.sum(b_sds, 1), 0))

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

        b_g, b_gn, b_gr, b_gc = _chunk_gates(g, r, t0, T, i_hv, HV, LR, LSR, LSC)

        # the scores P (queries r in rows, keys s in columns) and diag(s)
        o_sr = gl.arange(0, 64, layout=LSR)
        o_sc = gl.arange(0, 64, layout=LSC)
        m_sr = (t0 + o_sr) < T
        m_sc = (t0 + o_sc) < T
        b_sd = gl.sum(gl.where((o_sr[:, None] == o_sc[None, :]) & m_sr[:, None], b_s, 0.0), 1)  # dO_r . Vnew_r
        m_lo = (o_sr[:, None] > o_sc[None, :]) & m_sr[:, None] & m_sc[None, :]
        b_p = b_s * gl.exp2(gl.where(m_lo, b_gr[:, None] - b_gc[None, :], float("-inf")))
        p_s.store(b_p.to(dt))
        fence_async_shared()
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
        _cta_barrier()  # P from both warpgroups in p_s
        b_dq = warpgroup_mma(p_s, k_s, b_dq)
        b_kf = k_s.load(L).to(gl.float32)
        b_dq = b_dq * scale + b_sd[:, None] * b_kf
        gl.store(pst + (r + o_r) * HV + i_hv, gl.sum(b_kf * b_dks, 1), mask=m_r)
        _wait_store(full)
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


def chunk_dqkw_ws(q, k, v_new, do, du, h_sub, dh_sub, g_cum, scale, dq, dk, dw, dgd, pst, sds, cu_seqlens,
                  tile_indices, sub_offsets, NT: int, config: dict | None = None) -> None:
    """Launch ``_gdn_dqkw_ws_kernel`` into the given outputs (``chunk_dqkw_bwd``'s, with one key tile: dgd / pst
    ``[B, T, HV]``, sds ``[slots, HV]``). Call only where ``dqkw_ws_supported`` holds."""
    cfg = {**DQKW_WS_DEFAULTS, **(config or {})}
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    bf16 = q.dtype == torch.bfloat16
    nrow = h_sub.numel() // V

    def desc(x, rows, cols, block):  # a 2-D [rows, cols] view, one chunk of one head per block
        return TensorDescriptor(x.view(rows, cols), [rows, cols], [cols, 1], block, _smem_layout(tuple(block), bf16))

    _gdn_dqkw_ws_kernel[(NT, B * HV)](
        desc(q, B * T, H * K, [BS, K]), desc(k, B * T, H * K, [BS, K]), desc(v_new, B * T, HV * V, [BS, BVC]),
        desc(do, B * T, HV * V, [BS, BVC]), desc(du, B * T, HV * V, [BS, BVC]), desc(h_sub, nrow, V, [K, BVC]),
        desc(dh_sub, nrow, V, [K, BVC]), desc(dq, B * T, HV * K, [BS, K]), desc(dk, B * T, HV * K, [BS, K]),
        desc(dw, B * T, HV * K, [BS, K]), g_cum, dq, dk, dw, dgd, pst, sds,
        cu_seqlens if cu_seqlens is not None else g_cum, tile_indices if tile_indices is not None else g_cum,
        sub_offsets if sub_offsets is not None else g_cum, scale, T, H=H, HV=HV, K=K, V=V,
        IS_VARLEN=cu_seqlens is not None, num_warps=cfg["num_warps"], maxnreg=128)
