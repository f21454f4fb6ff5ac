"""nodes.largest: the k largest of a long vector, by a sampled guess, exactly as torch.topk.

Unit: for vectors long enough to take the fast path, the positions found are the ones
torch.topk finds (as sets, whatever the distribution: gaussian, heavy-tailed, a single
spike, mostly zeros with ties at the guess, a sorted ramp); where the guess cannot work
(a short vector, k not small against n) torch.topk decides; and the fast path allocates
nothing of the vector's size after construction.
"""

from __future__ import annotations

import tracemalloc

import pytest
import torch
from allocations import Allocations

from tensorbus.nodes.largest import SHORT, Largest

pytestmark = pytest.mark.timeout(60)

N = 200_000


def _same_as_topk(magnitude: torch.Tensor, k: int) -> None:
    chosen = Largest(magnitude.numel(), k, dtype=magnitude.dtype)(magnitude)
    assert chosen.numel() == k
    assert chosen.unique().numel() == k
    left = torch.ones_like(magnitude, dtype=torch.bool)
    left[chosen] = False
    # Exact: none left out is larger than one chosen (ties may go either way).
    assert magnitude[left].max() <= magnitude[chosen].min()
    reference = torch.topk(magnitude, k).values
    assert torch.equal(magnitude[chosen].sort().values, reference.sort().values)


@pytest.mark.parametrize("shape", ["gaussian", "heavy", "spike", "mostly-zero", "ramp", "float64"])
@pytest.mark.parametrize("k", [1, 2000])
def test_the_k_found_are_the_k_largest(shape: str, k: int) -> None:
    generator = torch.Generator().manual_seed(k)
    values = torch.randn(N, generator=generator).abs()
    if shape == "heavy":
        values = values.pow(8)  # a few elements hold nearly all the mass
    elif shape == "spike":
        values = torch.zeros(N)
        values[12345] = 1.0  # one nonzero: the rest tie at zero
    elif shape == "mostly-zero":
        values[torch.rand(N, generator=generator) < 0.995] = 0.0
    elif shape == "ramp":
        values = torch.arange(N, dtype=torch.float32)  # sorted: sampled positions see it all
    elif shape == "float64":
        values = values.double()
    _same_as_topk(values, k)


def test_a_vector_with_its_large_values_off_the_sample_still_gets_them() -> None:
    largest = Largest(N, 100)
    values = torch.full((N,), 1.0)
    off = torch.ones(N, dtype=torch.bool)
    off[largest._positions] = False
    where = off.nonzero().reshape(-1)[:100]
    values[where] = 2.0  # the 100 largest, none where the guess looks
    assert set(largest(values).tolist()) == set(where.tolist())


def test_short_vectors_and_large_k_go_to_torch_topk() -> None:
    assert not Largest(SHORT - 1, 10)._fast
    assert not Largest(N, N // 2)._fast
    assert Largest(N, N // 100)._fast
    with pytest.raises(ValueError, match="want 0 < k <= n"):
        Largest(10, 0)


def test_the_fast_path_allocates_nothing_of_the_vectors_size() -> None:
    largest = Largest(N, N // 100)
    values = torch.randn(N).abs()
    largest(values)
    with Allocations() as torch_ops:  # torch's allocations
        for _ in range(5):
            largest(values)
    assert torch_ops.seen == []
    tracemalloc.start()  # numpy's (the list of survivors)
    try:
        for _ in range(5):
            largest(values)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < N  # about 2k survivors of 8 bytes: the vector is N * 4 bytes
