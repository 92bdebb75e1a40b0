"""The noise path computes with torch's operations bound at import and refuses a release once its own names are
replaced (lightning_dp/bound_torch.py, lightning_dp/sealed_noise.py; zoo37 T01–T04, T07–T10, T47).

A copy of each draw kept by a pass-through ``torch.Tensor.normal_`` let the user's optimizer step subtract the noise
again (σ = 1000, the weights moved as if σ were 0); a wrapper handed back numbers of its choice; a replaced
``torch._foreach_norm`` inflated the check's norms. Now none of those names is called by the noise path, and what
could still reach it — a module global or a class method of the path, a builtin or ``math`` function it calls, a
``torch.library`` kernel of an operation it dispatches — is refused before anything is drawn."""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from torch.autograd.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, fit, parameters  # noqa: E402

import lightning_dp.privacy.noise as noise_module  # noqa: E402
import lightning_dp.validators.noise_added as noise_added  # noqa: E402
from lightning_dp.privacy.banded_noise import BandedToeplitzNoise  # noqa: E402
from lightning_dp.privacy.csprng import SecureGaussianNoise  # noqa: E402
from lightning_dp.privacy.noise import GaussianNoise, NoiseMechanism  # noqa: E402
from lightning_dp.sealed_noise import OPERATIONS, NoisePathReplacedError, broken_seals  # noqa: E402

MECHANISMS: dict[str, Callable[[], NoiseMechanism]] = {
    "gaussian": lambda: GaussianNoise(seed=1, prefetch=False), "prefetched": lambda: GaussianNoise(prefetch=True),
    "secure": lambda: SecureGaussianNoise(prefetch=False), "banded": lambda: BandedToeplitzNoise(3, seed=4)}

_TENSOR_NAMES = ("normal_", "add_", "mul_", "div_", "copy_", "view", "reshape", "split", "to", "numel",
                 "is_contiguous", "is_floating_point", "double", "tolist", "sum", "clone", "__getitem__", "__mul__",
                 "__sub__", "__neg__", "__truediv__", "__matmul__")
_TORCH_NAMES = ("empty", "add", "randint", "stack", "_foreach_add_", "_foreach_mul_", "_foreach_mul", "_foreach_sub",
                "_foreach_norm", "narrow", "split_with_sizes", "cat", "sqrt", "log1p", "cos", "sin", "zeros",
                "from_numpy", "matmul", "sub", "div", "sum", "select", "index_select", "randn", "finfo")


def _releases(mechanism: NoiseMechanism, steps: int = 4, around: Any = contextlib.nullcontext) -> list[torch.Tensor]:
    """``steps`` releases of zeros (std 2, scaled by ½), each made inside ``around()``."""
    out = []
    for _ in range(steps):
        tensors = [torch.zeros(70_000), torch.zeros(30, 7), torch.zeros(5), torch.zeros(9, 8).t()]
        with around():
            with mechanism.step():
                mechanism.add_noise_(tensors, 2.0, scale_by=0.5)
        out.append(torch.cat([t.reshape(-1) for t in tensors]))
    return out


@pytest.fixture
def recorders(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list[str], Any]]:
    """Every torch function and tensor method the noise path could call replaced by a pass-through that records
    its calls while ``watching()`` (a profiler's timer; an attack's wrapper kept a copy of each draw)."""
    calls: list[str] = []
    active = [False]

    @contextlib.contextmanager
    def watching() -> Iterator[None]:
        active[0] = True
        try:
            yield
        finally:
            active[0] = False

    def recorder(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if active[0]:
                calls.append(name)
            return fn(*args, **kwargs)
        return wrapped

    for name in _TENSOR_NAMES:
        monkeypatch.setattr(torch.Tensor, name, recorder(f"Tensor.{name}", getattr(torch.Tensor, name)))
    for name in _TORCH_NAMES:
        monkeypatch.setattr(torch, name, recorder(f"torch.{name}", getattr(torch, name)))
    yield calls, watching


@pytest.mark.parametrize("kind", list(MECHANISMS))
def test_the_noise_path_calls_no_name_the_user_can_replace(kind: str, recorders: tuple[list[str], Any]) -> None:
    calls, watching = recorders
    mechanism = MECHANISMS[kind]()
    noised = _releases(mechanism, around=watching)
    mechanism.close()
    assert calls == []  # not one call reached a replaced name: no copy of a draw was seen
    z = torch.stack(noised).double() / 2.0  # N(0, 1) per coordinate (zeros scaled by 0.5, std 2)
    assert kind == "banded" or abs(z.var().item() - 1.0) < 0.02  # (banded: correlated, its own tests)


def test_a_fit_draws_its_noise_past_a_pass_through_normal(monkeypatch: pytest.MonkeyPatch) -> None:
    """zoo37 T04/T47: a pass-through ``Tensor.normal_`` keeping each draw given a generator sees none of the fit's."""
    kept: list[torch.Tensor] = []
    normal = torch.Tensor.normal_

    def keeping(self: torch.Tensor, *args: Any, generator: Any = None, **kwargs: Any) -> torch.Tensor:
        out = normal(self, *args, generator=generator, **kwargs)
        if generator is not None:
            kept.append(out.detach().clone())
        return out

    monkeypatch.setattr(torch.Tensor, "normal_", keeping)
    model = Classifier()
    before = parameters(model)
    dp = fit(model, steps=3, noise_multiplier=50.0)
    assert dp.private_step.ledger.steps == 3 and kept == []
    moved = max((a - b).abs().max().item() for a, b in zip(before, parameters(model)))
    assert moved > 0.5  # σ = 50 moved the weights (lr · σC/B per coordinate: ≈ 1)


def _release() -> None:
    GaussianNoise(seed=0, prefetch=False).add_noise_([torch.zeros(1000)], 1.0)


class _Proxy:
    """Forwards to torch's functions; what a proxy for a module's name would be."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch._C._VariableFunctions, name)


REPLACEMENTS: dict[str, Callable[[pytest.MonkeyPatch], str]] = {
    "module global": lambda mp: (mp.setattr(noise_module, "VF", _Proxy()), "lightning_dp.privacy.noise.VF")[1],
    "class method": lambda mp: (mp.setattr(GaussianNoise, "_normal", lambda self, draw, std: torch.zeros(draw.size)),
                                "GaussianNoise._normal")[1],
    "inherited method shadowed": lambda mp: (mp.setattr(GaussianNoise, "variance_factor", lambda self: 1e-6,
                                                        raising=False), "GaussianNoise.variance_factor (added)")[1],
    "builtin shadowed by a global": lambda mp: (mp.setattr(noise_added, "zip", lambda *a: iter(()), raising=False),
                                                "noise_added.zip (added)")[1],
    "math function": lambda mp: (mp.setattr(math, "isfinite", lambda x: False), "math.isfinite")[1],
    "tensor property": lambda mp: (mp.setattr(torch.Tensor, "layout", property(lambda t: torch.strided),
                                              raising=False), "torch.Tensor.layout")[1],
    "check's generator": lambda mp: (mp.setattr(noise_added, "_generator", lambda device: torch.Generator()),
                                     "noise_added._generator")[1],
}


@pytest.mark.parametrize("how", list(REPLACEMENTS))
def test_a_name_of_the_noise_path_replaced_is_refused_before_the_draw(how: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    named = REPLACEMENTS[how](monkeypatch)
    with pytest.raises(NoisePathReplacedError, match="changed after lightning_dp was imported") as refused:
        _release()
    assert named in str(refused.value)


def test_a_kernel_registered_for_an_operation_of_the_path_is_refused_until_removed() -> None:
    """A pass-through ``aten::normal_`` CPU kernel could keep every draw; refused while registered, not after."""
    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl("normal_", lambda self, mean=0.0, std=1.0, *, generator=None: self.zero_(), "CPU")
        with pytest.raises(NoisePathReplacedError, match="CPU kernel of aten::normal_"):
            _release()
    finally:
        library._destroy()
    _release()
    assert broken_seals() == []


def test_a_kernel_of_an_operation_off_the_path_and_a_tunable_are_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(noise_module, "_MIN_CHUNK", 100)  # how the draws are cut, not what is drawn
    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl("tanh", lambda self: self.clamp(-1, 1), "CPU")  # a user's kernel for an op off the path
        _release()
    finally:
        library._destroy()


def test_a_fit_with_a_replaced_name_releases_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Classifier()
    before = parameters(model)
    monkeypatch.setattr(GaussianNoise, "_draw_key", lambda self, key: [torch.zeros(d.size) for d in key[2]])
    with pytest.raises(NoisePathReplacedError, match="GaussianNoise._draw_key"):
        fit(model, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(before, parameters(model)))  # the optimizer never stepped
    assert model.trainer.strategy.private_step.ledger.steps == 0


def test_the_operations_guarded_are_all_the_path_dispatches() -> None:
    """Every ``aten`` operation the path dispatches (torch's profiler) is one whose kernels the seal watches."""
    profiles: list[Any] = []

    @contextlib.contextmanager
    def profiled() -> Iterator[None]:
        with profile() as prof:
            yield
        profiles.append(prof)

    for make in MECHANISMS.values():
        mechanism = make()
        _releases(mechanism, steps=3, around=profiled)
        mechanism.close()
    seen = {e.name.removeprefix("aten::") for prof in profiles for e in prof.function_events
            if e.name.startswith("aten::")}
    assert seen and seen <= OPERATIONS, sorted(seen - OPERATIONS)


def test_a_method_set_on_the_drawing_mechanism_itself_is_refused() -> None:
    """An instance's own attribute wins over its sealed class's method: ``noise._normal = ...`` on the strategy's
    mechanism would draw what it likes."""
    mechanism = GaussianNoise(seed=0, prefetch=False)
    mechanism._drawn_now = lambda plan, std: (torch.zeros(d.size) for d, _ in plan)  # type: ignore[method-assign]
    with pytest.raises(NoisePathReplacedError, match=r"GaussianNoise._drawn_now \(set on the instance\)"):
        mechanism.add_noise_([torch.zeros(1000)], 1.0)
    del mechanism._drawn_now
    mechanism.add_noise_([torch.zeros(1000)], 1.0)  # its own again: released
