"""The sanity check's validation hooks reading the training records: what they kept is refused as training starts
(zoo39 L02, L25).

Lightning runs ``num_sanity_val_steps`` (2 by default) validation batches inside ``trainer.fit``, before the fit
loop builds the training loader. :mod:`.validation_reads` watches validation's hooks for torch calls handed a copy
of the training data — but the copies are found from the training loader's dataset, which does not exist yet then,
so a read during the sanity check went unseen; and the state those hooks left (a buffer, an attribute) became the
baseline every later release is compared with. A prior of the training labels written into a model buffer by
``on_validation_epoch_end`` (``self.trainer.datamodule.train_set``, a global copy) was thus set by the sanity check,
written again with the same value by every later validation, and trained with from the first step: an un-noised
statistic of the private data in the model.

:class:`SanityReads` records, during the sanity check, where the memory handed to torch by the user's evaluation
hooks (:data:`~.validation_reads.EVALUATION_HOOKS`) lies — (device, first byte, end) of each tensor or NumPy array
argument, lightning_dp's own calls left out — and the state's fingerprint before and after it. As training starts,
when the training data's copies are known, :meth:`SanityReads.read` compares those spans with the copies'
(:meth:`~.validation_reads.EvaluationReads.covers`): a sanity check that read a training copy and changed the kept
state is refused before any release, naming what it wrote. A sanity check that reads only the validation data, or
that reads the training data and keeps nothing (a logged value: a report), trains.

Not seen: reads not handed to torch (NumPy or Python code alone), a copy made after the sanity check at a span a
sanity-check temporary had occupied (then a false read: only with a write), and what the sanity check kept where the
fingerprint does not look (rule 3's limits).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_dp.records.memory_spans import memory_span
from lightning_dp.validators.kept_state import StateFingerprint
from lightning_dp.validators.validation_reads import (EVALUATION_HOOKS, METADATA, EvaluationReads, function_name,
                                                      library_call, pop_mode)

__all__ = ["SanityReads"]

Span = tuple[str, int, int]


class SanityReads(TorchFunctionMode):
    """Records the memory spans the user's evaluation hooks hand to torch during the sanity check (module docstring).

    Args:
        trainer: the fitting trainer (its module names the hook running: ``_current_fx_name``).
        take: takes the kept state's fingerprint (the same fingerprint's ``take`` each time).
    """

    def __init__(self, trainer: Any, take: Callable[[], Any]) -> None:
        super().__init__()
        self._module = trainer.lightning_module
        self._take = take
        self._before = take()
        self._after: Optional[Any] = None
        self.spans: dict[Span, str] = {}  # span -> the first hook that handed it to torch

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        hook = getattr(self._module, "_current_fx_name", None)
        if hook in EVALUATION_HOOKS and function_name(func) not in METADATA:
            self._note(hook, (*args, *kwargs.values()))
        return func(*args, **kwargs)

    def _note(self, hook: str, values: Sequence[Any]) -> None:
        """Note the spans of the tensors and arrays among ``values`` (and in a list or tuple of them) not noted yet,
        unless the call is lightning_dp's own (asked once per call that hands a new span: a stack walk)."""
        new = [span for value in values for item in (value[:64] if isinstance(value, (list, tuple)) else (value,))
               if isinstance(item, (Tensor, np.ndarray)) and (span := memory_span(item)) is not None
               and span not in self.spans]
        if new and not library_call(__name__):
            for span in new:
                self.spans[span] = hook

    def close(self) -> None:
        """The sanity check ended: stop recording; the state as it left it is what :meth:`changed` compares (taken
        at the first call: a later one, as training starts, would count what ``on_train_start`` wrote)."""
        if self._after is not None:
            return
        pop_mode(self)
        self._after = self._take()

    def changed(self) -> list[str]:
        """The kept state's entries the sanity check changed (its parameters' contents are rule 3's elsewhere)."""
        if self._after is None:
            return []
        return [c for c in StateFingerprint.changed(self._before, self._after) if not c.startswith("contents of ")]

    def read(self, copies: Sequence[tuple[str, Any]]) -> Optional[str]:
        """The first evaluation hook that handed torch memory of the training data's ``copies`` (``None``: none)."""
        if not self.spans:
            return None
        watch = EvaluationReads(self._module.trainer, copies, lambda hook: None)
        return next((hook for span, hook in self.spans.items() if watch.covers(span)), None)
