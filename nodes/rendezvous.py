"""The rendezvous of a collectives group: every rank's call of collective k meets here.

One `Rendezvous` serves one group of `size` ranks (the ranks' side is `nodes.collectives`).
Each rank numbers its calls (`seq`: 0 is the join); the rendezvous gathers the `size` calls
of number k, checks that they agree (same op, same tensor dtype and shape, same reduce op
or source), computes the result and answers every rank. It holds nothing between two
collectives but what it needs to answer late or repeated calls: where each rank is, and
the last failures.

- allreduce: the tensors are combined in rank order, in their own dtype (fp32 sums in
  fp32, as gloo does), so every rank gets the same bytes and a rerun gets them again.
- broadcast: the source's tensor goes to every other rank as it arrived; the source gets
  an empty answer (it already holds the tensor).
- allgather: the tensors flattened and stacked in rank order, one tensor [size, numel]
  to everyone.
- join, barrier, leave: answered once all have called; the join's answer says which ranks
  share a host (int64 [size], host numbers in rank order), for local ranks.

A call that disagrees with the others fails collective k on every rank (Outcome.MISMATCH,
naming who called what); a rank that does not call within the timeout of one that did fails
it too (Outcome.TIMEOUT, naming the missing ranks). A failed k is remembered, so a late
rank learns of it at once instead of waiting out its own timeout. A message that is not a
valid call (undecodable, out of turn, a rank claimed twice) gets a coded Reject.

Zero copies on the way through: received tensors are read from their frames (`spans`),
results are fresh tensors sent without copying, and a broadcast forwards the frame it got.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Final

import torch

from tensorbus.bus.codec import DEFAULT_MAX_MESSAGE_BYTES, DTYPE_NAMES, DTYPES, decode, encode
from tensorbus.bus.errors import WireError
from tensorbus.bus.messages import (
    COORDINATOR,
    Collective,
    CollectiveOp,
    Outcome,
    ReduceOp,
    Reject,
    RejectCode,
    Result,
)
from tensorbus.bus.pieces import Received, copy_into, spans, whole
from tensorbus.bus.security import ServerKeys
from tensorbus.bus.transport import ZmqRouter

log = logging.getLogger("tensorbus.rendezvous")

KEEP_FAILED: Final = 64  # failed collectives remembered, for ranks that arrive late
_DIMS = r"(?:0|[1-9][0-9]{0,18})"
_SPEC: Final = re.compile(rf"(?:{'|'.join(DTYPES)})\[(?:{_DIMS}(?:, {_DIMS}){{0,7}})?\]")
_WITH_TENSOR: Final = frozenset({CollectiveOp.ALLREDUCE, CollectiveOp.ALLGATHER})
_WITHOUT: Final = frozenset({CollectiveOp.JOIN, CollectiveOp.BARRIER, CollectiveOp.LEAVE})


def tensor_spec(tensor: Received) -> str:
    """'float32[10, 3]': what a rank calls a collective with, as the rendezvous compares it."""
    return f"{DTYPE_NAMES[tensor.dtype]}[{', '.join(str(d) for d in tensor.shape)}]"


def describe(call: Collective) -> str:
    """The call as the user wrote it, for error messages: 'allreduce(float32[10], sum)'."""
    match call.op:
        case CollectiveOp.ALLREDUCE.value:
            return f"allreduce({call.spec}, {call.reduce})"
        case CollectiveOp.BROADCAST.value:
            return f"broadcast({call.spec}, src={call.root})"
        case CollectiveOp.ALLGATHER.value:
            return f"allgather({call.spec})"
        case CollectiveOp.JOIN.value:
            return f"join(size={call.size})"
        case CollectiveOp.LEAVE.value:
            return "close()"
        case _:
            return f"{call.op}()"


def ranks(numbers: list[int]) -> str:
    """'rank 2' or 'ranks 2, 3': who, in a message."""
    return f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {', '.join(map(str, numbers))}"


@dataclass
class _Round:
    """Collective number `seq` while its calls come in."""

    seq: int
    first: Collective  # the call the others must agree with
    calls: dict[int, tuple[bytes, Collective]] = field(default_factory=dict)  # rank -> (peer, call)
    deadline: float = math.inf
    timer: asyncio.TimerHandle | None = None


class _Refused(Exception):
    def __init__(self, code: RejectCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


class Rendezvous:
    """Serves one group on the running event loop: `start()`, then `close()`."""

    def __init__(
        self,
        bind: str,
        *,
        size: int,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        keys: ServerKeys | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self.size = size
        self._max_bytes = max_message_bytes
        self._server = ZmqRouter(bind, max_message_bytes=max_message_bytes + 65536, keys=keys)
        self.endpoint = self._server.endpoint
        self._next = [0] * size  # the number of each rank's next call
        self._rounds: dict[int, _Round] = {}
        self._failed: dict[int, tuple[Outcome, str]] = {}  # oldest first
        self._hosts: dict[int, str] = {}  # rank -> host name, from the join
        self.completed = 0  # collectives answered, the join included
        self.rejected: Counter[str] = Counter()  # messages refused, by RejectCode value
        self._warned: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._expiring: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._serve(), name=f"rendezvous {self.endpoint}")
        self._task.add_done_callback(_log_crash)

    async def close(self, *, linger_s: float = 0.0) -> None:
        """Stop serving; `linger_s` gives answers still queued that long to leave."""
        for task in (self._task, *self._expiring):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._task, *self._expiring) if t is not None),
                             return_exceptions=True)
        for round_ in self._rounds.values():
            if round_.timer is not None:
                round_.timer.cancel()
        # Blocks the loop for up to the linger: this is its last act.
        self._server.close(linger_s=linger_s)

    async def _serve(self) -> None:
        while True:
            peer, frames = await self._server.recv()
            try:
                call = decode(frames, max_bytes=self._max_bytes)
            except WireError as e:
                await self._refuse(peer, e.request, _Refused(e.code, str(e)))
                continue
            try:
                if not isinstance(call, Collective):
                    raise _Refused(RejectCode.UNEXPECTED, f"a rendezvous takes collectives, "
                                                          f"not {call.KIND.name}")
                await self._take(peer, call)
            except _Refused as e:
                await self._refuse(peer, call.request, e)

    # One call ------------------------------------------------------------------------------

    async def _take(self, peer: bytes, call: Collective) -> None:
        if call.size != self.size:
            # A rank started with another size: everyone in this collective should know.
            detail = (f"rank {call.sender} was started with size={call.size}, the rendezvous "
                      f"at {self.endpoint} with size={self.size}: give every rank the same size")
            await self._fail(call.seq, Outcome.MISMATCH, detail, also=(peer, call))
            return
        self._check(call)
        rank = call.sender
        self._next[rank] = call.seq + 1
        failed = self._failed.get(call.seq)
        if failed is not None:
            await self._answer(peer, call, Result(seq=call.seq, outcome=failed[0].value,
                                                  detail=failed[1]))
            return
        round_ = self._rounds.setdefault(call.seq, _Round(call.seq, call))
        first = round_.first
        if (call.op, call.spec, call.reduce, call.root) != (first.op, first.spec, first.reduce,
                                                            first.root):
            detail = (f"rank {rank} called {describe(call)} as collective {call.seq} where rank "
                      f"{first.sender} called {describe(first)}")
            await self._fail(call.seq, Outcome.MISMATCH, detail, also=(peer, call))
            return
        round_.calls[rank] = (peer, call)
        if call.op == CollectiveOp.JOIN.value:
            self._hosts[rank] = call.host
        deadline = asyncio.get_running_loop().time() + call.timeout_s
        if deadline < round_.deadline:
            if round_.timer is not None:
                round_.timer.cancel()
            round_.deadline = deadline
            round_.timer = asyncio.get_running_loop().call_at(deadline, self._expire, round_)
        if len(round_.calls) == self.size:
            await self._complete(round_)

    def _check(self, call: Collective) -> None:
        """Refuse a call that is not valid in itself or not this rank's turn."""
        rank, seq = call.sender, call.seq
        if not 0 <= rank < self.size:
            raise _Refused(RejectCode.MALFORMED, f"rank {rank} in a group of {self.size}")
        if call.op not in CollectiveOp._value2member_map_:
            raise _Refused(RejectCode.MALFORMED, f"unknown collective {call.op[:40]!r}")
        op = CollectiveOp(call.op)
        if (op is CollectiveOp.JOIN) != (seq == 0):
            raise _Refused(RejectCode.MALFORMED, "a join is collective 0, and only a join is")
        if op is CollectiveOp.JOIN and (self._next[rank] > 0 or self._taken(rank, seq)):
            raise _Refused(RejectCode.RANK_TAKEN, f"rank {rank} has joined already: give each "
                                                  "process its own rank")
        if op is not CollectiveOp.JOIN and self._next[rank] == 0:
            raise _Refused(RejectCode.UNKNOWN_WORKER, f"rank {rank} has not joined")
        if seq != self._next[rank] or self._taken(rank, seq):
            raise _Refused(RejectCode.UNEXPECTED, f"rank {rank} sent collective {seq} out of "
                                                  f"turn: its next is {self._next[rank]}")
        if not (math.isfinite(call.timeout_s) and call.timeout_s > 0):
            raise _Refused(RejectCode.MALFORMED, f"timeout_s of {call.timeout_s}")
        sends = op in _WITH_TENSOR or (op is CollectiveOp.BROADCAST and call.root == rank)
        if len(call.tensors) != int(sends):
            raise _Refused(RejectCode.MALFORMED, f"{op.value} from rank {rank} with "
                                                 f"{len(call.tensors)} tensors")
        if call.tensors and call.spec != tensor_spec(call.tensors[0]):
            raise _Refused(RejectCode.MALFORMED, "spec does not describe the tensor sent")
        if (op in _WITHOUT) != (call.spec == "") or (call.spec and not _SPEC.fullmatch(call.spec)):
            raise _Refused(RejectCode.MALFORMED, f"spec {call.spec[:80]!r} for {op.value}")
        if op is CollectiveOp.BROADCAST and not 0 <= call.root < self.size:
            raise _Refused(RejectCode.MALFORMED, f"broadcast from rank {call.root} in a group "
                                                 f"of {self.size}")
        if op is CollectiveOp.ALLREDUCE:
            if call.reduce not in ReduceOp._value2member_map_:
                raise _Refused(RejectCode.MALFORMED, f"unknown reduce op {call.reduce[:40]!r}")
            if call.reduce == ReduceOp.MEAN.value and not call.tensors[0].is_floating_point():
                raise _Refused(RejectCode.MALFORMED, f"mean of {call.spec}: floats only")

    def _taken(self, rank: int, seq: int) -> bool:
        round_ = self._rounds.get(seq)
        return round_ is not None and rank in round_.calls

    # Endings -------------------------------------------------------------------------------

    async def _complete(self, round_: _Round) -> None:
        del self._rounds[round_.seq]
        if round_.timer is not None:
            round_.timer.cancel()
        calls = [round_.calls[rank] for rank in range(self.size)]
        first = round_.first
        out: tuple[torch.Tensor, ...] = ()
        match CollectiveOp(first.op):
            case CollectiveOp.JOIN:
                numbers: dict[str, int] = {}
                out = (torch.tensor([numbers.setdefault(self._hosts[r], len(numbers))
                                     for r in range(self.size)], dtype=torch.int64),)
            case CollectiveOp.ALLREDUCE:
                out = (_reduce([c.tensors[0] for _, c in calls], ReduceOp(first.reduce)),)
            case CollectiveOp.ALLGATHER:
                # [size, numel]: a tensor of the most dimensions the codec takes gathers too.
                stacked = torch.empty((self.size, first.tensors[0].numel()),
                                      dtype=first.tensors[0].dtype)
                for rank, (_, call) in enumerate(calls):
                    copy_into(stacked[rank], call.tensors[0])
                out = (stacked,)
            case CollectiveOp.BROADCAST:
                # Forwarded as it came; several frames are joined (a copy: encode takes tensors).
                out = (whole(calls[first.root][1].tensors[0]),)
        self.completed += 1
        for peer, call in calls:
            keep = not (first.op == CollectiveOp.BROADCAST.value and call.sender == first.root)
            # The frames reference `out` itself: ZeroMQ keeps it alive until they are sent.
            await self._answer(peer, call, Result(seq=round_.seq, tensors=out if keep else ()))

    def _expire(self, round_: _Round) -> None:
        if self._rounds.get(round_.seq) is not round_:
            return
        missing = [r for r in range(self.size) if r not in round_.calls]
        task = asyncio.create_task(self._fail(round_.seq, Outcome.TIMEOUT, ranks(missing)))
        self._expiring.add(task)
        task.add_done_callback(self._expiring.discard)

    async def _fail(self, seq: int, outcome: Outcome, detail: str,
                    also: tuple[bytes, Collective] | None = None) -> None:
        """Collective `seq` failed: tell every rank in it (and `also`), and remember."""
        log.warning("collective %d failed (%s): %s", seq, outcome.value, detail)
        self._failed[seq] = (outcome, detail)
        while len(self._failed) > KEEP_FAILED:
            del self._failed[next(iter(self._failed))]
        round_ = self._rounds.pop(seq, None)
        if round_ is not None and round_.timer is not None:
            round_.timer.cancel()
        waiting = list(round_.calls.values()) if round_ is not None else []
        for peer, call in [*waiting, *([also] if also else [])]:
            await self._answer(peer, call, Result(seq=seq, outcome=outcome.value, detail=detail))

    async def _answer(self, peer: bytes, call: Collective, result: Result) -> None:
        reply = Result(sender=COORDINATOR, request=call.request, seq=result.seq,
                       outcome=result.outcome, detail=result.detail, tensors=result.tensors)
        await self._server.send(peer, encode(reply))

    async def _refuse(self, peer: bytes, request: int, refused: _Refused) -> None:
        self.rejected[refused.code.value] += 1
        now = time.monotonic()
        if now - self._warned.get(refused.code.value, -math.inf) >= 10.0:
            self._warned[refused.code.value] = now  # at most one line a code and 10 s
            log.warning("rendezvous %s refused a message (%s): %s", self.endpoint,
                        refused.code.value, refused.detail)
        await self._server.send(peer, encode(Reject(request=request, code=refused.code.value,
                                                    detail=refused.detail)))


def _reduce(tensors: list[Received], op: ReduceOp) -> torch.Tensor:
    """Combine in rank order, in the tensors' dtype, read from their frames where they lie."""
    out = torch.empty(tensors[0].shape, dtype=tensors[0].dtype)
    flat = out.view(-1)
    copy_into(flat, tensors[0])
    for tensor in tensors[1:]:
        for offset, part in spans(tensor):
            into = flat[offset : offset + part.numel()]
            match op:
                case ReduceOp.SUM | ReduceOp.MEAN:
                    into.add_(part)
                case ReduceOp.MAX:
                    torch.maximum(into, part, out=into)
                case ReduceOp.MIN:
                    torch.minimum(into, part, out=into)
    if op is ReduceOp.MEAN:
        flat.div_(len(tensors))
    return out


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("rendezvous stopped: %r", task.exception(), exc_info=task.exception())
