"""One prepared run on a GPU: is lightning_dp's private step exact on CUDA, and how fast is it?

a) Exactness. For a spread of the adversarial zoo (tests/zoo/zoo.py, the cases tests/zoo/test_zoo.py asserts
   exact) and the real model families of tests/zoo/test_real_models.py, one private step (DPStrategy, zero noise,
   q = 1, SGD lr = 1, float64) runs on the device through the tests' own harness (``zoo.private_step``, a Trainer
   with ``accelerator='gpu'``) and is compared with ``zoo.reference_update``, the per-example loop on the CPU.
   Each engine the CPU tests assert ('auto', 'ghost', 'vmap'; the real models: 'auto') is run once; a
   PrivacyConfigurationError/ValueError is recorded as REFUSED. One line per run: case, engine asked, engine
   picked, max relative error, PASS/FAIL/REFUSED/ERROR, seconds. Runs go engine by engine ('auto' for every case
   first), so a spent time budget (``--exact-budget``) drops only the later engines.
b) Speed. benchmarks/real_models.py's float32 steps (non-private vs private with the engine 'auto' picks) on the
   device, at GPU sizes (``--batch``/``--seq``/``--hidden``/``--vocab``), ``torch.cuda.synchronize()`` around each
   step, median of ``--steps`` after ``--warmup`` warm-up steps; a table with the private/non-private ratio.

Everything printed also goes to $OUT/gpu_check.log when OUT is set, and the results to $OUT/gpu_check.json (both
rewritten after every run, so a run cut short still leaves what it did). Run by hand from the repository root:

    PYTHONPATH=. python benchmarks/gpu_check.py                       # cuda when available, else cpu
    PYTHONPATH=. python benchmarks/gpu_check.py --quick               # a few cases and models, short timings
    PYTHONPATH=. python benchmarks/gpu_check.py --cpu-smoke           # the whole path on the CPU, tiny sizes
    PYTHONPATH=. python benchmarks/gpu_check.py --parts speed --models gpt2,lstm --batch 128

Needs pytest (the zoo's harness imports tests/conftest.py) and, for the real models, transformers and peft.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import logging
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

T0 = time.perf_counter()  # before torch's import: --deadline counts from here
ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT / "benchmarks", ROOT / "tests" / "zoo", ROOT / "tests", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402
from torch.utils.data._utils.collate import default_collate  # noqa: E402

import zoo  # noqa: E402  (tests/zoo/zoo.py; imports lightning_dp)

ENGINES = ("auto", "ghost", "vmap")
C = 0.3


def past(deadline_s: float) -> bool:
    """More than ``deadline_s`` seconds since the script started: start nothing new."""
    return time.perf_counter() - T0 > deadline_s


# ---------------------------------------------------------------- output
class Report:
    """Prints, mirrors every line to $OUT/gpu_check.log and keeps the JSON results in $OUT/gpu_check.json."""

    def __init__(self, out_dir: Optional[str]) -> None:
        self.out = Path(out_dir) if out_dir else None
        self.results: dict[str, Any] = {"env": {}, "exact": [], "speed": [], "notes": []}
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "gpu_check.log").write_text("")

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        if self.out:
            with open(self.out / "gpu_check.log", "a") as f:
                f.write(line + "\n")

    def save(self) -> None:
        if self.out:
            tmp = self.out / "gpu_check.json.tmp"
            tmp.write_text(json.dumps(self.results, indent=1, default=str))
            tmp.replace(self.out / "gpu_check.json")


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def versions() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cudnn"] = torch.backends.cudnn.version()
        env["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    for name, dist in (("pytorch_lightning", "pytorch-lightning"), ("lightning", "lightning"),
                       ("transformers", "transformers"), ("peft", "peft"), ("opacus", "opacus"),
                       ("dp_accounting", "dp-accounting"), ("numpy", "numpy")):
        try:
            __import__(name)
            env[name] = importlib.metadata.version(dist)
        except Exception as err:  # noqa: BLE001 - a missing package is a finding, not a crash
            env[name] = f"missing ({first_line(err)})"
    return env


def quiet_logs() -> None:
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric", "lightning_dp",
                 "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


# ---------------------------------------------------------------- exactness cases
@dataclass
class Case:
    """One model of the zoo or a real family: how to build it and its data, and the engines its CPU test asserts."""

    name: str
    factory: Callable[[], nn.Module]
    data: Callable[[], TensorDataset]
    engines: tuple[str, ...] = ENGINES
    collate: Optional[Callable] = None
    physical: Optional[int] = None
    rtol: float = 1e-6
    atol: float = 1e-9
    prepare: Optional[Callable[[nn.Module], None]] = None
    reference_collate: Optional[Callable] = None
    quick: bool = False


def _pad() -> TensorDataset:
    return zoo.token_data(pad=True)


def _batch_norm_eval(model: nn.Module) -> None:
    model.norm.eval()  # type: ignore[union-attr]


def _twice(examples: list) -> Any:
    """test_zoo's reference for TokensAfterBatchNorm: each example run twice in a batch of two."""
    return default_collate(examples * 2)


def zoo_cases() -> list[Case]:
    """The zoo models test_zoo.py asserts exact (engines as there; 'auto' added)."""
    Z, tok, vec = zoo, zoo.token_data, zoo.vector_data
    return [
        Case("plain", Z.Plain, vec, quick=True),
        Case("per-example-token-mean", Z.PerExampleTokenMean, _pad, quick=True),
        Case("flattened-tokens", Z.FlattenedTokens, tok),
        Case("sliced-position-table", Z.SlicedPositionTable, tok),
        Case("broadcast-positions", Z.BroadcastPositions, tok),
        Case("relative-bias", Z.RelativeBias, tok),
        Case("mha-time-major", lambda: Z.TorchAttention(batch_first=False), _pad, quick=True),
        Case("encoder-layer", Z.TorchEncoderLayer, _pad),
        Case("lstm-bf", lambda: Z.TorchRecurrent("LSTM", batch_first=True), _pad, quick=True),
        Case("gru-tm", lambda: Z.TorchRecurrent("GRU", batch_first=False), _pad),
        Case("opacus-dplstm", Z.OpacusLSTM, _pad),
        Case("lstm-h0-expand", lambda: Z.LearnedInitialState("LSTM", "expand"), _pad),
        Case("packed-lstm-2l-bi", lambda: Z.PackedRecurrent("LSTM", on_output=True, num_layers=2,
                                                             bidirectional=True), _pad),
        Case("lstmcell-loop", lambda: Z.CellLoop("LSTMCell"), tok),
        Case("vit-root-tokens", Z.ViTClassifier, tok),
        Case("mae-root-tokens", Z.MAEClassifier, tok),
        Case("functional-qkv", Z.FunctionalQKV, tok),
        Case("moe-rows", Z.MixtureOfExperts, vec),
        Case("moe-tokens-act", lambda: Z.MixtureOfExperts(act=True, tokens=True), vec),
        Case("routed-logits", lambda: Z.RoutedTokens(True), vec),
        Case("bn-tokens-physical1", Z.TokensAfterBatchNorm, Z.image_data, physical=1, prepare=_batch_norm_eval,
             reference_collate=_twice, quick=True),
        Case("coordinate-bias-inplace", lambda: Z.CoordinateBias(True), tok),
        Case("reentrant-checkpoint", Z.ReentrantCheckpoint, vec),
        Case("unused-parameters", Z.UnusedParameters, vec),
        Case("module-tying", Z.ModuleTying, tok, engines=("auto", "vmap")),
        Case("per-frame-conv", Z.PerFrameConv, Z.frame_data),
        Case("bias-by-method", Z.BiasByMethod, tok),
        Case("window-copy", Z.WindowCopy, tok),
        Case("windowed-functional-qkv", Z.WindowedFunctionalQKV, tok),
        Case("pooled-heads", Z.PooledHeads, tok),
        Case("decomposed-rel-pos-mvit", Z.DecomposedRelPos, tok),
        Case("decomposed-rel-pos-sam", lambda: Z.DecomposedRelPos(flattened=True), tok),
        Case("lstm-over-rows", Z.RecurrentOverRows, Z.image_data),
        Case("gru-over-rows-h0", lambda: Z.RecurrentOverRows("GRU", h0=True), Z.image_data),
        Case("router-scatter", lambda: Z.RoutedTokens(scattered=True), vec),
        Case("scaled-norm", Z.ScaledTokens, tok, quick=True),
        Case("scaled-norm-twice", lambda: Z.ScaledTokens("twice"), tok),
        Case("lstm-tm", lambda: Z.TorchRecurrent("LSTM", batch_first=False), _pad),
        Case("lstm-on-features", Z.RecurrentOnFeatures, Z.feature_sequence_data),
        Case("gru-tm-on-features", lambda: Z.RecurrentOnFeatures("GRU", batch_first=False), Z.feature_sequence_data),
        Case("rnn-on-features-h0", lambda: Z.RecurrentOnFeatures("RNN", state=True), Z.feature_sequence_data),
        Case("lstm-output-in-place", lambda: Z.RecurrentOutputInPlace("LSTM", "mul_"), _pad),
        Case("table-without-arguments", Z.TableWithoutArguments, tok),
        Case("parametrized-conv", lambda: Z.Parametrized("conv"), tok),
        Case("parametrized-orthogonal", lambda: Z.Parametrized("orthogonal"), tok),
        Case("time-major-collate-phys4", Z.TimeMajorBatchTransposed, _pad, engines=("auto",),
             collate=Z.time_major_collate, physical=4),
    ]


REAL_QUICK = ("gpt2", "llama-lora")


def real_cases(report: Report) -> list[Case]:
    """tests/zoo/test_real_models.py's families on 'auto' (its builders, its Wrapped/Vision wrappers)."""
    try:
        import test_real_models as trm
    except BaseException as err:  # pytest.importorskip raises Skipped (a BaseException) without transformers/peft
        report.results["notes"].append(f"real models skipped: {first_line(err)}")
        report.say(f"real models skipped: {first_line(err)}")
        return []

    def images() -> TensorDataset:  # test_vision_families_are_exact's data
        g = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(zoo.N, 3, 16, 16, generator=g), torch.randint(0, 2, (zoo.N,), generator=g))

    class MaskedAutoencoder(trm.MaskedAutoencoder):
        """The test's ViTMAE, its fixed masking noise made on the batch's device (the test's is on the CPU)."""

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, _ = batch
            noise = torch.arange(16, dtype=x.dtype, device=x.device).flip(0).expand(x.shape[0], 16)
            return self.m(pixel_values=x, noise=noise).loss

    def wrapped(make: Callable, kind: str) -> Callable[[], nn.Module]:
        return lambda: trm.Wrapped(make, kind)

    cases = [Case(name, wrapped(make, kind), trm._data, engines=("auto",), quick=name in REAL_QUICK,
                  **trm.TOLERANCE.get(name, {})) for name, (make, kind) in trm.CASES.items()]
    cases.append(Case("deberta", wrapped(trm.deberta, "cls"), trm._data, engines=("auto",)))
    for make in (trm.swin, trm.convnext, trm.beit, trm.pvt, trm.swinv2):
        cases.append(Case(make.__name__, (lambda m=make: trm.Vision(m)), images, engines=("auto",)))
    cases.append(Case("vitmae", MaskedAutoencoder, images, engines=("auto",)))
    return cases


# ---------------------------------------------------------------- exactness run
def max_relative_error(got: list[Tensor], want: list[Tensor]) -> float:
    """max |got − want| over every coordinate of the update, relative to max |want|."""
    num = max(((g.cpu() - w.cpu()).abs().max().item() for g, w in zip(got, want) if w.numel()), default=0.0)
    den = max((w.abs().max().item() for w in want if w.numel()), default=0.0)
    return num / den if den > 0 else num


def close(got: list[Tensor], want: list[Tensor], rtol: float, atol: float) -> bool:
    if len(got) != len(want):
        return False
    return all(g.shape == w.shape and bool(((g.cpu() - w.cpu()).abs() <= atol + rtol * w.cpu().abs()).all())
               for g, w in zip(got, want))


def leaked_modes() -> int:
    """Broadcast-site TorchFunctionModes left active (what tests/conftest.py's fixture checks); closes them."""
    from torch.overrides import _get_current_function_mode_stack

    from lightning_dp.grad_sample.capture.broadcast_sites import BroadcastSites

    left = [m for m in _get_current_function_mode_stack() if isinstance(m, BroadcastSites)]
    for mode in reversed(left):
        mode.close()
    return len(left)


def exact_once(case: Case, engine: str, trainer_kwargs: dict[str, Any]) -> dict[str, Any]:
    """One private step of ``case`` on ``engine`` against the CPU per-example loop (as zoo.assert_exact)."""
    from lightning_dp import PrivacyConfigurationError

    row: dict[str, Any] = {"case": case.name, "engine": engine}
    torch.manual_seed(0)
    model = case.factory().double()
    if case.prepare:
        case.prepare(model)
    data = zoo._as_double(case.data())
    reference = zoo.reference_update(copy.deepcopy(model), data, case.reference_collate or case.collate or
                                     default_collate, C, float(len(data)))
    try:
        strategy, update = zoo.private_step(model, data, case.collate, engine, C, case.physical, **trainer_kwargs)
    except (PrivacyConfigurationError, ValueError) as err:
        row.update(status="REFUSED", picked="-", error=first_line(err))
        return row
    row["picked"] = strategy.engine_name
    row["step_device"] = str(strategy.root_device)
    row["model_device_after_fit"] = str(next(model.parameters()).device)
    row["max_rel_err"] = max_relative_error(update, reference)
    row["status"] = "PASS" if close(update, reference, case.rtol, case.atol) else "FAIL"
    return row


def run_exact(cases: list[Case], engines: tuple[str, ...], trainer_kwargs: dict[str, Any], budget_s: float,
              deadline_s: float, report: Report) -> None:
    report.say(f"== a) exactness: float64, zero noise, q = 1, C = {C}, "
               f"accelerator={trainer_kwargs['accelerator']}; reference: per-example loop on the CPU")
    report.say(f"{'case':26s} {'engine':>6s} {'picked':>14s} {'max rel err':>11s} {'verdict':>7s} {'s':>6s}")
    start = time.perf_counter()
    for engine in engines:
        for case in (c for c in cases if engine in c.engines):
            if time.perf_counter() - start > budget_s or past(deadline_s):
                report.results["exact"].append({"case": case.name, "engine": engine, "status": "SKIPPED"})
                continue
            report.results["exact"].append(exact_row(case, engine, trainer_kwargs, report))
            report.save()
    counts = {s: sum(r["status"] == s for r in report.results["exact"])
              for s in ("PASS", "FAIL", "REFUSED", "ERROR", "SKIPPED")}
    report.say(f"exactness: {counts} in {time.perf_counter() - start:.0f} s"
               + (" (SKIPPED: --exact-budget or --deadline spent)" if counts["SKIPPED"] else ""))


def exact_row(case: Case, engine: str, trainer_kwargs: dict[str, Any], report: Report) -> dict[str, Any]:
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            row = exact_once(case, engine, trainer_kwargs)
        except Exception as err:  # noqa: BLE001 - one failure must not stop the run
            row = {"case": case.name, "engine": engine, "picked": "-", "status": "ERROR", "error": first_line(err),
                   "traceback": traceback.format_exc()[-3000:]}
    row["seconds"] = round(time.perf_counter() - t0, 2)
    if leaked := leaked_modes():
        row["status"], row["leaked_modes"] = "FAIL", leaked
    messages = sorted({str(w.message).splitlines()[0][:200] for w in caught if "lightning_dp" in str(w.filename)})
    if messages:
        row["warnings"] = messages[:5]
    err = f"{row.get('max_rel_err', float('nan')):11.1e}" if "max_rel_err" in row else f"{'-':>11s}"
    tail = f"  {row['error']}" if "error" in row else ""
    report.say(f"{case.name:26s} {engine:>6s} {row.get('picked', '-'):>14s} {err} {row['status']:>7s} "
               f"{row['seconds']:6.1f}{tail}")
    return row


# ---------------------------------------------------------------- speed
def run_speed(args: argparse.Namespace, device: str, report: Report) -> None:
    import real_models  # benchmarks/real_models.py

    real_models.configure(args.batch, args.seq, args.hidden, args.vocab)
    table = {**real_models.models(), **real_models.OPT_IN}
    names = [n for n in args.models.split(",") if n]
    report.say(f"== b) speed on {device}: float32, batch {args.batch}, T {args.seq}, hidden {args.hidden}, "
               f"vocab {args.vocab}; median ms/step of {args.steps} after {args.warmup} warm-up (interleaved)")
    report.say(f"{'model':14s} {'engine':>8s} {'non-private':>12s} {'private':>9s} {'ratio':>6s} {'s':>6s}")
    start = time.perf_counter()
    for name in names:
        row: dict[str, Any] = {"model": name}
        if name not in table:
            row.update(status="ERROR", error="unknown model (transformers/peft missing?)")
        elif time.perf_counter() - start > args.speed_budget or past(args.deadline):
            row.update(status="SKIPPED")
        else:
            row.update(speed_row(real_models, table[name], name, args, device))
        report.results["speed"].append(row)
        report.save()
        if row["status"] == "OK":
            report.say(f"{name:14s} {row['engine']:>8s} {row['nonprivate_ms']:12.2f} {row['private_ms']:9.2f} "
                       f"{row['ratio']:6.2f} {row['seconds']:6.1f}")
        else:
            report.say(f"{name:14s} {row['status']}  {row.get('error', '')}")
    ok = [r["ratio"] for r in report.results["speed"] if r["status"] == "OK"]
    if ok:
        report.say(f"speed: median ratio {statistics.median(ok):.2f} over {len(ok)} models in "
                   f"{time.perf_counter() - start:.0f} s")


def speed_row(real_models: Any, make: Callable[[], nn.Module], name: str, args: argparse.Namespace,
              device: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        engine, base, priv = real_models.measure(name, make, args.steps, device=device, warmup=args.warmup)
    except Exception as err:  # noqa: BLE001
        return {"status": "ERROR", "error": first_line(err), "traceback": traceback.format_exc()[-3000:],
                "seconds": round(time.perf_counter() - t0, 2)}
    row = {"status": "OK", "engine": engine, "nonprivate_ms": base, "private_ms": priv, "ratio": priv / base,
           "seconds": round(time.perf_counter() - t0, 2)}
    if torch.device(device).type == "cuda":
        row["max_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    return row


# ---------------------------------------------------------------- main
SPEED_MODELS = "gpt2,bert,llama,llama-lora,t5,vit,torch-encoder,gru,lstm,lstm-packed"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--parts", default="exact,speed", help="comma-separated: exact, speed")
    p.add_argument("--quick", action="store_true", help="a few cases per part, short timings")
    p.add_argument("--cpu-smoke", action="store_true", help="the whole path on the CPU: --quick, tiny sizes")
    p.add_argument("--cases", default="", help="comma-separated substrings of case names to run (default: all)")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--exact-budget", type=float, default=150.0, help="seconds; later runs are SKIPPED")
    p.add_argument("--models", default=SPEED_MODELS, help="benchmarks/real_models.py names")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--speed-budget", type=float, default=120.0, help="seconds; later models are SKIPPED")
    p.add_argument("--deadline", type=float, default=290.0,
                   help="seconds from the start after which no case or model starts (default 290)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.device, args.quick = "cpu", True
        args.batch, args.seq, args.hidden, args.vocab = 4, 16, 32, 64
    if args.quick:
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
        if args.models == SPEED_MODELS:
            args.models = "gpt2,llama-lora,torch-encoder,lstm"
    return args


def select(cases: list[Case], args: argparse.Namespace) -> list[Case]:
    if args.cases:
        wanted = [w for w in args.cases.split(",") if w]
        return [c for c in cases if any(w in c.name for w in wanted)]
    return [c for c in cases if c.quick] if args.quick else cases


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    report = Report(os.environ.get("OUT"))
    if args.threads:
        torch.set_num_threads(args.threads)
    report.results["env"] = {**versions(), "args": vars(args)}
    quiet_logs()  # after versions(): importing lightning resets its loggers
    report.say("gpu_check: " + ", ".join(f"{k}={v}" for k, v in report.results["env"].items() if k != "args"))
    report.save()
    if torch.device(args.device).type == "cuda":
        if not torch.cuda.is_available():
            report.say("--device cuda but torch.cuda.is_available() is False")
            return 2
        torch.zeros(1, device=args.device).add_(1).item()  # CUDA context outside the first case's time
    parts = args.parts.split(",")
    if "exact" in parts:
        accelerator = "gpu" if torch.device(args.device).type == "cuda" else "cpu"
        cases = select(zoo_cases() + real_cases(report), args)
        engines = tuple(e for e in args.engines.split(",") if e)
        run_exact(cases, engines, {"accelerator": accelerator, "devices": 1}, args.exact_budget, args.deadline,
                  report)
    if "speed" in parts:
        run_speed(args, args.device, report)
    bad = [r for r in report.results["exact"] if r["status"] in ("FAIL", "ERROR", "REFUSED")]
    bad += [r for r in report.results["speed"] if r["status"] == "ERROR"]
    report.results["summary"] = {"bad": len(bad), "seconds": round(time.perf_counter() - T0, 1)}
    report.save()
    report.say(f"gpu_check done in {time.perf_counter() - T0:.0f} s: {len(bad)} FAIL/ERROR/REFUSED "
               "(every case here is exact on the CPU tests)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
