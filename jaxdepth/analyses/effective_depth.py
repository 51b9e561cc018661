"""Effective depth from the per-layer curves, and the depth score (METHODS §6).

Every rule returns an `EffectiveDepth` that says explicitly when no layer qualifies, instead
of raising (as the reference does for cosine) or returning -1 (which silently becomes a ratio
of 0 in the reference tables).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

__all__ = [
    "EffectiveDepth",
    "cosine_effective_depth",
    "kl_effective_depth",
    "overlap_effective_depth",
    "depth_score",
    "depth_effects",
]


@dataclasses.dataclass(frozen=True)
class EffectiveDepth:
    """`layer` is the effective depth (None when no layer qualifies): an index l = 0..L-2 of the
    curve it was read from (for the logit-lens curves, the boundary h_l). `num_layers` is L,
    `ratio` = (layer + 1) / L (None with no crossing), `rule` names how it was read.
    `str()` gives "l (ratio r)" or "no crossing (rule)"."""

    layer: Optional[int]
    num_layers: int
    rule: str

    @property
    def ratio(self) -> Optional[float]:
        """(layer + 1) / L, the share of the depth used; None when no layer qualifies."""
        return None if self.layer is None else (self.layer + 1) / self.num_layers

    @property
    def found(self) -> bool:
        """Whether a layer qualifies (`layer` is not None)."""
        return self.layer is not None

    def __str__(self) -> str:
        if self.layer is None:
            return f"no crossing ({self.rule})"
        return f"{self.layer} (ratio {self.ratio:.3f})"


def _first(indices) -> Optional[int]:
    return int(indices[0]) if len(indices) else None


def _curve(values) -> np.ndarray:
    c = np.asarray(values, np.float64)
    if c.ndim != 1 or len(c) < 2:
        raise ValueError(f"a per-layer curve of at least 2 layers is needed, got shape {c.shape}")
    if not np.all(np.isfinite(c)):
        raise ValueError("the curve contains NaN or infinite values")
    return c


def cosine_effective_depth(mean_cosine) -> EffectiveDepth:
    """The last l <= L-2 where the mean cosine crosses from negative to non-negative:
    c[l] < 0 and c[l+1] >= 0."""
    c = _curve(mean_cosine)
    hits = np.nonzero((c[:-1] < 0) & (c[1:] >= 0))[0]
    return EffectiveDepth(int(hits[-1]) if len(hits) else None, len(c), "cosine: last c[l] < 0 <= c[l+1]")


def kl_effective_depth(kl, fraction: float = 0.5) -> EffectiveDepth:
    """The first l <= L-2 with KL[l] < fraction * max(KL)."""
    c = _curve(kl)
    return EffectiveDepth(
        _first(np.nonzero(c[:-1] < fraction * c.max())[0]), len(c), f"KL: first KL[l] < {fraction} max KL"
    )


def overlap_effective_depth(overlap, threshold: float = 0.3) -> EffectiveDepth:
    """The first l <= L-2 with top-5 overlap[l] > threshold."""
    c = _curve(overlap)
    return EffectiveDepth(_first(np.nonzero(c[:-1] > threshold)[0]), len(c), f"overlap: first overlap[l] > {threshold}")


def depth_effects(later) -> np.ndarray:
    """Each skipped layer's mean effect on the layers after it, from the `[L, L]` skip-effect
    matrix D: e_s = sum_j D[s, j] / max(L-1-s, 1) (what the depth score weighs)."""
    D = np.asarray(later, np.float64)
    L = D.shape[0]
    if D.shape != (L, L):
        raise ValueError(f"expected a square [L, L] matrix, got {D.shape}")
    return D.sum(axis=1) / np.maximum(L - 1 - np.arange(L), 1)


def depth_score(later) -> float:
    """First study's depth score from the `[L, L]` skip-effect matrix D:
    d = sum_s s e_s / sum_s e_s with e = `depth_effects(D)`."""
    e = depth_effects(later)
    L = len(e)
    if e.sum() <= 0:
        raise ValueError("all skip effects are zero: the depth score is undefined")
    return float(np.sum(np.arange(L) * e) / e.sum())
