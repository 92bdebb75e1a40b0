"""The inputs that steps declared public trained on: a sample of the rows a model's forward received inside
:func:`~lightning_dp.records.outside_steps.public_steps`, kept with the parameters those steps trained.

Steps inside ``public_steps()`` (``PublicPretraining``'s loop, a user's own loop) are not counted as fits outside the
mechanism: the user declares their data public. Nothing else checked the declaration: a loop over the private
training set inside the block trained on it without noise, and the ledger counted only the DP fit that followed. So
while a block is open (and only then) a global forward pre-hook (``register_module_forward_pre_hook``) keeps a
sample of the rows of the first tensor argument of each outermost module call made with gradients enabled: at most
:data:`SAMPLE_ROWS` rows per block (reservoir sampling, a fixed seed; fewer for wide rows: :data:`MAX_BYTES`), copied
to the CPU. Each optimizer step in the block links the parameters it stepped to the block's sample (a weak reference:
the link goes with the parameter). When a private fit attaches, :func:`public_rows` gives the rows its model's
parameters were trained on as public, and :mod:`lightning_dp.record_statistics.public_overlap` compares them with
the training records.

What it cannot see: inputs passed by keyword only (``model(input_ids=...)``), 1-D inputs, a step whose forward ran
outside the block, inputs transformed before the model sees them differently from the training records (compared
as they are).
"""

from __future__ import annotations

import random
import weakref
from typing import Any, Iterable, Optional

import torch
from torch import Tensor
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from lightning_dp.records.held_records import DIGESTED_DTYPES

SAMPLE_ROWS = 256
"""Rows of a block's inputs kept (at most)."""

MAX_BYTES = 32 << 20
"""Bytes of a block's kept rows (at most): wide rows (images) keep fewer than :data:`SAMPLE_ROWS`, at least 16."""


class PublicSample:
    """A reservoir sample of the input rows of one ``public_steps()`` block."""

    def __init__(self) -> None:
        self.rows: list[Tensor] = []
        self.seen = 0
        self._rng = random.Random(0)

    def offer(self, x: Tensor) -> None:
        """Offer each row of ``x`` (a batch along dimension 0) to the sample; the kept ones are copied to the CPU
        (in one transfer)."""
        row_bytes = max(1, x[0].numel() * x.element_size())
        capacity = max(16, min(SAMPLE_ROWS, MAX_BYTES // row_bytes))
        slots: dict[int, int] = {}  # slot in the sample → row of x (a later row replacing an earlier one wins)
        filled = len(self.rows)
        for i in range(x.shape[0]):
            self.seen += 1
            if filled < capacity:
                slots[filled], filled = i, filled + 1
            else:
                j = self._rng.randrange(self.seen)
                if j < capacity:
                    slots[j] = i
        if not slots:
            return
        kept = x.detach()[torch.tensor(list(slots.values()), device=x.device)].to("cpu", copy=True)
        for slot, row in zip(slots, kept):
            if slot < len(self.rows):
                self.rows[slot] = row
            else:
                self.rows.append(row)


_LINKED: dict[int, tuple["weakref.ref[Any]", list[PublicSample]]] = {}
"""``id`` of a parameter stepped inside ``public_steps()`` → (a weak reference to it, the samples of its blocks)."""
_BLOCK: list[Optional[PublicSample]] = [None]
_CALL_DEPTH = [0]
_HANDLES: list[Any] = []


def open_block() -> None:
    """The outermost ``public_steps()`` block begins: a new sample, the forward hooks installed."""
    _BLOCK[0], _CALL_DEPTH[0] = PublicSample(), 0
    _HANDLES.extend([register_module_forward_pre_hook(_before_forward),
                     register_module_forward_hook(_after_forward, always_call=True)])


def close_block() -> None:
    """The outermost ``public_steps()`` block ends: the hooks removed (its sample stays with the parameters)."""
    while _HANDLES:
        _HANDLES.pop().remove()
    _BLOCK[0], _CALL_DEPTH[0] = None, 0


def link_stepped(params: Iterable[Any]) -> None:
    """The parameters an optimizer stepped inside the open block were trained on its inputs."""
    sample = _BLOCK[0]
    if sample is None:
        return
    for p in params:
        key = id(p)
        held = _LINKED.get(key)
        if held is None or held[0]() is not p:
            held = (weakref.ref(p, lambda r, key=key: _forget(key, r)), [])
            _LINKED[key] = held
        if not any(s is sample for s in held[1]):
            held[1].append(sample)


def public_rows(params: Iterable[Any]) -> list[Tensor]:
    """The kept input rows of the ``public_steps()`` blocks that stepped any of ``params`` (each block once)."""
    samples: dict[int, PublicSample] = {}
    for p in params:
        held = _LINKED.get(id(p))
        if held is not None and held[0]() is p:
            samples.update((id(s), s) for s in held[1])
    return [row for s in samples.values() for row in s.rows]


def _forget(key: int, ref: "weakref.ref[Any]") -> None:
    held = _LINKED.get(key)
    if held is not None and held[0] is ref:
        del _LINKED[key]


def _before_forward(module: Any, args: Any) -> None:
    _CALL_DEPTH[0] += 1
    sample = _BLOCK[0]
    if _CALL_DEPTH[0] != 1 or sample is None or not torch.is_grad_enabled():
        return
    x = next((a for a in args if isinstance(a, Tensor)), None) if isinstance(args, tuple) else None
    if x is not None and x.dim() >= 2 and x.shape[0] and x.dtype in DIGESTED_DTYPES and x.layout == torch.strided:
        sample.offer(x)


def _after_forward(module: Any, args: Any, output: Any) -> None:
    _CALL_DEPTH[0] = max(0, _CALL_DEPTH[0] - 1)
