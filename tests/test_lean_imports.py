"""The privacy core and the per-example machinery are torch-only: importing them loads neither Lightning nor
Opacus nor an accounting library (the mechanism can be audited and used without the Lightning glue).

One fresh interpreter imports each in turn and prints, after each step, the heavy packages loaded so far: the set
only grows, so a step's list is empty exactly when neither it nor a step before it loaded one (a package that loads
one fails the assertion at its own step, or at the first earlier step that loads the same)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

HEAVY = ("pytorch_lightning", "lightning", "lightning_fabric", "opacus", "dp_accounting", "matplotlib", "sklearn")
MECHANISM = ("lightning_dp.privacy.private_step", "lightning_dp.grad_sample", "lightning_dp.validators",
             "lightning_dp.mechanism")
STEPS = ("import lightning_dp", *(f"import {package}" for package in MECHANISM), "lightning_dp.DPStrategy")


@functools.lru_cache(maxsize=None)
def _loaded_after_each_step() -> dict[str, list[str]]:
    code = "import sys, json\n" + "".join(
        f"{step}\nprint(json.dumps([{step!r}, sorted(m for m in {HEAVY!r} if m in sys.modules)]))\n" for step in STEPS)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return dict(json.loads(line) for line in out.stdout.splitlines() if line.startswith('["'))


def test_mechanism_imports_no_lightning_opacus_or_accounting_library():
    loaded = _loaded_after_each_step()
    for package in MECHANISM:
        assert loaded[f"import {package}"] == [], package


def test_package_names_load_on_first_use():
    loaded = _loaded_after_each_step()
    assert loaded["import lightning_dp"] == []
    assert "pytorch_lightning" not in loaded[f"import {MECHANISM[-1]}"]  # not loaded before the name's first use
    assert "pytorch_lightning" in loaded["lightning_dp.DPStrategy"]


def test_accounting_epsilon_is_the_function_not_the_module():
    from lightning_dp.accounting import epsilon

    assert callable(epsilon) and epsilon(1.0, 0.01, 100, 1e-5) > 0
