"""Prompt-pair tasks for edge attribution: text in, `TaskPairs` out.

`addition_pairs` is the task the cookbook, `jaxdepth circuit` and the edge benchmark run on the
embedded model: two-digit addition, whose clean and corrupt prompts differ in one digit (the
tens of the first operand), so that the right next token (the tens of the sum) differs too. The
metric is the logit difference of the two answers' tokens (`logit_difference`). Pairs of your
own come from `jaxdepth.analyses.edges.text_pairs` or, from a JSON Lines file, `read_pairs`
(re-exported here for the command)."""

from __future__ import annotations

import numpy as np

from jaxdepth.analyses.edges.pairs import TaskPairs, answer_token, read_pairs

__all__ = ["TaskPairs", "addition_pairs", "read_pairs"]


def addition_pairs(tokenizer, n: int = 20, seed: int = 0, shots: int = 2) -> TaskPairs:
    """`n` pairs `'{a}+{b}={a+b}\\n' * shots + '{c}+{d}='` with c two digits (clean) or c + 10
    (corrupt), every sum below 100; labels: the first token of each answer (its tens digit, one
    token in a tokenizer that splits digits, as SmolLM2's; `answer_token`). Pairs whose two
    prompts tokenize to different lengths, or whose answers begin with the same token, are
    skipped (the tokenizer decides); a ValueError if fewer than `n` remain after 20n draws."""
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
        right, wrong = (answer_token(tokenizer, str(s)) for s in (c + d, c + 10 + d))
        if len(x) != len(y) or right == wrong:
            continue
        clean.append(x)
        corrupt.append(y)
        labels.append([right, wrong])
        texts.append(texts_pair)
    if len(clean) < n:
        raise ValueError(
            f"only {len(clean)} of {n} addition pairs tokenize to equal lengths and distinct answer tokens with this "
            "tokenizer"
        )
    return TaskPairs(clean, corrupt, np.array(labels, np.int32), texts)
