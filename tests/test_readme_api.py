"""What the README shows a user runs as shown: its Python API section's code block, whole,
in a fresh interpreter from the repository's root (a user copies it, and it must not need
names it does not define), and `tensorbus --version`."""

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


def test_version_says_the_release_and_the_wire_protocol(capsys: pytest.CaptureFixture[str]) -> None:
    from tensorbus.bus.messages import BUILD, PROTOCOL_VERSION
    from tensorbus.run.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"tensorbus {BUILD} (wire protocol {PROTOCOL_VERSION})\n"
