"""SecondMomentMonitor: logged values read back with tensorboard's reader, checked against the optimizer state."""

from __future__ import annotations

import csv
import math
from types import SimpleNamespace
from unittest import mock

import pytest
import pytorch_lightning as pl
import torch
from conftest import TinyClassifier, make_loader, quiet_trainer
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_dp.callbacks._vstats import Summary
from lightning_dp.callbacks.adam_variant import AdamVariant
from lightning_dp.callbacks.second_moment_monitor import SecondMomentMonitor
from lightning_dp.optim import NotPrivateWarning
from lightning_dp.strategy import DPStrategy

BETAS = (0.8, 0.99)
LRS = (0.01, 0.003)


class AdamModule(TinyClassifier):
    """The user's module: plain torch.optim.Adam (or Adagrad) with two param groups."""

    def __init__(self, kind: str = "adam") -> None:
        super().__init__()
        self.kind = kind

    def configure_optimizers(self):
        groups = [{"params": self.net[0].parameters(), "lr": LRS[0]},
                  {"params": self.net[2].parameters(), "lr": LRS[1]}]
        if self.kind == "adagrad":
            return torch.optim.Adagrad(groups)
        return torch.optim.Adam(groups, betas=BETAS)


class Capture(Callback):
    """Copies, per optimizer step t, the parameters before/after and the optimizer state."""

    def __init__(self) -> None:
        self.before: list[torch.Tensor] = []
        self.at: dict[int, dict] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = trainer.optimizers[0]
        groups = []
        for gi, group in enumerate(opt.param_groups):
            entries = []
            for p in group["params"]:
                state = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
                idx = [i for i, q in enumerate(pl_module.parameters()) if q is p][0]
                entries.append((state, (self.before[idx] - p.detach()) / group["lr"]))
            groups.append(entries)
        diag = getattr(trainer.strategy, "non_private_diagnostics", None)
        self.at[trainer.global_step] = {"groups": groups, "release": trainer.strategy.last_release, "diag": diag}


def _fit(tmp_path, monitor, *, kind="adam", sigma=1.0, steps=7, extra=(), logger="tb"):
    pl.seed_everything(0, verbose=False)
    capture = Capture()
    log = (TensorBoardLogger(str(tmp_path), name="run") if logger == "tb" else CSVLogger(str(tmp_path), name="run"))
    strategy = (DPStrategy(noise_multiplier=sigma, max_grad_norm=1.0, public_state=["Capture"])  # the test's observer
                if sigma is not None else "auto")
    trainer = quiet_trainer(strategy=strategy, max_steps=steps, logger=log,
                            callbacks=[*extra, monitor, capture])
    trainer.fit(AdamModule(kind), make_loader(n=100, batch_size=20))
    return trainer, capture


def _events(trainer) -> EventAccumulator:
    acc = EventAccumulator(trainer.logger.log_dir, size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def _scalar(acc, tag) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def _v_hat(state) -> torch.Tensor:
    t = int(state["step"])
    return state["exp_avg_sq"] / (1 - BETAS[1] ** t)


def _cat(captured, fn, group=None) -> torch.Tensor:
    groups = captured["groups"] if group is None else [captured["groups"][group]]
    return torch.cat([fn(state, delta).reshape(-1) for entries in groups for state, delta in entries])


def _check_stats(acc, tag_prefix, step, values, abs_tol=1e-9):
    """Logged min/q1/median/q3/max/mean of ``values`` at ``step``."""
    expected = {"min": values.min(), "max": values.max(), "mean": values.double().mean(),
                **dict(zip(("q1", "median", "q3"), torch.quantile(values, torch.tensor([0.25, 0.5, 0.75]))))}
    for stat, value in expected.items():
        logged = _scalar(acc, f"{tag_prefix}/{stat}")[step]
        assert logged == pytest.approx(float(value), rel=1e-4, abs=abs_tol), (tag_prefix, stat, step)


def test_logged_v_phi_and_update_match_adam_state(tmp_path):
    trainer, capture = _fit(tmp_path, SecondMomentMonitor(every_n_steps=3))
    acc = _events(trainer)
    steps = sorted(_scalar(acc, "vt/v/all/median"))
    assert steps == [1, 3, 6]
    phi = (1.0 * 1.0 / trainer.strategy.expected_batch_size) ** 2
    for step in steps:
        at = capture.at[step]
        v = _cat(at, lambda s, d: _v_hat(s))
        _check_stats(acc, "vt/v/all", step, v)
        _check_stats(acc, "vt/v/group1", step, _cat(at, lambda s, d: _v_hat(s), group=1))
        _check_stats(acc, "vt/v_minus_phi/all", step, v - phi)
        assert _scalar(acc, "vt/phi")[step] == pytest.approx(phi, rel=1e-6)
        assert _scalar(acc, "vt/frac_negative")[step] == pytest.approx(float((v - phi < 0).float().mean()))
        # the update actually applied, recovered from the parameter change / lr
        _check_stats(acc, "vt/update/all", step, _cat(at, lambda s, d: d), abs_tol=2e-3)
    hist = acc.Histograms("vt/hist/v")[-1]
    v_last = _cat(capture.at[6], lambda s, d: _v_hat(s))
    assert hist.step == 6 and hist.histogram_value.num == v_last.numel()
    assert hist.histogram_value.bucket[0] == 0  # TensorBoard's empty left sentinel
    assert sum(hist.histogram_value.bucket) == v_last.numel()
    assert hist.histogram_value.bucket_limit[0] == pytest.approx(float(v_last.min()), rel=1e-5)
    assert hist.histogram_value.max == pytest.approx(float(v_last.max()), rel=1e-5)
    assert {"vt/hist/m", "vt/hist/v", "vt/hist/v_minus_phi", "vt/hist/update"} <= set(acc.Tags()["histograms"])


def test_bias_corrected_phi_negative_fraction_and_update(tmp_path):
    """With DP-AdamBC the monitor must use Φ̄ and the variant's divisor sqrt(max(v̂ − Φ̄, γ'))."""
    trainer, capture = _fit(tmp_path, SecondMomentMonitor(every_n_steps=3), extra=[AdamVariant("bias_corrected")])
    acc = _events(trainer)
    phi = (1.0 / trainer.strategy.expected_batch_size) ** 2
    at = capture.at[6]
    v = _cat(at, lambda s, d: _v_hat(s))
    phi_bar = _cat(at, lambda s, d: (s["phi"] / (1 - BETAS[1] ** int(s["step"]))).expand_as(s["exp_avg"]))
    assert _scalar(acc, "vt/phi")[6] == pytest.approx(phi, rel=1e-6)
    frac = float((v - phi_bar < 0).float().mean())
    assert 0 < frac < 1
    assert _scalar(acc, "vt/frac_negative")[6] == pytest.approx(frac)
    applied = _cat(at, lambda s, d: d)
    _check_stats(acc, "vt/update/all", 6, applied, abs_tol=1e-2)
    m_hat = _cat(at, lambda s, d: s["exp_avg"] / (1 - BETAS[0] ** int(s["step"])))
    plain = m_hat / (v.sqrt() + 1e-8)  # what a monitor ignoring the variant would report
    assert not torch.allclose(plain.abs().max(), applied.abs().max(), rtol=0.1)


def test_nothing_non_private_unless_opted_in(tmp_path):
    trainer, _ = _fit(tmp_path, SecondMomentMonitor(every_n_steps=2))
    acc = _events(trainer)
    written = acc.Tags()["scalars"] + acc.Tags()["histograms"]
    assert "vt/v/all/median" in written
    assert not [t for t in written if t.startswith("nonprivate")]
    assert trainer.strategy.non_private_diagnostics is None


def test_non_private_opt_in_matches_own_ema_of_clean_mean(tmp_path):
    with pytest.warns(NotPrivateWarning, match="NOT covered by the differential-privacy guarantee"):
        trainer, capture = _fit(tmp_path, SecondMomentMonitor(every_n_steps=3, diagnostics="non_private"))
    acc = _events(trainer)
    params = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
    m = {p: torch.zeros_like(p) for p in params}
    v = {p: torch.zeros_like(p) for p in params}
    for step in range(1, 7):
        diag = capture.at[step]["diag"]
        for p in params:
            g = diag.clean_mean[p]
            m[p] = BETAS[0] * m[p] + (1 - BETAS[0]) * g
            v[p] = BETAS[1] * v[p] + (1 - BETAS[1]) * g * g
        if step in (1, 3, 6):
            v_c = torch.cat([(v[p] / (1 - BETAS[1] ** step)).reshape(-1) for p in params])
            _check_stats(acc, "nonprivate/vt/v/all", step, v_c, abs_tol=1e-12)
            assert _scalar(acc, "nonprivate/clip_fraction")[step] == pytest.approx(diag.clip_fraction)
            assert _scalar(acc, "nonprivate/mean_norm_over_c")[step] == pytest.approx(diag.clean_mean_norm_over_c)
            assert _scalar(acc, "nonprivate/grad_norm/median")[step] == pytest.approx(
                float(torch.quantile(diag.norms, 0.5)), rel=1e-5)
    assert {"nonprivate/vt/hist/m", "nonprivate/vt/hist/v", "nonprivate/vt/hist/update"} <= set(acc.Tags()["histograms"])


def test_clean_and_private_v_agree_when_the_noise_vanishes(tmp_path):
    """σ → 0: private v̂ must equal the clean v^c (an independent check of the clean EMA's betas)."""
    with pytest.warns(NotPrivateWarning):
        trainer, _ = _fit(tmp_path, SecondMomentMonitor(every_n_steps=3, diagnostics="non_private"), sigma=1e-6)
    acc = _events(trainer)
    for stat in ("q1", "median", "max", "mean"):
        clean, private = _scalar(acc, f"nonprivate/vt/v/all/{stat}"), _scalar(acc, f"vt/v/all/{stat}")
        for step in (1, 3, 6):
            assert clean[step] == pytest.approx(private[step], rel=1e-3)


def test_non_private_requires_dp_strategy(tmp_path):
    with pytest.raises(ValueError, match="DPStrategy"):
        _fit(tmp_path, SecondMomentMonitor(diagnostics="non_private"), sigma=None)


def test_csv_logger_gets_the_scalars(tmp_path):
    trainer, capture = _fit(tmp_path, SecondMomentMonitor(every_n_steps=4), logger="csv")
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("vt/v/all/median")]
    assert [int(r["step"]) for r in rows] == [1, 4]
    v = _cat(capture.at[4], lambda s, d: _v_hat(s))
    assert float(rows[1]["vt/v/all/median"]) == pytest.approx(float(torch.quantile(v, 0.5)), rel=1e-4)


def test_adagrad_sum_is_monitored(tmp_path):
    trainer, capture = _fit(tmp_path, SecondMomentMonitor(every_n_steps=5), kind="adagrad", steps=5)
    acc = _events(trainer)
    _check_stats(acc, "vt/v/all", 5, _cat(capture.at[5], lambda s, d: s["sum"]))
    phi = (1.0 / trainer.strategy.expected_batch_size) ** 2
    corrected = _cat(capture.at[5], lambda s, d: s["sum"] - 5 * phi)  # AdaGrad: Σ_s Φ_s = tΦ
    _check_stats(acc, "vt/v_minus_phi/all", 5, corrected)


def test_subsample_keeps_exact_extremes(tmp_path):
    trainer, capture = _fit(tmp_path, SecondMomentMonitor(every_n_steps=3, max_coordinates=20), steps=3)
    acc = _events(trainer)
    v = _cat(capture.at[3], lambda s, d: _v_hat(s))
    assert v.numel() > 40
    assert _scalar(acc, "vt/v/all/max")[3] == pytest.approx(float(v.max()), rel=1e-6)
    assert _scalar(acc, "vt/v/all/mean")[3] == pytest.approx(float(v.double().mean()), rel=1e-5)
    assert acc.Histograms("vt/hist/v")[-1].histogram_value.num < 30


def test_only_rank_zero_writes():
    monitor = SecondMomentMonitor(every_n_steps=1)
    logger = mock.Mock()
    trainer = SimpleNamespace(is_global_zero=False, global_step=1, loggers=[logger], optimizers=[],
                              strategy=SimpleNamespace())
    monitor.on_train_batch_end(trainer, None, None, None, 0)
    logger.log_metrics.assert_not_called()
    trainer.is_global_zero = True
    monitor.on_train_batch_end(trainer, None, None, None, 0)
    logger.log_metrics.assert_called_once()


@pytest.mark.parametrize("kwargs", [{"every_n_steps": 0}, {"every_n_steps": 1.5}, {"diagnostics": "clean"},
                                    {"max_coordinates": 0}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        SecondMomentMonitor(**kwargs)


def test_summary_ignores_non_finite_values():
    s = Summary()
    x = torch.tensor([1.0, -2.0, math.inf, 3.0, math.nan])
    s.add(x, x)
    stats = s.stats()
    assert (stats["min"], stats["max"], stats["median"]) == (-2.0, 3.0, 1.0)
    assert s.nonfinite == 2 and s.frac_negative == pytest.approx(1 / 3)


@pytest.mark.parametrize("lo,hi", [(1e-8, 1e-2), (-1e-3, 1e-2), (0.0, 5.0), (0.5, 2.0), (-3.0, -1e-6), (1.0, 1.0)])
def test_histogram_edges_cover_the_data_and_resolve_decades(lo, hi):
    from lightning_dp.callbacks._hist_bins import histogram_edges

    edges = histogram_edges(lo, hi, bins=64)
    assert (edges[1:] > edges[:-1]).all() and edges[0] <= lo and edges[-1] >= hi and len(edges) <= 65
    if lo > 0 and hi / lo > 100:  # every decade gets buckets, not just the top one
        assert int((edges < 10 * lo).sum()) >= 5


def test_clean_emas_continue_after_resume(tmp_path):
    """σ → 0 again: after a resume the private v̂ continues from Adam's restored state, so the
    clean v^c only agrees with it if the clean EMAs (and their step count) were restored too."""
    with pytest.warns(NotPrivateWarning):
        first, _ = _fit(tmp_path / "a", SecondMomentMonitor(every_n_steps=2, diagnostics="non_private"),
                        sigma=1e-6, steps=4)
    ckpt = tmp_path / "mid.ckpt"
    first.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    (state,) = [v for k, v in saved.items() if "SecondMomentMonitor" in k]
    assert state["clean"]["steps"] == 4 and set(state["clean"]["v"]) == {n for n, _ in first.lightning_module.named_parameters()}
    pl.seed_everything(1, verbose=False)
    monitor = SecondMomentMonitor(every_n_steps=2, diagnostics="non_private")
    log = TensorBoardLogger(str(tmp_path / "b"), name="run")
    with pytest.warns(NotPrivateWarning):
        trainer = quiet_trainer(strategy=DPStrategy(noise_multiplier=1e-6, max_grad_norm=1.0), max_steps=8,
                                logger=log, callbacks=[monitor])
        trainer.fit(AdamModule(), make_loader(n=100, batch_size=20), ckpt_path=ckpt)
    assert monitor.state_dict()["clean"]["steps"] == 8
    acc = _events(trainer)
    clean, private = _scalar(acc, "nonprivate/vt/v/all/median"), _scalar(acc, "vt/v/all/median")
    for step in (6, 8):
        assert clean[step] == pytest.approx(private[step], rel=1e-3)
