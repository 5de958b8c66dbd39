"""Ground truth for the mLSTM (xLSTM matrix memory), exponential or sigmoid input gate.

Notation: B batch, T time, H heads, K/V head dims, N sequences (N = B, or the number of ``cu_seqlens``
sequences with B = 1). Layout as FLA: q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, gate pre-activations
i, f ``[B, T, H]``. State ``(C [N, H, K, V], n [N, H, K], m [N, H])`` for ``input_gate="exp"``,
``(C, n)`` for ``"sigmoid"``; None means zeros (m0 = 0), as mlstm_kernels 2.0.6.

- ``recurrent_mlstm_ref``: the step-by-step recurrence, one ``mlstm_step`` per token (equations in
  ``tfla/ops/mlstm/step.py``). This is the ground truth.
- ``parallel_mlstm_ref``: the quadratic form (TFLA paper Appendix B.1, eqs. (19)-(27)) extended with one extra
  "column" for the initial state, an independent cross-check of the recurrence. Unrolling the max-state
  recurrence gives, with F_t = sum_{s<=t} logsigmoid(f_s) and logD_tj = F_t - F_j + i_j (j <= t),

      m_t = max(F_t + m_0, max_{j<=t} logD_tj)

  so the row max of the paper's D matrix alone is *not* the recurrence's m when the initial column wins
  (e.g. strongly negative input gates): the outputs then differ in the ``eps`` term only. mlstm_kernels'
  parallel kernels use the paper's row max (no initial column); this reference includes it and matches the
  recurrence to rounding.

Both compute in float32, or float64 when q is float64 (tests pass float64), and are autograd-safe.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from tfla.ops.mlstm.step import check_mlstm_options, check_mlstm_state, mlstm_step


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _check_inputs(q, k, v, i, f, input_gate, normalize, eps, scale, initial_state, cu_seqlens):
    check_mlstm_options(input_gate, normalize, eps, scale)
    for name, x in (("q", q), ("k", k), ("v", v), ("i", i), ("f", f)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"`q` and `k` must be [B, T, H, K] of one shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"`v` must be [B, T, H, V] with (B, T, H) = {(B, T, H)}, got {tuple(v.shape)}")
    for name, x in (("i", i), ("f", f)):
        if tuple(x.shape) != (B, T, H):
            raise ValueError(f"`{name}` must be [B, T, H] = {(B, T, H)}, got {tuple(x.shape)}")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with `cu_seqlens` the batch size must be 1, got B={B}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None:
        check_mlstm_state(initial_state, input_gate, N, H, K, v.shape[-1], q.device, "initial_state")


def _zero_state(q, v, input_gate, N):
    _, _, H, K = q.shape
    dt = _compute_dtype(q)
    C = q.new_zeros(N, H, K, v.shape[-1], dtype=dt)
    n = q.new_zeros(N, H, K, dtype=dt)
    return (C, n, q.new_zeros(N, H, dtype=dt)) if input_gate == "exp" else (C, n)


def _over_sequences(fn, q, k, v, i, f, initial_state, output_final_state, cu_seqlens, **opts):
    """Run ``fn`` on each ``cu_seqlens`` sequence from its own initial state; concatenate along T / N."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != q.shape[1] or any(b1 < b0 for b0, b1 in itertools.pairwise(bounds)):
        raise ValueError(f"`cu_seqlens` must be non-decreasing from 0 to T={q.shape[1]}, got {bounds}")
    hs, finals = [], []
    for n, (b0, b1) in enumerate(itertools.pairwise(bounds)):
        s0 = tuple(x[n:n + 1] for x in initial_state) if initial_state is not None else None
        h_n, s_n = fn(q[:, b0:b1], k[:, b0:b1], v[:, b0:b1], i[:, b0:b1], f[:, b0:b1],
                      initial_state=s0, output_final_state=True, **opts)
        hs.append(h_n)
        finals.append(s_n)
    final = tuple(torch.cat(xs, 0) for xs in zip(*finals)) if output_final_state else None
    return torch.cat(hs, 1), final


def recurrent_mlstm_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    *,
    input_gate: str = "exp",
    normalize: bool = True,
    eps: float = 1e-6,
    scale: float | None = None,
    initial_state: tuple[torch.Tensor, ...] | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Step-by-step mLSTM: a loop over T of ``mlstm_step``.

    Args: as ``tfla.chunk_mlstm`` (module docstring for shapes); ``cu_seqlens [N+1]`` int offsets with B = 1,
    each sequence restarting from ``initial_state[n]``.

    Returns ``(h [B, T, H, V] in v's dtype, final_state or None)``, the state in float32/float64.
    Raises ValueError/TypeError naming the argument (see ``check_mlstm_options``, ``check_mlstm_state``).
    """
    _check_inputs(q, k, v, i, f, input_gate, normalize, eps, scale, initial_state, cu_seqlens)
    opts = {"input_gate": input_gate, "normalize": normalize, "eps": eps, "scale": scale}
    if cu_seqlens is not None:
        return _over_sequences(recurrent_mlstm_ref, q, k, v, i, f, initial_state, output_final_state,
                               cu_seqlens, **opts)
    B, T, H, _ = q.shape
    state = initial_state
    hs = []
    for t in range(T):
        h_t, state = mlstm_step(q[:, t], k[:, t], v[:, t], i[:, t], f[:, t], state, **opts)
        hs.append(h_t)
    h = torch.stack(hs, 1) if hs else v.new_zeros(B, 0, H, v.shape[-1])
    if not output_final_state:
        return h, None
    if state is None:
        state = _zero_state(q, v, input_gate, B)
    elif T == 0:
        state = tuple(x.to(_compute_dtype(q)) for x in state)
    return h, tuple(state)


def parallel_mlstm_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    *,
    input_gate: str = "exp",
    normalize: bool = True,
    eps: float = 1e-6,
    scale: float | None = None,
    initial_state: tuple[torch.Tensor, ...] | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Quadratic (T x T) mLSTM with the row-max-stabilized gate matrix D plus the initial-state column
    (module docstring). Same arguments, returns and errors as ``recurrent_mlstm_ref``; O(T^2) memory."""
    _check_inputs(q, k, v, i, f, input_gate, normalize, eps, scale, initial_state, cu_seqlens)
    opts = {"input_gate": input_gate, "normalize": normalize, "eps": eps, "scale": scale}
    if cu_seqlens is not None:
        return _over_sequences(parallel_mlstm_ref, q, k, v, i, f, initial_state, output_final_state,
                               cu_seqlens, **opts)
    B, T, H, K = q.shape
    dt = _compute_dtype(q)
    s0 = _zero_state(q, v, input_gate, B) if initial_state is None else tuple(x.to(dt) for x in initial_state)
    if T == 0:
        return v.new_zeros(B, 0, H, v.shape[-1]), (s0 if output_final_state else None)
    if scale is None:
        scale = K ** -0.5
    exp_gate = input_gate == "exp"
    C0, n0 = s0[0], s0[1]                                                     # [B, H, K, V], [B, H, K]
    m0 = s0[2] if exp_gate else torch.zeros_like(s0[1][..., 0])               # [B, H]
    qs = q.to(dt).transpose(1, 2) * scale                                     # [B, H, T, K]
    k_, v_ = k.to(dt).transpose(1, 2), v.to(dt).transpose(1, 2)               # [B, H, T, K], [B, H, T, V]
    Fc = F.logsigmoid(f.to(dt)).transpose(1, 2).cumsum(-1)                    # [B, H, T]  F_t
    log_i = i.to(dt).transpose(1, 2)
    if not exp_gate:
        log_i = F.logsigmoid(log_i)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    logD = torch.where(causal, Fc[..., :, None] - Fc[..., None, :] + log_i[..., None, :], -float("inf"))
    log_g0 = Fc + m0[..., None]                                               # [B, H, T] initial column
    m = torch.maximum(logD.amax(-1), log_g0) if exp_gate else torch.zeros_like(Fc)
    D = torch.exp(logD - m[..., None])                                        # [B, H, T, T]
    g0 = torch.exp(log_g0 - m)                                                # [B, H, T]
    S = (qs @ k_.transpose(-1, -2)) * D
    h = S @ v_ + g0[..., None] * (qs @ C0)                                    # [B, H, T, V]
    if normalize:
        den = S.sum(-1) + g0 * (qs @ n0[..., None])[..., 0]                   # [B, H, T]
        lower = torch.exp(-m) if exp_gate else torch.ones_like(den)
        h = h / (torch.maximum(den.abs(), lower) + eps)[..., None]
    h = h.transpose(1, 2).to(v.dtype)
    if not output_final_state:
        return h, None
    m_T = m[..., -1]                                                          # [B, H]
    w = torch.exp(Fc[..., -1:] - Fc + log_i - m_T[..., None])                 # [B, H, T]
    g_T = torch.exp(Fc[..., -1] + m0 - m_T)                                   # [B, H]
    C_T = g_T[..., None, None] * C0 + torch.einsum("bht,bhtk,bhtv->bhkv", w, k_, v_)
    n_T = g_T[..., None] * n0 + torch.einsum("bht,bhtk->bhk", w, k_)
    return h, ((C_T, n_T, m_T) if exp_gate else (C_T, n_T))
