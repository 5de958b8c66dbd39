"""Chunk-local cumulative sum of a per-token log-space decay: scalar ``[B, T, H]`` or per channel ``[B, T, H, D]``.

Notation: B batch, T time, H heads, BT chunk (the outer chunk L: the sum restarts every BT tokens).

``G[t] = scale * sum_{s = chunk start}^{t} g[s]`` (forward) or ``scale * sum_{s = t}^{chunk end} g[s]``
(reverse, used by backward passes to turn per-token gate gradients into gradients of ``g``).
tfla passes ``scale = 1 / ln 2`` so the kernels downstream use ``exp2``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tfla.ops.common.grid import check_varlen_batch, chunk_rows, program_rows, tile_grid
from tfla.ops.common.utils import cdiv, prepare_chunk_indices


@triton.jit
def _chunk_local_cumsum_scalar_kernel(
    g,
    out,
    flag,
    cu_seqlens,
    chunk_indices,
    scale,
    T,
    H: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    BT: tl.constexpr,
    REVERSE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    FLAG: tl.constexpr,
    sub=None,
    add=None,
    HAS_SUB: tl.constexpr = False,
    HAS_ADD: tl.constexpr = False,
    FLAT: tl.constexpr = False,
    FLOOR: tl.constexpr = None,
):
    """One (chunk, batch x head, channel tile) per program. ``BD = 0``: a scalar gate ``[B, T, H]``;
    else a per-channel gate ``[B, T, H, D]`` in ``[BT, BD]`` tiles (channels contiguous: coalesced).
    ``FLAG``: also raise ``flag[0]`` to 1 when any loaded ``g`` is positive (a growth, not a decay).
    ``HAS_SUB`` / ``HAS_ADD``: scan ``g - sub`` and add ``add`` to the result (same shape as g; the backward's
    ``dG = q.dq - k.dk`` difference and the sub-chunk part of dg, without their own passes over HBM)."""
    i_t, i_bh = program_rows(T, BT, H, IS_VARLEN, FLAT)  # (chunk, batch x head): 2-D or flat grid (grid.py)
    i_b, i_h = i_bh // H, i_bh % H
    i_t, bos, T = chunk_rows(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    if BD == 0:
        p = (bos + o_t) * H + i_h
        m = m_t
    else:
        if FLAT:  # the channel tile's axis follows the chunk x head axes: 1 after the flat grid's one, else 2
            i_d = tl.program_id(1)
        else:
            i_d = tl.program_id(2)
        o_d = i_d * BD + tl.arange(0, BD)
        p = ((bos + o_t) * H + i_h)[:, None] * D + o_d[None, :]
        m = m_t[:, None] & (o_d < D)[None, :]
    b_g = tl.load(g + p, mask=m, other=0.0).to(out.dtype.element_ty)  # summed in the output dtype
    if FLOOR is not None:  # raised to the floor (a comparison, so NaN stays NaN)
        b_g = tl.where(b_g < FLOOR, FLOOR, b_g)
    if HAS_SUB:
        b_g -= tl.load(sub + p, mask=m, other=0.0).to(out.dtype.element_ty)
    if FLAG:
        if tl.max(tl.ravel(b_g), axis=0) > 0:
            tl.atomic_max(flag, 1)
    # scanned from the end when reversed (not total - prefix, which cancels catastrophically when
    # the suffix sums are small against the total, as gate gradients under strong decay are)
    b_o = tl.cumsum(b_g, axis=0, reverse=REVERSE) * scale
    if HAS_ADD:
        b_o += tl.load(add + p, mask=m, other=0.0).to(out.dtype.element_ty)
    tl.store(out + p, b_o.to(out.dtype.element_ty), mask=m)


def chunk_local_cumsum(
    g: torch.Tensor,
    chunk_size: int,
    scale: float = 1.0,
    reverse: bool = False,
    bounds: list[int] | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    positive_flag: "PositiveFlag | None" = None,
    sub: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
    force_flat: bool = False,
    floor: float | None = None,
) -> torch.Tensor:
    """Chunk-local (reverse) cumsum of ``g: [B, T, H]`` (scalar gate) or ``[B, T, H, D]`` (per-channel
    gate, summed per channel) over chunks of ``chunk_size`` tokens.

    For varlen, pass ``cu_seqlens`` (device tensor) and ``bounds`` (the same offsets as a list) or a
    precomputed ``chunk_indices``. ``positive_flag``: a ``PositiveFlag`` whose int32 device tensor ``[1]``
    (zero) the kernel sets to 1 when any element of ``g`` is > 0 (the ops' ``g <= 0`` check without a
    second pass over g); its host copy is queued right after the kernel. ``sub`` / ``add`` (g's shape): the
    result is ``scale * cumsum(g - sub) + add`` in one pass. ``floor``: each g is raised to it first (the log decays'
    ``LOG_DECAY_FLOOR``; NaN stays NaN). ``force_flat``: the 1-D grid that very large inputs
    take (``tfla/ops/common/grid.py``; for tests). Returns g's shape in ``out_dtype`` (fp32 by default).
    """
    B, T, H = g.shape[:3]
    D = g.shape[3] if g.dim() == 4 else 1
    g = g.contiguous()
    for name, x in (("sub", sub), ("add", add)):
        if x is not None and (x.shape != g.shape or not x.is_contiguous()):
            raise ValueError(f"`{name}` must be a contiguous tensor of g's shape {tuple(g.shape)}")
    out = torch.empty(g.shape, dtype=out_dtype, device=g.device)
    if cu_seqlens is not None:
        if chunk_indices is None:
            chunk_indices = prepare_chunk_indices(bounds, chunk_size, g.device)
        NT = chunk_indices.shape[0]
    else:
        NT = cdiv(T, chunk_size)
    if NT == 0 or B * H * D == 0:
        if positive_flag is not None:
            positive_flag.queued()
        return out
    check_varlen_batch(B, cu_seqlens)
    if g.dim() == 3 and H > 1:
        # a scalar gate of H heads as one head of H channels: each program loads [chunk, H] rows of contiguous
        # values instead of one head's values H apart (the same sums; docs/performance.md, "The gate cumsum's
        # loads"); g, sub, add and out are contiguous, so the kernel reads them as [B, T, 1, H]
        H, D = 1, H
    BD = 0 if g.dim() == 3 and D == 1 else min(triton.next_power_of_2(D), max(16, 4096 // chunk_size))
    grid, flat = tile_grid(NT, B * H, force_flat=force_flat)
    _chunk_local_cumsum_scalar_kernel[grid + (cdiv(D, BD) if BD else 1,)](
        g, out, positive_flag.flag if positive_flag is not None else None, cu_seqlens, chunk_indices, scale, T,
        H=H, D=D, BD=BD, BT=chunk_size, REVERSE=reverse, IS_VARLEN=cu_seqlens is not None,
        FLAG=positive_flag is not None, sub=sub, add=add, HAS_SUB=sub is not None, HAS_ADD=add is not None, FLAT=flat,
        FLOOR=None if floor is None else float(floor),
        num_warps=4,
    )
    if positive_flag is not None:
        positive_flag.queued()
    return out


class PositiveFlag:
    """The ``g <= 0`` check of the decayed linear-attention ops without a full host sync: the cumsum kernel
    raises ``flag`` (int32 ``[1]`` on the kernels' device) when any ``g > 0``; ``queued`` (called right after
    that kernel) copies it to pinned host memory behind an event, and ``raise_if_positive`` (at the end of the
    call, after every kernel is queued) waits for that event only, not for the call's later kernels. With the
    read as a stream sync at the end of the forward, the GPU ran dry while the host prepared the backward
    (H100, chunk_simple_gla fwd+bwd at B=4 T=8192 H=16 K=V=128, bf16: call 2.52 ms, kernels 2.08 ms)."""

    def __init__(self, device: torch.device):
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._host = self._event = None

    def queued(self) -> None:
        if self.flag.is_cuda:
            self._host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            self._host.copy_(self.flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def raise_if_positive(self, name: str = "g") -> None:
        if self._event is not None:
            self._event.synchronize()
            positive = bool(self._host.item())
        else:
            positive = bool(self.flag.item())
        if positive:  # a positive log decay is a growth, not a decay
            raise ValueError(f"`{name}` is a log decay and must be <= 0 everywhere; got positive values")


def positive_flag_for(like: torch.Tensor | None) -> PositiveFlag | None:
    """None when ``like`` is None (nothing to check), else a ``PositiveFlag`` on ``like``'s device (pass the
    tensor the kernels run on: q; a ``g_gamma`` may live on the host) that the gate's cumsum kernel raises
    when any ``g > 0`` (no extra pass over g), read after the kernels are queued (``raise_if_positive``),
    waiting for the cumsum kernel only (measured on an H100 with a host read before the kernels: 2.18 ms
    vs 0.56 ms without it, B=4 T=8192 H=16 K=V=128). None (no check) during CUDA-graph capture, where no
    host read is possible."""
    if like is None or (like.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    return PositiveFlag(like.device)


def raise_if_positive(flag: PositiveFlag | None, name: str = "g"):
    """Raise ValueError naming ``name`` if the cumsum kernel found a positive log decay (no-op for None)."""
    if flag is not None:
        flag.raise_if_positive(name)
