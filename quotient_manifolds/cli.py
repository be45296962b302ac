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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quotient-manifolds", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="measure the geometry facts on a random GL(h) block")
    demo.add_argument("--n", type=int, default=4)
    demo.add_argument("--m", type=int, default=3)
    demo.add_argument("--h", type=int, default=2)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
