"""chunk_gla (vector decay) forward+backward with the gated operands of the intra-chunk products kept in
fp32 (TF32 products, ``tfla.ops.gla.chunk.VEC_F32 = True``, the default) or rounded to bf16 (False), on the
bench workload (B = 4, T = 8192, H = 16, K = V = 128, bf16, L = 64): ``do_bench`` median of one forward plus
``torch.autograd.grad``, and the rel-L2 of o and every gradient against tfla's fp32 run on the same inputs.

    python scripts/time_gla_vec.py [--B 4 --T 8192 --H 16 --K 128 --V 128 --L 64]
"""
from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import tfla
import tfla.ops.gla.chunk as gla_chunk
from tfla.bench.inputs import linear_attn_inputs
from tfla.utils.testing import rel_l2


def main() -> None:
    p = argparse.ArgumentParser()
    for n, d in (("B", 4), ("T", 8192), ("H", 16), ("K", 128), ("V", 128), ("L", 64)):
        p.add_argument(f"--{n}", type=int, default=d)
    a = p.parse_args()
    x = linear_attn_inputs(a.B, a.T, a.H, a.K, a.V, kind="vector", dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(a.B, a.T, a.H, a.V, generator=gen).to("cuda", torch.bfloat16)
    names = ["q", "k", "v", "g"]

    def run(leaves):
        o, _ = tfla.chunk_gla(*leaves, chunk_size=a.L)
        return [o.detach(), *torch.autograd.grad(o, leaves, do.to(o.dtype))]

    ref = run([x[n].float().requires_grad_() for n in names])
    leaves = [x[n].requires_grad_() for n in names]
    for flag in (True, False):
        gla_chunk.VEC_F32 = flag
        out = run(leaves)
        errs = " ".join(f"{n} {rel_l2(t.double(), r.double()):.2e}" for n, t, r in zip(["o"] + names, out, ref))
        ms = do_bench(lambda: run(leaves), warmup=10, rep=50, return_mode="median")
        print(f"VEC_F32={flag}: fwd+bwd {ms:.3f} ms | rel-L2 vs fp32 run: {errs}", flush=True)


if __name__ == "__main__":
    main()
