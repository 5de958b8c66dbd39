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


GDN_OP_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def gdn_op_grads(configs: list[dict], varlen: bool, segments: int = 1, seed: int = 7, reference: bool = False,
                 device: str = "cuda", l2norm: bool = False, HV: int = 4):
    """Forward + backward of ``tfla.chunk_gated_delta_rule`` on one bf16 input on ``device`` under each of
    ``configs`` (the op's ``config``): B = 2 x T = 550, or 4 packed sequences of 1, 299, 0 and 800 tokens
    (``varlen``); H = 2, HV value heads (4: grouped), K = V = 128; an initial state; random cotangents for o and the
    final state; ``segments`` as the op takes it; ``l2norm``: ``use_qk_l2norm_in_kernel``. Returns one tuple per
    config, ``(o, final_state, *gradients of GDN_OP_NAMES)``, and with ``reference`` also the gradients of the
    float64 recurrence (CPU) as the last item."""
    import tfla
    from tfla.bench.inputs import gdn_inputs
    from tfla.ops.gated_delta_rule.reference import recurrent_gated_delta_rule_ref

    cu = torch.tensor([0, 1, 300, 300, 1100], device=device) if varlen else None
    B, T = (1, 1100) if varlen else (2, 550)
    x = gdn_inputs(B, T, 2, 128, 128, HV=HV, dtype=torch.bfloat16, device=device, initial_state=True,
                   num_seqs=4 if varlen else B, seed=seed)
    gen = torch.Generator(device=device).manual_seed(0)
    do = torch.randn(B, T, HV, 128, device=device, generator=gen).bfloat16()
    dht = torch.randn(x["initial_state"].shape, device=device, generator=gen)
    res = []
    for cfg in configs:
        leaves = [x[n].clone().requires_grad_() for n in GDN_OP_NAMES]
        o, s = tfla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                           cu_seqlens=cu, segments=segments, config=cfg,
                                           use_qk_l2norm_in_kernel=l2norm)
        res.append((o, s) + torch.autograd.grad((o * do).sum() + (s * dht).sum(), leaves))
    if reference:
        r = [x[n].double().cpu().requires_grad_() for n in GDN_OP_NAMES]
        ro, rs = recurrent_gated_delta_rule_ref(*r[:5], scale=128 ** -0.5, initial_state=r[5],
                                                output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                                                cu_seqlens=cu.cpu() if varlen else None)
        res.append(torch.autograd.grad((ro * do.double().cpu()).sum() + (rs * dht.double().cpu()).sum(), r))
    return res


def rnn_grads(fn, cell: str, x, R, b, state, final: bool = True, cu=None, seed: int = 1):
    """``(h, final state tuple, (dx, dR, db, *dstate0))`` of an RNN cell op ``fn`` (``tfla.lstm``'s signature, or a
    reference with it) on copies of x, R, b and the initial state ``state`` (a tuple, or None for zeros): float64
    cotangents from a generator seeded with ``seed``, cast to each output's dtype, for h and (``final``) every final
    state but the sLSTM's m (a constant of the backward); ``cu`` is passed as ``cu_seqlens``."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, R, b, *(state or ()))]
    kw = {"cu_seqlens": cu} if cu is not None else {}
    h, fin = fn(*leaves[:3], tuple(leaves[3:]) if state is not None else None, final, **kw)
    gen = torch.Generator().manual_seed(seed)
    outs, cts = [h], [torch.randn(h.shape, generator=gen, dtype=torch.float64)]
    if final:
        for k, f in enumerate(fin):
            if cell == "slstm" and k == 3:  # m: a constant of the backward
                continue
            outs.append(f)
            cts.append(torch.randn(f.shape, generator=gen, dtype=torch.float64))
    grads = torch.autograd.grad(outs, leaves, [c.to(o.dtype).to(o.device) for c, o in zip(cts, outs)],
                                allow_unused=True)
    return h, fin, grads


def host_seconds_behind_sleep(call) -> float:
    """Host time of ``call()`` queued behind a ~200 ms sleep kernel on the current CUDA device, after one call that
    compiles and fills host caches: far below 0.2 s unless the call waits for the device (a host read of a device
    tensor, a copy from pageable memory)."""
    import time

    call()
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # cycles: >= 200 ms at SM clocks up to 2 GHz
    t0 = time.perf_counter()
    call()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host
