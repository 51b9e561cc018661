"""Final answers read out of text as the datasets' evaluations read them, and compared as
numbers where both are numbers: what "the generated answer is right" means in the structure
analysis (`jaxdepth.analyses.layer_structure`).

`final_answer(text)` takes, in this order of precedence:
1. the content of the last `\\boxed{...}`, as written (MATH and AIME solutions box their
   answer; braces inside it balanced);
2. what follows the last "final answer is" up to the end of its line (the studies' GSM8K
   instruction asks for "The final answer is [answer]", and jaxdepth's GSM8K-layout solutions
   end so);
3. what follows the last "####" up to the end of its line (GSM8K's own solutions);
4. else the last number in the text (the usual fallback of GSM8K evaluations);
5. else the text's first non-empty line (free-text answers: HellaSwag endings, MQuAKE).
Within 2 and 3, a number is taken out of what was found when there is one (`$32.` is 32).

`same_answer(generated, reference)` compares the two final answers: as numbers where both
parse as one (commas, `$` and `%` dropped: `1,000` = `1000.0`), else as text, lower-cased,
with whitespace collapsed and surrounding punctuation stripped. A generation is cut at its
first blank line before it is read (`cut_generation`): a model that answers and then starts
another problem would otherwise have that problem's numbers read as its answer.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence, Union

__all__ = ["final_answer", "same_answer", "cut_generation", "as_number"]

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?%?|-?\$?\.\d+%?")
_MARKERS = (re.compile(r"final answer is:?", re.I), re.compile(r"####"))


def _last_boxed(text: str) -> Optional[str]:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: no box closed


def as_number(text: str) -> Optional[float]:
    """`text` as a number (commas, `$` and `%` and a trailing '.' dropped), or None."""
    cleaned = text.strip().rstrip(".").replace(",", "").replace("$", "").replace("%", "")
    try:
        return float(cleaned)
    except ValueError:
        return None


def _with_number(found: str) -> str:
    number = _NUMBER.search(found)
    return number.group(0) if number else found.strip()


def final_answer(text: str) -> str:
    """The final answer in `text` (module docstring), as text ('' for empty text)."""
    boxed = _last_boxed(text)
    if boxed is not None:  # as written: a boxed fraction is not the number in its numerator
        return boxed.strip()
    for marker in _MARKERS:
        found = list(marker.finditer(text))
        if found:
            return _with_number(text[found[-1].end() :].split("\n", 1)[0])
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1]
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _normal_text(text: str) -> str:
    return " ".join(text.lower().split()).strip(" .,;:!?\"'")


def same_answer(generated: str, reference: str) -> bool:
    """Whether the final answers of `generated` and `reference` agree (module docstring)."""
    mine, theirs = final_answer(generated), final_answer(reference)
    a, b = as_number(mine), as_number(theirs)
    if a is not None and b is not None:
        return a == b
    return bool(_normal_text(theirs)) and _normal_text(mine) == _normal_text(theirs)


def cut_generation(text: Union[str, bytes], stops: Optional[Sequence[str]] = None) -> str:
    """`text` up to its first blank line (what is read of a generation), or, given `stops`, up
    to the first of them (a task whose answer is one line stops at "\n")."""
    text = text.decode() if isinstance(text, bytes) else text
    if stops is None:
        return re.split(r"\n\s*\n", text, maxsplit=1)[0]
    return text[: min([text.find(s) for s in stops if s and s in text], default=len(text))]
