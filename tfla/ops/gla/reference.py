"""Ground truth for gated linear attention with a vector decay per key channel (FLA's GLA).

Notation: B batch, T time, H heads, K/V head dims, N sequences.

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,    o_t = scale S_t^T q_t

``g`` is the log decay ``[B, T, H, K]`` (natural log, <= 0), one per key channel (GLA paper,
Yang et al. 2023, Eq. 3; ULA paper Section 2.1, "vector decay"). Computes in q's dtype (pass
float64 for tests); no chunking, no log2.
"""
from __future__ import annotations

import itertools

import torch


def recurrent_gla_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Step-by-step recurrence; returns ``(o [B, T, H, V], final_state [N, H, K, V] or None)``.
    With ``cu_seqlens`` (B = 1) each packed sequence restarts from its own ``initial_state[n]``."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if cu_seqlens is not None:
        bounds = [int(b) for b in cu_seqlens.tolist()]
        outs, finals = [], []
        for n, (b0, b1) in enumerate(itertools.pairwise(bounds)):
            h0 = initial_state[n:n + 1] if initial_state is not None else None
            o_n, s_n = recurrent_gla_ref(q[:, b0:b1], k[:, b0:b1], v[:, b0:b1], g[:, b0:b1], scale, h0, True)
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
        S = S * torch.exp(g[:, t].to(q.dtype))[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(o, 1) if o else q.new_zeros(B, 0, H, V)
    return o, (S if output_final_state else None)
