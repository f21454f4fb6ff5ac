"""Unit: the SPEC loader names exactly what is missing or wrong, in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tensorbus.run.spec import SpecError, load_spec

pytestmark = pytest.mark.timeout(30)

GOOD = """
import torch
def model():
    return torch.nn.Linear(2, 1)
def data(rank, world_size, batch_size):
    return [(torch.zeros(batch_size, 2), torch.zeros(batch_size, 1))]
def loss(output, target):
    return ((output - target) ** 2).mean()
"""


def _write(tmp_path: Path, text: str, name: str = "spec") -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return path


def test_a_good_spec_loads_with_optional_parts_absent(tmp_path: Path) -> None:
    spec = load_spec(_write(tmp_path, GOOD))
    assert spec.optimizer is None and spec.evaluate is None
    assert isinstance(spec.build_model(), torch.nn.Linear)


@pytest.mark.parametrize(
    ("name", "described"),
    [("model", "model() -> torch.nn.Module"),
     ("data", "data(rank, world_size, batch_size) -> iterable of (input, target)"),
     ("loss", "loss(output, target) -> scalar tensor")],
)
def test_each_missing_function_is_named(tmp_path: Path, name: str, described: str) -> None:
    path = _write(tmp_path, GOOD.replace(f"def {name}(", f"def not_{name}("))
    with pytest.raises(SpecError) as error:
        load_spec(path)
    assert str(error.value) == f"SPEC {path}: missing {described}: define it (see examples/digits.py)"


def test_wrong_parameters_and_non_callables_are_named(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD.replace("def data(rank, world_size, batch_size):",
                                         "def data(rank):"))
    with pytest.raises(SpecError, match=r"data has the wrong parameters, expected data\(rank"):
        load_spec(path)
    path = _write(tmp_path, GOOD + "\nevaluate = 3\n", "non_callable")
    with pytest.raises(SpecError, match="evaluate is a int, expected evaluate"):
        load_spec(path)


def test_import_failures_and_missing_files_are_one_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "import no_such_module_here\n")
    with pytest.raises(SpecError) as error:
        load_spec(path)
    assert str(error.value) == (f"SPEC {path}: importing it raised ModuleNotFoundError: "
                                "No module named 'no_such_module_here'")
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "absent.py")
    with pytest.raises(SpecError, match="no module no_such_pkg here: run from the folder"):
        load_spec("no_such_pkg:thing")


TASK = """
import torch

class Task:
    @staticmethod
    def model():
        return torch.nn.Linear(2, 1)

    @staticmethod
    def data(rank, world_size, batch_size):
        return []

    @staticmethod
    def loss(output, target):
        return output.sum()
"""


def test_module_object_form(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, TASK, "my_task_module")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        spec = load_spec("my_task_module:Task")
        assert isinstance(spec.build_model(), torch.nn.Linear)
        with pytest.raises(SpecError, match="has no attribute 'Nope'"):
            load_spec("my_task_module:Nope")
    finally:
        sys.modules.pop("my_task_module", None)


def test_model_that_raises_or_returns_the_wrong_thing(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD.replace("return torch.nn.Linear(2, 1)", "return 5"))
    with pytest.raises(SpecError) as error:
        load_spec(path).build_model()
    assert str(error.value) == f"SPEC {path}: model() returned int, not a torch.nn.Module"
    path = _write(tmp_path, GOOD.replace("return torch.nn.Linear(2, 1)", "raise RuntimeError('x')"),
                  "raises")
    with pytest.raises(SpecError, match=r"model\(\) raised RuntimeError: x"):
        load_spec(path).build_model()


@pytest.mark.system  # it starts processes
def test_the_digits_example_reads_what_load_digits_gives_without_importing_sklearn() -> None:
    """examples/digits.py reads scikit-learn's bundled digits itself (importing
    scikit-learn costs every process of a run about a second): the same arrays as
    load_digits(), and scikit-learn is not imported."""
    import hashlib
    import subprocess

    from sklearn.datasets import load_digits

    probe = ("import hashlib, sys; from examples.digits import _digits; p, l = _digits(); "
             "print(p.dtype, l.dtype, hashlib.sha256(p.tobytes() + l.tobytes()).hexdigest(), "
             "'sklearn' in sys.modules)")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    digits = load_digits()
    wanted = hashlib.sha256(digits.data.tobytes() + digits.target.tobytes()).hexdigest()
    assert out == [str(digits.data.dtype), str(digits.target.dtype), wanted, "False"]


def test_a_module_spec_is_found_in_the_current_folder(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """As `python -m` finds it, where the tensorbus script's folder is first on the path."""
    (tmp_path / "herespec.py").write_text(
        (Path(__file__).resolve().parents[2] / "examples" / "digits.py").read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "herespec", raising=False)
    assert load_spec("herespec").model is not None
    with pytest.raises(SpecError, match=r"SPEC nothere:SPEC: no module nothere here: run from "
                                        r"the folder that holds it, or put that folder on PYTHONPATH"):
        load_spec("nothere:SPEC")



def test_a_spec_file_imports_the_modules_beside_it(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """As running a script puts its folder on the path, from whatever folder it runs."""
    folder = tmp_path / "specs"
    folder.mkdir()
    (folder / "besidemodel.py").write_text(GOOD)
    spec = folder / "cnn_bn.py"
    spec.write_text("from besidemodel import model, data, loss\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(folder))])
    monkeypatch.delitem(sys.modules, "besidemodel", raising=False)
    assert isinstance(load_spec("specs/cnn_bn.py").build_model(), torch.nn.Linear)


def test_a_folder_given_as_spec_says_so(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as error:
        load_spec(tmp_path)
    assert str(error.value) == (f"SPEC {tmp_path}: is a folder: give the Python file in it that "
                                "defines model(), data() and loss(), or module:object")
