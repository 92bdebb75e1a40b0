"""Rule 3 for the optimizer (privacy/boundary/__init__.py): a learning rate (or any hyper-parameter of a parameter
group) set from the batch or its loss — in training_step, the backward or a batch hook — is refused before the
release it would steer; a scheduler stepping after the update is not."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from cases import Classifier, data, fit, loader, parameters, plain_step, strategy, unchanged
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader

from lightning_dp import PrivacyConfigurationError


class LossSetsLearningRate(Classifier):
    """Sets the learning rate from the batch's loss in training_step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.optimizers().param_groups[0]["lr"] = 0.1 + float(loss.detach())
        return loss


class LaterMomentumFromLabels(Classifier):
    """From the third batch on, sets SGD's momentum from the share of positive labels."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0, momentum=0.0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx >= 2:
            self.optimizers().param_groups[0]["momentum"] = float((batch[1] == 1).float().mean())
        return super().training_step(batch, batch_idx)


class BatchEndSetsLearningRate(Classifier):
    """Halves the learning rate at batch end when the loss is small."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if float(outputs["loss"]) < 100:
            self.optimizers().param_groups[0]["lr"] *= 0.5


class StepScheduled(Classifier):
    """A LambdaLR stepped by Lightning after every update (a function of the step count only)."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


@pytest.mark.parametrize("model, key", [(LossSetsLearningRate, "param_groups[0].lr"),
                                        (BatchEndSetsLearningRate, "param_groups[0].lr")])
def test_a_hyperparameter_set_from_the_batch_is_refused_before_any_release(model, key):
    m = model()
    before = parameters(m)
    pattern = r"hyper-parameters or state.* changed .*" + key.replace("[", r"\[")
    with pytest.raises(PrivacyConfigurationError, match=pattern):
        fit(m, steps=3)
    assert unchanged(before, m)


def test_a_write_that_starts_later_is_refused_before_that_steps_release():
    """Gated on steps 2 and 3 only: neither the first step's replays (as now and as at the plan's last step) nor
    their exchanged batch meet it; the step's own comparison refuses it before its release."""
    strategy_steps = []

    class Record(LaterMomentumFromLabels):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.trainer.global_step in (2, 3):
                self.optimizers().param_groups[0]["momentum"] = float((batch[1] == 1).float().mean())
            return Classifier.training_step(self, batch, batch_idx)

        def on_after_backward(self) -> None:
            strategy_steps.append(self.trainer.global_step)

    with pytest.raises(PrivacyConfigurationError, match=r"param_groups\[0\]\.momentum"):
        fit(Record(), steps=6, n=256)
    assert strategy_steps == [0, 1], "the third step's release was refused, the first two made"


def test_a_write_from_a_later_batch_is_refused_on_the_first_step():
    """From the third batch of an epoch on: the first step's replays as at the plan's last step, on the batch with
    its labels exchanged, set another momentum: refused before any release."""
    model = LaterMomentumFromLabels()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"param_groups\[0\]\.momentum"):
        fit(model, steps=6, n=256)
    assert unchanged(before, model)


def test_a_scheduler_stepping_after_the_update_is_allowed():
    dp = fit(StepScheduled(), steps=4)
    assert dp.ledger.steps == 4


def test_a_plain_loop_is_checked_between_begin_and_release():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    step, opt, batches = plain_step(model)
    try:
        for attempt in range(2):
            opt.zero_grad()
            x, y = next(batches)
            step.begin()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if attempt == 1:
                opt.param_groups[0]["lr"] = float(loss)
                with pytest.raises(PrivacyConfigurationError, match=r"param_groups\[0\]\.lr"):
                    step.release(optimizer=opt)
            else:
                step.release(optimizer=opt)
                opt.step()
                opt.param_groups[0]["lr"] = 0.05  # after the update, before the next step: a schedule's place
    finally:
        step.detach()


class WritesAdamMoment(Classifier):
    """Adds the batch's mean feature to Adam's first moments in training_step (from the second step, when they
    exist)."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        for state in self.optimizers().optimizer.state.values():
            state["exp_avg"].add_(batch[0].mean())
        return loss


def test_the_optimizer_state_written_from_the_batch_is_refused_before_that_release():
    with pytest.raises(PrivacyConfigurationError, match=r"optimizer state\[0\]\[0\]\.exp_avg"):
        fit(WritesAdamMoment(), steps=3)


def test_a_parameter_written_through_data_is_refused_before_the_release():
    """``p.data.copy_`` moves neither the storage nor the version counter: the parameter's norm shows it (in a plain
    loop, where no batch check runs between begin and release)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    step, opt, batches = plain_step(model, verify="first_step")
    try:
        for attempt in range(2):
            opt.zero_grad()
            x, y = next(batches)
            step.begin()
            nn.functional.cross_entropy(model(x), y).backward()
            if attempt == 1:
                model[2].bias.data.copy_(x[:2, 0])
                with pytest.raises(PrivacyConfigurationError, match=r"contents of parameter 2\.bias"):
                    step.release(optimizer=opt)
            else:
                step.release(optimizer=opt)
                opt.step()
    finally:
        step.detach()


class BatchEndWarmup(Classifier):
    """A linear warm-up set at batch end from the step count alone (public: the same whatever the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.rates: list[float] = []

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        for group in self.optimizers().optimizer.param_groups:
            group["lr"] = min(1.0, (self.global_step + 1) / 10)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.rates.append(optimizer.param_groups[0]["lr"])


def test_a_warmup_from_the_step_count_at_batch_end_is_allowed_and_the_replays_leave_the_rate_as_it_was():
    model = BatchEndWarmup()
    dp = fit(model, steps=4, public_state=["rates"])
    assert dp.ledger.steps == 4
    assert model.rates == pytest.approx([1.0, 0.2, 0.3, 0.4]), \
        "the first update at the optimizer's own rate: the replays' warm-up values were put back"


class LateBatchEndSetsLearningRate(Classifier):
    """Sets the learning rate from the loss at batch end, from the third batch of an epoch on."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx >= 2:
            self.optimizers().optimizer.param_groups[0]["lr"] = 0.1 * float(outputs["loss"])


def test_a_rate_set_from_the_loss_only_later_in_an_epoch_is_refused_before_any_release():
    """The replay as of the plan's last step runs with an epoch's last batch_idx."""
    m = LateBatchEndSetsLearningRate()
    before = parameters(m)
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)from the batch.*param_groups\[0\]\.lr"):
        fit(m, steps=6)
    assert unchanged(before, m)


class StashInDefaults(Classifier):
    """Keeps the last loss in the optimizer's ``defaults`` and scales the next loss by it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * self.optimizers().optimizer.defaults.get("memory", 1.0)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.optimizers().optimizer.defaults["memory"] = float(outputs["loss"])


def test_data_kept_in_the_optimizers_defaults_is_refused_before_any_release():
    m = StashInDefaults()
    before = parameters(m)
    with pytest.raises(PrivacyConfigurationError, match=r"optimizer defaults\.memory"):
        fit(m, steps=3)
    assert unchanged(before, m)


def test_the_replays_leave_the_optimizer_as_they_found_it():
    """A key a replayed hook adds to a parameter group, or a rate it sets, is gone after the replays; what they set
    alike is not called steered, what they set apart is."""
    from lightning_dp.validators.steered_settings import steered_hyperparameters

    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.5)
    values = iter([1.0, 2.0])

    def alike() -> None:
        opt.param_groups[0]["seen"] = 3
        opt.param_groups[0]["lr"] = 0.1

    def apart() -> None:
        opt.param_groups[0]["lr"] = next(values)

    assert steered_hyperparameters(opt, [alike, alike]) == []
    assert steered_hyperparameters(opt, [apart, apart]) == ["optimizer param_groups[0].lr"]
    assert opt.param_groups[0]["lr"] == 0.5 and "seen" not in opt.param_groups[0]


# ---------------------------------------------------------------------------- decisions from the training data


class TrainingAccuracyRate(pl.Callback):
    """Sets the learning rate from the training set's accuracy at every epoch's end (read from the tensors)."""

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        xs, ys = trainer.train_dataloader.dataset.tensors
        with torch.no_grad():
            accuracy = float((module(xs).argmax(1) == ys).float().mean())
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = 0.1 * accuracy


class StopsOnALowBatchLoss(Classifier):
    """Stops training once a batch's loss is small (from the third epoch)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.current_epoch >= 2 and float(outputs["loss"]) < 5.0:
            self.trainer.should_stop = True


class EpochDecay(Classifier):
    """Halves the learning rate at every epoch's end: a schedule, from no data."""

    def on_train_epoch_end(self) -> None:
        for group in self.trainer.optimizers[0].param_groups:
            group["lr"] *= 0.5


def test_a_rate_set_from_a_training_statistic_at_epoch_end_is_refused_before_any_release():
    model = Classifier()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match="from the training data by the hooks that see no batch.*lr"):
        fit(model, steps=12, callbacks=[TrainingAccuracyRate()])
    assert unchanged(before, model)


def test_a_stop_decided_from_the_loss_is_refused_before_any_release():
    model = StopsOnALowBatchLoss()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match="trainer should_stop"):
        fit(model, steps=20)
    assert unchanged(before, model)


def test_an_epoch_schedule_and_an_epoch_report_train():
    class Report(pl.Callback):
        accuracy = 0.0

        def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            xs, ys = trainer.train_dataloader.dataset.tensors
            with torch.no_grad():
                print(f"training accuracy {float((module(xs).argmax(1) == ys).float().mean()):.2f}")

    model = EpochDecay()
    dp = fit(model, steps=12, callbacks=[Report()])
    assert dp.ledger.steps == 12
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.5 ** model.trainer.current_epoch)


class EndsTheEpochOnPositives(Classifier):
    """Ends the epoch (on_train_batch_start returns -1) on a batch with many positive labels."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        return -1 if float(batch[1].float().mean()) > 0.6 else None


def test_an_epoch_ended_from_the_batch_is_refused_before_any_release():
    model = EndsTheEpochOnPositives()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"the epoch was ended \(on_train_batch_start returned -1\)"):
        fit(model, steps=12)
    assert unchanged(before, model)


def test_a_training_length_decided_from_the_training_data_is_refused_before_any_release():
    class Longer(pl.Callback):
        def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            xs, ys = trainer.train_dataloader.dataset.tensors
            with torch.no_grad():
                accuracy = float((module(xs).argmax(1) == ys).float().mean())
            trainer.fit_loop.max_epochs = 2 + int(10 * accuracy)

    model = Classifier()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match="trainer max_epochs"):
        fit(model, steps=12, callbacks=[Longer()])
    assert unchanged(before, model)


def test_the_replays_leave_the_run_as_it_was(tmp_path):
    """The first step replays the batch and epoch hooks several times: a checkpoint saved by hand at epoch end, a
    scheduler stepped by hand and the loggers see only the real epochs."""
    logged = []

    class SavesAndSteps(Classifier):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5 ** epoch)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "epoch", "frequency": 1000}}

        def on_train_epoch_end(self) -> None:
            self.lr_schedulers().step()
            self.trainer.save_checkpoint(tmp_path / f"epoch{self.current_epoch}.ckpt")
            self.trainer.logger.log_metrics({"epoch_seen": float(self.current_epoch)}, step=self.global_step)

    model = SavesAndSteps()
    trainer = quiet_trainer(strategy=strategy(), max_steps=12, logger=pl.loggers.CSVLogger(tmp_path))
    original = trainer.logger.log_metrics
    trainer.logger.log_metrics = lambda metrics, step=None: (logged.append(dict(metrics)), original(metrics, step))
    trainer.fit(model, loader())
    epochs = trainer.current_epoch
    assert model.lr_schedulers().last_epoch == epochs
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.5 ** epochs)
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == [f"epoch{e}.ckpt" for e in range(epochs)]
    assert [m["epoch_seen"] for m in logged if "epoch_seen" in m] == [float(e) for e in range(epochs)]


def test_the_checks_passes_leave_a_scheduler_stepped_by_hand_where_it_was():
    """A warm-up stepped by hand in on_train_batch_start: the probe's and the batch check's passes run that hook
    too, and put the scheduler back after each."""

    class ManualWarmup(Classifier):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 100))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step", "frequency": 10**6}}

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self.lr_schedulers().step()

    model = ManualWarmup()
    fit(model, steps=6, verify="every_step")
    assert model.lr_schedulers().last_epoch == 6
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(7 / 100)


class Teacher(pl.Callback):
    """Trains a teacher on the whole training set at every epoch's end (it never sees a batch)."""

    def __init__(self) -> None:
        self.head = nn.Linear(4, 2)

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        xs, ys = trainer.train_dataloader.dataset.tensors
        optimizer = torch.optim.SGD(self.head.parameters(), lr=0.5)
        with torch.enable_grad():
            for _ in range(5):
                optimizer.zero_grad()
                nn.functional.cross_entropy(self.head(xs), ys).backward()
                optimizer.step()


class Student(Classifier):
    """Distils the teacher's soft labels."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        teacher = next(cb for cb in self.trainer.callbacks if isinstance(cb, Teacher))
        with torch.no_grad():
            soft = nn.functional.softmax(teacher.head(x), 1)
        return -(soft * nn.functional.log_softmax(self(x), 1)).sum(1).mean()


class History(pl.Callback):
    """Keeps the training set's accuracy of every epoch (a report for a plot)."""

    def __init__(self) -> None:
        self.accuracy: list[float] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        xs, ys = trainer.train_dataloader.dataset.tensors
        with torch.no_grad():
            self.accuracy.append(float((module(xs).argmax(1) == ys).float().mean()))


def test_state_a_callback_computes_from_the_training_set_at_epoch_end_is_refused_before_any_release():
    model = Student()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"hooks that see no batch.*callback Teacher\.head"):
        fit(model, steps=12, callbacks=[Teacher()])
    assert unchanged(before, model)


def test_a_report_kept_from_the_training_set_trains_once_declared_public():
    with pytest.raises(PrivacyConfigurationError, match=r"callback History\.accuracy"):
        fit(Classifier(), steps=12, callbacks=[History()])
    history = History()
    dp = fit(Classifier(), steps=12, callbacks=[history], public_state=["History.accuracy"])
    assert dp.ledger.steps == 12 and len(history.accuracy) == 3, "the real epochs' reports only"


class FittedInTrainStart(Classifier):
    """Fits a frozen teacher submodule to the whole training set in on_train_start (released with the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Linear(4, 2).requires_grad_(False)

    def on_train_start(self) -> None:
        xs, ys = self.trainer.train_dataloader.dataset.tensors
        fitted = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(fitted.parameters(), lr=0.5)
        with torch.enable_grad():
            for _ in range(5):
                optimizer.zero_grad()
                nn.functional.cross_entropy(fitted(xs), ys).backward()
                optimizer.step()
        self.teacher.load_state_dict(fitted.state_dict())


class EpochTimer(pl.Callback):
    """Times every epoch (a wall-clock stamp: not the data's)."""

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        import time

        self.started = time.perf_counter()


def test_a_teacher_fitted_to_the_training_set_in_on_train_start_is_refused_before_any_release():
    model = FittedInTrainStart()
    before = parameters(model.net)
    with pytest.raises(PrivacyConfigurationError, match=r"on_train_start.*parameter teacher\.weight"):
        fit(model, steps=4)
    assert unchanged(before, model.net), "no release was made (the real on_train_start fitted the teacher)"


class Data(pl.LightningDataModule):
    def setup(self, stage: str) -> None:
        self.train_set = data(64)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=16)


class FittedInSetup(FittedInTrainStart):
    """The same teacher, fitted in setup (before training starts) to the datamodule's training set."""

    def setup(self, stage: str) -> None:
        xs, ys = self.trainer.datamodule.train_set.tensors
        fitted = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(fitted.parameters(), lr=0.5)
        for _ in range(5):
            optimizer.zero_grad()
            nn.functional.cross_entropy(fitted(xs), ys).backward()
            optimizer.step()
        self.teacher.load_state_dict(fitted.state_dict())

    def on_train_start(self) -> None:
        pass


class BuildsInSetup(Classifier):
    """Builds its head in setup and initialises it from a seeded generator (nothing from the data)."""

    def setup(self, stage: str) -> None:
        if not hasattr(self, "head"):
            self.head = nn.Linear(2, 2)
        with torch.no_grad():
            self.head.weight.copy_(torch.eye(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))


def test_a_teacher_fitted_before_training_is_refused_and_a_layer_built_in_setup_trains():
    """setup and on_fit_start are replayed with the hooks that see no batch; the model's structure and weights are
    put back after each replay (the replays do not build the head again, nor reset what training changed)."""
    model = FittedInSetup()
    with pytest.raises(PrivacyConfigurationError, match=r"parameter teacher\.weight"):
        quiet_trainer(strategy=strategy(), max_steps=4).fit(model, datamodule=Data())
    built = BuildsInSetup()
    dp = fit(built, steps=4)
    assert dp.ledger.steps == 4
    head = built.head
    assert any(p is head.weight for p in built.parameters()) and not torch.equal(head.weight, torch.eye(2))


class RateFromTheData(Classifier):
    """Sets the learning rate to 1/L, L the training set's largest squared singular value (a smoothness bound)."""

    def configure_optimizers(self):
        x, _ = self.trainer.datamodule.train_set.tensors
        bound = float(torch.linalg.matrix_norm(x, ord=2)) ** 2 / len(x)
        return torch.optim.SGD(self.parameters(), lr=1.0 / bound)


def test_a_learning_rate_configure_optimizers_takes_from_the_training_data_is_refused_before_any_release():
    model = RateFromTheData()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"configured optimizer 0 param_groups\[0\]\.lr"):
        quiet_trainer(strategy=strategy(), max_steps=4).fit(model, datamodule=Data())
    assert unchanged(before, model), "a release happened"


def test_a_timer_callback_trains():
    dp = fit(Classifier(), steps=8, callbacks=[EpochTimer()])
    assert dp.ledger.steps == 8


def test_a_random_jitter_of_the_rate_is_not_taken_for_the_data():
    """Every replay draws from the same seeds: a rate jittered by Python's random at batch end is the same in all."""
    import random

    class Jitter(Classifier):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            for group in self.trainer.optimizers[0].param_groups:
                group["lr"] = 1.0 + 0.1 * random.random()

    dp = fit(Jitter(), steps=6)
    assert dp.ledger.steps == 6


def test_a_hook_registered_in_on_train_start_is_registered_once():
    calls = []

    class Registers(Classifier):
        def on_train_start(self) -> None:
            self.net[0].register_forward_hook(lambda module, args, output: calls.append(1))

    model = Registers()
    fit(model, steps=2, public_state=["net.0._forward_hooks"])
    assert len(model.net[0]._forward_hooks) == 1


def test_a_rate_from_the_wall_clock_is_not_taken_for_the_data():
    """A rate decayed by elapsed time at batch end differs between two replays on the same examples: not the
    data's, not judged (a rate from the loss is: test_a_hyperparameter_set_from_the_batch_...)."""
    import time

    start = time.perf_counter()

    class WallClock(Classifier):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            for group in self.trainer.optimizers[0].param_groups:
                group["lr"] = 1.0 / (1.0 + time.perf_counter() - start)

    dp = fit(WallClock(), steps=6)
    assert dp.ledger.steps == 6
