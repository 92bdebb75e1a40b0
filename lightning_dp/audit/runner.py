"""One audited training run: canaries in, train once with DPStrategy, ε lower bound out.

Steinke, Nasr & Jagielski (2023), docs/algorithms.md §8: draw m canaries with public ½-coins,
train once, score every canary, turn the correct guesses into an ε lower bound at the
stated confidence (:mod:`lightning_dp.audit.bound`), and compare it with the ε the
accountant claims for the same run (``ledger_epsilon`` of the strategy's ledger, same δ).
A lower bound above the claim means the code does not do what the accountant assumes.

Each call is one trial, audited alone: its fit stands apart from the data's record
(:func:`~lightning_dp.accounting.data_ledgers.apart`), so trials on one dataset neither compose
in the claim nor spend each other's ``target_epsilon``, and the claim is the ε of this fit's own
releases (a model fitted before keeps its ledger; only this run's entries are claimed).
"""

from __future__ import annotations

import importlib
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import pytorch_lightning as pl
import torch
import yaml
from torch import nn

from lightning_dp.accounting import data_ledgers, ledger_epsilon
from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.audit.bound import BoundResult, audit_from_scores
from lightning_dp.audit.canaries import CanaryDataModule, canary_losses, draw_coins, loss_scores, make_input_canaries
from lightning_dp.audit.gradient_canaries import GradientCanaryDataModule, GradientCanaryModule
from lightning_dp.privacy.noise import NoiseMechanism
from lightning_dp.privacy.sampling import secure_seed
from lightning_dp.strategy import DPStrategy

KINDS = ("input", "gradient")
SCORES = ("loss", "loss_drop")


@dataclass(frozen=True)
class AuditResult:
    """The audit's lower bound next to the accountant's claim.

    Attributes:
        epsilon_lower_bound: ε the run provably exceeds with probability ≥ ``confidence``.
        claimed_epsilon: the accountant's ε for the same run at ``delta``.
        delta, confidence: of both numbers / of the lower bound.
        kind: "input" or "gradient" canaries.
        canaries, included: m and how many coins said "in".
        guesses, correct, k: of the best guess size k (k "in" + k "out" guesses).
        steps, noise_multiplier, max_grad_norm, sample_rate: the mechanism as run.
        seed: the recorded canary/coin seed.
    """

    epsilon_lower_bound: float
    claimed_epsilon: float
    delta: float
    confidence: float
    kind: str
    canaries: int
    included: int
    guesses: int
    correct: int
    k: int
    steps: int
    noise_multiplier: float
    max_grad_norm: float
    sample_rate: float
    seed: int

    @property
    def violated(self) -> bool:
        """True when the measured lower bound exceeds the claimed ε (the claim is refuted)."""
        return self.epsilon_lower_bound > self.claimed_epsilon

    def summary(self) -> str:
        """Human-readable lines: both ε, the counts, and the verdict."""
        verdict = "VIOLATED: the lower bound exceeds the claimed ε" if self.violated else "consistent with the claim"
        return "\n".join([
            "=== lightning_dp privacy audit (one run, Steinke-Nasr-Jagielski 2023) ===",
            f"claimed ε (accountant)      : {self.claimed_epsilon:.4f} at δ = {self.delta:g}",
            f"empirical ε lower bound     : {self.epsilon_lower_bound:.4f} at {100 * self.confidence:g} % confidence",
            f"canaries ({self.kind:8s})       : m = {self.canaries}, included = {self.included}, "
            f"correct {self.correct} of {self.guesses} guesses (k = {self.k} per side), seed = {self.seed}",
            f"mechanism                   : σ = {self.noise_multiplier:.4g}, C = {self.max_grad_norm:g}, "
            f"q = {self.sample_rate:.4g}, {self.steps} steps",
            f"verdict                     : {verdict}",
        ])


def run_audit(
    config: Union[str, Path, dict, None] = None,
    *,
    model: Optional[pl.LightningModule] = None,
    datamodule: Optional[pl.LightningDataModule] = None,
    strategy_kwargs: Optional[dict[str, Any]] = None,
    canaries: int = 200,
    kind: str = "input",
    confidence: float = 0.95,
    delta: Optional[float] = None,
    max_epochs: Optional[int] = None,
    seed: Optional[int] = None,
    noise: Optional[NoiseMechanism] = None,
    amplitude: float = 1.0,
    ks: Optional[Sequence[int]] = None,
    num_classes: Optional[int] = None,
    score: str = "loss",
) -> AuditResult:
    """Train once with m canaries under :class:`DPStrategy` and audit the run.

    Give either ``config`` (a ``lightning-dp fit`` YAML path or its parsed dict: ``model``,
    ``data``, ``trainer.strategy`` (DPStrategy), ``trainer.max_epochs``, ``privacy_delta``)
    or ``model``, ``datamodule`` and ``strategy_kwargs`` (DPStrategy's arguments).

    Args:
        canaries: m.
        kind: "input" (OOD inputs with random labels, scored by their loss under the trained
            model: black-box) or "gradient" (Dirac gradient canaries, white-box; the model
            must be a classifier, see :class:`GradientCanaryModule`).
        confidence: 1 − β of the lower bound.
        delta: δ of both numbers (default: the config's ``privacy_delta``/``target_delta``, else 1e-5).
        max_epochs: override the config's training length.
        seed: canary/coin seed (default from the OS; recorded in the result).
        noise: a NoiseMechanism passed to DPStrategy (tests inject broken ones here).
        amplitude: magnitude of input-canary pixels/features.
        ks: guess sizes to try (see :func:`~lightning_dp.audit.bound.audit_from_scores`).
        num_classes: for input canaries when neither datamodule nor model states it.
        score: input canaries only: "loss" (-loss after training) or "loss_drop" (loss under
            the initial weights minus loss after training).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1) (e.g. 0.95), got {confidence!r}")
    if canaries < 2:
        raise ValueError(f"need at least 2 canaries (one guess per side), got {canaries}")
    if config is not None:
        model, datamodule, strategy_kwargs, cfg_epochs, cfg_delta = load_config(config)
        max_epochs = max_epochs if max_epochs is not None else cfg_epochs
        delta = delta if delta is not None else cfg_delta
    if model is None or datamodule is None or strategy_kwargs is None:
        raise ValueError("give a config, or all of model=, datamodule= and strategy_kwargs=")
    delta = delta if delta is not None else strategy_kwargs.get("target_delta") or 1e-5
    seed = secure_seed() if seed is None else int(seed)
    strategy = DPStrategy(**{**strategy_kwargs, **({"noise": noise} if noise is not None else {})})
    if kind == "input":
        scores, coins = _input_run(
            model, datamodule, strategy, canaries, seed, amplitude, max_epochs, num_classes, score == "loss_drop"
        )
    else:
        scores, coins = _gradient_run(model, datamodule, strategy, canaries, seed, max_epochs)
    bound = audit_from_scores(scores, coins.numpy(), confidence, delta, ks)
    return _result(bound, strategy, kind, int(coins.sum()), seed)


def _input_run(model, datamodule, strategy, m, seed, amplitude, max_epochs, num_classes, drop):
    datamodule.setup("fit")
    x0, _ = datamodule.train_dataloader().dataset[0]
    classes = num_classes or getattr(datamodule, "num_classes", None) or _hparam(model, "num_classes")
    if classes is None:
        raise ValueError("cannot tell the number of classes: pass num_classes=")
    canaries = make_input_canaries(m, tuple(torch.as_tensor(x0).shape), int(classes), seed, amplitude)
    # Initial weights are drawn before, and independently of, the coins: a valid reference.
    reference = canary_losses(model, canaries) if drop else None
    _fit(model, CanaryDataModule(datamodule, canaries), strategy, max_epochs)
    return loss_scores(canary_losses(model, canaries), reference), canaries.included


def _gradient_run(model, datamodule, strategy, m, seed, max_epochs):
    coins = draw_coins(m, seed)
    wrapped = GradientCanaryModule(model, m, strategy.max_grad_norm)
    _fit(wrapped, GradientCanaryDataModule(datamodule, coins), strategy, max_epochs)
    return wrapped.scores(), coins


def _fit(model: nn.Module, datamodule: pl.LightningDataModule, strategy: DPStrategy, max_epochs: Optional[int]) -> None:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=max_epochs if max_epochs is not None else 10,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0,
    )
    with warnings.catch_warnings(), data_ledgers.apart():  # a trial alone: not the trials composed on the data
        warnings.filterwarnings("ignore", message=".*(does not have many workers|Full backward hook|GPU available).*")
        trainer.fit(model, datamodule=datamodule)


def _result(bound: BoundResult, strategy: DPStrategy, kind: str, included: int, seed: int) -> AuditResult:
    ledger = _trial(strategy.ledger)  # this trial's releases alone (a model fitted before continues its own ledger)
    claimed = ledger_epsilon(ledger, bound.delta) if ledger.steps else 0.0
    return AuditResult(
        epsilon_lower_bound=bound.epsilon, claimed_epsilon=claimed, delta=bound.delta, confidence=bound.confidence,
        kind=kind, canaries=bound.m, included=included, guesses=bound.guesses, correct=bound.correct, k=bound.k,
        steps=ledger.steps, noise_multiplier=strategy.noise_multiplier, max_grad_norm=strategy.max_grad_norm,
        sample_rate=float(strategy.sample_rate or math.nan), seed=seed,
    )


def _trial(ledger: PrivacyLedger) -> PrivacyLedger:
    """The releases of ``ledger``'s own fit (:attr:`PrivacyLedger.run`): the one trial audited."""
    if ledger.run is None:
        return ledger
    own = PrivacyLedger()
    own.load_entries(e for e in ledger.entries if e.run == ledger.run)
    own.unit = ledger.unit
    return own


def _hparam(model: pl.LightningModule, name: str) -> Any:
    return getattr(model, "hparams", {}).get(name)


def load_config(
    config: Union[str, Path, dict],
) -> tuple[pl.LightningModule, pl.LightningDataModule, dict, Optional[int], Optional[float]]:
    """(model, datamodule, DPStrategy kwargs, max_epochs, δ) from a ``lightning-dp fit`` config.

    Reads ``model``/``data`` (``class_path`` + ``init_args``), ``trainer.strategy``
    (must be DPStrategy), ``trainer.max_epochs``, ``privacy_delta`` and ``seed_everything``.
    """
    cfg = yaml.safe_load(Path(config).read_text()) if not isinstance(config, dict) else config
    for key in ("model", "data"):
        if not isinstance(cfg.get(key), dict) or "class_path" not in cfg[key]:
            raise ValueError(f"the config needs a '{key}:' section with class_path (and init_args)")
    trainer_cfg = cfg.get("trainer") or {}
    strategy_cfg = trainer_cfg.get("strategy")
    if not isinstance(strategy_cfg, dict) or _resolve(strategy_cfg["class_path"]) is not DPStrategy:
        raise ValueError("the config's trainer.strategy must be lightning_dp.DPStrategy (class_path + init_args)")
    if cfg.get("seed_everything") is not None:
        pl.seed_everything(int(cfg["seed_everything"]), verbose=False)
    model = _instantiate(cfg["model"])
    datamodule = _instantiate(cfg["data"])
    kwargs = dict(strategy_cfg.get("init_args") or {})
    delta = cfg.get("privacy_delta", kwargs.get("target_delta"))
    return model, datamodule, kwargs, trainer_cfg.get("max_epochs"), delta


def _resolve(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _instantiate(section: dict) -> Any:
    return _resolve(section["class_path"])(**(section.get("init_args") or {}))
