"""``python -m quotient_manifolds``: the command line."""

from .cli import main

raise SystemExit(main())
