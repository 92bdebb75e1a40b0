"""`lightning-dp fit --config configs/digits.yaml`, shortened: the main job's path end to end."""

import sys
from pathlib import Path

import pytest

from lightning_dp.cli import main

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "digits.yaml"


def test_fit_prints_accuracy_and_epsilon(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", str(CONFIG), "--trainer.max_steps=3", "--trainer.logger=false",
            "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "test/acc:" in out
    line = next(l for l in out.splitlines() if l.startswith("privacy: ε = "))
    eps = float(line.split("=")[1].split()[0])
    assert 0 < eps <= 3.0  # σ was calibrated for the 3 planned steps at ε = 3
    assert "after 3 steps" in line


def test_unknown_command_and_help(capsys):
    assert main(["nope"]) == 2
    assert main(["--help"]) == 0
    assert "budget" in capsys.readouterr().out


def test_the_recipe_config_runs_with_public_pretraining_and_ema(tmp_path, capsys, monkeypatch, caplog):
    yaml = pytest.importorskip("yaml")
    monkeypatch.chdir(tmp_path)
    recipe = yaml.safe_load((CONFIG.parent / "digits_best.yaml").read_text())
    callbacks = [c["class_path"].rsplit(".", 1)[-1] for c in recipe["trainer"]["callbacks"]]
    assert callbacks == ["PublicPretraining", "EMAWeightAveraging"]
    pretraining = recipe["trainer"]["callbacks"][0]["init_args"]
    pretraining["dataset"]["init_args"]["size"], pretraining["epochs"] = 200, 1  # shortened
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump(recipe, allow_unicode=True))
    args = ["fit", "--config", str(config), "--trainer.max_steps=3", "--trainer.logger=false",
            "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false"]
    with caplog.at_level("INFO", logger="lightning_dp.callbacks.public_pretraining"):
        assert main(args) == 0
    out = capsys.readouterr().out
    assert "test/acc:" in out and "after 3 steps" in out
    assert "frozen after public pretraining: features (10250 parameters stay trainable)" in caplog.text


def test_fit_without_the_cli_extra_prints_one_line_with_the_pip_command(monkeypatch, capsys):
    """jsonargparse missing (simulated: its import fails): one line on stderr naming pip install "lightning_dp[cli]",
    exit status 1, no ImportError traceback."""
    monkeypatch.setitem(sys.modules, "jsonargparse", None)  # `import jsonargparse` raises ImportError
    assert main(["fit", "--config", "configs/digits.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lightning-dp fit: ") and "Traceback" not in err
    assert 'pip install "lightning_dp[cli]"' in err


def test_fit_with_jsonargparse_but_not_its_signatures_extra_names_the_same_command(monkeypatch, capsys):
    import pytorch_lightning.cli

    monkeypatch.setattr(pytorch_lightning.cli, "_JSONARGPARSE_SIGNATURES_AVAILABLE", False)
    assert main(["fit", "--config", "configs/digits.yaml"]) == 1
    assert 'jsonargparse[signatures] is needed here' in capsys.readouterr().err
