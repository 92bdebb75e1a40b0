"""The first step's probe: examples do not interact, and the engine sees every gradient path.

Per-example clipping bounds what one example adds to the released sum S = Σ_i clip_C(g_i) by C
only if g_i, what the engine calls example i's gradient, is example i's alone. Two kinds of
user code break that silently, and neither shows in the model's structure:

- **Examples interact** through the loss or the model: a token mean normalised by the batch's
  non-pad count, ``h - h.mean(0)``, a summed loss (every g_i then scales with the batch size).
  Then g_i depends on which other examples were sampled.
- **A gradient path the engine does not capture**: a parameter also used outside the module
  that owns it (``F.linear(h, self.emb.weight)``), a compiled graph whose hooks never fire.
  Then Σ_i g_i differs from the gradient autograd computes.

The probe runs once, before the first release, on k examples (a fixed, public choice of
indices: the first k of the rank's shard), with clipping switched off:

    g_i^batch   the engine's per-example gradients of the k examples as one batch
    g_i^alone   the engine's gradient of example i as a batch of one            (k passes)
    ∇           autograd's gradient of the batch's mean loss, engine detached   (1 pass)

and requires, to a tolerance set by the precision,

    ‖g_i^batch‖ = ‖g_i^alone‖ for every i        (no interaction, no per-batch scaling)
    Σ_i g_i^batch = Σ_i g_i^alone                 (the same, per coordinate)
    Σ_i g_i^batch = k · ∇                          (every use of every parameter captured)

The model runs in the modes the step runs it in (a module that mixes examples only in training mode — a
batch-level token mix, CutMix inside the model — is seen; one that caches in eval mode is not switched into
it), with dropout switched off (:class:`NoDropout`: torch's dropout functions are the identity and attention's
``dropout_p`` is 0 during the probe; drop-path modules are put in eval) and the same random seed for every pass, so
the passes are comparable. A step that still draws random numbers of its own (augmentation in ``training_step``) is
detected by one more batch pass with another seed; then only the coarse checks run (a summed loss: the ratios'
geometric mean > √k; uncaptured uses: same seed as autograd's pass), with a warning; the user's gradients, RNG state
and drop-path modes are restored.

A float32 refusal of batch against alone within :data:`~lightning_dp.tolerance.NEAR_MISS` times its tolerance is
judged again with the same passes in float64 (:meth:`ExampleIndependenceProbe._judged`): round-off is relative to the
terms a product sums, so features in the thousands through a layer whose output then saturates move an independent
example's gradient by several tolerances; in float64 that vanishes and an interaction stays. What it cannot see: code
paths the first k examples do not take, interactions that vanish for these k examples (e.g. a token-mean loss over
examples of equal length), and code that interacts only when it computes in float32, by at most the window. It costs
k + 3 forward/backward passes on ≤ k examples, once (k + 2 more in float64 after a near miss only).
"""

from __future__ import annotations

import math

from contextlib import contextmanager

import os
import re
import traceback
import warnings
from typing import Callable, Collection, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_dp.errors import PrivacyConfigurationError, RandomStepWarning
from lightning_dp.records import user_generators
from lightning_dp.replays.runs_again import InterruptedRun, interrupts_failed
from lightning_dp.validators.kept_state import StateFingerprint, public_name
from lightning_dp.validators.random_draws import drawing_modules, random_step_warning
from lightning_dp.clipping import ClippingPolicy, ClipRule, FlatClipping
from lightning_dp.clipping.reference import pseudo_units, reference_sums
from lightning_dp.engine_api import ClippedBatch, GradSampleEngine
from lightning_dp.power_iteration import buffers_set_apart
from lightning_dp.tolerance import LOW_PRECISION_TOLERANCE, NEAR_MISS, REJUDGED_ULPS, batch_tolerance
from lightning_dp.wide_replay import in_float64
from lightning_dp._warnings import output_hook_notice_quieted
from lightning_dp.validators.step_calls import StepWatch, double_backward_error, sorted_batch_hint, weighted_mean_hint

LossOf = Callable[[Sequence[int]], Tensor]
"""Runs the user's forward and loss on the examples with these dataset indices; returns the loss."""

PROBE_EXAMPLES = 6


def probe_tolerance(dtype: torch.dtype, low_precision: bool) -> float:
    """Relative tolerance of the probe's comparisons: float rounding of different batch shapes,
    not interactions. bf16/fp16 autocast computes in ~3 significant digits."""
    if low_precision:
        return 3e-2
    return 1e-6 if dtype == torch.float64 else 1e-3  # float64 models may compute parts in float32 (RoPE)


class ExampleIndependenceProbe:
    """Runs the probe of the module docstring for one model, engine and parameter list.

    Args:
        module: the model the engine is attached to.
        engine: the attached engine (detached and re-attached once for autograd's reference).
        params: the trainable parameters, in the engine's order.
        names: a display name per parameter (for the errors).
        loss_of: the user's forward and loss on the examples with these indices.
        rtol: relative tolerance (:func:`probe_tolerance`).
        autograd_params: the leaves autograd's reference differentiates, one per parameter, asked for when
            the reference pass runs (default: ``params``). FSDP2 runs forward and backward on unsharded copies
            of its sharded parameters (:meth:`~lightning_dp.sharding.fsdp_layout.FSDPLayout.autograd_params`).
        state: the fingerprint of the state no pass may write (default: the module's, less the engine's own
            attributes; :class:`~lightning_dp.validators.kept_state.StateFingerprint`).
        deferred: the caller replays the loop's batch hooks after the probe and judges what they keep there
            (:class:`~lightning_dp.validators.hook_replays.BatchEndWrites`): a write to kept state other than a
            trainable parameter (a step counter; a frozen momentum copy named in ``frozen``) is left to that
            judgement, in :attr:`written`, not refused here.
        frozen: the names of the parameters that neither require grad nor hold a gradient
            (:func:`frozen_parameters`): with ``deferred``, their writes are judged by the replays as a buffer's.
        isolated: training puts every example alone in its forward and backward (physical batches of one): examples
            cannot interact there, so batch and alone are not compared; the norm rule, the clipping and every use of
            every parameter still are.
        clipping: the run's clipping policy (default flat): its factors are the ones checked.
        grouped: training clips units of several examples (user-level DP): the clipped pass puts the examples in
            units of two (:func:`~lightning_dp.clipping.reference.pseudo_units`), so the engine's norms of
            sums across examples are checked too.
        what: how refusals name ``loss_of``: ``"training_step"`` (DPStrategy), else a plain loop's loss function.
        lazy: what puts back the slots a first forward fills (:func:`~.lazy_caches.empty_slots`): with ``deferred``, a
            write they undo (Hugging Face's ``config.problem_type``) does not take the place of another refusal.
        start_state: what puts the user's state back as the step found it, before every pass
            (:meth:`~.snapshot.StateSnapshot.restore_users`): a counter the step increments and reads (a
            warm-up factor from ``self.n_steps += 1``) is read alike by every pass — as by the step, which runs once —
            instead of one more at each pass, which the comparisons took for examples interacting. The last pass's
            write stays: it is refused, or (``deferred``) left in :attr:`written` for the replays to judge on other
            data.
    """

    def __init__(self, module: nn.Module, engine: GradSampleEngine, params: Sequence[Tensor],
                 names: Sequence[str], loss_of: LossOf, rtol: float,
                 autograd_params: Optional[Callable[[], Sequence[Tensor]]] = None,
                 state: Optional[StateFingerprint] = None, isolated: bool = False,
                 clipping: Optional[ClippingPolicy] = None, grouped: bool = False, deferred: bool = False,
                 frozen: Collection[str] = (), what: str = "training_step",
                 lazy: Sequence[Callable[[], None]] = (), start_state: Optional[Callable[[], None]] = None) -> None:
        self.module, self.engine, self.params, self.names = module, engine, list(params), list(names)
        self._start_state = start_state
        self.what, self.lazy = what, list(lazy)
        self.frozen = frozenset(frozen)
        self.deferred, self.written = deferred, []  # type: tuple[bool, list[str]]
        self.clipping = clipping if clipping is not None else FlatClipping()
        self.grouped = grouped and not isolated
        self.loss_of, self.rtol = loss_of, rtol
        self.autograd_params = autograd_params
        self.state = state if state is not None else StateFingerprint(module, skip_keys=engine.owned_attributes)
        self.isolated = isolated
        self.random = False
        """Set by :meth:`run`: the step draws random numbers of its own (only the coarse checks could run)."""
        self.interaction_rtol = rtol
        """Set by :meth:`run`: the tolerance of the batch-against-alone comparisons (:meth:`_interaction_tolerance`)."""
        self.compute_dtype: Optional[torch.dtype] = None
        """Set by :meth:`run`: the lowest-precision floating dtype the forward computed in (:class:`LowestFloat`)."""
        self._sorted = False  # the step sorted a tensor (validators/step_calls.py): named if examples interact
        self._weighted = False  # the step took a class-weighted mean loss (step_calls.py): named likewise
        self._calls = StepWatch()  # what the user's step calls during the passes (not the engine's own work)
        self._dtypes = LowestFloat()  # the floating dtypes of the last pass (:meth:`_watched`)
        self._before: Optional[dict] = None  # the state before the passes (:meth:`_not_lazy`)
        self._indices: list[int] = []  # the examples probed (:meth:`_random_warning`)
        self._distance: Optional[float] = None  # how far, in its tolerance, :meth:`_compare`'s refusal was

    def run(self, indices: Sequence[int]) -> None:
        """Probe on the examples ``indices`` (≥ 2); raises :class:`PrivacyConfigurationError`. A write left to the
        replays (``deferred``) that the passes then disagree over (the state fed the next pass's loss) is what is
        refused, as without them: the likely cause."""
        self.written, self._before = [], None
        # a frozen copy the step writes (a momentum target) put back before each pass and after them: every pass
        # sees it as the step would, and the replays judge its write from the state as it was
        self._frozen_kept = [(p, p.detach().clone()) for name, p in self.module.named_parameters()
                             if name in self.frozen] if self.deferred else []
        try:
            self._run(indices)
        except PrivacyConfigurationError as err:
            kept = self._not_lazy(self.written) if self.written and not isinstance(err, StateWriteError) else []
            if kept:
                raise state_mutation_error(kept, what=self.what) from err
            raise
        finally:
            self._put_frozen_back()

    def _not_lazy(self, written: list[str]) -> list[str]:
        """The entries of ``written`` that putting the :attr:`lazy` slots back does not undo."""
        for put_back in self.lazy:
            put_back()
        return [name for name in self.state.changed(self._before, self.state.take(full=True)) if name in written]

    def _start_with_filled_slots(self) -> None:
        """:attr:`_start_state`, then the :attr:`lazy` slots (but a number from 0) as the passes so far filled them: a
        cache filled from shapes is not made again by every pass (a lazy field filled alike does not take the place of
        another refusal), and a statistic kept on first use is read by the later passes as the step's later steps
        would read it — the replays judge that write, and refuse it by name."""
        assert self._start_state is not None
        filled = []
        for slot in self.lazy:
            holder, key = getattr(slot, "holder", None), getattr(slot, "key", None)
            if type(getattr(slot, "empty", None)) is int:  # a count from 0 (`self.n_steps = 0`): a counter, put back
                continue                                     # (a length cached from shapes is filled alike again)
            if isinstance(holder, dict) and key in holder:
                value = holder[key]
                filled.append((holder, key, value, list(value.items()) if type(value) is dict
                               else list(value) if type(value) is list else None))
        self._start_state()
        for holder, key, value, items in filled:
            holder[key] = value
            if type(value) is dict and items is not None:
                value.clear()
                value.update(items)
            elif type(value) is list and items is not None:
                value[:] = items

    def _put_frozen_back(self) -> None:
        with torch.no_grad():
            for p, value in getattr(self, "_frozen_kept", ()):
                if not torch.equal(p, value):
                    p.copy_(value)

    def _run(self, indices: Sequence[int]) -> None:
        if len(indices) < 2:
            return  # one example cannot interact with another; nothing to compare
        before = self.state.take(full=True)
        self._before = before if self._before is None else self._before  # (the state before any pass of this run)
        calls = self._calls = StepWatch()
        self._indices = list(indices)
        try:
            with check_passes(self.module, self.params, self.engine):
                # alone first: a layer argument that does not follow the batch (a [T, T] mask) is seen
                # with other leading dimensions and never sliced per example afterwards (capture.py)
                alone = [self._engine_pass([i]) for i in indices]
                finite = [i for i, a in zip(indices, alone) if bool(torch.isfinite(a.norms).all())]
                if not finite or len(finite) == len(indices):
                    together = self._engine_pass(list(indices))
                    self.compute_dtype = self._dtypes.lowest  # (the dtypes of that pass alone)
                    reseeded = self._engine_pass(list(indices), seed=1)
                    # a bound that clips about half of them: the weighted sum Σ c_i g_i with c_i < 1 is checked too
                    bound = float(torch.cat([a.norms.double() for a in alone]).median())
                    # isolated: training clips examples alone, so the factors are checked on examples alone
                    clipped = (None if bound <= 0 else
                               [self._engine_pass([i], rule=self._rule(bound, 1)) for i in indices] if self.isolated
                               else self._engine_pass(list(indices), rule=self._rule(bound, len(indices))))
                    reference = self._autograd_pass(list(indices))
        except Exception as err:  # a write made before the failure is refused too (no engine lifts it), the failure
            # named first: the write may be unrelated to it (a field set lazily on a first call) or left by it halfway
            changed = self.state.changed(before, self.state.take(full=True))  # (no replay judges it: all of it)
            if changed:
                raise state_mutation_error(changed, failure=err, what=self.what,
                                           set_apart=self._buffers_set_apart(changed, indices)) from err
            if calls.double_backward:  # what made the engine fail, or its passes disagree: named, not guessed
                raise double_backward_error(self.engine.name) from err
            differentiated = self._differentiated()
            if differentiated:  # the step's own torch.autograd.grad of the parameters (an engine's hooks break on it)
                raise parameters_differentiated_error(differentiated) from err
            raise
        changed = self._refused(self.state.changed(before, self.state.take(full=True)))
        if changed:
            raise state_mutation_error(changed, what=self.what)
        if calls.double_backward:
            raise double_backward_error(self.engine.name)
        if finite and len(finite) < len(indices):  # records whose gradient is not finite add 0 to a release
            return self._run(finite)  # (no warning: how many of the batch's records are not finite is its data's)
        self._sorted, self._weighted = calls.sorted, calls.weighted_mean
        self.interaction_rtol = self._interaction_tolerance()
        # the same examples, batch shape and code under another seed: any difference beyond rounding is randomness of
        # the step's own, judged at the tolerance batch and alone are then compared at (a draw that moves the
        # gradients by less than rtol, noise of two views in a consistency loss, would otherwise read as interaction)
        drawn = (together.norms.double() - reseeded.norms.double()).abs()  # per example, as the batch check compares
        limit = self.interaction_rtol * float(together.norms.double().max()) + 1e-12
        random = self.random = bool((drawn > limit).any())
        permuted = self._judged(together, alone, reference, list(indices), random)
        if permuted and (clipped is None or random):
            raise self._interaction(together.norms.double(), torch.cat([a.norms.double() for a in alone]),
                                    len(indices))
        if isinstance(clipped, list):
            for one, example in zip(clipped, alone):
                self._check_clipping(one, [example], bound)
        elif clipped is not None and not random:
            try:
                self._check_clipping(clipped, alone, bound)
            except PrivacyConfigurationError:
                if permuted:  # rows that looked like a reordering of the examples are not: they interact
                    raise self._interaction(together.norms.double(),
                                            torch.cat([a.norms.double() for a in alone]), len(indices)) from None
                raise

    def _differentiated(self) -> str:
        """The name of the first parameter the user's step took ``torch.autograd.grad`` with respect to ("": none;
        an input's gradient, an adversarial example or a gradient penalty on the inputs, is not one)."""
        taken = self._calls.differentiated
        return next((name for p, name in zip(self.params, self.names) if id(p) in taken), "")

    def _refused(self, changed: list[str]) -> list[str]:
        """The writes the probe refuses: all of them, or (``deferred``) those to trainable parameters, the rest kept
        in :attr:`written` for the replays to judge (a counter every data writes alike; a running mean they set apart;
        a frozen momentum copy of the weights, :attr:`frozen`)."""
        if not self.deferred:
            return changed
        self.written = [c for c in changed if not parameter_entry(c, self.frozen)]
        return [c for c in changed if c not in self.written]

    # ------------------------------------------------------------------ passes
    def _loss(self, indices: list[int], backward: bool = False, seed: int = 0) -> Tensor:
        self._seed(seed)
        self._put_frozen_back()
        if self._start_state is not None:  # every pass from the user's state as the step found it, but the slots a
            self._start_with_filled_slots()  # first forward fills, as the first pass filled them (as before)
        try:
            with interrupts_failed(), self._calls:  # the user's forward and backward only: an engine's torch.func
                # replay takes its own (gradients with create_graph=True, which is no double backward of the step);
                # a KeyboardInterrupt of the user's step here is a failed pass, refused, not an interrupt of the fit
                loss = self.loss_of(indices)
                if loss.grad_fn is None:
                    raise detached_loss_error(loss)
                if backward:
                    with output_hook_notice_quieted(self.engine.name):
                        loss.backward()
            return loss
        except PrivacyConfigurationError:
            raise
        except Exception as err:  # noqa: BLE001  (any failure of the user's step on a small batch)
            raise probe_failure_error(err, len(indices)) from err

    def _seed(self, seed: int) -> None:
        """Start a pass's draws (:func:`seed_all`; the batch check starts some from the real step's own states)."""
        seed_all(seed)

    def _rule(self, bound: float, count: int) -> ClipRule:
        """The run's policy at ``bound``, on ``count`` examples (in units of two when training groups them)."""
        return ClipRule(self.clipping.at_bound(bound), pseudo_units(count) if self.grouped else None)

    @contextmanager
    def _watched(self) -> Iterator[None]:
        """A pass under a fresh :class:`LowestFloat` (:attr:`_dtypes`). Every pass runs the user's step under the same
        modes (:class:`NoDropout`, :class:`LowestFloat`, :class:`~.step_calls.StepWatch`): Dynamo guards a
        ``torch.compile``'d model's frames on the types of the mode stack, so a watch entered for one pass only made
        it compile them again for that pass and again for the next (each frame up to 8 times, then left uncompiled)."""
        self._dtypes = LowestFloat()
        with self._dtypes:
            yield

    def _engine_pass(self, indices: list[int], seed: int = 0, rule: Optional[ClipRule] = None) -> ClippedBatch:
        with self._watched():
            for p in self.params:
                p.grad = None
            self.engine.begin_step(len(indices))
            self._loss(indices, backward=True, seed=seed)
            try:
                return self.engine.clip_and_sum(self.params, float("inf") if rule is None else rule)
            except PrivacyConfigurationError:
                raise
            except Exception as err:  # noqa: BLE001  (the engine's own failure on this model)
                raise engine_failure_error(err) from err

    def _buffers_set_apart(self, changed: Sequence[str], indices: Sequence[int]) -> Optional[dict[str, bool]]:
        """For the refusal's text: whether the examples set apart each buffer of ``changed`` the forward wrote
        (:func:`~lightning_dp.power_iteration.buffers_set_apart`), the forward run as the probe's passes run it."""
        buffers = [name.partition(" ")[2] for name in changed if name.startswith("buffer ")]
        if not buffers:
            return None
        with check_passes(self.module, self.params, self.engine):
            return buffers_set_apart(self.module, buffers, lambda i: self._autograd_pass([i]), indices)

    def _autograd_pass(self, indices: list[int]) -> list[Tensor]:
        self.engine.detach()
        try:
            with self._watched():
                loss = self._loss(indices)
            leaves = list(self.params if self.autograd_params is None else self.autograd_params())
            grads = gradients_of(loss, leaves)
        finally:
            self.engine.attach(self.module)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(leaves, grads)]

    # ------------------------------------------------------------------ verdict
    def _check_norms(self, alone: list[ClippedBatch], scale: float) -> None:
        """An example alone is a batch of one: the engine's unclipped sum is its gradient, whose norm must be the
        norm the engine clips by. The two come from different code (a ghost norm from activation Gram matrices; the
        sum from one weighted contraction), so a wrong norm rule — the one error that silently loosens the clipping
        bound and that the other comparisons, engine against itself and sums against autograd, cannot see — shows
        here."""
        for batch in alone:
            actual = torch.sqrt(sum(batch.sums[p].double().pow(2).sum() for p in self.params))
            claimed = batch.norms.double().reshape(-1)[0]
            if not self._close(claimed, actual, scale):
                raise norm_mismatch_error(self.engine.name, self.precision_hint())

    def _check_clipping(self, clipped: ClippedBatch, alone: list[ClippedBatch], bound: float) -> None:
        """The engine's clipped sum at a bound C that clips some of the examples must be the policy's Σ_u c_u g_u of
        the gradients it computed for each example alone (flat: Σ_i min(1, C/‖g_i‖) g_i; units of two examples when
        training groups them; :func:`~lightning_dp.clipping.reference.reference_sums`). The probe's other
        passes take C = ∞, where every factor is 1 and a mistake in applying the factors could not show."""
        groups = pseudo_units(len(alone)) if self.grouped and len(alone) > 1 else None
        wanted = reference_sums(self.clipping.at_bound(bound), [[a.sums[p] for p in self.params] for a in alone],
                                groups)
        for p, name, want in zip(self.params, self.names, wanted):
            got = clipped.sums[p].double()
            if not self._close(got, want, max(float(want.norm()), float(got.norm()), bound * 1e-3)):
                raise clipping_error(self.engine.name, name, self.precision_hint())

    def _close(self, a: Tensor, b: Tensor, scale: float, rtol: Optional[float] = None) -> bool:
        return float((a.double() - b.double()).norm()) <= (self.rtol if rtol is None else rtol) * scale + 1e-12

    def _interaction_tolerance(self) -> float:
        """The tolerance of the batch-against-alone comparisons: the same examples through the same code, so rounding
        only (:func:`~lightning_dp.tolerance.batch_tolerance`, 64 ulps of the precision the forward
        computed in), never looser than ``rtol`` (which also bounds the comparisons of different code paths: the
        engine's norm against its sum, its sum against autograd's)."""
        reference = self.params[0] if self.params else torch.zeros(())
        dtype = reference.dtype if reference.is_floating_point() else torch.float32
        if self.compute_dtype is not None and torch.finfo(self.compute_dtype).eps > torch.finfo(dtype).eps:
            dtype = self.compute_dtype
        low = self.rtol >= LOW_PRECISION_TOLERANCE
        return min(self.rtol, batch_tolerance(dtype, reference.device, low_precision=low))

    def _interaction(self, together: Tensor, alone: Tensor, k: int, name: Optional[str] = None,
                     summed: bool = False) -> PrivacyConfigurationError:
        return interaction_error(together, alone, k, name, summed=summed, engine=self.engine.name,
                                 sorted_batch=self._sorted, weighted_mean=self._weighted,
                                 precision=self.precision_hint())

    def _random_warning(self) -> str:
        """The warning that the step draws random numbers of its own, naming where (one more forward of two of the
        probe's examples, dropout off as in the passes: :func:`~.random_draws.drawing_modules`)."""
        found: tuple[list, bool] = ([], True)
        with check_passes(self.module, self.params, self.engine):
            seed_all(0)
            try:
                with self._watched():
                    found = drawing_modules(self.module, lambda: self._loss(self._indices[:2]))
            except PrivacyConfigurationError:
                pass  # (the passes ran it before: named as augmentation, as before)
        return random_step_warning(self.what, *found)

    def precision_hint(self) -> str:
        """A sentence for a refusal when the forward computed in a half-precision dtype (autocast, a bf16 model;
        :attr:`compute_dtype`) while the tolerance is float32's: rounding alone may be what differed, and
        ``low_precision=True`` is the fix. Empty otherwise (or when the tolerance is already the low-precision one:
        DPStrategy under precision='bf16-mixed'/'16-mixed')."""
        dtype = self.compute_dtype
        if (dtype is None or torch.finfo(dtype).eps <= torch.finfo(torch.float32).eps
                or self.rtol >= LOW_PRECISION_TOLERANCE):
            return ""
        return (f"The forward computed in {dtype} (torch.autocast, or a half-precision model), whose rounding alone "
                f"can exceed the probe's tolerance ({self.rtol:g}): in a plain PrivateStep loop pass "
                "step.verify(loss_fn, low_precision=True) (the probe's tolerance for bf16/fp16); under DPStrategy set "
                "Trainer(precision='bf16-mixed') (or '16-mixed'), which does the same, instead of calling "
                "torch.autocast in training_step. ")

    def _judged(self, together: ClippedBatch, alone: list[ClippedBatch], reference: list[Tensor],
                indices: list[int], random: bool) -> bool:
        """:meth:`_compare`; an interaction it refuses in float32 by at most :data:`~lightning_dp.tolerance.NEAR_MISS`
        times the tolerance (batch against alone) is compared once more on the same examples with every pass in
        float64 (:func:`~lightning_dp.wide_replay.in_float64`), batch against alone at
        :data:`~lightning_dp.tolerance.REJUDGED_ULPS` float32 ulps of the largest norm and the sums at float64's
        :func:`probe_tolerance`. Float32 round-off is relative to the terms a product sums, not to its result: a
        feature in the thousands through a first layer whose output tanh then saturates (a product of large terms
        that cancel) moves an example's gradient between a batch of 6 and a batch of one by several times the
        tolerance, with independent examples; in float64 that round-off is 2^-29 of it, while an interaction float32
        saw (over 64 ulps) stays. The refusal stands unless that replay computed in float64 throughout and found
        nothing; farther than the window (or a random step, or a model not in float32) it stands as it is: code
        that interacts only when it computes in float32 is refused beyond the window."""
        self._distance = None
        try:
            return self._compare(together, alone, reference, len(indices), random)
        except PrivacyConfigurationError as err:
            distance, self._distance = self._distance, None
            if distance is None or distance > NEAR_MISS or random or self.isolated or not self._in_float32():
                raise
            rtol, interaction_rtol = self.rtol, self.interaction_rtol
            self.rtol = probe_tolerance(torch.float64, False)
            self.interaction_rtol = REJUDGED_ULPS * torch.finfo(torch.float32).eps
            try:
                with check_passes(self.module, self.params, self.engine), in_float64(self.module) as wide:
                    alone = [self._engine_pass([i]) for i in indices]
                    together = self._engine_pass(list(indices))
                    reference = self._autograd_pass(list(indices))
                    permuted = self._compare(together, alone, reference, len(indices), random)
            except Exception:  # noqa: BLE001  (refused again, or the model cannot run in float64: the verdict stands)
                raise err from None
            finally:
                self.rtol, self.interaction_rtol, self._distance = rtol, interaction_rtol, None
            if not wide.complete or permuted:
                raise err from None
            return False

    def _in_float32(self) -> bool:
        """The model's trainable parameters and its forward compute in float32, at float32's own tolerances (not
        half precision, not TF32): where :meth:`_judged` applies."""
        return (all(p.dtype == torch.float32 for p in self.params) and self.compute_dtype in (None, torch.float32)
                and self.interaction_rtol == batch_tolerance(torch.float32, torch.device("cpu"))
                and self.autograd_params is None)

    def _compare(self, together: ClippedBatch, alone: list[ClippedBatch], reference: list[Tensor], k: int,
                 random: bool) -> bool:
        """The comparisons of the module docstring; returns whether the batch's rows are the examples in another
        order (the same norms, :func:`same_norms`: a batch sorted before packing), which :meth:`run` then confirms
        with the clipped pass (a weighted sum whose weights follow each row's own norm)."""
        permuted = False
        alone_norms = torch.cat([a.norms.double() for a in alone])
        together_norms = together.norms.double()
        bad = [name for name, ref in zip(self.names, reference) if not bool(torch.isfinite(ref).all())]
        if bad or not bool(torch.isfinite(together_norms).all() and torch.isfinite(alone_norms).all()):
            raise non_finite_error(bad)
        scale = float(torch.maximum(alone_norms.max(), together_norms.max()))
        if self.autograd_params is None:  # replicated parameters: each alone pass's sum is that example's gradient
            self._check_norms(alone, scale)
        if self.isolated:  # training never puts two examples in one forward: nothing to compare batch with alone
            pass
        elif random:  # the step draws random numbers of its own: batch and alone are not comparable exactly
            ratios = together_norms / alone_norms.clamp_min(1e-30)
            if float(ratios.clamp_min(1e-30).log().mean().exp()) > k ** 0.5:  # ≈ k for a summed loss, ≈ 1 for a mean
                raise self._interaction(together_norms, alone_norms, k, summed=_about_k(ratios, alone_norms, k))
            warnings.warn(RandomStepWarning(self._random_warning()), stacklevel=2)
        elif not self._close(together_norms, alone_norms, scale * k ** 0.5, self.interaction_rtol):
            if not same_norms(together_norms, alone_norms, self.interaction_rtol * scale * k ** 0.5):
                self._distance = float((together_norms - alone_norms).norm()) / (
                    self.interaction_rtol * scale * k ** 0.5 + 1e-12)
                raise self._interaction(together_norms, alone_norms, k)
            permuted = True
        for p, name, ref in zip(self.params, self.names, reference):
            summed = sum(a.sums[p].double() for a in alone)
            size = max(float(summed.norm()), float(together.sums[p].double().norm()), scale * 1e-3)
            # per parameter the fixed rtol: a parameter whose gradient cancels analytically (a bias before a
            # normalisation) keeps rounding of its intermediate terms, whose size is not known here
            if not random and not self.isolated and not self._close(together.sums[p], summed, size):
                self._distance = float((together.sums[p].double() - summed).norm()) / (self.rtol * size + 1e-12)
                raise self._interaction(together_norms, alone_norms, k, name)
            autograd_sum = ref.double() * k
            if not self._close(together.sums[p], autograd_sum, max(size, float(autograd_sum.norm()))):
                if self._differentiated():  # the step's own autograd.grad of the parameters (not an input's)
                    raise parameters_differentiated_error(self._differentiated())
                raise uncaptured_use_error(name, self.precision_hint())
        return permuted


def parameter_entry(name: str, frozen: Collection[str] = ()) -> bool:
    """Whether a fingerprint's entry is (or takes in) a trainable parameter: written outside the gradient, never
    accepted. A parameter named in ``frozen`` (:func:`frozen_parameters`: it does not require grad — a momentum
    copy of the online network) is not: its write is judged like a buffer's, by the replays."""
    if " parameters and buffers on " in name:
        return True
    for prefix in ("parameter ", "contents of parameter "):
        if name.startswith(prefix):
            return name[len(prefix):] not in frozen
    return False


def frozen_parameters(module: nn.Module) -> frozenset[str]:
    """The names of ``module``'s parameters that do not require grad and hold no gradient: a frozen copy (BYOL's,
    MoCo's or DINO's momentum target, a ``copy.deepcopy`` of the online network), not a trainable parameter the
    release must cover (rule 1 covers the parameters that require grad). No backward gives it a gradient, so no
    optimizer steps it, whether one holds it (an optimizer built on ``self.parameters()``) or not. Its writes
    before the release are kept state like a buffer's: accepted when every replay writes them alike (from the
    released weights only), refused when other data sets them apart."""
    return frozenset(name for name, p in module.named_parameters(remove_duplicate=False)
                     if not p.requires_grad and p.grad is None)


def same_norms(a: Tensor, b: Tensor, tolerance: float) -> bool:
    """Whether two vectors of per-example norms are the same up to the order of the examples (sorted, then within
    ``tolerance`` in L2): a batch that reorders its examples (sorted by length before packing) still has one example
    per row, so per-row clipping still bounds each example by C."""
    if a.shape != b.shape:
        return False
    return float((a.double().sort().values - b.double().sort().values).norm()) <= tolerance + 1e-12


def seed_all(seed: int) -> None:
    """One seed for torch's, NumPy's and Python's generators and the ``torch.Generator`` objects the model and the
    callbacks hold (:mod:`~lightning_dp.records.user_generators`): two passes seeded alike draw alike (the callers
    fork the generators, :func:`check_passes`, :func:`~lightning_dp.validators.rng.forked_rngs`)."""
    import random

    import numpy as np

    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    user_generators.reseed(seed)


def gradients_of(loss: Tensor, leaves: Sequence[Tensor]) -> list[Optional[Tensor]]:
    """∂loss/∂leaves by ``torch.autograd.grad``; where the graph holds a ``torch.utils.checkpoint(use_reentrant=True)``
    block on inputs that require grad (Hugging Face's gradient checkpointing with ``use_reentrant=True``), which
    refuses ``.grad()``, by ``loss.backward()`` into the leaves' ``.grad`` instead, their earlier ``.grad`` restored."""
    try:
        return list(torch.autograd.grad(loss, list(leaves), allow_unused=True, retain_graph=True))
    except RuntimeError as err:
        if "use_reentrant=True" not in str(err):
            raise
    saved = [p.grad for p in leaves]
    for p in leaves:
        p.grad = None
    try:
        loss.backward()
        return [p.grad for p in leaves]
    finally:
        for p, g in zip(leaves, saved):
            p.grad = g


def clipping_error(engine: str, name: str, precision: str = "") -> PrivacyConfigurationError:
    """The probe's error when an engine's clipped sum is not the clip factors applied to its per-example gradients
    (``precision``: :meth:`ExampleIndependenceProbe.precision_hint`, the likelier cause when given)."""
    return PrivacyConfigurationError(
        f"Engine '{engine}' clipped the first step's examples wrongly (parameter {name}): its clipped sum is not "
        "the clipping policy's Σ_u c_u g_u (flat: Σ_i min(1, C/‖g_i‖) g_i) of the per-example gradients it computed, "
        f"so one unit's influence would not be bounded by C. Nothing was released. {precision}Try another engine "
        "(per_sample='ghost', 'vmap' or 'opacus_hooks'; 'auto' "
        "tries each engine that serves the model) and please report the model to lightning_dp.")


def _differing(together: Tensor, alone: Tensor) -> int:
    """How many examples' norms differ batch against alone beyond rounding (a count: no values of the data)."""
    return int(((together.double() - alone.double()).abs() > 1e-6 * alone.double().abs().clamp_min(1e-30)).sum())


def norm_mismatch_error(engine: str, precision: str = "") -> PrivacyConfigurationError:
    """The probe's error when an engine's per-example norm is not the norm of that example's gradient (no values:
    they are the training data's; ``precision``: :meth:`ExampleIndependenceProbe.precision_hint`, the likelier
    cause when given)."""
    return PrivacyConfigurationError(
        f"Engine '{engine}' computed a per-example gradient norm that is not the norm of the gradient it computed for "
        "that example alone: clipping by that norm would not bound the example's influence by C. Nothing was "
        f"released. {precision}{'Otherwise this' if precision else 'This'} is the engine's error on one of the "
        "model's layers: try another engine (per_sample='ghost', 'vmap' or 'opacus_hooks'; 'auto' tries each engine "
        "that serves the model) and please report the model to lightning_dp.")


def _scaled_by_batch(together: Tensor, alone: Tensor, k: int) -> bool:
    """Every example's gradient k× its gradient alone (within 2 %): a summed loss."""
    return bool((((together / alone.clamp_min(1e-30)) - k).abs() <= 0.02 * k).all())


def _about_k(ratios: Tensor, alone: Tensor, k: int) -> bool:
    """Under the step's own randomness, a summed loss: every example's gradient alone is not nothing and its batch
    gradient within a factor of 2 of k× it (an in-batch contrastive loss has no gradient alone: zoo28 c01)."""
    return not bool(_vanished(alone, ratios * alone).any()) and bool(((ratios / k).log().abs() <= math.log(2)).all())


def _vanished(alone: Tensor, together: Tensor) -> Tensor:
    """The examples whose gradient alone vanishes (under 1e-6 of the largest in the batch) while the batch gives
    them one: a loss an example gets only from the others (in-batch negatives)."""
    top = float(together.max()) if together.numel() else 0.0
    return (alone <= 1e-6 * top) & (together > 1e-6 * top)


class StateWriteError(PrivacyConfigurationError):
    """The probe's refusal of a forward that wrote the model's own state (:func:`state_mutation_error`): a property
    of the model, not of the engine, and the write has happened: ``per_sample="auto"`` tries no other engine (its
    probe would see the state already written and nothing change)."""


def state_mutation_error(changed: Sequence[str], failure: Optional[BaseException] = None,
                         what: str = "training_step", set_apart: Optional[dict[str, bool]] = None) -> StateWriteError:
    """The user's step changed the model's own state outside the gradient (its parameters, buffers or attributes):
    data-dependent state that the noise never covers (nn.Embedding(max_norm=...) renormalising the rows a batch
    looked up, running statistics, a memory bank); the released model or its checkpoint would reveal it. ``failure``:
    a probe pass failed after the write (:meth:`ExampleIndependenceProbe._run`); its error leads the message, the
    likelier thing to fix (a write it interrupted, or one unrelated to it, is named after it). ``what``:
    ``"training_step"`` (DPStrategy), else a plain loop's loss function (``PrivateStep``'s terms). The first line
    names what was written and the fix; the details follow."""
    lightning = what == "training_step"
    declare = "DPStrategy(public_state={!r})" if lightning else "PrivateStep(..., public_state={!r})"
    declarable = list(dict.fromkeys(public_name(e) for e in changed if not e.startswith("parameter ")))[:3]
    written = [entry.partition(" ")[2] for entry in changed if entry.startswith("parameter ")][:3]
    public = ""
    if written:
        public += (" A parameter masked or constrained in place in the forward (PixelCNN's masked convolution, "
                   "self.weight.data *= self.mask; a max-norm renorm of .data) trains when the forward uses the "
                   "constrained weight instead of writing it: F.conv2d(x, self.weight * self.mask, self.bias, "
                   "self.stride, self.padding) (F.linear alike).")
        public += (" A parameter written outside the gradient (a momentum or EMA copy of the weights updated in "
                   f"{what}) has two ways out: update it after the release (" + ("on_train_batch_end" if lightning
                   else "after optimizer.step()") + ") from the parameters only, or, if it is not derived from the "
                   f"training data, declare it public: {declare.format(written)}. A frozen copy (requires_grad=False, "
                   "in no optimizer) updated from the weights alone is also accepted before the release.")
    lead = ""
    if failure is not None and written and "mutating directly with `.data`" in str(failure):
        failure = None  # functorch refusing the write itself: the write is the thing to fix, not the engine
    subject = f"{what} (its forward or loss)" if lightning else f"{what} given to verify() (its forward or loss)"
    if set_apart and failure is not None and any(text in str(failure) for text in ("in-place operation", _IN_PLACE)):
        failure = None  # (functorch refusing a buffer's in-place write: the write is the thing to fix)
        lead = _buffer_write_lead(subject, set_apart)
        if not any(set_apart.values()):
            return StateWriteError(lead)
    if failure is not None:
        text = (str(failure) if isinstance(failure, PrivacyConfigurationError)
                else f"{type(failure).__name__}: {failure}").rstrip()
        stop = "" if text.endswith(".") else "."
        lead = f"The first step's probe failed: {text}{stop} Fix that first. Before it failed, "
    return StateWriteError(
        lead + (subject if lead else subject[0].upper() + subject[1:]) + " changed the model's own state outside "
        "the gradient: " + ", ".join(changed[:6]) + (" …" if len(changed) > 6 else "") + ". Fix: remove the write "
        "or make it a function of the parameters only; if it is not derived from the training data (a step counter) "
        "or you accept that it leaves unprotected like a logged metric (a list of losses kept for an epoch-end log), "
        f"declare it public: {declare.format(declarable or written)}.\nWhat a step writes from the data "
        "(nn.Embedding(max_norm=...) renormalising the rows the batch looked up, running statistics, an EMA of "
        "activations, a counter or a memory bank kept as an attribute) is released with the model or kept in its "
        "checkpoints without noise, so the guarantee would not hold. Nothing was released. Remove the update "
        "(max_norm=None and normalise functionally, e.g. F.normalize; track_running_stats=False), or make the "
        "state a function of the parameters only." + public)


def _buffer_write_lead(subject: str, set_apart: dict[str, bool]) -> str:
    """The first sentences of a refusal of buffers written in place in the forward, by cause
    (:func:`~lightning_dp.power_iteration.buffers_set_apart`): from the batch, or from the weights alone."""
    batch = [name for name, apart in set_apart.items() if apart]
    if batch:
        return (f"{subject} writes the buffer {', '.join(batch[:3])} in place from the batch: run on one example and "
                "on another, the forward set it apart — a statistic of the batch kept in a buffer (a scale set from a "
                "layer's input in a forward pre-hook), released with the model without noise. Compute it inside the "
                "forward without keeping it. Also, ")
    names = list(set_apart)[:3]
    declare = f"DPStrategy(public_state={names!r})" if subject.startswith("training_step") else \
        f"PrivateStep(..., public_state={names!r})"
    return (f"{subject} writes the buffer {', '.join(names)} in place in the forward, alike on every example: from "
            "the weights, not the batch (a power iteration of a parametrization of your own, as in a spectral "
            "norm). The per-example engine cannot run through an in-place write in the forward, and every pass of a "
            "step would advance it. Fix: use torch.nn.utils.parametrizations.spectral_norm (the library holds its "
            "iteration during the step and advances it once per update, from the released weights; a class of your "
            "own is not run so: its code could read anything), or advance the buffer after the release, in "
            "on_train_batch_end under torch.no_grad() from the weights only, the forward only reading it, and "
            f"declare it public, {declare} (it starts from a random draw, which the checks cannot tell from a "
            "value of the data). Nothing was released.")


class LowestFloat(TorchFunctionMode):
    """Watches one pass: :attr:`lowest` is the floating dtype of least precision among the results of the torch calls
    it made (a float64 model that computes its rotary embedding in float32 computes, in part, in float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.lowest: Optional[torch.dtype] = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, Tensor) and t.is_floating_point() and (
                    self.lowest is None or torch.finfo(t.dtype).eps > torch.finfo(self.lowest).eps):
                self.lowest = t.dtype
        return out


class NoDropout(TorchFunctionMode):
    """Dropout off while the probe runs, the model otherwise in its own modes: torch's dropout functions return their
    input (``nn.Dropout``, ``F.dropout`` in Hugging Face's attention), and the functions that take a dropout
    probability as an argument run with 0: ``scaled_dot_product_attention`` (``dropout_p``),
    ``multi_head_attention_forward`` (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``: the mode is not
    active inside a function it handles, so the dropout it calls itself would not be seen) and the recurrent layers'
    kernels (``nn.LSTM``/``GRU``/``RNN``'s dropout between layers); the engines' replays inside the probe see the
    same. The mode stays on during a backward (``loss.backward()``, ``torch.autograd.grad``) called under it: torch
    pops a mode while it handles a call, so without :func:`_keeping` the backward ran with dropout on, and a
    ``torch.utils.checkpoint`` block (Hugging Face's ``gradient_checkpointing_enable()``) recomputed its forward there
    with other operations than it ran (a dropout mask saved, another attention kernel): torch refused the backward
    (``CheckpointError``: recomputed values ... have different metadata)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BACKWARDS:
            return _keeping(self, func, types, args, kwargs)
        name = getattr(func, "__name__", "")
        if name in DROPOUT_FUNCTIONS:
            return args[0] if args else kwargs["input"]
        if name in _DROPOUT_ARGUMENT:
            args, kwargs = _no_dropout_argument(name, tuple(args), kwargs)
        return func(*args, **kwargs)


_BACKWARDS = (Tensor.backward, torch.autograd.backward, torch.autograd.grad)
"""The calls that run a backward, where a checkpointed forward is recomputed (:class:`NoDropout`)."""


def _keeping(mode: TorchFunctionMode, func, types, args: tuple, kwargs: dict):
    """``func`` (one of :data:`_BACKWARDS`) called with ``mode`` pushed back on torch's mode stack for its duration,
    its own dispatch to ``mode`` skipped (``torch.overrides.redispatch_function``, torch ≥ 2.13; older torch: the
    private ``torch._C._skip_one_hop_torch_function`` where it exists, else the mode stays off as before)."""
    redispatch = getattr(torch.overrides, "redispatch_function", None) or getattr(
        torch._C, "_skip_one_hop_torch_function", None)
    if redispatch is None:
        return func(*args, **kwargs)
    with mode:
        return redispatch(func, types, args, kwargs)


_DROPOUT_ARGUMENT: dict[str, tuple[Optional[int], str]] = {
    "scaled_dot_product_attention": (4, "dropout_p"),   # (query, key, value, attn_mask, dropout_p, …)
    "multi_head_attention_forward": (10, "dropout_p"),  # (query, key, value, embed_dim, num_heads, in_proj_weight,
    #                                                      in_proj_bias, bias_k, bias_v, add_zero_attn, dropout_p, …)
    "lstm": (None, "dropout"), "gru": (None, "dropout"), "rnn_tanh": (None, "dropout"), "rnn_relu": (None, "dropout"),
}
"""torch functions taking a dropout probability: (its position, or ``None`` for the first float argument; its name)."""


def _no_dropout_argument(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` of a call to ``name`` (:data:`_DROPOUT_ARGUMENT`) with its dropout probability 0. The
    recurrent kernels (``_VF.lstm(input, hx, weights, bias, num_layers, dropout, train, …)``, with ``batch_sizes``
    after ``input`` for a packed sequence) take no other float."""
    position, key = _DROPOUT_ARGUMENT[name]
    if position is None:
        position = next((i for i, a in enumerate(args) if type(a) is float), len(args))
    elif key in kwargs or position >= len(args):
        return args, {**kwargs, key: 0.0}
    if position < len(args):
        return (*args[:position], 0.0, *args[position + 1:]), kwargs
    return args, kwargs


DROPOUT_FUNCTIONS: frozenset[str] = frozenset({
    "dropout", "dropout_", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "alpha_dropout_",
    "feature_alpha_dropout", "feature_alpha_dropout_", "feature_dropout", "feature_dropout_"})
"""torch functions whose training-mode result is a random mask: the identity during the probe."""


@contextmanager
def check_passes(module: nn.Module, params: Sequence[Tensor], engine: GradSampleEngine) -> Iterator[None]:
    """Where the checks run the user's step (the probe, the batch check): stochastic-depth modules in eval, dropout
    off (:class:`NoDropout`), the RNG forked; afterwards the engine's captures dropped and the modes and the
    parameters' ``.grad`` as they were."""
    saved = [p.grad for p in params]
    modes = [(m, m.training) for m in module.modules() if _drops_paths(m)]
    for m, _ in modes:
        m.training = False
    try:
        with torch.random.fork_rng(devices=[]), user_generators.forked(), NoDropout():
            yield
    finally:
        engine.begin_step(None)
        for m, mode in modes:
            m.training = mode
        for p, g in zip(params, saved):
            p.grad = g


def _drops_paths(m: nn.Module) -> bool:
    """A stochastic-depth module (timm's ``DropPath``, torchvision's ``StochasticDepth``, ``DropBlock``): it draws its
    masks with ``bernoulli_``, not a dropout function, and is the identity in eval mode."""
    name = type(m).__name__
    return m.training and any(key in name for key in ("DropPath", "StochasticDepth", "DropBlock"))


def interaction_error(together: Tensor, alone: Tensor, k: int, name: Optional[str] = None,
                      summed: bool = False, engine: Optional[str] = None,
                      sorted_batch: bool = False, weighted_mean: bool = False,
                      precision: str = "") -> PrivacyConfigurationError:
    """The probe's error when example i's gradient depends on the other examples of the batch (``engine``: the
    engine that computed them, named as the other possible cause; ``sorted_batch``: the step sorted a tensor, the
    likeliest cause then, :func:`~.step_calls.sorted_batch_hint`; ``weighted_mean``: the step took a class-weighted
    mean loss, :func:`~.step_calls.weighted_mean_hint`; ``precision``: the forward computed in half precision under
    float32's tolerance, :meth:`ExampleIndependenceProbe.precision_hint`). The cause and its fix come first: a summed
    loss (every gradient k× its gradient alone) is named as such, with nothing else; so is a loss an example gets only
    from the others (its gradient alone vanishes: in-batch negatives, :func:`_vanished`)."""
    if summed or _scaled_by_batch(together, alone, k):
        return PrivacyConfigurationError(
            "The loss is a SUM over the batch (e.g. reduction='sum'): return the MEAN over examples "
            "(reduction='mean'), or the vector of per-example losses from training_step (DPStrategy takes its mean). "
            f"The first step's probe found each example's gradient in a batch of {k} to be {k}× its gradient alone, "
            "so per-example clipping would not bound one example's influence by C. Nothing was released.")
    vanished = int(_vanished(alone, together).sum())
    if vanished:  # the cause is the loss itself: name it, and the fixes, first (zoo28 c01-c07)
        return PrivacyConfigurationError(
            f"Each example's loss depends on the other examples of the batch (in-batch negatives): the first step's "
            f"probe found the gradient of {vanished} of {k} examples to vanish when computed alone and not in the "
            "batch, as in a contrastive loss over the batch (SimCLR's NT-Xent, InfoNCE and CLIP, SupCon, MoCo with "
            "in-batch keys, batch-hard triplet mining, prototypes from the batch) or a loss centred on a batch "
            "statistic (h - h.mean(0)). Returning its mean or a vector of "
            "per-example losses does not change that, and per-example clipping cannot bound one example's influence "
            "on the others' terms by C. Nothing was released. Make each example's loss its own: negatives from a "
            "public negative bank (a fixed buffer of embeddings of public data or of random directions, never "
            "written from the batch), or a per-example objective (docs/models.md, \"Contrastive losses\").")
    hinted = sorted_batch or weighted_mean or bool(precision)
    cause = (f"{'Other possible' if hinted else 'Likely'} causes: "
             "a loss normalised by a batch-wide count (a token mean over all non-pad tokens of the batch, e.g. "
             "cross_entropy(..., ignore_index=-100) on [B·T] logits, Hugging Face's default LM loss; a segmentation "
             "loss's mean over the batch's non-void pixels, cross_entropy(out, mask, ignore_index=255) on [B, C, H, W]"
             "): use lightning_dp.per_example_token_mean(logits, targets, ignore_index=...) ([B, T, V] or "
             "[B, C, H, W] logits), which averages each example's own tokens or pixels, or return per-example "
             "losses from training_step; an operation across the batch"
             " (h - h.mean(0), batch statistics, attention or pooling over dimension 0); a layer on flattened rows"
             " that are not example-major (h.transpose(0, 1).reshape(-1, d): flatten the [B, T, d] tensor itself, "
             "so example i owns rows i*T...(i+1)*T-1); or randomness other than dropout in the forward.")
    if engine is not None and not hinted:
        cause += (f" If the examples are independent (a non-private step on each alone agrees), engine '{engine}' "
                  "gets one of the layers' per-example gradients wrong: try another (per_sample='ghost', 'vmap' "
                  "or 'opacus_hooks'; 'auto' tries each engine that serves the model) and please report it.")
    found = precision + (weighted_mean_hint() if weighted_mean else "") + (sorted_batch_hint() if sorted_batch else "")
    where = f" (parameter {name})" if name else ""
    return PrivacyConfigurationError(  # a recognised cause and its fix first (qa12 b06: it came after the generic text)
        f"Examples interact{where}: {found}The first step's probe computed the same examples' gradients as one batch "
        f"of {k} and one by one, and they differ (for {_differing(together, alone)} of the {k}; no gradient values "
        "are quoted: they are the training data's). Per-example clipping then does not bound one example's "
        f"influence by C. Nothing was released. {cause}"
    )


def detached_loss_error(loss: Tensor) -> PrivacyConfigurationError:
    """The probe's error when the step's loss has no autograd history (``grad_fn`` is None): a loss taken out of the
    graph (``.item()``, ``.detach()``, ``.numpy()``) and wrapped in a new tensor has no gradient path to the model."""
    leaf = " (a new tensor with requires_grad=True)" if loss.requires_grad else ""
    return PrivacyConfigurationError(
        f"The loss training_step returned is detached from the model{leaf}: it has no gradient path to any "
        "parameter, e.g. torch.tensor(loss.item(), requires_grad=True) or loss.detach(). Return the loss tensor "
        "computed from the model's output itself (log loss.item() separately if you need a number). Nothing was "
        "released.")


class StepFailedError(PrivacyConfigurationError):
    """:func:`probe_failure_error`: the user's own step raised in a check's pass (its cause is the user's exception)."""


def probe_failure_error(err: Exception, k: int) -> PrivacyConfigurationError:
    """The probe's error when the user's training_step fails on a batch of ``k`` examples, with the likely
    cause: an in-place op on an output that torch's full backward hooks wrap (the opacus_hooks engine), a
    forward that insists on training mode (the probe turns dropout off by putting every module without
    parameters of its own in eval mode), or a step that does not accept every batch size."""
    text = f"{type(err).__name__}: {err}"
    if "is a view and is being modified inplace" in text:
        cause = ("A layer's output is modified in place (e.g. q = self.q(h); q /= s) and the engine wraps that "
                 "output in a custom autograd function (per_sample='opacus_hooks' uses torch's full backward hooks, "
                 "which forbid it). Use per_sample='ghost' or 'vmap' (both serve it), or write q = q / s.")
    elif _engine_frame(err) is not None:
        cause = (f"The failure is inside the per-example engine ({_engine_frame(err)}), not in your training_step: "
                 "the engine cannot serve this model as it is. Try another engine (per_sample='ghost', 'vmap' or "
                 "'opacus_hooks'), and please report the model to lightning_dp.")
    elif type(err).__name__ == "CheckpointError":
        cause = ("A torch.utils.checkpoint block (Hugging Face's gradient_checkpointing_enable()) recomputed its "
                 "forward in the backward with other operations than it ran: the probe runs the step with dropout off "
                 "and keeps it off inside the backward only where torch has torch.overrides.redispatch_function "
                 "(2.13). Upgrade torch, or set the model's dropout probabilities to 0, or train without gradient "
                 "checkpointing.")
    elif isinstance(err, InterruptedRun):
        cause = (f"Your code raised {type(err.__cause__).__name__} while the check ran the step on these examples: "
                 "the checks run training_step and the batch's hooks again, and a run again that raises ends as a "
                 "failed run, never as the fit's end (an interrupt raised from what a batch holds — its loss, its "
                 "labels — would decide how many releases the fit makes). Stop a fit from a hook with "
                 "trainer.should_stop = True on a public condition (the step count, the wall clock), or raise "
                 "outside the fit.")
    elif re.search(r"\btrain(ing)?\b|\.train\(\)", str(err), re.IGNORECASE):
        cause = ("The probe runs the forward with dropout off: every module without parameters of its own is in "
                 "eval mode (layers with parameters stay in training mode). A forward that requires training mode "
                 "there cannot be probed: make the check read a layer with parameters, or drop it.")
    else:
        cause = ("Poisson sampling makes batches of any size ≥ 0, so training_step must accept them (e.g. avoid "
                 ".squeeze() on the batch dimension).")
    kind = PrivacyConfigurationError if _engine_frame(err) is not None else StepFailedError
    return kind(f"The first step's probe ran training_step on a batch of {k} example(s) and it failed ({text}). "
                f"{cause}")


def non_finite_error(names: Sequence[str]) -> PrivacyConfigurationError:
    """The probe's error when the gradients themselves are NaN or infinite (nothing else can be compared)."""
    where = f" (autograd's gradient of {', '.join(names[:4])}{' …' if len(names) > 4 else ''})" if names else ""
    return PrivacyConfigurationError(
        f"The first step's probe found gradients that are not finite (NaN or inf){where} on the first examples of "
        "the batch: the model's forward or loss produces them, privately or not (e.g. a softmax over a fully "
        "masked row, log of zero, a sequence shorter than a layer's window or stride), or a statistic over the "
        "batch's examples (a batch standardised by its own mean and std in a collate_fn or the forward: the std of "
        "one example is NaN — and such examples interact, which a private step refuses too). Clipping a NaN gives "
        "NaN, so "
        "nothing was released. Fix the model or the data (check a non-private step on the same batch).")


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # lightning_dp/
_ENGINE_DIR = os.path.join(_PACKAGE, "grad_sample") + os.sep  # the engines and their capture
_HARNESS = ("private_step.py", os.path.join("validators", "probe.py"), os.path.join("validators", "step_calls.py"))
_OPACUS = f"{os.sep}opacus{os.sep}"


def _engine_frame(err: BaseException) -> Optional[str]:
    """``file:line`` of the deepest frame of ``err``'s traceback in the engine's own code (capture, broadcast sites,
    grad_sample, and Opacus' hooks; not the probe or the step that call the user's code), or None."""
    found = None
    for frame in traceback.extract_tb(err.__traceback__):
        name = os.path.abspath(frame.filename)
        if name.startswith(_ENGINE_DIR) and not name.endswith(_HARNESS):
            found = f"{os.path.relpath(name, _PACKAGE)}:{frame.lineno}"
        elif _OPACUS in name:  # the opacus_hooks engine's rules and hooks run inside the user's forward and backward
            found = f"opacus{os.sep}{name.split(_OPACUS, 1)[1]}:{frame.lineno}"
    return found


_IN_PLACE = "torch.func refused an in-place write"


def engine_failure_error(err: Exception) -> PrivacyConfigurationError:
    """The probe's error when the engine itself fails computing the first examples' per-example gradients."""
    where = _engine_frame(err) or "the engine"
    if "in-place operation" in str(err) and "captured Tensor" in str(err):  # torch.func's refusal of a write
        return PrivacyConfigurationError(
            f"The per-example engine failed on this model in the first step's probe ({type(err).__name__}: {_IN_PLACE} "
            f"in the forward; at {where}): the forward writes a tensor it does not take "
            "as input — a buffer updated in place (copy_, add_, under torch.no_grad(): a power iteration of a "
            "parametrization of your own, a running statistic), declared public or not. No engine runs through it. "
            "Nothing was released. Move the write out of the forward (after the release, in on_train_batch_end, "
            "from the weights only), or use torch.nn.utils.parametrizations.spectral_norm for a spectral norm.")
    return PrivacyConfigurationError(
        f"The per-example engine failed on this model in the first step's probe ({type(err).__name__}: {err}; at "
        f"{where}): it cannot serve the model as it is. Nothing was released. Try another engine (per_sample='ghost', "
        "'vmap' or 'opacus_hooks'; 'auto' tries each engine that serves the model), and please report the model to "
        "lightning_dp.")


def parameters_differentiated_error(name: str) -> PrivacyConfigurationError:
    """The probe's error when the user's step takes the gradient of its loss with respect to the parameters itself
    (``torch.autograd.grad(loss, self.parameters())``) and the engine's sums then disagree with autograd's."""
    return PrivacyConfigurationError(
        f"training_step takes a gradient with respect to the model's parameters itself (torch.autograd.grad with "
        f"parameters such as {name} among its inputs): that is the batch's raw gradient, which no noise covers — "
        "logged, kept or used in the loss (a gradient norm, a sharpness penalty) it releases the training data "
        "unprotected — and its backward runs through the per-example engine's capture a second time, so the "
        "per-example gradients no longer add up to autograd's. Nothing was released. Read gradients after the "
        "release (on_before_optimizer_step sees the noised ĝ), or compute a penalty from public data.")


def uncaptured_use_error(name: str, precision: str = "") -> PrivacyConfigurationError:
    """The probe's error when autograd's gradient of a parameter differs from the engine's sum (``precision``:
    :meth:`ExampleIndependenceProbe.precision_hint`, added when given)."""
    return PrivacyConfigurationError(
        f"Parameter {name} receives gradient through a use the per-example engine does not capture: its "
        "per-example gradients do not add up to autograd's gradient. Typical causes: the parameter is also used "
        "outside the forward of the module that owns it (a functional call such as F.linear(h, self.emb.weight) "
        "for weight tying: make the output layer an nn.Linear whose .weight is the embedding's Parameter), a "
        "parameter read directly in a parent module's forward, or a torch.compile'd graph that bypasses the "
        f"engine's hooks. Nothing was released.{' ' + precision.rstrip() if precision else ''}"
    )
