"""The fused gated-delta-rule forward (``tfla/ops/common/fused_delta_fwd.py``) against the float64 recurrence: fp32,
T = 1 and T not a multiple of 64, grouped value heads, initial and final state, varlen with sequences of length 0 and
1, head dims that are not powers of two, zero / strong / no gates, the flat grid and 64-bit offsets."""
import pytest
import torch

from tfla.bench.inputs import gdn_inputs
from tfla.ops.common.fused_delta_fwd import fused_delta_fwd
from tfla.ops.gated_delta_rule.reference import recurrent_gated_delta_rule_ref
from tfla.utils.testing import assert_rel_close, tolerance

CASES = [  # (B, T, H, HV, K, V, gate, varlen)
    (1, 1, 1, 1, 16, 16, "default", False),
    (2, 130, 1, 2, 32, 16, "default", False),
    (1, 200, 2, 2, 20, 24, "strong", False),
    (1, 150, 1, 2, 32, 32, "zero", False),
    (1, 130, 1, 2, 32, 16, "mixed", True),
    (1, 100, 1, 1, 16, 48, None, False),
]


@pytest.mark.parametrize("B,T,H,HV,K,V,gate,varlen", CASES)
def test_fused_delta_fwd_matches_recurrence(device, poison_empty, B, T, H, HV, K, V, gate, varlen):
    cu = torch.tensor([0, 1, 1, 70, T], device=device) if varlen else None
    N = 4 if varlen else B
    x = gdn_inputs(B, T, H, K, V, HV=HV, dtype=torch.float32, device=device, gate=gate or "default",
                   initial_state=True, num_seqs=N, seed=T + K)
    g = x["g"] if gate is not None else None
    scale = K ** -0.5
    out = fused_delta_fwd(x["q"], x["k"], x["v"], g, x["beta"], scale, x["initial_state"], True, cu_seqlens=cu)
    o, s = out["o"], out["final_state"]
    r = {n: (t.double().cpu() if t is not None else None) for n, t in x.items()}
    g_ref = r["g"] if gate is not None else torch.zeros_like(r["beta"])
    ro, rs = recurrent_gated_delta_rule_ref(r["q"], r["k"], r["v"], g_ref, r["beta"], scale=scale,
                                            initial_state=r["initial_state"], output_final_state=True,
                                            cu_seqlens=cu.cpu() if cu is not None else None)
    assert_rel_close("o", o.cpu(), ro, tolerance(torch.float32))
    assert_rel_close("final_state", s.cpu(), rs, tolerance(torch.float32))


def test_fused_delta_fwd_flat_and_int64_equal_default(device):
    x = gdn_inputs(2, 130, 1, 32, 16, HV=2, dtype=torch.float32, device=device, initial_state=True, seed=1)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.2, x["initial_state"], True)
    a = fused_delta_fwd(*args, save=2)
    b = fused_delta_fwd(*args, save=2, config={"flat": True, "idx64": True})
    for n in ("o", "final_state", "v_new", "h"):
        assert torch.equal(a[n], b[n]), n


@pytest.mark.parametrize("segments,mn_BV", [(1, None), (2, None), (4, None), (4, 16)])
@pytest.mark.parametrize("varlen", [False, True])
def test_fused_delta_fwd_segments_match_recurrence(device, poison_empty, monkeypatch, segments, mn_BV, varlen):
    """Pieces of a sequence in parallel with the exact start states from the [M | N] scan (pieces shorter than 64
    rows, sequences of length 0 and 1, shorter and longer than a piece; strong gates: the transitions start past
    the pieces' first chunks). With 16-column transition tiles (two of M's columns alone at K = 32) and gates of
    -1.3 a token, a cut piece's tiles store M = 0 without running a chunk (run, they would store ~e^-83)."""
    import tfla.ops.common.fused_delta_fwd as fdf

    tables = []
    real_cut = fdf.piece_cutoffs
    monkeypatch.setattr(fdf, "piece_cutoffs", lambda *a: tables.append(real_cut(*a)) or tables[-1])
    T = 330
    cu = torch.tensor([0, 1, 1, 70, 330], device=device) if varlen else None
    x = gdn_inputs(1 if varlen else 2, T, 1, 32, 16, HV=2, dtype=torch.float32, device=device, gate="strong",
                   initial_state=True, num_seqs=4 if varlen else None, seed=segments)
    if mn_BV:  # -83 a 64-row chunk: a cut piece's map from the cut on, ~e^-83, is still a normal fp32 number
        x["g"] = torch.full_like(x["g"], -1.3)
    out = fused_delta_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.3, x["initial_state"], True,
                          cu_seqlens=cu, segments=segments, config={"mn_BV": mn_BV} if mn_BV else None)
    if mn_BV:
        warm = tables[-1][0].cpu()
        zero = (out["split"].mn[..., :32] == 0).flatten(0, 1).flatten(1).all(1).cpu()  # per (piece, head): M = 0
        assert (warm > 0).any() and zero[warm > 0].all()
        if varlen:  # a one-token sequence's map is not 0
            assert not zero.all()
    o, s = out["o"], out["final_state"]
    r = {n: t.double().cpu() for n, t in x.items()}
    ro, rs = recurrent_gated_delta_rule_ref(r["q"], r["k"], r["v"], r["g"], r["beta"], scale=0.3,
                                            initial_state=r["initial_state"], output_final_state=True,
                                            cu_seqlens=cu.cpu() if cu is not None else None)
    assert_rel_close("o", o.cpu(), ro, tolerance(torch.float32))
    assert_rel_close("final_state", s.cpu(), rs, tolerance(torch.float32))


def _chunk_log_bounds(k, beta, g, cuts, H, HV):
    """The prep's bound on each 64-row chunk's map in float64 PyTorch: ``sum_t max(g_t, -80) + log max(1, |1 - beta_t
    |k_t|^2|)`` over the chunk's rows, ``[chunks, HV]`` (the chunks of the sequences ``cuts`` in a row)."""
    rows = []
    for b, e in zip(cuts[:-1], cuts[1:]):
        for c in range(-(-(e - b) // 64)):
            r = slice(b + 64 * c, min(b + 64 * (c + 1), e))
            row = []
            for hv in range(HV):
                kk = (k[0, r, hv // (HV // H)].double() ** 2).sum(-1)
                bb = beta[0, r, hv].double()
                row.append(float(g[0, r, hv].double().clamp(min=-80).sum() +
                                 torch.log((1 - bb * kk).abs().clamp(min=1)).sum()))
            rows.append(row)
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, HV)


def _cutoff_reference(bounds, cuts, HV, from_start):
    """``piece_cutoffs`` in Python from the chunks' log bounds: per (piece, value head), walking the piece's 64-row
    chunks from its end (``from_start``: its start), the first chunk c where the bounds walked sum to -80 or less:
    c, the chunks left out before it (none found: 0); from_start: c + 1, the chunks to run (none found: all)."""
    out, c0 = [], 0
    for b, e in zip(cuts[:-1], cuts[1:]):
        nc = -(-(e - b) // 64)
        for hv in range(HV):
            acc, cut = 0.0, nc if from_start else 0
            for c in (range(nc) if from_start else reversed(range(nc))):
                acc += float(bounds[c0 + c, hv])
                if acc <= -80:
                    cut = c + 1 if from_start else c
                    break
            out.append(cut)
        c0 += nc
    return out


@pytest.mark.parametrize("layout", ["varlen", "dense"])
@pytest.mark.parametrize("case", ["decay", "growth", "mixed_heads", "no_gate"])
def test_piece_cutoffs_match_the_bound(device, case, layout):
    """The prep's bound on each 64-row chunk's map (``ut_inverse_with_cumsum`` / ``ut_inverse`` with ``log_bound``)
    against float64, and from it the chunks each piece's transition leaves out and those the backward's summary pass
    runs (``piece_cutoffs``) against the same walk in Python: gates of -0.5 a token (a chunk sums to about -32, keys
    of norm 1 to 1.5: the cut falls on the third chunk from a piece's end, far from the threshold's rounding), keys
    of norm 2 to 3 with beta = 1 (each token's map may grow by 3 or more: no cut), value heads with and without
    decay (grouped heads, H = 1, HV = 2), no gate (nothing left out); varlen: pieces of 0, 30, 64, 200 and 640 rows
    (the bound from the gates' cumsum in the same kernel); dense: two sequences of 200 rows (the chunks numbered
    across the batch; the cumsum in its own kernel)."""
    from tfla.ops.common.cumsum import chunk_local_cumsum
    from tfla.ops.common.fused_delta_fwd import piece_cutoffs
    from tfla.ops.common.ut_transform import ut_inverse, ut_inverse_with_cumsum
    from tfla.ops.common.utils import ALL_CHUNKS, RCP_LN2, chunk_offset_rows
    from tfla.ops.common.varlen import chunk_tables

    cuts = [0, 0, 30, 94, 294, 934] if layout == "varlen" else [0, 200, 400]
    R, H, HV, K = cuts[-1], 1, 2, 32
    gen = torch.Generator().manual_seed(3)
    k = torch.nn.functional.normalize(torch.randn(1, R, H, K, generator=gen), dim=-1)
    k = k * (1 + 0.5 * torch.rand(1, R, H, 1, generator=gen))  # norms 1 to 1.5: a few tokens' maps may grow
    beta = torch.rand(1, R, HV, generator=gen)
    g = torch.full((1, R, HV), -0.5)
    if case == "growth":
        k, beta = 2 * k, torch.ones(1, R, HV)
    if case == "mixed_heads":
        g[..., 1] = -1e-3
    offsets = torch.tensor(chunk_offset_rows(cuts, 64), device=device)
    lb = torch.full((offsets[-1].item(), HV), float("nan"), device=device)
    if layout == "varlen":
        cu = torch.tensor(cuts, device=device)
        ut_inverse_with_cumsum(k.to(device), g.to(device), beta.to(device), cu, chunk_tables(cuts, 64, device)[0],
                               log_bound=lb)
    else:
        d = [x.to(device).reshape(2, R // 2, *x.shape[2:]) for x in (k, beta, g)]
        ut_inverse(d[0], chunk_local_cumsum(d[2], 64, scale=RCP_LN2), d[1], log_bound=lb)
    bounds = _chunk_log_bounds(k, beta, g, cuts, H, HV)
    assert_rel_close("log_bound", lb.cpu(), bounds, 1e-5)
    warm, keep = piece_cutoffs(None if case == "no_gate" else lb, offsets, HV)
    if case == "no_gate":
        assert warm.tolist() == [0] * (len(cuts) - 1) * HV
        assert keep.tolist() == [ALL_CHUNKS] * (len(cuts) - 1) * HV
        return
    assert warm.tolist() == _cutoff_reference(bounds, cuts, HV, False)
    assert keep.tolist() == _cutoff_reference(bounds, cuts, HV, True)
    if case == "decay" and layout == "varlen":  # the 200-row piece's chunks sum to -32, -32, -32, -4: cut at its
        # first (from the end) or its third; the 640-row piece's ten to -32 each: at its third from either end
        assert warm.tolist()[6:] == [0, 0, 7, 7] and keep.tolist()[6:] == [3, 3, 3, 3]
    if case == "decay" and layout == "dense":  # chunks of -32, -32, -32, -4 in each sequence
        assert warm.tolist() == [0] * 4 and keep.tolist() == [3] * 4
    if case == "growth":
        assert warm.tolist() == [0] * len(warm) and keep.tolist() == [c1 - c0 for c0, c1 in
                                                                      zip(offsets.tolist()[:-1], offsets.tolist()[1:])
                                                                      for _ in range(HV)]


def test_segment_bounds():
    from tfla.ops.common.fused_delta_fwd import segment_bounds

    assert segment_bounds([0, 300], 2) == ([0, 192, 300], [0, 2])
    assert segment_bounds([0, 0, 1, 65], 4) == ([0, 0, 1, 65], [0, 1, 2, 3])
    assert segment_bounds([0, 1000], 4) == ([0, 256, 512, 768, 1000], [0, 4])
    with pytest.raises(ValueError, match="segments"):
        segment_bounds([0, 10], 0)


@pytest.mark.parametrize("varlen", [False, True])
def test_fused_delta_fwd_saved_tensors_equal_across_segments(device, varlen):
    """Vnew and the states before every 64-row chunk (``save`` 2) are the same with and without the split (the
    pieces' chunks land in the sequence's own slots); sequences of length 0 and 1 and a piece shorter than 64."""
    T = 330
    cu = torch.tensor([0, 1, 1, 70, 330], device=device) if varlen else None
    x = gdn_inputs(1 if varlen else 2, T, 1, 32, 16, HV=2, dtype=torch.float32, device=device, gate="strong",
                   initial_state=True, num_seqs=4 if varlen else None, seed=5)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.3, x["initial_state"], True)
    a = fused_delta_fwd(*args, cu_seqlens=cu, segments=1, save=2)
    b = fused_delta_fwd(*args, cu_seqlens=cu, segments=3, save=2)
    for n in ("o", "final_state", "v_new", "h"):
        assert a[n].shape == b[n].shape, n
        assert_rel_close(n, b[n].cpu(), a[n].cpu().double(), tolerance(torch.float32))


def test_choose_piece():
    """The split is taken for one long sequence and left out where the heads already fill the GPU."""
    from tfla.ops.common.fused_delta_fwd import choose_piece

    piece = choose_piece([0, 65536], 16, 128, sms=132)
    assert piece is not None and piece % 64 == 0 and 1024 <= piece < 65536
    assert choose_piece([i * 8192 for i in range(5)], 16, 128, sms=132) is None  # 256 programs fill 132 SMs
    assert choose_piece([0, 12767, 20959, 26959, 30959, 32767, 32768], 32, 128, sms=132) is None  # varlen, HV 32
    assert choose_piece([0, 500], 1, 128, sms=132) is None  # shorter than two pieces
    assert choose_piece([0], 16, 128, sms=132) is None


def test_choose_piece_fills_one_wave_of_gluon_ctas():
    """For the Gluon pieces (one CTA of 128 state columns per SM) the pieces are the fewest that fill one wave of
    132 SMs: 8 x 16 heads, 4 x 32; two sequences share the wave; a long sequence beside short ones leaves them their
    share; never more CTAs than SMs (9 pieces x 16 heads measured 1.2x slower than 8 on an H200)."""
    from tfla.ops.common.fused_delta_fwd import choose_piece

    def pieces(bounds, HV):
        p = choose_piece(bounds, HV, 128, 132, cta_cols=128)
        return p, sum(-(-(e - b) // p) for b, e in zip(bounds[:-1], bounds[1:]))

    assert pieces([0, 65536], 16) == (8192, 8)
    assert pieces([0, 32768], 16) == (4096, 8)
    assert pieces([0, 131072], 16) == (16384, 8)
    assert pieces([0, 65536], 32) == (16384, 4)
    assert pieces([0, 65536, 131072], 16) == (16384, 8)
    short = [60000 + 200 * i for i in range(21)]  # 60,000 tokens, then 20 of 200
    piece, n = pieces([0] + short, 16)
    assert n - 20 == 7 and 7 * 16 + 20 * 16 * 4 * 64 / piece <= 132
    for T in range(4096, 300_000, 4096):
        for HV in (1, 4, 16, 32, 64):
            p = choose_piece([0, T], HV, 128, 132, cta_cols=128)
            assert p is None or (p % 64 == 0 and -(-T // p) * HV <= 132)
    assert choose_piece([0, 65536], 64, 128, 132, cta_cols=128) is None  # 64 heads x 2 fill the GPU already


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_segments_must_be_a_positive_int(device, bad):
    import tfla

    x = gdn_inputs(1, 8, 1, 16, 16, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="segments"):
        tfla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], segments=bad)


def test_op_segments_agree(device):
    """The public op gives the same output, final state and gradients with the sequence cut into pieces."""
    import tfla

    x = gdn_inputs(1, 300, 1, 32, 16, HV=2, dtype=torch.float32, device=device, initial_state=True, seed=2)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    res = []
    for segments in (1, 4):
        leaves = [x[n].clone().requires_grad_() for n in names]
        o, s = tfla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                           segments=segments)
        grads = torch.autograd.grad((o * o).sum() + s.sum(), leaves)
        res.append((o, s, *grads))
    for name, a, b in zip(("o", "final_state") + names, *res):
        assert_rel_close(name, b.detach().cpu(), a.detach().cpu().double(), tolerance(torch.float32))


def test_split_forward_keeps_consistent_tensors(device):
    """With the sequence cut, the default keeps the pieces' start states and the backward runs the pass again over
    the same pieces; with ``save_v_new=True`` the op keeps the forward's own states too (a kept Vnew would not match
    the backward's state pass from the initial state: the pieces start from the scan's states). Both give
    ``save_states``' gradients (bitwise on the CPU)."""
    import tfla

    x = gdn_inputs(1, 300, 1, 32, 16, HV=2, dtype=torch.float16, device=device, initial_state=True, seed=4)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    res = []
    for kw in (dict(), dict(save_v_new=True), dict(save_states=True)):
        leaves = [x[n].clone().requires_grad_() for n in names]
        o, s = tfla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                           segments=4, **kw)
        res.append(torch.autograd.grad((o.float() ** 2).sum() + s.sum(), leaves))
    for got in res[:2]:
        for name, a, b in zip(names, got, res[2]):
            if device == "cpu":
                assert torch.equal(a, b), name
            else:
                assert_rel_close(name, a.float().cpu(), b.float().cpu().double(), 1e-3)


def test_forward_without_grad_keeps_nothing(device, monkeypatch):
    """Under ``torch.no_grad`` (inputs that require grad or not) the fused pass writes only o and the final state,
    also with ``save_v_new=True``; with gradients it keeps Vnew where asked, and nothing by default (FLA's saved
    set)."""
    import tfla
    import tfla.ops.gated_delta_rule.chunk as chunk

    seen = []
    real = chunk.fused_delta_fwd

    def spy(*a, **kw):
        seen.append(kw["save"])
        return real(*a, **kw)

    monkeypatch.setattr(chunk, "fused_delta_fwd", spy)
    x = gdn_inputs(1, 70, 1, 16, 16, dtype=torch.float32, device=device)
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    with torch.no_grad():
        tfla.chunk_gated_delta_rule(*leaves, save_v_new=True)
    tfla.chunk_gated_delta_rule(*(t.detach() for t in leaves), save_v_new=True)
    tfla.chunk_gated_delta_rule(*leaves, save_v_new=True)
    tfla.chunk_gated_delta_rule(*leaves)
    assert seen == [0, 0, 1, 0]


@pytest.mark.parametrize("segments", [1, 3])
def test_varlen_with_host_offsets_never_reads_cu_seqlens(device, monkeypatch, segments):
    """With ``cu_seqlens_cpu`` given, neither the forward (with or without a split) nor the backward reads
    ``cu_seqlens`` back to the host: every host-side read of that tensor raises here."""
    import tfla

    T = 200
    cu = torch.tensor([0, 1, 1, 90, T], device=device)
    cu_cpu = cu.cpu().clone()  # a distinct tensor also when the device is the CPU
    _forbid_host_reads(monkeypatch, cu)
    x = gdn_inputs(1, T, 1, 32, 16, HV=2, dtype=torch.float32, device=device, initial_state=True, num_seqs=4, seed=6)
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]
    o, s = tfla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu,
                                       cu_seqlens_cpu=cu_cpu, segments=segments)
    torch.autograd.grad((o * o).sum() + s.sum(), leaves)


def _forbid_host_reads(monkeypatch, tensor):
    """Every host-side read of ``tensor`` raises from here on."""
    for name in ("tolist", "item", "cpu", "numpy", "__int__", "__index__", "__iter__", "__bool__"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, _name=name, **kw):
            if self is tensor:
                raise AssertionError(f"cu_seqlens.{_name}() read on the host")
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, spy)


def test_varlen_tables_cached_per_cu_seqlens(device, monkeypatch):
    """A second call with the same ``cu_seqlens`` tensor reads nothing back (forward and backward, with a split);
    new offsets written into it by a PyTorch op are seen (its version counter changes): the outputs then match a
    fresh tensor with those offsets, and a reused tensor whose contents changed does not reuse stale tables."""
    import tfla

    T = 200
    x = gdn_inputs(1, T, 1, 32, 16, HV=2, dtype=torch.float32, device=device, initial_state=True, num_seqs=4, seed=7)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def run(cu, **kw):
        leaves = [x[n].clone().requires_grad_() for n in names]
        o, s = tfla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                           cu_seqlens=cu, **kw)
        return [o, s, *torch.autograd.grad((o * o).sum() + s.sum(), leaves)]

    cu = torch.tensor([0, 1, 1, 90, T], device=device)
    first = run(cu, segments=3)
    with monkeypatch.context() as m:
        _forbid_host_reads(m, cu)
        again = run(cu, segments=3)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    cu.copy_(torch.tensor([0, 64, 70, 130, T], device=device))  # in place: the version counter moves
    got = run(cu, segments=3)
    want = run(torch.tensor([0, 64, 70, 130, T], device=device), segments=3)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert not torch.equal(got[0], first[0])


@pytest.mark.parametrize("cu", [[0, 1, 1, 70, 200], [0, 200, 200, 200, 200], [0, 63, 64, 65, 200]])
def test_device_tables_match_host_tables(device, cu):
    """``VarlenIndex.on_device`` (device ops only) gives the host tables' rows first, then padding rows whose chunk
    lies past its sequence's end (every row masked off), in a table of ``min(T // 64 + N, T)`` rows."""
    from tfla.ops.common.varlen import VarlenIndex, chunk_tables

    T, N = cu[-1], len(cu) - 1
    got = VarlenIndex.on_device(torch.tensor(cu, device=device), T)
    want_idx, want_first, _ = chunk_tables(cu, 64, device)
    n = want_idx.shape[0]
    assert got.bounds is None and got.sub_indices.shape == (min(T // 64 + N, T), 2)
    assert torch.equal(got.sub_indices[:n], want_idx) and torch.equal(got.sub_offsets, want_first)
    assert torch.equal(got.cu_seqlens.cpu(), torch.tensor(cu))
    for s, c in got.sub_indices[n:].tolist():
        assert c * 64 >= cu[s + 1] - cu[s]


@pytest.mark.parametrize("cu,order", [
    ([0, 1, 1, 70, 200], [3, 2, 0, 1]),  # chunks 1, 0, 2, 3: longest first, ties (none here) in their order
    ([0, 0, 1, 65, 194, 1100], [4, 3, 1, 2, 0]),  # chunks 0, 1, 1, 3, 15: the two 1-chunk sequences keep theirs
    ([0, 200, 300, 301], []),  # chunks 4, 2, 1: in order already
    ([0, 64, 128], []),  # a tie alone
])
def test_longest_first_order(device, cu, order):
    """The chain kernels' program order (``varlen.longest_first_order``): sequences by 64-row chunk count, most
    first, ties in their order; nothing where the offsets are in that order. ``VarlenIndex`` carries it as a device
    table (None when empty), built in the same host-to-device copy as the chunk tables."""
    from tfla.ops.common.varlen import VarlenIndex, chunk_tables, longest_first_order, table_kind

    assert longest_first_order(cu) == order
    vl = VarlenIndex.build(torch.tensor(cu, device=device), 64)
    # the kernels' variant, in the compiled kinds' keys (precompile.apply)
    assert table_kind(vl) == ("packed, longest first" if order else "packed") and table_kind(None) == "dense"
    idx, first, got = chunk_tables(cu, 64, device)
    assert torch.equal(vl.sub_indices, idx) and torch.equal(vl.sub_offsets, first)
    if order:
        assert vl.seq_order.dtype == torch.int32 and vl.seq_order.tolist() == order and got.tolist() == order
    else:
        assert vl.seq_order is None and got is None
    assert VarlenIndex.on_device(torch.tensor(cu, device=device), cu[-1]).seq_order is None


@pytest.mark.parametrize("flat", [False, True])
def test_longest_first_tl_kernels_are_bitwise_the_same(device, flat):
    """The ``tl`` pass and the ``tl`` state-gradient recurrence of the delta rule with their programs taking the
    sequences longest first (``seq_order``, ``grid.ordered_row``; also on the flat grid): the same o, final state,
    Vnew, states, dS, dU and initial-state gradient, bit for bit, as in the given order."""
    from tfla.ops.common.chunk_state_bwd import chunk_state_bwd
    from tfla.ops.common.ut_transform import w_from_tm
    from tfla.ops.common.varlen import chunk_tables

    bounds = [0, 1, 1, 70, 130, 300]  # chunks 1, 0, 2, 1, 3: order 4, 2, 0, 3, 1
    cu = torch.tensor(bounds, device=device)
    x = gdn_inputs(1, bounds[-1], 1, 32, 16, HV=2, dtype=torch.float32, device=device, initial_state=True,
                   num_seqs=5, seed=3)
    idx, offs, order = chunk_tables(bounds, 64, device)
    assert order.tolist() == [4, 2, 0, 3, 1]
    cfg = {"ws": False, "flat": flat}
    got, want = (fused_delta_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.2, x["initial_state"], True,
                                 cu_seqlens=cu, bounds=bounds, segments=1, save=2, sub_tables=(idx, offs, o),
                                 config=cfg) for o in (order, None))
    for name in ("o", "final_state", "v_new", "h"):
        assert torch.equal(got[name], want[name]), name
    w = w_from_tm(x["k"], got["g_cum"], got["beta"], got["ai"], 64, cu_seqlens=cu, sub_indices=idx)
    do = torch.randn_like(x["v"])
    dht = torch.randn_like(got["final_state"])
    got_b, want_b = (chunk_state_bwd(x["q"], x["k"], w, do, None, got["g_cum"], 0.2, 64, dht=dht, need_dh0=True,
                                     cu_seqlens=cu, sub_offsets=offs, num_sub_chunks=idx.shape[0],
                                     config={"ws": False, "flat": flat}, seq_order=o) for o in (order, None))
    for name, a, b in zip(("dh", "du", "dh0"), got_b, want_b):
        assert torch.equal(a, b), name


def test_pieces_longest_first_is_bitwise_the_same(device, monkeypatch):
    """A split's pieces taken longest first by the pass, the transitions and the backward's pass and recurrence over
    the pieces (``Split.seq_order``): the op's outputs and gradients bitwise those of the pieces in order."""
    import tfla
    import tfla.ops.common.fused_delta_fwd as fdf

    bounds = [0, 5, 70, 330]  # segments=2: pieces of 5, 64, 1, 192 and 68 rows (order 3, 4, 0, 1, 2)
    cu = torch.tensor(bounds, device=device)
    x = gdn_inputs(1, bounds[-1], 1, 32, 16, HV=2, dtype=torch.float32, device=device, initial_state=True,
                   num_seqs=3, seed=4)
    outs = []
    for order in (fdf.longest_first_order, lambda b: []):
        monkeypatch.setattr(fdf, "longest_first_order", order)
        fdf._split_tables.cache_clear()
        leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]
        o, s = tfla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                           cu_seqlens=cu, segments=2)
        outs.append((o, s) + torch.autograd.grad((o * o).sum() + (s * s).sum(), leaves))
    fdf._split_tables.cache_clear()
    for i, (a, b) in enumerate(zip(*outs)):
        assert torch.equal(a, b), f"output {i}"


def test_device_tables_clamp_malformed_offsets(device):
    """Offsets that are not a partition of [0, T] (unchecked under capture) become one: every row the kernels can
    touch lies inside the tensors."""
    from tfla.ops.common.varlen import VarlenIndex

    got = VarlenIndex.on_device(torch.tensor([5, 300, 2, 100], device=device), 150)
    offs = got.cu_seqlens.tolist()
    assert offs[0] == 0 and offs[-1] == 150 and offs == sorted(offs)
    idx = got.sub_indices.tolist()
    assert all(0 <= s < 3 and c >= 0 for s, c in idx)


def _forced_capture(monkeypatch, cu):
    """Make the op see a CUDA-graph capture (on any device) and forbid every host read of ``cu`` or of host tables."""
    import tfla.ops.common.varlen as varlen

    def refuse(*a, **kw):
        raise AssertionError("host tables built under capture")

    monkeypatch.setattr(varlen, "_capturing", lambda: True)
    monkeypatch.setattr(varlen, "cached_bounds", refuse)
    monkeypatch.setattr(varlen, "_tables", refuse)
    _forbid_host_reads(monkeypatch, cu)


OPTION_CASES = [dict(), dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)]


@pytest.mark.parametrize("opts", OPTION_CASES, ids=["plain", "l2norm-gate-beta"])
def test_varlen_forward_under_capture_equals_eager(device, monkeypatch, poison_empty, opts):
    """Under CUDA-graph capture (forced here, so it runs on the interpreter) the varlen forward without gradients
    builds its tables on the device and reads nothing back: equal to the eager call, for sequences of length 0, 1,
    shorter and longer than 64, grouped value heads and initial / final states; new offsets written into the same
    ``cu_seqlens`` are taken by the next call."""
    import tfla

    T = 200
    x = gdn_inputs(1, T, 1, 32, 16, HV=2, dtype=torch.float32, device=device, initial_state=True, num_seqs=4, seed=9)
    if opts.get("use_gate_in_kernel"):
        opts = {**opts, "A_log": torch.tensor([0.2, 1.5], device=device), "dt_bias": torch.tensor([0.1, -0.4],
                                                                                                   device=device)}
    cu = torch.tensor([0, 1, 1, 70, T], device=device)

    def run(**kw):
        with torch.no_grad():
            return tfla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                               initial_state=x["initial_state"], output_final_state=True,
                                               cu_seqlens=cu, **opts, **kw)

    for offsets in ([0, 1, 1, 70, T], [0, 130, 131, 131, T]):
        cu.copy_(torch.tensor(offsets, device=device))
        want = run()
        with monkeypatch.context() as m:
            _forced_capture(m, cu)
            got = run(cu_seqlens_cpu=torch.tensor([0, 50, 100, 150, T]))  # (ignored under capture)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_varlen_under_capture_refuses_gradients_and_pieces(device, monkeypatch):
    """Under capture a varlen call that needs gradients, or one forced into pieces, raises ValueError naming why."""
    import tfla

    x = gdn_inputs(1, 70, 1, 16, 16, dtype=torch.float32, device=device, num_seqs=2, seed=1)
    cu = torch.tensor([0, 30, 70], device=device)
    _forced_capture(monkeypatch, cu)
    q = x["q"].clone().requires_grad_()
    with pytest.raises(ValueError, match="without gradients"):
        tfla.chunk_gated_delta_rule(q, x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu)
    with torch.no_grad(), pytest.raises(ValueError, match="segments"):
        tfla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, segments=3)
    with pytest.raises(ValueError, match="CUDA-graph capture"):  # an op without device tables
        tfla.chunk_simple_gla(x["q"], x["k"], x["q"], g=x["g"], cu_seqlens=cu)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,K", [(torch.bfloat16, 128), (torch.float32, 64)])
def test_cuda_graph_varlen_forward_replays_new_offsets(dtype, K):
    """A varlen forward (no gradients; l2norm and gate in the op, initial states) captured in a CUDA graph, replayed
    after new inputs and new offsets (same N and T) were written into the captured tensors: equal to an eager call on
    those (bf16 at K = 128 takes the Hopper pass there)."""
    import tfla

    T, HV = 700, 4
    names = ("q", "k", "v", "g", "beta", "initial_state")
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                A_log=torch.linspace(0.0, 2.0, HV, device="cuda"), dt_bias=torch.zeros(HV, device="cuda"))

    def inputs(seed):
        x = gdn_inputs(1, T, 2, K, K, HV=HV, dtype=dtype, device="cuda", initial_state=True, num_seqs=5, seed=seed)
        return {n: x[n] for n in names}

    static = inputs(1)
    cu = torch.tensor([0, 1, 1, 300, 301, T], device="cuda")

    def step():
        with torch.no_grad():
            return tfla.chunk_gated_delta_rule(*(static[n] for n in names[:5]), initial_state=static["initial_state"],
                                               output_final_state=True, cu_seqlens=cu, **opts)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed, offsets in ((2, [0, 64, 64, 65, 600, T]), (3, [0, 0, 0, 0, 0, T])):
        fresh = inputs(seed)
        for n in names:
            static[n].copy_(fresh[n])
        cu.copy_(torch.tensor(offsets, device="cuda"))
        graph.replay()
        want = step()
        for a, b in zip(out, want):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("segments", [1, 3])
@pytest.mark.parametrize("grad", [False, True])
def test_cuda_graph_replay_equals_eager(segments, grad):
    """The dense forward (unsplit or cut into pieces) and forward + backward captured in a CUDA graph after a warm-up
    call, replayed with new input contents: equal to eager calls on those inputs."""
    import tfla

    names = ("q", "k", "v", "g", "beta", "initial_state")
    static = gdn_inputs(2, 300, 2, 64, 64, HV=4, dtype=torch.bfloat16, device="cuda", initial_state=True, seed=1)
    static = {n: static[n].clone().requires_grad_(grad) for n in names}
    do = torch.randn(2, 300, 4, 64, device="cuda").bfloat16()

    def step():
        o, s = tfla.chunk_gated_delta_rule(*(static[n] for n in names[:5]), initial_state=static["initial_state"],
                                           output_final_state=True, segments=segments)
        if not grad:
            return [o, s]
        return [o, s, *torch.autograd.grad((o * do).sum() + s.sum(), [static[n] for n in names])]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.set_grad_enabled(grad):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.set_grad_enabled(grad):
        out = step()
    fresh = gdn_inputs(2, 300, 2, 64, 64, HV=4, dtype=torch.bfloat16, device="cuda", initial_state=True, seed=2)
    with torch.no_grad():
        for n in names:
            static[n].copy_(fresh[n])
    graph.replay()
    with torch.set_grad_enabled(grad):
        want = step()
    for a, b in zip(out, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("T,varlen", [(1, False), (150, False), (200, True)])
def test_ut_inverse_with_cumsum_equals_cumsum_then_inverse(device, poison_empty, T, varlen):
    """The prep of the Hopper pass: the gate's cumsum inside the inverse's kernel gives the separate cumsum's G (to
    the order of its additions) and the same Tm, with gates below the floor, -inf and rows past T."""
    from tfla.ops.common.cumsum import chunk_local_cumsum
    from tfla.ops.common.ut_transform import ut_inverse, ut_inverse_with_cumsum
    from tfla.ops.common.utils import LOG_DECAY_FLOOR, RCP_LN2, SUB_CHUNK, prepare_chunk_indices

    cu = torch.tensor([0, 1, 1, 70, T], device=device) if varlen else None
    sub = prepare_chunk_indices([0, 1, 1, 70, T], SUB_CHUNK, device) if varlen else None
    x = gdn_inputs(1 if varlen else 2, T, 1, 32, 16, HV=2, dtype=torch.float32, device=device, gate="strong",
                   seed=T)
    g = x["g"].clone()
    g[0, 0, 0] = float("-inf")
    g[..., min(T - 1, 5), 1] = -300.0
    g_cum, ai = ut_inverse_with_cumsum(x["k"], g, x["beta"], cu, sub)
    want_g = chunk_local_cumsum(g, SUB_CHUNK, scale=RCP_LN2, cu_seqlens=cu, chunk_indices=sub,
                                out_dtype=torch.float32, floor=LOG_DECAY_FLOOR)
    assert g_cum.dtype == torch.float32 and torch.isfinite(g_cum).all()
    torch.testing.assert_close(g_cum, want_g, rtol=1e-6, atol=1e-5)
    want_ai = ut_inverse(x["k"], want_g, x["beta"], cu, sub)
    assert_rel_close("ai", ai.cpu(), want_ai.double().cpu(), tolerance(torch.float32))


@pytest.mark.parametrize("bias", [True, False])
def test_ut_inverse_with_gate_activation_equals_prologue(device, poison_empty, bias):
    """With ``A_log`` / ``dt_bias`` the prep's kernel activates the gates itself (``-exp(A_log) softplus(a +
    dt_bias)``) before the cumsum: G and Tm as ``gate_prologue`` then the inverse, varlen, pre-activations up to +-30
    (softplus's threshold, the floor)."""
    from tfla.ops.common.gate_act import NO_BETA, GateAct, gate_prologue
    from tfla.ops.common.ut_transform import ut_inverse, ut_inverse_with_cumsum
    from tfla.ops.common.utils import SUB_CHUNK, prepare_chunk_indices

    T = 200
    cu = torch.tensor([0, 1, 1, 70, T], device=device)
    sub = prepare_chunk_indices([0, 1, 1, 70, T], SUB_CHUNK, device)
    x = gdn_inputs(1, T, 1, 32, 16, HV=2, dtype=torch.float32, device=device, seed=11)
    gen = torch.Generator().manual_seed(11)
    a = (torch.randn(1, T, 2, generator=gen) * 4).to(device)
    a[0, 3, 0], a[0, 80, 1] = 30.0, -30.0
    A_log = torch.tensor([0.3, 2.0], device=device)
    dt_bias = torch.tensor([-1.0, 0.5], device=device) if bias else None
    g_cum, ai = ut_inverse_with_cumsum(x["k"], a, x["beta"], cu, sub, A_log=A_log, dt_bias=dt_bias)
    want_g, _ = gate_prologue(a, x["beta"], GateAct(A_log, dt_bias, NO_BETA), cu_seqlens=cu, chunk_indices=sub)
    torch.testing.assert_close(g_cum, want_g, rtol=1e-6, atol=1e-4)
    want_ai = ut_inverse(x["k"], want_g, x["beta"], cu, sub)
    assert_rel_close("ai", ai.cpu(), want_ai.double().cpu(), tolerance(torch.float32))
