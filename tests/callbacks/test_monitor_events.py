"""SecondMomentMonitor read back through TensorBoard's own reader; `lightning-dp report`."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
from conftest import TinyClassifier, make_loader, quiet_trainer
from pytorch_lightning.callbacks import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_dp import DPStrategy
from lightning_dp.callbacks.second_moment_monitor import SecondMomentMonitor


class AdamModule(TinyClassifier):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2, betas=(0.9, 0.99))


class CaptureV(Callback):
    """Bias-corrected v̂ and Φ after each step, straight from the optimizer state."""

    def __init__(self):
        self.v_hat, self.phi = {}, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = trainer.optimizers[0]
        beta2 = opt.param_groups[0]["betas"][1]
        parts = []
        for p in pl_module.parameters():
            state = opt.state[p]
            parts.append((state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))).flatten())
        self.v_hat[trainer.global_step] = torch.cat(parts)
        self.phi[trainer.global_step] = trainer.strategy.last_release.noise_std**2


def _fit(tmp_path, diagnostics):
    logger = pl.loggers.TensorBoardLogger(str(tmp_path), name="run")
    capture = CaptureV()
    monitor = SecondMomentMonitor(every_n_steps=2, diagnostics=diagnostics)
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0, public_state=["CaptureV"]), max_steps=4,
                            logger=logger, callbacks=[capture, monitor])
    trainer.fit(AdamModule(), make_loader())
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    return events, capture, logger.log_dir


def test_logged_statistics_match_the_optimizer_state(tmp_path):
    events, capture, _ = _fit(tmp_path, "private")
    scalars = set(events.Tags()["scalars"])
    assert {"vt/v/all/median", "vt/v/all/q1", "vt/phi", "vt/frac_negative", "vt/update/all/median"} <= scalars
    assert {"vt/hist/v", "vt/hist/m", "vt/hist/v_minus_phi", "vt/hist/update"} <= set(events.Tags()["histograms"])
    logged = {e.step: e.value for e in events.Scalars("vt/v/all/median")}
    assert set(logged) >= {2, 4}
    for step in (2, 4):
        v = capture.v_hat[step]
        assert logged[step] == pytest.approx(float(torch.quantile(v, 0.5)), rel=1e-4)
        frac = {e.step: e.value for e in events.Scalars("vt/frac_negative")}[step]
        assert frac == pytest.approx(float((v - capture.phi[step] < 0).float().mean()), abs=1e-6)
        phi = {e.step: e.value for e in events.Scalars("vt/phi")}[step]
        assert phi == pytest.approx(capture.phi[step], rel=1e-5)


def test_nothing_non_private_is_written_unless_opted_in(tmp_path):
    events, _, _ = _fit(tmp_path / "private", "private")
    tags = events.Tags()["scalars"] + events.Tags()["histograms"]
    assert not [t for t in tags if t.startswith("nonprivate/")]
    with pytest.warns(UserWarning, match="NOT covered"):
        events, _, _ = _fit(tmp_path / "opted", "non_private")
    assert "nonprivate/clip_fraction" in events.Tags()["scalars"]


def test_report_renders_table_and_figure(tmp_path, capsys):
    from lightning_dp.commands.report import main

    with pytest.warns(UserWarning):
        _, _, log_dir = _fit(tmp_path, "non_private")
    out = tmp_path / "report.png"
    assert main([log_dir, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| step | series |" in text and "clean v (NOT private)" in text
    assert out.stat().st_size > 10_000
    assert main([str(tmp_path / "nothing-here"), "--out", str(out)]) != 0


def test_csv_logger_gets_the_scalars(tmp_path):
    import csv

    logger = pl.loggers.CSVLogger(str(tmp_path), name="csv")
    trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1.0), max_steps=2, logger=logger,
                            callbacks=[SecondMomentMonitor(every_n_steps=1)])
    trainer.fit(AdamModule(), make_loader())
    rows = list(csv.DictReader(open(f"{logger.log_dir}/metrics.csv")))
    assert any(r.get("vt/v/all/median") for r in rows)
    assert not any(k.startswith("nonprivate/") for k in rows[0])
