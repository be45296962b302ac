"""``quotient-manifolds``: the command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    import torch

    from .demo import format_facts, geometry_facts

    torch.set_num_threads(1)
    text = format_facts(geometry_facts(args.n, args.m, args.h, args.seed))
    print(text)
    return 0 if text.endswith("all facts hold") else 1


def _verify(args: argparse.Namespace) -> int:
    from .symbolic import main as verify_main

    return verify_main(args.rest)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quotient-manifolds", description=__doc__)
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
    args, rest = parser.parse_known_args(argv)
    if args.command == "verify":
        args.rest = rest  # options belong to ``python -m quotient_manifolds.symbolic``
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
