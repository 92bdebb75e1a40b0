"""DP-SignSGD with majority vote (docs/algorithms.md §6): the update, and M virtual workers.

* :class:`DPSignSGD` is the optimizer-side update θ -= η·vote. It never sees data: the
  vote in ``p.grad`` was produced by the mechanism (:mod:`lightning_dp.sign_sgd.vote`),
  either by the strategy in DDP mode (each rank a worker, the vote all-reduced as int8
  signs) or by :class:`VirtualWorkersSignSGD`.
* :class:`VirtualWorkersSignSGD` runs M workers in one process, for research on one
  machine: per step each worker Poisson-samples its local data with rate q, clips each
  example's gradient to C, adds its own noise σC, sends sign(·); the server votes and
  the parameters move by η·vote. Each worker is the library's private step
  (:class:`~lightning_dp.privacy.private_step.PrivateStep`: sampler, engine, probe) with
  the DDP mode's sign-vote release rule: no mechanism code of its own.

Privacy accounting: every worker runs the sampled Gaussian mechanism on its own local
dataset with the same (σ, local q) at every step, so all workers have the same
guarantee and one :class:`~lightning_dp.accounting.ledger.PrivacyLedger` (with q the
*local* rate) describes each of them. Calibrate σ with
:func:`lightning_dp.accounting.sign_sgd_calibration.calibrate_worker_sigma`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.mode_free import mode_free
from lightning_dp.engine_api import mark_released
from lightning_dp.record_checks.records import check_records
from lightning_dp.grad_sample.base import ClippedBatch
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.privacy.private_step import PrivateStep
from lightning_dp.privacy.release import DEFAULT_REQUEST
from lightning_dp.privacy.sampling import PoissonBatchSampler, secure_seed
from lightning_dp.sign_sgd.privatizer import SignVotePrivatizer
from lightning_dp.sign_sgd.vote import SIGN_DTYPE, majority_vote
from lightning_dp.validators.probe import PROBE_EXAMPLES

GradientNoise = Callable[[tuple[int, ...], torch.Generator], Tensor]
"""``(shape, generator) -> noise`` added to a worker's mean-gradient estimate (research only)."""


class DPSignSGD(torch.optim.Optimizer):
    """θ -= η · sign(p.grad), where ``p.grad`` holds the majority vote (docs/algorithms.md §6).

    The optimizer takes the sign once more, which leaves a vote in {-1, 0, +1}
    unchanged. It adds no privacy itself: privacy comes from whoever wrote ``p.grad``
    (the sign-vote mechanism). On a raw gradient it is plain single-worker SignSGD.

    Args:
        params: parameters or parameter groups.
        lr: η > 0.
    """

    mechanism: ClassVar[str] = "sign_vote"
    """Marker for the strategy: this optimizer expects a vote, not a noised mean, in ``p.grad``."""

    def __init__(self, params: Iterable[nn.Parameter] | Iterable[dict], lr: float) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Move every parameter with a gradient by -lr · sign(grad)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(torch.sign(p.grad), alpha=-group["lr"])
        return loss


@dataclass(frozen=True)
class VoteStep:
    """What one :meth:`VirtualWorkersSignSGD.step` did.

    Attributes:
        batch_sizes: realised local Poisson batch size per worker (never released).
        vote: the released vote, flat over all trainable parameters (int8).
        agreement: fraction of (worker, coordinate) signs equal to the vote.
    """

    batch_sizes: tuple[int, ...]
    vote: Tensor
    agreement: float


class VirtualWorkersSignSGD:
    """M DP-SignSGD workers in one process (docs/algorithms.md §6, mode (b) of issue 7).

    Each worker runs the library's private step (:class:`~lightning_dp.privacy.private_step.PrivateStep`)
    on its own local data: its Poisson sampler (:class:`~lightning_dp.privacy.sampling.PoissonBatchSampler`),
    per-example clipped sums from the step's engine (any model ``DPStrategy`` accepts, checked by the same
    validators and the first-step probe), and the DDP mode's release rule
    (:class:`~lightning_dp.sign_sgd.privatizer.SignVotePrivatizer`: its own noise σC, then the sign).
    The server votes and the parameters move by η·vote; the step's ledger is charged one round per step.

    Args:
        model: the shared model (its trainable parameters are updated in place).
        loss_fn: ``loss_fn(output, target)`` -> the mean loss of a batch (or one loss per example),
            e.g. ``F.binary_cross_entropy_with_logits``.
        worker_data: M pairs ``(inputs, targets)``, the local datasets (first axis = examples).
        sample_rate: local Poisson rate q (the same for every worker).
        lr: η.
        noise_multiplier: σ ≥ 0 per worker; 0 with ``max_grad_norm=None`` is non-private
            SignSGD with majority vote.
        max_grad_norm: C, per-example clipping norm; ``None`` means no clipping (only
            allowed with σ = 0, since the sensitivity would be unbounded).
        gradient_noise: optional synthetic noise ξ_m in mean-gradient units added to each
            worker's gradient before the sign (the seed's §4.1 heavy-tailed experiment).
            It is data-independent, so with σ > 0 it is post-processing of the SGM
            release and changes no guarantee.
        generator: source of sampling seeds, noise and ξ; ``None`` uses an OS-seeded one.
        per_sample: the per-example gradient engine (``"auto"`` as in ``DPStrategy``).

    The worker statistic is S_m + B_m ξ_m + σ C z_m with B_m the *expected* local batch
    q·n_m when private (dividing by the realised size would leak it), the realised size
    when not; ξ_m is thus on the scale of the mean gradient S_m / B_m in both cases.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        worker_data: Sequence[tuple[Tensor, Tensor]],
        sample_rate: float,
        lr: float,
        noise_multiplier: float = 0.0,
        max_grad_norm: Optional[float] = None,
        gradient_noise: Optional[GradientNoise] = None,
        generator: Optional[torch.Generator] = None,
        per_sample: str = "auto",
    ) -> None:
        _validate(worker_data, sample_rate, noise_multiplier, max_grad_norm)
        if noise_multiplier > 0:  # each record once, in one worker: a copy would be sampled (and counted) twice
            pooled = TensorDataset(torch.cat([x for x, _ in worker_data]), torch.cat([y for _, y in worker_data]))
            check_records(pooled, None, len(pooled))
        self.model = model
        self.loss_fn = loss_fn
        self.worker_data = list(worker_data)
        self.sample_rate = float(sample_rate)
        self.noise_multiplier = float(noise_multiplier)
        self.max_grad_norm = max_grad_norm
        self.gradient_noise = gradient_noise
        self.generator = generator if generator is not None else torch.Generator().manual_seed(secure_seed())
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.optimizer = DPSignSGD(self.params.values(), lr=lr)
        noise = GaussianNoise(generator=self.generator)
        self.private_step = PrivateStep(self.noise_multiplier if self.is_private else None, max_grad_norm or 1.0,
                                        noise, engine=per_sample)
        self.private_step.attach(model)
        self.privatizer = SignVotePrivatizer(noise=noise)  # one worker's release rule, drawn fresh per worker
        self.samplers = [PoissonBatchSampler(x.shape[0], self.sample_rate, 1, seed=self._seed())
                         for x, _ in self.worker_data]
        x0, y0 = self.worker_data[0]
        try:
            self.private_step.verify_on(lambda idx: loss_fn(model(x0[idx]), y0[idx]),
                                        range(min(PROBE_EXAMPLES, x0.shape[0])), what="loss_fn(model(x), y)")
        except BaseException:
            self.private_step.detach()  # the model is left as it came
            raise

    def detach(self) -> None:
        """Remove the private step's engine from the model (before another runner or strategy trains it)."""
        self.private_step.detach()

    @property
    def ledger(self) -> PrivacyLedger:
        """One worker's privacy ledger (every worker's: same σ, same local q, same rounds)."""
        return self.private_step.ledger

    @property
    def num_workers(self) -> int:
        """M."""
        return len(self.worker_data)

    @property
    def is_private(self) -> bool:
        """True when each worker's message is a DP release (σ > 0 and clipping on)."""
        return self.noise_multiplier > 0 and self.max_grad_norm is not None

    def _seed(self) -> int:
        return int(torch.randint(0, 2**62, (1,), generator=self.generator))

    def _sample(self) -> tuple[Tensor, Tensor, Tensor, list[int]]:
        xs, ys, owners, sizes = [], [], [], []
        for m, ((x, y), sampler) in enumerate(zip(self.worker_data, self.samplers)):
            keep = torch.tensor(next(iter(sampler)), dtype=torch.long)
            xs.append(x[keep])
            ys.append(y[keep])
            sizes.append(len(keep))
            owners.append(torch.full((sizes[-1],), m, dtype=torch.long))
        return torch.cat(xs), torch.cat(ys), torch.cat(owners), sizes

    def _clipped_sum(self, x: Tensor, y: Tensor) -> ClippedBatch:
        """One worker's S_m through the private step's engine (clipped iff C is set)."""
        params = list(self.params.values())
        if x.shape[0] == 0:
            return ClippedBatch({p: torch.zeros_like(p) for p in params}, None, torch.zeros(0), 0)
        self.private_step.begin(x.shape[0])
        self.loss_fn(self.model(x), y).backward()
        return self.private_step.clipped_sums(math.inf if self.max_grad_norm is None else None)

    def worker_sums(self, x: Tensor, y: Tensor, owners: Tensor) -> Tensor:
        """S_m for every worker, flat over parameters: ``[M, D]``; clipped per example iff C is set."""
        return self._stacked([self._clipped_sum(x[owners == m], y[owners == m]) for m in range(self.num_workers)])

    @mode_free  # the clipped sums as the engine made them, whatever modes the user entered (mode_free.py)
    def _stacked(self, batches: list[ClippedBatch]) -> Tensor:
        params = list(self.params.values())
        return torch.stack([torch.cat([b.sums[p].detach().reshape(-1) for p in params]) for b in batches])

    def _divisors(self, sizes: list[int]) -> Tensor:
        if self.is_private:
            return torch.tensor([self.sample_rate * x.shape[0] for x, _ in self.worker_data])
        return torch.tensor(sizes, dtype=torch.float).clamp(min=1.0)

    def _worker_signs(self, sums: Tensor) -> Tensor:
        """Each worker's released sign(S_m + σ C z_m), by the sign-vote release rule: ``[M, D]`` int8."""
        params = list(self.params.values())
        signs = []
        for row in sums:
            parts = torch.split(row, [p.numel() for p in params])
            batch = ClippedBatch({p: part.view_as(p) for p, part in zip(params, parts)}, None, torch.zeros(0), 0)
            self.privatizer.privatize(batch, params, DEFAULT_REQUEST, self.noise_multiplier,
                                      self.max_grad_norm or 1.0, 1.0)
            signs.append(torch.cat([p.grad.reshape(-1) for p in params]).to(SIGN_DTYPE))
        return torch.stack(signs)

    def step(self) -> VoteStep:
        """One round: sample, clip, per-worker noise and sign, vote, θ -= η·vote, ledger += 1. Past the model's
        backward (the clipped sums, the noise, the signs, the vote and its write into ``p.grad``) the round runs
        outside the user's torch modes (:mod:`~lightning_dp.mode_free`)."""
        x, y, owners, sizes = self._sample()
        return self._vote(self.worker_sums(x, y, owners), sizes)

    @mode_free
    def _vote(self, sums: Tensor, sizes: list[int]) -> VoteStep:
        if self.gradient_noise is not None:
            xi = self.gradient_noise(tuple(sums.shape), self.generator).to(sums.dtype)
            sums = sums + self._divisors(sizes).unsqueeze(1).to(sums.dtype) * xi
        signs = self._worker_signs(sums)
        vote = majority_vote(signs)
        self._write_vote(vote)
        self.optimizer.step()
        self.ledger.record(self.noise_multiplier, self.sample_rate, private=self.is_private)
        agreement = float((signs == vote.unsqueeze(0)).float().mean())
        return VoteStep(tuple(sizes), vote, agreement)

    def _write_vote(self, vote: Tensor) -> None:
        offset = 0
        for p in self.params.values():
            n = p.numel()
            p.grad = vote[offset : offset + n].view_as(p).to(p.dtype)
            mark_released(p.grad)  # the library's own output: the next round's engine does not take it for a gradient
            offset += n


def _validate(
    worker_data: Sequence[tuple[Tensor, Tensor]],
    sample_rate: float,
    noise_multiplier: float,
    max_grad_norm: Optional[float],
) -> None:
    if len(worker_data) == 0:
        raise ValueError("worker_data must hold at least one (inputs, targets) pair")
    if any(x.shape[0] != y.shape[0] or x.shape[0] == 0 for x, y in worker_data):
        raise ValueError("every worker needs a non-empty dataset with as many targets as inputs")
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    if not noise_multiplier >= 0.0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
    if noise_multiplier > 0 and max_grad_norm is None:
        raise ValueError("noise without clipping is not private: set max_grad_norm=C (or noise_multiplier=0)")
