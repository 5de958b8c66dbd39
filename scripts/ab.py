"""A/B timing of config variants of tfla ops: each variant is a JSON dict passed as the op's ``config=``.

python scripts/ab.py --ops gdn[,mlstm-sig,...] --variants 'base={};w8={"state_lin": {"num_warps": 8}}'
                     [--mode fwdbwd] [--L 64] [--rounds 3] [--compare] [--determinism N] [--op-kwargs JSON]

``--variants``: ``name=JSON`` separated by ``;``; ``{}`` is the op's default config, so ``base={}`` is the tree as
committed. Nothing else changes between variants (no module attribute is set): a switch that an A/B should reach
is a key of the op's ``config=``. Variants run in rounds (A B A B ...) so that clock drift shows up as a spread,
not as a difference. Per op and variant: the median over rounds of the do_bench medians (warmup 10 / rep 50 ms) of
one call (``--mode fwdbwd``: forward plus ``torch.autograd.grad`` of every input with a fixed random cotangent), each
round's value, and the peak memory above the inputs. ``--compare``: each variant's outputs against the first
variant's (bitwise equal, or the relative L2); ``--determinism N``: each variant run N more times, compared bitwise
with its first run. Workloads and ops as ``scripts/profile_ops.py``.
"""
import argparse
import json
import statistics

from tfla.bench.common import peak_mib, time_ms
from tfla.bench.opcalls import OPS, op_run, rel_errors
from tfla.cli import use_interpreter_without_gpu


def parse_variants(spec: str) -> list[tuple[str, dict]]:
    """``'a={};b={"state_lin": {"BV": 32}}'`` -> ``[("a", {}), ("b", {"state_lin": {"BV": 32}})]``."""
    out = []
    for part in filter(str.strip, spec.split(";")):
        name, sep, cfg = part.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"expected name=JSON, got {part!r}")
        try:
            cfg = json.loads(cfg) if cfg.strip() else {}
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"variant {name.strip()!r}: not JSON ({e})")
        if not isinstance(cfg, dict):
            raise argparse.ArgumentTypeError(f"variant {name.strip()!r}: a config is a JSON dict, got {cfg!r}")
        out.append((name.strip(), cfg))
    if len({n for n, _ in out}) != len(out):
        raise argparse.ArgumentTypeError("variant names must differ")
    return out


def describe(errs: dict) -> str:
    return ", ".join(f"{n} {'equal' if e == 0.0 else f'{e:.1e}'}" for n, e in errs.items())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="gdn", help=f"comma-separated, from {', '.join(OPS)}")
    p.add_argument("--variants", type=parse_variants, required=True)
    p.add_argument("--mode", default="fwdbwd", choices=["fwd", "fwdbwd"])
    p.add_argument("--L", type=int, default=64, help="chunk size")
    p.add_argument("--op-kwargs", type=json.loads, default=None, help="extra keyword arguments of the op (JSON)")
    p.add_argument("--shape", default=None, help="B,T,H,K,V (default: the op's workload)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compare", action="store_true", help="also: outputs against the first variant's")
    p.add_argument("--determinism", type=int, default=0, metavar="N",
                   help="also: each variant run N more times, outputs compared bitwise with its first run")
    a = p.parse_args(argv)
    use_interpreter_without_gpu()
    shape = tuple(int(x) for x in a.shape.split(",")) if a.shape else None
    for op in a.ops.split(","):
        runs = {}
        try:
            for name, cfg in a.variants:
                inputs = next(iter(runs.values())).inputs if runs else None
                runs[name] = op_run(op, a.mode, a.L, cfg, shape=shape, dtype=a.dtype, op_kwargs=a.op_kwargs,
                                    inputs=inputs)
        except ValueError as e:
            raise SystemExit(f"{op}: {e}")
        first_name, first = next(iter(runs.items()))
        print(f"== {first.label}", flush=True)
        if a.compare:
            ref = first.run()
            for name, r in list(runs.items())[1:]:
                print(f"{op:10s} {name} vs {first_name}: {describe(rel_errors(r.run(), ref, r.names))}", flush=True)
            del ref
        for name, r in runs.items() if a.determinism else ():
            once = r.run()
            worst = {}
            for _ in range(a.determinism):
                for n, e in rel_errors(r.run(), once, r.names).items():
                    worst[n] = max(worst.get(n, 0.0), e)
            bad = {n: e for n, e in worst.items() if e}
            print(f"{op:10s} {name} determinism over {a.determinism + 1} runs: "
                  + ("bitwise equal" if not bad else f"DIFFERS {describe(bad)}"), flush=True)
            del once
        times = {name: [] for name in runs}
        peaks = {}
        for rnd in range(a.rounds):
            for name, r in runs.items():
                if rnd == 0:  # compile, then the peak of one call above what is allocated now
                    r.run()
                    peaks[name] = peak_mib(r.run)
                times[name].append(time_ms(r.run, 10, 50))
        for name in runs:
            t = times[name]
            peak = f"  peak {peaks[name]:.0f} MiB" if peaks[name] is not None else ""
            print(f"{op:10s} L={a.L:<4d} {name:12s} {statistics.median(t):8.3f} ms  rounds "
                  + " ".join(f"{v:.3f}" for v in t) + peak, flush=True)


if __name__ == "__main__":
    main()
