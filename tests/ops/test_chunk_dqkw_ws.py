"""The delta rule's chunk gradients on Hopper in one Gluon kernel (``tfla/ops/common/chunk_dqkw_ws.py``, sm_90 only)
against the ``tl`` kernels it replaces there (``_gdn_dqkw_kernel`` + ``_wy_bwd_kernel``, the same math, then
``l2norm_bwd``): dense and varlen with sequences of length 0, 1 and not a multiple of 64, grouped value heads,
l2norm's backward (one value head per key head: in the kernel), value head dims 64 and 128, fp16 and bf16; and
through the op (forward + backward, whole and cut in pieces) against the op on the ``tl`` kernels and the float64
recurrence. Where it does not apply (CPU, fp32, K != 128, V other than 64 / 128, no gate) the ``tl``
kernels run."""
import pytest
import torch

from tfla.ops.common.chunk_dqkw import chunk_dqkw_bwd
from tfla.ops.common.chunk_dqkw_ws import gdn_bwd_chunk_ws, gdn_bwd_ws_supported
from tfla.ops.common.cumsum import chunk_local_cumsum
from tfla.ops.common.fused_delta_ws import HAVE_GLUON
from tfla.ops.common.l2norm import l2norm_bwd
from tfla.ops.common.wy_bwd import wy_bwd
from tfla.utils.testing import GDN_OP_NAMES, gdn_op_grads, rel_l2

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and HAVE_GLUON
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU and Triton's Gluon")
RCP_LN2 = 1.4426950408889634


def _inputs(B, T, H, HV, V, lens, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cu = None if lens is None else torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda")

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * s).to(dtype)

    q = torch.nn.functional.normalize(rnd(B, T, H, 128).float(), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(rnd(B, T, H, 128).float(), dim=-1).to(dtype)
    vn, do, du = rnd(B, T, HV, V), rnd(B, T, HV, V), rnd(B, T, HV, V, s=0.3)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda", generator=gen) + 3)
    g_cum = chunk_local_cumsum(g, 64, scale=RCP_LN2, cu_seqlens=cu, bounds=None if lens is None else cu.tolist())
    kw = {}
    if cu is None:
        NS = (T + 63) // 64
    else:
        from tfla.ops.common.varlen import chunk_tables
        idx, offs, _ = chunk_tables(cu.tolist(), 64, cu.device)
        NS = idx.shape[0]
        kw = dict(cu_seqlens=cu, tile_indices=idx, sub_offsets=offs)
    h = rnd(B, NS, HV, 128, V, s=0.5)
    dh = rnd(B, NS, HV, 128, V, s=0.5)
    return (q, k, vn, do, du, h, dh, g_cum), kw


def _ws_inputs(B, T, H, HV, vn, dtype):
    """v, beta, Tm (``ai``) and l2norm's row factors (rstd of q and k) for ``gdn_bwd_chunk_ws`` beside ``_inputs``."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    v = torch.randn(vn.shape, device="cuda", generator=gen).to(dtype)
    beta = torch.rand(B, T, HV, device="cuda", generator=gen).to(dtype)
    ai = (torch.randn(B, T, HV, 64, device="cuda", generator=gen) * 0.2).to(dtype)
    rq, rk = (torch.rand(B, T, H, device="cuda", generator=gen) + 0.5 for _ in range(2))
    return v, beta, ai, rq, rk



@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("B,T,H,HV,V,lens,dtype,l2", [
    (1, 1, 1, 1, 128, None, torch.bfloat16, False),
    (2, 300, 2, 4, 128, None, torch.bfloat16, False),
    (1, 1171, 2, 2, 128, [0, 1, 64, 130, 5, 971], torch.bfloat16, True),
    (3, 257, 1, 2, 64, None, torch.float16, False),
    (1, 1171, 1, 2, 64, [0, 1, 64, 130, 5, 971], torch.bfloat16, False),
    (2, 2000, 2, 8, 128, None, torch.bfloat16, False),
    (2, 700, 3, 3, 128, None, torch.bfloat16, True),
])
def test_ws_bwd_matches_tl(B, T, H, HV, V, lens, dtype, l2):
    """``gdn_bwd_chunk_ws`` (one kernel; with ``l2``, one value head per key head, dq and dk taken through l2norm's
    backward) against ``chunk_dqkw_bwd`` + ``wy_bwd`` on the ``tl`` kernels (and ``l2norm_bwd``); bitwise equal
    across calls."""
    args, kw = _inputs(B, T, H, HV, V, lens, dtype, seed=T + V + 1)
    q, k, vn, do, du, h, dh, g_cum = args
    v, beta, ai, rq, rk = _ws_inputs(B, T, H, HV, vn, dtype)
    assert gdn_bwd_ws_supported(q, k, v, beta, ai, vn, do, du, h, g_cum)
    got = gdn_bwd_chunk_ws(q, k, v, beta, ai, vn, do, du, h, dh, g_cum, 128 ** -0.5, kw.get("cu_seqlens"),
                           kw.get("tile_indices"), kw.get("sub_offsets"), l2=(rq, rk) if l2 else None)
    w = torch.empty(B, T, HV, 128, device="cuda", dtype=dtype)
    dq, dko, dw, dgd, pst, sds = chunk_dqkw_bwd(*args, 128 ** -0.5, dq_dtype=dtype, dk_dtype=dtype, dw=w, **kw)
    dk, dv, dbeta, dgam = wy_bwd(k, v, beta, g_cum, ai, vn, du, None, None, 64, cu_seqlens=kw.get("cu_seqlens"),
                                 sub_indices=kw.get("tile_indices"), dk_add=dko, dk_dtype=dtype, dw=dw, pst=pst,
                                 sdst=sds)
    if l2:  # the l2norm inputs whose normalized rows are q and k: x0 = q / r (fp32), so that x0 r = q
        dq = l2norm_bwd(q.float() / rq[..., None], rq, dq).to(dtype)
        dk = l2norm_bwd(k.float() / rk[..., None], rk, dk).to(dtype)
    # the gate gradient's delta part: the reverse cumsum within 64 rows of the kernel's rows, of dgd plus dgam there
    cu = kw.get("cu_seqlens")
    bounds = None if cu is None else cu.tolist()
    dg = chunk_local_cumsum(dgd, 64, reverse=True, cu_seqlens=cu, bounds=bounds, add=dgam)
    dg_got = chunk_local_cumsum(got[4], 64, reverse=True, cu_seqlens=cu, bounds=bounds)
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dg"), (*got[:4], dg_got), (dq, dk, dv, dbeta, dg)):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), name
        assert rel_l2(a.float(), b.float()) < 1e-2, f"{name}: {rel_l2(a.float(), b.float()):.3e}"
    for _ in range(2):  # deterministic
        again = gdn_bwd_chunk_ws(q, k, v, beta, ai, vn, do, du, h, dh, g_cum, 128 ** -0.5, kw.get("cu_seqlens"),
                                 kw.get("tile_indices"), kw.get("sub_offsets"), l2=(rq, rk) if l2 else None)
        for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dgd"), again, got):
            assert torch.equal(a, b), name


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("lens,l2", [(None, False), ([0, 1, 64, 130, 5, 971], True)])
def test_ws_bwd_persistent_grid_sizes(monkeypatch, lens, l2):
    """The persistent kernel walks its tiles in CTAs of any count with the same results: grids of 1, 3 and 7 CTAs
    (many tiles per CTA, counts not a multiple of the grid; the producer's and consumers' barrier phases over many
    tiles) bitwise equal to the grid of one CTA per SM, also with dv written over dU."""
    import tfla.ops.common.chunk_dqkw_ws as cw

    B, T, H, HV = (2, 300, 2, 4) if lens is None else (1, 1171, 2, 2)
    args, kw = _inputs(B, T, H, HV, 128, lens, torch.bfloat16, seed=11)
    q, k, vn, do, du, h, dh, g_cum = args
    v, beta, ai, rq, rk = _ws_inputs(B, T, H, HV, vn, torch.bfloat16)

    def run(sms, into_du=False):
        monkeypatch.setattr(cw, "sm_count", lambda x: sms)
        return gdn_bwd_chunk_ws(q, k, v, beta, ai, vn, do, du.clone() if into_du else du, h, dh, g_cum, 128 ** -0.5,
                                kw.get("cu_seqlens"), kw.get("tile_indices"), kw.get("sub_offsets"),
                                l2=(rq, rk) if l2 else None, dv_into_du=into_du)

    ref = run(torch.cuda.get_device_properties(0).multi_processor_count)
    for sms, into_du in ((1, False), (3, True), (7, False)):
        got = run(sms, into_du)
        for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dgd"), got, ref):
            assert torch.equal(a, b), f"{name}, {sms} CTAs"


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("B,T,H,HV,lens,l2", [
    (2, 300, 2, 4, None, False),
    (1, 1171, 2, 4, [0, 1, 64, 130, 5, 971], True),
    (1, 257, 1, 4, None, True),
])
def test_ws_bwd_gva_sum(monkeypatch, B, T, H, HV, lens, l2):
    """Grouped value heads summed in the kernel (``gva_sum``: a CTA runs a key head's value heads in turn, the partial
    sums through its scratch rows) against the kernel per value head followed by ``group_sum`` (with l2norm's
    backward there): dq and dk within the 16-bit rounding of the per-head parts, every other output bitwise equal;
    bitwise equal across grids of 1, 3 and 7 CTAs (several units per CTA, the partial sums' barrier phases over many
    tiles) and repeat calls."""
    import tfla.ops.common.chunk_dqkw_ws as cw
    from tfla.ops.common.group_sum import group_sum

    args, kw = _inputs(B, T, H, HV, 128, lens, torch.bfloat16, seed=T + 7)
    q, k, vn, do, du, h, dh, g_cum = args
    v, beta, ai, rq, rk = _ws_inputs(B, T, H, HV, vn, torch.bfloat16)

    def run(gva, sms=None):
        if sms is not None:
            monkeypatch.setattr(cw, "sm_count", lambda x: sms)
        return gdn_bwd_chunk_ws(q, k, v, beta, ai, vn, do, du, h, dh, g_cum, 128 ** -0.5, kw.get("cu_seqlens"),
                                kw.get("tile_indices"), kw.get("sub_offsets"), l2=(rq, rk) if l2 and gva else None,
                                gva_sum=gva)

    ref = run(False)
    dq = group_sum(ref[0], H, q.dtype, l2=(q.float() / rq[..., None], rq) if l2 else None)
    dk = group_sum(ref[1], H, k.dtype, l2=(k.float() / rk[..., None], rk) if l2 else None)
    got = run(True)
    for name, a, b in zip(("dq", "dk"), got, (dq, dk)):
        assert a.shape == (B, T, H, 128) and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), name
        assert rel_l2(a.float(), b.float()) < 4e-3, f"{name}: {rel_l2(a.float(), b.float()):.3e}"
    for name, a, b in zip(("dv", "dbeta", "dgd"), got[2:], ref[2:]):
        assert torch.equal(a, b), name
    for sms in (None, 1, 3, 7):
        again = run(True, sms)
        for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dgd"), again, got):
            assert torch.equal(a, b), f"{name}, {sms} CTAs"


def test_ws_bwd_gva_sum_rejects(device):
    """``gva_sum`` where it does not apply raises before any launch: one value head per key head, V = 64, with
    ``dq_into_v_new``."""
    def call(HV=4, V=128, **kw):
        q, k = (torch.randn(1, 70, 2, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
        v, vn, do, du = (torch.randn(1, 70, HV, V, device=device, dtype=torch.bfloat16) for _ in range(4))
        h = torch.randn(1, 2, HV, 128, V, device=device, dtype=torch.bfloat16)
        beta, ai = torch.rand(1, 70, HV, device=device), torch.randn(1, 70, HV, 64, device=device)
        return gdn_bwd_chunk_ws(q, k, v, beta, ai, vn, do, du, h, h, torch.zeros(1, 70, HV, device=device), 0.1,
                                gva_sum=True, **kw)

    for kw in (dict(HV=2), dict(V=64), dict(dq_into_v_new=True)):
        with pytest.raises(ValueError, match="gva_sum"):
            call(**kw)


def test_ws_bwd_not_taken_where_it_does_not_apply(device):
    def args(K=128, V=128, dtype=torch.bfloat16):
        q, k = (torch.randn(1, 70, 1, K, device=device, dtype=dtype) for _ in range(2))
        v, vn, do, du = (torch.randn(1, 70, 1, V, device=device, dtype=dtype) for _ in range(4))
        beta = torch.rand(1, 70, 1, device=device)
        ai = torch.randn(1, 70, 1, 64, device=device, dtype=dtype)
        h = torch.randn(1, 2, 1, K, V, device=device, dtype=dtype)
        return q, k, v, beta, ai, vn, do, du, h, torch.zeros(1, 70, 1, device=device)

    if device == "cuda" and SM90:
        assert gdn_bwd_ws_supported(*args())
        assert gdn_bwd_ws_supported(*args(V=64))
    assert not gdn_bwd_ws_supported(*args()[:-1], None)  # no gate
    assert not gdn_bwd_ws_supported(*args(dtype=torch.float32))
    assert not gdn_bwd_ws_supported(*args(K=64))
    assert not gdn_bwd_ws_supported(*args(V=256))
    assert not gdn_bwd_ws_supported(*args(V=96))
    if device == "cpu":
        assert not gdn_bwd_ws_supported(*args())


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("varlen,segments,l2norm,HV,slab", [
    (False, 1, False, 4, False), (True, 1, False, 4, False), (False, 3, False, 4, False), (True, 3, False, 4, False),
    (True, 1, True, 4, False), (False, 3, True, 2, False), (True, 1, True, 2, False), (False, 1, True, 4, True)])
def test_op_with_ws_bwd(varlen, segments, l2norm, HV, slab):
    """The op with the one-kernel chunk gradients (default on Hopper) against the op on the ``tl`` kernels
    (``config={"dqkw": {"ws": False}}``) and the float64 recurrence's gradients: bf16, grouped value heads (HV = 4,
    H = 2: summed in the kernel) and not, initial and final state, whole sequences, pieces and the backward's slabs
    (4 chunks each), with and without ``use_qk_l2norm_in_kernel`` (its backward runs in the kernel)."""
    extra = {"slab": {"chunks": 4}} if slab else {}
    *res, ref = gdn_op_grads([{"dqkw": {"ws": ws}, **extra} for ws in (True, False)], varlen, segments, seed=17,
                             reference=True, l2norm=l2norm, HV=HV)
    for name, a_, b_, rf in zip(GDN_OP_NAMES, res[0][2:], res[1][2:], ref):
        assert torch.isfinite(a_).all(), name
        e_ws, e_tl = rel_l2(a_.double().cpu(), rf), rel_l2(b_.double().cpu(), rf)
        assert e_ws <= 1.15 * e_tl + 1e-4, f"{name}: ws {e_ws:.3e} vs tl {e_tl:.3e}"
