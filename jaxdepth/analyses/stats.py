"""Small numerical helpers shared by the analyses (float32, clamped denominators, masks)."""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

__all__ = [
    "norm",
    "relative_norm",
    "cosine",
    "masked_max",
    "token_mean",
    "per_prompt_mean",
    "prompt_mean",
    "NORM_EPS",
    "floating_metric",
]

NORM_EPS = 1e-6  # METHODS: denominators of relative norms are clamped at 1e-6


def norm(x, axis=-1):
    """Euclidean norm over `axis` (default the last), computed in float32."""
    x = x.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(x * x, axis=axis))


def relative_norm(x, y):
    """||x|| / max(||y||, 1e-6) over the last axis."""
    return norm(x) / jnp.maximum(norm(y), NORM_EPS)


def cosine(x, y):
    """Cosine similarity over the last axis (0 where either vector is ~0)."""
    x, y = x.astype(jnp.float32), y.astype(jnp.float32)
    return jnp.sum(x * y, axis=-1) / jnp.maximum(norm(x) * norm(y), NORM_EPS)


def masked_max(x, mask, axis=-1):
    """Max of x where mask is true; 0 where the mask is empty (effects are non-negative)."""
    return jnp.max(jnp.where(mask, x, 0.0), axis=axis)


def token_mean(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Mean over every valid token of every prompt: `values [..., B, T]`, `valid [B, T]`."""
    return np.sum(values * valid, axis=(-2, -1)) / np.sum(valid)


def per_prompt_mean(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Mean over each prompt's valid positions: `values [..., B, T]` -> `[..., B]`."""
    return np.sum(values * valid, axis=-1) / np.sum(valid, axis=-1)


def prompt_mean(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Mean over positions within each prompt, then over prompts."""
    return per_prompt_mean(values, valid).mean(axis=-1)


def floating_metric(values, metric: Callable):
    """`values`, what `metric` returned, refused at trace time unless they are floating point (a
    `ValueError` naming the dtype): an integer or boolean metric (an argmax, an accuracy) has a
    zero gradient everywhere, so every gradient, score and attribution of it would be exactly 0.
    Every analysis that differentiates a user's metric, or patches edges under the metric its
    scores were taken with, checks it here."""
    dtype = jnp.asarray(values).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"the metric {getattr(metric, '__name__', metric)!r} returns {dtype} values: a metric must be "
            "floating point, since an integer or boolean one (an argmax, an accuracy) has a zero gradient "
            "everywhere and every score or attribution of it would be exactly 0. Return a float that moves "
            "with the logits (a logit difference, a probability) instead"
        )
    return values
