"""``python -m quotient_manifolds.symbolic [--quick] [--latex] …``: see :mod:`.cli`."""

from .cli import main

raise SystemExit(main())
