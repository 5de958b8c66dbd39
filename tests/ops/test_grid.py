"""Launch grids past CUDA's axis limits and 64-bit row offsets (``tfla/ops/common/grid.py``).

Inputs large enough to need them only fit a GPU (``test_large_inputs.py``); here every stage runs its flat grid and
its 64-bit offsets on small inputs (the config keys ``flat`` / ``idx64``), and must give bitwise the same result as
its default launch: the two forms index the same programs and the same elements.
"""
import pytest
import torch

from tfla.bench.inputs import gdn_inputs, random_cu_seqlens
from tfla.ops.common.chunk_state import chunk_state_fwd
from tfla.ops.common.cumsum import chunk_local_cumsum
from tfla.ops.common.grid import MAX_GRID_X, flat_grid, needs_int64, tile_grid
from tfla.ops.common.varlen import VarlenIndex
from tfla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd

FORCED = {"flat": True, "idx64": True}
STAGES = ("ut", "state", "state_lin", "state_bwd", "dqkw", "wy_bwd")


def test_tile_grid_goes_flat_only_past_the_limits():
    assert tile_grid(2, 65535, 65535) == ((2, 65535, 65535), False)
    assert tile_grid(2, 65536, 3) == ((2 * 65536 * 3,), True)
    assert tile_grid(2, 3, 65536) == ((2 * 3 * 65536,), True)
    assert tile_grid(4, 5, force_flat=True) == ((20,), True)
    with pytest.raises(ValueError, match="2147483647"):
        flat_grid(2**16, 2**16)
    assert flat_grid(MAX_GRID_X) == (MAX_GRID_X,)
    assert needs_int64(2**31) and not needs_int64(2**31 - 1)


def _equal(a, b, name):
    if a is None or b is None:
        assert a is None and b is None, name
        return
    assert torch.equal(a, b), f"{name}: the flat grid / 64-bit offsets changed the result"


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("save_v_new", [False, True])
def test_gdn_stages_flat_and_int64_equal_default(device, varlen, save_v_new):
    """GDN forward and backward (ut, the recompute's state passes, the state-gradient recurrence, dqkw, wy_bwd)
    with every stage forced to the flat grid and 64-bit offsets."""
    T, H, HV, K, V = 150, 1, 2, 32, 16
    cu = random_cu_seqlens(T, 3, seed=3, device=device) if varlen else None
    x = gdn_inputs(1 if varlen else 2, T, H, K, V, HV=HV, dtype=torch.float32, device=device, initial_state=True,
                   num_seqs=3 if varlen else None, seed=5)
    vl = VarlenIndex.build(cu, 64) if varlen else None
    outs = []
    for cfg in (None, {s: FORCED for s in STAGES}):
        o, s, inter = chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.3,
                                                 x["initial_state"], True, vl, config=cfg)
        gen = torch.Generator().manual_seed(1)
        do = torch.randn(o.shape, generator=gen).to(device)
        dht = torch.randn(s.shape, generator=gen).to(device)
        grads = chunk_gated_delta_rule_bwd(x["q"], x["k"], x["v"], inter["g_cum"], x["beta"], inter["ai"], 0.3,
                                           x["initial_state"], do, dht, vl, config=cfg,
                                           v_new=inter["v_new"] if save_v_new else None)
        outs.append((o, s) + tuple(grads))
    for name, a, b in zip(("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0"), *outs):
        _equal(a, b, name)


@pytest.mark.parametrize("varlen", [False, True])
def test_tiled_product_flat_equal_default(device, varlen):
    """The TFLA tiled product (``chunk_tiled``) in its forward form with states, its reverse form and its dual form
    (dq and dk from one launch, L = 64), at L = 64 and 128, on the flat grid with 64-bit offsets."""
    from tfla.ops.common.chunk_output import chunk_tiled, dual_supported, output_config

    T, H, K, V = 150, 2, 32, 16
    gen = torch.Generator().manual_seed(9)
    B = 1 if varlen else 2
    cu = random_cu_seqlens(T, 3, seed=5, device=device) if varlen else None
    q, k = (torch.randn(B, T, H, K, generator=gen).to(device) for _ in range(2))
    v, do = (torch.randn(B, T, H, V, generator=gen).to(device) for _ in range(2))
    g = -torch.rand(B, T, H, generator=gen).to(device)
    for L in (64, 128):
        vl = VarlenIndex.build(cu, L) if varlen else None
        g_cum = chunk_local_cumsum(g, L, scale=1.4426950408889634, cu_seqlens=cu,
                                   chunk_indices=vl.chunk_indices if vl else None)
        h, _ = chunk_state_fwd(k, v, g_cum, L, cu_seqlens=cu, chunk_offsets=vl.sub_offsets if vl else None,
                                  num_chunks=vl.sub_indices.shape[0] if vl else None, store_every_sub_chunk=True)
        for cfg in (None, FORCED):
            tiled = dict(cu_seqlens=cu, config=cfg)
            if vl is not None:
                tiled.update(tile_indices=vl.tiles(output_config(L, K, V, cfg)["BQ"]), chunk_offsets=vl.sub_offsets)
            dq_args = dict(h=h, state_every=64, state_transposed=True, rowdot_with=q, **tiled)
            res = [chunk_tiled(k, q, do, g_cum, 0.3, L, reverse=True, **tiled)]
            if dual_supported(L, V, K, q.dtype):
                res += list(chunk_tiled(do, v, k, g_cum, 0.3, L, dual_dtype=k.dtype, **dq_args))
            else:
                res += list(chunk_tiled(do, v, k, g_cum, 0.3, L, **dq_args))
            if cfg is None:
                ref = res
        for i, (a, b) in enumerate(zip(ref, res)):
            _equal(a, b, f"L={L} tiled output {i}")


@pytest.mark.parametrize("varlen", [False, True])
def test_cumsum_and_vector_gate_state_flat_equal_default(device, varlen):
    """The chunk cumsum (scalar and per-channel gates) and the linear-attention state pass with a vector gate
    (the GLA path of the state kernel) on the flat grid with 64-bit offsets."""
    T, H, K, V = 140, 2, 32, 16
    gen = torch.Generator().manual_seed(7)
    B = 1 if varlen else 2
    cu = random_cu_seqlens(T, 3, seed=4, device=device) if varlen else None
    bounds = cu.tolist() if varlen else None
    g = -torch.rand(B, T, H, generator=gen).to(device)
    gk = -torch.rand(B, T, H, K, generator=gen).to(device)
    wide = -torch.rand(B, T, H, 80, generator=gen).to(device)  # two 64-channel tiles (the grid's last axis)
    for x in (g, gk, wide):
        a = chunk_local_cumsum(x, 64, cu_seqlens=cu, bounds=bounds)
        b = chunk_local_cumsum(x, 64, cu_seqlens=cu, bounds=bounds, force_flat=True)
        _equal(a, b, f"cumsum {tuple(x.shape)}")
    k = torch.randn(B, T, H, K, generator=gen).to(device)
    v = torch.randn(B, T, H, V, generator=gen).to(device)
    gv = chunk_local_cumsum(gk, 64, cu_seqlens=cu, bounds=bounds)
    vl = VarlenIndex.build(cu, 64) if varlen else None
    kw = dict(output_final_state=True, gv_cum=gv, cu_seqlens=cu, chunk_offsets=vl.chunk_offsets if vl else None,
              num_chunks=vl.num_chunks if vl else None)
    a = chunk_state_fwd(k, v, None, 64, **kw)
    b = chunk_state_fwd(k, v, None, 64, config=FORCED, **kw)
    for name, x, y in zip(("h", "final"), a, b):
        _equal(x, y, f"vector-gate state {name}")


@pytest.mark.parametrize("gate", ["scalar", "split", "vector"])
def test_linear_state_kernels_longest_first_equal_given_order(device, gate):
    """The linear-attention state pass (with the normalizer state for split gates) and its state-gradient recurrence
    (with the rows of <S, dS>) with programs taking the packed sequences longest first (``seq_order``): bitwise the
    results of the given order."""
    from tfla.ops.common.chunk_state_bwd import chunk_state_bwd

    bounds = [0, 1, 1, 70, 130, 300]  # 64-row chunks 1, 0, 2, 1, 3
    cu = torch.tensor(bounds, device=device)
    T, H, K, V = bounds[-1], 2, 32, 16
    gen = torch.Generator().manual_seed(11)
    q, k = (torch.randn(1, T, H, K, generator=gen).to(device) for _ in range(2))
    v, do = (torch.randn(1, T, H, V, generator=gen).to(device) for _ in range(2))
    h0 = torch.randn(5, H, K, V, generator=gen).to(device)
    vl = VarlenIndex.build(cu, 64)
    assert vl.seq_order.tolist() == [4, 2, 0, 3, 1]
    g_cum = chunk_local_cumsum(-torch.rand(1, T, H, generator=gen).to(device), 64, scale=1.4426950408889634,
                               cu_seqlens=cu, bounds=bounds)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_offsets=vl.sub_offsets,
              num_chunks=vl.sub_indices.shape[0], store_every_sub_chunk=True)
    bkw = dict(dht=torch.randn(5, H, K, V, generator=gen).to(device), need_dh0=True, cu_seqlens=cu,
               sub_offsets=vl.sub_offsets, num_sub_chunks=vl.sub_indices.shape[0])
    if gate == "vector":
        kw["gv_cum"] = bkw["gv_cum"] = chunk_local_cumsum(-torch.rand(1, T, H, K, generator=gen).to(device), 64,
                                                          cu_seqlens=cu, bounds=bounds)
        g_cum, dvo = None, torch.randn(1, T, H, V, generator=gen).to(device)
    else:
        dvo = None
        if gate == "split":
            kw.update(gk_cum=g_cum - 0.5, gb=torch.zeros(1, T, H, device=device), n_state=True)
            bkw.update(gk_cum=g_cum - 0.5, gb=torch.zeros(1, T, H, device=device))
    res = []
    for order in (vl.seq_order, None):
        fwd = chunk_state_fwd(k, v, g_cum, 64, seq_order=order, **kw)
        h_sub = fwd[0].clone()
        bwd = chunk_state_bwd(q, k, None, do, dvo, g_cum, 0.3, 64, h_sub=h_sub, sds=True, seq_order=order, **bkw)
        res.append(tuple(fwd) + tuple(bwd) + (h_sub,))
    for i, (a, b) in enumerate(zip(*res)):
        assert (a is None and b is None) or torch.equal(a, b), f"{gate} gate: output {i} changed with the order"


def test_public_gdn_config_reaches_every_stage(device):
    """``chunk_gated_delta_rule(config=..)``: forced large-input indexing in every stage gives bitwise the default's
    outputs and gradients; a config that names no stage is an error."""
    import tfla
    from tfla.ops.gated_delta_rule.chunk import CONFIG_STAGES

    x = gdn_inputs(1, 130, 1, 32, 16, HV=2, dtype=torch.float32, device=device, initial_state=True, seed=2)
    outs = []
    for cfg in (None, {s: FORCED for s in CONFIG_STAGES if s != "slab"}):  # (slab: no kernel, chunks / count)
        leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]
        o, s = tfla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True, config=cfg)
        outs.append((o, s) + torch.autograd.grad(o.sum() + s.sum(), leaves))
    for i, (a, b) in enumerate(zip(*outs)):
        _equal(a, b, f"output {i}")
    with pytest.raises(ValueError, match="config"):
        tfla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], config={"stat": {}})


def test_host_ints():
    """``utils.host_ints``: equal values by a fill, others by a copy, in the dtype asked; empty lists."""
    from tfla.ops.common.utils import host_ints

    for vals, dt in (([5, 5, 5], torch.int32), ([0, 3, 1], torch.int64), ([], torch.int32), ([7], torch.int64)):
        t = host_ints(vals, "cpu", dt)
        assert t.dtype == dt and t.tolist() == vals
    if torch.cuda.is_available():
        assert host_ints([1, 2, 3], "cuda").cpu().tolist() == [1, 2, 3]
