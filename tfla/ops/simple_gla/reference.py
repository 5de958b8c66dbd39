"""Ground truth for linear attention with a scalar (per token and head) or no decay.

Notation: B batch, T time, H heads, K/V head dims, N sequences.

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,    o_t = scale S_t^T q_t          (FLA's simple GLA)

``g`` is the log decay ``[B, T, H]`` (natural log, <= 0), or ``g_gamma [H]`` a constant per head
(RetNet / Lightning Attention), or neither (linear transformer). Computes in q's dtype.

Normalized linear attention (FLA's ``chunk_linear_attn(normalize=True)``) also carries the key sum:

    z_t = z_{t-1} + k_t,    o_t = scale S_t^T q_t / (scale q_t . z_t + 1e-10)
"""
from __future__ import annotations

import itertools

import torch


def recurrent_simple_gla_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Step-by-step recurrence; returns ``(o [B, T, H, V], final_state [N, H, K, V] or None)``."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if cu_seqlens is not None:
        bounds = [int(b) for b in cu_seqlens.tolist()]
        outs, finals = [], []
        for n, (b0, b1) in enumerate(zip(bounds[:-1], bounds[1:])):
            h0 = initial_state[n:n + 1] if initial_state is not None else None
            o_n, s_n = recurrent_simple_gla_ref(q[:, b0:b1], k[:, b0:b1], v[:, b0:b1],
                                                g[:, b0:b1] if g is not None else None, g_gamma, scale, h0, True)
            outs.append(o_n)
            finals.append(s_n)
        return torch.cat(outs, 1), (torch.cat(finals, 0) if output_final_state else None)
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = q.new_zeros(B, H, K, V)
    if initial_state is not None:
        S = S + initial_state.to(q.dtype)
    o = []
    for t in range(T):
        if g is not None:
            S = S * torch.exp(g[:, t])[..., None, None]
        elif g_gamma is not None:
            S = S * torch.exp(g_gamma.to(q.dtype))[None, :, None, None]
        S = S + k[:, t, :, :, None] * v[:, t, :, None, :]
        o.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(o, 1) if o else q.new_zeros(B, 0, H, V)
    return o, (S if output_final_state else None)


def recurrent_linear_attn_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | tuple | None = None,
    output_final_state: bool = False,
    normalize: bool = True,
    cu_seqlens: torch.Tensor | None = None,
):
    """Step-by-step linear attention as FLA's ``chunk_linear_attn`` (fla 0.6.0) defines it.

    ``initial_state``: ``S_0 [N, H, K, V]``, or with ``normalize`` a tuple ``(S_0 or None, z_0 [N, 1, H, K] or
    None)``. Returns ``(o, (S_T or None, z_T [N, 1, H, K]))`` with ``normalize`` (z_T always), else
    ``(o, S_T or None)``. z restarts per sequence of ``cu_seqlens`` (from z_0[n]); the epsilon is FLA's.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    kv0, z0 = initial_state, None
    if normalize and isinstance(initial_state, tuple):
        kv0, z0 = initial_state
    if cu_seqlens is not None:
        bounds = [int(b) for b in cu_seqlens.tolist()]
        outs, states, zs = [], [], []
        for n, (b0, b1) in enumerate(itertools.pairwise(bounds)):
            init = (kv0[n:n + 1] if kv0 is not None else None, z0[n:n + 1] if z0 is not None else None)
            o_n, st = recurrent_linear_attn_ref(q[:, b0:b1], k[:, b0:b1], v[:, b0:b1], scale, init, True, normalize)
            outs.append(o_n)
            states.append(st[0] if normalize else st)
            if normalize:
                zs.append(st[1])
        o, S = torch.cat(outs, 1), (torch.cat(states, 0) if output_final_state else None)
        return (o, (S, torch.cat(zs, 0))) if normalize else (o, S)
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = q.new_zeros(B, H, K, V) + (kv0.to(q.dtype) if kv0 is not None else 0)
    z = q.new_zeros(B, H, K) + (z0[:, 0].to(q.dtype) if z0 is not None else 0)
    o = []
    for t in range(T):
        S = S + k[:, t, :, :, None] * v[:, t, :, None, :]
        z = z + k[:, t]
        o_t = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
        if normalize:
            o_t = o_t / (scale * (q[:, t] * z).sum(-1, keepdim=True) + 1e-10)
        o.append(o_t)
    o = torch.stack(o, 1) if o else q.new_zeros(B, 0, H, V)
    S = S if output_final_state else None
    return (o, (S, z[:, None])) if normalize else (o, S)


def lightning_log_decay(H: int, layer_idx: int, num_layers: int, device=None) -> torch.Tensor:
    """Lightning Attention's per-head log decays for layer ``layer_idx`` of ``num_layers`` (ALiBi-style slopes
    scaled down with depth, Qin et al., "Lightning Attention-2", 2024; the values FLA's ``chunk_lightning_attn``
    uses): ``-(8 / H) (1 - layer_idx / num_layers) h`` for head h = 0 .. H - 1 (head 0: no decay)."""
    return -(8.0 / H) * (1.0 - layer_idx / num_layers) * torch.arange(H, dtype=torch.float32, device=device)


def retention_log_decay(H: int, device=None) -> torch.Tensor:
    """RetNet's per-head decays as FLA's ``chunk_retention`` uses them: ``log(1 - 2^(-5 - h))``."""
    return torch.log(1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float32, device=device)))
