"""Unit: a model cut into pipeline stages (nodes.stages), where each stage's worker listens
(nodes.pipeline_directory), and the mailbox a stage's compute thread takes its neighbours'
messages from (nodes.neighbours.Mailbox). No sockets, no processes."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from tensorbus.bus.messages import ActivationGrads, Activations, Join, Kind, RejectCode
from tensorbus.nodes.admission import refusal
from tensorbus.nodes.neighbours import Mailbox
from tensorbus.nodes.pipeline_directory import PipelineDirectory
from tensorbus.nodes.stages import Stage, StagesError, build_stage, cut, group, whole

pytestmark = pytest.mark.timeout(10)


def _stages() -> list[nn.Module]:
    return [nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 4)]


@pytest.mark.parametrize(("sizes", "count", "groups"), [
    ([5, 5, 5, 5], 4, [[0], [1], [2], [3]]),
    ([5, 5, 5, 5], 2, [[0, 1], [2, 3]]),
    ([10, 1, 1, 10], 2, [[0, 1], [2, 3]]),
    ([1, 1, 1, 9], 2, [[0, 1, 2], [3]]),
    ([576, 0, 4160, 260], 3, [[0, 1], [2], [3]]),
    ([3], 1, [[0]]),
])
def test_consecutive_groups_whose_largest_is_smallest(sizes: list[int], count: int,
                                                      groups: list[list[int]]) -> None:
    assert [list(g) for g in group(sizes, count)] == groups


def test_fewer_modules_than_stages_is_an_error_that_says_so() -> None:
    with pytest.raises(StagesError, match="3 module.s. cannot be cut into 4 pipeline stages"):
        group([1, 1, 1], 4)


def test_a_stage_passes_a_tuple_on_as_arguments() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, 2 * x

    class Add(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b

    assert torch.equal(Stage(Pair(), Add())(torch.ones(3)), torch.full((3,), 3.0))
    assert torch.equal(Stage(Add())(torch.ones(2), torch.ones(2)), torch.full((2,), 2.0))


def test_the_whole_model_names_its_parameters_as_sequential_of_the_stages_does() -> None:
    torch.manual_seed(0)
    stages = cut(_stages(), 2)
    torch.manual_seed(0)
    sequential = nn.Sequential(*_stages())
    assembled = whole(stages)
    assert list(assembled.state_dict()) == list(sequential.state_dict())
    for (_, a), (_, b) in zip(assembled.state_dict().items(), sequential.state_dict().items(),
                              strict=True):
        assert torch.equal(a, b)
    x = torch.randn(5, 8)
    assert torch.equal(assembled(x), stages[1](stages[0](x)))


def test_a_stage_s_worker_allocates_its_own_stage_alone() -> None:
    built: list[nn.Module] = []

    def big() -> list[nn.Module]:
        modules = [nn.Linear(512, 512) for _ in range(4)]
        built.extend(modules)
        return modules

    stage = build_stage(big, 2, 4)
    assert all(p.device.type == "cpu" for p in stage.parameters())
    assert sum(p.numel() for p in stage.parameters()) == 512 * 512 + 512
    # The others were never given memory: they were made on the meta device.
    assert all(p.is_meta for m in built if m not in list(stage) for p in m.parameters())


def test_a_stage_with_constructor_made_buffers_is_built_in_full() -> None:
    class Masked(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 4)
            self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)

    stage = build_stage(lambda: [nn.Linear(4, 4), Masked()], 1, 2)
    masked = stage[0]
    assert isinstance(masked, Masked)
    assert torch.equal(masked.mask, torch.tril(torch.ones(4, 4)))


def test_stages_that_are_not_modules_or_not_a_list_are_named() -> None:
    with pytest.raises(StagesError, match="stages\\(\\) item 1 is a int, not a torch.nn.Module"):
        build_stage(lambda: [nn.Linear(2, 2), 3], 0, 1)  # type: ignore[list-item]
    with pytest.raises(StagesError, match="stages\\(\\) returned Linear, not a list"):
        build_stage(lambda: nn.Linear(2, 2), 0, 1)  # type: ignore[arg-type, return-value]
    with pytest.raises(StagesError, match="stages\\(\\) raised KeyError"):
        build_stage(lambda: {}["x"], 0, 1)


def test_the_directory_answers_each_stage_with_its_pipeline_s_neighbours() -> None:
    directory = PipelineDirectory(3)
    directory.place(0, 0, "tcp://a:1")
    directory.place(1, 0, "tcp://a:2")
    directory.place(1, 1, "tcp://b:2")
    assert directory.neighbours(1, 0) == ("tcp://a:1", "")  # stage 2 has not joined
    assert directory.neighbours(0, 0) == ("", "tcp://a:2")
    assert directory.neighbours(2, 1) == ("tcp://b:2", "")
    directory.place(2, 0, "tcp://a:3")
    assert directory.neighbours(1, 0) == ("tcp://a:1", "tcp://a:3")
    directory.forget(2, 0, "tcp://elsewhere:9")  # a replacement joined since: kept
    assert directory.neighbours(1, 0)[1] == "tcp://a:3"
    directory.forget(2, 0)
    assert directory.neighbours(1, 0)[1] == ""
    with pytest.raises(ValueError, match="stage 3 of 3"):
        directory.place(3, 0, "tcp://a:4")


def _activations(step: int, micro: int) -> Activations:
    return Activations(stage=0, step=step, micro=micro, outputs=1, batch=4,
                       tensors=(torch.zeros(1), torch.zeros(1)))


def test_the_mailbox_gives_each_message_once_and_waits_for_one_not_here() -> None:
    mailbox = Mailbox()
    assert mailbox.put((Kind.ACTIVATIONS, 0, 1), _activations(0, 1))
    assert not mailbox.put((Kind.ACTIVATIONS, 0, 1), _activations(0, 1))  # a second one
    threading.Timer(0.05, lambda: mailbox.put((Kind.ACTIVATIONS, 0, 0), _activations(0, 0))).start()
    checks: list[float] = []
    first = mailbox.take((Kind.ACTIVATIONS, 0, 0), poll_s=0.01, check=lambda: checks.append(1))
    assert isinstance(first, Activations) and first.micro == 0 and checks
    assert mailbox.take((Kind.ACTIVATIONS, 0, 1), poll_s=0.01, check=lambda: None).micro == 1
    assert len(mailbox) == 0


def test_a_wait_ends_with_what_check_raises_or_an_interruption() -> None:
    mailbox = Mailbox()
    with pytest.raises(TimeoutError):
        mailbox.take((Kind.ACTIVATION_GRADS, 0, 0), poll_s=0.01,
                     check=lambda: (_ for _ in ()).throw(TimeoutError()))
    threading.Timer(0.05, mailbox.interrupt, (RuntimeError("session over"),)).start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="session over"):
        mailbox.take((Kind.ACTIVATION_GRADS, 0, 0), poll_s=10.0, check=lambda: None)
    assert time.monotonic() - started < 5.0  # at once, not at the next check
    mailbox.resume()
    mailbox.put((Kind.ACTIVATION_GRADS, 0, 0),
                ActivationGrads(stage=1, step=0, micro=0, loss=0.5, tensors=(torch.zeros(1),)))
    assert mailbox.take((Kind.ACTIVATION_GRADS, 0, 0), poll_s=0.01, check=lambda: None)


def test_a_take_lets_go_of_what_came_for_earlier_steps() -> None:
    mailbox = Mailbox()
    mailbox.put((Kind.ACTIVATIONS, 3, 0), _activations(3, 0))  # a step given up
    mailbox.put((Kind.ACTIVATIONS, 5, 0), _activations(5, 0))  # this session's, early
    mailbox.put((Kind.ACTIVATIONS, 4, 0), _activations(4, 0))
    assert mailbox.take((Kind.ACTIVATIONS, 4, 0), poll_s=0.01, check=lambda: None).step == 4
    assert len(mailbox) == 1


def test_a_worker_of_another_stage_is_refused_before_its_layout_is_compared() -> None:
    same = "0f1e2d3c4b5a6978"  # (stages of identical blocks have one layout)
    wrong = refusal(Join(layout=same, stage=2, stages=4), layout=same, model=None, stage=(1, 4))
    assert wrong is not None and wrong.code is RejectCode.LAYOUT
    assert wrong.detail.startswith("this coordinator serves stage 1 of 4, and the worker holds "
                                   "stage 2 of 4: connect each stage's workers")
    whole_model = refusal(Join(layout=same), layout=same, model=None, stage=(0, 2))
    assert whole_model is not None and "and the worker holds the whole model" in whole_model.detail
    assert refusal(Join(layout=same, stage=1, stages=4), layout=same, model=None,
                   stage=(1, 4)) is None
