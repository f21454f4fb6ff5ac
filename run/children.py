"""The worker processes a launcher starts: forked from it where that is safe, fresh
interpreters otherwise; each dies with its launcher.

A fresh `python -m tensorbus worker` imports torch and the rest of tensorbus again: over a
second of CPU each, most of a short run's start on a small machine (`python -m benchmarks
ab REV --only start` measures a start). `Forks` forks the workers from the
launcher as it starts instead, while nothing of the run is made yet (no event loop, no
ZeroMQ context, no SPEC loaded, no other Python thread), and each child waits on a pipe for
its orders. Told them, a child becomes what a fresh `python -m MODULE ARGV` would be, with
the imports already done:

- its own session, so that Ctrl-C in the terminal reaches the launcher alone (a script
  stays in the launcher's process group, as a subprocess it starts would: Ctrl-C reaches
  it too, as it would reach `python SCRIPT`);
- stdin the rest of its orders pipe (at its end at once, unless the launcher keeps writing:
  `Forked.stdin`); stdout a pipe (`Forked.stdout`), or the stderr pipe (`Forked.stderr`)
  line by line; `sys.std*` made anew over them; no other file of the launcher's;
- Python's own signal handlers; logging not set up (the root logger's level WARNING); the
  global random states of torch and numpy drawn afresh (Python's `random` is by `os.fork`);
- it runs MODULE as `python -m` does (or a script, as `python SCRIPT` does: `tensorbus
  launch`'s, with the variables and torch threads it is given), then exits as an
  interpreter does: it waits for its threads, runs its atexit handlers (which let go of
  its shared memory, and see an exception that ended it in `sys.last_value`), lets go of
  a script's globals (its files left open are flushed), flushes sys.std* and ends with
  its status (but files a module left open and unflushed are not flushed, and string
  hashes are seeded as the launcher's: the same on every child).

A child never told (the SPEC failed to load, say) exits 0 as its pipe closes, and
`Forks.close` reaps it. What stays shared with the launcher is what it had imported, copy
on write.

Where forking is not safe, launchers start fresh interpreters as before (`can_fork`): other
than Linux with pidfds (5.3), GPU devices or CUDA initialised (a child must not inherit
CUDA's state), or threads beyond those its imports made (OpenBLAS's, which handle a fork:
a thread pool that torch started for an operation would deadlock a child that runs one).
Only the CLI forks: a caller of the Python API may hold anything in its process.
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import fcntl
import gc
import importlib.util
import io
import json
import locale
import logging
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, NoReturn

import numpy  # (first: the threads its OpenBLAS starts are counted in _THREADS)

REAP_S: Final = 5.0  # how long an untold child may take to exit once its pipe closes
# A child's stdout: a pipe of its own, or its stderr's; or, "inherit", its stdout and stderr
# are the launcher's own, as a subprocess's it starts without pipes; or, "launchers", its
# stdout is the launcher's own and its stderr a pipe.
Stdout = Literal["pipe", "stderr", "inherit", "launchers"]
_PR_SET_PDEATHSIG: Final = 1  # prctl options, from linux/prctl.h
_PR_SET_NAME: Final = 15
_TASKS = "/proc/self/task"
_THREADS: Final = len(os.listdir(_TASKS)) if os.path.isdir(_TASKS) else 0  # imports' own


def die_with_parent() -> None:
    """In a child: ask the kernel for SIGTERM when the parent dies (PR_SET_PDEATHSIG)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _prctl(option: int, argument: int | bytes) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, argument) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}): {os.strerror(errno)}")


def can_fork(devices: list[str]) -> bool:
    """Whether workers on `devices` can be forked from this process now."""
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return False
    if any(d != "cpu" for d in devices) or len(os.listdir(_TASKS)) > _THREADS:
        return False
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # a kernel older than 5.3
        return False
    return True


@dataclass
class _Child:
    """A forked child, not told yet: its pid, a pidfd, and the launcher's ends of its pipes."""

    pid: int
    pidfd: int
    orders: int  # its orders, then its stdin (write end)
    stdout: int  # (read ends)
    stderr: int


class Forks:
    """`count` children forked now, each waiting to be told what to run (`start`)."""

    def __init__(self, count: int) -> None:
        sys.stdout.flush()  # (or a child would write again what the launcher had buffered)
        sys.stderr.flush()
        self._waiting: list[_Child] = []
        try:
            for _ in range(count):
                self._waiting.append(self._fork())
        except BaseException:
            self.close()
            raise

    def _fork(self) -> _Child:
        parent = os.getpid()
        pipes = [os.pipe() for _ in range(3)]  # (read, write) each: orders, stdout, stderr
        # Ctrl-C held back across the fork: in the child before it ignores it, the
        # launcher's handler would raise into the launcher's frames.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            pid = os.fork()
            if pid == 0:  # (never returns)
                _child(parent, pipes[0][0], pipes[1][1], pipes[2][1])
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        for fd in (pipes[0][0], pipes[1][1], pipes[2][1]):
            os.close(fd)
        child = _Child(pid, -1, pipes[0][1], pipes[1][0], pipes[2][0])
        try:
            child.pidfd = os.pidfd_open(pid)
        except OSError:
            _end([child])
            raise
        return child

    async def start(self, name: str, module: str, argv: list[str], *, stdin: bool = False,
                    stdout: Stdout = "stderr", script: bool = False,
                    environ: dict[str, str] | None = None, unset: Sequence[str] = (),
                    threads: int | None = None, session: bool | None = None) -> Forked:
        """The next child, told to run `python -m MODULE ARGV` (or `python MODULE ARGV`,
        MODULE a `script`'s path, with `environ` set, `unset` removed from its environment,
        and torch's `threads`): written to on
        stdin (`Forked.stdin`) if `stdin`, else its stdin at its end; its stdout read from
        `Forked.stdout` ("pipe"), or from `Forked.stderr` with its stderr, line by line
        ("stderr"), or the launcher's own, its stderr too ("inherit") or its stderr read
        from `Forked.stderr` ("launchers"). `session`: a session of its own, so that Ctrl-C
        in the terminal reaches the launcher alone (the default, but for a script, which
        stays in the launcher's process group as a subprocess would). Its command line
        stays its launcher's; `name` (15 bytes at most) is what `ps -o comm` and `top` show."""
        child = self._waiting.pop(0)
        orders = {"name": name, "module": module, "argv": argv, "stdout": stdout,
                  "script": script, "environ": environ or {}, "unset": list(unset),
                  "threads": threads, "session": not script if session is None else session}
        try:
            # One line, in the pipe at once (it holds 64 KiB; the child reads while we write).
            _write_all(child.orders, json.dumps(orders).encode() + b"\n")
        except BaseException:
            _end([child])
            raise
        if not stdin:
            os.close(child.orders)
        if stdout != "pipe":
            os.close(child.stdout)
        if stdout == "inherit":
            os.close(child.stderr)
        return await Forked.watch(child, stdin=stdin, stdout=stdout == "pipe",
                                  stderr=stdout != "inherit")

    def close(self) -> None:
        """End the children never told: each exits as its pipe closes, and is reaped here
        (killed if it has not exited within REAP_S)."""
        waiting, self._waiting = self._waiting, []
        _end(waiting)


def _end(children: list[_Child]) -> None:
    """Close the launcher's ends of these untold children's pipes, and reap them: each
    exits as its orders pipe closes, or is killed after REAP_S."""
    for child in children:
        for fd in (child.orders, child.stdout, child.stderr):
            os.close(fd)
    deadline = time.monotonic() + REAP_S
    for child in children:
        while os.waitpid(child.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(child.pid, signal.SIGKILL)
                os.waitpid(child.pid, 0)  # (a SIGKILL ends it)
                break
            time.sleep(0.005)
        if child.pidfd >= 0:
            os.close(child.pidfd)


class Forked:
    """A started child: the part of asyncio.subprocess.Process that the launchers use
    (pid, stdin, stdout, stderr, returncode, wait, send_signal). Its exit is seen through
    its pidfd."""

    def __init__(self, child: _Child, stdin: _Lines | None, stdout: asyncio.StreamReader | None,
                 stderr: asyncio.StreamReader | None) -> None:
        self.pid = child.pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self._pidfd = child.pidfd
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = self._loop.create_future()
        self._loop.add_reader(self._pidfd, self._reap)

    @classmethod
    async def watch(cls, child: _Child, *, stdin: bool, stdout: bool, stderr: bool = True) -> Forked:
        return cls(child, _Lines(child.orders) if stdin else None,
                   await _reader(child.stdout) if stdout else None,
                   await _reader(child.stderr) if stderr else None)

    def _reap(self) -> None:
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:
            return  # (not yet: a pidfd is readable only once its process ended)
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        if self.stdin is not None:
            self.stdin.close()
        self.returncode = os.waitstatus_to_exitcode(status)
        self._exited.set_result(self.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:  # reaped: its pid may be another process's now
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._pidfd, sig)


class _Lines:
    """A child's stdin, for the few short lines a launcher writes (run.colocated's orders):
    each written whole at once, without waiting on the loop; none once the child is gone,
    as asyncio's pipes drop them."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def write(self, data: bytes) -> None:
        if self._fd is None:
            return
        try:
            _write_all(self._fd, data)
        except BrokenPipeError:
            self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


async def _reader(fd: int) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0))
    return reader


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _child(parent: int, orders: int, stdout: int, stderr: int) -> NoReturn:
    """A forked child's whole life: wait for its orders, run them, exit."""
    code = 1
    script = ""  # the path of a script run as `python SCRIPT` would (else a module's run)
    try:
        # Ctrl-C in the terminal reaches the launcher's whole process group, this child
        # too until it is told (and takes a session of its own): the launcher ends it then.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (whatever the launcher's handler)
        die_with_parent()
        if os.getppid() != parent:  # the launcher died before the line above
            os._exit(1)
        # None of the launcher's other files, from now on: a child that held the
        # launcher's ends of another's pipes, even untold, would hide that one's end.
        _close_all_but({orders, stdout, stderr})
        line = _read_line(orders)
        if not line:
            os._exit(0)  # never told: the launcher gave up before starting it
        told = json.loads(line)
        _prctl(_PR_SET_NAME, told["name"].encode()[:15])  # (this thread's: the process's)
        if told["script"]:
            script = os.path.abspath(told["module"])
        if told["session"]:
            os.setsid()
        # (Else in the launcher's process group, as a subprocess it starts: Ctrl-C in the
        # terminal reaches this child too, as it would reach it alone.)
        if told["stdout"] == "inherit":  # (the launcher's, which this process has as its own)
            stdout, stderr = 1, 2
        elif told["stdout"] == "launchers":
            stdout = 1
        _stdio(orders, stdout if told["stdout"] != "stderr" else stderr, stderr)
        _as_if_fresh(told["threads"], script=bool(told["script"]))
        for name in told["unset"]:
            os.environ.pop(name, None)
        os.environ.update(told["environ"])
        sys.argv = [told["module"], *told["argv"]]
        if told["script"]:
            _run_script(script)
        else:
            runpy.run_module(told["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:  # as the interpreter takes it: a status, or a message and 1
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt as e:  # as the interpreter ends: by SIGINT itself, after its exit
        _uncaught(e, script)
        code = -signal.SIGINT
    except BaseException as e:  # noqa: BLE001 - whatever it is, this process must end here
        _uncaught(e, script)
    finally:
        try:
            _exit_as_an_interpreter(script)
        finally:
            if code == -signal.SIGINT:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(code)


def _run_script(path: str) -> None:
    """Run the script at `path` (absolute) as `python SCRIPT` does: its folder first on
    sys.path, and its module `__main__` to the end of the process (for what pickles its
    classes, and its atexit handlers); without a spec, as there (multiprocessing's spawn
    then imports it again by its path)."""
    sys.path[0] = os.path.dirname(path)
    spec = importlib.util.spec_from_file_location("__main__", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"can't open file {path!r}")
    main = importlib.util.module_from_spec(spec)
    main.__spec__ = None
    sys.modules["__main__"] = main
    spec.loader.exec_module(main)


def _uncaught(e: BaseException, script: str) -> None:
    """Said, and kept where the interpreter keeps an exception that ended it (for the atexit
    handlers to see: nodes.own_loop's tells its coordinator). A script's is said by
    sys.excepthook, from its own first frame, as the interpreter says it."""
    tb = e.__traceback__
    if script:
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
        tb = tb or e.__traceback__  # (raised before its first line ran: a SyntaxError, say)
        e.with_traceback(tb)  # (what sys.excepthook prints, whatever it is given)
    sys.last_type, sys.last_value, sys.last_traceback = type(e), e, tb
    (sys.excepthook if script else traceback.print_exception)(type(e), e, tb)


def _stdio(stdin: int, stdout: int, stderr: int) -> None:
    """Make these the child's fds 0-2, and nothing else open, as a fresh interpreter's
    start (close_fds) would have it, and make sys.stdin, stdout and stderr anew over them."""
    # Moved above 2 first: a launcher started with a standard descriptor closed may have
    # got one of these as 0, 1 or 2.
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 3) for fd in (stdin, stdout, stderr)]
    for to, fd in enumerate(high):
        os.dup2(fd, to)
    _close_all_but(set())
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        buffered = io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(
            buffered, encoding=getattr(old, "encoding", None) or locale.getpreferredencoding(False),
            errors=getattr(old, "errors", None) or ("backslashreplace" if fd == 2 else "strict"),
            # (Python's choice for each, and line by line where stdout shares stderr's pipe)
            line_buffering=fd == 2 or os.isatty(fd) or (fd == 1 and stdout == stderr))
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _close_all_but(keep: set[int]) -> None:
    """Close every descriptor above 2 but those in `keep`."""
    start = 3
    for fd in sorted(fd for fd in keep if fd >= start):
        os.closerange(start, fd)
        start = fd + 1
    os.closerange(start, os.sysconf("SC_OPEN_MAX"))


def _exit_as_an_interpreter(script: str = "") -> None:
    """What an interpreter does at its exit that matters here, in its order: wait for
    the threads that are not daemons, run the atexit handlers (shared memory let go of),
    let go of a script's globals (its files still open are flushed and closed), flush
    sys.stdout and stderr. (Private functions of CPython's, as its exit calls them: this
    child must not unwind into its launcher's frames to reach them.)"""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    if script:
        main = sys.modules.get("__main__")
        if main is not None and getattr(main, "__file__", None) == script:
            # As the interpreter clears a module at its end: names with one underscore
            # first, then the others, each set to None (a __del__ finds its globals so).
            names = main.__dict__
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            for name in [*private, *(n for n in names if n not in private)]:
                if name != "__builtins__":
                    names[name] = None
            gc.collect()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()


def _read_line(fd: int) -> bytes:
    """One line from `fd`, read a byte at a time: what follows it is the child's stdin."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            return b""  # closed before a whole line: never told
        line += byte
    return bytes(line)


def _as_if_fresh(threads: int | None = None, *, script: bool = False) -> None:
    """Undo what the launcher set up in this process that a fresh interpreter lacks;
    `threads`: torch's, as OMP_NUM_THREADS sets them in a fresh one. A `script` (not
    tensorbus's own command) also gets SIGUSR1's default (run.entry ignores it)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if script:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    for handler in list(logging.root.handlers):  # (run.cli sets logging up for its command)
        logging.root.removeHandler(handler)
    logging.root.setLevel(logging.WARNING)
    # Drawn afresh from the OS's entropy, as a fresh import seeds each: workers that share
    # the launcher's would draw the same dropout masks, the same shuffles.
    numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
        if threads is not None:
            torch.set_num_threads(threads)
    elif threads is not None:  # (taken as torch is imported)
        os.environ["OMP_NUM_THREADS"] = str(threads)


async def spawn(argv: list[str]) -> asyncio.subprocess.Process:
    """`python -m tensorbus ARGV`, a fresh interpreter, as a child of this launcher that
    dies with it: its stdout and stderr in one pipe (`stdout`), unbuffered, as a forked
    one's (run.local's relay of a worker's output)."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-u", "-m", "tensorbus", *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        preexec_fn=die_with_parent,
        # Its own session: Ctrl-C in the terminal reaches the launcher alone, which
        # stops the workers gracefully through the coordinator.
        start_new_session=True,
    )
