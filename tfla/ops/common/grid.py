"""Launch grids that cannot outgrow CUDA's limits.

CUDA allows 2^31 - 1 programs on grid axis 0 but only 65,535 on axes 1 and 2. tfla's kernels launch on a
2-D or 3-D grid (innermost dimension first: value or column tiles, then row tiles, then batch x heads) while
it fits, and on a 1-D grid of the same programs in the same order when it does not (``tile_grid``): the
kernel then splits ``tl.program_id(0)`` back (``program_tile``, ``program_rows``, ``program_pair``, with
``FLAT`` set). The split costs a few integer divisions per program, measured at up to 6% of the tiled kernel's
time on an H200 (docs/performance.md), hence only where needed. Program ids are int64 either way.
"""
from __future__ import annotations

import math

import triton
import triton.language as tl

MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535


def flat_grid(*dims: int) -> tuple[int]:
    """``(prod(dims),)`` for a kernel that splits its program id back into ``dims`` (first = innermost).

    Raises:
        ValueError: the product passes CUDA's 2^31 - 1 programs on grid axis 0 (the input is too large
            for one launch).
    """
    n = math.prod(int(d) for d in dims)
    if n > MAX_GRID_X:
        raise ValueError(f"the launch needs {n} programs ({' x '.join(str(d) for d in dims)}), more than CUDA's "
                         f"limit of {MAX_GRID_X} on grid axis 0: split the input (fewer tokens or heads per call)")
    return (n,)


def tile_grid(*dims: int, force_flat: bool = False) -> tuple[tuple[int, ...], bool]:
    """``(grid, flat)``: ``dims`` as they are when every axis is within CUDA's limits, else ``flat_grid(*dims)``
    and ``flat = True`` (the kernel's ``FLAT``; ``force_flat``: always, the stages' config key ``flat``, which
    lets tests run the flat form at small sizes). Raises as ``flat_grid``."""
    dims = tuple(int(d) for d in dims)
    if not force_flat and dims[0] <= MAX_GRID_X and all(d <= MAX_GRID_YZ for d in dims[1:]):
        return dims, False
    return flat_grid(*dims), True


def check_varlen_batch(batch: int, cu_seqlens) -> None:
    """Packed sequences (``cu_seqlens``) come with B = 1: the flat grids of varlen launches assume it.

    Raises:
        ValueError: ``cu_seqlens`` given with a batch size other than 1.
    """
    if cu_seqlens is not None and batch != 1:
        raise ValueError(f"with `cu_seqlens` the batch size must be 1 (sequences packed along T), got B={batch}")


def needs_int64(*numels: int) -> bool:
    """Whether an offset into a tensor of one of these element counts (or a product of a sequence position and a
    row stride reaching that far) can pass 2^31 - 1: the kernels' ``IDX64``."""
    return max(int(n) for n in numels) >= 2**31


@triton.jit
def program_tile(T, NI: tl.constexpr, BR: tl.constexpr, HV: tl.constexpr, IS_VARLEN: tl.constexpr,
                 FLAT: tl.constexpr):
    """(inner tile, row tile, batch x head) of this program, int64, on a grid ``(NI, NR, B*HV)`` (``tile_grid``):
    NR = cdiv(T, BR) row tiles per sequence, or with varlen (B = 1) the rows of the (sequence, tile) table, which
    the flat grid's size gives."""
    if FLAT:
        pid = tl.program_id(0)  # < 2^31: the split runs in 32 bits
        if IS_VARLEN:
            NR = tl.num_programs(0) // (NI * HV)
        else:
            NR = tl.cdiv(T, BR)
        i_r = pid // NI
        return (pid % NI).to(tl.int64), (i_r % NR).to(tl.int64), (i_r // NR).to(tl.int64)
    else:
        return tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)


@triton.jit
def program_rows(T, BR: tl.constexpr, HV: tl.constexpr, IS_VARLEN: tl.constexpr, FLAT: tl.constexpr):
    """(row tile, batch x head) of this program, int64, on a grid ``(NR, B*HV)`` (as ``program_tile`` with NI = 1)."""
    if FLAT:
        _, i_r, i_bh = program_tile(T, 1, BR, HV, IS_VARLEN, True)
    else:
        i_r, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    return i_r, i_bh


@triton.jit
def ordered_row(i_nh, seq_order, HV: tl.constexpr, ORDERED: tl.constexpr):
    """The (sequence x value head) row a chain kernel's program row ``i_nh`` runs: with ORDERED, sequence
    ``seq_order[i_nh // HV]`` (``varlen.longest_first_order``: the longest sequences' programs start first), else
    ``i_nh`` itself."""
    if ORDERED:
        return tl.load(seq_order + i_nh // HV).to(tl.int64) * HV + i_nh % HV
    else:
        return i_nh


@triton.jit
def program_pair(NI: tl.constexpr, FLAT: tl.constexpr):
    """(inner, outer) index of this program, int64, on a grid ``(NI, N)``."""
    if FLAT:
        pid = tl.program_id(0)
        return (pid % NI).to(tl.int64), (pid // NI).to(tl.int64)
    else:
        return tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)


@triton.jit
def chunk_rows(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN: tl.constexpr):
    """``(i_c, bos, T)`` of a (chunk, batch) program: its chunk within the sequence, the sequence's first row and its
    length. With ``IS_VARLEN`` (B = 1) ``i_t`` is a row of the ``[NC, 2]`` (sequence, chunk) table ``chunk_indices``
    and the sequence's rows come from ``cu_seqlens``; else chunk ``i_t`` of batch row ``i_b`` of T rows."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        i_c = i_t
        bos = i_b * T
    return i_c, bos, T
