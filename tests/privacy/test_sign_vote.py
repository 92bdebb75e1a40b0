"""DP-SignSGD mechanism (docs/algorithms.md §6): worker signs, the vote, the int8 all-reduce."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scipy import stats

from lightning_dp.grad_sample.base import clip_and_sum_materialised
from lightning_dp.sign_sgd.vote import (
    SIGN_DTYPE,
    all_reduce_vote,
    all_reduce_votes,
    majority_vote,
    noisy_sum,
    vote_wire_dtype,
    worker_sign,
)


def _reference_vote(signs: torch.Tensor) -> torch.Tensor:
    """Majority by counting: +1 if more +1 than -1, -1 if fewer, 0 on a tie."""
    plus = (signs == 1).sum(0)
    minus = (signs == -1).sum(0)
    return (plus > minus).to(torch.int8) - (plus < minus).to(torch.int8)


# --- worker_sign / noisy_sum -------------------------------------------------


def test_worker_sign_without_noise_is_the_sign_and_zeros_map_to_zero() -> None:
    s = torch.tensor([[3.0, -0.5, 0.0], [0.0, 0.0, -2.0]])
    out = worker_sign(s, 0.0, 1.0)
    assert out.dtype == SIGN_DTYPE
    assert out.tolist() == [[1, -1, 0], [0, 0, -1]]


def test_worker_sign_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="noise_multiplier"):
        worker_sign(torch.zeros(3), -1.0, 1.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        worker_sign(torch.zeros(3), 1.0, 0.0)
    with pytest.raises(ValueError, match="floating"):
        worker_sign(torch.zeros(3, dtype=torch.long), 1.0, 1.0)


@pytest.mark.parametrize("sigma,clip", [(0.7, 1.0), (2.0, 0.3)])
def test_worker_noise_std_is_sigma_c_chi_square(sigma: float, clip: float) -> None:
    """Σ z² / (σC)² ~ χ²_n; a 10 % error in σ is far outside the 1e-6 two-sided bounds."""
    n = 200_000
    noise = noisy_sum(torch.zeros(n, dtype=torch.float64), sigma, clip, torch.Generator().manual_seed(1))
    lo, hi = stats.chi2.ppf([1e-6, 1 - 1e-6], df=n)
    for true_std in (sigma * clip,):
        assert lo < float((noise**2).sum()) / true_std**2 < hi
    for wrong in (0.9, 1.1):
        stat = float((noise**2).sum()) / (wrong * sigma * clip) ** 2
        assert not lo < stat < hi


def test_worker_sign_flip_probability_matches_sigma_c() -> None:
    """P(sign(s + σCz) = +1) = Φ(s / σC); with 1e6 coordinates a 10 % error in σ is > 20 sd away."""
    sigma, clip, n = 1.5, 2.0, 1_000_000
    s = torch.full((n,), 0.5 * sigma * clip)
    frac = float((worker_sign(s, sigma, clip, torch.Generator().manual_seed(2)) == 1).double().mean())
    sd = (0.25 / n) ** 0.5
    assert abs(frac - stats.norm.cdf(0.5)) < 5 * sd
    for wrong in (0.9, 1.1):
        assert abs(frac - stats.norm.cdf(0.5 / wrong)) > 10 * sd


def test_workers_noise_is_independent_across_rows() -> None:
    """A leading worker axis gets independent noise per worker (no shared z)."""
    out = noisy_sum(torch.zeros(2, 50_000), 1.0, 1.0, torch.Generator().manual_seed(3))
    corr = torch.corrcoef(out)[0, 1].item()
    assert abs(corr) < 0.03


def test_noise_is_fresh_without_generator() -> None:
    a = noisy_sum(torch.zeros(100), 1.0, 1.0)
    b = noisy_sum(torch.zeros(100), 1.0, 1.0)
    assert not torch.equal(a, b)


def test_per_example_clipping_bounds_a_workers_sensitivity_by_c() -> None:
    """Adding one example with a huge gradient moves the pre-noise sum S_m by at most C."""
    clip = 0.8
    gen = torch.Generator().manual_seed(4)
    param = torch.nn.Parameter(torch.zeros(5, 3))
    base = [torch.randn(16, 5, 3, generator=gen)]
    huge = 1e6 * torch.randn(1, 5, 3, generator=gen)
    s_without = clip_and_sum_materialised([param], base, clip).sums[param]
    s_with = clip_and_sum_materialised([param], [torch.cat([base[0], huge])], clip).sums[param]
    change = (s_with - s_without).norm().item()
    assert change <= clip * (1 + 1e-6)
    assert change > 0.99 * clip  # the bound is attained: clipping, not vanishing


# --- majority_vote -----------------------------------------------------------


def test_majority_vote_small_cases_and_ties() -> None:
    signs = torch.tensor([[1, 1, -1, 0, 1], [1, -1, -1, 0, -1], [-1, 0, -1, 0, 0]], dtype=torch.int8)
    assert majority_vote(signs).tolist() == [1, 0, -1, 0, 0]


@pytest.mark.parametrize("seed", range(5))
def test_majority_vote_random_property(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    m = int(torch.randint(1, 12, (1,), generator=gen))
    signs = (torch.randint(0, 3, (m, 7, 9), generator=gen) - 1).to(torch.int8)
    vote = majority_vote(signs)
    assert vote.dtype == SIGN_DTYPE and vote.shape == (7, 9)
    assert torch.equal(vote, _reference_vote(signs))


def test_majority_vote_many_workers_does_not_overflow() -> None:
    """250 × (+1) and 50 × (-1): the sum 200 wraps to -56 in int8, which would flip the vote."""
    signs = torch.cat([torch.ones(250, 4, dtype=torch.int8), -torch.ones(50, 4, dtype=torch.int8)])
    assert int(signs.sum(0, dtype=torch.int8)[0]) < 0  # the trap is real
    assert majority_vote(signs).tolist() == [1, 1, 1, 1]


def test_majority_vote_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="int8"):
        majority_vote(torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"\{-1, 0, \+1\}"):
        majority_vote(torch.full((3, 2), 2, dtype=torch.int8))
    with pytest.raises(ValueError, match="worker axis"):
        majority_vote(torch.ones((), dtype=torch.int8))


# --- all_reduce_vote ---------------------------------------------------------


def test_wire_dtype_is_int8_up_to_127_workers() -> None:
    assert vote_wire_dtype(2) == torch.int8
    assert vote_wire_dtype(127) == torch.int8
    assert vote_wire_dtype(128) == torch.int32
    with pytest.raises(ValueError):
        vote_wire_dtype(0)


def test_all_reduce_vote_with_custom_collective_simulates_many_ranks() -> None:
    """300 simulated ranks: the wire dtype must widen, and the vote equals the majority."""
    gen = torch.Generator().manual_seed(5)
    signs = (torch.randint(0, 3, (300, 64), generator=gen) - 1).to(torch.int8)
    seen: list[torch.dtype] = []

    def fake_all_reduce(t: torch.Tensor) -> None:
        seen.append(t.dtype)
        t.copy_(signs.to(t.dtype).sum(0))

    vote = all_reduce_vote(signs[0], all_reduce=fake_all_reduce, world_size=300)
    assert seen == [torch.int32]
    assert torch.equal(vote, majority_vote(signs))
    with pytest.raises(ValueError, match="world_size"):
        all_reduce_vote(signs[0], all_reduce=fake_all_reduce)


def test_all_reduce_vote_needs_initialised_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised in this interpreter")
    with pytest.raises(RuntimeError, match="initialised"):
        all_reduce_vote(torch.ones(3, dtype=torch.int8))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        gen = torch.Generator().manual_seed(100 + rank)
        local = [worker_sign(torch.randn(33, generator=gen), 1.0, 1.0, gen), worker_sign(torch.randn(4, 5, generator=gen), 0.0, 1.0)]
        before = [t.clone() for t in local]
        int8_votes = all_reduce_votes(local)
        assert all(torch.equal(a, b) for a, b in zip(local, before)), "input signs were modified"
        fp32 = [t.float() for t in local]
        for t in fp32:
            dist.all_reduce(t)
        torch.save(
            {"local": local, "int8": int8_votes, "fp32": [torch.sign(t).to(torch.int8) for t in fp32]},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.ddp
def test_int8_all_reduce_equals_fp32_vote_on_two_gloo_processes() -> None:
    with tempfile.TemporaryDirectory() as out_dir:
        # fork (where available) skips re-importing torch and this module in each child:
        # ~1 s instead of ~7 s; the same torch.multiprocessing API as spawn.
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        mp.start_processes(_gloo_worker, args=(2, _free_port(), out_dir), nprocs=2, join=True, start_method=method)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]
    for k in range(2):
        stacked = torch.stack([results[r]["local"][k] for r in range(2)])
        for r in range(2):
            assert results[r]["int8"][k].dtype == torch.int8
            assert torch.equal(results[r]["int8"][k], results[r]["fp32"][k])
            assert torch.equal(results[r]["int8"][k], majority_vote(stacked))
    # two voters disagreeing must give a 0 somewhere (ties), else the test is vacuous
    assert (results[0]["int8"][0] == 0).any()


def test_noise_comes_from_the_noise_mechanism_with_the_given_generator() -> None:
    from lightning_dp.privacy.noise import GaussianNoise

    a = noisy_sum(torch.zeros(1000), 1.0, 2.0, torch.Generator().manual_seed(7))
    z = GaussianNoise(generator=torch.Generator().manual_seed(7)).sample([torch.zeros(1000)])[0]
    torch.testing.assert_close(a, 2.0 * z)  # the same draw, scaled by σC: one place draws noise
    with pytest.raises(ValueError, match="seed or generator"):
        GaussianNoise(seed=1, generator=torch.Generator())
