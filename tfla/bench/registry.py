"""Registry of Gated DeltaNet implementations the benchmark can run: tfla in each of its saved-set variants, FLA's
own Triton kernel (``FLA_FLASH_QLA=0``) and FlashQLA, the last two only when installed.

Every entry takes the input dict of ``tfla.bench.inputs.gdn_inputs`` and returns ``(o, final_state)``.

Below them, ``OpImpl`` entries for ``tfla bench linear-attn`` (tfla vs FLA, decay none / constant /
scalar / vector) and ``tfla bench mlstm`` (tfla vs mlstm_kernels): each maps an input dict in its own
layout to the output o, and says why when it cannot run here.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Impl:
    name: str
    fn: Callable
    chunk_size: int
    state_itemsize: int | None  # bytes per stored state element (None: input dtype size)
    version: str
    note: str = ""


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


# what tfla's forward keeps for its backward: the op's default (FLA's saved set: Vnew and the states recomputed), Vnew,
# or Vnew and the 64-row states
VARIANTS = {"default": {}, "save_v_new": dict(save_v_new=True), "save_states": dict(save_states=True),
            # the backward in slabs of 64 / 32 chunks (Hopper, dense, Vnew kept: less memory, more host time; the op's
            # README)
            "slab64": dict(save_v_new=True, config={"slab": {"chunks": 64}}),
            "slab32": dict(save_v_new=True, config={"slab": {"chunks": 32}}),
            # FLA's saved set with the backward in 1 (whole sequences) / 2 / 3 / 4 slabs of the longest sequence
            # (the default takes two for large dense inputs: the op's README)
            "whole": dict(config={"slab": {"count": 1}}), "slabs2": dict(config={"slab": {"count": 2}}),
            "slabs3": dict(config={"slab": {"count": 3}}), "slabs4": dict(config={"slab": {"count": 4}})}


def tfla_impl(variant: str = "default") -> Impl:
    """tfla's ``chunk_gated_delta_rule`` in one of ``VARIANTS`` (the name is the impl's label after "tfla")."""
    from tfla.ops.gated_delta_rule import chunk_gated_delta_rule

    if variant not in VARIANTS:
        raise ValueError(f"unknown tfla variant {variant!r}; choose from {', '.join(VARIANTS)}")
    save = VARIANTS[variant]

    def fn(x, output_final_state=True, **kw):
        return chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x.get("initial_state"),
            output_final_state=output_final_state, cu_seqlens=x.get("cu_seqlens"), **save,
            **x.get("kw", {}), **kw)

    return Impl("tfla" if variant == "default" else f"tfla {variant}", fn, 64, None, _version("tfla"))


IMPORT_ERRORS: dict[str, str] = {}  # peer -> why it did not import here (printed with the skipped peers)


def _import_failed(peer: str, e: BaseException) -> None:
    IMPORT_ERRORS[peer] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def import_peer(peer: str, module: str):
    """``module`` imported, or None when it does not import here (not installed, or fails on this machine); the error
    is kept for ``missing_note(peer)``."""
    try:
        return importlib.import_module(module)
    except Exception as e:
        _import_failed(peer, e)
        return None


def missing_note(peer: str) -> str:
    """``peer`` plus the import error that made it unavailable, when one was seen."""
    why = IMPORT_ERRORS.get(peer)
    return f"{peer} ({why})" if why else peer


def fla_impl() -> Impl | None:
    """FLA's Triton ``chunk_gated_delta_rule`` (chunk 64). FLA reads ``FLA_FLASH_QLA`` at call time,
    so the entry pins it to 0 around each call to time FLA's own kernels, not FlashQLA's."""
    mod = import_peer("fla", "fla.ops.gated_delta_rule")
    if mod is None:
        return None
    fla_gdn = mod.chunk_gated_delta_rule

    def fn(x, output_final_state=True):
        old = os.environ.get("FLA_FLASH_QLA")
        os.environ["FLA_FLASH_QLA"] = "0"
        try:
            return fla_gdn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x.get("initial_state"),
                           output_final_state=output_final_state, cu_seqlens=x.get("cu_seqlens"), **x.get("kw", {}))
        finally:
            if old is None:
                os.environ.pop("FLA_FLASH_QLA", None)
            else:
                os.environ["FLA_FLASH_QLA"] = old

    return Impl("fla", fn, 64, None, _version("fla-core"), "FLA_FLASH_QLA=0")


def flashqla_impl() -> Impl | None:
    fq = import_peer("flashqla", "flash_qla")
    if fq is None:
        return None

    def fn(x, output_final_state=True):
        kw = dict(x.get("kw", {}))
        g = x["g"]
        if kw.pop("use_gate_in_kernel", False):  # flash-qla 0.1.3 has no gate option: the gate in PyTorch, timed
            g = -kw.pop("A_log").float().exp() * torch.nn.functional.softplus(g.float() + kw.pop("dt_bias").float())
        return fq.chunk_gated_delta_rule(x["q"], x["k"], x["v"], g, x["beta"],
                                         initial_state=x.get("initial_state"),
                                         output_final_state=output_final_state, cu_seqlens=x.get("cu_seqlens"), **kw)

    return Impl("flashqla", fn, 64, None, _version("flash-qla"),
                "layer workloads: the gate -exp(A_log) softplus(a + dt_bias) in PyTorch inside the timed call")


def gdn_impls(variants=("default",), peers=("fla", "flashqla")) -> tuple[list[Impl], list[str]]:
    """Implementations to run, and a note for each requested peer that is not available."""
    impls = [tfla_impl(v) for v in variants]
    missing = []
    for peer in peers:
        impl = {"fla": fla_impl, "flashqla": flashqla_impl}[peer]()
        if impl is None:
            missing.append(missing_note(peer))
        else:
            impls.append(impl)
    return impls, missing


# ----------------------------------------------------------------------------------------------
# Linear attention (decay none / constant / scalar / vector) and mLSTM: ``tfla bench linear-attn``,
# ``tfla bench mlstm``. Every entry maps a dict of inputs in its own layout to the output o.
# ----------------------------------------------------------------------------------------------
@dataclass
class OpImpl:
    name: str
    fn: Callable | None           # fn(x: dict) -> o, x and o in the entry's layout; None when unavailable
    chunk_size: int | None
    version: str
    note: str = ""
    unavailable: str | None = None  # why it cannot run here ("not implemented: ...", "not available: ...")
    head_first: bool = False        # inputs/outputs [B, H, T, ...] (mlstm_kernels), else [B, T, H, ...]
    crash_probe: bool = False       # may kill the process while compiling: try it in a subprocess first
    kernel: str | None = None       # peer kernel name (mlstm_kernels registry key)
    input_gate: str | None = None   # mLSTM input gate of the entry ("exp" | "sigmoid")


@contextlib.contextmanager
def fla_flash_qla_off():
    """Pin ``FLA_FLASH_QLA=0`` (FLA reads it at call time) so FLA's own Triton kernels run."""
    old = os.environ.get("FLA_FLASH_QLA")
    os.environ["FLA_FLASH_QLA"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FLA_FLASH_QLA", None)
        else:
            os.environ["FLA_FLASH_QLA"] = old


def find_tfla_op(name: str, modules: tuple[str, ...] = ()) -> tuple[Callable | None, str | None]:
    """``tfla.<name>``, else the first of ``modules`` that defines it; ``(fn, None)`` or ``(None, why)``.
    Imported lazily: ops still being written show up as unavailable instead of failing the benchmark."""
    import tfla

    try:
        return getattr(tfla, name), None
    except Exception as e:  # not exported yet, or its module fails to import
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    for mod in modules:
        try:
            fn = getattr(importlib.import_module(mod), name, None)
        except Exception as e:
            why = f"{mod}: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
            continue
        if fn is not None:
            return fn, None
    return None, why


LINEAR_ATTN_OPS = {  # kind -> (tfla op, modules to look in, FLA module, FLA op)
    "none": ("chunk_linear_attn", (), "fla.ops.linear_attn", "chunk_linear_attn"),
    "constant": ("chunk_retention", (), "fla.ops.retention", "chunk_retention"),
    "scalar": ("chunk_simple_gla", (), "fla.ops.simple_gla", "chunk_simple_gla"),
    "vector": ("chunk_gla", ("tfla.ops.gla",), "fla.ops.gla", "chunk_gla"),
    "lightning": ("chunk_lightning_attn", (), "fla.ops.lightning_attn", "chunk_lightning_attn"),
}
# the Lightning Attention layer the bench runs (its decays: reference.lightning_log_decay)
LIGHTNING_LAYER, LIGHTNING_LAYERS = 0, 24


def _linear_attn_call(op, kind: str, x: dict, **kw):
    q, k, v = x["q"], x["k"], x["v"]
    if kind == "none":
        return op(q, k, v, normalize=False, **kw)[0]
    if kind == "constant":
        return op(q, k, v, **kw)[0]
    if kind == "lightning":
        return op(q, k, v, LIGHTNING_LAYER, LIGHTNING_LAYERS, **kw)[0]
    return op(q, k, v, g=x["g"], **kw)[0]


def tfla_linear_attn_impl(kind: str, chunk_size: int) -> OpImpl:
    name, modules, _, _ = LINEAR_ATTN_OPS[kind]
    op, why = find_tfla_op(name, modules)
    impl = OpImpl(f"tfla L={chunk_size}", None, chunk_size, _version("tfla"), note=f"tfla.{name}")
    if op is None:
        impl.unavailable, impl.note = f"not implemented (tfla.{name})", f"tfla.{name} missing: {why}"
        return impl
    impl.fn = lambda x: _linear_attn_call(op, kind, x, chunk_size=chunk_size)
    return impl


def fla_linear_attn_impl(kind: str) -> OpImpl | None:
    """FLA's Triton op for ``kind`` at its default chunk size 64, ``FLA_FLASH_QLA=0`` pinned; None when
    FLA is not installed or does not import here."""
    _, _, mod, name = LINEAR_ATTN_OPS[kind]
    module = import_peer("fla", mod)
    if module is None:
        return None
    op = getattr(module, name, None)
    if op is None:  # an FLA without this op
        _import_failed("fla", AttributeError(f"module {mod!r} has no attribute {name!r}"))
        return None

    def fn(x):
        with fla_flash_qla_off():
            return _linear_attn_call(op, kind, x)

    return OpImpl("fla", fn, 64, _version("fla-core"), note=f"{mod}.{name}, FLA_FLASH_QLA=0")


def linear_attn_impls(kind: str, chunk_sizes=(64, 128, 256), peers=("fla",)) -> tuple[list[OpImpl], list[str]]:
    """tfla at each chunk size (entries marked unavailable when its op is missing) and FLA when installed;
    also the requested peers that are not installed."""
    impls = [tfla_linear_attn_impl(kind, L) for L in chunk_sizes]
    missing = []
    if "fla" in peers:
        impl = fla_linear_attn_impl(kind)
        if impl is None:
            missing.append(missing_note("fla"))
        else:
            impls.append(impl)
    return impls, missing


# mlstm_kernels 2.0.6 chunkwise Triton kernels: registry key -> (input gate, chunk sizes it runs at).
# "xl" kernels (TFLA) take any chunk size dividing T (multiples of 64, or T itself when T < 128);
# limit_chunk is the paper's chunk-limited baseline, run at its default 64.
MLSTM_KERNELS = {
    "triton_xl_chunk_siging": "sigmoid",
    "triton_limit_chunk": "exp",
    "triton_xl_chunk": "exp",
}
MLSTM_KERNELS_CRASHY = {"triton_xl_chunk"}  # crashed Triton 3.6's compiler (LLVM assertion) on an H200


def tfla_mlstm_impl(input_gate: str, chunk_size: int, detach_normalizer: bool = False,
                    save_states: bool = False) -> OpImpl:
    """tfla.chunk_mlstm at one chunk size; ``detach_normalizer``: mlstm_kernels' gradient convention (the
    normalizer and max state held constant, as ``tfla.compat.mlstm_kernels`` returns), row "tfla L=.. detached";
    ``save_states`` (L = 64): the forward's states kept for the backward, row "tfla L=64 saved"."""
    op, why = find_tfla_op("chunk_mlstm", ("tfla.ops.mlstm", "tfla.ops.mlstm.chunk"))
    flags = ["detach_normalizer=True"] * detach_normalizer + ["save_states=True"] * save_states
    impl = OpImpl(f"tfla L={chunk_size}" + (" detached" if detach_normalizer else "") + (" saved" if save_states else ""),
                  None, chunk_size, _version("tfla"),
                  note="tfla.chunk_mlstm" + (f"({', '.join(flags)})" if flags else ""), input_gate=input_gate)
    if op is None:
        impl.unavailable, impl.note = "not available (tfla.chunk_mlstm)", f"tfla.chunk_mlstm missing: {why}"
        return impl
    impl.fn = lambda x: op(x["q"], x["k"], x["v"], x["i"], x["f"], input_gate=input_gate, normalize=True,
                           eps=1e-6, chunk_size=chunk_size, detach_normalizer=detach_normalizer,
                           **({"save_states": True} if save_states else {}))[0]
    return impl


def mlstm_kernels_impl(kernel: str, chunk_size: int, save_states: bool = False) -> OpImpl | None:
    """One mlstm_kernels chunkwise kernel, head-first ``[B, NH, S, D]``, eps 1e-6, ``chunk_size`` (the
    intra chunk of the xl kernels; reduced to gcd(S, chunk_size) for shorter inputs such as the slice
    check's); None when mlstm_kernels (or this kernel) is not available. ``save_states`` (xl kernels):
    ``recompute_states_in_bw=False``, the forward's states kept for the backward (row "... saved")."""
    try:
        from mlstm_kernels.torch import get_mlstm_kernel

        fn_k = get_mlstm_kernel(f"chunkwise--{kernel}")
    except Exception as e:
        _import_failed(f"mlstm_kernels:{kernel}", e)
        return None
    gate = MLSTM_KERNELS[kernel]

    def fn(x):
        S = x["q"].shape[2]
        L = chunk_size if S % chunk_size == 0 else math.gcd(S, chunk_size)
        kw = {"return_last_states": False, "eps": 1e-6, "chunk_size": L}
        if x["q"].dtype in (torch.float32, torch.float16, torch.bfloat16):
            kw["autocast_kernel_dtype"] = x["q"].dtype  # only used under torch.autocast
        if gate == "sigmoid":
            kw["normalize"] = True
        if save_states:
            kw["recompute_states_in_bw"] = False
        return fn_k(x["q"], x["k"], x["v"], x["i"], x["f"], **kw)

    short = kernel.removeprefix("triton_")
    version = _version("mlstm_kernels")
    if version == "?":
        version = _version("mlstm-kernels")
    return OpImpl(f"mk {short} L={chunk_size}" + (" saved" if save_states else ""), fn, chunk_size, version,
                  note=f"chunkwise--{kernel}" + ("(recompute_states_in_bw=False)" if save_states else ""),
                  head_first=True, crash_probe=kernel in MLSTM_KERNELS_CRASHY, kernel=kernel, input_gate=gate)


def mlstm_impls(input_gate: str, chunk_sizes=(64, 128, 256), kernels=tuple(MLSTM_KERNELS), mk_chunk_sizes=(128,),
                with_tfla: bool = True, with_tfla_detached: bool = False, with_tfla_saved: bool = False,
                saved_kernels=()) -> tuple[list[OpImpl], list[str]]:
    """tfla.chunk_mlstm at each chunk size (unavailable entries when it is missing) and the mlstm_kernels
    kernels of this input gate (xl kernels at each of ``mk_chunk_sizes``, limit_chunk at 64); with
    ``with_tfla_saved`` tfla with ``save_states`` (L = 64), and ``saved_kernels`` (xl keys) with
    ``recompute_states_in_bw=False``."""
    impls = [tfla_mlstm_impl(input_gate, L) for L in chunk_sizes] if with_tfla else []
    if with_tfla_detached:
        impls += [tfla_mlstm_impl(input_gate, L, detach_normalizer=True) for L in chunk_sizes]
    if with_tfla_saved:
        impls.append(tfla_mlstm_impl(input_gate, 64, save_states=True))
    missing = []
    for kernel, saved in [(kk, False) for kk in kernels] + [(kk, True) for kk in saved_kernels]:
        if MLSTM_KERNELS[kernel] != input_gate:
            continue
        for L in ((64,) if kernel == "triton_limit_chunk" else mk_chunk_sizes):
            impl = mlstm_kernels_impl(kernel, L, save_states=saved)
            if impl is None:
                missing.append(missing_note(f"mlstm_kernels:{kernel}"))
                break
            impls.append(impl)
    return impls, missing
