"""Keep freed memory for reuse: fewer page faults on the hot path (a process setting).

Every step frees and allocates the same large blocks: gradients autograd makes, frames
libzmq receives (1 MiB chunks, allocated on its I/O thread, freed on ours). glibc's malloc
gives freed memory at the top of a heap back to the system once it exceeds a trim
threshold, and maps blocks above the mmap threshold afresh each time; either way the next
step faults every page in again (seen as minor page faults in getrusage, step after step,
on a worker serving a shard of the 10M-parameter MLP). Raising both thresholds keeps the
blocks in the heap. Only `run/` calls this, once per process, like the torch thread count.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest on 64-bit
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed blocks for reuse; False where there is no glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
                and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
