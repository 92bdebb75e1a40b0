"""More places a step can keep data (validators/kept_state.py): a class attribute shared by every instance, the
LightningDataModule, the dataset's records kept as NumPy arrays or lists, a tensor stashed under a private name on the
trainer; and what must stay allowed (a dataset's lazy cache, Lightning's own private attributes)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from conftest import quiet_trainer
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, fit, loader, parameters, strategy, unchanged  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.fingerprints.checksums import ARRAY_BYTES, _array_digest  # noqa: E402
from lightning_dp.fingerprints.state_walker import class_attributes  # noqa: E402
from lightning_dp.validators.kept_state import StateFingerprint  # noqa: E402


class SharedHistory(Classifier):
    """``history = []`` in the class body: appended through ``self``, it lives on the class."""

    history: list = [1.0]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * self.history[-1]

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.history.append(float(outputs["loss"]))


def test_a_class_attribute_written_from_the_batch_is_refused_before_any_release():
    SharedHistory.history = [1.0]
    model = SharedHistory()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"class attribute SharedHistory\.history"):
        fit(model)
    assert unchanged(before, model)
    assert SharedHistory.history == [1.0], "the replays' appends were put back"


def test_class_attributes_are_the_users_data_only():
    class Base(pl.LightningModule):
        limit = 3
        table: dict = {}

        def method(self) -> None: ...

        @property
        def prop(self) -> int:
            return 1

    class Child(Base):
        seen: list = []

    found = {(cls.__name__, key) for cls, key, _ in class_attributes([Child])}
    assert found == {("Child", "seen"), ("Base", "limit"), ("Base", "table")}


class Memory(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.memory = [1.0]

    def train_dataloader(self) -> DataLoader:
        return loader()


class ReadsDataModule(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * self.trainer.datamodule.memory[-1]

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.trainer.datamodule.memory.append(float(outputs["loss"]))


def test_data_kept_on_the_datamodule_is_refused_before_any_release():
    model = ReadsDataModule()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"datamodule Memory\.memory"):
        quiet_trainer(strategy=strategy(), max_steps=3).fit(model, datamodule=Memory())
    assert unchanged(before, model)


class Reloaded(pl.LightningDataModule):
    """Builds its loader anew every epoch (and remembers how often): not data."""

    def __init__(self) -> None:
        super().__init__()
        self.built = 0

    def train_dataloader(self) -> DataLoader:
        self.built += 1
        return loader()


def test_a_datamodule_rebuilding_its_loader_every_epoch_is_allowed():
    dm = Reloaded()
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=10, reload_dataloaders_every_n_epochs=1).fit(Classifier(), datamodule=dm)
    assert dp.ledger.steps == 10 and dm.built >= 3


class Labelled(Dataset):
    """Features as a tensor, labels as a NumPy array or a Python list."""

    def __init__(self, kind: str) -> None:
        base = data(64)
        self.x = base.tensors[0]
        labels = base.tensors[1].numpy().copy()
        self.y = labels if kind == "numpy" else [int(v) for v in labels]

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> Any:
        return self.x[i], int(self.y[i])


class PseudoLabels(Classifier):
    """From the third step on, relabels the first record from the loss (self-training written into the data)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_step >= 2:
            self.trainer.train_dataloader.dataset.y[0] = int(float(outputs["loss"]) > 0.5)


@pytest.mark.parametrize("kind", ["numpy", "list"])
def test_pseudo_labels_written_into_array_or_list_labels_are_refused_before_any_release(kind):
    model = PseudoLabels()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"dataset 0 \(Labelled\)"):
        quiet_trainer(strategy=strategy(), max_steps=6).fit(model, DataLoader(Labelled(kind), batch_size=16))
    assert unchanged(before, model)


class LazyCache(Dataset):
    """Caches each record the loader reads (a dict filled by ``__getitem__``): the records themselves, allowed."""

    def __init__(self) -> None:
        self.base = data(64)
        self.cache: dict = {}

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> Any:
        if i not in self.cache:
            self.cache[i] = self.base[i]
        return self.cache[i]


def test_a_dataset_caching_its_records_is_allowed():
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=6).fit(Classifier(), DataLoader(LazyCache(), batch_size=16))
    assert dp.ledger.steps == 6


class PrivateStash(Classifier):
    """Keeps the batch under a private name on the trainer; the next step adds a penalty on it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        kept = getattr(self.trainer, "_kept", None)
        return loss if kept is None else loss + 0.0 * self(kept).sum()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.trainer._kept = batch[0].detach().clone()


def test_a_tensor_stashed_under_a_private_name_on_the_trainer_is_refused_before_any_release():
    model = PrivateStash()
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"attribute trainer\._kept"):
        fit(model)
    assert unchanged(before, model)


def test_a_large_array_is_compared_on_strided_rows_and_by_identity():
    big = np.zeros(ARRAY_BYTES // 4 * 4, dtype=np.float32)  # 4 MiB
    token = _array_digest(big)
    assert _array_digest(big) == token
    big[0] = 1.0  # a sampled position
    assert _array_digest(big) != token
    assert _array_digest(big.copy()) != _array_digest(big), "another array of the same values: another identity"
    small = np.zeros(16)
    assert _array_digest(small) == _array_digest(small.copy()), "a small array: by its contents alone"


def test_a_fingerprint_reads_the_class_attribute_through_the_instance():
    fingerprint = StateFingerprint(SharedHistory())
    before = fingerprint.take()
    SharedHistory.history.append(2.0)
    try:
        assert "class attribute SharedHistory.history" in StateFingerprint.changed(before, fingerprint.take())
    finally:
        SharedHistory.history.pop()
