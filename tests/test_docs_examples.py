"""The paste-able examples of the new public names in docs/ run as written (the frozen configuration, the ε
ceiling, the performance options, the README's plain loop)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = [("docs/accounting.md", "EpsilonCeiling"), ("docs/architecture.md", "PrivateStep.from_config"),
            ("docs/performance.md", "fixed_batch_size="), ("README.md", "step.calibrate(")]


@pytest.mark.parametrize("page, name", EXAMPLES)
def test_the_example_runs(page, name, capsys):
    blocks = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S) if name in b]
    assert blocks, f"{page} has no example using {name}"
    exec(compile(textwrap.dedent(blocks[0]), page, "exec"), {})
    if name == "EpsilonCeiling":  # the last release allowed, then the reason the next one is refused
        steps, reason = capsys.readouterr().out.split(" ", 1)
        assert int(steps) > 0 and "would spend more than target_epsilon = 1.0" in reason
