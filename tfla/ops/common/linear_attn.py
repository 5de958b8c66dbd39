"""Host orchestration of linear attention on the shared stages (no / constant / scalar decay, split gates, the
normalizer state): the forward and backward that ``chunk_simple_gla``, ``chunk_linear_attn`` and the mLSTM run.

Notation: B batch, T time, H heads, K/V head dims, N sequences, L = chunk_size (outer chunk).
"""
from __future__ import annotations

import torch

from tfla.ops.common.chunk_output import chunk_output_fwd, chunk_tiled, dual_supported, output_config
from tfla.ops.common.chunk_state import chunk_state_fwd, intra_supported
from tfla.ops.common.chunk_state_bwd import chunk_state_bwd
from tfla.ops.common.cumsum import chunk_local_cumsum
from tfla.ops.common.utils import LOG_DECAY_FLOOR, RCP_LN2, SUB_CHUNK
from tfla.ops.common.wy_bwd import wy_bwd


def chunk_simple_gla_fwd(q, k, v, g, scale, initial_state, output_final_state, chunk_size, varlen=None,
                         g_cum=None, gk_cum=None, gb=None, out_dtype=None, n_state=False, initial_n=None,
                         normalizer=None, positive_flag=None, return_states=False):
    """Plain forward: ``(o, final_state, g_cum)``; g is the log decay ``[B, T, H]`` or None.

    Split gates (the mLSTM): pass ``g_cum`` (query-side GQ, log2, restarting every L) with ``gk_cum``
    and ``gb`` instead of ``g`` (see ``chunk_output.chunk_tiled``). ``n_state``: the state kernel also
    carries the normalizer state n (v = 1; start ``initial_n``) and the call returns
    ``(o, final_state, g_cum, den, final_n)``; ``normalizer`` (``dict(lo=, eps=)`` for the mLSTM's
    ``max(|den|, lo) + eps``, ``dict(lo=None, eps=, signed=True)`` for FLA's ``den + eps``; needs ``n_state``)
    divides the output by it in the tiled kernel and ``den`` is its dot (else None). ``positive_flag``:
    a ``PositiveFlag`` that the cumsum kernel raises when any ``g > 0``. ``return_states``: also return the states
    ``h [B, NT, HV, K, V]`` and ``hn`` (or None) last (at L = 64 they are the backward's ``states``)."""
    cu = varlen.cu_seqlens if varlen is not None else None
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if g is not None:
        g_cum = chunk_local_cumsum(g, chunk_size, scale=RCP_LN2, cu_seqlens=cu, out_dtype=acc, floor=LOG_DECAY_FLOOR,
                                   chunk_indices=varlen.chunk_indices if varlen is not None else None,
                                   positive_flag=positive_flag)
    h, final_state, *ns = chunk_state_fwd(
        k, v, g_cum, chunk_size, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu,
        chunk_offsets=varlen.chunk_offsets if varlen is not None else None,
        num_chunks=varlen.num_chunks if varlen is not None else None, gk_cum=gk_cum, gb=gb, n_state=n_state,
        initial_n=initial_n, seq_order=varlen.seq_order if varlen is not None else None)
    hn, final_n = ns if n_state else (None, None)
    ocfg = output_config(chunk_size, q.shape[-1], v.shape[-1])
    o = chunk_output_fwd(q, k, v, h, g_cum, scale, chunk_size, cu_seqlens=cu, out_dtype=out_dtype,
                         tile_indices=varlen.tiles(ocfg["BQ"]) if varlen is not None else None,
                         chunk_offsets=varlen.chunk_offsets if varlen is not None else None, config=ocfg,
                         gk_cum=gk_cum, gb=gb, normalizer=dict(normalizer, hn=hn) if normalizer is not None else None)
    extra = (h, hn) if return_states else ()
    if not n_state:
        return (o, final_state, g_cum) + extra
    o, den = o if normalizer is not None else (o, None)
    return (o, final_state, g_cum, den, final_n) + extra


def chunk_simple_gla_bwd(q, k, v, g_cum, scale, initial_state, do, dht, chunk_size, varlen=None, gk_cum=None,
                         gb=None, dden=None, initial_n=None, dnt=None, kdot=False, need_dg=True, states=None,
                         do_row_log2=None, state_bwd_config=None):
    """Plain backward: ``(dq, dk, dv, dg, dh0)`` (dg None without decay; dq, dk in q's dtype, each rounded once
    from its fp32 sum in the kernel that forms it; dg fp32). ``kdot``: append ``k . dk`` per row ``[B, T, H]``
    fp32 (before rounding). ``need_dg=False`` (a constant decay: ``g_gamma``, retention): dg is None and its
    work is skipped (wy_bwd then reads no states). With split
    gates (``gk_cum``, ``gb``) dg is the gradient of a per-token log decay shared by GQ and GK.

    ``dden [B, T, H]`` fp32 (with ``initial_n [N, H, K]`` or None and ``dnt [N, H, K]`` or None): the
    cotangent of the forward's normalizer dot ``den`` (``chunk_simple_gla_fwd(n_state=True)``), i.e. of
    one more value column of ones, folded into the same kernels (the scores of dq and dk gain ``dden`` per
    row, the states carry n and dn beside S and dS); returns ``(dq, dk, dv, dg, dh0, dn0)`` then.

    ``states``: ``(h, hn)`` from ``chunk_simple_gla_fwd(return_states=True)`` at the same L = 64 (the states every
    64 rows, ``hn`` the normalizer's or None): no recompute. h is overwritten (dS over S): pass it once.

    ``do_row_log2 [B, T, H]`` (g_cum's dtype): the output's cotangent is ``do * 2^do_row_log2`` per row (the mLSTM's
    ``dh / d``). With split gates at L = 64 (the dual dq / dk launch and dvo in the state-gradient recurrence) no
    scaled copy of do is made: the row factor joins the query-side gate of the dq / dk scores and the
    recurrence's query rows (``dden`` enters those scores as ``dden 2^-do_row_log2``); elsewhere do is scaled
    first. ``state_bwd_config``: launch / precision keys of the state-gradient recurrence (``chunk_state_bwd``)."""
    L = chunk_size
    cu = varlen.cu_seqlens if varlen is not None else None
    sub = varlen.sub_indices if varlen is not None else None
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_state = dden is not None
    if states is not None:
        h_sub, hn_sub = states
        if L != SUB_CHUNK or (n_state and hn_sub is None):
            raise ValueError(f"states (the forward's) serve chunk_size={SUB_CHUNK} and, with dden, hold hn")
    else:
        h_sub, _, *ns = chunk_state_fwd(
            k, v, g_cum, L, initial_state=initial_state, cu_seqlens=cu,
            chunk_offsets=varlen.sub_offsets if varlen is not None else None,
            num_chunks=varlen.sub_indices.shape[0] if varlen is not None else None, store_every_sub_chunk=True,
            gk_cum=gk_cum, gb=gb, n_state=n_state, initial_n=initial_n, seq_order=varlen.seq_order if varlen is not None else None)
        hn_sub = ns[0] if n_state else None
    tiled = dict(cu_seqlens=cu, gk_cum=gk_cum, gb=gb)
    if varlen is not None:
        tiled.update(tile_indices=varlen.tiles(output_config(L, q.shape[-1], v.shape[-1])["BQ"]),
                     chunk_offsets=varlen.sub_offsets)
    dual = dual_supported(L, v.shape[-1], q.shape[-1], q.dtype)
    g_rows, row_add = g_cum, dden  # the dq / dk launch's query-side gate and row constant
    if do_row_log2 is not None:
        if tuple(do_row_log2.shape) != tuple(do.shape[:3]):
            raise ValueError(f"do_row_log2 must be [B, T, H] = {tuple(do.shape[:3])}")
        if dual and intra_supported(L) and g_cum is not None and gk_cum is not None:
            # every use of a dO row r in those two kernels carries its query-side gate 2^GQ_r
            g_rows = g_cum + do_row_log2
            row_add = dden * torch.exp2(-do_row_log2) if dden is not None else None
        else:
            do = (do.to(acc) * torch.exp2(do_row_log2.to(acc))[..., None]).to(do.dtype)
            do_row_log2 = None
    # at L = 64 (one diagonal tile per chunk): dvo formed inside the state-gradient recurrence, dq and dk from
    # one tiled launch (the same gated score tile)
    dvo = None if intra_supported(L) else chunk_tiled(k, q, do, g_cum, scale, L, reverse=True, **tiled)
    dq_args = dict(h=h_sub, state_every=SUB_CHUNK, state_transposed=True, rowdot_with=q, out_dtype=q.dtype,
                   row_add=row_add, row_add_n=hn_sub, **tiled)
    if dual:
        dq, dgq, dko, dgk = chunk_tiled(do, v, k, g_rows, scale, L, dual_dtype=k.dtype, **dq_args)
    else:
        dq, dgq = chunk_tiled(do, v, k, g_cum, scale, L, **dq_args)
        dko, dgk = chunk_tiled(v, do, q, g_cum, scale, L, reverse=True, rowdot_with=k, out_dtype=k.dtype, row_add=dden,
                               **tiled)
    # without the delta rule the state-gradient recurrence's dU is the whole gradient of v
    # dS overwrites S in h_sub's buffer (S's last reader, the dq launch, has run); with a gate gradient the
    # recurrence also returns the rows of <S, dS> (S's only use in wy_bwd): one [B, NS, H, K, V] buffer less
    gate_grad = g_cum is not None and need_dg
    dh_sub, dv, dh0, *rest = chunk_state_bwd(
        q, k, None, do, dvo, g_cum, scale, L, dht=dht, need_dh0=initial_state is not None, cu_seqlens=cu,
        sub_offsets=varlen.sub_offsets if varlen is not None else None,
        num_sub_chunks=varlen.sub_indices.shape[0] if varlen is not None else None, gk_cum=gk_cum, gb=gb,
        dden=dden, dnt=dnt, h_sub=h_sub, sds=gate_grad, do_row_log2=do_row_log2, config=state_bwd_config,
        seq_order=varlen.seq_order if varlen is not None else None)
    del dvo  # not needed by wy_bwd: freed before its outputs are allocated (peak memory)
    dhn_sub, dn0 = rest[:2] if n_state else (None, None)
    sds_sub = rest[-1] if gate_grad else None
    # S only where the recurrence did not take <S, dS> (and then dS has a buffer of its own)
    h_sub = h_sub if gate_grad and sds_sub is None else None
    # dk = dko + the state part, added and rounded to k's dtype in wy_bwd
    dk, _, _, dg_sub, *kdk = wy_bwd(k, None, None, g_cum, None, v, None, h_sub, dh_sub, L, cu_seqlens=cu,
                                    sub_indices=sub, gk_cum=gk_cum, gb=gb, hn_sub=hn_sub, dhn_sub=dhn_sub, dk_add=dko,
                                    dk_dtype=k.dtype, kdot=kdot, need_dg=need_dg, sds_sub=sds_sub)
    dg = None
    if g_cum is not None and need_dg:
        dg = chunk_local_cumsum(dgq, L, reverse=True, cu_seqlens=cu, out_dtype=acc, sub=dgk, add=dg_sub,
                                chunk_indices=varlen.chunk_indices if varlen is not None else None)
    return (dq, dk, dv, dg, dh0) + ((dn0,) if n_state else ()) + (tuple(kdk) if kdot else ())
