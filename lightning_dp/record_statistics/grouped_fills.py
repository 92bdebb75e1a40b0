"""Missing values filled with a statistic of the cell's group: a class-conditional (or grouped) mean or median.

``X[y == c] = np.where(isnan(X[y == c]), np.nanmean(X[y == c], 0), X[y == c])`` (the Titanic notebooks' "age by
class"), or pandas' ``df.groupby("Pclass")["Age"].transform(lambda s: s.fillna(s.mean()))``, writes into each
missing cell the mean (or median) of the observed cells of the records that share its group. Each such cell depends
on every record of the group, and its value tells the group apart: with the label as the group, the features encode
the label. No noise covers them, so training on them is not differentially private (rule 11).

:func:`grouped_imputed_columns` judges a training feature tensor ([N, D], in float32 or float64) by its
*groupings* — each tensor of the dataset with one value per record and 2 to 16 distinct values (the labels, a float
0/1 target), then each column of the features with 2 to 16 distinct values (a class, a sex, a port); 24 at most —
and its columns' *repeated values*: in a column whose cells other than 0 are half distinct or more, each value other
than 0 in two cells or more; in a column whose values all but 2 to 16 lie on a decimal grid (1, 0.1, 0.01, 0.001),
those off it in two cells or more; the 16 most repeated per column. Integer, ordinal and one-hot columns have none.
A repeated value whose cells all fall in one group of a grouping (20 rows or more, 10 other cells or more) is found
where it is, as :func:`~.imputed_cells.imputed_columns` judges a whole column, the mean of the group's other cells
to 16 ulps of the column's largest magnitude, that mean rounded to a step at most 1/100 of its standard error, or
(in three cells or more, 64 groups at most per tensor) halfway between their two middle ones — and stands out of
them: they are continuous (ten or more other than 0, 90 % distinct), or it is the one value off the grid they lie on.
The evidence is as strong as for one global fill (an exact mean among continuous values never happens by chance), so
one group found is enough. The groups' means come from per-group sums (one product per grouping), so a table of
100,000 × 64 float32 cells adds about a second to the check. On the real tables measured (scikit-learn's digits,
breast cancer, wine, iris, diabetes; a California-housing-like table of 20,000 rows with ties and a capped column;
ordinal, one-hot and count columns; 20,000 normal rows with a binary label) nothing is found, in float32 and
float64.

What it cannot see, as for a global fill: the median of an odd count, a group's mode (a data value), a fill of a
group smaller than 20 rows or with fewer than 10 other observed cells, groups made of several columns at once
(``groupby(["Pclass", "Sex"])``: within one column's groups the cells hold several fills, none the mean of the
rest), groupings by a continuous column's bins, and past the limits above (a 25th grouping, a 17th repeated value).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_dp.record_statistics.imputed_cells import MAX_CELLS, MAX_COLUMNS, off_grid, off_step, rounding_step

MAX_GROUPS, MIN_ROWS, MAX_GROUPINGS = 16, 20, 24
"""A grouping has 2 to ``MAX_GROUPS`` values; groups of fewer than ``MIN_ROWS`` rows are not judged; at most
``MAX_GROUPINGS`` groupings are tried."""

MAX_VALUES, MAX_MEDIANS = 16, 64
"""Repeated values judged per column (the most repeated first), and groups whose order is read for a median (of a
value in three cells or more), at most."""


def grouped_imputed_columns(t: Tensor, others: Sequence[tuple[str, Tensor]] = (),
                            sorted_columns: Optional[Tensor] = None) -> list[tuple[int, str, str]]:
    """(column, "mean", "median" or "rounded mean", grouping) for each column of the training features ``t``
    ([N, D] floating point, no NaN) filled, within the groups of one grouping, with its group's statistic (module
    docstring). ``others``: the dataset's other tensors (name, tensor: the labels), each a grouping if it has one
    value per record and 2 to ``MAX_GROUPS`` of them; a grouping is named by its name, or "column ``k``" of ``t``.
    ``sorted_columns``: ``t``'s columns sorted ([D, N]), if at hand.

    Only a value that fills two cells or more is judged, and only for a grouping that puts all its cells in one
    group: its group's mean comes from per-group sums (one pass a column), its median from that group's cells."""
    if not t.dtype.is_floating_point or t.dim() != 2 or t.shape[0] < 2 * MIN_ROWS or t.shape[1] > MAX_COLUMNS \
            or t.numel() > MAX_CELLS or not bool(torch.isfinite(t).all()):
        return []
    x = t.detach().to("cpu", torch.float64)
    s = (sorted_columns if sorted_columns is not None else x.T.sort(1).values).to("cpu", torch.float64)
    runs = [torch.unique_consecutive(s[j], return_counts=True) for j in range(x.shape[1])]
    groupings = _groupings(x, runs, others)
    if not groupings:
        return []
    eps = torch.finfo(t.dtype).eps
    sums: dict[int, tuple[Tensor, Tensor]] = {}  # per grouping: the groups' sums and sums of squares [G, D]
    medians = 0
    found = []
    for j, (values, counts) in enumerate(runs):
        repeated = _repeated(values, counts)
        if not repeated:
            continue
        tol = 16 * eps * float(x[:, j].abs().max())
        held = torch.isin(x[:, j], torch.tensor(repeated, dtype=x.dtype)).nonzero().flatten()
        for v in repeated:
            rows = held[x[held, j] == v]
            k = len(rows)
            how = ""
            for g, (name, own, codes, sizes) in enumerate(groupings):
                group = codes[rows]
                if own == j or not bool((group == group[0]).all()):
                    continue
                c = int(group[0])
                m = int(sizes[c]) - k
                if m + k < MIN_ROWS or m < 10:
                    continue
                if g not in sums:
                    one_hot = torch.nn.functional.one_hot(codes, len(sizes)).to(x.dtype).T  # [G, N]
                    sums[g] = (one_hot @ x, one_hot @ (x * x))
                total, squares = (float(a[c, j]) for a in sums[g])
                mean = (total - k * v) / m
                error = max((squares - k * v * v) / m - mean * mean, 0.0) ** 0.5 / m ** 0.5
                cells = x[codes == c, j] if abs(mean - v) <= tol or rounding_step(v, mean, error, t.dtype) \
                    or (k >= 3 and medians < MAX_MEDIANS) else None
                if cells is None:
                    continue
                rest = cells[cells != v]
                if abs(mean - v) <= tol:
                    how = "mean"
                elif (step := rounding_step(v, mean, error, t.dtype)) and off_step(rest, step, 4 * eps * abs(v)):
                    how = "rounded mean"
                else:
                    medians += 1
                    how = "median" if _halfway(rest, v, tol) else ""
                if how and _ordinary(cells, rest, v):
                    found.append((j, how, name))
                    break
                how = ""
            if how:
                break
    return found


def _groupings(x: Tensor, runs: Sequence[tuple[Tensor, Tensor]],
               others: Sequence[tuple[str, Tensor]]) -> list[tuple[str, int, Tensor, Tensor]]:
    """(name, own column or -1, each record's group code [N], the groups' sizes) of ``others`` with one value per
    record, then of the columns of ``x``, with 2 to ``MAX_GROUPS`` values; ``MAX_GROUPINGS`` at most."""
    out = []
    for name, o in others:
        if o.dim() >= 1 and o.shape[:1] == x.shape[:1] and o[0].numel() == 1 and not o.dtype.is_complex:
            g = o.detach().reshape(-1).cpu()
            if g.is_floating_point() and not bool(torch.isfinite(g).all()):
                continue
            values, codes = torch.unique(g, return_inverse=True)
            if 2 <= len(values) <= MAX_GROUPS:
                out.append((name, -1, codes, torch.bincount(codes, minlength=len(values))))
    for j, (values, counts) in enumerate(runs):
        if 2 <= len(values) <= MAX_GROUPS:
            out.append((f"column {j}", j, torch.searchsorted(values, x[:, j].contiguous()), counts))
    return out[:MAX_GROUPINGS]


def _repeated(values: Tensor, counts: Tensor) -> list[float]:
    """The values of a column (its distinct ``values`` and their ``counts``) that could be fills among ordinary
    values, the most repeated first: those in two cells or more other than 0 where the cells other than 0 are half
    distinct or more; else those off the coarsest decimal grid (1, 0.1, 0.01, 0.001) that all but 2 to
    ``MAX_GROUPS`` of the values lie on, in half the cells or fewer. Integer, ordinal and one-hot columns have none."""
    nonzero = values != 0
    cells = int(counts[nonzero].sum())
    if cells < MIN_ROWS:
        return []
    pick = torch.zeros_like(nonzero)
    if int((counts[nonzero] == 1).sum()) >= 0.5 * cells:
        pick = nonzero & (counts >= 2)
    else:
        for decimals in range(4):
            scaled = values * 10 ** decimals
            off = nonzero & ((scaled - scaled.round()).abs() > 1e-6 * float(scaled.abs().max().clamp_min(1.0)))
            if not bool(off.any()):
                break  # on this grid: no fill off it
            if int(off.sum()) <= MAX_GROUPS and int(counts[off].sum()) <= cells // 2:
                pick = off & (counts >= 2)
                break
    order = counts[pick].argsort(descending=True, stable=True)[:MAX_VALUES]
    return values[pick][order].tolist()


def _halfway(rest: Tensor, v: float, tol: float) -> bool:
    """Whether ``v`` is the median of an even count of ``rest``: as many below as above, halfway between the two."""
    below, above = rest[rest < v], rest[rest > v]
    return len(below) == len(above) > 0 and abs((float(below.max()) + float(above.min())) / 2 - v) <= tol


def _ordinary(cells: Tensor, rest: Tensor, v: float) -> bool:
    """Whether ``v`` stands out of its group's other cells ``rest`` (``cells``: all of the group's) as a fill does
    (:func:`~.imputed_cells.imputed_columns`): they are continuous — ten or more other than 0, 90 % of them
    distinct —, or ``v`` is the one value off the decimal grid they lie on."""
    nonzero = rest[rest != 0]
    if len(nonzero) >= 10 and len(torch.unique(nonzero)) >= 0.9 * len(nonzero):
        return True
    value, one = off_grid(cells.sort().values[None])
    return bool(one[0]) and float(value[0]) == v
