"""Ghost engine with tied weights (ghost_tied.py): the norms' cross terms, against a per-example loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gs_cases import assert_close_batch, per_example_grads, random_scale, reference, run_engine
from lightning_dp.grad_sample import make_engine
from lightning_dp.grad_sample import ghost_tied


class TiedLM(nn.Module):
    """GPT-2 style: the LM head's weight is the token embedding's ([V, d])."""

    def __init__(self, V: int = 7, d: int = 4, second_linear: bool = False) -> None:
        super().__init__()
        self.emb, self.mix, self.head = nn.Embedding(V, d), nn.Linear(d, d), nn.Linear(d, V, bias=False)
        self.head.weight = self.emb.weight
        self.second_linear = second_linear
        if second_linear:  # a second Linear sharing the same [V, d] weight: Linear × Linear cross terms
            self.aux = nn.Linear(d, V, bias=False)
            self.aux.weight = self.emb.weight

    def forward(self, x):
        h = torch.tanh(self.mix(self.emb(x)))
        out = self.head(h)
        return out + 0.5 * self.aux(h * h) if self.second_linear else out


def lm_loss(model, x, y):
    return F.cross_entropy(model(x).transpose(1, 2), y)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("second_linear", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_tied_embedding_and_heads_match_the_loop(T, second_linear, scaled):
    torch.manual_seed(0)
    _check_against_loop(TiedLM(second_linear=second_linear).double(), T, 6, scaled)


def _check_against_loop(model: nn.Module, T: int, n: int, scaled: bool) -> None:
    """Ghost engine (clip 0.05, squares, optional scale) == brute force, float64."""
    params = list(model.parameters())
    x, y = torch.randint(0, 7, (n, T)), torch.randint(0, 7, (n, T))
    scale = random_scale(params) if scaled else None
    ref = reference(per_example_grads(model, lm_loss, x, y, params, scale), params, 0.05)
    engine = make_engine("ghost")
    engine.attach(model)
    assert engine.unsupported_layers(model) == []
    got = run_engine(engine, model, lm_loss, x, y, params, 0.05, scale, with_squares=True)
    assert_close_batch(got, ref, params, rtol=1e-9)
    engine.detach()


def test_cross_terms_are_what_makes_it_exact():
    """Dropping the cross terms (each owner's norm alone) would under-clip: the test above needs them."""
    torch.manual_seed(0)
    model = TiedLM().double()
    x, y = torch.randint(0, 7, (4, 5)), torch.randint(0, 7, (4, 5))
    params = list(model.parameters())
    grads = per_example_grads(model, lm_loss, x, y, params)
    engine = make_engine("ghost")
    engine.attach(model)
    original = ghost_tied.cross_term
    try:
        import lightning_dp.grad_sample.ghost as ghost

        ghost.cross_term = lambda a, b, rows: torch.zeros(a.r.shape[0] if hasattr(a, "r") else a.g.shape[0],
                                                          dtype=torch.float64)
        wrong = run_engine(engine, model, lm_loss, x, y, params, 1e9)
    finally:
        ghost.cross_term = original
    true = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in gi)) for gi in grads])
    assert not torch.allclose(wrong.norms, true, rtol=1e-3)


@pytest.mark.parametrize("kinds", [("lowrank", "lookup"), ("lookup", "lookup"), ("lowrank", "lowrank"),
                                   ("dense", "lookup"), ("dense", "lowrank")])
def test_every_cross_term_form_equals_the_dense_inner_product(kinds):
    torch.manual_seed(0)
    n, T, S, V, d = 3, 4, 5, 6, 2

    def make(kind, length):
        if kind == "lowrank":
            return ghost_tied.LowRank(torch.randn(n, length, V, dtype=torch.float64),
                                      torch.randn(n, length, d, dtype=torch.float64), 1.7)
        if kind == "lookup":
            return ghost_tied.Lookup(torch.randint(0, V, (n, length)), torch.randn(n, length, d, dtype=torch.float64))
        return ghost_tied.Dense(torch.randn(n, V, d, dtype=torch.float64))

    a, b = make(kinds[0], T), make(kinds[1], S)
    want = (ghost_tied.dense(a, V) * ghost_tied.dense(b, V)).sum((1, 2))
    torch.testing.assert_close(ghost_tied.cross_term(a, b, V), want)
    torch.testing.assert_close(ghost_tied.cross_term(b, a, V), want)


class Conv1D(nn.Module):
    """Hugging Face's Conv1D as GPT-2 defines it: weight [in, out], y = x W + b."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], self.nf)


class ConvOneDLM(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.emb, self.proj, self.head = nn.Embedding(7, 4), Conv1D(4, 4), nn.Linear(4, 7, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.proj(self.emb(x))))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("T", [1, 5])
def test_hugging_face_conv1d_takes_the_linear_rule_and_is_exact(tied, scaled, T):
    from lightning_dp.grad_sample import linear_rule

    torch.manual_seed(0)
    model = ConvOneDLM(tied).double()
    assert linear_rule.is_hf_conv1d(model.proj)
    _check_against_loop(model, T, 5, scaled)
