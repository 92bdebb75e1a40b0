"""One private step, Lightning-free: what ``DPStrategy``, a plain PyTorch loop and a sharded
strategy share. A reader audits the whole mechanism here.

Per logical step t (docs/algorithms.md, "The mechanism"):

    indices ← the Poisson sampler's batch (never read from the data)        :meth:`PrivateStep.take`
    S_t     = Σ_i clip_C(g_{t,i}), over one or more physical batches        :meth:`begin`, :meth:`bank`
    ĝ_t     = (S_t + σ C z_t) / B, noise once (one rank), into p.grad       :meth:`release`
    ledger += the rounds the noise mechanism charges for step t             (same call)

The release rule is a :class:`~lightning_dp.privacy.privatizer.StepPrivatizer`, chosen by the
optimizer's ``mechanism`` marker from :data:`PRIVATIZERS` (the noised mean, or DP-SignSGD's vote).
Before the first release :meth:`verify` runs the example-independence probe
(:mod:`~lightning_dp.validators.probe`); a release before it is refused.

Plain PyTorch (``examples/plain_pytorch.py``)::

    step = PrivateStep(noise_multiplier=1.0, max_grad_norm=1.0)
    step.attach(model, optimizer)
    loader = step.poisson_loader(DataLoader(dataset, batch_size=64))
    step.verify(lambda batch: F.cross_entropy(model(batch[0]), batch[1]))
    for x, y in loader:
        step.begin()
        F.cross_entropy(model(x), y).backward()
        step.release()                       # p.grad ← ĝ_t, ledger += 1
        optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol, Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_dp._lazy import lazy_exports
from lightning_dp.accounting import module_ledgers
from lightning_dp.accounting.module_ledgers import adoption_note, restore_note
from lightning_dp.accounting.ledger import PrivacyLedger
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.losses import loss_tensor, mean_loss  # noqa: F401  (the loss convention, where callers import it)
from lightning_dp.privacy.boundary import (
    ReleaseBoundary,
    attribute_keys,
    gradient_hooks,
)
from lightning_dp.clipping import ClippingPolicy, ClipRule, FlatClipping, as_rule
from lightning_dp.clipping.resolve import resolve_clipping, unit_refusal
from lightning_dp.accounting.budget_shortfall import SIGMA_RATIO_LIMIT, Shortfall, check_on_budget_short, too_noisy
from lightning_dp.records.collate import EmptySafeCollate, loader_like
from lightning_dp.records.fresh_randomness import FreshRandomness
from lightning_dp.records.stateless import FetchState
from lightning_dp.privacy.config import ExecutionConfig, PrivacyConfig
from lightning_dp.diagnostics import StepDiagnostics, diagnose, gathered
from lightning_dp.records.fetch import fetch, read_examples
from lightning_dp.mode_free import mode_free
from lightning_dp.performance.cpu_memory import retain_freed_memory
from lightning_dp.performance.fixed_batch import PaddedCollate, check_fixed_batch_size
from lightning_dp.engine_api import ClippedBatch, GradSampleEngine, make_engine, merge_clipped, select_engine
from lightning_dp.privacy.min_sep_sampling import MinSepPoissonBatchSampler, group_sample_rate, min_sep_steps_per_epoch
from lightning_dp.privacy.noise import NoiseMechanism
from lightning_dp.privacy.privatizer import Privatizer, StepPrivatizer, validate_privacy_params
from lightning_dp.release_reduce import flat_all_reduce
from lightning_dp.records.recorded_batches import RecordedBatches
from lightning_dp.privacy.release import DEFAULT_REQUEST, MechanismRequest, PrivateOptimizer, Release
from lightning_dp.privacy.user_sampling import UserPoissonBatchSampler
from lightning_dp.units import Users
from lightning_dp.validators import validate_module
from lightning_dp.validators.step_checks import StepChecks, mark_private
from lightning_dp.validators.layers import ATTACHED  # models with an engine attached (one at a time: hooks would mix)
from lightning_dp.validators.layers import sparse_optimizer_error
from lightning_dp.validators.loaders import TrainingPopulation, training_population
from lightning_dp.validators.mechanism_settings import mechanism_state
from lightning_dp.validators.plain_loop import PlainLoop, check_bound_loss
from lightning_dp.validators.schedule import VerificationSchedule
from lightning_dp.record_checks.records import check_records
from lightning_dp.record_checks.outside_records import records_exchanged
from lightning_dp.validators.finite_release import check_finite_release
from lightning_dp.validators.step_index import check_start_step, own_index, plan_to_keep

if TYPE_CHECKING:
    from lightning_dp.accounting.ceiling import EpsilonCeiling


class ShardLayout(Protocol):
    """Where FSDP2 keeps each parameter's shard, as the private step reads it (:class:`~lightning_dp.sharding.
    fsdp_layout.FSDPLayout`, whose sharded release rule registers itself in :data:`PRIVATIZERS`)."""

    def sharded_parameters(self) -> list[tuple[str, Tensor]]: ...

    def full_request(self, request: MechanismRequest) -> MechanismRequest: ...

AllReduce = Callable[[Tensor], None]


@dataclass(frozen=True)
class Distribution:
    """Where this process stands among the workers of one step.

    Attributes:
        rank: this process's rank (rank 0 adds the Gaussian noise).
        world_size: number of processes that each sample and clip their own shard.
        all_reduce: in-place SUM all-reduce of one tensor (``None`` with one process).
        layout: where the parameters live when FSDP2 shards them (``None``: replicated on every rank).
            Then each rank noises the shard it owns from its own stream, after a reduce-scatter of the
            clipped sums (:class:`~lightning_dp.sharding.privatizer.ShardedPrivatizer`).
    """

    rank: int = 0
    world_size: int = 1
    all_reduce: Optional[AllReduce] = None
    layout: Optional[ShardLayout] = None


@dataclass(frozen=True)
class SamplingPlan:
    """The sampling a run's accounting rests on.

    Attributes:
        num_samples: N, the population Poisson sampling draws from.
        expected_batch_size: B = world_size × the loader's batch size (the divisor of ĝ).
        sample_rate: q (the within-group rate q_g = bB/N with b-min-separation, b bands).
        steps_per_epoch: logical steps per epoch.
    """

    num_samples: int
    expected_batch_size: float
    sample_rate: float
    steps_per_epoch: int


def _gaussian(noise: NoiseMechanism, where: Distribution) -> StepPrivatizer:
    if where.layout is not None:  # FSDP2: each rank noises the rows it owns (registered by sharding/privatizer.py)
        return PRIVATIZERS["sharded"](noise, where)
    reduce = None if where.all_reduce is None else partial(flat_all_reduce, all_reduce=where.all_reduce)
    return Privatizer(noise, reduce=reduce, adds_noise=where.rank == 0)


PRIVATIZERS: dict[str, Callable[[NoiseMechanism, Distribution], StepPrivatizer]] = {"gaussian": _gaussian}
"""Release rules by the optimizer's ``mechanism`` marker (plain optimizers: ``"gaussian"``). DP-SignSGD's
``"sign_vote"`` registers itself when its optimizer is imported (:mod:`lightning_dp.sign_sgd.privatizer`), the
noised mean of sharded parameters (``"sharded"``, what ``"gaussian"`` uses under FSDP2) when the sharded strategy
imports :mod:`lightning_dp.sharding.privatizer`."""


class PrivateStep(StepChecks):
    """The private step of the module docstring, for one model and one noise mechanism.

    The keyword arguments are the fields of the two frozen configurations it keeps (:attr:`config`,
    :attr:`execution`; :mod:`~lightning_dp.privacy.config` documents each): ``noise_multiplier``, ``max_grad_norm``,
    ``noise`` (a :class:`~lightning_dp.privacy.noise.NoiseMechanism`), ``target_epsilon``, ``target_delta``,
    ``accountant``, ``sampler_seed``, ``secure_sampling`` (``secure_mode``), ``clipping``, ``privacy_unit``,
    ``public_state`` and ``on_budget_short`` are :class:`~lightning_dp.privacy.config.PrivacyConfig`'s; ``engine``,
    ``views_per_example``, ``fixed_batch_size``, ``verify``, ``verify_budget`` and ``retain_cpu_memory`` are
    :class:`~lightning_dp.privacy.config.ExecutionConfig`'s. A strategy builds both once and calls
    :meth:`from_config`. With ``fixed_batch_size`` the loader pads (:meth:`poisson_loader`) and :meth:`begin` takes
    the padding count (not with ``privacy_unit``: a padding row belongs to no user).

    The ledger continues the module's: :meth:`attach` adopts every release this process already made on the
    model (:mod:`~lightning_dp.accounting.module_ledgers`), and :meth:`load_state_dict` never shortens it.
    """

    def __init__(
        self,
        noise_multiplier: Optional[float],
        max_grad_norm: Optional[float],
        noise: NoiseMechanism,
        engine: str = "auto",
        target_epsilon: Optional[float] = None,
        target_delta: Optional[float] = None,
        accountant: str = "rdp",
        sampler_seed: Optional[int] = None,
        secure_sampling: bool = False,
        views_per_example: int = 1,
        public_state: Sequence[str] = (),
        verify: str = "sampled",
        verify_budget: float = 0.02,
        on_budget_short: str = "refuse",
        clipping: Optional[ClippingPolicy] = None,
        privacy_unit: Optional[Users] = None,
        fixed_batch_size: Optional[int] = None,
        retain_cpu_memory: bool = True,
    ) -> None:
        self.config = PrivacyConfig(
            noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, target_epsilon=target_epsilon,
            target_delta=target_delta, accountant=accountant, noise=noise, secure_mode=secure_sampling,
            sampler_seed=sampler_seed, clipping=clipping, privacy_unit=privacy_unit, public_state=tuple(public_state),
            on_budget_short=on_budget_short)
        """What the guarantee depends on (:class:`~lightning_dp.privacy.config.PrivacyConfig`), frozen: read, never
        written (σ calibrated from a target is state: :attr:`noise_multiplier`)."""
        self.execution = ExecutionConfig(engine=engine, views_per_example=views_per_example,
                                         fixed_batch_size=fixed_batch_size, verify=verify, verify_budget=verify_budget,
                                         retain_cpu_memory=retain_cpu_memory)
        """How the step runs (:class:`~lightning_dp.privacy.config.ExecutionConfig`), frozen."""
        self._configure(self.config, self.execution)

    @classmethod
    def from_config(cls, privacy: PrivacyConfig, execution: ExecutionConfig = ExecutionConfig()) -> "PrivateStep":
        """The private step of a configuration built once by a strategy (its keyword arguments), handed down unchanged.
        ``privacy.noise`` names the mechanism (:meth:`PrivacyConfig.noise_mechanism`)."""
        step = cls.__new__(cls)
        step.config, step.execution = privacy, execution
        step._configure(privacy, execution)
        return step

    def _configure(self, privacy: PrivacyConfig, execution: ExecutionConfig) -> None:
        """Everything the step holds, from the two frozen configurations."""
        noise_multiplier, engine = privacy.noise_multiplier, execution.engine
        secure_sampling, views_per_example = privacy.secure_mode, execution.views_per_example
        self.on_budget_short = check_on_budget_short(privacy.on_budget_short)
        self.clipping = resolve_clipping(privacy.max_grad_norm, privacy.clipping)
        """The clipping policy (:mod:`~lightning_dp.clipping`): C is its bound (:attr:`max_grad_norm`)."""
        if hasattr(self.clipping, "secure"):  # the adaptive policy's count noise, from the CSPRNG in secure mode
            self.clipping.secure = secure_sampling  # type: ignore[attr-defined]
        if privacy.privacy_unit is not None and not isinstance(privacy.privacy_unit, Users):
            raise TypeError(f"privacy_unit must be None (the example) or Users(...), got {privacy.privacy_unit!r}")
        self.users = privacy.privacy_unit
        """User-level DP (:class:`~lightning_dp.units.Users`), or ``None``: the example is the unit."""
        fixed = execution.fixed_batch_size
        self.fixed_batch_size = None if fixed is None else check_fixed_batch_size(fixed)
        if self.fixed_batch_size is not None and self.users is not None:
            raise ValueError("fixed_batch_size is not supported with privacy_unit=Users(...) (a padding row belongs to "
                             "no user, and physical batches are cut between users): use one of the two")
        self._padder: Optional[PaddedCollate] = None
        self._padding = 0  # padding rows of the physical batch begun last (fixed_batch_size)
        validate_privacy_params(noise_multiplier if noise_multiplier is not None else 1.0,
                                self.clipping.configured_bound)
        if engine != "auto":
            make_engine(engine)  # fail fast on an unknown name
        self.noise_multiplier = None if noise_multiplier is None else float(noise_multiplier)
        self.noise = privacy.noise_mechanism()
        self.engine_name = engine
        self._auto = engine == "auto"
        self.target_epsilon, self.target_delta, self.accountant = (privacy.target_epsilon, privacy.target_delta,
                                                                   privacy.accountant)
        self.sampler_seed, self.secure_sampling = privacy.sampler_seed, secure_sampling
        self.views_per_example = views_per_example
        self.ledger = PrivacyLedger()
        self.plan: Optional[SamplingPlan] = None
        self.distribution = Distribution()
        self.last_release: Optional[Release] = None
        self.diagnostics: Optional[StepDiagnostics] = None
        self.diagnostics_enabled = False
        self.steps_taken = 0
        self._engine: Optional[GradSampleEngine] = None
        self._module: Optional[nn.Module] = None
        self._privatizer: Optional[StepPrivatizer] = None
        self._mechanism = "gaussian"
        self._batches: Optional[RecordedBatches] = None
        self._source: Optional[tuple[Any, Callable[[list[Any]], Any]]] = None
        self._request: MechanismRequest = DEFAULT_REQUEST
        self._pending: Optional[ClippedBatch] = None
        self._groups: Optional[torch.Tensor] = None  # the units of the physical batch begun (user-level DP)
        self._examples = -1
        self._verified = False
        self._ceiling: Optional[EpsilonCeiling] = None  # target_epsilon's, built when first asked (_target)
        self.ceilings: list[Any] = []
        """Ceilings added to ``target_epsilon``'s (:class:`~lightning_dp.callbacks.PrivacyBudget`'s): each an
        :class:`~lightning_dp.accounting.ceiling.EpsilonCeiling`, asked before every release (:meth:`refusal`)."""
        self.adopted: Optional[str] = None
        """What the last :meth:`attach` adopted of the module's record, as a log line (``None``: nothing)."""
        self.fresh = FreshRandomness()  # randomness starts afresh each step, each record (records/fresh_randomness.py)
        self.boundary = ReleaseBoundary(privacy.public_state)
        """The release boundary (:mod:`~lightning_dp.privacy.boundary`): checked before every release."""
        self.schedule = VerificationSchedule(execution.verify, execution.verify_budget)
        """When the batch check runs (:mod:`~lightning_dp.validators.schedule`)."""
        self._random_step = False  # the first probe saw the step draw random numbers: batches are not comparable
        self._tolerance_low = False
        self._compute_dtype: Optional[torch.dtype] = None  # the lowest precision the first probe saw the forward use
        self._optimizer: Optional[Optimizer] = None
        self._parameters_checked = False  # the parameter set was checked this step (refresh_parameters)
        self._open_batch = False  # a physical batch began (begin) and was not banked or released yet
        self.loop = PlainLoop(partial(mechanism_state, self), partial(getattr, self.boundary, "public_state"),
                              partial(getattr, self, "examples_alone"), self.params, self.boundary.post_processed)
        """The step's drawn batch and what the loop does with it (:mod:`~lightning_dp.validators.plain_loop`)."""

    @property
    def max_grad_norm(self) -> float:
        """C now: the clipping policy's bound (the adaptive policy moves it after each release)."""
        return self.clipping.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        """Set C of flat clipping (a Trainer's ``gradient_clip_val`` taken as C); a policy keeps its own bound."""
        if not isinstance(self.clipping, FlatClipping):
            raise PrivacyConfigurationError(
                f"C comes from clipping={type(self.clipping).__name__}: it cannot be set to {value!r} from elsewhere "
                "(a Trainer's gradient_clip_val); give the bound in the policy only.")
        validate_privacy_params(1.0, float(value))
        self.clipping = FlatClipping(float(value))

    @property
    def unit(self) -> str:
        """What one ε protects: ``"example"`` or ``"user"``."""
        return "example" if self.users is None else "user"

    # ------------------------------------------------------------------ model
    def attach(self, module: nn.Module, optimizer: Optional[Optimizer] = None,
               distribution: Distribution = Distribution()) -> str:
        """Validate ``module``, attach the engine, choose the release rule; returns the engine's name.

        Raises :class:`PrivacyConfigurationError` naming every layer that cannot be trained privately."""
        if module in ATTACHED:
            raise PrivacyConfigurationError(
                f"{type(module).__name__} is already attached to another private step (a DPStrategy fit, a "
                "PrivateStep or a VirtualWorkersSignSGD that was not detached): two engines on one model capture "
                "each other's calls. Call detach() on the first (DPStrategy does at teardown) or use a copy.")
        problems = validate_module(module)
        if problems:
            raise PrivacyConfigurationError("The model cannot be trained privately:\n- " + "\n- ".join(problems))
        sparse = sparse_optimizer_error(optimizer, module)
        if sparse is not None:
            raise sparse
        if self.engine_name == "auto":
            try:
                self.engine_name = select_engine(module, self.views_per_example)
            except ValueError as err:  # said once: not chained to the same text
                raise PrivacyConfigurationError(str(err)) from None
        engine = self._engine_for(module, self.engine_name, distribution)
        self._mechanism = getattr(optimizer, "mechanism", "gaussian")
        if self._mechanism not in PRIVATIZERS:
            raise PrivacyConfigurationError(
                f"optimizer asks for mechanism {self._mechanism!r}; known: {sorted(PRIVATIZERS)}")
        self._refuse_combinations(distribution)
        self._privatizer = PRIVATIZERS[self._mechanism](self.noise, distribution)
        self.distribution = distribution
        hooks, keys = gradient_hooks([p for p in module.parameters() if p.requires_grad]), attribute_keys(module)
        if distribution.layout is not None:
            self.boundary.parameters = distribution.layout.sharded_parameters
        self.clipping.bind([name for name, p in module.named_parameters() if p.requires_grad])
        engine.attach(module)
        if self.execution.retain_cpu_memory and any(p.device.type == "cpu" for p in module.parameters()):
            retain_freed_memory()  # no page faults per step on CPU (performance/cpu_memory.py)
        ATTACHED.add(module)
        self._engine, self._module, self._optimizer = engine, module, optimizer
        self.boundary.attach(module, optimizer, hooks, keys, engine.owned_attributes)
        # the generators the model and the callbacks hold: forked by the checks, reseeded each step as the global ones
        self.fresh.watch(lambda: [m for m in (self._module,) if m is not None] + list(self.boundary.callbacks()))
        self.adopted = self.adopt(module)
        return engine.name

    def _refuse_combinations(self, where: Distribution) -> None:
        """The clipping policy's and the privacy unit's refusals of this run's settings, before any release."""
        settings = dict(sharded=where.layout is not None, mechanism=self._mechanism, bands=self.bands,
                        second_moment=False, users=self.users is not None)
        reason = self.clipping.refusal(**settings) or unit_refusal(self.users, **settings)
        if reason:
            raise PrivacyConfigurationError(reason + ".")

    def adopt(self, module: nn.Module) -> Optional[str]:
        """Continue ``module``'s record (:mod:`~lightning_dp.accounting.module_ledgers`): the ledger becomes every
        release this process made on the module (or a part of it) and every one it held, and charges the
        module's later releases. Returns a log line when it grew (``None``: it already held them all)."""
        record = module_ledgers.record_of(module)
        before = self.ledger.steps
        note = None
        if record is not None and record is not self.ledger:
            combined = module_ledgers.combine(self.ledger, record)
            if combined.added:
                self.ledger.load_state_dict(combined.ledger.state_dict())
                self.ledger.unit = getattr(record, "unit", "example")  # what the adopted releases protect
                self._ceiling = None
                note = adoption_note(before, record.steps, self.ledger.steps, combined.diverged)
        module_ledgers.bind(module, self.ledger)
        return note

    def _engine_for(self, module: nn.Module, name: str, distribution: Distribution) -> GradSampleEngine:
        """A fresh engine ``name`` set up for ``module`` (not attached); refuses a model it cannot serve."""
        engine = make_engine(name)
        if self.views_per_example > 1 and not engine.supports_views:
            raise PrivacyConfigurationError(
                f"engine '{engine.name}' cannot take {self.views_per_example} rows as one example (augmentation "
                "multiplicity): use per_sample='auto', 'vmap' or 'opacus_hooks'.")
        engine.views_per_example = self.views_per_example
        if self.fixed_batch_size is not None and not engine.supports_padding:
            raise PrivacyConfigurationError(
                f"engine '{engine.name}' cannot clip padded batches (fixed_batch_size): use per_sample='auto', "
                "'ghost', 'vmap' or 'opacus_hooks'.")
        if distribution.layout is not None and hasattr(engine, "stream_sums"):
            engine.stream_sums = True  # the sharded privatizer reads one parameter's sum at a time
        problems = [f"engine '{engine.name}' cannot serve layer {what}" for what in engine.unsupported_layers(module)]
        if problems:
            raise PrivacyConfigurationError(
                "The model cannot be trained privately:\n- " + "\n- ".join(problems)
                + "\nUse per_sample='auto' (it picks an engine that serves every layer), or change the layers named.")
        return engine

    def _switch_engine(self, name: str) -> None:
        """Replace the attached engine by a fresh engine ``name`` (auto's next choice after a refused probe)."""
        assert self._engine is not None and self._module is not None
        engine = self._engine_for(self._module, name, self.distribution)
        self.clipping.bind([n for n, p in self._module.named_parameters() if p.requires_grad])
        self.discard_noise()
        self._engine.detach()
        hooks = gradient_hooks([p for p in self._module.parameters() if p.requires_grad])
        keys = attribute_keys(self._module)
        engine.attach(self._module)
        self._engine, self.engine_name = engine, name
        self.boundary.attach(self._module, self._optimizer, hooks, keys, engine.owned_attributes)

    def refresh_parameters(self) -> bool:
        """Re-attach the engine when the trainable parameters changed since :meth:`attach` (their identities or
        names: a pruning callback, a finetuning callback unfreezing layers); the probe must then pass again before
        the next release (:attr:`verified` turns False). Returns whether they changed. The model is validated
        again first: a change no engine serves is refused here."""
        if self._module is None:
            return False
        if not self.boundary.parameters_changed():
            self._parameters_checked = True  # for this step (until its release); a change is checked again at the
            return False                     # next begin(), however its re-attachment ended (a refusal, a toggle back)
        problems = validate_module(self._module)
        if problems:
            raise PrivacyConfigurationError("The model's trainable parameters changed during training and it can no "
                                            "longer be trained privately:\n- " + "\n- ".join(problems))
        self._switch_engine(self.engine_name)
        self._verified = False
        return True

    def detach(self) -> None:
        """Remove the engine's hooks from the model; drop the noise drawn ahead and join its worker."""
        for noise in {id(n): n for n in (self.noise, getattr(self._privatizer, "noise", None))
                      if isinstance(n, NoiseMechanism)}.values():
            noise.close()
        if self._engine is not None:
            self._engine.detach()
            self._engine = None
            ATTACHED.discard(self._module)
        self.boundary.detach()
        self.loop.forget()
        if self._module is not None:
            module_ledgers.unbind(self._module, self.ledger)

    @property
    def mechanism(self) -> str:
        """The release rule in use (a key of :data:`PRIVATIZERS`)."""
        return self._mechanism

    def params(self) -> list[nn.Parameter]:
        """The trainable parameters of the attached model, in the engine's order."""
        assert self._module is not None, "attach() first"
        return [p for p in self._module.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ data
    def poisson_loader(self, dataloader: DataLoader, start_step: Optional[int] = None,
                       batches_per_step: int = 1) -> DataLoader:
        """``dataloader`` rebuilt around Poisson sampling of its population (one shard per rank); the plan (q, N, B) is
        its, whatever state was or is restored. Its sampler defines the population (:func:`training_population` refuses
        the ones Poisson sampling cannot stand in for); ``batches_per_step`` × its ``batch_size`` (gradient
        accumulation) is the expected batch per process. Each pass starts a banded group cycle at the ledger's count
        (``start_step``, if given, must be it: :mod:`~lightning_dp.validators.step_index`). The records it draws are
        checked first
        (:func:`~lightning_dp.record_checks.records.check_records`: a fixed record per index, each once)."""
        where, first = self.distribution, check_start_step(self, start_step)
        self.fresh.start()  # the base seed, before any record is read
        population = training_population(dataloader, where.rank, where.world_size, batches_per_step)
        fetches = FetchState(dataloader.dataset, dataloader.collate_fn, records_exchanged).noted()  # before any read
        check_records(dataloader.dataset, population.indices, population.num_samples, users=self.users)
        self._check_ledger_unit()
        seed = None if self.sampler_seed is None else self.sampler_seed + where.rank
        sampler: Any
        if self.users is not None:
            sampler = self._user_sampler(dataloader.dataset, population, seed)
        else:
            self.plan = self._plan(population)
            sampler = MinSepPoissonBatchSampler(population.num_samples, self.plan.sample_rate,
                                                self.plan.steps_per_epoch, self.bands, where.rank, where.world_size,
                                                seed, self.secure_sampling)
        sampler.step = first
        self.check_ranks_agree(population, sampler)  # one mechanism on every rank (validators/rank_agreement.py)
        self._batches = RecordedBatches(sampler, population.indices, lambda: self.steps_taken)
        dl = self.training_loader = dataloader
        collate: Callable[[list[Any]], Any] = EmptySafeCollate(dl.dataset, dl.collate_fn)
        if self.fixed_batch_size is not None:  # every batch of n ≤ F examples arrives padded to F rows
            collate = self._padder = PaddedCollate(dl.dataset, self.fixed_batch_size, dl.collate_fn)
        self._source = (dl.dataset, dl.collate_fn or EmptySafeCollate(dl.dataset).collate_fn)
        self.boundary.datasets = lambda: [dl.dataset]  # a record written in place is refused (kept_state.py)
        self.boundary.new_datasets()
        return loader_like(dl, self._batches, collate, fetches, self.fresh)

    def _user_sampler(self, dataset: Any, population: TrainingPopulation,
                      seed: Optional[int]) -> UserPoissonBatchSampler:
        """User-level DP: the plan over users (N = n_users, B = k) and the sampler of users
        (:mod:`~lightning_dp.units`); the ledger then counts releases per user."""
        assert self.users is not None
        positions = population.indices if population.indices is not None else range(population.num_samples)
        members = self.users.partition(dataset, positions)
        k, n = self.users.users_per_batch, len(members)
        if k > n:
            raise PrivacyConfigurationError(f"Users(users_per_batch={k}) exceeds the {n} users of the training data: "
                                            "lower users_per_batch.")
        rate = k / n
        self.plan = SamplingPlan(n, float(k), rate, min_sep_steps_per_epoch(rate, 1))
        where = self.distribution
        return UserPoissonBatchSampler(members, rate, self.plan.steps_per_epoch, where.rank, where.world_size, seed,
                                       self.secure_sampling, self.users.max_examples_per_user)

    def groups_of(self, indices: Sequence[int]) -> Optional[torch.Tensor]:
        """The units of a batch's records (user-level DP; ``None``: every example its own unit)."""
        return None if self.users is None else self.users.groups_of(indices)

    def _plan(self, population: TrainingPopulation) -> SamplingPlan:
        n, world = population.num_samples, self.distribution.world_size
        expected = population.batch_size * world
        if expected > n:
            raise PrivacyConfigurationError(
                f"Expected global batch {expected} (= {world} processes × batch_size {population.batch_size}) "
                f"exceeds the number of training examples {n}: lower batch_size.")
        # Poisson sampling is the b = 1 case of b-min-separated participation (q_g = bB/N).
        try:
            rate = group_sample_rate(expected, n, self.bands)
        except ValueError as err:
            raise PrivacyConfigurationError(str(err)) from err
        return SamplingPlan(n, float(expected), rate, min_sep_steps_per_epoch(rate, self.bands))

    @property
    def bands(self) -> int:
        """b of the noise mechanism (1: independent noise, plain Poisson sampling)."""
        return int(getattr(self.noise, "bands", 1))

    def take(self) -> list[int]:
        """The dataset indices of the batch being trained on now (the sampler's record)."""
        if self._batches is None:
            raise RuntimeError("the training loader was not rebuilt by poisson_loader()")
        indices = self._batches.take(delivered=self.loop.plain)
        self.loop.drawn(indices, self._batches.batch, self._pending is not None)
        if self.loop.plain:
            self.loop.step_begins(self.schedule.due)
        return indices

    def padded_examples(self, indices: Sequence[int], padding: int) -> Any:
        """The examples ``indices`` and ``padding`` padding records after them, collated by the user's ``collate_fn``
        (fixed-shape batches: :mod:`~lightning_dp.performance.fixed_batch`)."""
        assert self._source is not None and self._padder is not None, "poisson_loader() with fixed_batch_size first"
        dataset, collate = self._source
        return collate(list(fetch(dataset, indices)) + self._padder.padding(padding))

    def examples(self, indices: Sequence[int], fixed: bool = False) -> Any:
        """The examples ``indices`` read as the loader's fetcher reads them (the dataset's ``__getitems__``
        when it has one, :func:`~lightning_dp.records.fetch.fetch`) and collated by the user's ``collate_fn``
        (on the CPU).

        ``fixed``: example i is read with torch's, NumPy's and Python's generators seeded by i (states restored
        after), so a randomly augmented dataset gives example i the same views alone and in any batch: the probe
        then compares like with like and verifies the views' layout too. A dataset with a ``__getitems__`` of its
        own reads a batch in one call, as the loader does (a batch-level read is what the probe must see);
        randomness it draws is then the step's own (the probe notices and says so)."""
        assert self._source is not None, "poisson_loader() first"
        return read_examples(*self._source, indices, fixed)

    # ------------------------------------------------------------------ calibration
    def calibrate(self, planned_steps: int) -> Optional[float]:
        """σ for ``target_epsilon`` at ``target_delta`` over ``planned_steps`` (if σ was not given);
        returns the σ set now, or ``None`` when nothing was calibrated."""
        assert self.plan is not None, "poisson_loader() first"
        self._warn_large_delta()
        if self.target_epsilon is None or self.noise_multiplier is not None:
            return None
        sigma = self._sigma_for(planned_steps)
        validate_privacy_params(sigma, self.max_grad_norm)
        self.noise_multiplier = float(sigma)
        return self.noise_multiplier

    def _warn_large_delta(self) -> None:
        assert self.plan is not None
        if self.target_delta is not None and self.target_delta >= 1.0 / self.plan.num_samples \
                and self.distribution.rank == 0:
            warnings.warn(f"target_delta={self.target_delta} is not below 1/N = {1.0 / self.plan.num_samples:.3g}: a "
                          "mechanism that publishes one random example outright satisfies such a δ. Use δ ≪ 1/N "
                          "(e.g. N^-1.1).", stacklevel=3)

    def _sigma_for(self, planned_steps: int) -> float:
        """σ_plan: the σ ``target_epsilon`` needs for ``planned_steps`` steps on a fresh ledger."""
        from lightning_dp.accounting import calibrate_noise
        from lightning_dp.accounting.banded import calibrate_banded_noise

        assert self.plan is not None and self.target_epsilon is not None and self.target_delta is not None
        q = self.plan.sample_rate
        if self.bands == 1:
            return calibrate_noise(self.target_epsilon, self.target_delta, q, planned_steps, self.accountant)
        return calibrate_banded_noise(self.target_epsilon, self.target_delta, q, planned_steps, self.bands,
                                      self.accountant)

    def fit_target(self, first_step: int, planned_steps: int) -> Optional[str]:
        """Make steps ``first_step`` … ``planned_steps − 1`` fit ``target_epsilon`` after what the ledger has
        spent; returns one log line saying what was done (``None``: nothing to say).

        A fresh ledger calibrates σ for the plan. Otherwise (a resumed run, or a module whose earlier fits the
        ledger continues) the run's σ is kept if the rest of the plan fits; if not, σ* is the smallest σ with
        ε(ledger + remaining rounds at σ) ≤ target (spent steps counted exactly). σ* within 3× of the run's σ is
        applied; beyond that, or when no σ fits, :class:`PrivacyConfigurationError` is raised before any
        release unless ``on_budget_short="recalibrate"`` (:mod:`~lightning_dp.accounting.budget_shortfall`).
        Either way the ceiling (:meth:`refusal`) refuses any release beyond the target afterwards."""
        if self.target_epsilon is None:
            return None
        assert self.plan is not None and self.target_delta is not None
        if self.noise_multiplier is None and (not self.ledger.steps or not self.ledger.is_private):
            sigma = self.calibrate(planned_steps)
            return (f"σ = {sigma:.4f} calibrated for ε = {self.target_epsilon} at δ = {self.target_delta} over "
                    f"{planned_steps} steps with q = {self.plan.sample_rate:.5g} ({self.accountant} accountant)")
        if not self.ledger.is_private:
            return None  # the noiseless baseline: ε = ∞ already (warned), no guarantee to keep (see affordable)
        rounds = sum(self.rounds_at(t) for t in range(first_step, planned_steps))
        ceiling = self._target()
        if self.noise_multiplier is not None and ceiling.allows(self.noise_multiplier, self.plan.sample_rate, rounds):
            return None
        return self._fit_spent(first_step, planned_steps, rounds)

    def _fit_spent(self, first_step: int, planned_steps: int, rounds: int) -> str:
        """σ* for the plan's remaining ``rounds`` after the ledger, applied or refused (:meth:`fit_target`)."""
        assert self.plan is not None and self.target_epsilon is not None and self.target_delta is not None
        from lightning_dp.accounting.calibration import smallest_sigma
        from lightning_dp.accounting.epsilon import ledger_epsilon
        from lightning_dp.accounting.ledger import LedgerEntry

        old, q, spent = self.noise_multiplier, self.plan.sample_rate, tuple(self.ledger.entries)
        if old is None:
            self._warn_large_delta()  # calibrate()'s warning, for a σ calibrated after a continued record
        run_sigma = next(e.noise_multiplier for e in reversed(spent) if e.private)
        reference = max(run_sigma, self._sigma_for(max(planned_steps, 1)))
        if rounds == 0:  # nothing left to train in this plan: σ only for what the strategy reports
            self.noise_multiplier = old if old is not None else reference
            return f"the plan's steps are all taken ({self.ledger.steps} releases in the ledger)"
        try:
            sigma: Optional[float] = smallest_sigma(
                lambda s: ledger_epsilon(spent + (LedgerEntry(s, q, rounds),), self.target_delta, self.accountant),
                self.target_epsilon, start=old or reference)
        except ValueError:
            sigma = None
        if too_noisy(sigma, reference, self.on_budget_short):
            raise self._shortfall(first_step, planned_steps - first_step, run_sigma, sigma, reference).error()
        assert sigma is not None
        validate_privacy_params(sigma, self.max_grad_norm)
        self.noise_multiplier = float(sigma)
        done = (f"the plan's remaining {planned_steps - first_step} steps and the {self.ledger.steps} spent stay "
                f"within ε = {self.target_epsilon} at δ = {self.target_delta} ({self.accountant} accountant)")
        if sigma > SIGMA_RATIO_LIMIT * reference:
            done += f"; {sigma / reference:.1f}× the run's σ, as on_budget_short='recalibrate' asks"
        if old is None:
            return f"σ = {sigma:.4f} calibrated so that {done}"
        return f"σ recalibrated {old:.4f} → {sigma:.4f} so that {done}"

    def _shortfall(self, first_step: int, remaining: int, run_sigma: float, needed: Optional[float],
                   reference: float) -> Shortfall:
        ceiling = self._target()
        assert self.plan is not None and self.target_epsilon is not None and self.target_delta is not None
        spent, hint = ceiling.spent(), max(2, self.plan.steps_per_epoch)
        affordable = ceiling.rounds_left(run_sigma, self.plan.sample_rate, hint)
        return Shortfall(spent, self.target_epsilon, self.target_delta, self.accountant, self.ledger.steps,
                         first_step, remaining, run_sigma, affordable, needed, reference)

    def _target(self) -> "EpsilonCeiling":
        """``target_epsilon``'s ceiling at ``target_delta`` by the run's accountant over the ledger
        (:class:`~lightning_dp.accounting.ceiling.EpsilonCeiling`); built again when the target changed or the
        ledger was replaced (restored, adopted: ``_ceiling`` is dropped there)."""
        from lightning_dp.accounting.ceiling import EpsilonCeiling

        assert self.target_epsilon is not None and self.target_delta is not None
        held = self._ceiling
        if held is None or (held.target_epsilon, held.delta, held.accountant) != (
                self.target_epsilon, self.target_delta, self.accountant):
            held = self._ceiling = EpsilonCeiling(self.target_epsilon, self.target_delta, self.ledger, self.accountant)
        return held

    def affordable(self, step: Optional[int] = None) -> bool:
        """Whether releasing step ``step`` keeps ε within ``target_epsilon`` (always, without a target, and in a
        run already declared non-private: the noiseless research baseline's ledger is ε = ∞ from its first
        release, with a warning, and has no guarantee to protect)."""
        if self.target_epsilon is None or self.noise_multiplier is None or self.plan is None:
            return True
        index = own_index(self, step, "affordable")
        return not self.ledger.is_private or self._target().allows(self.noise_multiplier, self.plan.sample_rate,
                                                                   self.rounds_at(index))

    def refusal(self, step: Optional[int] = None) -> Optional[str]:
        """Why step ``step`` must not be released now (``None``: it may): the reason of the first ceiling that
        refuses it, ``target_epsilon``'s (:meth:`affordable`) then every one in :attr:`ceilings`, each asked with
        the (σ, q) in force now, those of the release itself, and the rounds it charges (docs/accounting.md)."""
        rounds = self.rounds_at(own_index(self, step, "refusal"))
        if self.noise_multiplier is None or self.plan is None or not rounds:  # no round: nothing spent
            return None
        sigma, q = self.noise_multiplier, self.plan.sample_rate
        own = [self._target()] if self.target_epsilon is not None and self.ledger.is_private else []
        for ceiling in own + list(self.ceilings):
            reason = ceiling.refusal(sigma, q, rounds) if hasattr(ceiling, "refusal") else ceiling(sigma, q)
            if reason:
                self.discard_noise()  # not released: the noise drawn ahead for it goes too
                return reason
        return None

    @property
    def release_guards(self) -> list[Any]:
        """:attr:`ceilings`, by its former name (a plain function (σ, q) → reason is asked too)."""
        return self.ceilings

    def discard_noise(self) -> None:
        """Drop the noise drawn ahead for the next release (:mod:`~lightning_dp.performance.noise_prefetch`): called
        wherever a step will not be released (refused, unaffordable, raised) or the next release's tensors change
        (parameter set, engine, restored state), so a draw made for one release is never used by another."""
        mechanisms = [self.noise, getattr(self._privatizer, "noise", None)]
        for noise in {id(n): n for n in mechanisms if isinstance(n, NoiseMechanism)}.values():
            noise.discard_prefetched()

    def check_kept(self, where: str, skip: tuple[str, ...] = ()) -> None:
        """:meth:`ReleaseBoundary.check_kept` (kept state against the last update's), on every rank alike."""
        self.on_every_rank(lambda: self.boundary.check_kept(where, skip=skip), f"found state changed {where}")

    def pause_boundary(self, where: str) -> None:
        """Validation starts: :meth:`ReleaseBoundary.pause`, on every rank alike (and the state written since the
        last release compared with the training data's statistics: validation's logged values are released)."""
        self.on_every_rank(lambda: self.boundary.pause(where), f"found state changed {where}")
        self.check_written_statistics(f"as validation starts, {where}", full=True)

    @property
    def verified(self) -> bool:
        """Whether :meth:`verify` has passed in this process."""
        return self._verified

    def begin(self, num_examples: Optional[int] = None, indices: Optional[Sequence[int]] = None,
              stand_in: bool = False, padding: int = 0) -> int:
        """Start a (physical) batch of ``num_examples`` (default: :meth:`take` the sampler's next batch; a count without
        ``indices`` takes it too and must be its count; physical batches are unused parts of it:
        :mod:`~lightning_dp.validators.plain_loop`), followed by
        ``padding`` padding rows (fixed-shape batches: clip factor 0, not counted); every hooked layer is checked
        against the n + padding rows. Returns the count of examples. User-level DP: ``indices`` are the batch's
        records, whose users are clipped together (default: the batch taken); a count without them is refused
        unless ``stand_in`` (a stand-in example whose gradient is discarded). Padding is refused with user-level
        DP (a padding row belongs to no user)."""
        assert self._engine is not None, "attach() first"
        if self._open_batch:  # the last physical batch was neither banked nor released: its step raised
            self.discard_noise()
            self.loop.abandon()
        self.fresh.step(self.steps_taken)  # once per step index: its randomness independent of earlier data
        self.boundary.step_begins()
        if not self._parameters_checked and self.refresh_parameters():
            if num_examples is None and self._batches is not None:
                self.take()  # the batch handed for this step goes with it: the next begin() takes the next one
            raise PrivacyConfigurationError(
                "The model's trainable parameters changed since verify() (their identities or names): the engine was "
                "re-attached; call verify(...) again before the next release.")
        if padding < 0 or (padding and self.users is not None):
            raise ValueError(f"padding must be a count >= 0 of padding rows, and none under user-level DP; got "
                             f"{padding!r}")
        if self.users is not None and indices is None and num_examples and not stand_in:
            raise RuntimeError("user-level DP: begin(n, indices) needs the batch's records, whose users are clipped "
                               "together (begin() takes them from the sampler)")
        if num_examples is None or (self._batches is not None and self.loop.takes(num_examples, indices, stand_in)):
            taken = self.take()  # a count without records: the loader's next batch, which it must be
            indices = taken if num_examples is None else indices
        n = len(indices) if num_examples is None and indices is not None else num_examples
        assert n is not None
        units = None if self.users is None or indices is None else self.users.units_of(indices)
        self.loop.physical(n, indices, stand_in, padding, units)  # an unused part of the drawn batch, users whole
        self._groups = None if indices is None or n == 0 else self.groups_of(indices)
        self._engine.begin_step(n + padding)
        self._examples, self._padding = n, padding
        self._open_batch = True
        return n

    def expect_request(self, optimizer: Optional[Optimizer]) -> MechanismRequest:
        """Ask the optimizer what the coming release must include (before its forward pass). Under sharding
        a scale (scale-then-privatize) is gathered to full size: the engine scales whole per-example gradients."""
        request = optimizer.mechanism_request() if isinstance(optimizer, PrivateOptimizer) else DEFAULT_REQUEST
        if self.distribution.layout is not None:
            request = self.distribution.layout.full_request(request)
        self._request = request
        self._pending = None
        return self._request

    def discard(self) -> None:
        """Drop what the engine captured since :meth:`begin` (a stand-in pass run only to join collectives)."""
        assert self._engine is not None, "attach() first"
        self._engine.begin_step(None)
        self._open_batch = False

    def bank(self) -> None:
        """Clip and sum the physical batch just differentiated; held until :meth:`release` (no noise yet)."""
        self.loop.check_bank()  # never a stand-in's
        part = self._clipped()
        self._pending = part if self._pending is None else merge_clipped(self._pending, part)
        self._open_batch = False

    @mode_free  # clipping, noise and division are torch's, whatever modes the user entered (mode_free.py)
    def _clipped(self, max_grad_norm: Optional[float] = None,
                 params: Optional[list[nn.Parameter]] = None) -> ClippedBatch:
        assert self._engine is not None
        request = self._request
        rule = as_rule(max_grad_norm) if max_grad_norm is not None else ClipRule(self.clipping, self._groups)
        if request.second_moment and not rule.is_flat_per_example:
            reason = self.clipping.refusal(sharded=False, mechanism="gaussian", bands=1, second_moment=True,
                                           users=self.users is not None) \
                or unit_refusal(self.users, sharded=False, mechanism="gaussian", bands=1, second_moment=True)
            if reason:
                raise PrivacyConfigurationError(reason + ". Nothing was released.")
        self._engine.padding_rows = self._padding  # only around this call: the probe's and checks' batches hold none
        try:
            return self._engine.clip_and_sum(self.params() if params is None else params, rule, request.scale,
                                             request.second_moment)
        finally:
            self._engine.padding_rows, self._padding = 0, 0

    def clipped_sums(self, max_grad_norm: Optional[float] = None,
                     params: Optional[list[nn.Parameter]] = None) -> ClippedBatch:
        """S = Σ_i clip_C(g_i) of the examples differentiated since :meth:`begin` (banked parts included),
        before any noise: what :meth:`release` privatises, and what release rules run outside it take (the
        caller privatises it and charges :attr:`ledger`): :class:`~lightning_dp.optim.sign_sgd.VirtualWorkersSignSGD`'s
        workers.
        ``max_grad_norm`` overrides C (``math.inf``: unclipped, only for non-private baselines); ``params``: the
        trainable parameters (:meth:`params`) when the caller has them already (one module walk per step).
        Refused before :meth:`verify`/:meth:`verify_on` has passed, like :meth:`release`."""
        if not self._verified:
            raise RuntimeError("call verify() or verify_on() before taking clipped sums: the probe checks the "
                               "assumptions the guarantee rests on")
        batch = self._clipped(max_grad_norm, params)
        self._open_batch = False
        if self._pending is not None:
            batch, self._pending = merge_clipped(self._pending, batch), None
        return batch

    @mode_free
    def release(self, step: Optional[int] = None, optimizer: Optional[Optimizer] = None,
                empty: bool = False) -> Release:
        """Privatise the clipped sums of this logical step into ``p.grad`` and charge the ledger.

        Args:
            step: the release's index, if given: it must be :attr:`steps_taken` (:mod:`~.validators.step_index`).
            optimizer: receives the release when it is a
                :class:`~lightning_dp.privacy.release.PrivateOptimizer`.
            empty: this rank's batch was empty and a stand-in example was differentiated so that it
                takes part in collectives: its gradient is discarded (zero sums).
        """
        if self._privatizer is None or self.plan is None:
            raise RuntimeError("the mechanism is not set up: attach() and poisson_loader() first")
        if not self._verified:
            raise RuntimeError("call verify(loss_of_batch) before the first release: the probe checks the "
                               "assumptions the guarantee rests on")
        if self.noise_multiplier is None:
            raise RuntimeError("σ is not known: give noise_multiplier or call calibrate() first")
        index = own_index(self, step, drawn=True)
        refused = self.refusal(index)
        if refused:
            self._pending = None
            raise PrivacyConfigurationError(
                f"step {index}: {refused}: not released. Stop when refusal() gives a reason (DPStrategy does).")
        self.loop.check_release(empty, params := self.params())  # a batch the loader drew, released once
        self._open_batch = False
        try:
            return self._release(index, optimizer, empty, params)
        except BaseException:
            self.discard_noise()  # a release that raised leaves no draw for the next one
            raise

    def _release(self, index: int, optimizer: Optional[Optimizer], empty: bool, params: list[nn.Parameter]) -> Release:
        """:meth:`release` once it may release step ``index``: the boundary's checks, the clipped sums, the noise,
        the ledger."""
        assert self._module is not None and self._privatizer is not None and self.plan is not None
        assert self.noise_multiplier is not None
        target = optimizer if optimizer is not None else self._optimizer
        mark_private(target)  # its steps are releases (records/outside_steps.py), as attach()'s optimizer's are
        named = self.boundary.trainable()  # listed once a release, as the parameters (release())
        batch = self.clipped_sums(params=params)  # this physical batch merged with the step's earlier ones
        self.on_every_rank(lambda: (self.boundary.check_release(target, named),
                                    check_finite_release(batch, params, self.engine_name)), "refused its release")
        self.check_written_statistics(f"before the release of step {index}")  # written since the last one
        if empty:
            batch = _zero_clipped_batch(batch)
        elif self.loop.plain:
            check_bound_loss(self, batch.norms, params)  # the loop's loss is the one verified
        request, expected = self._request, self.plan.expected_batch_size
        if request.second_moment and self.bands > 1:
            raise PrivacyConfigurationError("independent_moments draws noise twice per step; banded noise streams one "
                                            "draw per step: use noise='gaussian' with this variant.")
        if self.diagnostics_enabled:
            self.diagnostics = self._diagnose(batch, params)
        sigma = self.clipping.gradient_noise_multiplier(self.noise_multiplier, expected)
        release = self._privatizer.privatize(batch, params, request, sigma, self.max_grad_norm, expected)
        self.boundary.released(params, named)  # the optimizer must step with exactly this (boundary rule 2)
        where = self.distribution
        self.clipping.after_release(batch.norms, expected, self.noise_multiplier, where.all_reduce, where.rank,
                                    where.world_size)
        rounds = self.rounds_at(index)
        self.ledger.record(self.noise_multiplier, self.plan.sample_rate, steps=rounds, private=not request.clean_mean)
        self.steps_taken = index + 1
        self._parameters_checked = False
        self.last_release = release
        self.loop.after_release(target)
        if isinstance(optimizer, PrivateOptimizer):
            optimizer.observe_release(release)
        return release

    def rounds_at(self, step: int) -> int:
        """Sampled-Gaussian rounds step ``step`` charges: the noise mechanism's (banded: one per cycle of
        b steps); DP-SignSGD's workers always 1."""
        return 1 if self._mechanism == "sign_vote" else self.noise.rounds_at(step)

    def _diagnose(self, batch: ClippedBatch, params: list[nn.Parameter]) -> StepDiagnostics:
        assert self.plan is not None
        diagnostics = diagnose(batch, params, self.plan.expected_batch_size, self.max_grad_norm)  # before the noise
        if self.distribution.all_reduce is not None:
            flat_all_reduce(list(diagnostics.clean_mean.values()), self.distribution.all_reduce)
            diagnostics = gathered(diagnostics)  # norms, clip fraction: every rank's examples
        return diagnostics

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The privacy state a resumed run must continue from (never the noise RNG)."""
        plan = self.plan
        return {
            "ledger": self.ledger.state_dict(),
            "noise_multiplier": self.noise_multiplier,
            "noise": self.noise.state_dict(),
            "max_grad_norm": self.clipping.configured_bound,
            "clipping": self.clipping.state_dict(),
            "privacy_unit": self.unit,
            "target_epsilon": self.target_epsilon,
            "target_delta": self.target_delta,
            "accountant": self.accountant,
            "steps_taken": self.steps_taken,
            "sample_rate": None if plan is None else plan.sample_rate,
            "expected_batch_size": None if plan is None else plan.expected_batch_size,
            "num_samples": None if plan is None else plan.num_samples,
            "steps_per_epoch": None if plan is None else plan.steps_per_epoch,
        }

    def load_state_dict(self, state: Mapping[str, Any], keep_noise_multiplier: bool = False) -> Optional[str]:
        """Restore :meth:`state_dict` (``keep_noise_multiplier``: this run's σ stays, see :meth:`changes_from`). The
        ledger never goes backwards: combined with the one held (``module_ledgers.combine``), a restored prefix
        keeps the longer record, a different history is counted with it. The release count continues (the loader's
        next pass starts there); a built loader's plan (q, N, B) stays (:mod:`~lightning_dp.validators.step_index`).
        Returns a log line when the restored ledger did not simply extend the one held (``None``: it did)."""
        restored = PrivacyLedger()
        restored.load_state_dict(state["ledger"])
        combined = module_ledgers.combine(restored, self.ledger)
        self.ledger.load_state_dict(combined.ledger.state_dict())
        note = None if not combined.added else restore_note(restored.steps, self.ledger.steps, combined.diverged)
        self._ceiling = None
        if state.get("noise_multiplier") is not None and not keep_noise_multiplier:
            self.noise_multiplier = float(state["noise_multiplier"])
        self.noise.load_state_dict(state.get("noise", {}))
        if state.get("privacy_unit", "example") != self.unit:
            raise PrivacyConfigurationError(
                f"the checkpoint accounted its releases per {state.get('privacy_unit', 'example')}, this run per "
                f"{self.unit}: resume with the checkpoint's privacy_unit.")
        if "clipping" in state:
            self.clipping.load_state_dict(state["clipping"])
        self.discard_noise()  # never a draw made before the restore
        self.steps_taken = int(state.get("steps_taken", self.steps_taken))
        if plan_to_keep(self, state):  # the loader's plan stays once it is built (what it draws is what is charged)
            self.plan = SamplingPlan(int(state["num_samples"]), float(state["expected_batch_size"]),
                                     float(state["sample_rate"]), int(state["steps_per_epoch"]))
        return note

    def changes_from(self, state: Mapping[str, Any], requested_sigma: Optional[float]) -> list[str]:
        """The privacy arguments of this run that differ from a checkpoint's, one line each."""
        def differs(new: Optional[float], old: Optional[float]) -> bool:
            return new is not None and old is not None and not math.isclose(float(new), float(old), rel_tol=1e-9)

        return [f"{label}: checkpoint {old}, this run {new}" for label, new, old in (
            ("noise_multiplier (σ)", requested_sigma, state.get("noise_multiplier")),
            ("max_grad_norm (C)", self.clipping.configured_bound, state.get("max_grad_norm")),
            ("target_epsilon", self.target_epsilon, state.get("target_epsilon")),
            ("target_delta", self.target_delta, state.get("target_delta")),
        ) if differs(new, old)]


def _zero_clipped_batch(batch: ClippedBatch) -> ClippedBatch:
    zeros = {p: torch.zeros_like(s) for p, s in batch.sums.items()}
    squares = None if batch.square_sums is None else {p: torch.zeros_like(s) for p, s in batch.square_sums.items()}
    return ClippedBatch(zeros, squares, batch.norms[:0], 0)


__getattr__ = lazy_exports(__name__, {
    "BatchInteractionCheck": "lightning_dp.validators.batch_check",
    "ExampleIndependenceProbe": "lightning_dp.validators.probe", "PROBE_EXAMPLES": "lightning_dp.validators.probe",
    "SecureGaussianNoise": "lightning_dp.privacy.csprng", "SignVotePrivatizer": "lightning_dp.sign_sgd.privatizer",
    "StateSnapshot": "lightning_dp.validators.snapshot",
    "StateWriteError": "lightning_dp.validators.probe", "_first_line": "lightning_dp.validators.step_checks",
    "_headline": "lightning_dp.validators.step_checks", "batch_tolerance": "lightning_dp.tolerance",
    "engines_after": "lightning_dp.engine_api", "forked_rngs": "lightning_dp.validators.rng",
    "probe_tolerance": "lightning_dp.validators.probe", "reads_per_index": "lightning_dp.records.fetch",
    "reseed": "lightning_dp.records.fetch", "seeded": "lightning_dp.records.fetch",
    "state_written_error": "lightning_dp.privacy.boundary"
})
"""Names this module held before they moved (read access by the old name; new code imports their homes)."""
