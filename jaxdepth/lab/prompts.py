"""Prompt datasets formatted as the studies do (METHODS §8): raw text, no chat template, the
gold solution teacher-forced. Each prompt keeps its question part and answer part apart, because
residual erasure and integrated gradients measure the answer tokens only.

Two datasets carry a difficulty, read into `Prompt.difficulty`: MATH (its level, 1-5) and MQuAKE
(the number of hops, 2-4), the axes along which the first study plots its depth score;
`load_prompts(..., difficulty=k)` keeps the prompts of one level.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Optional, Sequence


from jaxdepth.core.batch import LengthBuckets, PromptBatch, make_batch

__all__ = [
    "Prompt",
    "DatasetError",
    "format_gsm8k",
    "format_short",
    "format_hellaswag",
    "format_aime",
    "math_level",
    "math_subject",
    "format_math",
    "mquake_hops",
    "format_mquake",
    "DatasetSpec",
    "read_rows",
    "load_prompts",
    "encode",
    "INSTRUCTION",
    "AIME_MAX_TOKENS",
    "MATH_LEVELS",
    "MATH_SUBJECTS",
    "EMBEDDED_DIR",
    "DATASETS",
]


INSTRUCTION = (
    "Given the following problem, reason and give a final answer to the problem.\n"
    'Problem: {problem}\nYour response should end with "{ending}" where [answer] is the '
    "response to the problem.\n"
)
AIME_MAX_TOKENS = 400


@dataclasses.dataclass(frozen=True)
class Prompt:
    """`question + answer` is the text the model reads; `answer` is what is teacher-forced.
    `difficulty`: the dataset's difficulty of this prompt (MATH level, MQuAKE hops), None for a
    dataset without one."""

    question: str
    answer: str
    difficulty: Optional[int] = None

    @property
    def text(self) -> str:
        """Question and answer as one text, what is tokenized."""
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


def _text(row: dict, name: str) -> str:
    value = _field(row, name)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be text, got {type(value).__name__}")
    return value


MATH_LEVELS = (1, 2, 3, 4, 5)
MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)


def math_level(row: dict) -> Optional[int]:
    """The level of a MATH row, 1-5, from 'Level N' (or the number itself). MATH marks a few
    problems 'Level ?': those have no level (None) and match no level filter."""
    level = _field(row, "level")
    if isinstance(level, str):
        text = level.strip()
        if text == "Level ?":
            return None
        if not text.startswith("Level "):
            raise ValueError(f"level must look like 'Level 3', got {level!r}")
        text = text[len("Level ") :]
        level = int(text) if text.isdigit() else text
    if isinstance(level, bool) or not isinstance(level, int) or level not in MATH_LEVELS:
        raise ValueError(f"level must be one of {MATH_LEVELS}, got {level!r}")
    return level


def math_subject(row: dict) -> str:
    """The subject of a MATH row as the hub names its config: 'Counting & Probability' ->
    'counting_and_probability'."""
    return _text(row, "type").strip().lower().replace("&", "and").replace(" ", "_")


def format_math(row: dict) -> Prompt:
    """'Problem: {problem}\\nAnswer:' and ' ' + the gold solution, the level as difficulty: the
    format of the first study's code for MATH (the solution is the whole worked solution,
    ending in its \\boxed answer)."""
    return Prompt(f"Problem: {_text(row, 'problem')}\nAnswer:", " " + _text(row, "solution"), math_level(row))


def mquake_hops(row: dict) -> int:
    """The number of hops of a MQuAKE row: its fact triples (`orig_triples` on the hub,
    `orig.triples` in the published JSON files), else its single-hop questions."""
    if "orig_triples" in row:
        chain = row["orig_triples"]
    elif isinstance(row.get("orig"), dict) and "triples" in row["orig"]:
        chain = row["orig"]["triples"]
    else:
        chain = _field(row, "single_hops")
    if not isinstance(chain, list) or not chain:
        raise ValueError(f"the hop chain must be a non-empty list, got {chain!r}")
    return len(chain)


def format_mquake(row: dict) -> Prompt:
    """'Question: {the first multi-hop question}\\nAnswer:' and ' ' + the gold answer (before any
    edit), the hop count as difficulty: the format of the first study's code for MQuAKE."""
    questions = _field(row, "questions")
    if not isinstance(questions, list) or not questions or not isinstance(questions[0], str):
        raise ValueError("questions must be a non-empty list of texts")
    return Prompt(f"Question: {questions[0]}\nAnswer:", " " + _text(row, "answer"), mquake_hops(row))


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """How a dataset is read: its rows' `formatter` (a row -> a `Prompt`), where on the hub it
    is, the prompts' token limit, the JSONL file shipped with the package, and its difficulty
    levels and how one is named."""

    formatter: Callable[[dict], Prompt]
    # (path, config name, None, or a tuple of config names whose splits are concatenated, split)
    hub: Optional[tuple] = None
    max_tokens: Optional[int] = None
    embedded: Optional[str] = None  # a JSONL file shipped in the package
    levels: tuple = ()  # the difficulties its prompts carry (empty: none)
    level_format: str = "{}"  # how a difficulty is named in tables and figures


# the package data folder, jaxdepth/data (this module is jaxdepth/lab/prompts.py)
EMBEDDED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")

DATASETS = {
    # Short arithmetic problems written for jaxdepth, in GSM8K's row layout, without the studies'
    # long instruction: the main job works offline and its per-position sweeps stay cheap on a CPU.
    "default": DatasetSpec(format_short, embedded=os.path.join(EMBEDDED_DIR, "default_prompts.jsonl")),
    "gsm8k": DatasetSpec(format_gsm8k, ("openai/gsm8k", "main", "test")),
    "hellaswag": DatasetSpec(format_hellaswag, ("Rowan/hellaswag", None, "validation")),
    "aime24": DatasetSpec(format_aime, ("Maxwell-Jia/AIME_2024", None, "train"), AIME_MAX_TOKENS),
    # The test split of every subject, concatenated in the order of MATH_SUBJECTS.
    "math": DatasetSpec(
        format_math, ("EleutherAI/hendrycks_math", MATH_SUBJECTS, "test"), levels=MATH_LEVELS, level_format="Level {}"
    ),
    # MQuAKE-CF-3k as the first study's code reads it: from MQuAKE-Remastered, a corrected
    # release of the MQuAKE benchmark.
    "mquake": DatasetSpec(
        format_mquake, ("henryzhongsc/MQuAKE-Remastered", None, "CF3k"), levels=(2, 3, 4), level_format="{} hops"
    ),
}


def _read_json_list(path: str) -> list[dict]:
    """A `.json` file holding one list of rows (how MQuAKE publishes its files)."""
    try:
        with open(path) as f:
            rows = json.load(f)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise DatasetError(f"{path}: a .json dataset file must hold a list of rows (objects)")
    return rows


def _load_hub(hub_path: str, config: Optional[str], split: str) -> list[dict]:
    import datasets

    try:
        return list(datasets.load_dataset(hub_path, config, split=split))
    except Exception as e:
        which = hub_path if config is None else f"{hub_path} (config {config})"
        raise DatasetError(
            f"could not load {which} from the hub or the local cache "
            f"({type(e).__name__}: {e}); pass a local JSONL file instead"
        ) from e


def read_rows(name: str, path: Optional[str] = None) -> list[dict]:
    """Rows of dataset `name` from a local JSONL file (or a `.json` file holding a list of rows),
    the package (embedded sets), or the hub through `datasets` (which also finds a local cache
    when offline)."""
    if path is not None:
        if not os.path.isfile(path):
            raise DatasetError(f"dataset file not found: {path}")
        if path.endswith(".json"):
            return _read_json_list(path)
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
    hub_path, config, split = spec.hub
    configs = config if isinstance(config, tuple) else (config,)
    return [row for c in configs for row in _load_hub(hub_path, c, split)]


def load_prompts(
    name: str,
    path: Optional[str] = None,
    limit: Optional[int] = None,
    *,
    difficulty: Optional[int] = None,
    where: Optional[Callable[[dict], bool]] = None,
) -> list[Prompt]:
    """Formatted prompts of dataset `name` (a key of `DATASETS`), in file order.

    `difficulty`: keep only the prompts of that difficulty (MATH level 1-5, MQuAKE hops 2-4);
    `where`: keep only the rows (as read, before formatting) it returns True for, e.g.
    `where=lambda row: math_subject(row) == "geometry"`. `limit` counts the prompts kept."""
    if name not in DATASETS:
        raise DatasetError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    spec = DATASETS[name]
    if difficulty is not None and difficulty not in spec.levels:
        raise DatasetError(
            f"{name} has no difficulty {difficulty!r}"
            + (
                f"; its levels: {', '.join(map(str, spec.levels))}"
                if spec.levels
                else ": its prompts carry no difficulty"
            )
        )
    prompts = []
    for number, row in enumerate(read_rows(name, path), 1):
        try:
            if where is not None and not where(row):
                continue
            prompt = spec.formatter(row)
        except (KeyError, ValueError, TypeError, IndexError, AttributeError) as e:
            raise DatasetError(f"{name} row {number} is malformed: {type(e).__name__}: {e}") from None
        if difficulty is not None and prompt.difficulty != difficulty:
            continue
        prompts.append(prompt)
        if limit is not None and len(prompts) >= limit and spec.max_tokens is None:
            break
    return prompts


def encode(
    tokenizer,
    prompts: Sequence[Prompt],
    *,
    max_tokens: Optional[int] = None,
    context: Optional[int] = None,
    limit: Optional[int] = None,
    buckets: LengthBuckets = LengthBuckets(),
) -> PromptBatch:
    """Tokenize with the tokenizer's defaults; the answer starts at the first token that carries
    answer text (ends after the question text: a token straddling the two is answer). Prompts
    over `max_tokens` are skipped (the AIME rule); a prompt over the model's `context` is an
    error."""
    token_lists, starts = [], []
    for prompt in prompts:
        enc = tokenizer(prompt.text, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        if max_tokens is not None and len(ids) > max_tokens:
            continue
        if context is not None and len(ids) > context:
            raise ValueError(
                f"a prompt of {len(ids)} tokens exceeds the model's context of {context}: {prompt.text[:80]!r}..."
            )
        boundary = len(prompt.question)
        # The answer starts at the first token carrying answer text: one that ends after the
        # question. A token straddling the boundary (' 28' after a question ending in '= ') is
        # answer, or a byte-level tokenizer would leave the '2' out of what is attributed.
        # Special tokens (a BOS) have empty offsets (0, 0): they belong to the question.
        start = next((i for i, (a, b) in enumerate(offsets) if b > a and b > boundary), len(ids))
        token_lists.append(ids)
        starts.append(max(start, 1))
        if limit is not None and len(token_lists) >= limit:
            break
    if not token_lists:
        raise ValueError(f"no prompt left to encode ({len(prompts)} given, max_tokens={max_tokens})")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return make_batch(token_lists, starts, buckets=buckets, pad_id=pad, max_length=context)
