"""DP-SignSGD optimizer and the M-virtual-workers runner (docs/algorithms.md §6)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.sign_sgd.vote import majority_vote
from lightning_dp.optim.sign_sgd import DPSignSGD, VirtualWorkersSignSGD


def _workers(m: int = 4, n: int = 12, d: int = 3, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m * n, d, generator=gen)
    y = (x @ torch.ones(d) > 0).float().unsqueeze(1)
    return [(x[i * n : (i + 1) * n], y[i * n : (i + 1) * n]) for i in range(m)]


def test_dp_sign_sgd_moves_by_lr_times_vote() -> None:
    p = nn.Parameter(torch.tensor([1.0, 1.0, 1.0]))
    opt = DPSignSGD([p], lr=0.1)
    p.grad = torch.tensor([1.0, -1.0, 0.0])
    opt.step()
    assert torch.allclose(p.detach(), torch.tensor([0.9, 1.1, 1.0]))
    p.grad = torch.tensor([5.0, -0.01, 0.0])  # a raw gradient: only its sign matters
    opt.step()
    assert torch.allclose(p.detach(), torch.tensor([0.8, 1.2, 1.0]))


def test_dp_sign_sgd_rejects_bad_lr() -> None:
    with pytest.raises(ValueError, match="lr"):
        DPSignSGD([nn.Parameter(torch.zeros(1))], lr=0.0)


def test_virtual_workers_update_equals_lr_times_vote_of_worker_signs() -> None:
    """Without noise, θ moves by exactly -η · majority(sign(S_m)) with S_m the clipped per-example sums."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    data = _workers()
    reference = copy.deepcopy(model)  # the runner attaches its engine to ``model``
    runner = VirtualWorkersSignSGD(model, F.binary_cross_entropy_with_logits, data, 1.0, 0.05, 0.0, 0.5)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    sums = []
    for x, y in data:  # reference: autograd per example, clip, sum
        s = torch.zeros_like(before)
        for i in range(x.shape[0]):
            reference.zero_grad()
            F.binary_cross_entropy_with_logits(reference(x[i : i + 1]), y[i : i + 1]).backward()
            g = torch.cat([p.grad.flatten() for p in reference.parameters()])
            s += g * min(1.0, 0.5 / (g.norm().item() + 1e-6))
        sums.append(s)
    expected_vote = majority_vote(torch.stack([torch.sign(s).to(torch.int8) for s in sums]))
    step = runner.step()
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert step.batch_sizes == (12, 12, 12, 12)  # q = 1 takes every example
    assert torch.equal(step.vote, expected_vote)
    assert torch.allclose(before - after, 0.05 * expected_vote.float(), atol=1e-7)


def test_worker_sums_clip_each_example_to_c() -> None:
    """One example with a huge input changes its worker's clipped sum by at most C."""
    model = nn.Linear(3, 1)
    data = _workers(m=2)
    runner = VirtualWorkersSignSGD(model, F.binary_cross_entropy_with_logits, data, 1.0, 0.1, 1.0, 0.7)
    x = torch.cat([d[0] for d in data])
    y = torch.cat([d[1] for d in data])
    owners = torch.repeat_interleave(torch.arange(2), 12)
    base = runner.worker_sums(x, y, owners)
    huge = 1e5 * torch.ones(1, 3)
    wrong_label = (model(huge) < 0).float().detach()  # the misclassified label: gradient ≈ huge
    x2 = torch.cat([x, huge])
    y2 = torch.cat([y, wrong_label])
    with_huge = runner.worker_sums(x2, y2, torch.cat([owners, torch.tensor([1])]))
    assert torch.equal(with_huge[0], base[0])
    change = (with_huge[1] - base[1]).norm().item()
    assert 0.69 < change <= 0.7 * (1 + 1e-6)


def test_ledger_records_local_rate_and_privacy() -> None:
    model = nn.Linear(3, 1)
    private = VirtualWorkersSignSGD(model, F.binary_cross_entropy_with_logits, _workers(), 0.25, 0.1, 2.0, 1.0,
                                    generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        private.step()
    (entry,) = private.ledger.entries
    assert (entry.noise_multiplier, entry.sample_rate, entry.steps, entry.private) == (2.0, 0.25, 3, True)
    with pytest.raises(PrivacyConfigurationError, match="already attached"):  # two engines on one model
        VirtualWorkersSignSGD(model, F.binary_cross_entropy_with_logits, _workers(), 0.25, 0.1)
    private.detach()
    clean = VirtualWorkersSignSGD(model, F.binary_cross_entropy_with_logits, _workers(), 0.25, 0.1)
    clean.step()
    assert not clean.ledger.is_private


def test_workers_take_any_model_the_strategy_takes_and_the_probe_guards_them() -> None:
    """Workers run the private step's engine (not a functional vmap of their own): a model with
    LayerNorm and a token embedding trains; a loss that sums over the batch is refused by the probe."""
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 7, (10, 5), generator=gen), torch.rand(10, 1, generator=gen).round()) for _ in range(3)]
    model = nn.Sequential(nn.Embedding(7, 4), nn.LayerNorm(4), nn.Flatten(), nn.Linear(20, 1))
    runner = VirtualWorkersSignSGD(model, F.binary_cross_entropy_with_logits, data, 0.5, 0.1, 1.0, 1.0,
                                   generator=torch.Generator().manual_seed(1))
    before = [p.detach().clone() for p in model.parameters()]
    runner.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    runner.detach()

    def summed(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(out, y, reduction="sum")

    with pytest.raises(PrivacyConfigurationError, match="sum"):
        VirtualWorkersSignSGD(model, summed, data, 0.5, 0.1, 1.0, 1.0)


def test_noise_without_clipping_is_refused() -> None:
    with pytest.raises(ValueError, match="max_grad_norm"):
        VirtualWorkersSignSGD(nn.Linear(3, 1), F.binary_cross_entropy_with_logits, _workers(), 0.5, 0.1, 1.0, None)
    with pytest.raises(ValueError, match="sample_rate"):
        VirtualWorkersSignSGD(nn.Linear(3, 1), F.binary_cross_entropy_with_logits, _workers(), 0.0, 0.1)
    with pytest.raises(ValueError, match="worker_data"):
        VirtualWorkersSignSGD(nn.Linear(3, 1), F.binary_cross_entropy_with_logits, [], 0.5, 0.1)


def test_empty_batches_are_valid_steps() -> None:
    """q tiny: every batch empty; the private step still happens (noise only) and is accounted."""
    model = nn.Linear(3, 1)
    runner = VirtualWorkersSignSGD(model, F.binary_cross_entropy_with_logits, _workers(), 1e-9, 0.1, 1.0, 1.0,
                                   generator=torch.Generator().manual_seed(1))
    step = runner.step()
    assert step.batch_sizes == (0, 0, 0, 0)
    assert runner.ledger.steps == 1
    assert (step.vote != 0).any()  # noise-only signs still vote


def test_gradient_noise_is_scaled_by_expected_batch_when_private() -> None:
    """ξ_m is in mean-gradient units: the worker statistic gets B_m·ξ_m with B_m = q·n_m."""
    seen = []

    def xi(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        seen.append(shape)
        return torch.full(shape, 1e6)  # dominates S_m and σC z (still above its rounding): every sign +1

    model = nn.Linear(3, 1)
    runner = VirtualWorkersSignSGD(model, F.binary_cross_entropy_with_logits, _workers(), 0.5, 0.1, 1.0, 1.0,
                                   gradient_noise=xi, generator=torch.Generator().manual_seed(2))
    step = runner.step()
    assert seen == [(4, 4)]
    assert step.vote.tolist() == [1, 1, 1, 1] and step.agreement == 1.0


def test_private_training_learns_a_separable_problem() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    data = _workers(m=10, n=40, seed=3)
    runner = VirtualWorkersSignSGD(model, F.binary_cross_entropy_with_logits, data, 0.3, 0.02, 1.0, 1.0,
                                   generator=torch.Generator().manual_seed(4))
    for _ in range(150):
        runner.step()
    x = torch.cat([d[0] for d in data])
    y = torch.cat([d[1] for d in data])
    assert ((model(x) > 0).float() == y).float().mean() > 0.9


def test_the_vote_left_in_p_grad_is_not_a_gradient_of_the_next_round() -> None:
    """The vote the optimizer stepped with stays in ``p.grad`` (no zero_grad between rounds); it is the library's own
    output (marked as released), so the ghost engine does not take it for a use of the weights its hooks missed."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    runner = VirtualWorkersSignSGD(model, F.binary_cross_entropy_with_logits, _workers(), 0.5, 0.05, 1.0, 1.0,
                                   generator=torch.Generator().manual_seed(2), per_sample="ghost")
    for _ in range(3):
        runner.step()
    assert runner.ledger.steps == 3
    runner.detach()


@pytest.mark.parametrize("layout", ["within", "across"])
def test_a_record_held_twice_by_the_workers_is_refused(layout) -> None:
    """Each record lives once, in one worker: a copy (twice in one worker's data, or in two workers') would be
    sampled twice per round while the ledger charges q once."""
    data = _workers()
    x, y = data[0]
    if layout == "within":
        data[0] = (torch.cat([x, x]), torch.cat([y, y]))
    else:
        data[1] = (x.clone(), y.clone())
    with pytest.raises(PrivacyConfigurationError, match="repeat"):
        VirtualWorkersSignSGD(nn.Linear(3, 1), F.binary_cross_entropy_with_logits, data, 0.25, 0.1, 1.0, 1.0)
