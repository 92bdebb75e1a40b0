"""The ``lightning-dp`` command.

``lightning-dp fit|validate|test|predict --config FILE`` is Lightning's own CLI
(LightningCLI) with a privacy summary after ``fit``; every other subcommand
(``budget``, ``report``, ``audit``, ...) is a small tool in :mod:`lightning_dp.commands`,
registered by name in :data:`COMMANDS`.
"""

from __future__ import annotations

import importlib
import math
import sys
from typing import Optional

from pytorch_lightning.cli import LightningArgumentParser, LightningCLI

#: Subcommands outside LightningCLI: name -> (module with ``main(argv) -> int``, one-line help).
COMMANDS: dict[str, tuple[str, str]] = {
    "budget": ("lightning_dp.commands.budget", "ε of a setting, or σ for a target ε, from several accountants"),
    "audit": ("lightning_dp.commands.audit", "one-run privacy audit: empirical ε lower bound vs the claimed ε"),
    "report": ("lightning_dp.commands.report", "Table 1 and a Figure-2-like PNG from SecondMomentMonitor logs"),
}

_LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


class DPLightningCLI(LightningCLI):
    """LightningCLI that tests the model after ``fit`` and prints what the run spent."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Add ``--privacy_delta`` (δ at which the spent ε is reported)."""
        parser.add_argument("--privacy_delta", type=float, default=1e-5, help="δ at which to report the ε spent")
        parser.add_argument("--test_after_fit", type=bool, default=True, help="run the test set after fit")

    def after_fit(self) -> None:
        """Run the test split (if the data has one) and print accuracy and ε."""
        config = self.config[self.subcommand]
        metrics: dict[str, float] = {}
        if config.get("test_after_fit", True) and _has_test_data(self):
            results = self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=None, verbose=False)
            metrics = {k: float(v) for k, v in (results[0] if results else {}).items()}
        if self.trainer.is_global_zero:
            print(privacy_summary(self.trainer.strategy, config.get("privacy_delta", 1e-5), metrics))


def _has_test_data(cli: LightningCLI) -> bool:
    from pytorch_lightning.utilities.model_helpers import is_overridden

    owner = cli.datamodule if cli.datamodule is not None else cli.model
    return owner is not None and is_overridden("test_dataloader", owner)


def privacy_summary(strategy: object, delta: float, metrics: dict[str, float]) -> str:
    """One human-readable block: test metrics, ε at δ, and the mechanism's parameters."""
    from lightning_dp.accounting import ledger_epsilon
    from lightning_dp.strategy import DPStrategy

    lines = ["", "=== lightning_dp summary ==="]
    for name, value in sorted(metrics.items()):
        shown = f"{100 * value:.2f} %" if name.endswith("acc") else f"{value:.4f}"
        lines.append(f"{name}: {shown}")
    if not isinstance(strategy, DPStrategy):
        lines.append("Not trained with DPStrategy: no privacy guarantee.")
        return "\n".join(lines)
    ledger = strategy.ledger
    eps = ledger_epsilon(ledger, delta) if ledger.steps else 0.0
    eps_text = "inf (a non-private variant was used)" if math.isinf(eps) else f"{eps:.4f}"
    lines.append(f"privacy: ε = {eps_text} at δ = {delta:g} (RDP accountant) after {ledger.steps} steps")
    lines.append(
        f"mechanism: σ = {strategy.noise_multiplier:.4g}, C = {strategy.max_grad_norm:g}, "
        f"q = {strategy.sample_rate:.4g} (expected batch {strategy.expected_batch_size:g} of N = {strategy.num_samples})"
    )
    return "\n".join(lines)


def _usage() -> str:
    extra = "\n".join(f"  {name:<9} {help_}" for name, (_, help_) in sorted(COMMANDS.items()))
    return (
        "usage: lightning-dp {fit,validate,test,predict} --config FILE [options]\n"
        "       lightning-dp COMMAND [options]\n\n"
        "Lightning subcommands (LightningCLI; `lightning-dp fit --help` lists options):\n"
        "  fit       train, then test and print the ε spent\n"
        "  validate, test, predict\n\n"
        f"Tools:\n{extra}\n"
    )


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``lightning-dp``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command = argv[0]
    if command in COMMANDS:
        module = importlib.import_module(COMMANDS[command][0])
        return int(module.main(argv[1:]) or 0)
    if command not in _LIGHTNING_SUBCOMMANDS:
        print(f"lightning-dp: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    DPLightningCLI(args=argv, save_config_kwargs={"overwrite": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
