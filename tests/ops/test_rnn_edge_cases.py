"""Edge cases of tfla.elman / lstm / gru / slstm that issue 27 asks for, fp32 against the float64 step loop
(``recurrent_rnn_ref``): h, every final state and the gradients of x, R, b and every initial-state tensor, with
random cotangents for h and the final states (the sLSTM's m excluded: a constant of the backward).

- B = 17 (past one 16-row batch tile, a multiple of no BB) with head dims that are not powers of two: 48 on the
  fused and alternating paths, 96 on the fused path forced (BD = 128, beyond its default D <= 64), 192 on the team
  (its default above 64) and alternating paths (the fused path takes D <= 128).
- Pre-activations near +-30: saturated sigmoids and tanhs, the sLSTM's exponential gates at the ends of the m
  stabilizer's range.
- Determinism: two forward + backward runs bitwise equal, the second with every ``torch.empty`` NaN-filled.
- D = 768 (the paper's hidden size as one head; not a power of two), the default (team) path.
- Non-finite pre-activations (NaN, +-inf) in one row: forward and backward finish, the other rows are untouched.

Tolerances (rel-L2 per tensor): forward ``tolerance(float32)`` (1e-5 on the interpreter, 3e-5 on CUDA), gradients
1e-4 (the issue's bound).
"""
import functools

import pytest
import torch

import tfla
from tfla.ops.rnn.reference import CELL_GATES, CELL_STATES, recurrent_rnn_ref
from tfla.ops.rnn.tiling import DeviceLimits, choose_fused_launch
from tfla.utils.testing import assert_rel_close, rnn_grads, tolerance

CELLS = ("elman", "lstm", "gru", "slstm")
FWD_TOL = tolerance(torch.float32)
GRAD_TOL = 1e-4
B, T, NH = 17, 4, 2
# (path, D): the fused path's default D (48), its largest tile forced (96 -> BD = 128), the team path's default D
# (192), the alternating path at 48 and 192
PATH_D = [("fused", 48), ("fused", 96), ("team", 192), ("alternating", 48), ("alternating", 192)]


def _inputs(cell, D, seed, saturate=None, B=B, T=T, NH=NH):
    """fp32 x ``[B, T, G, NH, D]``, R, b and an initial state (the sLSTM's n > 0 but in row 0, where n = c = 0
    makes m_t = g^i). saturate: None (x ~ N(0, 1)), ``"half"`` (a random half of x's elements, every gate, at
    +-30 + N(0, 0.1^2)) or ``"all"`` (every element so). B, T, NH: the module's unless given."""
    gen = torch.Generator().manual_seed(seed)
    G, S = len(CELL_GATES[cell]), len(CELL_STATES[cell])
    x = torch.randn(B, T, G, NH, D, generator=gen)
    if saturate is not None:
        sat = 30.0 * torch.randn(x.shape, generator=gen).sign() + 0.1 * torch.randn(x.shape, generator=gen)
        frac = {"half": 0.5, "all": 1.0}[saturate]
        x = torch.where(torch.rand(x.shape, generator=gen) < frac, sat, x)
    R = torch.randn(G, NH, D, D, generator=gen) / D ** 0.5
    b = torch.randn(G, NH, D, generator=gen) * 0.5
    state = [torch.randn(B, NH, D, generator=gen) * 0.5 for _ in range(S)]
    if cell == "slstm":
        state[2] = state[2].abs() + 0.3
        state[2][0], state[1][0] = 0.0, 0.0
    return x, R, b, tuple(state)


def _run(fn, cell, x, R, b, state, device):
    """``(h, final state tuple, (dx, dR, db, *dstate0))`` of ``fn`` (a cell's signature) on copies of the inputs
    on ``device`` in their dtype, the same float64 cotangents (cast) for every dtype (``rnn_grads``)."""
    return rnn_grads(fn, cell, *(t.to(device) for t in (x, R, b)), tuple(t.to(device) for t in state))


def _tfla(cell, path):
    return functools.partial(getattr(tfla, cell), config={"path": path})


def _reference(cell, x, R, b, state):
    fn = lambda *a: recurrent_rnn_ref(cell, *a)  # noqa: E731
    return _run(fn, cell, x.double(), R.double(), b.double(), tuple(s.double() for s in state), "cpu")


def _grad_names(cell):
    return ["dx", "dR", "db"] + [f"d{s}0" for s in CELL_STATES[cell]]


def _check_forward(cell, got, ref):
    assert got[0].dtype == torch.float32 and got[0].shape == ref[0].shape
    assert_rel_close("h", got[0], ref[0], FWD_TOL)
    for name, f, fr in zip(CELL_STATES[cell], got[1], ref[1]):
        assert_rel_close(f"final {name}", f, fr, FWD_TOL)


def _check_m0_grad(g):
    """The sLSTM's initial m: no gradient (None, or zeros from the kernels)."""
    assert g is None or (torch.isfinite(g).all() and torch.count_nonzero(g) == 0)


def _check(cell, got, ref):
    _check_forward(cell, got, ref)
    for name, g, gr in zip(_grad_names(cell), got[2], ref[2]):
        if gr is None:
            _check_m0_grad(g)
            continue
        assert_rel_close(name, g, gr, GRAD_TOL)


@pytest.mark.parametrize("path,D", PATH_D)
@pytest.mark.parametrize("cell", CELLS)
def test_batch17_odd_head_dim(cell, path, D, device, poison_empty):
    """B = 17 over two batch tiles (fused: 16 rows + 1), 2 heads, 4 steps, D not a power of two, with initial and
    final states; outputs NaN-poisoned so an unwritten row or column shows."""
    x, R, b, s = _inputs(cell, D, seed=1000 + D)
    if device == "cuda" and path == "fused" and choose_fused_launch(
            B, NH, D, torch.float32, DeviceLimits.from_device(), cell=cell) is None:
        # fp32 R of all gates at BD = 128 does not fit one block of this GPU (H100: the LSTM's 573,440 B): the forced
        # path refuses with a ValueError naming the config (the interpreter, without that limit, runs it)
        with pytest.raises(ValueError, match="`config`"):
            _run(_tfla(cell, path), cell, x, R, b, s, device)
        return
    got = _run(_tfla(cell, path), cell, x, R, b, s, device)
    _check(cell, got, _reference(cell, x, R, b, s))


@pytest.mark.parametrize("path,D", [("fused", 48), ("alternating", 192)])
@pytest.mark.parametrize("cell", CELLS)
def test_half_saturated_preactivations(cell, path, D, device):
    """Half of every gate's pre-activations near +-30 (x = +-30 + noise, R h + b adds about +-2), the other half
    moderate, so the gradients have a part that does not vanish: every output and gradient finite and within
    tolerance of the reference (sLSTM: exp(g^i - m_t) with g^i = +-30, logsigmoid(-30) in the forget gate)."""
    x, R, b, s = _inputs(cell, D, seed=2000 + D, saturate="half")
    got = _run(_tfla(cell, path), cell, x, R, b, s, device)
    _check(cell, got, _reference(cell, x, R, b, s))


# gradients that stay O(1) when every pre-activation is near +-30; the rest vanish (|.| ~ 1e-13 or 0)
_LIVE_WHEN_SATURATED = {"elman": set(), "lstm": {"dc0"}, "gru": {"dh0"}, "slstm": {"dx", "dR", "db", "dh0", "dc0",
                                                                                  "dn0"}}
_VANISHED = 1e-9


@pytest.mark.parametrize("path,D", [("fused", 48), ("alternating", 192)])
@pytest.mark.parametrize("cell", CELLS)
def test_saturated_preactivations(cell, path, D, device):
    """Every pre-activation near +-30. Outputs and final states within tolerance. Gradients: those that stay O(1)
    (the LSTM's c0 through f = sigmoid(+-30), the GRU's h0 through z, all of the sLSTM's, whose input gate's
    derivative is exp(g^i - m_t) itself) within tolerance; the others vanish in the float64 reference (sigmoid'(30)
    ~ 1e-13) and must vanish here too (below 1e-9), not be compared by rel-L2: fp32 rounds 1 - sigmoid(30) to 0,
    as torch's fp32 autograd does, so their rel-L2 is ~0.7 and measures that rounding only."""
    x, R, b, s = _inputs(cell, D, seed=3000 + D, saturate="all")
    got = _run(_tfla(cell, path), cell, x, R, b, s, device)
    ref = _reference(cell, x, R, b, s)
    _check_forward(cell, got, ref)
    for name, g, gr in zip(_grad_names(cell), got[2], ref[2]):
        if gr is None:
            _check_m0_grad(g)
            continue
        live = name in _LIVE_WHEN_SATURATED[cell]
        assert (gr.abs().max() > _VANISHED) == live, f"{name}: reference max {gr.abs().max():.2e}"
        if live:
            assert_rel_close(name, g, gr, GRAD_TOL)
        else:
            assert torch.isfinite(g).all(), name
            assert g.abs().max() <= _VANISHED, f"{name}: max {g.abs().max():.2e}, reference {gr.abs().max():.2e}"


@pytest.mark.parametrize("path,D", [("fused", 48), ("alternating", 192)])
@pytest.mark.parametrize("cell", CELLS)
def test_deterministic(cell, path, D, device, request):
    """Two forward + backward runs on identical inputs give bitwise-equal h, final states and gradients; the second
    runs with every ``torch.empty`` / ``empty_like`` NaN-filled, so a result that reads memory no kernel wrote
    differs (NaN is unequal to itself)."""
    x, R, b, s = _inputs(cell, D, seed=4000 + D, saturate="half")
    first = _run(_tfla(cell, path), cell, x, R, b, s, device)
    request.getfixturevalue("poison_empty")  # from here on
    second = _run(_tfla(cell, path), cell, x, R, b, s, device)
    names = ["h"] + [f"final {n}" for n in CELL_STATES[cell]] + _grad_names(cell)
    for name, a, c in zip(names, [first[0], *first[1], *first[2]], [second[0], *second[1], *second[2]]):
        assert (a is None) == (c is None), name
        assert a is None or torch.equal(a, c), f"{name}: runs differ, max {(a - c).abs().max():.2e}"


@pytest.mark.parametrize("cell", CELLS)
def test_head_dim_768(cell, device):
    """D = 768 at NH = 1 (the FlashRNN paper's hidden size as one head; not a power of two) on the default path
    (team, D > 64): h, final states and every gradient against the float64 step loop; B = 3, 3 steps."""
    x, R, b, s = _inputs(cell, 768, seed=5000, B=3, T=3, NH=1)
    got = _run(getattr(tfla, cell), cell, x, R, b, s, device)
    _check(cell, got, _reference(cell, x, R, b, s))


# numpy, under the interpreter, warns on the inf - inf these inputs make (the sLSTM's exp(g^i - m_t) at g^i = inf)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("path", ["fused", "team", "alternating"])
@pytest.mark.parametrize("cell", CELLS)
def test_nonfinite_preactivations_finish(cell, path, value, device):
    """Bad input: non-finite pre-activations never hang a kernel (every loop runs a fixed number of steps; the team
    path's members wait on a count of arrivals, never on a value). Row 0's x at step 1, every gate, set to NaN / +-inf (D = 20: masked columns; B = 17:
    row 0 shares its fused batch tile with rows 1-15): forward and backward finish; the other rows' h, final states,
    dx and initial-state gradients equal the clean run's bitwise (rows do not mix), as do row 0's h at step 0 and
    its final-state-free parts; a NaN makes row 0's h NaN from step 1 on (not hidden)."""
    x, R, b, s = _inputs(cell, 20, seed=6000)
    x_bad = x.clone()
    x_bad[0, 1] = value
    clean = _run(_tfla(cell, path), cell, x, R, b, s, device)
    bad = _run(_tfla(cell, path), cell, x_bad, R, b, s, device)
    assert torch.equal(bad[0][1:], clean[0][1:]) and torch.equal(bad[0][0, :1], clean[0][0, :1])
    for name, f, fc in zip(CELL_STATES[cell], bad[1], clean[1]):
        assert torch.equal(f[1:], fc[1:]), f"final {name}"
    for name, g, gc in zip(_grad_names(cell), bad[2], clean[2]):
        if name in ("dR", "db") or g is None:  # sums over every row and step
            continue
        assert torch.equal(g[1:], gc[1:]), name
    if value != value:  # NaN
        assert torch.isnan(bad[0][0, 1:]).all()
