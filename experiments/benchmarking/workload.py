"""Each analysis' prompts: one encoding of the data, then every case's prompt count and token cap."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class Workload:
    """One analysis' prompts: the jaxdepth batch and the same prompts as plain token lists."""

    name: str
    batch: object  # jaxdepth PromptBatch
    token_lists: list
    answer_starts: list
    answer_replaced: int  # prompts whose answer was cut off by the cap (see `truncate`)
    cap: Optional[int]

    @property
    def lengths(self):
        return [len(t) for t in self.token_lists]

    def describe(self) -> str:
        s = f"{len(self.token_lists)} prompt(s), lengths {self.lengths}"
        if self.cap:
            s += f" (cap {self.cap} tokens)"
        if self.answer_replaced:
            s += (
                f"; {self.answer_replaced} answer(s) cut off by the cap: their last quarter of tokens "
                "stands in as the answer"
            )
        return s


def truncate(full, indices, cap: Optional[int], pad_id: int, name: str) -> Workload:
    """Prompts `indices` of `full`, cut to their first `cap` tokens. A cut that removes every
    answer-predicting position (the answer starts at token >= cap - 1) would leave erasure and IG
    nothing to measure: the last quarter of the cut prompt then stands in as its answer. Both
    implementations receive exactly the same tokens and answer starts."""
    from jaxdepth.core.batch import make_batch

    token_lists, starts, replaced = [], [], 0
    for i in indices:
        n = int(full.lengths[i])
        tokens = [int(t) for t in full.tokens[i, :n]]
        start = int(full.answer_start[i])
        if cap is not None and n > cap:
            tokens, n = tokens[:cap], cap
        if start > n - 1:
            start = n - max(1, n // 4)
            replaced += 1
        token_lists.append(tokens)
        starts.append(start)
    batch = make_batch(token_lists, starts, pad_id=pad_id)
    return Workload(name, batch, token_lists, starts, replaced, cap)


def combine_caps(*caps):
    caps = [c for c in caps if c]
    return min(caps) if caps else None


def build_workloads(model, args, cases: dict):
    """Every prompt the run needs, encoded once (the cases' counts, and at least the study's 10
    and the erasure baseline's), and each case's workload: its first prompts cut to its cap.
    Returns (every encoded prompt, {analysis: workload})."""
    from jaxdepth.lab.prompts import encode, load_prompts

    counts = {a: case.prompts(args) for a, case in cases.items()}
    need = max(list(counts.values()) + [10, args.baseline_prompts])
    full = encode(model.tokenizer, load_prompts("gsm8k", args.data, limit=need))
    pad_id = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0
    workloads = {
        a: truncate(full, range(min(counts[a], len(full))), case.cap(args), pad_id, a) for a, case in cases.items()
    }
    return full, workloads
