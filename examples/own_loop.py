"""A plain PyTorch training script, with its own loop, made a tensorbus one by four lines.

Its argparse, its per-epoch test, its logging and its checkpoints are its own; the lines
marked `# tensorbus` are all it adds (scikit-learn's digits and a small MLP: examples/digits.py).

    python examples/own_loop.py --epochs 3                      # alone, as any script
    tensorbus launch examples/own_loop.py --workers 2 -- --epochs 3
    tensorbus launch examples/own_loop.py --workers 4 --strategy async -- --epochs 3

Across machines: `tensorbus coordinator --workers N` on one, and on each
`TENSORBUS_COORDINATOR=tcp://HOST:PORT torchrun --nproc-per-node G examples/own_loop.py`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import digits  # noqa: E402 - the model and data of examples/digits.py

import tensorbus  # noqa: E402 - tensorbus

log = logging.getLogger("own_loop")


def test(model: torch.nn.Module) -> tuple[float, float]:
    """Mean loss and accuracy on the held-out digits."""
    figures = digits.evaluate(model)
    return figures["test_loss"], figures["accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description="digits, with a loop of its own")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--gamma", type=float, default=1.0, help="the lr's factor after each epoch")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="backward passes a step: each batch in as many parts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-interval", type=int, default=20, help="batches between logs")
    parser.add_argument("--save", type=Path, help="write the model's state_dict here each epoch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    ctx = tensorbus.init()  # tensorbus: where this process stands (a world of one alone)
    torch.manual_seed(args.seed)
    model = digits.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    optimizer = tensorbus.DistributedOptimizer(  # tensorbus
        optimizer, model, backward_passes_per_step=args.accumulate)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
    batches = digits.data(ctx.rank, ctx.world_size, args.batch_size)  # tensorbus: this rank's shard

    for epoch in range(1, args.epochs + 1):
        model.train()
        for i, (x, y) in enumerate(batches):
            optimizer.zero_grad()
            loss = 0.0
            for part_x, part_y in zip(x.chunk(args.accumulate), y.chunk(args.accumulate),
                                      strict=True):
                # Each part's share of the batch's mean loss: their gradients add up to it.
                part = F.cross_entropy(model(part_x), part_y) * (len(part_y) / len(y))
                part.backward()
                loss += part.item()
            optimizer.step()
            if i % args.log_interval == 0:
                log.info("rank %d epoch %d batch %d loss %.4f", ctx.rank, epoch, i, loss)
        scheduler.step()
        test_loss, accuracy = test(model)
        log.info("rank %d epoch %d: test loss %.4f, accuracy %.2f %%", ctx.rank, epoch,
                 test_loss, 100 * accuracy)
        if args.save is not None and ctx.rank == 0:
            torch.save(model.state_dict(), args.save)
    optimizer.close()  # tensorbus: leave the run (also done at exit)


if __name__ == "__main__":
    main()
