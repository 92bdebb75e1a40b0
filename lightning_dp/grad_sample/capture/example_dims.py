"""Where the example dimension is, for the layers whose inputs and outputs are not batch-first.

Most layers take and return ``[B, …]``. A few torch layers put the examples elsewhere by
default, and some return several tensors: ``nn.MultiheadAttention`` (``batch_first=False``:
``[T, B, d]``; attention weights ``[B, T, S]``) and ``nn.LSTM``/``nn.GRU``/``nn.RNN``
(``batch_first=False``: ``[T, B, d]``; the hidden states ``h_n``/``c_n`` are ``[L, B, H]``
whatever ``batch_first`` says). The capture verifies each output against the step's number of
examples at the dimension given here, and the per-layer vmap slices inputs and output
gradients there, so these layers get exact per-example gradients unchanged.

``nn.MultiheadAttention`` is also a *unit*: it owns ``in_proj_weight`` and calls its child
``out_proj``'s weight functionally, so it is hooked as one layer with all its parameters.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

UNITS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)
"""Modules hooked as one layer together with their children's parameters."""


@dataclass(frozen=True)
class ExampleDims:
    """The example dimension of a layer's arguments and of its output tensors.

    Attributes:
        argument: argument slot (positional index as a string, or keyword name) → its example
            dimension, or ``None`` for an argument never sliced per example (an attention mask).
        outputs: example dimension of each tensor of the output, in ``tree_flatten`` order
            (outputs past the end use 0).
    """

    argument: Callable[[str], Optional[int]]
    outputs: tuple[int, ...] = (0,)

    def output(self, k: int) -> int:
        """The example dimension of output tensor k."""
        return self.outputs[k] if k < len(self.outputs) else 0


BATCH_FIRST = ExampleDims(lambda key: 0)


def _attention(m: nn.MultiheadAttention) -> ExampleDims:
    seq = 0 if m.batch_first else 1
    slots = {"0": seq, "1": seq, "2": seq, "query": seq, "key": seq, "value": seq, "3": 0, "key_padding_mask": 0}
    return ExampleDims(lambda key: slots.get(key), (seq, 0))


STATE_NAMES = frozenset({"hx", "h0", "h_0", "hidden", "hidden_state", "state", "states", "initial_state"})
"""Argument names an RNN subclass's ``forward`` gives its initial state (``[L, B, H]``: the examples in dimension 1)."""

_TORCH_FORWARDS = frozenset({nn.RNN.forward, nn.LSTM.forward, nn.GRU.forward, nn.RNNBase.forward})
_PARAMETERS: dict[Any, tuple[str, ...]] = {}


def _parameter_names(m: nn.Module) -> tuple[str, ...]:
    """The names of ``m.forward``'s parameters in order (without ``self``), cached per function."""
    fn = getattr(type(m), "forward")
    if fn not in _PARAMETERS:
        _PARAMETERS[fn] = tuple(inspect.signature(fn).parameters)[1:]
    return _PARAMETERS[fn]


def _recurrent(m: nn.RNNBase) -> ExampleDims:
    """torch's RNNs: ``input`` at the sequence layout's example dimension, ``hx`` in dimension 1. A subclass with a
    ``forward`` of its own (an LSTM taking ``lengths=`` and packing inside: ``forward(self, x, lengths=None)``) binds
    its call to its own signature (:func:`~.capture.bind_call`): its first argument is the input, an argument named
    like a state (:data:`STATE_NAMES`) holds the examples in dimension 1, and any other tensor is one row per example
    in dimension 0 (``lengths`` ``[B]``, a mask ``[B, T]``; passed whole when it has no such rows)."""
    seq = 0 if m.batch_first else 1
    if type(m).forward in _TORCH_FORWARDS:
        return ExampleDims(lambda key: seq if key in ("0", "input") else 1, (seq, 1, 1))
    names = _parameter_names(m)

    def argument(key: str) -> int:
        name = names[int(key)] if key.isdigit() and int(key) < len(names) else key
        if key == "0" or (names and name == names[0]):
            return seq
        return 1 if name in STATE_NAMES else 0

    return ExampleDims(argument, (seq, 1, 1))


TIME_MAJOR_CONTAINERS: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
                                                      nn.TransformerEncoder, nn.TransformerDecoder)
"""torch layers that run their position-wise sublayers on ``[T, B, d]`` when ``batch_first=False`` (the
stacks too: their final ``norm`` sees the last layer's time-major output; ``nn.Transformer`` is two stacks)."""


POSITION_WISE: tuple[type[nn.Module], ...] = (nn.Linear, nn.LayerNorm, nn.RMSNorm, nn.Embedding)
"""torch layers that act on each position of ``[…, d]`` alone: called on ``[T, B, …]`` outside a time-major
container (a tutorial ViT's norms and MLP around ``nn.MultiheadAttention(batch_first=False)``) they are served
time-major where autograd's record proves dimension 1 holds the examples (:mod:`~.validators.example_layout`,
:meth:`~.capture.ActivationCapture._time_major_call`)."""


def position_wise(module: nn.Module) -> bool:
    """Whether ``module`` is one of :data:`POSITION_WISE` with that class's own forward (a subclass that rearranges its
    input first is not position-wise)."""
    return any(isinstance(module, kind) and type(module).forward is kind.forward for kind in POSITION_WISE)


def time_major_layers(root: nn.Module) -> set[int]:
    """``id`` of every position-wise layer (Linear, LayerNorm, …: not a unit, not an RNN) inside a
    :data:`TIME_MAJOR_CONTAINERS` layer built with ``batch_first=False``. Their calls see ``[T, B, …]``;
    the capture moves the example dimension to the front (views), which for a position-wise layer
    changes nothing but the order of rows, so every engine rule applies unchanged."""
    ids: set[int] = set()
    for container in root.modules():
        if isinstance(container, TIME_MAJOR_CONTAINERS) and not _batch_first(container):
            ids.update(id(m) for m in container.modules()
                       if m is not container and not isinstance(m, (*UNITS, nn.RNNBase)))
    return ids


def _batch_first(container: nn.Module) -> bool:
    layers = getattr(container, "layers", None)  # a stack: its layers' layout
    if isinstance(layers, nn.ModuleList) and len(layers) > 0:
        container = layers[0]
    attention = getattr(container, "self_attn", None)
    return bool(getattr(attention, "batch_first", False))


def example_dims(module: nn.Module) -> ExampleDims:
    """The :class:`ExampleDims` of ``module`` (batch-first for every layer not listed above)."""
    if isinstance(module, nn.MultiheadAttention):
        return _attention(module)
    if isinstance(module, nn.RNNBase):
        return _recurrent(module)
    return BATCH_FIRST


def draws_randomness(module: nn.Module) -> bool:
    """Whether a call of ``module`` itself draws random numbers (attention or inter-layer RNN
    dropout in training mode): recomputing it must replay the call's random state."""
    if not isinstance(module, (*UNITS, nn.RNNBase)):  # before the getattr: a missing attribute raises inside it
        return False
    p = getattr(module, "dropout", 0.0)
    return module.training and isinstance(p, float) and p > 0
