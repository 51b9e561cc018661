"""Prompt batches and the length buckets they pad to: the ladder, the groups' shapes, and results
that do not depend on the padding."""

import numpy as np
import pytest

from jaxdepth.analyses import contributions, erasure, integrated_gradients as ig, layer_skip, logit_lens
from jaxdepth.analyses.ig import Execution, FixedRule
from jaxdepth.core.batch import ANSWER_BUCKETS, LengthBuckets, make_batch
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import random_params

CONFIG = ModelConfig(
    model_type="qwen2",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=1e4,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    qkv_bias=True,
)
EXACT = LengthBuckets(1, geometric=False)  # every prompt at its own length: no padding at all

pytestmark = pytest.mark.usefixtures("highest_precision")


def test_the_geometric_ladder_is_the_powers_of_two_and_their_midpoints():
    buckets = LengthBuckets()
    ladder = sorted({buckets.padded(n) for n in range(1, 1025)})
    assert ladder == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    for n in range(1, 1025):
        b = buckets.padded(n)
        assert b >= n and (n <= 16 or b <= 1.5 * n), (n, b)  # at most half the length again
        assert buckets.padded(b) == b  # a bucket is its own bucket
    assert ANSWER_BUCKETS.padded(5) == 6 and ANSWER_BUCKETS.padded(1) == 4
    assert LengthBuckets(16, geometric=False).padded(17) == 32


def test_the_gsm8k_sample_lengths_share_four_buckets():
    # the token counts of GSM8K sample rows 0-9 span 121 to 349 tokens
    lengths = [121, 135, 150, 176, 199, 230, 261, 300, 331, 349]
    assert sorted({LengthBuckets().padded(n) for n in lengths}) == [128, 192, 256, 384]
    assert len({LengthBuckets(16, geometric=False).padded(n) for n in lengths}) == 10


def test_length_buckets_parse_and_refuse():
    assert LengthBuckets.parse("geometric") == LengthBuckets()
    assert LengthBuckets.parse("geometric:8") == LengthBuckets(8)
    assert LengthBuckets.parse("multiple:64") == LengthBuckets(64, geometric=False)
    assert LengthBuckets.parse(str(LengthBuckets(8, geometric=False))) == LengthBuckets(8, geometric=False)
    for bad in ("powers", "multiple:", "multiple:x", "geometric:-2", "multiple:0"):
        with pytest.raises(ValueError, match="length buckets|positive integer"):
            LengthBuckets.parse(bad)


def test_a_batch_and_its_prompts_take_bucket_lengths():
    rng = np.random.default_rng(0)
    batch = make_batch([rng.integers(0, 97, n).tolist() for n in (20, 40, 70)], [10, 30, 60])
    assert batch.tokens.shape[1] == 96
    assert [batch.single(i).tokens.shape[1] for i in range(3)] == [24, 48, 96]
    prompt = batch.prompt(1)  # answer-predicting positions 29..38: 10, padded to 12
    assert prompt.tokens.shape == (1, 48) and prompt.answer_positions.shape == (12,)
    assert int(prompt.answer_real.sum()) == 10
    assert batch.select([0, 1]).buckets == batch.buckets
    exact = make_batch([rng.integers(0, 97, n).tolist() for n in (20, 40, 70)], buckets=EXACT)
    assert [exact.single(i).tokens.shape[1] for i in range(3)] == [20, 40, 70]


def test_no_padding_beyond_the_context():
    """A prompt that fits the model's context is never padded past it, whatever its bucket."""
    rng = np.random.default_rng(4)
    batch = make_batch([rng.integers(0, 97, n).tolist() for n in (70, 150)], max_length=160)
    assert LengthBuckets().padded(150) == 192 and batch.tokens.shape[1] == 160
    assert batch.single(1).tokens.shape[1] == 160 and batch.single(0).tokens.shape[1] == 96


def test_groups_have_power_of_two_rows_with_the_prompts_first():
    rng = np.random.default_rng(1)
    lengths = (5, 40, 17, 9, 30, 12, 25, 70, 6, 20)
    batch = make_batch([rng.integers(0, 97, n).tolist() for n in lengths])
    seen = []
    for index, group in batch.groups(max_tokens=64):
        rows, T = group.tokens.shape
        assert rows & (rows - 1) == 0 and rows >= len(index) and (rows == 1 or rows * T <= 64)
        assert T == LengthBuckets().padded(batch.lengths[index].max())
        np.testing.assert_array_equal(group.tokens[: len(index)], batch.tokens[index, :T])
        np.testing.assert_array_equal(
            group.tokens[len(index) :], np.repeat(group.tokens[len(index) - 1 : len(index)], rows - len(index), axis=0)
        )
        seen.extend(index)
    assert sorted(seen) == list(range(len(lengths)))
    three = make_batch([rng.integers(0, 97, n).tolist() for n in (17, 20, 25)])
    [(index, group)] = three.groups(max_tokens=128)  # 3 prompts in 4 rows of 32 positions
    assert list(index) == [0, 1, 2] and group.tokens.shape == (4, 32)


@pytest.fixture(scope="module")
def runs():
    """Every batch analysis on the same prompts, padded to buckets and not padded at all."""
    params = random_params(CONFIG, 1, scale=0.2)
    rng = np.random.default_rng(3)
    # Three prompts (so that the grouped analyses pad a group with a fourth row) in two buckets,
    # each padded (37 to 48, 13 to 16), the short one trimmed from the batch's 48 positions. The
    # first and last share their length and answer length: each distinct (length, answer length)
    # compiles every sweep once more per run, and compiling was nearly all of this test's time.
    token_lists = [rng.integers(0, 97, n).tolist() for n in (37, 13, 37)]
    starts = [30, 9, 30]
    baseline = np.asarray(rng.normal(size=(CONFIG.num_layers + 1, CONFIG.hidden_size)), np.float32)

    def run(buckets):
        batch = make_batch(token_lists, starts, buckets=buckets)
        return batch, dict(
            erasure=erasure.residual_erasure(params, batch, CONFIG, baseline),
            layer_skip=layer_skip.layer_skip(params, batch, CONFIG),
            ig=ig.integrated_gradients_of_answers(
                params, batch, CONFIG, rule=FixedRule(steps=4), execution=Execution(progress=False)
            ),
            lens=logit_lens.logit_lens(params, batch, CONFIG),
            contributions=contributions.contributions(params, batch, CONFIG),
        )

    return run(LengthBuckets()), run(EXACT)


@pytest.mark.slow(seconds=35)
def test_results_do_not_depend_on_the_buckets(runs):
    (padded_batch, padded), (exact_batch, exact) = runs
    assert padded_batch.tokens.shape[1] == 48 and exact_batch.tokens.shape[1] == 37
    lengths = exact_batch.lengths
    for i, n in enumerate(lengths):  # per position, on each prompt's real positions
        np.testing.assert_allclose(
            padded["erasure"].effects[i, :, :n], exact["erasure"].effects[i, :, :n], rtol=1e-4, atol=1e-6
        )
        np.testing.assert_allclose(
            padded["ig"].attributions[i, :, :n], exact["ig"].attributions[i, :, :n], rtol=1e-4, atol=1e-6
        )
        # exact zeros stay exact: erasing the last position changes no answer prediction
        assert np.all(padded["erasure"].effects[i, :, n - 1] == 0) and np.all(
            exact["erasure"].effects[i, :, n - 1] == 0
        )
    np.testing.assert_allclose(padded["ig"].f_baseline, exact["ig"].f_baseline, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(padded["layer_skip"].later, exact["layer_skip"].later, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(padded["layer_skip"].output, exact["layer_skip"].output, rtol=1e-4, atol=1e-6)
    for name in ("kl", "overlap"):
        np.testing.assert_allclose(getattr(padded["lens"], name), getattr(exact["lens"], name), rtol=1e-4, atol=1e-6)
    for name in contributions.STATISTICS:
        np.testing.assert_allclose(
            getattr(padded["contributions"], name), getattr(exact["contributions"], name), rtol=1e-4, atol=1e-6
        )
