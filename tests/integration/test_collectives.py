"""Collectives for custom loops (`nodes.collectives`, `nodes.rendezvous`), in layers:

- the wire: the Collective and Result kinds round-trip any allowed tensor, and hostile
  headers are refused by the codec (no sockets);
- the rendezvous: invalid or out-of-turn calls get coded Rejects and change nothing (one
  loop, real ZeroMQ on a random loopback port);
- groups of ranks in threads of this process: every op and dtype against the same reduction
  done here, deadlines, mismatches, keys;
- processes: tensorbus against torch.distributed on gloo on the same inputs, and the
  custom-loop example.
"""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zygote

from tensorbus.bus.codec import CHUNK_BYTES, MAX_TENSORS, decode, encode
from tensorbus.bus.errors import (
    ByteLengthError,
    DtypeError,
    MalformedHeaderError,
    PeerTimeoutError,
)
from tensorbus.bus.messages import Collective, Pull, Reject, Result
from tensorbus.bus.pieces import Pieces, whole
from tensorbus.bus.security import load_client_keys, load_server_keys, make_keys
from tensorbus.bus.transport import ZmqClient, new_event_loop
from tensorbus.nodes import CollectiveMismatchError, Group, GroupFailedError, GroupServer
from tensorbus.nodes.rendezvous import Rendezvous, tensor_spec

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 10.0  # collectives in tests that are not about deadlines


def received(frames: list[Any]) -> list[Any]:
    return [bytes(frames[0]), *(bytearray(memoryview(f)) for f in frames[1:])]


def free_port() -> int:
    """A port free now, for a rank that hosts the rendezvous by binding it: what is under
    test there is a bind to the port given. (Another process may take it before: tests not
    of that bind use a GroupServer on port 0, which keeps the port it gets.)"""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def in_threads(size: int, endpoint: str, body: Callable[[Group], Any], *, host: bool = True,
               join: dict[str, Any] | None = None) -> list[Any]:
    """Run `body(group)` on `size` ranks, one thread each; each rank's result or exception."""
    results: list[Any] = [None] * size

    def rank(r: int) -> None:
        try:
            options = {"timeout": TIMEOUT, "join_timeout": TIMEOUT, **(join or {})}
            with Group.join(endpoint, rank=r, size=size, host=host and r == 0,
                            **options) as group:
                results[r] = body(group)
        except Exception as e:  # noqa: BLE001 - handed to the test, which checks it
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a rank hung"
    return results


# The wire ------------------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("dtype", "shape"), [
    (torch.float32, (3, 4, 5)), (torch.bfloat16, ()), (torch.int8, (0, 7)),
    (torch.bool, (9,)), (torch.float64, (2, 1, 1, 1, 1, 1, 1, 3)),
], ids=str)
def test_collective_and_result_carry_any_shape_and_dtype(dtype: torch.dtype,
                                                         shape: tuple[int, ...]) -> None:
    tensor = (torch.arange(max(1, torch.Size(shape).numel())) % 3)[: torch.Size(shape).numel()]
    tensor = tensor.to(dtype).reshape(shape)
    call = Collective(sender=1, request=4, op="allgather", seq=3, size=2, timeout_s=5.0,
                      spec=tensor_spec(tensor), tensors=(tensor,))
    got = decode(received(encode(call)))
    assert got == call and torch.equal(got.tensors[0], tensor)
    gathered = tensor.reshape(1, -1).expand(2, -1).contiguous()
    result = Result(request=4, seq=3, tensors=(gathered,))
    got = decode(received(encode(result)))
    assert got == result and torch.equal(got.tensors[0], gathered)


@pytest.mark.timeout(10)
def test_large_tensors_travel_in_frames_and_come_back_whole() -> None:
    tensor = torch.randn(CHUNK_BYTES // 4 * 2 + 5)
    frames = encode(Result(request=1, seq=1, tensors=(tensor,)))
    assert len(frames) == 1 + 3
    got = decode(received(frames)).tensors[0]
    assert isinstance(got, Pieces) and torch.equal(whole(got), tensor)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("op", 3, "field 'op' must be str"),
    ("seq", "7", "field 'seq' must be int"),
    ("size", 2.0, "field 'size' must be int"),
    ("timeout_s", "5", "field 'timeout_s' must be float"),
    ("root", None, "field 'root' must be int"),
    ("host", ["node"], "field 'host' must be str"),
])
def test_a_collective_with_a_field_of_the_wrong_type_is_refused(field: str, value: object,
                                                               fragment: str) -> None:
    frames = received(encode(Collective(sender=0, request=1, op="barrier", seq=1, size=2,
                                        timeout_s=5.0)))
    header = msgpack.unpackb(frames[0], raw=False)
    header["f"][field] = value
    with pytest.raises(MalformedHeaderError, match=re.escape(fragment)):
        decode([msgpack.packb(header, use_bin_type=True)])


@pytest.mark.timeout(10)
def test_hostile_collective_headers_are_refused_before_any_tensor_is_built() -> None:
    tensor = torch.zeros(4)
    frames = received(encode(Collective(sender=0, request=1, op="allreduce", seq=1, size=2,
                                        timeout_s=5.0, spec="float32[4]", reduce="sum",
                                        tensors=(tensor,))))
    header = msgpack.unpackb(frames[0], raw=False)

    def mutated(change: Callable[[dict[str, Any]], None]) -> list[Any]:
        copy = msgpack.unpackb(frames[0], raw=False)
        change(copy)
        return [msgpack.packb(copy, use_bin_type=True), *frames[1:]]

    with pytest.raises(MalformedHeaderError, match="unexpected"):
        decode(mutated(lambda h: h["f"].update(extra=1)))
    with pytest.raises(MalformedHeaderError, match="missing"):
        decode(mutated(lambda h: h["f"].pop("spec")))
    with pytest.raises(DtypeError):
        decode(mutated(lambda h: h["t"][0].__setitem__(0, "complex64")))
    with pytest.raises(ByteLengthError):
        decode(mutated(lambda h: h["t"][0].__setitem__(1, [5])))
    with pytest.raises(MalformedHeaderError, match="tensors, at most"):
        decode(mutated(lambda h: h.__setitem__("t", [h["t"][0]] * (MAX_TENSORS + 1))))
    assert decode(frames).op == header["f"]["op"]  # the unchanged one passes


# The rendezvous, on its own ------------------------------------------------------------


@pytest.mark.timeout(20)
def test_the_rendezvous_refuses_invalid_calls_with_a_code_and_goes_on() -> None:
    async def scenario() -> None:
        server = Rendezvous("tcp://127.0.0.1:0", size=2)
        server.start()
        a = ZmqClient(server.endpoint, max_message_bytes=1 << 20)
        b = ZmqClient(server.endpoint, max_message_bytes=1 << 20)

        async def ask(client: ZmqClient, message: Any) -> Any:
            frames = message if isinstance(message, list) else encode(message)
            await client.send(frames)
            return decode(await asyncio.wait_for(client.recv(), 5))

        def call(rank: int, op: str, seq: int, **fields: Any) -> Collective:
            fields = {"size": 2, "timeout_s": 5.0, **fields}
            return Collective(sender=rank, request=seq + 1, op=op, seq=seq, **fields)

        try:
            refusals = [
                (a, [b"\x92garbage"], "malformed"),
                (a, Pull(sender=0, request=9), "unexpected"),
                (a, call(0, "barrier", 1), "unknown_worker"),  # not joined
                (a, call(5, "join", 0), "malformed"),  # no rank 5 in a group of 2
                (a, call(0, "shuffle", 1), "malformed"),
                (a, call(0, "join", 0, spec="float32[1]"), "malformed"),
            ]
            for client, message, code in refusals:
                reply = await ask(client, message)
                assert isinstance(reply, Reject) and reply.code == code, (message, reply)
            join = asyncio.ensure_future(ask(a, call(0, "join", 0)))
            await asyncio.sleep(0.05)
            taken = await ask(b, call(0, "join", 0))  # rank 0 from another process
            assert isinstance(taken, Reject) and taken.code == "rank_taken"
            joined = await asyncio.gather(join, ask(b, call(1, "join", 0)))
            assert [r.outcome for r in joined] == ["done", "done"]
            assert joined[0].tensors[0].tolist() == [0, 0]  # one host
            lie = call(0, "allreduce", 1, spec="float32[3]", reduce="sum",
                       tensors=(torch.zeros(2),))
            int_mean = call(0, "allreduce", 1, spec="int64[2]", reduce="mean",
                            tensors=(torch.zeros(2, dtype=torch.int64),))
            for message in (lie, int_mean, call(1, "barrier", 5)):
                reply = await ask(a if message.sender == 0 else b, message)
                assert isinstance(reply, Reject), reply
            assert server.rejected == {"malformed": 6, "unexpected": 2, "unknown_worker": 1,
                                       "rank_taken": 1}
            # Nothing was taken: both ranks are still at collective 1, which works.
            done = await asyncio.gather(ask(a, call(0, "barrier", 1)), ask(b, call(1, "barrier", 1)))
            assert [r.outcome for r in done] == ["done", "done"] and server.completed == 2
        finally:
            a.close()
            b.close()
            await server.close()

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(scenario())


# Groups of ranks in threads ------------------------------------------------------------


def _inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [
        torch.randn(10, generator=g),
        torch.randn(4, 3, generator=g, dtype=torch.float64).t(),  # not contiguous
        torch.randn(5, generator=g).to(torch.bfloat16),
        torch.randint(-50, 50, (6,), generator=g, dtype=torch.int32),
        torch.tensor(float(rank)),  # 0-d
        torch.empty(0, 3),
        torch.randn(CHUNK_BYTES // 4 + 100, generator=g),  # two frames each way
    ]


def _reduced(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    """What the rendezvous must compute: in rank order, in the dtype."""
    out = tensors[0].clone()
    for t in tensors[1:]:
        out = {"sum": torch.add, "mean": torch.add, "max": torch.maximum,
               "min": torch.minimum}[op](out, t)
    return out / len(tensors) if op == "mean" else out


@pytest.mark.timeout(30)
def test_three_ranks_in_threads_agree_with_the_reduction_done_here() -> None:
    size = 3

    def body(group: Group) -> dict[str, Any]:
        out: dict[str, Any] = {"local": (group.local_rank, group.local_size)}
        for op in ("sum", "mean", "max", "min"):
            out[op] = [group.allreduce(t, op=op) for t in _inputs(group.rank)
                       if op != "mean" or t.is_floating_point()]
        out["broadcast"] = [group.broadcast(t, src=src) for src in range(size)
                            for t in _inputs(group.rank)]
        out["allgather"] = [group.allgather(t) for t in _inputs(group.rank)]
        weight = torch.nn.Parameter(torch.full((3,), float(group.rank)))
        out["param"] = group.allreduce(weight, op="sum") is weight and weight.tolist()
        group.barrier()
        return out

    results = in_threads(size, f"tcp://127.0.0.1:{free_port()}", body)
    for r, result in enumerate(results):
        assert not isinstance(result, Exception), f"rank {r}: {result!r}"
        assert result["local"] == (r, size)
        inputs = [_inputs(q) for q in range(size)]
        for op in ("sum", "mean", "max", "min"):
            want = [_reduced([inputs[q][i] for q in range(size)], op)
                    for i in range(len(inputs[0])) if op != "mean" or inputs[0][i].is_floating_point()]
            assert len(result[op]) == len(want)
            for got, expected in zip(result[op], want, strict=True):
                assert got.dtype == expected.dtype and torch.equal(got, expected), op
        assert all(torch.equal(got, inputs[i // len(inputs[0])][i % len(inputs[0])])
                   for i, got in enumerate(result["broadcast"]))
        for i, gathered in enumerate(result["allgather"]):
            assert [t.shape for t in gathered] == [inputs[q][i].shape for q in range(size)]
            assert all(torch.equal(t, inputs[q][i]) for q, t in enumerate(gathered))
        assert result["param"] == [3.0, 3.0, 3.0]


@pytest.mark.timeout(20)
def test_a_rank_that_never_calls_is_named_within_the_timeout() -> None:
    size, timeout = 3, 1.0
    gave_up = threading.Semaphore(0)

    def body(group: Group) -> Any:
        if group.rank == 2:  # never calls the allreduce; closes once the others gave up
            for _ in range(2):
                gave_up.acquire(timeout=15)
            return None
        began = time.monotonic()
        try:
            with pytest.raises(PeerTimeoutError) as info:
                group.allreduce(torch.ones(4), timeout=timeout)
            took = time.monotonic() - began
            with pytest.raises(GroupFailedError):
                group.barrier()  # the group is spent
            return info.value, took
        finally:
            gave_up.release()

    with GroupServer("tcp://127.0.0.1:0", size=size) as server:
        results = in_threads(size, server.endpoint, body, host=False)
    for rank in (0, 1):
        assert isinstance(results[rank], tuple), results[rank]
        error, took = results[rank]
        assert error.peer == "rank 2" and error.seconds == timeout
        assert "rank 2 did not answer allreduce(float32[4], sum) as collective 1" in str(error)
        assert timeout * 0.9 < took < timeout + 1.0
    assert results[2] is None


@pytest.mark.timeout(10)
def test_a_missing_rendezvous_is_named_and_never_waited_on_forever() -> None:
    with socket.socket() as bound:  # bound and kept, never listening: nobody answers there
        bound.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{bound.getsockname()[1]}"
        began = time.monotonic()
        with pytest.raises(PeerTimeoutError) as info:
            Group.join(endpoint, rank=1, size=2, join_timeout=0.5)
    assert time.monotonic() - began < 3.0
    assert info.value.peer == f"the rendezvous at {endpoint}"
    assert "join(size=2) as collective 0" in str(info.value)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("calls", "words"), [
    ({0: ("allreduce", torch.zeros(10)), 1: ("broadcast", torch.zeros(10))},
     ["allreduce(float32[10], sum)", "broadcast(float32[10], src=0)"]),
    ({0: ("allreduce", torch.zeros(10)), 1: ("allreduce", torch.zeros(11))},
     ["allreduce(float32[10], sum)", "allreduce(float32[11], sum)"]),
    ({0: ("allgather", torch.zeros(2, 2)), 1: ("allgather", torch.zeros(2, 2, dtype=torch.int64))},
     ["allgather(float32[2, 2])", "allgather(int64[2, 2])"]),
    ({0: ("barrier", None), 1: ("allgather", torch.zeros(1))},
     ["barrier()", "allgather(float32[1])"]),
], ids=["op", "shape", "dtype", "barrier"])
def test_ranks_calling_different_things_fail_alike_with_who_called_what(
        calls: dict[int, tuple[str, torch.Tensor | None]], words: list[str]) -> None:
    def body(group: Group) -> Any:
        group.barrier()  # collective 1; the mismatch is number 2
        op, tensor = calls[group.rank]
        with pytest.raises(CollectiveMismatchError) as info:
            getattr(group, op)(*(() if tensor is None else (tensor,)))
        with pytest.raises(GroupFailedError):
            group.barrier()
        return str(info.value)

    with GroupServer("tcp://127.0.0.1:0", size=2) as server:
        results = in_threads(2, server.endpoint, body, host=False)
    assert results[0] == results[1], results
    message = results[0]
    assert re.fullmatch(r"rank [01] called .* as collective 2 where rank [01] called .*", message)
    assert all(word in message for word in words), message


@pytest.mark.timeout(20)
def test_a_rank_started_with_another_size_fails_the_join_for_everyone() -> None:
    errors: dict[int, Exception] = {}
    with GroupServer("tcp://127.0.0.1:0", size=2) as server:
        def rank(r: int, size: int) -> None:
            try:
                Group.join(server.endpoint, rank=r, size=size, host=False, join_timeout=TIMEOUT)
            except Exception as e:  # noqa: BLE001 - the test checks it
                errors[r] = e
        threads = [threading.Thread(target=rank, args=(0, 2)), threading.Thread(target=rank, args=(1, 3))]
        began = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
    assert time.monotonic() - began < TIMEOUT / 2
    assert {type(e) for e in errors.values()} == {CollectiveMismatchError}, errors
    assert all("rank 1 was started with size=3" in str(e) and "size=2" in str(e)
               for e in errors.values())


@pytest.mark.timeout(20)
def test_arguments_are_checked_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="rank must be in"):
        Group.join("tcp://127.0.0.1:1", rank=2, size=2)
    with pytest.raises(ValueError, match="insecure=True"):
        Group.join("tcp://0.0.0.0:1", rank=0, size=1)
    with Group.join("tcp://127.0.0.1:0", rank=0, size=1) as group:  # a group of one
        with pytest.raises(ValueError, match="'median' is not a valid ReduceOp"):
            group.allreduce(torch.ones(2), op="median")
        with pytest.raises(ValueError, match="floating-point"):
            group.allreduce(torch.ones(2, dtype=torch.int64), op="mean")
        with pytest.raises(ValueError, match="src must be in"):
            group.broadcast(torch.ones(2), src=1)
        assert group.allreduce(torch.ones(2), op="mean").tolist() == [1.0, 1.0]  # still fine
        assert [t.tolist() for t in group.allgather(torch.ones(2))] == [[1.0, 1.0]]
    with pytest.raises(GroupFailedError, match="closed"):
        group.barrier()


@pytest.mark.timeout(30)
def test_with_curve_keys_only_authorized_ranks_get_in(tmp_path: Path) -> None:
    make_keys(tmp_path / "ours")
    make_keys(tmp_path / "theirs")
    server_keys = load_server_keys(tmp_path / "ours")
    with GroupServer("tcp://127.0.0.1:0", size=1, keys=server_keys) as server:
        with pytest.raises(PeerTimeoutError, match="the rendezvous at"):
            Group.join(server.endpoint, rank=0, size=1, host=False, join_timeout=0.5,
                       keys=load_client_keys(tmp_path / "theirs"))
        assert server.completed == 0
    keys = {"keys": load_client_keys(tmp_path / "ours"), "server_keys": server_keys}
    results = in_threads(2, f"tcp://127.0.0.1:{free_port()}",
                         lambda g: g.allreduce(torch.full((3,), g.rank + 1.0)).tolist(), join=keys)
    assert results == [[3.0, 3.0, 3.0]] * 2


# Processes -----------------------------------------------------------------------------


@pytest.mark.system  # it starts processes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 3])
def test_processes_get_what_gloo_computes_on_the_same_inputs(size: int, tmp_path: Path) -> None:
    ports = [str(free_port()), str(free_port())]
    ranks = [zygote.shared().popen(
        [str(r), str(size), *ports, str(tmp_path)], script=ROOT / "tests" / "collectives_peer.py",
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(size)]
    try:
        outputs = [rank.communicate(timeout=50)[0] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    assert [rank.returncode for rank in ranks] == [0] * size, "\n".join(outputs)
    saved = [torch.load(tmp_path / f"rank{r}.pt") for r in range(size)]
    for r, both in enumerate(saved):
        ours, gloo = both["tensorbus"], both["gloo"]
        for kind in ("broadcast", "allgather", "max"):
            assert len(ours[kind]) == len(gloo[kind]) > 0
            assert all(torch.equal(a, b) for a, b in zip(ours[kind], gloo[kind], strict=True)), (r, kind)
        for kind in ("sum", "mean"):
            assert len(ours[kind]) == len(gloo[kind]) > 0
            for a, b in zip(ours[kind], gloo[kind], strict=True):
                assert a.dtype == b.dtype
                if a.is_floating_point() and size > 2:  # three terms: gloo may add in another order
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
                else:
                    assert torch.equal(a, b), (r, kind)
        # Reduced in rank order at one place: every rank holds the very same bytes.
        for kind in ("sum", "mean"):
            first = saved[0]["tensorbus"][kind]
            assert all(torch.equal(a, b) for a, b in zip(ours[kind], first, strict=True))


@pytest.mark.system  # it starts processes
@pytest.mark.timeout(60)
def test_the_custom_loop_example_ends_with_the_same_weights_on_every_rank() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "custom_loop.py"), "--world-size", "2",
         "--steps", "15", "--timeout", "50"],
        cwd=ROOT, capture_output=True, text=True, timeout=55, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2, done.stdout
    pattern = (r"rank (\d)/2: steps 15, last loss ([\d.]+), accuracy ([\d.]+), "
               r"weights ([0-9a-f]{16}), identical on all ranks: True")
    found = [re.fullmatch(pattern, line) for line in lines]
    assert all(found), lines
    assert [m.group(1) for m in found if m] == ["0", "1"]
    assert len({m.groups()[1:] for m in found if m}) == 1, lines  # loss, accuracy, weights
