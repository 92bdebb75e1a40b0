"""Engines agree on every layer they accept: one equality suite, every registered engine × every case of
engine_zoo.py, against the per-example loop (one backward per example, float64; gs_cases.reference).

For each (engine, case): a layer in ``engine.unsupported_layers(model)`` skips the case (the engine is
excluded from it, so ``auto`` never picks it there); otherwise the engine runs two steps on one attached
model and must match the reference within relative error 1e-6:

- C between the two smallest per-example norms (all but one example clipped), the clipped sums and
  the norms; for ``ghost``, with the ghost norm / book-keeping paths forced (tiny layers would
  otherwise materialise);
- C huge (nothing clipped), with the squared sums (``ghost``: the materialised paths).

A wrong result on an accepted case is either fixed by the engine's unsupported list or listed in
:data:`XFAIL` (strict, with the reason); a loud refusal during the step (a PrivacyConfigurationError) is
allowed only where listed in :data:`RUNTIME_REFUSED`; a case no engine accepts is listed in
:data:`REFUSED_BY_ALL`. ``select_engine`` must pick an engine that passes.
"""

from __future__ import annotations

import functools
from typing import Optional

import pytest
import torch
from torch import Tensor, nn

import lightning_dp.grad_sample.conv_rules as conv_rules
import lightning_dp.grad_sample.embedding_rule as embedding_rule
import lightning_dp.grad_sample.linear_rule as linear_rule
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.grad_sample import available_engines, make_engine, select_engine  # registers all
from lightning_dp.grad_sample.base import ClippedBatch

import engine_zoo as zoo
from gs_cases import reference

ENGINES = available_engines()
RTOL = 1e-6
ZERO_FLOOR = 1e-3
"""A parameter whose true gradient is (almost) zero — a Linear bias before InstanceNorm, which removes
it — is compared relative to ZERO_FLOOR × the largest reference tensor instead of its own size."""

XFAIL: dict[tuple[str, str], tuple[str, type[BaseException]]] = {}
"""(engine, case): a wrong result or a crash on a case the engine accepts, to be fixed in the engine."""

RUNTIME_REFUSED: dict[tuple[str, str], str] = {
    ("opacus_hooks", "broadcast_positions"): "dimension 0 of these layers' outputs is not 5",
    ("opacus_hooks", "broadcast_shared_table"): "dimension 0 of these layers' outputs is not 5",
}
"""(engine, case) → the message of the PrivacyConfigurationError the step raises: the engine cannot see
the problem statically (a [1, T] lookup broadcast over the batch: Opacus would put its grad sample in
row 0 of [n, …]), and refuses it loudly instead of releasing a wrong sum."""

REFUSED_BY_ALL: dict[str, str] = {
    "batchnorm2d": "BatchNorm normalises with batch statistics: one example changes every other example's "
                   "gradient, so there is no per-example gradient to clip (validators/layers.py refuses it too)",
}

AUTO_XFAIL: dict[str, tuple[str, type[BaseException]]] = {}
"""Cases where ``select_engine`` picks an engine listed in :data:`XFAIL`."""


# ------------------------------------------------------------------------------------------ reference
def _dense(g: Optional[Tensor], p: Tensor) -> Tensor:
    if g is None:
        return torch.zeros_like(p)
    return g.to_dense() if g.is_sparse else g


@functools.lru_cache(maxsize=None)
def per_example(case_name: str) -> list[list[Tensor]]:
    """Example i's gradient of every trainable parameter: a batch of one, one backward each."""
    case = zoo.BY_NAME[case_name]
    model, (x, y) = case.build(), case.batch()
    params = zoo.trainable(model)
    grads = []
    for i in range(x.shape[0]):
        gi = torch.autograd.grad(case.loss(model, x[i:i + 1], y[i:i + 1]), params, allow_unused=True)
        grads.append([_dense(g, p) for g, p in zip(gi, params)])
    return grads


def small_c(norms: Tensor) -> float:
    """Between the two smallest norms: every example but one is clipped."""
    s = norms.sort().values
    return float(s[0] + s[1]) / 2


def _close(got: Tensor, want: Tensor, floor: float, what: str) -> None:
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
    got = got.to_dense() if got.is_sparse else got
    scale = max(float(want.abs().max()) if want.numel() else 0.0, floor, 1e-300)
    err = float((got.double() - want).abs().max()) if want.numel() else 0.0
    assert err <= RTOL * scale, f"{what}: max abs error {err:.3e}, relative {err / scale:.3e} > {RTOL}"


def assert_matches(got: ClippedBatch, want: ClippedBatch, params: list[nn.Parameter], squares: bool) -> None:
    assert got.batch_size == want.batch_size
    _close(got.norms, want.norms, 0.0, "norms")
    assert set(got.sums) == set(params), "sums must hold exactly the trainable parameters given"
    floor = ZERO_FLOOR * max(float(want.sums[p].abs().max()) for p in params)
    for k, p in enumerate(params):
        _close(got.sums[p], want.sums[p], floor, f"sums[{k}] {tuple(p.shape)}")
    if squares:
        assert got.square_sums is not None
        floor = ZERO_FLOOR * max(float(want.square_sums[p].abs().max()) for p in params)
        for k, p in enumerate(params):
            _close(got.square_sums[p], want.square_sums[p], floor, f"square_sums[{k}] {tuple(p.shape)}")


# ------------------------------------------------------------------------------------------ one check
def check(engine_name: str, case: zoo.Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two steps of the engine on one attached model equal the reference (module docstring)."""
    grads = per_example(case.name)
    model, (x, y) = case.build(), case.batch()
    params = zoo.trainable(model)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    norms = reference(grads, params, float("inf")).norms
    engine = make_engine(engine_name)
    engine.attach(model)
    try:
        for C, squares, force_ghost in ((small_c(norms), False, True), (1e12, True, False)):
            if engine_name == "ghost":
                monkeypatch.setattr(linear_rule, "prefer_ghost", _forced(_PREFER_GHOST, force_ghost))
                monkeypatch.setattr(embedding_rule, "prefer_ghost_embedding",
                                    _forced(_PREFER_GHOST_EMBEDDING, force_ghost))
                monkeypatch.setattr(conv_rules, "prefer_conv_ghost", _forced(_PREFER_CONV_GHOST, force_ghost))
            engine.begin_step(x.shape[0])
            model.zero_grad()
            case.loss(model, x, y).backward()
            got = engine.clip_and_sum(params, C, with_squares=squares)
            assert_matches(got, reference(grads, params, C), params, squares)
    finally:
        engine.detach()
    for name, p in model.named_parameters():
        if name in frozen:
            assert p.grad is None and torch.equal(p.detach(), frozen[name]), f"frozen {name} changed"


_PREFER_GHOST = linear_rule.prefer_ghost
_PREFER_GHOST_EMBEDDING = embedding_rule.prefer_ghost_embedding
_PREFER_CONV_GHOST = conv_rules.prefer_conv_ghost


def _forced(rule, force: bool):
    """Ghost's cost rule, or always True (the ghost norm and book-keeping contraction) when ``force``."""
    return (lambda *args: True) if force else rule


def _pairs():
    for case in zoo.CASES:
        for engine in ENGINES:
            known = XFAIL.get((engine, case.name))
            marks = [pytest.mark.xfail(strict=True, reason=known[0], raises=known[1])] if known else []
            yield pytest.param(engine, case, id=f"{case.name}-{engine}", marks=marks)


@pytest.mark.parametrize("engine_name,case", list(_pairs()))
def test_engine_matches_per_example_loop(engine_name, case, monkeypatch):
    problems = make_engine(engine_name).unsupported_layers(case.build())
    if problems:
        pytest.skip(f"excluded by {engine_name}.unsupported_layers: {problems}")
    refused = RUNTIME_REFUSED.get((engine_name, case.name))
    if refused is not None:
        with pytest.raises(PrivacyConfigurationError, match=refused):
            check(engine_name, case, monkeypatch)
        return
    check(engine_name, case, monkeypatch)


# ------------------------------------------------------------------------------------------ coverage
def _accepting(case: zoo.Case) -> list[str]:
    model = case.build()
    return [e for e in ENGINES if not make_engine(e).unsupported_layers(model)]


def test_every_case_is_served_or_refused_by_all():
    """Each case has an engine that accepts it and passes, or it is in REFUSED_BY_ALL (no engine accepts
    it and auto refuses it). The exception lists name real cases and stay current."""
    names = set(zoo.BY_NAME)
    for table in (XFAIL, RUNTIME_REFUSED):
        for engine, name in table:
            assert engine in ENGINES and name in names, (engine, name)
            assert engine in _accepting(zoo.BY_NAME[name]), \
                f"({engine}, {name}) is excluded by its unsupported list now: remove the stale entry"
    assert set(REFUSED_BY_ALL) <= names and set(AUTO_XFAIL) <= names
    unserved = []
    for case in zoo.CASES:
        accepting = _accepting(case)
        if case.name in REFUSED_BY_ALL:
            assert accepting == [], f"{case.name} is accepted by {accepting}: remove it from REFUSED_BY_ALL"
            with pytest.raises(ValueError, match="No per-example gradient engine"):
                select_engine(case.build())
            continue
        passing = [e for e in accepting if (e, case.name) not in XFAIL and (e, case.name) not in RUNTIME_REFUSED]
        if not passing:
            unserved.append(case.name)
    assert unserved == [], f"no engine serves these cases (add a rule, or REFUSED_BY_ALL with a reason): {unserved}"


def _auto_cases():
    for case in zoo.CASES:
        if case.name in REFUSED_BY_ALL:
            continue
        known = AUTO_XFAIL.get(case.name)
        marks = [pytest.mark.xfail(strict=True, reason=known[0], raises=known[1])] if known else []
        yield pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", list(_auto_cases()))
def test_auto_picks_an_engine_that_passes(case, monkeypatch):
    name = select_engine(case.build())
    assert (name, case.name) not in RUNTIME_REFUSED, f"auto picks {name}, which refuses {case.name} at run time"
    check(name, case, monkeypatch)


def test_auto_chooses_only_among_tested_engines():
    from lightning_dp.grad_sample.auto import PREFERENCE

    assert set(PREFERENCE) <= set(ENGINES)
