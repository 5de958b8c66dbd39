"""Linear attention with scalar, constant or no decay on tfla's shared two-level engine.

Notation: B batch, T time, H heads, K/V head dims, N sequences, L = chunk_size (outer chunk).

Forward: chunk-local cumsum of g (log2) -> state recurrence (states every L tokens, 64-row
sub-chunks on chip) -> TFLA-tiled output. Backward: states at every 64-row sub-chunk recomputed;
the output's gradients of v, q, k from the same tiled product with permuted arguments (ULA);
the reverse state-gradient recurrence (which also completes dv); the state terms of dk and dg.
These are the Gated DeltaNet kernels with the delta-rule flags off: no second copy of any stage.

Normalized linear attention (``chunk_linear_attn``, FLA's default): the key sum z is the engine's normalizer state
(the mLSTM's n, with no gates), carried beside S by the state kernel; the tiled output kernel forms the denominator
``scale q . z`` in the same pass and divides by ``den + 1e-10`` (``NORM = 3``); the backward scales dO by ``1 / d`` and
folds the denominator's cotangent into the same kernels as the mLSTM's (``chunk_linear_attn_fwd`` / ``_bwd``).
"""
from __future__ import annotations

import dataclasses

import torch

from tfla.ops.common import precompile
from tfla.ops.common.cumsum import positive_flag_for, raise_if_positive
from tfla.ops.common.linear_attn import chunk_simple_gla_bwd, chunk_simple_gla_fwd
from tfla.ops.common.normalizer import normalizer_bwd_prep
from tfla.ops.common.utils import autograd_call, on_input_device
from tfla.ops.common.varlen import VarlenIndex, table_kind
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
    @on_input_device
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


@on_input_device
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
    args = (q, k, v, g, initial_state.contiguous() if initial_state is not None else None, varlen, opts, positive)
    out = precompile.apply(autograd_call(ChunkSimpleGLAFunction), args, q, lambda: (
        "simple_gla", precompile.signature(q, v, g, args[4]), q.shape[1] % 64 == 0, table_kind(varlen), opts))
    # after the kernels are queued: the host waits once, at the end
    raise_if_positive(positive, "g" if g_gamma is None else "g_gamma")
    return out


@on_input_device
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


# FLA 0.6.0's epsilon of the normalized linear attention, added to the signed denominator scale q . z
LINEAR_ATTN_EPS = 1e-10


def _zero_state_for(z_init, q, v):
    """The state kernels start the key sum z beside S: zeros for S when only z_0 is given."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return z_init.new_zeros(z_init.shape[0], q.shape[2], q.shape[3], v.shape[3], dtype=acc)


def chunk_linear_attn_fwd(q, k, v, scale, initial_state, z_init, output_final_state, chunk_size, varlen=None):
    """Plain forward of the normalized ``chunk_linear_attn``: ``(o, final_state or None, z_state, den)``.

    The key sum ``z`` is the engine's normalizer state (the state of v = 1, carried beside S in the state kernel,
    restarting per sequence from ``z_init [N, 1, H, K]`` or zeros), and the tiled output kernel forms
    ``den_r = scale q_r . z_r`` (its row sums with c = 1) in the same pass as the numerator and divides by
    ``den + 1e-10`` before its one store (``normalizer=dict(signed=True)``): no PyTorch pass over ``[B, T, H, K]``.
    o ``[B, T, H, V]`` and z_state ``[N, 1, H, K]`` in q's dtype promoted with z_init's, final_state
    ``[N, H, K, V]`` fp32, den ``[B, T, H]`` fp32 (float64 for float64 inputs)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_dtype = q.dtype if z_init is None else torch.promote_types(q.dtype, z_init.dtype)
    s0 = initial_state if initial_state is not None or z_init is None else _zero_state_for(z_init, q, v)
    # the final S is formed with the final z (one flag in the state kernel) and dropped when not asked for
    o, final, _, den, z = chunk_simple_gla_fwd(
        q, k, v, None, scale, s0, True, chunk_size, varlen, out_dtype=out_dtype, n_state=True,
        initial_n=z_init[:, 0].to(acc) if z_init is not None else None,
        normalizer=dict(lo=None, eps=LINEAR_ATTN_EPS, signed=True))
    return o, (final if output_final_state else None), z[:, None].to(out_dtype), den


def chunk_linear_attn_bwd(q, k, v, scale, initial_state, z_init, o, den, do, dht, dz, chunk_size, varlen=None):
    """Plain backward of the normalized ``chunk_linear_attn``: ``(dq, dk, dv, d initial_state or None, dz_init or
    None)`` from the forward's output ``o`` and ``den``; dq, dk, dv in q's dtype, the state gradients fp32.

    With ``d = den + 1e-10`` the numerator's cotangent is ``do / d`` and the dot's ``dden = -(do . o) / d`` (one
    pass, ``normalizer_bwd_prep(signed=True)``); the engine's backward folds dden in as the value column of ones
    (``chunk_simple_gla_bwd(dden=..)``: the dq / dk scores gain dden per row, the states carry z and dz)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    do_n, dden = normalizer_bwd_prep(do, o, den, None, LINEAR_ATTN_EPS, signed=True, do_dtype=q.dtype)
    s0 = initial_state if initial_state is not None or z_init is None else _zero_state_for(z_init, q, v)
    dq, dk, dv, _, dh0, dn0 = chunk_simple_gla_bwd(
        q, k, v, None, scale, s0, do_n, dht, chunk_size, varlen, dden=dden,
        initial_n=z_init[:, 0].to(acc).contiguous() if z_init is not None else None,
        dnt=dz[:, 0].to(acc).contiguous() if dz is not None else None)
    return (dq, dk, dv, dh0 if initial_state is not None else None,
            dn0[:, None] if z_init is not None else None)


class ChunkLinearAttnFunction(torch.autograd.Function):
    """``chunk_linear_attn(normalize=True)``: inputs q, k, v, S_0 or None, z_0 or None; outputs o, final S or
    None, z_state."""

    @staticmethod
    def forward(ctx, q, k, v, initial_state, z_init, varlen, opts: LinearAttnOptions):
        o, final, z, den = chunk_linear_attn_fwd(q, k, v, opts.scale, initial_state, z_init, opts.output_final_state,
                                                 opts.chunk_size, varlen)
        ctx.save_for_backward(q, k, v, initial_state, z_init, o, den)
        ctx.varlen, ctx.opts = varlen, opts
        return o, final, z

    @staticmethod
    @on_input_device
    def backward(ctx, do, dht, dz):
        q, k, v, initial_state, z_init, o, den = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        check_cotangent("o", do, o.shape, o.dtype)
        dq, dk, dv, dh0, dz0 = chunk_linear_attn_bwd(
            q, k, v, ctx.opts.scale, initial_state, z_init, o, den, do.contiguous(),
            dht.contiguous() if dht is not None else None, dz, ctx.opts.chunk_size, ctx.varlen)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                dh0.to(initial_state.dtype) if dh0 is not None else None,
                dz0.to(z_init.dtype) if dz0 is not None else None, None, None)


@on_input_device
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
    ``o_t = scale S_t^T q_t / (scale q_t . z_t + 1e-10)`` (epsilon added, denominator's sign kept, as in FLA;
    Katharopoulos et al., "Transformers are RNNs", 2020, Section 3.3: the running sums S and Z).

    The normalized op runs in the engine's kernels (``chunk_linear_attn_fwd`` / ``_bwd``): z is the normalizer
    state carried beside S by the state kernel, the denominator is formed and divided by in the tiled output
    kernel, and the backward folds the denominator's cotangent into the same kernels as the mLSTM's normalizer.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; fp32, fp16 or bf16 (all the same; float64 for verification).
        scale: default ``K ** -0.5``. output_final_state: return the final ``S``.
        initial_state: ``S_0 [N, H, K, V]`` (any float dtype, read as fp32), or with ``normalize`` also a tuple
            ``(S_0 or None, z_0 or None)`` with ``z_0 [N, 1, H, K]`` (fp32 or q's dtype) the key sum carried from
            earlier tokens; a plain tensor with ``normalize`` means ``z_0 = 0`` (FLA does the same). N = B, or the
            number of sequences with ``cu_seqlens``.
        normalize: divide by ``scale q_t . z_t + 1e-10`` (default True).
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B = 1); S and z restart (from S_0[n], z_0[n]) per
            sequence.
        chunk_size: outer chunk L in {64, 128, 256, 512} (keyword-only).

    Returns, as FLA: with ``normalize``, ``(o [B, T, H, V], (final_state [N, H, K, V] fp32 or None,
    z_state [N, 1, H, K]))`` -- the key sum is returned even when ``output_final_state`` is False, and a sequence
    with no tokens keeps its z_0 (zeros without); o and z_state in q's dtype promoted with z_0's (FLA's type
    promotion: bf16 q with an fp32 z_0 gives fp32), z summed in fp32 (FLA rounds it to k's dtype). Without
    ``normalize``, ``(o, final_state or None)`` exactly as ``chunk_simple_gla``. Differentiable in q, k, v, S_0
    and z_0. A denominator near zero (keys or queries of mixed signs) makes o and its gradients large, as in FLA.

    Raises ValueError/TypeError as ``chunk_simple_gla``, and ValueError for a tuple ``initial_state`` without
    ``normalize`` (FLA would pass the tuple on as a state tensor and fail inside), a tuple not of length 2,
    or a ``z_0`` not of shape ``[N, 1, H, K]`` or on another device; TypeError for a ``z_0`` dtype other than
    fp32 or q's.
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
    compiling = torch.compiler.is_compiling()  # then custom ops (library.py): no host reads here
    varlen = None
    if cu_seqlens is not None and not compiling:
        varlen = VarlenIndex.build(cu_seqlens, chunk_size)
        check_varlen_bounds(varlen.bounds, q.shape[1])
    q, k, v = (x.contiguous() for x in (q, k, v))
    kv_init = kv_init.contiguous() if kv_init is not None else None
    z_init = z_init.contiguous() if z_init is not None else None
    opts = LinearAttnOptions(float(scale), int(chunk_size), bool(output_final_state))
    if compiling:
        from tfla.ops.simple_gla.library import linear_attn_fwd

        o, final_state, z_state, _ = linear_attn_fwd(q, k, v, kv_init, z_init, cu_seqlens, opts.scale,
                                                     opts.chunk_size, opts.output_final_state)
    else:
        args = (q, k, v, kv_init, z_init, varlen, opts)
        o, final_state, z_state = precompile.apply(autograd_call(ChunkLinearAttnFunction), args, q, lambda: (
            "linear_attn", precompile.signature(q, v, kv_init, z_init), q.shape[1] % 64 == 0, table_kind(varlen),
            opts))
    return o, (final_state if output_final_state else None, z_state)


@on_input_device
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
