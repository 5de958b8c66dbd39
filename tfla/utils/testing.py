"""Helpers for checking kernels against references (used by the tests and the benchmarks)."""
from __future__ import annotations

import torch


def rel_l2(out: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """``||out - ref|| / ||ref||`` computed in float64; inf if ``out`` is missing or not finite."""
    if out is None or ref is None:
        return float("nan") if out is None and ref is None else float("inf")
    out, ref = out.double(), ref.double()
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(out.shape)} vs {tuple(ref.shape)}")
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_rel_close(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    """Fail unless ``out`` is finite everywhere and within ``tol`` relative L2 of ``ref``."""
    assert out is not None, f"{name}: missing"
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    n_bad = int((~torch.isfinite(out)).sum())
    assert n_bad == 0, f"{name}: {n_bad} non-finite values (unwritten tile or overflow)"
    err = rel_l2(out, ref)
    assert err <= tol, f"{name}: rel-L2 {err:.3e} > {tol:.1e}"
    return err
