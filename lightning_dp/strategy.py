"""DPStrategy: Lightning glue around the private step of :mod:`lightning_dp.privacy`.

The strategy owns privacy (docs/architecture.md): it swaps the training loader for Poisson
sampling, attaches a per-example gradient engine, and wraps Lightning's optimizer
closure so that after the user's forward and backward the gradients are replaced by

    ĝ_t = (Σ_i clip_C(g_{t,i}) + σ C z_t) / B          (docs/algorithms.md, "The mechanism")

before the optimizer (and Lightning's ``on_before_optimizer_step``) sees them. Every
release is recorded in :attr:`DPStrategy.ledger`, which travels in checkpoints.

One class serves one process and ``devices=N`` (it is a ``DDPStrategy``): with several
processes each rank samples and clips its own shard, rank 0 adds the noise once, and a
single all-reduce sums the noisy total. Torch's DDP wrapper is never used, so no
non-private gradient is ever communicated.

The hooks themselves (data, step, ceiling, checkpoints) are :class:`~lightning_dp._strategy_glue.PrivateTraining`,
shared with the sharded :class:`~lightning_dp.sharded_strategy.DPShardedStrategy`; this file adds how a
replicated model is placed and reduced.
"""

from __future__ import annotations

import atexit
import logging
from datetime import timedelta
from typing import Literal, Optional, Sequence, Union

from typing_extensions import override

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from pytorch_lightning.overrides.distributed import _sync_module_states
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from pytorch_lightning.strategies.strategy import Strategy
from pytorch_lightning.trainer.states import TrainerFn

from lightning_dp._strategy_glue import (
    REGISTERED_ARGUMENTS,
    REGISTERED_DEFAULTS,
    PrivacyStateLauncher,
    PrivateTraining,
    check_trainer,
    destroy_process_group,
    planned_steps,
    setup_optimizers,
)
from lightning_dp.privacy.config import ExecutionConfig, PrivacyConfig
from lightning_dp.privacy.noise import NoiseMechanism
from lightning_dp.clipping import ClippingPolicy
from lightning_dp.units import Users
from lightning_dp.privacy.private_step import Distribution

log = logging.getLogger(__name__)

__all__ = ["DPStrategy", "REGISTERED_DEFAULTS", "planned_steps"]


class DPStrategy(PrivateTraining, DDPStrategy):
    """Train any LightningModule with DP-SGD-style per-example clipping and Gaussian noise.

    Args:
        noise_multiplier: σ; the noise std is σ·C. Give this or ``target_epsilon``.
        max_grad_norm: C, the per-example clipping norm. Not given: the Trainer's ``gradient_clip_val`` (with
            ``gradient_clip_algorithm="norm"``, Lightning's default) when it has one, said in one INFO line, and
            Lightning's own clipping of the batch gradient is off for the fit (it would clip the released, noised
            gradient); else the bound of ``clipping``; else 1.0. Given as well, a different ``gradient_clip_val`` is
            refused naming both, and ``gradient_clip_algorithm="value"`` is always refused
            (:mod:`lightning_dp._gradient_clip`); given with a ``clipping`` policy, the two must agree.
        target_epsilon: calibrate σ before the first step so that the planned run
            (``max_steps`` or ``max_epochs``) spends at most this ε at ``target_delta``.
        target_delta: δ for calibration (warns when δ ≥ 1/N).
        accountant: accountant used for calibration (see :mod:`lightning_dp.accounting`).
        per_sample: per-example gradient engine, by registered name
            (see :func:`lightning_dp.grad_sample.available_engines`), or ``"auto"`` (default):
            the fastest engine valid for the model (ghost, then vmap, then opacus_hooks),
            named in the log.
        max_physical_batch_size: split larger Poisson batches into physical batches of at
            most this many examples (forward + backward each, clipped sums accumulated);
            noise is still added once per logical step. ``None``: never split. ``1``: every
            example's gradient from its own forward and backward, so examples cannot interact by
            construction (certainty, at the cost of one pass per example; the interaction checks are
            then not needed and do not run).
        fixed_batch_size: F: every physical batch is exactly F rows (fixed shapes, e.g. for ``torch.compile``): the
            Poisson batch's examples, then padding rows (zeroed records, clip factor 0: they add exactly nothing); a
            larger Poisson batch runs as several padded physical batches. Nothing is truncated, so the accounting is
            unchanged (:mod:`lightning_dp.performance.fixed_batch`). Costs the padding rows' compute; the logged loss is
            the mean over the F rows. Every ``clipping`` policy is served; not with ``max_physical_batch_size``,
            ``augmentation_multiplicity > 1`` or ``privacy_unit``. ``None`` (default): Poisson shapes.
        retain_cpu_memory: on CPU, keep freed memory for the next step (glibc's malloc thresholds, set once per
            process: :mod:`lightning_dp.performance.cpu_memory`): a private step then re-faults no pages each step
            (the digits CNN: 6.3 → 4.1 ms/step alone in its process). ``False`` leaves the allocator alone.
        noise: ``"gaussian"`` (default: fresh independent Gaussians from an OS-seeded
            generator), ``"banded"`` (correlated DP-MF noise with ``bands`` bands and
            b-min-separated sampling, docs/algorithms.md §7), or a
            :class:`~lightning_dp.privacy.noise.NoiseMechanism` instance.
        bands: b for ``noise="banded"``: the data is split into b groups and step t
            Poisson-samples group t mod b; the noise history costs (b − 1)·d floats.
        sampler_seed: seed of the Poisson sampler (tests only; default from the OS).
        secure_mode: draw the noise and the Poisson sampling from the operating system's CSPRNG,
            with the Holohan & Braghin (2021) mitigation against floating-point attacks on the
            Gaussian (:mod:`lightning_dp.privacy.csprng`). Slower (docs/secure_mode.md); for
            models you publish when the attacker may see the floating-point output. Works with
            ``noise="gaussian"`` and ``GaussianNoise``-free runs only (not banded noise, not
            DP-SignSGD, no ``sampler_seed``).
        resume_privacy: what a resumed run does when σ, C, ``target_epsilon`` or
            ``target_delta`` differ from its checkpoint's: ``"strict"`` (default) refuses
            with an error naming both values; ``"new"`` applies this run's σ, C and target
            from the resumed step on, and says so in the log (the ledger records every step's
            σ, so ε stays exact). A new target is the explicit way to raise a finished run's
            budget: it stays a ceiling on the whole ledger, the checkpoint's releases included.
        on_budget_short: with ``target_epsilon``, what a fit does when the ledger (a resumed
            checkpoint's, or this module's earlier fits in this process: the ledger travels with
            the module) leaves too little budget for the plan at the run's σ. σ is raised to σ*,
            the smallest σ that fits the rest of the plan, when σ* ≤ 3× σ_ref (the larger of the
            run's σ and the σ the target needs for the plan on its own), with one log line.
            Beyond 3×, ``"refuse"`` (default) raises ``PrivacyConfigurationError`` before any
            release, saying how much budget is left and the options (stop here; a larger
            ``target_epsilon``; this argument); ``"recalibrate"`` trains on at σ* (near-pure noise
            when σ* ≫ σ_ref: a finished ε = 3 run resumed for more epochs needs σ* ≈ 50×). A spent
            budget (no σ fits) is always refused (:mod:`lightning_dp.accounting.budget_shortfall`).
        augmentation_multiplicity: K ≥ 1 (De et al. 2022): every example arrives as K consecutive
            rows, its augmented views (wrap the dataset in :class:`lightning_dp.data.AugmentedViews`
            and use its ``collate`` as the loader's ``collate_fn``); the example's gradient is the
            mean over its views, clipped once, so the guarantee and the accounting are unchanged.
            Needs the ``vmap`` or ``opacus_hooks`` engine ("auto" picks one).
        public_state: names of module or callback state that the release boundary lets change outside the
            private update (docs/release_boundary.md): attribute paths of the LightningModule (``"queue"``,
            ``"encoder.stats"``, shell wildcards ``"meters.*"``), buffer names, and ``"CallbackClass"`` or
            ``"CallbackClass.attribute"``. Declare only state that is not derived from the training data (a step
            counter, a schedule) or that you accept leaves unprotected, like a logged metric. Any other change is
            refused before the next release.
        verify: when the step's own sampled examples are checked for interactions (as one batch, in two halves
            and alone, before the release): ``"sampled"`` (default: the first step — also as the module would run at
            the plan's last step — then random later steps taking about ``verify_budget`` of the training time
            and one random step in each doubling window of steps), ``"every_step"`` (certainty at about twice the
            cost per step) or ``"first_step"``. The first step's probe runs in every mode.
        verify_budget: the share of training time the later checks may take under ``verify="sampled"`` (0.02).
        clipping: a clipping policy (docs/clipping.md): :class:`~lightning_dp.PerLayerClipping` (each parameter
            tensor to C_p, √(Σ C_p²) = C), :class:`~lightning_dp.AutomaticClipping` (g·C/(‖g‖ + γ), Bu et al. 2023)
            or :class:`~lightning_dp.AdaptiveClipping` (a bound that tracks a quantile of the norms, Andrew et al.
            2021; ``max_grad_norm`` then reads the current bound, logged as ``privacy/clip_norm``). ``None``
            (default): flat clipping at ``max_grad_norm``. The sensitivity is C for every policy.
        privacy_unit: :class:`~lightning_dp.Users` for user-level DP (docs/user_level.md): users are
            Poisson-sampled (q = k / n_users), each user's mean gradient over its records is clipped to C, the
            accounting is per user (N = n_users; ``expected_batch_size`` is k). ``None`` (default): the example.
        accelerator: the accelerator (set by the Trainer; as for Lightning's ``DDPStrategy``).
        parallel_devices: the devices of the processes (set by the Trainer).
        cluster_environment: the cluster environment (set by the Trainer).
        checkpoint_io: checkpoint reader/writer plugin.
        precision_plugin: precision plugin (set by the Trainer from ``precision``).
        process_group_backend: torch.distributed backend with several processes (default per device).
        timeout: timeout of the process group's collectives.
        start_method: how processes start with several devices: "popen" (default), "spawn", "fork"
            or "forkserver".

    Example:
        >>> trainer = pl.Trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0),
        ...                      accelerator="cpu", devices=1, max_epochs=5)  # doctest: +SKIP
    """

    strategy_name = "dp"

    def __init__(
        self,
        noise_multiplier: Optional[float] = None,
        max_grad_norm: Optional[float] = None,
        *,
        target_epsilon: Optional[float] = None,
        target_delta: Optional[float] = None,
        accountant: str = "rdp",
        per_sample: str = "auto",
        max_physical_batch_size: Optional[int] = None,
        fixed_batch_size: Optional[int] = None,
        retain_cpu_memory: bool = True,
        noise: Optional[Union[str, NoiseMechanism]] = None,
        bands: int = 1,
        sampler_seed: Optional[int] = None,
        secure_mode: bool = False,
        resume_privacy: Literal["strict", "new"] = "strict",
        augmentation_multiplicity: int = 1,
        public_state: Sequence[str] = (),
        verify: Literal["first_step", "sampled", "every_step"] = "sampled",
        verify_budget: float = 0.02,
        on_budget_short: Literal["refuse", "recalibrate"] = "refuse",
        clipping: Optional[ClippingPolicy] = None,
        privacy_unit: Optional[Users] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._init_privacy(
            PrivacyConfig(
                noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, target_epsilon=target_epsilon,
                target_delta=target_delta, accountant=accountant, noise=noise, bands=bands, secure_mode=secure_mode,
                sampler_seed=sampler_seed, clipping=clipping, privacy_unit=privacy_unit, public_state=public_state,
                on_budget_short=on_budget_short),
            ExecutionConfig(
                engine=per_sample, views_per_example=augmentation_multiplicity,
                max_physical_batch_size=max_physical_batch_size, fixed_batch_size=fixed_batch_size, verify=verify,
                verify_budget=verify_budget, retain_cpu_memory=retain_cpu_memory),
            resume_privacy,
        )

    def __repr__(self) -> str:
        # Shown in Lightning's own "invalid strategy" error when a Trainer of the other namespace gets
        # this object: the repr names the import that fixes it.
        other = ("lightning_dp.DPStrategy (for pytorch_lightning)" if pl.__name__ != "pytorch_lightning"
                 else "lightning_dp.unified.DPStrategy (for `import lightning as L`)")
        step = self.private_step
        sigma = step.noise_multiplier if step.noise_multiplier is not None else f"target ε={step.target_epsilon}"
        return (f"DPStrategy(noise_multiplier={sigma}, max_grad_norm={step.max_grad_norm}) built on {pl.__name__}; "
                f"with the other package use {other}")

    # ------------------------------------------------------------------ processes
    @override
    def _configure_launcher(self) -> None:
        # One process: no launcher. fork/spawn: Lightning's, also returning the privacy state.
        if not self._distributed:
            self._launcher = None
        elif self._start_method == "popen":
            super()._configure_launcher()
        else:
            self._launcher = PrivacyStateLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        """Set up the device; the process group only with several processes."""
        if self._distributed:
            super().setup_environment()
            atexit.unregister(destroy_process_group)  # once, however many fit/test calls set it up
            atexit.register(destroy_process_group)
        else:
            Strategy.setup_environment(self)

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Check the configuration, move the model, build optimizers and the mechanism."""
        assert self.accelerator is not None and self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            check_trainer(trainer, self.label)
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._distributed:
            _sync_module_states(self.model)  # replicas start identical; no DDP wrapper (see module doc)
        if fitting:
            setup_optimizers(self, trainer, self.label)
            world = self.num_nodes * self.num_processes
            self._attach(Distribution(self.global_rank, world, dist.all_reduce if self._distributed else None))
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)


StrategyRegistry.register(DPStrategy.strategy_name, DPStrategy, description="Differentially private training "
                          "(lightning_dp): per-example clipping, Gaussian noise, Poisson sampling",
                          override=True, **REGISTERED_ARGUMENTS)
