r"""Rank correlation with uncertainty: Kendall τ, bootstrap CI and p-value.

The paper's claim is a table of Kendall τ between a sharpness measure and the
generalisation gap (paper §5, Table 1; Jiang et al. 2020). τ is ``scipy.stats.kendalltau``
(τ-b, ties handled); the p-value is its two-sided test of τ = 0; the 95 % interval is
the percentile bootstrap over members (pairs resampled with replacement).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import InvalidArgumentError

__all__ = ["check_n_boot", "conditional_tau", "discretize", "granulated", "granulated_tau",
           "kendall_tau"]


def check_n_boot(n_boot: object) -> int:
    """`n_boot`, the number of bootstrap resamples, if it is an integer from 1.

    Raises
    ------
    InvalidArgumentError
        Naming `n_boot` and the accepted values (0 resamples give no interval, only NaN).
    """
    if not isinstance(n_boot, numbers.Integral) or isinstance(n_boot, bool) or n_boot < 1:
        raise InvalidArgumentError(
            f"n_boot={n_boot!r} must be a positive integer (bootstrap resamples), e.g. "
            "n_boot=2000")
    return int(n_boot)


def kendall_tau(
    x: Sequence[float],
    y: Sequence[float],
    *,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> dict:
    r"""Kendall τ-b of ``x`` against ``y`` with a percentile-bootstrap interval.

    Parameters
    ----------
    x, y : sequence of float
        Paired values, one per population member; pairs with a non-finite entry
        are dropped (their number is reported as ``n_dropped``).
    n_boot : int
        Bootstrap resamples of the members, 1 or more.
    seed : int
        Seed of the resampling (results are reproducible).
    level : float
        Coverage of the interval.

    Returns
    -------
    dict
        ``{"tau", "ci95": [lo, hi], "p_value", "n", "n_dropped"}``; ``tau`` is NaN
        when fewer than 3 finite pairs remain or one side is constant.

    Raises
    ------
    InvalidArgumentError
        `n_boot` is not an integer from 1, or `level` is not in (0, 1).
    """
    from scipy.stats import kendalltau

    n_boot = check_n_boot(n_boot)
    if not 0 < level < 1:
        raise InvalidArgumentError(f"level={level!r} must be in (0, 1), e.g. level=0.95")

    xa = np.asarray(x, dtype=float)
    ya = np.asarray(y, dtype=float)
    if xa.shape != ya.shape or xa.ndim != 1:
        raise ValueError(f"x and y must be 1-D of equal length, got {xa.shape} and {ya.shape}")
    ok = np.isfinite(xa) & np.isfinite(ya)
    xa, ya = xa[ok], ya[ok]
    n = int(xa.size)
    out = {"tau": math.nan, "ci95": [math.nan, math.nan], "p_value": math.nan, "n": n,
           "n_dropped": int((~ok).sum())}
    if n < 3 or np.ptp(xa) == 0 or np.ptp(ya) == 0:
        return out
    res = kendalltau(xa, ya)
    out["tau"], out["p_value"] = float(res.statistic), float(res.pvalue)
    rng = np.random.default_rng(seed)
    taus = _bootstrap_taus(xa, ya, [rng.integers(0, n, n) for _ in range(n_boot)])
    if taus:
        a = (1 - level) / 2
        lo, hi = np.quantile(taus, [a, 1 - a])
        out["ci95"] = [float(lo), float(hi)]
    return out


def _bootstrap_taus(xa: np.ndarray, ya: np.ndarray, draws: list[np.ndarray]) -> list[float]:
    r"""τ-b of every resample ``(xa[i], ya[i])``, vectorised; equal to ``kendalltau``'s.

    With pair signs $S^x_{ab} = \operatorname{sign}(x_a - x_b)$, τ-b is
    $Σ_{a<b} S^x S^y / √((n_{0} - n_x)(n_{0} - n_y))$, ``n₀ = n(n−1)/2`` and ``n_x`` the
    pairs tied in x (repeated members of a resample are ties).  NaN (dropped) when a
    side is constant.  ~100× faster than calling ``scipy.stats.kendalltau`` per resample.
    """
    if not draws:
        return []
    sx = np.sign(xa[:, None] - xa[None, :])
    sy = np.sign(ya[:, None] - ya[None, :])
    out: list[float] = []
    for chunk in range(0, len(draws), 256):
        idx = np.stack(draws[chunk:chunk + 256])  # (b, n)
        bx = sx[idx[:, :, None], idx[:, None, :]]
        by = sy[idx[:, :, None], idx[:, None, :]]
        conc = 0.5 * (bx * by).sum((1, 2))
        m = idx.shape[1]
        n0 = m * (m - 1) / 2
        nx = n0 - 0.5 * np.abs(bx).sum((1, 2))
        ny = n0 - 0.5 * np.abs(by).sum((1, 2))
        den = np.sqrt((n0 - nx) * (n0 - ny))
        with np.errstate(invalid="ignore", divide="ignore"):
            t = np.where(den > 0, conc / np.where(den > 0, den, 1.0), np.nan)
        out.extend(float(v) for v in np.clip(t, -1.0, 1.0) if np.isfinite(v))
    return out


def granulated_tau(
    x: Sequence[float], y: Sequence[float], groups: Sequence[Sequence]
) -> float:
    r"""Granulated τ of Jiang et al. (2020) for one hyperparameter.

    ``groups[i]`` is the tuple of the *other* hyperparameters of member ``i``; τ is
    computed inside every group with at least 3 members (only the studied
    hyperparameter varies there) and averaged. NaN if no group qualifies.
    """
    from scipy.stats import kendalltau

    xa, ya = np.asarray(x, float), np.asarray(y, float)
    buckets: dict = {}
    for i, g in enumerate(groups):
        buckets.setdefault(tuple(g), []).append(i)
    taus = []
    for idx in buckets.values():
        if len(idx) >= 3:
            t = kendalltau(xa[idx], ya[idx]).statistic
            if np.isfinite(t):
                taus.append(float(t))
    return float(np.mean(taus)) if taus else math.nan


def discretize(values: Sequence, max_levels: int = 4, bins: int = 3) -> list:
    r"""Levels of one hyperparameter axis for stratification.

    An axis with at most `max_levels` distinct values keeps them; a continuous axis (e.g. a
    log-uniform learning rate) is cut into `bins` equal-count bins of its sorted values
    (level = bin index).
    """
    vals = list(values)
    distinct = sorted(set(vals), key=lambda v: (str(type(v)), v))
    if len(distinct) <= max_levels:
        return vals
    order = np.argsort(np.asarray(vals, dtype=float), kind="stable")
    level = np.empty(len(vals), dtype=int)
    for b, chunk in enumerate(np.array_split(order, bins)):
        level[chunk] = b
    return level.tolist()


def granulated(
    x: Sequence[float],
    y: Sequence[float],
    hypers: Sequence[Mapping],
    *,
    axes: Sequence[str] | None = None,
    ids: Sequence[str] | None = None,
    min_group: int = 2,
) -> dict:
    r"""Granulated τ of Jiang et al. (2020): per hyperparameter, τ among members that differ
    only in it, averaged.

    For an axis $i$ the members are grouped by the exact values of every *other*
    hyperparameter (every key of `hypers`, the seed included); a group of at least
    `min_group` members with finite `x` and `y` in which axis $i$ takes at least two values
    is a group of axis $i$. With $\tau_g$ the Kendall τ-b of `x` against `y` inside group
    $g$ and $m_i$ the number of groups whose $\tau_g$ is defined (a group in which `x` or
    `y` is constant has none),

    $$
    \psi_i = \frac{1}{m_i} \sum_{g} \tau_g, \qquad
    \Psi = \frac{1}{|A|} \sum_{i \in A} \psi_i ,
    $$

    $A$ being the axes of `axes` (default: every key) whose $\psi_i$ exists. A
    one-factor-at-a-time design
    ([`ofat_design`][quotient_manifolds.experiments.finetune.ofat_design]) makes the groups
    of axis $i$ exactly the bases with their alternates along $i$; independently sampled
    hyperparameters make none ($\psi_i$ NaN, 0 groups).

    Parameters
    ----------
    x, y : sequence of float
        The measure and the gap, one per member.
    hypers : sequence of mapping
        Every member's hyperparameters, seed included.
    axes : sequence of str, optional
        The axes to report (default: the union of the keys of `hypers`).
    ids : sequence of str, optional
        Member names used in the report (default: the indices).
    min_group : int
        Smallest group.

    Returns
    -------
    dict
        `{"psi": Ψ, "n_axes": |A|, "axes": {axis: {"tau": ψ_i, "n_groups": m_i,
        "n_members": members in those groups, "groups": [{"members", "values", "tau"}]}}}`;
        `groups` lists every group, those without a τ too (`tau` NaN).
    """
    from scipy.stats import kendalltau

    xa, ya = np.asarray(x, float), np.asarray(y, float)
    if not (len(xa) == len(ya) == len(hypers)):
        raise ValueError(f"x, y and hypers must have one entry per member, got {len(xa)}, "
                         f"{len(ya)} and {len(hypers)}")
    names = [str(i) for i in range(len(hypers))] if ids is None else [str(i) for i in ids]
    keys = sorted({k for h in hypers for k in h})
    axes = keys if axes is None else list(axes)
    finite = [i for i in range(len(hypers)) if np.isfinite(xa[i]) and np.isfinite(ya[i])]
    out: dict = {"axes": {}}
    for a in axes:
        others = [k for k in keys if k != a]
        buckets: dict = {}
        for i in finite:
            key = tuple((k, _hashable(hypers[i].get(k))) for k in others)
            buckets.setdefault(key, []).append(i)
        groups, taus, used = [], [], 0
        for idx in buckets.values():
            vals = [hypers[i].get(a) for i in idx]
            if len(idx) < min_group or len({_hashable(v) for v in vals}) < 2:
                continue
            t = float(kendalltau(xa[idx], ya[idx]).statistic)
            groups.append({"members": [names[i] for i in idx], "values": vals, "tau": t})
            if math.isfinite(t):
                taus.append(t)
                used += len(idx)
        out["axes"][a] = {"tau": float(np.mean(taus)) if taus else math.nan,
                          "n_groups": len(taus), "n_members": used, "groups": groups}
    psis = [d["tau"] for d in out["axes"].values() if math.isfinite(d["tau"])]
    out["psi"] = float(np.mean(psis)) if psis else math.nan
    out["n_axes"] = len(psis)
    return out


def _hashable(v: object) -> object:
    """A hyperparameter value as a dict key (lists become tuples)."""
    return tuple(v) if isinstance(v, list) else v


def conditional_tau(x: Sequence[float], y: Sequence[float], strata: Sequence) -> dict:
    r"""τ of `x` against `y` within the strata of one hyperparameter, pooled.

    Pairs of members in the same stratum only (levels of `discretize`): τ-b of the pooled
    within-stratum pairs, $\sum_s C_s - D_s$ over $\sqrt{(\sum_s n^x_s)(\sum_s n^y_s)}$
    (untied pairs per side). It removes the part of the rank agreement that comes from the
    stratifying hyperparameter.

    Returns
    -------
    dict
        `{"tau": float, "n_pairs": int, "n_strata": int}`.
    """
    xa, ya = np.asarray(x, float), np.asarray(y, float)
    lev = discretize(list(strata))
    conc = nx = ny = 0.0
    pairs, groups = 0, set()
    for s in {str(v) for v in lev}:
        idx = [i for i, v in enumerate(lev) if str(v) == s
               and np.isfinite(xa[i]) and np.isfinite(ya[i])]
        if len(idx) < 2:
            continue
        groups.add(s)
        sx = np.sign(xa[idx][:, None] - xa[idx][None, :])
        sy = np.sign(ya[idx][:, None] - ya[idx][None, :])
        iu = np.triu_indices(len(idx), 1)
        conc += float((sx * sy)[iu].sum())
        nx += float(np.abs(sx)[iu].sum())
        ny += float(np.abs(sy)[iu].sum())
        pairs += len(iu[0])
    tau = conc / math.sqrt(nx * ny) if nx > 0 and ny > 0 else math.nan
    return {"tau": tau, "n_pairs": pairs, "n_strata": len(groups)}
