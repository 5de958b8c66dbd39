"""Gated DeltaNet decode: one fused recurrent kernel (``tfla.fused_recurrent_gated_delta_rule``), forward only.

Notation: B batch, T time (tokens per sequence, or all packed tokens with ``cu_seqlens``), H key heads, HV value
heads (HV = H * groups), K/V head dims, N sequences, S state-index columns (1 + speculative tokens), BK/BV tiles.

Per value head, state ``S [K, V]`` in fp32 registers (float64 for float64 inputs):
``S_t = e^{g_t} S_{t-1} + k_t beta_t (v_t - e^{g_t} S_{t-1}^T k_t)^T``, ``o_t = scale S_t^T q_t``.
One program per (sequence, value head, value tile of BV columns) loops over its sequence's tokens: a decode step
(T = 1) or a few speculative tokens. The launch depends on shapes only (grid ``V/BV x N*HV``, flattened past CUDA's
axis limits), and nothing is read back to the host, so a call can be captured in a CUDA graph (the GPU test
``test_cuda_graph_decode_with_pool``: replay equal to eager; ``tfla bench decode`` times the replays). A program
loads its first token's inputs before its slot index and state (independent of them): one memory round trip less per
program (H200, graph time, B = 64: 78.6 -> 72.2 us;
``docs/performance.md``, "Decode: the token's inputs loaded before the state").

State pool (vLLM / SGLang): with ``ssm_state_indices`` the states live in a pool ``[slots, HV, K, V]`` (the
``initial_state`` argument); sequence n starts from slot ``idx[n, num_accepted_tokens[n] - 1]`` (column 0 without
``num_accepted_tokens``) and, with ``inplace_final_state``, writes the state after its token t to slot ``idx[n, t]``
(2-D indices) or its final state to slot ``idx[n]`` (1-D). A start slot outside ``[0, slots)`` (padding: < 0)
skips the sequence: no read, no write, zero outputs; a write slot outside it skips that write. The kernel clamps
the column ``num_accepted_tokens[n] - 1`` into ``[0, S - 1]`` and varlen offsets into ``[0, T]``: device-side
values are never checked on the host, but nothing is read or written outside the tensors.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from tfla.ops.common.grid import program_pair, tile_grid
from tfla.ops.common.l2norm import l2norm
from tfla.ops.common.utils import (SUB_CHUNK, acc_dtype, autograd_call, cdiv, next_pow2, on_input_device,
                                   seqlens_to_list, sm_count)
from tfla.ops.gated_delta_rule.chunk import _fla_options
from tfla.utils.validation import (
    check_common,
    check_gate_dtype,
    check_qkv,
    check_tensor,
    check_varlen_bounds,
)

# launch keys of ``config``: value-tile width and warps (the state tile is BK x BV fp32 registers per program)
CONFIG_KEYS = ("BV", "num_warps")


@triton.jit
def _in_pool(o, i_slot, n_slots):
    """Whether slot ``i_slot`` lies in ``[0, n_slots)``, as a block like ``o`` (block masks, not scalar ones: the
    interpreter rejects a block mask combined with a scalar one)."""
    b_s = o.to(tl.int64) * 0 + i_slot
    return (b_s >= 0) & (b_s < n_slots)


@triton.jit
def _token_inputs(q, k, v, g, beta, row, live, i_h, i_hv, o_k, o_v, m_k, m_v, H: tl.constexpr, HV: tl.constexpr,
                  K: tl.constexpr, V: tl.constexpr, USE_G: tl.constexpr, USE_BETA: tl.constexpr, ACC: tl.constexpr):
    """Row ``row``'s q, k ``[BK]`` (key head i_h of H), v ``[BV]``, beta and the gate's factor ``e^g`` (value head i_hv
    of HV; 1 without ``USE_G`` / ``USE_BETA``), zeros where ``live`` is false (a row outside the sequence: loaded ahead
    of its use, never used). Shared by the decode kernels (``tfla/ops/simple_gla/fused_recurrent.py``: HV = H, no
    beta)."""
    m_tk = m_k & (o_k * 0 + live.to(tl.int32) > 0)
    m_tv = m_v & (o_v * 0 + live.to(tl.int32) > 0)
    b_q = tl.load(q + (row * H + i_h) * K + o_k, mask=m_tk, other=0.0).to(ACC)
    b_k = tl.load(k + (row * H + i_h) * K + o_k, mask=m_tk, other=0.0).to(ACC)
    b_v = tl.load(v + (row * HV + i_hv) * V + o_v, mask=m_tv, other=0.0).to(ACC)
    b_one = tl.full((), 1.0, ACC)
    if USE_BETA:
        b_beta = tl.load(beta + row * HV + i_hv, mask=live, other=0.0).to(ACC)
    else:
        b_beta = b_one
    if USE_G:
        b_eg = tl.exp(tl.load(g + row * HV + i_hv, mask=live, other=0.0).to(ACC))
    else:
        b_eg = b_one
    return b_q, b_k, b_v, b_beta, b_eg


@triton.jit(do_not_specialize=["T", "n_slots"])
def _gdn_fused_recurrent_fwd_kernel(
    q, k, v, g, beta, o, h0, ht, cu_seqlens, state_idx, num_acc,
    scale, T, n_slots,
    s_h0_n, s_h0_h, s_h0_k, s_h0_v,
    s_ht_n, s_ht_h, s_ht_k, s_ht_v,
    s_idx_n, s_idx_s, s_acc,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, NS: tl.constexpr,
    USE_G: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr,
    USE_IDX: tl.constexpr, SPEC: tl.constexpr, USE_ACC: tl.constexpr, INPLACE: tl.constexpr, FLAT: tl.constexpr,
    ACC: tl.constexpr,
):
    i_v, i_nh = program_pair(NV, FLAT)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:  # offsets clamped into [0, T]: a malformed cu_seqlens reads nothing outside the tensors
        eos = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_n + 1).to(tl.int64), 0), T)
        bos = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_n).to(tl.int64), 0), eos)
    else:
        bos = i_n * T
        eos = bos + T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]

    # the first token's inputs go out before the slot's and the state's loads (they do not depend on them): at T =
    # 1 the state's load then waits on the slot's alone, not on the inputs' round trip too
    b_q, b_k, b_v, b_beta, b_eg = _token_inputs(q, k, v, g, beta, bos, bos < eos, i_h, i_hv, o_k, o_v, m_k, m_v,
                                                H, HV, K, V, USE_G, True, ACC)

    # the slot this sequence starts from (the pool's row; the sequence itself without indices)
    if USE_IDX:
        if USE_ACC:
            i_c = tl.load(num_acc + i_n * s_acc).to(tl.int64) - 1
            i_c = tl.minimum(tl.maximum(i_c, 0), NS - 1)
        else:
            i_c = i_n * 0
        i_slot = tl.load(state_idx + i_n * s_idx_n + i_c * s_idx_s).to(tl.int64)
        m_lk, m_lv = _in_pool(o_k, i_slot, n_slots), _in_pool(o_v, i_slot, n_slots)  # [BK], [BV]: live or not
    else:
        i_slot = i_n
        m_lk, m_lv = o_k >= 0, o_v >= 0

    b_h = tl.zeros([BK, BV], dtype=ACC)  # [BK, BV]
    if USE_H0:
        p_h0 = h0 + i_slot * s_h0_n + i_hv * s_h0_h + o_k[:, None] * s_h0_k + o_v[None, :] * s_h0_v
        b_h += tl.load(p_h0, mask=m_h & m_lk[:, None], other=0.0).to(ACC)

    for i_t in range(0, eos - bos):
        row = bos + i_t
        if USE_G:
            b_h = b_h * b_eg
        b_u = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))  # [BV]
        b_h = b_h + b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0) * scale  # [BV]
        b_o = tl.where(m_lv, b_o, 0.0)
        tl.store(o + (row * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if INPLACE:
            if SPEC:  # the state after token i_t goes to slot idx[n, i_t] (tokens past the S columns: not kept)
                i_w = tl.load(state_idx + i_n * s_idx_n + tl.minimum(i_t, NS - 1) * s_idx_s).to(tl.int64)
                m_w = m_lk & _in_pool(o_k, i_w, n_slots) & (o_k * 0 + i_t < NS)  # [BK]
                p_w = ht + i_w * s_ht_n + i_hv * s_ht_h + o_k[:, None] * s_ht_k + o_v[None, :] * s_ht_v
                tl.store(p_w, b_h.to(ht.dtype.element_ty), mask=m_h & m_w[:, None])
        # the next token's inputs (speculative decode, prefill), loaded after this token's products: loaded at the
        # loop's top, ahead of them, they kept 162 registers live instead of 128 (6 programs per SM instead of 8)
        b_q, b_k, b_v, b_beta, b_eg = _token_inputs(q, k, v, g, beta, row + 1, row + 1 < eos, i_h, i_hv, o_k, o_v,
                                                    m_k, m_v, H, HV, K, V, USE_G, True, ACC)

    if STORE_HT:
        if INPLACE:
            if not SPEC:  # the final state back into the slot it came from
                p_w = ht + i_slot * s_ht_n + i_hv * s_ht_h + o_k[:, None] * s_ht_k + o_v[None, :] * s_ht_v
                tl.store(p_w, b_h.to(ht.dtype.element_ty), mask=m_h & m_lk[:, None])
        else:
            p_w = ht + i_n * s_ht_n + i_hv * s_ht_h + o_k[:, None] * s_ht_k + o_v[None, :] * s_ht_v
            tl.store(p_w, tl.where(m_lk[:, None], b_h, 0.0).to(ht.dtype.element_ty), mask=m_h)


def launch_config(V: int, config: dict | None = None, pairs: int = 0, sms: int = 132) -> dict:
    """``BV`` (value columns per program) and ``num_warps`` for ``pairs`` (sequence x value head) programs per value
    tile on ``sms`` SMs: 32 columns on 2 warps where ``pairs * ceil(V / 32)`` fills two programs per SM, else 8 on
    one warp (FLA's and vLLM's tile: a K = 128 state tile is 32 fp32 registers per thread, and small batches get
    more programs). ``config`` overrides either, and ``flat: True`` forces the flat grid
    (``tfla/ops/common/grid.py``; for tests).

    H100, torch 2.11, Triton 3.6, H = 16, HV = 32, K = V = 128, bf16, fp32 states, T = 1, median ``do_bench``
    (2026-11-24): B = 64 sequences 116.1 us at 8 / 1 warp, 98.0 at 32 / 2 (reading and writing every state once at
    ~3.35 TB/s: 80 us), 99.5 at 32 / 1, 98.9 at 64 / 4, 102.3 at 16 / 2; B = 256 441.9 / 375.0 (floor 320 us),
    366.0 at 64 / 2; from a pool of 2B slots (``ssm_state_indices``, in place) B = 64 124.5 / 102.9, B = 256
    474.4 / 389.8. At B = 1 and 8 the call is bound by its launch (18-135 us in any tiling, noisy)."""
    wide = pairs * cdiv(V, 32) >= 2 * sms
    cfg = {"BV": min(32, next_pow2(V)), "num_warps": 2} if wide else {"BV": min(8, next_pow2(V)), "num_warps": 1}
    cfg.update(config or {})
    return cfg


def fused_recurrent_gated_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    inplace_final_state: bool = False,
    state_v_first: bool = False,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain forward, no checks (``fused_recurrent_gated_delta_rule`` validates): q, k, v, g, beta contiguous,
    ``initial_state`` in tfla's ``[slots, HV, K, V]`` index order (any strides: a V-first pool is its transposed
    view). Returns ``(o [B, T, HV, V] in q's dtype, final_state)``: with ``inplace_final_state`` the states are
    written into ``initial_state`` and final_state is None; else ``[N, HV, K, V]`` fp32 (``[N, HV, V, K]`` with
    ``state_v_first``; float64 for float64 inputs) or None."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    spec = ssm_state_indices is not None and ssm_state_indices.dim() == 2  # a slot per token, not per sequence
    if ssm_state_indices is not None and ssm_state_indices.dim() == 1:
        ssm_state_indices = ssm_state_indices[:, None]
    NS = ssm_state_indices.shape[1] if ssm_state_indices is not None else 1
    cfg = launch_config(V, config, N * HV, sm_count(q))
    BK, BV = next_pow2(K), cfg["BV"]
    NV = cdiv(V, BV)
    o = torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device)
    ht = None
    if inplace_final_state:
        ht = initial_state
    elif output_final_state:
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        if state_v_first:  # allocated V-first, written through strides
            ht = torch.empty(N, HV, V, K, dtype=acc, device=q.device).transpose(-1, -2)
        else:
            ht = torch.empty(N, HV, K, V, dtype=acc, device=q.device)
    if N * HV == 0 or o.numel() == 0 and ht is None:
        return o, (None if inplace_final_state or ht is None else _user_layout(ht, state_v_first))
    dummy = o  # stands in for absent pointers (never dereferenced: their constexpr flags are off)
    s_h0 = initial_state.stride() if initial_state is not None else (0, 0, 0, 0)
    s_ht = ht.stride() if ht is not None else (0, 0, 0, 0)
    grid, flat = tile_grid(NV, N * HV, force_flat=bool(cfg.get("flat", False)))
    _gdn_fused_recurrent_fwd_kernel[grid](
        q, k, v, g if g is not None else dummy, beta, o,
        initial_state if initial_state is not None else dummy, ht if ht is not None else dummy,
        cu_seqlens if cu_seqlens is not None else dummy,
        ssm_state_indices if ssm_state_indices is not None else dummy,
        num_accepted_tokens if num_accepted_tokens is not None else dummy,
        scale, T, initial_state.shape[0] if initial_state is not None else 0,
        *s_h0, *s_ht,
        ssm_state_indices.stride(0) if ssm_state_indices is not None else 0,
        ssm_state_indices.stride(1) if ssm_state_indices is not None else 0,
        num_accepted_tokens.stride(0) if num_accepted_tokens is not None else 0,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, NV=NV, NS=NS,
        USE_G=g is not None, USE_H0=initial_state is not None, STORE_HT=ht is not None,
        IS_VARLEN=cu_seqlens is not None, USE_IDX=ssm_state_indices is not None, SPEC=spec,
        USE_ACC=num_accepted_tokens is not None, INPLACE=bool(inplace_final_state), FLAT=flat,
        ACC=acc_dtype(q.dtype),
        num_warps=cfg["num_warps"],
    )
    if inplace_final_state or ht is None:
        return o, None
    return o, _user_layout(ht, state_v_first)


def _user_layout(ht: torch.Tensor, state_v_first: bool) -> torch.Tensor:
    return ht.transpose(-1, -2) if state_v_first else ht


@dataclasses.dataclass(frozen=True)
class FusedRecurrentOptions:
    """Non-tensor arguments of one call."""

    scale: float
    output_final_state: bool
    inplace_final_state: bool
    state_v_first: bool
    config: dict | None = dataclasses.field(default=None, compare=False, hash=False)


class FusedRecurrentGatedDeltaRuleFunction(torch.autograd.Function):
    """Forward only, as FLA's fused recurrent op: its backward raises NotImplementedError."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                opts: FusedRecurrentOptions):
        return fused_recurrent_gated_delta_rule_fwd(
            q, k, v, g, beta, opts.scale, initial_state, opts.output_final_state, cu_seqlens, ssm_state_indices,
            num_accepted_tokens, opts.inplace_final_state, opts.state_v_first, opts.config)

    @staticmethod
    @on_input_device
    def backward(ctx, do, dht):
        raise NotImplementedError(
            "fused_recurrent_gated_delta_rule is forward-only (a decode kernel keeps no per-token states); "
            "use tfla.chunk_gated_delta_rule for training")


def _check_index(name: str, x, q: torch.Tensor, N: int, ndims: tuple[int, ...]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"`{name}` must be an int32/int64 tensor, got {x.dtype}")
    if x.dim() not in ndims or x.shape[0] != N or (x.dim() == 2 and x.shape[1] < 1):
        want = " or ".join(("[N]", "[N, 1 + num_speculative]")[d - 1] for d in ndims)
        raise ValueError(f"`{name}` must have shape {want} with N = {N} sequences, got {tuple(x.shape)}")
    if x.device != q.device:
        raise ValueError(f"`{name}` is on {x.device} but `q` is on {q.device}")


def check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                 inplace_final_state, host_values: bool = True) -> None:
    """Validate a ``fused_recurrent_gated_delta_rule`` call (``initial_state`` in ``[*, HV, K, V]`` index order);
    raises ValueError/TypeError naming the argument. Values of index tensors and ``cu_seqlens``: ``check_host_values``
    where ``host_values`` (off while torch.compile traces: the custom op's body checks them then)."""
    B, T, H, HV, K, V = check_qkv(q, k, v, grouped=True)
    named = [("q", q), ("k", k), ("v", v), ("beta", beta)]
    for name, x in (("g", g), ("beta", beta)):
        if x is None:
            continue
        check_tensor(name, x, 3)
        if x.shape != (B, T, HV):
            raise ValueError(f"`{name}` must have shape [B, T, HV] = {(B, T, HV)}, got {tuple(x.shape)}")
        check_gate_dtype(name, x, q)
        if name == "g":
            named.append((name, x))
    # chunk_size is not an argument of this op: the shared check is given a valid one
    check_common(q, named, scale, None, cu_seqlens, SUB_CHUNK, (HV, K, V))
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if not isinstance(inplace_final_state, bool):
        raise TypeError(f"`inplace_final_state` must be a bool, got {type(inplace_final_state).__name__}")
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"`initial_state` must be a torch.Tensor or None, got {type(initial_state).__name__}")
        if not initial_state.is_floating_point():
            raise TypeError(f"`initial_state` must be floating point, got {initial_state.dtype}")
        if initial_state.device != q.device:
            raise ValueError(f"`initial_state` is on {initial_state.device} but `q` is on {q.device}")
        pool = ssm_state_indices is not None  # any number of slots
        if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != (HV, K, V) \
                or (not pool and initial_state.shape[0] != N):
            what = f"[slots, HV, K, V] = (*, {HV}, {K}, {V})" if pool else f"[N, HV, K, V] = {(N, HV, K, V)}"
            raise ValueError(f"`initial_state` must have shape {what} (the same transposed with `state_v_first`), "
                             f"got {tuple(initial_state.shape)}")
    elif inplace_final_state:
        raise ValueError("`inplace_final_state=True` needs `initial_state`: the state pool written in place")
    if ssm_state_indices is not None:
        _check_index("ssm_state_indices", ssm_state_indices, q, N, (1, 2))
        if initial_state is None:
            raise ValueError("`ssm_state_indices` index a state pool: pass it as `initial_state` [slots, HV, K, V]")
    if num_accepted_tokens is not None:
        if ssm_state_indices is None:
            raise ValueError("`num_accepted_tokens` needs `ssm_state_indices` (the slots it selects from)")
        _check_index("num_accepted_tokens", num_accepted_tokens, q, N, (1,))
    if host_values:
        check_host_values(T, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens)


def check_host_values(T: int, pool, cu_seqlens, ssm_state_indices, num_accepted_tokens) -> None:
    """The values of ``cu_seqlens``, ``ssm_state_indices`` (< the slots of ``pool``, the initial state) and
    ``num_accepted_tokens`` (in ``[1, S]``, S the index columns), for each of them that is on the host (CPU): device
    tensors are never read back. Called by ``check_inputs`` in eager calls and by the custom ops' bodies under
    ``torch.compile`` (which run on the real tensors); raises ValueError naming the argument."""
    if cu_seqlens is not None and cu_seqlens.device.type == "cpu":
        check_varlen_bounds(seqlens_to_list(cu_seqlens), T)
    if ssm_state_indices is not None and ssm_state_indices.device.type == "cpu" and ssm_state_indices.numel() \
            and int(ssm_state_indices.max()) >= pool.shape[0]:
        raise ValueError(f"`ssm_state_indices` must be < the {pool.shape[0]} slots of `initial_state` "
                         f"(< 0: padding), got max {int(ssm_state_indices.max())}")
    if num_accepted_tokens is not None and num_accepted_tokens.device.type == "cpu" and num_accepted_tokens.numel():
        S = ssm_state_indices.shape[1] if ssm_state_indices.dim() == 2 else 1
        if int(num_accepted_tokens.min()) < 1 or int(num_accepted_tokens.max()) > S:
            raise ValueError(f"`num_accepted_tokens` must lie in [1, {S}] (1 + num_speculative, the columns of "
                             f"`ssm_state_indices`), got {num_accepted_tokens.tolist()}")


@on_input_device
def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    *,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    inplace_final_state: bool = False,
    transpose_state_layout: bool | None = None,
    config: dict | None = None,
):
    r"""Gated delta rule (Gated DeltaNet), step by step in one fused kernel: decoding and speculative decoding.

    Recurrence per value head (Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule",
    arXiv 2412.06464, 2024 / ICLR 2025, Eq. 10, the gated delta rule; ``docs/gdn-math.md``):
    ``S_t = e^{g_t} S_{t-1} + k_t beta_t (v_t - e^{g_t} S_{t-1}^T k_t)^T``, ``o_t = scale S_t^T q_t``, with the
    state ``S [K, V]`` accumulated in fp32. A drop-in for FLA 0.6.0's ``fused_recurrent_gated_delta_rule`` (same
    names, order and layout), plus vLLM's / SGLang's state-pool arguments (keyword-only). Same results as
    ``tfla.chunk_gated_delta_rule`` up to rounding, so a prefill by the chunk op continues exactly with this op.

    Args:
        q: queries ``[B, T, H, K]``; fp32, fp16 or bf16 (float64 for verification).
        k: keys ``[B, T, H, K]``, q's dtype.
        v: values ``[B, T, HV, V]``, q's dtype; HV a multiple of H (value head j reads key head ``j // (HV // H)``).
        g: log forget gate (natural log, ``<= 0``) ``[B, T, HV]``, fp32 or q's dtype; None: no decay.
        gk, gv: FLA's key- / value-wise decays: not supported, anything but None raises ValueError.
        beta: write strength ``[B, T, HV]``, fp32 or q's dtype; None: ones (as FLA).
        scale: query scale; default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (any float dtype, read as fp32; ``[N, HV, V, K]`` with
            ``state_v_first``); N = B, or the number of sequences with ``cu_seqlens``. With ``ssm_state_indices``
            the state pool ``[slots, HV, K, V]`` (any number of slots).
        output_final_state: also return the final state (ignored with ``inplace_final_state``).
        use_qk_l2norm_in_kernel: L2-normalise q and k (``x / sqrt(sum x^2 + 1e-6)``) first (one Triton pass each).
        use_gate_in_kernel, A_log, dt_bias: g holds pre-activations and the log decay is
            ``-exp(A_log) softplus(g + dt_bias)`` (A_log, dt_bias ``[HV]``; dt_bias optional): FLA's GDN gate, a
            PyTorch op on ``[B, T, HV]`` before the kernel, as in ``tfla.chunk_gated_delta_rule``.
        use_beta_sigmoid_in_kernel: beta holds pre-activations, ``sigmoid(beta)`` is used;
            ``allow_neg_eigval``: with it, ``2 sigmoid(beta)``.
        state_v_first: initial and final states (and the pool) in the ``[.., HV, V, K]`` layout, read and written
            through strides (no copy). ``transpose_state_layout`` (keyword-only): its deprecated name.
        cu_seqlens: ``[N + 1]`` int offsets of N packed sequences (B = 1); empty sequences allowed. Checked only
            when on the CPU; on the GPU the kernel clamps them into ``[0, T]``.
        ssm_state_indices (keyword-only): int32/int64 ``[N]`` or ``[N, 1 + num_speculative]``, slots of the pool
            ``initial_state``. Sequence n starts from slot ``idx[n, 0]`` (``idx[n]`` for 1-D), or from
            ``idx[n, num_accepted_tokens[n] - 1]``. An index < 0 is a padding slot: a sequence whose start slot is
            < 0 (or, on the device, >= slots) is skipped: nothing read or written, its outputs zero.
        num_accepted_tokens (keyword-only): int32/int64 ``[N]`` in ``[1, 1 + num_speculative]``: tokens accepted
            in the previous speculative step (selects the start slot; clamped into range in the kernel).
        inplace_final_state (keyword-only): write the states into ``initial_state`` in place: with 2-D
            ``ssm_state_indices`` the state after token t of sequence n to slot ``idx[n, t]`` (tokens past the
            columns are not kept; slots < 0 skipped), with 1-D indices (or none) the final state to the slot read.
            Other slots are untouched.
        config (keyword-only): launch overrides ``{"BV": value tile, "num_warps": int}``; results equal up to
            rounding (the warps' split of the K sums changes their order: not bitwise the same).

    Returns:
        ``o [B, T, HV, V]`` in q's dtype (zeros for skipped sequences), and ``final_state``: with
        ``inplace_final_state`` the pool ``initial_state`` itself (written in place); else ``[N, HV, K, V]`` fp32
        (``[N, HV, V, K]`` with ``state_v_first``; zeros for skipped sequences) if ``output_final_state``, else None.

    Raises:
        TypeError / ValueError naming the argument: wrong types, ranks, shapes or dtypes; head dims above 256;
        ``gk`` / ``gv`` given; ``g`` None with ``use_gate_in_kernel``; A_log / dt_bias misuse;
        ``allow_neg_eigval`` without ``use_beta_sigmoid_in_kernel``; malformed host ``cu_seqlens``; index tensors
        of the wrong shape or dtype; ``ssm_state_indices`` without a pool or (on the host) reaching past its slots;
        ``num_accepted_tokens`` without ``ssm_state_indices`` or (on the host) outside ``[1, 1 + num_speculative]``;
        ``inplace_final_state`` without ``initial_state``. NotImplementedError in backward: the op is forward-only,
        as FLA's.

    No host reads of device tensors and a grid fixed by the shapes, for CUDA-graph capture (a replay equals eager
    calls on an H100: ``test_cuda_graph_decode_with_pool``).
    """
    if gk is not None or gv is not None:
        raise ValueError("`gk` / `gv` (key- / value-wise decays) are not supported by tfla; pass None")
    if use_gate_in_kernel and g is None:
        raise ValueError("`g` (the gate's pre-activations) must be given with `use_gate_in_kernel=True`")
    if beta is None and isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and v.dim() == 4:
        beta = torch.ones(v.shape[:3], dtype=q.dtype, device=q.device)
    user_state = initial_state
    q, k, v, g, beta, initial_state, state_v_first, _ = _fla_options(
        q, k, v, g, beta, initial_state, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, None,
        use_gate_in_kernel, A_log, dt_bias, transpose_state_layout)
    compiling = torch.compiler.is_compiling()  # then one custom op (library.py), no host reads
    check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                 inplace_final_state, host_values=not compiling)
    if config is not None and (not isinstance(config, dict) or not set(config) <= set(CONFIG_KEYS) or not all(
            isinstance(c, int) and c > 0 and c & (c - 1) == 0 for c in config.values())):
        raise ValueError(f"`config` must be a dict with keys among {CONFIG_KEYS} and powers of two as values, "
                         f"got {config!r}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    g = g.contiguous() if g is not None else None
    opts = FusedRecurrentOptions(float(scale), bool(output_final_state), inplace_final_state, bool(state_v_first),
                                 config)
    if compiling:
        from tfla.ops.gated_delta_rule.library import fused_recurrent_fwd, fused_recurrent_inplace

        if inplace_final_state:
            o = fused_recurrent_inplace(q, k, v, g, beta, user_state, cu_seqlens, ssm_state_indices,
                                        num_accepted_tokens, opts.scale, opts.state_v_first)
            return o, user_state
        o, final_state = fused_recurrent_fwd(q, k, v, g, beta, initial_state, cu_seqlens, ssm_state_indices,
                                             num_accepted_tokens, opts.scale, opts.output_final_state,
                                             opts.state_v_first)
        return o, final_state if opts.output_final_state else None
    args = (q, k, v, g, beta, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens, opts)
    # decode: no autograd node where no gradient is needed (host time per step); else its backward raises
    o, final_state = autograd_call(FusedRecurrentGatedDeltaRuleFunction)(*args)
    if inplace_final_state:
        return o, user_state
    return o, final_state
