"""DPStrategy on 1 vs 2 CPU processes, and what it all-reduces (issue 6). Run by hand:

    python benchmarks/ddp.py                    # DigitsCNN(channels=8), global batch 64, 60 steps
    python benchmarks/ddp.py --channels 32 --steps 100

Prints, per configuration, the median wall time of one training step (data loading,
forward, backward, clipping, noise, communication, optimizer step; the first
``--warmup`` steps dropped) and the bytes all-reduced per step during training:

* ``dp 1 proc``: DPStrategy, one process, batch 64, 1 and 2 torch threads;
* ``dp 2 proc``: DPStrategy, 2 forked processes (gloo), batch 32 each (global B = 64);
* ``ddp 2 proc``: non-private Lightning DDP (torch's reducer), batch 32 each;
* ``plain 1 proc``: non-private, one process, batch 64.

Bytes are counted in the workers: ``torch.distributed.all_reduce`` (and broadcast,
all_gather, barrier calls) is wrapped before the fork, and torch DDP's reducer, which
calls the process group directly, gets a counting communication hook. Expected: both
DDP flavours move 4·d bytes per step (d trainable float32 parameters): DPStrategy in one
flat all-reduce of the noisy clipped sums, torch DDP in its gradient buckets. The one
8-byte broadcast per step in both is Lightning's own SIGTERM check
(``_broadcast_sigterm_tensor`` of its training loop), not the mechanism.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from functools import wraps
from pathlib import Path
from typing import Any, Callable

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import DDPStrategy

from lightning_dp import DPStrategy
from lightning_dp.data import DigitsDataModule
from lightning_dp.models import DigitsCNN

_COUNTS: Counter = Counter()  # per process (each forked worker has its own copy)
_WRAPPED = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "broadcast_object_list", "barrier")


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


def _counting(name: str, fn: Callable) -> Callable:
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _COUNTS[f"{name}_calls"] += 1
        _COUNTS[f"{name}_bytes"] += _tensor_bytes(args[0]) if args else 0
        return fn(*args, **kwargs)

    return wrapper


def install_counters() -> None:
    """Wrap the Python-level collectives of ``torch.distributed`` (before the fork)."""
    for name in _WRAPPED:
        setattr(dist, name, _counting(name, getattr(dist, name)))


def _counting_ddp_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
    """torch DDP's default hook (all-reduce, then average), counting the bucket's bytes."""
    buffer = bucket.buffer()
    _COUNTS["ddp_reducer_calls"] += 1
    _COUNTS["ddp_reducer_bytes"] += buffer.numel() * buffer.element_size()
    work = dist.distributed_c10d.all_reduce(buffer.div_(dist.get_world_size()), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class StepTimer(Callback):
    """Times consecutive training steps; counts collectives issued while training; rank 0 writes JSON."""

    def __init__(self, out: Path, warmup: int) -> None:
        self.out, self.warmup = out, warmup
        self.ends: list[float] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model.register_comm_hook(None, _counting_ddp_hook)  # Lightning registers hooks on CUDA only

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _COUNTS.clear()
        self.ends = [time.perf_counter()]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        steps = [b - a for a, b in zip(self.ends, self.ends[1:])][self.warmup :]
        d = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        record = {
            "ms_per_step": 1000 * statistics.median(steps),
            "steps": trainer.global_step,
            "params": d,
            "counts": {k: v / trainer.global_step for k, v in _COUNTS.items()},
        }
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(record))


def run(kind: str, devices: int, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.steps`` steps of DigitsCNN in one configuration; rank 0's record."""
    torch.set_num_threads(threads)
    out = Path(tempfile.mkdtemp()) / "record.json"
    per_rank = args.batch // devices
    if kind == "dp":
        strategy: Any = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, start_method="fork")
    elif devices > 1:
        strategy = DDPStrategy(start_method="fork")
    else:
        strategy = "auto"
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StepTimer(out, args.warmup)],
    )
    torch.manual_seed(0)
    trainer.fit(DigitsCNN(channels=args.channels), datamodule=DigitsDataModule(batch_size=per_rank))
    return json.loads(out.read_text())


def main() -> None:
    """Run every configuration and print one table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64, help="global (expected) batch size")
    parser.add_argument("--channels", type=int, default=8, help="DigitsCNN width (d grows ~ channels²)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    install_counters()
    configs = [
        ("plain 1 proc, 1 thread", "plain", 1, 1),
        ("dp 1 proc, 1 thread", "dp", 1, 1),
        ("dp 1 proc, 2 threads", "dp", 1, 2),
        ("ddp 2 proc (non-private)", "plain", 2, 1),
        ("dp 2 proc", "dp", 2, 1),
    ]
    rows = [(name, run(kind, devices, threads, args)) for name, kind, devices, threads in configs]
    d = rows[0][1]["params"]
    print(f"DigitsCNN(channels={args.channels}): d = {d} parameters (4·d = {4 * d} bytes), global batch {args.batch}")
    print(f"{'configuration':28s} {'ms/step':>8s} {'all-reduced B/step':>19s} {'all_reduce calls/step':>22s}  other")
    for name, rec in rows:
        counts = rec["counts"]
        sent = counts.get("all_reduce_bytes", 0) + counts.get("ddp_reducer_bytes", 0)
        calls = counts.get("all_reduce_calls", 0) + counts.get("ddp_reducer_calls", 0)
        other = {k: round(v, 3) for k, v in counts.items() if not k.startswith(("all_reduce", "ddp_reducer"))}
        print(f"{name:28s} {rec['ms_per_step']:8.2f} {sent:19.0f} {calls:22.2f}  {other or ''}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
