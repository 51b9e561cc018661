"""Generation counts each prompt's real length against the context, not its padded length: a
31-token prompt padded to 32 takes 33 new tokens on a 64-token context (its positions 0..63),
decoding exactly as the prompt alone; 34 are refused, naming the prompt. Rotary positions
(a tiny llama), learned ones (a tiny GPT-2 with a 64-position table, against transformers'
greedy generate) and `Model.generate`, which pads to a length bucket."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import tiny_config, tiny_hf_config, tiny_tokenizer
from jaxdepth.core.decoding import generate
from jaxdepth.core.model import random_params

CONTEXT = 64
STATIC = ("config", "max_new_tokens")
decode = jax.jit(generate, static_argnames=STATIC)
PROMPT = [int(t) for t in (np.arange(31) * 7 + 3) % 90 + 1]  # 31 tokens


def padded(prompts, T):
    """Right-padded token ids `[B, T]` and their mask."""
    tokens, valid = np.zeros((len(prompts), T), np.int32), np.zeros((len(prompts), T), bool)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)], valid[i, : len(p)] = p, True
    return tokens, valid


def alone(params, config, prompt, new):
    """The prompt decoded unpadded, a batch of its own."""
    tokens = np.asarray([prompt], np.int32)
    return np.asarray(decode(params, tokens, config, valid=np.ones(tokens.shape, bool), max_new_tokens=new).tokens[0])


def test_the_real_length_counts_not_the_padded_one():
    config = tiny_config(max_position_embeddings=CONTEXT)
    params = random_params(config, seed=3, scale=0.3)
    tokens, valid = padded([PROMPT, PROMPT[:9]], 32)  # the longest prompt padded to a bucket of 32
    out = generate(params, tokens, config, valid=valid, max_new_tokens=CONTEXT - 31)  # checked: valid is concrete
    assert np.array_equal(np.asarray(out.tokens[0]), alone(params, config, PROMPT, CONTEXT - 31))
    assert np.array_equal(np.asarray(out.tokens[1]), alone(params, config, PROMPT[:9], CONTEXT - 31))
    with pytest.raises(ValueError, match="prompt 0 has 31 tokens: with 34 new tokens they exceed the model's context"):
        generate(params, tokens, config, valid=valid, max_new_tokens=CONTEXT - 30)
    # padding past the context itself: the prefill would run positions the model does not have
    wide, wide_valid = padded([PROMPT[:9]], CONTEXT + 8)
    with pytest.raises(ValueError, match=f"padded to {CONTEXT + 8} positions, past the model's context"):
        generate(params, wide, config, valid=wide_valid, max_new_tokens=4)


@pytest.mark.parity
def test_learned_positions_fill_the_context_as_transformers_does(tmp_path):
    """GPT-2's learned position table has exactly 64 rows: the decoding uses positions 0..62 of
    the prompt padded to 32 (the 64th token is read off, never fed back) and gives transformers'
    greedy tokens of the prompt alone."""
    torch = pytest.importorskip("torch")
    from conversion.hf import convert_hf_folder

    hf_config, model_class = tiny_hf_config("gpt2")
    hf_config.n_positions = CONTEXT
    torch.manual_seed(0)
    model = model_class(hf_config).eval()
    model.save_pretrained(str(tmp_path))
    weights = convert_hf_folder(str(tmp_path))
    assert weights.config.max_position_embeddings == CONTEXT and weights.config.positions == "learned"
    tokens, valid = padded([PROMPT], 32)
    got = generate(weights.params, tokens, weights.config, valid=valid, max_new_tokens=CONTEXT - 31)
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=CONTEXT - 31,
            min_new_tokens=CONTEXT - 31,
            do_sample=False,
            pad_token_id=0,
        )[0, 31:].tolist()
    assert np.asarray(got.tokens[0]).tolist() == expected


def test_model_generate_counts_the_prompt_not_its_bucket():
    """`Model.generate` pads a 31-token prompt to its bucket (32) and still takes 33 new tokens
    on a 64-token context, the same text as the prompt decoded alone; 34 are refused."""
    from jaxdepth.lab.loaded_model import Model

    tokenizer = tiny_tokenizer()
    config = tiny_config(vocab_size=len(tokenizer), max_position_embeddings=CONTEXT)
    model = Model(random_params(config, 0, scale=0.3), config, tokenizer, "tiny")
    words = "the cat sat on a mat and then the dog ran to the park to play with a red ball".split()
    text = next(
        " ".join(words[:n] * 3)[:k]
        for n in range(1, len(words) + 1)
        for k in range(1, 3 * len(" ".join(words[:n])) + 1)
        if len(model.encode(" ".join(words[:n] * 3)[:k])) == 31
    )
    ids = model.encode(text)
    assert len(ids) == 31
    expected = alone(model.params, config, [int(t) for t in ids], CONTEXT - 31)
    eos = tokenizer.eos_token_id
    kept = [int(t) for t in expected if t != eos]
    assert model.generate(text, max_new_tokens=CONTEXT - 31) == [tokenizer.decode(kept, skip_special_tokens=True)]
    with pytest.raises(ValueError, match="prompt 0 has 31 tokens"):
        model.generate(text, max_new_tokens=CONTEXT - 30)
