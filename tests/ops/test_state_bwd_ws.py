"""The warp-specialized Gluon state-gradient recurrence of the delta rule (``tfla/ops/common/state_bwd_ws.py``, Hopper
only; from Tm and beta) against the ``tl`` kernel (``_delta_state_bwd_kernel``, the same math from W): dense and
varlen with sequences of length 0, 1 and not a multiple of 64, the final state's cotangent given and absent, the
stores off (a piece's summary), one and two consumer warpgroups; and through the op (forward + backward, whole and
cut in pieces) against the op on the ``tl`` kernel and the float64 recurrence. Where it does not apply (CPU, fp16,
fp32, K != 128) the ``tl`` kernel runs."""
import pytest
import torch

from tfla.ops.common.chunk_state_bwd import chunk_state_bwd
from tfla.ops.common.cumsum import chunk_local_cumsum
from tfla.ops.common.fused_delta_ws import HAVE_GLUON
from tfla.ops.common.state_bwd_ws import state_bwd_ws_supported
from tfla.ops.common.ut_transform import w_from_tm
from tfla.utils.testing import GDN_OP_NAMES, gdn_op_grads, rel_l2

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and HAVE_GLUON
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU and Triton's Gluon")
RCP_LN2 = 1.4426950408889634


def _inputs(B, T, H, HV, lens, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cu = None if lens is None else torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda")

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * s).bfloat16()

    q = torch.nn.functional.normalize(rnd(B, T, H, 128).float(), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(rnd(B, T, H, 128).float(), dim=-1).bfloat16()
    ai = rnd(B, T, HV, 64, s=0.2)  # Tm (W = Tm X_k is formed inside the Gluon kernel, by w_from_tm for the tl one)
    beta = torch.rand(B, T, HV, device="cuda", generator=gen)
    do = rnd(B, T, HV, 128)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda", generator=gen) + 3)
    g_cum = chunk_local_cumsum(g, 64, scale=RCP_LN2, cu_seqlens=cu,
                               bounds=None if lens is None else cu.tolist())
    N = B if lens is None else len(lens)
    dht = torch.randn(N, HV, 128, 128, device="cuda", generator=gen)
    return q, k, ai, beta, do, g_cum, dht, cu


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("B,T,H,HV,lens,cfg", [
    (1, 1, 1, 1, None, None),
    (2, 300, 2, 4, None, {"NCONS": 1, "BV": 64}),
    (1, 1171, 2, 4, [0, 1, 64, 130, 5, 971], None),
    (1, 1171, 1, 2, [0, 1, 64, 130, 5, 971], {"NCONS": 2, "BV": 32}),
    (3, 257, 1, 2, None, {"NCONS": 1, "BV": 32}),
    (1, 1171, 2, 4, [0, 1, 64, 130, 5, 971], {"NCONS": 2, "BV": 64}),
])
@pytest.mark.parametrize("with_dht,store", [(True, True), (False, True), (True, False)])
def test_ws_state_bwd_matches_tl(B, T, H, HV, lens, cfg, with_dht, store):
    q, k, ai, beta, do, g_cum, dht, cu = _inputs(B, T, H, HV, lens, seed=T + HV)
    dht = dht if with_dht else None
    assert state_bwd_ws_supported(q, k, ai, beta, do, g_cum, dht, cu, cfg)
    kw, idx = {}, None
    if cu is not None:
        from tfla.ops.common.varlen import chunk_tables
        idx, offs, _ = chunk_tables(cu.tolist(), 64, cu.device)
        kw = dict(cu_seqlens=cu, sub_offsets=offs, num_sub_chunks=idx.shape[0])
    w = w_from_tm(k, g_cum, beta, ai, 64, cu_seqlens=cu, sub_indices=idx)
    res = [chunk_state_bwd(q, k, None, do, None, g_cum, 128 ** -0.5, 64, dht=dht, need_dh0=True, store=store,
                           config={"ws": cfg or True}, ai=ai, beta=beta, **kw),
           chunk_state_bwd(q, k, w, do, None, g_cum, 128 ** -0.5, 64, dht=dht, need_dh0=True, store=store,
                           config={"ws": False}, **kw)]
    for name, a, b in zip(("dh", "du", "dh0"), *res):
        if not store and name != "dh0":
            assert a is None and b is None
            continue
        assert torch.isfinite(a).all(), name
        assert rel_l2(a.float(), b.float()) < 1e-2, f"{name}: {rel_l2(a.float(), b.float()):.3e}"


@pytest.mark.gpu
@needs_sm90
def test_ws_state_bwd_longest_first_is_bitwise_the_same():
    """Programs that take the packed sequences longest first (``varlen.longest_first_order``) give dS, dU and the
    initial state's gradient of the in-order launch bit for bit."""
    from tfla.ops.common.varlen import chunk_tables

    lens = [0, 1, 64, 130, 5, 971]
    q, k, ai, beta, do, g_cum, dht, cu = _inputs(1, sum(lens), 2, 4, lens, seed=3)
    idx, offs, order = chunk_tables(cu.tolist(), 64, cu.device)
    assert order.tolist() == [5, 3, 1, 2, 4, 0]
    got, want = (chunk_state_bwd(q, k, None, do, None, g_cum, 128 ** -0.5, 64, dht=dht, need_dh0=True, cu_seqlens=cu,
                                 sub_offsets=offs, num_sub_chunks=idx.shape[0], ai=ai, beta=beta, seq_order=o)
                 for o in (order, None))
    for name, a, b in zip(("dh", "du", "dh0"), got, want):
        assert torch.equal(a, b), name


def test_ws_state_bwd_not_taken_where_it_does_not_apply(device):
    q, k, do = (torch.randn(1, 70, 1, 128, device=device, dtype=torch.bfloat16) for _ in range(3))
    ai = torch.randn(1, 70, 1, 64, device=device, dtype=torch.bfloat16)
    beta = torch.rand(1, 70, 1, device=device)
    g = torch.zeros(1, 70, 1, device=device)
    if device == "cuda" and SM90:
        assert state_bwd_ws_supported(q, k, ai, beta, do, g, None, None)
    assert not state_bwd_ws_supported(q, k, ai, beta, do, None, None, None)  # no gate
    assert not state_bwd_ws_supported(q, k, None, None, do, g, None, None)  # no Tm
    assert not state_bwd_ws_supported(q.half(), k.half(), ai.half(), beta, do.half(), g, None, None)
    assert not state_bwd_ws_supported(q.float(), k.float(), ai.float(), beta, do.float(), g, None, None)
    q64 = torch.randn(1, 70, 1, 64, device=device, dtype=torch.bfloat16)
    assert not state_bwd_ws_supported(q64, q64, ai, beta, do, g, None, None)
    if device == "cpu":
        assert not state_bwd_ws_supported(q, k, ai, beta, do, g, None, None)
    with pytest.raises(ValueError, match="ai"):  # Tm without beta
        chunk_state_bwd(q, k, None, do, None, g, 0.1, 64, ai=ai)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("segments", [1, 3])
def test_op_with_ws_state_bwd(varlen, segments):
    """``chunk_gated_delta_rule`` forward + backward with the Gluon state-gradient recurrence against the op on the
    ``tl`` kernel (``config={"state_bwd": {"ws": False}}``) and the float64 recurrence's gradients: bf16, grouped
    value heads, initial and final state, whole sequences and pieces."""
    *res, ref = gdn_op_grads([{"state_bwd": {"ws": ws}} for ws in (True, False)], varlen, segments, seed=11,
                             reference=True)
    for name, a_, b_, rf in zip(GDN_OP_NAMES, res[0][2:], res[1][2:], ref):
        assert torch.isfinite(a_).all(), name
        e_ws, e_tl = rel_l2(a_.double().cpu(), rf), rel_l2(b_.double().cpu(), rf)
        assert e_ws <= 1.15 * e_tl + 1e-4, f"{name}: ws {e_ws:.3e} vs tl {e_tl:.3e}"
