"""Hostile peers against a running coordinator, over real ZeroMQ on loopback.

The requirement: the coordinator survives anything a peer sends. Each message gets a typed
error and a Reject where the sender can be told, is counted, and changes no state. Here:

- `test_fuzz_from_a_stranger_is_all_rejected_and_training_is_untouched`: a peer that never
  joined sends 10,000 messages made from real encoded messages of every kind by seeded
  mutation: random bytes, truncated headers, bit flips, lies in every header field (protocol,
  kind, sender, request, version, fields, dtype, shape, byte count up to 2**64-1), frames
  missing, extra or of the wrong length, totals over the size limit, NaN and inf tensors, and
  replays of a real worker's pushes spoofing its rank. Meanwhile two workers train sync on
  digits. Each message's fate is predicted by the codec itself (`decode` with the
  coordinator's layout and limit, then the coordinator's rule for strangers). The test asserts
  that versions advance during the fuzz, that every message gets exactly the predicted Reject
  (code and request id, in order), that `metrics.rejected` equals the predicted counts, and
  that the final weights equal those of a run without the fuzzer (`torch.equal`, bit for bit).
  Messages with a frame over the coordinator's limit go from a second socket: ZeroMQ's
  MAXMSGSIZE hangs up on that peer before the coordinator's code sees a byte, so for them the
  test asserts only that each costs that peer its connection and is neither counted nor
  answered. The fuzz sends at most `WINDOW` messages ahead of the replies: a ROUTER drops
  replies to a peer whose queue is full, and a window well under the queue makes "every
  message answered" an exact check.
- `test_hostile_pushes_from_a_member_are_dropped_and_never_applied`: a joined worker's own
  connection sends non-finite pushes (NaN or inf gradient, NaN loss), pushes claiming future
  versions and a replay of its previous push. Each is answered by an Ack naming the drop
  reason and counted in the summary, the non-finite ones are logged, and the run ends on
  the reference weights, bit for bit.
- `test_heartbeat_and_leave_from_a_stranger_are_rejected_and_counted`: the two kinds a
  member sends unasked are refused like any other from a peer that never joined.
- `test_every_reject_can_be_read_by_its_sender`: a header field holding a string or list
  near the codec's limits is quoted in the Reject's detail in bounded form, so that the
  sender's codec can read the Reject.
- `test_a_refused_header_names_the_request_it_refuses`: a Join of another protocol version
  is refused with its own request id, so the worker learns the version is wrong at once
  instead of waiting out its join timeout.

Reproduce a failure with the same `SEED`: the mutations do not depend on timing.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import random
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Final

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio
from specs import load_example
from zmq.utils.monitor import parse_monitor_message

from tensorbus.bus.codec import MAX_HEADER_BYTES, MAX_TENSORS, decode, encode
from tensorbus.bus.errors import WireError
from tensorbus.bus.layout import Layout
from tensorbus.bus.messages import (
    BUILD,
    Ack,
    Heartbeat,
    Join,
    Kind,
    Leave,
    Message,
    Pull,
    Push,
    Ready,
    Reject,
    Stop,
    Weights,
    Welcome,
)
from tensorbus.bus.shared import SegmentCache, SharedTensorError
from tensorbus.bus.transport import ClientFactory, ZmqClient
from tensorbus.nodes import Coordinator, CoordinatorConfig, State, Worker, WorkerConfig
from tensorbus.strategies import Sync

SEED: Final = 20_240_611
WORKERS: Final = 2
STEPS: Final = 40
BATCH: Final = 8
LR, MOMENTUM = 0.05, 0.9
FUZZ_MESSAGES: Final = 10_000
OVERSIZE_MESSAGES: Final = 12
WINDOW: Final = 200  # fuzz messages in flight; well under the ROUTER's send queue of 1000
HOLD_AT: Final = 30  # workers wait before this batch until the fuzz is done
REPLY_TIMEOUT_S: Final = 10.0
REQUEST_BASE: Final = 1_000_000_000  # fuzz message i asks with request id REQUEST_BASE + i
MUTATIONS: Final = 17  # Mutator.ops
HOSTILE_RANK: Final = 1  # the member whose connection lies in the member test
LIE_AT: Final = 3  # ... before its push on this version
LIE_BASE: Final = 2_000_000_000  # ... with request ids from here


digits = load_example("digits")


# Runs ------------------------------------------------------------------------------------


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _coordinator() -> Coordinator:
    torch.manual_seed(0)
    return Coordinator(model=digits.model(), strategy=Sync(workers=WORKERS),
                       config=CoordinatorConfig(batch_size=BATCH, steps=STEPS), optimizer=_sgd)


def _worker(endpoint: str, rank: int, data: Callable[[int, int, int], Any] = digits.data,
            transport: ClientFactory = ZmqClient) -> Worker:
    return Worker(model=digits.model(), data=data, loss=digits.loss,
                  config=WorkerConfig(connect=endpoint, rank=rank, request_timeout_s=10.0),
                  transport=transport)


def _weights(coordinator: Coordinator) -> list[torch.Tensor]:
    return [p.detach().clone() for p in coordinator.model.parameters()]


def _assert_same_weights(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    # Sync averages in worker order: same seed and data give the same bits.
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"parameter {i} differs by {(g - w).abs().max().item()}"


def _client_factory(cls: type[ZmqClient], **extra: Any) -> Any:
    """A worker's transport (a bus.transport.ClientFactory) that builds `cls` with `extra`."""
    def build(connect: str, **options: Any) -> ZmqClient:
        return cls(connect, **options, **extra)
    return build


class _Recording(ZmqClient):
    """A worker's connection that keeps a copy of every push it sends, by (rank, version)."""

    def __init__(self, connect: str, *, pushes: dict[tuple[int, int], list[bytes]],
                 **options: Any) -> None:
        super().__init__(connect, **options)
        self._pushes = pushes

    async def send(self, frames: Any) -> Any:
        header = msgpack.unpackb(frames[0])
        if header["k"] == Kind.PUSH:
            # Copied now: the worker writes its gradient buffer again after the send.
            self._pushes.setdefault((header["s"], header["v"]), [bytes(memoryview(f)) for f in frames])
        return await super().send(frames)


@dataclass(frozen=True)
class Reference:
    weights: list[torch.Tensor]  # after STEPS versions of sync with no hostile peer
    pushes: dict[tuple[int, int], list[bytes]]  # the real workers' pushes, frames as sent


@pytest.fixture(scope="module")
def reference() -> Reference:
    pushes: dict[tuple[int, int], list[bytes]] = {}
    recording = _client_factory(_Recording, pushes=pushes)

    async def train() -> tuple[Coordinator, dict[str, Any]]:
        coordinator = _coordinator()
        endpoint = coordinator.bind()
        summary, *_ = await asyncio.gather(coordinator.run(), *(
            _worker(endpoint, rank, transport=recording).run() for rank in range(WORKERS)))
        return coordinator, summary

    coordinator, summary = asyncio.run(train())
    assert summary["steps"] == STEPS and summary["rejected"] == {} and summary["dropped"] == {}
    return Reference(_weights(coordinator), pushes)


class _Held:
    """A shard whose batch `HOLD_AT` waits for `gate` (60 s at most), so that training is
    still going when the fuzz ends. Sized and re-iterable like the shard it wraps."""

    def __init__(self, shard: Any, gate: threading.Event) -> None:
        self._shard, self._gate = shard, gate

    def __len__(self) -> int:
        return len(self._shard)

    def __iter__(self) -> Iterator[Any]:
        for i, batch in enumerate(self._shard):
            if i == HOLD_AT:
                self._gate.wait(60.0)
            yield batch


# The mutator -------------------------------------------------------------------------------

_GARBAGE: Final[tuple[object, ...]] = (
    None, True, False, 0, -1, 1, 7, 11, 2**31, 2**62, 2**63 - 1, 2**64 - 1, -(2**63), 0.5,
    math.nan, math.inf, -math.inf, "", "x", "float32", "\x00\xff", "é" * 100, "y" * 5000,
    b"raw", [], [1, 2], [["float32", [2410], 9640]], {}, {"a": 1}, {1: 2}, {"p": 1},
)
_DTYPE_LIES: Final = ("float64", "float16", "bfloat16", "int32", "int8", "uint8", "bool",
                      "complex64", "float", "FLOAT32", "", "float32\x00")


_LARGE_FRAME: Final = bytes(60_000)


@dataclass(frozen=True)
class _Seed:
    header: dict[str, Any]
    tensors: list[bytes]


def _seeds(layout: Layout) -> list[_Seed]:
    """Real encoded messages of every kind, with tensors of the coordinator's layout."""
    flat = tuple(torch.randn(b.numel, generator=torch.Generator().manual_seed(SEED)).to(b.dtype)
                 for b in layout.buckets)
    messages: list[Message] = [
        Join(rank=-1, layout=layout.digest, build=BUILD),
        Join(sender=1, rank=1, layout=layout.digest, build=BUILD),
        Join(rank=0, layout="0" * 16, build="0.0.0"),
        Join(rank=5, layout=layout.digest),
        Ready(sender=0, batches=93),
        Push(sender=1, version=3, clock=3, loss=2.25, samples=BATCH, tensors=flat),
        Pull(sender=0, version=2),
        Heartbeat(sender=1, version=2, phase="computing", clock=2),
        Leave(sender=0, version=5, reason="done"),
        Welcome(rank=0, world_size=2, strategy="sync", push="gradient", local_steps=1,
                wait="newer", batch_size=BATCH, pub_port=1, heartbeat_s=0.5, timeout_s=10.0,
                lr=0.1, tensors=flat),
        Ack(version=1, dropped="late"),
        Weights(version=4, tensors=flat),
        Weights(version=4),
        Stop(version=9),
        Reject(code="malformed", detail="no"),
    ]
    seeds = []
    for message in messages:
        frames = encode(message)
        seeds.append(_Seed(msgpack.unpackb(frames[0]), [bytes(memoryview(f)) for f in frames[1:]]))
    return seeds


class Mutator:
    """Hostile messages, each a list of frames, from real ones; seeded, so reproducible."""

    def __init__(self, rng: random.Random, layout: Layout, replays: list[list[bytes]]) -> None:
        self.rng = rng
        self.seeds = _seeds(layout)
        self.push = next(seed for seed in self.seeds if seed.header["k"] == Kind.PUSH)
        self.replays = replays
        self.numel = layout.buckets[0].numel
        # A few big frames, shared by many messages, to keep the plan's memory small.
        self.big_headers = [rng.randbytes(MAX_HEADER_BYTES + 1 + rng.randrange(4096)) for _ in range(4)]
        self.poisoned = {value: torch.full((self.numel,), value).numpy().tobytes()
                         for value in (math.nan, math.inf, -math.inf)}
        self.ops: list[Callable[[_Seed], list[bytes]]] = [
            self.random_bytes, self.truncated, self.bit_flips, self.envelope_lie,
            self.header_keys, self.field_lie, self.tensor_lie, self.frame_count,
            self.frame_length, self.non_finite, self.replay, self.valid, self.not_a_map,
            self.too_large, self.big_header, self.deep_nesting, self.kind_swap,
        ]

    def message(self, request: int) -> tuple[str, list[bytes]]:
        """One mutation, named; a header it leaves readable asks with `request`."""
        seed = self.rng.choice(self.seeds)
        seed = _Seed({**copy.deepcopy(seed.header), "r": request}, list(seed.tensors))
        op = self.rng.choice(self.ops)
        return op.__name__, op(seed)

    def oversize(self, limit: int) -> list[bytes]:
        """A message with a frame over `limit` bytes (ZeroMQ's MAXMSGSIZE on the ROUTER)."""
        big = self.rng.randbytes(limit + 1 + self.rng.randrange(limit))
        seed = self.rng.choice(self.seeds)
        return self.rng.choice([[big], [_pack(seed.header), big], [_pack(seed.header), b"", big]])

    def _garbage(self) -> object:
        return self.rng.choice(_GARBAGE)

    def _pack(self, seed: _Seed) -> list[bytes]:
        return [_pack(seed.header), *seed.tensors]

    def random_bytes(self, seed: _Seed) -> list[bytes]:
        return [self.rng.randbytes(self.rng.randrange(300)), *seed.tensors]

    def truncated(self, seed: _Seed) -> list[bytes]:
        header, *rest = self._pack(seed)
        return [header[: self.rng.randrange(len(header))], *rest]

    def bit_flips(self, seed: _Seed) -> list[bytes]:
        header, *rest = self._pack(seed)
        flipped = bytearray(header)
        for _ in range(self.rng.randint(1, 8)):
            flipped[self.rng.randrange(len(flipped))] ^= 1 << self.rng.randrange(8)
        return [bytes(flipped), *rest]

    def envelope_lie(self, seed: _Seed) -> list[bytes]:
        key = self.rng.choice("pksrv")
        lies: dict[str, list[object]] = {
            "p": [0, 1, 3, 99, -1, "2", 2.0], "k": [0, 12, 255, -4, 4.0, True],
            "s": [-2, 0, 1, 5, 2**63 - 1, 2**63], "r": [-1, 2**63, 0.0, "7"],
            "v": [-1, 2**62, 2**63, 1e9], }
        seed.header[key] = self.rng.choice([*lies[key], self._garbage()])
        return self._pack(seed)

    def header_keys(self, seed: _Seed) -> list[bytes]:
        if self.rng.random() < 0.5:
            del seed.header[self.rng.choice("ksrvtf")]  # "p" is read first: see kind_swap
        else:
            seed.header[self.rng.choice(["x", "pp", "", "T", "ff"])] = self._garbage()
        return self._pack(seed)

    def field_lie(self, seed: _Seed) -> list[bytes]:
        own: dict[str, Any] = seed.header["f"]
        choice = self.rng.random()
        if own and choice < 0.6:
            own[self.rng.choice(sorted(own))] = self._garbage()
        elif own and choice < 0.8:
            del own[self.rng.choice(sorted(own))]
        else:
            own[self.rng.choice(["extra", "rank", "loss", "code"])] = self._garbage()
        if self.rng.random() < 0.1:
            seed.header["f"] = self._garbage()
        return self._pack(seed)

    def tensor_lie(self, seed: _Seed) -> list[bytes]:
        specs: list[Any] = seed.header["t"]
        if not specs:  # a kind that carries none: give it one
            specs.append(["float32", [self.numel], self.numel * 4])
            seed.tensors.append(self.push.tensors[0])
        spec = specs[self.rng.randrange(len(specs))]
        n = self.numel
        match self.rng.choice(("dtype", "shape", "nbytes", "count", "garbage")):
            case "dtype":
                spec[0] = self.rng.choice([*_DTYPE_LIES, self._garbage()])
                if spec[0] in ("float64", "int8", "uint8", "bool") and self.rng.random() < 0.5:
                    # An honest-looking tensor of another dtype: only the layout can refuse it.
                    spec[2] = n * torch.empty(0, dtype=getattr(torch, spec[0])).element_size()
                    seed.tensors[0] = self.rng.randbytes(spec[2])
            case "shape":
                spec[1] = self.rng.choice([[n + 1], [n - 1], [n, 1], [1, n], [], [0], [-n],
                                           [2**62], [2**63], [n] * 9, [str(n)], [[n]],
                                           [2**40, 2**40], self._garbage()])
                if self.rng.random() < 0.5 and spec[1] in ([n + 1], [n - 1], [n, 1], [0]):
                    spec[2] = math.prod(spec[1]) * 4  # consistent with itself, not the model
                    seed.tensors[0] = self.rng.randbytes(spec[2])
            case "nbytes":
                spec[2] = self.rng.choice([spec[2] + 1, spec[2] - 4, 0, -1, 2**62, 2**63 - 1,
                                           2**64 - 1, self._garbage()])
            case "count":
                if self.rng.random() < 0.5:
                    specs.append(list(spec))
                else:
                    specs.extend([list(spec)] * MAX_TENSORS)
            case _:
                specs[specs.index(spec)] = self._garbage()
        return self._pack(seed)

    def frame_count(self, seed: _Seed) -> list[bytes]:
        frames = self._pack(seed)
        if len(frames) > 1 and self.rng.random() < 0.5:
            return frames[: self.rng.randrange(1, len(frames))]
        return frames + [self.rng.randbytes(self.rng.choice([0, 4, 9640]))] * self.rng.randint(1, 3)

    def frame_length(self, seed: _Seed) -> list[bytes]:
        if not seed.tensors:
            return self.frame_count(seed)
        i = self.rng.randrange(len(seed.tensors))
        frame = seed.tensors[i]
        seed.tensors[i] = self.rng.choice([frame[:-1], frame[:-4], b"", frame + b"\x00",
                                           frame + frame[:4], frame[: len(frame) // 2]])
        return self._pack(seed)

    def non_finite(self, seed: _Seed) -> list[bytes]:
        """A well-formed update full of NaN or inf, from a stranger posing as a worker."""
        push = copy.deepcopy(self.push.header)
        push["r"], push["s"] = seed.header["r"], self.rng.choice([0, 1, 7])
        value = self.rng.choice([math.nan, math.inf, -math.inf])
        if self.rng.random() < 0.3:
            push["f"]["loss"] = value
        return [_pack(push), self.poisoned[value]]

    def replay(self, seed: _Seed) -> list[bytes]:
        """A real worker's push as it sent it, resent by a stranger, maybe retouched."""
        header, *tensors = self.rng.choice(self.replays)
        push = msgpack.unpackb(header)
        if self.rng.random() < 0.5:
            push["r"] = seed.header["r"]
        if self.rng.random() < 0.5:
            push["s"] = self.rng.choice([0, 1])
        if self.rng.random() < 0.3:
            push["v"] = self.rng.choice([0, 1, 2, 3, 50, 2**62])
        return [_pack(push), *tensors]

    def valid(self, seed: _Seed) -> list[bytes]:
        return self._pack(seed)

    def not_a_map(self, seed: _Seed) -> list[bytes]:
        return [_pack(self._garbage()), *seed.tensors]

    def too_large(self, seed: _Seed) -> list[bytes]:
        """Byte counts whose total is over the limit, each frame under ZeroMQ's."""
        push = copy.deepcopy(self.push.header)
        push["r"] = seed.header["r"]
        if self.rng.random() < 0.5:  # a lie: the frame is the model's size
            push["t"] = [["float32", [2**60], 2**62]]
            return [_pack(push), self.push.tensors[0]]
        numel = 15_000  # 60 kB a frame; the limit is the model (10 kB) plus 64 kB
        push["t"] = [["float32", [numel], numel * 4]] * 2
        return [_pack(push), *[_LARGE_FRAME] * 2]

    def big_header(self, seed: _Seed) -> list[bytes]:
        return [self.rng.choice(self.big_headers), *seed.tensors]

    def deep_nesting(self, seed: _Seed) -> list[bytes]:
        return [b"\x91" * self.rng.randrange(100, 3000) + b"\xc0", *seed.tensors]

    def kind_swap(self, seed: _Seed) -> list[bytes]:
        seed.header["k"] = self.rng.choice(list(Kind))
        return self._pack(seed)


def _pack(value: object) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


@dataclass(frozen=True)
class Verdict:
    code: str  # the RejectCode value it must be counted and refused under
    request: int  # the request id the Reject must carry


def predict(frames: list[bytes], *, layout: Layout, max_bytes: int) -> Verdict:
    """How the coordinator must refuse this message from a peer that never joined, while
    both ranks are held by training workers: every message from a stranger is refused."""
    try:
        with warnings.catch_warnings():
            # torch warns that `bytes` are read-only; the coordinator's frames are not.
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            message = decode(frames, max_bytes=max_bytes, layout=layout)
    except SharedTensorError as e:
        # A push by reference from a stranger: told to join first, as one with bytes is.
        return Verdict("unknown_worker", e.request)
    except WireError as e:
        return Verdict(e.code.value, e.request)
    match message:
        case Join(build=build) if build not in ("", "unknown", BUILD):
            code = "build"  # another release: said first, it may explain a layout's difference
        case Join(stage=stage, stages=stages) if (stage, stages) != (0, 1):
            code = "layout"  # a pipeline stage's worker: not this coordinator's (admission)
        case Join(layout=digest) if digest != layout.digest:
            code = "layout"
        case Join(rank=rank) if rank < -1:
            code = "malformed"
        case Join(rank=rank) if rank == -1 or rank >= WORKERS:
            code = "full"
        case Join():
            code = "rank_taken"
        case _:
            code = "unknown_worker"
    return Verdict(code, message.request)


# repr=False: Python 3.11's asyncio.run formats the repr of its main task's result when it
# restores SIGINT, and a repr of 10,000 messages takes seconds.
@dataclass(repr=False)
class FuzzPlan:
    messages: list[list[bytes]]
    verdicts: list[Verdict]
    ops: list[str]  # the mutation that made each message
    oversize: list[list[bytes]]

    def describe(self, i: int) -> str:
        return f"fuzz message {i} ({self.ops[i]}, to be refused as {self.verdicts[i]})"


def plan_fuzz(layout: Layout, max_bytes: int, replays: list[list[bytes]]) -> FuzzPlan:
    rng = random.Random(SEED)
    mutator = Mutator(rng, layout, replays)
    plan = FuzzPlan([], [], [], [])
    while len(plan.messages) < FUZZ_MESSAGES:
        op, frames = mutator.message(REQUEST_BASE + len(plan.messages))
        assert all(len(f) <= max_bytes for f in frames), f"{op} made an oversize frame"
        plan.messages.append(frames)
        plan.verdicts.append(predict(frames, layout=layout, max_bytes=max_bytes))
        plan.ops.append(op)
    plan.oversize = [mutator.oversize(max_bytes) for _ in range(OVERSIZE_MESSAGES)]
    return plan


# The stranger's sockets ----------------------------------------------------------------------


def _dealer(context: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RECONNECT_IVL, 10)
    socket.connect(endpoint)
    return socket


async def _recv(socket: zmq.asyncio.Socket, run: asyncio.Task[Any], what: str) -> list[bytes]:
    receiving = asyncio.ensure_future(socket.recv_multipart())
    done, _ = await asyncio.wait({receiving, run}, timeout=REPLY_TIMEOUT_S,
                                 return_when=asyncio.FIRST_COMPLETED)
    if receiving not in done:
        receiving.cancel()
        if run in done:
            raise AssertionError(f"the coordinator ended while waiting for {what}: {run!r}")
        raise AssertionError(f"no reply to {what} within {REPLY_TIMEOUT_S} s")
    return receiving.result()


async def _fuzz(socket: zmq.asyncio.Socket, plan: FuzzPlan, run: asyncio.Task[Any]) -> list[list[bytes]]:
    """Send the plan's messages, at most WINDOW ahead of the replies; return the replies."""
    replies: list[list[bytes]] = []
    for i, frames in enumerate(plan.messages):
        while i - len(replies) >= WINDOW:
            replies.append(await _recv(socket, run, plan.describe(len(replies))))
        await socket.send_multipart(frames)
    while len(replies) < len(plan.messages):
        replies.append(await _recv(socket, run, plan.describe(len(replies))))
    return replies


async def _oversize(socket: zmq.asyncio.Socket, messages: list[list[bytes]]) -> tuple[int, bool]:
    """Send each message once the last one has cost this socket its connection; return how
    many disconnections were seen, and whether anything was answered."""
    monitor = socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    hung_up = 0
    try:
        for frames in messages:
            await socket.send_multipart(frames)
            while True:
                event = parse_monitor_message(await asyncio.wait_for(monitor.recv_multipart(), 10.0))
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    hung_up += 1
                    break
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)
    return hung_up, bool(await socket.poll(50))


async def _until(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        await asyncio.sleep(0.005)


# Tests ------------------------------------------------------------------------------------------


@dataclass(repr=False)
class FuzzOutcome:
    plan: FuzzPlan
    replies: list[list[bytes]]
    hung_up: int  # times the oversize socket lost its connection
    oversize_answered: bool
    versions: tuple[int, int]  # the coordinator's version when the fuzz began and ended
    state: State  # the coordinator's state when the fuzz ended
    rejected: Counter[str]  # metrics.rejected when the fuzz ended
    summary: dict[str, Any]
    weights: list[torch.Tensor]


async def _fuzz_run(reference: Reference) -> FuzzOutcome:
    gate = threading.Event()
    coordinator = _coordinator()
    endpoint = coordinator.bind()
    # Its own limit (private): the verdicts must use exactly what the coordinator checks.
    layout, max_bytes = coordinator.flat.layout, coordinator._max_bytes
    replays = [reference.pushes[key] for key in sorted(reference.pushes) if key[1] < 10]
    plan = plan_fuzz(layout, max_bytes, replays)
    run = asyncio.create_task(coordinator.run())

    def held(rank: int, world: int, batch: int) -> _Held:
        return _Held(digits.data(rank, world, batch), gate)

    workers = [asyncio.create_task(_worker(endpoint, rank, held).run()) for rank in range(WORKERS)]
    context = zmq.asyncio.Context()
    # Closed by hand: a socket left to the garbage collector warns, which fails the test.
    stranger, oversize = _dealer(context, endpoint), _dealer(context, endpoint)
    try:
        await _until(lambda: coordinator.version >= 1 or run.done(), 30.0, "training started")
        first = coordinator.version
        fuzzing = asyncio.create_task(_fuzz(stranger, plan, run))
        hung_up, answered = await _oversize(oversize, plan.oversize)
        replies = await fuzzing
        versions, state = (first, coordinator.version), coordinator.state
        rejected = Counter(coordinator.metrics.rejected)
        gate.set()
        summary = await asyncio.wait_for(run, 30.0)
        await asyncio.gather(*workers)
    finally:
        gate.set()
        stranger.close(linger=0)
        oversize.close(linger=0)
        context.destroy(linger=0)
        for task in (run, *workers):
            task.cancel()
        await asyncio.gather(run, *workers, return_exceptions=True)
    return FuzzOutcome(plan, replies, hung_up, answered, versions, state, rejected, summary,
                       _weights(coordinator))


@pytest.mark.timeout(90)
def test_fuzz_from_a_stranger_is_all_rejected_and_training_is_untouched(
    reference: Reference,
) -> None:
    outcome = asyncio.run(_fuzz_run(reference))
    plan = outcome.plan
    assert len(plan.messages) >= 10_000
    assert len(set(plan.ops)) == MUTATIONS, f"a mutation made no message: {Counter(plan.ops)}"
    # It kept training: versions went on during the fuzz, and the run finished.
    first, last = outcome.versions
    assert outcome.state is State.TRAINING, "the fuzz outlasted training"
    assert last > first, f"no version applied during the fuzz (stuck at {first})"
    assert outcome.summary["steps"] == STEPS
    assert outcome.summary["dropped"] == {}
    # Every message was answered, in order, by the Reject its verdict names.
    assert len(outcome.replies) == len(plan.messages)
    for i, (reply, verdict) in enumerate(zip(outcome.replies, plan.verdicts, strict=True)):
        message = decode(reply)
        assert isinstance(message, Reject), f"{plan.describe(i)}: answered by {message!r}"
        assert (message.code, message.request) == (verdict.code, verdict.request), plan.describe(i)
    # Every one was counted, under its code; the oversize ones (never read) under none.
    expected = Counter(v.code for v in plan.verdicts)
    assert outcome.rejected == expected
    assert outcome.summary["rejected"] == dict(expected)
    assert outcome.hung_up == len(plan.oversize) and not outcome.oversize_answered
    # Its weights were never touched: bit for bit those of the run without the fuzzer.
    _assert_same_weights(outcome.weights, reference.weights)


# A joined worker that lies --------------------------------------------------------------------


def _member_lies(real: Push, previous: Push) -> dict[int, tuple[Push, str]]:
    """Pushes a member sends over its own connection just before `real`, by request id, each
    with the drop reason (or, for a Reject, the code) it must be answered with."""
    grads = real.tensors[0]
    nan, inf = grads.clone(), grads.clone()
    nan[0], inf[-1] = math.nan, math.inf
    lies = [
        (replace(real, tensors=(nan, *real.tensors[1:])), "not_finite"),
        (replace(real, tensors=(inf, *real.tensors[1:])), "not_finite"),
        (replace(real, loss=math.nan), "not_finite"),
        (replace(real, version=real.version + 1), "ahead"),
        (replace(real, version=2**62), "ahead"),
        (replace(previous, clock=real.clock), "late"),  # its last push, again
    ]
    # Not here: a push posing as the other worker. It is refused (unknown_worker), and the
    # honest worker sharing this connection takes that Reject as its own removal and joins
    # again. The fuzz sends such pushes from a connection of their own.
    return {LIE_BASE + i: (replace(push, request=LIE_BASE + i), why)
            for i, (push, why) in enumerate(lies)}


class _LyingMember(ZmqClient):
    """Worker HOSTILE_RANK's own connection. Before the worker's push on version LIE_AT it
    sends `_member_lies`, and it keeps the answers to them, which the worker ignores."""

    def __init__(self, connect: str, *, layout: Layout, lies: dict[int, tuple[Push, str]],
                 answers: dict[int, Message], **options: Any) -> None:
        super().__init__(connect, **options)
        self._layout, self._lies, self._answers = layout, lies, answers
        self._previous: Push | None = None  # the worker's last push, copied
        self._segments = SegmentCache()

    async def send(self, frames: Any) -> Any:
        header = msgpack.unpackb(frames[0])
        if header["k"] == Kind.PUSH and header["s"] == HOSTILE_RANK:
            # (The worker's pushes go by reference from shared memory: read them there.)
            push = decode(frames, layout=self._layout, segments=self._segments)
            assert isinstance(push, Push)
            # Copied: the tensors are the worker's gradient buffer, written again later.
            real = replace(push, tensors=tuple(t.clone() for t in push.tensors))
            if real.version == LIE_AT and not self._lies:
                assert self._previous is not None
                self._lies.update(_member_lies(real, self._previous))
                for lie, _ in self._lies.values():
                    await super().send(encode(lie))
            self._previous = real
        return await super().send(frames)

    async def recv(self) -> Any:
        frames = await super().recv()
        request = msgpack.unpackb(frames[0])["r"]
        if request >= LIE_BASE:
            self._answers[request] = decode(frames, layout=self._layout)
        return frames


@pytest.mark.timeout(60)
def test_hostile_pushes_from_a_member_are_dropped_and_never_applied(
    reference: Reference, caplog: pytest.LogCaptureFixture
) -> None:
    lies: dict[int, tuple[Push, str]] = {}
    answers: dict[int, Message] = {}

    lying = _client_factory(_LyingMember, layout=_coordinator().flat.layout, lies=lies,
                            answers=answers)

    async def train() -> tuple[Coordinator, dict[str, Any]]:
        coordinator = _coordinator()
        endpoint = coordinator.bind()
        summary, *_ = await asyncio.gather(coordinator.run(), *(
            _worker(endpoint, rank, transport=lying).run() for rank in range(WORKERS)))
        return coordinator, summary

    caplog.set_level(logging.WARNING, logger="tensorbus.coordinator")
    coordinator, summary = asyncio.run(train())

    assert len(lies) == 6, "the worker never pushed on version LIE_AT"
    for request, (lie, why) in lies.items():
        answer = answers.get(request)
        assert isinstance(answer, Ack) and answer.dropped == why, (lie, answer)
    dropped = Counter(why for _, why in lies.values())
    assert summary["dropped"] == dict(dropped)  # not_finite 3, ahead 2, late 1
    assert summary["rejected"] == {}
    assert summary["per_worker"][str(HOSTILE_RANK)]["dropped"] == sum(dropped.values())
    assert summary["steps"] == STEPS
    assert math.isfinite(summary["final_loss"])
    assert any("non-finite" in r.getMessage() for r in caplog.records
               if r.name == "tensorbus.coordinator" and r.levelno == logging.WARNING)
    _assert_same_weights(_weights(coordinator), reference.weights)


# Unasked messages and long details from a stranger -----------------------------------------


async def _ask_stranger(frames: list[list[Any]]) -> tuple[list[list[bytes]], Counter[str], State]:
    """Send each message from a peer that never joined, to a coordinator waiting for its
    workers; return the replies (one each, in order), its rejection counts and state."""
    coordinator = _coordinator()
    endpoint = coordinator.bind()
    run = asyncio.create_task(coordinator.run())
    context = zmq.asyncio.Context()
    stranger = _dealer(context, endpoint)
    try:
        for message in frames:
            await stranger.send_multipart(message)
        replies = [await _recv(stranger, run, f"message {i}") for i in range(len(frames))]
        return replies, Counter(coordinator.metrics.rejected), coordinator.state
    finally:
        stranger.close(linger=0)
        context.destroy(linger=0)
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)


@pytest.mark.timeout(30)
def test_heartbeat_and_leave_from_a_stranger_are_rejected_and_counted() -> None:
    sent = [Heartbeat(sender=0, request=11, version=3, phase="computing", clock=3),
            Leave(sender=0, request=12, reason="done"),
            Heartbeat(sender=9, request=13),
            Leave(sender=1, request=14, reason="error", detail="boom")]
    replies, rejected, state = asyncio.run(_ask_stranger([encode(m) for m in sent]))
    answers = [decode(r) for r in replies]
    assert [(a.KIND, a.request, getattr(a, "code", None)) for a in answers] == [
        (Kind.REJECT, m.request, "unknown_worker") for m in sent]
    assert rejected == {"unknown_worker": len(sent)}
    assert state is State.STARTING  # no worker joined, none left


def _long_values(layout: Layout) -> list[list[bytes]]:
    """Messages whose header holds a string or list just under the codec's limits (4096
    characters a string, 64 KiB a header) where an error message quotes it."""
    tensors = layout.allocate()
    push = msgpack.unpackb(encode(Push(sender=0, request=21, clock=0, loss=1.0, samples=8,
                                       tensors=tensors))[0])
    frame = bytes(memoryview(encode(Push(clock=0, loss=1.0, samples=8, tensors=tensors))[1]))
    long, longs = "z" * 4090, ["z" * 4000] * 15
    spec = push["t"][0]
    headers = [
        {**push, "p": longs}, {**push, "k": long}, {**push, "s": long}, {**push, "v": longs},
        {**push, "f": {**push["f"], long: 1}}, {**push, long: 1},
        {**push, "t": [[long, spec[1], spec[2]]]}, {**push, "t": [[spec[0], longs, spec[2]]]},
        {**push, "t": [[spec[0], spec[1], long]]},
    ]
    return [[_pack(h), frame] for h in headers]


@pytest.mark.timeout(30)
def test_every_reject_can_be_read_by_its_sender() -> None:
    layout = _coordinator().flat.layout
    replies, rejected, _ = asyncio.run(_ask_stranger(_long_values(layout)))
    assert sum(rejected.values()) == len(replies)  # every one counted, and answered ...
    unreadable = []
    for i, reply in enumerate(replies):
        try:
            assert isinstance(decode(reply), Reject)
        except WireError as e:
            unreadable.append(f"reply {i} ({len(reply[0])} bytes): {e}"[:200])
    assert unreadable == []  # ... and every answer readable by a peer's codec


@pytest.mark.timeout(30)
def test_a_refused_header_names_the_request_it_refuses() -> None:
    join = msgpack.unpackb(encode(Join(request=5, rank=-1, layout="x"))[0])
    sent = [{**join, "p": 1}, {**join, "p": 1, "r": 6, "x": 1}, {**join, "r": 7, "x": 1}]
    replies, _, _ = asyncio.run(_ask_stranger([[_pack(h)] for h in sent]))
    answers = [decode(r) for r in replies]
    assert [(a.request, getattr(a, "code", None)) for a in answers] == [
        (5, "protocol"), (6, "protocol"), (7, "malformed")]
