"""The accuracy recipe's transferable parts on the small transformer LM (issue 21, item 4).

Augmentation does not apply to text; the parameter EMA and the larger expected batch do. Each row
adds one thing to the previous, at ε = 3 (δ = 1e-5, RDP; σ calibrated for each row's own plan):

* base: ``TinyTransformerLM`` (2 layers, d = 64, 4 heads) from scratch on byte-level windows of
  Python's ``pydoc_data`` help text, DP-Adam (post-processing, lr 0.01), expected batch 64, 300 steps;
* + EMA of the released parameters (Lightning's ``EMAWeightAveraging``, post-processing);
* + expected batch 256 for the same 300 steps (4× the examples per step, σ recalibrated);
* a control that is not a step of the ladder: batch 64 for 1200 steps, as many examples as the
  batch-256 row at the same ε (is it the batch, or the compute?).

The metric is the validation perplexity exp(val loss) on the last 10 % of the text, with the EMA
weights where the row has them.

    python examples/lm_recipe.py --seeds 0 1 --out docs/results/lm_recipe.md   # 8 runs of 300–1200 steps
    python examples/lm_recipe.py --smoke                                        # 4 rows of 3 steps, one seed
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EMAWeightAveraging

from lightning_dp.accounting import forget_data_releases
from lightning_dp import DPStrategy
from lightning_dp._warnings import quiet_lightning
from lightning_dp.data import PydocTextDataModule
from lightning_dp.models import TinyTransformerLM


@dataclass(frozen=True)
class Setting:
    """One row of the ablation."""

    name: str
    batch_size: int = 64
    steps: int = 300
    lr: float = 0.01
    ema: Optional[float] = None


LADDER = (
    Setting("base (batch 64, 300 steps)"),
    Setting("+ EMA 0.99", ema=0.99),
    Setting("+ batch 256 (σ recalibrated)", ema=0.99, batch_size=256),
    Setting("control: batch 64, 1200 steps (the examples of batch 256)", ema=0.99, steps=1200),
)


def run(setting: Setting, epsilon: float, seed: int, max_train_windows: Optional[int] = None) -> dict:
    """Train one row privately; validation perplexity, σ and wall time."""
    pl.seed_everything(seed, verbose=False)
    data = PydocTextDataModule(seq_len=64, batch_size=setting.batch_size, max_train_windows=max_train_windows)
    strategy = DPStrategy(target_epsilon=epsilon, target_delta=1e-5, max_grad_norm=1.0)
    callbacks = [EMAWeightAveraging(decay=setting.ema)] if setting.ema else []
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=setting.steps, max_epochs=-1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, num_sanity_val_steps=0,
                         limit_val_batches=0)  # one validation, after fit (with the EMA weights, if any)
    model = TinyTransformerLM(d_model=64, n_layers=2, n_heads=4, lr=setting.lr)
    start = time.perf_counter()
    forget_data_releases()  # runs compared on the same records: each its own ε (docs/accounting.md, 'The data carry')
    with quiet_lightning(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data)
        trainer.limit_val_batches = 1.0
        val = trainer.validate(model, data, verbose=False)[0]["val/loss"]
    wall = time.perf_counter() - start
    return dict(setting=setting.name, epsilon=epsilon, seed=seed, val_loss=float(val),
                perplexity=math.exp(float(val)), sigma=strategy.noise_multiplier, wall=wall)


def table(rows: list[dict]) -> str:
    """Markdown: validation perplexity mean ± std (min–max) over seeds per row, σ and wall time."""
    lines = ["| setting | val perplexity | val loss (nats/token) | σ | s per run |", "|---|---|---|---|---|"]
    for s in LADDER:  # the smoke rows keep their names
        mine = [r for r in rows if r["setting"] == s.name]
        if not mine:
            continue
        ppl = [r["perplexity"] for r in mine]
        loss = [r["val_loss"] for r in mine]
        std = statistics.stdev(ppl) if len(ppl) > 1 else 0.0
        lines.append(f"| {s.name} | {statistics.mean(ppl):.2f} ± {std:.2f} ({min(ppl):.2f}–{max(ppl):.2f}) | "
                     f"{statistics.mean(loss):.3f} | {mine[0]['sigma']:.3f} | "
                     f"{statistics.mean(r['wall'] for r in mine):.0f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    """Run the ladder, print each run and the table, optionally write it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eps", type=float, default=3.0, help="target ε of every row")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="initialisation seeds")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    parser.add_argument("--smoke", action="store_true", help="every row for 3 steps on 512 windows, one seed (CI)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ladder = [replace(s, steps=3) for s in LADDER] if args.smoke else list(LADDER)
    seeds, windows = (args.seeds[:1], 512) if args.smoke else (args.seeds, None)
    rows = []
    for setting in ladder:
        for seed in seeds:
            rows.append(run(setting, args.eps, seed, max_train_windows=windows))
            print(f"[{len(rows)}/{len(ladder) * len(seeds)}] {rows[-1]}", flush=True)
    text = table(rows)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return rows


if __name__ == "__main__":
    main()
