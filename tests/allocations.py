"""A watch on new buffers: what the tests of the hot path use to say that a step allocates
no gradient-sized memory (tests/integration/test_hot_path.py, tests/unit/test_largest.py)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

AT_LEAST = 64 * 1024  # bytes: smaller outputs (scalars, small views' metadata) are not counted


class Allocations(TorchDispatchMode):
    """Records every operation whose output has storage of AT_LEAST bytes that none of its
    inputs had: a new buffer, not a view or an in-place result."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        had = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.nbytes() >= AT_LEAST and storage.data_ptr() not in had:
                    self.seen.append((str(func), storage.nbytes()))
        return out
