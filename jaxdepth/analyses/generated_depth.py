"""Depth in what the model generates: the lens of each generated token, its settling depth,
the deep-thinking ratio of an answer (Chen et al. 2026, arXiv 2602.13517), Think@n selection
among samples, and the entropy lens (arXiv 2502.16570).

Definitions (docs/analyses.md says the same). For a token the model generated, P_l is the
lens distribution of the residual after layer l (h_l through the final norm and LM head, or a
tuned lens's translator first), l = 1..L, at the position whose output chose the token; P_L is
the distribution it was drawn from. Then

- D_l = JSD(P_l || P_L), the Jensen-Shannon divergence in bits (log base 2, so 0 <= D_l <= 1):
  symmetric, 0 exactly where the two distributions agree;
- the settling depth s = min{l in 1..L : D_l <= g}, the first layer at which the running
  minimum of D falls to the threshold g (it exists: D_L = 0);
- the token is deep-thinking when s >= ceil(rho * L): its prediction settles only in the
  deepest layers, the last 1 - rho of them (rho as in the paper: 0.85 keeps the last 15%);
- the deep-thinking ratio (DTR) of an answer is the share of its generated tokens that are
  deep-thinking (an end-of-sequence token counts; padding after it does not);
- the entropy lens H_l = H(P_l) in bits, l = 0..L (l = 0 the embeddings).

Think@n (`think_at_n`): of n sampled answers to a prompt, keep the `keep` share with the
highest DTR (at least one; ties to the earlier sample) and take the majority answer among the
kept; self-consistency (`majority_answer`) votes over all n. A tie between answers goes to the
one given first.

The lens of generated tokens is exact from one teacher-forced forward of prompt + answer (the
model is causal: the residuals at a position do not depend on later tokens), so an answer's
lens costs one forward, not one per token.
"""

from __future__ import annotations

import math
from collections import Counter
from functools import partial
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import residual_stream, unembed

__all__ = [
    "jensen_shannon",
    "entropy_bits",
    "lens_trajectories",
    "settling_depths",
    "deep_thinking",
    "deep_thinking_ratio",
    "majority_answer",
    "think_at_n",
    "DEFAULT_THRESHOLD",
    "DEFAULT_RHO",
    "DEFAULT_KEEP",
]

DEFAULT_THRESHOLD = 0.5  # g: a layer has settled once its JSD to the output is at most this, in bits
DEFAULT_RHO = 0.85  # deep-thinking: settling at or after layer ceil(rho * L)
DEFAULT_KEEP = 0.5  # Think@n keeps the half of the samples with the highest DTR

_LOG2 = math.log(2.0)


def _log_probs(logits):
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def jensen_shannon(p_logits, q_logits, axis: int = -1):
    """JSD(P || Q) in bits of the distributions of two logit arrays, over `axis`: 0.5 KL(P || M)
    + 0.5 KL(Q || M) with M = (P + Q) / 2. Symmetric, in [0, 1], exactly 0 where P = Q. Terms of
    zero probability contribute 0 (x log x -> 0), so a distribution with exact zeros is fine."""
    log_p, log_q = _log_probs(p_logits), _log_probs(q_logits)
    p, q = jnp.exp(log_p), jnp.exp(log_q)
    log_m = jnp.logaddexp(log_p, log_q) - _LOG2
    part = lambda x, log_x: jnp.where(x > 0, x * (log_x - log_m), 0.0)  # noqa: E731
    return 0.5 * jnp.sum(part(p, log_p) + part(q, log_q), axis=axis) / _LOG2


def entropy_bits(logits, axis: int = -1):
    """H(P) in bits of the distribution of `logits` over `axis`."""
    log_p = _log_probs(logits)
    return -jnp.sum(jnp.where(log_p > -jnp.inf, jnp.exp(log_p) * log_p, 0.0), axis=axis) / _LOG2


@partial(jit, static_argnames="config")
def lens_trajectories(params, tokens, valid, config: ModelConfig, translators=None):
    """The lens of every position of `tokens [B, T]`: `jsd [L, B, T]`, row l-1 the JSD in bits
    of the lens of h_l (after layer l, l = 1..L) to the output distribution (row L-1 is 0), and
    `entropy [L+1, B, T]`, row l the entropy of the lens of h_l (l = 0..L). With `translators`
    (a tuned lens's, one per boundary 0..L-1) h_0..h_{L-1} go through theirs first; h_L, the
    output, never does. One boundary's `[B, T, V]` logits exist at a time (`lax.map`).
    Padded positions (`valid` false) hold numbers of no prompt: leave them out."""
    hs = residual_stream(params, tokens, config, valid=valid)
    final = unembed(params, hs[-1], config)

    def read(logits):
        return jensen_shannon(logits, final), entropy_bits(logits)

    if translators is None:
        jsd, entropy = jax.lax.map(lambda h: read(unembed(params, h, config)), hs[:-1])
    else:
        from jaxdepth.analyses.tuned_lens import translate

        jsd, entropy = jax.lax.map(
            lambda x: read(unembed(params, translate(*x), config)),
            (hs[:-1], translators["weight"], translators["bias"]),
        )
    # jsd rows are of h_0..h_{L-1}; the settling depth counts layers 1..L, so drop h_0 and end
    # with the output's own 0
    jsd = jnp.concatenate([jsd[1:], jnp.zeros_like(jsd[:1])], axis=0)
    return jsd, jnp.concatenate([entropy, entropy_bits(final)[None]], axis=0)


def settling_depths(jsd, threshold: float = DEFAULT_THRESHOLD) -> np.ndarray:
    """The settling depth of each token, int `[...]`, from `jsd [L, ...]` (row l-1 the JSD of
    layer l to the output): the first layer l in 1..L with JSD <= `threshold` (module
    docstring); L where no earlier layer reaches it (row L-1 is 0 for a model's own output)."""
    jsd = np.asarray(jsd)
    settled = jsd <= threshold
    settled[-1] = True  # the output is its own distribution: nothing settles later than L
    return np.argmax(settled, axis=0) + 1


def deep_thinking(depths, num_layers: int, rho: float = DEFAULT_RHO) -> np.ndarray:
    """bool `[...]`: whether each settling depth is deep-thinking, `depth >= ceil(rho * L)`."""
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"rho must be in (0, 1], got {rho}")
    return np.asarray(depths) >= math.ceil(rho * num_layers)


def deep_thinking_ratio(deep, counted) -> np.ndarray:
    """DTR per answer `[N]`: the share of each answer's counted tokens (`counted [N, T]`, its
    generated tokens) that are deep-thinking (`deep [N, T]`); NaN for an answer with none."""
    deep, counted = np.asarray(deep, bool), np.asarray(counted, bool)
    n = counted.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, (deep & counted).sum(axis=-1) / n, np.nan)


def majority_answer(answers: Sequence[str]) -> Optional[str]:
    """The most frequent of `answers`, a tie going to the answer given first; None for none."""
    if not answers:
        return None
    counts = Counter(answers)
    best = max(counts.values())
    return next(a for a in answers if counts[a] == best)


def think_at_n(answers: Sequence[str], ratios: Sequence[float], keep: float = DEFAULT_KEEP) -> Optional[str]:
    """Think@n's answer among n samples: the majority (`majority_answer`) of the
    `max(1, round(keep * n))` samples with the highest DTR (`ratios`; ties, and NaN ratios
    last, to the earlier sample)."""
    if len(answers) != len(ratios):
        raise ValueError(f"{len(answers)} answers but {len(ratios)} ratios")
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    if not answers:
        return None
    r = np.nan_to_num(np.asarray(ratios, np.float64), nan=-np.inf)
    order = sorted(range(len(answers)), key=lambda i: (-r[i], i))
    kept = sorted(order[: max(1, round(keep * len(answers)))])
    return majority_answer([answers[i] for i in kept])
