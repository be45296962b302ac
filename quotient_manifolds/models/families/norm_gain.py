r"""Norm gains: the gain and shift of a pre-norm LayerNorm/RMSNorm, folded into its readers.

A norm whose output is read only by linear maps has the symmetry of rescaling its gain against
their input columns (and, with biases, of translating its shift against their biases):
[`NormGainFold`][quotient_manifolds.models.families.norm_gain.NormGainFold] is its canonical
representative, and [`NormGains`][quotient_manifolds.models.families.norm_gain.NormGains] finds
every such norm on the traced forward pass: a norm whose output the readers of
[`linear`][quotient_manifolds.models.linear] account for entirely, and which reaches the
outputs through nothing else (post-norm blocks, whose norm output is also the residual stream,
have no such symmetry and are skipped).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..linear import Consumer, ReadQuery, readers_of, storage
from ..norms import any_norm, is_norm, norm_bias, norm_offset, norm_weight
from ..paths import pooled_readers, reaches_only
from ..prober import Prober
from ..records import Fallback
from ..symmetry import Fold, Scene, SymmetryFamily, full_mask, random_normal, random_scale

__all__ = ["NormGainFold", "NormGains", "ReturnedNormGainFold"]

Params = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class NormGainFold(Fold):
    r"""The gain (and shift) of a pre-norm LayerNorm/RMSNorm, folded into its consumers.

    A norm $y = γ ⊙ \hat x + β$ ($\hat x$ the normalised input, $γ = o + w$ with the
    parameter $w$ and a constant offset $o$: $o = 1$ for Gemma's norms, else $0$) whose output
    is read only by the linear maps $z_j = W_j y + b_j$ has the symmetry
    $(γ, β, W_j) ↦ (c ⊙ γ, c ⊙ β, W_j \operatorname{diag}(c)^{-1})$ for every
    $c ∈ (\mathbb R^*)^d$, and, when every consumer has a bias (or its output shift is dead,
    like a key projection's), $(β, b_j) ↦ (β + t, b_j − W_j t)$ for every $t ∈ \mathbb R^d$.

    Canonical representative: $W_j ← W_j \operatorname{diag}(γ)$, $γ ← 1$ (frozen) and, with
    `shift="fold"`, $b_j ← b_j + W_j β$, $β ← 0$ (frozen); with `shift="scale"` (a consumer
    without bias whose shift is not dead) $β ← β ⊘ γ$, which needs $γ$ without zeros.

    Attributes
    ----------
    weight, bias : str, str or None
        The norm's gain parameter $w$ and shift $β$.
    offset : float
        $o$ in $γ = o + w$.
    consumers : tuple of Consumer
        Every linear map that reads the norm's output.
    shift : {"fold", "scale", "none"}
        How $β$ is canonicalised (`"none"`: the norm has no $β$).
    """

    weight: str = ""
    bias: str | None = None
    offset: float = 0.0
    consumers: tuple[Consumer, ...] = ()
    shift: str = "none"

    kind = "norm_gain"
    order = 0

    @property
    def params(self) -> tuple[str, ...]:
        names = [self.weight, self.bias] + [c.weight for c in self.consumers]
        if self.shift == "fold":
            names += [c.bias for c in self.consumers]
        return tuple(dict.fromkeys(n for n in names if n is not None))

    def frozen(self, params: Params) -> dict[str, torch.Tensor]:
        out = {self.weight: full_mask(params, self.weight)}
        if self.bias is not None and self.shift == "fold":
            out[self.bias] = full_mask(params, self.bias)
        return out

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            out = dict(params)
            w = out[self.weight]
            g = w + self.offset
            beta = None if self.bias is None else out[self.bias]
            for c in self.consumers:
                M, b = c.read(out)
                if self.shift == "fold" and b is not None:
                    assert beta is not None, "shift='fold' needs the norm's bias"
                    b = b + M @ beta.to(M.dtype)
                c.write(out, M * g.to(M.dtype), b)
            out[self.weight] = torch.full_like(w, 1.0 - self.offset)
            if self.bias is not None and beta is not None:  # beta is read from the bias
                out[self.bias] = torch.zeros_like(beta) if self.shift == "fold" else beta / g
            return out, self.frozen(params)

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            w = params[self.weight]
            c = random_scale(w.shape, generator, a, w.dtype, w.device)
            t = (a * random_normal(w.shape, generator, w.dtype, w.device)
                 if self.bias is not None and self.shift == "fold" else None)
            return self._move(params, c, t)

    def _move(self, params: Params, c: torch.Tensor, t: torch.Tensor | None
              ) -> dict[str, torch.Tensor]:
        r"""$(γ, β, W_j, b_j) \mapsto (c ⊙ γ, c ⊙ β + t, W_j \operatorname{diag}(c)^{-1},
        b_j - W_j \operatorname{diag}(c)^{-1} t)$ (out of place)."""
        out = dict(params)
        w = out[self.weight]
        out[self.weight] = c * (w + self.offset) - self.offset
        if self.bias is not None:
            out[self.bias] = c * out[self.bias] + (0 if t is None else t)
        for cons in self.consumers:
            M, b = cons.read(out)
            M = M / c.to(M.dtype)
            if t is not None and b is not None:
                b = b - M @ t.to(M.dtype)
            cons.write(out, M, b)
        return out

    def lie_dim(self, params: Params) -> int:
        d = params[self.weight].numel()
        return 2 * d if self.bias is not None and self.shift == "fold" else d

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        d = params[self.weight].numel()
        w = params[self.weight]
        c = theta[:d].to(w.dtype).exp().view(w.shape)
        t = theta[d:].to(w.dtype).view(w.shape) if theta.numel() > d else None
        return self._move(params, c, t)

    def describe(self) -> dict:
        d = super().describe()
        d.update(offset=self.offset, shift=self.shift,
                 consumers=[c.weight + ("" if c.stop < 0 else f"[{c.start}:{c.stop}]")
                            for c in self.consumers])
        return d


@dataclass(frozen=True)
class ReturnedNormGainFold(NormGainFold):
    """[`NormGainFold`][quotient_manifolds.models.families.norm_gain.NormGainFold] of a norm
    whose output is also one of the model's outputs (an encoder's last hidden state, returned
    beside the logits and read by the decoder's cross-attention): the fold changes that output,
    so it is a symmetry of a loss of the other outputs only, claimed when the user's loss is
    unchanged."""

    invariant = "loss"


def _returned(p: Prober, name: str) -> bool:
    """Whether the output of the module `name` is one of the model's outputs."""
    outs = {storage(t) for t in p.reference or ()}
    return any(c.name == name and isinstance(c.out, torch.Tensor) and storage(c.out) in outs
               for c in p.calls)


class NormGains(SymmetryFamily):
    """Pre-norm gains and shifts, folded into the linear maps that read the norm's output."""

    name = "norm gains"
    kind = "folds"
    symmetries = ("complete", "full")

    def present(self, scene: Scene) -> bool:
        return any_norm(scene.modules.values())

    def find(self, scene: Scene) -> None:
        p = scene.prober
        readers = p.parameterised_calls()
        seen: set[str] = set()
        for call in p.calls:
            m = p.modules[call.name]
            if call.name in seen or call.name in scene.accounted or not is_norm(m):
                continue
            if not isinstance(call.out, torch.Tensor):
                continue
            seen.add(call.name)
            d = norm_weight(m).numel()
            if call.out.shape[-1] != d:
                continue
            found = readers_of(readers, ReadQuery(storage(call.out), d, p.name, p.pname))
            if found is not None and not found[0] and scene.symmetry == "complete":
                found = pooled_readers(p, call.name, d)  # read through a mean pooling
            if found is None or not found[0]:
                continue  # read by an unknown module, or by no linear map: not a pre-norm
            self._propose(scene, p, call.name, m, found, call.args, call.kwargs)

    @staticmethod
    def _propose(scene: Scene, p: Prober, name: str, m: nn.Module,
                 found: tuple[list[Consumer], list[str]], args: tuple, kwargs: dict) -> None:
        cons, mods = found
        w, b = p.name(norm_weight(m)), p.pname(norm_bias(m))
        offset = norm_offset(m, args, kwargs)
        if offset is None:
            return
        tied = [c.weight for c in cons if p.tied(c.weight)]
        if tied:
            if reaches_only(p, name, mods):
                scene.fallback(name, "norm", (
                    f"the norm's gain feeds {tied[0]!r}, which is tied to another module "
                    "(e.g. the input embedding); folding the gain would change that module, so "
                    "the gain symmetry is not removed"))
            return
        g = p.params[w] + offset
        if b is None:
            cands = [NormGainFold(name, w, None, offset, tuple(cons), "none")]
        else:
            cands = [NormGainFold(name, w, b, offset, tuple(cons), "fold")]
            if bool((g != 0).all()):
                cands.append(NormGainFold(name, w, b, offset, tuple(cons), "scale"))

        if scene.symmetry == "complete" and _returned(p, name):
            # the output is also returned (an encoder's last hidden state, read by the decoder's
            # cross-attention): the fold keeps a loss of the logits, not that output
            cands += [ReturnedNormGainFold(c.module, c.weight, c.bias, c.offset, c.consumers,
                                           c.shift) for c in list(cands)]

        def reject(p: Prober) -> Fallback | None:
            if not reaches_only(p, name, mods):
                return None  # post-norm (residual) or a returned hidden state: no symmetry
            worst = min(p.probe(c) for c in cands)
            if cands[0].bias is not None and len(cands) == 1:
                why = ("its shift cannot be folded into the consumers and the gain has zero "
                       "entries")
            else:
                why = f"a random gain scaling changed the output by {worst:.1e} (relative)"
                if worst < 1e-5:
                    why += (", about float32 rounding: the norm may compute in float32 "
                            "internally, which a float64 probe cannot confirm")
            return Fallback(name, "norm", f"pre-norm structure found, but {why}; the gain "
                            "symmetry is not removed")

        scene.propose(cands, reject)
