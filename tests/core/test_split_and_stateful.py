"""The sites of a split layer (each query head's q, k and v inputs, each head's result) against
the layer computed by hand, and stateful interventions against their stateless equivalents:
through the scan, a run from a traced boundary, a vmapped stack and a gradient."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, assert_moved
from jaxdepth.core import sites
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.layer import attend, attention_heads, attention_mask, key_values, norm, rotary_tables
from jaxdepth.core.loops import LayerRun, Pieces, run_layers, run_layers_in_pieces, suffix_value_and_grad
from jaxdepth.core.model import embed, forward, random_params, unembed

B, T = 2, 7
CONFIG = ModelConfig(
    model_type="qwen3",
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32,
    tie_word_embeddings=True,
    qkv_bias=True,
    qk_norm=True,
)
L, H, D = CONFIG.num_layers, CONFIG.num_heads, CONFIG.hidden_size

pytestmark = pytest.mark.usefixtures("highest_precision")


@functools.lru_cache(maxsize=None)
def _setup():
    params = random_params(CONFIG, 4, scale=0.2)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CONFIG.vocab_size, (B, T)), jnp.int32)
    return params, tokens


@jax.jit
def run(params, tokens, interventions):
    return forward(params, tokens, CONFIG, interventions=interventions)


def _with_value_input(layer, head, vector):
    """Logits when query head `head` of layer `layer` reads its value from h + vector (by hand:
    the other heads, the residual and the MLP read h)."""
    params, tokens = _setup()
    cos, sin = rotary_tables(T, CONFIG)
    mask = attention_mask(jnp.ones((B, T), bool))
    h = embed(params, tokens, CONFIG)
    for l in range(L):
        p = {name: w[l] for name, w in params["layers"].items()}
        q, k, v, _, heads = attention_heads(p, norm(h, p["attn_norm"], CONFIG), cos, sin, mask, CONFIG)
        if l == layer:
            _, v_moved = key_values(p, norm(h + vector, p["attn_norm"], CONFIG), cos, sin, CONFIG)
            v_per_head = jnp.repeat(v, H // CONFIG.num_kv_heads, axis=2)
            v_per_head = v_per_head.at[:, :, head].set(v_moved[:, :, head // (H // CONFIG.num_kv_heads)])
            _, moved = attend(q, jnp.repeat(k, H // CONFIG.num_kv_heads, axis=2), v_per_head, mask, CONFIG)
            heads = heads.at[:, :, head].set(moved[:, :, head])
        a = heads.reshape(B, T, -1) @ p["o"]
        x = norm(h + a, p["mlp_norm"], CONFIG)
        h = h + a + (jax.nn.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"]
    return unembed(params, h, CONFIG)


def test_a_split_layer_without_change_is_the_layer():
    params, tokens = _setup()
    split = run(params, tokens, sites.unchanged("q_in"))
    assert_close(split, run(params, tokens, None), "a split layer", tol=1e-5)


def test_one_heads_value_input_moved_against_the_layer_by_hand():
    params, tokens = _setup()
    vector = 0.5 * jax.random.normal(jax.random.key(1), (D,))
    head_only = np.zeros((H, 1)).astype(np.float32)
    head_only[3] = 1.0
    ours = run(params, tokens, sites.add("v_in", 1, head_only * vector, np.ones(T)))
    expected = _with_value_input(1, 3, vector)
    assert_close(ours, expected, "v_in of head 3", tol=1e-5)
    assert_moved(ours, run(params, tokens, None), "v_in of head 3")


def test_every_heads_inputs_moved_is_attention_reading_a_moved_residual():
    """q_in, k_in and v_in of every head moved by v: the attention reads h + v, the residual and
    the MLP read h: exactly `mlp_in` and `resid_post` compensating a `resid_pre` edit."""
    params, tokens = _setup()
    vector = 0.5 * jax.random.normal(jax.random.key(3), (D,))
    moved = [sites.add(site, 2, vector, np.ones(T)) for site in ("q_in", "k_in", "v_in")]
    compensated = [
        sites.add("resid_pre", 2, vector, np.ones(T)),
        sites.add("mlp_in", 2, -vector, np.ones(T)),
        sites.add("resid_post", 2, -vector, np.ones(T)),
    ]
    assert_close(run(params, tokens, moved), run(params, tokens, compensated), "heads' inputs", tol=1e-5)


def test_head_results_sum_to_the_attention_output_and_ablate_like_head_out():
    params, tokens = _setup()
    h0 = embed(params, tokens, CONFIG)
    split = sites.unchanged("head_result")
    _, (results, attn) = run_layers(params, h0, CONFIG, interventions=split, tap=lambda r, _: (r.head_result, r.attn))
    assert results.shape == (L, B, T, H, D)
    assert_close(results.sum(axis=3), attn, "sum of head results")
    _, plain = run_layers(params, h0, CONFIG, tap=lambda r, _: r.head_result)
    assert plain is None or all(x is None for x in jax.tree.leaves(plain, is_leaf=lambda x: x is None))
    heads = np.zeros((L, H), np.float32)
    heads[1, 2] = 1.0
    zero_result = sites.Intervention(
        "head_result", lambda v, l, d: v * jnp.where(l == 1, 1 - d, 1)[None, None, :, None], jnp.asarray(heads[1])
    )
    ablated = sites.ablate_heads(heads, head_dim=CONFIG.head_dim)
    assert_close(run(params, tokens, zero_result), run(params, tokens, ablated), "ablated head", tol=1e-5)


# ----------------------------------------------------------------------------- stateful interventions


def _count_layers(site, value, layer, vector, count):
    """Adds count * vector to each layer's output, counting the layers run in its state."""
    return value + count.astype(value.dtype) * vector, count + 1


def counting(vector):
    return sites.StatefulIntervention(("resid_post",), _count_layers, vector, jnp.float32(0))


def stateless(vector, first: int = 0):
    """The same edit without a state: layer l adds (l - first) * vector."""
    rows = jnp.asarray(np.maximum(np.arange(L) - first, 0), jnp.float32)[:, None] * vector[None]
    return sites.Intervention("resid_post", lambda v, l, d: v + d[l], rows, layer_data=True)


def test_a_stateful_intervention_equals_its_stateless_equivalent_in_every_loop():
    params, tokens = _setup()
    vector = 0.3 * jax.random.normal(jax.random.key(4), (D,))
    ours, theirs = run(params, tokens, counting(vector)), run(params, tokens, stateless(vector))
    np.testing.assert_array_equal(ours, theirs)
    assert_moved(ours, run(params, tokens, None), "counted layers")
    h1 = run_layers(params, embed(params, tokens, CONFIG), CONFIG, tap=lambda r, _: r.out)[1][0]
    from_one = jax.jit(
        lambda h, iv: run_layers(params, h, CONFIG, interventions=iv, run=LayerRun(start=jnp.int32(1)))[0]
    )
    np.testing.assert_array_equal(from_one(h1, counting(vector)), from_one(h1, stateless(vector, first=1)))


def test_a_stack_of_stateful_interventions_vmaps_like_one_at_a_time():
    params, tokens = _setup()
    vectors = 0.3 * jax.random.normal(jax.random.key(5), (3, D))
    stacked = jax.jit(jax.vmap(lambda v: forward(params, tokens, CONFIG, interventions=counting(v))))(vectors)
    for i in range(3):
        np.testing.assert_array_equal(stacked[i], run(params, tokens, counting(vectors[i])))


def test_a_gradient_through_the_state_equals_the_stateless_one():
    params, tokens = _setup()

    def loss(make, vector):
        return jnp.sum(forward(params, tokens, CONFIG, interventions=make(vector))[:, -1, :5])

    vector = 0.1 * jnp.ones(D)
    ours = jax.jit(jax.grad(lambda v: loss(counting, v)))(vector)
    assert_close(ours, jax.jit(jax.grad(lambda v: loss(stateless, v)))(vector), "gradient", tol=1e-5)
    assert float(jnp.max(jnp.abs(ours))) > 0


def _grow(site, value, layer, data, state):
    return value, jnp.concatenate([state, state])


def test_a_state_that_changes_shape_and_loops_that_cannot_carry_one_are_refused():
    params, tokens = _setup()
    h0 = embed(params, tokens, CONFIG)
    with pytest.raises(sites.InterventionError, match="keeps its structure, shapes and dtypes"):
        forward(params, tokens, CONFIG, interventions=sites.StatefulIntervention("mlp_out", _grow, None, jnp.zeros(2)))
    with pytest.raises(ValueError, match="cannot carry a stateful intervention"):
        suffix_value_and_grad(params, h0, 0, CONFIG, jnp.sum, interventions=counting(jnp.ones(D)))
    buffers = (jnp.zeros((L, B, T, CONFIG.num_kv_heads, CONFIG.head_dim)),) * 2
    for interventions, message in (
        (counting(jnp.ones(D)), "not piece by piece"),
        (sites.unchanged("k_in"), "run split sites without pieces"),
    ):
        with pytest.raises(ValueError, match=message):
            run_layers_in_pieces(
                params,
                h0,
                0,
                buffers,
                jnp.ones((B, T), bool),
                CONFIG,
                pieces=Pieces(0, 0, T),
                interventions_of=lambda rows: interventions,
            )
