"""The ledger travels with the weights (accounting/module_ledgers.py): a trained module re-created as another
object in the same process — a deep copy, an unpickled copy, a fresh module loaded with its state dict, a part of
it — continues the trained module's record instead of restarting at zero; a freshly initialised module does not."""

from __future__ import annotations

import copy
import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))

from cases import Classifier, fit, loader, strategy  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from lightning_dp.accounting import module_ledgers  # noqa: E402
from lightning_dp.accounting.ledger import PrivacyLedger  # noqa: E402


@pytest.fixture
def trained() -> Classifier:
    model = Classifier()
    assert fit(model, steps=3).ledger.steps == 3
    return model


def _loaded(model: Classifier) -> Classifier:
    fresh = Classifier()
    fresh.load_state_dict(model.state_dict())
    return fresh


def _encoder_only(model: Classifier) -> Classifier:
    fresh = Classifier()
    with torch.no_grad():
        torch.nn.init.normal_(fresh.net[2].weight)
    fresh.net[0].load_state_dict(model.net[0].state_dict())
    return fresh


def _rounded(dtype: torch.dtype):
    """The trained weights saved in ``dtype`` and loaded into a fresh float32 module."""
    def recreate(model: Classifier) -> Classifier:
        fresh = Classifier()
        fresh.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
        return fresh
    return recreate


def _near(change):
    """The trained weights changed a little (``change`` of each tensor) and loaded into a fresh module."""
    def recreate(model: Classifier) -> Classifier:
        fresh = Classifier()
        generator = torch.Generator().manual_seed(1)
        fresh.load_state_dict({k: change(v, generator) for k, v in model.state_dict().items()})
        return fresh
    return recreate


@pytest.mark.parametrize("recreate", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m)), _loaded,
                                      _encoder_only, _rounded(torch.float16), _rounded(torch.bfloat16),
                                      _near(lambda v, g: v * 1.0001),
                                      _near(lambda v, g: v + 1e-4 * torch.randn(v.shape, generator=g))],
                         ids=["deepcopy", "pickle", "load_state_dict", "a part", "float16 round trip",
                              "bfloat16 round trip", "scaled by 1.0001", "noise added"])
def test_a_recreated_module_continues_the_record(trained, recreate):
    again = fit(recreate(trained), steps=2)
    assert again.ledger.steps == 5


def _frozen(recreate):
    """A fresh module whose encoder is ``recreate``'s trained one, frozen (a linear probe on a privately trained
    backbone)."""
    def frozen(model: Classifier) -> Classifier:
        probe = Classifier()  # a fresh head
        with torch.no_grad():
            torch.nn.init.normal_(probe.net[2].weight)
        probe.net[0] = recreate(model).net[0].requires_grad_(False)
        return probe
    return frozen


@pytest.mark.parametrize("recreate", [_frozen(lambda m: m), _frozen(copy.deepcopy), _frozen(_loaded),
                                      _frozen(lambda m: pickle.loads(pickle.dumps(m))),
                                      _frozen(_rounded(torch.float16))],
                         ids=["the same module", "deepcopy", "load_state_dict", "pickle", "float16 round trip"])
def test_a_frozen_copy_of_trained_weights_continues_the_record(trained, recreate):
    """Frozen weights a private fit trained hold its releases as trainable ones do (zoo20 k1: a probe on a
    deep-copied frozen backbone started a fresh record, 8 of 16 releases)."""
    again = fit(recreate(trained), steps=2)
    assert again.ledger.steps == 5


@pytest.mark.usefixtures("without_data_ledger")  # the weights' record alone: every fit reads the same 64 records
def test_a_frozen_public_part_does_not_carry_a_record_it_never_trained():
    """A part frozen in a private fit (public weights: the fresh module's) and frozen again in the next one carries
    no record: only weights a fit trained are recorded."""
    model = Classifier()
    model.net[0].requires_grad_(False)
    assert fit(model, steps=3).ledger.steps == 3
    probe = Classifier()
    probe.net[0].requires_grad_(False)
    assert fit(probe, steps=2).ledger.steps == 2


@pytest.mark.usefixtures("without_data_ledger")  # the weights' record alone: every fit reads the same 64 records
def test_a_fresh_module_starts_its_own_record(trained):
    """The same initial weights as the trained module had (Classifier seeds its initialisation): only weights the
    releases changed carry the record."""
    assert fit(Classifier(), steps=2).ledger.steps == 2


def test_the_digest_follows_contents_shape_and_dtype():
    x = torch.arange(12, dtype=torch.float32)
    assert module_ledgers.digest(x) == module_ledgers.digest(x.clone())
    assert module_ledgers.digest(x) != module_ledgers.digest(x.flip(0))  # the same values elsewhere
    assert module_ledgers.digest(x) != module_ledgers.digest(x.view(3, 4))
    assert module_ledgers.digest(x) != module_ledgers.digest(x.double())


class Normed(Classifier):
    """A classifier with a LayerNorm (weight of ones, bias of zeros) trained with a tiny learning rate."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-6)


@pytest.mark.usefixtures("without_data_ledger")  # the weights' record alone: every fit reads the same 64 records
def test_a_fresh_module_is_not_taken_for_a_rounding_of_barely_trained_weights():
    """The norm's weight moved by ~1e-6 is still all ones in bfloat16: that rounding is a fresh module's too."""
    assert fit(Normed(), steps=3).ledger.steps == 3
    assert fit(Normed(), steps=2).ledger.steps == 2


def test_a_float64_copy_continues_the_record(trained):
    fresh = Classifier().double()
    fresh.load_state_dict(trained.state_dict())
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=2, precision="64-true").fit(fresh, loader(64))
    assert dp.ledger.steps == 5


@pytest.mark.usefixtures("without_data_ledger")  # the weights' record alone: every fit reads the same 64 records
def test_weights_moved_their_own_way_start_their_own_record(trained):
    """Weights as far from the trained ones as the start, moved in a direction of their own, are neither near the
    trained weights (module_ledgers.near) nor on the fit's path (accounting/lineage.py: halfway between the start and
    the end is, and continues the record: tests/accounting/test_lineage.py)."""
    other = Classifier()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * float(p.std()))
    assert fit(other, steps=2).ledger.steps == 2


def test_a_checkpoint_written_mid_fit_continues_every_release_of_that_fit(tmp_path):
    """"The best checkpoint" from the middle of a fit, reloaded into a fresh module after it: the fit's later
    releases used the same data, so the record is the whole fit's (8), not the checkpoint's (2)."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    model = Classifier()
    dp = strategy()
    every_two = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=2)
    quiet_trainer(strategy=dp, max_steps=8, callbacks=[every_two], enable_checkpointing=True).fit(model, loader(64))
    assert dp.ledger.steps == 8
    first = sorted(tmp_path.glob("*step=2*.ckpt"))[0]
    fresh = Classifier()
    fresh.load_state_dict(torch.load(first, weights_only=False)["state_dict"])
    assert fit(fresh, steps=4).ledger.steps == 12


@pytest.mark.usefixtures("without_data_ledger")  # the weights' record alone: every fit reads the same 64 records
def test_a_layer_unfrozen_and_never_trained_leaves_no_record():
    """A fit stopped right after unfreezing a layer (before its first release) leaves that layer's weights — a fresh
    module's — without the record (it would hand every later fresh module the fit's releases)."""
    model = Classifier()
    model.net[0].requires_grad_(False)
    assert fit(model, steps=3).ledger.steps == 3
    ledger = PrivacyLedger()
    ledger.record(1.0, 0.25, 3)
    frozen = Classifier()
    frozen.net[0].requires_grad_(False)
    module_ledgers.bind(frozen, ledger)
    frozen.net[0].requires_grad_(True)
    module_ledgers.unbind(frozen, ledger)
    assert fit(Classifier(), steps=2).ledger.steps == 2


class Distilled(Classifier):
    """A student trained on soft targets from a teacher it holds outside its registry (``how``)."""

    def __init__(self, teacher: torch.nn.Module, how: str) -> None:
        super().__init__()
        teacher.requires_grad_(False)
        if how == "list":
            self.teachers = [teacher]
            self.soft = lambda x: self.teachers[0](x).softmax(-1)
        elif how == "private list":  # under a private name, as torch and Lightning keep their own
            self._t = [teacher]
            self.soft = lambda x: self._t[0](x).softmax(-1)
        else:
            def soft(x, _teacher=teacher):  # held by a function's default argument
                return _teacher(x).softmax(-1)
            self.soft = soft

    def training_step(self, batch, batch_idx):
        x, _ = batch
        with torch.no_grad():
            target = self.soft(x)
        return torch.nn.functional.kl_div(self(x).log_softmax(-1), target, reduction="batchmean")


@pytest.mark.parametrize("how", ["list", "private list", "function"])
def test_a_student_of_a_privately_trained_teacher_continues_the_teachers_record(trained, how):
    """The teacher's releases are in the student's outputs: the student's record starts from them."""
    assert fit(Distilled(trained, how), steps=2).ledger.steps == 5
