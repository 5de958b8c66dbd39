"""One forward + backward of tfla's Gated DeltaNet for Nsight Compute (scripts/device_run.sh ncu).

python scripts/ncu_gdn.py [L]  — a warm-up call first (compiles), then the profiled call between
cudaProfilerStart/Stop (run ncu with --profile-from-start off).
"""
import sys

import torch

import tfla
from tfla.bench.inputs import gdn_inputs

L = int(sys.argv[1]) if len(sys.argv) > 1 else 64
x = gdn_inputs(4, 8192, 16, 128, 128, dtype=torch.bfloat16, device="cuda")
leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
do = torch.randn_like(x["v"])
for profiled in (False, True):
    if profiled:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    o, _ = tfla.chunk_gated_delta_rule(*leaves, chunk_size=L)
    torch.autograd.grad(o, leaves, do)
    torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
