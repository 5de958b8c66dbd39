"""Helpers for checking kernels against references (used by the tests and the benchmarks)."""
from __future__ import annotations

import torch


def rel_l2(out: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """``||out - ref|| / ||ref||`` computed in float64 (on ``out``'s device); inf if ``out`` is missing or not
    finite."""
    if out is None or ref is None:
        return float("nan") if out is None and ref is None else float("inf")
    out, ref = out.double(), ref.double().to(out.device)
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


# Relative-L2 tolerances of a result against its float64 reference, by (input dtype, where the kernels run).
# fp32 runs IEEE fp32 dots on the CPU interpreter but tf32x3 (three TF32 tensor-core products, ~1e-6 per product)
# on CUDA (tfla.ops.common.utils.dot_precision), whose rounding strong decays amplify in the gate gradient: the GDN
# backward's strong-gate cases at L = 64 measured dg 1.26e-5 and 1.81e-5 on an H100 (2026-11-23, 293a86c) and fail
# 1e-5 on an H200 (2026-11-24, bb68e62; the other 146 GDN GPU cases passed at 1e-5 there).
TOLERANCES = {
    (torch.float64, "interpreter"): 1e-12,
    (torch.float32, "interpreter"): 1e-5,
    (torch.float32, "cuda"): 3e-5,
    (torch.float16, "interpreter"): 1e-2,
    (torch.float16, "cuda"): 1e-2,
}


def tolerance(dtype: torch.dtype, where: str | None = None) -> float:
    """``TOLERANCES[(dtype, where)]``; ``where`` is ``"cuda"`` or ``"interpreter"`` (default: cuda when a GPU is
    present, as the tests run there then).

    Raises:
        KeyError: no tolerance for that pair (a test must not guess one).
    """
    if where is None:
        where = "cuda" if torch.cuda.is_available() else "interpreter"
    return TOLERANCES[(dtype, where)]
