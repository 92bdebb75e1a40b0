"""A field of a configuration object the model holds, ``None`` until a first forward sets it (validators/lazy_caches.py,
``held_objects``): Hugging Face's ``*ForSequenceClassification`` called with ``labels=`` sets
``config.problem_type = "single_label_classification"`` on its first forward, from ``num_labels`` and the labels'
dtype — alike on every batch: the standard fine-tune trains. Such a field set from the data's values (a
``problem_type`` chosen from the labels' values, a scale from the first batch's loss) is set apart by the first step's
replays on other data and refused before any release."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import parameters, strategy, unchanged  # noqa: E402
from conftest import quiet_trainer  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.lazy_caches import empty_slots, held_objects  # noqa: E402

transformers = pytest.importorskip("transformers")


def tiny_bert(**config: Any) -> Any:
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=16, num_labels=2, **config))


def token_loader(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 32, (n, 8), generator=g)
    return DataLoader(TensorDataset(ids, torch.ones_like(ids), (ids[:, 0] > 17).long()), batch_size=16)


class SequenceClassifier(pl.LightningModule):
    """The Hugging Face fine-tune as the Lightning GLUE tutorial writes it: the model's own loss, from ``labels=``."""

    def __init__(self, **config: Any) -> None:
        super().__init__()
        self.model = tiny_bert(**config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, attention_mask, labels = batch
        return self.model(input_ids, attention_mask=attention_mask, labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)


class ProblemTypeFromLabelValues(SequenceClassifier):
    """``problem_type`` chosen, on first use, from the labels' values (whether most of the batch is positive)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, attention_mask, labels = batch
        config = self.model.config
        if config.problem_type is None:
            config.problem_type = ("multi_label_classification" if float(labels.float().mean()) > 0.5
                                   else "single_label_classification")
        logits = self.model(input_ids, attention_mask=attention_mask).logits
        return F.cross_entropy(logits, labels)


class ScaleFromFirstLoss(SequenceClassifier):
    """A float field of the configuration (``None`` before the first step) set from the first batch's loss."""

    def __init__(self) -> None:
        super().__init__(loss_scale=None)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.model.config.loss_scale is None:
            self.model.config.loss_scale = float(loss.detach())
        return loss


def fit(model: pl.LightningModule, steps: int = 3) -> Any:
    dp = strategy()
    quiet_trainer(strategy=dp, max_steps=steps).fit(model, token_loader())
    return dp


def test_the_hugging_face_classification_fine_tune_with_labels_trains():
    model = SequenceClassifier()
    assert model.model.config.problem_type is None
    assert fit(model).ledger.steps == 3
    assert model.model.config.problem_type == "single_label_classification"  # set by the real first step


@pytest.mark.parametrize("model", [ProblemTypeFromLabelValues, ScaleFromFirstLoss],
                         ids=["problem_type from the labels' values", "a float from the first loss"])
def test_a_configuration_field_set_from_the_data_is_refused_before_any_release(model):
    module = model()
    before = parameters(module)
    with pytest.raises(PrivacyConfigurationError, match=r"config"):
        fit(module)
    assert unchanged(before, module), "a release happened"


class Settings:
    """A plain object of the user's holding a lazily set field and a nested configuration."""

    def __init__(self) -> None:
        self.mask = None
        self.rate = 0.1
        self._private = None
        self.inner = transformers.PretrainedConfig(problem_type=None)


def test_which_fields_are_put_back():
    module = tiny_bert()
    module.settings = Settings()
    module._hidden = Settings()  # a private attribute: not walked
    objects = held_objects(module)
    assert module.config in objects and module.settings in objects and module.settings.inner in objects
    assert module._hidden not in objects
    assert len(objects) == len({id(o) for o in objects}), "the shared config is listed once"
    puts = empty_slots(module)
    module.config.problem_type, module.settings.mask = "regression", torch.ones(2)
    module.settings.rate, module.settings._private = 0.5, 1
    module.settings.inner.problem_type = "regression"
    for put in puts:
        put()
    assert module.config.problem_type is None and module.settings.mask is None
    assert module.settings.inner.problem_type is None
    assert module.settings.rate == 0.5 and module.settings._private == 1  # not None before: not a lazy field


# ---------------------------------------------------------------------------- a plain PrivateStep loop
def plain_fit(model: Any, loss_of: Any, steps: int = 3) -> Any:
    """``verify(loss_of)`` then ``steps`` releases of a plain loop (the README's), the step returned."""
    from lightning_dp.privacy.noise import GaussianNoise
    from lightning_dp.privacy.private_step import PrivateStep

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = PrivateStep(1.0, 1.0, GaussianNoise(seed=0), sampler_seed=0)
    step.attach(model, opt)
    loader = step.poisson_loader(token_loader())
    step.verify(loss_of)
    for i, batch in enumerate(loader):
        if step.begin():
            loss_of(batch).backward()
        step.release(optimizer=opt)
        opt.step()
        opt.zero_grad()
        if i + 1 == steps:
            break
    return step


def test_the_hugging_face_classifier_trains_in_a_plain_loop():
    model = tiny_bert()
    step = plain_fit(model, lambda b: model(b[0], attention_mask=b[1], labels=b[2]).loss)
    assert step.steps_taken == 3
    assert model.config.problem_type == "single_label_classification"


def test_a_hugging_face_image_classifier_trains_in_a_plain_loop():
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=1, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, num_labels=2))
    step = plain_fit(model, lambda b: model(pixel_values=b[0][:, :8].float().reshape(-1, 1, 2, 4).repeat(1, 1, 4, 2),
                                            labels=b[2]).loss)
    assert step.steps_taken == 3 and model.config.problem_type == "single_label_classification"


def problem_type_from_label_values(model: Any) -> Any:
    def loss_of(batch: Any) -> torch.Tensor:
        if model.config.problem_type is None:
            model.config.problem_type = ("multi_label_classification" if float(batch[2].float().mean()) > 0.5
                                         else "single_label_classification")
        return F.cross_entropy(model(batch[0], attention_mask=batch[1]).logits, batch[2])
    return loss_of


def scale_from_first_loss(model: Any) -> Any:
    def loss_of(batch: Any) -> torch.Tensor:
        loss = model(batch[0], attention_mask=batch[1], labels=batch[2]).loss
        if model.config.loss_scale is None:
            model.config.loss_scale = float(loss.detach())
        return loss
    return loss_of


@pytest.mark.parametrize("loss", [problem_type_from_label_values, scale_from_first_loss],
                         ids=["problem_type from the labels' values", "a float from the first loss"])
def test_a_field_set_from_the_data_is_refused_in_a_plain_loop_in_its_terms(loss):
    model = tiny_bert(loss_scale=None)
    before = parameters(model)
    with pytest.raises(PrivacyConfigurationError, match=r"config") as refused:
        plain_fit(model, loss(model))
    text = str(refused.value)
    first = text.splitlines()[0]  # what was written and the fix, first
    assert first.startswith("The loss function given to verify()"), first
    assert "PrivateStep(..., public_state=['config'])" in first, first
    assert "DPStrategy" not in text and "training_step" not in text.splitlines()[0]
    assert unchanged(before, model), "a release happened"


def test_a_counter_in_the_loss_function_is_still_refused_in_a_plain_loop():
    model = tiny_bert()
    model.calls = 0

    def loss_of(batch: Any) -> torch.Tensor:
        model.calls += 1
        return model(batch[0], attention_mask=batch[1], labels=batch[2]).loss

    with pytest.raises(PrivacyConfigurationError, match=r"attribute calls"):
        plain_fit(model, loss_of)


@pytest.mark.parametrize("plain", [True, False], ids=["plain loop", "DPStrategy"])
def test_a_lazy_field_does_not_take_the_place_of_another_refusal(plain):
    """A summed loss on the classifier whose first forward sets ``config.problem_type``: the refusal names the sum,
    not the field (which every data fills alike)."""
    model = tiny_bert()

    def summed(batch: Any) -> torch.Tensor:  # labels=: the first forward sets problem_type
        return model(batch[0], attention_mask=batch[1], labels=batch[2]).loss * len(batch[2])

    class Summed(SequenceClassifier):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return summed(batch)

    with pytest.raises(PrivacyConfigurationError, match="SUM over the batch") as refused:
        if plain:
            plain_fit(model, summed)
        else:
            module = Summed()
            model = module.model
            fit(module)
    assert "config" not in str(refused.value)
