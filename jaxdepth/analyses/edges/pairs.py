"""Prompt pairs (a clean and a corrupt prompt of the same length) and the metric of edge
attribution."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import check_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptPairs:
    """A batch of B prompt pairs, right-padded to T positions: `clean`, `corrupt` int `[B, T]`,
    `valid [B, T]` (the same for both prompts of a pair), `last [B]` (each pair's last real
    position, whose logits the metric reads) and the metric's `labels` (`[B, ...]`, or None).
    Build it with `prompt_pairs`."""

    clean: jax.Array
    corrupt: jax.Array
    valid: jax.Array
    last: jax.Array
    labels: Optional[jax.Array] = None

    def __len__(self) -> int:
        return self.clean.shape[0]

    def select(self, index) -> "PromptPairs":
        """The pairs `index` (a list of indices), as a batch of their own."""
        index = np.asarray(index)
        return jax.tree.map(lambda x: x[index], self)

    def shared_prefix(self) -> int:
        """P: how many first positions every pair's clean and corrupt prompts share (at most up
        to the earliest last position, which the metric reads). Nothing differs before P, so
        edge attribution runs only positions P.. (`edge_forward`'s `prefix`)."""
        differs = np.asarray(self.clean) != np.asarray(self.corrupt)
        first = np.where(differs.any(axis=1), differs.argmax(axis=1), differs.shape[1])
        return int(min(first.min(), np.asarray(self.last).min()))

    def check(self, config: ModelConfig) -> None:
        """Refuse token ids or a context the model cannot take."""
        check_tokens(np.asarray(self.clean), config)
        check_tokens(np.asarray(self.corrupt), config)


def prompt_pairs(clean, corrupt, labels=None) -> PromptPairs:
    """Pairs from token ids: `clean` and `corrupt` are sequences of B token lists (or int arrays
    `[B, T]`, all positions real); the clean and corrupt prompt of each pair must have the same
    length (edge scores compare activations position by position). Shorter pairs are
    right-padded with token 0. `labels`: what the metric reads besides the logits, one row
    per pair (e.g. `[B, 2]` token ids for `logit_difference`)."""
    clean, corrupt = _token_lists(clean, "clean"), _token_lists(corrupt, "corrupt")
    if len(clean) != len(corrupt):
        raise ValueError(f"{len(clean)} clean prompts but {len(corrupt)} corrupt ones: give one of each per pair")
    if not clean:
        raise ValueError("no prompt pairs")
    for i, (a, b) in enumerate(zip(clean, corrupt)):
        if len(a) != len(b):
            raise ValueError(
                f"pair {i}: the clean prompt has {len(a)} tokens and the corrupt one {len(b)}; edge scores "
                "compare the two runs position by position, so both prompts of a pair need the same length"
            )
        if not a:
            raise ValueError(f"pair {i} is empty")
    T = max(len(a) for a in clean)
    lengths = np.array([len(a) for a in clean])
    pad = lambda rows: np.array([list(r) + [0] * (T - len(r)) for r in rows], np.int32)
    if labels is not None:
        labels = jnp.asarray(labels)
        if labels.shape[:1] != (len(clean),):
            raise ValueError(f"labels must have one row per pair ({len(clean)}), got shape {labels.shape}")
    return PromptPairs(
        clean=jnp.asarray(pad(clean)),
        corrupt=jnp.asarray(pad(corrupt)),
        valid=jnp.asarray(np.arange(T)[None, :] < lengths[:, None]),
        last=jnp.asarray(lengths - 1, jnp.int32),
        labels=labels,
    )


def _token_lists(prompts, what: str) -> list[list[int]]:
    if isinstance(prompts, (np.ndarray, jax.Array)):
        if prompts.ndim != 2:
            raise ValueError(f"{what} tokens must be [B, T] or a list of token lists, got shape {prompts.shape}")
        return [list(map(int, row)) for row in np.asarray(prompts)]
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise ValueError(
            f"{what} must be a list of token-id lists (tokenize the text first), got {type(prompts).__name__}"
        )
    return [list(map(int, p)) for p in prompts]


def metric_values(metric: Callable, logits, labels) -> jax.Array:
    """`metric(logits [B, V], labels)`, checked at trace time to give one value per pair `[B]`."""
    values = metric(logits, labels)
    if jnp.shape(values) != logits.shape[:1]:
        raise ValueError(
            f"the metric must return one value per pair, shape [B] = {logits.shape[:1]}, got {jnp.shape(values)}: "
            "edge scores are per pair (sum or average them afterwards)"
        )
    return values.astype(jnp.float32)


def logit_difference(logits, labels):
    """The logit of the right answer minus that of the wrong one, per pair: `labels [B, 2]` holds
    (right, wrong) token ids. The usual metric of IOI-style tasks."""
    rows = jnp.arange(logits.shape[0])
    return logits[rows, labels[:, 0]] - logits[rows, labels[:, 1]]


def answer_probability(logits, labels):
    """The probability of the answer token `labels [B]` (or `labels[:, 0]`), per pair."""
    answer = labels if labels.ndim == 1 else labels[:, 0]
    return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)[jnp.arange(logits.shape[0]), answer]
