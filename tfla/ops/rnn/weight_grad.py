"""The recurrent weights' gradients after the backward's time loop: ``dR`` and ``db`` of every path in one Triton
kernel that reads the saved tensors where they lie.

``dR[g, n, e, d] = sum over (t, batch) of drh[t, n, batch, g D + e] h_{t-1}[n, batch, d]`` and ``db[g, n, e]`` the
same sum of ``drh`` alone, with drh the gradient of every step's ``R h_{t-1}`` (``[Tm, NH, N, G D]``) and
``h_{t-1}`` the h slot of the saved states (``[Tm + 1, S, NH, N, D]``, step t's input at index t). Per head these are
a ``[G D, Tm N] x [Tm N, D]`` product with a long reduction and a small output (``64 x 16`` per head at the FlashRNN
paper's D = 16), so a plain batched matmul runs few programs over thousands of rows each, and the rows must first be
gathered out of the time-major layouts. Here a program owns one ``[BM, BN]`` tile of one head's dR (and ``BM`` entries
of db) over one slice of the rows, read through strides; the slices' partial sums (fp32, ``[splits, NH, G D, D]``)
are added afterwards in a fixed order, so results are bitwise repeatable.

Products: the saved drh and states are fp32. On a GPU each operand is split into a bf16 high part and the bf16
rounding of the remainder, and three bf16 tensor-core products (hi hi, lo hi, hi lo) accumulate in fp32: ~16 mantissa
bits per operand, for fp32 inputs, and for 16-bit inputs up to D = 128 (H100, torch 2.11, Triton 3.6, B = 16, T =
1024, G = 4, random fp32 operands,
median ``do_bench``: rel-L2 1.5e-5 / 6.7e-6 against float64 at D x NH = 768 x 1 / 16 x 48; without the hi lo product
1.7e-3, 0.9-0.97x the time, so it stays). fp32's ``tf32x3`` would need both operands K-major, and here both are stored
the other way round: as one TF32 product with both operands transposed, 768 x 1 took 4.85 ms. On the CPU interpreter
one IEEE fp32 product; float64 (the verification dtype) uses ``torch.bmm`` in float64.

Above D = 128 a tile program reads its rows once per tile of the other operand (drh once per column tile, h once per
row tile: 6 and 24 times at D = 768), and splitting fp32 operands in registers keeps the loads from streaming into
the tensor cores. There the operands are first split once into contiguous bf16 hi / lo copies (``[NH, Tm N, G D]``
and ``[NH, Tm N, D]``, db's partial sums on the way; transient memory: the size of drh and h in fp32), and a
pipelined GEMM (``_dR_gemm_kernel``) forms the same three products from them. NVIDIA H200, torch 2.11, Triton 3.6,
B = 16, T = 1024, G = 4, random fp32 operands, median ``do_bench`` (2026-11-29): D x NH = 768 x 1 1.310 -> 0.592 ms,
256 x 3 0.366 -> 0.305; at 64 x 12 the in-register split stays faster (0.148 against 0.222-0.247).

For 16-bit inputs above D = 128 (``tf32``) the copies are fp32 and transposed (``[NH, G D, Tm N]``, ``[NH, D, Tm
N]``: the rows contiguous, as TF32 tensor-core products take both operands) and one TF32 product forms dR: rel-L2
7.7e-4 against float64 on random fp32 operands instead of 1.5e-5, below the error the bf16 recurrence already
carries into drh (the bench's bf16 gradients at 768 x 1: 1.96e-3 against tfla's fp32 run), and a third of the
products. H200, same shape, 2026-12-01: ``dR_db`` 0.609 -> 0.465 ms; in the LSTM's forward + backward the GEMM 0.44
-> 0.29 ms (128 x 256 tiles, 8 warps, 3 stages: the fastest of 36 launches tried). fp32 inputs keep the split
products (their tests ask for 3e-5 on CUDA).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.utils import cdiv, interpret_mode, next_pow2, sm_count


@triton.jit
def _dR_tile(GD, D, rows, rows_per_split, BM: tl.constexpr, BN: tl.constexpr):
    """This program's dR tile (grid ``(tiles of [GD, D], row slices, NH)``): its row slice i_s, head i_h, column
    tile i_c, the tile's rows o_m and columns o_c of ``[GD, D]`` with their masks, and its slice ``[r_start, r_end)``
    of the ``rows`` (step, batch) pairs."""
    i_mn, i_s, i_h = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    n_cols = tl.cdiv(D, BN)
    i_m, i_c = i_mn // n_cols, i_mn % n_cols
    o_m = i_m * BM + tl.arange(0, BM)
    o_c = i_c * BN + tl.arange(0, BN)
    r_start = i_s * rows_per_split
    return i_s, i_h, i_c, o_m, o_c, o_m < GD, o_c < D, r_start, tl.minimum(r_start + rows_per_split, rows)


@triton.jit
def _store_dR(dR_ptr, acc, i_s, i_h, o_m, o_c, m_m, m_c, GD, D):
    """A tile's partial sum into ``dR_ptr[i_s, i_h]`` (``[row slices, NH, GD, D]`` fp32)."""
    base = i_s * tl.num_programs(2) + i_h
    tl.store(dR_ptr + base * GD * D + o_m[:, None] * D + o_c[None, :], acc, mask=m_m[:, None] & m_c[None, :])


@triton.jit
def _rnn_dR_db_kernel(
    drh_ptr, h_ptr, dR_ptr, db_ptr,
    N, D, GD, rows, rows_per_split,
    s_rt, s_rn, s_rb, s_ht, s_hn, s_hb,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
):
    """One ``[BM, BN]`` tile of head i_h's dR (rows of ``G D``, columns of D) summed over rows ``[i_s
    rows_per_split, ...)`` of the ``rows = Tm N`` (step, batch) pairs, row r = (t = r // N, batch = r % N); stored at
    ``dR_ptr[i_s, i_h]`` (``[GD, D]``); the column-0 tiles also store db's BM entries at ``db_ptr[i_s, i_h]``. SPLIT:
    each fp32 operand as a bf16 high part and the bf16 rounding of its remainder, three bf16 products (hi hi, lo hi,
    hi lo; ~16 mantissa bits per operand, fp32 accumulation); else one fp32 ``tl.dot`` at PREC."""
    i_s, i_h, i_c, o_m, o_c, m_m, m_c, r_start, r_end = _dR_tile(GD, D, rows, rows_per_split, BM, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    acc_b = tl.zeros([BM], tl.float32)
    for r0 in tl.range(r_start, r_end, BK, num_stages=3):
        o_r = r0 + tl.arange(0, BK)
        m_r = o_r < r_end
        t, bb = o_r // N, o_r % N
        a = tl.load(drh_ptr + (t * s_rt + i_h * s_rn + bb * s_rb)[:, None] + o_m[None, :],
                    mask=m_r[:, None] & m_m[None, :], other=0.0)  # [BK, BM]
        h = tl.load(h_ptr + (t * s_ht + i_h * s_hn + bb * s_hb)[:, None] + o_c[None, :],
                    mask=m_r[:, None] & m_c[None, :], other=0.0)  # [BK, BN]
        if SPLIT:
            a_hi = a.to(tl.bfloat16)
            a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
            h_hi = h.to(tl.bfloat16)
            h_lo = (h - h_hi.to(tl.float32)).to(tl.bfloat16)
            at_hi = tl.trans(a_hi)
            acc = tl.dot(at_hi, h_hi, acc)
            acc = tl.dot(tl.trans(a_lo), h_hi, acc)
            acc = tl.dot(at_hi, h_lo, acc)
        else:
            acc = tl.dot(tl.trans(a), h, acc, input_precision=PREC)
        acc_b += tl.sum(a, 0)
    _store_dR(dR_ptr, acc, i_s, i_h, o_m, o_c, m_m, m_c, GD, D)
    if i_c == 0:
        tl.store(db_ptr + (i_s * tl.num_programs(2) + i_h) * GD + o_m, acc_b, mask=m_m)


@triton.jit
def _split_rows_kernel(src, hi, lo, db_p, N, C, rows, s_t, s_n, s_b, BR: tl.constexpr, BC: tl.constexpr,
                       SPLIT: tl.constexpr, SUM: tl.constexpr, TRANS: tl.constexpr):
    """Rows ``[i_r BR, ..)`` x columns ``[i_c BC, ..)`` of head i_h of ``src`` (row r = (t = r // N, batch = r % N)
    at ``src + t s_t + i_h s_n + batch s_b``, C contiguous columns) into ``hi`` (``[NH, rows, C]``; TRANS:
    ``[NH, C, rows]``): SPLIT, its bf16 rounding, and the bf16 rounding of the remainder into ``lo``; else an fp32
    copy. SUM: the block's column sums into ``db_p[i_r, i_h]`` (``[C]``)."""
    i_r, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_r = i_r * BR + tl.arange(0, BR)
    o_c = i_c * BC + tl.arange(0, BC)
    m = (o_r < rows)[:, None] & (o_c < C)[None, :]
    t, bb = o_r // N, o_r % N
    x = tl.load(src + (t.to(tl.int64) * s_t + i_h * s_n + bb * s_b)[:, None] + o_c[None, :], mask=m, other=0.0)
    if TRANS:
        dst = (i_h * C + o_c)[None, :] * rows + o_r[:, None]
    else:
        dst = (i_h * rows + o_r)[:, None] * C + o_c[None, :]
    if SPLIT:
        x_hi = x.to(tl.bfloat16)
        tl.store(hi + dst, x_hi, mask=m)
        tl.store(lo + dst, (x - x_hi.to(tl.float32)).to(tl.bfloat16), mask=m)
    else:
        tl.store(hi + dst, x, mask=m)
    if SUM:
        tl.store(db_p + (i_r * tl.num_programs(2) + i_h) * C + o_c, tl.sum(x, 0), mask=o_c < C)


@triton.jit
def _dR_gemm_kernel(a_hi, a_lo, b_hi, b_lo, dR_ptr, rows, GD, D, rows_per_split, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr,
                    TRANS: tl.constexpr):
    """``_rnn_dR_db_kernel``'s tile of dR from the contiguous copies of ``_split_rows_kernel`` (``a``: drh's rows
    ``[NH, rows, GD]``, ``b``: h's ``[NH, rows, D]``; TRANS: both transposed, ``[NH, GD, rows]`` and ``[NH, D,
    rows]``, the rows contiguous as TF32 tensor-core products want both operands): SPLIT, the three bf16 products
    (hi hi, lo hi, hi lo) of the loaded hi / lo tiles; else one fp32 product at PREC."""
    i_s, i_h, i_c, o_m, o_c, m_m, m_c, r_start, r_end = _dR_tile(GD, D, rows, rows_per_split, BM, BN)
    base_a = i_h * rows * GD
    base_b = i_h * rows * D
    acc = tl.zeros([BM, BN], tl.float32)
    for r0 in tl.range(r_start, r_end, BK, num_stages=STAGES):
        o_r = (r0 + tl.arange(0, BK)).to(tl.int64)
        m_r = o_r < r_end
        m_a = m_r[:, None] & m_m[None, :]
        m_b = m_r[:, None] & m_c[None, :]
        if TRANS:
            off_a = base_a + o_m[:, None] * rows + o_r[None, :]
            off_b = base_b + o_c[:, None] * rows + o_r[None, :]
            a = tl.load(a_hi + off_a, mask=tl.trans(m_a), other=0.0)  # [BM, BK]
            b = tl.trans(tl.load(b_hi + off_b, mask=tl.trans(m_b), other=0.0))  # [BK, BN]
        else:
            off_a = base_a + o_r[:, None] * GD + o_m[None, :]
            off_b = base_b + o_r[:, None] * D + o_c[None, :]
            a = tl.trans(tl.load(a_hi + off_a, mask=m_a, other=0.0))  # [BM, BK]
            b = tl.load(b_hi + off_b, mask=m_b, other=0.0)
        if SPLIT:
            acc = tl.dot(a, b, acc)
            acc = tl.dot(tl.trans(tl.load(a_lo + off_a, mask=m_a, other=0.0)), b, acc)
            acc = tl.dot(a, tl.load(b_lo + off_b, mask=m_b, other=0.0), acc)
        else:
            acc = tl.dot(a, b, acc, input_precision=PREC)
    _store_dR(dR_ptr, acc, i_s, i_h, o_m, o_c, m_m, m_c, GD, D)


def _tiles(GD: int, D: int):
    """``(BM, BN)``: 128 x 128 from D = 128 on, else 64 rows (fewer where G D is smaller) and D's power of two (H100,
    torch 2.11, Triton 3.6, split bf16 products, B = 16, T = 1024, G = 4, median ``do_bench``: at D x NH = 768 x 1
    / 256 x 3 / 64 x 12 this rule with 4 warps, 32-row slices and ~4 programs per SM measured 1.27 / 0.35 / 0.14
    ms, the fastest of 8-32 launches tried each; ``torch.bmm`` in fp32 with the rows gathered: 1.52 / 1.00 / 0.79,
    2026-11-25)."""
    BN = min(128, max(16, next_pow2(D)))
    return min(128 if BN == 128 else 64, max(16, next_pow2(GD))), BN


def _row_splits(rows: int, tiles: int, BK: int, x: torch.Tensor) -> tuple[int, int]:
    """``(splits, rows per split)`` of the rows for ``tiles`` dR tiles: enough programs for ~4 per SM of x's device,
    each over at least 8 row blocks of BK, a multiple of BK rows per split."""
    splits = max(1, min(cdiv(4 * sm_count(x), tiles), cdiv(rows, 8 * BK)))
    per = cdiv(cdiv(rows, splits), BK) * BK
    return cdiv(rows, per), per


def dR_db(states: torch.Tensor, drh: torch.Tensor, tf32: bool = False):
    """dR ``[G, NH, D, D]`` and db ``[G, NH, D]`` (the states' dtype) from drh ``[Tm, NH, N, G D]`` and the h slot
    of states ``[Tm + 1, S, NH, N, D]`` (module docstring). ``tf32`` (the cells' 16-bit inputs): above D = 128 one
    TF32 product over transposed fp32 copies instead of three split bf16 ones (IEEE fp32 on the interpreter)."""
    Tm, NH, N, GD = drh.shape
    D = states.shape[-1]
    G = GD // D
    if states.dtype == torch.float64 or Tm * N == 0:
        h_prev = states[:Tm, 0].permute(1, 0, 2, 3).reshape(NH, Tm * N, D)
        drh_rows = drh.permute(1, 0, 2, 3).reshape(NH, Tm * N, GD)
        dR = torch.bmm(drh_rows.transpose(1, 2), h_prev).view(NH, G, D, D).permute(1, 0, 2, 3)
        return dR, drh.sum((0, 2)).view(NH, G, D).transpose(0, 1)
    BM, BN = _tiles(GD, D)
    if D > 128:
        return _dR_db_copies(states, drh, BM, BN, tf32)
    BK = 64 if BM * BN < 64 * 64 else 32  # (operand registers)
    rows = Tm * N
    splits, per = _row_splits(rows, cdiv(GD, BM) * cdiv(D, BN) * NH, BK, drh)
    dR_p = torch.empty(splits, NH, GD, D, device=drh.device, dtype=torch.float32)
    db_p = torch.empty(splits, NH, GD, device=drh.device, dtype=torch.float32)
    h = states[:, 0]
    _rnn_dR_db_kernel[(cdiv(GD, BM) * cdiv(D, BN), splits, NH)](
        drh, h, dR_p, db_p, N, D, GD, rows, per,
        drh.stride(0), drh.stride(1), drh.stride(2), h.stride(0), h.stride(1), h.stride(2),
        BM=BM, BN=BN, BK=BK, SPLIT=not interpret_mode(), PREC="ieee", num_warps=4)
    dR, db = (dR_p[0], db_p[0]) if splits == 1 else (dR_p.sum(0), db_p.sum(0))
    return dR.view(NH, G, D, D).permute(1, 0, 2, 3), db.view(NH, G, D).transpose(0, 1)


def _dR_db_copies(states: torch.Tensor, drh: torch.Tensor, BM: int, BN: int, tf32: bool):
    """``dR_db`` through contiguous hi / lo copies of drh and h and ``_dR_gemm_kernel`` (module docstring): 32-row
    steps, 4 warps, 4 stages, ~4 programs per SM (the fastest of 8 launches tried at 768 x 1 and 256 x 3); with
    ``tf32`` transposed fp32 copies and one TF32 product."""
    Tm, NH, N, GD = drh.shape
    D = states.shape[-1]
    G = GD // D
    rows = Tm * N
    split = not interpret_mode() and not tf32
    cdt = torch.bfloat16 if split else torch.float32
    shape_a, shape_b = ((NH, GD, rows), (NH, D, rows)) if tf32 else ((NH, rows, GD), (NH, rows, D))
    a_hi = torch.empty(shape_a, device=drh.device, dtype=cdt)
    b_hi = torch.empty(shape_b, device=drh.device, dtype=cdt)
    a_lo, b_lo = (torch.empty_like(a_hi), torch.empty_like(b_hi)) if split else (a_hi, b_hi)
    BR, BC = 64, 128
    db_p = torch.empty(cdiv(rows, BR), NH, GD, device=drh.device, dtype=torch.float32)
    h = states[:, 0]
    for src, hi, lo, C, dsum in ((drh, a_hi, a_lo, GD, True), (h, b_hi, b_lo, D, False)):
        _split_rows_kernel[(cdiv(rows, BR), cdiv(C, BC), NH)](
            src, hi, lo, db_p, N, C, rows, src.stride(0), src.stride(1), src.stride(2), BR=BR, BC=BC, SPLIT=split,
            SUM=dsum, TRANS=tf32, num_warps=4)
    BK, stages, warps = 32, 4, 4
    if tf32 and not interpret_mode():  # the fastest of 36 launches at 768 x 1 (module docstring)
        BN, stages, warps = (256 if D >= 256 else BN), 3, 8
    splits, per = _row_splits(rows, cdiv(GD, BM) * cdiv(D, BN) * NH, BK, drh)
    dR_p = torch.empty(splits, NH, GD, D, device=drh.device, dtype=torch.float32)
    _dR_gemm_kernel[(cdiv(GD, BM) * cdiv(D, BN), splits, NH)](
        a_hi, a_lo, b_hi, b_lo, dR_p, rows, GD, D, per, BM=BM, BN=BN, BK=BK, SPLIT=split,
        PREC="tf32" if tf32 and not interpret_mode() else "ieee", STAGES=stages, TRANS=tf32, num_warps=warps)
    dR = dR_p[0] if splits == 1 else dR_p.sum(0)
    return dR.view(NH, G, D, D).permute(1, 0, 2, 3), db_p.sum(0).view(NH, G, D).transpose(0, 1)
