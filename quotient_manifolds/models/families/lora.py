r"""LoRA adapters: $W + B A$ depends on $(B, A)$ only through $B A$, a GL(r) block.

Every peft `LoraLayer` (a module with `lora_A`/`lora_B` dicts of linear maps) gets one block per
adapter: $G = B$ (the `(out, r)` weight of `lora_B`), $H = A^\top$ (the rows of the `(r, in)`
weight of `lora_A`), $(B, A) \mapsto (B M^{-1}, M A)$ for $M \in GL(r)$.
"""

from __future__ import annotations

from torch import nn

from ..blocks import BlockSpec, FactorPart
from ..symmetry import Scene, SymmetryFamily

__all__ = ["LoRA"]


class LoRA(SymmetryFamily):
    """One GL(r) block per LoRA adapter."""

    name = "LoRA adapters"
    kind = "blocks"
    symmetries = ("complete", "full", "paper")

    def find(self, scene: Scene) -> None:
        for name, m in scene.modules.items():
            A, B = getattr(m, "lora_A", None), getattr(m, "lora_B", None)
            if not (isinstance(A, nn.ModuleDict) and isinstance(B, nn.ModuleDict)):
                continue
            scene.account(name, m)
            base = getattr(m, "base_layer", None)
            d = base.in_features if isinstance(base, nn.Linear) else None
            for key in A.keys():
                a, b = A[key], B[key] if key in B else None
                if not (isinstance(a, nn.Linear) and isinstance(b, nn.Linear)):
                    continue
                scene.claim(BlockSpec(
                    "lora", name, 1, a.out_features,
                    (FactorPart(scene.name(b.weight), "cols"),),
                    (FactorPart(scene.name(a.weight), "rows"),), note=f"adapter {key!r}"), d)
