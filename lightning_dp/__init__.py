"""lightning_dp: differentially private training for any PyTorch Lightning project.

Add :class:`DPStrategy` to your Trainer; add callbacks for accounting
(:class:`PrivacyBudget`), optimizer variants (:class:`AdamVariant`) and monitoring.
See the README for a quickstart.
"""

from lightning_dp.accounting import LedgerEntry, PrivacyLedger, calibrate_noise, epsilon, ledger_epsilon
from lightning_dp.callbacks import AdamVariant, PrivacyBudget, SecondMomentMonitor
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.losses import per_example_token_mean
from lightning_dp.optim import DPAdagrad, DPAdam
from lightning_dp.strategy import DPStrategy

__version__ = "0.1.0"

__all__ = [
    "AdamVariant",
    "DPAdagrad",
    "DPAdam",
    "DPStrategy",
    "LedgerEntry",
    "PrivacyBudget",
    "PrivacyConfigurationError",
    "PrivacyLedger",
    "SecondMomentMonitor",
    "__version__",
    "calibrate_noise",
    "epsilon",
    "ledger_epsilon",
    "per_example_token_mean",
]
