"""Records read by the user's step itself (validators/record_reads.py): a training_step that reads the training
dataset — directly, through a Subset, by an inherited __getitem__ — is refused before its release; the loader's and
the checks' own reads, and other datasets, are not watched; the classes are left as they were."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Subset, SubsetRandomSampler, TensorDataset, random_split

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, data, parameters, strategy, unchanged  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.fingerprints.dataset_tokens import dataset_parts  # noqa: E402
from lightning_dp.validators.record_reads import refuse_record_reads  # noqa: E402


class ReadsNegatives(Classifier):
    """Reads a training record besides the batch (a margin from its features)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = self.trainer.train_dataloader.dataset[0]
        return super().training_step(batch, batch_idx) * (1.0 + 0.0 * x.abs().sum())


class Records(Dataset):
    """A dataset whose item access is inherited from its base."""

    def __init__(self) -> None:
        self.inner = data(64)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        return self.inner[i]


class Inherited(Records):
    pass


@pytest.mark.parametrize("dataset", [lambda: data(64), lambda: Subset(data(80), range(64)), Inherited],
                         ids=["TensorDataset", "Subset", "inherited __getitem__"])
def test_a_step_reading_training_records_is_refused_before_its_release(dataset):
    model = ReadsNegatives()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match="read records of the training dataset itself"):
        quiet_trainer(strategy=strategy(), max_steps=2).fit(model, DataLoader(dataset(), batch_size=16))
    assert unchanged(before, model)
    assert "__getitem__" not in Inherited.__dict__, "the class is left as it was"


def test_other_datasets_and_other_times_are_not_watched():
    watched, other = data(8), data(8)
    original = TensorDataset.__getitem__
    with refuse_record_reads(watched):
        other[0]
    watched[0]  # outside the step
    assert TensorDataset.__getitem__ is original
    with pytest.raises(PrivacyConfigurationError):
        with refuse_record_reads(watched):
            watched[1]
    assert TensorDataset.__getitem__ is original


def test_the_datasets_a_dataset_is_made_of_unwrap_subsets_and_concatenations():
    a, b = data(4), data(4)
    chain = Subset(torch.utils.data.ConcatDataset([a, Subset(b, [0, 1])]), [0, 5])
    found, tensors = dataset_parts(chain)
    assert any(d is a for d in found) and any(d is b for d in found) and len(found) == 5
    assert {id(t) for _, t in tensors} == {id(t) for t in (*a.tensors, *b.tensors)}


class InjectsAtBatchStart(Classifier):
    """Writes a training record into the batch in on_train_batch_start (a hard negative, outside the sample)."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        batch[0][0] = self.trainer.train_dataloader.dataset[0][0]


class ReadsAfterBackward(Classifier):
    """Reads a record in on_before_optimizer_step, from the third step on (after the first step's checks)."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.global_step >= 2:
            self.trainer.train_dataloader.dataset[3]


@pytest.mark.parametrize("model, released", [(InjectsAtBatchStart, 0), (ReadsAfterBackward, 2)])
def test_a_hook_of_the_step_reading_training_records_is_refused_before_the_update(model, released):
    m = model()
    dp = strategy()
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)hook Lightning runs in it\) read records"):
        quiet_trainer(strategy=dp, max_steps=4).fit(m, DataLoader(data(64), batch_size=16))
    assert m.trainer.global_step == released, "the refused step's update was not made"
    assert "__getitem__" not in TensorDataset.__dict__ or TensorDataset.__getitem__ is ORIGINAL


ORIGINAL = TensorDataset.__getitem__


class TrainingAccuracyAtEpochEnd(Classifier):
    """Reports the accuracy over the whole training set at epoch end (a report: allowed)."""

    def on_train_epoch_end(self) -> None:
        dataset = self.trainer.train_dataloader.dataset
        with torch.no_grad():
            right = sum(int(self(dataset[i][0][None]).argmax() == dataset[i][1]) for i in range(len(dataset)))
        self.accuracy = right / len(dataset)


def test_reading_the_training_set_outside_a_step_is_not_refused():
    m = TrainingAccuracyAtEpochEnd()
    dp = strategy(public_state=["accuracy"])
    quiet_trainer(strategy=dp, max_steps=8).fit(m, DataLoader(data(64), batch_size=16))
    assert dp.ledger.steps == 8 and 0 <= m.accuracy <= 1
    assert TensorDataset.__getitem__ is ORIGINAL, "the class is left as it was"


class Validated(Classifier):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", super().training_step(batch, batch_idx))


class KeepsARecordAtValidation(Validated):
    """Reads a training record at validation end and uses it as an extra negative in later steps."""

    def on_validation_epoch_end(self) -> None:
        self.memory = self.trainer.train_dataloader.dataset[0][0][None]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        memory = getattr(self, "memory", None)
        return loss if memory is None else loss + 0.0 * self(memory).sum()


class KeepsAValidationLoss(Validated):
    """Keeps its last validation loss to scale the training loss by (validated on the training records)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.scale = float(Classifier.training_step(self, batch, batch_idx))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * getattr(self, "scale", 1.0)


def _fit_validated(model: Classifier, validation_data: Any) -> Any:
    dp = strategy()
    train = data(64)
    validation = train if validation_data is None else validation_data  # one batch: fetched before validation starts
    quiet_trainer(strategy=dp, max_steps=8, val_check_interval=2, num_sanity_val_steps=0).fit(
        model, DataLoader(train, batch_size=16), DataLoader(validation, batch_size=len(validation)))
    return dp


@pytest.mark.parametrize("model", [KeepsARecordAtValidation, KeepsAValidationLoss])
def test_state_kept_by_validation_after_reading_training_records_is_refused(model):
    m = model()
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)during validation after it read training data.*"
                                                        r"attribute (memory|scale)"):
        _fit_validated(m, None if model is KeepsAValidationLoss else data(32, seed=1))
    assert m.trainer.strategy.ledger.steps == 2, "refused at the first validation's end"


def test_validation_on_the_training_records_that_keeps_nothing_passes():
    assert _fit_validated(Validated(), None).ledger.steps == 8


def _fit_split(model: Classifier, kind: str) -> Any:
    """Train on 64 of 96 records of one dataset, validate on the rest (or, ``overlapping``, on 16 of the 64 too)."""
    full, dp = data(96), strategy()
    order = torch.randperm(96, generator=torch.Generator().manual_seed(0)).tolist()
    rows = order[48:] if kind == "overlapping samplers" else order[64:]
    train = DataLoader(full, batch_size=16, sampler=SubsetRandomSampler(order[:64]))
    if kind == "random_split":
        held, rest = random_split(full, [64, 32], generator=torch.Generator().manual_seed(0))
        train, val = DataLoader(held, batch_size=16), DataLoader(rest, batch_size=32)
    else:
        val = DataLoader(full, batch_size=len(rows), sampler=SubsetRandomSampler(rows))
    quiet_trainer(strategy=dp, max_steps=8, val_check_interval=2, num_sanity_val_steps=0).fit(model, train, val)
    return dp


@pytest.mark.parametrize("kind", ["disjoint samplers", "random_split"])
def test_state_kept_by_validation_on_held_out_records_of_the_training_dataset_passes(kind):
    """Validation reads the training dataset's object, but only records training never reads (a SubsetRandomSampler
    split, a random_split): what it keeps is held-out data's (the reads are told only for training rows)."""
    assert _fit_split(KeepsAValidationLoss(), kind).ledger.steps == 8


def test_state_kept_by_validation_on_overlapping_samplers_is_refused():
    m = KeepsAValidationLoss()
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)during validation after it read training data.*"
                                                        r"attribute scale"):
        _fit_split(m, "overlapping samplers")
    assert m.trainer.strategy.ledger.steps == 2, "refused at the first validation's end"


class ShowsARecordAtBatchEnd(Classifier):
    """Looks at a training record at batch end (a report: allowed where it really runs)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.trainer.train_dataloader.dataset[0]


def test_a_batch_end_read_is_not_counted_when_the_checks_replay_the_hook():
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=3).fit(ShowsARecordAtBatchEnd(), DataLoader(data(64), batch_size=16))
    assert dp.ledger.steps == 3


class CrashesOnce(Classifier):
    """Raises in training_step at step 2 (a user's sanity check), as a NaN guard would."""

    crash_at = 2

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.crash_at:
            raise RuntimeError("loss is NaN")
        return super().training_step(batch, batch_idx)


def test_a_copy_of_a_module_whose_fit_crashed_inside_the_step_trains() -> None:
    """Lightning leaves the module's current hook name at ``training_step`` when it raises; a copy of it carries the
    name, and the loader's reads before the next fit's first step were taken for the step's."""
    import copy

    model = CrashesOnce()
    with pytest.raises(RuntimeError, match="NaN"):
        quiet_trainer(strategy=strategy(), max_steps=6).fit(model, DataLoader(data(64), batch_size=16))
    again = copy.deepcopy(model)
    again.crash_at = -1
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=3).fit(again, DataLoader(data(64), batch_size=16))
    assert dp.ledger.steps >= 3


def test_a_read_elsewhere_is_told_unless_it_reads_only_rows_training_never_reads():
    """RecordWatch.rows: an index, a negative one, a list (``__getitems__``) of held-out rows is not told; a training
    row, or a key the watch cannot read (a slice), is."""
    from lightning_dp.validators.record_reads import RecordWatch

    full, told = data(8), []
    watch = RecordWatch(full, counting=lambda: False, elsewhere=lambda: told.append(1))
    watch.rows = {id(full): {0, 1, 2, 3}}
    watch.start()
    try:
        for key, tells in [(5, False), (-1, False), (torch.tensor(6), False), (2, True), (-8, True),
                           (slice(4, 6), True)]:
            told.clear()
            full[key]
            assert bool(told) is tells, key
        assert watch._held_out(full, ([4, 5],)) and not watch._held_out(full, ([4, 3],))  # __getitems__' keys
    finally:
        watch.stop()
    assert TensorDataset.__getitem__ is ORIGINAL
