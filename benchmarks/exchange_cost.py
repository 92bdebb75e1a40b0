"""The secret exchange against the public map it replaced: ``python benchmarks/exchange_cost.py``.

Exchange and restore of a 60,000 × 784 float32 tensor (MNIST's training images as floats, 188 MB), of the same as a
NumPy array, of 47 MB of uint8 pixels and of 60,000 int64 labels (one thread, best of seven): the secret masks
(record_checks/outside_records.py: a block of a secret length laid over the memory) against the public map's two
exclusive ors (``fixed=True``). Also prints the largest mask the exchange keeps until its restore.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from lightning_dp.record_checks.outside_records import exchange


def best_ms(run: Callable[[], None], repeats: int = 7) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def both_ways(value: Any, fixed: bool) -> Callable[[], None]:
    def run() -> None:
        exchange(value, fixed=fixed)()
    return run


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(60_000, 784, generator=g)
    cases = {"float32 tensor 60000x784": images, "float32 NumPy 60000x784": images.numpy().copy(),
             "uint8 pixels 60000x784": torch.randint(0, 256, (60_000, 784), generator=g, dtype=torch.uint8),
             "int64 labels 60000": torch.randint(0, 10, (60_000,), generator=g)}
    for name, value in cases.items():
        public, secret = best_ms(both_ways(value, True)), best_ms(both_ways(value, False))
        print(f"{name:28s} public map {public:7.2f} ms   secret {secret:7.2f} ms   ({secret / public:.2f}x)")
    restore = exchange(images)
    kept = [c.cell_contents for c in restore.__closure__ or () if isinstance(c.cell_contents, torch.Tensor)
            and c.cell_contents.data_ptr() != images.data_ptr()]  # the block of masks, not the tensor's own view
    restore()
    print(f"kept until the restore: {max(t.numel() * t.element_size() for t in kept) / 2**20:.2f} MiB "
          f"(the tensor: {images.numel() * 4 / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
