"""tensorbus.init() and DistributedOptimizer outside any launcher: a world of one, in this
process (no coordinator, no thread, no socket)."""

from __future__ import annotations

import pytest
import torch

from tensorbus.nodes import own_loop

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", own_loop.COORDINATOR_VARIABLE,
                 "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(own_loop, "_context", None)


@pytest.mark.usefixtures("alone")
def test_alone_the_optimizer_steps_as_the_wrapped_one_does() -> None:
    context = own_loop.init(device="cpu")
    assert (context.rank, context.world_size, context.coordinator) == (0, 1, None)
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    theirs.load_state_dict(ours.state_dict())
    wrapped = own_loop.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1), ours)
    plain = torch.optim.SGD(theirs.parameters(), lr=0.1)
    for optimizer, model in ((wrapped, ours), (plain, theirs)):
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.ones(4, 3)).pow(2).mean().backward()
            optimizer.step()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("alone")
def test_more_backward_passes_than_said_raise_at_step() -> None:
    """backward_passes_per_step=2: two passes or fewer step; a third before step() raises,
    saying so (the count is the wrapper's, alone as in a run)."""
    model = torch.nn.Linear(3, 2)
    optimizer = own_loop.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                              backward_passes_per_step=2)
    for passes in (2, 1):
        for _ in range(passes):
            model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
    for _ in range(3):
        model(torch.ones(1, 3)).sum().backward()
    with pytest.raises(RuntimeError) as raised:
        optimizer.step()
    assert str(raised.value) == (
        "3 backward passes since the last step(), and backward_passes_per_step is 2: call "
        "step() after at most that many, or raise it")
    with pytest.raises(ValueError, match="backward_passes_per_step must be at least 1, got 0"):
        own_loop.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                      backward_passes_per_step=0)
