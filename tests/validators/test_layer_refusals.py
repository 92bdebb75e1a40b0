"""Layers refused by validators/layers.py, before training or at the call that would break the guarantee, each
with an error naming the layer and the fix; and the BatchNorm use that is served (eval mode, frozen statistics)."""

from __future__ import annotations

import copy
import pickle
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parents[1] / "zoo"))

import zoo  # noqa: E402

from lightning_dp import DPStrategy, PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.layers import _CallCheck, install_call_checks, validate_module  # noqa: E402

D, V, T = zoo.D, zoo.V, zoo.T
ENGINES = ["ghost", "vmap", "opacus_hooks"]


def _call_checks(module: nn.Module) -> list[_CallCheck]:
    return [h for h in module._forward_pre_hooks.values() if isinstance(h, _CallCheck)]


# ---------------------------------------------------------------- legacy weight_norm / spectral_norm
class LegacyWeightNorm(zoo.Base):
    """torch.nn.utils.weight_norm (the pre-parametrize API): ``weight`` recomputed from weight_g/weight_v by a
    forward pre-hook."""

    def __init__(self) -> None:
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (deprecated in favour of the parametrizations API)
            self.a = torch.nn.utils.weight_norm(nn.Linear(D, D))
        self.b = nn.Linear(D, 3)

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.b(torch.tanh(self.a(x))), y)


def test_legacy_weight_norm_is_refused_before_training():
    zoo.assert_refused(LegacyWeightNorm, zoo.vector_data(),
                       r"layer 'a' \(Linear\).*torch\.nn\.utils\.weight_norm.*remove_weight_norm\(layer, 'weight'\)"
                       r".*parametrizations\.weight_norm, which is served")


class LazyHead(zoo.Base):
    """``nn.LazyLinear``: its parameters get their shape at the first forward (zoo21 e1: a raw ValueError before)."""

    def __init__(self, materialise: bool = False) -> None:
        super().__init__()
        self.a = nn.LazyLinear(3)
        if materialise:
            self.a(torch.zeros(1, D))

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.a(x), y)


def test_an_unmaterialised_lazy_layer_is_refused_before_training_by_name():
    model = LazyHead()
    with pytest.raises(PrivacyConfigurationError, match=r"layer 'a' \(LazyLinear\) is lazy.*torch\.zeros\(1, "):
        quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=2).fit(
            model, DataLoader(zoo.vector_data(), batch_size=2))
    assert isinstance(model.a.weight, nn.parameter.UninitializedParameter)  # no step ran


def test_a_lazy_layer_materialised_before_fit_trains():
    model = LazyHead(materialise=True)
    before = model.a.weight.detach().clone()
    quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=2).fit(
        model, DataLoader(zoo.vector_data(), batch_size=2))
    assert not torch.equal(before, model.a.weight)


def test_legacy_spectral_norm_is_refused_by_name():
    model = nn.Sequential(nn.Linear(D, D), torch.nn.utils.spectral_norm(nn.Linear(D, 3)))
    [problem] = validate_module(model)
    assert "layer '1' (Linear)" in problem and "torch.nn.utils.spectral_norm" in problem
    assert "remove_spectral_norm(layer, 'weight')" in problem


# ---------------------------------------------------------------- scale_grad_by_freq
class FrequencyScaled(zoo.Base):
    """Row gradients divided by the token's count in the whole batch: the examples interact."""

    bag = False

    def __init__(self) -> None:
        super().__init__()
        self.emb = (nn.EmbeddingBag(V, D, mode="sum", scale_grad_by_freq=True) if self.bag
                    else nn.Embedding(V, D, scale_grad_by_freq=True))
        self.head = nn.Linear(D, 3)

    def loss(self, batch):
        x, y = batch
        h = self.emb(x) if self.bag else self.emb(x).mean(1)
        return F.cross_entropy(self.head(torch.tanh(h)), y[:, 0] % 3)


class FrequencyScaledBag(FrequencyScaled):
    bag = True


@pytest.mark.parametrize("factory,kind", [(FrequencyScaled, "Embedding"), (FrequencyScaledBag, "EmbeddingBag")])
def test_scale_grad_by_freq_is_refused_by_name(factory, kind):
    zoo.assert_refused(factory, zoo.token_data(),
                       rf"layer 'emb' \({kind}\(scale_grad_by_freq=True\)\).*Use scale_grad_by_freq=False")


# ---------------------------------------------------------------- sparse gradients
class SparseEmbedding(zoo.Base):
    """nn.Embedding(sparse=True) trained by torch.optim.SparseAdam, the pairing torch documents for it."""

    sparse, optimizer = True, "sparse_adam"

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D, sparse=self.sparse), nn.Linear(D, 3)

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.head(torch.tanh(self.emb(x).mean(1))), y[:, 0] % 3)

    def configure_optimizers(self):
        if self.optimizer == "sparse_adam":
            return torch.optim.SparseAdam(list(self.parameters()), lr=1e-2)
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class SparseEmbeddingAdam(SparseEmbedding):
    """sparse=True with a dense optimizer."""

    optimizer = "adam"


class DenseEmbeddingSparseAdam(SparseEmbedding):
    """SparseAdam on dense layers: it would refuse the released (dense) gradient at optimizer.step()."""

    sparse = False


def test_sparse_embedding_with_sparse_adam_is_refused_by_name():
    """The safezoo6 crash (a NotImplementedError inside the probe's comparison of a sparse gradient): refused before
    any release, naming the layer and the fix."""
    zoo.assert_refused(SparseEmbedding, zoo.token_data(),
                       r"SparseAdam takes sparse gradients only \(layer 'emb' \(Embedding\(sparse=True\)\)\).*does "
                       r"not support sparse gradients.*dense.*noise.*every coordinate.*torch\.optim\.Adam.*"
                       r"sparse=False")


@pytest.mark.parametrize("kind", ["Embedding", "EmbeddingBag"])
def test_sparse_embedding_is_refused_before_training(kind):
    """sparse=True with a dense optimizer: refused by the model's validation, by name, before the first forward."""
    layer = nn.Embedding(V, D, sparse=True) if kind == "Embedding" else nn.EmbeddingBag(V, D, sparse=True)
    [problem] = validate_module(nn.Sequential(layer, nn.Linear(D, 3)))
    assert f"layer '0' ({kind}(sparse=True)) produces sparse gradients" in problem
    assert "not support" in problem and "every coordinate" in problem
    assert f"{kind}(..., sparse=False)" in problem and "torch.optim.Adam" in problem
    zoo.assert_refused(SparseEmbeddingAdam, zoo.token_data(),
                       r"layer 'emb' \(Embedding\(sparse=True\)\) produces sparse gradients.*sparse=False")


def test_sparse_adam_on_dense_layers_is_refused_before_training():
    """SparseAdam refuses dense gradients at its step, which would come after the first release: refused first."""
    zoo.assert_refused(DenseEmbeddingSparseAdam, zoo.token_data(),
                       r"SparseAdam takes sparse gradients only, and the private step.*torch\.optim\.Adam")


def test_sparse_adam_is_refused_in_a_plain_loop():
    from lightning_dp.privacy.noise import GaussianNoise
    from lightning_dp.privacy.private_step import PrivateStep

    model = nn.Sequential(nn.Embedding(V, D), nn.Flatten(), nn.Linear(D * T, 3))
    step = PrivateStep(noise_multiplier=1.0, max_grad_norm=1.0, noise=GaussianNoise())
    with pytest.raises(PrivacyConfigurationError, match=r"SparseAdam takes sparse gradients only.*torch\.optim\.Adam"):
        step.attach(model, torch.optim.SparseAdam(list(model.parameters()), lr=1e-2))


# ---------------------------------------------------------------- EmbeddingBag: 1-D input with offsets
class BagOffsets(zoo.Base):
    """The documented variable-length call: every example's bag packed into one flat tensor, with offsets."""

    def __init__(self) -> None:
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(V, D, mode="mean", padding_idx=0), nn.Linear(D, 3)

    def lengths(self, x):
        return 1 + x[:, 0] % T  # each bag's length, from its own example

    def loss(self, batch):
        x, y = batch
        lens = self.lengths(x)
        flat = torch.cat([x[i, :lens[i]] for i in range(x.shape[0])])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])
        return F.cross_entropy(self.head(torch.tanh(self.bag(flat, offsets=offsets))), y[:, 0] % 3)


class BagPadded(BagOffsets):
    """The fix: the same bags as [B, L] rows, padded with padding_idx (left out of the mean)."""

    def loss(self, batch):
        x, y = batch
        padded = x.masked_fill(torch.arange(T)[None] >= self.lengths(x)[:, None], 0)  # tokens are ≥ 1
        return F.cross_entropy(self.head(torch.tanh(self.bag(padded))), y[:, 0] % 3)


class BagWeighted(BagOffsets):
    """mode='sum' with per_sample_weights [B, L]: padding by zero weights."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(V, D, mode="sum")

    def loss(self, batch):
        x, y = batch
        weights = (torch.arange(T)[None] < self.lengths(x)[:, None]).to(self.head.weight.dtype) / T
        return F.cross_entropy(self.head(torch.tanh(self.bag(x, per_sample_weights=weights))), y[:, 0] % 3)


class BagOffsetsWeighted(BagOffsets):
    """mode='sum' on the packed input, per_sample_weights packed the same way (flat, one per token)."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(V, D, mode="sum", padding_idx=0)

    def loss(self, batch):
        x, y = batch
        lens = self.lengths(x)
        flat = torch.cat([x[i, :lens[i]] for i in range(x.shape[0])])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])  # include_last_offset=False: B of
        weights = (flat % 3 + 1).to(self.head.weight.dtype) / T
        out = self.bag(flat, offsets[:-1], per_sample_weights=weights)
        return F.cross_entropy(self.head(torch.tanh(out)), y[:, 0] % 3)


class BagOffsetsMax(BagOffsets):
    """mode='max' on the packed input: not served."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(V, D, mode="max")


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
@pytest.mark.parametrize("factory", [BagOffsets, BagOffsetsWeighted])
def test_embedding_bag_on_a_flat_input_with_offsets_is_exact(factory, engine):
    """The bags are the examples (the offsets' dimension, not the input's): one step, the probe included, equals the
    per-example loop."""
    zoo.assert_exact(factory, zoo.token_data(), per_sample=engine)


class BagMisaligned(BagOffsets):
    """Offsets that do not follow the examples (every bag 3 tokens of the packed input, the last one the rest): bag b
    holds other examples' tokens, so output row b is not example b's alone."""

    def loss(self, batch):
        x, y = batch
        lens = self.lengths(x)
        flat = torch.cat([x[i, :lens[i]] for i in range(x.shape[0])])
        offsets = (torch.arange(x.shape[0]) * 3).clamp(max=flat.shape[0])
        return F.cross_entropy(self.head(torch.tanh(self.bag(flat, offsets))), y[:, 0] % 3)


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_embedding_bag_offsets_that_mix_examples_are_refused_by_the_probe(engine):
    """The probe compares each example alone with the batch: bags that are not the examples show."""
    zoo.assert_refused(BagMisaligned, zoo.token_data(), r"Examples interact", per_sample=engine)


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_embedding_bag_max_on_a_flat_input_with_offsets_is_refused_at_the_call(engine):
    zoo.assert_refused(BagOffsetsMax, zoo.token_data(),
                       r"layer 'bag' \(EmbeddingBag\(mode='max'\)\) was called on a 1-D input with offsets.*"
                       r"mode='sum' or mode='mean'.*2-D \[B, L\].*padding_idx", per_sample=engine)


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
@pytest.mark.parametrize("factory", [BagPadded, BagWeighted])
def test_embedding_bag_on_bags_as_rows_is_exact(factory, engine):
    zoo.assert_exact(factory, zoo.token_data(), per_sample=engine)


def test_call_checks_leave_the_model_after_the_fit():
    """Once detached, the model is the user's again: a flat EmbeddingBag call is no longer refused."""
    torch.manual_seed(0)
    model = BagPadded().double()
    zoo.private_step(model, zoo._as_double(zoo.token_data()))
    assert _call_checks(model.bag)  # installed for the fit; gone at the first call after it
    out = model.bag(torch.tensor([1, 2, 3]), torch.tensor([0, 2]))
    out.sum().backward()
    assert not _call_checks(model.bag)


def test_call_checks_follow_copies_and_pickle():
    model = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.EmbeddingBag(V, D))
    install_call_checks(model)
    install_call_checks(model)  # replaced, not doubled
    assert [len(_call_checks(m)) for m in model] == [0, 1, 1]
    twin = copy.deepcopy(model)
    assert _call_checks(twin[1])[0]._root() is twin
    restored = pickle.loads(pickle.dumps(model))
    assert _call_checks(restored[1])[0]._root is None  # inactive
    restored[1](torch.randn(4, D))  # training mode, not attached: the user's own business


# ---------------------------------------------------------------- BatchNorm
class FrozenBatchNorm(zoo.Base):
    """Fine-tuning with frozen BatchNorm statistics: eval mode, no trainable affine (a per-example affine map)."""

    norm = nn.BatchNorm1d

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(D, D), self.norm(D), nn.Linear(D, 3)
        with torch.no_grad():  # statistics "from pretraining"
            self.bn.running_mean.uniform_(-1.0, 1.0)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-1.0, 1.0)
        self.bn.requires_grad_(False)
        self.bn.eval()

    def on_train_epoch_start(self):
        self.bn.eval()  # after any model.train()

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.b(torch.tanh(self.bn(self.a(x)))), y)


class FrozenSyncBatchNorm(FrozenBatchNorm):
    norm = nn.SyncBatchNorm


class BatchNormLeftTraining(FrozenBatchNorm):
    """The same model whose BatchNorm runs in training mode (the module never keeps it in eval)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn.train()

    def on_train_epoch_start(self):
        pass


class SyncBatchNormLeftTraining(BatchNormLeftTraining):
    norm = nn.SyncBatchNorm


class BatchStatisticsOnly(FrozenBatchNorm):
    """track_running_stats=False: batch statistics in eval mode too."""

    def __init__(self) -> None:
        zoo.Base.__init__(self)
        self.a, self.bn, self.b = nn.Linear(D, D), nn.BatchNorm1d(D, track_running_stats=False), nn.Linear(D, 3)
        self.bn.requires_grad_(False)
        self.bn.eval()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("factory", [FrozenBatchNorm, FrozenSyncBatchNorm])
def test_frozen_batchnorm_kept_in_eval_is_exact(factory, engine):
    zoo.assert_exact(factory, zoo.vector_data(), per_sample=engine)


class TrainableEvalBatchNorm(FrozenBatchNorm):
    """Running statistics frozen (eval mode), affine weight and bias trained."""

    def __init__(self) -> None:
        super().__init__()
        self.bn.requires_grad_(True)


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
def test_trainable_batchnorm_affine_in_eval_is_exact(engine):
    strategy = zoo.assert_exact(TrainableEvalBatchNorm, zoo.vector_data(), per_sample=engine)
    assert strategy.lightning_module.bn.weight.requires_grad


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("factory,kind", [(BatchNormLeftTraining, "BatchNorm1d"),
                                          (SyncBatchNormLeftTraining, "SyncBatchNorm")])
def test_batchnorm_in_training_mode_is_refused_at_its_first_forward(factory, kind, engine):
    torch.manual_seed(0)
    model = factory().double()
    stats = [model.bn.running_mean.clone(), model.bn.running_var.clone()]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyConfigurationError,
                       match=rf"layer 'bn' \({kind}\) ran in training mode.*self\.bn\.eval\(\).*GroupNorm\(num_groups, "
                             rf"{D}\)"):
        zoo.private_step(model, zoo._as_double(zoo.vector_data()), per_sample=engine)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters())), "a release happened"
    assert torch.equal(stats[0], model.bn.running_mean) and torch.equal(stats[1], model.bn.running_var)


class BatchNormTrainedLater(FrozenBatchNorm):
    """Eval for the first step, then switched to training mode by the module itself."""

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step >= 1:
            self.train()  # e.g. a stray model.train(): BatchNorm back to batch statistics
        return super().training_step(batch, batch_idx)


def test_batchnorm_switched_to_training_mode_later_is_refused_before_any_release():
    """The first step's checks run the step as it would run later in the plan (global_step set ahead), where the module
    switches its BatchNorm back to training mode: refused before the first release, the statistics untouched."""
    torch.manual_seed(0)
    model = BatchNormTrainedLater().double()
    stats = model.bn.running_mean.clone()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=0.3, noise=zoo.ZeroNoise())
    trainer = quiet_trainer(strategy=strategy, max_steps=3)
    data = zoo._as_double(zoo.vector_data())
    with pytest.raises(PrivacyConfigurationError, match=r"layer 'bn' \(BatchNorm1d\) ran in training mode"):
        trainer.fit(model, DataLoader(data, batch_size=len(data)))
    assert strategy.ledger.steps == 0
    assert torch.equal(stats, model.bn.running_mean)


def test_batchnorm_without_running_statistics_is_refused_before_training():
    zoo.assert_refused(BatchStatisticsOnly, zoo.vector_data(),
                       r"layer 'bn' \(BatchNorm1d\(track_running_stats=False\)\).*GroupNorm\(num_groups, 6\)")


def test_auto_names_eval_mode_as_the_fix_for_a_trainable_batchnorm_in_training_mode():
    """No engine serves a BatchNorm with trainable affine weights in training mode: the refusal names the layer once
    and the fix that works (eval mode before fit; its weights still train), not 'freeze them'."""
    from lightning_dp.grad_sample.auto import select_engine

    model = TrainableEvalBatchNorm()
    model.bn.train()
    with pytest.raises(ValueError, match="No per-example gradient engine") as refused:
        select_engine(model)
    text = str(refused.value)
    assert "self.bn.eval()" in text and "freeze" not in text.lower() and text.count("bn (") == 1, text
    nested = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    with pytest.raises(ValueError, match=r"self\.get_submodule\('1'\)\.eval\(\)"):
        select_engine(nested)


class _ComplexSpectral(nn.Module):
    """A spectral layer with a complex weight, held complex (``real=False``) or as its real view (``real=True``)."""

    def __init__(self, real: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        w = torch.randn(4, 3, dtype=torch.complex64) * 0.3
        self.real = real
        self.w = nn.Parameter(torch.view_as_real(w).clone() if real else w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.view_as_complex(self.w) if self.real else self.w
        return (x.to(torch.complex64) @ w).abs()


def test_a_complex_parameter_is_refused_by_name_and_its_real_view_trains():
    """zoo34 S22: a complex weight failed inside the engine ("please report"); it is refused before training, naming
    the parameter and the real view that trains."""
    [problem] = validate_module(nn.Sequential(_ComplexSpectral(real=False)))
    assert "parameter '0.w' is complex (torch.complex64)" in problem and "torch.view_as_real" in problem
    assert validate_module(nn.Sequential(_ComplexSpectral(real=True))) == []

    import pytorch_lightning as pl

    class Spectral(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = _ComplexSpectral(real=True)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    model = Spectral()
    before = model.layer.w.detach().clone()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
    quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0),
                  max_steps=3).fit(model, DataLoader(data, batch_size=16))
    assert not torch.equal(before, model.layer.w.detach())
