"""Unit: what a SPEC's scheduler(optimizer) may return, and what it is told otherwise."""

from __future__ import annotations

import pytest
import torch

from tensorbus.nodes.schedules import make_schedule

pytestmark = pytest.mark.timeout(10)


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


def test_a_scheduler_alone_steps_by_epoch_and_a_dict_says_when() -> None:
    opt = _optimizer()
    alone = make_schedule(lambda o: torch.optim.lr_scheduler.StepLR(o, 1), opt)
    assert (alone.interval, alone.scheduler.get_last_lr()) == ("epoch", [0.1])
    by_step = make_schedule(
        lambda o: {"scheduler": torch.optim.lr_scheduler.StepLR(o, 1), "interval": "step"}, opt)
    assert by_step.interval == "step"


def test_an_epoch_schedule_steps_once_for_each_epoch_newly_done() -> None:
    opt = _optimizer()
    schedule = make_schedule(lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5), opt)
    for epochs_done in (None, 0, 0, 1, 1, 3):  # (None: the epoch's length not known yet)
        opt.step()
        schedule.after_step(epochs_done)
    assert schedule.epochs_stepped == 3
    assert schedule.scheduler.get_last_lr() == [0.1 / 8]
    per_step = make_schedule(
        lambda o: {"scheduler": torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5),
                   "interval": "step"}, opt)
    for _ in range(2):
        per_step.after_step(None)
    assert per_step.scheduler.get_last_lr() == [0.1 / 8 / 4]


@pytest.mark.parametrize("returned, says", [
    (lambda o: None, "returned NoneType, not a torch LR scheduler"),
    (lambda o: {"scheduler": torch.optim.lr_scheduler.StepLR(o, 1), "interval": "batch"},
     "interval 'batch'"),
    (lambda o: {"scheduler": torch.optim.lr_scheduler.StepLR(o, 1), "monitor": "loss"},
     "takes only 'scheduler' and 'interval'"),
    (lambda o: torch.optim.lr_scheduler.StepLR(_optimizer(), 1), "of another optimizer"),
])
def test_anything_else_is_said_in_one_line(returned: object, says: str) -> None:
    with pytest.raises(ValueError, match=None) as raised:
        make_schedule(returned, _optimizer())  # type: ignore[arg-type]
    assert says in str(raised.value) and "\n" not in str(raised.value)
