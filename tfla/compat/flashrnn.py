"""FlashRNN 1.0.8's ``flashrnn`` function and ``FlashRNNConfig`` backed by tfla's cells (``tfla.lstm``, ``gru``,
``slstm``, ``elman``), so that code written against FlashRNN runs on tfla by swapping the import:

    from tfla.compat.flashrnn import flashrnn, FlashRNNConfig      # instead of: from flashrnn import ...
    states, last_states = flashrnn(Wx, R, b, states=None, function="lstm", backend="cuda_fused")

Layouts (FlashRNN's defaults; B batch, T time, G gates, NH heads, D head dim, S states):

    Wx [B, T, G, NH, D]       gate pre-activations (the input projection, computed outside)
    R  [G_r, NH, D, D]        recurrent weights, [out, in] per gate and head (as tfla's R)
    b  [G_b, NH, D]
    states [S, B, 1, NH, D]   initial states, h first (None: every state ``config.initial_val``, default 0)
    returns (states [S, B, T, NH, D], last_states [S, B, 1, NH, D]): every state after every step and the last
    one (a view of the first, as FlashRNN's), in Wx's dtype; h over time is ``states[0]``

    function  Wx gates     R gates      b gates                 states        tfla cell
    lstm      i, f, z, o   i, f, z, o   i, f, z, o              h, c          tfla.lstm (same gates)
    slstm     i, f, z, o   i, f, z, o   i, f, z, o              h, c, n, m    tfla.slstm (same gates)
    elman     h            h            h                       h             tfla.elman
    gru       r, z, n      n, r, z      n_h, r, z, n_x (4)      h             tfla.gru (below)

    FlashRNN's GRU: h_t = z h + (1 - z) tanh(Wx_n + n_x + r (R_n h + n_h)), r = sigmoid(Wx_r + R_r h + b_r), z
    likewise; tfla.gru gets R and b reordered to (r, z, n) with b_n = n_h, and n_x added to Wx's n gate (in Wx's
    dtype).

Other layouts through ``config``: ``input_shape`` (a permutation of "BTGHD", e.g. "TBGHD"), ``recurrent_shape``
("GHDP"; P is the input side of R), ``bias_shape`` ("GHD"), ``output_shape`` ("SBTHD", also used for ``states``).

What is honored, and what differs from FlashRNN, on purpose:

- ``function``, the four layouts, ``initial_val`` and (when positive) ``num_heads`` / ``head_dim`` / ``hidden_dim``
  (checked against Wx) are honored; with a ``config`` the ``function`` / ``backend`` / ``dtype`` arguments are
  ignored, as FlashRNN does. A ``config`` may be this module's ``FlashRNNConfig`` or FlashRNN's own (its fields
  are read by name).
- ``backend``: any FlashRNN name ("vanilla", "vanilla_fwbw", "cuda", "cuda_fused", "triton_fused") runs tfla's
  default path (fused, all steps in one launch, for head dims D <= 64; above, the team path: a team of programs per
  head meeting at a grid barrier every step, one launch; ``tfla/ops/rnn/README.md``), for every function
  (FlashRNN's "triton_fused" and "vanilla_fwbw" have lstm and slstm only; its "cuda_fused" runs gru as "cuda").
  Other names raise ValueError.
- ``dtype`` (and ``config.dtype*``, ``batch_size``, ``enable_automatic_mixed_precision``): validated names,
  otherwise not used. tfla reads Wx in its own dtype, computes ``R h``, the gates and the states in fp32 (float64
  for float64 Wx) and returns Wx's dtype; R and b of another dtype than Wx's (or fp32) are cast to Wx's. FlashRNN
  keeps its states in Wx's dtype between steps, so bf16 / fp16 results differ by that rounding.
- ``gradient_recurrent_cut``, ``gradient_recurrent_clipval``, ``forward_clipval`` and non-empty ``constants``
  raise ValueError (not implemented in tfla).
- sLSTM: equal to FlashRNN's CUDA kernels for initial states with n = 0 (the zero state) or n >= 1, and c = 0
  where n = 0 (FlashRNN clamps n to >= 1 and its gates to <= 1, which never binds from such states). Both treat
  the max state m as a constant of the backward: no gradient through m, the initial m's gradient is zero and a
  cotangent of m in ``states`` is ignored.
- T = 0 is allowed (``last_states`` are then the initial states). Under ``torch.compile`` gru and elman trace
  (tfla's custom ops); lstm and slstm, whose c, n, m over time only the eager path returns, run it through a graph
  break (so ``fullgraph=True`` refuses them).

Gradients flow to Wx, R, b and ``states`` from every output. Source: FlashRNN 1.0.8 (``flashrnn/flashrnn.py``,
the ``vanilla`` and ``alternating`` pointwise functions); Pöppel et al. 2024, "FlashRNN", Section 2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

# function -> (gates of Wx, gates of R, gates of b); as FlashRNN's registry (its num_gates_w, _r, _t)
_FUNCTIONS = {"lstm": (4, 4, 4), "slstm": (4, 4, 4), "gru": (3, 3, 4), "elman": (1, 1, 1)}
# the states of each function, in the order of FlashRNN's S axis (tfla's initial_state order too); kept here so that
# importing this module does not import Triton (tfla.ops.rnn.reference.CELL_STATES, through tfla.ops.rnn, would)
STATES = {"lstm": ("h", "c"), "slstm": ("h", "c", "n", "m"), "gru": ("h",), "elman": ("h",)}
BACKENDS = ("vanilla", "vanilla_fwbw", "cuda", "cuda_fused", "triton_fused")
DTYPES = ("bfloat16", "float16", "float32", "float64")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# tfla's layouts (FlashRNN's defaults): Wx, R, b, and states / outputs
_INPUT, _RECURRENT, _BIAS, _OUTPUT = "BTGHD", "GHDP", "GHD", "SBTHD"


@dataclass
class FlashRNNConfig:
    """FlashRNN 1.0.8's ``FlashRNNConfig`` fields and defaults (module docstring: which are honored). As FlashRNN's,
    it fills ``num_heads`` / ``head_dim`` / ``hidden_dim`` from each other and the gate and state counts from
    ``function``; an unknown ``function`` raises ValueError."""

    backend: str = "cuda_fused"
    function: str = "lstm"
    gradient_recurrent_cut: bool = False
    gradient_recurrent_clipval: Optional[float] = None
    forward_clipval: Optional[float] = None
    constants: Optional[dict] = None
    simple_agg: bool = True
    hidden_dim: int = -1
    num_heads: int = -1
    head_dim: int = -1
    num_states: int = 4
    num_gates_r: int = 4
    num_gates_w: int = 4
    num_gates_i: int = 4
    num_gates_t: int = 4
    batch_size: int = 8
    input_shape: str = _INPUT
    output_shape: str = _OUTPUT
    recurrent_shape: str = _RECURRENT
    bias_shape: str = _BIAS
    dtype: str = "bfloat16"
    dtype_acc: Optional[str] = "float32"
    dtype_b: Optional[str] = None
    dtype_r: Optional[str] = None
    dtype_w: Optional[str] = None
    dtype_g: Optional[str] = None
    dtype_s: Optional[str] = None
    dtype_a: Optional[str] = None
    enable_automatic_mixed_precision: bool = True
    trainable_r: Union[list, bool] = True
    trainable_b: Union[list, bool] = True
    initial_val: Union[float, Sequence[float]] = 0.0

    def __post_init__(self):
        if self.function not in _FUNCTIONS:
            raise ValueError(f"`function` must be one of {tuple(_FUNCTIONS)}, got {self.function!r}")
        if self.num_heads <= 0 and self.head_dim <= 0:
            self.num_heads = 1
        if self.num_heads <= 0:
            self.num_heads = self.hidden_dim // self.head_dim
        elif self.head_dim <= 0:
            self.head_dim = self.hidden_dim // self.num_heads
        if self.hidden_dim <= 0:
            self.hidden_dim = self.num_heads * self.head_dim
        self.num_gates_w, self.num_gates_r, self.num_gates_t = _FUNCTIONS[self.function]
        self.num_gates_i = self.num_gates_t
        self.num_states = len(STATES[self.function])
        self.simple_agg = self.function != "gru"


def _to_layout(name: str, t, given: str, want: str) -> torch.Tensor:
    """``t`` (dims named by ``given``) permuted to ``want``; TypeError / ValueError naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(want):
        raise ValueError(f"`{name}` must be {len(want)}-D ({given}), got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"`{name}` dtype must be float16, bfloat16, float32 or float64, got {t.dtype}")
    return t if given == want else t.permute(tuple(given.index(c) for c in want))


def _layout_name(cfg, attr: str, default: str) -> str:
    s = getattr(cfg, attr, default) if cfg is not None else default
    if not isinstance(s, str) or sorted(s) != sorted(default):
        raise ValueError(f"`config.{attr}` must be a permutation of {default!r}, got {s!r}")
    return s


def _check_config(cfg, B: int, NH: int, D: int, check_dims: bool) -> None:
    for attr in ("gradient_recurrent_cut", "gradient_recurrent_clipval", "forward_clipval"):
        if getattr(cfg, attr, None) not in (None, False):
            raise ValueError(f"`config.{attr}` is not supported by tfla (got {getattr(cfg, attr)!r})")
    if getattr(cfg, "constants", None):
        raise ValueError(f"`config.constants` is not supported by tfla (got {cfg.constants!r})")
    for attr, want in (("num_heads", NH), ("head_dim", D), ("hidden_dim", NH * D)) if check_dims else ():
        got = getattr(cfg, attr, -1)
        if isinstance(got, int) and got > 0 and got != want:
            raise ValueError(f"`config.{attr}` is {got} but `Wx` has {want} (NH={NH}, D={D})")


def _initial_states(cfg, S: int, B: int, NH: int, D: int, like: torch.Tensor):
    """The states FlashRNN starts from without ``states``: ``config.initial_val`` per state (None when all 0)."""
    val = getattr(cfg, "initial_val", 0.0)
    vals = [float(val)] * S if isinstance(val, (int, float)) else [float(v) for v in val]
    if len(vals) != S:
        raise ValueError(f"`config.initial_val` must be a float or {S} floats, got {val!r}")
    if not any(vals):
        return None
    return tuple(like.new_full((B, NH, D), v) for v in vals)


def flashrnn(
    Wx: torch.Tensor,
    R: torch.Tensor,
    b: torch.Tensor,
    states: Optional[torch.Tensor] = None,
    function: str = "lstm",
    config: Optional[FlashRNNConfig] = None,
    backend: str = "cuda_fused",
    dtype: str = "bfloat16",
):
    """FlashRNN's ``flashrnn``: runs ``function`` over Wx with recurrent weights R and bias b (layouts, gate
    orders and what is honored: module docstring).

    Args:
        Wx: ``[B, T, G, NH, D]`` pre-activations (float16, bfloat16, float32, float64).
        R: ``[G_r, NH, D, D]``; b: ``[G_b, NH, D]`` (gru: 4 biases); any float dtype.
        states: None or ``[S, B, 1, NH, D]`` initial states (h first), any float dtype.
        function: "lstm", "slstm", "gru" or "elman". backend, dtype: FlashRNN's names (validated, not used).
        config: None, or a FlashRNNConfig (this module's or FlashRNN's); replaces function / backend / dtype.

    Returns:
        ``(states [S, B, T, NH, D], last_states [S, B, 1, NH, D])`` in Wx's dtype (in ``config.output_shape``).

    Raises:
        ValueError: unknown function / backend / dtype / layout, wrong ranks or shapes (naming the argument),
            tensors on different devices, unsupported config options. TypeError: non-tensors, non-float dtypes.
    """
    given = config is not None
    if not given:
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"`dtype` must be one of {DTYPES}, got {dtype!r}")
        config = FlashRNNConfig(function=function, backend=backend, dtype=dtype or "bfloat16")
    function, backend = getattr(config, "function", None), getattr(config, "backend", None)
    if function not in _FUNCTIONS:
        raise ValueError(f"`function` must be one of {tuple(_FUNCTIONS)}, got {function!r}")
    if backend not in BACKENDS:
        raise ValueError(f"Unknown backend {backend!r}: FlashRNN's backends are {BACKENDS}")
    out_shape = _layout_name(config, "output_shape", _OUTPUT)
    x = _to_layout("Wx", Wx, _layout_name(config, "input_shape", _INPUT), _INPUT)
    Rc = _to_layout("R", R, _layout_name(config, "recurrent_shape", _RECURRENT), _RECURRENT)
    bc = _to_layout("b", b, _layout_name(config, "bias_shape", _BIAS), _BIAS)
    Gw, Gr, Gb = _FUNCTIONS[function]
    S = len(STATES[function])
    B, T, G, NH, D = x.shape
    if G != Gw:
        raise ValueError(f"`Wx` must be [B, T, {Gw}, NH, D] for {function} ({Gw} gates), got {tuple(x.shape)} "
                         f"(in the canonical layout {_INPUT})")
    if tuple(Rc.shape) != (Gr, NH, D, D):
        raise ValueError(f"`R` must be [{Gr}, NH, D, D] = {(Gr, NH, D, D)} for {function} and Wx of shape "
                         f"{tuple(x.shape)}, got {tuple(Rc.shape)} (in the canonical layout {_RECURRENT})")
    if tuple(bc.shape) != (Gb, NH, D):
        raise ValueError(f"`b` must be [{Gb}, NH, D] = {(Gb, NH, D)} for {function}"
                         + (" (FlashRNN's GRU has 4 biases: n_h, r, z, n_x)" if function == "gru" else "")
                         + f", got {tuple(bc.shape)} (in the canonical layout {_BIAS})")
    for name, t in (("R", R), ("b", b)):
        if t.device != Wx.device:
            raise ValueError(f"`{name}` is on {t.device} but `Wx` is on {Wx.device}")
    _check_config(config, B, NH, D, given)
    if states is None:
        s0 = _initial_states(config, S, B, NH, D, x)
    else:
        sc = _to_layout("states", states, out_shape, _OUTPUT)
        if tuple(sc.shape) != (S, B, 1, NH, D):
            raise ValueError(f"`states` must be [S, B, 1, NH, D] = {(S, B, 1, NH, D)} for {function} (states "
                             f"{', '.join(STATES[function])}), got {tuple(sc.shape)} (in the canonical layout "
                             f"{_OUTPUT})")
        if states.device != Wx.device:
            raise ValueError(f"`states` is on {states.device} but `Wx` is on {Wx.device}")
        s0 = tuple(sc[k, :, 0] for k in range(S))
    # tfla takes R and b in x's dtype or fp32 (float64 with float64 x)
    Rc, bc = (t if t.dtype == x.dtype or (t.dtype == torch.float32 and x.dtype != torch.float64) else t.to(x.dtype)
              for t in (Rc, bc))
    if function == "gru":  # FlashRNN's (n, r, z) / (n_h, r, z, n_x) to tfla's (r, z, n); n_x joins Wx's n gate
        x = torch.cat([x[:, :, :2], x[:, :, 2:] + bc[3].to(x.dtype)], dim=2)
        Rc, bc = Rc[[1, 2, 0]], bc[[1, 2, 0]]

    if S == 1:
        import tfla  # lazily: tfla.<cell> resolves to the op module on first use

        h, _ = getattr(tfla, function)(x, Rc, bc, s0, False)
        seq = h.unsqueeze(0)
    else:
        from tfla.ops.rnn.cells import rnn_state_sequence

        h, rest = rnn_state_sequence(function, x, Rc, bc, s0)
        seq = torch.cat([h.unsqueeze(0), rest.to(h.dtype)])
    if T > 0:
        last = seq[:, :, -1:]
    elif s0 is None:
        last = seq.new_zeros(S, B, 1, NH, D)
    else:
        last = torch.stack([s.to(seq.dtype) for s in s0]).unsqueeze(2)
    if out_shape != _OUTPUT:
        perm = tuple(_OUTPUT.index(c) for c in out_shape)
        seq, last = seq.permute(perm), last.permute(perm)
    return seq, last
