"""The cell math of the four cells of ``tfla/ops/rnn/README.md`` as ``@triton.jit`` helpers (one step forward,
``_cell_fwd``, and its gradient, ``_cell_bwd``; the cell a ``tl.constexpr`` flag), shared by the alternating path's
pointwise kernels here (one cell update per time step and per launch) and the fused kernels of ``fused.py`` (all
steps in one launch).

Notation: B batch, G gates, NH heads, D head dim, S states of the cell, E = NH * B * D elements per step,
BE the block of elements per program. Internal layouts (fp32, or float64 for float64 inputs):
states ``[S, NH, B, D]`` per step (h first, so ``states[0]`` is the matmul operand ``[NH, B, D]``),
``rh = R h_{t-1}`` ``[NH, B, G, D]`` per step. x and the output h are read and written through their strides.
"""
from __future__ import annotations

import triton
import triton.language as tl

# the cells, as constexpr globals (a @triton.jit function may read only those; host code uses ``.value``)
ELMAN, LSTM, GRU, SLSTM = (tl.constexpr(i) for i in range(4))


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    # sign(x) (1 - e^{-2|x|}) / (1 + e^{-2|x|}): no overflow for any finite x
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _logsigmoid(x):
    return tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))




@triton.jit
def _cell_fwd(x0, r0, x1, r1, x2, r2, x3, r3, h0, c0, n0, m0, CELL: tl.constexpr):
    """One step of ``CELL`` on blocks of one shape (fp32 or float64): gate j's input x_j and recurrent part
    ``r_j = R_j h_{t-1} + b_j`` (apart: the GRU's n gate scales r_2 by r), the states before the step (h0, c0, n0,
    m0). Returns the states after it, (h, c, n, m); arguments of gates or states the cell lacks are ignored
    (passed through for states)."""
    h, c, n, m = h0, c0, n0, m0
    if CELL == ELMAN:
        h = _tanh(x0 + r0)
    elif CELL == LSTM:
        c = _sigmoid(x1 + r1) * c0 + _sigmoid(x0 + r0) * _tanh(x2 + r2)
        h = _sigmoid(x3 + r3) * _tanh(c)
    elif CELL == GRU:
        r = _sigmoid(x0 + r0)
        z = _sigmoid(x1 + r1)
        h = (1.0 - z) * _tanh(x2 + r * r2) + z * h0
    else:  # SLSTM
        a_i = x0 + r0
        lf = _logsigmoid(x1 + r1) + m0
        m = tl.where(n0 == 0.0, a_i, tl.maximum(a_i, lf))
        ig = tl.exp(a_i - m)
        fg = tl.exp(lf - m)
        c = fg * c0 + ig * _tanh(x2 + r2)
        n = fg * n0 + ig
        h = _sigmoid(x3 + r3) * c / n
    return h, c, n, m


@triton.jit
def _cell_bwd(x0, r0, x1, r1, x2, r2, x3, r3, h0, c0, n0, m0, h1, c1, n1, m1, dh, dc, dn, CELL: tl.constexpr):
    """Gradient of one ``_cell_fwd`` step (the sLSTM's m a constant). In: the step's gate inputs, the states
    before (h0, c0, n0, m0) and after it (h1, c1, n1, m1), dh the whole gradient of h_t, dc and dn the gradients
    of c_t, n_t carried from later steps. Returns ``(d0, d1, d2, d3, dr2, dh0, dc0, dn0)``: the gradient of gate
    j's pre-activation (that of x_j, and of r_j but for the GRU's n gate), of r_2 (the GRU: r d2), the direct part
    of dh_{t-1} (the GRU's z dh; 0 for the others, whose h_{t-1} acts only through R), and of c_{t-1}, n_{t-1}
    (values of gates and states the cell lacks are meaningless)."""
    d0 = dh * 0.0
    d1, d2, d3, dr2, dh0, dc0, dn0 = d0, d0, d0, d0, d0, d0, d0
    if CELL == ELMAN:
        d0 = dh * (1.0 - h1 * h1)
    elif CELL == LSTM:
        ig = _sigmoid(x0 + r0)
        fg = _sigmoid(x1 + r1)
        zg = _tanh(x2 + r2)
        og = _sigmoid(x3 + r3)
        tc = _tanh(c1)
        dc = dc + dh * og * (1.0 - tc * tc)
        d0 = dc * zg * ig * (1.0 - ig)
        d1 = dc * c0 * fg * (1.0 - fg)
        d2 = dc * ig * (1.0 - zg * zg)
        d3 = dh * tc * og * (1.0 - og)
        dc0 = dc * fg
    elif CELL == GRU:
        r = _sigmoid(x0 + r0)
        z = _sigmoid(x1 + r1)
        ng = _tanh(x2 + r * r2)
        d2 = dh * (1.0 - z) * (1.0 - ng * ng)
        d1 = dh * (h0 - ng) * z * (1.0 - z)
        d0 = d2 * r2 * r * (1.0 - r)
        dr2 = d2 * r
        dh0 = dh * z
    else:  # SLSTM, m a constant
        a_f = x1 + r1
        ig = tl.exp(x0 + r0 - m1)
        fg = tl.exp(_logsigmoid(a_f) + m0 - m1)
        zg = _tanh(x2 + r2)
        og = _sigmoid(x3 + r3)
        dc = dc + dh * og / n1
        dn = dn - dh * og * c1 / (n1 * n1)
        d0 = (dc * zg + dn) * ig
        d1 = (dc * c0 + dn * n0) * fg * (1.0 - _sigmoid(a_f))
        d2 = dc * ig * (1.0 - zg * zg)
        d3 = dh * (c1 / n1) * og * (1.0 - og)
        dc0 = dc * fg
        dn0 = dn * fg
    if CELL != GRU:
        dr2 = d2
    return d0, d1, d2, d3, dr2, dh0, dc0, dn0


@triton.jit
def _states_in(p, E, m, like, S: tl.constexpr):
    """The states (h, c, n, m) of one step at ``p`` (state k at ``p + k E``); those the cell lacks are ``like``."""
    h = tl.load(p, mask=m, other=0.0)
    c, n, mm = like, like, like
    if S > 1:
        c = tl.load(p + E, mask=m, other=0.0)
    if S > 2:
        n = tl.load(p + 2 * E, mask=m, other=1.0)
        mm = tl.load(p + 3 * E, mask=m, other=0.0)
    return h, c, n, mm


@triton.jit
def _states_out(p, E, m, h, c, n, mm, S: tl.constexpr):
    tl.store(p, h, mask=m)
    if S > 1:
        tl.store(p + E, c, mask=m)
    if S > 2:
        tl.store(p + 2 * E, n, mask=m)
        tl.store(p + 3 * E, mm, mask=m)


@triton.jit
def _store_gates(p, sg, d0, d1, d2, d3, m, G: tl.constexpr):
    """Gate j's block at ``p + j sg``, for the cell's G gates."""
    tl.store(p, d0, mask=m)
    if G > 1:
        tl.store(p + sg, d1, mask=m)
    if G > 2:
        tl.store(p + 2 * sg, d2, mask=m)
    if G > 3:
        tl.store(p + 3 * sg, d3, mask=m)


@triton.jit
def _gate_in(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, j, D, NHD, m, ACC: tl.constexpr):
    """``(x_j, R_j h + b_j)`` of gate j for a block of elements, in ACC."""
    b_x = tl.load(x_ptr + o_x + j * sxg, mask=m, other=0.0).to(ACC)
    b_rh = tl.load(rh_ptr + o_rh + j * D, mask=m, other=0.0).to(ACC)
    b_b = tl.load(b_ptr + o_b + j * NHD, mask=m, other=0.0).to(ACC)
    return b_x, b_rh + b_b


@triton.jit
def _gates_in(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, D, NHD, m, G: tl.constexpr, ACC: tl.constexpr):
    """``(x_0, r_0, ..., x_3, r_3)`` of ``_cell_fwd`` for the cell's G gates (the others repeat gate 0's)."""
    x0, r0 = _gate_in(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 0, D, NHD, m, ACC)
    x1, r1, x2, r2, x3, r3 = x0, r0, x0, r0, x0, r0
    if G > 1:
        x1, r1 = _gate_in(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 1, D, NHD, m, ACC)
    if G > 2:
        x2, r2 = _gate_in(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 2, D, NHD, m, ACC)
    if G > 3:
        x3, r3 = _gate_in(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 3, D, NHD, m, ACC)
    return x0, r0, x1, r1, x2, r2, x3, r3


@triton.jit
def _step_elements(B, NH, D, sxb, sxn, sxd, G: tl.constexpr, BE: tl.constexpr):
    """This program's BE elements of one step's ``[NH, B, D]``: the flat index and its mask, d, batch row, head,
    and the offsets into x (through its strides), into ``rh`` (``[NH, B, G * D]``, gate 0) and into b (gate 0)."""
    o_e = tl.program_id(0).to(tl.int64) * BE + tl.arange(0, BE)
    m_e = o_e < NH * B * D
    d = o_e % D
    bi = (o_e // D) % B
    n = o_e // (B * D)
    return o_e, m_e, d, bi, n, bi * sxb + n * sxn + d * sxd, (o_e // D) * (G * D) + d, n * D + d


@triton.jit
def _rnn_pointwise_fwd_kernel(
    x_ptr, rh_ptr, b_ptr, s_in_ptr, s_out_ptr, o_ptr,
    B, NH, D,
    sxb, sxg, sxn, sxd, sob, son, sod,
    CELL: tl.constexpr, G: tl.constexpr, S: tl.constexpr, BE: tl.constexpr, ACC: tl.constexpr,
):
    """states_t = cell(x_t, R h_{t-1}, b, states_{t-1}); also writes h_t into the output in its dtype."""
    o_e, m_e, d, bi, n, o_x, o_rh, o_b = _step_elements(B, NH, D, sxb, sxn, sxd, G, BE)
    E = NH * B * D
    x0, r0, x1, r1, x2, r2, x3, r3 = _gates_in(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, D, NH * D, m_e, G, ACC)
    h0, c0, n0, m0 = _states_in(s_in_ptr + o_e, E, m_e, x0, S)
    h, c, n_new, m_new = _cell_fwd(x0, r0, x1, r1, x2, r2, x3, r3, h0, c0, n0, m0, CELL)
    _states_out(s_out_ptr + o_e, E, m_e, h, c, n_new, m_new, S)
    tl.store(o_ptr + bi * sob + n * son + d * sod, h.to(o_ptr.dtype.element_ty), mask=m_e)


@triton.jit
def _rnn_pointwise_bwd_kernel(
    x_ptr, rh_ptr, b_ptr, s_prev_ptr, s_cur_ptr, do_ptr, dh_rec_ptr, ds_ptr, dx_ptr, drh_ptr,
    B, NH, D,
    sxb, sxg, sxn, sxd, sdb, sdn, sdd, sdxb, sdxg, sdxn, sdxd,
    CELL: tl.constexpr, G: tl.constexpr, S: tl.constexpr, BE: tl.constexpr, ACC: tl.constexpr,
):
    """Gradient of one step. In: dh_t = do_t + dh_rec (the recurrent part R^T drh_{t+1} + its direct part), the
    carried state gradients ``ds[1:]`` (c, n; m is a constant). Out: dx_t (the pre-activation gradients), drh_t
    (the gradients of R h_{t-1}: dx_t but r * dn for the GRU's n gate), ``ds[0]`` = the direct part of dh_{t-1}
    (GRU: z dh_t, else 0), ``ds[1:]`` overwritten with the gradients of c_{t-1}, n_{t-1}."""
    o_e, m_e, d, bi, n, o_x, o_rh, o_b = _step_elements(B, NH, D, sxb, sxn, sxd, G, BE)
    E = NH * B * D
    dh = tl.load(do_ptr + bi * sdb + n * sdn + d * sdd, mask=m_e, other=0.0).to(ACC)
    dh += tl.load(dh_rec_ptr + o_e, mask=m_e, other=0.0)
    x0, r0, x1, r1, x2, r2, x3, r3 = _gates_in(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, D, NH * D, m_e, G, ACC)
    h0, c0, n0, m0 = _states_in(s_prev_ptr + o_e, E, m_e, x0, S)
    h1, c1, n1, m1 = _states_in(s_cur_ptr + o_e, E, m_e, x0, S)
    dc, dn = dh, dh  # (unused by cells without c, n)
    if S > 1:
        dc = tl.load(ds_ptr + E + o_e, mask=m_e, other=0.0)
    if CELL == SLSTM:
        dn = tl.load(ds_ptr + 2 * E + o_e, mask=m_e, other=0.0)
    d0, d1, d2, d3, dr2, dh0, dc0, dn0 = _cell_bwd(x0, r0, x1, r1, x2, r2, x3, r3, h0, c0, n0, m0, h1, c1, n1, m1,
                                                   dh, dc, dn, CELL)
    _store_gates(dx_ptr + bi * sdxb + n * sdxn + d * sdxd, sdxg, d0, d1, d2, d3, m_e, G)
    _store_gates(drh_ptr + o_rh, D, d0, d1, dr2, d3, m_e, G)
    tl.store(ds_ptr + o_e, dh0, mask=m_e)
    if S > 1:
        tl.store(ds_ptr + E + o_e, dc0, mask=m_e)
    if CELL == SLSTM:
        tl.store(ds_ptr + 2 * E + o_e, dn0, mask=m_e)
