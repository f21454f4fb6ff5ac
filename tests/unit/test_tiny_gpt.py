"""examples/tiny_gpt.py, the language model of Debian's fortunes: its text split, its
windows, its causal attention, and that a few AdamW steps in one process learn."""

from __future__ import annotations

import pytest
import torch
from specs import load_example

pytestmark = pytest.mark.timeout(30)

gpt = load_example("tiny_gpt")
if not gpt.DATA_DIR.is_dir():
    pytest.skip(f"needs Debian's fortunes package ({gpt.DATA_DIR})", allow_module_level=True)


def test_every_tenth_fortune_is_held_out_and_the_windows_are_shifted_by_one() -> None:
    train, held = gpt._texts()
    assert len(train) > 2_000_000 and 8 * len(held) < len(train) < 10 * len(held)
    assert train.endswith(b"\n") and held.endswith(b"\n")
    x, y = gpt._windows(train)
    assert x.shape == y.shape and x.shape[1] == gpt.CONTEXT
    assert torch.equal(x[0, 1:], y[0, :-1]) and torch.equal(y[0, -1:], x[1, :1])
    batches = gpt.data(1, 2, 8)
    first_x, first_y = next(iter(batches))
    assert first_x.shape == (8, gpt.CONTEXT) and first_x.dtype == torch.int64


def test_a_byte_sees_only_the_bytes_before_it() -> None:
    model = gpt.model().eval()
    tokens = torch.randint(0, 256, (1, gpt.CONTEXT))
    changed = tokens.clone()
    changed[0, 40:] = (changed[0, 40:] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.allclose(a[0, :40], b[0, :40], atol=1e-6)  # before the change: the same
    assert not torch.allclose(a[0, 40:], b[0, 40:])


def test_a_few_adamw_steps_learn_the_bytes_of_english() -> None:
    torch.manual_seed(0)
    model = gpt.model()
    before = gpt.evaluate(model)
    assert 7.5 < before["bits_per_byte"] < 8.5  # about a uniform guess over 256 bytes
    optimizer = gpt.optimizer(model.parameters())
    for step, (x, y) in enumerate(gpt.data(0, 1, 32)):
        optimizer.zero_grad()
        gpt.loss(model(x), y).backward()
        optimizer.step()
        if step == 10:
            break
    after = gpt.evaluate(model)
    assert after["bits_per_byte"] < 5.0, after  # the frequent bytes of English, at least (4.5)
