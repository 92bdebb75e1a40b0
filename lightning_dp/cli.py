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
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # imported on first use: `lightning-dp --help` and the tools load no torch/Lightning
    from pytorch_lightning.cli import LightningArgumentParser, LightningCLI

#: Subcommands outside LightningCLI: name -> (module with ``main(argv) -> int``, one-line help).
COMMANDS: dict[str, tuple[str, str]] = {
    "budget": ("lightning_dp.commands.budget", "ε of a setting, or σ for a target ε, from several accountants"),
    "audit": ("lightning_dp.commands.audit", "one-run privacy audit: empirical ε lower bound vs the claimed ε"),
    "report": ("lightning_dp.commands.report", "Table 1 and a Figure-2-like PNG from SecondMomentMonitor logs"),
}

_LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


class _DPLightningCLIHooks:
    """LightningCLI that tests the model after ``fit`` and prints what the run spent.

    The hooks of :class:`DPLightningCLI`, which is this class on top of Lightning's
    ``LightningCLI``, built on first use (:func:`_lightning_cli_class`) so that importing
    this module loads neither torch nor Lightning.
    """

    config: Any
    subcommand: Any
    trainer: Any
    model: Any
    datamodule: Any

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Add ``--privacy_delta`` and ``--allow_mismatch`` (δ of the summary: :func:`privacy_summary`)."""
        parser.add_argument(
            "--privacy_delta", type=Optional[float], default=None,
            help="δ at which to report the ε spent. Default: the strategy's target_delta (a different value is "
                 "refused unless --allow_mismatch=true); for a run without target_delta, 1/N^1.1",
        )
        parser.add_argument(
            "--allow_mismatch", type=bool, default=False,
            help="report at a --privacy_delta that differs from the strategy's target_delta, on purpose",
        )
        parser.add_argument("--test_after_fit", type=bool, default=True, help="run the test set after fit")

    def before_fit(self) -> None:
        """Refuse, before training, a ``--privacy_delta`` that differs from the strategy's ``target_delta``."""
        config = self.config[self.subcommand]
        _summary_delta(self.trainer.strategy, config.get("privacy_delta"), bool(config.get("allow_mismatch")))

    def after_fit(self) -> None:
        """Run the test split (if the data has one) and print accuracy and ε."""
        config = self.config[self.subcommand]
        metrics: dict[str, float] = {}
        if config.get("test_after_fit", True) and _has_test_data(self):
            results = self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=None, verbose=False)
            metrics = {k: float(v) for k, v in (results[0] if results else {}).items()}
        if self.trainer.is_global_zero:
            print(privacy_summary(self.trainer.strategy, config.get("privacy_delta"), metrics,
                                  allow_mismatch=bool(config.get("allow_mismatch"))))
            print("\n".join(where_to_look(self.trainer.loggers)))


def _lightning_cli_class() -> "type[LightningCLI]":
    """``DPLightningCLI``: the hooks above on top of ``LightningCLI`` (created once, on first use)."""
    cls = globals().get("DPLightningCLI")
    if cls is None:
        from lightning_dp._extras import require

        require("jsonargparse", "cli")  # LightningCLI's parser: the [cli] extra
        from pytorch_lightning.cli import LightningCLI

        cls = type("DPLightningCLI", (_DPLightningCLIHooks, LightningCLI),
                   {"__module__": __name__, "__doc__": _DPLightningCLIHooks.__doc__})
        globals()["DPLightningCLI"] = cls
    return cls


def __getattr__(name: str) -> Any:
    if name == "DPLightningCLI":
        return _lightning_cli_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _has_test_data(cli: LightningCLI) -> bool:
    from pytorch_lightning.utilities.model_helpers import is_overridden

    owner = cli.datamodule if cli.datamodule is not None else cli.model
    return owner is not None and is_overridden("test_dataloader", owner)


def _summary_delta(strategy: object, delta: Optional[float], allow_mismatch: bool) -> Any:
    """δ of the summary (:func:`lightning_dp.accounting.run_privacy.resolve_delta`), or ``None``
    while neither the strategy, ``--privacy_delta`` nor N gives one."""
    from lightning_dp.accounting.run_privacy import resolve_delta

    n = getattr(strategy, "num_samples", None)
    return resolve_delta(strategy, delta, allow_mismatch=allow_mismatch, num_samples=n,
                         who="lightning-dp fit", name="--privacy_delta", mark="--allow_mismatch=true")


def privacy_summary(
    strategy: object, delta: Optional[float] = None, metrics: Optional[dict[str, float]] = None,
    *, allow_mismatch: bool = False,
) -> str:
    """One human-readable block: test metrics, ε spent, and the mechanism's parameters.

    ε is the ledger's, by the run's accountant (``strategy.accountant``) at the run's δ
    (``strategy.target_delta``); the line names both and where δ came from. ``delta``
    (``--privacy_delta``) is for runs without ``target_delta`` (default then 1/N^1.1); a
    ``delta`` different from ``target_delta`` raises
    :class:`~lightning_dp.errors.PrivacyConfigurationError` unless ``allow_mismatch``
    (``--allow_mismatch=true``). See :mod:`lightning_dp.accounting.run_privacy`.
    """
    from lightning_dp.accounting import ledger_epsilon
    from lightning_dp.accounting.run_privacy import resolve_accountant
    from lightning_dp._strategy_glue import PrivateTraining

    lines = ["", "=== lightning_dp summary ==="]
    for name, value in sorted((metrics or {}).items()):
        shown = f"{100 * value:.2f} %" if name.endswith("acc") else f"{value:.4f}"
        lines.append(f"{name}: {shown}")
    if not isinstance(strategy, PrivateTraining):  # DPStrategy or DPShardedStrategy keep a ledger
        lines.append("Not trained with DPStrategy or DPShardedStrategy: no privacy guarantee.")
        return "\n".join(lines)
    ledger = strategy.ledger
    accountant = resolve_accountant(strategy).value
    chosen = _summary_delta(strategy, delta, allow_mismatch)
    if chosen is None:
        lines.append("privacy: ε not computed (no target_delta, N unknown): give --privacy_delta; "
                     f"{ledger.steps} steps")
    else:
        eps = ledger_epsilon(ledger, chosen.value, accountant) if ledger.steps else 0.0
        eps_text = "inf (a non-private variant was used)" if math.isinf(eps) else f"{eps:.4f}"
        unit = "" if getattr(ledger, "unit", "example") == "example" else f" per {ledger.unit}"
        lines.append(f"privacy: ε = {eps_text}{unit} at δ = {chosen.value:g} after {ledger.steps} steps "
                     f"({accountant} accountant: the strategy's; δ: {chosen.source})")
    counted = "users" if getattr(ledger, "unit", "example") == "user" else "examples"
    lines.append(
        f"mechanism: σ = {strategy.noise_multiplier:.4g}, C = {strategy.max_grad_norm:g}, "
        f"q = {strategy.sample_rate:.4g} (expected batch {strategy.expected_batch_size:g} of N = {strategy.num_samples}"
        + (f" {counted})" if counted == "users" else ")")
    )
    clipping = getattr(strategy, "clipping", None)
    if clipping is not None and type(clipping).__name__ != "FlatClipping":
        lines.append(f"clipping: {clipping.describe()}")
    return "\n".join(lines)


def where_to_look(loggers: list[Any]) -> list[str]:
    """The commands that show this run: TensorBoard on its log folder (the custom-scalars dashboard:
    ε against its target, σ, v̂ against Φ) and ``lightning-dp report`` for the v_t figure; nothing
    when the run has no TensorBoard logger."""
    from pytorch_lightning.loggers import TensorBoardLogger

    runs = [lg for lg in loggers if isinstance(lg, TensorBoardLogger)]
    if not runs:
        return []
    log_dir = runs[0].log_dir
    return ["", "where to look:",
            f"  tensorboard --logdir {runs[0].root_dir}     (tab CUSTOM SCALARS: ε vs target, σ, v̂ vs Φ)",
            f"  lightning-dp report {log_dir}     (v_t figure, histograms and Φ: {log_dir}/report.png)"]


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
        if command.startswith("-"):  # e.g. `lightning-dp --trainer.strategy.help lightning_dp.DPStrategy`
            print(f"lightning-dp: {command!r} is an option: put it after a subcommand, e.g.\n"
                  f"  lightning-dp fit {' '.join(argv)}\n\n{_usage()}", file=sys.stderr)
        else:
            print(f"lightning-dp: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    # Destroy the process group this run made (each rank, after its own fit/test: no collective is
    # left, and destroying a gloo group is local). Lightning does it at exit for NCCL only; a gloo
    # group still alive when Python finalizes aborts a few percent of 2-process CPU runs after the
    # summary ("terminate called without an active exception", exit 134): a gloo worker thread
    # dropping the last reference to a finished collective's tensors asks for the GIL, and a thread
    # asking for it during finalization is ended by a forced unwind through a noexcept destructor.
    missing = _missing_cli_extra()
    if missing is not None:  # one line with the install command, not an ImportError traceback
        print(f"lightning-dp {command}: {missing}", file=sys.stderr)
        return 1
    had_process_group = _process_group_initialized()
    from lightning_dp._warnings import quiet_lightning_adverts

    quiet_lightning_adverts()  # Lightning's "💡 Tip: try litlogger/litmodels" lines (see lightning_dp._warnings)
    # From the command line LightningCLI reads sys.argv itself (passing the same list again makes it warn
    # that both were given); from Python (tests, notebooks) the explicit list is passed.
    args = None if argv == sys.argv[1:] else argv
    _lightning_cli_class()(args=args, save_config_kwargs={"overwrite": True})
    if not had_process_group and _process_group_initialized():
        import torch.distributed

        torch.distributed.destroy_process_group()
    return 0


def _missing_cli_extra() -> Optional[str]:
    """Why LightningCLI cannot run here, as one line naming ``pip install "lightning_dp[cli]"``, or None: jsonargparse
    not importable, or installed without its ``signatures`` extra (which LightningCLI refuses)."""
    from lightning_dp._extras import require

    try:
        require("jsonargparse", "cli")
    except ImportError as err:
        return str(err)
    from pytorch_lightning import cli as lightning_cli
    if not getattr(lightning_cli, "_JSONARGPARSE_SIGNATURES_AVAILABLE", True):
        return ('jsonargparse[signatures] is needed here and is not installed: pip install "lightning_dp[cli]" '
                "(or the [all] extra, which `make demo` installs).")
    return None


def _process_group_initialized() -> bool:
    """Whether this process has a ``torch.distributed`` process group (``False`` without torch imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized()


if __name__ == "__main__":
    sys.exit(main())
