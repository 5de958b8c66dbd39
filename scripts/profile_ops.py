"""Per-kernel GPU time of tfla op calls (torch.profiler): where the time of one call goes.

python scripts/profile_ops.py OP [OP ...] [--mode fwd|fwdbwd] [--L 64] [--config JSON] [--op-kwargs JSON]
                              [--shape B,T,H,K,V] [--dtype bf16] [--gate default] [--reps 5] [--host]

OPs: gdn, mlstm-exp, mlstm-sig, simple-gla, gla, retention, linear-attn, lightning (tfla.bench.opcalls; default
workloads: B=4 T=8192 H=16 K=V=128, the mLSTM B=8 T=8192 H=16 K=128 V=256, bf16). Prints per op the median time of
the whole call (``triton.testing.do_bench``), the sum of its kernel times, and one line per kernel (time per call,
launches per call), longest first: each kernel is one stage of the op, timed inside a real call. The gap between the
call and the kernel sum is launch and host time (host syncs show up there; ``--host`` profiles the Python side).
``--config`` is passed as the op's ``config=`` (e.g. ``'{"state_bwd": {"num_warps": 8}}'``), ``--op-kwargs`` as
keyword arguments (e.g. ``'{"save_states": true}'``). Without a GPU the call runs through the interpreter and only
its wall time is printed.
"""
import argparse
import json

import torch

from tfla.bench.common import time_ms
from tfla.bench.opcalls import OPS, kernel_times, op_run
from tfla.cli import use_interpreter_without_gpu


def shape_arg(s: str) -> tuple[int, ...]:
    parts = tuple(int(x) for x in s.split(","))
    if len(parts) != 5:
        raise argparse.ArgumentTypeError(f"expected B,T,H,K,V, got {s!r}")
    return parts


def host_profile(run, lines: int = 14) -> None:
    """Host (Python) time per call without syncs, and the functions it goes to (the top ``lines`` by own time,
    then by cumulative time)."""
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
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(lines)
        print("\n".join(buf.getvalue().splitlines()[-(lines + 6):]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ops", nargs="+", choices=list(OPS))
    p.add_argument("--mode", default="fwd", choices=["fwd", "fwdbwd"])
    p.add_argument("--L", type=int, default=64, help="chunk size")
    p.add_argument("--config", type=json.loads, default=None, help="the op's config= (JSON dict)")
    p.add_argument("--op-kwargs", type=json.loads, default=None, help="extra keyword arguments of the op (JSON)")
    p.add_argument("--shape", type=shape_arg, default=None, help="B,T,H,K,V (default: the op's workload)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default bf16 (fp32 on CPU)")
    p.add_argument("--gate", default="default", help="gate regime of the inputs (tfla.bench.inputs.GATES)")
    p.add_argument("--reps", type=int, default=5, help="profiled calls")
    p.add_argument("--host", action="store_true", help="also: host time per call and its top functions")
    p.add_argument("--host-lines", type=int, default=14, help="functions listed by --host, per ordering")
    a = p.parse_args(argv)
    use_interpreter_without_gpu()
    for op in a.ops:
        try:
            r = op_run(op, a.mode, a.L, a.config, shape=a.shape, dtype=a.dtype, gate=a.gate, op_kwargs=a.op_kwargs)
        except ValueError as e:
            raise SystemExit(f"{op}: {e}")
        r.run()
        ms = time_ms(r.run, 10, 50)
        rows = kernel_times(r.run, a.reps)
        total = sum(t for _, t, _ in rows)
        cfg = f" config={json.dumps(a.config)}" if a.config else ""
        print(f"== {r.label}{cfg}: call {ms:.3f} ms (median)" +
              (f", kernels {total:.3f} ms per call" if rows else ", no CUDA: no kernel times"))
        for name, t, n in rows:
            print(f"   {t:8.3f} ms  x{n:4.1f}  {name[:110]}")
        if a.host and torch.cuda.is_available():
            host_profile(r.run, a.host_lines)


if __name__ == "__main__":
    main()
