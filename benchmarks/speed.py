"""Speed and memory of private training vs non-private (issue 10). Run by hand:

    OMP_NUM_THREADS=1 python benchmarks/speed.py --threads 1       # both backends, 3 models, batch 64
    python benchmarks/speed.py --backend lightning --models mlp --modes nonprivate,ghost
    python benchmarks/speed.py --device cuda                         # on a GPU

Prints, per model and backend: median ms/step and peak memory for non-private training,
a hand-written Opacus loop (GradSampleModule + DPOptimizer, hooks) and each lightning_dp
engine, with ratios to non-private per example (time: of each run's median batch, memory: of
its largest; Poisson batches vary, plain loops' batches are all ``--batch``) and the speed-up
over Opacus, then the issue's targets.

Backends (``BACKENDS``):

* ``plain``: bare loops. Engines: forward, mean loss, backward, ``engine.clip_and_sum``,
  then the library's :class:`~lightning_dp.privacy.privatizer.Privatizer` (σCz once, / B), optimizer step.
* ``lightning``: the same models inside ``pl.Trainer``: non-private Trainer, Opacus in a
  LightningModule (its DPOptimizer driven by Lightning's closure; uniform batches), and
  ``DPStrategy(per_sample=engine)`` (Poisson batches of expected size ``--batch``). Time per
  step is taken by a callback from ``on_train_batch_start`` to ``on_train_batch_end``
  (forward, backward, clipping, noise, optimizer step; loading excluded).

Models: ``digits`` (lightning_dp.models.DigitsCNN's layers: 2 conv + GroupNorm + tanh, 8×8),
``mlp`` (784-512-512-10), ``lm`` (causal transformer, 2 layers, d=128, T=64, vocab 256);
also ``cnn8``/``cnn28`` (conv + ReLU + linear, 8×8 / 28×28 with pooling).

Timing runs all modes of one model in one subprocess, interleaved (plain: one step of each
in turn; lightning: ``--rounds`` short fits of each in turn), so a busy machine slows every
mode alike. Peak memory runs each (model, mode) in its own subprocess: the peak of the bytes
held by tensors over those before the first step (:class:`MemoryMeter`: on CUDA
``torch.cuda.max_memory_allocated``, on CPU the profiler's allocation events): activations,
gradients, per-example state, noise buffers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MODELS = ("digits", "mlp", "lm", "cnn8", "cnn28")
DEFAULT_MODELS = ("digits", "mlp", "lm")
ENGINES = ("ghost", "vmap", "opacus_hooks")
DEFAULT_MODES = ("nonprivate", "noise_only", "opacus") + ENGINES
LOSS = Callable[[nn.Module, Tensor, Tensor], Tensor]


# ----------------------------------------------------------------------------- models
class SmallCNN(nn.Module):
    """conv(1→16,3) + conv(16→32,3) + linear + linear, ReLU; ``side`` 8 or 28 (pools)."""

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


def _classify(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(m(x), y)


def _next_token(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(m(x).reshape(-1, 256), y.reshape(-1))


def build(name: str, n: int, device: torch.device) -> tuple[nn.Module, LOSS, tuple[Tensor, Tensor]]:
    """(model, loss_fn, (x, y) with ``n`` examples) for one benchmark model; same init per call."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name == "digits":
        from lightning_dp.models.digits_cnn import DigitsCNN

        cnn = DigitsCNN()
        model: nn.Module = nn.Sequential(cnn.features, cnn.head)
        x, y, loss_fn = torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g), _classify
    elif name in ("cnn8", "cnn28"):
        side = 8 if name == "cnn8" else 28
        model = SmallCNN(side)
        x, y, loss_fn = torch.randn(n, 1, side, side, generator=g), torch.randint(0, 10, (n,), generator=g), _classify
    elif name == "mlp":
        model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        x, y, loss_fn = torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g), _classify
    elif name == "lm":
        model = TransformerLM()
        x, y = torch.randint(0, 256, (n, 64), generator=g), torch.randint(0, 256, (n, 64), generator=g)
        loss_fn = _next_token
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    return model.to(device), loss_fn, (x, y)


def _opacus_optimizer(params, args) -> torch.optim.Optimizer:
    from opacus.optimizers import DPOptimizer

    return DPOptimizer(torch.optim.SGD(params, lr=1e-3), noise_multiplier=args.sigma, max_grad_norm=args.clip,
                       expected_batch_size=args.batch)


# ------------------------------------------------------------------------ plain loops
def nonprivate_loop(model, loss_fn, batch, args) -> Callable[[], None]:
    """Forward, mean loss, backward, SGD step."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model, *batch).backward()
        opt.step()

    return step


def opacus_loop(model, loss_fn, batch, args) -> Callable[[], None]:
    """Hand-written Opacus: GradSampleModule (hooks) + DPOptimizer."""
    from opacus import GradSampleModule

    gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean")
    opt = _opacus_optimizer(gsm.parameters(), args)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(gsm, *batch).backward()
        opt.step()

    return step


def engine_loop(name: str):
    """Plain loop around one lightning_dp engine and the library's Privatizer (as DPStrategy runs them)."""

    def make(model, loss_fn, batch, args) -> Callable[[], None]:
        from lightning_dp.grad_sample import make_engine
        from lightning_dp.privacy.noise import GaussianNoise
        from lightning_dp.privacy.privatizer import Privatizer
        from lightning_dp.privacy.release import DEFAULT_REQUEST

        engine = make_engine(name)
        engine.attach(model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=1e-3)
        privatizer = Privatizer(GaussianNoise())

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(model, *batch).backward()
            out = engine.clip_and_sum(params, args.clip)
            privatizer.privatize(out, params, DEFAULT_REQUEST, args.sigma, args.clip, float(args.batch))
            opt.step()

        return step

    return make


def noise_only_loop(model, loss_fn, batch, args) -> Callable[[], None]:
    """Only the σCz draw of a private step (GaussianNoise, as the Privatizer draws it)."""
    from lightning_dp.privacy.noise import GaussianNoise

    params = [p for p in model.parameters() if p.requires_grad]
    noise = GaussianNoise()

    def step() -> None:
        noise.sample(params)

    return step


LOOPS: dict[str, Callable] = {"nonprivate": nonprivate_loop, "opacus": opacus_loop, "noise_only": noise_only_loop,
                              **{e: engine_loop(e) for e in ENGINES}}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class MemoryMeter:
    """Peak growth (MiB) of the memory held by tensors from :meth:`start` to :meth:`peak_mib`.

    CUDA: ``torch.cuda.max_memory_allocated`` over the allocation at :meth:`start`. CPU: the
    same quantity from the profiler's allocation events (``profile_memory=True``: every
    tensor allocation and free, summed in time order; the running maximum). Process RSS would
    also count allocator slack and libraries initialising lazily (oneDNN, MKL buffers), which
    dwarf an 8×8 CNN's activations; tensor bytes compare what the training step itself holds.
    Frees of tensors allocated before :meth:`start` are not seen, so the CPU peak errs high.
    """

    def __init__(self, device: torch.device) -> None:
        self.device, self.base, self._profiler = device, 0, None

    def start(self) -> None:
        """Record the baseline (reset the CUDA peak, or start recording CPU allocations)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.start()

    def peak_mib(self) -> float:
        """Peak growth since :meth:`start`, MiB."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self.base) / 2**20
        self._profiler.stop()
        events = [e for e in self._profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
        return peak_of_allocations([(e.start_ns(), e.nbytes()) for e in events]) / 2**20


def peak_of_allocations(events: list[tuple[int, int]]) -> int:
    """Largest running total of (time, +bytes allocated / −bytes freed) events, in time order."""
    total = peak = 0
    for _, nbytes in sorted(events, key=lambda e: e[0]):
        total += nbytes
        peak = max(peak, total)
    return peak


def measure_plain(model_name: str, modes: list[str], what: str, args) -> dict[str, dict]:
    """``what`` = "time": all modes in this process, one step of each in turn; "memory": one mode."""
    device = torch.device(args.device)
    steps = {}
    for mode in modes:
        model, loss_fn, (x, y) = build(model_name, args.batch, device)
        steps[mode] = LOOPS[mode](model, loss_fn, (x.to(device), y.to(device)), args)
    if what == "memory":
        (mode,) = modes
        meter = MemoryMeter(device)
        meter.start()
        for _ in range(3):
            steps[mode]()
        return {mode: {"peak_mib": meter.peak_mib()}}
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


# -------------------------------------------------------------------------- lightning
LIGHTNING_MODES = ("nonprivate", "opacus") + ENGINES


def _lightning_classes():
    """The LightningModule and callbacks (defined lazily: plain runs need no Lightning import)."""
    import pytorch_lightning as pl

    class BenchModule(pl.LightningModule):
        """``loss_fn(model, x, y)`` as the training step, SGD(lr=1e-3); ``opacus``: Opacus'
        GradSampleModule around the model and its DPOptimizer (hand-written Opacus in Lightning)."""

        def __init__(self, model: nn.Module, loss_fn: LOSS, opacus: Optional[Any] = None) -> None:
            super().__init__()
            if opacus is not None:
                from opacus import GradSampleModule

                model = GradSampleModule(model, batch_first=True, loss_reduction="mean")
            self.model, self.loss_fn, self.opacus = model, loss_fn, opacus

        def training_step(self, batch, batch_idx):
            return self.loss_fn(self.model, *batch)

        def configure_optimizers(self):
            if self.opacus is not None:
                return _opacus_optimizer(self.parameters(), self.opacus)
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class StepTimer(pl.Callback):
        """ms from on_train_batch_start to on_train_batch_end, skipping the first ``skip`` of each fit."""

        def __init__(self, device: torch.device, skip: int) -> None:
            self.device, self.skip, self.times, self.batches, self._t0 = device, skip, [], [], 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            _sync(self.device)
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            _sync(self.device)
            if trainer.global_step > self.skip:
                self.times.append((time.perf_counter() - self._t0) * 1e3)
                self.batches.append(len(batch[0]))

    class MemoryProbe(pl.Callback):
        """Peak memory growth from the first training batch to the end of fit, and the largest
        batch seen (Poisson batches under DPStrategy vary around ``--batch``)."""

        def __init__(self, device: torch.device) -> None:
            self.meter, self.result, self.max_batch = MemoryMeter(device), math.nan, 0

        def on_train_start(self, trainer, pl_module) -> None:
            self.meter.start()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.max_batch = max(self.max_batch, len(batch[0]))

        def on_train_end(self, trainer, pl_module) -> None:
            self.result = self.meter.peak_mib()

    return BenchModule, StepTimer, MemoryProbe


def lightning_fit(mode: str, module, data: tuple[Tensor, Tensor], steps: int, callbacks: list, args) -> None:
    """One ``Trainer.fit`` of ``steps`` steps: non-private, Opacus-in-Lightning, or DPStrategy(engine)."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dp import DPStrategy

    kwargs: dict[str, Any] = dict(accelerator="gpu" if args.device.startswith("cuda") else "cpu", devices=1)
    if mode in ENGINES:
        kwargs["strategy"] = DPStrategy(noise_multiplier=args.sigma, max_grad_norm=args.clip, per_sample=mode,
                                        sampler_seed=0)  # the same Poisson batch sizes in every run
    trainer = pl.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=callbacks, **kwargs)
    loader = DataLoader(TensorDataset(*data), batch_size=args.batch, shuffle=True, drop_last=True)
    trainer.fit(module, loader)


def measure_lightning(model_name: str, modes: list[str], what: str, args) -> dict[str, dict]:
    """The modes inside ``pl.Trainer``: "time" = ``--rounds`` short fits of each mode in turn."""
    BenchModule, StepTimer, MemoryProbe = _lightning_classes()
    device = torch.device(args.device)
    modules, data = {}, None
    for mode in modes:
        model, loss_fn, data = build(model_name, args.batch * 20, device)
        modules[mode] = BenchModule(model, loss_fn, opacus=args if mode == "opacus" else None)
    skip = 2  # first steps of a fit: hook set-up, lazy allocations, loader start
    if what == "memory":
        (mode,) = modes
        probe = MemoryProbe(device)
        lightning_fit(mode, modules[mode], data, skip + 3, [probe], args)
        return {mode: {"peak_mib": probe.result, "max_batch": probe.max_batch}}
    timers = {m: StepTimer(device, skip) for m in modes}
    per_round = max(1, math.ceil(args.steps / args.rounds))
    for _ in range(args.rounds):
        for mode in modes:
            lightning_fit(mode, modules[mode], data, skip + per_round, [timers[mode]], args)
    return {m: {"ms": statistics.median(t.times), "med_batch": statistics.median(t.batches)}
            for m, t in timers.items()}


BACKENDS: dict[str, Callable[..., dict[str, dict]]] = {"plain": measure_plain, "lightning": measure_lightning}
BACKEND_MODES = {"plain": DEFAULT_MODES, "lightning": LIGHTNING_MODES}


# --------------------------------------------------------------------------- driver
def run_child(backend: str, model_name: str, modes: list[str], what: str, args) -> dict[str, dict]:
    """Run one measurement in a fresh subprocess; returns {mode: {...}} or {mode: {"error"}}."""
    cmd = [sys.executable, __file__, "--child", f"{backend}:{what}:{model_name}:{','.join(modes)}",
           "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--rounds", str(args.rounds), "--device", args.device, "--threads", str(args.threads),
           "--sigma", str(args.sigma), "--clip", str(args.clip)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["?"])[-1]
        return {m: {"error": last[:160]} for m in modes}
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure(backend: str, model_name: str, modes: list[str], args) -> dict[str, dict]:
    """Interleaved timing of all modes, then each mode's peak memory in its own process."""
    modes = [m for m in modes if m in BACKEND_MODES[backend]]
    results = run_child(backend, model_name, modes, "time", args)
    for mode in modes:
        if "error" not in results.get(mode, {"error": ""}):
            results[mode].update(run_child(backend, model_name, [mode], "memory", args)[mode])
    return results


def _ratio(a: dict, b: dict, key: str) -> float:
    return a[key] / b[key] if key in a and b.get(key, 0) > 0 else math.nan


def _memory_ratio(a: dict, b: dict, batch: int) -> float:
    """Peak memory of ``a`` over ``b`` per example of each run's largest batch: Poisson batches
    (DPStrategy) reach e.g. 81 where the non-private loader's are 64, and activations scale with B."""
    return _ratio(a, b, "peak_mib") * b.get("max_batch", batch) / a.get("max_batch", batch)


def _time_ratio(a: dict, b: dict, batch: int) -> float:
    """ms/step of ``a`` over ``b`` per example of each run's median batch (Poisson batches of
    expected size B have medians a few examples off B in a short run)."""
    return _ratio(a, b, "ms") * b.get("med_batch", batch) / a.get("med_batch", batch)


def report(backend: str, model_name: str, results: dict[str, dict], args) -> None:
    """One table: ms/step, × non-private, peak MiB, × non-private, speed-up over Opacus."""
    base, opa = results.get("nonprivate", {}), results.get("opacus", {})
    print(f"\n== {model_name} / {backend} (batch {args.batch}, {args.device}, {torch.get_num_threads()} threads) ==")
    print(f"{'mode':<14}{'ms/step':>10}{'x /example':>11}{'peak MiB':>10}{'x /example':>11}{'vs opacus':>11}"
          f"{'B med/max':>11}")
    for mode, r in results.items():
        if "error" in r:
            print(f"{mode:<14}  error: {r['error']}")
            continue
        print(f"{mode:<14}{r['ms']:>10.2f}{_time_ratio(r, base, args.batch):>11.2f}{r.get('peak_mib', math.nan):>10.3g}"
              f"{_memory_ratio(r, base, args.batch):>11.2f}{_time_ratio(opa, r, args.batch):>10.1f}x"
              f"{r.get('med_batch', args.batch):>6.0f}/{r.get('max_batch', args.batch):<4}")


def targets(all_results: dict[tuple[str, str], dict[str, dict]], batch: int, engine: str = "ghost") -> None:
    """The issue's targets for ``engine``: time ≤ 1.5× (1.25× lm), memory ≤ 1.3×, ≥ 5× Opacus
    (CNN, MLP); time per example of the median batch, memory of the largest."""
    print(f"\n== targets ({engine}) ==")
    for (backend, model_name), res in all_results.items():
        r, base, opa = res.get(engine, {}), res.get("nonprivate", {}), res.get("opacus", {})
        t, m, s = _time_ratio(r, base, batch), _memory_ratio(r, base, batch), _time_ratio(opa, r, batch)
        t_max = 1.25 if model_name == "lm" else 1.5
        checks = [f"time {t:.2f}x {'ok' if t <= t_max else 'MISSED'} (<= {t_max})",
                  f"memory {m:.2f}x {'ok' if m <= 1.3 else 'MISSED'} (<= 1.3)"]
        if model_name != "lm":
            checks.append(f"vs Opacus {s:.1f}x {'ok' if s >= 5 else 'MISSED'} (>= 5)")
        print(f"{model_name:<7}{backend:<10}" + "; ".join(checks))


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma list of {MODELS}")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma list (noise_only: plain only)")
    ap.add_argument("--backend", choices=sorted(BACKENDS) + ["all"], default="all")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per mode (plain)")
    ap.add_argument("--rounds", type=int, default=3, help="lightning: fits per mode, interleaved")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for m in args.models.split(","):
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {MODELS}")
    for m in args.modes.split(","):
        if m not in DEFAULT_MODES:
            ap.error(f"unknown mode {m!r}; choose from {DEFAULT_MODES}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no CUDA device; use --device cpu")
    return args


def main() -> None:
    args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        backend, what, model_name, modes = args.child.split(":")
        print(json.dumps(BACKENDS[backend](model_name, modes.split(","), what, args)))
        return
    backends = sorted(BACKENDS, reverse=True) if args.backend == "all" else [args.backend]
    all_results = {}
    for model_name in args.models.split(","):
        for backend in backends:
            all_results[(backend, model_name)] = res = measure(backend, model_name, args.modes.split(","), args)
            report(backend, model_name, res, args)
            sys.stdout.flush()
    targets(all_results, args.batch)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
