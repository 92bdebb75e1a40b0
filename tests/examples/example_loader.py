"""Load a script from examples/ as a module (the examples are scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(filename: str, module_name: str) -> ModuleType:
    """Execute ``examples/<filename>`` as module ``module_name`` (registered in ``sys.modules``,
    where dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / filename)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
