"""DPShardedStrategy (FSDP2) vs DPStrategy (replicated), 2 CPU processes each (issue 19). Run by hand:

    OMP_NUM_THREADS=1 python benchmarks/sharded.py                  # the small transformer, batch 16 per rank
    OMP_NUM_THREADS=1 python benchmarks/sharded.py --d-model 256 --layers 4 --json out.json

Both runs train ``lightning_dp.models.TinyTransformerLM`` (vocab 256, context 64; Adam, so optimizer
state counts) on random tokens with the same per-rank Poisson batch, σ = 1, C = 1, the ghost engine.
Per rank, measured in the forked workers (tensor bytes, as in ``benchmarks/speed.py``):

* ``step ms``: median wall time of a training step (``on_train_batch_start`` → ``on_train_batch_end``:
  forward, backward, clipping, reduce/reduce-scatter, noise, optimizer step; the first ``--warmup``
  steps and the profiled step dropped; the median over ``--rounds`` interleaved fits of each);
* ``params``, ``grads``, ``adam``: bytes this rank holds after a step (a sharded tensor counts its
  local shard): what persists between steps;
* ``engine``: bytes of the ghost engine's per-example state when the step's clipped sums are taken
  (captured layer inputs and output gradients, and normalisation layers' per-example grads);
* ``step peak``: peak growth of the bytes held by tensors during one step (the profiler's allocation
  events, :class:`speed.MemoryMeter`; the same step, hence the same Poisson batch, in both runs):
  activations, per-example state, clipped sums, the reduce-scatter buffers, FSDP2's all-gathered
  layers, the new gradients.

Then docs/distributed.md's capacity table is *computed* from these measured bytes (see :func:`capacity`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed import MemoryMeter  # noqa: E402

from lightning_dp import DPShardedStrategy, DPStrategy  # noqa: E402
from lightning_dp.sharding import privatizer as sharded_privatizer
from lightning_dp.sharding.fsdp_layout import local_bytes  # noqa: E402
from lightning_dp.models.tiny_transformer import TinyTransformerLM  # noqa: E402

WORLD = 2


def _captured_bytes(engine: Any) -> int:
    """Bytes of the tensors the ghost engine holds for the step (each storage once)."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        elif isinstance(t, (list, tuple)):
            for x in t:
                add(x)
        elif isinstance(t, dict):
            for x in t.values():
                add(x)

    capture = engine._capture
    for calls in capture.completed().values():
        for rec in calls.records:
            add(rec.args)
            add(rec.kwargs)
            add(rec.grad_outs)
        add(calls.reduced)
    add(capture.roots.grads)
    return sum(seen.values())


class Meter(Callback):
    """Step times, persistent bytes, the engine's per-example state and one profiled step; written per rank."""

    def __init__(self, out_dir: str, warmup: int, profile_step: int) -> None:
        self.out_dir, self.warmup, self.profile_step = out_dir, warmup, profile_step
        self.times: list[float] = []
        self.engine: list[int] = []
        self.persistent: dict[str, int] = {}
        self.peak_mib = math.nan
        self.profiled_batch = 0
        self._t0 = 0.0
        self._meter: Optional[MemoryMeter] = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        torch.set_num_threads(1)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.strategy.private_step
        engine = step._engine
        original = engine.clip_and_sum

        def measured(*args: Any, **kwargs: Any) -> Any:
            self.engine.append(_captured_bytes(engine))
            return original(*args, **kwargs)

        engine.clip_and_sum = measured

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step == self.profile_step:
            self.profiled_batch = int(batch[0].shape[0])
            self._meter = MemoryMeter(torch.device("cpu"))
            self._meter.start()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           idx: int) -> None:
        elapsed = (time.perf_counter() - self._t0) * 1e3
        step = trainer.global_step - 1
        if self._meter is not None:
            self.peak_mib = self._meter.peak_mib()
            self._meter = None
        elif step >= self.warmup:
            self.times.append(elapsed)
        params = [p for p in pl_module.parameters()]
        optimizer = trainer.optimizers[0]
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, Tensor) and t.dim() > 0]
        self.persistent = {
            "params": local_bytes(params),
            "grads": local_bytes([p.grad for p in params if p.grad is not None]),
            "adam": local_bytes(state),
        }

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        result = {
            "step_ms": statistics.median(self.times) if self.times else math.nan,
            "engine_bytes": statistics.median(self.engine[-len(self.times):]) if self.engine else 0,
            "peak_mib": self.peak_mib,
            "profiled_batch": self.profiled_batch,
            **self.persistent,
            "parameters": sum(p.numel() for p in pl_module.parameters()),
        }
        Path(self.out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def run(kind: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One 2-process fit with ``kind`` in ("sharded", "replicated"); each rank's measurements."""
    torch.manual_seed(0)
    model = TinyTransformerLM(vocab_size=256, max_len=args.context, d_model=args.d_model, n_layers=args.layers,
                              n_heads=args.heads, optimizer="adam", lr=1e-3)
    ids = torch.randint(0, 256, (args.examples, args.context + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=args.batch, shuffle=True)
    privacy = dict(noise_multiplier=1.0, max_grad_norm=1.0, sampler_seed=0, start_method="fork",
                   timeout=timedelta(seconds=300))
    strategy = DPShardedStrategy(**privacy) if kind == "sharded" else DPStrategy(**privacy)
    with tempfile.TemporaryDirectory() as out:
        meter = Meter(out, args.warmup, profile_step=args.warmup)
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=args.steps, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[meter])
        trainer.fit(model, data)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]


# ------------------------------------------------------------------ the computed capacity table
GPT_SIZES = {  # name: (layers, d_model), vocabulary 50257, context 1024 (GPT-2; GPT-3's shapes beyond 1.5 B)
    "GPT-2 124M": (12, 768), "GPT-2 355M": (24, 1024), "GPT-2 774M": (36, 1280), "GPT-2 1.5B": (48, 1600),
    "2.7B": (32, 2560), "6.7B": (32, 4096), "13B": (40, 5120), "30B": (48, 7168), "66B": (64, 9216),
    "175B": (96, 12288),
}


def gpt_parameters(layers: int, d: int, vocab: int = 50257, context: int = 1024) -> int:
    """Parameters of a GPT-2-shaped model: 12·L·d² + 13·L·d (blocks) + (V + T)·d + 2d (tied head)."""
    return 12 * layers * d * d + 13 * layers * d + (vocab + context) * d + 2 * d


def capacity(measured: dict[str, float], devices: int, lora: bool, sharded: bool, device_bytes: float = 80e9,
             context: int = 1024, vocab: int = 50257, lora_fraction: float = 0.005) -> str:
    """The largest of :data:`GPT_SIZES` whose per-device bytes fit ``device_bytes`` (computed, not run).

    Per device: ``persistent/parameter`` × P (measured bytes per parameter of parameters + grads + Adam
    state; sharded: divided by the devices), plus ``activation`` bytes × (T · d · L) for one example
    (measured on the small transformer per example, token, width and layer; ``max_physical_batch_size=1``),
    plus the logits of one example and their gradient (2 · T · V · 4 bytes), plus when sharded one block's
    all-gathered parameters and one block of streamed clipped sums (2 × 12·d² × 4 bytes). LoRA: frozen
    parameters cost 4 bytes each (sharded: /devices), the trainable ``lora_fraction`` of P the full
    persistent bytes. Linear in T·d·L: attention's T² scores (saved by the math attention kernel, not by
    flash attention) are not modelled."""
    best = "none"
    for name, (layers, d) in GPT_SIZES.items():
        P = gpt_parameters(layers, d)
        per_param = measured["per_parameter_bytes"]
        if lora:
            persistent = 4 * P + per_param * lora_fraction * P
        else:
            persistent = per_param * P
        if sharded:
            persistent /= devices
        act = measured["activation_bytes"] * context * d * layers + 2 * 4 * context * vocab  # + logits and their grad
        extra = 2 * 12 * d * d * 4 if sharded else 0
        if persistent + act + extra <= device_bytes:
            best = name
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="expected Poisson batch per rank")
    parser.add_argument("--examples", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="fits of each strategy, interleaved")
    parser.add_argument("--bucket-elements", type=int, default=None,
                        help="reduce-scatter send buffer (default: sharded_privatizer.BUCKET_ELEMENTS)")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    if args.bucket_elements is not None:  # set before the workers fork
        sharded_privatizer.BUCKET_ELEMENTS = args.bucket_elements
    rounds: dict[str, list[list[dict[str, Any]]]] = {"replicated": [], "sharded": []}
    for _ in range(args.rounds):  # interleaved: a busy machine slows both alike
        for kind in rounds:
            rounds[kind].append(run(kind, args))
    results = {kind: [{**runs[-1][r], "step_ms": statistics.median(run[r]["step_ms"] for run in runs)}
                      for r in range(WORLD)] for kind, runs in rounds.items()}
    P = results["replicated"][0]["parameters"]
    print(f"TinyTransformerLM d={args.d_model} L={args.layers} T={args.context}: {P:,} parameters; "
          f"batch {args.batch}/rank, {WORLD} processes (gloo, CPU); reduce-scatter buffer "
          f"{sharded_privatizer.BUCKET_ELEMENTS:,} elements")
    print(f"{'':12}{'rank':>5}{'step ms':>9}{'params':>11}{'grads':>11}{'adam':>11}{'engine':>11}{'step peak':>11}")
    for kind, ranks in results.items():
        for r, m in enumerate(ranks):
            print(f"{kind:12}{r:>5}{m['step_ms']:>9.1f}{m['params'] / 2**20:>10.2f}M{m['grads'] / 2**20:>10.2f}M"
                  f"{m['adam'] / 2**20:>10.2f}M{m['engine_bytes'] / 2**20:>10.2f}M{m['peak_mib']:>10.2f}M")
    rep, sh = results["replicated"][0], results["sharded"][0]
    persistent = {k: sum(m[x] for x in ("params", "grads", "adam")) for k, m in (("replicated", rep), ("sharded", sh))}
    print(f"persistent bytes per rank, sharded / replicated: {persistent['sharded'] / persistent['replicated']:.3f} "
          f"(1/{WORLD} = {1 / WORLD:.3f}); step time ratio {sh['step_ms'] / rep['step_ms']:.2f}")
    tokens = rep["profiled_batch"] * args.context * args.d_model * args.layers  # the profiled step's examples
    measured = {
        "per_parameter_bytes": persistent["replicated"] / P,
        "activation_bytes": max(rep["peak_mib"] * 2**20 - 4 * P, 0) / tokens,
    }
    print(f"measured: {measured['per_parameter_bytes']:.1f} persistent bytes per parameter (replicated), "
          f"{measured['activation_bytes']:.1f} step bytes per example·token·width·layer")
    print("computed: the largest GPT size trainable privately on devices of 80 GB (T = 1024, physical batch 1)")
    print(f"{'devices':>8}{'full, replicated':>20}{'full, sharded':>16}{'LoRA, replicated':>20}{'LoRA, sharded':>16}")
    table = {}
    for devices in (1, 8, 64):
        row = [capacity(measured, devices, lora, sharded) for lora in (False, True) for sharded in (False, True)]
        table[devices] = row
        print(f"{devices:>8}{row[0]:>20}{row[1]:>16}{row[2]:>20}{row[3]:>16}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "measured": measured,
                                               "capacity": table}, indent=1))


if __name__ == "__main__":
    main()
