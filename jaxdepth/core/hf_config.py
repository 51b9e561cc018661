"""Hugging Face `config.json` -> `ModelConfig` fields, one reader per family.

Each reader returns the fields it sets and names the keys it read; `config_fields` then refuses
any key neither read nor known to be inert (bookkeeping, generation defaults, dropout that is
off at inference). A silently ignored rope scaling, window or soft-cap would make every analysis
wrong without a visible symptom, so an unknown key is an error that names it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

__all__ = [
    "UnsupportedConfigError",
    "config_fields",
    "SUPPORTED_MODEL_TYPES",
]


class UnsupportedConfigError(ValueError):
    """A checkpoint asks for an architecture or a config feature that is not implemented.

    Raised by `ModelConfig.from_hf` (and by `ModelConfig` itself for impossible shapes), its
    message naming the config key, its value and what is implemented; a `ValueError`."""


# Keys with no numerical meaning at inference, in any family.
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
    "tokenizer_class",
    "_attn_implementation_autoset",
    "tf_legacy_loss",
    "use_bfloat16",
    "is_llama_config",
    "transformers.js_config",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "hidden_dropout",
    "classifier_dropout",
    "is_decoder",
    "max_window_layers",  # Qwen2: already folded into `layer_types`
    "task_specific_params",  # generation defaults (GPT-2)
    "cache_implementation",
    "final_logit_softcapping_enabled",
    "summary_type",  # GPT-2's sequence-classification head, not the LM
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
    "n_ctx",
    "original_max_position_embeddings",  # checked where a rope scaling reads it
    "output_router_logits",  # a mixture of experts' training: its router's auxiliary loss, jitter
    "router_aux_loss_coef",
    "router_jitter_noise",
}

_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
_LLAMA3_ROPE = {
    "factor": "rope_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_position",
}


class _Reader:
    """Reads keys of one `config.json`, remembering which: what is left is refused."""

    def __init__(self, hf: Mapping[str, Any]):
        self.hf = dict(hf)
        self.read: set[str] = set()

    def __contains__(self, key):
        return self.hf.get(key) is not None

    def get(self, key, default=None):
        self.read.add(key)
        value = self.hf.get(key)
        return default if value is None else value

    def need(self, key):
        self.read.add(key)
        if self.hf.get(key) is None:
            raise UnsupportedConfigError(f"config has no {key!r}")
        return self.hf[key]

    def refuse(self, key, why):
        raise UnsupportedConfigError(f"config key {key!r} = {self.hf.get(key)!r}: {why}")

    def require(self, key, allowed, why):
        if self.get(key, allowed[0]) not in allowed:
            self.refuse(key, why)

    def activation(self, key: str) -> str:
        act = self.get(key, "silu")
        if act not in _ACTIVATIONS:
            self.refuse(key, f"implemented activations: {', '.join(_ACTIVATIONS)}")
        return _ACTIVATIONS[act]

    def left_over(self):
        return [k for k in self.hf if k not in self.read and k not in _INERT_KEYS]


def config_fields(hf: Mapping[str, Any]) -> dict:
    """The `ModelConfig` fields of a Hugging Face `config.json` dict, or an
    `UnsupportedConfigError` naming the first key or feature that is not reproduced."""
    model_type = hf.get("model_type")
    if model_type not in _FAMILIES:
        hint = (
            " (a multimodal Gemma 3: convert its text model, model_type 'gemma3_text')"
            if model_type == "gemma3"
            else ""
        )
        raise UnsupportedConfigError(
            f"config key 'model_type' = {model_type!r} is not supported{hint}; supported: {SUPPORTED_MODEL_TYPES} "
            "(Qwen2/Qwen2.5/DeepSeek-R1-Distill-Qwen are 'qwen2', Qwen3 'qwen3', SmolLM2/Llama 3 'llama', "
            "Pythia 'gpt_neox')"
        )
    r = _Reader(hf)
    r.read.add("model_type")
    fields = {"model_type": model_type, **_FAMILIES[model_type](r)}
    left = r.left_over()
    if left:
        r.refuse(left[0], "this config key is not handled by jaxdepth; refusing to ignore it silently")
    return fields


# ----------------------------------------------------------------------------- shared pieces


def _shapes(r: _Reader, *, hidden="hidden_size", layers="num_hidden_layers", heads="num_attention_heads") -> dict:
    num_heads, width = int(r.need(heads)), int(r.need(hidden))
    return dict(
        vocab_size=int(r.need("vocab_size")),
        hidden_size=width,
        num_layers=int(r.need(layers)),
        num_heads=num_heads,
        num_kv_heads=int(r.get("num_key_value_heads", num_heads)),
        head_dim=int(r.get("head_dim", width // num_heads)),
    )


def _rope(r: _Reader, head_dim: int, params: Mapping | None = None, key: str | None = None) -> dict:
    """Rotary fields from `rope_parameters` (transformers 5), `rope_scaling` or top-level keys."""
    if params is None:
        r.read.update({"rope_scaling", "rope_parameters"})
        key = "rope_scaling" if "rope_scaling" in r else "rope_parameters"
        params = dict(r.get(key, {}))
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear", "longrope", "yarn"):
        r.refuse(
            key, f"rope_type {rope_type!r} is not implemented (implemented: default, llama3, linear, longrope, yarn)"
        )
    both = dict(r.hf.get("rope_parameters") or {}) if key == "rope_scaling" else {}
    theta = params.get("rope_theta", both.get("rope_theta", r.get("rope_theta", r.get("rotary_emb_base"))))
    if theta is None:
        raise UnsupportedConfigError("config has neither 'rope_theta' nor rope_parameters['rope_theta']")
    partial = float(params.get("partial_rotary_factor", r.get("partial_rotary_factor", r.get("rotary_pct", 1.0))))
    fields = dict(rope_theta=float(theta), rotary_dim=0 if partial == 1.0 else int(head_dim * partial))
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    if rope_type == "llama3":
        missing = set(_LLAMA3_ROPE) - set(params)
        if missing:
            r.refuse(key, f"llama3 rope scaling needs {', '.join(sorted(missing))}")
        fields.update({field: float(params[name]) for name, field in _LLAMA3_ROPE.items()}, rope_type="llama3")
        fields["rope_original_max_position"] = int(fields["rope_original_max_position"])
        known |= set(_LLAMA3_ROPE)
    elif rope_type == "linear":
        fields.update(rope_type="linear", rope_factor=float(params["factor"]))
        known.add("factor")
    elif rope_type == "longrope":
        fields.update(_longrope(r, key, params))
        known |= {"short_factor", "long_factor", "factor", "attention_factor", "original_max_position_embeddings"}
    elif rope_type == "yarn":
        fields.update(_yarn(r, key, params))
        known |= {"factor", "attention_factor", "beta_fast", "beta_slow", "truncate", "mscale", "mscale_all_dim"}
        known.add("original_max_position_embeddings")
    if set(params) - known:
        r.refuse(key, f"rope settings {sorted(set(params) - known)} are not implemented")
    return fields


def _longrope(r: _Reader, key: str, params: Mapping) -> dict:
    """Phi-3's long-context rotary scaling, as transformers reads it: the context it was trained
    at (`original_max_position_embeddings`, in the rope settings or at the top level), per
    frequency factors for prompts up to it and beyond it, and the cos / sin scale
    `attention_factor`, by default sqrt(1 + ln s / ln original) with s = `factor` or, without
    one, max_position_embeddings / original (1 where s <= 1)."""
    missing = {"short_factor", "long_factor"} - set(params)
    if missing:
        r.refuse(key, f"longrope scaling needs {', '.join(sorted(missing))}")
    original = params.get("original_max_position_embeddings", r.get("original_max_position_embeddings"))
    if not original:
        r.refuse(key, "longrope scaling needs original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = r.need("max_position_embeddings") / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return dict(
        rope_type="longrope",
        rope_original_max_position=int(original),
        rope_short_factor=tuple(float(f) for f in params["short_factor"]),
        rope_long_factor=tuple(float(f) for f in params["long_factor"]),
        rope_attention_factor=float(attention),
    )


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale of a context `factor` (transformers' `get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(r: _Reader, key: str, params: Mapping) -> dict:
    """YaRN's rotary scaling, as transformers reads it: the original context (in the rope
    settings or at the top level), `factor` (by default the context over the original one),
    the ramp's `beta_fast` and `beta_slow` (32 and 1 where absent or 0), `truncate` (default
    true) and the cos / sin scale `attention_factor`, by default 0.1 ln(factor) + 1, or with
    `mscale` and `mscale_all_dim` the ratio of those of each (1 where factor <= 1)."""
    original = params.get("original_max_position_embeddings", r.get("original_max_position_embeddings"))
    if not original:
        r.refuse(key, "yarn scaling needs original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = r.need("max_position_embeddings") / original

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    return dict(
        rope_type="yarn",
        rope_factor=float(factor),
        rope_original_max_position=int(original),
        rope_attention_factor=float(attention),
        rope_beta_fast=float(params.get("beta_fast") or 32),
        rope_beta_slow=float(params.get("beta_slow") or 1),
        rope_truncate=bool(params.get("truncate", True)),
    )


def _layer_types(
    r: _Reader, num_layers: int, *, all_sliding: bool = False, pattern: int = 0, default_window: int | None = None
) -> dict:
    """`sliding_window` and per-layer `layer_types` ('full' / 'sliding'), as transformers builds
    them: from `layer_types` where the config has it, else every layer sliding (`all_sliding`:
    Mistral, Phi-3) or every layer but each `pattern`-th (Gemma). `default_window` is the
    family's window where the config has no `sliding_window` key at all (transformers' default;
    an explicit null means no window)."""
    r.read.add("sliding_window")
    window = r.hf["sliding_window"] if "sliding_window" in r.hf else default_window
    types = r.get("layer_types")
    if types is not None:
        unknown = sorted(set(types) - set(_LAYER_TYPES))
        if unknown:
            r.refuse("layer_types", f"layer types {unknown} are not implemented ({', '.join(_LAYER_TYPES)} are)")
        types = tuple(_LAYER_TYPES[t] for t in types)
    elif pattern:
        types = tuple("sliding" if (i + 1) % pattern else "full" for i in range(num_layers))
    elif all_sliding and window is not None:
        types = ("sliding",) * num_layers
    if types and "sliding" in types and window is None:
        r.refuse("layer_types", "sliding layers without a sliding_window")
    if not types or "sliding" not in types:
        return {}
    return dict(sliding_window=int(window), layer_types=types)


def _common(r: _Reader, shapes: dict, *, eps: str = "rms_norm_eps") -> dict:
    if r.get("quantization_config"):
        r.refuse("quantization_config", "quantized checkpoints are not supported; use float weights")
    return dict(
        shapes,
        intermediate_size=int(r.need("intermediate_size")),
        rms_norm_eps=float(r.need(eps)),
        max_position_embeddings=int(r.need("max_position_embeddings")),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
    )


# ----------------------------------------------------------------------------- the families


def _llama_like(r: _Reader) -> dict:
    """Qwen2 / 2.5, Qwen3, Llama (SmolLM2, Llama 3.x), Mistral and SmolLM3: the pre-norm SwiGLU
    decoder (SmolLM3's layers without rotary positions, `_no_rope_layers`)."""
    model_type = r.hf["model_type"]
    shapes = _shapes(r)
    if r.get("pretraining_tp", 1) != 1:
        r.refuse("pretraining_tp", "tensor-parallel pretraining slices are not implemented")
    for key, why in (
        ("use_mrope", "multimodal rotary embeddings (M-RoPE) are not implemented"),
        ("rope_interleaved", "interleaved rotary embeddings are not implemented (HF Llama/Qwen2 rotate halves)"),
    ):
        if r.get(key):
            r.refuse(key, why)
    if model_type in ("llama", "mistral") and r.get("use_sliding_window"):
        r.refuse("use_sliding_window", f"{model_type} takes its window from sliding_window alone")
    if model_type == "llama":  # Llama has no window: a key left from another family must switch nothing on
        r.read.update({"sliding_window", "max_window_layers"})
        if r.get("layer_types") and set(r.get("layer_types")) != {"full_attention"}:
            r.refuse("layer_types", "Llama layers attend fully")
    qwen = model_type in ("qwen2", "qwen3", "qwen3_moe")
    switched = qwen or model_type == "smollm3"  # windows only where use_sliding_window turns them on
    if switched and not r.get("use_sliding_window", False):
        r.read.update({"sliding_window", "layer_types"})  # a window size only use_sliding_window turns on
        windows = {}
        if any(t != "full_attention" for t in r.hf.get("layer_types") or ()):
            r.refuse("layer_types", "sliding layers while use_sliding_window is false")
    elif qwen and "layer_types" not in r:  # older configs: max_window_layers on slide
        first = int(r.get("max_window_layers", shapes["num_layers"]))
        r.hf["layer_types"] = [
            "sliding_attention" if i >= first else "full_attention" for i in range(shapes["num_layers"])
        ]
        windows = _layer_types(r, shapes["num_layers"])
    else:
        mistral = model_type in ("mistral", "mixtral")
        default_window = 4096 if model_type == "mistral" else None
        windows = _layer_types(r, shapes["num_layers"], all_sliding=mistral, default_window=default_window)
    fields = dict(
        _common(r, shapes),
        activation=r.activation("hidden_act"),
        qkv_bias=model_type == "qwen2" or bool(r.get("attention_bias", False)),
        o_bias=not qwen and bool(r.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        mlp_bias=bool(r.get("mlp_bias", False)),
        **_rope(r, shapes["head_dim"]),
        **windows,
    )
    if fields["rotary_dim"]:
        r.refuse("rope_parameters", "partial rotary embeddings are not implemented for this family")
    if model_type in _EXPERT_KEYS:
        fields.update(_experts(r))
    if model_type == "smollm3":
        fields["nope_layers"] = _no_rope_layers(r, shapes["num_layers"])
    return fields


def _no_rope_layers(r: _Reader, L: int) -> tuple[int, ...]:
    """SmolLM3's layers without rotary positions: where `no_rope_layers` (a flag per layer, 1 a
    layer that rotates) holds 0, or where none is given every `no_rope_layer_interval`-th
    layer (4 where the config is silent), as transformers derives them."""
    flags, interval = r.get("no_rope_layers"), int(r.get("no_rope_layer_interval", 4))
    if flags is None:
        flags = [int((i + 1) % interval != 0) for i in range(L)]
    if len(flags) != L or any(f not in (0, 1) for f in flags):
        r.refuse("no_rope_layers", f"it must hold a 0 or 1 for each of the {L} layers")
    return tuple(i for i, f in enumerate(flags) if not f)


# Per mixture-of-experts family: the keys of the experts' count and width (transformers saves
# Qwen3-MoE's `num_experts` as `num_local_experts`, its attribute map's name for it), and whether
# the chosen experts' weights are renormalised: `norm_topk_prob`'s default, or None where the
# family always renormalises (and has no such key).
_EXPERT_KEYS = {
    "mixtral": (("num_local_experts",), "intermediate_size", None),
    "qwen3_moe": (("num_experts", "num_local_experts"), "moe_intermediate_size", False),
    "olmoe": (("num_experts", "num_local_experts"), "intermediate_size", False),
    "gpt_oss": (("num_local_experts",), "intermediate_size", None),
    "deepseek_v3": (("n_routed_experts",), "moe_intermediate_size", True),
}


def _experts(r: _Reader) -> dict:
    """The mixture-of-experts fields: E experts of width F, k per token, renormalised where the
    family does (`_EXPERT_KEYS`), and the dense layers among the sparse ones (`_dense_layers`),
    of width `intermediate_size`."""
    model_type = r.hf["model_type"]
    count_keys, width_key, normalized = _EXPERT_KEYS[model_type]
    count_key = next((k for k in count_keys if k in r), count_keys[0])
    r.read.update({*count_keys, "intermediate_size"})  # the latter the dense layers' width, where any
    L = int(r.need("num_hidden_layers"))
    dense = _dense_layers(r, model_type, L)
    if len(dense) == L:
        r.refuse("mlp_only_layers" if model_type == "qwen3_moe" else "first_k_dense_replace", "every layer is dense")
    return dict(
        num_experts=int(r.need(count_key)),
        experts_per_token=int(r.need("num_experts_per_tok")),
        intermediate_size=int(r.need(width_key)),
        normalize_expert_weights=True if normalized is None else bool(r.get("norm_topk_prob", normalized)),
        dense_layers=dense,
        dense_size=int(r.need("intermediate_size")) if dense else 0,
    )


def _dense_layers(r: _Reader, model_type: str, L: int) -> tuple[int, ...]:
    """The layers with a dense MLP among a mixture's sparse ones, as transformers builds them:
    Qwen3-MoE's `mlp_only_layers`, and where none are named every layer l with (l + 1) not a
    multiple of `decoder_sparse_step`; DeepSeek-V3's first `first_k_dense_replace` (3 where the
    config is silent, transformers' default). The other families have none."""
    if model_type == "qwen3_moe":
        only, step = list(r.get("mlp_only_layers") or []), int(r.get("decoder_sparse_step", 1))
        if step < 1:
            r.refuse("decoder_sparse_step", "it must be at least 1")
        if any(not 0 <= int(i) < L for i in only):
            r.refuse("mlp_only_layers", f"it names layers outside 0..{L - 1}")
        return tuple(i for i in range(L) if i in only or (i + 1) % step)
    if model_type == "deepseek_v3":
        return tuple(range(min(int(r.get("first_k_dense_replace", 3)), L)))
    return ()


def _gemma(r: _Reader) -> dict:
    """Gemma 2 and Gemma 3 (text): RMSNorm with (1 + w) before and after both sublayers, embeddings
    scaled by sqrt(D), GeGLU, soft-capped attention and logits, alternating sliding layers; Gemma 3
    adds q/k norms and a local rotary base for its sliding layers."""
    gemma3 = r.hf["model_type"] == "gemma3_text"
    shapes = _shapes(r)
    if r.get("use_bidirectional_attention"):
        r.refuse("use_bidirectional_attention", "only causal attention is implemented")
    act_key = "hidden_activation" if "hidden_activation" in r else "hidden_act"
    r.read.add("hidden_act")
    if gemma3 and isinstance(r.hf.get("rope_parameters"), Mapping) and "full_attention" in r.hf["rope_parameters"]:
        per_type = r.get("rope_parameters")
        rope = _rope(r, shapes["head_dim"], per_type["full_attention"], "rope_parameters")
        local = _rope(r, shapes["head_dim"], per_type.get("sliding_attention", {}), "rope_parameters")
        if "rope_type" in local or local["rotary_dim"] or set(per_type) - {"full_attention", "sliding_attention"}:
            r.refuse("rope_parameters", "sliding layers take a plain rotary base (rope_type 'default') only")
        rope["local_rope_theta"] = local["rope_theta"]
    else:
        rope = _rope(r, shapes["head_dim"])
        if gemma3:
            rope["local_rope_theta"] = float(r.get("rope_local_base_freq", 10000.0))
    D = shapes["hidden_size"]
    return dict(
        _common(r, shapes),
        **rope,
        **_layer_types(
            r,
            shapes["num_layers"],
            # older configs without layer_types: Gemma 2 alternates, Gemma 3 slides 5 layers in 6
            pattern=2 if not gemma3 else int(r.get("sliding_window_pattern", r.get("_sliding_window_pattern", 6))),
            default_window=4096,
        ),
        activation=r.activation(act_key),
        qkv_bias=bool(r.get("attention_bias", False)),
        o_bias=bool(r.get("attention_bias", False)),
        qk_norm=gemma3,
        norm_offset=1.0,
        norm_scale_in_float32=True,
        post_norms=True,
        embed_scale=float(math.sqrt(D)),
        attn_scale=float(r.need("query_pre_attn_scalar")) ** -0.5,
        attn_softcap=float(r.get("attn_logit_softcapping", 0.0)),
        final_softcap=float(r.get("final_logit_softcapping", 0.0)),
    )


def _gemma4(r: _Reader) -> dict:
    """Gemma 4 (the text model): Gemma 3's layer with weight-scaled RMSNorms (no 1 + w), an RMSNorm
    without a weight on the values, scores unscaled (1), full-attention layers of their own head
    width and key/value heads (`global_head_dim` and `num_global_key_value_heads`, or
    transformers 5's `per_layer_config`) whose values may be their keys (`attention_k_eq_v`),
    'proportional' rotary on them, the last `num_kv_shared_layers` layers reusing earlier layers'
    keys and values, a double-wide MLP on those (`use_double_wide_mlp`), per-layer inputs
    (`hidden_size_per_layer_input`), a learned scalar per layer, and where `enable_moe_block`
    a mixture of experts beside each layer's MLP (`_gemma4_experts`). Bidirectional attention is
    refused."""
    shapes = _shapes(r)
    L, Dh, K = shapes["num_layers"], shapes["head_dim"], shapes["num_kv_heads"]
    if r.get("attention_bias"):
        r.refuse("attention_bias", "biases in Gemma 4's attention are not implemented")
    # 'vision': image tokens attend to each other both ways, text causally (all a text model sees)
    if r.get("use_bidirectional_attention") not in (None, "vision"):
        r.refuse("use_bidirectional_attention", "only causal attention is implemented")
    experts = _gemma4_experts(r)
    types = r.get("layer_types")
    if types is None:  # transformers' default: five sliding layers in six
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(L)]
    types = list(types)
    if types and types[-1] != "full_attention":  # transformers forces the last layer to attend fully
        types[-1] = "full_attention"
    r.hf["layer_types"] = types
    windows = _layer_types(r, L, default_window=512)
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    k_eq_v = bool(r.get("attention_k_eq_v", False))
    global_dims = _gemma4_global_shapes(r, full, Dh, K, k_eq_v)
    rope = _gemma4_rope(r, types, Dh, global_dims["head_dim"])
    if not windows:  # every layer attends fully: their shapes are the config's
        shapes.update(head_dim=global_dims["head_dim"], num_kv_heads=global_dims["num_kv_heads"])
        global_dims = dict(head_dim=0, num_kv_heads=0)
    shared = int(r.get("num_kv_shared_layers", 0))
    if not 0 <= shared < L:
        r.refuse("num_kv_shared_layers", f"it must leave at least one of the {L} layers computing keys and values")
    shared_layers = tuple(range(L - shared, L))
    producing = {types[i] for i in range(L - shared)}
    if set(types) - producing:  # transformers refuses it too
        r.refuse("num_kv_shared_layers", "a layer type whose keys and values no earlier layer computes")
    P = int(r.get("hidden_size_per_layer_input", 256))
    r.read.add("vocab_size_per_layer_input")
    if P and int(r.get("vocab_size_per_layer_input", 262144)) != shapes["vocab_size"]:
        r.refuse("vocab_size_per_layer_input", "per-layer embeddings of another vocabulary than the tokens'")
    r.read.add("hidden_act")
    return dict(
        _common(r, shapes),
        **rope,
        **windows,
        activation=r.activation("hidden_activation" if "hidden_activation" in r else "hidden_act"),
        qkv_bias=False,
        qk_norm=True,
        norm_scale_in_float32=True,
        post_norms=True,
        embed_scale=float(math.sqrt(shapes["hidden_size"])),
        attn_scale=1.0,
        final_softcap=float(r.get("final_logit_softcapping") or 0.0),
        global_head_dim=global_dims["head_dim"] if global_dims["head_dim"] != shapes["head_dim"] else 0,
        global_kv_heads=global_dims["num_kv_heads"] if global_dims["num_kv_heads"] != shapes["num_kv_heads"] else 0,
        keys_as_values=k_eq_v,
        value_norm=True,
        shared_kv_layers=shared_layers,
        wide_mlp_layers=shared_layers if r.get("use_double_wide_mlp", False) else (),
        per_layer_input_size=P,
        layer_scalar=True,
        **experts,
    )


def _gemma4_experts(r: _Reader) -> dict:
    """Gemma 4's mixture-of-experts block (`enable_moe_block`, the 26B-A4B model): in every layer,
    `num_experts` experts of width `moe_intermediate_size`, `top_k_experts` per token, their
    weights renormalised, beside the layer's own MLP of width `intermediate_size`, which is
    the mixture's shared MLP here (`ModelConfig.expert_norms`). Without the block, its keys
    must switch nothing on."""
    keys = ("num_experts", "top_k_experts", "moe_intermediate_size")
    r.read.update(keys)
    if not r.get("enable_moe_block"):
        for key in keys:
            if r.get(key):
                r.refuse(key, "Gemma 4 has experts only where enable_moe_block is set")
        return {}
    if r.get("use_double_wide_mlp") and int(r.get("num_kv_shared_layers", 0)):
        r.refuse("use_double_wide_mlp", "a double-wide MLP beside Gemma 4's experts is not implemented")
    return dict(
        num_experts=int(r.need("num_experts")),
        experts_per_token=int(r.need("top_k_experts")),
        intermediate_size=int(r.need("moe_intermediate_size")),
        shared_expert_size=int(r.need("intermediate_size")),
        normalize_expert_weights=True,
        expert_norms=True,
    )


# The multimodal Gemma 4's keys beside its text model's: its vision and audio towers and the token
# ids of their placeholders, which a text prompt does not use.
_GEMMA4_MULTIMODAL_KEYS = {
    "vision_config",
    "audio_config",
    "boi_token_id",
    "eoi_token_id",
    "image_token_id",
    "video_token_id",
    "boa_token_id",
    "eoa_token_id",
    "eoa_token_index",
    "audio_token_id",
    "vision_soft_tokens_per_image",
}


def _gemma4_multimodal(r: _Reader) -> dict:
    """The multimodal Gemma 4 (`Gemma4ForConditionalGeneration`) as the text model it holds: its
    `text_config`, read as `gemma4_text` (`_gemma4`); the vision and audio towers are not
    converted. Text prompts only: an image, video or audio placeholder token in a prompt embeds
    as a text token, where the multimodal model puts its towers' outputs."""
    text = r.need("text_config")
    inner = _Reader({**dict(text), "model_type": "gemma4_text"})
    inner.read.add("model_type")
    fields = _gemma4(inner)
    left = inner.left_over()
    if left:
        inner.refuse(left[0], "this text_config key is not handled by jaxdepth; refusing to ignore it silently")
    r.read.update(_GEMMA4_MULTIMODAL_KEYS)
    tied = r.get("tie_word_embeddings", fields["tie_word_embeddings"])
    if bool(tied) != fields["tie_word_embeddings"]:
        r.refuse("tie_word_embeddings", "the text model's tie_word_embeddings says otherwise")
    return fields


def _gemma4_global_shapes(r: _Reader, full: list, Dh: int, K: int, k_eq_v: bool) -> dict:
    """The full-attention layers' head width and key/value heads, as transformers builds them:
    `per_layer_config`'s overrides where the config has one (transformers 5 writes it, each
    layer's entries that differ from the top level's), else `global_head_dim` (512 where the
    config is silent) and, where `attention_k_eq_v`, `num_global_key_value_heads`. Overrides
    of anything else, of a sliding layer, or differing among the full layers are refused."""
    r.read.update({"per_layer_config", "global_head_dim", "num_global_key_value_heads"})
    overrides = r.hf.get("per_layer_config")
    if overrides is None:
        kv = r.hf.get("num_global_key_value_heads") if k_eq_v else None
        return dict(head_dim=int(r.get("global_head_dim", 512)), num_kv_heads=int(kv or K))
    per_layer = {int(i): dict(v) for i, v in dict(overrides).items()}
    if any(i not in full for i, v in per_layer.items() if v):
        r.refuse("per_layer_config", "only the full-attention layers' head shapes may differ from the top level's")
    unknown = {k for v in per_layer.values() for k in v} - {"head_dim", "num_key_value_heads"}
    if unknown:
        r.refuse("per_layer_config", f"per-layer overrides of {sorted(unknown)} are not implemented")
    seen = {(v.get("head_dim", Dh), v.get("num_key_value_heads", K)) for v in (per_layer.get(i, {}) for i in full)}
    if len(seen) > 1:
        r.refuse("per_layer_config", "full-attention layers of different head shapes are not implemented")
    head_dim, kv = seen.pop() if seen else (Dh, K)
    return dict(head_dim=int(head_dim), num_kv_heads=int(kv))


def _gemma4_rope(r: _Reader, types: list, Dh: int, global_dim: int) -> dict:
    """Gemma 4's rotary settings per layer type: the full-attention layers' 'proportional' (or
    'default') rotary over their whole heads, the sliding layers' plain rotary at a base of
    their own (`local_rope_theta`)."""
    r.read.update({"rope_parameters", "rope_scaling"})
    per_type = r.hf.get("rope_parameters")
    if per_type is None:  # transformers' defaults
        per_type = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        }
    if not isinstance(per_type, Mapping) or set(per_type) - {"full_attention", "sliding_attention"}:
        r.refuse("rope_parameters", "Gemma 4's rope_parameters are per layer type (full_attention, sliding_attention)")
    if r.hf.get("rope_scaling"):
        r.refuse("rope_scaling", "Gemma 4 takes its rotary settings from rope_parameters")
    full = dict(per_type.get("full_attention") or {})
    sliding = dict(per_type.get("sliding_attention") or {})
    if "sliding_attention" in types:
        if sliding.get("rope_type", "default") != "default" or set(sliding) - {"rope_type", "rope_theta"}:
            r.refuse("rope_parameters", "sliding layers take a plain rotary base (rope_type 'default') only")
        if "rope_theta" not in sliding:
            r.refuse("rope_parameters", "the sliding layers' rope_theta is missing")
    rope_type = full.get("rope_type", "default")
    if rope_type not in ("default", "proportional") or "rope_theta" not in full:
        r.refuse("rope_parameters", "full-attention layers take 'default' or 'proportional' rotary with a rope_theta")
    known = {"rope_type", "rope_theta"}
    if rope_type == "proportional":
        known |= {"partial_rotary_factor", "factor"}
    if set(full) - known:
        r.refuse("rope_parameters", f"full-attention rope settings {sorted(set(full) - known)} are not implemented")
    fields = dict(rope_theta=float(full["rope_theta"]), rotary_dim=0)
    if "sliding_attention" in types:
        fields["local_rope_theta"] = float(sliding["rope_theta"])
    if rope_type == "proportional":
        angles = int(float(full.get("partial_rotary_factor", 1.0)) * global_dim // 2)
        if angles < 1:
            r.refuse("rope_parameters", "proportional rotary without a rotating frequency")
        fields.update(
            rope_type="proportional",
            rope_factor=float(full.get("factor", 1.0)),
            rotary_dim=0 if 2 * angles == global_dim else 2 * angles,
        )
    return fields


def _olmo_layer(r: _Reader) -> dict:
    """What OLMo 2 and OLMoE share: Llama's shapes, q/k norms over the whole projection."""
    shapes = _shapes(r)
    return dict(
        _common(r, shapes),
        **_rope(r, shapes["head_dim"]),
        activation=r.activation("hidden_act"),
        qkv_bias=bool(r.get("attention_bias", False)),
        o_bias=bool(r.get("attention_bias", False)),
        qk_norm=True,
        qk_norm_scope="projection",
    )


def _olmo2(r: _Reader) -> dict:
    """OLMo 2: norms after attention and the MLP only, q/k norms over the whole projection."""
    return dict(_olmo_layer(r), norm_scale_in_float32=True, pre_norms=False, post_norms=True)


def _olmoe(r: _Reader) -> dict:
    """OLMoE: Llama's pre-norm layer with OLMo 2's q/k norms over the whole projection and a
    mixture of experts for its MLP."""
    if r.get("clip_qkv") is not None:
        r.refuse("clip_qkv", "clipped queries, keys and values are not implemented")
    return {**_olmo_layer(r), **_experts(r)}


def _gpt_oss(r: _Reader) -> dict:
    """GPT-OSS: Llama's pre-norm layer (RMSNorm scaled in float32) with biases on every
    projection, attention sinks, sliding and full layers alternating, YaRN rotary, and a mixture
    of experts with a biased router (softmax over the chosen experts' logits: their scores
    renormalised) and biased experts computing a clamped GLU."""
    shapes = _shapes(r)
    r.read.add("hidden_act")  # (the clamped GLU has its own activation)
    bias = bool(r.get("attention_bias", True))
    return dict(
        _common(r, shapes),
        **_rope(r, shapes["head_dim"]),
        **_layer_types(r, shapes["num_layers"], pattern=2, default_window=128),
        qkv_bias=bias,
        o_bias=bias,
        norm_scale_in_float32=True,
        attention_sinks=True,
        mlp="clamped",
        mlp_bias=True,
        glu_alpha=float(r.get("swiglu_alpha", 1.702)),
        glu_limit=float(r.get("swiglu_limit", 7.0)),
        **_experts(r),
        router_bias=True,
    )


def _deepseek_v3(r: _Reader) -> dict:
    """DeepSeek-V3: multi-head latent attention (a query latent, a key-value latent and one
    rotary key shared by the heads, the rotated dims last), YaRN rotary whose scale also scales
    the attention scores, and a mixture of experts with a sigmoid router picking by its scores
    plus a learned correction among the best groups of experts, weights renormalised and
    scaled, and shared experts; dense layers first (`first_k_dense_replace`)."""
    shapes = _shapes(r)
    H = shapes["num_heads"]
    nope, rope, value = (int(r.need(k)) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    r.read.update({"head_dim", "qk_head_dim", "num_nextn_predict_layers", "ep_size", "aux_loss_alpha", "seq_aux"})
    for key, allowed, why in (
        ("num_key_value_heads", (H,), "latent attention expands keys and values for every head"),
        ("attention_bias", (False,), "biases in latent attention are not implemented"),
        ("pretraining_tp", (1,), "tensor-parallel pretraining slices are not implemented"),
        ("topk_method", ("noaux_tc",), "only DeepSeek-V3's group-limited routing is implemented"),
        ("scoring_func", ("sigmoid",), "only DeepSeek-V3's sigmoid scores are implemented"),
        ("moe_layer_freq", (1,), "dense layers among the sparse ones are not implemented yet"),
    ):
        r.require(key, allowed, why)
    rotary = _rope(r, rope)
    rope_settings = dict(r.hf.get("rope_parameters") or r.hf.get("rope_scaling") or {})
    scale = (nope + rope) ** -0.5
    m_all = rope_settings.get("mscale_all_dim")
    if rotary.get("rope_type", "default") != "default" and m_all:  # transformers' yarn_apply_mscale
        scale = scale * _yarn_mscale(rope_settings["factor"], m_all) ** 2
    common = _common(r, {**shapes, "num_kv_heads": H, "head_dim": nope + rope})
    return dict(
        common,
        **{**rotary, "rotary_dim": rope},
        rotary_last=True,
        rope_interleaved=bool(r.get("rope_interleave", True)),
        attn_scale=float(scale),
        activation=r.activation("hidden_act"),
        qkv_bias=False,
        q_lora_rank=int(r.get("q_lora_rank") or 0),
        kv_lora_rank=int(r.need("kv_lora_rank")),
        value_head_dim=value,
        **_experts(r),
        router="sigmoid",
        router_correction=True,
        router_groups=int(r.get("n_group") or 1),
        router_groups_kept=int(r.get("topk_group") or 1),
        expert_scale=float(r.get("routed_scaling_factor", 1.0)),
        shared_expert_size=int(r.get("n_shared_experts") or 0) * int(r.need("moe_intermediate_size")),
    )


def _qwen3_5(r: _Reader) -> dict:
    """Qwen3.5 (the text model): three of every four layers linear attention (the gated delta
    rule after a causal convolution, `jaxdepth.core.linear_attention`), the others full
    attention with a sigmoid gate on each head's output, q/k norms over each head, partial
    rotary (a quarter of each head where the config is silent, as transformers defaults it);
    RMSNorms scaling by 1 + w in float32. The multimodal rotary's sections (`mrope_section`)
    coincide for text, whose three position grids are one: read, and inert."""
    shapes = _shapes(r)
    L = shapes["num_layers"]
    types = r.get("layer_types")
    if types is None:
        interval = int(r.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(L)]
    r.read.update({"layer_types", "full_attention_interval"})
    if len(types) != L or set(types) - {"linear_attention", "full_attention"}:
        r.refuse("layer_types", f"Qwen3.5's layers are linear_attention or full_attention, one per layer; got {types}")
    rope = dict(r.hf.get("rope_parameters") or {})
    rope.setdefault("partial_rotary_factor", 0.25)
    for inert in ("mrope_section", "mrope_interleaved"):
        rope.pop(inert, None)
    r.read.update({"rope_parameters", "rope_scaling"})
    if r.get("attention_bias"):
        r.refuse("attention_bias", "biases in Qwen3.5's attention are not implemented")
    return dict(
        _common(r, shapes),
        **_rope(r, shapes["head_dim"], rope, "rope_parameters"),
        activation=r.activation("hidden_act"),
        qkv_bias=False,
        qk_norm=True,
        norm_offset=1.0,
        norm_scale_in_float32=True,
        attention_gate=True,
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        linear_key_heads=int(r.need("linear_num_key_heads")),
        linear_value_heads=int(r.need("linear_num_value_heads")),
        linear_key_dim=int(r.need("linear_key_head_dim")),
        linear_value_dim=int(r.need("linear_value_head_dim")),
        linear_conv_kernel=int(r.need("linear_conv_kernel_dim")),
    )


def _phi3(r: _Reader) -> dict:
    """Phi-3: Llama's layer with fused q/k/v and gate/up projections and a sliding window."""
    shapes = _shapes(r)
    return dict(
        _common(r, shapes),
        **_rope(r, shapes["head_dim"]),
        **_layer_types(r, shapes["num_layers"], all_sliding=True),
        activation=r.activation("hidden_act"),
        qkv_bias=False,
    )


def _gpt2(r: _Reader) -> dict:
    """GPT-2: LayerNorm with biases, learned absolute positions, a GELU MLP, biases everywhere."""
    shapes = _shapes(r, hidden="n_embd", layers="n_layer", heads="n_head")
    for key, allowed, why in (
        ("scale_attn_weights", (True,), "unscaled attention scores are not implemented"),
        ("scale_attn_by_inverse_layer_idx", (False,), "scores scaled by the layer index are not implemented"),
        ("reorder_and_upcast_attn", (False,), "the reordered, upcast attention is not implemented"),
        ("add_cross_attention", (False,), "cross-attention is not implemented"),
    ):
        r.require(key, allowed, why)
    width = shapes["hidden_size"]
    return dict(
        shapes,
        intermediate_size=int(r.get("n_inner", 4 * width)),
        rms_norm_eps=float(r.need("layer_norm_epsilon")),
        max_position_embeddings=int(r.need("n_positions")),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", True)),
        rope_theta=0.0,
        positions="learned",
        norm="layer",
        activation=r.activation("activation_function"),
        mlp="plain",
        mlp_bias=True,
        qkv_bias=True,
        o_bias=True,
    )


def _gpt_neox(r: _Reader) -> dict:
    """GPT-NeoX / Pythia: parallel attention and MLP, partial rotary, LayerNorm, biases."""
    shapes = _shapes(r)
    bias = bool(r.get("attention_bias", True))
    return dict(
        _common(r, shapes, eps="layer_norm_eps"),
        **_rope(r, shapes["head_dim"]),
        norm="layer",
        parallel_residual=bool(r.get("use_parallel_residual", True)),
        activation=r.activation("hidden_act"),
        mlp="plain",
        mlp_bias=True,
        qkv_bias=bias,
        o_bias=bias,
    )


_FAMILIES: dict[str, Callable[[_Reader], dict]] = {  # each a setting of the one decoder layer
    "qwen2": _llama_like,
    "qwen3": _llama_like,
    "llama": _llama_like,
    "smollm3": _llama_like,
    "mistral": _llama_like,
    "mixtral": _llama_like,
    "qwen3_moe": _llama_like,
    "olmoe": _olmoe,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
    "qwen3_5_text": _qwen3_5,
    "gemma2": _gemma,
    "gemma3_text": _gemma,
    "gemma4_text": _gemma4,
    "gemma4": _gemma4_multimodal,
    "olmo2": _olmo2,
    "phi3": _phi3,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
}

# The Hugging Face `model_type`s `ModelConfig.from_hf` reads.
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)
