"""System: the trained model leaves a run as a plain state_dict: `--save FILE.pt` at the
end (one coordinator, or each worker serving a shard), and `tensorbus export` of its
checkpoint. Either loads into a fresh model() and scores the summary's accuracy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import zygote

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "examples" / "digits.py")

pytestmark = pytest.mark.timeout(120)


def _score(path: Path) -> float:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import digits
    finally:
        sys.path.pop(0)
    model = digits.model()
    model.load_state_dict(torch.load(path, weights_only=True))  # strict: every name, no other
    return float(digits.evaluate(model)["accuracy"])


@pytest.mark.parametrize("layout", [[], pytest.param(["--colocate"], marks=pytest.mark.colocated)],
                         ids=["one coordinator", "colocated"])
def test_the_saved_and_the_exported_model_score_the_summarys_accuracy(
        tmp_path: Path, layout: list[str]) -> None:
    saved, checkpoints, exported = tmp_path / "model.pt", tmp_path / "ck", tmp_path / "e.pt"
    done = zygote.tensorbus("local", DIGITS, "--workers", "2", "--steps", "40", "--threads", "1",
                            "--no-progress", "--json", "--save", str(saved),
                            "--checkpoint-dir", str(checkpoints), *layout, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    accuracy = json.loads(done.stdout)["accuracy"]
    assert accuracy > 0.3  # (trained: chance is 0.1)
    assert _score(saved) == pytest.approx(accuracy, abs=1e-6)
    if layout:
        return  # (each colocated shard checkpoints its own range: nothing whole to export)
    done = zygote.tensorbus("export", str(checkpoints), "-o", str(exported), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == f"wrote the model of {checkpoints}/ckpt-000000040.pt to {exported}"
    assert _score(exported) == pytest.approx(accuracy, abs=1e-6)


def test_what_cannot_be_saved_or_exported_is_said_at_once(tmp_path: Path) -> None:
    nowhere = zygote.tensorbus("local", DIGITS, "--workers", "2", "--steps", "4",
                               "--save", "/nonexistent/m.pt", timeout=60)
    assert (nowhere.returncode, nowhere.stderr) == (2, (
        "tensorbus: error: cannot write --save /nonexistent/m.pt: /nonexistent is not a "
        "folder: give a file's path in a folder you can write in\n"))
    shard = zygote.tensorbus("coordinator", DIGITS, "--workers", "1", "--shard", "0/2",
                             "--save", str(tmp_path / "m.pt"), timeout=60)
    assert shard.returncode == 2 and "--save writes the whole model" in shard.stderr
    empty = zygote.tensorbus("export", str(tmp_path), "-o", str(tmp_path / "m.pt"), timeout=60)
    assert (empty.returncode, empty.stderr) == (2, f"tensorbus: error: {tmp_path} holds no checkpoint\n")
