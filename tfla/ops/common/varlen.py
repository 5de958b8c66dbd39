"""Index tables of packed sequences (``cu_seqlens``), shared by a call's stages and cached across calls.

A model calls its layers with the same ``cu_seqlens`` tensor, forward and backward. The tables (which sequence and
chunk each program works on) depend only on the offsets, so they are built once per offsets and chunk size
(``_tables``: an LRU cache of device tensors, one host-to-device copy per build), and the offsets are read back to
the host once per ``cu_seqlens`` tensor (``cached_bounds``: keyed by the tensor's identity, storage and PyTorch
version counter, as FLA's ``tensor_cache`` keys on identity). A host read or copy waits for the device's queue: before
this cache the Qwen3-Next-style layer spent ~0.5 ms per forward there (H100, 2026-11-24: 2.17 ms wall for 1.67 ms of
kernels). Writing new offsets into the same tensor by a PyTorch op bumps its version and rebuilds; writing them from
outside PyTorch (a custom kernel) is not seen: pass ``cu_seqlens_cpu`` or a new tensor then.

Under CUDA-graph capture host tables would be those of the offsets at capture time, and a replay with other offsets
silently wrong. There ``VarlenIndex.on_device`` builds the tables from ``cu_seqlens`` with device ops (no host read,
recomputed by every replay) in a table sized from host-known bounds: N sequences of T tokens in all have at most
``min(T // 64 + N, T)`` chunks of 64 rows; the rows past the real chunks name a chunk past the last sequence's end,
whose rows every kernel masks off. Ops that take it say so (the Gated DeltaNet forward without gradients); others
raise ``ValueError`` under capture (``VarlenIndex.build``).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import weakref

import torch

from tfla.ops.common.utils import SUB_CHUNK, chunk_index_rows, chunk_offset_rows, seqlens_to_list

_BOUNDS_CACHE_SIZE = 16
_bounds_cache: "collections.OrderedDict" = collections.OrderedDict()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (no host reads of device tensors allowed)."""
    return _capturing()


def _device_tables(cu_seqlens: torch.Tensor, T: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(offsets, indices [NCmax, 2], first [N + 1])`` from device ops alone, for chunks of ``size`` rows.

    ``offsets``: ``cu_seqlens`` clamped into ``[0, T]``, made non-decreasing, starting at 0 and ending at T (equal to
    ``cu_seqlens`` when that is valid; a malformed one becomes some valid partition, so no kernel reads or writes
    outside the tensors). ``indices``: the (sequence, chunk) pairs in order, then padding rows naming the chunk just
    past the last sequence's end (all of its rows masked off). ``first``: each sequence's first chunk and the
    total."""
    N = cu_seqlens.numel() - 1
    ncmax = min(T // size + N, T)
    # no scalar writes (`offs[0] = 0` copies from the host, which a capture refuses): masks by position
    pos = torch.arange(N + 1, device=cu_seqlens.device)
    offs = cu_seqlens.clamp(0, T).cummax(0).values
    offs = torch.where(pos == 0, 0, torch.where(pos == N, T, offs)).to(cu_seqlens.dtype)
    counts = (offs[1:] - offs[:-1] + (size - 1)) // size
    first = torch.zeros(N + 1, dtype=torch.int64, device=cu_seqlens.device)
    first[1:] = counts.to(torch.int64).cumsum(0)
    c = torch.arange(ncmax, dtype=torch.int64, device=cu_seqlens.device)
    seq = torch.searchsorted(first[1:], c, right=True).clamp_(max=N - 1)
    chunk = c - first[seq]
    indices = torch.stack((seq, chunk), 1).to(torch.int32)
    return offs, indices, first.to(torch.int32)


def cached_bounds(cu_seqlens: torch.Tensor) -> list[int]:
    """``cu_seqlens`` as a host list, read from the device once per tensor (identity, storage, version counter)."""
    try:
        key = (id(cu_seqlens), cu_seqlens.data_ptr(), cu_seqlens._version)
    except RuntimeError:  # inference-mode tensors keep no version counter: read every time
        return seqlens_to_list(cu_seqlens)
    hit = _bounds_cache.get(key)
    if hit is not None and hit[0]() is cu_seqlens:
        _bounds_cache.move_to_end(key)
        return hit[1]
    bounds = seqlens_to_list(cu_seqlens)
    _bounds_cache[key] = (weakref.ref(cu_seqlens), bounds)
    if len(_bounds_cache) > _BOUNDS_CACHE_SIZE:
        _bounds_cache.popitem(last=False)
    return bounds


def longest_first_order(bounds) -> list[int]:
    """The sequences at the offsets ``bounds`` ordered by their 64-row chunk count, most first (ties in their order):
    the order in which the chain kernels (one program per sequence and head walking its chunks) start their
    programs. The GPU starts a grid's programs in order as SMs free up, so a packed batch whose longest sequence
    comes last leaves that sequence's chain to run after the others, on an otherwise idle GPU; longest first
    (LPT scheduling) starts it at once. An empty list where the offsets are in that order already."""
    n = [-(-(e - b) // SUB_CHUNK) for b, e in zip(bounds[:-1], bounds[1:])]
    order = sorted(range(len(n)), key=lambda i: -n[i])
    return [] if order == list(range(len(n))) else order


@functools.lru_cache(maxsize=64)
def _tables(bounds: tuple[int, ...], sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """For each size in ``sizes``: the ``[NC, 2]`` int32 (sequence, chunk) table and the ``[N + 1]`` int32 first chunk
    of each sequence; then ``longest_first_order`` as ``[N]`` int32 (None where the sequences are in that order),
    all from one host-to-device copy (views of one int32 buffer)."""
    parts = []
    for size in sizes:
        rows = chunk_index_rows(bounds, size)
        parts.append([x for r in rows for x in r])
        parts.append(chunk_offset_rows(bounds, size))
    parts.append(longest_first_order(bounds))
    flat = torch.tensor([x for p in parts for x in p], dtype=torch.int32).to(device)
    out, at = [], 0
    for i, p in enumerate(parts):
        t = flat[at:at + len(p)]
        out.append(t.view(-1, 2) if i % 2 == 0 and i < len(parts) - 1 else t)
        at += len(p)
    if not parts[-1]:
        out[-1] = None
    return tuple(out)


def chunk_tables(bounds, size: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(indices [NC, 2], offsets [N + 1], order [N] or None)`` of chunks of ``size`` rows for the offsets ``bounds``
    (cached; ``order``: ``longest_first_order``)."""
    return _tables(tuple(bounds), (int(size),), torch.device(device))


def table_kind(varlen: "VarlenIndex | None") -> str:
    """Which kernel variants a call's sequences take, for keys of compiled kinds (``precompile.apply``): "dense",
    "packed" or "packed, longest first" (``seq_order`` given)."""
    if varlen is None:
        return "dense"
    return "packed" if varlen.seq_order is None else "packed, longest first"


@dataclasses.dataclass
class VarlenIndex:
    """Index tables for ``cu_seqlens`` (cached: see the module's docstring)."""

    cu_seqlens: torch.Tensor
    bounds: list[int] | None  # the offsets on the host; None for tables built on the device (``on_device``)
    chunk_indices: torch.Tensor  # (seq, outer chunk) pairs
    chunk_offsets: torch.Tensor  # first outer chunk of each sequence
    sub_indices: torch.Tensor  # (seq, 64-row sub-chunk) pairs
    sub_offsets: torch.Tensor  # first 64-row sub-chunk of each sequence
    seq_order: torch.Tensor | None = None  # longest_first_order (None: in that order, or tables built on the device)

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_indices.shape[0])

    def tiles(self, size: int) -> torch.Tensor:
        """(seq, tile) table for tiles of ``size`` rows (64-row tiles reuse ``sub_indices``)."""
        if size == SUB_CHUNK:
            return self.sub_indices
        self._need_host("tiles of another size")
        return chunk_tables(self.bounds, size, self.cu_seqlens.device)[0]

    def with_chunk_size(self, chunk_size: int) -> "VarlenIndex":
        """The same sequences indexed for another outer chunk size (no host sync)."""
        self._need_host("another chunk size")
        return VarlenIndex.build(self.cu_seqlens, chunk_size, bounds=self.bounds)

    def _need_host(self, what: str) -> None:
        if self.bounds is None:
            raise ValueError(f"{what} needs the offsets on the host: not available for `cu_seqlens` under CUDA-graph "
                             "capture")

    @classmethod
    def on_device(cls, cu_seqlens: torch.Tensor, T: int) -> "VarlenIndex":
        """64-row tables of ``cu_seqlens`` for T packed tokens built by device ops only, for CUDA-graph capture: no
        host read, so a replay recomputes them from the offsets it finds in ``cu_seqlens`` (same N and T). The
        offsets are not checked (clamped into ``[0, T]`` and made non-decreasing instead: see ``_device_tables``);
        the tables carry padding rows (module docstring); ``bounds`` is None. Not cached."""
        offs, indices, first = _device_tables(cu_seqlens, int(T), SUB_CHUNK)
        return cls(cu_seqlens=offs, bounds=None, chunk_indices=indices, chunk_offsets=first, sub_indices=indices,
                   sub_offsets=first)

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, chunk_size: int, bounds: list[int] | None = None) -> "VarlenIndex":
        """The tables of ``cu_seqlens`` at chunks of ``chunk_size`` and of 64 rows (cached).

        Raises:
            ValueError: called while a CUDA graph is being captured (host tables would be those of the offsets at
                capture time; ops that can run on ``on_device`` tables take that path instead).
        """
        if _capturing():
            raise ValueError("`cu_seqlens` under CUDA-graph capture is not supported by this call: the index tables "
                             "come from the offsets at capture time, so a replay with other offsets would be wrong; "
                             "run it outside the graph (dense calls, and chunk_gated_delta_rule's forward without "
                             "gradients, can be captured)")
        bounds = cached_bounds(cu_seqlens) if bounds is None else bounds
        ci, co, si, so, order = _tables(tuple(bounds), (int(chunk_size), SUB_CHUNK), cu_seqlens.device)
        return cls(cu_seqlens=cu_seqlens, bounds=bounds, chunk_indices=ci, chunk_offsets=co, sub_indices=si,
                   sub_offsets=so, seq_order=order)
