"""Linear attention with scalar / constant / no decay (chunk_simple_gla, chunk_retention, chunk_lightning_attn,
chunk_linear_attn, normalized or not) against the float64 recurrence: output, final state and every gradient."""
import pytest
import torch
import torch.nn.functional as F

import tfla
from tfla.bench.inputs import random_cu_seqlens
from tfla.ops.simple_gla.reference import (
    lightning_log_decay,
    recurrent_linear_attn_ref,
    recurrent_simple_gla_ref,
    retention_log_decay,
)
from tfla.utils.testing import assert_rel_close, tolerance

FP32_TOL = tolerance(torch.float32)  # 1e-5 IEEE on the interpreter; tf32x3 on CUDA (tfla.utils.testing)


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


def test_simple_gla_varlen_wide_values(device, poison_empty):
    """fp32 with V = 200: the tiled kernel switches to 32-row tiles for the 256-wide contraction of dq,
    and must rebuild the varlen tile table for them (it read the caller's 64-row table before)."""
    T = 230
    cu = random_cu_seqlens(T, 3, seed=4, device=device)
    _check(device, 1, T, 1, 16, 200, 64, "g", cu=cu, num_seqs=3, seed=4)


def test_simple_gla_float64_exact(device):
    if device == "cuda":
        pytest.skip("float64 verification runs through the interpreter")
    _check(device, 1, 200, 1, 16, 16, 128, "g", dtype=torch.float64, tol=1e-12, seed=4)


def test_simple_gla_without_final_state(device):
    _check(device, 1, 100, 1, 16, 16, 64, "g", final=False, seed=5)


@pytest.mark.parametrize("L", [64, 128])
def test_simple_gla_g_without_grad(device, L):
    """A g that needs no gradient skips the gate gradient's work (wy_bwd's DG off, no states read there):
    dq, dk, dv and d initial_state are the same as with dg computed (bitwise), and dg is None."""
    x = _inputs(1, 200, 2, 32, 16, "g", torch.float32, device, 8)
    grads = []
    for g_grad in (True, False):
        leaves = {n: x[n].clone().requires_grad_(n != "g" or g_grad) for n in ("q", "k", "v", "g", "h0")}
        o, s = tfla.chunk_simple_gla(leaves["q"], leaves["k"], leaves["v"], g=leaves["g"], initial_state=leaves["h0"],
                                     output_final_state=True, chunk_size=L)
        loss = (o * torch.cos(o.detach())).sum() + s.sum()
        want = [leaves[n] for n in ("q", "k", "v", "h0")] + ([leaves["g"]] if g_grad else [])
        grads.append(torch.autograd.grad(loss, want))
    for name, a, b in zip(("dq", "dk", "dv", "dh0"), grads[0], grads[1]):
        assert torch.equal(a, b), name
    assert grads[0][4].abs().sum() > 0


def test_retention_is_simple_gla_with_fixed_decays(device):
    x = _inputs(1, 150, 4, 16, 16, "none", torch.float32, device, 6)
    o1, s1 = tfla.chunk_retention(x["q"], x["k"], x["v"], initial_state=x["h0"], output_final_state=True)
    ro, rs = recurrent_simple_gla_ref(*(x[n].cpu().double() for n in ("q", "k", "v")),
                                      g_gamma=retention_log_decay(4).double(), initial_state=x["h0"].cpu().double(),
                                      output_final_state=True)
    assert_rel_close("o", o1.cpu(), ro, FP32_TOL)
    assert_rel_close("final_state", s1.cpu(), rs, FP32_TOL)


@pytest.mark.parametrize("layer_idx,num_layers,L", [(0, 4, 64), (3, 4, 128), (4, 4, 64)])
def test_lightning_attn_matches_recurrence(device, layer_idx, num_layers, L):
    """Lightning Attention's decays (FLA's chunk_lightning_attn): output, final state and every gradient
    against the float64 recurrence with the same constant decays; layer_idx = num_layers is no decay."""
    x = _inputs(1, 150, 4, 16, 16, "none", torch.float32, device, 10)
    names = ("q", "k", "v", "h0")
    leaves = {n: x[n].clone().requires_grad_() for n in names}
    o, s = tfla.chunk_lightning_attn(leaves["q"], leaves["k"], leaves["v"], layer_idx, num_layers,
                                     initial_state=leaves["h0"], output_final_state=True, chunk_size=L)
    gen = torch.Generator().manual_seed(11)
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(s.shape, generator=gen)
    got = torch.autograd.grad((o * do.to(device)).sum() + (s * dht.to(device)).sum(), list(leaves.values()))
    ref_leaves = {n: t.detach().cpu().double().requires_grad_() for n, t in leaves.items()}
    gg = lightning_log_decay(4, layer_idx, num_layers).double()
    assert gg[0] == 0 and bool((gg <= 0).all())
    ro, rs = recurrent_simple_gla_ref(ref_leaves["q"], ref_leaves["k"], ref_leaves["v"], g_gamma=gg,
                                      initial_state=ref_leaves["h0"], output_final_state=True)
    ref = torch.autograd.grad((ro * do.double()).sum() + (rs * dht.double()).sum(), list(ref_leaves.values()))
    assert_rel_close("o", o.detach().cpu(), ro, FP32_TOL)
    assert_rel_close("final_state", s.detach().cpu(), rs, FP32_TOL)
    for name, a, b in zip(names, got, ref):
        assert_rel_close(f"d{name}", a.cpu(), b, FP32_TOL)


def test_lightning_attn_bad_input(device):
    q = torch.randn(1, 8, 2, 16, device=device)
    with pytest.raises(ValueError, match="layer_idx"):
        tfla.chunk_lightning_attn(q, q, q, 5, 4)
    with pytest.raises(ValueError, match="num_layers"):
        tfla.chunk_lightning_attn(q, q, q, 0, 0)
    with pytest.raises(TypeError, match="`layer_idx` must be an int"):
        tfla.chunk_lightning_attn(q, q, q, 0.5, 4)


def test_linear_attn_matches_no_decay(device):
    x = _inputs(1, 90, 1, 16, 16, "none", torch.float32, device, 7)
    o, _ = tfla.chunk_linear_attn(x["q"], x["k"], x["v"], normalize=False)
    ro, _ = recurrent_simple_gla_ref(*(x[n].cpu().double() for n in ("q", "k", "v")))
    assert_rel_close("o", o.cpu(), ro, FP32_TOL)


def _la_inputs(B, T, H, K, V, dtype, device, seed, num_seqs=None, keys="positive", z_dtype=None, bounds=None):
    """Positive feature maps (elu + 1), the inputs normalized linear attention is used with: the
    denominators scale q_t . z_t stay positive, so the relative errors measure the kernels, not a pole.
    ``keys="mixed"``: keys of both signs whose running sum flips sign every 23 tokens of each sequence (``bounds``:
    the varlen offsets; k_t = a_t u + small noise, z_t ~ +-u), so the denominators change sign while staying away
    from zero (z_0 small)."""
    gen = torch.Generator().manual_seed(seed)
    N = num_seqs or B
    x = {"q": F.elu(torch.randn(B, T, H, K, generator=gen)) + 1,
         "k": (F.elu(torch.randn(B, T, H, K, generator=gen)) + 1) * K ** -0.5,
         "v": torch.randn(B, T, H, V, generator=gen),
         "h0": torch.randn(N, H, K, V, generator=gen) * 0.5,
         "z0": (F.elu(torch.randn(N, 1, H, K, generator=gen)) + 1) * 4 * K ** -0.5}
    if keys == "mixed":
        u = (F.elu(torch.randn(1, 1, H, K, generator=gen)) + 1) * K ** -0.5
        bounds = bounds or [0, T]
        pos = torch.cat([torch.arange(b1 - b0) for b0, b1 in zip(bounds[:-1], bounds[1:])])  # within its sequence
        sign = 1.0 - 2.0 * ((pos // 23) % 2).float()
        a = torch.where(pos == 0, sign, sign - F.pad(sign, (1, 0))[:-1])  # the steps: 1, 0, .., -2, 0, .., 2
        x["k"] = a[None, :, None, None] * u + 0.02 * K ** -0.5 * torch.randn(B, T, H, K, generator=gen)
        x["z0"] = x["z0"] * 0.02
    x = {n: t.to(device=device, dtype=dtype) for n, t in x.items()}
    if z_dtype is not None:
        x["z0"] = x["z0"].to(z_dtype)
    return x


def _check_la(device, B, T, H, K, V, L, seed=0, cu=None, num_seqs=None, init="tuple", final=True,
              dtype=torch.float32, tol=FP32_TOL, default_args=False, keys="positive", z_dtype=None):
    """chunk_linear_attn(normalize=True) vs the float64 recurrence: o, final S, z_state and the gradients
    of q, k, v and each initial state given, with random cotangents for every output.
    init: "tuple" (S_0, z_0) | "kv" (a plain S_0 tensor: z_0 = 0) | "z" ((None, z_0)) | "s" ((S_0, None)) |
    "none" ((None, None)) | None. z_dtype: z_0's dtype (default q's); o and z_state come in the promoted dtype.
    Returns the reference's denominators ``scale q_t . z_t`` ``[B, T, H]`` (float64)."""
    x = _la_inputs(B, T, H, K, V, dtype, device, seed, num_seqs, keys=keys, z_dtype=z_dtype,
                   bounds=cu.tolist() if cu is not None else None)
    names = ["q", "k", "v"] + {"tuple": ["h0", "z0"], "kv": ["h0"], "z": ["z0"], "s": ["h0"], "none": [],
                               None: []}[init]
    leaves = {n: x[n].clone().requires_grad_() for n in names}

    def state(d):
        return {"tuple": lambda: (d["h0"], d["z0"]), "kv": lambda: d["h0"], "z": lambda: (None, d["z0"]),
                "s": lambda: (d["h0"], None), "none": lambda: (None, None), None: lambda: None}[init]()

    kw = {} if default_args else {"initial_state": state(leaves), "output_final_state": final, "normalize": True,
                                  "cu_seqlens": cu, "chunk_size": L}
    o, (s, z) = tfla.chunk_linear_attn(leaves["q"], leaves["k"], leaves["v"], **kw)
    N = num_seqs or B
    out_dtype = torch.promote_types(dtype, z_dtype) if z_dtype is not None and "z0" in names else dtype
    assert o.dtype == out_dtype and z.dtype == out_dtype and z.shape == (N, 1, H, K)
    assert (s is None) == (not final or default_args)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(o.shape, generator=gen).to(device=device, dtype=o.dtype)
    dz = torch.randn(z.shape, generator=gen).to(device=device, dtype=z.dtype)
    loss = (o * do).sum() + (z * dz).sum()
    if s is not None:
        dht = torch.randn(s.shape, generator=gen).to(device=device, dtype=s.dtype)
        loss = loss + (s * dht).sum()
    got = torch.autograd.grad(loss, list(leaves.values()))
    ref_leaves = {n: t.detach().cpu().double().requires_grad_() for n, t in leaves.items()}
    ro, (rs, rz) = recurrent_linear_attn_ref(ref_leaves["q"], ref_leaves["k"], ref_leaves["v"],
                                             initial_state=None if default_args else state(ref_leaves),
                                             output_final_state=True, normalize=True,
                                             cu_seqlens=cu.cpu() if cu is not None else None)
    rloss = (ro * do.cpu().double()).sum() + (rz * dz.cpu().double()).sum()
    if s is not None:
        rloss = rloss + (rs * dht.cpu().double()).sum()
    ref = torch.autograd.grad(rloss, list(ref_leaves.values()))
    assert_rel_close("o", o.detach().cpu(), ro, tol)
    assert_rel_close("z_state", z.detach().cpu(), rz, tol)
    if s is not None:
        assert_rel_close("final_state", s.detach().cpu(), rs, tol)
    for name, a, b in zip(names, got, ref):
        assert a.dtype == leaves[name].dtype, name
        assert_rel_close(f"d{name}", a.cpu(), b, tol)
    # the reference's denominators, from its key sums per sequence
    rq, rk = (ref_leaves[n].detach() for n in ("q", "k"))
    z0 = ref_leaves["z0"].detach() if "z0" in names else None
    bounds = cu.tolist() if cu is not None else [0, T]
    zc = torch.cat([rk[:, b0:b1].cumsum(1) + (z0[n:n + 1] if cu is not None else z0) if z0 is not None
                    else rk[:, b0:b1].cumsum(1) for n, (b0, b1) in enumerate(zip(bounds[:-1], bounds[1:]))], 1)
    return (rq * zc).sum(-1) * K ** -0.5


@pytest.mark.parametrize("B,T,H,K,V,L", [(2, 1, 1, 32, 32, 64), (1, 63, 2, 32, 16, 64), (1, 130, 1, 16, 32, 128),
                                         (1, 100, 1, 20, 24, 64), (1, 300, 1, 16, 16, 256), (1, 520, 1, 16, 16, 512)])
def test_linear_attn_normalized_fp32(device, poison_empty, B, T, H, K, V, L):
    """Every chunk size, T = 1, T not a multiple of 64 or of L, head dims that are not powers of two."""
    _check_la(device, B, T, H, K, V, L, seed=T + L)


@pytest.mark.parametrize("init,final", [("kv", True), ("z", False), ("s", True), ("none", False), (None, True)])
def test_linear_attn_normalized_states(device, init, final):
    """A plain tensor initial_state means z_0 = 0 (as in FLA); (None, z_0) carries only the key sum, (S_0, None)
    only S, (None, None) neither; z_state comes back even without output_final_state (FLA returns (None, z_state))."""
    _check_la(device, 1, 70, 2, 16, 16, 64, seed=11, init=init, final=final)


def test_linear_attn_normalize_is_the_default(device):
    _check_la(device, 1, 90, 1, 16, 16, 64, seed=7, init=None, default_args=True)


@pytest.mark.parametrize("cu_list,L", [(None, 64), ([0, 30, 30, 77, 150], 64), ([0, 1, 1, 65, 66, 150], 64),
                                       ([0, 0, 1, 149, 150], 128)])
def test_linear_attn_normalized_varlen(device, poison_empty, cu_list, L):
    """S and z restart from S_0[n], z_0[n] per sequence; an empty sequence keeps its z_0 (as in FLA); one-token
    sequences; sequences across chunk boundaries."""
    cu = (torch.tensor(cu_list, device=device) if cu_list is not None
          else random_cu_seqlens(150, 4, seed=12, device=device))
    N = cu.numel() - 1
    _check_la(device, 1, 150, 2, 16, 16, L, seed=12, cu=cu, num_seqs=N)
    _check_la(device, 1, 150, 2, 16, 16, L, seed=13, cu=cu, num_seqs=N, init="z", final=False)


@pytest.mark.parametrize("L,cu_list", [(64, None), (128, None), (64, [0, 40, 41, 150])])
def test_linear_attn_normalized_sign_change(device, L, cu_list):
    """Keys of both signs: the denominators scale q_t . z_t change sign within a sequence (FLA keeps the sign
    and adds its epsilon; no absolute value or lower bound as in the mLSTM)."""
    cu = torch.tensor(cu_list, device=device) if cu_list is not None else None
    den = _check_la(device, 1, 150, 2, 16, 16, L, seed=17, keys="mixed", cu=cu,
                    num_seqs=len(cu_list) - 1 if cu_list else None)
    assert (den > 0).any() and (den < 0).any()
    assert den.abs().min() > 0.1 * den.abs().median()  # away from the pole: the errors measure the kernels


def test_linear_attn_normalized_fp16_promoted_by_fp32_z0(device):
    """fp16 q, k, v with an fp32 z_0: o and z_state in fp32 (FLA's promotion), dz_0 fp32, dq, dk, dv fp16; and
    all fp16."""
    _check_la(device, 1, 100, 2, 32, 32, 64, seed=19, dtype=torch.float16, z_dtype=torch.float32,
              tol=tolerance(torch.float16))
    _check_la(device, 1, 100, 2, 32, 32, 64, seed=20, dtype=torch.float16, tol=tolerance(torch.float16))


def test_linear_attn_normalized_float64_exact(device):
    if device == "cuda":
        pytest.skip("float64 verification runs through the interpreter")
    _check_la(device, 1, 100, 1, 16, 16, 64, seed=13, dtype=torch.float64, tol=1e-12)
    _check_la(device, 1, 100, 1, 16, 16, 128, seed=14, dtype=torch.float64, tol=1e-12, keys="mixed")


def test_linear_attn_normalized_chains(device):
    """(S, z_state) of one call continues the next: two halves equal the whole sequence."""
    x = _la_inputs(1, 100, 2, 16, 16, torch.float32, device, 14)
    q, k, v = x["q"], x["k"], x["v"]
    o, (s, z) = tfla.chunk_linear_attn(q, k, v, initial_state=(x["h0"], x["z0"]), output_final_state=True)
    o1, st = tfla.chunk_linear_attn(q[:, :37], k[:, :37], v[:, :37], initial_state=(x["h0"], x["z0"]),
                                    output_final_state=True)
    o2, (s2, z2) = tfla.chunk_linear_attn(q[:, 37:], k[:, 37:], v[:, 37:], initial_state=st, output_final_state=True)
    assert_rel_close("o", torch.cat([o1, o2], 1).cpu(), o.cpu().double(), FP32_TOL)
    assert_rel_close("final_state", s2.cpu(), s.cpu().double(), FP32_TOL)
    assert_rel_close("z_state", z2.cpu(), z.cpu().double(), FP32_TOL)


def test_linear_attn_bad_input(device):
    x = _la_inputs(1, 40, 2, 16, 16, torch.float32, device, 15)
    q, k, v, h0, z0 = x["q"], x["k"], x["v"], x["h0"], x["z0"]
    with pytest.raises(ValueError, match="tuple `initial_state` is for normalize=True"):
        tfla.chunk_linear_attn(q, k, v, initial_state=(h0, z0), normalize=False)
    with pytest.raises(ValueError, match="tuple of 3"):
        tfla.chunk_linear_attn(q, k, v, initial_state=(h0, z0, z0))
    with pytest.raises(ValueError, match=r"z_state\)` must have 4 dims"):
        tfla.chunk_linear_attn(q, k, v, initial_state=(h0, z0[:, 0]))
    with pytest.raises(ValueError, match=r"z_state\) must have shape"):
        tfla.chunk_linear_attn(q, k, v, initial_state=(h0, z0[:, :, :1]))
    with pytest.raises(TypeError, match=r"z_state\)` dtype"):
        tfla.chunk_linear_attn(q, k, v, initial_state=(h0, z0.double()))
    with pytest.raises(ValueError, match="`initial_state` must have shape"):
        tfla.chunk_linear_attn(q, k, v, initial_state=(h0[:, :1], z0))


def test_simple_gla_bad_input(device):
    x = _inputs(1, 40, 2, 16, 16, "g", torch.float32, device, 8)
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    with pytest.raises(ValueError, match="vector decay"):
        tfla.chunk_simple_gla(q, k, v, g=torch.zeros(1, 40, 2, 16, device=device))
    with pytest.raises(ValueError, match="must be <= 0"):
        tfla.chunk_simple_gla(q, k, v, g=g.abs() + 0.1)
    g1 = g.clone()
    g1[0, 37, 1] = 1e-3  # one positive element, in the last (partial) chunk
    with pytest.raises(ValueError, match="`g` is a log decay and must be <= 0"):
        tfla.chunk_simple_gla(q, k, v, g=g1, chunk_size=64)
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


@pytest.mark.parametrize("gate", ["scalar", "vector"])
@pytest.mark.parametrize("T,V,cu_list", [(200, 40, None), (190, 32, [0, 70, 70, 190])])
def test_state_bwd_in_place_of_the_states(device, poison_empty, gate, T, V, cu_list):
    """The state-gradient recurrence writing dS over S (``h_sub``) gives the same dS, dU and d initial_state as
    into a fresh buffer (bitwise), and its rows of <S, dS> (one partial per value tile) sum to those of the
    states and gradients of the out-of-place run; varlen slots included (an empty sequence among them)."""
    from tfla.ops.common.chunk_state import chunk_state_fwd
    from tfla.ops.common.chunk_state_bwd import chunk_state_bwd
    from tfla.ops.common.varlen import VarlenIndex

    gen = torch.Generator().manual_seed(T + V)
    B, H, K, L = 1, 2, 32, 64
    q, k = (torch.randn(B, T, H, K, generator=gen).to(device) for _ in range(2))
    v, do = (torch.randn(B, T, H, V, generator=gen).to(device) for _ in range(2))
    N = B if cu_list is None else len(cu_list) - 1
    h0 = torch.randn(N, H, K, V, generator=gen).to(device)
    cu = torch.tensor(cu_list, device=device) if cu_list is not None else None
    vl = VarlenIndex.build(cu, L) if cu is not None else None
    if gate == "scalar":  # log2 cumulative gates restarting every L (any values <= 0 do here)
        g_cum, gv_cum, dvo = (F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2) * 0.3).to(device), None, None
    else:
        g_cum, gv_cum = None, (F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2) * 0.3).to(device)
        dvo = do * 0.5  # the vector gate reads dvo (no in-kernel product)
    h_sub, _ = chunk_state_fwd(k, v, g_cum, L, initial_state=h0, cu_seqlens=cu, gv_cum=gv_cum,
                                  chunk_offsets=vl.sub_offsets if vl else None,
                                  num_chunks=vl.sub_indices.shape[0] if vl else None, store_every_sub_chunk=True)
    kw = dict(cu_seqlens=cu, sub_offsets=vl.sub_offsets if vl else None, gv_cum=gv_cum, need_dh0=True,
              num_sub_chunks=vl.sub_indices.shape[0] if vl else None)
    dh, du, dh0 = chunk_state_bwd(q, k, None, do, dvo, g_cum, 0.7, L, **kw)
    s = h_sub.clone()
    dh2, du2, dh02, sds = chunk_state_bwd(q, k, None, do, dvo, g_cum, 0.7, L, **kw, h_sub=s, sds=True)
    assert dh2.data_ptr() == s.data_ptr()
    for name, a, b in (("dh", dh2, dh), ("du", du2, du), ("dh0", dh02, dh0)):
        assert torch.equal(a, b), name
    want = (h_sub.double() * dh.double()).sum(-1)  # [B, NS, H, K]
    assert_rel_close("sds", sds.sum(3).double().cpu(), want.cpu(), 1e-6)


@pytest.mark.parametrize("L,split", [(64, True), (64, False), (128, True)])
def test_bwd_do_row_log2_equals_scaled_do(device, L, split):
    """``chunk_simple_gla_bwd(do_row_log2=rl)`` (the mLSTM's dO = dh / d) gives the gradients of ``do * 2^rl``: at
    L = 64 with split gates through the query-side gate (no scaled copy of do; the normalizer's row constant dden
    and its states beside), elsewhere by scaling do first. Rows with rl of both signs; varlen not needed (the row
    factor is per token)."""
    from tfla.ops.common.chunk_state_bwd import chunk_state_bwd
    from tfla.ops.simple_gla.chunk import chunk_simple_gla_bwd

    gen = torch.Generator().manual_seed(L + split)
    B, T, H, K, V = 1, 150, 2, 32, 48
    q, k = (torch.randn(B, T, H, K, generator=gen).to(device) for _ in range(2))
    v, do = (torch.randn(B, T, H, V, generator=gen).to(device) for _ in range(2))
    g = (F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2) * 0.5)
    # log2 gates cumulative within chunks of L; the key side a little apart from the query side (the mLSTM's shape)
    gq = torch.cat([c.cumsum(1) for c in g.split(L, 1)], 1).to(device)
    gk = (gq - 0.3 * torch.rand(B, T, H, generator=gen).to(device)) if split else None
    rl = (torch.randn(B, T, H, generator=gen) * 2).to(device)
    dden = torch.randn(B, T, H, generator=gen).to(device)
    h0 = torch.randn(B, H, K, V, generator=gen).to(device)
    n0 = torch.randn(B, H, K, generator=gen).to(device)
    kw = dict(gk_cum=gk, dden=dden, initial_n=n0, kdot=split)
    got = chunk_simple_gla_bwd(q, k, v, gq, 0.6, h0, do, None, L, **kw, do_row_log2=rl)
    want = chunk_simple_gla_bwd(q, k, v, gq, 0.6, h0, do * torch.exp2(rl)[..., None], None, L, **kw)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_rel_close(f"output {i}", a.double().cpu(), b.double().cpu(), 1e-5)
    with pytest.raises(ValueError, match="do_row_log2"):  # the recurrence's row factor needs dvo formed in it
        chunk_state_bwd(q, k, None, do, do, gq, 0.6, L, do_row_log2=rl)


def test_state_bwd_keeps_ds_apart_on_one_stage_16bit(device):
    """16-bit inputs on a one-stage launch do not take the dS-over-S path (Triton 3.6 faulted there on the H100):
    the rows of <S, dS> come back None, dS gets a buffer of its own and S is left as it was."""
    from tfla.ops.common.chunk_state import chunk_state_fwd
    from tfla.ops.common.chunk_state_bwd import chunk_state_bwd

    gen = torch.Generator().manual_seed(9)
    B, T, H, K, V, L = 1, 130, 1, 16, 16, 64
    q, k, v, do = (torch.randn(B, T, H, K, generator=gen).half().to(device) for _ in range(4))
    g = (F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2) * 0.3).to(device)
    h_sub, _ = chunk_state_fwd(k, v, g, L, store_every_sub_chunk=True)
    s = h_sub.clone()
    dh, _, _, sds = chunk_state_bwd(q, k, None, do, None, g, 0.5, L, h_sub=s, sds=True, config={"num_stages": 1})
    assert sds is None and dh.data_ptr() != s.data_ptr() and torch.equal(s, h_sub)
    dh2, _, _, sds2 = chunk_state_bwd(q, k, None, do, None, g, 0.5, L, h_sub=s, sds=True)  # two stages: in place
    assert sds2 is not None and dh2.data_ptr() == s.data_ptr() and torch.equal(dh2, dh)


@pytest.mark.gpu
@pytest.mark.parametrize("K,V", [(256, 256), (256, 128)])
def test_head_dim_256_bf16_gpu(K, V):
    """bf16 at head dim 256 on the GPU: the state backward's one-stage launch hit an illegal address on the H100
    under Triton 3.6 (found 2026-11-23); 16-bit launches now pipeline two stages. Output and every gradient
    against tfla's fp32 run of the same inputs (bf16-level agreement, 1e-2)."""
    gen = torch.Generator().manual_seed(K + V)
    q, k = (torch.randn(2, 300, 2, K, generator=gen) * K ** -0.25 for _ in range(2))
    v = torch.randn(2, 300, 2, V, generator=gen)
    g = F.logsigmoid(torch.randn(2, 300, 2, generator=gen) + 3)
    runs = []
    for dt in (torch.bfloat16, torch.float32):
        leaves = [t.to("cuda", dt if t is not g else torch.float32).requires_grad_() for t in (q, k, v, g)]
        o, _ = tfla.chunk_simple_gla(*leaves[:3], g=leaves[3], chunk_size=64)
        do = torch.randn(o.shape, generator=gen.manual_seed(1)).to("cuda", dt)
        runs.append((o,) + torch.autograd.grad(o, leaves, do))
    for name, a, b in zip(("o", "dq", "dk", "dv", "dg"), *runs):
        assert_rel_close(name, a.float().cpu(), b.double().cpu(), 1e-2)


def test_in_place_stage_arguments_checked(device):
    """The in-place stage's preconditions raise ValueError: rows of <S, dS> without the states to overwrite or with
    the delta rule's W, a state-terms call that needs S without it, h_sub of the wrong shape."""
    from tfla.ops.common.chunk_state_bwd import chunk_state_bwd
    from tfla.ops.common.wy_bwd import wy_bwd

    B, T, H, K, V, L = 1, 128, 1, 16, 16, 64
    q, k, v, do = (torch.randn(B, T, H, K, device=device) for _ in range(4))
    g = torch.zeros(B, T, H, device=device)
    h = torch.zeros(B, 2, H, K, V, device=device)
    with pytest.raises(ValueError, match="sds"):
        chunk_state_bwd(q, k, None, do, None, g, 1.0, L, sds=True)
    with pytest.raises(ValueError, match="sds"):
        chunk_state_bwd(q, k, k, do, None, g, 1.0, L, h_sub=h, sds=True)
    with pytest.raises(ValueError, match="h_sub"):
        chunk_state_bwd(q, k, None, do, None, g, 1.0, L, h_sub=h[:, :1])
    with pytest.raises(ValueError, match="h_sub is needed"):
        wy_bwd(k, None, None, g, None, v, None, None, h, L)
