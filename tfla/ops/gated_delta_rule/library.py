"""``torch.library`` custom ops of the chunked Gated DeltaNet and of its decode op, the path
``tfla.chunk_gated_delta_rule`` and ``tfla.fused_recurrent_gated_delta_rule`` take while ``torch.compile`` traces them
(``torch.compiler.is_compiling()``): Dynamo cannot trace the host code in front of the
kernels (cached index tables, reads of ``cu_seqlens``, Triton launches), so the forward and the backward each enter
the graph as one opaque op with a fake implementation (output shapes and dtypes from the input shapes) and the
autograd formula registered between them. Eager calls keep ``ChunkGatedDeltaRuleFunction``.

Under compilation the forward keeps FLA's saved set (inputs, cumulative gates, Tm: the eager default; ``save_v_new``
and ``save_states`` are ignored there) and runs every sequence in one chain (no ``segments`` split); the backward
recomputes Vnew and the states by the forward's pass without its output. ``config`` is ignored there (launch tuning
only; results equal up to rounding).
"""
from __future__ import annotations

import torch

from tfla.ops.common.custom_ops import absent, varlen_index
from tfla.ops.common.fused_delta_fwd import SAVE_NONE
from tfla.ops.common.utils import SUB_CHUNK, on_input_device


@torch.library.custom_op("tfla::chunk_gated_delta_rule_fwd", mutates_args=())
@on_input_device
def chunk_gdn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float,
                  output_final_state: bool, needs_grad: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o, final_state, g_cum, ai)``: ``chunk_gated_delta_rule_fwd``'s outputs and what the backward keeps
    beside the inputs (FLA's saved set); an empty fp32 tensor stands for an absent one (no final state; nothing kept
    without ``needs_grad``)."""
    from tfla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    # (under CUDA-graph capture without gradients: tables built on the device, as in eager calls)
    varlen = varlen_index(cu_seqlens, SUB_CHUNK, q.shape[1], on_device=not needs_grad)
    o, final, inter = chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, scale, initial_state, output_final_state, varlen,
        save=SAVE_NONE, segments=1)
    keep = [inter["g_cum"], inter["ai"]] if needs_grad else [None] * 2
    return tuple(x if x is not None else absent(q) for x in [o, final] + keep)


@chunk_gdn_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, needs_grad):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    o = v.new_empty(B, T, HV, V, dtype=q.dtype)
    final = q.new_empty(N, HV, K, V, dtype=acc) if output_final_state else absent(q)
    if not needs_grad:
        return o, final, absent(q), absent(q)
    return o, final, q.new_empty(B, T, HV, dtype=acc), q.new_empty(B, T, HV, SUB_CHUNK, dtype=q.dtype)


@torch.library.custom_op("tfla::chunk_gated_delta_rule_bwd", mutates_args=())
@on_input_device
def chunk_gdn_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_cum: torch.Tensor, beta: torch.Tensor,
                  ai: torch.Tensor, initial_state: torch.Tensor | None, do: torch.Tensor,
                  dht: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dg, dbeta, dh0)`` of ``chunk_gated_delta_rule_bwd`` from the forward op's kept tensors (dh0
    an empty fp32 tensor without an initial state); Vnew and the states recomputed."""
    from tfla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd

    varlen = varlen_index(cu_seqlens, SUB_CHUNK, q.shape[1])
    dq, dk, dv, dg, dbeta, dh0, *_ = chunk_gated_delta_rule_bwd(
        q, k, v, g_cum, beta, ai, scale, initial_state, do.contiguous(), None if dht is None else dht.contiguous(),
        varlen)
    return dq, dk, dv, dg, dbeta, dh0 if dh0 is not None else absent(q)


@chunk_gdn_bwd.register_fake
def _(q, k, v, g_cum, beta, ai, initial_state, do, dht, cu_seqlens, scale):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dh0 = initial_state.new_empty(initial_state.shape, dtype=acc) if initial_state is not None else absent(q)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g_cum.new_empty(g_cum.shape, dtype=acc),
            beta.new_empty(beta.shape, dtype=acc), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, needs_grad = inputs
    _, _, g_cum, ai = output
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, g_cum, ai)
    ctx.scale, ctx.output_final_state = scale, output_final_state


def _backward(ctx, do, dht, *_):
    q, k, v, g, beta, initial_state, cu_seqlens, g_cum, ai = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v, dtype=q.dtype)
    dq, dk, dv, dg, dbeta, dh0 = chunk_gdn_bwd(
        q, k, v, g_cum, beta, ai, initial_state, do, dht if ctx.output_final_state else None, cu_seqlens,
        ctx.scale)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype),
            dh0.to(initial_state.dtype) if initial_state is not None else None, None, None, None, None)


chunk_gdn_fwd.register_autograd(_backward, setup_context=_setup_context)


# decode (``tfla.fused_recurrent_gated_delta_rule``, forward only): one op that returns the final state, one that
# writes the states into the pool in place (a mutation declared to the compiler). ``config`` is ignored here.

@torch.library.custom_op("tfla::fused_recurrent_gated_delta_rule", mutates_args=())
@on_input_device
def fused_recurrent_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, beta: torch.Tensor,
                        initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                        ssm_state_indices: torch.Tensor | None, num_accepted_tokens: torch.Tensor | None,
                        scale: float, output_final_state: bool, state_v_first: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, final_state)`` (an empty fp32 tensor without ``output_final_state``); ``initial_state`` in tfla's
    ``[*, HV, K, V]`` index order (a V-first state as its transposed view). Host (CPU) index tensors' values are
    checked here (the compiled call skips the eager check's reads)."""
    from tfla.ops.gated_delta_rule.fused_recurrent import check_host_values, fused_recurrent_gated_delta_rule_fwd

    check_host_values(q.shape[1], initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens)
    o, final = fused_recurrent_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                    cu_seqlens, ssm_state_indices, num_accepted_tokens, False,
                                                    state_v_first)
    return o, final if final is not None else absent(q)


@fused_recurrent_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens, scale,
      output_final_state, state_v_first):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    final = q.new_empty((N, HV, V, K) if state_v_first else (N, HV, K, V), dtype=acc) if output_final_state \
        else absent(q)
    return v.new_empty(B, T, HV, V, dtype=q.dtype), final


@torch.library.custom_op("tfla::fused_recurrent_gated_delta_rule_inplace", mutates_args=("pool",))
@on_input_device
def fused_recurrent_inplace(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                            beta: torch.Tensor, pool: torch.Tensor, cu_seqlens: torch.Tensor | None,
                            ssm_state_indices: torch.Tensor | None, num_accepted_tokens: torch.Tensor | None,
                            scale: float, state_v_first: bool) -> torch.Tensor:
    """o; the states go into ``pool`` (the user's tensor, ``[slots, HV, V, K]`` with ``state_v_first``) in place.
    Host (CPU) index tensors' values are checked here, before anything is written."""
    from tfla.ops.gated_delta_rule.fused_recurrent import check_host_values, fused_recurrent_gated_delta_rule_fwd
    from tfla.utils.validation import state_in_kv_layout

    check_host_values(q.shape[1], pool, cu_seqlens, ssm_state_indices, num_accepted_tokens)

    o, _ = fused_recurrent_gated_delta_rule_fwd(q, k, v, g, beta, scale, state_in_kv_layout(pool, state_v_first),
                                                False, cu_seqlens, ssm_state_indices, num_accepted_tokens, True,
                                                state_v_first)
    return o


@fused_recurrent_inplace.register_fake
def _(q, k, v, g, beta, pool, cu_seqlens, ssm_state_indices, num_accepted_tokens, scale, state_v_first):
    B, T = q.shape[:2]
    return v.new_empty(B, T, v.shape[2], v.shape[3], dtype=q.dtype)
