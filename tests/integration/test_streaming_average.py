"""Integration: streaming averaging (average with fragments), in one event loop over real
ZeroMQ, against the same training worked out by hand here: each worker computes H/P local
steps while its last push travels, then mixes that fragment's average into its own
weights (mix of its own, 1 - mix of the average) and pushes the next fragment, measured
from the newest version; the coordinator averages one fragment a version, with an outer
Nesterov step on that fragment's parameters alone, or as int4 changes with error feedback.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import msgpack
import pytest
import torch
from equivalence import digits, initial, max_difference
from test_quantized_average import _flat, _load, _sgd

from tensorbus.bus.codec import decode, encode
from tensorbus.bus.messages import Kind, Message, Push, Reject
from tensorbus.bus.quantize import VALUE_DTYPE, dequantize_add, quantize, sizes
from tensorbus.bus.transport import ZmqClient
from tensorbus.nodes import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from tensorbus.nodes.flat import FlatModel
from tensorbus.strategies import PeriodicAveraging

pytestmark = pytest.mark.timeout(30)

WORKERS, H, P, B, VERSIONS = 2, 4, 2, 8, 6
OUTER = (0.7, 0.9)  # the outer SGD's lr and Nesterov momentum
# The digits MLP's tensors in two fragments, cut at the tensor nearest half its 2410
# elements: the first layer's weight (2048), then its bias and the second layer (362).
FRAGMENTS = ((0,), (1, 2, 3))


def _train(*, compress: str = "", outer: bool = False, mix: float = 0.5,
           transport: Any = ZmqClient) -> Coordinator:
    async def train() -> Coordinator:
        strategy = PeriodicAveraging(
            workers=WORKERS, average_every=H, fragments=P, fragment_mix=mix,
            **({"outer_lr": OUTER[0], "outer_momentum": OUTER[1], "nesterov": True}
               if outer else {}))
        coordinator = Coordinator(model=initial(), strategy=strategy, optimizer=_sgd,
                                  config=CoordinatorConfig(batch_size=B, steps=VERSIONS,
                                                           compress=compress))
        endpoint = coordinator.bind()
        team = [Worker(model=digits.model(), data=digits.data, loss=digits.loss, optimizer=_sgd,
                       config=WorkerConfig(connect=endpoint, rank=rank), transport=transport)
                for rank in range(WORKERS)]
        await asyncio.gather(coordinator.run(), *(w.run() for w in team))
        return coordinator

    return asyncio.run(train())


def _ranges() -> list[slice]:
    """Each fragment's elements in the flat weights (one float32 bucket, tensors in order)."""
    sizes_ = [p.numel() for p in initial().parameters()]
    starts = [sum(sizes_[:i]) for i in range(len(sizes_) + 1)]
    return [slice(starts[f[0]], starts[f[-1] + 1]) for f in FRAGMENTS]


def _by_hand(*, bits: int | None = None, outer: bool = False, mix: float = 0.5) -> torch.nn.Module:
    ranges = _ranges()
    newest = _flat(initial()).clone()  # the coordinator's weights, version after version
    models = [initial() for _ in range(WORKERS)]
    optimizers = [_sgd(m.parameters()) for m in models]
    shards = [iter(digits.data(rank, WORKERS, B)) for rank in range(WORKERS)]
    residuals = [torch.zeros_like(newest) for _ in range(WORKERS)]
    momentum = torch.zeros_like(newest)  # the outer SGD's, element by element
    for version in range(VERSIONS):
        pushed = ranges[version % P]
        sent = []
        for rank, (model, optimizer, shard) in enumerate(zip(models, optimizers, shards, strict=True)):
            for _ in range(H // P):  # computed while the last push travels
                inputs, targets = next(shard)
                optimizer.zero_grad()
                digits.loss(model(inputs), targets).backward()
                optimizer.step()
            local = _flat(model).clone()
            if version > 0:  # the last push's fragment has come back: mixed in
                back = ranges[(version - 1) % P]
                local[back].mul_(mix).add_(newest[back], alpha=1 - mix)
                _load(model, local)
            if bits is None:
                sent.append(local[pushed].clone())
                continue
            change = newest[pushed] - local[pushed]
            change += residuals[rank][pushed]
            count, blocks = sizes(change.numel(), bits)
            values, scales = torch.empty(count, dtype=VALUE_DTYPE[bits]), torch.empty(blocks)
            quantize(change, bits, values, scales)
            dequantized = torch.zeros_like(change)
            dequantize_add(dequantized, values, scales, bits)
            residuals[rank][pushed] = change - dequantized
            sent.append(dequantized)
        if bits is not None:  # the mean of the changes, taken from the published weights
            average = newest[pushed].clone()
            for change in sent:
                average.add_(change, alpha=-1 / WORKERS)
        else:
            average = torch.stack(sent).mean(dim=0)
        if outer:  # Nesterov SGD on published - average, this fragment's elements alone
            lr, mu = OUTER
            gradient = newest[pushed] - average
            momentum[pushed] = mu * momentum[pushed] + gradient
            newest[pushed] -= lr * (gradient + mu * momentum[pushed])
        else:
            newest[pushed] = average
    model = initial()
    _load(model, newest)
    return model


def test_the_model_is_cut_into_fragments_of_whole_tensors() -> None:
    layout = FlatModel(initial()).layout
    ranges = _ranges()
    for fragment, elements in zip(layout.fragments(P), ranges, strict=True):
        (span,) = fragment.spans
        assert (span.start, span.stop) == (elements.start, elements.stop)


@pytest.mark.parametrize(("compress", "bits", "outer"), [("", None, True), ("int4", 4, False)],
                         ids=["outer-nesterov", "int4"])
def test_streaming_is_fragments_averaged_in_turn_and_mixed_in_by_hand(
        compress: str, bits: int | None, outer: bool) -> None:
    coordinator = _train(compress=compress, outer=outer)
    assert coordinator.version == VERSIONS
    want = _by_hand(bits=bits, outer=outer)
    for (name, g), w in zip(coordinator.model.named_parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5, msg=f"parameter {name}")
    assert max_difference(want, initial()) > 1e-2  # it trained
    # The mixing is in it: replacing a fragment with its average (mix 0) ends elsewhere.
    assert max_difference(want, _by_hand(bits=bits, outer=outer, mix=0.0)) > 1e-4


WRONG = 1 << 40  # the request ids of the pushes sent beside worker 0's own


class _WrongFragments(ZmqClient):
    """Worker 0's connection. Before its push on version 1 (fragment 1) it sends two that
    this run must refuse: its push on version 0 (fragment 0's tensors) said to be on
    version 1, and the whole model's weights; it keeps the answers, which the worker
    ignores."""

    answers: dict[int, Message] = {}

    def __init__(self, connect: str, **options: Any) -> None:
        super().__init__(connect, **options)
        self._first: Push | None = None
        self._fragments = FlatModel(initial()).layout.fragments(P)

    async def send(self, frames: Any) -> Any:
        header = msgpack.unpackb(frames[0])
        if header["k"] == Kind.PUSH and header["s"] == 0:
            push = decode(frames, layout=FlatModel(initial()).layout,
                          fragments=[f.layout for f in self._fragments])
            assert isinstance(push, Push)
            if push.version == 0:  # (copied: the worker writes that part again)
                self._first = replace(push, tensors=tuple(t.clone() for t in push.tensors))
            elif push.version == 1 and self._first is not None:
                whole = tuple(w.clone() for w in FlatModel(initial()).weights)
                for request, lie in enumerate((replace(self._first, version=1),
                                               replace(self._first, version=1, fragment=-1,
                                                       tensors=whole)), WRONG):
                    await super().send(encode(replace(lie, request=request)))
                self._first = None
        return await super().send(frames)

    async def recv(self) -> Any:
        frames = await super().recv()
        request = msgpack.unpackb(frames[0])["r"]
        if request >= WRONG:
            _WrongFragments.answers[request] = decode(frames)
        return frames


def test_a_push_of_another_fragment_than_its_version_s_is_refused() -> None:
    _WrongFragments.answers = {}
    coordinator = _train(outer=True, transport=_WrongFragments)
    answers = _WrongFragments.answers
    assert sorted(answers) == [WRONG, WRONG + 1]
    assert all(isinstance(a, Reject) and a.code == "layout" for a in answers.values())
    assert answers[WRONG].detail == ("a push of fragment 0 on version 1, where this run's "
                                     "pushes on it carry fragment 1")
    assert answers[WRONG + 1].detail.startswith("a push of the whole model on version 1")
    assert coordinator.metrics.rejected["layout"] == 2
    for g, w in zip(coordinator.model.parameters(), _by_hand(outer=True).parameters(), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)  # nothing of them taken
