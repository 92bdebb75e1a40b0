"""Statistics of the training data computed before training: exact, un-noised, and kept or trained on.

A normalisation layer holding the training features' mean and standard deviation (``register_buffer("mean",
x_train.mean(0))``), class weights from the training labels' frequencies (``CrossEntropyLoss(weight=1 / counts)``),
or features standardised with their own statistics (scikit-learn's ``StandardScaler().fit(x_train)``) are functions
of every training record that no noise covers: a buffer is released with the model (and saved in its checkpoints),
and data scaled by its own statistics makes every example's gradient depend on all the others. Whatever σ the
ledger counts, the trained model is then not differentially private.

:func:`data_statistics_held` looks, once before the first release, for

* tensors (and NumPy arrays, lists and tuples of numbers) held by the model's modules (buffers and attributes), the
  LightningDataModule, the optimizers and schedulers (their attributes, rate functions and classes of the user's, not
  their per-parameter state: :func:`~lightning_dp.record_checks.holders.code_holders`) and the training datasets' own
  attributes — the tensors beside the records too, those whose
  first dimension is no dataset's length (``self.mean = x.mean(0)`` applied in ``__getitem__``), compared with the
  statistics of the others, and what :mod:`.loader_statistics` walks to: a helper, a closure, the class — that
  equal, to float precision, a statistic of the training tensors (and of the datasets' NumPy record arrays, and of
  the arrays outside the dataset its items read, :mod:`.read_records`: a global ``X[i]``):
  per-feature and per-channel mean, standard deviation and variance, the features' global mean and
  standard deviation, the labels' class counts, frequencies, log frequencies (an output bias set to the log prior) and
  inverse frequencies (normalised to sum 1 or to mean 1), and for two classes the ratio of their counts (a
  ``pos_weight``) and each one's fraction (a focal loss's alpha) as single numbers unless round; a float target's
  (a regression's y) mean, standard deviation, and unless its values are all integers its median, minimum and
  maximum (to 4 float32 ulps), and the continuous features' global minimum and maximum; the parameters too
  (initialised from the data);
* per-feature order statistics at any level (a min-max scaler's buffers, a median and interquartile range, quantile
  bin edges; a range as a difference of two), and vectors of exact per-feature training values
  (:mod:`.order_statistics`); class-conditional means, standard deviations and variances (a prototype head,
  :mod:`.conditional_statistics`); a [D, D] whitening matrix of any kind, a covariance, correlation or uncentred second
  moment, its inverse or Cholesky factor (:mod:`.second_moments`). These are computed once per feature tensor,
  when a candidate of its width is held: on 100,000 × 64 float32 features about 1 s of one CPU core (the sort, the
  moments, the class statistics), the whole check about 5 s;
* rows of a parameter, buffer or attribute along a principal direction of the training features (a first layer
  initialised by PCA: an SVD of the training set, scikit-learn's ``PCA``; a randomised approximation,
  ``torch.pca_lowrank`` with fewer components than features, is not exact and not seen);
* per-record columns of the training tensors and the datasets' NumPy arrays derived from the labels' statistics: a
  sample-weight column equal to a class-weight formula at each record's label, a target-encoded feature
  (:mod:`.derived_columns`);
* feature tensors every column of which has mean 0 and standard deviation 1 (either convention), median 0 and
  interquartile range 1, or minimum 0 and maximum 1 with more than two values (most columns), to float precision:
  scaled by their own statistics; or holding statistics written into the records: missing cells filled with their
  column's mean or median (:mod:`.imputed_cells`), their class's or group's (:mod:`.grouped_fills`: the dataset's
  other tensors, the labels, are the groupings with the low-cardinality columns), or from the neighbouring records
  (:mod:`.neighbour_copies`: a forward fill, an interpolation), a projection on the training set's principal directions
  (:mod:`.decorrelated_columns`), values replaced by a function of their ranks (:mod:`.rank_columns`), columns
  clipped at their own percentiles (:mod:`.clipped_columns`); a regression target standardised, centred or min-max
  scaled by its own statistics (:mod:`.scaled_targets`).

* vectors held beside the records, in the model or the loader, that are *close* to a per-feature (or per-channel)
  statistic far beyond chance: rounded (``x.mean(0).round(decimals=3)``), of a random part of the training rows, or
  of them with others (:mod:`.near_statistics`); tables of numbers — dicts keyed by column or name, lists of
  per-column tuples or dicts — are read as the vectors they hold (:mod:`.number_tables`).

Values released by a DP mechanism that charged a ledger (:class:`~lightning_dp.data.PrivateStandardizer`'s mean and
standard deviation) are not refused (:mod:`.released_statistics`); features scaled by them pass by their noise.

The statistics are computed once and kept for the fit (:class:`~.training_statistics.TrainingStatistics`;
feature tensors scaled by their own statistics: :mod:`.scaled_records`): :mod:`.written_statistics` compares with them
what the hooks write during it, where the replays cannot see a path (a file saved before the fit read back).

Constant tensors are never taken for a statistic (a zero bias is not the mean of standardised data), nor is a scalar
within the tolerance of 0 or 1, statistic or candidate (a convolution's ``padding`` ``(0,)`` against the mean of
data normalised per record). Names declared
public are skipped (:func:`~lightning_dp.fingerprints.public_names.is_public`). What it cannot see: a statistic
transformed after it was computed other than by rounding (scaled — a robust standard deviation IQR / 1.349 —,
combined with public constants), a single number rounded or of a subset, vectors of a subset too few in columns or
records for :mod:`.near_statistics`' chance bound, quantiles of integer-valued columns alone other than their extremes,
a whitening matrix whose eps over the smallest eigenvalue exceeds its tolerance, and data scaled by its own
statistics in another way (to another range; a rank transform :mod:`.rank_columns` does not see).
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Iterable, Iterator, Optional, Sequence

from torch import Tensor, nn

from lightning_dp.records.library_code import library_rooted
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.fingerprints.dataset_tokens import dataset_parts
from lightning_dp.fingerprints.public_names import is_public
from lightning_dp.record_statistics.clipped_columns import CLIPPED, clip_fix
from lightning_dp.record_statistics.decorrelated_columns import decorrelated_fix
from lightning_dp.record_statistics.derived_columns import derived_columns, derived_columns_fix
from lightning_dp.record_statistics.imputed_cells import imputation_fix
from lightning_dp.record_statistics.loader_statistics import transform_holders
from lightning_dp.record_statistics.neighbour_copies import neighbour_fix
from lightning_dp.record_statistics.number_tables import number_columns
from lightning_dp.record_statistics.rank_columns import rank_fix
from lightning_dp.record_statistics.read_records import records_read
from lightning_dp.record_statistics.record_lengths import lengths_held
from lightning_dp.record_statistics.scaled_records import COPIED, IMPUTED, PROJECTED, RANKED
from lightning_dp.record_statistics.training_statistics import MAX_ELEMENTS, TrainingStatistics, real_numbers, \
    training_name
from lightning_dp.records.held_records import holds_records, row_digests
from lightning_dp.records.library_objects import framework_keys

__all__ = ["data_statistics_error", "data_statistics_held", "held_candidates", "records_in_weights"]

_DERIVED = ("a sample weight computed from the training labels' counts", "a target encoding of a category")


def data_statistics_held(holders: Iterable[tuple[str, Any]], dataset: Any, public: Sequence[str] = (),
                         loader: Any = None, charged: Optional[Collection[str]] = None,
                         kept: Optional[list["TrainingStatistics"]] = None) -> list[str]:
    """What ``holders`` ((path, object): modules, a datamodule), the training ``loader``'s collator and the datasets'
    transforms (:mod:`.loader_statistics`) keep that is a statistic of ``dataset``'s tensors or of its records'
    lengths (:mod:`.record_lengths`), which of its feature tensors are standardised with their own statistics, and
    which of the modules' parameters and buffers hold training records (:func:`records_in_weights`), as findings.
    ``charged``: the runs of the fit's ledger, whose DP releases pass (:mod:`.released_statistics`; ``None``: any).
    ``kept``: receives the :class:`TrainingStatistics` compared with, for the fit (:mod:`.written_statistics`)."""
    holders = list(holders)
    datasets, tensors = dataset_parts(dataset)
    in_weights = records_in_weights([m for _, m in holders if isinstance(m, nn.Module)], tensors, public)
    derived = derived_columns(datasets, tensors, public)  # per-record weights and target encodings
    holders += transform_holders(loader, datasets)
    lengths = lengths_held(_candidates([*holders, *((f"dataset {type(d).__name__}", d) for d in datasets)]),
                           tensors, public)
    read = records_read(dataset, tensors, MAX_ELEMENTS)  # records the items read from outside it (a global X[i])
    held = _statistics_held(holders, datasets, [*tensors, *read], public, charged, kept)
    return list(dict.fromkeys(in_weights + held + derived + lengths))


def records_in_weights(modules: Sequence[nn.Module], tensors: Sequence[tuple[str, Tensor]],
                       public: Sequence[str] = ()) -> list[str]:
    """The parameters and buffers of ``modules`` that hold training records before training: rows of a training
    tensor (prototypes, RBF centres or a memory initialised from examples; a buffer of sample inputs) or its labels
    (:func:`~lightning_dp.records.held_records.holds_records`). They are released with the model as they are
    — DP-SGD's noise covers the updates, not an initial value copied from the data."""
    digests = [(path, t, row_digests(t)) for path, t in tensors if t.numel()]
    found = []
    for module in modules:
        named = [*(("parameter", n, p) for n, p in module.named_parameters()),
                 *(("buffer", n, b) for n, b in module.named_buffers())]
        for kind, name, value in named:
            if is_public(name, public):
                continue
            for path, t, rows in digests:
                if holds_records(value.detach(), t, rows):
                    found.append(f"{kind} {name} holds records of the training {training_name(path, t)}")
                    break
    return found


def _statistics_held(holders: Sequence[tuple[str, Any]], datasets: Sequence[Any],
                     tensors: Sequence[tuple[str, Tensor]], public: Sequence[str],
                     charged: Optional[Collection[str]] = None,
                     kept: Optional[list["TrainingStatistics"]] = None) -> list[str]:
    statistics = TrainingStatistics(datasets, tensors, public, charged)
    if kept is not None:
        kept.append(statistics)
    found = statistics.scaled()
    if not statistics.stats:
        return found
    owners = [*holders, *((f"dataset {type(d).__name__}", d) for d in datasets)]
    for path, value in _candidates(owners):
        found.extend(statistics.held_by(path, value) or statistics.slices_held(path, value))
    return found


def data_statistics_error(found: Sequence[str]) -> PrivacyConfigurationError:
    """The refusal of :func:`data_statistics_held`'s findings."""
    lines = "\n".join(f"- {f}" for f in found[:6])
    records = ("Training records kept in the model's weights or buffers are released with it as they are (initialise "
               "prototypes, centres or memories from public data or at random). ") \
        if any(" holds records " in f for f in found) else ""
    derived = derived_columns_fix() + " " if any(f.endswith(_DERIVED) for f in found) else ""
    derived += "".join(fix() + " " for kind, fix in ((IMPUTED, imputation_fix), (COPIED, neighbour_fix),
                                                     (PROJECTED, decorrelated_fix), (RANKED, rank_fix),
                                                     (CLIPPED, clip_fix))
                       if any(kind in f for f in found))
    derived += "Set lengths to a public value (a round cap, the model's context size). " \
        if any("records' length" in f or "record's length" in f for f in found) else ""
    return PrivacyConfigurationError(
        "Statistics of the training data were computed without noise before training:\n" + lines + "\n" + records
        + derived + "They depend on "
        "every training record and no noise covers them: a buffer is released with the model and its checkpoints, "
        "and data scaled by its own statistics makes each example's gradient depend on all the others, so the model "
        "would not be differentially private whatever σ the ledger counts. Nothing was released. Fix: normalise "
        "with public constants (a known range: pixels / 255, digits / 16) or statistics of public data, standardise "
        "features with lightning_dp.data.PrivateStandardizer (a DP mean and standard deviation, charged to this "
        "fit's DPStrategy), weight classes by a public prior, initialise layers at random or from public data, or "
        "estimate them with a DP mechanism of your own and account for its ε (a value not derived from this "
        "training data: declare it, DPStrategy(public_state=[name])).")


def _candidates(owners: Iterable[tuple[str, Any]], parameters: bool = True,
                settled: Optional[Callable[[nn.Module], bool]] = None) -> Iterator[tuple[str, Any]]:
    """(path, value) of the tensors, arrays and number sequences the owners hold: a module's parameters (unless not
    ``parameters``), buffers and its submodules' attributes, another object's attributes (one level into lists,
    tuples and dicts of them). ``settled(m)``: a submodule whose attributes the caller knows unchanged since it last
    compared them (:class:`~.written_statistics.WrittenStatistics`' walk at each release): they are not yielded."""
    for label, owner in owners:
        if isinstance(owner, nn.Module):
            at = f"{label}." if label.startswith(("loader.", "dataset ")) else ""  # a transform the loader holds
            for name, p in owner.named_parameters() if parameters else ():  # initialised from the data: a log prior
                yield f"parameter {at}{name}", p
            for name, b in owner.named_buffers():
                yield f"buffer {at}{name}", b
            for prefix, m in owner.named_modules():
                if settled is not None and settled(m):
                    continue
                yield from _attributes(f"attribute {at}{prefix + '.' if prefix else ''}", m, framework_keys())
        else:
            yield from _attributes(f"{label}.", owner)


def _attributes(prefix: str, owner: Any, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, Any]]:
    for key, value in (vars(owner).items() if hasattr(owner, "__dict__") else ()):
        if isinstance(value, (nn.Module, nn.Parameter)) or key.startswith("__") or key in skip:
            continue
        yield f"{prefix}{key}", value
        yield from ((f"{prefix}{key}{suffix}", column) for suffix, column in number_columns(value))
        if isinstance(value, (list, tuple)) and 0 < len(value) <= 16 and not real_numbers(value):
            for i, item in enumerate(value):
                yield f"{prefix}{key}[{i}]", item
                yield from ((f"{prefix}{key}[{i}]{suffix}", column) for suffix, column in number_columns(item))
        elif isinstance(value, dict) and len(value) <= 64:
            for k, item in value.items():
                yield f"{prefix}{key}[{k!r}]", item
                yield from ((f"{prefix}{key}[{k!r}]{suffix}", column) for suffix, column in number_columns(item))
        elif hasattr(value, "__dict__") and not isinstance(value, (Tensor, type)) \
                and not library_rooted(type(value), ("torch", "pytorch_lightning", "lightning")):
            for k, item in vars(value).items():  # a transform object: Normalize(mean, std)
                if not k.startswith("__"):
                    yield f"{prefix}{key}.{k}", item


held_candidates = _candidates
"""What the owners hold that is compared with the statistics (public: :mod:`.written_statistics` walks it too)."""
