"""Unit: what a run prints when it ends (run.summary), and the progress line that log lines
do not glue onto (run.progress)."""

from __future__ import annotations

import io
import signal
from pathlib import Path

import pytest

from tensorbus.run.progress import ProgressLine
from tensorbus.run.summary import after_a_signal, stopped_by, table

SUMMARY = {
    "event": "summary", "strategy": "sync", "workers": 4, "steps": 234, "samples": 59904,
    "wall_s": 9.21, "train_s": 2.93, "final_loss": 0.48696, "dropped": {"late": 3},
    "rejected": {}, "max_staleness": 0, "max_clock_gap": 0, "broadcasts": 234, "lost": [],
    "ended": "reached 1 epoch", "resumed_from": None, "stopped_by": None, "checkpoint": None,
    "per_worker": {"0": {"pushes": 234}}, "accuracy": 0.82, "test_loss": 0.5023,
}


def test_the_table_holds_the_main_figures_and_evaluate_s() -> None:
    assert table(SUMMARY, Path("m.jsonl")).splitlines() == [
        "sync, 4 workers: 234 versions, 59904 samples in 2.9 s of training (9.2 s in all)",
        "  final loss   0.4870",
        "  accuracy     0.8200",
        "  test_loss    0.5023",
        "  dropped      3 late",
        "  lost         none",
        "  ended        reached 1 epoch",
        "  every step and the whole summary: m.jsonl",
    ]
    assert table(SUMMARY, None).splitlines()[-1] == (
        "  (--metrics FILE.jsonl keeps every step and the whole summary)")


def test_a_worker_that_failed_is_said_on_a_line_of_its_own() -> None:
    failed = {**SUMMARY, "failed": [{"rank": 1, "version": 31, "why": "RuntimeError: boom"}]}
    lines = table(failed, None).splitlines()
    assert lines[lines.index("  lost         none") + 1] == (
        "  failed       worker 1 at version 31: RuntimeError: boom")
    assert not any(line.startswith("  failed") for line in table(SUMMARY, None).splitlines())


def test_a_run_stopped_by_a_signal_says_what_was_saved_and_how_to_go_on() -> None:
    assert stopped_by(SUMMARY) is None
    saved = {**SUMMARY, "stopped_by": "SIGINT", "steps": 57, "checkpoint": "ck/ckpt-000000057.pt"}
    assert stopped_by(saved) is signal.SIGINT
    assert after_a_signal(saved) == ("stopped by SIGINT at version 57: checkpoint "
                                      "ck/ckpt-000000057.pt: run the same command with "
                                      "--resume to go on")
    unsaved = {**saved, "checkpoint": None}
    assert after_a_signal(unsaved) == ("stopped by SIGINT at version 57: nothing was saved "
                                       "(--checkpoint-dir DIR keeps a run's state)")
    assert stopped_by({**SUMMARY, "stopped_by": "a test"}) is None  # (from Python: no signal)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_written_under_the_progress_bar_clears_it_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorbus.nodes.coordinator import Progress

    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    line = ProgressLine(terminal, every_s=0.0)
    with line.above():
        import sys

        line(Progress(1, 10, 0.5, 64, 1.0, 0.1))
        print("a log line", file=sys.stderr)
        line(Progress(2, 10, 0.4, 128, 2.0, 0.2))
    line.close()
    written = terminal.getvalue()
    # The bar is taken off ("\r" and erase to the line's end) before the log line, which
    # thus starts a line of its own; the next step draws the bar again.
    before, after = written.split("a log line\n")
    assert before.endswith("\r\x1b[K") and before.count("v1/10") == 1
    assert "v2/10" in after and after.endswith("\n")
