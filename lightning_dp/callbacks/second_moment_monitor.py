"""SecondMomentMonitor: what the DP noise does to Adam's second moment, logged every n steps.

The bias-correction seed (dp-adam-bias-correction.txt, Table 1 and Figure 2) shows
that under DP the noise variance Φ = (σC/B)² dominates Adam's v̂ (docs/algorithms.md §1),
and the design-principles seed (Fig. 4) reports the share of coordinates with
v̂ − Φ < 0. This callback logs those quantities for the user's own run. They are
post-processing of the optimizer state (noisy quantities) and cost no privacy.
With ``diagnostics="non_private"`` it also logs statistics of the *clean* clipped
mean, read from :attr:`DPStrategy.non_private_diagnostics`; those logs are NOT
covered by the DP guarantee.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import pytorch_lightning as pl
import torch
from lightning_fabric.loggers.tensorboard import TensorBoardLogger as _TensorBoardLoggerBase
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_dp._warnings import filter_upstream_noise
import lightning_dp.callbacks._monitor_tags as tags
from lightning_dp.callbacks._clean_moments import CleanMoments
from lightning_dp.callbacks._hist_bins import histogram_edges
from lightning_dp.callbacks._optimizer_moments import family_of, mean_phi, param_moments
from lightning_dp.callbacks._subsample import CoordinateSample
from lightning_dp.callbacks._tb_layout import MONITOR, write_layout
from lightning_dp.callbacks._vstats import Summary
from lightning_dp.optim.noiseless import NotPrivateWarning

DIAGNOSTICS = ("private", "non_private")

NON_PRIVATE_WARNING = (
    "SecondMomentMonitor(diagnostics='non_private'): the 'nonprivate/*' logs (clean clipped mean, its Adam "
    "moments, per-example gradient norms, clip fraction, ‖ḡ‖/C) are computed from UN-NOISED training data and "
    "are NOT covered by the differential-privacy guarantee. The trained model still is; these logs are not: "
    "do not publish or share them."
)

GroupRef = tuple[int, Optimizer, dict[str, Any]]


class SecondMomentMonitor(Callback):
    """Log v̂, Φ, v̂ − Φ and the Adam update every ``every_n_steps`` optimizer steps.

    Logged at the first step and whenever ``trainer.global_step % every_n_steps == 0``
    (``on_train_batch_end``, so at step t the optimizer state is that after its t-th
    step), from rank 0 only, straight to every logger in ``trainer.loggers`` via
    ``log_metrics`` (not subject to ``log_every_n_steps``). Histograms go only to
    TensorBoard loggers (``experiment.add_histogram``), at the multiples of
    ``every_n_steps`` only (:meth:`log_now`). Supported optimizers:
    :class:`~lightning_dp.optim.DPAdam` / :class:`~lightning_dp.optim.DPAdagrad` (every
    variant) and ``torch.optim.Adam`` / ``AdamW`` / ``Adagrad``; others are skipped with
    a warning.

    Quantities, per parameter (docs/algorithms.md §1–§2):

    * v̂ = v/(1−β2^t) for Adam (``exp_avg_sq``); the running sum ``sum`` for AdaGrad;
    * Φ = per-coordinate variance of the noise in the last step's ĝ,
      ``Release.noise_std²`` (``(noise_std/scale)²`` under scale-then-privatize) — taken
      from ``trainer.strategy.last_release``; absent without ``DPStrategy``;
    * v̂ − Φ̄ with Φ̄ what bias correction subtracts: the variant's tracked average
      (state ``"phi"``) when it keeps one, else Φ (Adam) or t·Φ (AdaGrad);
    * the update direction actually applied, m̂ / D(v̂), with D the variant's own
      divisor (``√v̂ + ε`` for plain Adam, ``sqrt(max(v̂ − Φ̄, γ'))`` for bias
      correction, ...), without the learning rate. AdaGrad: ĝ / D(G).

    Tags (scope = ``all`` for the whole model, ``group<i>`` for the i-th parameter
    group counted over all optimizers; stat = ``min``, ``q1``, ``median``, ``q3``,
    ``max``, ``mean``):

    ===========================================  ===============================================
    ``vt/v/<scope>/<stat>``                      v̂
    ``vt/v_minus_phi/<scope>/<stat>``            v̂ − Φ̄ (the corrected second moment)
    ``vt/update/<scope>/<stat>``                 m̂ / D(v̂)
    ``vt/phi``                                   Φ (mean over coordinates if per-coordinate)
    ``vt/frac_negative``                         share of coordinates with v̂ − Φ̄ < 0
    ``vt/frac_negative/group<i>``                the same, per group
    ``vt/hist/m``, ``vt/hist/v``,                histograms (TensorBoard; ``histograms=True``), in
    ``vt/hist/v_minus_phi``, ``vt/hist/update``  the quantity's units (``lightning-dp report``)
    ``vt/hist/log10_v``,                         log10 v̂ and log10(v̂ / Φ̄) (0: v̂ = Φ̄), which fill
    ``vt/hist/log10_v_over_phi``                 TensorBoard's linear axis (v̂ spans decades)
    ===========================================  ===============================================

    All under ``vt/``, which sorts after PrivacyBudget's ``privacy/`` in TensorBoard. With a
    TensorBoard logger, a custom-scalars layout (one dashboard: ε against its target, σ, Φ
    against the median v̂ and v̂ − Φ̄, ...) is written once at fit start
    (:mod:`lightning_dp.callbacks._tb_layout`).

    With ``diagnostics="non_private"`` (NOT covered by the DP guarantee; warned at setup):

    ===========================================  ===============================================
    ``nonprivate/vt/v/<scope>/<stat>``           v̂^c: Adam's v̂ of the clean clipped mean ḡ
                                                 (own EMA with the optimizer's β2)
    ``nonprivate/vt/update/all/<stat>``          m̂^c / (√v̂^c + ε)
    ``nonprivate/clip_fraction``                 share of the step's examples with ‖g_i‖ > C
    ``nonprivate/grad_norm/<min|q1|median|q3|max>``  per-example gradient norms of the step
    ``nonprivate/mean_norm_over_c``              ‖ḡ‖ / C (design-principles Fig. 5)
    ``nonprivate/vt/hist/m``, ``.../hist/v``,     histograms of m̂^c, v̂^c and the clean update
    ``.../hist/update``
    ===========================================  ===============================================

    Large models: min, max, mean and the negative share are exact; quartiles and
    histograms use a fixed random subsample of at most ``max_coordinates`` coordinates
    (drawn once, data-independent; ``torch.quantile`` refuses more than 16M values).
    The clean EMAs cost two model-sized buffers and are updated every step; they are
    saved in checkpoints (by parameter name) and continue on resume. Norm quantiles and the
    clip fraction are over every rank's examples of the logged step (gathered by the strategy).

    Args:
        every_n_steps: log every n optimizer steps (and at the first).
        diagnostics: ``"private"`` (default) or ``"non_private"`` (opt in to the
            ``nonprivate/*`` logs; needs ``DPStrategy``).
        histograms: also write TensorBoard histograms.
        max_coordinates: cap of the subsample used for quartiles and histograms.
        seed: seed of that subsample.

    Example::

        trainer = pl.Trainer(strategy=DPStrategy(noise_multiplier=1.0),
                             callbacks=[SecondMomentMonitor(every_n_steps=50)],
                             logger=pl.loggers.TensorBoardLogger("lightning_logs"))
        # then: lightning-dp report lightning_logs/version_0   (writes report.png into that folder)
    """

    layout_role = MONITOR
    """What this callback draws in the TensorBoard layout (:mod:`lightning_dp.callbacks._tb_layout`)."""

    def __init__(
        self,
        every_n_steps: int = 50,
        diagnostics: str = "private",
        histograms: bool = True,
        max_coordinates: int = 1_000_000,
        seed: int = 0,
    ) -> None:
        if int(every_n_steps) != every_n_steps or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an integer >= 1, got {every_n_steps!r}.")
        if diagnostics not in DIAGNOSTICS:
            raise ValueError(f"diagnostics must be one of {DIAGNOSTICS}, got {diagnostics!r}; "
                             f"'non_private' opts in to logs NOT covered by the DP guarantee.")
        self.every_n_steps = int(every_n_steps)
        self.diagnostics = diagnostics
        self.histograms = bool(histograms)
        self._sample = CoordinateSample(max_coordinates, seed)
        self._restored_clean: Optional[dict[str, Any]] = None  # from a checkpoint, until the first fold
        self._reset()

    @property
    def non_private(self) -> bool:
        """Whether the opt-in, non-private diagnostics are on."""
        return self.diagnostics == "non_private"

    def _reset(self) -> None:
        self._last_logged: Optional[int] = None
        self._clean: Optional[CleanMoments] = None
        self._names: dict[Tensor, str] = {}
        self._last_diag: Any = None
        self._warned_unsupported: set[str] = set()

    # -- hooks --------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        """With ``diagnostics="non_private"``: warn loudly, then ask the strategy for the diagnostics."""
        filter_upstream_noise()  # again here: a filter set at import is lost if that import ran in catch_warnings
        if stage != "fit" or not self.non_private:
            return
        enable = getattr(trainer.strategy, "enable_non_private_diagnostics", None)
        if enable is None:
            raise ValueError(
                f"SecondMomentMonitor(diagnostics='non_private') reads the clean clipped mean from "
                f"lightning_dp.DPStrategy, but the trainer's strategy is {type(trainer.strategy).__name__}: "
                f"use Trainer(strategy=DPStrategy(...)) or diagnostics='private'."
            )
        rank_zero_warn(NON_PRIVATE_WARNING, category=NotPrivateWarning)
        enable()

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Start afresh (clean EMAs, schedule), keeping clean EMAs restored from a checkpoint; write
        the TensorBoard custom-scalars layout (once per writer, shared with PrivacyBudget)."""
        self._reset()
        write_layout(trainer)

    def state_dict(self) -> dict[str, Any]:
        """The clean EMAs (opt-in diagnostics only; empty otherwise)."""
        if self._clean is None:
            return {}
        return {"clean": self._clean.state_dict(self._names)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the saved clean EMAs until the first step rebuilds the buffers, then restore them."""
        self._restored_clean = state_dict.get("clean")

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        """Fold the clean mean (opt-in), then log if this step is due (rank 0; with sharded parameters every
        rank takes part in gathering each parameter's moments, and rank 0 writes)."""
        if not trainer.is_global_zero and not _sharded(trainer):
            return
        if self.non_private:
            self._fold_clean(trainer)
        step = int(trainer.global_step)
        if self._due(step):
            self.log_now(trainer, step)

    def _due(self, step: int) -> bool:
        if step < 1 or step == self._last_logged:
            return False
        return self._last_logged is None or step % self.every_n_steps == 0

    # -- collecting ---------------------------------------------------------------------
    def log_now(self, trainer: "pl.Trainer", step: int, histograms: Optional[bool] = None) -> None:
        """Compute every statistic from the current optimizer state and write it at ``step``.

        Histograms (with ``histograms=True`` at construction) by default only at multiples of
        ``every_n_steps``, not at the extra first-step log: there v̂ = ĝ₁² is one χ² draw per
        coordinate spanning ~10 decades, and TensorBoard draws every step of a histogram on one
        shared x-axis, so that slice alone would squeeze all later ones against an edge.
        """
        self._last_logged = step
        if histograms is None:
            histograms = step % self.every_n_steps == 0
        histograms = self.histograms and histograms
        groups = list(self._groups(trainer))
        self._sample.plan([p for _, _, group in groups for p in group["params"]])
        scalars, hists = self._private_logs(trainer, groups, histograms)
        if self.non_private:
            more_scalars, more_hists = self._non_private_logs(groups)
            scalars.update(more_scalars)
            hists.update(more_hists)
        self._write(trainer, step, scalars, hists if histograms else {})

    def _groups(self, trainer: "pl.Trainer") -> Iterator[GroupRef]:
        index = 0
        for optimizer in trainer.optimizers:
            supported = family_of(optimizer) is not None
            if not supported:
                self._warn_unsupported(optimizer)
            for group in optimizer.param_groups:
                if supported:
                    yield index, optimizer, group
                index += 1

    def _warn_unsupported(self, optimizer: Optimizer) -> None:
        name = type(optimizer).__name__
        if name not in self._warned_unsupported:
            self._warned_unsupported.add(name)
            rank_zero_warn(f"SecondMomentMonitor: {name} keeps no Adam/AdaGrad second moment; it is not monitored "
                           f"(supported: Adam, AdamW, Adagrad and lightning_dp's DPAdam/DPAdagrad).")

    def _private_logs(self, trainer: "pl.Trainer", groups: list[GroupRef],
                      histograms: bool = True) -> tuple[dict[str, float], dict[str, Tensor]]:
        release = getattr(trainer.strategy, "last_release", None)
        families = (tags.V, tags.V_MINUS_PHI, tags.UPDATE, "m")
        per_group = []
        scalars: dict[str, float] = {}
        ratios: list[Tensor] = []  # sampled v̂ / Φ̄, for the log10 histogram
        for index, optimizer, group in groups:
            scoped = {fam: Summary() for fam in families}
            for p in group["params"]:
                moments = param_moments(optimizer, group, p, release)
                if moments is None:
                    continue
                values = (moments.v, moments.v - moments.phi, moments.update, moments.m)
                for fam, full in zip(families, values):
                    scoped[fam].add(full, self._sample.take(p, full))
                if histograms:
                    ratios.append(self._sampled_ratio(p, moments.v, moments.phi))
            per_group.append(scoped)
            scalars.update(_summaries(scoped, families[:3], tags.group_scope(index)))
            scalars[tags.frac_negative_tag(index)] = scoped[tags.V_MINUS_PHI].frac_negative
        whole = {fam: Summary.merged([g[fam] for g in per_group]) for fam in families}
        scalars.update(_summaries(whole, families[:3], "all"))
        scalars[tags.FRAC_NEGATIVE] = whole[tags.V_MINUS_PHI].frac_negative
        if release is not None:
            scalars[tags.PHI] = mean_phi([p for _, _, g in groups for p in g["params"]], release)
        hists = {tags.HIST_M: whole["m"].samples, tags.HIST_V: whole[tags.V].samples,
                 tags.HIST_V_MINUS_PHI: whole[tags.V_MINUS_PHI].samples, tags.HIST_UPDATE: whole[tags.UPDATE].samples}
        if histograms:
            hists[tags.HIST_LOG10_V] = _log10_positive(hists[tags.HIST_V])
            hists[tags.HIST_LOG10_V_OVER_PHI] = _log10_positive(torch.cat(ratios) if ratios else torch.empty(0))
        return scalars, hists

    def _sampled_ratio(self, p: Tensor, v: Tensor, phi: Any) -> Tensor:
        """v̂ / Φ̄ on the sampled coordinates of ``p`` (empty without noise: Φ̄ = 0)."""
        if not isinstance(phi, Tensor):
            if not phi > 0:
                return torch.empty(0)
            return self._sample.take(p, v).detach().float().cpu() / float(phi)
        phi = phi.detach().expand_as(v) if phi.numel() == 1 else phi.detach()
        return (self._sample.take(p, v).detach() / self._sample.take(p, phi)).float().cpu()

    # -- non-private (opt-in) -------------------------------------------------------------
    def _fold_clean(self, trainer: "pl.Trainer") -> None:
        diag = getattr(trainer.strategy, "non_private_diagnostics", None)
        if diag is None or diag is self._last_diag:
            return
        self._last_diag = diag
        if self._clean is None:
            settings = {}
            for _, optimizer, group in self._groups(trainer):
                betas = group.get("betas", (0.9, 0.999))
                for p in group["params"]:
                    settings[p] = (family_of(optimizer) or "adam", float(betas[0]), float(betas[1]))
            self._clean = CleanMoments(settings)
            self._names = {p: name for name, p in trainer.lightning_module.named_parameters()}
            restored, self._restored_clean = self._restored_clean, None
            if restored is not None:
                self._clean.load_state_dict(restored, {name: p for p, name in self._names.items()})
        self._clean.fold(diag.clean_mean)

    def _non_private_logs(self, groups: list[GroupRef]) -> tuple[dict[str, float], dict[str, Tensor]]:
        diag, clean = self._last_diag, self._clean
        if diag is None or clean is None:
            return {}, {}
        scalars = {tags.CLIP_FRACTION: float(diag.clip_fraction),
                   tags.MEAN_NORM_OVER_C: float(diag.clean_mean_norm_over_c)}
        for stat, value in zip(tags.NORM_STATS, diag.norm_quantiles((0.0, 0.25, 0.5, 0.75, 1.0))):
            scalars[f"{tags.NORM}/{stat}"] = float(value)
        families = (tags.CLEAN_V, tags.CLEAN_UPDATE, "m")
        per_group = []
        for index, _, group in groups:
            scoped = {fam: Summary() for fam in families}
            for p in group["params"]:
                moments = clean.moments(p)
                if moments is None:
                    continue
                m, v = moments
                values = (v, m / (v.sqrt() + group.get("eps", 1e-8)), m)
                for fam, full in zip(families, values):
                    scoped[fam].add(full, self._sample.take(p, full))
            per_group.append(scoped)
            scalars.update(_summaries(scoped, (tags.CLEAN_V,), tags.group_scope(index)))
        whole = {fam: Summary.merged([g[fam] for g in per_group]) for fam in families}
        scalars.update(_summaries(whole, families[:2], "all"))
        hists = {tags.HIST_CLEAN_M: whole["m"].samples, tags.HIST_CLEAN_V: whole[tags.CLEAN_V].samples,
                 tags.HIST_CLEAN_UPDATE: whole[tags.CLEAN_UPDATE].samples}
        return scalars, hists

    # -- writing ------------------------------------------------------------------------
    def _write(self, trainer: "pl.Trainer", step: int, scalars: dict[str, float], hists: dict[str, Tensor]) -> None:
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=step)
            if hists and isinstance(logger, _TensorBoardLoggerBase):
                for tag, values in hists.items():
                    if values.numel():
                        _add_histogram(logger.experiment, tag, values, step, linear=tag in _LOG10_HISTOGRAMS)


_LOG10_HISTOGRAMS = (tags.HIST_LOG10_V, tags.HIST_LOG10_V_OVER_PHI)


def _sharded(trainer: "pl.Trainer") -> bool:
    """Whether the strategy shards the parameters (``DPShardedStrategy``: its statistics need every rank)."""
    return getattr(trainer.strategy, "layout", None) is not None


def _add_histogram(writer: Any, tag: str, values: Tensor, step: int, bins: int = 64, linear: bool = False) -> None:
    """A TensorBoard histogram computed in torch (``add_histogram`` goes through a slow numpy path).

    Edges from :func:`~lightning_dp.callbacks._hist_bins.histogram_edges` (log / symmetric-log
    when the values span decades), or ``bins`` equal buckets with ``linear=True`` (values already
    on a log scale). As in TensorBoard's own writer, the first bucket is an empty sentinel whose
    right limit is the left edge of the data.
    """
    v = values.detach().double().flatten()
    lo, hi = float(v.min()), float(v.max())
    if linear and hi > lo:
        bin_edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    else:
        bin_edges = histogram_edges(lo, hi, bins)
    counts, edges = torch.histogram(v, bins=bin_edges)
    writer.add_histogram_raw(
        tag, min=lo, max=hi, num=v.numel(), sum=float(v.sum()), sum_squares=float(v.pow(2).sum()),
        bucket_limits=edges.tolist(), bucket_counts=[0.0] + counts.tolist(), global_step=step,
    )


def _log10_positive(values: Tensor) -> Tensor:
    """log10 of the finite positive entries of ``values`` (the rest cannot be drawn on a log scale)."""
    values = values.detach().double().reshape(-1)
    return values[torch.isfinite(values) & (values > 0)].log10()


def _summaries(summaries: dict[str, Summary], families: tuple[str, ...], scope: str) -> dict[str, float]:
    """``{"<family>/<scope>/<stat>": value}`` for the given families."""
    return {tags.stat_tag(fam, scope, stat): value
            for fam in families for stat, value in summaries[fam].stats().items()}
