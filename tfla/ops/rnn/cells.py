"""Multi-head Elman, LSTM, GRU and sLSTM (FlashRNN's cells) on three paths. Fused (``fused.py``; the default for head
dims up to 64 and 16-bit or fp32 inputs): one launch runs all time steps with the states and R on chip. Team
(``team.py``; the default above D = 64): a team of programs per head, each owning a slice of the units, meeting at
a grid barrier every step. Alternating (float64): per time step one batched matmul ``R h_{t-1}`` for all gates and
heads (PyTorch, fp32 accumulation), then one fused Triton pointwise kernel. ``config={"path": ...}`` forces one.

Notation: B batch, T time, G gates, NH heads, D head dim, S states of the cell, N sequences (B, or
``len(cu_seqlens) - 1`` for varlen), Tm the longest sequence.

Backward (alternating): time in reverse, one fused pointwise kernel per step (pre-activation gradients, carried c / n
gradients), the recurrent gradient ``R^T`` (pre-activation gradients) as one batched matmul per step; the fused
and team paths do all steps in one launch. After the loop, all: dR as one batched matmul over all (t, batch) rows and db
as one sum. Definitions: ``README.md`` here.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from tfla.ops.common import precompile
from tfla.ops.common.utils import (SUPPORTED_DTYPES, autograd_call, cdiv, check_device, host_ints, interpret_mode,
                                   next_pow2, on_input_device)
from tfla.ops.common.varlen import cached_bounds
from tfla.ops.rnn import pointwise
from tfla.ops.rnn.fused import MAX_FUSED_D, compile_check, rnn_fused_bwd, rnn_fused_fwd
from tfla.ops.rnn.team import TEAM_COLS, rnn_team_bwd, rnn_team_fwd
from tfla.ops.rnn.team import compile_check as team_compile_check
from tfla.ops.rnn.tiling import (H100, TEAM_WARPS, DeviceLimits, FusedFeedback, TeamFeedback, TeamLaunch,
                                 choose_fused_launch, choose_fused_launch_compiled, choose_team_launch,
                                 choose_team_launch_compiled, team_bk)
from tfla.ops.rnn.reference import CELL_GATES, CELL_STATES
from tfla.ops.rnn.weight_grad import dR_db
from tfla.utils.validation import check_cotangent, check_tensor, check_varlen_bounds

_CELL_IDS = {"elman": pointwise.ELMAN.value, "lstm": pointwise.LSTM.value, "gru": pointwise.GRU.value,
             "slstm": pointwise.SLSTM.value}
_MAX_BLOCK = 1024
FUSED_AUTO_MAX_D = 64  # head dims the fused path takes by default (R of all gates on chip)
CONFIG_KEYS = {"path": ("auto", "fused", "team", "alternating"), "BB": (16, 32, 64), "num_warps": (1, 2, 4, 8),
               "num_stages": (1, 2, 3), "team_cols": TEAM_COLS, "team_BK": (32, 64, 128, 256),
               "team_sync": (True, False), "team_resident": (True, False)}


@dataclasses.dataclass(frozen=True)
class Launch:
    """How the kernels run: ``path`` "fused" (``fused.py``) or "team" (``team.py``; BC units per member, BK the dots'
    slice of D, ``sync``: one launch with a grid barrier, else one launch per step), with BB batch rows per program,
    ``num_warps`` and ``num_stages``."""
    path: str
    BB: int
    num_warps: int
    num_stages: int
    BC: int = 0
    BK: int = 0
    sync: bool = False
    resident: bool = False


@dataclasses.dataclass(frozen=True)
class RNNOptions:
    cell: str
    lengths: tuple[int, ...]  # steps of each of the N sequences (all T without varlen)
    output_final_state: bool
    state_sequence: bool = False  # also output the states after h (c; c, n, m) after every step
    fused: Launch | None = None  # the fused or team path's launch; None: alternating


def check_config(config, dtype: torch.dtype, D: int) -> None:
    """``config`` of the cells: None or a dict with keys ``CONFIG_KEYS`` (values among those listed)."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise TypeError(f"`config` must be None or a dict, got {type(config).__name__}")
    for k, v in config.items():
        if k not in CONFIG_KEYS:
            raise ValueError(f"`config` key {k!r} unknown; keys: {tuple(CONFIG_KEYS)}")
        if v not in CONFIG_KEYS[k] or isinstance(v, bool) != (k in ("team_sync", "team_resident")):
            raise ValueError(f"`config[{k!r}]` must be one of {CONFIG_KEYS[k]}, got {v!r}")
    path = config.get("path")
    if path in ("fused", "team") and dtype == torch.float64:
        raise ValueError(f"`config['path']={path!r}` takes float32/float16/bfloat16 inputs; float64 runs the "
                         "alternating path")
    if path == "fused" and D > MAX_FUSED_D:
        raise ValueError(f"`config['path']='fused'` takes head dims up to {MAX_FUSED_D}, got D={D}")


@functools.lru_cache(maxsize=16)
def _device_limits(index: int) -> DeviceLimits:
    return DeviceLimits.from_device(index)


@functools.lru_cache(maxsize=None)
def _compile_feedback(index: int) -> FusedFeedback:
    """GPU ``index``'s fused launches compiled by the launch search's checks (``choose_fused_launch_compiled``): a
    cache of what the compiler produced, like Triton's own kernel cache (a kernel's registers and spills do not
    change within a process)."""
    return FusedFeedback()


@functools.lru_cache(maxsize=None)
def _team_feedback(index: int) -> TeamFeedback:
    """GPU ``index``'s team launches compiled by the team search's checks (``choose_team_launch_compiled``), as
    ``_compile_feedback`` for the fused path."""
    return TeamFeedback()


_TEAM_CHOICES: dict = {}  # (GPU, cell, shape, fixed values) -> the compiled search's TeamLaunch


def _team_compiled(index: int, cell: str, N: int, NH: int, D: int, dtype, BK, sync, num_warps, BB, BC, resident,
                   num_stages, check=None) -> TeamLaunch | None:
    """``choose_team_launch_compiled`` on GPU ``index`` for ``cell``: each candidate compiled at most once per
    process (``_team_feedback``), by ``check(launch) -> (spill bytes, failed) or None`` where given (the call's own
    dry run: ``rnn``) and else, or where it returns None, by ``team.compile_check``; the choice kept per shape and
    fixed values, so a repeated call does not search again."""
    key = (index, cell, N, NH, D, dtype, BK, sync, num_warps, BB, BC, resident, num_stages)
    if key not in _TEAM_CHOICES:
        G, S = len(CELL_GATES[cell]), len(CELL_STATES[cell])
        compile_only = functools.partial(team_compile_check, _CELL_IDS[cell], G, S, D, dtype, N=N, NH=NH,
                                         device=torch.device("cuda", index), sync=sync, num_warps=num_warps)
        compiled = compile_only if check is None else (lambda t: check(t) or compile_only(t))
        _TEAM_CHOICES[key] = choose_team_launch_compiled(
            N, NH, D, dtype, _device_limits(index), cell=cell, feedback=_team_feedback(index), compiled=compiled,
            BK=BK, BB=BB, team_cols=BC, team_resident=resident, num_stages=num_stages)
    return _TEAM_CHOICES[key]


def fused_launch(config, dtype: torch.dtype, N: int, NH: int, D: int, device: torch.device | None = None, *,
                 cell: str | None = None, check=None) -> Launch | None:
    """The path of a (checked) ``config`` for N rows and NH heads of D units (``cell``: that cell's kernels, None:
    the most demanding of the four): a ``Launch`` of the fused or team path, or None for the alternating one.
    Default: fused with D <= FUSED_AUTO_MAX_D, team above, alternating for float64 (the fused path at D = 128 is
    faster where it fits: H100, bf16, LSTM, B = 16, T = 1024, D x NH = 128 x 6, fused 2.95 / 9.80 ms forward /
    forward + backward, team 4.43 / 10.62 at 071f7e5; but the sLSTM's fused backward needs 266 KB of shared memory
    there). The launch settings come from the constraint search of ``tiling.py`` under the device's limits (a CUDA
    device's own, the H100's on the CPU interpreter), with the config's keys as fixed variables: fused
    ``choose_fused_launch`` (BB, warps, stages; on the H100 at the shapes measured 16 rows, 8 warps above D = 32 else
    4, the most stages that fit: 3 for 16-bit inputs; on a GPU with a cell given, ``choose_fused_launch_compiled``:
    choices near the register limit are compiled first and a spilling or failing one is passed over), team
    ``choose_team_launch`` (BB, units per member, R held or streamed, stages; 4 warps; on a GPU with a cell given,
    ``choose_team_launch_compiled``: the choice is compiled before it runs, one that fails to compile is passed over
    and one that spills kilobytes ranks after those that do not; ``check(launch)``: how a candidate ``Launch`` is
    compiled for that, returning ``(spill bytes, failed)`` or None, default ``team.compile_check``). Where no
    candidate meets the
    constraints (a config the device cannot take; on the interpreter it still runs) the config's values, else those
    hand-set ones, are taken as they are, and a launch beyond the GPU's resources raises ValueError naming
    ``config``."""
    cfg = config or {}
    path = cfg.get("path", "auto")
    if path == "auto":
        path = "alternating" if dtype == torch.float64 else "fused" if D <= FUSED_AUTO_MAX_D else "team"
    if path == "alternating":
        return None
    on_gpu = device is not None and device.type == "cuda"
    limits = _device_limits(device.index or 0) if on_gpu else H100
    N = max(N, 1)  # an empty batch launches nothing; any launch will do
    if path == "fused":
        fixed = dict(BB=cfg.get("BB"), num_warps=cfg.get("num_warps"), num_stages=cfg.get("num_stages"))
        if on_gpu and cell is not None and not interpret_mode():  # compiler feedback near the register limit
            G, S = len(CELL_GATES[cell]), len(CELL_STATES[cell])
            check = functools.partial(compile_check, _CELL_IDS[cell], G, S, D, dtype, N=N, NH=NH, device=device)
            got = choose_fused_launch_compiled(N, NH, D, dtype, limits, cell=cell,
                                               feedback=_compile_feedback(device.index or 0), compiled=check, **fixed)
        else:
            got = choose_fused_launch(N, NH, D, dtype, limits, cell=cell, **fixed)
        if got is None:
            got = (cfg.get("BB", 16), cfg.get("num_warps", 8 if D > 32 else 4), cfg.get("num_stages", 2))
        return Launch("fused", *got)
    fixed = dict(BB=cfg.get("BB"), team_cols=cfg.get("team_cols"), team_resident=cfg.get("team_resident"),
                 num_stages=cfg.get("num_stages"))
    if on_gpu and cell is not None and not interpret_mode():  # compiler feedback: spills and failures
        as_launch = functools.partial(_team_launch, cfg=cfg, N=N, NH=NH, D=D, limits=limits)
        t = _team_compiled(device.index or 0, cell, N, NH, D, dtype, cfg.get("team_BK"), cfg.get("team_sync"),
                           cfg.get("num_warps", TEAM_WARPS), *fixed.values(),
                           check=None if check is None else (lambda c: check(as_launch(c))))
    else:
        t = choose_team_launch(N, NH, D, dtype, limits, BK=cfg.get("team_BK"), **fixed)
    if t is None:
        res = bool(fixed["team_resident"])
        BB = fixed["BB"] or min(64, max(16, next_pow2(N)))
        BC = fixed["team_cols"] or TEAM_COLS[0]
        t = TeamLaunch(BB, BC, team_bk(D, dtype, res, cfg.get("team_BK")), res,
                       fixed["num_stages"] or (2 if dtype == torch.float32 else 3),
                       cdiv(D, BC) * cdiv(N, BB) * NH <= limits.sms)
    return _team_launch(t, cfg, N, NH, D, limits)


def _team_launch(t: TeamLaunch, cfg: dict, N: int, NH: int, D: int, limits: DeviceLimits) -> Launch:
    """The cells' ``Launch`` of a team search result under ``cfg`` (its sync and warps)."""
    sync = cfg.get("team_sync")
    if sync is None:
        sync = t.fits and not interpret_mode()
    elif sync and (not t.fits or interpret_mode()):
        raise ValueError(f"`config['team_sync']=True` needs the grid ({cdiv(D, t.BC) * cdiv(N, t.BB) * NH} programs) "
                         f"to fit the GPU's {limits.sms} SMs at once on a GPU; take more `team_cols` or leave it unset")
    return Launch("team", t.BB, cfg.get("num_warps", TEAM_WARPS), t.num_stages, t.BC, t.BK, sync, t.resident)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tl_acc(dtype: torch.dtype):
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def _block(E: int) -> int:
    return min(_MAX_BLOCK, next_pow2(E))


def rnn_fwd(cell: str, x, R, b, state0, fused: Launch | None = None):
    """Forward on a padded batch. x ``[N, Tm, G, NH, D]``; state0 ``[S, NH, N, D]`` (ACC dtype); fused: the
    ``Launch`` of the fused or team path (``fused_launch``), or None for the alternating path.

    Returns ``(o [N, Tm, NH, D] in x's dtype, states [Tm + 1, S, NH, N, D], rh [Tm, NH, N, G * D], Wt, b_acc)``
    with ``Wt [NH, D, G * D]`` (R as the right operand of ``h @ Wt``; in x's dtype on the team path with 16-bit x,
    whose members stream it from L2 every step, else ACC) and every state step kept for the backward (the same
    for every path).
    """
    N, Tm, G, NH, D = x.shape
    acc = _acc(x.dtype)
    w_dtype = x.dtype if fused is not None and fused.path == "team" else acc
    Wt = R.to(w_dtype).permute(1, 3, 0, 2).reshape(NH, D, G * D)  # Wt[n, d, g*D + e] = R[g, n, e, d]
    b_acc = b.to(acc).contiguous()
    states = torch.empty(Tm + 1, *state0.shape, device=x.device, dtype=acc)
    states[0] = state0
    rh = torch.empty(Tm, NH, N, G * D, device=x.device, dtype=acc)
    o = torch.empty(N, Tm, NH, D, device=x.device, dtype=x.dtype)
    if fused is not None and fused.path == "team":
        rnn_team_fwd(_CELL_IDS[cell], x, Wt, b_acc, states, rh, o, fused)
        return o, states, rh, Wt, b_acc
    if fused is not None:
        rnn_fused_fwd(_CELL_IDS[cell], x, Wt, b_acc, states, rh, o, fused.BB, fused.num_warps, fused.num_stages)
        return o, states, rh, Wt, b_acc
    E = NH * N * D
    BE = _block(E)
    grid = (cdiv(E, BE),)
    for t in range(Tm):
        torch.matmul(states[t, 0], Wt, out=rh[t])
        xt, ot = x[:, t], o[:, t]
        pointwise._rnn_pointwise_fwd_kernel[grid](
            xt, rh[t], b_acc, states[t], states[t + 1], ot, N, NH, D,
            xt.stride(0), xt.stride(1), xt.stride(2), xt.stride(3), ot.stride(0), ot.stride(1), ot.stride(2),
            CELL=_CELL_IDS[cell], G=G, S=state0.shape[0], BE=BE, ACC=_tl_acc(x.dtype))
    return o, states, rh, Wt, b_acc


def rnn_bwd(cell: str, x, Wt, b_acc, states, rh, do, dstate_final, lengths, dstate_seq=None,
            fused: Launch | None = None):
    """Backward of ``rnn_fwd``. do ``[N, Tm, NH, D]``; dstate_final ``[S, NH, N, D]`` (ACC dtype; the m slot is
    ignored), added before the step ``lengths[n] - 1`` of each sequence n; dstate_seq None or ``[Tm, S - 1, NH, N,
    D]`` (ACC), the cotangents of the states after h (c; c, n, m; m ignored) after every step, added before each
    step; fused as ``rnn_fwd``'s (either path takes either's saved tensors). Returns ``(dx [N, Tm, G, NH, D]`` in
    x's dtype, ``dR [G, NH, D, D], db [G, NH, D], dstate0 [S, NH, N, D])`` in the ACC dtype."""
    N, Tm, G, NH, D = x.shape
    S = states.shape[1]
    acc = states.dtype
    dx = torch.empty(N, Tm, G, NH, D, device=x.device, dtype=x.dtype)  # (the kernels store fp32 values rounded)
    drh = torch.empty(Tm, NH, N, G * D, device=x.device, dtype=acc)
    if fused is not None:
        dstate0 = torch.zeros(S, NH, N, D, device=x.device, dtype=acc)
        args = (_CELL_IDS[cell], x, Wt, b_acc, states, rh, do, dstate_final, lengths, dstate_seq, dx, drh, dstate0)
        if fused.path == "team":
            rnn_team_bwd(*args, fused)
        else:
            rnn_fused_bwd(*args, fused.BB, fused.num_warps, fused.num_stages)
        return (dx, *dR_db(states, drh, tf32=x.dtype in (torch.float16, torch.bfloat16)), dstate0)
    dh_rec = torch.zeros(NH, N, D, device=x.device, dtype=acc)
    ds = torch.zeros(S, NH, N, D, device=x.device, dtype=acc)
    n_carried = 3 if cell == "slstm" else S  # h (and c, n); the sLSTM's m is a constant
    inject: dict[int, list[int]] = {}
    for n, L in enumerate(lengths):
        inject.setdefault(L - 1, []).append(n)

    def add_final(rows):
        idx = torch.tensor(rows, device=x.device)
        dh_rec[:, idx] += dstate_final[0][:, idx]
        if n_carried > 1:
            ds[1:n_carried, :, idx] += dstate_final[1:n_carried][:, :, idx]

    WtT = Wt.transpose(1, 2)
    E = NH * N * D
    BE = _block(E)
    grid = (cdiv(E, BE),)
    for t in range(Tm - 1, -1, -1):
        if t in inject:
            add_final(inject[t])
        if dstate_seq is not None and n_carried > 1:
            ds[1:n_carried] += dstate_seq[t, :n_carried - 1]
        xt, dot, dxt = x[:, t], do[:, t], dx[:, t]
        pointwise._rnn_pointwise_bwd_kernel[grid](
            xt, rh[t], b_acc, states[t], states[t + 1], dot, dh_rec, ds, dxt, drh[t], N, NH, D,
            xt.stride(0), xt.stride(1), xt.stride(2), xt.stride(3), dot.stride(0), dot.stride(1), dot.stride(2),
            dxt.stride(0), dxt.stride(1), dxt.stride(2), dxt.stride(3),
            CELL=_CELL_IDS[cell], G=G, S=S, BE=BE, ACC=_tl_acc(x.dtype))
        dh_rec = torch.baddbmm(ds[0], drh[t], WtT)  # direct part (GRU's z dh) + R^T (pre-activation gradients)
    if -1 in inject:  # empty sequences: the final state is the initial state
        add_final(inject[-1])
    dstate0 = torch.zeros_like(ds)
    dstate0[0] = dh_rec
    dstate0[1:n_carried] = ds[1:n_carried]
    return (dx, *dR_db(states, drh), dstate0)


class RNNFunction(torch.autograd.Function):
    """``(opts, x, R, b, *state0) -> (o, *final_state[, state_seq])``; state tensors ``[N, NH, D]`` (N =
    len(opts.lengths)); with ``opts.state_sequence`` also ``state_seq [S - 1, N, Tm, NH, D]`` (ACC dtype), the states
    after h after every step."""

    @staticmethod
    def forward(ctx, opts: RNNOptions, x, R, b, *state0):
        N, Tm, G, NH, D = x.shape
        S = len(CELL_STATES[opts.cell])
        acc = _acc(x.dtype)
        if state0:
            s0 = torch.stack([s.to(acc).transpose(0, 1) for s in state0])  # [S, NH, N, D]
        else:
            s0 = torch.zeros(S, NH, N, D, device=x.device, dtype=acc)
        o, states, rh, Wt, b_acc = rnn_fwd(opts.cell, x, R, b, s0, opts.fused)
        ctx.save_for_backward(x, Wt, b_acc, states, rh)
        ctx.opts = opts
        ctx.meta = (R.dtype, b.dtype, tuple(s.dtype for s in state0))
        seq = (states[1:, 1:].permute(1, 3, 0, 2, 4).contiguous(),) if opts.state_sequence else ()
        if not opts.output_final_state:
            return (o, *seq)
        idx = host_ints(opts.lengths, x.device, torch.long)  # (long also when B = 0)
        final = states[idx, :, :, torch.arange(N, device=x.device)]  # [N, S, NH, D]
        return (o, *(final[:, k].contiguous() for k in range(S)), *seq)

    @staticmethod
    @on_input_device
    def backward(ctx, do, *dfinal):
        x, Wt, b_acc, states, rh = ctx.saved_tensors
        opts = ctx.opts
        N, Tm, G, NH, D = x.shape
        S = states.shape[1]
        dseq = None
        if opts.state_sequence:
            *dfinal, g = dfinal
            if g is not None:
                check_cotangent("state_seq", g, (S - 1, N, Tm, NH, D), None)
                dseq = g.to(states.dtype).permute(2, 0, 3, 1, 4)  # [Tm, S - 1, NH, N, D]
        if do is None:
            do = torch.zeros(N, Tm, NH, D, device=x.device, dtype=x.dtype)
        check_cotangent("h", do, (N, Tm, NH, D), None)
        dsf = torch.zeros(S, NH, N, D, device=x.device, dtype=states.dtype)
        for k, g in enumerate(dfinal):
            if g is not None:
                check_cotangent(f"final_state[{k}]", g, (N, NH, D), None)
                dsf[k] = g.to(states.dtype).transpose(0, 1)
        dx, dR, db, ds0 = rnn_bwd(opts.cell, x, Wt, b_acc, states, rh, do, dsf, opts.lengths, dseq, opts.fused)
        R_dtype, b_dtype, s_dtypes = ctx.meta
        dstate = tuple(ds0[k].transpose(0, 1).to(dt) for k, dt in enumerate(s_dtypes))
        return (None, dx, dR.to(R_dtype), db.to(b_dtype), *dstate)


def _check(cell, x, R, b, initial_state, output_final_state, cu_seqlens, host_values=True, config=None):
    gates, states = CELL_GATES[cell], CELL_STATES[cell]
    G = len(gates)
    check_tensor("x", x, 5)
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"`x` dtype must be one of float32/float16/bfloat16 (or float64), got {x.dtype}")
    B, T, Gx, NH, D = x.shape
    if Gx != G:
        raise ValueError(f"`x` must be [B, T, G, NH, D] with G={G} gates {gates} for the {cell} cell, "
                         f"got G={Gx} (shape {tuple(x.shape)})")
    if NH < 1 or D < 1:
        raise ValueError(f"`x` must have at least one head and head dim >= 1, got NH={NH}, D={D}")
    check_tensor("R", R, 4)
    if tuple(R.shape) != (G, NH, D, D):
        raise ValueError(f"`R` must be [G, NH, D, D] = {(G, NH, D, D)} ([out, in] per gate and head) for x of "
                         f"shape {tuple(x.shape)}, got {tuple(R.shape)}")
    check_tensor("b", b, 3)
    if tuple(b.shape) != (G, NH, D):
        raise ValueError(f"`b` must be [G, NH, D] = {(G, NH, D)}, got {tuple(b.shape)}")
    for name, t in (("R", R), ("b", b)):
        if t.dtype not in (x.dtype, torch.float32) or (x.dtype == torch.float64 and t.dtype != torch.float64):
            raise TypeError(f"`{name}` dtype must be float32 or x's dtype ({x.dtype}), got {t.dtype}")
    check_device("x", x)
    for name, t in (("R", R), ("b", b)):
        if t.device != x.device:
            raise ValueError(f"`{name}` is on {t.device} but `x` is on {x.device}")
    if not isinstance(output_final_state, bool):
        raise TypeError(f"`output_final_state` must be a bool, got {type(output_final_state).__name__}")
    check_config(config, x.dtype, D)
    N = B
    lengths = (T,) * B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 \
                or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError("`cu_seqlens` must be a 1-D int32/int64 tensor of N + 1 sequence offsets")
        if cu_seqlens.device != x.device:
            raise ValueError(f"`cu_seqlens` is on {cu_seqlens.device} but `x` is on {x.device}")
        if B != 1:
            raise ValueError(f"with `cu_seqlens` the batch size must be 1 (sequences packed along T), got B={B}")
        if cu_seqlens.numel() < 2:
            raise ValueError("`cu_seqlens` must hold at least two offsets [0, ..., T]")
        N = cu_seqlens.numel() - 1
        if host_values:  # (not while torch.compile traces: the custom op reads them when it runs)
            bounds = cached_bounds(cu_seqlens)
            check_varlen_bounds(bounds, T)
            lengths = tuple(b1 - b0 for b0, b1 in zip(bounds[:-1], bounds[1:]))
        else:
            bounds = lengths = None
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != len(states):
            got = len(initial_state) if isinstance(initial_state, (tuple, list)) else type(initial_state).__name__
            raise ValueError(f"`initial_state` must be a tuple of {len(states)} tensors {states} for the {cell} "
                             f"cell, each [N, NH, D], got {got}")
        for name, s in zip(states, initial_state):
            if not isinstance(s, torch.Tensor):
                raise TypeError(f"`initial_state` entry {name!r} must be a torch.Tensor, got {type(s).__name__}")
            if tuple(s.shape) != (N, NH, D):
                raise ValueError(f"`initial_state` entry {name!r} must be [N, NH, D] = {(N, NH, D)}, "
                                 f"got {tuple(s.shape)}")
            if not s.is_floating_point():
                raise TypeError(f"`initial_state` entry {name!r} must be floating point, got {s.dtype}")
            if s.device != x.device:
                raise ValueError(f"`initial_state` entry {name!r} is on {s.device} but `x` is on {x.device}")
    return lengths, bounds if cu_seqlens is not None else None


def pad_index(bounds, lengths, T: int, device):
    """Varlen as a padded batch: ``(gather [N, Tm], unpack [T])``, the packed row of each (sequence, step) (pad steps
    read row T, a zero row appended to x) and the padded position ``n Tm + t`` of each packed row (built on the
    device from the offsets: no host wait, no boolean indexing)."""
    Tm = max(lengths)
    t_idx = torch.arange(Tm, device=device)
    offs = host_ints(bounds, device, torch.long)  # [N + 1]
    valid = t_idx[None, :] < host_ints(lengths, device, torch.long)[:, None]
    gather = torch.where(valid, offs[:-1, None] + t_idx[None, :], T)
    rows = torch.arange(T, device=device)
    seq = torch.searchsorted(offs[1:], rows, right=True)  # each packed row's sequence
    return gather, seq * Tm + rows - offs[seq]


def pad_rows(x: torch.Tensor, bounds, lengths) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed sequences ``x [1, T, ...]`` as a padded batch ``[N, Tm, ...]`` gathered by ``pad_index`` (pad steps read
    a zero row; they run after each sequence's last step, so they change neither its outputs nor its final state):
    ``(padded x, gather, unpack)``, ``unpack`` for ``unpad_rows``."""
    gather, unpack = pad_index(bounds, lengths, x.shape[1], x.device)
    return torch.cat([x[0], x.new_zeros(1, *x.shape[2:])])[gather], gather, unpack


def unpad_rows(o: torch.Tensor, unpack: torch.Tensor) -> torch.Tensor:
    """A padded batch's rows ``[N, Tm, ...]`` back in packed order ``[1, T, ...]`` (``pad_rows``' inverse)."""
    return o.flatten(0, 1).index_select(0, unpack).unsqueeze(0)


def _precompile_key(opts: RNNOptions, x, R, b, state0) -> tuple:
    # (the key without the sequences' lengths, which vary between varlen batches)
    return ("rnn", precompile.signature(x, R, b, *state0), x.shape[1] % 16 == 0, dataclasses.replace(opts, lengths=()))


def _apply(opts: RNNOptions, x, R, b, *state0):
    """``RNNFunction.apply``, its kernels compiled on a thread pool first at the first call of a kind (the cell, the
    launch, the dtypes and head sizes; ``precompile.first_call``)."""
    return precompile.apply(autograd_call(RNNFunction), (opts, x, R, b, *state0), x,
                            lambda: _precompile_key(opts, x, R, b, state0))


_TEAM_KERNELS = ("_rnn_team_fwd_kernel", "_rnn_team_bwd_kernel")


def _dry_run_check(opts: RNNOptions, x, R, b, state0):
    """The team search's compile check as the call's own first dry run (``precompile.first_call``): a candidate
    ``Launch`` runs the dry run that the call would run anyway (every kernel of its forward and backward compiled on
    the pool at once), and its team kernels' loads give ``(spill bytes, failed)``; None where no dry run ran (not
    ``precompile.enabled``, or one ran for that launch before), so the search compiles the candidate itself."""
    def check(launch: Launch):
        o = dataclasses.replace(opts, fused=launch)
        if not precompile.enabled(x):
            return None
        results: list = []
        key = (*_precompile_key(o, x, R, b, state0), x.device)  # precompile.apply's key for this launch
        if not precompile.first_call(key, lambda: precompile.dry_apply(RNNFunction.apply, (o, x, R, b, *state0)),
                                     results=results):
            return None
        team = [k for name, k in results if name in _TEAM_KERNELS]
        if not team:
            return None
        spill = max((int(getattr(k, "n_spills", 0) or 0) for k in team if not isinstance(k, Exception)), default=0)
        return spill, any(isinstance(k, Exception) for k in team)

    return check


@on_input_device
def rnn(cell: str, x, R, b, initial_state=None, output_final_state=False, *, cu_seqlens=None, config=None):
    """Shared entry of the four cells (see ``elman``, ``lstm``, ``gru``, ``slstm``); under ``torch.compile`` the
    custom ops of ``library.py``."""
    if cell not in CELL_GATES:
        raise ValueError(f"`cell` must be one of {tuple(CELL_GATES)}, got {cell!r}")
    compiling = torch.compiler.is_compiling()
    lengths, bounds = _check(cell, x, R, b, initial_state, output_final_state, cu_seqlens, host_values=not compiling,
                             config=config)
    state0 = tuple(initial_state) if initial_state is not None else ()
    if compiling:
        from tfla.ops.rnn.library import config_arg, rnn_fwd_op

        out = rnn_fwd_op(x, R, b, list(state0), cu_seqlens, cell, output_final_state, config_arg(config))
        return out[0], (tuple(out[1:]) if output_final_state else None)
    xp, _, unpack = (x, None, None) if bounds is None else pad_rows(x, bounds, lengths)  # varlen: padded
    opts = RNNOptions(cell, lengths, output_final_state)
    fused = fused_launch(config, x.dtype, len(lengths), x.shape[3], x.shape[4], x.device, cell=cell,
                         check=_dry_run_check(opts, xp, R, b, state0))
    out = _apply(dataclasses.replace(opts, fused=fused), xp, R, b, *state0)
    h = out[0] if unpack is None else unpad_rows(out[0], unpack)
    return h, (tuple(out[1:]) if output_final_state else None)


@torch.compiler.disable  # eager only (a graph break under torch.compile): the custom ops return h and the final state
@on_input_device
def rnn_state_sequence(cell: str, x, R, b, initial_state=None, config=None):
    """``(h [B, T, NH, D], state_seq [S - 1, B, T, NH, D])``: ``cell`` as ``rnn`` (no varlen, no final state), also
    returning the states after h (c; for the sLSTM c, n, m) after every step, in fp32 (float64 for float64 x) and
    differentiable (m's cotangent is ignored: m is a constant of the backward). FlashRNN returns every state at
    every step; ``tfla.compat.flashrnn`` uses this."""
    if cell not in CELL_GATES:
        raise ValueError(f"`cell` must be one of {tuple(CELL_GATES)}, got {cell!r}")
    lengths, _ = _check(cell, x, R, b, initial_state, False, None, config=config)
    state0 = tuple(initial_state) if initial_state is not None else ()
    fused = fused_launch(config, x.dtype, len(lengths), x.shape[3], x.shape[4], x.device, cell=cell)
    return RNNFunction.apply(RNNOptions(cell, lengths, False, state_sequence=True, fused=fused), x, R, b, *state0)


_DOC = """{title}

    {recurrence}

    Pre-activations ``g^j_t = x^j_t + R^j h_{{t-1}} + b^j`` per gate j and head (x already holds the input
    projection). Fused path (default for head dims D <= 64 and fp32 / fp16 / bf16 x): one Triton launch runs all
    steps with the states and R on chip, the products ``R^j h`` as ``tl.dot`` in x's dtype (fp32 accumulation;
    fp32 x: tf32x3 on a GPU). Team path (default above D = 64): a team of programs per head, each owning a slice of
    the units, in one launch that meets at a grid barrier every step. Alternating path (float64): per step one
    batched matmul for all gates and heads plus one fused Triton pointwise kernel. Launch settings: a constraint
    search over the device's limits (``tfla/ops/rnn/tiling.py``). States and gate math in fp32 (float64 for float64
    inputs).
    Source: {source}.

    Args:
        x: ``[B, T, G, NH, D]`` with G = {G} gates in the order {gates}; float32, float16, bfloat16 (float64 for
            verification). With ``cu_seqlens``: B = 1 and the sequences packed along T.
        R: ``[G, NH, D, D]`` recurrent weights, ``[out, in]`` per gate and head like an ``nn.Linear`` weight;
            float32 or x's dtype.
        b: ``[G, NH, D]`` bias; float32 or x's dtype.
        initial_state: None (zeros) or a tuple {states} of ``[N, NH, D]`` tensors (N = B, or the number of
            sequences with ``cu_seqlens``), any floating dtype.
        output_final_state: also return the state after each sequence's last step.
        cu_seqlens: keyword-only, 1-D int32/int64 ``[N + 1]`` offsets of packed sequences (varlen); run as a padded
            batch of the longest length.
        config: keyword-only, None or a dict: ``"path"``: ``"auto"`` (default: fused up to D = 64, team above,
            alternating for float64), ``"fused"`` (D <= 128, not float64), ``"team"`` (not float64) or
            ``"alternating"``; ``"BB"`` (batch rows per program: 16, 32, 64; default from the launch search),
            ``"num_warps"`` (1, 2, 4, 8; fused: default 8 above D = 32, else 4; team: 4), ``"num_stages"`` (1, 2, 3);
            the team path's ``"team_cols"`` (units per program: 16, 32, 64, 128), ``"team_BK"``, ``"team_sync"``
            (one launch with a grid barrier: True / False), ``"team_resident"`` (R's slices held on chip).
            ``tfla/ops/rnn/README.md``.

    Returns:
        ``(h, final_state)``: h ``[B, T, NH, D]`` in x's dtype (the hidden state after every step);
        final_state a tuple {states} of ``[N, NH, D]`` fp32 tensors (float64 for float64 x), or None.
        Differentiable in x, R, b and the initial state{grad_note}.

    Raises:
        ValueError: wrong ranks or shapes (gate count G, head dim D or heads NH of R / b differing from x, state
            tuple length or shapes), bad ``cu_seqlens`` offsets or B != 1 with them, tensors on different devices,
            unknown ``config`` keys or values (the fused path forced for float64 or D > 128, the team path for
            float64, ``team_sync=True`` where the grid does not fit the GPU at once), a ``config`` whose launch does
            not fit the GPU.
        TypeError: non-tensor or non-floating inputs, unsupported dtypes, a ``config`` that is not a dict.
    """


def _make(cell: str, title: str, recurrence: str, source: str, grad_note: str = ""):
    def op(x, R, b, initial_state=None, output_final_state=False, *, cu_seqlens=None, config=None):
        return rnn(cell, x, R, b, initial_state, output_final_state, cu_seqlens=cu_seqlens, config=config)

    op.__name__ = op.__qualname__ = cell
    op.__doc__ = _DOC.format(title=title, recurrence=recurrence, source=source, G=len(CELL_GATES[cell]),
                             gates=CELL_GATES[cell], states=CELL_STATES[cell], grad_note=grad_note)
    return op


_FLASHRNN = "FlashRNN (Pöppel et al. 2024, Section 2, Eqs. 1-4)"
elman = _make("elman", "Multi-head Elman RNN.", "h_t = tanh(g^h_t)", _FLASHRNN)
lstm = _make(
    "lstm", "Multi-head LSTM; equals ``torch.nn.LSTM`` with x = input W_ih^T + b_ih, R = W_hh, b = b_hh (NH = 1).",
    "c_t = sigmoid(g^f) c_{t-1} + sigmoid(g^i) tanh(g^z);  h_t = sigmoid(g^o) tanh(c_t)",
    _FLASHRNN + "; torch.nn.LSTM documentation (gate order i, f, g, o)")
gru = _make(
    "gru", "Multi-head GRU; equals ``torch.nn.GRU`` with x = input W_ih^T + b_ih, R = W_hh, b = b_hh (NH = 1).",
    "r = sigmoid(x_r + R_r h + b_r), z = sigmoid(x_z + R_z h + b_z), n = tanh(x_n + r (R_n h + b_n)),  "
    "h_t = (1 - z) n + z h_{t-1}",
    _FLASHRNN + "; torch.nn.GRU documentation (gate order r, z, n)")
slstm = _make(
    "slstm", "Multi-head sLSTM (xLSTM's scalar-memory LSTM with exponential input gate and max state m).",
    "lf = logsigmoid(g^f) + m_{t-1}; m_t = g^i where n_{t-1} = 0 else max(g^i, lf); i' = exp(g^i - m_t), "
    "f' = exp(lf - m_t);  c_t = f' c_{t-1} + i' tanh(g^z), n_t = f' n_{t-1} + i', h_t = sigmoid(g^o) c_t / n_t "
    "(no clamps)",
    _FLASHRNN + "; xLSTM (Beck et al. 2024)",
    grad_note=" (m is treated as a constant in the backward, as xLSTM and FlashRNN do: no gradient flows through "
              "m, and the initial m's gradient is zero)")
