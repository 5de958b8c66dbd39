"""tfla.compat.mlstm_kernels: names, keywords, head-first layout and state conventions, tested against a fake
``tfla.chunk_mlstm`` that records its call (so the adapter is checked apart from the kernel)."""
import inspect
import os
import sys

import pytest
import torch

import tfla
from tfla.compat.mlstm_kernels import get_available_mlstm_kernels, get_mlstm_kernel

B, NH, S, DK, DV = 2, 3, 7, 4, 5


class FakeChunkMLSTM:
    """Records the call; returns h and a final state that encode their own positions."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, i, f, **kwargs):
        self.calls.append(dict(q=q, k=k, v=v, i=i, f=f, **kwargs))
        Bq, T, H, K = q.shape
        V = v.shape[-1]
        h = torch.arange(Bq * T * H * V, dtype=q.dtype).reshape(Bq, T, H, V)
        if not kwargs.get("output_final_state"):
            return h, None
        C = torch.arange(Bq * H * K * V, dtype=torch.float32).reshape(Bq, H, K, V)
        n = torch.arange(Bq * H * K, dtype=torch.float32).reshape(Bq, H, K) + 0.5
        m = torch.arange(Bq * H, dtype=torch.float32).reshape(Bq, H) - 3.0
        return h, ((C, n, m) if kwargs["input_gate"] == "exp" else (C, n))


@pytest.fixture
def fake(monkeypatch):
    fn = FakeChunkMLSTM()
    monkeypatch.setattr(tfla, "chunk_mlstm", fn, raising=False)
    return fn


def _head_first_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(B, NH, S, DK, generator=g), "k": torch.randn(B, NH, S, DK, generator=g),
            "v": torch.randn(B, NH, S, DV, generator=g), "i": torch.randn(B, NH, S, generator=g),
            "f": torch.randn(B, NH, S, generator=g)}


def _check_layout(call, x):
    for name in ("q", "k", "v", "i", "f"):
        assert torch.equal(call[name], x[name].transpose(1, 2)), name   # [B, NH, S, ...] -> [B, S, NH, ...]


def _expected_h(x):
    h_tfla, _ = FakeChunkMLSTM()(*(x[n].transpose(1, 2) for n in "qkvif"))
    return h_tfla.transpose(1, 2)


@pytest.mark.parametrize("name,chunk_default", [("chunkwise--triton_xl_chunk", 128),
                                                ("chunkwise--triton_limit_chunk", 64)])
def test_exp_chunkwise_mapping(fake, name, chunk_default):
    x = _head_first_inputs()
    fn = get_mlstm_kernel(name)
    h = fn(**x)
    assert isinstance(h, torch.Tensor) and h.shape == (B, NH, S, DV)
    assert torch.equal(h, _expected_h(x))
    call = fake.calls[-1]
    _check_layout(call, x)
    assert call["input_gate"] == "exp" and call["normalize"] is True and call["eps"] == 1e-6
    assert call["initial_state"] is None and call["output_final_state"] is False
    assert call["chunk_size"] == chunk_default

    c0, n0, m0 = torch.randn(B, NH, DK, DV), torch.randn(B, NH, DK), torch.randn(B, NH, 1)
    h, (c, n, m) = fn(**x, c_initial=c0, n_initial=n0, m_initial=m0, return_last_states=True, eps=1e-3,
                      chunk_size=256)
    call = fake.calls[-1]
    C_in, n_in, m_in = call["initial_state"]
    assert C_in is c0 and n_in is n0 and m_in.shape == (B, NH) and torch.equal(m_in, m0[..., 0])
    assert call["output_final_state"] is True and call["eps"] == 1e-3 and call["chunk_size"] == 256
    C_out, n_out, m_out = FakeChunkMLSTM()(*(x[k_].transpose(1, 2) for k_ in "qkvif"), input_gate="exp",
                                           output_final_state=True)[1]
    assert torch.equal(c, C_out) and torch.equal(n, n_out)
    assert m.shape == (B, NH, 1) and torch.equal(m[..., 0], m_out)              # tfla [N, H] -> (B, NH, 1)
    assert torch.equal(h, _expected_h(x))


def test_exp_m_initial_2d_accepted(fake):
    x = _head_first_inputs()
    m0 = torch.randn(B, NH)
    get_mlstm_kernel("chunkwise--triton_xl_chunk")(**x, c_initial=torch.zeros(B, NH, DK, DV),
                                                   n_initial=torch.zeros(B, NH, DK), m_initial=m0)
    assert fake.calls[-1]["initial_state"][2] is m0


def test_siging_mapping(fake):
    x = _head_first_inputs()
    fn = get_mlstm_kernel("chunkwise--triton_xl_chunk_siging")
    h = fn(**x)
    call = fake.calls[-1]
    _check_layout(call, x)
    assert torch.equal(h, _expected_h(x))
    assert call["input_gate"] == "sigmoid" and call["normalize"] is True and call["chunk_size"] == 128

    c0, n0 = torch.randn(B, NH, DK, DV), torch.randn(B, NH, DK)
    h, last = fn(**x, c_initial=c0, n_initial=n0, m_initial=torch.randn(B, NH, 1), return_last_states=True,
                 normalize=False)
    call = fake.calls[-1]
    assert call["normalize"] is False
    assert len(call["initial_state"]) == 2 and call["initial_state"][0] is c0 and call["initial_state"][1] is n0
    assert len(last) == 2 and last[0].shape == (B, NH, DK, DV) and last[1].shape == (B, NH, DK)


def test_parallel_native_autograd_mapping(fake):
    x = _head_first_inputs()
    fn = get_mlstm_kernel("parallel--native_autograd")
    h = fn(**x, eps=1e-4, chunk_size=32, autocast_kernel_dtype=torch.bfloat16)    # extra keywords ignored
    call = fake.calls[-1]
    _check_layout(call, x)
    assert torch.equal(h, _expected_h(x))
    assert call["input_gate"] == "exp" and call["eps"] == 1e-4 and "chunk_size" not in call
    assert call["output_final_state"] is False and call["initial_state"] is None
    with pytest.raises(ValueError, match="initial states"):
        fn(**x, c_initial=torch.zeros(B, NH, DK, DV))
    with pytest.raises(ValueError, match="last states"):
        fn(**x, return_last_states=True)


def test_tuning_knobs_accepted_and_ignored(fake):
    x = _head_first_inputs()
    get_mlstm_kernel("chunkwise--triton_xl_chunk")(**x, chunk_size_inter=64, chunk_size_intra=128,
                                                   siz_b_L_parallel=64, siz_b_L_loop=64, siz_b_DH_parallel=128,
                                                   siz_b_DH_loop=64, num_warps_intra=4, num_warps_inter=4,
                                                   num_stages_intra=1, num_stages_inter=1)
    call = fake.calls[-1]
    assert set(call) == {"q", "k", "v", "i", "f", "input_gate", "normalize", "eps", "initial_state",
                         "output_final_state", "chunk_size", "detach_normalizer"}
    assert call["detach_normalizer"] is True  # mlstm_kernels' Triton backward convention


@pytest.mark.parametrize("name", ["chunkwise--triton_xl_chunk", "chunkwise--triton_xl_chunk_siging"])
def test_recompute_states_in_bw_maps_to_save_states(fake, name):
    x = _head_first_inputs()
    get_mlstm_kernel(name)(**x, chunk_size=128, recompute_states_in_bw=False)
    call = fake.calls[-1]
    assert call["save_states"] is True and call["chunk_size"] == 64  # tfla's saved states are the 64-row ones
    get_mlstm_kernel(name)(**x, chunk_size=128)
    assert "save_states" not in fake.calls[-1] and fake.calls[-1]["chunk_size"] == 128


def test_input_errors(fake):
    x = _head_first_inputs()
    with pytest.raises(ValueError, match="together"):
        get_mlstm_kernel("chunkwise--triton_xl_chunk")(**x, c_initial=torch.zeros(B, NH, DK, DV))
    with pytest.raises(ValueError, match="together"):
        get_mlstm_kernel("chunkwise--triton_xl_chunk_siging")(**x, n_initial=torch.zeros(B, NH, DK))
    with pytest.raises(ValueError, match="Unsupported kernel dtype"):
        get_mlstm_kernel("chunkwise--triton_limit_chunk")(**x, autocast_kernel_dtype=torch.float64)
    with pytest.raises(TypeError):
        get_mlstm_kernel("chunkwise--triton_limit_chunk")(**x, normalize=False)   # not a keyword there either
    assert not fake.calls


def test_unknown_name_lists_supported():
    with pytest.raises(ValueError) as err:
        get_mlstm_kernel("chunkwise--native_custbw")
    for name in get_available_mlstm_kernels():
        assert name in str(err.value)
    assert set(get_available_mlstm_kernels()) == {
        "chunkwise--triton_xl_chunk", "chunkwise--triton_xl_chunk_siging", "chunkwise--triton_limit_chunk",
        "parallel--native_autograd"}


def test_signatures_match_mlstm_kernels():
    """Same parameter names, order, kinds and defaults as mlstm_kernels 2.0.6 (when unpacked at /tmp/mk)."""
    if not os.path.isdir("/tmp/mk"):
        pytest.skip("mlstm_kernels wheel not unpacked at /tmp/mk")
    if "/tmp/mk" not in sys.path:
        sys.path.insert(0, "/tmp/mk")
    pytest.importorskip("einops")
    mk = pytest.importorskip("mlstm_kernels.torch")
    if "chunkwise--triton_xl_chunk" not in mk.get_available_mlstm_kernels():
        pytest.skip("mlstm_kernels' Triton kernels are not importable here")
    for name in get_available_mlstm_kernels():
        theirs = inspect.signature(mk.get_mlstm_kernel(name)).parameters.values()
        ours = inspect.signature(get_mlstm_kernel(name)).parameters.values()
        assert [(p.name, p.kind, p.default) for p in ours] == [(p.name, p.kind, p.default) for p in theirs], name


@pytest.mark.gpu
def test_autocast_kernel_dtype_casts_inputs_under_cuda_autocast(fake):
    """As mlstm_kernels' custom_fwd(cast_inputs=...): inside CUDA autocast the inputs are cast to
    autocast_kernel_dtype and the op runs with autocast off; initial states keep their dtype."""
    x = {k_: t.cuda() for k_, t in _head_first_inputs().items()}
    c0, n0, m0 = torch.zeros(B, NH, DK, DV).cuda(), torch.zeros(B, NH, DK).cuda(), torch.zeros(B, NH, 1).cuda()
    fn = get_mlstm_kernel("chunkwise--triton_xl_chunk")
    with torch.autocast("cuda", dtype=torch.float16):
        fn(**x, c_initial=c0, n_initial=n0, m_initial=m0, autocast_kernel_dtype=torch.bfloat16)
    call = fake.calls[-1]
    assert all(call[n].dtype == torch.bfloat16 for n in "qkvif")
    assert all(s.dtype == torch.float32 for s in call["initial_state"])
    fn(**x)                                                                      # outside autocast: no cast
    assert all(fake.calls[-1][n].dtype == torch.float32 for n in "qkvif")
