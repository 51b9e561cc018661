"""How much the effective depths depend on the prompts: a bootstrap over prompts (METHODS §6).

An effective depth is read off a curve averaged over a few prompts (ten in the second study),
and where that curve passes within a few thousandths of a threshold one prompt more or less
moves the depth by a layer. Resampling the prompts with replacement, re-aggregating their
curves exactly as the result aggregates them and reading the depth again shows how far it
moves. Everything here is numpy on saved results: nothing is recomputed on the model.

All quantities of one result share one index matrix (`resample_indices`), so for one seed
the KL and overlap depths of a resample come from the same prompts, and so do the results of
other analyses run on the same prompts.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from jaxdepth.analyses import effective_depth as ed
from jaxdepth.analyses.effective_depth import EffectiveDepth

__all__ = [
    "effective_depth_intervals",
    "curve_bands",
    "per_prompt_depths",
    "depth_score_interval",
    "DepthInterval",
    "CurveBand",
    "ScoreInterval",
    "resample_indices",
    "resampled_curves",
    "prompt_mean_band",
    "aggregate",
    "depth_interval",
    "curve_band",
    "DEFAULT_RESAMPLES",
    "DEFAULT_SEED",
    "DEFAULT_LEVEL",
    "WEIGHTINGS",
    "has_per_prompt",
]

DEFAULT_RESAMPLES = 1000
DEFAULT_SEED = 0
DEFAULT_LEVEL = 0.95
WEIGHTINGS = ("prompt", "token")


# ----------------------------------------------------------------------------- resampling


def resample_indices(num_prompts: int, *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> np.ndarray:
    """`[resamples, num_prompts]` prompt indices drawn with replacement by one
    `numpy.random.default_rng(seed)`: row r is the r-th bootstrap sample of the prompts."""
    if num_prompts < 1:
        raise ValueError(f"a bootstrap over prompts needs at least one prompt, got {num_prompts}")
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    return np.random.default_rng(seed).integers(0, num_prompts, size=(resamples, num_prompts))


def _multiplicities(indices: np.ndarray, num_prompts: int) -> np.ndarray:
    """`[R, N]`: how often each prompt occurs in each resample."""
    R = indices.shape[0]
    flat = (indices + num_prompts * np.arange(R)[:, None]).ravel()
    return np.bincount(flat, minlength=R * num_prompts).reshape(R, num_prompts).astype(np.float64)


def _weights(weighting: str, counts: np.ndarray) -> np.ndarray:
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    return np.asarray(counts, np.float64) if weighting == "token" else np.ones(len(counts))


def aggregate(per_prompt: np.ndarray, counts: np.ndarray, weighting: str) -> np.ndarray:
    """The aggregate curve `[L]` from per-prompt curves `[N, L]` (each a mean over that prompt's
    tokens) and token counts `[N]`: 'prompt' is their plain mean, 'token' their count-weighted
    mean (= the mean over every token of every prompt)."""
    per_prompt = np.asarray(per_prompt, np.float64)
    w = _weights(weighting, counts)
    if weighting == "prompt":
        # Summed as `stats.prompt_mean` sums, along the last axis of a C-ordered [L, N] array, so
        # the stored curve comes back bit for bit whatever the layout of `per_prompt`.
        return np.ascontiguousarray(per_prompt.T).mean(axis=-1)
    return np.sum(w[:, None] * per_prompt, axis=0) / w.sum()


def resampled_curves(per_prompt: np.ndarray, counts: np.ndarray, weighting: str, indices: np.ndarray) -> np.ndarray:
    """`[R, L]`: the aggregate curve of each resample of `indices [R, N]`, a prompt drawn k
    times counting k times (as `aggregate` would count k copies of it)."""
    per_prompt = np.asarray(per_prompt, np.float64)
    # A [R, N] x [N, L] product instead of gathering [R, N, L]: memory stays O(R (N + L)).
    w = _multiplicities(indices, per_prompt.shape[0]) * _weights(weighting, counts)[None]
    return (w @ per_prompt) / w.sum(axis=1, keepdims=True)


def prompt_mean_band(
    per_prompt: np.ndarray, resamples: int, seed: int
) -> tuple[Optional[np.ndarray], Optional[CurveBand], int]:
    """The mean curve `[L]` of per-prompt curves `[N, L]` over the prompts whose curve is finite
    everywhere (None when none is), its 95% bootstrap band over those prompts (None without
    resamples or with fewer than two of them), and their count: the band of a figure that
    draws a per-prompt quantity's mean (the geometry profile, the layer Jacobians)."""
    kept = per_prompt[np.all(np.isfinite(per_prompt), axis=1)].astype(np.float64)
    if not len(kept):
        return None, None, 0
    counts = np.ones(len(kept))
    mean = aggregate(kept, counts, "prompt")
    if resamples <= 0 or len(kept) < 2:
        return mean, None, len(kept)
    indices = resample_indices(len(kept), resamples=resamples, seed=seed)
    return mean, curve_band(resampled_curves(kept, counts, "prompt", indices)), len(kept)


# ----------------------------------------------------------------------------- summaries


def _bounds(level: float) -> tuple[float, float]:
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    return 100 * (1 - level) / 2, 100 * (1 + level) / 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class DepthInterval:
    """Bootstrap distribution of one effective depth.

    `point` is the depth of the full data. `low` and `high` are the percentile interval at
    `level` (2.5th and 97.5th percentiles for 0.95), read as the nearest resampled depths
    outward ('lower' and 'higher'), so they are layers a resample really gave. A resample
    where no layer qualifies sorts after every layer; a bound that falls on such resamples is
    None. `shares` maps each depth to the share of resamples giving it, None (no layer
    qualifies) included; the shares add up to 1.
    """

    method: str
    point: EffectiveDepth
    low: Optional[int]
    high: Optional[int]
    level: float
    shares: Mapping[Optional[int], float]
    resamples: int
    num_prompts: int

    @property
    def num_layers(self) -> int:
        """L, the model's number of layers (the denominator of the ratios)."""
        return self.point.num_layers

    @property
    def ratio_low(self) -> Optional[float]:
        """(low + 1) / L; the ratio is monotone in the depth, so this bounds the ratio."""
        return None if self.low is None else (self.low + 1) / self.num_layers

    @property
    def ratio_high(self) -> Optional[float]:
        """(high + 1) / L, the upper bound of the ratio; None where `high` is None."""
        return None if self.high is None else (self.high + 1) / self.num_layers

    def share(self, layer: Optional[int]) -> float:
        """Share of resamples giving depth `layer` (None: no layer qualifies)."""
        return self.shares.get(layer, 0.0)


def depth_interval(
    method: str,
    point: EffectiveDepth,
    resampled: Sequence[Optional[int]],
    *,
    level: float = DEFAULT_LEVEL,
    num_prompts: int,
) -> DepthInterval:
    """Summarise resampled depths (None where no layer qualifies) as a `DepthInterval`."""
    if len(resampled) == 0:
        raise ValueError("no resampled depths")
    L = point.num_layers
    # L stands for "no layer qualifies": every rule reads layers <= L-2, so it sorts last, and
    # 'lower' / 'higher' return values that occur, so it maps back to None exactly.
    values = np.array([L if d is None else d for d in resampled], np.int64)
    lo, hi = _bounds(level)
    low, high = (int(np.percentile(values, q, method=m)) for q, m in ((lo, "lower"), (hi, "higher")))
    layers, counts = np.unique(values, return_counts=True)
    shares = {None if v == L else int(v): float(c / len(values)) for v, c in zip(layers, counts)}
    return DepthInterval(
        method=method,
        point=point,
        low=None if low == L else low,
        high=None if high == L else high,
        level=level,
        shares=shares,
        resamples=len(values),
        num_prompts=num_prompts,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurveBand:
    """Per-layer percentile band `[L]` of a resampled aggregate curve (linear interpolation
    between resamples: the curve is continuous)."""

    low: np.ndarray
    high: np.ndarray
    level: float
    resamples: int


def curve_band(curves: np.ndarray, *, level: float = DEFAULT_LEVEL) -> CurveBand:
    """The band of resampled curves `[R, L]` at `level`, layer by layer."""
    lo, hi = _bounds(level)
    low, high = np.percentile(np.asarray(curves, np.float64), [lo, hi], axis=0)
    return CurveBand(low=low, high=high, level=level, resamples=len(curves))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScoreInterval:
    """Bootstrap distribution of the depth score. `point` is the score of the full data (None
    where it is undefined: every skip effect zero); `samples [R]` the resampled scores (NaN where
    undefined, as when a resample holds only prompts too short to be measured); `low` and `high`
    the percentile interval at `level` ('lower' / 'higher'), an undefined resample sorting
    last and a bound falling on one being None."""

    point: Optional[float]
    low: Optional[float]
    high: Optional[float]
    level: float
    samples: np.ndarray
    num_prompts: int

    @property
    def resamples(self) -> int:
        """How many resamples were scored (the length of `samples`)."""
        return len(self.samples)

    @property
    def undefined_share(self) -> float:
        """Share of resamples whose depth score is undefined."""
        return float(np.mean(np.isnan(self.samples)))


# ----------------------------------------------------------------------------- results


def _rules(kl_fraction: float, overlap_threshold: float) -> dict[str, Callable[[np.ndarray], EffectiveDepth]]:
    return {
        "cosine": ed.cosine_effective_depth,
        "kl": lambda c: ed.kl_effective_depth(c, kl_fraction),
        "overlap": lambda c: ed.overlap_effective_depth(c, overlap_threshold),
    }


def has_per_prompt(result) -> bool:
    """Whether a ContributionResult or LogitLensResult carries per-prompt curves (results saved
    before they existed do not)."""
    return getattr(result, "tokens_per_prompt", None) is not None


def _series(result) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], np.ndarray, str]:
    """`({method: (per-prompt curves [N, L], aggregate curve [L])}, token counts [N], weighting)`:
    what each effective depth reads, and how the result aggregates it."""
    if not has_per_prompt(result):
        raise ValueError(
            f"this {type(result).__name__} has no per-prompt curves (saved by an older "
            "version): rerun the analysis to bootstrap it"
        )
    counts = np.asarray(result.tokens_per_prompt)
    if hasattr(result, "cos_layer"):  # ContributionResult: the mean over every token
        return {"cosine": (result.mean_cosine_per_prompt, result.mean_cosine)}, counts, "token"
    if hasattr(result, "kl"):  # LogitLensResult: as its settings say
        weighting = result.settings.get("weighting", "prompt")
        return (
            {"kl": (result.kl_per_prompt, result.kl), "overlap": (result.overlap_per_prompt, result.overlap)},
            counts,
            weighting,
        )
    raise TypeError(f"no effective depth is read from a {type(result).__name__}")


def effective_depth_intervals(
    result,
    *,
    kl_fraction: float = 0.5,
    overlap_threshold: float = 0.3,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    level: float = DEFAULT_LEVEL,
) -> dict[str, DepthInterval]:
    """Bootstrap intervals of the effective depths a result gives: `{'cosine': ...}` for a
    ContributionResult (token-weighted re-aggregation), `{'kl': ..., 'overlap': ...}` for a
    LogitLensResult (its own weighting). Each resample re-aggregates the per-prompt curves of
    the prompts drawn and reads the depth with the rules of `effective_depth` (thresholds as
    given); the point estimate is the depth of the stored aggregate curve."""
    series, counts, weighting = _series(result)
    indices = resample_indices(len(counts), resamples=resamples, seed=seed)
    rules = _rules(kl_fraction, overlap_threshold)
    out = {}
    for method, (per_prompt, curve) in series.items():
        rule = rules[method]
        resampled = [rule(c).layer for c in resampled_curves(per_prompt, counts, weighting, indices)]
        out[method] = depth_interval(method, rule(curve), resampled, level=level, num_prompts=len(counts))
    return out


def curve_bands(
    result, *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED, level: float = DEFAULT_LEVEL
) -> dict[str, CurveBand]:
    """Per-layer bootstrap bands of a result's aggregate curves (for figures): every statistic
    and 'mean_cosine' of a ContributionResult, 'kl' and 'overlap' of a LogitLensResult."""
    series, counts, weighting = _series(result)
    if hasattr(result, "cos_layer"):
        names = ("norm_attn", "norm_mlp", "norm_layer", "cos_attn", "cos_mlp", "cos_layer")
        series = {
            **{n: (getattr(result, f"{n}_per_prompt"), getattr(result, n)) for n in names},
            "mean_cosine": series["cosine"],
        }
    indices = resample_indices(len(counts), resamples=resamples, seed=seed)
    return {
        name: curve_band(resampled_curves(per_prompt, counts, weighting, indices), level=level)
        for name, (per_prompt, _) in series.items()
    }


def per_prompt_depths(
    result, *, kl_fraction: float = 0.5, overlap_threshold: float = 0.3
) -> dict[str, list[EffectiveDepth]]:
    """Each prompt's own effective depths: its per-prompt curve through the same rule, the
    spread the mean curve hides. Keys as in `effective_depth_intervals`."""
    series, _, _ = _series(result)
    rules = _rules(kl_fraction, overlap_threshold)
    return {method: [rules[method](c) for c in per_prompt] for method, (per_prompt, _) in series.items()}


def _score(later: np.ndarray) -> float:
    try:
        return ed.depth_score(later)
    except ValueError:  # every effect zero: undefined, counted as such
        return float("nan")


def depth_score_interval(
    result, *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED, level: float = DEFAULT_LEVEL
) -> ScoreInterval:
    """Bootstrap interval of the depth score of a LayerSkipResult: each resample takes the max
    over its prompts' `later_per_prompt` (as the result aggregates them) and scores it with
    `effective_depth.depth_score`. A result of several sublayers is bootstrapped one sublayer
    at a time (`depth_score_interval(result.part("attn"))`), each its own score."""
    per_prompt = np.asarray(result.later_per_prompt)
    if per_prompt.ndim != 3 or per_prompt.shape[1] != per_prompt.shape[2]:
        hint = " (one sublayer at a time: pass result.part(sublayer))" if hasattr(result, "part") else ""
        raise ValueError(f"expected later_per_prompt of shape [N, L, L], got {per_prompt.shape}{hint}")
    indices = resample_indices(per_prompt.shape[0], resamples=resamples, seed=seed)
    # A max ignores how often a prompt was drawn: each resample reduces its distinct prompts.
    samples = np.array([_score(per_prompt[np.unique(row)].max(axis=0)) for row in indices])
    point = _score(np.asarray(result.later))
    lo, hi = _bounds(level)
    ranked = np.where(np.isnan(samples), np.inf, samples)  # undefined sorts last
    low, high = (float(np.percentile(ranked, q, method=m)) for q, m in ((lo, "lower"), (hi, "higher")))
    undefined = lambda x: None if not np.isfinite(x) else x
    return ScoreInterval(
        point=undefined(point),
        low=undefined(low),
        high=undefined(high),
        level=level,
        samples=samples,
        num_prompts=per_prompt.shape[0],
    )
