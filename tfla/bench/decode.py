"""``tfla bench decode``: Gated DeltaNet decode steps, ``tfla.fused_recurrent_gated_delta_rule`` against FLA's
``fused_recurrent_gated_delta_rule`` (when ``fla`` imports), after a correctness check of every implementation
against the float64 step-by-step recurrence.

Workload (issue 26's decode target), on a GPU by default: T = 1 token per sequence (``--T`` for speculative
steps), B = 1, 8, 64, 256 sequences (``--B``), H = 16 key heads, HV = 32 value heads, K = V = 128, bf16 q, k, v
and beta, fp32 log gates g (``gdn_inputs``, the tests' factory) and fp32 states. Without a GPU the same structure
at interpreter sizes (B = 1, 3, H = 1, HV = 2, K = V = 16, fp32). Modes (``--modes``):

    state  the states passed as ``initial_state [B, HV, K, V]``, ``output_final_state=True`` (a new fp32 final
           state per call): FLA's interface, the one both implementations have
    pool   a pool of 2B fp32 slots ``[2B, HV, K, V]``, B of them (a random choice) named by 1-D
           ``ssm_state_indices``, ``inplace_final_state=True``: each sequence reads its slot and writes its final
           state back (vLLM's / SGLang's interface; also at T > 1: the per-token slots of 2-D indices are not
           benched). tfla only: FLA 0.6.0's op has no state pool

Both modes start from the same states (the pool's chosen slots), so one reference serves both:
``recurrent_gated_delta_rule_ref`` in float64 on the upcast (already rounded) inputs. Each implementation's o and
final state (pool: the written slots) are compared by relative L2; above the dtype's tolerance (``TOLERANCE``, the
same as ``tfla bench gdn``), not finite, or (pool) with any other slot changed, the row is WRONG and not timed.

Timing: median ``triton.testing.do_bench`` of one call (one decode step of T tokens per sequence; do_bench clears
the L2 cache before each call, so states come from HBM), column ``us`` in microseconds per step (``ms`` in the
JSON / CSV rows). At small batches an eager call is bound by its host side (Python and the kernel launch, ~40-160
us per call on the H200 machines measured, varying between runs), so on a GPU the same call is also replayed from a
CUDA graph (``graph us``, ``graph_ms``: device time alone, as vLLM and SGLang run decode steps), and the columns
below use that time (an implementation that cannot be captured keeps its eager time there, and the table says so). ``first_s``: wall time of the first call at the workload (the check call: it compiles
what Triton's cache and earlier rows have not). On a GPU only: the bytes floor, each state read and written once
(``2 B HV K V * 4``) plus q, k, v, g, beta read and o written once, as GB/s achieved and as ``x floor`` = time /
(bytes / bandwidth), with the bandwidth the GPU's HBM specification (``HBM_TBPS`` by device name, e.g. H100 SXM
3.35 TB/s, H200 4.8; ``--hbm-tbps`` sets it, and without a known name the column stays empty); and ``x copy`` =
time / the measured time of ``copy_`` between two fp32 tensors of the states' size (``copy us``: the same
bytes read and written once by PyTorch's copy kernel, the floor this GPU attains: the faster of a CUDA-graph replay,
as the rows are timed, and the eager call). ``vs FLA``: FLA's state-mode
time at the same B and T over the row's time (graph times on a GPU; for both modes: FLA has no pool). Without a
GPU the times are the interpreter's wall-clock median of a few calls, and the graph and floor columns are empty.
"""
from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tfla.bench import gdn
from tfla.bench.common import (
    append_csv,
    check_csv,
    csv_row,
    env_info,
    error_status,
    fmt,
    graph_ms,
    rel_l2,
    time_ms,
    write_json,
)
from tfla.bench.gdn import DTYPES, TOLERANCE
from tfla.bench.inputs import as_reference, gdn_inputs
from tfla.bench.registry import _version, fla_flash_qla_off, import_peer, missing_note

MODES = ("state", "pool")
IMPLS = ("tfla", "fla")
# HBM bandwidth by the specification of the GPU (TB/s), for the x-floor column: the first entry whose words all
# appear in the device name (NVIDIA's data sheets: H100 SXM5 HBM3, H100 PCIe HBM2e, H100 NVL, H200 HBM3e)
HBM_TBPS = ((("H100", "PCIe"), 2.0), (("H100", "NVL"), 3.9), (("H100",), 3.35), (("H200",), 4.8))
OP = "fused_recurrent_gated_delta_rule"


@dataclass(frozen=True)
class Workload(gdn.Workload):
    """``tfla bench gdn``'s workload (one token step per sequence here) with the decode call's byte floor."""

    def floor_bytes(self) -> int:
        """Bytes of one call read or written at least once: fp32 states read and written, q, k, v, beta, o in the
        input dtype, fp32 g (the pool's index vector, 4 B bytes, is left out)."""
        item = DTYPES[self.dtype].itemsize
        state = 2 * self.B * self.HV * self.K * self.V * 4
        qk = 2 * self.B * self.T * self.H * self.K * item
        vo = 2 * self.B * self.T * self.HV * self.V * item
        gates = self.B * self.T * self.HV * (4 + item)
        return state + qk + vo + gates

    def copy_floor_ms(self, warmup: float, rep: float) -> float:
        """Device time (ms) of ``copy_`` between two fp32 tensors of the states' size: each state's bytes read and
        written once by PyTorch's copy kernel; the lower of the median replay from a CUDA graph (as the rows' ``graph
        us``; where capture works) and the median eager ``do_bench`` time. The eager time carries a launch gap at
        small B; the replay measured slower at large B (NVIDIA H200, torch 2.11, B = 256, HV = 32, K = V = 128: 401.0
        us replayed against 257.4 eager, 2026-11-29; not explained), so neither alone is the floor."""
        src = torch.randn(self.B, self.HV, self.K, self.V, device="cuda")
        dst = torch.empty_like(src)
        try:
            try:
                graph = graph_ms(lambda: dst.copy_(src), warmup, rep)
            except RuntimeError:  # (capture refused)
                graph = None
            eager = time_ms(lambda: dst.copy_(src), warmup, rep)
            return eager if graph is None else min(graph, eager)
        finally:
            del src, dst


def spec_tbps(device_name: str) -> float | None:
    """The HBM bandwidth of ``HBM_TBPS`` for a CUDA device name, or None for a GPU not in the table."""
    for words, tbps in HBM_TBPS:
        if all(w in device_name for w in words):
            return tbps
    return None


def _list_of(kind: Callable, allowed: tuple | None, what: str) -> Callable[[str], list]:
    """argparse ``type`` of a comma list: ``"1,8"`` -> ``[1, 8]``; an empty list, a value that does not parse, is
    not positive, or is not in ``allowed`` is an argparse error."""
    def parse(spec: str) -> list:
        out = []
        for part in (p.strip() for p in str(spec).split(",")):
            try:
                val = kind(part)
            except ValueError:
                val = None
            if not part or val is None or (allowed is not None and val not in allowed) \
                    or (kind is int and val < 1):
                raise argparse.ArgumentTypeError(f"expected a comma list of {what}, got {spec!r}")
            out.append(val)
        return list(dict.fromkeys(out))
    return parse


def _positive(s: str) -> int:
    try:
        n = int(s)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    gpu = torch.cuda.is_available()
    p.add_argument("--B", type=_list_of(int, None, "positive batch sizes"), default="1,8,64,256" if gpu else "1,3",
                   help="sequences per step, comma-separated")
    p.add_argument("--T", type=_positive, default=1, help="tokens per sequence and step (> 1: speculative steps)")
    p.add_argument("--H", type=int, default=16 if gpu else 1, help="key heads")
    p.add_argument("--HV", type=int, default=32 if gpu else 2, help="value heads (a multiple of H)")
    p.add_argument("--K", type=int, default=128 if gpu else 16, help="key head dim")
    p.add_argument("--V", type=int, default=128 if gpu else 16, help="value head dim")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16" if gpu else "fp32",
                   help="q, k, v, beta and o (g and the states are fp32)")
    p.add_argument("--modes", type=_list_of(str, MODES, f"modes from {', '.join(MODES)}"), default="state,pool",
                   help="state: initial_state [B, HV, K, V] and a new final state; pool: a pool of 2B slots, "
                        "ssm_state_indices, inplace_final_state")
    p.add_argument("--impls", type=_list_of(str, IMPLS, f"implementations from {', '.join(IMPLS)}"),
                   default="tfla,fla", help="comma-separated (fla only when installed, state mode only)")
    p.add_argument("--hbm-tbps", type=float, default=None,
                   help="HBM bandwidth of the x-floor column, TB/s (GPU only; default: the GPU's specification "
                        "for H100 and H200 devices, else no x-floor column)")
    p.add_argument("--warmup", type=float, default=25.0, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=float, default=100.0, help="do_bench repetition time, ms")
    p.add_argument("--csv", type=str, default=None,
                   help="append one row per timed implementation to this CSV file (tfla.bench.common.CSV_COLUMNS)")
    p.add_argument("--json", type=str, default=None, help="write rows and environment to this JSON file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# ----------------------------------------------------------------------------------------------
# implementations: fn(x, mode) -> (o, final states [B, HV, K, V]); in pool mode the pool x["pool"] is written
# ----------------------------------------------------------------------------------------------
@dataclass
class DecodeImpl:
    name: str
    version: str
    fn: Callable
    modes: tuple[str, ...]
    note: str


def tfla_impl() -> DecodeImpl:
    import tfla

    def fn(x, mode):
        if mode == "state":
            return tfla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], beta=x["beta"],
                                                         initial_state=x["initial_state"], output_final_state=True)
        o, _ = tfla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], beta=x["beta"],
                                                     initial_state=x["pool"], ssm_state_indices=x["idx"],
                                                     inplace_final_state=True)
        return o, None

    return DecodeImpl("tfla", _version("tfla"), fn, MODES, f"tfla.{OP}")


def fla_impl() -> DecodeImpl | None:
    """FLA's ``fused_recurrent_gated_delta_rule`` (``FLA_FLASH_QLA=0`` pinned around each call, as for the chunk
    op); None when ``fla`` does not import."""
    mod = import_peer("fla", "fla.ops.gated_delta_rule")
    if mod is None:
        return None
    op = mod.fused_recurrent_gated_delta_rule

    def fn(x, mode):
        with fla_flash_qla_off():
            return op(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["initial_state"],
                      output_final_state=True)

    return DecodeImpl("fla", _version("fla-core"), fn, ("state",), f"fla.ops.gated_delta_rule.{OP}")


def decode_inputs(wl: Workload, device, seed: int) -> dict:
    """``gdn_inputs`` for one step plus a pool ``[2B, HV, K, V]`` of fp32 states ~ N(0, 1/4), the B slots ``idx``
    (int32, a random choice) the sequences use, and ``initial_state = pool[idx]``."""
    x = gdn_inputs(wl.B, wl.T, wl.H, wl.K, wl.V, HV=wl.HV, dtype=DTYPES[wl.dtype], device=device, seed=seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x["pool"] = torch.randn(2 * wl.B, wl.HV, wl.K, wl.V, generator=gen, device=device) * 0.5
    x["idx"] = torch.randperm(2 * wl.B, generator=gen, device=device)[:wl.B].to(torch.int32)
    x["initial_state"] = x["pool"][x["idx"].long()].contiguous()
    return x


def reference(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 step-by-step recurrence on the upcast inputs: (o, final state)."""
    from tfla.ops.gated_delta_rule.reference import recurrent_gated_delta_rule_ref

    r = as_reference({n: x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")})
    return recurrent_gated_delta_rule_ref(r["q"], r["k"], r["v"], r["g"], r["beta"],
                                          initial_state=r["initial_state"], output_final_state=True)


def checked_call(impl: DecodeImpl, x: dict, mode: str, device: str) -> tuple[float, torch.Tensor, torch.Tensor, bool]:
    """The first call (on a copy of the pool in pool mode): ``(wall s, o, final states, other slots untouched)``."""
    xc = dict(x, pool=x["pool"].clone()) if mode == "pool" else x
    t0 = time.perf_counter()
    with torch.no_grad():
        o, s = impl.fn(xc, mode)
    if device == "cuda":
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    untouched = True
    if mode == "pool":
        idx = x["idx"].long()
        s = xc["pool"][idx]
        rest = torch.ones(x["pool"].shape[0], dtype=torch.bool, device=x["pool"].device)
        rest[idx] = False
        untouched = torch.equal(xc["pool"][rest], x["pool"][rest])
    return first_s, o, s, untouched


def timed_call(impl: DecodeImpl, x: dict, mode: str):
    """One decode step; pool mode writes a pool of its own (the states keep stepping from call to call)."""
    xt = dict(x, pool=x["pool"].clone()) if mode == "pool" else x

    def call():
        with torch.no_grad():
            return impl.fn(xt, mode)
    return call


def _workloads(args) -> list[Workload]:
    if args.HV % args.H:
        raise SystemExit(f"--HV {args.HV} must be a multiple of --H {args.H}")
    return [Workload(B, args.T, args.H, args.HV, args.K, args.V, args.dtype) for B in args.B]


def run(args) -> tuple[list[dict], dict]:
    from rich.progress import Progress

    check_csv(args.csv)
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    wls = _workloads(args)  # --B, --modes, --impls: lists (argparse parses string defaults with their type)
    impls, missing = ([tfla_impl()] if "tfla" in args.impls else []), []
    if "fla" in args.impls:
        peer = fla_impl()
        if peer is None:
            missing.append(missing_note("fla"))
        else:
            impls.append(peer)
    meta = env_info()
    meta["missing_peers"] = ",".join(missing) or "-"
    meta["hbm_tbps"] = (args.hbm_tbps or spec_tbps(torch.cuda.get_device_name())) if gpu else None
    rows = []

    def keep(row):  # written after every row, so a run cut short keeps what it measured
        rows.append(row)
        write_json(rows, meta, args.json)
        if row.get("status") == "ok":
            append_csv(args.csv, [csv_row(row, meta, OP, first_s=f"{row['first_s']:.2f}",
                                          x_floor=None if row.get("x_floor") is None else f"{row['x_floor']:.2f}",
                                          graph_ms=None if row.get("graph_ms") is None else f"{row['graph_ms']:.4f}",
                                          copy_ms=None if row.get("copy_ms") is None else f"{row['copy_ms']:.4f}",
                                          version=None if row["impl"] == "tfla" else row["version"])])

    runs = [(m, i) for m in args.modes for i in impls if m in i.modes]
    with Progress(disable=args.no_progress, transient=True) as bar:
        task = bar.add_task("decode", total=len(wls) * len(runs))
        for wl in wls:
            x = decode_inputs(wl, device, args.seed)
            ref_o, ref_s = reference(x)
            copy_ms = wl.copy_floor_ms(args.warmup, args.rep) if gpu else None  # one floor for the workload's rows
            for mode, impl in runs:
                bar.update(task, description=f"{impl.name} {mode} | {wl.label()}")
                row = {"impl": impl.name, "version": impl.version, "mode": mode, "B": wl.B, "T": wl.T, "H": wl.H,
                       "HV": wl.HV, "K": wl.K, "V": wl.V, "dtype": wl.dtype, "label": wl.label(), "op": impl.note}
                keep(_check_and_time(impl, x, mode, device, wl, row, ref_o, ref_s, args, meta["hbm_tbps"], copy_ms))
                bar.advance(task)
                gc.collect()
            del x, ref_o, ref_s
            if gpu:
                torch.cuda.empty_cache()
    _add_speedups(rows)
    return rows, meta


def _check_and_time(impl, x, mode, device, wl, row, ref_o, ref_s, args, hbm_tbps, copy_ms) -> dict:
    """``row`` with the first call's time and errors, then (when within tolerance) the timing columns and status;
    ``copy_ms``: the workload's ``copy_floor_ms`` (GPU only), measured once for all its rows."""
    try:
        row["first_s"], o, s, untouched = checked_call(impl, x, mode, device)
        row["err_o"], row["err_state"] = rel_l2(o, ref_o), rel_l2(s, ref_s)
        del o, s
    except Exception as e:  # a peer that rejects this shape or machine: report, keep going
        row["status"] = error_status(e)
        return row
    bad = [k[4:] for k in ("err_o", "err_state") if not row[k] <= TOLERANCE[wl.dtype]]
    if bad or not untouched:
        why = [f"{', '.join(bad)} rel-L2 above tolerance"] if bad else []
        why += [] if untouched else ["slots outside ssm_state_indices written"]
        row["status"] = f"WRONG ({'; '.join(why)}): not timed"
        return row
    row["ms"] = time_ms(timed_call(impl, x, mode), args.warmup, args.rep)
    row["us"] = row["ms"] * 1e3
    if device == "cuda":
        try:
            row["graph_ms"] = graph_ms(timed_call(impl, x, mode), args.warmup, args.rep)
            row["graph_us"] = row["graph_ms"] * 1e3
        except Exception as e:  # a peer that cannot be captured: its eager time stands in, and the row says so
            row["graph_ms"], row["graph_note"] = None, f"not captured ({error_status(e)})"
        device_ms = row["graph_ms"] or row["ms"]
        row["copy_ms"] = copy_ms
        row["floor_bytes"] = wl.floor_bytes()
        row["gbps"] = row["floor_bytes"] / (device_ms * 1e-3) / 1e9
        row["x_copy"] = device_ms / row["copy_ms"]
        if hbm_tbps:
            row["x_floor"] = device_ms * 1e-3 / (row["floor_bytes"] / (hbm_tbps * 1e12))
    row["status"] = "ok"
    return row


def _add_speedups(rows: list[dict]) -> None:
    """``speedup_vs_fla``: FLA's state-mode time at the same workload over the row's time (graph times where both
    rows have one, else eager times)."""
    keyf = ("B", "T", "H", "HV", "K", "V", "dtype")
    base = {tuple(r[k] for k in keyf): r for r in rows if r["impl"] == "fla" and r.get("ms")}
    for r in rows:
        b = base.get(tuple(r[k] for k in keyf))
        t = "graph_ms" if b and b.get("graph_ms") and r.get("graph_ms") else "ms"
        r["speedup_vs_fla"] = (b[t] / r[t]) if (b and r.get(t)) else None


def print_table(rows: list[dict], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    gpu = any(r.get("copy_ms") for r in rows)  # (set on a GPU even where no call could be captured)
    floor = ("graph us: one call replayed from a CUDA graph (device time); GB/s, x floor, x copy and vs FLA use it; "
             "x floor: graph time / (each fp32 state read and written once + q, k, v, g, beta, o) at the HBM "
             f"specification's {meta.get('hbm_tbps') or '(unknown: --hbm-tbps)'} TB/s; x copy: graph time / copy us "
             "(copy_ of the states' bytes, measured)" if gpu else "graph and floor columns: GPU only")
    t = Table(title=f"Gated DeltaNet decode ({OP}) | {meta['device']} | torch {meta['torch']} | triton "
                    f"{meta['triton']}\nus per step: median do_bench of one eager call; {floor}", title_justify="left")
    for col in ("impl", "mode", "workload", "us", "graph us", "copy us", "first call s", "GB/s", "x floor", "x copy",
                "err o", "err state", "vs FLA", "status"):
        t.add_column(col, justify="left" if col in ("impl", "mode", "workload", "status") else "right")
    for r in rows:
        t.add_row(r["impl"], r["mode"], r["label"], fmt(r.get("us"), ".1f"), fmt(r.get("graph_us"), ".1f"),
                  fmt(None if r.get("copy_ms") is None else r["copy_ms"] * 1e3, ".1f"), fmt(r.get("first_s"), ".2f"),
                  fmt(r.get("gbps"), ".0f"), fmt(r.get("x_floor"), ".2f"), fmt(r.get("x_copy"), ".2f"),
                  fmt(r.get("err_o"), ".2e"), fmt(r.get("err_state"), ".2e"),
                  (fmt(r.get("speedup_vs_fla"), ".2f") + "x") if r.get("speedup_vs_fla") else "-",
                  r.get("status", "") + (f"; eager times: {r['graph_note']}" if r.get("graph_note") else ""))
    console = Console(width=max(170, Console().width))
    console.print(t)
    if meta.get("missing_peers", "-") != "-":
        console.print(f"not available (skipped): {meta['missing_peers']}", markup=False)
    console.print(f"versions: fla-core {meta['fla-core']}, tfla {meta['tfla']} (git {meta['git'] or '-'}), "
                  f"{meta['date']}")


def main(args) -> int:
    rows, meta = run(args)
    write_json(rows, meta, args.json)
    print_table(rows, meta)
    bad = [r for r in rows if r["impl"] == "tfla" and r.get("status") != "ok"]
    return 1 if bad else 0
