"""FLOP and byte model of the chunkwise gated delta rule forward pass (per call).

Counts matrix-product FLOPs (2 per multiply-add) of the algorithm at outer chunk L with 64-row
sub-chunks, as tfla computes it; elementwise work (gates, masks) is ignored. For L = 64 this is also
the work of FLA's single-level kernel. Per token and value head:

    UT/WY (per 64-row sub-chunk, 16-row blocks):  A: 40 K,  W: 40 K,  U: 40 V   (multiply-adds)
    state:   W S and K^T Vnew:                     2 K V
    output:  q S:                                  K V
             intra, L x L causal in 64-row tiles:  32 (L/64 + 1) (K + V)

Bytes: ``min_bytes`` reads every input once and writes the output once (the roofline floor of
any implementation); ``pipeline_bytes`` adds tfla's intermediates (cumulative gates, W, U, Vnew
written and read back, states written every L tokens and read once).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    flops: float
    min_bytes: float
    pipeline_bytes: float
    state_bytes: float


def gdn_fwd_cost(B: int, T: int, H: int, HV: int, K: int, V: int, chunk_size: int = 64,
                 itemsize: int = 2, state_itemsize: int | None = None, gate_itemsize: int = 4) -> Cost:
    """Cost of one forward call; ``itemsize`` is the q/k/v dtype's size, states in ``state_itemsize``
    (default: itemsize, as tfla and FLA store them)."""
    L = chunk_size
    state_itemsize = state_itemsize or itemsize
    tok = B * T * HV  # token x value-head pairs
    mac = tok * (40 * K + 40 * K + 40 * V + 2 * K * V + K * V + 32 * (L / 64 + 1) * (K + V))
    n_states = B * -(-T // L) * HV
    state_bytes = n_states * K * V * state_itemsize
    qk = B * T * H * K * itemsize
    vv = B * T * HV * V * itemsize
    gates = B * T * HV * (gate_itemsize + itemsize)
    min_bytes = 2 * qk + 2 * vv + gates  # q, k, v, g, beta read; o written (same size as v)
    w_b = B * T * HV * K * itemsize
    inter = (
        B * T * HV * 4 * 4        # g_cum written once, read by three stages
        + 2 * w_b + 2 * vv        # W and U written, read by the state stage
        + 2 * vv                  # Vnew written, read by the output stage
        + 2 * state_bytes         # states written, read
        + 2 * qk                  # k read again by the state and output stages
    )
    return Cost(flops=2.0 * mac, min_bytes=float(min_bytes), pipeline_bytes=float(min_bytes + inter),
                state_bytes=float(state_bytes))


def gdn_bwd_cost(B: int, T: int, H: int, HV: int, K: int, V: int, chunk_size: int = 64) -> float:
    """Matrix FLOPs of tfla's backward pass (its recomputation included), per call. Per token and
    value head, in multiply-adds: recompute W, U (40 K + 40 V) and states (2 K V); the output's
    gradients of Vnew, q, k (3 x 32 (L/64 + 1) (K + V), plus K V for q's state term); the state
    recurrence (3 K V); the UT/WY backward (2 K V + 320 K + 128 V + 8192)."""
    L = chunk_size
    intra = 32 * (L / 64 + 1) * (K + V)
    mac = (40 * K + 40 * V + 2 * K * V) + (3 * intra + K * V) + 3 * K * V + (2 * K * V + 320 * K + 128 * V + 8192)
    return 2.0 * B * T * HV * mac
