"""``torch.library`` custom ops of linear attention with scalar, constant or no decay (``chunk_simple_gla`` and the
ops built on it: ``chunk_retention``, ``chunk_linear_attn``, ``chunk_lightning_attn``; the normalized
``chunk_linear_attn`` has a pair of its own), the path they take while
``torch.compile`` traces them (as ``tfla/ops/gated_delta_rule/library.py``): the forward and the backward each one
opaque op with a fake implementation, joined by ``register_autograd``. Under compilation the positive-decay check
(a host read after the kernels) is skipped.
"""
from __future__ import annotations

import torch

from tfla.ops.common.custom_ops import absent, varlen_index
from tfla.ops.common.linear_attn import chunk_simple_gla_bwd, chunk_simple_gla_fwd
from tfla.ops.common.utils import on_input_device
from tfla.ops.simple_gla.chunk import chunk_linear_attn_bwd, chunk_linear_attn_fwd


@torch.library.custom_op("tfla::chunk_simple_gla_fwd", mutates_args=())
@on_input_device
def simple_gla_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                   initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float,
                   chunk_size: int, output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o, final_state, g_cum)`` of ``chunk_simple_gla_fwd`` (an empty fp32 tensor for an absent one)."""
    o, final, g_cum = chunk_simple_gla_fwd(q, k, v, g, scale, initial_state, output_final_state, chunk_size,
                                           varlen_index(cu_seqlens, chunk_size, q.shape[1]))
    return o, final if final is not None else absent(q), g_cum if g_cum is not None else absent(q)


@simple_gla_fwd.register_fake
def _(q, k, v, g, initial_state, cu_seqlens, scale, chunk_size, output_final_state):
    B, T, H, K = q.shape
    V = v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    final = q.new_empty(N, H, K, V, dtype=acc) if output_final_state else absent(q)
    return v.new_empty(B, T, H, V, dtype=q.dtype), final, q.new_empty(B, T, H, dtype=acc) if g is not None \
        else absent(q)


@torch.library.custom_op("tfla::chunk_simple_gla_bwd", mutates_args=())
@on_input_device
def simple_gla_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_cum: torch.Tensor | None,
                   initial_state: torch.Tensor | None, do: torch.Tensor, dht: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None, scale: float, chunk_size: int, need_dg: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dg, dh0)`` of ``chunk_simple_gla_bwd`` (an empty fp32 tensor for dg / dh0 when absent)."""
    dq, dk, dv, dg, dh0 = chunk_simple_gla_bwd(q, k, v, g_cum, scale, initial_state, do.contiguous(),
                                               None if dht is None else dht.contiguous(), chunk_size,
                                               varlen_index(cu_seqlens, chunk_size, q.shape[1]), need_dg=need_dg)
    return dq, dk, dv, dg if dg is not None else absent(q), dh0 if dh0 is not None else absent(q)


@simple_gla_bwd.register_fake
def _(q, k, v, g_cum, initial_state, do, dht, cu_seqlens, scale, chunk_size, need_dg):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dg = g_cum.new_empty(g_cum.shape, dtype=acc) if g_cum is not None and need_dg else absent(q)
    dh0 = initial_state.new_empty(initial_state.shape, dtype=acc) if initial_state is not None else absent(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dg, dh0


def _setup_context(ctx, inputs, output):
    q, k, v, g, initial_state, cu_seqlens, scale, chunk_size, output_final_state = inputs
    ctx.save_for_backward(q, k, v, g, initial_state, cu_seqlens, output[2] if g is not None else None)
    ctx.scale, ctx.chunk_size, ctx.output_final_state = scale, chunk_size, output_final_state


def _backward(ctx, do, dht, _dg_cum):
    q, k, v, g, initial_state, cu_seqlens, g_cum = ctx.saved_tensors
    need_dg = g is not None and ctx.needs_input_grad[3]
    if do is None:
        do = torch.zeros_like(v, dtype=q.dtype)
    dq, dk, dv, dg, dh0 = simple_gla_bwd(q, k, v, g_cum, initial_state, do,
                                         dht if ctx.output_final_state else None, cu_seqlens, ctx.scale,
                                         ctx.chunk_size, need_dg)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype) if need_dg else None,
            dh0.to(initial_state.dtype) if initial_state is not None else None, None, None, None, None)


simple_gla_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("tfla::chunk_linear_attn_fwd", mutates_args=())
@on_input_device
def linear_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor | None,
                    z_init: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float, chunk_size: int,
                    output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o, final_state, z_state, den)`` of ``chunk_linear_attn_fwd`` (normalized; an empty fp32 tensor for an absent
    final state)."""
    o, final, z, den = chunk_linear_attn_fwd(q, k, v, scale, initial_state, z_init, output_final_state, chunk_size,
                                             varlen_index(cu_seqlens, chunk_size, q.shape[1]))
    return o, final if final is not None else absent(q), z, den


@linear_attn_fwd.register_fake
def _(q, k, v, initial_state, z_init, cu_seqlens, scale, chunk_size, output_final_state):
    B, T, H, K = q.shape
    V = v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_dtype = q.dtype if z_init is None else torch.promote_types(q.dtype, z_init.dtype)
    final = q.new_empty(N, H, K, V, dtype=acc) if output_final_state else absent(q)
    return (q.new_empty(B, T, H, V, dtype=out_dtype), final, q.new_empty(N, 1, H, K, dtype=out_dtype),
            q.new_empty(B, T, H, dtype=acc))


@torch.library.custom_op("tfla::chunk_linear_attn_bwd", mutates_args=())
@on_input_device
def linear_attn_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor | None,
                    z_init: torch.Tensor | None, o: torch.Tensor, den: torch.Tensor, do: torch.Tensor,
                    dht: torch.Tensor | None, dz: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float,
                    chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, d initial_state, dz_init)`` of ``chunk_linear_attn_bwd`` (an empty fp32 tensor for an absent
    initial-state part)."""
    dq, dk, dv, dh0, dz0 = chunk_linear_attn_bwd(
        q, k, v, scale, initial_state, z_init, o, den, do.contiguous(), None if dht is None else dht.contiguous(), dz,
        chunk_size, varlen_index(cu_seqlens, chunk_size, q.shape[1]))
    return dq, dk, dv, dh0 if dh0 is not None else absent(q), dz0 if dz0 is not None else absent(q)


@linear_attn_bwd.register_fake
def _(q, k, v, initial_state, z_init, o, den, do, dht, dz, cu_seqlens, scale, chunk_size):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dh0 = initial_state.new_empty(initial_state.shape, dtype=acc) if initial_state is not None else absent(q)
    dz0 = z_init.new_empty(z_init.shape, dtype=acc) if z_init is not None else absent(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dh0, dz0


def _la_setup_context(ctx, inputs, output):
    q, k, v, initial_state, z_init, cu_seqlens, scale, chunk_size, output_final_state = inputs
    ctx.save_for_backward(q, k, v, initial_state, z_init, cu_seqlens, output[0], output[3])
    ctx.scale, ctx.chunk_size, ctx.output_final_state = scale, chunk_size, output_final_state


def _la_backward(ctx, do, dht, dz, _dden):
    q, k, v, initial_state, z_init, cu_seqlens, o, den = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv, dh0, dz0 = linear_attn_bwd(q, k, v, initial_state, z_init, o, den, do,
                                           dht if ctx.output_final_state else None, dz, cu_seqlens, ctx.scale,
                                           ctx.chunk_size)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
            dh0.to(initial_state.dtype) if initial_state is not None else None,
            dz0.to(z_init.dtype) if z_init is not None else None, None, None, None, None)


linear_attn_fwd.register_autograd(_la_backward, setup_context=_la_setup_context)


@torch.library.custom_op("tfla::fused_recurrent_simple_gla", mutates_args=())
@on_input_device
def fused_recurrent_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                        g_gamma: torch.Tensor | None, scale: float, initial_state: torch.Tensor | None,
                        output_final_state: bool, reverse: bool, cu_seqlens: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, final_state)`` of the decode op (``fused_recurrent.py``; an empty fp32 tensor without the final
    state), initial and final state in tfla's ``[N, H, K, V]``."""
    from tfla.ops.simple_gla.fused_recurrent import _fwd

    o, ht = _fwd(q, k, v, g, g_gamma, scale, initial_state, output_final_state, reverse, cu_seqlens)
    return o, ht if ht is not None else absent(q)


@fused_recurrent_fwd.register_fake
def _(q, k, v, g, g_gamma, scale, initial_state, output_final_state, reverse, cu_seqlens):
    B, T, H, K = q.shape
    V = v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    ht = q.new_empty(N, H, K, V, dtype=acc) if output_final_state else absent(q)
    return v.new_empty(B, T, H, V, dtype=q.dtype), ht
