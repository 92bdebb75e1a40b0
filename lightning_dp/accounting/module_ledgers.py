"""The ledger travels with the module: per module object, every release made on it in this process.

A privacy guarantee is about what was released, not about which ``Trainer`` or strategy released
it. A second ``fit`` of the same module (a new ``Trainer``, a new ``DPStrategy``) trains weights that
already carry every earlier release: its ε composes with them (Dwork & Roth 2014, Thm. 3.16; for
RDP, Mironov 2017, Prop. 1), so its ledger must continue theirs, never restart at zero.

This module keeps that record: a :class:`weakref.WeakKeyDictionary` from module to the
:class:`~lightning_dp.accounting.ledger.PrivacyLedger` that charges its releases (weak: the record
goes when the module does). :class:`~lightning_dp.privacy.private_step.PrivateStep` binds its own
ledger to the module and to every submodule at ``attach`` (a model later trained as a part of
another, or a part trained alone, finds the record), and leaves a copy at ``detach`` (a step reused
elsewhere does not grow this module's record). Nothing is stored on the module or its tensors, and
checkpoints hold the strategy's ``lightning_dp`` key (with the names of the weights it trained: :func:`trained_names`).

A module re-created in this process as another object (``copy.deepcopy``, unpickling, ``load_state_dict`` of
a trained module's weights into a fresh one, ``load_from_checkpoint`` of a checkpoint written at the end of a fit)
is found by its weights: when a step detaches, every trainable parameter the releases changed leaves a digest
of its contents (float64 sums of its values, of their squares and of a position-weighted sum, with its shape and
dtype) mapped to a copy of the record, and a module attached later whose trainable parameter has such a digest
continues that record (conservative: fine-tuning weights trained on other data counts their releases too).

Weights saved or loaded in half precision (float16 or bfloat16, kept so or cast back) or in float64 are found too:
each changed parameter also leaves the digests of its roundings and of its float64 copy there. The weights are marked
so at the end of a fit and whenever a checkpoint is written (:func:`mark`: a checkpoint from the middle of a fit,
"the best one", reloaded into a fresh module). Weights *near* trained ones — scaled by 1.0001, noise added — are
found by a sketch of each changed parameter (its values at 64 spread positions, before and after the releases,
:func:`near`): nearer to the trained values than a tenth of how far the releases moved them continues their record.
Weights *derived* from a fit — an EMA or ``AveragedModel`` kept along it, a snapshot saved mid-fit, a point between
start and end, ``0.5·w + noise``, a task vector, a soup of two fits — are found on the cone of the fit's start and of
sketches taken along it (:func:`derived`, accounting/lineage.py), judged on the weights as they are when a module is
attached, when neither digest nor nearness found a record.

A module that holds a privately trained one outside its registry — a teacher in a list, in a function's closure or
default arguments or named by it as a global (soft targets, stacked logits) — continues its record too
(:func:`held_modules`).

In another process a module's history is the checkpoint's ``lightning_dp`` entry, continued by ``trainer.fit(...,
ckpt_path=...)`` and by ``load_from_checkpoint`` (:func:`carry`, accounting/loaded_checkpoints.py), and the ledger
store: every :func:`mark` and :func:`carry` writes the record's digests, sketches and path sketches to disk, and
:func:`record_of` matches a module no record of this process matches against them by the same tests
(accounting/ledger_store.py: weights loaded by ``torch.load`` then ``load_state_dict``, a soup of loaded ones, on the
machine that trained them). What it cannot see: weights moved to another machine without the checkpoint's entry,
and weights changed after the fit that trained them beyond that (quantised to integers, pruned, a layer
reinitialised alone is a fresh layer; a task vector added to weights far from the fit's start).

Two records of one module are combined by :func:`combine`: when one is a prefix of the other
(a checkpoint restored from earlier in this process, the same run seen twice) the longer is kept,
so a ledger never goes backwards; otherwise both histories happened, and the record is their common
prefix followed by the rest of each (a composition: an upper bound on ε, never below either). Entries name the run
that made them (:attr:`~lightning_dp.accounting.ledger.LedgerEntry.run`, set by :func:`bind`): two runs with equal
settings are two histories (a soup of both), an entry of unknown run (an older checkpoint) matches as before.
Weights exactly a fit's (or near the end that two runs both reached from one start: a rerun with the same seeds)
are that one run's record, not a composition of runs that each alone explain them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import types
import uuid
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_dp.accounting import ledger_store
from lightning_dp.accounting.ledger import LedgerEntry, PrivacyLedger
from lightning_dp.accounting.lineage import RESIDUAL, PathSketches, fit_path, follows, one_thread
from lightning_dp.fingerprints.checksums import content_sums
from lightning_dp.fingerprints.state_walker import callable_state
from lightning_dp.records.identity import IdentityMap

_RECORDS: "weakref.WeakKeyDictionary[nn.Module, PrivacyLedger]" = weakref.WeakKeyDictionary()
_BY_CONTENT: dict[bytes, PrivacyLedger] = {}
"""Digest of a trainable parameter's contents after releases changed it → the record that trained it (a copy)."""
_AT_BIND: "weakref.WeakKeyDictionary[nn.Module, IdentityMap[tuple[bytes, Tensor]]]" = weakref.WeakKeyDictionary()
"""Module → its trainable parameters at :func:`bind` (by identity: one replaced since is freed, and a new one taking
its id is not judged by its start) → (digest, sketch)."""
_PATHS: "weakref.WeakKeyDictionary[nn.Module, tuple[PrivacyLedger, PathSketches]]" = weakref.WeakKeyDictionary()
"""Module → (the ledger bound to it, the sketches of its parameters along the fit: accounting/lineage.py)."""
_STORED: "weakref.WeakKeyDictionary[nn.Module, ledger_store.Entry]" = weakref.WeakKeyDictionary()
"""Module → the ledger store's entry of the fit bound to it (what its marks found so far, written at each)."""
_INTERNALS = frozenset(vars(nn.Module())) | {
    "_compiled_call_impl", "_trainer", "_fabric", "_fabric_optimizers", "_metric_attributes", "_hparams",
    "_hparams_initial", "_hparams_name", "_log_hyperparams", "_compiler_ctx", "_device_mesh", "_device", "_dtype",
    "_param_requires_grad_state", "_example_input_array", "_current_fx_name", "_automatic_optimization",
    "_strict_loading", "_jit_is_scripting"}
"""torch's own names on a module (its registries and hooks, as a bare ``nn.Module`` has them; a compiled forward)
and Lightning's (the trainer, Fabric, hyper-parameters, the logged metrics): :func:`held_modules` does not walk them
(the trainer holds every callback's and the datamodule's modules); any other name is walked, ``_t = [teacher]`` too."""


def digest(t: Tensor) -> bytes:
    """A digest of ``t``'s contents: its shape, dtype and the kept-state checksums of its values
    (:func:`~lightning_dp.fingerprints.checksums.content_sums`: float64 Σx, Σx², Σ (1 + j mod 251)·x_j)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    head = repr((tuple(local.shape), str(local.dtype))).encode()
    return hashlib.blake2b(head + content_sums([t])[0], digest_size=16).digest()


def _materialised(module: nn.Module) -> list[Tensor]:
    """``module``'s parameters less a lazy layer's placeholders (they hold no values; validators/layers.py refuses
    them before a release)."""
    from torch.nn.parameter import UninitializedParameter

    return [p for p in module.parameters() if not isinstance(p, UninitializedParameter)]


def _trainable(module: nn.Module) -> list[Tensor]:
    return [p for p in _materialised(module) if p.requires_grad and p.numel() and p.dtype.is_floating_point]


def _weights(module: nn.Module) -> list[Tensor]:
    """Every floating parameter, frozen ones too: a privately trained backbone reused frozen (a linear probe on a
    copy of it) holds that fit's releases as much as a trainable copy does. Only weights some fit trained are
    recorded (:func:`bind`'s trainable ones), so a public frozen backbone matches nothing."""
    return [p for p in _materialised(module) if p.numel() and p.dtype.is_floating_point]


@dataclass(frozen=True)
class Combined:
    """The record :func:`combine` made of two ledgers.

    Attributes:
        ledger: every release of both (a new object).
        added: releases the second contributed beyond the first (0: the first already held them all).
        diverged: neither was a prefix of the other (both histories composed).
    """

    ledger: PrivacyLedger
    added: int
    diverged: bool


def combine(first: PrivacyLedger, second: PrivacyLedger) -> Combined:
    """``first`` continued with what ``second`` holds beyond it (module docs): the longer of the two when
    one is a prefix of the other, else their common prefix, then ``first``'s rest, then ``second``'s.
    ``first`` is always a prefix of the result (running totals read from it stay valid). Entries are one history
    only when their runs agree too (:attr:`LedgerEntry.run`: two fits with equal σ, q and steps — a soup of two
    runs — compose); an entry whose run is unknown (a checkpoint written before runs were kept) matches any."""
    a, b = first.entries, second.entries
    i, shared = 0, 0  # whole entries in common; then releases shared in entry i
    while i < min(len(a), len(b)) and _same_kind(a[i], b[i]) and a[i].steps == b[i].steps:
        i += 1
    if i < len(a) and i < len(b) and _same_kind(a[i], b[i]):
        shared = min(a[i].steps, b[i].steps)
    rest = list(b[i:])
    if rest and shared:
        rest[0] = dataclasses.replace(rest[0], steps=rest[0].steps - shared)
    out = PrivacyLedger()
    out.load_entries((*a, *rest))
    added = out.steps - first.steps
    first_rest = first.steps - sum(e.steps for e in a[:i]) - shared
    return Combined(out, added, diverged=added > 0 and first_rest > 0)


def _same_kind(x: LedgerEntry, y: LedgerEntry) -> bool:
    return (x.noise_multiplier, x.sample_rate, x.private) == (y.noise_multiplier, y.sample_rate, y.private) and (
        x.run is None or y.run is None or x.run == y.run)


def held_runs() -> set[str]:
    """The runs (:attr:`LedgerEntry.run`) whose releases the record of a module alive in this process holds."""
    return {e.run for ledger in list(_RECORDS.values()) for e in ledger.entries if e.run is not None}


def record_of(module: nn.Module) -> Optional[PrivacyLedger]:
    """Every release this process made on ``module`` or any of its submodules (one record, combined), or, when
    none of this process matches, the record of a fit another process wrote to the ledger store that its weights
    match (accounting/ledger_store.py, by the same tests); ``None`` when there was none."""
    owners = (module, *held_modules(module))  # a teacher held in a list or a function: its releases too
    found = [_RECORDS.get(part) for owner in owners for part in owner.modules()]
    found += _by_weights(owners, _BY_CONTENT, _SKETCHES, any(found))
    if not any(found):  # weights another process trained (torch.save, then load_state_dict here)
        stored = ledger_store.read()
        found += _by_weights(owners, stored.by_content, stored.sketches, False)
    seen: list[PrivacyLedger] = []
    for ledger in found:
        if ledger is not None and all(ledger is not other for other in seen):
            seen.append(ledger)
    if not seen:
        return None
    record = seen[0]
    for other in seen[1:]:
        record = combine(record, other).ledger
    return record


def _by_weights(owners: tuple[nn.Module, ...], by_content: dict[bytes, PrivacyLedger], sketches: "Sketches",
                found: bool) -> list[PrivacyLedger]:
    """The records ``owners``' weights carry by the lookups ``by_content`` and ``sketches`` (this process' own, or
    the store's): the same weights as another object (a copy, a reload: module docstring), or near them, else (when
    nothing was ``found`` so far) weights derived from a fit's: an EMA, a snapshot, 0.5·w + noise, a soup."""
    out: list[PrivacyLedger] = []
    if by_content:
        for p in (p for owner in owners for p in _weights(owner)):  # exactly a fit's weights: that fit's record
            exact = by_content.get(digest(p))  # alone (another run that ended on the same values, a rerun with the
            out += [exact] if exact is not None else near(p, sketches)  # same seeds, is not a second history)
    if sketches and not found and not out:
        out += derived([p for owner in owners for p in _weights(owner)], sketches)
    return out


def held_modules(module: nn.Module, depth: int = 3, budget: int = 2_000) -> list[nn.Module]:
    """Modules ``module`` (or a part of it) holds outside its registry — in a list, a dict, a helper object, a
    function's closure, default arguments or the globals it names, a ``functools.partial``, under a public or a
    private name (``self._t = [teacher]``; torch's and Lightning's own, :data:`_INTERNALS`, are not walked) — to
    ``depth`` levels and ``budget`` objects: a privately trained teacher whose outputs the module trains on (soft
    targets, stacked logits) carries its releases into this module's (conservative: ε over-counted when the
    teacher's outputs are only post-processing)."""
    registered = {id(m) for m in module.modules()}
    found: list[nn.Module] = []
    seen: set[int] = set()
    frontier = [v for m in module.modules() for k, v in vars(m).items() if k not in _INTERNALS and k[:2] != "__"]
    for _ in range(depth):
        following: list = []
        for value in frontier:
            if id(value) in seen or len(seen) >= budget:
                continue
            seen.add(id(value))
            if isinstance(value, nn.Module):
                if id(value) not in registered:
                    found.append(value)
                continue
            following.extend(_inside(value))
        frontier = following
    return found


def _inside(value: object) -> list:
    """What ``value`` holds that may be (or hold) a module."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)[:256]
    if isinstance(value, dict):
        return list(value.values())[:256]
    if isinstance(value, (functools.partial, types.MethodType, types.FunctionType)):
        target = value.func if isinstance(value, functools.partial) else getattr(value, "__func__", value)
        named = [target.__globals__[n] for n in target.__code__.co_names if n in target.__globals__] \
            if isinstance(target, types.FunctionType) else []  # a global the function calls: `teacher(x)`
        return [*callable_state(value), *named]
    if hasattr(value, "__dict__") and not isinstance(value, (type, types.ModuleType, Tensor)):
        return [v for k, v in vars(value).items() if not k.startswith("__")]
    return []


def bind(module: nn.Module, ledger: PrivacyLedger) -> None:
    """From now on ``ledger`` (which already holds the module's record) charges the releases made on
    ``module`` and its submodules."""
    for part in module.modules():
        _RECORDS[part] = ledger
    _AT_BIND[module] = at_bind = IdentityMap()
    for p in _trainable(module):
        at_bind[p] = (digest(p), sample(p))
    if ledger.run is None:  # this fit's releases, told apart from another run's with equal settings (combine)
        ledger.run = uuid.uuid4().hex[:16]
    _stop_path(module)
    _STORED[module] = ledger_store.Entry()  # this fit's entry of the ledger store, written at each mark
    path = PathSketches([p for p in _trainable(module) if _sketched(p)], _samples)
    ledger.listen(path)
    _PATHS[module] = (ledger, path)


def _stop_path(module: nn.Module) -> None:
    held = _PATHS.pop(module, None)
    if held is not None:
        held[0].unlisten(held[1])


def unbind(module: nn.Module, ledger: PrivacyLedger) -> None:
    """Leave a copy of ``ledger`` as the record of the parts it was bound to (the step is done with them), and of
    the weights its releases changed (found again in another object: module docstring)."""
    copy = _copy(ledger)
    for part in module.modules():
        if _RECORDS.get(part) is ledger:
            _RECORDS[part] = copy
    for key in [key for key, held in _BY_CONTENT.items() if held is ledger]:  # marked at a checkpoint: the whole fit
        _BY_CONTENT[key] = copy
    for kept in _SKETCHES.values():
        kept[:] = [(start, end, copy if held is ledger else held, path) for start, end, held, path in kept]
    mark(module, copy)
    _AT_BIND.pop(module, None)
    _STORED.pop(module, None)
    _stop_path(module)


def mark(module: nn.Module, ledger: PrivacyLedger) -> None:
    """The weights of ``module`` as they are now carry ``ledger``'s releases: each trainable parameter the releases
    changed since :func:`bind` leaves its digests (:func:`digest`, of its roundings and of it in float64) and a
    sketch (:func:`sample`, beside the same positions when bound) by which a module holding these weights, or weights
    near them, is found. At the end of a fit (a copy of the record) and whenever a checkpoint is written (the fit's
    own ledger: a checkpoint saved mid-fit — "the best one" — reloaded continues every release of the fit, which
    used the same data; :func:`unbind` leaves the copy in its place)."""
    if not ledger.steps:
        return
    copy = ledger
    before = _AT_BIND.get(module, IdentityMap())
    path = _PATHS.get(module, (None, None))[1]
    stored = _STORED.get(module)
    names = {id(p): n for n, p in module.named_parameters()}
    for p in _trainable(module):  # those trainable when bound: a layer unfrozen since and not yet trained (a fit
        held = before.get(p)  # refused before its release) keeps a fresh module's weights, not the record's; nor
        if held is None:  # does a parameter that replaced one since (by identity, not by a freed one's id)
            continue
        now = digest(p)
        if held[0] == now:
            continue
        keys = (now, *_rounded_digests(p))
        for key in keys:
            _BY_CONTENT[key] = copy
        if stored is not None:  # the same material for a new process (accounting/ledger_store.py)
            stored.digests.update(keys)
            stored.trained += [names[id(p)]] if id(p) in names and names[id(p)] not in stored.trained else []
        if _sketched(p):
            end = sample(p)
            along = path.of(p) if path is not None else ()
            _SKETCHES.setdefault(tuple(p.shape), []).append((held[1], end, copy, (*along, end)))
            if stored is not None:
                stored.sketches.setdefault(tuple(p.shape), []).append((held[1], end, (*along, end)))
    if stored is not None:
        ledger_store.write(stored, copy)


def carry(module: nn.Module, ledger: PrivacyLedger, trained: Optional[list[str]] = None) -> None:
    """``module``, loaded from a checkpoint that holds ``ledger`` (accounting/loaded_checkpoints.py, another process's
    fit), carries its releases as a module this process trained would: the record of it and of each submodule, and
    the digests of the weights named in ``trained`` (:func:`trained_names`, written with the ledger), or, for a
    checkpoint without the names, of each trainable weight that is not constant; a digest already recorded here keeps
    its record (this process' own fit)."""
    for part in module.modules():
        held = _RECORDS.get(part)
        _RECORDS[part] = ledger if held is None else combine(held, ledger).ledger
    if trained is not None:
        named = dict(module.named_parameters())
        weights = [named[n] for n in trained if n in named and named[n].dtype.is_floating_point]
    else:
        weights = [p for p in _trainable(module) if not _constant(p)]
    keys = {key for p in weights for key in (digest(p), *_rounded_digests(p))}
    for key in keys:
        _BY_CONTENT.setdefault(key, ledger)
    names = {id(p): n for n, p in module.named_parameters()}  # for a new process too (accounting/ledger_store.py)
    ledger_store.write(ledger_store.Entry(ledger_store.content_key(ledger, keys), keys, {},
                                          [names[id(p)] for p in weights if id(p) in names]), ledger)


def trained_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s weights some fit's releases made what they are (their digests recorded: this fit's
    and earlier ones', after :func:`mark`), written into a checkpoint beside its ledger for :func:`carry`."""
    if not _BY_CONTENT:
        return []
    return [n for n, p in module.named_parameters() if p.numel() and p.dtype.is_floating_point
            and digest(p) in _BY_CONTENT]


def _constant(p: Tensor) -> bool:
    local = (p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1)
    return not local.numel() or bool((local == local[0]).all())


def _copy(ledger: PrivacyLedger) -> PrivacyLedger:
    out = PrivacyLedger()
    out.load_state_dict(ledger.state_dict())
    return out


_SKETCH_SIZE = 64
_MIN_SKETCHED = 16
_NEAR = 0.1
Sketches = dict[tuple[int, ...], list[tuple[Tensor, Tensor, PrivacyLedger, tuple[Tensor, ...]]]]
_SKETCHES: Sketches = {}
"""Shape → (sketch when bound, sketch after the releases, the record, sketches along the fit ending with that after
the releases: accounting/lineage.py) of every parameter the releases changed."""


def sample(p: Tensor) -> Tensor:
    """``p``'s values at :data:`_SKETCH_SIZE` positions spread evenly over it (all of them when fewer), in float64
    on the CPU (a copy, also of weights held so: a view would follow them): its sketch, in any dtype the weights are
    held in."""
    local = (p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1)
    step = max(1, local.numel() // _SKETCH_SIZE)
    return local[::step][:_SKETCH_SIZE].to("cpu", torch.float64, copy=True)


def _sketched(p: Tensor) -> bool:
    return p.numel() >= _MIN_SKETCHED and not _sharded(p) and p.dtype.is_floating_point


def _samples(params: list[Tensor]) -> list[Tensor]:
    """:func:`sample` of each of ``params``, moved to the CPU together (one transfer from an accelerator)."""
    if not params:
        return []
    local = [p.detach().reshape(-1) for p in params]
    picked = [x[::max(1, x.numel() // _SKETCH_SIZE)][:_SKETCH_SIZE] for x in local]
    if len({(x.device, x.dtype) for x in picked}) > 1:
        return [x.to("cpu", torch.float64, copy=True) for x in picked]
    return list(torch.cat(picked).to("cpu", torch.float64).split([x.numel() for x in picked]))


_SOUP_CANDIDATES = 6
"""The fits, nearest first, among which :func:`derived` looks for the two a soup averaged."""


@one_thread()  # a least-squares fit per stored parameter of a shape here: one thread each (lineage.one_thread)
def derived(params: list[Tensor], sketches: Optional[Sketches] = None) -> list[PrivacyLedger]:
    """The records of the fits whose path the weights ``params`` lie on (accounting/lineage.py: an EMA or average of
    the fit's weights, a snapshot from the middle of it, a shrink-and-perturb warm start, a task vector; a soup of two
    fits from one start, on both): a fit is taken when more than half of the parameters it trained (each judged
    by its sketch: :func:`~lightning_dp.accounting.lineage.follows`) are followed by one of ``params`` of their shape
    — weights trained on the same task from the fit's start, publicly, may follow one of its layers by chance.
    ``sketches``: the lookups to match (the ledger store's), this process' own when ``None``. Run with torch's
    intra-op threads at one (:func:`~lightning_dp.accounting.lineage.one_thread`: a store of 256 fits took 18 s on a
    loaded machine, now 0.2 s)."""
    sketches = _SKETCHES if sketches is None else sketches
    heres: dict[tuple[int, ...], list[Tensor]] = {}
    for p in params:
        if _sketched(p) and tuple(p.shape) in sketches:
            heres.setdefault(tuple(p.shape), []).append(sample(p))
    parts: dict[int, tuple[PrivacyLedger, dict[int, bool]]] = {}  # record → its parameters (by start) → followed
    for shape, kept in sketches.items():
        alike: list[list[tuple[float, Tensor, PrivacyLedger, tuple[Tensor, ...]]]] = [[] for _ in heres.get(shape, ())]
        for start, _, ledger, path in kept:
            followed = parts.setdefault(id(ledger), (ledger, {}))[1]
            for k, here in enumerate(heres.get(shape, ())):
                fitted = fit_path(here, start, (path,))
                if fitted is not None and fitted[0] <= RESIDUAL * fitted[1]:
                    followed[id(start)] = True
                elif fitted is not None:  # a clear part of this fit's move, more left: one of a soup's two fits?
                    alike[k].append((fitted[0] / max(fitted[1], 1e-300), start, ledger, path))
            followed.setdefault(id(start), False)
        for here, candidates in zip(heres.get(shape, ()), alike):  # a soup of two fits from one start: both
            candidates = sorted(candidates, key=lambda c: c[0])[:_SOUP_CANDIDATES]  # the nearest: pairs stay few
            for k, (_, start, ledger, path) in enumerate(candidates):
                for _, other_start, other, other_path in candidates[k + 1:]:
                    if other is not ledger and torch.equal(start, other_start) and follows(
                            here, start, path, other_path):
                        parts[id(ledger)][1][id(start)] = parts[id(other)][1][id(other_start)] = True
    return [ledger for ledger, followed in parts.values() if 2 * sum(followed.values()) > len(followed)]


def near(p: Tensor, sketches: Optional[Sketches] = None) -> list[PrivacyLedger]:
    """The records of trained weights ``p`` lies near: nearer to them (at the sketch's positions) than a tenth of
    how far the releases moved them from where they were bound (weights scaled by 1.0001, or with noise added,
    after training; a fresh module initialised as the trained one was is as far from it as training moved it).
    ``sketches``: the lookups to match (the ledger store's), this process' own when ``None``."""
    sketches = _SKETCHES if sketches is None else sketches
    kept = sketches.get(tuple(p.shape)) if p.numel() >= _MIN_SKETCHED and not _sharded(p) else None
    if not kept or not p.dtype.is_floating_point:
        return []
    here = sample(p)
    hits = [(start, end, ledger) for start, end, ledger, _ in kept
            if here.shape == end.shape and float((here - end).norm()) < _NEAR * float((end - start).norm())]
    # fits that went from one start to one end (a rerun with the same seeds) are one history of these weights: the
    # latest marked stands for them, not a composition of runs that each alone explain the weights
    return [ledger for k, (start, end, ledger) in enumerate(hits)
            if not any(torch.equal(start, s) and torch.equal(end, e) for s, e, _ in hits[k + 1:])]


def _sharded(p: Tensor) -> bool:
    """A DTensor (FSDP2): its sketch would be its shard's; sharded weights are found by their digests only."""
    return hasattr(p, "to_local")


LOWER_PRECISIONS = (torch.float16, torch.bfloat16)
"""The precisions trained weights are commonly saved or served in: a module holding them rounded there (in that dtype,
or back in the trained one) is found by the same record."""


def _rounded_digests(p: Tensor) -> list[bytes]:
    """Digests of ``p`` rounded to each of :data:`LOWER_PRECISIONS`, in that dtype and cast back to its own; none for a
    rounding that is constant (a norm's weight of ones moved by 1e-6 is ones again in bfloat16, as a fresh module's is:
    its digest would hand a fresh module this record)."""
    out = [digest(p.detach().to(torch.float64))] if p.dtype == torch.float32 else []  # loaded into `.double()`
    if p.dtype in LOWER_PRECISIONS:
        return out
    for dtype in LOWER_PRECISIONS:
        rounded = p.detach().to(dtype)
        local = (rounded.to_local() if hasattr(rounded, "to_local") else rounded).reshape(-1)
        if local.numel() and not bool((local == local[0]).all()):
            out += [digest(rounded), digest(rounded.to(p.dtype))]
    return out


def adoption_note(held: int, record: int, total: int, diverged: bool) -> str:
    """The log line of :meth:`~lightning_dp.privacy.private_step.PrivateStep.adopt`."""
    if diverged:
        return (f"the ledger ({held} releases) and this module's record in this process ({record} releases) are "
                f"different histories: both are counted, their common part once ({total} releases in all)")
    if held:
        return (f"the ledger ({held} releases, e.g. a restored checkpoint) is a prefix of this module's record in "
                f"this process: the longer record is kept ({total} releases; restoring weights does not take back "
                "releases already made)")
    return (f"this module already made {record} private release(s) (an earlier fit or private step, in this process "
            "or in one the ledger store recorded): the ledger continues from them, so ε, target_epsilon and "
            "PrivacyBudget count them too")


def restore_note(restored: int, total: int, diverged: bool) -> str:
    """The log line of :meth:`~lightning_dp.privacy.private_step.PrivateStep.load_state_dict` when the ledger held
    more than the checkpoint."""
    if diverged:
        return (f"the checkpoint's ledger ({restored} releases) and the one held are different histories: both are "
                f"counted, their common part once ({total} releases in all)")
    return (f"the checkpoint's ledger ({restored} releases) is a prefix of the one held ({total}): the longer is "
            "kept (restoring weights does not take back releases already made)")
