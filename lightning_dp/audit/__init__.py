"""Privacy auditing in one training run (Steinke, Nasr & Jagielski 2023; docs/algorithms.md §8).

An accountant proves ε for the algorithm we meant to run; an audit measures, from
outside, a lower bound on the ε of the code we actually ran. :func:`run_audit` inserts m
canaries (input-space or white-box gradient canaries), each included with probability ½,
trains once, and turns the correct membership guesses into an ε lower bound
(:func:`epsilon_lower_bound`) to compare with the claim.
"""

from lightning_dp.audit.bound import (
    BoundResult,
    audit_from_scores,
    count_correct,
    epsilon_lower_bound,
    guesses_from_scores,
    p_value,
)
from lightning_dp.audit.canaries import (
    CanaryDataModule,
    CanaryDataset,
    InputCanaries,
    canary_losses,
    draw_coins,
    loss_scores,
    make_input_canaries,
)
from lightning_dp.audit.gradient_canaries import GradientCanaryDataModule, GradientCanaryDataset, GradientCanaryModule
from lightning_dp.audit.runner import AuditResult, load_config, run_audit

__all__ = [
    "AuditResult",
    "BoundResult",
    "CanaryDataModule",
    "CanaryDataset",
    "GradientCanaryDataModule",
    "GradientCanaryDataset",
    "GradientCanaryModule",
    "InputCanaries",
    "audit_from_scores",
    "canary_losses",
    "count_correct",
    "draw_coins",
    "epsilon_lower_bound",
    "guesses_from_scores",
    "load_config",
    "loss_scores",
    "make_input_canaries",
    "p_value",
    "run_audit",
]
