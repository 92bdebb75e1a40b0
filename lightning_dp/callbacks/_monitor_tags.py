"""Tag names written by :class:`~lightning_dp.callbacks.second_moment_monitor.SecondMomentMonitor`.

Shared by the monitor (writer) and ``lightning-dp report`` (reader), so the two
cannot drift apart. Summary families are ``<family>/<scope>/<stat>`` with scope
``all`` (the whole model) or ``group<i>`` (the i-th parameter group, counted
over all optimizers in order).
"""

from __future__ import annotations

#: the six summary statistics of the seed's Table 1 (dp-adam-bias-correction.txt)
STATS: tuple[str, ...] = ("min", "q1", "median", "q3", "max", "mean")
#: the quantile levels of q1 / median / q3
QUANTILE_LEVELS: dict[str, float] = {"q1": 0.25, "median": 0.5, "q3": 0.75}

#: private (post-processing) families
V = "v_stats"  # v̂_t: bias-corrected Adam v (AdaGrad: the running sum)
V_MINUS_PHI = "v_minus_phi"  # v̂_t − Φ̄_t: the corrected second moment
UPDATE = "update"  # m̂ / D(v̂): the update direction applied (without the learning rate)
PHI = "v_stats/phi"  # Φ = per-coordinate noise variance of the last step's ĝ
FRAC_NEGATIVE = "v_stats/frac_negative"  # share of coordinates with v̂ − Φ̄ < 0

HIST_M = "hist/m"
HIST_V = "hist/v"
HIST_V_MINUS_PHI = "hist/v_minus_phi"
HIST_UPDATE = "hist/update"

#: NON-private (opt-in) tags, all under this prefix
NONPRIVATE = "nonprivate"
CLEAN_V = f"{NONPRIVATE}/v_stats"  # v̂^c: Adam's v of the clean clipped mean
CLEAN_UPDATE = f"{NONPRIVATE}/update"  # m̂^c / (√v̂^c + ε)
CLIP_FRACTION = f"{NONPRIVATE}/clip_fraction"
NORM = f"{NONPRIVATE}/grad_norm"  # per-example gradient norms: min, q1, median, q3, max
MEAN_NORM_OVER_C = f"{NONPRIVATE}/mean_norm_over_c"  # ‖ḡ‖ / C
HIST_CLEAN_M = f"{NONPRIVATE}/hist/m"
HIST_CLEAN_V = f"{NONPRIVATE}/hist/v"
HIST_CLEAN_UPDATE = f"{NONPRIVATE}/hist/update"

NORM_STATS: tuple[str, ...] = ("min", "q1", "median", "q3", "max")


def stat_tag(family: str, scope: str, stat: str) -> str:
    """``<family>/<scope>/<stat>``, e.g. ``v_stats/all/median`` or ``update/group0/q1``."""
    return f"{family}/{scope}/{stat}"


def group_scope(index: int) -> str:
    """Scope name of the ``index``-th parameter group: ``group<index>``."""
    return f"group{index}"
