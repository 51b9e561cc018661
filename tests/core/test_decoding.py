"""Generation (`jaxdepth.core.decoding.generate`): greedy tokens identical to transformers'
`generate(do_sample=False)` on tiny models of several families, ragged prompts in one batch;
a padded batch is each prompt alone; a vmapped set of interventions or layer orders decodes as
each one alone; a dropped layer decodes as that layer skipped; end-of-sequence, sampling and
the refusals."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from jaxdepth.core import sites
from jaxdepth.core.decoding import Decoding, generate, generate_orders
from jaxdepth.core.model import random_params
from jaxdepth.core.structure import (
    LayerOrder,
    drop_block,
    group_orders,
    identity_order,
    parallel_block,
    stack_orders,
    swap_pair,
)

NEW = 32
# transformers' greedy generate without an end-of-sequence token (an id no vocabulary has), as
# decoding here runs: it neither stops at the model's own end token nor masks it (as
# min_new_tokens would, where the model's argmax is that token).
WITHOUT_END = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=10**9)
STATIC = ("config", "max_new_tokens")
decode = jax.jit(generate, static_argnames=STATIC)

CONFIG = tiny_config(num_layers=4, qkv_bias=True)
PARAMS = random_params(CONFIG, seed=5, scale=0.3)
PROMPTS = [[5, 17, 3, 88, 41, 9, 12], [60, 2, 33], [7, 7, 19, 54, 21, 80, 3, 11, 45, 2]]


def batch(prompts):
    """Right-padded token ids and their mask."""
    T = max(map(len, prompts))
    tokens, valid = np.zeros((len(prompts), T), np.int32), np.zeros((len(prompts), T), bool)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)], valid[i, : len(p)] = p, True
    return tokens, valid


def run(prompts=PROMPTS, params=PARAMS, config=CONFIG, **options):
    tokens, valid = batch(prompts)
    return decode(params, tokens, config, valid=valid, max_new_tokens=options.pop("max_new_tokens", NEW), **options)


@pytest.mark.parity
@pytest.mark.parametrize(
    "variant",
    [
        "qwen2_gqa_untied",
        "gpt2",
        "mistral_window",
        "pythia_parallel",
        "mixtral_experts",
        "gpt_oss_sinks",
        "deepseek_v3_latent",
        "qwen3_moe_experts",
        "smollm3_nope",
        "qwen3_5_hybrid",
        "gemma4_shared_kv",
        "gemma4_plain",
        "gemma4_moe",
    ],
)
def test_greedy_tokens_equal_transformers(tiny_model, variant):
    """Ragged prompts decoded together, each against transformers' greedy generate of that prompt
    alone (learned positions, a sliding window the decoding crosses, a parallel block, mixtures of
    experts routing one token at a time, attention sinks, latent attention's cache, dense layers
    among sparse ones, layers without positions, linear attention's recurrent state, Gemma 4's
    per-layer inputs and keys and values shared among layers)."""
    torch = pytest.importorskip("torch")
    from conversion.hf import convert_hf_folder

    tiny = tiny_model(variant)
    weights = convert_hf_folder(tiny.folder)
    prompts = [[int(t) % weights.config.vocab_size for t in p] for p in PROMPTS]
    got = run(prompts, weights.params, weights.config)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = tiny.model.generate(torch.tensor([prompt]), **WITHOUT_END)[0, len(prompt) :].tolist()
        assert np.asarray(got.tokens[i]).tolist() == expected, (variant, i)


def test_a_padded_batch_is_each_prompt_alone():
    together = run()
    for i, prompt in enumerate(PROMPTS):
        alone = run([prompt])
        assert np.array_equal(together.tokens[i], alone.tokens[0]), i


def test_a_vmapped_set_of_interventions_decodes_as_each_alone():
    # skip one layer's contribution at every position: data that fits any number of rows
    layers = np.arange(CONFIG.num_layers)
    tokens, valid = batch(PROMPTS)

    def under(layer):
        return generate(
            PARAMS,
            tokens,
            CONFIG,
            valid=valid,
            max_new_tokens=NEW,
            interventions=sites.skip("delta", layer, jnp.ones(1)),
        ).tokens

    together = np.asarray(jax.jit(jax.vmap(under))(layers))
    for layer in layers:
        alone = run(interventions=sites.skip("delta", int(layer), np.ones(1))).tokens
        assert np.array_equal(together[layer], alone), layer
    assert not np.array_equal(together[0], run().tokens)  # the skips change what is generated


def test_a_dropped_layer_decodes_as_that_layer_skipped():
    for layer in range(CONFIG.num_layers):
        dropped = run(order=drop_block(CONFIG.num_layers, layer, 1)).tokens
        skipped = run(interventions=sites.skip("delta", layer, np.ones(1))).tokens
        assert np.array_equal(dropped, skipped), layer


def test_a_vmapped_stack_of_orders_decodes_as_each_alone():
    L = CONFIG.num_layers
    orders = [identity_order(L), drop_block(L, 1, 1), swap_pair(L, 0), drop_block(L, 2, 2)]
    tokens, valid = batch(PROMPTS)
    stacked = LayerOrder(*map(jnp.asarray, stack_orders(orders)))
    together = jax.jit(
        jax.vmap(lambda o: generate(PARAMS, tokens, CONFIG, valid=valid, max_new_tokens=NEW, order=o).tokens)
    )(stacked)
    for i, order in enumerate(orders):
        assert np.array_equal(together[i], run(order=order).tokens), i
    assert np.array_equal(together[0], run().tokens)


def test_end_of_sequence_ends_each_row_on_its_own():
    greedy = np.asarray(run().tokens)
    eos = int(greedy[0, 4])  # what the first prompt emits fifth ends it there
    ended = run(decoding=Decoding(eos_ids=(eos,), pad_id=-1))
    n = int(np.argmax(greedy[0] == eos)) + 1
    assert int(ended.lengths[0]) == n
    assert np.array_equal(ended.tokens[0, :n], greedy[0, :n]) and (np.asarray(ended.tokens[0, n:]) == -1).all()
    for i in range(1, len(PROMPTS)):  # the other rows run on to their own end
        row = greedy[i]
        m = int(np.argmax(row == eos)) + 1 if (row == eos).any() else NEW
        assert int(ended.lengths[i]) == m and np.array_equal(ended.tokens[i, :m], row[:m]), i


def test_sampling_is_seeded_and_a_cold_temperature_is_greedy():
    key = jax.random.PRNGKey(0)
    hot = run(decoding=Decoding(temperature=1.0, key=key)).tokens
    assert np.array_equal(hot, run(decoding=Decoding(temperature=1.0, key=key)).tokens)
    assert not np.array_equal(hot, run(decoding=Decoding(temperature=1.0, key=jax.random.PRNGKey(1))).tokens)
    assert np.array_equal(run(decoding=Decoding(temperature=1e-6, key=key)).tokens, run().tokens)


def test_refusals():
    tokens, valid = batch(PROMPTS)
    with pytest.raises(ValueError, match="not right-padded"):
        generate(PARAMS, tokens, CONFIG, valid=valid[:, ::-1], max_new_tokens=4)
    with pytest.raises(ValueError, match="has no tokens"):
        generate(PARAMS, tokens, CONFIG, valid=valid & False, max_new_tokens=4)
    with pytest.raises(ValueError, match="exceed the model's context"):
        generate(PARAMS, tokens, CONFIG, valid=valid, max_new_tokens=CONFIG.max_position_embeddings)
    with pytest.raises(ValueError, match="needs temperature > 0 and a key"):
        generate(PARAMS, tokens, CONFIG, valid=valid, max_new_tokens=4, decoding=Decoding(temperature=0.5))
    with pytest.raises(ValueError, match="unsplit sites"):
        generate(PARAMS, tokens, CONFIG, max_new_tokens=4, interventions=sites.unchanged("q_in"))
    for old in ({"temperature": 0.5}, {"key": jax.random.PRNGKey(0)}, {"pad_id": -1}, {"eos_ids": (2,)}):
        with pytest.raises(TypeError, match=r"decoding=jaxdepth.core.decoding.Decoding\("):
            generate(PARAMS, tokens, CONFIG, valid=valid, max_new_tokens=4, **old)
    plan = group_orders(stack_orders([identity_order(CONFIG.num_layers)]), CONFIG.num_layers)
    with pytest.raises(TypeError, match=r"decoding=jaxdepth.core.decoding.Decoding\(temperature=0.5\)"):
        generate_orders(PARAMS, tokens, CONFIG, plan, valid=valid, max_new_tokens=4, temperature=0.5)
    # a mask over the prompt's positions cannot act on one new token at a time
    with pytest.raises(sites.InterventionError, match="does not broadcast"):
        generate(
            PARAMS, tokens, CONFIG, max_new_tokens=4, interventions=sites.skip("delta", 0, np.ones(tokens.shape[1]))
        )


@functools.cache
def _embedded_prompts():
    return ["The capital of France is", "1, 2, 3, 4,", "Question: what is 2 + 3?\nAnswer:"]


@pytest.mark.slow(seconds=20)
def test_model_generate_on_the_embedded_model(smollm2):
    texts = smollm2.generate(_embedded_prompts(), max_new_tokens=12)
    assert len(texts) == 3 and all(isinstance(t, str) for t in texts)
    assert "5" in texts[1] and "6" in texts[1]  # it continues the count
    # stop strings cut the text; the order and interventions reach every step
    cut = smollm2.generate(_embedded_prompts()[1], max_new_tokens=12, stop=[" 6"])[0]
    assert texts[1].startswith(cut) and " 6" not in cut and len(cut) < len(texts[1])
    L = smollm2.config.num_layers
    assert smollm2.generate(_embedded_prompts(), max_new_tokens=12, order=identity_order(L)) == texts
    broken = smollm2.generate(_embedded_prompts(), max_new_tokens=12, order=drop_block(L, 0, L // 2))
    assert broken != texts
    with pytest.raises(ValueError, match="outside 0.."):
        smollm2.generate("hi", order=LayerOrder(np.array([[L]], np.int32), np.ones((1, 1), bool)))


def test_layer_major_decoding_is_each_order_alone():
    """generate_orders gives each order the tokens generate(order=...) gives it: greedy, under an
    intervention, and sampled (each order drawing with the key it would draw with alone)."""
    L = CONFIG.num_layers
    orders = [identity_order(L), drop_block(L, 1, 1), swap_pair(L, 0), drop_block(L, 2, 2), parallel_block(L, 1, 2)]
    plan = group_orders(stack_orders(orders), L)
    tokens, valid = batch(PROMPTS)
    many = jax.jit(generate_orders, static_argnames=("grouped",) + STATIC)
    steer = sites.add("resid_post", 1, jnp.full(CONFIG.hidden_size, 0.5), jnp.ones(1))
    key = jax.random.PRNGKey(3)
    for options in ({}, {"interventions": steer}, {"decoding": Decoding(temperature=1.0, key=key)}):
        together = many(PARAMS, tokens, CONFIG, plan, valid=valid, max_new_tokens=NEW, **options)
        assert together.tokens.shape == (len(orders), len(PROMPTS), NEW)
        for i, order in enumerate(orders):
            alone = run(order=order, **options)
            assert np.array_equal(together.tokens[i], alone.tokens), (i, options)
            assert np.array_equal(together.lengths[i], alone.lengths), (i, options)


def test_layer_major_decoding_stops_each_row_and_refuses_longrope():
    L = CONFIG.num_layers
    plan = group_orders(stack_orders([identity_order(L), drop_block(L, 3, 1)]), L)
    tokens, valid = batch(PROMPTS)
    eos = int(np.asarray(run().tokens)[0, 4])
    together = generate_orders(
        PARAMS, tokens, CONFIG, plan, valid=valid, max_new_tokens=NEW, decoding=Decoding(eos_ids=(eos,))
    )
    for i, order in enumerate([identity_order(L), drop_block(L, 3, 1)]):
        alone = run(order=order, decoding=Decoding(eos_ids=(eos,)))
        assert np.array_equal(together.tokens[i], alone.tokens) and np.array_equal(together.lengths[i], alone.lengths)
    half = CONFIG.rotated_dims // 2
    longrope = dataclasses.replace(
        CONFIG,
        rope_type="longrope",
        rope_original_max_position=16,
        rope_short_factor=(1.0,) * half,
        rope_long_factor=(2.0,) * half,
    )
    with pytest.raises(ValueError, match="longrope"):
        generate_orders(PARAMS, tokens, longrope, plan, valid=valid, max_new_tokens=4)
