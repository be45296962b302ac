r"""Lie subalgebras $\mathfrak k \subseteq \mathfrak{gl}(h)$ and the quotients by their groups.

When only a subgroup $K \subseteq GL(h)$ leaves a block's function unchanged (rotary position
embeddings allow only the commutant of the rotations on Q/K), the vertical space at
$x = (G, H)$ shrinks to

$$
\mathcal V^{\mathfrak k}_x = \{(G X, -H X^\top) : X \in \mathfrak k\},
$$

while the metric (inv or mix, relaxed by $\varepsilon$) and the Christoffel form stay those of
the full GL(h) quotient: both metrics are GL(h)-invariant, hence $K$-invariant.

**The horizontal condition.** For every $X \in \mathfrak{gl}(h)$,
$\langle \xi, (G X, -H X^\top)\rangle_x = \langle D(\xi), X\rangle_F$ with the *vertical dual*

$$
D^{\text{inv}}(\xi) = G^\top \xi_G P^{-1} - Q^{-1} \xi_H^\top H, \qquad
D^{\text{mix}}(\xi) = G^\top \xi_G Q - P \xi_H^\top H,
$$

($P = G^\top G + \varepsilon I$, $Q = H^\top H + \varepsilon I$), so $\xi$ is horizontal for
$\mathfrak k$ iff $\pi_{\mathfrak k} D(\xi) = 0$, where $\pi_{\mathfrak k}$ is the
Frobenius-orthogonal projection onto $\mathfrak k$ (for $\mathfrak k = \mathfrak{gl}(h)$ this is
the full GL condition $D(\xi) = 0$).

**The projection.** $\Pi(\xi) = (\xi_G + G X, \xi_H - H X^\top)$ with $X \in \mathfrak k$
solving $\pi_{\mathfrak k}\bigl(D(\xi) + L(X)\bigr) = 0$, where
$L(X) = D(G X, -H X^\top)$ is

$$
L^{\text{inv}}(X) = \hat P X P^{-1} + Q^{-1} X \hat Q, \qquad
L^{\text{mix}}(X) = \hat P X Q + P X \hat Q,
$$

with $\hat P = G^\top G$, $\hat Q = H^\top H$.  $L$ is symmetric positive definite in the
Frobenius inner product ($\langle Y, L(X)\rangle_F$ is the metric inner product of the two
vertical vectors), so its compression $A = \pi_{\mathfrak k} L|_{\mathfrak k}$ is too, and the
system has one solution.  The solver splits $\mathfrak k$ into an explicit part spanned by a
few sparse basis matrices (the rotary pairs) and a full $\mathfrak{gl}$ on the *free* indices
$F$ (partial rotary): $L$ restricted to the free block,
$Y \mapsto \ell_1 Y r_1 + \ell_2 Y r_2$ on $F \times F$, is diagonalised by two generalised
eigenbases (a Sylvester solve, as for the full GL(h) projection), and the explicit part is
eliminated by a Schur complement of size $d$ (the number of explicit basis matrices).
Everything that depends only on the base point is cached in a `SubgroupSystem`; one
projection then costs the $n \times h$ products of the GL(h) projection plus
$O(f^3 + d f^2 + d^2)$.

This module is pure tensor code; it imports nothing from the manifold layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import ShapeError, SubalgebraError
from . import gl
from .linalg import GRAM_DTYPE, compute_dtype, eye_like, sym, transpose

__all__ = [
    "Subalgebra",
    "RotaryCommutant",
    "BlockDiagonal",
    "SubgroupSystem",
    "subgroup_system",
    "vertical_dual",
    "dual_operator",
    "horizontal_residual",
    "horizontal_residual_scale",
    "horizontal_x",
    "project",
]


# ---------------------------------------------------------------------------------------
# Layout: k = span{B_a} ⊕ gl(F), with B_a sparse, Frobenius-orthonormal and zero on F×F
# ---------------------------------------------------------------------------------------
class _Layout(NamedTuple):
    rows: torch.Tensor  # (d, k) long: B_a = Σ_j vals[a, j] E_{rows[a, j], cols[a, j]}
    cols: torch.Tensor  # (d, k) long
    vals: torch.Tensor  # (d, k) float64; padding entries have value 0
    free: torch.Tensor  # (f,) long: indices on which k is all of gl
    free_slice: slice | None  # the free indices as a slice when contiguous (partial rotary)

    @property
    def d(self) -> int:
        return self.rows.shape[0]

    @property
    def f(self) -> int:
        return self.free.shape[0]


def _layout_from_parts(h: int, parts: list[list[tuple[int, int, float]]], free: list[int]):
    k = max((len(p) for p in parts), default=1)
    rows = torch.zeros(len(parts), k, dtype=torch.long)
    cols = torch.zeros(len(parts), k, dtype=torch.long)
    vals = torch.zeros(len(parts), k, dtype=GRAM_DTYPE)
    for a, part in enumerate(parts):
        for j, (r, c, v) in enumerate(part):
            rows[a, j], cols[a, j], vals[a, j] = r, c, v
    free = sorted(free)
    contiguous = bool(free) and free == list(range(free[0], free[0] + len(free)))
    span = slice(free[0], free[0] + len(free)) if contiguous else None
    return _Layout(rows, cols, vals, torch.tensor(free, dtype=torch.long), span)


@lru_cache(maxsize=256)
def _layout_on(sub: Subalgebra, device: torch.device) -> _Layout:
    lay = sub._layout()
    return _Layout(lay.rows.to(device), lay.cols.to(device), lay.vals.to(device),
                   lay.free.to(device), lay.free_slice)


def _coords(lay: _Layout, M: torch.Tensor) -> torch.Tensor:
    """``⟨B_a, M⟩_F`` for the explicit basis: ``(..., h, h) -> (..., d)``."""
    return (M[..., lay.rows, lay.cols] * lay.vals.to(M.dtype)).sum(-1)


def _embed(lay: _Layout, c: torch.Tensor, h: int) -> torch.Tensor:
    """``Σ_a c_a B_a``: ``(..., d) -> (..., h, h)``."""
    batch = c.shape[:-1]
    out = c.new_zeros(*batch, h * h)
    if not lay.d:
        return out.reshape(*batch, h, h)
    src = (c.unsqueeze(-1) * lay.vals.to(c.dtype)).reshape(*batch, -1)
    out.index_add_(-1, (lay.rows * h + lay.cols).reshape(-1), src)
    return out.reshape(*batch, h, h)


def _free_block(lay: _Layout, M: torch.Tensor, h: int) -> torch.Tensor:
    if lay.f == h:
        return M
    s = lay.free_slice
    if s is not None:
        return M[..., s, s]
    F = lay.free
    return M[..., F[:, None], F[None, :]]


def _add_free_block(lay: _Layout, out: torch.Tensor, Y: torch.Tensor, h: int) -> torch.Tensor:
    """``out`` (a fresh tensor, modified in place) plus ``Y`` on the free block."""
    if lay.f == h:
        return out + Y
    s = lay.free_slice
    if s is not None:
        out[..., s, s] += Y
    else:
        F = lay.free
        out[..., F[:, None], F[None, :]] += Y
    return out


def _layout_project(lay: _Layout, X: torch.Tensor, h: int) -> torch.Tensor:
    out = _embed(lay, _coords(lay, X), h) if lay.d else torch.zeros_like(X)
    return _add_free_block(lay, out, _free_block(lay, X, h).clone(), h) if lay.f else out


# ---------------------------------------------------------------------------------------
# Subalgebras
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Subalgebra:
    r"""A Lie subalgebra $\mathfrak k \subseteq \mathfrak{gl}(h)$ (hashable, so blocks can be
    batched by it).

    The group it generates acts on a block by $(G A^{-1}, H A^\top)$, $A \in \exp(\mathfrak k)$;
    the quotient's vertical space is $\{(G X, -H X^\top) : X \in \mathfrak k\}$.

    A subclass describes $\mathfrak k$ by `_layout()`: a few sparse Frobenius-orthonormal basis
    matrices plus the *free* indices $F$ on which $\mathfrak k$ contains all of
    $\mathfrak{gl}(F)$ (the projection solver exploits exactly this split), and may override
    [project][quotient_manifolds.geometry.subgroup.Subalgebra.project] with a faster
    closed form.  A subclass that only overrides `project` gets a dense layout computed from it
    (fine for small $h$).

    Attributes
    ----------
    h : int
        Size of the matrices (the head dimension).
    """

    h: int

    def __post_init__(self) -> None:
        if isinstance(self.h, bool) or not isinstance(self.h, (int, np.integer)) or self.h < 1:
            raise SubalgebraError(f"h must be a positive integer, got {self.h!r}")

    # -- description --------------------------------------------------------------------
    def _layout(self) -> _Layout:
        if type(self).project is Subalgebra.project:
            raise NotImplementedError(
                f"{type(self).__name__} must implement _layout() or project()"
            )
        h = self.h
        E = torch.eye(h * h, dtype=GRAM_DTYPE).reshape(h * h, h, h)
        Pk = self.project(E).reshape(h * h, h * h)
        U, s, _ = torch.linalg.svd(sym(Pk))
        B = U[:, s > 0.5].T  # orthonormal basis of the range, (d, h²)
        idx = torch.arange(h * h)
        parts = [[(int(i) // h, int(i) % h, float(v)) for i, v in zip(idx, b) if v != 0] for b in B]
        return _layout_from_parts(h, parts, [])

    def free(self) -> tuple[int, ...]:
        """The indices $F$ on which $\\mathfrak k$ contains all of $\\mathfrak{gl}(F)$."""
        return tuple(int(i) for i in self._layout().free)

    def dim(self) -> int:
        """$\\dim \\mathfrak k$."""
        lay = self._layout()
        return lay.d + lay.f**2

    def _check_matrix(self, X: torch.Tensor) -> None:
        shape = tuple(X.shape)
        if len(shape) < 2 or shape[-1] != self.h or shape[-2] != self.h:
            raise ShapeError(
                f"{type(self).__name__}(h={self.h}) needs matrices of shape (..., {self.h}, "
                f"{self.h}), got {shape}"
            )

    def project(self, X: torch.Tensor) -> torch.Tensor:
        """Frobenius-orthogonal projection of `X` `(..., h, h)` onto $\\mathfrak k$."""
        self._check_matrix(X)
        return _layout_project(_layout_on(self, X.device), X, self.h)

    def basis(self, dtype: torch.dtype = GRAM_DTYPE,
              device: torch.device | str | None = None) -> torch.Tensor:
        """A Frobenius-orthonormal basis of $\\mathfrak k$, shape `(dim, h, h)`.

        The explicit basis matrices first, then $E_{ab}$ for $a, b \\in F$.
        """
        lay = _layout_on(self, torch.device(device) if device is not None
                         else torch.get_default_device())
        h = self.h
        parts = [_embed(lay, torch.eye(lay.d, dtype=GRAM_DTYPE, device=lay.rows.device), h)]
        if lay.f:
            E = torch.zeros(lay.f, lay.f, h, h, dtype=GRAM_DTYPE, device=lay.rows.device)
            a = torch.arange(lay.f, device=lay.rows.device)
            F = lay.free
            E[a[:, None], a[None, :], F[:, None], F[None, :]] = 1.0
            parts.append(E.reshape(-1, h, h))
        return torch.cat(parts).to(dtype)

    def is_member(
        self, X: torch.Tensor, *, atol: float = 1e-12, rtol: float = 1e-10
    ) -> torch.Tensor:
        """Whether each matrix of `X` `(..., h, h)` lies in $\\mathfrak k$ (bool, leading dims).

        Tests $\\|X - \\pi_{\\mathfrak k} X\\|_\\infty \\le$ `atol` $+$ `rtol` $\\|X\\|_\\infty$.
        For an associative subalgebra (the rotary commutant, block-diagonal algebras) the
        group is the set of invertible members, so this also tests group membership.
        """
        err = (X - self.project(X)).abs().amax((-2, -1))
        return err <= atol + rtol * X.abs().amax((-2, -1))

    def random_algebra_element(
        self,
        generator: torch.Generator | None = None,
        *,
        batch: tuple[int, ...] = (),
        dtype: torch.dtype = GRAM_DTYPE,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """$\\pi_{\\mathfrak k}$ of a standard Gaussian matrix (a Gaussian element of the
        subalgebra), shape `(*batch, h, h)`."""
        Z = torch.randn(*batch, self.h, self.h, generator=generator, dtype=GRAM_DTYPE)
        return self.project(Z).to(dtype=dtype, device=device)

    def random_element(
        self,
        generator: torch.Generator | None = None,
        *,
        scale: float = 1.0,
        dtype: torch.dtype = GRAM_DTYPE,
        batch: tuple[int, ...] = (),
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        r"""A random invertible element $A = \exp(X)$ of the connected group.

        $X$ is a Gaussian element of $\mathfrak k$
        ([random_algebra_element][quotient_manifolds.geometry.subgroup.Subalgebra.random_algebra_element])
        rescaled to spectral norm $\|X\|_2$ = `scale`, so $\kappa_2(A) \le e^{2\,\text{scale}}$
        whatever $h$ and $\mathfrak k$.  Computed in float64 (`torch.linalg.matrix_exp`),
        returned in `dtype`; `batch` draws independent elements (e.g. one per head).
        """
        X = self.random_algebra_element(generator, batch=batch)
        norm = torch.linalg.matrix_norm(X, ord=2).clamp_min(torch.finfo(GRAM_DTYPE).tiny)
        A = torch.linalg.matrix_exp(X * (float(scale) / norm)[..., None, None])
        return A.to(dtype=dtype, device=device)

    def check_closed(self, *, atol: float = 1e-10) -> None:
        """Raise [SubalgebraError][quotient_manifolds.errors.SubalgebraError] unless
        $\\mathfrak k$ is closed under the commutator (a Lie subalgebra), checked on its basis."""
        B = self.basis()
        C = torch.einsum("aij,bjk->abik", B, B)
        C = C - C.transpose(0, 1)
        err = (C - self.project(C)).abs().max().item() if B.shape[0] else 0.0
        if err > atol:
            raise SubalgebraError(
                f"{self!r} is not closed under [X, Y] = XY - YX (error {err:.3g}); "
                "the quotient needs a Lie subalgebra"
            )


def _check_index(h: int, i: Any, what: str) -> int:
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < h:
        raise SubalgebraError(f"{what}: index {i!r} is not in range(h) = range({h})")
    return int(i)


@dataclass(frozen=True)
class RotaryCommutant(Subalgebra):
    r"""The commutant of rotary position embeddings (RoPE).

    Elements act on each rotary pair $(i, j)$ as a scaled rotation
    $\begin{pmatrix} a & -b \\ b & a \end{pmatrix}$ in the $(i, j)$ plane (one
    $\mathfrak{gl}(1, \mathbb C)$ per pair), and as an arbitrary matrix on the indices in no pair
    (partial rotary); pairs and free indices do not mix.  $\dim \mathfrak k = 2p + f^2$ for $p$
    pairs and $f$ free indices.  With distinct frequencies this is exactly the set of matrices
    that commute with every rotation $R(\theta)$ of the embedding (see the subgroups docs page).
    It is an associative algebra, closed under transpose, and its group is its set of invertible
    elements.

    Attributes
    ----------
    h : int
        Head dimension.
    pairs : tuple of (int, int)
        The coordinate pairs that the embedding rotates together: $(i, i + r/2)$ for
        $i < r/2$ in the rotate-half layout (HF Llama, GPT-NeoX; $r$ rotary dimensions),
        $(2i, 2i + 1)$ in the interleaved layout (GPT-J, timm EVA).  Build them with
        [rotate_half][quotient_manifolds.geometry.subgroup.RotaryCommutant.rotate_half] or
        [interleaved][quotient_manifolds.geometry.subgroup.RotaryCommutant.interleaved].
        `pairs=()` is all of $\mathfrak{gl}(h)$.
    """

    pairs: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        pairs = tuple(tuple(p) for p in self.pairs)
        seen: set[int] = set()
        for p in pairs:
            if len(p) != 2:
                raise SubalgebraError(f"rotary pair {p!r} must have two indices")
            i, j = (_check_index(self.h, t, f"rotary pair {p!r}") for t in p)
            if i == j or i in seen or j in seen:
                raise SubalgebraError(
                    f"rotary pair {p!r} repeats an index; pairs must be disjoint "
                    "(use RotaryCommutant.rotate_half / .interleaved to build them)"
                )
            seen |= {i, j}
        object.__setattr__(self, "pairs", tuple((int(i), int(j)) for i, j in pairs))

    @classmethod
    def rotate_half(cls, h: int, rotary_dims: int | None = None) -> RotaryCommutant:
        """Pairs $(i, i + r/2)$, $i < r/2$, on the first $r$ = `rotary_dims` (default $h$)
        dimensions (HF `rotate_half`: Llama, Mistral, Qwen, GPT-NeoX with `rotary_pct`)."""
        r = h if rotary_dims is None else int(rotary_dims)
        if r % 2 or not 0 <= r <= h:
            raise SubalgebraError(f"rotary_dims must be even and in [0, h={h}], got {rotary_dims}")
        return cls(h, tuple((i, i + r // 2) for i in range(r // 2)))

    @classmethod
    def interleaved(cls, h: int, rotary_dims: int | None = None) -> RotaryCommutant:
        """Pairs $(2i, 2i + 1)$ on the first `rotary_dims` (default $h$) dimensions
        (GPT-J, timm EVA, Meta's original Llama code)."""
        r = h if rotary_dims is None else int(rotary_dims)
        if r % 2 or not 0 <= r <= h:
            raise SubalgebraError(f"rotary_dims must be even and in [0, h={h}], got {rotary_dims}")
        return cls(h, tuple((2 * i, 2 * i + 1) for i in range(r // 2)))

    def free(self) -> tuple[int, ...]:
        """Indices in no pair."""
        used = {i for p in self.pairs for i in p}
        return tuple(i for i in range(self.h) if i not in used)

    def dim(self) -> int:
        return 2 * len(self.pairs) + len(self.free()) ** 2

    def _layout(self) -> _Layout:
        s = 1.0 / math.sqrt(2.0)
        parts = []
        for i, j in self.pairs:
            parts.append([(i, i, s), (j, j, s)])  # (E_ii + E_jj)/√2: the scale a
            parts.append([(j, i, s), (i, j, -s)])  # (E_ji − E_ij)/√2: the rotation b
        return _layout_from_parts(self.h, parts, list(self.free()))

    def _partner(self) -> list[int]:
        perm = list(range(self.h))
        for i, j in self.pairs:
            perm[i], perm[j] = j, i
        return perm

    def _masks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        h = self.h
        F, D, O = (np.zeros((h, h), dtype=np.int64) for _ in range(3))
        free = list(self.free())
        F[np.ix_(free, free)] = 1
        for i, j in self.pairs:
            D[i, i] = D[j, j] = 1
            O[i, j] = O[j, i] = 1
        return F, D, O

    def project(self, X: Any) -> Any:
        r"""Frobenius-orthogonal projection onto $\mathfrak k$.

        On a pair $(i, j)$: $a = \tfrac12(X_{ii} + X_{jj})$, $b = \tfrac12(X_{ji} - X_{ij})$;
        the free block is kept, everything else is zeroed.  Written with indexing and
        elementwise products only, so it also runs on the SymPy tensors of the symbolic checks.
        """
        if isinstance(X, torch.Tensor):
            self._check_matrix(X)
            if not self.pairs:
                return X.clone()
            perm, (F, D, O) = _rotary_tensors(self, X.device, X.dtype)
            Y = X[..., perm, :][..., perm]
        else:  # symbolic tensors: exact integer masks, Python index lists
            if not self.pairs:
                return X
            perm = self._partner()
            F, D, O = self._masks()
            Y = X[..., perm, :][..., :, perm]
        return X * F + (X + Y) * D * 0.5 + (X - Y) * O * 0.5

    def rotation(self, angles: torch.Tensor) -> torch.Tensor:
        r"""The rotation $R(\theta)$ `(..., h, h)` with angle $\theta_p$ = `angles[..., p]` on
        pair $p = (i, j)$ (it maps $e_i \mapsto \cos\theta_p e_i + \sin\theta_p e_j$) and the
        identity on the free indices."""
        if angles.shape[-1:] != (len(self.pairs),):
            raise ShapeError(f"angles must have shape (..., {len(self.pairs)}), got "
                             f"{tuple(angles.shape)}")
        R = torch.eye(self.h, dtype=angles.dtype, device=angles.device)
        R = R.expand(*angles.shape[:-1], self.h, self.h).clone()
        if self.pairs:
            i = torch.tensor([p[0] for p in self.pairs], device=angles.device)
            j = torch.tensor([p[1] for p in self.pairs], device=angles.device)
            c, s = torch.cos(angles), torch.sin(angles)
            R[..., i, i] = c
            R[..., j, j] = c
            R[..., j, i] = s
            R[..., i, j] = -s
        return R


@lru_cache(maxsize=256)
def _rotary_tensors(sub: RotaryCommutant, device: torch.device, dtype: torch.dtype):
    perm = torch.tensor(sub._partner(), device=device)
    masks = tuple(torch.as_tensor(m, dtype=dtype, device=device) for m in sub._masks())
    return perm, masks


@dataclass(frozen=True)
class BlockDiagonal(Subalgebra):
    r"""Block-diagonal matrices $\bigoplus_i \mathfrak{gl}(B_i)$ for a partition of `range(h)`.

    Every block is a full $\mathfrak{gl}$ on its indices; entries between blocks are zero.
    Singleton blocks give the diagonal matrices.  The largest block is the solver's free
    block; the others are explicit.

    Attributes
    ----------
    h : int
        Matrix size.
    blocks : tuple of tuple of int
        Disjoint index blocks covering `range(h)`.
    """

    blocks: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        blocks = tuple(tuple(_check_index(self.h, i, f"block {b!r}") for i in b)
                       for b in self.blocks)
        flat = [i for b in blocks for i in b]
        if sorted(flat) != list(range(self.h)) or any(not b for b in blocks):
            raise SubalgebraError(
                f"blocks {self.blocks!r} must be non-empty, disjoint and cover range({self.h})"
            )
        object.__setattr__(self, "blocks", blocks)

    def _largest(self) -> int:
        return max(range(len(self.blocks)), key=lambda k: len(self.blocks[k]))

    def _layout(self) -> _Layout:
        big = self._largest()
        parts = [[(a, b, 1.0)] for k, blk in enumerate(self.blocks) if k != big
                 for a in blk for b in blk]
        return _layout_from_parts(self.h, parts, sorted(self.blocks[big]))

    def dim(self) -> int:
        return sum(len(b) ** 2 for b in self.blocks)

    def _mask(self) -> np.ndarray:
        M = np.zeros((self.h, self.h), dtype=np.int64)
        for b in self.blocks:
            M[np.ix_(b, b)] = 1
        return M

    def project(self, X: Any) -> Any:
        """Zero the entries between blocks."""
        if isinstance(X, torch.Tensor):
            self._check_matrix(X)
            return X * torch.as_tensor(self._mask(), dtype=X.dtype, device=X.device)
        return X * self._mask()


# ---------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------
class SubgroupSystem(NamedTuple):
    r"""What the projection of one base point (batch of blocks) caches, all float64.

    The free block's operator $Y \mapsto \ell_1 Y r_1 + \ell_2 Y r_2$ is inverted as
    $Y = W_1 \bigl((W_1^\top R W_2) \odot \text{inv\_denom}\bigr) W_2^\top$, with
    $W_1^\top \ell_2 W_1 = I$, $W_1^\top \ell_1 W_1 = \operatorname{diag}(d_1)$,
    $W_2^\top r_1 W_2 = I$, $W_2^\top r_2 W_2 = \operatorname{diag}(d_2)$ and
    `inv_denom` $= 1/(d_{1,i} + d_{2,j})$ (0 where that vanishes); for mix at $\varepsilon = 0$
    the operator is $2 P_{FF} Y Q_{FF}$, `inv_denom` is `None` and `W1`, `W2` hold
    $\tfrac12 P_{FF}^{-1}$ and $Q_{FF}^{-1}$ (so $Y = W_1 R W_2^\top$).  `K[a]` is that inverse
    applied to the free block of $L(B_a)$, stored in the eigenbasis
    ($\tilde K_a = (W_1^\top L(B_a)_{FF} W_2) \odot \text{inv\_denom}$, so that
    $A_{ff}^{-1} L(B_a)_{FF} = W_1 \tilde K_a W_2^\top$) or, when `inv_denom` is `None`, in the
    original basis; the Schur complement
    $S = A_{pp} - A_{pf} A_{ff}^{-1} A_{fp}$ of the explicit part is kept as its eigenvectors
    and inverted eigenvalues (zero where a direction is degenerate: both factors rank
    deficient, which only the $\varepsilon$ relaxation allows).  Fields that a subalgebra does
    not need (no free block, no explicit part) are `None`.
    """

    W1: torch.Tensor | None
    W2: torch.Tensor | None
    inv_denom: torch.Tensor | None
    K: torch.Tensor | None
    S_vecs: torch.Tensor | None
    S_inv_vals: torch.Tensor | None


def _operator_factors(grams: gl.Grams, metric: str):
    """``(ℓ₁, r₁, ℓ₂, r₂)`` with ``L(X) = ℓ₁ X r₁ + ℓ₂ X r₂`` (float64)."""
    if metric not in gl.METRICS:
        raise ValueError(f"metric must be one of {gl.METRICS}, got {metric!r}")
    P, Q, eps = grams.P, grams.Q, grams.eps
    P_hat = P - eps * eye_like(P) if eps else P
    Q_hat = Q - eps * eye_like(Q) if eps else Q
    if metric == "inv":
        return P_hat, grams.P_inv, grams.Q_inv, Q_hat
    return P_hat, Q, P, Q_hat


def dual_operator(X: Any, grams: gl.Grams, metric: str) -> Any:
    r"""$L(X) = D(G X, -H X^\top)$: inv $\hat P X P^{-1} + Q^{-1} X \hat Q$, mix
    $\hat P X Q + P X \hat Q$ ($\hat P = P - \varepsilon I = G^\top G$).

    Frobenius-symmetric and positive definite for full-rank factors; the projection solves its
    compression to $\mathfrak k$.  Runs on torch or SymPy tensors.
    """
    l1, r1, l2, r2 = _operator_factors_any(grams, metric)
    return l1 @ X @ r1 + l2 @ X @ r2


def _operator_factors_any(grams: gl.Grams, metric: str):
    if isinstance(grams.P, torch.Tensor):
        return _operator_factors(grams, metric)
    P, Q, eps = grams.P, grams.Q, grams.eps or 0  # symbolic: no eye_like
    h = P.shape[-1]
    I = np.eye(h, dtype=np.int64)
    P_hat, Q_hat = (P - I * eps, Q - I * eps) if eps else (P, Q)
    if metric == "inv":
        return P_hat, grams.P_inv, grams.Q_inv, Q_hat
    return P_hat, Q, P, Q_hat


def _gen_eig(A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``W, d`` with ``Wᵀ B W = I`` and ``Wᵀ A W = diag(d)`` (``A`` symmetric, ``B`` SPD)."""
    L = torch.linalg.cholesky(B)
    I = eye_like(B).expand_as(B)
    L_inv = torch.linalg.solve_triangular(L, I, upper=False)
    d, U = torch.linalg.eigh(sym(L_inv @ A @ transpose(L_inv)))
    return transpose(L_inv) @ U, d


def _compress(lay: _Layout, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``⟨B_a, left B_b right⟩_F`` for the explicit basis, ``(..., d, d)``, from gathers only.

    ``Σ_{j,j'} v_{aj} v_{bj'} left[r_{aj}, r_{bj'}] right[c_{bj'}, c_{aj}]``: ``O(d²k²)``.
    """
    r, c, w = lay.rows.reshape(-1), lay.cols.reshape(-1), lay.vals.reshape(-1).to(left.dtype)
    M = left[..., r[:, None], r[None, :]] * right[..., c[None, :], c[:, None]]
    M = M * (w[:, None] * w[None, :])
    d, k = lay.rows.shape
    return M.reshape(*M.shape[:-2], d, k, d, k).sum((-3, -1))


def _free_part(lay: _Layout, left: torch.Tensor, right: torch.Tensor, h: int) -> torch.Tensor:
    """The free block of ``left B_a right`` for every explicit ``B_a``: ``(..., d, f, f)``."""
    F = lay.free
    lg = left[..., F, :][..., :, lay.rows]  # (..., f, d, k)
    rg = right[..., lay.cols, :][..., F]  # (..., d, k, f)
    return torch.einsum("...idk,dk,...dkj->...dij", lg, lay.vals.to(left.dtype), rg)


def _free_part_mapped(lay: _Layout, left, right, W1, W2) -> torch.Tensor:
    """``W₁ᵀ (left B_a right)_FF W₂`` for every explicit ``B_a``: ``(..., d, f, f)``."""
    s = lay.free_slice
    lF = left[..., s, :] if s is not None else left[..., lay.free, :]  # (..., f, h)
    rF = right[..., :, s] if s is not None else right[..., :, lay.free]  # (..., h, f)
    T = transpose(W1) @ lF  # (..., f, h)
    U = rF @ W2  # (..., h, f)
    return torch.einsum("...idk,dk,...dkj->...dij", T[..., :, lay.rows],
                        lay.vals.to(left.dtype), U[..., lay.cols, :])


def subgroup_system(
    G: torch.Tensor,
    H: torch.Tensor,
    grams: gl.Grams,
    metric: str,
    sub: Subalgebra,
) -> SubgroupSystem:
    r"""Cache the base point's part of the projection onto the $\mathfrak k$-horizontal space.

    Batched over the leading dimensions of `grams` (heads, layers); float64.  Cost: two
    generalised eigendecompositions of the free block ($O(f^3)$), the free-block coupling of
    the explicit basis in those eigenbases ($O(f^2 h + d k f^2)$, the basis matrices having
    $k$ entries each) and one eigendecomposition of the $d \times d$ Schur complement.  `G` and `H`
    are not read (the Gram matrices carry everything); they are part of the signature so that
    all kernels take the same arguments.
    """
    h = grams.P.shape[-1]
    if sub.h != h:
        raise ShapeError(f"the subalgebra has h = {sub.h} but the block has h = {h}")
    lay = _layout_on(sub, grams.P.device)
    l1, r1, l2, r2 = _operator_factors(grams, metric)
    W1 = W2 = inv_denom = K = S_vecs = S_inv = None
    if lay.f:
        fb = lambda M: _free_block(lay, M, h)  # noqa: E731
        W1, d1 = _gen_eig(fb(l1), fb(l2))
        W2, d2 = _gen_eig(fb(r2), fb(r1))
        if metric == "mix" and not grams.eps:
            # ℓ₁ = ℓ₂ = P and r₁ = r₂ = Q: A_ff(Y) = 2 P_FF Y Q_FF, d₁ = d₂ = 1, so
            # A_ff⁻¹(R) = ½ (W₁W₁ᵀ) R (W₂W₂ᵀ) = ½ P_FF⁻¹ R Q_FF⁻¹: two products instead of four
            W1, W2 = 0.5 * (W1 @ transpose(W1)), W2 @ transpose(W2)
        else:
            denom = d1.unsqueeze(-1) + d2.unsqueeze(-2)
            safe = denom.abs() > torch.finfo(GRAM_DTYPE).tiny
            inv_denom = torch.where(safe, 1.0 / torch.where(safe, denom, 1.0), 0.0)
    if lay.d:
        S = _compress(lay, l1, r1) + _compress(lay, l2, r2)  # ⟨B_a, L(B_b)⟩
        if lay.f:
            # W₁ᵀ A_fp[a] W₂ from the sparse B_a: A_fp[a] = Σ_t (ℓ_t B_a r_t)_FF is a sum of
            # a few outer products, so this costs O(f² h) instead of d free-block solves.
            At = (_free_part_mapped(lay, l1, r1, W1, W2)
                  + _free_part_mapped(lay, l2, r2, W1, W2))
            if inv_denom is None:  # separable: K_a = W₁ A_fp[a] W₂ in the original basis
                K = At.contiguous()
                Afp = _free_part(lay, l1, r1, h) + _free_part(lay, l2, r2, h)
                S = S - torch.einsum("...aij,...bij->...ab", Afp, K)
            else:  # K̃_a = (W₁ᵀ A_fp[a] W₂) ⊙ inv_denom, kept in the eigenbasis
                K = (At * inv_denom.unsqueeze(-3)).contiguous()
                S = S - torch.einsum("...aij,...bij->...ab", At, K)
        evals, S_vecs = torch.linalg.eigh(sym(S))
        tol = evals.abs().amax(-1, keepdim=True) * (lay.d * torch.finfo(GRAM_DTYPE).eps)
        keep = evals > tol.clamp_min(torch.finfo(GRAM_DTYPE).tiny)
        S_inv = torch.where(keep, 1.0 / torch.where(keep, evals, 1.0), 0.0)
    return SubgroupSystem(W1, W2, inv_denom, K, S_vecs, S_inv)


def vertical_dual(
    G: Any, H: Any, uG: Any, uH: Any, grams: gl.Grams, metric: str
) -> Any:
    r"""The $h \times h$ matrix $D(\xi)$ (float64) with
    $\langle \xi, (G X, -H X^\top)\rangle_x = \langle D(\xi), X\rangle_F$ for every $X$.

    inv: $G^\top \xi_G P^{-1} - Q^{-1} \xi_H^\top H$; mix: $G^\top \xi_G Q - P \xi_H^\top H$.
    The $n \times h$ products run in the working dtype (float32, or float64 for float64
    inputs), the rest in float64.  Runs on torch or SymPy tensors.
    """
    if isinstance(uG, torch.Tensor):
        dt = compute_dtype(uG.dtype)
        G, H, uG, uH = (t.to(dt) for t in (G, H, uG, uH))
    GtuG = (transpose(G) @ uG).to(GRAM_DTYPE)
    uHtH = (transpose(uH) @ H).to(GRAM_DTYPE)
    if metric == "inv":
        return GtuG @ grams.P_inv - grams.Q_inv @ uHtH
    if metric == "mix":
        return GtuG @ grams.Q - grams.P @ uHtH
    raise ValueError(f"metric must be one of {gl.METRICS}, got {metric!r}")


def horizontal_residual(
    G: Any, H: Any, uG: Any, uH: Any, grams: gl.Grams, metric: str, sub: Subalgebra
) -> Any:
    r"""$\pi_{\mathfrak k} D(\xi)$ (float64, in $\mathfrak k$): zero iff $\xi$ is horizontal for
    the subgroup, and $\langle \xi, (G X, -H X^\top)\rangle_x = \langle \text{residual},
    X\rangle_F$ for every $X \in \mathfrak k$.  Runs on torch or SymPy tensors."""
    return sub.project(vertical_dual(G, H, uG, uH, grams, metric))


def horizontal_residual_scale(
    G: torch.Tensor,
    H: torch.Tensor,
    uG: torch.Tensor,
    uH: torch.Tensor,
    grams: gl.Grams,
    metric: str,
    sub: Subalgebra,
) -> torch.Tensor:
    r"""Elementwise size of the residual's terms, for relative tolerances.

    The projection onto $\mathfrak k$ with every coefficient replaced by its absolute value,
    applied to $|a| + |b|$ where $D(\xi) = a - b$ (so cancellation inside the projection
    cannot make the scale smaller than the rounding error of the terms).
    """
    dt = compute_dtype(uG.dtype)
    G, H, uG, uH = (t.to(dt) for t in (G, H, uG, uH))
    GtuG, uHtH = (transpose(G) @ uG).to(GRAM_DTYPE), (transpose(uH) @ H).to(GRAM_DTYPE)
    if metric == "inv":
        a, b = GtuG @ grams.P_inv, grams.Q_inv @ uHtH
    else:
        a, b = GtuG @ grams.Q, grams.P @ uHtH
    T = a.abs() + b.abs()
    lay = _layout_on(sub, T.device)
    abs_lay = lay._replace(vals=lay.vals.abs())
    return _layout_project(abs_lay, T, sub.h)


def horizontal_x(
    G: torch.Tensor,
    H: torch.Tensor,
    uG: torch.Tensor,
    uH: torch.Tensor,
    grams: gl.Grams,
    metric: str,
    sub: Subalgebra,
    system: SubgroupSystem | None = None,
) -> torch.Tensor:
    r"""$X \in \mathfrak k$ (float64, `(..., h, h)`) with $\pi_{\mathfrak k}(D(\xi) + L(X)) = 0$,
    so that $(\xi_G + G X, \xi_H - H X^\top)$ is horizontal.

    Direct solve (no iteration): the free block by its simultaneous eigenbases, the explicit
    part by the cached Schur complement.
    """
    if system is None:
        system = subgroup_system(G, H, grams, metric, sub)
    h = sub.h
    R = vertical_dual(G, H, uG, uH, grams, metric)
    lay = _layout_on(sub, R.device)
    W1, W2, inv_denom, K, S_vecs, S_inv = system
    X = torch.zeros_like(R)
    if lay.f:  # subgroup_system sets W1, W2 when there is a free block
        assert W1 is not None and W2 is not None
        r_f = _free_block(lay, R, h)
        if inv_denom is None:  # separable: Y = W₁ R W₂ (symmetric W), K in the original basis
            Rk, Z = r_f, -(W1 @ r_f @ W2)
        else:  # in the eigenbasis: R̃ = W₁ᵀ R W₂, Z̃ = −R̃ ⊙ inv_denom, Y = W₁ Z̃ W₂ᵀ
            Rk = transpose(W1) @ r_f @ W2
            Z = -(Rk * inv_denom)
    if lay.d:  # subgroup_system sets S_vecs, S_inv (and K, with a free block) here
        assert S_vecs is not None and S_inv is not None
        rhs = -_coords(lay, R)
        if lay.f:  # + ⟨K_a, r_f⟩_F (= ⟨K̃_a, R̃⟩_F in the eigenbasis)
            assert K is not None
            # as a row vector times Kᵀ: batched gemv with a column vector is far slower on CPU
            rhs = rhs + (Rk.reshape(*Rk.shape[:-2], 1, -1) @ transpose(K.flatten(-2))).squeeze(-2)
        c = S_vecs @ (S_inv.unsqueeze(-1) * (transpose(S_vecs) @ rhs.unsqueeze(-1)))
        X = _embed(lay, c.squeeze(-1), h)
        if lay.f:  # − Σ_a c_a K_a
            assert K is not None
            Z = Z - (transpose(c) @ K.flatten(-2)).reshape(Z.shape)
    if lay.f:
        assert W1 is not None and W2 is not None
        Y = Z if inv_denom is None else W1 @ Z @ transpose(W2)
        X = _add_free_block(lay, X, Y, h)
    return X


def project(
    G: torch.Tensor,
    H: torch.Tensor,
    uG: torch.Tensor,
    uH: torch.Tensor,
    grams: gl.Grams,
    metric: str,
    sub: Subalgebra,
    system: SubgroupSystem | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Metric-orthogonal projection onto the horizontal space of the subgroup quotient.

    $\Pi(\xi) = (\xi_G + G X, \xi_H - H X^\top)$ with $X$ from
    [horizontal_x][quotient_manifolds.geometry.subgroup.horizontal_x]; the result is orthogonal,
    in the (relaxed) inv or mix metric, to every $(G Y, -H Y^\top)$ with $Y \in \mathfrak k$.
    Pass the base point's `system`
    ([subgroup_system][quotient_manifolds.geometry.subgroup.subgroup_system]) when projecting
    many vectors at one point.  Batched over leading dimensions; returned in the dtype of
    `uG`.
    """
    out_dt = uG.dtype
    X = horizontal_x(G, H, uG, uH, grams, metric, sub, system)
    dt = compute_dtype(out_dt)
    G, H, uG, uH = (t.to(dt) for t in (G, H, uG, uH))
    vG, vH = gl.vertical(G, H, X.to(dt))
    return (uG + vG).to(out_dt), (uH + vH).to(out_dt)
