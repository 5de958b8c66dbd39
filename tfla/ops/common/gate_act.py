"""FLA 0.6.0's gate and beta activations of the Gated DeltaNet, inside the gate's chunk cumsum: the forward's
prologue and the backward's epilogue over ``[B, T, HV]`` in one pass each, instead of PyTorch ops and their
autograd (a launch and a full read and write per elementwise op).

Notation: B batch, T time, HV value heads, BT chunk (64 rows: the gate's cumsum restarts there).

Gate (``use_gate_in_kernel``; FLA's ``fused_gdn_gating``, Qwen3-Next's GatedDeltaNet layer):
``g = -exp(A_log) softplus(a + dt_bias)`` per token from the pre-activation ``a`` and the per-head ``A_log``,
``dt_bias``. Beta (``use_beta_sigmoid_in_kernel``): ``beta = sigmoid(b)``, times 2 with ``allow_neg_eigval``.

Forward (``gate_prologue``): ``G = cumsum(max(g, LOG_DECAY_FLOOR)) / ln 2`` within each 64-row chunk (what
``chunk_local_cumsum`` gives the op) and the activated beta. Backward (``gate_epilogue``): the gate gradient
``dg = reverse_cumsum(dgq) + dgam`` (as ``chunk_local_cumsum``), then ``da = dg * dg/da``, the per-program sums of
``dg * g`` (A_log's gradient) and of ``da`` (dt_bias's), and ``db = dbeta * dbeta/db``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tfla.ops.common.grid import check_varlen_batch, chunk_rows, program_rows, tile_grid
from tfla.ops.common.utils import LOG_DECAY_FLOOR, RCP_LN2, acc_dtype, cdiv, prepare_chunk_indices

NO_BETA, BETA_SIGMOID, BETA_2SIGMOID = 0, 1, 2


class GateAct(NamedTuple):
    """The activations a call asked for: ``A_log`` ``[HV]`` (None: g is the log decay itself), ``dt_bias`` ``[HV]``
    or None, ``beta`` one of ``NO_BETA``, ``BETA_SIGMOID``, ``BETA_2SIGMOID``."""

    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    beta: int


@triton.jit
def _softplus(x):
    """``log(1 + e^x)``, and x itself above 20 (``torch.nn.functional.softplus``'s threshold, as FLA's gate);
    below, ``max(x, 0) + log1p(e^-|x|)`` with log1p by its series where e^-|x| is tiny."""
    y = tl.exp(-tl.abs(x))
    sp = tl.maximum(x, 0.0) + tl.where(y < 1e-4, y * (1.0 - y * (0.5 - y / 3.0)), tl.log(1.0 + y))
    return tl.where(x > 20.0, x, sp)


@triton.jit
def _softplus_grad(x):
    """d softplus / dx with the same threshold: 1 above 20, else sigmoid(x)."""
    return tl.where(x > 20.0, 1.0, tl.sigmoid(x))


@triton.jit
def _gdn_gate_kernel(
    g, beta, A_log, dt_bias,  # inputs: gate (pre-activation with GATE), beta pre-activation, [HV] parameters
    out, beta_out,  # forward: G (log2) and the activated beta; backward: dg or da, and d beta pre-activation
    dg_in, dg_add, dbeta, part,  # backward: the gate-gradient parts, dbeta, [NT, B*HV, 2] sums for A_log / dt_bias
    cu_seqlens, chunk_indices, T, NT,
    HV: tl.constexpr, BT: tl.constexpr, REVERSE: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BETA: tl.constexpr, IS_VARLEN: tl.constexpr, FLAT: tl.constexpr, ACC: tl.constexpr, FLOOR: tl.constexpr,
    SCALE: tl.constexpr, HAS_ADD: tl.constexpr,
):
    """One (chunk, batch x head) per program. ``GATE``: g holds ``a`` and ``g = -exp(A_log) softplus(a + dt_bias)``
    (``HAS_BIAS``); ``BETA``: 0 none, 1 sigmoid, 2 twice the sigmoid; ``REVERSE``: the backward (module docstring)."""
    i_t, i_bh = program_rows(T, BT, HV, IS_VARLEN, FLAT)
    i_part = (i_bh * NT + i_t) * 2  # this program's two sums in part [B * HV, NT, 2]
    i_b, i_h = i_bh // HV, i_bh % HV
    i_t, bos, T = chunk_rows(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m = o_t < T
    p = (bos + o_t) * HV + i_h
    if GATE:
        b_x = tl.load(g + p, mask=m, other=0.0).to(ACC)  # [BT] the pre-activation
        if HAS_BIAS:
            b_x += tl.load(dt_bias + i_h).to(ACC)
        b_e = tl.exp(tl.load(A_log + i_h).to(ACC))
        b_g = -b_e * _softplus(b_x)
    elif not REVERSE:  # (the backward reads g only through the activation)
        b_g = tl.load(g + p, mask=m, other=0.0).to(ACC)
    if not REVERSE:
        b_gf = tl.where(b_g < FLOOR, FLOOR, b_g)  # (a comparison: NaN stays NaN)
        tl.store(out + p, (tl.cumsum(b_gf, axis=0) * SCALE).to(out.dtype.element_ty), mask=m)
        if BETA > 0:
            b_s = tl.sigmoid(tl.load(beta + p, mask=m, other=0.0).to(ACC))
            tl.store(beta_out + p, (b_s * BETA).to(beta_out.dtype.element_ty), mask=m)
    else:
        # scanned from the end (chunk_local_cumsum's order), plus the delta part's own gradient
        b_dg = tl.cumsum(tl.load(dg_in + p, mask=m, other=0.0).to(ACC), axis=0, reverse=True)
        if HAS_ADD:
            b_dg += tl.load(dg_add + p, mask=m, other=0.0).to(ACC)
        if GATE:
            b_da = tl.where(m, -b_e * _softplus_grad(b_x) * b_dg, 0.0)
            tl.store(out + p, b_da.to(out.dtype.element_ty), mask=m)
            tl.store(part + i_part, tl.sum(tl.where(m, b_dg * b_g, 0.0), axis=0))
            tl.store(part + i_part + 1, tl.sum(b_da, axis=0))
        else:
            tl.store(out + p, b_dg.to(out.dtype.element_ty), mask=m)
        if BETA > 0:
            b_s = tl.sigmoid(tl.load(beta + p, mask=m, other=0.0).to(ACC))
            b_db = tl.load(dbeta + p, mask=m, other=0.0).to(ACC) * b_s * (1.0 - b_s) * BETA
            tl.store(beta_out + p, b_db.to(beta_out.dtype.element_ty), mask=m)


def _launch(g, act: GateAct, cu_seqlens, chunk_indices, bounds, reverse, **ptrs):
    """One launch over g's ``[B, T, HV]``; returns ``part [B * HV, NT, 2]`` (the backward's per-program sums for
    A_log and dt_bias) or None."""
    B, T, HV = g.shape
    if cu_seqlens is not None:
        check_varlen_batch(B, cu_seqlens)
        if chunk_indices is None:
            chunk_indices = prepare_chunk_indices(bounds, 64, g.device)
        NT = chunk_indices.shape[0]
    else:
        NT = cdiv(T, 64)
    acc = torch.float64 if g.dtype == torch.float64 else torch.float32
    # every program writes its two sums: no zero fill
    part = torch.empty(B * HV, NT, 2, dtype=acc, device=g.device) if reverse and act.A_log is not None else None
    if NT == 0 or B * HV == 0:
        return part
    dummy = ptrs["out"]  # stands in for absent pointers (their constexpr flags are off)
    args = {n: (ptrs.get(n) if ptrs.get(n) is not None else dummy)
            for n in ("beta", "out", "beta_out", "dg_in", "dg_add", "dbeta")}
    grid, flat = tile_grid(NT, B * HV)
    _gdn_gate_kernel[grid](
        g, args["beta"], act.A_log if act.A_log is not None else dummy,
        act.dt_bias if act.dt_bias is not None else dummy, args["out"], args["beta_out"], args["dg_in"],
        args["dg_add"], args["dbeta"], part if part is not None else dummy, cu_seqlens, chunk_indices, T, NT,
        HV=HV, BT=64, REVERSE=reverse, GATE=act.A_log is not None, HAS_BIAS=act.dt_bias is not None,
        BETA=act.beta, IS_VARLEN=cu_seqlens is not None, FLAT=flat, ACC=acc_dtype(g.dtype),
        FLOOR=LOG_DECAY_FLOOR, SCALE=RCP_LN2, HAS_ADD=ptrs.get("dg_add") is not None, num_warps=1,
    )
    return part


def gate_prologue(g: torch.Tensor, beta: torch.Tensor, act: GateAct, cu_seqlens=None, chunk_indices=None,
                  bounds=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, beta)``: G ``[B, T, HV]`` the gate's chunk cumsum in log2 units (fp32; float64 for float64 g), restarting
    every 64 rows (per sequence with ``cu_seqlens``: ``chunk_indices`` its 64-row table, or ``bounds`` its host
    copy), of the activated gate when ``act.A_log`` is given, floored at ``LOG_DECAY_FLOOR``; beta activated by
    ``act.beta`` (fp32; float64 for float64 beta) or ``beta`` itself."""
    acc = torch.float64 if g.dtype == torch.float64 else torch.float32
    g = g.contiguous()
    out = torch.empty(g.shape, dtype=acc, device=g.device)
    beta_out = None
    if act.beta != NO_BETA:
        beta = beta.contiguous()
        beta_out = torch.empty(beta.shape, dtype=torch.float64 if beta.dtype == torch.float64 else torch.float32,
                               device=beta.device)
    _launch(g, act, cu_seqlens, chunk_indices, bounds, False, beta=beta, out=out, beta_out=beta_out)
    return out, (beta_out if beta_out is not None else beta)


def gate_epilogue(dgq: torch.Tensor, dgam: torch.Tensor | None, dbeta: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, act: GateAct, cu_seqlens=None, chunk_indices=None, bounds=None):
    """The backward of ``gate_prologue`` and of the gate's chunk cumsum, from ``dgq`` (the part whose reverse cumsum
    within 64 rows is the gate gradient), ``dgam`` (added after it, or None), both ``[B, T, HV]``, and ``dbeta`` (of
    the activated beta); ``g``, ``beta`` the forward's inputs. Returns ``(dg, dbeta, dA_log, ddt_bias)``: dg
    ``[B, T, HV]`` of g as given (the pre-activation with ``act.A_log``), fp32 (float64 for float64 g); dbeta of beta
    as given (fp32 when activated, else ``dbeta`` itself); dA_log, ddt_bias ``[HV]`` fp32 / float64, or None."""
    acc = torch.float64 if g.dtype == torch.float64 else torch.float32
    out = torch.empty(g.shape, dtype=acc, device=g.device)
    dbeta_out = torch.empty(beta.shape, dtype=acc, device=beta.device) if act.beta != NO_BETA else None
    part = _launch(g.contiguous(), act, cu_seqlens, chunk_indices, bounds, True, beta=beta.contiguous(), out=out,
                   beta_out=dbeta_out, dg_in=dgq.contiguous(),
                   dg_add=dgam.contiguous() if dgam is not None else None, dbeta=dbeta.contiguous())
    dA_log = ddt = None
    if part is not None:
        sums = part.view(g.shape[0], g.shape[2], -1, 2).sum((0, 2))  # over batches and chunks, per head
        dA_log, ddt = sums[:, 0], (sums[:, 1] if act.dt_bias is not None else None)
    return out, (dbeta_out if dbeta_out is not None else dbeta), dA_log, ddt
