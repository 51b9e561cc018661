"""The mixture-of-experts families against transformers: each feature that sets a family apart
moves the logits by orders of magnitude past the parity tolerance (so the parity of
`test_parity.py` is evidence of each), and YaRN's frequencies are transformers' bits."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.layer import rotary_frequencies
from test_parity import TOL_TINY, _with_layer, converted, hf_logits, jax_logits

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.parity


def _without(params, *names):
    return {**params, "layers": {k: v for k, v in params["layers"].items() if k not in names}}


def _mistakes(params, config, folder: str) -> dict:
    """What a plausible mistake in each family feature would compute: `(params, config)`."""
    layers = params["layers"]
    zero = lambda name: _with_layer(params, name, jnp.zeros_like(layers[name]))  # noqa: E731
    changed = lambda **c: (params, dataclasses.replace(config, **c))  # noqa: E731
    mistakes = {
        "weights renormalised or not the other way": changed(
            normalize_expert_weights=not config.normalize_expert_weights
        ),
        "one expert fewer per token": changed(experts_per_token=config.experts_per_token - 1),
        "gate and up swapped": (
            {**params, "layers": {**layers, "expert_gate": layers["expert_up"], "expert_up": layers["expert_gate"]}},
            config,
        ),
    }
    if config.model_type == "gpt_oss":
        mistakes.update(
            {
                "sinks dropped": (_without(params, "sinks"), dataclasses.replace(config, attention_sinks=False)),
                "GLU not clamped": changed(glu_limit=1e6),
                "YaRN ignored": changed(rope_type="default", rope_attention_factor=1.0),
                "router bias dropped": (zero("router_bias"), config),
                "expert biases dropped": (zero("expert_down_bias"), config),
            }
        )
    if config.model_type == "deepseek_v3":
        mistakes.update(
            {
                "rotary pairs read as halves": (_converted_as(folder, config, rope_interleaved=False), config),
                "router correction ignored": (zero("router_correction"), config),
                "groups ignored": changed(router_groups=1),
                "weights not scaled": changed(expert_scale=1.0),
                "shared expert dropped": (zero("shared_down"), config),
                "softmax router": changed(router="softmax"),
                "scores not scaled by YaRN's mscale": changed(attn_scale=config.head_dim**-0.5),
            }
        )
    return mistakes


def _converted_as(folder, config, **changes):
    """The checkpoint in `folder` converted as if its config said `changes`."""
    import glob

    from conversion.hf_layouts import hf_source
    from conversion.layout import assemble_params
    from conversion.safetensors_io import read_safetensors

    tensors = {k: v for path in glob.glob(f"{folder}/*.safetensors") for k, v in read_safetensors(path).items()}
    as_said = dataclasses.replace(config, **changes)
    params = assemble_params(as_said, *hf_source(as_said, tensors))
    return {"layers": {k: jnp.asarray(v) for k, v in params.pop("layers").items()}, **params}


@pytest.mark.parametrize(
    "variant", ["mixtral_experts", "qwen3_moe_experts", "olmoe_experts", "gpt_oss_sinks", "deepseek_v3_latent"]
)
def test_each_feature_of_the_mixtures_moves_the_logits_far_past_the_tolerance(tiny_model, variant):
    tiny = tiny_model(variant)
    params, config = converted(tiny)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, size=(1, 300))
    ref = hf_logits(tiny.model, tokens)
    assert float(np.abs(jax_logits(params, tokens, config) - ref).max()) <= TOL_TINY
    for name, (p, c) in _mistakes(params, config, tiny.folder).items():
        e = float(np.abs(jax_logits(p, tokens, c) - ref).max())
        print(f"\n[parity] sensitivity, {variant} with {name}: max |logit diff| = {e:.3e}")
        assert e > 100 * TOL_TINY, name


# YaRN settings: GPT-OSS's (no truncation), Qwen3's long-context recipe (truncated by default),
# DeepSeek-V3's (mscale over mscale_all_dim), and one whose ramp collapses to a point.
YARN = {
    "gpt-oss": (
        150000.0,
        64,
        dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    ),
    "qwen3": (1e6, 128, dict(factor=4.0, original_max_position_embeddings=32768)),
    "deepseek-v3": (
        10000.0,
        64,
        dict(
            factor=40.0,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
            original_max_position_embeddings=4096,
        ),
    ),
    "narrow ramp": (12345.0, 16, dict(factor=4.0, beta_fast=8.0, beta_slow=8.0, original_max_position_embeddings=64)),
}


@pytest.mark.parametrize("name", sorted(YARN))
def test_yarn_frequencies_and_scale_are_transformers(name):
    """Bit for bit where torch's float32 power is correctly rounded (as the other rope types,
    `test_parity.test_rotary_frequencies_are_hf_bits`), within 2 ulps at its near-ties; the cos
    and sin scale exactly transformers' float."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta, head_dim, scaling = YARN[name]
    hf_config = transformers.LlamaConfig(
        vocab_size=8,
        hidden_size=4 * head_dim,
        intermediate_size=8,
        num_attention_heads=4,
        num_hidden_layers=1,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "rope_theta": theta, **scaling},
    )
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    config = ModelConfig.from_hf(hf_config.to_dict())
    ours = rotary_frequencies(config)
    assert config.rope_type == "yarn" and config.rope_attention_factor == scale
    ulps = np.abs(ours.view(np.int32).astype(np.int64) - inv_freq.numpy().view(np.int32))
    print(
        f"\n[parity] yarn frequencies, {name}: {int((ulps > 0).sum())} of {ulps.size} differ "
        f"(at most {ulps.max()} ulps)"
    )
    assert ulps.max() <= 2
