"""A small GPT-style language model on real English text: a tensorbus SPEC file.

A byte-level Transformer (2 causal self-attention blocks of width 128, about 0.45M
parameters) learns to predict the next byte of Debian's fortune cookies: the 43 files of
the `fortunes` package, about 2.6 MB of quotations, jokes, poems and definitions, read
from /usr/share/games/fortunes (`apt-get install fortunes`); nothing is downloaded. Every
tenth fortune is held out to evaluate on. Its inner optimizer is AdamW, as in DiLoCo:

    tensorbus local examples/tiny_gpt.py --workers 4 --strategy average --average-every 32 \\
        --outer-lr 0.7 --outer-momentum 0.9 --nesterov --steps 20

evaluate() gives the held-out loss in nats a byte and in bits a byte (`bits_per_byte`):
8 is a uniform guess over the 256 bytes; an order-0 model of English is about 4.5.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tensorbus.run.shards import Shards

# Where Debian's fortunes package installs its files (each a text, fortunes split by "%").
DATA_DIR = Path("/usr/share/games/fortunes")
SEED = 0  # the shuffles of the windows: epoch e uses SEED + e
CONTEXT = 64  # bytes a window; the model predicts each next one
WIDTH, HEADS, BLOCKS = 128, 4, 2
HELD_OUT = 10  # every tenth fortune is held out
EVAL_WINDOWS = 512  # held-out windows evaluate() reads (the first ones, always the same)


@functools.cache
def _texts() -> tuple[bytes, bytes]:
    """The training text and the held-out text, each fortune followed by a newline."""
    files = sorted(p for p in DATA_DIR.glob("*") if p.is_file() and not p.is_symlink()
                   and p.suffix not in (".dat", ".u8"))
    if not files:
        raise FileNotFoundError(f"no fortune files in {DATA_DIR}: install Debian's fortunes "
                                "package (apt-get install fortunes)")
    train: list[bytes] = []
    held: list[bytes] = []
    count = 0
    for path in files:
        for fortune in path.read_bytes().split(b"\n%\n"):
            if fortune.strip():
                (held if count % HELD_OUT == 0 else train).append(fortune.strip(b"\n") + b"\n")
                count += 1
    return b"".join(train), b"".join(held)


def _windows(text: bytes) -> tuple[Tensor, Tensor]:
    """Non-overlapping windows of CONTEXT bytes, and the same shifted by one: the targets."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    count = (len(data) - 1) // CONTEXT
    x = data[:count * CONTEXT].view(count, CONTEXT)
    y = data[1:count * CONTEXT + 1].view(count, CONTEXT)
    return x, y


class Block(nn.Module):
    """Pre-norm causal self-attention, then a 4x MLP, each added to its input."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attention = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, WIDTH)
        self.position = nn.Parameter(torch.zeros(CONTEXT, WIDTH))
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, 256)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        # True above the diagonal: a byte attends to itself and those before it only.
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool, device=tokens.device), 1)
        x = self.embed(tokens) + self.position[:length]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def model() -> nn.Module:
    torch.manual_seed(SEED)
    return TinyGPT()


def data(rank: int, world_size: int, batch_size: int) -> Shards:
    x, y = _windows(_texts()[0])
    return Shards(x, y, rank, world_size, batch_size, seed=SEED)


def loss(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output.reshape(-1, 256), target.reshape(-1))


def optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)  # type: ignore[arg-type]


def evaluate(model: nn.Module) -> dict[str, float]:
    x, y = _windows(_texts()[1])
    x, y = x[:EVAL_WINDOWS], y[:EVAL_WINDOWS]
    device = next(model.parameters()).device
    with torch.no_grad():
        total = sum(F.cross_entropy(model(xb.to(device)).reshape(-1, 256), yb.to(device).reshape(-1),
                                    reduction="sum").item()
                    for xb, yb in zip(x.split(128), y.split(128), strict=True))
    test_loss = total / y.numel()
    return {"test_loss": test_loss, "bits_per_byte": test_loss / math.log(2)}
