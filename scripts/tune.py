"""Time one tfla op under a set of launch configs passed as its ``config=`` argument, each checked against the
default config's outputs.

python scripts/tune.py OP --stage STAGE --grid JSON [--mode fwd|fwdbwd] [--L 64] [--kernel NAME] [--json PATH]
python scripts/tune.py OP --configs JSON [...]

e.g.  python scripts/tune.py gdn --mode fwdbwd --stage state_bwd --grid '{"BV": [32, 64], "num_warps": [4, 8]}'
      python scripts/tune.py gdn --configs '[{"ut": {"BK": 64}}, {"dqkw": {"num_warps": 8}, "state_lin": {"BV": 32}}]'

``--grid``: every combination of the listed values becomes ``{STAGE: {...}}`` (without ``--stage``: the
combination is the config itself); ``--configs``: a JSON list of whole config dicts. The GDN's stage keys are those
of ``chunk_gated_delta_rule_fwd`` / ``_bwd`` (``ut``, ``fused``, ``state``, ``state_bwd``, ``dqkw``, ``wy_bwd``, ...;
each a dict of the stage's launch keys such as ``BK``, ``BV``, ``num_warps``, ``num_stages``). ``{}`` (the default)
always runs first and is the reference: each config's outputs (o and, with ``--mode fwdbwd``, every gradient) are
compared with it (largest relative L2; 0 = bitwise equal) and a config off by more than ``--tol`` is listed as WRONG.
Per config: median time of the whole call (``triton.testing.do_bench``) and, with ``--kernel``, the profiled time per
call of the kernels whose name contains it. A config that fails to compile or launch is reported and skipped.
Workloads and ops as ``scripts/profile_ops.py``.
"""
import argparse
import itertools
import json

import torch

from tfla.bench.common import time_ms
from tfla.bench.opcalls import OPS, kernel_times, op_run, rel_errors
from tfla.cli import use_interpreter_without_gpu


def grid_configs(grid: dict, stage: str | None) -> list[dict]:
    keys = list(grid)
    combos = [dict(zip(keys, vals)) for vals in itertools.product(*(grid[k] for k in keys))]
    return [{stage: c} if stage else c for c in combos]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("op", choices=list(OPS))
    p.add_argument("--stage", default=None, help="config key the --grid combinations go under (e.g. state_bwd)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--grid", type=json.loads, help='JSON dict of lists, e.g. \'{"BV": [32, 64]}\'')
    src.add_argument("--configs", type=json.loads, help="JSON list of config dicts")
    p.add_argument("--mode", default="fwdbwd", choices=["fwd", "fwdbwd"])
    p.add_argument("--L", type=int, default=64, help="chunk size")
    p.add_argument("--op-kwargs", type=json.loads, default=None, help="extra keyword arguments of the op (JSON)")
    p.add_argument("--shape", default=None, help="B,T,H,K,V (default: the op's workload)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None)
    p.add_argument("--kernel", default=None, help="also: profiled time of the kernels whose name contains this")
    p.add_argument("--rep", type=float, default=50, help="do_bench repetition time, ms")
    p.add_argument("--tol", type=float, default=1e-2, help="largest relative L2 against the default config")
    p.add_argument("--json", default=None, help="write the results to this file")
    a = p.parse_args(argv)
    use_interpreter_without_gpu()
    configs = grid_configs(a.grid, a.stage) if a.grid is not None else list(a.configs)
    configs = [{}] + [c for c in configs if c != {}]
    shape = tuple(int(x) for x in a.shape.split(",")) if a.shape else None
    try:
        base = op_run(a.op, a.mode, a.L, {}, shape=shape, dtype=a.dtype, op_kwargs=a.op_kwargs)
    except ValueError as e:
        raise SystemExit(f"{a.op}: {e}")
    print(base.label)
    ref, results = None, []
    for cfg in configs:
        try:
            r = op_run(a.op, a.mode, a.L, cfg, op_kwargs=a.op_kwargs, inputs=base.inputs)
            outs = r.run()
            if ref is None:
                ref = tuple(o.clone() for o in outs)
            err = max(rel_errors(outs, ref, r.names).values())
            del outs
            ms = time_ms(r.run, 10, a.rep)
            kt = sum(t for name, t, _ in kernel_times(r.run, 3) if a.kernel in name) if a.kernel else None
        except Exception as e:  # a config that does not compile or fit: report, go on
            msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            print(f"  FAILED {json.dumps(cfg)}: {type(e).__name__}: {msg}", flush=True)
            results.append({"config": cfg, "error": f"{type(e).__name__}: {msg}"})
            if "illegal" in str(e).lower():  # the CUDA context is gone: nothing after this can run
                break
            continue
        results.append({"config": cfg, "ms": ms, "kernel_ms": kt, "max_rel_err": err})
        print(f"  {ms:8.3f} ms" + (f"  kernel {kt:7.3f} ms" if kt is not None else "") +
              f"  err {err:.1e}  {json.dumps(cfg)}", flush=True)
    ok = sorted((r for r in results if "ms" in r), key=lambda r: r["ms"])
    default_ms = results[0].get("ms") if results else None
    print(f"\nbest first ({a.op} {a.mode} L={a.L}; time / the default's time; {{}} is the default):")
    for r in ok:
        flag = "" if r["max_rel_err"] <= a.tol else "  WRONG"
        rel = f"{r['ms'] / default_ms:5.2f}x" if default_ms else "    -"
        print(f"  {r['ms']:8.3f} ms  {rel}  {json.dumps(r['config'])}{flag}")
    if a.json:
        env = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "label": base.label}
        with open(a.json, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
