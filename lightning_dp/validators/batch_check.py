"""Interaction checks beyond the first step: the probe's comparison, on a step's own sampled batch.

The first step's probe (:mod:`.probe`) compares k ≤ 6 fixed examples in a batch and alone. What it cannot see:
behaviour that starts after the first step (in-batch negatives after a warm-up), an effect that needs a larger
batch (hard-example mining keeping the top 8 of 64 losses), first records that are not representative
(class-sorted data with a class-weighted loss), and a coupling below its tolerance (a small batch-covariance
penalty). The batch check runs on the Poisson batch of the step being taken (its first step and later steps
chosen by :mod:`.schedule`), before that step's release, with clipping off (C = ∞), dropout off and one seed for
every pass, on m of the batch's examples (all of them up to ``max_examples``):

    g_i^all            the engine's per-example gradients of the m examples as one batch
    g_i^H, g_i^R       the same for a random half H and the rest R, each as one batch
    g_j^alone          two random examples, each as a batch of one

and requires, with τ = :func:`batch_tolerance` (from the compute dtype) and s = max_i ‖g_i^all‖ (the norms' scale),

    | ‖g_i^all‖ − ‖g_i^part‖ | ≤ τ · s                 for every example i of every part (H, R, alone)
    ‖S_H + S_R − S_all‖_p     ≤ τ · Σ_i ‖g_i^all‖       for every parameter p (S: the unclipped sums)

When ``training_step`` sees more examples at once than the m compared (a batch of 300, physical batches of
``max_physical_batch_size`` or the whole batch), the m examples pass once more among others of the batch, as many as
the step sees: each must keep its norm (code that standardises or mixes its batch only above a size runs there).

Halving the batch changes, for every example, which others share its batch: an example's gradient that depends on
the others moves for some example (top-k: the halves keep other examples; a batch statistic: both halves differ from
the whole; in-batch negatives: each example loses half its negatives), while rounding moves it by a few ulps. It
costs about two passes over the batch.

A step that draws random numbers of its own (augmentation or MixUp inside ``training_step``, seen by the first
probe) cannot be compared across batch sizes: its draws depend on the batch's shape. For it the batch runs twice with
one seed and one size, a random half of its examples replaced both times by copies of the others, other copies each
time (so a collate padding to the batch's longest gives both one shape too); every example that kept its own data
must keep its gradient (:meth:`BatchInteractionCheck._replacement`). Dropout is no such draw: it is off in every pass
(:class:`~.probe.NoDropout`, attention's and the recurrent layers' included).

**Draws.** Every pass of a round starts from one state of the generators (torch's CPU and CUDA ones, NumPy's,
Python's, those the model and the callbacks hold), restored afterwards. Round 0 starts from the real step's own:
as the step began (:meth:`~lightning_dp.records.fresh_randomness.FreshRandomness.started`; the passes replay the
batch-start hooks), else as the generators are before its ``training_step``
(:mod:`~lightning_dp.records.generator_states`). A coin tossed per batch (timm's ``Mixup(prob=p)``:
``if np.random.rand() < p: mix``) lands in the check exactly when it lands in the step: a checked step whose coin
lands is refused before its release. If a pass of round 0 drew from any generator (the step draws at all, whatever
it drew), the replacement test runs again from ``k`` other seeds (rounds 1 … k, each on at most
:data:`DRAW_EXAMPLES` of the examples, all passes of a round from its seed): ``k`` = :data:`FIRST_DRAWS` at the first
step's checks, :data:`LATER_DRAWS` at later ones. An interaction in any round refuses, naming "a random draw switches
an interaction on" (a step that drew and fails the halves in round 0 is judged by the replacement test, as a step the
probe saw draw: draws that follow the batch's shape differ between halves). So an interaction a coin of probability
p switches on is seen, by the end of the first step (c = 2 checks when the plan has later steps: the sampled batch
as now and as at the plan's last step, each with k₁ = 8 seeds), unless all c·k₁ + 1 = 17 independent tosses miss:
(1 − p)^17 ≈ 0.023 for p = 0.2, 0.17 for p = 0.1; each of n later checks adds k₂ + 1 = 4 more: (1 − p)^(17 + 4n)
≈ 0.02 for p = 0.1 after n = 5. Until then a step whose own coin lands is released only if it is not checked.
What the seeds cannot reproduce exactly: a coin drawn in the collate or a transfer hook (drawn from the fetch's
generators before the step began: the other seeds only) or after a dropout mask in the forward (the passes draw no
mask). Cost, measured (784-256-10 MLP, batch 64, one CPU thread): a step that draws takes 0.35 s per later check
instead of 0.17 s, the first step's 0.94 s instead of 0.60 s; a step that draws nothing pays nothing more.

Last, the whole batch passes once more with the training data's other copies in memory exchanged for other values
(:mod:`lightning_dp.record_checks.outside_records`): a step that reads only its batch gives bit for bit the same
gradients; one that reads other
records (neighbours, negatives, soft targets from the training tensors or a copy of them) does not.

A float32 refusal within :data:`~lightning_dp.tolerance.NEAR_MISS` τ is judged again in float64, where round-off
vanishes and an interaction stays (:meth:`BatchInteractionCheck._rejudged`, :mod:`lightning_dp.wide_replay`).
"""

from __future__ import annotations

import random
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.engine_api import ClippedBatch
from lightning_dp.records.generator_states import GeneratorStates, taken
from lightning_dp.record_checks.outside_records import ExchangedRecords, outside_records_error
from lightning_dp.validators.probe import ExampleIndependenceProbe, check_passes, frozen_parameters, seed_all
from lightning_dp.validators.step_calls import sorted_batch_hint, weighted_mean_hint
from lightning_dp.tolerance import NEAR_MISS, REJUDGED_ULPS, batch_tolerance
from lightning_dp.wide_replay import in_float64

__all__ = ["BatchInteractionCheck", "batch_interaction_error", "batch_tolerance", "FIRST_DRAWS", "LATER_DRAWS"]

FIRST_DRAWS = 8
"""Other seeds a step that draws random numbers is compared under at the first step's checks (module docstring)."""

LATER_DRAWS = 3
"""The same at each later check."""

DRAW_EXAMPLES = 32
"""The most examples compared under each other seed (a coin tossed per batch does not need the whole batch)."""


class BatchInteractionCheck(ExampleIndependenceProbe):
    """The check of the module docstring for one model, engine and parameter list (as :class:`ExampleIndependenceProbe`,
    whose passes it shares; ``rtol`` is τ).

    Args (besides the probe's):
        rng: the random choice of the examples compared (OS-seeded by the caller; never the data's).
        max_examples: m, the most examples of the batch taken as "all".
        outside: the training data's copies to exchange for the last pass (``None``: no such pass). ``loss_of`` must
            then give a batch the loss of the records it read for the first pass of those examples (not read again
            from the exchanged data).
        draws: k, the other seeds a step that draws random numbers is compared from (module docstring, "Draws").
    """

    def __init__(self, *args, rng: Optional[random.Random] = None, max_examples: int = 128,
                 outside: Optional[ExchangedRecords] = None, draws: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rng = rng or random.Random()
        self.max_examples = max_examples
        self.outside = outside
        self.draws = draws
        self.round = 0
        """The generators' state the passes start from: 0, the real step's own; 1 … ``draws``, another seed each (a
        reader of the batch keys what it caches by it: a collate's coin is tossed again in each round)."""
        self.drew = False
        """Set by :meth:`check`: a pass drew from a random generator (the step draws random numbers of its own)."""
        self._real: Optional[Callable[[], None]] = None
        self._set: Optional[GeneratorStates] = None
        self._seeds: list[int] = []

    def check(self, indices: Sequence[int], step: int, random_step: bool = False, as_of: str = "",
              real_size: int = 0, ordered: bool = False, built: bool = False,
              start: Optional[Callable[[], None]] = None) -> None:
        """Check the batch ``indices`` of step ``step``; raises :class:`PrivacyConfigurationError` (nothing changes).
        ``random_step``: the step draws random numbers of its own (augmentation in ``training_step``, MixUp): the
        replacement test runs instead (:meth:`_replacement`), at the batch's ``real_size``. ``as_of``: when the model
        was made to believe it runs (the first step checks the plan's later steps too), for the refusal's message.
        ``real_size``: how many examples the step's ``training_step`` really sees at once (the batch, or its physical
        batches): above ``max_examples``, the compared examples are also passed in a batch of that size
        (:meth:`_at_real_size`: code that changes what it does above a batch size shows there). ``ordered``: the
        halves are the first and the second half of ``indices`` as given (a batch built with a pair of records of
        each label, one of each pair in each half: :mod:`~lightning_dp.records.constructed_batches`); ``built``:
        the batch was built so, not sampled (the refusal says which); ``start``: puts the generators as the step
        began, before its batch-start hooks (which the passes replay); default: as they are now, before the step's
        ``training_step``."""
        self._real = start or taken().restore  # every pass of round 0 starts from the real step's own states
        self._as_of, self._ordered, self._built = as_of, ordered, built
        self._seeds = [self.rng.randrange(2**32) for _ in range(self.draws)]
        chosen = list(indices)
        limit = max(self.max_examples, real_size) if random_step else self.max_examples
        if len(chosen) > limit:
            chosen = chosen[:limit] if ordered else self.rng.sample(chosen, limit)
        if len(chosen) < 2:
            return  # one example cannot interact with another
        # a frozen copy the step writes (a momentum target from the weights) put back before each pass and after them
        self._frozen_kept = [(p, p.detach().clone()) for name, p in self.module.named_parameters()
                             if name in frozen_parameters(self.module)]
        try:
            with check_passes(self.module, self.params, self.engine):
                self._rejudged(lambda: self._compared(chosen, list(indices), step, random_step, real_size))
        finally:
            self._put_frozen_back()
            self._frozen_kept = []

    def _compared(self, chosen: list[int], indices: list[int], step: int, random_step: bool, real_size: int) -> None:
        """The comparisons of the module docstring (the replacement test for a step that draws random numbers), from
        the real step's generators; then, if a pass drew, the replacement test from each of the other seeds."""
        self._worst, self._near = 0.0, None  # type: float, Optional[float]  (distances in τ: :meth:`_rejudged`)
        self.round, self.drew = 0, False
        if random_step:
            self._replacement(chosen, step)
        else:
            try:
                whole = self._halves(chosen, step)
                if min(real_size, len(indices)) > len(chosen):
                    self._at_real_size(indices, chosen, whole, min(real_size, len(indices)), step)
            except PrivacyConfigurationError:
                if not self.drew:
                    raise  # a step that draws (a coin the probe never saw land) is judged as one: draws follow shapes
                self._worst, self._near = 0.0, None
                self._replacement(chosen, step)
        if not self.drew:
            return  # nothing drawn: every seed gives these passes
        few = chosen if len(chosen) <= DRAW_EXAMPLES else self.rng.sample(chosen, DRAW_EXAMPLES)
        for self.round in range(1, self.draws + 1):
            self._replacement(few, step)

    def _seed(self, seed: int) -> None:
        """Every pass of a round starts from one state (the probe's passes call this with their seed: unused here):
        round 0 from the real step's own (:attr:`_real`), round r from the r-th other seed."""
        if self.round == 0 and self._real is not None:
            self._real()
        else:
            seed_all(self._seeds[self.round - 1])
        self._set = None if self.drew else taken()

    def _engine_pass(self, indices: list[int], seed: int = 0, rule=None) -> ClippedBatch:
        batch = super()._engine_pass(indices, seed, rule)
        if self._set is not None and self._set.moved():
            self.drew = True
        return batch

    def _rejudged(self, compare: Callable[[], None]) -> None:
        """``compare()``; a near miss it refuses in float32 (examples interacting by at most :data:`NEAR_MISS` τ) is
        compared once more, the same examples in the same parts, in float64 (:func:`~lightning_dp.wide_replay.
        in_float64`) at :data:`REJUDGED_ULPS` float32 ulps: round-off of float32 vanishes there, an interaction that
        float32 saw stays (1e-5 of another example's input: about 100 ulps). The refusal stands unless that pass
        computed in float64 throughout and found nothing."""
        state = self.rng.getstate()
        try:
            compare()
        except PrivacyConfigurationError as err:
            low = self.rtol != batch_tolerance(torch.float32, torch.device("cpu"))
            if self._near is None or self._near > NEAR_MISS or low:
                raise
            self.rng.setstate(state)
            rtol, self.rtol, self._near = self.rtol, REJUDGED_ULPS * torch.finfo(torch.float32).eps, None
            try:
                with in_float64(self.module) as wide:
                    compare()
            except Exception:  # noqa: BLE001  (refused again, or the model cannot run in float64: the verdict stands)
                raise err from None
            finally:
                self.rtol = rtol
            if not wide.complete:
                raise err from None

    def _interacting(self, step: int, m: int, differing: int, summed: Sequence[str]) -> PrivacyConfigurationError:
        """:func:`batch_interaction_error`, the comparison's worst distance kept for :meth:`_rejudged`."""
        self._near = self._worst
        return batch_interaction_error(step, m, differing, summed, self.engine.name, self._as_of,
                                       (1 + self.draws) if self.drew else 0, self._built, self._likely_cause())

    def _likely_cause(self) -> str:
        """What the step's own calls, as the passes saw them (:class:`~.step_calls.StepWatch`), say the interaction
        likely is: a class-weighted mean loss (the probe's first examples may all share a label, so only a sampled
        batch shows it: public constant class weights, qa39 c10), a sort of the batch; "" when neither."""
        return ((weighted_mean_hint() if self._calls.weighted_mean else "")
                + (sorted_batch_hint() if self._calls.sorted else ""))

    def _halves(self, chosen: list[int], step: int) -> ClippedBatch:
        """The comparison of the module docstring: the batch, its two halves, two examples alone (returns the batch's
        pass)."""
        order = list(range(len(chosen)))
        if not self._ordered:
            self.rng.shuffle(order)
        half, rest = sorted(order[: len(order) // 2]), sorted(order[len(order) // 2:])
        lone = self.rng.sample(range(len(chosen)), min(2, len(chosen)))
        whole = self._engine_pass(chosen)
        parts = [self._engine_pass([chosen[i] for i in part]) for part in (half, rest)]
        alone = [self._engine_pass([chosen[i]]) for i in lone]
        self._verdict(whole, [(half, parts[0]), (rest, parts[1]), *(([i], a) for i, a in zip(lone, alone))], step)
        self._exchanged(chosen, whole, step)
        return whole

    def _at_real_size(self, indices: list[int], chosen: list[int], whole: ClippedBatch, size: int, step: int) -> None:
        """The compared examples once more among others of the batch, ``size`` in all (the size the step's
        ``training_step`` sees): each must keep the gradient norm it had in the compared batch. Code that standardises
        or mixes its batch only above a size (``if len(x) > 128``) never runs in the compared batch; here it does."""
        taken = set(chosen)
        others = self.rng.sample([i for i in indices if i not in taken], size - len(chosen))
        full = self._engine_pass([*chosen, *others])
        norms = whole.norms.double()
        if not bool(torch.isfinite(norms).all()):
            return
        differing = self._norms_apart(norms, full.norms.double()[: len(chosen)], norms)
        if differing:
            raise self._interacting(step, size, differing, [])

    def _replacement(self, chosen: list[int], step: int) -> None:
        """For a step that draws random numbers: the batch twice with one seed, a random half R of its examples
        replaced both times by copies of the others (the kept examples K), by another copy each time. An example of K
        keeps its own data, its place and its own draws in both passes: its gradient may change only if it depends
        on other examples (MixUp pairs example i with example π(i): for about half of them π(i) is in R, whose data
        differ between the passes). Both batches hold only K's records, so a collate that pads to the batch's longest
        gives them one shape, and draws whose layout follows the batch's shape (a token mask of shape [B, L]) are the
        same too; against the batch itself, R's longest example would change L and every draw (:func:`_donors`)."""
        order = list(range(len(chosen)))
        self.rng.shuffle(order)
        replaced = sorted(order[: len(order) // 2])
        kept = [i for i in range(len(chosen)) if i not in set(replaced)]
        first, second = _donors(kept, len(replaced), self.rng)
        # one example kept (a batch of two): it is compared with the batch itself
        base_indices = chosen if second is None else [chosen[i] for i in _placed(len(chosen), replaced, second)]
        base = self._engine_pass(base_indices)
        other = self._engine_pass([chosen[i] for i in _placed(len(chosen), replaced, first)])
        norms = base.norms.double()
        differing = self._norms_apart(norms[kept], other.norms.double()[kept], norms)
        if differing:
            raise self._interacting(step, len(chosen), differing, [])
        self._exchanged(base_indices, base, step)

    def _exchanged(self, chosen: list[int], whole: ClippedBatch, step: int) -> None:
        """The batch once more with the training data's other copies exchanged
        (:mod:`lightning_dp.record_checks.outside_records`): every
        per-example norm and every parameter's sum must be the first pass's; a failure only this pass meets is the
        step reading the exchanged data too (round 0 only)."""
        if self.outside is None or not self.outside.arrays or self.round:
            return
        start, self._start_state = self._start_state, None  # the user's state put back before the exchange, not in
        if start is not None:                                # it (the exchanged copies are the user's tensors too)
            start()
        try:
            with self.outside.exchanged():
                try:
                    other = self._engine_pass(chosen)
                except Exception as err:  # noqa: BLE001  (the same batch ran before: only the exchange can fail it)
                    raise outside_records_error(step, 0, [], self.outside.names, err, self._as_of) from err
        finally:
            self._start_state = start
        norms, moved = whole.norms.double(), other.norms.double()
        if not bool(torch.isfinite(norms).all()):
            return
        differing = self._norms_apart(norms, moved, norms) if moved.shape == norms.shape else len(chosen)
        summed = self._sums_apart(whole, lambda p: other.sums[p].double())
        if differing or summed:
            raise outside_records_error(step, differing, summed, self.outside.names, None, self._as_of)

    def _verdict(self, whole: ClippedBatch, parts: list[tuple[list[int], ClippedBatch]], step: int) -> None:
        norms = whole.norms.double()
        if not bool(torch.isfinite(norms).all()):
            return  # not finite: the first probe names it; nothing to compare here
        differing = len(set().union(*(self._positions_apart(positions, part, norms) for positions, part in parts)))
        if differing and _reordered(norms, [part.norms.double() for _, part in parts], self._norm_tolerance(norms)):
            differing = 0  # the rows are the examples in another order (a batch sorted before packing): served
        half, rest = parts[0][1], parts[1][1]
        summed = self._sums_apart(whole, lambda p: half.sums[p].double() + rest.sums[p].double())
        if differing or summed:
            raise self._interacting(step, len(norms), differing, summed)

    def _norm_tolerance(self, norms: Tensor) -> float:
        """τ · s: the norms' scale s = max_i ‖g_i^all‖ (module docstring)."""
        return self.rtol * (float(norms.max()) if norms.numel() else 0.0) + 1e-12

    def _positions_apart(self, positions: list[int], part: ClippedBatch, norms: Tensor) -> set[int]:
        """The examples (positions in the whole batch) whose norm in ``part`` differs from the whole batch's: an
        example compared in a half and alone is counted once (the refusal said 75 of 73 examples changed, qa39 c10)."""
        apart = self._apart(norms[positions], part.norms.double(), norms)
        return {positions[i] for i in apart.nonzero().flatten().tolist()}

    def _norms_apart(self, expected: Tensor, got: Tensor, norms: Tensor) -> int:
        """How many per-example norms ``got`` differ from ``expected`` (:meth:`_apart`)."""
        return int(self._apart(expected, got, norms).sum())

    def _apart(self, expected: Tensor, got: Tensor, norms: Tensor) -> Tensor:
        """Which per-example norms ``got`` differ from ``expected`` by more than :meth:`_norm_tolerance` of the whole
        batch's ``norms`` (a bool mask); the worst distance kept for :meth:`_rejudged`."""
        apart = (expected - got).abs() / self._norm_tolerance(norms)
        self._worst = max(self._worst, float(apart.max()) if apart.numel() else 0.0)
        return apart > 1

    def _sums_apart(self, whole: ClippedBatch, sum_of: Callable[[Tensor], Tensor]) -> list[str]:
        """The parameters whose sum ``sum_of(p)`` differs from the whole batch's by more than τ · Σ_i ‖g_i^all‖ (the
        sums' rounding is bounded by their terms' sizes)."""
        tolerance = self.rtol * float(whole.norms.double().sum()) + 1e-12
        apart = [float((sum_of(p) - whole.sums[p].double()).norm()) / tolerance for p in self.params]
        self._worst = max([self._worst, *apart])
        return [name for name, a in zip(self.names, apart) if a > 1]


def _donors(kept: list[int], count: int, rng: random.Random) -> tuple[list[int], Optional[list[int]]]:
    """Two lists of ``count`` donors, positions in ``kept``, that differ at every place (:meth:`BatchInteractionCheck.
    _replacement`); ``None`` for the second when only one example is kept."""
    first = [rng.choice(kept) for _ in range(count)]
    if len(kept) < 2:
        return first, None
    return first, [rng.choice([k for k in kept if k != d]) for d in first]


def _placed(n: int, replaced: list[int], donors: list[int]) -> list[int]:
    """The positions 0..n-1 with each of ``replaced`` taken by its donor."""
    positions = list(range(n))
    for position, donor in zip(replaced, donors):
        positions[position] = donor
    return positions


def _reordered(whole: Tensor, parts: list[Tensor], tolerance: float) -> bool:
    """Whether the batch's per-row norms are its examples' norms in another order: the two halves' together are the
    whole batch's up to order (sorted, each within ``tolerance``), and each example alone has a norm the batch has.
    A step that sorts its batch (by length before ``pack_padded_sequence(enforce_sorted=True)``) and undoes the order
    on its outputs has one example per row in every pass, in an order that depends on the batch."""
    halves = torch.cat(parts[:2])
    if halves.shape != whole.shape:
        return False
    if float((whole.sort().values - halves.sort().values).abs().max()) > tolerance:
        return False
    return all(float((whole - lone).abs().min()) <= tolerance for part in parts[2:] for lone in part)


def batch_interaction_error(step: int, m: int, differing: int, summed: Sequence[str],
                            engine: str, as_of: str = "", drawn: int = 0, built: bool = False, hint: str = ""
                            ) -> PrivacyConfigurationError:
    """The refusal of an interaction the batch check found (counts only: no gradient values of the data); ``drawn``:
    the step draws random numbers and was compared from that many generator states; ``built``: on a batch built from
    the training records, not the sampled one (``as_of`` says which); ``hint``: the likeliest cause the step's own
    calls name (:meth:`BatchInteractionCheck._likely_cause`), said before the typical ones."""
    where = f" and the sums of {', '.join(summed[:4])}{' …' if len(summed) > 4 else ''} changed" if summed else ""
    when = f" ({as_of})" if as_of else ""
    which = "that batch" if built else "the step's own sampled batch"
    coin = ("The step draws random numbers of its own and was compared from the generators' states of the step "
            f"itself and of other seeds ({drawn} in all): a random draw switches an interaction on (MixUp or CutMix "
            "applied with a probability, timm's Mixup(prob=…), RandomChoice([MixUp, Identity]) in the collate), or it "
            "is on for every draw; the steps it lands on would release it. ") if drawn else ""
    return PrivacyConfigurationError(
        f"Examples interact at step {step}{when}: checked on {m} examples of {which} (as one batch, as two halves and "
        f"two of them alone), {differing} example gradient(s) changed with the batch's composition{where}. Per-example "
        f"clipping then does not bound one example's influence by C. Nothing was released for this step. {coin}"
        f"{hint}{'Other typical' if hint else 'Typical'} causes the first step cannot show: an operation across the "
        "batch that starts after a warm-up (in-batch negatives, a contrastive loss over the batch), a selection by "
        "rank within the batch (hard-example mining with top-k), a loss weighted by the batch's own statistics "
        "(class weights from its labels), a penalty on batch statistics (a covariance or mean of the batch's "
        "features), or augmentation that mixes examples (MixUp/CutMix inside training_step). Make every example's "
        "loss its own (per-example weights fixed in advance, negatives from public data)"
        + ("." if hint else  # a cause named: no engine's bug
           f"; if the examples are independent, engine '{engine}' gets a per-example gradient wrong: try another "
           "(per_sample='ghost', 'vmap' or 'opacus_hooks') and please report it."))
