"""The fused path of the FlashRNN cells: one launch runs all time steps. One program per (batch tile of BB rows,
head) keeps its rows' states in fp32 registers and its head's recurrent matrices (all G gates) on chip, loaded once,
and loops over t; per step the G products ``h_{t-1} R_j^T`` are ``tl.dot``s and the cell math is ``pointwise.py``'s (the
alternating path's). The backward runs the same way in reverse with dh (and dc, dn) on chip and
``dh_{t-1} = sum_j (d pre-activation_j) R_j`` as ``tl.dot``s. Both keep the alternating path's saved layouts (all
states, ``R h_{t-1}`` per step, the pre-activation gradients), so dR and db are formed after the loop as there.

Notation: N sequences (batch rows), Tm steps, G gates, NH heads, D head dim, S states of the cell, E = NH * N * D
elements of one state per step; BB batch rows and BD (a power of two >= D) head-dim columns per program.
Layouts as ``cells.rnn_fwd``: states ``[Tm + 1, S, NH, N, D]``, rh ``[Tm, NH, N, G * D]`` (fp32), Wt
``[NH, D, G * D]`` (``Wt[n, d, j D + e] = R[j, n, e, d]``); x, o, do, dx through their strides.
Dots: operands in x's dtype for 16-bit inputs (h and the gradients rounded to it, fp32 accumulation), fp32 with
``dot_precision`` (tf32x3 on a GPU, IEEE on the interpreter) for fp32 inputs; float64 runs the alternating path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.utils import cdiv, dot_precision, dot_tile, host_ints
from tfla.ops.rnn.pointwise import SLSTM, _cell_bwd, _cell_fwd, _states_in, _states_out, _store_gates

MAX_FUSED_D = 128  # the largest head dim the fused path takes (chosen by default up to 64: cells.py)
_DOT = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _tile(N, NH, D, BB: tl.constexpr, BD: tl.constexpr):
    """This program's head, its ``[BB, BD]`` tile's batch rows and columns, their mask, and the tile's offsets in
    one state ``[NH, N, D]`` and in one step of rh ``[NH, N, G * D]`` (gate 0)."""
    i_b, i_n = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_b = i_b * BB + tl.arange(0, BB)
    o_d = tl.arange(0, BD)
    m = (o_b < N)[:, None] & (o_d < D)[None, :]
    o_s = (i_n * N + o_b[:, None]) * D + o_d[None, :]
    return i_n, o_b, o_d, m, o_s


@triton.jit
def _weight(p_w, o_d, j, D, swi, swo, TRANS: tl.constexpr, DOT: tl.constexpr):
    """Gate j's ``[BD, BD]`` block of one head's Wt (at p_w; strides swi along d, swo along the G * D columns) in
    DOT, zero outside D: ``R_j^T`` (``[in, out]``, the forward's right operand) or with TRANS ``R_j`` (``[out,
    in]``, the backward's)."""
    m = (o_d < D)[:, None] & (o_d < D)[None, :]
    o_in, o_out = o_d[:, None], o_d[None, :]
    if TRANS:
        o_in, o_out = o_d[None, :], o_d[:, None]
    return tl.load(p_w + o_in * swi + (j * D + o_out) * swo, mask=m, other=0.0).to(DOT)


@triton.jit
def _weights(p_w, o_d, D, swi, swo, G: tl.constexpr, TRANS: tl.constexpr, DOT: tl.constexpr):
    """The G gates' ``_weight`` blocks (gates the cell lacks repeat gate 0's, unused)."""
    w0 = _weight(p_w, o_d, 0, D, swi, swo, TRANS, DOT)
    w1, w2, w3 = w0, w0, w0
    if G > 1:
        w1 = _weight(p_w, o_d, 1, D, swi, swo, TRANS, DOT)
    if G > 2:
        w2 = _weight(p_w, o_d, 2, D, swi, swo, TRANS, DOT)
    if G > 3:
        w3 = _weight(p_w, o_d, 3, D, swi, swo, TRANS, DOT)
    return w0, w1, w2, w3


@triton.jit
def _bias(b_ptr, i_n, o_d, j, NH, D):
    return tl.load(b_ptr + (j * NH + i_n) * D + o_d, mask=o_d < D, other=0.0)[None, :]  # [1, BD]


@triton.jit
def _biases(b_ptr, i_n, o_d, NH, D, G: tl.constexpr):
    """The G gates' biases of head i_n, ``[1, BD]`` each (b ``[G, NH, D]``; gates the cell lacks repeat gate 0's)."""
    b0 = _bias(b_ptr, i_n, o_d, 0, NH, D)
    b1, b2, b3 = b0, b0, b0
    if G > 1:
        b1 = _bias(b_ptr, i_n, o_d, 1, NH, D)
    if G > 2:
        b2 = _bias(b_ptr, i_n, o_d, 2, NH, D)
    if G > 3:
        b3 = _bias(b_ptr, i_n, o_d, 3, NH, D)
    return b0, b1, b2, b3


@triton.jit
def _x(p_x, sxg, j, m):
    return tl.load(p_x + j * sxg, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _xs(p_x, sxg, m, G: tl.constexpr):
    """The G gates' x tiles of one step (gates the cell lacks repeat gate 0's)."""
    x0 = _x(p_x, sxg, 0, m)
    x1, x2, x3 = x0, x0, x0
    if G > 1:
        x1 = _x(p_x, sxg, 1, m)
    if G > 2:
        x2 = _x(p_x, sxg, 2, m)
    if G > 3:
        x3 = _x(p_x, sxg, 3, m)
    return x0, x1, x2, x3


@triton.jit
def _rnn_fused_fwd_kernel(
    x_ptr, wt_ptr, b_ptr, s_ptr, rh_ptr, o_ptr,
    N, NH, D, Tm,
    swn, swi, swo, sxb, sxt, sxg, sxn, sxd, sob, sot, son, sod,
    CELL: tl.constexpr, G: tl.constexpr, S: tl.constexpr, BB: tl.constexpr, BD: tl.constexpr,
    DOT: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr,
):
    """All Tm steps of one batch tile and head: states[t + 1] = cell(x_t, R h_t, b, states[t]), rh[t] = R h_t
    (without b), o_t = h_{t+1} in o's dtype; states[0] is the initial state."""
    i_n, o_b, o_d, m, o_s = _tile(N, NH, D, BB, BD)
    E = NH * N * D
    w0, w1, w2, w3 = _weights(wt_ptr + i_n * swn, o_d, D, swi, swo, G, False, DOT)
    b0, b1, b2, b3 = _biases(b_ptr, i_n, o_d, NH, D, G)
    h, c, n, mx = _states_in(s_ptr + o_s, E, m, tl.zeros([BB, BD], tl.float32), S)  # [BB, BD] each
    o_rh = (i_n * N + o_b[:, None]) * (G * D) + o_d[None, :]
    p_x = x_ptr + o_b[:, None] * sxb + i_n * sxn + o_d[None, :] * sxd
    p_o = o_ptr + o_b[:, None] * sob + i_n * son + o_d[None, :] * sod
    t0 = i_n * 0  # int64 step index
    for i in tl.range(0, Tm, num_stages=STAGES):  # STAGES > 1: step t + 1's loads issued during step t
        t = t0 + i
        hd = h.to(DOT)
        r0 = tl.dot(hd, w0, input_precision=PREC)  # [BB, BD]: (R_0 h_{t-1})^T
        x0 = _x(p_x + t * sxt, sxg, 0, m)
        r1, r2, r3, x1, x2, x3 = r0, r0, r0, x0, x0, x0
        if G > 1:
            r1 = tl.dot(hd, w1, input_precision=PREC)
            x1 = _x(p_x + t * sxt, sxg, 1, m)
        if G > 2:
            r2 = tl.dot(hd, w2, input_precision=PREC)
            x2 = _x(p_x + t * sxt, sxg, 2, m)
        if G > 3:
            r3 = tl.dot(hd, w3, input_precision=PREC)
            x3 = _x(p_x + t * sxt, sxg, 3, m)
        _store_gates(rh_ptr + t * (N * NH * G * D) + o_rh, D, r0, r1, r2, r3, m, G)
        h, c, n, mx = _cell_fwd(x0, r0 + b0, x1, r1 + b1, x2, r2 + b2, x3, r3 + b3, h, c, n, mx, CELL)
        _states_out(s_ptr + (t + 1) * (S * E) + o_s, E, m, h, c, n, mx, S)
        tl.store(p_o + t * sot, h.to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _bwd_inputs(t, m, last, o_s, E, dsf_ptr, dseq_ptr, p_do, sdt, p_x, sxt, sxg, p_rh, D, b0, b1, b2, b3, s_ptr,
                CELL: tl.constexpr, G: tl.constexpr, S: tl.constexpr, HAS_SEQ: tl.constexpr):
    """Everything one backward step of a ``[BB, BD]`` tile reads (none of it depends on the later steps, so a loop
    may load step t - 1's during step t): the final state's cotangents where a row's last step is t (h, c, n), the
    state sequence's (c, n), do_t, the gate inputs x_t and ``R h_{t-1} + b``, and the states at t and t + 1; values
    the cell lacks are zeros (n: ones), lanes off m zeros. A tuple for ``_bwd_math``."""
    zero = tl.zeros(m.shape, tl.float32)
    m_f = m & (last == t)
    fh = tl.load(dsf_ptr + o_s, mask=m_f, other=0.0)
    fc, fn, sc, sn = zero, zero, zero, zero
    if S > 1:
        fc = tl.load(dsf_ptr + E + o_s, mask=m_f, other=0.0)
    if CELL == SLSTM:
        fn = tl.load(dsf_ptr + 2 * E + o_s, mask=m_f, other=0.0)
    if HAS_SEQ:
        sc = tl.load(dseq_ptr + t * ((S - 1) * E) + o_s, mask=m, other=0.0)
        if CELL == SLSTM:
            sn = tl.load(dseq_ptr + t * ((S - 1) * E) + E + o_s, mask=m, other=0.0)
    do = tl.load(p_do + t * sdt, mask=m, other=0.0).to(tl.float32)
    x0, x1, x2, x3 = _xs(p_x + t * sxt, sxg, m, G)
    r0 = tl.load(p_rh, mask=m, other=0.0) + b0
    r1, r2, r3 = r0, r0, r0
    if G > 1:
        r1 = tl.load(p_rh + D, mask=m, other=0.0) + b1
    if G > 2:
        r2 = tl.load(p_rh + 2 * D, mask=m, other=0.0) + b2
    if G > 3:
        r3 = tl.load(p_rh + 3 * D, mask=m, other=0.0) + b3
    h0, c0, n0, m0 = _states_in(s_ptr + t * (S * E) + o_s, E, m, zero, S)
    h1, c1, n1, m1 = _states_in(s_ptr + (t + 1) * (S * E) + o_s, E, m, zero, S)
    return fh, fc, fn, sc, sn, do, x0, x1, x2, x3, r0, r1, r2, r3, h0, c0, n0, m0, h1, c1, n1, m1


@triton.jit
def _bwd_math(dh_rec, dc, dn, inp, CELL: tl.constexpr, S: tl.constexpr, HAS_SEQ: tl.constexpr):
    """One backward step of a ``[BB, BD]`` tile (the fused and team paths') from ``_bwd_inputs``' tuple: the final
    state's and the state sequence's cotangents added, dh_t = do_t + dh_rec (its part from step t + 1), the cell's
    backward. Returns ``(d0, d1, d2, dr2, d3, dh0, dc, dn)``: the pre-activation gradients (dx_t's gates), those that
    enter ``dh_{t-1} = dh0 + sum_j d_j R_j`` (dr2 for gate 2: the GRU's r d2) and dc, dn of ``c_{t-1}, n_{t-1}``;
    ``_bwd_store`` writes them."""
    fh, fc, fn, sc, sn, do, x0, x1, x2, x3, r0, r1, r2, r3, h0, c0, n0, m0, h1, c1, n1, m1 = inp
    dh_rec += fh
    if S > 1:
        dc += fc
    if CELL == SLSTM:
        dn += fn
    if HAS_SEQ:
        dc += sc
        if CELL == SLSTM:
            dn += sn
    dh = do + dh_rec
    d0, d1, d2, d3, dr2, dh0, dc, dn = _cell_bwd(x0, r0, x1, r1, x2, r2, x3, r3, h0, c0, n0, m0, h1, c1, n1, m1, dh,
                                                 dc, dn, CELL)
    return d0, d1, d2, dr2, d3, dh0, dc, dn


@triton.jit
def _bwd_store(t, d0, d1, d2, dr2, d3, m, p_dx, sdxt, sdxg, p_drh, D, G: tl.constexpr):
    """A backward step's stores: dx_t (the pre-activation gradients, in dx's dtype) and the gradient of ``R h_{t-1}``
    at p_drh (fp32)."""
    _store_gates(p_dx + t * sdxt, sdxg, d0, d1, d2, d3, m, G)
    _store_gates(p_drh, D, d0, d1, dr2, d3, m, G)


@triton.jit
def _rnn_fused_bwd_kernel(
    x_ptr, wt_ptr, b_ptr, s_ptr, rh_ptr, do_ptr, dsf_ptr, len_ptr, dseq_ptr, dx_ptr, drh_ptr, ds0_ptr,
    N, NH, D, Tm,
    swn, swi, swo, sxb, sxt, sxg, sxn, sxd, sdb, sdt, sdn, sdd, sdxb, sdxt, sdxg, sdxn, sdxd,
    CELL: tl.constexpr, G: tl.constexpr, S: tl.constexpr, BB: tl.constexpr, BD: tl.constexpr,
    DOT: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr, HAS_SEQ: tl.constexpr,
):
    """``cells.rnn_bwd`` for one batch tile and head, all steps in reverse. dsf ``[S, NH, N, D]``: the final
    state's cotangents, added before step ``len - 1`` of each row (after the loop for ``len = 0``); dseq
    ``[Tm, S - 1, NH, N, D]`` (with HAS_SEQ): the cotangents of c (and n) after every step. Writes dx, drh per step
    and ds0 (the initial state's gradient: h, c, n; the m slot is left as it is)."""
    i_n, o_b, o_d, m, o_s = _tile(N, NH, D, BB, BD)
    E = NH * N * D
    w0, w1, w2, w3 = _weights(wt_ptr + i_n * swn, o_d, D, swi, swo, G, True, DOT)
    zero = tl.zeros([BB, BD], tl.float32)
    b0, b1, b2, b3 = _biases(b_ptr, i_n, o_d, NH, D, G)
    last = tl.load(len_ptr + o_b, mask=o_b < N, other=-1)[:, None] - 1  # [BB, 1]: each row's last step
    dh_rec, dc, dn = zero, zero, zero  # dh_rec: dh_t's part from step t + 1; dc, dn: of c_t, n_t
    o_rh = (i_n * N + o_b[:, None]) * (G * D) + o_d[None, :]
    p_x = x_ptr + o_b[:, None] * sxb + i_n * sxn + o_d[None, :] * sxd
    p_do = do_ptr + o_b[:, None] * sdb + i_n * sdn + o_d[None, :] * sdd
    p_dx = dx_ptr + o_b[:, None] * sdxb + i_n * sdxn + o_d[None, :] * sdxd
    t_last = i_n * 0 + Tm - 1  # int64 step index
    for i in tl.range(0, Tm, num_stages=STAGES):
        t = t_last - i
        inp = _bwd_inputs(t, m, last, o_s, E, dsf_ptr, dseq_ptr, p_do, sdt, p_x, sxt, sxg,
                          rh_ptr + t * (N * NH * G * D) + o_rh, D, b0, b1, b2, b3, s_ptr, CELL, G, S, HAS_SEQ)
        d0, d1, d2, dr2, d3, dh0, dc, dn = _bwd_math(dh_rec, dc, dn, inp, CELL, S, HAS_SEQ)
        _bwd_store(t, d0, d1, d2, dr2, d3, m, p_dx, sdxt, sdxg, drh_ptr + t * (N * NH * G * D) + o_rh, D, G)
        # dh_{t-1} = direct part + sum_j (d R_j h_{t-1}) R_j; lanes outside the tile (meaningless values) zeroed
        # before they enter a row's sum
        dh_rec = dh0 + tl.dot(tl.where(m, d0, 0.0).to(DOT), w0, input_precision=PREC)
        if G > 1:
            dh_rec += tl.dot(tl.where(m, d1, 0.0).to(DOT), w1, input_precision=PREC)
        if G > 2:
            dh_rec += tl.dot(tl.where(m, dr2, 0.0).to(DOT), w2, input_precision=PREC)
        if G > 3:
            dh_rec += tl.dot(tl.where(m, d3, 0.0).to(DOT), w3, input_precision=PREC)
    m_f = m & (last == -1)  # empty sequences: the final state is the initial state
    dh_rec += tl.load(dsf_ptr + o_s, mask=m_f, other=0.0)
    tl.store(ds0_ptr + o_s, dh_rec, mask=m)
    if S > 1:
        dc += tl.load(dsf_ptr + E + o_s, mask=m_f, other=0.0)
        tl.store(ds0_ptr + E + o_s, dc, mask=m)
    if CELL == SLSTM:
        dn += tl.load(dsf_ptr + 2 * E + o_s, mask=m_f, other=0.0)
        tl.store(ds0_ptr + 2 * E + o_s, dn, mask=m)


def _run(kernel, grid, *args, **kw):
    """Launch; a launch config that needs more shared memory or registers than the GPU has (a ``config`` the caller
    chose) raises ValueError naming it instead of Triton's OutOfResources."""
    try:
        kernel[grid](*args, **kw)
    except triton.runtime.errors.OutOfResources as e:
        raise ValueError(f"`config` (BB={kw['BB']}, num_warps={kw['num_warps']}, num_stages={kw['STAGES']}) does not "
                         f"fit this GPU: {e}") from e


def _launch(N: int, NH: int, D: int, dtype: torch.dtype, BB: int, num_warps: int, num_stages: int):
    BD = dot_tile(D, MAX_FUSED_D, dtype)
    return (cdiv(N, BB), NH), dict(BB=BB, BD=BD, DOT=_DOT[dtype], PREC=dot_precision(dtype),
                                   STAGES=num_stages, num_warps=num_warps)


def rnn_fused_fwd(cell_id: int, x, Wt, b_acc, states, rh, o, BB: int, num_warps: int, num_stages: int):
    """Fills ``states[1:]``, rh and o (``cells.rnn_fwd``'s outputs; states[0] holds the initial state)."""
    N, Tm, G, NH, D = x.shape
    grid, kw = _launch(N, NH, D, x.dtype, BB, num_warps, num_stages)
    _run(_rnn_fused_fwd_kernel, grid,
         x, Wt, b_acc, states, rh, o, N, NH, D, Tm, *Wt.stride(), *x.stride(), *o.stride(),
         CELL=cell_id, G=G, S=states.shape[1], **kw)


def rnn_fused_bwd(cell_id: int, x, Wt, b_acc, states, rh, do, dstate_final, lengths, dstate_seq, dx, drh, dstate0,
                  BB: int, num_warps: int, num_stages: int):
    """Fills dx, drh (all steps) and dstate0's h, c, n slots (``cells.rnn_bwd``'s, before dR and db); lengths
    ``[N]`` ints (each row's last step is ``lengths[n] - 1``)."""
    N, Tm, G, NH, D = x.shape
    grid, kw = _launch(N, NH, D, x.dtype, BB, num_warps, num_stages)
    lens = host_ints(lengths, x.device)
    seq = dstate_seq.contiguous() if dstate_seq is not None else dstate_final
    _run(_rnn_fused_bwd_kernel, grid,
         x, Wt, b_acc, states, rh, do, dstate_final.contiguous(), lens, seq, dx, drh, dstate0, N, NH, D, Tm,
         *Wt.stride(), *x.stride(), *do.stride(), *dx.stride(),
         CELL=cell_id, G=G, S=states.shape[1], HAS_SEQ=dstate_seq is not None, **kw)


def compile_check(cell_id: int, G: int, S: int, D: int, dtype: torch.dtype, config: tuple[int, int, int], N: int,
                  NH: int, device: torch.device) -> tuple[int, bool]:
    """``(spill bytes, failed)`` of one fused launch ``config = (BB, num_warps, num_stages)``: its forward and
    backward kernels compiled for ``device`` without running (Triton's ``warmup``, dtypes in place of tensors;
    contiguous layouts of N rows, NH heads and 1024 steps), loaded (which checks shared memory and threads), and the
    larger of their local-memory (spill) bytes per thread read. For ``tiling.choose_fused_launch_compiled`` (a GPU
    only; the interpreter compiles nothing)."""
    BB, num_warps, num_stages = config
    grid, kw = _launch(N, NH, D, dtype, BB, num_warps, num_stages)
    Tm, f32 = 1024, torch.float32
    w = (D * G * D, G * D, 1)  # Wt [NH, D, G D]
    x = (Tm * G * NH * D, G * NH * D, NH * D, D, 1)  # x, dx [N, Tm, G, NH, D]
    o = (Tm * NH * D, NH * D, D, 1)  # o, do [N, Tm, NH, D]
    launches = ((_rnn_fused_fwd_kernel, (dtype, f32, f32, f32, f32, dtype, N, NH, D, Tm, *w, *x, *o), {}),
                (_rnn_fused_bwd_kernel, (dtype, f32, f32, f32, f32, dtype, f32, torch.int32, f32, dtype, f32, f32,
                                         N, NH, D, Tm, *w, *x, *o, *x), {"HAS_SEQ": False}))
    spill = 0
    try:
        with torch.cuda.device(device):
            for kernel, args, extra in launches:
                compiled = kernel.warmup(*args, grid=grid, CELL=cell_id, G=G, S=S, **extra, **kw)
                compiled._init_handles()  # loads the binary: shared memory and threads checked, n_spills read
                spill = max(spill, int(getattr(compiled, "n_spills", 0) or 0))
    except triton.runtime.errors.OutOfResources:
        return spill, True
    return spill, False
