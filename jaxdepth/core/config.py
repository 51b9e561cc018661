"""Model configuration: a frozen, keyword-only description of a decoder-only transformer.

`ModelConfig.from_hf` reads a Hugging Face `config.json` dictionary and refuses every
architecture or config feature this project does not implement, naming the offending key:
a silently ignored rope-scaling rule or sliding window would make every analysis wrong
without any visible symptom.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
ROPE_TYPES = ("default", "llama3")


class UnsupportedConfigError(ValueError):
    """A checkpoint asks for an architecture or a config feature that is not implemented.

    Raised by `ModelConfig.from_hf` (and by `ModelConfig` itself for impossible shapes), its
    message naming the config key, its value and what is implemented; a `ValueError`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a pre-norm decoder (Qwen2, Qwen3 or Llama family).

    Frozen, keyword-only and hashable: every jitted function takes it as a static argument, so a
    different config compiles anew. Build it with `from_hf` from a Hugging Face `config.json`;
    a loaded model carries its own (`Model.config`).

    `model_type` is 'qwen2', 'qwen3' or 'llama'. The shapes, in the axis names of
    `jaxdepth.core.model`: `vocab_size` V, `hidden_size` D, `intermediate_size` F (the MLP),
    `num_layers` L, `num_heads` H query heads and `num_kv_heads` K key/value heads (query head h
    reads kv head h // (H // K)), `head_dim` Dh. `rope_theta` is the rotary base, `rms_norm_eps`
    the RMSNorm epsilon, `max_position_embeddings` the longest context the checkpoint declares
    (`Model` and `jaxdepth.integrated_gradients` refuse longer token arrays).
    `tie_word_embeddings`: the LM head is the embedding matrix (no `lm_head` param).

    `qkv_bias` distinguishes Qwen2 (biases on q/k/v projections) from Llama (none); `qk_norm`
    marks Qwen3 (an RMSNorm over each query and key head before the rotary embedding).
    `rope_type` 'llama3' rescales the rotary frequencies as Llama 3.1 / 3.2 do (`rope_factor`,
    the low and high frequency factors and the original context length).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 1.0
    rope_original_max_position: int = 0

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedConfigError(
                f"model_type {self.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedConfigError(f"rope_type {self.rope_type!r} is not supported; supported: {ROPE_TYPES}")
        if self.rope_type == "llama3" and not (
            self.rope_factor > 0
            and self.rope_original_max_position > 0
            and self.rope_high_freq_factor > self.rope_low_freq_factor > 0
        ):
            raise UnsupportedConfigError(
                "llama3 rope scaling needs factor > 0, original_max_position_embeddings > 0 and "
                f"high_freq_factor > low_freq_factor > 0; got {self.rope_factor}, {self.rope_original_max_position}, "
                f"{self.rope_high_freq_factor}, {self.rope_low_freq_factor}"
            )

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (this class's field names, not Hugging Face's keys)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """The config `to_dict` gave (checked as any new config is); not a Hugging Face
        `config.json`: that is `from_hf`."""
        return cls(**d)

    def to_json(self) -> str:
        """`to_dict` as JSON text, keys sorted (what a converted checkpoint folder stores)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Build a config from a Hugging Face `config.json` dict, refusing what is not handled.

        Every key must be one this implementation reads or knows to be inert (generation
        defaults, token ids, dropout, ...); any other key, and any feature not reproduced
        (another activation, rope scaling but 'llama3', a sliding window in use, MLP biases,
        quantization), is an `UnsupportedConfigError` naming it. `rope_theta` is read from the
        top level or from `rope_parameters` (transformers 5)."""
        hf = dict(hf)
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedConfigError(
                f"config key 'model_type' = {model_type!r} is not supported; supported: "
                f"{SUPPORTED_MODEL_TYPES} (Qwen2/Qwen2.5/DeepSeek-R1-Distill-Qwen are 'qwen2', Qwen3 is "
                "'qwen3', SmolLM2/Llama 3 are 'llama')"
            )
        _check_hf_features(hf)
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rope_theta=float(_rope_theta(hf)),
            rms_norm_eps=float(hf["rms_norm_eps"]),
            max_position_embeddings=int(hf["max_position_embeddings"]),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=(model_type == "qwen2") or bool(hf.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            **_rope_scaling(hf),
        )


# Keys that describe shapes/numerics read above, or carry no numerical meaning (bookkeeping,
# generation defaults, dropout that is inactive at inference, init scales).
_READ_KEYS = {
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_theta",
    "rope_parameters",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
}
_INERT_KEYS = {
    "architectures",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "_name_or_path",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "use_cache",
    "attention_dropout",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "problem_type",
    "max_window_layers",
    "tokenizer_class",
    "_attn_implementation_autoset",
    "tf_legacy_loss",
    "use_bfloat16",
    "is_llama_config",
    "transformers.js_config",
}


# The keys of a 'llama3' rope scaling, as HF names them, and the config fields they fill.
_LLAMA3_ROPE = {
    "factor": "rope_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_position",
}


def _rope_spec(hf: Mapping[str, Any]) -> tuple[str, dict]:
    """(the key holding the rope settings, those settings): `rope_parameters` (transformers 5)
    or `rope_scaling` (older configs, with `rope_theta` at the top level)."""
    if hf.get("rope_scaling"):
        return "rope_scaling", dict(hf["rope_scaling"])
    return "rope_parameters", dict(hf.get("rope_parameters") or {})


def _rope_scaling(hf: Mapping[str, Any]) -> dict:
    _, spec = _rope_spec(hf)
    if spec.get("rope_type", spec.get("type", "default")) != "llama3":
        return {}
    fields = {field: float(spec[name]) for name, field in _LLAMA3_ROPE.items()}
    fields["rope_original_max_position"] = int(fields["rope_original_max_position"])
    return {"rope_type": "llama3", **fields}


def _check_hf_features(hf: Mapping[str, Any]) -> None:
    """Raise on any config feature whose effect this implementation does not reproduce."""

    def refuse(key, why):
        raise UnsupportedConfigError(f"config key {key!r} = {hf[key]!r}: {why}")

    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "only 'silu' is implemented")
    key, params = _rope_spec(hf)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        refuse(key, f"rope_type {rope_type!r} is not implemented (implemented: {', '.join(ROPE_TYPES)})")
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor"} | (
        set(_LLAMA3_ROPE) if rope_type == "llama3" else set()
    )
    missing = set(_LLAMA3_ROPE) - set(params) if rope_type == "llama3" else set()
    if set(params) - known or missing or params.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(
            key,
            "only full rotary embeddings of rope_type 'default', or 'llama3' with exactly "
            f"{', '.join(sorted(_LLAMA3_ROPE))}, are implemented",
        )
    if hf.get("use_sliding_window") and hf.get("sliding_window") is not None:
        refuse("use_sliding_window", "sliding-window attention is not implemented")
    layer_types = hf.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        refuse("layer_types", "only 'full_attention' layers are implemented")
    if hf.get("mlp_bias"):
        refuse("mlp_bias", "MLP biases are not implemented")
    if hf.get("pretraining_tp", 1) != 1:
        refuse("pretraining_tp", "tensor-parallel pretraining slices are not implemented")
    if hf.get("use_mrope"):
        refuse("use_mrope", "multimodal rotary embeddings (M-RoPE) are not implemented")
    if hf.get("rope_interleaved"):
        refuse("rope_interleaved", "interleaved rotary embeddings are not implemented (HF Llama/Qwen2 rotate halves)")
    if hf.get("quantization_config"):
        refuse("quantization_config", "quantized HF checkpoints are not supported; use float weights")
    handled_flags = {
        "hidden_act",
        "rope_scaling",
        "use_sliding_window",
        "sliding_window",
        "layer_types",
        "mlp_bias",
        "pretraining_tp",
        "quantization_config",
        "use_mrope",
        "rope_interleaved",
    }
    for key in hf:
        if key not in _READ_KEYS | _INERT_KEYS | handled_flags:
            refuse(key, "this config key is not handled by jaxdepth; refusing to ignore it silently")


def _rope_theta(hf: Mapping[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    if "rope_theta" in params:
        return params["rope_theta"]
    if "rope_theta" in hf:
        return hf["rope_theta"]
    raise UnsupportedConfigError("config has neither 'rope_theta' nor rope_parameters['rope_theta']")
