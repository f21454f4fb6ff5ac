"""Unit tests of `bus.pieces`: a tensor received in several frames, used where it lies."""

from __future__ import annotations

import math

import pytest
import torch

from tensorbus.bus.pieces import (
    Pieces,
    all_finite,
    copy_into,
    fold,
    fold_checked,
    spans,
    sum_into,
    whole,
)

pytestmark = pytest.mark.timeout(10)


def _pieces(values: torch.Tensor, cuts: list[int], shape: tuple[int, ...] | None = None) -> Pieces:
    parts, at = [], 0
    for cut in [*cuts, values.numel()]:
        parts.append(values[at:cut].clone())
        at = cut
    return Pieces(parts, shape or (values.numel(),))


def test_spans_cover_the_tensor_in_order_with_offsets() -> None:
    p = _pieces(torch.arange(10.0), [3, 7])
    assert [(o, t.tolist()) for o, t in spans(p)] == [(0, [0, 1, 2]), (3, [3, 4, 5, 6]), (7, [7, 8, 9])]
    plain = torch.arange(6.0).view(2, 3)
    assert [(o, t.shape) for o, t in spans(plain)] == [(0, (6,))]


def test_whole_joins_and_keeps_the_shape() -> None:
    p = _pieces(torch.arange(12.0), [5], shape=(3, 4))
    assert torch.equal(whole(p), torch.arange(12.0).view(3, 4))
    t = torch.ones(2)
    assert whole(t) is t


def test_copy_into_a_flat_buffer() -> None:
    values = torch.arange(10.0)
    flat = torch.full((10,), 7.0)
    copy_into(flat, _pieces(values, [4]))
    assert torch.equal(flat, values)


@pytest.mark.parametrize("block", [1, 3, 4, 7, 64])
def test_sum_into_adds_tensors_cut_at_different_places_block_by_block(block: int) -> None:
    a, b, c = (torch.arange(10.0) * k for k in (1, 10, 100))
    flat = torch.full((10,), 7.0)  # overwritten, not added to
    sum_into(flat, [_pieces(a, [4]), _pieces(b, [1, 3, 9]), c], 0.5, block=block)
    assert torch.equal(flat, (a + b + c) * 0.5)


def test_sum_into_one_tensor_copies_it_and_refuses_a_wrong_size() -> None:
    flat = torch.zeros(6)
    sum_into(flat, [_pieces(torch.arange(6.0), [2])])
    assert torch.equal(flat, torch.arange(6.0))
    with pytest.raises(ValueError, match="5 elements for a buffer of 6"):
        sum_into(flat, [torch.zeros(5)])


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("block", [5, 64])
def test_tensors_cut_alike_are_summed_as_a_copy_then_adds_would_bit_for_bit(
        count: int, block: int) -> None:
    """The first two, cut at the same places and of the buffer's dtype, are added in one
    pass (torch.add into the block): the same float sums, in the same order."""
    torch.manual_seed(count)
    tensors = [_pieces(torch.randn(23), [7, 14]) for _ in range(count)]
    want = whole(tensors[0]).clone()
    for t in tensors[1:]:
        want.add_(whole(t))
    flat = torch.full((23,), 7.0)
    sum_into(flat, tensors, 0.25, block=block)
    assert torch.equal(flat, want.mul_(0.25))


def test_a_narrower_dtype_adds_into_float32() -> None:
    flat = torch.zeros(6)
    half = torch.tensor([0.5, 1.5, 2.5, 3.5, 4.5, 5.5], dtype=torch.bfloat16)
    sum_into(flat, [torch.zeros(6), _pieces(half, [2])])
    assert flat.tolist() == [0.5, 1.5, 2.5, 3.5, 4.5, 5.5]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 5, 9])
def test_all_finite_finds_a_bad_element_in_any_piece(bad: float, where: int) -> None:
    values = torch.arange(10.0)
    values[where] = bad
    assert not all_finite(_pieces(values, [3, 7]))
    assert not all_finite(values)


def test_all_finite_is_not_fooled_by_a_sum_that_overflows() -> None:
    big = torch.full((8,), 60000.0, dtype=torch.float16)  # finite, but sums past fp16's max
    assert not math.isfinite(float(big.sum()))
    assert all_finite(big) and all_finite(_pieces(big, [3]))
    assert all_finite(torch.tensor([1, 2, 3]))  # integers are always finite


def test_pieces_must_add_up_to_the_shape() -> None:
    with pytest.raises(ValueError, match="pieces of 5 elements for shape"):
        Pieces([torch.ones(2), torch.ones(3)], (6,))
    with pytest.raises(ValueError, match="at least one piece"):
        Pieces([], (0,))


def _pushes(n: int) -> list[torch.Tensor | Pieces]:
    """Three updates of n elements: cut in two places, whole, and whole in bf16."""
    return [_pieces(torch.randn(n), [n // 3, n // 2]), torch.randn(n),
            torch.randn(n).to(torch.bfloat16)]


@pytest.mark.parametrize("n", [1, 10, 1001])
@pytest.mark.parametrize("block", [1, 7, 64])
def test_a_fold_push_by_push_has_the_bits_of_a_fold_at_once(n: int, block: int) -> None:
    """nodes.fold: pushes folded as they come, each on what the last one left, equal the
    step made over all of them at the end, bit for bit; and both are w + a*x0 + a*x1 + ...
    in that order (up to the rounding of a fused multiply-add)."""
    torch.manual_seed(n)
    weights, pushes = torch.randn(n), _pushes(n)
    at_once = torch.full((n,), 7.0)
    fold(at_once, weights, pushes, -0.03, block=block)
    one_by_one = torch.full((n,), 7.0)
    for i, push in enumerate(pushes):
        assert fold_checked(one_by_one, weights if i == 0 else None, push, -0.03, block=block) is None
    assert torch.equal(one_by_one, at_once)
    want = weights.clone()
    for push in pushes:
        want = want + -0.03 * whole(push).float()
    torch.testing.assert_close(at_once, want, rtol=0, atol=1e-6)
    # The first pushes at once and the rest then: the same bits too (a step that goes on
    # from a fold).
    later = torch.full((n,), 7.0)
    fold(later, weights, pushes[:1], -0.03, block=block)
    fold(later, None, pushes[1:], -0.03, block=block)
    assert torch.equal(later, at_once)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_fold_stops_at_the_first_block_that_is_not_finite(bad: float) -> None:
    torch.manual_seed(1)
    weights, good = torch.randn(40), torch.randn(40)
    poisoned = torch.randn(40)
    poisoned[25] = bad
    out = torch.full((40,), 7.0)
    assert fold_checked(out, weights, good, 0.5, block=8) is None
    before = out.clone()
    # Blocks of 8: element 25 is in the block that starts at 24, which is not written;
    # the blocks before it are, and `fold` with `stop` makes them again without it.
    assert fold_checked(out, None, _pieces(poisoned, [13]), 0.5, block=8) == 24
    assert torch.equal(out[24:], before[24:]) and not torch.equal(out[:24], before[:24])
    fold(out, weights, [good], 0.5, stop=24, block=8)
    assert torch.equal(out, before)


def test_a_fold_checks_an_overflowing_sum_element_by_element_and_refuses_a_wrong_size() -> None:
    big = torch.full((8,), 60000.0, dtype=torch.float16)  # finite, but sums past fp16's max
    out = torch.zeros(8)
    assert fold_checked(out, torch.zeros(8), big, 1.0) is None
    assert torch.equal(out, big.float())
    with pytest.raises(ValueError, match="5 elements for a buffer of 8"):
        fold_checked(out, None, torch.zeros(5), 1.0)
    with pytest.raises(ValueError, match="5 elements for a buffer of 8"):
        fold(out, None, [torch.zeros(5)], 1.0)
