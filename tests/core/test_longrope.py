"""Phi-3's long-context rotary scaling ('longrope'): short factors for a prompt within the
original context, long ones beyond it, cos and sin scaled by the attention factor; each prompt
chooses for itself in a padded batch, and decoding switches where transformers' generate does."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conversion.hf import convert_hf_folder
from jaxdepth.core.config import ModelConfig, UnsupportedConfigError
from jaxdepth.core.decoding import generate
from jaxdepth.core.layer import longrope_rows
from jaxdepth.core.model import forward

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.parity

VARIANT = "phi3_longrope"  # original context 24 tokens (tests/conftest.py)
TOL = 1e-4


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(np.asarray(tokens)[None], dtype=torch.long)).logits[0].numpy()


def test_the_config_reads_transformers_longrope_settings(tiny_model):
    tiny = tiny_model(VARIANT)
    config = convert_hf_folder(tiny.folder).config
    rope = tiny.config.rope_parameters
    assert config.rope_type == "longrope" and config.rope_original_max_position == 24
    assert config.rope_short_factor == tuple(rope["short_factor"]) and config.rope_long_factor == tuple(
        rope["long_factor"]
    )
    # transformers' default: sqrt(1 + ln(512 / 24) / ln 24), the context ratio as the factor
    assert config.rope_attention_factor == pytest.approx(np.sqrt(1 + np.log(512 / 24) / np.log(24)))
    hf = tiny.hf_config_json()
    with pytest.raises(UnsupportedConfigError, match="long_factor"):
        ModelConfig.from_hf(
            {**hf, "rope_parameters": {k: v for k, v in hf["rope_parameters"].items() if k != "long_factor"}}
        )


def test_short_and_long_prompts_and_a_batch_of_both_match_transformers(tiny_model):
    tiny = tiny_model(VARIANT)
    weights = convert_hf_folder(tiny.folder)
    config = weights.config
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, n) for n in (24, 25, 60)]  # at, just past, far past
    T = max(map(len, prompts))
    tokens, valid = np.zeros((3, T), np.int32), np.zeros((3, T), bool)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)], valid[b, : len(p)] = p, True
    assert np.asarray(longrope_rows(jnp.asarray(valid), config)).tolist() == [False, True, True]
    batched = np.asarray(forward(weights.params, jnp.asarray(tokens), config, valid=jnp.asarray(valid)))
    for b, p in enumerate(prompts):
        ref = hf_logits(tiny.model, p)
        alone = np.asarray(forward(weights.params, jnp.asarray(p[None]), config))[0]
        print(f"\n[parity] {VARIANT}, {len(p)} tokens: max |logit diff| = {np.abs(alone - ref).max():.3e}")
        np.testing.assert_allclose(alone, ref, rtol=TOL, atol=TOL * np.abs(ref).max())
        np.testing.assert_allclose(batched[b, : len(p)], ref, rtol=TOL, atol=TOL * np.abs(ref).max())
        assert np.array_equal(alone.argmax(-1), ref.argmax(-1))
    # the other factor set is far off: the choice is what the test checks
    other = dict(rope_short_factor=config.rope_long_factor, rope_long_factor=config.rope_short_factor)
    import dataclasses

    swapped = np.asarray(forward(weights.params, jnp.asarray(prompts[1][None]), dataclasses.replace(config, **other)))[
        0
    ]
    assert np.abs(swapped - hf_logits(tiny.model, prompts[1])).max() > 100 * TOL


def test_greedy_decoding_across_the_original_context_equals_transformers(tiny_model):
    """Prompts of 18 and 12 tokens, 16 new tokens each: both cross position 24, where
    transformers' generate takes the long factors for the new tokens (the cached keys keep
    their short ones)."""
    tiny = tiny_model(VARIANT)
    weights = convert_hf_folder(tiny.folder)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, weights.config.vocab_size, n) for n in (18, 12)]
    T = max(map(len, prompts))
    tokens, valid = np.zeros((2, T), np.int32), np.zeros((2, T), bool)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)], valid[b, : len(p)] = p, True
    got = generate(weights.params, jnp.asarray(tokens), weights.config, valid=jnp.asarray(valid), max_new_tokens=16)
    for b, p in enumerate(prompts):
        with torch.no_grad():
            # an end-of-sequence id no vocabulary has: decoding here neither stops at the model's own
            # end token nor masks it (min_new_tokens would, where the model's argmax is that token)
            expected = tiny.model.generate(
                torch.tensor(p[None]), max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=10**9
            )[0, len(p) :].tolist()
        assert np.asarray(got.tokens[b]).tolist() == expected, b
