"""Per-kernel GPU time of one tfla op call (torch.profiler), to see where the time goes.

python scripts/profile_ops.py OP [OP ...] [--mode fwd|fwdbwd] [--L 64] [--reps 5]
OPs: mlstm-sig, mlstm-exp, mlstm-sig-det, mlstm-exp-det (detach_normalizer; B=8 T=8192 H=16 K=128 V=256), sgla-scalar, sgla-scalar-nocheck (input
check skipped, last), sgla-none, gla[-strong][-span0] (vector decay [B, T, H, K]; logsigmoid(x) instead of
logsigmoid(x) / 16; VEC_SPAN = 0), retention (constant decay), gdn (B=4 T=8192 H=16
K=V=128); all bf16. Prints, per op, the do_bench median of the whole call, the sum of kernel times per
call and one line per kernel name (total per call, count per call), longest first. The gap between
the whole call and the kernel sum is launch/host time (host syncs show up there).
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

import tfla


def inputs(op):
    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s, dt=torch.bfloat16: torch.randn(*s, device="cuda", generator=gen, dtype=dt)  # noqa: E731
    if op.startswith("mlstm"):
        B, T, H, K, V = 8, 8192, 16, 128, 256
        return dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, H, V), i=rnd(B, T, H, dt=torch.float32),
                    f=rnd(B, T, H, dt=torch.float32) + 3)
    B, T, H, K, V = 4, 8192, 16, 128, 128
    x = dict(q=rnd(B, T, H, K), k=torch.nn.functional.normalize(rnd(B, T, H, K).float(), dim=-1).bfloat16(),
             v=rnd(B, T, H, V))
    if op in ("sgla-scalar", "sgla-scalar-nocheck", "gdn"):
        x["g"] = torch.nn.functional.logsigmoid(rnd(B, T, H, dt=torch.float32) + 4)
    if op.startswith("gla"):  # per-channel log decays, FLA's benchmark style (logsigmoid / 16: mostly near 0)
        x["g"] = torch.nn.functional.logsigmoid(rnd(B, T, H, K, dt=torch.float32)) / (1 if "strong" in op else 16)
    if op == "gdn":
        x["beta"] = torch.rand(B, T, H, device="cuda", generator=gen)
    return x


def call(op, L):
    if op.startswith("mlstm"):  # mlstm-sig / mlstm-exp [-det: mlstm_kernels' gradient convention]
        gate = "sigmoid" if op.startswith("mlstm-sig") else "exp"
        det = op.endswith("-det")
        return lambda x: tfla.chunk_mlstm(**x, input_gate=gate, chunk_size=L, detach_normalizer=det)[0]
    if op == "sgla-scalar-nocheck":  # the host-synced `g <= 0` check skipped: its cost in isolation
        import tfla.ops.simple_gla.chunk as sg
        sg._positive_flag = lambda g: None
    if op.startswith("gla"):  # gla[-strong][-span0]: strong gates; the diagonal's factored path off
        import tfla.ops.gla.chunk as gc
        gc.VEC_SPAN = 0 if "span0" in op else 32
        return lambda x: tfla.chunk_gla(**x, chunk_size=L)[0]
    if op.startswith("sgla"):
        return lambda x: tfla.chunk_simple_gla(**x, chunk_size=L)[0]
    if op == "retention":  # constant decay per head (FLA's chunk_retention)
        return lambda x: tfla.chunk_retention(**x, chunk_size=L)[0]
    return lambda x: tfla.chunk_gated_delta_rule(**x, chunk_size=L)[0]


def fwdbwd(op, L):
    """``(run, fn, leaves, do)`` for ``op`` at chunk size L: ``run()`` is one forward plus ``torch.autograd.grad``
    of every input with a fixed random cotangent ``do`` (the calls the timing scripts measure)."""
    fn = call(op, L)
    leaves = {n: t.clone().requires_grad_() for n, t in inputs(op).items()}
    do = torch.randn_like(fn(leaves))

    def run():
        return torch.autograd.grad(fn(leaves), list(leaves.values()), do)

    return run, fn, leaves, do


def main():
    p = argparse.ArgumentParser()
    p.add_argument("ops", nargs="+")
    p.add_argument("--mode", default="fwd", choices=["fwd", "fwdbwd"])
    p.add_argument("--L", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--host", action="store_true", help="also: host (Python) time per call and its top functions")
    p.add_argument("--unfused", action="store_true",
                   help="backward at L = 64 without the fused paths (dvo inside the state backward, dq+dk in one launch)")
    a = p.parse_args()
    if a.unfused:
        import tfla.ops.gated_delta_rule.chunk as gdn
        import tfla.ops.simple_gla.chunk as sg
        for mod in (gdn, sg):
            mod.intra_supported = mod.dual_supported = lambda *args, **kw: False
    for op in a.ops:
        if a.mode == "fwdbwd":
            run = fwdbwd(op, a.L)[0]
        else:
            x = inputs(op)
            fn = call(op, a.L)

            def run():
                with torch.no_grad():
                    fn(x)
        run()
        torch.cuda.synchronize()
        ms = do_bench(run, warmup=10, rep=50, return_mode="median")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.reps):
                run()
            torch.cuda.synchronize()
        rows = [(e.key, e.device_time_total / 1e3 / a.reps, e.count / a.reps) for e in prof.key_averages()
                if e.device_time_total > 0]
        rows.sort(key=lambda r: -r[1])
        total = sum(r[1] for r in rows)
        print(f"== {op} {a.mode} L={a.L}{' unfused' if a.unfused else ''}: call {ms:.3f} ms (do_bench median), kernels {total:.3f} ms per call")
        for name, t, n in rows:
            print(f"   {t:8.3f} ms  x{n:4.1f}  {name[:110]}")
        if a.host:  # where the host spends a call (a host sync inside shows up as the wait in bool/item)
            import cProfile
            import io
            import pstats
            import time

            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                run()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            print(f"   host {1e3 * (t1 - t0) / 20:.3f} ms per call (20 calls, no sync between)")
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(20):
                run()
            pr.disable()
            torch.cuda.synchronize()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(14)
            print("\n".join(buf.getvalue().splitlines()[-20:]))


if __name__ == "__main__":
    main()
