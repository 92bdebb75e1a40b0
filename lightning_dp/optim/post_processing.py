"""Post-processing DP-Adam: plain Adam/AdaGrad on the privatised gradient ĝ (docs/algorithms.md §1)."""

from __future__ import annotations

from typing import ClassVar

from lightning_dp.optim.preconditioner import Preconditioner


class PostProcessing(Preconditioner):
    """The baseline: ``v`` averages ĝ², divisor ``√v̂ + ε`` (§1).

    Needs nothing from the mechanism, so it also runs outside ``DPStrategy``
    (then it is simply Adam / AdamW / AdaGrad).
    """

    name: ClassVar[str] = "post_processing"
    requires_release: ClassVar[bool] = False

    def __init__(self) -> None:
        pass
