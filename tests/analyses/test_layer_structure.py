"""The structure sweep (`jaxdepth.analyses.layer_structure`): the identity's scores are the plain
forward's, a dropped block scores as those layers skipped, a vmapped sweep scores as each
structure alone, and the angular-distance rule picks the block that changes nothing."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import tiny_config, model_dir
from jaxdepth.analyses.layer_structure import (
    Structure,
    StructureResult,
    structure_analysis,
    structure_figure,
    _answer_scores,
    generated_answers,
    angular_distances,
    gromov_choice,
    structure_family,
    structure_scores,
)
from jaxdepth.core import sites
from jaxdepth.core.batch import make_batch
from jaxdepth.core.model import forward, random_params, residual_stream

# Compare at full float32 matmul precision; a vmapped sweep and a member alone are different
# programs, which may round a sum differently by an ulp.
pytestmark = pytest.mark.usefixtures("highest_precision")

CONFIG = tiny_config(num_layers=5, qkv_bias=True)
L = CONFIG.num_layers
PARAMS = random_params(CONFIG, seed=7, scale=0.3)
rng = np.random.default_rng(2)
BATCH = make_batch([rng.integers(0, 97, n).tolist() for n in (12, 9, 15)], [8, 5, 11], pad_id=0)


def test_the_family():
    family = structure_family(L, 3)
    drops = [s for s in family if s.kind == "drop"]
    assert family[0] == Structure("intact", 0, 0) and str(family[0]) == "intact"
    assert len(drops) == 5 + 4 + 3 and len([s for s in family if s.kind == "swap"]) == 4
    assert [str(s) for s in family if s.kind == "reverse"] == ["reverse 1..2", "reverse 1..3"]
    with pytest.raises(ValueError, match="max_block"):
        structure_family(L, L)


def test_the_intact_model_scores_as_the_plain_forward():
    scores = structure_scores(PARAMS, BATCH, CONFIG, [Structure("intact", 0, 0)])
    logits = forward(PARAMS, BATCH.tokens, CONFIG, valid=BATCH.valid)
    logprob, token_accuracy, correct = _answer_scores(logits, BATCH.tokens, BATCH.valid, BATCH.answer_start)
    np.testing.assert_allclose(scores.answer_logprob[0], np.asarray(logprob), rtol=1e-6)
    assert np.array_equal(scores.answer_token_accuracy[0], np.asarray(token_accuracy))
    assert np.array_equal(scores.answer_correct[0], np.asarray(correct, np.float32))
    # against the definition: the mean log-probability of each prompt's answer tokens
    log_probs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for i, (n, start) in enumerate(zip(BATCH.lengths, BATCH.answer_start)):
        expected = np.mean([log_probs[i, t - 1, BATCH.tokens[i, t]] for t in range(start, n)])
        assert scores.answer_logprob[0, i] == pytest.approx(expected, rel=1e-5)
        top = [log_probs[i, t - 1].argmax() == BATCH.tokens[i, t] for t in range(start, n)]
        assert scores.answer_token_accuracy[0, i] == pytest.approx(np.mean(top))
        assert scores.answer_correct[0, i] == float(all(top))


def test_a_dropped_block_scores_as_those_layers_skipped():
    for block in (Structure("drop", 1, 2), Structure("drop", 4, 1)):
        skips = [
            sites.skip("delta", l, np.ones(BATCH.tokens.shape[1])) for l in range(block.start, block.start + block.size)
        ]
        logits = jax.jit(forward, static_argnames="config")(
            PARAMS, BATCH.tokens, CONFIG, valid=BATCH.valid, interventions=skips
        )
        logprob, _, correct = _answer_scores(logits, BATCH.tokens, BATCH.valid, BATCH.answer_start)
        scores = structure_scores(PARAMS, BATCH, CONFIG, [block])
        np.testing.assert_allclose(scores.answer_logprob[0], np.asarray(logprob), rtol=1e-6, atol=1e-6)
        assert np.array_equal(scores.answer_correct[0], np.asarray(correct, np.float32))


def test_a_vmapped_sweep_scores_as_each_structure_alone():
    family = structure_family(L, 2)
    together = structure_scores(PARAMS, BATCH, CONFIG, family, chunk_size=4)
    for i, s in enumerate(family):
        alone = structure_scores(PARAMS, BATCH, CONFIG, [s])
        np.testing.assert_allclose(together.answer_logprob[i], alone.answer_logprob[0], rtol=1e-6, err_msg=str(s))
        assert np.array_equal(together.answer_correct[i], alone.answer_correct[0]), str(s)
    assert len(set(map(tuple, together.answer_logprob.round(4)))) > len(family) // 2  # structures differ


def test_angular_distances_and_the_rule_of_gromov():
    params = jax.tree.map(np.array, PARAMS)
    params["layers"]["o"][2] = 0.0  # layer 2 writes nothing: h_3 = h_2
    params["layers"]["down"][2] = 0.0
    distances = angular_distances(params, BATCH, CONFIG, 3)
    assert distances.shape == (3, L) and np.isnan(distances[1, L - 1]) and np.isnan(distances[2, L - 2])
    assert distances[0, 2] == pytest.approx(0.0, abs=1e-3) and (np.delete(distances[0], 2) > 0.01).all()
    assert gromov_choice(distances)[0] == Structure("drop", 2, 1)
    # against the definition, from the residual stream directly
    hs = np.asarray(residual_stream(params, BATCH.tokens, CONFIG, valid=BATCH.valid), np.float64)
    last = BATCH.answer_start - 1
    a, b = hs[1, np.arange(3), last], hs[3, np.arange(3), last]
    cos = np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    assert distances[1, 1] == pytest.approx(np.mean(np.arccos(np.clip(cos, -1, 1)) / np.pi), abs=1e-6)


def test_prompts_without_answers_are_refused():
    batch = make_batch([[1, 2, 3]], [3], pad_id=0)
    with pytest.raises(ValueError, match="needs an answer"):
        structure_scores(PARAMS, batch, CONFIG, [Structure("drop", 0, 1)])


def test_the_result_saves_draws_and_sums_up(tmp_path):
    result = structure_analysis(PARAMS, BATCH, CONFIG, max_block=2)
    family = structure_family(L, 2)
    assert result.structures() == family and result.answer_logprob.shape == (len(family), 3)
    loaded = StructureResult.load(result.save(str(tmp_path / "structure.npz")))
    assert loaded.structures() == family and np.array_equal(loaded.answer_logprob, result.answer_logprob)
    assert (result.angular_distance[1, L - 1] == -1.0) and gromov_choice(result.angular_distance)[1].start < L - 1
    grid = result.drop_grid(result.accuracy())
    assert grid.shape == (2, L) and np.isnan(grid[1, L - 1])
    assert grid[1, 2] == result.accuracy()[family.index(Structure("drop", 2, 2))]
    best = result.largest_droppable(points=100.0)  # anything goes: the largest block, the best of its size
    assert best.size == 2 and result.largest_droppable(points=-100.0) is None
    fig = structure_figure(result)
    assert len(fig.axes) >= 3
    from jaxdepth.analyses.layer_structure import ANALYSIS

    within = result.largest_droppable()
    summary = ANALYSIS.summary(result)
    if within is None:
        assert summary == ["no layer droppable within 1 point of token accuracy"]
    else:
        assert summary[0] == f"droppable within 1 point: {within.size} layers ({within})"


@pytest.mark.slow(seconds=30)
def test_the_command_line_runs_it_as_a_plugin(tmp_path, capsys):
    from conftest import save_tiny_checkpoint
    from jaxdepth.lab import plugins
    from jaxdepth.lab.cli import main
    from jaxdepth.lab.registry import ANALYSES
    from jaxdepth.lab.results import load_result

    model = save_tiny_checkpoint(str(tmp_path / "model"), context=1024)
    registered, loaded = dict(ANALYSES), dict(plugins.LOADED)
    try:
        code = main(
            [
                "run",
                "--model",
                model,
                "--dataset",
                "default",
                "--prompts",
                "2",
                "--detail-prompts",
                "2",
                "--plugin",
                "jaxdepth.analyses.layer_structure:ANALYSIS",
                "--analyses",
                "layer_structure",
                "--structure-max-block",
                "2",
                "--out",
                str(tmp_path / "out"),
            ]
        )
    finally:
        ANALYSES.clear()
        ANALYSES.update(registered)
        plugins.LOADED.clear()
        plugins.LOADED.update(loaded)
    assert code == 0
    result = load_result(str(model_dir(tmp_path / "out", model) / "default" / "layer_structure.npz"))
    assert isinstance(result, StructureResult) and result.answer_logprob.shape[1] == 2
    assert result.settings["identity"]["structure_max_block"] == 2
    printed = capsys.readouterr().out
    assert "droppable within 1 point" in printed or "no layer droppable" in printed


def _words(ids):
    """A stand-in tokenizer's decode: every token id as a number, so answers read as numbers."""
    return " ".join(str(i) for i in ids)


def test_generated_answers_are_each_structures_own_generation_read():
    """A prompt whose reference answer is the intact model's own greedy continuation is answered
    right by the intact model; every structure's verdict is its own generate(order=...) decoded,
    cut and compared by hand."""
    from jaxdepth.analyses.answers import cut_generation, same_answer
    from jaxdepth.core.decoding import generate

    questions = [rng.integers(0, 97, n).tolist() for n in (7, 4)]
    new = 6
    asked = make_batch(questions, pad_id=0)  # right-padded, as generate takes prompts
    tokens, valid = asked.tokens, asked.valid
    intact = generate(PARAMS, tokens, CONFIG, valid=valid, max_new_tokens=new).tokens
    # the reference of prompt 0 is the intact continuation; of prompt 1, a token it never emits
    answers = [np.asarray(intact[0]).tolist(), [int(np.setdiff1d(np.arange(97), np.asarray(intact[1]))[0])]]
    batch = make_batch([q + a for q, a in zip(questions, answers)], [len(q) for q in questions], pad_id=0)
    family = [Structure("intact", 0, 0), Structure("drop", 1, 1), Structure("swap", 2, 2)]
    correct, texts = generated_answers(PARAMS, batch, CONFIG, family, _words, max_new_tokens=new, chunk_size=2)
    assert correct.shape == (3, 2) and correct[0, 0] and not correct[0, 1]
    for s, structure in enumerate(family):
        alone = np.asarray(
            generate(PARAMS, tokens, CONFIG, valid=valid, max_new_tokens=new, order=structure.order(L)).tokens
        )
        for b in range(2):
            read = cut_generation(_words(alone[b]))
            assert texts[s][b] == read
            assert correct[s, b] == same_answer(read, _words(answers[b])), (structure, b)
    result = structure_analysis(PARAMS, batch, CONFIG, max_block=1, decode=_words, max_new_tokens=new)
    assert result.generated and result.generated_accuracy()[0] == 0.5
    from jaxdepth.analyses.layer_structure import ANALYSIS

    assert ANALYSIS.summary(result)[-1] == "generated answers right: 50% intact"
    assert len(structure_figure(result).axes) >= 4  # a third heatmap: the generated answers


def test_generation_chunks_hold_one_kind_and_size():
    from jaxdepth.analyses.layer_structure import _kindred_chunks

    family = structure_family(L, 2)  # intact; 5 + 4 drops; 4 swaps; reverse, repeat, parallel of 2
    family.insert(15, Structure("reverse", 1, 3))  # beside the reverse of 2: one kind, one chunk
    chunks = _kindred_chunks(family, 3)
    assert chunks[:4] == [(0, 3), (3, 6), (6, 9), (9, 10)]  # the intact model with the single drops
    assert [b - a for a, b in chunks] == [3, 3, 3, 1, 3, 1, 2, 1, 1]
    for a, b in chunks:
        kinds = {
            ("drop", 1) if s.kind == "intact" else (s.kind, s.size if s.kind == "drop" else 0) for s in family[a:b]
        }
        assert len(kinds) == 1
