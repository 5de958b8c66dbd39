"""Host-side helpers shared by every tfla op: index tables for varlen, dtype/precision policy,
device checks.

Notation: B batch, T time, H heads, N sequences (B, or len(cu_seqlens) - 1 for varlen),
BT outer chunk (L, where states live), BS sub-chunk (64 rows, the UT/WY level).
"""
from __future__ import annotations

import functools
import itertools
import os

import torch

# log2(e): tfla keeps cumulative gates in log2 units so kernels use exp2 (one MUFU op).
RCP_LN2 = 1.4426950408889634

SUB_CHUNK = 64
CHUNK_SIZES = (64, 128, 256, 512)
MAX_HEAD_DIM = 256
# float64 is a verification dtype (float64 accumulation end to end, e.g. for gradcheck)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# Log decays below this (natural log) are raised to it by the chunk cumsum that first reads them
# (``chunk_local_cumsum(floor=..)``): e^-80 = 1.8e-35 is a state reset in fp32 like e^-1e4 or e^-inf, but the chunk
# sums keep the following rows' gates to ~1e-5 (fp32's spacing at 80): -1e4 left them ~1e-3 from their true
# differences, -inf made them NaN (-inf - -inf). The gradient of a floored g is that of the floor, whose terms all
# carry its e^-80 (zero up to rounding). NaN stays NaN.
LOG_DECAY_FLOOR = -80.0

# a per-(sequence, head) chunk count meaning "every chunk" (``fused_delta_fwd.piece_cutoffs``' tables: the kernels take
# min(their length, this x 64 rows), which stays below 2^31)
ALL_CHUNKS = 1 << 24


def next_pow2(x: int) -> int:
    return 1 << (max(int(x), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dot_tile(n: int, cap: int, dtype: torch.dtype) -> int:
    """Width of a head-dim tile that enters ``tl.dot``: the power of two covering ``n`` columns, at most ``cap``, at
    least 16, and at least 32 for 16-bit operands: 16-wide 16-bit tiles read shared memory out of bounds under
    Triton 3.6 on Hopper (H100, 2026-11-24: an illegal address in the UT transform at V = 16; GDN's dv and dbeta
    wrong at V = 16 and dk at K = 16, rel-L2 ~1, fp16 and bf16; masks cover the extra columns)."""
    low = 32 if dtype in (torch.float16, torch.bfloat16) else 16
    return max(low, min(max(16, next_pow2(n)), cap))


def interpret_mode() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision for fp32 inputs (irrelevant for 16-bit operands; Triton's default
    would be one TF32 product, ~1e-3 relative). On the GPU fp32 uses ``tf32x3`` (three TF32 tensor-core
    products, ~1e-6 relative): exact IEEE fp32 dots lower to unrolled FMA loops whose ptxas compile took
    minutes per kernel at head dim 256 (H200, Triton 3.6; docs/performance.md). float64 and the CPU
    interpreter use IEEE."""
    if dtype == torch.float64 or (dtype == torch.float32 and interpret_mode()):
        return "ieee"
    return "tf32x3" if dtype == torch.float32 else "tf32"


def acc_dtype(dtype: torch.dtype):
    """Accumulator dtype of the kernels: float64 for float64 inputs (verification, e.g. gradcheck), else fp32."""
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def on_input_device(fn):
    """Decorator of the public ops and their autograd backward: ``fn`` runs with the CUDA device of its first tensor
    argument current. Triton launches a kernel on the current device and its stream, whatever device the tensors
    are on, so a model spread over GPUs in one process (e.g. Hugging Face's ``device_map="auto"``) that calls a layer
    on cuda:1 while cuda:0 is current would launch on the wrong device; PyTorch's own ops follow their tensors, and
    so do FLA's (``input_guard``). Costs one device query per call where the devices agree; nothing while
    ``torch.compile`` traces (the compiled graph sets its device)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.compiler.is_compiling():
            x = next((a for a in itertools.chain(args, kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if x is not None and x.is_cuda and x.device.index != torch.cuda.current_device():
                with torch.cuda.device(x.device):
                    return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


class _NoGradCtx:
    """The ctx of an autograd Function's ``forward`` run outside autograd: what it saves for a backward is dropped."""

    def save_for_backward(self, *tensors) -> None:
        pass


def autograd_call(fn_cls: type[torch.autograd.Function]):
    """``fn_cls.apply``, except that a call that needs no gradient (grad mode off, or no tensor argument requiring
    grad) runs ``fn_cls.forward`` directly with a ctx that keeps nothing: the same outputs, no autograd node, and less
    host time (a GDN forward at B = 4, T = 8192, H = 16 with its launches stubbed: 132 -> ~88 us on this project's
    2-core CPU machines, torch 2.13, 2026-12-02). For Functions whose forward touches ctx only to save tensors and set
    attributes."""
    def call(*args):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return fn_cls.apply(*args)
        return fn_cls.forward(_NoGradCtx(), *args)

    call.__name__ = f"{fn_cls.__name__}.apply"
    return call


def check_device(name: str, t: torch.Tensor) -> None:
    """Kernels run on CUDA devices, or on the CPU through the Triton interpreter, there in float32 / float16 /
    float64 only: bfloat16 products come out overflowed there (Triton 3.9's interpreter, 2026-11-25: GDN, simple GLA
    and the LSTM against the same inputs in float32, rel-L2 4 to 1e11; float16 5e-4), so bfloat16 CPU tensors raise
    ValueError instead of returning such values."""
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and interpret_mode():
        if t.dtype == torch.bfloat16:
            raise ValueError(f"`{name}` is bfloat16 on the CPU: Triton's interpreter computes bfloat16 products "
                             "wrongly; use float32 or float16 there (bfloat16 runs on CUDA)")
        return
    raise ValueError(
        f"`{name}` is on device '{t.device}', but tfla's Triton kernels run on CUDA devices "
        "(or on the CPU only with TRITON_INTERPRET=1, for testing)"
    )


def seqlens_to_list(cu_seqlens: torch.Tensor) -> list[int]:
    """One host sync per call: every index table below is built from this list."""
    return [int(x) for x in cu_seqlens.tolist()]


def chunk_index_rows(bounds, chunk_size: int) -> list[tuple[int, int]]:
    """(sequence id, chunk index within that sequence) of every chunk of ``chunk_size`` tokens across the sequences
    delimited by ``bounds`` (cu_seqlens as a list)."""
    return [(n, i) for n in range(len(bounds) - 1) for i in range(cdiv(bounds[n + 1] - bounds[n], chunk_size))]


def chunk_offset_rows(bounds, chunk_size: int) -> list[int]:
    """Index of each sequence's first chunk of ``chunk_size`` tokens, and the total at the end (``N + 1`` ints)."""
    offs = [0]
    for n in range(len(bounds) - 1):
        offs.append(offs[-1] + cdiv(bounds[n + 1] - bounds[n], chunk_size))
    return offs


def prepare_chunk_indices(bounds: list[int], chunk_size: int, device) -> torch.Tensor:
    """``[NC, 2]`` int32 table of ``chunk_index_rows`` on ``device``."""
    rows = chunk_index_rows(bounds, chunk_size)
    if not rows:
        return torch.zeros((0, 2), dtype=torch.int32, device=device)
    return torch.tensor(rows, dtype=torch.int32, device=device)


def prepare_chunk_offsets(bounds: list[int], chunk_size: int, device) -> torch.Tensor:
    """``[N + 1]`` int32 ``chunk_offset_rows`` on ``device``."""
    return torch.tensor(chunk_offset_rows(bounds, chunk_size), dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=None)
def device_sm_count(index: int = 0) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(x: torch.Tensor) -> int:
    """SMs of ``x``'s CUDA device (cached per device); 132, an H100's, for CPU tensors (the interpreter), so launch
    choices that depend on it are the same there as on that GPU."""
    return device_sm_count(x.device.index or 0) if x.is_cuda else 132


def varlen_mode(cu_seqlens) -> int:
    """The kernels' ``IS_VARLEN``: 0 dense (None), 1 ``cu_seqlens`` of N + 1 offsets, 2 an ``[N, 2]`` table of (first
    row, end row) pairs in the packed rows (parts of sequences: the GDN backward's slabs; taken by
    ``chunk_state.chunk_state_fwd``, ``state_bwd_ws.delta_state_bwd_ws`` and ``chunk_dqkw_ws.gdn_bwd_chunk_ws``, whose
    kernels read sequences through ``_sequence_slots`` / ``_seq_rows``; other stages take offsets only)."""
    if cu_seqlens is None:
        return 0
    return 2 if cu_seqlens.dim() == 2 else 1


def num_sequences(cu_seqlens, B: int) -> int:
    """N: B dense, else the offsets' or the pairs' count (``varlen_mode``)."""
    if cu_seqlens is None:
        return B
    return cu_seqlens.shape[0] if cu_seqlens.dim() == 2 else cu_seqlens.numel() - 1


def host_ints(values, device, dtype=torch.int32) -> torch.Tensor:
    """A 1-D tensor of host ints on ``device`` without waiting for the device's queue: all equal (a dense batch's
    lengths) by a fill on the device, else from pinned host memory copied with ``non_blocking=True``. A plain
    ``torch.tensor(values, device=...)`` copies from pageable memory, which waits until every kernel queued before it
    has finished (the RNN cells' backward built its row lengths so, and the GPU idled while the host then launched
    the backward's kernels)."""
    values = list(values)
    device = torch.device(device)
    if len(set(values)) <= 1:
        return torch.full((len(values),), values[0] if values else 0, dtype=dtype, device=device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
