"""The `tensorbus` command's entry point (and `python -m tensorbus`'s).

The command line is parsed first, with nothing heavy imported (run.flags): a mistyped
option is answered at once. Importing torch and the rest of the CLI then takes a second or
two; an interrupt (Ctrl-C) in that time ends like one at any later point: one line, exit
status 130 (see `run.cli`).
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    import signal

    from tensorbus.run import flags, interrupts

    interrupts.note()
    # A request for the status table (run.status) that comes before it listens, or after,
    # is let pass, not fatal (SIGUSR1's default ends the process).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    args = flags.parse(sys.argv[1:])
    try:
        from tensorbus.run.cli import run
    except KeyboardInterrupt:
        _interrupted()
    if interrupts.noted():  # swallowed by a library while it imported: it may be half made
        _interrupted()
    return run(args)


def _interrupted() -> None:
    worker = sys.argv[1:2] == ["worker"]  # a worker's errors are read by its launcher
    print(f"{'' if worker else 'tensorbus: '}error: interrupted", file=sys.stderr, flush=True)
    # Not a return: an interrupt that landed in code run by exec() from a string (as
    # dataclasses and torch's import do) makes CPython 3.11 end the process by SIGINT at
    # exit, even once caught; nothing needs finalizing yet.
    sys.stdout.flush()
    os._exit(130)
