"""DP-Adam variants on a small transformer LM at a fixed σ (issue 9 b; design-principles §5.2).

docs/algorithms.md §1–§5 define the variants; "What the seeds measured" says what the paper
found on TinyBERT/arXiv: bias correction and independent moments do worse than
post-processing, scale-then-privatize does better. Here: :class:`TinyTransformerLM`
trained from scratch on Python's own help text (:class:`PydocTextDataModule`, byte
level), under ``DPStrategy(noise_multiplier=σ)`` with σ fixed across methods (as the
paper fixes it and sets ε aside; the ε of one run is still reported), every method
with every seed. Per step the callback :class:`NegativeFraction` records the fraction
of coordinates with v̂_t − Φ < 0 (the paper's Fig. 4), read from DPAdam's state.

    python examples/transformer_variants.py                    # full run (see the config)
    python examples/transformer_variants.py --smoke --out /tmp/t.md
    python examples/transformer_variants.py --seeds 5

The same script runs the equal-ε comparison of independent and banded (DP-MF) noise
(docs/algorithms.md §7; design-principles §2.1, §4.5): a config or a method row may set
``noise`` (``gaussian`` | ``banded``), ``bands`` and ``target_epsilon`` (σ calibrated by
``DPStrategy`` for that row's noise and bands) instead of ``sigma``:

    python examples/transformer_variants.py --config configs/banded_transformer.yaml \
        --out docs/results/banded_transformer.md
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.callbacks import Callback
from torch.utils.data import TensorDataset

from lightning_dp.accounting import forget_data_releases
from lightning_dp import AdamVariant, DPStrategy, ledger_epsilon
from lightning_dp._warnings import quiet_lightning
from lightning_dp.data.pydoc_text import PydocTextDataModule
from lightning_dp.models.tiny_transformer import TinyTransformerLM, evaluate_loss, parameter_count
from lightning_dp.optim import DPAdam
from lightning_dp.optim.preconditioner import noise_variance

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "transformer_variants.yaml"
DEFAULT_OUT = ROOT / "docs" / "results" / "transformer_variants.md"
NOISES = ("gaussian", "banded")
# A page may end with a hand-written reading after this line; rewriting the page keeps it.
READING_MARKER = "<!-- hand-written reading below: kept when the script rewrites this page -->"


@dataclass(frozen=True)
class Method:
    """One row: the model's optimizer (``adam``/``sgd``), the AdamVariant, lr, C and privacy.

    ``private=False`` trains without DPStrategy (no clipping, no noise): a reference.
    ``noise``, ``bands``, ``sigma`` and ``target_epsilon`` override the config's values for
    this row (``None``: the config's); ``sigma`` and ``target_epsilon`` exclude each other.
    """

    label: str
    optimizer: str
    lr: float
    variant: Optional[str] = None
    momentum: float = 0.9
    max_grad_norm: Optional[float] = None
    private: bool = True
    hparams: dict[str, Any] = field(default_factory=dict)
    noise: Optional[str] = None
    bands: Optional[int] = None
    sigma: Optional[float] = None
    target_epsilon: Optional[float] = None


@dataclass
class Setup:
    """The experiment read from the YAML config.

    Privacy is either a fixed ``sigma`` or a ``target_epsilon`` at ``delta`` (σ calibrated per
    row by DPStrategy for the row's noise and bands); ``noise``/``bands`` are row defaults.
    """

    sigma: Optional[float]
    max_grad_norm: float
    delta: float
    batch_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    steps: int
    eval_every: int
    eval_windows: int
    seeds: list[int]
    methods: list[Method]
    max_train_windows: Optional[int] = None
    target_epsilon: Optional[float] = None
    noise: str = "gaussian"
    bands: int = 1


@dataclass
class RunResult:
    """One training run: final validation loss, curves, the per-step negative fraction, σ, ε."""

    val_loss: float
    curve_steps: list[int]
    curve_val: list[float]
    negative_fraction: list[float]
    epsilon: float
    seconds: float
    sigma: float = math.nan  # σ used (calibrated from target_epsilon when the row asks); nan if not private


# ----------------------------------------------------------------------------- config
def load_setup(path: Path, smoke: bool = False) -> Setup:
    """Read the YAML; ``smoke`` applies its ``smoke:`` overrides (a handful of steps)."""
    raw = yaml.safe_load(Path(path).read_text())
    if not isinstance(raw, dict) or "methods" not in raw:
        raise ValueError(f"{path}: expected a mapping with a `methods` list (see configs/transformer_variants.yaml).")
    if smoke:
        smoke_over = raw.get("smoke") or {}
        keep = smoke_over.pop("methods", None)
        raw.update(smoke_over)
        if keep is not None:
            raw["methods"] = [m for m in raw["methods"] if m.get("label") in keep]
    setup = Setup(
        sigma=_optional_float(raw.get("sigma")), max_grad_norm=float(raw["max_grad_norm"]), delta=float(raw["delta"]),
        batch_size=int(raw["batch_size"]), seq_len=int(raw["seq_len"]), d_model=int(raw["d_model"]),
        n_layers=int(raw["n_layers"]), n_heads=int(raw["n_heads"]), steps=int(raw["steps"]),
        eval_every=int(raw["eval_every"]), eval_windows=int(raw["eval_windows"]),
        seeds=[int(s) for s in raw["seeds"]], methods=[_method(m) for m in raw["methods"]],
        max_train_windows=raw.get("max_train_windows"), target_epsilon=_optional_float(raw.get("target_epsilon")),
        noise=str(raw.get("noise", "gaussian")), bands=int(raw.get("bands", 1)),
    )
    _check(setup)
    return setup


def _optional_float(value: Any) -> Optional[float]:
    return None if value is None else float(value)


def _method(entry: dict[str, Any]) -> Method:
    if "lr" not in entry or "label" not in entry:
        raise ValueError(f"every method needs a `label` and an `lr`, got {entry!r}.")
    if entry.get("optimizer") not in ("adam", "sgd"):
        raise ValueError(f"method {entry['label']!r}: optimizer must be 'adam' or 'sgd'.")
    known = {"label", "optimizer", "lr", "variant", "momentum", "max_grad_norm", "private", "hparams",
             "noise", "bands", "sigma", "target_epsilon"}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ValueError(f"method {entry['label']!r}: unknown keys {unknown}; put variant options under `hparams`.")
    c = entry.get("max_grad_norm")
    return Method(label=str(entry["label"]), optimizer=entry["optimizer"], lr=float(entry["lr"]),
                  variant=entry.get("variant"), momentum=float(entry.get("momentum", 0.9)),
                  max_grad_norm=None if c is None else float(c), private=bool(entry.get("private", True)),
                  hparams=dict(entry.get("hparams") or {}), noise=entry.get("noise"),
                  bands=None if entry.get("bands") is None else int(entry["bands"]),
                  sigma=_optional_float(entry.get("sigma")),
                  target_epsilon=_optional_float(entry.get("target_epsilon")))


def _check(setup: Setup) -> None:
    if not setup.methods or not setup.seeds:
        raise ValueError("the config needs at least one method and one seed.")
    _check_budget("the config", setup.sigma, setup.target_epsilon)
    if setup.noise not in NOISES or setup.bands < 1 or (setup.noise == "gaussian" and setup.bands != 1):
        raise ValueError(f"the config: noise must be one of {NOISES} and bands >= 1 (bands > 1 needs noise: banded), "
                         f"got noise={setup.noise!r}, bands={setup.bands}.")
    if setup.steps < 1 or setup.eval_every < 1:
        raise ValueError("steps and eval_every must be >= 1.")
    for m in setup.methods:
        if m.variant and m.optimizer != "adam":
            raise ValueError(f"method {m.label!r}: a variant needs optimizer: adam.")
        if m.variant and not m.private:
            raise ValueError(f"method {m.label!r}: a DP variant needs private: true (it reads the mechanism).")
        _check_budget(f"method {m.label!r}", m.sigma, m.target_epsilon)
        if m.private:
            privacy_kwargs(setup, m)  # raises on a row whose noise, bands or budget cannot run


def _check_budget(where: str, sigma: Optional[float], target_epsilon: Optional[float]) -> None:
    if sigma is not None and target_epsilon is not None:
        raise ValueError(f"{where}: give sigma (fixed σ) or target_epsilon (σ calibrated), not both.")
    for name, value in (("sigma", sigma), ("target_epsilon", target_epsilon)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{where}: {name} must be a finite number > 0, got {value}.")


def privacy_kwargs(setup: Setup, method: Method) -> dict[str, Any]:
    """DPStrategy's privacy arguments for one private row (docs/algorithms.md §7 for banded noise).

    The row's ``noise``/``bands``/``sigma``/``target_epsilon`` win over the config's; a row
    that sets either σ or ε ignores the other one of the config. Returns ``noise``, ``bands``,
    ``max_grad_norm`` and either ``noise_multiplier`` or ``target_epsilon`` + ``target_delta``.
    """
    noise = method.noise or setup.noise
    bands = method.bands if method.bands is not None else (setup.bands if noise == "banded" else 1)
    if noise not in NOISES:
        raise ValueError(f"method {method.label!r}: noise must be one of {NOISES}, got {noise!r}.")
    if bands < 1 or (noise == "gaussian" and bands != 1):
        raise ValueError(f"method {method.label!r}: bands must be 1 for gaussian noise and >= 1 for banded, "
                         f"got {bands}.")
    if noise == "banded" and bands > 1 and method.variant == "independent_moments":
        raise ValueError(f"method {method.label!r}: independent_moments needs noise: gaussian (two draws per step).")
    kwargs: dict[str, Any] = {"noise": noise, "bands": bands,
                              "max_grad_norm": method.max_grad_norm or setup.max_grad_norm}
    if method.sigma is not None or method.target_epsilon is not None:
        sigma, epsilon = method.sigma, method.target_epsilon
    else:
        sigma, epsilon = setup.sigma, setup.target_epsilon
    if sigma is not None:
        kwargs["noise_multiplier"] = sigma
    elif epsilon is not None:
        kwargs.update(target_epsilon=epsilon, target_delta=setup.delta)
    else:
        raise ValueError(f"method {method.label!r}: set sigma or target_epsilon (in the row or at the top).")
    return kwargs


def fixed_sigma_gaussian(setup: Setup) -> bool:
    """True when every private row has independent noise with the config's σ (the variants page)."""
    return setup.sigma is not None and all(
        privacy_kwargs(setup, m) == {"noise": "gaussian", "bands": 1, "noise_multiplier": setup.sigma,
                                     "max_grad_norm": m.max_grad_norm or setup.max_grad_norm}
        for m in setup.methods if m.private
    )


# ----------------------------------------------------------------------------- the callback
def negative_fraction(optimizer: torch.optim.Optimizer, release: Any) -> Optional[float]:
    """Share of coordinates with v̂_t − Φ < 0 after the step (design-principles Fig. 4; docs/algorithms.md §2).

    v̂_t = ``exp_avg_sq`` / (1 − β2^t) from DPAdam's state and Φ the per-coordinate
    variance of the step's noise, ``release.noise_std²`` (divided by s² under
    scale-then-privatize). For ``independent_moments`` v̂ is already unbiased, so the
    share of v̂ < 0 is returned (Φ = 0). For ``noiseless`` v̂ is the clean second moment:
    the share is that of coordinates whose clean v̂ lies below Φ (the paper's Fig. 6).
    ``None`` for optimizers that are not DPAdam or before any release.
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, DPAdam) or release is None:
        return None
    unbiased = inner.variant == "independent_moments"
    negative, total = 0, 0
    for group in inner.param_groups:
        beta2 = group["betas"][1]
        for p in group["params"]:
            state = inner.state.get(p, {})
            if "exp_avg_sq" not in state or int(state["step"]) < 1:
                continue
            v_hat = state["exp_avg_sq"] / (1.0 - beta2 ** int(state["step"]))
            phi = 0.0 if unbiased else noise_variance(p, release)
            negative += int(((v_hat - phi) < 0).sum())
            total += v_hat.numel()
    return negative / total if total else None


class NegativeFraction(Callback):
    """Per step: the fraction of negative v̂ − Φ (see :func:`negative_fraction`); every
    ``eval_every`` steps: the loss on a fixed set of validation windows."""

    def __init__(self, val_windows: TensorDataset, eval_every: int) -> None:
        self.val_windows = val_windows
        self.eval_every = eval_every
        self.fractions: list[float] = []
        self.curve_steps: list[int] = []
        self.curve_val: list[float] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Loss of the initial model (step 0)."""
        self._evaluate(0, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        """Record the fraction after the step; evaluate on the schedule."""
        release = getattr(trainer.strategy, "last_release", None)
        fraction = negative_fraction(trainer.optimizers[0], release)
        if fraction is not None:
            self.fractions.append(fraction)
        step = trainer.global_step
        if step % self.eval_every == 0 or step == trainer.max_steps:
            self._evaluate(step, pl_module)

    def _evaluate(self, step: int, pl_module: pl.LightningModule) -> None:
        assert isinstance(pl_module, TinyTransformerLM)
        self.curve_steps.append(step)
        self.curve_val.append(evaluate_loss(pl_module, self.val_windows))


# ----------------------------------------------------------------------------- one run


def make_data(setup: Setup) -> PydocTextDataModule:
    """The byte-level pydoc windows, set up."""
    data = PydocTextDataModule(seq_len=setup.seq_len, batch_size=setup.batch_size,
                               max_train_windows=setup.max_train_windows)
    data.setup()
    return data


def train_once(setup: Setup, method: Method, seed: int, data: PydocTextDataModule) -> RunResult:
    """Train one model for ``setup.steps`` steps; evaluate on the whole validation split."""
    started = time.time()
    pl.seed_everything(seed, verbose=False)
    model = TinyTransformerLM(vocab_size=data.vocab_size, max_len=setup.seq_len, d_model=setup.d_model,
                              n_layers=setup.n_layers, n_heads=setup.n_heads, lr=method.lr,
                              optimizer=method.optimizer, momentum=method.momentum)
    assert data.val_set is not None
    monitor = NegativeFraction(TensorDataset(*(t[: setup.eval_windows] for t in data.val_set.tensors)),
                               setup.eval_every)
    callbacks: list[Callback] = [monitor]
    strategy: Any = "auto"
    if method.private:
        # NegativeFraction keeps, from on_train_batch_end, statistics of the optimizer's moments after each update
        # (released values) and losses on held-out windows: declared public for the release boundary.
        strategy = DPStrategy(**privacy_kwargs(setup, method), public_state=["NegativeFraction"])
        if method.variant:
            callbacks.append(AdamVariant(method.variant, **method.hparams))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=setup.steps, max_epochs=-1,
        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    forget_data_releases()  # runs compared on the same records: each its own ε (docs/accounting.md, 'The data carry')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the noiseless warning is stated in the table
        trainer.fit(model, datamodule=data)
    epsilon = ledger_epsilon(strategy.ledger, setup.delta) if method.private else math.inf
    return RunResult(val_loss=evaluate_loss(model, data.val_set), curve_steps=monitor.curve_steps,
                     curve_val=monitor.curve_val, negative_fraction=monitor.fractions, epsilon=epsilon,
                     seconds=time.time() - started, sigma=strategy.noise_multiplier if method.private else math.nan)


# ----------------------------------------------------------------------------- table and plot
def mean_std(values: Sequence[float], digits: int = 3) -> str:
    """``mean ± std`` (sample std; 0 for one value)."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.{digits}f} ± {std:.{digits}f}"


def late_fraction(run: RunResult) -> Optional[float]:
    """Mean negative fraction over the second half of the steps (``None`` if not recorded)."""
    fr = run.negative_fraction
    return statistics.fmean(fr[len(fr) // 2 :]) if fr else None


def markdown_table(setup: Setup, results: dict[str, list[RunResult]]) -> str:
    """One line per method: lr, C, ε, final validation loss (mean ± std over seeds), negative share.

    Configs with calibrated ε or banded noise get :func:`equal_epsilon_table` instead.
    """
    if not fixed_sigma_gaussian(setup):
        return equal_epsilon_table(setup, results)
    lines = ["| method | lr | C | ε (δ = {:g}) | final val loss (nats/token, mean ± std) | "
             "share v̂ − Φ < 0, 2nd half (mean) | s / run |".format(setup.delta),
             "|---|---|---|---|---|---|---|"]
    for method in setup.methods:
        runs = results[method.label]
        eps = runs[0].epsilon
        eps_cell = "∞ (not private)" if math.isinf(eps) or not method.private or method.variant == "noiseless" \
            else f"{eps:.2f}"
        fractions = [f for f in (late_fraction(r) for r in runs) if f is not None]
        share = f"{100 * statistics.fmean(fractions):.1f} %" if fractions else "—"
        c = "—" if not method.private else f"{method.max_grad_norm or setup.max_grad_norm:g}"
        lines.append(f"| {method.label} | {method.lr:g} | {c} | {eps_cell} | **{mean_std([r.val_loss for r in runs])}** "
                     f"| {share} | {statistics.fmean(r.seconds for r in runs):.0f} |")
    return "\n".join(lines)


def equal_epsilon_table(setup: Setup, results: dict[str, list[RunResult]]) -> str:
    """One line per method: noise (bands), lr, C, σ used, ε realised (from the ledger), loss, share, time.

    σ is the mean over seeds (the same for every seed: it depends only on ε, δ, q, T and b); the
    ε cell is one value when the seeds agree to 5e-4, else their range. docs/algorithms.md §7 for banded noise.
    """
    lines = ["| method | noise | lr | C | σ | ε realised (δ = {:g}) | final val loss (nats/token, mean ± std) | "
             "share v̂ − Φ < 0, 2nd half (mean) | s / run |".format(setup.delta),
             "|---|---|---|---|---|---|---|---|---|"]
    for method in setup.methods:
        runs = results[method.label]
        fractions = [f for f in (late_fraction(r) for r in runs) if f is not None]
        share = f"{100 * statistics.fmean(fractions):.1f} %" if fractions else "—"
        if method.private:
            kw = privacy_kwargs(setup, method)
            noise = "independent" if kw["bands"] == 1 else f"banded, b = {kw['bands']}"
            eps = [r.epsilon for r in runs]
            eps_cell = "∞ (not private)" if method.variant == "noiseless" or math.isinf(max(eps)) else (
                f"{eps[0]:.3f}" if max(eps) - min(eps) < 5e-4 else f"{min(eps):.3f}–{max(eps):.3f}")
            cells = [noise, f"{method.lr:g}", f"{kw['max_grad_norm']:g}",
                     f"{statistics.fmean(r.sigma for r in runs):.4f}", eps_cell]
        else:
            cells = ["none", f"{method.lr:g}", "—", "—", "∞ (not private)"]
        lines.append(f"| {method.label} | " + " | ".join(cells) + f" | **{mean_std([r.val_loss for r in runs])}** "
                     f"| {share} | {statistics.fmean(r.seconds for r in runs):.0f} |")
    return "\n".join(lines)


def plot(setup: Setup, results: dict[str, list[RunResult]], path: Path) -> None:
    """Two panels: validation loss vs step (mean over seeds), share of negative v̂ − Φ per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, method in enumerate(setup.methods):
        runs, color = results[method.label], colors[k % len(colors)]
        steps = runs[0].curve_steps
        mean = [statistics.fmean(r.curve_val[i] for r in runs) for i in range(len(steps))]
        left.plot(steps, mean, label=method.label, color=color)
        if runs[0].negative_fraction:
            n = min(len(r.negative_fraction) for r in runs)
            frac = [100 * statistics.fmean(r.negative_fraction[i] for r in runs) for i in range(n)]
            right.plot(range(1, n + 1), frac, label=method.label, color=color)
    left.set(xlabel="step", ylabel=f"val loss on {setup.eval_windows} windows (nats/token)",
             title="next-token loss (mean over seeds)")
    right.set(xlabel="step", ylabel="% coordinates", ylim=(0, 102),
              title="share of v̂ − Φ < 0 (IM: v̂ < 0; noiseless: clean v̂ < Φ)")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- driver
def run_all(setup: Setup) -> dict[str, list[RunResult]]:
    """Every method with every seed, in this process."""
    data = make_data(setup)
    results: dict[str, list[RunResult]] = {}
    for method in setup.methods:
        for seed in setup.seeds:
            run = train_once(setup, method, seed, data)
            results.setdefault(method.label, []).append(run)
            frac = late_fraction(run)
            extra = f", share v̂−Φ<0 {100 * frac:.1f} %" if frac is not None else ""
            print(f"{method.label} seed={seed}: val loss {run.val_loss:.4f}{extra} ({run.seconds:.0f} s)", flush=True)
    return results


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command-line flags (``--seeds`` overrides the config's list)."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="experiment definition (YAML)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown file to write (the PNG and the raw JSON go next to it)")
    p.add_argument("--smoke", action="store_true", help="a handful of steps, one seed, few methods (CI)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds 0..n-1 (default: the config's list)")
    args = p.parse_args(argv)
    if args.seeds is not None and args.seeds < 1:
        p.error("--seeds must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> Path:
    """Run, print the table, write the markdown and the PNG; return the markdown's path."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    with quiet_lightning():
        return _run(args)


def _run(args: argparse.Namespace) -> Path:
    setup = load_setup(args.config, smoke=args.smoke)
    if args.seeds is not None:
        setup.seeds = list(range(args.seeds))
    started = time.time()
    results = run_all(setup)
    table = markdown_table(setup, results)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = args.out.with_suffix(".png")
    plot(setup, results, png)
    args.out.with_suffix(".json").write_text(json.dumps({k: [asdict(r) for r in v] for k, v in results.items()}))
    page = report(args, setup, table, png.name, time.time() - started)
    args.out.write_text(page + kept_reading(args.out))
    print(f"wrote {args.out} and {png} ({time.time() - started:.0f} s)")
    return args.out


def kept_reading(path: Path) -> str:
    """The hand-written part of an existing page: :data:`READING_MARKER` and all after it ("" if none)."""
    if not path.exists():
        return ""
    text = path.read_text()
    at = text.find(READING_MARKER)
    return "" if at < 0 else "\n" + text[at:]


def _model_and_data(setup: Setup) -> tuple[str, int]:
    """The pages' sentence on the model and the data, and the number of training windows N."""
    data = make_data(setup)
    model = TinyTransformerLM(vocab_size=data.vocab_size, max_len=setup.seq_len, d_model=setup.d_model,
                              n_layers=setup.n_layers, n_heads=setup.n_heads)
    assert data.train_set is not None and data.val_set is not None
    n = len(data.train_set)
    return (f"Model: `TinyTransformerLM` ({setup.n_layers} layers, d = {setup.d_model},\n"
            f"{setup.n_heads} heads, {parameter_count(model):,} parameters), trained from scratch on byte-level "
            f"windows of\n{setup.seq_len} tokens of Python's `pydoc_data` help text ({n} training windows, "
            f"{len(data.val_set)} validation\nwindows: the last 10 % of the text)."), n


def report(args: argparse.Namespace, setup: Setup, table: str, png: str, seconds: float) -> str:
    """The markdown file: setup, table, figure (:func:`equal_epsilon_report` for ε / banded configs)."""
    if not fixed_sigma_gaussian(setup):
        return equal_epsilon_report(args, setup, table, png, seconds)
    flags = " --smoke" if args.smoke else ""
    model_and_data, n = _model_and_data(setup)
    phi = (setup.sigma * setup.max_grad_norm / setup.batch_size) ** 2
    return f"""# DP-Adam variants on a small transformer LM at fixed σ (design-principles §5.2)

Generated by `python examples/transformer_variants.py{flags}` with `{args.config.name}` in {seconds / 60:.1f} min
(one process, 1 torch thread). {model_and_data} `DPStrategy(noise_multiplier = {setup.sigma:g})`, Poisson sampling with
expected batch B = {setup.batch_size} (q = {setup.batch_size / n:.4f}), {setup.steps} steps, C = {setup.max_grad_norm:g}
unless the row says otherwise, so Φ = (σC/B)² = {phi:.2e} per coordinate. Seeds {setup.seeds} (initialisation;
sampling and noise are OS-seeded). σ is fixed across methods, as in the paper; the ε column is that of
one run at δ = {setup.delta:g} (RDP accountant). DP-SGD is SGD with momentum; the Adam rows are
torch.optim.Adam (β = (0.9, 0.999), ε = 1e-8) swapped by `AdamVariant`; bias_corrected and
independent_moments use γ instead of ε. **noiseless is not differentially private** (its v reads the clean
clipped mean); "non-private Adam" trains without DPStrategy (no clipping, no noise). Learning rates (and C
for scale-then-privatize) were chosen by a one-seed probe on the validation loss (see
`configs/transformer_variants.yaml`); that probe is not part of the reported runs.

The share column is the mean over the second half of training of the per-step share of
coordinates with v̂_t − Φ < 0 (the quantity bias correction floors at γ'; the paper's Fig. 4),
read from DPAdam's state after each step; for independent_moments it is the share of v̂_t < 0;
for noiseless it is the share of coordinates whose *clean* v̂_t lies below Φ (the paper's Fig. 6).
For scale_then_privatize Φ_t = (σC/B)²/s_t² changes from step to step and the share compares v̂_t with
the current Φ_t, not with its EMA: indicative only.

{table}

![validation loss and share of negative v̂ − Φ per step]({png})
"""


def _shown(path: Path) -> str:
    """``path`` relative to the repository root when it lies inside it (for the page's command line)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def equal_epsilon_report(args: argparse.Namespace, setup: Setup, table: str, png: str, seconds: float) -> str:
    """The page of a config with calibrated ε and/or banded noise (docs/algorithms.md §7; design-principles §4.5)."""
    flags = " --smoke" if args.smoke else ""
    model_and_data, n = _model_and_data(setup)
    budget = (f"σ calibrated by `DPStrategy(target_epsilon={setup.target_epsilon:g}, target_delta={setup.delta:g})` "
              "for each row's noise and bands" if setup.target_epsilon is not None
              else f"σ = {setup.sigma:g} unless the row says otherwise" if setup.sigma is not None
              else "σ as each row says")
    return f"""# Independent vs banded (DP-MF) noise on a small transformer LM

Generated by `python examples/transformer_variants.py --config {_shown(args.config)} --out {_shown(args.out)}{flags}`
in {seconds / 60:.1f} min
(one process, 1 torch thread). {model_and_data} Privacy: {budget} (RDP accountant), expected batch B = {setup.batch_size},
{setup.steps} steps, C = {setup.max_grad_norm:g} unless the row says otherwise. Independent rows: Poisson sampling
with q = B/N = {setup.batch_size / n:.4f}. Banded rows (`noise="banded"`, docs/algorithms.md §7): b-banded Toeplitz
DP-MF noise (Fichtenberger coefficients) with b-min-separated sampling — the data split into b groups, step t
Poisson-samples group t mod b at rate q_g = bB/N — accounted as ⌈T/b⌉ sampled-Gaussian rounds at q_g
(Choquette-Choo et al. 2023, Thm. 5). The ε column is realised from each run's ledger at δ = {setup.delta:g}.
Seeds {setup.seeds} (initialisation; sampling and noise are OS-seeded). The Adam rows are torch.optim.Adam
(β = (0.9, 0.999), ε = 1e-8) swapped by `AdamVariant`; scale_then_privatize clips in the scaled space (its C) and
refreshes s every step. Learning rates: see `{_shown(args.config)}`.

{table}

![validation loss and share of negative v̂ − Φ per step]({png})
"""


if __name__ == "__main__":
    main()
