"""Gated linear attention with a vector decay (chunk_gla) against the float64 recurrence: output, final
state and every gradient (q, k, v, g, initial state) with random cotangents for o and the final state."""
import pytest
import torch
import torch.nn.functional as F

import tfla
from tfla.bench.inputs import random_cu_seqlens
from tfla.ops.gla.reference import recurrent_gla_ref
from tfla.utils.testing import assert_rel_close, rel_l2, tolerance

FP32_TOL = tolerance(torch.float32)  # 1e-5 IEEE on the interpreter; tf32x3 on CUDA (tfla.utils.testing)


def _dg_tol(max_abs_g, L):
    """dg under strong decay: the cumulative log2 gate |GV| reaches L max|g| / ln 2 within a chunk and is
    stored in fp32, so the exponent of a near pair (which dominates dg there) is off by ~eps |GV|;
    measured rel-L2 of dg ~ 1.1-1.5e-8 |GV|max (op README). Everything else stays at 1e-5."""
    return max(FP32_TOL, 3e-8 * L * max_abs_g / 0.6931471805599453)


def _gate(z, gate):
    """Log decays per key channel (natural log, <= 0) of a regime."""
    return {
        "default": F.logsigmoid(z + 3),  # e^g ~ 0.95
        "strong": -5 + 0.5 * torch.tanh(z),  # e^g ~ 0.007 every step and channel
        "mixed": torch.where(z > 0, -5 + 0.5 * torch.tanh(z), F.logsigmoid(z + 6)),  # channels near 0 and near 1
        "near_one": -1e-3 * torch.rand_like(z),  # e^g in (0.999, 1]
        "near_zero": -12 + torch.tanh(z),  # e^g ~ 6e-6
        "zero": torch.zeros_like(z),  # no decay
        # ~0.98 log2 per step: a 32-row tile spans ~30 <= the default vec_span = 32, so the diagonal takes the factored
        # product with factors up to 2^30 (one more row per tile would not: the steps)
        "span_edge": -0.68 + 0.01 * torch.tanh(z),
    }[gate]


def _inputs(B, T, H, K, V, dtype, device, seed, num_seqs=None, gate="default"):
    gen = torch.Generator().manual_seed(seed)
    x = {"q": torch.randn(B, T, H, K, generator=gen), "k": torch.randn(B, T, H, K, generator=gen) * K ** -0.5,
         "v": torch.randn(B, T, H, V, generator=gen), "g": _gate(torch.randn(B, T, H, K, generator=gen), gate),
         "h0": torch.randn(num_seqs or B, H, K, V, generator=gen) * 0.5}
    gdt = torch.float64 if dtype == torch.float64 else torch.float32
    return {n: t.to(device=device, dtype=dtype if n in ("q", "k", "v") else gdt) for n, t in x.items()}


def _check(device, B, T, H, K, V, L, dtype=torch.float32, seed=0, cu=None, num_seqs=None, gate="default",
           tol=FP32_TOL, h0=True, final=True, tols=None, config=None):
    x = _inputs(B, T, H, K, V, dtype, device, seed, num_seqs, gate)
    names = ["q", "k", "v", "g"] + (["h0"] if h0 else [])
    leaves = {n: x[n].clone().requires_grad_() for n in names}
    o, s = tfla.chunk_gla(leaves["q"], leaves["k"], leaves["v"], leaves["g"], initial_state=leaves.get("h0"),
                          output_final_state=final, cu_seqlens=cu, chunk_size=L, config=config)
    assert o.dtype == dtype and o.shape == (B, T, H, V)
    assert (s is None) == (not final)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(o.shape, generator=gen).to(device=device, dtype=o.dtype)
    loss = (o * do).sum()
    if final:
        assert s.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        dht = torch.randn(s.shape, generator=gen).to(device=device, dtype=s.dtype)
        loss = loss + (s * dht).sum()
    got = torch.autograd.grad(loss, list(leaves.values()))
    ref_leaves = {n: t.detach().cpu().double().requires_grad_() for n, t in leaves.items()}
    ro, rs = recurrent_gla_ref(ref_leaves["q"], ref_leaves["k"], ref_leaves["v"], ref_leaves["g"],
                               initial_state=ref_leaves.get("h0"), output_final_state=True,
                               cu_seqlens=cu.cpu() if cu is not None else None)
    rloss = (ro * do.cpu().double()).sum() + ((rs * dht.cpu().double()).sum() if final else 0)
    ref = torch.autograd.grad(rloss, list(ref_leaves.values()))
    assert_rel_close("o", o.detach().cpu(), ro, tol)
    if final:
        assert_rel_close("final_state", s.detach().cpu(), rs, tol)
    for name, a, b in zip(names, got, ref):
        assert a.dtype == leaves[name].dtype
        assert_rel_close(f"d{name}", a.cpu(), b, (tols or {}).get(f"d{name}", tol))


@pytest.mark.parametrize("B,T,H,K,V,L", [(2, 1, 1, 32, 32, 64), (1, 63, 2, 32, 16, 64), (1, 65, 1, 16, 16, 64),
                                         (1, 150, 1, 16, 32, 128), (1, 100, 1, 20, 24, 64), (1, 300, 1, 16, 16, 256),
                                         (1, 513, 1, 16, 16, 512)])
def test_gla_fp32(device, poison_empty, B, T, H, K, V, L):
    _check(device, B, T, H, K, V, L, seed=T + L)


@pytest.mark.parametrize("L,dg_tol", [(64, FP32_TOL), (128, 2e-5)])
def test_gla_strong_decay(device, L, dg_tol):
    """g ~ -5 per step and channel: every exponent the kernels evaluate stays <= 0, so nothing overflows;
    dg at 1e-5 for L = 64 (measured 6.0e-6) and 2e-5 for L = 128 (measured 1.3e-5), see ``_dg_tol``."""
    _check(device, 1, 150, 1, 16, 16, L, gate="strong", seed=3, tols={"dg": dg_tol})


@pytest.mark.parametrize("gate", ["zero", "near_one", "near_zero", "mixed", "span_edge"])
def test_gla_decay_regimes(device, gate):
    """No decay, decays within 1e-3 of 1, decays ~6e-6 (g ~ -12: dg held to ``_dg_tol``), channels of
    both kinds in one head, and a gate at the edge of the factored diagonal's span."""
    tols = {"dg": _dg_tol(13.0, 64)} if gate == "near_zero" else None
    _check(device, 1, 100, 1, 16, 16, 64, gate=gate, seed=5, tols=tols)


def test_gla_without_initial_or_final_state(device):
    _check(device, 1, 100, 2, 16, 16, 64, h0=False, final=False, seed=6)


@pytest.mark.parametrize("cu_list", [None, [0, 30, 30, 77, 140]])
def test_gla_varlen(device, cu_list):
    """Each packed sequence restarts from its own initial state (an empty one keeps it)."""
    cu = (torch.tensor(cu_list, device=device) if cu_list is not None
          else random_cu_seqlens(140, 3, seed=2, device=device))
    _check(device, 1, 140, 2, 16, 16, 64, cu=cu, num_seqs=len(cu) - 1, seed=2)


def test_gla_varlen_wide_heads(device):
    """fp32 with more than 128 columns runs 32-row tiles: the varlen tile tables must be built for them."""
    _check(device, 1, 150, 1, 160, 144, 64, cu=torch.tensor([0, 40, 150], device=device), num_seqs=2, seed=11)


@pytest.mark.parametrize("BQ", [16, 64])
def test_gla_tile_rows(device, BQ):
    """The vector gate's diagonal square at other tile heights than the op's default 32 rows (one
    16-row block; four blocks), forward and backward, L = 128 (``config={"tile_rows": ..}``)."""
    cfg = {"tile_rows": BQ}
    _check(device, 1, 150, 1, 16, 16, 128, gate="mixed", seed=12, config=cfg)
    _check(device, 1, 130, 2, 16, 16, 64, cu=torch.tensor([0, 50, 130], device=device), num_seqs=2, seed=13,
           config=cfg)


def test_gla_float64_exact(device):
    if device == "cuda":
        pytest.skip("float64 verification runs through the interpreter")
    _check(device, 1, 130, 1, 16, 16, 128, dtype=torch.float64, tol=1e-12, seed=4, gate="mixed")


def test_gla_fp16(device):
    """fp16 inputs, fp32 gates and accumulation: every tensor within a few fp16 ulps (measured <= 4e-4)."""
    _check(device, 1, 150, 2, 32, 16, 64, dtype=torch.float16, tol=2e-3, seed=9)


def _lowp_errors(x, L, monkeypatch, vec_f32):
    """Relative L2 of o and every gradient of a 16-bit call against the float64 recurrence on the same
    (rounded) inputs, with the gated operands kept in fp32 (``vec_f32``) or rounded to the input dtype."""
    names = ["q", "k", "v", "g", "h0"]
    leaves = {n: x[n].clone().requires_grad_() for n in names}
    o, s = tfla.chunk_gla(leaves["q"], leaves["k"], leaves["v"], leaves["g"], initial_state=leaves["h0"],
                          output_final_state=True, chunk_size=L, config={"vec_f32": vec_f32})
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(o.shape, generator=gen).to(device=o.device, dtype=o.dtype)
    dht = torch.randn(s.shape, generator=gen).to(device=s.device, dtype=s.dtype)
    got = torch.autograd.grad((o * do).sum() + (s * dht).sum(), list(leaves.values()))
    ref_leaves = {n: t.detach().cpu().double().requires_grad_() for n, t in leaves.items()}
    ro, rs = recurrent_gla_ref(ref_leaves["q"], ref_leaves["k"], ref_leaves["v"], ref_leaves["g"],
                               initial_state=ref_leaves["h0"], output_final_state=True)
    ref = torch.autograd.grad((ro * do.cpu().double()).sum() + (rs * dht.cpu().double()).sum(),
                              list(ref_leaves.values()))
    err = {"o": rel_l2(o.detach().cpu().double(), ro)}
    err.update({f"d{n}": rel_l2(a.cpu().double(), b) for n, a, b in zip(names, got, ref)})
    return err


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["default", "mixed"])
@pytest.mark.parametrize("L", [64, 128])
def test_gla_bf16_gated_operands_in_fp32(monkeypatch, gate, L):
    """bf16 on the GPU: keeping the gated operands of the intra-chunk products in fp32 (TF32 products, the
    default) is no less accurate than rounding them to bf16, for o and every gradient."""
    x = _inputs(2, 512, 4, 64, 64, torch.bfloat16, "cuda", seed=L, gate=gate)
    on = _lowp_errors(x, L, monkeypatch, True)
    off = _lowp_errors(x, L, monkeypatch, False)
    for name in on:
        print(f"bf16 gla {gate} L={L} {name}: fp32 operands {on[name]:.3e} | bf16 operands {off[name]:.3e}")
    for name in on:
        assert on[name] <= 1.05 * off[name] + 1e-5, name


@pytest.mark.parametrize("gate", ["default", "mixed"])
def test_gla_fp16_gated_operands_in_fp32_interpreter(device, monkeypatch, gate):
    """fp16 through the interpreter (which forms fp32 products exactly): the gated operands kept in fp32
    (``VEC_F32``, the default for 16-bit inputs) are never less accurate than fp16 operands, and dg, the
    difference of nearly equal sums, is at least 2x more accurate (measured 4.3x / 3.2x; o, dq, dk, dv
    3-40% better). Fails if the flag stops reaching the kernels."""
    if device == "cuda":
        pytest.skip("on the GPU TF32 keeps fp16's 10 mantissa bits; the bf16 test covers the GPU")
    x = _inputs(1, 128, 2, 32, 32, torch.float16, device, seed=3, gate=gate)
    on = _lowp_errors(x, 64, monkeypatch, True)
    off = _lowp_errors(x, 64, monkeypatch, False)
    for name in on:
        assert on[name] <= 1.001 * off[name] + 1e-7, name
    assert on["dg"] * 2 <= off["dg"]


def test_gla_wide_heads(device):
    """K = V = 256 (fp32: 32-row tiles, the state term contracted in pieces) under strong decay."""
    _check(device, 1, 70, 1, 256, 256, 64, gate="strong", seed=10)


def test_gla_matches_simple_gla_for_uniform_channels(device):
    """A vector decay equal across channels is simple GLA's scalar decay: both ops agree."""
    x = _inputs(1, 90, 2, 16, 16, torch.float32, device, 7)
    g = x["g"][..., :1]
    o1, s1 = tfla.chunk_gla(x["q"], x["k"], x["v"], g.expand_as(x["q"]), initial_state=x["h0"], output_final_state=True)
    o2, s2 = tfla.chunk_simple_gla(x["q"], x["k"], x["v"], g=g[..., 0], initial_state=x["h0"], output_final_state=True)
    assert_rel_close("o", o1.cpu(), o2.cpu().double(), FP32_TOL)
    assert_rel_close("final_state", s1.cpu(), s2.cpu().double(), FP32_TOL)


def test_gla_bad_input(device):
    x = _inputs(1, 40, 2, 16, 16, torch.float32, device, 8)
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    with pytest.raises(ValueError, match=r"`g` must be a log decay per key channel.*chunk_simple_gla"):
        tfla.chunk_gla(q, k, v, g[..., 0])
    with pytest.raises(ValueError, match=r"`g` must be a log decay per key channel"):
        tfla.chunk_gla(q, k, v, g[..., :8])
    with pytest.raises(TypeError, match="`g` must be a torch.Tensor"):
        tfla.chunk_gla(q, k, v, None)
    with pytest.raises(ValueError, match="`g` is a log decay and must be <= 0"):
        tfla.chunk_gla(q, k, v, g.abs() + 0.1)
    g1 = g.clone()
    g1[0, 39, 1, 15] = 1e-3  # one positive element: the last token's last channel
    with pytest.raises(ValueError, match="`g` is a log decay and must be <= 0"):
        tfla.chunk_gla(q, k, v, g1, cu_seqlens=torch.tensor([0, 17, 40], device=device))
    with pytest.raises(TypeError, match="`g` dtype"):
        tfla.chunk_gla(q, k, v, g.double())
    with pytest.raises(TypeError, match="`k` dtype"):
        tfla.chunk_gla(q, k.half(), v, g)
    with pytest.raises(ValueError, match="`v` must be"):
        tfla.chunk_gla(q, k, v[:, :, :1], g)
    with pytest.raises(ValueError, match="`chunk_size`"):
        tfla.chunk_gla(q, k, v, g, chunk_size=100)
    with pytest.raises(ValueError, match="`initial_state` must have shape"):
        tfla.chunk_gla(q, k, v, g, initial_state=x["h0"][:, :1])


@pytest.mark.parametrize("H", [1, 3, 16])
@pytest.mark.parametrize("reverse", [False, True])
def test_scalar_cumsum_matches_torch(device, H, reverse):
    """The cumsum of a scalar gate ``[B, T, H]`` (several heads: taken as one head's channels) with ``sub``, ``add``
    and ``floor`` against a per-chunk torch cumsum, dense and varlen, and its positivity flag."""
    from tfla.ops.common.cumsum import PositiveFlag, chunk_local_cumsum
    from tfla.ops.common.utils import prepare_chunk_indices

    gen = torch.Generator().manual_seed(1)
    B, T, L = 2, 150, 64
    g, sub, add = (-torch.rand(B, T, H, generator=gen).to(device) for _ in range(3))
    g[0, 5, 0] = -200.0  # below the floor

    def ref(x, s, a, cuts):
        x = torch.clamp(x, min=-80.0) - s
        parts = [torch.cat([(c.flip(1).cumsum(1).flip(1) if reverse else c.cumsum(1)) * 2
                            for c in x[:, lo:hi].split(L, 1)], 1) for lo, hi in zip(cuts[:-1], cuts[1:])]
        return torch.cat(parts, 1) + a

    out = chunk_local_cumsum(g, L, scale=2.0, reverse=reverse, sub=sub, add=add, floor=-80.0)
    assert out.shape == g.shape
    assert_rel_close("cumsum", ref(g, sub, add, [0, T]).double().cpu(), out.double().cpu(), 1e-6)
    flag = PositiveFlag(g.device)
    chunk_local_cumsum(g, L, positive_flag=flag)
    flag.raise_if_positive()
    g[1, 149, H - 1] = 1e-6
    flag = PositiveFlag(g.device)
    chunk_local_cumsum(g, L, reverse=reverse, positive_flag=flag)
    with pytest.raises(ValueError, match="`g` is a log decay"):
        flag.raise_if_positive()
    cu = [0, 70, 71, 150]
    outv = chunk_local_cumsum(g[:1], L, scale=2.0, reverse=reverse, cu_seqlens=torch.tensor(cu, device=device),
                              chunk_indices=prepare_chunk_indices(cu, L, device), sub=sub[:1], add=add[:1],
                              floor=-80.0)
    assert_rel_close("cumsum varlen", ref(g[:1], sub[:1], add[:1], cu).double().cpu(), outv.double().cpu(), 1e-6)


@pytest.mark.parametrize("D", [1, 20, 128])
@pytest.mark.parametrize("reverse", [False, True])
def test_channel_cumsum_matches_torch(device, D, reverse):
    """The cumsum kernel's per-channel tiles (``[B, T, H, D]``, channels contiguous) against a per-chunk
    torch cumsum, dense and varlen, with the positivity flag left at 0 for g <= 0."""
    from tfla.ops.common.cumsum import PositiveFlag, chunk_local_cumsum
    from tfla.ops.common.utils import prepare_chunk_indices

    torch.manual_seed(0)
    B, T, H, L = 2, 150, 3, 64
    g = -torch.rand(B, T, H, D, device=device)
    flag = PositiveFlag(g.device)
    out = chunk_local_cumsum(g, L, scale=2.0, reverse=reverse, positive_flag=flag)
    ref = torch.cat([(c.flip(1).cumsum(1).flip(1) if reverse else c.cumsum(1)) for c in g.split(L, 1)], 1) * 2
    assert_rel_close("cumsum", ref.double().cpu(), out.double().cpu(), 1e-6)
    flag.raise_if_positive()  # g <= 0: no error
    assert int(flag.flag.item()) == 0
    g[1, 149, 2, D - 1] = 1e-6  # one positive element, the last one
    flag = PositiveFlag(g.device)
    chunk_local_cumsum(g, L, reverse=reverse, positive_flag=flag)
    with pytest.raises(ValueError, match="`g` is a log decay"):
        flag.raise_if_positive()
    cu = [0, 70, 150]
    gv = g[:1]
    outv = chunk_local_cumsum(gv, L, reverse=reverse, cu_seqlens=torch.tensor(cu, device=device),
                              chunk_indices=prepare_chunk_indices(cu, L, device))
    refv = torch.cat([torch.cat([(c.flip(1).cumsum(1).flip(1) if reverse else c.cumsum(1))
                                 for c in gv[:, a:b].split(L, 1)], 1) for a, b in zip(cu[:-1], cu[1:])], 1)
    assert_rel_close("cumsum varlen", refv.double().cpu(), outv.double().cpu(), 1e-6)
