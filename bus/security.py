"""CURVE keys and ZAP authentication: who may talk to the coordinator, and how sockets prove it.

This module owns the key directory and the gate in front of the coordinator's sockets. It
knows nothing of messages: `bus.transport` calls `curve_server` / `curve_client` on its
sockets and starts a `KeyGate` on the server's context; everything else goes through them.

Key directory (the standard ZeroMQ certificate format, written by `zmq.auth`)::

    DIR/coordinator.key          coordinator public key    copy to every worker machine
    DIR/coordinator.key_secret   coordinator key pair      stays on the coordinator (0600)
    DIR/NAME.key                 worker NAME public key
    DIR/NAME.key_secret          worker NAME key pair      copy to that worker only (0600)
    DIR/authorized/NAME.key      public keys the coordinator lets in, one file a worker

A worker machine needs `coordinator.key` and its own `NAME.key_secret`; the coordinator
needs `coordinator.key_secret` and `authorized/`. Revoking a worker is deleting its file in
`authorized/` (read when the coordinator starts).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger("tensorbus.security")

COORDINATOR_NAME: Final = "coordinator"
AUTHORIZED: Final = "authorized"  # sub-directory of the public keys the coordinator admits
ZAP_DOMAIN: Final = "tensorbus"  # what our server sockets tell the ZAP handler they are
KEY_CHARS: Final = 40  # a Z85-encoded 32-byte CURVE key
WARN_KEYS: Final = 64  # distinct refused keys that get a warning; later ones are only counted


class KeysError(ValueError):
    """A key file is missing, unreadable or malformed: which file, and how to make one."""

    def __init__(self, path: Path, problem: str, fix: str | None = None) -> None:
        super().__init__(
            f"{path}: {problem}; " + (fix or f"make keys with `tensorbus keys {path.parent}` "
                                      "(then copy coordinator.key and the worker's "
                                      "NAME.key_secret to the worker)"))
        self.path = path
        self.problem = problem


@dataclass(frozen=True)
class ServerKeys:
    """The coordinator's key pair and the worker public keys it admits (all Z85 bytes)."""

    public: bytes
    secret: bytes = field(repr=False)  # never in a log line or a traceback
    authorized: frozenset[bytes]
    directory: Path

    @property
    def admitted(self) -> frozenset[bytes]:
        """The keys the gate lets in: the workers', and the coordinator's own, which only a
        coordinator of this run holds (its standby, calling on it, and it on its standby)."""
        return self.authorized | {self.public}

    def as_peer(self) -> ClientKeys:
        """The keys a coordinator calls on another of its run with (its standby's server,
        or the coordinator a standby follows): its own pair, and that same public key."""
        return ClientKeys(public=self.public, secret=self.secret, server_public=self.public)


@dataclass(frozen=True)
class ClientKeys:
    """A worker's key pair and the coordinator public key it expects (all Z85 bytes)."""

    public: bytes
    secret: bytes = field(repr=False)
    server_public: bytes


# --- key files -------------------------------------------------------------------------------


def make_keys(directory: Path, workers: Sequence[str] = ("worker",)) -> None:
    """Create the coordinator's and each worker's key pair in `directory`; authorize workers.

    Never overwrites: a complete pair is kept as it is (so re-running adds new workers only),
    and half a pair is an error rather than a guess. Only a pair made here is authorized, so
    that re-running never lets back in a worker whose `authorized/` file was removed.
    """
    directory = Path(directory)
    for name in (COORDINATOR_NAME, *workers):
        if not name or name == AUTHORIZED or Path(name).name != name or name.startswith("."):
            raise ValueError(f"workers: {name!r} is not a plain file name")
    if COORDINATOR_NAME in workers:
        raise ValueError(f"workers: {COORDINATOR_NAME!r} is the coordinator's name")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    (directory / AUTHORIZED).mkdir(exist_ok=True)
    _make_pair(directory, COORDINATOR_NAME)
    for name in workers:
        if _make_pair(directory, name):
            shutil.copyfile(directory / f"{name}.key", directory / AUTHORIZED / f"{name}.key")


def _make_pair(directory: Path, name: str) -> bool:
    """Create NAME's pair unless it exists; whether it was created."""
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if public.exists() and secret.exists():
        return False
    if public.exists() or secret.exists():
        present, absent = (public, secret) if public.exists() else (secret, public)
        raise KeysError(absent, f"missing while {present.name} exists; restore it or remove both")
    # Written in a private (0700) directory beside the target and renamed into place, so that
    # the secret is never readable by others, not even between its write and its chmod.
    with tempfile.TemporaryDirectory(dir=directory, prefix=".keys-") as staging:
        made_public, made_secret = zmq.auth.create_certificates(staging, name)
        os.chmod(made_secret, 0o600)
        os.replace(made_secret, secret)
        os.replace(made_public, public)
    return True


def _certificate(path: Path) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a certificate file; every failure a KeysError naming it."""
    if not path.is_file():
        raise KeysError(path, "no such file")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeysError(path, f"cannot read a certificate ({e})") from None
    for key in (public, secret):
        if key is not None and not _is_z85_key(key):
            raise KeysError(path, "holds a malformed key (not 40 Z85 characters)")
    return public, secret


def _read_public(path: Path) -> bytes:
    return _certificate(path)[0]


def _read_pair(path: Path) -> tuple[bytes, bytes]:
    public, secret = _certificate(path)
    if secret is None:
        raise KeysError(path, "holds no secret key (is this the .key_secret file?)")
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s is readable by other users; chmod 600 it", path)
    return public, secret


def _is_z85_key(key: bytes) -> bool:
    try:
        return len(key) == KEY_CHARS and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):  # z85.decode raises KeyError on a bad character
        return False


def load_server_keys(directory: Path) -> ServerKeys:
    """The coordinator's keys: its pair and every `authorized/*.key` (at least one)."""
    directory = Path(directory)
    public, secret = _read_pair(directory / f"{COORDINATOR_NAME}.key_secret")
    listed = directory / AUTHORIZED
    files = sorted(listed.glob("*.key")) if listed.is_dir() else []
    if not files:
        raise KeysError(listed, "lists no worker public keys (*.key)")
    authorized = frozenset(_read_public(f) for f in files)
    return ServerKeys(public=public, secret=secret, authorized=authorized, directory=directory)


def load_client_keys(directory: Path, name: str = "worker") -> ClientKeys:
    """Worker NAME's keys: its pair (NAME.key_secret) and the coordinator's public key."""
    directory = Path(directory)
    pair = directory / f"{name}.key_secret"
    if directory.is_dir() and not pair.exists():
        held = sorted(p.name.removesuffix(".key_secret") for p in directory.glob("*.key_secret")
                      if p.name != f"{COORDINATOR_NAME}.key_secret")
        raise KeysError(
            pair, f"no key pair named {name} (--key-name) here, where there are: "
                  f"{', '.join(held) if held else 'none'}",
            f"give one of those to --key-name, or make it with `tensorbus keys {directory} "
            f"--worker {name}` and copy its {name}.key to the coordinator's authorized/")
    public, secret = _read_pair(pair)
    server_public = _read_public(directory / f"{COORDINATOR_NAME}.key")
    return ClientKeys(public=public, secret=secret, server_public=server_public)


# --- sockets ---------------------------------------------------------------------------------


def curve_server(socket: zmq.Socket[Any], keys: ServerKeys) -> None:
    """Make `socket` a CURVE server under our ZAP domain. Call before bind."""
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())


def curve_client(socket: zmq.Socket[Any], keys: ClientKeys) -> None:
    """Make `socket` a CURVE client of the coordinator. Call before connect."""
    socket.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


class KeyGate:
    """The ZAP handler of one libzmq context: admits exactly the CURVE keys in `authorized`.

    It answers in a thread of its own (pyzmq's ThreadAuthenticator) on a shadow of the
    context, so it needs no running event loop: the coordinator may bind from synchronous
    code. Start it before binding: libzmq admits
    every CURVE key when no ZAP handler is listening. A plain (NULL) peer never reaches the
    gate: libzmq drops it at the mechanism mismatch.
    """

    def __init__(self, context: zmq.Context[Any], authorized: frozenset[bytes]) -> None:
        self._authorized = authorized
        self._refused: set[bytes] = set()
        self.rejected = 0  # handshakes refused; written only by the gate's thread
        # A shadow shares the libzmq context (so inproc://zeromq.zap.01 is seen by the
        # server's sockets) but makes synchronous sockets, which the gate's thread needs.
        self._auth = ThreadAuthenticator(zmq.Context.shadow(context.underlying))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP credentials provider: `key` is the client's public key, Z85-encoded."""
        if key in self._authorized:
            return True
        self.rejected += 1
        # One warning a key, for the first few keys: a hostile peer retrying in a loop, or
        # with fresh keys, must not flood the log or grow memory without bound.
        if key not in self._refused and len(self._refused) < WARN_KEYS:
            self._refused.add(key)
            log.warning("refused a CURVE handshake from unknown key %s... (domain %s); "
                        "authorize it by adding its .key file to authorized/",
                        key[:8].decode("ascii", "replace"), domain)
        return False

    def close(self) -> None:
        """Stop the thread and close its sockets; before the context is terminated."""
        self._auth.stop()
