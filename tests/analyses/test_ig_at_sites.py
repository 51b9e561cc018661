"""`jaxdepth.integrated_gradients`: any metric, any site, any layers, every rule, against a
hand-written Riemann sum of `jax.grad` through a plain forward; the completeness gap against
F(x) - F(b) computed directly; refusals."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdepth
from conftest import assert_close
from jaxdepth.analyses.ig import AdaptiveRule, Attribution, Execution, FixedRule
from jaxdepth.analyses.ig.checks import ig_baseline
from jaxdepth.analyses.ig.rules import quadrature, rule_of
from jaxdepth.analyses.ig import path as ig_path
from jaxdepth.analyses.ig.path import IG_MEMORY_FRACTION, choose_backward, ig_memory_budget
from jaxdepth.core import sites
from jaxdepth.core.batch import PromptBatch
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, forward, random_params
from jaxdepth.core.sweep import auto_chunk_size, member_bytes
from jaxdepth.lab.loaded_model import Model

CONFIG = ModelConfig(
    model_type="qwen2",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=12345.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    qkv_bias=True,
)
L, T = CONFIG.num_layers, 9
CORRECT, WRONG = 5, 11

pytestmark = pytest.mark.usefixtures("highest_precision")


@functools.lru_cache(maxsize=None)
def _setup():
    params = random_params(CONFIG, 4, scale=0.2)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CONFIG.vocab_size, (2, T)), jnp.int32)
    return params, tokens


@jaxdepth.metric(reads="last")
def logit_difference(r):  # one value per prompt: its last real position's logit of CORRECT minus WRONG
    return r.logits[:, 0, CORRECT] - r.logits[:, 0, WRONG]


def logit_difference_of_one(logits):  # the same of one prompt's full logits [1, T, V], a scalar: the references'
    return logits[0, -1, CORRECT] - logits[0, -1, WRONG]


def integrated_gradients(
    params, tokens, config, metric, *, site="resid_post", layers=None, baseline="channel_mean", per_channel=True, **run
):
    """`jaxdepth.integrated_gradients` of `Attribution(metric, site, layers, baseline, per_channel)`."""
    return jaxdepth.integrated_gradients(
        params, tokens, config, Attribution(metric, site, layers, baseline, per_channel), **run
    )


def _by_hand(params, tokens, site, layer, alphas, weights, metric=logit_difference_of_one):
    """Per-channel IG of layer `layer` at `site` by jax.grad of a plain forward in which
    `sites.replace` sets the site's value at every position; and F(x), F(b). (A site of a split
    layer is read from a run split by an intervention that changes nothing.)"""
    split = sites.unchanged(site) if site in sites.SPLIT_SITES else None
    x = run_layers(
        params, embed(params, tokens, CONFIG), CONFIG, interventions=split, tap=lambda r, _: getattr(r, site)
    )
    x = x[1][layer]
    b = jnp.broadcast_to(ig_baseline(x, jnp.ones(tokens.shape, bool), "channel_mean"), x.shape)
    F = lambda z: metric(forward(params, tokens, CONFIG, interventions=sites.replace(site, layer, jnp.ones(T), z)))
    grad = jax.jit(jax.grad(F))
    mean_grad = sum(w * grad(b + a * (x - b)) for a, w in zip(alphas, weights))
    return (x - b) * mean_grad, float(F(x)), float(F(b))


def _relative_error(ours, expected):
    return float(np.max(np.abs(np.asarray(ours) - np.asarray(expected))) / np.max(np.abs(np.asarray(expected))))


@pytest.mark.parametrize("site", ["resid_post", "head_out", "k_in", "head_result", "mlp_in"])
def test_against_a_hand_written_riemann_sum(site):
    params, tokens = _setup()
    one = tokens[:1]
    steps = 6
    result = integrated_gradients(params, one, CONFIG, logit_difference, site=site, rule=FixedRule(steps=steps))
    trailing = sites.site_shape(site, CONFIG, 1, T)[2:]
    assert result.attributions.shape == (L, 1, T) + trailing and result.per_position.shape == (L, 1, T)
    assert result.gap.shape == (L, 1) and result.evaluations.tolist() == [[steps]] * L
    alphas, weights = quadrature("left", steps)
    for layer in range(L):
        expected, f_x, f_b = _by_hand(params, one, site, layer, alphas, weights)
        err = _relative_error(result.attributions[layer], expected)
        assert err <= 1e-4, f"{site} layer {layer}: relative error {err:.2e}"
        assert result.f_input[0] == pytest.approx(f_x, abs=1e-5)
        assert result.f_baseline[layer, 0] == pytest.approx(f_b, abs=1e-5)
        # the gap is the attributions' sum against F(x) - F(b), computed directly
        assert result.gap[layer, 0] == pytest.approx(
            float(np.sum(result.per_position[layer, 0])) - (f_x - f_b), abs=1e-5
        )
        np.testing.assert_allclose(
            result.per_position[layer, 0],
            np.asarray(expected).reshape(T, -1).sum(-1),
            atol=1e-5 * float(np.max(np.abs(expected))) * 10,
        )


def test_a_subset_of_layers_other_rules_and_baselines_at_mlp_hidden():
    params, tokens = _setup()
    one = tokens[1:]
    result = integrated_gradients(
        params,
        one,
        CONFIG,
        logit_difference,
        site="mlp_hidden",
        layers=[2, 0],
        rule=FixedRule("gauss", 4),
        baseline="zero",
    )
    alphas, weights = quadrature("gauss", 4)
    for i, layer in enumerate([2, 0]):
        x = run_layers(params, embed(params, one, CONFIG), CONFIG, tap=lambda r, _: r.mlp_hidden)[1][layer]
        F = lambda z: logit_difference_of_one(
            forward(params, one, CONFIG, interventions=sites.replace("mlp_hidden", layer, jnp.ones(T), z))
        )
        expected = x * sum(w * jax.grad(F)(a * x) for a, w in zip(alphas, weights))
        assert _relative_error(result.attributions[i], expected) <= 1e-4, f"layer {layer}"


def test_prompts_of_a_batch_are_attributed_independently():
    params, tokens = _setup()
    valid = np.ones((2, T), bool)
    valid[1, -2:] = False  # right padding: the second prompt is shorter

    # a metric of the last position reads each prompt's own last real token, never its padding
    padded = PromptBatch(np.asarray(tokens), valid, valid.sum(1))
    both = integrated_gradients(params, padded, CONFIG, logit_difference, rule=FixedRule(steps=4), site="attn_out")
    for i in range(2):
        n = int(valid[i].sum())
        alone = integrated_gradients(
            params, tokens[i : i + 1, :n], CONFIG, logit_difference, rule=FixedRule(steps=4), site="attn_out"
        )
        assert_close(both.attributions[:, i, :n], alone.attributions[:, 0], f"prompt {i}", tol=1e-5)
        assert_close(both.gap[:, i], alone.gap[:, 0], f"gap of prompt {i}")
        assert np.all(both.attributions[:, i, n:] == 0), "padding positions must attribute exactly 0"


def test_adaptive_rule_certifies_its_gap_and_its_channels_sum_to_its_positions():
    params, tokens = _setup()
    one = tokens[:1]
    result = integrated_gradients(
        params, one, CONFIG, logit_difference, rule=AdaptiveRule(tolerance=1e-3), site="mlp_out"
    )
    assert result.converged.all() and result.converged.shape == (L, 1)
    assert np.all(np.abs(result.gap) <= result.bound + 1e-6)
    assert np.all(result.bound <= 1e-3 * np.abs(result.f_input[None] - result.f_baseline) + 1e-6)
    np.testing.assert_allclose(result.attributions.sum(-1), result.per_position, atol=1e-5)
    # a fine fixed rule agrees within the certified tolerance
    fine = integrated_gradients(params, one, CONFIG, logit_difference, rule=FixedRule("midpoint", 256), site="mlp_out")
    scale = np.abs(result.f_input[None] - result.f_baseline)[..., None]
    assert np.max(np.abs(fine.per_position - result.per_position) / scale) < 5e-3


def test_under_an_intervention_equals_the_hand_computation_with_it():
    params, tokens = _setup()
    one = tokens[:1]
    ablate = sites.ablate_heads(np.eye(L, CONFIG.num_heads, dtype=np.float32), head_dim=CONFIG.head_dim)
    result = integrated_gradients(
        params, one, CONFIG, logit_difference, rule=FixedRule(steps=4), interventions=ablate, layers=[1]
    )
    x = run_layers(params, embed(params, one, CONFIG), CONFIG, interventions=ablate, tap=lambda r, _: r.out)[1][1]
    b = jnp.broadcast_to(x.mean(axis=1, keepdims=True), x.shape)
    F = lambda z: logit_difference_of_one(
        forward(params, one, CONFIG, interventions=[ablate, sites.replace("resid_post", 1, jnp.ones(T), z)])
    )
    alphas, weights = quadrature("left", 4)
    expected = (x - b) * sum(w * jax.grad(F)(b + a * (x - b)) for a, w in zip(alphas, weights))
    assert _relative_error(result.attributions[0], expected) <= 1e-4


REFUSALS = {
    "a metric of more than one value per prompt": (
        dict(metric=jaxdepth.metric(reads="last")(lambda r: r.logits[:, 0])),
        r"must return one value per prompt, shape \(1,\).*returned shape \(1, 97\)",
    ),
    "an unknown site": (dict(site="mlp_input"), r"unknown site 'mlp_input'"),
    "a layer out of range": (dict(layers=[3]), r"layers must be distinct layer indices in 0..2"),
    "an unknown rule": (dict(rule="simpson"), r"rule must be one of"),
    "a baseline of the wrong shape": (dict(baseline=np.zeros(31)), r"a baseline array must broadcast"),
    # an argmax or an accuracy has a zero gradient: every attribution would be exactly 0
    "an integer metric": (
        dict(metric=jaxdepth.metric(reads="last")(lambda r: jnp.argmax(r.logits[:, 0], axis=-1))),
        r"returns int32 values.*zero gradient",
    ),
    "a boolean metric": (
        dict(metric=jaxdepth.metric(reads="last")(lambda r: r.logits[:, 0, CORRECT] > r.logits[:, 0, WRONG])),
        r"returns bool values: a metric must be floating point",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals(case):
    params, tokens = _setup()
    options, message = REFUSALS[case]
    options = {"metric": logit_difference, "rule": FixedRule(steps=2), **options}
    with pytest.raises(ValueError, match=message):
        integrated_gradients(params, tokens[:1], CONFIG, options.pop("metric"), **options)
    with pytest.raises(ValueError, match="one prompt"):
        integrated_gradients(params, tokens, CONFIG, logit_difference, rule=AdaptiveRule())


RULE_REFUSALS = {
    "a tolerance with a fixed rule": (lambda: rule_of("left", 2, tolerance=0.01), r"tolerance is the adaptive rule's"),
    "a budget with a fixed rule": (lambda: rule_of("gauss", 2, max_evaluations=9), r"max_evaluations is the adaptive"),
    "no steps": (lambda: FixedRule(steps=0), r"steps must be >= 1, got 0"),
    "the adaptive rule's name as a fixed one": (lambda: FixedRule("adaptive"), r"AdaptiveRule\(tolerance="),
    "a tolerance of 0": (lambda: AdaptiveRule(tolerance=0.0), r"tolerance must be > 0, got 0.0"),
    "a negative tolerance of a layer": (lambda: AdaptiveRule(tolerance=[0.1, -1]), r"tolerance must be > 0"),
    "a budget below one Simpson interval": (lambda: AdaptiveRule(max_evaluations=2), r"max_evaluations must be >= 3"),
    "a grid of one point": (lambda: AdaptiveRule(grid_points=1), r"grid_points must be 0 \(no grid\) or >= 2"),
}


@pytest.mark.parametrize("case", list(RULE_REFUSALS))
def test_a_rule_refuses_what_it_does_not_take(case):
    make, message = RULE_REFUSALS[case]
    with pytest.raises(ValueError, match=message):
        make()


def test_a_number_or_a_tolerance_per_layer_of_other_layers_is_refused_as_a_rule():
    params, tokens = _setup()
    with pytest.raises(TypeError, match=r"FixedRule\(steps=8\) or AdaptiveRule\(max_evaluations=8\)"):
        integrated_gradients(params, tokens, CONFIG, logit_difference, rule=8)
    with pytest.raises(TypeError, match="steps must be an integer"):
        FixedRule(steps=8.0)
    with pytest.raises(ValueError, match="tolerance has 2 values, one per layer, for 3 attributed layers"):
        integrated_gradients(params, tokens[:1], CONFIG, logit_difference, rule=AdaptiveRule(tolerance=[1, 1]))


@jaxdepth.metric(reads="all")
def logit_difference_of_all_logits(r):  # every prompt of `_setup` is T real tokens: -1 is the last real one
    return r.logits[:, -1, CORRECT] - r.logits[:, -1, WRONG]


def test_a_metric_of_some_positions_equals_the_metric_of_all_logits():
    """A metric reading 'last' runs the head at that position only: the attributions of the
    metric reading every position's logits."""
    params, tokens = _setup()
    at_last = integrated_gradients(params, tokens, CONFIG, logit_difference, rule=FixedRule(steps=4))
    everywhere = integrated_gradients(params, tokens, CONFIG, logit_difference_of_all_logits, rule=FixedRule(steps=4))
    assert_close(at_last.attributions, everywhere.attributions, "per channel", tol=1e-5)
    assert_close(at_last.f_baseline, everywhere.f_baseline, "F(b)", tol=1e-6)


def test_model_methods_equal_the_functions_and_compile_once_per_shape():
    params, tokens = _setup()
    model = Model(params=params, config=CONFIG, tokenizer=None, source="random")
    skip = sites.keep("delta", np.ones((L, T), np.float32) * (np.arange(L) != 1)[:, None])
    assert_close(
        model.logits(tokens, interventions=skip), forward(params, tokens, CONFIG, interventions=skip), "logits"
    )
    h, tapped = model.run(tokens, tap=tap_mlp_norm, interventions=skip)
    ref_h, ref_t = run_layers(params, embed(params, tokens, CONFIG), CONFIG, interventions=skip, tap=tap_mlp_norm)
    assert_close(h, ref_h, "h_L")
    assert_close(tapped, ref_t, "tap")
    from jaxdepth.lab.loaded_model import _jit_forward

    before = _jit_forward._cache_size()
    for factor in (0.0, 0.5, 2.0):  # a new intervention value compiles nothing new
        model.logits(tokens, interventions=sites.keep("delta", factor * np.ones((L, T), np.float32)))
    assert _jit_forward._cache_size() == before
    g = model.site_gradients(tokens[:1], logit_difference, ("resid_pre", "mlp_out"))
    assert g.gradients["resid_pre"].shape == (L + 1, 1, T, CONFIG.hidden_size)
    from jaxdepth.analyses.attribution import site_gradients

    direct = site_gradients(params, tokens[:1], CONFIG, logit_difference, ("resid_pre", "mlp_out"))
    assert_close(g.gradients["mlp_out"], direct.gradients["mlp_out"], "Model.site_gradients", tol=1e-6)
    ig = model.integrated_gradients(tokens[:1], Attribution(logit_difference, layers=[0]), rule=FixedRule(steps=2))
    assert ig.per_position.shape == (1, 1, T)


def tap_mlp_norm(record, _):
    return jnp.linalg.norm(record.mlp_out, axis=-1)


# ----------------------------------------------------------------------------- non-finite values

# Twelve layers without q/k/v biases: from h = 0 every layer's output stays 0 and each RMSNorm
# multiplies the gradient by 1/sqrt(eps) = 1000, so a zero baseline at resid_pre of the first
# layers overflows to inf and NaN, as on the embedded model's 30 layers.
DEEP = ModelConfig(
    model_type="llama",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=12,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=1e4,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    qkv_bias=False,
)


@jaxdepth.metric(reads="last")
def answer_log_probability(r):
    return jax.nn.log_softmax(r.logits[:, 0])[:, CORRECT]


@functools.lru_cache(maxsize=None)
def _deep_setup():
    return random_params(DEEP, 0, scale=0.2), np.random.default_rng(0).integers(0, DEEP.vocab_size, (1, 6))


def test_a_zero_baseline_at_the_residual_is_warned_about_and_its_nan_raised():
    params, tokens = _deep_setup()
    with pytest.warns(UserWarning, match=r"baseline='zero'.*1/sqrt\(eps\).*Use baseline='channel_mean'"):
        with pytest.raises(
            jaxdepth.NonFiniteAttributionError,
            match=r"at 'resid_pre' are not finite \(NaN or inf\) at:\n  layer 0, prompt 0: "
            r"the attributions at positions 0",
        ):
            integrated_gradients(
                params,
                tokens,
                DEEP,
                answer_log_probability,
                site="resid_pre",
                layers=[0, 1],
                rule=FixedRule(steps=8),
                baseline="zero",
            )


@pytest.mark.filterwarnings("ignore:integrated gradients at 'resid_pre' with baseline='zero'")
def test_nonfinite_warn_names_every_such_layer_and_returns_the_values():
    params, tokens = _deep_setup()
    with pytest.warns(RuntimeWarning, match=r"layer 0, prompt 0: the attributions at positions 0\n"):
        result = integrated_gradients(
            params,
            tokens,
            DEEP,
            answer_log_probability,
            site="resid_pre",
            layers=[0, 1, 11],
            rule=FixedRule(steps=8),
            baseline="zero",
            execution=Execution(nonfinite="warn"),
        )
    assert not np.all(np.isfinite(result.per_position[0]))
    assert np.all(np.isfinite(result.per_position[2])), "layer 11 has one norm left: finite"


@pytest.mark.filterwarnings("ignore:integrated gradients at 'resid_pre' with baseline='zero'")
def test_the_adaptive_rule_stops_a_layer_at_its_first_nonfinite_evaluation():
    """One round (the initial 23 nodes), not the budget of 2048: converged False, bound NaN."""
    params, tokens = _deep_setup()
    options = dict(site="resid_pre", layers=[0], rule=AdaptiveRule(), baseline="zero")
    with pytest.warns(RuntimeWarning, match=r"layer 0, prompt 0: the attributions"):
        result = integrated_gradients(
            params,
            tokens,
            DEEP,
            answer_log_probability,
            execution=Execution(nonfinite="warn"),
            per_channel=False,
            **options,
        )
    assert result.evaluations[0, 0] <= 23
    assert not result.converged[0, 0] and np.isnan(result.bound[0, 0])
    with pytest.raises(jaxdepth.NonFiniteAttributionError, match=r"layer 0, prompt 0"):
        integrated_gradients(params, tokens, DEEP, answer_log_probability, **options)


def test_a_zero_baseline_inside_the_layer_stays_finite_and_quiet():
    """At attn_out the path's start is h + 0, not a zero residual: no warning, finite values."""
    import warnings

    params, tokens = _deep_setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = integrated_gradients(
            params,
            tokens,
            DEEP,
            answer_log_probability,
            site="attn_out",
            layers=[0],
            rule=FixedRule(steps=8),
            baseline="zero",
        )
    assert np.all(np.isfinite(result.per_position))


@pytest.mark.parametrize("site, rule", [("resid_post", "left"), ("mlp_out", "gauss"), ("head_out", "adaptive")])
def test_a_stored_backward_gives_the_recomputed_attributions(site, rule):
    """Keeping the later layers' activations instead of recomputing them changes no number
    beyond float32 rounding, for a residual site, a site inside the layer and the adaptive rule."""
    params, tokens = _setup()
    tokens = tokens[:1] if rule == "adaptive" else tokens
    options = dict(
        site=site, layers=[0, 2], rule=AdaptiveRule(tolerance=0.05) if rule == "adaptive" else FixedRule(rule, 8)
    )
    metric = logit_difference
    recomputed = integrated_gradients(
        params, tokens, CONFIG, metric, execution=Execution(backward="recompute"), **options
    )
    stored = integrated_gradients(params, tokens, CONFIG, metric, execution=Execution(backward="stored"), **options)
    partly = integrated_gradients(  # the last layer kept: layer 0's path crosses both kinds
        params, tokens, CONFIG, metric, execution=Execution(backward=1), **options
    )
    for other in (stored, partly):
        np.testing.assert_array_equal(other.evaluations, recomputed.evaluations)
        assert_close(other.per_position, recomputed.per_position, "per position", tol=1e-5)
        assert_close(other.attributions, recomputed.attributions, "per channel", tol=1e-5)
        assert_close(other.f_baseline, recomputed.f_baseline, "F(b)", tol=1e-6)
    with pytest.raises(ValueError, match=r"backward must be one of \('auto', 'recompute', 'stored'\) or a number"):
        integrated_gradients(params, tokens, CONFIG, metric, execution=Execution(backward="kept"), **options)
    with pytest.raises(ValueError, match=rf"stored layers in 0\.\.{CONFIG.num_layers}"):
        integrated_gradients(
            params, tokens, CONFIG, metric, execution=Execution(backward=CONFIG.num_layers + 1), **options
        )


def _scale(value, layer, factor):
    return value * factor


def test_a_stored_backward_takes_an_intervention_with_python_scalar_data():
    """A Python float in an intervention is weakly typed in the kept activations; the stored
    backward accepts it and agrees with the recomputing one."""
    params, tokens = _setup()
    halve = sites.Intervention("attn_out", _scale, 0.5)
    options = dict(site="resid_post", layers=[0], rule=FixedRule(steps=4), interventions=(halve,))
    stored = integrated_gradients(
        params, tokens, CONFIG, logit_difference, execution=Execution(backward="stored"), **options
    )
    recomputed = integrated_gradients(
        params, tokens, CONFIG, logit_difference, execution=Execution(backward="recompute"), **options
    )
    assert_close(stored.per_position, recomputed.per_position, "per position", tol=1e-5)


def test_auto_stores_the_activations_whenever_one_stored_gradient_fits(monkeypatch):
    """'auto' keeps the later layers' activations when one stored gradient fits in the budget
    (the chunk shrinks first), and recomputes them only when not even one does; without a
    budget it takes `IG_MEMORY_FRACTION` of the free memory; a concrete choice is passed
    through."""
    T = 64
    one = member_bytes(CONFIG, T, grad=True, stored=True)
    assert choose_backward("auto", CONFIG, T, memory_budget=one) == "stored"
    partial = member_bytes(CONFIG, T, grad=True, stored=1)  # the last layer's matmul outputs kept
    assert choose_backward("auto", CONFIG, T, memory_budget=one - 1) == CONFIG.num_layers - 1
    assert choose_backward("auto", CONFIG, T, memory_budget=partial) == 1
    assert choose_backward("auto", CONFIG, T, memory_budget=partial - 1) == "recompute"
    assert auto_chunk_size(CONFIG, T, 256, grad=True, stored=True, memory_budget=one) == 1
    assert choose_backward("recompute", CONFIG, T, memory_budget=10**15) == "recompute"
    assert choose_backward("stored", CONFIG, T, memory_budget=1) == "stored"
    monkeypatch.setattr(ig_path, "available_memory_budget", lambda fraction: int(fraction * 10**9))
    assert ig_memory_budget() == int(IG_MEMORY_FRACTION * 10**9) and ig_memory_budget(123) == 123


@jaxdepth.metric(reads="last", clean=True)
def logit_difference_change(r):  # F(run) - F(clean): 0 at the input, the clean run of integrated gradients
    return (r.logits[:, 0, CORRECT] - r.logits[:, 0, WRONG]) - (r.clean[:, 0, CORRECT] - r.clean[:, 0, WRONG])


def test_a_clean_run_metric_is_given_the_input_as_its_clean_run():
    """A metric with clean=True reads F(x)'s logits as the clean ones: it is 0 at the input, and
    its attributions are those of the metric without the constant."""
    params, tokens = _setup()
    change = integrated_gradients(params, tokens, CONFIG, logit_difference_change, rule=FixedRule(steps=4), layers=[1])
    plain = integrated_gradients(params, tokens, CONFIG, logit_difference, rule=FixedRule(steps=4), layers=[1])
    np.testing.assert_array_equal(change.f_input, np.zeros(2, np.float32))
    assert_close(change.attributions, plain.attributions, "per channel", tol=1e-5)
    assert_close(change.f_baseline, plain.f_baseline - plain.f_input[None], "F(b) - F(x)", tol=1e-5)


def test_the_former_forms_are_refused_with_the_new_ones():
    """A plain function of the logits, loose keywords of what is attributed or of how it runs,
    and a metric of answers where the prompts have none: each refused with what says the same."""
    params, tokens = _setup()
    with pytest.raises(TypeError, match=r"(?s)is a plain function; a metric is now one form.*reads='last'"):
        jaxdepth.integrated_gradients(params, tokens, CONFIG, logit_difference_of_one, rule=FixedRule(steps=2))
    with pytest.raises(TypeError, match=r"Attribution\(metric, site='head_out', layers=\[0\]\)"):
        jaxdepth.integrated_gradients(params, tokens, CONFIG, logit_difference, site="head_out", layers=[0])
    with pytest.raises(TypeError, match=r"execution=jaxdepth.Execution\(chunk_size=2, progress=True\)"):
        jaxdepth.integrated_gradients(params, tokens, CONFIG, logit_difference, chunk_size=2, progress=True)
    with pytest.raises(ValueError, match="integrated gradients knows no answer positions"):
        jaxdepth.integrated_gradients(params, tokens, CONFIG, jaxdepth.metrics.answer_probability)


def test_a_chunk_size_changes_nothing_but_the_chunking():
    """`Execution(chunk_size=...)` reaches the gradient sweep (one compilation per chunk) and
    changes no number beyond float32 rounding."""
    params, tokens = _setup()
    options = dict(rule=FixedRule(steps=6), site="mlp_out", layers=[0, 2])
    whole = integrated_gradients(params, tokens, CONFIG, logit_difference, **options)
    before = ig_path.weighted_gradient._cache_size()
    chunked = integrated_gradients(
        params, tokens, CONFIG, logit_difference, execution=Execution(chunk_size=4), **options
    )
    assert ig_path.weighted_gradient._cache_size() == before + 1  # chunk 4 is a program of its own
    assert_close(chunked.attributions, whole.attributions, "per channel", tol=1e-6)
    assert_close(chunked.f_baseline, whole.f_baseline, "F(b)", tol=1e-6)


def test_the_public_form_with_the_answer_probability_is_the_studies_integrated_gradients():
    """`jaxdepth.integrated_gradients` of `jaxdepth.metrics.answer_probability` on a prompt with
    its answer span (`PromptArrays`) is the studies' IG of that prompt, to the bit."""
    from jaxdepth.analyses.integrated_gradients import ig_of_prompt
    from jaxdepth.core.batch import make_batch

    params, tokens = _setup()
    prompt = make_batch([np.asarray(tokens[0]).tolist()], [5]).prompt(0)
    what = Attribution(jaxdepth.metrics.answer_probability, site="mlp_out", per_channel=False)
    public = jaxdepth.integrated_gradients(params, prompt, CONFIG, what, rule=FixedRule(steps=4))
    study = ig_of_prompt(params, prompt, CONFIG, rule=FixedRule(steps=4), target="mlp")
    np.testing.assert_array_equal(public.per_position, study.per_position)
    np.testing.assert_array_equal(public.f_input, study.f_input)
    np.testing.assert_array_equal(public.f_baseline, study.f_baseline)
    assert public.attributions is None and float(public.f_input[0]) > 0
