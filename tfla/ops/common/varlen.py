"""Index tables of packed sequences (``cu_seqlens``), built once per call and shared by its stages."""
from __future__ import annotations

import dataclasses

import torch

from tfla.ops.common.utils import SUB_CHUNK, prepare_chunk_indices, prepare_chunk_offsets, seqlens_to_list


@dataclasses.dataclass
class VarlenIndex:
    """Index tables for ``cu_seqlens`` (built once per call from one host sync)."""

    cu_seqlens: torch.Tensor
    bounds: list[int]
    chunk_indices: torch.Tensor  # (seq, outer chunk) pairs
    chunk_offsets: torch.Tensor  # first outer chunk of each sequence
    sub_indices: torch.Tensor  # (seq, 64-row sub-chunk) pairs
    sub_offsets: torch.Tensor  # first 64-row sub-chunk of each sequence

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_indices.shape[0])

    def tiles(self, size: int) -> torch.Tensor:
        """(seq, tile) table for tiles of ``size`` rows (64-row tiles reuse ``sub_indices``)."""
        if size == SUB_CHUNK:
            return self.sub_indices
        return prepare_chunk_indices(self.bounds, size, self.cu_seqlens.device)

    def with_chunk_size(self, chunk_size: int) -> "VarlenIndex":
        """The same sequences indexed for another outer chunk size (no host sync)."""
        return VarlenIndex.build(self.cu_seqlens, chunk_size, bounds=self.bounds)

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, chunk_size: int, bounds: list[int] | None = None) -> "VarlenIndex":
        bounds = seqlens_to_list(cu_seqlens) if bounds is None else bounds
        dev = cu_seqlens.device
        return cls(
            cu_seqlens=cu_seqlens,
            bounds=bounds,
            chunk_indices=prepare_chunk_indices(bounds, chunk_size, dev),
            chunk_offsets=prepare_chunk_offsets(bounds, chunk_size, dev),
            sub_indices=prepare_chunk_indices(bounds, SUB_CHUNK, dev),
            sub_offsets=prepare_chunk_offsets(bounds, SUB_CHUNK, dev),
        )
