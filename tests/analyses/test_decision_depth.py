"""Decision depth per token: the first boundary from which the lens's top-1 stays the model's."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from conftest import tiny_config, with_layers_silenced
from jaxdepth.analyses.decision_depth import (
    ANALYSIS,
    DecisionDepthResult,
    decision_depth,
    decision_depth_figure,
    decision_depths,
    frequency_ranks,
)
from jaxdepth.analyses.suite import RunInputs
from jaxdepth.core.batch import make_batch
from jaxdepth.core.model import random_params, residual_stream, unembed

CONFIG = tiny_config(num_layers=4)


def test_decision_depths_on_constructed_predictions_equal_a_hand_count():
    # boundaries 0..4 (rows), five positions (columns); row 4 is the model's prediction
    top1 = np.array(
        [
            [7, 1, 2, 3, 9],
            [7, 1, 5, 3, 9],
            [7, 2, 5, 8, 9],
            [7, 1, 5, 3, 1],
            [7, 1, 5, 3, 2],
        ]
    )
    # 0: always 7; 1: leaves 1 at boundary 2 and comes back at 3; 2: 5 from boundary 1 on;
    # 3: 3 from 3 on (8 at 2); 4: only the last boundary predicts 2
    assert decision_depths(top1).tolist() == [0, 3, 1, 3, 4]
    assert decision_depths(top1[:, None, :]).shape == (1, 5)  # any trailing shape


def test_frequency_ranks_by_id_and_by_count():
    predicted = np.array([[5, 5, 9, 2, 0], [9, 5, 2, 2, 7]])
    valid = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], bool)
    assert np.array_equal(frequency_ranks(predicted, valid, "id"), predicted)
    # counts over valid positions: 2 and 5 three times each (the tie by id: 2 first), 9 twice,
    # 7 once; 0 sits at padding only
    ranks = frequency_ranks(predicted, valid, "count")
    assert ranks[valid].tolist() == [1, 1, 2, 0, 2, 1, 0, 0, 3]


def _batch(lengths, answer_starts, seed=0):
    rng = np.random.default_rng(seed)
    return make_batch([rng.integers(1, CONFIG.vocab_size, n).tolist() for n in lengths], answer_starts)


def _brute_force(params, batch, config):
    hs = residual_stream(params, jnp.asarray(batch.tokens), config, valid=jnp.asarray(batch.valid))
    top1 = np.stack([np.asarray(jnp.argmax(unembed(params, h, config), -1)) for h in hs])
    L = config.num_layers
    depth = np.full(batch.tokens.shape, -1)
    for b, t in zip(*np.nonzero(batch.valid)):
        y = top1[L, b, t]
        depth[b, t] = min(l for l in range(L + 1) if all(top1[k, b, t] == y for k in range(l, L + 1)))
    return depth


def test_a_model_whose_later_layers_are_zeroed_decides_where_they_start():
    params = random_params(CONFIG, 0, scale=0.5)
    batch = _batch([9, 6, 12], [5, 3, 8])
    start = 2  # layers 2 and 3 write nothing: h_2 = h_3 = h_4
    zeroed = with_layers_silenced(params, np.arange(start, CONFIG.num_layers))
    result = decision_depth(zeroed, batch, CONFIG)
    assert np.array_equal(result.depth, _brute_force(zeroed, batch, CONFIG))
    assert result.depth[result.valid].max() <= start and (result.depth[result.valid] == start).mean() > 0.5
    assert np.all(result.depth[~batch.valid] == -1)

    full = decision_depth(params, batch, CONFIG)
    assert np.array_equal(full.depth, _brute_force(params, batch, CONFIG))
    assert full.depth[full.valid].max() > start  # the later layers do change predictions


def test_the_answer_groups_and_the_suite_analysis(tmp_path):
    params = random_params(CONFIG, 1, scale=0.5)
    batch = _batch([9, 6], [5, 6])  # the second prompt has no answer part
    result = decision_depth(params, batch, CONFIG, frequency="count")
    first, later = result.answer_positions()
    assert np.nonzero(first) == (np.array([0]), np.array([4]))  # position 4 predicts answer token 5
    assert np.nonzero(later)[1].tolist() == [5, 6, 7] and not later[1].any()
    per_prompt = result.per_prompt(first)
    assert per_prompt[0] == result.depth[0, 4] and np.isnan(per_prompt[1])
    quartiles = result.rank_quartiles()
    assert np.array_equal(np.sum(quartiles, axis=0).astype(bool), result.valid)

    path = str(tmp_path / "r.npz")
    result.save(path)
    again = DecisionDepthResult.load(path)
    assert np.array_equal(again.depth, result.depth) and again.settings["frequency"] == "count"
    assert decision_depth_figure(result, resamples=20) is not None

    from types import SimpleNamespace

    model = SimpleNamespace(params=params, config=CONFIG)
    settings = ANALYSIS.settings(decision_frequency="count")
    suite = ANALYSIS.run(RunInputs(model=model, batch=batch, settings=settings, progress=False))
    assert np.array_equal(suite.depth, result.depth)
    assert ANALYSIS.summary(suite)[0].startswith("mean decision depth")


def test_the_summary_averages_each_prompts_mean_over_the_prompts():
    """Prompts of 3 and 6 positions: the summary's means are those of the two prompts' means (as
    the figure's bars are), not of the nine positions pooled."""
    depth = np.array([[1, 1, 1, -1, -1, -1], [4, 4, 4, 4, 4, 2]])
    result = DecisionDepthResult(
        depth=depth,
        predicted=np.zeros_like(depth),
        rank=np.where(depth >= 0, 0, -1),
        answer_start=np.array([1, 3]),
        lengths=np.array([3, 6]),
        num_layers=4,
        settings={"frequency": "id"},
    )
    by_prompt = (1.0 + (5 * 4 + 2) / 6) / 2  # 2.333...
    pooled = (3 * 1 + 5 * 4 + 2) / 9  # 2.777...: the token-weighted mean, which the summary is not
    # the first answer token: position 0 of prompt 0 (depth 1) and position 2 of prompt 1 (depth 4);
    # later ones: position 1 of prompt 0 (1), positions 3 and 4 of prompt 1 (4 and 4; pooled: 3.0)
    overall, groups = ANALYSIS.summary(result)
    assert f"{by_prompt:.1f}" != f"{pooled:.1f}"
    assert overall == f"mean decision depth {by_prompt:.1f} of 4 (mean over prompts of each prompt's mean)"
    assert groups == f"answer's first token {(1 + 4) / 2:.1f}, later ones {(1 + 4) / 2:.1f}"
    assert result.prompt_mean() == by_prompt
    fig = decision_depth_figure(result, resamples=0)
    bars = [patch.get_width() for patch in fig.axes[1].patches]
    assert bars[0] == by_prompt / 4  # "all positions", the figure's first group
