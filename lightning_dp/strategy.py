"""DPStrategy: Lightning glue around the private mechanism of :mod:`lightning_dp.mechanism`.

The strategy owns privacy (ARCHITECTURE.md): it swaps the training loader for Poisson
sampling, attaches a per-example gradient engine, and wraps Lightning's optimizer
closure so that after the user's forward and backward the gradients are replaced by

    ĝ_t = (Σ_i clip_C(g_{t,i}) + σ C z_t) / B          (ALGORITHMS.md, "The mechanism")

before the optimizer (and Lightning's ``on_before_optimizer_step``) sees them. Every
release is recorded in :attr:`DPStrategy.ledger`, which travels in checkpoints.

One class serves one process and ``devices=N`` (it is a ``DDPStrategy``): with several
processes each rank samples and clips its own shard, rank 0 adds the noise once, and a
single all-reduce sums the noisy total. Torch's DDP wrapper is never used, so no
non-private gradient is ever communicated.
"""

from __future__ import annotations

import atexit
import io
import logging
import math
from datetime import timedelta
from functools import partial
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Literal, Optional, Union

from typing_extensions import override

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from lightning_fabric.utilities.types import _PATH
from pytorch_lightning.overrides.distributed import _sync_module_states
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from pytorch_lightning.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from pytorch_lightning.strategies.strategy import Strategy
from pytorch_lightning.trainer.states import RunningStage, TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.mechanism import GaussianNoise, NoiseMechanism, Release
from lightning_dp.mechanism.banded_noise import BandedToeplitzNoise
from lightning_dp.mechanism.csprng import SecureGaussianNoise
from lightning_dp.mechanism.diagnostics import StepDiagnostics
from lightning_dp.mechanism.private_step import Distribution, PrivateStep, mean_loss

log = logging.getLogger(__name__)

_CHECKPOINT_KEY = "lightning_dp"
_SUPPORTED_PRECISION = ("32-true", "64-true", "bf16-mixed")


class DPStrategy(DDPStrategy):
    """Train any LightningModule with DP-SGD-style per-example clipping and Gaussian noise.

    Args:
        noise_multiplier: σ; the noise std is σ·C. Give this or ``target_epsilon``.
        max_grad_norm: C, the per-example clipping norm.
        target_epsilon: calibrate σ before the first step so that the planned run
            (``max_steps`` or ``max_epochs``) spends at most this ε at ``target_delta``.
        target_delta: δ for calibration (warns when δ ≥ 1/N).
        accountant: accountant used for calibration (see :mod:`lightning_dp.accounting`).
        per_sample: per-example gradient engine, by registered name
            (see :func:`lightning_dp.mechanism.available_engines`), or ``"auto"`` (default):
            the fastest engine valid for the model (ghost, then vmap, then opacus_hooks),
            named in the log.
        max_physical_batch_size: split larger Poisson batches into physical batches of at
            most this many examples (forward + backward each, clipped sums accumulated);
            noise is still added once per logical step. ``None``: never split.
        noise: ``"gaussian"`` (default: fresh independent Gaussians from an OS-seeded
            generator), ``"banded"`` (correlated DP-MF noise with ``bands`` bands and
            b-min-separated sampling, ALGORITHMS.md §7), or a
            :class:`~lightning_dp.mechanism.NoiseMechanism` instance.
        bands: b for ``noise="banded"``: the data is split into b groups and step t
            Poisson-samples group t mod b; the noise history costs (b − 1)·d floats.
        sampler_seed: seed of the Poisson sampler (tests only; default from the OS).
        secure_mode: draw the noise and the Poisson sampling from the operating system's CSPRNG,
            with the Holohan & Braghin (2021) mitigation against floating-point attacks on the
            Gaussian (:mod:`lightning_dp.mechanism.csprng`). Slower (README: secure mode); for
            models you publish when the attacker may see the floating-point output. Works with
            ``noise="gaussian"`` and ``GaussianNoise``-free runs only (not banded noise, not
            DP-SignSGD, no ``sampler_seed``).
        resume_privacy: what a resumed run does when σ, C, ``target_epsilon`` or
            ``target_delta`` differ from its checkpoint's: ``"strict"`` (default) refuses
            with an error naming both values; ``"new"`` applies this run's σ and C from the
            resumed step on, and says so in the log (the ledger records every step's σ, so
            ε stays exact). A different target ε is always refused.
        augmentation_multiplicity: K ≥ 1 (De et al. 2022): every example arrives as K consecutive
            rows, its augmented views (wrap the dataset in :class:`lightning_dp.data.AugmentedViews`
            and use its ``collate`` as the loader's ``collate_fn``); the example's gradient is the
            mean over its views, clipped once, so the guarantee and the accounting are unchanged.
            Needs the ``vmap`` or ``opacus_hooks`` engine ("auto" picks one).
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
        max_grad_norm: float = 1.0,
        *,
        target_epsilon: Optional[float] = None,
        target_delta: Optional[float] = None,
        accountant: str = "rdp",
        per_sample: str = "auto",
        max_physical_batch_size: Optional[int] = None,
        noise: Optional[Union[str, NoiseMechanism]] = None,
        bands: int = 1,
        sampler_seed: Optional[int] = None,
        secure_mode: bool = False,
        resume_privacy: Literal["strict", "new"] = "strict",
        augmentation_multiplicity: int = 1,
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
        _check_noise_arguments(noise_multiplier, target_epsilon, target_delta)
        if resume_privacy not in ("strict", "new"):
            raise ValueError(f"resume_privacy must be 'strict' or 'new', got {resume_privacy!r}")
        if max_physical_batch_size is not None and max_physical_batch_size < 1:
            raise ValueError(f"max_physical_batch_size must be a positive integer, got {max_physical_batch_size!r}")
        mechanism = _make_noise(noise, bands)
        if secure_mode:
            if sampler_seed is not None:
                raise ValueError("secure_mode draws the sampling from the OS's CSPRNG: remove sampler_seed")
            if noise not in (None, "gaussian"):
                raise ValueError(f"secure_mode supports noise='gaussian' only, got {noise!r}")
            mechanism = SecureGaussianNoise()
        self.private_step = PrivateStep(
            noise_multiplier, max_grad_norm, mechanism, engine=per_sample, target_epsilon=target_epsilon,
            target_delta=target_delta, accountant=accountant, sampler_seed=sampler_seed, secure_sampling=secure_mode,
            views_per_example=augmentation_multiplicity,
        )
        """The Lightning-free mechanism (:class:`~lightning_dp.mechanism.private_step.PrivateStep`) these hooks drive."""
        self._requested_sigma = self.private_step.noise_multiplier
        self.resume_privacy = resume_privacy
        self.secure_mode = bool(secure_mode)
        self.max_physical_batch_size = max_physical_batch_size
        self._examples_this_step = -1
        self._over_budget = False

    def __repr__(self) -> str:
        # Shown in Lightning's own "invalid strategy" error when a Trainer of the other namespace gets
        # this object: the repr names the import that fixes it.
        other = ("lightning_dp.DPStrategy (for pytorch_lightning)" if pl.__name__ != "pytorch_lightning"
                 else "lightning_dp.unified.DPStrategy (for `import lightning as L`)")
        step = self.private_step
        sigma = step.noise_multiplier if step.noise_multiplier is not None else f"target ε={step.target_epsilon}"
        return (f"DPStrategy(noise_multiplier={sigma}, max_grad_norm={step.max_grad_norm}) built on {pl.__name__}; "
                f"with the other package use {other}")

    # ------------------------------------------------------------------ public state (the private step's)
    @property
    def ledger(self) -> PrivacyLedger:
        """Every noisy release of this run (restored from checkpoints on resume)."""
        return self.private_step.ledger

    @property
    def noise_multiplier(self) -> float:
        """σ in use (calibrated from ``target_epsilon`` once the train loader is known)."""
        if self.private_step.noise_multiplier is None:
            raise RuntimeError("σ is calibrated from target_epsilon when training starts; it is not known yet.")
        return self.private_step.noise_multiplier

    @property
    def max_grad_norm(self) -> float:
        """C, the per-example clipping norm."""
        return self.private_step.max_grad_norm

    @property
    def target_epsilon(self) -> Optional[float]:
        """The ε σ is calibrated for (``None`` when σ was given)."""
        return self.private_step.target_epsilon

    @property
    def target_delta(self) -> Optional[float]:
        """δ of ``target_epsilon`` (``None`` when σ was given)."""
        return self.private_step.target_delta

    @target_delta.setter
    def target_delta(self, delta: Optional[float]) -> None:
        self.private_step.target_delta = delta

    @property
    def accountant(self) -> str:
        """The accountant σ is calibrated with (a name of :func:`lightning_dp.accounting.available_accountants`)."""
        return self.private_step.accountant

    @property
    def sample_rate(self) -> Optional[float]:
        """Global Poisson rate q = B / N (``None`` before the train loader is built)."""
        plan = self.private_step.plan
        return None if plan is None else plan.sample_rate

    @property
    def expected_batch_size(self) -> Optional[float]:
        """Global expected batch B = world_size × loader batch_size."""
        plan = self.private_step.plan
        return None if plan is None else plan.expected_batch_size

    @property
    def num_samples(self) -> Optional[int]:
        """N, the size of the training set."""
        plan = self.private_step.plan
        return None if plan is None else plan.num_samples

    @property
    def steps_per_epoch(self) -> Optional[int]:
        """Logical steps per epoch, round(1/q)."""
        plan = self.private_step.plan
        return None if plan is None else plan.steps_per_epoch

    @property
    def rounds_charged_next_step(self) -> int:
        """Sampled-Gaussian rounds the next optimizer step adds to the ledger: 1 with independent
        noise; with banded noise 1 on the first step of each cycle of b steps and 0 on the others
        (Choquette-Choo et al. 2023, Thm. 5). :class:`~lightning_dp.callbacks.PrivacyBudget` uses it
        to stop exactly at the budget."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return self.private_step.rounds_at(trainer.global_step if trainer is not None else 0)

    @property
    def last_release(self) -> Optional[Release]:
        """The :class:`~lightning_dp.mechanism.Release` of the last step (``None`` before the first)."""
        return self.private_step.last_release

    @property
    def non_private_diagnostics(self) -> Optional[StepDiagnostics]:
        """Un-noised statistics of the last step, or ``None`` unless enabled (NOT private)."""
        return self.private_step.diagnostics

    def enable_non_private_diagnostics(self) -> None:
        """Compute :class:`~lightning_dp.mechanism.diagnostics.StepDiagnostics` every step.

        They are read from un-noised per-example data: anything logged from them is not
        covered by the DP guarantee (the model still is). Warns once.
        """
        if not self.private_step.diagnostics_enabled:
            rank_zero_warn(
                "DPStrategy: non-private diagnostics enabled. Statistics computed from un-noised "
                "per-example gradients (clean clipped mean, norms, clip fraction) are NOT covered by the "
                "differential-privacy guarantee; the trained model still is. Do not publish these logs."
            )
        self.private_step.diagnostics_enabled = True

    @property
    def engine_name(self) -> str:
        """Name of the per-example gradient engine in use (``"auto"`` until chosen at setup)."""
        return self.private_step.engine_name

    # ------------------------------------------------------------------ processes
    @property
    def _distributed(self) -> bool:
        return self.num_nodes * self.num_processes > 1

    @override
    def _configure_launcher(self) -> None:
        # One process: no launcher. fork/spawn: Lightning's, also returning the privacy state.
        if not self._distributed:
            self._launcher = None
        elif self._start_method == "popen":
            super()._configure_launcher()
        else:
            self._launcher = _PrivacyStateLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        """Set up the device; the process group only with several processes."""
        if self._distributed:
            super().setup_environment()
            atexit.unregister(_destroy_process_group)  # once, however many fit/test calls set it up
            atexit.register(_destroy_process_group)
        else:
            Strategy.setup_environment(self)

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Check the configuration, move the model, build optimizers and the mechanism."""
        assert self.accelerator is not None and self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            _check_trainer(trainer)
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._distributed:
            _sync_module_states(self.model)  # replicas start identical; no DDP wrapper (see module doc)
        if fitting:
            _setup_optimizers(self, trainer)
            self._attach()
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _attach(self) -> None:
        world = self.num_nodes * self.num_processes
        where = Distribution(self.global_rank, world, dist.all_reduce if self._distributed else None)
        engine = self.private_step.attach(self.lightning_module, self.optimizers[0], where)
        if self.private_step.mechanism == "sign_vote":
            rank_zero_info(f"DPStrategy: DP-SignSGD majority vote over {world} worker(s), each adding its own noise")
        rank_zero_info(f"DPStrategy: per-example gradients by engine '{engine}'")

    @override
    def teardown(self) -> None:
        """Detach the engine's hooks, then Lightning's teardown."""
        self.private_step.detach()
        super().teardown()

    # ------------------------------------------------------------------ data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Rebuild the training loader around Poisson sampling (other stages untouched)."""
        trainer = self.lightning_module.trainer
        if trainer.state.fn != TrainerFn.FITTING or not _is_train_loader(trainer, dataloader):
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise PrivacyConfigurationError(
                f"DPStrategy needs a torch DataLoader for training, got {type(dataloader).__name__}."
            )
        if dataloader.batch_size is None and dataloader.batch_sampler is None:
            dataloader = _loader_before_sampler_injection(trainer, dataloader)
        loader = self.private_step.poisson_loader(dataloader, start_step=trainer.global_step)
        self._calibrate(trainer)
        return loader

    def _calibrate(self, trainer: "pl.Trainer") -> None:
        step = self.private_step
        if step.target_epsilon is None:
            step.calibrate(0)  # σ given: only the δ ≥ 1/N warning
            return
        planned = planned_steps(trainer, self.steps_per_epoch or 1)
        message = step.fit_target(trainer.global_step, planned)
        if message:
            rank_zero_info(f"DPStrategy: {message}")

    # ------------------------------------------------------------------ the private step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the user's ``training_step`` on the sampled examples, verified.

        The number of examples is the sampler's (:class:`RecordedBatches`), never read from
        the batch; the engine checks every layer against it. Before the first release the
        probe of :mod:`~lightning_dp.mechanism.validators.probe` runs once. A returned vector of
        per-example losses (shape ``[n]``) is averaged here.

        An empty Poisson batch: with one process the step is skipped (zero loss). With several,
        the other ranks run the user's step, which may hold collectives
        (``self.log(..., sync_dist=True)``): this rank runs it too, on a stand-in example whose
        gradient is discarded, so that every rank takes part in every collective. Its logged
        values have batch size 0 (they do not enter epoch means); an ``on_step`` value is that
        of the stand-in.
        """
        step = self.private_step
        indices = step.take()
        n = self._examples_this_step = len(indices)
        if self._over_budget:  # decided in optimizer_step: this step is not taken (nothing is computed)
            return None
        if not step.verified:
            self._verify()
        if n == 0:
            if not self._distributed:
                # Nothing to differentiate: the step still happens, its clipped sum is zero.
                step.begin(0)
                return torch.zeros((), device=self.root_device, requires_grad=True)
            args, kwargs = _with_batch(args, kwargs, self._collated([0]))
            n = 1
        limit = self.max_physical_batch_size
        if limit is not None and n > limit:
            # Physical batches are collated anew from the step's indices (any collate layout is split right).
            *heads, last = [indices[start:start + limit] for start in range(0, n, limit)]
            for head in heads:
                self._physical_step(len(head), *_with_batch(args, kwargs, self._collated(head)))
            args, kwargs, n = *_with_batch(args, kwargs, self._collated(last)), len(last)
        step.begin(n)
        return mean_loss(super().training_step(*args, **kwargs), n)

    def _physical_step(self, n: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward + backward one physical batch of n examples and bank its clipped sums (no noise yet)."""
        self.private_step.begin(n)
        loss = mean_loss(super().training_step(*args, **kwargs), n)
        loss = loss["loss"] if isinstance(loss, dict) else loss
        self.lightning_module.backward(loss)
        self.private_step.bank()

    def _verify(self) -> None:
        """The first step's probe (:mod:`~lightning_dp.mechanism.validators.probe`) on the user's ``training_step``."""
        module = self.lightning_module

        def loss_of(batch: Any) -> Any:
            with self.precision_plugin.train_step_context(), _silenced_logging(module):
                return module.training_step(batch, 0)

        low = "16" in str(module.trainer.precision)
        self.private_step.verify(loss_of, low_precision=low, to_device=self.batch_to_device, what="training_step")

    def _collated(self, indices: list[int]) -> Any:
        """The examples ``indices`` collated by the user's ``collate_fn`` and moved to the device."""
        return self.batch_to_device(self.private_step.examples(indices))

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[pl.LightningModule | nn.Module] = None,
        **kwargs: Any,
    ) -> Any:
        """Run the optimizer on the private gradient: the closure is wrapped to privatise.

        The ceiling: a step whose release would take ε past ``target_epsilon`` is not taken. The closure
        still runs (Lightning's loop and the sampler's queue advance; ``training_step`` returns nothing),
        the optimizer does not step, and training stops with a warning. Every rank decides alike."""
        trainer = self.lightning_module.trainer
        self._over_budget = not self.private_step.affordable(trainer.global_step)
        if self._over_budget:
            closure()
            trainer.should_stop = True
            rank_zero_warn(f"DPStrategy: step {trainer.global_step} would spend more than target_epsilon = "
                           f"{self.private_step.target_epsilon}: training stops here (nothing released).")
            return None
        private_closure = partial(self._private_closure, optimizer, closure)
        return super().optimizer_step(optimizer, private_closure, model, **kwargs)

    def _private_closure(self, optimizer: Optimizer, closure: Callable[[], Any]) -> Any:
        step = self.private_step
        step.expect_request(optimizer)
        loss = closure()
        step.release(self.lightning_module.trainer.global_step, optimizer, empty=self._examples_this_step == 0)
        return loss

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """Add the private step's state (ledger, σ, C, target, noise state) to the checkpoint, then write it."""
        checkpoint[_CHECKPOINT_KEY] = self.private_step.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read a checkpoint and restore the ledger, so spent budget is never forgotten."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        state = checkpoint.get(_CHECKPOINT_KEY)
        if state is not None:
            self.private_step.load_state_dict(state, keep_noise_multiplier=self._resume_changes(state))
        else:
            rank_zero_warn(
                f"Checkpoint {checkpoint_path} has no privacy ledger (not written by DPStrategy): "
                "the budget spent before it is unknown and NOT counted."
            )
        return checkpoint

    def _resume_changes(self, state: dict[str, Any]) -> bool:
        """Compare this run's privacy arguments with the checkpoint's: an error (``resume_privacy="strict"``),
        or a logged switch to the new σ and C (``"new"``). Returns whether the new values apply."""
        changes = self.private_step.changes_from(state, self._requested_sigma)
        if not changes:
            return False
        target_changed = any(c.startswith("target_") for c in changes)
        if self.resume_privacy == "strict" or target_changed:
            fix = ("A different target is refused: keep the checkpoint's target_epsilon/target_delta, or start a new "
                   "run." if target_changed else
                   "Pass the checkpoint's values to continue the same run, or DPStrategy(..., resume_privacy='new') "
                   "to apply the new ones from the resumed step on.")
            raise PrivacyConfigurationError("Resuming with privacy arguments that differ from the checkpoint's:\n- "
                                            + "\n- ".join(changes) + "\n" + fix)
        rank_zero_warn("DPStrategy: resumed with resume_privacy='new'; from this step on: " + "; ".join(changes)
                       + ". The ledger records each step's σ, so ε counts both parts exactly.")
        return True


REGISTERED_DEFAULTS: dict[str, float] = {"noise_multiplier": 1.0, "max_grad_norm": 1.0}
"""What ``Trainer(strategy="dp")`` builds: ``DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)`` (σ = 1 and C = 1,
Opacus' example defaults; pass a ``DPStrategy`` instance for anything else). Registered when Lightning and
``lightning_dp`` are both imported, in either order."""

StrategyRegistry.register(DPStrategy.strategy_name, DPStrategy, description="Differentially private training "
                          "(lightning_dp): per-example clipping, Gaussian noise, Poisson sampling",
                          override=True, **REGISTERED_DEFAULTS)


class _PrivacyStateLauncher(_MultiProcessingLauncher):
    """Lightning's fork/spawn launcher, also bringing rank 0's privacy state back.

    With ``start_method="fork"``/``"spawn"`` training runs in child processes and
    Lightning only returns rank 0's weights and metrics; without this the main process's
    ``strategy.ledger`` would stay empty after ``fit`` (ε spent would read as zero).
    """

    @override
    def get_extra_results(self, trainer: "pl.Trainer") -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        strategy = self._strategy
        assert isinstance(strategy, DPStrategy)
        state = strategy.private_step.state_dict()
        buffer = io.BytesIO()
        torch.save(state, buffer)  # bytes, like Lightning's metrics: no shared-memory tensors in the queue
        extra[_CHECKPOINT_KEY] = buffer.getvalue()
        return extra

    @override
    def update_main_process_results(self, trainer: "pl.Trainer", extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        if _CHECKPOINT_KEY in extra:
            assert isinstance(self._strategy, DPStrategy)
            state = torch.load(io.BytesIO(extra[_CHECKPOINT_KEY]), weights_only=False)
            self._strategy.private_step.load_state_dict(state)


def _with_batch(args: tuple[Any, ...], kwargs: dict[str, Any], batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args:
        return (batch, *args[1:]), kwargs
    return args, {**kwargs, "batch": batch}


@contextmanager
def _silenced_logging(module: "pl.LightningModule") -> Iterator[None]:
    """``self.log``/``self.log_dict`` do nothing while the probe runs the user's step (its values are not a step's)."""
    module.log = module.log_dict = lambda *a, **k: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict


def _make_noise(noise: Optional[Union[str, NoiseMechanism]], bands: int) -> NoiseMechanism:
    """The noise mechanism named by ``noise`` (see :class:`DPStrategy`)."""
    if isinstance(noise, NoiseMechanism):
        if bands != 1 and bands != getattr(noise, "bands", 1):
            raise ValueError(f"bands={bands} conflicts with the given noise mechanism ({noise!r})")
        return noise
    if noise in (None, "gaussian"):
        if bands != 1:
            raise ValueError(f"bands={bands} needs noise='banded' (independent Gaussian noise has one band)")
        return GaussianNoise()
    if noise == "banded":
        return BandedToeplitzNoise(bands)
    raise ValueError(f"noise must be 'gaussian', 'banded' or a NoiseMechanism, got {noise!r}")


_LIGHTNING_IMPLICIT_MAX_EPOCHS = 1000
"""Lightning's ``max_epochs`` when neither ``max_epochs`` nor ``max_steps`` is given (loops/utilities.py)."""


def _destroy_process_group() -> None:
    """Destroy the process group while the interpreter is still whole (an ``atexit`` handler).

    Lightning does this for NCCL only. A gloo group still alive when Python finalizes aborts a few
    percent of 2-process CPU runs ("terminate called without an active exception", exit 134): a
    gloo worker thread dropping the last reference to a finished collective's tensors asks for the
    GIL, and a thread asking for it during finalization is ended by a forced unwind through a
    ``noexcept`` destructor. Destroying is local; a no-op when the group is already gone.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def planned_steps(trainer: "pl.Trainer", steps_per_epoch: int) -> int:
    """Optimizer steps the trainer will take: ``max_steps`` or ``max_epochs`` × steps per epoch."""
    limit = trainer.limit_train_batches
    if isinstance(limit, int):
        steps_per_epoch = min(steps_per_epoch, limit)
    elif isinstance(limit, float) and limit < 1.0:
        steps_per_epoch = max(1, int(steps_per_epoch * limit))
    by_epochs = trainer.max_epochs * steps_per_epoch if trainer.max_epochs not in (None, -1) else None
    by_steps = trainer.max_steps if trainer.max_steps not in (None, -1) else None
    candidates = [s for s in (by_epochs, by_steps) if s is not None]
    if by_steps is None and trainer.max_epochs == _LIGHTNING_IMPLICIT_MAX_EPOCHS:
        raise PrivacyConfigurationError(
            f"target_epsilon needs a planned length, and Trainer(max_epochs={_LIGHTNING_IMPLICIT_MAX_EPOCHS}) is the "
            "value Lightning fills in when neither max_epochs nor max_steps is set: σ would be calibrated for "
            f"{_LIGHTNING_IMPLICIT_MAX_EPOCHS} epochs. Set Trainer(max_epochs=...) or Trainer(max_steps=...) (for "
            f"exactly {_LIGHTNING_IMPLICIT_MAX_EPOCHS} epochs, give max_steps={_LIGHTNING_IMPLICIT_MAX_EPOCHS} × steps "
            f"per epoch = {_LIGHTNING_IMPLICIT_MAX_EPOCHS * steps_per_epoch}).")
    if not candidates:
        raise PrivacyConfigurationError(
            "target_epsilon needs a planned length: set Trainer(max_steps=...) or Trainer(max_epochs=...)."
        )
    return int(min(candidates))


def _loader_before_sampler_injection(trainer: "pl.Trainer", dataloader: DataLoader) -> DataLoader:
    """The user's training loader as given. Lightning injects its ``DistributedSampler`` (a
    ``DPStrategy`` is a ``DDPStrategy``) before :meth:`DPStrategy.process_dataloader`, and for a
    loader built from a ``BatchSampler`` the rebuilt one has neither ``batch_size`` nor batch
    sampler: ask the fit loop's source for the original (the loader passed to ``fit``, or
    ``train_dataloader()`` called again)."""
    source = getattr(trainer.fit_loop, "_data_source", None)
    original = source.dataloader() if source is not None and source.is_defined() else None
    if isinstance(original, DataLoader):
        return original
    return dataloader


def _is_train_loader(trainer: "pl.Trainer", dataloader: object) -> bool:
    # Lightning processes the train loader in fit_loop.setup_data with stage TRAINING;
    # validation loaders come through here with SANITY_CHECKING or VALIDATING.
    return trainer.state.stage == RunningStage.TRAINING


def _check_noise_arguments(
    noise_multiplier: Optional[float], target_epsilon: Optional[float], target_delta: Optional[float]
) -> None:
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError("Give exactly one of noise_multiplier (σ) or target_epsilon (with target_delta).")
    if target_epsilon is not None:
        if not (math.isfinite(target_epsilon) and target_epsilon > 0):
            raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
        if target_delta is None or not 0 < target_delta < 1:
            raise ValueError(f"target_epsilon needs target_delta in (0, 1), got {target_delta!r}")


def _check_trainer(trainer: "pl.Trainer") -> None:
    module = trainer.lightning_module
    if not module.automatic_optimization:
        raise PrivacyConfigurationError(
            "DPStrategy supports automatic optimization only: remove `self.automatic_optimization = False` "
            "(the strategy must own backward, clipping and noise)."
        )
    if trainer.gradient_clip_val:
        raise PrivacyConfigurationError(
            f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) clips the batch gradient, not each example's: "
            "remove it and set DPStrategy(max_grad_norm=...) instead."
        )
    if trainer.accumulate_grad_batches != 1:
        raise PrivacyConfigurationError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) would add noise to each micro-batch "
            "and rescale per-example gradients before clipping: remove it and raise the DataLoader's batch_size "
            "(the expected Poisson batch) instead; DPStrategy(max_physical_batch_size=...) bounds the memory."
        )
    precision = str(trainer.precision)
    if precision not in _SUPPORTED_PRECISION:
        raise PrivacyConfigurationError(
            f"Trainer(precision={precision!r}) is not supported by DPStrategy: fp16 loss scaling rescales "
            "per-example gradients before clipping, and 'true' half precision adds noise in half precision. "
            "Use precision='32-true' or 'bf16-mixed' (autocast; clipping is computed in float32)."
        )


def _setup_optimizers(strategy: DPStrategy, trainer: "pl.Trainer") -> None:
    one_only = (
        "DPStrategy supports exactly one optimizer (one noise draw per step covers all parameters): "
        "put all parameter groups in one optimizer."
    )
    try:
        strategy.setup_optimizers(trainer)
    except RuntimeError as err:
        if "multiple optimizers" in str(err):
            raise PrivacyConfigurationError(f"configure_optimizers returned several optimizers. {one_only}") from err
        raise
    optimizers = strategy.optimizers
    if len(optimizers) != 1:
        raise PrivacyConfigurationError(f"configure_optimizers returned {len(optimizers)} optimizers. {one_only}")
    if isinstance(optimizers[0], torch.optim.LBFGS):
        raise PrivacyConfigurationError("LBFGS re-evaluates the closure: each evaluation would be a new release.")
