"""tfla.chunk_mlstm against the float64 step-by-step recurrence: output, final state (C, n, m) and the
gradients of q, k, v, i, f and every initial-state tensor, with random cotangents for all outputs."""
import pytest
import torch

import tfla
from tfla.bench.inputs import random_cu_seqlens
from tfla.bench.mlstm import parallel_mlstm_detached_ref
from tfla.ops.mlstm.reference import recurrent_mlstm_ref
from tfla.utils.testing import assert_rel_close, rel_l2, tolerance

FP32_TOL = tolerance(torch.float32)  # 1e-5 IEEE on the interpreter; tf32x3 on CUDA (tfla.utils.testing)
CONFIGS = [("exp", True), ("sigmoid", True), ("sigmoid", False)]


def _inputs(B, T, H, K, V, gate, dtype, device, seed, N=None, i_scale=1.0, f_shift=2.0):
    gen = torch.Generator().manual_seed(seed)
    N = N or B
    x = {"q": torch.randn(B, T, H, K, generator=gen), "k": torch.randn(B, T, H, K, generator=gen),
         "v": torch.randn(B, T, H, V, generator=gen),
         "i": torch.randn(B, T, H, generator=gen) * i_scale, "f": torch.randn(B, T, H, generator=gen) + f_shift,
         "C0": torch.randn(N, H, K, V, generator=gen) * 0.3, "n0": torch.randn(N, H, K, generator=gen) * 0.3,
         "m0": torch.randn(N, H, generator=gen)}
    gdt = torch.float64 if dtype == torch.float64 else torch.float32
    return {n: t.to(device=device, dtype=dtype if n in ("q", "k", "v") else gdt) for n, t in x.items()}


def _run(fn, x, gate, normalize, h0, final, cu, L=None, seed=0):
    names = ["q", "k", "v", "i", "f"] + ((["C0", "n0"] + (["m0"] if gate == "exp" else [])) if h0 else [])
    leaves = {n: x[n].detach().clone().requires_grad_() for n in names}
    state = tuple(leaves[n] for n in names[5:]) if h0 else None
    kw = dict(input_gate=gate, normalize=normalize, initial_state=state, output_final_state=final, cu_seqlens=cu)
    if L is not None:
        kw["chunk_size"] = L
    h, st = fn(*(leaves[n] for n in names[:5]), **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    loss = (h.double() * torch.randn(h.shape, generator=gen, dtype=torch.float64).to(h.device)).sum()
    outs = {"h": h}
    if final:
        for n, t in zip(("C", "n", "m"), st):
            outs[n] = t
            loss = loss + (t.double() * torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    outs.update({"d" + n: g for n, g in zip(leaves, grads)})
    return outs


def _check(device, B, T, H, K, V, L, gate, normalize, dtype=torch.float32, h0=True, final=True, cu=None, N=None,
           tol=FP32_TOL, seed=0, floor=False, **kw):
    """Every output and gradient within ``tol`` of the float64 recurrence. ``floor``: inputs whose
    conditioning puts even the fp32 recurrence above ``tol`` (input gates of +-40: the normalizer
    divides by near-cancelling sums); then each tensor may be up to 2x the fp32 recurrence's own error."""
    x = _inputs(B, T, H, K, V, gate, dtype, device, seed, N=N, **kw)
    got = _run(tfla.chunk_mlstm, x, gate, normalize, h0, final, cu, L=L, seed=seed)
    xr = {n: t.detach().cpu().double() for n, t in x.items()}
    cur = cu.cpu() if cu is not None else None
    ref = _run(recurrent_mlstm_ref, xr, gate, normalize, h0, final, cur, seed=seed)
    base = None
    if floor:
        base = _run(recurrent_mlstm_ref, {n: t.float() for n, t in xr.items()}, gate, normalize, h0, final, cur,
                    seed=seed)
    for n in ref:
        assert torch.isfinite(got[n]).all(), n
        t = tol if base is None else max(tol, 2 * rel_l2(base[n].double(), ref[n]))
        assert_rel_close(n, got[n].cpu(), ref[n], t)


@pytest.mark.parametrize("gate,normalize", CONFIGS)
@pytest.mark.parametrize("L", [64, 128, 256])
def test_mlstm_fp32_matches_recurrence(device, poison_empty, gate, normalize, L):
    _check(device, 2, 150, 2, 16, 32, L, gate, normalize, seed=L)


@pytest.mark.parametrize("gate,normalize", CONFIGS)
def test_mlstm_float64_exact(device, gate, normalize):
    if device == "cuda":
        pytest.skip("float64 verification runs through the interpreter")
    _check(device, 1, 200, 1, 16, 16, 128, gate, normalize, dtype=torch.float64, tol=1e-11, seed=3, i_scale=20.0)


@pytest.mark.parametrize("gate", ["exp", "sigmoid"])
def test_mlstm_large_input_gates(device, gate):
    """Input-gate pre-activations of +-40 and beyond (the max-state path): finite and exact."""
    _check(device, 1, 200, 2, 16, 16, 64, gate, True, seed=4, i_scale=40.0, floor=True)
    _check(device, 1, 200, 2, 16, 16, 64, gate, True, seed=4, i_scale=3.0, floor=True)


def test_mlstm_strong_and_zero_forget(device):
    """Strong forget gates (log f ~ -4 per token) at 3e-5: the chunk-local cumulative gates reach ~-256
    within a 64-row chunk, where fp32 spacing is 1.5e-5 (the same limit as simple GLA's and GDN's dg)."""
    _check(device, 1, 130, 2, 16, 16, 64, "exp", True, seed=5, f_shift=-4.0, tol=3e-5)
    _check(device, 1, 130, 2, 16, 16, 64, "exp", True, seed=6, f_shift=30.0, floor=True)  # forget ~ 1: dm0 1.2e-5 in fp32 either way


@pytest.mark.parametrize("gate,normalize", [("exp", True), ("sigmoid", True)])
def test_mlstm_varlen(device, gate, normalize):
    T = 300
    cu = random_cu_seqlens(T, 4, seed=7, device=device)
    _check(device, 1, T, 2, 16, 16, 64, gate, normalize, cu=cu, N=4, seed=7)


@pytest.mark.parametrize("T", [1, 64, 65])
def test_mlstm_short_sequences(device, T):
    _check(device, 1, T, 1, 16, 16, 64, "exp", True, seed=T)


def test_mlstm_without_states(device):
    _check(device, 1, 100, 2, 16, 16, 64, "exp", True, h0=False, final=False, seed=8)
    _check(device, 1, 100, 2, 16, 16, 64, "sigmoid", False, h0=False, final=False, seed=9)


@pytest.mark.parametrize("gate", ["exp", "sigmoid"])
def test_mlstm_chunkwise_then_step_continues_exactly(device, gate):
    x = _inputs(1, 90, 2, 16, 16, gate, torch.float32, device, 10)
    args = [x[n] for n in ("q", "k", "v", "i", "f")]
    h_all, s_all = tfla.chunk_mlstm(*args, input_gate=gate, output_final_state=True)
    T1 = 80
    h1, state = tfla.chunk_mlstm(*(a[:, :T1] for a in args), input_gate=gate, output_final_state=True)
    hs = [h1]
    for t in range(T1, 90):
        h_t, state = tfla.mlstm_step(*(a[:, t] for a in args), state, input_gate=gate)
        hs.append(h_t[:, None])
    assert_rel_close("h", torch.cat(hs, 1), h_all, FP32_TOL)
    for n, a, b in zip("Cnm", state, s_all):
        assert_rel_close(n, a, b, FP32_TOL)


def _detached(q, k, v, i, f, input_gate, normalize, initial_state, output_final_state, cu_seqlens, **kw):
    return parallel_mlstm_detached_ref(q, k, v, i, f, input_gate=input_gate), None


def _tfla_detached(*args, **kw):
    return tfla.chunk_mlstm(*args, detach_normalizer=True, **kw)


@pytest.mark.parametrize("gate", ["exp", "sigmoid"])
def test_mlstm_detached_normalizer(device, gate):
    """``detach_normalizer=True`` (mlstm_kernels' backward convention): the same output, gradients of
    the product with the normalizer and max state held constant (float64 quadratic reference)."""
    x = _inputs(1, 150, 2, 16, 16, gate, torch.float32, device, 14)
    got = _run(_tfla_detached, x, gate, True, False, False, None, L=64, seed=14)
    ref = _run(_detached, {n: t.cpu().double() for n, t in x.items()}, gate, True, False, False, None, seed=14)
    exact = _run(tfla.chunk_mlstm, x, gate, True, False, False, None, L=64, seed=14)
    assert torch.equal(got["h"], exact["h"])
    for n in ref:
        assert_rel_close(n, got[n].cpu(), ref[n], FP32_TOL)
    assert rel_l2(exact["dq"].cpu().double(), ref["dq"]) > 1e-3  # the conventions do differ


def _tfla_saved(*args, **kw):
    return tfla.chunk_mlstm(*args, save_states=True, **kw)


@pytest.mark.parametrize("gate,normalize", CONFIGS)
def test_mlstm_save_states(device, gate, normalize):
    """``save_states=True``: the forward's 64-row states replace the backward's recompute; every output and
    gradient bitwise equal to the recompute's (same kernels on the same states; those are checked against float64),
    including varlen with an empty sequence and a second backward through the same graph (it recomputes: the
    first one overwrote the saved states)."""
    cu = torch.tensor([0, 37, 37, 150], device=device)
    for cu_, B, N in ((None, 2, None), (cu, 1, 3)):
        x = _inputs(B, 150, 2, 16, 32, gate, torch.float32, device, 21, N=N)
        got = _run(_tfla_saved, x, gate, normalize, True, True, cu_, L=64, seed=21)
        exp = _run(tfla.chunk_mlstm, x, gate, normalize, True, True, cu_, L=64, seed=21)
        for n in exp:
            assert torch.equal(got[n], exp[n]), n
    names = ["q", "k", "v", "i", "f"]
    leaves = [x[n].detach().clone().requires_grad_() for n in names]
    h, _ = tfla.chunk_mlstm(*leaves, input_gate=gate, normalize=normalize, chunk_size=64, save_states=True)
    dh = torch.randn_like(h)
    first = torch.autograd.grad(h, leaves, dh, retain_graph=True)
    second = torch.autograd.grad(h, leaves, dh)
    for n, a, b in zip(names, first, second):
        assert torch.equal(a, b), n
    with pytest.raises(ValueError, match="save_states"):
        tfla.chunk_mlstm(*leaves, input_gate=gate, normalize=normalize, chunk_size=128, save_states=True)


def test_mlstm_bad_input(device):
    x = _inputs(1, 40, 2, 16, 16, "exp", torch.float32, device, 11)
    q, k, v, i, f = (x[n] for n in ("q", "k", "v", "i", "f"))
    with pytest.raises(ValueError, match="input_gate"):
        tfla.chunk_mlstm(q, k, v, i, f, input_gate="relu")
    with pytest.raises(ValueError, match="normalize=False"):
        tfla.chunk_mlstm(q, k, v, i, f, normalize=False)
    with pytest.raises(ValueError, match="`i`"):
        tfla.chunk_mlstm(q, k, v, i[..., None], f)
    with pytest.raises(ValueError, match="`f`"):
        tfla.chunk_mlstm(q, k, v, i, f[:, :10])
    with pytest.raises(TypeError, match="initial_state"):
        tfla.chunk_mlstm(q, k, v, i, f, initial_state=(x["C0"], x["n0"]))  # exp needs m too
    with pytest.raises(ValueError, match="initial_state"):
        tfla.chunk_mlstm(q, k, v, i, f, initial_state=(x["C0"], x["n0"][:, :1], x["m0"]))
    with pytest.raises(ValueError, match="chunk_size"):
        tfla.chunk_mlstm(q, k, v, i, f, chunk_size=100)
    with pytest.raises(ValueError, match="eps"):
        tfla.chunk_mlstm(q, k, v, i, f, eps=-1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("gate,normalize", CONFIGS)
def test_mlstm_deterministic(gate, normalize):
    x = _inputs(2, 1000, 4, 64, 128, gate, torch.bfloat16, "cuda", 12)
    a = _run(tfla.chunk_mlstm, x, gate, normalize, True, True, None, L=128)
    b = _run(tfla.chunk_mlstm, x, gate, normalize, True, True, None, L=128)
    for n in a:
        assert torch.equal(a[n], b[n]), n


MK_KERNELS = {"exp": "chunkwise--triton_limit_chunk", "sigmoid": "chunkwise--triton_xl_chunk_siging"}


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["exp", "sigmoid"])
def test_mlstm_bf16_no_worse_than_mlstm_kernels(gate):
    """bf16 output and gradients vs float64, tfla and mlstm_kernels on the same inputs (head-first for
    mlstm_kernels), both in mlstm_kernels' gradient convention (normalizer and max state held constant,
    tfla's ``detach_normalizer=True``); tfla's error may exceed mlstm_kernels' by at most 10%."""
    mk = pytest.importorskip("mlstm_kernels.torch")
    B, T, H, K, V = 1, 512, 2, 64, 128
    x = _inputs(B, T, H, K, V, gate, torch.float32, "cuda", 13)
    xb = {n: (t.bfloat16() if n in ("q", "k", "v") else t) for n, t in x.items()}
    xr = {n: t.cpu().double() for n, t in x.items()}
    ref = _run(_detached, xr, gate, True, False, False, None)
    ours = _run(_tfla_detached, xb, gate, True, False, False, None, L=128)
    kern = mk.get_mlstm_kernel(MK_KERNELS[gate])

    def theirs(q, k, v, i, f, input_gate, normalize, initial_state, output_final_state, cu_seqlens):
        tr = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731
        h = kern(q=tr(q), k=tr(k), v=tr(v), i=tr(i), f=tr(f), chunk_size=128, eps=1e-6, return_last_states=False)
        return tr(h), None

    try:
        other = _run(theirs, xb, gate, True, False, False, None)
    except Exception as e:  # noqa: BLE001
        # mlstm_kernels 2.0.6 uses block pointers, which Triton 3.9 removed (CompilationError /
        # NotImplementedError there): no peer to compare with, tfla's own bf16 run above still ran
        if "Block pointers have been removed" not in f"{e} {e.__cause__}":
            raise
        pytest.skip(f"mlstm_kernels does not compile with this Triton: {type(e).__name__}")
    report = []
    for n in ref:
        e_ours, e_theirs = rel_l2(ours[n].cpu().double(), ref[n]), rel_l2(other[n].cpu().double(), ref[n])
        report.append(f"{n}: tfla {e_ours:.2e} mlstm_kernels {e_theirs:.2e}")
    print(f"\nbf16 mlstm {gate}: " + "; ".join(report))
    for n in ref:
        assert rel_l2(ours[n].cpu().double(), ref[n]) <= 1.1 * rel_l2(other[n].cpu().double(), ref[n]) + 1e-4, n


def test_state_bwd_launch_covers_the_device():
    """16-bit inputs: 128-column value tiles while they leave at least one program per SM (132 off the GPU), narrower
    tiles below that (each program is a sequential chain of T / 64 steps); fp32 keeps the shared default."""
    from tfla.ops.mlstm.chunk import _state_bwd_config

    q16, q32 = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)
    assert _state_bwd_config(q16, 8, 16, 256)["BV"] == 128  # 256 programs
    assert _state_bwd_config(q16, 4, 16, 256)["BV"] == 64  # 128 at 128 columns: too few
    assert _state_bwd_config(q16, 1, 16, 256)["BV"] == 32  # the narrowest, whatever it covers
    assert all(not _state_bwd_config(q16, n, 16, 256)["qsplit"] for n in (1, 4, 8))
    assert _state_bwd_config(q32, 8, 16, 256) is None
