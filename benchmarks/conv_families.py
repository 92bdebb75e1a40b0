"""Per-step time of small convolutional models under the ghost engine vs non-private, with and without the
registered closed-form rules (grad_sample/rules.py: convolutions of any dimension, transposed convolutions, PReLU).
Run by hand:

    python benchmarks/conv_families.py                          # every model, 1 thread
    python benchmarks/conv_families.py --models tcn,tasnet --threads 1,2 --steps 20 --rounds 3

Models (batch 32, float32, CPU), sized as published tutorials size theirs: ``tcn`` a dilated Conv1d TCN (64
channels, 256 steps); ``conv3d`` a 3-D conv net on 8×16×16 volumes; ``deconv`` a DCGAN-style ConvTranspose2d decoder
(latent → 32×32 image); ``prelu-mlp`` an MNIST-sized MLP (784 → 512 → 512 → 10) with PReLU activations;
``tasnet`` a Conv-TasNet-like separator (Conv1d encoder, 1×1 and depthwise dilated Conv1d blocks with PReLU and a
global layer norm γ ⊙ (x − μ)/σ + β over [C, T] with γ, β of shape [1, C, 1], ConvTranspose1d decoder).

One process, three modes interleaved step by step (so machine drift hits them alike): the non-private step, the
private step with the rules, and the private step without them (:func:`rules_disabled`: those layers take the
per-example vmap replay, as before the rules). A private step is forward, mean loss, backward,
``engine.clip_and_sum``, the library's ``Privatizer`` (σCz once, ÷B), SGD step. Medians are printed with the ratios private / non-private;
``--rounds R`` repeats each measurement R times (fresh models) and prints medians and the range of the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dp.grad_sample import make_engine

from lightning_dp.grad_sample.capture import activations as capture

from lightning_dp.privacy.noise import GaussianNoise

from lightning_dp.privacy.privatizer import Privatizer

from lightning_dp.privacy.release import DEFAULT_REQUEST
from lightning_dp.grad_sample import rules

B = 32


class TCN(nn.Module):
    """Temporal convolutional network: dilated causal Conv1d blocks (k = 3, dilation 1, 2, 4, 8) with residuals."""

    def __init__(self, c_in: int = 8, hidden: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.inp = nn.Conv1d(c_in, hidden, 1)
        self.blocks = nn.ModuleList(nn.Conv1d(hidden, hidden, 3, dilation=d, padding=2 * d) for d in (1, 2, 4, 8))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for conv in self.blocks:
            h = h + torch.relu(conv(h)[..., :h.shape[-1]])  # causal: the padding's tail cut
        return self.head(h.mean(-1))


class Conv3dNet(nn.Module):
    """Small 3-D conv net on tiny volumes."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv3d(1, 8, 3, padding=1), nn.Conv3d(8, 16, 3, stride=2, padding=1)
        self.c3, self.head = nn.Conv3d(16, 16, 3, padding=1), nn.Linear(16, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.c3(torch.relu(self.c2(torch.relu(self.c1(x))))))
        return self.head(h.mean((2, 3, 4)))


class Decoder(nn.Module):
    """DCGAN-style decoder: latent → 4×4 → ConvTranspose2d ×3 → 32×32 image."""

    def __init__(self, latent: int = 64) -> None:
        super().__init__()
        self.fc = nn.Linear(latent, 64 * 4 * 4)
        self.up = nn.ModuleList([nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.ConvTranspose2d(32, 16, 4, 2, 1),
                                 nn.ConvTranspose2d(16, 1, 4, 2, 1)])

    def forward(self, z: Tensor) -> Tensor:
        h = self.fc(z).view(-1, 64, 4, 4)
        for k, up in enumerate(self.up):
            h = up(h) if k == len(self.up) - 1 else torch.relu(up(h))
        return h


class PReLUMLP(nn.Module):
    def __init__(self, d: int = 784, hidden: int = 512, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.PReLU(hidden), nn.Linear(hidden, hidden), nn.PReLU(),
                                 nn.Linear(hidden, classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class GlobalLayerNorm(nn.Module):
    """Conv-TasNet's gLN, as its reference implementation writes it."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.gamma, self.beta = nn.Parameter(torch.ones(1, channels, 1)), nn.Parameter(torch.zeros(1, channels, 1))

    def forward(self, y: Tensor) -> Tensor:
        mean = y.mean(dim=1, keepdim=True).mean(dim=2, keepdim=True)
        var = (torch.pow(y - mean, 2)).mean(dim=1, keepdim=True).mean(dim=2, keepdim=True)
        return self.gamma * (y - mean) / torch.pow(var + 1e-8, 0.5) + self.beta


class TasNetBlock(nn.Module):
    def __init__(self, bottleneck: int, hidden: int, dilation: int) -> None:
        super().__init__()
        self.inp, self.act1, self.norm1 = nn.Conv1d(bottleneck, hidden, 1), nn.PReLU(), GlobalLayerNorm(hidden)
        self.depth = nn.Conv1d(hidden, hidden, 3, dilation=dilation, padding=dilation, groups=hidden)
        self.act2, self.norm2, self.out = nn.PReLU(), GlobalLayerNorm(hidden), nn.Conv1d(hidden, bottleneck, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(self.act1(self.inp(x)))
        return x + self.out(self.norm2(self.act2(self.depth(h))))


class TasNet(nn.Module):
    """Conv-TasNet-like separator: encoder, two dilated blocks, a sigmoid mask, transposed-conv decoder."""

    def __init__(self, filters: int = 64, kernel: int = 16, bottleneck: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.encoder = nn.Conv1d(1, filters, kernel, stride=kernel // 2, bias=False)
        self.norm, self.bottleneck = GlobalLayerNorm(filters), nn.Conv1d(filters, bottleneck, 1)
        self.blocks = nn.Sequential(*[TasNetBlock(bottleneck, hidden, d) for d in (1, 2, 4)])
        self.mask = nn.Conv1d(bottleneck, filters, 1)
        self.decoder = nn.ConvTranspose1d(filters, 1, kernel, stride=kernel // 2, bias=False)

    def forward(self, wave: Tensor) -> Tensor:
        w = torch.relu(self.encoder(wave))
        m = torch.sigmoid(self.mask(self.blocks(self.bottleneck(self.norm(w)))))
        return self.decoder(w * m)


def _classification(shape: tuple[int, ...]) -> Callable[[torch.Generator], tuple[Tensor, Tensor]]:
    return lambda g: (torch.randn(B, *shape, generator=g), torch.randint(0, 10, (B,), generator=g))


def _regression(shape: tuple[int, ...], target: tuple[int, ...]) -> Callable[[torch.Generator], tuple[Tensor, Tensor]]:
    return lambda g: (torch.randn(B, *shape, generator=g), torch.randn(B, *target, generator=g))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable, Callable[[Tensor, Tensor], Tensor]]] = {
    "tcn": (TCN, _classification((8, 256)), F.cross_entropy),
    "conv3d": (Conv3dNet, _classification((1, 8, 16, 16)), F.cross_entropy),
    "deconv": (Decoder, _regression((64,), (1, 32, 32)), F.mse_loss),
    "prelu-mlp": (PReLUMLP, _classification((784,)), F.cross_entropy),
    "tasnet": (TasNet, _regression((1, 1024), (1, 1024)), F.mse_loss),
}


@contextlib.contextmanager
def rules_disabled() -> Iterator[None]:
    """The code before the rules: the registry of closed-form rules emptied (convolutions but a plain Conv2d, PReLU:
    back to the per-example vmap replay) and the elementwise-scale rule kept to its former candidates, one trainable
    1-D weight and nothing else (a global layer norm's weight and bias: back to the replay)."""
    rules.registered_rules()
    saved = list(rules._RULES)
    rules._RULES.clear()
    former = capture.scale_candidate
    capture.scale_candidate = lambda m: (lambda c: c if c is not None and len(c) == 1 and c[0].dim() == 1
                                         else None)(former(m))
    try:
        yield
    finally:
        rules._RULES.extend(saved)
        capture.scale_candidate = former


def steps(name: str) -> dict[str, Callable[[], None]]:
    """The non-private step and the two private steps (with / without the rules), each on its own copy of the model,
    on one fixed batch."""
    make, data, loss_fn = MODELS[name]
    torch.manual_seed(0)
    models = {mode: make() for mode in ("nonprivate", "private", "private-norules")}
    for m in models.values():
        m.load_state_dict(models["nonprivate"].state_dict())
    x, y = data(torch.Generator().manual_seed(0))
    out: dict[str, Callable[[], None]] = {}
    plain = models["nonprivate"]
    opt_plain = torch.optim.SGD(plain.parameters(), lr=1e-3)

    def nonprivate() -> None:
        opt_plain.zero_grad(set_to_none=True)
        loss_fn(plain(x), y).backward()
        opt_plain.step()

    out["nonprivate"] = nonprivate
    for mode in ("private", "private-norules"):
        context = rules_disabled if mode == "private-norules" else contextlib.nullcontext
        with context():
            out[mode] = _private_step(models[mode], x, y, loss_fn, context)
    return out


def _private_step(model: nn.Module, x: Tensor, y: Tensor, loss_fn, context) -> Callable[[], None]:
    engine = make_engine("ghost")
    engine.attach(model)
    privatizer = Privatizer(GaussianNoise())
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3)

    def private() -> None:
        with context():
            opt.zero_grad(set_to_none=True)
            engine.begin_step(B)
            loss_fn(model(x), y).backward()
            batch = engine.clip_and_sum(params, 1.0)
            privatizer.privatize(batch, params, DEFAULT_REQUEST, 1.0, 1.0, float(B))
            opt.step()

    return private


def measure(name: str, n_steps: int, warmup: int = 2) -> dict[str, float]:
    """Median ms per step of each mode, interleaved step by step."""
    fns = steps(name)
    times: dict[str, list[float]] = {mode: [] for mode in fns}
    for i in range(n_steps + warmup):
        for mode, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times[mode].append(time.perf_counter() - t0)
    return {mode: statistics.median(t) * 1e3 for mode, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="", help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--threads", default="1", help="comma-separated torch thread counts")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=1, help="repeat each measurement; medians and the ratios' range")
    args = parser.parse_args()
    names = [m for m in args.models.split(",") if m] or list(MODELS)
    print(f"batch {B}, ghost engine; median ms/step over {args.steps} steps (interleaved), {args.rounds} round(s)")
    print(f"{'model':10s} {'threads':>7s} {'non-private':>12s} {'no rules':>9s} {'rules':>9s} "
          f"{'ratio before':>13s} {'ratio after':>12s}")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for name in names:
            runs = [measure(name, args.steps) for _ in range(args.rounds)]
            med = {mode: statistics.median(r[mode] for r in runs) for mode in runs[0]}
            before = [r["private-norules"] / r["nonprivate"] for r in runs]
            after = [r["private"] / r["nonprivate"] for r in runs]

            def ratio(rs: list[float]) -> str:
                spread = f" ({min(rs):.2f}–{max(rs):.2f})" if len(rs) > 1 else ""
                return f"{statistics.median(rs):.2f}{spread}"

            print(f"{name:10s} {threads:7d} {med['nonprivate']:12.1f} {med['private-norules']:9.1f} "
                  f"{med['private']:9.1f} {ratio(before):>13s} {ratio(after):>12s}", flush=True)


if __name__ == "__main__":
    main()
