"""The wire: message kinds, the zero-copy codec, socket set-up, liveness and deadlines.

Knows nothing of training: it moves typed messages with flat tensors between nodes.
"""

from bus.codec import DTYPES, decode, encode
from bus.errors import PeerTimeoutError, RejectedError, WireError
from bus.layout import Layout
from bus.messages import COORDINATOR, PROTOCOL_VERSION, Kind, Message, Phase, RejectCode

__all__ = [
    "COORDINATOR",
    "DTYPES",
    "PROTOCOL_VERSION",
    "Kind",
    "Layout",
    "Message",
    "PeerTimeoutError",
    "Phase",
    "RejectCode",
    "RejectedError",
    "WireError",
    "decode",
    "encode",
]
