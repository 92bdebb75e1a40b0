"""Models fitted in this process outside the private mechanism, held by the model, a callback or the datamodule.

A teacher trained with a plain optimizer on the training set (300 Adam steps), frozen and held by the student — as a
submodule the private optimizer does not train, or outside the registry (in a list, a helper object, a closure) — has
memorised the data, and its soft targets pass what it memorised into every step: the ledger counts only the student's
releases. So does a fitted scikit-learn estimator held there (a random forest's split thresholds are midpoints of
training values, its leaves per-record label counts). The library cannot know what data they were fitted on; it can
know *that* they were fitted here (:mod:`lightning_dp.records.outside_steps` counts the steps of every optimizer that
is not a private step's), and refuses them before the first release unless declared public:
``DPStrategy(public_state=[name])`` for a teacher fitted on public data only. A teacher trained with DP first
(``DPStrategy``, a ``PrivateStep``) is not counted here: its releases continue the student's ledger (rule 9).

The model's own weights that the private optimizer trains, stepped here by another optimizer first (pretrained in a
plain loop on the same tensors, then given to ``trainer.fit``), are warned of once (:func:`warn_pretrained_outside`,
:class:`~lightning_dp.errors.OutsideStepsWarning`; refused when that warning is made an error): public pretraining is
legitimate, but it belongs in :func:`~lightning_dp.records.outside_steps.public_steps` (``PublicPretraining``'s
steps, its frozen layers included, are declared public by the callback itself). Not refused: a frozen module
never stepped in this process (random, or loaded from a file); the estimators whose fitted values the data-statistics
and vocabulary checks judge precisely (:data:`JUDGED_ELSEWHERE`: a scaler holding the training mean is refused
there, one fitted on public data is not).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Iterator, Optional, Sequence

from torch import nn

from lightning_dp.errors import OutsideStepsWarning, PrivacyConfigurationError, warn_or_refuse
from lightning_dp.records.outside_steps import stepped_outside
from lightning_dp.record_checks.holders import _Walk
from lightning_dp.fingerprints.public_names import is_public

JUDGED_ELSEWHERE = frozenset({"StandardScaler", "RobustScaler", "MinMaxScaler", "PCA",  # data_statistics.py
                              "LabelEncoder", "OneHotEncoder", "OrdinalEncoder", "LabelBinarizer",  # held_vocabulary
                              "MultiLabelBinarizer"})
"""scikit-learn classes a finer check judges by their fitted values (not refused here for being fitted)."""

_MODEL = "the model's attribute "
_WARNED: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()  # module → outside steps warned of


def outside_fits_held(module: nn.Module, optimizer: Optional[Any], holders: Iterable[tuple[str, Any]],
                      public: Sequence[str] = ()) -> list[str]:
    """What ``holders`` (the model first, then callbacks and the datamodule) hold that was fitted in this process
    outside the private mechanism: a submodule or a held module with parameters the private ``optimizer`` does not
    train (not in it, or frozen; with no optimizer: parameters that do not require grad) stepped by another
    optimizer, or a fitted
    scikit-learn estimator; those covered by ``public`` are left out."""
    params = module.parameters() if optimizer is None else (p for g in optimizer.param_groups for p in g["params"])
    trained = {id(p) for p in params if p.requires_grad}  # a frozen teacher in ``Adam(self.parameters())`` is not
    found: dict[str, int] = {}
    for name, p in module.named_parameters():
        if id(p) not in trained and stepped_outside(p) and not is_public(name, public):
            key = f"the model's submodule {name.split('.')[0]}"
            found[key] = found.get(key, 0) + 1
    walk = _FitsWalk()
    for label, owner in holders:
        walk.seen.add(id(owner))
        if isinstance(owner, nn.Module):
            for _ in walk.model(owner):
                pass
        else:
            walk.attributes(f"{label}.", owner, 1)
    for _ in walk.run():
        pass
    for path, held in walk.modules:
        count = sum(1 for name, p in held.named_parameters()
                    if id(p) not in trained and stepped_outside(p) and not _public(f"{path}.{name}", public))
        if count:
            found[f"{path} (a module held outside the model's registry)"] = count
    notes = [f"{what}: {n} parameter tensor(s) stepped by an optimizer that is not the private step's"
             for what, n in found.items()]
    return notes + [f"{path}: a fitted scikit-learn {type(est).__name__}" for path, est in walk.estimators
                    if not _public(path, public)]


def _public(path: str, public: Sequence[str]) -> bool:
    """Declared public: the path with the model's prefix taken off (``_t[0]``, ``helper.teacher``,
    ``MyCallback.clf``), or its first name (``_t``)."""
    bare = path[len(_MODEL):] if path.startswith(_MODEL) else path
    return is_public(bare, public) or is_public(bare.split("[")[0].split(".")[0], public)


def fitted_estimator(value: Any) -> bool:
    """A fitted scikit-learn estimator not judged elsewhere: its class from ``sklearn.``, with a ``fit`` method and
    fitted attributes (instance names ending in ``_``, not private)."""
    cls = type(value)
    if not (cls.__module__ or "").startswith("sklearn.") or cls.__name__ in JUDGED_ELSEWHERE:
        return False
    try:
        names = list(vars(value))
    except TypeError:
        return False
    return callable(getattr(value, "fit", None)) and any(
        isinstance(k, str) and k.endswith("_") and not k.startswith("_") for k in names)


class _FitsWalk(_Walk):
    """The holders' walk (:mod:`lightning_dp.record_checks.holders`), keeping the modules held outside the model and
    the fitted estimators."""

    def __init__(self) -> None:
        super().__init__()
        self.modules: list[tuple[str, nn.Module]] = []
        self.estimators: list[tuple[str, Any]] = []

    def module(self, path: str, value: nn.Module, depth: int) -> Iterator[tuple[str, Any]]:
        self.modules.append((path, value))
        yield from super().module(path, value, depth)

    def callable_or_object(self, path: str, value: Any, depth: int) -> Iterator[tuple[str, Any]]:
        if fitted_estimator(value):
            self.estimators.append((path, value))
            return
        yield from super().callable_or_object(path, value, depth)


def outside_fit_error(found: Sequence[str]) -> PrivacyConfigurationError:
    """The refusal of :func:`outside_fits_held`'s findings."""
    lines = "\n".join(f"- {f}" for f in found[:6])
    return PrivacyConfigurationError(
        "Models fitted in this process outside the private step are held by the model, a callback or the "
        "datamodule:\n" + lines + "\nA model fitted without noise (a teacher trained with a plain optimizer, a "
        "scikit-learn estimator) may have memorised the training data, and its outputs (soft targets, features) "
        "pass it into every step: the ledger counts only this fit's releases, so the model would not be "
        "differentially private whatever σ it counts. Nothing was released. Train it with DP (DPStrategy or a "
        "PrivateStep: its ledger then continues into this model's), or, if it was fitted on public data only, "
        "declare it public: DPStrategy(public_state=[<its attribute name>]).")


def warn_pretrained_outside(module: nn.Module, optimizer: Optional[Any]) -> None:
    """Warn once (per module and count of steps) when trainable parameters of ``module`` that the private
    ``optimizer`` trains were stepped in this process by an optimizer outside the mechanism; a refusal when
    :class:`~lightning_dp.errors.OutsideStepsWarning` is an error (``warnings.simplefilter("error", ...)``)."""
    params = module.parameters() if optimizer is None else (p for g in optimizer.param_groups for p in g["params"])
    counts = [stepped_outside(p) for p in {id(p): p for p in params if p.requires_grad}.values()]
    stepped, steps = sum(1 for c in counts if c), max(counts, default=0)
    if not stepped or _WARNED.get(module, 0) >= steps:
        return
    _WARNED[module] = steps
    message = (f"{stepped} of the trainable parameter tensors this private fit trains were stepped up to {steps} "
               "time(s) in this process by an optimizer outside the private step (a plain loop, a fit without "
               "DPStrategy) before it. If those steps saw the private data, they are releases without noise that no "
               "ledger counts, and the model is not differentially private whatever σ this fit counts. Steps on "
               "public data go inside `with lightning_dp.public_steps():` (or the PublicPretraining callback); steps "
               "on the private data must be charged: train them with DPStrategy or a PrivateStep (the ledger then "
               "continues). To refuse such fits: warnings.simplefilter(\"error\", lightning_dp.OutsideStepsWarning).")
    warn_or_refuse(OutsideStepsWarning, message)
