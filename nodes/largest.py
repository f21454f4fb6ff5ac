"""The k elements of largest magnitude in a long vector, found fast on the CPU.

`torch.topk` over a million elements takes several times the batch-1 step of the
1M-parameter benchmark model that it serves (`--compress topk:R`) on this kind of CPU.
`Largest` finds the same k elements several times faster (k = 1%):

1. it guesses a threshold from a fixed random sample of the positions: a value that k of
   the n elements should reach, lowered by five standard deviations of how many sampled
   elements reach it (a lower bound on the k-th largest except with negligible
   probability), so that about k + 5 sqrt(k n / SAMPLE) elements survive;
2. it keeps the elements at or above the guess: one comparison into a buffer made once,
   and one pass to list the survivors (numpy's flatnonzero, whose time grows with their
   number);
3. it takes the exact top k of those few (numpy's argpartition).

Where fewer than k survive (a gradient so skewed that the sample missed its tail), or
more than half do (ties at the guess, such as a gradient of mostly zeros), or the vector
is short, on a GPU, or k is not small against n, `torch.topk` over the whole vector
decides. The result is exact either way: k distinct positions, none of them smaller in
magnitude than one left out (ties broken arbitrarily, as `torch.topk` breaks them).
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np
import torch

SAMPLE: Final = 1 << 14  # positions sampled for the guess
SHORT: Final = 1 << 16  # below this many elements, torch.topk is fast enough
NUMPY: Final = frozenset({torch.float32, torch.float64, torch.float16})


class Largest:
    """`largest(magnitude)`: the indices of the k largest of `n` non-negative values."""

    def __init__(self, n: int, k: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0) -> None:
        if not 0 < k <= n:
            raise ValueError(f"keep {k} of {n} elements: want 0 < k <= n")
        self.n, self.k = n, k
        expected = k * SAMPLE / n  # sampled elements at or above the k-th largest, on average
        rank = math.ceil(expected + 5 * math.sqrt(expected)) + 8  # the guess: the rank-th largest sampled
        self._fast = torch.device(device).type == "cpu" and n >= SHORT and rank <= SAMPLE // 4
        # numpy compares and partitions about 3x faster than torch here, one thread; it
        # has no bfloat16, which torch compares instead.
        self._numpy = dtype in NUMPY
        if self._fast:
            generator = torch.Generator().manual_seed(seed)
            self._positions = torch.randint(0, n, (SAMPLE,), generator=generator).sort().values
            self._sample = torch.empty(SAMPLE, dtype=dtype)
            self._rank = rank
            self._passed = torch.empty(n, dtype=torch.bool)  # made once: n bytes
            self._passed_np = self._passed.numpy()

    def __call__(self, magnitude: torch.Tensor) -> torch.Tensor:
        if self._fast:
            chosen = self._by_guess(magnitude)
            if chosen is not None:
                return chosen
        return torch.topk(magnitude, self.k, sorted=False).indices

    def _by_guess(self, magnitude: torch.Tensor) -> torch.Tensor | None:
        sample = torch.index_select(magnitude, 0, self._positions, out=self._sample)
        guess = torch.topk(sample, self._rank, sorted=False).values.min()
        if self._numpy:
            values = magnitude.numpy()
            np.greater_equal(values, values.dtype.type(guess.item()), out=self._passed_np)
        else:
            torch.ge(magnitude, guess, out=self._passed)
        survivors = np.flatnonzero(self._passed_np)
        if not self.k <= survivors.size <= self.n // 2:
            return None
        if self._numpy:
            # The k largest of the survivors, in no order (ties broken arbitrarily).
            found = survivors[np.argpartition(values[survivors], survivors.size - self.k)[-self.k:]]
            return torch.from_numpy(found)
        chosen = torch.from_numpy(survivors)
        return chosen[torch.topk(magnitude[chosen], self.k, sorted=False).indices]
