"""The private step against its floor and against Opacus, interleaved in one process (issue 38). Run by hand:

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/cost_floor.py                      # the whole table
    PYTHONPATH=. python benchmarks/cost_floor.py --models mlp --batches 64 --threads 1 --rounds 20

For each (model, batch B, torch threads), one child process builds every mode on a copy of the same model and
times one step of each in turn, in a shuffled order each round (a busy machine slows every mode alike, and no mode
always follows another: the position in a round alone moved a ratio by ~5 %); it prints the median
ms/step of each mode and the median over rounds of each mode's time over the non-private step's *in the same
round* (paired ratios). Every mode trains on exactly B rows, with Adam:

* ``nonprivate``: forward, mean loss, backward, Adam step.
* ``ldp``: lightning_dp's whole private step in a plain loop, on the batch its Poisson loader draws over exactly the B
  rows (q = 1; drawn before the timed step) (:class:`~lightning_dp.privacy.private_step.PrivateStep`,
  ghost engine, the defaults): the release boundary's checks, clipping, noise once (drawn ahead when a CPU is free:
  ``noise_prefetch``, ``prefetch="auto"``), ÷B, the ledger, Adam step, the boundary's fingerprint after it.
* ``ldp_sync``: the same, the noise drawn at the release (``GaussianNoise(prefetch=False)``).
* ``opacus_ghost``: Opacus' ghost clipping (``GradSampleModuleFastGradientClipping`` + ``DPOptimizerFastGradientClipping``
  + ``DPLossFastGradientClipping``: two backward passes).
* ``opacus_hooks``: Opacus' ``GradSampleModule`` + ``DPOptimizer`` (per-example gradients materialised).

Models: ``digits`` (lightning_dp.models.DigitsCNN: 2 conv + GroupNorm, 8×8), ``mlp`` (784-512-512-10), ``lm``
(causal transformer, 2 layers, d = 128, T = 64, vocab 256; position ids made contiguous: Opacus' embedding norm
needs it), ``gpt2`` (Hugging Face GPT-2, tiny config in-process: 2 layers, d = 128, T = 64, vocab 256, untied
head: Opacus' ghost clipping refuses tied weights; explicit per-example position ids for the same reason).
A mode that fails prints its error instead of a time. ``--cpu`` times the main thread's CPU time instead of the wall
clock (on a machine other processes keep busy, the scheduler's pauses are left out; with 1 thread every mode but
``ldp``, whose noise is drawn ahead on another thread, runs wholly on the main thread: read ``ldp_sync`` then).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

import speed  # noqa: E402

MODELS = ("digits", "mlp", "lm", "gpt2")
EXTRA_MODELS = ("deep",)
"""Models :func:`build` makes that the tables leave out: ``deep`` is deep_overhead.py's 48 × [Linear(64, 64), LayerNorm,
GELU] (per-layer Python; ab_revisions.py, function_times.py)."""
MODES = ("nonprivate", "ldp", "ldp_sync", "opacus_ghost", "opacus_hooks")
SIGMA, CLIP, LR = 1.0, 1.0, 1e-3


class ContiguousLM(speed.TransformerLM):
    """speed.py's LM with contiguous position ids ([b, T] materialised, not an expanded view)."""

    def forward(self, idx: Tensor) -> Tensor:
        b, T = idx.shape
        pos = torch.arange(T, device=idx.device).repeat(b, 1)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


class TinyGPT2(nn.Module):
    """Hugging Face GPT-2 from a tiny config, returning logits; per-example position ids."""

    def __init__(self) -> None:
        super().__init__()
        import transformers as tf

        tf.logging.set_verbosity_error()
        config = tf.GPT2Config(vocab_size=256, n_positions=64, n_embd=128, n_layer=2, n_head=4,
                               tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                               attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
        self.model = tf.GPT2LMHeadModel(config)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device).repeat(idx.shape[0], 1)
        return self.model(input_ids=idx, position_ids=pos).logits


def build(name: str, n: int) -> tuple[nn.Module, bool, tuple[Tensor, Tensor]]:
    """(model, token-level loss?, (x, y) of n examples); the same initial weights at every call."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name == "lm":
        return ContiguousLM(), True, (torch.randint(0, 256, (n, 64), generator=g), torch.randint(0, 256, (n, 64), generator=g))
    if name == "gpt2":
        return TinyGPT2(), True, (torch.randint(0, 256, (n, 64), generator=g), torch.randint(0, 256, (n, 64), generator=g))
    if name == "deep":
        import deep_overhead  # (it imports this module)

        x, y = torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)
        return deep_overhead.stack(48), False, (x, y)
    model, _, data = speed.build(name, n, torch.device("cpu"))
    return model, False, data


def loss_of(out: Tensor, y: Tensor, tokens: bool) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)) if tokens else F.cross_entropy(out, y)


# ----------------------------------------------------------------------------- modes
def nonprivate(model: nn.Module, tokens: bool, data: tuple[Tensor, Tensor], B: int) -> Callable[[], None]:
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = data

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_of(model(x), y, tokens).backward()
        opt.step()

    return step


def ldp(prefetch: bool) -> Callable[..., Callable[[], None]]:
    def make(model: nn.Module, tokens: bool, data: tuple[Tensor, Tensor], B: int) -> Callable[[], None]:
        from lightning_dp.privacy.noise import GaussianNoise
        from lightning_dp.privacy.private_step import PrivateStep

        opt = torch.optim.Adam(model.parameters(), lr=LR)
        try:
            noise = GaussianNoise() if prefetch else GaussianNoise(prefetch=False)  # the default: prefetch="auto"
        except TypeError:  # a version without noise_prefetch (a "before" run): noise drawn at the release
            noise = GaussianNoise()
        step = PrivateStep(SIGMA, CLIP, noise, engine="ghost", sampler_seed=0)
        step.attach(model, opt)
        x, y = data
        draw, batch = drawn_batches(step, x, y, B)
        step.verify(lambda batch: loss_of(model(batch[0]), batch[1], tokens))

        def run() -> None:
            bx, by = batch()
            opt.zero_grad(set_to_none=True)
            step.begin()
            loss_of(model(bx), by, tokens).backward()
            step.release(optimizer=opt)
            opt.step()

        run.prepare = draw  # type: ignore[attr-defined]
        return run

    return make


def drawn_batches(step: Any, x: Tensor, y: Tensor, B: int) -> tuple[Callable[[], None], Callable[[], Any]]:
    """The private step's Poisson loader over exactly the B rows ``x, y`` (q = 1: each pass draws every row, one
    batch of B), as ``(draw, batch)``: ``draw()`` has the loader hand the loop its next batch — a plain loop may only
    release a batch its Poisson loader handed it, once — and is run before the timed step (data loading, which the
    other modes do not time either); ``batch()`` is the batch drawn last."""
    loader = step.poisson_loader(DataLoader(TensorDataset(x, y), batch_size=B))
    held: list[Any] = []

    def draw() -> None:
        held[:] = list(loader)  # one pass: one batch of all B rows

    def batch() -> Any:
        if not held:
            draw()  # a step run without its draw (the first, untimed call)
        return held.pop()

    return draw, batch


def opacus_ghost(model: nn.Module, tokens: bool, data: tuple[Tensor, Tensor], B: int) -> Callable[[], None]:
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    gsm = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="mean", max_grad_norm=CLIP,
                                               use_ghost_clipping=True)
    opt = DPOptimizerFastGradientClipping(torch.optim.Adam(gsm.parameters(), lr=LR), noise_multiplier=SIGMA,
                                          max_grad_norm=CLIP, expected_batch_size=B, loss_reduction="mean")
    criterion = DPLossFastGradientClipping(gsm, opt, nn.CrossEntropyLoss(), "mean")
    x, y = data

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = gsm(x)
        loss = (criterion(out.reshape(-1, out.shape[-1]), y.reshape(-1), shape=out.shape) if tokens
                else criterion(out, y))
        loss.backward()
        opt.step()

    return step


def opacus_hooks(model: nn.Module, tokens: bool, data: tuple[Tensor, Tensor], B: int) -> Callable[[], None]:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean")
    opt = DPOptimizer(torch.optim.Adam(gsm.parameters(), lr=LR), noise_multiplier=SIGMA, max_grad_norm=CLIP,
                      expected_batch_size=B)
    x, y = data

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_of(gsm(x), y, tokens).backward()
        opt.step()

    return step


BUILDERS: dict[str, Callable[..., Callable[[], None]]] = {
    "nonprivate": nonprivate, "ldp": ldp(True), "ldp_sync": ldp(False), "opacus_ghost": opacus_ghost,
    "opacus_hooks": opacus_hooks,
}


def measure(name: str, B: int, modes: list[str], rounds: int, warmup: int,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Interleaved rounds of every mode (this process); medians and paired ratios to ``nonprivate``. ``clock``: wall
    time, or this thread's CPU time (``--cpu``)."""
    steps: dict[str, Callable[[], None]] = {}
    errors: dict[str, str] = {}
    for mode in modes:
        model, tokens, data = build(name, B)
        try:
            steps[mode] = BUILDERS[mode](model, tokens, data, B)
            steps[mode]()
        except Exception as err:  # noqa: BLE001  (reported in the table)
            errors[mode] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
            steps.pop(mode, None)
    times: dict[str, list[float]] = {m: [] for m in steps}
    order = random.Random(0)
    for i in range(warmup + rounds):
        modes_now = list(steps)
        order.shuffle(modes_now)  # no mode always runs right after another (position in the round biases by ~5 %)
        for mode in modes_now:
            prepare = getattr(steps[mode], "prepare", None)
            if prepare is not None:
                prepare()
            t0 = clock()
            steps[mode]()
            if i >= warmup:
                times[mode].append((clock() - t0) * 1e3)
    base = times.get("nonprivate")
    out: dict[str, Any] = {"errors": errors, "ms": {m: statistics.median(v) for m, v in times.items()}}
    if base:
        out["ratio"] = {m: statistics.median(a / b for a, b in zip(v, base)) for m, v in times.items()}
        out["ratio_iqr"] = {m: _quartiles([a / b for a, b in zip(v, base)]) for m, v in times.items()}
    if "ldp" in times:
        out["vs_ldp"] = {m: statistics.median(a / b for a, b in zip(v, times["ldp"])) for m, v in times.items()}
    return out


def _quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    name, B = args.child.split(":")
    print(json.dumps(measure(name, int(B), args.modes.split(","), args.rounds, args.warmup,
                             time.thread_time if args.cpu else time.perf_counter)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default="64,512")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="time the main thread's CPU time, not the wall clock (1 thread; "
                    "the ldp mode's noise drawn ahead on another thread is then not counted: read ldp_sync)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.threads = int(args.threads)
        child(args)
        return
    modes = args.modes.split(",")
    print(f"| model | B | threads | non-private ms | " + " | ".join(f"{m} (x non-private)" for m in modes[1:])
          + " | Opacus ghost / ldp |")
    print("|" + "---|" * (5 + len(modes)))
    for threads in args.threads.split(","):
        for B in args.batches.split(","):
            for name in args.models.split(","):
                cmd = [sys.executable, __file__, "--child", f"{name}:{B}", "--threads", threads, "--modes", args.modes,
                       "--rounds", str(args.rounds), "--warmup", str(args.warmup), *(["--cpu"] if args.cpu else [])]
                env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONWARNINGS": "ignore"}
                res = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if res.returncode != 0:
                    print(f"| {name} | {B} | {threads} | error: {(res.stderr.strip().splitlines() or ['?'])[-1][:100]} |")
                    continue
                r = json.loads(res.stdout.strip().splitlines()[-1])
                cells = []
                for m in modes[1:]:
                    if m in r["errors"]:
                        cells.append(f"n/a ({r['errors'][m][:40]})")
                    else:
                        lo, hi = r["ratio_iqr"][m]
                        cells.append(f"{r['ms'][m]:.1f} ms ({r['ratio'][m]:.2f}x, IQR {lo:.2f}-{hi:.2f})")
                speedup = r.get("vs_ldp", {}).get("opacus_ghost")
                print(f"| {name} | {B} | {threads} | {r['ms'].get('nonprivate', float('nan')):.1f} | " + " | ".join(cells)
                      + (f" | {speedup:.2f}x |" if speedup else " | n/a |"), flush=True)


if __name__ == "__main__":
    main()
