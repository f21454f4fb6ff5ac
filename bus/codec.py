"""The wire format: a message to a list of sendable buffers, and the inverse.

Frame 0 is a msgpack header: {"p": protocol, "k": kind, "s": sender, "r": request id,
"v": version, "t": [[dtype, shape, nbytes, chunk], ...], "f": {the kind's own fields}},
and "b": n where the last n tensors of "t" are the model's buffers (`Message.state`).
Then come the raw bytes of the message's flat tensors, in header order, each tensor cut into
frames of `chunk` bytes (the last one shorter): ceil(nbytes / chunk) frames, at least one.
A tensor sent by reference (in shared memory, to a process on the same host: `bus.shared`)
has a fifth entry, [segment, offset], and no frames.
ZeroMQ moves large tensors fastest as frames of about a megabyte (see `bus.pieces`); the
sender evens the chunks out where the last one would be under 64 KiB (`_chunk`).

`decode` checks everything (sizes, types, kind, dtypes, byte counts, the model's layout)
before it builds a single tensor, and raises a `WireError` subclass naming what is wrong.
Neither direction copies tensor bytes:

- `encode` returns numpy views of the tensors' own memory. The caller sends them with
  `copy=False` and must not write those tensors until ZeroMQ is done with the frames
  (see `bus.buffers`).
- `decode` returns tensors made by `torch.frombuffer` over the received frames; they share
  the frames' memory and keep them alive for as long as they live. A tensor by reference
  is a read-only view of the sender's segment (`bus.shared.SegmentCache`): the sender's memory,
  which a worker does not write until its coordinator is done with a push, and which a
  reader of weights checks it copied whole (the rules in `bus.shared`). A tensor of more than
  one frame comes back as `bus.pieces.Pieces`, one 1-D tensor a frame.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Final

import msgpack
import numpy as np
import torch

from tensorbus.bus.errors import (
    ByteLengthError,
    DtypeError,
    FrameCountError,
    LayoutError,
    MalformedHeaderError,
    MessageTooLargeError,
    ProtocolVersionError,
    UnknownKindError,
    WireError,
    quote,
)
from tensorbus.bus.layout import Layout
from tensorbus.bus.messages import MOST_TENSORS, PROTOCOL_VERSION, SCHEMA, Kind, Message
from tensorbus.bus.pieces import Pieces, Received
from tensorbus.bus.shared import Ref, SegmentCache, SharedTensorError

# The dtypes a tensor frame may have; anything else is refused before it is read.
DTYPES: Final[dict[str, torch.dtype]] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: Final[dict[torch.dtype, str]] = {v: k for k, v in DTYPES.items()}

MAX_HEADER_BYTES: Final = 64 * 1024
MAX_TENSORS: Final = Message.MAX_TENSORS  # a message's, unless its kind says more
# Frames of this size keep ZeroMQ over tcp near its best (benchmarks/bench.py, part a).
CHUNK_BYTES: Final = 1 << 20
# A peer may cut finer, but not so fine that a message becomes millions of frames.
MIN_CHUNK_BYTES: Final = 4096
# pyzmq copies a frame smaller than this (zmq.COPY_THRESHOLD) rather than send it by
# reference: where a tensor's last chunk would be that small, its chunks are evened out.
SMALL_FRAME: Final = 1 << 16
MAX_FRAMES: Final = 1 << 16
MAX_DIMS: Final = 8
# The longest array a header may hold, past which it is not read at all: twice the most
# tensors of any kind (a longer tensor list is refused after, with its count and limit).
MAX_ARRAY: Final = max(MAX_TENSORS * (MAX_DIMS + 3), 2 * MOST_TENSORS)
MAX_STRING: Final = 4096
DEFAULT_MAX_MESSAGE_BYTES: Final = 4 << 30
_HEADER_KEYS: Final = frozenset("pksrvetf")
_OPTIONAL_KEYS: Final = frozenset("b")
_INT64_MAX: Final = 2**63 - 1

Buffer = bytes | bytearray | memoryview


def encode(message: Message, *, chunk_bytes: int = CHUNK_BYTES,
           refer: Callable[[torch.Tensor], Ref | None] | None = None,
           term: int | None = None) -> list[Buffer | np.ndarray]:
    """Turn a message into frames: the header, then each tensor's bytes in chunks (not copied).
    A tensor that `refer` places (in shared memory the receiver reads: bus.shared) goes as
    its place instead. `term`: the sender's, in place of the message's (a coordinator
    stamps its own on all it sends, without a copy of each message)."""
    specs = []
    frames: list[Buffer | np.ndarray] = [b""]
    if message.state and not message.CARRIES_STATE:
        raise ValueError(f"a {message.KIND.name} carries no buffers")
    for index, tensor in enumerate((*message.tensors, *message.state)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"only tensors are sent, not {type(tensor).__name__}")
        name = DTYPE_NAMES.get(tensor.dtype)
        if name is None:
            raise DtypeError(str(tensor.dtype))
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("tensors on the wire must be contiguous CPU tensors")
        nbytes = tensor.numel() * tensor.element_size()
        chunk = _chunk(nbytes, chunk_bytes, tensor.element_size())
        # (Buffers always go as bytes: they are small, and the sender writes them again.)
        ref = refer(tensor) if refer is not None and nbytes and index < len(message.tensors) else None
        if ref is not None:
            specs.append([name, list(tensor.shape), nbytes, chunk, ref])
            continue
        specs.append([name, list(tensor.shape), nbytes, chunk])
        if not nbytes:
            frames.append(b"")
            continue
        raw = tensor.detach().reshape(-1).view(torch.uint8).numpy()
        frames.extend(raw[i : i + chunk] for i in range(0, nbytes, chunk))
    _, own_fields = SCHEMA[message.KIND]
    header = {
        "p": PROTOCOL_VERSION,
        "k": int(message.KIND),
        "s": message.sender,
        "r": message.request,
        "v": message.version,
        "e": message.term if term is None else term,
        "t": specs,
        "f": {name: getattr(message, name) for name in own_fields},
    }
    if message.state:
        header["b"] = len(message.state)
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def _chunk(nbytes: int, chunk_bytes: int, itemsize: int) -> int:
    """The chunk of a tensor of `nbytes`: `chunk_bytes` in whole elements, so that each
    frame is a tensor of its own; or, where the last frame would be copied for its small
    size (a colocated worker computes on its shard's frames in place: nodes.colocated_sets),
    as even a cut into as many frames."""
    chunk = max(chunk_bytes // itemsize, 1) * itemsize
    if chunk >= SMALL_FRAME and 0 < nbytes % chunk < SMALL_FRAME and nbytes > chunk:
        frames = -(-nbytes // chunk)
        chunk = -(-nbytes // (frames * itemsize)) * itemsize
    return chunk


def decode(
    frames: Sequence[Buffer],
    *,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    layout: Layout | None = None,
    segments: SegmentCache | None = None,
    fragments: Sequence[Layout] = (),
) -> Message:
    """Validate frames and build the message; raise a WireError subclass if anything is off.
    Tensors by reference are read through `segments`; without one, they are refused. Where
    `layout` is given, a message that names a fragment of the model (its `fragment` field,
    0 or more: streaming averaging) is checked against that one of `fragments` instead."""
    if not frames:
        raise MalformedHeaderError("no frames")
    header = _unpack_header(frames[0])
    # Read first, so that every later refusal (another protocol version included) names
    # the request it refuses, and the sender's wait for it ends.
    request = header.get("r")
    request = request if type(request) is int and 0 <= request <= _INT64_MAX else 0
    try:
        _check_header(header)
        return _decode(header, frames, max_bytes, layout, segments, fragments)
    except WireError as e:
        e.request = request  # so that the Reject reaches the request that waits for it
        raise


def _decode(
    header: dict[str, Any], frames: Sequence[Buffer], max_bytes: int, layout: Layout | None,
    segments: SegmentCache | None, fragments: Sequence[Layout],
) -> Message:
    kind = _kind(header)
    cls, own_fields = SCHEMA[kind]
    envelope = {
        "sender": _int(header, "s", minimum=-1),
        "request": _int(header, "r", minimum=0),
        "version": _int(header, "v", minimum=0),
        "term": _int(header, "e", minimum=0),
    }
    values = _fields(header["f"], own_fields)
    part = values.get("fragment", -1)
    if part != -1 and layout is not None:
        if not 0 <= part < len(fragments):
            raise LayoutError(f"fragment {part} of a model in {len(fragments)} fragments"
                              if fragments else f"fragment {part} of a model not in fragments")
        layout = fragments[part]
    specs = _tensor_specs(header["t"], cls.CARRIES_TENSORS, cls.MAX_TENSORS)
    carried = header.get("b", 0)
    if type(carried) is not int or not 0 <= carried <= len(specs) or (carried and not cls.CARRIES_STATE):
        raise MalformedHeaderError(f"field 'b' must count the buffers among the tensors of a "
                                   f"kind that carries them, got {quote(carried)}")
    total = sum(spec.nbytes for spec in specs)
    if total > max_bytes:
        raise MessageTooLargeError(total, max_bytes)
    expected = sum(spec.frames for spec in specs)
    if expected > MAX_FRAMES:
        raise MalformedHeaderError(f"{expected} tensor frames, at most {MAX_FRAMES}")
    if len(frames) - 1 != expected:
        raise FrameCountError(expected, len(frames) - 1)
    first = 1
    for i, spec in enumerate(specs):
        for j, frame in enumerate(frames[first : first + spec.frames]):
            received = memoryview(frame).nbytes
            if received != spec.frame_bytes(j):
                raise ByteLengthError(i, spec.nbytes, spec.frame_bytes(j), received)
        first += spec.frames
    if carried and any(spec.ref is not None for spec in specs[len(specs) - carried:]):
        raise SharedTensorError("buffers by reference: they go as bytes")
    main = specs[:len(specs) - carried]
    if (layout is not None and cls.CARRIES_TENSORS and cls.OF_THE_LAYOUT
            and (main or not cls.TENSORS_OPTIONAL)):
        check = layout.check_sparse if cls.SPARSE else layout.check
        check([(spec.dtype, spec.shape) for spec in main])
    tensors: list[Received] = []
    first = 1
    for spec in specs:
        if spec.ref is not None:
            if segments is None:
                raise SharedTensorError("a tensor by reference (shared memory), which this node "
                                        "does not take: send the bytes")
            if (kind not in (Kind.PUSH, Kind.WEIGHTS, Kind.REPLICA)
                    or not spec.dtype.is_floating_point):
                raise SharedTensorError(f"a {spec.dtype} tensor by reference in a {kind.name}: "
                                        "only the float tensors of a push, of weights or of a "
                                        "replica may come by reference")
            tensors.append(segments.view(spec.ref, spec.nbytes, spec.dtype).view(spec.shape))
            continue
        tensors.append(_tensor(frames[first : first + spec.frames], spec))
        first += spec.frames
    split = len(tensors) - carried
    return cls(**envelope, tensors=tuple(tensors[:split]), state=tuple(tensors[split:]), **values)


def _unpack_header(frame: Buffer) -> dict[str, Any]:
    size = memoryview(frame).nbytes
    if size > MAX_HEADER_BYTES:
        raise MalformedHeaderError(f"header of {size} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_STRING,
            max_bin_len=0,
            max_array_len=MAX_ARRAY,
            max_map_len=64,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise MalformedHeaderError(f"not a msgpack header ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise MalformedHeaderError(f"header is a {type(header).__name__}, not a map")
    return header


def _check_header(header: dict[str, Any]) -> None:
    # The protocol version is read first: a peer of another version may lay out the rest
    # differently, and it should be told the version is wrong, not that its header is.
    if type(header.get("p")) is not int or header["p"] != PROTOCOL_VERSION:
        raise ProtocolVersionError(header.get("p"), PROTOCOL_VERSION)
    if not _HEADER_KEYS <= set(header) <= _HEADER_KEYS | _OPTIONAL_KEYS:
        raise MalformedHeaderError(f"header keys {quote(sorted(header))}, expected {sorted(_HEADER_KEYS)}")


def _kind(header: dict[str, Any]) -> Kind:
    k = header["k"]
    if type(k) is not int or k not in Kind._value2member_map_:
        raise UnknownKindError(k)
    return Kind(k)


def _int(header: dict[str, Any], key: str, *, minimum: int) -> int:
    value = header[key]
    if type(value) is not int or not minimum <= value <= _INT64_MAX:
        raise MalformedHeaderError(f"field {key!r} must be an integer >= {minimum}, got {quote(value)}")
    return value


def _fields(raw: object, expected: dict[str, type]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise MalformedHeaderError("fields are not a map")
    if set(raw) != set(expected):
        missing = sorted(set(expected) - set(raw))
        extra = sorted(set(raw) - set(expected))
        raise MalformedHeaderError(f"fields missing {missing}, unexpected {quote(extra)}")
    values = {}
    for name, typ in expected.items():
        value = raw[name]
        if typ is float and type(value) is int:
            value = float(value)
        if type(value) is not typ:
            raise MalformedHeaderError(
                f"field {name!r} must be {typ.__name__}, got {type(value).__name__}"
            )
        values[name] = value
    return values


class _Spec:
    """One tensor's header entry, checked: its frames are `chunk` bytes each, the last shorter."""

    __slots__ = ("chunk", "dtype", "frames", "nbytes", "ref", "shape")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, chunk: int,
                 ref: object = None) -> None:
        self.dtype, self.shape, self.nbytes, self.chunk = dtype, shape, nbytes, chunk
        self.ref = ref  # [segment, offset] of a tensor by reference, checked by the SegmentCache
        self.frames = max(-(-nbytes // chunk), 1) if ref is None else 0

    def frame_bytes(self, j: int) -> int:
        return min(self.chunk, self.nbytes - j * self.chunk)


def _tensor_specs(raw: object, carries_tensors: bool, most: int) -> list[_Spec]:
    if not isinstance(raw, list):
        raise MalformedHeaderError("tensor list is not an array")
    if raw and not carries_tensors:
        raise MalformedHeaderError("this kind carries no tensors")
    if len(raw) > most:
        raise MalformedHeaderError(f"{len(raw)} tensors, at most {most}")
    specs = []
    for i, spec in enumerate(raw):
        if not (isinstance(spec, list) and len(spec) in (4, 5)):
            raise MalformedHeaderError(
                f"tensor {i}: spec must be [dtype, shape, nbytes, chunk] (and [segment, offset])")
        name, shape, nbytes, chunk = spec[:4]
        if type(name) is not str or name not in DTYPES:
            raise DtypeError(name)
        dtype = DTYPES[name]
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or any(type(d) is not int or not 0 <= d <= _INT64_MAX for d in shape)
        ):
            raise MalformedHeaderError(f"tensor {i}: bad shape {quote(shape)}")
        if type(nbytes) is not int or nbytes < 0:
            raise MalformedHeaderError(f"tensor {i}: bad byte count {quote(nbytes)}")
        expected = math.prod(shape) * dtype.itemsize
        if nbytes != expected:
            raise ByteLengthError(i, nbytes, expected, -1)
        if (type(chunk) is not int or chunk % dtype.itemsize
                or not (chunk >= MIN_CHUNK_BYTES or chunk >= nbytes > 0 or chunk == nbytes == 0)
                or chunk > _INT64_MAX):
            raise MalformedHeaderError(
                f"tensor {i}: chunk of {quote(chunk)} bytes: a whole number of elements, at "
                f"least {MIN_CHUNK_BYTES} bytes unless the tensor fits in one")
        ref = spec[4] if len(spec) == 5 else None
        if len(spec) == 5 and (ref is None or not nbytes):
            raise MalformedHeaderError(f"tensor {i}: a reference must be [segment, offset], "
                                       "to a tensor of at least one element")
        specs.append(_Spec(dtype, tuple(shape), nbytes, max(chunk, 1), ref))
    return specs


def _tensor(frames: Sequence[Buffer], spec: _Spec) -> Received:
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=spec.dtype)
    if len(frames) == 1:
        return torch.frombuffer(frames[0], dtype=spec.dtype).view(spec.shape)
    return Pieces([torch.frombuffer(f, dtype=spec.dtype) for f in frames], spec.shape)
