"""lightning-dp report: Table 1 as markdown and a Figure-2-like PNG, from the event files alone."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from conftest import TinyClassifier, make_loader, quiet_trainer
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_dp.callbacks import _monitor_tags as tags
from lightning_dp.callbacks.second_moment_monitor import SecondMomentMonitor
from lightning_dp.commands.report import main
from lightning_dp.optim import NotPrivateWarning
from lightning_dp.strategy import DPStrategy


class AdamModule(TinyClassifier):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _run(root, diagnostics: str = "private", monitor: bool = True) -> str:
    pl.seed_everything(0, verbose=False)
    logger = TensorBoardLogger(str(root), name="run")
    callbacks = [SecondMomentMonitor(every_n_steps=3, diagnostics=diagnostics)] if monitor else []
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=7, logger=logger, callbacks=callbacks)
    trainer.fit(AdamModule(), make_loader(n=100, batch_size=20))
    return logger.log_dir


@pytest.fixture(scope="module")
def private_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("private"))


@pytest.fixture(scope="module")
def non_private_run(tmp_path_factory):
    with pytest.warns(NotPrivateWarning):
        return _run(tmp_path_factory.mktemp("nonprivate"), diagnostics="non_private")


def _rows(out: str) -> dict[tuple[int, str], list[str]]:
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].isdigit():
            rows[(int(cells[0]), cells[1])] = cells[2:]
    return rows


def _logged(logdir: str, tag: str, step: int) -> float:
    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    return next(e.value for e in acc.Scalars(tag) if e.step == step)


def test_table_and_png_with_clean_series(non_private_run, tmp_path, capsys):
    out = tmp_path / "report.png"
    assert main([non_private_run, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "| step | series | min | Q1 | median | Q3 | max | mean |" in text
    rows = _rows(text)
    assert set(rows) == {(s, label) for s in (1, 6)
                         for label in ("clean v (NOT private)", "private v̂", "corrected v̂ − Φ")}
    for step in (1, 6):
        assert float(rows[(step, "private v̂")][2]) == pytest.approx(
            _logged(non_private_run, tags.stat_tag(tags.V, "all", "median"), step), rel=1e-3)
        assert float(rows[(step, "clean v (NOT private)")][5]) == pytest.approx(
            _logged(non_private_run, tags.stat_tag(tags.CLEAN_V, "all", "mean"), step), rel=1e-3)
    assert f"Φ = {(1 / 20) ** 2:.4g}" in text


def test_private_run_has_no_clean_rows_and_picks_steps(private_run, tmp_path, capsys):
    out = tmp_path / "r.png"
    assert main([str(private_run), "--out", str(out), "--early", "2", "--late", "4"]) == 0
    assert out.stat().st_size > 10_000
    rows = _rows(capsys.readouterr().out)
    assert {step for step, _ in rows} == {1, 3}  # nearest logged steps to 2 and 4 (logged: 1, 3, 6)
    assert not [label for _, label in rows if "clean" in label]


def test_parent_directory_is_searched(private_run, tmp_path, capsys):
    parent = str(private_run).rsplit("/", 1)[0]
    assert main([parent, "--out", str(tmp_path / "p.png")]) == 0


def test_no_event_files_is_a_clear_error(tmp_path, capsys):
    assert main([str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert "no TensorBoard event files" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_no_monitor_tags_is_a_clear_error(tmp_path, capsys):
    logdir = _run(tmp_path, monitor=False)
    assert main([logdir, "--out", str(tmp_path / "x.png")]) == 2
    assert "hold no SecondMomentMonitor tags" in capsys.readouterr().err


def test_without_a_path_the_latest_monitored_run_is_reported(private_run, non_private_run, tmp_path, monkeypatch,
                                                             capsys):
    import os
    import shutil

    root = tmp_path / "lightning_logs"
    shutil.copytree(non_private_run, root / "version_0")
    shutil.copytree(private_run, root / "version_1")
    (root / "version_2").mkdir()  # newest, but no monitor tags: skipped
    old = 1_000_000_000
    for f in (root / "version_0").iterdir():
        os.utime(f, (old, old))
    monkeypatch.chdir(tmp_path)
    assert main(["--out", "r.png"]) == 0
    out = capsys.readouterr().out
    assert "run: lightning_logs/version_1" in out
    assert not [label for _, label in _rows(out) if "clean" in label]  # the private run's table


def test_without_a_path_and_no_logs_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--out", "r.png"]) == 2
    assert "no lightning_logs/" in capsys.readouterr().err


def test_symlog_ticks_leave_the_region_around_zero_to_zero():
    from lightning_dp.commands.report import symlog_ticks

    values = [-0.08, -3e-6, 1e-7, 2e-5, 0.09]
    ticks = symlog_ticks(values, linthresh=1e-7)
    assert 0.0 in ticks and len(ticks) <= 7
    assert min(abs(t) for t in ticks if t) >= 1e-5  # nothing within 100× of the linear threshold
    assert max(ticks) == 0.1 and min(ticks) == -0.1


def test_without_out_the_figure_lands_in_the_runs_folder_and_its_path_is_printed(private_run, tmp_path, monkeypatch,
                                                                                  capsys):
    """Not in the working directory (issue 35): beside the run's event files, also when a parent folder is given."""
    import shutil
    from pathlib import Path

    root = tmp_path / "logs"
    shutil.copytree(private_run, root / "version_0")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main([str(root)]) == 0
    written = root / "version_0" / "report.png"
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(Path(".").iterdir()) == []
    assert capsys.readouterr().out.rstrip().endswith(f"figure written to {written}")
