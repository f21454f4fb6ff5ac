"""Block quantization of float tensors to 8 or 4 bits, for pushes that are sent rarely
(`--compress int8|int4` under periodic averaging: nodes.outbox).

A tensor of n elements is cut into blocks of BLOCK elements (the last one shorter). Each
block travels as one float32 scale, its largest magnitude divided by LEVELS[bits], and
its elements as round(x / scale), integers in [-LEVELS, LEVELS] (round half to even, as
torch.round): int8 as they are, one byte each; int4 two to a byte, each stored as q + 8
(1 to 15), the even element in the low half. A block of zeros has scale 0 and sends zeros.

So a float32 tensor travels in about 1/4 (int8) or 1/8 (int4) of its bytes, plus 4 bytes
of scale a block (1/16 of a float32 tensor at BLOCK 64). What is lost is at most half a
step, scale / 2, an element; an error-feedback residual (nodes.outbox) carries it to the
next push. `dequantize_add` adds the values back, in float32.

These make temporaries as large as the tensor: they run once a push, every H local
steps, not on every step.
"""

from __future__ import annotations

import math
from typing import Final

import torch

BLOCK: Final = 64  # elements per scale
LEVELS: Final[dict[int, int]] = {8: 127, 4: 7}  # the largest magnitude, in steps of the scale
VALUE_DTYPE: Final[dict[int, torch.dtype]] = {8: torch.int8, 4: torch.uint8}


def sizes(numel: int, bits: int) -> tuple[int, int]:
    """How many value elements (of VALUE_DTYPE[bits]) and scales `numel` elements travel as."""
    if bits not in LEVELS:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    values = numel if bits == 8 else (numel + 1) // 2
    return values, math.ceil(numel / BLOCK)


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` as a (blocks, BLOCK) view of its full blocks, and its tail (shorter than BLOCK)."""
    full = x.numel() // BLOCK * BLOCK
    return x[:full].view(-1, BLOCK), x[full:]


def quantize(x: torch.Tensor, bits: int, values: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize the 1-D float tensor `x` into `values` and `scales` (sized by `sizes`)."""
    levels = LEVELS[bits]
    n = x.numel()
    want_values, want_scales = sizes(n, bits)
    if values.numel() != want_values or scales.numel() != want_scales:
        raise ValueError(f"{n} elements at {bits} bits take {want_values} values and "
                         f"{want_scales} scales, not {values.numel()} and {scales.numel()}")
    with torch.no_grad():
        x = x.float()
        body, tail = _blocks(x)
        nb = body.shape[0]
        if nb:
            torch.amax(body.abs(), dim=1, out=scales[:nb])
        if tail.numel():
            scales[nb] = tail.abs().max()
        scales.div_(levels)
        # Divide by the scale where it is not 0 (a block of zeros stays zeros).
        inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
        q = torch.empty(n, dtype=torch.float32, device=x.device)
        q_body, q_tail = _blocks(q)
        torch.mul(body, inverse[:nb, None], out=q_body)
        if tail.numel():
            torch.mul(tail, inverse[nb], out=q_tail)
        q.round_().clamp_(-levels, levels)
        if bits == 8:
            values.copy_(q)
            return
        shifted = (q + 8).to(torch.uint8)
        if n % 2:
            shifted = torch.cat([shifted, shifted.new_full((1,), 8)])  # a zero, to pair
        pairs = shifted.view(-1, 2)
        torch.bitwise_or(pairs[:, 0], pairs[:, 1] << 4, out=values)


def dequantize_add(out: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bits: int,
                   alpha: float = 1.0) -> None:
    """out += alpha * (what `values` and `scales` stand for), in `out`'s dtype (float32)."""
    n = out.numel()
    with torch.no_grad():
        if bits == 8:
            q = values.float()
        else:
            low = (values & 0xF).to(torch.int16) - 8
            high = (values >> 4).to(torch.int16) - 8
            q = torch.stack([low, high], dim=1).view(-1)[:n].float()
        q_body, q_tail = _blocks(q)
        nb = q_body.shape[0]
        out_body, out_tail = _blocks(out)
        out_body.add_(q_body.mul_(scales[:nb, None]), alpha=alpha)
        if q_tail.numel():
            out_tail.add_(q_tail.mul_(scales[nb]), alpha=alpha)
