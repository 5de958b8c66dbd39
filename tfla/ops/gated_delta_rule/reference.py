"""Ground truth for the gated delta rule (pure PyTorch, no Triton).

Notation: B batch, T time, H key heads, HV value heads (HV = H * groups), K/V head dims,
N sequences, L outer chunk, C = 64 sub-chunk.

Recurrence (FLA's convention; ``docs/gdn-math.md``), per batch element and value head,
state ``S [K, V]``, log-space gate ``g_t <= 0``:

    S_t = exp(g_t) S_{t-1};   S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T;   o_t = scale S_t^T q_t

* ``recurrent_gated_delta_rule_ref`` steps through time in the dtype it is given (tests pass
  float64); it is the ground truth every kernel is checked against.
* ``chunk_gated_delta_rule_ref`` is the chunkwise form for any outer chunk L, mirroring the kernel
  stages (chunk-local cumsum -> sub-chunk UT/WY -> state recurrence with states every L ->
  L x L causal output), and can return every intermediate so each Triton stage is tested alone.
  With ``ut_level="outer"`` it instead forms the L x L UT transform of the design note
  (``W_L = Tm_L (beta e^G K)``, ``U_L = Tm_L (beta V)``, ``Vnew = U_L - W_L S_0``), which the tests
  use to show the two formulations agree.
"""
from __future__ import annotations

import math

import torch


def _expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, T, H * groups, D]: value head j uses key head j // groups."""
    return x.repeat_interleave(groups, dim=2) if groups > 1 else x


def l2norm_ref(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's l2norm), in x's dtype."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _split_varlen(cu_seqlens):
    bounds = [int(b) for b in cu_seqlens.tolist()]
    return list(zip(bounds[:-1], bounds[1:]))


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Step-by-step gated delta rule in q's dtype.

    Shapes as ``tfla.chunk_gated_delta_rule``: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``,
    g, beta ``[B, T, HV]``, initial_state ``[N, HV, K, V]`` (cast to q's dtype).
    Returns ``(o [B, T, HV, V], final_state [N, HV, K, V] or None)``.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_ref(q), l2norm_ref(k)
    if cu_seqlens is not None:
        outs, finals = [], []
        for n, (bos, eos) in enumerate(_split_varlen(cu_seqlens)):
            h0 = initial_state[n:n + 1] if initial_state is not None else None
            o_n, s_n = recurrent_gated_delta_rule_ref(
                q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], g[:, bos:eos], beta[:, bos:eos],
                scale, h0, True)
            outs.append(o_n)
            finals.append(s_n)
        return torch.cat(outs, 1), (torch.cat(finals, 0) if output_final_state else None)

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k = _expand_heads(q, HV // H), _expand_heads(k, HV // H)
    S = q.new_zeros(B, HV, K, V)
    if initial_state is not None:
        S = S + initial_state.to(q.dtype)
    o = q.new_zeros(B, T, HV, V)
    for t in range(T):
        S = S * torch.exp(g[:, t])[..., None, None]
        kv = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        u = beta[:, t, :, None] * (v[:, t] - kv)
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        o[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, (S if output_final_state else None)


def _unit_lower_inverse_ref(A: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for strictly lower-triangular A [..., n, n]."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    return torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)


def _ut(k, v, beta, G, Gc):
    """UT/WY of one block of rows: k [B, n, HV, K], v [B, n, HV, V], beta/G [B, n, HV], Gc [B, HV].
    Returns Tm [B, HV, n, n], W [B, n, HV, K], U [B, n, HV, V]."""
    kk = torch.einsum("brhk,bshk->bhrs", k, k)
    Gh = G.transpose(1, 2)  # [B, HV, n]
    n = k.shape[1]
    strict = torch.ones(n, n, dtype=torch.bool, device=k.device).tril(-1)
    decay = torch.exp((Gh[..., :, None] - Gh[..., None, :]).masked_fill(~strict, -math.inf))
    A = beta.transpose(1, 2)[..., :, None] * kk * decay
    Tm = _unit_lower_inverse_ref(A)
    xk = (beta * torch.exp(G - Gc[:, None]))[..., None] * k
    W = torch.einsum("bhrs,bshk->brhk", Tm, xk)
    U = torch.einsum("bhrs,bshv->brhv", Tm, beta[..., None] * v)
    return Tm, W, U


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    sub_chunk: int = 64,
    ut_level: str = "sub",
    return_intermediates: bool = False,
):
    """Chunkwise gated delta rule for any outer chunk ``chunk_size`` (L), in q's dtype.

    Stages (the kernels' stages): ``g_cum`` = cumsum of g restarting every L tokens (natural log
    units); per ``sub_chunk`` rows the UT/WY transform (``w``, ``u``); the state recurrence over
    sub-chunks with the state stored at every outer-chunk start (``h [B, NT, HV, K, V]``) and the new
    values ``v_new``; the L x L causal output. ``ut_level="outer"`` forms the L x L UT transform
    instead (design note form; ``w``/``u`` are then outer-level).

    Returns ``(o, final_state)`` or, with ``return_intermediates``, ``(o, final_state, dict)`` with
    keys ``g_cum, w, u, v_new, h``.
    """
    if ut_level not in ("sub", "outer"):
        raise ValueError(f"ut_level must be 'sub' or 'outer', got {ut_level!r}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_ref(q), l2norm_ref(k)
    if cu_seqlens is not None:
        parts = []
        for n, (bos, eos) in enumerate(_split_varlen(cu_seqlens)):
            h0 = initial_state[n:n + 1] if initial_state is not None else None
            parts.append(chunk_gated_delta_rule_ref(
                q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], g[:, bos:eos], beta[:, bos:eos], scale, h0,
                True, False, None, chunk_size, sub_chunk, ut_level, True))
        o = torch.cat([p[0] for p in parts], 1)
        final = torch.cat([p[1] for p in parts], 0) if output_final_state else None
        if not return_intermediates:
            return o, final
        inter = {key: torch.cat([p[2][key] for p in parts], 1) for key in ("g_cum", "w", "u", "v_new", "h")}
        return o, final, inter

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    L, C = chunk_size, sub_chunk
    if ut_level == "sub" and L % C:
        raise ValueError(f"chunk_size {L} must be a multiple of sub_chunk {C}")
    qh, kh = _expand_heads(q, HV // H), _expand_heads(k, HV // H)
    NT = -(-T // L)
    g_cum = torch.cat([torch.cumsum(g[:, c * L:(c + 1) * L], dim=1) for c in range(NT)], 1) if NT else g

    # built from per-chunk pieces (no in-place writes), so autograd can run through this reference
    S = q.new_zeros(B, HV, K, V)
    if initial_state is not None:
        S = S + initial_state.to(q.dtype)
    hs, ws, us, vns, os_ = [], [], [], [], []
    for c in range(NT):
        c0, c1 = c * L, min((c + 1) * L, T)
        hs.append(S)
        S0 = S
        if ut_level == "outer":
            zero = g_cum.new_zeros(B, HV)
            _, w_c, u_c = _ut(kh[:, c0:c1], v[:, c0:c1], beta[:, c0:c1], g_cum[:, c0:c1], zero)
            vn_c = u_c - torch.einsum("brhk,bhkv->brhv", w_c, S0)
            gl = g_cum[:, c1 - 1]
            S = torch.exp(gl)[..., None, None] * S + torch.einsum(
                "brhk,brhv->bhkv", kh[:, c0:c1] * torch.exp(gl[:, None] - g_cum[:, c0:c1])[..., None], vn_c)
            ws.append(w_c)
            us.append(u_c)
            vns.append(vn_c)
        else:
            vn_parts = []
            for s0 in range(c0, c1, C):
                s1 = min(s0 + C, c1)
                gc = g_cum[:, s0 - 1] if s0 > c0 else g_cum.new_zeros(B, HV)
                _, w_s, u_s = _ut(kh[:, s0:s1], v[:, s0:s1], beta[:, s0:s1], g_cum[:, s0:s1], gc)
                vn = u_s - torch.einsum("brhk,bhkv->brhv", w_s, S)
                gn = g_cum[:, s1 - 1]
                S = torch.exp(gn - gc)[..., None, None] * S + torch.einsum(
                    "brhk,brhv->bhkv", kh[:, s0:s1] * torch.exp(gn[:, None] - g_cum[:, s0:s1])[..., None], vn)
                ws.append(w_s)
                us.append(u_s)
                vn_parts.append(vn)
            vn_c = torch.cat(vn_parts, 1)
            vns.append(vn_c)
        # L x L causal output of the outer chunk
        Gc = g_cum[:, c0:c1].transpose(1, 2)  # [B, HV, n]
        n = c1 - c0
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.exp((Gc[..., :, None] - Gc[..., None, :]).masked_fill(~causal, -math.inf))
        att = torch.einsum("brhk,bshk->bhrs", qh[:, c0:c1], kh[:, c0:c1]) * decay
        o_inter = torch.exp(g_cum[:, c0:c1])[..., None] * torch.einsum("brhk,bhkv->brhv", qh[:, c0:c1], S0)
        os_.append(scale * (o_inter + torch.einsum("bhrs,bshv->brhv", att, vn_c)))
    empty = q.new_zeros(B, 0, HV, V)
    o = torch.cat(os_, 1) if os_ else empty
    w = torch.cat(ws, 1) if ws else q.new_zeros(B, 0, HV, K)
    u = torch.cat(us, 1) if us else empty
    v_new = torch.cat(vns, 1) if vns else empty
    h = torch.stack(hs, 1) if hs else q.new_zeros(B, 0, HV, K, V)
    final = S if output_final_state else None
    if return_intermediates:
        return o, final, {"g_cum": g_cum, "w": w, "u": u, "v_new": v_new, "h": h}
    return o, final


def _revcumsum_chunks(x: torch.Tensor, size: int) -> torch.Tensor:
    """Reverse cumulative sum along dim 1 restarting every ``size`` rows: out_t = sum_{t' >= t, same chunk} x_t'."""
    out = torch.empty_like(x)
    for c0 in range(0, x.shape[1], size):
        blk = x[:, c0:c0 + size]
        out[:, c0:c0 + size] = blk.flip(1).cumsum(1).flip(1)
    return out


def chunk_gated_delta_rule_bwd_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    sub_chunk: int = 64,
    return_intermediates: bool = False,
):
    """Backward of the chunkwise gated delta rule, staged as the kernels are (no varlen, no l2norm).

    o-part at the outer chunk L (o = scale (2^G q S_0 + causal-gated (q k^T) Vnew)):
        dvo = scale (gated (q k^T))^T do,  dq = scale (2^G do S_0^T + gated (do Vnew^T) k),
        dko = scale (gated (do Vnew^T))^T q,  dG_o = q.dq - k.dko.
    State backward, reverse over 64-row sub-chunks (dS: gradient of the state after the sub-chunk):
        dU = dvo + e^(gn - g) (K dS);  dS <- e^(gn) dS - W^T dU;  at an outer-chunk start
        dS += scale (e^G Q)^T dO.
    Delta part per sub-chunk j (S_j forward state, dS_{j+1}): dW = -dU S_j^T,
        dk_state = e^(gn - g) Vnew dS_{j+1}^T, then the UT/WY backward gives dk, dv, dbeta, dgamma.
    dg = revcumsum_L(dG_o) + revcumsum_64(dgamma).

    Returns ``(dq, dk, dv, dg, dbeta, dh0)`` in q's dtype, plus a dict of intermediates when asked.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G_ = HV // H
    L, C = chunk_size, sub_chunk
    qh, kh = _expand_heads(q, G_), _expand_heads(k, G_)
    _, _, inter = chunk_gated_delta_rule_ref(q, k, v, g, beta, scale, initial_state, False, False, None, L, C,
                                             "sub", True)
    G, w, vnew, h = inter["g_cum"], inter["w"], inter["v_new"], inter["h"]
    NT = -(-T // L)
    # forward states at every sub-chunk start (recompute)
    S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(q.dtype).clone()
    h_sub = []
    for s0 in range(0, T, C):
        c0 = (s0 // L) * L
        s1 = min(s0 + C, T, c0 + L)
        gc = G[:, s0 - 1] if s0 > c0 else G.new_zeros(B, HV)
        h_sub.append(S)
        gn = G[:, s1 - 1]
        S = torch.exp(gn - gc)[..., None, None] * S + torch.einsum(
            "brhk,brhv->bhkv", kh[:, s0:s1] * torch.exp(gn[:, None] - G[:, s0:s1])[..., None], vnew[:, s0:s1])

    # o-part at the outer level
    dq = q.new_zeros(B, T, HV, K)
    dko = q.new_zeros(B, T, HV, K)
    dvo = q.new_zeros(B, T, HV, V)
    for c in range(NT):
        c0, c1 = c * L, min((c + 1) * L, T)
        n = c1 - c0
        Gc = G[:, c0:c1].transpose(1, 2)
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.exp((Gc[..., :, None] - Gc[..., None, :]).masked_fill(~causal, -math.inf))  # [B,HV,r,s]
        qk = torch.einsum("brhk,bshk->bhrs", qh[:, c0:c1], kh[:, c0:c1]) * decay
        dov = torch.einsum("brhv,bshv->bhrs", do[:, c0:c1], vnew[:, c0:c1]) * decay
        dvo[:, c0:c1] = scale * torch.einsum("bhrs,brhv->bshv", qk, do[:, c0:c1])
        dq[:, c0:c1] = scale * (torch.exp(G[:, c0:c1])[..., None] * torch.einsum("brhv,bhkv->brhk", do[:, c0:c1], h[:, c])
                                + torch.einsum("bhrs,bshk->brhk", dov, kh[:, c0:c1]))
        dko[:, c0:c1] = scale * torch.einsum("bhrs,brhk->bshk", dov, qh[:, c0:c1])
    dG_o = (qh * dq).sum(-1) - (kh * dko).sum(-1)

    # state backward over sub-chunks, reverse
    dS = q.new_zeros(B, HV, K, V) if dht is None else dht.to(q.dtype).clone()
    subs = list(range(0, T, C))
    dh_sub = [None] * len(subs)
    dU = q.new_zeros(B, T, HV, V)
    dS_inter = q.new_zeros(B, HV, K, V)
    for idx in reversed(range(len(subs))):
        s0 = subs[idx]
        c0 = (s0 // L) * L
        s1 = min(s0 + C, T, c0 + L)
        gc = G[:, s0 - 1] if s0 > c0 else G.new_zeros(B, HV)
        gn = G[:, s1 - 1]
        dh_sub[idx] = dS
        dU[:, s0:s1] = dvo[:, s0:s1] + torch.exp(gn[:, None] - G[:, s0:s1])[..., None] * torch.einsum(
            "brhk,bhkv->brhv", kh[:, s0:s1], dS)
        dS_inter = dS_inter + scale * torch.einsum(
            "brhk,brhv->bhkv", qh[:, s0:s1] * torch.exp(G[:, s0:s1])[..., None], do[:, s0:s1])
        dS = torch.exp(gn - gc)[..., None, None] * dS - torch.einsum("brhk,brhv->bhkv", w[:, s0:s1], dU[:, s0:s1])
        if s0 == c0:  # outer-chunk start: the o-part's use of S_0
            dS = dS + dS_inter
            dS_inter = torch.zeros_like(dS_inter)
    dh0 = dS

    # delta part and UT/WY backward per sub-chunk
    dk_d = q.new_zeros(B, T, HV, K)
    dv = q.new_zeros(B, T, HV, V)
    dbeta = q.new_zeros(B, T, HV)
    dgam = q.new_zeros(B, T, HV)
    for idx, s0 in enumerate(subs):
        c0 = (s0 // L) * L
        s1 = min(s0 + C, T, c0 + L)
        n = s1 - s0
        gc = G[:, s0 - 1] if s0 > c0 else G.new_zeros(B, HV)
        gam = (G[:, s0:s1] - gc[:, None])  # [B, n, HV]
        gn = gam[:, -1]
        Sj, dSj1 = h_sub[idx], dh_sub[idx]
        kj, vj, bj = kh[:, s0:s1], v[:, s0:s1], beta[:, s0:s1]
        dUj, vnj = dU[:, s0:s1], vnew[:, s0:s1]
        dW = -torch.einsum("brhv,bhkv->brhk", dUj, Sj)
        e_n = torch.exp(gn[:, None] - gam)  # [B, n, HV]
        dk_state = e_n[..., None] * torch.einsum("brhv,bhkv->brhk", vnj, dSj1)
        P = (kj * dk_state).sum(-1)  # [B, n, HV]
        dg_j = -P
        dg_j[:, -1] += torch.exp(gn) * (Sj * dSj1).sum((-2, -1)) + P.sum(1)
        # UT/WY backward
        Tm, _, _ = _ut(kj, vj, bj, G[:, s0:s1], gc)  # [B, HV, n, n]
        xk = (bj * torch.exp(gam))[..., None] * kj
        xv = bj[..., None] * vj
        dxk = torch.einsum("bhrs,brhk->bshk", Tm, dW)
        dxv = torch.einsum("bhrs,brhv->bshv", Tm, dUj)
        dTm = torch.einsum("brhk,bshk->bhrs", dW, xk) + torch.einsum("brhv,bshv->bhrs", dUj, xv)
        strict = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)
        dA = -(Tm.transpose(-1, -2) @ dTm @ Tm.transpose(-1, -2)) * strict
        gh = gam.transpose(1, 2)
        E = torch.exp((gh[..., :, None] - gh[..., None, :]).masked_fill(~strict, -math.inf))
        kk = torch.einsum("brhk,bshk->bhrs", kj, kj)
        Am = bj.transpose(1, 2)[..., :, None] * kk * E  # A
        M = dA * E * bj.transpose(1, 2)[..., :, None]
        dk_wy = (bj * torch.exp(gam))[..., None] * dxk + torch.einsum("bhrs,bshk->brhk", M, kj) \
            + torch.einsum("bhrs,brhk->bshk", M, kj)
        dAA = (dA * Am)
        dg_j = dg_j + dAA.sum(-1).transpose(1, 2) - dAA.sum(-2).transpose(1, 2) + (dxk * xk).sum(-1)
        dbeta[:, s0:s1] = (dA * kk * E).sum(-1).transpose(1, 2) + (dxk * kj).sum(-1) * torch.exp(gam) + (dxv * vj).sum(-1)
        dk_d[:, s0:s1] = dk_state + dk_wy
        dv[:, s0:s1] = bj[..., None] * dxv
        dgam[:, s0:s1] = dg_j
    dg = _revcumsum_chunks(dG_o, L) + _revcumsum_chunks(dgam, C)
    dk_full = dko + dk_d
    if G_ > 1:
        dq = dq.view(B, T, H, G_, K).sum(3)
        dk_full = dk_full.view(B, T, H, G_, K).sum(3)
    out = (dq, dk_full, dv, dg, dbeta, dh0)
    if return_intermediates:
        return out, {"dvo": dvo, "dq": dq, "dko": dko, "dG_o": dG_o, "dU": dU, "dh_sub": torch.stack(dh_sub, 1),
                     "h_sub": torch.stack(h_sub, 1), "dk_d": dk_d, "dgam": dgam}
    return out
