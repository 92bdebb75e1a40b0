"""Bases that store the same records are one base (record_checks/stored_sources.py, zoo17 r2): two augmenting classes
over the same tensors, or two datasets each holding a copy of the same training data, concatenated, read every
person twice; disjoint parts, parts sharing only their labels and records read from files keep their names."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset, TensorDataset

from lightning_dp import DPStrategy, PrivacyConfigurationError
from lightning_dp.record_checks.record_sources import check_sources
from lightning_dp.record_checks.stored_sources import identifying_rows, same_records


class Signed(Dataset):
    """Each record's features times a fixed sign: an augmented copy that stores the records itself."""

    def __init__(self, x, y, sign: float) -> None:
        self.x, self.y, self.sign = x, y, sign

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] * self.sign, self.y[i]


class Images(Dataset):
    """torchvision-style: the records as a NumPy array and a list of labels, with a transform of its own."""

    def __init__(self, data: np.ndarray, targets: list, flip: bool) -> None:
        self.data, self.targets, self.flip = data, targets, flip

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        x = torch.from_numpy(self.data[i])
        return (x.flip(0) if self.flip else x), self.targets[i]


class Files(Dataset):
    """Records read by index from files; stores only its labels."""

    def __init__(self, root: str, labels: list) -> None:
        self.root, self.labels = root, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return torch.full((4,), float(i) + 1000.0 * ord(self.root[0])), self.labels[i]  # each root's own files


def _data(n: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, (x[:, 0] > 0).long()


X, Y = _data()


@pytest.mark.parametrize("parts", [
    lambda: [Signed(X, Y, 1.0), Signed(X, Y, -1.0)],
    lambda: [Signed(X.clone(), Y.clone(), 1.0), Signed(X.clone(), Y.clone(), -1.0)],
    lambda: [Images(X.numpy().copy(), Y.tolist(), False), Images(X.numpy().copy(), Y.tolist(), True)],
    lambda: [Signed(X, Y, 1.0), Signed(X[torch.randperm(64)], Y, -1.0)],
    lambda: [Signed(X, Y, 1.0), Signed(X[Y == 1][:8], Y[Y == 1][:8], -1.0)],
    lambda: [Signed(X[:4], Y[:4], -1.0), Signed(X, Y, 1.0)],
], ids=["same tensors", "copies of them", "torchvision-style copies", "stored in another order",
        "a minority's rows copied to oversample it", "the copy first"])
def test_parts_that_store_the_same_records_are_refused(parts):
    with pytest.raises(PrivacyConfigurationError, match="more than once"):
        check_sources(ConcatDataset(parts()), None)


@pytest.mark.parametrize("parts", [
    lambda: [Signed(X[:32], Y[:32], 1.0), Signed(X[32:], Y[32:], 1.0)],
    lambda: [Signed(X, Y, 1.0), Signed(_data(seed=1)[0], Y, 1.0)],
    lambda: [Files("a", [0, 1] * 16), Files("b", [0, 1] * 16)],
    lambda: [Subset(Signed(X, Y, 1.0), range(32)), Subset(Signed(X, Y, -1.0), range(32, 64))],
], ids=["disjoint halves", "the same labels only", "records in files", "disjoint subsets of two copies"])
def test_parts_of_other_records_train(parts):
    check_sources(ConcatDataset(parts()), None)


def test_labels_and_indices_do_not_identify_records():
    assert identifying_rows(TensorDataset(torch.arange(64), Y)) == {}
    files = Files("a", [0, 1] * 32)  # stores its labels only: identified by its items as read
    read, stored = identifying_rows(files), identifying_rows(TensorDataset(torch.stack([files[i][0] for i in
                                                                                       range(64)]), Y))
    assert list(read) == list(stored) == [("float32", (4,))]
    assert np.array_equal(read[("float32", (4,))], stored[("float32", (4,))])


def test_two_file_datasets_reading_the_same_records_are_one_source():
    """Nothing stored identifies their records: the items as read do (record_checks/read_items.py)."""
    with pytest.raises(PrivacyConfigurationError, match="reads one record more than once"):
        check_sources(ConcatDataset([Files("a", [0, 1] * 16), Files("a", [1, 0] * 16)]), None)
    assert list(identifying_rows(TensorDataset(X, Y))) == [("float32", (4,))]


def test_a_record_stored_twice_is_named_as_the_first_base_s():
    (owner, index), (owner2, index2) = same_records([Signed(X, Y, 1.0), Signed(X[[5, 9]].clone(), Y[[5, 9]], -1.0)])
    assert owner.tolist() == [0] * 64 and index.tolist() == list(range(64))
    assert owner2.tolist() == [0, 0] and index2.tolist() == [5, 9]


def test_a_few_equal_records_in_two_sources_are_natural():
    other = _data(200, seed=2)[0]
    other[:3] = X[:3]  # 3 of 200: under 5 % of the smaller source... of 64: 4.7 %
    (_, _), (owner2, _) = same_records([Signed(X, Y, 1.0), Signed(other, torch.zeros(200), 1.0)])
    assert owner2.tolist() == [1] * 200
    check_sources(ConcatDataset([Signed(X, Y, 1.0), Signed(other, torch.zeros(200), 1.0)]), None)


def test_a_fit_on_two_augmented_copies_is_refused_before_any_release():
    import pytorch_lightning as pl
    from torch import nn

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Model()
    before = model.net.weight.detach().clone()
    dp = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0)
    trainer = pl.Trainer(strategy=dp, accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(PrivacyConfigurationError, match="more than once"):
        trainer.fit(model, DataLoader(ConcatDataset([Signed(X, Y, 1.0), Signed(X, Y, -1.0)]), batch_size=16))
    assert torch.equal(model.net.weight, before) and dp.ledger.steps == 0
