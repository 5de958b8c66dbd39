"""Fused pointwise Triton kernels of the alternating path: one cell update per time step (forward) and its
gradient (backward), for the four cells of ``tfla/ops/rnn/README.md``; the cell is a ``tl.constexpr`` flag.

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
def _store_four_gates(dx_ptr, drh_ptr, o_dx, o_rh, sdxg, D, da_0, da_1, da_2, da_3, m_e):
    """The four pre-activation gradients of an LSTM / sLSTM step into dx (gate stride ``sdxg``) and into the
    recurrent product's gradient (gates D apart)."""
    tl.store(dx_ptr + o_dx, da_0, mask=m_e)
    tl.store(dx_ptr + o_dx + sdxg, da_1, mask=m_e)
    tl.store(dx_ptr + o_dx + 2 * sdxg, da_2, mask=m_e)
    tl.store(dx_ptr + o_dx + 3 * sdxg, da_3, mask=m_e)
    tl.store(drh_ptr + o_rh, da_0, mask=m_e)
    tl.store(drh_ptr + o_rh + D, da_1, mask=m_e)
    tl.store(drh_ptr + o_rh + 2 * D, da_2, mask=m_e)
    tl.store(drh_ptr + o_rh + 3 * D, da_3, mask=m_e)


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
def _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, j, D, NHD, m, ACC: tl.constexpr):
    """(x, R h, b) of gate ``j`` for a block of elements, in ACC."""
    b_x = tl.load(x_ptr + o_x + j * sxg, mask=m, other=0.0).to(ACC)
    b_rh = tl.load(rh_ptr + o_rh + j * D, mask=m, other=0.0).to(ACC)
    b_b = tl.load(b_ptr + o_b + j * NHD, mask=m, other=0.0).to(ACC)
    return b_x, b_rh, b_b


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
    CELL: tl.constexpr, G: tl.constexpr, BE: tl.constexpr, ACC: tl.constexpr,
):
    """states_t = cell(x_t, R h_{t-1}, b, states_{t-1}); also writes h_t into the output in its dtype."""
    o_e, m_e, d, bi, n, o_x, o_rh, o_b = _step_elements(B, NH, D, sxb, sxn, sxd, G, BE)
    E = NH * B * D
    NHD = NH * D
    if CELL == ELMAN:
        xh, rh, bh = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 0, D, NHD, m_e, ACC)
        h = _tanh(xh + rh + bh)
    elif CELL == LSTM:
        xi, ri, bi_ = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 0, D, NHD, m_e, ACC)
        xf, rf, bf = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 1, D, NHD, m_e, ACC)
        xz, rz, bz = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 2, D, NHD, m_e, ACC)
        xo, ro, bo = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 3, D, NHD, m_e, ACC)
        c_prev = tl.load(s_in_ptr + E + o_e, mask=m_e, other=0.0)
        c = _sigmoid(xf + rf + bf) * c_prev + _sigmoid(xi + ri + bi_) * _tanh(xz + rz + bz)
        h = _sigmoid(xo + ro + bo) * _tanh(c)
        tl.store(s_out_ptr + E + o_e, c, mask=m_e)
    elif CELL == GRU:
        xr, rr, br = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 0, D, NHD, m_e, ACC)
        xz, rz, bz = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 1, D, NHD, m_e, ACC)
        xn, rn, bn = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 2, D, NHD, m_e, ACC)
        h_prev = tl.load(s_in_ptr + o_e, mask=m_e, other=0.0)
        r = _sigmoid(xr + rr + br)
        z = _sigmoid(xz + rz + bz)
        h = (1.0 - z) * _tanh(xn + r * (rn + bn)) + z * h_prev
    else:  # SLSTM
        xi, ri, bi_ = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 0, D, NHD, m_e, ACC)
        xf, rf, bf = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 1, D, NHD, m_e, ACC)
        xz, rz, bz = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 2, D, NHD, m_e, ACC)
        xo, ro, bo = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 3, D, NHD, m_e, ACC)
        c_prev = tl.load(s_in_ptr + E + o_e, mask=m_e, other=0.0)
        n_prev = tl.load(s_in_ptr + 2 * E + o_e, mask=m_e, other=0.0)
        m_prev = tl.load(s_in_ptr + 3 * E + o_e, mask=m_e, other=0.0)
        a_i = xi + ri + bi_
        lf = _logsigmoid(xf + rf + bf) + m_prev
        m_new = tl.where(n_prev == 0.0, a_i, tl.maximum(a_i, lf))
        ig = tl.exp(a_i - m_new)
        fg = tl.exp(lf - m_new)
        c = fg * c_prev + ig * _tanh(xz + rz + bz)
        n_new = fg * n_prev + ig
        h = _sigmoid(xo + ro + bo) * c / n_new
        tl.store(s_out_ptr + E + o_e, c, mask=m_e)
        tl.store(s_out_ptr + 2 * E + o_e, n_new, mask=m_e)
        tl.store(s_out_ptr + 3 * E + o_e, m_new, mask=m_e)
    tl.store(s_out_ptr + o_e, h, mask=m_e)
    tl.store(o_ptr + bi * sob + n * son + d * sod, h.to(o_ptr.dtype.element_ty), mask=m_e)


@triton.jit
def _rnn_pointwise_bwd_kernel(
    x_ptr, rh_ptr, b_ptr, s_prev_ptr, s_cur_ptr, do_ptr, dh_rec_ptr, ds_ptr, dx_ptr, drh_ptr,
    B, NH, D,
    sxb, sxg, sxn, sxd, sdb, sdn, sdd, sdxb, sdxg, sdxn, sdxd,
    CELL: tl.constexpr, G: tl.constexpr, BE: tl.constexpr, ACC: tl.constexpr,
):
    """Gradient of one step. In: dh_t = do_t + dh_rec (the recurrent part R^T drh_{t+1} + its direct part), the
    carried state gradients ``ds[1:]`` (c, n; m is a constant). Out: dx_t (the pre-activation gradients), drh_t
    (the gradients of R h_{t-1}: dx_t but r * dn for the GRU's n gate), ``ds[0]`` = the direct part of dh_{t-1}
    (GRU: z dh_t, else 0), ``ds[1:]`` overwritten with the gradients of c_{t-1}, n_{t-1}."""
    o_e, m_e, d, bi, n, o_x, o_rh, o_b = _step_elements(B, NH, D, sxb, sxn, sxd, G, BE)
    E = NH * B * D
    o_dx = bi * sdxb + n * sdxn + d * sdxd
    NHD = NH * D
    dh = tl.load(do_ptr + bi * sdb + n * sdn + d * sdd, mask=m_e, other=0.0).to(ACC)
    dh += tl.load(dh_rec_ptr + o_e, mask=m_e, other=0.0)
    dh_direct = dh * 0.0
    if CELL == ELMAN:
        h = tl.load(s_cur_ptr + o_e, mask=m_e, other=0.0)
        da = dh * (1.0 - h * h)
        tl.store(dx_ptr + o_dx, da, mask=m_e)
        tl.store(drh_ptr + o_rh, da, mask=m_e)
    elif CELL == LSTM:
        xi, ri, bi_ = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 0, D, NHD, m_e, ACC)
        xf, rf, bf = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 1, D, NHD, m_e, ACC)
        xz, rz, bz = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 2, D, NHD, m_e, ACC)
        xo, ro, bo = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 3, D, NHD, m_e, ACC)
        ig = _sigmoid(xi + ri + bi_)
        fg = _sigmoid(xf + rf + bf)
        zg = _tanh(xz + rz + bz)
        og = _sigmoid(xo + ro + bo)
        c_prev = tl.load(s_prev_ptr + E + o_e, mask=m_e, other=0.0)
        tc = _tanh(tl.load(s_cur_ptr + E + o_e, mask=m_e, other=0.0))
        dc = tl.load(ds_ptr + E + o_e, mask=m_e, other=0.0) + dh * og * (1.0 - tc * tc)
        da_i = dc * zg * ig * (1.0 - ig)
        da_f = dc * c_prev * fg * (1.0 - fg)
        da_z = dc * ig * (1.0 - zg * zg)
        da_o = dh * tc * og * (1.0 - og)
        tl.store(ds_ptr + E + o_e, dc * fg, mask=m_e)
        _store_four_gates(dx_ptr, drh_ptr, o_dx, o_rh, sdxg, D, da_i, da_f, da_z, da_o, m_e)
    elif CELL == GRU:
        xr, rr, br = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 0, D, NHD, m_e, ACC)
        xz, rz, bz = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 1, D, NHD, m_e, ACC)
        xn, rn, bn = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 2, D, NHD, m_e, ACC)
        h_prev = tl.load(s_prev_ptr + o_e, mask=m_e, other=0.0)
        r = _sigmoid(xr + rr + br)
        z = _sigmoid(xz + rz + bz)
        hn = rn + bn
        ng = _tanh(xn + r * hn)
        da_n = dh * (1.0 - z) * (1.0 - ng * ng)
        da_z = dh * (h_prev - ng) * z * (1.0 - z)
        da_r = da_n * hn * r * (1.0 - r)
        dh_direct = dh * z
        tl.store(dx_ptr + o_dx, da_r, mask=m_e)
        tl.store(dx_ptr + o_dx + sdxg, da_z, mask=m_e)
        tl.store(dx_ptr + o_dx + 2 * sdxg, da_n, mask=m_e)
        tl.store(drh_ptr + o_rh, da_r, mask=m_e)
        tl.store(drh_ptr + o_rh + D, da_z, mask=m_e)
        tl.store(drh_ptr + o_rh + 2 * D, da_n * r, mask=m_e)
    else:  # SLSTM, m a constant
        xi, ri, bi_ = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 0, D, NHD, m_e, ACC)
        xf, rf, bf = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 1, D, NHD, m_e, ACC)
        xz, rz, bz = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 2, D, NHD, m_e, ACC)
        xo, ro, bo = _gate(x_ptr, rh_ptr, b_ptr, o_x, o_rh, o_b, sxg, 3, D, NHD, m_e, ACC)
        c_prev = tl.load(s_prev_ptr + E + o_e, mask=m_e, other=0.0)
        n_prev = tl.load(s_prev_ptr + 2 * E + o_e, mask=m_e, other=0.0)
        m_prev = tl.load(s_prev_ptr + 3 * E + o_e, mask=m_e, other=0.0)
        c = tl.load(s_cur_ptr + E + o_e, mask=m_e, other=0.0)
        n_cur = tl.load(s_cur_ptr + 2 * E + o_e, mask=m_e, other=1.0)
        m_cur = tl.load(s_cur_ptr + 3 * E + o_e, mask=m_e, other=0.0)
        a_i = xi + ri + bi_
        a_f = xf + rf + bf
        ig = tl.exp(a_i - m_cur)
        fg = tl.exp(_logsigmoid(a_f) + m_prev - m_cur)
        zg = _tanh(xz + rz + bz)
        og = _sigmoid(xo + ro + bo)
        dc = tl.load(ds_ptr + E + o_e, mask=m_e, other=0.0) + dh * og / n_cur
        dn = tl.load(ds_ptr + 2 * E + o_e, mask=m_e, other=0.0) - dh * og * c / (n_cur * n_cur)
        da_i = (dc * zg + dn) * ig
        da_f = (dc * c_prev + dn * n_prev) * fg * (1.0 - _sigmoid(a_f))
        da_z = dc * ig * (1.0 - zg * zg)
        da_o = dh * (c / n_cur) * og * (1.0 - og)
        tl.store(ds_ptr + E + o_e, dc * fg, mask=m_e)
        tl.store(ds_ptr + 2 * E + o_e, dn * fg, mask=m_e)
        _store_four_gates(dx_ptr, drh_ptr, o_dx, o_rh, sdxg, D, da_i, da_f, da_z, da_o, m_e)
    tl.store(ds_ptr + o_e, dh_direct, mask=m_e)
