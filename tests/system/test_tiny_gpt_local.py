"""examples/tiny_gpt.py as issue 39's DiLoCo runs it: `tensorbus local` with average,
AdamW inside each worker, Nesterov outside on the coordinator, and int4 pushes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import zygote

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def test_diloco_with_int4_pushes_trains_the_language_model() -> None:
    if not Path("/usr/share/games/fortunes/fortunes").exists():
        pytest.skip("needs Debian's fortunes package (apt-get install fortunes)")
    done = zygote.shared().run(
        ["local", "examples/tiny_gpt.py", "--workers", "2", "--strategy", "average",
         "--average-every", "8", "--outer-lr", "0.7", "--outer-momentum", "0.9", "--nesterov",
         "--compress", "int4", "--steps", "3", "--batch-size", "16", "--threads", "1",
         "--no-progress", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=100, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["steps"] == 3 and summary["samples"] == 3 * 2 * 8 * 16
    # 48 AdamW steps of 16 windows a worker: from 8 bits a byte (a uniform guess) to the
    # frequent bytes of English, at least.
    assert summary["bits_per_byte"] < 5.5, summary
