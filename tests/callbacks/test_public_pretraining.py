"""PublicPretraining: the model is trained on the public set before the private fit, nothing of it reaches
the private mechanism or its ledger, frozen layers never move afterwards (no noise, no update), and resume
keeps the checkpoint's weights and the freezing (issue 21)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyClassifier, make_loader, quiet_trainer
from pytorch_lightning.callbacks import Callback, ModelCheckpoint

from lightning_dp import DPStrategy, PublicPretraining


def _public(n: int = 400, seed: int = 7):
    return make_loader(n=n, seed=seed).dataset  # same task, other draws: stands in for public data


class _AtFitStart(Callback):
    """The parameters (and their requires_grad) once the strategy has set up, before the first private step."""

    def on_fit_start(self, trainer, pl_module):
        self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        self.trainable = {n for n, p in pl_module.named_parameters() if p.requires_grad}


def _accuracy(module, dataset) -> float:
    x, y = dataset.tensors
    with torch.no_grad():
        return float((module(x).argmax(1) == y).float().mean())


def test_pretraining_learns_the_public_task_before_the_first_private_step():
    torch.manual_seed(0)
    module, public = TinyClassifier(), _public()
    before = _accuracy(module, public)
    seen = _AtFitStart()
    pre = PublicPretraining(public, epochs=5, lr=0.05, batch_size=20)
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    quiet_trainer(strategy=strategy, max_steps=3, callbacks=[pre, seen]).fit(module, make_loader())
    assert len(pre.losses) == 5 and pre.losses[-1] < 0.5 * pre.losses[0]
    probe = TinyClassifier()
    probe.load_state_dict(seen.params)
    assert _accuracy(probe, public) > max(0.9, before)  # learned before any private step ran
    assert strategy.ledger.steps == 3  # pretraining steps are not private steps: not in the ledger


def test_frozen_layers_never_move_and_the_rest_trains():
    torch.manual_seed(0)
    module = TinyClassifier()
    seen = _AtFitStart()
    strategy = DPStrategy(noise_multiplier=2.0, max_grad_norm=1.0)
    quiet_trainer(strategy=strategy, max_steps=5, callbacks=[PublicPretraining(_public(), epochs=1, freeze=["net.0"]), seen]
                  ).fit(module, make_loader())
    assert seen.trainable == {"net.2.weight", "net.2.bias"}
    after = dict(module.named_parameters())
    for name in ("net.0.weight", "net.0.bias"):
        assert torch.equal(after[name].detach(), seen.params[name])  # noise σ = 2 would move any noised coordinate
        assert not after[name].requires_grad
    assert not torch.equal(after["net.2.weight"].detach(), seen.params["net.2.weight"])


def test_a_wrong_layer_name_fails_before_pretraining_and_names_the_layers():
    calls = []

    def loss(out, y):
        calls.append(1)
        return F.cross_entropy(out, y)

    pre = PublicPretraining(_public(), epochs=1, freeze=["features"], loss=loss)
    with pytest.raises(ValueError, match=r"no submodule 'features'.*net"):
        quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=1, callbacks=[pre]).fit(
            TinyClassifier(), make_loader())
    assert not calls


@pytest.mark.parametrize("kwargs", [dict(epochs=-1), dict(batch_size=0), dict(lr=0.0)])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        PublicPretraining(_public(), **kwargs)


def test_test_after_fit_does_not_pretrain_again():
    module = TinyClassifier()
    pre = PublicPretraining(_public(), epochs=2)
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=2, callbacks=[pre])
    trainer.fit(module, make_loader())
    weights = [p.detach().clone() for p in module.parameters()]
    pre.losses = []
    module.test_step = lambda batch, batch_idx: None
    trainer.test(module, make_loader(seed=1))  # held-out records (the training ones: refused, evaluated_records)
    assert pre.losses == [] and all(torch.equal(a, p) for a, p in zip(weights, module.parameters()))


def test_resume_keeps_the_checkpoint_weights_and_the_freezing(tmp_path):
    first = TinyClassifier()
    quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_epochs=1, enable_checkpointing=True,
                  callbacks=[PublicPretraining(_public(), epochs=2, freeze=["net.0"], seed=0),
                             ModelCheckpoint(dirpath=tmp_path, save_last=True)]).fit(first, make_loader())
    saved = first.net[0].weight.detach().clone()
    resumed = TinyClassifier()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    # another pretraining seed gives other features; the checkpoint's must win, and stay frozen
    quiet_trainer(strategy=strategy, max_epochs=2,
                  callbacks=[PublicPretraining(_public(), epochs=2, freeze=["net.0"], seed=1)]).fit(
        resumed, make_loader(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert torch.equal(resumed.net[0].weight.detach(), saved) and not resumed.net[0].weight.requires_grad
    assert strategy.ledger.steps == 20


def test_pretraining_converts_no_tensor_that_requires_grad_to_a_number():
    """The epoch's loss is summed from detached values: torch's 'Converting a tensor with requires_grad=True to a
    scalar' warning is not raised by our loop (issue 35: it was, once per fit)."""
    import warnings

    from lightning_dp.callbacks.public_pretraining import pretrain

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning of the loop fails the test
        losses = pretrain(TinyClassifier(), _public(n=40), epochs=1, lr=0.05, batch_size=20)
    assert len(losses) == 1


def _private_and_public_views():
    """A private training Subset of one tensor pair and the "public" sets built from it (red team i2)."""
    from torch.utils.data import Subset, TensorDataset

    full = make_loader(n=300, seed=3).dataset
    x, y = full.tensors
    private = Subset(full, range(100, 250))
    return full, private, {
        "same": private,
        "overlapping_subset": Subset(full, range(0, 150)),
        "copied_rows": TensorDataset(x[100:250].clone(), y[100:250].clone()),
        "wrapper": Subset(private, range(0, 60)),
    }


@pytest.mark.parametrize("kind", ["same", "overlapping_subset", "copied_rows", "wrapper"])
def test_the_private_training_set_declared_public_is_refused_before_it_trains(kind):
    from torch.utils.data import DataLoader

    from lightning_dp.errors import PrivacyConfigurationError

    _, private, public = _private_and_public_views()
    module = TinyClassifier()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    pre = PublicPretraining(public[kind], epochs=2, batch_size=20)
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(PrivacyConfigurationError, match=r"(?s)declared public are records of the private.*"
                                                        r"Pass public data.*train on these records privately"):
        quiet_trainer(strategy=strategy, max_steps=3, callbacks=[pre]).fit(module, DataLoader(private, batch_size=20))
    assert pre.losses == []  # refused before a step of pretraining
    assert all(torch.equal(p.detach(), before[n]) for n, p in module.named_parameters())
    assert strategy.ledger.steps == 0


class _OwnLoader(TinyClassifier):
    """The training loader from the module's own hook: not known at the callback's ``setup``."""

    def __init__(self, dataset) -> None:
        super().__init__()
        self.dataset = dataset

    def train_dataloader(self):
        from torch.utils.data import DataLoader

        return DataLoader(self.dataset, batch_size=20)


def test_a_loader_from_the_module_is_refused_when_the_private_fit_attaches_before_any_release():
    from lightning_dp.errors import PrivacyConfigurationError

    _, private, public = _private_and_public_views()
    pre = PublicPretraining(public["copied_rows"], epochs=1, batch_size=20)
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(PrivacyConfigurationError, match="inside lightning_dp.public_steps"):
        quiet_trainer(strategy=strategy, max_steps=3, callbacks=[pre]).fit(_OwnLoader(private))
    assert len(pre.losses) == 1 and strategy.ledger.steps == 0  # it trained, but nothing was released


def test_a_held_out_part_of_the_same_tensor_and_a_set_sharing_a_few_rows_still_train():
    from torch.utils.data import DataLoader, Subset, TensorDataset

    full, private, _ = _private_and_public_views()
    other = _public(n=200)
    x, y = other.tensors
    x[[10, 90, 170]] = full.tensors[0][[120, 180, 240]]  # 3 of 200 rows identical to training rows (1.5 %)
    for i, public in enumerate((Subset(full, range(0, 100)), TensorDataset(x, y))):
        torch.manual_seed(0)
        strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
        pre = PublicPretraining(public, epochs=1, batch_size=20)
        quiet_trainer(strategy=strategy, max_steps=2, callbacks=[pre]).fit(TinyClassifier(),
                                                                          DataLoader(private, batch_size=20))
        # 2 of its own; the second fit on the same private records continues the first's 2 (the data's record)
        assert len(pre.losses) == 1 and strategy.ledger.steps == 2 * (i + 1)
