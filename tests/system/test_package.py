"""tensorbus is one import package: `tensorbus.bus`, `.nodes`, `.strategies` and `.run`, and
nothing else at the top of site-packages. A user's own `run.py` or `nodes.py` beside their
script shadows nothing, and no module is loaded under two names (two copies of every class).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import tensorbus

ROOT = Path(__file__).resolve().parents[2]
BARE = ("bus", "nodes", "strategies", "run")  # the folders, never imported by these names
SUBPACKAGES = [f"tensorbus.{name}" for name in BARE]


def _python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True, timeout=20).stdout
    return [ROOT / line for line in listed.splitlines() if (ROOT / line).is_file()]


# An import of a folder by its bare name, in code or in a string of code (a test's child
# program): "import" or "from" or "python -m" followed by one of BARE.
_BARE_IMPORT = re.compile(
    r"(?:^|[;\"']|\\n)\s*(?:from (?:bus|nodes|strategies|run)(?:\.\w+)* import\b"  # from X import
    r"|import (?:bus|nodes|strategies|run)(?:\.\w+)*\s*(?:$|[;,\"'\\]))"  # import X.y
    r"|-m[\"', ]+(?:bus|nodes|strategies|run)\b(?![-\w])")  # python -m X: the module


@pytest.mark.timeout(30)
def test_no_code_imports_the_folders_by_their_bare_names() -> None:
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in _python_files()
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if _BARE_IMPORT.search(line) and "bare names allowed" not in line]
    assert found == []


@pytest.mark.timeout(30)
def test_every_module_loads_once_under_tensorbus() -> None:
    code = ("import importlib, pkgutil, sys\n"
            "import tensorbus\n"
            f"for package in {SUBPACKAGES!r}:\n"
            "    module = importlib.import_module(package)\n"
            "    for info in pkgutil.iter_modules(module.__path__, package + '.'):\n"
            "        if not info.name.endswith('__main__'):\n"
            "            importlib.import_module(info.name)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {BARE!r}))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=25, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_public_api_is_one_import() -> None:
    assert tensorbus.__all__ == sorted(tensorbus.__all__, key=lambda n: (n != "__version__", n))
    for name in tensorbus.__all__:
        assert getattr(tensorbus, name) is not None, name
    assert tensorbus.Coordinator.__module__ == "tensorbus.nodes.coordinator"
    assert tensorbus.Sync is tensorbus.STRATEGIES["sync"]
    with pytest.raises(AttributeError, match="module 'tensorbus' has no attribute 'nothing'"):
        _ = tensorbus.nothing  # type: ignore[attr-defined]


def _copy_of_the_tree(into: Path) -> Path:
    """The files a clean clone has: tracked ones, and new ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True, timeout=20).stdout
    for line in listed.splitlines():
        source = ROOT / line
        if source.is_file():
            (into / line).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / line)
    return into


@pytest.mark.timeout(180)
def test_an_installed_wheel_is_tensorbus_alone_and_shadows_nothing(tmp_path: Path) -> None:
    tree = _copy_of_the_tree(tmp_path / "clone")
    quiet = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(tree)], check=True, timeout=120, env=quiet,
                   capture_output=True)
    (wheel,) = wheels.glob("tensorbus-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"tensorbus"}
    # torch, pyzmq and the rest come from this interpreter's site-packages; tensorbus from
    # the wheel alone (the venv's own site-packages come first on its path).
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    bin_dir = env_dir / "bin"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install",
                    "-q", "--no-deps", str(wheel)], check=True, timeout=120, env=quiet,
                   capture_output=True)
    folder = tmp_path / "users-folder"
    folder.mkdir()
    for name in BARE:
        (folder / f"{name}.py").write_text('raise SystemExit("shadowed")\n')
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "HOME": str(tmp_path)}

    def run(*command: str, timeout: float = 30) -> str:
        done = subprocess.run(list(command), cwd=folder, env=env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, check=False)
        assert done.returncode == 0, (command, done.stdout[-1000:], done.stderr[-2000:])
        assert "shadowed" not in done.stdout + done.stderr
        return done.stdout

    version = f"tensorbus {tensorbus.__version__} (wire protocol"
    assert run(str(bin_dir / "tensorbus"), "--version").startswith(version)
    assert run("python", "-m", "tensorbus", "--version").startswith(version)
    where = run("python", "-c", "import tensorbus; print(tensorbus.__version__, tensorbus.__file__, "
                "tensorbus.launch_local.__module__)").split()
    assert where[0] == tensorbus.__version__
    assert Path(where[1]).is_relative_to(env_dir)
    assert where[2] == "tensorbus.run.local"
    # The README's quick start, from the user's folder, for 10 steps rather than an epoch
    # (234 versions: half a minute of both cores, which the suite cannot spare).
    (quick,) = [line for line in (ROOT / "README.md").read_text().splitlines()
                if line.startswith("tensorbus local examples/fashion_mnist.py")]
    assert " --epochs 1 " in quick, quick
    args = quick.replace(" --epochs 1 ", " --steps 10 ").split()
    run(*args[:2], str(tree / args[2]), *args[3:], timeout=120)
    summary = json.loads((folder / "m.jsonl").read_text().splitlines()[-1])
    assert (summary["event"], summary["steps"], summary["workers"]) == ("summary", 10, 4)
