"""Unit: the model's buffers laid out flat, their combination, and their place on the wire."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tensorbus.bus.codec import decode, encode
from tensorbus.bus.errors import LayoutError, MalformedHeaderError
from tensorbus.bus.messages import Ack, Push, Weights
from tensorbus.nodes.flat import FlatModel
from tensorbus.nodes.model_buffers import BufferMean, ServedBuffers, carried

pytestmark = pytest.mark.timeout(30)


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    model.register_buffer("scratch", torch.ones(2), persistent=False)  # not in a state_dict
    return model


def test_the_persistent_buffers_travel_and_stay_the_modules_own() -> None:
    flat = FlatModel(_model())
    assert [name for name, _ in carried(flat.module)] == [
        "1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert [(b.dtype, b.numel) for b in flat.model_buffers.layout.buckets] == [
        (torch.float32, 6), (torch.int64, 1)]
    flat.module.train()
    flat.module(torch.randn(5, 4))  # the forward updates the flat tensors in place
    assert int(flat.model_buffers.flat[1]) == 1
    assert flat.model_buffers.flat[0][3:].ne(1).all()
    sent = flat.model_buffers.copy()
    flat.module(torch.randn(5, 4))
    assert int(sent[1]) == 1  # (a copy: the next forward does not write what was sent)


def test_a_model_without_buffers_sends_none() -> None:
    flat = FlatModel(nn.Linear(3, 2))
    assert not flat.model_buffers and flat.model_buffers.copy() == ()


def test_the_combination_averages_floats_and_takes_the_largest_count() -> None:
    flat = FlatModel(_model())
    mean = BufferMean(flat.model_buffers.layout)
    assert mean.combine() is None
    mean.take(0, (torch.arange(6, dtype=torch.float32), torch.tensor([3])))
    mean.take(2, (torch.full((6,), 2.0), torch.tensor([5])))
    floats, counts = mean.combine()  # type: ignore[misc]
    torch.testing.assert_close(floats, (torch.arange(6.0) + 2) / 2)
    assert counts.tolist() == [5]
    assert mean.combine() is None  # (nothing new since)
    mean.forget(2)
    floats, counts = mean.combine()  # type: ignore[misc]
    torch.testing.assert_close(floats, torch.arange(6.0))
    with pytest.raises(LayoutError):
        mean.take(1, (torch.zeros(5), torch.tensor([1])))


def test_buffers_ride_behind_the_tensors_and_never_by_reference() -> None:
    weights = (torch.arange(4, dtype=torch.float32),)
    state = (torch.ones(6), torch.tensor([7]))
    back = decode(encode(Push(clock=0, loss=0.5, samples=1, tensors=weights, state=state),
                         refer=lambda t: None))
    assert isinstance(back, Push) and len(back.tensors) == 1 and len(back.state) == 2
    torch.testing.assert_close(back.tensors[0], weights[0])
    assert back.state[1].tolist() == [7]
    # A broadcast with no buffers has no "b" in its header, as before buffers travelled.
    plain = decode(encode(Weights(version=3, tensors=weights)))
    assert plain.state == ()
    with pytest.raises(ValueError, match="carries no buffers"):
        encode(Ack(state=state))


def test_a_buffer_count_that_does_not_fit_is_refused() -> None:
    import msgpack

    frames = encode(Push(clock=0, loss=0.5, samples=1, tensors=(torch.ones(2),),
                         state=(torch.ones(1),)))
    header = msgpack.unpackb(frames[0])
    for bad in (3, -1, "1"):
        header["b"] = bad
        with pytest.raises(MalformedHeaderError, match="'b'"):
            decode([msgpack.packb(header), *frames[1:]])


def test_a_root_publishes_its_workers_combination_and_a_relay_its_roots() -> None:
    root, relay = FlatModel(_model()), FlatModel(_model())
    served, relayed = ServedBuffers(root.model_buffers), ServedBuffers(relay.model_buffers,
                                                                       relay=True)
    first = served.published()
    assert [t.tolist() for t in first] == [t.tolist() for t in root.model_buffers.flat]
    pushed = (torch.full((6,), 3.0), torch.tensor([4]))
    served.take(0, pushed)
    relayed.take(0, pushed)
    # The root's model holds the combination, and publishes it.
    assert served.published()[0].tolist() == [3.0] * 6
    assert root.model_buffers.flat[0].tolist() == [3.0] * 6
    # A relay's model keeps the root's (its upstream link loads them): it publishes
    # those, and sends its workers' combination up.
    relay.model_buffers.load((torch.full((6,), 7.0), torch.tensor([9])))
    assert relayed.published()[0].tolist() == [7.0] * 6
    assert relayed.upstream()[0].tolist() == [3.0] * 6
    assert relay.model_buffers.flat[0].tolist() == [7.0] * 6
