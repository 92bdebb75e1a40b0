"""``lightning-dp audit``: train a config once with canaries and check its ε claim from outside.

    lightning-dp audit --config configs/digits.yaml --canaries 200 --confidence 0.95 [--max-epochs N]
    lightning-dp audit --config configs/audit_digits.yaml --kind gradient

Prints the empirical ε lower bound (Steinke, Nasr & Jagielski 2023; docs/algorithms.md §8)
next to the accountant's ε for the same run. Exit status: 0 when the lower bound is at
most the claimed ε, 1 when it exceeds it (the implementation leaks more than claimed),
2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

#: canary kinds of :func:`lightning_dp.audit.runner.run_audit` (its ``KINDS``; a test keeps them equal). Not
#: imported from there: the runner loads torch and Lightning, which ``lightning-dp audit --help`` does not need.
KINDS = ("input", "gradient")


def run_audit(*args: Any, **kwargs: Any) -> Any:
    """:func:`lightning_dp.audit.runner.run_audit`, imported on first call (it loads torch and Lightning)."""
    from lightning_dp.audit.runner import run_audit as run

    return run(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The ``audit`` subcommand's argument parser."""
    p = argparse.ArgumentParser(prog="lightning-dp audit", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True,
                   help="a `lightning-dp fit` YAML (model, data, trainer.strategy: DPStrategy)")
    p.add_argument("--canaries", "-m", type=int, default=200, help="number of canaries m (default: %(default)s)")
    p.add_argument("--confidence", type=float, default=0.95,
                   help="confidence of the lower bound (default: %(default)s)")
    p.add_argument("--max-epochs", type=int, help="override trainer.max_epochs (the claim follows the run)")
    p.add_argument("--kind", choices=KINDS, default="input",
                   help="input-space canaries (any classifier) or white-box Dirac gradient canaries "
                   "(default: %(default)s)")
    p.add_argument("--delta", type=float, help="δ of both numbers (default: the config's privacy_delta)")
    p.add_argument("--seed", type=int, help="canary/coin seed (default: from the OS; printed)")
    p.add_argument("--amplitude", type=float, default=1.0, help="input-canary pixel magnitude (default: %(default)s)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``lightning-dp audit``; 0 = consistent, 1 = lower bound exceeds the claimed ε, 2 = bad input."""
    args = build_parser().parse_args(argv)
    if args.canaries < 2:
        print("lightning-dp audit: error: --canaries must be at least 2", file=sys.stderr)
        return 2
    try:
        result = run_audit(
            args.config, canaries=args.canaries, kind=args.kind, confidence=args.confidence, delta=args.delta,
            max_epochs=args.max_epochs, seed=args.seed, amplitude=args.amplitude,
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"lightning-dp audit: error: {err}", file=sys.stderr)
        return 2
    print(result.summary())
    return 1 if result.violated else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
