"""tfla.compat.flashrnn: FlashRNN 1.0.8's ``flashrnn(Wx, R, b, states, function, config, backend, dtype)`` on tfla's
cells, checked in FlashRNN's layout against a float64 step loop (every state at every step, the last states and the
gradients of Wx, R, b and the initial states), and against FlashRNN's own pure-PyTorch ``vanilla`` backend when
the ``flashrnn`` package is importable."""
import inspect

import pytest
import torch

from tfla.compat.flashrnn import BACKENDS, STATES, FlashRNNConfig, flashrnn
from tfla.ops.rnn.reference import CELL_STATES, recurrent_rnn_ref
from tfla.utils.testing import assert_rel_close, tolerance

FUNCTIONS = {"lstm": (4, 4, 4), "gru": (3, 3, 4), "slstm": (4, 4, 4), "elman": (1, 1, 1)}  # Wx, R, b gates


def _inputs(fn, B, T, NH, D, dtype=torch.float32, device="cpu", seed=0, states=True):
    """FlashRNN-layout inputs; sLSTM states with n = 0 (and c = 0) in batch row 0 and n >= 1 elsewhere, the
    states FlashRNN's kernels treat as tfla does."""
    gen = torch.Generator().manual_seed(seed)
    Gw, Gr, Gb = FUNCTIONS[fn]
    S = len(CELL_STATES[fn])
    Wx = torch.randn(B, T, Gw, NH, D, generator=gen)
    R = torch.randn(Gr, NH, D, D, generator=gen) / D ** 0.5
    b = torch.randn(Gb, NH, D, generator=gen) * 0.5
    s0 = torch.randn(S, B, 1, NH, D, generator=gen) * 0.5 if states else None
    if fn == "slstm" and states:
        s0[2] = s0[2].abs() + 1.0
        s0[1:3, 0] = 0.0
    cast = lambda t: None if t is None else t.to(dtype).to(device)  # noqa: E731
    return cast(Wx), cast(R), cast(b), cast(s0)


def _reference(fn, Wx, R, b, s0):
    """FlashRNN's recurrence in its layout, step by step in the inputs' dtype: ``(states [S, B, T, NH, D], last
    [S, B, 1, NH, D])``. The GRU is written out from FlashRNN's definition (its gate and bias order); the other
    functions share tfla's gate order, so one step of ``recurrent_rnn_ref`` each."""
    B, T, _, NH, D = Wx.shape
    S = len(CELL_STATES[fn])
    state = tuple(Wx.new_zeros(B, NH, D) for _ in range(S)) if s0 is None else tuple(s0[k, :, 0] for k in range(S))
    seq = []
    for t in range(T):
        if fn == "gru":  # R gates (n, r, z), b (n_h, r, z, n_x), Wx (r, z, n)
            h = state[0]
            Ry = torch.einsum("gned,bnd->bgne", R, h)
            r = torch.sigmoid(Wx[:, t, 0] + Ry[:, 1] + b[1])
            z = torch.sigmoid(Wx[:, t, 1] + Ry[:, 2] + b[2])
            n = torch.tanh(Wx[:, t, 2] + b[3] + r * (Ry[:, 0] + b[0]))
            state = (z * h + (1 - z) * n,)
        else:
            state = recurrent_rnn_ref(fn, Wx[:, t:t + 1], R, b, state, True)[1]
        seq.append(torch.stack(state))
    seq = torch.stack(seq, 2) if seq else torch.stack(state).unsqueeze(2)[:, :, :0]
    return seq, (seq[:, :, -1:] if T else torch.stack(state).unsqueeze(2))


def _run(fn_call, fn, Wx, R, b, s0, seed=1):
    """Outputs and the gradients of (Wx, R, b, s0) for random cotangents of both outputs."""
    leaves = [t.detach().clone().requires_grad_() for t in (Wx, R, b) + ((s0,) if s0 is not None else ())]
    seq, last = fn_call(fn, *leaves[:3], leaves[3] if s0 is not None else None)
    gen = torch.Generator().manual_seed(seed)
    cts = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype) for o in (seq, last)]
    grads = torch.autograd.grad((seq, last), leaves, cts, allow_unused=True)
    return seq, last, grads


def _compat(fn, Wx, R, b, s0, **kw):
    return flashrnn(Wx, R, b, states=s0, function=fn, **kw)


def _check(fn, got, ref, tol):
    seq, last, grads = got
    seq_r, last_r, grads_r = ref
    assert seq.shape == seq_r.shape and last.shape == last_r.shape
    S = len(CELL_STATES[fn])
    for k, name in enumerate(CELL_STATES[fn][:S]):
        assert_rel_close(f"states[{name}]", seq[k], seq_r[k], tol)
        assert_rel_close(f"last[{name}]", last[k], last_r[k], tol)
    for name, g, gr in zip(("dWx", "dR", "db", "dstates"), grads, grads_r):
        if fn == "slstm" and name == "dstates":  # m is a constant of the backward: its initial gradient is zero
            assert torch.count_nonzero(g[3]) == 0
            g, gr = g[:3], gr[:3]
        assert_rel_close(name, g, gr, tol)


@pytest.mark.parametrize("fn", list(FUNCTIONS))
@pytest.mark.parametrize("B,T,NH,D,with_states", [(2, 5, 2, 6, True), (3, 1, 1, 12, False), (1, 4, 3, 5, True)])
def test_matches_reference(fn, B, T, NH, D, with_states, device):
    Wx, R, b, s0 = _inputs(fn, B, T, NH, D, device=device, seed=B * 10 + T, states=with_states)
    got = _run(_compat, fn, Wx, R, b, s0)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    ref = _run(_reference, fn, d(Wx), d(R), d(b), d(s0))
    assert got[0].dtype == torch.float32 and got[0].shape == (len(CELL_STATES[fn]), B, T, NH, D)
    assert got[1].shape == (len(CELL_STATES[fn]), B, 1, NH, D)
    _check(fn, got, ref, tolerance(torch.float32))


@pytest.mark.parametrize("fn", ["lstm", "gru"])
def test_layouts_from_config(fn, device):
    """FlashRNN's other layouts (time-first input, head-first R and b, state-time-batch output) give the same
    values as the default layout, permuted; also with ``states``."""
    Wx, R, b, s0 = _inputs(fn, 2, 4, 2, 5, device=device, seed=3)
    seq, last = flashrnn(Wx, R, b, s0, function=fn)
    cfg = FlashRNNConfig(function=fn, num_heads=2, head_dim=5, input_shape="TBGHD", recurrent_shape="HPGD",
                         bias_shape="HGD", output_shape="STBHD")
    seq2, last2 = flashrnn(Wx.transpose(0, 1), R.permute(1, 3, 0, 2), b.transpose(0, 1), s0.transpose(1, 2),
                           config=cfg)
    assert seq2.shape == seq.transpose(1, 2).shape and last2.shape == last.transpose(1, 2).shape
    torch.testing.assert_close(seq2, seq.transpose(1, 2), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(last2, last.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_initial_val_backends_dtype_and_empty_sequence(device):
    Wx, R, b, _ = _inputs("lstm", 2, 3, 1, 4, device=device, seed=4, states=False)
    ref = flashrnn(Wx, R, b, torch.full((2, 2, 1, 1, 4), 0.25, device=device), function="lstm")
    got = flashrnn(Wx, R, b, config=FlashRNNConfig(function="lstm", num_heads=1, head_dim=4, initial_val=0.25))
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    base = flashrnn(Wx, R, b, function="lstm")
    for backend in BACKENDS:  # every FlashRNN backend name runs tfla's path
        torch.testing.assert_close(flashrnn(Wx, R, b, function="lstm", backend=backend, dtype="float32"), base,
                                   rtol=0, atol=0)
    seq, last = flashrnn(Wx[:, :0], R, b, torch.full((2, 2, 1, 1, 4), 0.5, device=device), function="lstm")
    assert seq.shape == (2, 2, 0, 1, 4) and torch.equal(last, torch.full((2, 2, 1, 1, 4), 0.5, device=device))


def test_mixed_dtypes(device):
    """fp16 Wx with fp32 R and b: the states come back in Wx's dtype."""
    Wx, R, b, s0 = _inputs("slstm", 2, 4, 2, 6, device=device, seed=5)
    seq, last = flashrnn(Wx.half(), R, b, s0, function="slstm")
    assert seq.dtype == last.dtype == torch.float16
    ref, _ = _reference("slstm", Wx.half().double(), R.double(), b.double(), s0.double())
    assert_rel_close("states", seq[:3], ref[:3], 1e-2)


def test_state_names_are_the_cells():
    assert STATES == CELL_STATES  # (the adapter keeps its own copy so that importing it does not import Triton)


def test_torch_compile(device):
    """gru traces whole (tfla's custom ops); lstm's state sequence runs eagerly through a graph break."""
    for fn, fullgraph in (("gru", True), ("lstm", False)):
        Wx, R, b, s0 = _inputs(fn, 2, 3, 2, 4, device=device, seed=8)
        compiled = torch.compile(lambda *a, fn=fn: flashrnn(*a, function=fn), backend="eager", fullgraph=fullgraph)
        for a, c in zip(compiled(Wx, R, b, s0), flashrnn(Wx, R, b, s0, function=fn)):
            torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)


def test_input_errors(device):
    Wx, R, b, s0 = _inputs("gru", 2, 3, 2, 4, device=device)
    with pytest.raises(ValueError, match="4 biases"):
        flashrnn(Wx, R, b[:3], function="gru")
    with pytest.raises(ValueError, match="`R` must be"):
        flashrnn(Wx, R[:, :1], b, function="gru")
    with pytest.raises(ValueError, match="`Wx` must be"):
        flashrnn(Wx, R, b, function="lstm")
    with pytest.raises(ValueError, match="`states` must be"):
        flashrnn(Wx, R, b, s0.expand(1, 2, 2, 2, 4), function="gru")
    with pytest.raises(ValueError, match="5-D"):
        flashrnn(Wx[0], R, b, function="gru")
    with pytest.raises(TypeError, match="`Wx` must be a torch.Tensor"):
        flashrnn(Wx.tolist(), R, b, function="gru")
    with pytest.raises(TypeError, match="`b` dtype"):
        flashrnn(Wx, R, b.int(), function="gru")
    with pytest.raises(ValueError, match="`function`"):
        flashrnn(Wx, R, b, function="mlstm")
    with pytest.raises(ValueError, match="Unknown backend"):
        flashrnn(Wx, R, b, function="gru", backend="cudnn")
    with pytest.raises(ValueError, match="`dtype`"):
        flashrnn(Wx, R, b, function="gru", dtype="fp8")
    with pytest.raises(ValueError, match="input_shape"):
        flashrnn(Wx, R, b, config=FlashRNNConfig(function="gru", num_heads=2, input_shape="BTGH"))
    with pytest.raises(ValueError, match="gradient_recurrent_clipval"):
        flashrnn(Wx, R, b, config=FlashRNNConfig(function="gru", num_heads=2, gradient_recurrent_clipval=1.0))
    with pytest.raises(ValueError, match="num_heads"):
        flashrnn(Wx, R, b, config=FlashRNNConfig(function="gru", num_heads=4))
    with pytest.raises(ValueError, match="function"):
        FlashRNNConfig(function="mlstm")


# ---------------------------------------------------------------------------------------------------------------
# against FlashRNN itself: its pure-PyTorch ``vanilla`` backend runs on the CPU (skipped without the package)
# ---------------------------------------------------------------------------------------------------------------
def _flashrnn_package():
    try:
        import flashrnn as package
    except Exception as e:  # not installed, or fails to import here
        pytest.skip(f"flashrnn not importable: {type(e).__name__}: {e}")
    return package


@pytest.mark.parametrize("fn", list(FUNCTIONS))
def test_matches_flashrnn_vanilla(fn):
    """float64, default and permuted layouts, with FlashRNN's own FlashRNNConfig; gradients for lstm, gru and
    elman (FlashRNN's vanilla sLSTM differentiates through m and its n >= 1 clamp, its CUDA kernels do not)."""
    package = _flashrnn_package()
    Wx, R, b, s0 = _inputs(fn, 2, 4, 2, 3, dtype=torch.float64, seed=6)

    def theirs(fn_, Wx_, R_, b_, s_):
        return package.flashrnn(Wx_, R_, b_, states=s_, function=fn_, backend="vanilla", dtype="float64")

    if fn == "slstm":  # vanilla takes m = i only where all of n is 0 (the CUDA kernels and tfla: per element)
        s0[2] = s0[2].abs() + 1.0
        for states in (s0, torch.zeros_like(s0)):
            for a, c in zip(_compat(fn, Wx, R, b, states), theirs(fn, Wx, R, b, states)):
                torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
    else:
        got, ref = _run(_compat, fn, Wx, R, b, s0), _run(theirs, fn, Wx, R, b, s0)
        for a, c in zip(got[:2] + got[2], ref[:2] + ref[2]):
            torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)
    cfg = package.FlashRNNConfig(function=fn, backend="vanilla", dtype="float64", num_heads=2, head_dim=3,
                                 input_shape="TBGHD", recurrent_shape="HGDP", bias_shape="HGD", output_shape="STBHD")
    args = (Wx.transpose(0, 1), R.transpose(0, 1), b.transpose(0, 1), s0.transpose(1, 2))
    for a, c in zip(flashrnn(*args, config=cfg), package.flashrnn(*args, config=cfg)):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)


def test_signature_and_config_fields_match_flashrnn():
    package = _flashrnn_package()
    theirs = inspect.signature(package.flashrnn).parameters.values()
    ours = inspect.signature(flashrnn).parameters.values()
    assert [(p.name, p.kind, p.default) for p in ours] == [(p.name, p.kind, p.default) for p in theirs]
    public = lambda cls: {n: f.default for n, f in cls.__dataclass_fields__.items() if not n.startswith("_")}  # noqa: E731
    assert public(FlashRNNConfig) == public(package.FlashRNNConfig)
