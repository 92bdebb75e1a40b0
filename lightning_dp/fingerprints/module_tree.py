"""How the kept-state fingerprint reads a module tree: its shape (:class:`TreeShape`: when to walk it again),
how each module's attributes are read (:func:`attribute_mode`: a torch layer's data only, a torchmetrics ``Metric``'s
persistent states, a user's module all of them) and which of them are state or configuration
(:class:`ModuleAttributes`, kept per module while its attributes hold the same objects), and a torch RNN's list of
weights as its next forward runs on them (:func:`_rnn_listing`).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Sequence

from torch import nn
from torch.nn.utils.prune import BasePruningMethod

from lightning_dp.fingerprints.state_walker import library_function
from lightning_dp.records.library_code import library_named


class TreeShape:
    """The shape of a module tree as it was walked, to tell cheaply whether it is still that tree (:meth:`same`): per
    module its count of parameters and buffers and of submodules, and the submodules of each module that had any,
    by identity. A parameter, buffer or submodule added or removed, or a submodule replaced in its container
    (``model[2] = nn.Linear(...)``, ``model.head = ...``), or a module's class reassigned (``m.__class__ = ...``:
    its attribute mode may differ) changes it (this holds the modules it walked, so a new one is never at an address
    of theirs); a parameter or buffer replaced in its slot does not (the fingerprint reads the slots anew)."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = list(modules)
        self.containers = [m for m in self.modules if m._modules]
        self.counts = self._counts()
        self.children = self._children()
        self.classes = list(map(type, self.modules))

    def _counts(self) -> list[int]:
        return [len(m._parameters) + len(m._buffers) + (len(m._modules) << 32) for m in self.modules]

    def _children(self) -> list[Any]:
        return [c for m in self.containers for c in m._modules.values()]

    def same(self) -> bool:
        """Whether the tree has the shape it had when walked."""
        if self._counts() != self.counts:  # a module that had no submodule and gained one shows here
            return False
        children = self._children()
        return len(children) == len(self.children) and all(map(operator.is_, children, self.children)) \
            and all(map(operator.is_, map(type, self.modules), self.classes))  # (``layer.__class__ = nn.Sigmoid``)


DATA_ONLY = ["<data>"]
"""The attribute mode of torch's own layers: only values that can hold data (tensors, arrays, containers, objects)."""


_NUMBERS = (bool, int, float, str)


class ModuleAttributes:
    """Reads a module's attributes as the fingerprint compares them: those that are state and, for a torch layer, its
    configuration (:func:`_configuration`), with their entry names, public ones (``public(path)``) left out. Which
    names those are is kept per module and reused while its ``__dict__`` holds the same names bound to objects of the
    same types (for a user's module, the same objects: whether a function is a library's is read from it), under the
    same name prefix: that is all they depend on. The values are read anew at every call, so every value is compared
    at every fingerprint as before. ``skip_keys``: the engine's and the frameworks' own names."""

    def __init__(self, skip_keys: frozenset[str], public: Callable[[str], bool]) -> None:
        self.skip_keys = skip_keys
        self.public = public
        self._cache: dict[int, tuple[nn.Module, str, tuple[Any, ...], list[tuple[str, str, str]],
                                     list[tuple[str, str]]]] = {}

    def read(self, m: nn.Module, mode: list[str],
             prefix: str) -> tuple[list[tuple[str, str, Any]], list[tuple[str, Any]]]:
        """((path, entry, value) of the state, (entry, value) of the configuration) of ``m``, named under ``prefix``,
        read in ``mode`` (:func:`attribute_mode`; not ``None``)."""
        if mode and mode is not DATA_ONLY:
            return [(prefix + k, f"attribute {prefix}{k}", getattr(m, k)) for k in mode
                    if not self.public(prefix + k)], []
        fields = vars(m)
        values = fields.values()
        # names and types (and, where a function is state, which objects: a torch layer's callables never are)
        held = (*fields, *map(type, values)) if mode is DATA_ONLY else (*fields, *map(id, values), *map(type, values))
        cached = self._cache.get(id(m))
        if cached is None or cached[0] is not m or cached[1] != prefix or cached[2] != held:
            cached = self._cache[id(m)] = (m, prefix, held, *self._names(fields, mode, prefix))
        state = [(path, entry, fields[k]) for k, path, entry in cached[3]]
        return _rnn_listing(m, state) if isinstance(m, nn.RNNBase) else state, [(e, fields[k]) for k, e in cached[4]]

    def _names(self, fields: dict[str, Any], mode: list[str],
               prefix: str) -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
        state = []
        recomputed = _pruned_tensors(fields)
        for key, value in fields.items():
            if key == "forward" and not engine_forward(value):  # (an engine's name too: the others are state)
                if not self.public(prefix + key):
                    state.append((key, prefix + key, f"attribute {prefix}{key}"))
                continue
            if (key in self.skip_keys or key.startswith("_dp_") or isinstance(value, nn.Module)
                    or library_function(value) or key in recomputed):
                continue
            if mode is DATA_ONLY and _layer_setting(key, value):
                continue
            if not self.public(prefix + key):
                state.append((key, prefix + key, f"attribute {prefix}{key}"))
        configuration = [(k, f"configuration {prefix}{k}") for k, _ in _configuration(fields)
                         if not self.public(prefix + k)] if mode is DATA_ONLY else []
        return state, configuration




def _pruned_tensors(fields: dict[str, Any]) -> frozenset[str]:
    """The attributes ``torch.nn.utils.prune`` sets before every call of a pruned layer (``weight = weight_orig *
    weight_mask``, by its forward pre-hook): a copy of the product of a parameter and a buffer, both fingerprinted,
    made anew at each call (not state: compared, it would differ at every step by identity)."""
    hooks = fields.get("_forward_pre_hooks")
    if not hooks:
        return frozenset()
    return frozenset(h._tensor_name for h in hooks.values() if isinstance(h, BasePruningMethod))


def _layer_setting(key: str, value: Any) -> bool:
    """Whether a torch layer's attribute is its own setting, not state: ``None``, a public number or string (its
    configuration, compared apart by :func:`_configuration`), or its ``forward`` swapped in by an engine for the fit
    (lightning_dp's ``ReplacedForward``). State, walked and compared at every release: any other ``forward`` set on
    the layer (``layer.forward = torch.sigmoid if y.mean() > 0.5 else torch.tanh``: what the layer computes, chosen
    by the data, as a class swapped would be), a dtype or device (``m.compute_dtype = float64 if
    x.abs().max() > 3 else float32`` is a bit of the batch), a tuple or ``torch.Size`` (a forward
    hook's ``setattr(m, "features_in", inputs)``, ``(h.detach(),)``, ``m.seen_shape = ids.shape``: a padded batch's
    length is its longest record's; a tuple of ``int`` sizes costs little and never changes), a number under a
    private name (``m._seen += len(y)``: no configuration of torch's changes in a step) and any other callable (a
    lambda whose closure holds the batch's mean)."""
    if value is None:
        return True
    if type(value) in _NUMBERS:
        return not key.startswith("_")
    return key == "forward" and engine_forward(value)


def engine_forward(value: Any) -> bool:
    """Whether a ``forward`` set on a module is an engine's for the fit (lightning_dp's ``ReplacedForward``)."""
    return library_named(type(value), "lightning_dp.")


def _configuration(fields: dict[str, Any]) -> list[tuple[str, Any]]:
    """A torch layer's numbers and flags that set what its forward computes (``Dropout.p``, ``eps``, a loss's
    ``label_smoothing`` or ``reduction``), from its ``vars``: set from the data between two releases they steer the next
    step by it. Its mode (``training``) is read apart, as the next training step will run it
    (:func:`~lightning_dp.validators.kept_state.training_modes`)."""
    return [(k, v) for k, v in fields.items() if type(v) in _NUMBERS and k != "training" and not k.startswith("_")]


def attribute_mode(m: nn.Module) -> Optional[list[str]]:
    """How :class:`~lightning_dp.validators.kept_state.StateFingerprint` reads ``m``'s attributes: for torch's own
    layers only the values that can hold data (their configuration — sizes, flags, names — is not state, but a tensor a
    user caches on an ``nn.Linear`` is: :data:`DATA_ONLY`), for a torchmetrics ``Metric`` the names of its persistent
    states (``None``: it has none), else ``[]``: every attribute."""
    if library_named(type(m), "torch."):  # (written there: not a user's class claiming torch's module)
        return DATA_ONLY
    states = _metric_states(m)
    if states is not None:
        return states if states else None
    return []


def _metric_states(m: nn.Module) -> Optional[list[str]]:
    """A torchmetrics ``Metric``'s persistent states (what its state dict keeps), or ``None`` for other modules."""
    defaults = getattr(m, "_defaults", None)
    persistent = getattr(m, "_persistent", None)
    if not isinstance(defaults, dict) or not isinstance(persistent, dict) or not hasattr(m, "_update_count"):
        return None
    return [name for name in defaults if persistent.get(name)]


def _rnn_listing(m: nn.Module, fields: list[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
    """``fields`` (path, entry, value) of a torch RNN layer with its list of weights for the fused kernel
    (``_flat_weights``, and the weak references ``_flat_weight_refs`` that tell it is stale) read as what its next
    forward runs on. torch keeps that list itself, from the parameters: a ``functional_call`` (the per-example replay of
    a layer whose inter-layer dropout draws, the probe's dropout-free pass) leaves its substitutes listed, and the next
    forward lists the parameters again (``_update_flat_weights``). So the entry is, per weight, whether the next forward
    runs on a parameter (or on the weight the module holds now: a ``functional_call``'s while it runs): always, when the
    listing is stale; a plain tensor written into an up-to-date list is still seen."""
    if not isinstance(m, nn.RNNBase) or not all(hasattr(m, k) for k in ("_flat_weights", "_flat_weights_names")):
        return fields
    stale = getattr(m, "_weights_have_changed", None)
    relisted = bool(stale()) if callable(stale) else False
    runs_on = tuple(relisted or isinstance(w, nn.Parameter) or w is getattr(m, name, None)
                    for name, w in zip(m._flat_weights_names, m._flat_weights))
    named = [(p, e, v, p.rpartition(".")[2]) for p, e, v in fields]
    return [(p, e, runs_on if k == "_flat_weights" else v) for p, e, v, k in named if k != "_flat_weight_refs"]
