"""Prompt datasets formatted as the studies do (METHODS §8): raw text, no chat template, the
gold solution teacher-forced. Each prompt keeps its question part and answer part apart, because
residual erasure and integrated gradients measure the answer tokens only.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Optional, Sequence

import numpy as np

from jaxdepth.core.batch import PromptBatch, make_batch

INSTRUCTION = ("Given the following problem, reason and give a final answer to the problem.\n"
               "Problem: {problem}\nYour response should end with \"{ending}\" where [answer] is the "
               "response to the problem.\n")
AIME_MAX_TOKENS = 400


@dataclasses.dataclass(frozen=True)
class Prompt:
    """`question + answer` is the text the model reads; `answer` is what is teacher-forced."""

    question: str
    answer: str

    @property
    def text(self) -> str:
        return self.question + self.answer


class DatasetError(ValueError):
    """A dataset file is missing or one of its rows is malformed."""


def _field(row: dict, name: str):
    for key in (name, name.capitalize(), name.upper()):
        if key in row:
            return row[key]
    raise KeyError(name)


def _gsm8k_solution(row: dict) -> str:
    """The gold rationale (text before '####', calculator annotations kept), then 'The final
    answer is N'."""
    rationale, sep, final = _field(row, "answer").partition("####")
    if not sep:
        raise ValueError("GSM8K answer has no '####' final answer")
    return rationale + f"The final answer is {final.strip()}"


def format_gsm8k(row: dict) -> Prompt:
    """Instruction + question, a blank line, and the gold solution (METHODS §8)."""
    question = INSTRUCTION.format(problem=_field(row, "question"), ending="The final answer is [answer]") + "\n"
    return Prompt(question, _gsm8k_solution(row))


def format_short(row: dict) -> Prompt:
    """A GSM8K-layout row without the studies' instruction: 'Problem: ...' and 'Solution: ' then
    the gold solution. About half as many tokens as `format_gsm8k`, a quarter of the erasure work."""
    return Prompt(f"Problem: {_field(row, 'question')}\nSolution: ", _gsm8k_solution(row))


def format_hellaswag(row: dict) -> Prompt:
    """Context + ' ' + the gold ending (no space before an ending starting with ',')."""
    if "endings" in row:  # the hub layout: every ending and the gold label
        ending = row["endings"][int(row["label"])]
    else:
        ending = row["ending"]
    ctx = row["ctx"]
    return Prompt(ctx, ending if ending.startswith(",") else " " + ending)


def format_aime(row: dict) -> Prompt:
    """The GSM8K instruction ending in '\\boxed{[answer]}', then a blank line and the solution."""
    question = INSTRUCTION.format(problem=_field(row, "problem"), ending="\\boxed{[answer]}") + "\n\n"
    return Prompt(question, _field(row, "solution"))


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    formatter: Callable[[dict], Prompt]
    hub: Optional[tuple] = None  # (path, config name or None, split)
    max_tokens: Optional[int] = None
    embedded: Optional[str] = None  # a JSONL file shipped in the package


EMBEDDED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

DATASETS = {
    # Short arithmetic problems written for jaxdepth, in GSM8K's row layout, without the studies'
    # long instruction: the main job works offline and its per-position sweeps stay cheap on a CPU.
    "default": DatasetSpec(format_short, embedded=os.path.join(EMBEDDED_DIR, "default_prompts.jsonl")),
    "gsm8k": DatasetSpec(format_gsm8k, ("openai/gsm8k", "main", "test")),
    "hellaswag": DatasetSpec(format_hellaswag, ("Rowan/hellaswag", None, "validation")),
    "aime24": DatasetSpec(format_aime, ("Maxwell-Jia/AIME_2024", None, "train"), AIME_MAX_TOKENS),
}


def read_rows(name: str, path: Optional[str] = None) -> list[dict]:
    """Rows of dataset `name` from a local JSONL file, the package (embedded sets), or the hub
    through `datasets` (which also finds a local cache when offline)."""
    if path is not None:
        if not os.path.isfile(path):
            raise DatasetError(f"dataset file not found: {path}")
        rows = []
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DatasetError(f"{path}:{number}: not valid JSON ({e})") from None
        return rows
    spec = DATASETS[name]
    if spec.embedded is not None:
        return read_rows(name, spec.embedded)
    import datasets

    hub_path, config, split = spec.hub
    try:
        return list(datasets.load_dataset(hub_path, config, split=split))
    except Exception as e:
        raise DatasetError(f"could not load {hub_path} from the hub or the local cache "
                           f"({type(e).__name__}: {e}); pass a local JSONL file instead") from e


def load_prompts(name: str, path: Optional[str] = None, limit: Optional[int] = None) -> list[Prompt]:
    """Formatted prompts of dataset `name` ('gsm8k', 'hellaswag', 'aime24')."""
    if name not in DATASETS:
        raise DatasetError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    prompts = []
    for number, row in enumerate(read_rows(name, path), 1):
        try:
            prompts.append(DATASETS[name].formatter(row))
        except (KeyError, ValueError, TypeError, IndexError) as e:
            raise DatasetError(f"{name} row {number} is malformed: {type(e).__name__}: {e}") from None
        if limit is not None and len(prompts) >= limit and DATASETS[name].max_tokens is None:
            break
    return prompts


def encode(tokenizer, prompts: Sequence[Prompt], *, max_tokens: Optional[int] = None,
           context: Optional[int] = None, limit: Optional[int] = None,
           pad_to_multiple: int = 16) -> PromptBatch:
    """Tokenize with the tokenizer's defaults; the answer starts at the first token that begins
    at or after the end of the question text. Prompts over `max_tokens` are skipped (the AIME
    rule); a prompt over the model's `context` is an error."""
    token_lists, starts = [], []
    for prompt in prompts:
        enc = tokenizer(prompt.text, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        if max_tokens is not None and len(ids) > max_tokens:
            continue
        if context is not None and len(ids) > context:
            raise ValueError(f"a prompt of {len(ids)} tokens exceeds the model's context of {context}: "
                             f"{prompt.text[:80]!r}...")
        boundary = len(prompt.question)
        # Special tokens (a BOS) have empty offsets (0, 0): they belong to the question.
        start = next((i for i, (a, b) in enumerate(offsets) if b > a and a >= boundary), len(ids))
        token_lists.append(ids)
        starts.append(max(start, 1))
        if limit is not None and len(token_lists) >= limit:
            break
    if not token_lists:
        raise ValueError(f"no prompt left to encode ({len(prompts)} given, max_tokens={max_tokens})")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return make_batch(token_lists, starts, pad_to_multiple=pad_to_multiple, pad_id=pad)
