"""Multi-process: workers forked from their launcher (run.children).

Each test runs a small launcher in a fresh interpreter (forking pytest's own process, with
whatever earlier tests left in it, would test something else) that forks children with
`Forks`, starts them on `tests/forked_child.py` and prints what it saw as JSON.
`tests/system/test_local.py` and `tests/system/test_colocated_local.py` check the same through
`tensorbus local`, whose workers are forked this way, against workers started by hand.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
PREAMBLE = """\
import asyncio, json, os, signal, sys, time
from tensorbus.run.children import Forks, can_fork
"""


def _launcher(code: str, *, close_stdin: bool = False) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    return subprocess.Popen([sys.executable, "-c", PREAMBLE + textwrap.dedent(code)], cwd=ROOT,
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: os.close(0)) if close_stdin else None)  # noqa: PLW1509


def _probe(code: str, *, close_stdin: bool = False) -> Any:
    """Run a launcher whose code prints one JSON value last; that value."""
    launcher = _launcher(code, close_stdin=close_stdin)
    try:
        out, err = launcher.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.communicate()
        raise
    assert launcher.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_exit_statuses_come_back_as_a_fresh_processes_would() -> None:
    seen = _probe("""
        forks = Forks(7)
        async def main():
            started = [await forks.start(f"child {i}", "forked_child", argv) for i, argv in
                       enumerate([["exit", "0"], ["exit", "3"], ["fail"], ["sleep", "30"],
                                   ["atexit"], ["interrupt"], ["thread"]])]
            started[3].send_signal(signal.SIGKILL)
            codes = [await p.wait() for p in started]
            errs = [(await p.stderr.read()).decode() for p in started]
            try:
                started[0].send_signal(signal.SIGTERM)
                again = "sent"
            except ProcessLookupError:
                again = "ProcessLookupError"
            return codes, errs, again
        print(json.dumps(asyncio.run(main())))
        forks.close()
    """)
    codes, errs, again = seen
    assert codes == [0, 3, 1, -signal.SIGKILL, 0, -signal.SIGINT, 0]
    assert "told to fail" in errs[2] and "KeyboardInterrupt" in errs[5]
    assert errs[4] == "atexit ran\n"  # (its atexit handlers run at its exit)
    assert errs[6] == "thread done\n"  # (and it waits for its threads first)
    assert again == "ProcessLookupError"  # (reaped: its pid may be another's by now)


def test_a_child_is_what_a_fresh_interpreter_would_be() -> None:
    reports = _probe("""
        import logging
        import numpy as np
        import torch
        np.random.seed(1)  # (children that kept the launcher's states would draw the same)
        torch.manual_seed(1)
        logging.basicConfig(level="INFO")
        signal.signal(signal.SIGTERM, lambda *_: None)
        stray = os.open(os.devnull, os.O_RDONLY)
        os.set_inheritable(stray, True)  # (as a file its own parent left it would be)
        forks = Forks(3)
        async def main():
            await (await forks.start("first", "forked_child", ["exit", "0"])).wait()
            out = []
            for name in ("tb worker 0", "tb worker 1"):
                child = await forks.start(name, "forked_child", ["report"])
                assert await child.wait() == 0
                out.append(json.loads(await child.stderr.readline()))
            return {"launcher": {"pid": os.getpid(), "sid": os.getsid(0)}, "children": out}
        print(json.dumps(asyncio.run(main())))
        forks.close()
    """)
    launcher, (a, b) = reports["launcher"], reports["children"]
    assert a["ppid"] == b["ppid"] == launcher["pid"]
    assert a["sid"] == a["pid"] and b["sid"] == b["pid"]  # a session of its own
    assert a["name"] == "tb worker 0" and b["name"] == "tb worker 1"
    assert a["random"] != b["random"] and a["torch_random"] != b["torch_random"]
    assert a["sigint_default"] and a["sigterm_default"] and a["logging_handlers"] == 0
    assert a["stdin"] == "" and a["stdout"] == a["stderr"] and a["stderr"].startswith("pipe:")
    assert a["argv"][1:] == ["report"]
    # Its stdio and the descriptor its listing opened: nothing of the launcher's (its
    # stray file, its ends of the pipes), nor of the child forked before it.
    assert len(set(a["fds"]) - {0, 1, 2}) <= 1, a["fds"]


def test_stdin_and_stdout_pipes() -> None:
    """Also from a launcher started with stdin closed: its first pipe is fd 0."""
    lines = _probe(close_stdin=True, code="""
        read, write = os.pipe()
        assert read == 0  # (what Forks will get too, once these are closed)
        os.close(read)
        os.close(write)
        forks = Forks(1)
        async def main():
            child = await forks.start("echo", "forked_child", ["echo"], stdin=True, stdout="pipe")
            got = []
            for word in ("one", "two"):
                child.stdin.write(word.encode() + b"\\n")
                got.append((await child.stdout.readline()).decode().strip())
            child.stdin.close()
            assert await child.wait() == 0
            child.stdin.write(b"dropped: the child is gone\\n")
            return got
        print(json.dumps(asyncio.run(main())))
        forks.close()
    """)
    assert lines == ["ONE", "TWO"]


def test_stdout_shares_stderrs_pipe_line_by_line() -> None:
    """By default what a child prints comes with what it writes to stderr, in order, each
    line as it is printed (the child still lives)."""
    lines = _probe("""
        forks = Forks(1)
        async def main():
            child = await forks.start("printer", "forked_child", ["print"])
            got = [(await asyncio.wait_for(child.stderr.readline(), 10)).decode()
                   for _ in range(2)]
            child.send_signal(signal.SIGKILL)
            await child.wait()
            return got
        print(json.dumps(asyncio.run(main())))
        forks.close()
    """)
    assert lines == ["to stdout\n", "to stderr\n"]


def test_a_script_runs_as_python_script_would_with_the_launchers_output(tmp_path: Path) -> None:
    """`tensorbus launch`'s way (run.own_loop): a script's path, its own variables and torch
    threads, its folder first on sys.path and its `__file__` absolute, the launcher's stdout
    and stderr, logging not set up; its module `__main__` to the end (an atexit handler
    pickles its class); an exception that ends it said by sys.excepthook from the script's
    own first frame, and its atexit handlers' sys.last_value; a file it left open, flushed."""
    (tmp_path / "beside.py").write_text("WHERE = 'beside'\n")
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""\
        import atexit, logging, os, pickle, sys, torch
        import beside
        class Thing:
            pass
        def at_exit():
            pickle.dumps(Thing())  # (found as __main__.Thing)
            print("at exit:", repr(getattr(sys, "last_value", None)), file=sys.stderr, flush=True)
        atexit.register(at_exit)
        print(__name__, sys.argv[1:], os.environ["RANK"], beside.WHERE, torch.get_num_threads(),
              os.path.isabs(__file__), logging.getLogger().level, flush=True)
        left_open = open(os.path.join(os.path.dirname(__file__), "left_open.txt"), "w")
        left_open.write("written, never flushed by the script")
        raise ValueError("the script's own")
    """))
    launcher = _launcher(f"""
        import logging
        logging.basicConfig(level=logging.DEBUG)  # (the launcher's, not the script's)
        forks = Forks(1)
        async def main():
            child = await forks.start("script", {str(script)!r}, ["--flag", "x"],
                                      stdout="inherit", script=True, environ={{"RANK": "3"}},
                                      threads=1)
            assert child.stdout is None and child.stderr is None
            return await child.wait()
        print("status", asyncio.run(main()), flush=True)
        forks.close()
    """)
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 0, err
    assert out.splitlines() == ["__main__ ['--flag', 'x'] 3 beside 1 True 30", "status 1"]
    traceback = err[err.index("Traceback"):].splitlines()
    assert traceback[1].startswith(f'  File "{script}", line ')  # (no launcher's frame first)
    assert "ValueError: the script's own" in err
    assert "at exit: ValueError(\"the script's own\")" in err
    assert (tmp_path / "left_open.txt").read_text() == "written, never flushed by the script"


def test_a_child_on_the_launchers_stdout_with_its_stderr_read_and_a_variable_unset(
    tmp_path: Path,
) -> None:
    """stdout="launchers" (`worker --workers-per-node`'s): what the child prints reaches the
    launcher's own stdout, its stderr comes to the launcher; `unset` leaves a variable of the
    launcher's out of the child's environment."""
    script = tmp_path / "script.py"
    script.write_text("import os, sys\n"
                      "print('printed', os.environ.get('WORLD_SIZE'), os.environ['RANK'])\n"
                      "print('said', file=sys.stderr)\n")
    launcher = _launcher(f"""
        os.environ["WORLD_SIZE"] = "8"
        forks = Forks(1)
        async def main():
            child = await forks.start("script", {str(script)!r}, [], stdout="launchers",
                                      script=True, environ={{"RANK": "3"}}, unset=["WORLD_SIZE"])
            assert child.stdout is None
            said = await child.stderr.read()
            return said.decode(), await child.wait()
        print(json.dumps(asyncio.run(main())))
        forks.close()
    """)
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 0, err
    assert out.splitlines() == ["printed None 3", json.dumps(["said\n", 0])]


def test_no_child_holds_anothers_pipes() -> None:
    """A child forked after another holds none of the launcher's ends of that one's pipes:
    the first sees its stdin end when the launcher closes it, while the second lives."""
    seen = _probe("""
        forks = Forks(3)
        async def main():
            first = await forks.start("first", "forked_child", ["echo"], stdin=True,
                                      stdout="pipe")
            second = await forks.start("second", "forked_child", ["sleep", "30"])
            first.stdin.write(b"last\\n")
            first.stdin.close()
            code = await asyncio.wait_for(first.wait(), 10)
            out = await asyncio.wait_for(first.stdout.read(), 10)
            alive = second.returncode is None
            second.send_signal(signal.SIGTERM)
            return out.decode(), code, alive, await second.wait()
        print(json.dumps(asyncio.run(main())))
        forks.close()
    """)
    assert seen == ["LAST\n", 0, True, -signal.SIGTERM]


def test_children_never_told_exit_and_are_reaped() -> None:
    seen = _probe("""
        forks = Forks(3)
        pids = [c.pid for c in forks._waiting]
        started = time.monotonic()
        forks.close()
        took = time.monotonic() - started
        gone = []
        for pid in pids:
            try:
                os.waitpid(pid, os.WNOHANG)
                gone.append(False)
            except ChildProcessError:  # reaped already: not our child any more
                gone.append(True)
        print(json.dumps([took, gone]))
    """)
    took, gone = seen
    assert gone == [True, True, True] and took < 2.0


def test_children_die_with_their_launcher() -> None:
    """SIGKILL the launcher: a started child ends (PR_SET_PDEATHSIG: nothing else would end
    its sleep), and so does one never told (its orders pipe closes too)."""
    launcher = _launcher("""
        forks = Forks(2)
        async def main():
            child = await forks.start("sleeper", "forked_child", ["sleep", "60"])
            print(json.dumps([child.pid, forks._waiting[0].pid]), flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
    """)
    try:
        assert launcher.stdout is not None
        pids = json.loads(launcher.stdout.readline())
        assert all(_alive(pid) for pid in pids)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids):
            assert time.monotonic() < deadline, [pid for pid in pids if _alive(pid)]
            time.sleep(0.05)
    finally:
        launcher.kill()
        launcher.communicate()


def test_forking_only_where_it_is_safe() -> None:
    seen = _probe("""
        import threading
        first = [can_fork(["cpu", "cpu"]), can_fork(["cpu", "cuda:0"])]
        stop = threading.Event()
        thread = threading.Thread(target=stop.wait)
        thread.start()
        with_a_thread = can_fork(["cpu"])
        stop.set()
        thread.join()
        print(json.dumps([*first, with_a_thread]))
    """)
    assert seen == [True, False, False]


def test_no_fork_once_torch_has_started_its_thread_pool() -> None:
    """A child forked after torch ran an operation on its thread pool would deadlock in its
    first one: refused, however the threads came."""
    before, after, tasks = _probe("""
        import torch
        before = can_fork(["cpu"])
        tasks = len(os.listdir("/proc/self/task"))
        torch.set_num_threads(2)
        torch.ones(1 << 22).mul_(2).sum()  # (long enough for the pool to share it)
        print(json.dumps([before, can_fork(["cpu"]), len(os.listdir("/proc/self/task")) - tasks]))
    """)
    if tasks == 0:
        pytest.skip("this torch ran the operation without starting a thread")
    assert before and not after
