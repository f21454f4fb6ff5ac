"""What the children of tests/system/test_children.py run: `python -m forked_child WHAT [ARG]`,
forked from a launcher by run.children.Forks.

- exit N: exits with status N;
- fail: raises SystemExit with a message (status 1, the message on stderr);
- interrupt: raises KeyboardInterrupt (the interpreter ends by SIGINT);
- report: writes what it finds of itself to stderr as one JSON line;
- echo: copies each stdin line to stdout, upper-cased, until stdin ends;
- print: prints a line to stdout, then one to stderr, then sleeps 30 s (killed before);
- sleep S: sleeps S seconds, then exits 0;
- atexit: registers an atexit handler that writes to stderr, then exits 0;
- thread: starts a thread (not a daemon) that writes to stderr after 0.3 s, and returns.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

what = sys.argv[1]
if what == "exit":
    sys.exit(int(sys.argv[2]))
elif what == "fail":
    raise SystemExit("told to fail")
elif what == "interrupt":
    raise KeyboardInterrupt
elif what == "report":
    import logging

    import torch

    print(json.dumps({
        "pid": os.getpid(),
        "sid": os.getsid(0),
        "ppid": os.getppid(),
        "name": Path("/proc/self/comm").read_text().strip(),
        "random": float(np.random.random()),
        "torch_random": float(torch.rand(1).item()),
        "logging_handlers": len(logging.root.handlers),
        "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "stdin": sys.stdin.read(),
        "stdout": os.readlink("/proc/self/fd/1"),
        "stderr": os.readlink("/proc/self/fd/2"),
        "argv": sys.argv,
    }), file=sys.stderr, flush=True)
elif what == "echo":
    for line in sys.stdin:
        print(line.strip().upper(), flush=True)
elif what == "print":
    print("to stdout")
    print("to stderr", file=sys.stderr)
    time.sleep(30)
elif what == "sleep":
    time.sleep(float(sys.argv[2]))
elif what == "atexit":
    atexit.register(lambda: print("atexit ran", file=sys.stderr, flush=True))
elif what == "thread":
    import threading

    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", file=sys.stderr,
                                                             flush=True))).start()
else:
    sys.exit(f"forked_child: unknown {what!r}")
