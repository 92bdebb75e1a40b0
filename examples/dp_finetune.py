"""DP fine-tuning the way Li et al. ("Large language models can be strong DP learners") recommend:
pre-train on public text, then fine-tune privately on the private text (issue 18, item 6).

A small decoder (Hugging Face ``GPT2LMHeadModel`` from a config: byte vocabulary, d = 64,
2 layers, T = 64) is

1. pre-trained non-privately on **public** text: Python's help pages (``pydoc_data.topics``);
2. fine-tuned on **private** text: the docstrings of Python's standard library modules
   (a different text that also ships with Python; its last 10 % is held out), as
   - full fine-tuning with ``DPStrategy`` at ε = 3 and ε = 8 (δ = 1e-5, σ calibrated),
   - LoRA (peft, r = 8 on ``c_attn``/``c_proj``; base frozen) with ``DPStrategy`` at ε = 3 and 8,
   - the same model trained from scratch with ``DPStrategy`` at ε = 3 and 8,
   - a non-private fine-tune (the ceiling), and the pre-trained model untouched (the floor).

Every private run uses the per-example token loss (``lightning_dp.per_example_token_mean``),
safe with padding, and ``per_sample="auto"`` (the ghost engine, tied embeddings included).
Reported: validation perplexity (per byte) on the held-out private text, and wall time.

    python examples/dp_finetune.py --out docs/results/dp_finetune.md       # full run (~minutes on CPU)
    python examples/dp_finetune.py --smoke --out /tmp/ft.md                # seconds, for the tests
"""

from __future__ import annotations

import argparse
import importlib
import math
import pkgutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.accounting import forget_data_releases
from lightning_dp import DPStrategy, per_example_token_mean
from lightning_dp.data.pydoc_text import encode, pydoc_text, windows

T = 64


def stdlib_docstrings(limit: int = 400_000) -> str:
    """The docstrings of Python's standard-library modules (and their public classes and functions),
    in sorted module order: the "private" text. Deterministic for a given Python."""
    parts: list[str] = []
    names = sorted(m.name for m in pkgutil.iter_modules() if m.module_finder.path.startswith(sys.base_prefix)
                   and not m.name.startswith(("_", "test", "idlelib", "tkinter", "turtle", "antigravity", "this")))
    for name in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # noqa: BLE001  (platform-specific modules)
            continue
        for obj in [module, *(getattr(module, a) for a in sorted(dir(module)) if not a.startswith("_"))]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 80 and getattr(obj, "__module__", name) in (name, None):
                parts.append(doc.strip())
        if sum(map(len, parts)) > limit:
            break
    return "\n\n".join(parts)[:limit]


def split(text: str, val_fraction: float = 0.1) -> tuple[TensorDataset, TensorDataset]:
    tokens = encode(text, "byte")
    cut = int(tokens.numel() * (1 - val_fraction))
    return windows(tokens[:cut], T), windows(tokens[cut:], T)


class Decoder(pl.LightningModule):
    """A GPT-2 config model, wrapped unchanged; the loss is each window's own token mean."""

    def __init__(self, lr: float, lora: bool = False, base: Optional["Decoder"] = None) -> None:
        super().__init__()
        import transformers

        config = transformers.GPT2Config(vocab_size=256, n_positions=T, n_embd=64, n_layer=2, n_head=4,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
        if base is not None:
            model.load_state_dict(base.model.state_dict())
        if lora:
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj"],
                                                               lora_dropout=0.0, fan_in_fan_out=True))
        self.model, self.lr = model, lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return per_example_token_mean(self.model(input_ids=x).logits, y).mean()  # the mean of per-example means

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.lr)


@torch.no_grad()
def perplexity(module: Decoder, data: TensorDataset) -> float:
    module.eval()
    total, count = 0.0, 0
    for x, y in DataLoader(data, batch_size=256):
        logits = module.model(input_ids=x).logits
        total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="sum"))
        count += y.numel()
    module.train()
    return math.exp(total / count)


@dataclass
class Row:
    name: str
    epsilon: str
    sigma: str
    trainable: int
    ppl: float
    seconds: float


def fit(module: Decoder, data: TensorDataset, steps: int, batch: int, strategy=None) -> float:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, strategy=strategy or "auto")
    forget_data_releases()  # runs compared on the same records: each its own ε (docs/accounting.md, 'The data carry')
    t0 = time.perf_counter()
    trainer.fit(module, DataLoader(data, batch_size=batch, shuffle=True))
    return time.perf_counter() - t0


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/results/dp_finetune.md"))
    parser.add_argument("--smoke", action="store_true", help="a few steps of everything (tests)")
    parser.add_argument("--pretrain-steps", type=int, default=1500)
    parser.add_argument("--finetune-steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=128, help="expected Poisson batch of the private runs")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.smoke:
        args.pretrain_steps, args.finetune_steps, args.batch = 3, 2, 16
    torch.set_num_threads(args.threads)
    pl.seed_everything(0, verbose=False)
    public, _ = split(pydoc_text())
    private, held_out = split(stdlib_docstrings())
    if args.smoke:
        public, private, held_out = (TensorDataset(*(t[:64] for t in d.tensors)) for d in (public, private, held_out))

    pretrained = Decoder(lr=3e-3)
    pre_seconds = fit(pretrained, public, args.pretrain_steps, 64)
    rows = [Row("pre-trained on public text only", "–", "–", 0, perplexity(pretrained, held_out), pre_seconds)]

    def run(name: str, module: Decoder, epsilon: Optional[float]) -> None:
        strategy = None if epsilon is None else DPStrategy(target_epsilon=epsilon, target_delta=1e-5, max_grad_norm=1.0)
        seconds = fit(module, private, args.finetune_steps, args.batch, strategy)
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        sigma = "–" if strategy is None else f"{strategy.noise_multiplier:.2f}"
        rows.append(Row(name, "∞ (non-private)" if epsilon is None else str(epsilon), sigma, trainable,
                        perplexity(module, held_out), seconds))

    run("full fine-tune, non-private", Decoder(lr=1e-3, base=pretrained), None)
    for eps in (3.0, 8.0):
        run("full fine-tune, DPStrategy", Decoder(lr=1e-3, base=pretrained), eps)
        run("LoRA r=8, DPStrategy", Decoder(lr=5e-3, lora=True, base=pretrained), eps)
        run("from scratch, DPStrategy", Decoder(lr=3e-3), eps)
    write(args, rows, len(public), len(private), len(held_out))


def write(args, rows: list[Row], n_public: int, n_private: int, n_held_out: int) -> None:
    lines = [
        "# DP fine-tuning a small decoder: public pre-training, private fine-tuning",
        "",
        f"`python examples/dp_finetune.py{' --smoke' if args.smoke else ''}` ({args.threads} CPU threads). "
        f"GPT-2 config (byte vocabulary, d = 64, 2 layers, 4 heads, T = {T}, tied embeddings); pre-trained "
        f"{args.pretrain_steps} steps (batch 64, Adam) on Python's help pages ({n_public} windows, public); "
        f"fine-tuned {args.finetune_steps} steps on the docstrings of Python's standard library "
        f"({n_private} windows, private; {n_held_out} held-out windows for the perplexity). Private runs: "
        f"`DPStrategy(target_epsilon=ε, target_delta=1e-5, max_grad_norm=1)`, expected batch {args.batch}, "
        "σ calibrated for the run, per-example token loss, engine chosen by `auto` (ghost). One seed.",
        "",
        "| model | ε | σ | trainable parameters | held-out perplexity (per byte) | wall time |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.name} | {r.epsilon} | {r.sigma} | {r.trainable or '–'} | {r.ppl:.2f} | {r.seconds:.0f} s |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
