"""Registry of Gated DeltaNet implementations the benchmark can run: tfla at each chunk size, FLA's
own Triton kernel (``FLA_FLASH_QLA=0``) and FlashQLA, the last two only when installed.

Every entry takes the input dict of ``tfla.bench.inputs.gdn_inputs`` and returns ``(o, final_state)``.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
from dataclasses import dataclass
from typing import Callable


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


def tfla_impl(chunk_size: int) -> Impl:
    from tfla.ops.gated_delta_rule import chunk_gated_delta_rule

    def fn(x, output_final_state=True, **kw):
        return chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x.get("initial_state"),
            output_final_state=output_final_state, cu_seqlens=x.get("cu_seqlens"), chunk_size=chunk_size, **kw)

    return Impl(f"tfla L={chunk_size}", fn, chunk_size, None, _version("tfla"))


def fla_impl() -> Impl | None:
    """FLA's Triton ``chunk_gated_delta_rule`` (chunk 64). FLA reads ``FLA_FLASH_QLA`` at call time,
    so the entry pins it to 0 around each call to time FLA's own kernels, not FlashQLA's."""
    try:
        mod = importlib.import_module("fla.ops.gated_delta_rule")
    except Exception:  # not installed, or fails to import on this machine
        return None
    fla_gdn = mod.chunk_gated_delta_rule

    def fn(x, output_final_state=True):
        old = os.environ.get("FLA_FLASH_QLA")
        os.environ["FLA_FLASH_QLA"] = "0"
        try:
            return fla_gdn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x.get("initial_state"),
                           output_final_state=output_final_state, cu_seqlens=x.get("cu_seqlens"))
        finally:
            if old is None:
                os.environ.pop("FLA_FLASH_QLA", None)
            else:
                os.environ["FLA_FLASH_QLA"] = old

    return Impl("fla", fn, 64, None, _version("fla-core"), "FLA_FLASH_QLA=0")


def flashqla_impl() -> Impl | None:
    try:
        fq = importlib.import_module("flash_qla")
    except Exception:
        return None

    def fn(x, output_final_state=True):
        return fq.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                         initial_state=x.get("initial_state"),
                                         output_final_state=output_final_state, cu_seqlens=x.get("cu_seqlens"))

    return Impl("flashqla", fn, 64, None, _version("flash-qla"))


def gdn_impls(chunk_sizes=(64, 128, 256, 512), peers=("fla", "flashqla")) -> tuple[list[Impl], list[str]]:
    """Implementations to run, and a note for each requested peer that is not available."""
    impls = [tfla_impl(L) for L in chunk_sizes]
    missing = []
    for peer in peers:
        impl = {"fla": fla_impl, "flashqla": flashqla_impl}[peer]()
        if impl is None:
            missing.append(peer)
        else:
            impls.append(impl)
    return impls, missing
