"""The fused RNN launch optimizer (``tfla/ops/rnn/tiling.py``): constraints of every choice, branch-and-bound against
enumeration, the cache, argument errors, the shared-memory model against sm_90 compiles, feedback, and the H100
hand defaults of ``cells.fused_launch`` at the shapes the tests and docs use."""
import itertools
import types

import pytest
import torch

from tfla.ops.rnn import tiling
from tfla.ops.rnn.cells import CONFIG_KEYS, fused_launch
from tfla.ops.rnn.tiling import (CELLS, H100, SPACE, DeviceLimits, FusedFeedback, choose_fused_launch,
                                 exhaustive_fused_launch, fused_constraints, fused_cost, fused_smem)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SMALL = DeviceLimits(name="small", sms=4, regs_per_sm=32768, smem_per_block=65536, smem_per_sm=98304,
                     max_warps_per_sm=32)
LIMITS = (H100, SMALL, DeviceLimits(name="A100-like", sms=108, smem_per_block=166912, smem_per_sm=167936))
SHAPES = [(1, 1), (17, 3), (16, 48), (256, 12), (4096, 48)]


def test_space_is_the_cells_config_space():
    assert SPACE == {k: v for k, v in CONFIG_KEYS.items() if k != "path" and not k.startswith("team_")}


@pytest.mark.parametrize("limits", LIMITS, ids=lambda l: l.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [1, 16, 20, 32, 48, 64, 96, 128])
def test_choice_meets_every_constraint_and_equals_enumeration(limits, dtype, D):
    """Every choice meets every constraint, equals the enumeration's, and beats (or ties) every feasible candidate."""
    for (N, NH), cell in itertools.product(SHAPES, (None, *CELLS)):
        got = choose_fused_launch(N, NH, D, dtype, limits, cell=cell)
        assert got == exhaustive_fused_launch(N, NH, D, dtype, limits, cell=cell)
        feasible = [c for c in itertools.product(*SPACE.values())
                    if all(fused_constraints(c, cell, D, dtype, limits).values())]
        if got is None:
            assert not feasible
            continue
        cons = fused_constraints(got, cell, D, dtype, limits)
        assert all(cons.values()), cons
        assert fused_cost(cell, D, dtype, *got, limits).smem <= limits.smem_per_block
        key = tiling.fused_objective(got, N, NH, cell, D, dtype, limits)
        assert all(key <= tiling.fused_objective(c, N, NH, cell, D, dtype, limits) for c in feasible)


@pytest.mark.parametrize("fixed", [dict(BB=32), dict(num_warps=2), dict(num_stages=3), dict(BB=64, num_stages=1),
                                   dict(BB=16, num_warps=8, num_stages=2)])
@pytest.mark.parametrize("limits", LIMITS[:2], ids=lambda l: l.name)
def test_fixed_variables_equal_enumeration(fixed, limits):
    """Small spaces (some variables fixed, as ConstrINT allows) and feedback sets: branch-and-bound = enumeration."""
    spilled = frozenset({(16, 8, 2), (32, 4, 1)})
    failed = frozenset({(16, 4, 2), (64, 8, 1)})
    for dtype, D, (N, NH), cell in itertools.product(DTYPES, (16, 64, 128), SHAPES, (None, "gru")):
        fb = FusedFeedback()
        for c in spilled:
            fb.record(D, dtype, c, spilled=True)
        for c in failed:
            fb.record(D, dtype, c, failed=True)
        got = choose_fused_launch(N, NH, D, dtype, limits, cell=cell, feedback=fb, **fixed)
        want = exhaustive_fused_launch(N, NH, D, dtype, limits, cell=cell, spilled=spilled, failed=failed, **fixed)
        assert got == want
        if got is not None:
            assert got not in failed
            for i, k in enumerate(SPACE):
                if k in fixed:
                    assert got[i] == fixed[k]


def _hand_rule(cell, D, dtype):
    """BB = 16, 8 warps above D = 32 else 4, and the most stages whose shared memory (every cell's when cell is None)
    fits the H100's block."""
    BD = tiling.dot_tile(D, 128, dtype)
    cells = CELLS if cell is None else (cell,)
    st = max(s for s in SPACE["num_stages"]
             if all(fused_smem(c, k, 16, BD, s, dtype) <= H100.smem_per_block for c in cells for k in ("fwd", "bwd")))
    return 16, 8 if D > 32 else 4, st


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [1, 4, 12, 16, 17, 20, 31, 32, 33, 48, 63, 64])
@pytest.mark.parametrize("cell", (None, *CELLS))
def test_reproduces_h100_defaults(dtype, D, cell):
    """At the shapes the tests (N <= 19, NH <= 3) and the docs (B = 16, D x NH = 768) use, the optimizer on the H100's
    limits chooses the hand rule (``_hand_rule``): 3 stages wherever they fit (16-bit inputs at every D <= 64; fp32
    but for some cells at D > 32)."""
    want = _hand_rule(cell, D, dtype)
    got = fused_launch(None, dtype, 1, 1, D, cell=cell)
    assert got.path == "fused" and (got.BB, got.num_warps, got.num_stages) == want
    if dtype != torch.float32:
        assert want[2] == 3
    for N, NH in [(1, 1), (2, 2), (3, 2), (17, 3), (19, 3), (16, 768 // max(D, 16)), (16, 48), (64, 12)]:
        assert choose_fused_launch(N, NH, D, dtype, H100, cell=cell) == want, (N, NH)


def test_many_programs_trade_stages_and_warps_for_residency():
    """Beyond one wave the objective may leave the hand rule (unmeasured on a GPU): bf16 D = 16 with 768 programs
    takes 2 stages (less shared memory, the programs in one wave); fp32 D = 16 with 768 x 16 rows takes 32-row tiles."""
    assert choose_fused_launch(16, 48, 16, torch.bfloat16) == (16, 4, 3)
    assert choose_fused_launch(256, 48, 16, torch.bfloat16) == (16, 4, 2)
    assert choose_fused_launch(1, 48, 16, torch.float32) == (16, 4, 3)
    assert choose_fused_launch(256, 48, 16, torch.float32)[0] == 32


# sm_90, Triton 3.6.0 (compile_stats.py --op rnn), BB = 16, 2 stages: shared bytes of (forward, backward)
SMEM_SM90 = {
    (torch.bfloat16, 64): {"elman": (14336, 22528), "lstm": (45056, 79872), "gru": (34816, 57344),
                           "slstm": (45056, 100352)},
    (torch.float32, 64): {"gru": (118784, 143360), "slstm": (155648, 212992)},
    (torch.bfloat16, 16): {"elman": (5120, 9216), "lstm": (14336, 31744), "gru": (11264, 22528),
                           "slstm": (14336, 41984)},
}


@pytest.mark.parametrize("key", list(SMEM_SM90), ids=str)
def test_smem_model_matches_sm90_compiles(key):
    dtype, D = key
    BD = tiling.dot_tile(D, 128, dtype)
    for cell, (fwd, bwd) in SMEM_SM90[key].items():
        assert fused_smem(cell, "fwd", 16, BD, 2, dtype) == fwd
        assert fused_smem(cell, "bwd", 16, BD, 2, dtype, state_sequence=False) == bwd


def test_bf16_d128_slstm_takes_one_stage():
    """D = 128 bf16: two stages of the sLSTM's backward need 266240 B > 232448 (the hand rule's (16, 8, 2) does not
    fit), one stage fits; fp32 LSTM: R alone (4 x 128 x 128 x 4 B x 2 copies) exceeds every block."""
    assert fused_smem("slstm", "bwd", 16, 128, 2, torch.bfloat16, state_sequence=False) == 266240
    assert choose_fused_launch(16, 6, 128, torch.bfloat16, cell="slstm")[2] == 1
    assert choose_fused_launch(16, 6, 128, torch.float32, cell="lstm") is None


def test_feedback_excludes_and_ranks_last():
    fb = FusedFeedback()
    args = (16, 12, 64, torch.bfloat16)
    assert choose_fused_launch(*args, feedback=fb) == (16, 8, 3)
    fb.record(64, torch.bfloat16, (16, 8, 3), cell="slstm", failed=True)
    assert choose_fused_launch(*args, cell="lstm", feedback=fb) == (16, 8, 3)  # another cell's observation
    got = choose_fused_launch(*args, feedback=fb)
    assert got != (16, 8, 3) and got is not None
    fb.record(64, torch.bfloat16, got, spilled=True)
    again = choose_fused_launch(*args, feedback=fb)
    assert again not in ((16, 8, 3), got)
    assert fb.excluded(64, torch.bfloat16) == (frozenset({got}), frozenset({(16, 8, 3)}))
    assert fb.excluded(48, torch.bfloat16)[1] == frozenset({(16, 8, 3)})  # same tile BD = 64
    assert fb.excluded(32, torch.bfloat16) == (frozenset(), frozenset())


def test_cache():
    choose_fused_launch.cache_clear()
    choose_fused_launch(16, 12, 64, torch.bfloat16)
    choose_fused_launch(16, 12, 64, torch.bfloat16)
    info = choose_fused_launch.cache_info()
    assert (info.hits, info.misses) == (1, 1)
    choose_fused_launch(16, 12, 64, torch.bfloat16, SMALL)
    assert choose_fused_launch.cache_info().misses == 2


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(N=0), ValueError, "`N`"), (dict(N=1.5), TypeError, "`N`"), (dict(NH=True), TypeError, "`NH`"),
    (dict(D=0), ValueError, "`D`"), (dict(D=129), ValueError, "`D`"), (dict(dtype=torch.float64), TypeError, "`dtype`"),
    (dict(dtype="bf16"), TypeError, "`dtype`"), (dict(device_limits={}), TypeError, "`device_limits`"),
    (dict(cell="rnn"), ValueError, "`cell`"), (dict(BB=8), ValueError, "`BB`"),
    (dict(num_warps=16), ValueError, "`num_warps`"), (dict(num_stages=0), ValueError, "`num_stages`"),
    (dict(feedback={}), TypeError, "`feedback`"),
])
def test_bad_arguments(kwargs, exc, match):
    args = dict(N=16, NH=4, D=32, dtype=torch.float32, device_limits=H100, **{})
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        choose_fused_launch(**args)


def test_bad_limits_and_feedback():
    with pytest.raises(ValueError, match="`sms`"):
        DeviceLimits(sms=0)
    with pytest.raises(TypeError, match="`config`"):
        FusedFeedback().record(16, torch.float32, [16, 4, 2], failed=True)
    with pytest.raises(ValueError, match="`cell`"):
        FusedFeedback().record(16, torch.float32, (16, 4, 2), cell="x", failed=True)


def test_from_device(monkeypatch):
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            DeviceLimits.from_device()
    props = types.SimpleNamespace(name="fake", multi_processor_count=108, regs_per_multiprocessor=65536,
                                  shared_memory_per_block_optin=166912, shared_memory_per_multiprocessor=167936,
                                  max_threads_per_multi_processor=2048, warp_size=32)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    lim = DeviceLimits.from_device()
    assert (lim.sms, lim.smem_per_block, lim.smem_per_sm, lim.max_warps_per_sm) == (108, 166912, 167936, 64)


# the team path's search (tiling.choose_team_launch)
TEAM_DS = [65, 96, 192, 200, 256, 768, 1024, 2560, 4096]
TEAM_SHAPES = [(1, 1), (17, 3), (16, 1), (32, 1), (40, 1), (64, 6), (256, 12), (384, 6)]


def test_team_space_is_the_cells_config_space():
    assert tiling.TEAM_SPACE == {k: CONFIG_KEYS[k] for k in ("BB", "team_cols", "team_resident", "num_stages")}


@pytest.mark.parametrize("limits", LIMITS, ids=lambda l: l.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_team_choice_meets_every_constraint_and_equals_enumeration(limits, dtype):
    """Every team choice meets every constraint, equals the enumeration's, and beats (or ties) every feasible
    candidate."""
    space = list(itertools.product(*tiling.TEAM_SPACE.values()))
    for D, (N, NH) in itertools.product(TEAM_DS, TEAM_SHAPES):
        got = tiling.choose_team_launch(N, NH, D, dtype, limits)
        assert got == tiling.exhaustive_team_launch(N, NH, D, dtype, limits)
        feasible = [c for c in space if all(tiling.team_constraints(c, D, dtype, limits).values())]
        if got is None:
            assert not feasible
            continue
        cand = (got.BB, got.BC, got.resident, got.num_stages)
        cons = tiling.team_constraints(cand, D, dtype, limits)
        assert all(cons.values()), cons
        assert tiling.team_smem(got.BB, got.BC, D, dtype, got.resident, got.num_stages) <= limits.smem_per_block
        key = tiling.team_objective(cand, N, NH, D, limits)
        assert all(key <= tiling.team_objective(c, N, NH, D, limits) for c in feasible)
        assert got.fits == (-(-D // got.BC) * -(-N // got.BB) * NH <= limits.sms)


@pytest.mark.parametrize("fixed", [dict(BB=32), dict(team_cols=64), dict(team_resident=False), dict(num_stages=1),
                                   dict(BB=16, team_cols=16, team_resident=True), dict(BK=64)])
def test_team_fixed_variables_equal_enumeration(fixed):
    """Small spaces (some variables fixed): branch-and-bound = enumeration, and the fixed values are kept."""
    for limits, dtype, D, (N, NH) in itertools.product(LIMITS[:2], DTYPES, (96, 768, 2048), TEAM_SHAPES):
        got = tiling.choose_team_launch(N, NH, D, dtype, limits, **fixed)
        assert got == tiling.exhaustive_team_launch(N, NH, D, dtype, limits, **fixed)
        if got is not None:
            names = {"BB": got.BB, "team_cols": got.BC, "team_resident": got.resident, "num_stages": got.num_stages}
            for k, v in fixed.items():
                assert (got.BK if k == "BK" and not got.resident else names.get(k, v)) == v


def test_team_launches_measured_on_h100():
    """The launches the H100 runs measured (the cells' README, "Team path"): one 16-row tile of 48 members holding R
    at B = 16, D = 768; two such tiles at B = 32 (one 32-row tile would stream R: 6.00 / 21.06 against 4.93 / 14.08
    ms); from 33 rows one 64-row tile streaming R at 2 stages (3 need 245,760 B of shared memory, the launch
    raised); fp32 streams 32-wide slices; 6 heads of 128 over 6 tiles of 64 rows take 64 units per member."""
    t = tiling.choose_team_launch
    assert t(16, 1, 768, torch.bfloat16) == tiling.TeamLaunch(16, 16, 1024, True, 3, True)
    assert t(32, 1, 768, torch.bfloat16) == tiling.TeamLaunch(16, 16, 1024, True, 3, True)
    assert t(40, 1, 768, torch.bfloat16) == tiling.TeamLaunch(64, 16, 128, False, 2, True)
    assert t(64, 1, 768, torch.float32) == tiling.TeamLaunch(64, 16, 32, False, 2, True)
    assert t(384, 6, 128, torch.bfloat16).BC == 64
    assert tiling.team_smem(64, 16, 768, torch.bfloat16, False, 3) == 245760  # the runtime's "Required: 245760"
    assert tiling.team_smem(64, 16, 768, torch.bfloat16, False, 3) > tiling.team_smem_budget(H100)
    # 256 rows of one head of 768: 4 tiles x 48 members of 16 units do not fit 132 SMs, 4 x 24 of 32 units do
    assert t(256, 1, 768, torch.bfloat16) == tiling.TeamLaunch(64, 32, 128, False, 2, True)
    # 12 heads of 768 over 6 tiles: no team fits at once; one launch per step with the fewest programs
    got = t(384, 12, 768, torch.bfloat16)
    assert not got.fits and got.BC == 128


def test_team_cache_and_bad_arguments():
    tiling.choose_team_launch.cache_clear()
    tiling.choose_team_launch(16, 1, 768, torch.bfloat16)
    tiling.choose_team_launch(16, 1, 768, torch.bfloat16)
    assert (tiling.choose_team_launch.cache_info().hits, tiling.choose_team_launch.cache_info().misses) == (1, 1)
    for kwargs, exc, match in [(dict(BB=8), ValueError, "`BB`"), (dict(team_cols=48), ValueError, "`team_cols`"),
                               (dict(team_resident=1), ValueError, "`team_resident`"),
                               (dict(num_stages=4), ValueError, "`num_stages`"), (dict(BK=100), ValueError, "`BK`"),
                               (dict(N=0), ValueError, "`N`"), (dict(dtype=torch.float64), TypeError, "`dtype`"),
                               (dict(device_limits=None), TypeError, "`device_limits`")]:
        args = dict(N=16, NH=1, D=768, dtype=torch.bfloat16, device_limits=H100)
        args.update(kwargs)
        with pytest.raises(exc, match=match):
            tiling.choose_team_launch(**args)


def _first_checked_shape():
    """A shape (dtype, D, cell) whose default fused choice is predicted at or above the check's register fraction."""
    for dtype in DTYPES:
        for D in (16, 32, 48, 64, 128):
            for cell in CELLS:
                got = choose_fused_launch(16, 2, D, dtype, cell=cell)
                if got is not None and fused_cost(cell, D, dtype, *got).regs >= \
                        tiling.REG_CHECK_FRACTION * H100.regs_per_thread:
                    return dtype, D, cell
    raise AssertionError("no default choice reaches the check's register fraction")


def test_compiled_feedback_passes_over_spills_and_failures():
    """A fake compiler: the search's first choice spills, the second fails to compile; the third is taken, each
    config compiled once, and a second search with the same feedback compiles nothing (order of calls does not
    matter: the result is the first clean config in the objective's order)."""
    dtype, D, cell = _first_checked_shape()
    calls = []
    bad = {}

    def compiled(config):
        calls.append(config)
        if not bad:
            bad[config] = (tiling.SPILL_BYTES, False)
        elif len(bad) == 1 and config not in bad:
            bad[config] = (0, True)
        return bad.get(config, (tiling.SPILL_BYTES - 1, False))  # below the threshold: clean

    fb = FusedFeedback()
    got = tiling.choose_fused_launch_compiled(16, 2, D, dtype, H100, cell=cell, feedback=fb, compiled=compiled)
    spilled, failed = fb.excluded(D, dtype, cell)
    assert len(spilled) == 1 and len(failed) == 1 and got not in spilled | failed
    assert calls[:2] == [next(iter(spilled)), next(iter(failed))] and len(calls) == len(set(calls))
    assert got == choose_fused_launch(16, 2, D, dtype, cell=cell, feedback=fb)  # the plain search agrees
    n = len(calls)
    assert tiling.choose_fused_launch_compiled(16, 2, D, dtype, H100, cell=cell, feedback=fb, compiled=compiled) == got
    assert len(calls) == n  # every config seen once


def test_compiled_feedback_all_spill_and_below_fraction():
    """Where every checked config spills, the best spilled one is returned (a spill runs; a failure does not); a
    choice predicted below the register fraction is taken without compiling."""
    dtype, D, cell = _first_checked_shape()
    calls = []
    fb = FusedFeedback()
    got = tiling.choose_fused_launch_compiled(16, 2, D, dtype, H100, cell=cell, feedback=fb,
                                              compiled=lambda c: calls.append(c) or (512, False))
    assert got is not None and len(calls) == len(set(calls)) >= 1
    assert got in fb.excluded(D, dtype, cell)[0] or \
        fused_cost(cell, D, dtype, *got).regs < tiling.REG_CHECK_FRACTION * H100.regs_per_thread
    light = choose_fused_launch(16, 2, 16, torch.bfloat16, cell="elman")
    assert fused_cost("elman", 16, torch.bfloat16, *light).regs < tiling.REG_CHECK_FRACTION * H100.regs_per_thread
    assert tiling.choose_fused_launch_compiled(16, 2, 16, torch.bfloat16, H100, cell="elman", feedback=FusedFeedback(),
                                               compiled=lambda c: pytest.fail("compiled a light config")) == light
    with pytest.raises(ValueError, match="`cell`"):
        tiling.choose_fused_launch_compiled(16, 2, 16, torch.bfloat16, H100, cell=None, feedback=fb, compiled=len)
    with pytest.raises(TypeError, match="`feedback`"):
        tiling.choose_fused_launch_compiled(16, 2, 16, torch.bfloat16, H100, cell="lstm", feedback={}, compiled=len)


def test_team_feedback_excludes_and_ranks_after():
    """A failed team candidate is excluded, a spilled one ranks after every candidate without a recorded spill
    (still before teams that do not fit the SMs at once); another cell's record does not count; the branch-and-bound
    equals the enumeration with the same sets."""
    args = (16, 1, 768, torch.bfloat16)
    first = tiling.choose_team_launch(*args)
    c1 = (first.BB, first.BC, first.resident, first.num_stages)
    fb = tiling.TeamFeedback()
    fb.record(768, torch.bfloat16, c1, cell="lstm", failed=True)
    assert tiling.choose_team_launch(*args, cell="gru", feedback=fb) == first
    second = tiling.choose_team_launch(*args, cell="lstm", feedback=fb)
    c2 = (second.BB, second.BC, second.resident, second.num_stages)
    assert c2 != c1 and second.fits
    fb.record(768, torch.bfloat16, c2, cell="lstm", spilled=True)
    third = tiling.choose_team_launch(*args, cell="lstm", feedback=fb)
    assert (third.BB, third.BC, third.resident, third.num_stages) not in (c1, c2) and third.fits
    assert fb.excluded(768, torch.bfloat16, "lstm") == (frozenset({c2}), frozenset({c1}))
    assert fb.excluded(768, torch.bfloat16, "gru") == (frozenset(), frozenset())
    for limits, D, (N, NH), fixed in itertools.product(LIMITS[:2], (192, 768), TEAM_SHAPES,
                                                       (dict(), dict(team_resident=True), dict(num_stages=3))):
        got = tiling.choose_team_launch(N, NH, D, torch.bfloat16, limits, cell="lstm", feedback=fb, **fixed)
        spilled, failed = fb.excluded(D, torch.bfloat16, "lstm")
        want = tiling.exhaustive_team_launch(N, NH, D, torch.bfloat16, limits, spilled=spilled, failed=failed, **fixed)
        assert got == want
    with pytest.raises(TypeError, match="`config`"):
        fb.record(768, torch.bfloat16, (16, 16, 1, 3), failed=True)  # resident must be a bool
    with pytest.raises(TypeError, match="`feedback`"):
        tiling.choose_team_launch(*args, feedback=tiling.FusedFeedback())
    with pytest.raises(ValueError, match="`cell`"):
        tiling.choose_team_launch(*args, cell="rnn")


def test_team_compiled_feedback_passes_over_spills_and_failures():
    """A fake compiler: the team search's first choice fails, the second spills (from TEAM_SPILL_BYTES per thread),
    the third compiles clean and is taken; each candidate compiled once; a second search with the same feedback
    compiles nothing; where every candidate spills, the first of TEAM_MAX_CHECKS examined is taken (a spill runs, a
    failure does not), and where all fail, none."""
    calls, bad = [], {}

    def compiled(launch):
        cand = (launch.BB, launch.BC, launch.resident, launch.num_stages)
        calls.append(cand)
        if not bad:
            bad[cand] = (0, True)
        elif len(bad) == 1 and cand not in bad:
            bad[cand] = (tiling.TEAM_SPILL_BYTES, False)
        return bad.get(cand, (tiling.TEAM_SPILL_BYTES - 1, False))

    fb = tiling.TeamFeedback()
    args = (16, 1, 768, torch.bfloat16, H100)
    got = tiling.choose_team_launch_compiled(*args, cell="lstm", feedback=fb, compiled=compiled)
    spilled, failed = fb.excluded(768, torch.bfloat16, "lstm")
    assert len(spilled) == 1 and len(failed) == 1 and len(calls) == 3 == len(set(calls))
    assert calls[:2] == [next(iter(failed)), next(iter(spilled))]
    assert (got.BB, got.BC, got.resident, got.num_stages) == calls[2]
    assert calls[0] == (lambda t: (t.BB, t.BC, t.resident, t.num_stages))(tiling.choose_team_launch(*args))
    assert tiling.choose_team_launch_compiled(*args, cell="lstm", feedback=fb, compiled=compiled) == got
    assert len(calls) == 3
    n = []
    every = tiling.choose_team_launch_compiled(*args, cell="gru", feedback=tiling.TeamFeedback(),
                                               compiled=lambda l: n.append(l) or (4096, False))
    assert every == tiling.choose_team_launch(*args) and len(n) == tiling.TEAM_MAX_CHECKS
    assert tiling.choose_team_launch_compiled(*args, cell="gru", feedback=tiling.TeamFeedback(),
                                              compiled=lambda l: (0, True)) is None
    with pytest.raises(ValueError, match="`cell`"):
        tiling.choose_team_launch_compiled(*args, cell=None, feedback=fb, compiled=compiled)
    with pytest.raises(TypeError, match="`feedback`"):
        tiling.choose_team_launch_compiled(*args, cell="lstm", feedback=tiling.FusedFeedback(), compiled=compiled)
