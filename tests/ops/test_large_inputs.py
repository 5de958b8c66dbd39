"""Inputs past 2^31 elements: no offset may wrap, no grid axis may overflow (GPU only, ``slow``).

Each chunked op runs once on B = 1, T = 2^20 + 2^16 tokens with H = 32 heads of head dim 64, so a token
tensor holds T * H * K = 2.28e9 > 2^31 elements (6% margin) and the stored states more (chunks * H * K * V).
Checked per op:

- dense: every output, final state and gradient is finite; the last ``TAIL`` outputs and their gradients
  equal a run over just those tokens started from the state after the preceding ones (detached, so the
  tail's gradients are the same functions of the same values);
- varlen: the same total packed as [long, 1, 0, TAIL] tokens: the last sequence's outputs and gradients
  equal a run of that sequence alone (B = 1) from its own initial state.

Wrapped 32-bit offsets write and read the wrong rows near the end of the buffers; the comparison of the
tail catches that (the tail runs at offsets below 2^31). The mLSTM step (PyTorch ops) runs on a state of
B * H * K * V > 2^31 elements. Peak memory ~70 GB for GDN's backward: the tests skip, saying so, on a GPU
with less free memory.

Run: ``python -m pytest -q -m "gpu and slow" tests/ops/test_large_inputs.py`` (the grid-limit cases at the end are
small and run with the plain GPU suite, ``-m gpu``).
"""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

import tfla
from tfla.utils.testing import rel_l2

pytestmark = pytest.mark.gpu

H, K, V = 32, 64, 64
T_BIG = 2**20 + 2**16  # T * H * K = 2.28e9 > 2^31
TAIL = 4096  # a multiple of every chunk size: the tail starts at a chunk boundary
TOL = 5e-3  # bf16: the two runs share kernels and chunk boundaries; wrapped offsets give O(1) errors
OPS = ("gdn", "simple_gla", "gla", "mlstm")


def _need(gib: float):
    gc.collect()  # what an earlier test left in PyTorch's cache counts as free
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs ~{gib:.0f} GiB of free GPU memory, {free / 2**30:.0f} GiB free")


def _inputs(op: str, T: int, gen: torch.Generator) -> dict:
    dev, bf = "cuda", torch.bfloat16

    def rn(*shape, dtype=bf, scale=1.0):
        return (torch.randn(shape, generator=gen, device=dev) * scale).to(dtype)

    x = {"q": rn(1, T, H, K), "k": F.normalize(rn(1, T, H, K, dtype=torch.float32), dim=-1).to(bf),
         "v": rn(1, T, H, V)}
    if op == "gdn":
        x["g"] = F.logsigmoid(rn(1, T, H, dtype=torch.float32) + 3.0)
        x["beta"] = torch.sigmoid(rn(1, T, H, dtype=torch.float32)).to(bf)
    elif op == "simple_gla":
        x["g"] = F.logsigmoid(rn(1, T, H, dtype=torch.float32) + 3.0)
    elif op == "gla":
        x["g"] = F.logsigmoid(rn(1, T, H, K, dtype=torch.float32) + 4.0) / 4
    elif op == "mlstm":
        x["i"] = rn(1, T, H, dtype=torch.float32)
        x["f"] = rn(1, T, H, dtype=torch.float32) + 3.0
    return x


def _state(op: str, N: int, gen: torch.Generator):
    if op == "mlstm":
        return (torch.randn(N, H, K, V, generator=gen, device="cuda") * 0.1,
                torch.rand(N, H, K, generator=gen, device="cuda"), torch.zeros(N, H, device="cuda"))
    return torch.randn(N, H, K, V, generator=gen, device="cuda") * 0.1


def _run(op: str, x: dict, initial_state, cu_seqlens=None):
    kw = dict(initial_state=initial_state, output_final_state=True, cu_seqlens=cu_seqlens)
    if op == "gdn":
        return tfla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    if op == "simple_gla":
        return tfla.chunk_simple_gla(x["q"], x["k"], x["v"], g=x["g"], **kw)
    if op == "gla":
        return tfla.chunk_gla(x["q"], x["k"], x["v"], x["g"], **kw)
    return tfla.chunk_mlstm(x["q"], x["k"], x["v"], x["i"], x["f"], input_gate="exp", **kw)


def _flat(state) -> tuple:
    return tuple(state) if isinstance(state, (tuple, list)) else (state,)


def _fwd_bwd(op: str, x: dict, initial_state, do: torch.Tensor, dht: tuple, cu_seqlens=None):
    """Outputs, final state and the gradients of sum(o * do) + sum(final * dht) w.r.t. x and the state."""
    leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
    s0 = tuple(s.detach().requires_grad_() for s in _flat(initial_state))
    o, final = _run(op, leaves, s0 if len(s0) > 1 else s0[0], cu_seqlens)
    final = _flat(final)
    loss = (o.float() * do.float()).sum() + sum((f.float() * d).sum() for f, d in zip(final, dht) if d is not None)
    grads = torch.autograd.grad(loss, list(leaves.values()) + list(s0), allow_unused=True)
    names = list(leaves) + [f"d_s0_{i}" for i in range(len(s0))]
    return o.detach(), tuple(f.detach() for f in final), {n: gr for n, gr in zip(names, grads) if gr is not None}


def _assert_finite(name: str, t: torch.Tensor):
    bad = int((~torch.isfinite(t)).sum())
    assert bad == 0, f"{name}: {bad} non-finite values"


def _check(what: str, got: torch.Tensor, ref: torch.Tensor, tol: float = TOL):
    err = rel_l2(got.float(), ref.float())
    assert err <= tol, f"{what}: rel-L2 {err:.3e} > {tol:.0e}"


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS)
def test_dense_past_int32(op):
    _need(100 if op in ("gdn", "mlstm") else 80)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = _inputs(op, T_BIG, gen)
    s0 = _state(op, 1, gen)
    do = torch.randn(1, T_BIG, H, V, generator=gen, device="cuda").bfloat16()
    dht = tuple(torch.randn_like(s) if s.dim() > 2 else None for s in _flat(s0))  # no cotangent for m
    o, final, grads = _fwd_bwd(op, x, s0, do, dht)
    _assert_finite("o", o)
    for i, f in enumerate(final):
        _assert_finite(f"final_state[{i}]", f)
    for n, gr in grads.items():
        _assert_finite(n, gr)
    tail = slice(T_BIG - TAIL, T_BIG)
    o_tail = o[:, tail].clone()
    g_tail = {n: gr[:, tail].clone() for n, gr in grads.items() if not n.startswith("d_s0")}
    del o, grads
    with torch.no_grad():  # the state after the preceding tokens
        _, s_mid = _run(op, {n: t[:, :T_BIG - TAIL] for n, t in x.items()}, s0)
    xt = {n: t[:, tail].contiguous() for n, t in x.items()}
    o2, final2, grads2 = _fwd_bwd(op, xt, s_mid, do[:, tail].contiguous(), dht)
    _check("o (tail)", o2, o_tail)
    for i, (a, b) in enumerate(zip(final2, final)):
        _check(f"final_state[{i}]", a, b)
    for n in g_tail:
        _check(f"{n} (tail)", grads2[n], g_tail[n], 2 * TOL)


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS)
def test_varlen_past_int32(op):
    _need(100 if op in ("gdn", "mlstm") else 80)
    gen = torch.Generator(device="cuda").manual_seed(1)
    long = T_BIG - TAIL - 1
    cu = torch.tensor([0, long, long + 1, long + 1, T_BIG], device="cuda")  # [long, 1, 0, TAIL]
    x = _inputs(op, T_BIG, gen)
    s0 = _state(op, 4, gen)
    do = torch.randn(1, T_BIG, H, V, generator=gen, device="cuda").bfloat16()
    dht = tuple(torch.randn_like(s) if s.dim() > 2 else None for s in _flat(s0))
    o, final, grads = _fwd_bwd(op, x, s0, do, dht, cu_seqlens=cu)
    _assert_finite("o", o)
    for n, gr in grads.items():
        _assert_finite(n, gr)
    tail = slice(T_BIG - TAIL, T_BIG)
    xt = {n: t[:, tail].contiguous() for n, t in x.items()}
    s_last = tuple(s[3:4] for s in _flat(s0))
    o2, final2, grads2 = _fwd_bwd(op, xt, s_last if len(s_last) > 1 else s_last[0], do[:, tail].contiguous(),
                                  tuple(d[3:4] if d is not None else None for d in dht))
    _check("o (last sequence)", o2, o[:, tail])
    for i, (a, b) in enumerate(zip(final2, final)):
        _check(f"final_state[{i}] (last sequence)", a, b[3:4])
    for n in x:
        _check(f"{n} (last sequence)", grads2[n], grads[n][:, tail], 2 * TOL)
    for n in grads2:
        if n.startswith("d_s0"):
            _check(f"{n} (last sequence)", grads2[n], grads[n][3:4], 2 * TOL)


@pytest.mark.slow
def test_mlstm_step_past_int32():
    """The decoding step on a state of B * H * K * V = 2.31e9 elements equals the step on a slice of the batch."""
    _need(40)
    B, K, V = 4400, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(B, H, d, generator=gen, device="cuda").bfloat16() for d in (K, K, V))
    i, f = torch.randn(B, H, generator=gen, device="cuda"), torch.randn(B, H, generator=gen, device="cuda") + 3
    state = (torch.randn(B, H, K, V, generator=gen, device="cuda") * 0.1,
             torch.rand(B, H, K, generator=gen, device="cuda"), torch.zeros(B, H, device="cuda"))
    assert state[0].numel() > 2**31
    h, new = tfla.mlstm_step(q, k, v, i, f, state)
    _assert_finite("h", h)
    sl = slice(B - 8, B)
    h2, new2 = tfla.mlstm_step(q[sl], k[sl], v[sl], i[sl], f[sl], tuple(s[sl] for s in state))
    _check("h (last rows)", h2, h[sl])  # (batched products of another size round differently: not bitwise)
    for a, b in zip(new2, new):
        _check("state (last rows)", a, b[sl], 1e-5)


@pytest.mark.parametrize("op", OPS)
def test_many_sequences_past_grid_axis_limit(op):
    """N * H > 65,535 programs of one dimension (CUDA's limit on grid axes 1 and 2): 2,100 sequences of 1 to 64
    tokens, each equal to its own run (first, middle and last checked)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    N = 2100
    lens = torch.randint(1, 65, (N,), generator=gen, device="cuda")
    lens[5] = 0
    cu = F.pad(lens.cumsum(0), (1, 0))
    T = int(cu[-1])
    x = _inputs(op, T, gen)
    s0 = _state(op, N, gen)
    assert N * H > 65535
    with torch.no_grad():
        o, final = _run(op, x, s0, cu_seqlens=cu)
        for n in (0, N // 2, N - 1):
            a, b = int(cu[n]), int(cu[n + 1])
            xs = {name: t[:, a:b].contiguous() for name, t in x.items()}
            sn = tuple(s[n:n + 1] for s in _flat(s0))
            o2, f2 = _run(op, xs, sn if len(sn) > 1 else sn[0])
            _check(f"o (sequence {n})", o2, o[:, a:b])
            for a_, b_ in zip(_flat(f2), _flat(final)):
                _check(f"final state (sequence {n})", a_, b_[n:n + 1])


def test_large_batch_past_grid_axis_limit():
    """B * HV > 65,535 in the dense layout (GDN forward and backward against the first rows run alone)."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    B, T = 2100, 80
    x = {n: t.reshape(B, T, *t.shape[2:]) for n, t in _inputs("gdn", B * T, gen).items()}
    do = torch.randn(B, T, H, V, generator=gen, device="cuda").bfloat16()
    s0 = _state("gdn", B, gen)
    dht = (torch.randn_like(s0),)
    o, final, grads = _fwd_bwd("gdn", x, s0, do, dht)
    for rows in (slice(0, 2), slice(B - 2, B)):
        o2, f2, g2 = _fwd_bwd("gdn", {n: t[rows] for n, t in x.items()}, s0[rows], do[rows], (dht[0][rows],))
        _check("o", o2, o[rows])
        _check("final state", f2[0], final[0][rows])
        for n in x:
            _check(n, g2[n], grads[n][rows], 2 * TOL)
