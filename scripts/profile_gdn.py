"""Per-stage times of tfla's Gated DeltaNet forward (GPU), to see where the time goes.

python scripts/profile_gdn.py [--B 4 --T 8192 --H 16 --K 128 --V 128] [--chunk-sizes 64,128,256,512]
Times each Triton stage alone with triton.testing.do_bench (median), on the inputs the stage gets
inside a real call. Prints one line per (L, stage) and the sum.
"""
import argparse

import torch
from triton.testing import do_bench

from tfla.bench.inputs import gdn_inputs
from tfla.ops.common.chunk_output import chunk_output_fwd
from tfla.ops.common.chunk_state import chunk_state_fwd
from tfla.ops.common.cumsum import chunk_local_cumsum
from tfla.ops.common.utils import RCP_LN2
from tfla.ops.common.ut_transform import ut_transform_fwd


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--chunk-sizes", default="64,128,256,512")
    p.add_argument("--backward", action="store_true", help="time the backward stages instead")
    a = p.parse_args()
    x = gdn_inputs(a.B, a.T, a.H, a.K, a.V, dtype=torch.bfloat16, device="cuda")
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    scale = a.K ** -0.5
    bench = lambda f: do_bench(f, warmup=25, rep=100, return_mode="median")  # noqa: E731
    print(f"stage times, B={a.B} T={a.T} H={a.H} K={a.K} V={a.V} bf16, {torch.cuda.get_device_name(0)}")
    if a.backward:
        return backward(a, q, k, v, g, beta, scale, bench)
    for L in [int(s) for s in a.chunk_sizes.split(",")]:
        g_cum = chunk_local_cumsum(g, L, scale=RCP_LN2)
        w, u, _ = ut_transform_fwd(k, v, g_cum, beta, L)
        h, v_new, _ = chunk_state_fwd(k, u, g_cum, L, w=w)
        t = {
            "cumsum": bench(lambda: chunk_local_cumsum(g, L, scale=RCP_LN2)),
            "ut": bench(lambda: ut_transform_fwd(k, v, g_cum, beta, L)),
            "state": bench(lambda: chunk_state_fwd(k, u, g_cum, L, w=w)),
            "output": bench(lambda: chunk_output_fwd(q, k, v_new, h, g_cum, scale, L)),
        }
        parts = "  ".join(f"{n} {ms:.3f}" for n, ms in t.items())
        print(f"L={L:4d}  {parts}  sum {sum(t.values()):.3f} ms")


def backward(a, q, k, v, g, beta, scale, bench):
    from tfla.ops.common.chunk_output import chunk_tiled
    from tfla.ops.common.chunk_state import chunk_state_bwd
    from tfla.ops.common.ut_transform import wy_bwd
    from tfla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd

    do = torch.randn_like(v)
    for L in [int(s) for s in a.chunk_sizes.split(",")]:
        _, _, inter = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, None, False, L)
        g_cum, ai = inter["g_cum"], inter["ai"]
        w, u, _ = ut_transform_fwd(k, v, g_cum, beta, L, ai=ai)
        h_sub, v_new, _ = chunk_state_fwd(k, u, g_cum, L, w=w, store_every_sub_chunk=True)
        dvo = chunk_tiled(k, q, do, g_cum, scale, L, reverse=True)
        dh_sub, du, _ = chunk_state_bwd(q, k, w, do, dvo, g_cum, scale, L)
        t = {
            "wy": bench(lambda: ut_transform_fwd(k, v, g_cum, beta, L, ai=ai)),
            "state_fwd": bench(lambda: chunk_state_fwd(k, u, g_cum, L, w=w, store_every_sub_chunk=True)),
            "dv": bench(lambda: chunk_tiled(k, q, do, g_cum, scale, L, reverse=True)),
            "dq": bench(lambda: chunk_tiled(do, v_new, k, g_cum, scale, L, h=h_sub, state_every=64,
                                            state_transposed=True, rowdot_with=q, out_dtype=torch.float32)),
            "dk": bench(lambda: chunk_tiled(v_new, do, q, g_cum, scale, L, reverse=True, rowdot_with=k,
                                            out_dtype=torch.float32)),
            "state_bwd": bench(lambda: chunk_state_bwd(q, k, w, do, dvo, g_cum, scale, L)),
            "wy_bwd": bench(lambda: wy_bwd(k, v, beta, g_cum, ai, v_new, du, h_sub, dh_sub, L)),
        }
        total = bench(lambda: chunk_gated_delta_rule_bwd(q, k, v, g_cum, beta, ai, scale, None, do, None, L))
        parts = "  ".join(f"{n} {ms:.3f}" for n, ms in t.items())
        print(f"L={L:4d}  {parts}  sum {sum(t.values()):.3f}  whole bwd {total:.3f} ms")


if __name__ == "__main__":
    main()
