"""Gated linear attention with a vector decay per key channel (GLA) on tfla's shared two-level engine.

Notation: B batch, T time, H heads, K/V head dims, N sequences, L = chunk_size (outer chunk),
GV the per-channel log decay cumulated within each outer chunk, log2 units, ``[B, T, H, K]``.

Forward: chunk-local cumsum of g per channel (log2) -> state recurrence with per-key-row decay
(states every L tokens, 64-row sub-chunks on chip) -> TFLA-tiled output with the gate on the
contraction dim. Backward: states at every 64-row sub-chunk recomputed; dv from the tiled product
(gate on the contraction dim), dq and dk from it with the gate on their output columns (ULA Eq. 9);
the reverse state-gradient recurrence (which completes dv); the state terms of dk and dg.
These are the simple GLA stages with the ``VEC_G`` flags on: no second copy of any stage.
"""
from __future__ import annotations

import dataclasses

import torch

from tfla.ops.common import precompile
from tfla.ops.common.chunk_output import chunk_tiled, output_config
from tfla.ops.common.chunk_state import chunk_state_fwd
from tfla.ops.common.chunk_state_bwd import chunk_state_bwd
from tfla.ops.common.cumsum import chunk_local_cumsum, positive_flag_for, raise_if_positive
from tfla.ops.common.wy_bwd import wy_bwd
from tfla.ops.common.utils import (LOG_DECAY_FLOOR, RCP_LN2, SUB_CHUNK, autograd_call, next_pow2,
                                   on_input_device)
from tfla.ops.common.varlen import VarlenIndex, table_kind
from tfla.utils.validation import (
    check_cotangent,
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
class GLAOptions:
    scale: float
    chunk_size: int
    output_final_state: bool
    vec_f32: bool = True
    vec_span: int = 32
    tile_rows: int | None = None


def _channel_cumsum(x, chunk_size, varlen, reverse=False, scale=1.0, positive_flag=None, sub=None, add=None,
                    floor=None):
    """Chunk-local (reverse) cumsum of ``[B, T, H, K]`` per channel (the cumsum kernel's channel tiles),
    of ``x - sub`` plus ``add`` when given. fp32 (float64 for float64)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return chunk_local_cumsum(x, chunk_size, scale=scale, reverse=reverse,
                              cu_seqlens=varlen.cu_seqlens if varlen is not None else None, out_dtype=acc,
                              chunk_indices=varlen.chunk_indices if varlen is not None else None,
                              positive_flag=positive_flag, sub=sub, add=add, floor=floor)


def _tiled_cfg(chunk_size, a, DC, rowdot=False, opts: GLAOptions | None = None):
    """Tiles of one ``chunk_tiled`` call under the vector gate, passed as its config, so the varlen tile
    table is built once here for the kernel's ``BQ`` (``chunk_tiled`` would otherwise rebuild it with a
    host read when its own fp32 override changes the tiles).

    32-row tiles with 8 warps; fp32 with more than 128 columns: 16 rows, one stage, 8 warps. (The H100's
    409600 B at fp32 K = V = 256 came from a call that passed no pins: 64-row tiles, 2 stages, where tf32x3
    stages hi and lo copies of both fp32 dot operands, see the op README. 4 warps at 16 rows spilled
    840-6572 B per thread at fp32 K = V = 256, 8 warps 0-1916 B; sm_90 compile, Triton 3.6.)
    The diagonal's elementwise steps hold several fp32 [BQ, K] tensors: a local sm_90 compile (Triton 3.9,
    ptxas, no GPU) of the scalar defaults (64 rows, 4 warps) spilled 0.6-4 KiB per thread at K = V = 128
    bf16 (the scalar gate's kernels: 0.3-0.5 KiB); these tiles spill 0-16 B there. Not timed."""
    cfg = output_config(chunk_size, a.shape[-1], DC)
    bv = max(16, next_pow2(DC)) if rowdot else cfg["BV"]
    wide_fp32 = a.element_size() >= 4 and max(next_pow2(a.shape[-1]), bv) > 128
    cfg["BQ"] = cfg["BKV"] = min(16 if wide_fp32 else 32, chunk_size)
    cfg["num_warps"] = 8
    if wide_fp32:
        cfg["num_stages"] = 1
    opts = opts or GLAOptions(1.0, chunk_size, False)
    if opts.tile_rows is not None:
        cfg["BQ"] = cfg["BKV"] = min(opts.tile_rows, chunk_size)
        cfg["num_warps"] = 4
    cfg["VEC_SPAN"] = 0 if wide_fp32 else opts.vec_span
    cfg["VEC_F32"] = opts.vec_f32
    return cfg


def _tiled_args(chunk_size, a, DC, varlen, offsets, rowdot=False, opts: GLAOptions | None = None):
    cfg = _tiled_cfg(chunk_size, a, DC, rowdot, opts)
    if varlen is None:
        return {"config": cfg}
    return {"config": cfg, "cu_seqlens": varlen.cu_seqlens, "tile_indices": varlen.tiles(cfg["BQ"]),
            "chunk_offsets": offsets}


def _state_cfg(k):
    """State kernels with the vector gate: 8 warps; the pipeline stages stay chunk_state's vector-gate
    defaults (one stage for K > 64, measured on an H100). A local sm_90 compile (scripts/compile_stats.py,
    Triton 3.9, no GPU) with those stages: bf16 K = V = 128 spills 0 B (forward) and 456 B (backward) per
    thread with 8 warps, 112-344 B and 2572 B with 4; fp32 K = 256 forward 0 B vs 1.5 KiB. Not timed."""
    return {"num_warps": 8}


def chunk_gla_fwd(q, k, v, g, scale, initial_state, output_final_state, chunk_size, varlen=None,
                  positive_flag=None, opts: GLAOptions | None = None):
    """Plain forward: ``(o, final_state, gv_cum)``; g is the log decay ``[B, T, H, K]`` (natural log).
    ``positive_flag``: a ``PositiveFlag`` the cumsum kernel raises when any ``g > 0``."""
    cu = varlen.cu_seqlens if varlen is not None else None
    gv_cum = _channel_cumsum(g, chunk_size, varlen, scale=RCP_LN2, positive_flag=positive_flag, floor=LOG_DECAY_FLOOR)
    h, final_state = chunk_state_fwd(
        k, v, None, chunk_size, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu,
        chunk_offsets=varlen.chunk_offsets if varlen is not None else None,
        num_chunks=varlen.num_chunks if varlen is not None else None, gv_cum=gv_cum, config=_state_cfg(k),
        seq_order=varlen.seq_order if varlen is not None else None)
    o = chunk_tiled(q, k, v, None, scale, chunk_size, h=h, gv_cum=gv_cum,
                    **_tiled_args(chunk_size, q, v.shape[-1], varlen, varlen.chunk_offsets if varlen else None,
                                  opts=opts))
    return o, final_state, gv_cum


def chunk_gla_bwd(q, k, v, gv_cum, scale, initial_state, do, dht, chunk_size, varlen=None,
                  opts: GLAOptions | None = None):
    """Plain backward: ``(dq, dk, dv, dg, dh0)`` (dq, dk in q's dtype, each rounded once from its fp32 sum;
    dg fp32; dg ``[B, T, H, K]`` is the gradient of
    the natural-log decay g). dg = reverse chunk cumsum of ``q * dq - k * dk`` per channel (the tiled
    products' part, r = s terms left out as they cancel) plus the state terms of each sub-chunk."""
    L = chunk_size
    cu = varlen.cu_seqlens if varlen is not None else None
    sub = varlen.sub_indices if varlen is not None else None
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    h_sub, _ = chunk_state_fwd(
        k, v, None, L, initial_state=initial_state, cu_seqlens=cu,
        chunk_offsets=varlen.sub_offsets if varlen is not None else None,
        num_chunks=varlen.sub_indices.shape[0] if varlen is not None else None, store_every_sub_chunk=True,
        gv_cum=gv_cum, config=_state_cfg(k), seq_order=varlen.seq_order if varlen is not None else None)
    offs = varlen.sub_offsets if varlen is not None else None
    K, V = q.shape[-1], v.shape[-1]
    # the tiled parts of dv and dk stay fp32 until the state parts are added (one rounding to the input
    # dtype, as FLA's chunk_gla; bf16 tiled parts rounded twice: dk 2.43e-3 vs FLA 1.85e-3, H100)
    dvo = chunk_tiled(k, q, do, None, scale, L, reverse=True, gv_cum=gv_cum, out_dtype=acc,
                      **_tiled_args(L, k, V, varlen, offs, opts=opts))
    dq, dgq = chunk_tiled(do, v, k, None, scale, L, h=h_sub, state_every=SUB_CHUNK, state_transposed=True,
                          rowdot_with=q, out_dtype=q.dtype, gv_cum=gv_cum, gv_on_out=True,
                          **_tiled_args(L, do, K, varlen, offs, rowdot=True, opts=opts))
    dko, dgk = chunk_tiled(v, do, q, None, scale, L, reverse=True, rowdot_with=k, out_dtype=acc, gv_cum=gv_cum,
                           gv_on_out=True, **_tiled_args(L, v, K, varlen, offs, rowdot=True, opts=opts))
    # without the delta rule the state-gradient recurrence's dU is the whole gradient of v
    dh_sub, dv, dh0, sds_sub = chunk_state_bwd(
        q, k, None, do, dvo, None, scale, L, dht=dht, need_dh0=initial_state is not None, cu_seqlens=cu,
        sub_offsets=varlen.sub_offsets if varlen is not None else None,
        num_sub_chunks=varlen.sub_indices.shape[0] if varlen is not None else None, gv_cum=gv_cum,
        config=_state_cfg(k), h_sub=h_sub, sds=True,  # dS in S's buffer, with the rows of <S, dS>
        seq_order=varlen.seq_order if varlen is not None else None)
    del dvo  # freed before wy_bwd's outputs are allocated (peak memory)
    h_sub = h_sub if sds_sub is None else None  # S only where the recurrence did not take <S, dS>
    # dk = dko + the state part, added in wy_bwd's kernel and rounded once to k's dtype (three fp32 passes of
    # [B, T, H, K] less: H100 profile, B=4 T=8192 H=16 K=V=128, 0.79 ms of fp32 adds and 0.27 ms of casts)
    dk, _, _, dg_sub = wy_bwd(k, None, None, None, None, v, None, h_sub, dh_sub, L, cu_seqlens=cu, sub_indices=sub,
                              gv_cum=gv_cum, dk_add=dko, dk_dtype=k.dtype, sds_sub=sds_sub)
    del dko
    dg = _channel_cumsum(dgq, L, varlen, reverse=True, sub=dgk, add=dg_sub)  # one pass: the difference and
    # the sub-chunk part inside the cumsum kernel (two fp32 [B, T, H, K] passes less)
    return dq, dk, dv, dg, dh0


class ChunkGLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, varlen, opts: GLAOptions, positive_flag=None):
        o, final_state, gv_cum = chunk_gla_fwd(q, k, v, g, opts.scale, initial_state, opts.output_final_state,
                                               opts.chunk_size, varlen, positive_flag, opts)
        ctx.save_for_backward(q, k, v, g, initial_state, gv_cum)
        ctx.varlen, ctx.opts = varlen, opts
        return o, final_state

    @staticmethod
    @on_input_device
    def backward(ctx, do, dht):
        q, k, v, g, initial_state, gv_cum = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        check_cotangent("o", do, v.shape, q.dtype)
        if dht is not None:
            dht = dht.contiguous()
        dq, dk, dv, dg, dh0 = chunk_gla_bwd(q, k, v, gv_cum, ctx.opts.scale, initial_state, do.contiguous(), dht,
                                            ctx.opts.chunk_size, ctx.varlen, ctx.opts)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype),
                dh0.to(initial_state.dtype) if dh0 is not None else None, None, None, None)


def _check(q, k, v, g, scale, initial_state, cu_seqlens, chunk_size):
    B, T, H, _, K, V = check_qkv(q, k, v, grouped=False)
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"`g` must be a torch.Tensor (the log decay [B, T, H, K]), got {type(g).__name__}")
    if tuple(g.shape) != (B, T, H, K):
        hint = (" (a scalar decay per token and head [B, T, H] is chunk_simple_gla's)"
                if tuple(g.shape) == (B, T, H) else "")
        raise ValueError(f"`g` must be a log decay per key channel, shape [B, T, H, K] = {(B, T, H, K)}, "
                         f"got {tuple(g.shape)}{hint}")
    check_tensor("g", g, 4)
    check_gate_dtype("g", g, q)
    check_common(q, (("q", q), ("k", k), ("v", v), ("g", g)), scale, initial_state, cu_seqlens, chunk_size,
                 (H, K, V), "H, K, V")


@on_input_device
def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    config: dict | None = None,
):
    r"""Gated linear attention with a vector decay per key channel (GLA, HGRN2-style). A drop-in for
    FLA's ``chunk_gla`` (``fla.ops.gla``).

    ``S_t = diag(e^{g_t}) S_{t-1} + k_t v_t^T``, ``o_t = scale S_t^T q_t`` (GLA paper, Yang et al. 2023,
    "Gated Linear Attention Transformers with Hardware-Efficient Training", Section 4; ULA paper,
    Sections 2.1-2.2, Eqs. 4-7 and 9, "vector decay").

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; fp32, fp16 or bf16 (all the same; float64 for
            verification). Head dims K, V up to 256.
        g: log decay per key channel ``[B, T, H, K]``: natural log, <= 0 (``e^g`` is the per-step
            forget factor); fp32 or q's dtype. Cumulated in fp32 within each outer chunk.
        scale: default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (N = B, or the number of sequences with ``cu_seqlens``), any
            float dtype (read as fp32), or None (zeros).
        output_final_state: also return ``S_T`` per sequence.
        state_v_first: initial and final state in FLA's ``[N, H, V, K]`` layout (transposed at the boundary).
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (B = 1); each restarts from its
            own initial state.
        cu_seqlens_cpu: FLA's host copy of ``cu_seqlens`` (same values; the index tables are built from it
            without a device read).
        chunk_size: outer chunk L in {64, 128, 256, 512} (keyword-only; states live every L tokens).
        config: tuning keys (keyword-only, each optional). ``vec_f32`` (default True): with 16-bit inputs the gated
            operands of the intra-chunk products (``a_r 2^(GV_r - GV_m)``, ``b_s 2^(GV_m - GV_s)``, and ``c_s`` with
            its scores for dq / dk) stay fp32 and those products run in TF32, as FLA's ``chunk_gla`` forms its
            intra-chunk scores; False rounds them to the input dtype (H100, B = 4, T = 8192 bf16: dv 3.64e-3 vs
            FLA's 2.01e-3, dg 4.84e-3 vs 1.37e-3 against the fp32 run, when the tiled parts of dv and dk were also
            bf16). ``vec_span`` (default 32): the diagonal square as one masked tensor-core product when the gate
            spans at most this many log2 units over a tile's rows in every channel (checked per tile at run time;
            else 16-row elementwise steps); 0 always takes the steps (and fp32 at more than 128 columns does).
            ``tile_rows`` (16, 32 or 64; default 32, 16 for fp32 at more than 128 columns): rows of the tiled
            products' tiles (with 4 warps when set).

    Returns ``(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32 or None)``; differentiable in
    q, k, v, g and initial_state.

    Raises ValueError/TypeError naming the argument for wrong shapes or dtypes (a scalar decay
    ``[B, T, H]`` passed as ``g`` points to ``chunk_simple_gla``), positive log decays (checked at the
    end of the call, after the kernels are queued, waiting for the gate's cumsum kernel only; not while a
    CUDA graph is being captured), unsupported sizes, chunk sizes or devices.
    """
    initial_state = state_in_kv_layout(initial_state, state_v_first)
    compiling = torch.compiler.is_compiling()  # then custom ops (library.py): no host reads here
    bounds = None if compiling else host_bounds(cu_seqlens, cu_seqlens_cpu)
    _check(q, k, v, g, scale, initial_state, cu_seqlens, chunk_size)
    positive = None if compiling else positive_flag_for(g)
    K = q.shape[-1]
    varlen = None
    if cu_seqlens is not None and not compiling:
        varlen = VarlenIndex.build(cu_seqlens, chunk_size, bounds=bounds)
        check_varlen_bounds(varlen.bounds, q.shape[1])
    if scale is None:
        scale = K ** -0.5
    q, k, v, g = (x.contiguous() for x in (q, k, v, g))
    config = dict(config or {})
    unknown = set(config) - {"vec_f32", "vec_span", "tile_rows"}
    if unknown:
        raise ValueError(f"`config` has unknown keys {sorted(unknown)} (known: vec_f32, vec_span, tile_rows)")
    if config.get("tile_rows", 16) not in (16, 32, 64):
        raise ValueError(f"`config['tile_rows']` must be 16, 32 or 64, got {config['tile_rows']!r}")
    opts = GLAOptions(float(scale), int(chunk_size), bool(output_final_state), bool(config.get("vec_f32", True)),
                      int(config.get("vec_span", 32)), config.get("tile_rows"))
    if compiling:
        from tfla.ops.gla.library import gla_fwd

        o, final_state, _ = gla_fwd(q, k, v, g, initial_state.contiguous() if initial_state is not None else None,
                                    cu_seqlens, opts.scale, opts.chunk_size, opts.output_final_state, opts.vec_f32,
                                    opts.vec_span, opts.tile_rows or 0)
        return o, state_in_fla_layout(final_state if output_final_state else None, state_v_first)
    args = (q, k, v, g, initial_state.contiguous() if initial_state is not None else None, varlen, opts, positive)
    o, final_state = precompile.apply(autograd_call(ChunkGLAFunction), args, q, lambda: (
        "gla", precompile.signature(q, v, g, args[4]), q.shape[1] % 64 == 0, table_kind(varlen), opts))
    raise_if_positive(positive)
    return o, state_in_fla_layout(final_state, state_v_first)
