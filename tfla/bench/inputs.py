"""Input factories shared by the tests and the benchmarks.

Gates follow ``shared/baselines.md``: ``g = logsigmoid(randn + 3)`` (natural log, <= 0),
``beta = sigmoid(randn)``, keys L2-normalised. Other gate regimes exist for edge-case tests.
Tensors are drawn in fp32 on the CPU from a seeded generator, rounded to the kernel dtype, then
moved; ``as_reference`` upcasts those rounded values (never the originals) for a reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

GATES = ("default", "weak", "strong", "zero", "mixed")


def _gate(kind: str, shape, gen) -> torch.Tensor:
    x = torch.randn(shape, generator=gen)
    if kind == "default":
        return F.logsigmoid(x + 3.0)
    if kind == "weak":  # g close to 0: long memory
        return -1e-3 * torch.rand(shape, generator=gen)
    if kind == "strong":  # heavy decay: e^g ~ 0.01 .. 0.5
        return F.logsigmoid(x - 2.0) * 2.0
    if kind == "zero":
        return torch.zeros(shape)
    if kind == "mixed":  # g = 0 on even value heads, strong decay on odd ones
        g = F.logsigmoid(x - 2.0) * 2.0
        g[..., 0::2] = 0.0
        return g
    raise ValueError(f"gate must be one of {GATES}, got {kind!r}")


def gdn_inputs(
    B: int,
    T: int,
    H: int,
    K: int,
    V: int,
    HV: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    gate: str = "default",
    gate_dtype: torch.dtype = torch.float32,
    beta_dtype: torch.dtype | None = None,
    initial_state: bool = False,
    num_seqs: int | None = None,
    seed: int = 0,
) -> dict:
    """Random inputs for ``chunk_gated_delta_rule``: dict with q, k, v, g, beta, initial_state.

    ``num_seqs`` sets N for the initial state (varlen); default B. g is ``gate_dtype`` (fp32, as
    FLA's GatedDeltaNet layer produces it), beta defaults to the kernel dtype.
    """
    HV = HV or H
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), p=2, dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = _gate(gate, (B, T, HV), gen)
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen))
    h0 = torch.randn(num_seqs or B, HV, K, V, generator=gen) * 0.5 if initial_state else None
    out = {
        "q": q.to(dtype),
        "k": k.to(dtype),
        "v": v.to(dtype),
        "g": g.to(gate_dtype),
        "beta": beta.to(beta_dtype or dtype),
        "initial_state": h0,
    }
    return {name: (x.to(device) if x is not None else None) for name, x in out.items()}


def as_reference(inputs: dict, dtype: torch.dtype = torch.float64) -> dict:
    """Upcast already-rounded inputs for a reference computation."""
    return {name: (x.to(dtype) if isinstance(x, torch.Tensor) else x) for name, x in inputs.items()}


def random_cu_seqlens(T: int, num_seqs: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """``[num_seqs + 1]`` int64 offsets splitting T tokens into ``num_seqs`` random non-empty pieces."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(T - 1, generator=gen)[: num_seqs - 1] + 1
    bounds = [0] + sorted(cuts.tolist()) + [T]
    return torch.tensor(bounds, dtype=torch.int64, device=device)


DECAY_KINDS = ("none", "constant", "scalar", "vector", "lightning")


def linear_attn_inputs(
    B: int,
    T: int,
    H: int,
    K: int,
    V: int,
    kind: str = "scalar",
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    gate: str = "default",
    gate_dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict:
    """Random inputs for linear attention with decay ``kind``: dict with q, k, v [B, T, H, K|V] (keys
    L2-normalised) and g: None for "none" (no decay), "constant" and "lightning" (the op's fixed per-head decays),
    the log decay ``[B, T, H]`` for "scalar" (simple GLA), ``[B, T, H, K]`` for "vector" (GLA), drawn
    from the ``gate`` regime in ``gate_dtype``."""
    if kind not in DECAY_KINDS:
        raise ValueError(f"kind must be one of {DECAY_KINDS}, got {kind!r}")
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), p=2, dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = None
    if kind == "scalar":
        g = _gate(gate, (B, T, H), gen)
    elif kind == "vector":
        g = _gate(gate, (B, T, H, K), gen)
    out = {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype), "g": g.to(gate_dtype) if g is not None else None}
    return {name: (x.to(device) if x is not None else None) for name, x in out.items()}


def mlstm_inputs(
    B: int,
    T: int,
    H: int,
    K: int,
    V: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    gate_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> dict:
    """Random mLSTM inputs: dict with q, k [B, T, H, K], v [B, T, H, V] ~ N(0, 1) in ``dtype`` and the
    gate pre-activations i ~ N(0, 1), f ~ N(3, 1) [B, T, H] (a mostly open forget gate, as xLSTM's
    forget-gate bias initialisation) in ``gate_dtype`` (default: ``dtype``, as mlstm_kernels'
    benchmarks pass them)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    i = torch.randn(B, T, H, generator=gen)
    f = torch.randn(B, T, H, generator=gen) + 3.0
    gd = gate_dtype or dtype
    out = {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype), "i": i.to(gd), "f": f.to(gd)}
    return {name: x.to(device) for name, x in out.items()}


RNN_GATES = {"elman": 1, "lstm": 4, "gru": 3, "slstm": 4}  # gates of tfla's cells (tfla.ops.rnn.reference)


def rnn_inputs(
    cell: str,
    B: int,
    T: int,
    NH: int,
    D: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    layer: bool = False,
    seed: int = 0,
) -> dict:
    """Random inputs for the FlashRNN cells (``tfla.lstm``, ``gru``, ``slstm``, ``elman``) in ``dtype``.

    Default: the op's own, x ``[B, T, G, NH, D]`` ~ N(0, 1) (the pre-activations), R ``[G, NH, D, D]`` ~ N(0, 1 / D)
    and b ``[G, NH, D]`` ~ N(0, 1 / 4). ``layer=True``: what ``torch.nn.LSTM`` / ``nn.GRU`` take for hidden size
    H = NH * D: u ``[B, T, H]`` ~ N(0, 1), W_ih, W_hh ``[G * H, H]`` ~ N(0, 1 / H), b_ih, b_hh ``[G * H]`` ~
    N(0, 1 / 4), so x = u W_ih^T + b_ih ~ N(0, 5 / 4) (with NH = 1 the op's problem for R = W_hh, b = b_hh).
    """
    if cell not in RNN_GATES:
        raise ValueError(f"cell must be one of {tuple(RNN_GATES)}, got {cell!r}")
    G = RNN_GATES[cell]
    gen = torch.Generator().manual_seed(seed)
    if layer:
        H = NH * D
        out = {"u": torch.randn(B, T, H, generator=gen), "W_ih": torch.randn(G * H, H, generator=gen) / H ** 0.5,
               "b_ih": torch.randn(G * H, generator=gen) * 0.5, "W_hh": torch.randn(G * H, H, generator=gen) / H ** 0.5,
               "b_hh": torch.randn(G * H, generator=gen) * 0.5}
    else:
        out = {"x": torch.randn(B, T, G, NH, D, generator=gen), "R": torch.randn(G, NH, D, D, generator=gen) / D ** 0.5,
               "b": torch.randn(G, NH, D, generator=gen) * 0.5}
    return {name: x.to(dtype).to(device) for name, x in out.items()}
