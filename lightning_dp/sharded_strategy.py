"""DPShardedStrategy: private training of models sharded by FSDP2, on Lightning's ``ModelParallelStrategy``.

The same mechanism as :class:`~lightning_dp.strategy.DPStrategy` (docs/algorithms.md, "The mechanism"),
with parameters, gradients and optimizer state sharded over the ranks instead of replicated:

    each rank         Poisson-samples its own examples; forward + backward on the all-gathered
                      (unsharded) layers; the ghost engine clips each example with its
                      whole-model norm and sums: S^(rank), full-size
    reduce-scatter    S[R_r] = Σ_ranks S^(rank)[R_r], rank r's rows R_r of every parameter
    rank r            ĝ[R_r] = (S[R_r] + σ C z^(r)) / B, its own noise stream: every coordinate noised once
    optimizer         steps on the sharded parameters with the sharded ĝ (its state is sharded alike)

FSDP2's own gradient reduce-scatter is switched off and autograd's gradients of the unsharded
parameters are discarded (:class:`~lightning_dp.sharding.fsdp_layout.FSDPLayout`): nothing
non-private is communicated. The Lightning hooks (data, step, ceiling, checkpoints) are
:class:`~lightning_dp._strategy_glue.PrivateTraining`, shared with ``DPStrategy``; this file adds how a
sharded model is set up and which :class:`~lightning_dp.privacy.private_step.Distribution` it gets.

The user's LightningModule shards itself in ``configure_model`` as Lightning documents::

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)
"""

from __future__ import annotations

import atexit
import os
import tempfile
from datetime import timedelta
from typing import Any, Literal, Optional, Sequence, Union

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout
from pytorch_lightning.strategies import ModelParallelStrategy, StrategyRegistry
from pytorch_lightning.strategies.launchers.multiprocessing import _WorkerOutput
from pytorch_lightning.trainer.states import TrainerFn
from typing_extensions import override

from lightning_dp._strategy_glue import (
    REGISTERED_ARGUMENTS,
    PrivacyStateLauncher,
    PrivateTraining,
    check_optimizers,
    check_trainer,
    destroy_process_group,
    one_optimizer_expected,
)
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.privacy.config import ExecutionConfig, PrivacyConfig
from lightning_dp.privacy.noise import NoiseMechanism
from lightning_dp.grad_sample.fsdp_support import engine_problems
from lightning_dp.sharding.fsdp_layout import FSDPLayout
import lightning_dp.sharding.privatizer  # noqa: F401  (registers the sharded release rule with the private step)
from lightning_dp.privacy.private_step import Distribution

__all__ = ["DPShardedStrategy"]


class DPShardedStrategy(PrivateTraining, ModelParallelStrategy):
    """``DPStrategy``'s guarantee for a model sharded by FSDP2 (``fully_shard`` in ``configure_model``).

    Parameters, gradients and optimizer state are sharded over ``data_parallel_size`` processes; each
    process samples, clips (whole-model per-example norms, ghost clipping) and noises the coordinates
    it owns (module docstring). The privacy arguments and their meaning are ``DPStrategy``'s.

    Args:
        noise_multiplier: σ; the noise std is σ·C. Give this or ``target_epsilon``.
        max_grad_norm: C, the per-example clipping norm (not given: the Trainer's ``gradient_clip_val``, else 1.0;
            as ``DPStrategy``).
        target_epsilon: calibrate σ before the first step so that the planned run spends at most this ε.
        target_delta: δ for calibration.
        accountant: accountant used for calibration (see :mod:`lightning_dp.accounting`).
        per_sample: ``"auto"`` or ``"ghost"``: sharded parameters are served by the ghost engine only.
        max_physical_batch_size: split larger Poisson batches into physical batches of at most this many
            examples (noise still once per logical step).
        noise: ``"gaussian"`` (default) or a :class:`~lightning_dp.privacy.noise.NoiseMechanism` with a
            ``for_rank(rank)`` method returning that rank's independent stream. Banded noise is not
            supported yet.
        sampler_seed: seed of the Poisson sampler (tests only; rank r uses ``sampler_seed + r``).
        secure_mode: noise and sampling from the OS's CSPRNG (as ``DPStrategy``).
        resume_privacy: ``"strict"`` or ``"new"``, as ``DPStrategy``.
        on_budget_short: ``"refuse"`` or ``"recalibrate"``, as ``DPStrategy``.
        augmentation_multiplicity: 1 only (K > 1 needs an engine that does not run on sharded parameters).
        clipping, privacy_unit: ``None`` only: clipping policies and user-level DP (``DPStrategy``'s) are refused here
            by name (they need per-parameter or per-user norms the sharded privatizer's streamed sums do not give).
        public_state: names of state declared public, as ``DPStrategy``.
        verify, verify_budget: as ``DPStrategy`` (the later batch checks do not run on sharded parameters yet:
            the first step's probe does).
        data_parallel_size: processes the model is sharded over (default: all of them). Tensor
            parallelism is not supported.
        save_distributed_checkpoint: each rank writes its shard (default), or rank 0 writes one file.
            Either way the privacy ledger travels in the checkpoint.
        process_group_backend: torch.distributed backend (default per device: gloo on CPU).
        timeout: timeout of the process group's collectives.
        start_method: how the processes start: "popen" (default: Lightning re-runs the script per rank),
            "fork" or "spawn" (in-process; the ledger and the full weights come back to the caller).

    Example:
        >>> trainer = pl.Trainer(strategy=DPShardedStrategy(noise_multiplier=1.0, max_grad_norm=1.0),
        ...                      accelerator="cpu", devices=2, max_epochs=5)  # doctest: +SKIP
    """

    label = "DPShardedStrategy"
    strategy_name = "dp_sharded"

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
        noise: Optional[Union[str, NoiseMechanism]] = None,
        sampler_seed: Optional[int] = None,
        secure_mode: bool = False,
        resume_privacy: Literal["strict", "new"] = "strict",
        augmentation_multiplicity: int = 1,
        public_state: Sequence[str] = (),
        verify: Literal["first_step", "sampled", "every_step"] = "sampled",
        verify_budget: float = 0.02,
        on_budget_short: Literal["refuse", "recalibrate"] = "refuse",
        clipping: Optional[Any] = None,
        privacy_unit: Optional[Any] = None,
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        if per_sample not in ("auto", "ghost"):
            raise PrivacyConfigurationError(
                f"DPShardedStrategy(per_sample={per_sample!r}): sharded parameters are served by the ghost engine "
                "only (its norms come from each layer's activations and output gradients, which FSDP2 keeps "
                "full-size). Use per_sample='auto' or 'ghost', or DPStrategy for the other engines.")
        if augmentation_multiplicity != 1:
            raise PrivacyConfigurationError(
                f"DPShardedStrategy(augmentation_multiplicity={augmentation_multiplicity}): several views per example "
                "need the vmap or opacus_hooks engine, which do not run on sharded parameters. Use DPStrategy.")
        if noise == "banded" or getattr(noise, "bands", 1) > 1:
            raise PrivacyConfigurationError(
                "DPShardedStrategy does not support banded (correlated) noise yet: its history would be kept and "
                "checkpointed per shard. Use noise='gaussian' (the default) or DPStrategy(noise='banded').")
        if clipping is not None or privacy_unit is not None:
            raise PrivacyConfigurationError(
                f"DPShardedStrategy({'clipping' if clipping is not None else 'privacy_unit'}=...): clipping policies "
                "and user-level DP need per-parameter or per-user norms that the sharded privatizer's streamed sums do "
                "not give. Use DPStrategy with them, or flat clipping (max_grad_norm) here.")
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method must be 'popen', 'spawn', 'fork' or 'forkserver', got {start_method!r}")
        self._init_privacy(
            PrivacyConfig(
                noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, target_epsilon=target_epsilon,
                target_delta=target_delta, accountant=accountant, noise=noise, secure_mode=secure_mode,
                sampler_seed=sampler_seed, public_state=public_state, on_budget_short=on_budget_short),
            ExecutionConfig(engine="ghost", max_physical_batch_size=max_physical_batch_size, verify=verify,
                            verify_budget=verify_budget),
            resume_privacy,
        )
        self._start_method = start_method
        self.layout: Optional[FSDPLayout] = None
        """Where FSDP2 keeps the parameters (set up with the model)."""

    def __repr__(self) -> str:
        step = self.private_step
        sigma = step.noise_multiplier if step.noise_multiplier is not None else f"target ε={step.target_epsilon}"
        return f"DPShardedStrategy(noise_multiplier={sigma}, max_grad_norm={step.max_grad_norm}) built on {pl.__name__}"

    # ------------------------------------------------------------------ processes
    @override
    def _configure_launcher(self) -> None:
        if self._start_method == "popen" or self.num_processes <= 1:
            super()._configure_launcher()
        else:
            self._launcher = _ShardedStateLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        """The process group and the 1-D data-parallel mesh (every process shards the model)."""
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
        atexit.unregister(destroy_process_group)  # once, however many fit/test calls set it up
        atexit.register(destroy_process_group)

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Check the configuration, shard and place the model (Lightning), then seal FSDP2's gradient
        reduction and attach the mechanism to the sharded layout."""
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            check_trainer(trainer, self.label)
        with one_optimizer_expected(self.label):
            super().setup(trainer)
        if not fitting:
            return
        check_optimizers(self.optimizers, self.label, self.lightning_module)
        self.layout = FSDPLayout(self.lightning_module, engine_problems)
        self.layout.seal()  # before any forward: FSDP2 never reduce-scatters an autograd gradient
        all_reduce = dist.all_reduce if self._distributed else None
        self._attach(Distribution(self.global_rank, self.world_size, all_reduce, layout=self.layout))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The shared private step (:class:`~lightning_dp._strategy_glue.PrivateTraining`), begun from the
        sharded state: a validation forward leaves FSDP2's root parameters gathered (:meth:`FSDPLayout.reshard`)."""
        if self.layout is not None:
            self.layout.reshard()
        return super().training_step(*args, **kwargs)

    def _physical_batches_in_lockstep(self, count: int) -> int:
        """The largest number of physical batches over the ranks: FSDP2 all-gathers in every forward and
        backward, so every rank runs as many (the extra ones on a stand-in example whose gradient is dropped)."""
        if not self._distributed:
            return count
        most = torch.tensor([count], dtype=torch.int64, device=self.root_device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most.item())

    @override
    def teardown(self) -> None:
        """Remove the layout's forward hook, then the shared teardown (engine detached, Lightning's)."""
        if self.layout is not None:
            self.layout.unseal()
        super().teardown()


class _ShardedStateLauncher(PrivacyStateLauncher):
    """fork/spawn for the sharded strategy: rank 0's privacy state and the *full* weights come back
    (gathered from the shards by every rank; Lightning's launcher would send rank 0's shards)."""

    @override
    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Optional[_WorkerOutput]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None) if callback is not None else None
        full = get_model_state_dict(self._strategy.model, options=StateDictOptions(full_state_dict=True,
                                                                                    cpu_offload=True))
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(full, weights_path)
        return _WorkerOutput(best, weights_path, trainer.state, results, self.get_extra_results(trainer))


StrategyRegistry.register(DPShardedStrategy.strategy_name, DPShardedStrategy,
                          description="Differentially private training of FSDP2-sharded models (lightning_dp)",
                          override=True, **REGISTERED_ARGUMENTS)
"""``Trainer(strategy="dp_sharded")``: ``DPShardedStrategy(noise_multiplier=1.0, max_grad_norm=1.0)``, the same
documented defaults as ``strategy="dp"``; registered with it, whichever package the user imports first."""
