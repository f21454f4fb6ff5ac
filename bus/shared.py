"""Tensors in shared memory, sent to a process on the same host by reference, not by bytes.

Over tcp:// between two processes of one host, every byte of a push is copied twice by the
kernel (into the socket and out of it), on the cores that training needs too: with 2
colocated workers and the 10M-parameter MLP, 20 MB each way a version. A worker whose
coordinator sees the same /dev/shm keeps its gradient buffers in shared memory instead
(`SharedAllocator`), and a push names where each tensor lies, [segment, offset], in place of its
bytes (`bus.codec`); the coordinator maps the segment once (`SegmentCache`) and reads the gradient
where backward wrote it.

Same host, proven both ways: a worker names a small segment of its own and the random
token in it in its Join (`HostToken`); a coordinator that reads that token there, and takes
tensors by reference, answers with its own host token in its Welcome; a worker sends by
reference only to a coordinator whose token it reads in turn. Each side has then opened a
file of the other's, as segments will be opened.

Ownership: a coordinator reads a push's tensors until it has answered the push (the
finiteness check, the fold) and, for a push it keeps, until the step that uses it, which
comes before the version that step makes is published. So a worker writes buffers it
pushed by reference again only once every coordinator it pushed them to is done with them
(see `nodes.training`):
- sync, with or without backups (`strategies.base.Wait.NEWER`, gradients pushed): once
  each has answered and published a newer version, which it waits for anyway;
- async (`Wait.NOTHING`; pipelined: the next gradient goes into the other set while this
  one is out) and ssp (`Wait.ANSWERED`): once each has answered. A coordinator answers a
  push by reference of a rhythm that does not wait for a newer version only after the
  step that takes it, or, kept for a later step, once it has copied it out of the segment
  (`Coordinator._push`); ssp's answer to a worker past the bound then waits on, as with
  bytes, until the slowest catches up. One case breaks
the rule, and the coordinator mends it: a worker that joins again while the coordinator
still holds its last push (kept for a step that waits for a straggler) computes again at
once; so a coordinator copies a joining worker's held push out of its segment before it
welcomes it (`Coordinator._join`).

Weights go the other way by reference too: a coordinator makes its versions in sets of a
`SharedWeightPool` (shared memory) and broadcasts to the workers of its host where the new version
lies, under a topic of its own (`bus.transport`), not its bytes. A version's readers are
not counted: the pool writes a set again only some versions after it was published
(`bus.buffers.SendBuffers` with `reused`), bumping its generation counter first, and a
worker checks the counter after its copy and pulls the version's bytes if it moved
(`nodes.version_chain.VersionChain.load_shared`): a torn copy is never computed on. A worker whose only
coordinator is on its host computes on the set itself, where it lies, and checks the
counter once its gradient is made, before it pushes it: moved, and it computes again on
a copy (`nodes.in_place.InPlace.follow_set`).

Trust: a coordinator takes references only from members, only in a Push, and a worker
only from its coordinator, only in Weights; only for float tensors, only from regular files
of its own user named as here, and only for bytes inside them. A sender may still change
its bytes after they were checked: on one host as one user, it could as well write the coordinator's memory.

Lifetime: the creator of a segment unlinks its file when it closes its allocator, or at exit.
A creator killed (SIGKILL, a crash, a whole cluster at once) cannot: its files are found
and unlinked by the next tensorbus process of this user that `sweep`s, as every node does
when it starts, a coordinator when a worker is lost, a worker when it ends and a launcher
when a child fails. A
segment's name holds its creator's pid and start time, so that a creator that is gone is
told from a process that took its pid since. A mapping stays valid after the unlink for as
long as tensors over it live. A receiver keeps the segments it used last mapped, a few per
worker (`SegmentCache(kept)`), so that those of workers gone are let go of.

Where /dev/shm is missing, full or too small, `SharedAllocator.allocate` raises OSError (the space is
reserved with posix_fallocate, so that a full /dev/shm fails there, not with a SIGBUS on a
later write) and the worker sends the bytes, as over any other link.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import platform
import re
import secrets
import stat
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tensorbus.bus.errors import WireError

log = logging.getLogger("tensorbus.shared")
ROOT = Path("/dev/shm")
# tensorbus-PID-START-RANDOM: its creator's pid and start time (clock ticks since boot)
_NAME = re.compile(r"tensorbus-([0-9]{1,10})-([0-9]{1,20})-[0-9a-f]{16}")
_ALIGN = 4096  # each buffer of a set starts on a page
_TOKEN_BYTES = 16

Ref = list[str | int]  # [segment name, byte offset]: where a tensor lies, on the wire


class SharedTensorError(WireError):
    """A tensor sent by reference that this process cannot or may not read."""


def _new_name() -> str:
    return f"tensorbus-{os.getpid()}-{_started(os.getpid()) or 0}-{secrets.token_hex(8)}"


def _started(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot; None if there is none, or
    if it has ended and waits to be reaped (a zombie: it can unlink nothing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count after it. A killed
    # worker whose launcher died too is reparented to PID 1, which in a container may
    # never reap it: its /proc entry stays, state Z, with its start time.
    fields = stat_line[stat_line.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])  # field 22


def creator_alive(name: str) -> bool:
    """Whether the process that created segment `name` still runs (True for a name that
    is not a segment's: nothing is known of it)."""
    found = _NAME.fullmatch(name)
    if found is None:
        return True
    pid, start = int(found[1]), int(found[2])
    if not Path("/proc/self/stat").exists():  # no start times here: the pid alone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return _started(pid) == start  # (another start: a process that took the pid since)


def sweep() -> list[str]:
    """Unlink the segments of this user's whose creators are gone (killed before they
    could unlink them); their names."""
    try:
        entries = list(os.scandir(ROOT))
    except OSError:
        return []
    gone = []
    for entry in entries:
        if not _NAME.fullmatch(entry.name) or creator_alive(entry.name):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            os.unlink(entry.path)
        except OSError:  # (unlinked meanwhile, by another sweep or its owner)
            continue
        gone.append(entry.name)
    if gone:
        log.info("unlinked %d shared-memory segment(s) of processes that were killed: %s",
                 len(gone), ", ".join(gone))
    return gone


class _Segment:
    """A file in /dev/shm of `nbytes`, created here and mapped read-write."""

    def __init__(self, nbytes: int) -> None:
        self.name = _new_name()
        path = ROOT / self.name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        self._unlink = weakref.finalize(self, _unlink, self.name, os.getpid())  # runs once
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))  # ENOSPC now, not SIGBUS later
            self.map = mmap.mmap(fd, max(nbytes, 1))
        except BaseException:
            self._unlink()
            raise
        finally:
            os.close(fd)

    def unlink(self) -> None:
        self._unlink()


def _unlink(name: str, creator: int) -> None:
    if os.getpid() != creator:
        # A process forked from the creator (a DataLoader's worker, say) holds a copy of
        # the segment's object: when that copy goes, the creator's file stays.
        return
    try:
        os.unlink(ROOT / name)
    except FileNotFoundError:
        pass


class SharedAllocator:
    """Buffer sets in shared memory, one segment a set, and where a tensor lies in them."""

    def __init__(self) -> None:
        self._spans: list[tuple[int, int, str]] = []  # (first byte, end, segment name)
        self._segments: list[_Segment] = []

    def allocate(self, buckets: Sequence[tuple[int, torch.dtype]]) -> tuple[torch.Tensor, ...]:
        """Zeroed 1-D tensors of (numel, dtype), in one new segment; OSError if /dev/shm
        cannot hold it."""
        offsets, size = [], 0
        for numel, dtype in buckets:
            offsets.append(size)
            size += -(-numel * dtype.itemsize // _ALIGN) * _ALIGN
        segment = _Segment(size)
        self._segments.append(segment)
        whole = torch.frombuffer(segment.map, dtype=torch.uint8, count=max(size, 1))
        base = whole.data_ptr()
        self._spans.append((base, base + size, segment.name))
        # Fresh tmpfs pages read as zeros; touching them now spares the first backward.
        whole.zero_()
        return tuple(whole[at : at + numel * dtype.itemsize].view(dtype)
                     for at, (numel, dtype) in zip(offsets, buckets, strict=True))

    def locate(self, tensor: torch.Tensor) -> Ref | None:
        """[segment, offset] of a contiguous tensor that lies in this allocator's segments, else None."""
        first = tensor.data_ptr()
        end = first + tensor.numel() * tensor.element_size()
        for start, stop, name in self._spans:
            if start <= first and end <= stop:
                return [name, first - start]
        return None

    def unlink(self, name: str) -> None:
        """Unlink segment `name` and forget where it lies (tensors over it stay valid)."""
        for segment in [s for s in self._segments if s.name == name]:
            segment.unlink()
            self._segments.remove(segment)
        self._spans = [span for span in self._spans if span[2] != name]

    def close(self) -> None:
        """Unlink the segments (tensors over them stay valid while they live)."""
        for segment in self._segments:
            segment.unlink()
        self._segments, self._spans = [], []


class SharedWeightPool:
    """Weight sets in shared memory that a coordinator publishes by reference to the
    workers of its host, each with a generation number in its segment's first page.

    The coordinator writes a published set again only after taking it back from its pool
    (`bus.buffers.SendBuffers`), which `bump`s its generation first; a broadcast names the
    generation the set had when it went out. A reader copies the weights, then reads the
    generation (`SegmentCache.generation`): the same, and no write of the set had begun before its
    last read, so the copy is whole; another, and it is thrown away (`nodes.version_chain`). That
    inference needs stores seen in the order they were made, and loads made in order, as
    x86-64 guarantees (TSO); elsewhere `SharedWeightPool.usable()` is False and weights go as bytes.
    """

    def __init__(self) -> None:
        self._shm = SharedAllocator()
        self._counters: dict[str, torch.Tensor] = {}  # segment name -> its set's counter
        self._full = False  # /dev/shm could not hold a set (said once)
        self._open = False  # (see open)

    @staticmethod
    def usable() -> bool:
        return platform.machine().lower() in ("x86_64", "amd64")

    def allocate(self, buckets: Sequence[tuple[int, torch.dtype]]) -> tuple[torch.Tensor, ...]:
        """Zeroed 1-D tensors of (numel, dtype) in one new segment, after its counter;
        OSError if /dev/shm cannot hold them."""
        counter, *tensors = self._shm.allocate([(1, torch.int64), *buckets])
        ref = self._shm.locate(counter)
        assert ref is not None
        self._counters[str(ref[0])] = counter
        return tuple(tensors)

    def allocator(
        self, buckets: Sequence[tuple[int, torch.dtype]],
        otherwise: Callable[[], tuple[torch.Tensor, ...]],
    ) -> Callable[[], tuple[torch.Tensor, ...]]:
        """A function that allocates a set of `buckets` here, or, where /dev/shm cannot hold
        it, calls `otherwise` (the weights of that set then go as bytes)."""
        def allocate() -> tuple[torch.Tensor, ...]:
            if not self._open:  # (a set made before or after a run: read by nobody)
                return otherwise()
            try:
                return self.allocate(buckets)
            except OSError as e:
                if not self._full:
                    self._full = True
                    log.info("versions go to workers on this host as bytes: no room for "
                             "them in shared memory (%s)", e)
                return otherwise()
        return allocate

    def locate(self, tensor: torch.Tensor) -> Ref | None:
        return self._shm.locate(tensor)

    def generation(self, tensors: Sequence[torch.Tensor]) -> int | None:
        """The generation of the set that `tensors` (the set, or a range of it) lie in;
        None if it is not one of ours."""
        counter = self._counter(tensors)
        return int(counter[0]) if counter is not None else None

    def bump(self, tensors: Sequence[torch.Tensor]) -> None:
        """Called before the set that `tensors` lie in is written again (nothing if it is
        not one of ours)."""
        counter = self._counter(tensors)
        if counter is not None:
            counter += 1

    def release(self, tensors: Sequence[torch.Tensor]) -> None:
        """The set that `tensors` lie in is no longer used here: unlink its segment (a
        reader that mapped it keeps it, and no broadcast names it again)."""
        name = self._segment(tensors)
        if name is not None:
            self._shm.unlink(name)
            self._counters.pop(name, None)

    def _counter(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
        name = self._segment(tensors)
        return self._counters.get(name) if name is not None else None

    def _segment(self, tensors: Sequence[torch.Tensor]) -> str | None:
        """The name of the segment the set that `tensors` begin lies in, if one of ours."""
        ref = self._shm.locate(tensors[0]) if tensors else None
        return str(ref[0]) if ref is not None else None

    def open(self) -> None:
        """From now on `allocator`'s sets lie here: a coordinator opens its pool when it
        runs, so that one made and never run holds no segment."""
        self._open = True

    def close(self) -> None:
        """Unlink every segment (sets over them stay valid while they are used); sets
        allocated after this are private memory."""
        self._open = False
        self._shm.close()
        self._counters.clear()


class SegmentCache:
    """The segments a receiver reads tensors from: mapped read-only on first use, the
    `kept` used last kept mapped."""

    def __init__(self, kept: int = 8) -> None:
        self.kept = kept
        self._maps: OrderedDict[str, torch.Tensor] = OrderedDict()

    def holds(self, tensor: object) -> bool:
        """Whether `tensor` was read through this cache (lies in a segment it mapped)."""
        if not isinstance(tensor, torch.Tensor):
            return False
        base = tensor.untyped_storage().data_ptr()
        return any(whole.data_ptr() == base for whole in self._maps.values())

    @staticmethod
    def generation(tensor: torch.Tensor) -> int | None:
        """The generation counter of the `SharedWeightPool` segment that `tensor`, read through a
        segment cache, lies in (its first eight bytes: a view's storage is the whole mapping),
        read now; None if that storage is too small to hold one."""
        storage = tensor.untyped_storage()
        if storage.nbytes() < 8:
            return None
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        return int(whole[:8].view(torch.int64)[0])

    def view(self, ref: object, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """The 1-D tensor of `nbytes` at `ref`; SharedTensorError if it is not one of ours
        to read: a malformed reference, a segment that is gone, or bytes past its end."""
        if not (isinstance(ref, list) and len(ref) == 2 and type(ref[0]) is str
                and type(ref[1]) is int):
            raise SharedTensorError(f"a tensor by reference needs [segment, offset], got {ref!r:.80}")
        name, offset = ref
        if not _NAME.fullmatch(name):
            raise SharedTensorError(f"{name!r:.80} is not a tensorbus segment name")
        whole = self._maps.get(name)
        if whole is None:
            whole = self._map(name)
        else:
            self._maps.move_to_end(name)
        if offset < 0 or offset % dtype.itemsize or offset + nbytes > whole.numel():
            raise SharedTensorError(f"{nbytes} bytes at offset {offset} of segment {name}, "
                                    f"of {whole.numel()} bytes")
        return whole[offset : offset + nbytes].view(dtype)

    def _map(self, name: str) -> torch.Tensor:
        try:
            fd, size = _open(name)
            try:
                memory = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        except OSError as e:
            raise SharedTensorError(f"segment {name} cannot be mapped here ({e.strerror}): "
                                    "is its sender on another host?") from None
        with warnings.catch_warnings():
            # Read-only memory: nothing on the receiving side writes what it received.
            warnings.simplefilter("ignore", UserWarning)
            whole = torch.frombuffer(memory, dtype=torch.uint8)
        self._maps[name] = whole
        if len(self._maps) > self.kept:
            self._maps.popitem(last=False)
        return whole


def _open(name: str) -> tuple[int, int]:
    """A read-only descriptor of segment `name` and its size; OSError unless it is a
    non-empty regular file of this user's. Non-blocking: a FIFO by that name must not
    hang the caller."""
    fd = os.open(ROOT / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or not info.st_size:
            raise OSError(errno.EPERM, "not a regular file of this user's")
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


class HostToken:
    """A proof of which /dev/shm a node sees: a small segment with a random token. Its
    `offer` goes in a Join or a Welcome; `seen(offer)`, at the other end, says whether
    that node sees the same."""

    def __init__(self) -> None:
        self._segment = _Segment(_TOKEN_BYTES)
        token = secrets.token_bytes(_TOKEN_BYTES)
        self._segment.map[:_TOKEN_BYTES] = token
        self.offer = f"{self._segment.name} {token.hex()}"

    def close(self) -> None:
        self._segment.unlink()

    @staticmethod
    def seen(offer: str) -> bool:
        """Whether this process reads the token of `offer` in its segment."""
        name, _, token = offer.partition(" ")
        if not _NAME.fullmatch(name) or len(token) != 2 * _TOKEN_BYTES:
            return False
        try:
            fd, _ = _open(name)
            try:
                return os.read(fd, _TOKEN_BYTES).hex() == token
            finally:
                os.close(fd)
        except OSError:
            return False
