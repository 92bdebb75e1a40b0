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

#: Every private family lives under this prefix, which sorts after ``privacy/`` (PrivacyBudget's
#: tags) in TensorBoard's Scalars tab: the privacy section comes first, v_t below it.
PREFIX = "vt"

#: private (post-processing) families
V = f"{PREFIX}/v"  # v̂_t: bias-corrected Adam v (AdaGrad: the running sum)
V_MINUS_PHI = f"{PREFIX}/v_minus_phi"  # v̂_t − Φ̄_t: the corrected second moment
UPDATE = f"{PREFIX}/update"  # m̂ / D(v̂): the update direction applied (without the learning rate)
PHI = f"{PREFIX}/phi"  # Φ = per-coordinate noise variance of the last step's ĝ
FRAC_NEGATIVE = f"{PREFIX}/frac_negative"  # share of coordinates with v̂ − Φ̄ < 0 (per group: .../group<i>)

#: histograms in the units of the quantity: bucket edges from ``_hist_bins`` (read by ``lightning-dp report``)
HIST_M = f"{PREFIX}/hist/m"
HIST_V = f"{PREFIX}/hist/v"
HIST_V_MINUS_PHI = f"{PREFIX}/hist/v_minus_phi"
HIST_UPDATE = f"{PREFIX}/hist/update"
#: histograms for TensorBoard's linear x axis: v̂ spans decades, so the raw histogram sits against one
#: edge of the chart; log10 v̂ and log10(v̂ / Φ̄) (0 where v̂ = Φ̄, < 0 where v̂ − Φ̄ < 0) use its width
HIST_LOG10_V = f"{PREFIX}/hist/log10_v"
HIST_LOG10_V_OVER_PHI = f"{PREFIX}/hist/log10_v_over_phi"

#: NON-private (opt-in) tags, all under this prefix
NONPRIVATE = "nonprivate"
CLEAN_V = f"{NONPRIVATE}/{V}"  # v̂^c: Adam's v of the clean clipped mean
CLEAN_UPDATE = f"{NONPRIVATE}/{UPDATE}"  # m̂^c / (√v̂^c + ε)
CLIP_FRACTION = f"{NONPRIVATE}/clip_fraction"
NORM = f"{NONPRIVATE}/grad_norm"  # per-example gradient norms: min, q1, median, q3, max
MEAN_NORM_OVER_C = f"{NONPRIVATE}/mean_norm_over_c"  # ‖ḡ‖ / C
HIST_CLEAN_M = f"{NONPRIVATE}/{HIST_M}"
HIST_CLEAN_V = f"{NONPRIVATE}/{HIST_V}"
HIST_CLEAN_UPDATE = f"{NONPRIVATE}/{HIST_UPDATE}"

NORM_STATS: tuple[str, ...] = ("min", "q1", "median", "q3", "max")


def stat_tag(family: str, scope: str, stat: str) -> str:
    """``<family>/<scope>/<stat>``, e.g. ``vt/v/all/median`` or ``vt/update/group0/q1``."""
    return f"{family}/{scope}/{stat}"


def group_scope(index: int) -> str:
    """Scope name of the ``index``-th parameter group: ``group<index>``."""
    return f"group{index}"


def frac_negative_tag(index: int) -> str:
    """The share of coordinates with v̂ − Φ̄ < 0 in the ``index``-th parameter group."""
    return f"{FRAC_NEGATIVE}/{group_scope(index)}"
