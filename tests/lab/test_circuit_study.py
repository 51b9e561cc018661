"""`jaxdepth circuit` end to end on a tiny checkpoint: the files it writes, what they hold, a
rerun that reuses them, and its clear errors; the pair tasks."""

import json
import os
import re
import warnings

import numpy as np
import pytest

from conftest import save_tiny_checkpoint, tiny_tokenizer, model_dir
from jaxdepth.analyses.edges import Circuit, EdgeScores, find_circuit
from jaxdepth.lab import circuit_study
from jaxdepth.lab.circuit_study import EdgeChecks
from jaxdepth.lab.circuit_tasks import addition_pairs, read_pairs
from jaxdepth.lab.cli import main


def _equal_length_pairs(tokenizer, n=3):
    """Pairs of texts whose clean and corrupt prompts tokenize to the same length, and whose
    answers begin with different tokens (the tens digit differs)."""
    rows = []
    for a in range(10, 50):
        clean, corrupt, right, wrong = f"{a} + 7 = ", f"{a + 10} + 7 = ", str(a + 7), str(a + 17)
        if len(tokenizer.encode(clean)) != len(tokenizer.encode(corrupt)):
            continue
        if tokenizer.encode(right)[0] != tokenizer.encode(wrong)[0]:
            rows.append({"clean": clean, "corrupt": corrupt, "right": right, "wrong": wrong})
        if len(rows) == n:
            return rows
    pytest.skip("the tiny tokenizer splits these numbers unevenly")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "model"), context=128)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _equal_length_pairs(tiny_tokenizer())))
    return str(path)


def _circuit_args(checkpoint, pairs, out, *extra):
    return [
        "circuit",
        "--model",
        checkpoint,
        "--pairs",
        pairs,
        "--check",
        "6",
        "--size",
        "10",
        "--out",
        str(out),
        *extra,
    ]


def test_circuit_command_writes_scores_checks_circuit_and_figures(checkpoint, pairs_file, tmp_path, capsys):
    args = _circuit_args(checkpoint, pairs_file, tmp_path / "out", "--steps", "2")
    assert main(args) == 0
    # the task is the pairs file's stem; the folder below it names the method and its settings,
    # each file the settings it depends on
    folder = model_dir(tmp_path / "out", checkpoint) / "circuit_pairs" / "eap-ig-inputs-left-2"
    scores = EdgeScores.load(str(folder / "edge_scores.npz"))
    checks = EdgeChecks.load(str(folder / "edge_checks_top6.npz"))
    circuit = Circuit.load(str(folder / "circuit_size10.npz"))
    assert scores.method == "eap-ig-inputs" and scores.steps == 2 and scores.scores.shape[0] == 3
    assert checks.effects.shape == (6, 3) and len(circuit.edges) == 10
    np.testing.assert_array_equal(checks.edges, circuit.edges[:6])  # both the best edges by |mean score|
    for name in ("circuit_size10", "faithfulness_size10", "scores_vs_patching_top6"):
        assert (folder / "figures" / f"{name}.png").stat().st_size > 1000
    assert "faithfulness" in (folder / "summary_top6_size10.txt").read_text()
    capsys.readouterr()
    # EAP on the same task goes beside EAP-IG, replacing none of its files
    assert main(_circuit_args(checkpoint, pairs_file, tmp_path / "out", "--method", "eap")) == 0
    assert EdgeScores.load(str(folder.parent / "eap" / "edge_scores.npz")).method == "eap"
    assert EdgeScores.load(str(folder / "edge_scores.npz")).method == "eap-ig-inputs"
    capsys.readouterr()
    assert main(args) == 0  # the rerun reuses the scores and the checks
    out = capsys.readouterr().out
    assert "edge scores (eap-ig-inputs) reused" in out and "edges reused" in out


def test_an_ablation_and_positions_go_to_a_folder_of_their_own(checkpoint, pairs_file, tmp_path, capsys):
    """Each writer at its mean over the task's clean prompts at each position: the scores, the
    checks and the circuit under that ablation, beside the corrupt run's, with the figure over
    positions."""
    extra = ("--method", "eap", "--ablation", "mean-per-position", "--positions")
    assert main(_circuit_args(checkpoint, pairs_file, tmp_path, *extra)) == 0
    folder = model_dir(tmp_path, checkpoint) / "circuit_pairs" / "eap-mean-per-position"
    scores = EdgeScores.load(str(folder / "edge_scores.npz"))
    assert scores.ablation == "mean-per-position" and scores.method == "eap"
    assert scores.position_scores.shape == scores.scores.shape + (scores.position_scores.shape[-1],)
    np.testing.assert_allclose(scores.position_scores.sum(-1), scores.scores, rtol=1e-4, atol=1e-6)
    assert (folder / "figures" / "positions_size10.png").stat().st_size > 1000
    saved = Circuit.load(str(folder / "circuit_size10.npz"))
    assert saved.ablation == "mean-per-position"
    found, drawn = find_circuit_under(checkpoint, pairs_file, scores, saved)
    # the faithfulness saved is the circuit's, and that of its live edges, which the figure draws
    assert saved.faithfulness == pytest.approx(found, abs=1e-5)
    assert saved.faithfulness == pytest.approx(drawn, abs=1e-5)
    capsys.readouterr()


@pytest.mark.parametrize("level, name", [("node", "nodes"), ("neuron", "neurons")])
def test_circuits_of_nodes_and_neurons_are_named_and_counted_in_members(
    checkpoint, pairs_file, tmp_path, capsys, level, name
):
    args = _circuit_args(checkpoint, pairs_file, tmp_path, "--method", "eap", "--level", level)
    args[args.index("--size") + 1] = "4" if level == "node" else "30"
    assert main(args) == 0
    folder = model_dir(tmp_path, checkpoint) / "circuit_pairs" / "eap"
    size = args[args.index("--size") + 1]
    circuit = Circuit.load(str(folder / f"circuit_size{size}_{name}.npz"))
    assert circuit.level == level
    printed = capsys.readouterr().out
    if level == "node":
        assert len(circuit.nodes) == 4 and "circuit of 4 nodes, " in printed
        assert set(circuit.edges[:, 0].tolist()) <= set(circuit.nodes.tolist())
    else:
        assert len(circuit.nodes) + len(circuit.units) == 30 and len(circuit.units) > 0
        assert f"circuit of {len(circuit.nodes)} heads or input and {len(circuit.units)} MLP units, " in printed
        assert EdgeScores.load(str(folder / "edge_scores.npz")).neuron_scores is not None
    assert (folder / "figures" / f"faithfulness_size{size}_{name}.png").exists()


def find_circuit_under(checkpoint, pairs_file, scores, saved: Circuit) -> tuple[float, float]:
    """The size-10 circuit's faithfulness recomputed from the saved scores under the same
    ablation, in this process, and that of the `saved` circuit's live edges alone."""
    import jaxdepth
    from jaxdepth.analyses.edges import CircuitSearch, Patching, circuit_metric, faithfulness, logit_difference
    from jaxdepth.analyses.edges import mean_ablation

    model = jaxdepth.load(checkpoint)
    task = read_pairs(pairs_file, model.tokenizer)
    ablation = mean_ablation(model.params, task.clean, model.config, per_position=True)
    pairs = task.prompt_pairs()
    patching = Patching(ablation)
    found = find_circuit(
        model.params, pairs, model.config, logit_difference, scores, CircuitSearch(size=10, patching=patching)
    )
    live = circuit_metric(model.params, pairs, model.config, logit_difference, [saved.pruned().mask], patching=patching)
    return found.faithfulness, float(faithfulness(live, scores.f_clean, scores.f_corrupt)[0])


def test_a_target_no_circuit_reaches_is_said_plainly(checkpoint, pairs_file, tmp_path, capsys, monkeypatch):
    def unreached(*args, **kwargs):  # as find_circuit says it when no circuit of the grid reaches the target
        circuit = find_circuit(*args, **kwargs)
        circuit.reached = False
        warnings.warn("no circuit reaches faithfulness 0.9: ...", RuntimeWarning)
        return circuit

    monkeypatch.setattr(circuit_study, "find_circuit", unreached)
    args = _circuit_args(checkpoint, pairs_file, tmp_path, "--method", "eap")
    args[args.index("--size") : args.index("--size") + 2] = ["--target", "0.9"]
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert main(args) == 1
    # said once, by the command's error line, not a second time by find_circuit's warning
    assert not [w for w in warned if "no circuit reaches" in str(w.message)]
    printed = capsys.readouterr()
    assert (
        "error: no circuit reaches faithfulness 0.9 (the circuit saved is the whole graph, faithfulness "
        in (printed.err.splitlines()[-1])
    )
    folder = model_dir(tmp_path, checkpoint) / "circuit_pairs" / "eap"
    summary = (folder / "summary_top6_target0.9.txt").read_text()
    assert "(target 0.9 NOT reached by any circuit of the top edges: this is the whole graph)" in summary
    assert (folder / "circuit_target0.9.npz").exists()  # what was computed is saved all the same


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--size", "263"], r"--size must be in 1..262 \(the edges of this model's graph\), got 263"),
        (["--size", "0"], r"--size must be in 1..262"),
        (["--check", "-1"], "--check must be at least 1, got -1"),
        (["--steps", "-2"], "--steps must be at least 1, got -2"),
        (["--draw", "-5"], "--draw must be at least 0, got -5"),
        (["--num-pairs", "0"], "--num-pairs must be at least 1, got 0"),
        (["--target", "1.5"], r"--target is a faithfulness, in \(0, 1\]; got 1.5"),
        (["--target", "0"], r"--target is a faithfulness, in \(0, 1\]; got 0"),
        (["--tolerance", "0.1"], "with --rule adaptive only"),
        (["--rule", "adaptive", "--method", "eap-ig-activations"], "use it with --method eap-ig-inputs"),
        (["--ablation", "zero"], "--ablation zero needs --method eap or eap-ig-activations"),
        (["--level", "node", "--search", "greedy"], "--level node takes its members by their scores"),
        (["--level", "neuron", "--size", "50000"], r"--size must be in 1..\d+ \(the heads, input and MLP units"),
    ],
)
def test_bad_arguments_are_refused_before_any_scoring(checkpoint, tmp_path, capsys, monkeypatch, extra, message):
    def never(*args, **kwargs):
        raise AssertionError("scoring began before the arguments were checked")

    monkeypatch.setattr(circuit_study, "edge_attribution", never)
    monkeypatch.setattr(circuit_study, "edge_effects", never)
    assert main(["circuit", "--model", checkpoint, "--num-pairs", "2", "--out", str(tmp_path), *extra]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_pairs_with_identical_prompts_are_refused_before_any_scoring(checkpoint, tmp_path, capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("scoring began before the pairs were checked")

    monkeypatch.setattr(circuit_study, "edge_attribution", never)
    rows = _equal_length_pairs(tiny_tokenizer())
    rows[1]["corrupt"] = rows[1]["clean"]
    same = tmp_path / "same.jsonl"
    same.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["circuit", "--model", checkpoint, "--pairs", str(same), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"pair 1 ({same}:2)" in err and "the clean and the corrupt prompt are the same tokens" in err


def test_circuit_help_shows_every_default_and_what_names_the_task(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["circuit", "--help"])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    entries = re.split(r"\n(?=  -)", text.split("options:", 1)[1])  # one per option: its line and continuation
    for entry in entries:
        if not entry.strip() or entry.strip().startswith("-h"):
            continue
        assert "default" in entry.lower(), entry
    squeezed = re.sub(r"\s+", "", text)  # argparse wraps lines at spaces and hyphens
    for shown in ("--stepsSTEPSEAP-IGsteps(with--ruleadaptive:itsbudget)(default:16)", "(default:100)"):
        assert shown in squeezed
    for said in (
        "The task is named after the pairs file (its name without the extension: PAIRS.jsonl is the task PAIRS)",
        "or addition<N> for the addition task of --num-pairs N",
    ):
        assert re.sub(r"\s+", "", said) in squeezed


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
    path.write_text(json.dumps({"clean": "a bb", "corrupt": "ccc dd", "right": "xyz", "wrong": "q"}) + "\n\n")
    task = read_pairs(str(path), Words())
    assert task.clean == [[1, 2]] and task.labels.tolist() == [[3, 1]]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no pairs"):
        read_pairs(str(empty), Words())
    assert os.path.exists(path)


def test_a_task_of_ones_own_is_scored_by_its_own_metric(checkpoint, pairs_file, tmp_path, capsys):
    """The circuit command reads the task's metric (`TaskPairs.metric`), not a fixed one: scored
    by the negated logit difference, every edge's score is negated, and the identity names it."""
    import dataclasses

    import jaxdepth
    from jaxdepth.analyses.edges import logit_difference
    from jaxdepth.lab.circuit_study import find_and_save
    from jaxdepth.lab.circuit_tasks import read_pairs
    from jaxdepth.lab.cli import build_parser

    model = jaxdepth.load(checkpoint)
    task = read_pairs(pairs_file, model.tokenizer)
    args = build_parser().parse_args(_circuit_args(checkpoint, pairs_file, tmp_path, "--method", "eap", "--no-figures"))

    @jaxdepth.metric(reads="last")
    def negated(r):
        return -logit_difference(r)

    scores = {}
    for name, each in (("default", task), ("negated", dataclasses.replace(task, metric=negated))):
        folder = tmp_path / name
        find_and_save(model, each, str(folder), args, model_name="tiny", fingerprint="0" * 16, figures=False)
        scores[name] = EdgeScores.load(str(folder / "edge_scores.npz"))
    capsys.readouterr()
    np.testing.assert_allclose(scores["negated"].scores, -scores["default"].scores, rtol=1e-6, atol=1e-7)
    assert task.scored_by() is logit_difference and dataclasses.replace(task, metric=negated).scored_by() is negated
