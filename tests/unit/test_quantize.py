"""bus.quantize: block scales, rounding, int4 packing and the sum back, against values
worked out by hand (Python's round() rounds half to even, as torch.round does)."""

from __future__ import annotations

import pytest
import torch

from tensorbus.bus.quantize import BLOCK, LEVELS, dequantize_add, quantize, sizes

pytestmark = pytest.mark.timeout(30)


def _by_hand(x: list[float], bits: int) -> tuple[list[int], list[float]]:
    """Each block's scale (its largest magnitude / levels) and each element's integer."""
    levels = LEVELS[bits]
    scales, ints = [], []
    for start in range(0, len(x), BLOCK):
        block = x[start:start + BLOCK]
        scale = torch.tensor(max(abs(v) for v in block), dtype=torch.float32).item() / levels
        scale = torch.tensor(scale, dtype=torch.float32).item()
        scales.append(scale)
        inverse = torch.tensor(1.0 / scale if scale else 0.0, dtype=torch.float32).item()
        for v in block:
            q = round(torch.tensor(v * inverse, dtype=torch.float32).item())
            ints.append(max(-levels, min(levels, q)))
    return ints, scales


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 63, 64, 130, 1001])
def test_the_integers_and_scales_are_those_worked_out_by_hand(bits: int, numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    n_values, n_scales = sizes(numel, bits)
    values = torch.empty(n_values, dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.empty(n_scales)
    quantize(x, bits, values, scales)
    ints, hand_scales = _by_hand(x.tolist(), bits)
    assert scales.tolist() == pytest.approx(hand_scales, rel=1e-6)
    if bits == 8:
        assert values.tolist() == ints
    else:  # two to a byte, q + 8, the even element low; an odd count pads with a zero (8)
        padded = [q + 8 for q in ints] + ([8] if numel % 2 else [])
        assert values.tolist() == [padded[i] | padded[i + 1] << 4 for i in range(0, len(padded), 2)]
    # Back: each element within half a step of its block's scale.
    out = torch.zeros(numel)
    dequantize_add(out, values, scales, bits)
    steps = torch.tensor(hand_scales).repeat_interleave(BLOCK)[:numel]
    assert torch.all((out - x).abs() <= steps / 2 + 1e-6)
    assert torch.equal(out, torch.tensor(ints, dtype=torch.float32) * steps)


def test_int4_of_a_small_block_by_hand() -> None:
    """Largest magnitude 7: scale 1; 3.5 rounds to 4 (half to even), -2.5 to -2."""
    x = torch.tensor([7.0, -7.0, 3.5, -2.5, 0.0])
    values, scales = torch.empty(3, dtype=torch.uint8), torch.empty(1)
    quantize(x, 4, values, scales)
    assert scales.tolist() == [1.0]
    # integers 7, -7, 4, -2, 0 -> stored 15, 1, 12, 6, 8 (and the pad 8)
    assert values.tolist() == [15 | 1 << 4, 12 | 6 << 4, 8 | 8 << 4]


def test_a_block_of_zeros_sends_zeros_and_the_sum_back_is_scaled() -> None:
    x = torch.cat([torch.zeros(BLOCK), torch.full((BLOCK,), -2.0)])
    values, scales = torch.empty(2 * BLOCK, dtype=torch.int8), torch.empty(2)
    quantize(x, 8, values, scales)
    assert scales[0].item() == 0.0 and torch.all(values[:BLOCK] == 0)
    assert torch.all(values[BLOCK:] == -127)
    out = torch.ones(2 * BLOCK)
    dequantize_add(out, values, scales, 8, alpha=-0.5)  # out - x / 2
    assert torch.allclose(out, torch.cat([torch.ones(BLOCK), torch.full((BLOCK,), 2.0)]))


def test_buffers_of_the_wrong_size_are_refused() -> None:
    with pytest.raises(ValueError, match="100 elements at 4 bits take 50 values and 2 scales"):
        quantize(torch.zeros(100), 4, torch.empty(100, dtype=torch.uint8), torch.empty(2))
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        sizes(10, 2)
