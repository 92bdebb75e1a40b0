"""Kept state (validators/kept_state.py): what a step computes from its batch and keeps — a buffer of any dtype,
a Python attribute, a NumPy running mean, a callback's state — is refused before any release (or, for a write
that starts later, before the next one), unless declared public; a checkpoint is never written with it."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from cases import Classifier, fit, loader, parameters, strategy, unchanged
from conftest import quiet_trainer
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch import nn

from lightning_dp import PrivacyConfigurationError
from lightning_dp.privacy.boundary import StateWrittenError
from lightning_dp.validators.probe import StateWriteError

np = pytest.importorskip("numpy")


class IntegerCounter(Classifier):
    """Counts the positive labels it has seen in an int64 buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("positives", torch.zeros((), dtype=torch.long))

    def training_step(self, batch, batch_idx):
        self.positives += (batch[1] == 1).sum()
        return super().training_step(batch, batch_idx)


class BoolFlag(Classifier):
    """Remembers in a bool buffer whether any example had a large first feature."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("saw_large", torch.tensor(False))

    def training_step(self, batch, batch_idx):
        self.saw_large |= bool((batch[0][:, 0] > 0.5).any())
        return super().training_step(batch, batch_idx)


class MemoryBank(Classifier):
    """A queue of the batch's features kept as a plain attribute (in-batch negatives for later steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.bank: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.bank.append(batch[0].detach())
        return loss


class RunningMeanStd:
    """A NumPy running mean, a helper object of the user's own."""

    def __init__(self) -> None:
        self.mean = np.zeros(4)
        self.count = 0

    def update(self, x) -> None:
        self.count += len(x)
        self.mean = self.mean + (x.mean(0) - self.mean) * len(x) / self.count


class NumpyNormaliserAfterStep(Classifier):
    """Updates the normaliser in on_train_batch_end (after the release), saved in checkpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.normaliser = RunningMeanStd()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.normaliser.update(batch[0].numpy())


class FeatureQueueCallback(Callback):
    """A callback keeping the batch's inputs in its state (a hard-negative queue)."""

    def __init__(self) -> None:
        self.queue = torch.zeros(0, 4)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.queue = torch.cat([self.queue, batch[0]])[-32:]


class WarmupWriter(Classifier):
    """Keeps batch statistics from the third step on (global_step counts the updates made): the first step's replay,
    run as the module would run later in the plan too, refuses it before any release."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stat", torch.zeros(4))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step >= 2:
            self.stat.copy_(batch[0].mean(0))


LATE_CALL = 13
"""The late writers' first writing call: past the first step's replays of the batch hooks."""


class LateWriter(Classifier):
    """Keeps batch statistics from its own 13th call on: a counter of its own (declared public) that the first step's
    replays (twelve calls — plain twice, moved, plain twice, exchanged, as now and as at the plan's last step —,
    restored after) never bring there, so only the per-step comparison can see the write."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stat", torch.zeros(4))
        self.calls = 0

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.calls += 1
        if self.calls >= LATE_CALL:
            self.stat.copy_(batch[0].mean(0))


class LateStatistic(Callback):
    """The same write from a callback (it runs before ModelCheckpoint's on_train_batch_end)."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.calls += 1
        if self.calls >= LATE_CALL:
            pl_module.stat.copy_(batch[0].mean(0))


ENGINES = ["ghost", "vmap", "opacus_hooks"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("factory,what", [(IntegerCounter, "buffer positives"), (BoolFlag, "buffer saw_large"),
                                          (MemoryBank, "attribute bank")])
def test_state_written_in_the_step_is_refused_before_any_release(factory, what, engine):
    model = factory()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s){what}.*public_state"):
        fit(model, n=64, per_sample=engine)
    assert unchanged(before, model), "a release happened"


@pytest.mark.parametrize("factory,callbacks,what", [
    (NumpyNormaliserAfterStep, [], "attribute normaliser"),
    (Classifier, [FeatureQueueCallback()], "callback FeatureQueueCallback.queue"),
])
def test_state_kept_in_batch_end_hooks_is_refused_before_any_release(factory, callbacks, what):
    """The hooks are replayed on the first step's examples before its release (PrivateStep.verify_on)."""
    model = factory()
    before = parameters(model)
    with pytest.raises(StateWrittenError, match=rf"(?s)^Kept state written outside the release: [^\n]*{what}[^\n]*"
                                                rf"public_state[^\n]*\nState changed.*replayed on the first step's"):
        fit(model, callbacks=callbacks)
    assert unchanged(before, model), "a release happened"


def test_a_write_keyed_on_the_step_is_refused_before_any_release():
    model = WarmupWriter()
    before = parameters(model)
    with pytest.raises(StateWrittenError, match="(?s)replayed.*buffer stat"):
        fit(model, steps=6)
    assert unchanged(before, model), "a release happened"


def test_a_write_that_starts_later_is_refused_before_the_next_release():
    model = LateWriter()
    with pytest.raises(StateWrittenError, match="buffer stat") as info:
        fit(model, steps=LATE_CALL + 1, public_state=["calls"])
    assert "wrote nothing at its first call" in str(info.value)  # refused at the hook's call (judged_writes.py)
    assert model.trainer.strategy.ledger.steps == LATE_CALL, "the steps before the write released; the write refused at the next"


def test_no_checkpoint_is_written_with_state_kept_from_the_batch(tmp_path):
    model = LateWriter()
    model.on_train_batch_end = lambda *args: None  # the callback writes instead, before the checkpoint is saved
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    with pytest.raises(StateWrittenError, match="wrote nothing at its first call"):  # at the call, before the save
        quiet_trainer(strategy=strategy(public_state=["LateStatistic.calls", "calls"]), max_steps=LATE_CALL + 1,
                      callbacks=[LateStatistic(), ckpt], enable_checkpointing=True).fit(model, loader())
    saved = list(tmp_path.glob("*.ckpt"))
    assert len(saved) == LATE_CALL - 1, "the checkpoints before the write are written, none after it"
    assert not torch.load(saved[0], weights_only=False)["state_dict"]["stat"].any()


@pytest.mark.parametrize("factory,public", [(IntegerCounter, ["positives"]), (MemoryBank, ["bank"]),
                                            (NumpyNormaliserAfterStep, ["normaliser"]),
                                            (LateWriter, ["stat*", "calls"])])
def test_declared_public_state_trains(factory, public):
    model = factory()
    dp = fit(model, steps=4, public_state=public)
    assert dp.ledger.steps == 4


def test_declared_public_callback_trains_and_a_trusted_one_needs_nothing(tmp_path):
    queue = FeatureQueueCallback()
    dp = strategy(public_state=["FeatureQueueCallback"])
    quiet_trainer(strategy=dp, max_steps=4, callbacks=[queue, ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1)],
                  enable_checkpointing=True).fit(Classifier(), loader())
    assert dp.ledger.steps == 4 and len(queue.queue) > 0 and list(tmp_path.glob("*.ckpt"))


class Observer(Callback):
    """Reads only released values (after the release and the update): never handed the batch, so trusted."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.norms.append(float(sum(p.grad.norm() ** 2 for p in pl_module.parameters())))


def test_a_callback_that_never_sees_the_batch_keeps_what_it_likes():
    observer = Observer()
    assert fit(Classifier(), steps=4, callbacks=[observer]).ledger.steps == 4
    assert len(observer.norms) == 4


class Counting(Classifier):
    """A step counter, declared public; a torchmetrics mean of the loss; the Lightning docs' outputs list."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.long))
        self.train_loss = torchmetrics.MeanMetric()
        self.training_step_outputs: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.steps_seen += 1
        self.train_loss(loss.detach(), weight=1)
        self.training_step_outputs.append(loss.detach())
        return loss


def test_the_probe_and_the_replay_leave_no_trace():
    """#37: after the first step's probe (k + 3 passes) and the hooks' replay, the user's state is as if only the real
    steps ran: the counter, the metric's weight and the outputs list count 3 steps."""
    model = Counting()
    fit(model, steps=3, public_state=["steps_seen", "training_step_outputs"])
    assert int(model.steps_seen) == 3
    assert len(model.training_step_outputs) == 3
    assert float(model.train_loss.weight) == 3.0


class StatsInAListedModule(Classifier):
    """A normaliser module kept in a plain list (never registered), its running mean updated from the batch."""

    def __init__(self) -> None:
        super().__init__()
        norm = nn.BatchNorm1d(4, affine=False)
        self.helpers = [norm]

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.helpers[0].running_mean.mul_(0.9).add_(0.1 * batch[0].mean(0))
        return super().training_step(batch, batch_idx)


class NormalisingDataModule(pl.LightningDataModule):
    """A datamodule that accumulates the batches' feature means in on_after_batch_transfer."""

    def __init__(self) -> None:
        super().__init__()
        self.seen_mean = torch.zeros(4)

    def train_dataloader(self):
        return loader()

    def on_after_batch_transfer(self, batch, dataloader_idx):
        if self.trainer is not None and self.trainer.training:
            self.seen_mean = 0.9 * self.seen_mean + 0.1 * batch[0].mean(0)
        return batch


def test_a_module_held_in_a_list_is_fingerprinted():
    model = StatsInAListedModule()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)attribute helpers.*public_state"):
        fit(model)
    assert unchanged(before, model)


def test_a_datamodule_keeping_batch_statistics_is_refused_before_any_release():
    model = Classifier()
    before = parameters(model)
    with pytest.raises(StateWrittenError, match=r"(?s)datamodule NormalisingDataModule.seen_mean.*public_state"):
        quiet_trainer(strategy=strategy(), max_steps=3).fit(model, datamodule=NormalisingDataModule())
    assert unchanged(before, model)


def test_a_snapshot_restore_leaves_parameters_held_in_attributes_untouched():
    """An nn.LSTM subclass defined by the user keeps its Parameters in the inherited ``_flat_weights`` list: the probe's
    restore must not copy them back (their version counter would move and read as a write at the next release)."""
    from lightning_dp.validators.snapshot import StateSnapshot

    class Subclassed(nn.LSTM):
        pass

    rnn = Subclassed(3, 4)
    versions = [p._version for p in rnn.parameters()]
    StateSnapshot(rnn).restore()
    assert [p._version for p in rnn.parameters()] == versions


class CachedOnABuiltinLayer(Classifier):
    """Keeps the batch's inputs on torch's own nn.Linear (an attribute set on a library layer)."""

    def training_step(self, batch, batch_idx):
        self.net[0].last_inputs = batch[0].detach()
        return super().training_step(batch, batch_idx)


def test_data_cached_on_a_torch_layer_is_fingerprinted():
    model = CachedOnABuiltinLayer()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)attribute net.0.last_inputs.*public_state"):
        fit(model)
    assert unchanged(before, model)


def test_an_attribute_the_probe_adds_is_removed_again():
    """A step that caches its batch on a torch layer, declared public: the first step's passes (probe, checks,
    replays) leave nothing behind; only the real steps' value is there."""
    model = CachedOnABuiltinLayer()
    seen = {}

    class Spy(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            # the loop's own call comes first in each step (the checks' passes run the hook again after it, some as
            # of later steps: keyed by the loop's own count of batches, which they do not move)
            step = trainer.fit_loop.epoch_loop.batch_progress.total.ready - 1
            seen.setdefault(step, hasattr(pl_module.net[0], "last_inputs"))

    fit(model, steps=2, callbacks=[Spy()], public_state=["net.0.last_inputs", "Spy"])
    assert seen == {0: False, 1: True}


class OutputsList(Classifier):
    """Lightning 2.x's migration guide: ``self.training_step_outputs.append(loss)``, averaged and cleared at epoch end
    (QA qa8 s26)."""

    def __init__(self) -> None:
        super().__init__()
        self.training_step_outputs: list = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.training_step_outputs.append(loss.detach())
        return loss


def test_the_refusal_of_a_kept_list_names_it_and_the_fix_on_a_short_first_line():
    with pytest.raises(StateWrittenError) as refused:
        fit(OutputsList())
    first = str(refused.value).splitlines()[0]
    assert first.startswith("Kept state written outside the release: attribute training_step_outputs. Fix:"), first
    assert "DPStrategy(public_state=['training_step_outputs'])" in first and len(first) < 400, first
    assert "declare it public: attribute" not in str(refused.value)  # (the old where-clause ran into the names)
    fit(OutputsList(), public_state=["training_step_outputs"])  # the fix it names trains


def test_the_parameter_signature_tells_a_parameter_at_a_freed_ones_address():
    """The trainable parameters' signature (re-attach when it changes) holds them: a parameter put in place of one
    freed since, at its address, under its name, is a change."""
    from torch import nn

    from lightning_dp.privacy.boundary import parameter_signature

    module = nn.Linear(3, 2)
    before = parameter_signature(module)
    freed = id(module.weight)
    module.weight = None  # its slot kept, in its place
    made = [nn.Linear(3, 2).weight for _ in range(200)]  # CPython hands a freed object's memory to the next one
    module.weight = next((p for p in made if id(p) == freed), made[0])
    assert [name for name, _ in parameter_signature(module)] == ["weight", "bias"]
    assert parameter_signature(module) != before
