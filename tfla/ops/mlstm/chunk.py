"""The mLSTM (xLSTM's matrix memory) on tfla's shared two-level engine, exponential or sigmoid input gate.

Notation: B batch, T time, H heads, K/V head dims, N sequences, L = chunk_size (outer chunk).
F_t = sum_{u <= t} log sigmoid(f_u) (per sequence), Fl the same restarting every L, ig the log input
gate (i for "exp", log sigmoid(i) for "sigmoid").

Recurrence (TFLA paper, Section 2 and Appendix B; mlstm_kernels' semantics):

    m_t = max(log sigmoid(f_t) + m_{t-1}, ig_t)                  (exp only; sigmoid keeps m = 0)
    C_t = e^{log sigmoid(f_t) + m_{t-1} - m_t} C_{t-1} + e^{ig_t - m_t} k_t v_t^T,   n_t likewise with v_t = 1
    h_t = scale C_t^T q_t / (max(|scale n_t . q_t|, e^{-m_t}) + eps)     ("exp")
    h_t = scale C_t^T q_t / (max(|scale n_t . q_t|, 1) + eps)            ("sigmoid", normalize=True)

How it runs on the engine (no mLSTM-specific kernel): the max state is a prefix max,
``m_t = F_t + max(m_0, max_{s <= t} (ig_s - F_s))``, computed exactly (float64, one cummax) before
the kernels. With it every pair weight is one exponent ``e^{Fl_t - m_t - (Fl_s - ig_s)} = 2^(GQ_t - GK_s)``
(<= 1), i.e. the split-gate mode of the shared state and tiled kernels (query-side gate GQ, key-side
gate GK, the state at an outer-chunk start stabilized by the m of the row before it). The paper's
online row max is not needed because m is known up front; the stabilized states are exactly the
recurrence's (C, n, m). The normalizer n is the state of the same product with v = 1: the forward
carries it in the state kernel beside C (``n_state``) and the tiled output kernel forms the
normalizer's row sums in the same pass and divides before its one store (``normalizer``): two kernels
after the gate preparation. The backward still runs the normalizer as a second engine pass on a
16-wide value tensor whose column 0 is ones.

Gradients: the engine's backward with m held fixed (dq, dk, dv, the forget-gate gradient, d initial
state), the input gate from ``di_s = k_s . dk_s`` (e^{ig_s} scales every use of k_s), and the m path:
h depends on m only through eps (``h = C~q / (max(|n~q|, 1) + eps e^m)`` in unstabilized terms), so
``dm_t = -eps (dh_t . h_t) / den_t``, routed to the prefix max's argmax (deterministic segment sums,
no atomics).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from tfla.ops.common import precompile
from tfla.ops.common.cumsum import chunk_local_cumsum
from tfla.ops.common.linear_attn import chunk_simple_gla_bwd, chunk_simple_gla_fwd
from tfla.ops.common.normalizer import normalizer_bwd_prep
from tfla.ops.common.utils import LOG_DECAY_FLOOR, autograd_call, cdiv, on_input_device, sm_count
from tfla.ops.common.varlen import VarlenIndex, table_kind
from tfla.ops.mlstm.step import INPUT_GATES, check_mlstm_options, check_mlstm_state  # noqa: F401
from tfla.utils.validation import (
    check_cotangent,
    check_common,
    check_qkv,
    check_tensor,
    check_varlen_bounds,
)

DEFAULT_CHUNK_SIZE = 128
# The backward runs at L = 64 whatever the forward's chunk_size: it recomputes the gates (restarting every
# L) and stores states at every 64-row sub-chunk anyway, so a larger L only adds intra-chunk work there
# (H100, bf16, B = 8, T = 8192, H = 16, K = 128, V = 256, sigmoid: fwd+bwd 10.52 ms at L = 64, 11.11 at
# L = 128), while the forward is faster at L = 128 (2.01 vs 2.30 ms; 1048 vs 1564 MiB). docs/performance.md.
BWD_CHUNK_SIZE = 64
LOG2E = 1.0 / math.log(2.0)


@dataclasses.dataclass(frozen=True)
class MLSTMOptions:
    input_gate: str
    normalize: bool
    eps: float
    scale: float
    chunk_size: int
    output_final_state: bool
    aug: bool  # the normalizer state n is computed (beside C, same kernels): normalize, or n in/out
    detach_normalizer: bool = False
    save_states: bool = False  # keep the forward's 64-row states for the backward (chunk_size 64)


# ----------------------------------------------------------------------------------------------
# segment (per-sequence) scans over [B, T, H]; varlen packs N sequences along T with B = 1
# ----------------------------------------------------------------------------------------------
def _cumsum_t(x: torch.Tensor) -> torch.Tensor:
    """cumsum over T of [B, T, H], run on a time-last copy: PyTorch's scan over a middle dim of
    [8, 8192, 16] float64 took 2 ms on an H100 (docs/performance.md), the innermost scan a few us."""
    return x.transpose(1, 2).contiguous().cumsum(-1).transpose(1, 2).contiguous()


def _cummax_t(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    vals, idx = torch.cummax(x.transpose(1, 2).contiguous(), -1)
    return vals.transpose(1, 2).contiguous(), idx.transpose(1, 2).contiguous()


@dataclasses.dataclass
class _Segments:
    cu: torch.Tensor | None  # [N + 1] int64 or None (then every batch row is one sequence)
    seq: torch.Tensor | None  # [T] sequence of each token
    bos: torch.Tensor | None  # [T] first token of its sequence
    eos: torch.Tensor | None  # [T] one past its last token

    @classmethod
    def build(cls, T: int, cu: torch.Tensor | None, device) -> _Segments:
        if cu is None:
            return cls(None, None, None, None)
        cu = cu.to(device=device, dtype=torch.int64)
        seq = torch.searchsorted(cu[1:], torch.arange(T, device=device), right=True)
        return cls(cu, seq, cu[seq], cu[seq + 1])

    def cumsum(self, x: torch.Tensor) -> torch.Tensor:
        cs = _cumsum_t(x)
        if self.cu is None:
            return cs
        return cs - (cs - x)[:, self.bos]

    def rev_cumsum(self, x: torch.Tensor) -> torch.Tensor:
        """sum_{t >= u, same sequence} x_t."""
        if self.cu is None:
            return _cumsum_t(x.flip(1)).flip(1)
        cs = _cumsum_t(x)
        return cs[:, self.eos - 1] - cs + x

    def cummax(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cu is None:
            return _cummax_t(a)
        # sequences kept apart by offsets larger than the values' span (float64: exact enough)
        span = float((a.max() - a.min()).item()) + 1.0 if a.numel() else 1.0
        off = (self.seq.to(a.dtype) * (2.0 * span))[None, :, None]
        vals, idx = _cummax_t(a + off)
        return vals - off, idx

    def per_sequence_sum(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H] -> [N, H]."""
        if self.cu is None:
            return x.sum(1)
        cs = torch.cat([x.new_zeros(x.shape[0], 1, x.shape[2]), _cumsum_t(x)], 1)[0]  # [T + 1, H]
        return cs[self.cu[1:]] - cs[self.cu[:-1]]

    def last(self, x: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """x at each sequence's last token ([N, H]); x0 [N, H] for empty sequences."""
        if self.cu is None:
            return x[:, -1] if x.shape[1] else x0
        lens = self.cu[1:] - self.cu[:-1]
        return torch.where(lens[:, None] > 0, x[0, (self.cu[1:] - 1).clamp(min=0)], x0)

    def first_of_seq(self, T: int, device) -> torch.Tensor:
        """[T] bool: first token of its sequence."""
        t = torch.arange(T, device=device)
        return t == 0 if self.cu is None else t == self.bos


@dataclasses.dataclass
class _Gates:
    gq: torch.Tensor  # [B, T, H] log2, query side, restarting every L
    gk: torch.Tensor  # [B, T, H] log2, key side
    gb: torch.Tensor | None  # [B, T, H] log2, the row before each outer chunk (exp only)
    lo: torch.Tensor | float  # the normalizer's lower bound: e^{-m} [B, T, H] fp32, or 1
    m: torch.Tensor | None  # [B, T, H] float64 max state (exp)
    idx: torch.Tensor | None  # [B, T, H] argmax of the prefix max (-1: m_0)
    ig: torch.Tensor  # [B, T, H] log input gate (float64 for "exp", the accumulator dtype for "sigmoid")


def _gates(i, f, m0, opts: MLSTMOptions, seg: _Segments, acc: torch.dtype, varlen=None) -> _Gates:
    B, T, H = i.shape
    L = opts.chunk_size
    if opts.input_gate == "sigmoid":
        # no max state: only the chunk-local sums of log f, in the accumulator dtype on the shared cumsum kernel
        # (sums of <= L terms; the float64 path below spent ~0.35 ms of PyTorch scans and copies per fwd+bwd at
        # B = 8, T = 8192, H = 16 on an H100: docs/performance.md)
        ig = F.logsigmoid(i.to(acc))
        gq = chunk_local_cumsum(F.logsigmoid(f.to(acc)), L, scale=LOG2E, out_dtype=acc, floor=LOG_DECAY_FLOOR,
                                cu_seqlens=varlen.cu_seqlens if varlen is not None else None,
                                chunk_indices=varlen.chunk_indices if varlen is not None else None)
        return _Gates(gq, gq - ig * LOG2E, None, 1.0, None, None, ig)
    logf = F.logsigmoid(f.double()).clamp_min(LOG_DECAY_FLOOR)  # (utils.LOG_DECAY_FLOOR: why)
    ig = i.double()
    Fc = seg.cumsum(logf)  # F_t, per sequence
    t = torch.arange(T, device=i.device)
    pos = t if seg.cu is None else t - seg.bos
    c0 = t - pos % L  # first row of the outer chunk
    Fl = Fc - (Fc - logf)[:, c0]  # restarting every L
    cm, idx = seg.cummax(ig - Fc)
    m0t = (m0.double() if m0 is not None else torch.zeros(seg_count(seg, B), H, dtype=torch.float64,
                                                           device=i.device))
    m0_tok = m0t[None] if seg.cu is not None else m0t[:, None]  # [B, T or 1, H]
    m0_tok = m0_tok[:, seg.seq] if seg.cu is not None else m0_tok
    M = torch.maximum(m0_tok, cm)
    idx = torch.where(m0_tok >= cm, torch.full_like(idx, -1), idx)
    m = Fc + M
    m_prev = torch.cat([m.new_zeros(B, 1, H), m[:, :-1]], 1)
    first = seg.first_of_seq(T, i.device)[None, :, None]
    m_prev = torch.where(first, m0_tok.expand_as(m), m_prev)
    gq = ((Fl - m) * LOG2E).to(acc)
    gk = ((Fl - ig) * LOG2E).to(acc)
    gb = (-m_prev * LOG2E).to(acc)
    lo = torch.exp(-m).to(acc)
    return _Gates(gq, gk, gb, lo, m, idx, ig)


def seg_count(seg: _Segments, B: int) -> int:
    return B if seg.cu is None else seg.cu.numel() - 1


def _argmax_grad(dM: torch.Tensor, idx: torch.Tensor, seg: _Segments) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient of ``M_t = max(m_0, max_{s <= t} a_s)``: to a_s (``[B, T, H]``) and to m_0 (``[N, H]``).
    Within a sequence the argmax is non-decreasing, so each s receives the sum over one run of t
    (prefix-sum differences; unique scatter targets: deterministic)."""
    B, T, H = dM.shape
    cs = _cumsum_t(dM)
    run_end = torch.ones_like(idx, dtype=torch.bool)
    run_end[:, :-1] = idx[:, :-1] != idx[:, 1:]
    valid = run_end & (idx >= 0)
    start = idx.clamp(min=0)
    prev = torch.where(start > 0, cs.gather(1, (start - 1).clamp(min=0)), torch.zeros_like(cs))
    val = torch.where(valid, cs - prev, torch.zeros_like(cs))
    da = dM.new_zeros(B, T + 1, H)
    da.scatter_(1, torch.where(valid, start, torch.full_like(start, T)), val)
    dm0 = seg.per_sequence_sum(torch.where(idx < 0, dM, torch.zeros_like(dM)))
    return da[:, :T], dm0


# ----------------------------------------------------------------------------------------------
# forward / backward
# ----------------------------------------------------------------------------------------------
def _c0(C0, acc):
    return C0.to(acc) if C0 is not None else None


def chunk_mlstm_fwd(q, k, v, i, f, C0, n0, m0, opts: MLSTMOptions, varlen=None):
    """Plain forward: ``(h, (C, n, m) or None, den)``; den [B, T, H] the normalizer's dot (or None).

    Two kernels after the gate preparation: the state recurrence carries C and n together (n is the
    same recurrence with v = 1), and the tiled output forms the normalizer's row sums in the same pass
    and divides before its only store (``chunk_simple_gla_fwd(n_state=True, normalizer=...)``)."""
    B, T, H, _V = v.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    seg = _Segments.build(T, varlen.cu_seqlens if varlen is not None else None, q.device)
    gt = _gates(i, f, m0, opts, seg, acc, varlen)
    norm = dict(lo=gt.lo if isinstance(gt.lo, torch.Tensor) else None, eps=opts.eps) if opts.normalize else None
    h, hC, _, *nrm = chunk_simple_gla_fwd(
        q, k, v, None, opts.scale, _c0(C0, acc), opts.output_final_state, opts.chunk_size, varlen, g_cum=gt.gq,
        gk_cum=gt.gk, gb=gt.gb, out_dtype=v.dtype, n_state=opts.aug,
        initial_n=n0.to(acc) if n0 is not None else None, normalizer=norm, return_states=opts.save_states)
    states = tuple(nrm[-2:]) if opts.save_states else None
    nrm = nrm[:-2] if opts.save_states else nrm
    den, n_final = nrm if opts.aug else (None, None)
    final = None
    if opts.output_final_state:
        N = seg_count(seg, B)
        if opts.input_gate == "exp":
            m0t = m0.to(acc) if m0 is not None else torch.zeros(N, H, dtype=acc, device=q.device)
            final = (hC, n_final, seg.last(gt.m, m0t.double()).to(acc))
        else:
            final = (hC, n_final)
    if opts.save_states:
        return h, final, den, states
    return h, final, den


# the state-gradient recurrence for 16-bit inputs: its q-term as one bf16 product (dO 2^G rounded once, no hi + lo
# split), which lets wider value tiles run without spilling. H100, B = 8, T = 8192, H = 16, K = 128, V = 256,
# sigmoid fwd+bwd: 8.322 -> 8.195 ms without the split (bf16 errors against float64 unchanged to 2 digits); that
# kernel 2.638 ms at 32 columns / 4 warps (the default before), 2.20 at 64 / 4, 2.13 at 128 / 8 (exp: 2.62 / 2.39)
# (docs/performance.md, 2026-11-23, c36da31). fp32 tiles keep the shared default (twice the shared memory)
STATE_BWD_CONFIG = {"qsplit": False, "BV": 128, "num_warps": 8}
# narrower when that leaves fewer programs than SMs: each program is a chain of T / 64 steps, and at the TFLA paper's
# T = 65536 (B = 1, H = 16) 128 columns give 32 programs (H100: fwd+bwd 17.54 ms, 14.48 at 32 columns in an older tree)
STATE_BWD_NARROW = ({"qsplit": False, "BV": 64, "num_warps": 4}, {"qsplit": False, "BV": 32, "num_warps": 4})


def _state_bwd_config(q: torch.Tensor, num_seqs: int, H: int, V: int) -> dict | None:
    """The state-gradient recurrence's launch for 16-bit inputs (None: the shared default, fp32): the widest of
    128 / 64 / 32 value columns whose ``num_seqs * H * cdiv(V, BV)`` programs still cover the device's SMs."""
    if q.element_size() != 2:
        return None
    sms = sm_count(q)
    for cfg in (STATE_BWD_CONFIG,) + STATE_BWD_NARROW:
        if num_seqs * H * cdiv(V, cfg["BV"]) >= sms:
            return cfg
    return STATE_BWD_NARROW[-1]


def chunk_mlstm_bwd(q, k, v, i, f, C0, n0, m0, h, den, final, dh, dC, dn, dm, opts: MLSTMOptions, varlen=None,
                    states=None):
    """Plain backward: ``(dq, dk, dv, di, df, dC0, dn0, dm0)``. ``states``: the forward's ``(h, hn)`` at L = 64
    (``chunk_mlstm_fwd`` with ``save_states``), used instead of the recompute and overwritten."""
    B, T, H, _V = v.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    seg = _Segments.build(T, varlen.cu_seqlens if varlen is not None else None, q.device)
    gt = _gates(i, f, m0, opts, seg, acc, varlen)
    gates = {"gk_cum": gt.gk, "gb": gt.gb}
    dden = sd = rl = None
    if opts.normalize:
        # dO = dh / d is not written: the kernels read dh with the row factor 2^rl = 1 / d (chunk_simple_gla_bwd
        # (do_row_log2=..) applies it in the gates where it can, else scales a copy; H100: peak 3196 -> 2696 MiB)
        rl, sd, dden = normalizer_bwd_prep(dh, h, den, gt.lo if isinstance(gt.lo, torch.Tensor) else None,
                                           opts.eps, exact=not opts.detach_normalizer)
        do = dh
    else:
        do = dh.to(q.dtype)
    C0a = _c0(C0, acc)
    sb_cfg = _state_bwd_config(q, seg_count(seg, B), H, _V)
    dn0 = None
    dC = dC.to(acc).contiguous() if dC is not None else None
    if opts.aug and (dden is not None or dn is not None or n0 is not None):
        # the normalizer is the same product with one more value column of ones: its cotangent dden and
        # the n / dn states ride along in the numerator's kernels (one backward pass)
        # (the initial state comes whole: n0 is given exactly when C0 is)
        if dden is None:
            dden = torch.zeros(B, T, H, dtype=acc, device=q.device)
        dq, dk, dv, dlogf, dh0, dn0, kdk = chunk_simple_gla_bwd(
            q, k, v, gt.gq, opts.scale, C0a, do.contiguous(), dC, opts.chunk_size, varlen, **gates,
            dden=dden.contiguous(), initial_n=n0.to(acc).contiguous() if n0 is not None else None,
            dnt=dn.to(acc).contiguous() if dn is not None else None, kdot=True, states=states, do_row_log2=rl,
            state_bwd_config=sb_cfg)
    else:
        dq, dk, dv, dlogf, dh0, kdk = chunk_simple_gla_bwd(q, k, v, gt.gq, opts.scale, C0a, do.contiguous(), dC,
                                                           opts.chunk_size, varlen, **gates, kdot=True,
                                                           states=states, do_row_log2=rl,
                                                           state_bwd_config=sb_cfg)
    dC0 = dh0
    # k . dk per row (fp32, in wy_bwd): e^{ig_s} scales every use of k_s. float64 only for the max state's path
    exp = opts.input_gate == "exp"
    dig = kdk.double() if exp else kdk
    dlogf = dlogf.double() if exp else dlogf
    dm0 = None
    if opts.input_gate == "exp":
        # the m path: dm_t = -eps (dh_t . h_t) / den_t, plus the returned final m and states' scaling
        dM = -opts.eps * sd.double()
        if opts.detach_normalizer:
            dM = torch.zeros_like(dM)
        if final is not None and (dC is not None or dn is not None or dm is not None):
            dmT = dm.double() if dm is not None else torch.zeros_like(final[2], dtype=torch.float64)
            if dC is not None:
                dmT = dmT - (dC.double() * final[0].double()).sum((-2, -1))
            if dn is not None:
                dmT = dmT - (dn.double() * final[1].double()).sum(-1)
            last = torch.zeros_like(dM)
            if seg.cu is None:
                last[:, -1] = dmT
            else:
                lens = seg.cu[1:] - seg.cu[:-1]
                ends = (seg.cu[1:] - 1).clamp(min=0)
                # (an empty sequence adds 0 at a neighbour's end: exact in any order)
                last[0].index_put_((ends,), torch.where(lens[:, None] > 0, dmT, torch.zeros_like(dmT)),
                                   accumulate=True)
            dM = dM + last
        da, dm0_max = _argmax_grad(dM, gt.idx, seg)  # a_s = ig_s - F_s
        dig = dig + da
        dlogf = dlogf + seg.rev_cumsum(dM - da)  # m_t = F_t + M_t; a_s = ig_s - F_s
        dm0 = dm0_max
        if dC0 is not None:  # the initial state is stabilized by m_0: C~_0 = e^{m_0} C_0
            dm0 = dm0 + (dC0.double() * C0.double()).sum((-2, -1))
        if dn0 is not None:
            dm0 = dm0 + (dn0.double() * n0.double()).sum(-1)
        if seg.cu is not None:  # an empty sequence passes its m_0 straight to its final m
            lens = seg.cu[1:] - seg.cu[:-1]
            if dm is not None:
                dm0 = dm0 + torch.where(lens[:, None] == 0, dm.double(), torch.zeros_like(dm0))
        di = dig
    else:
        di = dig * torch.sigmoid(-i.to(dig.dtype))
    fd = f.to(dlogf.dtype)  # d log sigmoid(f) / df, 0 where the floor holds log sigmoid(f)
    df = torch.where(F.logsigmoid(fd) >= LOG_DECAY_FLOOR, dlogf * torch.sigmoid(-fd), 0.0)
    return dq, dk, dv, di, df, dC0, dn0, dm0


class ChunkMLSTMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, i, f, C0, n0, m0, varlen, opts: MLSTMOptions):
        h, final, den, *states = chunk_mlstm_fwd(q, k, v, i, f, C0, n0, m0, opts, varlen)
        # save_states: the 64-row states (and n's) kept for one backward, which overwrites them (dS over S)
        ctx.states = states[0] if states else None
        ctx.save_for_backward(q, k, v, i, f, C0, n0, m0, h, den,
                              *(final if final is not None and opts.input_gate == "exp" else ()))
        ctx.varlen, ctx.opts = varlen, opts
        if final is None:
            return h, None, None, None
        if opts.input_gate == "exp":
            return h, final[0], final[1], final[2]
        return h, final[0], final[1], None

    @staticmethod
    @on_input_device
    def backward(ctx, dh, dC, dn, dm):
        # the backward's chunk size (see BWD_CHUNK_SIZE); den and h do not depend on L. The varlen tables
        # for it are built here (from the bounds already on the host), not on every forward call
        opts, varlen = ctx.opts, ctx.varlen
        if opts.chunk_size != BWD_CHUNK_SIZE:
            opts = dataclasses.replace(opts, chunk_size=BWD_CHUNK_SIZE)
            varlen = varlen.with_chunk_size(BWD_CHUNK_SIZE) if varlen is not None else None
        q, k, v, i, f, C0, n0, m0, h, den, *final = ctx.saved_tensors
        states, ctx.states = ctx.states, None  # a second backward (retain_graph) recomputes them
        if dh is None:
            dh = torch.zeros_like(v)
        check_cotangent("h", dh, v.shape, v.dtype)
        dq, dk, dv, di, df, dC0, dn0, dm0 = chunk_mlstm_bwd(
            q, k, v, i, f, C0, n0, m0, h, den, tuple(final) if final else None, dh.contiguous(), dC, dn, dm,
            opts, varlen, states=states)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), di.to(i.dtype), df.to(f.dtype),
                dC0.to(C0.dtype) if (C0 is not None and dC0 is not None) else None,
                dn0.to(n0.dtype) if (n0 is not None and dn0 is not None) else None,
                dm0.to(m0.dtype) if (m0 is not None and dm0 is not None) else None, None, None)


def _check(q, k, v, i, f, input_gate, normalize, eps, scale, initial_state, cu_seqlens, chunk_size):
    B, T, H, _, K, V = check_qkv(q, k, v, grouped=False)
    check_mlstm_options(input_gate, normalize, eps, scale)
    for name, g in (("i", i), ("f", f)):
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != (B, T, H):
            raise ValueError(f"`{name}` must be the gate pre-activation per token and head, shape [B, T, H] = "
                             f"{(B, T, H)}, got {tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__}")
        check_tensor(name, g, 3)
        if not g.is_floating_point():
            raise TypeError(f"`{name}` must be a float tensor, got {g.dtype}")
    if initial_state is not None:
        N = B if cu_seqlens is None else (cu_seqlens.numel() - 1 if isinstance(cu_seqlens, torch.Tensor) else B)
        check_mlstm_state(initial_state, input_gate, N, H, K, V, q.device, name="initial_state")
    check_common(q, (("q", q), ("k", k), ("v", v), ("i", i), ("f", f)), scale, None, cu_seqlens, chunk_size,
                 (H, K, V), "H, K, V")


@on_input_device
def chunk_mlstm(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    *,
    input_gate: str = "exp",
    normalize: bool = True,
    eps: float = 1e-6,
    scale: float | None = None,
    initial_state: tuple[torch.Tensor, ...] | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    detach_normalizer: bool = False,
    save_states: bool = False,
):
    r"""The mLSTM, chunkwise on tfla's two-level engine (TFLA paper, Sections 2-4; mlstm_kernels'
    semantics, tfla's ``[B, T, H, K]`` layout).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; fp32, fp16 or bf16 (all the same dtype).
        i, f: input and forget gate pre-activations ``[B, T, H]`` (any float dtype; used in fp32/float64).
        input_gate: ``"exp"`` (xLSTM's exponential gate, stabilized by the max state m) or ``"sigmoid"``
            (mLSTMsig: log sigmoid input gate, no max state).
        normalize: divide by ``max(|scale n_t . q_t|, e^{-m_t}) + eps`` ("exp"; required) or
            ``max(|scale n_t . q_t|, 1) + eps`` ("sigmoid"); ``normalize=False`` (sigmoid only) returns
            the plain gated product (the paper's mLSTMsig without normalizer).
        eps: added to the normalizer (default 1e-6, as mlstm_kernels).
        scale: ``q . k`` scale, default ``K ** -0.5``.
        initial_state: ``(C [N, H, K, V], n [N, H, K], m [N, H])`` for "exp", ``(C, n)`` for "sigmoid"
            (C, n stabilized by m as in mlstm_kernels); N = B, or the number of sequences with cu_seqlens.
        output_final_state: also return the final state (same structure, fp32).
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B = 1); each starts from its initial state.
        chunk_size: the forward's outer chunk L in {64, 128, 256, 512} (default 128); the backward
            always runs at L = 64 (it stores states every 64 rows regardless; a larger L there only adds
            intra-chunk work), so L trades forward speed against the forward's state memory.
        detach_normalizer: treat the normalizer ``max(|n . q|, e^{-m}) + eps`` and the max state as
            constants in the backward pass, as mlstm_kernels' Triton kernels do (TFLA paper, Appendix
            B.3); the default False gives the exact gradient of the output. The forward is the same.
        save_states: keep the forward's states (every 64 rows; ``chunk_size=64`` required) for the backward
            instead of recomputing them there: faster training at ``B * T/64 * H * K * V`` elements in q's dtype
            (plus the fp32 normalizer states) held between forward and backward (1 GiB at B = 8, T = 8192, H = 16,
            K = 128, V = 256, bf16; measured times in the op's README). Like mlstm_kernels'
            ``recompute_states_in_bw=False``. The backward overwrites them: a second backward recomputes.

    Returns ``(h [B, T, H, V] in v's dtype, final_state or None)``; differentiable in q, k, v, i, f and
    the initial state (m included).

    Raises ValueError/TypeError naming the argument for wrong shapes or dtypes, an unknown input gate,
    ``normalize=False`` with the exponential gate, negative eps, unsupported sizes or devices.
    """
    _check(q, k, v, i, f, input_gate, normalize, eps, scale, initial_state, cu_seqlens, chunk_size)
    if save_states and chunk_size != BWD_CHUNK_SIZE:
        raise ValueError(f"save_states needs chunk_size={BWD_CHUNK_SIZE} (the backward's states are the 64-row "
                         f"ones), got chunk_size={chunk_size}")
    _B, T, _H, K = q.shape
    compiling = torch.compiler.is_compiling()  # then custom ops (library.py): no host reads here
    varlen = None
    if cu_seqlens is not None and not compiling:
        varlen = VarlenIndex.build(cu_seqlens, chunk_size)
        check_varlen_bounds(varlen.bounds, T)
    if scale is None:
        scale = K ** -0.5
    opts = MLSTMOptions(input_gate, bool(normalize), float(eps), float(scale), int(chunk_size),
                        bool(output_final_state),
                        aug=bool(normalize or output_final_state or initial_state is not None),
                        detach_normalizer=bool(detach_normalizer), save_states=bool(save_states))
    C0 = n0 = m0 = None
    if initial_state is not None:
        C0, n0 = initial_state[0].contiguous(), initial_state[1].contiguous()
        m0 = initial_state[2].contiguous() if input_gate == "exp" else None
    q, k, v, i, f = (x.contiguous() for x in (q, k, v, i, f))
    if compiling:
        from tfla.ops.mlstm.library import mlstm_fwd

        h, C, n, m, _ = mlstm_fwd(q, k, v, i, f, C0, n0, m0, cu_seqlens, opts.input_gate, opts.normalize, opts.eps,
                                  opts.scale, opts.chunk_size, opts.output_final_state, opts.aug,
                                  opts.detach_normalizer)
    else:
        args = (q, k, v, i, f, C0, n0, m0, varlen, opts)
        h, C, n, m = precompile.apply(autograd_call(ChunkMLSTMFunction), args, q, lambda: (
            "mlstm", precompile.signature(q, v, i, f, C0, n0, m0), q.shape[1] % 64 == 0, table_kind(varlen), opts))
    if not output_final_state:
        return h, None
    return h, ((C, n, m) if input_gate == "exp" else (C, n))
