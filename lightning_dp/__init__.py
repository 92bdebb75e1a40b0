"""lightning_dp: differentially private training for any PyTorch Lightning project.

Add :class:`DPStrategy` to your Trainer; add callbacks for accounting, optimizer
variants and monitoring. See the README for a quickstart.
"""

from lightning_dp.accounting.ledger import LedgerEntry, PrivacyLedger
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.strategy import DPStrategy

__version__ = "0.1.0"

__all__ = ["DPStrategy", "LedgerEntry", "PrivacyConfigurationError", "PrivacyLedger", "__version__"]
