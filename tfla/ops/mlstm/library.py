"""``torch.library`` custom ops of ``chunk_mlstm``, the path it takes while ``torch.compile`` traces it (as
``tfla/ops/gated_delta_rule/library.py``): forward and backward each one opaque op with a fake implementation,
joined by ``register_autograd``. Under compilation ``save_states`` is ignored (the backward recomputes the states).
"""
from __future__ import annotations

import torch

from tfla.ops.common.custom_ops import absent, varlen_index
from tfla.ops.common.utils import on_input_device
from tfla.ops.mlstm.chunk import BWD_CHUNK_SIZE, MLSTMOptions, chunk_mlstm_bwd, chunk_mlstm_fwd


def _opts(input_gate, normalize, eps, scale, chunk_size, output_final_state, aug, detach_normalizer):
    return MLSTMOptions(input_gate, normalize, eps, scale, chunk_size, output_final_state, aug=aug,
                        detach_normalizer=detach_normalizer)


def _acc(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _opt(x):
    return x if x is not None and x.numel() else None


@torch.library.custom_op("tfla::chunk_mlstm_fwd", mutates_args=())
@on_input_device
def mlstm_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
              C0: torch.Tensor | None, n0: torch.Tensor | None, m0: torch.Tensor | None,
              cu_seqlens: torch.Tensor | None, input_gate: str, normalize: bool, eps: float, scale: float,
              chunk_size: int, output_final_state: bool, aug: bool, detach_normalizer: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(h, C, n, m, den)`` of ``chunk_mlstm_fwd``: the final state's parts and the normalizer's dot, empty fp32
    tensors where absent (no final state, no m for the sigmoid gate, no den without ``aug``)."""
    opts = _opts(input_gate, normalize, eps, scale, chunk_size, output_final_state, aug, detach_normalizer)
    h, final, den = chunk_mlstm_fwd(q, k, v, i, f, C0, n0, m0, opts, varlen_index(cu_seqlens, chunk_size, q.shape[1]))
    final = tuple(final) + (None,) * (3 - len(final)) if final is not None else (None,) * 3
    acc = _acc(q)
    return (h,) + tuple(x.to(acc) if x is not None else absent(q) for x in final + (den,))


@mlstm_fwd.register_fake
def _(q, k, v, i, f, C0, n0, m0, cu_seqlens, input_gate, normalize, eps, scale, chunk_size, output_final_state, aug,
      detach_normalizer):
    B, T, H, K = q.shape
    V = v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    acc = _acc(q)
    h = v.new_empty(B, T, H, V)
    C = q.new_empty(N, H, K, V, dtype=acc) if output_final_state else absent(q)
    n = q.new_empty(N, H, K, dtype=acc) if output_final_state else absent(q)
    m = q.new_empty(N, H, dtype=acc) if output_final_state and input_gate == "exp" else absent(q)
    den = q.new_empty(B, T, H, dtype=acc) if aug else absent(q)
    return h, C, n, m, den


@torch.library.custom_op("tfla::chunk_mlstm_bwd", mutates_args=())
@on_input_device
def mlstm_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor,
              C0: torch.Tensor | None, n0: torch.Tensor | None, m0: torch.Tensor | None, h: torch.Tensor,
              den: torch.Tensor, C: torch.Tensor, n: torch.Tensor, m: torch.Tensor, dh: torch.Tensor,
              dC: torch.Tensor | None, dn: torch.Tensor | None, dm: torch.Tensor | None,
              cu_seqlens: torch.Tensor | None, input_gate: str, normalize: bool, eps: float, scale: float,
              output_final_state: bool, aug: bool, detach_normalizer: bool) -> list[torch.Tensor]:
    """``[dq, dk, dv, di, df, dC0, dn0, dm0]`` of ``chunk_mlstm_bwd`` at its chunk size (dq, dk, dv in the inputs'
    dtypes, the rest fp32; empty fp32 tensors for absent initial-state parts)."""
    opts = _opts(input_gate, normalize, eps, scale, BWD_CHUNK_SIZE, output_final_state, aug, detach_normalizer)
    final = None
    if output_final_state and input_gate == "exp":
        final = (C, n, m)
    grads = chunk_mlstm_bwd(q, k, v, i, f, C0, n0, m0, h, _opt(den), final, dh.contiguous(), dC, dn, dm, opts,
                            varlen_index(cu_seqlens, BWD_CHUNK_SIZE, q.shape[1]))
    acc = _acc(q)
    out = [g.to(t.dtype) for g, t in zip(grads[:3], (q, k, v))]
    return out + [g.to(acc) if g is not None else absent(q) for g in grads[3:]]


@mlstm_bwd.register_fake
def _(q, k, v, i, f, C0, n0, m0, h, den, C, n, m, dh, dC, dn, dm, cu_seqlens, input_gate, normalize, eps, scale,
      output_final_state, aug, detach_normalizer):
    acc = _acc(q)
    st = [x.new_empty(x.shape, dtype=acc) if x is not None else absent(q) for x in (C0, n0, m0)]
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), i.new_empty(i.shape, dtype=acc),
            f.new_empty(f.shape, dtype=acc)] + st


def _setup_context(ctx, inputs, output):
    q, k, v, i, f, C0, n0, m0, cu_seqlens = inputs[:9]
    h, C, n, m, den = output
    ctx.save_for_backward(q, k, v, i, f, C0, n0, m0, cu_seqlens, h, den, C, n, m)
    input_gate, normalize, eps, scale, _chunk, output_final_state, aug, detach = inputs[9:]
    ctx.args = (input_gate, normalize, eps, scale, output_final_state, aug, detach)


def _backward(ctx, dh, dC, dn, dm, _dden):
    q, k, v, i, f, C0, n0, m0, cu_seqlens, h, den, C, n, m = ctx.saved_tensors
    input_gate, _, _, _, output_final_state, _, _ = ctx.args
    if dh is None:
        dh = torch.zeros_like(v)
    if not output_final_state:
        dC = dn = dm = None
    elif input_gate != "exp":
        dm = None
    dq, dk, dv, di, df, dC0, dn0, dm0 = mlstm_bwd(q, k, v, i, f, C0, n0, m0, h, den, C, n, m, dh, dC, dn, dm,
                                                  cu_seqlens, *ctx.args)
    return (dq, dk, dv, di.to(i.dtype), df.to(f.dtype), dC0.to(C0.dtype) if C0 is not None else None,
            dn0.to(n0.dtype) if n0 is not None else None, dm0.to(m0.dtype) if m0 is not None else None) + (None,) * 9


mlstm_fwd.register_autograd(_backward, setup_context=_setup_context)
