"""Linear attention with scalar / constant / no decay (chunk_simple_gla, chunk_retention,
chunk_linear_attn) against the float64 recurrence: output, final state and every gradient."""
import pytest
import torch
import torch.nn.functional as F

import tfla
from tfla.bench.inputs import random_cu_seqlens
from tfla.ops.simple_gla.reference import recurrent_simple_gla_ref, retention_log_decay
from tfla.utils.testing import assert_rel_close

FP32_TOL = 1e-5


def _inputs(B, T, H, K, V, mode, dtype, device, seed, num_seqs=None, gate="default"):
    gen = torch.Generator().manual_seed(seed)
    x = {"q": torch.randn(B, T, H, K, generator=gen), "k": torch.randn(B, T, H, K, generator=gen) * K ** -0.5,
         "v": torch.randn(B, T, H, V, generator=gen),
         "h0": torch.randn(num_seqs or B, H, K, V, generator=gen) * 0.5}
    if mode == "g":
        z = torch.randn(B, T, H, generator=gen)
        x["g"] = {"default": F.logsigmoid(z + 3), "strong": 2 * F.logsigmoid(z - 2), "zero": torch.zeros_like(z)}[gate]
    x = {n: t.to(dtype if n in ("q", "k", "v") else (torch.float64 if dtype == torch.float64 else torch.float32))
         .to(device) for n, t in x.items()}
    if mode == "gamma":
        x["g_gamma"] = retention_log_decay(H, device=device)
    return x


def _check(device, B, T, H, K, V, L, mode, dtype=torch.float32, seed=0, cu=None, num_seqs=None, gate="default",
           tol=FP32_TOL, final=True, tols=None):
    x = _inputs(B, T, H, K, V, mode, dtype, device, seed, num_seqs, gate)
    names = ["q", "k", "v"] + (["g"] if mode == "g" else []) + ["h0"]
    leaves = {n: x[n].clone().requires_grad_() for n in names}
    o, s = tfla.chunk_simple_gla(leaves["q"], leaves["k"], leaves["v"], g=leaves.get("g"), g_gamma=x.get("g_gamma"),
                                 initial_state=leaves["h0"], output_final_state=final, cu_seqlens=cu, chunk_size=L)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(o.shape, generator=gen).to(device=device, dtype=o.dtype)
    loss = (o * do).sum()
    if final:
        dht = torch.randn(s.shape, generator=gen).to(device=device, dtype=s.dtype)
        loss = loss + (s * dht).sum()
    got = torch.autograd.grad(loss, list(leaves.values()))
    ref_leaves = {n: t.detach().cpu().double().requires_grad_() for n, t in leaves.items()}
    gg = x.get("g_gamma")
    ro, rs = recurrent_simple_gla_ref(ref_leaves["q"], ref_leaves["k"], ref_leaves["v"], g=ref_leaves.get("g"),
                                      g_gamma=gg.cpu().double() if gg is not None else None,
                                      initial_state=ref_leaves["h0"], output_final_state=True,
                                      cu_seqlens=cu.cpu() if cu is not None else None)
    rloss = (ro * do.cpu().double()).sum() + ((rs * dht.cpu().double()).sum() if final else 0)
    ref = torch.autograd.grad(rloss, list(ref_leaves.values()))
    assert_rel_close("o", o.detach().cpu(), ro, tol)
    if final:
        assert_rel_close("final_state", s.detach().cpu(), rs, tol)
    for name, a, b in zip(names, got, ref):
        assert_rel_close(f"d{name}", a.cpu(), b, (tols or {}).get(f"d{name}", tol))


@pytest.mark.parametrize("mode", ["g", "gamma", "none"])
@pytest.mark.parametrize("B,T,H,K,V,L", [(2, 1, 1, 32, 32, 64), (1, 63, 2, 32, 16, 64), (1, 130, 1, 16, 32, 128),
                                         (1, 300, 1, 32, 32, 256), (1, 513, 1, 16, 16, 512), (1, 100, 1, 20, 24, 64)])
def test_simple_gla_fp32(device, poison_empty, mode, B, T, H, K, V, L):
    _check(device, B, T, H, K, V, L, mode, seed=T + L)


def test_simple_gla_zero_gates(device):
    _check(device, 1, 300, 2, 32, 32, 128, "g", gate="zero", seed=3)


def test_simple_gla_strong_gates(device):
    """Strong decay: every tensor at 1e-5 except dg, held to 2e-5 (the chunkwise gate gradient sums
    near-cancelling row and column terms; measured 1.07e-5 here; see the GDN op README)."""
    _check(device, 1, 300, 2, 32, 32, 128, "g", gate="strong", seed=3, tols={"dg": 2e-5})


@pytest.mark.parametrize("mode", ["g", "none"])
def test_simple_gla_varlen(device, mode):
    T = 350
    cu = random_cu_seqlens(T, 4, seed=2, device=device)
    _check(device, 1, T, 2, 32, 16, 128, mode, cu=cu, num_seqs=4, seed=2)


def test_simple_gla_float64_exact(device):
    if device == "cuda":
        pytest.skip("float64 verification runs through the interpreter")
    _check(device, 1, 200, 1, 16, 16, 128, "g", dtype=torch.float64, tol=1e-12, seed=4)


def test_simple_gla_without_final_state(device):
    _check(device, 1, 100, 1, 16, 16, 64, "g", final=False, seed=5)


def test_retention_is_simple_gla_with_fixed_decays(device):
    x = _inputs(1, 150, 4, 16, 16, "none", torch.float32, device, 6)
    o1, s1 = tfla.chunk_retention(x["q"], x["k"], x["v"], initial_state=x["h0"], output_final_state=True)
    ro, rs = recurrent_simple_gla_ref(*(x[n].cpu().double() for n in ("q", "k", "v")),
                                      g_gamma=retention_log_decay(4).double(), initial_state=x["h0"].cpu().double(),
                                      output_final_state=True)
    assert_rel_close("o", o1.cpu(), ro, FP32_TOL)
    assert_rel_close("final_state", s1.cpu(), rs, FP32_TOL)


def test_linear_attn_matches_no_decay(device):
    x = _inputs(1, 90, 1, 16, 16, "none", torch.float32, device, 7)
    o, _ = tfla.chunk_linear_attn(x["q"], x["k"], x["v"], normalize=False)
    ro, _ = recurrent_simple_gla_ref(*(x[n].cpu().double() for n in ("q", "k", "v")))
    assert_rel_close("o", o.cpu(), ro, FP32_TOL)
    with pytest.raises(NotImplementedError, match="normalize"):
        tfla.chunk_linear_attn(x["q"], x["k"], x["v"])  # FLA's default normalize=True: not yet


def test_simple_gla_bad_input(device):
    x = _inputs(1, 40, 2, 16, 16, "g", torch.float32, device, 8)
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    with pytest.raises(ValueError, match="vector decay"):
        tfla.chunk_simple_gla(q, k, v, g=torch.zeros(1, 40, 2, 16, device=device))
    with pytest.raises(ValueError, match="must be <= 0"):
        tfla.chunk_simple_gla(q, k, v, g=g.abs() + 0.1)
    with pytest.raises(ValueError, match="`g_gamma` is a log decay"):
        tfla.chunk_simple_gla(q, k, v, g_gamma=torch.full((2,), 0.5, device=device))
    with pytest.raises(ValueError, match="at most one"):
        tfla.chunk_simple_gla(q, k, v, g=g, g_gamma=torch.full((2,), -0.5, device=device))
    with pytest.raises(ValueError, match="`g_gamma` must be a per-head"):
        tfla.chunk_simple_gla(q, k, v, g_gamma=torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="`v` must be"):
        tfla.chunk_simple_gla(q, k, v[:, :, :1], g=g)
    with pytest.raises(ValueError, match="`chunk_size`"):
        tfla.chunk_simple_gla(q, k, v, g=g, chunk_size=100)
    with pytest.raises(TypeError, match="`k` dtype"):
        tfla.chunk_simple_gla(q, k.half(), v, g=g)
