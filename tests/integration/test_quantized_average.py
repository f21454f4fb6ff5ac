"""Integration: average with `--compress int8|int4`, in one event loop over real ZeroMQ,
against local SGD worked out by hand with the same quantization: each worker pushes its
change since the published weights plus its residual, block-quantized (bus.quantize), and
keeps what the integers left out; the coordinator takes the mean of the changes from the
weights it published. Also plain averaging's refusal of the gradient compressions."""

from __future__ import annotations

import asyncio

import pytest
import torch
from equivalence import LR, digits, initial

from tensorbus.bus.quantize import VALUE_DTYPE, dequantize_add, quantize, sizes
from tensorbus.nodes import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from tensorbus.nodes.flat import FlatModel
from tensorbus.strategies import PeriodicAveraging, Sync

pytestmark = pytest.mark.timeout(30)


def _sgd(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=LR)  # (plain: the outer arithmetic is the point here)


def _train(compress: str, workers: int, rounds: int, h: int, b: int) -> Coordinator:
    async def train() -> Coordinator:
        coordinator = Coordinator(
            model=initial(), strategy=PeriodicAveraging(workers=workers, average_every=h),
            optimizer=_sgd, config=CoordinatorConfig(batch_size=b, steps=rounds, compress=compress))
        endpoint = coordinator.bind()
        team = [Worker(model=digits.model(), data=digits.data, loss=digits.loss, optimizer=_sgd,
                       config=WorkerConfig(connect=endpoint, rank=rank))
                for rank in range(workers)]
        await asyncio.gather(coordinator.run(), *(w.run() for w in team))
        return coordinator

    return asyncio.run(train())


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _load(model: torch.nn.Module, flat: torch.Tensor) -> None:
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def _by_hand(bits: int, workers: int, rounds: int, h: int, b: int) -> torch.nn.Module:
    """Local SGD whose pushes are quantized changes with error feedback, by hand."""
    model = initial()
    # The model is one float32 bucket, its parameters in order: the blocks run across them.
    layout = FlatModel(initial()).layout
    assert len(layout.buckets) == 1
    assert [e.name for e in layout.entries] == [n for n, _ in model.named_parameters()]
    shards = [iter(digits.data(rank, workers, b)) for rank in range(workers)]
    n = _flat(model).numel()
    residuals = [torch.zeros(n) for _ in range(workers)]
    for _ in range(rounds):
        published = _flat(model).clone()
        sent = []
        for rank, shard in enumerate(shards):
            _load(model, published)
            optimizer = _sgd(model.parameters())
            for _ in range(h):
                inputs, targets = next(shard)
                optimizer.zero_grad()
                digits.loss(model(inputs), targets).backward()
                optimizer.step()
            change = published - _flat(model) + residuals[rank]
            count, blocks = sizes(n, bits)
            values, scales = torch.empty(count, dtype=VALUE_DTYPE[bits]), torch.empty(blocks)
            quantize(change, bits, values, scales)
            back = torch.zeros(n)
            dequantize_add(back, values, scales, bits)
            residuals[rank] = change - back
            sent.append(back)
        _load(model, published - torch.stack(sent).mean(dim=0))
    return model


@pytest.mark.parametrize(("compress", "bits"), [("int8", 8), ("int4", 4)])
def test_quantized_average_is_local_sgd_with_quantized_changes_by_hand(compress: str,
                                                                       bits: int) -> None:
    workers, rounds, h, b = 2, 4, 3, 8
    coordinator = _train(compress, workers, rounds, h, b)
    assert coordinator.version == rounds
    want = _by_hand(bits, workers, rounds, h, b)
    got = coordinator.model
    for (name, g), w in zip(got.named_parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5, msg=f"parameter {name}")
    moved = max((w - s).abs().max().item()
                for w, s in zip(want.parameters(), initial().parameters(), strict=True))
    assert moved > 1e-2
    # The quantization did something: unquantized averaging ends elsewhere.
    plain = _train("", workers, rounds, h, b).model
    assert max((p - g).abs().max().item()
               for p, g in zip(plain.parameters(), got.parameters(), strict=True)) > 1e-6


def test_each_strategy_refuses_the_compressions_its_pushes_cannot_take() -> None:
    with pytest.raises(ValueError, match="under average workers push weights, which --compress "
                                         "sends as int8 or int4 only"):
        Coordinator(model=initial(), strategy=PeriodicAveraging(workers=2), optimizer=_sgd,
                    config=CoordinatorConfig(batch_size=8, steps=1, compress="bf16"))
    with pytest.raises(ValueError, match="--compress int8 and int4 quantize the weights average "
                                         "pushes, and sync pushes gradients"):
        Coordinator(model=initial(), strategy=Sync(workers=2), optimizer=_sgd,
                    config=CoordinatorConfig(batch_size=8, steps=1, compress="int4"))
