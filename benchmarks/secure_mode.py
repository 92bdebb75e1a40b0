"""Cost of DPStrategy(secure_mode=True) (privacy/csprng.py). Run by hand:

    OMP_NUM_THREADS=1 python benchmarks/secure_mode.py

Prints, for the parameter counts of docs/secure_mode.md's table's models (digits CNN, MLP 784-512-512-10,
the 2-layer d=128 transformer LM) and for flat tensors of 2^20 and 10·2^20 coordinates: ms per
noise draw added in place, torch's generator vs the secure one, and the ratio; the cost of one
secure Poisson batch of the main job (N = 1437, q = 64/1437); and the main job's mean step time
(digits CNN, Lightning, 2 epochs) without and with secure mode.
"""

from __future__ import annotations

import statistics
import time

import pytorch_lightning as pl
import torch
from torch import nn

from lightning_dp import DPStrategy
from lightning_dp.data import DigitsDataModule
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.privacy.csprng import SecureGaussianNoise
from lightning_dp.privacy.min_sep_sampling import MinSepPoissonBatchSampler
from lightning_dp.models import DigitsCNN
from lightning_dp.models.tiny_transformer import TinyTransformerLM


def _ms(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def noise_costs() -> None:
    models = {
        "digits CNN": DigitsCNN(channels=16),
        "MLP 784-512-512-10": nn.Sequential(nn.Linear(784, 512), nn.Linear(512, 512), nn.Linear(512, 10)),
        "transformer LM d=128": TinyTransformerLM(),
    }
    shapes = {name: [p.shape for p in model.parameters()] for name, model in models.items()}
    shapes.update({"1M coordinates": [torch.Size([1 << 20])], "10M coordinates": [torch.Size([10 * (1 << 20)])]})
    print(f"{'model':24s} {'params':>9s} {'torch ms':>9s} {'secure ms':>10s} {'ratio':>6s}")
    for name, model_shapes in shapes.items():
        grads = [torch.zeros(shape) for shape in model_shapes]
        count = sum(g.numel() for g in grads)
        repeats = 7 if count < 1 << 20 else 3
        plain = _ms(lambda: GaussianNoise().add_noise_(grads, 0.01, 1 / 64), repeats)
        secure = _ms(lambda: SecureGaussianNoise().add_noise_(grads, 0.01, 1 / 64), repeats)
        print(f"{name:24s} {count:9d} {plain:9.2f} {secure:10.2f} {secure / plain:6.1f}")


def sampling_cost() -> None:
    for secure in (False, True):
        sampler = MinSepPoissonBatchSampler(1437, 64 / 1437, 1000, 1, secure=secure)
        it = iter(sampler)
        ms = _ms(lambda: next(it), repeats=200)
        print(f"Poisson batch of N = 1437, q = 64/1437, {'secure' if secure else 'torch '}: {ms * 1e3:7.1f} µs")


class _StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter() - self._t0)


def main_job_step(secure: bool) -> float:
    timer = _StepTimer()
    trainer = pl.Trainer(strategy=DPStrategy(noise_multiplier=1.0, secure_mode=secure), max_epochs=2,
                         accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
                         num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(DigitsCNN(channels=16), DigitsDataModule(batch_size=64))
    return statistics.median(timer.times[5:]) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    noise_costs()
    sampling_cost()
    plain, secure = main_job_step(False), main_job_step(True)
    print(f"main job (digits CNN) median step: {plain:.2f} ms, secure mode {secure:.2f} ms ({secure / plain:.2f}×)")


if __name__ == "__main__":
    main()
