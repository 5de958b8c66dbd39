"""First calls compiled on a thread pool (``tfla/ops/common/precompile.py``): the dry run's routing of launches on
any machine; on a GPU, in a fresh process with an empty Triton cache, a GDN forward + backward whose first call
compiles every kernel inside the dry run, launches nothing there, and returns what the next call returns."""
import contextlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tfla.ops.common import precompile


def test_dry_run_routes_launches(monkeypatch):
    """Inside a dry run (this context's list set) a launch becomes a warm-up compile whose kernel is collected and
    nothing is returned; outside it, Triton's own ``run`` with the caller's arguments; CPU tensors never dry-run."""
    seen = []

    def fake_run(self, *args, grid, warmup, **kwargs):
        seen.append((self, args, grid, warmup, kwargs))
        return f"kernel-{len(seen)}"

    monkeypatch.setattr(precompile, "_ORIG_RUN", fake_run)
    assert precompile._dry_run("fn", 1, 2, grid=(3,), warmup=False, num_warps=4) == "kernel-1"
    assert seen[-1] == ("fn", (1, 2), (3,), False, {"num_warps": 4})
    kernels = []
    token = precompile._DRY.set(kernels)
    try:
        assert precompile._dry_run("fn", 5, grid=(1, 2), warmup=False) is None
    finally:
        precompile._DRY.reset(token)
    assert seen[-1] == ("fn", (5,), (1, 2), True, {}) and kernels == ["kernel-2"]
    assert not precompile.enabled(torch.zeros(1))

    def no_key():
        raise AssertionError("a key is built only where enabled() holds")

    assert precompile.apply(lambda a, b: a + b, (2, 3), torch.zeros(1), no_key) == 5  # CPU: the Function alone



def test_first_call_once_per_key_restores_triton():
    """``first_call`` runs a key's dry run once per process, drops the dry run's errors (the real call raises them),
    runs it without autograd's device threads, and leaves Triton's ``JITFunction.run`` as it found it."""
    from triton.runtime.jit import JITFunction

    before = JITFunction.run
    runs = []

    def dry():
        runs.append(torch.autograd.is_multithreading_enabled())
        assert JITFunction.run is precompile._dry_run
        raise RuntimeError("raised again by the real call")

    key = ("test_first_call_once_per_key", object())
    assert precompile.first_call(key, dry, workers=2) is True
    assert precompile.first_call(key, dry, workers=2) is False
    assert runs == [False] and JITFunction.run is before and torch.autograd.is_multithreading_enabled()


def test_dry_apply_leaves_the_callers_tensors_alone():
    """``dry_apply`` runs the Function and its backward on aliases: the caller's leaves get no gradient, their hooks
    do not fire, and no graph hangs on them; without grad mode no backward runs."""
    calls = []

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(x)
            calls.append("forward")
            return x * x + y, x.sum()

        @staticmethod
        def backward(ctx, do, ds):
            calls.append("backward")
            (x,) = ctx.saved_tensors
            return 2 * x * do, do

    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3)
    fired = []
    x.register_hook(lambda g: fired.append(g))
    precompile.dry_apply(Square.apply, (x, y))
    assert calls == ["forward", "backward"] and x.grad is None and not fired
    with torch.no_grad():
        precompile.dry_apply(Square.apply, (x, y))
    assert calls == ["forward", "backward", "forward"]
    assert precompile.signature(torch.zeros(2, 5, 3, 4), None) == ((torch.float32, (3, 4), False), None)

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, triton
    import torch.nn.functional as F
    from triton.runtime.jit import JITFunction
    import tfla
    from tfla.ops.common import precompile
    from tfla.bench.inputs import gdn_inputs
    op = sys.argv[1]
    phase = ["before"]
    compiles = {"dry": 0, "real": 0}
    launches = {"dry": 0, "real": 0}
    orig = JITFunction._do_compile
    def counted(self, *a, **k):
        compiles["dry" if phase[0] == "dry" else "real"] += 1
        return orig(self, *a, **k)
    JITFunction._do_compile = counted
    def hook(*a, **k):
        launches["dry" if phase[0] == "dry" else "real"] += 1
    triton.knobs.runtime.launch_enter_hook = hook
    first = precompile.first_call
    def marked(*a, **k):
        phase[0] = "dry"
        try:
            return first(*a, **k)
        finally:
            phase[0] = "real"
    precompile.first_call = marked
    dev, dt = "cuda", torch.bfloat16
    B, T, H, K, V = 2, 1000, 2, 64, 64
    def rnd(*shape, dtype=dt):
        return torch.randn(*shape, device=dev).to(dtype).requires_grad_()
    if op == "gdn":
        x = gdn_inputs(B, T, H, 128, 128, HV=4, dtype=dt, device=dev, gate="default", initial_state=True,
                       num_seqs=B, seed=0)
        leaves = [x[n].requires_grad_() for n in ("q", "k", "v", "g", "beta")]
        fn = lambda: tfla.chunk_gated_delta_rule(*leaves, initial_state=x["initial_state"], output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
    elif op == "mlstm":
        leaves = [rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V), rnd(B, T, H, dtype=torch.float32),
                  rnd(B, T, H, dtype=torch.float32)]
        fn = lambda: tfla.chunk_mlstm(*leaves)
    elif op == "gla":
        leaves = [rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)]
        g = F.logsigmoid(torch.randn(B, T, H, K, device=dev)).requires_grad_()
        leaves.append(g)
        fn = lambda: tfla.chunk_gla(*leaves)
    elif op == "simple_gla":
        leaves = [rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)]
        leaves.append(F.logsigmoid(torch.randn(B, T, H, device=dev)).requires_grad_())
        fn = lambda: tfla.chunk_simple_gla(*leaves)
    elif op == "linear_attn":
        leaves = [rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)]
        fn = lambda: tfla.chunk_linear_attn(*leaves)
    elif op == "lstm":
        NH, D = 2, 32
        leaves = [rnd(B, 100, 4, NH, D), (torch.randn(4, NH, D, D, device=dev) * D ** -0.5).to(dt).requires_grad_(),
                  rnd(4, NH, D)]
        fn = lambda: tfla.lstm(*leaves)
    def call():
        o = fn()[0]
        return [o, *torch.autograd.grad(o, leaves, torch.ones_like(o), allow_unused=True)]
    a = call()
    torch.cuda.synchronize()
    after_first = dict(compiles=dict(compiles), launches=dict(launches))
    b = call()
    torch.cuda.synchronize()
    equal = all((u is None and w is None) or torch.equal(u, w) for u, w in zip(a, b))
    print(json.dumps({**after_first, "equal": equal}))
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("op", ["gdn", "mlstm", "gla", "simple_gla", "linear_attn", "lstm"])
def test_first_call_compiles_in_the_dry_run_gpu(tmp_path, op):
    """A fresh process with an empty Triton cache: each op's first forward + backward (the GDN with l2norm, initial
    and final state, grouped value heads) compiles its kernels inside the dry run and none in the real call,
    launches nothing in the dry run, and its results equal the second call's bitwise."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT, op], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["compiles"]["dry"] >= 2 and r["compiles"]["real"] == 0, r
    assert r["launches"]["dry"] == 0 and r["launches"]["real"] >= 2, r
    assert r["equal"], r


def test_first_call_results(monkeypatch):
    """``first_call(..., results=)`` receives each compiled kernel's ``(name, kernel)`` after its load, and
    ``(name, exception)`` where the load raised (the RNN team search reads spills and failures from them)."""
    from triton.runtime.jit import JITFunction

    class Kernel:
        def __init__(self, name, fails):
            self.name, self.fails = name, fails

        def _init_handles(self):
            if self.fails:
                raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(precompile, "_ORIG_RUN", lambda self, *a, grid, warmup, **kw: self)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())  # (no GPU needed)
    ok, bad = Kernel("ok_kernel", False), Kernel("bad_kernel", True)

    def dry():
        JITFunction.run(ok, grid=(1,), warmup=False)
        JITFunction.run(bad, grid=(1,), warmup=False)

    results = []
    assert precompile.first_call(("test_first_call_results", object()), dry, workers=2, results=results)
    assert results[0] == ("ok_kernel", ok)
    assert results[1][0] == "bad_kernel" and isinstance(results[1][1], RuntimeError)
