"""The noise a release adds is checked where it is added (lightning_dp/validators/noise_added.py, zoo36 T27–T31):
a release whose noise is missing or shrunk is refused; legitimate draws of every library mechanism pass (large
signals, scale_by, empty and bfloat16 tensors, banded noise). How the draw is kept out of the user's reach (torch's
operations bound at import, the path sealed): tests/validators/test_sealed_noise.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_dp.privacy.banded_noise import BandedToeplitzNoise
from lightning_dp.privacy.csprng import SecureGaussianNoise
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.validators.noise_added import (
    NoiseMissingError, check_noise_added, chi2_floor, libraries_noise, noise_taken)


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 3 for s in [(300, 400), (8,), (1,), (0,), (40, 25), (200_000,)]]


def _added_then_checked(tensors: list[torch.Tensor], std: float, factor: float, scale_by: float = 1.0) -> None:
    """A release whose noise is ``factor`` × the asked one, checked as the wrapper checks a library mechanism's."""
    taken = noise_taken(tensors)
    g = torch.Generator().manual_seed(0)
    for t in tensors:
        t.mul_(scale_by).add_(torch.randn(t.shape, generator=g, dtype=t.dtype) * (std * factor))
    check_noise_added(tensors, taken, std, scale_by, 1.0)


@pytest.mark.parametrize("factor", [0.0, 1e-3])
def test_a_release_without_its_noise_is_refused(factor: float) -> None:
    with pytest.raises(NoiseMissingError, match="missing from the release"):
        _added_then_checked(_tensors(), 0.5, factor, scale_by=1 / 64)


def test_noise_shrunk_on_a_large_tensor_is_refused() -> None:
    with pytest.raises(NoiseMissingError, match="tensor 0, 4096 numbers read"):
        _added_then_checked([torch.zeros(200_000)], 1.0, 0.8)  # a fifth of the noise gone


def test_noise_added_to_some_small_tensors_only_is_refused() -> None:
    """The draw right, its addition to the small tensors skipped (pooled over twelve)."""
    tensors = [torch.zeros(5) for _ in range(12)]
    taken = noise_taken(tensors)
    with pytest.raises(NoiseMissingError):
        check_noise_added(tensors, taken, 1.0, 1.0, 1.0)


@pytest.mark.parametrize("make", [lambda: GaussianNoise(seed=1, prefetch=False), lambda: GaussianNoise(seed=2),
                                  lambda: SecureGaussianNoise(), lambda: BandedToeplitzNoise(3, seed=4)],
                         ids=["gaussian", "prefetched", "secure", "banded"])
def test_legitimate_draws_pass(make: Any) -> None:
    """Every library mechanism, many releases: large signals beside the noise, scale_by, empty and bfloat16 tensors."""
    mechanism = make()
    for step in range(15):
        tensors = _tensors(step) + [torch.randn(64, dtype=torch.bfloat16) * 50]
        with mechanism.step():
            mechanism.add_noise_(tensors, 0.05 if step % 2 else 3.0, scale_by=1 / 256 if step % 3 else 1.0)


def test_a_mechanism_of_yours_is_yours() -> None:
    class Zero(GaussianNoise):
        def sample(self, like: Any) -> list[torch.Tensor]:
            return [torch.zeros_like(t) for t in like]

    assert libraries_noise(GaussianNoise) and not libraries_noise(Zero)
    t = torch.ones(10)
    Zero(seed=0).add_noise_([t], 1.0)  # a scripted noise of a test: not checked
    assert torch.equal(t, torch.ones(10))


def test_the_floor_bounds_the_chance_of_a_false_refusal() -> None:
    """P(χ²_n ≤ floor) ≤ 1e-12 (Chernoff), and the floor sits well above zero for n ≥ 8."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 8, 100, 4096):
        floor = chi2_floor(n)
        draws = torch.randn(20_000, n, generator=g, dtype=torch.float64).pow(2).sum(1)
        assert (draws <= floor).sum() == 0 and 0 <= floor < n
    assert chi2_floor(8) > 1e-3 and chi2_floor(4096) > 0.8 * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noise_below_the_values_float_resolution_is_not_refused(dtype: torch.dtype) -> None:
    """A fresh-clone CI's false refusal: σ = 1e-6 on a bias's two summed gradients near 16 (one float32 ulp is
    1.9e-6) read back as zeros about one release in six; the rounding's bound is credited, the draws pass."""
    mechanism = GaussianNoise(seed=3, prefetch=False)
    for step in range(300):
        with mechanism.step():
            mechanism.add_noise_([torch.full((2,), 16.0, dtype=dtype), torch.full((5,), -9.0, dtype=dtype)], 1e-6)


def test_noise_missing_where_the_resolution_would_show_it_is_still_refused() -> None:
    """The rounding's credit is a few ulps of the values: noise about 80 ulps wide shrunk to a tenth is refused."""
    with pytest.raises(NoiseMissingError):
        _added_then_checked([torch.full((64,), 1.0)], 1e-5, 0.1)
