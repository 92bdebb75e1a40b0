"""The copies of logged values in the text files the loggers wrote (lightning_dp/value_copies/text_files.py)."""

from __future__ import annotations

import json
import os
import time

import torch

from lightning_dp.value_copies.logged_values import LoggedValues
from lightning_dp.value_copies.text_files import rewrite_file, rewrite_text, written

A, B = float(torch.tensor(0.6412345)), float(torch.tensor(0.5923417))
FAR, NEAR = (lambda v: v + 100), (lambda v: v - 100)


def _logged() -> LoggedValues:
    return LoggedValues({"train_loss"}, {"train_loss": [A, B]}, (FAR, NEAR))


def test_numbers_after_a_logged_name_or_equal_to_a_logged_value_move_alternately():
    text = (json.dumps({"step": 3, "train_loss": A, "lr": 0.5}) + "\n" + json.dumps({"step": 7, "train_loss": 2}) +
            f"\n{B:.5f}, 12.5, 1e-05, v1.0.2, 2026-11-30")
    new, names = rewrite_text(text, _logged())
    lines = new.splitlines()
    assert json.loads(lines[0]) == {"step": 3, "train_loss": A + 100, "lr": 0.5}
    assert json.loads(lines[1]) == {"step": 7, "train_loss": 2 - 100}, "a whole number under its name moves too"
    assert lines[2] == f"{round(B, 5) + 100!r}, 12.5, 1e-05, v1.0.2, 2026-11-30" and names == {"train_loss"}


def test_a_table_moves_by_column_by_row_name_and_by_value(tmp_path):
    path = tmp_path / "metrics.tsv"
    path.write_text(f"step\tname\tvalue\ttrain_loss\n0\ttrain_loss\t0.25\t\n1\tother\t{B}\t4\n")
    original, new = rewrite_file(str(path), _logged())
    assert original == path.read_bytes()
    assert new.decode() == f"step\tname\tvalue\ttrain_loss\n0\ttrain_loss\t100.25\t\n1\tother\t{B - 100}\t104.0\n"


def test_the_files_looked_at_are_text_files_changed_since_under_the_named_places(tmp_path):
    run = tmp_path / "run" / "version_0"
    (run / "deep" / "deeper" / "deepest").mkdir(parents=True)
    names = ("metrics.jsonl", "hparams.yaml", "events.out.tfevents.1", "deep/deeper/deepest/far.txt", ".hidden.csv")
    for name in names:
        (run / name).write_text("train_loss: 0.5\n")
    old = tmp_path / "old.csv"
    old.write_text("train_loss\n0.5\n")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    found = written([tmp_path / "run", str(old), "not a path", None, tmp_path / "run"], since=time.time() - 60)
    assert sorted(os.path.relpath(f, tmp_path) for f in found) == ["run/version_0/hparams.yaml",
                                                                    "run/version_0/metrics.jsonl"]
    assert rewrite_file(str(run / "events.out.tfevents.1"), _logged()) is not None  # named directly: text is text
    (run / "binary.log").write_bytes(b"\xff\xfe\x00train_loss: 0.5")
    assert rewrite_file(str(run / "binary.log"), _logged()) is None
