"""The main job, ``tfla bench gdn``, runs end to end (CPU: through the interpreter on a tiny workload)."""
import csv
import datetime
import json
import subprocess
import sys

import pytest
import torch

from tfla.cli import main


def test_bench_gdn_small(tmp_path, capsys):
    csv_path, json_path = tmp_path / "r.csv", tmp_path / "r.json"
    args = ["bench", "gdn", "--T", "70,130", "--B", "1", "--H", "1", "--HV", "2", "--K", "16", "--V", "16",
            "--variants", "default,save_v_new", "--dtype", "fp32", "--no-progress", "--csv", str(csv_path), "--json",
            str(json_path)]
    if torch.cuda.is_available():
        args += ["--warmup", "1", "--rep", "5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "save_v_new" in out and "Gated DeltaNet fwd" in out  # (rich may wrap the label)
    data = json.loads(json_path.read_text())
    rows = [r for r in data["rows"] if r["impl"].startswith("tfla")]
    assert len(rows) == 4 and all(r["status"] == "ok" and r["ms"] > 0 for r in rows)
    assert all(r["err_o"] < 1e-5 for r in rows)
    assert all(r["first_s"] > 0 for r in rows) and "first call s" in out  # the first call's wall time
    # the host time per call (CUDA only: the interpreter's calls are all host)
    assert "host ms" in out and all((r["host_ms"] > 0) if torch.cuda.is_available() else r["host_ms"] is None
                                    for r in rows)
    assert data["env"]["torch"] == torch.__version__
    with open(csv_path, newline="") as f:
        assert [r["impl"] for r in csv.DictReader(f)] == [r["impl"] for r in rows]


def test_bench_csv_appends_rows(tmp_path):
    """``--csv``: the fixed columns, a header once, one row per timed implementation appended on each run."""
    import re

    from tfla.bench.common import CSV_COLUMNS

    csv_path = tmp_path / "results.csv"
    args = ["bench", "gdn", "--T", "70", "--B", "1", "--H", "1", "--HV", "2", "--K", "16", "--V", "16",
            "--variants", "default,save_v_new", "--dtype", "fp32", "--impls", "tfla", "--no-progress", "--csv",
            str(csv_path)]
    if torch.cuda.is_available():
        args += ["--warmup", "1", "--rep", "5"]
    assert main(args) == 0
    with open(csv_path, newline="") as f:
        header = next(csv.reader(f))
    assert header == list(CSV_COLUMNS) == ["date", "commit", "device", "torch", "triton", "op", "impl", "B", "T", "H",
                                           "HV", "K", "V", "dtype", "mode", "ms", "peak_mib", "notes"]
    assert main(args) == 0
    text = csv_path.read_text()
    assert text.count("date,commit,") == 1
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["impl"] for r in rows] == ["tfla", "tfla save_v_new"] * 2
    for r in rows:
        assert datetime.datetime.fromisoformat(r["date"]).utcoffset() == datetime.timedelta(0)
        assert re.fullmatch(r"[0-9a-f]{4,40}|", r["commit"])  # git rev-parse --short HEAD, or "" without git
        assert r["torch"] == torch.__version__ and r["op"] == "chunk_gated_delta_rule"
        assert (r["B"], r["T"], r["H"], r["HV"], r["K"], r["V"], r["dtype"], r["mode"]) == \
            ("1", "70", "1", "2", "16", "16", "fp32", "fwd")
        assert float(r["ms"]) > 0 and (r["peak_mib"] == "") == (not torch.cuda.is_available())
        assert re.fullmatch(r"src=[0-9a-f]{12}", r["notes"].split()[0])  # the source hash of env_info


def test_bench_csv_refuses_other_columns(tmp_path, capsys):
    """A ``--csv`` file written with other columns is refused before anything runs, and left as it was."""
    csv_path = tmp_path / "old.csv"
    csv_path.write_text("impl,ms\ntfla,1.0\n")
    with pytest.raises(SystemExit, match="other columns"):
        main(["bench", "gdn", "--T", "64", "--H", "1", "--K", "16", "--V", "16",
              "--dtype", "fp32", "--no-progress", "--impls", "tfla", "--csv", str(csv_path)])
    assert csv_path.read_text() == "impl,ms\ntfla,1.0\n"


@pytest.mark.parametrize("mode,variants", [("fwdbwd", "default,save_v_new,save_states"), ("bwd", "default")])
def test_bench_gdn_backward_modes(tmp_path, capsys, mode, variants):
    json_path = tmp_path / "r.json"
    args = ["bench", "gdn", "--mode", mode, "--T", "100", "--B", "1", "--H", "1", "--HV", "2", "--K", "16",
            "--V", "16", "--variants", variants, "--dtype", "fp32", "--no-progress", "--json", str(json_path)]
    if torch.cuda.is_available():
        args += ["--warmup", "1", "--rep", "5"]
    assert main(args) == 0
    assert f"Gated DeltaNet {mode}" in capsys.readouterr().out
    rows = [r for r in json.loads(json_path.read_text())["rows"] if r["impl"].startswith("tfla")]
    labels = {"default": "tfla", "save_v_new": "tfla save_v_new", "save_states": "tfla save_states"}
    assert [r["impl"] for r in rows] == [labels[s] for s in variants.split(",")]
    for row in rows:
        assert row["status"] == "ok" and row["ms"] > 0
        assert all(row[f"err_{n}"] < 1e-5 for n in ("dq", "dk", "dv", "dbeta")) and row["err_dg"] < 5e-5
        # the memory held from forward to backward: measured on a GPU (the default, FLA's saved set, holds the least)
        assert (row["held_mib"] is None) == (not torch.cuda.is_available())
    if torch.cuda.is_available() and len(rows) > 1:
        held = {r["impl"]: r["held_mib"] for r in rows}
        assert held["tfla"] <= held["tfla save_v_new"] <= held["tfla save_states"]


def test_bench_gdn_rejects_bad_variants(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "gdn", "--variants", "default,big", "--no-progress"])
    assert "--variants" in capsys.readouterr().err


def test_bench_refuses_wrong_kernel(monkeypatch, capsys):
    """A kernel whose output is off is reported WRONG and not timed (and the command fails)."""
    import tfla.bench.registry as reg

    real = reg.tfla_impl

    def broken(variant):
        impl = real(variant)
        fn = impl.fn
        impl.fn = lambda x, **kw: (lambda o, s: (o * 1.01, s))(*fn(x, **kw))
        return impl

    monkeypatch.setattr(reg, "tfla_impl", broken)
    rc = main(["bench", "gdn", "--T", "64", "--H", "1", "--K", "16", "--V", "16",
               "--dtype", "fp32", "--no-progress", "--impls", "tfla"])
    assert rc == 1
    assert "WRONG" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["-m", "tfla", "bench", "gdn", "--help"]])
def test_module_entry_point(argv):
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--variants" in r.stdout


def test_bench_gdn_named_workloads(tmp_path, capsys):
    """``--workload qwen3-next``: packed varlen (a length-0 and a length-1 sequence), HV = 2H, l2norm and gate in the
    op, initial states; checked against the float32 reference with the same prologue before it is timed."""
    json_path = tmp_path / "w.json"
    main(["bench", "gdn", "--workload", "qwen3-next", "--dtype", "fp32", "--impls", "tfla", "--no-progress",
          "--json", str(json_path)])
    rows = json.loads(json_path.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["tfla"]
    r = rows[0]
    assert r["status"] == "ok" and r["workload"] == "qwen3-next" and "varlen N=6 l2norm+gate" in r["label"]
    assert r["HV"] == 2 * r["H"] and r["err_o"] < 1e-5


def test_bench_gdn_layer_lens(tmp_path, capsys):
    """``--lens``: the layer's packed sequences in another order (the rows say which); a bad list or another
    workload is a clear error."""
    json_path = tmp_path / "w.json"
    main(["bench", "gdn", "--workload", "qwen3-next", "--lens", "9,0,40,1,30", "--dtype", "fp32", "--impls", "tfla",
          "--no-progress", "--json", str(json_path)])
    r = json.loads(json_path.read_text())["rows"][0]
    assert r["status"] == "ok" and r["T"] == 80 and r["lens"] == "9,0,40,1,30" and r["err_o"] < 1e-5
    for argv, match in ((["--workload", "qwen3-next", "--lens", "0,0"], "--lens"), (["--workload", "mve", "--lens",
                                                                                     "5,6"], "qwen3-next")):
        with pytest.raises(ValueError, match=match):
            main(["bench", "gdn", *argv, "--impls", "tfla", "--no-progress"])


def test_bench_gdn_sweep_plot(tmp_path, capsys):
    """``--workload sweep --plot``: one timed row per T, and the plot file written."""
    pytest.importorskip("matplotlib")
    json_path, png = tmp_path / "s.json", tmp_path / "s.png"
    main(["bench", "gdn", "--workload", "sweep", "--dtype", "fp32", "--impls", "tfla", "--no-progress",
          "--json", str(json_path), "--plot", str(png)])
    # forward + backward: the memory held for the backward in the rows (a second panel of the plot on a GPU)
    main(["bench", "gdn", "--workload", "sweep", "--mode", "fwdbwd", "--dtype", "fp32", "--impls", "tfla",
          "--variants", "default", "--no-progress", "--json", str(json_path), "--plot", str(png)])
    rows = json.loads(json_path.read_text())["rows"]
    assert all(r["status"] == "ok" and "held_mib" in r for r in rows) and png.stat().st_size > 1000
    rows = json.loads(json_path.read_text())["rows"]
    want = [64, 128, 256] if not torch.cuda.is_available() else [2048, 8192, 32768, 65536]  # the device's sweep
    assert sorted(r["T"] for r in rows) == want and all(r["status"] == "ok" for r in rows)
    assert png.stat().st_size > 1000


def test_bench_gdn_plot_memory_panel(tmp_path):
    """The plot's memory panel (drawn where rows carry memory, on a GPU): peak and held lines per implementation,
    from rows as ``tfla bench gdn --mode fwdbwd`` writes them."""
    pytest.importorskip("matplotlib")
    from tfla.bench.gdn import plot

    rows = [{"impl": impl, "mode": "fwdbwd", "T": T, "ms": 0.1 * T / 64 * f, "peak_mib": 10.0 * T / 64 * f,
             "held_mib": 3.0 * T / 64 * f} for impl, f in (("tfla", 1.0), ("fla", 2.0)) for T in (2048, 8192)]
    meta = {"device": "test", "torch": "-", "triton": "-", "date": "-"}

    def width(rows_, name):  # the PNG's width in pixels (its IHDR chunk)
        png = tmp_path / name
        plot(rows_, meta, str(png))
        return int.from_bytes(png.read_bytes()[16:20], "big")

    # two panels (12 inches at 150 dpi) with memory, one (6.4 inches) without
    assert width(rows, "m.png") == 1800
    assert width([{k: v for k, v in r.items() if not k.endswith("_mib")} for r in rows], "t.png") == 960
