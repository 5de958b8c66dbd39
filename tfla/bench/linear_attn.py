"""``tfla bench linear-attn``: linear attention with no, constant, scalar or vector decay, tfla (each
chunk size) against FLA, after a correctness check of every implementation.

Decay kinds and the ops compared (same arguments and layout ``[B, T, H, K|V]`` on both sides):

    none      tfla.chunk_linear_attn(normalize=False)   fla.ops.linear_attn.chunk_linear_attn(normalize=False)
    constant  tfla.chunk_retention                      fla.ops.retention.chunk_retention
    scalar    tfla.chunk_simple_gla(g [B, T, H])        fla.ops.simple_gla.chunk_simple_gla
    vector    tfla.chunk_gla(g [B, T, H, K])            fla.ops.gla.chunk_gla   (tfla row 'not implemented' if absent)
    lightning tfla.chunk_lightning_attn                 fla.ops.lightning_attn.chunk_lightning_attn
              (Lightning Attention's constant decays of layer LIGHTNING_LAYER of LIGHTNING_LAYERS: the first
              layer of a 24-layer model, the strongest decays, -(8 / H) h per token for head h)

FLA runs at its own chunk size (64) with ``FLA_FLASH_QLA=0``. For each workload, before any timing:

1. full check: the output (and gradients) on the benchmark inputs against tfla's fp32 run of the same op
   at L = 64 on fp32 copies of the inputs (column ``ref``; an implementation's own fp32 run when tfla
   lacks the op): the ``err_*`` columns. This is the implementation's first call at the workload; its wall
   time, s, is column ``first_s`` (it compiles what Triton's cache and the earlier rows have not);
2. slice check (cheap, always): every implementation on ``q[:1, :slice_T]`` (the benchmark dtype) against
   the float64 step-by-step recurrence (``recurrent_simple_gla_ref``; ``recurrent_gla_ref`` for
   "vector") on the same rounded inputs: rel-L2 of o (and with ``--mode fwdbwd`` of dq, dk, dv, dg for a
   random cotangent) in the ``slice_err_*`` columns.

An implementation off by more than the dtype's tolerance in any of these, or not finite, is reported
WRONG and not timed. Then: median time (``triton.testing.do_bench``), TFLOP/s from a matmul-FLOP model
(``linear_attn_cost``), GB/s of the minimal bytes (forward), peak memory above the inputs.

The helpers in the second half (layout, check, time) are shared with ``tfla.bench.mlstm``.
"""
from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass

import torch

from tfla.bench.common import (append_csv, check_csv, csv_row, env_info, error_status, fmt, peak_mib, rel_l2,
                               time_ms, warm_autograd, write_json)
from tfla.bench.inputs import DECAY_KINDS, GATES, linear_attn_inputs

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# refuse-to-time thresholds (rel-L2 against the reference); the measured error is reported
TOLERANCE = {"fp32": 1e-3, "fp16": 1e-2, "bf16": 2e-2}
# gate gradients (dg; mLSTM di, df) are the weakest in every implementation: their own threshold
TOLERANCE_GATE = {"fp32": 5e-3, "fp16": 5e-2, "bf16": 1e-1}
GATE_GRADS = ("dg", "di", "df")
# statuses of rows that did not run for a reason other than a failure of the implementation
SKIPPED = ("not implemented", "not available")


@dataclass(frozen=True)
class Workload:
    kind: str
    B: int
    T: int
    H: int
    K: int
    V: int
    dtype: str

    def label(self) -> str:
        return f"{self.kind} B={self.B} T={self.T} H={self.H} K={self.K} V={self.V} {self.dtype}"


def ints(s: str) -> list[int]:
    return [int(x) for x in str(s).split(",") if x.strip()]


def names(s: str) -> list[str]:
    return [x.strip() for x in str(s).split(",") if x.strip()]


def add_common_arguments(p: argparse.ArgumentParser, impls: str, chunk_sizes: str = "64,128,256") -> None:
    """Options shared by ``linear-attn`` and ``mlstm`` (workload options are each command's own)."""
    gpu = torch.cuda.is_available()
    p.add_argument("--mode", choices=["fwd", "fwdbwd"], default="fwd",
                   help="what to time: forward only (no grad), or forward + backward (torch.autograd.grad)")
    p.add_argument("--tokens", type=int, default=None,
                   help="constant-tokens sweep: B = tokens // T for each T (default: constant batch --B)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16" if gpu else "fp32")
    p.add_argument("--chunk-sizes", type=str, default=chunk_sizes, help="tfla outer chunk sizes L")
    p.add_argument("--impls", type=str, default=impls, help="comma-separated implementations (peers only when installed)")
    p.add_argument("--slice-T", type=int, default=256,
                   help="slice check against the float64 recurrence on B=1, T=min(T, slice-T)")
    p.add_argument("--warmup", type=float, default=25.0, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=float, default=100.0, help="do_bench repetition time, ms")
    p.add_argument("--csv", type=str, default=None,
                   help="append one row per timed implementation to this CSV file (header written when the file is new; "
                        "columns: tfla.bench.common.CSV_COLUMNS)")
    p.add_argument("--json", type=str, default=None, help="write rows and environment to this JSON file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_arguments(p: argparse.ArgumentParser) -> None:
    gpu = torch.cuda.is_available()
    p.add_argument("--kinds", type=str, default=",".join(DECAY_KINDS),
                   help=f"decay kinds, comma-separated subset of {','.join(DECAY_KINDS)}")
    p.add_argument("--B", type=int, default=4 if gpu else 1, help="batch size (ignored with --tokens)")
    p.add_argument("--T", type=str, default="8192" if gpu else "200",
                   help="sequence length(s), comma-separated for a sweep")
    p.add_argument("--H", type=int, default=16 if gpu else 2, help="heads")
    p.add_argument("--K", type=int, default=128 if gpu else 32)
    p.add_argument("--V", type=int, default=128 if gpu else 32)
    p.add_argument("--gate", choices=GATES, default="default", help="decay regime of g (scalar, vector)")
    add_common_arguments(p, impls="tfla,fla")


def workloads_from_args(args) -> list[Workload]:
    kinds = names(args.kinds)
    for kind in kinds:
        if kind not in DECAY_KINDS:
            raise SystemExit(f"--kinds: unknown decay kind {kind!r} (choose from {', '.join(DECAY_KINDS)})")
    out = []
    for kind in kinds:
        for T in ints(args.T):
            B = max(1, args.tokens // T) if args.tokens else args.B
            out.append(Workload(kind, B, T, args.H, args.K, args.V, args.dtype))
    return out


def linear_attn_cost(B: int, T: int, H: int, K: int, V: int, chunk_size: int, mode: str, itemsize: int,
                     gate_elems: int = 0) -> tuple[float, float]:
    """``(matmul FLOPs, minimal bytes)`` of one call: per token and head, forward multiply-adds
    ``2 K V`` (state update, q S) + ``32 (L/64 + 1) (K + V)`` (L x L causal intra-chunk part in 64-row
    tiles, as ``tfla.ops.gated_delta_rule.cost``); backward ``5 K V + 3 x intra`` (states recomputed,
    dq, dk, dv, state-gradient recurrence). Minimal bytes (forward): q, k, v and gates read once, o
    written once; ``gate_elems`` fp32 gate elements per token and head."""
    intra = 32 * (chunk_size / 64 + 1) * (K + V)
    mac = 2 * K * V + intra
    if mode == "fwdbwd":
        mac += 5 * K * V + 3 * intra
    tok = B * T * H
    min_bytes = tok * ((2 * K + 2 * V) * itemsize + 4 * gate_elems)
    return 2.0 * tok * mac, float(min_bytes)


def _slice_reference_fn(kind: str):
    """float64 ground truth of ``kind``: fn(x) -> o."""
    from tfla.ops.gla.reference import recurrent_gla_ref
    from tfla.ops.simple_gla.reference import recurrent_simple_gla_ref, retention_log_decay

    if kind == "none":
        return lambda x: recurrent_simple_gla_ref(x["q"], x["k"], x["v"])[0]
    if kind == "constant":
        return lambda x: recurrent_simple_gla_ref(
            x["q"], x["k"], x["v"], g_gamma=retention_log_decay(x["q"].shape[2], device=x["q"].device).double())[0]
    if kind == "lightning":
        from tfla.bench.registry import LIGHTNING_LAYER, LIGHTNING_LAYERS
        from tfla.ops.simple_gla.reference import lightning_log_decay

        return lambda x: recurrent_simple_gla_ref(x["q"], x["k"], x["v"], g_gamma=lightning_log_decay(
            x["q"].shape[2], LIGHTNING_LAYER, LIGHTNING_LAYERS, device=x["q"].device).double())[0]
    if kind == "scalar":
        return lambda x: recurrent_simple_gla_ref(x["q"], x["k"], x["v"], g=x["g"])[0]
    return lambda x: recurrent_gla_ref(x["q"], x["k"], x["v"], x["g"])[0]


# ----------------------------------------------------------------------------------------------
# shared with tfla.bench.mlstm: layout, one checked run, timing
# ----------------------------------------------------------------------------------------------
def to_layout(x: dict, head_first: bool) -> dict:
    """``[B, T, H, ...]`` tensors to ``[B, H, T, ...]`` (and back: the same swap) when ``head_first``."""
    if not head_first:
        return x
    return {n: (t.transpose(1, 2).contiguous() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}


def _swap(t: torch.Tensor, head_first: bool) -> torch.Tensor:
    return t.transpose(1, 2) if head_first else t


def as_dtype(x: dict, dtype: torch.dtype) -> dict:
    return {n: (t.to(dtype) if isinstance(t, torch.Tensor) else t) for n, t in x.items()}


def slice_inputs(x: dict, T: int) -> dict:
    """``[:1, :T]`` of every ``[B, T, ...]`` tensor."""
    return {n: (t[:1, :T].contiguous() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}


def grad_names(leaves) -> list[str]:
    return [f"d{n}" for n in leaves]


def run_checked(fn, x: dict, leaves, do: torch.Tensor | None, head_first: bool = False):
    """``(o, {dname: grad})`` of ``fn`` on ``x`` (``[B, T, H, ...]``; converted to the entry's layout and
    back), the gradients of ``leaves`` for the cotangent ``do`` when given."""
    xn = to_layout(x, head_first)
    if do is None:
        with torch.no_grad():
            o = fn(xn)
        return _swap(o, head_first).detach(), {}
    lv = {n: xn[n].detach().clone().requires_grad_() for n in leaves}
    with torch.enable_grad():
        o = fn({**xn, **lv})
        grads = torch.autograd.grad(o, [lv[n] for n in leaves], _swap(do, head_first))
    return _swap(o, head_first).detach(), {d: _swap(g, head_first) for d, g in zip(grad_names(leaves), grads)}


def timed_call(fn, x: dict, leaves, do: torch.Tensor | None, mode: str, head_first: bool = False):
    """The function to time, inputs already in the entry's layout (conversion not timed)."""
    xn = to_layout(x, head_first)
    if mode == "fwd":
        def call():
            with torch.no_grad():
                return fn(xn)
        return call
    lv = {n: xn[n].detach().clone().requires_grad_() for n in leaves}
    xl = {**xn, **lv}
    order = [lv[n] for n in leaves]
    don = _swap(do, head_first).contiguous()

    def call():
        o = fn(xl)
        return torch.autograd.grad(o, order, don)
    return call


def add_errors(row: dict, prefix: str, o, grads: dict, ref_o, ref_grads: dict, only=None) -> None:
    if only is None or "o" in only:
        row[f"{prefix}o"] = rel_l2(o, ref_o) if ref_o is not None else None
    for d, g in grads.items():
        if only is None or d in only:
            row[f"{prefix}{d}"] = rel_l2(g, ref_grads[d]) if ref_grads.get(d) is not None else None


_ERR_ORDER = ("o", "dq", "dk", "dv", "dg", "di", "df")


def order_columns(row: dict) -> dict:
    """The row with its err_* then slice_err_* columns (o, dq, dk, dv, dg, di, df) after the others."""
    def key(k):
        for rank, prefix in ((1, "err_"), (2, "slice_err_")):
            if k.startswith(prefix) and k[len(prefix):] in _ERR_ORDER:
                return rank, _ERR_ORDER.index(k[len(prefix):])
        return 0, 0
    return {k: row[k] for k in sorted(row, key=key)}


def over_tolerance(row: dict, dtype: str) -> list[str]:
    """Error columns above the dtype's tolerance (or not finite)."""
    bad = []
    for key, e in row.items():
        if not key.startswith(("err_", "slice_err_")) or e is None:
            continue
        tol = TOLERANCE_GATE[dtype] if key.rsplit("_", 1)[-1] in GATE_GRADS else TOLERANCE[dtype]
        if not e <= tol:
            bad.append(key.removeprefix("err_").replace("slice_err_", "slice "))
    return bad


def measure(row: dict, fn, x: dict, leaves, do, mode: str, head_first: bool, warmup: float, rep: float,
            flops: float, min_bytes: float) -> None:
    """Median ms, TFLOP/s, GB/s (forward) and peak MiB of one checked implementation into ``row``."""
    call = timed_call(fn, x, leaves, do, mode, head_first)
    row["ms"] = time_ms(call, warmup, rep)
    row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
    row["gbps_min"] = min_bytes / (row["ms"] * 1e-3) / 1e9 if mode == "fwd" else None
    del call
    gc.collect()
    row["peak_mib"] = peak_mib(timed_call(fn, x, leaves, do, mode, head_first))
    gc.collect()


def random_cotangent(shape, dtype, device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    return torch.randn(*shape, device=device, generator=gen).to(dtype)


# ----------------------------------------------------------------------------------------------
def run(args) -> tuple[list[dict], dict]:
    from rich.progress import Progress

    from tfla.bench.registry import LINEAR_ATTN_OPS, linear_attn_impls, tfla_linear_attn_impl

    check_csv(args.csv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wls = workloads_from_args(args)
    warm_autograd(device)
    want = names(args.impls)
    chunk_sizes = ints(args.chunk_sizes) if "tfla" in want else []
    peers = [p for p in want if p != "tfla"]
    unknown = [p for p in peers if p != "fla"]
    if unknown:
        raise SystemExit(f"--impls: unknown implementation(s) {', '.join(unknown)} (choose from tfla, fla)")
    meta = env_info()
    missing = set()
    rows = []

    def keep(row):  # written after every row, so a run cut short keeps what it measured
        rows.append(row)
        write_json(rows, meta, args.json)
        if row.get("status") == "ok":
            append_csv(args.csv, [csv_row(row, meta, LINEAR_ATTN_OPS[row["kind"]][0], kind=row["kind"],
                                          chunk=row["chunk"], gate=row["gate"] if row["gate"] != "-" else None,
                                          first_s=f"{row['first_s']:.2f}",
                                          version=None if row["impl"].startswith("tfla") else row["version"])])

    per_kind = {kind: linear_attn_impls(kind, chunk_sizes, peers) for kind in dict.fromkeys(w.kind for w in wls)}
    with Progress(disable=args.no_progress, transient=True) as bar:
        task = bar.add_task("linear-attn", total=sum(len(per_kind[w.kind][0]) for w in wls))
        for wl in wls:
            impls, miss = per_kind[wl.kind]
            missing.update(miss)
            dtype = DTYPES[wl.dtype]
            x = linear_attn_inputs(wl.B, wl.T, wl.H, wl.K, wl.V, kind=wl.kind, dtype=dtype, device=device,
                                   gate=args.gate, seed=args.seed)
            leaves = ["q", "k", "v"] + (["g"] if x["g"] is not None else [])
            do = random_cotangent((wl.B, wl.T, wl.H, wl.V), dtype, device, args.seed) if args.mode == "fwdbwd" else None
            # float64 ground truth on the slice
            Ts = min(wl.T, args.slice_T)
            xs, dos = slice_inputs(x, Ts), (do[:1, :Ts].contiguous() if do is not None else None)
            s_o, s_g = run_checked(_slice_reference_fn(wl.kind), as_dtype(xs, torch.float64), leaves,
                                   dos.double() if dos is not None else None)
            # fp32 reference on the full inputs: tfla's op at L = 64
            ref_impl = tfla_linear_attn_impl(wl.kind, 64)
            ref, ref_label = None, "self fp32"
            if ref_impl.fn is not None:
                try:
                    ref = run_checked(ref_impl.fn, as_dtype(x, torch.float32), leaves,
                                      do.float() if do is not None else None)
                    ref_label = "tfla fp32 L=64"
                except Exception as e:
                    meta["reference_error"] = error_status(e)
            for impl in impls:
                bar.update(task, description=f"{impl.name} | {wl.label()}")
                row = {"impl": impl.name, "version": impl.version, "kind": wl.kind, "mode": args.mode,
                       "chunk": impl.chunk_size, "B": wl.B, "T": wl.T, "H": wl.H, "K": wl.K, "V": wl.V,
                       "dtype": wl.dtype, "gate": args.gate if wl.kind in ("scalar", "vector") else "-",
                       "op": impl.note, "ref": ref_label, "slice_T": Ts}
                if impl.unavailable:
                    row["ref"] = None
                    row["status"] = impl.unavailable
                    keep(row)
                    bar.advance(task)
                    continue
                try:
                    t0 = time.perf_counter()  # the first call at this workload: compiles what it has not yet
                    o, g = run_checked(impl.fn, x, leaves, do)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    row["first_s"] = time.perf_counter() - t0
                    r_o, r_g = ref if ref is not None else run_checked(
                        impl.fn, as_dtype(x, torch.float32), leaves, do.float() if do is not None else None)
                    add_errors(row, "err_", o, g, r_o, r_g)
                    o, g = run_checked(impl.fn, xs, leaves, dos)
                    add_errors(row, "slice_err_", o, g, s_o, s_g)
                    row = order_columns(row)
                    del o, g, r_o, r_g
                except Exception as e:  # a peer that rejects this shape or machine: report, keep going
                    row["status"] = error_status(e)
                    keep(row)
                    bar.advance(task)
                    continue
                bad = over_tolerance(row, wl.dtype)
                if bad:
                    row["status"] = f"WRONG ({', '.join(bad)} rel-L2 above tolerance): not timed"
                    keep(row)
                    bar.advance(task)
                    continue
                gate_elems = {"scalar": 1, "vector": wl.K}.get(wl.kind, 0)
                flops, min_bytes = linear_attn_cost(wl.B, wl.T, wl.H, wl.K, wl.V, impl.chunk_size, args.mode,
                                                    dtype.itemsize, gate_elems)
                try:
                    measure(row, impl.fn, x, leaves, do, args.mode, False, args.warmup, args.rep, flops, min_bytes)
                    row["status"] = "ok"
                except Exception as e:
                    row["status"] = error_status(e)
                keep(row)
                bar.advance(task)
                gc.collect()
            del x, do, xs, dos, s_o, s_g, ref
            if device == "cuda":
                torch.cuda.empty_cache()
    meta["missing_peers"] = ",".join(sorted(missing)) or "-"
    add_speedups(rows, "fla", ("kind", "B", "T", "H", "K", "V", "dtype", "mode"), "speedup_vs_fla")
    return rows, meta


def add_speedups(rows: list[dict], base_impl, keyf, col: str) -> None:
    """``col`` = time of the fastest row whose impl matches ``base_impl`` (a name or a predicate) with the
    same ``keyf`` values, over this row's time."""
    match = (lambda r: r["impl"] == base_impl) if isinstance(base_impl, str) else base_impl
    base = {}
    for r in rows:
        if match(r) and r.get("ms"):
            k = tuple(r[f] for f in keyf)
            base[k] = min(base.get(k, float("inf")), r["ms"])
    for r in rows:
        b = base.get(tuple(r[f] for f in keyf))
        r[col] = (b / r["ms"]) if (b and r.get("ms")) else None


def max_slice_err(r: dict):
    errs = [v for k, v in r.items() if k.startswith("slice_err_") and v is not None]
    return max(errs) if errs else None


def print_table(rows: list[dict], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    mode = rows[0]["mode"] if rows else "fwd"
    t = Table(title=f"Linear attention {mode} | {meta['device']} | torch {meta['torch']} | triton {meta['triton']}",
              title_justify="left")
    grads = [] if mode == "fwd" else ["dq", "dk", "dv", "dg"]
    bw_cols = ["GB/s (min bytes)"] if mode == "fwd" else []
    for col in ("impl", "kind", "workload", "ms", "first call s", "TFLOP/s (model)", *bw_cols, "peak MiB", "err o",
                *[f"err {n}" for n in grads], "slice err (max)", "vs FLA", "status"):
        t.add_column(col, justify="left" if col in ("impl", "kind", "workload", "status") else "right")
    for r in rows:
        wl = f"B={r['B']} T={r['T']} H={r['H']} K={r['K']} V={r['V']} {r['dtype']}"
        t.add_row(r["impl"], r["kind"], wl, fmt(r.get("ms")), fmt(r.get("first_s"), ".1f"), fmt(r.get("tflops"), ".1f"),
                  *([fmt(r.get("gbps_min"), ".0f")] if bw_cols else []), fmt(r.get("peak_mib"), ".0f"),
                  fmt(r.get("err_o"), ".2e"), *[fmt(r.get(f"err_{n}"), ".2e") for n in grads],
                  fmt(max_slice_err(r), ".2e"),
                  (fmt(r.get("speedup_vs_fla"), ".2f") + "x") if r.get("speedup_vs_fla") else "-", r.get("status", ""))
    console = Console(width=max(190 if mode == "fwd" else 230, Console().width))
    console.print(t)
    if meta.get("missing_peers", "-") != "-":
        console.print(f"not available (skipped): {meta['missing_peers']}", markup=False)
    if meta.get("reference_error"):
        console.print(f"tfla fp32 reference failed (rows use their own fp32 run): {meta['reference_error']}")
    console.print(f"versions: fla-core {meta['fla-core']}, tfla {meta['tfla']} (git {meta['git'] or '-'}), "
                  f"{meta['date']}")


def exit_code(rows: list[dict]) -> int:
    """1 if a tfla row failed (error or WRONG); rows of ops not implemented or not available do not count."""
    bad = [r for r in rows if r["impl"].startswith("tfla") and r.get("status") != "ok"
           and not str(r.get("status", "")).startswith(SKIPPED)]
    return 1 if bad else 0


def main(args) -> int:
    rows, meta = run(args)
    write_json(rows, meta, args.json)
    print_table(rows, meta)
    return exit_code(rows)
