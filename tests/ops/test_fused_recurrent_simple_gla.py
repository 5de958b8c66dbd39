"""``tfla.fused_recurrent_simple_gla`` (decode, forward only) against the float64 step recurrence: scalar / constant /
no decay, initial and final states, varlen with empty and one-token sequences, reverse, FLA's V-first state layout,
and chunked prefill followed by decode steps equal to one chunked call."""
import pytest
import torch

import tfla
from tfla.ops.simple_gla.reference import recurrent_simple_gla_ref
from tfla.utils.testing import assert_rel_close, tolerance

TOL = tolerance(torch.float32)


def _inputs(B, T, H, K, V, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, generator=gen)
    gamma = -torch.rand(H, generator=gen)
    return [t.to(device) for t in (q, k, v, g, gamma)]


@pytest.mark.parametrize("decay", ["g", "g_gamma", "none"])
@pytest.mark.parametrize("B,T,K,V,h0", [(2, 1, 16, 16, True), (1, 37, 32, 20, True), (3, 5, 20, 64, False)])
def test_vs_reference(device, decay, B, T, K, V, h0):
    q, k, v, g, gamma = _inputs(B, T, 2, K, V, device, seed=T)
    s0 = torch.randn(B, 2, K, V).to(device) if h0 else None
    kw = dict(g=g if decay == "g" else None, g_gamma=gamma if decay == "g_gamma" else None)
    o, s = tfla.fused_recurrent_simple_gla(q, k, v, **kw, initial_state=s0, output_final_state=True)
    d = {n: t.cpu().double() if t is not None else None for n, t in kw.items()}
    ro, rs = recurrent_simple_gla_ref(q.cpu().double(), k.cpu().double(), v.cpu().double(), **d,
                                      initial_state=s0.cpu().double() if h0 else None, output_final_state=True)
    assert o.dtype == q.dtype and s.dtype == torch.float32
    assert_rel_close("o", o.cpu(), ro, TOL)
    assert_rel_close("final_state", s.cpu(), rs, TOL)


@pytest.mark.parametrize("reverse", [False, True])
def test_varlen_reverse_and_v_first(device, reverse):
    """Packed sequences of 0, 1, 9 and 4 tokens; with ``reverse`` each runs from its last token (the reference on the
    time-flipped sequence, flipped back); states in FLA's V-first layout."""
    cu = torch.tensor([0, 0, 1, 10, 14], device=device)
    q, k, v, g, _ = _inputs(1, 14, 2, 16, 8, device, seed=3)
    s0 = torch.randn(4, 2, 8, 16).to(device)  # [N, H, V, K]
    o, s = tfla.fused_recurrent_simple_gla(q, k, v, g, initial_state=s0, output_final_state=True, reverse=reverse,
                                           state_v_first=True, cu_seqlens=cu)
    bounds = cu.tolist()
    for n, (b0, b1) in enumerate(zip(bounds[:-1], bounds[1:])):
        sl = [t[:, b0:b1].cpu().double() for t in (q, k, v, g)]
        if reverse:
            sl = [t.flip(1) for t in sl]
        ro, rs = recurrent_simple_gla_ref(*sl, initial_state=s0[n:n + 1].transpose(-1, -2).cpu().double(),
                                          output_final_state=True)
        if reverse:
            ro = ro.flip(1)
        if b1 > b0:
            assert_rel_close(f"o[{n}]", o[:, b0:b1].cpu(), ro, TOL)
        assert_rel_close(f"final_state[{n}]", s[n].transpose(-1, -2).cpu()[None], rs, TOL)


def test_chunked_prefill_then_decode(device):
    """A chunked prefill, then three one-token decode steps from its final state, equal one chunked call."""
    q, k, v, g, _ = _inputs(1, 73, 2, 16, 16, device, seed=5)
    o_all, s_all = tfla.chunk_simple_gla(q, k, v, g, output_final_state=True)
    o, s = tfla.chunk_simple_gla(q[:, :70], k[:, :70], v[:, :70], g[:, :70], output_final_state=True)
    outs = [o]
    for t in range(70, 73):
        o_t, s = tfla.fused_recurrent_simple_gla(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                                 initial_state=s, output_final_state=True)
        outs.append(o_t)
    assert_rel_close("o", torch.cat(outs, 1).cpu(), o_all.cpu().double(), TOL)
    assert_rel_close("final_state", s.cpu(), s_all.cpu().double(), TOL)


def test_forward_only_and_bad_input(device):
    q, k, v, g, gamma = _inputs(1, 4, 2, 16, 16, device)
    leaf = q.clone().requires_grad_()
    o, _ = tfla.fused_recurrent_simple_gla(leaf, k, v, g)
    with pytest.raises(NotImplementedError, match="forward-only"):
        o.sum().backward()
    with pytest.raises(ValueError, match="at most one"):
        tfla.fused_recurrent_simple_gla(q, k, v, g, g_gamma=gamma)
    with pytest.raises(ValueError, match="`g`"):
        tfla.fused_recurrent_simple_gla(q, k, v, g[..., :1])
    with pytest.raises(TypeError, match="reverse"):
        tfla.fused_recurrent_simple_gla(q, k, v, g, reverse=1)
