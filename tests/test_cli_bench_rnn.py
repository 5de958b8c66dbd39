"""``tfla bench rnn`` end to end (CPU: through the interpreter on tiny workloads): rows, JSON and CSV, the
correctness gate before timing, the torch.nn peer, FlashRNN's rows through a stand-in package, the paper's
workload table, ``--list`` and ``--plot``."""
import csv
import json
import subprocess
import sys
import types

import pytest
import torch

from tfla.cli import main
from tfla.utils.testing import tolerance

TIMING = ["--warmup", "1", "--rep", "5"] if torch.cuda.is_available() else []
TINY = ["--B", "2", "--T", "5", "--dtype", "fp32", "--no-progress", *TIMING]


def _rows(path):
    data = json.loads(path.read_text())
    return data, data["rows"]


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_bench_rnn_small(tmp_path, capsys, mode):
    csv_path, json_path = tmp_path / "r.csv", tmp_path / "r.json"
    rc = main(["bench", "rnn", "--cells", "lstm,gru", "--heads", "6:2,12:1", "--mode", mode, "--impls", "tfla,torch",
               *TINY, "--csv", str(csv_path), "--json", str(json_path)])
    assert rc == 0
    assert "RNN cells" in capsys.readouterr().out
    data, rows = _rows(json_path)
    assert {"flashrnn", "cudnn", "git", "src"} <= set(data["env"])
    # torch.nn only where NH = 1 (one dense recurrent matrix)
    assert [(r["impl"], r["cell"], r["NH"]) for r in rows] == [
        ("tfla", "lstm", 2), ("tfla", "gru", 2), ("tfla", "lstm", 1), ("torch", "lstm", 1), ("tfla", "gru", 1),
        ("torch", "gru", 1)]
    grads = {"tfla": ("dx", "dR", "db"), "torch": ("du", "dW_ih", "db_ih", "dW_hh", "db_hh")}
    # fp32 on CUDA: tfla's tolerance there (tf32x3 dots); cuDNN's LSTM / GRU use TF32 by default (torch's
    # allow_tf32 for cuDNN), ~1e-3 relative
    tol = {"tfla": tolerance(torch.float32), "torch": 1e-3 if torch.cuda.is_available() else 1e-5}
    for r in rows:
        assert r["status"] == "ok" and r["ms"] > 0 and r["first_s"] > 0 and r["mode"] == mode
        assert r["err_h"] < tol[r["impl"]] and r["slice_err_h"] < tol[r["impl"]]
        for g in grads[r["impl"]] if mode == "fwdbwd" else ():
            assert r[f"err_{g}"] < tol[r["impl"]] and r[f"slice_err_{g}"] < tol[r["impl"]]
        assert (r.get("proj_ms") is not None) == (r["impl"] == "torch")
    with open(csv_path, newline="") as f:
        written = list(csv.DictReader(f))
    assert [(w["op"], w["impl"], w["H"], w["K"]) for w in written] == [
        (r["cell"], r["impl"], str(r["NH"]), str(r["D"])) for r in rows]
    assert all("first_s=" in w["notes"] for w in written)


@pytest.fixture
def fake_flashrnn(monkeypatch):
    """A stand-in ``flashrnn`` package whose ``flashrnn`` is tfla's FlashRNN adapter: checks the bench's layout
    conversion (the GRU's gate and bias order) and its gradient mapping without FlashRNN's CUDA kernels."""
    from tfla.compat.flashrnn import flashrnn

    calls = []

    def fn(Wx, R, b, states=None, function="lstm", config=None, backend="cuda_fused", dtype="bfloat16"):
        calls.append((function, backend, dtype, tuple(R.shape), tuple(b.shape)))
        return flashrnn(Wx, R, b, states, function, config, backend, dtype)

    monkeypatch.setitem(sys.modules, "flashrnn", types.SimpleNamespace(flashrnn=fn))
    return calls


def test_bench_rnn_flashrnn_rows(tmp_path, fake_flashrnn):
    json_path = tmp_path / "r.json"
    rc = main(["bench", "rnn", "--cells", "gru,slstm", "--heads", "4:2", "--mode", "fwdbwd", "--impls", "tfla,flashrnn",
               *TINY, "--json", str(json_path)])
    assert rc == 0
    rows = _rows(json_path)[1]
    status = {(r["impl"], r["cell"]): r["status"] for r in rows}
    unavailable = {("flashrnn:cuda_fused", "gru"), ("flashrnn:triton_fused", "gru")}  # as FlashRNN 1.0.8
    assert set(status) == {(i, c) for i in ("tfla", "flashrnn:cuda_fused", "flashrnn:cuda", "flashrnn:triton_fused")
                           for c in ("gru", "slstm")}
    for key, st in status.items():
        assert st.startswith("not available") if key in unavailable else st == "ok", (key, st)
    for r in rows:
        if r["status"] == "ok":
            assert all(r[f"{p}{n}"] < 1e-5 for p in ("err_", "slice_err_") for n in ("h", "dx", "dR", "db"))
    gru_calls = {c for c in fake_flashrnn if c[0] == "gru"}
    assert gru_calls == {("gru", "cuda", "float32", (3, 2, 4, 4), (4, 2, 4))}  # FlashRNN's 4 GRU biases
    speed = [r for r in rows if r["impl"] == "tfla"]
    assert all(r["speedup_vs_flashrnn"] is not None for r in speed)


def test_bench_rnn_refuses_wrong_kernel(monkeypatch, tmp_path, capsys):
    """An op off by 1% is WRONG and not timed (against the fp32 reference and the float64 slice); the command
    fails."""
    import tfla.bench.rnn as bench

    real = bench.tfla_impl

    def broken(cell):
        impl = real(cell)
        make = impl.make

        def make2(inputs, grad):
            fn, lv, back = make(inputs, grad)
            return (lambda: fn() * 1.01), lv, back
        impl.make = make2
        return impl

    monkeypatch.setattr(bench, "tfla_impl", broken)
    json_path = tmp_path / "r.json"
    rc = main(["bench", "rnn", "--cells", "elman", "--heads", "4:1", "--mode", "fwd", "--impls", "tfla", *TINY,
               "--json", str(json_path)])
    assert rc == 1
    assert "WRONG" in capsys.readouterr().out
    (row,) = _rows(json_path)[1]
    assert row["status"].startswith("WRONG (h, slice h") and "ms" not in row


def test_bench_rnn_paths(tmp_path):
    """``tfla:fused`` / ``tfla:alternating``: tfla with its path forced, each checked before timing; the fused path
    is not available above D = 128."""
    json_path = tmp_path / "r.json"
    rc = main(["bench", "rnn", "--cells", "lstm", "--heads", "4:2,130:1", "--mode", "fwd",
               "--impls", "tfla:fused,tfla:alternating", *TINY, "--json", str(json_path)])
    assert rc == 0
    rows = _rows(json_path)[1]
    assert [(r["impl"], r["D"], r["status"][:13]) for r in rows] == [
        ("tfla:fused", 4, "ok"), ("tfla:alternating", 4, "ok"), ("tfla:fused", 130, "not available"),
        ("tfla:alternating", 130, "ok")]
    assert all(r["err_h"] < tolerance(torch.float32) for r in rows if r["status"] == "ok")


def test_paper_workloads_and_list(capsys):
    from tfla.bench.rnn import WORKLOADS

    (head,) = WORKLOADS["headdim"]
    assert head == ((16,), (1024,), ((16, 48), (32, 24), (64, 12), (128, 6), (256, 3), (768, 1)), "D")
    assert all(D * NH == 768 for D, NH in head[2])
    assert [g[2] for g in WORKLOADS["batch"]] == [((64, 12),), ((768, 1),)] == [g[2] for g in WORKLOADS["length"]]
    assert WORKLOADS["batch"][0][0] == (2, 8, 16, 32, 64, 128, 256)
    assert WORKLOADS["length"][0][1] == (256, 512, 1024, 2048)
    assert all(NH == 1 for _, NH in WORKLOADS["max-d"][0][2])
    assert main(["bench", "rnn", "--list", "--workload", "all"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("headdim", "batch", "length", "max-d")) and "implementations:" in out
    assert main(["bench", "rnn", "--list", "--workload", "headdim", "--B", "3", "--T", "7", "--heads", "8:2"]) == 0
    assert "1 workloads" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--impls"):
        main(["bench", "rnn", "--list", "--impls", "cudnn"])


def test_bench_rnn_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "rnn.png"
    rc = main(["bench", "rnn", "--cells", "elman", "--workload", "length", "--heads", "4:1", "--mode", "fwd",
               "--impls", "tfla", "--dtype", "fp32", "--no-progress", *TIMING, "--plot", str(png)])
    assert rc == 0 and png.stat().st_size > 0


def test_help():
    r = subprocess.run([sys.executable, "-m", "tfla", "bench", "rnn", "--help"], check=False, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and all(f in r.stdout for f in ("--workload", "--cells", "--heads", "--impls", "--plot"))
