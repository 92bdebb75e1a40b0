"""Statistical tests of the mechanism: noise std σC/B, clipping bound C, noise once."""

import math

import pytest
import torch
from scipy import stats
from torch import nn

import lightning_dp.privacy.noise as noise_module
from lightning_dp.grad_sample import make_engine
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.privacy.privatizer import Privatizer
from lightning_dp.privacy.release import MechanismRequest
from lightning_dp.grad_sample import ClippedBatch


def _zero_batch(params):
    return ClippedBatch({p: torch.zeros_like(p) for p in params}, None, torch.zeros(0), 0)


def _variance_bounds(n, alpha=1e-4):
    lo, hi = stats.chi2.ppf([alpha / 2, 1 - alpha / 2], n)
    return lo / n, hi / n


@pytest.mark.parametrize("sigma,C,B", [(1.0, 1.0, 32.0), (0.7, 2.5, 100.0)])
@pytest.mark.parametrize("shapes", [[(200, 100)], [(40, 5)] * 100], ids=["one-tensor", "many-small-tensors"])
def test_noise_std_is_sigma_c_over_b(sigma, C, B, shapes):
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    Privatizer(GaussianNoise(seed=0)).privatize(_zero_batch(params), params, MechanismRequest(), sigma, C, B)
    g = torch.cat([p.grad.flatten() for p in params]).double()
    ratio = (g.pow(2).mean() / (sigma * C / B) ** 2).item()  # known mean 0: chi2 with n dof
    lo, hi = _variance_bounds(g.numel())
    assert lo < ratio < hi
    # The test would catch a 10 % error in σ: (1.1)² and (0.9)² lie outside the bounds.
    assert not lo < ratio / 1.21 < hi and not lo < ratio / 0.81 < hi


def test_second_moment_splits_the_budget():
    params = [nn.Parameter(torch.zeros(20000))]
    batch = ClippedBatch({params[0]: torch.zeros(20000)}, {params[0]: torch.zeros(20000)}, torch.zeros(0), 0)
    sigma, C, B = 1.0, 2.0, 10.0
    rel = Privatizer(GaussianNoise(seed=1)).privatize(batch, params, MechanismRequest(second_moment=True), sigma, C, B)
    lo, hi = _variance_bounds(20000)
    assert lo < params[0].grad.pow(2).mean().item() / (math.sqrt(2) * sigma * C / B) ** 2 < hi
    sm = rel.second_moment[params[0]]
    assert lo < sm.pow(2).mean().item() / (math.sqrt(2) * sigma * C**2 / B) ** 2 < hi
    assert rel.noise_std == pytest.approx(math.sqrt(2) * sigma * C / B)


def test_scale_then_privatize_noise_is_sigma_c_in_scaled_space():
    p = nn.Parameter(torch.zeros(40000))
    scale = torch.full((40000,), 4.0)
    scale[:20000] = 0.5
    Privatizer(GaussianNoise(seed=2)).privatize(_zero_batch([p]), [p], MechanismRequest(scale={p: scale}), 1.0, 1.0, 8.0)
    scaled = (p.grad * scale).double()  # back in scaled space the noise is isotropic σC/B
    lo, hi = _variance_bounds(20000)
    for part in (scaled[:20000], scaled[20000:]):
        assert lo < part.pow(2).mean().item() / (1.0 / 8.0) ** 2 < hi


def test_only_the_noise_rank_adds_noise_and_reduce_sees_everything():
    p = nn.Parameter(torch.zeros(10))
    seen = []
    quiet = Privatizer(GaussianNoise(seed=3), reduce=lambda ts: seen.extend(t.clone() for t in ts), adds_noise=False)
    batch = ClippedBatch({p: torch.ones(10)}, None, torch.ones(3), 3)
    quiet.privatize(batch, [p], MechanismRequest(), 1.0, 1.0, 5.0)
    assert torch.equal(seen[0], torch.ones(10))  # no noise on this rank
    assert torch.allclose(p.grad, torch.ones(10) / 5.0)


def test_clean_mean_is_unnoised():
    p = nn.Parameter(torch.zeros(10))
    batch = ClippedBatch({p: torch.full((10,), 3.0)}, None, torch.ones(3), 3)
    rel = Privatizer(GaussianNoise(seed=4)).privatize(batch, [p], MechanismRequest(clean_mean=True), 1.0, 1.0, 3.0)
    assert torch.allclose(rel.clean_mean[p], torch.ones(10))
    assert not torch.allclose(p.grad, torch.ones(10))


def _engine_sum(model, x, y, C, scale=None):
    engine = make_engine("opacus_hooks")
    engine.attach(model)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    out = engine.clip_and_sum(params, C, scale, with_squares=True)
    engine.detach()
    for p in params:
        p.grad = None
    return params, out


def test_one_huge_example_moves_the_clipped_sum_by_at_most_c():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    C = 0.5
    params, without = _engine_sum(model, x, y, C)
    x_big = torch.cat([x, 1e4 * torch.randn(1, 5)])
    y_big = torch.cat([y, torch.tensor([1])])
    _, with_big = _engine_sum(model, x_big, y_big, C)
    diff = torch.cat([(with_big.sums[p] - without.sums[p]).flatten() for p in params]).norm()
    assert with_big.norms[-1] > 10 * C  # the example really was clipped
    assert diff <= C * (1 + 1e-5)
    assert diff >= C * 0.99  # and clipped to C, not to something smaller


def test_engine_matches_a_per_example_loop():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    model[0].bias.requires_grad_(False)  # frozen: no per-example gradient, no noise
    x, y = torch.randn(9, 4), torch.randint(0, 2, (9,))
    C = 0.3
    params, out = _engine_sum(model, x, y, C)
    assert len(params) == 3
    expected = [torch.zeros_like(p) for p in params]
    expected_sq = [torch.zeros_like(p) for p in params]
    for i in range(9):
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), params)
        norm = torch.cat([g.flatten() for g in grads]).norm()
        factor = min(1.0, C / (norm.item() + 1e-6))
        for e, s, g in zip(expected, expected_sq, grads):
            e += factor * g
            s += (factor * g) ** 2
    for p, e, s in zip(params, expected, expected_sq):
        assert torch.allclose(out.sums[p], e, atol=1e-6)
        assert torch.allclose(out.square_sums[p], s, atol=1e-7)
    assert out.batch_size == 9


def test_noise_with_a_reduce_is_added_before_it_and_has_std_sigma_c_over_b():
    """The multi-process path (noise into the sums, reduce, / B) gives the same N(0, (σC/B)²)."""
    p = nn.Parameter(torch.zeros(30000))
    seen = []
    priv = Privatizer(GaussianNoise(seed=6), reduce=lambda ts: seen.extend(t.clone() for t in ts))
    batch = ClippedBatch({p: torch.full((30000,), 2.0)}, None, torch.ones(3), 3)
    priv.privatize(batch, [p], MechanismRequest(), 0.8, 1.5, 4.0)
    lo, hi = _variance_bounds(30000)
    assert lo < (seen[0] - 2.0).pow(2).mean().item() / (0.8 * 1.5) ** 2 < hi  # noise already in what is reduced
    assert lo < (p.grad - 0.5).double().pow(2).mean().item() / (0.8 * 1.5 / 4.0) ** 2 < hi


def test_add_noise_in_chunks_is_fresh_per_coordinate(monkeypatch):
    """Chunked draws into one scratch buffer: every chunk new, N(0, std²), scale_by applied, dtypes apart."""
    monkeypatch.setattr(noise_module, "_MIN_CHUNK", 1000)
    base = torch.full((12000,), 4.0)
    tensors = [base.clone(), torch.full((7,), 4.0), torch.full((3000,), 4.0, dtype=torch.float64),
               torch.full((50, 40), 4.0).t()]  # the last is not contiguous
    GaussianNoise(seed=7).add_noise_(tensors, 3.0, scale_by=0.5)
    z = [(t - 2.0).flatten().double() for t in tensors]  # scale_by: 4 -> 2
    assert [t.dtype for t in tensors] == [torch.float32, torch.float32, torch.float64, torch.float32]
    lo, hi = _variance_bounds(12000 + 7 + 3000 + 2000)
    assert lo < torch.cat(z).pow(2).mean().item() / 9.0 < hi
    chunk = -(-17007 // 8)  # max(_MIN_CHUNK, ⌈d / 8⌉) numbers per draw
    chunks = z[0][: 5 * chunk].view(5, chunk)
    r = torch.corrcoef(chunks)
    assert (r - torch.eye(5, dtype=r.dtype)).abs().max() < 4.5 / math.sqrt(chunk)  # no repeated scratch contents
    with pytest.raises(ValueError, match="std"):
        GaussianNoise(seed=7).add_noise_(tensors, 0.0)


def test_small_tensors_share_draws_but_never_noise(monkeypatch):
    """Tensors below the scratch size are drawn together (one draw per bucket): each still gets
    its own N(0, std²) values, scale_by is applied, shapes and empty tensors are respected."""
    monkeypatch.setattr(noise_module, "_MIN_CHUNK", 1000)
    shapes = [(3, 5)] * 150 + [(0,), (40, 25), (1,), (7, 1, 2)] * 5
    tensors = [torch.full(s, 4.0) for s in shapes] + [torch.full((9000,), 4.0)]
    GaussianNoise(seed=3).add_noise_(tensors, 2.0, scale_by=0.5)
    assert [tuple(t.shape) for t in tensors[:-1]] == shapes
    z = [((t - 2.0) / 2.0).flatten().double() for t in tensors]
    assert all((t != 4.0).all() for t in tensors)  # every coordinate drawn, none left untouched
    lo, hi = _variance_bounds(sum(v.numel() for v in z))
    assert lo < torch.cat(z).pow(2).mean().item() < hi
    firsts = torch.stack([v[:15] for v in z[:150]])  # the 150 equal small tensors
    r = torch.corrcoef(firsts)
    assert (r - torch.eye(150, dtype=r.dtype)).abs().max() < 0.95  # no tensor reuses another's noise
    assert len({tuple(v.tolist()) for v in firsts}) == 150
    GaussianNoise(seed=3).add_noise_([], 2.0)  # nothing to do


def test_add_noise_of_a_custom_sample_uses_that_sample():
    class Ones(GaussianNoise):
        def sample(self, like):
            return [torch.ones_like(t) for t in like]

    t = torch.full((5,), 2.0)
    Ones().add_noise_([t], 3.0, scale_by=0.5)
    assert torch.equal(t, torch.full((5,), 4.0))
