"""Public names imported when first used, not with their package.

The `tensorbus` command parses its arguments before torch is imported (run.flags), and a
package's __init__ that imported its modules would import torch with it. Each package maps
its public names to the modules that define them and looks a name up on first use:

    _WHERE = {"Coordinator": "coordinator", ...}

    def __getattr__(name: str) -> Any:
        return lazy.attribute(__name__, _WHERE, name)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any


def attribute(package: str, where: Mapping[str, str], name: str) -> Any:
    """`package`'s public `name`, imported from its module and kept: later lookups find it
    as an ordinary attribute. AttributeError for a name that is not one of `where`."""
    if name not in where:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
    setattr(sys.modules[package], name, value)
    return value
