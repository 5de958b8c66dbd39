"""Peak memory of one Gated DeltaNet forward + backward on the Hopper path, predicted on a machine without a GPU.

Every Triton / Gluon launch is replaced by a no-op, the Hopper (Gluon) paths are taken as on an H100 / H200, the
tensors live on the CPU, and a ``TorchDispatchMode`` records every tensor storage that an ATen op creates during the
call (tfla's own buffers and PyTorch's: casts, copies, autograd's) until it is freed. The call is the bench's
(``tfla bench gdn --mode fwdbwd``: a forward on copies of the inputs that require gradients, then
``torch.autograd.grad`` of all of them with a random cotangent), so the printed peak is the bench's ``peak MiB``
(the most allocated above what was allocated before the call) up to the CUDA caching allocator's rounding of block
sizes, and ``held`` is what the forward's outputs keep for the backward (the bench's ``held MiB``).

On 2026-11-28 (7a41b1e, default options) it printed 1224 / 2726 / 2499 MiB peak and 66 / 392 / 183 MiB held for the
MVE, the Qwen3-Next-style layer and B = 1, T = 65536, where the bench measured 1224 / 2728 / 2499 and 66 / 392 / 183
on an H200 (and `slab32` 860 / 206 at the MVE, as measured); the buffers live at the peak show what a memory change
would have to remove. Values are not computed (no-op launches): times and results mean nothing here, only sizes.

    python scripts/memory_peak.py --workload mve --variants default,save_states
    python scripts/memory_peak.py --shape 2,4096,16,32,128,128 --top 12
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


class StorageTracker(TorchDispatchMode):
    """Bytes of the tensor storages created under this mode and still alive; ``peak`` and the buffers live at it."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[int, str]] = {}
        self.cur = self.peak = 0
        self.at_peak: list[tuple[int, str]] = []

    def _track(self, t: torch.Tensor, op) -> None:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.live or st.nbytes() == 0:
            return
        nbytes = st.nbytes()
        frames = [f for f in traceback.extract_stack()[:-3] if f"{os.sep}tfla{os.sep}" in f.filename]
        where = f"{frames[-1].name}, {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "torch"
        self.live[key] = (nbytes, f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}: {op} in {where}")
        self.cur += nbytes
        weakref.finalize(st, self._free, key, nbytes)
        if self.cur > self.peak:
            self.peak = self.cur
            self.at_peak = sorted(self.live.values(), reverse=True)

    def _free(self, key: int, nbytes: int) -> None:
        if self.live.pop(key, None) is not None:
            self.cur -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # views and in-place results share an input's storage: not an allocation
        seen = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().data_ptr() not in seen:
                self._track(t, func.overloadpacket.__name__)
        return out


@contextlib.contextmanager
def hopper_without_launches():
    """Within: launches are no-ops (compiled and interpreted kernels alike), the Gluon stages' capability checks and
    the device check pass on the CPU; everything is restored on exit."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import tfla.ops.common.chunk_state_bwd as csb
    import tfla.ops.common.fused_delta_fwd as fwd
    import tfla.ops.gated_delta_rule.chunk as chunk
    import tfla.utils.validation as validation

    def yes(*a, **k):
        return True

    def no_launch(self, *a, **k):
        return None

    patches = [(JITFunction, "run", no_launch), (InterpretedFunction, "run", no_launch), (fwd, "ws_supported", yes),
               (chunk, "ws_supported", yes), (chunk, "gdn_bwd_ws_supported", yes),
               (chunk, "state_bwd_ws_supported", yes), (csb, "state_bwd_ws_supported", yes),
               (validation, "check_device", lambda name, t: None)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def measure(x: dict, variant: str, seed: int = 0) -> dict:
    """``{"peak": bytes, "held": bytes, "at_peak": [(bytes, what), ...]}`` of the bench's forward + backward call of
    tfla's ``variant`` (``tfla.bench.registry.VARIANTS``) on the workload inputs ``x``."""
    from tfla.bench.gdn import LEAVES, _timed_call
    from tfla.bench.registry import tfla_impl

    impl = tfla_impl(variant)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(x["v"].shape, generator=gen).to(x["v"].dtype)
    call = _timed_call(impl, x, do, "fwdbwd")
    with StorageTracker() as tr:
        grads = call()
    out = {"peak": tr.peak, "at_peak": tr.at_peak}
    leaves = {n: x[n].detach().clone().requires_grad_() for n in LEAVES}
    with StorageTracker() as tr:
        o, _ = impl.fn({**x, **leaves}, output_final_state=False)
        held = tr.cur - o.untyped_storage().nbytes()
    del grads, o
    out["held"] = held
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=("mve", "qwen3-next", "long"), default=None,
                   help="a workload of `tfla bench gdn` at its GPU size (default: mve unless --shape)")
    p.add_argument("--shape", type=str, default=None, help="B,T,H,HV,K,V instead of a named workload")
    p.add_argument("--variants", type=str, default="default,save_v_new,save_states",
                   help="tfla variants, comma-separated (tfla.bench.registry.VARIANTS)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--top", type=int, default=10, help="largest buffers listed at the peak")
    args = p.parse_args(argv)
    from tfla.bench.gdn import Workload, named_workloads, workload_inputs
    from tfla.bench.registry import VARIANTS

    if args.shape:
        try:
            B, T, H, HV, K, V = (int(s) for s in args.shape.split(","))
        except ValueError:
            p.error(f"--shape must be B,T,H,HV,K,V, got {args.shape!r}")
        wl = Workload(B, T, H, HV, K, V, args.dtype)
    else:
        wl = named_workloads(args.workload or "mve", True, args.dtype)[0]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; choose from {', '.join(VARIANTS)}")
    x = workload_inputs(wl, "cpu", "default", 0)
    print(f"{wl.label()}: forward + backward as `tfla bench gdn --mode fwdbwd` (launches no-ops, sizes only)")
    for variant in variants:
        with hopper_without_launches():
            r = measure(x, variant)
        print(f"tfla {variant}: peak {r['peak'] / 2**20:.0f} MiB above the inputs, held {r['held'] / 2**20:.0f} MiB "
              f"from forward to backward; largest buffers at the peak:")
        for nbytes, what in r["at_peak"][:args.top]:
            print(f"  {nbytes / 2**20:8.1f} MiB  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
