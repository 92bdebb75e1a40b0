"""The privacy ledger: every noisy release a run has made.

The ledger is the single source of truth for what a run has spent. The strategy
records one entry per logical optimizer step (the sampled Gaussian mechanism of
docs/algorithms.md, "The mechanism"); accountants and the ``PrivacyBudget`` callback read
it. Consecutive steps with the same ``(σ, q)`` are run-length merged, so a ledger of
10^6 constant steps is one entry.

The ledger is plain state: :meth:`state_dict` / :meth:`load_state_dict` travel in
Lightning checkpoints, so a resumed run never forgets budget already spent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional


@dataclass(frozen=True)
class LedgerEntry:
    """``steps`` consecutive releases of the sampled Gaussian mechanism.

    Attributes:
        noise_multiplier: σ, the noise std divided by the clipping norm (sensitivity).
        sample_rate: q, the Poisson sampling rate (global expected batch / N).
        steps: how many consecutive releases used this (σ, q).
        private: ``False`` for releases that are not differentially private
            (the noiseless research baseline); any such entry makes ε infinite.
        run: the fit that made these releases (:attr:`PrivacyLedger.run`), so that two runs with equal
            settings are told apart when their records are combined; ``None`` when unknown (a ledger built by
            hand, a checkpoint written before runs were recorded): then alike settings are taken for one history.
    """

    noise_multiplier: float
    sample_rate: float
    steps: int
    private: bool = True
    run: Optional[str] = None


class PrivacyLedger:
    """Run-length list of the releases of a run: (σ, q, steps, private).

    Example:
        >>> ledger = PrivacyLedger()
        >>> ledger.record(1.0, 0.01)
        >>> ledger.record(1.0, 0.01)
        >>> ledger.steps, len(ledger.entries)
        (2, 1)
    """

    def __init__(self) -> None:
        self._entries: list[LedgerEntry] = []
        self._steps = 0
        self._private = True
        self.unit = "example"
        """What one release's ε protects: ``"example"`` (a record) or ``"user"`` (all of a user's records, with
        ``DPStrategy(privacy_unit=Users(...))``): N and q are then counted in users."""
        self.run: Optional[str] = None
        """The fit whose releases :meth:`record` adds (set when the ledger is bound to a module,
        :func:`~lightning_dp.accounting.module_ledgers.bind`); each entry keeps the run that made it."""
        self._listeners: list[Callable[[int], None]] = []

    def listen(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(steps)`` after every :meth:`record` that added releases (``steps``: how many);
        listeners are not part of the ledger's state (not copied, pickled nor saved)."""
        self._listeners.append(listener)

    def unlisten(self, listener: Callable[[int], None]) -> None:
        """Stop calling ``listener``."""
        self._listeners = [f for f in self._listeners if f is not listener]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_listeners"] = []
        return state

    def record(self, noise_multiplier: float, sample_rate: float, steps: int = 1, private: bool = True) -> None:
        """Append ``steps`` releases with noise multiplier σ and sampling rate q."""
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in [0, 1], got {sample_rate}")
        if noise_multiplier < 0 or math.isnan(noise_multiplier):
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
        if steps == 0:
            return
        self._steps += int(steps)
        self._private = self._private and bool(private)
        last = self._entries[-1] if self._entries else None
        if last is not None and (last.noise_multiplier, last.sample_rate, last.private, last.run) == (
            noise_multiplier,
            sample_rate,
            private,
            self.run,
        ):
            self._entries[-1] = LedgerEntry(noise_multiplier, sample_rate, last.steps + steps, private, self.run)
        else:
            self._entries.append(LedgerEntry(float(noise_multiplier), float(sample_rate), int(steps), private,
                                             self.run))
        for listener in list(getattr(self, "_listeners", ())):
            listener(int(steps))

    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        """The run-length entries, oldest first (read-only; a copy: O(entries))."""
        return tuple(self._entries)

    def entries_since(self, index: int) -> tuple[LedgerEntry, ...]:
        """The entries from position ``index`` on (``len(ledger)`` gives the next index).

        A reader that keeps its position pays for new entries only; the entry at
        ``len(ledger) − 1`` may still grow (run-length merge), so re-read it from there."""
        return tuple(self._entries[max(0, index) :])

    @property
    def steps(self) -> int:
        """Total number of releases recorded."""
        return self._steps

    @property
    def is_private(self) -> bool:
        """``False`` as soon as one non-private release was recorded (O(1))."""
        return self._private

    def __iter__(self) -> Iterator[LedgerEntry]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index: int) -> LedgerEntry:
        """The entry at ``index`` (O(1); negative indices count from the newest)."""
        return self._entries[index]

    def __repr__(self) -> str:
        unit = "" if self.unit == "example" else f", per {self.unit}"
        return f"PrivacyLedger(steps={self.steps}, entries={len(self._entries)}{unit})"

    def state_dict(self) -> dict[str, Any]:
        """Serialisable state, for checkpoints: the releases run-length merged by (σ, q, private) as they always
        were, and, when any run is known, the runs that made them as ``"runs"``: [run, steps] in order."""
        merged: list[list[Any]] = []
        runs: list[list[Any]] = []
        for e in self._entries:
            if merged and merged[-1][0:2] == [e.noise_multiplier, e.sample_rate] and merged[-1][3] == e.private:
                merged[-1][2] += e.steps
            else:
                merged.append([e.noise_multiplier, e.sample_rate, e.steps, e.private])
            if runs and runs[-1][0] == e.run:
                runs[-1][1] += e.steps
            else:
                runs.append([e.run, e.steps])
        state: dict[str, Any] = {"entries": merged}
        if self.unit != "example":
            state["unit"] = self.unit
        if any(run is not None for run, _ in runs):
            state["runs"] = runs
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the ledger's content with a saved state (a state without runs, as written before runs were kept:
        each entry's run unknown). The ledger's own :attr:`run` stays: what it records next is still this fit's."""
        runs = [[None if r is None else str(r), int(n)] for r, n in state.get("runs") or []]
        entries: list[LedgerEntry] = []
        for s, q, n, p in state["entries"]:
            n = int(n)
            while n > 0:
                if runs and runs[0][1] <= 0:
                    runs.pop(0)
                    continue
                run, take = (runs[0][0], min(n, runs[0][1])) if runs else (None, n)
                if runs:
                    runs[0][1] -= take
                entries.append(LedgerEntry(float(s), float(q), take, bool(p), run))
                n -= take
        self.load_entries(entries)
        self.unit = str(state.get("unit", self.unit))

    def load_entries(self, entries: Iterable[LedgerEntry]) -> None:
        """Replace the ledger's releases by ``entries`` (consecutive ones of one setting and run merged)."""
        kept: list[LedgerEntry] = []
        for e in entries:
            if e.steps and kept and (kept[-1].noise_multiplier, kept[-1].sample_rate, kept[-1].private,
                                     kept[-1].run) == (e.noise_multiplier, e.sample_rate, e.private, e.run):
                kept[-1] = LedgerEntry(e.noise_multiplier, e.sample_rate, kept[-1].steps + e.steps, e.private, e.run)
            elif e.steps:
                kept.append(e)
        self._entries = kept
        self._steps = sum(e.steps for e in kept)
        self._private = all(e.private for e in kept)
