"""Evaluation of the training records outside a fit: ``trainer.validate``/``test``/``predict`` on them (zoo20 h1).

Inside a fit, validation on the training records may not steer training (rule 10: :mod:`.monitored`). Between two
fits the same output steers the next one unseen: a learning rate chosen from ``trainer.validate(model, train_loader)``,
example weights from ``trainer.predict`` on the training set. Outside a fit the strategy cannot see where the value
goes, and it is un-noised output of the private data: an evaluation stage run through a private strategy on a loader
over the training population of a fit that strategy or that module made is refused, unless declared public
(``public_state=["trainer.validate"]``, ``"trainer.test"``, ``"trainer.predict"``: a report accepted to leave like a
logged metric).

Which records: :func:`note_training` keeps, at each fit's training loader, the digests of the rows of its identifying
items (:func:`~lightning_dp.record_checks.stored_sources.identifying_rows`: one row per record, not a label column) at
the population's
indices; :func:`check_evaluation` finds an evaluation loader's records among them (a copy of the tensors in other
memory, another dataset object over them), or its dataset is the training dataset itself, on indices in common. A
share under :data:`~lightning_dp.record_checks.stored_sources.OVERLAP` of the evaluated records is natural (equal
records in two sources). A
plain ``pl.Trainer`` without a private strategy is outside the library's reach (docs/release_boundary.md).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import numpy as np

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.fingerprints.public_names import is_public
from lightning_dp.validators.monitored import _positions, _records
from lightning_dp.record_checks.stored_sources import OVERLAP, identifying_rows

Population = tuple[Any, Optional[set[int]], dict[tuple, np.ndarray]]
"""(a weak reference to the training dataset under its ``Subset`` wrappers, its indices trained on — ``None``: all —,
per kind of identifying item the sorted digests of the rows trained on)."""

_TRAINED: "weakref.WeakKeyDictionary[Any, Population]" = weakref.WeakKeyDictionary()
"""The last fit's training population, by strategy and by module."""


def _rows(loader: Any) -> tuple[Any, Optional[set[int]], dict[tuple, np.ndarray]]:
    """(the loader's dataset under its ``Subset`` wrappers, the indices of it the loader reads, their digests)."""
    base, rows = _records(loader.dataset, _positions(loader))
    picked = None if rows is None else np.asarray(sorted(rows), dtype=np.int64)
    digests = {kind: np.unique(d if picked is None else d[picked[picked < len(d)]])
               for kind, d in identifying_rows(base).items()}
    return base, rows, digests


def note_training(loader: Any, *owners: Any) -> Optional[tuple[Any, Optional[set[int]], dict[tuple, np.ndarray]]]:
    """A fit's training ``loader`` (the user's, before Poisson sampling): its population, kept for ``owners``.
    Returns (its dataset under the ``Subset`` wrappers, the indices of it read — ``None``: all —, their digests);
    ``None`` when not kept."""
    try:
        base, rows, digests = _rows(loader)
        population = (weakref.ref(base), rows, digests)
    except TypeError:  # a dataset without len() or weak references: not kept
        return None
    for owner in owners:
        if owner is not None:
            _TRAINED[owner] = population
    return base, rows, digests


def trained_dataset(*owners: Any) -> Optional[Any]:
    """The training dataset (under its ``Subset`` wrappers) of the last fit one of ``owners`` made, while it lives."""
    for owner in owners:
        dataset = _TRAINED[owner][0]() if owner is not None and owner in _TRAINED else None
        if dataset is not None:
            return dataset
    return None


def check_evaluation(loader: Any, stage: str, public: tuple[str, ...], label: str, *owners: Any) -> None:
    """Refuse the evaluation ``stage`` (``validate``, ``test``, ``predict``) of ``loader`` when it reads the training
    records of a fit one of ``owners`` (the strategy, the module) made, unless ``trainer.<stage>`` is declared
    public."""
    known = [_TRAINED[o] for o in owners if o is not None and o in _TRAINED]
    if not known or getattr(loader, "dataset", None) is None or is_public(f"trainer.{stage}", public):
        return
    try:
        base, rows, digests = _rows(loader)
    except TypeError:
        return
    for held, trained_rows, trained in known:
        if held() is base and (rows is None or trained_rows is None or rows & trained_rows):
            break
        n = max((len(d) for d in digests.values()), default=0)
        hits = max((int(np.isin(d, trained[k]).sum()) for k, d in digests.items() if k in trained), default=0)
        if hits and hits >= OVERLAP * n:
            break
    else:
        return
    raise PrivacyConfigurationError(
        f"trainer.{stage}(...) under {label} on a loader over the training records of a private fit of this model: "
        "its losses, metrics and predictions are computed from the private data without noise, and whatever they "
        "decide next (a learning rate, example weights, the next fit) leaves the guarantee. Evaluate on held-out "
        f"data (records the fit did not train on), or, if you accept that the result leaves unprotected like a "
        f"logged metric, declare it: {label}(public_state=['trainer.{stage}']).")
