"""Input checks shared by every tfla op: each raises ValueError/TypeError naming the argument."""
from __future__ import annotations

import torch

from tfla.ops.common.utils import CHUNK_SIZES, MAX_HEAD_DIM, SUPPORTED_DTYPES, check_device


def check_tensor(name: str, x, ndim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"`{name}` must have {ndim} dims, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"`{name}` must be a floating-point tensor, got {x.dtype}")


def check_qkv(q, k, v, grouped: bool) -> tuple[int, int, int, int, int, int]:
    """q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` with HV a multiple of H (``grouped``) or HV = H.
    Returns ``(B, T, H, HV, K, V)``."""
    check_tensor("q", q, 4)
    check_tensor("k", k, 4)
    check_tensor("v", v, 4)
    if q.shape != k.shape:
        raise ValueError(f"`q` and `k` must have the same shape [B, T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if grouped:
        if v.shape[:2] != (B, T):
            raise ValueError(f"`v` must be [B, T, HV, V] with B={B}, T={T}, got {tuple(v.shape)}")
        if H == 0 or v.shape[2] % H != 0:
            raise ValueError(f"`v` has HV={v.shape[2]} heads, which must be a positive multiple of the H={H} heads of q/k")
    elif v.shape[:3] != (B, T, H):
        raise ValueError(f"`v` must be [B, T, H, V] with (B, T, H) = {(B, T, H)}, got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if not (1 <= K <= MAX_HEAD_DIM and 1 <= V <= MAX_HEAD_DIM):
        raise ValueError(f"head dims must be in [1, {MAX_HEAD_DIM}], got K={K} (q/k) and V={V} (v)")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"`q` dtype must be one of float32/float16/bfloat16 (or float64), got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"`{name}` dtype {x.dtype} differs from `q` dtype {q.dtype}; q, k and v must share a dtype")
    return B, T, H, HV, K, V


def check_gate_dtype(name: str, x: torch.Tensor, q: torch.Tensor) -> None:
    """Gates may be float32 or q's dtype (float64 with float64 q)."""
    if x.dtype not in (q.dtype, torch.float32):
        raise TypeError(f"`{name}` dtype must be float32 or q's dtype ({q.dtype}), got {x.dtype}")
    if q.dtype == torch.float64 and x.dtype != torch.float64:
        raise TypeError(f"`{name}` must be float64 when q is float64, got {x.dtype}")


def check_common(q, named_tensors, scale, initial_state, cu_seqlens, chunk_size, state_shape,
                 state_names: str = "HV, K, V") -> None:
    """chunk_size, scale, devices, cu_seqlens and initial_state ``[N, *state_shape]``."""
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"`chunk_size` must be one of {CHUNK_SIZES}, got {chunk_size!r}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"`scale` must be a float or None, got {type(scale).__name__}")
    for name, x in named_tensors:
        check_device(name, x)
        if x.device != q.device:
            raise ValueError(f"`{name}` is on {x.device} but `q` is on {q.device}")
    N = q.shape[0]
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError("`cu_seqlens` must be a 1-D int32/int64 tensor of N + 1 sequence offsets")
        if cu_seqlens.device != q.device:
            raise ValueError(f"`cu_seqlens` is on {cu_seqlens.device} but `q` is on {q.device}")
        if q.shape[0] != 1:
            raise ValueError(f"with `cu_seqlens` the batch size must be 1 (sequences packed along T), got B={q.shape[0]}")
        if cu_seqlens.numel() < 2:
            raise ValueError("`cu_seqlens` must hold at least two offsets [0, ..., T]")
        N = cu_seqlens.numel() - 1
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"`initial_state` must be a torch.Tensor or None, got {type(initial_state).__name__}")
        if tuple(initial_state.shape) != (N, *state_shape):
            raise ValueError(f"`initial_state` must have shape [N, {state_names}] = {(N, *state_shape)}, "
                             f"got {tuple(initial_state.shape)}")
        if not initial_state.is_floating_point():
            raise TypeError(f"`initial_state` must be floating point, got {initial_state.dtype}")
        if initial_state.device != q.device:
            raise ValueError(f"`initial_state` is on {initial_state.device} but `q` is on {q.device}")


def check_varlen_bounds(bounds: list[int], T: int) -> None:
    if bounds[0] != 0 or bounds[-1] != T:
        raise ValueError(f"`cu_seqlens` must start at 0 and end at T={T}, got {bounds[0]} ... {bounds[-1]}")
    if any(b1 < b0 for b0, b1 in zip(bounds[:-1], bounds[1:])):
        raise ValueError("`cu_seqlens` must be non-decreasing")


def state_in_kv_layout(initial_state, state_v_first: bool):
    """FLA's ``state_v_first``: an initial state given as ``[N, HV, V, K]`` viewed as tfla's ``[N, HV, K, V]``
    (the final state goes back with ``.transpose(-1, -2)``). ValueError for a state that is not 4-D."""
    if not state_v_first or initial_state is None:
        return initial_state
    if not isinstance(initial_state, torch.Tensor) or initial_state.dim() != 4:
        raise ValueError("with `state_v_first`, `initial_state` must be a 4-D tensor [N, HV, V, K]")
    return initial_state.transpose(-1, -2)


def state_in_fla_layout(final_state, state_v_first: bool):
    """The final state ``[N, HV, K, V]`` returned as ``[N, HV, V, K]`` (contiguous) with FLA's ``state_v_first``."""
    if not state_v_first or final_state is None:
        return final_state
    return final_state.transpose(-1, -2).contiguous()


def host_bounds(cu_seqlens, cu_seqlens_cpu) -> list[int] | None:
    """The sequence offsets from FLA's ``cu_seqlens_cpu`` (a host copy of ``cu_seqlens``, trusted to hold the same
    values, as FLA does: comparing them would cost the device read it saves), or None when not given."""
    if cu_seqlens_cpu is None:
        return None
    if cu_seqlens is None:
        raise ValueError("`cu_seqlens_cpu` is the host copy of `cu_seqlens`: pass both")
    if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.device.type != "cpu" \
            or cu_seqlens_cpu.dim() != 1 or cu_seqlens_cpu.dtype not in (torch.int32, torch.int64) \
            or cu_seqlens_cpu.numel() != cu_seqlens.numel():
        raise ValueError("`cu_seqlens_cpu` must be a 1-D int32/int64 CPU tensor with as many offsets as `cu_seqlens`")
    return [int(x) for x in cu_seqlens_cpu.tolist()]


def check_cotangent(name: str, x: torch.Tensor, shape, dtype) -> None:
    """The cotangent autograd hands a backward for output ``name``: ``shape``, ``dtype`` (None: any), floating point.

    Raises:
        ValueError: wrong shape. TypeError: wrong or non-floating dtype.
    """
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"cotangent of `{name}` must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"cotangent of `{name}` must have dtype {dtype}, got {x.dtype}")
    if not x.is_floating_point():
        raise TypeError(f"cotangent of `{name}` must be floating point, got {x.dtype}")
