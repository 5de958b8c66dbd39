"""``torch.library`` custom ops of the FlashRNN cells (``tfla.elman``, ``lstm``, ``gru``, ``slstm``), the path they
take while ``torch.compile`` traces them (as ``tfla/ops/gated_delta_rule/library.py``). Varlen pads to the longest
sequence, a length only known when the op runs, so the kept steps (states, ``R h``) have no shape the fake
implementation could give: the backward op runs the forward again for them (exact; the compiled backward costs one
more forward than eager's).
"""
from __future__ import annotations

import ast

import torch

from tfla.ops.common.utils import host_ints, on_input_device
from tfla.ops.common.varlen import cached_bounds
from tfla.ops.rnn.cells import _acc, fused_launch, pad_rows, rnn_bwd, rnn_fwd, unpad_rows
from tfla.ops.rnn.reference import CELL_STATES
from tfla.utils.validation import check_varlen_bounds


def config_arg(config: dict | None) -> str:
    """The cells' ``config`` (keys ``cells.CONFIG_KEYS``: strings, ints, bools) as the ops' string argument (a custom
    op takes no dict): a dict literal with sorted keys, so equal configs give equal arguments (plain string
    formatting, which Dynamo traces; ``json`` it does not)."""
    config = config or {}
    return "{" + ", ".join(f"{k!r}: {config[k]!r}" for k in sorted(config)) + "}"


def _config(config: str) -> dict:
    """The cells' ``config`` from the ops' argument (``config_arg``)."""
    return ast.literal_eval(config)


def _forward(cell, x, R, b, state0, cu_seqlens, config):
    """The padded run: ``(h packed like x's rows, states, rh, Wt, b_acc, xp, lengths, gather, unpack, fused)``."""
    B, T = x.shape[:2]
    gather = unpack = None
    lengths = (T,) * B
    xp = x
    if cu_seqlens is not None:
        bounds = cached_bounds(cu_seqlens)
        check_varlen_bounds(bounds, T)
        lengths = tuple(b1 - b0 for b0, b1 in zip(bounds[:-1], bounds[1:]))
        xp, gather, unpack = pad_rows(x, bounds, lengths)
    N, _, _, NH, D = xp.shape
    acc = _acc(x.dtype)
    S = len(CELL_STATES[cell])
    s0 = torch.stack([s.to(acc).transpose(0, 1) for s in state0]) if state0 else \
        torch.zeros(S, NH, N, D, device=x.device, dtype=acc)
    fused = fused_launch(config, x.dtype, N, NH, D, x.device, cell=cell)
    o, states, rh, Wt, b_acc = rnn_fwd(cell, xp, R, b, s0, fused)
    h = o if unpack is None else unpad_rows(o, unpack)
    return h, states, rh, Wt, b_acc, xp, lengths, gather, unpack, fused


@torch.library.custom_op("tfla::rnn_fwd", mutates_args=())
@on_input_device
def rnn_fwd_op(x: torch.Tensor, R: torch.Tensor, b: torch.Tensor, state0: list[torch.Tensor],
               cu_seqlens: torch.Tensor | None, cell: str, output_final_state: bool, config: str
               ) -> list[torch.Tensor]:
    """``[h, *final_state]`` (the final state's tensors ``[N, NH, D]`` in the accumulation dtype, when asked);
    config: the cells' ``config`` as ``config_arg`` gives it (every key)."""
    cfg = _config(config)
    h, states, *_, lengths, _, _, _ = _forward(cell, x, R, b, state0, cu_seqlens, cfg)
    if not output_final_state:
        return [h]
    N = len(lengths)
    idx = host_ints(lengths, x.device, torch.long)
    final = states[idx, :, :, torch.arange(N, device=x.device)]  # [N, S, NH, D]
    return [h] + [final[:, k].contiguous() for k in range(states.shape[1])]


@rnn_fwd_op.register_fake
def _(x, R, b, state0, cu_seqlens, cell, output_final_state, config):
    B, T, _, NH, D = x.shape
    h = x.new_empty(B, T, NH, D)
    if not output_final_state:
        return [h]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return [h] + [x.new_empty(N, NH, D, dtype=_acc(x.dtype)) for _ in CELL_STATES[cell]]


@torch.library.custom_op("tfla::rnn_bwd", mutates_args=())
@on_input_device
def rnn_bwd_op(x: torch.Tensor, R: torch.Tensor, b: torch.Tensor, state0: list[torch.Tensor],
               cu_seqlens: torch.Tensor | None, dh: torch.Tensor, dfinal: list[torch.Tensor], cell: str,
               config: str) -> list[torch.Tensor]:
    """``[dx, dR, db, *d initial_state]`` in the inputs' dtypes; ``dfinal``: the final state's cotangents ``[N, NH,
    D]`` each (zeros where none), or empty."""
    _, states, rh, Wt, b_acc, xp, lengths, gather, unpack, fused = _forward(cell, x, R, b, state0, cu_seqlens,
                                                                          _config(config))
    N, Tm, _, NH, D = xp.shape
    acc = states.dtype
    dhp = dh if unpack is None else dh.new_zeros(N * Tm, NH, D).index_copy_(0, unpack, dh[0]).view(N, Tm, NH, D)
    dsf = torch.zeros(states.shape[1], NH, N, D, device=x.device, dtype=acc)
    for k, g in enumerate(dfinal):
        dsf[k] = g.to(acc).transpose(0, 1)
    dxp, dR, db, ds0 = rnn_bwd(cell, xp, Wt, b_acc, states, rh, dhp.contiguous(), dsf, lengths, fused=fused)
    if gather is None:
        dx = dxp
    else:  # back to packed rows (pad steps read the zero row T, whose gradient is dropped)
        dx_ext = dxp.new_zeros(x.shape[1] + 1, *x.shape[2:])
        dx_ext.index_add_(0, gather.reshape(-1), dxp.reshape(-1, *x.shape[2:]))
        dx = dx_ext[:-1].unsqueeze(0)
    # contiguous: the fake implementation promises the inputs' (contiguous) strides, and inductor checks them (dR
    # comes out of a transposed product)
    return [dx.to(x.dtype).contiguous(), dR.to(R.dtype).contiguous(), db.to(b.dtype).contiguous()] + \
        [ds0[k].transpose(0, 1).to(s.dtype, copy=True).contiguous() for k, s in enumerate(state0)]  # (no two alias)


@rnn_bwd_op.register_fake
def _(x, R, b, state0, cu_seqlens, dh, dfinal, cell, config):
    return [x.new_empty(x.shape), R.new_empty(R.shape), b.new_empty(b.shape)] + [s.new_empty(s.shape) for s in state0]


def _setup_context(ctx, inputs, output):
    x, R, b, state0, cu_seqlens, cell, output_final_state, config = inputs
    ctx.save_for_backward(x, R, b, cu_seqlens, *state0)
    ctx.cell, ctx.output_final_state, ctx.config = cell, output_final_state, config


def _backward(ctx, grads):
    x, R, b, cu_seqlens, *state0 = ctx.saved_tensors
    dh = grads[0] if grads[0] is not None else torch.zeros(*x.shape[:2], *x.shape[3:], device=x.device,
                                                           dtype=x.dtype)
    dfinal = []
    if ctx.output_final_state:
        N = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        dfinal = [g if g is not None else x.new_zeros(N, x.shape[3], x.shape[4], dtype=_acc(x.dtype))
                  for g in grads[1:]]
    out = rnn_bwd_op(x, R, b, list(state0), cu_seqlens, dh, dfinal, ctx.cell, ctx.config)
    return out[0], out[1], out[2], list(out[3:]), None, None, None, None


rnn_fwd_op.register_autograd(_backward, setup_context=_setup_context)
