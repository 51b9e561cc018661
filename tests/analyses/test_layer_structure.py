"""The structure sweep (`jaxdepth.analyses.layer_structure`): the identity's scores are the plain
forward's, a dropped block scores as those layers skipped, a vmapped sweep scores as each
structure alone, and the angular-distance rule picks the block that changes nothing."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import tiny_config, model_dir
from progress_recorder import bar_recorder
from jaxdepth.analyses.layer_structure import (
    Generation,
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
from jaxdepth.core.execution import Execution
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
    together = structure_scores(PARAMS, BATCH, CONFIG, family, execution=Execution(chunk_size=4))
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
        assert summary[0] == "no layer droppable within 1 point of token accuracy"
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
    correct, texts = generated_answers(
        PARAMS, batch, CONFIG, family, Generation(_words, max_new_tokens=new), execution=Execution(chunk_size=2)
    )
    assert correct.shape == (3, 2) and correct[0, 0] and not correct[0, 1]
    for s, structure in enumerate(family):
        alone = np.asarray(
            generate(PARAMS, tokens, CONFIG, valid=valid, max_new_tokens=new, order=structure.order(L)).tokens
        )
        for b in range(2):
            read = cut_generation(_words(alone[b]))
            assert texts[s][b] == read
            assert correct[s, b] == same_answer(read, _words(answers[b])), (structure, b)
    result = structure_analysis(PARAMS, batch, CONFIG, max_block=1, generation=Generation(_words, new))
    assert result.generated and result.generated_accuracy()[0] == 0.5
    from jaxdepth.analyses.layer_structure import ANALYSIS

    assert ANALYSIS.summary(result)[-2] == "generated answers right: 50% intact"
    assert len(structure_figure(result).axes) >= 4  # a third heatmap: the generated answers


def test_the_chunks_of_a_sweep_are_at_most_two_programs():
    """Every chunk of one shape family has one shape (the last filled up with its last order), so
    that one compiled program serves them all: the single-layer orders' and the parallel ones'."""
    from jaxdepth.analyses.layer_structure import _chunks, _programs

    family = structure_family(L, 3)  # intact; 5 + 4 + 3 drops; 4 swaps; reverse, repeat, parallel of 2 and 3
    orders = [s.order(L) for s in family]
    chunks = _chunks(orders, 4)
    members = [m for m, _ in chunks]
    single = [i for i, s in enumerate(family) if s.kind != "parallel"]
    parallel = [i for i, s in enumerate(family) if s.kind == "parallel"]
    assert sum(members, []) == single + parallel
    assert [len(m) for m in members] == [4, 4, 4, 4, 4, 1, 2]
    assert {tuple(o.layers.shape) for _, o in chunks[:6]} == {(4, L + 3, 1)}  # a repeated block of 3: L + 3 steps
    assert tuple(chunks[6][1].layers.shape) == (2, L - 1, 3)
    assert _programs(chunks) == 2
    for m, stacked in chunks:  # each member's rows are its own order, padded; the filler repeats the last
        for row, i in enumerate(m + [m[-1]] * (len(stacked.layers) - len(m))):
            alone = orders[i]
            n, g = np.shape(alone.layers)
            assert np.array_equal(np.asarray(stacked.layers[row, :n, :g])[alone.used], alone.layers[alone.used])
            assert not np.asarray(stacked.used[row, n:]).any() and not np.asarray(stacked.used[row, :, g:]).any()


def _made_up_result(num_layers, max_block, *, drop_accuracy, generated=True, seed=0):
    """A `StructureResult` of the family with chosen scores (no model run): the intact model's
    token accuracy 0.8, every drop's `drop_accuracy`, the others' random; angular distances
    smallest at layer 2 for every block size."""
    family = structure_family(num_layers, max_block)
    rng = np.random.default_rng(seed)
    B = 4
    token_accuracy = rng.uniform(0, 1, (len(family), B))
    token_accuracy[0] = 0.8
    for i, s in enumerate(family):
        if s.kind == "drop":
            token_accuracy[i] = drop_accuracy
    distance = np.full((max_block, num_layers), -1.0)
    for n in range(1, max_block + 1):
        distance[n - 1, : num_layers + 1 - n] = 0.5
        distance[n - 1, 2] = 0.1
    correct = (rng.uniform(0, 1, (len(family), B)) < 0.5).astype(np.float32)
    correct[0] = [1, 0, 0, 0]  # the intact model answers one prompt in four by generation
    return StructureResult(
        kinds=[s.kind for s in family],
        starts=np.array([s.start for s in family]),
        sizes=np.array([s.size for s in family]),
        answer_logprob=-rng.uniform(0, 5, (len(family), B)),
        answer_token_accuracy=token_accuracy,
        answer_correct=(token_accuracy == 1).astype(np.float32),
        angular_distance=distance,
        num_layers=num_layers,
        settings={"max_block": max_block, "max_new_tokens": 8 if generated else 0},
        generated_correct=correct if generated else np.zeros((len(family), 0), np.float32),
    )


def test_the_summary_names_the_rules_block_and_the_generated_accuracy_when_nothing_is_droppable():
    from jaxdepth.analyses.layer_structure import ANALYSIS

    result = _made_up_result(6, 2, drop_accuracy=0.5)  # every drop loses 30 points
    assert result.largest_droppable() is None
    assert ANALYSIS.summary(result) == [
        "no layer droppable within 1 point of token accuracy",
        "angular rule at 1 layer: drop 2..2 (50% against 80% intact)",
        "generated answers right: 25% intact",
        "no drop harmless teacher-forced costs the generated answers 10 points",
    ]
    droppable = _made_up_result(6, 2, drop_accuracy=0.8)  # every drop keeps it: the largest is of 2 layers
    assert ANALYSIS.summary(droppable) == [
        "droppable within 1 point: 2 layers (drop 0..1)",
        "angular rule at that size: drop 2..3 (80% against 80%)",
        "generated answers right: 25% intact",
        "no drop harmless teacher-forced costs the generated answers 10 points",
    ]
    droppable.generated_correct[1] = 0  # drop 0..0: harmless teacher-forced, 25 points lost generated
    assert ANALYSIS.summary(droppable)[-1] == "harmless teacher-forced, not generated: drop 0..0"


def test_critical_layers_are_harmless_teacher_forced_and_not_generated():
    from jaxdepth.analyses.layer_structure import critical_layers_figure, critical_under_generation

    result = _made_up_result(6, 2, drop_accuracy=0.8)
    result.generated_correct[1:] = 1.0  # every structure answers every prompt...
    first, second = [i for i, s in enumerate(result.structures()) if s.kind == "drop"][:2]
    result.generated_correct[first] = [0, 0, 0, 0]  # ...but these: 25 points lost
    result.generated_correct[second] = [1, 0, 0, 0]  # 0 points lost
    result.answer_token_accuracy[second] = 0.5  # and this one is not harmless teacher-forced anyway
    assert critical_under_generation(result) == [result.structures()[first]]
    fig = critical_layers_figure(result)
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["1 layer dropped", "2 layers dropped"]
    import matplotlib.pyplot as plt

    plt.close(fig)
    assert critical_under_generation(_made_up_result(6, 2, drop_accuracy=0.8, generated=False)) == []


def test_each_panel_of_the_figure_has_one_x_axis_meaning():
    """The swaps are drawn against their first layer, the middle blocks' structures against
    their size, on two panels; each panel's curves hold only its own structures."""
    L_, K = 8, 3
    result = _made_up_result(L_, K, drop_accuracy=0.5)
    fig = structure_figure(result)
    by_title = {ax.get_title(): ax for ax in fig.axes}
    swaps = by_title["adjacent layers swapped"]
    blocks = by_title["the middle block, rearranged"]
    assert swaps.get_xlabel() == "first swapped layer (swapped with the next)"
    assert blocks.get_xlabel() == "size of the middle block"
    curves = lambda ax: {
        line.get_label(): line.get_xdata() for line in ax.get_lines() if "intact" not in line.get_label()
    }  # noqa: E731
    assert set(curves(swaps)) == {"swap: token accuracy", "swap: generated answers"}
    assert all(list(x) == list(range(L_ - 1)) for x in curves(swaps).values())
    assert {label.split(":")[0] for label in curves(blocks)} == {"reverse", "repeat", "parallel"}
    assert all(list(x) == list(range(2, K + 1)) for x in curves(blocks).values())
    family = result.structures()
    swap_rows = [i for i, s in enumerate(family) if s.kind == "swap"]
    np.testing.assert_array_equal(swaps.get_lines()[0].get_ydata(), result.accuracy()[swap_rows])
    # one layer at most: no middle block of two or more, no panel for it
    single = structure_figure(_made_up_result(L_, 1, drop_accuracy=0.5))
    assert "the middle block, rearranged" not in {ax.get_title() for ax in single.axes}


def test_progress_counts_every_chunk_and_names_the_programs_to_compile():
    """A bar opens before the first chunk runs (its compilation included), saying how many
    programs the sweep compiles, and steps once per chunk: the teacher-forced scores of the
    single-layer orders in chunks of 4 and the parallel block's, then generation's chunks of
    drops, of swaps and of the middle blocks."""
    Recorder, bars = bar_recorder()
    batch = make_batch([rng.integers(0, 97, n).tolist() for n in (9, 7)], [6, 5], pad_id=0)
    family = structure_family(L, 2)  # intact, 5 + 4 drops, 4 swaps, reverse and repeat: single-layer; 1 parallel
    structure_analysis(
        PARAMS,
        batch,
        CONFIG,
        max_block=2,
        generation=Generation(_words, max_new_tokens=2),
        execution=Execution(chunk_size=4, progress=Recorder),
    )
    scored = -(-(len(family) - 1) // 4) + 1  # the 16 single-layer orders by 4, the parallel one
    generated = 3 + 1 + 1  # the intact model and the 9 drops by 4; the 4 swaps; the 3 middle blocks
    assert [(b.desc, b.total, b.done) for b in bars] == [
        ("teacher-forced scores (2 programs to compile)", scored, scored),
        ("generating under each structure (3 programs to compile)", generated, generated),
    ]


def test_generation_chunks_run_drops_and_swaps_on_their_schedules():
    """The intact model and the drops share the identity's schedule, the swaps theirs (one
    `[J, 1]` of layers for the whole chunk); the middle blocks are stacked as their own orders."""
    from jaxdepth.analyses.layer_structure import _generation_chunks, _schedule_of

    family = structure_family(L, 2)
    chunks = _generation_chunks(family, [s.order(L) for s in family], L, 4)
    kinds = [[family[i].kind for i in members] for members, _ in chunks]
    assert kinds[:4] == [["intact", "drop", "drop", "drop"], ["drop"] * 4, ["drop"] * 2, ["swap"] * 4]
    assert kinds[4:] == [["reverse", "repeat", "parallel"]]
    for members, stacked in chunks[:4]:
        kind = "swap" if family[members[0]].kind == "swap" else "drop"
        assert np.array_equal(np.asarray(stacked.layers)[:, 0], _schedule_of(kind, L))
        assert stacked.used.shape == (4,) + stacked.layers.shape
    assert chunks[4][1].layers.shape == (3, L + 2, 2)


@pytest.mark.parametrize("num_layers", [2, 5, 30])
def test_drops_and_swaps_run_their_own_layers_on_a_shared_schedule(num_layers):
    """On its family's schedule, the steps each structure runs are its own order's layers, in
    order; the others leave its residual as it is."""
    from jaxdepth.analyses.layer_structure import _on_schedule, _schedule_of

    assert _schedule_of("swap", 4).tolist() == [0, 1, 0, 2, 1, 3, 2]
    for s in structure_family(num_layers, 1 if num_layers == 2 else 3):
        schedule = _schedule_of(s.kind, num_layers)
        if schedule is None:
            assert s.kind in ("reverse", "repeat", "parallel")
            continue
        order = s.order(num_layers)
        assert schedule[_on_schedule(order, schedule)].tolist() == np.asarray(order.layers)[:, 0].tolist(), str(s)


def test_the_loose_options_are_refused_with_the_values_that_say_the_same():
    """How the sweep runs is one `Execution`, what generation reads one `Generation`: the
    keywords they once were on their own are refused before anything runs."""
    intact = [Structure("intact", 0, 0)]
    with pytest.raises(TypeError, match=r"structure_scores\(\) takes how to run as one value: execution=jaxdepth"):
        structure_scores(PARAMS, BATCH, CONFIG, intact, chunk_size=4)
    with pytest.raises(TypeError, match=r"execution=jaxdepth.Execution\(memory_budget=1000, progress=False\)"):
        structure_analysis(PARAMS, BATCH, CONFIG, max_block=1, memory_budget=1000, progress=False)
    with pytest.raises(TypeError, match="unexpected keyword arguments: decode, max_new_tokens"):
        structure_analysis(PARAMS, BATCH, CONFIG, max_block=1, decode=_words, max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        Generation(_words, 0)
