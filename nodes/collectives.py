"""Collectives for custom training loops: the `dist.all_reduce` idiom over the bus.

For users who write their own loop: a `Group` of `size` ranks with `allreduce` (sum, mean,
min, max), `broadcast`, `allgather` and `barrier`, synchronous and in place like
torch.distributed, each with a deadline::

    group = Group.join("tcp://127.0.0.1:29500", rank=rank, size=size)   # rank 0 hosts
    group.broadcast(flat_weights, src=0)
    ...
    group.allreduce(flat_grads, op="mean")
    group.barrier()
    group.close()                                  # or: with Group.join(...) as group:

Topology: a star. One rendezvous (`nodes.rendezvous`) gathers every rank's tensor, reduces
in rank order and answers everyone, so all ranks get the same bytes; every byte goes through
it (2 x size x tensor bytes a collective at the rendezvous), which suits small groups and
models, not a ring of many GPUs. Rank 0 hosts it on its bus thread unless `host` says
otherwise; `GroupServer` runs one on its own, for a host that is no rank.

Every call is synchronous: the calling thread blocks while the bus (an asyncio loop on a
thread of the group's own) moves the tensors. Tensors go without copies, read where they
lie (CPU, contiguous; others pass through one staging copy), and a tensor sent is not
written again until ZeroMQ is done with it. One call at a time per group; calls from
several threads are serialised in the order they take the lock.

Failures are typed: a rank that does not call in time raises `PeerTimeoutError` on the
others, naming the rank and the call; ranks that call different things raise
`CollectiveMismatchError` on all of them, naming who called what. After a failure the
group is spent (its ranks no longer agree on where they are): close it and join anew.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import TimeoutError as FutureTimeout
from types import TracebackType
from typing import Any, Final, Self, TypeVar

import torch

from tensorbus.bus.buffers import wait_sent
from tensorbus.bus.codec import DEFAULT_MAX_MESSAGE_BYTES, decode, encode
from tensorbus.bus.deadline import at_most, within
from tensorbus.bus.errors import PeerTimeoutError, RejectedError
from tensorbus.bus.messages import Collective, CollectiveOp, Outcome, ReduceOp, Reject, Result
from tensorbus.bus.pieces import copy_into, whole
from tensorbus.bus.security import ClientKeys, ServerKeys
from tensorbus.bus.transport import (
    HANDSHAKE_MECHANISM,
    HANDSHAKE_REFUSED,
    ZmqClient,
    is_loopback,
    new_event_loop,
    split_endpoint,
)
from tensorbus.nodes.rendezvous import Rendezvous, describe, tensor_spec

log = logging.getLogger("tensorbus.collectives")

T = TypeVar("T")

DEFAULT_TIMEOUT_S: Final = 300.0  # a collective: ranks may differ by an evaluation or a checkpoint
DEFAULT_JOIN_TIMEOUT_S: Final = 300.0  # the join: ranks start at different times
# Past a call's own timeout, how long a rank waits for the rendezvous to report a missing
# rank before it blames the rendezvous itself (gone, or unreachable): a quarter of the
# timeout, between 0.5 and 5 s.
RENDEZVOUS_GRACE_S: Final = 5.0
LINGER_S: Final = 2.0  # how long a closing host gives its last answers to leave
LOCAL_S: Final = 30.0  # a bound on what needs no peer: binding, closing, the bus thread


class CollectiveMismatchError(Exception):
    """The ranks called different collectives (or shapes, dtypes, ops) at the same step."""

    def __init__(self, seq: int, detail: str) -> None:
        super().__init__(detail)
        self.seq = seq
        self.detail = detail


class GroupFailedError(Exception):
    """A collective of this group failed before; the group can no longer be used."""


class Group:
    """One rank's handle on a group; make it with `Group.join`."""

    def __init__(self, *, rank: int, size: int, endpoint: str, timeout: float,
                 max_message_bytes: int, keys: ClientKeys | None) -> None:
        self.rank = rank
        self.size = size
        self.endpoint = endpoint  # where the rendezvous is (the bound port, when hosted)
        self.timeout = timeout
        self.local_rank = 0  # rank among the group's processes on this host
        self.local_size = 1  # the group's processes on this host
        self._max_bytes = max_message_bytes
        self._keys = keys
        self._loop = _LoopThread(f"tensorbus-group-{rank}")
        self._client: ZmqClient | None = None
        self._server: Rendezvous | None = None
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._failed: str | None = None  # why, once a collective has failed
        self._closed = False

    @classmethod
    def join(
        cls,
        endpoint: str,
        *,
        rank: int,
        size: int,
        host: bool | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT_S,
        keys: ClientKeys | None = None,
        server_keys: ServerKeys | None = None,
        insecure: bool = False,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> Group:
        """Join the group at `endpoint` ('tcp://HOST:PORT') as `rank` of `size`; return once
        all `size` ranks have joined. `host` (default: rank 0) binds the rendezvous there.
        `timeout` is every later call's default. Binding a non-loopback address needs
        `server_keys` (and every rank `keys`, see bus.security) or `insecure=True`.
        `max_message_bytes` bounds what one message may carry, an allgather's result
        (size x the tensor) included."""
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        for name, value in (("timeout", timeout), ("join_timeout", join_timeout)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        split_endpoint(endpoint)
        hosting = rank == 0 if host is None else host
        if hosting:
            _check_bind(endpoint, server_keys, insecure)
        group = cls(rank=rank, size=size, endpoint=endpoint, timeout=timeout,
                    max_message_bytes=max_message_bytes, keys=keys)
        try:
            group._loop.run(group._open(hosting, server_keys), timeout=LOCAL_S)
            numbers = group._call(CollectiveOp.JOIN, None, timeout=join_timeout)
            hosts = numbers[0].tolist() if numbers else [0] * size
        except BaseException:
            group.close(wait=False)
            raise
        group.local_rank = hosts[:rank].count(hosts[rank])
        group.local_size = hosts.count(hosts[rank])
        log.info("rank %d of %d joined the group at %s", rank, size, group.endpoint)
        return group

    async def _open(self, hosting: bool, server_keys: ServerKeys | None) -> None:
        if hosting:
            self._server = Rendezvous(self.endpoint, size=self.size, keys=server_keys,
                                      max_message_bytes=self._max_bytes)
            self._server.start()
            self.endpoint = _reachable(self._server.endpoint, self.endpoint)
        self._client = ZmqClient(self.endpoint, max_message_bytes=self._max_bytes + 65536,
                                 keys=self._keys)

    # The collectives ----------------------------------------------------------------------

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *,
                  timeout: float | None = None) -> torch.Tensor:
        """Reduce `tensor` over the group, in place on every rank, and return it. `op`:
        "sum", "mean" (floating point only), "min" or "max"; combined in rank order in the
        tensor's dtype, so every rank gets the same bytes."""
        reduce = ReduceOp(op)  # ValueError naming the op if unknown
        if reduce is ReduceOp.MEAN and not tensor.is_floating_point():
            raise ValueError(f"op='mean' needs a floating-point tensor, not {tensor.dtype}")
        staged = _staged(tensor)
        (result,) = self._call(CollectiveOp.ALLREDUCE, staged, reduce=reduce.value,
                               timeout=timeout)
        return _write(tensor, staged, result)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *,
                  timeout: float | None = None) -> torch.Tensor:
        """Rank `src`'s tensor to every rank: in place on the others; returns `tensor`.
        Every rank passes a tensor of the same dtype and shape; every rank, `src`
        included, returns once all have called it."""
        if not 0 <= src < self.size:
            raise ValueError(f"src must be in [0, {self.size}), got {src}")
        if src == self.rank:
            self._call(CollectiveOp.BROADCAST, _staged(tensor), root=src, timeout=timeout)
            return tensor
        (result,) = self._call(CollectiveOp.BROADCAST, None, spec=tensor_spec(tensor),
                               root=src, timeout=timeout)
        staged = tensor if _wire_ready(tensor) else torch.empty(tensor.shape, dtype=tensor.dtype)
        return _write(tensor, staged, result)

    def allgather(self, tensor: torch.Tensor, *, timeout: float | None = None) -> list[torch.Tensor]:
        """Every rank's tensor, in rank order (new tensors on `tensor`'s device)."""
        (result,) = self._call(CollectiveOp.ALLGATHER, _staged(tensor), timeout=timeout)
        _check_result(result, tensor, self.size * tensor.numel())
        stacked = whole(result).view(self.size, *tensor.shape).to(tensor.device)
        return list(stacked.unbind(0))

    def barrier(self, *, timeout: float | None = None) -> None:
        """Return once every rank has called barrier."""
        self._call(CollectiveOp.BARRIER, None, timeout=timeout)

    # Closing -------------------------------------------------------------------------------

    def close(self, *, wait: bool = True) -> None:
        """Leave the group. With `wait` (the default) this waits, up to `timeout`, until
        every rank closes, so that the host's rendezvous outlives every rank's last call;
        it never raises for a peer (a failure is logged)."""
        if self._closed:
            return
        self._closed = True
        try:
            if wait and self._failed is None and self._client is not None:
                self._call(CollectiveOp.LEAVE, None, timeout=self.timeout, closing=True)
        except (PeerTimeoutError, RejectedError, CollectiveMismatchError, GroupFailedError) as e:
            log.warning("rank %d: closing without the others: %s", self.rank, e)
        finally:
            self._loop.run(self._shut(), timeout=LOCAL_S)
            self._loop.stop()

    async def _shut(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._server is not None:
            await self._server.close(linger_s=LINGER_S)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        # After an error the others may never reach close: do not wait for them.
        self.close(wait=kind is None)

    # One call ------------------------------------------------------------------------------

    def _call(self, op: CollectiveOp, tensor: torch.Tensor | None, *, timeout: float | None,
              spec: str = "", reduce: str = "", root: int = -1,
              closing: bool = False) -> tuple[Any, ...]:
        """Run one collective on the bus thread; the received tensors (one or none)."""
        timeout = self.timeout if timeout is None else timeout
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        with self._lock:
            if self._closed and not closing:
                raise GroupFailedError(f"rank {self.rank}: the group is closed")
            if self._failed is not None:
                raise GroupFailedError(f"rank {self.rank}: an earlier collective failed "
                                       f"({self._failed}): close the group and join anew")
            seq = next(self._seq)
            call = Collective(
                sender=self.rank, request=seq + 1, op=op.value, seq=seq, size=self.size,
                timeout_s=float(timeout), spec=tensor_spec(tensor) if tensor is not None else spec,
                reduce=reduce, root=root, tensors=(tensor,) if tensor is not None else (),
                host=socket.gethostname() if op is CollectiveOp.JOIN else "")
            try:
                # The coroutine has its own deadlines; this one only guards against a stuck loop.
                return self._loop.run(self._exchange(call), timeout=timeout + 2 * _grace(timeout) + 1)
            except BaseException as e:
                self._failed = f"collective {seq}, {describe(call)}: {type(e).__name__}: {e}"
                raise

    async def _exchange(self, call: Collective) -> tuple[Any, ...]:
        assert self._client is not None
        what = f"{describe(call)} as collective {call.seq}"
        # The send has a deadline too: a DEALER whose peer is gone may block in send.
        tracker = await within(self._client.send(encode(call)), call.timeout_s,
                               peer=f"the rendezvous at {self.endpoint}",
                               waiting_for=f"sending {what}")
        waited = call.timeout_s + _grace(call.timeout_s)
        deadline = time.monotonic() + waited
        while True:
            try:
                frames = await at_most(self._client.recv(),
                                        max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                problem = self._client.connection_problem()
                hint = (problem if problem in (HANDSHAKE_REFUSED, HANDSHAKE_MECHANISM) else
                        "is the host rank (0 unless told otherwise) running, and reachable?")
                raise PeerTimeoutError(f"the rendezvous at {self.endpoint}", what, waited,
                                       hint) from None
            reply = decode(frames, max_bytes=self._max_bytes)
            if reply.request == call.request:
                break  # anything else answers a call that had failed already
        # The tensor sent is the caller's: not to be written until ZeroMQ is done with it.
        await wait_sent(tracker, timeout=_grace(call.timeout_s), what=what)
        match reply:
            case Result(outcome=Outcome.DONE.value):
                return reply.tensors
            case Result(outcome=Outcome.TIMEOUT.value, detail=missing):
                raise PeerTimeoutError(missing, what, call.timeout_s,
                                       "it crashed, is slower than the timeout, or skipped the call")
            case Result(outcome=Outcome.MISMATCH.value, detail=detail):
                raise CollectiveMismatchError(call.seq, detail)
            case Reject(code=code, detail=detail):
                raise RejectedError(code, detail)
            case _:
                raise RejectedError("unexpected", f"the rendezvous answered {what} with {reply!r}")


class GroupServer:
    """A rendezvous on its own thread, for a host that is no rank (or a port chosen by the
    system: `endpoint` says which). The ranks join with `host=False`."""

    def __init__(self, bind: str, *, size: int, keys: ServerKeys | None = None,
                 insecure: bool = False,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        _check_bind(bind, keys, insecure)
        self._loop = _LoopThread("tensorbus-rendezvous")
        try:
            self._server = self._loop.run(_started(bind, size, keys, max_message_bytes),
                                          timeout=LOCAL_S)
        except BaseException:
            self._loop.stop()
            raise
        self.endpoint = _reachable(self._server.endpoint, bind)

    @property
    def completed(self) -> int:
        """Collectives answered so far, the join included."""
        return self._server.completed

    def close(self) -> None:
        if self._loop.running:
            self._loop.run(self._server.close(linger_s=LINGER_S), timeout=LOCAL_S)
            self._loop.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _started(bind: str, size: int, keys: ServerKeys | None, max_bytes: int) -> Rendezvous:
    server = Rendezvous(bind, size=size, keys=keys, max_message_bytes=max_bytes)
    server.start()
    return server


class _LoopThread:
    """An event loop on a daemon thread of its own, which callers hand coroutines to."""

    def __init__(self, name: str) -> None:
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def run(self, coroutine: Coroutine[Any, Any, T], *, timeout: float | None) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            raise PeerTimeoutError("the group's bus thread", "a collective", timeout or 0.0) from None
        except BaseException:
            future.cancel()  # interrupted (Ctrl-C): the bus stops waiting too
            raise

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=LOCAL_S)
        if not self._thread.is_alive():  # a loop still running cannot be closed
            self._loop.close()


def _grace(timeout: float) -> float:
    return min(max(timeout / 4, 0.5), RENDEZVOUS_GRACE_S)


def _wire_ready(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.is_contiguous()


def _staged(tensor: torch.Tensor) -> torch.Tensor:
    """What goes on the wire: the tensor itself, or (GPU, strided) a contiguous CPU copy."""
    if _wire_ready(tensor):
        return tensor.detach()
    return tensor.detach().to("cpu").contiguous()


def _write(tensor: torch.Tensor, staged: torch.Tensor, result: Any) -> torch.Tensor:
    """tensor[:] = result, through `staged` (the tensor itself, or its CPU stand-in)."""
    _check_result(result, tensor, tensor.numel())
    with torch.no_grad():
        copy_into(staged.view(-1), result)
        if staged is not tensor and staged.data_ptr() != tensor.data_ptr():
            tensor.copy_(staged)
    return tensor


def _check_result(result: Any, tensor: torch.Tensor, numel: int) -> None:
    """The rendezvous checked that every rank called alike; this checks what it answered."""
    if result.dtype != tensor.dtype or result.numel() != numel:
        raise RejectedError("unexpected", f"the rendezvous answered with {tensor_spec(result)} "
                                          f"for a {tensor_spec(tensor)}")


def _check_bind(endpoint: str, keys: ServerKeys | None, insecure: bool) -> None:
    host, _ = split_endpoint(endpoint)
    if keys is None and not insecure and not is_loopback(host):
        raise ValueError(
            f"binding {endpoint} without keys would let anyone who can reach it read and "
            "change the tensors: pass server_keys (see `tensorbus keys`), or insecure=True "
            "to accept that")


def _reachable(bound: str, asked: str) -> str:
    """The address the host's own client dials: the one asked for, with the bound port
    (a wildcard such as 0.0.0.0 or * is dialled on loopback)."""
    host, _ = split_endpoint(asked.replace("*", "0.0.0.0"))
    _, port = split_endpoint(bound)
    if host in ("0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    return f"tcp://{host}:{port}"
