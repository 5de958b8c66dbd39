"""``scripts/memory_peak.py``: the GDN forward + backward's memory on the Hopper path, predicted without a GPU (every
launch a no-op, allocations tracked). The held memory is what the op's README promises per option (issue 24: the
default holds FLA's saved set); the peak's largest buffers are the backward's 64-row states and their gradients."""
import importlib.util
import os

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("memory_peak", os.path.join(ROOT, "scripts", "memory_peak.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _inputs(B, T, H, HV, K, V):
    from tfla.bench.gdn import Workload, workload_inputs

    return workload_inputs(Workload(B, T, H, HV, K, V, "bf16"), "cpu", "default", 0)


@pytest.mark.parametrize("T", [200, 256])
def test_held_memory_per_option(tool, T):
    """Held from forward to backward: the default keeps g's cumsum (fp32) and Tm (64 columns, input dtype) beyond the
    inputs, as FLA does; ``save_v_new`` adds Vnew (v's size); ``save_states`` adds the state before every 64-row
    chunk."""
    B, H, HV, K, V = 2, 2, 4, 128, 128
    x = _inputs(B, T, H, HV, K, V)
    held = {}
    for variant in ("default", "save_v_new", "save_states"):
        with tool.hopper_without_launches():
            held[variant] = tool.measure(x, variant)["held"]
    assert held["default"] == B * T * HV * (4 + 64 * 2)
    assert held["save_v_new"] - held["default"] == B * T * HV * V * 2
    assert held["save_states"] - held["save_v_new"] == B * -(-T // 64) * HV * K * V * 2


def test_peak_buffers_and_slabs(tool):
    """The peak holds the 64-row states and their gradients (``B * ceil(T / 64) * HV * K * V`` each, 16-bit) beside
    dq, dk, dv and Vnew (FLA's saved set: dq in Vnew's buffer); the backward in slabs of 64 chunks (``slab64``: Vnew
    kept; ``slabs2``: FLA's saved set, two slabs) holds one slab's states and gradients at a time (half of them at
    128 chunks) and peaks lower by about that much. Launches restored afterwards."""
    from triton.runtime.jit import JITFunction

    run = JITFunction.run
    B, T, H, K, V = 4, 8192, 16, 128, 128  # the MVE (dense, unsplit: the slabs' path); no values are computed
    x = _inputs(B, T, H, H, K, V)
    state_bytes = B * (T // 64) * H * K * V * 2
    peaks = {}
    for variant in ("whole", "save_v_new", "slab64", "slabs2"):
        with tool.hopper_without_launches():
            r = tool.measure(x, variant)
        peaks[variant] = r["peak"]
        if variant == "whole":
            assert [n for n, _ in r["at_peak"][:2]] == [state_bytes, state_bytes], r["at_peak"][:4]
            assert r["peak"] >= 2 * state_bytes + 4 * B * T * H * V * 2
        if variant.startswith("slab"):
            assert max(n for n, _ in r["at_peak"]) < state_bytes, r["at_peak"][:4]
    # FLA's saved set forms Vnew in the backward and writes dq over it (dq_into_v_new); a kept Vnew stays
    assert peaks["save_v_new"] - peaks["whole"] == B * T * H * V * 2
    # half the states and half their gradients less, the slab starts (fp32, one state per sequence and head) more
    assert peaks["save_v_new"] - peaks["slab64"] >= 0.9 * state_bytes
    # the same with FLA's saved set in two slabs (the slab's pass writes its Vnew rows, dq goes over them)
    assert peaks["whole"] - peaks["slabs2"] >= 0.9 * state_bytes
    assert JITFunction.run is run


def test_cli_prints_a_peak(tool, capsys):
    assert tool.main(["--shape", "1,128,2,2,128,128", "--variants", "default", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "tfla default: peak" in out and "MiB" in out


def test_dq_into_v_new_refuses_what_it_cannot_alias():
    """``gdn_bwd_chunk_ws(dq_into_v_new=True)`` raises before any launch where dq cannot take Vnew's buffer."""
    from tfla.ops.common.chunk_dqkw_ws import gdn_bwd_chunk_ws

    B, T, H, K, V = 1, 64, 1, 128, 64
    e = lambda *s: torch.zeros(*s, dtype=torch.bfloat16)  # noqa: E731
    q, k, v = e(B, T, H, K), e(B, T, H, K), e(B, T, H, V)
    with pytest.raises(ValueError, match="dq_into_v_new"):
        gdn_bwd_chunk_ws(q, k, v, e(B, T, H), e(B, T, H, 64), v.clone(), v, v.clone(), e(B, 1, H, K, V),
                         e(B, 1, H, K, V), torch.zeros(B, T, H), 0.1, dq_into_v_new=True)


@pytest.mark.parametrize("V,l2norm,slab", [(128, True, False), (128, False, True), (64, True, False)])
def test_gva_sum_wiring_on_hopper_path(tool, monkeypatch, V, l2norm, slab):
    """On the Hopper path (launches no-ops) the backward with grouped value heads at K = V = 128 asks the chunk-gradient
    kernel for the sum over each key head's value heads (``gva_sum``, l2norm's backward there too, also per slab) and
    runs no ``group_sum``; at V = 64 it keeps the kernel per value head and ``group_sum`` after it. The gradients of q
    and k have q's and k's shapes either way."""
    import tfla
    import tfla.ops.gated_delta_rule.chunk as ch

    calls = {"ws": [], "group_sum": 0}
    ws, gs = ch.gdn_bwd_chunk_ws, ch.group_sum

    def spy_ws(*a, **k):
        calls["ws"].append((k.get("gva_sum", False), k.get("l2") is not None))
        return ws(*a, **k)

    def spy_gs(*a, **k):
        calls["group_sum"] += 1
        return gs(*a, **k)

    monkeypatch.setattr(ch, "gdn_bwd_chunk_ws", spy_ws)
    monkeypatch.setattr(ch, "group_sum", spy_gs)
    x = _inputs(1, 4096 if slab else 300, 2, 4, 128, V)
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    with tool.hopper_without_launches():
        o, _ = tfla.chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=l2norm, segments=1,
                                           config={"slab": {"count": 2}} if slab else None)
        grads = torch.autograd.grad(o, leaves, torch.zeros_like(o))
    assert [g.shape for g in grads] == [t.shape for t in leaves]
    gva = V == 128
    assert calls["ws"] == [(gva, l2norm and gva)] * (2 if slab else 1), calls  # (gva_sum, l2norm's backward inside)
    assert calls["group_sum"] == (0 if gva else 2)
