"""Decode for linear attention with scalar, constant or no decay: one fused recurrent kernel
(``tfla.fused_recurrent_simple_gla``), forward only, FLA 0.6.0's ``fused_recurrent_simple_gla`` arguments.

Per head, state ``S [K, V]`` in fp32 registers (float64 for float64 inputs): ``S_t = e^{g_t} S_{t-1} + k_t v_t^T``,
``o_t = scale S_t^T q_t`` (``g_t`` per token and head, or ``g_gamma`` per head, or none). One program per (sequence,
head, value tile of BV columns) walks its sequence's tokens (in reverse with ``reverse``); the grid depends on shapes
only and nothing is read back to the host, so a call can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.grid import program_pair, tile_grid
from tfla.ops.common.utils import SUB_CHUNK, acc_dtype, cdiv, next_pow2, on_input_device, sm_count
from tfla.ops.gated_delta_rule.fused_recurrent import _token_inputs, launch_config
from tfla.ops.simple_gla.chunk import _check
from tfla.utils.validation import state_in_fla_layout, state_in_kv_layout


@triton.jit(do_not_specialize=["T"])
def _simple_gla_fused_recurrent_fwd_kernel(
    q, k, v, g, gamma, o, h0, ht, cu_seqlens, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    USE_G: tl.constexpr, USE_GAMMA: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
    IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr, FLAT: tl.constexpr, ACC: tl.constexpr,
):
    i_v, i_nh = program_pair(NV, FLAT)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:  # offsets clamped into [0, T]: a malformed cu_seqlens reads nothing outside the tensors
        eos = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_n + 1).to(tl.int64), 0), T)
        bos = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_n).to(tl.int64), 0), eos)
    else:
        bos = i_n * T
        eos = bos + T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    p_s = i_nh * K * V + o_k[:, None] * V + o_v[None, :]
    # the first token's inputs go out before the state's load (independent of it), as in the GDN decode kernel: one
    # memory round trip less per program at T = 1
    row = eos - 1 if REVERSE else bos
    b_q, b_k, b_v, _, b_eg = _token_inputs(q, k, v, g, q, row, bos < eos, i_h, i_h, o_k, o_v, m_k, m_v, H, H, K, V,
                                           USE_G, False, ACC)
    b_h = tl.zeros([BK, BV], dtype=ACC)
    if USE_H0:
        b_h += tl.load(h0 + p_s, mask=m_h, other=0.0).to(ACC)
    if USE_GAMMA:
        b_dec = tl.exp(tl.load(gamma + i_h).to(ACC))
    for i_t in range(0, eos - bos):
        row = bos + i_t
        if REVERSE:
            row = eos - 1 - i_t
        if USE_G:
            b_h = b_h * b_eg
        if USE_GAMMA:
            b_h = b_h * b_dec
        b_h = b_h + b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0) * scale
        tl.store(o + (row * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        nxt = row - 1 if REVERSE else row + 1  # the next token's inputs, after this one's products
        b_q, b_k, b_v, _, b_eg = _token_inputs(q, k, v, g, q, nxt, i_t + 1 < eos - bos, i_h, i_h, o_k, o_v, m_k, m_v,
                                               H, H, K, V, USE_G, False, ACC)
    if STORE_HT:
        tl.store(ht + p_s, b_h.to(ht.dtype.element_ty), mask=m_h)


class _ForwardOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *args):
        return fn(*args)

    @staticmethod
    @on_input_device
    def backward(ctx, *grads):
        raise NotImplementedError("fused_recurrent_simple_gla is forward-only (decode); use tfla.chunk_simple_gla "
                                  "for training")


def _fwd(q, k, v, g, g_gamma, scale, initial_state, output_final_state, reverse, cu_seqlens):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
    ht = torch.empty(N, H, K, V, dtype=acc, device=q.device) if output_final_state else None
    if N * H == 0:
        if ht is not None:
            ht.copy_(initial_state if initial_state is not None else torch.zeros_like(ht))
        return o, ht
    # the GDN decode kernel's launch rule (32 columns on 2 warps where the batch fills the SMs, else 8 on one warp)
    cfg = launch_config(V, None, N * H, sm_count(q))
    BV = cfg["BV"]
    NV = cdiv(V, BV)
    grid, flat = tile_grid(NV, N * H)
    _simple_gla_fused_recurrent_fwd_kernel[grid](
        q, k, v, g, g_gamma, o, initial_state, ht, cu_seqlens, scale, T,
        H=H, K=K, V=V, BK=next_pow2(K), BV=BV, NV=NV, USE_G=g is not None, USE_GAMMA=g_gamma is not None,
        USE_H0=initial_state is not None, STORE_HT=ht is not None, IS_VARLEN=cu_seqlens is not None,
        REVERSE=bool(reverse), FLAT=flat, ACC=acc_dtype(q.dtype), num_warps=cfg["num_warps"],
    )
    return o, ht


@on_input_device
def fused_recurrent_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
):
    r"""Linear attention with a scalar decay per token and head, a constant decay per head (``g_gamma``) or none,
    token by token in one kernel (decode); a drop-in for FLA 0.6.0's ``fused_recurrent_simple_gla`` (same names and
    order), forward only.

    ``S_t = e^{g_t} S_{t-1} + k_t v_t^T``, ``o_t = scale S_t^T q_t`` (ULA paper, Section 2; as ``chunk_simple_gla``).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; fp32, fp16 or bf16 (all the same).
        g: log decay ``[B, T, H]`` (natural log; fp32 or q's dtype) or None; g_gamma: ``[H]`` or None; at most one.
            Positive values are not checked here (a growth, computed as given).
        scale: default ``K ** -0.5``. initial_state: ``[N, H, K, V]`` (``[N, H, V, K]`` with ``state_v_first``),
            read in fp32. output_final_state: return the state after each sequence's last token (its first with
            ``reverse``).
        reverse: walk each sequence from its last token to its first.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B = 1); device values are not read back (clamped into
            ``[0, T]`` in the kernel).

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32 ([N, H, V, K] with state_v_first) or None)``.

    Raises:
        ValueError / TypeError naming the argument as ``chunk_simple_gla``; NotImplementedError in backward (a decode
        kernel keeps no per-token states; ``chunk_simple_gla`` trains).
    """
    user_state = initial_state
    initial_state = state_in_kv_layout(initial_state, state_v_first)
    _check(q, k, v, g, g_gamma, scale, initial_state, cu_seqlens, SUB_CHUNK)
    if not isinstance(reverse, bool):
        raise TypeError(f"`reverse` must be a bool, got {type(reverse).__name__}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    q, k, v = (x.contiguous() for x in (q, k, v))
    g = g.contiguous() if g is not None else None
    gamma = g_gamma.detach().to(device=q.device, dtype=torch.float32).contiguous() if g_gamma is not None else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    args = (q, k, v, g, gamma, float(scale), h0, bool(output_final_state), reverse, cu_seqlens)
    if torch.compiler.is_compiling():  # one custom op (library.py; forward only there: no autograd formula)
        from tfla.ops.simple_gla.library import fused_recurrent_fwd

        o, ht = fused_recurrent_fwd(*args)
        return o, state_in_fla_layout(ht if output_final_state else None, state_v_first)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (q, k, v, g, user_state)):
        o, ht = _ForwardOnly.apply(_fwd, *args)
    else:
        o, ht = _fwd(*args)
    return o, state_in_fla_layout(ht, state_v_first)
