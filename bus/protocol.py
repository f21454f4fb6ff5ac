"""The wire protocol's version and this release's name: what every node of a run must share.

Apart from the messages (`bus.messages`), so that the command line can say them without
importing torch.
"""

from __future__ import annotations

import importlib.metadata
from typing import Final

# 2: pushes carry telemetry, acks the time held; 3: chunked tensors; 4: Changes;
# 5: tensors by reference (bus.shared) and the Welcome's offer of them; 6: broadcasts
# under a topic frame, a version's weights by reference too (Weights.generation); 7: segment
# names carry their creator's start time (bus.shared.sweep); 8: the Welcome's seed; 9: a
# push says its shard's length once known (data() without len()); 10: the model's buffers
# ride with pushes and weights (header key "b"), the Welcome's clip_grad_norm and
# precision, a push's fp16 overflows; 11: Describe (a script's own loop), a push's lrs;
# 12: a standby coordinator (Follow, Replica, the standby named in Welcome and Heartbeat, a
# Stop that moves workers, the not_yet refusal); pipeline stages (Peers, Activations,
# ActivationGrads; a Join's stage and inbox, a Welcome's micro-batches and schedule), a
# push's peak memory and a stage's busy time; streaming averaging (Fragment, a push's
# fragment and local steps, the Welcome's fragments and mix, an Ack's local steps);
# 13: every message carries its coordinator's term (header key "e"), Follow's and
# Replica's own term fields gone into it
PROTOCOL_VERSION: Final = 13


def _build() -> str:
    try:
        return importlib.metadata.version("tensorbus")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


BUILD: Final = _build()  # this release, sent on join so that mismatched builds are named
