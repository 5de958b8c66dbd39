"""``tfla bench decode`` end to end (CPU: the interpreter at its small default shapes): a row per mode and batch,
checked before timing against the float64 recurrence, the JSON and CSV rows, FLA's rows through a stand-in module
(state mode only, ``FLA_FLASH_QLA=0`` during its calls), a wrong peer refused, and argparse errors."""
import csv
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from tfla.cli import main

GPU = torch.cuda.is_available()
TIMING = ["--warmup", "1", "--rep", "5"] if GPU else []
# the interpreter's defaults made explicit (B = 1, 3, H = 1, HV = 2, K = V = 16, fp32); on a GPU a small bf16 run
SMALL = ["--B", "1,3", "--H", "1", "--HV", "2", "--K", "16", "--V", "16", "--no-progress", *TIMING]
TOL = 2e-2 if GPU else 1e-3  # the bench's bf16 / fp32 tolerances (tfla.bench.gdn.TOLERANCE)


def test_bench_decode_small(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "fla", None)  # FLA not importable here, installed or not
    json_path, csv_path = tmp_path / "d.json", tmp_path / "d.csv"
    assert main(["bench", "decode", *SMALL, "--json", str(json_path), "--csv", str(csv_path)]) == 0
    out = capsys.readouterr().out
    assert "Gated DeltaNet decode" in out and ("TB/s" in out if GPU else "GPU only" in out)
    assert "not available (skipped): fla (ModuleNotFoundError" in out
    data = json.loads(json_path.read_text())
    rows = data["rows"]
    assert [(r["impl"], r["B"], r["mode"]) for r in rows] == [
        ("tfla", 1, "state"), ("tfla", 1, "pool"), ("tfla", 3, "state"), ("tfla", 3, "pool")]
    for r in rows:
        assert r["status"] == "ok" and r["T"] == 1 and (r["H"], r["HV"], r["K"], r["V"]) == (1, 2, 16, 16)
        assert r["ms"] > 0 and r["us"] == pytest.approx(r["ms"] * 1e3) and r["first_s"] > 0
        assert r["err_o"] < TOL and r["err_state"] < TOL
        assert all((r.get(c) is not None) == GPU for c in ("graph_ms", "copy_ms", "x_copy", "gbps"))
        assert (r.get("x_floor") is not None) == (GPU and data["env"]["hbm_tbps"] is not None)
    assert data["env"]["src"] and data["env"]["missing_peers"].startswith("fla (")
    with open(csv_path, newline="") as f:
        written = list(csv.DictReader(f))
    assert [(w["op"], w["impl"], w["B"], w["mode"]) for w in written] == [
        ("fused_recurrent_gated_delta_rule", "tfla", str(r["B"]), r["mode"]) for r in rows]
    assert all(f"first_s={r['first_s']:.2f}" in w["notes"].split() for w, r in zip(written, rows))


def test_spec_tbps():
    """The x-floor column's bandwidth from the device name: H100 SXM / PCIe / NVL and H200 by their data sheets, none
    for other names."""
    from tfla.bench.decode import spec_tbps

    assert spec_tbps("NVIDIA H100 80GB HBM3") == 3.35
    assert spec_tbps("NVIDIA H100 PCIe") == 2.0
    assert spec_tbps("NVIDIA H100 NVL") == 3.9
    assert spec_tbps("NVIDIA H200") == 4.8
    assert spec_tbps("NVIDIA A100-SXM4-80GB") is None


def _fake_fla(monkeypatch, scale_o: float = 1.0):
    """A stand-in ``fla.ops.gated_delta_rule`` whose fused recurrent op is tfla's (o times ``scale_o``); it records
    ``FLA_FLASH_QLA`` at each call."""
    import tfla

    seen = []

    def op(q, k, v, g=None, beta=None, initial_state=None, output_final_state=False, **kw):
        seen.append(os.environ.get("FLA_FLASH_QLA"))
        o, s = tfla.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=initial_state,
                                                     output_final_state=output_final_state, **kw)
        return o * scale_o, s

    mods = {n: types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.gated_delta_rule")}
    mods["fla.ops.gated_delta_rule"].fused_recurrent_gated_delta_rule = op
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return seen


def test_bench_decode_fla_rows_state_mode_only(monkeypatch, tmp_path, capsys):
    seen = _fake_fla(monkeypatch)
    json_path = tmp_path / "d.json"
    assert main(["bench", "decode", *SMALL, "--B", "2", "--json", str(json_path)]) == 0
    rows = json.loads(json_path.read_text())["rows"]
    assert [(r["impl"], r["mode"]) for r in rows] == [("tfla", "state"), ("fla", "state"), ("tfla", "pool")]
    assert all(r["status"] == "ok" for r in rows) and set(seen) == {"0"}
    assert rows[1]["speedup_vs_fla"] == pytest.approx(1.0)
    t = "graph_ms" if GPU else "ms"  # device times on a GPU (graph replays), else the interpreter's wall clock
    assert all(r["speedup_vs_fla"] == pytest.approx(rows[1][t] / r[t]) for r in rows)
    assert "vs FLA" in capsys.readouterr().out


def test_bench_decode_refuses_wrong_peer(monkeypatch, tmp_path):
    _fake_fla(monkeypatch, scale_o=1.05)
    json_path = tmp_path / "d.json"
    rc = main(["bench", "decode", *SMALL, "--B", "1", "--modes", "state", "--json", str(json_path)])
    assert rc == 0  # only tfla's rows decide the exit status
    tfla_row, fla_row = json.loads(json_path.read_text())["rows"]
    assert tfla_row["status"] == "ok"
    assert fla_row["status"].startswith("WRONG (o rel-L2") and "ms" not in fla_row and fla_row["err_state"] < TOL


@pytest.mark.parametrize("flags", [["--modes", "state,paged"], ["--modes", ""], ["--B", "1,x"], ["--B", "0"],
                                   ["--B", ""], ["--impls", "tfla,vllm"], ["--T", "0"]])
def test_bench_decode_bad_arguments(flags, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "decode", *flags])
    assert e.value.code == 2
    assert f"argument {flags[0]}" in capsys.readouterr().err


def test_bench_decode_help():
    r = subprocess.run([sys.executable, "-m", "tfla", "bench", "decode", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and all(f in r.stdout for f in ("--modes", "--B", "--T", "--hbm-tbps"))


def test_uncapturable_impl_keeps_eager_times(monkeypatch, device):
    """An implementation whose call cannot be captured in a CUDA graph keeps its row: graph_ms None, the derived
    columns from its eager time, the table naming why (the GPU path run with the capture stubbed and the copy floor given)."""
    from tfla.bench import decode

    def no_capture(*a, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decode, "graph_ms", no_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    wl = decode.Workload(1, 1, 1, 2, 16, 16, "fp32")
    x = decode.decode_inputs(wl, device, 0)
    ref_o, ref_s = decode.reference(x)
    args = types.SimpleNamespace(warmup=1, rep=5)
    row = decode._check_and_time(decode.tfla_impl(), x, "state", "cuda", wl, {}, ref_o, ref_s, args, 3.35, 0.5)
    assert row["status"] == "ok" and row["graph_ms"] is None and "stream is capturing" in row["graph_note"]
    assert row["x_copy"] == pytest.approx(row["ms"] / 0.5)
    assert row["x_floor"] == pytest.approx(row["ms"] * 1e-3 / (wl.floor_bytes() / 3.35e12))
