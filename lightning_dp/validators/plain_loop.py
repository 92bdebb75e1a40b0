"""A loop of one's own and :class:`~lightning_dp.privacy.private_step.PrivateStep`: its contract, checked at run time.

The ledger charges each release at the Poisson rate q. That holds only for what the private loader really drew, once:

- **One release per drawn batch** (:meth:`PlainLoop.drawn`, :meth:`PlainLoop.check_release`). A logical step begins
  with a batch taken from the Poisson loader's record (``step.begin()`` / ``step.take()``); in a plain loop only a
  batch the loader has *handed to the loop* may be taken, once. A batch reused for a second release, a batch of one's
  own ``DataLoader`` (shuffled, full-batch) or a release without any ``begin`` is refused: each would be charged at
  q without having been drawn.
- **Physical batches are disjoint parts of it** (:meth:`PlainLoop.physical`): gradient accumulation banks parts of
  the drawn batch, each record at most once (``begin(len(part), part)``); a record in two banked parts would move the
  released sum by 2C. In a plain loop the parts must cover the drawn batch before its release.
- **The loss released is the loss verified** (:func:`check_bound_loss`): ``verify(loss_of)`` probes ``loss_of``; the
  loop back-propagates a loss of its own. On the steps the verification schedule picks (the first, then sampled, or
  every step under ``verify="every_step"``) the loss given to ``verify`` is run again on the very batch the loader
  handed the loop, from the generators' state at ``begin``, and its per-example gradient norms must be the loop's
  (to the batch check's tolerance): a loop that centres its batch, adds an in-batch term or any other loss is refused
  before that release.
- **No decision from the un-noised loss** (:meth:`PlainLoop.check_decisions`): the loss the loop back-propagates is
  watched from its backward on (a :class:`WatchedLoss`); when its value was read (``float(loss)``, ``.item()``, a
  print) and the optimizer's hyper-parameters then changed between a release and the next step's ``begin`` (or its
  ``opt.step()``), other than by a ``torch.optim.lr_scheduler`` scheduler stepping on the step count, the change was
  decided from private data outside the release: refused (release boundary, rule 3). A rate set from the step count
  while the loss is not read is a schedule and trains.
- **σ and C as given** (:meth:`PlainLoop.check_mechanism`): the step's noise multiplier and clipping policy as released
  are compared at the next ``begin``; a loop of one's own cannot be replayed to tell a schedule from a value read off
  the batch (a C from the batch's median loss), so a change is refused unless declared public.

The Lightning strategies draw, verify and seal their loss themselves (``training_step`` is the verified loss): for
them only the first two rules apply (``plain = False``).
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from lightning_dp.clipping import ClipRule
from lightning_dp.errors import PrivacyConfigurationError
from lightning_dp.losses import loss_tensor
from lightning_dp.fingerprints.fingerprint_entries import Fingerprint
from lightning_dp.performance.scheduler_search import schedulers_of
from lightning_dp.validators.kept_state import StateFingerprint
from lightning_dp.validators.steered_settings import settings
from lightning_dp.validators.optimizer_extra_state import rebound_state
from lightning_dp.validators.schedule_state import told_states
from lightning_dp.records import user_generators
from lightning_dp.replays.starting_state import Generators, StartingState
from lightning_dp.validators.rng import forked_rngs
from lightning_dp.validators.snapshot import StateSnapshot
from lightning_dp.tolerance import batch_tolerance

__all__ = ["PlainLoop", "WatchedLoss", "check_bound_loss"]

_FIX = ("Iterate the loader poisson_loader() returned and call step.begin() once for each batch it yields, then "
        "backward, step.release(), optimizer.step()")


def not_drawn_error(what: str) -> PrivacyConfigurationError:
    """The refusal of a release (or a batch begun) that the Poisson loader did not draw for it."""
    return PrivacyConfigurationError(
        f"{what}: the ledger charges every release at the Poisson rate q, which holds only for a batch the private "
        "loader drew, released once. A batch reused for a second release, a batch from a DataLoader of one's own or a "
        f"release without step.begin() would be charged as drawn when it was not. Nothing was released. {_FIX}.")


class WatchedLoss(Tensor):
    """The loss a plain loop back-propagated: a tensor like any other (what is computed from it is watched too) whose
    value, once read (``float``, ``.item()``, a comparison, a print), marks the loop's step as having read it."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if name not in _PASSED_ON:
            _note_read(name)
        return super().__torch_function__(func, types, args, kwargs or {})

    def __format__(self, spec: str) -> str:
        _note_read("__format__")
        return self.detach().as_subclass(Tensor).__format__(spec)


_PASSED_ON = frozenset({"detach", "clone", "backward", "requires_grad_", "size", "dim", "numel", "is_floating_point",
                        "__get__", "__set__", "grad_fn", "requires_grad", "dtype", "device", "shape", "is_leaf"})
_WATCHING: Callable[[], Optional["PlainLoop"]] = lambda: None  # noqa: E731  (the loop whose loss is watched now)
_BACKWARD: Optional[Callable[..., Any]] = None  # torch.autograd.backward while a plain loop's window is open


def _note_read(name: str) -> None:
    loop = _WATCHING()
    if loop is not None:
        loop.ever_read = True
    if loop is not None and loop.read is None:
        loop.read = name


def _watched_backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.autograd.backward`` (``loss.backward()`` calls it) while a plain loop's step is open: the losses
    back-propagated become :class:`WatchedLoss`."""
    assert _BACKWARD is not None
    loop = _WATCHING()
    if loop is not None:
        loop.note_leaves((tensors,) if isinstance(tensors, Tensor) else tuple(tensors))
    out = _BACKWARD(tensors, *args, **kwargs)
    for t in (tensors,) if isinstance(tensors, Tensor) else tuple(tensors):
        if type(t) is Tensor and t.dim() == 0:
            t.__class__ = WatchedLoss
    return out


def _watch_backward(on: bool) -> None:
    global _BACKWARD
    if on and _BACKWARD is None:
        _BACKWARD, torch.autograd.backward = torch.autograd.backward, _watched_backward
    elif not on and _BACKWARD is not None:
        torch.autograd.backward, _BACKWARD = _BACKWARD, None


def _watch_clips(on: bool) -> None:
    """``torch.nn.utils``'s gradient clipping watched (:func:`_watched_clip`) while a plain loop is watched: from its
    first ``begin()`` until it is forgotten, so a clip of the released ĝ before ``optimizer.step()`` is seen too."""
    for place, name in _CLIPS:
        current = getattr(place, name, None)
        if on and current is not None and not hasattr(current, "original"):
            setattr(place, name, _watched_clip(name, current))
        elif not on and hasattr(current, "original"):
            setattr(place, name, current.original)


_CLIPS = [(place, name) for place in (torch.nn.utils, torch.nn.utils.clip_grad)
          for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")]


def _public_arguments(args: tuple, kwargs: dict) -> bool:
    """Whether a clip's arguments besides the parameters are plain constants (a number, ``'inf'``, a flag): no
    tensor, no loss (a :class:`WatchedLoss` is a tensor), nothing computed from the batch's gradients."""
    return all(type(value) in (int, float, bool, str, type(None)) for value in (*args, *kwargs.values()))


def _watched_clip(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.nn.utils``'s gradient clipping while a plain loop is watched. For the step's parameters: refused while
    its step is open, whose ``p.grad`` is ``None`` until ``release()`` (their per-example gradients are the engine's,
    clipped there); after the release, a clip of ĝ_t to constants (:func:`_public_arguments`) while the loop has never
    read a loss's value is post-processing of ĝ_t, held as released (``post_processed``, qa39 p05); any other
    (a bound from the loss, a total norm passed in) is left to the check before the update, which refuses it."""
    def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        loop = _WATCHING()
        if loop is not None:
            parameters = [parameters] if isinstance(parameters, Tensor) else list(parameters)
            own = {id(p) for p in loop.params()}
            if any(id(p) in own for p in parameters) and loop.released:
                if not loop.ever_read and _public_arguments(args, kwargs) and loop.same_clip(name, args, kwargs):
                    return loop.post_processed(lambda: original(parameters, *args, **kwargs))
            elif any(id(p) in own for p in parameters):
                raise PrivacyConfigurationError(
                    f"torch.nn.utils.{name} between begin() and release(): until the release the gradients are the "
                    "mechanism's (p.grad is None: each example's gradient is clipped to max_grad_norm and the sum "
                    "noised at release()). Clipping is the mechanism's: set max_grad_norm (or clipping=, a clipping "
                    "policy). A clip of the noised update goes after step.release(), before optimizer.step() "
                    "(post-processing; declare public_state=['p.grad'] if it is refused). Nothing was released.")
        return original(parameters, *args, **kwargs)

    clip.original = original  # type: ignore[attr-defined]
    return clip


def _rng_states() -> StartingState:
    """The model's own generators (records/user_generators.py), then torch's, NumPy's and Python's."""
    return StartingState(lambda: functools.partial(user_generators.restore, user_generators.states()),
                         lambda: Generators(cuda="available"))


_SCHEDULED = frozenset({"lr", "momentum", "betas"})
"""What ``torch.optim.lr_scheduler`` schedulers set (OneCycleLR and CyclicLR cycle the momentum or betas too)."""


class PlainLoop:
    """The logical step's drawn batch and what the loop did with it (module docstring).

    Attributes:
        plain: the loop is the user's own (``False`` under the Lightning strategies: only the draw rules apply).
        indices: the dataset indices of the step's Poisson batch (``None``: none drawn yet).
        batch: the batch the loader handed the loop for it (plain loops).
        loss_of: the loss ``verify`` probed, on a batch as the loader yields it.
    """

    def __init__(self, mechanism: Callable[[], Fingerprint] = dict,
                 public: Callable[[], Sequence[str]] = tuple, alone: Callable[[], bool] = bool,
                 params: Callable[[], Sequence[Tensor]] = tuple,
                 post_processed: Callable[[Callable[[], Any]], Any] = lambda apply: apply()) -> None:
        self.mechanism = mechanism
        """The step's σ, clipping policy, noise and sampling now (:func:`~.mechanism_settings.mechanism_state`)."""
        self.public = public
        """The names declared public (``"noise_multiplier"``, ``"max_grad_norm"``: a schedule of one's own)."""
        self.alone = alone
        """Whether the step was configured for examples alone (``max_physical_batch_size=1``, no privacy unit): the
        probe then skips the batch-with-alone comparison and no batch check runs, so every physical batch must hold
        one example (:meth:`physical` refuses more)."""
        self.params = params
        """The parameters the step releases (every other leaf a plain loop's backward reaches: :meth:`note_leaves`)."""
        self.post_processed = post_processed
        """Runs torch's clip of the released ĝ_t to constants and holds its result as released (the release
        boundary's ``post_processed``); by default it is run and left to the check before the update."""
        self._plain = True
        self._leaves: dict[int, weakref.ref] = {}  # leaves requiring grad this step's backward reached
        self._trained: dict[int, weakref.ref] = {}  # leaves outside the model an earlier step's backward reached
        self.indices: Optional[list[int]] = None
        self.batch: Any = None
        self.begun: set[int] = set()
        self.units: set[Any] = set()
        """The users of the physical batches begun for this step (user-level DP): each in one physical batch only."""
        self.released = True
        self.stand_in = False
        self.padding = 0
        self._loss_of: Optional[Callable[[Any], Any]] = None
        self.what = "the loss function"
        self._due = False
        self._rngs: Optional[StartingState] = None
        self.read: Optional[str] = None
        """How the loss's value was read since the step began (``None``: not read)."""
        self.ever_read = False
        """Whether the loop has read a loss's value at any step (a bound kept from an earlier step's loss)."""
        self._clip: Optional[tuple] = None  # the first clip of a release to constants: (name, arguments)
        self._hyper: Optional[Fingerprint] = None  # the optimizer's hyper-parameters as released
        self._mechanism: Optional[Fingerprint] = None  # σ and C as released
        self._at_begin: Optional[Fingerprint] = None  # σ, C, noise and sampling as this step began
        self._optimizer: Any = None
        self._hook: Any = None
        self._schedulers: list[weakref.ref] = []

    @property
    def plain(self) -> bool:
        """The loop is the user's own (``False`` under the Lightning strategies, which verify ``training_step`` as the
        loss and draw the batches themselves: :meth:`driven_by_strategy`). Read-only: a plain loop cannot switch its
        own checks off."""
        return self._plain

    def driven_by_strategy(self) -> None:
        """The Lightning strategies' glue drives this step: ``training_step`` is the verified loss, the strategy draws,
        collates and seals it, so only the draw rules apply (not for a loop of one's own: its loss would go
        unchecked)."""
        self._plain = False

    @property
    def loss_of(self) -> Optional[Callable[[Any], Any]]:
        """The loss ``verify`` probed, on a batch as the loader yields it (set by ``verify``: :meth:`bind_loss`)."""
        return self._loss_of

    @property
    def due(self) -> bool:
        """Whether this step's loss is run again against the verified one (the verification schedule's choice)."""
        return self._due

    def bind_loss(self, loss_of: Callable[[Any], Any], what: str) -> None:
        """``verify`` probed ``loss_of``: the loss a plain loop's releases are bound to (:func:`check_bound_loss`)."""
        self._loss_of, self.what = loss_of, what

    # ------------------------------------------------------------------ the draw
    def drawn(self, indices: list[int], batch: Any, banked: bool) -> None:
        """A Poisson batch was taken for a new logical step (``banked``: clipped sums of the one before are held)."""
        if banked:
            raise PrivacyConfigurationError(
                "A new Poisson batch was taken while physical batches banked from the one before were never released: "
                "a release mixing two draws holds records of both (each drawn at rate q), so one record could count "
                "twice. Release each drawn batch (step.release()) before beginning the next.")
        self.indices, self.batch, self.begun, self.released, self.stand_in = list(indices), batch, set(), False, False
        self.units = set()

    def same_clip(self, name: str, args: tuple, kwargs: dict) -> bool:
        """Whether a clip of the released ĝ_t has the function and arguments of the loop's first such clip (kept
        then): a public bound is one constant, while a bound computed from each step's batch (``float(x.abs().max())``,
        which no loss read shows) moves and is left to the check before the update, which refuses it."""
        key = (name, args, tuple(sorted(kwargs.items())))
        if self._clip is None:
            self._clip = key
        return self._clip == key

    def takes(self, n: int, indices: Optional[Sequence[int]], stand_in: bool) -> bool:
        """Whether ``begin(n, indices)`` starts a new logical step: a count without records when no drawn batch is
        open (the Poisson loader's next batch is taken: it must be that batch)."""
        return indices is None and not stand_in and (self.indices is None or self.released)

    def abandon(self) -> None:
        """The physical batch begun last was neither banked nor released (its step raised): the drawn batch it was part
        of is not released any more (a count given to the next ``begin`` takes the loader's next batch)."""
        if self.begun:
            self.released, self.batch = True, None

    def physical(self, n: int, indices: Optional[Sequence[int]], stand_in: bool, padding: int,
                 units: Optional[Sequence[Any]] = None) -> None:
        """A physical batch of ``n`` examples (records ``indices``; ``None``: the whole drawn batch; ``units``: their
        users, under user-level DP) begins: it must be an unused part of the drawn batch, holding users no other
        physical batch of the step holds, and one example when the step was configured for examples alone."""
        self.padding = padding
        self.stand_in = stand_in  # the last physical batch's: a stand-in before it was discarded (DDP lockstep)
        if stand_in:
            return
        if n > 1 and self.alone():
            raise PrivacyConfigurationError(
                f"begin({n}): this step was configured for examples alone (max_physical_batch_size=1), so neither the "
                "probe nor the batch check compares a batch with its examples alone; a physical batch of several "
                "examples could mix them (a loss centred on the batch) unchecked. Begin one example at a time, or "
                "configure the step without max_physical_batch_size=1. Nothing was released.")
        self._check_units(units)
        if self.indices is None:
            return  # no Poisson loader (a caller that clips and charges itself: VirtualWorkersSignSGD)
        if self.released:
            raise not_drawn_error(f"begin({n}) after the drawn batch was released")
        drawn = self.indices
        if indices is None:
            if self.begun:
                raise PrivacyConfigurationError(
                    f"begin({n}) without the records of a physical batch, after part of the drawn batch was begun: "
                    "name each part's records, begin(len(part), part), with disjoint parts of step.take() (a record in "
                    "two parts would move the release by 2C). Nothing was released.")
            if n != len(drawn):
                raise not_drawn_error(f"begin({n}) counts {n} examples; the Poisson batch drawn for this step holds "
                                      f"{len(drawn)}")
            part: Sequence[int] = drawn
        else:
            part = list(indices)
            if n != len(part) or len(set(part)) != len(part):
                raise PrivacyConfigurationError(f"begin({n}, indices): {len(part)} indices, {len(set(part))} distinct; "
                                                "each record once, as many as the count.")
            outside = set(part) - set(drawn)
            if outside:
                raise not_drawn_error(f"begin({n}, indices) names {len(outside)} record(s) the Poisson batch of this "
                                      "step does not hold")
            again = self.begun.intersection(part)
            if again:
                raise PrivacyConfigurationError(
                    f"{len(again)} record(s) of this physical batch were begun already in another physical batch of "
                    "the same step: two banked parts holding one record move the released sum by 2C, not C. Split "
                    "the drawn batch (step.take()) into disjoint parts. Nothing was released.")
        self.begun.update(part)

    def _check_units(self, units: Optional[Sequence[Any]]) -> None:
        """User-level DP: a user's records are clipped together, so they must all be in one physical batch; a user in
        two banked parts is clipped twice (up to 2C for one user). The users are known from the records named."""
        if units is None:
            return
        split = self.units.intersection(units)
        if split:
            raise PrivacyConfigurationError(
                f"{len(split)} user(s) of this physical batch have records in another physical batch of the same step: "
                "a user's records are clipped together (user-level DP), so a user split over two banked parts is "
                "clipped twice and moves the release by up to 2C. Cut the drawn batch between users "
                "(lightning_dp.units.physical.user_chunks(indices, step.groups_of(indices), limit)). Nothing was "
                "released.")
        self.units.update(units)

    def check_bank(self) -> None:
        """Before a physical batch is banked: a stand-in's gradient (``begin(..., stand_in=True)``: an example run only
        to join a collective) never enters a release."""
        if self.stand_in:
            raise PrivacyConfigurationError(
                "a stand-in batch (begin(..., stand_in=True)) was banked: its gradient would enter the release beside "
                "the drawn batch's (records counted twice, or records not drawn). A stand-in is only run to join a "
                "collective and is dropped: step.discard(). Nothing was released.")

    def check_release(self, empty: bool, params: Optional[Sequence[Tensor]] = None) -> None:
        """Before a release: a drawn batch is open, not released, a stand-in is released empty, and (plain loops) its
        physical batches covered it. ``params``: the step's trainable parameters, if listed already."""
        _watch_backward(False)
        if self.indices is None or self.released:
            raise not_drawn_error("release() without a Poisson batch drawn for it (no step.begin(), or a second "
                                  "release of one batch)")
        if self.stand_in and not empty:
            raise PrivacyConfigurationError("a stand-in batch (begin(..., stand_in=True)) was released with its "
                                            "gradient: release(empty=True) discards it. Nothing was released.")
        self.check_mechanism_kept()
        if self.plain and not empty:
            self._check_outside_leaves(params)
        if self.plain and not empty and len(self.begun) != len(self.indices):
            raise PrivacyConfigurationError(
                f"the physical batches begun hold {len(self.begun)} of the {len(self.indices)} records drawn for this "
                "step: release the whole drawn batch (records left out by the loop's own choice depend on the data). "
                "Nothing was released.")

    def after_release(self, optimizer: Any) -> None:
        """The drawn batch was released: no second release of it; the optimizer's hyper-parameters as released are
        what the next step compares (plain loops)."""
        self.released, self.stand_in, self.batch = True, False, None
        if self.plain:
            self._mechanism = self.mechanism()
        if not self.plain or optimizer is None:
            return
        if optimizer is not self._optimizer:
            if self._hook is not None:
                self._hook.remove()
            self._optimizer, self._schedulers = optimizer, []
            self._hook = optimizer.register_step_pre_hook(self._before_update)
        self._hyper = self._decided(optimizer)

    # ------------------------------------------------------------------ decisions from the loss
    def step_begins(self, schedule_due: Callable[[], bool]) -> None:
        """A plain loop's logical step begins: decisions since the last release are judged, the loss of this step is
        watched from its backward on, and whether its loss is bound to the verified one this step is decided."""
        global _WATCHING
        self.check_decisions("between the last release and this step's begin()")
        self.check_mechanism("between the last release and this step's begin()")
        self._hyper, self.read, self._mechanism = None, None, None
        self._at_begin = self.mechanism()
        self._leaves = {}
        ref = weakref.ref(self)
        _WATCHING = ref  # type: ignore[assignment]
        _watch_backward(True)
        _watch_clips(True)
        self._due = self._loss_of is not None and schedule_due()
        self._rngs = _rng_states() if self._due else None

    def _before_update(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        self.check_decisions("between the release and optimizer.step()")

    def check_mechanism(self, where: str) -> None:
        """Refuse σ or C changed since the release (module docstring): in a loop of one's own the library cannot tell a
        schedule from a value read off the batch (``loss.median()``), so only the strategy's own moves (calibration
        before the first release, an adaptive policy) and names declared public change them."""
        if self._mechanism is None:
            return
        declared = {"privacy noise_multiplier": "noise_multiplier", "privacy clipping": "max_grad_norm",
                    "privacy clipping state": "max_grad_norm"}
        changed = [name for name in StateFingerprint.changed(self._mechanism, self.mechanism())
                   if declared.get(name) not in self.public()]
        if changed:
            raise PrivacyConfigurationError(
                f"The mechanism's σ or C changed {where} ({', '.join(changed)}): in a loop of one's own they cannot be "
                "told apart from values read off the private batch (a C from the batch's median loss, a σ lowered "
                "once the loss is low), which would steer the next release by un-noised data (docs/release_boundary.md"
                ", rule 3). Nothing more was released. Give σ and C before training (or a target ε, which calibrates "
                "σ; AdaptiveClipping moves C privately); a schedule of one's own from the step count only may be "
                "declared: PrivateStep(..., public_state=['noise_multiplier']) or ['max_grad_norm'].")

    def check_mechanism_kept(self) -> None:
        """Before a plain loop's release: σ, C (the clipping policy's state), the noise and the sampling as the step
        began. Set after the backward they would clip and noise this very release by its own un-noised batch (a C from
        the batch's median loss): refused whatever is declared, before anything is released. A schedule of one's own
        sets them between a release and the next ``begin``."""
        taken = self._at_begin
        if not self.plain or taken is None:
            return
        changed = StateFingerprint.changed(taken, self.mechanism())
        if changed:
            raise PrivacyConfigurationError(
                f"The mechanism's σ or C changed within the step, between begin() and release() "
                f"({', '.join(changed)}): set after the backward they would clip and noise this release by a value "
                "read off its own un-noised batch (a C from the batch's median loss, a σ lowered once its loss is low) "
                "(docs/release_boundary.md, rule 3). Nothing was released. Give σ and C before training; a schedule "
                "declared public (public_state=['noise_multiplier']) sets them between a release and the next begin().")

    def note_leaves(self, roots: Sequence[Any]) -> None:
        """The leaf tensors requiring grad whose ``.grad`` a backward from ``roots`` (the plain loop's, its step
        open) will write: the graph's ``AccumulateGrad`` nodes."""
        stack = [t.grad_fn for t in roots if isinstance(t, Tensor) and t.grad_fn is not None]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            leaf = getattr(node, "variable", None)
            if isinstance(leaf, Tensor):
                self._leaves[id(leaf)] = weakref.ref(leaf)
            stack.extend(child for child, _ in node.next_functions)

    def _check_outside_leaves(self, params: Optional[Sequence[Tensor]] = None) -> None:
        """A tensor outside the released parameters that this step's backward and an earlier step's both wrote
        ``.grad`` of is kept state trained on the raw, un-clipped batch gradient (a temperature, loss weights of the
        loop's own with their own optimizer): refused before the release. An input made to require grad (FGSM,
        saliency) is a new tensor each step and trains."""
        model = {id(p) for p in (self.params() if params is None else params)}
        outside = {k: r for k, r in self._leaves.items() if k not in model and r() is not None}
        kept = [r() for k, r in outside.items() if k in self._trained and self._trained[k]() is r()]
        self._trained = {k: r for k, r in {**self._trained, **outside}.items() if r() is not None}
        if kept:
            shapes = ", ".join(str(tuple(t.shape)) for t in kept[:3] if t is not None)
            raise PrivacyConfigurationError(
                f"{len(kept)} tensor(s) outside the model's released parameters (shape {shapes}) received a gradient "
                "from the loop's backward at this step and at an earlier one: their .grad is the raw batch gradient, "
                "neither clipped nor noised, and state kept across steps trained on it releases the batch without "
                "noise (docs/release_boundary.md, rule 2). Nothing was released. Make such a tensor a parameter of the "
                "attached model (it is then clipped and noised with the rest), detach it, or declare it frozen "
                "(requires_grad=False).")

    def check_decisions(self, where: str) -> None:
        """Refuse hyper-parameters changed since the release when the loss's value was read (module docstring)."""
        if self._hyper is None or self._optimizer is None or self.read is None:
            return
        changed = StateFingerprint.changed(self._hyper, self._decided(self._optimizer))
        if not changed or self._scheduled(changed):
            return
        raise PrivacyConfigurationError(
            f"The optimizer's hyper-parameters or state, or what a learning-rate scheduler was told, changed {where} "
            f"({', '.join(changed[:4])}) after the loop read the "
            f"value of the loss it back-propagated ({self.read}): the un-noised loss of the private batch steering "
            "later updates is a release without noise (docs/release_boundary.md, rule 3). Nothing more was released. "
            "Set rates from the step count (a torch.optim.lr_scheduler scheduler, or by hand without reading the "
            "loss) or from held-out data; a loss printed for a report is allowed when no rate is set by hand.")

    def _decided(self, optimizer: Any) -> Fingerprint:
        """What sets the next updates besides the release: the optimizer's hyper-parameters, the entries of its state
        a loop's code rebinds (:func:`~.optimizer_extra_state.rebound_state`: a loss kept for a step size) and what its
        schedulers were told (:func:`~.schedule_state.told_states`: ``scheduler.observe(loss.item())``)."""
        return {**settings(optimizer), **rebound_state(optimizer), **told_states(self._scheduler_objects(optimizer))}

    def _scheduled(self, changed: Sequence[str]) -> bool:
        """Whether every change is a ``torch.optim.lr_scheduler`` scheduler's (not ``ReduceLROnPlateau``, which is
        told a value) setting the learning rates it reports (``_last_lr``)."""
        if any(not name.startswith("optimizer param_groups[") or name.rsplit(".", 1)[-1] not in _SCHEDULED
               for name in changed):
            return False
        optimizer = self._optimizer
        rates = [group["lr"] for group in optimizer.param_groups]
        for scheduler in self._scheduler_objects(optimizer):
            if getattr(scheduler, "_last_lr", None) == rates:
                return True
        return False

    def _scheduler_objects(self, optimizer: Any) -> list[Any]:
        found = [s for s in (r() for r in self._schedulers) if s is not None]
        if not found:  # until one is found (performance/scheduler_search.py: a walk only when one may hold it)
            found = schedulers_of(optimizer)
            self._schedulers = [weakref.ref(s) for s in found]
        return found

    def forget(self) -> None:
        """Stop watching (detach, a new optimizer)."""
        global _WATCHING
        if self._hook is not None:
            self._hook.remove()
        self._hook, self._optimizer, self._hyper, self._schedulers = None, None, None, []
        if _WATCHING() is self:
            _WATCHING = lambda: None  # noqa: E731
            _watch_backward(False)
            _watch_clips(False)


def bound_loss_error(what: str, scaled: bool = False) -> PrivacyConfigurationError:
    """The refusal of a loop whose back-propagated loss is not the one ``verify`` checked (no norm or difference is
    quoted: they are the private batch's). ``scaled``: every example's gradient norm is the same multiple of the
    verified loss's, which is what a loss scaled before its backward (``torch.amp.GradScaler``) gives."""
    if scaled:
        return PrivacyConfigurationError(
            f"The loss the loop back-propagated is {what} given to verify() multiplied by a constant: run again on the "
            "batch the loader handed the loop, every example's gradient norm is the same multiple of the verified one. "
            "A loss scaled before its backward (torch.amp.GradScaler's scaler.scale(loss).backward(), or loss * k) "
            "is clipped at C after the scaling, which is not the contract verify() checked. Nothing was released. "
            "Back-propagate the loss itself (loss.backward(), then step.release() and optimizer.step(), without a "
            "GradScaler): for mixed precision, autocast to bfloat16, which needs no scaler, and verify with "
            "step.verify(loss_fn, low_precision=True); to weight the loss by a constant, give verify() the same "
            "weighted loss. (DPStrategy handles Lightning's precision='16-mixed' scaler itself.)")
    return PrivacyConfigurationError(
        f"The loss the loop back-propagated is not {what} given to verify(): run again on the batch the loader handed "
        "the loop, from the same random state, its per-example gradient norms differ beyond the tolerance of the "
        "precision. The probe verified a loss that is not the one released (a batch centred on its own mean, an "
        "in-batch term, another transform of the batch). Nothing was released. Give verify() exactly the loss the loop "
        "computes from the loader's batch, with its random draws after step.begin().")


def _scaled_copy(real: Tensor, again: Tensor, rtol: float) -> bool:
    """Whether the released pass's sorted per-example norms ``real`` are one constant k ≠ 1 times the verified
    loss's ``again`` (within the relative tolerance ``rtol``): a loss scaled before its backward."""
    if real.shape != again.shape or not real.numel() or float(again.sum()) <= 0:
        return False
    k = float(real.sum() / again.sum())
    return abs(k - 1) > 10 * rtol and float((real - k * again).abs().max()) <= rtol * float(real.abs().max())


def check_bound_loss(step: Any, norms: Tensor, params: Optional[Sequence[Tensor]] = None) -> None:
    """The verified loss of ``step`` (a :class:`~lightning_dp.privacy.private_step.PrivateStep`) on the loop's own
    batch must give the released pass's per-example norms (module docstring). Everything the pass writes is restored;
    the generators continue as if it had not run. ``params``: the step's trainable parameters, if listed already."""
    loop = step.loop
    engine, module = step._engine, step._module
    if not loop.due or loop.loss_of is None or loop.batch is None or engine is None or module is None:
        return
    start = time.perf_counter()
    params = step.params() if params is None else params
    grads = [p.grad for p in params]
    rows = len(loop.indices or ()) + loop.padding
    snapshot = StateSnapshot(module, [], step.boundary.engine_keys, step.boundary.global_modules())
    try:
        with forked_rngs():
            if loop._rngs is not None:
                loop._rngs.put_back()
            engine.begin_step(rows)
            loss_tensor(loop.loss_of(loop.batch), rows, loop.what).backward()
            engine.padding_rows = loop.padding
            rule = ClipRule(step.clipping, step.groups_of(loop.indices) if loop.indices else None)
            checked = engine.clip_and_sum(params, rule, step._request.scale, False).norms
    finally:
        engine.padding_rows = 0
        engine.begin_step(None)
        snapshot.restore()
        for p, g in zip(params, grads):
            p.grad = g
        step.schedule.checked(time.perf_counter() - start)
    real = norms.detach().double().flatten().sort().values
    again = checked.detach().double().flatten().to(real.device).sort().values
    dtype = params[0].dtype if params else torch.float32
    if step._compute_dtype is not None and torch.finfo(step._compute_dtype).eps > torch.finfo(dtype).eps:
        dtype = step._compute_dtype
    scale = float(torch.cat([real, again]).abs().max()) if real.numel() + again.numel() else 0.0
    tol = batch_tolerance(dtype, params[0].device if params else torch.device("cpu"), step._tolerance_low) * scale
    worst = math.inf if real.shape != again.shape else float((real - again).abs().max()) if real.numel() else 0.0
    if worst > tol:
        raise bound_loss_error(loop.what, _scaled_copy(real, again, tol / scale if scale else 0.0))
