"""Prompts as arrays: right-padded token ids, a validity mask and where the answer starts."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import numpy as np

# Tokens (rows x padded length) of one forward when prompts are grouped (`PromptBatch.groups`):
# on 2-core x86 CPUs a forward of the embedded model reaches about 90% of its large-batch speed
# from 128 rows on, against 70% at 64.
GROUP_TOKENS = 256


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """`tokens [B, T]` int32 right-padded, `valid [B, T]` bool, `answer_start [B]`: the position
    of the first answer token (= the prompt length when a prompt has no answer part)."""

    tokens: np.ndarray
    valid: np.ndarray
    answer_start: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return self.valid.sum(axis=1)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, index) -> "PromptBatch":
        return PromptBatch(self.tokens[index], self.valid[index], self.answer_start[index])

    def single(self, i: int, pad_to_multiple: int = 16) -> "PromptBatch":
        """Prompt i alone, padded only to its own length rounded up to `pad_to_multiple`:
        per-prompt sweeps then cost what the prompt costs, not what the longest one does, and
        prompts of similar lengths still share a compiled computation."""
        return self._trimmed(np.array([i]), pad_to_multiple)

    def groups(self, max_tokens: int = GROUP_TOKENS, pad_to_multiple: int = 16) -> list[tuple[np.ndarray, "PromptBatch"]]:
        """The prompts packed into sub-batches of similar length: `[(indices, sub-batch), ...]`.

        Prompts are taken shortest first; a group grows while its rows times its padded length
        (its longest prompt's, rounded up to `pad_to_multiple`) stay within `max_tokens`, and a
        longer prompt is a group of its own. One forward per group instead of per prompt: a
        prompt of 64 tokens alone gives each matmul 64 rows, too few to keep a CPU's vector
        units busy, while sorting by length keeps the padding small."""
        lengths = self.lengths
        packed: list[list[int]] = []
        for i in np.argsort(lengths, kind="stable"):
            group = packed[-1] if packed else None
            if group is None or (len(group) + 1) * self._padded_length(lengths[i], pad_to_multiple) > max_tokens:
                packed.append([int(i)])
            else:
                group.append(int(i))
        return [(np.asarray(group), self._trimmed(np.asarray(group), pad_to_multiple)) for group in packed]

    def _padded_length(self, length: int, pad_to_multiple: int) -> int:
        """`length` rounded up to a multiple of `pad_to_multiple`, at most the batch's length."""
        return min(-(-int(length) // pad_to_multiple) * pad_to_multiple, self.tokens.shape[1])

    def _trimmed(self, index: np.ndarray, pad_to_multiple: int) -> "PromptBatch":
        """Prompts `index`, cut to their longest prompt's padded length."""
        T = self._padded_length(self.lengths[index].max(), pad_to_multiple)
        return PromptBatch(self.tokens[index, :T], self.valid[index, :T], self.answer_start[index])

    def answer_positions(self, i: int, pad_to_multiple: int = 4) -> tuple[np.ndarray, np.ndarray]:
        """Prompt i's answer-predicting positions, padded to a multiple of `pad_to_multiple`
        (a static size for compilation) by repeating the last one; returns `(positions [A],
        real [A] bool)`. Reading the output only there saves the LM head on question tokens.
        The padding is small because each padded position costs a full LM head per sweep
        member; prompts rarely share a compiled sweep anyway (their lengths differ)."""
        positions = np.nonzero(self.answer_prediction_mask()[i])[0]
        if len(positions) == 0:
            raise ValueError(f"prompt {i} has no answer token to measure")
        A = -(-len(positions) // pad_to_multiple) * pad_to_multiple
        real = np.arange(A) < len(positions)
        return np.concatenate([positions, np.full(A - len(positions), positions[-1])]).astype(np.int32), real

    def prompt(self, i: int, pad_to_multiple: int = 16, answer_pad_to: int = 4) -> "PromptArrays":
        """Prompt i as the per-prompt sweeps take it: `single(i, pad_to_multiple)` with its
        answer positions (`answer_positions`, padded to a multiple of `answer_pad_to`)."""
        one = self.single(i, pad_to_multiple)
        positions, real = one.answer_positions(0, answer_pad_to)
        return PromptArrays(jax.numpy.asarray(one.tokens), jax.numpy.asarray(one.valid),
                            jax.numpy.asarray(positions), jax.numpy.asarray(real))

    def answer_prediction_mask(self) -> np.ndarray:
        """`[B, T]`: positions p whose output predicts an answer token, p+1 in the answer."""
        pos = np.arange(self.tokens.shape[1])[None]
        return (pos >= self.answer_start[:, None] - 1) & (pos <= self.lengths[:, None] - 2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptArrays:
    """One prompt as one value, a pytree of arrays (it passes through `jit` and `vmap` as its
    leaves): `tokens`, `valid` `[1, T]`; `answer_positions [A]`, the positions whose outputs
    predict answer tokens (padded to a static size by repeating the last), and `answer_real
    [A]`, False at that padding. Analyses without an answer leave the last two None."""

    tokens: jax.Array
    valid: jax.Array
    answer_positions: Optional[jax.Array] = None
    answer_real: Optional[jax.Array] = None

    @property
    def answer_targets(self) -> jax.Array:
        """The token each answer position predicts (the next one), `[A]`."""
        T = self.tokens.shape[1]
        return self.tokens[0, jax.numpy.minimum(self.answer_positions + 1, T - 1)]


def make_batch(token_lists: Sequence[Sequence[int]], answer_starts: Optional[Sequence[int]] = None,
               *, pad_to_multiple: int = 16, pad_id: int = 0) -> PromptBatch:
    """Right-pad token lists into a batch; the padded length is rounded up to `pad_to_multiple`
    so prompts of similar lengths share one compiled computation."""
    if not token_lists:
        raise ValueError("no prompts")
    lengths = [len(t) for t in token_lists]
    if min(lengths) == 0:
        raise ValueError("empty prompt")
    T = -(-max(lengths) // pad_to_multiple) * pad_to_multiple
    tokens = np.full((len(token_lists), T), pad_id, np.int32)
    valid = np.zeros((len(token_lists), T), bool)
    for i, t in enumerate(token_lists):
        tokens[i, :len(t)] = t
        valid[i, :len(t)] = True
    starts = np.asarray(lengths if answer_starts is None else answer_starts, np.int64)
    if np.any(starts < 1) or np.any(starts > np.asarray(lengths)):
        raise ValueError("answer_start must lie in 1..length (the answer needs a preceding position)")
    return PromptBatch(tokens, valid, starts)
