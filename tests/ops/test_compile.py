"""``torch.compile(fullgraph=True)`` traces tfla's chunked Gated DeltaNet forward and backward without graph breaks
(custom ops, ``tfla/ops/gated_delta_rule/library.py``) and gives eager's results; ``backend="eager"`` runs on the CPU
interpreter (CI), inductor on the GPU."""
import pytest
import torch
import torch._dynamo.testing

import tfla
from tfla.bench.inputs import gdn_inputs
from tfla.utils.testing import assert_rel_close, tolerance

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _run(fn, x, cu=None, dynamic_dim=None, **kw):
    leaves = [x[n].clone().requires_grad_() for n in NAMES]
    if dynamic_dim is not None:  # on the tensors the call gets (a clone does not keep the mark)
        for t in leaves[:5]:
            torch._dynamo.mark_dynamic(t, dynamic_dim)
    o, s = fn(*leaves, cu, **kw)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen).to(o)
    dht = torch.randn(s.shape, generator=gen).to(s)
    grads = torch.autograd.grad((o * do).sum() + (s * dht).sum(), leaves)
    return (o, s) + grads


def _check_compiled(device, fn, run, label):
    """``run(fn)`` and ``run(torch.compile(fn, fullgraph=True))`` give the same tensors; on the CPU one frame
    (no graph break) through a counting backend, inductor on the GPU."""
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(fn, fullgraph=True, backend=counter if device == "cpu" else "inductor")
    want, got = run(fn), run(compiled)
    if device == "cpu":
        assert counter.frame_count == 1
    for j, (a, b) in enumerate(zip(got, want)):
        assert_rel_close(f"{label}[{j}]", a.detach().cpu(), b.detach().cpu().double(), tolerance(torch.float32))


def _gdn(q, k, v, g, beta, h0, cu, **kw):
    return tfla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                       **kw)


@pytest.mark.parametrize("varlen,kw", [
    (False, {}),
    (True, {}),
    (False, dict(use_qk_l2norm_in_kernel=True)),
    (True, dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)),
])
def test_gdn_fullgraph_equals_eager(device, varlen, kw):
    T = 150
    cu = torch.tensor([0, 1, 64, 64, T], device=device) if varlen else None
    x = gdn_inputs(1, T, 1, 16, 16, HV=2, dtype=torch.float32, device=device, initial_state=True,
                   num_seqs=4 if varlen else None, seed=3)
    if not varlen:
        x["initial_state"] = x["initial_state"][:1]
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(_gdn, fullgraph=True, backend=counter if device == "cpu" else "inductor")
    want = _run(_gdn, x, cu, **kw)
    got = _run(compiled, x, cu, **kw)
    if device == "cpu":
        assert counter.frame_count == 1
    for name, a, b in zip(("o", "final_state") + NAMES, got, want):
        assert_rel_close(name, a.detach().cpu(), b.detach().cpu().double(), tolerance(torch.float32))


def test_gdn_compiled_with_dynamic_length_does_not_recompile(device):
    """A length marked dynamic compiles once for several lengths (T not a multiple of 64 included)."""
    torch._dynamo.reset()  # what earlier tests in this process compiled must not count
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(_gdn, fullgraph=True, backend=counter)
    for T in (70, 129, 200):
        x = gdn_inputs(1, T, 1, 16, 16, dtype=torch.float32, device=device, initial_state=True, seed=T)
        got = _run(compiled, x, dynamic_dim=1)
        want = _run(_gdn, x)
        for name, a, b in zip(("o", "final_state") + NAMES, got, want):
            assert_rel_close(name, a.detach().cpu(), b.detach().cpu().double(), tolerance(torch.float32))
    assert counter.frame_count == 1


# the other families with a length marked dynamic: (op over q, k, v, g, gk, i, f, beta of one length, trained)
_DYNAMIC_LENGTH = {
    "simple_gla": (lambda q, k, v, g, gk, i, f, beta: tfla.chunk_simple_gla(q, k, v, g, output_final_state=True), True),
    "linear_attn": (lambda q, k, v, g, gk, i, f, beta: tfla.chunk_linear_attn(q, k, v, output_final_state=True), True),
    "gla": (lambda q, k, v, g, gk, i, f, beta: tfla.chunk_gla(q, k, v, gk, output_final_state=True), True),
    "mlstm": (lambda q, k, v, g, gk, i, f, beta: tfla.chunk_mlstm(q, k, v, i, f, output_final_state=True), True),
    "gdn_decode": (lambda q, k, v, g, gk, i, f, beta: tfla.fused_recurrent_gated_delta_rule(
        q, k, v, g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True), False),
    "simple_gla_decode": (lambda q, k, v, g, gk, i, f, beta: tfla.fused_recurrent_simple_gla(
        q, k, v, g, output_final_state=True), False),
}


def _flat(out):
    """The tensors of an op's ``(o, state)`` or ``(o, (state parts))`` in order (None dropped)."""
    return tuple(t for x in out for t in (x if isinstance(x, tuple) else (x,)) if t is not None)


@pytest.mark.parametrize("name", sorted(_DYNAMIC_LENGTH))
def test_compiled_with_dynamic_length_does_not_recompile_per_family(device, name):
    """The linear-attention family, GLA, the mLSTM and the decode ops with the length marked dynamic compile once
    for several lengths (T not a multiple of 64 included); outputs, final states and (chunked ops) every gradient
    equal eager's."""
    torch._dynamo.reset()  # what earlier tests in this process compiled must not count
    fn, trained = _DYNAMIC_LENGTH[name]
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    H, K = 2, 16
    for T in (70, 129, 200):
        gen = torch.Generator().manual_seed(T)
        q, k = ((torch.nn.functional.elu(torch.randn(1, T, H, K, generator=gen)) + 1).to(device) for _ in range(2))
        v = torch.randn(1, T, H, K, generator=gen).to(device)
        g, gk = (-torch.rand(1, T, H, generator=gen)).to(device), (-torch.rand(1, T, H, K, generator=gen)).to(device)
        i, f = torch.randn(1, T, H, generator=gen).to(device), (torch.randn(1, T, H, generator=gen) + 2).to(device)
        beta = torch.rand(1, T, H, generator=gen).to(device)

        def run(f_, mark):
            leaves = [t.clone().requires_grad_(trained) for t in (q, k, v, g, gk, i, f, beta)]
            if mark:  # on the tensors the call gets (a clone does not keep the mark)
                for t in leaves:
                    torch._dynamo.mark_dynamic(t, 1)
            with torch.set_grad_enabled(trained):
                out = _flat(f_(*leaves))
            if not trained:
                return out
            grads = torch.autograd.grad(sum((o * o).sum() for o in out), leaves, allow_unused=True)
            return out + tuple(d for d in grads if d is not None)

        got, want = run(compiled, True), run(fn, False)
        assert len(got) == len(want)
        for j, (a, b) in enumerate(zip(got, want)):
            assert_rel_close(f"{name}[{j}] T={T}", a.detach().cpu(), b.detach().cpu().double(),
                             tolerance(torch.float32))
    assert counter.frame_count == 1


def test_gdn_compiled_forward_without_grad(device):
    """Under no_grad the compiled forward keeps nothing for a backward and matches eager."""
    x = gdn_inputs(1, 100, 1, 16, 16, dtype=torch.float32, device=device, initial_state=True, seed=5)
    compiled = torch.compile(_gdn, fullgraph=True, backend="eager")
    with torch.no_grad():
        got = compiled(*(x[n] for n in NAMES), None)
        want = _gdn(*(x[n] for n in NAMES), None)
    for name, a, b in zip(("o", "final_state"), got, want):
        assert_rel_close(name, a.cpu(), b.cpu().double(), tolerance(torch.float32))


def test_gdn_compiled_varlen_forward_under_capture(device, monkeypatch):
    """The compiled varlen forward without gradients under CUDA-graph capture (forced here; what a compile with CUDA
    graphs records): the custom op builds its tables on the device, reads no offsets back, and equals eager."""
    import tfla.ops.common.varlen as varlen

    T = 150
    x = gdn_inputs(1, T, 1, 16, 16, HV=2, dtype=torch.float32, device=device, initial_state=True, num_seqs=4, seed=5)
    cu = torch.tensor([0, 1, 64, 64, T], device=device)
    compiled = torch.compile(_gdn, fullgraph=True, backend="eager")
    with torch.no_grad():
        want = _gdn(*(x[n] for n in NAMES), cu)
        monkeypatch.setattr(varlen, "_capturing", lambda: True)
        monkeypatch.setattr(varlen, "cached_bounds", lambda *a: pytest.fail("offsets read under capture"))
        got = compiled(*(x[n] for n in NAMES), cu)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_gdn_compiled_bad_input_raises_as_eager(device):
    """Bad shapes raise eager's ValueError through a compiled call; with ``fullgraph=True`` Dynamo reports it as its
    own error carrying the same message."""
    x = gdn_inputs(1, 64, 1, 16, 16, dtype=torch.float32, device=device)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"][:, :10], None, None)
    with pytest.raises(ValueError, match="`beta` must have shape") as eager:
        _gdn(*args)
    with pytest.raises(ValueError, match="`beta` must have shape"):
        torch.compile(_gdn, backend="eager")(*args)
    with pytest.raises(Exception) as full:
        torch.compile(_gdn, fullgraph=True, backend="eager")(*args)
    assert "`beta` must have shape" in str(full.value) and str(eager.value).split(" = ")[0] in str(full.value)


@pytest.mark.parametrize("case", ["rows", "columns", "accepted", "slot_value", "accepted_value"])
def test_decode_compiled_bad_shapes_raise_as_eager(device, case):
    """Index tensors whose shapes the fake implementation could not use, and host index tensors with values out of
    range (a slot past the pool, an accepted count outside ``[1, S]``: checked in the custom op's body, which runs on
    the real tensors), raise eager's ValueError through a compiled call (with ``fullgraph=True`` as Dynamo's own
    error carrying the same message)."""
    torch._dynamo.reset()  # a compiled `decode` of an earlier case (same code, other closure) must not be reused
    x = gdn_inputs(2, 3, 1, 16, 16, HV=2, dtype=torch.float32, device=device, seed=14)
    pool = torch.zeros(4, 2, 16, 16, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    idx, acc, match = {
        "rows": (torch.tensor([[0, 1], [2, 3], [1, 2]], **i32), None, "`ssm_state_indices` must have shape"),
        "columns": (torch.zeros(2, 0, **i32), None, "`ssm_state_indices` must have shape"),
        "accepted": (torch.tensor([[0, 1], [2, 3]], **i32), torch.tensor([1, 2, 1], **i32),
                     "`num_accepted_tokens` must have shape"),
        "slot_value": (torch.tensor([[0, 1], [2, 4]], **i32), None, "`ssm_state_indices` must be < the 4 slots"),
        "accepted_value": (torch.tensor([[0, 1], [2, 3]], **i32), torch.tensor([1, 3], **i32),
                           r"`num_accepted_tokens` must lie in \[1, 2\]"),
    }[case]
    if device != "cpu" and case.endswith("_value"):
        pytest.skip("values of device index tensors are not read back (documented as unchecked)")

    def decode(q, k, v, g, beta):
        return tfla.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=pool, ssm_state_indices=idx,
                                                     num_accepted_tokens=acc, inplace_final_state=True)

    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match=match) as eager:
        decode(*args)
    with pytest.raises(ValueError, match=match):
        torch.compile(decode, backend="eager")(*args)
    with pytest.raises(Exception) as full:
        torch.compile(decode, fullgraph=True, backend="eager")(*args)
    assert str(eager.value) in str(full.value)


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_decode_fullgraph_equals_eager(device, v_first, inplace):
    """The decode op with a state pool (speculative slots, padding, varlen) compiles without graph breaks; outputs,
    the final state and the pool written in place equal eager's."""
    HV, K, V = 2, 16, 16
    cu = torch.tensor([0, 3, 4, 6], device=device)
    x = gdn_inputs(1, 6, 1, K, V, HV=HV, dtype=torch.float32, device=device, seed=11)
    gen = torch.Generator().manual_seed(2)
    pool = torch.randn(8, HV, V, K, generator=gen).to(device) if v_first else \
        torch.randn(8, HV, K, V, generator=gen).to(device)
    idx = torch.tensor([[1, 2, 3], [4, -1, 5], [-1, 6, 7]], device=device)
    acc = torch.tensor([2, 1, 3], dtype=torch.int32, device=device)

    def decode(q, k, v, g, beta, p):
        return tfla.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=p, cu_seqlens=cu,
                                                     ssm_state_indices=idx, num_accepted_tokens=acc,
                                                     output_final_state=not inplace, inplace_final_state=inplace,
                                                     state_v_first=v_first)

    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(decode, fullgraph=True, backend=counter if device == "cpu" else "inductor")
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    p_eager, p_comp = pool.clone(), pool.clone()
    o_e, s_e = decode(*args, p_eager)
    o_c, s_c = compiled(*args, p_comp)
    if device == "cpu":
        assert counter.frame_count == 1
    assert_rel_close("o", o_c.cpu(), o_e.cpu().double(), tolerance(torch.float32))
    assert_rel_close("final_state / pool", s_c.cpu(), s_e.cpu().double(), tolerance(torch.float32))
    if inplace:
        assert torch.equal(p_comp, p_eager) and not torch.equal(p_comp, pool)


def _la_ops(device):
    H = 2
    gamma = -torch.rand(H, generator=torch.Generator().manual_seed(4)).to(device)
    return {
        "simple_gla": lambda q, k, v, g, h0, cu: tfla.chunk_simple_gla(q, k, v, g, initial_state=h0,
                                                                      output_final_state=True, cu_seqlens=cu),
        "simple_gla_g_gamma": lambda q, k, v, g, h0, cu: tfla.chunk_simple_gla(
            q, k, v, g_gamma=gamma, initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=128),
        "retention": lambda q, k, v, g, h0, cu: tfla.chunk_retention(q, k, v, initial_state=h0,
                                                                     output_final_state=True, cu_seqlens=cu),
        "linear_attn": lambda q, k, v, g, h0, cu: tfla.chunk_linear_attn(q, k, v, initial_state=h0,
                                                                         output_final_state=True, normalize=False,
                                                                         cu_seqlens=cu),
        "lightning_attn": lambda q, k, v, g, h0, cu: tfla.chunk_lightning_attn(
            q, k, v, 1, 4, initial_state=h0, output_final_state=True, cu_seqlens=cu),
    }


@pytest.mark.parametrize("name", ["simple_gla", "simple_gla_g_gamma", "retention", "linear_attn", "lightning_attn"])
@pytest.mark.parametrize("varlen", [False, True])
def test_linear_attention_fullgraph_equals_eager(device, name, varlen):
    """The linear-attention family (one pair of custom ops under them all) compiles without graph breaks; outputs,
    final state and every gradient equal eager's."""
    T, H = 130, 2
    cu = torch.tensor([0, 1, 70, T], device=device) if varlen else None
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, T, H, 16, generator=gen).to(device) for _ in range(3))
    g = (-torch.rand(1, T, H, generator=gen)).to(device)
    h0 = torch.randn(3 if varlen else 1, H, 16, 16, generator=gen).to(device)
    fn = _la_ops(device)[name]
    uses_g = name == "simple_gla"

    def run(f):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, h0)]
        o, s = f(*leaves[:4], leaves[4], cu)
        loss = (o * o).sum() + s.sum()
        grads = torch.autograd.grad(loss, [t for i, t in enumerate(leaves) if i != 3 or uses_g])
        return (o, s) + grads

    _check_compiled(device, fn, run, name)


@pytest.mark.parametrize("varlen,init", [(False, "tuple"), (True, "tuple"), (False, "z"), (True, "kv")])
def test_linear_attn_normalized_fullgraph_equals_eager(device, varlen, init):
    """``chunk_linear_attn(normalize=True)`` (its own pair of custom ops: the key sum and the division in the kernels)
    compiles without graph breaks; o, final S, z_state and the gradients of q, k, v and each initial-state part given
    ((S_0, z_0), (None, z_0), a plain S_0) equal eager's."""
    T, H, K = 130, 2, 16
    cu = torch.tensor([0, 1, 70, T], device=device) if varlen else None
    N = 3 if varlen else 1
    gen = torch.Generator().manual_seed(10)
    q, k = ((torch.nn.functional.elu(torch.randn(1, T, H, K, generator=gen)) + 1).to(device) for _ in range(2))
    v = torch.randn(1, T, H, K, generator=gen).to(device)
    h0 = torch.randn(N, H, K, K, generator=gen).to(device)
    z0 = torch.rand(N, 1, H, K, generator=gen).to(device)
    parts = {"tuple": [h0, z0], "z": [z0], "kv": [h0]}[init]

    def fn(q, k, v, *st):
        state = {"tuple": lambda: tuple(st), "z": lambda: (None, st[0]), "kv": lambda: st[0]}[init]()
        return tfla.chunk_linear_attn(q, k, v, initial_state=state, output_final_state=True, cu_seqlens=cu)

    def run(f):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, *parts)]
        o, (s, z) = f(*leaves)
        loss = (o * o).sum() + s.sum() + (z * z).sum()
        return (o, s, z) + torch.autograd.grad(loss, leaves)

    _check_compiled(device, fn, run, "linear_attn_normalized")


@pytest.mark.parametrize("varlen", [False, True])
def test_gla_fullgraph_equals_eager(device, varlen):
    """``chunk_gla`` (vector decay) compiles without graph breaks; outputs and gradients equal eager's."""
    T, H, K = 130, 2, 16
    cu = torch.tensor([0, 1, 70, T], device=device) if varlen else None
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, T, H, K, generator=gen).to(device) for _ in range(3))
    g = (-torch.rand(1, T, H, K, generator=gen)).to(device)
    h0 = torch.randn(3 if varlen else 1, H, K, K, generator=gen).to(device)

    def fn(q, k, v, g, h0):
        return tfla.chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu)

    def run(f):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, h0)]
        o, s = f(*leaves)
        return (o, s) + torch.autograd.grad((o * o).sum() + s.sum(), leaves)

    _check_compiled(device, fn, run, "gla")


@pytest.mark.parametrize("input_gate,varlen,detach", [("exp", False, False), ("exp", True, False),
                                                      ("sigmoid", False, False), ("exp", False, True)])
def test_mlstm_fullgraph_equals_eager(device, input_gate, varlen, detach):
    """``chunk_mlstm`` (both input gates, initial and final states, varlen, the detached normalizer) compiles without
    graph breaks; outputs, final states and every gradient equal eager's."""
    T, H, K, V = 130, 2, 16, 32
    cu = torch.tensor([0, 1, 70, T], device=device) if varlen else None
    N = 3 if varlen else 1
    gen = torch.Generator().manual_seed(9)
    q, k = (torch.randn(1, T, H, K, generator=gen).to(device) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen).to(device)
    i, f = torch.randn(1, T, H, generator=gen).to(device), (torch.randn(1, T, H, generator=gen) + 2).to(device)
    state = [torch.randn(N, H, K, V, generator=gen).to(device), torch.rand(N, H, K, generator=gen).to(device)]
    if input_gate == "exp":
        state.append(torch.randn(N, H, generator=gen).to(device))

    def fn(q, k, v, i, f, *st):
        return tfla.chunk_mlstm(q, k, v, i, f, input_gate=input_gate, initial_state=tuple(st),
                                output_final_state=True, cu_seqlens=cu, detach_normalizer=detach)

    def run(fn_):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, i, f, *state)]
        h, fin = fn_(*leaves)
        loss = (h * h).sum() + sum(x.sum() for x in fin)
        return (h, *fin) + torch.autograd.grad(loss, leaves)

    _check_compiled(device, fn, run, "mlstm")


@pytest.mark.parametrize("input_gate", ["exp", "sigmoid"])
def test_mlstm_step_fullgraph_equals_eager(device, input_gate):
    """``mlstm_step`` (PyTorch ops, no custom op) traces whole: one frame, h and the new state equal eager's, from a
    given state and from none."""
    B, H, K, V = 3, 2, 16, 32
    gen = torch.Generator().manual_seed(13)
    q, k = (torch.randn(B, H, K, generator=gen).to(device) for _ in range(2))
    v = torch.randn(B, H, V, generator=gen).to(device)
    i, f = torch.randn(B, H, generator=gen).to(device), (torch.randn(B, H, generator=gen) + 2).to(device)
    state = [torch.randn(B, H, K, V, generator=gen).to(device), torch.rand(B, H, K, generator=gen).to(device)]
    if input_gate == "exp":
        state.append(torch.randn(B, H, generator=gen).to(device))

    def fn(q, k, v, i, f, *st):
        h, new = tfla.mlstm_step(q, k, v, i, f, tuple(st) if st else None, input_gate=input_gate)
        return (h, *new)

    for st in (state, []):
        _check_compiled(device, fn, lambda f_: f_(q, k, v, i, f, *st), f"mlstm_step_{input_gate}")


def _opcheck_cases(device):
    """(op, args) for every custom op, small fp32 inputs (varlen where the op takes it)."""
    from tfla.ops.gated_delta_rule import library as gdn
    from tfla.ops.gla.library import gla_fwd
    from tfla.ops.mlstm.library import mlstm_fwd
    from tfla.ops.simple_gla.library import linear_attn_fwd, simple_gla_fwd
    from tfla.ops.common.l2norm import _l2norm_fwd_op
    from tfla.ops.rnn.library import rnn_fwd_op
    from tfla.ops.simple_gla.library import fused_recurrent_fwd as fused_recurrent_simple_gla_op

    x = gdn_inputs(1, 70, 1, 16, 16, HV=2, dtype=torch.float32, device=device, initial_state=True, num_seqs=2,
                   seed=1)
    cu = torch.tensor([0, 20, 70], device=device)
    q, k, v, g, beta, h0 = (x[n] for n in NAMES)
    gen = torch.Generator().manual_seed(0)
    v1 = torch.randn(1, 70, 1, 16, generator=gen).to(device)
    h1 = torch.randn(2, 1, 16, 16, generator=gen).to(device)
    g1 = -torch.rand(1, 70, 1, generator=gen).to(device)
    gk = -torch.rand(1, 70, 1, 16, generator=gen).to(device)
    i, f = torch.randn(1, 70, 1, generator=gen).to(device), torch.randn(1, 70, 1, generator=gen).to(device)
    n0, m0 = torch.rand(2, 1, 16, generator=gen).to(device), torch.randn(2, 1, generator=gen).to(device)
    idx = torch.tensor([1, -1], device=device)
    pool = torch.randn(3, 2, 16, 16, generator=gen).to(device)
    return {
        "gdn": (gdn.chunk_gdn_fwd, (q, k, v, g, beta, h0, cu, 0.25, True, True)),
        "gdn_decode": (gdn.fused_recurrent_fwd, (q[:, :2], k[:, :2], v[:, :2], g[:, :2], beta[:, :2], pool, None, idx,
                                                None, 0.25, True, False)),
        "gdn_decode_inplace": (gdn.fused_recurrent_inplace, (q[:, :2], k[:, :2], v[:, :2], g[:, :2], beta[:, :2],
                                                            pool.clone(), None, idx, None, 0.25, False)),
        "l2norm": (_l2norm_fwd_op, (q, 1e-6)),
        "simple_gla": (simple_gla_fwd, (q, k, v1, g1, h1, cu, 0.25, 64, True)),
        "linear_attn_normalized": (linear_attn_fwd, (q.abs(), k.abs(), v1, h1, n0[:, None], cu, 0.25, 64, True)),
        "gla": (gla_fwd, (q, k, v1, gk, h1, cu, 0.25, 64, True, True, 32, 0)),
        "mlstm": (mlstm_fwd, (q, k, v1, i, f, h1, n0, m0, cu, "exp", True, 1e-6, 0.25, 64, True, True, False)),
        "simple_gla_decode": (fused_recurrent_simple_gla_op, (q[:, :3], k[:, :3], v1[:, :3], g1[:, :3], None, 0.25, h1,
                                                              True, True, torch.tensor([0, 1, 3], device=device))),
        "rnn": (rnn_fwd_op, (torch.randn(1, 9, 4, 2, 8, generator=gen).to(device),
                             torch.randn(4, 2, 8, 8, generator=gen).to(device) * 0.3,
                             torch.randn(4, 2, 8, generator=gen).to(device),
                             [torch.randn(2, 2, 8, generator=gen).to(device) for _ in range(2)],
                             torch.tensor([0, 3, 9], device=device), "lstm", True, '{"path": "auto"}')),
    }


@pytest.mark.parametrize("name", ["gdn", "gdn_decode", "gdn_decode_inplace", "l2norm", "simple_gla",
                                  "linear_attn_normalized", "gla", "mlstm", "simple_gla_decode", "rnn"])
def test_custom_ops_pass_opcheck(device, name):
    """``torch.library.opcheck``: schema, fake implementation against the real outputs (shapes, dtypes), autograd
    registration, AOT dispatch with dynamic shapes."""
    op, args = _opcheck_cases(device)[name]
    def leaf(a):
        if isinstance(a, list):
            return [leaf(t) for t in a]
        return a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a

    args = tuple(a if "decode" in name else leaf(a) for a in args)
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("cell,G,S", [("elman", 1, 1), ("lstm", 4, 2), ("gru", 3, 1), ("slstm", 4, 4)])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("path", ["auto", "alternating"])  # auto: the fused path at D = 8
def test_rnn_fullgraph_equals_eager(device, cell, G, S, varlen, path):
    """The FlashRNN cells compile without graph breaks (forward op; the backward op runs the forward again);
    outputs, final states and every gradient equal eager's, dense and varlen (an empty and a one-step sequence),
    on both paths."""
    torch._dynamo.reset()  # one code object (fn below) over 16 cases: past dynamo's recompile limit otherwise
    B, T, NH, D = (1, 9, 2, 8) if varlen else (2, 6, 2, 8)
    cu = torch.tensor([0, 0, 1, 9], device=device) if varlen else None
    N = 3 if varlen else B
    gen = torch.Generator().manual_seed(G)
    x = torch.randn(B, T, G, NH, D, generator=gen).to(device)
    R = (torch.randn(G, NH, D, D, generator=gen) * 0.3).to(device)
    b = torch.randn(G, NH, D, generator=gen).to(device)
    st = [torch.randn(N, NH, D, generator=gen).to(device) * 0.5 for _ in range(S)]
    op = getattr(tfla, cell)

    def fn(x, R, b, *st):
        return op(x, R, b, initial_state=tuple(st), output_final_state=True, cu_seqlens=cu, config={"path": path})

    def run(f):
        leaves = [t.clone().requires_grad_() for t in (x, R, b, *st)]
        h, fin = f(*leaves)
        loss = (h * h).sum() + sum(s.sum() for s in fin[:3])  # sLSTM's m is a constant of the backward
        return (h, *fin) + torch.autograd.grad(loss, leaves)

    _check_compiled(device, fn, run, cell)


def test_rnn_compiled_keeps_every_config_key(device, monkeypatch):
    """Under compilation the cells' custom ops hand the whole ``config`` to the launch choice (the team keys
    included), as eager calls do."""
    import tfla.ops.rnn.library as library

    seen = []
    real = library.fused_launch

    def spy(config, *a, **kw):
        seen.append(dict(config))
        return real(config, *a, **kw)

    monkeypatch.setattr(library, "fused_launch", spy)
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 1, 32, generator=gen).to(device)
    R = (torch.randn(4, 1, 32, 32, generator=gen) * 0.2).to(device)
    b = torch.randn(4, 1, 32, generator=gen).to(device)
    cfg = {"path": "team", "team_cols": 16, "team_sync": False}
    eager = tfla.lstm(x, R, b, config=cfg)[0]
    got = torch.compile(lambda *a: tfla.lstm(*a, config=cfg)[0], fullgraph=True, backend="eager")(x, R, b)
    assert seen and all(c == cfg for c in seen)
    torch.testing.assert_close(got, eager, rtol=0, atol=0)


@pytest.mark.parametrize("decay", ["g", "g_gamma"])
def test_simple_gla_decode_fullgraph_equals_eager(device, decay):
    """``fused_recurrent_simple_gla`` (varlen, reverse, V-first state) compiles as one custom op, equal to eager."""
    cu = torch.tensor([0, 1, 4], device=device)
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 4, 2, 16, generator=gen).to(device) for _ in range(3))
    g = -torch.rand(1, 4, 2, generator=gen).to(device) if decay == "g" else None
    gamma = -torch.rand(2, generator=gen).to(device) if decay == "g_gamma" else None
    h0 = torch.randn(2, 2, 16, 16, generator=gen).to(device)

    def fn(q, k, v, h0):
        return tfla.fused_recurrent_simple_gla(q, k, v, g, g_gamma=gamma, initial_state=h0, output_final_state=True,
                                               reverse=True, state_v_first=True, cu_seqlens=cu)

    with torch.no_grad():
        _check_compiled(device, fn, lambda f: f(q, k, v, h0), f"simple_gla_decode_{decay}")
