"""Part (a) of the benchmark: how fast a tensor crosses from one process to another.

Four ways to move SIZE bytes, each timed the same way (the sender sends REPEATS copies,
the receiver answers once it has all of them, the clock runs from the first send to that
answer), so that their ratios compare like with like:

- `memcpy`: `copy_` into a warm buffer in one process: what the memory can do.
- `zmq-1frame`: raw pyzmq, the tensor as one zero-copy frame (PUSH -> PULL over tcp).
- `zmq-chunked`: raw pyzmq, the tensor as 1 MiB zero-copy frames (the bus's size).
- `tensorbus`: the bus itself: a Push through `tensorbus.bus.codec` and `.transport`
  (`ZmqClient` -> `ZmqServer`), decoded on arrival, every frame checked.

The bus's receiver keeps freed memory for reuse (`tensorbus.run.memory.keep_freed_memory`),
as every tensorbus process does: libzmq allocates each received frame on its I/O thread,
and with glibc's default thresholds the freed frames' pages go back to the system and fault
in again. Raw pyzmq is measured both ways (`kept`), so that a ratio can hold the bus to raw
pyzmq's best with the same process setting, and show what the setting itself is worth.

Each returns GB/s (10^9 bytes per second). Run as a benchmark of its own, it sweeps raw
pyzmq's frame size for one tensor, with and without the receiver keeping freed memory, beside
the bus, round after round (which chunk size the bus should use, and what one frame costs);
it writes benchmarks/results/throughput-{MB}MB.md and .json:

    python -m benchmarks throughput [--mb 128] [--rounds 4]     # about 3 minutes

The sender of each pyzmq and tensorbus run is a fresh process too, as the receiver is:
what one case leaves in a process (heaps, threads, pyzmq's zero-copy garbage collector's
backlog) does not weigh on the next.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import queue
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from benchmarks.report import RESULTS, Meta, write_json, write_markdown

CHUNK = 1 << 20
WAIT_S = 120  # the longest any side waits for the other: a dead peer fails the case


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def memcpy(size: int, repeats: int) -> float:
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.empty(size, dtype=torch.uint8)
    dst.copy_(src)  # warm: every page of both is mapped before the clock starts
    started = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return size * repeats / (time.perf_counter() - started) / 1e9


def _receive(socket: zmq.Socket, what: str) -> list[Any]:
    """One message, within WAIT_S; TimeoutError naming what did not come otherwise."""
    if not socket.poll(WAIT_S * 1000):
        raise TimeoutError(f"no {what} within {WAIT_S} s: the other process is gone or stuck")
    return socket.recv_multipart(copy=False)


def _reap(process: Any) -> None:
    process.join(30)
    if process.is_alive():
        process.kill()
        process.join(5)


def _raw_receiver(port: int, repeats: int, kept: bool) -> None:
    if kept:
        _keep_freed_memory()
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.bind(f"tcp://127.0.0.1:{port}")
    done = context.socket(zmq.PUSH)
    done.connect(f"tcp://127.0.0.1:{port + 1}")
    _receive(pull, "warm-up tensor")
    done.send(b"ready")
    for _ in range(repeats):
        _receive(pull, "tensor")
    done.send(b"done")
    context.destroy(linger=1000)


def raw_zmq(size: int, repeats: int, *, chunk: int | None, kept: bool = False) -> float:
    """Raw pyzmq PUSH -> PULL, zero-copy, one frame or `chunk`-byte frames; with `kept`,
    the receiver keeps freed memory for reuse, as a tensorbus process does."""
    return _fresh(_raw_sender, size, repeats, chunk, kept)


def _keep_freed_memory() -> None:
    from tensorbus.run.memory import keep_freed_memory

    if not keep_freed_memory():
        raise RuntimeError("this C library has no mallopt: the kept cases need glibc")


def _raw_sender(size: int, repeats: int, chunk: int | None, kept: bool) -> float:
    port = _two_ports()
    receiver = mp.get_context("spawn").Process(target=_raw_receiver, args=(port, repeats, kept))
    receiver.start()
    context = zmq.Context()
    try:
        push = context.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{port}")
        done = context.socket(zmq.PULL)
        done.bind(f"tcp://127.0.0.1:{port + 1}")
        data = np.ones(size, dtype=np.uint8)
        step = chunk or size
        frames = [data[i : i + step] for i in range(0, size, step)]
        push.send_multipart(frames, copy=False)
        _receive(done, "word from the receiver")  # the warm-up landed: the receiver is up
        started = time.perf_counter()
        for _ in range(repeats):
            push.send_multipart(frames, copy=False)
        _receive(done, "word from the receiver")
        return size * repeats / (time.perf_counter() - started) / 1e9
    finally:
        context.destroy(linger=0)
        _reap(receiver)


def _bus_receiver(port: int, size: int, repeats: int) -> None:
    from tensorbus.bus.codec import decode
    from tensorbus.bus.transport import ZmqServer, new_event_loop

    _keep_freed_memory()  # as every tensorbus process does (tensorbus.run.cli)

    async def main() -> None:
        server = ZmqServer(f"tcp://127.0.0.1:{port}", max_message_bytes=size + 65536,
                           pub_port=port + 2)
        context = zmq.Context()
        done = context.socket(zmq.PUSH)
        done.connect(f"tcp://127.0.0.1:{port + 1}")
        try:
            async with asyncio.timeout(WAIT_S):
                decode((await server.recv())[1])  # the warm-up
            done.send(b"ready")
            async with asyncio.timeout(WAIT_S):  # for them all: nothing added per message
                for _ in range(repeats):
                    decode((await server.recv())[1])  # let go at once, as raw pyzmq's receiver
            done.send(b"done")
        finally:
            context.destroy(linger=1000)
            server.close()

    new_event_loop().run_until_complete(main())


def tensorbus(size: int, repeats: int) -> float:
    """A Push of one float32 tensor of `size` bytes, through the bus's codec and sockets."""
    return _fresh(_bus_sender, size, repeats)


def _bus_sender(size: int, repeats: int) -> float:
    from tensorbus.bus.codec import encode
    from tensorbus.bus.messages import Push
    from tensorbus.bus.transport import ZmqClient, new_event_loop

    port = _two_ports(3)
    receiver = mp.get_context("spawn").Process(target=_bus_receiver, args=(port, size, repeats))
    receiver.start()
    tensor = torch.ones(size // 4, dtype=torch.float32)

    async def main() -> float:
        client = ZmqClient(f"tcp://127.0.0.1:{port}", max_message_bytes=size + 65536)
        context = zmq.Context()
        done = context.socket(zmq.PULL)
        done.bind(f"tcp://127.0.0.1:{port + 1}")
        try:
            push = Push(clock=0, loss=0.0, samples=1, tensors=(tensor,))
            await client.send(encode(push))
            # The warm-up landed: the receiver is up.
            await asyncio.to_thread(_receive, done, "word from the receiver")
            started = time.perf_counter()
            for _ in range(repeats):
                await client.send(encode(push))
            await asyncio.to_thread(_receive, done, "word from the receiver")
            return size * repeats / (time.perf_counter() - started) / 1e9
        finally:
            context.destroy(linger=0)
            client.close()

    loop = new_event_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()
        _reap(receiver)


def _fresh(sender: Callable[..., float], *args: Any) -> float:
    """`sender(*args)` run in a new process: its result."""
    context = mp.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_report, args=(results, sender, args))
    process.start()
    try:
        gbps, error = results.get(timeout=600)
    except queue.Empty:
        raise RuntimeError(f"{sender.__name__}{args[:2]} gave no result within 600 s") from None
    finally:
        _reap(process)
    if error:
        raise RuntimeError(f"{sender.__name__}{args} failed: {error}")
    return float(gbps)


def _report(results: Any, sender: Callable[..., float], args: tuple[Any, ...]) -> None:
    try:
        results.put((sender(*args), ""))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((0.0, f"{type(e).__name__}: {e}"))


def _two_ports(n: int = 2) -> int:
    """A port whose next n-1 ports are free too (tried, not guaranteed)."""
    for _ in range(100):
        port = free_port()
        if port + n < 65536 and all(_is_free(port + i) for i in range(1, n)):
            return port
    raise OSError("no run of free ports on loopback")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def measure(size: int, repeats: int) -> dict[str, Any]:
    """Every way, for one size: GB/s by name."""
    return {
        "memcpy": memcpy(size, repeats),
        "zmq-1frame": raw_zmq(size, repeats, chunk=None),
        "zmq-chunked": raw_zmq(size, repeats, chunk=CHUNK),
        "tensorbus": tensorbus(size, repeats),
    }


SWEEP = (None, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20)  # frame sizes; None: one frame
KEPT_SWEEP = (None, 512 << 10, 1 << 20)  # the same, the receiver keeping freed memory


def main(argv: Sequence[str], meta: Meta) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks throughput",
                                     description="raw pyzmq throughput by frame size, and the bus")
    parser.add_argument("--mb", type=int, default=128, help="tensor size in MiB")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    size = args.mb << 20
    repeats = max(8, 1024 // args.mb)
    names = ([f"{c >> 10} KiB frames" if c else "one frame" for c in SWEEP]
             + [f"{c >> 10} KiB, kept" if c else "one frame, kept" for c in KEPT_SWEEP]
             + ["tensorbus"])
    lines = [(f"{args.mb} MiB, GB/s, {repeats} tensors a case; \"kept\": the receiver keeps freed "
              "memory, as a tensorbus process does"), "",
             "| round | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    print("\n".join(lines))
    rounds = []
    for r in range(args.rounds):  # interleaved: a noisy moment slows one round of all
        figures = ([raw_zmq(size, repeats, chunk=c) for c in SWEEP]
                   + [raw_zmq(size, repeats, chunk=c, kept=True) for c in KEPT_SWEEP]
                   + [tensorbus(size, repeats)])
        rounds.append(dict(zip(names, figures, strict=True)))
        lines.append(f"| {r + 1} | " + " | ".join(f"{g:.2f}" for g in figures) + " |")
        print(lines[-1], flush=True)
    # The bus against raw pyzmq's fastest way, within each round.
    best = [f["tensorbus"] / max(v for k, v in f.items() if k != "tensorbus") for f in rounds]
    lines += ["", (f"tensorbus / raw pyzmq's fastest way in the same round: median "
                   f"{statistics.median(best):.2f} (min {min(best):.2f}, max {max(best):.2f})")]
    name = f"throughput-{args.mb}MB"
    write_json(args.out / f"{name}.json", {"mb": args.mb, "repeats": repeats, "rounds": rounds}, meta)
    write_markdown(args.out / f"{name}.md", "\n".join(lines), meta)
    print(lines[-1])
