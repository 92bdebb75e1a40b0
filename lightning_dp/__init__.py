"""lightning_dp: differentially private training for any PyTorch Lightning project.

Add :class:`DPStrategy` to your Trainer; add callbacks for accounting
(:class:`PrivacyBudget`), optimizer variants (:class:`AdamVariant`) and monitoring.
See the README for a quickstart.
"""

import sys
from typing import TYPE_CHECKING

from lightning_dp._lazy import after_import, lazy_exports

_EXPORTS = {
    "AdamVariant": "lightning_dp.callbacks",
    "AdaptiveClipping": "lightning_dp.clipping",
    "AutomaticClipping": "lightning_dp.clipping",
    "DPAdagrad": "lightning_dp.optim",
    "DPAdam": "lightning_dp.optim",
    "DPShardedStrategy": "lightning_dp.sharded_strategy",
    "DPStrategy": "lightning_dp.strategy",
    "LedgerEntry": "lightning_dp.accounting.ledger",
    "OutsideStepsWarning": "lightning_dp.errors",
    "PrivacyBudget": "lightning_dp.callbacks",
    "PerLayerClipping": "lightning_dp.clipping",
    "PrivacyConfigurationError": "lightning_dp.errors",
    "PrivacyLedger": "lightning_dp.accounting.ledger",
    "PublicPretraining": "lightning_dp.callbacks",
    "SecondMomentMonitor": "lightning_dp.callbacks",
    "Users": "lightning_dp.units",
    "calibrate_noise": "lightning_dp.accounting.calibration",
    "epsilon": "lightning_dp.accounting.epsilon",
    "ledger_epsilon": "lightning_dp.accounting.epsilon",
    "per_example_token_mean": "lightning_dp.losses",
    "public_steps": "lightning_dp.records.outside_steps",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)


def _filter_upstream_noise() -> None:
    from lightning_dp._warnings import filter_upstream_noise

    filter_upstream_noise()  # Lightning's own harmless deprecation noise, narrowly (see lightning_dp._warnings)


def _continue_loaded_ledgers(namespace: str) -> None:
    from lightning_dp.accounting.loaded_checkpoints import install

    install(namespace)  # load_from_checkpoint of a private fit's checkpoint continues its ledger, in any process


def _register_strategy() -> None:
    _filter_upstream_noise()
    _continue_loaded_ledgers("pytorch_lightning")
    glue = sys.modules.get("lightning_dp._strategy_glue")
    if getattr(getattr(glue, "__spec__", None), "_initializing", False):
        # Lightning imported first by the strategies' own glue, itself imported first (a process started by "spawn"
        # unpickling the launcher): the strategies need the whole glue, and register when they are imported.
        return
    import lightning_dp.strategy  # noqa: F401  (registers ``strategy="dp"`` in Lightning's registry)
    import lightning_dp.sharded_strategy  # noqa: F401  (and ``strategy="dp_sharded"``)


def _register_unified_strategy() -> None:
    _filter_upstream_noise()
    _continue_loaded_ledgers("lightning.pytorch")
    try:
        import lightning_dp.unified  # noqa: F401  (the same, in lightning.pytorch's registry)
    except ImportError:  # the unified build needs pytorch_lightning too; without it DPStrategy is unavailable
        pass


def _record_outside_steps() -> None:
    import lightning_dp.records.outside_steps  # noqa: F401  (counts optimizer steps outside the mechanism)


after_import("torch.optim", _record_outside_steps)  # a teacher fitted here without DP is refused (outside_fits)
after_import("pytorch_lightning", _register_strategy)  # Trainer(strategy="dp"), whichever is imported first
after_import("lightning.pytorch", _register_unified_strategy)  # L.Trainer(strategy="dp")

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from lightning_dp.accounting import LedgerEntry, PrivacyLedger, calibrate_noise, epsilon, ledger_epsilon
    from lightning_dp.callbacks import AdamVariant, PrivacyBudget, PublicPretraining, SecondMomentMonitor
    from lightning_dp.errors import OutsideStepsWarning, PrivacyConfigurationError
    from lightning_dp.records.outside_steps import public_steps
    from lightning_dp.losses import per_example_token_mean
    from lightning_dp.clipping import AdaptiveClipping, AutomaticClipping, PerLayerClipping
    from lightning_dp.units import Users
    from lightning_dp.optim import DPAdagrad, DPAdam
    from lightning_dp.sharded_strategy import DPShardedStrategy
    from lightning_dp.strategy import DPStrategy

__version__ = "0.1.0"

__all__ = [
    "AdamVariant",
    "AdaptiveClipping",
    "AutomaticClipping",
    "DPAdagrad",
    "DPAdam",
    "DPShardedStrategy",
    "DPStrategy",
    "LedgerEntry",
    "OutsideStepsWarning",
    "PrivacyBudget",
    "PerLayerClipping",
    "PrivacyConfigurationError",
    "PrivacyLedger",
    "PublicPretraining",
    "SecondMomentMonitor",
    "Users",
    "__version__",
    "calibrate_noise",
    "epsilon",
    "ledger_epsilon",
    "per_example_token_mean",
    "public_steps",
]
