"""Where a step draws random numbers of its own (validators/random_draws.py): the probe's warning names the module
whose forward drew them (Hugging Face's SpecAugment in wav2vec2's forward, from NumPy's generator) or the step itself
outside every forward (augmentation), with the way out for each."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.grad_sample import make_engine
from lightning_dp.validators.probe import ExampleIndependenceProbe, NoDropout, probe_tolerance
from lightning_dp.validators.random_draws import drawing_modules, random_step_warning

X, Y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))


class Jitter(nn.Module):
    """Noise added in a submodule's forward, from NumPy's generator."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.3 * torch.from_numpy(np.random.standard_normal(tuple(x.shape))).to(x.dtype)


class Net(nn.Module):
    def __init__(self, jitter: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 3)
        self.jitter = Jitter() if jitter else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(self.jitter(x))))


def _warning(model: nn.Module, loss_of, what: str) -> str:
    engine = make_engine("ghost")
    engine.attach(model)
    with pytest.warns(UserWarning, match="draws random numbers outside dropout") as caught:
        ExampleIndependenceProbe(model, engine, list(model.parameters()), [n for n, _ in model.named_parameters()],
                                 loss_of, probe_tolerance(torch.float64, False), what=what).run(list(range(6)))
    return next(str(w.message) for w in caught if "draws random numbers" in str(w.message))


def test_the_module_whose_forward_drew_is_named():
    torch.manual_seed(0)
    model = Net(jitter=True).double()
    text = _warning(model, lambda idx: F.cross_entropy(model(X[idx]), Y[idx]), "training_step")
    assert text.startswith("DPStrategy: the training step") and "module 'jitter' (Jitter)" in text
    assert "outside any module's forward" not in text and "__getitem__" not in text


def test_the_warning_has_its_own_category_and_says_how_to_silence_per_example_draws():
    from lightning_dp.errors import RandomStepWarning

    torch.manual_seed(0)
    model = Net(jitter=True).double()
    engine = make_engine("ghost")
    engine.attach(model)
    with pytest.warns(RandomStepWarning) as caught:
        ExampleIndependenceProbe(model, engine, list(model.parameters()), [n for n, _ in model.named_parameters()],
                                 lambda idx: F.cross_entropy(model(X[idx]), Y[idx]),
                                 probe_tolerance(torch.float64, False), what="training_step").run(list(range(6)))
    text = next(str(w.message) for w in caught if isinstance(w.message, RandomStepWarning))
    assert "reparameterisation" in text and "category=lightning_dp.errors.RandomStepWarning" in text


def test_augmentation_in_a_plain_loops_loss_is_named_with_the_dataset_alternative():
    torch.manual_seed(0)
    model = Net(jitter=False).double()

    def loss_of(idx):
        x = X[idx]
        return F.cross_entropy(model(x + 0.3 * torch.randn_like(x)), Y[idx])

    text = _warning(model, loss_of, "the loss function")
    assert text.startswith("PrivateStep: the loss function given to verify()") and "DPStrategy" not in text
    assert "outside any module's forward" in text and "__getitem__" in text and "module '" not in text


def test_draws_inside_and_outside_the_forwards_are_told_apart():
    model = Net(jitter=True).double()
    found, outside = drawing_modules(model, lambda: model(X))
    assert [name for name, _ in found] == ["jitter"] and not outside
    found, outside = drawing_modules(model, lambda: model(X + torch.randn_like(X)))
    assert [name for name, _ in found] == ["jitter"] and outside
    model = Net(jitter=False).double()
    assert drawing_modules(model, lambda: model(X)) == ([], False)


def test_hugging_face_spec_augment_is_named_with_how_to_turn_it_off():
    transformers = pytest.importorskip("transformers")

    def tiny(**config) -> nn.Module:
        torch.manual_seed(0)
        return transformers.Wav2Vec2ForSequenceClassification(transformers.Wav2Vec2Config(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, conv_dim=(8, 8),
            conv_stride=(5, 4), conv_kernel=(10, 4), num_feat_extract_layers=2, num_conv_pos_embeddings=8,
            num_conv_pos_embedding_groups=2, num_labels=2, mask_time_length=2, layerdrop=0.0, **config)).train()

    audio = torch.randn(2, 800)
    model = tiny()
    with NoDropout():  # as the probe's passes run: dropout is not the step's own randomness
        found, outside = drawing_modules(model, lambda: model(audio))
    assert ("wav2vec2", model.wav2vec2) in found and not outside
    text = random_step_warning("training_step", found, outside)
    assert "'wav2vec2' (Wav2Vec2Model)" in text and "apply_spec_augment=False" in text and "__getitem__" not in text
    model = tiny(apply_spec_augment=False)
    with NoDropout():
        assert drawing_modules(model, lambda: model(audio)) == ([], False)


def test_draws_in_the_collate_function_warn_and_the_advice_is_the_datasets_getitem():
    """qa11 f3: the warning said augmentation in 'the collate function' trains without it, but only ``dataset[i]`` is
    read from generators seeded per record; a collate draws for the whole batch, so per-item masking there warns."""
    import warnings

    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dp import DPStrategy
    from lightning_dp.errors import RandomStepWarning

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(5, 3)

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def collate(items):
        return torch.stack([x * (torch.rand(x.shape) > 0.2) for x, _ in items]), torch.stack([y for _, y in items])

    data = TensorDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))
    trainer = pl.Trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), accelerator="cpu", devices=1,
                         max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Model(), DataLoader(data, batch_size=16, collate_fn=collate))
    text = next(str(w.message) for w in caught if issubclass(w.category, RandomStepWarning))
    assert "__getitem__ (not the collate function" in text and "(or the collate" not in text
