"""Unit tier: final answers read as the datasets' evaluations read them
(`jaxdepth.analyses.answers`), numbers compared as numbers."""

from __future__ import annotations

import pytest

from jaxdepth.analyses.answers import as_number, cut_generation, final_answer, same_answer
from jaxdepth.lab.prompts import format_gsm8k, format_short


@pytest.mark.parametrize(
    "text, answer",
    [
        ("so x = \\boxed{\\frac{1}{2}} and then \\boxed{204}.", "204"),  # the last box
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # as written, braces balanced
        ("4 * 8 = 32.\nThe final answer is $1,032.\nNext", "$1,032"),
        ("The Final Answer is: 7 apples", "7"),
        ("She has 3 + 4 = <<3+4=7>>7.\n#### 7", "7"),
        ("first 12, then 15, so 18 left", "18"),
        ("\n  Paris is the capital\nof France", "Paris is the capital"),
        ("", ""),
    ],
)
def test_final_answer(text, answer):
    assert final_answer(text) == answer


def test_numbers_compare_as_numbers_and_text_as_text():
    assert same_answer("The final answer is 1,000.", "#### 1000") and same_answer("so $32.00", "32")
    assert not same_answer("The final answer is 31", "The final answer is 32")
    assert same_answer("  paris.", "Paris") and not same_answer("Rome", "Paris") and not same_answer("", "")
    assert as_number("-2.5%") == -2.5 and as_number("two") is None


def test_a_generation_is_read_up_to_its_first_blank_line():
    text = "4 tickets cost 4 * 8 = 32 dollars.\n\nProblem: a train holds 50 people"
    assert cut_generation(text) == "4 tickets cost 4 * 8 = 32 dollars."
    assert same_answer(cut_generation(text), "The final answer is 32") and not same_answer(text, "32")


def test_the_datasets_references_read_their_gold_answers():
    row = {"question": "How many?", "answer": "Add 2 and 3: <<2+3=5>>5 apples.\n#### 5"}
    for formatted in (format_gsm8k(row), format_short(row)):
        assert final_answer(formatted.answer) == "5"
