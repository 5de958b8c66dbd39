"""Launch-config variants of the mLSTM forward+backward (bf16, B=8 T=8192 H=16 K=128 V=256, CUDA): each
variant overrides the tiled kernel's / state kernels' / state-terms kernel's config by wrapping the
engine's config entry points, checks h and every gradient against the default config's (rel-L2), and
prints the do_bench median of forward+backward.

python scripts/tune_mlstm.py [--gate sigmoid|exp] [--L 128] [--variants base,tiled8,...]
"""
import argparse
import functools

import torch
from triton.testing import do_bench

import tfla
import tfla.ops.common.chunk_output as co
import tfla.ops.simple_gla.chunk as sg

VARIANTS = {  # name -> (tiled overrides, state fwd config, state bwd config, wy_bwd config)
    "base": ({}, {}, {}, {}),
    "tiled8": ({"num_warps": 8}, {}, {}, {}),
    "tiled8s1": ({"num_warps": 8, "num_stages": 1}, {}, {}, {}),
    "sfwd8": ({}, {"num_warps": 8}, {}, {}),
    "sfwd_bv32": ({}, {"BV": 32}, {}, {}),
    "sbwd8": ({}, {}, {"num_warps": 8}, {}),
    "sbwd_bv64w8": ({}, {}, {"BV": 64, "num_warps": 8}, {}),
    "wy_bv32": ({}, {}, {}, {"BV": 32}),
    "wy8": ({}, {}, {}, {"num_warps": 8}),
}
ORIG = (co.tiled_config, sg.chunk_state_fwd, sg.chunk_state_bwd, sg.wy_bwd)


def apply(name):
    t, sf, sb, wy = VARIANTS[name]
    co.tiled_config = lambda L, DA, DC, config=None: ORIG[0](L, DA, DC, {**t, **(config or {})})
    sg.chunk_state_fwd = functools.partial(ORIG[1], config=sf) if sf else ORIG[1]
    sg.chunk_state_bwd = functools.partial(ORIG[2], config=sb) if sb else ORIG[2]
    sg.wy_bwd = functools.partial(ORIG[3], config=wy) if wy else ORIG[3]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gate", default="sigmoid")
    p.add_argument("--L", type=int, default=128)
    p.add_argument("--variants", default=",".join(VARIANTS))
    a = p.parse_args()
    B, T, H, K, V = 8, 8192, 16, 128, 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = [torch.randn(B, T, H, D, device="cuda", generator=gen, dtype=torch.bfloat16) for D in (K, K, V)]
    x += [torch.randn(B, T, H, device="cuda", generator=gen), torch.randn(B, T, H, device="cuda", generator=gen) + 3]
    leaves = [t.clone().requires_grad_() for t in x]
    do = torch.randn(B, T, H, V, device="cuda", generator=gen, dtype=torch.bfloat16)

    def run():
        h = tfla.chunk_mlstm(*leaves, input_gate=a.gate, chunk_size=a.L)[0]
        return (h,) + torch.autograd.grad(h, leaves, do)

    ref = None
    for name in a.variants.split(","):
        apply(name)
        try:
            outs = run()
            torch.cuda.synchronize()
            if ref is None:
                ref = [o.float() for o in outs]
            err = max(((o.float() - r).norm() / r.norm().clamp_min(1e-30)).item() for o, r in zip(outs, ref))
            ms = do_bench(run, warmup=10, rep=50, return_mode="median")
            print(f"{a.gate} L={a.L} {name:14s} fwd+bwd {ms:7.3f} ms  max rel-L2 vs first {err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001 - a config the compiler refuses: report, go on
            print(f"{a.gate} L={a.L} {name:14s} error {type(e).__name__}: {str(e)[:150]}", flush=True)
    apply("base")


if __name__ == "__main__":
    main()
