"""tfla.fused_recurrent_gated_delta_rule (Gated DeltaNet decode) against the float64 step-by-step recurrence
``recurrent_gated_delta_rule_ref``: dense and varlen (empty and one-token sequences), GVA, initial / final / V-first
states, FLA's gate, beta and l2norm options, the state pool of vLLM / SGLang (padding slots, speculative slots with
``num_accepted_tokens``, in place), a chunked prefill continued by decode steps, and bad input."""
import pytest
import torch
import torch.nn.functional as F

import tfla
from tfla.bench.inputs import as_reference, gdn_inputs
from tfla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd, launch_config
from tfla.ops.gated_delta_rule.reference import recurrent_gated_delta_rule_ref
from tfla.utils.testing import assert_rel_close, tolerance

TOL = tolerance(torch.float32)


def _ref(x, **kw):
    r = as_reference(x)
    g = r["g"] if r.get("g") is not None else torch.zeros_like(r["beta"])
    return recurrent_gated_delta_rule_ref(r["q"], r["k"], r["v"], g, r["beta"], **kw)


def _inputs(B, T, H, K, V, HV=None, dtype=torch.float32, device="cpu", h0=True, N=None, seed=0):
    return gdn_inputs(B, T, H, K, V, HV=HV, dtype=dtype, device=device, initial_state=h0, num_seqs=N, seed=seed,
                      gate_dtype=torch.float64 if dtype == torch.float64 else torch.float32)


@pytest.mark.parametrize("B, T, H, HV, K, V, h0, dtype", [
    (2, 1, 2, 2, 16, 16, True, torch.float32),     # one decode step
    (2, 7, 2, 4, 16, 24, True, torch.float32),     # several tokens, GVA, V not a power of two
    (1, 5, 1, 3, 20, 12, False, torch.float32),    # K not a power of two, no initial state
    (2, 3, 1, 2, 16, 16, True, torch.float16),
    (1, 4, 2, 2, 16, 16, True, torch.float64),
])
def test_vs_reference(device, poison_empty, B, T, H, HV, K, V, h0, dtype):
    if dtype == torch.float64 and device == "cuda":
        pytest.skip("float64 is the interpreter's verification dtype (no CUDA tolerance in TOLERANCES)")
    x = _inputs(B, T, H, K, V, HV=HV, dtype=dtype, device=device, h0=h0, seed=1)
    o, s = tfla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], beta=x["beta"],
                                                 initial_state=x["initial_state"], output_final_state=True)
    ro, rs = _ref(x, initial_state=as_reference(x)["initial_state"], output_final_state=True)
    assert o.dtype == dtype and s.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = tolerance(dtype)
    assert_rel_close("o", o, ro, tol)
    assert_rel_close("final_state", s, rs, tol)
    o2, s2 = tfla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], beta=x["beta"],
                                                   initial_state=x["initial_state"])
    assert s2 is None
    if device == "cpu":
        assert torch.equal(o2, o)
    else:  # the kernel without the final-state store compiles differently (H100: not bitwise equal at fp32)
        assert_rel_close("o without the final state", o2, o.double(), tol)


def test_varlen_empty_and_one_token_sequences(device, poison_empty):
    cu = torch.tensor([0, 0, 1, 4, 4, 9], device=device)  # lengths 0, 1, 3, 0, 5
    x = _inputs(1, 9, 2, 16, 16, HV=4, device=device, N=5, seed=2)
    o, s = tfla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], beta=x["beta"], cu_seqlens=cu,
                                                 initial_state=x["initial_state"], output_final_state=True)
    ro, rs = _ref(x, initial_state=as_reference(x)["initial_state"], output_final_state=True, cu_seqlens=cu)
    assert_rel_close("o", o, ro, TOL)
    assert_rel_close("final_state", s, rs, TOL)
    assert torch.equal(s[0], x["initial_state"][0]) and torch.equal(s[3], x["initial_state"][3])


def test_state_v_first(device):
    x = _inputs(2, 3, 1, 16, 24, HV=2, device=device, seed=3)
    h0_vk = x["initial_state"].transpose(-1, -2).contiguous()  # [N, HV, V, K]
    o, s = tfla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], beta=x["beta"],
                                                 initial_state=h0_vk, output_final_state=True, state_v_first=True)
    ro, rs = _ref(x, initial_state=as_reference(x)["initial_state"], output_final_state=True)
    assert s.shape == (2, 2, 24, 16)
    assert_rel_close("o", o, ro, TOL)
    assert_rel_close("final_state", s, rs.transpose(-1, -2), TOL)
    o2, s2 = tfla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], beta=x["beta"],
                                                   initial_state=h0_vk, output_final_state=True, state_v_first=True,
                                                   config={"BV": 32, "num_warps": 2})  # one value tile
    assert_rel_close("o (BV 32)", o2, ro, TOL)
    assert_rel_close("final_state (BV 32)", s2, rs.transpose(-1, -2), TOL)


def test_launch_config_by_batch():
    """32-column tiles on 2 warps once the batch fills two programs per SM at that width, else FLA's 8 on one."""
    assert launch_config(128, None, pairs=64 * 32, sms=132) == {"BV": 32, "num_warps": 2}
    assert launch_config(128, None, pairs=66, sms=132) == {"BV": 32, "num_warps": 2}  # 66 x 4 tiles = 2 x 132
    assert launch_config(128, None, pairs=65, sms=132) == {"BV": 8, "num_warps": 1}
    assert launch_config(16, None, pairs=10_000, sms=132)["BV"] == 16
    assert launch_config(128, {"BV": 16}, pairs=64 * 32, sms=132) == {"BV": 16, "num_warps": 2}


def test_wide_tiles_at_a_large_batch(device):
    """A batch that takes the 32-column tiles by default (34 sequences x 2 heads x 4 tiles >= 2 x 132 programs)
    against the float64 recurrence and against FLA's 8-column tiles."""
    x = _inputs(34, 2, 1, 16, 128, HV=2, device=device, seed=4)
    kw = dict(beta=x["beta"], initial_state=x["initial_state"], output_final_state=True)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if x["q"].is_cuda else 132
    if 34 * 2 * 4 < 2 * sms:
        pytest.skip("this device has too many SMs for the batch to take the wide tiles")
    o, s = tfla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], **kw)
    o8, s8 = tfla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], config={"BV": 8, "num_warps": 1},
                                                   **kw)
    ro, rs = _ref(x, initial_state=as_reference(x)["initial_state"], output_final_state=True)
    assert_rel_close("o", o, ro, TOL)
    assert_rel_close("final_state", s, rs, TOL)
    assert_rel_close("o vs 8 columns", o, o8, TOL)
    assert_rel_close("final_state vs 8 columns", s, s8, TOL)


def test_no_gate_and_default_beta(device):
    x = _inputs(2, 4, 2, 16, 16, device=device, seed=4)
    o, s = tfla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], beta=x["beta"],
                                                 initial_state=x["initial_state"], output_final_state=True)
    ro, rs = _ref({**x, "g": None}, initial_state=as_reference(x)["initial_state"], output_final_state=True)
    assert_rel_close("o", o, ro, TOL)
    assert_rel_close("final_state", s, rs, TOL)
    o1, _ = tfla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"])  # beta None: ones (as FLA)
    ro1, _ = _ref({**x, "beta": torch.ones_like(x["beta"])})
    assert_rel_close("o (beta None)", o1, ro1, TOL)


def test_l2norm_and_gate_options(device):
    x = _inputs(1, 6, 2, 16, 16, HV=4, device=device, seed=5)
    gen = torch.Generator().manual_seed(6)
    g_raw, beta_raw = torch.randn(1, 6, 4, generator=gen), torch.randn(1, 6, 4, generator=gen)
    A_log, dt_bias = torch.randn(4, generator=gen) * 0.5, torch.randn(4, generator=gen)
    q, k = x["q"] * 3, x["k"] * 0.5  # not unit norm
    o, s = tfla.fused_recurrent_gated_delta_rule(
        q, k, x["v"], g_raw.to(device), beta=beta_raw.to(device), initial_state=x["initial_state"],
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log.to(device),
        dt_bias=dt_bias.to(device), use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    g = -A_log.double().exp() * F.softplus(g_raw.double() + dt_bias.double())
    beta = 2 * torch.sigmoid(beta_raw.double())
    r = as_reference(x)
    ro, rs = recurrent_gated_delta_rule_ref(q.double(), k.double(), r["v"], g.to(device), beta.to(device),
                                            initial_state=r["initial_state"], output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    assert_rel_close("o", o, ro, TOL)
    assert_rel_close("final_state", s, rs, TOL)


def _pool(slots, HV, K, V, device, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, HV, K, V, generator=gen) * 0.5).to(device)


@pytest.mark.parametrize("v_first", [False, True])
def test_state_pool_padding_inplace(device, poison_empty, v_first):
    """Three one-token sequences (B = 3, T = 1) reading slots 3, padding and 0 of a 6-slot pool."""
    x = _inputs(3, 1, 1, 16, 16, HV=2, device=device, h0=False, seed=8)
    pool = _pool(6, 2, 16, 16, device)
    idx = torch.tensor([3, -1, 0], dtype=torch.int32, device=device)
    ro, rs = _ref(x, initial_state=pool[[3, 0, 0]].double(), output_final_state=True)
    live = [0, 2]
    args = (x["q"], x["k"], x["v"], x["g"])
    p_user = pool.transpose(-1, -2).contiguous() if v_first else pool.clone()
    o, s = tfla.fused_recurrent_gated_delta_rule(*args, beta=x["beta"], initial_state=p_user, output_final_state=True,
                                                 ssm_state_indices=idx, state_v_first=v_first)
    assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.equal(s[1], torch.zeros_like(s[1]))
    assert_rel_close("o", o[live], ro[live], TOL)
    assert_rel_close("final_state", s[live], (rs.transpose(-1, -2) if v_first else rs)[live], TOL)
    # in place: slots 3 and 0 hold the final states, every other slot untouched
    o2, s2 = tfla.fused_recurrent_gated_delta_rule(*args, beta=x["beta"], initial_state=p_user,
                                                   ssm_state_indices=idx, inplace_final_state=True,
                                                   state_v_first=v_first)
    assert s2 is p_user and torch.equal(o2, o)
    got = p_user.transpose(-1, -2) if v_first else p_user
    assert_rel_close("slot 3", got[3], rs[0], TOL)
    assert_rel_close("slot 0", got[0], rs[2], TOL)
    for j in (1, 2, 4, 5):
        assert torch.equal(got[j], pool[j]), j


def test_speculative_slots(device, poison_empty):
    """Speculative decode: 4 packed sequences of 3, 1, 2 and 2 tokens, S = 3 slots each; sequence n starts from slot
    idx[n, num_accepted[n] - 1] and writes the state after its token t to idx[n, t] (skipped where < 0); the fourth
    starts from a padding slot."""
    HV, K, V = 2, 16, 16
    cu = torch.tensor([0, 3, 4, 6, 8], device=device)
    x = _inputs(1, 8, 1, K, V, HV=HV, device=device, h0=False, seed=9)
    pool = _pool(16, HV, K, V, device)
    idx = torch.tensor([[1, 2, 3], [4, -1, 5], [6, -1, 7], [-1, 8, 9]], device=device)
    acc = torch.tensor([2, 1, 3, 1], dtype=torch.int32, device=device)
    starts = [2, 4, 7, -1]  # idx[n, acc[n] - 1]
    p = pool.clone()
    o, s = tfla.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], beta=x["beta"], initial_state=p,
                                                 cu_seqlens=cu, ssm_state_indices=idx, num_accepted_tokens=acc,
                                                 inplace_final_state=True)
    assert s is p
    r = as_reference(x)
    written = set()
    for n, (bos, eos) in enumerate(((0, 3), (3, 4), (4, 6), (6, 8))):
        if starts[n] < 0:
            assert torch.equal(o[:, bos:eos], torch.zeros_like(o[:, bos:eos])), n
            continue
        for t in range(eos - bos):  # the state after token t of sequence n, and its output
            sl = slice(bos, bos + t + 1)
            ro, rs = recurrent_gated_delta_rule_ref(r["q"][:, sl], r["k"][:, sl], r["v"][:, sl], r["g"][:, sl],
                                                    r["beta"][:, sl], initial_state=pool[starts[n]][None].double(),
                                                    output_final_state=True)
            assert_rel_close(f"o[{n}, {t}]", o[:, bos + t], ro[:, -1], TOL)
            w = int(idx[n, t])
            if w >= 0:
                assert_rel_close(f"slot {w}", p[w], rs[0], TOL)
                written.add(w)
    assert written == {1, 2, 3, 4, 6}
    for j in set(range(16)) - written:
        assert torch.equal(p[j], pool[j]), j


def test_kernel_clamps_device_values(device):
    """Values the public op would reject on the host, given to the plain forward: num_accepted_tokens outside
    [1, S] is clamped into the columns, a slot past the pool is padding, and nothing outside the pool is written."""
    x = _inputs(3, 2, 1, 16, 16, HV=2, device=device, h0=False, seed=10)
    pool = _pool(8, 2, 16, 16, device)
    idx = torch.tensor([[1, 2], [3, 4], [9, 5]], device=device)  # 9: past the 8 slots
    acc = torch.tensor([0, 7, 1], device=device)  # columns -1 and 6: clamped to 0 and 1
    big = torch.cat([pool, torch.full_like(pool[:2], 7.0)])  # two guard slots after the pool
    p = big[:8]
    o, _ = fused_recurrent_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 16 ** -0.5, p,
                                                ssm_state_indices=idx, num_accepted_tokens=acc,
                                                inplace_final_state=True, config={"flat": True})
    assert torch.equal(big[8:], torch.full_like(pool[:2], 7.0)) and torch.equal(o[2], torch.zeros_like(o[2]))
    r = as_reference(x)
    for n, start in ((0, 1), (1, 4)):
        ro, rs = recurrent_gated_delta_rule_ref(r["q"][n:n + 1], r["k"][n:n + 1], r["v"][n:n + 1], r["g"][n:n + 1],
                                                r["beta"][n:n + 1], initial_state=pool[start][None].double(),
                                                output_final_state=True)
        assert_rel_close(f"o[{n}]", o[n:n + 1], ro, TOL)
        assert_rel_close(f"slot {int(idx[n, 1])}", p[idx[n, 1]], rs[0], TOL)
    assert torch.equal(p[[0, 5, 6, 7]], pool[[0, 5, 6, 7]])


def test_chunked_prefill_then_decode(device):
    """Prefill with tfla.chunk_gated_delta_rule, then decode steps with this op from its final state: equal to one
    chunked call over the whole sequence."""
    T0, steps = 70, 3
    x = _inputs(2, T0 + steps, 1, 16, 16, HV=2, device=device, seed=11)
    full_o, full_s = tfla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                 initial_state=x["initial_state"], output_final_state=True)
    o, s = tfla.chunk_gated_delta_rule(*(x[n][:, :T0] for n in ("q", "k", "v", "g", "beta")),
                                       initial_state=x["initial_state"], output_final_state=True)
    outs = [o]
    for t in range(T0, T0 + steps):
        o_t, s = tfla.fused_recurrent_gated_delta_rule(*(x[n][:, t:t + 1] for n in ("q", "k", "v", "g")),
                                                       beta=x["beta"][:, t:t + 1], initial_state=s,
                                                       output_final_state=True)
        outs.append(o_t)
    assert_rel_close("o", torch.cat(outs, 1), full_o, TOL)
    assert_rel_close("final_state", s, full_s, TOL)


def test_forward_only(device):
    x = _inputs(1, 2, 1, 16, 16, device=device, seed=12)
    q = x["q"].clone().requires_grad_()
    o, _ = tfla.fused_recurrent_gated_delta_rule(q, x["k"], x["v"], x["g"], beta=x["beta"])
    with pytest.raises(NotImplementedError, match="forward-only"):
        o.sum().backward()


def _bad_calls(device):
    x = _inputs(2, 3, 1, 16, 16, HV=2, device=device, seed=13)
    q, k, v, g, beta, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    pool = _pool(4, 2, 16, 16, device)
    i32 = dict(dtype=torch.int32, device=device)
    base = dict(q=q, k=k, v=v, g=g, beta=beta)
    # the value checks of index tensors (range of ssm_state_indices, num_accepted_tokens, cu_seqlens' end) run only on
    # host tensors: on the device the op never reads them back (documented as unchecked: clamped or skipped)
    return [
        (dict(base, gk=g), ValueError, "gk"),
        (dict(base, k=k[..., :8]), ValueError, "k"),
        (dict(base, v=v.half()), TypeError, "v"),
        (dict(base, g=g[:, :2]), ValueError, "g"),
        (dict(base, beta=beta.double()), TypeError, "beta"),
        (dict(base, initial_state=h0[:1]), ValueError, "initial_state"),
        (dict(base, inplace_final_state=True), ValueError, "inplace_final_state"),
        (dict(base, g=None, use_gate_in_kernel=True, A_log=torch.zeros(2, device=device)), ValueError, "g"),
        (dict(base, initial_state=pool, ssm_state_indices=torch.tensor([0, 4], **i32)), ValueError,
         "ssm_state_indices", "host"),
        (dict(base, initial_state=pool, ssm_state_indices=torch.tensor([0, 1, 2], **i32)), ValueError,
         "ssm_state_indices"),
        (dict(base, initial_state=pool, ssm_state_indices=torch.tensor([0., 1.], device=device)), TypeError,
         "ssm_state_indices"),
        (dict(base, initial_state=pool, ssm_state_indices=torch.tensor([[0, 1], [2, 3], [1, 2]], **i32)), ValueError,
         "ssm_state_indices"),
        (dict(base, initial_state=pool, ssm_state_indices=torch.zeros(2, 0, **i32)), ValueError, "ssm_state_indices"),
        (dict(base, initial_state=pool, ssm_state_indices=torch.zeros(2, 1, 1, **i32)), ValueError,
         "ssm_state_indices"),
        (dict(base, ssm_state_indices=torch.tensor([0, 1], **i32)), ValueError, "ssm_state_indices"),
        (dict(base, initial_state=pool, ssm_state_indices=torch.tensor([[0, 1], [2, 3]], **i32),
              num_accepted_tokens=torch.tensor([1, 1, 1], **i32)), ValueError, "num_accepted_tokens"),
        (dict(base, initial_state=pool, ssm_state_indices=torch.tensor([[0, 1], [2, 3]], **i32),
              num_accepted_tokens=torch.tensor([[1], [1]], **i32)), ValueError, "num_accepted_tokens"),
        (dict(base, initial_state=pool, ssm_state_indices=torch.tensor([[0, 1], [2, 3]], **i32),
              num_accepted_tokens=torch.tensor([1., 1.], device=device)), TypeError, "num_accepted_tokens"),
        (dict(base, initial_state=pool, ssm_state_indices=torch.tensor([[0, 1], [2, 3]], **i32),
              num_accepted_tokens=torch.tensor([1, 3], **i32)), ValueError, "num_accepted_tokens", "host"),
        (dict(base, initial_state=pool, ssm_state_indices=torch.tensor([[0, 1], [2, 3]], **i32),
              num_accepted_tokens=torch.tensor([0, 1], **i32)), ValueError, "num_accepted_tokens", "host"),
        (dict(base, num_accepted_tokens=torch.tensor([1, 1], **i32)), ValueError, "num_accepted_tokens"),
        (dict(base, cu_seqlens=torch.tensor([0, 3], device=device)), ValueError, "cu_seqlens"),
        (dict(base, q=q[:1], k=k[:1], v=v[:1], g=g[:1], beta=beta[:1], cu_seqlens=torch.tensor([0, 2], device=device)),
         ValueError, "cu_seqlens", "host"),
        (dict(base, config={"BK": 16}), ValueError, "config"),
        (dict(base, config={"BV": 12}), ValueError, "config"),
        (dict(base, allow_neg_eigval=True), ValueError, "allow_neg_eigval"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls("cpu"))))
def test_bad_input(device, case):
    kwargs, err, name, *host = _bad_calls(device)[case]
    if host and device != "cpu":
        pytest.skip("a value check of a device index tensor: unchecked on the device by design (never read back)")
    with pytest.raises(err, match=name):
        tfla.fused_recurrent_gated_delta_rule(**kwargs)


@pytest.mark.gpu
def test_cuda_graph_decode_with_pool():
    """A decode step with a state pool captured in a CUDA graph and replayed on new inputs equals eager calls."""
    dev = "cuda"
    N, HV, K, V = 4, 4, 128, 128
    pool = _pool(8, HV, K, V, dev)
    idx = torch.tensor([5, -1, 2, 7], dtype=torch.int32, device=dev)
    x = _inputs(N, 1, 2, K, V, HV=HV, dtype=torch.bfloat16, device=dev, h0=False, seed=14)
    args = [x[n].clone() for n in ("q", "k", "v", "g", "beta")]

    def step():
        return tfla.fused_recurrent_gated_delta_rule(*args[:4], beta=args[4], initial_state=p_graph,
                                                     ssm_state_indices=idx, inplace_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)[0]

    p_graph = pool.clone()
    step()  # warm-up (compiles)
    p_graph.copy_(pool)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph = step()
    p_graph.copy_(pool)
    y = _inputs(N, 1, 2, K, V, HV=HV, dtype=torch.bfloat16, device=dev, h0=False, seed=15)
    for a, n in zip(args, ("q", "k", "v", "g", "beta")):
        a.copy_(y[n])
    graph.replay()
    torch.cuda.synchronize()
    p_eager = pool.clone()
    o_eager, _ = tfla.fused_recurrent_gated_delta_rule(y["q"], y["k"], y["v"], y["g"], beta=y["beta"],
                                                       initial_state=p_eager, ssm_state_indices=idx,
                                                       inplace_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(o_graph, o_eager) and torch.equal(p_graph, p_eager)
