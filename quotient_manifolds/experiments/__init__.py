"""Reproductions of the paper's experiments and transformer populations.

Top layer: imports `quotient_manifolds.sharpness` and below, never the reverse.
"""

from .report import scatter_figure, summarize, tau_table
from .stats import granulated_tau, kendall_tau
from .store import PopulationStore, atomic_write_text, protocol_hash

__all__ = [
    "PopulationStore",
    "atomic_write_text",
    "granulated_tau",
    "kendall_tau",
    "protocol_hash",
    "scatter_figure",
    "summarize",
    "tau_table",
]
