"""Chunk-local cumulative sum of a per-token scalar gate (log-space decay).

Notation: B batch, T time, H heads, BT chunk (the outer chunk L: the sum restarts every BT tokens).

``G[t] = scale * sum_{s = chunk start}^{t} g[s]`` (forward) or ``scale * sum_{s = t}^{chunk end} g[s]``
(reverse, used by backward passes to turn per-token gate gradients into gradients of ``g``).
tfla passes ``scale = 1 / ln 2`` so the kernels downstream use ``exp2``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.utils import cdiv, prepare_chunk_indices


@triton.jit
def _chunk_local_cumsum_scalar_kernel(
    g,
    out,
    cu_seqlens,
    chunk_indices,
    scale,
    T,
    H: tl.constexpr,
    BT: tl.constexpr,
    REVERSE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_b * T
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    p = (bos + o_t) * H + i_h
    b_g = tl.load(g + p, mask=m_t, other=0.0).to(out.dtype.element_ty)  # [BT], summed in the output dtype
    # scanned from the end when reversed (not total - prefix, which cancels catastrophically when
    # the suffix sums are small against the total, as gate gradients under strong decay are)
    b_o = tl.cumsum(b_g, axis=0, reverse=REVERSE)
    tl.store(out + p, (b_o * scale).to(out.dtype.element_ty), mask=m_t)


def chunk_local_cumsum(
    g: torch.Tensor,
    chunk_size: int,
    scale: float = 1.0,
    reverse: bool = False,
    bounds: list[int] | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Chunk-local (reverse) cumsum of ``g: [B, T, H]`` over chunks of ``chunk_size`` tokens.

    For varlen, pass ``cu_seqlens`` (device tensor) and ``bounds`` (the same offsets as a list) or a
    precomputed ``chunk_indices``. Returns ``[B, T, H]`` in ``out_dtype`` (fp32 by default).
    """
    B, T, H = g.shape
    out = torch.empty(B, T, H, dtype=out_dtype, device=g.device)
    if cu_seqlens is not None:
        if chunk_indices is None:
            chunk_indices = prepare_chunk_indices(bounds, chunk_size, g.device)
        NT = chunk_indices.shape[0]
    else:
        NT = cdiv(T, chunk_size)
    if NT == 0 or B * H == 0:
        return out
    _chunk_local_cumsum_scalar_kernel[(NT, B * H)](
        g, out, cu_seqlens, chunk_indices, scale, T,
        H=H, BT=chunk_size, REVERSE=reverse, IS_VARLEN=cu_seqlens is not None,
        num_warps=4,
    )
    return out
