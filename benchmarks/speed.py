"""Speed and memory of private training vs non-private (issue 10). Run by hand:

    python benchmarks/speed.py                       # all models, all modes, batch 64
    python benchmarks/speed.py --models mlp --modes nonprivate,ghost --steps 50

Prints, per model: median ms/step and peak memory for non-private training, a
hand-written Opacus loop (GradSampleModule + DPOptimizer, hooks) and each lightning_dp
engine as a plain loop (forward, mean loss, backward, engine.clip_and_sum, + σCz, / B,
optimizer step), with ratios to non-private and the speed-up over Opacus.

Timing runs all modes of one model in one subprocess, one step of each in turn, so a
busy machine slows every mode alike and the ratios stay meaningful. Peak memory runs
each (model, mode) in its own subprocess: on CUDA
``torch.cuda.max_memory_allocated``; on CPU the growth of ``resource.getrusage`` maxrss
over the process's state after building the model and data (so it counts activations,
gradients, per-example state and allocator slack, not the torch import).

Structure for later modes: ``LOOPS`` maps a mode to a function (model, loss_fn, batch,
args) -> step callable; ``BACKENDS`` maps "plain" (here) and "lightning" (to be added:
the same modes through ``DPStrategy`` inside a ``Trainer``) to a runner.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MODELS = ("cnn8", "cnn28", "mlp", "lm")
ENGINES = ("ghost", "vmap", "opacus_hooks")
DEFAULT_MODES = ("nonprivate", "noise_only", "opacus") + ENGINES


# ----------------------------------------------------------------------------- models
class DigitsCNN(nn.Module):
    """conv(1→16,3) + conv(16→32,3) + linear + linear; ``side`` 8 (digits) or 28 (pools)."""

    def __init__(self, side: int = 8) -> None:
        super().__init__()
        self.pool = side > 8
        self.conv1, self.conv2 = nn.Conv2d(1, 16, 3), nn.Conv2d(16, 32, 3)
        s = side - 4 if not self.pool else ((side - 2) // 2 - 2) // 2
        self.fc1, self.fc2 = nn.Linear(32 * s * s, 64), nn.Linear(64, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.conv1(x))
        x = F.max_pool2d(x, 2) if self.pool else x
        x = torch.relu(self.conv2(x))
        x = F.max_pool2d(x, 2) if self.pool else x
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class CausalBlock(nn.Module):
    """Pre-LN block: causal attention from nn.Linear (no nn.MultiheadAttention) + MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff1, self.ff2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.reshape(b, T, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, T, d))
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))


class TransformerLM(nn.Module):
    """2 causal blocks, d=128, T=64, vocab 256; position indices expanded to [b, T]."""

    def __init__(self, vocab: int = 256, d: int = 128, T: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(T, d)
        self.blocks = nn.Sequential(*[CausalBlock(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        b, T = idx.shape
        pos = torch.arange(T, device=idx.device).expand(b, T)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def build(name: str, batch: int, device: torch.device):
    """(model, loss_fn, (x, y)) for one benchmark model."""
    g = torch.Generator().manual_seed(0)
    if name in ("cnn8", "cnn28"):
        side = 8 if name == "cnn8" else 28
        model = DigitsCNN(side)
        x, y = torch.randn(batch, 1, side, side, generator=g), torch.randint(0, 10, (batch,), generator=g)
        loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    elif name == "mlp":
        model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        x, y = torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)
        loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    elif name == "lm":
        model = TransformerLM()
        x, y = torch.randint(0, 256, (batch, 64), generator=g), torch.randint(0, 256, (batch, 64), generator=g)
        loss_fn = lambda m, x, y: F.cross_entropy(m(x).reshape(-1, 256), y.reshape(-1))  # noqa: E731
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    return model.to(device), loss_fn, (x.to(device), y.to(device))


# ------------------------------------------------------------------------------ loops
def nonprivate_loop(model, loss_fn, batch, args) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model, *batch).backward()
        opt.step()

    return step


def opacus_loop(model, loss_fn, batch, args) -> Callable[[], None]:
    """Hand-written Opacus: GradSampleModule (hooks) + DPOptimizer."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean")
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=1e-3), noise_multiplier=args.sigma,
                      max_grad_norm=args.clip, expected_batch_size=args.batch)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(gsm, *batch).backward()
        opt.step()

    return step


def engine_loop(name: str):
    """Plain loop around one lightning_dp engine: the mechanism as the strategy runs it."""

    def make(model, loss_fn, batch, args) -> Callable[[], None]:
        import lightning_dp.mechanism.grad_sample.functorch_vmap  # noqa: F401  (registers engines)
        import lightning_dp.mechanism.grad_sample.ghost  # noqa: F401
        import lightning_dp.mechanism.grad_sample.opacus_hooks  # noqa: F401
        from lightning_dp.mechanism.grad_sample.base import make_engine

        engine = make_engine(name)
        engine.attach(model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=1e-3)
        std = args.sigma * args.clip

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(model, *batch).backward()
            out = engine.clip_and_sum(params, args.clip)
            for p in params:
                p.grad = (out.sums[p] + torch.randn_like(p) * std) / args.batch
            opt.step()

        return step

    return make


def noise_only_loop(model, loss_fn, batch, args) -> Callable[[], None]:
    """Only the σCz draw of a private step: the part of the cost no engine can remove."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        for p in params:
            torch.randn_like(p)

    return step


LOOPS: dict[str, Callable] = {"nonprivate": nonprivate_loop, "opacus": opacus_loop, "noise_only": noise_only_loop,
                              **{e: engine_loop(e) for e in ENGINES}}


# ---------------------------------------------------------------------------- running
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def plain_steps(model_name: str, modes: list[str], args) -> dict[str, Callable[[], None]]:
    """One step callable per mode, each on its own copy of the model (same init)."""
    device = torch.device(args.device)
    steps = {}
    for mode in modes:
        torch.manual_seed(0)
        model, loss_fn, batch = build(model_name, args.batch, device)
        steps[mode] = LOOPS[mode](model, loss_fn, batch, args)
    return steps


def time_interleaved(steps: dict[str, Callable[[], None]], args) -> dict[str, dict]:
    """Median ms/step per mode, steps taken round-robin so a busy machine slows all alike."""
    device = torch.device(args.device)
    times: dict[str, list[float]] = {m: [] for m in steps}
    for i in range(args.warmup + args.steps):
        for mode, step in steps.items():
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            if i >= args.warmup:
                times[mode].append((time.perf_counter() - t0) * 1e3)
    return {m: {"ms": statistics.median(t)} for m, t in times.items()}


def peak_memory(step: Callable[[], None], args) -> float:
    """Peak memory growth (MiB) over a few steps, after the model and data exist."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024  # KiB on Linux


def measure_plain(model_name: str, modes: list[str], what: str, args) -> dict[str, dict]:
    """``what`` = "time": all modes in this process, interleaved; "memory": one mode only."""
    steps = plain_steps(model_name, modes, args)
    if what == "time":
        return time_interleaved(steps, args)
    (mode,) = modes
    return {mode: {"peak_mib": peak_memory(steps[mode], args)}}


def measure_lightning(model_name: str, modes: list[str], what: str, args) -> dict[str, dict]:
    """Placeholder: the same modes through DPStrategy inside a Trainer (added by the lead)."""
    raise NotImplementedError("--backend lightning is not implemented yet")


BACKENDS: dict[str, Callable[..., dict[str, dict]]] = {
    "plain": measure_plain, "lightning": measure_lightning}


def run_child(model_name: str, modes: list[str], what: str, args) -> dict[str, dict]:
    """Run one measurement in a fresh subprocess; returns {mode: {...}} or {mode: {"error"}}."""
    cmd = [sys.executable, __file__, "--child", f"{what}:{model_name}:{','.join(modes)}", "--batch", str(args.batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
           "--backend", args.backend, "--threads", str(args.threads)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["?"])[-1]
        return {m: {"error": last[:120]} for m in modes}
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure(model_name: str, modes: list[str], args) -> dict[str, dict]:
    """Interleaved timing of all modes, then each mode's peak memory in its own process."""
    results = run_child(model_name, modes, "time", args)
    for mode in modes:
        if "error" not in results.get(mode, {"error": ""}):
            results[mode].update(run_child(model_name, [mode], "memory", args)[mode])
    return results


def report(model_name: str, results: dict[str, dict]) -> None:
    base, opa = results.get("nonprivate", {}), results.get("opacus", {})
    print(f"\n== {model_name} (batch {ARGS.batch}, {ARGS.device}, {torch.get_num_threads()} threads) ==")
    print(f"{'mode':<14}{'ms/step':>10}{'x nonpriv':>11}{'peak MiB':>10}{'x nonpriv':>11}{'vs opacus':>11}")
    for mode, r in results.items():
        if "error" in r:
            print(f"{mode:<14}  error: {r['error']}")
            continue
        tr = r["ms"] / base["ms"] if "ms" in base else math.nan
        mem = r.get("peak_mib", math.nan)
        mr = mem / base["peak_mib"] if base.get("peak_mib", 0) > 0 else math.nan
        sp = opa["ms"] / r["ms"] if "ms" in opa else math.nan
        print(f"{mode:<14}{r['ms']:>10.2f}{tr:>11.2f}{mem:>10.1f}{mr:>11.2f}{sp:>10.1f}x")


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", choices=sorted(BACKENDS), default="plain")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main() -> None:
    global ARGS
    ARGS = args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        what, model_name, modes = args.child.split(":")
        print(json.dumps(BACKENDS[args.backend](model_name, modes.split(","), what, args)))
        return
    for model_name in args.models.split(","):
        report(model_name, measure(model_name, args.modes.split(","), args))
        sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
