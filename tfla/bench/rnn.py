"""``tfla bench rnn``: the FlashRNN cells (``tfla.lstm``, ``gru``, ``slstm``, ``elman``) against ``torch.nn.LSTM`` /
``nn.GRU`` (cuDNN on a GPU) and FlashRNN 1.0.8's backends, on the FlashRNN paper's workloads, after a correctness
check of every implementation.

What each row times (inputs made and converted to the implementation's layout outside the timed region; zero
initial states; ``fwdbwd``: the forward plus ``torch.autograd.grad`` of every input for a random cotangent of h):

    tfla                tfla.<cell>(x, R, b): the recurrence given the pre-activations x [B, T, G, NH, D] (the
                        fused path for D <= 64, else the team path; float64: the alternating path:
                        tfla/ops/rnn/README.md)
    tfla:<path>         the same with config={"path": <path>}, path fused (D <= 128), team or alternating
    flashrnn:<backend>  flashrnn.flashrnn(Wx, R, b, function=<cell>, backend=<backend>, dtype=<dtype>) for backend
                        cuda_fused, cuda, triton_fused (when the flashrnn package imports): the same recurrence in
                        FlashRNN's layout (the GRU's R and b reordered and a zero 4th bias, outside the timed call);
                        its h is states[0]. triton_fused: lstm and slstm with D <= 64; cuda_fused: not gru (FlashRNN
                        runs it as cuda)
    torch               torch.nn.LSTM / nn.GRU with hidden D, for lstm and gru where NH = 1 (one dense recurrent
                        matrix; no rows elsewhere), on u [B, T, D]. It always applies its input projection
                        u W_ih^T + b_ih (one GEMM over all steps) before the recurrence, so its time includes that
                        GEMM; column proj_ms times it alone (F.linear, same mode) for subtraction. Gradients: u and
                        its 4 weights

Workloads (``--workload``; bf16 on a GPU), the FlashRNN paper's speed experiments (Pöppel et al. 2024; FlashRNN's
``speed_experiments/kernel_speed_benchmark.py``):

    headdim  B = 16, T = 1024, hidden 768 as (D, NH) in (16, 48), (32, 24), (64, 12), (128, 6), (256, 3), (768, 1)
    batch    B in 2, 8, 16, 32, 64, 128, 256 at T = 1024, (D, NH) in (64, 12), (768, 1)
    length   T in 256, 512, 1024, 2048 at B = 16, (D, NH) in (64, 12), (768, 1)
    max-d    NH = 1, D in 1024, 2048, 2560, 4096 at B = 16, T = 1024: the largest head a backend takes (FlashRNN's
             notebook probes D = 2560 for cuda_fused)
    all      the four

``--B``, ``--T``, ``--heads D:NH,...`` replace those values of the chosen workload. Without a GPU the same
structure at interpreter sizes (fp32), as the other benches.

Correctness, before any timing, per workload and cell: (1) the first call on the full inputs (its wall time is
column first_s: it compiles what Triton's or torch's extension caches and the earlier rows have not) against
tfla's fp32 run on fp32 copies of the inputs (``err_*``, h and every gradient); (2) a slice ``x[:, :slice_T]``
against the float64 step loop ``recurrent_rnn_ref`` (``slice_err_*``). torch rows are checked on the same function
of u (x = u W_ih^T + b_ih, R = W_hh, b = b_hh). Above the dtype's tolerance (``TOLERANCE``; provisional, not yet
run on a GPU) a row is WRONG and not timed. Then: median ms (``triton.testing.do_bench``), TFLOP/s of the
recurrent matmuls (model: 2 B T G NH D^2 forward, 3x that forward + backward), peak memory above the inputs. A
peer that crashes the process ends the run; rows written so far stay in ``--json`` / ``--csv``.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tfla.bench.common import (append_csv, check_csv, csv_row, env_info, error_status, fmt, peak_mib, rel_l2,
                               time_ms, warm_autograd, write_json)
from tfla.bench.inputs import RNN_GATES, rnn_inputs
from tfla.bench.linear_attn import DTYPES, add_speedups, exit_code, ints, names, random_cotangent

CELLS = ("lstm", "gru", "slstm", "elman")
MODES = ("fwd", "fwdbwd")
FLASHRNN_BACKENDS = ("cuda_fused", "cuda", "triton_fused")
TFLA_PATHS = ("fused", "team", "alternating")
TORCH_CELLS = ("lstm", "gru")
# refuse-to-time thresholds (rel-L2 of h and of every gradient against tfla's fp32 run and the float64 slice);
# bf16 allows for FlashRNN keeping its states in bf16 between steps
TOLERANCE = {"fp32": 1e-3, "fp16": 1e-2, "bf16": 5e-2}
_FLASHRNN_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Workload:
    B: int
    T: int
    NH: int
    D: int
    dtype: str
    name: str = "custom"
    sweep: str = "D"  # the parameter this workload's series varies (the plot's x axis)

    def label(self) -> str:
        return f"B={self.B} T={self.T} NH={self.NH} D={self.D} {self.dtype}"


# name -> groups of (batch sizes, lengths, (D, NH) pairs, swept parameter); GPU sizes, then interpreter sizes
WORKLOADS = {
    "headdim": [((16,), (1024,), ((16, 48), (32, 24), (64, 12), (128, 6), (256, 3), (768, 1)), "D")],
    "batch": [((2, 8, 16, 32, 64, 128, 256), (1024,), (p,), "B") for p in ((64, 12), (768, 1))],
    "length": [((16,), (256, 512, 1024, 2048), (p,), "T") for p in ((64, 12), (768, 1))],
    "max-d": [((16,), (1024,), tuple((D, 1) for D in (1024, 2048, 2560, 4096)), "D")],
}
CPU_WORKLOADS = {
    "headdim": [((2,), (8,), ((2, 6), (4, 3), (12, 1)), "D")],
    "batch": [((1, 2, 4), (8,), (p,), "B") for p in ((4, 3), (12, 1))],
    "length": [((2,), (4, 8, 16), (p,), "T") for p in ((4, 3), (12, 1))],
    "max-d": [((2,), (8,), ((16, 1), (24, 1)), "D")],
}


def _heads(s: str) -> tuple[tuple[int, int], ...]:
    try:
        return tuple((int(d), int(nh)) for d, nh in (p.split(":") for p in names(s)))
    except ValueError:
        raise SystemExit(f"--heads: expected D:NH pairs separated by commas (e.g. 64:12,768:1), got {s!r}") from None


def workloads_from_args(args) -> list[Workload]:
    table = WORKLOADS if torch.cuda.is_available() else CPU_WORKLOADS
    chosen = list(table) if args.workload == "all" else [args.workload]
    out = []
    for name in chosen:
        for Bs, Ts, pairs, sweep in table[name]:
            Bs = ints(args.B) if args.B else Bs
            Ts = ints(args.T) if args.T else Ts
            pairs = _heads(args.heads) if args.heads else pairs
            out += [Workload(B, T, NH, D, args.dtype, name, sweep) for D, NH in pairs for B in Bs for T in Ts]
    return list(dict.fromkeys(out))


def add_arguments(p: argparse.ArgumentParser) -> None:
    gpu = torch.cuda.is_available()
    p.add_argument("--workload", choices=[*WORKLOADS, "all"], default="headdim",
                   help="FlashRNN paper workload (module docstring: python -m pydoc tfla.bench.rnn)")
    p.add_argument("--B", type=str, default=None, help="batch size(s), comma-separated: replace the workload's")
    p.add_argument("--T", type=str, default=None, help="sequence length(s), comma-separated: replace the workload's")
    p.add_argument("--heads", type=str, default=None, help="D:NH pairs, comma-separated: replace the workload's")
    p.add_argument("--cells", type=str, default=",".join(CELLS), help=f"comma-separated subset of {','.join(CELLS)}")
    p.add_argument("--mode", type=str, default="fwd,fwdbwd",
                   help="comma-separated: fwd (forward without grad), fwdbwd (forward + torch.autograd.grad)")
    p.add_argument("--impls", type=str, default="tfla,torch,flashrnn",
                   help="comma-separated: tfla (tfla:fused, tfla:team, tfla:alternating: that path forced), torch (nn.LSTM / "
                        "nn.GRU), flashrnn (its three backends) or "
                        f"flashrnn:<backend> ({', '.join(FLASHRNN_BACKENDS)}); peers only when installed")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16" if gpu else "fp32")
    p.add_argument("--slice-T", type=int, default=64, help="float64 check on x[:, :slice-T]")
    p.add_argument("--warmup", type=float, default=25.0, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=float, default=100.0, help="do_bench repetition time, ms")
    p.add_argument("--list", action="store_true", help="print the workloads and implementations, run nothing")
    p.add_argument("--csv", type=str, default=None,
                   help="append one row per timed implementation to this CSV file (tfla.bench.common.CSV_COLUMNS)")
    p.add_argument("--json", type=str, default=None, help="write rows and environment to this JSON file")
    p.add_argument("--plot", type=str, default=None, metavar="PATH",
                   help="write a plot of time against the swept parameter to PATH (needs matplotlib: the plot extra)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# ----------------------------------------------------------------------------------------------
# implementations: make(inputs, grad) -> (fn: () -> h [B, T, NH, D], leaves {name: tensor}, grads_back)
# ----------------------------------------------------------------------------------------------
@dataclass
class RNNImpl:
    name: str
    version: str
    layer: bool  # takes nn.LSTM-style inputs (u, W_ih, b_ih, W_hh, b_hh) instead of (x, R, b)
    make: Callable | None
    note: str = ""
    unavailable: str | None = None


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _leaves(inputs: dict, grad: bool) -> dict:
    return {n: t.detach().clone().requires_grad_(grad) for n, t in inputs.items()}


def tfla_impl(cell: str, path: str | None = None, D: int = 0) -> RNNImpl:
    """``tfla.<cell>`` on its default path, or with ``path`` (fused, team, alternating) forced."""
    import tfla
    from tfla.ops.rnn.fused import MAX_FUSED_D

    op = getattr(tfla, cell)
    cfg = {"path": path} if path else None

    def make(inputs, grad):
        lv = _leaves(inputs, grad)
        return (lambda: op(lv["x"], lv["R"], lv["b"], config=cfg)[0]), lv, None

    impl = RNNImpl("tfla" if path is None else f"tfla:{path}", _version("tfla"), False, make,
                   note=f"tfla.{cell}" + (f"(config={cfg})" if cfg else ""))
    if path == "fused" and D > MAX_FUSED_D:
        impl.unavailable = f"not available: tfla's fused path takes D <= {MAX_FUSED_D}"
    return impl


def _layer_problem(lv: dict, cell: str):
    """(x, R, b) of the op for nn.LSTM / nn.GRU inputs (NH = 1): x = u W_ih^T + b_ih, R = W_hh, b = b_hh."""
    B, T, H = lv["u"].shape
    G = RNN_GATES[cell]
    return (F.linear(lv["u"], lv["W_ih"], lv["b_ih"]).view(B, T, G, 1, H), lv["W_hh"].view(G, 1, H, H),
            lv["b_hh"].view(G, 1, H))


def reference_impl(cell: str, layer: bool, float64_loop: bool) -> RNNImpl:
    """tfla's op (or the float64 step loop) as a function of the same leaves as an implementation's."""
    import tfla
    from tfla.ops.rnn.reference import recurrent_rnn_ref

    def run(x, R, b):
        return recurrent_rnn_ref(cell, x, R, b)[0] if float64_loop else getattr(tfla, cell)(x, R, b)[0]

    def make(inputs, grad):
        lv = _leaves(inputs, grad)
        if not layer:
            return (lambda: run(lv["x"], lv["R"], lv["b"])), lv, None
        return (lambda: run(*_layer_problem(lv, cell))), lv, None

    return RNNImpl("reference", "-", layer, make)


_TORCH_PARAMS = {"W_ih": "weight_ih_l0", "b_ih": "bias_ih_l0", "W_hh": "weight_hh_l0", "b_hh": "bias_hh_l0"}


def torch_impl(cell: str) -> RNNImpl:
    """``torch.nn.LSTM`` / ``nn.GRU`` (``cell`` in TORCH_CELLS) on the layer inputs of NH = 1: its own parameters
    (one flattened cuDNN weight buffer) hold W_ih, b_ih, W_hh, b_hh."""

    def make(inputs, grad):
        B, T, H = inputs["u"].shape
        mod = getattr(torch.nn, cell.upper())(H, H, batch_first=True).to(inputs["u"].device, inputs["u"].dtype)
        with torch.no_grad():
            for n, attr in _TORCH_PARAMS.items():
                getattr(mod, attr).copy_(inputs[n])
        mod.flatten_parameters()
        mod.requires_grad_(grad)
        u = inputs["u"].detach().clone().requires_grad_(grad)
        lv = {"u": u, **{n: getattr(mod, attr) for n, attr in _TORCH_PARAMS.items()}}
        return (lambda: mod(u)[0].view(B, T, 1, H)), lv, None

    return RNNImpl("torch", torch.__version__, True, make, note=f"torch.nn.{cell.upper()}")


_IMPORT_ERRORS: dict[str, str] = {}  # peer -> why it did not import here


def flashrnn_impl(cell: str, backend: str, D: int, dtype: str) -> RNNImpl | None:
    """FlashRNN 1.0.8's ``flashrnn`` at one backend; None when the package does not import."""
    try:
        fr = importlib.import_module("flashrnn")
    except Exception as e:  # not installed, or fails to import on this machine
        _IMPORT_ERRORS["flashrnn"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        return None
    _IMPORT_ERRORS.pop("flashrnn", None)
    impl = RNNImpl(f"flashrnn:{backend}", _version("flashrnn"), False, None, note=f"flashrnn(backend={backend!r})")
    if backend == "triton_fused" and (cell not in ("lstm", "slstm") or D > 64):
        impl.unavailable = "not available: flashrnn triton_fused runs lstm and slstm with D <= 64"
    elif backend == "cuda_fused" and cell == "gru":
        impl.unavailable = "not available: flashrnn runs gru's cuda_fused as cuda"
    if impl.unavailable:
        return impl

    def make(inputs, grad):
        x, R, b = inputs["x"], inputs["R"], inputs["b"]
        if cell == "gru":  # tfla (r, z, n) -> FlashRNN's R (n, r, z) and b (n_h, r, z, n_x = 0)
            R, b = R[[2, 0, 1]], torch.cat([b[[2, 0, 1]], torch.zeros_like(b[:1])])
        lv = _leaves({"x": x, "R": R, "b": b}, grad)

        def fn():
            return fr.flashrnn(lv["x"], lv["R"], lv["b"], states=None, function=cell, backend=backend,
                               dtype=_FLASHRNN_DTYPE[dtype])[0][0]  # states[0]: h
        return fn, lv, (_gru_grads_to_tfla if cell == "gru" else None)

    impl.make = make
    return impl


def _gru_grads_to_tfla(g: dict) -> dict:
    """FlashRNN's GRU gradients (R: n, r, z; b: n_h, r, z, n_x) in tfla's gate order (r, z, n); n_x dropped."""
    return {"dx": g["dx"], "dR": g["dR"][[1, 2, 0]], "db": g["db"][[1, 2, 0]]}


def impls_for(cell: str, wl: Workload, want: list[str]) -> list[RNNImpl]:
    out = [tfla_impl(cell)] if "tfla" in want else []
    out += [tfla_impl(cell, path, wl.D) for path in TFLA_PATHS if f"tfla:{path}" in want]
    if "torch" in want and cell in TORCH_CELLS and wl.NH == 1:  # one dense recurrent matrix: NH = 1 only
        out.append(torch_impl(cell))
    backends = [b for b in FLASHRNN_BACKENDS if "flashrnn" in want or f"flashrnn:{b}" in want]
    for backend in backends:
        impl = flashrnn_impl(cell, backend, wl.D, wl.dtype)
        if impl is None:
            break
        out.append(impl)
    return out


def _check_impls(want: list[str]) -> None:
    known = {"tfla", *(f"tfla:{p}" for p in TFLA_PATHS), "torch", "flashrnn",
             *(f"flashrnn:{b}" for b in FLASHRNN_BACKENDS)}
    bad = [w for w in want if w not in known]
    if bad:
        raise SystemExit(f"--impls: unknown implementation(s) {', '.join(bad)} "
                         f"(choose from {', '.join(sorted(known))})")


# ----------------------------------------------------------------------------------------------
# one checked run, the timed call
# ----------------------------------------------------------------------------------------------
def run_checked(impl: RNNImpl, inputs: dict, do: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    """``(h, {d<leaf>: gradient})`` (the gradients in the op's layout; none without a cotangent ``do``)."""
    fn, lv, back = impl.make(inputs, do is not None)
    if do is None:
        with torch.no_grad():
            return fn().detach(), {}
    with torch.enable_grad():
        h = fn()
        grads = torch.autograd.grad(h, list(lv.values()), do.to(h.dtype))
    g = {f"d{n}": t for n, t in zip(lv, grads)}
    return h.detach(), (back(g) if back else g)


def timed_call(impl: RNNImpl, inputs: dict, do: torch.Tensor | None, mode: str):
    fn, lv, _ = impl.make(inputs, mode == "fwdbwd")
    if mode == "fwd":
        def call():
            with torch.no_grad():
                return fn()
        return call
    order = list(lv.values())

    def call():
        return torch.autograd.grad(fn(), order, do)
    return call


def projection_ms(inputs: dict, do: torch.Tensor | None, mode: str, warmup: float, rep: float) -> float:
    """Time of nn.LSTM / nn.GRU's input GEMM alone: ``F.linear(u, W_ih, b_ih)`` (and its gradients)."""
    lv = _leaves({n: inputs[n] for n in ("u", "W_ih", "b_ih")}, mode == "fwdbwd")
    if mode == "fwd":
        def call():
            with torch.no_grad():
                return F.linear(lv["u"], lv["W_ih"], lv["b_ih"])
    else:
        dy = torch.ones(*lv["u"].shape[:2], lv["W_ih"].shape[0], device=do.device, dtype=do.dtype)

        def call():
            return torch.autograd.grad(F.linear(lv["u"], lv["W_ih"], lv["b_ih"]), list(lv.values()), dy)
    return time_ms(call, warmup, rep)


def _errors(row: dict, prefix: str, h, grads: dict, ref) -> None:
    row[f"{prefix}h"] = rel_l2(h, ref[0])
    for d, g in grads.items():
        row[f"{prefix}{d}"] = rel_l2(g, ref[1][d])


def over_tolerance(row: dict, dtype: str) -> list[str]:
    return [k.removeprefix("err_").replace("slice_err_", "slice ") for k, e in row.items()
            if k.startswith(("err_", "slice_err_")) and e is not None and not e <= TOLERANCE[dtype]]


def recurrent_flops(wl: Workload, cell: str, mode: str) -> float:
    """Matmul FLOPs of the recurrence (the model): ``2 B T G NH D^2`` forward, three times that with the backward
    (``R^T`` times the pre-activation gradients, and dR)."""
    f = 2.0 * wl.B * wl.T * RNN_GATES[cell] * wl.NH * wl.D ** 2
    return f * (3 if mode == "fwdbwd" else 1)


# ----------------------------------------------------------------------------------------------
def _row(impl: RNNImpl, cell: str, mode: str, wl: Workload) -> dict:
    return {"impl": impl.name, "version": impl.version, "cell": cell, "mode": mode, "workload": wl.name,
            "sweep": wl.sweep, "B": wl.B, "T": wl.T, "NH": wl.NH, "D": wl.D, "H": wl.NH, "K": wl.D, "V": wl.D,
            "dtype": wl.dtype, "op": impl.note}


def _references(cell: str, layer: bool, x: dict, xs: dict, do, Ts: int):
    """tfla's fp32 run on the inputs x and the float64 step loop on their slice xs (``[:, :Ts]``), each ``(h,
    gradients)`` (gradients only with a cotangent ``do``)."""
    full = run_checked(reference_impl(cell, layer, False), {n: t.float() for n, t in x.items()},
                       do.float() if do is not None else None)
    sl = run_checked(reference_impl(cell, layer, True), {n: t.double() for n, t in xs.items()},
                     do[:, :Ts].double() if do is not None else None)
    return full, sl


def run(args) -> tuple[list[dict], dict]:
    from rich.progress import Progress

    check_csv(args.csv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wls = workloads_from_args(args)
    warm_autograd(device)
    cells, modes, want = names(args.cells), names(args.mode), names(args.impls)
    for c in cells:
        if c not in CELLS:
            raise SystemExit(f"--cells: unknown cell {c!r} (choose from {', '.join(CELLS)})")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--mode: unknown mode {m!r} (choose from {', '.join(MODES)})")
    _check_impls(want)
    meta = env_info()
    meta["flashrnn"] = _version("flashrnn")
    meta["cudnn"] = str(torch.backends.cudnn.version()) if torch.cuda.is_available() else "-"
    rows = []

    def keep(row):  # written after every row, so a run cut short keeps what it measured
        rows.append(row)
        write_json(rows, meta, args.json)
        if row.get("status") == "ok":
            proj = row.get("proj_ms")
            append_csv(args.csv, [csv_row(row, meta, row["cell"], workload=row["workload"],
                                          first_s=f"{row['first_s']:.2f}",
                                          proj_ms=None if proj is None else f"{proj:.4f}",
                                          version=None if row["impl"].startswith("tfla") else row["version"])])

    plan = [(wl, cell, impls_for(cell, wl, want)) for wl in wls for cell in cells]
    with Progress(disable=args.no_progress, transient=True) as bar:
        task = bar.add_task("rnn", total=sum(len(p[2]) for p in plan) * len(modes))
        for wl, cell, impls in plan:
            dtype = DTYPES[wl.dtype]
            grads_needed = "fwdbwd" in modes
            do = random_cotangent((wl.B, wl.T, wl.NH, wl.D), dtype, device, args.seed) if grads_needed else None
            Ts = min(wl.T, args.slice_T)
            inputs, refs = {}, {}  # layer inputs or not -> (inputs, their slice), (fp32 and float64 references)
            for impl in impls:
                for mode in modes:
                    bar.update(task, description=f"{impl.name} {cell} {mode} | {wl.label()}")
                    row = _row(impl, cell, mode, wl)
                    if impl.unavailable:
                        row["status"] = impl.unavailable
                        keep(row)
                        bar.advance(task)
                        continue
                    dm = do if mode == "fwdbwd" else None
                    try:
                        if impl.layer not in inputs:
                            x = rnn_inputs(cell, wl.B, wl.T, wl.NH, wl.D, dtype=dtype, device=device,
                                           layer=impl.layer, seed=args.seed)
                            inputs[impl.layer] = x, {n: (t[:, :Ts].contiguous() if n in ("x", "u") else t)
                                                     for n, t in x.items()}
                        x, xs = inputs[impl.layer]
                        t0 = time.perf_counter()  # the first call at this workload: compiles what it has not yet
                        h, g = run_checked(impl, x, dm)
                        if device == "cuda":
                            torch.cuda.synchronize()
                        row["first_s"] = time.perf_counter() - t0
                        if impl.layer not in refs:
                            refs[impl.layer] = _references(cell, impl.layer, x, xs, do, Ts)
                        full, sl = refs[impl.layer]
                        _errors(row, "err_", h, g, full)
                        h, g = run_checked(impl, xs, dm[:, :Ts].contiguous() if dm is not None else None)
                        _errors(row, "slice_err_", h, g, sl)
                        del h, g
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
                    try:
                        call = timed_call(impl, x, dm, mode)
                        row["ms"] = time_ms(call, args.warmup, args.rep)
                        row["tflops"] = recurrent_flops(wl, cell, mode) / (row["ms"] * 1e-3) / 1e12
                        del call
                        gc.collect()
                        row["peak_mib"] = peak_mib(timed_call(impl, x, dm, mode))
                        if impl.layer:
                            row["proj_ms"] = projection_ms(x, dm, mode, args.warmup, args.rep)
                        row["status"] = "ok"
                    except Exception as e:
                        row["status"] = error_status(e)
                    keep(row)
                    bar.advance(task)
                    gc.collect()
            del inputs, refs, do
            if device == "cuda":
                torch.cuda.empty_cache()
    asked = any(w.startswith("flashrnn") for w in want)
    missing = asked and "flashrnn" in _IMPORT_ERRORS
    meta["missing_peers"] = f"flashrnn ({_IMPORT_ERRORS['flashrnn']})" if missing else "-"
    key = ("cell", "B", "T", "NH", "D", "dtype", "mode")
    add_speedups(rows, lambda r: r["impl"].startswith("flashrnn"), key, "speedup_vs_flashrnn")
    add_speedups(rows, "torch", key, "speedup_vs_torch")
    return rows, meta


def list_workloads(args) -> None:
    """``--list``: the workloads, cells, modes and implementations a run would take (nothing runs)."""
    wls = workloads_from_args(args)
    want = names(args.impls)
    _check_impls(want)
    print(f"{len(wls)} workloads x cells {args.cells} x modes {args.mode}, {args.dtype}:")
    for wl in wls:
        print(f"  {wl.name:8s} {wl.label()}")
    note = ""
    if any(w.startswith("flashrnn") for w in want) and flashrnn_impl("lstm", "cuda", 64, args.dtype) is None:
        note = f" (flashrnn not importable: {_IMPORT_ERRORS['flashrnn']})"
    print(f"implementations: {args.impls}{note}")


def print_table(rows: list[dict], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"RNN cells | {meta['device']} | torch {meta['torch']} | triton {meta['triton']}",
              title_justify="left")
    for col in ("impl", "cell", "mode", "workload", "ms", "first call s", "TFLOP/s (model)", "peak MiB", "proj ms",
                "err h", "err grads (max)", "slice err (max)", "vs FlashRNN", "vs torch", "status"):
        t.add_column(col, justify="left" if col in ("impl", "cell", "mode", "workload", "status") else "right")

    def worst(r, prefix, grads_only=False):
        errs = [v for k, v in r.items() if k.startswith(prefix) and v is not None
                and not (grads_only and k.endswith("_h"))]
        return max(errs) if errs else None

    for r in rows:
        wl = f"B={r['B']} T={r['T']} NH={r['NH']} D={r['D']} {r['dtype']}"
        t.add_row(r["impl"], r["cell"], r["mode"], wl, fmt(r.get("ms")), fmt(r.get("first_s"), ".2f"),
                  fmt(r.get("tflops"), ".2f"), fmt(r.get("peak_mib"), ".0f"), fmt(r.get("proj_ms")),
                  fmt(r.get("err_h"), ".2e"), fmt(worst(r, "err_", True), ".2e"), fmt(worst(r, "slice_err_"), ".2e"),
                  (fmt(r.get("speedup_vs_flashrnn"), ".2f") + "x") if r.get("speedup_vs_flashrnn") else "-",
                  (fmt(r.get("speedup_vs_torch"), ".2f") + "x") if r.get("speedup_vs_torch") else "-",
                  r.get("status", ""))
    console = Console(width=max(220, Console().width))
    console.print(t)
    if meta.get("missing_peers", "-") != "-":
        console.print(f"not available (skipped): {meta['missing_peers']}", markup=False)
    console.print(f"versions: flashrnn {meta['flashrnn']}, cuDNN {meta['cudnn']}, tfla {meta['tfla']} "
                  f"(git {meta['git'] or '-'}), {meta['date']}")


def plot(rows: list[dict], meta: dict, path: str) -> None:
    """ms against the swept parameter (D, B or T), log-log, one line per (cell, mode, impl, fixed shape)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.8))
    series: dict[tuple, list] = {}
    for r in rows:
        if r.get("ms") is None:
            continue
        fixed = {"D": f"B={r['B']} T={r['T']}", "B": f"T={r['T']} D={r['D']} NH={r['NH']}",
                 "T": f"B={r['B']} D={r['D']} NH={r['NH']}"}[r["sweep"]]
        series.setdefault((r["cell"], r["mode"], r["impl"], r["sweep"], fixed), []).append((r[r["sweep"]], r["ms"]))
    for (cell, mode, impl, sweep, fixed), pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                linestyle="-" if mode == "fwdbwd" else "--", label=f"{cell} {mode} {impl} ({fixed}; x = {sweep})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("the workload's swept parameter: D, B or T")
    ax.set_ylabel("ms (median)")
    ax.set_title(f"RNN cells, {meta['device']}\ntorch {meta['torch']}, triton {meta['triton']}, "
                 f"flashrnn {meta['flashrnn']}, {meta['date']}", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main(args) -> int:
    if args.list:
        list_workloads(args)
        return 0
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
    return exit_code(rows)
