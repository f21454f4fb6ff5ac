"""Unit: why a run failed, as typed errors with fields (nodes.failures); each one's line is
said from its fields, and docs/errors.md shows exactly these lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorbus.nodes.failures import (
    FAILURES,
    Diverged,
    JoinTimedOut,
    NoVersionMade,
    TooFewWorkers,
    TrainingError,
)

ERRORS = Path(__file__).resolve().parents[2] / "docs" / "errors.md"


@pytest.mark.parametrize("failure", [e for cls in FAILURES for e in cls.examples()], ids=repr)
def test_the_errors_table_shows_each_failure_as_it_says_itself(failure: TrainingError) -> None:
    assert f"`tensorbus: error: {failure}`" in ERRORS.read_text()


def test_every_failure_is_a_training_error_whose_line_is_its_str() -> None:
    for cls in FAILURES:
        for failure in cls.examples():
            assert isinstance(failure, TrainingError)
            assert str(failure) == failure.args[0] and "\n" not in str(failure)


def test_the_fields_say_it_all() -> None:
    waiting = Diverged(ranks=(1, 3), window=8, version=12, waiting=(0,))
    assert str(waiting).startswith("the last 8 updates of workers 1 and 3 were not finite "
                                   "(NaN or inf), at version 12, while worker 0 waits for them")
    assert str(waiting).endswith("; or training is diverging: lower --lr")
    gone = TooFewWorkers(live=0, minimum=1, version=313, why="worker 1: data() raised")
    assert str(gone) == "no worker is left at version 313: worker 1: data() raised"
    late = JoinTimedOut(joined=1, wanted=2, waited_s=12.0, endpoint="tcp://h:1",
                        lost_early=(0,))
    assert "; 1 joined and were lost before training began (ranks 0):" in str(late)
    dropped = NoVersionMade(waited_s=3.0, dropped={"not_finite": 8, "late": 0})
    assert str(dropped).endswith("their pushes were dropped (8 not_finite)")
    assert str(TrainingError("as said")) == "as said"
