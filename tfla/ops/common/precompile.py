"""First calls: compile an op's kernels on a thread pool instead of one after another (issue 26, cold start).

A forward + backward of the GDN launches nine kernels, and Triton compiles each at its first launch, one after
another: on an H200 host with an empty Triton cache the MVE's first call spent ~10.7 s compiling (2026-11-28,
`docs/performance.md`, "Cold start"). Most of a compile is not Python: LLVM and ptxas, and the C launcher that the
host compiler builds per kernel signature. ``first_call`` runs the op once as a dry run on the caller's thread: every
Triton launch inside it (``JITFunction.run``, the ``tl`` and the Gluon kernels) is turned into a compile submitted to
Triton's ``AsyncCompileMode`` on a thread pool, with the same arguments and so the same specialization, and nothing
runs on the device; the backward of a dry run that needs gradients runs on the same thread
(``torch.autograd.set_multithreading_enabled(False)``), so its launches are caught too. After the compiles the
launchers are built and the modules loaded on the pool, then the real call finds every kernel in Triton's cache.
The dry run's tensors are allocated as in the real call (its peak), its PyTorch operations run on unwritten memory,
and its results are dropped; it holds no tensor beyond its own call.

Skipped (the first call compiles as before): under the CPU interpreter, inside ``torch.compile``, during CUDA-graph
capture, when another ``AsyncCompileMode`` is active, and where Triton has no ``AsyncCompileMode``. A key is dry-run
once per process; a later call whose launches specialize differently (another dtype, an int argument that changes
its divisibility by 16) compiles those kernels at its launch, as without this module.
"""
from __future__ import annotations

import contextvars
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Hashable

import torch

from tfla.ops.common.utils import interpret_mode

try:
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction
except ImportError:  # a Triton without AsyncCompileMode: first calls compile one kernel after another
    _async_compile = JITFunction = None

_DRY: contextvars.ContextVar = contextvars.ContextVar("tfla_dry_run", default=None)
_LOCK = threading.Lock()
_SEEN: set = set()
_ORIG_RUN = JITFunction.run if JITFunction is not None else None


def _dry_run(self, *args, grid, warmup, **kwargs):
    """``JITFunction.run`` while ``first_call`` holds its lock: inside a dry run (this thread's context) a launch
    becomes a compile submitted to the active ``AsyncCompileMode``; anywhere else, Triton's own ``run``."""
    kernels = _DRY.get()
    if kernels is None:
        return _ORIG_RUN(self, *args, grid=grid, warmup=warmup, **kwargs)
    kernel = _ORIG_RUN(self, *args, grid=grid, warmup=True, **kwargs)
    if kernel is not None:
        kernels.append(kernel)
    return None


def in_dry_run() -> bool:
    """Whether this thread runs inside ``first_call``'s dry run (launches become compiles there): for code, tests
    among it, that counts the op's real calls."""
    return _DRY.get() is not None


def _load(kernel, device: int):
    """Finish one compile on a pool thread: its launcher (built by the host compiler on first use) and its module
    loaded into the device's context. Returns ``(kernel name, compiled kernel)``, or ``(name, exception)`` where
    loading failed (shared memory or threads beyond the device's)."""
    with torch.cuda.device(device):
        kernel = kernel.result() if hasattr(kernel, "result") else kernel
        init = getattr(kernel, "_init_handles", None)
        try:
            if init is not None:
                init()
        except Exception as e:  # noqa: BLE001 - the caller's results say so; the real launch raises it again
            return getattr(kernel, "name", None), e
        return getattr(kernel, "name", None), kernel


def dry_apply(apply: Callable, args: tuple, out_index: int = 0) -> None:
    """A dry run's call of an autograd Function: ``apply(*args)`` on aliases of the tensors in ``args`` (detached,
    ``requires_grad`` kept: the caller's tensors get no graph, hooks or gradients) and, where grad mode is on and the
    output ``out_index`` requires grad, ``torch.autograd.grad`` of it (an unwritten cotangent) with respect to every
    alias that requires grad: the launches of the forward and of the backward a training step runs."""
    xs = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in args]
    out = apply(*xs)
    o = out[out_index] if isinstance(out, (tuple, list)) else out
    leaves = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
    if torch.is_grad_enabled() and leaves and isinstance(o, torch.Tensor) and o.requires_grad:
        torch.autograd.grad(o, leaves, torch.empty_like(o), allow_unused=True)


def signature(*tensors) -> tuple:
    """Part of a ``first_call`` key: per tensor (or None) its dtype, its sizes past the first two (heads and head
    dims for ``[B, T, ...]`` inputs, the state's dims for states) and whether it requires grad."""
    return tuple(None if x is None else (x.dtype, tuple(x.shape[2:]), x.requires_grad) for x in tensors)


def enabled(x: torch.Tensor) -> bool:
    """Whether ``first_call`` can run for inputs on ``x``'s device (a CUDA tensor, Triton's JIT with
    ``AsyncCompileMode``, no interpreter, no torch.compile tracing, no CUDA-graph capture)."""
    return (_async_compile is not None and x.is_cuda and not interpret_mode() and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing() and _async_compile.active_mode.get() is None)


def apply(fn: Callable, args: tuple, x: torch.Tensor, key: Callable[[], tuple]):
    """``fn(*args)`` (an autograd Function's ``apply``), after ``first_call(key(), dry_apply(fn, args))`` where
    ``enabled(x)`` holds: the ops' one entry to this module. ``key`` builds the call's kind only on the GPU path (the
    op's name and ``signature`` of its tensors, its options); a key's options include its floats (scale, eps), so a
    new value dry-runs again, over kernels already compiled."""
    if enabled(x):
        first_call((*key(), x.device), lambda: dry_apply(fn, args))
    return fn(*args)


def first_call(key: Hashable, dry: Callable[[], object], workers: int | None = None,
               results: list | None = None) -> bool:
    """Run ``dry`` (the op's call, forward and backward as the real call will run them) as a dry run the first time
    ``key`` is seen in this process, compiling every kernel it launches on ``workers`` threads (default: the host's
    cores, at most 16), and wait for the compiles. Returns whether it ran. Errors inside the dry run are dropped:
    the real call that follows meets them again and raises them itself. The kernels are compiled and loaded for
    the current CUDA device, as Triton launches them. ``results``: a list that receives ``(kernel name, compiled
    kernel or the exception its loading raised)`` per kernel (the RNN team search reads their spills). Call only
    where ``enabled`` holds."""
    if key in _SEEN:
        return False
    with _LOCK:
        if key in _SEEN:
            return False
        _SEEN.add(key)
        kernels: list = []
        workers = workers or max(1, min(16, os.cpu_count() or 1))
        with ThreadPoolExecutor(workers, thread_name_prefix="tfla-compile") as pool:
            token = _DRY.set(kernels)
            prev, JITFunction.run = JITFunction.run, _dry_run
            try:
                with _async_compile.AsyncCompileMode(pool, ignore_errors=True), \
                        torch.autograd.set_multithreading_enabled(False):
                    try:
                        dry()
                    except Exception:  # noqa: BLE001 - the real call raises it
                        pass
            finally:
                JITFunction.run = prev
                _DRY.reset(token)
            device = torch.cuda.current_device() if kernels else None  # the device Triton compiled them for
            for f in [pool.submit(_load, k, device) for k in kernels]:
                try:
                    out = f.result()
                except Exception:  # noqa: BLE001 - a kernel that failed to compile fails again at its launch
                    continue
                if results is not None:
                    results.append(out)
        return True
