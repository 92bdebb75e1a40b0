"""When the budget left is short of the plan: refuse before training, or recalibrate only when asked.

With ``target_epsilon`` the target is a ceiling on the whole ledger (every release of the module:
a resumed checkpoint's, an earlier fit's). A fit whose plan does not fit the budget left at the
run's σ can only continue with a larger σ: σ* = min{σ : ε(ledger + the plan's remaining rounds at σ)
≤ target}. A finished ε = 3 run resumed for more epochs gets σ* ≈ 50 × the run's σ: near-pure noise,
the model only degrades. So the default is to refuse, before any release, unless σ* stays close to
the reference

    σ_ref = max(σ_run, σ_plan)

σ_run: the σ of the ledger's last release (the run's σ); σ_plan: the σ that ``target_epsilon`` needs
for the trainer's whole plan on its own (what a fresh run of this plan would use; the larger one when
an earlier fit ran at a small given σ). σ* ≤ :data:`SIGMA_RATIO_LIMIT` × σ_ref (3×) recalibrates with
one log line (a crashed run resumed with a slightly longer plan). Beyond that the fit trains only with
``DPStrategy(on_budget_short="recalibrate")``. No σ fitting (the budget is spent) is always
refused. The 3× is a judgement, not a theorem: a step's noise variance grows as σ², so at 3× σ_ref each
step carries 9× the noise variance the run was calibrated for (the reported traps were 50× and 1,200×),
while the modest rise of a crashed run resumed with a somewhat longer plan passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from lightning_dp.errors import PrivacyConfigurationError

OnBudgetShort = Literal["refuse", "recalibrate"]
ON_BUDGET_SHORT: tuple[str, ...] = ("refuse", "recalibrate")
"""The values of ``DPStrategy(on_budget_short=...)``."""

SIGMA_RATIO_LIMIT = 3.0
"""σ* / σ_ref above which a fit is refused unless ``on_budget_short="recalibrate"`` (module docs)."""


def check_on_budget_short(value: str) -> str:
    """``value`` if it is one of :data:`ON_BUDGET_SHORT`, else ``ValueError``."""
    if value not in ON_BUDGET_SHORT:
        raise ValueError(f"on_budget_short must be one of {ON_BUDGET_SHORT}, got {value!r}")
    return value


def too_noisy(needed_sigma: Optional[float], reference_sigma: float, on_budget_short: str) -> bool:
    """Whether a fit needing σ* = ``needed_sigma`` (``None``: no σ fits) must be refused (σ_ref: module docs)."""
    if needed_sigma is None:
        return True
    return on_budget_short == "refuse" and needed_sigma > SIGMA_RATIO_LIMIT * reference_sigma


@dataclass(frozen=True)
class Shortfall:
    """What the budget left allows, for the refusal's message.

    Attributes:
        spent: ε of the ledger at ``delta`` (``accountant``).
        target, delta, accountant: the run's target.
        releases: rounds already in the ledger.
        first_step: the step the fit starts at (the trainer's global step).
        remaining_steps: steps of the plan still to take.
        run_sigma: σ of the ledger's last release.
        affordable: steps the budget left buys at ``run_sigma``.
        needed_sigma: σ*, the σ that fits the rest of the plan (``None``: none does).
        reference_sigma: σ_ref = max(σ_run, σ_plan) (module docs).
    """

    spent: float
    target: float
    delta: float
    accountant: str
    releases: int
    first_step: int
    remaining_steps: int
    run_sigma: float
    affordable: int
    needed_sigma: Optional[float]
    reference_sigma: float

    def error(self) -> PrivacyConfigurationError:
        """The refusal, naming what is left and the three ways on."""
        head = (f"target_epsilon = {self.target} is a ceiling on the whole ledger, and {self.releases} release(s) "
                f"already spent ε = {self.spent:.4g} of it at δ = {self.delta:g} ({self.accountant} accountant; "
                "this module's earlier fits and checkpoints count, a fast_dev_run smoke test too, and other models' "
                "fits on the same records in this process: accounting/data_ledgers.py): "
                f"ε ≈ {max(self.target - self.spent, 0.0):.3g} is left, {self.affordable} more step(s) at the run's "
                f"σ = {self.run_sigma:.4g}. ")
        if self.needed_sigma is None:
            why = f"No σ fits any of the plan's {self.remaining_steps} remaining steps: the budget is spent."
        else:
            why = (f"The plan's {self.remaining_steps} remaining steps would need σ = {self.needed_sigma:.4g}, "
                   f"{self.needed_sigma / self.reference_sigma:.1f}× σ = {self.reference_sigma:.4g} (the larger of the "
                   f"run's σ and the σ this target needs for the plan on its own; limit {SIGMA_RATIO_LIMIT:g}×): the "
                   "steps would be near-pure noise.")
        options = ["stop here: the trained module (or the checkpoint) is the result of this budget",
                   "raise the target explicitly: DPStrategy(target_epsilon=<larger>) (resuming a checkpoint, also "
                   "resume_privacy='new'); ε then counts every release against the new target"]
        if self.needed_sigma is not None:
            options.append(f"train the remaining steps at σ = {self.needed_sigma:.4g} anyway: "
                           "DPStrategy(..., on_budget_short='recalibrate')")
        if self.affordable:
            options.append(f"take only the {self.affordable} step(s) the budget buys at the run's σ: "
                           f"Trainer(max_steps={self.first_step + self.affordable})")
        options.append("if the releases are other models' fits on these records and those models were thrown away "
                       "(a notebook cell run again): lightning_dp.accounting.forget_data_releases() before the fit "
                       "(ε then understates the records' privacy loss if those models are kept)")
        listed = "\n".join(f"({i}) {text}" for i, text in enumerate(options, 1))
        return PrivacyConfigurationError(f"Nothing trained: the budget left is short of the plan. {head}{why}\n"
                                         f"Options:\n{listed}")
