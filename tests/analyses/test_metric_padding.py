"""A user's metric never reads padding (`jaxdepth.analyses.metric_inputs`): a 9-token prompt padded
to 16 beside a 16-token one, and a metric of `logits[0, -1]` (the docs' forward examples' form;
for layer skip and erasure a `Metric` of reads='all', `r.logits[:, -1]`) that reads position 15,
padding for the short prompt. Every analysis that takes a metric (layer
skip, erasure, integrated gradients, site gradients, `Model.site_gradients`) refuses it before it
measures anything, naming the prompt and its length; a metric of real positions only passes and
gives exactly the numbers of the unchecked computation. Edge attribution's metrics of every position
(`reads='all'`), which read every position of pairs padded to the longest, are held to the same
rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdepth
from jaxdepth.analyses import attribution, erasure, layer_skip
from jaxdepth.analyses.edges import kl_clean_to_run, mean_kl_clean_to_run, prompt_pairs
from jaxdepth.analyses import metrics
from jaxdepth.analyses.edges.scores import edge_attribution
from jaxdepth.analyses.ig import Attribution, Execution, FixedRule, integrated_gradients
from jaxdepth.analyses.layer_skip import Skip, SkipMasks, member_masks
from jaxdepth.analyses.metric_inputs import padding_reads
from jaxdepth.core.batch import LengthBuckets, PromptArrays, make_batch
from jaxdepth.lab.loaded_model import Model

from tiny_qwen import CONFIG, params  # noqa: F401  (fixture)

SHORT = 9  # the short prompt's real length; its bucket is 16
REFUSED = rf"reads padded positions of prompt 1, which has {SHORT} real tokens padded to 16"


@jaxdepth.metric(reads="all")
def last_logit(r):
    """The docs' form, `logits[0, -1]`: position 15, padding for a 9-token prompt."""
    return r.logits[:, -1, 0]


@jaxdepth.metric(reads="all")
def last_argmax(r):
    """A metric without a gradient reading padding: the model's top token at position 15 (as a
    float: a metric is floating point), which only the replacement of the padding moves."""
    return jnp.argmax(r.logits[:, -1], axis=-1).astype(jnp.float32)


@jaxdepth.metric(reads="all")
def real_logit(r):
    """Position 8, real in both prompts: the short prompt's last token."""
    return r.logits[:, SHORT - 1, 0]


@jaxdepth.metric(reads="last")
def last_token_logit(r):
    """Each prompt's last real token, wherever it is: no padding reaches the metric."""
    return r.logits[:, 0, 0]


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
            layer_skip.layer_skip(params, batch, CONFIG, Skip(mode="current"), metric=metric)


def test_a_metric_of_real_positions_gives_the_unchecked_numbers(params, batch):
    """The checked analysis's metric changes equal, to the bit, those of the skipped runs and
    `metric_changes` called directly (no check) on each prompt."""
    result = layer_skip.layer_skip(params, batch, CONFIG, Skip(mode="current"), metric=real_logit)
    for i in range(len(batch)):
        one = batch.single(i)
        T = one.tokens.shape[1]
        skip, measure = member_masks(int(batch.lengths[i]), T, [], "current")
        prompt = PromptArrays(*jax.device_put((one.tokens, one.valid)))
        masks = SkipMasks(np.stack(skip).astype(np.float32), np.stack(measure))
        _, final, clean_final = layer_skip.skipped_runs(
            params, prompt, np.arange(CONFIG.num_layers), jax.device_put(masks), CONFIG
        )
        direct = np.asarray(layer_skip.metric_changes(params, final, clean_final, prompt, CONFIG, real_logit))
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
    return {
        "layer skip": lambda m: layer_skip.layer_skip(params, batch, CONFIG, Skip(mode="current"), metric=m),
        "erasure": lambda m: erasure.residual_erasure(params, batch, CONFIG, baseline, metric=m),
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


def _alone(batch, i):
    """Prompt i of `batch` as a batch of its own, padded to no more than its length."""
    n = int(batch.lengths[i])
    return make_batch([batch.tokens[i, :n].tolist()], [int(batch.answer_start[i])], buckets=LengthBuckets(1, False))


def test_a_metric_of_the_last_token_reads_each_prompt_as_if_alone(params, batch):
    """A metric of reads='last' on prompts of different lengths, padded to one bucket: its
    values (layer skip's and erasure's changes) are those of each prompt run alone, unpadded,
    to float32 rounding (other shapes, other sums); and the same metric written for the whole
    output at the short prompt's last real position gives the same numbers there."""
    baseline = erasure.mean_residuals(params, batch, CONFIG)
    skipped = layer_skip.layer_skip(params, batch, CONFIG, Skip(mode="current"), metric=last_token_logit)
    erased = erasure.residual_erasure(params, batch, CONFIG, baseline, metric=last_token_logit)
    for i in range(len(batch)):
        one, n = _alone(batch, i), int(batch.lengths[i])
        assert one.tokens.shape == (1, n)
        alone = layer_skip.layer_skip(params, one, CONFIG, Skip(mode="current"), metric=last_token_logit)
        np.testing.assert_allclose(skipped.metric_change_per_prompt[i], alone.metric_change_per_prompt[0], atol=2e-5)
        alone = erasure.residual_erasure(params, one, CONFIG, baseline, metric=last_token_logit)
        np.testing.assert_allclose(erased.metric_change[i, :, :n], alone.metric_change[0], atol=2e-5)
    whole = layer_skip.layer_skip(params, batch, CONFIG, Skip(mode="current"), metric=real_logit)
    np.testing.assert_allclose(skipped.metric_change_per_prompt[1], whole.metric_change_per_prompt[1], atol=2e-6)
    assert np.abs(skipped.metric_change_per_prompt).max() > 1e-2


def test_the_old_forms_of_a_metric_are_refused_with_the_new_one(params, batch):
    """A plain function of one prompt's logits, the form layer skip and erasure took before, is
    refused before anything runs, with the message that shows the new form."""
    baseline = np.zeros((CONFIG.num_layers + 1, CONFIG.hidden_size), np.float32)
    old = lambda logits: logits[0, SHORT - 1, 0]  # noqa: E731
    new_form = r"is a plain function; a metric is now one form for every analysis.*@jaxdepth.metric\(reads='last'\)"
    with pytest.raises(TypeError, match="(?s)layer skip: the metric '<lambda>' " + new_form):
        layer_skip.layer_skip(params, batch, CONFIG, metric=old)
    with pytest.raises(TypeError, match="(?s)erasure: the metric '<lambda>' " + new_form):
        erasure.residual_erasure(params, batch, CONFIG, baseline, metric=old)
    with pytest.raises(TypeError, match="layer skip"):
        layer_skip.skip_effects_of_prompt(params, batch.prompt(0), None, CONFIG, metric=old)


def test_the_loose_options_are_refused_with_the_execution_that_says_the_same(params, batch):
    baseline = np.zeros((CONFIG.num_layers + 1, CONFIG.hidden_size), np.float32)
    shown = r"execution=jaxdepth.Execution\(chunk_size=3, progress=False\)"
    with pytest.raises(TypeError, match=r"layer_skip\(\) takes how to run as one value: " + shown):
        layer_skip.layer_skip(params, batch, CONFIG, chunk_size=3, progress=False)
    with pytest.raises(TypeError, match=r"residual_erasure\(\) takes how to run as one value: " + shown):
        erasure.residual_erasure(params, batch, CONFIG, baseline, chunk_size=3, progress=False)
    with pytest.raises(TypeError, match=r"Erasure\(effect='answer_probability_change'\)"):
        erasure.residual_erasure(params, batch, CONFIG, baseline, effect="answer_probability_change")


@metrics.metric(reads="all", clean=True)
def last_position_kl(r):
    """KL to the clean run at position -1: padding for the shorter pair."""
    clean = jax.nn.log_softmax(r.clean[:, -1], axis=-1)
    return jnp.sum(jnp.exp(clean) * (clean - jax.nn.log_softmax(r.logits[:, -1], axis=-1)), axis=-1)


@metrics.metric(reads="all")
def last_position_logit(r):
    """The first logit at position -1, without the clean run: padding for the shorter pair too."""
    return r.logits[:, -1, 0]


def test_edge_attribution_refuses_a_metric_of_every_position_reading_padding(params):
    """A metric of every position reads the logits at every position of pairs padded to the
    longest: one at position -1 reads the shorter pair's padding and is refused, with or
    without the clean run; the built-in ones (the last real position, a mean over real
    positions) run."""
    pairs = prompt_pairs(
        [list(range(1, 10)), [4, 8, 15, 16, 23, 42]], [[1, 2, 3, 5, 5, 6, 7, 8, 9], [4, 8, 7, 16, 23, 42]]
    )
    for bad in (last_position_kl, last_position_logit):
        with pytest.raises(
            ValueError,
            match=f"edge attribution: the metric '{bad.__name__}' reads padded positions of "
            "prompt 1, which has 6 real tokens padded to 9",
        ):
            edge_attribution(params, pairs, CONFIG, bad)
    for good in (kl_clean_to_run, mean_kl_clean_to_run):
        edge_attribution(params, pairs, CONFIG, good)
