"""Parity of a hybrid model (Qwen3.5: linear attention, the gated delta rule, on three layers of
four, gated full attention on the fourth) with transformers, against a float64 reference.

The delta rule's float32 rounding grows through the gated norm, which divides each value head's
output by its own norm: on the tiny random model transformers' float32 logits are 6e-4 from its
float64 ones (logit scale 7), beyond the 1e-4 that the other families' parity tests hold. So the
reference is transformers run in float64, with the float32 casts of its Qwen3.5 code widened to
float64 too, and jaxdepth's float32 logits must be as close to it as transformers' own float32
logits are. Measured max |logit diff| are printed (`pytest -s`).
"""

from __future__ import annotations

import copy
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_parity import converted, hf_logits, jax_logits

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.parity

VARIANT = "qwen3_5_hybrid"


class _Float64Casts(types.ModuleType):
    """`torch` as transformers' Qwen3.5 module sees it, with `torch.float32` read as float64: its
    delta rule, conv and norms cast to float32 whatever the model's type."""

    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


def float64_logits(model, tokens) -> np.ndarray:
    """transformers' logits of `model` in float64 throughout."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5

    wide = copy.deepcopy(model).double()
    real, qwen3_5.torch = qwen3_5.torch, _Float64Casts("torch")
    try:
        with torch.no_grad():
            return wide(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()
    finally:
        qwen3_5.torch = real


@pytest.fixture(scope="module")
def hybrid(tiny_model):
    tiny = tiny_model(VARIANT)
    params, config = converted(tiny)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, size=(2, 300))
    return tiny, params, config, tokens, float64_logits(tiny.model, tokens)


def test_the_layers_are_linear_attention_and_gated_attention(hybrid):
    _, params, config, _, _ = hybrid
    assert config.linear_layers == (0, 1, 3) and config.attention_layers == (2,)
    assert config.attention_gate and config.norm_offset == 1.0 and config.rotary_dim == 8
    assert params["layers"]["q"].shape[0] == 1 and params["layers"]["linear_qkv"].shape[0] == 3
    assert params["layers"]["mlp_norm"].shape[0] == 4


def test_logits_are_as_close_to_float64_as_transformers_float32(hybrid):
    tiny, params, config, tokens, reference = hybrid
    ours = jax_logits(params, tokens, config)
    theirs = hf_logits(tiny.model, tokens)
    ours_error, their_error = (float(np.abs(x - reference).max()) for x in (ours, theirs))
    print(
        f"\n[parity] {VARIANT}: T=300, max |logit diff| to float64: jaxdepth {ours_error:.3e}, transformers "
        f"float32 {their_error:.3e}; to transformers float32 {np.abs(ours - theirs).max():.3e} (logit scale "
        f"{np.abs(reference).max():.2f})"
    )
    assert ours_error <= 1.5 * their_error
    assert ours_error <= 1e-4 * np.abs(reference).max()  # the 1e-4 relative


def test_a_right_padded_batch_is_each_prompt_alone(hybrid):
    """The linear layers zero the padded positions' inputs (as transformers does): a prompt's
    valid positions are the same in a padded batch as alone, to the rounding of XLA's batched
    products (amplified as the module docstring says: the unpadded row 0 moves by 5e-5 between
    batch 2 and batch 1), and exactly the same whatever the padding holds."""
    _, params, config, _, _ = hybrid
    rng = np.random.default_rng(2)
    lengths = (256, 180)
    tokens = rng.integers(0, config.vocab_size, size=(2, 256))
    valid = np.arange(256)[None] < np.array(lengths)[:, None]
    ours = jax_logits(params, tokens, config, valid)
    for b, n in enumerate(lengths):
        alone = jax_logits(params, tokens[b : b + 1, :n], config)[0]
        print(f"\n[parity] {VARIANT} row {b} padded vs alone: {np.abs(ours[b, :n] - alone).max():.3e}")
        np.testing.assert_allclose(ours[b, :n], alone, rtol=0, atol=1e-4 * np.abs(alone).max())
    other = np.where(valid, tokens, (tokens + 7) % config.vocab_size)
    np.testing.assert_array_equal(jax_logits(params, other, config, valid)[1, : lengths[1]], ours[1, : lengths[1]])


SENSITIVITY = [
    ("the heads' gate ignored", {"attention_gate": False}),
    ("every layer attention", {"linear_layers": ()}),
    ("rotary on the whole head", {"rotary_dim": 0}),
    ("norm weights taken as w, not 1 + w", {"norm_offset": 0.0}),
]


@pytest.mark.parametrize("mistake,changes", SENSITIVITY, ids=[m for m, _ in SENSITIVITY])
def test_parity_is_sensitive_to_each_feature(hybrid, mistake, changes):
    tiny, params, config, tokens, reference = hybrid
    wrong = dataclasses.replace(config, **changes)
    if "attention_gate" in changes:
        params = {**params, "layers": {k: w for k, w in params["layers"].items() if k != "attn_gate"}}
    if "linear_layers" in changes:  # the attention's weights for every layer: layer 2's, repeated
        layers = {
            name: (jnp.repeat(w, 4, axis=0) if w.shape[0] == 1 else w)
            for name, w in params["layers"].items()
            if not name.startswith("linear_")
        }
        params = {**params, "layers": layers}
    e = float(np.abs(jax_logits(params, tokens[:1], wrong) - reference[:1]).max())
    print(f"\n[parity] sensitivity, {VARIANT} with {mistake}: max |logit diff| = {e:.3e}")
    assert e > 100 * 1e-4, mistake


def test_a_prefix_of_keys_and_values_alone_is_refused_by_name(hybrid):
    """A linear-attention layer continues from its state, which keys and values do not hold: a
    run from a `(keys, values)` prefix is refused, naming the `MixerPrefix` it takes."""
    from jaxdepth.core.loops import LayerRun, clean_key_values, run_layers
    from jaxdepth.core.model import embed

    _, params, config, tokens, _ = hybrid
    h = embed(params, jnp.asarray(tokens[:, :8]), config)
    prefix = tuple(jnp.zeros((config.num_layers, 2, 4, config.num_kv_heads, config.head_dim)) for _ in range(2))
    with pytest.raises(ValueError, match="runs from a MixerPrefix"):
        run_layers(params, h, config, run=LayerRun(prefix=prefix))
    with pytest.raises(ValueError, match="clean_key_values .* not implemented for a model with linear-attention"):
        clean_key_values(params, jnp.stack([h] * (config.num_layers + 1)), config)


def test_decoding_with_the_recurrent_cache_is_rerunning_the_whole_sequence(hybrid):
    """Greedy decoding carries each linear-attention layer's state (and the attention layer's keys
    and values) from the prompt through every new token; each new token equals the argmax of a
    forward on the whole sequence so far. Ragged prompts in one batch: a padded prompt's state is
    its own, not the padding's."""
    from jaxdepth.core.decoding import generate

    _, params, config, tokens, _ = hybrid
    lengths, new = (40, 23), 12
    valid = np.arange(40)[None] < np.array(lengths)[:, None]
    got = np.asarray(
        generate(params, jnp.asarray(tokens[:, :40]), config, max_new_tokens=new, valid=jnp.asarray(valid)).tokens
    )
    width = max(lengths) + new  # one shape for every rerun, its mask marking the sequence so far
    for b, n in enumerate(lengths):
        sequence = np.zeros((1, width), np.int64)
        sequence[0, :n] = tokens[b, :n]
        for t in range(n, n + new):
            logits = jax_logits(params, sequence, config, np.arange(width)[None] < t)
            sequence[0, t] = logits[0, t - 1].argmax()
        assert got[b].tolist() == sequence[0, n : n + new].tolist(), b


def test_decoding_under_layer_orders_carries_each_steps_own_state(hybrid):
    """Under a layer order each step keeps its own cache (a repeated linear-attention layer two
    states): `generate_orders` (layer-major, each distinct layer of a step once) gives each order
    what `generate(order=...)` gives it, and a dropped linear-attention layer decodes as that
    layer skipped (its residual passed on unchanged, every token)."""
    from jaxdepth.core import sites
    from jaxdepth.core.decoding import generate, generate_orders
    from jaxdepth.core.structure import (
        drop_block,
        group_orders,
        identity_order,
        parallel_block,
        stack_orders,
        swap_pair,
    )

    _, params, config, tokens, _ = hybrid
    L, new = config.num_layers, 8
    lengths = (30, 17)
    prompt, valid = jnp.asarray(tokens[:, :30]), jnp.asarray(np.arange(30)[None] < np.array(lengths)[:, None])
    orders = [identity_order(L), drop_block(L, 1, 1), swap_pair(L, 1), parallel_block(L, 0, 2)]
    decode = jax.jit(generate, static_argnames=("config", "max_new_tokens"))
    together = generate_orders(
        params, prompt, config, group_orders(stack_orders(orders), L), valid=valid, max_new_tokens=new
    )
    for i, order in enumerate(orders):
        alone = decode(params, prompt, config, max_new_tokens=new, valid=valid, order=order)
        assert np.array_equal(together.tokens[i], alone.tokens), i
    skipped = sites.replace("delta", 1, jnp.ones(1, bool), jnp.zeros(config.hidden_size))
    as_skipped = decode(params, prompt, config, max_new_tokens=new, valid=valid, interventions=skipped)
    assert np.array_equal(together.tokens[1], as_skipped.tokens)
    assert not np.array_equal(together.tokens[1], together.tokens[0])  # the dropped layer matters


@pytest.mark.parametrize("boundary", [0, 2, 3])
def test_pieces_from_the_clean_prefix_are_the_whole_run(hybrid, boundary):
    """Erasure's suffix runs: an edit at position t of boundary b, the layers after b run in
    pieces from the piece holding t, each linear-attention layer from its state there (recomputed
    from its clean inputs before the piece) and the attention layer against the clean keys; every
    position from that piece on equals the whole run with the edit."""
    from jaxdepth.analyses.erasure import clean_run
    from jaxdepth.core.batch import PromptArrays
    from jaxdepth.core import sites
    from jaxdepth.core.loops import Pieces, final_residual, run_layers, run_layers_in_pieces
    from jaxdepth.core.model import embed

    _, params, config, tokens, _ = hybrid
    T, width, position = 48, 8, 21
    prompt = jnp.asarray(tokens[:1, :T])
    valid = jnp.ones((1, T), bool)
    arrays = PromptArrays(prompt, valid, jnp.asarray([T - 2]))
    hs, keys, values, _ = clean_run(params, arrays, config)
    value = jnp.asarray(np.random.default_rng(0).standard_normal(config.hidden_size), hs.dtype)
    edit = lambda rows: sites.replace("resid_pre", boundary, rows == position, value)  # noqa: E731
    first = position // width
    got = run_layers_in_pieces(
        params,
        hs[boundary],
        boundary,
        (keys, values),
        valid,
        config,
        pieces=Pieces(first, T // width - 1, width),
        interventions_of=lambda rows: (edit(rows),),
        clean_inputs=hs,
    )
    whole = run_layers(params, embed(params, prompt, config), config, valid=valid, interventions=edit(jnp.arange(T)))[0]
    got, whole = np.asarray(final_residual(got, config, ())), np.asarray(whole)
    start = first * width
    np.testing.assert_allclose(got[:, start:], whole[:, start:], rtol=0, atol=1e-4 * np.abs(whole).max())
    assert np.abs(whole[:, position:] - np.asarray(hs[-1][:, position:])).max() > 1e-2  # the edit matters
