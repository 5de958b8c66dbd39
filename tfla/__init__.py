"""tfla: Tiled Flash Linear Attention kernels for linear RNNs (Triton + PyTorch autograd).

Public ops are imported lazily, so ``import tfla`` does not import Triton: a CPU-only process can
still set ``TRITON_INTERPRET=1`` after importing tfla and before the first op is used.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_OPS = {
    "chunk_gated_delta_rule": "tfla.ops.gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "tfla.ops.gated_delta_rule",
    "chunk_simple_gla": "tfla.ops.simple_gla",
    "chunk_retention": "tfla.ops.simple_gla",
    "chunk_linear_attn": "tfla.ops.simple_gla",
    "chunk_lightning_attn": "tfla.ops.simple_gla",
    "fused_recurrent_simple_gla": "tfla.ops.simple_gla",
    "chunk_gla": "tfla.ops.gla",
    "chunk_mlstm": "tfla.ops.mlstm.chunk",
    "mlstm_step": "tfla.ops.mlstm.step",
    "elman": "tfla.ops.rnn",
    "lstm": "tfla.ops.rnn",
    "gru": "tfla.ops.rnn",
    "slstm": "tfla.ops.rnn",
}

__all__ = sorted(_OPS)


def __getattr__(name: str):
    if name in _OPS:  # imported on first use, then a module attribute (no lookup per call)
        op = getattr(importlib.import_module(_OPS[name]), name)
        globals()[name] = op
        return op
    raise AttributeError(f"module 'tfla' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_OPS))
