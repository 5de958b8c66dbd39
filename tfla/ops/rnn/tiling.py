"""Launch settings of the fused and team RNN kernels (``fused.py``, ``team.py``) from integer constraints, in the
spirit of FlashRNN's ConstrINT (Pöppel et al. 2024, Sections 5.4 and Appendices C-D): for the fused path the batch
tile BB, ``num_warps`` and ``num_stages`` are chosen by a small branch-and-bound search over the integer space
``SPACE`` under the device's limits (SM count, registers, shared memory, warps) and the shapes' divisibility, with a
lexicographic objective; for the team path (section above ``TEAM_SPACE``) BB, the units per member, R held or
streamed and the stages; results are cached. ``cells.fused_launch`` takes both.

Notation: N batch rows (sequences), NH heads, D head dim, BD the dot tile (a power of two >= D, at least 16, 32 for
16-bit inputs: ``dot_tile``), G gates, S states, W = num_warps, St = num_stages.

Per-program resources (one program = one (batch tile, head); the launch tuple serves the forward and the backward):

- shared memory, from ``fused.py``'s code and the buffers Triton 3.6 allocates for it (``compile_stats.py
  --allocs``): the G recurrent blocks ``[BD, BD]`` in the dot dtype (fp32: a high and a low copy for tf32x3), plus
  per pipelined stage (St - 1 of them) the loads issued one step ahead (forward: the G gates of x_t; backward: dh_t,
  the gates of x_t and ``R h_{t-1}``, the state tiles and cotangents the cell's backward reads: ``_BWD_LOADS``),
  plus one ``[BB, BD]`` layout-conversion buffer (the dot's A operand, fp32: two copies, at least BB * BD * 4 B).
  On the 736 kernels of the sweep below it is never under the compiled figure: equal for 497, at most 16 KiB over
  (fp32 at BD = 16, some BB = 64 or 3-stage configs). State-sequence cotangents (``rnn_state_sequence``) add
  their tiles to the backward's loads.
- registers per thread, an estimate (ptxas decides): ``a + b * e + c * f`` with e = BB * BD / (32 * min(W, tiles))
  the elements of one ``[BB, BD]`` tile a thread holds (tiles = (BB / 16) * (BD / 8) mma tiles of one dot: warps
  beyond that replicate) and f = BB * BD / 32 (each warp holds the whole A operand), a, b, c per (cell, direction,
  16-bit | fp32) from a least-squares fit to sm_90 compiles (``_REG_FIT``). Its spill classification (estimate > 255
  <=> ptxas spilled) is right for 647 of 736 compiled kernels (bf16 D = 16..128, fp32 D = 16..64, BB 16 / 32 / 64,
  W 4 / 8 (and 2 at D = 16), St 1 / 2 (and 3 at D = 16)): it misses 83 spills and predicts 6 that do not occur (the
  misses: BB = 32 at D = 32 and 2 warps at D = 16, mostly the LSTM's and sLSTM's backward); registers cannot be
  predicted exactly (FlashRNN, Appendix D), so compiled kernels' spills and failures feed back through
  ``FusedFeedback`` (below).

Measured, sm_90, Triton 3.6.0 and its ptxas, compiled on a CPU (``scripts/compile_stats.py --op rnn``), BB = 16,
W = 8, St = 2, D = 64 (registers / spill bytes / shared bytes; model's shared bytes equal):

| dtype | kernel | elman | lstm | gru | slstm |
|---|---|---|---|---|---|
| bf16 | fwd | 48 / 0 / 14336 | 96 / 0 / 45056 | 74 / 0 / 34816 | 120 / 0 / 45056 |
| bf16 | bwd | 48 / 0 / 22528 | 157 / 0 / 79872 | 124 / 0 / 57344 | 206 / 0 / 100352 |
| fp32 | fwd | 93 / 0 / 45056 | 169 / 0 / 155648 | 162 / 0 / 118784 | 165 / 0 / 155648 |
| fp32 | bwd | 100 / 0 / 53248 | 254 / 0 / 192512 | 170 / 0 / 143360 | 255 / 4 / 212992 |

(fp32 at D = 64: the sLSTM backward spills 4 B under Triton 3.6 at these defaults; Triton 3.9: 254 registers, none.)

Constraints of a candidate (``fused_constraints``): BB, W, St in ``SPACE``; BB a multiple of 16 (the mma tile's rows);
32 W threads within the block limit; shared memory of every kernel within the per-block limit; at least one program
resident per SM (registers, warps); not recorded as failed to compile. Objective (``fused_objective``, smaller is
better, compared in order): (1) registers over the per-thread limit (a predicted spill; a recorded spill counts as
over), (2) waves x mma rounds: waves = ceil(programs / (SMs x resident programs per SM)), programs = NH * ceil(N /
BB), rounds = ceil(tiles / W) mma tiles per warp per dot, a step-latency proxy, (3) rounds, (4) more stages (the loads
of the next St - 1 steps in flight during step t: on the H100, torch 2.11, Triton 3.6, bf16, B = 16, T = 1024, D <=
64, median ``do_bench`` of forward and forward + backward, 3 stages measured 1.2-1.9x faster per step than 2, forward
and backward; ``README.md``), (5) fewer warps than the SM's schedulers (4), (6) W, (7) shared memory, (8) BB.
``choose_fused_launch`` returns the smallest candidate; ``exhaustive_fused_launch`` the same by enumeration (for
tests).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import torch

from tfla.ops.common.utils import dot_tile

SPACE = {"BB": (16, 32, 64), "num_warps": (1, 2, 4, 8), "num_stages": (1, 2, 3)}  # = cells.CONFIG_KEYS
MAX_FUSED_D = 128  # fused.MAX_FUSED_D (not imported: fused.py needs Triton)
CELLS = ("elman", "lstm", "gru", "slstm")
_GATES = {"elman": 1, "lstm": 4, "gru": 3, "slstm": 4}
# [BB, BD] tiles the backward's loop loads per step (pipelined with St > 1): (fp32 tiles, tiles in x's dtype);
# fp32: dh_t's final-state part (h, c, n), R h_{t-1} of the gates it reads, the states it reads (t and t + 1);
# x's dtype: dh_t, the gates of x_t it reads (Triton drops the loads a cell's backward does not use)
_BWD_LOADS = {"elman": (2, 1), "lstm": (8, 5), "gru": (5, 4), "slstm": (13, 5)}
_SEQ_LOADS = {"elman": 0, "lstm": 1, "gru": 0, "slstm": 2}  # the state sequence's cotangents (c; c, n)
# registers a + b e + c f (module docstring): least squares over the kernels that did not spill, sm_90, Triton 3.6.0
# (D = 16 and 32, part of 64; fp32 and bf16), checked on the whole sweep (module docstring)
_REG_FIT = {
    ("elman", "fwd", "16"): (11.9, 5.2, 0.2), ("elman", "bwd", "16"): (17.1, 7.7, 0.2),
    ("lstm", "fwd", "16"): (49.6, 9.5, 0.9), ("lstm", "bwd", "16"): (71.0, 10.0, 1.5),
    ("gru", "fwd", "16"): (48.1, 11.3, 0.2), ("gru", "bwd", "16"): (52.6, 19.5, 0.5),
    ("slstm", "fwd", "16"): (104.5, 1.8, 1.2), ("slstm", "bwd", "16"): (8.3, 33.1, 1.5),
    ("elman", "fwd", "fp32"): (41.5, 1.5, 1.1), ("elman", "bwd", "fp32"): (40.7, 3.5, 1.2),
    ("lstm", "fwd", "fp32"): (108.5, 2.0, 1.9), ("lstm", "bwd", "fp32"): (107.9, 17.5, 0.1),
    ("gru", "fwd", "fp32"): (63.8, 5.5, 2.0), ("gru", "bwd", "fp32"): (86.1, 18.6, -0.8),
    ("slstm", "fwd", "fp32"): (111.7, 14.2, -1.0), ("slstm", "bwd", "fp32"): (11.8, 47.2, 0.5),
}
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    """What one SM and one block may use. Default: H100 SXM (sm_90): 132 SMs, 64 Ki 32-bit registers per SM, 255
    per thread, 227 KiB (232448 B) opt-in shared memory per block and 228 KiB per SM, 64 warps and 32 blocks per
    SM, 1024 threads per block, 4 warp schedulers per SM (CUDA C Programming Guide, compute capability 9.0)."""
    name: str = "H100 (sm_90)"
    sms: int = 132
    regs_per_sm: int = 65536
    regs_per_thread: int = 255
    smem_per_block: int = 232448
    smem_per_sm: int = 233472
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    max_threads_per_block: int = 1024
    schedulers_per_sm: int = 4

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "name":
                if not isinstance(v, str):
                    raise TypeError(f"`name` must be a str, got {type(v).__name__}")
            elif not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"`{f.name}` must be a positive int, got {v!r}")

    @classmethod
    def from_device(cls, device=None) -> DeviceLimits:
        """The limits of a CUDA device from ``torch.cuda.get_device_properties`` (fields it lacks keep the H100's);
        ValueError when CUDA is not available."""
        if not torch.cuda.is_available():
            raise ValueError("`device`: CUDA is not available; use DeviceLimits() (the H100's limits)")
        p = torch.cuda.get_device_properties(device)
        d = cls()
        warp = getattr(p, "warp_size", 32) or 32
        return cls(name=str(getattr(p, "name", d.name)), sms=int(p.multi_processor_count),
                   regs_per_sm=int(getattr(p, "regs_per_multiprocessor", d.regs_per_sm)),
                   smem_per_block=int(getattr(p, "shared_memory_per_block_optin", d.smem_per_block)),
                   smem_per_sm=int(getattr(p, "shared_memory_per_multiprocessor", d.smem_per_sm)),
                   max_warps_per_sm=int(getattr(p, "max_threads_per_multi_processor", 32 * d.max_warps_per_sm))
                   // warp)


H100 = DeviceLimits()


@dataclasses.dataclass(frozen=True)
class FusedCost:
    """Resources of one program of a fused launch over the kernels it covers (the cell's forward and backward, or
    all four cells'): shared bytes and estimated registers per thread, the maxima; resident programs per SM."""
    smem: int
    regs: int
    resident: int  # programs per SM (0: none fits)
    tiles: int  # mma tiles of one [BB, BD] x [BD, BD] dot
    rounds: int  # ceil(tiles / W)


def _check_dtype(dtype):
    if dtype not in _DTYPES:
        raise TypeError(f"`dtype` must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")


def _check_int(name, v, lo=1, hi=None):
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"`{name}` must be an int, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"`{name}` must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")


def _check_cell(cell):
    if cell is not None and cell not in CELLS:
        raise ValueError(f"`cell` must be None (all four) or one of {CELLS}, got {cell!r}")


def fused_smem(cell: str, direction: str, BB: int, BD: int, num_stages: int, dtype, state_sequence=True) -> int:
    """Shared bytes of one program of ``_rnn_fused_{fwd,bwd}_kernel`` (module docstring)."""
    wbytes, copies = (4, 2) if dtype == torch.float32 else (2, 1)
    xbytes = 4 if dtype == torch.float32 else 2
    G, tile = _GATES[cell], BB * BD
    weights = G * BD * BD * wbytes * copies
    scratch = max(tile * wbytes * copies, tile * 4)
    if direction == "fwd":
        per_stage = G * tile * xbytes
    else:
        n32, nx = _BWD_LOADS[cell]
        n32 += _SEQ_LOADS[cell] if state_sequence else 0
        per_stage = n32 * tile * 4 + nx * tile * xbytes
    return weights + (num_stages - 1) * per_stage + scratch


def fused_regs(cell: str, direction: str, BB: int, BD: int, num_warps: int, dtype) -> int:
    """Estimated registers per thread of one program (``_REG_FIT``; may exceed 255: a predicted spill)."""
    a, b, c = _REG_FIT[(cell, direction, "fp32" if dtype == torch.float32 else "16")]
    tiles = (BB // 16) * (BD // 8)
    e = BB * BD / (32 * min(num_warps, tiles))
    return math.ceil(a + b * e + c * BB * BD / 32)


def fused_cost(cell, D: int, dtype, BB: int, num_warps: int, num_stages: int, limits: DeviceLimits = H100) -> FusedCost:
    """``FusedCost`` of a launch (cell None: the maxima over the four cells)."""
    BD = dot_tile(D, MAX_FUSED_D, dtype)
    cells = CELLS if cell is None else (cell,)
    smem = max(fused_smem(c, k, BB, BD, num_stages, dtype) for c in cells for k in ("fwd", "bwd"))
    regs = max(fused_regs(c, k, BB, BD, num_warps, dtype) for c in cells for k in ("fwd", "bwd"))
    alloc = min(limits.regs_per_thread, -(-regs // 8) * 8)  # ptxas allocates in 8s, spilling past the limit
    resident = min(limits.smem_per_sm // max(smem, 1), limits.regs_per_sm // (alloc * 32 * num_warps),
                   limits.max_warps_per_sm // num_warps, limits.max_blocks_per_sm)
    tiles = (BB // 16) * (BD // 8)
    return FusedCost(smem, regs, resident, tiles, -(-tiles // num_warps))


def fused_constraints(cand, cell, D, dtype, limits: DeviceLimits = H100, failed=frozenset()) -> dict[str, bool]:
    """Each hard constraint of a candidate ``(BB, num_warps, num_stages)``, by name: True where it holds."""
    BB, W, St = cand
    c = fused_cost(cell, D, dtype, BB, W, St, limits)
    return {
        "in_space": BB in SPACE["BB"] and W in SPACE["num_warps"] and St in SPACE["num_stages"],
        "BB_multiple_of_16": BB % 16 == 0,
        "threads_per_block": 32 * W <= limits.max_threads_per_block,
        "smem_per_block": c.smem <= limits.smem_per_block,
        "resident_per_sm": c.resident >= 1,
        "not_failed": cand not in failed,
    }


def fused_objective(cand, N, NH, cell, D, dtype, limits: DeviceLimits = H100, spilled=frozenset()) -> tuple:
    """The objective's key of a candidate (module docstring; compared lexicographically, smaller is better)."""
    BB, W, St = cand
    c = fused_cost(cell, D, dtype, BB, W, St, limits)
    over = max(0, c.regs - limits.regs_per_thread) + (1 if cand in spilled else 0)
    programs = NH * -(-N // BB)
    waves = -(-programs // (limits.sms * max(c.resident, 1)))
    return (over, waves * c.rounds, c.rounds, -St, W < limits.schedulers_per_sm, W, c.smem, BB)


@dataclasses.dataclass
class _Feedback:
    """Observations of compiled launches of one path, so later choices exclude or avoid them (FlashRNN's compiler
    feedback, Appendix D): ``record(D, dtype, config, cell=None, spilled=.., failed=..)``. A failed compile excludes
    the config; a spill makes it rank after the configs without one; a clean compile is remembered too
    (``observed``), so it is not compiled again. Keyed by ``_key(D, dtype, cell)``; cell None applies to every
    cell."""
    table: dict = dataclasses.field(default_factory=dict)
    clean: set = dataclasses.field(default_factory=set)
    _CONFIG = "(BB, num_warps, num_stages)"

    def _key(self, D: int, dtype, cell):
        raise NotImplementedError

    def _valid(self, config) -> bool:
        raise NotImplementedError

    def record(self, D: int, dtype, config: tuple, cell: str | None = None, *, spilled: bool = False,
               failed: bool = False) -> None:
        key = self._key(D, dtype, cell)
        if not (isinstance(config, tuple) and self._valid(config)):
            raise TypeError(f"`config` must be a tuple {self._CONFIG}, got {config!r}")
        if not (spilled or failed):
            self.clean.add((*key, config))
            return
        spill, fail = self.table.get(key, (frozenset(), frozenset()))
        self.table[key] = (spill | {config} if spilled else spill, fail | {config} if failed else fail)

    def excluded(self, D: int, dtype, cell: str | None = None) -> tuple[frozenset, frozenset]:
        """``(spilled, failed)`` configs recorded for D's key, dtype and cell (and cell None's; for cell None: all
        cells')."""
        k0 = self._key(D, dtype, None)[:-1]
        spill, fail = frozenset(), frozenset()
        for key, (s, f) in self.table.items():
            c = key[-1]
            if key[:-1] == k0 and (c is None or cell is None or c == cell):
                spill, fail = spill | s, fail | f
        return spill, fail

    def observed(self, D: int, dtype, config: tuple, cell: str | None = None) -> bool:
        """Whether a compile of this config for D's key, dtype and cell was recorded (clean, spilled or failed)."""
        key = self._key(D, dtype, cell)
        spill, fail = self.table.get(key, (frozenset(), frozenset()))
        return (*key, config) in self.clean or config in spill or config in fail


@dataclasses.dataclass
class FusedFeedback(_Feedback):
    """``_Feedback`` of the fused path: configs ``(BB, num_warps, num_stages)``, keyed by (BD, dtype, cell). Passed
    to ``choose_fused_launch(..., feedback=)``; ``choose_fused_launch_compiled`` fills one from compiled kernels (the
    cells keep one per GPU: ``cells.fused_launch``)."""

    def _key(self, D, dtype, cell):
        _check_int("D", D, 1, MAX_FUSED_D)
        _check_dtype(dtype)
        _check_cell(cell)
        return dot_tile(D, MAX_FUSED_D, dtype), dtype, cell

    def _valid(self, config):
        return len(config) == 3 and all(isinstance(v, int) for v in config)


def _check_args(N, NH, D, dtype, limits, cell, fixed):
    _check_int("N", N)
    _check_int("NH", NH)
    _check_int("D", D, 1, MAX_FUSED_D)
    _check_dtype(dtype)
    if not isinstance(limits, DeviceLimits):
        raise TypeError(f"`device_limits` must be a DeviceLimits, got {type(limits).__name__}")
    _check_cell(cell)
    for k, v in fixed.items():
        if v is not None and (v not in SPACE[k] or isinstance(v, bool)):
            raise ValueError(f"`{k}` must be None or one of {SPACE[k]}, got {v!r}")


def _space(fixed):
    return [tuple(SPACE[k] if fixed[k] is None else (fixed[k],)) for k in ("BB", "num_warps", "num_stages")]


def exhaustive_fused_launch(N, NH, D, dtype, device_limits=H100, *, cell=None, BB=None, num_warps=None,
                            num_stages=None, spilled=frozenset(), failed=frozenset()):
    """``choose_fused_launch`` by enumerating every candidate (the reference of the tests)."""
    fixed = {"BB": BB, "num_warps": num_warps, "num_stages": num_stages}
    _check_args(N, NH, D, dtype, device_limits, cell, fixed)
    ok = [c for c in itertools.product(*_space(fixed))
          if all(fused_constraints(c, cell, D, dtype, device_limits, failed).values())]
    return min(ok, key=lambda c: fused_objective(c, N, NH, cell, D, dtype, device_limits, spilled), default=None)


@functools.lru_cache(maxsize=4096)
def _choose(N, NH, D, dtype, limits, cell, BB, W, St, spilled, failed):
    fixed = {"BB": BB, "num_warps": W, "num_stages": St}
    bbs, ws, sts = _space(fixed)
    best, best_key = None, None
    for bb in sorted(bbs):
        # shared memory grows with BB and St and does not depend on W: the smallest stage count bounds this BB
        # (and, BB ascending, every larger one)
        if fused_cost(cell, D, dtype, bb, max(ws), min(sts), limits).smem > limits.smem_per_block:
            break
        for w in sorted(ws, reverse=True):
            c0 = fused_cost(cell, D, dtype, bb, w, min(sts), limits)
            # bound: (1) and (2) of the key do not depend on St except through residency, at most that of St min
            lb_over = max(0, c0.regs - limits.regs_per_thread)
            lb_waves = -(-(NH * -(-N // bb)) // (limits.sms * max(c0.resident, 1)))
            if best_key is not None and (lb_over, lb_waves * c0.rounds) > best_key[:2]:
                continue
            for st in sorted(sts):
                cand = (bb, w, st)
                if not all(fused_constraints(cand, cell, D, dtype, limits, failed).values()):
                    if fused_cost(cell, D, dtype, bb, w, st, limits).smem > limits.smem_per_block:
                        break  # more stages only add shared memory
                    continue
                key = fused_objective(cand, N, NH, cell, D, dtype, limits, spilled)
                if best_key is None or key < best_key:
                    best, best_key = cand, key
    return best


def choose_fused_launch(N: int, NH: int, D: int, dtype, device_limits: DeviceLimits = H100, *, cell: str | None = None,
                        BB: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                        feedback: FusedFeedback | None = None) -> tuple[int, int, int] | None:
    """The fused path's ``(BB, num_warps, num_stages)`` for N batch rows, NH heads, head dim D (1..128) and x's dtype
    (fp32, fp16, bf16) on ``device_limits`` (default the H100's): the smallest candidate of the objective among those
    meeting every constraint (module docstring), or None when none does (R of all gates does not fit a block: run the
    alternating path). ``cell``: one cell's kernels, or None (default) for the most demanding of the four. ``BB``,
    ``num_warps``, ``num_stages``: fix a variable (None: search it). ``feedback``: observed spills / compile failures
    (``FusedFeedback``). Cached (``functools.lru_cache`` on the arguments and the feedback's content).

    Raises ValueError (out-of-range N, NH, D, a fixed value outside ``SPACE``, an unknown cell) or TypeError (a
    non-int size, an unsupported dtype, limits not a ``DeviceLimits``), naming the argument."""
    fixed = {"BB": BB, "num_warps": num_warps, "num_stages": num_stages}
    _check_args(N, NH, D, dtype, device_limits, cell, fixed)
    if feedback is not None and not isinstance(feedback, FusedFeedback):
        raise TypeError(f"`feedback` must be None or a FusedFeedback, got {type(feedback).__name__}")
    spilled, failed = feedback.excluded(D, dtype, cell) if feedback is not None else (frozenset(), frozenset())
    return _choose(N, NH, D, dtype, device_limits, cell, BB, num_warps, num_stages, spilled, failed)


choose_fused_launch.cache_info = _choose.cache_info
choose_fused_launch.cache_clear = _choose.cache_clear

# The register model is least sure near the limit (its misclassified kernels: module docstring): a candidate
# predicted to use at least this fraction of the per-thread registers is compiled before it is taken, and counts as
# spilled from SPILL_BYTES of local memory per thread on (a few bytes, e.g. the fp32 sLSTM backward's 4 B at D = 64
# and 2 stages under Triton 3.6, are the allocator's rounding, not a loop that spills).
REG_CHECK_FRACTION = 0.8
SPILL_BYTES = 64


def choose_fused_launch_compiled(N: int, NH: int, D: int, dtype, device_limits: DeviceLimits, *, cell: str,
                                 feedback: FusedFeedback, compiled, BB: int | None = None,
                                 num_warps: int | None = None,
                                 num_stages: int | None = None) -> tuple[int, int, int] | None:
    """``choose_fused_launch`` with compiler feedback: while the choice is a config whose predicted registers reach
    ``REG_CHECK_FRACTION`` of the limit and that ``feedback`` has not seen compiled, ``compiled(config) -> (spill
    bytes per thread, failed)`` compiles the cell's kernels for it (``fused.compile_check``), ``feedback`` records
    the result (spilled from ``SPILL_BYTES`` on) and the search runs again (a failed config is excluded, a spilled
    one ranks last). Returns the first choice that is below the fraction, was
    seen compiled, or compiled clean; where every candidate spills, the best of them; None where none fits. The
    result depends only on the compiled kernels, not on the order of calls (each check is recorded once)."""
    if not isinstance(feedback, FusedFeedback):
        raise TypeError(f"`feedback` must be a FusedFeedback, got {type(feedback).__name__}")
    _check_cell(cell)
    if cell is None:
        raise ValueError("`cell` must name the cell whose kernels are compiled")
    for _ in range(math.prod(len(v) for v in SPACE.values()) + 1):
        got = choose_fused_launch(N, NH, D, dtype, device_limits, cell=cell, BB=BB, num_warps=num_warps,
                                  num_stages=num_stages, feedback=feedback)
        if got is None or feedback.observed(D, dtype, got, cell):
            return got
        if fused_cost(cell, D, dtype, *got, device_limits).regs < REG_CHECK_FRACTION * device_limits.regs_per_thread:
            return got
        spill, failed = compiled(got)
        spilled = spill >= SPILL_BYTES
        feedback.record(D, dtype, got, cell, spilled=spilled, failed=bool(failed))
        if not (spilled or failed):
            return got
    raise AssertionError("unreachable: every config is checked at most once")


# ---------------------------------------------------------------------------------------------------------------------
# The team path (``team.py``): a team of P = ceil(D / BC) programs per (batch tile of BB rows, head), each owning BC
# units; per step a member forms its units' gates from the whole h (R's slices held on chip for the launch, or
# streamed from L2 in BK-wide slices of D at ``num_stages``) and the team meets at a grid barrier (one persistent,
# cooperative launch where every program is resident at once; else one launch per step).
#
# Variables: BB, BC (``team_cols``), held or streamed (``team_resident``), St (``num_stages``, of the streamed loop);
# BK and the warps follow (``team_bk``; 4 warps: H100 sweeps, the cells' README). Constraints (``team_constraints``):
# in ``TEAM_SPACE``; held slices only for 16-bit inputs (fp32's tf32x3 dots split both operands and spill kilobytes,
# sm_90); fp32 streams at <= 2 stages (spills at 3); the member's shared memory (``team_smem``) within
# ``team_smem_budget`` (the block's limit less 27 KiB the compiler adds: 200 KiB on sm_90, measured); not recorded
# as failed to compile (``TeamFeedback``). Objective (``team_objective``, lexicographic, smaller is better): (1) the
# team does not fit the SMs at once (one launch per step instead of one in all: ~100x slower, H100), (1b) a recorded
# spill of ``TEAM_SPILL_BYTES`` or more, (2) R streamed where the team fits (each step reads R's slices
# from L2: held measured 1.3-1.7x faster at D = 768, B = 16 / 32; one launch per step loads them every step either
# way), (3) batch tiles ceil(N / BB) (each tile's team reads R again; one dot of BB rows costs about as much as one of
# 16), (4) BB (rows past N are wasted), (5) BC where the team fits (more members, fewer units each: a shorter step),
# else -BC (fewer programs per launch), (6) -St (more of the next slices in flight), (7) streamed.
# ``choose_team_launch`` returns the smallest candidate (cached); ``exhaustive_team_launch`` enumerates;
# ``choose_team_launch_compiled`` compiles the first candidates in that order (there is no register model for the
# team kernels) and takes the first that compiles without a spill.

TEAM_SPACE = {"BB": (16, 32, 64), "team_cols": (16, 32, 64, 128), "team_resident": (True, False),
              "num_stages": (1, 2, 3)}  # = the cells' CONFIG_KEYS
TEAM_WARPS = 4


@dataclasses.dataclass(frozen=True)
class TeamLaunch:
    """A team launch: BB rows per program, BC units per member, BK the dots' slice of D, R's slices held or streamed
    at ``num_stages``, and whether the grid fits the SMs at once (``fits``: the persistent launch may run)."""
    BB: int
    BC: int
    BK: int
    resident: bool
    num_stages: int
    fits: bool


def team_bk(D: int, dtype, resident: bool, BK: int | None = None) -> int:
    """The dots' slice of D: all of it padded to a power of two when held; else BK, or 128 for 16-bit D > 64, 64 for
    D in 33..64, 32 for fp32 or D <= 32 (sm_90 spills kilobytes at fp32 128)."""
    BD = max(16, 1 << (D - 1).bit_length())
    if resident:
        return BD
    return BK or (32 if dtype == torch.float32 or D <= 32 else 64 if D <= 64 else 128)


def team_smem(BB: int, BC: int, D: int, dtype, resident: bool, num_stages: int, BK: int | None = None) -> int:
    """Shared bytes of one member the search bounds: held, the 4 gates' ``[BD, BC]`` slices (2 bytes) and the dots'
    ``[BB, BD]`` h operand (4 bytes); streamed, per stage the backward's 4 gates' ``[BB, BK]`` gradient rows and
    ``[BK, BC]`` slices (the larger of the two directions)."""
    BD = max(16, 1 << (D - 1).bit_length())
    if resident:
        return 4 * BD * BC * 2 + BB * BD * 4
    BK = team_bk(D, dtype, False, BK)
    return num_stages * 4 * (BB * BK + BK * BC) * (4 if dtype == torch.float32 else 2)


def team_smem_budget(limits: DeviceLimits = H100) -> int:
    return limits.smem_per_block - 27 * 1024


def team_constraints(cand, D: int, dtype, limits: DeviceLimits = H100, BK: int | None = None,
                     failed=frozenset()) -> dict[str, bool]:
    """Each hard constraint of a team candidate ``(BB, BC, resident, num_stages)``, by name: True where it holds."""
    BB, BC, res, St = cand
    return {
        "in_space": (BB in TEAM_SPACE["BB"] and BC in TEAM_SPACE["team_cols"] and res in (True, False)
                     and St in TEAM_SPACE["num_stages"]),
        "held_needs_16bit": not res or dtype != torch.float32,
        "fp32_stages": dtype != torch.float32 or St <= 2,
        "smem_per_block": team_smem(BB, BC, D, dtype, res, St, BK) <= team_smem_budget(limits),
        "threads_per_block": 32 * TEAM_WARPS <= limits.max_threads_per_block,
        "not_failed": cand not in failed,
    }


def team_objective(cand, N: int, NH: int, D: int, limits: DeviceLimits = H100, spilled=frozenset()) -> tuple:
    """The objective's key of a team candidate (compared lexicographically, smaller is better)."""
    BB, BC, res, St = cand
    tiles = -(-N // BB)
    fits = -(-D // BC) * tiles * NH <= limits.sms
    return (not fits, cand in spilled, not res and fits, tiles, BB, BC if fits else -BC, -St, not res)


@dataclasses.dataclass
class TeamFeedback(_Feedback):
    """``_Feedback`` of the team path: candidates ``(BB, BC, resident, num_stages)``, keyed by (D, dtype, cell).
    Passed to ``choose_team_launch(..., feedback=)``; ``choose_team_launch_compiled`` fills one from compiled
    kernels (the cells keep one per GPU: ``cells.fused_launch``)."""
    _CONFIG = "(BB, team_cols, team_resident, num_stages)"

    def _key(self, D, dtype, cell):
        _check_int("D", D)
        _check_dtype(dtype)
        _check_cell(cell)
        return D, dtype, cell

    def _valid(self, config):
        return (len(config) == 4 and isinstance(config[2], bool)
                and all(isinstance(v, int) and not isinstance(v, bool) for v in config[:2] + config[3:]))


def _check_team(N, NH, D, dtype, limits, fixed, BK):
    _check_int("N", N)
    _check_int("NH", NH)
    _check_int("D", D)
    _check_dtype(dtype)
    if not isinstance(limits, DeviceLimits):
        raise TypeError(f"`device_limits` must be a DeviceLimits, got {type(limits).__name__}")
    for k, v in fixed.items():
        if v is not None and (v not in TEAM_SPACE[k] or isinstance(v, bool) != (k == "team_resident")):
            raise ValueError(f"`{k}` must be None or one of {TEAM_SPACE[k]}, got {v!r}")
    if BK is not None and (not isinstance(BK, int) or isinstance(BK, bool) or BK < 16 or BK & (BK - 1)):
        raise ValueError(f"`BK` must be None or a power of two >= 16, got {BK!r}")


def _team_space(fixed):
    return [tuple(TEAM_SPACE[k] if fixed[k] is None else (fixed[k],))
            for k in ("BB", "team_cols", "team_resident", "num_stages")]


def _team_result(cand, N, NH, D, dtype, limits, BK):
    if cand is None:
        return None
    BB, BC, res, St = cand
    return TeamLaunch(BB, BC, team_bk(D, dtype, res, BK), res, St, team_objective(cand, N, NH, D, limits)[0] is False)


def exhaustive_team_launch(N, NH, D, dtype, device_limits=H100, *, BB=None, team_cols=None, team_resident=None,
                           num_stages=None, BK=None, spilled=frozenset(), failed=frozenset()) -> TeamLaunch | None:
    """``choose_team_launch`` by enumerating every candidate (the reference of the tests)."""
    fixed = {"BB": BB, "team_cols": team_cols, "team_resident": team_resident, "num_stages": num_stages}
    _check_team(N, NH, D, dtype, device_limits, fixed, BK)
    ok = [c for c in itertools.product(*_team_space(fixed))
          if all(team_constraints(c, D, dtype, device_limits, BK, failed).values())]
    best = min(ok, key=lambda c: team_objective(c, N, NH, D, device_limits, spilled), default=None)
    return _team_result(best, N, NH, D, dtype, device_limits, BK)


@functools.lru_cache(maxsize=4096)
def _choose_team(N, NH, D, dtype, limits, BB, BC, res, St, BK, spilled, failed):
    fixed = {"BB": BB, "team_cols": BC, "team_resident": res, "num_stages": St}
    bbs, bcs, ress, sts = _team_space(fixed)
    best, best_key = None, None
    for res_ in sorted(ress, reverse=True):
        for bb in sorted(bbs):
            for bc in sorted(bcs):
                # shared memory grows with BB, BC and the stages: the fewest stages bound this (bb, bc)
                if not team_constraints((bb, bc, res_, min(sts)), D, dtype, limits, BK)["smem_per_block"]:
                    break  # a larger BC only adds shared memory
                # a bound on this (bb, bc)'s keys: only the second entry (a recorded spill) and the stages' depend
                # on the stages; their best is no spill at the most stages
                k = team_objective((bb, bc, res_, max(sts)), N, NH, D, limits)
                if best_key is not None and k >= best_key:
                    continue
                for st in sorted(sts, reverse=True):
                    cand = (bb, bc, res_, st)
                    if all(team_constraints(cand, D, dtype, limits, BK, failed).values()):
                        key = team_objective(cand, N, NH, D, limits, spilled)
                        if best_key is None or key < best_key:
                            best, best_key = cand, key
                        if cand not in spilled:
                            break  # fewer stages only rank later
    return best


def choose_team_launch(N: int, NH: int, D: int, dtype, device_limits: DeviceLimits = H100, *, BB: int | None = None,
                       team_cols: int | None = None, team_resident: bool | None = None,
                       num_stages: int | None = None, BK: int | None = None, cell: str | None = None,
                       feedback: TeamFeedback | None = None) -> TeamLaunch | None:
    """The team path's launch (``TeamLaunch``) for N batch rows, NH heads, head dim D and x's dtype (fp32, fp16,
    bf16) on ``device_limits`` (default the H100's): the smallest candidate of the objective among those meeting
    every constraint (section comment above ``TEAM_SPACE``), or None when none does. ``BB``, ``team_cols``,
    ``team_resident``, ``num_stages``: fix a variable (None: search it); ``BK``: the streamed slice (None: ``team_bk``).
    ``feedback``: observed spills / compile failures of ``cell``'s kernels (``TeamFeedback``; cell None: any
    cell's). Cached (``functools.lru_cache``).

    Raises ValueError (out-of-range sizes, a fixed value outside ``TEAM_SPACE``, BK not a power of two >= 16, an
    unknown cell) or TypeError (a non-int size, an unsupported dtype, limits not a ``DeviceLimits``, feedback not a
    ``TeamFeedback``), naming the argument."""
    fixed = {"BB": BB, "team_cols": team_cols, "team_resident": team_resident, "num_stages": num_stages}
    _check_team(N, NH, D, dtype, device_limits, fixed, BK)
    _check_cell(cell)
    if feedback is not None and not isinstance(feedback, TeamFeedback):
        raise TypeError(f"`feedback` must be None or a TeamFeedback, got {type(feedback).__name__}")
    spilled, failed = feedback.excluded(D, dtype, cell) if feedback is not None else (frozenset(), frozenset())
    return _team_result(_choose_team(N, NH, D, dtype, device_limits, BB, team_cols, team_resident, num_stages, BK,
                                     spilled, failed), N, NH, D, dtype, device_limits, BK)


# A team candidate counts as spilled from this many bytes of local memory per thread in its compiled forward or
# backward kernel. The defaults run with some: at D = 768, B = 16 (bf16, R held, sm_90, Triton 3.9) the backward
# spills 20 / 124 / 36 B (GRU / LSTM / sLSTM) and is the fastest launch measured there; the held kernels' kilobytes
# before the bf16 ring (up to 6 KB) went with 1.3x slower steps (the cells' README, "Team path").
TEAM_SPILL_BYTES = 1024
# Candidates a compiled search examines at most (compiled ones that spilled or failed included): beyond them it
# takes the best that compiled, so a shape where everything spills costs a few compiles, not the whole space.
TEAM_MAX_CHECKS = 4


def choose_team_launch_compiled(N: int, NH: int, D: int, dtype, device_limits: DeviceLimits, *, cell: str,
                                feedback: TeamFeedback, compiled, BB: int | None = None,
                                team_cols: int | None = None, team_resident: bool | None = None,
                                num_stages: int | None = None, BK: int | None = None) -> TeamLaunch | None:
    """``choose_team_launch`` with compiler feedback (the team path has no register model, so its first choice is
    always compiled once): the candidates meeting every constraint are examined in the objective's order; one not
    yet seen compiled for the cell is compiled by ``compiled(launch) -> (spill bytes per thread, failed)``
    (``team.compile_check``) and recorded in ``feedback`` (spilled from ``TEAM_SPILL_BYTES`` on). The first that
    compiled without a spill is returned; a failed one is passed over; after ``TEAM_MAX_CHECKS`` candidates the
    first that compiled (with spills) is returned; None where none fits or all failed. The examination order is
    fixed, so the result depends only on the compiled kernels, not on the order of calls."""
    if not isinstance(feedback, TeamFeedback):
        raise TypeError(f"`feedback` must be a TeamFeedback, got {type(feedback).__name__}")
    _check_cell(cell)
    if cell is None:
        raise ValueError("`cell` must name the cell whose kernels are compiled")
    fixed = {"BB": BB, "team_cols": team_cols, "team_resident": team_resident, "num_stages": num_stages}
    _check_team(N, NH, D, dtype, device_limits, fixed, BK)
    order = sorted((c for c in itertools.product(*_team_space(fixed))
                    if all(team_constraints(c, D, dtype, device_limits, BK).values())),
                   key=lambda c: team_objective(c, N, NH, D, device_limits))
    first_run = None
    for cand in order[:TEAM_MAX_CHECKS]:
        launch = _team_result(cand, N, NH, D, dtype, device_limits, BK)
        if not feedback.observed(D, dtype, cand, cell):
            spill, failed = compiled(launch)
            feedback.record(D, dtype, cand, cell, spilled=spill >= TEAM_SPILL_BYTES, failed=bool(failed))
        spilled, failed = feedback.excluded(D, dtype, cell)
        if cand in failed:
            continue
        if cand not in spilled:
            return launch
        first_run = first_run or launch
    return first_run


choose_team_launch.cache_info = _choose_team.cache_info
choose_team_launch.cache_clear = _choose_team.cache_clear
