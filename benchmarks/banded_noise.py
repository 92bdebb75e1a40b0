"""Banded DP-MF noise: cost per step and prefix-sum error at equal ε (run by hand:
``python benchmarks/banded_noise.py``).

Prints:
1. time of one ``sample()`` call against independent noise, for d parameters and b bands
   (target: the b − 1 axpy's stay well below a training step), and the history memory
   (b − 1)·d·4 bytes;
2. for a long run (N = 50 000, B = 500, T = 2000 steps, δ = 1e-5), the mean prefix-sum noise
   variance of banded noise relative to independent noise at equal ε, for several b, with the
   Fichtenberger coefficients and with optimised ones (docs/algorithms.md §7; design-principles §4.5).
"""

from __future__ import annotations

import time

import torch

from lightning_dp.accounting import calibrate_noise
from lightning_dp.accounting.banded import calibrate_banded_noise
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.accounting.banded_coefficients import (
    fichtenberger_coefficients,
    optimize_banded_coefficients,
    prefix_sum_error,
)
from lightning_dp.privacy.banded_noise import BandedToeplitzNoise


def time_sample(noise, like, repeats: int = 20) -> float:
    for _ in range(3):
        noise.sample(like)
    start = time.perf_counter()
    for _ in range(repeats):
        noise.sample(like)
    return (time.perf_counter() - start) / repeats


def speed() -> None:
    print("1. sample() time per step (CPU, float32)")
    for d in (10**5, 10**6, 4 * 10**6):
        like = [torch.zeros(d)]
        base = time_sample(GaussianNoise(seed=0), like)
        print(f"   d={d:>8}: independent {base * 1e3:7.2f} ms")
        for b in (2, 8, 32):
            noise = BandedToeplitzNoise(b, seed=0)
            t = time_sample(noise, like)
            mib = noise.memory_numel * 4 / 2**20
            print(f"             b={b:>3}: {t * 1e3:7.2f} ms  (×{t / base:4.1f})  history {mib:7.1f} MiB")


def error_at_equal_epsilon() -> None:
    n, batch, steps, delta = 50_000, 500, 2000, 1e-5
    q = batch / n
    print(f"2. mean prefix-sum variance, banded / independent, equal ε (N={n}, B={batch}, T={steps})")
    for eps in (2.0, 8.0):
        sigma1 = calibrate_noise(eps, delta, q, steps, rtol=1e-3)
        independent = sigma1**2 * (steps + 1) / 2
        for b in (2, 4, 8, 16, 32, 64):
            sigma_b = calibrate_banded_noise(eps, delta, b * q, steps, b, rtol=1e-3)
            fich = sigma_b**2 * prefix_sum_error(fichtenberger_coefficients(b), steps) / independent
            opt = sigma_b**2 * prefix_sum_error(optimize_banded_coefficients(b, steps), steps) / independent
            print(
                f"   ε={eps:3.0f} b={b:>3}: σ_b={sigma_b:5.2f} (σ_1={sigma1:4.2f})"
                f"  Fichtenberger {fich:5.3f}  optimised {opt:5.3f}"
            )


if __name__ == "__main__":
    torch.set_num_threads(1)
    speed()
    error_at_equal_epsilon()
