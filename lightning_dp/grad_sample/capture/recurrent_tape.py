"""What the backward of one RNN call leaves for the clipping: its weights' linear forms.

The ghost engine's forward of torch's RNNs (:mod:`~lightning_dp.grad_sample.recurrent_forward`) is an
autograd function whose backward is the unrolled rule (:mod:`~lightning_dp.grad_sample.rnn_unrolled`): on
its way to the input gradients it computes every layer's gate gradients, hence the per-example weight gradients'
linear forms. It leaves them on the call's tape, which the capture finds from the call's output (the function's node)
and keeps on the call's record; the clipping reads them there instead of recomputing the recurrence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(eq=False)
class RecurrentTape:
    """The linear forms one RNN call's backward computed.

    ``names``: the parameters whose forms the backward computes (those requiring grad at the call). ``forms``:
    :class:`~lightning_dp.grad_sample.linear_forms.LinearForm` per layer and direction, over the call's
    rows, their gradients those of the loss as it is (the clipping multiplies by n, the mean's 1/n undone); ``None``
    until the backward ran. ``spent``: a second backward reached the call (``retain_graph``): the forms of one
    backward are no longer the call's, and the clipping recomputes from the record's accumulated output gradients.
    """

    names: frozenset[str]
    forms: Optional[list[Any]] = None
    spent: bool = False

    def receive(self, forms: list[Any]) -> None:
        """The backward's forms; a second backward spends the tape."""
        if self.forms is not None or self.spent:
            self.forms, self.spent = None, True
        else:
            self.forms = forms

    def forms_of(self, names: set[str]) -> Optional[list[Any]]:
        """The forms of the ``names`` parameters, or None where the tape does not hold them all (not run, spent, or
        a parameter that did not require grad at the call)."""
        if self.forms is None or not names <= self.names:
            return None
        if names == self.names:
            return self.forms
        kept = (form.restricted(names) for form in self.forms)
        return [form for form in kept if form is not None]


def tape_of(out: Any) -> Optional[RecurrentTape]:
    """The tape of the call whose output is ``out``, when that output came from the taped forward, else None."""
    tape = getattr(getattr(out, "grad_fn", None), "tape", None)
    return tape if isinstance(tape, RecurrentTape) else None
