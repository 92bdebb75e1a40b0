"""Physical batches that keep every user whole: a user's records are clipped together, so they must be
differentiated in one forward and backward (:func:`user_chunks`)."""

from __future__ import annotations

from typing import Sequence

from torch import Tensor


def user_chunks(indices: Sequence[int], groups: Tensor, limit: int) -> list[list[int]]:
    """``indices`` cut between users into chunks of at most ``limit`` records; a user with more records than
    ``limit`` gets a chunk of its own (larger than ``limit``: its records cannot be split)."""
    chunks: list[list[int]] = []
    current: list[int] = []
    start = 0
    values = groups.tolist()
    while start < len(values):
        end = start
        while end < len(values) and values[end] == values[start]:
            end += 1
        user = list(indices[start:end])
        if current and len(current) + len(user) > limit:
            chunks.append(current)
            current = []
        current = current + user
        start = end
    if current:
        chunks.append(current)
    return chunks
