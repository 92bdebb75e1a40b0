"""``Trainer(strategy="dp")`` through Lightning's registry, whichever package the user imports first."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys
{imports}
t = {trainer}(strategy="dp", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
s = t.strategy
print(type(s).__module__, type(s).__name__, s.noise_multiplier, s.max_grad_norm)
"""


def _strategy_built(imports: str, trainer: str) -> list[str]:
    code = SCRIPT.format(imports=imports, trainer=trainer)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1].split()


@pytest.mark.parametrize("imports", ["import lightning_dp\nimport pytorch_lightning as pl",
                                     "import pytorch_lightning as pl\nimport lightning_dp"])
def test_dp_is_registered_with_documented_defaults(imports):
    from lightning_dp.strategy import REGISTERED_DEFAULTS

    module, name, sigma, c = _strategy_built(imports, "pl.Trainer")
    assert (module, name) == ("lightning_dp.strategy", "DPStrategy")
    assert (float(sigma), float(c)) == (REGISTERED_DEFAULTS["noise_multiplier"], REGISTERED_DEFAULTS["max_grad_norm"])


def test_dp_is_registered_for_the_unified_package():
    pytest.importorskip("lightning")
    module, name, _, _ = _strategy_built("import lightning_dp\nimport lightning as L", "L.Trainer")
    assert module.startswith("lightning_dp._unified") and name == "DPStrategy"


def test_dp_sharded_is_registered_with_the_same_defaults():
    from lightning_dp.strategy import REGISTERED_DEFAULTS

    code = SCRIPT.replace('strategy="dp"', 'strategy="dp_sharded"').replace('devices=1', 'devices=2')
    out = subprocess.run([sys.executable, "-c", code.format(imports="import lightning_dp\nimport pytorch_lightning as pl",
                                                            trainer="pl.Trainer")],
                         capture_output=True, text=True, check=True)
    module, name, sigma, c = out.stdout.strip().splitlines()[-1].split()
    assert (module, name) == ("lightning_dp.sharded_strategy", "DPShardedStrategy")
    assert (float(sigma), float(c)) == (REGISTERED_DEFAULTS["noise_multiplier"], REGISTERED_DEFAULTS["max_grad_norm"])


def test_dp_sharded_is_registered_for_the_unified_package():
    pytest.importorskip("lightning")
    code = SCRIPT.replace('strategy="dp"', 'strategy="dp_sharded"').replace('devices=1', 'devices=2')
    out = subprocess.run([sys.executable, "-c", code.format(imports="import lightning_dp\nimport lightning as L",
                                                            trainer="L.Trainer")],
                         capture_output=True, text=True, check=True)
    module, name, _, _ = out.stdout.strip().splitlines()[-1].split()
    assert module.startswith("lightning_dp._unified") and name == "DPShardedStrategy"


def test_the_strategies_glue_imported_first_registers_dp_with_the_strategy():
    """A process started by "spawn" unpickles the launcher first: its module, the strategies' glue, imports Lightning
    before the strategies that need the whole glue exist; the strategy registers when the pickle's DPStrategy loads."""
    imports = ("import lightning_dp._strategy_glue\nfrom lightning_dp.strategy import DPStrategy\n"
               "import pytorch_lightning as pl")
    module, name, _, _ = _strategy_built(imports, "pl.Trainer")
    assert (module, name) == ("lightning_dp.strategy", "DPStrategy")
