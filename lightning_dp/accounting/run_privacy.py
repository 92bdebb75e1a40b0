"""One source of truth for the δ and the accountant at which a run's ε is reported.

:class:`~lightning_dp.DPStrategy` holds the run's privacy parameters: ``target_delta`` (the δ
of its guarantee, when given) and ``accountant`` (the accountant of its calibration: the run's
accountant). Everything that reports the ε of a run — :class:`~lightning_dp.PrivacyBudget`
and the summary of ``lightning-dp fit`` — takes δ and the accountant from the strategy, by
these rules (:func:`resolve_delta`, :func:`resolve_accountant`):

1. The strategy has the value: it is used. A *different* value given explicitly (e.g.
   ``PrivacyBudget(delta=1e-6)`` with ``DPStrategy(target_delta=1e-5)``) is refused with a
   :class:`~lightning_dp.errors.PrivacyConfigurationError` naming both values, unless the user
   marks it as meant with ``allow_mismatch=True`` (the command line: ``--allow_mismatch=true``);
   then the given value is used and the log says it differs from the strategy's.
2. The strategy has no δ (σ given as ``noise_multiplier``, no ``target_delta``): the δ given
   explicitly, else the default δ = 1/N^1.1 for N training examples (:func:`default_delta`).
   Either way the log names the δ used and where it came from.

Lightning-free: the strategy is read by attribute (``target_delta``, ``accountant``), so any
object with those attributes (or without them: rule 2) works.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from lightning_dp.accounting.accountants import get_accountant
from lightning_dp.accounting.checks import check_delta
from lightning_dp.errors import PrivacyConfigurationError

#: How the default δ is written in logs and docs.
DEFAULT_DELTA_RULE = "1/N^1.1"
#: The one way to mark a value that differs from the strategy's as meant (same name everywhere).
MARK = "allow_mismatch"


def default_delta(num_samples: int) -> float:
    """δ = 1 / N^1.1: below 1/N as it must be (docs/architecture.md), the choice of the
    DP-SignSGD paper's experiments. Used only when neither the strategy nor the user gives δ."""
    return 1.0 / float(num_samples) ** 1.1


@dataclass(frozen=True)
class Resolved:
    """A value and where it came from, in words (for the log line that names it)."""

    value: Any
    source: str


def strategy_delta(strategy: object) -> Optional[float]:
    """The strategy's ``target_delta`` (``None`` when it has none)."""
    value = getattr(strategy, "target_delta", None)
    return None if value is None else float(value)


def strategy_accountant(strategy: object) -> Optional[str]:
    """The strategy's ``accountant`` (``None`` when it has none)."""
    value = getattr(strategy, "accountant", None)
    return value if isinstance(value, str) else None


def _refuse(who: str, name: str, given: Any, attr: str, theirs: Any, mark: str) -> PrivacyConfigurationError:
    shown_given = f"{given:g}" if isinstance(given, float) else repr(given)
    shown_theirs = f"{theirs:g}" if isinstance(theirs, float) else repr(theirs)
    return PrivacyConfigurationError(
        f"{who}: {name}={shown_given} differs from the strategy's {attr}={shown_theirs}. The strategy is the "
        f"source of truth for the run's δ and accountant: remove {name} to report at the strategy's "
        f"{attr}={shown_theirs}, or change DPStrategy({attr}=...), or pass {mark} to report at "
        f"{name}={shown_given} on purpose."
    )


def resolve_delta(
    strategy: object,
    given: Optional[float] = None,
    *,
    allow_mismatch: bool = False,
    num_samples: Optional[int] = None,
    who: str = "PrivacyBudget",
    name: str = "delta",
    mark: str = f"{MARK}=True",
) -> Optional[Resolved]:
    """The δ to report at (module docs: rules 1 and 2).

    Args:
        strategy: the run's strategy (read: ``target_delta``).
        given: δ given explicitly by the user (``None``: not given).
        allow_mismatch: the user's mark that a ``given`` different from the strategy's is meant.
        num_samples: N, for the default 1/N^1.1; ``None`` (not known yet): returns ``None``
            when neither the strategy nor the user gives δ.
        who, name, mark: how the caller, its δ argument and the mark are spelled in messages.

    Raises:
        PrivacyConfigurationError: ``given`` differs from the strategy's ``target_delta``
            and ``allow_mismatch`` is false.
    """
    theirs = strategy_delta(strategy)
    if given is not None:
        given = check_delta(given)
        if theirs is None:
            return Resolved(given, f"{name} (the strategy has no target_delta)")
        if math.isclose(given, theirs, rel_tol=1e-9, abs_tol=0.0):
            return Resolved(theirs, "the strategy's target_delta")
        if not allow_mismatch:
            raise _refuse(who, name, given, "target_delta", theirs, mark)
        return Resolved(given, f"{name}, marked {mark}: the strategy's target_delta is {theirs:g}")
    if theirs is not None:
        return Resolved(theirs, "the strategy's target_delta")
    if num_samples:
        return Resolved(
            default_delta(num_samples),
            f"default δ = {DEFAULT_DELTA_RULE} for N = {num_samples} examples: no target_delta, no {name} given",
        )
    return None


def resolve_accountant(
    strategy: object,
    given: Optional[str] = None,
    *,
    allow_mismatch: bool = False,
    who: str = "PrivacyBudget",
    name: str = "accountant",
    mark: str = f"{MARK}=True",
) -> Resolved:
    """The accountant to report with: the strategy's (module docs: rule 1), else ``given``,
    else ``"rdp"``. A ``given`` different from the strategy's is refused unless ``allow_mismatch``."""
    if given is not None:
        get_accountant(given)  # unknown name: ValueError naming the choices
    theirs = strategy_accountant(strategy)
    if theirs is None:
        return Resolved(given or "rdp", f"{name}" if given else "default: the strategy has no accountant")
    if given is None or given == theirs:
        return Resolved(theirs, "the strategy's accountant")
    if not allow_mismatch:
        raise _refuse(who, name, given, "accountant", theirs, mark)
    return Resolved(given, f"{name}, marked {mark}: the strategy's accountant is {theirs!r}")
