r"""q/k norms: the gains of a query norm and a key norm, balanced against each other.

With q/k normalisation the scores are $(\gamma_q \odot \hat q)^\top R (\gamma_k \odot \hat k)$,
unchanged when $\gamma_q$ is scaled by $c$ and $\gamma_k$ by $1/c$ on each coordinate (each
rotated pair with rotary embeddings):
[`QKNormScaleFold`][quotient_manifolds.models.families.qk_norm.QKNormScaleFold] is its canonical
representative. [`QKNorms`][quotient_manifolds.models.families.qk_norm.QKNorms] finds the
`q_norm`/`k_norm` pairs of attention modules (Qwen3, OLMo2, Gemma3, timm) and tries the classes
from the finest group on; a LayerNorm key norm's shift, added to every key, is dead and
proposed as a key bias fold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..blocks import FactorPart
from ..norms import any_norm, is_norm, norm_offset, norm_weight
from ..prober import Prober
from ..records import Fallback
from ..symmetry import Fold, Scene, SymmetryFamily, random_scale
from .bias import KeyBiasFold

__all__ = ["QKNormScaleFold", "QKNorms"]

Params = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class QKNormScaleFold(Fold):
    r"""The gains of a q/k norm, balanced per class: $γ_q ← c ⊙ γ_q$, $γ_k ← γ_k ⊘ c$.

    With q/k norms the attention scores are $(γ_q ⊙ \hat q)^\top R (γ_k ⊙ \hat k)$ (with
    $R = R_i^\top R_j$ for rotary embeddings), unchanged when $γ_q$ is scaled by $c$ and
    $γ_k$ by $1/c$, for any $c$ that is constant on each class: each coordinate without rotary
    embeddings, each rotated pair with them, shared by the query heads of one K/V group.
    The gains of q/k norms shared by all heads give one class per coordinate (or pair).

    Canonical representative: per class $k$, $c_k = s_k (‖γ_{k}‖ / ‖γ_{q}‖)^{1/2}$ over the
    class's entries, with the sign $s_k$ that makes $\sum γ_q$ positive; afterwards
    $‖γ_q‖ = ‖γ_k‖$ on every class.  Nothing is frozen (the canonical set is not a set of
    fixed entries), but the canonical point is the same for every element of the orbit.

    Attributes
    ----------
    q_weight, k_weight : str
        The gains' parameters $w$ ($γ = o + w$).
    q_bias, k_bias : str or None
        LayerNorm shifts, scaled with the gains.
    q_offset, k_offset : float
        $o$ of each norm.
    q_class, k_class : tuple of int
        The class of every gain entry.
    layout : str
        Which classes were tried and confirmed (`"coordinate"`, `"rotate_half"`,
        `"interleaved"`).
    """

    q_weight: str = ""
    k_weight: str = ""
    q_bias: str | None = None
    k_bias: str | None = None
    q_offset: float = 0.0
    k_offset: float = 0.0
    q_class: tuple[int, ...] = ()
    k_class: tuple[int, ...] = ()
    layout: str = "coordinate"

    kind = "qk_norm"
    order = 3

    @property
    def params(self) -> tuple[str, ...]:
        names = (self.q_weight, self.q_bias, self.k_weight, self.k_bias)
        return tuple(n for n in names if n is not None)

    def _n(self) -> int:
        return max(max(self.q_class), max(self.k_class)) + 1

    def _scale(self, params, c: torch.Tensor) -> dict:
        out = dict(params)
        qi = torch.tensor(self.q_class, device=c.device)
        ki = torch.tensor(self.k_class, device=c.device)
        cq, ck = c[qi], c[ki]
        wq, wk = out[self.q_weight], out[self.k_weight]
        out[self.q_weight] = cq.to(wq.dtype) * (wq + self.q_offset) - self.q_offset
        out[self.k_weight] = (wk + self.k_offset) / ck.to(wk.dtype) - self.k_offset
        if self.q_bias is not None:
            out[self.q_bias] = cq.to(wq.dtype) * out[self.q_bias]
        if self.k_bias is not None:
            out[self.k_bias] = out[self.k_bias] / ck.to(wk.dtype)
        return out

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            wq, wk = params[self.q_weight], params[self.k_weight]
            gq = (wq + self.q_offset).to(torch.float64)
            gk = (wk + self.k_offset).to(torch.float64)
            n = self._n()
            qi = torch.tensor(self.q_class, device=wq.device)
            ki = torch.tensor(self.k_class, device=wq.device)
            sq = torch.zeros(n, dtype=torch.float64, device=wq.device).index_add(0, qi, gq * gq)
            sk = torch.zeros(n, dtype=torch.float64, device=wq.device).index_add(0, ki, gk * gk)
            if self.q_bias is not None:
                bq = params[self.q_bias].to(torch.float64)
                sq = sq.index_add(0, qi, bq * bq)
            if self.k_bias is not None:
                bk = params[self.k_bias].to(torch.float64)
                sk = sk.index_add(0, ki, bk * bk)
            ok = (sq > 0) & (sk > 0)
            c = torch.where(ok, (sk / torch.where(ok, sq, 1.0)) ** 0.25, 1.0)
            total = torch.zeros(n, dtype=torch.float64, device=wq.device).index_add(0, qi, gq)
            c = torch.where(total < 0, -c, c)
            return self._scale(params, c), {}

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            w = params[self.q_weight]
            c = random_scale((self._n(),), generator, a, torch.float64, w.device)
            return self._scale(params, c)

    def lie_dim(self, params: Params) -> int:
        return self._n()

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._scale(params, theta.to(torch.float64).exp())

    def describe(self) -> dict:
        d = super().describe()
        d.update(layout=self.layout, classes=self._n())
        return d


def _rotary_dims(attn: nn.Module, h: int) -> list[int]:
    cfg = getattr(attn, "config", None)
    dims = [h]
    for key in ("partial_rotary_factor", "rotary_pct"):
        f = getattr(cfg, key, None)
        if f:
            dims.append(int(h * float(f)))
    r = getattr(cfg, "rotary_dim", None)
    if r:
        dims.append(int(r))
    return [r for r in dict.fromkeys(dims) if r >= 2 and r % 2 == 0]


def _class_layouts(h: int, dims: Sequence[int]) -> list[tuple[str, list[int]]]:
    """Candidate coordinate classes of a q/k-norm gain of size `h`, finest group first."""
    out = [("coordinate", list(range(h)))]
    for r in dims:
        half = r // 2
        out.append((f"rotate_half(r={r})",
                    [j % half if j < r else half + (j - r) for j in range(h)]))
        out.append((f"interleaved(r={r})",
                    [j // 2 if j < r else half + (j - r) for j in range(h)]))
    return out


def _candidates(p: Prober, name: str, attn: nn.Module) -> list[QKNormScaleFold]:
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if not (isinstance(qn, nn.Module) and isinstance(kn, nn.Module) and is_norm(qn)
            and is_norm(kn)):
        return []
    cfg = getattr(attn, "config", None)
    heads = (getattr(attn, "num_heads", None) or getattr(attn, "num_attention_heads", None)
             or getattr(cfg, "num_attention_heads", None))
    h = getattr(attn, "head_dim", None) or getattr(cfg, "head_dim", None)
    q_weight, k_weight = norm_weight(qn), norm_weight(kn)
    lq, lk = q_weight.numel(), k_weight.numel()
    if not h:
        h = lq if lq == lk else (lq // heads if heads else None)
    if not heads or not h:
        return []
    kv = (getattr(attn, "num_key_value_heads", None) or getattr(attn, "num_kv_heads", None)
          or getattr(cfg, "num_key_value_heads", None) or heads)
    r = max(1, heads // max(1, kv))
    offsets: dict[str, float] = {}
    for nm, m in (("q", qn), ("k", kn)):
        call = next(((c.args, c.kwargs) for c in p.calls if p.modules.get(c.name) is m), None)
        if call is None:
            return []
        off = norm_offset(m, *call)
        if off is None:
            return []
        offsets[nm] = off
    out = []
    for layout, cls in _class_layouts(int(h), _rotary_dims(attn, int(h))):
        C = max(cls) + 1
        if lq == h and lk == h:
            qc, kc = cls, cls
        elif lq == heads * h and lk == kv * h:
            qc = [(e // h // r) * C + cls[e % h] for e in range(lq)]
            kc = [(e // h) * C + cls[e % h] for e in range(lk)]
        else:
            return []
        bq = p.pname(getattr(qn, "bias", None)) if isinstance(getattr(qn, "bias", None),
                                                               nn.Parameter) else None
        bk = p.pname(getattr(kn, "bias", None)) if isinstance(getattr(kn, "bias", None),
                                                               nn.Parameter) else None
        out.append(QKNormScaleFold(name, p.name(q_weight), p.name(k_weight), bq, bk,
                                   offsets["q"], offsets["k"], tuple(qc), tuple(kc), layout))
    return out


class QKNorms(SymmetryFamily):
    """The gain exchange of the `q_norm`/`k_norm` pair of every attention module."""

    name = "q/k norms"
    kind = "folds"
    symmetries = ("complete", "full")

    def present(self, scene: Scene) -> bool:
        return any_norm(scene.modules.values())

    def find(self, scene: Scene) -> None:
        p = scene.prober
        extra = []
        for name, m in p.modules.items():
            cands = _candidates(p, name, m)
            if not cands:
                continue
            for side in ("q_norm", "k_norm"):
                scene.account(f"{name}.{side}", getattr(m, side))

            def reject(p: Prober, name: str = name) -> Fallback:
                return Fallback(name, "qk_norm", (
                    "no per-coordinate or per-rotary-pair scaling of the q/k norm gains left "
                    "the output unchanged; the gain symmetry is not removed"))

            scene.propose(cands, reject)
            kb = cands[0].k_bias
            if kb is not None:  # a LayerNorm k_norm's shift is added to every key: dead
                extra.append(KeyBiasFold(name, FactorPart(kb, "bias", 0), 1,
                                         p.params[kb].numel()))
        for f in extra:
            scene.propose([f])
