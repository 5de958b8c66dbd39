"""tfla.elman / lstm / gru / slstm (the alternating path) against the float64 step loop and torch.nn.LSTM / GRU:
outputs, final states and the gradients of x, R, b and every initial-state tensor, with random cotangents."""
import pytest
import torch

import tfla
from tfla.ops.rnn.reference import CELL_GATES, CELL_STATES, recurrent_rnn_ref
from tfla.utils.testing import assert_rel_close, tolerance

CELLS = ("elman", "lstm", "gru", "slstm")
FP32_TOL = 1e-5  # per tensor, forward and gradients (the issue asks <= 1e-4 for the gradients)


def _inputs(cell, B, T, NH, D, dtype, device, seed, init=True, N=None):
    gen = torch.Generator().manual_seed(seed)
    G, S = len(CELL_GATES[cell]), len(CELL_STATES[cell])
    N = N or B
    x = torch.randn(B, T, G, NH, D, generator=gen)
    R = torch.randn(G, NH, D, D, generator=gen) / D ** 0.5
    b = torch.randn(G, NH, D, generator=gen) * 0.5
    state = None
    if init:
        state = [torch.randn(N, NH, D, generator=gen) * 0.5 for _ in range(S)]
        if cell == "slstm":  # n > 0, with rows at n = 0 (and c = 0), which take m_t = i_t
            state[2] = state[2].abs() + 0.3
            state[2][0], state[1][0] = 0.0, 0.0
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    return cast(x), cast(R), cast(b), (tuple(cast(s) for s in state) if init else None)


def _grads(fn, cell, x, R, b, state, final, cu=None, seed=1):
    """Output, final state and gradients of x, R, b, state from fn; ref-style float64 cotangents, m's dropped."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, R, b, *(state or ()))]
    kw = {"cu_seqlens": cu} if cu is not None else {}
    h, fin = fn(*leaves[:3], tuple(leaves[3:]) if state is not None else None, final, **kw)
    gen = torch.Generator().manual_seed(seed)
    outs, cts = [h], [torch.randn(h.shape, generator=gen, dtype=torch.float64)]
    if final:
        for k, f in enumerate(fin):
            if cell == "slstm" and k == 3:  # m: a constant of the backward
                continue
            outs.append(f)
            cts.append(torch.randn(f.shape, generator=gen, dtype=torch.float64))
    grads = torch.autograd.grad(outs, leaves, [c.to(o.dtype).to(o.device) for c, o in zip(cts, outs)],
                                allow_unused=True)
    return h, fin, grads


def _ref_fn(cell):
    return lambda x, R, b, s, final, cu_seqlens=None: recurrent_rnn_ref(cell, x, R, b, s, final)


def _check_all(cell, got, ref, tol, final, has_state):
    h, fin, grads = got
    hr, finr, gradsr = ref
    assert_rel_close("h", h, hr, tol)
    if final:
        for name, f, fr in zip(CELL_STATES[cell], fin, finr):
            assert_rel_close(f"final {name}", f, fr, tol)
    else:
        assert fin is None
    names = ["dx", "dR", "db"] + ([f"d{s}0" for s in CELL_STATES[cell]] if has_state else [])
    for name, g, gr in zip(names, grads, gradsr):
        if gr is None:  # the sLSTM's initial m: no gradient (m is a constant)
            assert g is None or torch.count_nonzero(g) == 0, name
            continue
        assert_rel_close(name, g, gr, tol)


CASES = [  # B, T, NH, D, initial state, final state
    (2, 5, 2, 12, True, True),
    (3, 1, 1, 48, False, True),  # T = 1, non-power-of-two D, zero initial state
    (1, 4, 3, 16, True, False),  # several heads, no final state
    (2, 6, 4, 5, False, False),
]


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("B,T,NH,D,init,final", CASES)
def test_cell_vs_reference(cell, B, T, NH, D, init, final, device, poison_empty):
    x, R, b, s = _inputs(cell, B, T, NH, D, torch.float32, device, seed=B * 100 + T * 10 + D)
    got = _grads(getattr(tfla, cell), cell, x, R, b, s, final)
    d = lambda t: t.double()  # noqa: E731
    ref = _grads(_ref_fn(cell), cell, d(x), d(R), d(b), tuple(map(d, s)) if s else None, final)
    assert got[0].dtype == torch.float32 and got[0].shape == (B, T, NH, D)
    _check_all(cell, got, ref, FP32_TOL, final, init)


@pytest.mark.parametrize("cell", CELLS)
def test_noncontiguous_and_float64(cell, device):
    x, R, b, s = _inputs(cell, 2, 4, 2, 8, torch.float64, device, seed=7)
    x_nc = x.transpose(0, 1).contiguous().transpose(0, 1)  # [B, T, ...] view with T-major strides
    assert not x_nc.is_contiguous()
    got = _grads(getattr(tfla, cell), cell, x_nc, R, b, s, True)
    ref = _grads(_ref_fn(cell), cell, x, R, b, s, True)
    _check_all(cell, got, ref, tolerance(torch.float64, "interpreter") * 100, True, True)


@pytest.mark.parametrize("cell", CELLS)
def test_fp16_forward(cell, device):
    x, R, b, s = _inputs(cell, 2, 6, 2, 12, torch.float16, device, seed=11)
    h, fin = getattr(tfla, cell)(x, R, b, s, True)
    d = lambda t: t.double()  # noqa: E731
    hr, finr = recurrent_rnn_ref(cell, d(x), d(R), d(b), tuple(map(d, s)), True)
    assert h.dtype == torch.float16 and fin[0].dtype == torch.float32
    assert_rel_close("h", h, hr, 1e-2)
    for name, f, fr in zip(CELL_STATES[cell], fin, finr):
        assert_rel_close(f"final {name}", f, fr, 1e-2)


@pytest.mark.parametrize("cell", CELLS)
def test_varlen_vs_per_sequence(cell, device):
    bounds = [0, 3, 3, 8, 9]  # an empty sequence: its final state is its initial state
    N, T = len(bounds) - 1, bounds[-1]
    x, R, b, s = _inputs(cell, 1, T, 2, 6, torch.float32, device, seed=5, N=N)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    got = _grads(getattr(tfla, cell), cell, x, R, b, s, True, cu=cu)

    def loop_ref(x, R, b, s, final, cu_seqlens=None):
        hs, fins = [], []
        for n in range(N):
            sn = tuple(t[n:n + 1] for t in s)
            h, f = recurrent_rnn_ref(cell, x[:, bounds[n]:bounds[n + 1]], R, b, sn, True)
            hs.append(h)
            fins.append(f)
        return torch.cat(hs, 1), tuple(torch.cat([f[k] for f in fins]) for k in range(len(s)))

    d = lambda t: t.double()  # noqa: E731
    ref = _grads(loop_ref, cell, d(x), d(R), d(b), tuple(map(d, s)), True)
    _check_all(cell, got, ref, FP32_TOL, True, True)


def _torch_case(kind, B=2, T=5, D=12, seed=3):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = (torch.nn.LSTM if kind == "lstm" else torch.nn.GRU)(D, D, batch_first=True)
    inp = torch.randn(B, T, D, generator=gen)
    h0 = torch.randn(1, B, D, generator=gen) * 0.5
    c0 = torch.randn(1, B, D, generator=gen) * 0.5
    return net, inp, h0, c0


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_equals_torch_nn(kind, device):
    net, inp, h0, c0 = _torch_case(kind)
    B, T, D = inp.shape
    G = 4 if kind == "lstm" else 3
    params = [net.weight_ih_l0, net.weight_hh_l0, net.bias_ih_l0, net.bias_hh_l0]
    inp, h0, c0 = (t.clone().requires_grad_() for t in (inp, h0, c0))
    leaves = [inp, h0] + ([c0] if kind == "lstm" else []) + params

    # torch.nn, in float64
    net64 = net.double()
    out, st = net64(inp.double(), (h0.double(), c0.double()) if kind == "lstm" else h0.double())
    fin_ref = st if kind == "lstm" else (st,)
    gen = torch.Generator().manual_seed(9)
    cts = [torch.randn(out.shape, generator=gen, dtype=torch.float64)] + \
          [torch.randn(f.shape, generator=gen, dtype=torch.float64) for f in fin_ref]
    g_ref = torch.autograd.grad([out, *fin_ref], leaves, cts)
    net.float()

    # tfla, fp32: x = input W_ih^T + b_ih split per gate, R = W_hh split per gate, b = b_hh (NH = 1)
    W_ih, W_hh, b_ih, b_hh = params
    x = (inp @ W_ih.T + b_ih).view(B, T, G, 1, D)
    R = W_hh.view(G, 1, D, D)
    bb = b_hh.view(G, 1, D)
    state = (h0[0, :, None], c0[0, :, None]) if kind == "lstm" else (h0[0, :, None],)
    h, fin = getattr(tfla, kind)(x.to(device), R.to(device), bb.to(device), tuple(t.to(device) for t in state), True)
    cts_tfla = [cts[0].float().view(B, T, 1, D)] + [c[0, :, None].float() for c in cts[1:]]
    g = torch.autograd.grad([h, *fin], leaves, [c.to(h.device) for c in cts_tfla])
    h, fin = h.cpu(), tuple(f.cpu() for f in fin)

    assert_rel_close("h", h, out[:, :, None], FP32_TOL)
    for name, f, fr in zip(("h", "c"), fin, fin_ref):
        assert_rel_close(f"final {name}", f, fr[0, :, None], FP32_TOL)
    names = ["d input", "d h0"] + (["d c0"] if kind == "lstm" else []) + ["d W_ih", "d W_hh", "d b_ih", "d b_hh"]
    for name, a, r in zip(names, g, g_ref):
        assert_rel_close(name, a, r.view_as(a), FP32_TOL)


def test_exports_and_docs():
    for cell in CELLS:
        fn = getattr(tfla, cell)
        assert fn.__name__ == cell and "Raises:" in fn.__doc__ and "FlashRNN" in fn.__doc__
        assert cell in dir(tfla)


def _bad(device, cell="lstm"):
    x, R, b, s = _inputs(cell, 2, 3, 2, 4, torch.float32, device, seed=0)
    return x, R, b, s


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda x, R, b, s: (x[0], R, b, s), ValueError, "`x` must have 5 dims"),
    (lambda x, R, b, s: (x[:, :, :3], R[:3], b[:3], s), ValueError, "G=4 gates"),
    (lambda x, R, b, s: (x, R[..., :3], b, s), ValueError, "`R` must be"),
    (lambda x, R, b, s: (x, R[:, :1], b, s), ValueError, "`R` must be"),
    (lambda x, R, b, s: (x, R, b[..., :3], s), ValueError, "`b` must be"),
    (lambda x, R, b, s: (x, R, b, s[:1]), ValueError, "`initial_state` must be a tuple of 2"),
    (lambda x, R, b, s: (x, R, b, (s[0], s[1][:1])), ValueError, "`initial_state` entry 'c'"),
    (lambda x, R, b, s: (x, R, b, s[0]), ValueError, "`initial_state` must be a tuple"),
    (lambda x, R, b, s: (x.int(), R, b, s), TypeError, "`x` must be a floating-point"),
    (lambda x, R, b, s: (x.half(), R.double(), b, s), TypeError, "`R` dtype"),
    (lambda x, R, b, s: (x, R.cpu().numpy(), b, s), TypeError, "`R` must be a torch.Tensor"),
    (lambda x, R, b, s: (x, R, b, (s[0], s[1].long())), TypeError, "entry 'c' must be floating"),
])
def test_bad_inputs(mutate, exc, match, device):
    with pytest.raises(exc, match=match):
        tfla.lstm(*mutate(*_bad(device)))


def test_bad_gate_counts_and_varlen(device):
    x, R, b, _ = _bad(device, "gru")
    cu = lambda *v: torch.tensor(v, device=device)  # noqa: E731
    with pytest.raises(ValueError, match="G=1 gates"):
        tfla.elman(x, R, b)
    with pytest.raises(ValueError, match="G=4 gates"):
        tfla.slstm(x, R, b)
    with pytest.raises(ValueError, match="batch size must be 1"):
        tfla.gru(x, R, b, cu_seqlens=cu(0, 3))
    with pytest.raises(ValueError, match="start at 0 and end at T=3"):
        tfla.gru(x[:1], R, b, cu_seqlens=cu(0, 2))
    with pytest.raises(TypeError, match="cu_seqlens"):
        tfla.gru(x[:1], R, b, cu_seqlens=cu(0.0, 3.0))
    with pytest.raises(ValueError, match=r"\[N, NH, D\] = \(2, 2, 4\)"):
        tfla.gru(x[:1], R, b, (torch.zeros(1, 2, 4, device=device),), cu_seqlens=cu(0, 1, 3))
    with pytest.raises(TypeError, match="output_final_state"):
        tfla.gru(x, R, b, None, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("cell", CELLS)
def test_bf16_forward_backward_gpu(cell):
    x, R, b, s = _inputs(cell, 4, 64, 3, 48, torch.bfloat16, "cuda", seed=13)
    got = _grads(getattr(tfla, cell), cell, x, R, b, s, True)
    d = lambda t: t.double()  # noqa: E731
    ref = _grads(_ref_fn(cell), cell, d(x), d(R), d(b), tuple(map(d, s)), True)
    _check_all(cell, got, ref, 3e-2, True, True)


@pytest.mark.parametrize("cell", CELLS)
def test_large_preactivations_wide_head_and_determinism(cell, device):
    """Pre-activations near +-30 (saturated gates, sLSTM exponents), B = 17, D = 192; two runs bitwise equal."""
    x, R, b, s = _inputs(cell, 17, 2, 1, 192, torch.float32, device, seed=21)
    x = x * 30.0 / x.abs().amax()  # pre-activations in about [-31, 31]
    runs = [_grads(getattr(tfla, cell), cell, x, R, b, s, True) for _ in range(2)]
    for a, c in zip([runs[0][0], *runs[0][1], *runs[0][2]], [runs[1][0], *runs[1][1], *runs[1][2]]):
        assert torch.equal(a, c)
    d = lambda t: t.double()  # noqa: E731
    ref = _grads(_ref_fn(cell), cell, d(x), d(R), d(b), tuple(map(d, s)), True)
    _check_all(cell, runs[0], ref, FP32_TOL, True, True)
