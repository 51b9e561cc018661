"""Every analysis on a tiny random model of every family beside Qwen and Llama (whose own tests
are in the other modules): each sweep equals the same interventions run one at a time, the lens
at the last boundary is the model, the NNX module is the pure forward, layer orders (dropped,
swapped, repeated layers) are the reordered layers run by hand, and a sliding window is
honoured by every path that runs attention (a window of 6 positions, shorter than the prompts).
The configs are read from each family's Hugging Face config (`conftest.FAMILY_VARIANTS`)."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FAMILY_VARIANTS, assert_close, tiny_hf_config
from jaxdepth.analyses import contributions, erasure, layer_skip, logit_lens
from jaxdepth.analyses import integrated_gradients as ig
from jaxdepth.analyses.edges.atp_star import atp_star
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import logit_difference, prompt_pairs
from jaxdepth.analyses.edges.patching import circuit_metric
from jaxdepth.analyses.edges.scores import edge_attribution
from jaxdepth.analyses.ig import Execution, FixedRule
from jaxdepth.analyses.ig.rules import quadrature
from jaxdepth.analyses.decision_depth import decision_depth
from jaxdepth.analyses.geometry import geometry
from jaxdepth.analyses.jacobians import Estimate, clean_layer_states, layer_jacobians
from jaxdepth.analyses.layer_skip import SUBLAYERS
from jaxdepth.core import sites
from jaxdepth.core.batch import make_batch
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.loops import LayerRun, clean_key_values, clean_prefix, run_grouped_orders, run_layer, run_layers
from jaxdepth.core.layer import empty_shared_kv, shared_kv_at
from jaxdepth.core.model import embed, forward, random_params, residual_stream, token_per_layer_inputs, unembed
from jaxdepth.core.module import Decoder
from jaxdepth.core.structure import (
    LayerOrder,
    describe_order,
    drop_block,
    group_orders,
    identity_order,
    repeat_block,
    stack_orders,
    swap_pair,
)

pytestmark = pytest.mark.usefixtures("highest_precision")

# longrope: the two prompts straddle its original context; Gemma 4 with per-layer inputs, layers
# reusing earlier layers' keys and values, full-attention layers of their own shapes
FAMILIES = sorted([*FAMILY_VARIANTS, "phi3_longrope", "qwen3_5_hybrid", "gemma4_shared_kv"])
WINDOW = 6


def family_config(name: str) -> ModelConfig:
    hf_config, _ = tiny_hf_config(name)
    config = ModelConfig.from_hf(hf_config.to_dict())
    return dataclasses.replace(config, sliding_window=WINDOW) if any(config.sliding_layers) else config


def family_params(config: ModelConfig):
    """The family's random weights. Gemma 4's attention scores are unscaled (`attn_scale` 1):
    with q/k norm weights near 1 its softmax is so sharp that float32 alone moves a suffix run's
    h_L by 6e-5; those weights halved (as `conftest._narrow_gemma4_scores` does for its GGUF
    model), the scores quartered."""
    params = random_params(config, 1, scale=0.15)
    if config.model_type.startswith("gemma4"):
        scale = lambda name: 0.5 if name.endswith(("q_norm", "k_norm")) else 1.0  # noqa: E731
        params["layers"] = {name: w * scale(name) for name, w in params["layers"].items()}
    return params


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    config = family_config(request.param)
    yield config, family_params(config)
    # A family's compiled programs dropped when the next family starts: this module compiles
    # thousands, and past the kernel's memory maps per process XLA's next compilation crashes
    # the worker (`conftest._release_compiled_programs`, which clears only at a module's end).
    jax.clear_caches()


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    return make_batch([rng.integers(0, 300, 30).tolist(), rng.integers(0, 300, 23).tolist()], [20, 15])


@partial(jax.jit, static_argnums=1)
def _jit_probs(params, config, tokens, valid, interventions):
    return jax.nn.softmax(forward(params, tokens, config, valid=valid, interventions=interventions), -1)


@partial(jax.jit, static_argnums=1)
def _jit_deltas(params, config, tokens, valid, interventions):
    h0, extra = embed(params, tokens, config), token_per_layer_inputs(params, tokens, config)
    tap = lambda r, _: r.delta  # noqa: E731
    return run_layers(params, h0, config, valid=valid, interventions=interventions, tap=tap, per_layer_inputs=extra)[1]


def _probs(params, config, tokens, valid, interventions=None):
    return np.asarray(_jit_probs(params, config, tokens, valid, interventions))


def _deltas(params, config, tokens, valid, interventions=None):
    return np.asarray(_jit_deltas(params, config, tokens, valid, interventions))


def test_the_configs_switch_their_families_features_on():
    on = {name: family_config(name) for name in FAMILIES}
    assert on["mistral_window"].sliding_layers == (True, True)
    assert on["gemma2_softcapped"].sliding_layers == (True, False, True) and on["gemma2_softcapped"].attn_softcap == 3.0
    assert on["gemma3_local_rope"].local_rope_theta == 999.0 and on["gemma3_local_rope"].rope_type == "linear"
    assert on["olmo2_post_norm"].qk_norm_scope == "projection" and not on["olmo2_post_norm"].pre_norms
    assert on["phi3_partial_rotary"].rotated_dims == on["phi3_partial_rotary"].head_dim // 2
    assert on["gpt2"].positions == "learned" and on["gpt2"].norm == "layer"
    assert on["pythia_parallel"].parallel_residual and not on["neox_sequential"].parallel_residual
    longrope = on["phi3_longrope"]  # the batch's prompts (30 and 23 tokens) take its long and its short factors
    assert longrope.rope_type == "longrope" and 23 <= longrope.rope_original_max_position < 30


def test_the_module_is_the_pure_forward_and_the_lens_ends_at_the_model(family, batch):
    params, config = family[1], family[0]
    tokens, valid = jnp.asarray(batch.tokens), jnp.asarray(batch.valid)
    logits = forward(params, tokens, config, valid=valid)
    np.testing.assert_array_equal(Decoder(params, config)(tokens, valid=valid), logits)
    hs = residual_stream(params, tokens, config, valid=valid)
    np.testing.assert_array_equal(unembed(params, hs[-1], config), logits)  # the family's norm and soft-cap
    lens = logit_lens.logit_lens(params, batch, config)
    assert lens.kl.shape == (config.num_layers,) and np.all(np.isfinite(lens.kl)) and np.all(lens.kl >= -1e-6)


def test_the_sites_mean_what_they_mean_in_every_family(family, batch):
    """a and m are what the residual receives, delta their sum, mlp_in what the MLP's norm reads;
    the contributions are read from them."""
    config, params = family
    tokens, valid = jnp.asarray(batch.tokens), jnp.asarray(batch.valid)
    tap = lambda r, _: (r.h, r.attn, r.mlp, r.delta, r.mlp_in, r.out, r.per_layer)  # noqa: E731
    extra = token_per_layer_inputs(params, tokens, config)
    h0 = embed(params, tokens, config)
    h, a, m, delta, mlp_in, out, e = run_layers(params, h0, config, valid=valid, tap=tap, per_layer_inputs=extra)[1]
    # (equal up to float32 rounding: XLA may fuse the sums of the layer and of the test apart)
    if config.layer_scalar:  # Gemma 4: out = s (h + a + m + e), e what the per-layer inputs add
        s = np.asarray(params["layers"]["layer_scalar"]).reshape(-1, 1, 1, 1)
        added = a + m + (0 if e is None else e)
        np.testing.assert_allclose(delta, (s - 1) * h + s * added, rtol=1e-6, atol=1e-6)
        assert np.abs(s - 1).max() > 1e-2 and np.abs(np.asarray(delta - (a + m))).max() > 1e-2  # the check has teeth
    else:
        np.testing.assert_allclose(delta, a + m, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out, h + delta, rtol=1e-6, atol=1e-6)
    if config.parallel_residual:
        np.testing.assert_array_equal(mlp_in, h)  # the MLP reads the layer's input itself
    else:
        np.testing.assert_allclose(mlp_in, h + a, rtol=1e-6, atol=1e-6)
        assert np.abs(a).max() > 1e-2  # so that h + a is not h
    stats = contributions.contributions(params, batch, config)
    assert stats.num_tokens == int(batch.valid.sum())
    for name in contributions.STATISTICS:
        curve = getattr(stats, name)
        assert curve.shape == (config.num_layers,) and np.all(np.isfinite(curve)), name


def test_a_layer_split_per_head_is_the_layer(family, batch):
    """Per-head inputs (the split sites of edges and head patching) change nothing by themselves,
    OLMo 2's q/k norms over the whole projection included."""
    config, params = family
    tokens, valid = jnp.asarray(batch.tokens), jnp.asarray(batch.valid)
    if config.shared_kv_layers:  # Gemma 4's heads of two shapes and shared keys: refused by name
        with pytest.raises(ValueError, match="split per head is not implemented.*Gemma 4"):
            forward(params, tokens, config, valid=valid, interventions=sites.unchanged("q_in"))
        return
    plain = forward(params, tokens, config, valid=valid)
    for site in ("q_in", "k_in", "head_result"):
        split = forward(params, tokens, config, valid=valid, interventions=sites.unchanged(site))
        np.testing.assert_allclose(split, plain, rtol=1e-5, atol=1e-5, err_msg=site)


def test_a_suffix_run_from_clean_keys_and_values_equals_the_full_forward(family, batch):
    """The prefix path of every suffix run (edges, the tuned lens): the window counts positions
    of the prefix too."""
    config, params = family
    tokens, valid = jnp.asarray(batch.tokens), jnp.asarray(batch.valid)
    hs = residual_stream(params, tokens, config, valid=valid)
    P = 11
    prefix = clean_prefix(params, hs, P, config, valid=valid)
    extra = token_per_layer_inputs(params, tokens, config)
    rows = lambda first: None if extra is None else extra[:, first:]  # noqa: E731  (the run's rows' own)
    if not config.mixed_mixers:  # the keys and values of every position, cut at P
        keys, values = clean_key_values(params, hs, config, valid=valid)
        np.testing.assert_array_equal(prefix[0], keys[:, :, :P])
        np.testing.assert_array_equal(prefix[1], values[:, :, :P])
    h, _ = run_layers(params, hs[0][:, P:], config, valid=valid, run=LayerRun(prefix=prefix), per_layer_inputs=rows(P))
    np.testing.assert_allclose(h, hs[-1][:, P:], rtol=1e-5, atol=1e-5)
    if config.shared_kv_layers:  # from a later boundary too: the layers after it read the clean run's shared keys
        l = 2
        shared = shared_kv_at((keys, values), l, config)
        later = LayerRun(start=l, prefix=prefix, shared_kv=shared)
        h, _ = run_layers(params, hs[l][:, P:], config, valid=valid, run=later, per_layer_inputs=rows(P))
        np.testing.assert_allclose(h, hs[-1][:, P:], rtol=1e-5, atol=1e-5)


def test_a_layer_jacobian_is_the_own_block_of_the_full_run(family, batch):
    """A token's step through one layer (`jaxdepth.core.loops.token_step`) is the forward at that token in
    every family (the window, longrope's factors per prompt, the post-norms), and the exact
    Jacobians of one layer and of the suffix to h_L equal the full run's derivatives."""
    config, params = family
    valid = jnp.asarray(batch.valid)
    tokens = jnp.asarray(batch.tokens)
    inputs, keys, values = clean_layer_states(params, tokens, valid, config)
    extra = token_per_layer_inputs(params, tokens, config)
    result = layer_jacobians(
        params, batch, config, positions=[[12], [22]], estimate=Estimate(exact_width=config.hidden_size)
    )

    @jax.jit
    def own_blocks(l, b, t):  # one compilation: the layer, prompt and position traced
        row = lambda a: jax.lax.dynamic_slice_in_dim(a, b, 1)  # noqa: E731

        # Gemma 4: the prompt's per-layer inputs, the keys shared at boundary l in the clean run
        kv = tuple(jax.lax.dynamic_slice_in_dim(a, b, 1, axis=1) for a in (keys, values))
        run = LayerRun(start=l, shared_kv=shared_kv_at(kv, l, config))
        options = dict(valid=row(valid), run=run, per_layer_inputs=None if extra is None else row(extra))

        def from_l(x):
            h = row(inputs[l]).at[0, t].set(x)
            final, outs = run_layers(params, h, config, tap=lambda r, _: r.out, **options)
            return outs[l, 0, t], final[0, t]

        return jax.jacfwd(from_l)(inputs[l, b, t])

    eye = jnp.eye(config.hidden_size)
    for b, t in ((0, 12), (1, 22)):
        for l in (0, config.num_layers - 1):
            for which, J in zip(("layer", "suffix"), own_blocks(l, b, t)):
                np.testing.assert_allclose(
                    getattr(result, f"{which}_frob2")[b, 0, l], jnp.sum((J - eye) ** 2), rtol=1e-4, err_msg=which
                )


def test_the_geometry_and_the_decision_depth_of_each_prompt_alone(family, batch):
    """The sink scores (the window and the post-norms change what heads attend to) and the
    boundaries' geometry of a padded batch equal each prompt's alone; the decision depth is the
    first boundary from which the lens's top-1 stays the model's, counted by hand."""
    config, params = family
    together = geometry(params, batch, config)
    top1 = np.argmax(
        np.stack(
            [unembed(params, h, config) for h in residual_stream(params, batch.tokens, config, valid=batch.valid)]
        ),
        axis=-1,
    )
    depths = decision_depth(params, batch, config).depth
    for i in range(len(batch)):
        alone = geometry(params, batch.single(i), config)
        np.testing.assert_allclose(alone.sink_scores[0], together.sink_scores[i], atol=2e-6)
        np.testing.assert_allclose(alone.entropy[0], together.entropy[i], atol=2e-5)
        np.testing.assert_allclose(alone.first_norm_ratio[0], together.first_norm_ratio[i], rtol=1e-5)
        for t in range(int(batch.lengths[i])):
            agrees = top1[:, i, t] == top1[-1, i, t]
            assert depths[i, t] == min(l for l in range(len(agrees)) if agrees[l:].all())


def test_layer_skip_sweep_equals_one_at_a_time(family, batch):
    config, params = family
    result = layer_skip.layer_skip(params, batch, config, layer_skip.Skip(sublayer="layer"))
    one = batch.single(0)
    tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
    T, length, L = one.tokens.shape[1], int(one.lengths[0]), config.num_layers
    pos = np.arange(T)
    d_clean = _deltas(params, config, tokens, valid)
    for s in range(L):
        for split in [t for t in result.split_positions[0] if t >= 0][:2]:
            iv = sites.skip(SUBLAYERS["layer"], s, ((pos >= 1) & (pos < split)).astype(np.float32))
            d_skip = _deltas(params, config, tokens, valid, iv)
            ratio = np.linalg.norm(d_clean - d_skip, axis=-1) / np.maximum(np.linalg.norm(d_clean, axis=-1), 1e-6)
            future = (pos >= split) & (pos < length)
            later = np.where(np.arange(L) > s, ratio[:, 0, future].max(-1), 0)
            assert np.all(result.later_per_prompt[0][s] >= later - 2e-5)
    assert np.all(np.isfinite(result.later)) and np.any(result.later > 0)


def test_erasure_sweep_equals_one_at_a_time(family, batch):
    config, params = family
    baseline = erasure.mean_residuals(params, batch, config)
    result = erasure.residual_erasure(params, batch, config, baseline, erasure.Erasure(blocks=3))
    one = batch.single(1)
    tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
    clean = _probs(params, config, tokens, valid)
    answer = one.answer_prediction_mask()[0]
    for layer in range(config.num_layers + 1):
        for t in (0, 4, 9, 14):
            iv = sites.replace("resid_pre", layer, np.arange(one.tokens.shape[1]) == t, baseline[layer])
            diff = np.linalg.norm(_probs(params, config, tokens, valid, iv) - clean, axis=-1)[0]
            assert result.effects[1, layer, t] == pytest.approx(diff[answer].max(), abs=2e-6)


def test_integrated_gradients_equal_one_at_a_time(family, batch):
    config, params = family
    steps = 3
    one = batch.single(1)
    result = ig.integrated_gradients_of_answers(
        params,
        batch.select(slice(1, 2)),
        config,
        rule=FixedRule("midpoint", steps),
        execution=Execution(progress=False),
    )
    tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
    answer = jnp.asarray(one.answer_prediction_mask()[0])
    T = tokens.shape[1]
    target = jnp.concatenate([tokens[0, 1:], tokens[0, -1:]])

    def objective(z, layer):
        iv = sites.replace("resid_pre", layer + 1, jnp.ones(T, jnp.float32), z)
        p = jax.nn.softmax(forward(params, tokens, config, valid=valid, interventions=iv), -1)[0]
        return jnp.sum(jnp.where(answer, p[jnp.arange(T), target], 0.0))

    grad = jax.jit(jax.grad(objective))  # the layer traced: one compilation for all
    hs = residual_stream(params, tokens, config, valid=valid)
    alphas, weights = quadrature("midpoint", steps)
    for layer in range(config.num_layers):
        x = np.asarray(hs[layer + 1])
        v = one.valid[0][:, None]
        b = (x[0] * v).sum(0, keepdims=True) / v.sum()
        mean_grad = sum(w * np.asarray(grad(b + a * (x - b), layer)) for a, w in zip(alphas, weights))[0]
        expected = np.sum((x[0] - b) * mean_grad, -1) * one.valid[0]
        np.testing.assert_allclose(result.attributions[0, layer, : len(expected)], expected, atol=2e-6)


def test_layer_orders_equal_the_reordered_layers_run_by_hand(family, batch):
    """Orders run as data, a vmapped stack of them and layer-major (`run_grouped_orders`), are
    each order's layers called one at a time by their original index, in every family: a swapped
    layer keeps its own kind (Qwen3-MoE's and DeepSeek-V3's dense layer 0 among sparse ones), its
    own window (Gemma's, GPT-OSS's sliding layers), its own rotary (SmolLM3's layer 1 without).
    The by-hand layers read their index as a Python int (their kind, window and rotary chosen
    while tracing), the vmapped stack as a traced one (chosen inside the program)."""
    config, params = family
    L = config.num_layers
    orders = [identity_order(L), drop_block(L, 0, 1), swap_pair(L, 0), repeat_block(L, L - 1, 1)]
    steps = [[int(i) for i in np.asarray(o.layers)[:, 0]] for o in orders]  # one layer per step
    stacked = stack_orders(orders)
    plan = group_orders(stacked, L)
    tokens, valid = jnp.asarray(batch.tokens), jnp.asarray(batch.valid)

    extra = dict(valid=valid, per_layer_inputs=token_per_layer_inputs(params, tokens, config))
    if config.shared_kv_layers:
        # layer-major orders take no per-layer inputs nor shared keys: refused by name
        with pytest.raises(ValueError, match="per-layer inputs"):
            run_grouped_orders(params, embed(params, tokens, config), config, plan, valid=valid)
        plan = None

    @jax.jit
    def as_data(params, order):  # one program: the plain forward and the orders run as data
        h0 = embed(params, tokens, config)
        plain = run_layers(params, h0, config, **extra)[0]
        intact = run_layers(params, h0, config, run=LayerRun(order=identity_order(L)), **extra)[0]
        stack = jax.vmap(lambda o: run_layers(params, h0, config, run=LayerRun(order=o), **extra)[0])(order)
        grouped = None if plan is None else run_grouped_orders(params, h0, config, plan, valid=valid)[0]
        return plain, intact, stack, grouped

    @jax.jit
    def by_hand(params):
        # one run_layer call per step; a prefix two orders share is run once (the repeat is the
        # intact run and one more layer), which keeps the unrolled program small
        # Gemma 4: each layer reads the keys shared by the layers before it in the order (the
        # record's slot after it, as the scan carries it)
        h0 = embed(params, tokens, config)
        runs = {(): (h0, empty_shared_kv(config, *h0.shape[:2], h0.dtype))}
        for layers in steps:
            for n, i in enumerate(layers):
                if tuple(layers[: n + 1]) not in runs:
                    h, shared = runs[tuple(layers[:n])]
                    r = run_layer(params, i, h, config, shared_kv=shared, **extra)
                    runs[tuple(layers[: n + 1])] = (r.out, r.shared_kv)
        return jnp.stack([runs[tuple(layers)][0] for layers in steps])

    plain, intact, stack, grouped = as_data(params, LayerOrder(*map(jnp.asarray, stacked)))
    plain, intact, stack = map(np.asarray, (plain, intact, stack))
    expected = np.asarray(by_hand(params))
    # A scan over traced indices, vmapped, and a program of unrolled layers round float32 apart:
    # by 1e-6 of the residual, or (Gemma 4, its per-layer inputs gating an un-normed residual) as
    # far as twice the identity order's own vmapped member is from its layers run by hand: the
    # same layers, so only the rounding of the batched program moves that one
    tol = max(1e-6 * np.abs(expected).max(), 2 * float(np.abs(stack[0] - expected[0]).max()))
    for c, order in enumerate(orders):
        what = describe_order(order)
        assert_close(stack[c], expected[c], f"vmapped {what}", tol=tol)
        if grouped is not None:
            assert_close(np.asarray(grouped[c]), expected[c], f"layer-major {what}", tol=tol)
    # A step of one layer is that layer's output, so the intact order alone is the plain forward
    # bit for bit. A member of the vmapped stack is not: batched over the orders, it rounds apart
    # from the order alone (by up to 5e-6 in the families with q/k norms: Gemma 3, OLMo 2, OLMoE,
    # Qwen3-MoE, DeepSeek-V3's latents), which the tolerance above covers.
    np.testing.assert_array_equal(intact, plain)
    # the orders change the residual, so that agreeing with the hand-run layers says something
    for c in range(1, len(orders)):
        assert np.abs(expected[c] - expected[0]).max() > 1e-2, describe_order(orders[c])


def _pairs():
    rng = np.random.default_rng(5)
    clean = rng.integers(3, 300, (2, 14))
    corrupt = clean.copy()
    corrupt[:, 6] = (corrupt[:, 6] + 17) % 300
    return prompt_pairs(clean, corrupt, np.array([[1, 2], [2, 1]]))


def test_edges_give_the_clean_and_the_corrupt_run(family):
    """The whole graph is the clean run and the empty circuit the corrupt one, in every family:
    with norms after the sublayers (Gemma 2/3, OLMo 2) a layer's attention is one writer, its
    output after the norm (`tests/analyses/test_edge_post_norms.py`)."""
    config, params = family
    pairs = _pairs()
    if config.shared_kv_layers:  # no writers and readers for Gemma 4's features: refused by name
        with pytest.raises(ValueError, match="edge graph of a model with Gemma 4's per_layer_inputs"):
            edge_attribution(params, pairs, config, logit_difference)
        return
    graph = EdgeGraph.of(config)
    assert graph.attention_writers == (1 if config.post_norms else config.num_heads)
    scores = edge_attribution(params, pairs, config, logit_difference)
    assert np.all(np.isfinite(scores.scores)) and scores.graph == graph
    assert np.max(np.abs(scores.f_clean - scores.f_corrupt)) > 1e-2  # the endpoints differ: the check has teeth
    f = circuit_metric(params, pairs, config, logit_difference, [graph.edge_mask, np.zeros_like(graph.edge_mask)])
    np.testing.assert_allclose(f[0], scores.f_clean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f[1], scores.f_corrupt, rtol=1e-5, atol=1e-5)


def test_atp_star_runs_every_node_kind_of_every_family(family):
    """AtP* reads each family's attention as the layer computes it (GPT-OSS's sinks included:
    `attend` refuses a call without them), a mixture's output as one MLP node and its experts'
    hidden units as its neurons (refused by name among dense layers)."""
    config, params = family
    kinds = ("queries", "keys", "values", "heads", "mlps") + (() if config.mixed_mlps else ("neurons",))
    if config.shared_kv_layers:  # no nodes for Gemma 4's features: refused by name
        with pytest.raises(ValueError, match="edge graph of a model with Gemma 4's per_layer_inputs"):
            atp_star(params, _pairs(), config, logit_difference, kinds=kinds, method="AtP*")
        return
    scores = atp_star(params, _pairs(), config, logit_difference, kinds=kinds, method="AtP*")
    for kind in kinds:
        assert np.all(np.isfinite(scores.of(kind))), kind
    for layer in config.linear_layers:  # a linear layer's value heads: their outputs and inputs
        for kind in ("heads", "keys", "values"):
            assert np.abs(scores.of(kind)[:, layer, : config.linear_value_heads]).max() > 0, (kind, layer)
    if config.mixed_mlps:
        with pytest.raises(ValueError, match="dense layers among its mixtures"):
            atp_star(params, _pairs(), config, logit_difference, kinds=("neurons",))
    # (queries may all be 0: under the 6-token window of these tests no later query sees the change)
    for kind in ("heads", "mlps", "keys", "values"):
        assert kind not in kinds or np.abs(scores.of(kind)).max() > 0, kind
