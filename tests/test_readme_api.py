"""The README's Python API section runs as it is written: its code block, whole, in a
fresh interpreter from the repository's root (a user copies it, and it must not need
names it does not define)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(240)


def _api_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("\n## Python API\n"):]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found is not None
    return found.group(1)


def test_the_python_api_section_runs_as_written() -> None:
    code = _api_block() + "\nprint(summary['steps'], summary['strategy'], summary['workers'])\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=220, stdin=subprocess.DEVNULL, check=False,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "100 sync 2"
