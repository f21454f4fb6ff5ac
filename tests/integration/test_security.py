"""CURVE keys and ZAP authentication: the key directory, and who gets through the wire.

Unit tests make and load keys in a temporary directory. Integration tests run a keyed
ZmqServer on a random loopback port with an authorized worker, a stranger (a valid key pair
the coordinator does not list) and a plain peer (no CURVE), and check that only the worker
is heard, that the outsiders do not slow it down, and that its bytes on the wire are not
plaintext.
"""

from __future__ import annotations

import asyncio
import contextlib
import stat
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from tensorbus.bus.security import (
    ClientKeys,
    KeysError,
    ServerKeys,
    load_client_keys,
    load_server_keys,
    make_keys,
)
from tensorbus.bus.transport import ZmqClient, ZmqServer

LIMIT = 1 << 20
WINDOW_S = 1.0  # how long an outsider gets to try; loopback handshakes take milliseconds


# --- keys ------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_make_keys_writes_the_layout_with_private_secrets(tmp_path: Path) -> None:
    make_keys(tmp_path, ["w0", "w1"])
    for name in ("coordinator", "w0", "w1"):
        assert (tmp_path / f"{name}.key").is_file()
        assert stat.S_IMODE((tmp_path / f"{name}.key_secret").stat().st_mode) == 0o600
    assert sorted(p.name for p in (tmp_path / "authorized").iterdir()) == ["w0.key", "w1.key"]
    assert not list(tmp_path.glob(".keys-*"))  # no staging left behind

    server = load_server_keys(tmp_path)
    w0 = load_client_keys(tmp_path, "w0")
    w1 = load_client_keys(tmp_path, "w1")
    assert server.authorized == {w0.public, w1.public}
    assert w0.server_public == w1.server_public == server.public
    assert len(server.public) == len(server.secret) == 40  # Z85 text, as zmq.auth writes
    assert server.directory == tmp_path
    assert server.secret.decode() not in repr(server) + repr(w0)
    assert w0.secret.decode() not in repr(server) + repr(w0)


@pytest.mark.timeout(10)
def test_make_keys_never_overwrites_and_adds_new_workers(tmp_path: Path) -> None:
    make_keys(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.rglob("*.key*")}
    make_keys(tmp_path, ["worker", "extra"])
    after = {p.name: p.read_bytes() for p in tmp_path.rglob("*.key*")}
    assert {k: after[k] for k in before} == before
    assert load_client_keys(tmp_path, "extra").public in load_server_keys(tmp_path).authorized
    # A revoked worker stays revoked when keys are made again.
    (tmp_path / "authorized" / "worker.key").unlink()
    make_keys(tmp_path, ["worker", "extra"])
    assert not (tmp_path / "authorized" / "worker.key").exists()


@pytest.mark.timeout(10)
def test_make_keys_refuses_half_a_pair_and_odd_names(tmp_path: Path) -> None:
    make_keys(tmp_path)
    (tmp_path / "worker.key").unlink()
    with pytest.raises(KeysError, match=r"worker\.key: missing while worker\.key_secret exists"):
        make_keys(tmp_path)
    for bad in ("../w", "authorized", "coordinator", ""):
        with pytest.raises(ValueError, match="workers"):
            make_keys(tmp_path / "other", [bad])


@pytest.mark.parametrize(
    ("remove", "load"),
    [
        ("coordinator.key_secret", "server"),
        ("authorized/worker.key", "server"),
        ("worker.key_secret", "client"),
        ("coordinator.key", "client"),
    ],
)
@pytest.mark.timeout(10)
def test_a_missing_file_is_named_with_how_to_make_it(
    tmp_path: Path, remove: str, load: str
) -> None:
    make_keys(tmp_path)
    (tmp_path / remove).unlink()
    with pytest.raises(KeysError) as caught:
        load_server_keys(tmp_path) if load == "server" else load_client_keys(tmp_path)
    missing = tmp_path / remove if "/" not in remove else tmp_path / "authorized"
    assert caught.value.path == missing
    assert str(missing) in str(caught.value)
    assert f"tensorbus keys {tmp_path}" in str(caught.value)


@pytest.mark.timeout(10)
def test_a_public_file_in_place_of_a_secret_or_a_garbled_key_is_refused(tmp_path: Path) -> None:
    make_keys(tmp_path)
    secret = tmp_path / "worker.key_secret"
    kept = secret.read_bytes()
    secret.write_bytes((tmp_path / "worker.key").read_bytes())
    with pytest.raises(KeysError, match="no secret key"):
        load_client_keys(tmp_path)
    secret.write_bytes(kept)
    (tmp_path / "coordinator.key").write_text('curve\n    public-key = "short"\n')
    with pytest.raises(KeysError, match="malformed key"):
        load_client_keys(tmp_path)
    with pytest.raises(KeysError, match="no such file"):
        load_client_keys(tmp_path / "nowhere")


# --- the wire --------------------------------------------------------------------------------


@pytest.fixture
def keys(tmp_path: Path) -> tuple[ServerKeys, ClientKeys, ClientKeys]:
    """(server, authorized worker, stranger): the stranger knows the server's public key."""
    make_keys(tmp_path / "ours")
    make_keys(tmp_path / "theirs")
    worker = load_client_keys(tmp_path / "ours")
    theirs = load_client_keys(tmp_path / "theirs")
    stranger = ClientKeys(public=theirs.public, secret=theirs.secret,
                          server_public=worker.server_public)
    return load_server_keys(tmp_path / "ours"), worker, stranger


@pytest.fixture
def server(keys: tuple[ServerKeys, ClientKeys, ClientKeys]) -> Iterator[ZmqServer]:
    # Built outside any event loop, as a coordinator binding from synchronous code would.
    server = ZmqServer("tcp://127.0.0.1:0", max_message_bytes=LIMIT, keys=keys[0])
    try:
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def _client(server: ZmqServer, keys: ClientKeys | None) -> Iterator[ZmqClient]:
    client = ZmqClient(server.endpoint, max_message_bytes=LIMIT, keys=keys)
    try:
        client.subscribe(server.pub_port)
        yield client
    finally:
        client.close()


async def _round_trip(server: ZmqServer, client: ZmqClient, payload: bytes) -> bytes:
    await client.send([payload])
    peer, frames = await asyncio.wait_for(server.recv(), 2.0)
    assert bytes(frames[0]) == payload
    await server.send(peer, [b"re:" + payload])
    return bytes((await asyncio.wait_for(client.recv(), 2.0))[0])


async def _broadcast_until_heard(server: ZmqServer, client: ZmqClient) -> bytes:
    """Publish until the subscriber hears it: a SUB misses what is sent before it joins."""

    async def publish() -> None:
        while True:
            await server.publish([b"version"])
            await asyncio.sleep(0.02)

    publisher = asyncio.create_task(publish())
    try:
        return bytes((await asyncio.wait_for(client.recv_broadcast(), 2.0))[0])
    finally:
        publisher.cancel()


@pytest.mark.timeout(10)
def test_an_authorized_worker_round_trips_and_hears_broadcasts_over_curve(
    server: ZmqServer, keys: tuple[ServerKeys, ClientKeys, ClientKeys]
) -> None:
    async def scenario() -> None:
        with _client(server, keys[1]) as client:
            assert await _round_trip(server, client, b"hello") == b"re:hello"
            assert await _broadcast_until_heard(server, client) == b"version"
            for socket in (server._router, server._pub):
                assert socket.getsockopt(zmq.MECHANISM) == zmq.CURVE
                assert socket.getsockopt(zmq.CURVE_SERVER) == 1
            for socket in (client._dealer, client._sub):
                assert socket.getsockopt(zmq.MECHANISM) == zmq.CURVE
                assert socket.getsockopt(zmq.CURVE_SERVER) == 0
        assert server.rejected == 0

    asyncio.run(scenario())


@pytest.mark.timeout(10)
def test_close_stops_the_gate_also_when_bind_fails(
    server: ZmqServer, keys: tuple[ServerKeys, ClientKeys, ClientKeys]
) -> None:
    threads = threading.active_count()
    with pytest.raises(OSError, match="cannot bind"):
        ZmqServer(f"tcp://127.0.0.1:{server.port}", max_message_bytes=LIMIT, keys=keys[0])
    assert threading.active_count() == threads
    other = ZmqServer("tcp://127.0.0.1:0", max_message_bytes=LIMIT, keys=keys[0])
    assert threading.active_count() == threads + 1  # the gate answers in a thread
    other.close()
    other.close()  # twice is harmless
    assert threading.active_count() == threads


@pytest.mark.parametrize("outsider", ["stranger", "plain"])
@pytest.mark.timeout(10)
def test_an_outsider_gets_nothing_through(
    server: ZmqServer, keys: tuple[ServerKeys, ClientKeys, ClientKeys], outsider: str
) -> None:
    async def scenario() -> list[bytes]:
        heard: list[bytes] = []

        async def listen() -> None:
            while True:
                _, frames = await server.recv()
                heard.append(bytes(frames[0]))

        with (_client(server, keys[2] if outsider == "stranger" else None) as intruder,
              _client(server, keys[1]) as worker):
            listener = asyncio.create_task(listen())
            try:
                # (Bounded: once the mismatch has dropped a plain peer's connection, its
                # DEALER has no peer and a send waits for one for good.)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(intruder.send([b"intruder"]), WINDOW_S)
                await worker.send([b"worker"])
                # The worker heard within the window proves the window was long enough.
                assert await _broadcast_until_heard(server, worker) == b"version"
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(intruder.recv_broadcast(), WINDOW_S)
            finally:
                listener.cancel()
        return heard

    assert asyncio.run(scenario()) == [b"worker"]
    # A stranger is refused by the gate, again on each reconnect; a plain peer never reaches
    # it (libzmq drops a NULL peer of a CURVE server at the mechanism mismatch), and is
    # counted by the socket's monitor.
    assert server.rejected > 0


@contextlib.asynccontextmanager
async def _hammering(server: ZmqServer, stranger: ClientKeys) -> AsyncIterator[None]:
    """Outsiders opening fresh connections and sending, every few ms, while the body runs.

    Fresh sockets, because libzmq does not reconnect a peer refused at the handshake: a
    hostile one has to come back on its own.
    """
    # Synchronous sockets: a NOBLOCK send that finds no peer just raises Again.
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()

    def outsider(curve: bool) -> zmq.Socket[bytes]:
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        if curve:
            socket.setsockopt(zmq.CURVE_SERVERKEY, stranger.server_public)
            socket.setsockopt(zmq.CURVE_PUBLICKEY, stranger.public)
            socket.setsockopt(zmq.CURVE_SECRETKEY, stranger.secret)
        socket.connect(server.endpoint)
        with contextlib.suppress(zmq.Again):
            socket.send(b"intruder", zmq.NOBLOCK)
        return socket

    async def hammer() -> None:
        live: list[zmq.Socket[bytes]] = []
        while True:
            live += [outsider(curve=True), outsider(curve=False)]
            while len(live) > 8:  # a few at a time, each given some ms to be refused
                live.pop(0).close()
            await asyncio.sleep(0.005)

    task = asyncio.create_task(hammer())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        context.destroy(linger=0)


@pytest.mark.timeout(15)
def test_honest_workers_are_unaffected_while_outsiders_hammer(
    server: ZmqServer, keys: tuple[ServerKeys, ClientKeys, ClientKeys]
) -> None:
    async def scenario() -> None:
        async with _hammering(server, keys[2]):
            async with asyncio.timeout(5.0):  # let the refusals pile up first
                while server.rejected < 10:
                    await asyncio.sleep(0.01)
            with _client(server, keys[1]) as worker:
                for i in range(50):
                    payload = f"step {i}".encode()
                    # _round_trip also checks that the server heard the worker, not an outsider
                    assert await _round_trip(server, worker, payload) == b"re:" + payload
                assert await _broadcast_until_heard(server, worker) == b"version"

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def _tap(target_port: int, captured: bytearray) -> AsyncIterator[int]:
    """A TCP relay to `target_port` that records what the client sends; yields its port."""
    tasks: set[asyncio.Task[None]] = set()
    writers: list[asyncio.StreamWriter] = []

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, record: bool) -> None:
        while data := await src.read(65536):
            if record:
                captured.extend(data)
            dst.write(data)
            await dst.drain()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        writers.extend((writer, up_writer))
        for task in (pump(reader, up_writer, True), pump(up_reader, writer, False)):
            tasks.add(asyncio.create_task(task))

    listener = await asyncio.start_server(relay, "127.0.0.1", 0)
    try:
        yield listener.sockets[0].getsockname()[1]
    finally:
        listener.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in writers:
            writer.close()
        await listener.wait_closed()


@pytest.mark.parametrize("keyed", [True, False])
@pytest.mark.timeout(10)
def test_requests_are_not_plaintext_on_the_wire(
    keys: tuple[ServerKeys, ClientKeys, ClientKeys], keyed: bool
) -> None:
    marker = b"gradient-bytes-in-the-clear-" * 4
    captured = bytearray()

    async def scenario() -> None:
        server = ZmqServer("tcp://127.0.0.1:0", max_message_bytes=LIMIT,
                           keys=keys[0] if keyed else None)
        try:
            async with _tap(server.port, captured) as port:
                client = ZmqClient(f"tcp://127.0.0.1:{port}", max_message_bytes=LIMIT,
                                   keys=keys[1] if keyed else None)
                try:
                    assert await _round_trip(server, client, marker) == b"re:" + marker
                    mechanism = server._router.getsockopt(zmq.MECHANISM)
                    assert mechanism == (zmq.CURVE if keyed else zmq.NULL)
                finally:
                    client.close()
        finally:
            server.close()

    asyncio.run(scenario())
    # Without keys the tap sees the payload, so it would see it with keys if it were there.
    assert (marker in captured) is not keyed


@pytest.mark.timeout(10)
def test_a_peer_without_keys_is_counted_as_refused(
    keys: tuple[ServerKeys, ClientKeys, ClientKeys]
) -> None:
    """libzmq drops it at the mechanism mismatch, before the gate: the monitor sees it."""
    keyed = ZmqServer("tcp://127.0.0.1:0", max_message_bytes=LIMIT, keys=keys[0])
    context = zmq.Context()
    plain = context.socket(zmq.DEALER)
    try:
        plain.connect(keyed.endpoint)
        # (Not waited for: once the mismatch has dropped its connection, a DEALER with no
        # peer blocks in send, for good; the connection is what is counted.)
        with contextlib.suppress(zmq.Again):
            plain.send(b"let me in", zmq.NOBLOCK)
        deadline = time.monotonic() + 5
        while keyed.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert keyed.rejected >= 1
    finally:
        plain.close(linger=0)
        context.destroy(linger=0)
        keyed.close()


@pytest.mark.timeout(10)
def test_a_key_name_with_no_pair_names_those_there_and_how_to_make_it(tmp_path: Path) -> None:
    make_keys(tmp_path, ["alice", "bob"])
    with pytest.raises(KeysError) as caught:
        load_client_keys(tmp_path, "nobody")
    assert str(caught.value) == (
        f"{tmp_path}/nobody.key_secret: no key pair named nobody (--key-name) here, where "
        f"there are: alice, bob; give one of those to --key-name, or make it with "
        f"`tensorbus keys {tmp_path} --worker nobody` and copy its nobody.key to the "
        "coordinator's authorized/")
