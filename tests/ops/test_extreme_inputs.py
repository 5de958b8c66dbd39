"""Extreme but legal inputs: outputs and gradients stay finite and equal the float64 recurrence.

Per op (GDN, simple GLA, GLA, mLSTM), fp32 on the interpreter (or CUDA): no decay on any head (g = 0), decays of
-1e4 and -inf on some tokens (a state reset: e^g = 0), GDN's beta = 0 and beta = 1, mLSTM input-gate
pre-activations of +-80, T = 1, and packed sequences of length 1 and 0. Non-finite inputs (NaN) propagate to the
outputs of their sequence, as in FLA: ``test_nan_gate_propagates``.
"""
import pytest
import torch

import tfla
from tfla.bench.inputs import gdn_inputs
from tfla.ops.gated_delta_rule.reference import recurrent_gated_delta_rule_ref
from tfla.ops.gla.reference import recurrent_gla_ref
from tfla.ops.mlstm.reference import recurrent_mlstm_ref
from tfla.ops.simple_gla.reference import recurrent_simple_gla_ref
from tfla.utils.testing import assert_rel_close, tolerance

H, K, V = 1, 16, 16


def _case(op, T, device, gate, seed, N=1):
    """(tfla fn, reference fn, inputs dict, names of the differentiable inputs)."""
    x = gdn_inputs(1, T, H, K, V, HV=2 if op == "gdn" else H, dtype=torch.float32, device=device, seed=seed,
                   initial_state=True, num_seqs=N)
    gen = torch.Generator().manual_seed(seed + 7)
    HV = x["v"].shape[2]
    if op == "gla":
        x["g"] = torch.nn.functional.logsigmoid(torch.randn(1, T, H, K, generator=gen) + 2).to(device)
    if op == "mlstm":
        x["i"] = torch.randn(1, T, H, generator=gen).to(device)
        x["f"] = (torch.randn(1, T, H, generator=gen) + 3).to(device)
        x["initial_state"] = (x["initial_state"], torch.rand(N, H, K, generator=gen).to(device),
                              torch.zeros(N, H, device=device))
    g = x["g"]
    if gate == "zero":
        x["g"] = torch.zeros_like(g)
    elif gate in ("-1e4", "-inf") and op != "mlstm":
        g = g.clone()
        g[:, T // 3] = float(gate)
        g[:, (2 * T) // 3, 0] = float(gate)  # one head only (GDN / GLA's first channel)
        x["g"] = g
    elif gate in ("-1e4", "-inf"):  # the mLSTM's forget gate: logsigmoid(f) -> -1e4 / -inf
        x["f"] = x["f"].clone()
        x["f"][:, T // 3] = float(gate)
    elif gate == "beta0":
        x["beta"] = torch.zeros_like(x["beta"])
    elif gate == "beta1":
        x["beta"] = torch.ones_like(x["beta"])
    elif gate == "i80":
        x["i"] = x["i"].clone()
        x["i"][:, ::3] = 80.0
        x["i"][:, 1::3] = -80.0
    del HV
    if op == "gdn":
        names = ("q", "k", "v", "g", "beta")

        def fn(xs, cu):
            return tfla.chunk_gated_delta_rule(*[xs[n] for n in names], initial_state=xs["initial_state"],
                                               output_final_state=True, cu_seqlens=cu)

        def ref(xs, cu):
            return recurrent_gated_delta_rule_ref(*[xs[n] for n in names], initial_state=xs["initial_state"],
                                                  output_final_state=True, cu_seqlens=cu)
    elif op in ("simple_gla", "gla"):
        names = ("q", "k", "v", "g")
        op_fn = tfla.chunk_simple_gla if op == "simple_gla" else tfla.chunk_gla
        ref_fn = recurrent_simple_gla_ref if op == "simple_gla" else recurrent_gla_ref

        def fn(xs, cu):
            return op_fn(xs["q"], xs["k"], xs["v"], g=xs["g"], initial_state=xs["initial_state"],
                         output_final_state=True, cu_seqlens=cu)

        def ref(xs, cu):
            return ref_fn(xs["q"], xs["k"], xs["v"], g=xs["g"], initial_state=xs["initial_state"],
                          output_final_state=True, cu_seqlens=cu)
    else:
        names = ("q", "k", "v", "i", "f")

        def fn(xs, cu):
            return tfla.chunk_mlstm(*[xs[n] for n in names], initial_state=xs["initial_state"],
                                    output_final_state=True, cu_seqlens=cu)

        def ref(xs, cu):
            return recurrent_mlstm_ref(*[xs[n] for n in names], initial_state=xs["initial_state"],
                                       output_final_state=True, cu_seqlens=cu)
    return fn, ref, x, names


def _flat(s):
    return list(s) if isinstance(s, (tuple, list)) else [s]


def _compare(op, T, device, gate, seed=0, cu=None):
    N = 1 if cu is None else len(cu) - 1
    fn, ref, x, names = _case(op, T, device, gate, seed, N)
    states = _flat(x["initial_state"])
    leaves = {n: x[n].clone().requires_grad_() for n in names}
    s_leaves = [s.clone().requires_grad_() for s in states]
    o, fs = fn({**leaves, "initial_state": s_leaves[0] if len(s_leaves) == 1 else tuple(s_leaves)}, cu)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(o.shape, generator=gen).to(device)
    dfs = [torch.randn(f.shape, generator=gen).to(device) for f in _flat(fs)][:2]  # m (mLSTM) gets none
    loss = (o * do).sum() + sum((f * d).sum() for f, d in zip(_flat(fs), dfs))
    got = torch.autograd.grad(loss, list(leaves.values()) + s_leaves[:2])

    r_leaves = {n: t.detach().cpu().double().requires_grad_() for n, t in leaves.items()}
    r_states = [s.detach().cpu().double().requires_grad_() for s in s_leaves]
    ro, rfs = ref({**r_leaves, "initial_state": r_states[0] if len(r_states) == 1 else tuple(r_states)},
                  cu.cpu() if cu is not None else None)
    rloss = (ro * do.cpu().double()).sum() + sum((f * d.cpu().double()).sum() for f, d in zip(_flat(rfs), dfs))
    want = torch.autograd.grad(rloss, list(r_leaves.values()) + r_states[:2])
    # floored decays and gates of magnitude 80: fp32 spaces numbers near 80 by 7.6e-6, so e^80 and the rows' chunk
    # sums behind a floored gate carry ~1e-5 relative error before any kernel runs (measured on the interpreter:
    # o 3.4e-5 and df 1.04e-4 at i = +-80; the forget gate's gradient sums terms of opposite sign there)
    tol = tolerance(torch.float32) * {"-1e4": 10, "-inf": 10, "i80": 30}.get(gate, 1)
    assert_rel_close("o", o.detach().cpu(), ro, tol)
    for i, (a, b) in enumerate(zip(_flat(fs)[:2], _flat(rfs)[:2])):
        assert_rel_close(f"final_state[{i}]", a.detach().cpu(), b, tol)
    for name, a, b in zip(list(names) + ["d_state0", "d_state1"], got, want):
        assert_rel_close(f"d{name}", a.cpu(), b, tol)


OPS = ("gdn", "simple_gla", "gla", "mlstm")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("gate", ["zero", "-1e4", "-inf"])
def test_extreme_gates(device, op, gate):
    _compare(op, 150, device, gate, seed=3)


@pytest.mark.parametrize("gate", ["beta0", "beta1"])
def test_gdn_beta_edges(device, gate):
    _compare("gdn", 150, device, gate, seed=4)


def test_mlstm_input_gate_80(device):
    _compare("mlstm", 150, device, "i80", seed=5)


@pytest.mark.parametrize("op", OPS)
def test_one_token(device, op):
    _compare(op, 1, device, "default", seed=6)


@pytest.mark.parametrize("op", OPS)
def test_varlen_lengths_one_and_zero(device, op):
    cu = torch.tensor([0, 1, 1, 70, 71, 130], device=device)  # lengths 1, 0, 69, 1, 59
    _compare(op, 130, device, "default", seed=8, cu=cu)


@pytest.mark.parametrize("op", ("gdn", "simple_gla"))
def test_nan_gate_propagates(device, op):
    """A NaN decay makes its sequence's outputs from that token on NaN (as FLA's kernels do); other sequences are
    untouched. Documented in the README's limits."""
    cu = torch.tensor([0, 70, 140], device=device)
    fn, _, x, _ = _case(op, 140, device, "default", 9, N=2)
    x["g"] = x["g"].clone()
    x["g"][:, 100] = float("nan")
    with torch.no_grad():
        o, _ = fn(x, cu)
    assert torch.isfinite(o[:, :70]).all()
    assert torch.isnan(o[:, 100:]).any()
