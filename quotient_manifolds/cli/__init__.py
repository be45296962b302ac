"""``quotient-manifolds``: the command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}; see {self.prog} "
                     "--help\n")


def _demo(args: argparse.Namespace) -> int:
    import torch

    from .demo import format_facts, geometry_facts

    torch.set_num_threads(1)
    text = format_facts(geometry_facts(args.n, args.m, args.h, args.seed))
    print(text)
    return 0 if text.endswith("all facts hold") else 1


def _verify(args: argparse.Namespace) -> int:
    from ..symbolic import main as verify_main

    return verify_main(args.rest)


def _reproduce(args: argparse.Namespace) -> int:
    import torch

    from ..errors import MissingDependencyError
    from ..experiments.registry import ExperimentUnavailableError, combined_table, run_experiments

    torch.set_num_threads(1)
    try:
        results = run_experiments([args.experiment], args.out, quick=args.quick, progress=True,
                                  weights=args.weights)
    except (ExperimentUnavailableError, MissingDependencyError, ValueError) as e:
        print(f"quotient-manifolds reproduce: error: {e}", file=sys.stderr)
        return 2
    print(combined_table(results))
    for name, res in results.items():
        print(f"{name}: {args.out}/{name}/results.json ({res['wall_s']:.1f} s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="quotient-manifolds", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="measure the geometry facts on a random GL(h) block")
    demo.add_argument("--n", type=int, default=4)
    demo.add_argument("--m", type=int, default=3)
    demo.add_argument("--h", type=int, default=2)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    verify = sub.add_parser(
        "verify",
        help="prove the closed forms from the metrics with SymPy (options: --quick, --list, -k, "
        "--markdown, --latex)",
        add_help=False,
    )
    verify.set_defaults(func=_verify)
    from ..experiments.registry import EXPERIMENTS

    reproduce = sub.add_parser(
        "reproduce", help="run a paper experiment or population and print its tau table"
    )
    reproduce.add_argument("experiment", choices=[*EXPERIMENTS, "all"])
    reproduce.add_argument("--out", required=True, help="output folder (results and caches)")
    reproduce.add_argument("--quick", action="store_true", help="small protocol for CI")
    reproduce.add_argument(
        "--weights", help="populations only: keep the trained weights in this folder and only "
        "the records (JSON, figures) under --out, training and measuring one member at a time")
    reproduce.set_defaults(func=_reproduce)
    from .population import add_subcommands

    add_subcommands(sub)  # sharpness, correlate (docs/cli.md)
    args, rest = parser.parse_known_args(argv)
    if args.command == "verify":
        args.rest = rest  # options belong to ``python -m quotient_manifolds.symbolic``
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
