"""Ground truth for linear attention with a scalar (per token and head) or no decay.

Notation: B batch, T time, H heads, K/V head dims, N sequences.

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,    o_t = scale S_t^T q_t          (FLA's simple GLA)

``g`` is the log decay ``[B, T, H]`` (natural log, <= 0), or ``g_gamma [H]`` a constant per head
(RetNet / Lightning Attention), or neither (linear transformer). Computes in q's dtype.
"""
from __future__ import annotations

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


def retention_log_decay(H: int, device=None) -> torch.Tensor:
    """RetNet's per-head decays as FLA's ``chunk_retention`` uses them: ``log(1 - 2^(-5 - h))``."""
    return torch.log(1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float32, device=device)))
