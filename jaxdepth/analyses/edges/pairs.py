"""Prompt pairs (a clean and a corrupt prompt of the same length) and what the metric of edge
attribution reads in them: pairs from token ids (`prompt_pairs`), from texts and a tokenizer
(`text_pairs`) or from a JSON Lines file (`read_pairs`).

The metric F is the package's one form (`jaxdepth.analyses.metrics`): a `Metric` of a `Readout`,
one value per pair `[B]`, reading the positions it declares (`pair_reads`): 'last' each pair's
last real position, 'all' every position (`Readout.real` the pairs' `valid`), 'answer' the last
position with the right label (`labels[:, 0]`) as its answer. `Readout.labels` are the pairs'
labels, and a metric with `clean=True` gets the clean run's logits at its positions
(`Readout.clean`: the run under the same interventions, without any patch or path). The
built-ins: `logit_difference`, `answer_probability`, `kl_clean_to_run`, `kl_run_to_clean`,
`mean_kl_clean_to_run` (re-exported by `jaxdepth.analyses.edges`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.analyses.metrics import Metric, Reads, as_metric, logit_difference, reads_at
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import check_tokens

__all__ = [
    "PromptPairs",
    "prompt_pairs",
    "TaskPairs",
    "text_pairs",
    "read_pairs",
    "answer_token",
    "edge_metric",
    "pair_reads",
]


# Why a pair is refused, said once for every builder and check.
SAME_PROMPTS = "the clean and the corrupt prompt are the same tokens: nothing differs, so there is nothing to attribute"
SHARED_ANSWER_TOKEN = (
    "the right and the wrong answer begin with the same token, and logit_difference reads each answer's first "
    "token only: F would be 0 on both prompts of such a pair, and its scores and effects 0. Make the answers "
    "differ in their first token by moving what they share into the prompts (' New York' / ' New Delhi': end "
    "both prompts with ' New' and answer ' York' / ' Delhi'; numbers written with a leading space: end the "
    "prompts with the space and write the answers without it)"
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptPairs:
    """A batch of B prompt pairs, right-padded to T positions: `clean`, `corrupt` int `[B, T]`,
    `valid [B, T]` (the same for both prompts of a pair), `last [B]` (each pair's last real
    position, whose logits the metric reads) and the metric's `labels` (`[B, ...]`, or None).
    Build it with `prompt_pairs` (token ids), or `text_pairs` / `read_pairs` (texts).
    `clean_logits [B, P, V]`: the clean run's logits at the P positions the metric reads
    (`pair_reads`), which the edge functions fill in for a metric with `clean=True` (None
    otherwise)."""

    clean: jax.Array
    corrupt: jax.Array
    valid: jax.Array
    last: jax.Array
    labels: Optional[jax.Array] = None
    clean_logits: Optional[jax.Array] = None

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

    def check(self, config: ModelConfig, metric: Optional[Metric] = None) -> None:
        """Refuse token ids or a context the model cannot take, and labels that `metric` cannot
        read: for `logit_difference`, labels that are not `[B, 2]` or a pair whose right and
        wrong answer are the same token (F would be 0 on both of its runs, and the pair would
        be averaged into every score and effect as if it had no circuit)."""
        check_tokens(np.asarray(self.clean), config)
        check_tokens(np.asarray(self.corrupt), config)
        if metric is not logit_difference:  # another metric's labels mean what that metric says
            return
        labels = None if self.labels is None else np.asarray(self.labels)
        if labels is None or labels.shape != (len(self), 2):
            shape = None if labels is None else labels.shape
            raise ValueError(
                f"logit_difference reads labels [B, 2] = [{len(self)}, 2] (the right and the wrong answer's token "
                f"ids), got {shape}"
            )
        same = np.flatnonzero(labels[:, 0] == labels[:, 1])
        if len(same):
            raise ValueError("; ".join(f"pair {i}: token {labels[i, 0]}" for i in same) + f": {SHARED_ANSWER_TOKEN}")


def prompt_pairs(clean, corrupt=None, labels=None) -> PromptPairs:
    """Pairs from token ids: `clean` and `corrupt` are sequences of B token lists (or int arrays
    `[B, T]`, all positions real); the clean and corrupt prompt of each pair must have the same
    length (edge scores compare activations position by position). Shorter pairs are
    right-padded with token 0. `labels`: what the metric reads besides the logits, one row
    per pair (e.g. `[B, 2]` token ids for `logit_difference`). `corrupt` None: clean prompts
    only, for ablations that need no corrupt run (`jaxdepth.analyses.edges.ablations`: zero,
    mean); the corrupt ablation refuses them."""
    clean = _token_lists(clean, "clean")
    single = corrupt is None
    corrupt = [list(c) for c in clean] if single else _token_lists(corrupt, "corrupt")
    if len(clean) != len(corrupt):
        raise ValueError(f"{len(clean)} clean prompts but {len(corrupt)} corrupt ones: give one of each per pair")
    if not clean:
        raise ValueError("no prompt pairs")
    for i, (a, b) in enumerate(zip(clean, corrupt)):
        if single and not a:
            raise ValueError(f"prompt {i} is empty")
        if not single:
            _check_pair(f"pair {i}", a, b)
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


def _check_pair(name: str, clean: list, corrupt: list) -> None:
    """Refuse a pair (named `name` in the error) whose token lists differ in length, are empty,
    or are the same tokens (nothing to attribute)."""
    if len(clean) != len(corrupt):
        raise ValueError(
            f"{name}: the clean prompt has {len(clean)} tokens and the corrupt one {len(corrupt)}; edge scores "
            "compare the two runs position by position, so both prompts of a pair need the same length"
        )
    if not clean:
        raise ValueError(f"{name} is empty")
    if clean == corrupt:
        raise ValueError(f"{name}: {SAME_PROMPTS}")


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


@dataclasses.dataclass(frozen=True)
class TaskPairs:
    """Pairs of prompts as text and as tokens: `clean`, `corrupt` (token lists), `labels [n, 2]`
    (the right and the wrong answer's first token, what `logit_difference` reads) and `texts`
    (the clean and the corrupt text of each pair). `prompt_pairs()` gives the `PromptPairs`
    the edge functions take. Build it with `text_pairs` or `read_pairs`. `metric`: what the task
    is scored by, a `jaxdepth.Metric` (`Readout.labels` are these labels; None:
    `logit_difference`); the circuit command reads it from the task (`scored_by`), so a task of
    one's own brings its own."""

    clean: list
    corrupt: list
    labels: np.ndarray
    texts: list
    metric: Optional[Metric] = None

    def prompt_pairs(self) -> PromptPairs:
        """The pairs as a padded batch (`prompt_pairs`)."""
        return prompt_pairs(self.clean, self.corrupt, self.labels)

    def scored_by(self) -> Metric:
        """The task's metric: `metric`, or `logit_difference` where it names none."""
        return logit_difference if self.metric is None else self.metric


def answer_token(tokenizer, text: str) -> int:
    """The first token of the answer `text` as `logit_difference`'s labels hold it: `text`
    tokenized alone, without the special tokens a tokenizer adds to a prompt (a BOS token would
    be every answer's first token)."""
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # a tokenizer whose encode takes the text alone
        ids = list(tokenizer.encode(text))
    if not ids:
        raise ValueError(f"the answer {text!r} has no tokens")
    return int(ids[0])


def text_pairs(
    tokenizer, clean: Sequence[str], corrupt: Sequence[str], right: Sequence[str], wrong: Sequence[str]
) -> TaskPairs:
    """Pairs from texts, tokenized as `jaxdepth circuit` does: pair i is the prompts `clean[i]`
    and `corrupt[i]` (`tokenizer.encode`, with the tokenizer's special tokens) and the answers
    `right[i]` (the clean prompt's) and `wrong[i]` (the corrupt one's), whose first tokens
    (`answer_token`) are the labels of `logit_difference`. A ValueError names the first pair
    whose prompts tokenize to different lengths or to the same tokens, or whose answers begin
    with the same token. `.prompt_pairs()` of the result is what the edge functions take."""
    columns = [list(c) for c in (clean, corrupt, right, wrong)]
    if any(isinstance(c, str) for c in (clean, corrupt, right, wrong)) or len({len(c) for c in columns}) != 1:
        raise ValueError("clean, corrupt, right and wrong must be lists of texts of the same length, one per pair")
    return _tokenized(tokenizer, list(zip(*columns)), [f"pair {i}" for i in range(len(columns[0]))])


def read_pairs(path: str, tokenizer) -> TaskPairs:
    """Pairs from a JSON Lines file, one object per pair: `{"clean": text, "corrupt": text,
    "right": text, "wrong": text}`, tokenized and checked as `text_pairs` does (its errors name
    the pair and its line)."""
    rows, names = [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append(tuple(row[key] for key in ("clean", "corrupt", "right", "wrong")))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{path}:{number}: each line must be a JSON object with clean, corrupt, right and wrong ({e})"
                ) from None
            names.append(f"pair {len(names)} ({path}:{number})")
    if not rows:
        raise ValueError(f"{path} holds no pairs")
    return _tokenized(tokenizer, rows, names)


def _tokenized(tokenizer, rows: list, names: list) -> TaskPairs:
    """`TaskPairs` of `rows` (clean, corrupt, right, wrong) of text, each pair checked and named
    in errors by `names`."""
    if not rows:
        raise ValueError("no prompt pairs")
    clean, corrupt, labels = [], [], []
    for name, (x, y, right, wrong) in zip(names, rows):
        where = f"{name} ({x!r} / {y!r})"
        a, b = list(tokenizer.encode(x)), list(tokenizer.encode(y))
        _check_pair(where, a, b)
        try:
            answers = [answer_token(tokenizer, t) for t in (right, wrong)]
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if answers[0] == answers[1]:
            shown = f" ({tokenizer.decode(answers[:1])!r})" if hasattr(tokenizer, "decode") else ""
            raise ValueError(
                f"{name} (answers {right!r} / {wrong!r}): token {answers[0]}{shown}: {SHARED_ANSWER_TOKEN}"
            )
        clean.append(a)
        corrupt.append(b)
        labels.append(answers)
    return TaskPairs(clean, corrupt, np.array(labels, np.int32), [(row[0], row[1]) for row in rows])


def edge_metric(metric, analysis: str, pairs: PromptPairs) -> Metric:
    """`metric` as a `Metric` the edge functions can read (`jaxdepth.analyses.metrics.as_metric`):
    a plain function of the logits, the form they took before, is refused with a message that
    shows the new one; a metric of 'answer' positions needs the pairs' labels (its answer is the
    right label, `labels[:, 0]`). Every edge function has a clean run to give a `clean=True`
    metric."""
    return as_metric(metric, analysis, clean_available=True, answers_available=pairs.labels is not None)


def pair_reads(metric: Metric, pairs: PromptPairs) -> Reads:
    """The positions `metric` reads in `pairs` (`jaxdepth.analyses.metrics.Reads`, `[B, P]`):
    'last' each pair's last real position (`pairs.last`), 'all' every position (real where
    `pairs.valid`), 'answer' the last position, whose answer token is the right label
    (`labels[:, 0]`, or `labels [B]` itself). jit-traceable."""
    if metric.reads == "all":
        return reads_at(metric, pairs.valid)
    B = pairs.clean.shape[0]
    last = jnp.asarray(pairs.last, jnp.int32)[:, None]
    if metric.reads == "last":
        return Reads(last, jnp.ones((B, 1), bool))
    labels = jnp.asarray(pairs.labels)
    answer = labels if labels.ndim == 1 else labels[:, 0]
    return Reads(last, jnp.ones((B, 1), bool), answer[:, None].astype(jnp.int32))
