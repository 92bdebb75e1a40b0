"""The optimizer's update judged when it runs the user's code (validators/judged_updates.py; rules 2 and 3 of
docs/release_boundary.md): a step of the user's class, a step hook on the optimizer or a global one that reads the
training data is refused at the step it does so (zoo34 L03, L48); an update computed from ĝ, the optimizer's state
and public values trains."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit  # noqa: E402

from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.judged_updates import library_post_hooks_off, users_update_code  # noqa: E402

READ = "The optimizer's update read the training data"


def training_mean(module: Any) -> torch.Tensor:
    """The training set's feature mean, as code inside the step can reach it (through the trainer)."""
    return module.trainer.train_dataloader.dataset.tensors[0].mean(0)


class ReadsData(torch.optim.SGD):
    """A step of the user's class that reads the training set from ``start`` on and writes it ``into`` a place."""

    def __init__(self, module: Any, into: str, start: int = 0) -> None:
        super().__init__(module.parameters(), lr=0.1)
        self.module, self.into, self.start, self.calls = [module], into, start, 0

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = super().step(closure)
        self.calls += 1
        if self.calls <= self.start:
            return loss
        module = self.module[0]
        mean = training_mean(module)
        bias = module.net[2].bias
        if self.into == "weights":
            bias.add_(0.5 * (mean[:2] - bias))
        elif self.into == "state":
            self.state[bias]["center"] = mean.clone()
        elif self.into == "grad":
            bias.grad = mean[:2].clone()
        elif self.into == "rate":
            self.param_groups[0]["lr"] = float(mean.abs().sum())
        elif self.into == "module":
            module.center = mean.clone()
        return loss


class WithStepCode(Classifier):
    def __init__(self, make: Callable[[Any], torch.optim.Optimizer]) -> None:
        super().__init__()
        self.make = make

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.make(self)


@pytest.mark.parametrize("into", ["weights", "state", "grad", "rate", "module"])
def test_a_step_of_the_users_class_reading_the_training_data_is_refused(into: str) -> None:
    model = WithStepCode(lambda m: ReadsData(m, into))
    with pytest.raises(PrivacyConfigurationError, match=READ):
        fit(model, steps=3)
    if into == "weights":  # the refused update was put back: the mean is not in the weights
        assert not torch.allclose(model.net[2].bias, training_mean(model)[:2], atol=0.2)


def test_a_read_that_starts_at_a_later_step_is_refused_there() -> None:
    model = WithStepCode(lambda m: ReadsData(m, "weights", start=2))
    with pytest.raises(PrivacyConfigurationError, match=f"{READ}.* at step 2"):
        fit(model, steps=4)
    assert model.trainer.global_step == 2


def _post_hooked(m: Any) -> torch.optim.Optimizer:
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            m.net[0].bias[:4].copy_(training_mean(m))
    opt.register_step_post_hook(post)
    return opt


def test_a_step_post_hook_copying_the_training_mean_into_the_weights_is_refused() -> None:
    with pytest.raises(PrivacyConfigurationError, match=f"{READ}.*step post-hook"):
        fit(WithStepCode(_post_hooked), steps=3)


def test_a_global_step_hook_reading_the_training_data_is_refused() -> None:
    model = Classifier()

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            model.net[0].bias[:4].copy_(training_mean(model))
    handle = register_optimizer_step_post_hook(post)
    try:
        with pytest.raises(PrivacyConfigurationError, match=f"{READ}.*global optimizer step hook"):
            fit(model, steps=3)
    finally:
        handle.remove()


class Lion(torch.optim.Optimizer):
    """A sign-momentum optimizer of the user's (Lion) keeping a count, a tensor counter and a history of norms."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, b1=0.9, b2=0.99, wd=0.01))
        self.count, self.history = 0, []

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.count += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "m" not in state:
                    state["m"], state["k"] = torch.zeros_like(p), torch.zeros((), dtype=torch.long)
                state["k"] += 1
                p.mul_(1 - group["lr"] * group["wd"])
                p.add_(torch.sign(group["b1"] * state["m"] + (1 - group["b1"]) * p.grad), alpha=-group["lr"])
                state["m"].mul_(group["b2"]).add_(p.grad, alpha=1 - group["b2"])
        self.history.append(float(sum(p.norm() for g in self.param_groups for p in g["params"])))
        return loss


class Lookahead(torch.optim.SGD):
    """SGD with Lookahead's slow weights kept on the optimizer, pulled every third step."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        self.n, self.slow = 0, [p.detach().clone() for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = super().step(closure)
        self.n += 1
        if self.n % 3 == 0:
            for slow, p in zip(self.slow, [p for g in self.param_groups for p in g["params"]]):
                slow.add_(0.5 * (p - slow))
                p.copy_(slow)
        return loss


class Perturbed(torch.optim.SGD):
    """SGD adding a small random perturbation from torch's generator after each update."""

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(torch.randn_like(p) * 1e-4)
        return loss


def _max_norm(m: Any) -> torch.optim.Optimizer:
    opt = torch.optim.SGD(m.parameters(), lr=1.0)

    def project(optimizer: Any, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            w = m.net[0].weight
            w.div_(w.norm(dim=1, keepdim=True).clamp(min=0.5) / 0.5)
    opt.register_step_post_hook(project)
    return opt


@pytest.mark.parametrize("make", [lambda m: Lion(m.parameters()), lambda m: Lookahead(m.parameters()),
                                  lambda m: Perturbed(m.parameters(), lr=0.1), _max_norm],
                         ids=["lion", "lookahead", "perturbed", "max-norm-post-hook"])
def test_an_update_from_the_release_and_the_optimizers_state_trains(make: Callable[[Any], Any]) -> None:
    model = WithStepCode(make)
    fit(model, steps=4)
    assert model.trainer.global_step == 4
    optimizer = model.trainer.optimizers[0]
    if isinstance(optimizer, Lion):  # the runs again were put back: each real step counted once
        assert optimizer.count == 4 and len(optimizer.history) == 4
        assert all(int(s["k"]) == 4 for s in optimizer.state.values())
    if isinstance(optimizer, Lookahead):
        assert optimizer.n == 4


def test_the_users_step_code_is_found_and_the_librarys_hooks_are_left_out_of_a_run_again() -> None:
    layer = torch.nn.Linear(2, 1)
    plain = torch.optim.SGD(layer.parameters(), lr=0.1)
    assert users_update_code(plain) == []
    library_hook = plain.register_step_post_hook(torch.optim.Optimizer.zero_grad)  # a library's function
    assert users_update_code(plain) == []
    calls: list[str] = []
    users = plain.register_step_post_hook(lambda *_: calls.append("user"))
    assert [w.split(" (")[0] for w in users_update_code(plain)] == ["a step post-hook of SGD"]
    assert users_update_code(Lion(layer.parameters())) == ["Lion.step"]
    with library_post_hooks_off(plain):
        assert list(plain._optimizer_step_post_hooks) == [users.id]
    assert list(plain._optimizer_step_post_hooks) == [library_hook.id, users.id]  # put back, in order


def _cached_before_closure(m: Any) -> torch.optim.Optimizer:
    """zoo35 R01: the training mean computed once, before the closure, into a cell of the step's maker."""
    cache: list[torch.Tensor] = []

    class CachedCenter(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
            if not cache:
                cache.append(training_mean(m)[:2].clone())
            with torch.enable_grad():
                loss = closure() if closure is not None else None
            super().step()
            m.net[2].bias.copy_(cache[0])
            return loss
    return CachedCenter(m.parameters(), lr=0.1)


def _tells_the_run_again(m: Any) -> torch.optim.Optimizer:
    """zoo35 R02/X02b: reads the data only when its closure changed .grad (the real step), else writes what it kept."""
    kept: list[Optional[torch.Tensor]] = [None]

    class Sneaky(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
            before = m.net[2].bias.grad
            with torch.enable_grad():
                loss = closure() if closure is not None else None
            if m.net[2].bias.grad is not before or kept[0] is None:
                kept[0] = training_mean(m)[:2].clone()
            super().step()
            m.net[2].bias.copy_(kept[0])
            return loss
    return Sneaky(m.parameters(), lr=0.1)


class InitGroup(torch.optim.SGD):
    """zoo35 R04: torch's own step, a helper of it overridden to read the data."""

    def __init__(self, m: Any) -> None:
        super().__init__(m.parameters(), lr=0.1)
        self.m = [m]

    def _init_group(self, *args: Any) -> Any:
        out = super()._init_group(*args)
        with torch.no_grad():
            self.m[0].net[2].bias.copy_(training_mean(self.m[0])[:2])
        return out


class Rate(float):
    """zoo35 R06: a learning rate whose negation (torch's step computes -lr) reads the labels."""

    module: Any = None

    def __neg__(self) -> float:
        labels = self.module.trainer.train_dataloader.dataset.tensors[1].float()
        return -float(self) * (0.5 + float(labels.mean()))


def _rate_reads_labels(m: Any) -> torch.optim.Optimizer:
    rate = Rate(0.1)
    rate.module = m
    return torch.optim.SGD(m.parameters(), lr=rate)


@pytest.mark.parametrize("make", [_cached_before_closure, _tells_the_run_again, InitGroup, _rate_reads_labels],
                         ids=["cache-before-closure", "tells-the-run-again", "init-group", "rate-object"])
def test_a_read_hidden_from_the_run_again_or_inside_torchs_step_is_refused(make: Callable[[Any], Any]) -> None:
    with pytest.raises(PrivacyConfigurationError, match=READ):
        fit(WithStepCode(make), steps=3)


class CountsAtTheTop(torch.optim.SGD):
    """zoo35 R36: a counter kept on the optimizer, written before the closure."""

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        self.n = getattr(self, "n", 0) + 1
        return super().step(closure)


def test_a_counter_written_at_the_top_of_the_step_trains() -> None:
    model = WithStepCode(lambda m: CountsAtTheTop(m.parameters(), lr=0.1))
    fit(model, steps=3)
    assert model.trainer.optimizers[0].n == 3  # each real step counted once
