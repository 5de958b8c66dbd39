"""A/B of source trees of tfla (its package at two or more revisions) on the GDN bench workloads, one process each.

python scripts/ab_trees.py export REV DIR       # git archive REV's tfla/ into DIR/tfla (a tree to carry to a GPU)
python scripts/ab_trees.py run --trees base=DIR,new=DIR [--workloads long,qwen3-next] [--mode fwdbwd|fwd]
                           [--rounds 2] [--repeats 3] [--ref] [--kernels 8] [--json PATH]

What ``scripts/ab.py`` does for ``config=`` variants, for code that no config reaches (a kernel rewritten, a stage
reordered): each tree runs in its own Python process with its directory first on ``sys.path`` (so Triton compiles
each tree's kernels from its own source), the processes alternating over the rounds (base, new, base, new, ..) so
that clock drift shows up as a spread. Per process and workload (``tfla bench gdn --workload``'s inputs and seed, the
op's defaults, forward plus ``torch.autograd.grad`` of q, k, v, g, beta with a fixed random cotangent in
``--mode fwdbwd``; autograd's device thread off): the call's median ``do_bench`` time (warmup 25 / rep 100 ms) in
``--repeats`` repeats, each kernel's device time per call (``torch.profiler`` over three calls), a hash of every output
or gradient (compared across trees: "equal" or the names that differ), whether two calls gave bitwise equal results,
and with ``--ref`` each one's relative L2 error against the bench's fp32 reference. Without a GPU it runs the kernels
through Triton's CPU interpreter at the bench's tiny CPU sizes (wiring only: times mean nothing, no profile).
Each tree's bench inputs come from its own ``tfla.bench``: trees whose input code differs hash differently.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

LEAVES = ("q", "k", "v", "g", "beta")


def export(rev: str, out: str) -> None:
    """``git archive`` of ``rev``'s ``tfla/`` into ``out/tfla`` (run from the repository)."""
    os.makedirs(out, exist_ok=True)
    archive = subprocess.run(["git", "archive", rev, "tfla"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)


def _worker(tree: str, out: str, workloads: list[str], mode: str, repeats: int, ref: bool) -> None:
    """One tree in this process: the measurements of the module docstring, as JSON into ``out``."""
    tree = os.path.abspath(tree)
    sys.path.insert(0, tree)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import tfla
    from tfla.bench.common import time_ms
    from tfla.bench.gdn import _reference, named_workloads, workload_inputs
    from tfla.bench.registry import tfla_impl

    if not os.path.abspath(tfla.__file__).startswith(tree + os.sep):
        raise RuntimeError(f"tfla imported from {tfla.__file__}, not from the tree {tree}")
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    torch.autograd.set_multithreading_enabled(False)
    impl = tfla_impl("default")
    rows = []
    for name in workloads:
        wl = named_workloads(name, gpu, "bf16" if gpu else "fp32")[0]
        x = workload_inputs(wl, dev, "default", 0)
        leaves = {n: x[n].detach().clone().requires_grad_(mode == "fwdbwd") for n in LEAVES}
        xl = {**x, **leaves}
        o, _ = impl.fn(xl, output_final_state=False)
        do = torch.randn(o.shape, generator=torch.Generator(device=dev).manual_seed(1), device=dev, dtype=o.dtype)

        def call():
            if mode == "fwd":
                with torch.no_grad():
                    return (impl.fn(x, output_final_state=False)[0],)
            out_o, _ = impl.fn(xl, output_final_state=False)
            return (out_o.detach(), *torch.autograd.grad(out_o, [leaves[n] for n in LEAVES], do))
        first, again = call(), call()
        names = ("o",) + (tuple(f"d{n}" for n in LEAVES) if mode == "fwdbwd" else ())
        row = {"workload": name, "names": names,
               "hashes": [hashlib.sha1(t.detach().float().cpu().numpy().tobytes()).hexdigest()[:12] for t in first],
               "deterministic": all(torch.equal(a, b) for a, b in zip(first, again))}
        if ref:
            r_o, _, r_g = _reference(x, do if mode == "fwdbwd" else None)
            want = (r_o,) + (tuple(r_g) if mode == "fwdbwd" else ())
            row["errors"] = [((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
                             for a, b in zip(first, want)]
        row["ms"] = [time_ms(call) for _ in range(repeats)]  # (do_bench on CUDA, wall clock on the CPU)
        row["kernels"] = {}
        if gpu:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
            row["kernels"] = {e.key: e.self_device_time_total / 3e3 for e in prof.key_averages()
                              if e.self_device_time_total > 0}
        rows.append(row)
    with open(out, "w") as f:
        json.dump({"tree": tree, "rows": rows}, f)


def _trees(spec: str) -> list[tuple[str, str]]:
    """``'base=DIR,new=DIR'`` -> ``[("base", DIR), ("new", DIR)]``; each DIR holds a ``tfla/`` package."""
    out = []
    for part in filter(str.strip, spec.split(",")):
        name, sep, path = part.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise argparse.ArgumentTypeError(f"expected name=DIR, got {part!r}")
        if not os.path.isfile(os.path.join(path.strip(), "tfla", "__init__.py")):
            raise argparse.ArgumentTypeError(f"tree {name.strip()!r}: no tfla/__init__.py under {path.strip()!r}")
        out.append((name.strip(), os.path.abspath(path.strip())))  # (the workers run in a temporary cwd)
    if len({n for n, _ in out}) != len(out) or not out:
        raise argparse.ArgumentTypeError("give one or more trees with different names")
    return out


def _span(xs) -> str:
    return f"{min(xs):.3f}" if max(xs) - min(xs) < 5e-4 else f"{min(xs):.3f}-{max(xs):.3f}"


def summarize(results: dict[str, list[dict]], kernels: int) -> str:
    """The table printed by ``run``: per workload and tree the call's ms over every process and repeat, the largest
    kernels (the first tree's order), hashes against the first tree's, determinism and errors."""
    first = next(iter(results))
    lines = []
    for w, base in enumerate(results[first][0]["rows"]):
        lines.append(f"## {base['workload']}")
        top = sorted(base["kernels"], key=lambda k: -base["kernels"][k])[:kernels]
        for tree, runs in results.items():
            rows = [r["rows"][w] for r in runs]
            diff = [n for n, a, b in zip(base["names"], rows[0]["hashes"], base["hashes"]) if a != b]
            same = all(r["hashes"] == rows[0]["hashes"] for r in rows)
            line = (f"{tree}: {_span([t for r in rows for t in r['ms']])} ms ({len(rows)} processes); "
                    f"{'equal to ' + first if not diff else 'differs from ' + first + ': ' + ', '.join(diff)}"
                    f"{'' if same else ' (hashes differ between its processes)'}; "
                    f"{'deterministic' if all(r['deterministic'] for r in rows) else 'NOT deterministic'}")
            if "errors" in rows[0]:
                line += "; vs fp32: " + ", ".join(f"{n} {e:.3e}" for n, e in zip(rows[0]["names"], rows[0]["errors"]))
            lines.append(line)
            for k in top:
                vals = [r["kernels"].get(k, 0.0) for r in rows]
                lines.append(f"    {k[:60]:60s} {_span(vals)}")
    return "\n".join(lines)


def run(trees: list[tuple[str, str]], workloads: list[str], mode: str, rounds: int, repeats: int, ref: bool,
        kernels: int, json_path: str | None) -> str:
    results: dict[str, list[dict]] = {name: [] for name, _ in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name, path in trees:
                out = os.path.join(tmp, f"{name}-{r}.json")
                cmd = [sys.executable, os.path.abspath(__file__), "worker", path, out, "--workloads",
                       ",".join(workloads), "--mode", mode, "--repeats", str(repeats)] + (["--ref"] if ref else [])
                subprocess.run(cmd, check=True, cwd=tmp)  # (cwd: no tfla/ of the caller's on the path)
                with open(out) as f:
                    results[name].append(json.load(f))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    return summarize(results, kernels)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="git archive REV's tfla/ into DIR")
    e.add_argument("rev")
    e.add_argument("dir")
    for name in ("run", "worker"):
        s = sub.add_parser(name, help="A/B the trees" if name == "run" else "one tree in this process (internal)")
        if name == "run":
            s.add_argument("--trees", type=_trees, required=True, help="name=DIR,name=DIR (each DIR holds tfla/)")
            s.add_argument("--rounds", type=int, default=2)
            s.add_argument("--kernels", type=int, default=8, help="kernels listed per workload")
            s.add_argument("--json", default=None, help="every process's measurements, as JSON")
        else:
            s.add_argument("tree")
            s.add_argument("out")
        s.add_argument("--workloads", default="long,qwen3-next", help="of `tfla bench gdn --workload`")
        s.add_argument("--mode", choices=["fwd", "fwdbwd"], default="fwdbwd")
        s.add_argument("--repeats", type=int, default=3)
        s.add_argument("--ref", action="store_true", help="also: errors against the bench's fp32 reference")
    a = p.parse_args(argv)
    workloads = [w for w in getattr(a, "workloads", "").split(",") if w]
    if a.cmd == "export":
        export(a.rev, a.dir)
    elif a.cmd == "worker":
        _worker(a.tree, a.out, workloads, a.mode, a.repeats, a.ref)
    else:
        if a.rounds < 1 or a.repeats < 1:
            p.error("--rounds and --repeats must be >= 1")
        print(run(a.trees, workloads, a.mode, a.rounds, a.repeats, a.ref, a.kernels, a.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
