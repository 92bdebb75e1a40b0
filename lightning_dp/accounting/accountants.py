"""A small registry of accountants for the sampled Gaussian mechanism (add/remove adjacency).

Each accountant maps a non-empty list of private, non-trivial ledger entries
(σ > 0, 0 < q ≤ 1, steps ≥ 1) and a δ to ε. All reuse maintained implementations:

``"rdp"``          Opacus' RDP analysis (``compute_rdp``) on Opacus' default orders, summed over
                   entries (RDP composes additively), converted with Balle et al. 2020, Thm. 21.
                   Fast, a valid upper bound, the default.
``"pld"``          Google dp-accounting's privacy-loss-distribution accountant (default
                   discretisation 1e-4). Tighter than RDP; ~0.1–1 s per call, more when the
                   ledger has many distinct (σ, q).
``"prv"``          Opacus' PRV accountant (Gopi et al. 2021), returns its upper bound
                   (``eps_error=0.01``). Tighter than RDP, about 0.01 above PLD.
``"integer_rdp"``  The DP-SignSGD paper's coarse method (docs/algorithms.md §6): integer orders
                   α ∈ {2, …, 20} and Mironov's conversion ε = RDP(α) + log(1/δ)/(α − 1).
                   Valid but loose; for comparison only.

Register more with :func:`register_accountant`.
"""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

import numpy as np

from lightning_dp.accounting.ledger import LedgerEntry
from lightning_dp.accounting.rdp import (
    INTEGER_ORDERS,
    RDP_ORDERS,
    rdp_to_epsilon,
    rdp_to_epsilon_mironov,
    step_rdp,
)

AccountantFn = Callable[[Sequence[LedgerEntry], float], float]

_REGISTRY: dict[str, AccountantFn] = {}


def register_accountant(name: str) -> Callable[[AccountantFn], AccountantFn]:
    """Decorator: register ``fn(entries, delta) -> ε`` under ``name``."""

    def wrap(fn: AccountantFn) -> AccountantFn:
        _REGISTRY[name] = fn
        return fn

    return wrap


def get_accountant(name: str) -> AccountantFn:
    """The accountant registered under ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown accountant {name!r}; choose one of {available_accountants()}") from None


def available_accountants() -> list[str]:
    """Names of the registered accountants."""
    return sorted(_REGISTRY)


def composed_rdp(entries: Sequence[LedgerEntry], orders: tuple[float, ...] = RDP_ORDERS) -> np.ndarray:
    """Per-order RDP of the whole list: Σ steps · one-step RDP (Mironov 2017, Prop. 1)."""
    total = np.zeros(len(orders))
    for e in entries:
        total = total + e.steps * step_rdp(e.noise_multiplier, e.sample_rate, orders)
    return total


@register_accountant("rdp")
def rdp_epsilon(entries: Sequence[LedgerEntry], delta: float) -> float:
    """Opacus RDP (default orders) composed additively, Balle et al. 2020 conversion."""
    return rdp_to_epsilon(composed_rdp(entries, RDP_ORDERS), RDP_ORDERS, delta)


@register_accountant("integer_rdp")
def integer_rdp_epsilon(entries: Sequence[LedgerEntry], delta: float) -> float:
    """The DP-SignSGD paper's grid: integer α ∈ {2..20}, Mironov's conversion (comparison only)."""
    return rdp_to_epsilon_mironov(composed_rdp(entries, INTEGER_ORDERS), INTEGER_ORDERS, delta)


@register_accountant("pld")
def pld_epsilon(entries: Sequence[LedgerEntry], delta: float) -> float:
    """dp-accounting's PLD accountant, default settings, add/remove adjacency."""
    import dp_accounting  # imported on first use: `import lightning_dp` stays light
    from dp_accounting.pld import PLDAccountant

    accountant = PLDAccountant()
    for e in entries:
        event = dp_accounting.PoissonSampledDpEvent(e.sample_rate, dp_accounting.GaussianDpEvent(e.noise_multiplier))
        accountant.compose(event, e.steps)
    return max(0.0, float(accountant.get_epsilon(delta)))


@register_accountant("prv")
def prv_epsilon(entries: Sequence[LedgerEntry], delta: float) -> float:
    """Opacus' PRV accountant (upper bound of its estimate, ``eps_error = 0.01``)."""
    from lightning_dp._opacus import import_opacus

    PRVAccountant = import_opacus("opacus.accountants").PRVAccountant  # imported on first use

    accountant = PRVAccountant()
    accountant.history = [(e.noise_multiplier, e.sample_rate, e.steps) for e in entries]
    with warnings.catch_warnings(), np.errstate(divide="ignore"):
        warnings.simplefilter("ignore", UserWarning)  # Opacus' internal RDP bound of the domain size
        eps = accountant.get_epsilon(delta)
    return max(0.0, float(eps))
