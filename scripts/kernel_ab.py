"""A/B of copies of one kernel module, each launched on the arguments one GDN call really passes to it.

python scripts/kernel_ab.py --function tfla.ops.common.chunk_dqkw_ws:gdn_bwd_chunk_ws \\
    --variants base=tfla/ops/common/chunk_dqkw_ws.py,new=.dev/new_ws.py [--workloads long,qwen3-next]
    [--mode fwdbwd|fwd] [--call -1] [--set dv_into_du=false,dq_into_v_new=false] [--rounds 2] [--json PATH]

For a change inside one kernel (a stage reordered, products left out for timing), where ``scripts/ab_trees.py``
would time whole calls in whole processes. Per workload (``tfla bench gdn --workload``'s inputs, the op's defaults,
forward plus ``torch.autograd.grad`` of q, k, v, g, beta in ``--mode fwdbwd``; autograd's device thread off): the op
runs once with a profile hook (``sys.setprofile``: no module attribute is replaced) recording the arguments of each
call of ``--function`` (``module:name``, the Python function around the kernel launch), and keeps call ``--call``'s
(default -1, the last: the first of a process is ``precompile.first_call``'s dry run on unwritten memory), its
tensors cloned. Each variant is a copy of that function's module file (``name=PATH``), imported as a module of its
own so that Triton compiles its kernels from its source; ``--set`` overrides keyword arguments (an in-place option
such as ``dv_into_du`` turned off, so that the captured inputs stay intact over the calls). Then, in ``--rounds``
rounds alternating the variants: a first call on a fresh copy of the arguments, its tensor outputs compared with
the first variant's (relative L2 and bitwise equality), and the time of a call (GPU: median ``do_bench``, warmup 25
/ rep 100 ms; CPU: one call's wall time through Triton's interpreter, wiring only). A variant that fails to build or
run is reported and skipped.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # (tfla from this checkout)

LEAVES = ("q", "k", "v", "g", "beta")


def _variants(spec: str) -> list[tuple[str, str]]:
    """``'base=FILE,new=FILE'`` -> ``[("base", FILE), ("new", FILE)]`` (absolute paths)."""
    out = []
    for part in filter(str.strip, spec.split(",")):
        name, sep, path = part.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise argparse.ArgumentTypeError(f"expected name=FILE, got {part!r}")
        if not os.path.isfile(path.strip()):
            raise argparse.ArgumentTypeError(f"variant {name.strip()!r}: no file {path.strip()!r}")
        out.append((name.strip(), os.path.abspath(path.strip())))
    if not out or len({n for n, _ in out}) != len(out):
        raise argparse.ArgumentTypeError(f"expected distinct names, got {spec!r}")
    return out


def _value(text: str):
    """``--set``'s values: true / false / none, ints, floats, else the string."""
    low = text.strip().lower()
    if low in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[low]
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _overrides(spec: str) -> dict:
    """``'a=1,b=false'`` -> ``{"a": 1, "b": False}``."""
    out = {}
    for part in filter(str.strip, spec.split(",")):
        key, sep, val = part.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected key=value, got {part!r}")
        out[key.strip()] = _value(val)
    return out


def _clone(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(y) for y in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def _tensors(x) -> list:
    """The tensors of a result, in order (nested tuples / lists flattened; None and other values skipped)."""
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _tensors(y)]
    return []


def capture(fn, run) -> list[inspect.BoundArguments]:
    """The arguments of every call of the Python function ``fn`` while ``run()`` runs on this thread (their tensors
    cloned at the call's entry), through ``sys.setprofile``."""
    code, sig, calls = fn.__code__, inspect.signature(fn), []
    old = sys.getprofile()

    def hook(frame, event, arg):
        if event == "call" and frame.f_code is code:
            loc = frame.f_locals
            bound = sig.bind_partial(**{p: loc[p] for p in sig.parameters if p in loc})
            bound.arguments = {k: _clone(v) for k, v in bound.arguments.items()}
            calls.append(bound)

    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(old)
    return calls


def load_variant(name: str, path: str, func: str):
    """``path`` imported as module ``kernel_ab_<name>``; its function ``func``."""
    mod_name = f"kernel_ab_{name}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod  # (Triton's JIT looks its functions' globals up through the module)
    spec.loader.exec_module(mod)
    return getattr(mod, func)


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else float((a - b).norm().item() > 0)


def run(function: str, variants: list[tuple[str, str]], workloads: list[str], mode: str, call: int,
        overrides: dict, rounds: int) -> dict:
    """The measurements of the module docstring: ``{workload: {"calls", "args", "variants": {name: {"ms",
    "rel", "equal"} or {"error"}}}}``."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from tfla.bench.gdn import named_workloads, workload_inputs
    from tfla.bench.registry import tfla_impl

    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    mod_name, _, func = function.partition(":")
    target = getattr(importlib.import_module(mod_name), func)
    fns = {}
    for name, path in variants:
        try:
            fns[name] = load_variant(name, path, func)
        except Exception as e:  # noqa: BLE001 (a variant that does not import is reported)
            fns[name] = e
    torch.autograd.set_multithreading_enabled(False)
    impl = tfla_impl("default")
    results = {}
    for wl_name in workloads:
        wl = named_workloads(wl_name, gpu, "bf16" if gpu else "fp32")[0]
        x = workload_inputs(wl, dev, "default", 0)
        leaves = {n: x[n].detach().clone().requires_grad_(mode == "fwdbwd") for n in LEAVES}
        xl = {**x, **leaves}

        def op():
            if mode == "fwd":
                with torch.no_grad():
                    impl.fn(x, output_final_state=False)
                return
            o, _ = impl.fn(xl, output_final_state=False)
            do = torch.randn(o.shape, generator=torch.Generator(device=dev).manual_seed(1), device=dev,
                             dtype=o.dtype)
            torch.autograd.grad(o, [leaves[n] for n in LEAVES], do)

        calls = capture(target, op)
        if not calls:
            raise RuntimeError(f"{function} was not called by the {mode} call of workload {wl_name}")
        bound = calls[call]
        bound.arguments.update(overrides)
        args, kwargs = bound.args, bound.kwargs
        row = {"calls": len(calls), "args": [list(t.shape) for t in _tensors(list(args))][:4], "variants": {}}
        ref = None
        for rnd in range(rounds):
            for name, _ in variants:
                fn, out = fns[name], row["variants"].setdefault(name, {"ms": []})
                if isinstance(fn, Exception) or "error" in out:
                    out["error"] = out.get("error") or f"{type(fn).__name__}: {fn}"[:400]
                    continue
                try:
                    if rnd == 0:
                        got = _tensors(fn(*_clone(args), **_clone(kwargs)))
                        if ref is None:
                            ref = [t.clone() for t in got]
                        out["rel"] = [_rel(a, b) for a, b in zip(got, ref)]
                        out["equal"] = [bool(torch.equal(a, b)) for a, b in zip(got, ref)]
                    if gpu:
                        import triton

                        ms = triton.testing.do_bench(lambda: fn(*args, **kwargs), warmup=25, rep=100)
                    else:
                        t0 = time.perf_counter()
                        fn(*args, **kwargs)
                        ms = (time.perf_counter() - t0) * 1e3
                    out["ms"].append(round(ms, 4))
                except Exception as e:  # noqa: BLE001 (a variant that does not build or run is reported)
                    out["error"] = f"{type(e).__name__}: {e}"[:400]
        results[wl_name] = row
    return results


def summarize(results: dict) -> str:
    lines = []
    for wl, row in results.items():
        lines.append(f"## {wl} ({row['calls']} calls, the arguments' first tensors {row['args']})")
        for name, out in row["variants"].items():
            if "error" in out:
                lines.append(f"{name}: FAILED {out['error']}")
                continue
            ms = out["ms"]
            same = "equal" if all(out.get("equal", [])) else "rel " + ", ".join(f"{e:.2e}" for e in out["rel"])
            lines.append(f"{name}: {min(ms):.4f}-{max(ms):.4f} ms ({len(ms)} rounds); outputs vs the first: {same}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--function", required=True, help="module:name of the Python function around the launch")
    p.add_argument("--variants", type=_variants, required=True, help="name=FILE,name=FILE (copies of its module)")
    p.add_argument("--workloads", default="long,qwen3-next", help="of `tfla bench gdn --workload`")
    p.add_argument("--mode", choices=["fwd", "fwdbwd"], default="fwdbwd")
    p.add_argument("--call", type=int, default=-1, help="which call's arguments (-1: the last)")
    p.add_argument("--set", type=_overrides, default={}, help="key=value,.. keyword arguments to override")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    results = run(a.function, a.variants, a.workloads.split(","), a.mode, a.call, a.set, a.rounds)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    print(summarize(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
