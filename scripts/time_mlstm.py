"""Forward+backward time and peak memory of tfla.chunk_mlstm (exact and detached-normalizer gradients)
and mlstm_kernels' xl_chunk_siging / limit_chunk on one workload (bf16, CUDA), no correctness gate:
the gated checks live in `tfla bench mlstm`."""
import sys

import torch
from triton.testing import do_bench

import tfla

B, T, H, K, V = 8, 8192, 16, 128, 256
gen = torch.Generator(device="cuda").manual_seed(0)
q, k = (torch.randn(B, T, H, K, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
v = torch.randn(B, T, H, V, device="cuda", generator=gen, dtype=torch.bfloat16)
i = torch.randn(B, T, H, device="cuda", generator=gen)
f = torch.randn(B, T, H, device="cuda", generator=gen) + 3
leaves = [x.clone().requires_grad_() for x in (q, k, v, i, f)]
do = torch.randn_like(v)


def fb(fn):
    def run():
        h = fn(*leaves)
        torch.autograd.grad(h, leaves, do)
    return run


def measure(name, fn):
    try:
        run = fb(fn)
        run()
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run(); torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        ms = do_bench(run, warmup=10, rep=50, return_mode="median")
        print(f"{name:44s} fwd+bwd {ms:7.3f} ms  peak {peak:7.0f} MiB", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"{name:44s} error {type(e).__name__}: {str(e)[:120]}", flush=True)


for gate in ("sigmoid", "exp"):
    for L in (64, 128):
        for det in (False, True):
            measure(f"tfla {gate} L={L} detach_normalizer={det}",
                    lambda q, k, v, i, f, g=gate, L=L, d=det: tfla.chunk_mlstm(q, k, v, i, f, input_gate=g, chunk_size=L,
                                                                           detach_normalizer=d)[0])
if "--mk" in sys.argv:
    from mlstm_kernels.torch import get_mlstm_kernel
    tr = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731
    for name, cs in (("chunkwise--triton_xl_chunk_siging", 128), ("chunkwise--triton_limit_chunk", 64)):
        kern = get_mlstm_kernel(name)
        measure(f"mk {name} L={cs}", lambda q, k, v, i, f, kern=kern, cs=cs: kern(
            q=tr(q), k=tr(k), v=tr(v), i=tr(i), f=tr(f), chunk_size=cs, return_last_states=False).transpose(1, 2))
