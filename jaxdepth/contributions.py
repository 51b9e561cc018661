"""Relative contributions and residual cosine similarity of every layer (METHODS §1)."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.batch import PromptBatch
from jaxdepth.compilation import jit
from jaxdepth.config import ModelConfig
from jaxdepth.model import LayerRecord, embed, run_layers
from jaxdepth.results import SavedResult
from jaxdepth.stats import cosine, relative_norm, token_mean

# Order of the statistics on the last axis of `per_token`.
STATISTICS = ("norm_attn", "norm_mlp", "norm_layer", "cos_attn", "cos_mlp", "cos_layer")


def _tap_contributions(r: LayerRecord, _):
    h_mid = r.h + r.attn
    layer = r.attn + r.mlp
    return jnp.stack([
        relative_norm(r.attn, r.h), relative_norm(r.mlp, h_mid), relative_norm(layer, r.h),
        cosine(r.attn, r.h), cosine(r.mlp, h_mid), cosine(layer, r.h),
    ], axis=-1)


@partial(jit, static_argnames="config")
def contribution_stats(params, tokens, valid, config: ModelConfig):
    """Per-token statistics `[L, B, T, 6]` in the order of `STATISTICS`, computed inside the scan."""
    _, stats = run_layers(params, embed(params, tokens), config, valid=valid, tap=_tap_contributions)
    return stats


@dataclasses.dataclass
class ContributionResult(SavedResult):
    """Per-layer curves `[L]`: the mean over every valid token of every prompt."""

    norm_attn: np.ndarray
    norm_mlp: np.ndarray
    norm_layer: np.ndarray
    cos_attn: np.ndarray
    cos_mlp: np.ndarray
    cos_layer: np.ndarray
    num_tokens: int
    settings: dict

    @property
    def mean_cosine(self) -> np.ndarray:
        """The average of the three cosine curves (what cosine effective depth reads)."""
        return (self.cos_attn + self.cos_mlp + self.cos_layer) / 3


def contributions(params, batch: PromptBatch, config: ModelConfig, *, settings=None) -> ContributionResult:
    """Relative norms and cosines of attention, MLP and whole-layer outputs, per layer."""
    # One prompt at a time, trimmed to its own length bucket: a padded batch would spend a third
    # of its work on padding when prompt lengths differ as much as GSM8K's.
    L, T = config.num_layers, batch.tokens.shape[1]
    stats = np.zeros((L, len(batch), T, len(STATISTICS)), np.float32)
    for i in range(len(batch)):
        one = batch.single(i)
        Ti = one.tokens.shape[1]
        stats[:, i, :Ti] = np.asarray(contribution_stats(params, jnp.asarray(one.tokens), jnp.asarray(one.valid),
                                                         config))[:, 0]
    curves = token_mean(np.moveaxis(stats, -1, 0), batch.valid)  # [6, L]
    return ContributionResult(**dict(zip(STATISTICS, curves)), num_tokens=int(batch.valid.sum()),
                              settings=dict(settings or {}))
