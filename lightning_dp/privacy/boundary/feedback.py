"""A value logged from the training data does not feed back into training (the release boundary's rule 6 in
:mod:`lightning_dp.privacy.boundary`, rule 10 in docs/release_boundary.md).

``self.log("train_loss", loss)`` in ``training_step`` reports an un-noised statistic of the private batch. Reported,
it is outside the guarantee and says so (the README's caveats). Fed back, it is a release without noise: a
``ReduceLROnPlateau`` that monitors it sets the learning rate of every later release from it, an ``EarlyStopping``
sets the number of releases, a ``ModelCheckpoint`` chooses which released model is kept. So a monitored name
(a plateau scheduler's ``monitor``, any callback's ``monitor`` attribute) must not be one that a training hook
logged: :func:`~lightning_dp.validators.monitored.fed_back` finds them (the Lightning glue hands them to the
boundary). The values lightning_dp's callbacks log there are functions of the ledger (ε) and are exempt; a name
declared in ``public_state`` is too (the user says it is computed from public data only).

Monitor a metric of held-out data (``validation_step`` on records that are not the training set's) instead.
Checked before every release and when validation starts, on every rank alike.
"""

from __future__ import annotations

from typing import Iterable

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.validators.monitored import Finding

__all__ = ["Finding", "feedback_error"]


def feedback_error(found: Iterable[Finding]) -> PrivacyConfigurationError:
    """The refusal of :func:`~lightning_dp.validators.monitored.fed_back`'s findings, naming each consumer and the
    fix."""
    lines = "\n".join(f"- {who} monitors {name!r}, {why}" for who, name, why in found)
    return PrivacyConfigurationError(
        "A value logged from the private training batch feeds back into training:\n" + lines + "\nIt is not noised, "
        "so the learning rate, the stopping step or the kept checkpoint it chooses would leak the training data "
        "outside the guarantee. Monitor a metric of held-out data (logged in validation_step), or declare the name "
        "in DPStrategy(public_state=[...]) if it is computed from public data only "
        "(docs/release_boundary.md, rule 10).")
