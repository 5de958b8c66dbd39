"""``tfla bench linear-attn`` and ``tfla bench mlstm`` run end to end (CPU: through the interpreter on
tiny workloads), write their JSON rows and CSV rows (timed implementations only), check before timing and
refuse to time a wrong kernel."""
import csv
import json
import subprocess
import sys

import pytest
import torch

from tfla.cli import main

TIMING = ["--warmup", "1", "--rep", "5"] if torch.cuda.is_available() else []
TINY = ["--B", "1", "--H", "1", "--K", "16", "--V", "16", "--impls", "tfla", "--chunk-sizes", "64",
        "--dtype", "fp32", "--no-progress", *TIMING]
COLUMNS = {"impl", "version", "kind", "mode", "chunk", "B", "T", "H", "K", "V", "dtype", "op", "ref", "slice_T",
           "err_o", "slice_err_o", "ms", "first_s", "tflops", "peak_mib", "status", "speedup_vs_fla"}


def _csv_rows(path):
    from tfla.bench.common import CSV_COLUMNS

    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == CSV_COLUMNS
    return rows


def _rows(path):
    data = json.loads(path.read_text())
    return data, data["rows"]


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_bench_linear_attn_small(tmp_path, capsys, mode):
    csv_path, json_path = tmp_path / "r.csv", tmp_path / "r.json"
    T = "64" if mode == "fwd" else "100"
    rc = main(["bench", "linear-attn", "--mode", mode, "--T", T, *TINY, "--csv", str(csv_path), "--json", str(json_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert f"Linear attention {mode}" in out and "first call s" in out
    data, rows = _rows(json_path)
    assert data["env"]["torch"] == torch.__version__
    assert [r["kind"] for r in rows] == ["none", "constant", "scalar", "vector", "lightning"]
    ran = [r for r in rows if r["status"] == "ok"]
    assert {r["kind"] for r in ran} >= {"none", "constant", "scalar", "lightning"}
    vector = rows[3]
    assert vector["status"] == "ok" or vector["status"].startswith("not implemented")
    grads = ("dq", "dk", "dv") if mode == "fwdbwd" else ()
    for r in ran:
        assert r["ms"] > 0 and r["ref"] == "tfla fp32 L=64" and r["slice_T"] == int(T)
        assert r["first_s"] > 0  # the first call's wall time
        assert r["err_o"] < 1e-5 and r["slice_err_o"] < 1e-5
        for n in grads:
            assert r[f"err_{n}"] < 1e-5 and r[f"slice_err_{n}"] < 1e-5
        if mode == "fwdbwd" and r["kind"] in ("scalar", "vector"):
            assert r["err_dg"] < 5e-5 and r["slice_err_dg"] < 5e-5
        if mode == "fwdbwd" and r["kind"] in ("none", "constant", "lightning"):
            assert "err_dg" not in r
    assert all(COLUMNS <= set(r) for r in ran)
    if mode == "fwdbwd":
        assert all({"err_dq", "err_dk", "err_dv", "slice_err_dq"} <= set(r) for r in ran)
    assert data["env"]["git"] is not None and data["env"]["src"]
    ops = {"none": "chunk_linear_attn", "constant": "chunk_retention", "scalar": "chunk_simple_gla",
           "vector": "chunk_gla", "lightning": "chunk_lightning_attn"}
    written = _csv_rows(csv_path)
    assert [(w["op"], w["impl"]) for w in written] == [(ops[r["kind"]], r["impl"]) for r in ran]
    assert all(w["mode"] == mode and w["HV"] == w["H"] == "1" and f"kind={r['kind']}" in w["notes"].split()
               for w, r in zip(written, ran))
    assert all(f"first_s={r['first_s']:.2f}" in w["notes"].split() for w, r in zip(written, ran))


def test_bench_linear_attn_refuses_wrong_kernel(monkeypatch, capsys, tmp_path):
    """A kernel off by 1% is WRONG and not timed, even though the full check's reference (tfla's own fp32
    run, broken the same way here) agrees with it: the float64 slice check catches it."""
    import tfla.bench.registry as reg

    real = reg.tfla_linear_attn_impl

    def broken(kind, L):
        impl = real(kind, L)
        fn = impl.fn
        impl.fn = lambda x: fn(x) * 1.01
        return impl

    monkeypatch.setattr(reg, "tfla_linear_attn_impl", broken)
    json_path = tmp_path / "r.json"
    rc = main(["bench", "linear-attn", "--kinds", "scalar", "--T", "64", *TINY, "--json", str(json_path)])
    assert rc == 1
    assert "WRONG" in capsys.readouterr().out
    (row,) = _rows(json_path)[1]
    assert row["status"].startswith("WRONG (slice o") and "ms" not in row and row["err_o"] < 1e-6
    assert row["first_s"] > 0  # the first call is timed before the check, as on a correct row


def test_bench_mlstm_small(tmp_path, capsys):
    import tfla

    if not hasattr(tfla, "chunk_mlstm"):
        pytest.skip("tfla.chunk_mlstm is not there yet")
    csv_path, json_path = tmp_path / "r.csv", tmp_path / "r.json"
    rc = main(["bench", "mlstm", "--mode", "fwdbwd", "--T", "64", *TINY, "--csv", str(csv_path), "--json", str(json_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "mLSTM fwdbwd" in out and "first call s" in out
    rows = _rows(json_path)[1]
    assert [r["input_gate"] for r in rows] == ["exp", "sigmoid"]
    for r in rows:
        assert r["status"] == "ok" and r["ms"] > 0 and r["first_s"] > 0 and r["grad_convention"] == "exact"
        for n in ("o", "dq", "dk", "dv", "di", "df"):
            assert r[f"err_{n}"] < 1e-5 and r[f"slice_err_{n}"] < 1e-5
    data = _rows(json_path)[0]
    assert all({"input_gate", "grad_convention", "ref_grads", "err_di", "slice_err_df", "speedup_vs_mk"} <= set(r)
               for r in rows)
    assert "mlstm_kernels" in data["env"]
    written = _csv_rows(csv_path)
    assert [w["op"] for w in written] == ["chunk_mlstm:exp", "chunk_mlstm:sigmoid"]
    assert all(w["impl"] == "tfla L=64" and "grad_convention=exact" in w["notes"].split() for w in written)
    assert all(f"first_s={r['first_s']:.2f}" in w["notes"].split() for w, r in zip(written, rows))


def test_bench_mlstm_detached_row_follows_mlstm_kernels_convention(tmp_path):
    """``--impls tfla_detached``: tfla in mlstm_kernels' gradient convention (normalizer and max state held
    constant), recognised as such by the slice check and checked against that float64 ground truth."""
    json_path = tmp_path / "r.json"
    rc = main(["bench", "mlstm", "--mode", "fwdbwd", "--T", "64", *TINY, "--impls", "tfla,tfla_detached",
               "--input-gates", "sigmoid", "--json", str(json_path)])
    assert rc == 0
    rows = _rows(json_path)[1]
    assert [(r["impl"], r["grad_convention"]) for r in rows] == [("tfla L=64", "exact"),
                                                                 ("tfla L=64 detached", "no normalizer grad")]
    for r in rows:
        assert r["status"] == "ok" and r["ms"] > 0 and r["first_s"] > 0
        assert all(r[f"slice_err_{n}"] < 1e-5 for n in ("o", "dq", "dk", "dv", "di", "df"))


def test_bench_mlstm_reports_missing_op(monkeypatch, tmp_path):
    """Without tfla.chunk_mlstm every tfla row says 'not available' and the command still succeeds."""
    import tfla.bench.registry as reg

    monkeypatch.setattr(reg, "find_tfla_op", lambda name, modules=(): (None, "ImportError: gone"))
    json_path = tmp_path / "r.json"
    assert main(["bench", "mlstm", "--T", "64", *TINY, "--json", str(json_path)]) == 0
    rows = _rows(json_path)[1]
    assert len(rows) == 2 and all(r["status"] == "not available (tfla.chunk_mlstm)" for r in rows)


def test_detached_reference_conventions():
    """The mlstm_kernels-convention ground truth: without detaching it is tfla's quadratic reference; with
    it o and dv are unchanged and dq, dk, di, df are not (float64)."""
    from tfla.bench.mlstm import parallel_mlstm_detached_ref
    from tfla.ops.mlstm.reference import parallel_mlstm_ref

    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 1, 40, 2, 8, 6
    x = [torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2)]
    x += [torch.randn(B, T, H, V, generator=gen, dtype=torch.float64), torch.randn(B, T, H, generator=gen,
          dtype=torch.float64), torch.randn(B, T, H, generator=gen, dtype=torch.float64) + 3]
    do = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    for gate in ("exp", "sigmoid"):
        outs = []
        for fn, kw in ((parallel_mlstm_ref, {}), (parallel_mlstm_detached_ref, {"detach_normalizer": False}),
                       (parallel_mlstm_detached_ref, {})):
            leaves = [t.clone().requires_grad_() for t in x]
            o = fn(*leaves, input_gate=gate, **kw)
            o = o[0] if isinstance(o, tuple) else o
            outs.append((o, torch.autograd.grad(o, leaves, do)))
        (o0, g0), (o1, g1), (o2, g2) = outs
        torch.testing.assert_close(o1, o0, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(o2, o0, rtol=1e-12, atol=1e-12)
        for a, b in zip(g1, g0):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(g2[2], g0[2], rtol=1e-10, atol=1e-12)  # dv
        for idx in (0, 1, 3, 4):  # dq, dk, di, df
            assert (g2[idx] - g0[idx]).norm() > 1e-3 * g0[idx].norm()


@pytest.mark.parametrize("op,flags", [("linear-attn", ["--kinds", "--chunk-sizes", "--tokens", "--mode"]),
                                      ("mlstm", ["--paper", "--mk-chunk-sizes", "--input-gates", "--mode"])])
def test_help(op, flags):
    r = subprocess.run([sys.executable, "-m", "tfla", "bench", op, "--help"], check=False, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and all(f in r.stdout for f in flags)


def test_source_hash_names_the_sources(tmp_path):
    """The bench's ``src`` field: the same for the same files, different when one byte or one name changes."""
    from tfla.bench.common import env_info, source_hash

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    h = source_hash(tmp_path)
    assert h == source_hash(tmp_path) and len(h) == 12
    (tmp_path / "b.py").write_text("y = 3\n")
    assert source_hash(tmp_path) != h
    (tmp_path / "b.py").write_text("y = 2\n")
    assert source_hash(tmp_path) == h
    (tmp_path / "b.py").rename(tmp_path / "c.py")
    assert source_hash(tmp_path) != h
    assert env_info()["src"] == source_hash()


def _script(name):
    import runpy
    from pathlib import Path

    return runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / name), run_name="tfla_script")


def _module_state():
    """Every tfla module's attributes (by identity): what a tool must leave as it found them."""
    return {name: dict(vars(m)) for name, m in sys.modules.items() if name.startswith("tfla.") and m is not None}


def test_opcalls_config_reaches_the_op():
    """``config`` is the op's argument: ``{}`` gives the default call's outputs bitwise (GDN), a launch override
    the same values; an op without ``config=`` (where one is left) refuses anything but ``{}``."""
    from tfla.bench.opcalls import op_run, rel_errors

    base = op_run("gdn", "fwdbwd", 64, None, shape=(1, 70, 1, 16, 16), dtype="fp32")
    ref = base.run()
    assert base.names == ("o", "dq", "dk", "dv", "dg", "dbeta")
    for cfg in ({}, {"state_lin": {"num_warps": 8}}):
        r = op_run("gdn", "fwdbwd", 64, cfg, inputs=base.inputs)
        assert max(rel_errors(r.run(), ref, r.names).values()) < 1e-6
    import tfla
    from tfla.bench.opcalls import OPS, takes_config

    for op in [op for op, (name, _, _) in OPS.items() if op != "gdn" and not takes_config(getattr(tfla, name))][:1]:
        assert op_run(op, "fwd", 64, {}, shape=(1, 70, 1, 16, 16), dtype="fp32").run()[0].shape == (1, 70, 1, 16)
        with pytest.raises(ValueError, match="config"):
            op_run(op, "fwd", 64, {"state": {"BV": 16}}, shape=(1, 70, 1, 16, 16), dtype="fp32")


def test_ab_and_tune_scripts_run_through_config(capsys):
    """``scripts/ab.py`` and ``scripts/tune.py`` on a tiny workload: variants parsed as JSON configs, outputs compared,
    times printed, and no tfla module attribute changed."""
    import tfla

    ab, tune = _script("ab.py"), _script("tune.py")
    variants = ab["parse_variants"]('base={};w8={"state_lin": {"num_warps": 8}}')
    assert variants == [("base", {}), ("w8", {"state_lin": {"num_warps": 8}})]
    with pytest.raises(Exception, match="JSON"):
        ab["parse_variants"]("x=gdn.FLAG=1")
    for name in tfla.__all__:  # every op module imported, so that the snapshot covers it
        getattr(tfla, name)
    before = _module_state()
    ab["main"](["--ops", "gdn", "--mode", "fwd", "--shape", "1,70,1,16,16", "--rounds", "1", "--compare",
                "--variants", 'base={};w8={"state_lin": {"num_warps": 8}}'])
    tune["main"](["gdn", "--mode", "fwd", "--shape", "1,70,1,16,16", "--stage", "fused", "--grid",
                  '{"num_warps": [4, 8]}'])
    after = _module_state()
    # every attribute a module had before is the same object after (new ones are allowed: a submodule imported on
    # the way, or names Triton's CPU interpreter puts into a kernel's module the first time it runs one)
    changed = [f"{name}.{k}" for name, state in before.items() if name in after
               for k, v in state.items() if k not in after[name] or after[name][k] is not v]
    assert not changed, changed
    out = capsys.readouterr().out
    assert "w8 vs base: o equal" in out and "base" in out and "ms  rounds" in out
    assert out.count('{"fused": {"num_warps"') == 4 and "WRONG" not in out


def test_ab_trees_exports_and_compares(tmp_path):
    """``scripts/ab_trees.py``: a tree exported from HEAD, run twice in their own processes on the mve workload's CPU
    size: the second equal to the first, deterministic, errors against the fp32 reference printed; bad tree specs
    refused."""
    import argparse
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True).returncode != 0:
        pytest.skip("needs the git repository")
    abt = _script("ab_trees.py")
    cwd = os.getcwd()
    try:
        os.chdir(root)
        abt["export"]("HEAD", str(tmp_path / "a"))
    finally:
        os.chdir(cwd)
    assert (tmp_path / "a" / "tfla" / "__init__.py").is_file()
    trees = abt["_trees"](f"a={tmp_path / 'a'},b={tmp_path / 'a'}")
    out = abt["run"](trees, ["mve"], "fwdbwd", 1, 1, True, 4, str(tmp_path / "r.json"))
    lines = out.splitlines()
    assert lines[0] == "## mve"
    assert "equal to a" in lines[2] and "deterministic" in lines[2] and "dg " in lines[2], out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["a"][0]["rows"][0]["hashes"] == saved["b"][0]["rows"][0]["hashes"]
    for bad in ("a", f"a={tmp_path}", f"a={tmp_path / 'a'},a={tmp_path / 'a'}"):
        with pytest.raises(argparse.ArgumentTypeError):
            abt["_trees"](bad)


def test_kernel_ab_times_copies_of_a_module_on_captured_arguments(tmp_path):
    """``scripts/kernel_ab.py`` on the interpreter: the GDN mve call's ``chunk_local_cumsum`` arguments captured
    (both calls, forward and backward), a copy of its module equal to the module itself, a copy whose function
    returns something else reported as different, a file without the function reported as failed; no tfla module's
    attributes replaced, the profile hook removed."""
    import argparse
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    src = (root / "tfla" / "ops" / "common" / "cumsum.py").read_text()
    (tmp_path / "same.py").write_text(src)
    marker = "def chunk_local_cumsum("
    assert src.count(marker) == 1
    (tmp_path / "off.py").write_text(src.replace(marker, "def _orig_cumsum(") + (
        "\n\ndef chunk_local_cumsum(*args, **kwargs):\n    return _orig_cumsum(*args, **kwargs) * 2\n"))
    (tmp_path / "none.py").write_text("x = 1\n")
    kab = _script("kernel_ab.py")
    variants = kab["_variants"](f"base={root / 'tfla/ops/common/cumsum.py'},same={tmp_path / 'same.py'},"
                                f"off={tmp_path / 'off.py'},none={tmp_path / 'none.py'}")
    before = _module_state()
    res = kab["run"]("tfla.ops.common.cumsum:chunk_local_cumsum", variants, ["mve"], "fwdbwd", -1, {}, 1)
    assert sys.getprofile() is None
    after = _module_state()
    changed = [f"{name}.{k}" for name, state in before.items() if name in after
               for k, v in state.items() if k not in after[name] or after[name][k] is not v]
    assert not changed, changed
    row = res["mve"]
    assert row["calls"] == 2
    v = row["variants"]
    assert v["base"]["equal"] == [True] and v["same"]["equal"] == [True] and len(v["same"]["ms"]) == 1
    assert v["off"]["equal"] == [False] and abs(v["off"]["rel"][0] - 1.0) < 1e-6
    assert "AttributeError" in v["none"]["error"]
    text = kab["summarize"](res)
    assert "same:" in text and "equal" in text and "none: FAILED" in text
    assert kab["_overrides"]("a=1,b=false,c=none,d=x") == {"a": 1, "b": False, "c": None, "d": "x"}
    for bad in ("a", f"a={tmp_path / 'missing.py'}", f"a={tmp_path / 'same.py'},a={tmp_path / 'same.py'}"):
        with pytest.raises(argparse.ArgumentTypeError):
            kab["_variants"](bad)


def test_ncu_stages_splits_partitions_and_stages(tmp_path, capsys):
    """``scripts/ncu_stages.py`` on a small source page in ncu's CSV form: two partitions at their register
    allocations, the consumer's stages cut at its mbarrier arrives, shares of samples and stall reasons."""
    hdr = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
           "Instructions Executed", "stall_barrier", "stall_long_sb", "stall_barrier (Not Issued)"]
    rows = [("0x10", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x28", 0, 0, 1, 0, 0),
            ("0x20", "@!P1 BRA 0x10", 10, 10, 100, 0, 10),
            ("0x30", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0", 0, 0, 8, 0, 0),
            ("0x40", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT", 6, 0, 80, 0, 0),
            ("0x50", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 24, 24, 80, 24, 0),
            ("0x60", "@!P0 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR23+0x32850], RZ", 10, 0, 80, 0, 0),
            ("0x70", "BAR.SYNC.DEFER_BLOCKING 0x0, 0x100", 40, 40, 80, 40, 0)]
    path = tmp_path / "rep.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "k"])
        w.writerow(hdr)
        for a, s, n, ni, ex, sb, sl in rows:
            w.writerow([a, s, n, ni, ex, sb, sl, sb])
    ns = _script("ncu_stages.py")
    parsed = ns["read"](str(path))
    assert [r["samples"] for r in parsed] == [0, 10, 0, 6, 24, 10, 40]
    parts = ns["partitions"](parsed)
    assert [(regs, len(p)) for regs, p in parts] == [(40, 2), (240, 5)]
    assert [len(s) for s in ns["stages"](parts[1][1])] == [4, 1]
    out = ns["report"](parsed)
    assert "(240 registers): 88.9% of the samples" in out, out
    assert "stalls: barrier 80.0%" in out, out
    assert "0: 0x30 .. 0x60 | 50.0% | 75.6% | HGMMA.64x64x16.F32.BF16" in out, out
    with open(tmp_path / "bad.csv", "w") as f:
        f.write("a,b\n1,2\n")
    with pytest.raises(ValueError, match="source"):
        ns["read"](str(tmp_path / "bad.csv"))
