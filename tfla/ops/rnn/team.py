"""The team path of the FlashRNN cells, for head dims too large for one program (D > 64 by default): a team of P
programs per (batch tile, head), each owning BC of the head's D units (columns of the state). Per step every member
reads the whole ``h_{t-1}`` of its rows, forms ``R_j h_{t-1}`` for its own units (``[BB, D] x [D, BC]`` per gate: its
slices of R held on chip for the launch where they fit, else streamed from L2 in BK-wide slices of D), runs the cell
on them (``pointwise.py``'s ``_cell_fwd``) and stores its part of ``h_t``; the team then meets at a barrier before
the next step reads ``h_t``. The backward runs the same way in reverse: each member owns the same units' dh, dc, dn
and forms the recurrent part of its dh from every unit's pre-activation gradients of the step after
(``sum_j drh_j R_j[:, own]``). A held slice's dot runs as a 3-D dot over D cut into one part per warp, summed
(``_rows_split``), over D in two power-of-two parts where that is shorter than one padded one (``held_parts``: 512
+ 256 at D = 768, not 1024); each step's inputs that do not depend on the chain (x; in the backward do, x, ``R h``
and the states) are loaded a step ahead, and a step's stores that no member reads (rh, the states, o; the
backward's dx and drh) go out after the member's arrival at the barrier, while the team gathers. The launch (batch
tile, units per member, R held or streamed, stages) comes from ``tiling.choose_team_launch``, on a GPU checked by
compiling it first (``compile_check``, ``tiling.choose_team_launch_compiled``).

Two ways to run the steps, one kernel: persistent (``SYNC``: one launch runs every step, the team meets at a
grid barrier: one int32 counter per (head, batch tile), ``atomic_add`` with release / acquire at GPU scope, spun on
until every member has arrived; h and the gradients pass through a two-slot ring in the dots' dtype; the launch is
cooperative, so every program of the grid is resident or the launch fails, never a hang; only where the grid fits
the SMs once and never under the CPU interpreter, which runs programs one after another) and stepwise (one launch
per step, h read from the fp32 states; the kernel boundary is the barrier: the interpreter, grids larger than the
GPU, ``config={"team_sync": False}``). Both read and write the same tensors as the fused and alternating paths
(``cells.rnn_fwd``'s layouts: states ``[Tm + 1, S, NH, N, D]``, rh ``[Tm, NH, N, G * D]``, the backward's dx and
drh), so dR and db are formed after the loop as there.

The idea of splitting one head's recurrent matrix over a team of SMs that exchange h each step through memory and
a grid barrier is FlashRNN's (Pöppel et al. 2024, Section 4, "fused kernel": the recurrent matrix stays on chip
across a cooperative grid); README of the cells for the measurements.
"""
from __future__ import annotations

import types
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.language as tl

from tfla.ops.common.utils import cdiv, dot_precision, host_ints, next_pow2
from tfla.ops.rnn.fused import _DOT, _biases, _bwd_inputs, _bwd_math, _bwd_store, _run, _xs
from tfla.ops.rnn.pointwise import SLSTM, _cell_fwd, _states_in, _states_out, _store_gates

TEAM_COLS = (16, 32, 64, 128)  # the units per member the launch may take (``config["team_cols"]``)


@triton.jit
def _team_tile(N, NH, D, BB: tl.constexpr, BC: tl.constexpr):
    """This program's head, batch rows (and their mask), units (and mask), the ``[BB, BC]`` mask, each row's start
    in one state ``[NH, N, D]`` and its counter."""
    i_c, i_b, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_b = i_b * BB + tl.arange(0, BB)
    o_c = i_c * BC + tl.arange(0, BC)
    m_b, m_c = o_b < N, o_c < D
    o_row = (i_n * N + o_b) * D  # [BB]
    return i_n, o_b, o_c, m_b, m_c, m_b[:, None] & m_c[None, :], o_row, i_n * tl.num_programs(1) + i_b


@triton.jit
def _team_arrive(cnt):
    """This program's arrival at the team's barrier: its stores before the call are visible to every member that
    has seen the counter reach the step's target (CTA barrier, then one release add at GPU scope)."""
    tl.debug_barrier()
    tl.atomic_add(cnt, 1, sem="release", scope="gpu")


@triton.jit
def _team_wait(cnt, target):
    """Wait until the team's counter reaches ``target`` (acquire at GPU scope, then a CTA barrier): every member's
    stores before its arrival are visible to this program's loads after the call."""
    seen = tl.atomic_add(cnt, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(cnt, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _slice(p_w, o_r, m_r, o_c, m_c, j, D, swi, swo, TRANS: tl.constexpr, DOT: tl.constexpr):
    """Gate j's ``[rows, BC]`` slice of one head's Wt (``Wt[d, j D + e] = R_j[e, d]`` at ``p_w + d swi + (j D + e)
    swo``) in DOT, zero off the masks: ``R_j^T[rows, own units]`` (inputs o_r to outputs o_c: the forward's right
    operand) or with TRANS ``R_j[rows, own units]`` (outputs o_r from inputs o_c: the backward's)."""
    if TRANS:
        off = o_c[None, :] * swi + (j * D + o_r[:, None]) * swo
    else:
        off = o_r[:, None] * swi + (j * D + o_c[None, :]) * swo
    return tl.load(p_w + off, mask=m_r[:, None] & m_c[None, :], other=0.0).to(DOT)


@triton.jit
def _slice3(p_w, o_k, o_u, m, j, D, swi, swo, TRANS: tl.constexpr, DOT: tl.constexpr):
    """``_slice`` over D in parts: o_k ``[KS, BK / KS, 1]`` rows of D, o_u ``[1, 1, BC]`` own units, m their mask."""
    if TRANS:
        off = o_u * swi + (j * D + o_k) * swo
    else:
        off = o_k * swi + (j * D + o_u) * swo
    return tl.load(p_w + off, mask=m, other=0.0).to(DOT)


@triton.jit
def _rows_split(p_rows, m_rows, D, K0: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, DOT: tl.constexpr):
    """Columns ``[K0, K0 + BK)`` of the rows at ``p_rows`` ([BB] pointers, read past L1) as the KS parts of a 3-D
    dot's left operand ``[KS, BB, BK / KS]`` (zero past D and off ``m_rows``): each warp takes a part of the dot's
    length (a 2-D dot of 16 rows and 16 units leaves it to one or two warps, H100 2026-11-25)."""
    o_k = K0 + tl.arange(0, KS)[:, None, None] * (BK // KS) + tl.arange(0, BK // KS)[None, None, :]
    return tl.load(p_rows[None, :, None] + o_k, mask=m_rows[None, :, None] & (o_k < D), other=0.0,
                   cache_modifier=".cg").to(DOT)


@triton.jit
def _team_fwd_dots(p_h, m_b, p_w, swi, swo, o_c, m_c, D, w0, w1, w2, w3, v0, v1, v2, BB: tl.constexpr,
                   BC: tl.constexpr, BK: tl.constexpr, BK2: tl.constexpr, KS: tl.constexpr, G: tl.constexpr,
                   DOT: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr, RESIDENT: tl.constexpr):
    """``(R_j h)^T`` for this member's units, ``[BB, BC]`` per gate: h's rows at ``p_h`` ([BB] pointers, read past
    L1). RESIDENT: the gates' slices held since the launch (``_team_weights``) over D's first BK rows (w*) and, where
    BK2 > 0, the next BK2 (v*; a head dim that is not a power of two in two power-of-two parts instead of one padded
    one: 512 + 256 at D = 768); for G = 1 or 4 all gates in w0 / v0, ``[KS, BK / KS, G BC]``, gate-major columns;
    for the GRU's 3 one per gate; else the slices streamed from Wt at ``p_w`` in BK-wide parts of D."""
    r0 = tl.zeros([BB, BC], tl.float32)
    r1, r2, r3 = r0, r0, r0
    if RESIDENT:
        hk = _rows_split(p_h, m_b, D, 0, BK, KS, DOT)
        if BK2 > 0:
            hk2 = _rows_split(p_h, m_b, D, BK, BK2, KS, DOT)
        if (G & (G - 1)) == 0:  # one 3-D dot for all gates over the KS parts of D, one sum over the parts
            part = tl.dot(hk, w0, input_precision=PREC)
            if BK2 > 0:
                part = tl.dot(hk2, v0, part, input_precision=PREC)
            e = tl.sum(part, 0)  # [BB, G BC]
            if G == 1:
                r0 = e
            else:  # each gate's columns: the gate index is a register index of the dot's layout, so no exchange
                e = tl.reshape(e, [BB, G, BC])
                o_g = tl.arange(0, G)[None, :, None]
                r0 = tl.sum(tl.where(o_g == 0, e, 0.0), 1)
                r1 = tl.sum(tl.where(o_g == 1, e, 0.0), 1)
                r2 = tl.sum(tl.where(o_g == 2, e, 0.0), 1)
                r3 = tl.sum(tl.where(o_g == 3, e, 0.0), 1)
        else:  # one 3-D dot per gate, each summed over the parts
            p0 = tl.dot(hk, w0, input_precision=PREC)
            p1 = tl.dot(hk, w1, input_precision=PREC)
            p2 = tl.dot(hk, w2, input_precision=PREC)
            if BK2 > 0:
                p0 = tl.dot(hk2, v0, p0, input_precision=PREC)
                p1 = tl.dot(hk2, v1, p1, input_precision=PREC)
                p2 = tl.dot(hk2, v2, p2, input_precision=PREC)
            r0 = tl.sum(p0, 0)
            r1 = tl.sum(p1, 0)
            r2 = tl.sum(p2, 0)
    else:
        for k0 in tl.range(0, D, BK, num_stages=STAGES):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < D
            hk = tl.load(p_h[:, None] + o_k[None, :], mask=m_b[:, None] & m_k[None, :], other=0.0,
                         cache_modifier=".cg").to(DOT)
            r0 = tl.dot(hk, _slice(p_w, o_k, m_k, o_c, m_c, 0, D, swi, swo, False, DOT), r0, input_precision=PREC)
            if G > 1:
                r1 = tl.dot(hk, _slice(p_w, o_k, m_k, o_c, m_c, 1, D, swi, swo, False, DOT), r1,
                            input_precision=PREC)
            if G > 2:
                r2 = tl.dot(hk, _slice(p_w, o_k, m_k, o_c, m_c, 2, D, swi, swo, False, DOT), r2,
                            input_precision=PREC)
            if G > 3:
                r3 = tl.dot(hk, _slice(p_w, o_k, m_k, o_c, m_c, 3, D, swi, swo, False, DOT), r3,
                            input_precision=PREC)
    return r0, r1, r2, r3


@triton.jit
def _team_bwd_dots(acc, p_d, m_rows, p_w, swi, swo, o_c, m_c, D, w0, w1, w2, w3, v0, v1, v2, v3, BK: tl.constexpr,
                   BK2: tl.constexpr, KS: tl.constexpr, G: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                   STAGES: tl.constexpr, RESIDENT: tl.constexpr):
    """``acc + sum_j d_j R_j[:, own units]``: the pre-activation gradients' rows at ``p_d`` ([BB] pointers to
    ``[G * D]`` rows, read past L1; rows off ``m_rows`` read as zero); R's slices held (RESIDENT: w0..w3 over D's
    first BK rows, v0..v3 over the next BK2, ``[KS, BK / KS, BC]``) or streamed from Wt at ``p_w``, as
    ``_team_fwd_dots``."""
    if RESIDENT:  # the gates' 3-D dots over the KS parts of D accumulate together, summed over the parts once
        part = tl.dot(_rows_split(p_d, m_rows, D, 0, BK, KS, DOT), w0, input_precision=PREC)
        if BK2 > 0:
            part = tl.dot(_rows_split(p_d, m_rows, D, BK, BK2, KS, DOT), v0, part, input_precision=PREC)
        if G > 1:
            part = tl.dot(_rows_split(p_d + D, m_rows, D, 0, BK, KS, DOT), w1, part, input_precision=PREC)
            if BK2 > 0:
                part = tl.dot(_rows_split(p_d + D, m_rows, D, BK, BK2, KS, DOT), v1, part, input_precision=PREC)
        if G > 2:
            part = tl.dot(_rows_split(p_d + 2 * D, m_rows, D, 0, BK, KS, DOT), w2, part, input_precision=PREC)
            if BK2 > 0:
                part = tl.dot(_rows_split(p_d + 2 * D, m_rows, D, BK, BK2, KS, DOT), v2, part,
                              input_precision=PREC)
        if G > 3:
            part = tl.dot(_rows_split(p_d + 3 * D, m_rows, D, 0, BK, KS, DOT), w3, part, input_precision=PREC)
            if BK2 > 0:
                part = tl.dot(_rows_split(p_d + 3 * D, m_rows, D, BK, BK2, KS, DOT), v3, part,
                              input_precision=PREC)
        acc += tl.sum(part, 0)
    else:
        for k0 in tl.range(0, D, BK, num_stages=STAGES):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < D
            pd = p_d[:, None] + o_k[None, :]
            md = m_rows[:, None] & m_k[None, :]
            for j in tl.static_range(G):
                acc = tl.dot(tl.load(pd + j * D, mask=md, other=0.0, cache_modifier=".cg").to(DOT),
                             _slice(p_w, o_k, m_k, o_c, m_c, j, D, swi, swo, True, DOT), acc, input_precision=PREC)
    return acc


@triton.jit
def _team_weights(p_w, o_c, m_c, D, swi, swo, K0: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                  G: tl.constexpr, TRANS: tl.constexpr, DOT: tl.constexpr, RESIDENT: tl.constexpr, BC: tl.constexpr,
                  CAT: tl.constexpr):
    """With RESIDENT (and BK > 0) the gates' ``_slice``s over rows ``[K0, K0 + BK)`` of D in KS parts
    (``[KS, BK / KS, BC]``; gates the cell lacks repeat gate 0's), loaded once per launch; with CAT and G = 1 or 4
    all gates side by side in w0 instead (``[KS, BK / KS, G BC]``, gate-major columns: the forward's one dot); else
    placeholders (the dots stream their slices)."""
    tl.static_assert(not (CAT and TRANS), "the gates side by side are the forward's operand")
    if RESIDENT and BK > 0 and CAT and (G & (G - 1)) == 0:
        o_k = (K0 + tl.arange(0, KS)[:, None] * (BK // KS) + tl.arange(0, BK // KS)[None, :])[:, :, None]
        o_u = tl.reshape(tl.broadcast_to(o_c[None, :], [G, BC]), [G * BC])[None, None, :]  # each gate's units
        m_u = tl.reshape(tl.broadcast_to(m_c[None, :], [G, BC]), [G * BC])[None, None, :]
        j = (tl.arange(0, G * BC) // BC)[None, None, :]
        w0 = tl.load(p_w + o_k * swi + (j * D + o_u) * swo, mask=(o_k < D) & m_u, other=0.0).to(DOT)
        w1, w2, w3 = w0, w0, w0
    elif RESIDENT and BK > 0:
        o_k = (K0 + tl.arange(0, KS)[:, None] * (BK // KS) + tl.arange(0, BK // KS)[None, :])[:, :, None]
        o_u = o_c[None, None, :]
        m = (o_k < D) & m_c[None, None, :]
        w0 = _slice3(p_w, o_k, o_u, m, 0, D, swi, swo, TRANS, DOT)
        w1, w2, w3 = w0, w0, w0
        if G > 1:
            w1 = _slice3(p_w, o_k, o_u, m, 1, D, swi, swo, TRANS, DOT)
        if G > 2:
            w2 = _slice3(p_w, o_k, o_u, m, 2, D, swi, swo, TRANS, DOT)
        if G > 3:
            w3 = _slice3(p_w, o_k, o_u, m, 3, D, swi, swo, TRANS, DOT)
    else:
        w0 = 0.0
        w1, w2, w3 = w0, w0, w0
    return w0, w1, w2, w3


@triton.jit
def _rnn_team_fwd_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, rh_ptr, o_ptr, cnt_ptr, ring_ptr,
    N, NH, D, t0, steps,
    swn, swi, swo, sxb, sxt, sxg, sxn, sxd, sob, sot, son, sod,
    CELL: tl.constexpr, G: tl.constexpr, S: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BK2: tl.constexpr, KS: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr,
    SYNC: tl.constexpr, RESIDENT: tl.constexpr,
):
    """Steps ``t0 .. t0 + steps - 1`` of this member's units: states[t + 1] = cell(x_t, R h_t, b, states[t]),
    rh[t] = R h_t (without b), o_t = h_{t+1}; with SYNC the team meets after every step and reads h from ``ring``
    (``[2, NH, N, D]`` in DOT: h_t in slot t % 2, the dots' operand, half of the fp32 state's bytes), else from the
    states. Step t + 1's x is loaded during step t (its latency off the chain between barriers: H100, LSTM, D = 768,
    7.6 -> 5.3 us per step)."""
    i_n, o_b, o_c, m_b, m_c, m, o_row, i_cnt = _team_tile(N, NH, D, BB, BC)
    E = NH * N * D
    o_s = o_row[:, None] + o_c[None, :]
    b0, b1, b2, b3 = _biases(b_ptr, i_n, o_c, NH, D, G)
    t_first = i_n * 0 + t0  # int64 step index
    h, c, n, mx = _states_in(s_ptr + t_first * (S * E) + o_s, E, m, tl.zeros([BB, BC], tl.float32), S)
    o_rh = (i_n * N + o_b[:, None]) * (G * D) + o_c[None, :]
    p_x = x_ptr + o_b[:, None] * sxb + i_n * sxn + o_c[None, :] * sxd
    p_o = o_ptr + o_b[:, None] * sob + i_n * son + o_c[None, :] * sod
    p_w = w_ptr + i_n * swn
    w0, w1, w2, w3 = _team_weights(p_w, o_c, m_c, D, swi, swo, 0, BK, KS, G, False, DOT, RESIDENT, BC, True)
    v0, v1, v2, v3 = _team_weights(p_w, o_c, m_c, D, swi, swo, BK, BK2, KS, G, False, DOT, RESIDENT, BC, True)
    P = tl.num_programs(0)
    xn0, xn1, xn2, xn3 = _xs(p_x + t_first * sxt, sxg, m & (o_b * 0 < steps)[:, None], G)
    if SYNC:  # the first step's h into the ring; the team meets before anyone reads it
        tl.store(ring_ptr + (t_first % 2) * E + o_s, h, mask=m)
        _team_arrive(cnt_ptr + i_cnt)
        _team_wait(cnt_ptr + i_cnt, P)
    for i in range(0, steps):
        t = t_first + i
        if SYNC:
            p_h = ring_ptr + (t % 2) * E + o_row
        else:
            p_h = s_ptr + t * (S * E) + o_row
        r0, r1, r2, r3 = _team_fwd_dots(p_h, m_b, p_w, swi, swo, o_c, m_c, D, w0, w1, w2, w3, v0, v1, v2, BB, BC,
                                        BK, BK2, KS, G, DOT, PREC, STAGES, RESIDENT)
        x0, x1, x2, x3 = xn0, xn1, xn2, xn3
        xn0, xn1, xn2, xn3 = _xs(p_x + (t + 1) * sxt, sxg, m & (o_b * 0 + i + 1 < steps)[:, None], G)
        h, c, n, mx = _cell_fwd(x0, r0 + b0, x1, r1 + b1, x2, r2 + b2, x3, r3 + b3, h, c, n, mx, CELL)
        if SYNC:  # h into the ring and the arrival first: the other stores go out while the team gathers
            tl.store(ring_ptr + ((t + 1) % 2) * E + o_s, h, mask=m)
            _team_arrive(cnt_ptr + i_cnt)
        _store_gates(rh_ptr + t * (N * NH * G * D) + o_rh, D, r0, r1, r2, r3, m, G)
        _states_out(s_ptr + (t + 1) * (S * E) + o_s, E, m, h, c, n, mx, S)
        tl.store(p_o + t * sot, h.to(o_ptr.dtype.element_ty), mask=m)
        if SYNC:
            _team_wait(cnt_ptr + i_cnt, P * (i + 2))


@triton.jit
def _rnn_team_bwd_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, rh_ptr, do_ptr, dsf_ptr, len_ptr, dseq_ptr, dx_ptr, drh_ptr, carry_ptr, ds0_ptr,
    cnt_ptr, ring_ptr, N, NH, D, Tm, t_hi, steps, tail,
    swn, swi, swo, sxb, sxt, sxg, sxn, sxd, sdb, sdt, sdn, sdd, sdxb, sdxt, sdxg, sdxn, sdxd,
    CELL: tl.constexpr, G: tl.constexpr, S: tl.constexpr, BB: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BK2: tl.constexpr, KS: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr,
    HAS_SEQ: tl.constexpr, SYNC: tl.constexpr, RESIDENT: tl.constexpr,
):
    """Steps ``t_hi`` down to ``t_hi - steps + 1`` of ``fused._rnn_fused_bwd_kernel`` for this member's units
    (same tensors and meaning), dh's recurrent part formed from every unit's drh of the step after. carry ``[3, NH,
    N, D]`` fp32: the direct part of dh (the GRU's z dh), dc and dn between launches (read at the start, written at
    the end; zeros before the first). ``tail`` (after the last step, t = 0): the initial state's gradient into ds0
    instead of the carry. With SYNC the recurrent dots read step t's drh from ``ring`` (``[2, NH, N, G * D]`` in DOT,
    slot t % 2), else from drh. Step t - 1's inputs (``fused._bwd_inputs``) are loaded during step t."""
    i_n, o_b, o_c, m_b, m_c, m, o_row, i_cnt = _team_tile(N, NH, D, BB, BC)
    E = NH * N * D
    o_s = o_row[:, None] + o_c[None, :]
    b0, b1, b2, b3 = _biases(b_ptr, i_n, o_c, NH, D, G)
    last = tl.load(len_ptr + o_b, mask=m_b, other=-1)[:, None] - 1  # [BB, 1]: each row's last step
    dh_dir = tl.load(carry_ptr + o_s, mask=m, other=0.0)
    dc = tl.load(carry_ptr + E + o_s, mask=m, other=0.0)
    dn = tl.load(carry_ptr + 2 * E + o_s, mask=m, other=0.0)
    o_rh = (i_n * N + o_b[:, None]) * (G * D) + o_c[None, :]
    o_drow = (i_n * N + o_b) * (G * D)  # [BB]: rows of one step of drh
    p_x = x_ptr + o_b[:, None] * sxb + i_n * sxn + o_c[None, :] * sxd
    p_do = do_ptr + o_b[:, None] * sdb + i_n * sdn + o_c[None, :] * sdd
    p_dx = dx_ptr + o_b[:, None] * sdxb + i_n * sdxn + o_c[None, :] * sdxd
    p_w = w_ptr + i_n * swn
    w0, w1, w2, w3 = _team_weights(p_w, o_c, m_c, D, swi, swo, 0, BK, KS, G, True, DOT, RESIDENT, BC, False)
    v0, v1, v2, v3 = _team_weights(p_w, o_c, m_c, D, swi, swo, BK, BK2, KS, G, True, DOT, RESIDENT, BC, False)
    P = tl.num_programs(0)
    t_top = i_n * 0 + t_hi  # int64 step index
    inp = _bwd_inputs(t_top, m & (o_b * 0 < steps)[:, None], last, o_s, E, dsf_ptr, dseq_ptr, p_do, sdt, p_x, sxt, sxg,
                      rh_ptr + t_top * (N * NH * G * D) + o_rh, D, b0, b1, b2, b3, s_ptr, CELL, G, S, HAS_SEQ)
    # loop-invariant code left inside the step loop: hoisted, it stayed live across the steps and spilled (sm_90
    # build, Triton 3.9, bf16, B = 16, R held: 1208 / 728 / 1508 B for the LSTM / GRU / sLSTM at D = 768, none
    # without; at B = 64, R streamed, 264 / 16 / 600 -> 96 / 8 / 460 B). The forward's loop keeps the hoisting: it
    # moves the held slices' conversion for the dots out of the loop (without it: 756 B of spills instead of 180).
    for i in tl.range(0, steps, disable_licm=True):
        t = t_top - i
        # dh_t: the direct part and sum_j (d R_j h_t) R_j from step t + 1 (none after the last step)
        if SYNC:
            p_d = ring_ptr + ((t + 1) % 2) * (N * NH * G * D) + o_drow
        else:
            p_d = drh_ptr + (t + 1) * (N * NH * G * D) + o_drow
        dh_rec = _team_bwd_dots(dh_dir, p_d, m_b & (o_b * 0 + t + 1 < Tm), p_w, swi, swo, o_c, m_c, D, w0, w1, w2, w3,
                                v0, v1, v2, v3, BK, BK2, KS, G, DOT, PREC, STAGES, RESIDENT)
        cur = inp
        inp = _bwd_inputs(t - 1, m & (o_b * 0 + i + 1 < steps)[:, None], last, o_s, E, dsf_ptr, dseq_ptr, p_do, sdt,
                          p_x, sxt, sxg, rh_ptr + (t - 1) * (N * NH * G * D) + o_rh, D, b0, b1, b2, b3, s_ptr, CELL,
                          G, S, HAS_SEQ)
        d0, d1, d2, dr2, d3, dh_dir, dc, dn = _bwd_math(dh_rec, dc, dn, cur, CELL, S, HAS_SEQ)
        if SYNC:  # the ring and the arrival first: dx and drh go out while the team gathers
            _store_gates(ring_ptr + (t % 2) * (N * NH * G * D) + o_rh, D, d0, d1, dr2, d3, m, G)
            _team_arrive(cnt_ptr + i_cnt)
        _bwd_store(t, d0, d1, d2, dr2, d3, m, p_dx, sdxt, sdxg, drh_ptr + t * (N * NH * G * D) + o_rh, D, G)
        if SYNC:
            _team_wait(cnt_ptr + i_cnt, P * (i + 1))
    if tail != 0:  # dh_{-1} from step 0's pre-activation gradients; empty sequences: the final state's cotangent
        t_lo = t_top - steps + 1
        if SYNC:
            p_d = ring_ptr + (t_lo % 2) * (N * NH * G * D) + o_drow
        else:
            p_d = drh_ptr + t_lo * (N * NH * G * D) + o_drow
        dh_rec = _team_bwd_dots(dh_dir, p_d, m_b & (o_b * 0 + t_lo < Tm), p_w, swi, swo, o_c, m_c, D, w0, w1, w2, w3,
                                v0, v1, v2, v3, BK, BK2, KS, G, DOT, PREC, STAGES, RESIDENT)
        m_f = m & (last == -1)
        tl.store(ds0_ptr + o_s, dh_rec + tl.load(dsf_ptr + o_s, mask=m_f, other=0.0), mask=m)
        if S > 1:
            tl.store(ds0_ptr + E + o_s, dc + tl.load(dsf_ptr + E + o_s, mask=m_f, other=0.0), mask=m)
        if CELL == SLSTM:
            tl.store(ds0_ptr + 2 * E + o_s, dn + tl.load(dsf_ptr + 2 * E + o_s, mask=m_f, other=0.0), mask=m)
    else:
        tl.store(carry_ptr + o_s, dh_dir, mask=m)
        tl.store(carry_ptr + E + o_s, dc, mask=m)
        tl.store(carry_ptr + 2 * E + o_s, dn, mask=m)


def _grid(N, NH, D, launch):
    return (cdiv(D, launch.BC), cdiv(N, launch.BB), NH)


def held_parts(D: int, BK: int, KS: int) -> tuple[int, int]:
    """The held slices' two parts of D, ``(BK1, BK2)``: powers of two (BK2 = 0: one part) covering D rounded up to a
    multiple of ``16 KS`` (each of the KS warps' share at least one 16-wide k-step), where they cover less than the
    one padded part BK: 512 + 256 at D = 768 instead of 1024 (a quarter of the held slices' tensor-core work and
    shared-memory reads less)."""
    unit = 16 * KS
    Dp = cdiv(D, unit) * unit
    BK1 = 1 << (Dp.bit_length() - 1)
    BK2 = next_pow2(Dp - BK1) if Dp > BK1 else 0
    return (BK1, BK2) if BK1 + BK2 < BK else (BK, 0)


def _kw(dtype, launch, D):
    # held slices: the dots' length D split over the warps (KS parts of >= 16), in up to two parts
    KS = min(launch.num_warps, launch.BK // 16) if launch.resident else 1
    BK, BK2 = held_parts(D, launch.BK, KS) if launch.resident else (launch.BK, 0)
    return dict(BB=launch.BB, BC=launch.BC, BK=BK, BK2=BK2, KS=KS, DOT=_DOT[dtype], PREC=dot_precision(dtype),
                STAGES=launch.num_stages, RESIDENT=launch.resident, num_warps=launch.num_warps)


def rnn_team_fwd(cell_id: int, x, Wt, b_acc, states, rh, o, launch):
    """``fused.rnn_fused_fwd`` on the team path: fills ``states[1:]``, rh and o. Wt ``[NH, D, G * D]`` in x's dtype
    for 16-bit x (fp32 otherwise); launch: ``cells.Launch`` of the team path."""
    N, Tm, G, NH, D = x.shape
    grid = _grid(N, NH, D, launch)
    kw = _kw(x.dtype, launch, D)
    args = (x, Wt, b_acc, states, rh, o)
    strides = (*Wt.stride(), *x.stride(), *o.stride())
    S = states.shape[1]
    if launch.sync:
        cnt = torch.zeros(grid[1] * NH, dtype=torch.int32, device=x.device)
        ring = torch.empty(2, NH, N, D, dtype=Wt.dtype, device=x.device)
        _run(_rnn_team_fwd_kernel, grid, *args, cnt, ring, N, NH, D, 0, Tm, *strides, CELL=cell_id, G=G, S=S,
             SYNC=True, launch_cooperative_grid=True, **kw)
        return
    for t in range(Tm):
        _run(_rnn_team_fwd_kernel, grid, *args, x, x, N, NH, D, t, 1, *strides, CELL=cell_id, G=G, S=S, SYNC=False,
             **kw)


def rnn_team_bwd(cell_id: int, x, Wt, b_acc, states, rh, do, dstate_final, lengths, dstate_seq, dx, drh, dstate0,
                 launch):
    """``fused.rnn_fused_bwd`` on the team path (same tensors): fills dx, drh and dstate0's h, c, n slots."""
    N, Tm, G, NH, D = x.shape
    grid = _grid(N, NH, D, launch)
    kw = _kw(x.dtype, launch, D)
    S = states.shape[1]
    lens = host_ints(lengths, x.device)
    dsf = dstate_final.contiguous()
    seq = dstate_seq.contiguous() if dstate_seq is not None else dsf
    carry = torch.zeros(3, NH, N, D, device=x.device, dtype=states.dtype)
    args = (x, Wt, b_acc, states, rh, do, dsf, lens, seq, dx, drh, carry, dstate0)
    strides = (*Wt.stride(), *x.stride(), *do.stride(), *dx.stride())
    const = dict(CELL=cell_id, G=G, S=S, HAS_SEQ=dstate_seq is not None, **kw)
    if launch.sync:
        cnt = torch.zeros(grid[1] * NH, dtype=torch.int32, device=x.device)
        ring = torch.empty(2, NH, N, G * D, dtype=Wt.dtype, device=x.device)
        _run(_rnn_team_bwd_kernel, grid, *args, cnt, ring, N, NH, D, Tm, Tm - 1, Tm, 1, *strides, SYNC=True,
             launch_cooperative_grid=True, **const)
        return
    for t in range(Tm - 1, -1, -1):
        _run(_rnn_team_bwd_kernel, grid, *args, lens, x, N, NH, D, Tm, t, 1, 0, *strides, SYNC=False, **const)
    _run(_rnn_team_bwd_kernel, grid, *args, lens, x, N, NH, D, Tm, -1, 0, 1, *strides, SYNC=False, **const)


def compile_check(cell_id: int, G: int, S: int, D: int, dtype: torch.dtype, launch, N: int, NH: int,
                  device: torch.device, sync: bool | None = None, num_warps: int = 4) -> tuple[int, bool]:
    """``(spill bytes, failed)`` of one team launch (``tiling.TeamLaunch``): its forward and backward kernels
    compiled for ``device`` without running (Triton's ``warmup``, dtypes in place of tensors; contiguous layouts of
    N rows, NH heads and 1024 steps, as a contiguous batch's launch specializes them, so that launch finds them in
    Triton's cache; ``sync`` None: the persistent kernel where the team fits the SMs), both at once on two threads,
    loaded (which checks shared memory and threads), and the larger of their local-memory (spill) bytes per thread
    read. For ``tiling.choose_team_launch_compiled`` (a GPU only; the interpreter compiles nothing)."""
    sync = launch.fits if sync is None else sync
    run = types.SimpleNamespace(BB=launch.BB, BC=launch.BC, BK=launch.BK, resident=launch.resident,
                                num_stages=launch.num_stages, num_warps=num_warps)
    grid, kw = _grid(N, NH, D, run), _kw(dtype, run, D)
    Tm, f32, i32 = 1024, torch.float32, torch.int32
    w = (D * G * D, G * D, 1)  # Wt [NH, D, G D] in x's dtype
    x = (Tm * G * NH * D, G * NH * D, NH * D, D, 1)  # x, dx [N, Tm, G, NH, D]
    o = (Tm * NH * D, NH * D, D, 1)  # o, do [N, Tm, NH, D]
    cnt, ring = (i32, dtype) if sync else (dtype, dtype)
    opts = dict(launch_cooperative_grid=True) if sync else {}
    launches = ((_rnn_team_fwd_kernel, (dtype, dtype, f32, f32, f32, dtype, cnt, ring, N, NH, D, 0,
                                        Tm if sync else 1, *w, *x, *o), {}),
                (_rnn_team_bwd_kernel, (dtype, dtype, f32, f32, f32, dtype, f32, i32, f32, dtype, f32, f32, f32,
                                        i32, ring, N, NH, D, Tm, Tm - 1, Tm if sync else 1, 1 if sync else 0, *w,
                                        *x, *o, *x), {"HAS_SEQ": False}))

    def build(kernel, args, extra):  # loading the binary checks shared memory and threads and reads n_spills
        with torch.cuda.device(device):
            compiled = kernel.warmup(*args, grid=grid, CELL=cell_id, G=G, S=S, SYNC=sync, **extra, **kw, **opts)
            compiled._init_handles()
            return int(getattr(compiled, "n_spills", 0) or 0)

    spill, failed = 0, False
    with ThreadPoolExecutor(len(launches), thread_name_prefix="tfla-compile") as pool:  # both kernels at once
        for f in [pool.submit(build, *spec) for spec in launches]:
            try:
                spill = max(spill, f.result())
            except triton.runtime.errors.OutOfResources:
                failed = True
    return spill, failed
