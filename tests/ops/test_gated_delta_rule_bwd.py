"""Gradients of tfla.chunk_gated_delta_rule against autograd through the float64 recurrence.

Random cotangents for both outputs (o and the final state); relative L2 per gradient (dq, dk, dv,
dg, dbeta, d initial_state). fp32: ``tolerance(torch.float32)`` (1e-5 with IEEE dots on the interpreter, 3e-5
with tf32x3 on CUDA); float64: 1e-12 plus a gradcheck; fp16 on the CPU interpreter; bf16 on the GPU against FLA's
(and FlashQLA's) own errors on the same inputs.
"""
import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import tfla
from tfla.bench.inputs import gdn_inputs, random_cu_seqlens
from tfla.ops.common.precompile import in_dry_run
from tfla.ops.gated_delta_rule.reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref
from tfla.utils.testing import assert_rel_close, host_seconds_behind_sleep, rel_l2, tolerance

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
FP32_TOL = tolerance(torch.float32)  # 1e-5 IEEE on the interpreter; tf32x3 on CUDA (tfla.utils.testing)
FP16_TOL = 1e-2


def _grads(device, B, T, H, HV, K, V, dtype=torch.float32, gate="default", h0=True, final=True, seed=0,
           l2norm=False, cu_seqlens=None, num_seqs=None, save_states=False, save_v_new=True, segments=None,
           config=None):
    """tfla's and the float64 recurrence's gradients on the same (rounded) inputs and cotangents."""
    x = gdn_inputs(B, T, H, K, V, HV=HV, dtype=dtype, device=device, gate=gate, initial_state=h0, seed=seed,
                   num_seqs=num_seqs, gate_dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    if h0 and dtype == torch.float64:
        x["initial_state"] = x["initial_state"].double()
    if l2norm:
        x["k"] = (x["k"].float() * 3.0).to(dtype)
    names = ["q", "k", "v", "g", "beta"] + (["initial_state"] if h0 else [])
    leaves = [x[n].clone().requires_grad_() for n in names]
    h0_leaf = leaves[5] if h0 else None
    o, s = tfla.chunk_gated_delta_rule(*leaves[:5], initial_state=h0_leaf, output_final_state=final,
                                       use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu_seqlens,
                                       save_states=save_states, save_v_new=save_v_new, segments=segments,
                                       config=config)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(o.shape, generator=gen).to(device=device, dtype=o.dtype)
    loss = (o * do).sum()
    if final:
        dht = torch.randn(s.shape, generator=gen).to(device=device, dtype=s.dtype)
        loss = loss + (s * dht).sum()
    got = torch.autograd.grad(loss, leaves)

    # the float64 recurrence where the kernels ran (on a GPU it is far faster than on the host)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    rh0 = ref_leaves[5] if h0 else None
    ro, rs = recurrent_gated_delta_rule_ref(*ref_leaves[:5], initial_state=rh0, output_final_state=True,
                                            use_qk_l2norm_in_kernel=l2norm,
                                            cu_seqlens=cu_seqlens)
    rloss = (ro * do.double()).sum()
    if final:
        rloss = rloss + (rs * dht.double()).sum()
    ref = torch.autograd.grad(rloss, ref_leaves)
    return dict(zip(NAMES, got)), dict(zip(NAMES, ref))


def _spy(calls: list, real):
    """``real``, appending to ``calls`` on each call outside precompile's dry run (on a GPU the first call of a kind
    runs the op once as a dry run before the real call)."""
    def spied(*args, **kwargs):
        if not in_dry_run():
            calls.append(1)
        return real(*args, **kwargs)
    return spied


def _check(got, ref, tol):
    for name in got:
        assert_rel_close(name, got[name].detach().cpu(), ref[name], tol)


# (B, T, H, HV, K, V, gate, h0, final)
CASES = [
    (1, 1, 1, 1, 32, 32, "default", True, True),
    (2, 63, 1, 1, 32, 32, "default", True, True),
    (1, 65, 2, 2, 32, 16, "strong", False, True),
    (1, 130, 1, 2, 32, 32, "mixed", True, False),
    (1, 127, 1, 1, 32, 32, "default", True, True),
    (2, 200, 1, 2, 16, 32, "weak", True, True),
    (1, 300, 1, 1, 32, 32, "default", True, True),
    (1, 257, 2, 4, 16, 16, "zero", True, True),
    (1, 513, 1, 1, 16, 16, "default", False, True),
    (1, 150, 1, 1, 20, 24, "default", True, True),
    (1, 100, 2, 2, 48, 80, "strong", True, True),
    (1, 130, 1, 1, 100, 200, "default", True, True),
]


@pytest.mark.parametrize("B,T,H,HV,K,V,gate,h0,final", CASES)
def test_bwd_fp32_matches_recurrence(device, poison_empty, B, T, H, HV, K, V, gate, h0, final):
    got, ref = _grads(device, B, T, H, HV, K, V, gate=gate, h0=h0, final=final, seed=T)
    _check(got, ref, FP32_TOL)


@pytest.mark.parametrize("save_v_new", [False, True])
def test_bwd_float64_exact(device, save_v_new):
    if device == "cuda":
        pytest.skip("float64 verification runs through the interpreter")
    got, ref = _grads(device, 1, 150, 1, 2, 16, 16, dtype=torch.float64, seed=3, save_v_new=save_v_new)
    _check(got, ref, 1e-12)


def test_gradcheck_float64(device):
    if device == "cuda":
        pytest.skip("float64 verification runs through the interpreter")
    x = gdn_inputs(1, 70, 1, 16, 16, HV=2, dtype=torch.float64, gate_dtype=torch.float64, initial_state=True, seed=1)
    args = [x[n].clone().double().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]

    def f(q, k, v, g, b, h0):
        return tfla.chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True)

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=True)


@pytest.mark.parametrize("varlen", [False, True])
def test_bwd_save_states_matches_recurrence(device, poison_empty, varlen):
    """save_states: the backward uses the forward's W, Vnew and 64-row states instead of recomputing them."""
    T = 300
    cu = random_cu_seqlens(T, 3, seed=5, device=device) if varlen else None
    got, ref = _grads(device, 1, T, 2, 4, 32, 16, gate="strong", cu_seqlens=cu, num_seqs=3 if varlen else None,
                      seed=7, save_states=True)
    _check(got, ref, FP32_TOL)


def test_state_grad_summary_pass(device):
    """``chunk_state_bwd(store=False)`` (the first pass of the backward in pieces) returns the same initial-state
    gradient as the storing pass, writes neither dS nor dU, and refuses a call that would return nothing."""
    from tfla.ops.common.chunk_state_bwd import chunk_state_bwd

    gen = torch.Generator().manual_seed(11)
    B, T, H, HV, K, V = 2, 150, 1, 2, 16, 32
    q, k = (torch.randn(B, T, H, K, generator=gen).to(device) for _ in range(2))
    w = torch.randn(B, T, HV, K, generator=gen).to(device) * 0.1
    do = torch.randn(B, T, HV, V, generator=gen).to(device)
    g = (F.logsigmoid(torch.randn(B, T, HV, generator=gen) + 2) / math.log(2)).to(device)
    dht = torch.randn(B, HV, K, V, generator=gen).to(device)
    dh, du, dh0 = chunk_state_bwd(q, k, w, do, None, g, 0.5, 64, dht=dht, need_dh0=True)
    dh_, du_, dh0_ = chunk_state_bwd(q, k, w, do, None, g, 0.5, 64, dht=dht, need_dh0=True, store=False)
    assert dh_ is None and du_ is None and dh is not None and du is not None
    assert torch.equal(dh0_, dh0)
    with pytest.raises(ValueError, match="store=False"):
        chunk_state_bwd(q, k, w, do, None, g, 0.5, 64, dht=dht, store=False)
    with pytest.raises(ValueError, match="store=False"):  # linear attention (w None) has no summary pass
        chunk_state_bwd(q, k, None, do, do, g, 0.5, 64, need_dh0=True, store=False)
    # the delta rule's kernel takes 64-row chunks with dvo formed inside and a scalar gate only
    with pytest.raises(ValueError, match="delta rule"):
        chunk_state_bwd(q, k, w, do, do, g, 0.5, 64)
    with pytest.raises(ValueError, match="delta rule"):
        chunk_state_bwd(q, k, w, do, None, g, 0.5, 128)
    # linear attention's vector-gate kernel (GLA) takes no scalar gate beside it
    gv = g[..., None].expand(B, T, HV, K).contiguous()
    with pytest.raises(ValueError, match="gv_cum"):
        chunk_state_bwd(q, k, None, do, do, g, 0.5, 64, gv_cum=gv)


@pytest.mark.parametrize("segments,varlen,h0,final,gate,mn_BV", [(2, False, True, True, "weak", None),
                                                                 (4, False, False, True, "zero", None),
                                                                 (3, True, True, True, "weak", None),
                                                                 (3, True, False, False, "mixed", None),
                                                                 (4, False, True, True, "strong", None),
                                                                 (2, True, True, True, "strong", 16)])
def test_bwd_in_pieces_matches_recurrence(device, poison_empty, monkeypatch, segments, varlen, h0, final, gate,
                                          mn_BV):
    """A forward cut into pieces runs the backward's state-gradient chain in the same pieces (two passes
    and a reverse scan); every gradient still matches the recurrence: dense with T not a multiple of 64 and B = 2,
    varlen with empty, one-token and multi-piece sequences, with and without the initial state and the final
    state's cotangent, grouped value heads; weak and zero gates (with strong ones a piece's transition M is ~0 and
    the scan's terms would not be checked), mixed ones (zero on half the heads) and strong ones, where the transition
    pass leaves out each piece's chunks whose state decays below e^-80 before its end, the backward's summary pass
    runs only the chunks whose map to the piece's start stays above it (``piece_cutoffs``), and the reverse scan
    takes the shorter transition (with 16-column transition tiles, M = 0 for the cut pieces: the scans skip them)."""
    import tfla.ops.common.fused_delta_fwd as fdf
    import tfla.ops.gated_delta_rule.chunk as chunk

    calls = []  # the real backward's calls (on a GPU the first call of a kind runs a dry run before it)
    real = chunk._state_grad_in_pieces
    monkeypatch.setattr(chunk, "_state_grad_in_pieces", _spy(calls, real))
    tables = []
    real_cut = fdf.piece_cutoffs
    monkeypatch.setattr(fdf, "piece_cutoffs", lambda *a: tables.append((real_cut(*a), a[1])) or tables[-1][0])
    T = 300
    cu = torch.tensor([0, 0, 1, 130, T], device=device) if varlen else None
    got, ref = _grads(device, 1 if varlen else 2, T, 2, 4, 32, 16, gate=gate, h0=h0, final=final,
                      cu_seqlens=cu, num_seqs=4 if varlen else None, seed=segments, segments=segments,
                      config={"fused": {"mn_BV": mn_BV}} if mn_BV else None)
    assert calls == [1]
    if gate == "strong":  # a chunk decays past e^-80: the pieces of two chunks or more leave some out both ways
        (warm, keep), offsets = tables[-1]
        chunks = (offsets[1:] - offsets[:-1]).repeat_interleave(4)  # per (piece, head), HV = 4
        assert ((chunks >= 2) & (warm > 0) & (keep < chunks)).any()
    _check(got, ref, FP32_TOL)


@pytest.mark.parametrize("save_v_new", [False, True])
@pytest.mark.parametrize("varlen,gate", [(False, "strong"), (True, "strong"), (True, "mixed")])
def test_bwd_save_v_new_both_ways(device, poison_empty, varlen, gate, save_v_new):
    """Vnew kept from the forward (the states rebuilt by the linear pass over Vnew) and recomputed with the states
    by the forward's pass run again (FLA's saved set): both match the recurrence, with varlen, grouped value heads,
    an initial state and T not a multiple of 64."""
    T = 300
    cu = random_cu_seqlens(T, 3, seed=11, device=device) if varlen else None
    got, ref = _grads(device, 1, T, 2, 4, 32, 16, gate=gate, cu_seqlens=cu, num_seqs=3 if varlen else None,
                      seed=9, save_v_new=save_v_new)
    _check(got, ref, FP32_TOL)


@pytest.mark.parametrize("segments", [1, 3])
@pytest.mark.parametrize("varlen", [False, True])
def test_bwd_without_v_new_equals_save_states(device, varlen, segments):
    """Without Vnew kept the backward runs the forward's pass again for Vnew and the 64-row states, the pair
    ``save_states`` keeps: the gradients equal save_states' bitwise (gate and beta activations, l2norm, grouped value
    heads, initial state, a final-state cotangent); with the sequences cut into pieces, over the same pieces from
    their start states (the forward keeps those, not the states)."""
    T = 150
    cu = torch.tensor([0, 1, 64, 64, T], device=device) if varlen else None
    x = gdn_inputs(1 if varlen else 2, T, 1, 32, 16, HV=2, dtype=torch.float32, device=device, initial_state=True,
                   num_seqs=4 if varlen else None, seed=21)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                A_log=torch.tensor([0.3, 1.2], device=device), dt_bias=torch.tensor([0.5, -0.5], device=device))
    runs = []
    for kw in (dict(save_v_new=False), dict(save_states=True)):
        leaves = [x[n].clone().requires_grad_() for n in names]
        o, s = tfla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                           cu_seqlens=cu, segments=segments, **opts, **kw)
        if kw.get("save_v_new") is False:  # what the forward kept beyond FLA's set: the pieces' starts alone
            assert len([t for t in o.grad_fn.saved_tensors if t is not None and t.shape == x["v"].shape]) == 1  # v
            assert (o.grad_fn.split is not None) == (segments > 1)
        gen = torch.Generator().manual_seed(0)
        do, ds = torch.randn(o.shape, generator=gen).to(o), torch.randn(s.shape, generator=gen).to(s)
        runs.append(torch.autograd.grad((o * do).sum() + (s * ds).sum(), leaves))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_save_v_new_keeps_what_it_says(device):
    """The forward saves Vnew exactly when asked (one tensor of v's shape and dtype more among the saved ones)."""
    x = gdn_inputs(1, 100, 1, 16, 16, HV=2, dtype=torch.float32, device=device)
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    counts = {}
    for flag in (False, True):
        o, _ = tfla.chunk_gated_delta_rule(*leaves, save_v_new=flag)
        saved = o.grad_fn.saved_tensors
        counts[flag] = [t for t in saved if t is not None and t.shape == x["v"].shape]
    assert len(counts[True]) == len(counts[False]) + 1
    with pytest.raises(TypeError, match="save_v_new"):
        tfla.chunk_gated_delta_rule(*leaves, save_v_new="yes")


def test_backward_slab_rule(device):
    """The backward's slab in 64-row chunks (0: whole sequences): two slabs by default for dense sequences and FLA's
    saved set where the backward holds at least 8192 64-row states (chunks of all sequences times value heads) and
    each slab at least 32 chunks; whole sequences with Vnew kept or packed sequences, ``config["slab"]``'s ``chunks``
    or ``count`` (slabs of the longest sequence) otherwise; bad values raise before any launch."""
    from tfla.ops.common.fused_delta_fwd import SAVE_NONE, SAVE_V_NEW
    from tfla.ops.common.varlen import VarlenIndex
    from tfla.ops.gated_delta_rule.chunk import _chunk_counts, _slab_chunks

    assert _chunk_counts(4, 8192, 16, None) == (128, 8192)
    cu = torch.tensor([0, 100, 100, 4196, 4197])
    assert _chunk_counts(1, 4197, 32, VarlenIndex.build(cu, 64)) == (64, (2 + 64 + 1) * 32)
    assert _slab_chunks(None, SAVE_NONE, 512, 4 * 512 * 16) == 256
    assert _slab_chunks(None, SAVE_NONE, 128, 8 * 128 * 16) == 64
    assert _slab_chunks(None, SAVE_NONE, 128, 4 * 128 * 16) == 64  # the MVE: 8192 states
    assert _slab_chunks(None, SAVE_NONE, 128, 2 * 128 * 16) == 0  # 4096 states: whole
    assert _slab_chunks(None, SAVE_NONE, 64, 20000) == 32
    assert _slab_chunks(None, SAVE_NONE, 63, 20000) == 0  # not two slabs of 32 chunks
    assert _slab_chunks(None, SAVE_V_NEW, 512, 4 * 512 * 16) == 0
    assert _slab_chunks({"slab": {"count": 1}}, SAVE_NONE, 512, 4 * 512 * 16) == 0
    assert _slab_chunks({"slab": {"count": 3}}, SAVE_NONE, 128, 128) == 43
    assert _slab_chunks({"slab": {"count": 3}}, SAVE_V_NEW, 128, 128) == 43
    assert _slab_chunks({"slab": {"count": 4}}, SAVE_NONE, 96, 96) == 0  # 24 chunks a slab: too few
    assert _slab_chunks({"slab": {"chunks": 5}}, SAVE_NONE, 10, 10) == 5
    assert _slab_chunks(None, SAVE_NONE, 512, 4 * 512 * 16, packed=True) == 0  # packed: where the config asks
    assert _slab_chunks({"slab": {"count": 2}}, SAVE_NONE, 200, 200, packed=True) == 100
    x = gdn_inputs(1, 64, 1, 16, 16, dtype=torch.float32, device=device, seed=0)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    for bad in ({"count": -1}, {"chunks": 2.0}, {"count": True}, {"slabs": 2}):
        with pytest.raises(ValueError, match="slab"):
            tfla.chunk_gated_delta_rule(*args, config={"slab": bad})


def test_slab_tables():
    """The backward's slab tables: slab j holds chunks ``[j n, (j + 1) n)`` of each sequence as a (first row, end row)
    pair (empty where the sequence is shorter), each part's first state slot and the (part, chunk) table; every
    64-row chunk of every sequence lands in exactly one slab."""
    from tfla.ops.gated_delta_rule.chunk import _slab_tables

    bounds = (0, 0, 1, 701, 831, 1831)  # lengths 0, 1, 700, 130, 1000
    tables = _slab_tables(bounds, 3, torch.device("cpu"))
    assert len(tables) == 6  # the longest: 16 chunks
    seen = set()
    for j, (pairs, offs, tiles, nch) in enumerate(tables):
        assert pairs.dtype == offs.dtype == tiles.dtype == torch.int32
        assert tiles.shape == (nch, 2)
        for i, (b, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            r0, r1 = pairs[i].tolist()
            assert (r0, r1) == (min(b + 192 * j, e), min(b + 192 * (j + 1), e))
            mine = [c for s, c in tiles.tolist() if s == i]
            assert mine == list(range(-(-(r1 - r0) // 64)))
            if mine:
                assert tiles[offs[i]].tolist() == [i, 0]
            seen |= {(i, 3 * j + c) for c in mine}
    assert seen == {(i, c) for i, (b, e) in enumerate(zip(bounds[:-1], bounds[1:])) for c in range(-(-(e - b) // 64))}
    dense = _slab_tables((0, 640, 1280), 4, torch.device("cpu"))
    assert [t[3] for t in dense] == [8, 8, 4]
    assert dense[2][0].tolist() == [[512, 640], [1152, 1280]] and dense[1][1].tolist() == [0, 4]


def test_fused_paths_reject_what_they_do_not_serve(device):
    from tfla.ops.common.chunk_output import chunk_tiled
    from tfla.ops.common.chunk_state_bwd import chunk_state_bwd

    x = gdn_inputs(1, 128, 1, 16, 16, device=device)
    q, k, v = x["q"], x["k"], x["v"]
    with pytest.raises(ValueError, match="dvo=None"):  # the in-kernel dvo serves one 64-row tile per chunk
        chunk_state_bwd(q, k, None, v, None, x["g"], 1.0, 128)
    with pytest.raises(ValueError, match="dual_dtype"):  # dq + dk in one launch: one diagonal tile per chunk
        chunk_tiled(v, v, k, x["g"], 1.0, 128, rowdot_with=q, dual_dtype=torch.float32)


def test_bwd_varlen_matches_recurrence_per_sequence(device, poison_empty):
    T = 400
    cu = random_cu_seqlens(T, 4, seed=64, device=device)
    got, ref = _grads(device, 1, T, 2, 4, 32, 16, cu_seqlens=cu, num_seqs=4, seed=64)
    _check(got, ref, FP32_TOL)


@pytest.mark.parametrize("HV", [1, 2])
def test_bwd_l2norm_in_kernel(device, HV):
    """l2norm inside the op: its backward in the GVA sum's pass (HV > H) or its own pass (HV = H)."""
    got, ref = _grads(device, 1, 100, 1, HV, 32, 32, l2norm=True, seed=5)
    _check(got, ref, FP32_TOL)


def test_bwd_fp16(device):
    got, ref = _grads(device, 1, 150, 1, 1, 32, 32, dtype=torch.float16, seed=6)
    assert got["dq"].dtype == torch.float16 and got["dh0"].dtype == torch.float32
    _check(got, ref, FP16_TOL)


def test_bwd_strong_gates_long_sequence_finite(device):
    """Strong decay over many chunks: every gradient finite and accurate (no overflow to NaN).

    dg is the one gradient held to 2e-5 here: under strong decay the chunkwise gate gradient is a
    reverse cumsum of near-cancelling row/column terms (float64 shows ~20x eps amplification; fp32
    measures 1.2e-5 at this shape). The diagonal terms are already kept out (chunk_output ROWDOT)."""
    got, ref = _grads(device, 1, 700, 1, 1, 16, 16, gate="strong", seed=7)
    _check({n: t for n, t in got.items() if n != "dg"}, ref, FP32_TOL)
    assert_rel_close("dg", got["dg"].detach().cpu(), ref["dg"], 2e-5)


def test_bwd_rejects_modified_saved_tensor(device):
    x = gdn_inputs(1, 40, 1, 16, 16, dtype=torch.float32, device=device)
    q = x["q"].clone().requires_grad_()
    k = x["k"].clone()
    o, _ = tfla.chunk_gated_delta_rule(q, k, x["v"], x["g"], x["beta"])
    k.mul_(2.0)  # a tensor the backward pass needs, modified in place
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()


def test_bwd_rejects_bad_cotangents(device):
    """A cotangent of the wrong shape raises; one of another dtype is cast to the output's dtype by
    autograd before tfla sees it, giving the same gradients as the matching dtype."""
    x = gdn_inputs(1, 40, 1, 16, 16, dtype=torch.float32, device=device, initial_state=True)
    q = x["q"].clone().requires_grad_()

    def run():
        return tfla.chunk_gated_delta_rule(q, x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                           output_final_state=True)

    o, s = run()
    with pytest.raises((RuntimeError, ValueError), match="shape"):
        torch.autograd.grad(o, q, grad_outputs=torch.ones(1, 40, 1, 8, device=device))
    o, s = run()
    ones = torch.ones_like(o)
    (a,) = torch.autograd.grad(o, q, grad_outputs=ones.double(), retain_graph=True)
    (b,) = torch.autograd.grad(o, q, grad_outputs=ones)
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,HV,K,V", [(1, 300, 2, 2, 128, 128), (1, 300, 1, 2, 128, 128),
                                          (1, 200, 1, 1, 100, 200), (1, 150, 1, 1, 256, 256)])
def test_bwd_fp32_gpu_shapes(B, T, H, HV, K, V):
    # (short T: the float64 recurrence with autograd runs on the host CPU)
    got, ref = _grads("cuda", B, T, H, HV, K, V, seed=T)
    _check(got, ref, FP32_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("K,V", [(16, 32), (32, 16), (16, 16)])
@pytest.mark.parametrize("save_v_new", [False, True])
def test_bwd_16bit_head_dim_16_gpu(dtype, K, V, save_v_new):
    """16-bit inputs with head dims of 16: every tile entering a dot is at least 32 wide (``dot_tile``). With 16-wide
    tiles dk (K = 16) and dv, dbeta (V = 16) came out wrong on an H100 under Triton 3.6 (rel-L2 ~1, 2026-11-24).
    Gradients against the float64 reference within a 16-bit tolerance (measured fine: ~5e-4 fp16, ~4e-3 bf16)."""
    x = gdn_inputs(1, 300, 1, K, V, HV=2, dtype=dtype, device="cuda", initial_state=True, seed=K + V + save_v_new)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    gen = torch.Generator(device="cuda").manual_seed(K + V)
    do = torch.randn(1, 300, 2, V, device="cuda", generator=gen).to(dtype)

    def grads(fn, up=False):
        leaves = [(x[n].double() if up else x[n]).clone().requires_grad_() for n in names]
        o, s = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True)
        return torch.autograd.grad((o * do.to(o.dtype)).sum() + s.sum(), leaves)

    ref = grads(lambda *a, **kw: chunk_gated_delta_rule_ref(*a, chunk_size=64, **kw), up=True)
    got = grads(lambda *a, **kw: tfla.chunk_gated_delta_rule(*a, save_v_new=save_v_new, **kw))
    tol = 3e-3 if dtype == torch.float16 else 2e-2
    for name, a, r in zip(NAMES, got, ref):
        assert_rel_close(name, a.double().cpu(), r.cpu(), tol)


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("segments", [1, 4])
def test_bwd_deterministic(segments, varlen):
    """Two backward passes on the same inputs give bitwise-identical gradients (no atomics), in one chain and with
    the forward and the state-gradient chain cut into pieces, dense and packed varlen (an empty and a one-token
    sequence among them)."""
    cu = torch.tensor([0, 1, 1, 1500, 4096], device="cuda") if varlen else None
    x = gdn_inputs(1 if varlen else 2, 4096 if varlen else 2048, 4, 128, 128, dtype=torch.bfloat16, device="cuda",
                   initial_state=True, num_seqs=4 if varlen else None, seed=segments)
    outs = []
    for _ in range(2):
        leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]
        o, s = tfla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                           cu_seqlens=cu, segments=segments)
        outs.append(torch.autograd.grad((o.float() * 0.01).sum() + s.sum(), leaves))
    for name, a, b in zip(NAMES, *outs):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("segments", [1, 4])
@pytest.mark.parametrize("varlen", [False, True])
def test_bwd_without_v_new_equals_save_states_bf16(varlen, segments):
    """On Hopper (bf16, K = V = 128: the Gluon pass) the backward's recomputation without Vnew (the pass without its
    output, ``PASS_STATES``) gives the Vnew and states ``save_states`` keeps, so the gradients are bitwise equal; in
    one chain per sequence and over the forward's pieces from their start states."""
    T = 1000
    cu = torch.tensor([0, 1, 300, 300, T], device="cuda") if varlen else None
    x = gdn_inputs(1 if varlen else 2, T, 2, 128, 128, HV=4, dtype=torch.bfloat16, device="cuda",
                   initial_state=True, num_seqs=4 if varlen else None, seed=5 + varlen)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    runs = []
    for kw in (dict(save_v_new=False), dict(save_states=True)):
        leaves = [x[n].clone().requires_grad_() for n in names]
        o, s = tfla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                           cu_seqlens=cu, segments=segments, use_qk_l2norm_in_kernel=True, **kw)
        gen = torch.Generator(device="cuda").manual_seed(1)
        do = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
        ds = torch.randn(s.shape, device="cuda", generator=gen)
        runs.append(torch.autograd.grad((o * do).sum() + (s * ds).sum(), leaves))
    for name, a, b in zip(NAMES, *runs):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("save_v_new", [False, True])
@pytest.mark.parametrize("gate", ["default", "strong"])
def test_bwd_bf16_no_worse_than_fla(save_v_new, gate):
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    os.environ["FLA_FLASH_QLA"] = "0"
    x = gdn_inputs(2, 2048, 4, 128, 128, dtype=torch.bfloat16, device="cuda", gate=gate, initial_state=True,
                   seed=64 + save_v_new)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    gen = torch.Generator(device="cuda").manual_seed(0)
    do = torch.randn(2, 2048, 4, 128, device="cuda", generator=gen).bfloat16()
    dht = torch.randn(2, 4, 128, 128, device="cuda", generator=gen)

    def grads(fn, upcast=False):
        leaves = [(x[n].float() if upcast else x[n]).clone().requires_grad_() for n in names]
        o, s = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True)
        return torch.autograd.grad((o * do.to(o.dtype)).sum() + (s * dht).sum(), leaves)

    tf = grads(lambda *a, **kw: tfla.chunk_gated_delta_rule(*a, save_v_new=save_v_new, **kw))
    try:
        fl = grads(fla.chunk_gated_delta_rule)
    except RuntimeError as e:  # FLA 0.6.0 refuses its gated backward on Hopper with Triton < 3.7.1
        if "tilelang" not in str(e):
            raise
        pytest.skip(f"FLA's backward refuses here: {str(e)[:100]}")
    # float32 reference: autograd through the pure-PyTorch chunkwise reference (no Triton)
    ref = grads(lambda *a, **kw: chunk_gated_delta_rule_ref(*a, chunk_size=64, **kw), upcast=True)
    for name, a, b, r in zip(NAMES, tf, fl, ref):
        e_t, e_f = rel_l2(a, r), rel_l2(b, r)
        print(f"bf16 bwd save_v_new={save_v_new} gate={gate} {name}: tfla {e_t:.3e} | FLA {e_f:.3e}")
        assert e_t <= 1.1 * e_f + 1e-4, name


def qwen3_next_gates(B, T, HV, device, gen, zero_heads=0.25):
    """Gates as Qwen3-Next's GatedDeltaNet layer forms them: ``g = -exp(A_log) * softplus(a + dt_bias)`` with
    ``A_log = log U(1, 16)`` and ``dt_bias`` the inverse softplus of ``dt = exp(U(log 1e-3, log 1e-1))`` per head
    (Mamba-2's initialisation), ``a ~ N(0, 1)`` per token; ``zero_heads`` of the heads get g = 0 (no decay).
    Returns g ``[B, T, HV]`` fp32 (natural log, <= 0; per-token decays down to about e^-4)."""
    a_log = torch.log(torch.empty(HV, device=device).uniform_(1.0, 16.0, generator=gen))
    dt = torch.exp(torch.empty(HV, device=device).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    a = torch.randn(B, T, HV, device=device, generator=gen)
    g = -torch.exp(a_log) * F.softplus(a + dt_bias)
    g[..., : int(round(HV * zero_heads))] = 0.0
    return g


@pytest.mark.gpu
def test_bwd_bf16_realistic_gates_vs_peers():
    """bf16 gradients with Qwen3-Next-style gates (GVA, initial state, T not a multiple of 64) against the float64
    recurrence (the chunked PyTorch reference in float64): every gradient within 1.1x of the best of FLA and
    FlashQLA where they are installed (FLA with ``FLA_FLASH_QLA=0``, its own kernels). Prints all errors.
    (H100, 2026-11-24, 45bb54d: dg 4.53e-3 vs FlashQLA 4.18e-3 and FLA 4.36e-3, 1.08x; dq 4.20e-3 and dk 5.10e-3 vs
    FlashQLA's 4.08e-3 and 4.93e-3; the others below both peers; docs/performance.md.)"""
    peers = {}
    try:
        import fla.ops.gated_delta_rule as fla_gdn
        peers["FLA"] = fla_gdn.chunk_gated_delta_rule
    except ImportError:
        pass
    try:
        import flash_qla
        peers["FlashQLA"] = flash_qla.chunk_gated_delta_rule
    except ImportError:
        pass
    if not peers:
        pytest.skip("neither FLA nor FlashQLA is installed")
    os.environ["FLA_FLASH_QLA"] = "0"
    B, T, H, HV, K, V = 2, 2085, 4, 8, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(64)
    x = gdn_inputs(B, T, H, K, V, HV=HV, dtype=torch.bfloat16, device="cuda", initial_state=True, seed=64)
    x["g"] = qwen3_next_gates(B, T, HV, "cuda", gen)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    do = torch.randn(B, T, HV, V, device="cuda", generator=gen).bfloat16()
    dht = torch.randn(B, HV, K, V, device="cuda", generator=gen)

    def grads(fn, upcast=False):
        leaves = [(x[n].double() if upcast else x[n]).clone().requires_grad_() for n in names]
        o, s = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True)
        return torch.autograd.grad((o * do.to(o.dtype)).sum() + (s * dht.to(s.dtype)).sum(), leaves)

    ref = grads(lambda *a, **kw: chunk_gated_delta_rule_ref(*a, chunk_size=64, **kw), upcast=True)
    errs = {"tfla": [rel_l2(a, r) for a, r in zip(grads(tfla.chunk_gated_delta_rule), ref)]}
    for peer, fn in peers.items():
        try:
            errs[peer] = [rel_l2(a, r) for a, r in zip(grads(fn), ref)]
        except RuntimeError as e:  # FLA 0.6.0 refuses its gated backward on Hopper with Triton < 3.7.1
            if "tilelang" not in str(e):
                raise
    if len(errs) == 1:
        pytest.skip("no peer's backward runs here")
    missed = []
    for i, name in enumerate(NAMES):
        best = min(e[i] for p, e in errs.items() if p != "tfla")
        print(f"bf16 realistic gates {name}: " + " | ".join(f"{p} {e[i]:.3e}" for p, e in errs.items()))
        if errs["tfla"][i] > 1.1 * best:
            missed.append(f"{name}: tfla {errs['tfla'][i]:.3e} > 1.1 x best peer {best:.3e}")
    assert not missed, "; ".join(missed)


def test_kept_v_new_rebuilds_the_forward_states(device):
    """With Vnew kept (``save_v_new=True``) the backward's linear pass over the stored Vnew rebuilds the fused
    forward's states (the forward puts the gate's weights on K, so both products take Vnew as stored): bitwise on
    the CPU interpreter, fp16 with Qwen3-Next-style gates. Both backward paths (kept Vnew, or the delta rule's chain
    recomputed) then agree to fp16 rounding."""
    from tfla.ops.common.chunk_state import chunk_state_fwd
    from tfla.ops.common.fused_delta_fwd import fused_delta_fwd

    gen = torch.Generator(device=device).manual_seed(3)
    x = gdn_inputs(1, 200, 1, 32, 32, HV=4, dtype=torch.float16, device=device, initial_state=True, seed=3)
    x["g"] = qwen3_next_gates(1, 200, 4, device, gen)
    fwd = fused_delta_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.2, x["initial_state"], True, save=2)
    h, _ = chunk_state_fwd(x["k"], fwd["v_new"], fwd["g_cum"], 64, initial_state=x["initial_state"],
                              store_every_sub_chunk=True, key_weights=True)
    if device == "cpu":
        assert torch.equal(h, fwd["h"])
    else:
        assert_rel_close("h", h.float().cpu(), fwd["h"].float().cpu(), 1e-3)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    do = torch.randn(1, 200, 4, 32, generator=gen, device=device).half()
    outs = []
    for keep in (True, False):
        leaves = [x[n].clone().requires_grad_() for n in names]
        o, s = tfla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                           save_v_new=keep)
        outs.append(torch.autograd.grad((o * do).sum() + s.sum(), leaves))
    for name, a, b in zip(NAMES, *outs):
        assert_rel_close(name, a.float().cpu(), b.float().cpu(), 5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("keep", [True, False], ids=["save_v_new", "fla_saved_set"])
@pytest.mark.parametrize("B,T,H,HV,l2norm,h0,lens", [
    (2, 1000, 2, 4, False, True, None), (1, 640, 2, 2, True, False, None), (2, 512, 1, 1, False, True, None),
    (3, 1000, 2, 2, False, False, None), (1, 2031, 2, 4, False, True, (0, 1, 700, 130, 1000, 200)),
    (1, 1344, 1, 1, True, False, (640, 0, 704))])
def test_bwd_in_slabs_gpu(monkeypatch, B, T, H, HV, l2norm, h0, lens, keep):
    """The Hopper backward one slab of 64-row chunks at a time (``config={"slab": {"chunks": 3}}``: slabs of 192
    rows, the last one cut when T is not a multiple of 64), with Vnew kept (the states rebuilt over it) and with
    FLA's saved set (the forward's pass again per slab, dq over the slab's Vnew), against the whole-sequence backward
    (``chunks`` 0) and the fp32 reference, bf16, GVA, l2norm, with and without the initial state, a cotangent for
    the final state, dense and packed (``lens``: empty and one-token sequences, ones inside the first slab, ones
    ending on a slab's border); the slab path runs (spied) and gives bitwise equal gradients twice."""
    from tfla.ops.gated_delta_rule import chunk as gdn_chunk

    calls = []
    real = gdn_chunk._ws_bwd_in_slabs
    monkeypatch.setattr(gdn_chunk, "_ws_bwd_in_slabs", _spy(calls, real))
    N = len(lens) if lens else B
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), device="cuda") if lens else None
    assert cu is None or cu[-1].item() == T
    x = gdn_inputs(B, T, H, 128, 128, HV=HV, dtype=torch.bfloat16, device="cuda", initial_state=h0, num_seqs=N,
                   seed=T + HV)
    names = ("q", "k", "v", "g", "beta") + (("initial_state",) if h0 else ())
    gen = torch.Generator(device="cuda").manual_seed(T)
    do = torch.randn(B, T, HV, 128, device="cuda", generator=gen).bfloat16()
    dht = torch.randn(N, HV, 128, 128, device="cuda", generator=gen)

    def grads(chunks, up=False):
        leaves = [(x[n].float() if up else x[n]).clone().requires_grad_() for n in names]
        fn = (lambda *a, **kw: chunk_gated_delta_rule_ref(*a, chunk_size=64, **kw)) if up else (
            lambda *a, **kw: tfla.chunk_gated_delta_rule(*a, config={"slab": {"chunks": chunks}}, save_v_new=keep,
                                                         segments=1, **kw))
        o, s = fn(*leaves[:5], initial_state=leaves[5] if h0 else None, output_final_state=True,
                  use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu)
        return torch.autograd.grad((o * do.to(o.dtype)).sum() + (s * dht).sum(), leaves)

    whole = grads(0)
    assert not calls
    slabs = grads(3)
    assert len(calls) == 1
    again = grads(3)
    ref = grads(0, up=True)
    for name, a, w, b, r in zip(NAMES, slabs, whole, again, ref):
        assert torch.equal(a, b), name
        assert rel_l2(a, w) <= 2e-3, (name, rel_l2(a, w))
        assert rel_l2(a, r) <= 1.05 * rel_l2(w, r) + 1e-4, (name, rel_l2(a, r), rel_l2(w, r))


@pytest.mark.gpu
@pytest.mark.parametrize("keep", [True, False], ids=["save_v_new", "fla_saved_set"])
def test_bwd_in_slabs_holds_less_gpu(monkeypatch, keep):
    """The point of the slabs: the peak memory of forward + backward drops by most of the 64-row states and their
    gradients (B = 2, T = 8192, H = 8, K = V = 128, bf16: 2 x 64 MiB of them at once for whole sequences, a quarter
    with slabs of 32 chunks), with Vnew kept and with FLA's saved set."""
    from tfla.ops.gated_delta_rule import chunk as gdn_chunk

    calls = []
    real = gdn_chunk._ws_bwd_in_slabs
    monkeypatch.setattr(gdn_chunk, "_ws_bwd_in_slabs", _spy(calls, real))
    x = gdn_inputs(2, 8192, 8, 128, 128, dtype=torch.bfloat16, device="cuda", seed=3)
    do = torch.randn_like(x["v"])

    def peak(chunks):
        leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        # (one chain: at 16 heads per sequence the automatic split would cut them into pieces, which keep their states)
        o, _ = tfla.chunk_gated_delta_rule(*leaves, config={"slab": {"chunks": chunks}}, segments=1,
                                           save_v_new=keep)
        torch.autograd.grad(o, leaves, do)
        return (torch.cuda.max_memory_allocated() - base) / 2 ** 20

    states = 2 * 2 * 128 * 8 * 128 * 128 * 2 / 2 ** 20  # h and dh: B x chunks x HV x K x V bf16, MiB
    whole = peak(0)
    slabs = peak(32)
    assert calls == [1]
    print(f"peak MiB: whole sequences {whole:.0f}, slabs {slabs:.0f} (states and gradients {states:.0f})")
    assert slabs <= whole - 0.6 * states, (whole, slabs, states)


def test_state_pass_over_row_pairs(device):
    """The backward's slabs as (first row, end row) pairs (``utils.varlen_mode`` 2): the state pass over Vnew run
    over chunks 2..4 of each sequence from the state at chunk 2 gives the whole pass's states there (the last pair
    cut by the sequence's end)."""
    from tfla.ops.common.chunk_state import chunk_state_fwd
    from tfla.ops.common.cumsum import chunk_local_cumsum
    from tfla.ops.common.utils import RCP_LN2

    B, T, HV, K, V = 2, 300, 2, 32, 16
    x = gdn_inputs(B, T, 1, K, V, HV=HV, dtype=torch.float32, device=device, initial_state=True, seed=5)
    gc = chunk_local_cumsum(x["g"], 64, scale=RCP_LN2)
    kw = dict(store_every_sub_chunk=True, key_weights=True)
    h, _ = chunk_state_fwd(x["k"], x["v"], gc, 64, initial_state=x["initial_state"], **kw)
    flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (x["k"], x["v"], gc)]
    pairs = torch.tensor([[b * T + 128, b * T + T] for b in range(B)], dtype=torch.int32, device=device)
    offs = torch.tensor([0, 3], dtype=torch.int32, device=device)
    hp, _ = chunk_state_fwd(*flat, 64, initial_state=h[:, 2].contiguous(), cu_seqlens=pairs, chunk_offsets=offs,
                               num_chunks=6, **kw)
    torch.testing.assert_close(hp.view(B, 3, HV, K, V), h[:, 2:5], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_backward_in_a_fresh_process():
    """The first backward of a fresh process, on autograd's device thread, whose first CUDA work is then a Gluon
    launch (Hopper): Triton encodes the launch's TMA descriptors before its launcher makes a CUDA context current on
    that thread, which raised "invalid device context" (H200, Triton 3.6, 2026-11-29) until the Gluon wrappers made
    the context current themselves (``fused_delta_ws.context_current``). Run in a subprocess: in this one an earlier
    test may have done CUDA work on that thread already."""
    code = (
        "import torch, tfla\n"
        "q, k, v = (torch.randn(2, 256, 2, 128, device='cuda', dtype=torch.bfloat16, requires_grad=True) "
        "for _ in range(3))\n"
        "g = torch.nn.functional.logsigmoid(torch.randn(2, 256, 2, device='cuda')).requires_grad_()\n"
        "beta = torch.rand(2, 256, 2, device='cuda').requires_grad_()\n"
        "o, _ = tfla.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)\n"
        "grads = torch.autograd.grad(o, (q, k, v, g, beta), torch.randn_like(o))\n"
        "assert all(bool(x.isfinite().all()) for x in grads)\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["default", "save_states", "pieces", "varlen_gva_l2norm"])
def test_call_does_not_wait_for_the_device(case):
    """A forward + backward call queues its kernels without waiting for the device (no host read of a device tensor,
    no copy from pageable memory, both of which wait for every kernel queued before): behind a ~200 ms sleep kernel a
    repeated call's host time stays far below 200 ms. A wait there would leave the GPU idle while the host prepares
    the next launches (H200, 2026-11-28, 7a41b1e: 3.8 ms of host time for the MVE's call behind that sleep)."""
    varlen = case == "varlen_gva_l2norm"
    cu = torch.tensor([0, 1, 700, 700, 2048], device="cuda") if varlen else None
    x = gdn_inputs(1 if varlen else 2, 2048, 2, 128, 128, HV=4 if varlen else 2, dtype=torch.bfloat16, device="cuda",
                   initial_state=True, num_seqs=4 if varlen else None, seed=3)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    leaves = [x[n].clone().requires_grad_() for n in names]
    kw = dict(save_states=case == "save_states", segments=4 if case == "pieces" else 1, cu_seqlens=cu,
              use_qk_l2norm_in_kernel=varlen)
    do = torch.randn(leaves[2].shape, device="cuda").to(torch.bfloat16)

    def call():
        o, _ = tfla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], **kw)
        return torch.autograd.grad(o, leaves, do)

    host = host_seconds_behind_sleep(call)
    assert host < 0.1, f"{case}: the call took {host * 1e3:.1f} ms on the host behind a ~200 ms sleep kernel"
