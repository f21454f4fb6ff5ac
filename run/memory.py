"""Keep freed memory for reuse: fewer page faults on the hot path (a process setting).

Every step frees and allocates the same large blocks: gradients autograd makes, frames
libzmq receives (1 MiB chunks, allocated on its I/O thread, freed on ours). glibc's malloc
gives such memory back to the system in three ways, and the next step then faults every
page in again (the kernel clears each one), step after step:

- a block above the mmap threshold is mapped afresh for each request;
- freed memory at the top of the main heap beyond the trim threshold is released;
- a thread's arena (the compute thread's, where autograd allocates the gradients) grows in
  heaps of at most 64 MiB: a block that does not fit in the thread's first heap gets a heap
  of its own, which glibc unmaps as soon as the block is freed, unless the top pad says to
  keep that much. With the 10M-parameter MLP the 32 MB gradient of the middle layer went
  this way every other step: 7767 faults each time (tests/test_hot_path.py), up to 4.5 ms
  of CPU a step in the kernel's page clearing (`perf`, benchmarks/cpu_profile.py).

Raising all three keeps the blocks: memory freed once is held for the next step, at the
cost of a process keeping up to a heap's worth of freed memory per thread that allocates.
Only `run/` calls this, once per process, like the torch thread count.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest on 64-bit
_HEAP_MAX = 2 * _MMAP_THRESHOLD_MAX  # the most a thread's heap holds (glibc's HEAP_MAX_SIZE)
_TRIM_THRESHOLD = 1 << 30
_SMALL = 128 << 10  # glibc's own starting mmap and trim thresholds


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
                and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
                # A heap with a pad of its whole size is never unmapped nor shrunk.
                and mallopt(_M_TOP_PAD, _HEAP_MAX))


def hold_only_what_is_used() -> bool:
    """The other way round, for a process whose memory is capped (run.faults' memory), so
    that what it holds is what it uses: one arena for every thread (not a heap of 64 MiB a
    thread that allocates), no top pad, and large blocks mapped afresh and given back as
    they are freed (not kept in a heap that small blocks cut up, which grows a large
    block's size at each step that frees one and makes another); False where there is no
    glibc. Call it before the process starts threads."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_ARENA_MAX, 1) and mallopt(_M_TOP_PAD, 0)
                and mallopt(_M_MMAP_THRESHOLD, _SMALL) and mallopt(_M_TRIM_THRESHOLD, _SMALL))
