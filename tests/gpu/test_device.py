"""GPU workers: `--device` resolution everywhere (unit), and the GPU path itself (the flat
buffers on the device, pinned host mirrors, a `local` run on CUDA), which needs a CUDA
device and skips with the reason where there is none."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorbus.bus.shared import SharedAllocator
from tensorbus.nodes.config import WorkerConfig
from tensorbus.nodes.flat import FlatModel
from tensorbus.run.device import resolve

pytestmark = pytest.mark.timeout(200)
ROOT = Path(__file__).resolve().parents[2]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="no CUDA device here: the GPU path needs one (torch "
                                 f"{torch.__version__})")


@pytest.mark.parametrize("name, local_rank, gpus, want", [
    ("cpu", 3, 4, "cpu"),
    ("auto", 0, 0, "cpu"),
    ("auto", 2, 4, "cuda:2"),
    ("cuda", 1, 2, "cuda:1"),
    ("cuda:3", 0, 4, "cuda:3"),
])
def test_devices_resolve(name: str, local_rank: int, gpus: int, want: str) -> None:
    assert resolve(name, local_rank, cuda_devices=gpus) == want


@pytest.mark.parametrize("name, local_rank, gpus, error", [
    ("cuda", 0, 0, "--device cuda: this machine has no CUDA device"),
    ("cuda:0", 0, 0, "--device cuda:0: this machine has no CUDA device"),
    ("auto", 4, 4, "--device auto: local rank 4 asks for GPU 4, and this machine has 4 (0..3)"),
    ("cuda:7", 0, 2, "--device cuda:7: cuda:7 asks for GPU 7, and this machine has 2 (0..1)"),
    ("gpu", 0, 1, "--device gpu: choose auto, cpu, cuda or cuda:N"),
])
def test_impossible_devices_are_refused(name: str, local_rank: int, gpus: int, error: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(error)):
        resolve(name, local_rank, cuda_devices=gpus)


def test_a_worker_config_takes_cpu_or_cuda_n() -> None:
    assert WorkerConfig(connect="tcp://127.0.0.1:1", device="cuda:0").device == "cuda:0"
    with pytest.raises(ValueError, match="device must be cpu or cuda:N"):
        WorkerConfig(connect="tcp://127.0.0.1:1", device="auto")


def test_on_the_cpu_the_host_mirrors_are_the_buffers() -> None:
    flat = FlatModel(torch.nn.Linear(4, 3))
    assert flat.host_grads is flat.grads and flat.host_weights is flat.weights
    flat.stage(weights=False)  # nothing to do


@CUDA
def test_the_flat_model_on_a_gpu_stages_through_pinned_memory() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    flat = FlatModel(model, "cuda:0")
    assert all(w.is_cuda for w in flat.weights) and all(g.is_cuda for g in flat.grads)
    assert all(h.is_pinned() and not h.is_cuda for h in (*flat.host_grads, *flat.host_weights))
    assert all(p.is_cuda for p in model.parameters())
    model(torch.randn(5, 8, device="cuda:0")).sum().backward()
    flat.gather_grads()
    flat.stage(weights=False)
    for host, dev in zip(flat.host_grads, flat.grads, strict=True):
        assert torch.equal(host, dev.cpu())
    received = [torch.randn(b.numel) for b in flat.layout.buckets]  # as from the wire
    flat.load(received)
    flat.stage(weights=True)
    for host, sent in zip(flat.host_weights, received, strict=True):
        assert torch.equal(host, sent)


@CUDA
def test_on_a_gpu_the_pushed_mirrors_move_into_shared_memory() -> None:
    """A coordinator on this host reads pushes by reference: on a GPU what is pushed is the
    gradients' host mirrors, which move into shared memory, page-locked there."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    flat = FlatModel(model, "cuda:0")
    shm = SharedAllocator()
    try:
        flat.share_grads(shm.allocate)
        flat.use_grad_sets(2)  # (async's second set goes there too)
        for _ in range(2):
            assert all(shm.locate(h) is not None and h.is_pinned() for h in flat.host_grads)
            assert all(g.is_cuda for g in flat.grads)
            flat.begin_backward()
            model(torch.randn(5, 8, device="cuda:0")).sum().backward()
            flat.gather_grads()
            flat.stage(weights=False)
            for host, dev in zip(flat.host_grads, flat.grads, strict=True):
                assert torch.equal(host, dev.cpu())
            flat.swap()
    finally:
        shm.close()


def _local(*options: str, tmp: Path) -> dict[str, Any]:
    """The summary of `local examples/digits.py` on 2 workers for 20 steps, with `options`."""
    metrics = tmp / f"m{len(list(tmp.iterdir()))}.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "tensorbus", "local", str(ROOT / "examples" / "digits.py"),
         "--workers", "2", "--steps", "20", "--threads", "1", "--no-progress", "--metrics",
         str(metrics), *options], cwd=ROOT, capture_output=True, text=True, timeout=100, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    summary: dict[str, Any] = json.loads(metrics.read_text().splitlines()[-1])
    return summary


@CUDA
def test_local_trains_on_the_gpu(tmp_path: Path) -> None:
    """The issue's command, on the digits: 2 workers on CUDA, the same answer as the CPU's
    up to float differences of the device; pushes by reference through shared memory, or
    as bytes without it."""
    cpu = _local("--device", "cpu", tmp=tmp_path)
    shared = _local("--device", "cuda", tmp=tmp_path)
    private = _local("--device", "cuda", "--no-shared-memory", tmp=tmp_path)
    for gpu, by_reference in ((shared, 20), (private, 0)):
        assert gpu["steps"] == 20
        assert gpu["test_loss"] == pytest.approx(cpu["test_loss"], abs=1e-3)
        assert [w["by_reference"] for w in gpu["per_worker"].values()] == [by_reference] * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: nothing to refuse")
def test_cuda_without_a_gpu_is_one_line() -> None:
    """The README's Errors row, word for word."""
    done = subprocess.run(
        [sys.executable, "-m", "tensorbus", "local", str(ROOT / "examples" / "digits.py"),
         "--workers", "1", "--steps", "1", "--device", "cuda"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        (f"tensorbus: error: --device cuda: this machine has no CUDA device that torch "
        f"{torch.__version__} can use: use --device cpu (or auto)")]
