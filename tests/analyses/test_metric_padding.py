"""A user's metric never reads padding (`jaxdepth.analyses.metric_inputs`): a 9-token prompt padded
to 16 beside a 16-token one, and a metric of `logits[0, -1]` (the docs' forward examples' form)
that reads position 15, padding for the short prompt. Every analysis that takes a metric (layer
skip, erasure, integrated gradients, site gradients, `Model.site_gradients`) refuses it before it
measures anything, naming the prompt and its length; a metric of real positions only passes and
gives exactly the numbers of the unchecked computation. Edge attribution's sequence metrics, which
read every position of pairs padded to the longest, are held to the same rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdepth
from jaxdepth.analyses import attribution, erasure, layer_skip
from jaxdepth.analyses.edges import kl_to_clean, mean_kl_to_clean, prompt_pairs, sequence_metric
from jaxdepth.analyses.edges.scores import edge_attribution
from jaxdepth.analyses.ig import Attribution, Execution, FixedRule, integrated_gradients
from jaxdepth.analyses.layer_skip import SkipMasks, member_masks
from jaxdepth.analyses.metric_inputs import padding_reads
from jaxdepth.core.batch import PromptArrays, make_batch
from jaxdepth.lab.loaded_model import Model

from tiny_qwen import CONFIG, params  # noqa: F401  (fixture)

SHORT = 9  # the short prompt's real length; its bucket is 16
REFUSED = rf"reads padded positions of prompt 1, which has {SHORT} real tokens padded to 16"


def last_logit(logits):
    """The docs' form, `logits[0, -1]`: position 15, padding for a 9-token prompt."""
    return logits[0, -1, 0]


def last_argmax(logits):
    """An integer metric (no gradient) reading padding: the model's top token at position 15."""
    return jnp.argmax(logits[0, -1])


def real_logit(logits):
    """Position 8, real in both prompts: the short prompt's last token."""
    return logits[0, SHORT - 1, 0]


def batch_logit(logits):
    """One value per prompt (integrated gradients' form for a batch) at position 15."""
    return logits[:, -1, 0]


def batch_real_logit(logits):
    """One value per prompt at position 8."""
    return logits[:, SHORT - 1, 0]


def summed_logit(logits):
    """A scalar of the batch (site gradients' form) reading position 15."""
    return jnp.sum(logits[:, -1, 0])


def summed_real_logit(logits):
    return jnp.sum(logits[:, SHORT - 1, 0])


@jaxdepth.metric(reads="all")
def every_last_logit(r):
    """A metric of every position's logits (integrated gradients' and site gradients' form)
    reading position 15 of each prompt: padding for the 9-token one."""
    return r.logits[:, -1, 0]


@jaxdepth.metric(reads="all")
def every_real_logit(r):
    """The same at position 8, real in both prompts."""
    return r.logits[:, SHORT - 1, 0]


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(3)
    return make_batch([rng.integers(1, 97, 16).tolist(), rng.integers(1, 97, SHORT).tolist()], [10, 5])


def test_the_trial_layer_skip_reading_padding_is_refused(params, batch):
    """The trial: on a 9-token prompt padded to 16, `logits[0, -1]` read position 15, padding (a
    change of -0.071 instead of 1.488 at one layer, exactly 0 at another, silently)."""
    assert batch.single(1).tokens.shape == (1, 16) and int(batch.lengths[1]) == SHORT
    for metric in (last_logit, last_argmax):
        with pytest.raises(ValueError, match="layer skip: the metric '" + metric.__name__ + "' " + REFUSED):
            layer_skip.layer_skip(params, batch, CONFIG, mode="current", metric=metric, progress=False)


def test_a_metric_of_real_positions_gives_the_unchecked_numbers(params, batch):
    """The checked analysis's metric changes equal, to the bit, those of the skipped runs and
    `metric_changes` called directly (no check) on each prompt."""
    result = layer_skip.layer_skip(params, batch, CONFIG, mode="current", metric=real_logit, progress=False)
    for i in range(len(batch)):
        one = batch.single(i)
        T = one.tokens.shape[1]
        skip, measure = member_masks(int(batch.lengths[i]), T, [], "current")
        prompt = PromptArrays(*jax.device_put((one.tokens, one.valid)))
        masks = SkipMasks(np.stack(skip).astype(np.float32), np.stack(measure))
        _, final, clean_final = layer_skip.skipped_runs(
            params, prompt, np.arange(CONFIG.num_layers), jax.device_put(masks), CONFIG
        )
        direct = np.asarray(layer_skip.metric_changes(params, final, clean_final, CONFIG, real_logit))
        np.testing.assert_array_equal(result.metric_change_per_prompt[i], direct)
    assert np.abs(result.metric_change_per_prompt).max() > 1e-2  # the metric really moves


def _masked_mean(valid):
    """The mean logit over each prompt's real positions, the padding multiplied by 0: a read of
    the padding that cannot change the value, which passes."""
    mask = jnp.asarray(valid, jnp.float32)
    return lambda logits: jnp.sum(logits[..., 0] * mask) / jnp.sum(mask)


def test_the_rule_of_padding_reads(params, batch):
    logits = jax.random.normal(jax.random.PRNGKey(0), (2, 16, CONFIG.vocab_size))
    valid = jnp.asarray(batch.valid)
    reads = lambda metric: np.asarray(padding_reads(metric, logits, valid)).tolist()  # noqa: E731
    assert reads(batch_logit) == [False, True]  # prompt 0 has no padding to read
    assert reads(batch_real_logit) == [False, False]
    assert reads(summed_logit) == [False, True]
    assert reads(_masked_mean(valid)) == [False, False]
    assert reads(lambda x: jnp.argmax(x[:, -1], axis=-1)) == [False, True]  # no gradient: the replacement moves it
    assert reads(lambda x: jnp.max(x[1, 12])) == [False, True]  # the replacement's max differs too


def _refusals(params, batch):
    """Each analysis that takes a metric, called with `metric`."""
    tokens, valid = jnp.asarray(batch.tokens), jnp.asarray(batch.valid)
    baseline = erasure.mean_residuals(params, batch, CONFIG)
    model = Model(params, CONFIG, None, "tiny")
    one_prompt = dict(progress=False)
    return {
        "layer skip": lambda m: layer_skip.layer_skip(params, batch, CONFIG, mode="current", metric=m, **one_prompt),
        "erasure": lambda m: erasure.residual_erasure(params, batch, CONFIG, baseline, metric=m, **one_prompt),
        "integrated gradients": lambda m: integrated_gradients(
            params, batch, CONFIG, Attribution(m, layers=[1]), rule=FixedRule(steps=2), execution=Execution()
        ),
        "site gradients": lambda m: attribution.site_gradients(params, PromptArrays(tokens, valid), CONFIG, m),
        "Model.site_gradients": lambda m: model.site_gradients(tokens, m, valid=valid),
    }


# (analysis, the name its refusal gives, a metric reading padding, one reading real positions only)
CASES = [
    ("layer skip", "layer skip", last_logit, real_logit),
    ("erasure", "erasure", last_logit, real_logit),
    ("integrated gradients", "integrated gradients", every_last_logit, every_real_logit),
    ("site gradients", "site gradients", every_last_logit, every_real_logit),
    ("Model.site_gradients", "site gradients", every_last_logit, every_real_logit),
]


@pytest.mark.parametrize("analysis, name, bad, good", CASES, ids=[c[0] for c in CASES])
def test_every_analysis_that_takes_a_metric_refuses_one_reading_padding(params, batch, analysis, name, bad, good):
    run = _refusals(params, batch)[analysis]
    with pytest.raises(ValueError, match=f"{name}: the metric '{bad.__name__}' {REFUSED}"):
        run(bad)
    run(good)  # real positions only: it runs


@sequence_metric
def last_position_kl(logits, clean_logits, pairs):
    """KL to the clean run at position -1: padding for the shorter pair."""
    clean = jax.nn.log_softmax(clean_logits[:, -1], axis=-1)
    return jnp.sum(jnp.exp(clean) * (clean - jax.nn.log_softmax(logits[:, -1], axis=-1)), axis=-1)


def test_edge_attribution_refuses_a_sequence_metric_reading_padding(params):
    """A sequence metric reads the logits at every position of pairs padded to the longest: one
    at position -1 reads the shorter pair's padding and is refused; the built-in ones (the last
    real position, a mean over real positions) run."""
    pairs = prompt_pairs(
        [list(range(1, 10)), [4, 8, 15, 16, 23, 42]], [[1, 2, 3, 5, 5, 6, 7, 8, 9], [4, 8, 7, 16, 23, 42]]
    )
    with pytest.raises(
        ValueError,
        match="edge attribution: the metric 'last_position_kl' reads padded positions of "
        "prompt 1, which has 6 real tokens padded to 9",
    ):
        edge_attribution(params, pairs, CONFIG, last_position_kl)
    for metric in (kl_to_clean, mean_kl_to_clean):
        edge_attribution(params, pairs, CONFIG, metric)
