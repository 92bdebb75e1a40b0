"""Compare the DP-Adam variants and DP-SGD on the digits CNN (issue 4, item 5).

docs/algorithms.md §1–§5 define the variants; "What the seeds measured" lists what the
papers found. For every ε in the config (δ fixed), every method and every point of
its small hyperparameter grid is trained with every seed under
``DPStrategy(target_epsilon=ε, target_delta=δ)`` (σ calibrated for the planned
number of steps). Per method and ε the grid point with the best mean validation
accuracy is chosen; the table reports its test accuracy, mean ± std over seeds.

Selecting hyperparameters on the private training data (its validation split) costs
privacy that the reported ε does not account for (Papernot & Steinke 2022); the ε
in the table is that of one training run.

    python examples/compare_variants.py                       # full sweep (~30 min)
    python examples/compare_variants.py --smoke --out /tmp/t.md
    python examples/compare_variants.py --epsilons 3 --seeds 5
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import pytorch_lightning as pl
import torch
import yaml

from lightning_dp.accounting import forget_data_releases
from lightning_dp import AdamVariant, DPStrategy, ledger_epsilon
from lightning_dp._warnings import quiet_lightning
from lightning_dp.data import DigitsDataModule
from lightning_dp.models import DigitsCNN

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "compare_variants.yaml"
DEFAULT_OUT = ROOT / "docs" / "results" / "compare_variants.md"
MODEL_KEYS = ("lr",)
STRATEGY_KEYS = ("max_grad_norm",)


@dataclass(frozen=True)
class Method:
    """One row of the table: an optimizer (and AdamVariant) with a hyperparameter grid."""

    label: str
    optimizer: str
    variant: Optional[str] = None
    momentum: float = 0.0
    grid: dict[str, list[Any]] = field(default_factory=dict)

    def points(self) -> list[dict[str, Any]]:
        """Every combination of the grid's values (keys in config order)."""
        keys = list(self.grid)
        return [dict(zip(keys, values)) for values in itertools.product(*(self.grid[k] for k in keys))]


@dataclass
class Sweep:
    """The sweep definition read from the YAML config."""

    delta: float
    epsilons: list[float]
    seeds: list[int]
    epochs: int
    batch_size: int
    max_grad_norm: float
    val_fraction: float
    channels: int
    methods: list[Method]
    max_steps: int = -1


@dataclass(frozen=True)
class RunResult:
    """One training run: accuracies on the validation and test splits, σ and ε spent."""

    val_acc: float
    test_acc: float
    sigma: float
    epsilon_spent: float
    seconds: float


# ----------------------------------------------------------------------------- config
def load_sweep(path: Path, smoke: bool = False) -> Sweep:
    """Read the YAML sweep; ``smoke`` applies its ``smoke:`` overrides (a few steps, few runs)."""
    raw = yaml.safe_load(Path(path).read_text())
    if not isinstance(raw, dict) or "methods" not in raw:
        raise ValueError(f"{path}: expected a mapping with a `methods` list (see configs/compare_variants.yaml).")
    methods = [_method(m) for m in raw["methods"]]
    sweep = Sweep(
        delta=float(raw["delta"]), epsilons=[float(e) for e in raw["epsilons"]], seeds=[int(s) for s in raw["seeds"]],
        epochs=int(raw["epochs"]), batch_size=int(raw["batch_size"]), max_grad_norm=float(raw["max_grad_norm"]),
        val_fraction=float(raw["val_fraction"]), channels=int(raw.get("channels", 16)), methods=methods,
    )
    if smoke:
        _apply_smoke(sweep, raw.get("smoke") or {})
    _check(sweep)
    return sweep


def _method(entry: dict[str, Any]) -> Method:
    grid = {k: (v if isinstance(v, list) else [v]) for k, v in (entry.get("grid") or {}).items()}
    if "lr" not in grid:
        raise ValueError(f"method {entry.get('label')!r}: its grid needs an `lr` list.")
    if entry.get("optimizer") != "sgd" and not entry.get("variant"):
        raise ValueError(f"method {entry.get('label')!r}: an adam method needs a `variant` (e.g. post_processing).")
    return Method(label=str(entry["label"]), optimizer=str(entry["optimizer"]), variant=entry.get("variant"),
                  momentum=float(entry.get("momentum", 0.0)), grid=grid)


def _apply_smoke(sweep: Sweep, smoke: dict[str, Any]) -> None:
    for key in ("epsilons", "seeds", "epochs", "max_steps"):
        if key in smoke:
            setattr(sweep, key, smoke[key])
    if "methods" in smoke:
        sweep.methods = [m for m in sweep.methods if m.label in smoke["methods"]]
    keep = int(smoke.get("lr_points", 0))
    if keep:
        sweep.methods = [Method(m.label, m.optimizer, m.variant, m.momentum, {k: v[:keep] for k, v in m.grid.items()})
                         for m in sweep.methods]


def _check(sweep: Sweep) -> None:
    if not sweep.methods or not sweep.seeds or not sweep.epsilons:
        raise ValueError("the sweep needs at least one method, one seed and one epsilon.")
    if not 0 < sweep.val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1) (selection needs a validation split), "
                         f"got {sweep.val_fraction}.")
    if any(not (math.isfinite(e) and e > 0) for e in sweep.epsilons):
        raise ValueError(f"epsilons must be finite and > 0, got {sweep.epsilons}.")


# ----------------------------------------------------------------------------- one run


@torch.no_grad()
def accuracy(model: torch.nn.Module, dataset: torch.utils.data.TensorDataset) -> float:
    """Top-1 accuracy of ``model`` on a whole TensorDataset (eval mode)."""
    model.eval()
    x, y = dataset.tensors
    return (model(x).argmax(1) == y).float().mean().item()


def train_once(sweep: Sweep, method: Method, point: dict[str, Any], epsilon: float, seed: int) -> RunResult:
    """Train one model (quiet Trainer) and evaluate it on the validation and test splits."""
    started = time.time()
    pl.seed_everything(seed, verbose=False)
    data = DigitsDataModule(batch_size=sweep.batch_size, val_fraction=sweep.val_fraction)
    model = DigitsCNN(lr=float(point["lr"]), optimizer=method.optimizer, momentum=method.momentum,
                      channels=sweep.channels)
    strategy = DPStrategy(target_epsilon=epsilon, target_delta=sweep.delta,
                          max_grad_norm=float(point.get("max_grad_norm", sweep.max_grad_norm)))
    hparams = {k: v for k, v in point.items() if k not in MODEL_KEYS + STRATEGY_KEYS}
    callbacks = [AdamVariant(method.variant, **hparams)] if method.variant else []
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_epochs=sweep.epochs, max_steps=sweep.max_steps,
        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    forget_data_releases()  # runs compared on the same records: each its own ε (docs/accounting.md, 'The data carry')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # per-run noise (the noiseless warning is stated in the table)
        trainer.fit(model, datamodule=data)
    return RunResult(
        val_acc=accuracy(model, data.val_set), test_acc=accuracy(model, data.test_set),
        sigma=strategy.noise_multiplier, epsilon_spent=ledger_epsilon(strategy.ledger, sweep.delta),
        seconds=time.time() - started,
    )


# ----------------------------------------------------------------------------- selection and table
@dataclass(frozen=True)
class Row:
    """The selected grid point of one method at one ε, with its per-seed results."""

    method: Method
    epsilon: float
    point: dict[str, Any]
    runs: list[RunResult]

    @property
    def val(self) -> list[float]:
        """Validation accuracies (%), one per seed."""
        return [100 * r.val_acc for r in self.runs]

    @property
    def test(self) -> list[float]:
        """Test accuracies (%), one per seed."""
        return [100 * r.test_acc for r in self.runs]


def select(method: Method, epsilon: float, results: dict[str, list[RunResult]], points: list[dict[str, Any]]) -> Row:
    """The grid point with the highest mean validation accuracy (ties: the first in grid order)."""
    best = max(points, key=lambda p: statistics.fmean(r.val_acc for r in results[_key(p)]))
    return Row(method, epsilon, best, results[_key(best)])


def _key(point: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in point.items())


def at_edge(method: Method, point: dict[str, Any]) -> list[str]:
    """Grid keys (with ≥ 2 values) whose chosen value is the first or last: the optimum may lie outside."""
    return [k for k, values in method.grid.items() if len(values) > 1 and point[k] in (values[0], values[-1])]


def _mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.1f} ± {std:.1f}"


def _eps_cell(run: RunResult) -> str:
    return "∞ (not private)" if math.isinf(run.epsilon_spent) else f"{run.epsilon_spent:.2f}"


def markdown_table(rows: list[Row]) -> str:
    """One line per (ε target, method): chosen hyperparameters, σ, ε spent, val and test accuracy."""
    lines = ["| target ε | method | chosen (on val) | σ | ε spent | val acc % | test acc % (mean ± std) |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        first = row.runs[0]
        edge = at_edge(row.method, row.point)
        chosen = _key(row.point) + (f" (edge: {', '.join(edge)})" if edge else "")
        lines.append(f"| {row.epsilon:g} | {row.method.label} | {chosen} | {first.sigma:.3f} "
                     f"| {_eps_cell(first)} | {_mean_std(row.val)} | **{_mean_std(row.test)}** |")
    return "\n".join(lines)


def grid_table(all_results: dict[tuple[float, str], dict[str, list[RunResult]]]) -> str:
    """Every grid point's validation and test accuracy (for the appendix)."""
    lines = ["| target ε | method | hyperparameters | val acc % | test acc % |", "|---|---|---|---|---|"]
    for (eps, label), results in all_results.items():
        for key, runs in results.items():
            lines.append(f"| {eps:g} | {label} | {key} | {_mean_std([100 * r.val_acc for r in runs])} "
                         f"| {_mean_std([100 * r.test_acc for r in runs])} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- driver
def run_sweep(sweep: Sweep) -> tuple[list[Row], dict[tuple[float, str], dict[str, list[RunResult]]]]:
    """Train everything in this process; return the selected rows and every result."""
    rows: list[Row] = []
    everything: dict[tuple[float, str], dict[str, list[RunResult]]] = {}
    for eps in sweep.epsilons:
        for method in sweep.methods:
            points = method.points()
            results: dict[str, list[RunResult]] = {}
            for point in points:
                for seed in sweep.seeds:
                    run = train_once(sweep, method, point, eps, seed)
                    results.setdefault(_key(point), []).append(run)
                    print(f"ε={eps:g} {method.label} [{_key(point)}] seed={seed}: val {100 * run.val_acc:.1f} % "
                          f"test {100 * run.test_acc:.1f} % σ={run.sigma:.3f} ({run.seconds:.1f} s)", flush=True)
            everything[(eps, method.label)] = results
            rows.append(select(method, eps, results, points))
    return rows, everything


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line flags (``--seeds`` / ``--epsilons`` override the config)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="sweep definition (YAML)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown file to write")
    p.add_argument("--smoke", action="store_true", help="a handful of steps, one seed, two methods (CI)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds 0..n-1 (default: the config's list)")
    p.add_argument("--epsilons", type=float, nargs="+", default=None, help="target ε values (default: the config's)")
    args = p.parse_args(argv)
    if args.seeds is not None and args.seeds < 1:
        p.error("--seeds must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> Path:
    """Run the sweep, print the table, write the markdown; return its path."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    with quiet_lightning():
        return _run(args)


def _run(args: argparse.Namespace) -> Path:
    sweep = load_sweep(args.config, smoke=args.smoke)
    if args.seeds is not None:
        sweep.seeds = list(range(args.seeds))
    if args.epsilons is not None:
        sweep.epsilons = list(args.epsilons)
    _check(sweep)
    started = time.time()
    rows, everything = run_sweep(sweep)
    table = markdown_table(rows)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(args, sweep, table, grid_table(everything), time.time() - started))
    print(f"wrote {args.out} ({time.time() - started:.0f} s)")
    return args.out


def report(args: argparse.Namespace, sweep: Sweep, table: str, grid: str, seconds: float) -> str:
    """The markdown file: setup, the table, every grid point."""
    flags = " --smoke" if args.smoke else ""
    steps = f"max_steps = {sweep.max_steps}" if sweep.max_steps > 0 else f"{sweep.epochs} epochs"
    return f"""# DP-Adam variants vs DP-SGD on the digits CNN

Generated by `python examples/compare_variants.py{flags}` with `{args.config.name}` in {seconds / 60:.1f} min
(one process, 1 torch thread). DigitsCNN (channels = {sweep.channels}, GroupNorm, tanh) on scikit-learn's
digits: 80/20 train/test split, {100 * sweep.val_fraction:g} % of the training part held out for validation.
DPStrategy(target_epsilon = ε, target_delta = {sweep.delta:g}): Poisson sampling with expected batch
{sweep.batch_size}, {steps}, σ calibrated by the RDP accountant, C = {sweep.max_grad_norm:g} unless the
grid sets `max_grad_norm`. Seeds {sweep.seeds} (model initialisation; sampling and noise are OS-seeded).
DP-SGD is SGD with momentum; the Adam rows are torch.optim.Adam swapped by `AdamVariant` (defaults
β = (0.9, 0.999), ε = 1e-8; bias_corrected and independent_moments use γ' instead of ε).

For each method and ε the grid point with the best mean **validation** accuracy was chosen and its
**test** accuracy is reported; "edge" marks a choice at the end of its grid (the optimum may lie
beyond). Choosing hyperparameters on (a split of) the private data costs privacy that the
"ε spent" column (one training run, from the strategy's ledger) does **not** account for.
**noiseless is not differentially private** (its second moment reads the clean clipped gradient; the
ledger reports ε = ∞): it is a research reference, not a competitor.

{table}

## Every grid point (mean ± std over seeds)

{grid}
"""


if __name__ == "__main__":
    main()
