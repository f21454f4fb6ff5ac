"""The wire: message kinds, the zero-copy codec, socket set-up, liveness and deadlines.

Knows nothing of training: it moves typed messages with flat tensors between nodes.
"""

from tensorbus.bus.codec import DTYPES, decode, encode
from tensorbus.bus.errors import PeerTimeoutError, RejectedError, WireError
from tensorbus.bus.layout import Layout
from tensorbus.bus.messages import COORDINATOR, PROTOCOL_VERSION, Kind, Message, Phase, RejectCode

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
