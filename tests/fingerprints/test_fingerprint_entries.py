"""What a replay on other data set apart (fingerprints/fingerprint_entries.py, ``moved_by_data``): an entry the second
replay on the data also set apart is excused only when it is no Python scalar (an object compared by identity, made
anew by each run); a number or a string is judged by value (zoo30 k03: the clocks are replayed, so the runs on the data
no longer differ by a time stamp, and a difference they still show is no excuse for one the data makes)."""

from __future__ import annotations

from lightning_dp.fingerprints.fingerprint_entries import moved_by_data


def test_a_number_the_runs_on_the_data_set_apart_is_still_judged() -> None:
    plain = {"attribute t": ("float", "1.5"), "attribute name": ("str", "a")}
    again = {"attribute t": ("float", "1.75"), "attribute name": ("str", "b")}
    other = {"attribute t": ("float", "9.5"), "attribute name": ("str", "c")}
    assert moved_by_data(plain, again, other) == ["attribute t", "attribute name"]


def test_an_object_made_anew_by_each_run_is_excused() -> None:
    plain = {"attribute loss_fn": ("object", "partial", 1), "attribute t": ("float", "1.5")}
    again = {"attribute loss_fn": ("object", "partial", 2), "attribute t": ("float", "1.5")}
    other = {"attribute loss_fn": ("object", "partial", 3), "attribute t": ("float", "1.5")}
    assert moved_by_data(plain, again, other) == []
    assert moved_by_data(plain, plain, other) == ["attribute loss_fn"]  # alike on the data: the other data's
