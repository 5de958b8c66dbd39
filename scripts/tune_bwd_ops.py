"""Time whole forward+backward calls of tfla ops with one backward stage's launch config overridden (GPU).

python scripts/tune_bwd_ops.py --ops gdn,sgla-scalar,mlstm-sig --stage state_bwd \
    --configs '[{}, {"BV": 64, "num_warps": 8}]'

For each op (the workloads of scripts/profile_ops.py) and each config: the do_bench median of one
forward+backward call and the profiler time of the stage's kernel per call. ``{}`` is the default.
Stages: ``dqkw`` (chunk_dqkw.chunk_dqkw_bwd, GDN), ``state_fwd`` (``_sub``: only the backward's recompute, ``_out``: only the forward's call; the kernel
time is that of both) / ``state_bwd`` (chunk_state.chunk_state_fwd / _bwd) and ``wy_bwd`` (ut_transform.wy_bwd), patched where
the ops import them, so every op's call picks the config up; ``tiled``: every launch of the tiled kernel
(forward output and the three backward products; ``chunk_output.tiled_config`` and its ``output_config``
aliases patched), e.g. ``'[{"num_stages": 1}, {"num_stages": 2}]'``.
"""
import argparse
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_ops import fwdbwd  # noqa: E402

import tfla.ops.gated_delta_rule.chunk as gdn  # noqa: E402
import tfla.ops.simple_gla.chunk as sgla  # noqa: E402

import tfla.ops.common.chunk_output as co  # noqa: E402
import tfla.ops.gla.chunk as gla  # noqa: E402

KERNELS = {"state_fwd": "_chunk_state_fwd_kernel", "state_fwd_sub": "_chunk_state_fwd_kernel",
           "state_fwd_out": "_chunk_state_fwd_kernel", "state_bwd": "_chunk_state_bwd_kernel",
           "wy_bwd": "_gdn_wy_bwd_kernel", "tiled": "_chunk_tiled_kernel", "dqkw": "_gdn_dqkw_kernel"}
FUNCS = {"state_fwd": "chunk_state_fwd", "state_fwd_sub": "chunk_state_fwd", "state_fwd_out": "chunk_state_fwd",
         "state_bwd": "chunk_state_bwd", "wy_bwd": "wy_bwd", "dqkw": "chunk_dqkw_bwd"}


def patch(stage, cfg):
    if stage == "tiled":  # the config resolver every tiled launch goes through
        orig = getattr(co, "_orig_tiled_config", None) or co.tiled_config
        co._orig_tiled_config = orig

        def resolved(L, DA, DC, config=None, _o=orig):
            return _o(L, DA, DC, {**(config or {}), **cfg})

        co.tiled_config = resolved
        for mod in (co, gdn, sgla, gla):
            if hasattr(mod, "output_config"):
                mod.output_config = resolved
        return
    name = FUNCS[stage]
    for mod in (gdn, sgla):
        if not hasattr(mod, name):  # e.g. chunk_dqkw_bwd: the delta rule only
            continue
        orig = getattr(mod, "_orig_" + name, None) or getattr(mod, name)
        setattr(mod, "_orig_" + name, orig)

        def wrapped(*a, _o=orig, **kw):
            # state_fwd_sub / _out: only the backward's recompute (states every 64 rows) / only the forward's call
            sub = bool(kw.get("store_every_sub_chunk"))
            if (stage == "state_fwd_sub" and not sub) or (stage == "state_fwd_out" and sub):
                return _o(*a, **kw)
            kw["config"] = {**(kw.get("config") or {}), **cfg}
            return _o(*a, **kw)

        setattr(mod, name, wrapped)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="gdn,sgla-scalar,mlstm-sig")
    p.add_argument("--stage", choices=list(KERNELS), default="state_bwd")
    p.add_argument("--configs", default='[{}]', help="JSON list of config dicts")
    p.add_argument("--L", type=int, default=64)
    p.add_argument("--no-intra", action="store_true",
                   help="dvo from its own tiled launch instead of inside the state backward (chunk_state.intra_supported)")
    a = p.parse_args()
    if a.no_intra:
        for mod in (gdn, sgla):
            mod.intra_supported = lambda *args, **kw: False
    for op in a.ops.split(","):
        run = fwdbwd(op, a.L)[0]
        for cfg in json.loads(a.configs):
            patch(a.stage, cfg)
            try:
                run()
                torch.cuda.synchronize()
                ms = do_bench(run, warmup=10, rep=50, return_mode="median")
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        run()
                    torch.cuda.synchronize()
                kt = sum(e.device_time_total for e in prof.key_averages() if e.key == KERNELS[a.stage]) / 3e3
                print(f"{op:12s} {a.stage}{' no-intra' if a.no_intra else ''} {json.dumps(cfg):40s} call {ms:7.3f} ms  kernel {kt:6.3f} ms", flush=True)
            except Exception as e:  # noqa: BLE001 (a config that does not compile or fit)
                print(f"{op:12s} {a.stage} {json.dumps(cfg):40s} FAILED {type(e).__name__}: {str(e)[:100]}", flush=True)
                if "illegal" in str(e):
                    return


if __name__ == "__main__":
    main()
