"""Spectral normalisation (``torch.nn.utils.parametrizations.spectral_norm``) under the private step: every pass of a
step divides by the same σ(W), per-example gradients through W/σ(W) equal a per-example loop of torch autograd, and
the power iteration advances u, v exactly once per update (power_iteration.py); once refused
(red team zoo26)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent / "zoo"))

import zoo  # noqa: E402

from lightning_dp import DPStrategy  # noqa: E402
from lightning_dp.power_iteration import PowerIterations, buffers_set_apart, spectral_norms  # noqa: E402

N, D = 8, 6


def images(seed: int = 0) -> TensorDataset:
    """Real (label 1) and synthetic (label 0) 1×8×8 images: a discriminator's training batch."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(N, 1, 8, 8, generator=g), torch.randint(0, 2, (N,), generator=g).double())


class Discriminator(zoo.Base):
    """An SN-GAN discriminator (Miyato et al.): spectral-normalised convolutions and linear head, LeakyReLU, a
    real/fake logit trained with binary cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        sn = parametrizations.spectral_norm
        self.body = nn.Sequential(sn(nn.Conv2d(1, 4, 3, stride=2, padding=1)), nn.LeakyReLU(0.1),
                                  sn(nn.Conv2d(4, 4, 3, stride=2, padding=1)), nn.LeakyReLU(0.1), nn.Flatten())
        self.head = sn(nn.Linear(4 * 2 * 2, 1))

    def loss(self, batch):
        x, y = batch
        return F.binary_cross_entropy_with_logits(self.head(self.body(x)).squeeze(1), y)


class Classifier(zoo.Base):
    """An MLP classifier with a spectral norm on its hidden layer (Lipschitz-constrained, 3 power iterations)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = parametrizations.spectral_norm(nn.Linear(D, D), n_power_iterations=3)
        self.b = nn.Linear(D, 3)

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.b(torch.tanh(self.a(x))), y)


def vectors(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(N, D, generator=g), torch.randint(0, 3, (N,), generator=g))


def _uv(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for _, _, p in spectral_norms(model) for t in (p._u, p._v)]


def _reference(model: zoo.Base, dataset: TensorDataset, C: float) -> list[torch.Tensor]:
    """−Σ_i clip_C(g_i)/N by a loop of torch autograd, each example alone, σ(W) from u, v held (the iteration off:
    eval mode of the spectral norms only), so every example differentiates W/σ(W) with the same u, v."""
    for _, _, p in spectral_norms(model):
        p.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(dataset)):
        grads = torch.autograd.grad(model.loss([t[i:i + 1] for t in dataset.tensors]), params)
        factor = min(1.0, C / (float(torch.sqrt(sum(g.pow(2).sum() for g in grads))) + 1e-6))
        total = [t + factor * g for t, g in zip(total, grads)]
    return [-t / len(dataset) for t in total]


@pytest.mark.parametrize("engine", ["ghost", "vmap"])
@pytest.mark.parametrize("factory,data", [(Discriminator, images), (Classifier, vectors)], ids=["sngan", "mlp"])
def test_per_example_gradients_through_the_spectral_norm_equal_a_loop(factory, data, engine):
    """One step, zero noise, q = 1: the update is −Σ clip_C(g_i)/N of the gradients of W/σ(W) (σ's u, v held as
    torch's spectral_norm holds them), the same σ for every example and every pass of the step."""
    torch.manual_seed(0)
    model = factory().double()
    dataset = TensorDataset(*(t.double() if t.is_floating_point() else t for t in data().tensors))
    want = _reference(copy.deepcopy(model), dataset, C=0.3)
    _, got = zoo.private_step(model, dataset, per_sample=engine, C=0.3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-9)


def test_opacus_hooks_refuse_a_spectral_norm_naming_the_engines_that_serve_it():
    zoo.assert_refused(Classifier, vectors(), r"engine 'opacus_hooks' cannot serve layer a .*spectral_norm.*"
                       r"served by 'vmap' and 'ghost'", per_sample="opacus_hooks")


class Counted(Classifier):
    """The classifier, counting each spectral norm's power iterations (every call of its power method with n > 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.iterations, self.weights = 0, []
        norm = self.a.parametrizations.weight[0]
        method = norm._power_method

        def counted(weight_mat, n):
            if n:
                self.iterations += n
                self.weights.append(weight_mat.detach().clone())
            return method(weight_mat, n)

        norm._power_method = counted


@pytest.mark.parametrize("accumulate", [1, 2])
def test_u_and_v_advance_once_per_step_from_the_released_weights(accumulate):
    """Three steps (each of ``accumulate`` physical batches, the first with the probe's and checks' passes): u, v
    advance n_power_iterations times per update, on the weights after it, as torch's training forward would at the
    next step; nothing in a step writes them (the release boundary would refuse it); detach gives the iteration back."""
    torch.manual_seed(0)
    model = Counted().double()
    data = TensorDataset(*(t.double() if t.is_floating_point() else t for t in vectors().tensors))
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=3,
                            accumulate_grad_batches=accumulate)
    trainer.fit(model, DataLoader(data, batch_size=2))
    assert model.iterations == 3 * 3  # 3 updates × n_power_iterations = 3, whatever the passes and physical batches
    assert model.a.parametrizations.weight[0].n_power_iterations == 3  # given back at detach
    assert torch.equal(model.weights[-1], model.a.parametrizations.weight.original)  # the last released weights
    assert all(not torch.equal(a, b) for a, b in zip(model.weights, model.weights[1:]))  # one run per update


def test_the_iteration_follows_the_weights_not_the_passes():
    """PowerIterations directly: held, forwards (training mode) leave u, v alone; advance() runs the power method
    n times on the weights as they are; eval mode is not advanced; release restores n."""
    torch.manual_seed(0)
    layer = parametrizations.spectral_norm(nn.Linear(D, D), n_power_iterations=2)
    twin = copy.deepcopy(layer)
    held = PowerIterations(layer)
    before = _uv(layer)
    for _ in range(3):
        layer(torch.randn(4, D))
    assert all(torch.equal(a, b) for a, b in zip(before, _uv(layer)))
    held.advance()
    twin(torch.randn(1, D))  # torch's own training forward: one n=2 iteration on the same weights
    assert all(torch.equal(a, b) for a, b in zip(_uv(layer), _uv(twin)))
    layer.eval()
    after = _uv(layer)
    held.advance()
    assert all(torch.equal(a, b) for a, b in zip(after, _uv(layer)))
    held.release()
    assert layer.parametrizations.weight[0].n_power_iterations == 2


def test_a_spectral_norm_trained_under_dpstrategy_changes_its_weights():
    """The SN-GAN discriminator trains for a few steps (noise on), weights and u, v move."""
    torch.manual_seed(0)
    model = Discriminator()
    before, uv = [p.detach().clone() for p in model.parameters()], _uv(model)
    quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=3).fit(
        model, DataLoader(images(), batch_size=4))
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(not torch.equal(a, b) for a, b in zip(uv, _uv(model)) if a.numel() > 1)  # (the head's u is ±1)


def test_the_legacy_spectral_norm_is_refused_naming_the_served_one():
    class Legacy(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.utils.spectral_norm(nn.Linear(D, D))

    zoo.assert_refused(Legacy, vectors(), r"layer 'a' \(Linear\).*torch\.nn\.utils\.spectral_norm.*"
                       r"parametrizations\.spectral_norm, which is served")


def test_a_class_of_the_users_named_like_the_spectral_norm_is_not_iterated():
    """zoo29 s07: the iteration is torch's own ``_SpectralNorm`` (recognised by identity, not by name): a user's
    parametrization named so, whose ``_power_method`` reads the training rows, is never called by the library."""
    rows = vectors().tensors[0]

    class _SpectralNorm(nn.Module):  # noqa: N801 (named like torch's on purpose)
        def __init__(self) -> None:
            super().__init__()
            self.n_power_iterations = 1
            self.register_buffer("u", torch.zeros(D))

        def _reshape_weight_to_matrix(self, weight: torch.Tensor) -> torch.Tensor:
            return weight

        def _power_method(self, weight: torch.Tensor, n: int) -> None:
            self.u.copy_(rows.mean(0))

        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return weight

    class Named(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(D, D)
            torch.nn.utils.parametrize.register_parametrization(self.a, "weight", _SpectralNorm())

    model = Named()
    assert spectral_norms(model) == []
    quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=2).fit(
        model, DataLoader(vectors(), batch_size=4))
    assert torch.equal(model.a.parametrizations.weight[0].u, torch.zeros(D))


class OwnPowerIteration(nn.Module):
    """zoo29 s05: a spectral norm of the user's own, its ``u`` advanced from ``W`` in the forward (``copy_`` under
    ``no_grad``, like torch's), from the weights only; ``advanced=False``: the forward only reads it."""

    def __init__(self, rows: int, advanced: bool = True) -> None:
        super().__init__()
        self.advanced = advanced
        self.register_buffer("u", F.normalize(torch.ones(rows), dim=0))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self.training and self.advanced:
            with torch.no_grad():
                self.u.copy_(F.normalize(weight @ F.normalize(weight.t() @ self.u, dim=0), dim=0))
        v = F.normalize(weight.t() @ self.u, dim=0)
        return weight / (self.u @ weight @ v)


class BatchScaled(nn.Module):
    """zoo29 s06: a scale buffer set from the batch's ``|x|`` by a forward pre-hook of the layer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.ones(()))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.s


class OwnParametrized(Classifier):
    def __init__(self, kind: str = "weights") -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        param = OwnPowerIteration(D, advanced=kind != "after") if kind != "batch" else BatchScaled()
        torch.nn.utils.parametrize.register_parametrization(self.a, "weight", param)
        if kind == "batch":
            self.a.register_forward_pre_hook(self._scale)
        self.kind = kind

    def _scale(self, layer: nn.Module, args: tuple) -> None:
        if layer.training:
            with torch.no_grad():
                layer.parametrizations.weight[0].s.copy_(1.0 / (1e-3 + args[0].abs().mean()))

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.kind == "after":  # the iteration advanced after the release, from the weights only
            u, weight = self.a.parametrizations.weight[0].u, self.a.parametrizations.weight.original
            with torch.no_grad():
                u.copy_(F.normalize(weight @ F.normalize(weight.t() @ u, dim=0), dim=0))


def test_a_power_iteration_of_the_users_own_in_the_forward_is_refused_naming_the_fixes():
    """zoo29 s05: refused (the engine cannot run through the in-place write, and a class of the user's own is not
    iterated by the library), by its cause — a buffer written from the weights, not the batch — with the fixes, not
    as an engine failure to report."""
    zoo.assert_refused(OwnParametrized, vectors(), r"^training_step .* writes the buffer a\.parametrizations\.weight"
                       r"\.0\.u in place in the forward, alike on every example: from the weights, not the batch.*"
                       r"parametrizations\.spectral_norm.*on_train_batch_end.*public_state")


def test_a_buffer_set_from_the_batch_in_the_forward_is_refused_by_its_cause():
    """zoo29 s06: refused as a statistic of the batch kept in a buffer, not as the engine's failure."""
    zoo.assert_refused(lambda: OwnParametrized("batch"), vectors(),
                       r"^training_step .* writes the buffer a\.parametrizations\.weight\.0\.s in place from the batch")


def test_a_power_iteration_of_the_users_own_advanced_after_the_release_trains():
    """The first refusal's fix: the forward only reads ``u``, advanced at the batch's end from the weights (declared
    public: its first value is a random draw the checks cannot tell from the data's)."""
    model = OwnParametrized("after")
    u = model.a.parametrizations.weight[0].u.clone()
    quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0,
                                      public_state=["a.parametrizations.weight.0.u"]), max_steps=3).fit(
        model, DataLoader(vectors(), batch_size=4))
    assert not torch.equal(u, model.a.parametrizations.weight[0].u)


def test_buffers_set_apart_tells_the_weights_from_the_batch():
    for kind, apart in (("weights", False), ("batch", True)):
        model = OwnParametrized(kind).double()
        x = vectors().tensors[0].double()
        name = "a.parametrizations.weight.0." + ("u" if kind == "weights" else "s")
        kept = dict(model.named_buffers())[name].clone()
        assert buffers_set_apart(model, [name], lambda i: model.b(model.a(x[i:i + 1])).sum().backward(),
                                 [0, 1]) == {name: apart}
        assert torch.equal(dict(model.named_buffers())[name], kept)  # left as it was
    assert buffers_set_apart(model, [name], lambda i: model.b(model.a(x[i:i + 1])).sum().backward(), [0]) is None


def test_the_in_place_write_declared_public_is_refused_as_torch_funcs_refusal_with_the_fix():
    """The buffer declared public: no longer state the step writes, but torch.func still refuses the write — named
    so, with the fixes, not as an engine to report."""
    zoo.assert_refused(OwnParametrized, vectors(), r"torch\.func refused an in-place write in the forward.*buffer "
                       r"updated in place.*on_train_batch_end.*parametrizations\.spectral_norm",
                       public_state=["a.parametrizations.weight.0.u"])
