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
