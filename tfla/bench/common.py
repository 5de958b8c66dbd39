"""Measurement helpers shared by the benchmarks: timing, peak memory, errors, environment, output."""
from __future__ import annotations

import csv
import datetime
import importlib.metadata
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from tfla.utils.testing import rel_l2  # noqa: F401  (re-exported for the benchmarks)


def time_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of ``fn()`` in ms: ``triton.testing.do_bench`` on CUDA; on the CPU (interpreter)
    the median of a few wall-clock runs."""
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def warm_autograd(device: str) -> None:
    """PyTorch's first ``torch.autograd.grad`` with a cotangent in a process imports what it imports lazily (sympy, via
    ``torch.fx.experimental.symbolic_shapes``: 3.4 s on an H200 host without compiled bytecode, 2026-11-28): paid here,
    before a bench times first calls, so that it does not land on the first implementation's."""
    x = torch.ones(2, device=device, requires_grad=True)
    torch.autograd.grad(x * 2, x, torch.ones_like(x))


def host_ms(fn, calls: int = 10) -> float | None:
    """Median host (Python and launch) time of ``fn()`` in ms over ``calls`` back-to-back calls on CUDA, the device
    not waited for between them (one sync before and after); None without CUDA (the interpreter's calls are all
    host). Where it reaches ``time_ms``'s device time, the call is bound by its host side and back-to-back timings
    follow the host's speed (GDN forward + backward at B = 4, T = 8192 on an H100: host ~2.0 ms against ~1.8 ms of
    kernels, 2026-11-25)."""
    if not torch.cuda.is_available():
        return None
    sync = torch.cuda.synchronize
    fn()
    sync()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    sync()
    return statistics.median(times)


def graph_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float | None:
    """Median device time of one ``fn()`` in ms, replayed from a CUDA graph (``torch.cuda.CUDAGraph``, captured after
    two calls on a side stream) by ``triton.testing.do_bench``: the call without its host side, as serving stacks
    run decode steps. None without CUDA. ``fn`` must be capturable (no host reads, no allocation it frees)."""
    if not torch.cuda.is_available():
        return None
    from triton.testing import do_bench

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    try:
        return float(do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    finally:
        del graph


def _tensor_bytes(out) -> int:
    """Bytes of the tensors in ``out`` (a tensor or nested tuples / lists of them)."""
    if isinstance(out, torch.Tensor):
        return out.untyped_storage().nbytes()
    if isinstance(out, (tuple, list)):
        return sum(_tensor_bytes(x) for x in out)
    return 0


def held_mib(forward) -> float | None:
    """CUDA memory a forward keeps for its backward, in MiB: allocated after ``forward()`` (its outputs, and with
    them the autograd graph and its saved tensors, still alive) above what was allocated before, less the outputs'
    own bytes. None without CUDA."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = forward()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base - _tensor_bytes(out)
    del out
    return held / 2**20


def peak_mib(fn) -> float | None:
    """Peak CUDA memory allocated during ``fn()`` above what was allocated before, in MiB."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def git_sha() -> str:
    """``git rev-parse --short HEAD`` of the checkout the package runs from, or "" (no git, no ``.git``)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except Exception:
        return ""


def source_hash(root: Path | None = None) -> str:
    """12 hex digits of SHA-1 over the package's ``*.py`` files (relative path and bytes, sorted): names the
    code a bench row ran even where ``git`` reads a stale or missing ``.git`` (the device copies of the tree).
    The same function at a checkout gives the same value for the same sources."""
    import hashlib

    root = Path(__file__).resolve().parents[1] if root is None else Path(root)
    h = hashlib.sha1()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _ver(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def env_info() -> dict:
    import triton

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()}), Triton interpreter",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tfla": _ver("tfla"),
        "git": git_sha(),
        "src": source_hash(),
        "fla-core": _ver("fla-core"),
        "flash-qla": _ver("flash-qla"),
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
    return info


def write_json(rows: list[dict], meta: dict, json_path: str | None) -> None:
    """All rows, every column, and the environment: the full record of one run (rewritten after each row)."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"env": meta, "rows": rows}, f, indent=1, default=str)


# ``--csv``: one row per timed implementation, appended, so one file collects runs over time and machines
CSV_COLUMNS = ("date", "commit", "device", "torch", "triton", "op", "impl", "B", "T", "H", "HV", "K", "V", "dtype",
               "mode", "ms", "peak_mib", "notes")


def check_csv(path: str | None) -> None:
    """Refuse (SystemExit) a ``--csv`` file that exists with other columns, before anything runs."""
    if not path or not Path(path).exists() or Path(path).stat().st_size == 0:
        return
    with open(path, newline="") as f:
        header = next(csv.reader(f), [])
    if tuple(header) != CSV_COLUMNS:
        raise SystemExit(f"--csv {path}: the file has other columns ({','.join(header)[:200]}); "
                         f"expected {','.join(CSV_COLUMNS)}")


def csv_row(row: dict, meta: dict, op: str, **notes) -> dict:
    """The ``--csv`` row of one timed bench row: ``notes`` is ``src=<source hash>`` and ``key=value`` pairs
    of ``notes`` (those not None), space-separated."""
    note = " ".join(f"{k}={v}" for k, v in {"src": meta["src"], **notes}.items() if v is not None)
    peak = row.get("peak_mib")
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": meta["git"], "device": meta["device"], "torch": meta["torch"], "triton": meta["triton"],
            "op": op, "impl": row["impl"], "B": row["B"], "T": row["T"], "H": row["H"], "HV": row.get("HV", row["H"]),
            "K": row["K"], "V": row["V"], "dtype": row["dtype"], "mode": row["mode"], "ms": f"{row['ms']:.4f}",
            "peak_mib": "" if peak is None else f"{peak:.1f}", "notes": note}


def append_csv(path: str | None, rows: list[dict]) -> None:
    """Append ``rows`` (``csv_row`` dicts) to ``path``, writing the header first when the file is new or empty."""
    if not path or not rows:
        return
    new = not Path(path).exists() or Path(path).stat().st_size == 0
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        if new:
            w.writeheader()
        w.writerows(rows)


def error_status(e: BaseException, limit: int = 240) -> str:
    """``error: <type>: <first line> ... <last line>`` of an exception (a Triton CompilationError names the
    source position first and the reason last)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    msg = lines[0] if lines else ""
    if len(lines) > 1:
        msg = f"{msg} ... {lines[-1]}"
    return f"error: {type(e).__name__}: {msg}"[:limit]


def fmt(x, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)
