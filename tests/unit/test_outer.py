"""Unit tests of `nodes.outer`: delayed Nesterov against its arithmetic by hand."""

import pytest
import torch

from tensorbus.nodes.outer import DelayedNesterov

pytestmark = pytest.mark.timeout(30)

GRADS = [torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5]), torch.tensor([-1.0, 3.0]),
         torch.tensor([2.0, 0.0]), torch.tensor([0.25, -0.75])]


def _stepped(optimizer_of, grads):  # type: ignore[no-untyped-def]
    param = torch.nn.Parameter(torch.tensor([3.0, -1.0]))
    optimizer = optimizer_of([param])
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    return param.detach()


def test_the_momentum_moves_every_n_steps_on_their_sum():
    lr, mu, every = 0.7, 0.9, 2
    w, m, total = torch.tensor([3.0, -1.0]), torch.zeros(2), torch.zeros(2)
    for step, g in enumerate(GRADS, 1):
        w = w - lr * g
        total = total + g
        if step % every == 0:
            m = mu * m + total
            w = w - lr * mu * m
            total = torch.zeros(2)
    got = _stepped(lambda ps: DelayedNesterov(ps, lr=lr, momentum=mu, every=every), GRADS)
    torch.testing.assert_close(got, w, rtol=0, atol=1e-6)


def test_every_step_it_is_sgd_with_nesterov_momentum():
    got = _stepped(lambda ps: DelayedNesterov(ps, lr=0.7, momentum=0.9, every=1), GRADS)
    want = _stepped(lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True), GRADS)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_its_state_is_a_checkpoint_s():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = DelayedNesterov([param], lr=1.0, momentum=0.5, every=3)
    param.grad = torch.ones(2)
    optimizer.step()
    again = DelayedNesterov([param], lr=1.0, momentum=0.5, every=3)
    again.load_state_dict(optimizer.state_dict())
    assert again.state[param]["steps"] == 1
    assert torch.equal(again.state[param]["sum"], torch.ones(2))
