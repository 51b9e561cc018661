"""The difficulty-graded datasets: MATH (levels 1-5) and MQuAKE (2-4 hops) formatted as the
first study's code formats them, their difficulty read back and filtered on, malformed rows named,
and a clear error when the hub cannot be reached."""

import json

import pytest

from jaxdepth.lab import prompts
from jaxdepth.lab.prompts import DatasetError, Prompt, load_prompts, math_subject

SUBJECTS = ["Algebra", "Counting & Probability", "Geometry", "Intermediate Algebra", "Precalculus"]


def _math_rows():
    """One MATH-layout row per level, each of another subject."""
    return [
        {
            "problem": f"What is ${level} + {level}$?",
            "level": f"Level {level}",
            "type": SUBJECTS[level - 1],
            "solution": f"We add: ${level} + {level} = \\boxed{{{2 * level}}}$.",
        }
        for level in range(1, 6)
    ]


def _mquake_row(hops, layout="hub"):
    """A MQuAKE row of `hops` hops, its chain in the hub layout (`orig_triples`), the published
    JSON layout (`orig.triples`) or only as single-hop questions."""
    chain = [[f"Q{i}", "P17", f"Q{i + 1}"] for i in range(hops)]
    row = {
        "questions": [f"Which {hops}-hop place is asked for?", "A paraphrase?", "Another?"],
        "answer": f"Place{hops}",
        "answer_alias": [],
        "new_answer": "Elsewhere",
        "single_hops": [{"question": f"hop {i}?", "answer": f"A{i}"} for i in range(hops)],
    }
    if layout == "hub":
        row["orig_triples"] = chain
    elif layout == "json":
        row["orig"] = {"triples": chain, "triples_labeled": chain}
    return row


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_math_rows_are_formatted_with_their_level(tmp_path):
    path = _write_jsonl(tmp_path / "math.jsonl", _math_rows())
    loaded = load_prompts("math", path)
    assert [p.difficulty for p in loaded] == [1, 2, 3, 4, 5]
    assert loaded[2] == Prompt("Problem: What is $3 + 3$?\nAnswer:", " We add: $3 + 3 = \\boxed{6}$.", 3)
    assert loaded[2].text == "Problem: What is $3 + 3$?\nAnswer: We add: $3 + 3 = \\boxed{6}$."


@pytest.mark.parametrize("layout", ["hub", "json", "single_hops"])
def test_mquake_rows_are_formatted_with_their_hops(tmp_path, layout):
    path = _write_jsonl(tmp_path / "mquake.jsonl", [_mquake_row(h, layout) for h in (2, 3, 4)])
    loaded = load_prompts("mquake", path)
    assert [p.difficulty for p in loaded] == [2, 3, 4]
    assert loaded[1] == Prompt("Question: Which 3-hop place is asked for?\nAnswer:", " Place3", 3)


def test_a_json_list_file_is_read_as_mquake_publishes_it(tmp_path):
    path = tmp_path / "MQuAKE-CF-3k-v2.json"
    path.write_text(json.dumps([_mquake_row(h, "json") for h in (4, 2)]))
    assert [p.difficulty for p in load_prompts("mquake", str(path))] == [4, 2]
    (tmp_path / "bad.json").write_text(json.dumps({"questions": []}))
    with pytest.raises(DatasetError, match="must hold a list of rows"):
        load_prompts("mquake", str(tmp_path / "bad.json"))


def test_prompts_of_one_difficulty_are_selected(tmp_path):
    math = _write_jsonl(tmp_path / "math.jsonl", _math_rows() * 3)
    assert [p.difficulty for p in load_prompts("math", math, difficulty=4)] == [4, 4, 4]
    assert len(load_prompts("math", math, limit=2, difficulty=4)) == 2  # the limit counts kept prompts
    mquake = _write_jsonl(tmp_path / "mquake.jsonl", [_mquake_row(h) for h in (2, 3, 4, 3)])
    assert [p.question for p in load_prompts("mquake", mquake, difficulty=3)] == [
        "Question: Which 3-hop place is asked for?\nAnswer:"
    ] * 2
    with pytest.raises(DatasetError, match="mquake has no difficulty 5; its levels: 2, 3, 4"):
        load_prompts("mquake", mquake, difficulty=5)
    with pytest.raises(DatasetError, match="gsm8k has no difficulty 1: its prompts carry no difficulty"):
        load_prompts("gsm8k", math, difficulty=1)


def test_rows_are_selected_by_a_predicate(tmp_path):
    path = _write_jsonl(tmp_path / "math.jsonl", _math_rows())
    kept = load_prompts("math", path, where=lambda row: math_subject(row) == "counting_and_probability")
    assert [p.difficulty for p in kept] == [2]
    assert [math_subject(r) for r in _math_rows()] == [
        "algebra",
        "counting_and_probability",
        "geometry",
        "intermediate_algebra",
        "precalculus",
    ]
    assert {math_subject(r) for r in _math_rows()} <= set(prompts.MATH_SUBJECTS)


def test_existing_datasets_keep_no_difficulty():
    assert all(p.difficulty is None for p in load_prompts("default", limit=3))
    assert Prompt("q", "a") == Prompt("q", "a", None)


def test_a_level_marked_unknown_has_no_difficulty(tmp_path):
    rows = _math_rows()[:2]
    rows[0]["level"] = "Level ?"
    path = _write_jsonl(tmp_path / "math.jsonl", rows)
    assert [p.difficulty for p in load_prompts("math", path)] == [None, 2]
    assert [p.difficulty for p in load_prompts("math", path, difficulty=1)] == []


@pytest.mark.parametrize(
    "name, row, message",
    [
        ("math", {"problem": "p", "level": "Level 6", "type": "Algebra", "solution": "s"}, "level must be one of"),
        ("math", {"problem": "p", "level": "hard", "type": "Algebra", "solution": "s"}, "level must look like"),
        ("math", {"problem": "p", "level": "Level 2", "type": "Algebra"}, "KeyError: 'solution'"),
        ("math", {"problem": ["p"], "level": "Level 2", "type": "Algebra", "solution": "s"}, "problem must be text"),
        ("mquake", {"questions": [], "answer": "a", "orig_triples": [[1, 2, 3]]}, "questions must be a non-empty"),
        ("mquake", {"questions": ["q?"], "answer": "a"}, "KeyError: 'single_hops'"),
        ("mquake", {"questions": ["q?"], "answer": "a", "orig_triples": []}, "hop chain must be a non-empty list"),
        ("mquake", {"questions": ["q?"], "answer": 7, "orig_triples": [[1, 2, 3]]}, "answer must be text"),
    ],
)
def test_malformed_rows_are_named(tmp_path, name, row, message):
    good = _math_rows()[0] if name == "math" else _mquake_row(2)
    path = _write_jsonl(tmp_path / "rows.jsonl", [good, row])
    with pytest.raises(DatasetError, match=f"{name} row 2 is malformed: .*{message}"):
        load_prompts(name, path)


@pytest.mark.parametrize(
    "name, hub",
    [("math", "EleutherAI/hendrycks_math \\(config algebra\\)"), ("mquake", "henryzhongsc/MQuAKE-Remastered")],
)
def test_offline_hub_failure_is_a_clear_error(monkeypatch, name, hub):
    import datasets

    calls = []

    def offline(path, config=None, split=None, **kwargs):
        calls.append((path, config, split))
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(
        DatasetError,
        match=f"could not load {hub} from the hub or the local cache "
        r"\(ConnectionError: offline\); pass a local JSONL file instead",
    ):
        load_prompts(name)
    assert (
        calls[0]
        == {
            "math": ("EleutherAI/hendrycks_math", "algebra", "test"),
            "mquake": ("henryzhongsc/MQuAKE-Remastered", None, "CF3k"),
        }[name]
    )


def test_every_math_subject_is_loaded_and_concatenated(monkeypatch):
    import datasets

    def fake(path, config=None, split=None, **kwargs):
        level = prompts.MATH_SUBJECTS.index(config) % 5 + 1
        return [{"problem": f"{config} problem", "level": f"Level {level}", "type": config, "solution": "s"}]

    monkeypatch.setattr(datasets, "load_dataset", fake)
    loaded = load_prompts("math")
    assert [p.question for p in loaded] == [f"Problem: {s} problem\nAnswer:" for s in prompts.MATH_SUBJECTS]
    assert [p.difficulty for p in loaded] == [1, 2, 3, 4, 5, 1, 2]


def test_a_token_straddling_question_and_answer_is_answer():
    """' 28' after a question ending in '= ' is one byte-level token: it carries answer text, so
    it is attributed with the answer rather than dropped from it."""
    from conftest import tiny_tokenizer

    from jaxdepth.lab.prompts import Prompt, encode

    tokenizer = tiny_tokenizer()
    prompt = Prompt("5 + 7 + 5 + 3 + 1 + 7 = ", "28")
    batch = encode(tokenizer, [prompt])
    ids = batch.tokens[0, : batch.lengths[0]]
    offsets = tokenizer(prompt.text, return_offsets_mapping=True)["offset_mapping"]
    first = int(batch.answer_start[0])
    assert offsets[first][0] < len(prompt.question) < offsets[first][1]  # this tokenizer does straddle
    assert tokenizer.decode(ids[first:]).strip() == "28"
    assert offsets[first - 1][1] <= len(prompt.question)  # the token before it is question only
