"""llama.cpp GGUF files -> jaxdepth params, read as transformers' GGUF loader reads them.

The model of a GGUF file is the one `AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`
builds: transformers renames some of llama.cpp's metadata keys to Hugging Face config keys, takes
every other setting from its config class's defaults, and undoes what llama.cpp's converter did to
the weights. `_ARCHS` holds this per architecture; the config it gives is read by the Hugging
Face family readers (`ModelConfig.from_hf`), the tensors by llama.cpp's names
(`conversion.layout.GGUF_NAMES`). Quantized tensors are dequantized with `gguf`.

transformers does not read every key llama.cpp writes. A key it does not read is accepted where
the file's value is the one transformers builds the model with anyway (llama.cpp writes Gemma 2's
soft-caps, which are transformers' defaults) and refused otherwise, as every key no table names:
jaxdepth never builds a model that differs from transformers', nor ignores what a file states.

GPT-OSS ('gpt-oss') files are the exception: transformers (5.24) cannot load any that llama.cpp
writes. Its loader reads the rope scaling, which llama.cpp always writes for GPT-OSS, from
`parts[0]` of each `gpt-oss.rope.scaling.*` field, which is the key's length and not its value,
and raises `TypeError: only 0-dimensional arrays can be converted to Python scalars`. With the
values read instead, it would still leave the experts (`ffn_{gate,up,down}_exps` and their biases)
and the attention sinks (`attn_sinks.weight`) unloaded and randomly initialised: its name map
gives `down_proj` and `sinks` names without llama.cpp's '.weight' and the fused `gate_up_proj` and
the biases none, and its `GptOssTensorProcessor` is registered as 'gpt_oss', which is not the
architecture a file states. jaxdepth reads such a file as that loader means to (its keys,
GptOssConfig's defaults, its rope scaling settings) and the tensors as llama.cpp's converter wrote
them, which gives back the model that was converted.

Nor can transformers (5.24) load a Gemma 4 ('gemma4') file whole. Its name map gives each layer's
`layer_scalar` the name `blk.{i}.layer_output_scale`, without the '.weight' llama.cpp writes, so
the scalars stay unloaded (initialised to 1) in every file; and it builds the per-layer embeddings
Gemma4TextConfig's 262144 tokens tall whatever the file's vocabulary, so a file of another fails to
load (`ignore_mismatched_sizes`). jaxdepth reads such a file as that loader means to: its keys
(the full-attention layers' head width from `key_length`; neither rotary base), Gemma4TextConfig's
defaults for the rest (sliding heads 256 wide, per-layer inputs 256 wide, five sliding layers in
six, no shared keys and values, no soft-cap, 'proportional' rotary on a quarter of the full
layers' frequencies at base 1e6 and base 1e4 on the sliding layers), llama.cpp's keys that
transformers does not read accepted only at those values, the per-layer embeddings one row per
token of the file's vocabulary, the scalars read.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping

import numpy as np

from conversion.errors import ConversionError
from conversion.layout import GGUF_NAMES, assemble_params, gguf_source
from jaxdepth.core.config import ModelConfig, UnsupportedConfigError
from jaxdepth.core.weights import ModelWeights

__all__ = [
    "unpermute_rotary_rows",
    "gguf_config",
    "convert_gguf",
]


def unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (`[out, in]` layout, `n_heads` heads)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute_llama(name: str, w: np.ndarray, config: ModelConfig) -> np.ndarray:
    """llama.cpp permutes the rows of Llama's q and k projections (weights and biases) into its
    own rotary layout; transformers undoes it for files of the 'llama' architecture only."""
    if ".attn_q." in name:
        return unpermute_rotary_rows(w, config.num_heads)
    if ".attn_k." in name:
        return unpermute_rotary_rows(w, config.num_kv_heads)
    return w


def _gemma_norms(name: str, w: np.ndarray, config: ModelConfig) -> np.ndarray:
    """llama.cpp stores Gemma's norm weights (all of them, q/k norms included) as 1 + w, the
    factor they scale by; transformers subtracts the 1 again, in float32, and so does this."""
    return w - np.float32(1) if name.endswith("norm.weight") else w


# llama.cpp's metadata keys (after '<architecture>.') -> the Hugging Face config keys transformers
# renames them to (`transformers.integrations.ggml.GGUF_CONFIG_MAPPING`).
_DECODER_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
_GEMMA_KEYS = {**_DECODER_KEYS, "attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"}
# Keys transformers does not read, and the `ModelConfig` field (or property) the file's value must
# equal: llama.cpp writes the head size of most architectures twice, and the rotary width.
_HEAD_SIZES = {"attention.key_length": "head_dim", "attention.value_length": "head_dim"}
_ROTARY_WIDTH = {"rope.dimension_count": "rotated_dims"}


@dataclasses.dataclass(frozen=True)
class _Arch:
    """How transformers reads a llama.cpp architecture.

    `model_type`: the Hugging Face family it builds. `keys`: the metadata keys it reads, renamed
    to config keys. `defaults`: what its config class supplies where the file is silent (only
    where jaxdepth's reader of the family would assume otherwise, or needs the key). `unread`:
    keys llama.cpp writes that it does not read -> the `ModelConfig` field (or the function of
    it) whose value the file's must equal (None: no effect on the model). `fix`: its change to a
    tensor (GGUF name, array).
    `rope_scaling`: the `rope.scaling.*` keys its loader gathers for the architecture into the
    rope settings that replace the config class's (`rope_scaling`), under the names it gives them;
    it does so only where the file states the type."""

    model_type: str
    keys: Mapping[str, str]
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    unread: Mapping[str, str | Callable[[ModelConfig], Any] | None] = dataclasses.field(default_factory=dict)
    fix: Callable[[str, np.ndarray, ModelConfig], np.ndarray] | None = None
    rope_scaling: Mapping[str, str] = dataclasses.field(default_factory=dict)


def _sliding_layers(config: ModelConfig) -> list:
    """Which layers attend within a window, as llama.cpp's `sliding_window_pattern` says it."""
    return [t == "sliding" for t in config.layer_types]


def _shared_kv_layer_count(config: ModelConfig) -> int:
    """How many of the last layers reuse earlier layers' keys and values."""
    return len(config.shared_kv_layers)


_ARCHS = {
    # transformers takes the head size from the rotary width, which llama.cpp writes as it.
    "llama": _Arch(
        "llama",
        {**_DECODER_KEYS, "rope.dimension_count": "head_dim"},
        {"rope_theta": 1e4},
        _HEAD_SIZES,
        _unpermute_llama,
    ),
    "qwen2": _Arch("qwen2", _DECODER_KEYS, {"rope_theta": 1e4}, {**_HEAD_SIZES, **_ROTARY_WIDTH}),
    # Qwen3Config's head size is 128 (every Qwen3's), whatever the file's key_length says.
    "qwen3": _Arch("qwen3", _DECODER_KEYS, {"rope_theta": 1e4, "head_dim": 128}, {**_HEAD_SIZES, **_ROTARY_WIDTH}),
    # Qwen3-MoE, every layer a mixture: llama.cpp's architecture has no dense MLP tensors, nor
    # Qwen3MoeConfig dense layers by default. transformers reads the head size but not the
    # experts' width, which stays Qwen3MoeConfig's 768 (Qwen3-30B-A3B's; 235B-A22B's 1536 is
    # refused), and renormalises the chosen experts' weights (its loader's default for the
    # architecture), as llama.cpp always does for it, whatever the model's own `norm_topk_prob`.
    "qwen3moe": _Arch(
        "qwen3_moe",
        {
            **_DECODER_KEYS,
            "attention.key_length": "head_dim",
            "expert_count": "num_experts",
            "expert_used_count": "num_experts_per_tok",
        },
        {
            "rope_theta": 1e4,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
        },
        {
            **_ROTARY_WIDTH,
            "attention.value_length": "head_dim",
            "expert_feed_forward_length": "intermediate_size",
            "expert_weights_norm": "normalize_expert_weights",
        },
    ),
    # transformers reads neither Phi-3's window (llama.cpp writes 0 for none) nor its rotary
    # width: Phi3Config's defaults are no window and full rotary. Its original context matters
    # only to the long-context rope scaling, which is refused (its factor tensors, `_DROPPED`).
    "phi3": _Arch(
        "phi3",
        _DECODER_KEYS,
        {"rope_theta": 1e4, "sliding_window": None},
        {**_ROTARY_WIDTH, "attention.sliding_window": "sliding_window", "rope.scaling.original_context_length": None},
    ),
    # GPT-2 has keys of its own; transformers renames the MLP width to a key GPT2Config does not
    # have (its width stays 4 D) and the context to `n_ctx`, leaving GPT2Config's 1024 positions.
    "gpt2": _Arch(
        "gpt2",
        {
            "block_count": "n_layer",
            "context_length": "n_ctx",
            "embedding_length": "n_embd",
            "attention.head_count": "n_head",
            "attention.layer_norm_epsilon": "layer_norm_epsilon",
        },
        {"n_positions": 1024, "activation_function": "gelu_new"},
        {"feed_forward_length": "intermediate_size"},
    ),
    # llama.cpp writes Gemma 2's soft-caps, which transformers does not read (Gemma2Config's 50
    # and 30 are Gemma 2's), and no query_pre_attn_scalar: Gemma2Config's 256 is that of 2B and
    # 9B, not 27B's 144 (which llama.cpp derives from the model size). The layers alternate.
    "gemma2": _Arch(
        "gemma2",
        _GEMMA_KEYS,
        {
            "rope_theta": 1e4,
            "query_pre_attn_scalar": 256,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "hidden_activation": "gelu_pytorch_tanh",
        },
        {
            **_ROTARY_WIDTH,
            "attention.value_length": "head_dim",
            "attn_logit_softcapping": "attn_softcap",
            "final_logit_softcapping": "final_softcap",
        },
        _gemma_norms,
    ),
    # Gemma 3 as Gemma3TextConfig has it where the file is silent: query_pre_attn_scalar 256 (as
    # for Gemma 2, not 27B's 168), 5 sliding layers in 6, base 10000 on them (llama.cpp writes it
    # as `rope.freq_base_swa`, which transformers does not read). transformers does not read the
    # linear rope scaling of Gemma 3 4B and larger either: such a file is refused.
    "gemma3": _Arch(
        "gemma3_text",
        _GEMMA_KEYS,
        {
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "sliding_window_pattern": 6,
            "query_pre_attn_scalar": 256,
            "hidden_activation": "gelu_pytorch_tanh",
        },
        {
            **_ROTARY_WIDTH,
            "attention.value_length": "head_dim",
            "final_logit_softcapping": "final_softcap",
            "rope.freq_base_swa": "local_rope_theta",
        },
        _gemma_norms,
    ),
    # GPT-OSS as GptOssConfig has it where the file is silent: head size 64 (llama.cpp's
    # key_length, which transformers does not read, must say so), a 128-token window on every
    # other layer, the first sliding (llama.cpp's `attention.sliding_window` is not the
    # `sliding_window` key transformers reads), base 150000 and YaRN rope scaling 32 over 4096
    # positions, its correction range not truncated. A file's rope scaling (llama.cpp writes it)
    # replaces those settings whole, as transformers' loader does: its type, factor and original
    # context, the correction range then truncated (YaRN's default in transformers, and in
    # llama.cpp, where the file cannot say otherwise); llama.cpp's `yarn_beta_fast`,
    # `yarn_beta_slow` and `yarn_attn_factor` land there under names transformers' YaRN does not
    # read, so they must be its defaults (32, 1, and 0.1 ln(factor) + 1). The experts' width is
    # `feed_forward_length`, which llama.cpp writes again as `expert_feed_forward_length`.
    "gpt-oss": _Arch(
        "gpt_oss",
        {
            **_DECODER_KEYS,
            "expert_count": "num_local_experts",
            "expert_used_count": "num_experts_per_tok",
            "sliding_window": "sliding_window",
        },
        {
            "rope_theta": 150000.0,
            "head_dim": 64,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
        },
        {
            **_HEAD_SIZES,
            **_ROTARY_WIDTH,
            "attention.sliding_window": "sliding_window",
            "expert_feed_forward_length": "intermediate_size",
            "rope.scaling.yarn_beta_fast": "rope_beta_fast",
            "rope.scaling.yarn_beta_slow": "rope_beta_slow",
            "rope.scaling.yarn_attn_factor": "rope_attention_factor",
        },
        rope_scaling={
            "rope.scaling.type": "rope_type",
            "rope.scaling.factor": "factor",
            "rope.scaling.attention_factor": "attention_factor",
            "rope.scaling.beta_fast": "beta_fast",
            "rope.scaling.beta_slow": "beta_slow",
            "rope.scaling.original_context_length": "original_max_position_embeddings",
            "rope.scaling.original_max_position_embeddings": "original_max_position_embeddings",
        },
    ),
    # Gemma 4 as Gemma4TextConfig has it where the file is silent (`conversion.gguf_file` above):
    # transformers reads the full-attention layers' head width from `key_length` and neither
    # rotary base; everything llama.cpp writes of the sliding layers' heads, the layer pattern,
    # the shared layers, the per-layer inputs and the soft-cap must be those defaults. Its norms
    # are stored as they are (llama.cpp shifts no Gemma 4 norm, nor does transformers).
    "gemma4": _Arch(
        "gemma4_text",
        {
            **{k: v for k, v in _DECODER_KEYS.items() if k != "rope.freq_base"},
            "attention.key_length": "global_head_dim",
            "attention.sliding_window": "sliding_window",
        },
        {"head_dim": 256, "hidden_size_per_layer_input": 256, "hidden_activation": "gelu_pytorch_tanh"},
        {
            "attention.value_length": "full_head_dim",
            "attention.key_length_swa": "head_dim",
            "attention.value_length_swa": "head_dim",
            "rope.dimension_count": "full_head_dim",  # llama.cpp's proportional rotary: `rope_freqs`
            "rope.dimension_count_swa": "head_dim",
            "rope.freq_base": "rope_theta",
            "rope.freq_base_swa": "local_rope_theta",
            "attention.sliding_window_pattern": _sliding_layers,
            "attention.shared_kv_layers": _shared_kv_layer_count,
            "embedding_length_per_layer_input": "per_layer_input_size",
            "final_logit_softcapping": "final_softcap",
        },
    ),
}

# llama.cpp's per-layer lists of these Gemma 4 keys (its double-wide MLPs' widths, its full layers'
# key/value heads) land in transformers' config as lists where Gemma4TextConfig takes one number.
_PER_LAYER_LISTS = {"gemma4": ("feed_forward_length", "attention.head_count_kv")}

# Tensors llama.cpp writes that transformers' model has no place for: the rope scaling they hold
# would be lost, so the file is refused.
_DROPPED = {
    "rope_freqs.weight": "Llama 3's rope scaling frequencies",
    "rope_factors_long.weight": "Phi-3's long-context rope factors",
    "rope_factors_short.weight": "Phi-3's long-context rope factors",
}


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _same(value, expected) -> bool:
    """The file's value equals the config's (GGUF stores float32: compare at that precision)."""
    if isinstance(value, float) or isinstance(expected, float):
        return np.float32(value) == np.float32(expected)
    return value == expected


def gguf_config(reader) -> ModelConfig:
    """The `ModelConfig` of a GGUF file (`gguf.GGUFReader`), as transformers' GGUF loader reads it."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedConfigError(
            f"GGUF key 'general.architecture' = {arch!r} is not supported; supported: {', '.join(_ARCHS)} "
            "(the llama.cpp architectures transformers' GGUF loader reads and jaxdepth has a family for; "
            "Mistral models are 'llama' files)"
        )
    if arch == "llama" and _field(reader, "general.name") == "mistral":
        raise UnsupportedConfigError(
            "GGUF key 'general.name' = 'mistral': transformers reads this 'llama' file as a Mistral model, with a "
            "4096-token window the file does not state, but cannot load its weights; refusing to guess which it is"
        )
    if arch == "llama" and "llama.attention.head_count_kv" not in reader.fields:
        raise UnsupportedConfigError(
            "the 'llama' GGUF file has no 'llama.attention.head_count_kv', without which transformers' GGUF "
            "loader leaves llama.cpp's permutation of the q/k rows in place; refusing to build a model that differs "
            "from either"
        )
    spec = _ARCHS[arch]
    hf = {"model_type": spec.model_type, **spec.defaults}
    unread, rope = {}, {}
    for key in reader.fields:
        if not key.startswith(arch + "."):
            continue
        name, value = key[len(arch) + 1 :], _field(reader, key)
        if name in _PER_LAYER_LISTS.get(arch, ()) and isinstance(value, list):
            raise UnsupportedConfigError(
                f"GGUF key {key!r} = {value!r}: a value per layer, which transformers' GGUF loader puts where its "
                f"config class takes one number; refusing to build a model that differs from either"
            )
        if name in spec.keys:
            hf[spec.keys[name]] = value
        elif name in spec.rope_scaling:
            rope[key] = (spec.rope_scaling[name], value)
        elif name in spec.unread:
            unread[key] = (value, spec.unread[name])
        else:
            raise UnsupportedConfigError(
                f"GGUF key {key!r} = {value!r} is read neither by transformers' GGUF loader nor by jaxdepth; "
                "refusing to ignore it"
            )
    if rope and f"{arch}.rope.scaling.type" not in rope:
        key, (_, value) = next(iter(rope.items()))
        raise UnsupportedConfigError(
            f"GGUF key {key!r} = {value!r}: transformers' GGUF loader reads the rope scaling only where the file "
            f"states its type ('{arch}.rope.scaling.type'), and builds the model with its config class's without it; "
            "refusing to build a model that differs from either"
        )
    if rope:
        hf["rope_scaling"] = dict(rope.values())
    # As transformers: the vocabulary from the token list where the file does not state its size,
    # and the LM head tied to the embeddings where llama.cpp wrote no `output.weight`.
    tokens = _field(reader, "tokenizer.ggml.tokens")
    hf.setdefault("vocab_size", len(tokens) if tokens is not None else 0)
    hf["tie_word_embeddings"] = "output.weight" not in {t.name for t in reader.tensors}
    if arch == "gemma4":  # the per-layer embeddings as the file holds them: one row per token
        hf["vocab_size_per_layer_input"] = hf["vocab_size"]
    config = ModelConfig.from_hf(hf)
    for key, (value, field) in unread.items():
        if field is None:
            continue
        expected = field(config) if callable(field) else getattr(config, field)
        if not _same(value, expected):
            raise UnsupportedConfigError(
                f"GGUF key {key!r} = {value!r}: transformers' GGUF loader does not read it and builds the model "
                f"with {getattr(field, '__name__', field)} = {expected!r}; refusing to build a model that differs "
                "from either"
            )
    return config


def _gemma4_rope_freqs(config: ModelConfig) -> np.ndarray:
    """llama.cpp's `rope_freqs.weight` of Gemma 4's full-attention layers as its converter writes it
    for the config's 'proportional' rotary: 1 on each rotating frequency, 1e30 (none) on the rest."""
    half = config.full_head_dim // 2
    rotating = config.rotary_dim // 2 if config.rotary_dim else half
    return np.array([1.0] * rotating + [1e30] * (half - rotating), np.float32)


def convert_gguf(path: str, *, dtype=np.float32, load_tokenizer: bool = True) -> ModelWeights:
    """Convert a GGUF file; the tokenizer is rebuilt from its metadata (no torch needed)."""
    import gguf

    if not os.path.isfile(path):
        raise ConversionError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        raise ConversionError(f"could not read GGUF file {path}: {type(e).__name__}: {e}") from None
    config = gguf_config(reader)
    arch = _field(reader, "general.architecture")
    by_name = {t.name: t for t in reader.tensors}
    if arch == "gemma4":  # transformers rotates as its config says, which this tensor must say too
        t = by_name.pop("rope_freqs.weight", None)
        factors = None if t is None else gguf.dequantize(t.data, t.tensor_type).reshape(-1)
        if factors is None or not np.array_equal(factors, _gemma4_rope_freqs(config)):
            raise UnsupportedConfigError(
                "GGUF tensor 'rope_freqs.weight' (llama.cpp's rotary frequency factors of Gemma 4's full-attention "
                f"layers) is {'missing' if t is None else factors.tolist()}: transformers does not read it and rotates "
                f"{config.rotary_dim or config.full_head_dim} of those layers' {config.full_head_dim} dims at base "
                f"{config.rope_theta:g}; refusing to build a model that differs from either"
            )
    for name, what in _DROPPED.items():
        if name in by_name:
            raise UnsupportedConfigError(
                f"GGUF tensor {name!r} ({what}) has no place in transformers' model of the file; refusing to drop it"
            )
    fix = _ARCHS[arch].fix

    def read(name: str) -> np.ndarray:
        t = by_name[name]
        w = gguf.dequantize(t.data, t.tensor_type)
        return w if fix is None else fix(name, w, config)

    available, get = gguf_source(config, by_name, read, GGUF_NAMES[arch])
    params = assemble_params(config, available, get, GGUF_NAMES[arch], dtype=dtype)
    tokenizer = None
    if load_tokenizer:
        from conversion.gguf_tokenizer import gguf_tokenizer

        tokenizer = gguf_tokenizer(reader)
    return ModelWeights(params=params, config=config, tokenizer=tokenizer, source=os.path.abspath(path))
