"""Bad input to tfla.chunk_gated_delta_rule raises ValueError/TypeError naming the argument."""
import pytest
import torch

import tfla
from tfla.bench.inputs import gdn_inputs


@pytest.fixture
def x(device):
    return gdn_inputs(1, 70, 2, 16, 16, HV=4, dtype=torch.float32, device=device, initial_state=True)


def call(x, **over):
    a = {**x, **over}
    kw = {k: a[k] for k in ("initial_state", "cu_seqlens", "scale") if k in a}
    return tfla.chunk_gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], **kw)


def test_valid_call_runs(x):
    o, s = call(x)
    assert o.shape == (1, 70, 4, 16) and s is None


@pytest.mark.parametrize("over, exc, match", [
    (lambda x: {"q": x["q"][0]}, ValueError, "`q` must have 4 dims"),
    (lambda x: {"q": x["q"].numpy() if x["q"].device.type == "cpu" else x["q"].tolist()}, TypeError, "`q` must be a torch.Tensor"),
    (lambda x: {"k": x["k"][:, :, :1]}, ValueError, "`q` and `k` must have the same shape"),
    (lambda x: {"v": x["v"][:, :60]}, ValueError, "`v` must be"),
    (lambda x: {"v": x["v"][:, :, :3], "g": x["g"][:, :, :3], "beta": x["beta"][:, :, :3]}, ValueError, "multiple of the H=2"),
    (lambda x: {"g": x["g"][:, :, :2]}, ValueError, "`g` must have shape"),
    (lambda x: {"beta": x["beta"][..., None]}, ValueError, "`beta` must have 3 dims"),
    (lambda x: {"k": x["k"].double()}, TypeError, "`k` dtype"),
    (lambda x: {"v": x["v"].half()}, TypeError, "`v` dtype"),
    (lambda x: {"g": x["g"].half()}, TypeError, "`g` dtype"),
    (lambda x: {n: x[n].to(torch.float8_e4m3fn) for n in ("q", "k", "v")}, TypeError, "`q` dtype"),
    (lambda x: {n: x[n].double() for n in ("q", "k", "v")}, TypeError, "`g` must be float64 when q is float64"),
    (lambda x: {"q": x["q"].long()}, TypeError, "`q` must be a floating-point"),
    (lambda x: {"initial_state": x["initial_state"][:, :2]}, ValueError, "`initial_state` must have shape"),
    (lambda x: {"initial_state": x["initial_state"].long()}, TypeError, "`initial_state` must be floating"),
    (lambda x: {"scale": "0.5"}, TypeError, "`scale`"),
])
def test_bad_input(x, over, exc, match):
    with pytest.raises(exc, match=match):
        call(x, **over(x))


def test_head_dim_above_256(device):
    y = gdn_inputs(1, 8, 1, 264, 16, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="head dims must be in"):
        call(y)
    y = gdn_inputs(1, 8, 1, 16, 300, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="V=300"):
        call(y)


def test_cu_seqlens_errors(x, device):
    cu = torch.tensor([0, 30, 70], device=device)
    h0 = x["initial_state"][:1].expand(2, -1, -1, -1).contiguous()
    o, _ = call(x, cu_seqlens=cu, initial_state=h0)  # valid
    assert o.shape == (1, 70, 4, 16)
    with pytest.raises(ValueError, match="end at T=70"):
        call(x, cu_seqlens=torch.tensor([0, 30, 60], device=device), initial_state=h0)
    with pytest.raises(ValueError, match="start at 0"):
        call(x, cu_seqlens=torch.tensor([5, 30, 70], device=device), initial_state=h0)
    with pytest.raises(ValueError, match="non-decreasing"):
        call(x, cu_seqlens=torch.tensor([0, 50, 40, 70], device=device), initial_state=None)
    with pytest.raises(TypeError, match="`cu_seqlens` must be a 1-D int"):
        call(x, cu_seqlens=torch.tensor([0.0, 70.0], device=device), initial_state=None)
    with pytest.raises(ValueError, match="batch size must be 1"):
        y = gdn_inputs(2, 70, 2, 16, 16, HV=4, dtype=torch.float32, device=device)
        call(y, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"`initial_state` must have shape \[N, HV, K, V\] = \(2,"):
        call(x, cu_seqlens=cu)  # N = 2 sequences but one initial state


def test_wrong_device_without_interpreter(x, monkeypatch):
    if x["q"].device.type != "cpu":
        pytest.skip("CPU tensors are the unsupported case; here inputs are on the GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        call(x)


def test_zero_length_sequence_in_varlen(device):
    y = gdn_inputs(1, 40, 1, 16, 16, dtype=torch.float32, device=device, initial_state=True, num_seqs=3)
    cu = torch.tensor([0, 20, 20, 40], device=device)
    o, s = tfla.chunk_gated_delta_rule(y["q"], y["k"], y["v"], y["g"], y["beta"], initial_state=y["initial_state"],
                                       output_final_state=True, cu_seqlens=cu)
    assert torch.equal(s[1], y["initial_state"][1].float())  # an empty sequence keeps its state
    assert torch.isfinite(o).all()


def test_bfloat16_on_the_interpreter_raises(device):
    """bfloat16 CPU tensors raise ValueError under Triton's interpreter (its bfloat16 products come out overflowed),
    for the chunked ops, the decode op and the RNN cells alike; on CUDA they run."""
    if device != "cpu":
        pytest.skip("the interpreter runs on the CPU")
    q = torch.randn(1, 10, 1, 16).bfloat16()
    g = torch.zeros(1, 10, 1)
    beta = torch.rand(1, 10, 1).bfloat16()
    with pytest.raises(ValueError, match="bfloat16 on the CPU"):
        tfla.chunk_gated_delta_rule(q, q, q, g, beta)
    with pytest.raises(ValueError, match="bfloat16 on the CPU"):
        tfla.fused_recurrent_gated_delta_rule(q, q, q, g=g, beta=beta)
    with pytest.raises(ValueError, match="bfloat16 on the CPU"):
        tfla.chunk_simple_gla(q, q, q, g=g)
    x = torch.randn(2, 5, 4, 1, 16).bfloat16()
    with pytest.raises(ValueError, match="bfloat16 on the CPU"):
        tfla.lstm(x, torch.randn(4, 1, 16, 16).bfloat16(), torch.zeros(4, 1, 16).bfloat16())
    # float16 runs there
    o, _ = tfla.chunk_simple_gla(q.half(), q.half(), q.half(), g=g)
    assert o.dtype == torch.float16 and torch.isfinite(o).all()
