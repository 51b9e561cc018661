"""`jaxdepth circuit` end to end on a tiny checkpoint: the files it writes, what they hold, a
rerun that reuses them, and its clear errors; the pair tasks."""

import json
import os

import numpy as np
import pytest

from conftest import save_tiny_checkpoint, tiny_tokenizer
from jaxdepth.analyses.edges import Circuit, EdgeScores
from jaxdepth.lab.circuit_study import EdgeChecks
from jaxdepth.lab.circuit_tasks import addition_pairs, read_pairs
from jaxdepth.lab.cli import main


def _equal_length_pairs(tokenizer, n=3):
    """Pairs of texts whose clean and corrupt prompts tokenize to the same length."""
    rows = []
    for a in range(10, 60):
        clean, corrupt = f"{a} + 7 = ", f"{a + 1} + 7 = "
        if len(tokenizer.encode(clean)) == len(tokenizer.encode(corrupt)):
            rows.append({"clean": clean, "corrupt": corrupt, "right": str(a + 7), "wrong": str(a + 8)})
        if len(rows) == n:
            return rows
    pytest.skip("the tiny tokenizer splits these numbers unevenly")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "model"), context=128)


def test_circuit_command_writes_scores_checks_circuit_and_figures(checkpoint, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in _equal_length_pairs(tiny_tokenizer())))
    args = ["circuit", "--model", checkpoint, "--pairs", str(pairs), "--steps", "2", "--check", "6"]
    args += ["--size", "10", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    folder = tmp_path / "out" / "model" / "circuit_pairs"
    scores = EdgeScores.load(str(folder / "edge_scores.npz"))
    checks = EdgeChecks.load(str(folder / "edge_checks.npz"))
    circuit = Circuit.load(str(folder / "circuit.npz"))
    assert scores.method == "eap-ig-inputs" and scores.steps == 2 and scores.scores.shape[0] == 3
    assert checks.effects.shape == (6, 3) and len(circuit.edges) == 10
    np.testing.assert_array_equal(checks.edges, circuit.edges[:6])  # both the best edges by |mean score|
    for name in ("circuit", "faithfulness", "scores_vs_patching"):
        assert (folder / "figures" / f"{name}.png").stat().st_size > 1000
    assert "faithfulness" in (folder / "summary.txt").read_text()
    capsys.readouterr()
    assert main(args) == 0  # the rerun reuses the scores and the checks
    out = capsys.readouterr().out
    assert "edge scores (eap-ig-inputs) reused" in out and "edges reused" in out


def test_circuit_command_refuses_bad_input(checkpoint, tmp_path, capsys):
    assert main(["circuit", "--model", checkpoint, "--pairs", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"clean": "1 + 1 = "}\n')
    assert main(["circuit", "--model", checkpoint, "--pairs", str(bad), "--out", str(tmp_path)]) == 2
    assert "clean, corrupt, right and wrong" in capsys.readouterr().err
    assert main(["circuit", "--model", checkpoint, "--method", "eap", "--steps", "4"]) == 2
    assert "EAP-IG's" in capsys.readouterr().err
    uneven = tmp_path / "uneven.jsonl"
    uneven.write_text(
        json.dumps({"clean": "1 + 1 = ", "corrupt": "1 + 1 + 1 + 1 = ", "right": "2", "wrong": "4"}) + "\n"
    )
    assert main(["circuit", "--model", checkpoint, "--pairs", str(uneven), "--out", str(tmp_path)]) == 2
    assert "same length" in capsys.readouterr().err


def test_addition_pairs_differ_in_one_digit_and_in_their_answer():
    class Digits:  # a tokenizer that splits every character, as SmolLM2 splits digits
        def encode(self, text):
            return [ord(ch) for ch in text]

    task = addition_pairs(Digits(), n=5, seed=1)
    for clean, corrupt, (right, wrong) in zip(task.clean, task.corrupt, task.labels):
        assert len(clean) == len(corrupt)
        assert sum(a != b for a, b in zip(clean, corrupt)) == 1
        assert right != wrong
    pairs = task.prompt_pairs()
    assert pairs.shared_prefix() == len(task.clean[0]) - 6  # the first operand's tens digit: 'cd+ef='


def test_read_pairs_reads_json_lines(tmp_path):
    class Words:
        def encode(self, text):
            return [len(w) for w in text.split()]

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"clean": "a bb", "corrupt": "c dd", "right": "xyz", "wrong": "q"}) + "\n\n")
    task = read_pairs(str(path), Words())
    assert task.clean == [[1, 2]] and task.labels.tolist() == [[3, 1]]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no pairs"):
        read_pairs(str(empty), Words())
    assert os.path.exists(path)
