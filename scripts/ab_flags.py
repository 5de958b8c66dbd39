"""A/B timing of module-level switches on whole forward+backward calls (GPU).

python scripts/ab_flags.py --ops mlstm-sig,gdn --L 128 \
    --variants 'base=;noqs=tfla.ops.common.chunk_state.QSPLIT_LINEAR=False'

Each variant is ``name=module.attr=value,module.attr=value`` (values: int, float or a Python literal); every
variant starts from the defaults of the tree, so ``base=`` is the tree as committed. Variants run in rounds
(A B A B ...) so that a clock drift shows up as a spread, not as a difference. Per op and variant: the median
over rounds of the do_bench medians (warmup 10 / rep 50 ms) of one forward plus ``torch.autograd.grad`` with a
fixed random cotangent, each round's value, and the peak ``max_memory_allocated`` above the inputs. Workloads and
calls are those of ``scripts/profile_ops.py`` (bf16).
"""
import argparse
import ast
import importlib
import os
import statistics
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_ops import fwdbwd  # noqa: E402


def parse_variants(spec):
    out = []
    for part in spec.split(";"):
        name, _, sets = part.partition("=")
        assigns = []
        for a in filter(None, sets.split(",")):
            path, _, val = a.partition("=")
            mod, _, attr = path.rpartition(".")
            assigns.append((mod, attr, ast.literal_eval(val)))
        out.append((name.strip(), assigns))
    return out


def apply(assigns, saved):
    for (mod, attr), val in saved.items():  # back to the tree's defaults first
        setattr(importlib.import_module(mod), attr, val)
    for mod, attr, val in assigns:
        m = importlib.import_module(mod)
        saved.setdefault((mod, attr), getattr(m, attr))
        setattr(m, attr, val)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="mlstm-sig")
    p.add_argument("--L", type=int, default=64)
    p.add_argument("--variants", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compare", action="store_true",
                   help="also: each variant's gradients against the first variant's (bitwise equal, or the rel. L2)")
    p.add_argument("--determinism", type=int, default=0, metavar="N",
                   help="also: each variant run N more times, gradients compared bitwise with its first run")
    a = p.parse_args()
    variants = parse_variants(a.variants)
    saved = {}
    for op in a.ops.split(","):
        run, _, leaves, _ = fwdbwd(op, a.L)
        if a.compare:
            ref = None
            for name, assigns in variants:
                apply(assigns, saved)
                g = run()
                if ref is None:
                    ref = g
                    continue
                cmp = []
                for n, x1, x0 in zip(leaves, g, ref):
                    same = torch.equal(x1, x0)
                    rel = float((x1.double() - x0.double()).norm() / x0.double().norm().clamp_min(1e-30))
                    cmp.append(f"{n} {'equal' if same else f'{rel:.1e}'}")
                print(f"{op:10s} {name} vs {variants[0][0]}: " + ", ".join(cmp), flush=True)
            del ref, g
            apply([], saved)
        for name, assigns in variants[:] if a.determinism else []:
            apply(assigns, saved)
            first = run()
            bad = {}
            for _ in range(a.determinism):
                for n, x1, x0 in zip(leaves, run(), first):
                    if not torch.equal(x1, x0):
                        rel = float((x1.double() - x0.double()).norm() / x0.double().norm().clamp_min(1e-30))
                        bad[n] = max(bad.get(n, 0.0), rel)
            print(f"{op:10s} {name} determinism over {a.determinism + 1} runs: "
                  + ("bitwise equal" if not bad else "DIFFERS " + ", ".join(f"{n} {r:.1e}" for n, r in bad.items())),
                  flush=True)
            del first
        apply([], saved)
        times = {name: [] for name, _ in variants}
        peaks = {}
        for r in range(a.rounds):
            for name, assigns in variants:
                apply(assigns, saved)
                if r == 0:  # compile, then the peak of one call above what is allocated now
                    run()
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    run()
                    torch.cuda.synchronize()
                    peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
                times[name].append(do_bench(run, warmup=10, rep=50, return_mode="median"))
        apply([], saved)
        for name, _ in variants:
            t = times[name]
            print(f"{op:10s} L={a.L:<4d} {name:12s} {statistics.median(t):8.3f} ms  rounds "
                  + " ".join(f"{v:.3f}" for v in t) + f"  peak {peaks[name]:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
