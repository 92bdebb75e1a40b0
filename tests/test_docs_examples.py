"""The paste-able examples of the new public names in docs/ run as written (the frozen configuration, the ε
ceiling, the performance options, the README's plain loop)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = [("docs/accounting.md", "EpsilonCeiling"), ("docs/architecture.md", "PrivateStep.from_config"),
            ("docs/performance.md", "fixed_batch_size="), ("README.md", "step.calibrate("),
            ("docs/release_boundary.md", "warn_or_refuse("), ("docs/getting_started.md", "PrivateStandardizer(")]


@pytest.mark.parametrize("page, name", EXAMPLES)
def test_the_example_runs(page, name, capsys):
    blocks = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S) if name in b]
    assert blocks, f"{page} has no example using {name}"
    exec(compile(textwrap.dedent(blocks[0]), page, "exec"), {})
    if name == "step.calibrate(":  # the loop prints the ε it spent (a ledger's repr alone holds no ε: no δ)
        spent = float(re.search(r"ε = ([0-9.]+)", capsys.readouterr().out).group(1))
        assert 0 < spent <= 3.0 + 1e-6
    if name == "warn_or_refuse(":  # strict: the warning became a refusal naming it
        assert capsys.readouterr().out.startswith("Refused (PackedRecordsWarning is an error here)")
    if name == "EpsilonCeiling":  # the last release allowed, then the reason the next one is refused
        steps, reason = capsys.readouterr().out.split(" ", 1)
        assert int(steps) > 0 and "would spend more than target_epsilon = 1.0" in reason


def test_examples_name_the_noise_multiplier_they_leave_to_calibration():
    """PrivateStep's first positional argument is σ: a bare ``PrivateStep(None, ...)`` reads as if None were something
    else (and invites ``PrivateStep(None, ..., noise_multiplier=1.0)``, a TypeError). The examples say
    ``noise_multiplier=None``."""
    pages = [ROOT / "README.md", ROOT / "examples" / "plain_pytorch.py", *sorted((ROOT / "docs").rglob("*.md"))]
    bare = [str(page.relative_to(ROOT)) for page in pages if re.search(r"PrivateStep\(\s*None\b", page.read_text())]
    assert not bare, f"PrivateStep(None, ...) in {bare}: write PrivateStep(noise_multiplier=None, ...)"
    assert "PrivateStep(noise_multiplier=None," in (ROOT / "README.md").read_text()
