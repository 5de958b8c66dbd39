"""Time the first (compiling) and second call of tfla's GDN forward+backward per shape and dtype on the
GPU, with an all-thread traceback if one call runs past --dump seconds (a stall vs a slow compile)."""
import argparse
import faulthandler
import sys
import time

import torch

import tfla
from tfla.bench.inputs import gdn_inputs

p = argparse.ArgumentParser()
p.add_argument("--shapes", default="1,300,1,2,128,128,256;1,200,1,1,100,200,128")
p.add_argument("--dtype", default="float32")
p.add_argument("--dump", type=float, default=240)
a = p.parse_args()
dtype = getattr(torch, a.dtype)
faulthandler.dump_traceback_later(a.dump, repeat=True, file=sys.stdout)
for spec in a.shapes.split(";"):
    B, T, H, HV, K, V, L = map(int, spec.split(","))
    x = gdn_inputs(B, T, H, K, V, HV=HV, dtype=dtype, device="cuda", initial_state=True)
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]
    for rep in range(2):
        t0 = time.time()
        o, s = tfla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True, chunk_size=L)
        torch.cuda.synchronize(); t1 = time.time()
        g = torch.autograd.grad(o.float().sum() + s.sum(), leaves)
        torch.cuda.synchronize(); t2 = time.time()
        print(f"{spec} {a.dtype} call{rep}: fwd {t1 - t0:.1f} s, bwd {t2 - t1:.1f} s", flush=True)
