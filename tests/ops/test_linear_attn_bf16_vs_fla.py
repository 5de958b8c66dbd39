"""bf16 on the GPU: tfla's linear-attention ops (chunk_linear_attn, chunk_retention, chunk_simple_gla,
chunk_gla), output and every gradient, no worse than FLA's on the same inputs; both measured against the
float64 step-by-step recurrence on the same rounded inputs (relative L2 per tensor)."""
import os

import pytest
import torch

from tfla.bench.common import rel_l2
from tfla.bench.inputs import linear_attn_inputs
from tfla.bench.linear_attn import _slice_reference_fn, random_cotangent, run_checked
from tfla.bench.registry import fla_linear_attn_impl, tfla_linear_attn_impl


@pytest.mark.gpu
@pytest.mark.parametrize("L", [64, 128])
@pytest.mark.parametrize("kind", ["none", "constant", "scalar", "vector"])
def test_bf16_no_worse_than_fla(kind, L):
    pytest.importorskip("fla.ops")
    if kind == "vector" and not os.environ.get("TFLA_TEST_FLA_GLA"):
        # FLA 0.6.0's chunk_gla did not finish compiling/autotuning within 400 s on an H100 (Triton 3.6),
        # and pytest-timeout could not interrupt it; opt in with TFLA_TEST_FLA_GLA=1 after compiling its
        # configs in parallel (2026-11-23)
        pytest.skip("FLA's chunk_gla compile is too slow here; set TFLA_TEST_FLA_GLA=1 to run")
    fla = fla_linear_attn_impl(kind)
    if fla is None:
        pytest.skip(f"FLA's {kind} op does not import here")
    B, T, H, K, V = 2, 512, 4, 64, 64
    x = linear_attn_inputs(B, T, H, K, V, kind=kind, dtype=torch.bfloat16, device="cuda", seed=L)
    leaves = ["q", "k", "v"] + (["g"] if x["g"] is not None else [])
    do = random_cotangent((B, T, H, V), torch.bfloat16, "cuda", seed=L)
    ours = run_checked(tfla_linear_attn_impl(kind, L).fn, x, leaves, do)
    try:
        theirs = run_checked(fla.fn, x, leaves, do)
    except RuntimeError as e:  # FLA 0.6.0 refuses its gated backward on Hopper with Triton < 3.7.1
        if "tilelang" not in str(e):
            raise
        pytest.skip(f"FLA's backward refuses here: {str(e)[:100]}")
    x64 = {n: (t.double() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    ref = run_checked(_slice_reference_fn(kind), x64, leaves, do.double())
    (o_t, g_t), (o_f, g_f), (o_r, g_r) = ours, theirs, ref
    for name, a, b, r in [("o", o_t, o_f, o_r)] + [(d, g_t[d], g_f[d], g_r[d]) for d in g_r]:
        e_t, e_f = rel_l2(a.double(), r), rel_l2(b.double(), r)
        print(f"bf16 {kind} L={L} {name}: tfla {e_t:.3e} | FLA {e_f:.3e}")
        assert torch.isfinite(a).all(), name
        assert e_t <= 1.1 * e_f + 1e-4, name
