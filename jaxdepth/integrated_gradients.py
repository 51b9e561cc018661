"""Integrated gradients of the answer probability with respect to each layer's output
(METHODS §5).

For layer l, x = h_{l+1} over the whole prompt and F(x) = sum over answer tokens of their
teacher-forced probabilities when h_{l+1} is set to x:

    IG_l[t] = sum_c (x - b)[t, c] * sum_k w_k dF/dx(b + α_k (x - b))[t, c]

All (layer, step) pairs are one vmapped `jax.grad`, chunked, with the layer body
rematerialised. The completeness gap `sum_t IG_l[t] - (F(x) - F(b))` says whether the number of
steps is enough.
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
from jaxdepth.model import embed, residual_stream, run_layers, unembed
from jaxdepth.results import SavedResult
from jaxdepth.sweep import auto_chunk_size, sweep

RULES = ("left", "midpoint", "gauss")
BASELINES = ("channel_mean", "token_mean", "zero")


def quadrature(rule: str, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes α_k in [0, 1] and weights w_k (summing to 1) of a quadrature rule.

    'left': α_k = k/n (the default, as the published code); 'midpoint': (k + 1/2)/n;
    'gauss': Gauss-Legendre on [0, 1].
    """
    if steps < 1:
        raise ValueError("steps must be >= 1")
    k = np.arange(steps, dtype=np.float64)
    if rule == "left":
        return k / steps, np.full(steps, 1.0 / steps)
    if rule == "midpoint":
        return (k + 0.5) / steps, np.full(steps, 1.0 / steps)
    if rule == "gauss":
        nodes, weights = np.polynomial.legendre.leggauss(steps)
        return (nodes + 1) / 2, weights / 2
    raise ValueError(f"rule must be one of {RULES}, got {rule!r}")


def ig_baseline(x, valid, kind: str):
    """Baseline for x `[..., T, D]` over valid positions `[T]`.

    'channel_mean' (default): per-channel mean over the prompt's positions, `[..., 1, D]`;
    'token_mean': per-token mean over channels, `[..., T, 1]` (the second study's code);
    'zero': zeros.
    """
    if kind == "channel_mean":
        w = valid[:, None].astype(x.dtype)
        return jnp.sum(x * w, axis=-2, keepdims=True) / jnp.sum(w)
    if kind == "token_mean":
        return jnp.mean(x, axis=-1, keepdims=True)
    if kind == "zero":
        return jnp.zeros_like(x)
    raise ValueError(f"baseline must be one of {BASELINES}, got {kind!r}")


@partial(jax.jit, static_argnames=("config", "baseline", "chunk_size"))
def ig_of_prompt(params, tokens, valid, answer_mask, alphas, weights, config: ModelConfig,
                 baseline: str = "channel_mean", chunk_size: Optional[int] = None):
    """IG for one prompt (`tokens`, `valid`, `answer_mask` `[1, T]`).

    Returns `(attributions [L, T], f_input [], f_baseline [L])`.
    """
    L, T = config.num_layers, tokens.shape[1]
    h0 = embed(params, tokens)
    targets = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    everywhere = jnp.ones((T,), jnp.float32)

    def objective(z, layer):
        h, _ = run_layers(params, h0, config, valid=valid, remat=True,
                          interventions=replace_residual(layer + 1, everywhere, z))
        probs = jax.nn.softmax(unembed(params, h, config), axis=-1)
        target_probs = jnp.take_along_axis(probs, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(answer_mask, target_probs, 0.0))

    x = residual_stream(params, tokens, config, valid=valid)[1:, 0].astype(jnp.float32)  # [L, T, D]
    b = jax.vmap(lambda xl: ig_baseline(xl, valid[0], baseline))(x)
    b = jnp.broadcast_to(b, x.shape)
    grad = jax.grad(objective)

    def member(m):
        layer, alpha, weight = m
        xl, bl = x[layer], b[layer]
        g = grad((bl + alpha * (xl - bl))[None], layer)[0]
        return weight * jnp.sum((xl - bl) * g, axis=-1)  # [T]

    layers = jnp.repeat(jnp.arange(L), alphas.shape[0])
    steps = (layers, jnp.tile(alphas, L), jnp.tile(weights, L))
    attributions = sweep(member, steps, chunk_size).reshape(L, alphas.shape[0], T).sum(axis=1)
    f_input = objective(x[-1][None], L - 1)
    f_baseline = jax.vmap(lambda bl, layer: objective(bl[None], layer))(b, jnp.arange(L))
    return attributions * valid[0], f_input, f_baseline


@dataclasses.dataclass
class IntegratedGradientsResult(SavedResult):
    """`attributions [P, L, T]`, completeness `gap [P, L]`, `f_input [P]` = F(x), `f_baseline
    [P, L]` = F(b), with the prompts' tokens for labelling."""

    attributions: np.ndarray
    gap: np.ndarray
    f_input: np.ndarray
    f_baseline: np.ndarray
    tokens: np.ndarray
    lengths: np.ndarray
    answer_start: np.ndarray
    settings: dict


def integrated_gradients(params, batch: PromptBatch, config: ModelConfig, *, steps: int = 256,
                         rule: str = "left", baseline: str = "channel_mean",
                         chunk_size: Optional[int] = None, memory_budget: Optional[int] = None,
                         progress: bool = True, settings=None) -> IntegratedGradientsResult:
    """Integrated gradients per layer and token for every prompt of `batch`."""
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    alphas, weights = quadrature(rule, steps)
    L, T = config.num_layers, batch.tokens.shape[1]
    P = len(batch)
    attributions = np.zeros((P, L, T), np.float32)
    f_input, f_baseline = np.zeros(P, np.float32), np.zeros((P, L), np.float32)
    for i in tqdm(range(P), desc=f"integrated gradients ({steps} steps)", disable=not progress):
        one = batch.single(i)
        Ti = one.tokens.shape[1]
        chunk = chunk_size or auto_chunk_size(config, Ti, L * steps, grad=True, memory_budget=memory_budget)
        a, fx, fb = ig_of_prompt(params, jnp.asarray(one.tokens), jnp.asarray(one.valid),
                                 jnp.asarray(one.answer_prediction_mask()), jnp.asarray(alphas, jnp.float32),
                                 jnp.asarray(weights, jnp.float32), config, baseline, chunk)
        attributions[i, :, :Ti], f_input[i], f_baseline[i] = np.asarray(a), np.asarray(fx), np.asarray(fb)
    gap = attributions.sum(axis=-1) - (f_input[:, None] - f_baseline)
    return IntegratedGradientsResult(
        attributions=attributions, gap=gap, f_input=f_input, f_baseline=f_baseline,
        tokens=batch.tokens, lengths=batch.lengths, answer_start=batch.answer_start,
        settings={**(settings or {}), "steps": steps, "rule": rule, "baseline": baseline})
