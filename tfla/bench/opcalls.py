"""One tfla op call by name, with a launch-config override: what ``scripts/profile_ops.py``, ``scripts/tune.py``
and ``scripts/ab.py`` time.

``op_run(op, mode, chunk_size, config)`` builds the inputs once (the benchmarks' factories, ``tfla.bench.inputs``)
and returns an ``OpRun`` whose ``run()`` is one call: the forward without autograd (``mode="fwd"``), or the
forward plus ``torch.autograd.grad`` of every input with a fixed random cotangent (``mode="fwdbwd"``).

``config`` goes to the op's ``config=`` argument, and only there: a tool never sets a module attribute. None
(no override) calls the public op as a user does; ``{}`` is the op's default config. An op whose public function
takes no ``config=`` accepts only ``{}``, except the Gated DeltaNet: given a config (``{}`` included, so that
variants compare like with like) it runs through its host functions ``chunk_gated_delta_rule_fwd`` / ``_bwd``,
which take ``config`` (stage keys such as ``ut``, ``fused``, ``state``, ``state_bwd``, ``dqkw``, ``wy_bwd``),
with Vnew kept from the forward as the op keeps it by default. The Gated DeltaNet runs 64-row chunks only
(``chunk_size`` 64).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

# name -> (tfla op, input factory family, default GPU workload B, T, H, K, V)
OPS = {
    "gdn": ("chunk_gated_delta_rule", "gdn", (4, 8192, 16, 128, 128)),
    "mlstm-exp": ("chunk_mlstm", "mlstm", (8, 8192, 16, 128, 256)),
    "mlstm-sig": ("chunk_mlstm", "mlstm", (8, 8192, 16, 128, 256)),
    "simple-gla": ("chunk_simple_gla", "scalar", (4, 8192, 16, 128, 128)),
    "gla": ("chunk_gla", "vector", (4, 8192, 16, 128, 128)),
    "retention": ("chunk_retention", "constant", (4, 8192, 16, 128, 128)),
    "linear-attn": ("chunk_linear_attn", "none", (4, 8192, 16, 128, 128)),
    "lightning": ("chunk_lightning_attn", "lightning", (4, 8192, 16, 128, 128)),
}
CPU_SHAPE = (1, 130, 2, 32, 32)  # the interpreter: a tiny workload with a partial last chunk
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class OpRun:
    label: str
    run: Callable[[], tuple]      # one call; returns (o,) or (o, d<input>, ...)
    names: tuple[str, ...]        # what run() returns, in order
    inputs: dict


def takes_config(fn) -> bool:
    try:
        return "config" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def default_shape(op: str) -> tuple[int, ...]:
    return OPS[op][2] if torch.cuda.is_available() else CPU_SHAPE


def _inputs(op: str, shape, dtype, device, gate: str, seed: int) -> dict:
    from tfla.bench.inputs import gdn_inputs, linear_attn_inputs, mlstm_inputs

    B, T, H, K, V = shape
    family = OPS[op][1]
    if family == "gdn":
        x = gdn_inputs(B, T, H, K, V, dtype=dtype, device=device, gate=gate, seed=seed)
        x.pop("initial_state")
        return x
    if family == "mlstm":
        return mlstm_inputs(B, T, H, K, V, dtype=dtype, device=device, gate_dtype=torch.float32, seed=seed)
    x = linear_attn_inputs(B, T, H, K, V, kind=family, dtype=dtype, device=device, gate=gate, seed=seed)
    return {n: t for n, t in x.items() if t is not None}


def _public_call(op: str, chunk_size: int, op_kwargs: dict) -> Callable:
    """``f(x, **extra) -> o`` through the public op."""
    import tfla
    from tfla.bench.registry import LIGHTNING_LAYER, LIGHTNING_LAYERS

    name = OPS[op][0]
    fn = getattr(tfla, name)
    kw = {**op_kwargs} if op == "gdn" else {"chunk_size": chunk_size, **op_kwargs}
    if op.startswith("mlstm"):
        kw["input_gate"] = "sigmoid" if op == "mlstm-sig" else "exp"
    elif op == "linear-attn":
        kw.setdefault("normalize", False)  # as FLA's chunk_linear_attn in the benchmark
    args = (LIGHTNING_LAYER, LIGHTNING_LAYERS) if op == "lightning" else ()

    def call(x, **extra):
        tensors = [x[n] for n in ("q", "k", "v")]
        rest = {n: t for n, t in x.items() if n not in ("q", "k", "v")}
        return fn(*tensors, *args, **rest, **kw, **extra)[0]

    call.fn = fn
    return call


def _gdn_host_run(x: dict, mode: str, config: dict, op_kwargs: dict, do):
    """The Gated DeltaNet through ``chunk_gated_delta_rule_fwd`` / ``_bwd`` with ``config`` (no autograd)."""
    from tfla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd

    if op_kwargs:
        raise ValueError(f"--op-kwargs {sorted(op_kwargs)} with a config needs tfla.chunk_gated_delta_rule to take "
                         "config= (its host functions take none of these)")
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    scale = q.shape[-1] ** -0.5

    def run():
        o, _, inter = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, None, False, config=config)
        if mode == "fwd":
            return (o,)
        grads = chunk_gated_delta_rule_bwd(q, k, v, inter["g_cum"], beta, inter["ai"], scale, None, do, None,
                                           config=config, v_new=inter["v_new"])
        return (o, *grads[:5])

    return run


def op_run(op: str, mode: str = "fwd", chunk_size: int = 64, config: dict | None = None, *,
           shape: tuple[int, ...] | None = None, dtype: str | None = None, device: str | None = None,
           gate: str = "default", op_kwargs: dict | None = None, seed: int = 0,
           inputs: dict | None = None) -> OpRun:
    """One call of ``op`` (a key of ``OPS``) at ``chunk_size`` with ``config`` (see the module docstring);
    ``inputs``: another ``OpRun``'s inputs to reuse (then shape, dtype, device and gate come from them)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")
    if mode not in ("fwd", "fwdbwd"):
        raise ValueError(f"mode must be fwd or fwdbwd, got {mode!r}")
    if op == "gdn" and chunk_size != 64:
        raise ValueError(f"the Gated DeltaNet runs 64-row chunks only, got chunk_size={chunk_size}")
    op_kwargs = dict(op_kwargs or {})
    if inputs is None:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or ("bf16" if device == "cuda" else "fp32")
        x = _inputs(op, tuple(shape or default_shape(op)), DTYPES[dtype], device, gate, seed)
    else:
        x = inputs
        device, dtype = x["q"].device, {v: k for k, v in DTYPES.items()}[x["q"].dtype]
    (B, T, H, K), (HV, V) = x["q"].shape, x["v"].shape[2:]
    call = _public_call(op, chunk_size, op_kwargs)
    names = tuple(x)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    do = torch.randn(B, T, HV, V, device=device, generator=gen).to(DTYPES[dtype]) if mode == "fwdbwd" else None
    label = f"{op} {mode} L={chunk_size} B={B} T={T} H={H} K={K} V={V} {dtype}"
    out_names = ("o",) + (tuple(f"d{n}" for n in names) if mode == "fwdbwd" else ())
    extra = {}
    if config is not None and takes_config(call.fn):
        extra["config"] = config
    elif config is not None and op == "gdn":
        return OpRun(label, _gdn_host_run(x, mode, config, op_kwargs, do), out_names, x)
    elif config:
        raise ValueError(f"tfla.{OPS[op][0]} takes no config= argument: only the variant {{}} runs for {op}")
    if mode == "fwd":
        def run():
            with torch.no_grad():
                return (call(x, **extra),)
        return OpRun(label, run, out_names, x)
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}

    def run():
        o = call(leaves, **extra)
        return (o.detach(), *torch.autograd.grad(o, list(leaves.values()), do))

    return OpRun(label, run, out_names, x)


def rel_errors(outs, ref, names) -> dict:
    """Relative L2 error of each output against ``ref`` (float64), 0.0 where bitwise equal."""
    errs = {}
    for n, a, b in zip(names, outs, ref):
        if torch.equal(a, b):
            errs[n] = 0.0
        else:
            errs[n] = float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
    return errs


def kernel_times(run: Callable, reps: int = 5) -> list[tuple[str, float, float]]:
    """``(kernel name, ms per call, launches per call)`` of every CUDA kernel ``run()`` launches, longest first
    (torch.profiler over ``reps`` calls); empty without a CUDA GPU."""
    if not torch.cuda.is_available():
        return []
    import warnings

    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # torch's notice that events of earlier profiling cycles are dropped
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                run()
            torch.cuda.synchronize()
        rows = [(e.key, e.device_time_total / 1e3 / reps, e.count / reps) for e in prof.key_averages()
                if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])
