"""Open intervention sites: a user-defined intervention, head ablation, steering, activation
patching and taps of every site equal an unscanned hand-written reference; stacks vmap; new
values never recompile; integrated gradients run under interventions."""

from __future__ import annotations

import functools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, assert_moved
from jaxdepth.core import compilation, sites
from jaxdepth.core.batch import PromptArrays
from jaxdepth.core.config import ModelConfig
from jaxdepth.analyses.ig.rules import quadrature
from jaxdepth.analyses.ig import FixedRule
from jaxdepth.analyses.integrated_gradients import ig_of_prompt
from jaxdepth.core.layer import attention_heads, attention_mask, mlp_hidden, norm, rotary_tables
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, forward, random_params, residual_stream, unembed

B, T = 2, 10
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
L, H, Dh = CONFIG.num_layers, CONFIG.num_heads, CONFIG.head_dim


# Compare at full float32 matmul precision (as the references compute).
pytestmark = pytest.mark.usefixtures("highest_precision")


@functools.lru_cache(maxsize=None)
def _setup():
    params = random_params(CONFIG, 3, scale=0.2)
    rng = np.random.default_rng(1)
    clean = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (B, T)), jnp.int32)
    corrupted = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (B, T)), jnp.int32)
    return params, clean, corrupted


@partial(jax.jit, static_argnames="edits")
def reference(params, tokens, edits=()):
    """Plain unscanned forward; `edits` maps (layer, site) -> a function of the value (hashable
    tuple of pairs), applied where the layer computes that site; (L, 'resid_pre') edits the
    final residual h_L."""
    edits = dict(edits)
    cos, sin = rotary_tables(T, CONFIG)
    mask = attention_mask(jnp.ones((B, T), bool))
    h = embed(params, tokens, CONFIG)
    for l in range(L):
        p = {name: w[l] for name, w in params["layers"].items()}
        edit = lambda site, v: edits[(l, site)](v) if (l, site) in edits else v
        h = edit("resid_pre", h)
        heads = edit("head_out", attention_heads(p, norm(h, p["attn_norm"], CONFIG), cos, sin, mask, CONFIG)[-1])
        a = edit("attn_out", heads.reshape(B, T, H * Dh) @ p["o"])
        hidden = edit("mlp_hidden", mlp_hidden(p, norm(edit("mlp_in", h + a), p["mlp_norm"], CONFIG), CONFIG))
        m = edit("mlp_out", hidden @ p["down"])
        h = edit("resid_post", h + edit("delta", a + m))
    if (L, "resid_pre") in edits:
        h = edits[(L, "resid_pre")](h)
    return unembed(params, h, CONFIG)


@partial(jax.jit, static_argnames=())
def run(params, tokens, interventions):
    return forward(params, tokens, CONFIG, interventions=interventions)


# A kind of intervention the package does not have, written as a user would: scale the MLP's
# hidden activations of one layer by a factor (both in `data`).
def scale_hidden(value, layer, data):
    return value * jnp.where(layer == data["layer"], data["factor"], 1.0)


def test_an_edit_of_the_mlp_input_changes_what_the_mlp_reads_not_the_residual():
    params, tokens, _ = _setup()
    vector = jax.random.normal(jax.random.key(5), (CONFIG.hidden_size,))
    ours = run(params, tokens, sites.add("mlp_in", 1, vector, np.ones(T)))
    assert_close(ours, reference(params, tokens, (((1, "mlp_in"), lambda v: v + vector),)), "mlp_in")
    assert_moved(ours, reference(params, tokens), "mlp_in")


def test_user_defined_intervention_equals_the_reference():
    params, tokens, _ = _setup()
    iv = sites.Intervention("mlp_hidden", scale_hidden, {"layer": jnp.int32(1), "factor": jnp.float32(-2.0)})
    ours = run(params, tokens, iv)
    assert_close(ours, reference(params, tokens, (((1, "mlp_hidden"), lambda v: -2.0 * v),)), "scaled hidden")
    assert_moved(ours, reference(params, tokens), "scaled hidden")


def test_a_stack_vmaps_and_new_values_never_recompile():
    params, tokens, _ = _setup()
    traces = []

    @jax.jit
    def counted(params, tokens, iv):
        traces.append(1)  # runs only while tracing
        return forward(params, tokens, CONFIG, interventions=iv)

    members = [(layer, factor) for layer in range(L) for factor in (0.0, 3.0)]
    for layer, factor in members:
        counted(
            params,
            tokens,
            sites.Intervention("mlp_hidden", scale_hidden, {"layer": jnp.int32(layer), "factor": jnp.float32(factor)}),
        )
    assert len(traces) == 1, f"traced {len(traces)} times for {len(members)} intervention values"
    stack = sites.Intervention(
        "mlp_hidden",
        scale_hidden,
        {
            "layer": jnp.array([m[0] for m in members], jnp.int32),
            "factor": jnp.array([m[1] for m in members], jnp.float32),
        },
    )
    batched = jax.jit(jax.vmap(lambda iv: forward(params, tokens, CONFIG, interventions=iv)))(stack)
    for i, (layer, factor) in enumerate(members):
        one = reference(params, tokens, (((layer, "mlp_hidden"), lambda v, f=factor: f * v),))
        assert_close(batched[i], one, f"member {i}")


def test_head_ablation_equals_zeroing_that_head():
    params, tokens, _ = _setup()
    heads = np.zeros((L, H), np.float32)
    heads[2, 1] = heads[0, 3] = 1.0
    ours = run(params, tokens, sites.ablate_heads(heads, head_dim=Dh))
    zero = lambda h: lambda v: v.at[:, :, h].set(0.0)
    expected = reference(params, tokens, (((0, "head_out"), zero(3)), ((2, "head_out"), zero(1))))
    assert_close(ours, expected, "zero ablation")
    assert_moved(ours, reference(params, tokens), "zero ablation")
    means = jax.random.normal(jax.random.key(0), (L, H, Dh))
    ours = run(params, tokens, sites.ablate_heads(heads, means))
    mean = lambda l, h: lambda v: v.at[:, :, h].set(means[l, h])
    assert_close(
        ours, reference(params, tokens, (((0, "head_out"), mean(0, 3)), ((2, "head_out"), mean(2, 1)))), "mean ablation"
    )


def test_several_layers_and_sites_in_one_forward():
    params, tokens, _ = _setup()
    vector = jax.random.normal(jax.random.key(1), (CONFIG.hidden_size,))
    positions = np.zeros(T, np.float32)
    positions[[2, 5]] = 1.0
    ivs = [
        sites.add("resid_pre", 0, vector, positions),
        sites.add("resid_pre", 2, -vector, positions),
        sites.keep("attn_out", np.stack([np.ones(T), 1 - positions, np.ones(T)]).astype(np.float32)),
    ]
    steer = lambda s: lambda v: v + s * positions[None, :, None] * vector
    expected = reference(
        params,
        tokens,
        (
            ((0, "resid_pre"), steer(1.0)),
            ((2, "resid_pre"), steer(-1.0)),
            ((1, "attn_out"), lambda v: v * (1 - positions)[None, :, None]),
        ),
    )
    assert_close(run(params, tokens, ivs), expected, "two boundaries and a sublayer")


def test_activation_patching_of_every_layer_and_head_in_one_vmapped_call():
    params, clean, corrupted = _setup()
    _, cached = run_layers(params, embed(params, corrupted, CONFIG), CONFIG, tap=lambda r, _: r.head_out)
    assert cached.shape == (L, B, T, H, Dh)
    pairs = [(l, h) for l in range(L) for h in range(H)]
    where = np.zeros((len(pairs), L, 1, 1, H, 1), bool)
    for i, (l, h) in enumerate(pairs):
        where[i, l, :, :, h] = True
    patched = jax.jit(
        jax.vmap(lambda w: forward(params, clean, CONFIG, interventions=sites.patch("head_out", cached, w)))
    )(where)
    for i, (l, h) in enumerate(pairs):
        expected = reference(
            params, clean, (((l, "head_out"), lambda v, l=l, h=h: v.at[:, :, h].set(cached[l, :, :, h])),)
        )
        assert_close(patched[i], expected, f"patched layer {l} head {h}")
    assert_moved(patched[0], reference(params, clean), "patching")


def test_taps_read_every_site():
    params, tokens, _ = _setup()
    _, t = run_layers(
        params,
        embed(params, tokens, CONFIG),
        CONFIG,
        tap=lambda r, _: {
            "q": r.q,
            "k": r.k,
            "v": r.v,
            "probs": r.attn_probs,
            "heads": r.head_out,
            "hidden": r.mlp_hidden,
            "mlp_out": r.mlp_out,
            "attn_out": r.attn_out,
            "pre": r.resid_pre,
            "post": r.resid_post,
        },
    )
    assert t["q"].shape == (L, B, T, H, Dh) and t["k"].shape == t["v"].shape == (L, B, T, CONFIG.num_kv_heads, Dh)
    probs = np.asarray(t["probs"])
    assert probs.shape == (L, B, H, T, T)
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    assert np.all(probs[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0)  # causal: exact zeros
    # The pieces recompose the sublayer outputs and the residual update.
    for l in range(L):
        p = {name: w[l] for name, w in params["layers"].items()}
        assert_close(t["hidden"][l] @ p["down"], t["mlp_out"][l], f"mlp_hidden of layer {l}")
        assert_close(t["heads"][l].reshape(B, T, -1) @ p["o"], t["attn_out"][l], f"head_out of layer {l}")
        # a head's output is its attention over the values of its kv head
        group = H // CONFIG.num_kv_heads
        for h in range(H):
            assert_close(
                jnp.einsum("bts,bsd->btd", t["probs"][l, :, h], t["v"][l, :, :, h // group]),
                t["heads"][l, :, :, h],
                f"layer {l} head {h}",
            )
    assert_close(t["post"], t["pre"] + t["attn_out"] + t["mlp_out"], "resid_post")


@pytest.mark.parametrize("kind", ["skip", "add"])
def test_integrated_gradients_under_an_intervention_equal_a_hand_computation(kind):
    """IG of layer l under an intervention, against jax.grad of the full forward with the same
    intervention and h_{l+1} written by hand: layer s < l skipped everywhere, or a vector added
    at resid_pre of layer l+1 (not idempotent: applied twice, it would show)."""
    params, tokens, _ = _setup()
    tokens, valid = tokens[:1], jnp.ones((1, T), bool)
    s, l, steps = 0, 1, 4
    if kind == "skip":
        iv = sites.skip("delta", s, np.r_[0.0, np.ones(T - 1)].astype(np.float32))
    else:
        vector = 0.5 * np.random.default_rng(5).standard_normal(CONFIG.hidden_size).astype(np.float32)
        iv = sites.add("resid_pre", l + 1, vector, jnp.ones(T))
    answer_positions, answer_real = jnp.arange(5, T - 1), jnp.ones(T - 6, bool)
    alphas, weights = quadrature("left", steps)
    prompt = PromptArrays(tokens, valid, answer_positions, answer_real)
    result = ig_of_prompt(params, prompt, CONFIG, rule=FixedRule(steps=steps), interventions=iv)
    ours, f_x, f_b = result.per_position[:, 0], result.f_input[0], result.f_baseline[:, 0]

    targets = tokens[0, answer_positions + 1]

    def F(x):  # the objective with layer l's output h_{l+1} = x; the intervention acts on top
        def write(value, layer, data):
            return jnp.where(layer == l + 1, data, value)

        logits = forward(params, tokens, CONFIG, interventions=[sites.Intervention("resid_pre", write, x[None]), iv])
        probs = jax.nn.softmax(logits[0, answer_positions], axis=-1)
        return jnp.sum(probs[jnp.arange(len(answer_positions)), targets])

    # layer l's output as the model computes it, before layer l+1's resid_pre interventions
    x = run_layers(params, embed(params, tokens, CONFIG), CONFIG, interventions=iv, tap=lambda r, _: r.out)[1][l, 0]
    b = jnp.broadcast_to(x.mean(axis=0, keepdims=True), x.shape)
    grads = [jax.grad(F)(b + a * (x - b)) for a in alphas]
    expected = sum(w * jnp.sum((x - b) * g, axis=-1) for w, g in zip(weights, grads))
    assert_close(ours[l], expected, f"IG of layer l under the {kind}")
    assert_close(f_x, F(x), "F(x)")
    assert_close(f_b[l], F(b), "F(b)")
    clean = ig_of_prompt(params, prompt, CONFIG, rule=FixedRule(steps=steps)).per_position[:, 0]
    assert float(jnp.max(jnp.abs(clean[l] - ours[l]))) > 1e-3, f"the {kind} did not change the attributions"


def test_unknown_site_is_refused():
    with pytest.raises(ValueError, match="unknown intervention site 'mlp_input'"):
        sites.Intervention("mlp_input", scale_hidden, {})
    with pytest.raises(ValueError, match="unknown intervention sites"):
        sites.StatefulIntervention(("mlp_in", "q_input"), scale_hidden)


# ----------------------------------------------------------------------------- the boundary rule
#
# Data indexed by layer has L rows (every site), or L+1 at resid_pre (boundaries h_0..h_L). L rows
# never touch the final residual h_L; L+1 rows edit it with row L. Each built-in kind at the last
# layer, against the forward edited by hand.


def _position(t):
    return (np.arange(T) == t).astype(np.float32)


@pytest.mark.parametrize("rows", [L, L + 1])
def test_keep_at_resid_pre_reaches_the_final_residual_only_with_l_plus_1_rows(rows):
    params, tokens, _ = _setup()
    masks = np.ones((rows, T), np.float32)
    masks[L - 1] = 1 - _position(4)  # the input of the last layer, position 4
    zero_at = lambda t: lambda v: v * (1 - _position(t))[None, :, None]
    edits = [((L - 1, "resid_pre"), zero_at(4))]
    if rows == L + 1:
        masks[L] = 1 - _position(6)  # the final residual, position 6
        edits.append(((L, "resid_pre"), zero_at(6)))
    ours = run(params, tokens, sites.keep("resid_pre", masks))
    assert_close(ours, reference(params, tokens, tuple(edits)), f"keep with {rows} rows")
    if rows == L:  # what clamping masks[L] to row L-1 gave: position 4 zeroed in h_L too
        assert_moved(ours, reference(params, tokens, tuple(edits) + (((L, "resid_pre"), zero_at(4)),)), "h_L")


@pytest.mark.parametrize("rows", [L, L + 1])
def test_patch_at_resid_pre_reaches_the_final_residual_only_with_l_plus_1_rows(rows):
    params, clean, corrupted = _setup()
    other = residual_stream(params, corrupted, CONFIG)[:rows]  # [rows, B, T, D]
    where = np.zeros((rows, 1, T, 1), bool)
    where[L - 1, :, 3] = True
    put = lambda l, t: lambda v: v.at[:, t].set(other[l][:, t])
    edits = [((L - 1, "resid_pre"), put(L - 1, 3))]
    if rows == L + 1:
        where[L, :, 7] = True
        edits.append(((L, "resid_pre"), put(L, 7)))
    ours = run(params, clean, sites.patch("resid_pre", other, where))
    assert_close(ours, reference(params, clean, tuple(edits)), f"patch with {rows} rows")
    assert_moved(ours, reference(params, clean), "patch")


@pytest.mark.parametrize("layer", [L - 1, L])
@pytest.mark.parametrize("kind", ["replace", "add"])
def test_replace_and_add_at_the_last_layer_and_the_final_residual(kind, layer):
    params, tokens, _ = _setup()
    vector = jax.random.normal(jax.random.key(2), (CONFIG.hidden_size,))
    positions = _position(5)
    # the argument orders differ: replace(site, layer, positions, value), add(site, layer, vector, positions)
    make = (
        (lambda site: sites.replace(site, layer, positions, vector))
        if kind == "replace"
        else (lambda site: sites.add(site, layer, vector, positions))
    )
    iv = make("resid_pre")
    edit = (
        (lambda v: v.at[:, 5].set(vector)) if kind == "replace" else (lambda v: v + positions[None, :, None] * vector)
    )
    expected = reference(params, tokens, (((layer, "resid_pre"), edit),))
    assert_close(run(params, tokens, iv), expected, f"{kind} at resid_pre of layer {layer}")
    assert_moved(expected, reference(params, tokens), kind)
    if layer == L - 1:  # the same at a site with L layers only
        assert_close(
            run(params, tokens, make("mlp_out")),
            reference(params, tokens, (((layer, "mlp_out"), edit),)),
            f"{kind} at mlp_out of the last layer",
        )


def test_head_ablation_at_the_last_layer():
    params, tokens, _ = _setup()
    heads = np.zeros((L, H), np.float32)
    heads[L - 1, 2] = 1.0
    ours = run(params, tokens, sites.ablate_heads(heads, head_dim=Dh))
    assert_close(
        ours,
        reference(params, tokens, (((L - 1, "head_out"), lambda v: v.at[:, :, 2].set(0.0)),)),
        "last layer's head 2",
    )
    assert_moved(ours, reference(params, tokens), "head ablation")


# A user-defined kind with layer-indexed data, declared: scale the value of layer l by factors[l].
def scale_by_layer(value, layer, data):
    return value * data["factors"][layer]


@pytest.mark.parametrize("rows", [L, L + 1])
def test_a_user_defined_kind_declares_its_layer_indexed_data(rows):
    params, tokens, _ = _setup()
    factors = 1.0 + 0.5 * np.arange(rows, dtype=np.float32)
    iv = sites.Intervention("resid_pre", scale_by_layer, {"factors": factors}, layer_data=("factors",))
    edits = tuple(((l, "resid_pre"), lambda v, f=float(factors[l]): f * v) for l in range(rows))
    assert_close(run(params, tokens, iv), reference(params, tokens, edits), f"user kind with {rows} rows")


REFUSALS = {
    "keep with L-1 rows": (
        lambda: sites.keep("resid_pre", np.ones((L - 1, T))),
        r"site 'resid_pre': data indexed by layer must have 3 \(one per layer\) or 4 "
        r"\(boundaries h_0..h_L, the last the final residual\) rows; data has shape \(2, 10\)",
    ),
    "keep with L+1 rows at attn_out": (
        lambda: sites.keep("attn_out", np.ones((L + 1, T))),
        r"site 'attn_out': data indexed by layer must have 3 \(one per layer\) rows; "
        r"data has shape \(4, 10\)",
    ),
    "a mask that does not broadcast": (
        lambda: sites.keep("mlp_out", np.ones((L, T + 1))),
        r"a row of masks of shape \(11,\) does not broadcast to \(2, 10\)",
    ),
    "a patch with the wrong width": (
        lambda: sites.patch("resid_post", np.ones((L, B, T, 1), np.float32), np.ones((L, 1, T, 1), bool)),
        r"site 'resid_post': a row of cached has shape \(2, 10, 1\); the site's value "
        r"is \(2, 10, 32\)",
    ),
    "a patch with L+2 rows": (
        lambda: sites.patch("resid_pre", np.ones((L + 2, B, T, 32), np.float32), np.ones((L + 2, 1, T, 1), bool)),
        r"must have 3 \(one per layer\) or 4 .* rows; data\[0\] has shape \(5, 2, 10, 32\)",
    ),
    "rows that disagree": (
        lambda: sites.patch("resid_pre", np.ones((L + 1, B, T, 32), np.float32), np.ones((L, 1, T, 1), bool)),
        r"its layer-indexed data disagree on the number of rows",
    ),
    "head masks of the wrong width": (
        lambda: sites.ablate_heads(np.ones((L, H + 1)), head_dim=Dh),
        r"heads must be \[L, 4\] and means \[L, 4, 8\], got \(3, 5\) and \(3, 5, 8\)",
    ),
    "an int replacement": (
        lambda: sites.replace("resid_pre", 1, np.ones(T), np.ones(32, np.int32)),
        r"the replacement value must be a float array, got int32",
    ),
    "an int steering vector": (
        lambda: sites.add("resid_pre", 1, np.ones(32, np.int32), np.ones(T)),
        r"the added vector must be a float array, got int32",
    ),
    "an int patch": (
        lambda: sites.patch("mlp_out", np.ones((L, B, T, 32), np.int32), np.ones((L, 1, T, 1), bool)),
        r"cached must be a float array, got int32",
    ),
    "a vector of the wrong width": (
        lambda: sites.add("resid_post", 1, np.ones(31, np.float32), np.ones(T)),
        r"the added vector of shape \(31,\) does not broadcast to \(2, 10, 32\)",
    ),
    "a user kind returning the wrong shape": (
        lambda: sites.Intervention("mlp_out", lambda v, l, d: v[..., :4]),
        r"returned shape \(2, 10, 4\), but the site's value has shape "
        r"\(2, 10, 32\)",
    ),
    "a user kind with undeclared keys": (
        lambda: sites.Intervention("resid_pre", scale_by_layer, {"factors": np.ones(L)}, layer_data=("scales",)),
        r"layer_data names \('scales',\), not entries of its data",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_ill_fitting_intervention_data_is_refused_at_trace_time(case):
    params, tokens, _ = _setup()
    make, message = REFUSALS[case]
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(lambda p, t: forward(p, t, CONFIG, interventions=make()), params, tokens)


# ----------------------------------------------------------------------------- layer indices

# forward jitted with jaxdepth's jit: it checks the interventions among the arguments before
# tracing, as every jitted function of the package does
jitted_forward = compilation.jit(forward, static_argnames="config")
STEER = np.random.default_rng(5).standard_normal(32).astype(np.float32)
EVERYWHERE = np.ones(T, np.float32)


@pytest.mark.parametrize("site", ["resid_pre", "attn_out", "resid_post"])
def test_a_negative_layer_index_counts_from_the_end(site):
    """-1 is the last layer (TransformerLens's blocks[-1]), -L the first: the same logits as the
    positive index, unjitted, through a jaxdepth jitted function, and traced under vmap."""
    params, tokens, _ = _setup()
    clean = forward(params, tokens, CONFIG)
    for negative, positive in ((-1, L - 1), (-L, 0)):
        want = forward(params, tokens, CONFIG, interventions=sites.add(site, positive, STEER, EVERYWHERE))
        assert_moved(want, clean, f"the steering at layer {positive}")
        got = forward(params, tokens, CONFIG, interventions=sites.add(site, negative, STEER, EVERYWHERE))
        assert np.array_equal(got, want), f"{site} at layer {negative} (unjitted)"
        jitted = jitted_forward(params, tokens, CONFIG, interventions=sites.add(site, negative, STEER, EVERYWHERE))
        assert np.array_equal(
            jitted, jitted_forward(params, tokens, CONFIG, interventions=sites.add(site, positive, STEER, EVERYWHERE))
        )
    traced = jax.vmap(lambda layer: run(params, tokens, sites.add(site, layer, STEER, EVERYWHERE)))(
        jnp.array([-1, L - 1], jnp.int32)
    )
    assert np.array_equal(traced[0], traced[1]), f"{site}: a traced -1"


@pytest.mark.parametrize(
    "site, layer",
    [
        ("resid_post", L),
        ("resid_post", 99),
        ("attn_out", L),
        ("resid_pre", L + 1),
        ("resid_pre", 99),
        ("mlp_out", -L - 1),
    ],
)
def test_an_out_of_range_layer_index_is_refused(site, layer):
    """Unjitted, through a jaxdepth jitted function, and for a replacement as for a steering
    vector: an error naming the site, the index and the valid range, never the clean run."""
    params, tokens, _ = _setup()
    top = L if site == "resid_pre" else L - 1
    message = (
        rf"at site '{site}': layer index {layer} is out of range for a model of {L} layers: "
        rf"valid are 0\.\.{top}, or -{L}\.\.-1"
    )
    for make in (
        lambda: sites.add(site, layer, STEER, EVERYWHERE),
        lambda: sites.replace(site, layer, EVERYWHERE, STEER),
    ):
        with pytest.raises(sites.InterventionError, match=message):
            forward(params, tokens, CONFIG, interventions=make())
        with pytest.raises(sites.InterventionError, match=message):
            jitted_forward(params, tokens, CONFIG, interventions=[make()])
    stack = sites.add(site, np.array([0, layer], np.int32), STEER, EVERYWHERE)  # one bad member of a stack
    with pytest.raises(sites.InterventionError, match=message):
        jitted_forward(params, tokens, CONFIG, interventions=stack)


def test_the_final_residual_is_index_L_at_resid_pre_only():
    params, tokens, _ = _setup()
    got = forward(params, tokens, CONFIG, interventions=sites.add("resid_pre", L, STEER, EVERYWHERE))
    want = reference(params, tokens, (((L, "resid_pre"), lambda h: h + STEER),))
    assert_close(got, want, "steering the final residual")


def scale_at(value, layer, data):
    return value * jnp.where(layer == data["at"], data["factor"], 1.0)


def test_a_user_kind_declares_its_layer_index():
    """`layer_index` names the entry of data holding the index: checked and counted from the
    end like the built-in kinds'; undeclared, an index is the user's to check."""
    params, tokens, _ = _setup()
    make = lambda at: sites.Intervention(
        "mlp_out", scale_at, {"at": jnp.int32(at), "factor": jnp.float32(3.0)}, layer_index="at"
    )
    assert np.array_equal(
        forward(params, tokens, CONFIG, interventions=make(-1)),
        forward(params, tokens, CONFIG, interventions=make(L - 1)),
    )
    with pytest.raises(sites.InterventionError, match=r"layer index 7 is out of range"):
        forward(params, tokens, CONFIG, interventions=make(7))
    with pytest.raises(sites.InterventionError, match=r"layer_index names 'layer', not an entry of its data"):
        forward(
            params,
            tokens,
            CONFIG,
            interventions=sites.Intervention("mlp_out", scale_at, {"at": 0, "factor": 1.0}, layer_index="layer"),
        )


def test_tap_inputs_without_a_row_per_layer_are_refused():
    """A traced layer reads row `layer` of tap_inputs: a short one would be clamped silently."""
    from jaxdepth.core.loops import LayerRun, run_layers

    params, tokens, _ = _setup()
    h0 = embed(params, tokens, CONFIG)
    tap = lambda record, x: jnp.sum(record.out * x)
    with pytest.raises(ValueError, match=rf"tap_inputs must have a leading layer axis of {L}"):
        run_layers(params, h0, CONFIG, tap=tap, tap_inputs=jnp.ones((L - 1, 32)), run=LayerRun(start=jnp.int32(0)))
    with pytest.raises(ValueError, match=rf"tap_inputs must have a leading layer axis of {L}"):
        run_layers(params, h0, CONFIG, tap=tap, tap_inputs=jnp.ones((L - 1, 32)))
    with pytest.raises(ValueError, match=rf"start must be a boundary in 0\.\.{L}"):
        run_layers(params, h0, CONFIG, run=LayerRun(start=-1))
