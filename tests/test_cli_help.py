"""The `lightning-dp` command's help: every strategy and callback argument described, a light
`--help` (no torch/Lightning imported), and our log format kept when Opacus is imported."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dp.cli import main

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "pytorch_lightning", "lightning", "numpy", "scipy", "opacus", "matplotlib", "tensorboard")


def _option_help(help_text: str, option: str) -> str:
    """The help text argparse prints for ``option`` (its lines after the option's own line)."""
    lines = help_text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"  {option} "):
            signature_and_help = re.split(r"\s{2,}", line[len(option) + 2:].strip(), maxsplit=1)
            parts = signature_and_help[1:]  # help on the option's own line, when argparse put it there
            for following in lines[i + 1:]:
                if not following.startswith(" " * 8) or following.lstrip().startswith("-"):
                    break
                parts.append(following.strip())
            return " ".join(p for p in parts if p)
    raise AssertionError(f"{option} not in the help output")


def _description(help_text: str, option: str) -> str:
    """The option's description: its help without jsonargparse's ``(type: ..., default: ...)``."""
    return _option_help(help_text, option).split("(type:")[0].strip()


def _init_arguments(cls: type) -> list[str]:
    return [p.name for p in inspect.signature(cls.__init__).parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _class_help(capsys: pytest.CaptureFixture[str], key: str, class_path: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", f"--trainer.{key}.help", class_path])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_strategy_help_describes_every_argument(capsys):
    from lightning_dp import DPStrategy

    out = _class_help(capsys, "strategy", "lightning_dp.DPStrategy")
    missing = [n for n in _init_arguments(DPStrategy) if not _description(out, f"--trainer.strategy.{n}")]
    assert not missing, f"DPStrategy arguments without a description in --help: {missing}"
    assert "per-example clipping norm" in _description(out, "--trainer.strategy.max_grad_norm")
    assert "σ" in _description(out, "--trainer.strategy.noise_multiplier")


@pytest.mark.parametrize("name", ["PrivacyBudget", "SecondMomentMonitor", "AdamVariant"])
def test_callback_help_describes_every_argument(capsys, name):
    import lightning_dp

    out = _class_help(capsys, "callbacks", f"lightning_dp.{name}")
    cls = getattr(lightning_dp, name)
    missing = [n for n in _init_arguments(cls) if not _description(out, f"--trainer.callbacks.{n}")]
    assert not missing, f"{name} arguments without a description in --help: {missing}"


def test_command_modules_import_neither_torch_nor_lightning():
    """`lightning-dp --help` and the tools' `--help` stay fast: nothing heavy is imported with them."""
    code = (
        "import sys\n"
        "import lightning_dp.cli, lightning_dp.commands.budget, lightning_dp.commands.audit, lightning_dp.commands.report\n"
        "for name in ('budget', 'audit', 'report'):\n"
        "    getattr(lightning_dp.commands, name).build_parser().format_help()\n"
        "lightning_dp.cli._usage()\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"


def test_audit_command_kinds_are_the_runners():
    from lightning_dp.audit.runner import KINDS
    from lightning_dp.commands import audit

    assert audit.KINDS == KINDS


def test_log_format_survives_importing_opacus():
    """Opacus' ``logging.basicConfig`` on import must not give the root logger its timestamp format."""
    code = (
        "import logging\n"
        "from lightning_dp.accounting import epsilon\n"
        "epsilon(1.0, 0.01, 10, 1e-5, 'prv')  # imports Opacus\n"
        "from lightning_dp.grad_sample.opacus_hooks import _grad_sample_hooks\n"
        "_grad_sample_hooks()\n"
        "import sys; assert 'opacus.utils.module_utils' in sys.modules\n"
        "assert not logging.getLogger().handlers, logging.getLogger().handlers\n"
        "from pytorch_lightning.utilities.rank_zero import rank_zero_info\n"
        "rank_zero_info('lightning line')\n"
        "logging.getLogger('lightning_dp.test').warning('our warning')\n"
    )
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stderr
    lines = err.splitlines()
    assert "lightning line" in lines and "our warning" in lines, err


def test_import_opacus_keeps_a_configured_root_logger():
    """A root logger the user configured is theirs: the guard neither adds nor removes handlers."""
    code = (
        "import logging\n"
        "logging.basicConfig(format='USER %(message)s')\n"
        "handlers = list(logging.getLogger().handlers)\n"
        "from lightning_dp._opacus import import_opacus\n"
        "import_opacus('opacus.accountants')\n"
        "assert logging.getLogger().handlers == handlers\n"
        "logging.getLogger('x').warning('kept')\n"
    )
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stderr
    assert "USER kept" in err.splitlines()


def test_opacus_is_imported_only_through_the_guard():
    """Every run-time Opacus import in lightning_dp goes through :func:`lightning_dp._opacus.import_opacus`."""
    offenders = []
    for path in sorted((ROOT / "lightning_dp").rglob("*.py")):
        if path.name == "_opacus.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        type_checking = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                         and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in type_checking:
                continue
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "opacus" or n.startswith("opacus.") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"import Opacus with lightning_dp._opacus.import_opacus (keeps the log format): {offenders}"


def test_an_option_before_the_subcommand_names_the_fix(capsys):
    assert main(["--trainer.strategy.help", "lightning_dp.DPStrategy"]) == 2
    assert "lightning-dp fit --trainer.strategy.help lightning_dp.DPStrategy" in capsys.readouterr().err
