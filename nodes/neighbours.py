"""A pipeline stage worker's links to the stages beside it: activations in and out.

Each stage worker binds an inbox (a ROUTER on a free port of its host) and connects one
DEALER to the inbox of each neighbour of its pipeline: the previous stage sends it
Activations, the next one ActivationGrads, and both send it a Heartbeat every heartbeat
period. Each DEALER's routing id names its stage, so the inbox knows who sent what before
it reads a message, and takes from each neighbour only what that neighbour sends.

The event loop runs the sockets: a receive task decodes every message (checked by the
codec, then here: kind, stage, pipeline, micro-batch, tensor count) and puts it in a
`Mailbox`; the compute thread takes what its schedule needs next, waiting while the
neighbour it waits on is heard from (Heartbeat or message) within the session's timeout,
and raises `NeighbourLost` naming the neighbour once it is not. A session that ends (the
coordinator stopped or removed this worker) interrupts the wait at once (`interrupt`).

Zero copies: an activation goes as one frame per tensor, sent from the tensor's own memory
(nothing writes a stage's outputs once made), and arrives as a tensor over the frame
(`torch.frombuffer`), which the next stage computes on where it lies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
from collections.abc import Callable
from typing import Any, Final

from tensorbus.bus.clock import SYSTEM_CLOCK, Clock
from tensorbus.bus.codec import DEFAULT_MAX_MESSAGE_BYTES, decode, encode
from tensorbus.bus.deadline import at_most
from tensorbus.bus.errors import WireError
from tensorbus.bus.messages import ActivationGrads, Activations, Heartbeat, Kind, Message
from tensorbus.bus.transport import Hub, ZmqRouter, ZmqSender

log = logging.getLogger("tensorbus.worker")
PREVIOUS, NEXT = -1, 1  # the neighbours, by their offset from this stage
Key = tuple[Kind, int, int]  # (kind, step, micro-batch)
_FROM: Final = {Kind.ACTIVATIONS: PREVIOUS, Kind.ACTIVATION_GRADS: NEXT}  # who sends which


class NeighbourLost(Exception):  # noqa: N818 - an outcome, as the coordinator's "lost"
    """A neighbouring stage of this pipeline went silent while this stage waited on it."""

    def __init__(self, stage: int, pipeline: int, silent_s: float, waiting_for: str) -> None:
        super().__init__(f"stage {stage} of pipeline {pipeline} was silent for {silent_s:.1f} s "
                         f"while this stage waited for {waiting_for}: its process is gone or "
                         "stalled (its pipeline cannot go on)")
        self.stage = stage
        self.pipeline = pipeline
        self.silent_s = silent_s


def routing_id(stage: int, pipeline: int) -> bytes:
    """How a stage worker names itself to its neighbours' inboxes."""
    return f"stage {stage} of pipeline {pipeline}".encode()


class Mailbox:
    """Messages from the neighbours, by (kind, step, micro-batch), until taken: put on the
    event loop's thread, taken on the compute thread."""

    def __init__(self) -> None:
        self._kept: dict[Key, Message] = {}
        self._changed = threading.Condition()
        self._interrupted: BaseException | None = None

    def put(self, key: Key, message: Message) -> bool:
        """Keep `message`; False (kept nothing) if one with that key is kept already."""
        with self._changed:
            if key in self._kept:
                return False
            self._kept[key] = message
            self._changed.notify_all()
            return True

    def take(self, key: Key, *, poll_s: float, check: Callable[[], None]) -> Message:
        """The message of `key`, once it is here; `check` is called every `poll_s` while
        none is (it raises to end the wait), and an interruption raises at once. What was
        kept for earlier steps is let go of: steps only go on (a step given up when a
        session ended is not asked for again)."""
        with self._changed:
            for stale in [k for k in self._kept if k[1] < key[1]]:
                del self._kept[stale]
            while True:
                if self._interrupted is not None:
                    raise self._interrupted
                message = self._kept.pop(key, None)
                if message is not None:
                    return message
                if not self._changed.wait(timeout=poll_s):
                    check()

    def interrupt(self, why: BaseException) -> None:
        """Make every take raise `why`, now and until `resume`."""
        with self._changed:
            self._interrupted = why
            self._changed.notify_all()

    def resume(self) -> None:
        """A new session: takes wait again. (What is kept stays: a neighbour may send this
        session's first activations before this worker's session has begun.)"""
        with self._changed:
            self._interrupted = None

    def __len__(self) -> int:
        with self._changed:
            return len(self._kept)


class Neighbours:
    """Stage `stage` of `stages`'s links to the stages beside it in its pipeline."""

    def __init__(self, *, stage: int, stages: int, host: str = "127.0.0.1",
                 micro_batches: Callable[[], int] = lambda: 0, clock: Clock = SYSTEM_CLOCK,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, hub: Hub | None = None
                 ) -> None:
        """`micro_batches`: how many a step has (from the Welcome; 0 while not known), to
        check messages by. `hub`: the worker's ZeroMQ context, for its sockets too (one
        I/O thread for all)."""
        if not 0 <= stage < stages:
            raise ValueError(f"stage {stage} of {stages}: need 0 <= stage < stages")
        self.stage, self.stages = stage, stages
        self.pipeline = -1  # this worker's rank (its pipeline), once joined
        self._host = host
        self._hub = hub
        self._micro_batches = micro_batches
        self._clock = clock
        self._max_bytes = max_message_bytes
        self._inbox: ZmqRouter | None = None
        self._senders: dict[int, ZmqSender] = {}  # offset -> link to that neighbour's inbox
        self._heard: dict[int, float] = {}  # offset -> monotonic time last heard from
        self.mailbox = Mailbox()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sent: list[concurrent.futures.Future[None]] = []  # sends of the compute thread
        self.timeout_s = 10.0  # the session's (its Welcome's): silence that ends a wait
        self.heartbeat_s = 0.5
        self.refused = 0  # messages dropped for what they were (logged)

    @property
    def inbox(self) -> str:
        """Where the neighbours send to (bound by `bind`)."""
        if self._inbox is None:
            raise RuntimeError("bind() first")
        return self._inbox.endpoint

    @property
    def offsets(self) -> tuple[int, ...]:
        """The neighbours this stage has: the previous, the next, or both."""
        return tuple(o for o in (PREVIOUS, NEXT) if 0 <= self.stage + o < self.stages)

    def bind(self) -> str:
        self._inbox = ZmqRouter(f"tcp://{self._host}:0", max_message_bytes=self._max_bytes + 65536,
                                hub=self._hub)
        return self._inbox.endpoint

    def connect(self, endpoints: dict[int, str], *, heartbeat_s: float, timeout_s: float) -> None:
        """Send to these inboxes (offset -> endpoint) from now on; a neighbour's silence
        is counted from now. (A link to the same endpoint is kept as it is.)"""
        self._loop = asyncio.get_running_loop()
        self.heartbeat_s, self.timeout_s = heartbeat_s, timeout_s
        for offset, endpoint in endpoints.items():
            held = self._senders.get(offset)
            if held is not None and held.endpoint != endpoint:
                held.close()
                held = None
            if held is None:
                self._senders[offset] = ZmqSender(
                    endpoint, routing_id=routing_id(self.stage, self.pipeline), hub=self._hub)
            self._heard[offset] = self._clock.monotonic()

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None

    # The event loop's side --------------------------------------------------------------

    async def receive(self) -> None:
        """Take every message the neighbours send, for as long as the worker runs."""
        assert self._inbox is not None
        while True:
            peer, frames = await self._inbox.recv()
            offset = self._offset_of(peer)
            if offset is None:
                self._refuse(f"a message from {peer[:64]!r}, not a neighbour of this stage")
                continue
            try:
                message = decode(frames, max_bytes=self._max_bytes)
            except WireError as e:
                self._refuse(f"a bad message from stage {self.stage + offset}: {e}")
                continue
            del frames  # (the message's tensors keep what they need of them)
            self._heard[offset] = self._clock.monotonic()
            if isinstance(message, Heartbeat):
                continue
            problem = self._problem(message, offset)
            if problem:
                self._refuse(f"{problem} from stage {self.stage + offset}")
                continue
            assert isinstance(message, Activations | ActivationGrads)
            if not self.mailbox.put((message.KIND, message.step, message.micro), message):
                self._refuse(f"a second {message.KIND.name} for micro-batch {message.micro} of "
                             f"step {message.step} from stage {self.stage + offset}")

    async def heartbeats(self) -> None:
        """Tell each neighbour this stage is alive, every heartbeat period."""
        while True:
            for sender in list(self._senders.values()):
                # (A beat that cannot leave is dropped: the neighbour's silence says it.)
                try:
                    await at_most(sender.send(encode(Heartbeat(sender=self.pipeline))),
                                  self.heartbeat_s)
                except TimeoutError:
                    pass
            await asyncio.sleep(self.heartbeat_s)

    def _offset_of(self, peer: bytes) -> int | None:
        for offset in self.offsets:
            if peer == routing_id(self.stage + offset, self.pipeline):
                return offset
        return None

    def _problem(self, message: Message, offset: int) -> str:
        """What is wrong with `message` from the neighbour at `offset` ("": nothing)."""
        if _FROM.get(message.KIND) != offset:
            return f"a {message.KIND.name}, which that neighbour does not send,"
        assert isinstance(message, Activations | ActivationGrads)
        if message.sender != self.pipeline or message.stage != self.stage + offset:
            return (f"a message of stage {message.stage} of pipeline {message.sender}, sent "
                    "under another name,")
        known = self._micro_batches()
        if message.micro < 0 or 0 < known <= message.micro:
            return f"micro-batch {message.micro} of {known}"
        if isinstance(message, Activations) and not 1 <= message.outputs < len(message.tensors):
            return (f"{len(message.tensors)} tensors, of which {message.outputs} outputs (at least "
                    "one output and one target)")
        return ""

    def _refuse(self, what: str) -> None:
        self.refused += 1
        if math.log2(self.refused).is_integer():  # (1st, 2nd, 4th, ...: bounded in the log)
            log.warning("stage %d of pipeline %d dropped %s (%d dropped so far)", self.stage,
                        self.pipeline, what, self.refused)

    async def _send(self, offset: int, frames: list[Any], what: str) -> None:
        try:
            await at_most(self._senders[offset].send(frames), self.timeout_s)
        except TimeoutError:  # (its inbox takes nothing: it is gone, or stalled)
            raise NeighbourLost(self.stage + offset, self.pipeline, self.timeout_s,
                                f"its inbox to take the {what}") from None

    # The compute thread's side ----------------------------------------------------------

    def send(self, message: Activations | ActivationGrads) -> None:
        """Send `message` to the neighbour that takes it (from the compute thread; its
        tensors must not be written again: they go as they lie)."""
        offset = -_FROM[message.KIND]
        frames = encode(message, chunk_bytes=self._max_bytes)  # (a frame a tensor)
        assert self._loop is not None
        what = (f"{'activations' if message.KIND is Kind.ACTIVATIONS else 'gradients'} of "
                f"micro-batch {message.micro} of step {message.step}")
        self._sent.append(asyncio.run_coroutine_threadsafe(self._send(offset, frames, what),
                                                           self._loop))

    def flush(self) -> None:
        """Raise what a send of the compute thread raised, if one did; forget those done."""
        pending = []
        for future in self._sent:
            if future.done():
                future.result()  # (its error, if any)
            else:
                pending.append(future)
        self._sent = pending

    def take(self, kind: Kind, step: int, micro: int, waiting_for: str) -> Message:
        """The message of `kind` for (step, micro), waited for while its sender is heard."""
        offset = _FROM[kind]

        def check() -> None:
            self.flush()
            silent = self._clock.monotonic() - self._heard.get(offset, -math.inf)
            if silent > self.timeout_s:
                raise NeighbourLost(self.stage + offset, self.pipeline, silent, waiting_for)

        return self.mailbox.take((kind, step, micro), poll_s=self.heartbeat_s, check=check)
