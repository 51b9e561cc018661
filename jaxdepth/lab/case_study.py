"""One prompt, looked at closely: residual erasure and integrated gradients of a single
question / answer pair, as in the case studies of both papers (the first study's multi-step
addition `5 + 7 + 5 + 3 + 1 + 7 = ` / `28`, single GSM8K problems).

`jaxdepth case` runs it. The prompt becomes a one-prompt dataset named after its text, so its
results are cached, resumed and written atomically by `study.run_study` like any other run, and
each analysis draws its usual figure; `case_figure` stacks their per-token views (erasure above
IG by default).
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Optional, Sequence

from jaxdepth.lab.prompts import DATASETS, Prompt, load_prompts

__all__ = [
    "case_prompt",
    "check_answer_tokens",
    "case_figure",
    "write_case_figures",
    "case_analysis",
    "check_analyses",
    "CASE_ANALYSES",
    "ARITHMETIC_PROMPT",
]


# The analyses a case study runs by default: both studies show these two per prompt.
CASE_ANALYSES = ("erasure", "integrated_gradients")
ARITHMETIC_PROMPT = Prompt("5 + 7 + 5 + 3 + 1 + 7 = ", "28")  # the first study's case


def case_prompt(
    *,
    question: Optional[str] = None,
    answer: Optional[str] = None,
    dataset: Optional[str] = None,
    row: Optional[int] = None,
    data_path: Optional[str] = None,
) -> tuple[Prompt, str]:
    """The prompt of a case study and its name (the dataset folder of its results).

    Either `question` and `answer` (the answer is what is teacher-forced and attributed), or a
    `dataset` (`prompts.DATASETS`) and a 0-based `row` of it, read from `data_path` or the hub
    and formatted as the studies do."""
    if (question is None) == (dataset is None):
        raise ValueError("give either a prompt (--prompt and --answer) or a dataset row (--dataset and --row)")
    if question is not None and (row is not None or data_path is not None):
        raise ValueError("--row and --data select a dataset row: they go with --dataset, not with --prompt")
    if dataset is not None and answer is not None:
        raise ValueError("a dataset row brings its own answer (the gold solution): --answer goes with --prompt")
    if question is not None:
        if not answer:
            raise ValueError("a case study needs the answer to attribute: --answer (e.g. --answer 28)")
        digest = hashlib.sha256(f"{question}\0{answer}".encode()).hexdigest()[:8]
        words = re.sub(r"[^A-Za-z0-9]+", "_", question).strip("_")[:32].strip("_")
        return Prompt(question, answer), f"case_{words}_{digest}" if words else f"case_{digest}"
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")
    if row is None or row < 0:
        raise ValueError(f"a dataset case needs a row number >= 0 (--row), got {row}")
    prompts = load_prompts(dataset, data_path, limit=row + 1)
    if row >= len(prompts):
        raise ValueError(f"{dataset} has {len(prompts)} rows; row {row} does not exist")
    return prompts[row], f"case_{dataset}_row{row}"


def check_answer_tokens(batch, prompt: Prompt) -> int:
    """The number of answer tokens of a one-prompt batch; an error when there is none (an answer
    of whitespace a tokenizer drops, say), since then nothing would be attributed."""
    count = int(batch.lengths[0] - batch.answer_start[0])
    if count <= 0:
        raise ValueError(
            f"the answer {prompt.answer!r} encodes to no token after the question "
            f"{prompt.question[-20:]!r}: nothing would be attributed"
        )
    return count


def case_figure(results: dict, *, tokenizer=None, title: Optional[str] = None):
    """The per-token views of the case's analyses (each `Analysis.panel`: residual erasure,
    integrated gradients, ...) one above the other on one figure, tokens aligned, the answer
    start marked in each, in the order of `results` (analysis name -> result). None when fewer
    than two of them have a per-token view."""
    from jaxdepth.analyses import drawing
    from jaxdepth.lab.registry import analysis

    drawn = {name: result for name, result in results.items() if analysis(name).panel is not None}
    if len(drawn) < 2:
        return None
    panels = [analysis(name).panel(result, 0, tokenizer=tokenizer) for name, result in drawn.items()]
    return drawing.stacked_token_figure(
        panels,
        title=title or "Case study: " + " and ".join(name.replace("_", " ") for name in drawn),
        settings=next(iter(drawn.values())).settings,
    )


def write_case_figures(results: dict, folder: str, tokenizer=None) -> list[str]:
    """Each analysis's own figure, and `case_figure`, the per-token views stacked, when two or
    more analyses have one; returns the paths written (PNG and PDF)."""
    from jaxdepth.lab import plots
    from jaxdepth.lab.study import write_figures

    paths = write_figures(results, folder, tokenizer)
    fig = case_figure(results, tokenizer=tokenizer)
    if fig is not None:
        paths.extend(plots.save_figure(fig, os.path.join(folder, "figures", "case")))
    return paths


def case_analysis(entry) -> bool:
    """Whether a case study may run the analysis `entry`: a per-prompt one, or one with a
    per-token view."""
    return entry.detail or entry.panel is not None


def check_analyses(names: Sequence[str]) -> list[str]:
    """The analyses a case may run: the per-prompt ones (erasure, IG and the attribution
    screens) and those with a per-token view (`Analysis.panel`, e.g. the decision depth of a
    plugin); the other whole-prompt-set ones (contributions, lens, layer skip) have nothing to
    say about one prompt that the table does not."""
    from jaxdepth.lab.registry import ANALYSES

    names = list(names)
    unknown = [n for n in names if n not in ANALYSES]
    if unknown:
        raise ValueError(f"unknown analyses {unknown}; known: {', '.join(ANALYSES)}")
    not_per_prompt = [n for n in names if not case_analysis(ANALYSES[n])]
    if not_per_prompt:
        raise ValueError(
            f"{', '.join(not_per_prompt)} describe a prompt set, not one prompt; a case runs the "
            f"per-prompt analyses and those with a per-token view: "
            f"{', '.join(n for n, a in ANALYSES.items() if case_analysis(a))}"
        )
    return names
