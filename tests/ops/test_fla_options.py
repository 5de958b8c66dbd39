"""FLA 0.6.0's extra options: chunk_gated_delta_rule's activated gate / beta, V-first state layout, host copy of
cu_seqlens and unused chunk_indices, and chunk_simple_gla / chunk_gla's state_v_first and cu_seqlens_cpu. Each equals
the plain call on inputs activated / laid out by hand, outputs and gradients: bitwise for the layouts and offsets
(the same kernels), to rounding for the activations (applied in the gate's cumsum kernels, ``gate_act.py``, against
PyTorch's ops by hand; float64 to 1e-12); bad combinations raise ValueError naming the argument."""
import pytest
import torch
import torch.nn.functional as F

import tfla
from tfla.bench.inputs import gdn_inputs
from tfla.utils.testing import assert_rel_close, tolerance


def _run(fn, leaves, v_first=False):
    o, s = fn(**leaves)
    gen = torch.Generator().manual_seed(5)
    loss = (o * torch.randn(o.shape, generator=gen).to(o.device)).sum()
    if s is not None:  # the same cotangent of the state in either layout
        shape = s.shape[:-2] + s.shape[-2:][::-1] if v_first else s.shape  # drawn in [K, V]
        dht = torch.randn(shape, generator=gen).to(s.device)
        loss = loss + (s * (dht.transpose(-1, -2) if v_first else dht)).sum()
    return (o, s) + torch.autograd.grad(loss, list(leaves.values()))


def _leaves(x, names):
    return {n: x[n].detach().clone().requires_grad_() for n in names}


def _same(a, b):
    assert len(a) == len(b)
    for i, (u, w) in enumerate(zip(a, b)):
        assert (u is None) == (w is None), i
        if u is not None:
            assert torch.equal(u, w), i


def _close(a, b, dtype):
    tol = 1e-12 if dtype == torch.float64 else tolerance(torch.float32)
    assert len(a) == len(b)
    for i, (u, w) in enumerate(zip(a, b)):
        assert (u is None) == (w is None), i
        if u is not None:
            assert_rel_close(f"output {i}", u.detach(), w.detach(), tol)


def _inputs(device, dtype=torch.float32, varlen=False):
    x = gdn_inputs(1, 150, 2, 16, 24, HV=4, dtype=dtype, device=device, initial_state=True, seed=3,
                   num_seqs=4 if varlen else None, gate_dtype=dtype)
    if dtype == torch.float64:
        x["initial_state"] = x["initial_state"].double()
    gen = torch.Generator().manual_seed(4)
    x["g_raw"] = (torch.randn(1, 150, 4, generator=gen) * 3).to(device, dtype)  # softplus over both regimes
    x["beta_raw"] = torch.randn(1, 150, 4, generator=gen).to(device, dtype)
    x["A_log"] = (torch.randn(4, generator=gen) * 0.5).to(device, dtype)
    x["dt_bias"] = torch.randn(4, generator=gen).to(device, dtype)
    if varlen:
        x["cu_seqlens"] = torch.tensor([0, 0, 1, 70, 150], device=device)
    return x


@pytest.fixture
def x(device):
    return _inputs(device)


@pytest.mark.parametrize("neg", [False, True])
def test_beta_sigmoid_in_kernel(x, neg):
    names = ("q", "k", "v", "g", "beta_raw", "initial_state")
    got = _run(lambda beta_raw, **a: tfla.chunk_gated_delta_rule(
        beta=beta_raw, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg, output_final_state=True,
        **a), _leaves(x, names))
    want = _run(lambda beta_raw, **a: tfla.chunk_gated_delta_rule(
        beta=torch.sigmoid(beta_raw) * (2.0 if neg else 1.0), output_final_state=True, **a),
        _leaves(x, names))
    _close(got, want, torch.float32)


@pytest.mark.parametrize("bias,beta,dtype,varlen", [(True, False, torch.float32, False),
                                                    (False, False, torch.float32, False),
                                                    (True, True, torch.float32, True),
                                                    (True, True, torch.float64, True)])
def test_gate_in_kernel(device, bias, beta, dtype, varlen):
    """The gate (and beta) activation in the kernels against PyTorch's ops by hand, dense and varlen (an empty and a
    one-token sequence), outputs and every gradient (a, A_log, dt_bias, beta's pre-activation)."""
    if dtype == torch.float64 and device == "cuda":
        pytest.skip("float64 verification runs through the interpreter")
    x = _inputs(device, dtype, varlen)
    cu = x.pop("cu_seqlens", None)
    names = ("q", "k", "v", "g_raw", "beta_raw" if beta else "beta", "initial_state", "A_log") + \
        (("dt_bias",) if bias else ())
    kw = dict(output_final_state=True, cu_seqlens=cu, use_beta_sigmoid_in_kernel=beta)

    def in_kernel(g_raw, A_log, dt_bias=None, beta_raw=None, beta=None, **a):
        return tfla.chunk_gated_delta_rule(g=g_raw, beta=beta_raw if beta_raw is not None else beta,
                                           use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, **kw, **a)

    def by_hand(g_raw, A_log, dt_bias=None, beta_raw=None, beta=None, **a):  # -exp(A_log) softplus(g + dt_bias)
        g = -A_log.exp() * F.softplus(g_raw + (dt_bias if dt_bias is not None else 0.0))
        b = torch.sigmoid(beta_raw) if beta_raw is not None else beta
        return tfla.chunk_gated_delta_rule(g=g, beta=b, output_final_state=True, cu_seqlens=cu, **a)

    got = _run(in_kernel, _leaves(x, names))
    want = _run(by_hand, _leaves(x, names))
    _close(got, want, dtype)
    assert got[-1].abs().sum() > 0  # A_log / dt_bias get a gradient


def test_state_v_first(x):
    names = ("q", "k", "v", "g", "beta", "initial_state")
    lv = _leaves(x, names)
    lv["initial_state"] = lv["initial_state"].detach().transpose(-1, -2).contiguous().requires_grad_()
    got = _run(lambda **a: tfla.chunk_gated_delta_rule(state_v_first=True, output_final_state=True, **a), lv,
               v_first=True)
    want = _run(lambda **a: tfla.chunk_gated_delta_rule(output_final_state=True, **a), _leaves(x, names))
    assert got[1].shape == want[1].shape[:2] + want[1].shape[2:][::-1]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1].transpose(-1, -2))
    _same(got[2:7], want[2:7])
    assert torch.equal(got[7], want[7].transpose(-1, -2))


def test_cu_seqlens_cpu_and_chunk_indices(x, device):
    cu = torch.tensor([0, 40, 41, 150], device=device)
    names = ("q", "k", "v", "g", "beta")
    x = {**x, "initial_state": x["initial_state"].repeat(3, 1, 1, 1)}
    names = names + ("initial_state",)
    got = _run(lambda **a: tfla.chunk_gated_delta_rule(cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(),
                                                       chunk_indices=torch.zeros(3, 2, dtype=torch.long),
                                                       output_final_state=True, **a), _leaves(x, names))
    want = _run(lambda **a: tfla.chunk_gated_delta_rule(cu_seqlens=cu, output_final_state=True, **a),
                _leaves(x, names))
    _same(got, want)


def test_transpose_state_layout_is_deprecated(x):
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        o, s = tfla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True,
                                           transpose_state_layout=True)
    assert s.shape == (1, 4, 24, 16)  # [N, HV, V, K]


def test_chunk_size_is_deprecated_and_ignored(x):
    """tfla's ``chunk_size`` of before 2026-11-24 (keyword-only): a DeprecationWarning, results unchanged; a value
    it never took raises."""
    want = tfla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True)
    with pytest.warns(DeprecationWarning, match="`chunk_size` is deprecated"):
        got = tfla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True,
                                          chunk_size=256)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for bad in (100, True):
        with pytest.raises(ValueError, match="`chunk_size` must be one of"):
            tfla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=bad)


@pytest.mark.parametrize("kw, match", [
    (dict(cp_context=object()), "`cp_context`"),
    (dict(allow_neg_eigval=True), "`allow_neg_eigval=True` requires"),
    (dict(use_gate_in_kernel=True), "`A_log` must be"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(3)), "`A_log` must be"),
    (dict(A_log=torch.zeros(4)), "only with `use_gate_in_kernel=True`"),
    (dict(cu_seqlens_cpu=torch.tensor([0, 150])), "pass both"),
    (dict(state_v_first=True, transpose_state_layout=True), "not both"),
    (dict(state_v_first=True, initial_state=torch.zeros(4, 16, 16)), "\\[N, HV, V, K\\]"),
])
def test_fla_options_bad_input(x, kw, match):
    kw = {k: (v.to(x["q"].device) if isinstance(v, torch.Tensor) and k != "cu_seqlens_cpu" else v)
          for k, v in kw.items()}
    with pytest.raises(ValueError, match=match):
        tfla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)


def test_cu_seqlens_cpu_bad_input(x, device):
    cu = torch.tensor([0, 70, 150], device=device)
    for bad in (torch.tensor([0, 150]), torch.tensor([0.0, 70.0, 150.0]), [0, 70, 150]):
        with pytest.raises(ValueError, match="`cu_seqlens_cpu` must be"):
            tfla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, cu_seqlens_cpu=bad)


@pytest.mark.parametrize("op", ["chunk_simple_gla", "chunk_gla"])
def test_linear_attn_state_v_first_and_cu_seqlens_cpu(device, op):
    """chunk_simple_gla / chunk_gla take FLA 0.6.0's state_v_first and cu_seqlens_cpu too (same order)."""
    gen = torch.Generator().manual_seed(6)
    B, T, H, K, V = 1, 120, 2, 16, 24
    x = {"q": torch.randn(B, T, H, K, generator=gen), "k": torch.randn(B, T, H, K, generator=gen) * 0.25,
         "v": torch.randn(B, T, H, V, generator=gen), "initial_state": torch.randn(2, H, K, V, generator=gen)}
    gshape = (B, T, H) if op == "chunk_simple_gla" else (B, T, H, K)
    x["g"] = F.logsigmoid(torch.randn(gshape, generator=gen) + 3)
    x = {n: t.to(device) for n, t in x.items()}
    cu = torch.tensor([0, 50, T], device=device)
    fn = getattr(tfla, op)
    names = ("q", "k", "v", "g", "initial_state")
    lv = _leaves(x, names)
    lv["initial_state"] = lv["initial_state"].detach().transpose(-1, -2).contiguous().requires_grad_()
    got = _run(lambda **a: fn(state_v_first=True, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), output_final_state=True,
                              **a), lv, v_first=True)
    want = _run(lambda **a: fn(cu_seqlens=cu, output_final_state=True, **a), _leaves(x, names))
    assert got[1].shape == (2, H, V, K)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1].transpose(-1, -2))
    _same(got[2:6], want[2:6])
    assert torch.equal(got[6], want[6].transpose(-1, -2))
    with pytest.raises(ValueError, match="`cu_seqlens_cpu`"):
        fn(x["q"], x["k"], x["v"], x["g"], cu_seqlens_cpu=cu.cpu())
