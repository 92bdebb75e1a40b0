"""The files a user's logger wrote since the fit began, set apart for a run and put back (value_copies/logger_files.py):
any file, binary too."""

from __future__ import annotations

import os
import time

from lightning_dp.value_copies.logger_files import LoggerFiles


def test_the_files_written_since_the_start_are_set_apart_and_put_back(tmp_path):
    (tmp_path / "hparams.yaml").write_bytes(b"lr: 1\n")
    old = time.time() - 100
    os.utime(tmp_path / "hparams.yaml", (old, old))
    (tmp_path / "appended.bin").write_bytes(b"\x00start")
    files = LoggerFiles(lambda: [str(tmp_path)], time.time() - 1)
    (tmp_path / "hist.npy").write_bytes(b"\x93NUMPY\x01\x00real")  # written during the fit
    (tmp_path / "appended.bin").write_bytes(b"\x00start\x01real")
    assert files.changed()
    with files.set_apart():
        assert not (tmp_path / "hist.npy").exists(), "a file made since the start is set apart"
        assert (tmp_path / "appended.bin").read_bytes() == b"\x00start", "one changed since reads as at the start"
        (tmp_path / "hist.npy").write_bytes(b"\x93NUMPY\x01\x00moved")  # the re-fed logger writes
        (tmp_path / "new.txt").write_text("made in the run")
        (tmp_path / "hparams.yaml").write_bytes(b"lr: 2\n")
    assert (tmp_path / "hist.npy").read_bytes() == b"\x93NUMPY\x01\x00real"
    assert (tmp_path / "appended.bin").read_bytes() == b"\x00start\x01real"
    assert not (tmp_path / "new.txt").exists() and (tmp_path / "hparams.yaml").read_bytes() == b"lr: 1\n"
    assert sorted(os.listdir(tmp_path)) == ["appended.bin", "hist.npy", "hparams.yaml"], "nothing left beside them"


def test_nothing_written_since_the_start_is_not_changed(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    old = time.time() - 100
    os.utime(tmp_path / "a.txt", (old, old))
    files = LoggerFiles(lambda: [str(tmp_path)], time.time() - 1)
    assert not files.changed()
    with files.set_apart():
        assert (tmp_path / "a.txt").read_text() == "x"
