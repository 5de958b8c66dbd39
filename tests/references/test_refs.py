"""The references agree with each other in float64 before any kernel is trusted against them."""
import pytest
import torch

from tfla.bench.inputs import as_reference, gdn_inputs, random_cu_seqlens
from tfla.ops.gated_delta_rule.reference import (
    chunk_gated_delta_rule_ref,
    l2norm_ref,
    recurrent_gated_delta_rule_ref,
)
from tfla.utils.testing import rel_l2


def _inputs(B, T, H, HV, K, V, gate="default", h0=True, seed=0, num_seqs=None):
    x = gdn_inputs(B, T, H, K, V, HV=HV, dtype=torch.float64, gate=gate, gate_dtype=torch.float64,
                   initial_state=h0, seed=seed, num_seqs=num_seqs)
    return as_reference(x)


@pytest.mark.parametrize("L", [64, 128, 256, 512])
@pytest.mark.parametrize("ut_level", ["sub", "outer"])
@pytest.mark.parametrize("gate", ["default", "strong", "zero", "mixed"])
def test_chunk_ref_equals_recurrence(L, ut_level, gate):
    x = _inputs(2, 300, 2, 4, 16, 12, gate=gate, seed=L)
    o, s = recurrent_gated_delta_rule_ref(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                          initial_state=x["initial_state"], output_final_state=True)
    oc, sc = chunk_gated_delta_rule_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                        output_final_state=True, chunk_size=L, ut_level=ut_level)
    assert rel_l2(oc, o) <= 1e-12
    assert rel_l2(sc, s) <= 1e-12


def test_sub_chunk_new_values_equal_outer_ut_transform():
    """Block forward substitution over 64-row sub-chunks reproduces the L x L UT transform's new
    values Vnew = U_L - W_L S_0 (design note, way 2) exactly."""
    x = _inputs(1, 512, 1, 2, 16, 8, seed=3)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    _, _, sub = chunk_gated_delta_rule_ref(*args, initial_state=x["initial_state"], chunk_size=512,
                                           ut_level="sub", return_intermediates=True)
    _, _, outer = chunk_gated_delta_rule_ref(*args, initial_state=x["initial_state"], chunk_size=512,
                                             ut_level="outer", return_intermediates=True)
    assert rel_l2(sub["v_new"], outer["v_new"]) <= 1e-12
    assert rel_l2(sub["h"], outer["h"]) <= 1e-12


@pytest.mark.parametrize("ref", ["recurrent", "chunk"])
def test_varlen_ref_equals_per_sequence(ref):
    T, N = 250, 4
    x = _inputs(1, T, 2, 2, 8, 8, num_seqs=N, seed=5)
    cu = random_cu_seqlens(T, N, seed=5)
    fn = recurrent_gated_delta_rule_ref if ref == "recurrent" else chunk_gated_delta_rule_ref
    o, s = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
              output_final_state=True, cu_seqlens=cu)
    for n in range(N):
        b0, b1 = int(cu[n]), int(cu[n + 1])
        on, sn = recurrent_gated_delta_rule_ref(
            x["q"][:, b0:b1], x["k"][:, b0:b1], x["v"][:, b0:b1], x["g"][:, b0:b1], x["beta"][:, b0:b1],
            initial_state=x["initial_state"][n:n + 1], output_final_state=True)
        assert rel_l2(o[:, b0:b1], on) <= 1e-13
        assert rel_l2(s[n:n + 1], sn) <= 1e-13


def test_recurrence_single_step_by_hand():
    """One step, written out: S = e^g S0 + k beta (v - e^g S0^T k)^T, o = scale S^T q."""
    x = _inputs(1, 1, 1, 1, 4, 3, seed=7)
    q, k, v, g, b, S0 = (x[n][0, 0, 0] if n != "initial_state" else x[n][0, 0]
                         for n in ("q", "k", "v", "g", "beta", "initial_state"))
    S = torch.exp(g) * S0
    S = S + torch.outer(k, b * (v - S.T @ k))
    o_ref = 0.5 * (S.T @ q)
    o, s = recurrent_gated_delta_rule_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.5,
                                          initial_state=x["initial_state"], output_final_state=True)
    assert torch.allclose(o[0, 0, 0], o_ref, rtol=0, atol=1e-14)
    assert torch.allclose(s[0, 0], S, rtol=0, atol=1e-14)


def test_l2norm_ref():
    x = torch.randn(3, 5, dtype=torch.float64)
    y = l2norm_ref(x)
    assert torch.allclose(y, x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("L", [64, 128, 256])
@pytest.mark.parametrize("gate", ["default", "strong", "mixed"])
def test_staged_backward_ref_equals_autograd_of_recurrence(L, gate):
    """The kernels' backward stages (o-part at L, state backward over 64-row sub-chunks, UT/WY
    backward) reproduce autograd through the step-by-step recurrence in float64."""
    from tfla.ops.gated_delta_rule.reference import chunk_gated_delta_rule_bwd_ref

    x = _inputs(2, 200, 1, 2, 8, 6, gate=gate, seed=L)
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]
    o, s = recurrent_gated_delta_rule_ref(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    dht = torch.randn(s.shape, generator=gen, dtype=s.dtype)
    ref = torch.autograd.grad((o * do).sum() + (s * dht).sum(), leaves)
    got = chunk_gated_delta_rule_bwd_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], do, dht,
                                         initial_state=x["initial_state"], chunk_size=L)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, ref):
        assert rel_l2(a, b) <= 1e-12, name
