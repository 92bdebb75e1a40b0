"""Activation (gradient) checkpointing under DPStrategy: Hugging Face's ``gradient_checkpointing_enable()`` and plain
``torch.utils.checkpoint``, reentrant or not.

The first step's probe runs the step with dropout off (validators/probe.py, ``NoDropout``, a torch function mode). torch
pops a mode while it handles a call, so the probe's ``loss.backward()`` ran with dropout on, and a checkpointed block
recomputed its forward there with other operations than it ran (a dropout mask, another attention kernel): a
non-reentrant checkpoint raised ``CheckpointError`` on the first pass (a batch of one), a reentrant one recomputed other
values (examples "interacted"). The mode now stays on inside the backward. The vmap engine's per-example replay also
ran Hugging Face's hook that marks the embeddings' output as requiring grad, which torch.func refuses
(grad_sample/functorch_vmap.py, ``_TransformedRequiresGrad``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import parameters, strategy, unchanged  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.probe import StateWriteError  # noqa: E402

transformers = pytest.importorskip("transformers")

REENTRANT = [{}, {"use_reentrant": False}, {"use_reentrant": True}]
REENTRANT_IDS = ["hf default", "use_reentrant=False", "use_reentrant=True"]


def token_loader(n: int = 48) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 32, (n, 8), generator=g)
    return DataLoader(TensorDataset(ids, (ids[:, 0] > 17).long()), batch_size=16)


class CheckpointedBert(pl.LightningModule):
    """A tiny BERT classifier (dropout on, as configured by default) with gradient checkpointing enabled."""

    def __init__(self, kwargs: dict) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=16, max_position_embeddings=16, num_labels=2)
        config.problem_type = "single_label_classification"  # set in advance: no lazily set field in play
        self.model = transformers.BertForSequenceClassification(config)
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, labels = batch
        return self.model(input_ids=input_ids, labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("per_sample", ["ghost", "vmap"])
@pytest.mark.parametrize("kwargs", REENTRANT, ids=REENTRANT_IDS)
def test_hugging_face_gradient_checkpointing_trains(per_sample, kwargs):
    module = CheckpointedBert(kwargs)
    assert module.model.is_gradient_checkpointing
    before = parameters(module)
    dp = strategy(per_sample=per_sample)
    quiet_trainer(strategy=dp, max_steps=2).fit(module, token_loader())
    assert dp.ledger.steps == 2
    assert not unchanged(before, module)


class CheckpointedBlock(pl.LightningModule):
    """``torch.utils.checkpoint`` around a block with dropout in it."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.inp = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 16))
        self.out = nn.Linear(16, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = checkpoint(self.block, self.inp(x), use_reentrant=self.reentrant)
        return F.cross_entropy(self.out(h), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def feature_loader(n: int = 48) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)


@pytest.mark.parametrize("per_sample", ["ghost", "vmap"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["use_reentrant=False", "use_reentrant=True"])
def test_torch_checkpoint_around_dropout_trains(per_sample, reentrant):
    module = CheckpointedBlock(reentrant)
    before = parameters(module)
    dp = strategy(per_sample=per_sample)
    quiet_trainer(strategy=dp, max_steps=2).fit(module, feature_loader())
    assert dp.ledger.steps == 2
    assert not unchanged(before, module)


class WritesThenFails(CheckpointedBlock):
    """Writes an attribute of its own, then fails on a batch of one (an error unrelated to the write)."""

    def __init__(self) -> None:
        super().__init__(reentrant=False)
        self.seen = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen = torch.zeros(())
        if len(x) == 1:
            raise ValueError("the step cannot take one example")
        return super().training_step(batch, batch_idx)


def test_a_failure_in_the_probe_is_named_before_a_write_it_interrupted():
    module = WritesThenFails()
    before = parameters(module)
    with pytest.raises(StateWriteError) as info:
        quiet_trainer(strategy=strategy(per_sample="ghost"), max_steps=2).fit(module, feature_loader())
    text = str(info.value)
    assert text.startswith("The first step's probe failed"), text[:300]
    assert text.index("ValueError: the step cannot take one example") < text.index("changed the model's own state")
    assert "seen" in text
    assert isinstance(info.value, PrivacyConfigurationError)
    assert unchanged(before, module), "a release happened"
