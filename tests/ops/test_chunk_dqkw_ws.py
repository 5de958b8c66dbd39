"""The delta rule's chunk gradients on Hopper in one Gluon kernel (``tfla/ops/common/chunk_dqkw_ws.py``, sm_90 only)
against the ``tl`` kernels it replaces there (``_gdn_dqkw_kernel`` + ``_wy_bwd_kernel``, the same math): dense and
varlen with sequences of length 0, 1 and not a multiple of 64, grouped value heads, value head dims 64 and 128, fp16
and bf16; and through the op (forward + backward, whole and cut in pieces) against the op on the ``tl`` kernels and
the float64 recurrence. Where it does not apply (CPU, fp32, K != 128, V other than 64 / 128, no gate) the ``tl``
kernels run."""
import pytest
import torch

from tfla.ops.common.chunk_dqkw import chunk_dqkw_bwd
from tfla.ops.common.chunk_dqkw_ws import gdn_bwd_chunk_ws, gdn_bwd_ws_supported
from tfla.ops.common.cumsum import chunk_local_cumsum
from tfla.ops.common.fused_delta_ws import HAVE_GLUON
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
        idx, offs = chunk_tables(cu.tolist(), 64, cu.device)
        NS = idx.shape[0]
        kw = dict(cu_seqlens=cu, tile_indices=idx, sub_offsets=offs)
    h = rnd(B, NS, HV, 128, V, s=0.5)
    dh = rnd(B, NS, HV, 128, V, s=0.5)
    return (q, k, vn, do, du, h, dh, g_cum), kw



@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("B,T,H,HV,V,lens,dtype", [
    (1, 1, 1, 1, 128, None, torch.bfloat16),
    (2, 300, 2, 4, 128, None, torch.bfloat16),
    (1, 1171, 2, 4, 128, [0, 1, 64, 130, 5, 971], torch.bfloat16),
    (3, 257, 1, 2, 64, None, torch.float16),
    (1, 1171, 1, 2, 64, [0, 1, 64, 130, 5, 971], torch.bfloat16),
    (2, 2000, 2, 8, 128, None, torch.bfloat16),
])
def test_ws_bwd_matches_tl(B, T, H, HV, V, lens, dtype):
    """``gdn_bwd_chunk_ws`` (one kernel) against ``chunk_dqkw_bwd`` + ``wy_bwd`` on the ``tl`` kernels."""
    args, kw = _inputs(B, T, H, HV, V, lens, dtype, seed=T + V + 1)
    q, k, vn, do, du, h, dh, g_cum = args
    gen = torch.Generator(device="cuda").manual_seed(5)
    v = torch.randn(vn.shape, device="cuda", generator=gen).to(dtype)
    beta = torch.rand(B, T, HV, device="cuda", generator=gen).to(dtype)
    ai = (torch.randn(B, T, HV, 64, device="cuda", generator=gen) * 0.2).to(dtype)
    assert gdn_bwd_ws_supported(q, k, v, beta, ai, vn, do, du, h, g_cum)
    got = gdn_bwd_chunk_ws(q, k, v, beta, ai, vn, do, du, h, dh, g_cum, 128 ** -0.5, kw.get("cu_seqlens"),
                           kw.get("tile_indices"), kw.get("sub_offsets"))
    w = torch.empty(B, T, HV, 128, device="cuda", dtype=dtype)
    dq, dko, dw, dgd, pst, sds = chunk_dqkw_bwd(*args, 128 ** -0.5, dq_dtype=dtype, dk_dtype=dtype, dw=w, **kw)
    dk, dv, dbeta, dgam = wy_bwd(k, v, beta, g_cum, ai, vn, du, None, None, 64, cu_seqlens=kw.get("cu_seqlens"),
                                 sub_indices=kw.get("tile_indices"), dk_add=dko, dk_dtype=dtype, dw=dw, pst=pst,
                                 sdst=sds)
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dgd", "dgam"), got, (dq, dk, dv, dbeta, dgd, dgam)):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), name
        assert rel_l2(a.float(), b.float()) < 1e-2, f"{name}: {rel_l2(a.float(), b.float()):.3e}"


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
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("segments", [1, 3])
def test_op_with_ws_bwd(varlen, segments):
    """The op with the one-kernel chunk gradients (default on Hopper) against the op on the ``tl`` kernels
    (``config={"dqkw": {"ws": False}}``) and the float64 recurrence's gradients: bf16, grouped value heads, initial
    and final state, whole sequences and pieces."""
    *res, ref = gdn_op_grads([{"dqkw": {"ws": ws}} for ws in (True, False)], varlen, segments, seed=17,
                             reference=True)
    for name, a_, b_, rf in zip(GDN_OP_NAMES, res[0][2:], res[1][2:], ref):
        assert torch.isfinite(a_).all(), name
        e_ws, e_tl = rel_l2(a_.double().cpu(), rf), rel_l2(b_.double().cpu(), rf)
        assert e_ws <= 1.15 * e_tl + 1e-4, f"{name}: ws {e_ws:.3e} vs tl {e_tl:.3e}"
