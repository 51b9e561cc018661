"""Prompt pairs from texts (`text_pairs`) and from a JSON Lines file (`read_pairs`), tokenized as
`jaxdepth circuit` does, and the pairs every builder refuses: prompts that are the same tokens,
answers that begin with the same token."""

import json
import re

import pytest

from conftest import tiny_tokenizer
from jaxdepth.analyses.edges import answer_token, prompt_pairs, read_pairs, text_pairs


class Characters:
    """One token per character (as SmolLM2 splits digits and a number's leading space), with a
    BOS token (0) that `encode` adds unless told not to, as Hugging Face tokenizers do."""

    def encode(self, text, add_special_tokens=True):
        return [0] * add_special_tokens + [ord(ch) for ch in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_text_pairs_tokenize_prompts_with_and_answers_without_special_tokens():
    tokenizer = Characters()
    task = text_pairs(tokenizer, ["2+3=", "4+4="], ["7+3=", "4+5="], ["5", "8"], ["1", "9"])
    assert task.clean == [[0, 50, 43, 51, 61], [0, 52, 43, 52, 61]] and task.corrupt[0] == [0, 55, 43, 51, 61]
    # the answers' first tokens, not the BOS token every answer would begin with
    assert task.labels.tolist() == [[ord("5"), ord("1")], [ord("8"), ord("9")]]
    assert task.texts == [("2+3=", "7+3="), ("4+4=", "4+5=")]
    pairs = task.prompt_pairs()
    assert pairs.clean.shape == (2, 5) and pairs.labels.tolist() == task.labels.tolist()
    assert answer_token(tokenizer, " 42") == ord(" ")


def test_read_pairs_reads_json_lines_as_text_pairs_do(tmp_path):
    rows = [{"clean": "2+3=", "corrupt": "7+3=", "right": "5", "wrong": "1"}, {"clean": "4+4=", "corrupt": "4+5="}]
    rows[1].update(right="8", wrong="9")
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n\n" for row in rows))
    task = read_pairs(str(path), Characters())
    expected = text_pairs(Characters(), *([row[k] for row in rows] for k in ("clean", "corrupt", "right", "wrong")))
    assert (task.clean, task.corrupt, task.texts) == (expected.clean, expected.corrupt, expected.texts)
    assert task.labels.tolist() == expected.labels.tolist() == [[ord("5"), ord("1")], [ord("8"), ord("9")]]


@pytest.mark.parametrize(
    "answers, token",
    [
        ((" 42", " 57"), "token 32 (' ')"),
        ((" New York", " New Delhi"), "token 32 (' ')"),
        (("17", "18"), "token 49 ('1')"),
    ],
)
def test_answers_that_begin_with_the_same_token_are_refused_by_name(tmp_path, answers, token):
    """A number written with a leading space begins with the space; the logit difference would
    read it for both answers, and F would be 0 on both runs of the pair."""
    clean, corrupt = ["2+3=", "1+1="], ["7+3=", "1+2="]
    with pytest.raises(
        ValueError, match=re.escape(f"pair 1 (answers '{answers[0]}' / '{answers[1]}'): {token}: the right")
    ) as e:
        text_pairs(Characters(), clean, corrupt, ["5", answers[0]], ["1", answers[1]])
    assert "differ in their first token" in str(e.value) and "end the prompts with the space" in str(e.value)
    path = tmp_path / "pairs.jsonl"
    rows = [
        dict(clean=c, corrupt=d, right=r, wrong=w)
        for c, d, r, w in zip(clean, corrupt, ["5", answers[0]], ["1", answers[1]])
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(
        ValueError, match=re.escape(f"pair 1 ({path}:2) (answers '{answers[0]}' / '{answers[1]}'): {token}: the right")
    ):
        read_pairs(str(path), Characters())


def test_a_real_tokenizer_names_the_shared_token_as_it_decodes():
    tokenizer = tiny_tokenizer()
    first = tokenizer.decode([tokenizer.encode(" New York")[0]])
    with pytest.raises(
        ValueError, match=rf"pair 0 \(answers ' New York' / ' New Delhi'\): token \d+ \({re.escape(repr(first))}\)"
    ):
        text_pairs(tokenizer, ["He lives in"], ["He lived in"], [" New York"], [" New Delhi"])


def test_prompts_that_are_the_same_tokens_are_refused_by_every_builder(tmp_path):
    with pytest.raises(ValueError, match="pair 1: the clean and the corrupt prompt are the same tokens"):
        prompt_pairs([[1, 2, 3], [4, 5, 6]], [[1, 2, 4], [4, 5, 6]])
    with pytest.raises(ValueError, match=r"pair 0 \('1\+1=' / '1\+1='\): the clean and the corrupt prompt are the"):
        text_pairs(Characters(), ["1+1="], ["1+1="], ["2"], ["3"])
    path = tmp_path / "same.jsonl"
    path.write_text(json.dumps(dict(clean="1+1=", corrupt="1+1=", right="2", wrong="3")) + "\n")
    with pytest.raises(
        ValueError,
        match=re.escape(f"pair 0 ({path}:1) ('1+1=' / '1+1='): the clean and the corrupt prompt are the same"),
    ):
        read_pairs(str(path), Characters())


def test_clear_errors_of_the_text_builders(tmp_path):
    with pytest.raises(ValueError, match="lists of texts of the same length"):
        text_pairs(Characters(), ["1+1="], ["1+2=", "1+3="], ["2"], ["3"])
    with pytest.raises(
        ValueError, match=r"pair 0 \('1\+1=' / '11\+1='\): the clean prompt has 5 tokens and the corrupt one 6"
    ):
        text_pairs(Characters(), ["1+1="], ["11+1="], ["2"], ["3"])
    with pytest.raises(ValueError, match="the answer '' has no tokens"):
        text_pairs(Characters(), ["1+1="], ["1+2="], ["2"], [""])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"clean": "1 + 1 = "}\n')
    with pytest.raises(
        ValueError,
        match=re.escape(f"{bad}:1: each line must be a JSON object with clean, corrupt, right and wrong"),
    ):
        read_pairs(str(bad), Characters())
