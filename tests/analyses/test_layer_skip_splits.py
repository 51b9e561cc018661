"""Layer skip with the split at each prompt's answer start (METHODS §3, the first study's
depth-against-difficulty runs): one split per prompt, equal to the plain forward run one member
at a time, recorded in `split_positions`, and part of the cache identity only when asked for."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdepth.analyses import layer_skip
from jaxdepth.core.batch import make_batch
from jaxdepth.analyses.layer_skip import SUBLAYERS, Skip
from jaxdepth.core import sites
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, forward, random_params
from jaxdepth.lab.registry import analysis
from jaxdepth.lab.study import StudySettings

from tiny_qwen import CONFIG  # the tiny Qwen2 every analysis test runs on


# Compare at full float32 matmul precision (as the references compute).
pytestmark = pytest.mark.usefixtures("highest_precision")


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, 1, scale=0.2)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    return make_batch(
        [rng.integers(0, 97, 30).tolist(), rng.integers(0, 97, 23).tolist(), rng.integers(0, 97, 9).tolist()],
        [20, 15, 6],
    )


@jax.jit
def _probs(params, tokens, valid, interventions):
    return jax.nn.softmax(forward(params, tokens, CONFIG, valid=valid, interventions=interventions), -1)


@jax.jit
def _deltas(params, tokens, valid, interventions):
    return run_layers(
        params,
        embed(params, tokens, CONFIG),
        CONFIG,
        valid=valid,
        interventions=interventions,
        tap=lambda r, _: r.delta,
    )[1]


def _one_at_a_time(params, one, layer, split, sublayer):
    """Skip `layer` at positions 1 <= p < split through the plain forward; numpy statistics over
    p >= split: (relative change of every layer's contribution [L], output change)."""
    T, length = one.tokens.shape[1], int(one.lengths[0])
    pos = np.arange(T)
    tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
    iv = sites.skip(SUBLAYERS[sublayer], layer, ((pos >= 1) & (pos < split)).astype(np.float32))
    d_clean, d_skip = (np.asarray(_deltas(params, tokens, valid, x)) for x in (None, iv))
    ratio = np.linalg.norm(d_clean - d_skip, axis=-1) / np.maximum(np.linalg.norm(d_clean, axis=-1), 1e-6)
    future = (pos >= split) & (pos < length)
    p_clean, p_skip = (np.asarray(_probs(params, tokens, valid, x)) for x in (None, iv))
    return ratio[:, 0, future].max(-1), np.linalg.norm(p_clean - p_skip, axis=-1)[0, future].max()


@pytest.mark.parametrize("sublayer", ["layer", "attn", "mlp"])
def test_answer_start_split_equals_one_at_a_time(params, batch, sublayer):
    result = layer_skip.layer_skip(params, batch, CONFIG, Skip(sublayer=sublayer, splits="answer_start"))
    L = CONFIG.num_layers
    np.testing.assert_array_equal(result.split_positions, batch.answer_start[:, None])
    for i in range(len(batch)):
        split = int(batch.answer_start[i])
        ref_later, ref_out = np.zeros((L, L)), np.zeros(L)
        for s in range(L):
            later, ref_out[s] = _one_at_a_time(params, batch.single(i), s, split, sublayer)
            ref_later[s] = np.where(np.arange(L) > s, later, 0.0)
        np.testing.assert_allclose(result.later_per_prompt[i], ref_later, atol=2e-5)
        np.testing.assert_allclose(result.output_per_prompt[i], ref_out, atol=2e-6)
    lower = np.tril(np.ones((L, L), bool))
    assert np.all(result.later_per_prompt[:, lower] == 0.0)  # j <= s: exactly zero by construction
    assert np.all(result.later[~lower] > 0)
    np.testing.assert_array_equal(result.later, result.later_per_prompt.max(0))
    assert result.settings["splits"] == "answer_start"


def test_answer_start_measures_a_prompt_the_sampled_splits_leave_out(params, batch):
    """A 9-token prompt has no sampled split position (range(8, 5, 8) is empty) but an answer."""
    sampled = layer_skip.layer_skip(params, batch, CONFIG)
    at_answer = layer_skip.layer_skip(params, batch, CONFIG, Skip(splits="answer_start"))
    assert np.all(sampled.split_positions[2] == -1) and np.all(sampled.later_per_prompt[2] == 0)
    assert at_answer.split_positions[2, 0] == 6 and at_answer.later_per_prompt[2].max() > 0


def test_a_prompt_without_answer_tokens_is_left_out(params):
    rng = np.random.default_rng(1)
    batch = make_batch([rng.integers(0, 97, 12).tolist(), rng.integers(0, 97, 10).tolist()], [5, 10])
    result = layer_skip.layer_skip(params, batch, CONFIG, Skip(splits="answer_start"))
    assert result.split_positions.tolist() == [[5], [-1]]
    assert np.all(result.later_per_prompt[1] == 0) and np.all(result.output_per_prompt[1] == 0)
    with pytest.raises(ValueError, match="no prompt has an answer token"):
        layer_skip.layer_skip(params, batch.select(slice(1, 2)), CONFIG, Skip(splits="answer_start"))


def test_sublayers_share_the_answer_start(params, batch):
    both = layer_skip.layer_skip_sublayers(
        params, batch, CONFIG, Skip(splits="answer_start"), sublayers=["layer", "mlp"]
    )
    alone = layer_skip.layer_skip(params, batch, CONFIG, Skip(sublayer="mlp", splits="answer_start"))
    np.testing.assert_array_equal(both.part("mlp").later, alone.later)
    np.testing.assert_array_equal(both.split_positions, batch.answer_start[:, None])
    assert both.settings["splits"] == "answer_start"


def test_bad_split_arguments_are_refused(params, batch):
    with pytest.raises(ValueError, match="needs mode='future'"):
        Skip(mode="current", splits="answer_start")
    with pytest.raises(ValueError, match="splits one of"):
        Skip(splits="answer")
    # the keywords of a Skip given on their own are refused, showing the Skip that says the same
    with pytest.raises(TypeError, match=r"skip=Skip\(mode='current', splits='answer_start'\)"):
        layer_skip.layer_skip(params, batch, CONFIG, mode="current", splits="answer_start")


def test_answer_start_enters_the_cache_identity_only_when_asked_for():
    entry = analysis("layer_skip")
    default = entry.identity(StudySettings().for_analysis(entry))
    assert "skip_split" not in default  # results cached before the option existed stay valid
    asked = StudySettings(options={"skip_split": "answer_start"}).for_analysis(entry)
    assert entry.identity(asked) == {**default, "skip_split": "answer_start"}
