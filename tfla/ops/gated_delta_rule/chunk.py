"""Two-level tiled Gated DeltaNet (TFLA-GDN): host orchestration, input checks, public op.

Notation: B batch, T time, H key heads, HV value heads, K/V head dims, N sequences; every stage works on 64-row
chunks (``SUB_CHUNK``; states live every 64 tokens).

Forward (``tfla/ops/common/fused_delta_fwd.py``): a prep pass per 64-row chunk (G = cumsum(g) in log2 units,
Tm = (I + A)^-1), then one fused pass per (sequence or segment, value head, value tile) with the state on chip that
writes o, the final state and what the backward keeps (Vnew by default, the 64-row states with ``save_states``);
long sequences are cut into segments joined by an exact scan (``segments``).

Backward (``chunk_gated_delta_rule_bwd``): the states at every 64 rows recomputed (or kept), the state-gradient
recurrence (in the forward's pieces when it cut a sequence and kept its states), dq / dk and the WY backward's state
terms from one read of the states and their gradients (``chunk_dqkw``), then the UT/WY backward.

Outer chunks larger than 64 rows (TFLA's two-level tiling, ``chunk_size`` 128 to 512) were dropped for this op on
2026-11-24: slower (fwd+bwd 3.544 vs 3.147 ms at L = 128, H100, before the fused forward), more memory (1478 vs 1358
MiB) and, with the fused forward, less precise in bf16 (1.1-1.3x the better peer's error at L = 512 with Qwen3-Next
gates): README of this op, docs/performance.md.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from tfla.ops.common import precompile
from tfla.ops.common.chunk_dqkw import chunk_dqkw_bwd
from tfla.ops.common.chunk_dqkw_ws import gdn_bwd_chunk_ws, gdn_bwd_ws_supported
from tfla.ops.common.chunk_state import chunk_state_fwd
from tfla.ops.common.chunk_state_bwd import chunk_state_bwd
from tfla.ops.common.cumsum import chunk_local_cumsum
from tfla.ops.common.custom_ops import varlen_index
from tfla.ops.common.fused_delta_fwd import (SAVE_NONE, SAVE_STATES, SAVE_V_NEW, Split, fused_delta_fwd,
                                            piece_ws, segment_scan, states_from_pass)
from tfla.ops.common.fused_delta_ws import fused_delta_pass_ws, ws_supported
from tfla.ops.common.gate_act import BETA_2SIGMOID, BETA_SIGMOID, NO_BETA, GateAct, gate_epilogue
from tfla.ops.common.group_sum import group_sum
from tfla.ops.common.l2norm import l2norm, l2norm_bwd, l2norm_fwd
from tfla.ops.common.state_bwd_ws import delta_state_bwd_ws, state_bwd_ws_supported
from tfla.ops.common.utils import CHUNK_SIZES, SUB_CHUNK, autograd_call, on_input_device
from tfla.ops.common.ut_transform import w_from_tm
from tfla.ops.common.wy_bwd import wy_bwd
from tfla.ops.common.varlen import VarlenIndex, table_kind
from tfla.utils.validation import (
    check_common,
    check_cotangent,
    check_gate_dtype,
    check_qkv,
    check_tensor,
    host_bounds,
    state_in_fla_layout,
    state_in_kv_layout,
)

@dataclasses.dataclass(frozen=True)
class GDNOptions:
    """Non-tensor arguments of one call (kept frozen so ``backward`` returns one slot per input)."""

    scale: float
    output_final_state: bool
    use_qk_l2norm_in_kernel: bool
    save_states: bool = False
    save_v_new: bool = False
    segments: int | None = None
    needs_grad: bool = True  # autograd will call backward (grad mode on and an input requires grad)
    config: dict | None = dataclasses.field(default=None, compare=False, hash=False)
    beta_act: int = NO_BETA  # beta holds pre-activations: the kernels apply sigmoid (x 2) (gate_act.py)
    gate_act: bool = False  # g holds pre-activations: the kernels apply -exp(A_log) softplus(g + dt_bias)


# stages of the forward and backward whose launches ``config`` can override (each stage function documents its keys)
CONFIG_STAGES = ("ut", "fused", "state_lin", "state_bwd", "dqkw", "wy_bwd", "slab")


def chunk_gated_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    varlen: VarlenIndex | None = None,
    config: dict | None = None,
    save: int = SAVE_NONE,
    segments: int | None = 1,
    split_save: int | None = None,
    act: GateAct | None = None,
    slab: int = 0,
):
    """Plain forward (no autograd): the fused pass (``fused_delta_fwd``; ``slab``: its slab starts kept). Returns
    ``(o, final_state, saved)`` where
    saved holds ``g_cum [B, T, HV]`` fp32 (log2, restarting every 64 rows), ``ai`` (Tm), ``beta`` (the one used:
    activated with ``act``) and, by ``save``, ``v_new`` and ``h`` (the state before every 64-row chunk). ``act``: g and
    beta hold pre-activations that the gate's cumsum kernel activates (``gate_act.py``).

    ``config`` (tuning, see docs/performance.md): ``{"ut": {...}, "fused": {...}}``; every key optional.
    """
    config = config or {}
    cu = varlen.cu_seqlens if varlen is not None else None
    out = fused_delta_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens=cu,
                          bounds=varlen.bounds if varlen is not None else None, segments=segments, save=save,
                          split_save=split_save,
                          sub_tables=(varlen.sub_indices, varlen.sub_offsets, varlen.seq_order)
                          if varlen is not None else None,
                          act=act, slab=slab,
                          config={**config.get("fused", {}), **({"ut": config["ut"]} if "ut" in config else {})})
    return out["o"], out["final_state"], out


def chunk_gated_delta_rule_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_cum: torch.Tensor,
    beta: torch.Tensor,
    ai: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    varlen: VarlenIndex | None = None,
    config: dict | None = None,
    saved: tuple | None = None,
    v_new: torch.Tensor | None = None,
    split: Split | None = None,
    act: GateAct | None = None,
    g: torch.Tensor | None = None,
    beta_in: torch.Tensor | None = None,
    l2: tuple | None = None,
    slab: tuple | None = None,
):
    """Plain backward (no autograd) from the forward's saved ``g_cum`` (log2, restarting every 64 rows) and ``ai``
    (Tm); ``saved = (v_new, h)`` (the forward's Vnew and 64-row states) skips their recomputation; ``v_new`` alone
    turns the recomputation into the linear-attention state pass over Vnew; neither: the forward's pass again
    (``states_from_pass``) for both; ``split`` (the forward's ``Split`` of its sequences into pieces, with ``saved`` or
    with neither) runs the state-gradient recurrence in those pieces in parallel (``_state_grad_in_pieces``) and,
    without ``saved``, the pass again over the pieces from their start states (``_states_in_pieces``); ``act`` with the
    forward's ``g`` and ``beta_in`` (pre-activations; ``beta`` is then the activated one): the gradients of the
    pre-activations, A_log and dt_bias (``gate_act.gate_epilogue``); ``l2 = (q0, rstd_q, k0, rstd_k)``: q and k are
    ``l2norm_fwd`` of q0 and k0, and dq, dk are returned for q0 and k0 (the l2norm's backward in Hopper's
    chunk-gradient kernel, else in the GVA sum's pass, or its own pass without grouped heads); ``slab = (n,
    states)`` (the forward's slab starts, ``fused_delta_fwd``'s ``slab``), with ``v_new`` or with neither: on Hopper
    the states (with neither, Vnew too), their gradients and the chunk gradients run one slab of n 64-row chunks at a
    time, last first (``_ws_bwd_in_slabs``). Returns ``(dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)``: dq, dk
    ``[B, T, H, K]`` in q's dtype, dv in v's dtype, dg and dbeta ``[B, T, HV]`` fp32, dh0 fp32 or None, dA_log and
    ddt_bias ``[HV]`` fp32 or None.

    Stages: recompute W (from Tm; not on Hopper), Vnew and the state at every 64-row chunk (or take them); the
    state-gradient recurrence (reverse; the output's gradient of Vnew formed inside it); dq, dk and the WY
    backward's state terms (dW = -dU S^T, dk's 2^(G_n - G) Vnew dS^T, <S, dS>) from one read of S and dS
    (``chunk_dqkw``; H100 3.528 -> 3.369 ms fwd+bwd against a dual tiled launch before the recurrence plus those
    terms in wy_bwd, 293a86c); the delta/UT-WY backward per chunk; dg = reverse cumsum of the output's and the delta
    part's gate gradients. ``config`` keys: ``ut``, ``fused`` (the pass run again), ``state_lin``, ``state_bwd``,
    ``dqkw``, ``wy_bwd`` (launch configs of those stages).
    """
    config = config or {}
    B, T, H, K = q.shape
    HV = v.shape[2]
    L = SUB_CHUNK
    cu = varlen.cu_seqlens if varlen is not None else None
    sub = varlen.sub_indices if varlen is not None else None
    # the state-gradient recurrence on Hopper runs from Tm and beta (state_bwd_ws.py): no W to recompute for it
    in_pieces = split is not None and (saved is not None or v_new is None)
    sb_ws = (config.get("state_bwd") or {}).get("ws", True)
    if in_pieces:
        sb_ws = piece_ws(sb_ws, v.shape[3])
    from_tm = sb_ws is not False and state_bwd_ws_supported(
        q, k, ai, beta, do, g_cum, None if in_pieces else dht, split.cu_seqlens if in_pieces else cu,
        sb_ws if isinstance(sb_ws, dict) else None)
    tm_kw = dict(ai=ai, beta=beta) if from_tm else {}
    ws = (config.get("dqkw") or {}).get("ws", True)
    fused_cfg = config.get("fused") or {}
    pass_cfg = fused_cfg["ws"] if isinstance(fused_cfg.get("ws"), dict) else None
    if (slab is not None and saved is None and (cu is None or varlen.bounds is not None) and not in_pieces
            and from_tm and ws is not False
            and gdn_bwd_ws_supported(q, k, v, beta, ai, v, do, v, v, g_cum)
            and (v_new is not None or fused_cfg.get("ws", True) is not False and ws_supported(
                q, k, v, True, None, None, SAVE_STATES, pass_cfg))):
        gva = _gva_sum(H, HV, K, v.shape[3])
        dq, dk, dv, dbeta, dgq, dgam, dh0 = _ws_bwd_in_slabs(
            q, k, v, g_cum, beta, ai, v_new, do, dht, initial_state, scale, slab,
            l2=(l2[1], l2[3]) if l2 is not None and (HV == H or gva) else None, config=config,
            sb_cfg=sb_ws if isinstance(sb_ws, dict) else None, ws_cfg=ws if isinstance(ws, dict) else None,
            pass_cfg=pass_cfg, bounds=varlen.bounds if varlen is not None else None, gva_sum=gva)
        if HV == H or gva:
            l2 = None  # (done)
        return _bwd_epilogue(q, k, dq, dk, dv, dbeta, dgq, dgam, dh0, g, beta_in, act, l2, varlen, acc_dtype=(
            torch.float64 if q.dtype == torch.float64 else torch.float32), cu=cu)
    own_v_new = saved is None and v_new is None  # Vnew formed below and dead after the chunk gradients
    if saved is not None:
        v_new, h_sub = saved
    elif v_new is not None:  # the forward's Vnew: the states without the delta rule's W S product
        h_sub, _ = chunk_state_fwd(
            k, v_new, g_cum, L, initial_state=initial_state, cu_seqlens=cu,
            chunk_offsets=varlen.sub_offsets if varlen is not None else None,
            num_chunks=varlen.sub_indices.shape[0] if varlen is not None else None,
            config=config.get("state_lin"), store_every_sub_chunk=True, key_weights=True,
            seq_order=varlen.seq_order if varlen is not None else None)
    elif in_pieces:  # FLA's saved set and a split: the pass again over the pieces, from their start states
        v_new, h_sub = _states_in_pieces(q, k, v, g_cum, beta, ai, scale, split, config.get("fused"))
    else:  # FLA's saved set: the forward's pass again for Vnew and the 64-row states (save_states' pair)
        v_new, h_sub = states_from_pass(
            q, k, v, g_cum, beta, ai, scale, initial_state, cu,
            chunk_offsets=varlen.sub_offsets if varlen is not None else None,
            num_chunks=varlen.sub_indices.shape[0] if varlen is not None else None, config=config.get("fused"),
            seq_order=varlen.seq_order if varlen is not None else None)
    # W for the recurrence where it does not run from Tm (off Hopper); dW later goes into its buffer
    w = None if from_tm else w_from_tm(k, g_cum, beta, ai, L, cu_seqlens=cu, sub_indices=sub,
                                       config=config.get("ut"))
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if in_pieces:
        dh_sub, du, dh0 = _state_grad_in_pieces(q, k, w, do, g_cum, scale, dht, initial_state is not None, split,
                                                config.get("state_bwd"), **tm_kw)
    else:
        dh_sub, du, dh0 = chunk_state_bwd(
            q, k, w, do, None, g_cum, scale, L, dht=dht, need_dh0=initial_state is not None, cu_seqlens=cu,
            sub_offsets=varlen.sub_offsets if varlen is not None else None,
            num_sub_chunks=varlen.sub_indices.shape[0] if varlen is not None else None,
            config=config.get("state_bwd"), seq_order=varlen.seq_order if varlen is not None else None, **tm_kw)
    # dq, dk and the WY backward's state terms from one read of S and dS (after the recurrence); dW goes into W's
    # buffer (recomputed here, dead after the recurrence). dq, dk and dk's tiled part (added to
    # the state / WY part in wy_bwd) per value head in the input dtype, as FLA's chunk_bwd_dqkwg: half the bytes of
    # their writes and reads (with grouped value heads too: H100, the Qwen3-Next-style layer, fwd+bwd 8.00 -> 7.28
    # ms, peak -512 MiB; bf16 dq / dk with Qwen3-Next gates 1.01-1.03x FlashQLA's error, below FLA's; 0.92-0.93x
    # FlashQLA's with fp32 per-head parts; docs/performance.md)
    if ws is not False and gdn_bwd_ws_supported(q, k, v, beta, ai, v_new, do, du, h_sub, g_cum):
        # on Hopper: the stage below and the UT / WY backward in one kernel (chunk_dqkw_ws.py): dW, dk's parts and
        # the state terms of the gate gradient stay on chip; the GVA sum (K = V = 128) and l2norm's backward too
        gva = _gva_sum(H, HV, K, v.shape[3])
        dq, dk, dv, dbeta, dgq = gdn_bwd_chunk_ws(
            q, k, v, beta, ai, v_new, do, du, h_sub, dh_sub, g_cum, scale, cu_seqlens=cu,
            tile_indices=sub, sub_offsets=varlen.sub_offsets if varlen is not None else None,
            l2=(l2[1], l2[3]) if l2 is not None and (HV == H or gva) else None, dv_into_du=True,
            dq_into_v_new=own_v_new and K == v.shape[3] and not gva, gva_sum=gva,
            config=ws if isinstance(ws, dict) else None)
        dgam = None  # (dgq's reverse cumsum is the whole delta part)
        del w, h_sub, dh_sub, du, v_new
        if HV == H or gva:
            l2 = None  # (done)
    else:
        dq, dko, dw, dgq, pst, sdst = chunk_dqkw_bwd(
            q, k, v_new, do, du, h_sub, dh_sub, g_cum, scale, cu_seqlens=cu,
            tile_indices=varlen.sub_indices if varlen is not None else None,
            sub_offsets=varlen.sub_offsets if varlen is not None else None, dq_dtype=q.dtype,
            dk_dtype=q.dtype, dw=w, config=config.get("dqkw"))
        del w, h_sub, dh_sub  # wy_bwd reads neither state tensor (freed here unless kept by the forward)
        # dk = the tiled product's part (dko) + the state and WY parts, added in wy_bwd's kernel and rounded once;
        # dgq is q . dq - k . dk of the output's part already
        dk, dv, dbeta, dgam = wy_bwd(k, v, beta, g_cum, ai, v_new, du, None, None, L, cu_seqlens=cu,
                                     sub_indices=sub, config=config.get("wy_bwd"), dk_add=dko, dk_dtype=q.dtype,
                                     dw=dw, pst=pst, sdst=sdst)
        del du, dko, dw, pst, sdst
    return _bwd_epilogue(q, k, dq, dk, dv, dbeta, dgq, dgam, dh0, g, beta_in, act, l2, varlen, acc, cu)


def _gva_sum(H: int, HV: int, K: int, V: int) -> bool:
    """Whether the Hopper chunk-gradient kernel sums grouped value heads itself (``gdn_bwd_chunk_ws``'s ``gva_sum``)
    instead of ``group_sum`` after it: HV > H with K = V = 128."""
    return HV != H and K == 128 and V == 128


def _bwd_epilogue(q, k, dq, dk, dv, dbeta, dgq, dgam, dh0, g, beta_in, act, l2, varlen, acc_dtype, cu):
    """The backward's last passes: dg (and the activations' gradients), the GVA sum and l2norm's backward where the
    chunk gradients left them (dq, dk per value head). dg = the reverse cumsum of dgq within 64 rows, + dgam (None:
    the Hopper chunk-gradient kernel's dgq carries it)."""
    H, HV = q.shape[2], dq.shape[2]
    # + the delta part's gradient of g (dgam: its reverse cumsum over the chunk done in wy_bwd; on Hopper in dgq's
    # own cumsum), in the same pass, and the activations' backward there too
    dA_log = ddt = None
    if act is not None:
        dg, dbeta, dA_log, ddt = gate_epilogue(dgq, dgam, dbeta, g, beta_in, act, cu_seqlens=cu,
                                               chunk_indices=varlen.chunk_indices if varlen else None)
    else:
        dg = chunk_local_cumsum(dgq, SUB_CHUNK, reverse=True, chunk_indices=varlen.chunk_indices if varlen else None,
                                out_dtype=acc_dtype, add=dgam, cu_seqlens=cu)
    if HV != H:  # grouped value heads: a key head's gradient sums over its value heads (fp32 sum)
        dq = group_sum(dq, H, q.dtype, l2=l2[:2] if l2 is not None else None)
        dk = group_sum(dk, H, k.dtype, l2=l2[2:] if l2 is not None else None)
    elif l2 is not None:
        dq, dk = l2norm_bwd(l2[0], l2[1], dq), l2norm_bwd(l2[2], l2[3], dk)
    return dq, dk, dv, dg, dbeta, dh0, dA_log, ddt


# the backward's slabs (unsplit sequences, Hopper): by default two per dense sequence for FLA's saved set (the
# default) where the backward holds at least BWD_SLAB_WORK 64-row states (B * HV * ceil(T / 64): 256 MiB at K = V =
# 128 in bf16, the MVE's), each slab at least BWD_SLAB_MIN 64-row chunks; whole sequences with Vnew kept and for
# packed sequences unless config["slab"] asks. A slab holds its 64-row states and their gradients alone and costs
# three launches of host time. NVIDIA H200, torch 2.11, Triton 3.6, bf16, H = 16, K = V = 128, forward + backward,
# 2026-11-28 (docs/performance.md): B = 4, T = 8192 whole 1.725 ms / 1096 MiB peak, two slabs 1.777 / 848 (device
# time: 1.723 / 1.772 with the backward on the calling thread, host 0.75 / 1.09 ms per call); B = 4, T = 32768
# 6.796 / 4384 and 6.802 / 3368; B = 8, T = 8192 3.393 / 2192 and 3.481 / 1696
BWD_SLABS = {SAVE_NONE: 2, SAVE_V_NEW: 1}
BWD_SLAB_MIN = 32
BWD_SLAB_WORK = 8192


def _slab_chunks(config: dict | None, save: int, nt: int, states: int, packed: bool = False) -> int:
    """The backward's slab in 64-row chunks (0: whole sequences) from ``config["slab"]``: ``chunks`` (per slab) or
    ``count`` (slabs of the longest sequence, ``nt`` 64-row chunks, at least ``BWD_SLAB_MIN`` chunks each), else
    for dense sequences ``BWD_SLABS[save]`` where the backward holds at least ``BWD_SLAB_WORK`` 64-row states
    (``states``: chunks of all sequences times value heads). Packed sequences (``packed``) take slabs only where the
    config asks: every sequence shorter than a slab lies in the first one, so the peak drops less and the time rises
    (the Qwen3-Next-style layer, two slabs: -231 MiB, +0.29 ms; docs/performance.md)."""
    cfg = (config or {}).get("slab") or {}
    if "chunks" in cfg:
        return cfg["chunks"]
    count = cfg.get("count", BWD_SLABS[save] if states >= BWD_SLAB_WORK and not packed else 1)
    if count <= 1 or nt < count * BWD_SLAB_MIN:
        return 0
    return -(-nt // count)


def _chunk_counts(B: int, T: int, HV: int, varlen: VarlenIndex | None) -> tuple[int, int]:
    """The longest sequence's 64-row chunks and all sequences' chunks times HV (0 for tables built on the device)."""
    if varlen is None:
        return -(-T // SUB_CHUNK), B * -(-T // SUB_CHUNK) * HV
    if varlen.bounds is None:
        return 0, 0
    b = varlen.bounds
    return max((-(-(e - s) // SUB_CHUNK) for s, e in zip(b[:-1], b[1:])), default=0), \
        int(varlen.sub_indices.shape[0]) * HV


@functools.lru_cache(maxsize=64)
def _slab_tables(bounds: tuple[int, ...], n: int, device: torch.device) -> list:
    """The slabs' index tables for sequences at the packed row offsets ``bounds`` (dense: ``b T``), built once per
    offsets and slab (one host-to-device copy: a copy from pageable host memory waits for the device's queue, which
    per slab and call cost ~1 ms on an H100). Slab j covers 64-row chunks ``[j n, (j + 1) n)`` of every sequence (an
    empty part where a sequence is shorter). Per slab, ``(pairs [N, 2], offs [N], tiles [C, 2], C)``: int32 (first
    row, end row) of each sequence's part, each part's first 64-row state slot in the slab's buffers, the (part,
    chunk) table of the slab's C chunks."""
    lens = [-(-(e - b) // SUB_CHUNK) for b, e in zip(bounds[:-1], bounds[1:])]
    host = []
    for j in range(max(1, -(-max(lens, default=0) // n))):
        pairs, offs, tiles = [], [], []
        for i, (b, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            c0, c1 = min(j * n, lens[i]), min((j + 1) * n, lens[i])
            pairs += [min(b + c0 * SUB_CHUNK, e), min(b + c1 * SUB_CHUNK, e)]
            offs.append(len(tiles) // 2)
            for c in range(c1 - c0):
                tiles += [i, c]
        host.append((pairs, offs, tiles))
    flat = torch.tensor([x for part in host for xs in part for x in xs], dtype=torch.int32).to(device)
    views = torch.split(flat, [len(xs) for part in host for xs in part])
    return [(p.view(-1, 2), o, t.view(-1, 2), t.numel() // 2) for p, o, t in zip(*[iter(views)] * 3)]


def _ws_bwd_in_slabs(q, k, v, g_cum, beta, ai, v_new, do, dht, initial_state, scale, slab, l2, config, sb_cfg,
                     ws_cfg, pass_cfg=None, bounds=None, gva_sum: bool = False):
    """The Hopper backward one slab at a time (``chunk_gated_delta_rule_bwd``'s ``slab``), dense sequences or packed
    ones (``bounds``: the host offsets of ``cu_seqlens``, q of shape ``[1, T, ..]``): slab j covers 64-row chunks
    ``[j n, (j + 1) n)`` of every sequence (empty where a sequence is shorter); last slab first, the states over it
    are rebuilt from the forward's fp32 state at its start (with the forward's Vnew, ``v_new``: ``chunk_state_fwd``
    over it; without (None, FLA's saved set): the forward's pass again without its output, ``fused_delta_pass_ws``
    with ``pass_cfg``, which forms the slab's Vnew rows too), the state-gradient recurrence runs over it from the
    gradient at its end (the next slab's start gradient, which an empty part passes on unchanged, or ``dht``), and
    the chunk gradients follow. The kernels see the slab as N (first row, end row) pairs (``utils.varlen_mode`` 2).
    The 64-row states and their gradients of one slab are held at a time instead of all: at B = 4, T = 8192, H = 16,
    K = V = 128, bf16 and n = 32, 128 MiB instead of 512. Without a kept Vnew and at K = V (per value head: not
    ``gva_sum``, which sums a key head's value heads in the kernel), dq is written over the Vnew rows of its own slab
    (each chunk's CTA stores its dq tile after its own loads of that Vnew tile; a later slab's pass writes only its
    own rows): no buffer of v's size for dq. Same products and order as the unsplit
    backward: results equal up to the order of fp32 additions. Returns ``(dq, dk, dv, dbeta, dgd, None, dh0)`` as
    the chunk-gradient stage (dq, dk per key head with ``gva_sum``; dgd's reverse cumsum within 64 rows is the
    whole delta part of the gate gradient: no ``dgam``)."""
    n, states = slab
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    bounds = tuple(bounds) if bounds is not None else tuple(b * T for b in range(B + 1))
    N = len(bounds) - 1
    dev = q.device
    flat = [x.reshape(1, B * T, *x.shape[2:]) if x is not None else None
            for x in (q, k, v, g_cum, beta, ai, v_new, do)]
    qf, kf, vf, gf, bf, af, vnf, dof = flat
    # a chunk that a sequence's end cuts loads the next rows of dU (and of Vnew) too (zero-weighted), rows of
    # another slab or sequence: finite memory there
    fill = torch.zeros if any((e - b) % SUB_CHUNK for b, e in zip(bounds[:-1], bounds[1:])) else torch.empty
    du = fill(1, B * T, HV, V, dtype=k.dtype, device=dev)
    own_v_new = v_new is None
    if own_v_new:
        vnf = fill(1, B * T, HV, V, dtype=k.dtype, device=dev)
    HQ = H if gva_sum else HV  # dq's and dk's heads (gva_sum: summed over each key head's value heads)
    dq = vnf.view(1, B * T, HV, K) if own_v_new and K == V and not gva_sum else torch.empty(
        1, B * T, HQ, K, dtype=q.dtype, device=dev)
    dk = torch.empty_like(dq)
    dbeta, dgd = (torch.empty(1, B * T, HV, dtype=torch.float32, device=dev) for _ in range(2))
    if l2 is not None:
        l2 = tuple(x.reshape(1, B * T, *x.shape[2:]) for x in l2)
    ds = dht
    tables = _slab_tables(bounds, n, dev)
    for j in reversed(range(len(tables))):
        pairs, offs, tiles, nch = tables[j]
        h0 = initial_state if j == 0 else states[j - 1].view(N, HV, K, V)
        if own_v_new:
            _, _, _, h_sub = fused_delta_pass_ws(qf, kf, vf, gf, bf, af, scale, h0, False, pairs, SAVE_STATES,
                                                 pass_cfg, chunk_offsets=offs, num_chunks=nch, output=False,
                                                 v_new_out=vnf)
        else:
            h_sub, _ = chunk_state_fwd(kf, vnf, gf, SUB_CHUNK, initial_state=h0, cu_seqlens=pairs,
                                       chunk_offsets=offs, num_chunks=nch, config=config.get("state_lin"),
                                       store_every_sub_chunk=True, key_weights=True)
        dh_sub, _, ds = delta_state_bwd_ws(qf, kf, af, bf, dof, gf, scale, ds, j > 0 or initial_state is not None,
                                           pairs, offs, nch, config=sb_cfg, du_out=du)
        gdn_bwd_chunk_ws(qf, kf, vf, bf, af, vnf, dof, du, h_sub, dh_sub, gf, scale, cu_seqlens=pairs,
                         tile_indices=tiles, sub_offsets=offs, l2=l2, dv_into_du=True, gva_sum=gva_sum,
                         config=ws_cfg, out=(dq, dk, dbeta, dgd))
        del h_sub, dh_sub
    return (dq.view(B, T, HQ, K), dk.view(B, T, HQ, K), du.view(B, T, HV, V), dbeta.view(B, T, HV),
            dgd.view(B, T, HV), None, ds if initial_state is not None else None)


def _states_in_pieces(q, k, v, g_cum, beta, ai, scale, split: Split, config):
    """Vnew and the state before every 64-row chunk (``save_states``' pair, in the forward's layout) by the forward's
    pass without its output over the forward's pieces, each from its start state (``split.starts``), at the forward's
    launch for pieces (``PIECE_WS`` on the Gluon kernel unless ``config`` sets one)."""
    B, T, HV, V = v.shape
    K = q.shape[3]
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g_cum, beta, ai)]
    cfg = {**(config or {}), "ws": piece_ws((config or {}).get("ws", True), V)}
    v_new, h = states_from_pass(*flat, scale, split.starts, split.cu_seqlens, chunk_offsets=split.sub_offsets,
                                num_chunks=split.num_chunks, config=cfg, seq_order=split.seq_order)
    return v_new.reshape(v.shape), h.reshape(B, -1, HV, K, V)


def _state_grad_in_pieces(q, k, w, do, g_cum, scale, dht, need_dh0, split: Split, config, ai=None, beta=None):
    """The state-gradient recurrence (L = 64) over the forward's pieces in parallel, exactly (``docs/gdn-math.md``
    section 6, backward): the adjoint is affine in the state gradient, ``dS_start = M^T dS_end + dN`` per piece.
    Pass 1 runs every piece from a zero gradient at its end for ``dN`` alone (``store=False``: no dS or dU), over
    the piece's chunks whose map to its start stays above e^-80 (``split.keep``, from the forward's
    ``piece_cutoffs``); the reverse scan walks each sequence's pieces from the final state's cotangent for every
    piece's end gradient and the initial state's gradient; pass 2 runs every piece from its exact end gradient and
    writes dS at every 64 rows and dU. Two passes of the recurrence in ``pieces`` times as many programs. Returns
    ``chunk_state_bwd``'s ``(dh, du, dh0)`` in the unsplit layout."""
    B, T = q.shape[:2]
    HV, K, V = do.shape[2], q.shape[3], do.shape[3]
    flat = [x.reshape(1, B * T, *x.shape[2:]) if x is not None else None for x in (q, k, w, do, g_cum, ai, beta)]
    tm_kw = dict(ai=flat[5], beta=flat[6]) if ai is not None else {}
    # the Gluon recurrence (Hopper) at two 64-column consumers per CTA for pieces, as the forward's pass
    # (state_bwd_ws.STATE_BWD_WS_DEFAULTS), unless the config sets its launch
    config = {**(config or {}), "ws": piece_ws((config or {}).get("ws", True), V)}
    kw = dict(cu_seqlens=split.cu_seqlens, sub_offsets=split.sub_offsets, num_sub_chunks=split.num_chunks,
              config=config, seq_order=split.seq_order)
    _, _, dn = chunk_state_bwd(*flat[:4], None, flat[4], scale, SUB_CHUNK, need_dh0=True, store=False, **kw,
                               **tm_kw, summary_chunks=split.keep)
    ends, dh0 = segment_scan(split.mn, dht, split.first, V, need_dh0, config, dn=dn)
    del dn
    dh, du, _ = chunk_state_bwd(*flat[:4], None, flat[4], scale, SUB_CHUNK, dht=ends, **kw, **tm_kw)
    return dh.view(B, -1, HV, K, V), du.view(B, T, HV, V), dh0


def check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens) -> None:
    """Validate a ``chunk_gated_delta_rule`` call; raises ValueError/TypeError naming the argument."""
    B, T, H, HV, K, V = check_qkv(q, k, v, grouped=True)
    for name, x in (("g", g), ("beta", beta)):
        check_tensor(name, x, 3)
        if x.shape != (B, T, HV):
            raise ValueError(f"`{name}` must have shape [B, T, HV] = {(B, T, HV)}, got {tuple(x.shape)}")
        check_gate_dtype(name, x, q)
    check_common(q, (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)), scale, initial_state, cu_seqlens,
                 SUB_CHUNK, (HV, K, V))


def _gdn_forward(q, k, v, g, beta, initial_state, A_log, dt_bias, varlen, opts: GDNOptions):
    """The op's forward: ``(o, final_state, saved, slab, split)``, ``saved`` the tensors the backward needs (empty
    without ``opts.needs_grad``), ``slab`` / ``split`` the backward's slab size and pieces (or None)."""
    grad = opts.needs_grad
    save = SAVE_NONE if not grad else SAVE_STATES if opts.save_states else \
        SAVE_V_NEW if opts.save_v_new else SAVE_NONE
    # a kept Vnew matches the backward's state pass only without a split: with one, keep the forward's own
    # states too. Without Vnew kept, a split keeps the pieces' start states and transitions (Split), and the
    # backward runs the pass and the state-gradient chain in the same pieces
    split_save = SAVE_STATES if save == SAVE_V_NEW else None
    act = _act(opts, A_log, dt_bias)
    q0 = k0 = rq = rk = None
    if opts.use_qk_l2norm_in_kernel:  # one Triton pass per tensor; its backward joins the GVA sum's pass
        (q0, k0), ((q, rq), (k, rk)) = (q, k), (l2norm_fwd(q), l2norm_fwd(k))
    # dense sequences, FLA's saved set or Vnew kept, slabs (_slab_chunks): the forward also keeps the state at
    # every n-th chunk, and the backward holds the 64-row states and their gradients of one slab at a time
    # (_ws_bwd_in_slabs)
    slab = _slab_chunks(opts.config, save, *_chunk_counts(q.shape[0], q.shape[1], v.shape[2], varlen),
                        packed=varlen is not None) if grad and save != SAVE_STATES else 0
    o, final_state, inter = chunk_gated_delta_rule_fwd(
        q, k, v, g, beta, opts.scale, initial_state, opts.output_final_state, varlen,
        config=opts.config, save=save, split_save=split_save, segments=opts.segments, act=act, slab=slab)
    if not grad:
        return o, final_state, (), None, None
    # saved: inputs, the cumulative gates (fp32, B*T*HV) and Tm (B*T*HV*64, input dtype); W, U,
    # Vnew and the 64-row states are recomputed in backward (README: memory) unless save_v_new keeps
    # Vnew or save_states keeps Vnew and the states before every 64-row chunk
    extra = tuple(inter[n] for n in ("v_new", "h")[:inter["save"]])
    slab_n = inter["slab"][0] if "slab" in inter else None
    if slab_n is not None:  # (after the kept tensors: fp32 [S - 1, B HV, K, V])
        extra += (inter["slab"][1],)
    # with a beta activation, the activated beta (fp32 [B, T, HV]) too
    # with l2norm, q and k are the normalized rows and q0, k0 the inputs (with their 1 / norm)
    saved = (q, k, v, g, beta, initial_state, A_log, dt_bias, inter["beta"], inter["g_cum"], inter["ai"], q0, rq,
             k0, rk, *extra)
    # with the forward's states kept, or nothing kept, the backward runs in the same pieces
    split = inter.get("split") if inter["save"] in (SAVE_STATES, SAVE_NONE) else None
    return o, final_state, saved, slab_n, split


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, A_log, dt_bias, varlen, opts: GDNOptions):
        # (ctx.needs_input_grad stays True under torch.no_grad: the public op decides from the grad mode)
        o, final_state, saved, ctx.slab, ctx.split = _gdn_forward(q, k, v, g, beta, initial_state, A_log, dt_bias,
                                                                  varlen, opts)
        ctx.save_for_backward(*saved)
        ctx.varlen, ctx.opts = varlen, opts
        return o, final_state

    @staticmethod
    @on_input_device
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state, A_log, dt_bias, beta_used, g_cum, ai, q0, rq, k0, rk, *saved = \
            ctx.saved_tensors
        slab = None
        if ctx.slab is not None:
            slab, saved = (ctx.slab, saved[-1]), saved[:-1]
        opts = ctx.opts
        act = _act(opts, A_log, dt_bias)
        if do is None:
            do = torch.zeros(*v.shape, dtype=q.dtype, device=q.device)
        check_cotangent("o", do, v.shape, q.dtype)
        if dht is not None:
            N = initial_state.shape[0] if initial_state is not None else (
                q.shape[0] if ctx.varlen is None else len(ctx.varlen.bounds) - 1)
            check_cotangent("final_state", dht, (N, v.shape[2], q.shape[3], v.shape[3]), None)
            dht = dht.contiguous()
        dq, dk, dv, dg, dbeta, dh0, dA_log, ddt = chunk_gated_delta_rule_bwd(
            q, k, v, g_cum, beta_used, ai, opts.scale, initial_state, do.contiguous(), dht, ctx.varlen,
            config=opts.config, saved=tuple(saved) if len(saved) == 2 else None,
            v_new=saved[0] if len(saved) == 1 else None, split=ctx.split, act=act, g=g, beta_in=beta,
            l2=(q0, rq, k0, rk) if q0 is not None else None, slab=slab)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype),
                dh0.to(initial_state.dtype) if dh0 is not None else None,
                dA_log.to(A_log.dtype) if dA_log is not None else None, ddt.to(dt_bias.dtype) if ddt is not None else None,
                None, None)


def _act(opts: GDNOptions, A_log, dt_bias) -> GateAct | None:
    """The activations the kernels apply (None: g and beta are used as given)."""
    if not opts.gate_act and opts.beta_act == NO_BETA:
        return None
    return GateAct(A_log if opts.gate_act else None, dt_bias if opts.gate_act else None, opts.beta_act)


@on_input_device
def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context=None,
    *,
    save_states: bool = False,
    save_v_new: bool = False,
    config: dict | None = None,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    transpose_state_layout: bool | None = None,
    segments: int | None = None,
    chunk_size: int | None = None,
):
    r"""Gated delta rule (Gated DeltaNet), chunkwise.

    Recurrence per value head (``docs/gdn-math.md``; Yang et al., ICLR 2025, Eq. 10):
    ``S_t = e^{g_t} S_{t-1} + k_t beta_t (v_t - e^{g_t} S_{t-1}^T k_t)^T``, ``o_t = scale S_t^T q_t``.
    Computed exactly (no approximation) in 64-row chunks with the UT/WY transform per chunk; the forward is one
    fused pass with the state on chip, long sequences cut into pieces joined by an exact scan. A drop-in for
    FLA's ``chunk_gated_delta_rule`` (same names, order and layout).

    Args:
        q: queries ``[B, T, H, K]``; fp32, fp16 or bf16.
        k: keys ``[B, T, H, K]``, same dtype as q (usually L2-normalised).
        v: values ``[B, T, HV, V]``, same dtype; HV must be a multiple of H (grouped value heads:
            value head j reads key head ``j // (HV // H)``).
        g: log-space forget gate (natural log, ``<= 0``) ``[B, T, HV]``, fp32 or q's dtype.
        beta: write strength ``[B, T, HV]``, fp32 or q's dtype.
        scale: query scale; default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (any float dtype, read as fp32); N = B, or the number of
            sequences with ``cu_seqlens``.
        output_final_state: also return the final state.
        use_qk_l2norm_in_kernel: L2-normalise q and k (``x / sqrt(sum x^2 + 1e-6)``) first (one Triton pass each; the
            backward's in the pass that sums grouped value heads' dq / dk).
        cu_seqlens: ``[N + 1]`` int offsets of N packed sequences (then B must be 1). Under CUDA-graph capture
            (forward without gradients) the index tables are built from it on the device, so a replay takes the
            offsets written into the same tensor since (same N and T; there unchecked: clamped into ``[0, T]``, made
            non-decreasing) and ``cu_seqlens_cpu`` is ignored.
        save_states: keep Vnew and the states (every 64 rows) from the forward for the backward instead of
            recomputing the states there (keyword-only): ``B*ceil(T/64)*HV*K*V`` more
            elements in the input dtype than the default (256 MiB at B=4, T=8192, H=16, K=V=128, bf16); README of
            this op.
        save_v_new: keep Vnew (``B*T*HV*V`` elements in the input dtype, the size of v: 128 MiB at B=4, T=8192,
            H=16, V=128, bf16) from the forward (keyword-only); the backward then rebuilds the states by the plain
            linear-attention pass over it. Default False: FLA's saved set (inputs, cumulative gates, Tm) and the
            backward runs the forward's pass again, without its output, for Vnew and the states (gradients equal
            ``save_states``'). Measured with the earlier recomputation that also formed the output (H100, bf16,
            2026-11-28, 5892856): True 1.804 / 4.337 ms forward + backward at that shape / the Qwen3-Next-style
            layer against 1.940 / 4.469 for False, the peak of one call equal. A forward cut into pieces
            (``segments``) with gradients keeps by default each piece's start state and transition (fp32, ``K*(K+2V)``
            elements per piece and value head) and the backward runs the pass again over the pieces; with
            ``save_v_new=True`` it keeps Vnew and the 64-row states. README of this op.
        config: launch overrides per stage (keyword-only, for tuning; results equal up to rounding): a dict whose keys
            are stages of ``CONFIG_STAGES`` and whose values are that stage's launch config (``BK``, ``BV``,
            ``num_warps``, ``num_stages``, ...: the keys each stage function in ``tfla/ops/common`` documents;
            ``flat`` / ``idx64`` force the large-input indexing, for tests; on Hopper ``fused``, ``state_bwd`` and
            ``dqkw`` take ``ws``: False for the ``tl`` kernels instead of the Gluon ones, or a dict of their launch;
            ``dqkw``'s Gluon kernel also runs the ``wy_bwd`` stage); ``slab``: ``{"chunks": n}`` (n 64-row chunks
            per slab; 0: whole sequences) or ``{"count": n}`` (n slabs of the longest sequence, at least 32 chunks
            each), the Hopper backward one slab at a time: one slab's 64-row states and their gradients in memory
            instead of all, three launches of host time per slab (not with ``save_states``, a split into pieces, or
            tables built on the device). Default: two slabs for dense sequences and FLA's saved set once
            ``B * HV * ceil(T / 64) >= 8192`` and ``ceil(T / 64) >= 64``, else whole sequences. README of this
            op, memory.
            ``scripts/tune.py`` searches them.
        use_beta_sigmoid_in_kernel: beta holds pre-activations; ``sigmoid(beta)`` is used (FLA 0.6.0's
            option; applied in fp32 by the gate's chunk-cumsum kernel, its gradient by the backward's last one:
            ``tfla/ops/common/gate_act.py``).
        allow_neg_eigval: with ``use_beta_sigmoid_in_kernel``, ``2 sigmoid(beta)`` (beta in [0, 2)).
        state_v_first: ``initial_state`` and the final state in the ``[N, HV, V, K]`` layout (transposed at the
            boundary; the kernels keep ``[K, V]``). ``transpose_state_layout``: its deprecated name.
        cu_seqlens_cpu: a host copy of ``cu_seqlens`` (same values; not compared, as in FLA): the index tables
            are built from it without reading ``cu_seqlens`` back from the device.
        chunk_indices: accepted for FLA compatibility and unused (tfla builds its own tables).
        cp_context: context parallelism is not supported yet: anything but None raises ValueError.
        segments: pieces each sequence is cut into for the forward and the backward's state-gradient chain (keyword-only): 1 runs every sequence in one chain; an int > 1 cuts each into at
            most that many pieces (multiples of 64 rows) joined by an exact scan (``docs/gdn-math.md`` section 6);
            None (default) chooses the piece length from the lengths, the heads and the GPU's SM count
            (``choose_piece``; no split at K > 128). Results equal up to rounding for any value.
        chunk_size: deprecated and ignored (keyword-only; a ``DeprecationWarning`` when given): until 2026-11-24 the
            outer chunk L of 64 to 512 rows where states were stored; the op now always runs 64-row chunks (larger
            outer chunks measured slower and less precise: README of this op). ValueError for a value that was never
            valid (not one of 64, 128, 256, 512).
        use_gate_in_kernel, A_log, dt_bias (keyword-only): g holds pre-activations and the log decay is
            ``-exp(A_log) softplus(g + dt_bias)`` (A_log, dt_bias ``[HV]``; dt_bias optional; softplus linear above
            20, as PyTorch's and FLA's), FLA's GDN gate, computed in fp32 inside the gate's chunk-cumsum kernel and
            differentiated in the backward's last kernel (``gate_act.py``): g, A_log and dt_bias get gradients.
            Under ``torch.compile`` both activations are PyTorch ops before the custom ops (inductor fuses them).

    Returns:
        ``o [B, T, HV, V]`` in q's dtype, and ``final_state [N, HV, K, V]`` fp32 (``[N, HV, V, K]`` with
        ``state_v_first``) or None.

    Raises:
        TypeError / ValueError naming the argument for wrong types, ranks, shapes, dtypes, head
        dims above 256, malformed ``cu_seqlens``, ``cu_seqlens_cpu`` or
        ``initial_state``, tensors on a device the kernels cannot run on, ``cp_context`` given, A_log /
        dt_bias without ``use_gate_in_kernel`` (or of the wrong size), ``allow_neg_eigval`` without
        ``use_beta_sigmoid_in_kernel``, ``cu_seqlens`` under CUDA-graph capture with gradients needed or with
        ``segments`` > 1.
        In backward: autograd's own error if a saved input was modified in place; ValueError for a
        cotangent of the wrong shape.

    Backward: gradients for q, k, v, g, beta and initial_state (README of this op: what the forward
    saves, what the backward recomputes, and the memory that costs).

    torch.compile: traced as ``torch.library`` custom ops (``library.py``: forward and backward, no graph break; every
    sequence in one chain there, ``save_states`` and ``config`` ignored).

    Precision: the recurrence and gates are fp32; materialized states and W/U use the input dtype
    (as in FLA); fp32 inputs use tf32x3 dots on the GPU (IEEE on the CPU interpreter).
    """
    # under torch.compile the op enters the graph as custom ops (library.py): no host reads here, and the gate / beta
    # activations stay PyTorch ops there (inductor fuses them); eager calls apply them in the gate's cumsum kernels
    compiling = torch.compiler.is_compiling()
    if chunk_size is not None:
        _deprecated_chunk_size(chunk_size, warn=not compiling)
    q, k, v, g, beta, initial_state, state_v_first, act = _fla_options(
        q, k, v, g, beta, initial_state, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cp_context,
        use_gate_in_kernel, A_log, dt_bias, transpose_state_layout, in_kernel=not compiling)
    bounds = None if compiling else host_bounds(cu_seqlens, cu_seqlens_cpu)
    check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    a_log, a_bias = (act.A_log, act.dt_bias) if act is not None else (None, None)
    needs_grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                 for t in (q, k, v, g, beta, initial_state, a_log, a_bias))
    varlen = None
    if cu_seqlens is not None and not compiling:
        # (under CUDA-graph capture: tables built on the device for a forward without gradients; else ValueError)
        varlen = varlen_index(cu_seqlens, SUB_CHUNK, T, on_device=not needs_grad, bounds=bounds)
    if scale is None:
        scale = K ** -0.5
    if segments is not None and (isinstance(segments, bool) or not isinstance(segments, int) or segments < 1):
        raise ValueError(f"`segments` must be a positive int or None, got {segments!r}")
    if not isinstance(save_v_new, bool):
        raise TypeError(f"`save_v_new` must be a bool, got {type(save_v_new).__name__}")
    if config is not None and (not isinstance(config, dict) or not set(config) <= set(CONFIG_STAGES)
                               or not all(isinstance(c, dict) for c in config.values())):
        raise ValueError(f"`config` must map stages of {CONFIG_STAGES} to dicts of launch overrides, got {config!r}")
    slab_cfg = (config or {}).get("slab") or {}
    if not set(slab_cfg) <= {"chunks", "count"} or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in slab_cfg.values()):
        raise ValueError(f'`config["slab"]` takes "chunks" and / or "count", ints >= 0, got {slab_cfg!r}')
    opts = GDNOptions(float(scale), bool(output_final_state), bool(use_qk_l2norm_in_kernel),
                      bool(save_states), save_v_new, segments, needs_grad,
                      config, act.beta if act is not None else NO_BETA, act is not None and act.A_log is not None)
    if use_qk_l2norm_in_kernel and compiling:  # custom ops each way; eager: inside ChunkGatedDeltaRuleFunction
        q, k = l2norm(q), l2norm(k)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    if compiling:
        from tfla.ops.gated_delta_rule.library import chunk_gdn_fwd

        o, final_state, *_ = chunk_gdn_fwd(q, k, v, g, beta, initial_state, cu_seqlens, opts.scale,
                                           opts.output_final_state, opts.needs_grad)
        final_state = final_state if output_final_state else None
    else:
        args = (q, k, v, g, beta, initial_state, a_log, a_bias, varlen, opts)
        # the first call of a kind: its kernels compiled on a thread pool first
        o, final_state = precompile.apply(autograd_call(ChunkGatedDeltaRuleFunction), args, q, lambda: (
            "gdn", precompile.signature(q, v, g, beta, initial_state, a_log), T % SUB_CHUNK == 0,
            table_kind(varlen), opts))
    return o, state_in_fla_layout(final_state, state_v_first)


def _deprecated_chunk_size(chunk_size, warn: bool = True) -> None:
    """``chunk_size`` of the op before 2026-11-24: warn that it is ignored (``warn``: not while torch.compile
    traces), or raise for a value it never took."""
    import warnings

    if isinstance(chunk_size, bool) or chunk_size not in CHUNK_SIZES:
        raise ValueError(f"`chunk_size` must be one of {CHUNK_SIZES} (and is deprecated), got {chunk_size!r}")
    if warn:
        warnings.warn("`chunk_size` is deprecated and ignored by chunk_gated_delta_rule: it runs 64-row chunks",
                      DeprecationWarning, stacklevel=3)


def _fla_options(q, k, v, g, beta, initial_state, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                 cp_context, use_gate_in_kernel, A_log, dt_bias, transpose_state_layout, in_kernel=False):
    """FLA 0.6.0's extra options of ``chunk_gated_delta_rule``, checked. The gate and beta activations are applied
    as differentiable PyTorch ops before the kernels, or with ``in_kernel`` left to the kernels (``gate_act.py``):
    returns ``(q, k, v, g, beta, initial_state, state_v_first, act)`` with the initial state in ``[N, HV, K, V]``
    and ``act`` the ``GateAct`` the kernels apply (None when there is nothing to apply or not ``in_kernel``)."""
    import warnings

    if transpose_state_layout is not None:
        if state_v_first:
            raise ValueError("pass `state_v_first` or the deprecated `transpose_state_layout`, not both")
        warnings.warn("`transpose_state_layout` is deprecated: use `state_v_first`", DeprecationWarning, stacklevel=3)
        state_v_first = bool(transpose_state_layout)
    if cp_context is not None:
        raise ValueError("`cp_context` (context parallelism) is not supported by tfla yet; pass None")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`")
    HV = v.shape[2] if isinstance(v, torch.Tensor) and v.dim() == 4 else None
    if use_gate_in_kernel:
        for name, x, need in (("A_log", A_log, True), ("dt_bias", dt_bias, False)):
            if x is None and not need:
                continue
            if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() != HV:
                raise ValueError(f"`{name}` must be a float tensor of HV = {HV} elements with use_gate_in_kernel")
        if isinstance(g, torch.Tensor) and not in_kernel:
            x = g.float() + (dt_bias.float().reshape(HV) if dt_bias is not None else 0.0)
            g = -A_log.float().reshape(HV).exp() * torch.nn.functional.softplus(x)
    elif A_log is not None or dt_bias is not None:
        raise ValueError("`A_log` / `dt_bias` are used only with `use_gate_in_kernel=True`")
    if use_beta_sigmoid_in_kernel and isinstance(beta, torch.Tensor) and not in_kernel:
        beta = torch.sigmoid(beta.float()) * (2.0 if allow_neg_eigval else 1.0)
    act = None
    if in_kernel and (use_gate_in_kernel or use_beta_sigmoid_in_kernel):
        act = GateAct(A_log.reshape(HV) if use_gate_in_kernel else None,
                      dt_bias.reshape(HV) if use_gate_in_kernel and dt_bias is not None else None,
                      (BETA_2SIGMOID if allow_neg_eigval else BETA_SIGMOID) if use_beta_sigmoid_in_kernel else NO_BETA)
    return q, k, v, g, beta, state_in_kv_layout(initial_state, state_v_first), state_v_first, act
