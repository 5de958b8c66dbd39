"""tfla.chunk_gated_delta_rule forward against the float64 step-by-step recurrence.

Every case checks o and the final state by relative L2 per tensor; outputs are allocated NaN-poisoned
so an unwritten tile fails. fp32 uses IEEE dots (tolerance 1e-5). fp16 runs on the CPU interpreter
(tolerance FP16_TOL, documented in the op's README); bf16 runs only on a GPU (the interpreter
mis-computes bf16 dots) and is held to FLA's own error on the same inputs.
"""
import pytest
import torch

import tfla
from tfla.bench.inputs import as_reference, gdn_inputs, random_cu_seqlens
from tfla.ops.gated_delta_rule import chunk_gated_delta_rule_fwd
from tfla.ops.gated_delta_rule.reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref
from tfla.utils.testing import assert_rel_close, rel_l2, tolerance

FP32_TOL = tolerance(torch.float32)  # 1e-5 IEEE on the interpreter; tf32x3 on CUDA (tfla.utils.testing)
FP16_TOL = 5e-3
LN2 = 0.6931471805599453


def _run_and_ref(device, B, T, H, HV, K, V, dtype=torch.float32, gate="default", h0=True, seed=0,
                 l2norm=False, scale=None):
    x = gdn_inputs(B, T, H, K, V, HV=HV, dtype=dtype, device=device, gate=gate, initial_state=h0, seed=seed)
    if l2norm:  # hand the kernel unnormalised keys
        x["k"] = (x["k"].float() * 3.0).to(dtype)
    o, s = tfla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale,
                                       initial_state=x["initial_state"], output_final_state=True,
                                       use_qk_l2norm_in_kernel=l2norm)
    r = as_reference(x)
    ro, rs = recurrent_gated_delta_rule_ref(r["q"], r["k"], r["v"], r["g"], r["beta"], scale=scale,
                                            initial_state=r["initial_state"], output_final_state=True,
                                            use_qk_l2norm_in_kernel=l2norm)
    return (o, s), (ro, rs)


# (B, T, H, HV, K, V): T in {1, 64 - 1, 64 + 1, non-multiples}, GVA, non-power-of-two head dims
CASES = [
    (2, 1, 2, 2, 32, 32),
    (1, 63, 1, 1, 32, 32),
    (1, 65, 1, 1, 32, 32),
    (2, 200, 2, 2, 32, 16),
    (1, 129, 2, 4, 16, 32),
    (2, 300, 1, 2, 32, 32),
    (1, 700, 1, 1, 16, 16),
    (1, 150, 1, 1, 20, 24),
    (1, 100, 2, 2, 48, 80),
]


@pytest.mark.parametrize("B,T,H,HV,K,V", CASES)
def test_fwd_fp32_matches_recurrence(device, poison_empty, B, T, H, HV, K, V):
    (o, s), (ro, rs) = _run_and_ref(device, B, T, H, HV, K, V, seed=T)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert_rel_close("o", o.cpu(), ro, FP32_TOL)
    assert_rel_close("final_state", s.cpu(), rs, FP32_TOL)


@pytest.mark.parametrize("gate", ["weak", "strong", "zero", "mixed"])
def test_fwd_fp32_gate_regimes(device, poison_empty, gate):
    (o, s), (ro, rs) = _run_and_ref(device, 1, 300, 1, 2, 32, 32, gate=gate, seed=11)
    assert_rel_close("o", o.cpu(), ro, FP32_TOL)
    assert_rel_close("final_state", s.cpu(), rs, FP32_TOL)


def test_fwd_no_initial_state_and_no_final_state(device):
    x = gdn_inputs(1, 130, 1, 32, 32, dtype=torch.float32, device=device, seed=2)
    o, s = tfla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert s is None
    r = as_reference(x)
    ro, _ = recurrent_gated_delta_rule_ref(r["q"], r["k"], r["v"], r["g"], r["beta"])
    assert_rel_close("o", o.cpu(), ro, FP32_TOL)


def test_fwd_l2norm_in_kernel_and_custom_scale(device):
    (o, s), (ro, rs) = _run_and_ref(device, 1, 100, 1, 2, 32, 32, l2norm=True, scale=0.3, seed=4)
    assert_rel_close("o", o.cpu(), ro, FP32_TOL)
    assert_rel_close("final_state", s.cpu(), rs, FP32_TOL)


@pytest.mark.parametrize("segments", [1, 3])
@pytest.mark.parametrize("grad", [False, True])
def test_fwd_l2norm_varlen_segments(device, poison_empty, segments, grad):
    """``use_qk_l2norm_in_kernel`` without gradients (the prep and the pass scale their products by the rows' L2
    factors; no normalised copy) and with them (the l2norm kernels first), varlen with a split, GVA, unnormalised
    q and k of varied norms, against the float64 recurrence per sequence."""
    T = 260
    cu = torch.tensor([0, 1, 1, 150, T], device=device)
    x = gdn_inputs(1, T, 2, 32, 16, HV=4, dtype=torch.float32, device=device, initial_state=True, num_seqs=4, seed=9)
    gen = torch.Generator().manual_seed(9)
    for n in ("q", "k"):
        x[n] = (x[n].cpu() * torch.exp(torch.randn(1, T, 2, 1, generator=gen))).to(device)
    leaves = {n: x[n].clone().requires_grad_(grad) for n in ("q", "k", "v", "g", "beta")}
    o, s = tfla.chunk_gated_delta_rule(*leaves.values(), initial_state=x["initial_state"], output_final_state=True,
                                       cu_seqlens=cu, segments=segments, use_qk_l2norm_in_kernel=True)
    r = as_reference(x)
    for i in range(4):
        b0, b1 = int(cu[i]), int(cu[i + 1])
        ro, rs = recurrent_gated_delta_rule_ref(
            r["q"][:, b0:b1], r["k"][:, b0:b1], r["v"][:, b0:b1], r["g"][:, b0:b1], r["beta"][:, b0:b1],
            initial_state=r["initial_state"][i:i + 1], output_final_state=True, use_qk_l2norm_in_kernel=True)
        if b1 > b0:
            assert_rel_close(f"o[{i}]", o[:, b0:b1].detach().cpu(), ro, FP32_TOL)
        assert_rel_close(f"final_state[{i}]", s[i:i + 1].detach().cpu(), rs, FP32_TOL)


@pytest.mark.parametrize("seed", [64, 128])
def test_fwd_varlen_matches_per_sequence_runs(device, poison_empty, seed):
    T = 400
    cu = random_cu_seqlens(T, 5, seed=seed, device=device)
    cu[1] = 1  # a length-1 sequence (sorted cuts keep the rest increasing)
    N = cu.numel() - 1
    x = gdn_inputs(1, T, 2, 32, 16, HV=4, dtype=torch.float32, device=device, initial_state=True,
                   num_seqs=N, seed=seed)
    o, s = tfla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                       output_final_state=True, cu_seqlens=cu)
    r = as_reference(x)
    for n in range(N):
        b0, b1 = int(cu[n]), int(cu[n + 1])
        ro, rs = recurrent_gated_delta_rule_ref(
            r["q"][:, b0:b1], r["k"][:, b0:b1], r["v"][:, b0:b1], r["g"][:, b0:b1], r["beta"][:, b0:b1],
            initial_state=r["initial_state"][n:n + 1], output_final_state=True)
        assert_rel_close(f"o[seq {n}]", o[:, b0:b1].cpu(), ro, FP32_TOL)
        assert_rel_close(f"final_state[seq {n}]", s[n:n + 1].cpu(), rs, FP32_TOL)


def test_stages_match_chunk_reference(device):
    """What the forward keeps for the backward against the chunkwise reference's intermediates: the gates cumulated
    within 64 rows, Vnew and the state before every 64-row chunk (``save`` 2)."""
    x = gdn_inputs(2, 333, 1, 32, 16, HV=2, dtype=torch.float32, device=device, initial_state=True, seed=8)
    o, s, inter = chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 32 ** -0.5,
                                             x["initial_state"], True, save=2)
    r = as_reference(x)
    _, _, r64 = chunk_gated_delta_rule_ref(r["q"], r["k"], r["v"], r["g"], r["beta"],
                                           initial_state=r["initial_state"], chunk_size=64, return_intermediates=True)
    assert_rel_close("g_cum", inter["g_cum"].cpu() * LN2, r64["g_cum"], 1e-6)
    for name in ("v_new", "h"):
        assert_rel_close(name, inter[name].cpu(), r64[name], FP32_TOL)


def test_fwd_fp16(device, poison_empty):
    (o, s), (ro, rs) = _run_and_ref(device, 1, 200, 1, 2, 32, 32, dtype=torch.float16, seed=9)
    assert o.dtype == torch.float16 and s.dtype == torch.float32
    assert_rel_close("o", o.cpu(), ro, FP16_TOL)
    assert_rel_close("final_state", s.cpu(), rs, FP16_TOL)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,HV,K,V", [(2, 1000, 4, 4, 128, 128), (2, 1000, 2, 4, 128, 128),
                                          (1, 3000, 4, 4, 128, 128), (1, 777, 2, 2, 100, 200),
                                          (1, 600, 2, 2, 256, 256)])
def test_fwd_fp32_gpu_shapes(poison_empty, B, T, H, HV, K, V):
    (o, s), (ro, rs) = _run_and_ref("cuda", B, T, H, HV, K, V, seed=1)
    assert_rel_close("o", o.cpu(), ro, FP32_TOL)
    assert_rel_close("final_state", s.cpu(), rs, FP32_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("segments", [1, 4, None])
@pytest.mark.parametrize("gate", ["default", "strong"])
def test_fwd_bf16_no_worse_than_fla(segments, gate):
    """bf16 forward (unsplit, cut into 4 pieces, or as chosen) no worse than FLA's against the float32 reference."""
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    import os
    os.environ["FLA_FLASH_QLA"] = "0"
    x = gdn_inputs(2, 2048, 4, 128, 128, dtype=torch.bfloat16, device="cuda", gate=gate, initial_state=True,
                   seed=segments or 0)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o, s = tfla.chunk_gated_delta_rule(*args, initial_state=x["initial_state"], output_final_state=True,
                                       segments=segments)
    fo, fs = fla.chunk_gated_delta_rule(*args, initial_state=x["initial_state"], output_final_state=True)
    r = as_reference(x)
    ro, rs = chunk_gated_delta_rule_ref(r["q"], r["k"], r["v"], r["g"], r["beta"], initial_state=r["initial_state"],
                                        output_final_state=True, chunk_size=64)
    e_o, e_s, f_o, f_s = rel_l2(o, ro), rel_l2(s, rs), rel_l2(fo, ro), rel_l2(fs, rs)
    print(f"bf16 segments={segments} gate={gate}: tfla o {e_o:.3e} state {e_s:.3e} | FLA o {f_o:.3e} state {f_s:.3e}")
    # "no worse" with 10% slack for rounding noise between two bf16 pipelines
    assert e_o <= 1.1 * f_o and e_s <= 1.1 * f_s


@pytest.mark.parametrize("seed, config", [
    (1, {"state_lin": {"BV": 32}, "fused": {"BV": 16}}),
    (2, {"ut": {"BK": 32, "inv_BK": 32}, "state_lin": {"num_warps": 8}, "fused": {"BV": 64, "num_warps": 8}}),
    (3, {"fused": {"mn_BV": 32, "num_stages": 3}, "ut": {"sc_BK": 64}}),
])
def test_tuning_configs_compute_the_same_function(device, seed, config):
    """Every tile/launch variant the tuner may pick (the fused forward's, and the backward's recomputation, which the
    backward reaches with ``save_v_new=False``) gives the default's output, final state and gradients (fp32), dense
    and varlen, with the forward cut into pieces."""
    T = 333
    cu = torch.tensor([0, 100, 101, 333], device=device)
    x = gdn_inputs(1, T, 1, 32, 48, HV=2, dtype=torch.float32, device=device, initial_state=True, num_seqs=3,
                   seed=seed)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    for varlen in (False, True):
        res = []
        for cfg in (None, config):
            leaves = [x[n].clone().requires_grad_() for n in names]
            h0 = leaves[5] if varlen else leaves[5][:1]
            o, s = tfla.chunk_gated_delta_rule(*leaves[:5], initial_state=h0, output_final_state=True,
                                               cu_seqlens=cu if varlen else None, segments=2,
                                               save_v_new=False, config=cfg)
            res.append((o, s, *torch.autograd.grad((o * o).sum() + s.sum(), leaves)))
        for name, a, b in zip(("o", "final_state") + names, *res):
            assert_rel_close(name, b.detach().cpu(), a.detach().cpu().double(), FP32_TOL)


@pytest.mark.parametrize("varlen", [False, True])
def test_forward_without_grad_equals_forward_with_grad(device, varlen):
    """A call that needs no gradient runs the forward without an autograd Function around it: the same o and final
    state, bitwise, as the call whose inputs require grad (l2norm and the gate's activation inside, pieces), and an
    output without a grad_fn."""
    T = 130
    cu = torch.tensor([0, 1, 70, 130], device=device) if varlen else None
    x = gdn_inputs(1, T, 1, 32, 32, HV=2, dtype=torch.float32, device=device, initial_state=True,
                   num_seqs=3 if varlen else 1, seed=4)
    gen = torch.Generator().manual_seed(5)
    kw = dict(initial_state=x["initial_state"], output_final_state=True, cu_seqlens=cu, segments=2,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              A_log=torch.rand(2, generator=gen).to(device), dt_bias=torch.rand(2, generator=gen).to(device))
    names = ("q", "k", "v", "g", "beta")
    o0, s0 = tfla.chunk_gated_delta_rule(*(x[n] for n in names), **kw)
    assert o0.grad_fn is None and s0.grad_fn is None
    o1, s1 = tfla.chunk_gated_delta_rule(*(x[n].clone().requires_grad_() for n in names), **kw)
    assert o1.grad_fn is not None
    assert torch.equal(o0, o1.detach()) and torch.equal(s0, s1.detach())
