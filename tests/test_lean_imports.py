"""The privacy core and the per-example machinery are torch-only: importing them loads neither Lightning nor
Opacus nor an accounting library (the mechanism can be audited and used without the Lightning glue)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("pytorch_lightning", "lightning", "lightning_fabric", "opacus", "dp_accounting", "matplotlib", "sklearn")


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_mechanism_imports_no_lightning_opacus_or_accounting_library():
    for package in ("lightning_dp.privacy.private_step", "lightning_dp.grad_sample", "lightning_dp.validators",
                    "lightning_dp.mechanism"):
        assert _loaded_after(f"import {package}") == [], package


def test_package_names_load_on_first_use():
    assert _loaded_after("import lightning_dp") == []
    assert "pytorch_lightning" in _loaded_after("import lightning_dp; lightning_dp.DPStrategy")


def test_accounting_epsilon_is_the_function_not_the_module():
    from lightning_dp.accounting import epsilon

    assert callable(epsilon) and epsilon(1.0, 0.01, 100, 1e-5) > 0
