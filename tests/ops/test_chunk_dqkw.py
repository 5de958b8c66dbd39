"""The backward stage chunk_dqkw (dq, dk, dW and the state parts of dg of the gated delta rule) alone, against its
formulas in float64 PyTorch on random states, state gradients and gradients of Vnew (the whole GDN backward with it:
tests/ops/test_gated_delta_rule_bwd.py)."""
import pytest
import torch

import tfla
from tfla.bench.inputs import gdn_inputs, random_cu_seqlens
from tfla.ops.common.chunk_dqkw import chunk_dqkw_bwd
from tfla.ops.common.utils import RCP_LN2
from tfla.ops.common.varlen import VarlenIndex
from tfla.utils.testing import assert_rel_close

TOL = 1e-5  # fp32 (IEEE dots through the interpreter, tf32x3 on the GPU)


def _dqkw_ref(q, k, v_new, do, du, h_sub, dh_sub, g_cum, scale, bounds):
    """The module docstring's formulas, chunk by chunk (64 rows, restarting at every sequence start), float64."""
    B, T, H, K = q.shape
    HV = do.shape[2]
    f = lambda x: x.detach().cpu().double()  # noqa: E731
    q, k, v_new, do, du, h_sub, dh_sub = map(f, (q, k, v_new, do, du, h_sub, dh_sub))
    g = f(g_cum) if g_cum is not None else torch.zeros(B, T, HV, dtype=torch.float64)
    dq = torch.zeros(B, T, HV, K, dtype=torch.float64)
    dk, dw = torch.zeros_like(dq), torch.zeros_like(dq)
    dgd = torch.zeros(B, T, HV, dtype=torch.float64)
    pst = torch.zeros_like(dgd)
    sds = torch.zeros(h_sub.shape[:3], dtype=torch.float64)
    for b in range(B):
        slot = 0 if len(bounds) > 2 else None
        seqs = list(zip(bounds[:-1], bounds[1:])) if len(bounds) > 2 else [(0, T)]
        for bos, eos in seqs:
            for j, t0 in enumerate(range(bos, eos, 64)):
                t1 = min(t0 + 64, eos)
                s_idx = (slot + j) if slot is not None else j
                for hv in range(HV):
                    h = hv // (HV // H)
                    S, dS = h_sub[b, s_idx, hv], dh_sub[b, s_idx, hv]
                    G = g[b, t0:t1, hv]
                    Q, Kk = q[b, t0:t1, h], k[b, t0:t1, h]
                    DO, VN, DU = do[b, t0:t1, hv], v_new[b, t0:t1, hv], du[b, t0:t1, hv]
                    sc = DO @ VN.T
                    n = t1 - t0
                    lower = torch.tril(torch.ones(n, n, dtype=torch.bool), -1)
                    P = torch.where(lower, sc * torch.exp2(G[:, None] - G[None, :]), 0.0)
                    d = torch.diagonal(sc)
                    dq_off = scale * (torch.exp2(G)[:, None] * (DO @ S.T) + P @ Kk)
                    dk_off = scale * (P.T @ Q)
                    dks = torch.exp2(G[-1] - G)[:, None] * (VN @ dS.T)
                    dq[b, t0:t1, hv] = dq_off + scale * d[:, None] * Kk
                    dk[b, t0:t1, hv] = dk_off + scale * d[:, None] * Q + dks
                    dw[b, t0:t1, hv] = -(DU @ S.T)
                    dgd[b, t0:t1, hv] = (Q * dq_off).sum(1) - (Kk * dk_off).sum(1)
                    pst[b, t0:t1, hv] = (Kk * dks).sum(1)
                    sds[b, s_idx, hv] = (S * dS).sum()
            if slot is not None:
                slot += -(-(eos - bos) // 64)
    return dict(dq=dq, dk=dk, dw=dw, dgd=dgd, pst=pst, sds=sds)


@pytest.mark.parametrize("B,T,H,HV,K,V,gated,varlen", [
    (2, 130, 1, 2, 32, 48, True, False),   # T not a multiple of 64, grouped value heads
    (1, 64, 2, 2, 80, 40, True, False),    # two key tiles (partial sums), masked key and value columns
    (1, 1, 1, 1, 16, 16, True, False),     # T = 1
    (1, 100, 1, 1, 32, 32, False, False),  # no gate
    (1, 300, 2, 4, 32, 16, True, True),    # varlen
])
def test_chunk_dqkw_matches_formulas(device, poison_empty, B, T, H, HV, K, V, gated, varlen):
    gen = torch.Generator().manual_seed(T + K)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    bounds = [0, T]
    cu = tiles = offsets = None
    if varlen:
        cu = random_cu_seqlens(T, 3, seed=T, device=device)
        idx = VarlenIndex.build(cu, 64)
        bounds, tiles, offsets = idx.bounds, idx.sub_indices, idx.sub_offsets
        NS = idx.sub_indices.shape[0]
    else:
        NS = -(-T // 64)
    q, k = rnd(B, T, H, K), rnd(B, T, H, K)
    v_new, do, du = rnd(B, T, HV, V), rnd(B, T, HV, V), rnd(B, T, HV, V)
    h_sub, dh_sub = rnd(B, NS, HV, K, V), rnd(B, NS, HV, K, V)
    g_cum = None
    if gated:  # chunk-local cumulative log2 gates, restarting every 64 rows of each sequence
        from tfla.ops.common.cumsum import chunk_local_cumsum
        g = torch.nn.functional.logsigmoid(rnd(B, T, HV) + 1.0)
        g_cum = chunk_local_cumsum(g, 64, scale=RCP_LN2, cu_seqlens=cu,
                                   chunk_indices=tiles if varlen else None)
    scale = K ** -0.5
    dq, dk, dw, dgd, pst, sds = chunk_dqkw_bwd(q, k, v_new, do, du, h_sub, dh_sub, g_cum, scale, cu_seqlens=cu,
                                               tile_indices=tiles, sub_offsets=offsets)
    ref = _dqkw_ref(q, k, v_new, do, du, h_sub, dh_sub, g_cum, scale, bounds)
    for name, out in dict(dq=dq, dk=dk, dw=dw, dgd=dgd, pst=pst, sds=sds).items():
        assert_rel_close(name, out.cpu(), ref[name], TOL)


def test_chunk_dqkw_rejects_bad_shapes(device):
    q = torch.zeros(1, 64, 1, 16, device=device)
    v = torch.zeros(1, 64, 1, 16, device=device)
    h = torch.zeros(1, 1, 1, 16, 16, device=device)
    with pytest.raises(ValueError, match="h_sub"):
        chunk_dqkw_bwd(q, q, v, v, v, h, h[..., :8], None, 1.0)
    with pytest.raises(ValueError, match="dw"):
        chunk_dqkw_bwd(q, q, v, v, v, h, h, None, 1.0, dw=torch.zeros(1, 64, 1, 8, device=device))
