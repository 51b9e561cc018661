"""ModelConfig: reading Hugging Face config.json dicts, refusing what is not implemented."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from jaxdepth.core.config import ModelConfig, UnsupportedConfigError

# A transformers-5 style Qwen2 config.json (as written by save_pretrained).
QWEN2_V5 = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "dtype": "float32",
    "eos_token_id": None,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "layer_types": ["full_attention", "full_attention"],
    "max_position_embeddings": 512,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "pad_token_id": None,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 12345.0, "rope_type": "default"},
    "sliding_window": None,
    "tie_word_embeddings": False,
    "transformers_version": "5.23.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 300,
}

# Published config.json files of models the project targets (transformers-4 era: top-level
# rope_theta). DeepSeek-R1-Distill-Qwen-7B:
DEEPSEEK_R1_DISTILL_QWEN_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.44.0",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
}
# Qwen2.5-0.5B:
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
# HuggingFaceTB/SmolLM2-135M (the embedded model's base, in its HF form):
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536,
    "is_llama_config": True,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_interleaved": False,
    "rope_scaling": None,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "vocab_size": 49152,
}


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def with_changes(base, drop=(), **changes):
    d = copy.deepcopy(base)
    for key in drop:
        d.pop(key)
    d.update(changes)
    return d


def test_transformers_5_qwen2_config():
    c = ModelConfig.from_hf(QWEN2_V5)
    assert c == ModelConfig(
        model_type="qwen2",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=12345.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        qkv_bias=True,
    )


def test_from_hf_does_not_modify_its_input():
    d = copy.deepcopy(QWEN2_V5)
    ModelConfig.from_hf(d)
    assert d == QWEN2_V5


def test_rope_theta_from_rope_parameters_and_from_top_level():
    from_params = ModelConfig.from_hf(QWEN2_V5)
    top_level = ModelConfig.from_hf(with_changes(QWEN2_V5, drop=["rope_parameters"], rope_theta=1e6))
    assert from_params.rope_theta == 12345.0
    assert top_level.rope_theta == 1e6
    assert isinstance(top_level.rope_theta, float)
    with pytest.raises(UnsupportedConfigError, match="rope_theta"):
        ModelConfig.from_hf(with_changes(QWEN2_V5, drop=["rope_parameters"]))


def test_head_dim_and_kv_heads_defaults():
    assert ModelConfig.from_hf(QWEN2_V5).head_dim == 64 // 4
    assert ModelConfig.from_hf(with_changes(QWEN2_V5, head_dim=None)).head_dim == 16
    assert ModelConfig.from_hf(with_changes(QWEN2_V5, head_dim=32)).head_dim == 32  # explicit wins
    assert ModelConfig.from_hf(with_changes(QWEN2_V5, drop=["num_key_value_heads"])).num_kv_heads == 4
    assert ModelConfig.from_hf(with_changes(QWEN2_V5, num_key_value_heads=None)).num_kv_heads == 4


def test_biases_and_tying():
    assert ModelConfig.from_hf(QWEN2_V5).qkv_bias
    llama = with_changes(
        QWEN2_V5,
        drop=["max_window_layers", "use_sliding_window", "sliding_window"],
        model_type="llama",
        attention_bias=False,
        architectures=["LlamaForCausalLM"],
    )
    assert not ModelConfig.from_hf(llama).qkv_bias
    assert ModelConfig.from_hf(with_changes(llama, attention_bias=True)).qkv_bias
    assert not ModelConfig.from_hf(with_changes(QWEN2_V5, drop=["tie_word_embeddings"])).tie_word_embeddings
    assert ModelConfig.from_hf(with_changes(QWEN2_V5, tie_word_embeddings=True)).tie_word_embeddings


def test_configs_written_by_transformers_are_accepted(tmp_path):
    transformers = pytest.importorskip("transformers")
    for cls, kwargs in [(transformers.Qwen2Config, {}), (transformers.LlamaConfig, {"attention_bias": False})]:
        cls(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=4321.0,
            **kwargs,
        ).save_pretrained(tmp_path)
        with open(tmp_path / "config.json") as f:
            c = ModelConfig.from_hf(json.load(f))
        assert (c.rope_theta, c.num_kv_heads, c.head_dim, c.num_layers) == (4321.0, 2, 16, 2)


@pytest.mark.parametrize(
    "hf, theta, tied",
    [
        (QWEN25_05B, 1e6, True),
        (DEEPSEEK_R1_DISTILL_QWEN_7B, 1e4, False),
        (SMOLLM2_135M, 1e5, True),
    ],
    ids=["Qwen2.5-0.5B", "DeepSeek-R1-Distill-Qwen-7B", "SmolLM2-135M"],
)
def test_published_configs_of_target_models_are_accepted(hf, theta, tied):
    """Keys that are present but switch nothing on (use_mrope false, rope_interleaved false,
    bookkeeping markers) must not make a target model unloadable."""
    c = ModelConfig.from_hf(hf)
    assert c.rope_theta == theta
    assert c.tie_word_embeddings == tied
    assert c.head_dim == hf["hidden_size"] // hf["num_attention_heads"]


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"model_type": "mamba"}, "model_type"),
        ({"model_type": "gemma3"}, "gemma3_text"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "rope_parameters"),
        ({"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 1e4, "beta_fast": 32}}, "rope_parameters"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            "rope_parameters",
        ),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"use_sliding_window": True, "sliding_window": 16, "layer_types": ["chunked_attention"] * 2}, "layer_types"),
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"pretraining_tp": 2}, "pretraining_tp"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"use_mrope": True}, "use_mrope"),
        ({"rope_interleaved": True}, "rope_interleaved"),
        ({"foo_bar": 1}, "foo_bar"),
    ],
)
def test_unhandled_features_are_refused_by_name(changes, named):
    with pytest.raises(UnsupportedConfigError, match=named):
        ModelConfig.from_hf(with_changes(QWEN2_V5, **changes))


def test_qwen2_slides_where_use_sliding_window_says_from_max_window_layers_on():
    on = ModelConfig.from_hf(
        with_changes(QWEN2_V5, use_sliding_window=True, sliding_window=16, max_window_layers=1, drop=["layer_types"])
    )
    assert on.sliding_window == 16 and on.sliding_layers[0] is False and all(on.sliding_layers[1:])
    off = ModelConfig.from_hf(with_changes(QWEN2_V5, use_sliding_window=False, sliding_window=16))
    assert not any(off.sliding_layers)


@pytest.mark.parametrize(
    "model_type, changes, named",
    [
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ("gpt2", {"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
        ("gpt_neox", {"hidden_act": "relu"}, "hidden_act"),
        ("mistral", {"layer_types": ["chunked_attention"] * 2}, "layer_types"),
    ],
)
def test_family_features_not_reproduced_are_refused_by_name(model_type, changes, named):
    transformers = pytest.importorskip("transformers")
    classes = {"gemma3_text": "Gemma3TextConfig", "gpt_neox": "GPTNeoXConfig", "gpt2": "GPT2Config"}
    cls = getattr(transformers, classes.get(model_type, f"{model_type.capitalize()}Config"))
    hf = cls().to_dict()
    hf.update(changes)
    with pytest.raises(UnsupportedConfigError, match=named):
        ModelConfig.from_hf(hf)


def test_llama3_rope_scaling_from_rope_parameters_and_from_rope_scaling():
    new = ModelConfig.from_hf(
        with_changes(QWEN2_V5, model_type="llama", rope_parameters={**LLAMA3_ROPE, "rope_theta": 5e5})
    )
    old = ModelConfig.from_hf(
        with_changes(QWEN2_V5, model_type="llama", drop=["rope_parameters"], rope_theta=5e5, rope_scaling=LLAMA3_ROPE)
    )
    assert new == old
    assert (
        new.rope_type,
        new.rope_factor,
        new.rope_low_freq_factor,
        new.rope_high_freq_factor,
        new.rope_original_max_position,
        new.rope_theta,
    ) == ("llama3", 8.0, 1.0, 4.0, 8192, 5e5)
    plain = ModelConfig.from_hf(QWEN2_V5)
    assert plain.rope_type == "default" and not plain.qk_norm


def test_qwen3_has_qk_norms_and_its_own_head_dim():
    c = ModelConfig.from_hf(with_changes(QWEN2_V5, model_type="qwen3", head_dim=24, attention_bias=False))
    assert c.qk_norm and c.head_dim == 24 and not c.qkv_bias


def test_shape_constraints():
    with pytest.raises(UnsupportedConfigError, match="multiple"):
        ModelConfig.from_hf(with_changes(QWEN2_V5, num_key_value_heads=3))
    with pytest.raises(UnsupportedConfigError, match="even"):
        ModelConfig.from_hf(with_changes(QWEN2_V5, head_dim=15))


def test_dict_and_json_round_trip_frozen_keyword_only():
    c = ModelConfig.from_hf(QWEN2_V5)
    assert ModelConfig.from_dict(c.to_dict()) == c
    assert ModelConfig.from_dict(json.loads(c.to_json())) == c
    assert hash(c) == hash(ModelConfig.from_dict(c.to_dict()))  # usable as a jit static argument
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_layers = 3
    with pytest.raises(TypeError):
        ModelConfig(*c.to_dict().values())
    with pytest.raises(UnsupportedConfigError, match="model_type"):
        dataclasses.replace(c, model_type="mamba")


# config.json files as the hub serves them (written by transformers 4.x, before `layer_types`
# and `rope_parameters`): the readers must build the layers transformers builds from them.
GPT2_HUB = {
    "activation_function": "gelu_new",
    "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1,
    "bos_token_id": 50256,
    "embd_pdrop": 0.1,
    "eos_token_id": 50256,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2",
    "n_ctx": 1024,
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "resid_pdrop": 0.1,
    "summary_activation": None,
    "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True,
    "summary_type": "cls_index",
    "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "vocab_size": 50257,
}
PYTHIA_70M_HUB = {
    "architectures": ["GPTNeoXForCausalLM"],
    "bos_token_id": 0,
    "eos_token_id": 0,
    "hidden_act": "gelu",
    "hidden_size": 512,
    "initializer_range": 0.02,
    "intermediate_size": 2048,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 2048,
    "model_type": "gpt_neox",
    "num_attention_heads": 8,
    "num_hidden_layers": 6,
    "rotary_emb_base": 10000,
    "rotary_pct": 0.25,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.24.0",
    "use_cache": True,
    "use_parallel_residual": True,
    "vocab_size": 50304,
}
GEMMA2_2B_HUB = {
    "architectures": ["Gemma2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": 1,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "torch_dtype": "float32",
    "transformers_version": "4.42.4",
    "use_cache": True,
    "vocab_size": 256000,
}
GEMMA3_1B_HUB = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "initializer_range": 0.02,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "use_cache": True,
    "vocab_size": 262144,
}


def test_hub_configs_of_the_families_build_the_layers_transformers_builds():
    gpt2 = ModelConfig.from_hf(GPT2_HUB)
    assert (gpt2.positions, gpt2.norm, gpt2.mlp, gpt2.activation, gpt2.intermediate_size) == (
        "learned",
        "layer",
        "plain",
        "gelu_tanh",
        3072,
    )
    pythia = ModelConfig.from_hf(PYTHIA_70M_HUB)
    assert pythia.parallel_residual and pythia.rotated_dims == 16 and pythia.rope_theta == 10000.0
    assert pythia.activation == "gelu" and pythia.qkv_bias and pythia.o_bias
    gemma2 = ModelConfig.from_hf(GEMMA2_2B_HUB)
    assert gemma2.sliding_layers[:4] == (True, False, True, False) and gemma2.sliding_window == 4096
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.attn_scale) == (50.0, 30.0, 256**-0.5)
    gemma3 = ModelConfig.from_hf(GEMMA3_1B_HUB)
    assert gemma3.sliding_layers[:6] == (True,) * 5 + (False,) and gemma3.sliding_window == 512
    assert (gemma3.rope_theta, gemma3.local_rope_theta, gemma3.qk_norm) == (1e6, 1e4, True)
    assert gemma3.attn_softcap == 0.0 and gemma3.final_softcap == 0.0
    transformers = pytest.importorskip("transformers")
    for hub, cls in ((GEMMA2_2B_HUB, transformers.Gemma2Config), (GEMMA3_1B_HUB, transformers.Gemma3TextConfig)):
        theirs = cls(**{k: v for k, v in hub.items() if k not in ("architectures", "model_type")}).layer_types
        ours = ModelConfig.from_hf(hub).sliding_layers
        assert ours == tuple(t == "sliding_attention" for t in theirs)


def test_a_mistral_config_without_a_window_key_slides_at_transformers_default():
    base = {
        "model_type": "mistral",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "rope_theta": 1e4,
    }
    assert ModelConfig.from_hf(base).sliding_window == 4096  # MistralConfig's default
    assert not any(ModelConfig.from_hf({**base, "sliding_window": None}).sliding_layers)  # null: no window
