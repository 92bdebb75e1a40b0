"""Smoke run of examples/dp_finetune.py (public pre-training, private fine-tuning)."""

from __future__ import annotations

from pathlib import Path

import pytest
from example_loader import load_example

pytest.importorskip("transformers")
pytest.importorskip("peft")


@pytest.mark.slow  # ≈ 23 s: eight fits of a Hugging Face model (make test-all); the suite keeps under 15 min
def test_smoke_run_writes_every_row(tmp_path: Path) -> None:
    example = load_example("dp_finetune.py", "dp_finetune")
    out = tmp_path / "ft.md"
    example.main(["--smoke", "--out", str(out), "--threads", "1"])
    text = out.read_text()
    for row in ("pre-trained on public text only", "full fine-tune, non-private", "full fine-tune, DPStrategy",
                "LoRA r=8, DPStrategy", "from scratch, DPStrategy"):
        assert f"| {row} |" in text
    assert text.count("| 3.0 |") == 3 and text.count("| 8.0 |") == 3


def test_the_private_text_differs_from_the_public_one() -> None:
    example = load_example("dp_finetune.py", "dp_finetune")
    private = example.stdlib_docstrings(limit=20_000)
    assert len(private) > 10_000 and private[:2000] not in example.pydoc_text()
