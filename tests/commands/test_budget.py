"""lightning-dp budget against the reference vectors (tests/data/accountant_vectors.csv: dp-accounting 0.6.0 /
Opacus 1.6.0): the table, calibration, the N/B/E setting, the plot, bad input."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from lightning_dp.commands import budget
from lightning_dp.commands.budget import main

#: dp-accounting 0.6.0 / Opacus 1.6.0 values, kept in the repository (tests/data/accountant_vectors.md says how
#: they were computed and the tolerances); a missing file fails the collection, it never skips
REFERENCE = Path(__file__).resolve().parents[1] / "data" / "accountant_vectors.csv"
ROWS = list(csv.DictReader(REFERENCE.open()))
#: a reference row whose PLD and PRV take < 0.3 s each (q = 1, σ = 10, T = 100)
FAST_ROW = 6
#: reference rows as a Lightning user states them: (row, N, B, epochs) with B/N = q and epochs · round(N/B) = T
LIGHTNING_ROWS = [(4, 60_000, 2_400, 90), (7, 10_000, 100, 100), (9, 25_000, 100, 40), (6, 500, 500, 100)]


def _values(out: str) -> dict[str, float]:
    """``{accountant: value}`` of the table on stdout (the lines after its dashed separator)."""
    lines = out.strip().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("---")) + 1
    return {line.rsplit(None, 1)[0].strip(): float(line.rsplit(None, 1)[1]) for line in lines[start:]
            if not line.startswith("plot written")}


def _setting_args(row: dict[str, str]) -> list[str]:
    return ["-q", row["q"], "-T", row["steps"], "--delta", row["delta"]]


@pytest.mark.parametrize("i", range(len(ROWS)))
def test_rdp_table_matches_the_reference(i, capsys):
    row = ROWS[i]
    assert main(_setting_args(row) + ["--sigma", row["sigma"], "--accountants", "rdp", "integer_rdp", "--quiet"]) == 0
    values = _values(capsys.readouterr().out)
    for column in ("eps_opacus_rdp", "eps_dp_accounting_rdp"):
        assert values["rdp"] == pytest.approx(float(row[column]), rel=1e-3)
    assert values["integer_rdp"] > float(row["eps_opacus_rdp"]) * (1 - 1e-3)  # coarser grid: never tighter


def test_pld_and_prv_table_match_the_reference(capsys):
    row = ROWS[FAST_ROW]
    assert main(_setting_args(row) + ["--sigma", row["sigma"], "--accountants", "pld", "prv", "--quiet"]) == 0
    values = _values(capsys.readouterr().out)
    assert values["pld"] == pytest.approx(float(row["eps_dp_accounting_pld"]), abs=2e-3)
    assert values["prv"] == pytest.approx(float(row["eps_opacus_prv"]), abs=0.02)


@pytest.mark.parametrize("i", [0, 4, 8, 11])
def test_sigma_for_the_reference_epsilon_is_the_reference_sigma(i, capsys):
    row = ROWS[i]
    args = _setting_args(row) + ["--target-epsilon", row["eps_opacus_rdp"], "--accountants", "rdp", "--quiet"]
    assert main(args) == 0
    assert _values(capsys.readouterr().out)["rdp"] == pytest.approx(float(row["sigma"]), rel=2e-3)


@pytest.mark.parametrize(("i", "n", "b", "epochs"), LIGHTNING_ROWS)
def test_dataset_size_batch_size_epochs_derive_q_and_t(i, n, b, epochs, capsys):
    row = ROWS[i]
    args = ["-N", str(n), "-B", str(b), "-E", str(epochs), "--sigma", row["sigma"], "--delta", row["delta"],
            "--accountants", "rdp", "--quiet"]
    assert main(args) == 0
    out = capsys.readouterr().out
    derived = out.splitlines()[0]
    assert derived.startswith("setting: q = B/N") and f"= {row['steps']}" in derived
    assert f"q = {float(row['q']):g}, T = {row['steps']}," in out  # the table's header names the derived q and T
    assert _values(out)["rdp"] == pytest.approx(float(row["eps_opacus_rdp"]), rel=1e-3)


def test_steps_per_epoch_is_the_strategys():
    """T = E × round(N/B), by the function the strategy plans with (not 60000/256 = 234.375 per epoch)."""
    from lightning_dp.privacy.min_sep_sampling import min_sep_steps_per_epoch

    setting = budget.derive_setting(60_000, 256, 3, budget.build_parser())
    assert setting.sample_rate == 256 / 60_000
    assert setting.steps == 3 * min_sep_steps_per_epoch(256 / 60_000, 1) == 3 * 234


@pytest.mark.parametrize(("args", "message"), [
    (["-q", "0.01", "-T", "10", "-N", "100"], "not both"),
    (["-N", "100", "-B", "10"], "missing --epochs"),
    (["-q", "0.01"], "missing --steps"),
    (["-T", "10"], "missing --sample-rate"),
    ([], "give the setting"),
    (["-N", "10", "-B", "20", "-E", "1"], "exceeds --dataset-size"),
    (["-N", "0", "-B", "20", "-E", "1"], "--dataset-size must be a positive integer"),
    (["-q", "0.01", "-T", "10", "--accountants", "nope"], "unknown 'nope'"),
])
def test_setting_errors_name_the_fix(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args + ["--sigma", "1", "--delta", "1e-5"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_value_exits_2(capsys):
    assert main(["-q", "1.5", "--sigma", "1", "-T", "10", "--delta", "1e-5", "--accountants", "rdp"]) == 2
    assert "sample_rate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["-q", "0.1", "-T", "10", "--delta", "1e-5"])  # neither σ nor target


def test_sign_sgd_rows_show_the_papers_2c_sensitivity(capsys):
    """The paper's σ protects only σ/2 (2C sensitivity): its true ε at σ = 2·σ_ref is the integer-grid
    ε at σ_ref, above the reference RDP ε; calibrated, its corrected σ is twice its published one."""
    row = ROWS[4]
    args = _setting_args(row) + ["--sigma", str(2 * float(row["sigma"])), "--accountants", "rdp", "--sign-sgd",
                                 "--quiet"]
    assert main(args) == 0
    values = _values(capsys.readouterr().out)
    true_eps = values["sign_sgd_paper (true ε of its σ: 2C sensitivity)"]
    assert true_eps > float(row["eps_opacus_rdp"]) * (1 - 1e-3)
    assert values["rdp"] < true_eps
    args = _setting_args(row) + ["--target-epsilon", f"{true_eps:.4f}", "--accountants", "integer_rdp", "--sign-sgd",
                                 "--quiet"]
    assert main(args) == 0
    values = _values(capsys.readouterr().out)
    published = values["sign_sgd_paper as published (integer grid, C)"]
    assert published == pytest.approx(float(row["sigma"]), rel=2e-3) == values["integer_rdp"]
    assert values["sign_sgd_paper corrected (integer grid, 2C)"] == pytest.approx(2 * published, abs=2e-4)


def test_progress_goes_to_stderr_unless_quiet(capsys):
    args = ["-q", "0.01", "--target-epsilon", "2", "-T", "500", "--delta", "1e-5", "--accountants", "rdp", "integer_rdp"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "σ by rdp …" in captured.err and "σ by integer_rdp …" in captured.err and " s\n" in captured.err
    assert "…" not in captured.out  # the table on stdout stays parseable
    assert main(args + ["--quiet"]) == 0
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- plot
def _args(argv: list[str]):
    return budget.build_parser().parse_args(argv)


def test_plot_draws_every_accountant_and_the_sign_sgd_rows_smooth(tmp_path, capsys):
    out = tmp_path / "eps.png"
    row = ROWS[7]
    assert main(_setting_args(row) + ["--sigma", row["sigma"], "--accountants", "rdp", "integer_rdp", "--sign-sgd",
                                      "--plot", str(out), "--quiet"]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    args = _args(_setting_args(row) + ["--sigma", row["sigma"], "--accountants", "rdp", "integer_rdp", "--sign-sgd"])
    curves = budget.plot_curves(args, budget.Setting(float(row["q"]), int(row["steps"])), float(row["sigma"]))
    assert [c.label for c in curves][:2] == ["rdp", "integer_rdp"] and "sign_sgd_paper" in curves[2].label
    assert len({(c.style["color"], str(c.style["linestyle"]), c.style["marker"]) for c in curves}) == len(curves)
    for c in curves:
        assert len(c.steps) >= 300 and c.steps[0] == 1 and c.steps[-1] == int(row["steps"])
        assert all(b >= a for a, b in zip(c.epsilons, c.epsilons[1:]))  # ε(t) grows with t
    assert curves[0].epsilons[-1] == pytest.approx(float(row["eps_opacus_rdp"]), rel=1e-3)  # ends at the reference


def test_plot_for_a_target_draws_published_and_corrected_sign_sgd(capsys):
    argv = ["-q", "0.01", "-T", "300", "--delta", "1e-5", "--target-epsilon", "2", "--accountants", "rdp", "--sign-sgd"]
    curves = budget.plot_curves(_args(argv), budget.Setting(0.01, 300), sigma=1.0)
    labels = [c.label for c in curves]
    assert labels[0] == "rdp" and "as published" in labels[1] and "corrected" in labels[2]
    assert curves[2].epsilons[-1] == pytest.approx(2.0, abs=0.01)  # corrected σ reaches the target at T
    assert curves[1].epsilons[-1] > 2.5  # the published σ spends more than it claims


def test_every_default_accountant_looks_different():
    """PLD and PRV agree to ~0.01: they must differ in colour, line style and marker, not only colour."""
    styles = [budget.accountant_style(n, i) for i, n in enumerate(budget.DEFAULT_ACCOUNTANTS)]
    styles += list(budget.SIGN_SGD_STYLES)
    for key in ("color", "marker"):
        assert len({str(s[key]) for s in styles}) == len(styles)
    pld, prv = budget.accountant_style("pld", 0), budget.accountant_style("prv", 1)
    assert pld["linestyle"] != prv["linestyle"] and prv.get("zorder", 2) > pld.get("zorder", 2)


def test_expensive_accountants_are_interpolated_monotonically(monkeypatch):
    """PLD/PRV are evaluated at a few steps (the markers) and joined by a monotone cubic on the dense grid."""
    import numpy as np

    import lightning_dp.accounting as accounting

    calls = []

    def fake_epsilon(sigma, q, t, delta, accountant):
        calls.append(t)
        return float(np.sqrt(t))

    monkeypatch.setattr(accounting, "epsilon", fake_epsilon)
    curve = budget.epsilon_curve("pld", 1.0, 0.01, 1000, 1e-5, "pld", {}, quiet=True)
    assert len(calls) <= budget.EXPENSIVE_POINTS and 1 in calls and 1000 in calls
    assert len(curve.steps) >= 300
    assert np.all(np.diff(curve.epsilons) >= 0)
    assert np.allclose(curve.epsilons, np.sqrt(curve.steps), rtol=0.02)  # smooth, close to the true curve
