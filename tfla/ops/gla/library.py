"""``torch.library`` custom ops of ``chunk_gla``, the path it takes while ``torch.compile`` traces it (as
``tfla/ops/gated_delta_rule/library.py``): forward and backward each one opaque op with a fake implementation,
joined by ``register_autograd``. Under compilation the positive-decay check (a host read) is skipped.
"""
from __future__ import annotations

import torch

from tfla.ops.common.custom_ops import absent, varlen_index
from tfla.ops.common.utils import on_input_device
from tfla.ops.gla.chunk import GLAOptions, chunk_gla_bwd, chunk_gla_fwd


def _opts(scale, chunk_size, output_final_state, vec_f32, vec_span, tile_rows):
    return GLAOptions(scale, chunk_size, output_final_state, vec_f32, vec_span, tile_rows or None)


@torch.library.custom_op("tfla::chunk_gla_fwd", mutates_args=())
@on_input_device
def gla_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, initial_state: torch.Tensor | None,
            cu_seqlens: torch.Tensor | None, scale: float, chunk_size: int, output_final_state: bool, vec_f32: bool,
            vec_span: int, tile_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o, final_state, gv_cum)`` of ``chunk_gla_fwd`` (an empty fp32 tensor without the final state);
    ``tile_rows`` 0: the default."""
    opts = _opts(scale, chunk_size, output_final_state, vec_f32, vec_span, tile_rows)
    o, final, gv_cum = chunk_gla_fwd(q, k, v, g, scale, initial_state, output_final_state, chunk_size,
                                     varlen_index(cu_seqlens, chunk_size, q.shape[1]), None, opts)
    return o, final if final is not None else absent(q), gv_cum


@gla_fwd.register_fake
def _(q, k, v, g, initial_state, cu_seqlens, scale, chunk_size, output_final_state, vec_f32, vec_span, tile_rows):
    B, T, H, K = q.shape
    V = v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    final = q.new_empty(N, H, K, V, dtype=acc) if output_final_state else absent(q)
    return v.new_empty(B, T, H, V, dtype=q.dtype), final, q.new_empty(B, T, H, K, dtype=acc)


@torch.library.custom_op("tfla::chunk_gla_bwd", mutates_args=())
@on_input_device
def gla_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gv_cum: torch.Tensor,
            initial_state: torch.Tensor | None, do: torch.Tensor, dht: torch.Tensor | None,
            cu_seqlens: torch.Tensor | None, scale: float, chunk_size: int, vec_f32: bool, vec_span: int,
            tile_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dg, dh0)`` of ``chunk_gla_bwd`` (dh0 an empty fp32 tensor without an initial state)."""
    opts = _opts(scale, chunk_size, False, vec_f32, vec_span, tile_rows)
    dq, dk, dv, dg, dh0 = chunk_gla_bwd(q, k, v, gv_cum, scale, initial_state, do.contiguous(),
                                        None if dht is None else dht.contiguous(), chunk_size,
                                        varlen_index(cu_seqlens, chunk_size, q.shape[1]), opts)
    return dq, dk, dv, dg, dh0 if dh0 is not None else absent(q)


@gla_bwd.register_fake
def _(q, k, v, gv_cum, initial_state, do, dht, cu_seqlens, scale, chunk_size, vec_f32, vec_span, tile_rows):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dh0 = initial_state.new_empty(initial_state.shape, dtype=acc) if initial_state is not None else absent(q)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape, dtype=k.dtype),
            gv_cum.new_empty(gv_cum.shape, dtype=acc), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, initial_state, cu_seqlens, scale, chunk_size, output_final_state, vec_f32, vec_span, tile_rows = \
        inputs
    ctx.save_for_backward(q, k, v, g, initial_state, cu_seqlens, output[2])
    ctx.args = (scale, chunk_size, vec_f32, vec_span, tile_rows)
    ctx.output_final_state = output_final_state


def _backward(ctx, do, dht, _dgv):
    q, k, v, g, initial_state, cu_seqlens, gv_cum = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v, dtype=q.dtype)
    dq, dk, dv, dg, dh0 = gla_bwd(q, k, v, gv_cum, initial_state, do, dht if ctx.output_final_state else None,
                                  cu_seqlens, *ctx.args)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype),
            dh0.to(initial_state.dtype) if initial_state is not None else None) + (None,) * 7


gla_fwd.register_autograd(_backward, setup_context=_setup_context)
