"""Who is training: ranks, the connection each came from, and what each was last seen doing.

Liveness is decided here from times the caller passes in (no clock of its own): a member
silent for longer than the timeout is named by `silent`, with what it was doing, so that
the coordinator can log it and remove it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorbus.bus.messages import Phase, RejectCode


@dataclass
class Member:
    rank: int
    identity: bytes  # the ROUTER identity of its connection
    last_seen: float
    phase: str = Phase.JOINING.value
    version: int = 0  # the version it last reported working on
    clock: int = 0  # updates it has pushed
    ready: bool = False  # has loaded its data and counts for the strategy
    batches: int = -1  # batches per epoch of its shard; -1 unknown
    inbox: str = ""  # a pipeline stage's worker: where the stages beside it send to

    def describe(self) -> str:
        return f"worker {self.rank} (phase {self.phase}, version {self.version}, clock {self.clock})"


class Membership:
    def __init__(self, size: int, *, first_rank: int = 0, world_size: int | None = None) -> None:
        """Ranks first_rank..first_rank+size-1 exist here; `world_size` (default: size) is
        the number of data shards that workers are told there are: more than `size` under
        a relay, whose workers are a slice of the whole tree's ranks."""
        self._ranks = range(first_rank, first_rank + size)
        self.world_size = world_size if world_size is not None else size
        self._by_rank: dict[int, Member] = {}
        self._by_identity: dict[bytes, Member] = {}

    def __len__(self) -> int:
        return len(self._by_rank)

    @property
    def size(self) -> int:
        """How many ranks exist here (members or not)."""
        return len(self._ranks)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._by_rank.values()))

    def get(self, identity: bytes) -> Member | None:
        return self._by_identity.get(identity)

    def name(self, identity: bytes) -> str:
        """How logs name the peer of connection `identity`: by rank, if a member."""
        member = self._by_identity.get(identity)
        return f"worker {member.rank}" if member else f"peer {identity.hex()}"

    def join(self, identity: bytes, rank: int, now: float) -> Member | RejectCode:
        """Admit a worker, or say why not. Joining again from the same connection is a no-op."""
        known = self._by_identity.get(identity)
        if known is not None and rank in (-1, known.rank):
            known.last_seen = now
            return known
        if rank < -1:
            return RejectCode.MALFORMED
        if rank == -1:
            free = [r for r in self._ranks if r not in self._by_rank]
            if not free:
                return RejectCode.FULL
            rank = free[0]
        elif rank not in self._ranks:
            return RejectCode.FULL
        elif rank in self._by_rank:
            return RejectCode.RANK_TAKEN
        member = Member(rank=rank, identity=identity, last_seen=now)
        self._by_rank[rank] = member
        self._by_identity[identity] = member
        return member

    def refusal(self, code: RejectCode, rank: int) -> str:
        """Why `join` refused `rank` with `code`, and what to do, in words."""
        ranks = f"{self._ranks.start}..{self._ranks.stop - 1}"
        if code is RejectCode.RANK_TAKEN:
            return (f"rank {rank} is another worker's: give each worker its own --rank, or "
                    "none (it then takes the lowest free one)")
        if code is RejectCode.FULL and rank == -1:
            return (f"every rank ({ranks}) is taken: start the coordinator with more --workers, "
                    "or with --max-workers to let more join")
        if code is RejectCode.FULL:
            return (f"rank {rank} is not one of this run's ({ranks}): give a --rank in that "
                    "range, or none, or start the coordinator with more --workers or --max-workers")
        return f"rank {rank} is not a rank"

    def remove(self, member: Member) -> None:
        self._by_rank.pop(member.rank, None)
        self._by_identity.pop(member.identity, None)

    def silent(self, now: float, timeout_s: float) -> list[Member]:
        return [m for m in self._by_rank.values() if now - m.last_seen > timeout_s]

    def not_listening(self, seconds: float) -> None:
        """The coordinator read nothing for `seconds` (a request it was busy with): that
        time is not its workers' silence."""
        for member in self._by_rank.values():
            member.last_seen += seconds
