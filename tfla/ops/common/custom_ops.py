"""Helpers of the ``torch.library`` custom ops (``library.py`` beside each op), the path the ops take while
``torch.compile`` traces them: the varlen tables built when the op runs (nothing is read from the device while
tracing), and the empty tensor that stands for an absent output (a custom op returns tensors, never None)."""
from __future__ import annotations

import torch

from tfla.ops.common.varlen import VarlenIndex, capturing
from tfla.utils.validation import check_varlen_bounds


def varlen_index(cu_seqlens: torch.Tensor | None, chunk_size: int, T: int, on_device: bool = False,
                 bounds: list[int] | None = None) -> VarlenIndex | None:
    """The cached index tables of ``cu_seqlens`` at ``chunk_size`` (None without varlen; ``bounds``: its host copy,
    else read once per tensor), its offsets checked against the T packed tokens (ValueError as in eager calls).
    ``on_device``: the call takes tables built on the device (``VarlenIndex.on_device``, 64-row chunks), which it
    gets under CUDA-graph capture (also a compile with CUDA graphs); other calls raise ValueError there
    (``VarlenIndex.build``)."""
    if cu_seqlens is None:
        return None
    if on_device and capturing():
        return VarlenIndex.on_device(cu_seqlens, T)
    varlen = VarlenIndex.build(cu_seqlens, chunk_size, bounds=bounds)
    check_varlen_bounds(varlen.bounds, T)
    return varlen


def absent(like: torch.Tensor) -> torch.Tensor:
    """An empty fp32 tensor on ``like``'s device: an output the call does not produce."""
    return like.new_empty(0, dtype=torch.float32)
