"""Kept state written before the release (on_train_batch_start, training_step, on_before_backward): judged like the
batch-end writes (hook_replays.BatchEndWrites). What every replay writes alike — a step counter, a batch counter —
or what the two replays on the same batch already set apart — a time stamp — trains without a declaration; what
other data set apart — a running mean of the batch, a count of its positives, a memory bank, the loss — is refused
before any release; and a write found alike on the first step that turns to the data later is met at the batch
check's steps (an epoch's first one), before that step's release."""

from __future__ import annotations

import time

import pytest
import torch
from cases import Classifier, fit, parameters, unchanged
from pytorch_lightning.callbacks import Callback

from lightning_dp.privacy.boundary import StateWrittenError


class StepCounter(Classifier):
    """``self.my_steps += 1`` in training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.my_steps = 0

    def training_step(self, batch, batch_idx):
        self.my_steps += 1
        return super().training_step(batch, batch_idx)


class BatchCounter(Callback):
    """A batch counter in on_train_batch_start."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches += 1


class BatchTimer(Callback):
    """A wall-clock time stamp at the batch's start, a duration at its end."""

    def __init__(self) -> None:
        self.last = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.last = time.perf_counter() - self._start


@pytest.mark.parametrize("verify", ["sampled", "every_step"])
def test_a_step_counter_in_training_step_trains_undeclared(verify):
    model = StepCounter()
    dp = fit(model, steps=5, verify=verify)
    assert dp.ledger.steps == 5
    assert model.my_steps == 5, "the checks' passes and replays leave no trace in the counter"


@pytest.mark.parametrize("verify", ["sampled", "every_step"])
def test_a_batch_counter_or_timer_in_on_train_batch_start_trains_undeclared(verify):
    counter, timer = BatchCounter(), BatchTimer()
    dp = fit(Classifier(), steps=5, callbacks=[counter, timer], verify=verify)
    assert dp.ledger.steps == 5
    assert counter.batches == 5 and timer.last > 0


class RunningMean(Classifier):
    """A running mean of the batch's features in training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.mean = torch.zeros(4)
        self.seen = 0

    def training_step(self, batch, batch_idx):
        self.seen += 1  # a counter beside it: accepted, the mean is not
        self.mean = 0.9 * self.mean + 0.1 * batch[0].mean(0)
        return super().training_step(batch, batch_idx)


class PositivesInBatchStart(Classifier):
    """A count of the positive labels in the module's on_train_batch_start."""

    def __init__(self) -> None:
        super().__init__()
        self.positives = 0

    def on_train_batch_start(self, batch, batch_idx):
        self.positives += int(batch[1].sum())


class BankInBatchStart(Classifier):
    """A memory bank of the batch's features, filled in on_train_batch_start."""

    def __init__(self) -> None:
        super().__init__()
        self.bank: list[torch.Tensor] = []

    def on_train_batch_start(self, batch, batch_idx):
        self.bank.append(batch[0].clone())


class PositivesCallback(Callback):
    """A callback counting positives in on_train_batch_start."""

    def __init__(self) -> None:
        self.positives = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.positives += int(batch[1].sum())


class LossBeforeBackward(Classifier):
    """The batch's loss kept in on_before_backward."""

    def __init__(self) -> None:
        super().__init__()
        self.loss = 0.0

    def on_before_backward(self, loss):
        self.loss = float(loss)


@pytest.mark.parametrize("factory,callbacks,what", [
    (RunningMean, [], "attribute mean"),
    (PositivesInBatchStart, [], "attribute positives"),
    (BankInBatchStart, [], "attribute bank"),
    (Classifier, [PositivesCallback()], "callback PositivesCallback.positives"),
    (LossBeforeBackward, [], "attribute loss"),
])
def test_state_the_data_sets_apart_before_the_release_is_refused_before_any_release(factory, callbacks, what):
    model = factory()
    before = parameters(model)
    with pytest.raises(StateWrittenError, match=rf"(?s)^Kept state written outside the release: [^\n]*{what}[^\n]*"
                                                rf"public_state[^\n]*\nState changed.*before its release.*set it apart"):
        fit(model, callbacks=callbacks)
    assert unchanged(before, model), "a release happened"


class TurnsToTheData(Classifier):
    """Writes its step count into ``last`` in training_step — alike on every data on the first step — until an epoch
    has ended (a flag its own on_train_epoch_end sets, which no replay of the first step brings about), then the
    batch's mean: the same entry, from the data."""

    def __init__(self) -> None:
        super().__init__()
        self.epochs_done = 0
        self.last = 0.0

    def training_step(self, batch, batch_idx):
        self.last = float(batch[0].mean()) if self.epochs_done else float(self.global_step)
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self):
        self.epochs_done += 1


def test_a_write_accepted_on_the_first_step_that_turns_to_the_data_is_refused_before_its_release():
    model = TurnsToTheData()
    with pytest.raises(StateWrittenError, match=r"(?s)before the release of step 4 .*set it apart.*attribute last"):
        fit(model, steps=8)  # 64 records, batches of 16 expected: the second epoch's first step is step 4
    assert model.trainer.strategy.ledger.steps == 4, "the first epoch released; the second epoch's first step not"
