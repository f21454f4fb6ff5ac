"""System: data() may be a generator function, as a SPEC author writes it first: it is
called anew for each epoch, and --epochs counts passes whose length each worker learns as
its first pass ends. The run makes the versions and samples that the same batches as a
list make, under every strategy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import zygote

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def _spec(tmp_path: Path, generator: bool) -> Path:
    calls = tmp_path / "calls.txt"
    spec = tmp_path / ("generated.py" if generator else "listed.py")
    spec.write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'examples')!r})\n"
        "from digits import model, loss, evaluate, data as _data\n\n\n"
        + ("def data(rank, world_size, batch_size):\n"
           f"    with open({str(calls)!r}, 'a') as f:\n"
           "        f.write(f'{rank}\\n')\n"
           "    yield from _data(rank, world_size, batch_size)\n" if generator else
           "def data(rank, world_size, batch_size):\n"
           "    return list(_data(rank, world_size, batch_size))\n"))
    return spec


def _run(spec: Path, strategy: list[str], *options: str) -> dict:
    done = zygote.tensorbus("local", str(spec), "--workers", "2", "--epochs", "2",
                            "--batch-size", "64", *strategy, "--threads", "1", "--no-progress",
                            "--json", *options, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("strategy", [
    ["--strategy", "sync"], ["--strategy", "ssp", "--staleness", "1"], ["--strategy", "async"],
    ["--strategy", "average", "--average-every", "2"]], ids=["sync", "ssp", "async", "average"])
def test_a_generator_function_makes_two_passes_as_a_list_does(tmp_path: Path,
                                                              strategy: list[str]) -> None:
    listed = _run(_spec(tmp_path, generator=False), strategy)
    generated = _run(_spec(tmp_path, generator=True), strategy)
    assert generated["steps"] == listed["steps"] > 0
    assert generated["samples"] == listed["samples"]
    calls = (tmp_path / "calls.txt").read_text().split()
    # Called anew for each epoch: twice a rank at least (a worker may begin a third pass
    # with the batch it computes while the run ends). Under async, once the run's length
    # is known, a faster rank goes on past its two passes and a slower one makes fewer
    # (under load, one), but the two epochs of batches take four calls at least.
    if strategy != ["--strategy", "async"]:
        assert all(calls.count(rank) >= 2 for rank in ("0", "1")), calls
    assert len(calls) >= 4 and {"0", "1"} <= set(calls), calls


def test_under_async_a_worker_far_ahead_waits_for_the_runs_length(tmp_path: Path) -> None:
    """Rank 1 takes 10 times as long a step: rank 0 has had its 2 passes long before rank
    1's first pass ends and says the run's length. Its updates past them wait (one is
    dropped and its answer held) instead of taking the run past a length not known yet
    (697 versions, not 44, before they did)."""
    summary = _run(_spec(tmp_path, generator=True), ["--strategy", "async"],
                   "--fault", "slow:0:10", "--fault", "slow:1:100")
    assert summary["steps"] == 44 and summary["samples"] == 44 * 64
    assert summary["dropped"] == {"past_epochs": 1}
    assert summary["per_worker"]["0"]["held_s"] > 0.5
