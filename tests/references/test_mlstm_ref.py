"""mLSTM ground truth: the step-by-step recurrence agrees with the quadratic form, with mlstm_kernels' own
pure-PyTorch implementations (when its wheel is unpacked at /tmp/mk) and with itself per varlen sequence;
``mlstm_step`` rejects bad inputs naming the argument."""
import os
import sys
import zlib

import pytest
import torch

from tfla.ops.mlstm.reference import parallel_mlstm_ref, recurrent_mlstm_ref
from tfla.ops.mlstm.step import mlstm_step
from tfla.utils.testing import assert_rel_close, rel_l2

D = torch.float64
MODES = [("exp", True), ("sigmoid", True), ("sigmoid", False)]
# (input gate mean, input gate std, forget gate mean): typical, saturated +-40, strong decay
REGIMES = {"typical": (0.0, 3.0, 3.0), "i_pos40": (40.0, 1.0, 3.0), "i_neg40": (-40.0, 1.0, 3.0),
           "strong_decay": (0.0, 3.0, -3.0)}


def _inputs(B, T, H, K, V, regime="typical", seed=0, N=None):
    g = torch.Generator().manual_seed(seed)
    i_mean, i_std, f_mean = REGIMES[regime]
    x = {"q": torch.randn(B, T, H, K, generator=g, dtype=D), "k": torch.randn(B, T, H, K, generator=g, dtype=D),
         "v": torch.randn(B, T, H, V, generator=g, dtype=D),
         "i": i_mean + i_std * torch.randn(B, T, H, generator=g, dtype=D),
         "f": f_mean + torch.randn(B, T, H, generator=g, dtype=D)}
    N = B if N is None else N
    x["state"] = (torch.randn(N, H, K, V, generator=g, dtype=D), torch.randn(N, H, K, generator=g, dtype=D),
                  torch.randn(N, H, generator=g, dtype=D))
    return x


def _state(x, input_gate, use):
    if not use:
        return None
    return x["state"] if input_gate == "exp" else x["state"][:2]


def _args(x):
    return x["q"], x["k"], x["v"], x["i"], x["f"]


@pytest.mark.parametrize("input_gate,normalize", MODES)
@pytest.mark.parametrize("h0", [False, True])
@pytest.mark.parametrize("regime", list(REGIMES))
def test_recurrence_equals_parallel(input_gate, normalize, h0, regime):
    x = _inputs(2, 37, 3, 8, 6, regime, seed=zlib.crc32(f"{input_gate}{normalize}{h0}{regime}".encode()) % 1000)
    opts = {"input_gate": input_gate, "normalize": normalize, "initial_state": _state(x, input_gate, h0),
            "output_final_state": True}
    h, s = recurrent_mlstm_ref(*_args(x), **opts)
    hp, sp = parallel_mlstm_ref(*_args(x), **opts)
    assert_rel_close("h", hp, h, 1e-12)
    assert torch.isfinite(h).all()
    assert len(s) == len(sp) == (3 if input_gate == "exp" else 2)
    for name, a, b in zip("Cnm", sp, s):
        assert torch.isfinite(b).all()
        assert_rel_close(name, a, b, 1e-12)


def test_explicit_scale_and_eps_reach_both_forms():
    x = _inputs(1, 20, 2, 4, 4, seed=7)
    for input_gate in ("exp", "sigmoid"):
        h, _ = recurrent_mlstm_ref(*_args(x), input_gate=input_gate, scale=0.3, eps=1e-2)
        hp, _ = parallel_mlstm_ref(*_args(x), input_gate=input_gate, scale=0.3, eps=1e-2)
        h0, _ = recurrent_mlstm_ref(*_args(x), input_gate=input_gate)
        assert rel_l2(hp, h) <= 1e-12
        assert rel_l2(h0, h) > 1e-3


@pytest.mark.parametrize("input_gate", ["exp", "sigmoid"])
def test_parallel_state_continues(input_gate):
    """The quadratic form's final state, fed back as initial state, continues the sequence exactly."""
    x = _inputs(2, 40, 2, 5, 3, seed=11)
    s0 = _state(x, input_gate, True)
    h, s = parallel_mlstm_ref(*_args(x), input_gate=input_gate, initial_state=s0, output_final_state=True)
    a = [t[:, :17] for t in _args(x)]
    b = [t[:, 17:] for t in _args(x)]
    h1, s1 = parallel_mlstm_ref(*a, input_gate=input_gate, initial_state=s0, output_final_state=True)
    h2, s2 = parallel_mlstm_ref(*b, input_gate=input_gate, initial_state=s1, output_final_state=True)
    assert rel_l2(torch.cat([h1, h2], 1), h) <= 1e-12
    for u, w in zip(s2, s):
        assert rel_l2(u, w) <= 1e-12


@pytest.mark.parametrize("input_gate,normalize", MODES)
def test_gradients_recurrence_equal_parallel(input_gate, normalize):
    x = _inputs(1, 24, 2, 4, 3, seed=5)
    leaves = [t.clone().requires_grad_() for t in _args(x)]
    s0 = [t.clone().requires_grad_() for t in _state(x, input_gate, True)]
    g = torch.Generator().manual_seed(1)
    grads = []
    for fn in (recurrent_mlstm_ref, parallel_mlstm_ref):
        h, s = fn(*leaves, input_gate=input_gate, normalize=normalize, initial_state=tuple(s0),
                  output_final_state=True)
        outs = (h, *s)
        g.manual_seed(1)
        cots = [torch.randn(o.shape, generator=g, dtype=D) for o in outs]
        grads.append(torch.autograd.grad(outs, leaves + s0, cots))
    for name, a, b in zip(["q", "k", "v", "i", "f", "C0", "n0", "m0"], *grads):
        assert_rel_close(f"d{name}", a, b, 1e-10)


@pytest.mark.parametrize("input_gate", ["exp", "sigmoid"])
@pytest.mark.parametrize("fn", [recurrent_mlstm_ref, parallel_mlstm_ref])
def test_varlen_equals_per_sequence(input_gate, fn):
    cu = torch.tensor([0, 5, 5, 21, 40, 41], dtype=torch.int64)       # includes an empty sequence
    N = cu.numel() - 1
    x = _inputs(1, 41, 2, 4, 3, seed=3, N=N)
    s0 = _state(x, input_gate, True)
    h, s = fn(*_args(x), input_gate=input_gate, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    assert h.shape == x["v"].shape and all(t.shape[0] == N for t in s)
    for n in range(N):
        b0, b1 = int(cu[n]), int(cu[n + 1])
        hn, sn = recurrent_mlstm_ref(*(t[:, b0:b1] for t in _args(x)), input_gate=input_gate,
                                     initial_state=tuple(t[n:n + 1] for t in s0), output_final_state=True)
        if b1 > b0:
            assert rel_l2(h[:, b0:b1], hn) <= 1e-12
        for u, w in zip(s, sn):
            assert rel_l2(u[n:n + 1], w) <= 1e-12


def test_zero_length_and_default_state():
    x = _inputs(2, 0, 2, 4, 3)
    h, s = recurrent_mlstm_ref(*_args(x), output_final_state=True)
    hp, sp = parallel_mlstm_ref(*_args(x), output_final_state=True)
    assert h.shape == hp.shape == (2, 0, 2, 3)
    for a, b in zip(s, sp):
        assert torch.equal(a, b) and not a.any()


# ----------------------------------------------------------------------------------------------- mlstm_step

def test_step_dtypes_and_zero_state():
    g = torch.Generator().manual_seed(0)
    B, H, K, V = 2, 3, 4, 5
    for dt, sdt in ((torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                    (torch.float64, torch.float64)):
        q, k = torch.randn(B, H, K, generator=g).to(dt), torch.randn(B, H, K, generator=g).to(dt)
        v = torch.randn(B, H, V, generator=g).to(dt)
        i, f = torch.randn(B, H, generator=g), torch.randn(B, H, generator=g)
        for input_gate in ("exp", "sigmoid"):
            h, s = mlstm_step(q, k, v, i, f, input_gate=input_gate)
            zero = (torch.zeros(B, H, K, V), torch.zeros(B, H, K), torch.zeros(B, H))[:len(s)]
            h0, s0 = mlstm_step(q, k, v, i, f, zero, input_gate=input_gate)
            assert h.dtype == dt and all(t.dtype == sdt for t in s)
            assert torch.equal(h, h0) and all(torch.equal(a, b) for a, b in zip(s, s0))


def _step_inputs(B=2, H=3, K=4, V=5):
    g = torch.Generator().manual_seed(0)
    return {"q": torch.randn(B, H, K, generator=g), "k": torch.randn(B, H, K, generator=g),
            "v": torch.randn(B, H, V, generator=g), "i": torch.randn(B, H, generator=g),
            "f": torch.randn(B, H, generator=g),
            "state": (torch.zeros(B, H, K, V), torch.zeros(B, H, K), torch.zeros(B, H))}


@pytest.mark.parametrize("change,opts,exc,match", [
    ({}, {"input_gate": "softplus"}, ValueError, "input_gate"),
    ({}, {"input_gate": "exp", "normalize": False}, ValueError, "normalize"),
    ({}, {"normalize": 1}, TypeError, "normalize"),
    ({}, {"eps": -1.0}, ValueError, "eps"),
    ({}, {"scale": "0.5"}, TypeError, "scale"),
    ({"q": torch.zeros(2, 3)}, {}, ValueError, "`q`"),
    ({"k": torch.zeros(2, 3, 5)}, {}, ValueError, "`k`"),
    ({"k": torch.zeros(2, 3, 4, dtype=torch.float64)}, {}, TypeError, "`k`"),
    ({"v": torch.zeros(2, 4, 5)}, {}, ValueError, "`v`"),
    ({"v": [0.0]}, {}, TypeError, "`v`"),
    ({"i": torch.zeros(2, 3, 1)}, {}, ValueError, "`i`"),
    ({"f": torch.zeros(3, 2)}, {}, ValueError, "`f`"),
    ({"f": torch.zeros(2, 3, dtype=torch.int64)}, {}, TypeError, "`f`"),
    ({"state": (torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 4))}, {}, TypeError, "`state`"),
    ({"state": torch.zeros(2, 3, 4, 5)}, {}, TypeError, "`state`"),
    ({"state": (torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 4), torch.zeros(2, 3, 1))}, {}, ValueError,
     r"state\[2\] \(m\)"),
    ({"state": (torch.zeros(2, 3, 5, 4), torch.zeros(2, 3, 4), torch.zeros(2, 3))}, {}, ValueError,
     r"state\[0\] \(C\)"),
    ({}, {"input_gate": "sigmoid"}, TypeError, r"\(C, n\)"),  # a 3-tuple for the sigmoid gate
])
def test_step_errors(change, opts, exc, match):
    x = {**_step_inputs(), **change}
    with pytest.raises(exc, match=match):
        mlstm_step(x["q"], x["k"], x["v"], x["i"], x["f"], x["state"], **opts)


def test_reference_rejects_bad_options():
    x = _inputs(1, 4, 2, 4, 3)
    with pytest.raises(ValueError, match="normalize"):
        recurrent_mlstm_ref(*_args(x), input_gate="exp", normalize=False)
    with pytest.raises(ValueError, match="batch size must be 1"):
        x2 = _inputs(2, 4, 2, 4, 3)
        recurrent_mlstm_ref(*_args(x2), cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="initial_state"):
        parallel_mlstm_ref(*_args(x), input_gate="sigmoid", initial_state=(x["state"][0][:, :1], x["state"][1]))


# ------------------------------------------------------------------------------- mlstm_kernels cross-checks

MK = "/tmp/mk"


@pytest.fixture(scope="module")
def mk():
    if not os.path.isdir(MK):
        pytest.skip("mlstm_kernels wheel not unpacked at /tmp/mk")
    if MK not in sys.path:
        sys.path.insert(0, MK)
    pytest.importorskip("einops")
    return pytest.importorskip("mlstm_kernels.torch")


def _hf(x):
    """tfla [B, T, H, ...] -> mlstm_kernels head-first [B, H, T, ...]."""
    return x.transpose(1, 2).contiguous()


def test_step_equals_mk_native_step(mk):
    from mlstm_kernels.torch.recurrent.native_step import mlstm_recurrent_step__native
    x = _inputs(2, 1, 3, 8, 6, seed=2)
    q, k, v, i, f = (t[:, 0] for t in _args(x))
    C, n, m = (t.clone() for t in x["state"])
    h, (C1, n1, m1) = mlstm_step(q, k, v, i, f, (C, n, m))
    hm, (Cm, nm, mm) = mlstm_recurrent_step__native(q, k, v, i[..., None], f[..., None], C, n, m[..., None],
                                                    dtype_state=D)
    for name, a, b in (("h", h, hm), ("C", C1, Cm), ("n", n1, nm), ("m", m1, mm[..., 0])):
        assert_rel_close(name, a, b, 1e-14)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_recurrence_equals_mk_native_sequence(mk, regime):
    from mlstm_kernels.torch.recurrent.native_sequence import (
        mlstm_recurrent_sequence__native_fw,
    )
    x = _inputs(2, 33, 3, 8, 6, regime, seed=4)
    C0, n0, m0 = x["state"]
    h, s = recurrent_mlstm_ref(*_args(x), initial_state=x["state"], output_final_state=True)
    hm, (Cm, nm, mm) = mlstm_recurrent_sequence__native_fw(
        *map(_hf, _args(x)), c_initial=C0, n_initial=n0, m_initial=m0[..., None], return_last_states=True,
        dtype_state=D)
    assert_rel_close("h", _hf(h), hm, 1e-13)
    for name, a, b in (("C", s[0], Cm), ("n", s[1], nm), ("m", s[2], mm[..., 0])):
        assert_rel_close(name, a, b, 1e-13)


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("h0", [False, True])
def test_recurrence_equals_mk_native_chunkwise(mk, regime, h0):
    """mlstm_kernels' pure-PyTorch chunkwise form (the semantics of its Triton kernels), states included."""
    x = _inputs(2, 64, 2, 8, 6, regime, seed=6)
    s0 = _state(x, "exp", h0)
    h, s = recurrent_mlstm_ref(*_args(x), initial_state=s0, output_final_state=True)
    init = {"c_initial": s0[0], "n_initial": s0[1], "m_initial": s0[2][..., None]} if h0 else {}
    hm, (Cm, nm, mm) = mk.get_mlstm_kernel("chunkwise--native_autograd")(
        *map(_hf, _args(x)), **init, return_last_states=True, chunk_size=16)
    assert_rel_close("h", _hf(h), hm, 1e-12)
    assert mm.shape == (2, 2, 1)
    for name, a, b in (("C", s[0], Cm), ("n", s[1], nm), ("m", s[2], mm[..., 0])):
        assert_rel_close(name, a, b, 1e-12)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("regime", list(REGIMES))
def test_sigmoid_recurrence_equals_mk_siging_parallel(mk, normalize, regime):
    x = _inputs(2, 40, 3, 8, 6, regime, seed=8)
    h, _ = recurrent_mlstm_ref(*_args(x), input_gate="sigmoid", normalize=normalize)
    hm = mk.get_mlstm_kernel("parallel--native_siging_autograd")(*map(_hf, _args(x)), normalize=normalize)
    assert_rel_close("h", _hf(h), hm, 1e-12)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_exp_recurrence_equals_mk_parallel_without_eps(mk, regime):
    """With eps = 0 the max state cancels exactly, so mlstm_kernels' parallel forms (row max of D only)
    equal the recurrence."""
    x = _inputs(2, 40, 3, 8, 6, regime, seed=9)
    h, _ = recurrent_mlstm_ref(*_args(x), eps=0.0)
    for name in ("parallel--native_autograd", "parallel--native_stablef_autograd"):
        hm = mk.get_mlstm_kernel(name)(*map(_hf, _args(x)), eps=0.0)
        assert_rel_close(name, _hf(h), hm, 1e-12)


def test_mk_parallel_omits_initial_max_state(mk):
    """mlstm_kernels' parallel form stabilizes with max_j logD_tj only; its recurrence (and tfla) also takes
    the m0 = 0 term F_t + m0. Where that term wins (input gate far below the forget gate's log), outputs
    differ by O(eps) relative: a known deviation of mlstm_kernels' parallel kernels, not of tfla."""
    x = _inputs(1, 8, 1, 4, 3, seed=10)
    x["i"][:, 0] = -5.0                      # m_1 = max(logsigmoid(f_1), -5) = logsigmoid(f_1) in the recurrence
    h, _ = recurrent_mlstm_ref(*_args(x))
    hp, _ = parallel_mlstm_ref(*_args(x))
    hm = mk.get_mlstm_kernel("parallel--native_autograd")(*map(_hf, _args(x)))
    assert rel_l2(hp, h) <= 1e-14
    err = rel_l2(_hf(h)[:, :, :1], hm[:, :, :1])
    assert 1e-7 < err < 1e-5
