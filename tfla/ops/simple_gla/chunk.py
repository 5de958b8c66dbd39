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

from tfla.ops.common.chunk_output import chunk_output_fwd, chunk_tiled, dual_supported, output_config
from tfla.ops.common.chunk_state import chunk_state_bwd, chunk_state_fwd, intra_supported
from tfla.ops.common.cumsum import PositiveFlag, chunk_local_cumsum
from tfla.ops.common.utils import LOG_DECAY_FLOOR, RCP_LN2, SUB_CHUNK
from tfla.ops.common.ut_transform import wy_bwd
from tfla.ops.gated_delta_rule.chunk import VarlenIndex, _check_cotangent
from tfla.utils.validation import (
    check_common,
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


def chunk_simple_gla_fwd(q, k, v, g, scale, initial_state, output_final_state, chunk_size, varlen=None,
                         g_cum=None, gk_cum=None, gb=None, out_dtype=None, n_state=False, initial_n=None,
                         normalizer=None, positive_flag=None, return_states=False):
    """Plain forward: ``(o, final_state, g_cum)``; g is the log decay ``[B, T, H]`` or None.

    Split gates (the mLSTM): pass ``g_cum`` (query-side GQ, log2, restarting every L) with ``gk_cum``
    and ``gb`` instead of ``g`` (see ``chunk_output.chunk_tiled``). ``n_state``: the state kernel also
    carries the normalizer state n (v = 1; start ``initial_n``) and the call returns
    ``(o, final_state, g_cum, den, final_n)``; ``normalizer`` (``dict(lo=, eps=)``, needs ``n_state``)
    divides the output by it in the tiled kernel and ``den`` is its dot (else None). ``positive_flag``:
    a ``PositiveFlag`` that the cumsum kernel raises when any ``g > 0``. ``return_states``: also return the states
    ``h [B, NT, HV, K, V]`` and ``hn`` (or None) last (at L = 64 they are the backward's ``states``)."""
    cu = varlen.cu_seqlens if varlen is not None else None
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if g is not None:
        g_cum = chunk_local_cumsum(g, chunk_size, scale=RCP_LN2, cu_seqlens=cu, out_dtype=acc, floor=LOG_DECAY_FLOOR,
                                   chunk_indices=varlen.chunk_indices if varlen is not None else None,
                                   positive_flag=positive_flag)
    h, _, final_state, *ns = chunk_state_fwd(
        k, v, g_cum, chunk_size, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu,
        chunk_offsets=varlen.chunk_offsets if varlen is not None else None,
        num_chunks=varlen.num_chunks if varlen is not None else None, gk_cum=gk_cum, gb=gb, n_state=n_state,
        initial_n=initial_n)
    hn, final_n = ns if n_state else (None, None)
    ocfg = output_config(chunk_size, q.shape[-1], v.shape[-1])
    o = chunk_output_fwd(q, k, v, h, g_cum, scale, chunk_size, cu_seqlens=cu, out_dtype=out_dtype,
                         tile_indices=varlen.tiles(ocfg["BQ"]) if varlen is not None else None,
                         chunk_offsets=varlen.chunk_offsets if varlen is not None else None, config=ocfg,
                         gk_cum=gk_cum, gb=gb, normalizer=dict(normalizer, hn=hn) if normalizer is not None else None)
    extra = (h, hn) if return_states else ()
    if not n_state:
        return (o, final_state, g_cum) + extra
    o, den = o if normalizer is not None else (o, None)
    return (o, final_state, g_cum, den, final_n) + extra


def chunk_simple_gla_bwd(q, k, v, g_cum, scale, initial_state, do, dht, chunk_size, varlen=None, gk_cum=None,
                         gb=None, dden=None, initial_n=None, dnt=None, kdot=False, need_dg=True, states=None,
                         do_row_log2=None, state_bwd_config=None):
    """Plain backward: ``(dq, dk, dv, dg, dh0)`` (dg None without decay; dq, dk in q's dtype, each rounded once
    from its fp32 sum in the kernel that forms it; dg fp32). ``kdot``: append ``k . dk`` per row ``[B, T, H]``
    fp32 (before rounding). ``need_dg=False`` (a constant decay: ``g_gamma``, retention): dg is None and its
    work is skipped (wy_bwd then reads no states). With split
    gates (``gk_cum``, ``gb``) dg is the gradient of a per-token log decay shared by GQ and GK.

    ``dden [B, T, H]`` fp32 (with ``initial_n [N, H, K]`` or None and ``dnt [N, H, K]`` or None): the
    cotangent of the forward's normalizer dot ``den`` (``chunk_simple_gla_fwd(n_state=True)``), i.e. of
    one more value column of ones, folded into the same kernels (the scores of dq and dk gain ``dden`` per
    row, the states carry n and dn beside S and dS); returns ``(dq, dk, dv, dg, dh0, dn0)`` then.

    ``states``: ``(h, hn)`` from ``chunk_simple_gla_fwd(return_states=True)`` at the same L = 64 (the states every
    64 rows, ``hn`` the normalizer's or None): no recompute. h is overwritten (dS over S): pass it once.

    ``do_row_log2 [B, T, H]`` (g_cum's dtype): the output's cotangent is ``do * 2^do_row_log2`` per row (the mLSTM's
    ``dh / d``). With split gates at L = 64 (the dual dq / dk launch and dvo in the state-gradient recurrence) no
    scaled copy of do is made: the row factor joins the query-side gate of the dq / dk scores and the
    recurrence's query rows (``dden`` enters those scores as ``dden 2^-do_row_log2``); elsewhere do is scaled
    first. ``state_bwd_config``: launch / precision keys of the state-gradient recurrence (``chunk_state_bwd``)."""
    L = chunk_size
    cu = varlen.cu_seqlens if varlen is not None else None
    sub = varlen.sub_indices if varlen is not None else None
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_state = dden is not None
    if states is not None:
        h_sub, hn_sub = states
        if L != SUB_CHUNK or (n_state and hn_sub is None):
            raise ValueError(f"states (the forward's) serve chunk_size={SUB_CHUNK} and, with dden, hold hn")
    else:
        h_sub, _, _, *ns = chunk_state_fwd(
            k, v, g_cum, L, initial_state=initial_state, cu_seqlens=cu,
            chunk_offsets=varlen.sub_offsets if varlen is not None else None,
            num_chunks=varlen.sub_indices.shape[0] if varlen is not None else None, store_every_sub_chunk=True,
            gk_cum=gk_cum, gb=gb, n_state=n_state, initial_n=initial_n)
        hn_sub = ns[0] if n_state else None
    tiled = dict(cu_seqlens=cu, gk_cum=gk_cum, gb=gb)
    if varlen is not None:
        tiled.update(tile_indices=varlen.tiles(output_config(L, q.shape[-1], v.shape[-1])["BQ"]),
                     chunk_offsets=varlen.sub_offsets)
    dual = dual_supported(L, v.shape[-1], q.shape[-1], q.dtype)
    g_rows, row_add = g_cum, dden  # the dq / dk launch's query-side gate and row constant
    if do_row_log2 is not None:
        if tuple(do_row_log2.shape) != tuple(do.shape[:3]):
            raise ValueError(f"do_row_log2 must be [B, T, H] = {tuple(do.shape[:3])}")
        if dual and intra_supported(L) and g_cum is not None and gk_cum is not None:
            # every use of a dO row r in those two kernels carries its query-side gate 2^GQ_r
            g_rows = g_cum + do_row_log2
            row_add = dden * torch.exp2(-do_row_log2) if dden is not None else None
        else:
            do = (do.to(acc) * torch.exp2(do_row_log2.to(acc))[..., None]).to(do.dtype)
            do_row_log2 = None
    # at L = 64 (one diagonal tile per chunk): dvo formed inside the state-gradient recurrence, dq and dk from
    # one tiled launch (the same gated score tile)
    dvo = None if intra_supported(L) else chunk_tiled(k, q, do, g_cum, scale, L, reverse=True, **tiled)
    dq_args = dict(h=h_sub, state_every=SUB_CHUNK, state_transposed=True, rowdot_with=q, out_dtype=q.dtype,
                   row_add=row_add, row_add_n=hn_sub, **tiled)
    if dual:
        dq, dgq, dko, dgk = chunk_tiled(do, v, k, g_rows, scale, L, dual_dtype=k.dtype, **dq_args)
    else:
        dq, dgq = chunk_tiled(do, v, k, g_cum, scale, L, **dq_args)
        dko, dgk = chunk_tiled(v, do, q, g_cum, scale, L, reverse=True, rowdot_with=k, out_dtype=k.dtype, row_add=dden,
                               **tiled)
    # without the delta rule the state-gradient recurrence's dU is the whole gradient of v
    # dS overwrites S in h_sub's buffer (S's last reader, the dq launch, has run); with a gate gradient the
    # recurrence also returns the rows of <S, dS> (S's only use in wy_bwd): one [B, NS, H, K, V] buffer less
    gate_grad = g_cum is not None and need_dg
    dh_sub, dv, dh0, *rest = chunk_state_bwd(
        q, k, None, do, dvo, g_cum, scale, L, dht=dht, need_dh0=initial_state is not None, cu_seqlens=cu,
        sub_offsets=varlen.sub_offsets if varlen is not None else None,
        num_sub_chunks=varlen.sub_indices.shape[0] if varlen is not None else None, gk_cum=gk_cum, gb=gb,
        dden=dden, dnt=dnt, h_sub=h_sub, sds=gate_grad, do_row_log2=do_row_log2, config=state_bwd_config)
    del dvo  # not needed by wy_bwd: freed before its outputs are allocated (peak memory)
    dhn_sub, dn0 = rest[:2] if n_state else (None, None)
    sds_sub = rest[-1] if gate_grad else None
    # S only where the recurrence did not take <S, dS> (and then dS has a buffer of its own)
    h_sub = h_sub if gate_grad and sds_sub is None else None
    # dk = dko + the state part, added and rounded to k's dtype in wy_bwd
    dk, _, _, dg_sub, *kdk = wy_bwd(k, None, None, g_cum, None, v, None, h_sub, dh_sub, L, cu_seqlens=cu,
                                    sub_indices=sub, gk_cum=gk_cum, gb=gb, hn_sub=hn_sub, dhn_sub=dhn_sub, dk_add=dko,
                                    dk_dtype=k.dtype, kdot=kdot, need_dg=need_dg, sds_sub=sds_sub)
    dg = None
    if g_cum is not None and need_dg:
        dg = chunk_local_cumsum(dgq, L, reverse=True, cu_seqlens=cu, out_dtype=acc, sub=dgk, add=dg_sub,
                                chunk_indices=varlen.chunk_indices if varlen is not None else None)
    return (dq, dk, dv, dg, dh0) + ((dn0,) if n_state else ()) + (tuple(kdk) if kdot else ())


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
        _check_cotangent("o", do, v.shape, q.dtype)
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


def _positive_flag(like: torch.Tensor | None) -> PositiveFlag | None:
    """None when ``like`` is None (nothing to check), else a ``PositiveFlag`` on ``like``'s device (pass the
    tensor the kernels run on: q; a ``g_gamma`` may live on the host) that the gate's cumsum kernel raises
    when any ``g > 0`` (no extra pass over g), read after the kernels are queued (``_raise_if_positive``),
    waiting for the cumsum kernel only (measured on an H100 with a host read before the kernels: 2.18 ms
    vs 0.56 ms without it, B=4 T=8192 H=16 K=V=128). None (no check) during CUDA-graph capture, where no
    host read is possible."""
    if like is None or (like.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    return PositiveFlag(like.device)


def _raise_if_positive(flag: PositiveFlag | None, name: str = "g"):
    if flag is not None:
        flag.raise_if_positive(name)


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
    bounds = host_bounds(cu_seqlens, cu_seqlens_cpu)
    _check(q, k, v, g, g_gamma, scale, initial_state, cu_seqlens, chunk_size)
    o, final_state = _chunk_simple_gla(q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens,
                                       chunk_size, check_positive=True, bounds=bounds)
    return o, state_in_fla_layout(final_state, state_v_first)


def _chunk_simple_gla(q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
                      check_positive, bounds=None):
    """``chunk_simple_gla`` after its argument checks; ``check_positive=False`` for decays known to be
    <= 0 (chunk_retention's own), which then cost no host read; ``bounds``: the offsets as a host list."""
    positive = _positive_flag(q if (g is not None or g_gamma is not None) and check_positive else None)
    B, T, H, K = q.shape
    varlen = None
    if cu_seqlens is not None:
        varlen = VarlenIndex.build(cu_seqlens, chunk_size, bounds=bounds)
        check_varlen_bounds(varlen.bounds, T)
    if g_gamma is not None:
        g = g_gamma.detach().to(device=q.device, dtype=torch.float32).view(1, 1, H).expand(B, T, H)
    if scale is None:
        scale = K ** -0.5
    q, k, v = (x.contiguous() for x in (q, k, v))
    g = g.contiguous() if g is not None else None
    opts = LinearAttnOptions(float(scale), int(chunk_size), bool(output_final_state))
    out = ChunkSimpleGLAFunction.apply(q, k, v, g, initial_state.contiguous() if initial_state is not None else None,
                                       varlen, opts, positive)
    # after the kernels are queued: the host waits once, at the end
    _raise_if_positive(positive, "g" if g_gamma is None else "g_gamma")
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
