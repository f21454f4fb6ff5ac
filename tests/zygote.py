"""Test helper: `tensorbus` commands forked from one warm process, not started afresh.

A fresh `python -m tensorbus ...` imports torch and tensorbus again: one to two seconds of
this machine's two cores, a few hundred times a suite. The zygote imports them once and
forks a child for each command; the child becomes what the fresh interpreter would be (its
own session, stdio, working folder, environment, signal handlers and random states, its
exit as an interpreter's: run.children does the same for `tensorbus local`'s workers) and
runs the command. Its pid and, when it ends, its exit status come back over a Unix socket.

`Zygote.popen` and `Zygote.run` take what `subprocess.Popen` and `subprocess.run` take for
`[sys.executable, "-m", "tensorbus", *argv]` (or `-c CODE`, or `SCRIPT`: run as
`tensorbus launch` runs one, run.children), and give what they give.
Tests that are about a fresh interpreter itself (installing, the interrupt of an import)
start one.

    python tests/zygote.py SOCKET     # serve: one child a connection
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent


# --- the client, in the tests ---------------------------------------------------------------


class Forked:
    """A child of the zygote, as much of subprocess.Popen as the tests use."""

    def __init__(self, connection: socket.socket, argv: list[str],
                 stdout: IO[Any] | None, stderr: IO[Any] | None, stdin: IO[Any] | None) -> None:
        self.args = argv
        self._connection = connection
        self.stdout, self.stderr, self.stdin = stdout, stderr, stdin
        self.pid = int(self._line(None))
        self.returncode: int | None = None

    def _line(self, timeout: float | None) -> str:
        self._connection.settimeout(timeout)
        data = b""
        while not data.endswith(b"\n"):
            chunk = self._connection.recv(64)
            if not chunk:
                raise RuntimeError("the zygote went away")
            data += chunk
        return data.decode().strip()

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._line(0.0))
            except (TimeoutError, BlockingIOError):
                return None
            self._connection.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = int(self._line(timeout))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None
            self._connection.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # (reaped: its pid may be another process's now)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: str | bytes | None = None,
                    timeout: float | None = None) -> tuple[Any, Any]:
        if self.stdin is not None and not self.stdin.closed:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        outputs: dict[str, Any] = {}
        readers = [threading.Thread(target=_read_all, args=(stream, name, outputs), daemon=True)
                   for name, stream in (("out", self.stdout), ("err", self.stderr))
                   if stream is not None and not stream.closed]
        for reader in readers:
            reader.start()
        self.wait(timeout)
        for reader in readers:
            reader.join(timeout)
        for stream in (self.stdout, self.stderr):  # (as Popen.communicate does)
            if stream is not None:
                stream.close()
        return outputs.get("out"), outputs.get("err")

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *_: object) -> None:
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None:
                stream.close()
        self.wait()


def _read_all(stream: IO[Any], name: str, into: dict[str, Any]) -> None:
    into[name] = stream.read()


class Zygote:
    """The client end: forks commands from the zygote at `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def popen(self, argv: Sequence[str], *, cwd: str | Path = ROOT,
              env: Mapping[str, str] | None = None, stdin: Any = subprocess.DEVNULL,
              stdout: Any = None, stderr: Any = None, text: bool = False,
              code: str | None = None, script: str | Path | None = None,
              netns: str | None = None) -> Forked:
        """`python -m tensorbus ARGV` (with `code`: `python -c CODE ARGV`; with `script`:
        `python SCRIPT ARGV`), forked; with `netns`, in that network namespace, as under
        `ip netns exec NETNS`."""
        ours: list[int] = []  # the child's ends of pipes made here, closed once sent
        mine: dict[str, IO[Any] | None] = {}

        def end(what: Any, name: str, fd: int, reading: bool) -> int:
            if what == subprocess.PIPE:
                read, write = os.pipe()
                theirs, kept = (read, write) if reading else (write, read)
                ours.append(theirs)
                mode = ("w" if reading else "r") + ("" if text else "b")
                mine[name] = open(kept, mode, buffering=-1 if not text or reading else 1)
                return theirs
            mine[name] = None
            if what == subprocess.DEVNULL:
                opened = os.open(os.devnull, os.O_RDONLY if reading else os.O_WRONLY)
                ours.append(opened)
                return opened
            if what == subprocess.STDOUT:
                return -1  # (filled in below: stderr into stdout)
            if what is None:
                return fd  # as the tests' own
            return what if isinstance(what, int) else what.fileno()

        fds = [end(stdin, "stdin", 0, True), end(stdout, "stdout", 1, False),
               end(stderr, "stderr", 2, False)]
        if fds[2] == -1:
            fds[2] = fds[1]
        order = {"argv": list(argv), "cwd": str(cwd), "code": code,
                 "script": None if script is None else os.path.abspath(os.path.join(cwd, script)),
                 "netns": netns,
                 "env": dict(os.environ if env is None else env)}
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(str(self.path))
            socket.send_fds(connection, [json.dumps(order).encode()], fds)
        finally:
            for fd in ours:
                os.close(fd)
        return Forked(connection, list(argv), mine["stdout"], mine["stderr"], mine["stdin"])

    def run(self, argv: Sequence[str], *, cwd: str | Path = ROOT,
            env: Mapping[str, str] | None = None, timeout: float | None = None,
            input: str | bytes | None = None, capture_output: bool = False,
            text: bool = False, check: bool = False, code: str | None = None,
            script: str | Path | None = None,
            stdin: Any = subprocess.DEVNULL) -> subprocess.CompletedProcess[Any]:
        pipe = subprocess.PIPE if capture_output else None
        process = self.popen(argv, cwd=cwd, env=env, stdout=pipe, stderr=pipe, text=text,
                             code=code, script=script,
                             stdin=subprocess.PIPE if input is not None else stdin)
        try:
            out, err = process.communicate(input, timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        finally:
            for stream in (process.stdout, process.stderr):
                if stream is not None:
                    stream.close()
        done = subprocess.CompletedProcess(argv, process.returncode, out, err)
        if check:
            done.check_returncode()
        return done


@contextmanager
def started(folder: Path) -> Iterator[Zygote]:
    """A zygote serving at `folder`/zygote.sock for the block, then ended with its children."""
    path = folder / "zygote.sock"
    server = subprocess.Popen([sys.executable, __file__, str(path)], cwd=ROOT,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not path.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the zygote did not start")
            time.sleep(0.02)
        yield Zygote(path)
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


_SHARED: list[Zygote] = []  # this test process's zygote, once started


def shared() -> Zygote:
    """This test process's zygote, started at first use and ended at its exit."""
    if not _SHARED:
        folder = tempfile.TemporaryDirectory(prefix="tensorbus-zygote-")
        block = started(Path(folder.name))
        _SHARED.append(block.__enter__())

        def end() -> None:
            block.__exit__(None, None, None)
            folder.cleanup()

        atexit.register(end)
    return _SHARED[0]


def tensorbus(*argv: str, **options: Any) -> subprocess.CompletedProcess[Any]:
    """`tensorbus ARGV`, run to its end (capture_output and text by default)."""
    options.setdefault("capture_output", True)
    options.setdefault("text", True)
    return shared().run(argv, **options)


# --- the server: one warm process that forks -------------------------------------------------


def _serve(path: Path) -> None:
    # What the command line imports, imported once: the forks share it. (Not modules
    # that a command runs as __main__, run.colocated: runpy warns of one imported before.)
    # torch._dynamo too: a process's first torch optimizer imports it (about a second of
    # CPU), and every coordinator, and every worker under average, builds one.
    import torch._dynamo  # noqa: F401

    import tensorbus.run.cli  # noqa: F401
    import tensorbus.run.local  # noqa: F401
    import tensorbus.run.spec  # noqa: F401

    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(path) + ".new")
    listening.listen(64)
    os.rename(str(path) + ".new", path)  # (seen by the client once it listens)
    told: dict[int, socket.socket] = {}  # pid -> the connection its status goes to
    ending = False

    def end(*_: object) -> None:
        nonlocal ending
        ending = True

    signal.signal(signal.SIGTERM, end)
    parent = os.getppid()  # the test process: its atexit ends us, unless it was killed
    while not ending and os.getppid() == parent:
        ready, _, _ = select.select([listening], [], [], 0.02)
        if ready:
            connection, _ = listening.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
            pid = os.fork()
            if pid == 0:
                listening.close()
                connection.close()
                for other in told.values():
                    other.close()
                _child(json.loads(message), fds)
            for fd in set(fds):
                if fd > 2:
                    os.close(fd)
            connection.sendall(f"{pid}\n".encode())
            told[pid] = connection
        while told:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            connection = told.pop(pid, None)
            if connection is not None:
                try:
                    connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                connection.close()
    for pid in told:  # the suite is over: nothing of it outlives it
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _child(order: dict[str, Any], fds: list[int]) -> None:
    """A forked child's whole life: become the fresh interpreter, run, exit as one."""
    from tensorbus.run import children

    code = 1
    script = order.get("script") or ""
    try:
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        stdin, stdout, stderr = fds if len(fds) == 3 else (fds + [0, 1, 2])[:3]
        children._stdio(stdin, stdout, stderr)
        if order.get("netns"):  # (after its stdio: a failure is said where the test reads)
            _enter_netns(order["netns"])
        os.chdir(order["cwd"])
        os.environ.clear()
        os.environ.update(order["env"])
        children._as_if_fresh(script=bool(script))
        sys.path[0] = ""  # as `-m` and `-c` have it: the working folder
        if script:
            sys.argv = [script, *order["argv"]]
            children._run_script(script)
        elif order["code"] is not None:
            sys.argv = ["-c", *order["argv"]]
            exec(compile(order["code"], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
        else:
            import runpy

            sys.argv = ["tensorbus", *order["argv"]]
            runpy.run_module("tensorbus", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt as e:
        children._uncaught(e, script)
        code = -signal.SIGINT
    except BaseException as e:  # noqa: BLE001 - whatever it is, this process must end here
        children._uncaught(e, script)
    finally:
        try:
            children._exit_as_an_interpreter(script)
        finally:
            if code == -signal.SIGINT:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(code & 0xFF)


def _enter_netns(name: str) -> None:
    """Move this process into the network namespace `ip netns add NAME` made: setns(2), as
    `ip netns exec` does for the network (not its mounts of /sys and /etc/netns, which
    nothing here reads). A namespace is a thread's, and this child has one thread yet."""
    import ctypes

    clone_newnet = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, clone_newnet) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into {name}: {os.strerror(error)}")
    finally:
        os.close(fd)


if __name__ == "__main__":
    _serve(Path(sys.argv[1]))
