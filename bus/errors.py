"""Typed errors of the wire layer, each carrying its facts and the code a peer is told.

A decoding error never escapes as a generic exception: every way a message can be wrong has
a class here, and each maps to one `RejectCode` so that the coordinator can answer the sender
with a coded Reject instead of a traceback.
"""

from __future__ import annotations

import reprlib

from tensorbus.bus.messages import RejectCode

_QUOTE = reprlib.Repr()  # keyword arguments only from Python 3.12
_QUOTE.maxstring = _QUOTE.maxother = 80
_QUOTE.maxlist = _QUOTE.maxdict = _QUOTE.maxtuple = 16
_QUOTE.maxlevel = 3


def quote(value: object) -> str:
    """A peer's value, quoted for an error message: bounded, so that a hostile value cannot
    make a Reject too long for its sender to read (or a log line too long to read)."""
    return _QUOTE.repr(value)


class WireError(Exception):
    """A message that cannot be accepted. `code` is what the sender is told."""

    code: RejectCode = RejectCode.MALFORMED
    request: int = 0  # the request id, where the header was readable enough to say


class MalformedHeaderError(WireError):
    def __init__(self, reason: str) -> None:
        super().__init__(f"malformed header: {reason}")
        self.reason = reason


class ProtocolVersionError(WireError):
    code = RejectCode.PROTOCOL

    def __init__(self, got: object, expected: int) -> None:
        super().__init__(f"protocol version {quote(got)}, this build speaks {expected}: run "
                         "the same tensorbus release on the coordinator and every worker")
        self.got = got
        self.expected = expected


class UnknownKindError(WireError):
    code = RejectCode.UNKNOWN_KIND

    def __init__(self, kind: object) -> None:
        super().__init__(f"unknown message kind {quote(kind)}")
        self.kind = kind


class FrameCountError(WireError):
    def __init__(self, declared: int, received: int) -> None:
        super().__init__(f"header declares {declared} tensor frames, {received} arrived")
        self.declared = declared
        self.received = received


class DtypeError(WireError):
    code = RejectCode.DTYPE

    def __init__(self, dtype: object) -> None:
        super().__init__(f"dtype {quote(dtype)} is not on the allow-list")
        self.dtype = dtype


class ByteLengthError(WireError):
    def __init__(self, index: int, declared: int, expected: int, received: int) -> None:
        # received < 0: the header contradicts itself, checked before any frame is read
        held = f", frame holds {received}" if received >= 0 else ""
        super().__init__(
            f"tensor {index}: header says {declared} bytes, shape and dtype make {expected}{held}"
        )
        self.index = index
        self.declared = declared
        self.expected = expected
        self.received = received


class LayoutError(WireError):
    code = RejectCode.LAYOUT

    def __init__(self, reason: str) -> None:
        super().__init__(f"tensors do not match the model's layout: {reason}")
        self.reason = reason


class MessageTooLargeError(WireError):
    code = RejectCode.TOO_LARGE

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"message of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class PeerTimeoutError(Exception):
    """A peer did not answer before a deadline: who, for what, and how long we waited."""

    def __init__(self, peer: str, waiting_for: str, seconds: float, hint: str = "") -> None:
        super().__init__(f"{peer} did not answer {waiting_for} within {seconds:.1f} s"
                         + (f": {hint}" if hint else ""))
        self.peer = peer
        self.waiting_for = waiting_for
        self.seconds = seconds


class HandshakeError(Exception):
    """ZeroMQ could not set up a connection with the peer (CURVE refused, say); no retry
    will help, so this ends the wait at once. The message says what to check."""

    def __init__(self, peer: str, problem: str) -> None:
        super().__init__(f"cannot talk to {peer}: {problem}")
        self.peer = peer
        self.problem = problem


class RejectedError(Exception):
    """The coordinator refused a request and said why."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"rejected ({code}): {detail}")
        self.code = code
        self.detail = detail
