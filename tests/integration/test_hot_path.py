"""The hot path allocates no gradient-sized buffer per step, on the worker or the coordinator.

Every torch operation is watched (a TorchDispatchMode) while the real code of one training
step runs, bytes moving through real ZeroMQ sockets on loopback:

- worker: zero the flat gradient, gather it after backward, encode the Push, send it;
  receive the next Weights, decode them, load them into the model;
- coordinator: receive and decode the Push, check it is finite, average it into the
  gradient buffer, step the optimizer (SGD with momentum), copy the weights into a snapshot
  from the pool and encode it for broadcast.

The first steps may allocate (the optimizer's momentum, the pool's snapshot sets); after
them, no operation may create storage of 64 KiB or more. Forward and backward are the
model's own business (autograd allocates each parameter's new gradient before adding it
into `.grad`) and run outside the watch. Received frames are libzmq's: chunks of
`CHUNK_BYTES`, allocated by libzmq's malloc, which reuses them; they are not torch storage.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zmq
from allocations import Allocations
from torch import nn

from tensorbus.bus.codec import CHUNK_BYTES, decode, encode
from tensorbus.bus.messages import Push, Weights
from tensorbus.bus.pieces import Pieces, all_finite
from tensorbus.nodes import Coordinator, CoordinatorConfig
from tensorbus.nodes.flat import FlatModel
from tensorbus.strategies import Sync

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)

def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))


def test_the_watch_sees_an_allocation() -> None:
    """The check can fail: a fresh gradient-sized tensor is seen."""
    grads = FlatModel(model()).grads
    with Allocations() as watch:
        _ = grads[0] * 2
    assert watch.seen and watch.seen[0][1] == grads[0].numel() * 4


def test_no_step_after_the_first_allocates_a_gradient_sized_buffer() -> None:
    worker = FlatModel(model())
    coordinator = Coordinator(
        model=model(), strategy=Sync(workers=1),
        # Its weight sets in private memory: sets in shared memory are mappings, which
        # this watch does not see (tests/integration/test_shared.py counts those).
        config=CoordinatorConfig(batch_size=8, steps=100, shared_memory=False),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    )
    layout = worker.layout
    assert layout.nbytes > 2 * CHUNK_BYTES  # so that tensors travel in several frames
    x, y = torch.randn(8, 512), torch.randn(8, 512)
    context = zmq.Context()
    try:
        up, down = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
        port = up.bind_to_random_port("tcp://127.0.0.1")
        down.connect(f"tcp://127.0.0.1:{port}")
        for step in range(6):
            # As the worker does: the hooks copy each fresh gradient into the flat buffer.
            worker.begin_backward()
            nn.functional.mse_loss(worker.module(x), y).backward()  # the model's own work
            with Allocations() as watch:
                worker.gather_grads()
                up.send_multipart(encode(Push(clock=step, loss=1.0, samples=8,
                                              tensors=worker.grads)), copy=False)
                push = decode(down.recv_multipart(copy=False), layout=layout)
                assert isinstance(push.tensors[0], Pieces)
                assert all(all_finite(t) for t in push.tensors)
                coordinator.master.step([push.tensors], 1.0, version=step + 1)
                snapshot = coordinator.master.copy()
                down.send_multipart(encode(Weights(version=step + 1, tensors=snapshot)), copy=False)
                weights = decode(up.recv_multipart(copy=False), layout=layout)
                worker.load(weights.tensors)
                coordinator.master.pool.release(snapshot, [])
            if step == 0:  # the momentum buffers and a snapshot set are made: seen
                assert {nbytes for _, nbytes in watch.seen} >= {512 * 512 * 4, layout.nbytes}
            if step >= 2:  # they exist by now
                assert watch.seen == [], f"step {step} allocated {watch.seen}"
        # And the step did what it should: the worker holds the coordinator's weights.
        assert all(torch.equal(a, b) for a, b in zip(worker.weights, coordinator.flat.weights,
                                                     strict=True))
    finally:
        context.destroy(linger=0)



def test_glibc_takes_the_request_to_keep_freed_memory() -> None:
    """run.memory asks glibc's malloc to keep freed blocks; glibc accepts the settings."""
    from tensorbus.run.memory import keep_freed_memory

    assert keep_freed_memory()


# One process computing the 10M-parameter benchmark MLP's gradient off its main thread, as
# a worker does; it prints the page faults of each step's compute thread.
_STEPS = """
import resource, sys, concurrent.futures
import torch
from torch import nn
from tensorbus.nodes.flat import FlatModel
from tensorbus.run.memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(784, 2820), nn.ReLU(), nn.Linear(2820, 2820), nn.ReLU(),
                      nn.Linear(2820, 10))
flat = FlatModel(model)
x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
def step():
    flat.begin_backward()
    nn.functional.cross_entropy(model(x), y).backward()
    flat.gather_grads()
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
with concurrent.futures.ThreadPoolExecutor(1) as pool:
    faults = [pool.submit(step).result() for _ in range(25)]
print(*[b - a for a, b in zip(faults, faults[1:])])
"""


@pytest.mark.system  # it starts processes
@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, Linux")
def test_a_compute_thread_reuses_the_gradient_memory_of_the_step_before() -> None:
    """Autograd allocates each step's gradients afresh, on the compute thread: after a few
    steps, that memory is the last step's, not new pages (each new page is a fault and a
    page the kernel clears). Without the top pad of run.memory, the 32 MB gradient of the
    middle layer takes a heap of its own that glibc unmaps when it is freed: 7767 faults
    on about half the steps, measured; with it, none once warm."""
    done = subprocess.run([sys.executable, "-c", _STEPS, "keep"], cwd=ROOT, capture_output=True,
                          text=True, timeout=100, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    faults = [int(n) for n in done.stdout.split()]
    page = resource.getpagesize()
    gradient_pages = 2820 * 2820 * 4 // page
    # Steps 11 to 24: not one more gradient's worth of new pages in all of them.
    assert sum(faults[10:]) < gradient_pages, faults
