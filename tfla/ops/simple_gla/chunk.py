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

from tfla.ops.common.chunk_output import chunk_output_fwd, chunk_tiled, output_config
from tfla.ops.common.chunk_state import chunk_state_bwd, chunk_state_fwd
from tfla.ops.common.cumsum import chunk_local_cumsum
from tfla.ops.common.utils import RCP_LN2, SUB_CHUNK
from tfla.ops.common.ut_transform import wy_bwd
from tfla.ops.gated_delta_rule.chunk import VarlenIndex, _check_cotangent
from tfla.utils.validation import check_common, check_gate_dtype, check_qkv, check_tensor, check_varlen_bounds

DEFAULT_CHUNK_SIZE = 64


@dataclasses.dataclass(frozen=True)
class LinearAttnOptions:
    scale: float
    chunk_size: int
    output_final_state: bool


def chunk_simple_gla_fwd(q, k, v, g, scale, initial_state, output_final_state, chunk_size, varlen=None):
    """Plain forward: ``(o, final_state, g_cum)``; g is the log decay ``[B, T, H]`` or None."""
    cu = varlen.cu_seqlens if varlen is not None else None
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    g_cum = None
    if g is not None:
        g_cum = chunk_local_cumsum(g, chunk_size, scale=RCP_LN2, cu_seqlens=cu, out_dtype=acc,
                                   chunk_indices=varlen.chunk_indices if varlen is not None else None)
    h, _, final_state = chunk_state_fwd(
        k, v, g_cum, chunk_size, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu,
        chunk_offsets=varlen.chunk_offsets if varlen is not None else None,
        num_chunks=varlen.num_chunks if varlen is not None else None)
    ocfg = output_config(chunk_size, q.shape[-1], v.shape[-1])
    o = chunk_output_fwd(q, k, v, h, g_cum, scale, chunk_size, cu_seqlens=cu,
                         tile_indices=varlen.tiles(ocfg["BQ"]) if varlen is not None else None,
                         chunk_offsets=varlen.chunk_offsets if varlen is not None else None, config=ocfg)
    return o, final_state, g_cum


def chunk_simple_gla_bwd(q, k, v, g_cum, scale, initial_state, do, dht, chunk_size, varlen=None):
    """Plain backward: ``(dq, dk, dv, dg, dh0)`` (dg None without decay; dq, dk, dg fp32)."""
    L = chunk_size
    cu = varlen.cu_seqlens if varlen is not None else None
    sub = varlen.sub_indices if varlen is not None else None
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    h_sub, _, _ = chunk_state_fwd(
        k, v, g_cum, L, initial_state=initial_state, cu_seqlens=cu,
        chunk_offsets=varlen.sub_offsets if varlen is not None else None,
        num_chunks=varlen.sub_indices.shape[0] if varlen is not None else None, store_every_sub_chunk=True)
    tiled = dict(cu_seqlens=cu)
    if varlen is not None:
        tiled.update(tile_indices=varlen.tiles(output_config(L, q.shape[-1], v.shape[-1])["BQ"]),
                     chunk_offsets=varlen.sub_offsets)
    dvo = chunk_tiled(k, q, do, g_cum, scale, L, reverse=True, **tiled)
    dq, dgq = chunk_tiled(do, v, k, g_cum, scale, L, h=h_sub, state_every=SUB_CHUNK, state_transposed=True,
                          rowdot_with=q, out_dtype=acc, **tiled)
    dko, dgk = chunk_tiled(v, do, q, g_cum, scale, L, reverse=True, rowdot_with=k, out_dtype=acc, **tiled)
    # without the delta rule the state-gradient recurrence's dU is the whole gradient of v
    dh_sub, dv, dh0 = chunk_state_bwd(
        q, k, None, do, dvo, g_cum, scale, L, dht=dht, need_dh0=initial_state is not None, cu_seqlens=cu,
        sub_offsets=varlen.sub_offsets if varlen is not None else None,
        num_sub_chunks=varlen.sub_indices.shape[0] if varlen is not None else None)
    dks, _, _, dg_sub = wy_bwd(k, None, None, g_cum, None, v, None, h_sub, dh_sub, L, cu_seqlens=cu, sub_indices=sub)
    dk = dko + dks
    dg = None
    if g_cum is not None:
        dg = chunk_local_cumsum(dgq - dgk, L, reverse=True, cu_seqlens=cu, out_dtype=acc,
                                chunk_indices=varlen.chunk_indices if varlen is not None else None) + dg_sub
    return dq, dk, dv, dg, dh0


class ChunkSimpleGLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, varlen, opts: LinearAttnOptions):
        o, final_state, g_cum = chunk_simple_gla_fwd(q, k, v, g, opts.scale, initial_state, opts.output_final_state,
                                                     opts.chunk_size, varlen)
        ctx.save_for_backward(q, k, v, g, initial_state, g_cum)
        ctx.varlen, ctx.opts = varlen, opts
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, initial_state, g_cum = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        _check_cotangent("o", do, v.shape, q.dtype)
        if dht is not None:
            dht = dht.contiguous()
        dq, dk, dv, dg, dh0 = chunk_simple_gla_bwd(q, k, v, g_cum, ctx.opts.scale, initial_state, do.contiguous(),
                                                   dht, ctx.opts.chunk_size, ctx.varlen)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype) if g is not None else None,
                dh0.to(initial_state.dtype) if dh0 is not None else None, None, None)


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
        if bool((g > 0).any()):  # one host sync: a positive log decay is a growth, not a decay
            raise ValueError("`g` is a log decay and must be <= 0 everywhere; got positive values")
    if g_gamma is not None:
        if not isinstance(g_gamma, torch.Tensor) or g_gamma.shape != (H,):
            raise ValueError(f"`g_gamma` must be a per-head log decay of shape [H] = ({H},)")
        if bool((g_gamma > 0).any()):
            raise ValueError("`g_gamma` is a log decay and must be <= 0; got positive values")
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
    cu_seqlens: torch.LongTensor | None = None,
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
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B = 1).
        chunk_size: outer chunk L in {64, 128, 256, 512} (keyword-only).

    Returns ``(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32 or None)``; differentiable in
    q, k, v, g and initial_state (``g_gamma`` is a constant, as in FLA).

    Raises ValueError/TypeError naming the argument for wrong shapes or dtypes, a vector decay passed
    as ``g``, positive log decays (checked with one host sync), unsupported sizes or devices.
    """
    _check(q, k, v, g, g_gamma, scale, initial_state, cu_seqlens, chunk_size)
    B, T, H, K = q.shape
    varlen = None
    if cu_seqlens is not None:
        varlen = VarlenIndex.build(cu_seqlens, chunk_size)
        check_varlen_bounds(varlen.bounds, T)
    if g_gamma is not None:
        g = g_gamma.detach().to(torch.float32).view(1, 1, H).expand(B, T, H)
    if scale is None:
        scale = K ** -0.5
    q, k, v = (x.contiguous() for x in (q, k, v))
    g = g.contiguous() if g is not None else None
    opts = LinearAttnOptions(float(scale), int(chunk_size), bool(output_final_state))
    return ChunkSimpleGLAFunction.apply(q, k, v, g, initial_state.contiguous() if initial_state is not None else None,
                                        varlen, opts)


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
    return chunk_simple_gla(q, k, v, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    normalize: bool = True,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
):
    """Linear attention without decay (FLA's ``chunk_linear_attn``): ``S_t = S_{t-1} + k_t v_t^T``,
    ``o_t = scale S_t^T q_t``. ``normalize`` defaults to True as in FLA (dividing by
    ``scale q_t . sum_{s <= t} k_s``); that mode is not implemented yet and raises NotImplementedError
    rather than returning the unnormalized output: pass ``normalize=False`` explicitly.
    Shapes and returns as ``chunk_simple_gla``."""
    if normalize:
        raise NotImplementedError("tfla.chunk_linear_attn: normalize=True is not implemented yet; "
                                  "pass normalize=False")
    return chunk_simple_gla(q, k, v, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                            cu_seqlens=cu_seqlens, chunk_size=chunk_size)
