"""Loading a SPEC (a Python file, or `module:object`) and saying exactly what is wrong with it.

A SPEC defines model(), data(rank, world_size, batch_size), loss(output, target), and
optionally optimizer(params), scheduler(optimizer), evaluate(model) and stages() (the model
cut into modules that run in sequence, for --pipeline). Every problem is a `SpecError` whose one
line names the SPEC, the function, and what was expected.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn

from tensorbus.nodes.worker import ComputeError, DataError

# name -> (positional parameters it takes, what it is, required)
_CONTRACT: dict[str, tuple[int, str, bool]] = {
    "model": (0, "model() -> torch.nn.Module", True),
    "data": (3, "data(rank, world_size, batch_size) -> iterable of (input, target)", True),
    "loss": (2, "loss(output, target) -> scalar tensor", True),
    "optimizer": (1, "optimizer(params) -> torch.optim.Optimizer", False),
    "evaluate": (1, "evaluate(model) -> dict[str, float]", False),
    "scheduler": (1, "scheduler(optimizer) -> a torch LR scheduler", False),
    "stages": (0, "stages() -> list of torch.nn.Module", False),
}


class SpecError(Exception):
    """A SPEC that cannot be used; the message is one line a person can act on."""


@dataclass(frozen=True)
class Spec:
    source: str  # as given: a path or module:object, so that workers can load the same
    model: Callable[[], Any]
    data: Callable[[int, int, int], Any]
    loss: Callable[[Any, Any], Any]
    optimizer: Callable[[Any], Any] | None
    evaluate: Callable[[nn.Module], dict[str, float]] | None
    scheduler: Callable[[Any], Any] | None = None
    stages: Callable[[], Any] | None = None

    def build_model(self) -> nn.Module:
        try:
            module = self.model()
        except Exception as e:
            raise SpecError(f"SPEC {self.source}: model() raised {type(e).__name__}: {e}") from e
        if not isinstance(module, nn.Module):
            raise SpecError(
                f"SPEC {self.source}: model() returned {type(module).__name__}, "
                "not a torch.nn.Module"
            )
        if not any(True for _ in module.parameters()):
            raise SpecError(f"SPEC {self.source}: model() has no parameters to train")
        return module


def load_spec(source: str | Path) -> Spec:
    text = str(source)
    namespace = _import(text)
    found: dict[str, Any] = {}
    for name, (arity, described, required) in _CONTRACT.items():
        value = getattr(namespace, name, None)
        if value is None:
            if required:
                raise SpecError(f"SPEC {text}: missing {described}: define it (see "
                                "examples/digits.py)")
            found[name] = None
            continue
        if not callable(value):
            raise SpecError(f"SPEC {text}: {name} is a {type(value).__name__}, expected {described}")
        if not _takes(value, arity):
            raise SpecError(f"SPEC {text}: {name} has the wrong parameters, expected {described}")
        found[name] = value
    return Spec(source=text, **found)


def _import(text: str) -> ModuleType | Any:
    path = Path(text)
    if path.is_dir():
        raise SpecError(f"SPEC {text}: is a folder: give the Python file in it that defines "
                        "model(), data() and loss(), or module:object")
    if text.endswith(".py") or path.is_file():
        if not path.is_file():
            raise SpecError(f"SPEC {text}: no such file: give a Python file's path, or "
                            "module:object")
        # As running a script does: the modules beside it can be imported by it.
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        name = f"tensorbus_spec_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise SpecError(f"SPEC {text}: cannot be loaded as a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # dataclasses and pickling of local classes look it up
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise SpecError(f"SPEC {text}: importing it raised {type(e).__name__}: {e}") from e
        return module
    module_name, _, attribute = text.partition(":")
    # As `python -m` has it: modules in the current folder can be named (the tensorbus
    # script's own folder is first on the path instead).
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            raise SpecError(f"SPEC {text}: importing {module_name} raised ModuleNotFoundError: "
                            f"{e}") from e
        raise SpecError(f"SPEC {text}: no module {e.name} here: run from the folder that holds "
                        "it, or put that folder on PYTHONPATH (or give the file's path)") from None
    except Exception as e:
        raise SpecError(f"SPEC {text}: importing {module_name} raised {type(e).__name__}: {e}") from e
    if not attribute:
        return module
    if not hasattr(module, attribute):
        raise SpecError(f"SPEC {text}: module {module_name} has no attribute {attribute!r}")
    return getattr(module, attribute)


def _takes(function: Callable[..., Any], arity: int) -> bool:
    try:
        inspect.signature(function).bind(*range(arity))
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): give it the benefit of the doubt
        return True
    return True


def error_line(error: Exception, spec: str | Path) -> str:
    """An error's one line: where the SPEC's own code failed (its data(), model or loss:
    nodes.worker's DataError and ComputeError), with the SPEC's path."""
    return f"SPEC {spec}: {error}" if isinstance(error, DataError | ComputeError) else str(error)
