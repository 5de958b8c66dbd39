"""The Gated DeltaNet's gate and beta activations inside the gate's cumsum kernels (``tfla/ops/common/gate_act.py``)
against PyTorch: the forward's chunk cumsum of ``-exp(A_log) softplus(a + dt_bias)`` (floored) and the activated
beta; the backward's gradients of a, A_log, dt_bias and beta's pre-activation, through autograd of the same
PyTorch ops. Pre-activations span softplus's linear, curved and exponentially small regimes."""
import pytest
import torch
import torch.nn.functional as F

from tfla.ops.common.cumsum import chunk_local_cumsum
from tfla.ops.common.gate_act import BETA_2SIGMOID, BETA_SIGMOID, NO_BETA, GateAct, gate_epilogue, gate_prologue
from tfla.ops.common.utils import LOG_DECAY_FLOOR, RCP_LN2
from tfla.utils.testing import assert_rel_close, tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("bias,beta_mode", [(True, BETA_SIGMOID), (False, BETA_2SIGMOID), (True, NO_BETA)])
def test_gate_act_matches_pytorch(device, dtype, varlen, bias, beta_mode):
    if dtype == torch.float64 and device == "cuda":
        pytest.skip("float64 verification runs through the interpreter")
    tol = 1e-12 if dtype == torch.float64 else tolerance(torch.float32)
    gen = torch.Generator().manual_seed(3)
    B, T, HV = (1, 200, 3) if varlen else (2, 130, 3)
    cu = torch.tensor([0, 0, 1, 70, T], device=device) if varlen else None
    bounds = cu.tolist() if varlen else None
    a = torch.randn(B, T, HV, generator=gen, dtype=torch.float64) * 8  # |a + dt_bias| past 20 on some tokens
    a[..., 0, 0] = -40.0  # softplus ~ e^-40: the series branch
    a = a.to(device, dtype).requires_grad_()
    a_log = (torch.randn(HV, generator=gen, dtype=torch.float64) * 2).to(device, dtype).requires_grad_()
    dt_bias = torch.randn(HV, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_() if bias else None
    b = torch.randn(B, T, HV, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
    act = GateAct(a_log.detach(), dt_bias.detach() if bias else None, beta_mode)

    g_cum, beta = gate_prologue(a.detach(), b.detach(), act, cu_seqlens=cu, bounds=bounds)
    g = -a_log.exp() * F.softplus(a + (dt_bias if bias else 0.0))
    want = chunk_local_cumsum(g.detach(), 64, scale=RCP_LN2, cu_seqlens=cu, bounds=bounds,
                              out_dtype=g_cum.dtype, floor=LOG_DECAY_FLOOR)
    assert_rel_close("g_cum", g_cum, want, tol)
    beta_want = torch.sigmoid(b) * beta_mode if beta_mode != NO_BETA else b
    assert_rel_close("beta", beta, beta_want.detach(), tol)

    dgq, dgam, dbeta = (torch.randn(B, T, HV, generator=gen, dtype=torch.float64).to(device, dtype) for _ in range(3))
    da, db, d_a_log, d_dt = gate_epilogue(dgq, dgam, dbeta, a.detach(), b.detach(), act, cu_seqlens=cu,
                                          bounds=bounds)
    dg = chunk_local_cumsum(dgq, 64, reverse=True, cu_seqlens=cu, bounds=bounds, out_dtype=da.dtype, add=dgam)
    leaves = [a, a_log] + ([dt_bias] if bias else [])
    ref = torch.autograd.grad(g, leaves, dg)
    assert_rel_close("da", da, ref[0], tol)
    assert_rel_close("dA_log", d_a_log, ref[1], tol)
    if bias:
        assert_rel_close("ddt_bias", d_dt, ref[2], tol)
    else:
        assert d_dt is None
    if beta_mode != NO_BETA:
        (ref_b,) = torch.autograd.grad(beta_want, b, dbeta)
        assert_rel_close("dbeta", db, ref_b, tol)
    else:
        assert db is dbeta


@pytest.mark.parametrize("varlen", [False, True])
def test_gate_epilogue_without_dgam(device, varlen):
    """``dgam=None`` (the Hopper chunk-gradient kernel's rows carry the whole delta part): the gradients of the
    activations from the reverse cumsum of ``dgq`` alone, equal to passing a zero ``dgam``, and against autograd."""
    gen = torch.Generator().manual_seed(5)
    B, T, HV = (1, 150, 2) if varlen else (2, 100, 2)
    cu = torch.tensor([0, 1, 64, T], device=device) if varlen else None
    bounds = cu.tolist() if varlen else None
    a = (torch.randn(B, T, HV, generator=gen) * 3).to(device).requires_grad_()
    a_log = torch.randn(HV, generator=gen).to(device).requires_grad_()
    dt_bias = torch.randn(HV, generator=gen).to(device).requires_grad_()
    b = torch.randn(B, T, HV, generator=gen).to(device)
    act = GateAct(a_log.detach(), dt_bias.detach(), BETA_SIGMOID)
    dgq, dbeta = (torch.randn(B, T, HV, generator=gen).to(device) for _ in range(2))
    got = gate_epilogue(dgq, None, dbeta, a.detach(), b, act, cu_seqlens=cu, bounds=bounds)
    zero = gate_epilogue(dgq, torch.zeros_like(dgq), dbeta, a.detach(), b, act, cu_seqlens=cu, bounds=bounds)
    for name, x, y in zip(("da", "dbeta", "dA_log", "ddt_bias"), got, zero):
        assert torch.equal(x, y), name
    g = -a_log.exp() * F.softplus(a + dt_bias)
    dg = chunk_local_cumsum(dgq, 64, reverse=True, cu_seqlens=cu, bounds=bounds)
    ref = torch.autograd.grad(g, [a, a_log, dt_bias], dg)
    tol = tolerance(torch.float32)
    for name, x, y in zip(("da", "dA_log", "ddt_bias"), (got[0], got[2], got[3]), ref):
        assert_rel_close(name, x, y, tol)
