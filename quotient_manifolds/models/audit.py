r"""The symmetry audit: is every flat direction of the model explained by a claimed symmetry?

A direction $v$ of the parameters is **flat** when the function does not change to first order
along it: $J v = 0$, with $J$ the Jacobian of the model's per-example log-probabilities (or
outputs, or losses) with respect to the parameters, over enough random inputs. Every continuous
symmetry the measure quotients out contributes flat directions, the tangent space of its orbit
at $w$: for a candidate with the action $\theta \mapsto \mathrm{act}_\theta(w)$ (`act_at`), the
columns of $V = \partial_\theta\, \mathrm{act}_\theta(w)|_{\theta = 0}$. So

$$
\dim \ker J \;=\; \underbrace{\operatorname{rank}[\,V \;\; E_U\,]}_{\text{claimed + unused}}
\;+\; \text{unexplained},
$$

where $E_U$ are the coordinate directions of the entries no output reads (columns of $J$ that
are identically zero: embedding rows of tokens no input holds, dead units). A third category is
kept apart from both: **near-flat** directions, the scalings of a norm's input by its writers
(`quotient_manifolds.models.near_flat`), which the audit constructs and
verifies itself (exact at $\varepsilon = 0$, inside the measured kernel at the model's
$\varepsilon$); they are no symmetry, are not claimed by the measure, and are reported with
their norm rather than counted as unexplained. The audit computes
the numbers exactly on small models (a singular value decomposition of $J$ in float64,
with the spectral gap reported) and attributes the unexplained flat directions to parameters.
On large models it runs per module (the symmetries within each module only) and says so.

[`audit`][quotient_manifolds.models.audit.audit] is evaluated at the canonical point of the
claimed folds, where the measure is evaluated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, jacfwd, jacrev

from ..errors import ExampleInputError, UnsupportedModelError
from ..tree import leading_size, tree_map
from .discovery import discover
from .inputs import (
    capture_inputs,
    cast_inputs,
    example_inputs,
    normalize_inputs,
    signature_names,
)
from .near_flat import NearFlat, near_flat
from .precision import float64_copy, float64_internals, no_fastpath
from .prober import Prober, output_tensors
from .records import Symmetries

__all__ = ["AuditReport", "audit"]

_SIGMA_RTOL = 1e-9  # without a gap, a singular value below this fraction of the largest is 0
_GAP_TOP = 1e-5  # a gap counts only below this fraction of the largest singular value
_GAP_MIN = 1e4  # the ratio across a gap that makes the count exact
_DRAW_ROWS = 8  # examples per redrawn input


@dataclass(frozen=True)
class AuditReport:
    """What the audit found.

    Attributes
    ----------
    method : str
        `"exact"` (one Jacobian of all the parameters) or `"per module"` (one per top-level
        module: only the symmetries within a module are seen).
    parameters : int
        Floating-point parameter entries audited.
    outputs : int
        Rows of the Jacobian (outputs times random inputs).
    flat : int
        $\\dim \\ker J$.
    claimed : int
        Rank of the orbit tangents of the claimed symmetries.
    unused : int
        Flat directions not claimed that are entries no output reads.
    unexplained : int
        `flat - rank[claimed, unused, near-flat]`: flat directions no claimed symmetry
        explains.
    violation : float
        $\\max_j \\|J v_j\\| / (\\|J\\|_2 \\|v_j\\|)$ over the claimed orbit tangents (near 0 when
        every claim is flat).
    gap : tuple of float
        The smallest singular value counted as non-zero and the largest counted as zero,
        relative to the largest.
    by_parameter : dict
        Parameter name to its share of the unexplained flat directions (they sum to
        `unexplained`).
    by_kind : dict
        Kind of candidate (`"attention.qk"`, `"norm_gain"`, ...) to the rank of its tangents.
    modules : tuple of AuditReport
        The per-module reports (`method="per module"`).
    near_flat : int
        Flat directions not claimed nor unused that the verified near-flat scalings explain
        (flat only up to a norm's $\\varepsilon$; not symmetries).
    near_flat_reasons : tuple of dict
        Each verified near-flat scaling: its norm, $\\varepsilon$, parameters, the relative
        change of a finite element at $\\varepsilon = 0$ and at the model's $\\varepsilon$, its
        $\\|J v\\| / (\\|J\\|_2 \\|v\\|)$ on the audited outputs (`violation`), and the reason.
    """

    method: str
    parameters: int
    outputs: int
    flat: int
    claimed: int
    unused: int
    unexplained: int
    violation: float
    gap: tuple[float, float]
    by_parameter: dict[str, float] = field(default_factory=dict)
    by_kind: dict[str, int] = field(default_factory=dict)
    modules: tuple[AuditReport, ...] = ()
    scope: str = ""
    near_flat: int = 0
    near_flat_reasons: tuple[dict, ...] = ()

    def to_dict(self) -> dict:
        """A JSON-friendly summary."""
        return asdict(self)


# -- random inputs -------------------------------------------------------------------------------
def _int_bound(name: str, model: nn.Module, t: torch.Tensor) -> int | None:
    """Exclusive upper bound of a redrawn integer input (`None`: keep it)."""
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    if name in ("input_ids", "decoder_input_ids") and vocab:
        return int(vocab)
    if name == "token_type_ids":
        return int(getattr(cfg, "type_vocab_size", 0) or int(t.max()) + 1)
    if "mask" in name or "position" in name:
        return None
    return int(t.max()) + 1 if t.numel() else None


def _redraw(model: nn.Module, inputs: tuple[tuple, dict], gen: torch.Generator
            ) -> tuple[tuple, dict]:
    """The inputs with every integer id tensor redrawn uniformly and every floating tensor
    redrawn as a Gaussian of the same RMS (masks and positions kept)."""
    def redraw(name: str):
        def f(t: torch.Tensor) -> torch.Tensor:
            if t.is_floating_point():
                rms = float(t.pow(2).mean().sqrt()) if t.numel() else 1.0
                return torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t) * (
                    rms if rms > 0 else 1.0)
            bound = _int_bound(name, model, t)
            if bound is None or t.dtype == torch.bool:
                return t
            return torch.randint(0, bound, t.shape, generator=gen).to(t)
        return f

    args, kwargs = _widen(inputs, _DRAW_ROWS)
    return (tuple(tree_map(redraw(f"arg{i}"), a) for i, a in enumerate(args)),
            {k: tree_map(redraw(k), v) for k, v in kwargs.items()})


def _widen(inputs: tuple[tuple, dict], rows: int) -> tuple[tuple, dict]:
    """The inputs with every tensor whose dim 0 is the batch repeated to `rows` rows."""
    batch = leading_size(inputs)
    if batch is None or batch >= rows:
        return inputs
    reps = -(-rows // batch)

    def widen(t: torch.Tensor) -> torch.Tensor:
        if t.dim() and t.shape[0] == batch:
            return t.repeat(reps, *([1] * (t.dim() - 1)))[:rows]
        return t

    return tree_map(widen, inputs[0]), tree_map(widen, inputs[1])


def _outputs(out: Any, kind: str) -> torch.Tensor:
    ys = output_tensors(out)
    if not ys:
        raise ExampleInputError("the model returns no floating-point output to audit")
    if kind == "log_probs":
        return torch.log_softmax(ys[0], dim=-1).reshape(-1)
    return torch.cat([y.reshape(-1) for y in ys])


# -- the tangents of the claimed symmetries ------------------------------------------------------
def _tangents(candidates: Sequence[Any], params: dict[str, torch.Tensor],
              names: Sequence[str]) -> tuple[torch.Tensor, list[str]]:
    """`(P, K)`: the orbit tangents of every candidate at `params` (flattened over `names`),
    and the kind of each column."""
    cols, kinds = [], []
    for c in candidates:
        k = c.lie_dim(params)
        if k == 0:
            continue

        def flat(theta: torch.Tensor, c=c) -> torch.Tensor:
            moved = c.act_at(params, theta)
            return torch.cat([moved[n].reshape(-1) for n in names])

        theta0 = torch.zeros(k, dtype=torch.float64, device=params[names[0]].device)
        cols.append(jacfwd(flat)(theta0).to(torch.float64))
        kinds += [c.kind] * k
    P = sum(params[n].numel() for n in names)
    if not cols:
        return torch.zeros(P, 0, dtype=torch.float64,
                           device=params[names[0]].device if names else None), []
    return torch.cat(cols, dim=1), kinds


def _rank(M: torch.Tensor, rtol: float = 1e-8) -> int:
    if M.numel() == 0:
        return 0
    s = torch.linalg.svdvals(M)
    return int((s > rtol * s[0]).sum()) if s.numel() and s[0] > 0 else 0


def _orthonormal(M: torch.Tensor, rtol: float = 1e-8) -> torch.Tensor:
    if M.shape[1] == 0:
        return M
    try:
        U, s, _ = torch.linalg.svd(M, full_matrices=False)
    except torch.linalg.LinAlgError:  # LAPACK's divide and conquer failed: the QR iteration
        import scipy.linalg

        u, sv, _ = scipy.linalg.svd(M.detach().to("cpu").numpy(), full_matrices=False,
                                    lapack_driver="gesvd")  # scipy needs host memory
        U, s = torch.from_numpy(u).to(M), torch.from_numpy(sv).to(M)
    return U[:, : int((s > rtol * s[0]).sum())] if s.numel() and s[0] > 0 else U[:, :0]


def _jacobian(model: nn.Module, params: dict[str, torch.Tensor], names: Sequence[str],
              inputs: tuple[tuple, dict], kind: str) -> torch.Tensor:
    """The Jacobian of the outputs on one input with respect to the parameters `names`."""
    rest = {n: t for n, t in params.items() if n not in names}
    buffers = dict(model.named_buffers())

    def f(*flat_params: torch.Tensor) -> torch.Tensor:
        d = {**rest, **dict(zip(names, flat_params, strict=True)), **buffers}
        with no_fastpath(), float64_internals():
            return _outputs(functional_call(model, d, inputs[0], inputs[1]), kind)

    jac = jacrev(f, argnums=tuple(range(len(names))))(*[params[n] for n in names])
    return torch.cat([j.reshape(j.shape[0], -1) for j in jac], dim=1)


def _threshold(s: torch.Tensor) -> tuple[int, float, float]:
    """`(rank, lo, hi)`: the singular values above the largest multiplicative gap below
    `_GAP_TOP` (relative) count as non-zero; `lo`, `hi` bound the gap (relative)."""
    rel = (s / s[0]).clamp_min(1e-300)
    best, rank = 1.0, int((rel > _SIGMA_RTOL).sum())
    for i in range(1, rel.numel()):
        if rel[i] < _GAP_TOP and float(rel[i - 1] / rel[i]) > best:
            best, rank = float(rel[i - 1] / rel[i]), i
    if best < _GAP_MIN and float(rel[-1]) > _GAP_TOP:  # no small singular value at all
        rank = rel.numel()
    lo = float(rel[rank - 1]) if rank else 0.0
    hi = float(rel[rank]) if rank < rel.numel() else 0.0
    return rank, lo, hi


def _one(model: nn.Module, params: dict[str, torch.Tensor], names: Sequence[str],
         draw: Callable[[], tuple[tuple, dict]], kind: str, candidates: Sequence[Any],
         scope: str, method: str, max_rows: int,
         near: Sequence[NearFlat] = ()) -> AuditReport:
    sizes = [params[n].numel() for n in names]
    P = sum(sizes)
    V, kinds = _tangents(candidates, params, names)
    dev = V.device  # the model's (the float64 copy's) device
    N = (torch.stack([f.tangent(params, names) for f in near], dim=1) if near
         else torch.zeros(P, 0, dtype=torch.float64, device=dev))
    jn = torch.zeros(N.shape[1], dtype=torch.float64, device=dev)
    R = torch.zeros(0, P, dtype=torch.float64, device=dev)
    colmax = torch.zeros(P, dtype=torch.float64, device=dev)
    jv = torch.zeros(V.shape[1], dtype=torch.float64, device=dev)
    rows, target, previous = 0, 2 * P, -1
    while True:
        while rows < target:
            try:
                J = _jacobian(model, params, names, draw(), kind).to(torch.float64)
            except RuntimeError as e:
                if "functorch transforms" not in str(e):
                    raise
                raise UnsupportedModelError(
                    "the audit differentiates the model with torch.func, and "
                    f"{type(model).__name__} runs an autograd.Function without a setup_context "
                    "(BLOOM's fused attention does); no flat directions can be counted for "
                    "it. Audit a model whose forward pass torch.func can differentiate.") from e
            rows += J.shape[0]
            colmax = torch.maximum(colmax, J.abs().amax(dim=0))
            if V.shape[1]:
                jv += (J @ V).pow(2).sum(0)
            if N.shape[1]:
                jn += (J @ N).pow(2).sum(0)
            R = torch.linalg.qr(torch.cat([R, J]), mode="r").R
        _, s, Vh = torch.linalg.svd(R, full_matrices=False)
        rank, lo, hi = _threshold(s) if s.numel() and s[0] > 0 else (0, 0.0, 0.0)
        clear = lo == 0 or hi == 0 or lo / max(hi, 1e-300) >= _GAP_MIN
        if (clear and rank == previous) or rows >= max_rows:
            break  # a clear gap, and twice the inputs found no more non-flat direction
        previous, target = rank, min(2 * target, max_rows)
    if Vh.shape[0] < P:
        raise ValueError(f"the audit has {rows} outputs for {P} parameter entries, too few to "
                         "find the flat directions; pass more samples=")
    smax = float(s[0]) if s.numel() else 0.0
    flat = P - rank
    claimed = _rank(V)
    violation = 0.0
    if V.shape[1] and smax > 0:
        violation = float((jv.sqrt() / (smax * V.norm(dim=0).clamp_min(1e-300))).max())
    dead = colmax == 0
    E = torch.eye(P, dtype=torch.float64, device=dev)[:, dead]
    explained = _orthonormal(torch.cat([V, E], dim=1))
    unused = explained.shape[1] - claimed
    null = Vh[rank:].T  # (P, flat)
    n_near, reasons = _near(N, null, explained, near, jn, smax)
    if n_near:
        explained = _orthonormal(torch.cat([explained, N[:, [r["index"] for r in reasons
                                                             if r["in_kernel"]]]], dim=1))
    unexplained = max(flat - explained.shape[1], 0)
    by_parameter: dict[str, float] = {}
    if unexplained:
        rest = null - explained @ (explained.T @ null)
        U, sv, _ = torch.linalg.svd(rest, full_matrices=False)
        basis = U[:, sv > 0.5]
        start = 0
        for n, k in zip(names, sizes, strict=True):
            share = float(basis[start:start + k].pow(2).sum())
            if share > 1e-6:
                by_parameter[n] = round(share, 4)
            start += k
    by_kind: dict[str, int] = {}
    for kd in dict.fromkeys(kinds):
        by_kind[kd] = _rank(V[:, [i for i, x in enumerate(kinds) if x == kd]])
    return AuditReport(method, P, rows, flat, claimed, unused, unexplained, violation,
                       (lo, hi), by_parameter, by_kind, scope=scope, near_flat=n_near,
                       near_flat_reasons=tuple(reasons))


def _near(N: torch.Tensor, null: torch.Tensor, explained: torch.Tensor,
          near: Sequence[NearFlat], jn: torch.Tensor, smax: float
          ) -> tuple[int, list[dict]]:
    """How many flat directions the near-flat tangents `N` add to `explained`, and a report of
    each. Only a tangent inside the measured kernel (its part outside below $10^{-6}$ of its
    norm) counts: one that the audit sees as not flat explains nothing."""
    reasons: list[dict] = []
    for i, f in enumerate(near):
        v = N[:, i]
        nv = float(v.norm())
        outside = float((v - null @ (null.T @ v)).norm()) / max(nv, 1e-300)
        reasons.append({**f.describe(), "index": i, "in_kernel": outside <= 1e-6,
                        "violation": float(jn[i].sqrt()) / max(smax * nv, 1e-300)})
    keep = [r["index"] for r in reasons if r["in_kernel"]]
    if not keep:
        return 0, reasons
    return _orthonormal(torch.cat([explained, N[:, keep]], dim=1)).shape[1] - \
        explained.shape[1], reasons


def audit(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    batch: Any = None,
    *,
    inputs: Any = None,
    output: str = "log_probs",
    symmetries: Symmetries | None = None,
    symmetry: str = "complete",
    max_outputs: int | None = None,
    max_parameters: int = 6000,
    seed: int = 0,
) -> AuditReport:
    r"""Count the flat directions of `model` and those its claimed symmetries explain.

    Parameters
    ----------
    model : nn.Module
        Only read (a float64 copy is audited).
    loss_fn, batch : optional
        The model's inputs are those of `loss_fn(model, batch)` (captured as the sharpness
        engine does, by a forward pre-hook); or pass `inputs`. Without either, an example input
        is built ([`example_inputs`][quotient_manifolds.models.inputs.example_inputs]).
    inputs : optional
        The model's inputs: `(args, kwargs)`, a dict, a tuple or a tensor.
    output : {"log_probs", "outputs"}
        The function: the log-softmax of the first floating output (the log-probabilities of a
        classifier or language model; the softmax shift is then flat), or every floating output
        as it is.
    symmetries : Symmetries, optional
        The claimed symmetries (default: [`discover`][quotient_manifolds.models.discover] with
        `symmetry`, on the same inputs).
    symmetry : str
        The group discovered when `symmetries` is not given.
    max_outputs : int, optional
        The most Jacobian rows to draw: the inputs are redrawn at random (integer ids uniform
        over the vocabulary, floating inputs Gaussian) until the singular values show a gap of
        $10^4$ below $10^{-5}$ of the largest, starting from twice as many outputs as
        parameters; default 32 times the parameters.
    max_parameters : int
        Above this number of entries the audit runs per top-level module.
    seed : int
        Seed of the redraws.

    Returns
    -------
    AuditReport
    """
    if output not in ("log_probs", "outputs"):
        raise ValueError(f"output must be 'log_probs' or 'outputs', got {output!r}")
    work = float64_copy(model)
    for m in work.modules():  # the padding row is read like any other: its true derivative
        if isinstance(m, nn.Embedding):
            m.padding_idx = None
    base_inputs = _inputs_of(work, model, loss_fn, batch, inputs, seed)
    if symmetries is None:  # symmetries of the audited function (the log-probabilities) count
        symmetries = discover(model, symmetry=symmetry, warn=False, example_inputs=base_inputs,
                              loss_fn=_functional(output), batch=base_inputs)
    raw = {n: p.detach() for n, p in work.named_parameters()}
    params, _ = symmetries.canonicalize(raw)
    params = {n: t.detach().to(torch.float64) if t.is_floating_point() else t
              for n, t in params.items()}
    names = [n for n, t in params.items() if t.is_floating_point()]
    candidates: list[Any] = [*symmetries.blocks, *symmetries.folds]

    near = near_flat(Prober(work, base_inputs), params)

    def max_rows(p: int) -> int:
        return max_outputs if max_outputs is not None else 32 * p
    gen = torch.Generator().manual_seed(seed)
    first = [base_inputs]

    def draw() -> tuple[tuple, dict]:
        return first.pop() if first else _redraw(model, base_inputs, gen)

    P = sum(params[n].numel() for n in names)
    if P <= max_parameters:
        return _one(work, params, names, draw, output, candidates, "", "exact", max_rows(P),
                    near)
    reports = []
    for top, _m in work.named_children():
        inside = [n for n in names if n.startswith(top + ".")]
        if not inside:
            continue
        own = [c for c in candidates if set(c.params) <= set(inside)]
        k = sum(params[n].numel() for n in inside)
        mine = [f for f in near if set(f.up) | {c.weight for c in f.down} <= set(inside)]
        reports.append(_one(work, params, inside, draw, output, own, top, "per module",
                            max_rows(k), mine))
    return AuditReport("per module", sum(r.parameters for r in reports),
                       max((r.outputs for r in reports), default=0),
                       sum(r.flat for r in reports), sum(r.claimed for r in reports),
                       sum(r.unused for r in reports), sum(r.unexplained for r in reports),
                       max((r.violation for r in reports), default=0.0),
                       (min((r.gap[0] for r in reports), default=0.0),
                        max((r.gap[1] for r in reports), default=0.0)),
                       {k: v for r in reports for k, v in r.by_parameter.items()}, {},
                       tuple(reports), near_flat=sum(r.near_flat for r in reports),
                       near_flat_reasons=tuple(x for r in reports for x in r.near_flat_reasons))


def _functional(kind: str) -> Callable[[nn.Module, tuple[tuple, dict]], torch.Tensor]:
    """A fixed random linear functional of the audited outputs, as a loss: invariant exactly
    where the outputs are (barring a cancellation of probability zero)."""
    def loss(model: nn.Module, inputs: tuple[tuple, dict]) -> torch.Tensor:
        y = _outputs(model(*inputs[0], **inputs[1]), kind)
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        return (y * w.to(y)).sum()
    return loss


def _inputs_of(work: nn.Module, model: nn.Module, loss_fn, batch, inputs, seed: int
               ) -> tuple[tuple, dict]:
    if inputs is None and loss_fn is not None and batch is not None:
        inputs = capture_inputs(model, loss_fn, batch)
    if inputs is None:
        inputs = example_inputs(work, torch.Generator().manual_seed(seed))
    args, kwargs = cast_inputs(normalize_inputs(inputs), torch.float64)
    if leading_size((args, kwargs)) is None:
        raise ExampleInputError("the model's inputs have no tensor to redraw; pass inputs=")
    if "use_cache" in signature_names(work.forward):
        kwargs.setdefault("use_cache", False)
    return args, kwargs
