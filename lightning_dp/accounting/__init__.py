"""Privacy accounting: ε of a setting or a ledger, σ for a target, a running RDP total.

Thin layer over maintained accountants (Opacus RDP/PRV, dp-accounting PLD); see
:mod:`lightning_dp.accounting.accountants` for the registry and what each one gives.
"""

from typing import TYPE_CHECKING

from lightning_dp._lazy import lazy_exports

_EXPORTS = {
    "BudgetReservation": "lightning_dp.accounting.reservation",
    "EpsilonCeiling": "lightning_dp.accounting.ceiling",
    "INTEGER_ORDERS": "lightning_dp.accounting.rdp",
    "LedgerEntry": "lightning_dp.accounting.ledger",
    "PrivacyLedger": "lightning_dp.accounting.ledger",
    "RDP_ORDERS": "lightning_dp.accounting.rdp",
    "RunningRDP": "lightning_dp.accounting.running_rdp",
    "available_accountants": "lightning_dp.accounting.accountants",
    "calibrate_noise": "lightning_dp.accounting.calibration",
    "epsilon": "lightning_dp.accounting.epsilon",
    "forget_data_releases": "lightning_dp.accounting.data_ledgers",
    "get_accountant": "lightning_dp.accounting.accountants",
    "ledger_epsilon": "lightning_dp.accounting.epsilon",
    "rdp_to_epsilon": "lightning_dp.accounting.rdp",
    "register_accountant": "lightning_dp.accounting.accountants",
    "running_for": "lightning_dp.accounting.running_rdp",
    "sampled_gaussian_rdp": "lightning_dp.accounting.sgm_rdp",
    "sampled_gaussian_rdp_upper": "lightning_dp.accounting.sgm_rdp",
    "sampled_gaussian_rdp_upper_many": "lightning_dp.accounting.sgm_rdp",
    "step_rdp": "lightning_dp.accounting.rdp",
    "steps_within_budget": "lightning_dp.accounting.horizon",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

# Bound now: the submodule ``epsilon`` would otherwise shadow the function of the same name.
from lightning_dp.accounting.epsilon import epsilon, ledger_epsilon  # noqa: E402

if TYPE_CHECKING:  # names load on first use (numpy/scipy/Opacus only when accounting is used)
    from lightning_dp.accounting.accountants import available_accountants, get_accountant, register_accountant
    from lightning_dp.accounting.calibration import calibrate_noise
    from lightning_dp.accounting.ceiling import EpsilonCeiling
    from lightning_dp.accounting.data_ledgers import forget_data_releases
    from lightning_dp.accounting.epsilon import epsilon, ledger_epsilon
    from lightning_dp.accounting.horizon import steps_within_budget
    from lightning_dp.accounting.ledger import LedgerEntry, PrivacyLedger
    from lightning_dp.accounting.rdp import INTEGER_ORDERS, RDP_ORDERS, rdp_to_epsilon, step_rdp
    from lightning_dp.accounting.reservation import BudgetReservation
    from lightning_dp.accounting.running_rdp import RunningRDP, running_for
    from lightning_dp.accounting.sgm_rdp import (
        sampled_gaussian_rdp,
        sampled_gaussian_rdp_upper,
        sampled_gaussian_rdp_upper_many,
    )

__all__ = [
    "BudgetReservation",
    "EpsilonCeiling",
    "INTEGER_ORDERS",
    "LedgerEntry",
    "PrivacyLedger",
    "RDP_ORDERS",
    "RunningRDP",
    "available_accountants",
    "calibrate_noise",
    "epsilon",
    "forget_data_releases",
    "get_accountant",
    "ledger_epsilon",
    "rdp_to_epsilon",
    "running_for",
    "register_accountant",
    "sampled_gaussian_rdp",
    "sampled_gaussian_rdp_upper",
    "sampled_gaussian_rdp_upper_many",
    "step_rdp",
    "steps_within_budget",
]
