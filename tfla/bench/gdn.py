"""``tfla bench gdn``: Gated DeltaNet benchmark of tfla (in each saved-set variant) against FLA and
FlashQLA, after a correctness check of every implementation against a float32 reference.

For each workload: inputs from ``gdn_inputs`` (the tests' factory); a float32 pure-PyTorch
chunkwise reference (``chunk_gated_delta_rule_ref``, itself tested against the step-by-step
recurrence in float64); each implementation's o and final state compared by relative L2 and, if
off by more than the dtype's tolerance or not finite, reported as WRONG and not timed. Then the
median time (``triton.testing.do_bench``), TFLOP/s from ``tfla.ops.gated_delta_rule.cost``, peak
memory above the inputs, bytes of materialized states and, with a backward (``--mode fwdbwd|bwd``), the memory
the forward holds for it (``held_mib``: allocated after the forward, its graph alive, above the inputs, less the
outputs). ``--plot``: time against T and, on a GPU, peak and held memory against T.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from dataclasses import dataclass

import torch

from tfla.bench.common import (append_csv, check_csv, csv_row, env_info, error_status, fmt, held_mib, peak_mib,
                               host_ms, rel_l2, time_ms, warm_autograd, write_json)
from tfla.bench.inputs import GATES, gdn_inputs
from tfla.bench.registry import gdn_impls
from tfla.ops.gated_delta_rule.cost import gdn_bwd_cost, gdn_fwd_cost

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# refuse-to-time thresholds (rel-L2 against the fp32 reference); the measured error is reported
TOLERANCE = {"fp32": 1e-3, "fp16": 1e-2, "bf16": 2e-2}
# the gate gradient is the weakest in every implementation (design note): its own threshold
TOLERANCE_DG = {"fp32": 5e-3, "fp16": 5e-2, "bf16": 1e-1}
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta")


@dataclass(frozen=True)
class Workload:
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    dtype: str
    lens: tuple[int, ...] | None = None  # packed sequences (cu_seqlens, B = 1, T = their sum)
    layer: bool = False  # l2norm of q, k and the gate inside the op, initial states (a Qwen3-Next-style layer)

    def label(self) -> str:
        gva = f" HV={self.HV}" if self.HV != self.H else ""
        extra = (f" varlen N={len(self.lens)}" if self.lens else "") + (" l2norm+gate" if self.layer else "")
        return f"B={self.B} T={self.T} H={self.H}{gva} K={self.K} V={self.V} {self.dtype}{extra}"


# Qwen3-Next-style packed batch: 6 sequences of 1 to 12,767 tokens, 32,768 in all (issue 23's layer)
QWEN3_NEXT_LENS = (12767, 8192, 6000, 4000, 1808, 1)
WORKLOADS = ("mve", "qwen3-next", "long", "sweep")


def named_workloads(name: str, gpu: bool, dtype: str) -> list[Workload]:
    """``--workload``: the MVE (B = 4, T = 8192, H = 16, K = V = 128); a Qwen3-Next-style layer (packed varlen,
    HV = 2H = 32, l2norm and gate in the op, initial states); one long sequence (T = 65536); the T sweep at 65,536
    tokens (B = 65536 / T). Without a GPU: the same structure at interpreter sizes."""
    if not gpu:  # tiny shapes for Triton's CPU interpreter
        lens = (40, 30, 20, 9, 1, 0)
        return {"mve": [Workload(2, 100, 2, 2, 32, 32, dtype)],
                "qwen3-next": [Workload(1, sum(lens), 2, 4, 32, 32, dtype, lens=lens, layer=True)],
                "long": [Workload(1, 300, 2, 2, 32, 32, dtype)],
                "sweep": [Workload(256 // T, T, 2, 2, 32, 32, dtype) for T in (64, 128, 256)]}[name]
    return {"mve": [Workload(4, 8192, 16, 16, 128, 128, dtype)],
            "qwen3-next": [Workload(1, sum(QWEN3_NEXT_LENS), 16, 32, 128, 128, dtype, lens=QWEN3_NEXT_LENS,
                                    layer=True)],
            "long": [Workload(1, 65536, 16, 16, 128, 128, dtype)],
            "sweep": [Workload(65536 // T, T, 16, 16, 128, 128, dtype) for T in (2048, 8192, 32768, 65536)]}[name]


def workload_inputs(wl: Workload, device, gate: str, seed: int) -> dict:
    """Inputs of one workload (``gdn_inputs``); a layer workload has raw q, k and gate pre-activations ``g`` with
    ``kw`` = the op's ``use_qk_l2norm_in_kernel`` / ``use_gate_in_kernel`` arguments (``A_log``, ``dt_bias`` as
    Qwen3-Next initialises them: ``A_log = log U(1, 16)``, ``dt_bias`` the inverse softplus of
    ``exp(U(log 1e-3, log 1e-1))``), initial states and ``cu_seqlens``."""
    import math

    dtype = DTYPES[wl.dtype]
    N = len(wl.lens) if wl.lens else wl.B
    x = gdn_inputs(wl.B, wl.T, wl.H, wl.K, wl.V, HV=wl.HV, dtype=dtype, device=device, gate=gate, seed=seed,
                   initial_state=wl.layer, num_seqs=N)
    if wl.lens:
        cu = [0]
        for n in wl.lens:
            cu.append(cu[-1] + n)
        x["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=device)
    if wl.layer:
        gen = torch.Generator().manual_seed(seed + 7)
        x["q"] = torch.randn(x["q"].shape, generator=gen).to(dtype).to(device)
        x["k"] = torch.randn(x["k"].shape, generator=gen).to(dtype).to(device)
        x["g"] = torch.randn(x["g"].shape, generator=gen).to(device)  # gate pre-activations a
        a_log = torch.log(torch.empty(wl.HV).uniform_(1.0, 16.0, generator=gen))
        dt = torch.exp(torch.empty(wl.HV).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
        x["kw"] = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=a_log.to(device),
                       dt_bias=(dt + torch.log(-torch.expm1(-dt))).to(device))
    return x


def layer_prologue(x: dict, q, k, g):
    """The layer workloads' l2norm and gate in PyTorch (fp32 inside): what the op does with ``kw``."""
    kw = x.get("kw") or {}
    if kw.get("use_qk_l2norm_in_kernel"):
        q, k = (t.float() * torch.rsqrt((t.float() ** 2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    if kw.get("use_gate_in_kernel"):
        g = -kw["A_log"].float().exp() * torch.nn.functional.softplus(g.float() + kw["dt_bias"].float())
    return q, k, g


def _ints(s: str) -> list[int]:
    return [int(x) for x in str(s).split(",") if x.strip()]


def _variants(spec: str) -> list[str]:
    """``"default,save_v_new"`` -> ``["default", "save_v_new"]``; a name not in ``VARIANTS`` is a clear error."""
    from tfla.bench.registry import VARIANTS

    out = [part.strip() for part in spec.split(",") if part.strip()]
    bad = [v for v in out if v not in VARIANTS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"expected names from {', '.join(VARIANTS)}, got {spec!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    gpu = torch.cuda.is_available()
    p.add_argument("--workload", choices=WORKLOADS, default=None,
                   help="a named workload (overrides --B/--T/--H/--HV/--K/--V): mve, qwen3-next (packed varlen, "
                        "HV = 2H, l2norm and gate in the op, initial states), long (B = 1, T = 65536), sweep "
                        "(T = 2048 .. 65536 at 65,536 tokens)")
    p.add_argument("--lens", type=str, default=None,
                   help="with --workload qwen3-next: the packed sequences' lengths, comma-separated, in packing order "
                        "(default 12767,8192,6000,4000,1808,1: longest first)")
    p.add_argument("--mode", choices=["fwd", "fwdbwd", "bwd"], default="fwd",
                   help="what to time: forward only, forward+backward, or backward only (graph kept)")
    p.add_argument("--B", type=int, default=4 if gpu else 1, help="batch size (ignored with --tokens)")
    p.add_argument("--T", type=str, default="8192" if gpu else "200",
                   help="sequence length(s), comma-separated for a sweep")
    p.add_argument("--tokens", type=int, default=None,
                   help="constant-tokens sweep: B = tokens // T for each T (default: constant batch --B)")
    p.add_argument("--H", type=str, default="16" if gpu else "2", help="key heads, comma-separated for a sweep")
    p.add_argument("--HV", type=int, default=None, help="value heads (GVA when > H; default H)")
    p.add_argument("--K", type=int, default=128 if gpu else 32)
    p.add_argument("--V", type=int, default=128 if gpu else 32)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16" if gpu else "fp32")
    p.add_argument("--variants", type=_variants, default=None,
                   help="what tfla's forward keeps for the backward, comma-separated: default (FLA's saved set), "
                        "save_v_new (Vnew), save_states (Vnew and the 64-row states), slab64 / slab32 (Vnew, the "
                        "backward in slabs of 64 / 32 chunks: less memory, more host time), whole / slabs2 / slabs3 / "
                        "slabs4 (FLA's saved set, the backward in 1 to 4 slabs per dense sequence; the default "
                        "takes 2 for large inputs); default: default with "
                        "--mode fwd (the forward is the same in all three), else the first three")
    p.add_argument("--impls", type=str, default="tfla,fla,flashqla",
                   help="comma-separated subset of tfla,fla,flashqla (peers only when installed)")
    p.add_argument("--gate", choices=GATES, default="default")
    p.add_argument("--warmup", type=float, default=25.0, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=float, default=100.0, help="do_bench repetition time, ms")
    p.add_argument("--csv", type=str, default=None,
                   help="append one row per timed implementation to this CSV file (header written when the file is new; "
                        "columns: tfla.bench.common.CSV_COLUMNS)")
    p.add_argument("--json", type=str, default=None, help="write rows and environment to this JSON file")
    p.add_argument("--plot", type=str, default=None, metavar="PATH",
                   help="write a plot of time against T per implementation (e.g. with --workload sweep) to PATH "
                        "(needs matplotlib: the plot extra)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--autograd-threads", choices=["on", "off"], default="on",
                   help="off: backward on the calling thread (torch.autograd.set_multithreading_enabled(False)) "
                        "for every implementation. PyTorch's default (on) hands each backward to a device thread "
                        "once per torch.autograd.grad call: a model pays it once per backward, this single-op "
                        "benchmark once per op (about 0.6 ms of host time per call on an H200 host)")


def workloads_from_args(args) -> list[Workload]:
    if getattr(args, "lens", None) and args.workload != "qwen3-next":
        raise ValueError("--lens applies to --workload qwen3-next")
    if args.workload:
        wls = named_workloads(args.workload, torch.cuda.is_available(), args.dtype)
        if getattr(args, "lens", None):
            lens = tuple(_ints(args.lens))
            if not lens or min(lens) < 0 or sum(lens) == 0:
                raise ValueError(f"--lens takes lengths >= 0 with a positive sum, got {args.lens!r}")
            wls = [dataclasses.replace(w, T=sum(lens), lens=lens) for w in wls]
        return wls
    out = []
    for H in _ints(args.H):
        HV = args.HV or H
        for T in _ints(args.T):
            B = max(1, args.tokens // T) if args.tokens else args.B
            out.append(Workload(B, T, H, HV, args.K, args.V, args.dtype))
    return out


LEAVES = ("q", "k", "v", "g", "beta")


def _reference(x: dict, do: torch.Tensor | None = None):
    """float32 pure-PyTorch chunkwise reference: (o, final_state) and, given ``do``, the gradients."""
    from tfla.ops.gated_delta_rule.reference import chunk_gated_delta_rule_ref

    f = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in x.items()}
    with torch.enable_grad():
        leaves = [f[n].clone().requires_grad_(do is not None) for n in LEAVES]
        q, k, g = layer_prologue(x, leaves[0], leaves[1], leaves[3])
        o, s = chunk_gated_delta_rule_ref(q, k, leaves[2], g, leaves[4], initial_state=f["initial_state"],
                                          output_final_state=True, chunk_size=64, cu_seqlens=x.get("cu_seqlens"))
        grads = torch.autograd.grad(o, leaves, do.float()) if do is not None else None
    return o.detach(), s.detach(), grads


def _run_impl(impl, x: dict, do: torch.Tensor | None):
    """(o, final_state, grads or None) of one implementation."""
    if do is None:
        with torch.no_grad():
            o, s = impl.fn(x, output_final_state=True)
        return o, s, None
    leaves = {n: x[n].detach().clone().requires_grad_() for n in LEAVES}
    o, s = impl.fn({**x, **leaves}, output_final_state=True)
    grads = torch.autograd.grad(o, [leaves[n] for n in LEAVES], do)
    return o.detach(), s.detach(), grads


def _forward_call(impl, x: dict):
    """A forward on copies of the inputs that require gradients (made here, before the call), returning its outputs
    (which keep the graph and its saved tensors alive)."""
    leaves = {n: x[n].detach().clone().requires_grad_() for n in LEAVES}
    xl = {**x, **leaves}

    def call():
        return impl.fn(xl, output_final_state=False)
    return call


def _timed_call(impl, x: dict, do: torch.Tensor | None, mode: str):
    """The function to time: forward (no grad), forward + backward, or backward alone."""
    if mode == "fwd":
        def call():
            with torch.no_grad():
                return impl.fn(x, output_final_state=False)
        return call
    leaves = {n: x[n].detach().clone().requires_grad_() for n in LEAVES}
    xl = {**x, **leaves}
    order = [leaves[n] for n in LEAVES]
    if mode == "fwdbwd":
        def call():
            o, _ = impl.fn(xl, output_final_state=False)
            return torch.autograd.grad(o, order, do)
        return call
    o, _ = impl.fn(xl, output_final_state=False)

    def call():
        return torch.autograd.grad(o, order, do, retain_graph=True)
    return call


def run(args) -> tuple[list[dict], dict]:
    threads = torch.autograd.is_multithreading_enabled()
    torch.autograd.set_multithreading_enabled(getattr(args, "autograd_threads", "on") == "on")
    try:
        return _run(args)
    finally:
        torch.autograd.set_multithreading_enabled(threads)


def _run(args) -> tuple[list[dict], dict]:
    from rich.progress import Progress

    check_csv(args.csv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wls = workloads_from_args(args)
    if args.variants is None:
        args.variants = _variants("default" if args.mode == "fwd" else "default,save_v_new,save_states")
    variants = args.variants if "tfla" in args.impls else []
    peers = [p for p in ("fla", "flashqla") if p in args.impls.split(",")]
    impls, missing = gdn_impls(variants, peers)
    meta = env_info()
    meta["missing_peers"] = ",".join(missing) or "-"
    meta["autograd_threads"] = "on" if torch.autograd.is_multithreading_enabled() else "off"
    rows = []

    def keep(row):  # written after every row, so a run cut short keeps what it measured
        rows.append(row)
        write_json(rows, meta, args.json)
        if row.get("status") == "ok":
            append_csv(args.csv, [csv_row(row, meta, "chunk_gated_delta_rule", chunk=row["chunk"], gate=row["gate"],
                                          version=None if row["impl"].startswith("tfla") else row["version"],
                                          lens=row.get("lens"))])
    warm_autograd(device)
    with Progress(disable=args.no_progress, transient=True) as bar:
        task = bar.add_task("gdn", total=len(wls) * len(impls))
        for wl in wls:
            dtype = DTYPES[wl.dtype]
            x = workload_inputs(wl, device, args.gate, args.seed)
            do = None
            if args.mode != "fwd":
                gen = torch.Generator(device=device).manual_seed(args.seed + 1)
                do = torch.randn(wl.B, wl.T, wl.HV, wl.V, device=device, generator=gen).to(dtype)
            ref_o, ref_s, ref_g = _reference(x, do)
            for impl in impls:
                bar.update(task, description=f"{impl.name} | {wl.label()}")
                cost = gdn_fwd_cost(wl.B, wl.T, wl.H, wl.HV, wl.K, wl.V, impl.chunk_size,
                                    itemsize=dtype.itemsize, state_itemsize=impl.state_itemsize)
                flops = {"fwd": cost.flops, "bwd": 0.0, "fwdbwd": cost.flops}[args.mode]
                if args.mode != "fwd":
                    flops += gdn_bwd_cost(wl.B, wl.T, wl.H, wl.HV, wl.K, wl.V, impl.chunk_size)
                row = {"impl": impl.name, "version": impl.version, "mode": args.mode, "chunk": impl.chunk_size,
                       "B": wl.B, "T": wl.T, "H": wl.H, "HV": wl.HV, "K": wl.K, "V": wl.V, "dtype": wl.dtype,
                       "gate": "qwen3-next in op" if wl.layer else args.gate, "workload": args.workload or "custom",
                       "label": wl.label()}
                if wl.lens:
                    row["lens"] = ",".join(map(str, wl.lens))
                try:
                    t0 = time.perf_counter()  # the first call at this workload: compiles what it has not yet
                    o, s, grads = _run_impl(impl, x, do)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    row["first_s"] = time.perf_counter() - t0
                    row["err_o"], row["err_state"] = rel_l2(o, ref_o), rel_l2(s, ref_s)
                    if grads is not None:
                        for name, gr, rg in zip(GRAD_NAMES, grads, ref_g):
                            row[f"err_{name}"] = rel_l2(gr, rg)
                    del o, s, grads
                except Exception as e:  # a peer that rejects this shape or machine: report, keep going
                    row["status"] = error_status(e)
                    keep(row)
                    bar.advance(task)
                    continue
                tol = TOLERANCE[wl.dtype]
                bad = [k for k, e in row.items() if k.startswith("err_") and
                       not (e <= (TOLERANCE_DG[wl.dtype] if k == "err_dg" else tol))]
                if bad:
                    row["status"] = f"WRONG ({', '.join(b[4:] for b in bad)} rel-L2 above tolerance): not timed"
                    keep(row)
                    bar.advance(task)
                    continue
                call = _timed_call(impl, x, do, args.mode)
                row["ms"] = time_ms(call, args.warmup, args.rep)
                row["host_ms"] = host_ms(call)
                row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12 if flops else None
                row["gbps_min"] = cost.min_bytes / (row["ms"] * 1e-3) / 1e9 if args.mode == "fwd" else None
                del call
                gc.collect()
                row["peak_mib"] = peak_mib(_timed_call(impl, x, do, "fwdbwd" if args.mode == "bwd" else args.mode))
                if args.mode != "fwd":
                    row["held_mib"] = held_mib(_forward_call(impl, x))
                row["state_mib"] = cost.state_bytes / 2**20
                row["status"] = "ok"
                keep(row)
                bar.advance(task)
                gc.collect()
            del x, ref_o, ref_s, ref_g, do
            if device == "cuda":
                torch.cuda.empty_cache()
    _add_speedups(rows)
    return rows, meta


def _add_speedups(rows: list[dict]) -> None:
    keyf = ("B", "T", "H", "HV", "K", "V", "dtype", "mode")
    base = {tuple(r[k] for k in keyf): r["ms"] for r in rows if r["impl"] == "fla" and "ms" in r}
    for r in rows:
        b = base.get(tuple(r[k] for k in keyf))
        r["speedup_vs_fla"] = (b / r["ms"]) if (b and "ms" in r) else None


def print_table(rows: list[dict], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    mode = rows[0]["mode"] if rows else "fwd"
    t = Table(title=f"Gated DeltaNet {mode} | {meta['device']} | torch {meta['torch']} | triton {meta['triton']}",
              title_justify="left")
    grad_cols = [] if mode == "fwd" else [f"err {n}" for n in GRAD_NAMES]
    bw_cols = ["GB/s (min bytes)"] if mode == "fwd" else []
    held_cols = [] if mode == "fwd" else ["held MiB"]
    for col in ("impl", "workload", "ms", "host ms", "first call s", "TFLOP/s", *bw_cols, "peak MiB", *held_cols, "state MiB",
                "err o", "err state", *grad_cols, "vs FLA", "status"):
        t.add_column(col, justify="left" if col in ("impl", "workload", "status") else "right")
    for r in rows:
        wl = r.get("label") or (f"B={r['B']} T={r['T']} H={r['H']}" + (f" HV={r['HV']}" if r["HV"] != r["H"] else "")
                                + f" K={r['K']} V={r['V']} {r['dtype']}")
        t.add_row(r["impl"], wl, fmt(r.get("ms")), fmt(r.get("host_ms")), fmt(r.get("first_s"), ".1f"), fmt(r.get("tflops"), ".1f"),
                  *([fmt(r.get("gbps_min"), ".0f")] if bw_cols else []),
                  fmt(r.get("peak_mib"), ".0f"), *([fmt(r.get("held_mib"), ".0f")] if held_cols else []),
                  fmt(r.get("state_mib"), ".1f"), fmt(r.get("err_o"), ".2e"),
                  fmt(r.get("err_state"), ".2e"), *[fmt(r.get(f"err_{n}"), ".2e") for n in GRAD_NAMES if grad_cols],
                  (fmt(r.get("speedup_vs_fla"), ".2f") + "x") if r.get("speedup_vs_fla") else "-", r.get("status", ""))
    console = Console(width=max(160 if mode == "fwd" else 230, Console().width))
    console.print(t)
    if meta.get("missing_peers", "-") != "-":
        console.print(f"not available (skipped): {meta['missing_peers']}", markup=False)
    console.print(f"versions: fla-core {meta['fla-core']}, flash-qla {meta['flash-qla']}, tfla {meta['tfla']} "
                  f"(git {meta['git'] or '-'}), {meta['date']}"
                  + ("" if meta.get("autograd_threads", "on") == "on" else ", autograd threads off"))


def plot(rows: list[dict], meta: dict, path: str) -> None:
    """Time against T, one line per implementation (rows with a time), log-log, to ``path`` (any format matplotlib
    writes); beside it, where rows measured memory (a GPU), peak memory (solid) and the memory held from forward to
    backward (dashed, ``--mode fwdbwd|bwd``) against T in MiB. Needs matplotlib (``pip install 'tfla[plot]'``)."""
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'tfla[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = list(dict.fromkeys(r["impl"] for r in rows))
    memory = any(r.get("peak_mib") is not None for r in rows)
    fig, axes = plt.subplots(1, 2 if memory else 1, figsize=(12.0 if memory else 6.4, 4.2), squeeze=False)
    ax = axes[0][0]
    for impl in impls:
        pts = sorted((r["T"], r["ms"]) for r in rows if r["impl"] == impl and r.get("ms") is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("T (tokens per sequence)")
    ax.set_ylabel("ms (median)")
    mode = rows[0]["mode"] if rows else "fwd"
    ax.set_title(f"Gated DeltaNet {mode}, {meta['device']}\ntorch {meta['torch']}, triton {meta['triton']}, "
                 f"{meta['date']}", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if memory:
        ax = axes[0][1]
        for i, impl in enumerate(impls):
            color = f"C{i}"
            for key, style, what in (("peak_mib", "-", "peak"), ("held_mib", "--", "held for backward")):
                pts = sorted((r["T"], r[key]) for r in rows if r["impl"] == impl and r.get(key) is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, marker="o",
                            label=f"{impl} {what}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (tokens per sequence)")
        ax.set_ylabel("MiB above the inputs")
        ax.set_title("memory", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main(args) -> int:
    if args.plot:  # fail before the run, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise SystemExit("--plot needs matplotlib: pip install 'tfla[plot]'") from e
    rows, meta = run(args)
    write_json(rows, meta, args.json)
    print_table(rows, meta)
    if args.plot:
        plot(rows, meta, args.plot)
    bad = [r for r in rows if r["impl"].startswith("tfla") and r.get("status") != "ok"]
    return 1 if bad else 0
