"""mlstm_kernels 2.0.6 kernel names backed by ``tfla.chunk_mlstm``.

``get_mlstm_kernel(name)`` returns a function with the keyword names, defaults, head-first layout and return
convention of the mlstm_kernels function of that name, so that code written against
``mlstm_kernels.torch.get_mlstm_kernel`` (e.g. xLSTM's ``mLSTMBackend``) runs on tfla by swapping the import:

    q, k: [B, NH, S, DHQK]   v: [B, NH, S, DHHV]   i, f: [B, NH, S]   (gate pre-activations)
    c_initial [B, NH, DHQK, DHHV], n_initial [B, NH, DHQK], m_initial [B, NH, 1]
    returns h [B, NH, S, DHHV], or (h, (c, n, m)) with return_last_states (m [B, NH, 1]; (c, n) for siging)

Only the layout is converted (tfla: ``[B, T, H, D]`` and m ``[N, H]``); h comes back as a transposed view.
What differs from mlstm_kernels, all on purpose:

- Block-size / warp / stage knobs (``chunk_size_inter``, ``siz_b_*``, ``num_warps_*``, ``num_stages_*``) are
  accepted and ignored: tfla picks its own tiles. ``chunk_size`` is passed on (tfla accepts 64, 128, 256, 512)
  and S need not be a multiple of it (mlstm_kernels asserts that it is). ``recompute_states_in_bw=False``
  becomes tfla's ``save_states=True`` (the forward's states kept for the backward), whose forward runs at
  ``chunk_size=64`` whatever was asked (its states are the backward's 64-row ones).
- ``autocast_kernel_dtype``: as mlstm_kernels' ``custom_fwd(cast_inputs=...)``, inside a CUDA autocast region
  q, k, v, i, f are cast to it and tfla runs with autocast off; outside autocast it has no effect. Initial
  states keep their dtype (mlstm_kernels casts them too, and loads them back as float32).
- ``parallel--native_autograd`` is computed by the chunkwise op. mlstm_kernels' parallel form stabilizes
  with the row max of D only, without the m0 = 0 term of its own recurrence; tfla follows the recurrence,
  so outputs differ in the ``eps`` term only: by at most about ``eps`` relative, where an input gate
  pre-activation is below the forget gates' cumulative log (e.g. ~4e-9 for N(0, 9) input gates).
  Its ``**kwargs`` are ignored, ``chunk_size`` included (tfla's default is used).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _to_tfla(x: torch.Tensor) -> torch.Tensor:
    """[B, NH, S, ...] -> [B, S, NH, ...] (a view)."""
    return x.transpose(1, 2)


def _run(q, k, v, i, f, initial_state, return_last_states, eps, chunk_size, autocast_kernel_dtype,
         input_gate, normalize=True, detach_normalizer=True, save_states=False):
    """``detach_normalizer``: mlstm_kernels' Triton backward treats the normalizer and the max state as
    constants (TFLA paper, Appendix B.3), so its chunkwise names do here too; its parallel
    native_autograd kernel differentiates through them (exact gradient)."""
    import tfla  # lazily: tfla.chunk_mlstm resolves to the op module on first use

    if autocast_kernel_dtype not in _KERNEL_DTYPES:
        raise ValueError(f"Unsupported kernel dtype {autocast_kernel_dtype}.")
    call = {"input_gate": input_gate, "normalize": normalize, "eps": eps, "initial_state": initial_state,
            "output_final_state": return_last_states, "detach_normalizer": detach_normalizer}
    if chunk_size is not None:
        call["chunk_size"] = chunk_size
    if save_states:
        call.update(save_states=True, chunk_size=64)
    inputs = [q, k, v, i, f]
    if torch.is_autocast_enabled("cuda"):
        inputs = [x.to(autocast_kernel_dtype) if x.is_floating_point() and x.is_cuda and x.dtype != torch.float64
                  else x for x in inputs]
        with torch.autocast("cuda", enabled=False):
            h, final = tfla.chunk_mlstm(*map(_to_tfla, inputs), **call)
    else:
        h, final = tfla.chunk_mlstm(*map(_to_tfla, inputs), **call)
    h = h.transpose(1, 2)
    if not return_last_states:
        return h
    if input_gate == "exp":
        c, n, m = final
        return h, (c, n, m[..., None])
    c, n = final
    return h, (c, n)


def _exp_initial_state(c_initial, n_initial, m_initial):
    given = [x is not None for x in (c_initial, n_initial, m_initial)]
    if not any(given):
        return None
    if not all(given):
        raise ValueError("`c_initial`, `n_initial` and `m_initial` must be given together (or none of them)")
    if m_initial.dim() == 3 and m_initial.shape[-1] == 1:
        m_initial = m_initial[..., 0]                                         # [B, NH, 1] -> [B, NH]
    return (c_initial, n_initial, m_initial)


def mlstm_chunkwise__xl_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    c_initial: torch.Tensor = None,
    n_initial: torch.Tensor = None,
    m_initial: torch.Tensor = None,
    return_last_states: bool = False,
    eps: float = 1e-6,
    chunk_size: int = 128,
    chunk_size_inter: int | None = None,
    chunk_size_intra: int | None = None,
    siz_b_L_parallel: int | None = None,
    siz_b_L_loop: int | None = None,
    siz_b_DH_parallel: int | None = None,
    siz_b_DH_loop: int | None = None,
    num_warps_intra: int | None = None,
    num_warps_inter: int | None = None,
    num_stages_intra: int | None = None,
    num_stages_inter: int | None = None,
    recompute_states_in_bw: bool = True,
    autocast_kernel_dtype: torch.dtype = torch.float32,
):
    """``chunkwise--triton_xl_chunk``: mLSTM with exponential input gate (module docstring for layout)."""
    return _run(q, k, v, i, f, _exp_initial_state(c_initial, n_initial, m_initial), return_last_states, eps,
                chunk_size, autocast_kernel_dtype, "exp", save_states=not recompute_states_in_bw)


def mlstm_siging_chunkwise__xl_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    c_initial: torch.Tensor = None,
    n_initial: torch.Tensor = None,
    m_initial: torch.Tensor = None,
    return_last_states: bool = False,
    eps: float = 1e-6,
    normalize: bool = True,
    chunk_size: int = 128,
    chunk_size_inter: int | None = None,
    chunk_size_intra: int | None = None,
    siz_b_L_parallel: int | None = None,
    siz_b_L_loop: int | None = None,
    siz_b_DH_parallel: int | None = None,
    siz_b_DH_loop: int | None = None,
    num_warps_intra: int | None = None,
    num_warps_inter: int | None = None,
    num_stages_intra: int | None = None,
    num_stages_inter: int | None = None,
    recompute_states_in_bw: bool = True,
    autocast_kernel_dtype: torch.dtype = torch.float32,
):
    """``chunkwise--triton_xl_chunk_siging``: mLSTM with sigmoid input gate; the state is ``(c, n)`` and
    ``m_initial`` is ignored (a placeholder in mlstm_kernels too)."""
    if (c_initial is None) != (n_initial is None):
        raise ValueError("`c_initial` and `n_initial` must be given together (or neither)")
    initial_state = (c_initial, n_initial) if c_initial is not None else None
    return _run(q, k, v, i, f, initial_state, return_last_states, eps, chunk_size, autocast_kernel_dtype,
                "sigmoid", normalize, save_states=not recompute_states_in_bw)


def mlstm_chunkwise__limit_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    c_initial: torch.Tensor = None,
    n_initial: torch.Tensor = None,
    m_initial: torch.Tensor = None,
    return_last_states: bool = False,
    eps: float = 1e-6,
    chunk_size: int = 64,
    autocast_kernel_dtype: torch.dtype = torch.float32,
):
    """``chunkwise--triton_limit_chunk``: mLSTM with exponential input gate, mlstm_kernels' default chunk 64."""
    return _run(q, k, v, i, f, _exp_initial_state(c_initial, n_initial, m_initial), return_last_states, eps,
                chunk_size, autocast_kernel_dtype, "exp")


def mlstm_parallel__native_autograd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    c_initial: torch.Tensor = None,
    n_initial: torch.Tensor = None,
    m_initial: torch.Tensor = None,
    return_last_states: bool = False,
    eps: float = 1e-6,
    **kwargs,
) -> torch.Tensor:
    """``parallel--native_autograd``: h only; like mlstm_kernels, initial states and ``return_last_states``
    are refused (ValueError) and other keywords ignored."""
    if c_initial is not None or n_initial is not None or m_initial is not None:
        raise ValueError("parallel--native_autograd does not take initial states (as mlstm_kernels); "
                         "use a chunkwise kernel")
    if return_last_states:
        raise ValueError("parallel--native_autograd does not return last states (as mlstm_kernels); "
                         "use a chunkwise kernel")
    return _run(q, k, v, i, f, None, False, eps, None, torch.float32, "exp", detach_normalizer=False)


_KERNELS: dict[str, Callable] = {
    "chunkwise--triton_xl_chunk": mlstm_chunkwise__xl_chunk,
    "chunkwise--triton_xl_chunk_siging": mlstm_siging_chunkwise__xl_chunk,
    "chunkwise--triton_limit_chunk": mlstm_chunkwise__limit_chunk,
    "parallel--native_autograd": mlstm_parallel__native_autograd,
}


def get_available_mlstm_kernels() -> list[str]:
    """The mlstm_kernels names that tfla provides."""
    return list(_KERNELS)


def get_mlstm_kernel(name: str) -> Callable:
    """The function for an mlstm_kernels kernel ``name`` ("<module>--<backend>"); ValueError for other names."""
    if name not in _KERNELS:
        raise ValueError(f"Unknown or unsupported mlstm kernel {name!r}; tfla provides {list(_KERNELS)}")
    return _KERNELS[name]
