"""The wire format: a message to a list of sendable buffers, and the inverse.

Frame 0 is a msgpack header: {"p": protocol, "k": kind, "s": sender, "r": request id,
"v": version, "t": [[dtype, shape, nbytes], ...], "f": {the kind's own fields}}.
Frames 1..n are the raw bytes of the message's flat tensors, in header order.

`decode` checks everything (sizes, types, kind, dtypes, byte counts, the model's layout)
before it builds a single tensor, and raises a `WireError` subclass naming what is wrong.
Neither direction copies tensor bytes:

- `encode` returns numpy views of the tensors' own memory. The caller sends them with
  `copy=False` and must not write those tensors until ZeroMQ is done with the frames
  (see `bus.buffers`).
- `decode` returns tensors made by `torch.frombuffer` over the received frames; they share
  the frames' memory and keep them alive for as long as they live.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

import msgpack
import numpy as np
import torch

from bus.errors import (
    ByteLengthError,
    DtypeError,
    FrameCountError,
    MalformedHeaderError,
    MessageTooLargeError,
    ProtocolVersionError,
    UnknownKindError,
    WireError,
    quote,
)
from bus.layout import Layout
from bus.messages import PROTOCOL_VERSION, SCHEMA, Kind, Message

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
MAX_TENSORS: Final = 64
MAX_DIMS: Final = 8
MAX_STRING: Final = 4096
DEFAULT_MAX_MESSAGE_BYTES: Final = 4 << 30
_HEADER_KEYS: Final = frozenset("pksrvtf")
_INT64_MAX: Final = 2**63 - 1

Buffer = bytes | bytearray | memoryview


def encode(message: Message) -> list[Buffer | np.ndarray]:
    """Turn a message into frames: the header, then each tensor's bytes (not copied)."""
    specs = []
    frames: list[Buffer | np.ndarray] = [b""]
    for tensor in message.tensors:
        name = DTYPE_NAMES.get(tensor.dtype)
        if name is None:
            raise DtypeError(str(tensor.dtype))
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("tensors on the wire must be contiguous CPU tensors")
        specs.append([name, list(tensor.shape), tensor.numel() * tensor.element_size()])
        flat = tensor.detach().reshape(-1)
        frames.append(flat.view(torch.uint8).numpy() if flat.numel() else b"")
    _, own_fields = SCHEMA[message.KIND]
    header = {
        "p": PROTOCOL_VERSION,
        "k": int(message.KIND),
        "s": message.sender,
        "r": message.request,
        "v": message.version,
        "t": specs,
        "f": {name: getattr(message, name) for name in own_fields},
    }
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def decode(
    frames: Sequence[Buffer],
    *,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    layout: Layout | None = None,
) -> Message:
    """Validate frames and build the message; raise a WireError subclass if anything is off."""
    if not frames:
        raise MalformedHeaderError("no frames")
    header = _unpack_header(frames[0])
    # Read first, so that every later refusal (another protocol version included) names
    # the request it refuses, and the sender's wait for it ends.
    request = header.get("r")
    request = request if type(request) is int and 0 <= request <= _INT64_MAX else 0
    try:
        _check_header(header)
        return _decode(header, frames, max_bytes, layout)
    except WireError as e:
        e.request = request  # so that the Reject reaches the request that waits for it
        raise


def _decode(
    header: dict[str, Any], frames: Sequence[Buffer], max_bytes: int, layout: Layout | None
) -> Message:
    kind = _kind(header)
    cls, own_fields = SCHEMA[kind]
    envelope = {
        "sender": _int(header, "s", minimum=-1),
        "request": _int(header, "r", minimum=0),
        "version": _int(header, "v", minimum=0),
    }
    values = _fields(header["f"], own_fields)
    specs = _tensor_specs(header["t"], cls.CARRIES_TENSORS)
    if len(frames) - 1 != len(specs):
        raise FrameCountError(len(specs), len(frames) - 1)
    total = sum(nbytes for _, _, nbytes in specs)
    if total > max_bytes:
        raise MessageTooLargeError(total, max_bytes)
    for i, ((_, _, nbytes), frame) in enumerate(zip(specs, frames[1:], strict=True)):
        received = memoryview(frame).nbytes
        if received != nbytes:
            raise ByteLengthError(i, nbytes, nbytes, received)
    if layout is not None and cls.CARRIES_TENSORS and (specs or not cls.TENSORS_OPTIONAL):
        layout.check([(dtype, shape) for dtype, shape, _ in specs])
    tensors = tuple(
        _tensor(frame, dtype, shape) for (dtype, shape, _), frame in zip(specs, frames[1:], strict=True)
    )
    return cls(**envelope, tensors=tensors, **values)


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
            max_array_len=MAX_TENSORS * (MAX_DIMS + 3),
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
    if set(header) != _HEADER_KEYS:
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


def _tensor_specs(
    raw: object, carries_tensors: bool
) -> list[tuple[torch.dtype, tuple[int, ...], int]]:
    if not isinstance(raw, list):
        raise MalformedHeaderError("tensor list is not an array")
    if raw and not carries_tensors:
        raise MalformedHeaderError("this kind carries no tensors")
    if len(raw) > MAX_TENSORS:
        raise MalformedHeaderError(f"{len(raw)} tensors, at most {MAX_TENSORS}")
    specs = []
    for i, spec in enumerate(raw):
        if not (isinstance(spec, list) and len(spec) == 3):
            raise MalformedHeaderError(f"tensor {i}: spec must be [dtype, shape, nbytes]")
        name, shape, nbytes = spec
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
        specs.append((dtype, tuple(shape), nbytes))
    return specs


def _tensor(frame: Buffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(frame, dtype=dtype).view(shape)
