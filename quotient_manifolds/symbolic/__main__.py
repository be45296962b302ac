"""``python -m quotient_manifolds.symbolic [--quick] [--latex] …``: see
[`cli`][quotient_manifolds.symbolic.cli]."""

from .cli import main

raise SystemExit(main())
