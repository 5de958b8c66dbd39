"""The fused gated-delta-rule forward (``tfla/ops/common/fused_delta_fwd.py``) against the float64 recurrence: fp32,
T = 1 and T not a multiple of 64, grouped value heads, initial and final state, varlen with sequences of length 0 and
1, head dims that are not powers of two, zero / strong / no gates, the flat grid and 64-bit offsets."""
import pytest
import torch

from tfla.bench.inputs import gdn_inputs
from tfla.ops.common.fused_delta_fwd import fused_delta_fwd
from tfla.ops.common.varlen import VarlenIndex
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
    sub = VarlenIndex.build(cu, 64).sub_indices if varlen else None
    scale = K ** -0.5
    o, s = fused_delta_fwd(x["q"], x["k"], x["v"], g, x["beta"], scale, x["initial_state"], True, cu_seqlens=cu,
                           sub_indices=sub)
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
    a = fused_delta_fwd(*args)
    b = fused_delta_fwd(*args, config={"flat": True, "idx64": True})
    for u, w in zip(a, b):
        assert torch.equal(u, w)


@pytest.mark.parametrize("segments", [1, 2, 4])
@pytest.mark.parametrize("varlen", [False, True])
def test_fused_delta_fwd_segments_match_recurrence(device, poison_empty, segments, varlen):
    """Pieces of a sequence in parallel with the exact start states from the [M | N] scan (pieces shorter than 64
    rows, sequences of length 0 and 1, shorter and longer than a piece)."""
    from tfla.ops.common.fused_delta_fwd import fused_delta_fwd_segmented

    T = 330
    cu = torch.tensor([0, 1, 1, 70, 330], device=device) if varlen else None
    x = gdn_inputs(1 if varlen else 2, T, 1, 32, 16, HV=2, dtype=torch.float32, device=device, gate="strong",
                   initial_state=True, num_seqs=4 if varlen else None, seed=segments)
    o, s = fused_delta_fwd_segmented(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.3, x["initial_state"], True,
                                     cu_seqlens=cu, segments=segments)
    r = {n: t.double().cpu() for n, t in x.items()}
    ro, rs = recurrent_gated_delta_rule_ref(r["q"], r["k"], r["v"], r["g"], r["beta"], scale=0.3,
                                            initial_state=r["initial_state"], output_final_state=True,
                                            cu_seqlens=cu.cpu() if cu is not None else None)
    assert_rel_close("o", o.cpu(), ro, tolerance(torch.float32))
    assert_rel_close("final_state", s.cpu(), rs, tolerance(torch.float32))


def test_segment_bounds():
    from tfla.ops.common.fused_delta_fwd import segment_bounds

    assert segment_bounds([0, 300], 2) == ([0, 192, 300], [0, 2])
    assert segment_bounds([0, 0, 1, 65], 4) == ([0, 0, 1, 65], [0, 1, 2, 3])
    assert segment_bounds([0, 1000], 4) == ([0, 256, 512, 768, 1000], [0, 4])
    with pytest.raises(ValueError, match="segments"):
        segment_bounds([0, 10], 0)
