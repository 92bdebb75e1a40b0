"""DP-SGD in a plain PyTorch loop (no Lightning) with lightning_dp's private step.

The same mechanism ``DPStrategy`` drives from Lightning's hooks
(:class:`lightning_dp.privacy.private_step.PrivateStep`): Poisson sampling, the first
step's verification of the model and loss, per-example clipping, noise once per step,
and the ledger. Data: scikit-learn's handwritten digits (ships with scikit-learn).

    python examples/plain_pytorch.py --epochs 15 --target-epsilon 3
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.accounting import ledger_epsilon
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.privacy.private_step import PrivateStep


@dataclass(frozen=True)
class Result:
    """What one private run gave."""

    test_accuracy: float
    epsilon: float
    delta: float
    noise_multiplier: float
    steps: int


def digits_split(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 8×8 digits, pixels scaled to [0, 1], split 80/20."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return TensorDataset(x[order[:cut]], y[order[:cut]]), TensorDataset(x[order[cut:]], y[order[cut:]])


def train(epochs: int = 15, batch_size: int = 64, target_epsilon: float = 3.0, max_grad_norm: float = 1.0,
          lr: float = 0.5, seed: int = 0) -> Result:
    """Train a small MLP privately at ``target_epsilon`` (δ = N^-1.1) and return test accuracy and ε."""
    torch.manual_seed(seed)
    train_set, test_set = digits_split(seed)
    delta = len(train_set) ** -1.1
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    step = PrivateStep(noise_multiplier=None, max_grad_norm=max_grad_norm, noise=GaussianNoise(),  # σ from target ε
                       target_epsilon=target_epsilon, target_delta=delta)
    step.attach(model, optimizer)
    loader = step.poisson_loader(DataLoader(train_set, batch_size=batch_size))
    assert step.plan is not None
    step.calibrate(epochs * step.plan.steps_per_epoch)
    step.verify(lambda batch: F.cross_entropy(model(batch[0]), batch[1]))  # refused before the first release

    for _ in range(epochs):
        for x, y in loader:
            if step.begin():  # the sampler's count; an empty Poisson batch still releases (noise only)
                F.cross_entropy(model(x), y).backward()
            step.release(optimizer=optimizer)  # p.grad ← (Σ clip_C(g_i) + σ C z) / B; ledger += 1
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    step.detach()

    x, y = test_set.tensors
    with torch.no_grad():
        accuracy = float((model(x).argmax(1) == y).float().mean())
    assert step.noise_multiplier is not None
    return Result(accuracy, ledger_epsilon(step.ledger, delta), delta, step.noise_multiplier, step.steps_taken)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--target-epsilon", type=float, default=3.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    r = train(args.epochs, args.batch_size, args.target_epsilon, args.max_grad_norm, args.lr, args.seed)
    print(f"test accuracy {r.test_accuracy:.3f} at ε = {r.epsilon:.3f}, δ = {r.delta:.2g} "
          f"(σ = {r.noise_multiplier:.3f}, {r.steps} steps)")


if __name__ == "__main__":
    main()
