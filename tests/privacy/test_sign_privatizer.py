import torch
from torch import nn

from lightning_dp.grad_sample import ClippedBatch
from lightning_dp.privacy.release import DEFAULT_REQUEST
from lightning_dp.sign_sgd.privatizer import SignVotePrivatizer


def test_one_worker_writes_the_sign_of_the_noisy_sum():
    p = nn.Parameter(torch.zeros(10000))
    sums = torch.linspace(-3, 3, 10000)
    batch = ClippedBatch({p: sums.clone()}, None, torch.ones(4), 4)
    SignVotePrivatizer(seed=0).privatize(batch, [p], DEFAULT_REQUEST, noise_multiplier=1.0, max_grad_norm=1.0,
                                         expected_batch_size=4.0)
    assert set(p.grad.unique().tolist()) <= {-1.0, 1.0}
    # P(sign = +1) = Φ(S / σC): far positive sums are almost always +1, far negative -1.
    assert (p.grad[sums > 2.5] == 1).float().mean() > 0.97
    assert (p.grad[sums < -2.5] == -1).float().mean() > 0.97
    near_zero = p.grad[sums.abs() < 0.05]
    assert 0.3 < (near_zero == 1).float().mean() < 0.7


def test_vote_goes_through_the_all_reduce():
    p = nn.Parameter(torch.zeros(5))
    batch = ClippedBatch({p: torch.full((5,), 100.0)}, None, torch.ones(1), 1)

    def peers_vote_minus_two(t):  # two other workers both voted -1 everywhere (their noise flags: 0)
        if t.is_floating_point():
            return  # the failure flag summed before the vote (release_reduce.raise_together): none failed
        t.add_(-2)

    SignVotePrivatizer(peers_vote_minus_two, world_size=3, seed=1).privatize(batch, [p], DEFAULT_REQUEST, 1e-3, 1.0, 1.0)
    assert torch.equal(p.grad, -torch.ones(5))
