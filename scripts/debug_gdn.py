"""Run each GDN forward stage with a device sync after it, to localize a faulting kernel."""
import json
import sys

import torch

from tfla.bench.inputs import gdn_inputs
from tfla.ops.common.chunk_output import chunk_output_fwd
from tfla.ops.common.chunk_state import chunk_state_fwd
from tfla.ops.common.cumsum import chunk_local_cumsum
from tfla.ops.common.utils import RCP_LN2
from tfla.ops.common.ut_transform import _gdn_wy_fwd_kernel, ut_inverse_fwd, ut_transform_fwd  # noqa: F401

B, T, H, K, V = (int(a) for a in (sys.argv[1:6] if len(sys.argv) > 5 else (1, 256, 2, 128, 128)))
L = int(sys.argv[6]) if len(sys.argv) > 6 else 64
state_cfg = json.loads(sys.argv[7]) if len(sys.argv) > 7 else None
x = gdn_inputs(B, T, H, K, V, dtype=torch.bfloat16, device="cuda")
q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]


def step(name, fn):
    out = fn()
    torch.cuda.synchronize()
    print("ok", name, flush=True)
    return out


g_cum = step("cumsum", lambda: chunk_local_cumsum(g, L, scale=RCP_LN2))
ai = step("inverse", lambda: ut_inverse_fwd(k, g_cum, beta))
w, u, ai = step("ut_transform", lambda: ut_transform_fwd(k, v, g_cum, beta, L))
h, v_new, _ = step("state", lambda: chunk_state_fwd(k, u, g_cum, L, w=w, config=state_cfg))
step("state2", lambda: chunk_state_fwd(k, v, g_cum, L, ai=ai, beta=beta, config=state_cfg))
step("output", lambda: chunk_output_fwd(q, k, v_new, h, g_cum, K ** -0.5, L))
