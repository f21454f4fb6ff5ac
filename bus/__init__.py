"""The wire: message kinds, the zero-copy codec, socket set-up, liveness and deadlines.

Knows nothing of training: it moves typed messages with flat tensors between nodes.
"""

from __future__ import annotations

from typing import Any

from tensorbus.bus import lazy

# Imported when first used, not with the package: the command line reads the wire's
# version (bus.protocol) and the configs without importing torch.
_WHERE = {
    "COORDINATOR": "messages",
    "DTYPES": "codec",
    "Kind": "messages",
    "Layout": "layout",
    "Message": "messages",
    "PROTOCOL_VERSION": "messages",
    "PeerTimeoutError": "errors",
    "Phase": "messages",
    "RejectCode": "messages",
    "RejectedError": "errors",
    "WireError": "errors",
    "decode": "codec",
    "encode": "codec",
}

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


def __getattr__(name: str) -> Any:
    return lazy.attribute(__name__, _WHERE, name)
