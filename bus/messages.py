"""The closed set of messages tensorbus nodes exchange, as frozen records.

Every message shares an envelope (sender, request id, model version, term, tensors) and adds a few
scalar fields of its own. Only `int`, `float`, `str` and `bool` fields exist, so that the
codec can check every header field's type before anything is built from it. Tensors are flat
buffers, one per dtype bucket of the model (see `bus.layout`), cut into frames on the wire;
only the collectives of custom loops (Collective, Result) carry tensors of any shape.
"""

from __future__ import annotations

import enum
import typing
from dataclasses import dataclass, field, fields
from typing import ClassVar, Final

from tensorbus.bus.pieces import Received
from tensorbus.bus.protocol import BUILD, PROTOCOL_VERSION  # noqa: F401 (theirs)

COORDINATOR: Final = -1  # the sender id of the coordinator; workers are 0..N-1


class Kind(enum.IntEnum):
    """Every message kind on the wire. The set is closed: anything else is rejected."""

    JOIN = 1  # worker -> coordinator: let me in (request, answered by WELCOME or REJECT)
    WELCOME = 2  # coordinator -> worker: your rank, the rhythm to follow, current weights
    READY = 3  # worker -> coordinator: data loaded, count me in (answered by ACK)
    PUSH = 4  # worker -> coordinator: an update computed on `version` (answered by ACK)
    ACK = 5  # coordinator -> worker: request taken (or dropped, with the reason)
    PULL = 6  # worker -> coordinator: send me the current weights (answered by WEIGHTS)
    WEIGHTS = 7  # coordinator -> worker(s): the weights of `version` (reply or broadcast)
    HEARTBEAT = 8  # either way: I am alive, at this version and phase
    LEAVE = 9  # worker -> coordinator: I am going, and why
    STOP = 10  # coordinator -> worker(s): training is over, leave
    REJECT = 11  # coordinator -> worker: your message was refused; `code` says why
    COLLECTIVE = 12  # rank -> rendezvous: my part of collective `seq` (answered by RESULT)
    RESULT = 13  # rendezvous -> rank: how collective `seq` ended, with its tensor if any
    CHANGES = 14  # coordinator -> workers: the elements that changed since version `base`
    DESCRIBE = 15  # worker -> coordinator: the model and optimizer it trains (answered by ACK)
    FOLLOW = 16  # standby -> coordinator: I follow you (answered by ACK); from a newer term: step down
    REPLICA = 17  # coordinator -> standby: the run's state at `version`, before it is published
    PEERS = 18  # stage worker <-> coordinator: where the stages beside it in its pipeline listen
    ACTIVATIONS = 19  # stage worker -> the next stage's: a micro-batch's outputs (and targets)
    ACTIVATION_GRADS = 20  # stage worker -> the previous stage's: the gradients of those outputs
    FRAGMENT = 21  # coordinator -> workers: one fragment of `version`, the rest as version - 1


class RejectCode(str, enum.Enum):
    """Why a message was refused; the peer gets the code, never a traceback."""

    MALFORMED = "malformed"  # header or frames are not a valid message
    PROTOCOL = "protocol"  # the peer speaks another protocol version
    UNKNOWN_KIND = "unknown_kind"  # the kind is not in `Kind`
    DTYPE = "dtype"  # a tensor's dtype is not on the allow-list
    LAYOUT = "layout"  # tensors do not match the model's registered layout
    TOO_LARGE = "too_large"  # the message exceeds the configured size limit
    UNKNOWN_WORKER = "unknown_worker"  # the sender has not joined (or was removed)
    RANK_TAKEN = "rank_taken"  # the requested rank belongs to a live worker
    FULL = "full"  # no rank is free
    UNEXPECTED = "unexpected"  # a valid message that this node does not take now
    NOT_FINITE = "not_finite"  # the update holds NaN or infinity
    BUILD = "build"  # the worker runs another tensorbus release than the coordinator
    NOT_YET = "not_yet"  # a standby coordinator, not serving yet: ask again (it may take over)


class CollectiveOp(str, enum.Enum):
    """What a rank asks of its group's rendezvous (see nodes.collectives)."""

    JOIN = "join"  # count me in: answered once every rank has joined
    ALLREDUCE = "allreduce"  # reduce my tensor with everyone's, give everyone the result
    BROADCAST = "broadcast"  # the source rank's tensor, to everyone
    ALLGATHER = "allgather"  # everyone's tensors, stacked in rank order, to everyone
    BARRIER = "barrier"  # answered once every rank has called it
    LEAVE = "leave"  # I am closing: answered once every rank is, so the host closes last


class ReduceOp(str, enum.Enum):
    """How an allreduce combines the ranks' tensors, in rank order, in their own dtype."""

    SUM = "sum"
    MEAN = "mean"  # the sum divided by the group size; floating-point dtypes only
    MIN = "min"
    MAX = "max"


class Outcome(str, enum.Enum):
    """How a collective ended, as the rendezvous tells every rank that took part."""

    DONE = "done"  # everyone called it alike; the result (if any) is attached
    TIMEOUT = "timeout"  # the ranks named in `detail` did not call it in time
    MISMATCH = "mismatch"  # the ranks did not call the same thing; `detail` says who called what


class Phase(str, enum.Enum):
    """What a worker is doing, as reported in its heartbeats (for logs and status)."""

    JOINING = "joining"
    LOADING = "loading"
    COMPUTING = "computing"
    PUSHING = "pushing"
    WAITING = "waiting"
    LEAVING = "leaving"


@dataclass(frozen=True, kw_only=True)
class Message:
    """The envelope every message carries."""

    KIND: ClassVar[Kind]
    CARRIES_TENSORS: ClassVar[bool] = False
    TENSORS_OPTIONAL: ClassVar[bool] = False  # may come with none at all (see Weights)
    SPARSE: ClassVar[bool] = False  # index and value tensors per bucket (see Changes)
    # Its tensors are the model's layout, checked against it by the codec (a Describe's are
    # the sender's own model: its digest is compared instead, in words).
    OF_THE_LAYOUT: ClassVar[bool] = True
    # May carry the model's buffers (BatchNorm's running statistics): a worker's with its
    # push, the coordinator's combination of them with its weights (nodes.flat, `state`).
    CARRIES_STATE: ClassVar[bool] = False
    MAX_TENSORS: ClassVar[int] = 64  # tensors a message of this kind may carry

    sender: int = COORDINATOR
    request: int = 0  # non-zero where a reply is expected; the reply echoes it
    version: int = 0  # the model version the payload or the statement refers to
    # The coordinator's term: takeovers by a standby before it (nodes.replication). Its own
    # messages carry it; a worker's carry the newest it heard. A coordinator that hears a
    # newer one was taken over (cut off) and steps down; a worker drops what an older says.
    term: int = 0
    # Sent: tensors. Received: tensors, or Pieces for those that came in several frames.
    tensors: tuple[Received, ...] = field(default=(), compare=False, repr=False)
    # The model's buffers, one flat tensor per dtype of their layout (empty: none sent).
    state: tuple[Received, ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True, kw_only=True)
class Join(Message):
    KIND = Kind.JOIN
    rank: int = -1  # the rank asked for; -1: any free one
    layout: str = ""  # digest of the worker's model layout; must equal the coordinator's
    build: str = ""  # the tensorbus release of the worker
    shared: str = ""  # its bus.shared.HostToken's offer: it would push by reference ("": not)
    # A pipeline stage's worker (nodes.stage_worker): its stage of `stages`, and where the
    # stages beside it reach it (its inbox); a worker of the whole model: stage 0 of 1, "".
    stage: int = 0
    stages: int = 1
    inbox: str = ""
    # The run it was last welcomed into (a Welcome's `run`; "": none): with a newer term than
    # the coordinator's, it makes that coordinator step down (nodes.replication).
    run: str = ""


@dataclass(frozen=True, kw_only=True)
class Describe(Message):
    """A script's model and optimizer, for a coordinator started without a SPEC
    (nodes.description): JSON, with the initial weights as tensors and the carried
    buffers as state. Sent before the Join; the first one sets the run's model."""

    KIND = Kind.DESCRIBE
    CARRIES_TENSORS = True
    CARRIES_STATE = True
    OF_THE_LAYOUT = False
    layout: str  # digest of the model's layout, as in a Join
    model: str  # nodes.description.describe's JSON
    build: str = ""  # the tensorbus release of the worker


@dataclass(frozen=True, kw_only=True)
class Welcome(Message):
    KIND = Kind.WELCOME
    CARRIES_TENSORS = True
    CARRIES_STATE = True
    rank: int
    world_size: int
    strategy: str
    push: str  # "gradient" or "weights": what the worker pushes
    local_steps: int  # steps between pushes
    wait: str  # after a push: "newer", "answered" or "nothing" (see strategies.base.Wait)
    batch_size: int  # per worker, the same for all so that shards line up
    pub_port: int  # where the coordinator publishes versions, on the same host
    heartbeat_s: float
    timeout_s: float
    lr: float  # for a worker that owns its optimizer and the SPEC gives none
    position: int = 0  # batches of its shard this rank had used (after a restart), to skip
    compress: str = ""  # how to push gradients: bus.layout.Compression ("": as they are)
    # It takes tensors by reference and saw the Join's host token: its own HostToken's offer ("": not).
    shared: str = ""
    seed: int = 0  # the run's --seed: a worker seeds its random generators from it and its rank
    # A worker that steps its own weights (average) clips its gradient to this norm first
    # (0: no clipping); where gradients are pushed, the coordinator clips their average.
    clip_grad_norm: float = 0.0
    precision: str = ""  # the forward's autocast: "", "bf16-mixed" or "fp16-mixed"
    # Where a standby coordinator serves, for the worker to move to if this one is lost ("": none).
    standby: str = ""
    run: str = ""  # the run's id, the same from term to term (a Replica's): named in joins
    # A pipeline stage's worker: the micro-batches a batch is cut into, and the order its
    # stage runs them in (nodes.pipeline_order.Schedule: "1f1b" or "gpipe").
    micro_batches: int = 1
    schedule: str = ""
    # Streaming averaging: the model cut into this many fragments (bus.layout.Layout.fragments),
    # one pushed every local_steps, and the share of its own weights a worker keeps when a
    # fragment's average comes back; 0 fragments: whole pushes, each waited for.
    fragments: int = 0
    mix: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Ready(Message):
    KIND = Kind.READY
    # Batches per epoch of this worker's shard; -1: not known yet (its pushes say it once its
    # first pass has ended); -2: never (a relay: its workers' data is theirs).
    batches: int
    # Samples of the data set each epoch leaves out, where the shard says (run.shards.Shards:
    # its last partial global batch); 0: none, or not known.
    unused: int = 0


@dataclass(frozen=True, kw_only=True)
class Push(Message):
    KIND = Kind.PUSH
    CARRIES_TENSORS = True
    CARRIES_STATE = True
    clock: int  # updates this worker has pushed before this one
    loss: float  # mean training loss of the batches behind this update
    samples: int  # samples behind this update
    # Telemetry, for status, straggler detection and traces (seconds, the worker's clocks):
    began: float = 0.0  # wall-clock time (time.time()) the compute behind this update began
    compute_s: float = 0.0  # time computing this update (data, forward, backward, steps)
    comm_s: float = 0.0  # since the previous compute ended: sending, receiving, loading weights
    wait_s: float = 0.0  # since the previous compute ended: held back, waiting for a version
    batches: int = -1  # batches per epoch of its shard, once known (see Ready)
    overflows: int = 0  # fp16 steps skipped so far for an overflow (nodes.precision)
    # A script's own loop (nodes.own_loop): its optimizer's learning rates, one a parameter
    # group, as JSON, which the coordinator's copy of it steps with ("": not a script).
    lrs: str = ""
    peak_bytes: int = 0  # the worker process's peak resident memory so far (its high-water mark)
    # A pipeline stage's worker: seconds in its forward and backward passes alone, the
    # seconds from its first one's start to its last one's end, and the most micro-batches
    # whose activations it held at once (nodes.stage_steps).
    busy_s: float = 0.0
    span_s: float = 0.0
    held: int = 0
    # Streaming averaging: the fragment of the model its tensors are (that fragment's layout,
    # checked by the codec); -1: the whole model (or the whole shard).
    fragment: int = -1
    steps: int = 0  # local steps behind it (0: as many as the Welcome said)


@dataclass(frozen=True, kw_only=True)
class Ack(Message):
    KIND = Kind.ACK
    dropped: str = ""  # empty: taken; otherwise why the update was dropped
    held_s: float = 0.0  # how long the strategy held this answer back (ssp's bound, the gate)
    # The local steps to take before the next push, where they are the worker's own
    # (async-average's dynamic local steps); 0: as many as the Welcome said.
    local_steps: int = 0


@dataclass(frozen=True, kw_only=True)
class Pull(Message):
    KIND = Kind.PULL


@dataclass(frozen=True, kw_only=True)
class Weights(Message):
    KIND = Kind.WEIGHTS
    CARRIES_TENSORS = True
    CARRIES_STATE = True
    TENSORS_OPTIONAL = True  # none: "you have the newest", the answer to a Pull of it
    # Broadcast by reference to a worker of the coordinator's host: the generation of the
    # shared set the tensors lie in, as published (bus.shared.SharedWeightPool); otherwise 0.
    generation: int = 0


@dataclass(frozen=True, kw_only=True)
class Changes(Message):
    """The weights of `version` as what changed since version `base`: per bucket of the
    layout, an int64 tensor of element indices and a tensor of their new values (a
    broadcast, where few elements change a version: top-k updates). Exact: applied to
    the weights of `base`, they give those of `version`, bit for bit."""

    KIND = Kind.CHANGES
    CARRIES_TENSORS = True
    CARRIES_STATE = True
    SPARSE = True
    base: int


@dataclass(frozen=True, kw_only=True)
class Fragment(Message):
    """The weights of `version` as one fragment of them (bus.layout.Layout.fragments): the
    version streaming averaging made by averaging that fragment alone, whose other
    fragments are those of version - 1 (a broadcast). Exact, as Changes are: written over
    the weights of version - 1, they give those of `version`, bit for bit."""

    KIND = Kind.FRAGMENT
    CARRIES_TENSORS = True
    CARRIES_STATE = True
    fragment: int  # which one; its tensors are that fragment's layout

    @property
    def base(self) -> int:
        """The version whose weights this one is written over."""
        return self.version - 1


@dataclass(frozen=True, kw_only=True)
class Heartbeat(Message):
    KIND = Kind.HEARTBEAT
    phase: str = ""
    clock: int = 0
    standby: str = ""  # a coordinator's: where its standby serves ("": none), as in a Welcome


@dataclass(frozen=True, kw_only=True)
class Leave(Message):
    KIND = Kind.LEAVE
    reason: str  # "done", "error", "interrupted", "stopped"
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class Stop(Message):
    KIND = Kind.STOP
    reason: str = "done"  # or "error": the run failed; or "moved": it goes on at `detail`
    detail: str = ""  # why it failed; where it moved (a standby that took over)


@dataclass(frozen=True, kw_only=True)
class Follow(Message):
    """A standby coordinator's, every heartbeat: it follows this coordinator, and takes
    its replicas at `endpoint` (where workers move to if this one is lost); the answer
    proves this coordinator alive. From a standby that took over (a newer `term`), it
    tells a coordinator that lived on apart to step down (nodes.replication)."""

    KIND = Kind.FOLLOW
    endpoint: str  # where the standby serves: tcp://HOST:PORT (its term: the envelope's)
    layout: str  # digest of its model's layout; must equal the coordinator's
    build: str = ""  # its tensorbus release
    shared: str = ""  # its bus.shared.HostToken's offer: it reads weights by reference ("": not)
    run: str = ""  # the run it follows, as its replicas named it ("": none taken yet)


@dataclass(frozen=True, kw_only=True)
class Replica(Message):
    """The run's state at `version`, sent to the standby before that version is published:
    tensors[0] is the state's tree as JSON bytes (uint8), the others its tensors, each as it
    lies in memory (bus.tree). Answered by ACK."""

    KIND = Kind.REPLICA
    CARRIES_TENSORS = True
    OF_THE_LAYOUT = False  # weights, optimizer state and buffers, of any shape
    MAX_TENSORS = 1024  # (an optimizer keeps a tensor or two a parameter)
    run: str  # the run's id, the same from term to term: a standby follows one run
    # Its weights by reference, to a standby of the same host: the generation of the shared
    # set they lie in (bus.shared.SharedWeightPool), as when sent; 0: they went as bytes.
    generation: int = 0


@dataclass(frozen=True, kw_only=True)
class Reject(Message):
    KIND = Kind.REJECT
    code: str
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class Collective(Message):
    """One rank's call of its group's collective number `seq` (0: the join)."""

    KIND = Kind.COLLECTIVE
    CARRIES_TENSORS = True
    TENSORS_OPTIONAL = True  # none for a barrier, or from a broadcast's receiving ranks
    op: str  # a CollectiveOp
    seq: int  # collectives this rank called before this one, the join included
    size: int  # the group size this rank was started with
    timeout_s: float  # how long this rank waits for the others
    spec: str = ""  # the caller's tensor, as "float32[10, 3]"; "" for none
    reduce: str = ""  # allreduce: a ReduceOp
    root: int = -1  # broadcast: the source rank
    host: str = ""  # join: the caller's host name, for local ranks


@dataclass(frozen=True, kw_only=True)
class Result(Message):
    """How collective `seq` ended; for a rank that receives something, the tensor."""

    KIND = Kind.RESULT
    CARRIES_TENSORS = True
    TENSORS_OPTIONAL = True  # none for a barrier, a failure, or a broadcast's source
    seq: int
    outcome: str = Outcome.DONE.value  # an Outcome
    detail: str = ""  # timeout: the ranks missing; mismatch: who called what


@dataclass(frozen=True, kw_only=True)
class Peers(Message):
    """Asked by a stage worker of its stage's coordinator (with both fields empty), and
    answered with the inboxes of the same pipeline's stages beside it, those known yet
    ("": not joined yet, or none: the first stage has no previous, the last no next)."""

    KIND = Kind.PEERS
    previous: str = ""
    next: str = ""


@dataclass(frozen=True, kw_only=True)
class Activations(Message):
    """Stage `stage`'s outputs for micro-batch `micro` of its step `step`, then that
    micro-batch's targets (which the last stage's loss takes), to the next stage of the
    same pipeline (`sender`: the pipeline's rank). Tensors of any shape, one frame each;
    `version`: the version of the sending stage's weights."""

    KIND = Kind.ACTIVATIONS
    CARRIES_TENSORS = True
    OF_THE_LAYOUT = False
    stage: int
    step: int
    micro: int
    outputs: int  # how many of the tensors are outputs; the one after them is the targets
    batch: int  # samples in the whole batch (the micro-batch's share of the loss is n_m / n)
    # Batches per epoch of the pipeline's shard, as the first stage knows it (-1: not yet, a
    # data() without len() in its first pass): the other stages, which draw no batches, learn it.
    shard: int = -1


@dataclass(frozen=True, kw_only=True)
class ActivationGrads(Message):
    """The gradients of the loss with respect to the floating-point outputs that stage
    `stage` - 1 sent for micro-batch `micro` of step `step`, in their order, from stage
    `stage`; and that micro-batch's share of the batch's loss, as the last stage found it."""

    KIND = Kind.ACTIVATION_GRADS
    CARRIES_TENSORS = True
    OF_THE_LAYOUT = False
    stage: int
    step: int
    micro: int
    loss: float


ENVELOPE: Final = frozenset(f.name for f in fields(Message))


def _field_types(cls: type[Message]) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls) if f.name not in ENVELOPE}


# kind -> (record class, its own fields and their types); the codec validates against this.
SCHEMA: Final[dict[Kind, tuple[type[Message], dict[str, type]]]] = {
    cls.KIND: (cls, _field_types(cls))
    for cls in (Join, Welcome, Ready, Push, Ack, Pull, Weights, Heartbeat, Leave, Stop, Reject,
                Collective, Result, Changes, Describe, Follow, Replica, Peers, Activations,
                ActivationGrads, Fragment)
}
# The most tensors a message of any kind may carry (the codec's bound on a header's arrays).
MOST_TENSORS: Final = max(cls.MAX_TENSORS for cls, _ in SCHEMA.values())
