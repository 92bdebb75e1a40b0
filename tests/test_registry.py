"""``Trainer(strategy="dp")`` through Lightning's registry, whichever package the user imports first.

Each import order runs in a fresh interpreter of its own (tests/conftest.py's ``strategies_built``): the cases of one
order share it, one line each; "pytorch_lightning first" is the process tests/examples/test_main_job.py checks too."""

from __future__ import annotations

import pytest

LIGHTNING_DP_FIRST = "import lightning_dp\nimport pytorch_lightning as pl"
PYTORCH_LIGHTNING_FIRST = "import pytorch_lightning as pl\nimport lightning_dp"
BOTH = (("dp", 1), ("dp_sharded", 2))


@pytest.fixture
def built(request, strategies_built):
    """{import order: {strategy name: [module, class, σ, C]}}, each order's process started on first use."""

    def get(imports: str, trainer: str = "pl.Trainer", cases: tuple = BOTH) -> dict[str, list[str]]:
        if imports == PYTORCH_LIGHTNING_FIRST:
            strategies, proc = request.getfixturevalue("pytorch_lightning_imported_first")
        else:
            strategies, proc = strategies_built(imports, trainer, cases)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return strategies

    return get


def _case(strategies: dict[str, list[str]], name: str) -> list[str]:
    assert name in strategies, f"{name}: no line from the child process"
    assert strategies[name][0] != "ERROR", f"{name}: {' '.join(strategies[name])}"
    return strategies[name]


@pytest.mark.parametrize("imports", [LIGHTNING_DP_FIRST, PYTORCH_LIGHTNING_FIRST])
def test_dp_is_registered_with_documented_defaults(imports, built):
    from lightning_dp.strategy import REGISTERED_DEFAULTS

    module, name, sigma, c = _case(built(imports), "dp")
    assert (module, name) == ("lightning_dp.strategy", "DPStrategy")
    assert (float(sigma), float(c)) == (REGISTERED_DEFAULTS["noise_multiplier"], REGISTERED_DEFAULTS["max_grad_norm"])


def test_dp_is_registered_for_the_unified_package(built):
    pytest.importorskip("lightning")
    module, name, _, _ = _case(built("import lightning_dp\nimport lightning as L", "L.Trainer"), "dp")
    assert module.startswith("lightning_dp._unified") and name == "DPStrategy"


def test_dp_sharded_is_registered_with_the_same_defaults(built):
    from lightning_dp.strategy import REGISTERED_DEFAULTS

    module, name, sigma, c = _case(built(LIGHTNING_DP_FIRST), "dp_sharded")
    assert (module, name) == ("lightning_dp.sharded_strategy", "DPShardedStrategy")
    assert (float(sigma), float(c)) == (REGISTERED_DEFAULTS["noise_multiplier"], REGISTERED_DEFAULTS["max_grad_norm"])


def test_dp_sharded_is_registered_for_the_unified_package(built):
    pytest.importorskip("lightning")
    module, name, _, _ = _case(built("import lightning_dp\nimport lightning as L", "L.Trainer"), "dp_sharded")
    assert module.startswith("lightning_dp._unified") and name == "DPShardedStrategy"


def test_the_strategies_glue_imported_first_registers_dp_with_the_strategy(built):
    """A process started by "spawn" unpickles the launcher first: its module, the strategies' glue, imports Lightning
    before the strategies that need the whole glue exist; the strategy registers when the pickle's DPStrategy loads."""
    imports = ("import lightning_dp._strategy_glue\nfrom lightning_dp.strategy import DPStrategy\n"
               "import pytorch_lightning as pl")
    module, name, _, _ = _case(built(imports, cases=(("dp", 1),)), "dp")
    assert (module, name) == ("lightning_dp.strategy", "DPStrategy")
