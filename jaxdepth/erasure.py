"""Residual erasure (METHODS §4): replace one residual vector h_l[t] by a baseline mean and
measure how much the predictions of the answer tokens move.

All (boundary, position) erasures of a prompt are one vmapped computation. Erasing position t
cannot change any position before t (causal attention), so only positions p >= t are
measured: an erasure after the last answer prediction is exactly 0, not float noise.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxdepth.batch import PromptBatch
from jaxdepth.config import ModelConfig
from jaxdepth.interventions import replace_residual
from jaxdepth.model import residual_stream, run_layers_from, unembed
from jaxdepth.results import SavedResult
from jaxdepth.stats import masked_max, norm
from jaxdepth.sweep import auto_chunk_size, sweep


@partial(jax.jit, static_argnames="config")
def _residual_sums(params, tokens, valid, config: ModelConfig):
    hs = residual_stream(params, tokens, config, valid=valid).astype(jnp.float32)
    return jnp.sum(hs * valid[None, :, :, None], axis=(1, 2))


def mean_residuals(params, batch: PromptBatch, config: ModelConfig, *, batch_size: int = 8) -> np.ndarray:
    """Baseline `[L+1, D]`: the mean residual at every boundary over all valid tokens of `batch`
    (a BOS token counts where the tokenizer added one)."""
    total = np.zeros((config.num_layers + 1, config.hidden_size), np.float64)
    for i in range(0, len(batch), batch_size):
        part = batch.select(slice(i, i + batch_size))
        total += np.asarray(_residual_sums(params, jnp.asarray(part.tokens), jnp.asarray(part.valid), config))
    return (total / batch.valid.sum()).astype(np.float32)


@partial(jax.jit, static_argnames=("config", "chunk_size"))
def erasure_of_prompt(params, tokens, valid, answer_positions, baseline, config: ModelConfig,
                      chunk_size: Optional[int] = None):
    """`[L+1, T]` effects of erasing h_l[t] for one prompt (`tokens`, `valid`: `[1, T]`;
    `answer_positions [A]`: the positions predicting answer tokens, repeats allowed).

    Boundaries run one after another (`lax.map`), the positions of a boundary as one chunked
    sweep. An erasure at boundary l starts from the clean h_l: layers before l are not rerun.
    """
    L, T = config.num_layers, tokens.shape[1]
    hs = residual_stream(params, tokens, config, valid=valid)
    answer_probs = lambda h: jax.nn.softmax(unembed(params, h[:, answer_positions], config), axis=-1)
    clean = answer_probs(hs[-1])
    pos = jnp.arange(T)

    def boundary_effects(boundary):
        def member(position):
            iv = replace_residual(boundary, pos == position, baseline[boundary])
            h, _ = run_layers_from(params, hs[boundary], boundary, config, valid=valid, interventions=iv)
            # Causality: an erasure at t changes no position before t, and at the last boundary
            # (after every layer) it changes position t alone. Masking the rest gives exact zeros.
            reach = jnp.where(boundary == L, answer_positions == position, answer_positions >= position)
            return masked_max(norm(answer_probs(h) - clean), reach[None])[0]
        return sweep(member, pos, chunk_size)

    return jax.lax.map(boundary_effects, jnp.arange(L + 1))


@dataclasses.dataclass
class ErasureResult(SavedResult):
    """`effects [P, L+1, T]` per prompt (0 beyond each prompt's length), with the prompts'
    tokens and answer starts so plots can label positions."""

    effects: np.ndarray
    tokens: np.ndarray
    lengths: np.ndarray
    answer_start: np.ndarray
    settings: dict


def residual_erasure(params, batch: PromptBatch, config: ModelConfig, baseline: np.ndarray, *,
                     chunk_size: Optional[int] = None, memory_budget: Optional[int] = None,
                     progress: bool = True, settings=None) -> ErasureResult:
    """Residual erasure for every prompt of `batch` against a `[L+1, D]` baseline."""
    L, T = config.num_layers, batch.tokens.shape[1]
    if baseline.shape != (L + 1, config.hidden_size):
        raise ValueError(f"baseline must be [L+1, D] = {(L + 1, config.hidden_size)}, got {baseline.shape}")
    effects = np.zeros((len(batch), L + 1, T), np.float32)
    for i in tqdm(range(len(batch)), desc="residual erasure", disable=not progress):
        one = batch.single(i)
        Ti = one.tokens.shape[1]
        chunk = chunk_size or auto_chunk_size(config, Ti, Ti, memory_budget=memory_budget)
        positions, _ = one.answer_positions(0)
        effects[i, :, :Ti] = np.asarray(erasure_of_prompt(
            params, jnp.asarray(one.tokens), jnp.asarray(one.valid), jnp.asarray(positions),
            jnp.asarray(baseline), config, chunk))
    return ErasureResult(effects=effects, tokens=batch.tokens, lengths=batch.lengths,
                         answer_start=batch.answer_start, settings=dict(settings or {}))
