"""Linear attention with scalar, constant or no decay on tfla's shared two-level engine.

Notation: B batch, T time, H heads, K/V head dims, N sequences, L = chunk_size (outer chunk).

Forward: chunk-local cumsum of g (log2) -> state recurrence (states every L tokens, 64-row
sub-chunks on chip) -> TFLA-tiled output. Backward: states at every 64-row sub-chunk recomputed;
the output's gradients of v, q, k from the same tiled product with permuted arguments (ULA);
the reverse state-gradient recurrence (which also completes dv); the state terms of dk and dg.
These are the Gated DeltaNet kernels with the delta-rule flags off: no second copy of any stage.
"""
from __future__ import annotations

import dataclasses

import torch

from tfla.ops.common.cumsum import positive_flag_for, raise_if_positive
from tfla.ops.common.linear_attn import chunk_simple_gla_bwd, chunk_simple_gla_fwd
from tfla.ops.common.varlen import VarlenIndex
from tfla.utils.validation import (
    check_common,
    check_cotangent,
    check_gate_dtype,
    check_qkv,
    check_tensor,
    check_varlen_bounds,
    host_bounds,
    state_in_fla_layout,
    state_in_kv_layout,
)

DEFAULT_CHUNK_SIZE = 64


@dataclasses.dataclass(frozen=True)
class LinearAttnOptions:
    scale: float
    chunk_size: int
    output_final_state: bool


class ChunkSimpleGLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, varlen, opts: LinearAttnOptions, positive_flag=None):
        o, final_state, g_cum = chunk_simple_gla_fwd(q, k, v, g, opts.scale, initial_state, opts.output_final_state,
                                                     opts.chunk_size, varlen, positive_flag=positive_flag)
        ctx.save_for_backward(q, k, v, g, initial_state, g_cum)
        ctx.varlen, ctx.opts = varlen, opts
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, initial_state, g_cum = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        check_cotangent("o", do, v.shape, q.dtype)
        if dht is not None:
            dht = dht.contiguous()
        # a constant decay (g_gamma expanded, detached) or a g that needs no gradient: its work is skipped
        need_dg = g is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dg, dh0 = chunk_simple_gla_bwd(q, k, v, g_cum, ctx.opts.scale, initial_state, do.contiguous(),
                                                   dht, ctx.opts.chunk_size, ctx.varlen, need_dg=need_dg)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype) if dg is not None else None,
                dh0.to(initial_state.dtype) if dh0 is not None else None, None, None, None)


def _check(q, k, v, g, g_gamma, scale, initial_state, cu_seqlens, chunk_size):
    B, T, H, _, K, V = check_qkv(q, k, v, grouped=False)
    if g is not None and g_gamma is not None:
        raise ValueError("pass at most one of `g` (per-token decay [B, T, H]) and `g_gamma` (per-head decay [H])")
    if g is not None:
        if not isinstance(g, torch.Tensor) or g.shape != (B, T, H):
            raise ValueError(f"`g` must be a scalar log decay per token and head, shape [B, T, H] = {(B, T, H)}, "
                             f"got {tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__}"
                             + (" (a vector decay [B, T, H, K] is chunk_gla's)" if isinstance(g, torch.Tensor)
                                and g.dim() == 4 else ""))
        check_tensor("g", g, 3)
        check_gate_dtype("g", g, q)
    if g_gamma is not None:
        if not isinstance(g_gamma, torch.Tensor) or g_gamma.shape != (H,):
            raise ValueError(f"`g_gamma` must be a per-head log decay of shape [H] = ({H},)")
    named = (("q", q), ("k", k), ("v", v)) + ((("g", g),) if g is not None else ())
    check_common(q, named, scale, initial_state, cu_seqlens, chunk_size, (H, K, V), "H, K, V")


def chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
):
    r"""Linear attention with a scalar decay per token and head (simple GLA, Mamba2-style), a constant
    decay per head (``g_gamma``: RetNet, Lightning Attention), or none. A drop-in for FLA's
    ``chunk_simple_gla``.

    ``S_t = e^{g_t} S_{t-1} + k_t v_t^T``, ``o_t = scale S_t^T q_t`` (ULA paper, Section 2; TFLA Section 2).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; fp32, fp16 or bf16 (all the same).
        g: log decay ``[B, T, H]`` (natural log, <= 0; fp32 or q's dtype) or None.
        g_gamma: constant log decay per head ``[H]`` (<= 0) or None; at most one of g, g_gamma.
        scale: default ``K ** -0.5``. initial_state: ``[N, H, K, V]``. output_final_state: return it.
        state_v_first: initial and final state in FLA's ``[N, H, V, K]`` layout (transposed at the boundary).
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B = 1).
        cu_seqlens_cpu: FLA's host copy of ``cu_seqlens`` (same values; the index tables are built from it
            without a device read).
        chunk_size: outer chunk L in {64, 128, 256, 512} (keyword-only).

    Returns ``(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32 or None)``; differentiable in
    q, k, v, g and initial_state (``g_gamma`` is a constant, as in FLA). The argument order is FLA 0.6.0's.

    Raises ValueError/TypeError naming the argument for wrong shapes or dtypes, a vector decay passed
    as ``g``, positive log decays (checked at the end of the call, after the kernels are queued, waiting
    for the gate's cumsum kernel only; not checked while a CUDA graph is being captured), unsupported sizes or devices.
    """
    initial_state = state_in_kv_layout(initial_state, state_v_first)
    bounds = None if torch.compiler.is_compiling() else host_bounds(cu_seqlens, cu_seqlens_cpu)
    _check(q, k, v, g, g_gamma, scale, initial_state, cu_seqlens, chunk_size)
    o, final_state = _chunk_simple_gla(q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens,
                                       chunk_size, check_positive=True, bounds=bounds)
    return o, state_in_fla_layout(final_state, state_v_first)


def _chunk_simple_gla(q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
                      check_positive, bounds=None):
    """``chunk_simple_gla`` after its argument checks; ``check_positive=False`` for decays known to be
    <= 0 (chunk_retention's own), which then cost no host read; ``bounds``: the offsets as a host list. Under
    ``torch.compile`` the custom ops of ``library.py`` (no positive-decay check there)."""
    compiling = torch.compiler.is_compiling()
    positive = positive_flag_for(q if (g is not None or g_gamma is not None) and check_positive and not compiling
                                 else None)
    B, T, H, K = q.shape
    varlen = None
    if cu_seqlens is not None and not compiling:
        varlen = VarlenIndex.build(cu_seqlens, chunk_size, bounds=bounds)
        check_varlen_bounds(varlen.bounds, T)
    if g_gamma is not None:
        g = g_gamma.detach().to(device=q.device, dtype=torch.float32).view(1, 1, H).expand(B, T, H)
    if scale is None:
        scale = K ** -0.5
    q, k, v = (x.contiguous() for x in (q, k, v))
    g = g.contiguous() if g is not None else None
    opts = LinearAttnOptions(float(scale), int(chunk_size), bool(output_final_state))
    if compiling:
        from tfla.ops.simple_gla.library import simple_gla_fwd

        o, final, _ = simple_gla_fwd(q, k, v, g, initial_state.contiguous() if initial_state is not None else None,
                                     cu_seqlens, opts.scale, opts.chunk_size, opts.output_final_state)
        return o, final if opts.output_final_state else None
    out = ChunkSimpleGLAFunction.apply(q, k, v, g, initial_state.contiguous() if initial_state is not None else None,
                                       varlen, opts, positive)
    # after the kernels are queued: the host waits once, at the end
    raise_if_positive(positive, "g" if g_gamma is None else "g_gamma")
    return out


def chunk_retention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
):
    """RetNet retention (FLA's ``chunk_retention``): ``chunk_simple_gla`` with the fixed per-head log
    decays ``log(1 - 2^(-5 - h))``. Shapes and returns as ``chunk_simple_gla``."""
    from tfla.ops.simple_gla.reference import retention_log_decay

    g_gamma = retention_log_decay(q.shape[2], device=q.device) if isinstance(q, torch.Tensor) and q.dim() == 4 else None
    _check(q, k, v, None, g_gamma, scale, initial_state, cu_seqlens, chunk_size)
    # log(1 - 2^(-5 - h)) < 0 by construction: no positivity check, no host read
    return _chunk_simple_gla(q, k, v, None, g_gamma, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
                             check_positive=False)


def _normalize_linear_attn(o, q, k, scale, z_init, cu_seqlens):
    """FLA's ``normalize_with_z_state`` (fla 0.6.0, ``fla/ops/linear_attn/utils.py``), forward direction:
    ``o_t / (scale q_t . z_t + 1e-10)`` with the running key sum ``z_t = z_init + sum_{s <= t} k_s`` restarted
    per sequence. Returns ``(o, z_state [N, 1, H, K])`` in FLA's dtypes (q's dtype promoted with z_init's).

    Plain PyTorch ops, so autograd differentiates it (FLA hand-writes the same backward). Computed in fp32
    (fp64 for fp64 inputs), where FLA rounds the key sum to k's dtype. The varlen key sum is one global
    cumsum in fp64 minus each sequence's start: no per-sequence loop, and no cancellation error for a short
    sequence packed after long ones. A sequence with no tokens keeps its z_init (zeros without), as in FLA.
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_dtype = q.dtype if z_init is None else torch.promote_types(q.dtype, z_init.dtype)
    B, T, H, K = k.shape
    z0 = z_init.to(acc) if z_init is not None else None
    if cu_seqlens is None:
        k_cum = k.to(acc).cumsum(1)  # [B, T, H, K]
        if z0 is not None:
            k_cum = k_cum + z0
        z_state = k_cum[:, -1:] if T > 0 else (z0 if z0 is not None else k_cum.new_zeros(B, 1, H, K))
    else:
        cu = cu_seqlens.long()
        lens = cu[1:] - cu[:-1]
        c = torch.nn.functional.pad(k[0].to(torch.float64).cumsum(0), (0, 0, 0, 0, 1, 0))  # [T + 1, H, K], c[0] = 0
        start = c[cu[:-1]]  # [N, H, K]
        k_cum = (c[1:] - start.repeat_interleave(lens, 0, output_size=T)).to(acc)[None]
        z_state = (c[cu[1:]] - start).to(acc)[:, None]  # [N, 1, H, K]
        if z0 is not None:
            k_cum = k_cum + z0[:, 0].repeat_interleave(lens, 0, output_size=T)[None]
            z_state = z_state + z0
    denom = (q.to(acc) * scale * k_cum).sum(-1, keepdim=True) + 1e-10  # FLA's epsilon, added, sign kept
    return (o.to(acc) / denom).to(out_dtype), z_state.to(out_dtype)


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | tuple | None = None,
    output_final_state: bool = False,
    normalize: bool = True,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
):
    r"""Linear attention without decay, a drop-in for FLA's ``chunk_linear_attn`` (fla 0.6.0,
    ``fla/ops/linear_attn/chunk.py``): ``S_t = S_{t-1} + k_t v_t^T``, ``o_t = scale S_t^T q_t``; with
    ``normalize`` (the default, as in FLA) ``z_t = z_{t-1} + k_t`` and
    ``o_t = scale S_t^T q_t / (scale q_t . z_t + 1e-10)`` (epsilon added, denominator's sign kept, as in FLA).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; fp32, fp16 or bf16 (all the same).
        scale: default ``K ** -0.5``. output_final_state: return the final ``S``.
        initial_state: ``S_0 [N, H, K, V]``, or with ``normalize`` also a tuple ``(S_0 or None, z_0 or None)``
            with ``z_0 [N, 1, H, K]`` (fp32 or q's dtype) the key sum carried from earlier tokens; a plain
            tensor with ``normalize`` means ``z_0 = 0`` (FLA does the same).
        normalize: divide by ``scale q_t . z_t`` (default True).
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B = 1); z restarts (from z_0[n]) per sequence.
        chunk_size: outer chunk L in {64, 128, 256, 512} (keyword-only).

    Returns, as FLA: with ``normalize``, ``(o, (final_state or None, z_state [N, 1, H, K]))`` -- the key sum
    is returned even when ``output_final_state`` is False, and a sequence with no tokens keeps its z_0; o and
    z_state in q's dtype promoted with z_0's (FLA's type promotion). Without ``normalize``, ``(o, final_state
    or None)`` exactly as ``chunk_simple_gla``. Differentiable in q, k, v, S_0 and z_0.

    Raises ValueError/TypeError as ``chunk_simple_gla``, and ValueError for a tuple ``initial_state`` without
    ``normalize`` (FLA would pass the tuple on as a state tensor and fail inside), a tuple not of length 2,
    or a ``z_0`` not of shape ``[N, 1, H, K]``.
    """
    kv_init, z_init = initial_state, None
    if isinstance(initial_state, tuple):
        if not normalize:
            raise ValueError("a (kv_state, z_state) tuple `initial_state` is for normalize=True; with "
                             "normalize=False pass the [N, H, K, V] state tensor alone")
        if len(initial_state) != 2:
            raise ValueError(f"with normalize=True `initial_state` is a tensor or a tuple (kv_state [N, H, K, V], "
                             f"z_state [N, 1, H, K]), got a tuple of {len(initial_state)}")
        kv_init, z_init = initial_state
    if not normalize:
        return chunk_simple_gla(q, k, v, scale=scale, initial_state=kv_init, output_final_state=output_final_state,
                                cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    _check(q, k, v, None, None, scale, kv_init, cu_seqlens, chunk_size)  # before z_init's check, which needs q
    B, _, H, K = q.shape
    if z_init is not None:
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        check_tensor("initial_state[1] (z_state)", z_init, 4)
        if tuple(z_init.shape) != (N, 1, H, K):
            raise ValueError(f"`initial_state[1]` (z_state) must have shape [N, 1, H, K] = {(N, 1, H, K)}, "
                             f"got {tuple(z_init.shape)}")
        check_gate_dtype("initial_state[1] (z_state)", z_init, q)
        if z_init.device != q.device:
            raise ValueError(f"`initial_state[1]` (z_state) is on {z_init.device} but `q` is on {q.device}")
    if scale is None:
        scale = K ** -0.5
    o, final_state = chunk_simple_gla(q, k, v, scale=scale, initial_state=kv_init,
                                      output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                      chunk_size=chunk_size)
    o, z_state = _normalize_linear_attn(o, q, k, float(scale), z_init, cu_seqlens)
    return o, (final_state, z_state)


def chunk_lightning_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    num_layers: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
):
    """Lightning Attention (FLA's ``chunk_lightning_attn``): ``chunk_simple_gla`` with the constant per-head log
    decays ``-(8 / H) (1 - layer_idx / num_layers) h`` (``reference.lightning_log_decay``; Qin et al.,
    "Lightning Attention-2", 2024). Shapes, dtypes and returns as ``chunk_simple_gla``; the decays are constants
    (no gradient).

    Raises ValueError/TypeError for the arguments ``chunk_simple_gla`` checks, and for ``layer_idx`` /
    ``num_layers`` that are not integers with ``num_layers >= 1`` and ``0 <= layer_idx <= num_layers`` (a
    larger ``layer_idx`` would make the decays positive)."""
    for name, val in (("layer_idx", layer_idx), ("num_layers", num_layers)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"`{name}` must be an int, got {type(val).__name__}")
    if num_layers < 1 or not 0 <= layer_idx <= num_layers:
        raise ValueError(f"need num_layers >= 1 and 0 <= layer_idx <= num_layers, got layer_idx={layer_idx}, "
                         f"num_layers={num_layers}")
    from tfla.ops.simple_gla.reference import lightning_log_decay

    _check(q, k, v, None, None, scale, initial_state, cu_seqlens, chunk_size)
    g_gamma = lightning_log_decay(q.shape[2], layer_idx, num_layers, device=q.device)
    return _chunk_simple_gla(q, k, v, None, g_gamma, scale, initial_state, output_final_state, cu_seqlens,
                             chunk_size, check_positive=False)
