"""System: --seed makes a run reproducible, dropout included: the same command twice gives
bit-identical weights, for sync and for average; another seed, other weights (the dropout
masks matter, so the check can fail)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import zygote

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)

SPEC = f"""
import sys
sys.path.insert(0, {str(ROOT / "examples")!r})
import torch
from torch import nn
from digits import data, loss, evaluate


def model():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(64, 10))
"""


def _final_weights(tmp_path: Path, name: str, strategy: list[str], seed: int) -> torch.Tensor:
    spec = tmp_path / "dropout.py"
    spec.write_text(SPEC)
    checkpoints = tmp_path / name
    done = zygote.tensorbus("local", str(spec), "--workers", "2", "--steps", "20",
                            "--batch-size", "16", "--seed", str(seed), *strategy,
                            "--checkpoint-dir", str(checkpoints), "--threads", "1",
                            "--no-progress", timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    (path,) = checkpoints.glob("ckpt-*.pt")
    state = torch.load(path, weights_only=True)
    return torch.cat([w.flatten() for w in state["weights"]])


@pytest.mark.parametrize("strategy", [["--strategy", "sync"],
                                      ["--strategy", "average", "--average-every", "2"]],
                         ids=["sync", "average"])
def test_the_same_seed_gives_the_same_bits_with_dropout(tmp_path: Path,
                                                        strategy: list[str]) -> None:
    first = _final_weights(tmp_path, "first", strategy, seed=3)
    again = _final_weights(tmp_path, "again", strategy, seed=3)
    other = _final_weights(tmp_path, "other", strategy, seed=4)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
