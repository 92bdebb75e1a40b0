"""lightning-dp budget: the table, calibration, the plot, bad input."""

from __future__ import annotations

import pytest

from lightning_dp.accounting import calibrate_noise, epsilon
from lightning_dp.commands.budget import main


def _values(out: str) -> dict[str, float]:
    rows = [line.split() for line in out.strip().splitlines()[3:]]
    return {name: float(value) for name, value in rows}


def test_epsilon_table(capsys):
    assert main(["--sample-rate", "0.01", "--noise-multiplier", "2", "--steps", "100", "--delta", "1e-5",
                 "--accountants", "rdp", "integer_rdp", "prv"]) == 0
    values = _values(capsys.readouterr().out)
    assert values["rdp"] == pytest.approx(epsilon(2.0, 0.01, 100, 1e-5), abs=1e-4)
    assert values["integer_rdp"] > values["rdp"] > values["prv"]


def test_sigma_for_target(capsys):
    assert main(["-q", "0.01", "--target-epsilon", "2", "-T", "500", "--delta", "1e-5",
                 "--accountants", "rdp", "integer_rdp"]) == 0
    values = _values(capsys.readouterr().out)
    assert values["rdp"] == pytest.approx(calibrate_noise(2.0, 1e-5, 0.01, 500), abs=1e-4)
    assert values["integer_rdp"] > values["rdp"]


def test_plot(tmp_path, capsys):
    out = tmp_path / "eps.png"
    assert main(["-q", "0.01", "--sigma", "1", "-T", "200", "--delta", "1e-5", "--accountants", "rdp",
                 "--plot", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_bad_input_exits_2(capsys):
    assert main(["-q", "1.5", "--sigma", "1", "-T", "10", "--delta", "1e-5", "--accountants", "rdp"]) == 2
    assert "sample_rate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["-q", "0.1", "-T", "10", "--delta", "1e-5"])  # neither σ nor target


def test_sign_sgd_rows_show_the_papers_2c_sensitivity(capsys):
    from lightning_dp.accounting import calibrate_noise, epsilon
    from lightning_dp.commands.budget import main

    assert main(["-q", "0.2", "-T", "100", "--delta", "1e-3", "--target-epsilon", "2", "--accountants", "rdp", "--sign-sgd"]) == 0
    out = capsys.readouterr().out
    grid = calibrate_noise(2.0, 1e-3, 0.2, 100, "integer_rdp")
    assert f"{grid:.4f}" in out and f"{2 * grid:.4f}" in out
    assert main(["-q", "0.2", "-T", "100", "--delta", "1e-3", "--sigma", "3", "--accountants", "rdp", "--sign-sgd"]) == 0
    out = capsys.readouterr().out
    assert f"{epsilon(1.5, 0.2, 100, 1e-3, 'integer_rdp'):.4f}" in out


def test_progress_goes_to_stderr_unless_quiet(capsys):
    args = ["-q", "0.01", "--target-epsilon", "2", "-T", "500", "--delta", "1e-5", "--accountants", "rdp", "integer_rdp"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "σ by rdp …" in captured.err and "σ by integer_rdp …" in captured.err and " s\n" in captured.err
    assert "…" not in captured.out  # the table on stdout stays parseable
    assert main(args + ["--quiet"]) == 0
    assert capsys.readouterr().err == ""
