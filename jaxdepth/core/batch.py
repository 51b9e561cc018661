"""Prompts as arrays: right-padded token ids, a validity mask and where the answer starts."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import numpy as np

__all__ = [
    "LengthBuckets",
    "PromptBatch",
    "PromptArrays",
    "make_batch",
    "GROUP_TOKENS",
    "ANSWER_BUCKETS",
]


# Tokens (rows x padded length) of one forward when prompts are grouped (`PromptBatch.groups`):
# on 2-core x86 CPUs a forward of the embedded model reaches about 90% of its large-batch speed
# from 128 rows on, against 70% at 64.
GROUP_TOKENS = 256


@dataclasses.dataclass(frozen=True)
class LengthBuckets:
    """The lengths prompts are padded to, so that prompts of many lengths share a few compiled
    computations (every sweep compiles once per shape).

    Geometric (the default): `smallest` x 1, 1.5, 2, 3, 4, 6, 8, ... (the powers of two and
    their midpoints: a ladder of ratio about 1.41). A prompt is padded by at most half its length
    and about a fifth on average, and prompts from 121 to 349 tokens (the GSM8K sample's rows
    0-9) share 4 lengths (128, 192, 256, 384) instead of 10. `geometric=False`: every multiple of
    `smallest` (the least padding, a compilation per `smallest` tokens of length). Padding never
    changes a result: padded positions are masked."""

    smallest: int = 16
    geometric: bool = True

    def __post_init__(self):
        if int(self.smallest) != self.smallest or self.smallest < 1:
            raise ValueError(f"the smallest bucket must be a positive integer, got {self.smallest!r}")

    def padded(self, length: int) -> int:
        """The bucket of a prompt of `length` tokens: the smallest bucket length >= `length`."""
        length, b = int(length), self.smallest
        if not self.geometric:
            return max(-(-length // b), 1) * b
        while b < length:
            if b + b // 2 >= length:
                return b + b // 2
            b *= 2
        return b

    def __str__(self) -> str:
        return f"{'geometric' if self.geometric else 'multiple'}:{self.smallest}"

    @classmethod
    def parse(cls, text: str) -> "LengthBuckets":
        """'geometric' or 'geometric:N' (the ladder from N), 'multiple:N' (every multiple of N)."""
        kind, colon, smallest = str(text).partition(":")
        if kind not in ("geometric", "multiple") or (colon and not smallest.isdigit()):
            raise ValueError(
                f"length buckets must be 'geometric', 'geometric:N' or 'multiple:N' (N a positive "
                f"integer), got {text!r}"
            )
        return cls(int(smallest or cls.smallest), geometric=kind == "geometric")


# Answer positions (the LM head's rows of a per-prompt sweep) are padded on the same ladder from 4.
ANSWER_BUCKETS = LengthBuckets(4)


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """`tokens [B, T]` int32 right-padded, `valid [B, T]` bool, `answer_start [B]`: the position
    of the first answer token (= the prompt length when a prompt has no answer part).
    `buckets`: the lengths its prompts are padded to when taken apart (`single`, `groups`,
    `prompt`); T itself is a bucket length when the batch comes from `make_batch`."""

    tokens: np.ndarray
    valid: np.ndarray
    answer_start: np.ndarray
    buckets: LengthBuckets = LengthBuckets()

    @property
    def lengths(self) -> np.ndarray:
        """Each prompt's real length `[B]` (its count of valid tokens)."""
        return self.valid.sum(axis=1)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, index) -> "PromptBatch":
        """The prompts at `index` (an int array, a slice, a list), as a batch of their own."""
        return PromptBatch(self.tokens[index], self.valid[index], self.answer_start[index], self.buckets)

    def single(self, i: int, buckets: Optional[LengthBuckets] = None) -> "PromptBatch":
        """Prompt i alone, padded only to its own bucket (`buckets`, default the batch's):
        per-prompt sweeps then cost about what the prompt costs, not what the longest one does,
        and prompts of similar lengths share a compiled computation."""
        return self._trimmed(np.array([i]), buckets or self.buckets)

    def groups(
        self, max_tokens: int = GROUP_TOKENS, buckets: Optional[LengthBuckets] = None
    ) -> list[tuple[np.ndarray, "PromptBatch"]]:
        """The prompts packed into sub-batches of similar length: `[(indices, sub-batch), ...]`;
        the sub-batch's first `len(indices)` rows are those prompts, and its row count is a power
        of two (the last prompt repeated): a sweep compiles once per (rows, bucket).

        Prompts are taken shortest first; a group grows while its rows, rounded up to a power of
        two, times its padded length (its longest prompt's bucket) stay within `max_tokens`, and
        a longer prompt is a group of its own. One forward per group instead of per prompt: a
        prompt of 64 tokens alone gives each matmul 64 rows, too few to keep a CPU's vector
        units busy, while sorting by length keeps the padding small."""
        buckets = buckets or self.buckets
        lengths = self.lengths
        packed: list[list[int]] = []
        for i in np.argsort(lengths, kind="stable"):
            group = packed[-1] if packed else None
            if group is None or _power_of_two_ceil(len(group) + 1) * buckets.padded(lengths[i]) > max_tokens:
                packed.append([int(i)])
            else:
                group.append(int(i))
        out = []
        for group in packed:
            rows = group + [group[-1]] * (_power_of_two_ceil(len(group)) - len(group))
            out.append((np.asarray(group), self._trimmed(np.asarray(rows), buckets)))
        return out

    def _trimmed(self, index: np.ndarray, buckets: LengthBuckets) -> "PromptBatch":
        """Prompts `index`, cut to their longest prompt's bucket length (at most the batch's
        own length, which `make_batch` makes a bucket length)."""
        T = min(buckets.padded(self.lengths[index].max()), self.tokens.shape[1])
        return PromptBatch(self.tokens[index, :T], self.valid[index, :T], self.answer_start[index], self.buckets)

    def answer_positions(self, i: int, buckets: LengthBuckets = ANSWER_BUCKETS) -> tuple[np.ndarray, np.ndarray]:
        """Prompt i's answer-predicting positions, padded to a bucket of `buckets` (a static
        size for compilation) by repeating the last one; returns `(positions [A], real [A]
        bool)`. Reading the output only there saves the LM head on question tokens; each
        padded position costs a full LM head per sweep member, so the ladder starts small."""
        positions = np.nonzero(self.answer_prediction_mask()[i])[0]
        if len(positions) == 0:
            raise ValueError(f"prompt {i} has no answer token to measure")
        A = buckets.padded(len(positions))
        real = np.arange(A) < len(positions)
        return np.concatenate([positions, np.full(A - len(positions), positions[-1])]).astype(np.int32), real

    def prompt(
        self, i: int, buckets: Optional[LengthBuckets] = None, answer_buckets: LengthBuckets = ANSWER_BUCKETS
    ) -> "PromptArrays":
        """Prompt i as the per-prompt sweeps take it: `single(i, buckets)` with its answer
        positions (`answer_positions(answer_buckets)`)."""
        one = self.single(i, buckets)
        positions, real = one.answer_positions(0, answer_buckets)
        # device_put, not jnp.asarray: the latter compiles a program per shape
        return PromptArrays(*jax.device_put((one.tokens, one.valid, positions, real)))

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
        return _next_tokens(self.tokens, self.answer_positions)


@jax.jit  # one program, not one per eager operation, when called outside a jitted function
def _next_tokens(tokens, positions):
    return tokens[0, jax.numpy.minimum(positions + 1, tokens.shape[1] - 1)]


def make_batch(
    token_lists: Sequence[Sequence[int]],
    answer_starts: Optional[Sequence[int]] = None,
    *,
    buckets: LengthBuckets = LengthBuckets(),
    pad_id: int = 0,
    max_length: Optional[int] = None,
) -> PromptBatch:
    """Right-pad token lists into a batch whose length is the longest list's bucket (`buckets`,
    kept by the batch for taking it apart), so that prompts of similar lengths share one
    compiled computation. `max_length` (the model's context): no padding beyond it, whatever
    the bucket (prompts longer than it are the caller's to refuse)."""
    if not token_lists:
        raise ValueError("no prompts")
    lengths = [len(t) for t in token_lists]
    if min(lengths) == 0:
        raise ValueError("empty prompt")
    T = buckets.padded(max(lengths))
    if max_length is not None and max(lengths) <= max_length:
        T = min(T, max_length)
    tokens = np.full((len(token_lists), T), pad_id, np.int32)
    valid = np.zeros((len(token_lists), T), bool)
    for i, t in enumerate(token_lists):
        tokens[i, : len(t)] = t
        valid[i, : len(t)] = True
    starts = np.asarray(lengths if answer_starts is None else answer_starts, np.int64)
    if np.any(starts < 1) or np.any(starts > np.asarray(lengths)):
        raise ValueError("answer_start must lie in 1..length (the answer needs a preceding position)")
    return PromptBatch(tokens, valid, starts, buckets)


def _power_of_two_ceil(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()
