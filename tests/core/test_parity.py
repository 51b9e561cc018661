"""Parity with Hugging Face transformers (PyTorch, float32): the foundation of every analysis.

jaxdepth runs at `jax.default_matmul_precision("highest")` in float32. Measured max abs logit
differences are printed (`pytest -s`).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import HYBRID_VARIANTS, TINY_VARIANTS, shared_data_path, write_tiny_gguf
from conversion.gguf_file import convert_gguf
from conversion.hf import convert_hf_folder
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.layer import rotary_frequencies
from jaxdepth.core.model import forward

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.parity

TOL_TINY = 1e-4
TOL_SMOLLM2 = 1e-3

_forward = jax.jit(forward, static_argnames="config")
# The hybrids' linear attention is compared with a float64 reference (`test_parity_hybrid.py`):
# transformers' own float32 run of them is farther than TOL_TINY from its float64 one.
FLOAT32_VARIANTS = sorted(set(TINY_VARIANTS) - set(HYBRID_VARIANTS))


def jax_logits(params, tokens, config, valid=None) -> np.ndarray:
    with jax.default_matmul_precision("highest"):
        return np.asarray(
            _forward(
                params, jnp.asarray(tokens, jnp.int32), config, valid=None if valid is None else jnp.asarray(valid)
            )
        )


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long))
    return out.logits.float().numpy()


def converted(tiny):
    c = convert_hf_folder(tiny.folder)
    return jax.tree.map(jnp.asarray, c.params), c.config


@pytest.mark.parametrize("variant", FLOAT32_VARIANTS)
def test_tiny_model_logits_match_hf(tiny_model, variant):
    tiny = tiny_model(variant)
    params, config = converted(tiny)
    assert config.rope_theta == (0.0 if config.positions == "learned" else 12345.0)
    # (a config whose layers differ, Gemma 4's, answers per layer: its first layer's, a sliding one)
    hf = tiny.config.per_layer_config[0] if getattr(tiny.config, "is_heterogeneous", False) else tiny.config
    assert config.num_kv_heads == getattr(hf, "num_key_value_heads", config.num_heads)
    assert config.tie_word_embeddings == tiny.config.tie_word_embeddings
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, size=(2, 300))
    ours = jax_logits(params, tokens, config)
    ref = hf_logits(tiny.model, tokens)
    diff = float(np.abs(ours - ref).max())
    print(f"\n[parity] {variant}: T=300, max |logit diff| = {diff:.3e} (logit scale {np.abs(ref).max():.2f})")
    assert ours.shape == ref.shape == (2, 300, config.vocab_size)
    by_position = np.abs(ours - ref).max(axis=(0, 2))
    # a difference that grows with the position points at the rotary angles
    assert diff <= TOL_TINY, (
        f"max |logit diff| {diff:.3e} at position {int(by_position.argmax())}; "
        f"first 50 positions {by_position[:50].max():.3e}, last 50 {by_position[-50:].max():.3e}"
    )


@pytest.mark.parametrize("variant", FLOAT32_VARIANTS)
def test_right_padded_batch_matches_each_prompt_alone(tiny_model, variant):
    tiny = tiny_model(variant)
    params, config = converted(tiny)
    rng = np.random.default_rng(2)
    lengths = (256, 180)
    prompts = [rng.integers(0, config.vocab_size, size=n) for n in lengths]
    T = max(lengths)
    valid = np.zeros((2, T), bool)
    tokens = np.zeros((2, T), np.int64)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
        valid[b, : len(p)] = True
    tokens[1, lengths[1] :] = rng.integers(0, config.vocab_size, size=T - lengths[1])
    ours = jax_logits(params, tokens, config, valid)
    diffs = []
    for b, p in enumerate(prompts):
        ref = hf_logits(tiny.model, p[None])[0]
        diffs.append(float(np.abs(ours[b, : len(p)] - ref).max()))
    print(
        f"\n[parity] {variant} padded batch {lengths}: max |logit diff| per row = "
        + ", ".join(f"{d:.3e}" for d in diffs)
    )
    assert max(diffs) <= TOL_TINY
    # What the padding holds must not matter at all to the valid positions.
    other = tokens.copy()
    other[1, lengths[1] :] = (other[1, lengths[1] :] + 7) % config.vocab_size
    again = jax_logits(params, other, config, valid)
    assert np.array_equal(again[1, : lengths[1]], ours[1, : lengths[1]])
    assert np.array_equal(again[0], ours[0])


def test_parity_is_sensitive(tiny_model):
    """The tolerance is sharp: plausible conversion mistakes fail it by orders of magnitude."""
    tiny = tiny_model("qwen2_gqa_untied")
    params, config = converted(tiny)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, size=(1, 300))
    ref = hf_logits(tiny.model, tokens)

    def err(p, c):
        return float(np.abs(jax_logits(p, tokens, c) - ref).max())

    assert err(params, config) <= TOL_TINY
    mistakes = {
        "default rope_theta": (params, dataclasses.replace(config, rope_theta=10000.0)),
        "q bias dropped": (_with_layer(params, "q_bias", jnp.zeros_like(params["layers"]["q_bias"])), config),
        "norm weights ignored": (
            _with_layer(params, "attn_norm", jnp.ones_like(params["layers"]["attn_norm"])),
            config,
        ),
        "kv heads swapped": (_with_layer(params, "k", _swap_kv_heads(params["layers"]["k"], config)), config),
    }
    for name, (p, c) in mistakes.items():
        e = err(p, c)
        print(f"\n[parity] sensitivity, {name}: max |logit diff| = {e:.3e}")
        assert e > 100 * TOL_TINY, name


@pytest.mark.parametrize(
    "variant,mistake", [("llama31_rope_scaled", "rope scaling ignored"), ("qwen3_gqa", "q/k norm weights ignored")]
)
def test_parity_is_sensitive_to_rope_scaling_and_qk_norms(tiny_model, variant, mistake):
    tiny = tiny_model(variant)
    params, config = converted(tiny)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, size=(1, 300))
    ref = hf_logits(tiny.model, tokens)
    if mistake == "rope scaling ignored":
        assert config.rope_type == "llama3" and config.rope_original_max_position == 64
        wrong_params, wrong_config = params, dataclasses.replace(config, rope_type="default")
    else:
        assert config.qk_norm and config.head_dim == 24
        ones = {k: jnp.ones_like(params["layers"][k]) for k in ("q_norm", "k_norm")}
        wrong_params, wrong_config = {**params, "layers": {**params["layers"], **ones}}, config
    assert float(np.abs(jax_logits(params, tokens, config) - ref).max()) <= TOL_TINY
    e = float(np.abs(jax_logits(wrong_params, tokens, wrong_config) - ref).max())
    print(f"\n[parity] sensitivity, {variant} with {mistake}: max |logit diff| = {e:.3e}")
    assert e > 100 * TOL_TINY


# Rotary settings of the studied families and of the tiny variants: (rope_theta, head_dim, llama3 scaling).
_LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
ROTARY_SETTINGS = {
    "qwen2.5": (1e6, 128, None),
    "qwen2.5-math": (1e4, 128, None),
    "smollm2": (1e5, 64, None),
    "llama3.1": (5e5, 128, _LLAMA31),
    "llama3.2-1b": (5e5, 64, {**_LLAMA31, "factor": 32.0}),
    "tiny": (12345.0, 16, None),
    "tiny-qwen3": (12345.0, 24, None),
    "tiny-llama31": (12345.0, 16, TINY_VARIANTS["llama31_rope_scaled"]["rope_scaling"]),
    "odd": (1234567.0, 80, {**_LLAMA31, "factor": 6.0, "original_max_position_embeddings": 4096}),
}


@pytest.mark.parametrize("name", sorted(ROTARY_SETTINGS))
def test_rotary_frequencies_are_hf_bits(name):
    """The frequencies are HF's, bit for bit, wherever torch's float32 power is correctly rounded
    (its vectorised power is an ulp off on a few near-ties, which ones depending on the CPU);
    at those, and the llama3 blend's steps after them, at most 2 ulps. A frequency off by 1e-5
    moves a tiny model's late logits by 3e-4, so this is checked here, not left to the logits."""
    import transformers

    theta, head_dim, scaling = ROTARY_SETTINGS[name]
    hf_config = transformers.LlamaConfig(
        vocab_size=8,
        hidden_size=4 * head_dim,
        intermediate_size=8,
        num_attention_heads=4,
        num_hidden_layers=1,
        rope_theta=theta,
        max_position_embeddings=131072,
        rope_scaling=scaling,
    )
    hf = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config).inv_freq.numpy()
    ours = rotary_frequencies(ModelConfig.from_hf(hf_config.to_dict()))
    assert isinstance(ours, np.ndarray) and ours.dtype == np.float32 and ours.shape == hf.shape

    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    torch_power = (theta**exponents).numpy()
    rounded_power = (np.float64(np.float32(theta)) ** exponents.numpy().astype(np.float64)).astype(np.float32)
    near_ties = torch_power != rounded_power
    ulps = np.abs(ours.view(np.int32).astype(np.int64) - hf.view(np.int32))
    print(
        f"\n[parity] rotary frequencies, {name}: {int((ulps > 0).sum())} of {ulps.size} differ "
        f"(at most {int(ulps.max())} ulps); torch's power is not correctly rounded at {int(near_ties.sum())}"
    )
    assert not (ulps > 0)[~near_ties].any()
    assert ulps.max() <= (1 if scaling is None else 2)


def _with_layer(params, key, value):
    return {**params, "layers": {**params["layers"], key: value}}


def _swap_kv_heads(k, config):
    L, D, _ = k.shape
    k = k.reshape(L, D, config.num_kv_heads, config.head_dim)
    return k[:, :, ::-1].reshape(L, D, -1)


@pytest.mark.parametrize("variant", ["llama_gqa_untied", "llama_mha_tied"])
def test_tiny_gguf_matches_transformers_gguf_loader(tiny_model, tmp_path, variant):
    """A GGUF written like llama.cpp's converter: transformers' GGUF loader and jaxdepth's
    converter must both recover the original model (checks the q/k row un-permutation)."""
    from transformers import AutoModelForCausalLM

    tiny = tiny_model(variant)
    path = write_tiny_gguf(tiny, str(tmp_path / "tiny.gguf"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).eval()
    c = convert_gguf(path, load_tokenizer=False)
    tokens = np.random.default_rng(4).integers(0, c.config.vocab_size, size=(1, 256))
    ours = jax_logits(jax.tree.map(jnp.asarray, c.params), tokens, c.config)
    original = hf_logits(tiny.model, tokens)
    via_hf_gguf = hf_logits(hf, tokens)
    d_hf, d_orig = float(np.abs(ours - via_hf_gguf).max()), float(np.abs(ours - original).max())
    print(
        f"\n[parity] {variant} via GGUF: max |logit diff| vs transformers' GGUF loader = {d_hf:.3e}, "
        f"vs the original model = {d_orig:.3e}"
    )
    assert d_hf <= TOL_TINY and d_orig <= TOL_TINY


# ----------------------------------------------------------------------------- real model


def _gsm8k_text(tokenizer, min_tokens: int = 128) -> str:
    with open(shared_data_path("gsm8k_test_sample.jsonl")) as f:
        records = [json.loads(line) for line in f]
    text = ""
    for r in records:
        text += r["question"] + "\n" + r["answer"] + "\n\n"
        if len(tokenizer(text)["input_ids"]) >= min_tokens:
            return text
    raise AssertionError("GSM8K sample too short")


@pytest.mark.slow(seconds=90)  # loading the GGUF through transformers: about 70 s
def test_smollm2_matches_transformers_gguf_loader(smollm2, smollm2_hf):
    assert smollm2.tokenizer is not None
    text = _gsm8k_text(smollm2.tokenizer)
    ids = smollm2.encode(text)
    assert ids.ndim == 1 and len(ids) >= 100
    with jax.default_matmul_precision("highest"):
        ours = smollm2.logits(ids[None])
    ref = hf_logits(smollm2_hf, ids[None])
    assert ours.shape == ref.shape == (1, len(ids), smollm2.config.vocab_size)
    diff = float(np.abs(ours - ref).max())
    agree = float(np.mean(ours.argmax(-1) == ref.argmax(-1)))
    print(
        f"\n[parity] SmolLM2-135M-Instruct Q4_1 GGUF, T={len(ids)}: max |logit diff| = {diff:.3e}, "
        f"argmax agreement = {agree:.4f} (logit scale {np.abs(ref).max():.1f})"
    )
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
    assert diff <= TOL_SMOLLM2


@pytest.mark.slow(seconds=90)  # transformers' model of the GGUF, if this worker has not loaded it yet
def test_smollm2_greedy_generation_matches_transformers(smollm2, smollm2_hf):
    """Three prompts of different lengths decoded together (right-padded) by jaxdepth, each
    against transformers' greedy generate of that prompt alone: the same new tokens, 32 or up
    to the end-of-sequence token, where both stop."""
    from jaxdepth.core.decoding import Decoding, generate

    prompts = [smollm2.encode(text) for text in ("The capital of France is", "1, 2, 3,", "Water boils at a")]
    T, new, eos = max(map(len, prompts)), 32, smollm2.tokenizer.eos_token_id
    tokens, valid = np.zeros((3, T), np.int32), np.zeros((3, T), bool)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)], valid[i, : len(p)] = p, True
    decode = jax.jit(generate, static_argnames=("config", "max_new_tokens"))
    got = decode(
        smollm2.params, tokens, smollm2.config, valid=valid, max_new_tokens=new, decoding=Decoding(eos_ids=(eos,))
    )
    for i, p in enumerate(prompts):
        with torch.no_grad():
            expected = smollm2_hf.generate(
                torch.tensor(p[None].astype(np.int64)), max_new_tokens=new, do_sample=False, eos_token_id=eos
            )[0, len(p) :].tolist()
        assert np.asarray(got.tokens[i, : int(got.lengths[i])]).tolist() == expected, i
    assert int(got.lengths.max()) == new  # one prompt at least runs to the end


def test_smollm2_config_matches_transformers(smollm2, smollm2_hf_config):
    hf = smollm2_hf_config
    c = smollm2.config
    assert c.model_type == "llama" and not c.qkv_bias
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.intermediate_size) == (
        hf.num_hidden_layers,
        hf.hidden_size,
        hf.num_attention_heads,
        hf.num_key_value_heads,
        hf.intermediate_size,
    )
    theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", getattr(hf, "rope_theta", None))
    assert c.rope_theta == pytest.approx(theta) == 100000.0
    assert c.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert c.tie_word_embeddings


# Each family's features, one at a time switched off in the converted config: parity must fail by
# far more than its tolerance, or the tiny variants would not be testing that feature at all.
FEATURE_MISTAKES = [
    ("mistral_window", "window ignored", {"layer_types": ()}),
    ("gemma2_softcapped", "attention soft-cap ignored", {"attn_softcap": 0.0}),
    ("gemma2_softcapped", "logit soft-cap ignored", {"final_softcap": 0.0}),
    ("gemma2_softcapped", "norm weights taken as w, not 1 + w", {"norm_offset": 0.0}),
    ("gemma2_softcapped", "embeddings not scaled", {"embed_scale": 1.0}),
    ("gemma3_local_rope", "local rotary base ignored", {"local_rope_theta": 0.0}),
    ("gemma3_local_rope", "linear rope scaling ignored", {"rope_type": "default"}),
    ("olmo2_post_norm", "q/k norms ignored", {"qk_norm": False}),
    ("phi3_partial_rotary", "partial rotary ignored", {"rotary_dim": 0}),
    ("phi3_partial_rotary", "window ignored", {"layer_types": ()}),
    ("phi3_longrope", "longrope scaling ignored", {"rope_type": "default"}),
    ("phi3_longrope", "longrope's cos / sin scale ignored", {"rope_attention_factor": 1.0}),
    ("gpt2", "LayerNorm taken as RMSNorm", {"norm": "rms"}),
    ("pythia_parallel", "parallel block run in sequence", {"parallel_residual": False}),
    ("pythia_parallel", "partial rotary ignored", {"rotary_dim": 0}),
    ("neox_sequential", "sequential block run in parallel", {"parallel_residual": True}),
    ("smollm3_nope", "rotary positions on every layer", {"nope_layers": ()}),
    ("smollm3_nope", "rotary positions on no layer", {"nope_layers": (0, 1, 2)}),
    ("gemma4_shared_kv", "proportional rotary's zero frequencies rotating", {"rotary_dim": 0}),
    ("gemma4_shared_kv", "values not normed", {"value_norm": False}),
    ("gemma4_shared_kv", "scores scaled by Dh**-0.5", {"attn_scale": 0.0}),
    ("gemma4_shared_kv", "sliding layers at the full layers' rotary base", {"local_rope_theta": 12345.0}),
    ("gemma4_shared_kv", "per-layer inputs ignored", {"per_layer_input_size": 0}),
    ("gemma4_shared_kv", "logit soft-cap ignored", {"final_softcap": 0.0}),
    ("gemma4_plain", "window ignored", {"sliding_window": 10**4}),
    ("gemma4_plain", "layer scalars ignored", {"layer_scalar": False}),
    ("gemma4_plain", "embeddings not scaled", {"embed_scale": 1.0}),
]


@pytest.mark.parametrize("variant,mistake,changes", FEATURE_MISTAKES, ids=[f"{v}-{m}" for v, m, _ in FEATURE_MISTAKES])
def test_parity_is_sensitive_to_each_family_feature(tiny_model, variant, mistake, changes):
    tiny = tiny_model(variant)
    params, config = converted(tiny)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, size=(1, 300))
    ref = hf_logits(tiny.model, tokens)
    assert float(np.abs(jax_logits(params, tokens, config) - ref).max()) <= TOL_TINY
    e = float(np.abs(jax_logits(params, tokens, dataclasses.replace(config, **changes)) - ref).max())
    print(f"\n[parity] sensitivity, {variant} with {mistake}: max |logit diff| = {e:.3e}")
    assert e > 100 * TOL_TINY, mistake
