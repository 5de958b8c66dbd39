"""GPU check of the state backward's dS-over-S path (chunk_state_bwd(h_sub=.., sds=True)): one launch config per
process (an illegal address poisons the context), CUDA_LAUNCH_BLOCKING=1 so the failing kernel is the one named.
It found (H100, Triton 3.6, bf16): a barrier between S's read and dS's store faults at 1 and 2 stages; the data
dependency now in the kernel runs at 2 stages; at 1 stage the plain launch (no dS over S, the first call below)
faults already, so 16-bit launches now pipeline 2 stages and a 1-stage override keeps dS apart. Triton 3.9 runs
every config (docs/results/h100-2026-11-23c/dbgsds_*.log).

    python scripts/debug_sds.py STAGES DTYPE [T]   # STAGES 1|2, DTYPE bfloat16|float16|float32
"""
import os
import sys

os.environ.setdefault("CUDA_LAUNCH_BLOCKING", "1")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tfla.ops.common.chunk_state as cs  # noqa: E402
from tfla.ops.common.ut_transform import wy_bwd  # noqa: E402

stages, dtype = int(sys.argv[1]), getattr(torch, sys.argv[2])
T = int(sys.argv[3]) if len(sys.argv) > 3 else 512
B, H, K, V, L = 2, 4, 128, 128, 64
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
q, k = (torch.randn(B, T, H, K, device=dev, dtype=dtype) * K ** -0.5 for _ in range(2))
v, do = (torch.randn(B, T, H, V, device=dev, dtype=dtype) for _ in range(2))
g = (F.logsigmoid(torch.randn(B, T, H, device=dev) + 3) * 1.44).view(B, T // L, L, H).cumsum(2).view(B, T, H)
h_sub, _, _ = cs.chunk_state_fwd(k, v, g, L, store_every_sub_chunk=True)
cfg = {"num_stages": stages}
tag = f"stages={stages} {sys.argv[2]} T={T}"
try:
    dh, du, _ = cs.chunk_state_bwd(q, k, None, do, None, g, 0.1, L, config=cfg)
    torch.cuda.synchronize() if dev == "cuda" else None
    s = h_sub.clone()
    dh2, du2, _, sds = cs.chunk_state_bwd(q, k, None, do, None, g, 0.1, L, config=cfg, h_sub=s, sds=True)
    torch.cuda.synchronize() if dev == "cuda" else None
    if sds is None:
        print(tag, "state_bwd kept dS apart (16-bit, one stage)")
        sys.exit(0)
    print(tag, "state_bwd ok; dh equal", torch.equal(dh2, dh), "du equal", torch.equal(du2, du))
    want = (h_sub.float() * dh.float()).sum(-1)
    err = ((sds.sum(3) - want).norm() / want.norm()).item()
    print(tag, "sds rel err", err)
    dg = wy_bwd(k, None, None, g, None, v, None, None, dh2, L, sds_sub=sds)[3]
    dg_ref = wy_bwd(k, None, None, g, None, v, None, h_sub, dh, L)[3]
    torch.cuda.synchronize() if dev == "cuda" else None
    print(tag, "wy_bwd ok; dg rel diff", ((dg - dg_ref).norm() / dg_ref.norm()).item())
except Exception as e:  # noqa: BLE001
    print(tag, "FAILED:", type(e).__name__, str(e).splitlines()[0][:200])
