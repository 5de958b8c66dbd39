"""Test setup: without a CUDA GPU every kernel runs through Triton's CPU interpreter, which must be
chosen before anything imports triton (so this happens here, first)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Under pytest-xdist every worker would run PyTorch's CPU ops (the float64 references) on all the host's cores: 12
# workers on a 16-core GPU host left the GDN backward's float64 recurrences to 192 threads, and single tests ran for
# minutes. Four processes of that recurrence on 2 cores took 70-128 s each at 2 threads and 20-22 s at 1 (torch 2.13
# CPU, 2026-11-29). Each worker takes its share of the cores instead.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def poison_empty(monkeypatch):
    """Make every ``torch.empty``/``empty_like`` float allocation NaN-filled, so an output element a
    kernel never writes shows up as NaN instead of as plausible garbage."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty_like(*args, **kwargs):
        t = real_empty_like(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
