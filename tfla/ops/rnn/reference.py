"""Step-by-step references of the four FlashRNN cells (Pöppel et al. 2024, "FlashRNN", Section 2): ground truth.

Notation: B batch, T time, G gates, NH heads, D head dim. ``x [B, T, G, NH, D]`` already holds the input
projection; ``R [G, NH, D, D]`` is ``[out, in]`` like an ``nn.Linear`` weight; ``b [G, NH, D]``.

Every reference computes in the dtype it is given (tests pass float64) and never casts; gradients come from
autograd. The sLSTM's max state m is detached (the backward treats m as a constant, as xLSTM and FlashRNN do).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# gates and states of each cell, in the order of x's gate axis and of the state tuple
CELL_GATES = {"elman": ("h",), "lstm": ("i", "f", "z", "o"), "gru": ("r", "z", "n"), "slstm": ("i", "f", "z", "o")}
CELL_STATES = {"elman": ("h",), "lstm": ("h", "c"), "gru": ("h",), "slstm": ("h", "c", "n", "m")}


def _rh(R: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``R h`` for all gates and heads: R ``[G, NH, D, D]``, h ``[B, NH, D]`` -> ``[B, G, NH, D]``."""
    return torch.einsum("gned,bnd->bgne", R, h)


def _step(cell: str, xt, rh, b, state):
    """One step of ``cell``; ``xt``, ``rh`` ``[B, G, NH, D]``, ``b`` ``[G, NH, D]``; returns the new state tuple."""
    if cell == "elman":
        return (torch.tanh(xt[:, 0] + rh[:, 0] + b[0]),)
    if cell == "lstm":
        a = xt + rh + b
        i, f, z, o = torch.sigmoid(a[:, 0]), torch.sigmoid(a[:, 1]), torch.tanh(a[:, 2]), torch.sigmoid(a[:, 3])
        c = f * state[1] + i * z
        return (o * torch.tanh(c), c)
    if cell == "gru":
        r = torch.sigmoid(xt[:, 0] + rh[:, 0] + b[0])
        z = torch.sigmoid(xt[:, 1] + rh[:, 1] + b[1])
        n = torch.tanh(xt[:, 2] + r * (rh[:, 2] + b[2]))
        return ((1 - z) * n + z * state[0],)
    # slstm
    _, c0, n0, m0 = state
    a = xt + rh + b
    ai, af = a[:, 0], a[:, 1]
    lf = F.logsigmoid(af) + m0.detach()
    m = torch.where(n0.detach() == 0, ai, torch.maximum(ai, lf)).detach()
    ig, fg = torch.exp(ai - m), torch.exp(lf - m)
    c = fg * c0 + ig * torch.tanh(a[:, 2])
    n = fg * n0 + ig
    return (torch.sigmoid(a[:, 3]) * c / n, c, n, m)


def recurrent_rnn_ref(cell: str, x, R, b, initial_state=None, output_final_state=False):
    """The ``cell`` recurrence one step at a time (see the module docstring and ``tfla/ops/rnn/README.md``).

    Args: x ``[B, T, G, NH, D]``, R ``[G, NH, D, D]``, b ``[G, NH, D]``, initial_state a tuple of ``[B, NH, D]``
    in ``CELL_STATES[cell]`` order (zeros when None), all of one dtype.
    Returns ``(h [B, T, NH, D], final state tuple or None)`` in that dtype.
    """
    B, T, G, NH, D = x.shape
    if initial_state is None:
        initial_state = tuple(x.new_zeros(B, NH, D) for _ in CELL_STATES[cell])
    state = tuple(initial_state)
    hs = []
    for t in range(T):
        state = _step(cell, x[:, t], _rh(R, state[0]), b, state)
        hs.append(state[0])
    h = torch.stack(hs, 1) if hs else x.new_zeros(B, 0, NH, D)
    return h, (state if output_final_state else None)


def recurrent_elman_ref(x, R, b, initial_state=None, output_final_state=False):
    return recurrent_rnn_ref("elman", x, R, b, initial_state, output_final_state)


def recurrent_lstm_ref(x, R, b, initial_state=None, output_final_state=False):
    return recurrent_rnn_ref("lstm", x, R, b, initial_state, output_final_state)


def recurrent_gru_ref(x, R, b, initial_state=None, output_final_state=False):
    return recurrent_rnn_ref("gru", x, R, b, initial_state, output_final_state)


def recurrent_slstm_ref(x, R, b, initial_state=None, output_final_state=False):
    return recurrent_rnn_ref("slstm", x, R, b, initial_state, output_final_state)
