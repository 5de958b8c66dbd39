"""``tfla bench mlstm``: the mLSTM with exponential ("exp") and sigmoid ("sigmoid", mLSTMsig) input gate,
tfla (``chunk_mlstm``, each chunk size L) against mlstm_kernels 2.0.6, after a correctness check.

Peers (``mlstm_kernels.torch.get_mlstm_kernel``, head-first ``[B, NH, S, D]``, eps 1e-6, normalized):

    sigmoid  chunkwise--triton_xl_chunk_siging   (TFLA mLSTMsig; at each --mk-chunk-sizes, default 128)
    exp      chunkwise--triton_limit_chunk       (chunk-limited baseline; chunk 64)
    exp      chunkwise--triton_xl_chunk          (TFLA mLSTMexp; crashed Triton 3.6's compiler on an H200:
                                                  compiled first in a probe subprocess, a crash is a row)

``--impls`` names: ``tfla``, ``tfla_detached`` (mlstm_kernels' gradient convention), ``tfla_saved``
(``save_states=True`` at L = 64: the forward's states kept for the backward), ``mlstm_kernels`` (all three
peers) or one peer key, and an xl peer with ``_saved`` (``xl_chunk_siging_saved``: ``recompute_states_in_bw=False``).

Inputs are converted to each implementation's layout outside the timed region. Workloads: ``--B --T --H
--K --V`` (default B=8, T=8192, H=16, K=128, V=256 bf16 on a GPU), ``--tokens`` for constant tokens, or
``--paper``: the TFLA paper's sweep, 65,536 tokens with T = 512 .. 65536 and B = 65536 // T.

Correctness, before any timing, as ``tfla bench linear-attn`` (module ``tfla.bench.linear_attn``):
a full check against tfla's fp32 run at L=64 (the first call at the workload: its wall time, s, is column
``first_s``; a probed peer's probe subprocess has already filled Triton's cache) and a float64 slice check on
``B=1, T=min(T, --slice-T)``.
Gradient conventions differ: tfla differentiates through everything; mlstm_kernels, as the TFLA paper
(Appendix B.3), treats the normalizer ``max(|n.q|, e^{-m}) + eps`` and the max state as constants, which
changes dq, dk, di, df (not o, not dv). The slice check computes both float64 ground truths (the
recurrence ``recurrent_mlstm_ref`` and ``parallel_mlstm_detached_ref`` below), records which one each
implementation follows (column ``grad_convention``) and reports errors against that one; on the full
inputs, gradients of an implementation whose convention differs from the reference's are compared with
its own fp32 run (column ``ref_grads``).
"""
from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tfla.bench.common import (append_csv, check_csv, csv_row, env_info, error_status, fmt, warm_autograd,
                               write_json)
from tfla.bench.inputs import mlstm_inputs
from tfla.bench.linear_attn import (
    DTYPES,
    add_common_arguments,
    add_errors,
    add_speedups,
    as_dtype,
    exit_code,
    ints,
    linear_attn_cost,
    max_slice_err,
    measure,
    names,
    order_columns,
    over_tolerance,
    random_cotangent,
    run_checked,
    slice_inputs,
)

INPUT_GATES = ("exp", "sigmoid")
LEAVES = ("q", "k", "v", "i", "f")
EXACT, DETACHED = "exact", "no normalizer grad"
CONVENTION_GRADS = ("dq", "dk", "di", "df")  # gradients that differ between the two conventions
PAPER_T = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
PAPER_TOKENS = 65536


@dataclass(frozen=True)
class Workload:
    B: int
    T: int
    H: int
    K: int
    V: int
    dtype: str

    def label(self) -> str:
        return f"B={self.B} T={self.T} H={self.H} K={self.K} V={self.V} {self.dtype}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    gpu = torch.cuda.is_available()
    p.add_argument("--input-gates", type=str, default="exp,sigmoid", help="comma-separated subset of exp,sigmoid")
    p.add_argument("--B", type=int, default=8 if gpu else 1, help="batch size (ignored with --tokens)")
    p.add_argument("--T", type=str, default="8192" if gpu else "128",
                   help="sequence length(s), comma-separated for a sweep")
    p.add_argument("--H", type=int, default=16 if gpu else 2, help="heads")
    p.add_argument("--K", type=int, default=128 if gpu else 32)
    p.add_argument("--V", type=int, default=256 if gpu else 32)
    p.add_argument("--paper", action="store_true",
                   help=f"TFLA paper sweep: {PAPER_TOKENS} tokens, T = {PAPER_T[0]}..{PAPER_T[-1]}, B = tokens // T, "
                        "H=16, K=128, V=256 (overrides --B/--T/--tokens/--H/--K/--V)")
    p.add_argument("--mk-chunk-sizes", type=str, default="128",
                   help="chunk sizes of the mlstm_kernels xl kernels (triton_limit_chunk always runs at 64)")
    p.add_argument("--gate-dtype", choices=["input", "fp32"], default="input",
                   help="dtype of the gate pre-activations i, f: the input dtype (as mlstm_kernels' benchmarks) or fp32")
    p.add_argument("--no-probe", action="store_true",
                   help="do not compile crash-prone peer kernels in a probe subprocess first")
    add_common_arguments(p, impls="tfla,mlstm_kernels")


def workloads_from_args(args) -> list[Workload]:
    if args.paper:
        return [Workload(PAPER_TOKENS // T, T, 16, 128, 256, args.dtype) for T in PAPER_T]
    return [Workload(max(1, args.tokens // T) if args.tokens else args.B, T, args.H, args.K, args.V, args.dtype)
            for T in ints(args.T)]


def _kernel_names(want: list[str]) -> tuple[bool, bool, bool, list[str], list[str]]:
    """(tfla requested, tfla in mlstm_kernels' gradient convention requested, tfla with save_states requested,
    mlstm_kernels registry keys requested, xl keys requested with the ``_saved`` suffix, i.e. with
    ``recompute_states_in_bw=False``) from ``--impls``."""
    from tfla.bench.registry import MLSTM_KERNELS

    kernels, saved = [], []
    for w in want:
        if w in ("tfla", "tfla_detached", "tfla_saved"):
            continue
        if w == "mlstm_kernels":
            kernels += list(MLSTM_KERNELS)
            continue
        key = w.removeprefix("chunkwise--")
        key = key if key.startswith("triton_") else f"triton_{key}"
        is_saved = key.endswith("_saved") and key.removesuffix("_saved") != "triton_limit_chunk"
        key = key.removesuffix("_saved") if is_saved else key
        if key not in MLSTM_KERNELS:
            raise SystemExit(f"--impls: unknown implementation {w!r} (choose from tfla, tfla_detached, tfla_saved, "
                             f"mlstm_kernels, {', '.join(MLSTM_KERNELS)}, or an xl kernel with _saved)")
        (saved if is_saved else kernels).append(key)
    return ("tfla" in want, "tfla_detached" in want, "tfla_saved" in want, list(dict.fromkeys(kernels)),
            list(dict.fromkeys(saved)))


def parallel_mlstm_detached_ref(q, k, v, i, f, *, input_gate: str = "exp", eps: float = 1e-6,
                                scale: float | None = None, detach_normalizer: bool = True) -> torch.Tensor:
    """Quadratic normalized mLSTM from a zero state, computed in q's dtype, ``[B, T, H, *]`` layout.

    ``h_t = sum_s S_ts v_s / (max(|sum_s S_ts|, e^{-m_t}) + eps)`` with ``S_ts = scale q_t.k_s e^{F_t - F_s +
    ig_s - m_t}`` (``ig`` = i for "exp", log sigmoid(i) for "sigmoid" with m = 0 and the bound 1), m the
    recurrence's max state (the initial state's column included). With ``detach_normalizer`` the
    denominator and m are constants for autograd: mlstm_kernels' gradient convention (TFLA paper,
    Appendix B.3). Without it this equals ``tfla.ops.mlstm.reference.parallel_mlstm_ref``."""
    T, K = q.shape[1], q.shape[3]
    scale = K ** -0.5 if scale is None else scale
    qs, k_, v_ = q.transpose(1, 2) * scale, k.transpose(1, 2), v.transpose(1, 2)
    Fc = F.logsigmoid(f.to(q.dtype)).transpose(1, 2).cumsum(-1)                  # [B, H, T]
    ig = i.to(q.dtype).transpose(1, 2)
    if input_gate == "sigmoid":
        ig = F.logsigmoid(ig)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    logD = torch.where(causal, Fc[..., :, None] - Fc[..., None, :] + ig[..., None, :], -float("inf"))
    if input_gate == "exp":
        m = torch.maximum(logD.amax(-1), Fc)
    else:
        m = torch.zeros_like(Fc)
    if detach_normalizer:
        m = m.detach()
    S = (qs @ k_.transpose(-1, -2)) * torch.exp(logD - m[..., None])
    lower = torch.exp(-m) if input_gate == "exp" else torch.ones_like(m)
    den = torch.maximum(S.sum(-1).abs(), lower) + eps
    if detach_normalizer:
        den = den.detach()
    return ((S @ v_) / den[..., None]).transpose(1, 2)


def _slice_references(xs: dict, dos, input_gate: str) -> dict:
    """float64 ground truths on the slice: {convention: (o, grads)} (one entry without a cotangent)."""
    x64 = as_dtype(xs, torch.float64)
    do64 = dos.double() if dos is not None else None
    try:
        from tfla.ops.mlstm.reference import recurrent_mlstm_ref

        def exact(x):
            return recurrent_mlstm_ref(x["q"], x["k"], x["v"], x["i"], x["f"], input_gate=input_gate, normalize=True,
                                       eps=1e-6)[0]
    except Exception:  # the recurrence not there yet: the quadratic form, differentiated through everything
        def exact(x):
            return parallel_mlstm_detached_ref(x["q"], x["k"], x["v"], x["i"], x["f"], input_gate=input_gate,
                                               detach_normalizer=False)
    refs = {EXACT: run_checked(exact, x64, LEAVES, do64)}
    if dos is not None:
        refs[DETACHED] = run_checked(
            lambda x: parallel_mlstm_detached_ref(x["q"], x["k"], x["v"], x["i"], x["f"], input_gate=input_gate),
            x64, LEAVES, do64)
    return refs


def _convention(grads: dict, refs: dict) -> str:
    """The ground truth whose dq, dk, di, df these gradients are closest to."""
    from tfla.bench.common import rel_l2

    if len(refs) < 2 or not grads:
        return EXACT
    score = {c: max(rel_l2(grads[d], r[1][d]) for d in CONVENTION_GRADS) for c, r in refs.items()}
    return min(score, key=score.get)


def _dist_version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


# ----------------------------------------------------------------------------------------------
# crash probe: a peer kernel known to kill the process while compiling is first compiled in a child
# ----------------------------------------------------------------------------------------------
_PROBED: dict[tuple, str | None] = {}


def _needs_probe(impl, args) -> bool:
    return impl.crash_probe and not args.no_probe and torch.cuda.is_available()


def _probe(impl, wl: Workload, slice_T: int, mode: str, gate_dtype: str, seed: int) -> str | None:
    """None if ``impl`` runs on the slice and full shapes in a subprocess (which also fills Triton's
    cache), else the reason."""
    key = (impl.kernel, impl.chunk_size, wl, slice_T, mode, gate_dtype)
    if key in _PROBED:
        return _PROBED[key]
    argv = [impl.kernel, impl.chunk_size, wl.B, wl.T, wl.H, wl.K, wl.V, wl.dtype, slice_T, mode, gate_dtype, seed]
    code = "import sys; from tfla.bench.mlstm import probe_main; sys.exit(probe_main(sys.argv[1:]))"
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        r = subprocess.run([sys.executable, "-c", code, *map(str, argv)], check=False, capture_output=True,
                           text=True, timeout=900, env=env)
        why = None
        if r.returncode != 0:
            tail = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()]
            how = f"signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
            why = f"error: crashed in a probe subprocess ({how}): {tail[-1][:160] if tail else ''}"
    except subprocess.TimeoutExpired:
        why = "error: probe subprocess timed out (900 s)"
    _PROBED[key] = why
    return why


def probe_main(argv: list[str]) -> int:
    """Child of ``_probe``: run one mlstm_kernels kernel on the slice and the full inputs (fwd or fwd+bwd)."""
    from tfla.bench.registry import mlstm_kernels_impl

    kernel, L, B, T, H, K, V, dtype, slice_T, mode, gate_dtype, seed = argv
    B, T, H, K, V, L, slice_T, seed = map(int, (B, T, H, K, V, L, slice_T, seed))
    dt = DTYPES[dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    impl = mlstm_kernels_impl(kernel, L)
    if impl is None:
        print(f"mlstm_kernels kernel {kernel} not available", file=sys.stderr)
        return 3
    x = mlstm_inputs(B, T, H, K, V, dtype=dt, device=device, gate_dtype=torch.float32 if gate_dtype == "fp32" else None,
                     seed=seed)
    do = random_cotangent((B, T, H, V), dt, device, seed) if mode == "fwdbwd" else None
    Ts = min(T, slice_T)
    run_checked(impl.fn, slice_inputs(x, Ts), LEAVES, do[:1, :Ts].contiguous() if do is not None else None, True)
    run_checked(impl.fn, x, LEAVES, do, True)
    if device == "cuda":
        torch.cuda.synchronize()
    return 0


# ----------------------------------------------------------------------------------------------
def run(args) -> tuple[list[dict], dict]:
    from rich.progress import Progress

    from tfla.bench.registry import mlstm_impls, tfla_mlstm_impl

    check_csv(args.csv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wls = workloads_from_args(args)
    warm_autograd(device)
    gates = names(args.input_gates)
    for g in gates:
        if g not in INPUT_GATES:
            raise SystemExit(f"--input-gates: unknown input gate {g!r} (choose from {', '.join(INPUT_GATES)})")
    with_tfla, with_detached, with_saved, kernels, saved_kernels = _kernel_names(names(args.impls))
    chunk_sizes = ints(args.chunk_sizes)
    meta = env_info()
    meta["mlstm_kernels"] = _dist_version("mlstm_kernels")
    missing = set()
    rows = []

    def keep(row):  # written after every row, so a run cut short keeps what it measured
        rows.append(row)
        write_json(rows, meta, args.json)
        if row.get("status") == "ok":
            append_csv(args.csv, [csv_row(row, meta, f"chunk_mlstm:{row['input_gate']}", chunk=row["chunk"],
                                          gate_dtype=row["gate_dtype"], grad_convention=row["grad_convention"],
                                          first_s=f"{row['first_s']:.2f}",
                                          version=None if row["impl"].startswith("tfla") else row["version"])])

    per_gate = {g: mlstm_impls(g, chunk_sizes, kernels, ints(args.mk_chunk_sizes), with_tfla, with_detached,
                               with_saved, saved_kernels) for g in gates}
    gate_dtype = torch.float32 if args.gate_dtype == "fp32" else None
    with Progress(disable=args.no_progress, transient=True) as bar:
        task = bar.add_task("mlstm", total=len(wls) * sum(len(per_gate[g][0]) for g in gates))
        for wl in wls:
            dtype = DTYPES[wl.dtype]
            x = mlstm_inputs(wl.B, wl.T, wl.H, wl.K, wl.V, dtype=dtype, device=device, gate_dtype=gate_dtype,
                             seed=args.seed)
            do = random_cotangent((wl.B, wl.T, wl.H, wl.V), dtype, device, args.seed) if args.mode == "fwdbwd" else None
            Ts = min(wl.T, args.slice_T)
            xs, dos = slice_inputs(x, Ts), (do[:1, :Ts].contiguous() if do is not None else None)
            x32, do32 = as_dtype(x, torch.float32), (do.float() if do is not None else None)
            for gate in gates:
                impls, miss = per_gate[gate]
                missing.update(miss)
                s_refs = _slice_references(xs, dos, gate)
                # fp32 reference on the full inputs: tfla at L = 64; its gradient convention from the slice
                ref, ref_label, ref_conv = None, "self fp32", EXACT
                ref_impl = tfla_mlstm_impl(gate, 64)
                if ref_impl.fn is not None:
                    try:
                        ref = run_checked(ref_impl.fn, x32, LEAVES, do32)
                        ref_label = "tfla fp32 L=64"
                        if do is not None:
                            ref_conv = _convention(run_checked(ref_impl.fn, as_dtype(xs, torch.float32), LEAVES,
                                                               dos.float())[1], s_refs)
                    except Exception as e:
                        meta[f"reference_error_{gate}"] = error_status(e)
                for impl in impls:
                    bar.update(task, description=f"{impl.name} {gate} | {wl.label()}")
                    row = {"impl": impl.name, "version": impl.version, "input_gate": gate, "mode": args.mode,
                           "chunk": impl.chunk_size, "B": wl.B, "T": wl.T, "H": wl.H, "K": wl.K, "V": wl.V,
                           "dtype": wl.dtype, "gate_dtype": args.gate_dtype, "op": impl.note, "ref": ref_label,
                           "ref_grads": ref_label if do is not None else None, "grad_convention": None,
                           "slice_T": Ts}
                    if impl.unavailable:
                        row["ref"] = row["ref_grads"] = None
                        row["status"] = impl.unavailable
                        keep(row)
                        bar.advance(task)
                        continue
                    why = None
                    if _needs_probe(impl, args):
                        why = _probe(impl, wl, args.slice_T, args.mode, args.gate_dtype, args.seed)
                    if why:
                        row["status"] = why
                        keep(row)
                        bar.advance(task)
                        continue
                    try:
                        t0 = time.perf_counter()  # the first call at this workload: compiles what it has not yet
                        o, g = run_checked(impl.fn, x, LEAVES, do, impl.head_first)
                        if device == "cuda":
                            torch.cuda.synchronize()
                        row["first_s"] = time.perf_counter() - t0
                        so, sg = run_checked(impl.fn, xs, LEAVES, dos, impl.head_first)
                        conv = _convention(sg, s_refs)
                        row["grad_convention"] = conv if sg else None
                        add_errors(row, "slice_err_", so, sg, *s_refs[conv])
                        del so, sg
                        if ref is None:
                            add_errors(row, "err_", o, g, *run_checked(impl.fn, x32, LEAVES, do32, impl.head_first))
                        elif not g or conv == ref_conv:
                            add_errors(row, "err_", o, g, *ref)
                        else:  # o, dv against the reference; the convention's gradients against its own fp32 run
                            add_errors(row, "err_", o, g, *ref, only=("o", "dv"))
                            try:
                                add_errors(row, "err_", o, g, *run_checked(impl.fn, x32, LEAVES, do32, impl.head_first),
                                           only=CONVENTION_GRADS)
                                row["ref_grads"] = f"{ref_label} (dv); self fp32 (dq, dk, di, df)"
                            except Exception as e:  # no fp32 run of this kernel here: the slice check only
                                row["ref_grads"] = f"{ref_label} (dv); dq, dk, di, df slice only (fp32 run: {error_status(e)})"
                        row = order_columns(row)
                        del o, g
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
                    flops, min_bytes = linear_attn_cost(wl.B, wl.T, wl.H, wl.K, wl.V, impl.chunk_size, args.mode,
                                                        dtype.itemsize, gate_elems=2)
                    try:
                        measure(row, impl.fn, x, LEAVES, do, args.mode, impl.head_first, args.warmup, args.rep,
                                flops, min_bytes)
                        row["status"] = "ok"
                    except Exception as e:
                        row["status"] = error_status(e)
                    keep(row)
                    bar.advance(task)
                    gc.collect()
                del s_refs, ref
            del x, do, xs, dos, x32, do32
            if device == "cuda":
                torch.cuda.empty_cache()
    meta["missing_peers"] = ",".join(sorted(missing)) or "-"
    add_speedups(rows, lambda r: r["impl"].startswith("mk "),
                 ("input_gate", "B", "T", "H", "K", "V", "dtype", "mode"), "speedup_vs_mk")
    return rows, meta


def print_table(rows: list[dict], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    mode = rows[0]["mode"] if rows else "fwd"
    t = Table(title=f"mLSTM {mode} | {meta['device']} | torch {meta['torch']} | triton {meta['triton']}",
              title_justify="left")
    grads = [] if mode == "fwd" else ["dq", "dk", "dv", "di", "df"]
    for col in ("impl", "gate", "workload", "ms", "first call s", "TFLOP/s (model)", "peak MiB", "err o",
                *[f"err {n}" for n in grads], "slice err (max)", *(["grad conv."] if grads else []), "vs mk", "status"):
        t.add_column(col, justify="left" if col in ("impl", "gate", "workload", "grad conv.", "status") else "right")
    for r in rows:
        wl = f"B={r['B']} T={r['T']} H={r['H']} K={r['K']} V={r['V']} {r['dtype']}"
        t.add_row(r["impl"], r["input_gate"], wl, fmt(r.get("ms")), fmt(r.get("first_s"), ".1f"),
                  fmt(r.get("tflops"), ".1f"), fmt(r.get("peak_mib"), ".0f"), fmt(r.get("err_o"), ".2e"),
                  *[fmt(r.get(f"err_{n}"), ".2e") for n in grads], fmt(max_slice_err(r), ".2e"),
                  *([r.get("grad_convention") or "-"] if grads else []),
                  (fmt(r.get("speedup_vs_mk"), ".2f") + "x") if r.get("speedup_vs_mk") else "-", r.get("status", ""))
    console = Console(width=max(190 if mode == "fwd" else 240, Console().width))
    console.print(t)
    if meta.get("missing_peers", "-") != "-":
        console.print(f"not available (skipped): {meta['missing_peers']}", markup=False)
    for k, v in meta.items():
        if k.startswith("reference_error"):
            console.print(f"tfla fp32 reference failed ({k[16:]}; rows use their own fp32 run): {v}")
    console.print(f"versions: mlstm_kernels {meta['mlstm_kernels']}, tfla {meta['tfla']} (git {meta['git'] or '-'}), "
                  f"{meta['date']}")


def main(args) -> int:
    rows, meta = run(args)
    write_json(rows, meta, args.json)
    print_table(rows, meta)
    return exit_code(rows)

