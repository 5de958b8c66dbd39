"""Launch configs of the normalizer state's gradient (``_normalizer_state_bwd_kernel``) at the mLSTM workload.

python scripts/tune_dn.py   (GPU; B=8 T=8192 H=16 K=128, bf16 q, fp32 gates / dden, backward at L = 64)
Times ``chunk_state_bwd``'s normalizer launch alone (the main recurrence skipped by timing both and subtracting
is noisy, so the kernel is called through the host function with a V = 16 value tensor and reported whole, and
the same call with dden=None is timed as the baseline)."""
import torch
from triton.testing import do_bench

from tfla.ops.common.chunk_state import chunk_state_bwd


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, K, V, L = 8, 8192, 16, 128, 16, 64
    q, k = (torch.randn(B, T, H, K, device="cuda", generator=gen).bfloat16() for _ in range(2))
    do = torch.randn(B, T, H, V, device="cuda", generator=gen).bfloat16()
    g = -torch.rand(B, T, H, device="cuda", generator=gen).cumsum(1) * 0.01
    dden = torch.randn(B, T, H, device="cuda", generator=gen)
    base = do_bench(lambda: chunk_state_bwd(q, k, None, do, None, g, 0.1, L), warmup=10, rep=50)
    print(f"without dn: {base:.3f} ms")
    for bk in (16, 32, 64):
        for warps in (1, 2, 4):
            for stages in (2, 3, 4):
                cfg = {"n_bk": bk, "n_warps": warps, "n_stages": stages}
                ms = do_bench(lambda: chunk_state_bwd(q, k, None, do, None, g, 0.1, L, dden=dden, config=cfg),
                              warmup=10, rep=50)
                print(f"n_bk {bk:3d} warps {warps} stages {stages}: {ms:.3f} ms (dn ~{ms - base:.3f})")


if __name__ == "__main__":
    main()
