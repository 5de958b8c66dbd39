"""Compile every Triton kernel one GLA / simple-GLA / mLSTM / GDN / RNN-cell forward + backward launches, for sm_90,
on a machine without a GPU (nothing is launched), and print per kernel: registers, spill stores, shared memory.

python scripts/compile_stats.py [--op gla|simple_gla|mlstm|gdn|rnn] [--dtype bf16|fp32] [--K 128] [--V 128]
                                [--L 64] [--rnn-D 64] [--allocs] [--check] [--layouts] [--dump DIR] [--config JSON]
                                [--save-v-new op|true|false]

``compile=`` is the wall time of that kernel's compile on this machine (from Triton's on-disk cache when it holds
the kernel: point ``TRITON_CACHE_DIR`` at an empty folder for cold times). ``--allocs`` lists each kernel's
shared-memory buffers (``ttg.local_alloc`` in its TTGIR: pipelined loads,
dot operands staged there; tf32x3 stages a hi and a lo copy of each fp32 operand); ``--check`` exits 1
when a kernel asks for more than sm_90's 232448 B.

Catches code-generator errors of GPU-only paths (the interpreter skips Triton's compiler) and shows
register spills and shared-memory use, which the interpreter cannot. The numbers come from this
machine's Triton and the ptxas it ships: another Triton version on the GPU machine can differ (compare
ops relative to each other, not to the 227 KiB limit to the byte). Launches are recorded by replacing
``JITFunction.run``, so the host code runs on CPU tensors with outputs left unwritten.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # the real JIT, not the interpreter
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
         torch.int32: "i32", torch.int64: "i64"}
launches = []


def _record(self, *args, grid, warmup, **kwargs):
    launches.append((self, args, kwargs))


def compile_launch(fn, args, kwargs, arch=90):
    kwargs = dict(kwargs)
    opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg", "launch_cooperative_grid") if k in kwargs}
    vals = {**dict(zip(fn.arg_names, args)), **kwargs}
    sig, const, attrs = {}, {}, {}
    for p in fn.params:
        v = vals.get(p.name, p.default if p.has_default else None)
        i = (fn.arg_names.index(p.name),)
        if p.is_constexpr or v is None:
            sig[p.name], const[i] = "constexpr", v
            continue
        # the JIT's own specialization (as at a launch on the GPU): 16-byte aligned pointers and integers
        # divisible by 16 get tt.divisibility = 16, integer 1 becomes a constant
        ty, attr = native_specialize_impl(CUDABackend, v, False, not p.do_not_specialize,
                                          not p.do_not_specialize_on_alignment)
        sig[p.name] = ty
        if ty == "constexpr":
            const[i] = attr
        elif isinstance(attr, str) and attr:
            attrs[i] = CUDABackend.parse_attr(attr)
    source = ASTSource
    if type(fn).__name__ == "GluonJITFunction":  # a Gluon kernel (fused_delta_ws.py)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return triton.compile(source(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=opts)


def _record_ws(dtype, T, K, V):
    """The Gluon forward pass's prep and launches (``fused_delta_pass_ws``) for dense / varlen, with and without the
    initial and final states and Vnew, the slab starts, and the pieces' transitions, at 1 and 2 consumer warpgroups
    (no GPU: the launcher only records)."""
    from tfla.ops.common import fused_delta_ws as ws

    if not ws.HAVE_GLUON:
        sys.exit(f"Triton {triton.__version__} has no Gluon warp specialization")
    H, HV = 2, 4
    q, k = torch.randn(1, T, H, K, dtype=dtype), torch.randn(1, T, H, K, dtype=dtype)
    v = torch.randn(1, T, HV, V, dtype=dtype)
    ai = torch.randn(1, T, HV, 64, dtype=dtype)
    g, beta = torch.randn(1, T, HV), torch.rand(1, T, HV, dtype=dtype)
    cu = torch.tensor([0, T // 3, T], dtype=torch.int32)
    # its prep: Tm with the gate's cumsum, dense and varlen
    from tfla.ops.common.ut_transform import ut_inverse_with_cumsum
    from tfla.ops.common.utils import prepare_chunk_indices

    ut_inverse_with_cumsum(k, g, beta)
    ut_inverse_with_cumsum(k, g, beta, cu, prepare_chunk_indices([0, T // 3, T], 64, "cpu"), A_log=torch.randn(HV),
                           dt_bias=torch.randn(HV))
    for ncons, bv in ((1, 64), (2, 32), (2, 64)):
        for varlen, h0, save in ((False, False, 0), (True, True, 1), (False, True, 1), (True, True, 2)):
            state = torch.randn(2 if varlen else 1, HV, K, V) if h0 else None
            offs = torch.tensor([0, (T // 3 + 63) // 64]) if varlen else None
            ws.fused_delta_pass_ws(q, k, v, g, beta, ai, 0.1, state, h0, cu if varlen else None, save,
                                   config={"NCONS": ncons, "BV": bv}, chunk_offsets=offs,
                                   num_chunks=(T // 3 + 63) // 64 + (T - T // 3 + 63) // 64)
        # Vnew and the slab starts kept (dense)
        ws.fused_delta_pass_ws(q, k, v, g, beta, ai, 0.1, None, False, None, 1, config={"NCONS": ncons, "BV": bv},
                               slab_states=torch.empty(1, HV, K, V), slab=2)
        # the pieces' transitions ([M | N], packed varlen)
        ws.fused_delta_pass_ws(q, k, v, g, beta, ai, 0.1, None, True, cu, config={"NCONS": ncons, "BV": bv},
                               transition=True)
        # the backward's Vnew and states without the output (states_from_pass), dense and varlen
        ws.fused_delta_pass_ws(q, k, v, g, beta, ai, 0.1, torch.randn(1, HV, K, V), False, None, 2,
                               config={"NCONS": ncons, "BV": bv}, output=False)
        ws.fused_delta_pass_ws(q, k, v, g, beta, ai, 0.1, torch.randn(2, HV, K, V), False, cu, 2,
                               config={"NCONS": ncons, "BV": bv}, output=False,
                               chunk_offsets=torch.tensor([0, (T // 3 + 63) // 64]),
                               num_chunks=(T // 3 + 63) // 64 + (T - T // 3 + 63) // 64)


def ptxas_stats(ptx: str, arch=90):
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    exe = next(os.path.join(bindir, n) for n in ("ptxas-blackwell", "ptxas") if os.path.exists(os.path.join(bindir, n)))
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([exe, f"-arch=sm_{arch}a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, check=False)
    out = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return (int(regs.group(1)) if regs else None, int(spill.group(1)) if spill else None)


SMEM_SM90 = 232448  # opt-in shared memory per block on sm_90 (H100 / H200)


def shared_allocs(ttgir: str):
    """``(shape, element type, tensor name)`` of every shared-memory buffer in a TTGIR module (buffers of
    disjoint lifetimes share bytes, so these can add up to more than the kernel's total)."""
    out = []
    for line in ttgir.splitlines():
        m = re.search(r"(%[\w.]+) = ttg\.local_alloc.*!ttg\.memdesc<([\dx]+)x(\w+),", line)
        if m:
            out.append((m.group(2), m.group(3), m.group(1)))
    return out


def _record_state_bwd_ws(dtype, T, K, V):
    """The Gluon state-gradient recurrence's launches (``delta_state_bwd_ws``, bf16): dense and varlen, with and
    without the final state's cotangent, the stores off (a piece's summary), at 1 and 2 consumer warpgroups."""
    from tfla.ops.common import state_bwd_ws as sb

    H, HV = 2, 4
    q, k = torch.randn(1, T, H, K, dtype=dtype), torch.randn(1, T, H, K, dtype=dtype)
    ai = torch.randn(1, T, HV, 64, dtype=dtype)
    beta = torch.rand(1, T, HV, dtype=dtype)
    do = torch.randn(1, T, HV, V, dtype=dtype)
    g = torch.randn(1, T, HV)
    cu = torch.tensor([0, T // 3, T], dtype=torch.int32)
    offs = torch.tensor([0, (T // 3 + 63) // 64, (T // 3 + 63) // 64 + (T - T // 3 + 63) // 64])
    for ncons, bv in ((1, 64), (2, 32), (2, 64)):
        for varlen, dht, store in ((False, False, True), (True, True, True), (True, False, False)):
            ct = torch.randn(2 if varlen else 1, HV, K, V) if dht else None
            sb.delta_state_bwd_ws(q, k, ai, beta, do, g, 0.1, ct, True, cu if varlen else None, offs if varlen else None,
                                  int(offs[-1]), store, config={"NCONS": ncons, "BV": bv})
    # the backward's slabs: (first row, end row) pairs, dU into a given buffer
    pairs = torch.tensor([[0, 128], [T // 2, T // 2 + 128]], dtype=torch.int32)
    sb.delta_state_bwd_ws(q, k, ai, beta, do, g, 0.1, torch.randn(2, HV, K, V), True, pairs,
                          torch.tensor([0, 2], dtype=torch.int32), 4, du_out=torch.empty_like(do))


def _record_gdn_bwd_ws(dtype, T, K, V):
    """The Gluon chunk-gradient kernel's launches (``gdn_bwd_chunk_ws``): grouped value heads (2 per key head) dense
    (T not a multiple of 64) and varlen, per value head and summed in the kernel (``gva_sum``, dense with l2norm's
    backward, varlen without); one value head per key head with l2norm's backward (dense) and without (varlen); the
    slabs' pairs per value head and summed."""
    from tfla.ops.common import chunk_dqkw_ws as cw

    cu = torch.tensor([0, T // 3, T], dtype=torch.int32)
    ns = (T // 3 + 63) // 64 + (T - T // 3 + 63) // 64
    tiles = torch.zeros(ns, 2, dtype=torch.int32)
    offs = torch.tensor([0, (T // 3 + 63) // 64])
    for HV, varlen, l2, gva in ((4, False, False, False), (4, True, False, False), (2, False, True, False),
                                (2, True, False, False), (4, False, True, True), (4, True, False, True)):
        H = 2
        if gva and (K, V) != (128, 128):
            continue
        q, k = torch.randn(1, T, H, K, dtype=dtype), torch.randn(1, T, H, K, dtype=dtype)
        v, vn, do, du = (torch.randn(1, T, HV, V, dtype=dtype) for _ in range(4))
        g = torch.randn(1, T, HV)
        h = torch.randn(1, ns if varlen else (T + 63) // 64, HV, K, V, dtype=dtype)
        rstd = torch.rand(1, T, H)
        cw.gdn_bwd_chunk_ws(q, k, v, torch.rand(1, T, HV, dtype=dtype), torch.randn(1, T, HV, 64, dtype=dtype), vn,
                            do, du, h, h, g, 0.1, cu if varlen else None, tiles if varlen else None,
                            offs if varlen else None, l2=(rstd, rstd) if l2 else None, gva_sum=gva)
    # the backward's slabs: (first row, end row) pairs, outputs into given buffers (inputs of their own: the loop
    # above skips its last cases where K, V != 128, which left its tensors and HV out of step)
    HV = 4
    q, k = torch.randn(1, T, H, K, dtype=dtype), torch.randn(1, T, H, K, dtype=dtype)
    v, vn, do, du = (torch.randn(1, T, HV, V, dtype=dtype) for _ in range(4))
    g = torch.randn(1, T, HV)
    pairs = torch.tensor([[0, 128], [T // 2, T // 2 + 128]], dtype=torch.int32)
    tiles = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]], dtype=torch.int32)
    h = torch.randn(1, 4, HV, K, V, dtype=dtype)
    for gva in (False, True) if (K, V) == (128, 128) else (False,):
        HQ = H if gva else HV
        outs = (torch.empty(1, T, HQ, K, dtype=dtype), torch.empty(1, T, HQ, K, dtype=dtype),
                *(torch.empty(1, T, HV) for _ in range(2)))
        cw.gdn_bwd_chunk_ws(q, k, v, torch.rand(1, T, HV, dtype=dtype), torch.randn(1, T, HV, 64, dtype=dtype), vn,
                            do, du, h, h, g, 0.1, pairs, tiles, torch.tensor([0, 2], dtype=torch.int32),
                            dv_into_du=True, gva_sum=gva, out=outs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", choices=["gla", "simple_gla", "mlstm", "gdn", "gdn_ws", "rnn"], default="gla",
                   help="rnn: the four FlashRNN cells' kernels, forward and backward: the alternating path's "
                        "pointwise kernels (D = 32) and the fused path's (D = --rnn-D); gdn_ws: the "
                        "warp-specialized Gluon kernels (fused_delta_ws.py, bf16 / fp16, state_bwd_ws.py, bf16, and chunk_dqkw_ws.py; "
                        "K = 128) at each of their flag sets")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--L", type=int, default=64)
    p.add_argument("--input-gate", choices=["sigmoid", "exp"], default="sigmoid", help="mLSTM input gate (--op mlstm)")
    p.add_argument("--rnn-D", type=int, default=64, help="--op rnn: head dim of the fused kernels")
    p.add_argument("--HV", type=int, default=2, help="value heads (--op gdn; 2 key heads: 4 is grouped)")
    p.add_argument("--T", type=int, default=300, help="sequence length (a multiple of 16 specializes T as the JIT does)")
    p.add_argument("--allocs", action="store_true", help="list the shared-memory buffers of each kernel")
    p.add_argument("--check", action="store_true", help="exit 1 if a kernel needs more than 232448 B")
    p.add_argument("--layouts", action="store_true",
                   help="count each kernel's layout conversions (ttg.convert_layout) and barriers in its TTGIR")
    p.add_argument("--dump", type=str, default=None, help="write each kernel's TTGIR and PTX to this folder")
    p.add_argument("--config", type=json.loads, default=None,
                   help="--op gdn: the config= of chunk_gated_delta_rule_fwd / _bwd "
                        "(JSON, e.g. '{\"state\": {\"BV\": 32}}'); --op rnn: the cells' config= of the fused "
                        "kernels (e.g. '{\"BB\": 32, \"num_warps\": 4}')")
    p.add_argument("--save-v-new", choices=["op", "true", "false"], default="op",
                   help="--op gdn: the backward with the forward's Vnew or recomputing it (op: the op's default)")
    args = p.parse_args(argv)
    if (args.config and args.op not in ("gdn", "rnn")) or (args.save_v_new != "op" and args.op != "gdn"):
        p.error("--config applies to --op gdn and rnn, --save-v-new to --op gdn")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    T, H, K, V, L = args.T, 2, args.K, args.V, args.L
    HV = args.HV if args.op == "gdn" else H
    q, k = torch.randn(1, T, H, K, dtype=dtype), torch.randn(1, T, H, K, dtype=dtype)
    v, do = torch.randn(1, T, HV, V, dtype=dtype), torch.randn(1, T, HV, V, dtype=dtype)
    h0, dht = torch.randn(1, HV, K, V), torch.randn(1, HV, K, V)
    JITFunction.run = _record
    if args.op == "gdn_ws":
        _record_ws(dtype, T, K, V)
        if dtype == torch.bfloat16:
            _record_state_bwd_ws(dtype, T, K, V)
        _record_gdn_bwd_ws(dtype, T, K, V)
    elif args.op == "gla":
        from tfla.ops.gla.chunk import chunk_gla_bwd, chunk_gla_fwd

        _, _, gv = chunk_gla_fwd(q, k, v, -torch.rand(1, T, H, K), 0.1, h0, True, L)
        chunk_gla_bwd(q, k, v, gv, 0.1, h0, do, dht, L)
    elif args.op == "mlstm":  # normalized, exact gradient, initial and final states
        from tfla.ops.mlstm.chunk import MLSTMOptions, chunk_mlstm_bwd, chunk_mlstm_fwd

        opts = MLSTMOptions(args.input_gate, True, 1e-6, K ** -0.5, L, True, aug=True, detach_normalizer=False)
        i, f = torch.randn(1, T, H), torch.randn(1, T, H) + 3
        n0 = torch.randn(1, H, K)
        m0 = torch.zeros(1, H) if args.input_gate == "exp" else None
        h, final, den = chunk_mlstm_fwd(q, k, v, i, f, h0, n0, m0, opts)
        chunk_mlstm_bwd(q, k, v, i, f, h0, n0, m0, h, den, final, do, dht, torch.randn(1, H, K),
                        torch.randn(1, H) if m0 is not None else None, opts)
    elif args.op == "gdn":
        from tfla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd

        import inspect

        from tfla.ops.gated_delta_rule import chunk_gated_delta_rule

        # the backward the op runs: with the forward's Vnew (save_v_new) or recomputing it (FLA's saved set)
        keep = {"true": True, "false": False}.get(args.save_v_new)
        if keep is None:  # the op's default argument (None there: the op's own default, which keeps Vnew)
            default = inspect.signature(chunk_gated_delta_rule).parameters["save_v_new"].default
            keep = default if isinstance(default, bool) else True
        g, beta = -torch.rand(1, T, HV), torch.rand(1, T, HV, dtype=dtype)
        from tfla.ops.common.fused_delta_fwd import SAVE_NONE, SAVE_V_NEW

        # the forward as autograd runs it: keeping Vnew for the backward when the backward takes it
        _, _, inter = chunk_gated_delta_rule_fwd(q, k, v, g, beta, 0.1, h0, True, config=args.config,
                                                 save=SAVE_V_NEW if keep else SAVE_NONE)
        chunk_gated_delta_rule_bwd(q, k, v, inter["g_cum"], beta, inter["ai"], 0.1, h0, do, dht, config=args.config,
                                   v_new=inter["v_new"] if keep else None)
    elif args.op == "rnn":
        from tfla.ops.rnn import cells

        N, Tm, NH = 2, 3, 2
        cfg = {"path": "fused", **(args.config or {})}
        cells.check_config(cfg, dtype, args.rnn_D)
        for D, fused in ((32, None), (args.rnn_D, cells.fused_launch(cfg, dtype, N, NH, args.rnn_D))):
            for cell, G, S in (("elman", 1, 1), ("lstm", 4, 2), ("gru", 3, 1), ("slstm", 4, 4)):
                x, R, b = torch.randn(N, Tm, G, NH, D, dtype=dtype), torch.randn(G, NH, D, D), torch.randn(G, NH, D)
                o, states, rh, Wt, b_acc = cells.rnn_fwd(cell, x, R, b, torch.zeros(S, NH, N, D), fused)
                cells.rnn_bwd(cell, x, Wt, b_acc, states, rh, torch.randn_like(o), torch.zeros(S, NH, N, D), [Tm] * N,
                              fused=fused)
    else:
        from tfla.ops.simple_gla.chunk import chunk_simple_gla_bwd, chunk_simple_gla_fwd

        _, _, gc = chunk_simple_gla_fwd(q, k, v, -torch.rand(1, T, H), 0.1, h0, True, L)
        chunk_simple_gla_bwd(q, k, v, gc, 0.1, h0, do, dht, L)
    over = False
    flags = ("VEC_G", "VEC_ROWDOT", "ROWDOT", "REVERSE", "HAS_STATE", "STORE_SUB", "N_STATE", "NORM", "ROWADD", "NCONS",
             "IS_VARLEN", "USE_H0", "SAVE", "TRANSITION", "PASS", "USE_DHT", "STORE", "BV", "HV", "L2",
             "VEC_SPAN", "CELL", "BB", "BD", "BC", "SYNC", "GVA")
    print(f"{args.op} {args.dtype} T={T} K={K} V={V} L={L}, sm_90, Triton {triton.__version__}")
    for fn, a, kw in launches:
        name = fn.fn.__name__
        t0 = time.perf_counter()
        c = compile_launch(fn, a, kw)
        secs = time.perf_counter() - t0
        regs, spill = ptxas_stats(c.asm["ptx"])
        fl = " ".join(f"{f}={kw[f]}" for f in flags if f in kw)
        print(f"  {name:34s} warps={c.metadata.num_warps} regs={regs} spill_stores={spill}B "
              f"smem={c.metadata.shared}B compile={secs:.2f}s  {fl}")
        over = over or c.metadata.shared > SMEM_SM90
        if args.layouts:
            ir = c.asm["ttgir"]
            print(f"      convert_layout {ir.count('ttg.convert_layout')}  local_alloc {ir.count('ttg.local_alloc')}"
                  f"  barriers {ir.count('gpu.barrier')}")
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            stem = os.path.join(args.dump, f"{len(os.listdir(args.dump)) // 2:02d}_{name}")
            for ext in ("ttgir", "ptx"):
                with open(f"{stem}.{ext}", "w") as fh:
                    fh.write(c.asm[ext])
        if args.allocs:
            for shape, ty, what in shared_allocs(c.asm["ttgir"]):
                print(f"      {shape:>14s} x {ty:4s}  {what}")
    if args.check and over:
        sys.exit(f"a kernel needs more than {SMEM_SM90} B of shared memory")


if __name__ == "__main__":
    main()
