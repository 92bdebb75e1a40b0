"""The verification half of :class:`~lightning_dp.privacy.private_step.PrivateStep`: the first step's probe, the
hooks' replay and the batch check, run on the user's model before a release (docs/verification.md).

:class:`StepChecks` is a base class of ``PrivateStep`` and works on its state: the attached module and engine
(``_module``, ``_engine``), the release boundary (``boundary``), where the process stands (``distribution``), the
sampling (``plan``, ``_batches``, ``examples``), the schedule of later checks (``schedule``) and the refusals every
rank shares (``on_every_rank``, ``_refused_anywhere``). It decides nothing about the release itself: a check that
fails raises :class:`~lightning_dp.errors.PrivacyConfigurationError` before any release, and ``PrivateStep.release``
refuses to run until :meth:`StepChecks.verify` (or :meth:`StepChecks.verify_on`) has passed.
"""

from __future__ import annotations

import copy
import time
import warnings
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.losses import loss_tensor
from lightning_dp.engine_api import engines_after
from lightning_dp.validators.batch_check import FIRST_DRAWS, LATER_DRAWS, BatchInteractionCheck, batch_tolerance
from lightning_dp.records.constructed_batches import label_batch, largest_batch
from lightning_dp.records.collate import held_records
from lightning_dp.records.empty_records import holding_data
from lightning_dp.record_checks.holders import code_holders
from lightning_dp.record_checks.outside_records import ExchangedRecords, exchanged_copy, training_copies
from lightning_dp.record_checks.released_transforms import uncharged_transforms, uncharged_transforms_error
from lightning_dp.validators.diagnostic_reads import moved as diagnostics_moved
from lightning_dp.record_statistics.data_statistics import data_statistics_error, data_statistics_held
from lightning_dp.record_statistics.training_statistics import TrainingStatistics
from lightning_dp.record_statistics.written_statistics import WrittenStatistics
from lightning_dp.record_statistics.public_overlap import check_public_steps
from lightning_dp.validators.held_vocabulary import loader_holders, vocabulary_error, vocabulary_held
from lightning_dp.validators.outside_fits import outside_fit_error, outside_fits_held, warn_pretrained_outside
from lightning_dp.validators.packed_records import warn_packed_records
from lightning_dp.records.outside_steps import mark_private
from lightning_dp.fingerprints.callback_state import is_datamodule
from lightning_dp.validators import logger_outputs
from lightning_dp.validators.lazy_caches import empty_slots, filled_alike
from lightning_dp.validators.probe import (PROBE_EXAMPLES, ExampleIndependenceProbe, StateWriteError, StepFailedError,
                                           frozen_parameters, probe_tolerance, state_mutation_error)
from lightning_dp.validators.rank_agreement import (check_ranks_agree, differing_release_values, disagreement_error,
                                                    release_agreement, release_values)
from lightning_dp.validators.rng import forked_rngs
from lightning_dp.validators.schedule import VerificationSchedule
from lightning_dp.validators.snapshot import StateSnapshot
from lightning_dp.validators.steered_settings import schedulers


class StepChecks:
    """The checks a :class:`~lightning_dp.privacy.private_step.PrivateStep` runs on the user's step before a
    release (see the module's docstring for the state it reads)."""

    training_loader: Any = None
    """The user's training loader (:meth:`poisson_loader`'s argument)."""

    probe_writes: Sequence[str] = ()
    """What the first step's probe found ``training_step`` writing to kept state other than parameters (a step
    counter), left to the replays of the batch hooks to judge (:meth:`verify_on`'s ``replay_hooks``)."""

    @property
    def examples_alone(self) -> bool:
        """Every example is differentiated alone (physical batches of one: ``max_physical_batch_size=1`` in the frozen
        execution configuration, and the example is the privacy unit): examples cannot interact, so the probe does not
        compare batch with alone and no batch check runs. Derived, read-only, and verified: a physical batch of more
        than one example is refused (:meth:`~lightning_dp.validators.plain_loop.PlainLoop.physical`)."""
        execution = getattr(self, "execution", None)
        return getattr(execution, "max_physical_batch_size", None) == 1 and getattr(self, "users", None) is None

    @property
    def schedule(self) -> VerificationSchedule:
        """When the batch check runs (:mod:`~lightning_dp.validators.schedule`), from the execution configuration's
        ``verify`` and ``verify_budget``."""
        return self._schedule

    @schedule.setter
    def schedule(self, schedule: VerificationSchedule) -> None:
        """Replace the schedule (a test's own clock): never by one that checks less than the configuration asks."""
        execution = getattr(self, "execution", None)
        if execution is not None and not schedule.at_least(execution.verify, execution.verify_budget):
            raise PrivacyConfigurationError(
                f"a verification schedule ({schedule.mode!r}, budget {schedule.budget}) that checks less than the "
                f"step's configuration (verify={execution.verify!r}, verify_budget={execution.verify_budget}): give "
                "verify/verify_budget to the step instead.")
        self._schedule = schedule

    # ------------------------------------------------------------------ the first step's probe
    def verify(self, loss_of_batch: Callable[[Any], Any], low_precision: bool = False,
               to_device: Callable[[Any], Any] = lambda batch: batch, what: str = "the loss function",
               replay_hooks: Optional[Callable[[Any], None]] = None) -> None:
        """The first step's probe on fixed, public examples (the first of this rank's shard):
        example independence, no summed loss, every use of every parameter captured.

        Args:
            loss_of_batch: the user's forward and loss on a batch: the mean loss, a vector of
                per-example losses (:func:`mean_loss`), or a dict holding either under ``"loss"``.
            low_precision: looser tolerance for autocast runs.
            to_device: moves a collated batch where the model is.
            what: how errors name ``loss_of_batch`` (e.g. ``"training_step"``).
            replay_hooks: runs the hooks a training loop calls around a step (batch start and end) on a batch, so
                that state they keep from it is refused before the first release (see :meth:`verify_on`); called
                with the probe's examples and with the first half of them (a hyper-parameter set apart by the two is
                set from the data).
        """
        assert self.plan is not None and self._batches is not None, "poisson_loader() first"
        self._refuse_data_statistics()
        where = self.distribution
        if hasattr(self._batches.inner, "first_positions"):  # users (user_sampling.py): two records of the first users
            indices = self._batches.positions(self._batches.inner.first_positions(PROBE_EXAMPLES))
        else:  # the first that hold data: an unreadable record the collate drops (None) is no example (zoo28 d02)
            indices = holding_data(self._source[0], self._batches.first_indices(
                4 * PROBE_EXAMPLES, self.plan.num_samples, where.rank, where.world_size), PROBE_EXAMPLES)
        replay = None if replay_hooks is None else (
            lambda idx: replay_hooks(to_device(self.examples(idx, fixed=True)),  # noqa: E731
                                     to_device(self.examples(idx[: max(1, len(idx) // 2)], fixed=True))))
        exchanged = None if replay_hooks is not None else (  # a plain loop's lazy fields judged on other values too
            lambda idx: loss_of_batch(to_device(exchanged_copy(self.examples(idx, fixed=True)))))  # noqa: E731
        self.verify_on(lambda idx: loss_of_batch(to_device(self.examples(idx, fixed=True))), indices,
                       low_precision, what, replay, exchanged)
        self.loop.bind_loss(lambda batch: loss_of_batch(to_device(batch)), what)  # plain_loop.py

    def _refuse_data_statistics(self) -> None:
        """Rule 11 of the release boundary: neither the model nor a LightningDataModule keeps a statistic of the
        training data, nor are its features standardised with their own (:mod:`.data_statistics`), nor do they keep
        a vocabulary built from the training records holding an item of one record (:mod:`.held_vocabulary`)."""
        assert self._source is not None and self._module is not None
        trainer = getattr(self._module, "_trainer", None)  # (the optimizers and schedulers: a mean kept as
        holders = [("model", self._module)] + [("datamodule", cb) for cb in self.boundary.callbacks()  # self.mu)
                                               if is_datamodule(cb)] \
            + code_holders(getattr(trainer, "optimizers", None) or (), schedulers(trainer))
        loader = getattr(self, "training_loader", None)  # what it holds (a collator's tokenizer) is looked in too
        charged = {e.run for e in self.ledger.entries if e.run}  # DP releases this fit's ledger counts pass
        kept: list[TrainingStatistics] = []
        found = data_statistics_held(holders, self._source[0], self.boundary.public_state, loader, charged, kept)
        if found:
            raise data_statistics_error(found)
        self._watch_written_statistics(kept[0] if kept else None, holders)
        found = uncharged_transforms(self._source[0], charged, getattr(self, "secure_sampling", False))
        if found:  # features a DP preprocessor computed, its release charged elsewhere (:mod:`.released_transforms`)
            raise uncharged_transforms_error(found)
        found = vocabulary_held(holders + loader_holders(loader), self._source[0], self.boundary.public_state)
        if found:
            raise vocabulary_error(found)
        optimizer = getattr(self, "_optimizer", None)
        found = outside_fits_held(self._module, optimizer, [holders[0], *((type(cb).__name__, cb) for cb in
                                  self.boundary.callbacks() if not is_datamodule(cb)), *holders[1:]],
                                  self.boundary.public_state)
        if found:  # models fitted in this process outside the mechanism (:mod:`.outside_fits`)
            raise outside_fit_error(found)
        warn_pretrained_outside(self._module, optimizer)  # its own weights stepped outside it first
        check_public_steps(self._module.parameters(), self._source[0])  # "public" steps on the training records
        warn_packed_records(self._module, self._source[0], loader)  # several documents per record (group_texts)

    written_statistics: Optional[WrittenStatistics] = None
    """What the user's state holds that equals a statistic of the training data, compared where it changes during the
    fit (:mod:`~lightning_dp.record_statistics.written_statistics`: before each release, as validation starts,
    before a checkpoint and at the fit's end)."""

    def _watch_written_statistics(self, statistics: Optional[TrainingStatistics],
                                  holders: Sequence[tuple[str, Any]]) -> None:
        """Keep rule 11's statistics for the fit: the state the hooks write later is compared with them."""
        self.written_statistics = self.boundary.on_update = None
        if statistics is None or self._module is None:
            return
        boundary, module = self.boundary, self._module

        def owners() -> list[tuple[str, Any]]:
            callbacks = boundary.untrusted_callbacks()
            labels = [type(cb).__name__ for cb in callbacks]
            return [*holders, *((label if labels.count(label) == 1 else f"{label}[{i}]", cb)
                                for i, (label, cb) in enumerate(zip(labels, callbacks)) if not is_datamodule(cb))]

        attached = getattr(self, "_optimizer", None)

        def optimizers() -> list[Any]:  # the released one and the attached one (each once: a wrapper unwrapped)
            found = [getattr(o, "_optimizer", o) for o in (boundary.watched, attached) if o is not None]
            return list({id(o): o for o in found}.values())

        watch = WrittenStatistics(statistics, owners, module, optimizers, clean=holders)
        self.written_statistics, boundary.on_update = watch, watch.note_update

    def forget_written_statistics(self) -> None:
        """The fit is over (its end judged, or it failed): the statistics of the training data and the training tensors
        they hold (:class:`~lightning_dp.record_statistics.training_statistics.TrainingStatistics`: the tensors, their
        sorted copies, principal directions) are released now, not kept until the next fit's first probe."""
        watch, self.written_statistics = self.written_statistics, None
        if watch is not None and self.boundary.on_update == watch.note_update:
            self.boundary.on_update = None

    def check_written_statistics(self, where: str, full: bool = False) -> None:
        """:meth:`WrittenStatistics.check` (none kept: nothing), on every rank alike; ``full``: every statistic and
        the optimizers' state too (validation's start, a checkpoint, the fit's end)."""
        watch = self.written_statistics
        if watch is not None:
            self.on_every_rank(lambda: watch.check(where, optimizers=full, full=full),
                               f"found a statistic of the data {where}")

    def verify_on(self, loss_of_examples: Callable[[list[int]], Any], indices: Sequence[int],
                  low_precision: bool = False, what: str = "the loss function",
                  replay_hooks: Optional[Callable[[list[int]], None]] = None,
                  loss_of_exchanged: Optional[Callable[[list[int]], Any]] = None) -> None:
        """:meth:`verify` on examples the caller reads itself: ``loss_of_examples(idx)`` is the loss of the
        examples ``idx`` (a list of ``indices``' entries) in one batch. For loops without :meth:`poisson_loader`
        (e.g. :class:`~lightning_dp.optim.sign_sgd.VirtualWorkersSignSGD`'s in-memory workers).

        After the probe, ``replay_hooks(indices)`` (if given) runs the loop's batch hooks on these examples: a change
        of the fingerprinted state it makes (a memory bank filled in ``on_train_batch_end``) is refused now, before
        the first release, rather than at the next release; what ``training_step`` writes to kept state other than a
        parameter is then left by the probe to the replay to judge (:attr:`probe_writes`: a counter every data writes
        alike is kept). Everything the probe and the replay wrote is restored
        afterwards (:class:`~lightning_dp.privacy.boundary.StateSnapshot`): they leave no trace.

        Without ``replay_hooks`` (a plain loop), a slot the probe's passes filled that was empty before
        (:func:`~.lazy_caches.empty_slots`: Hugging Face's ``config.problem_type``) is judged by running the loss again
        on these examples, on half of them and (``loss_of_exchanged``) on them exchanged
        (:func:`~.lazy_caches.filled_alike`): filled alike, it is filled so before the first release; set apart by
        the data, refused."""
        assert self._engine is not None and self._module is not None, "attach() first"
        self.refresh_parameters()  # type: ignore[attr-defined]  # (a layer replaced, requires_grad set back: re-attached)
        mark_private(getattr(self, "_optimizer", None))  # its steps from now on are releases (records/outside_steps)
        named = [(name, p) for name, p in self._module.named_parameters() if p.requires_grad]
        self.boundary.check_hooks(named)

        def loss_of(idx: list[int]) -> Tensor:
            return loss_tensor(loss_of_examples(idx), len(idx), what)

        tol = probe_tolerance(named[0][1].dtype if named else torch.float32, low_precision)
        params = [p for _, p in named]
        layout = self.distribution.layout
        leaves = None if layout is None else partial(layout.autograd_params, params)
        snapshot = StateSnapshot(self._module, self.boundary.untrusted_callbacks(), self.boundary.engine_keys,
                                 self.boundary.global_modules())

        frozen = frozen_parameters(self._module)  # momentum copies of the weights: judged by the replays
        modes = [(m, m.training) for m in self._module.modules()]
        unset = empty_slots(self._module)  # lazy caches the first forward fills
        plain = replay_hooks is None and bool(unset)  # no hooks to replay: the lazy slots judged here
        fills: list[Callable[[], None]] = []
        filled: list[str] = []  # their fingerprint's entries
        half = list(indices)[: max(1, len(indices) // 2)]
        runs = [partial(loss_of, list(indices)), partial(loss_of, list(indices)), partial(loss_of, half),
                *([partial(loss_of_exchanged, list(indices))] if loss_of_exchanged is not None else [])]

        def probe() -> None:
            assert self._module is not None and self._engine is not None
            state = self.boundary.fingerprint(self._module)
            before = state.take(full=True) if plain else None
            checked = ExampleIndependenceProbe(self._module, self._engine, params, [n for n, _ in named], loss_of, tol,
                                               autograd_params=leaves, state=state, isolated=self.examples_alone,
                                               clipping=self.clipping, grouped=self.users is not None,
                                               deferred=replay_hooks is not None or plain,
                                               frozen=frozen if replay_hooks is not None else (), what=what,
                                               lazy=unset, start_state=snapshot.restore_users)
            checked.run(list(indices))
            if plain and checked.written:
                with torch.no_grad(), self.engine_aside():
                    fills[:] = filled_alike(unset, state, before, checked.written, runs,
                                            partial(state_mutation_error, what=what))
                filled[:], checked.written = checked.written, []
            self.probe_writes = checked.written  # judged by the replays (refused at the release if not accepted)
            self._random_step, self._tolerance_low = checked.random, low_precision
            self._compute_dtype = checked.compute_dtype

        try:
            with forked_rngs():
                self._probe_engines(probe)
                if replay_hooks is not None:
                    for m, mode in modes:  # the replays start from the modes the step finds: a dropout the probe's
                        m.training = mode  # passes put in eval mode is put there again by every replay, found alike
                    for put_back in unset:  # a cache the first forward fills (a causal mask, a positional
                        put_back()           # table, a rotary cache) is filled again by every replay, judged alike
                    self.on_every_rank(lambda: self._replay(replay_hooks, list(indices)),
                                       "found state kept by the batch hooks (the release boundary)")
        finally:
            snapshot.restore()  # the probe's passes leave no trace in the user's state (metrics, lists, counters)
        for fill in fills:  # a plain loop's lazy slots, filled alike on all data: as the first step will fill them
            fill()
        self._verified = True
        self.boundary.ensure_baseline(replaced=replay_hooks is None)  # a plain loop's new layers taken as they are
        self.boundary.accept(filled)  # (a baseline taken before this verify() compares them so too)

    # ------------------------------------------------------------------ the batch check
    def batch_check_due(self) -> bool:
        """Whether this step's batch is checked (:attr:`schedule`; call once per step, before :meth:`check_batch`).
        Every rank decides alike (one all-reduce of the decision when distributed); never under FSDP2 sharding, whose
        passes would need every rank in lockstep."""
        due = self.schedule.due()
        if self.distribution.layout is not None or self.examples_alone:
            return False
        if self.distribution.all_reduce is None:
            return due
        assert self._module is not None
        device = next((p.device for p in self._module.parameters()), torch.device("cpu"))
        flag = torch.tensor([float(due and self.distribution.rank == 0)], device=device)
        self.distribution.all_reduce(flag)
        return bool(flag.item() > 0)

    def check_batch(self, loss_of_batch: Callable[[Any], Any], indices: Sequence[int], step: int,
                    max_examples: int = 128, as_of: str = "", charge: bool = True,
                    physical: Optional[int] = None) -> None:
        """The batch check (:mod:`~lightning_dp.validators.batch_check`) on this step's sampled examples,
        before its release: ``loss_of_batch(batch)`` is the user's loss of a batch of examples read by
        :meth:`examples` (``fixed``; each set of examples is read once, and every pass gets its own copy, so the last
        pass runs on the records read before the training data's other copies were exchanged:
        :mod:`~lightning_dp.record_checks.outside_records`).
        Everything the passes write is restored and the RNGs continue as if they had not run; every rank learns
        whether any refused (one all-reduce). ``max_examples``: the most examples passed as one batch (memory);
        ``as_of``: when the model was made to believe it runs (said in the refusal); ``charge``: the check's time
        counts against the schedule's budget (not for the first step's checks); ``physical``: the most examples
        ``training_step`` sees at once (``max_physical_batch_size``; ``None``: the whole batch), the size the check
        also passes the compared examples at. A step that draws random numbers is compared from the real step's
        generators and from :data:`~.batch_check.FIRST_DRAWS` other seeds at the first step's checks (the first call
        and those not charged), :data:`~.batch_check.LATER_DRAWS` later; the first call also checks the batches
        :meth:`_constructed` builds (every label, the largest plausible batch, two records)."""
        assert self._module is not None and self._engine is not None
        start = time.perf_counter()
        first = charge and self.schedule.checks == 0
        named = [(name, p) for name, p in self._module.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        reference = params[0] if params else torch.zeros(())
        dtype = reference.dtype
        if self._compute_dtype is not None and torch.finfo(self._compute_dtype).eps > torch.finfo(dtype).eps:
            dtype = self._compute_dtype
        tol = batch_tolerance(dtype, reference.device, self._tolerance_low)
        error: Optional[Exception] = None

        read: dict[tuple[int, ...], Any] = {}
        copies = [True]
        current: list[BatchInteractionCheck] = []  # the check running: its round keys the reads (a collate's coin)

        def loss_of(idx: list[int]) -> Tensor:
            key = (current[0].round if current else 0, *idx)
            if key not in read:
                read[key] = self.examples(idx, fixed=True)
            try:
                batch = copy.deepcopy(read[key])
            except Exception:  # noqa: BLE001  (a batch object that cannot be copied: read again, no exchanged pass)
                copies[0], batch = False, self.examples(idx, fixed=True)
            return loss_tensor(loss_of_batch(batch), len(idx), "training_step")

        snapshot = StateSnapshot(self._module, self.boundary.untrusted_callbacks(), self.boundary.engine_keys,
                                 self.boundary.global_modules())
        try:
            with forked_rngs():
                outside = self._training_copies(lambda: copies[0])
                fresh = getattr(self, "fresh", None)  # the generators as the step began (records/fresh_randomness)
                started = None if fresh is None else fresh.started(getattr(self, "steps_taken", -1))
                batches = [(list(indices), False, as_of, FIRST_DRAWS if first or not charge else LATER_DRAWS),
                           *((*built, 0) for built in (self._constructed(max_examples) if first else ()))]
                for built, ordered, said, draws in batches:
                    current[:] = [BatchInteractionCheck(
                        self._module, self._engine, params, [n for n, _ in named], loss_of, tol,
                        rng=self.schedule.rng, max_examples=max_examples, outside=outside, draws=draws,
                        start_state=snapshot.restore_users)]
                    current[0].check(built, step, self._random_step, said, min(len(built), physical or len(built)),
                                     ordered, built=said is not as_of, start=started)
        except StepFailedError as err:  # the user's step raised on some of its own examples: after the first
            # step's checks (``charge``) that is the step's own failure (a NaN guard, a stop at a step of its
            # choosing), raised as the step would raise it; on the first step, a step that fails on a smaller batch
            error = err if not charge or not isinstance(err.__cause__, Exception) else err.__cause__
        except PrivacyConfigurationError as err:
            error = err
        finally:
            snapshot.restore()
            if charge:
                self.schedule.checked(time.perf_counter() - start)
        refused, _ = self._refused_anywhere(error is not None, False)
        if error is not None:
            raise _named_precision(error, dtype, self._tolerance_low)
        if refused:
            raise _another_rank_error(f"found examples interacting at step {step} (the batch check)")

    def _constructed(self, max_examples: int) -> list[tuple[list[int], bool, str]]:
        """The first check's batches built from the population (:mod:`~lightning_dp.records.constructed_batches`):
        (dataset indices, halves as ordered, what the refusal says); none under user-level sampling (a unit is
        several records) or before :meth:`poisson_loader`."""
        if self.users is not None or self.plan is None or self._batches is None or self._source is None:
            return []
        where = self.distribution
        shard = range(where.rank, self.plan.num_samples, where.world_size)  # this process's population positions
        if len(shard) < 2:
            return []
        population = shard if self._batches.population is None else self._batches.positions(shard)
        rng = self.schedule.rng
        built = "not the sampled batch: a batch built from the training records (never released) "
        large = largest_batch(self.plan.expected_batch_size / where.world_size, len(shard))
        try:
            labels = label_batch(self._source[0], population, max_examples, rng)
        except Exception:  # noqa: BLE001  (labels in a form not foreseen: the other batches are still built)
            labels = None
        dataset = self._source[0]  # records the collate drops (None: unreadable) are no examples (zoo28 d02)
        return [*([(held_records(dataset, labels), True, built + "holding every label value, two of each")]
                  if labels else []),
                (held_records(dataset, rng.sample(population, large)), False, built + f"of {large} records, the "
                 "largest batch the sampler plausibly draws")]  # no tiny batch: at 2 or 3 examples some models'
        # layers cannot tell their examples from their own dimensions (zoo: stacked speakers) — a false refusal

    @contextmanager
    def engine_aside(self) -> Iterator[None]:
        """The model as the user's code meets it before the engine is attached (in ``setup``): the engine detached
        (its hooks removed, the layers' own forwards back: ghost's book-keeping forward leaves the weights'
        gradients to the release, so an ``optimizer.step()`` after a backward through it moves nothing), then
        attached again; the parameters' ``.grad`` put back as they were. For the replays of the hooks that see no
        batch (``step_replays.StepReplays._replay_epoch_hooks``): a non-private warm start there (plain SGD on the
        training set) moves the weights in its replays as in the real ``setup``, and its replay on the exchanged
        data sets them apart (docs/release_boundary.md, rule 3). Nothing captured then belongs to a step. Under FSDP2
        (a sharded layout) the engine stays attached: attached again there it was mapped to the parameters FSDP2 held
        at that moment and the next release failed (every callback with such a hook crashed a sharded fit); a warm
        start in ``setup`` then moves nothing in its replays (a limit of the sharded strategy: docs/distributed.md)."""
        engine, module = self._engine, self._module
        if engine is None or module is None:
            yield
            return
        grads = [(p, p.grad, None if p.grad is None else p.grad.detach().clone()) for p in module.parameters()]
        sharded = getattr(self.distribution, "layout", None) is not None
        if not sharded:
            engine.detach()
        try:
            yield
        finally:
            for p, grad, value in grads:
                if p.grad is not grad:
                    p.grad = grad
                if grad is not None and value is not None and not torch.equal(grad, value):
                    grad.copy_(value)
            if not sharded:
                engine.attach(module)

    def exchanged_training_data(self) -> ExchangedRecords:
        """The training data's copies in memory (:meth:`_training_copies`), for a caller's own replays; the
        non-private diagnostics move with them (:func:`~.diagnostic_reads.moved`: up, or down with the
        floating-point arrays only, so that the two exchanged runs of a window put them on both sides of any
        threshold)."""
        return self._training_copies(lambda: True, lambda floating_only: diagnostics_moved(self, up=not floating_only))

    def _training_copies(self, copyable: Callable[[], bool], also: Any = None) -> ExchangedRecords:
        """The training data's copies in memory the batch check exchanges (:func:`training_copies`: the training
        dataset's, and those the model, the datamodule, the callbacks, the user's globals, the optimizers and the
        schedulers keep: :func:`~lightning_dp.record_checks.holders.code_holders`); none when a
        batch cannot be copied (``copyable()`` false by then: its records would be read from the exchanged data)."""
        assert self._source is not None and self._module is not None
        trainer = getattr(self._module, "_trainer", None)
        holders = [("model", self._module), *((type(cb).__name__, cb) for cb in self.boundary.callbacks()),
                   *((m.__name__, m) for m in self.boundary.global_modules()),
                   *code_holders(getattr(trainer, "optimizers", None) or (), schedulers(trainer))]
        return ExchangedRecords(training_copies(self._source[0], holders), copyable, also)

    def _replay(self, replay_hooks: Callable[[list[int]], None], indices: list[int]) -> None:
        """Run the loop's batch hooks on the probe's examples; refuse what they keep (the release boundary, rule 3)."""
        assert self._module is not None and self._engine is not None
        fingerprint = self.boundary.fingerprint(self._module)
        before = fingerprint.take(self.boundary.callbacks(), full=True)
        try:
            replay_hooks(indices)
        except PrivacyConfigurationError:
            raise
        except Exception:  # noqa: BLE001  (a hook that needs more of the loop than a replay gives: checked per step)
            pass
        finally:
            self._engine.begin_step(None)
        changed = fingerprint.changed(before, fingerprint.take(self.boundary.callbacks(), full=True))
        if changed:
            raise self.boundary.written_error(
                changed, "in the hooks the loop runs around a step (on_train_batch_start, on_before_backward, "
                         "on_train_batch_end), replayed on the first step's examples before any release")

    def _probe_engines(self, probe: Callable[[], None]) -> None:
        """Run ``probe`` on the attached engine. Under ``per_sample="auto"`` (replicated parameters) an engine it
        refuses gives way to the next engine of :func:`~lightning_dp.grad_sample.auto.engines_after`, probed
        again from the start; the first engine the probe passes trains, with a warning naming the refusal. A forward
        that wrote the model's own state (:class:`~lightning_dp.validators.probe.StateWriteError`) is
        refused at once: the model's doing, and already done. Every rank takes the same engine: each attempt ends
        with one all-reduce of the counts of ranks that refused and that found a state write, and the next engine
        is tried while any refused. None passing: the first engine's refusal, naming the others'."""
        assert self._module is not None
        refusals: list[tuple[str, PrivacyConfigurationError]] = []
        tried: list[str] = []
        later: Optional[list[str]] = None
        while True:
            error: Optional[PrivacyConfigurationError] = None
            try:
                probe()
            except PrivacyConfigurationError as err:
                error = err
                refusals.append((self.engine_name, err))
            refused, final = self._refused_anywhere(error is not None, isinstance(error, StateWriteError))
            if not refused:
                break
            tried.append(self.engine_name)
            if final:
                raise error if isinstance(error, StateWriteError) else \
                    _another_rank_error("(the first step's probe) wrote the model's own state in its forward")
            if later is None:
                later = (engines_after(self._module, self.engine_name, self.views_per_example)
                         if self._auto and self.distribution.layout is None else [])
            if not later:
                raise _probe_refusal(refusals, self.engine_name)
            self._switch_engine(later.pop(0))
        if tried and self.distribution.rank == 0:  # every rank took the same engine: one warning
            why = f" The refusal: {_headline(refusals[0][1])}." if refusals else ""
            warnings.warn(
                f"per_sample='auto': the first step's probe refused engine(s) {', '.join(map(repr, tried))} on this "
                f"model and passed engine '{self.engine_name}', which trains it (slower).{why}", stacklevel=3)

    # ------------------------------------------------------------------ refusals every rank shares
    def on_every_rank(self, check: Callable[[], None], what: str) -> None:
        """Run ``check``; when distributed, every rank learns whether any rank's raised (one all-reduce) and raises too,
        so that no rank waits in a collective its refusing peer never joins. A logger call a training hook made
        refused on this rank alone (kept: :func:`~.logger_outputs.refused_now`) is raised here too."""
        error: Optional[PrivacyConfigurationError] = None
        try:
            check()
            logger_outputs.refused_now()
        except PrivacyConfigurationError as err:
            error = err
        if self.distribution.all_reduce is not None:
            refused, differing = self._refused_or_disagreeing(error is not None)
            if differing:  # every rank sums the same terms: each raises this (validators/rank_agreement.py)
                raise disagreement_error(differing, where="σ and C are compared at every release") from error
            if refused and error is None:
                raise _another_rank_error(what)
        if error is not None:
            raise error

    def _refused_or_disagreeing(self, refused: bool) -> tuple[bool, list[str]]:
        """Whether a check refused on any rank, and which of σ, C and the clipping policy's settings differ between
        the ranks (one SUM all-reduce of int64 terms: :func:`~.rank_agreement.release_agreement`)."""
        assert self._module is not None and self.distribution.all_reduce is not None
        device = next((p.device for p in self._module.parameters()), torch.device("cpu"))
        terms = torch.tensor([int(refused)] + release_agreement(release_values(self)), dtype=torch.int64,
                             device=device)
        self.distribution.all_reduce(terms)
        summed = terms.tolist()
        return summed[0] > 0, differing_release_values(summed[1:], self.distribution.world_size)

    def check_ranks_agree(self, population: Any, sampler: Any) -> None:
        """Once per training loader: every rank runs the same mechanism (σ, C, the clipping policy, q, B, N, steps per
        epoch, the noise's bands, the population before sharding, the partition into users); refused on every rank
        alike when not (:func:`~lightning_dp.validators.rank_agreement.check_ranks_agree`)."""
        check_ranks_agree(self, population, sampler)

    def any_rank(self, flag: bool, other: Optional[bool] = None) -> Any:
        """Whether ``flag`` holds on this rank or any other (one all-reduce, when distributed; with ``other``, the
        pair for both flags): every decision that changes how many times the user's hooks run again (a replay's second
        plain run, a window judged) is taken alike on every rank, so that the collectives in those hooks (a broadcast
        at batch end) stay paired."""
        both = self._refused_anywhere(bool(flag), bool(other))
        return both[0] if other is None else both

    def _refused_anywhere(self, refused: bool, final: bool) -> tuple[bool, bool]:
        """Whether the probe refused on this rank or any other, and whether any refusal was final (one all-reduce
        of the two counts, when distributed)."""
        if self.distribution.all_reduce is None:
            return refused, final
        assert self._module is not None
        device = next((p.device for p in self._module.parameters()), torch.device("cpu"))
        counts = torch.tensor([float(refused), float(final)], device=device)
        self.distribution.all_reduce(counts)
        return bool(counts[0].item() > 0), bool(counts[1].item() > 0)

    def _check_ledger_unit(self) -> None:
        """The ledger counts one unit: a module's record of releases per example is not continued per user (nor the
        reverse: its ε would mix the two units)."""
        held = getattr(self.ledger, "unit", "example")
        if self.ledger.steps and held != self.unit:
            raise PrivacyConfigurationError(
                f"this module's ledger (or the releases earlier fits in this process made on the same records) holds "
                f"releases accounted per {held}; a run per {self.unit} cannot continue it "
                f"(its ε would mix the two units). Train a fresh copy of the module, or keep privacy_unit as it was.")
        self.ledger.unit = self.unit


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _headline(err: BaseException) -> str:
    """The refusal's first clause (up to its first ': ' or ' ('; not a word's ``(s)``): a warning that training goes
    on carries no details that could quote the data."""
    line = _first_line(err)
    cut = min((i for i in (line.find(": "), line.find(" (")) if i > 0), default=len(line))
    return line[:cut].strip().rstrip(".:")


def _named_precision(error: Exception, dtype: torch.dtype, low: bool) -> Exception:
    """The batch check's refusal of interacting examples with half precision named first when the step computed in it
    (a float16 or bfloat16 model, autocast) at float32's tolerance: over a large batch the rounding alone can move a
    sum more than that tolerance (zoo37 T36: an fp16 model refused as "examples interact", the cause unnamed)."""
    half = torch.finfo(dtype).eps > torch.finfo(torch.float32).eps
    if low or not half or not str(error).startswith("Examples interact"):
        return error
    return PrivacyConfigurationError(
        f"The step computed in {dtype} (a half-precision model, or torch.autocast in training_step), whose rounding "
        "alone can make a batch's gradients differ from its examples' alone by more than the check's float32 "
        "tolerance: train the model in float32 under Trainer(precision='bf16-mixed') (or '16-mixed': the check's "
        "tolerance for half precision, clipping and noise in float32), or in a plain PrivateStep loop pass "
        f"step.verify(loss_fn, low_precision=True). What the check saw: {error}")


def _another_rank_error(what: str) -> PrivacyConfigurationError:
    """The error of a rank whose own check passed while another rank's refused (every rank stops alike)."""
    return PrivacyConfigurationError(
        f"A check on another rank's examples {what} (this rank's check passed): see that rank's error. Nothing was "
        "released.")


def _probe_refusal(refusals: Sequence[tuple[str, PrivacyConfigurationError]], engine: str) -> PrivacyConfigurationError:
    """The error of a probe no engine passed: the first engine's refusal (``auto``'s first choice: its cause and fix
    first), then one short line naming the other engines tried, with their refusals' headlines only where they differ
    from the first's (a summed loss is refused alike by every engine: said once). The first refusal itself is returned
    with that line appended, so its traceback and cause (an engine's own failure) stay and nothing is printed twice. A
    rank whose own probe passed while another rank's refused says so."""
    if not refusals:
        return _another_rank_error(f"(the first step's probe) refused engine '{engine}'")
    first = refusals[0][1]
    if len(refusals) == 1:
        return first
    same = [name for name, err in refusals[1:] if _headline(err) == _headline(first)]
    other = [f"'{name}': {_headline(err)}" for name, err in refusals[1:] if _headline(err) != _headline(first)]
    parts = ([f"{', '.join(map(repr, same))}: the same refusal"] if same else []) + other
    first.args = (f"{first}\n(per_sample='auto' also tried {'; '.join(parts)}.)",)
    return first
