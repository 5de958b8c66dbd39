"""GPU-only code paths compile: Triton's interpreter (the CPU tests) skips the compiler, which rejects what the
interpreter accepts (a module global read inside a kernel, a layout it cannot lower). ``scripts/compile_stats.py``
compiles every kernel an op launches for sm_90 with this machine's Triton and ptxas, no GPU needed; run in a
subprocess because the interpreter's setting is fixed when the kernels are decorated."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


@pytest.mark.parametrize("op,dtype", [("rnn", "fp32"), ("rnn", "bf16")])
def test_kernels_compile_for_sm90(op, dtype):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compile_stats.py"), "--op", op, "--dtype", dtype,
                        "--check"], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    for kernel in ("_rnn_pointwise_fwd_kernel", "_rnn_pointwise_bwd_kernel", "_rnn_fused_fwd_kernel",
                   "_rnn_fused_bwd_kernel"):
        assert kernel in r.stdout, r.stdout[-2000:]


# shared memory of one SM (233,472 B on sm_90) halved, less the 1 KB the driver reserves per program
TWO_PER_SM = 233472 // 2 - 1024


def test_gdn_fused_pass_fits_two_programs_per_sm():
    """The fused GDN forward at 64-column value tiles, keeping Vnew for the backward (the Qwen3-Next-style layer's
    launch under autograd), fits two programs per SM. Storing Vnew before the output put it at 123,396 B under
    Triton 3.6 and 3.9 (one program per SM: the pass 0.97 -> 1.10 ms on that layer, H100, 2026-11-24)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compile_stats.py"), "--op", "gdn", "--dtype",
                        "bf16", "--config", '{"fused": {"BV": 64}}'], capture_output=True, text=True, timeout=600,
                       env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    line = next(ln for ln in r.stdout.splitlines() if "_fused_delta_fwd_kernel" in ln)
    smem = int(line.split("smem=")[1].split("B")[0])
    assert smem <= TWO_PER_SM, line


def test_gdn_ws_pass_compiles_for_sm90():
    """The Gluon kernels (``fused_delta_ws.py``, ``state_bwd_ws.py``, ``chunk_dqkw_ws.py``: taken on Hopper GPUs only,
    so no CPU test runs them) compile for sm_90 at each of their flag sets, within one SM's shared memory. The
    forward pass: the default (one consumer of 64
    columns) spills at most a few dozen bytes (4-52 B under Triton 3.6 and 3.9), two consumers of 32 none (4 B in one
    flag set under 3.9), two of 64 (the pieces' launch: 213 KB of shared memory) a few hundred (76-248 B under 3.6,
    156-180 B under 3.9)."""
    from tfla.ops.common.fused_delta_ws import HAVE_GLUON

    if not HAVE_GLUON:
        pytest.skip("this Triton has no Gluon warp specialization")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compile_stats.py"), "--op", "gdn_ws", "--dtype",
                        "bf16", "--check"], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    lines = [ln for ln in r.stdout.splitlines() if "_fused_delta_ws_kernel" in ln]
    # 3 launches x (4 pass flag sets + Vnew with the backward's slab starts + the transitions + the backward's states
    # without the output, dense and varlen)
    assert len(lines) == 24, r.stdout[-2000:]
    spills = {ln: int(ln.split("spill_stores=")[1].split("B")[0]) for ln in lines}
    for ln, sp in spills.items():
        limit = 16 if "NCONS=2" in ln and "BV=32" in ln else 512 if "NCONS=2" in ln else 128
        assert sp <= limit, "\n".join(lines)
    # the state-gradient recurrence (state_bwd_ws.py, bf16): 3 launches x 3 flag sets and the slabs' (first row, end
    # row) pairs at two consumers of 32; two consumers of 32 columns
    # (the default) without spills, the others within 384 B (two 64-column consumers, the pieces' launch: 213 KB of
    # shared memory, 240-360 B under Triton 3.6 and 172-284 B under 3.9 since the next chunk's gates and beta are
    # loaded a step ahead, which measured faster there all the same)
    bwd = [ln for ln in r.stdout.splitlines() if "_delta_state_bwd_ws_kernel" in ln]
    assert len(bwd) == 10, r.stdout[-2000:]
    for ln in bwd:
        limit = 0 if "NCONS=2" in ln and "BV=32" in ln else 384
        assert int(ln.split("spill_stores=")[1].split("B")[0]) <= limit, "\n".join(bwd)
    # the chunk gradients (chunk_dqkw_ws.py): grouped value heads (dense, varlen) per value head and summed in the
    # kernel, one value head per key head (with l2norm's backward, without), and the slabs' pairs (per value head,
    # summed); no spills
    grads = [ln for ln in r.stdout.splitlines() if "_gdn_bwd_ws_kernel" in ln]
    assert len(grads) == 8 and sum("GVA=True" in ln for ln in grads) == 3, r.stdout[-2000:]
    assert all("spill_stores=0B" in ln for ln in grads), "\n".join(grads)


def test_gdn_ws_kernels_compile_at_v64():
    """The Gluon kernels at V = 64 (the chunk gradients' buffers of one 64-column tile each): every flag set builds
    for sm_90. Newer Tritons reject a ``[64, 128]`` view of a ``[64, 64]`` buffer even in a branch never taken (the
    grouped heads' partial sums, which V = 64 never runs), which this Triton would otherwise compile."""
    from tfla.ops.common.fused_delta_ws import HAVE_GLUON

    if not HAVE_GLUON:
        pytest.skip("this Triton has no Gluon warp specialization")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compile_stats.py"), "--op", "gdn_ws", "--dtype",
                        "bf16", "--V", "64", "--check"], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    grads = [ln for ln in r.stdout.splitlines() if "_gdn_bwd_ws_kernel" in ln]
    # one value head per key head (with l2norm's backward, without), grouped heads per value head, the slabs' pairs
    assert len(grads) == 5 and not any("GVA=True" in ln for ln in grads), r.stdout[-2000:]
    assert all("spill_stores=0B" in ln for ln in grads), "\n".join(grads)
