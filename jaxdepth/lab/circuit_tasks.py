"""Prompt-pair tasks for edge attribution: text in, `PromptPairs` out.

`addition_pairs` is the task the cookbook, `jaxdepth circuit` and the edge benchmark run on the
embedded model: two-digit addition, whose clean and corrupt prompts differ in one digit (the
tens of the first operand), so that the right next token (the tens of the sum) differs too. The
metric is the logit difference of the two answers' tokens (`logit_difference`)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from jaxdepth.analyses.edges.pairs import PromptPairs, prompt_pairs


@dataclasses.dataclass(frozen=True)
class TaskPairs:
    """Pairs of prompts as text and tokens: `clean`, `corrupt` (token lists), `labels [n, 2]`
    (the clean and the corrupt answer token), `texts` (the clean and corrupt text of each)."""

    clean: list
    corrupt: list
    labels: np.ndarray
    texts: list

    def prompt_pairs(self) -> PromptPairs:
        return prompt_pairs(self.clean, self.corrupt, self.labels)


def addition_pairs(tokenizer, n: int = 20, seed: int = 0, shots: int = 2) -> TaskPairs:
    """`n` pairs `'{a}+{b}={a+b}\\n' * shots + '{c}+{d}='` with c two digits (clean) or c + 10
    (corrupt), every sum below 100; labels: the first token of each answer (its tens digit, one
    token in a tokenizer that splits digits, as SmolLM2's). Pairs whose two prompts tokenize to
    different lengths are skipped (the tokenizer decides); a ValueError if fewer than `n` remain
    after 20n draws."""
    rng = np.random.default_rng(seed)
    clean, corrupt, labels, texts = [], [], [], []
    for _ in range(20 * n):
        if len(clean) == n:
            break
        examples = ""
        for _ in range(shots):
            a, b = rng.integers(10, 50, 2)
            examples += f"{a}+{b}={a + b}\n"
        c, d = int(rng.integers(10, 40)), int(rng.integers(10, 50))
        texts_pair = (f"{examples}{c}+{d}=", f"{examples}{c + 10}+{d}=")
        x, y = (list(tokenizer.encode(t)) for t in texts_pair)
        right, wrong = (list(tokenizer.encode(str(s)))[0] for s in (c + d, c + 10 + d))
        if len(x) != len(y) or right == wrong:
            continue
        clean.append(x)
        corrupt.append(y)
        labels.append([right, wrong])
        texts.append(texts_pair)
    if len(clean) < n:
        raise ValueError(f"only {len(clean)} of {n} addition pairs tokenize to equal lengths with this tokenizer")
    return TaskPairs(clean, corrupt, np.array(labels, np.int32), texts)


def read_pairs(path: str, tokenizer) -> TaskPairs:
    """Pairs from a JSON Lines file, one object per pair: `{"clean": text, "corrupt": text,
    "right": text, "wrong": text}` (the answers' first tokens are the labels)."""
    clean, corrupt, labels, texts = [], [], [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                pair = (row["clean"], row["corrupt"])
                answers = (row["right"], row["wrong"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{path}:{number}: each line must be a JSON object with clean, corrupt, right and wrong ({e})"
                ) from None
            clean.append(list(tokenizer.encode(pair[0])))
            corrupt.append(list(tokenizer.encode(pair[1])))
            labels.append([list(tokenizer.encode(a))[0] for a in answers])
            texts.append(pair)
    if not clean:
        raise ValueError(f"{path} holds no pairs")
    return TaskPairs(clean, corrupt, np.array(labels, np.int32), texts)
