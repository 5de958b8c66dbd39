"""The warp-specialized Gluon forward pass (``tfla/ops/common/fused_delta_ws.py``, Hopper only) against the ``tl``
pass and the float64 recurrence: T = 1 and T not a multiple of 64, varlen with sequences of length 0 and 1, grouped
value heads, initial and final state, Vnew kept, one and two consumer warpgroups, bf16 and fp16, strong gates; and
through the op, forward and backward. Where the pass does not apply (CPU, fp32, K != 128) the dispatch keeps the
``tl`` pass."""
import pytest
import torch

from tfla.bench.inputs import gdn_inputs
from tfla.ops.common.fused_delta_fwd import SAVE_STATES, SAVE_V_NEW, fused_delta_fwd
from tfla.ops.common.fused_delta_ws import HAVE_GLUON, ws_supported
from tfla.ops.gated_delta_rule.reference import recurrent_gated_delta_rule_ref
from tfla.utils.testing import GDN_OP_NAMES, gdn_op_grads, rel_l2

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and HAVE_GLUON
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU and Triton's Gluon")

CASES = [  # (B, T, H, HV, lens, gate, dtype, ws config)
    (1, 1, 1, 1, None, "default", torch.bfloat16, None),
    (2, 200, 2, 4, None, "default", torch.bfloat16, None),
    (1, 1000, 1, 2, None, "strong", torch.float16, None),
    (1, 1171, 2, 2, [0, 1, 64, 130, 5, 971], "default", torch.bfloat16, None),
    (1, 1171, 2, 4, [0, 1, 64, 130, 5, 971], "strong", torch.bfloat16, {"NCONS": 1, "BV": 64}),
    (3, 257, 1, 2, None, "zero", torch.bfloat16, {"NCONS": 1, "BV": 32}),
]


def _run(x, cu, ws, save):
    out = fused_delta_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5, x["initial_state"], True,
                          cu_seqlens=cu, segments=1, save=save, config={"ws": ws})
    return out["o"], out["final_state"], out["v_new"], out["h"]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("B,T,H,HV,lens,gate,dtype,cfg", CASES)
@pytest.mark.parametrize("save", [0, SAVE_V_NEW, SAVE_STATES])
def test_ws_pass_matches_tl_pass_and_recurrence(B, T, H, HV, lens, gate, dtype, cfg, save):
    cu = None
    N = B
    if lens is not None:
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda")
        N = len(lens)
    x = gdn_inputs(B, T, H, 128, 128, HV=HV, dtype=dtype, device="cuda", gate=gate, initial_state=True,
                   num_seqs=N, seed=T + HV)
    q, k, v = x["q"], x["k"], x["v"]
    assert ws_supported(q, k, v, True, x["initial_state"], cu, save, cfg)
    got = _run(x, cu, cfg or True, save)
    tl = _run(x, cu, False, save)
    r = {n: t.double().cpu() for n, t in x.items()}
    ro, rs = recurrent_gated_delta_rule_ref(r["q"], r["k"], r["v"], r["g"], r["beta"], scale=128 ** -0.5,
                                            initial_state=r["initial_state"], output_final_state=True,
                                            cu_seqlens=cu.cpu() if cu is not None else None)
    for name, a_, b_, ref in (("o", got[0], tl[0], ro), ("final_state", got[1], tl[1], rs)):
        e_ws, e_tl = rel_l2(a_.double().cpu(), ref), rel_l2(b_.double().cpu(), ref)
        assert torch.isfinite(a_).all(), name
        # the same rounding budget as the tl pass (the gate weights round on Vnew instead of k)
        assert e_ws <= 1.15 * e_tl + 1e-4, f"{name}: ws {e_ws:.3e} vs tl {e_tl:.3e}"
    if save:
        assert rel_l2(got[2].float(), tl[2].float()) < 1e-2
    else:
        assert got[2] is None
    if save == SAVE_STATES:  # the states before each chunk, as the tl pass keeps them
        assert got[3].shape == tl[3].shape
        assert rel_l2(got[3].float(), tl[3].float()) < 1e-2
    else:
        assert got[3] is None


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("save", [0, SAVE_STATES])
def test_ws_pass_longest_first_is_bitwise_the_same(save):
    """Programs that take the packed sequences longest first (``varlen.longest_first_order``, the default wherever
    the offsets are not in that order) change which CTA runs which sequence, not one product: o, the final state,
    Vnew and the states equal the in-order launch's bit for bit."""
    from tfla.ops.common.varlen import chunk_tables

    lens = [0, 1, 64, 130, 5, 971]
    bounds = [0] + torch.tensor(lens).cumsum(0).tolist()
    cu = torch.tensor(bounds, device="cuda")
    x = gdn_inputs(1, bounds[-1], 2, 128, 128, HV=4, dtype=torch.bfloat16, device="cuda", gate="default",
                   initial_state=True, num_seqs=len(lens), seed=5)
    idx, offs, order = chunk_tables(bounds, 64, "cuda")
    assert order.tolist() == [5, 3, 1, 2, 4, 0]
    got, want = (fused_delta_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5, x["initial_state"], True,
                                 cu_seqlens=cu, bounds=bounds, segments=1, save=save, sub_tables=(idx, offs, o))
                 for o in (order, None))
    for name in ("o", "final_state", "v_new", "h"):
        if got[name] is None:
            assert want[name] is None
        else:
            assert torch.equal(got[name], want[name]), name


def test_ws_pass_not_taken_where_it_does_not_apply(device):
    """CPU tensors, fp32, K != 128, no gate, an unknown ``save``, too many (sequence, head) pairs: the tl pass."""
    x = gdn_inputs(1, 70, 1, 128, 128, dtype=torch.float16, device=device, seed=1)
    q, k, v = x["q"], x["k"], x["v"]
    if device == "cuda" and SM90:
        assert ws_supported(q, k, v, True, None, None, 0)
        assert ws_supported(q, k, v, True, None, None, SAVE_V_NEW)
        assert ws_supported(q, k, v, True, None, None, SAVE_STATES)
    assert not ws_supported(q, k, v, True, None, None, 3)
    assert not ws_supported(q, k, v, False, None, None, 0)  # no gate
    assert not ws_supported(q.float(), k.float(), v.float(), True, None, None, 0)
    x64 = gdn_inputs(1, 70, 1, 64, 128, dtype=torch.float16, device=device, seed=1)
    assert not ws_supported(x64["q"], x64["k"], x64["v"], True, None, None, 0)
    cu = torch.arange(0, 70001, device=device)  # 70,000 one-token sequences x 1 head
    assert not ws_supported(q, k, v, True, None, cu, 0)
    if device == "cpu":
        assert not ws_supported(q, k, v, True, None, None, 0)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("segments", [1, 3])
def test_op_with_ws_pass_matches_tl_pass_forward_and_backward(varlen, segments):
    """``chunk_gated_delta_rule`` forward + backward with the Gluon pass against the same op on the tl pass
    (``config={"fused": {"ws": False}}``): bf16, grouped value heads, initial and final state; whole sequences and
    sequences cut in pieces (the Gluon transitions, per-chunk states kept for the backward)."""
    res = gdn_op_grads([{"fused": {"ws": ws}} for ws in (True, False)], varlen, segments, seed=7)
    for name, a_, b_ in zip(("o", "final_state") + GDN_OP_NAMES, *res):
        assert torch.isfinite(a_).all(), name
        assert rel_l2(a_.float(), b_.float()) < 2e-2, name


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("segments,lens,cfg,save", [
    (2, None, None, 0),
    (4, [0, 1, 700, 130, 64, 1276], None, SAVE_STATES),
    (3, [0, 1, 700, 130, 64, 1276], {"NCONS": 2, "BV": 32}, 0),
    (4, None, {"NCONS": 1, "BV": 64}, SAVE_STATES),
])
def test_ws_transitions_match_tl_and_recurrence(segments, lens, cfg, save):
    """Sequences cut into pieces: the pieces' ``[M | N]`` from the Gluon transition pass against the ``tl``
    transition pass, the op's output and final states against the float64 recurrence, and (``save`` 2, as under
    autograd) Vnew and the per-chunk states against the ``tl`` pass's (bf16, grouped value heads, initial state;
    config None: the pieces' default launch)."""
    B, T = (2, 1100) if lens is None else (1, sum(lens))
    cu = None if lens is None else torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda")
    N = B if lens is None else len(lens)
    x = gdn_inputs(B, T, 2, 128, 128, HV=4, dtype=torch.bfloat16, device="cuda", initial_state=True,
                   num_seqs=N, seed=segments)
    outs = []
    for ws in (cfg or True, False):
        out = fused_delta_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 128 ** -0.5, x["initial_state"], True,
                              cu_seqlens=cu, segments=segments, save=save, config={"ws": ws})
        assert "split" in out
        outs.append(out)
    mn_ws, mn_tl = outs[0]["split"].mn, outs[1]["split"].mn
    assert torch.isfinite(mn_ws).all()
    assert rel_l2(mn_ws, mn_tl) < 1e-2
    r = {n: t.double().cpu() for n, t in x.items()}
    ro, rs = recurrent_gated_delta_rule_ref(r["q"], r["k"], r["v"], r["g"], r["beta"], scale=128 ** -0.5,
                                            initial_state=r["initial_state"], output_final_state=True,
                                            cu_seqlens=cu.cpu() if cu is not None else None)
    for name, ref in (("o", ro), ("final_state", rs)):
        e_ws = rel_l2(outs[0][name].double().cpu(), ref)
        e_tl = rel_l2(outs[1][name].double().cpu(), ref)
        assert e_ws <= 1.15 * e_tl + 1e-4, f"{name}: ws {e_ws:.3e} vs tl {e_tl:.3e}"
    if save:
        for name in ("v_new", "h"):
            assert outs[0][name].shape == outs[1][name].shape
            assert rel_l2(outs[0][name].float(), outs[1][name].float()) < 1e-2, name


@pytest.mark.skipif(not HAVE_GLUON, reason="needs Triton's Gluon")
def test_tma_desc_equals_the_checked_descriptor():
    """``tma_desc`` (the descriptor filled in without ``TensorDescriptor``'s Python checks) holds what the checked
    dataclass holds, and takes the checked path, which raises, where its conditions fail: a base off 16 bytes, a
    non-contiguous tensor, too few elements for the matrix, fp32 elements."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from tfla.ops.common.fused_delta_ws import _smem_layout, tma_desc

    x = torch.randn(2, 192, 3, 64).to(torch.bfloat16)
    d = tma_desc(x, 2 * 192, 3 * 64, [64, 64], True)
    ref = TensorDescriptor(x.view(384, 192), [384, 192], [192, 1], [64, 64], _smem_layout((64, 64), True))
    assert isinstance(d, TensorDescriptor)
    for name in ("shape", "strides", "block_shape", "layout", "padding", "round_f32_to_tf32"):  # (as this Triton has)
        assert getattr(d, name, None) == getattr(ref, name, None), name
    assert (d.base.data_ptr(), d.base.dtype) == (ref.base.data_ptr(), ref.base.dtype)
    flat = torch.zeros(384 * 192 + 8, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="16-byte"):
        tma_desc(flat[1:1 + 384 * 192], 384, 192, [64, 64], True)
    with pytest.raises(RuntimeError):  # not viewable as the matrix
        tma_desc(x.transpose(1, 2), 384, 192, [64, 64], True)
    with pytest.raises(RuntimeError):
        tma_desc(x[:1], 384, 192, [64, 64], True)
    with pytest.raises(AssertionError):  # fp32 against a 16-bit layout
        tma_desc(x.float(), 384, 192, [64, 64], True)
