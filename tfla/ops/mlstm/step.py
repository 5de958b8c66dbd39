"""One step of the mLSTM recurrence: tfla's decoding step, which continues exactly from the final state of
``chunk_mlstm`` (same state layout, same semantics as mlstm_kernels 2.0.6).

Notation: B batch (= N sequences), H heads, K/V head dims, T time.

Exponential input gate (``input_gate="exp"``, TFLA paper Section 2, eqs. (1)-(4); mlstm_kernels
``torch/recurrent/native_step.py``), with stabilized states ``C, n`` and max state ``m``:

    m_t = max(logsigmoid(f_t) + m_{t-1}, i_t)
    C_t = exp(logsigmoid(f_t) + m_{t-1} - m_t) C_{t-1} + exp(i_t - m_t) k_t v_t^T
    n_t = exp(logsigmoid(f_t) + m_{t-1} - m_t) n_{t-1} + exp(i_t - m_t) k_t
    h_t = C_t^T (scale q_t) / (max(|n_t . (scale q_t)|, exp(-m_t)) + eps)

Sigmoid input gate (``input_gate="sigmoid"``, mLSTMsig, Section 4.1 eqs. (13)-(14); mlstm_kernels
``torch/parallel/native_siging/fw.py``), no max state:

    C_t = sigmoid(f_t) C_{t-1} + sigmoid(i_t) k_t v_t^T,    n_t = sigmoid(f_t) n_{t-1} + sigmoid(i_t) k_t
    h_t = C_t^T (scale q_t) / (max(|n_t . (scale q_t)|, 1) + eps)    (normalize=True)
    h_t = C_t^T (scale q_t)                                          (normalize=False)

``n`` is carried with ``normalize=False`` too, so the state is the same whatever ``normalize`` is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

INPUT_GATES = ("exp", "sigmoid")


def check_mlstm_options(input_gate, normalize, eps, scale) -> None:
    """Option checks shared by the mLSTM references, the step and the chunkwise op.

    Raises ValueError for an unknown ``input_gate``, for ``normalize=False`` with ``input_gate="exp"`` (the
    exponential gate's output is only defined with its normalizer, which cancels the max state), and for a
    negative or non-finite ``eps``; TypeError for a non-bool ``normalize`` or non-number ``eps``/``scale``.
    """
    if input_gate not in INPUT_GATES:
        raise ValueError(f"`input_gate` must be one of {INPUT_GATES}, got {input_gate!r}")
    if not isinstance(normalize, bool):
        raise TypeError(f"`normalize` must be a bool, got {type(normalize).__name__}")
    if not normalize and input_gate == "exp":
        raise ValueError("`normalize=False` is only defined for input_gate='sigmoid': the exponential input "
                         "gate needs its normalizer to cancel the max state m")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"`eps` must be a float, got {type(eps).__name__}")
    if not (0.0 <= eps < float("inf")):
        raise ValueError(f"`eps` must be finite and >= 0, got {eps!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"`scale` must be a float or None, got {type(scale).__name__}")


def _check_tensor(name: str, x, shape: tuple, device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"`{name}` must be a floating-point tensor, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"`{name}` must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"`{name}` is on {x.device} but `q` is on {device}")


def check_mlstm_state(state, input_gate: str, N: int, H: int, K: int, V: int, device, name: str = "state"):
    """``state`` must be ``(C [N, H, K, V], n [N, H, K], m [N, H])`` for ``input_gate="exp"`` and
    ``(C, n)`` for ``"sigmoid"``; raises TypeError/ValueError naming the offending member."""
    names = ("C", "n", "m") if input_gate == "exp" else ("C", "n")
    shapes = ((N, H, K, V), (N, H, K), (N, H))
    if not isinstance(state, (tuple, list)) or len(state) != len(names):
        got = f"a {type(state).__name__} of length {len(state)}" if isinstance(state, (tuple, list)) \
            else type(state).__name__
        raise TypeError(f"`{name}` must be a tuple ({', '.join(names)}) for input_gate={input_gate!r}, got {got}")
    for j, (member, shape) in enumerate(zip(names, shapes)):
        _check_tensor(f"{name}[{j}] ({member})", state[j], shape, device)


def mlstm_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    state: tuple[torch.Tensor, ...] | None = None,
    *,
    input_gate: str = "exp",
    normalize: bool = True,
    eps: float = 1e-6,
    scale: float | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One mLSTM time step (recurrence in the module docstring).

    Args:
        q, k: ``[B, H, K]`` query and key of this step; v: ``[B, H, V]``. q, k and v share one float dtype.
        i, f: ``[B, H]`` input and forget gate pre-activations (any float dtype).
        state: ``(C [B, H, K, V], n [B, H, K], m [B, H])`` for ``input_gate="exp"`` (stabilized C and n, max
            state m; a natural-log scale), ``(C, n)`` for ``"sigmoid"``; any float dtype. None: zeros
            (m0 = 0), as mlstm_kernels.
        input_gate: ``"exp"`` (mLSTMexp) or ``"sigmoid"`` (mLSTMsig).
        normalize: divide by the normalizer; False only with ``input_gate="sigmoid"``.
        eps: added to the normalizer's denominator (default 1e-6, as mlstm_kernels).
        scale: query scale, default ``K ** -0.5``.

    Returns:
        ``(h [B, H, V] in v's dtype, new_state)`` with new_state shaped as ``state``. Everything is computed
        in float32 (float64 when q is float64); the new state is returned in that dtype.

    Raises:
        TypeError / ValueError naming the argument for wrong types, shapes, devices or options
        (see ``check_mlstm_options``).

    Source: TFLA paper (Beck et al., 2025) Section 2 eqs. (1)-(4) and Section 4.1 eqs. (13)-(14); numerics as
    mlstm_kernels 2.0.6 ``mlstm_recurrent_step__native_fw`` and the siging parallel kernel.
    """
    check_mlstm_options(input_gate, normalize, eps, scale)
    for name, x in (("q", q), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"`{name}` must be [B, H, {name.upper() if name == 'v' else 'K'}], "
                             f"got shape {tuple(x.shape)}")
    B, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    _check_tensor("q", q, (B, H, K), dev)
    _check_tensor("k", k, (B, H, K), dev)
    _check_tensor("v", v, (B, H, V), dev)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"`{name}` dtype {x.dtype} differs from `q` dtype {q.dtype}; q, k, v must share a dtype")
    _check_tensor("i", i, (B, H), dev)
    _check_tensor("f", f, (B, H), dev)
    if state is not None:
        check_mlstm_state(state, input_gate, B, H, K, V, dev)

    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    if scale is None:
        scale = K ** -0.5
    qs = q.to(dt) * scale                                                     # [B, H, K]
    k_, v_, i_, f_ = k.to(dt), v.to(dt), i.to(dt), f.to(dt)
    if state is None:
        C = q.new_zeros(B, H, K, V, dtype=dt)
        n = q.new_zeros(B, H, K, dtype=dt)
        m = q.new_zeros(B, H, dtype=dt)
    else:
        C, n = state[0].to(dt), state[1].to(dt)
        m = state[2].to(dt) if input_gate == "exp" else None

    if input_gate == "exp":
        logf = F.logsigmoid(f_)
        m_new = torch.maximum(logf + m, i_)                                   # [B, H]
        a_f = torch.exp(logf + m - m_new)
        a_i = torch.exp(i_ - m_new)
    else:
        a_f, a_i = torch.sigmoid(f_), torch.sigmoid(i_)
    C = a_f[..., None, None] * C + a_i[..., None, None] * (k_[..., :, None] * v_[..., None, :])
    n = a_f[..., None] * n + a_i[..., None] * k_
    h = torch.einsum("bhk,bhkv->bhv", qs, C)                                  # [B, H, V]
    if normalize:
        qn = (qs * n).sum(-1).abs()                                           # [B, H]
        lower = torch.exp(-m_new) if input_gate == "exp" else torch.ones_like(qn)
        h = h / (torch.maximum(qn, lower) + eps)[..., None]
    new_state = (C, n, m_new) if input_gate == "exp" else (C, n)
    return h.to(v.dtype), new_state
