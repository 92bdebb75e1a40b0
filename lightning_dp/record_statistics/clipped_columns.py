"""Columns clipped (winsorised) at their own percentiles or extremes before training.

``lo, hi = torch.quantile(X, .01, 0), torch.quantile(X, .99, 0); X = X.clamp(lo, hi)`` (scipy's ``winsorize``,
``np.clip(x, *np.percentile(x, [1, 99], 0))``, a clip at the mean ± 3 standard deviations) writes a statistic of
the training set into every record beyond it: the records clipped all hold the bound, a function of the others.

:func:`clipped_columns` finds them in a training tensor ([N, D] or [N] floating point, N ≥ 50, at most
:data:`MAX_COLUMNS` columns and :data:`MAX_CELLS` cells), column by column, from the one thing a clip leaves: a
**mass of records tied at the column's minimum or maximum** — at least :data:`MIN_TIES` (3) and at most a quarter of
the column — in a column whose **other values are almost all distinct** (at least 95 % of them: continuous data, where
a natural tie at an extreme is as rare as a tie anywhere), at a bound that is **not a round number** (a multiple of
1/16 below 2¹⁶, or a number of at most four significant digits, exactly as the tensor's dtype holds it): a clip to a
public range (``x.clamp(-3, 3)``, ``[0, 255]``, a sensor saturating at 4095.0 or 0.5) passes, and so do integer or
few-valued columns (pixels, counts, categories: their ties are everywhere). A clip at the 1st/99th percentile is seen
from N ≈ 200 (three records beyond each percentile), at the 5th/95th from N = 50.

False positives, measured on unclipped data with this rule: none among 80,000 columns of N = 1,000 values (standard
normal, uniform, exponential and log-normal; float32 and float64), nor in scikit-learn's shipped digits, breast
cancer, diabetes, iris, wine and linnerud datasets (features and targets, float32 and float64). What it cannot see:
columns with many ties (data recorded to one or two decimals, N large: fewer than 95 % distinct values are not
judged), a clip at bounds round at four significant digits, a clip reaching fewer than three records, and data
clipped and then rescaled by its own extremes (a min-max scaler's 0 and 1 are round:
:func:`.scaled_records.scaled_by_itself` sees those instead). Rows that a ``lightning_dp.data`` mechanism computed
(:func:`~lightning_dp.record_checks.released_transforms.transforms_of`) are not judged: ``PrivateStandardizer``
clips to its public bounds and then scales by released (noised, so not round) statistics, ``PrivateImputer`` fills
with a released mean that may lie beyond a column's values; data clipped at its own percentiles before such a
mechanism is therefore not seen. Its output with columns reordered or selected is no longer its rows, yet ties at
its public bounds (or at a round clip made before it) scaled by the released statistics: in a fit charged for a
``PrivateStandardizer`` release, a tie at a value that release's scaling maps back to such a bound (``explained``:
:func:`~.released_statistics.released_end`) is no clip of the data's own, and the fit's other columns are judged
(the last note: every column of such a fit was skipped). Refused though public: a clip at round bounds then scaled
by constants that are not round (``(x.clamp(0, 1) - 0.485) / 0.229`` on tabular features): clip
after scaling, or at the scaled round bounds.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from lightning_dp.record_checks.released_transforms import transforms_of

MAX_COLUMNS, MAX_CELLS = 1024, 1 << 24
"""Tensors with more columns (images as pixels) or cells are not judged column by column."""

MIN_RECORDS, MIN_TIES, MAX_TIE_SHARE, MIN_DISTINCT_SHARE = 50, 3, 0.25, 0.95
"""Columns of fewer records are not judged; a clipped end holds from :data:`MIN_TIES` records to a quarter of the
column; the column's other values are at least 95 % distinct."""


CLIPPED = "clipped at its own percentiles or extremes"


def clipped(t: Tensor, sort: Optional[Callable[[], Tensor]] = None,
            explained: Callable[[float], bool] = lambda end: False) -> str:
    """How ``t`` was clipped at bounds of its own (:func:`clipped_columns`), or ""."""
    found = clipped_columns(t, sort, explained)
    if found and transforms_of(t):  # rows a DP preprocessor computed: clipped to its public bounds, or DP fills
        return ""
    return f"{CLIPPED} (records tied at a bound that is no round number in column{'s' * (len(found) > 1)} " \
        + ", ".join(map(str, found[:5])) + (" …" if len(found) > 5 else "") + ")" if found else ""


def clipped_columns(t: Tensor, sort: Optional[Callable[[], Tensor]] = None,
                    explained: Callable[[float], bool] = lambda end: False) -> list[int]:
    """The columns of ``t`` clipped at a bound of their own (module docstring). ``sort``: returns ``t``'s columns
    each sorted, [D, n], rows with a missing value left out (:class:`~.order_statistics.OrderStatistics`'s
    ``sorted``), called only for a tensor judged; ``None``: sorted here. ``explained``: whether a tie's value is a
    public bound a released transform put there (not counted)."""
    if not t.dtype.is_floating_point or t.dim() not in (1, 2) or t.shape[0] < MIN_RECORDS \
            or t.numel() > MAX_CELLS or (t.dim() == 2 and t.shape[1] > MAX_COLUMNS):
        return []
    if sort is None:
        x = t.detach().reshape(t.shape[0], -1).cpu()
        x = x[torch.isfinite(x).all(1)]
        sorted_columns = x.T.contiguous().sort(1).values
    else:
        sorted_columns = sort()
    found = []
    for j, column in enumerate(sorted_columns):
        if len(column) >= MIN_RECORDS and _clipped(column, t.dtype, explained):
            found.append(j)
    return found


def clip_fix() -> str:
    """The refusal's advice for clipped columns."""
    return ("Clip at public bounds fixed before the data are seen (a domain's limits, a round range such as "
            "x.clamp(-3, 3) after lightning_dp.data.PrivateStandardizer, which itself clips to its public lower and "
            "upper), never at the data's own percentiles or mean ± k standard deviations.")


def _clipped(s: Tensor, dtype: torch.dtype, explained: Callable[[float], bool]) -> bool:
    """Whether the sorted column ``s`` has a tie mass at an end that is not round, the rest almost all distinct."""
    n = len(s)
    low = int((s == s[0]).sum())
    high = int((s == s[-1]).sum())
    if low >= n // 2 or high >= n // 2:
        return False
    inner = s[low:n - high]
    if len(inner) < MIN_RECORDS // 2:
        return False
    distinct = int((inner[1:] != inner[:-1]).sum()) + 1
    if distinct < MIN_DISTINCT_SHARE * len(inner):
        return False
    most = MAX_TIE_SHARE * n
    return any(MIN_TIES <= ties <= most and not _round(float(end), dtype) and not explained(float(end))
               for ties, end in ((low, s[0]), (high, s[-1])))


def _round(value: float, dtype: torch.dtype) -> bool:
    """A number a person writes for the end of a range: a multiple of 1/16 below 2¹⁶ in size, or one of at most four
    significant digits, as ``dtype`` holds it (``torch.tensor(0.1)`` is 0.100000001…)."""
    if abs(value) < 65536 and float(value * 16).is_integer():
        return True
    short = float(f"{value:.4g}")
    return short == value or float(torch.tensor(short, dtype=dtype)) == value
