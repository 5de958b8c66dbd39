"""FLA 0.6.0's extra options: chunk_gated_delta_rule's activated gate / beta, V-first state layout, host copy of
cu_seqlens and unused chunk_indices, and chunk_simple_gla / chunk_gla's state_v_first and cu_seqlens_cpu. Each equals
the plain call on inputs activated / laid out by hand, outputs and gradients (bitwise: the options are the same
PyTorch ops in front of the same kernels); bad combinations raise ValueError naming the argument."""
import pytest
import torch
import torch.nn.functional as F

import tfla
from tfla.bench.inputs import gdn_inputs


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


@pytest.fixture
def x(device):
    x = gdn_inputs(1, 150, 2, 16, 24, HV=4, dtype=torch.float32, device=device, initial_state=True, seed=3)
    gen = torch.Generator().manual_seed(4)
    x["g_raw"] = torch.randn(1, 150, 4, generator=gen).to(device)
    x["beta_raw"] = torch.randn(1, 150, 4, generator=gen).to(device)
    x["A_log"] = torch.randn(4, generator=gen).to(device) * 0.5
    x["dt_bias"] = torch.randn(4, generator=gen).to(device)
    return x


@pytest.mark.parametrize("neg", [False, True])
def test_beta_sigmoid_in_kernel(x, neg):
    names = ("q", "k", "v", "g", "beta_raw", "initial_state")
    got = _run(lambda beta_raw, **a: tfla.chunk_gated_delta_rule(
        beta=beta_raw, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg, output_final_state=True,
        **a), _leaves(x, names))
    want = _run(lambda beta_raw, **a: tfla.chunk_gated_delta_rule(
        beta=torch.sigmoid(beta_raw) * (2.0 if neg else 1.0), output_final_state=True, **a),
        _leaves(x, names))
    _same(got, want)


@pytest.mark.parametrize("bias", [True, False])
def test_gate_in_kernel(x, bias):
    names = ("q", "k", "v", "g_raw", "beta", "initial_state", "A_log") + (("dt_bias",) if bias else ())
    got = _run(lambda g_raw, A_log, dt_bias=None, **a: tfla.chunk_gated_delta_rule(
        g=g_raw, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, output_final_state=True, **a),
        _leaves(x, names))

    def by_hand(g_raw, A_log, dt_bias=None, **a):  # FLA's GDN gate: -exp(A_log) softplus(g + dt_bias)
        g = -A_log.exp() * F.softplus(g_raw + (dt_bias if dt_bias is not None else 0.0))
        return tfla.chunk_gated_delta_rule(g=g, output_final_state=True, **a)

    want = _run(by_hand, _leaves(x, names))
    _same(got, want)
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
