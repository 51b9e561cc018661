"""Each family's Hugging Face tensor names, and how its fused tensors are cut into jaxdepth's.

`hf_source(config, tensors)` gives `assemble_params` (`conversion.layout`) the checkpoint as one
tensor per jaxdepth param, in the PyTorch `[out, in]` layout: Phi-3's fused q/k/v and gate/up
projections, GPT-NeoX's per-head interleaved q/k/v and GPT-2's fused `c_attn` (stored `[in, out]`,
as every GPT-2 `Conv1D`) are cut into named views, and the buffers some checkpoints store beside
the weights (causal masks, rotary frequencies) are set aside by name, never silently.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping

import numpy as np

from conversion.errors import ConversionError
from jaxdepth.core.config import ModelConfig

_LLAMA_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "o": "self_attn.o_proj.weight",
    "o_bias": "self_attn.o_proj.bias",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
    "gate_bias": "mlp.gate_proj.bias",
    "up_bias": "mlp.up_proj.bias",
    "down_bias": "mlp.down_proj.bias",
}
# Gemma 2/3 name the norm after attention `post_attention_layernorm`, Llama's name for the norm
# before the MLP; OLMo 2 has only the norms after the sublayers.
_GEMMA_LAYER = {
    **_LLAMA_LAYER,
    "attn_post_norm": "post_attention_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "mlp_post_norm": "post_feedforward_layernorm.weight",
}
_OLMO2_LAYER = {
    **{k: v for k, v in _LLAMA_LAYER.items() if k not in ("attn_norm", "mlp_norm")},
    "attn_post_norm": "post_attention_layernorm.weight",
    "mlp_post_norm": "post_feedforward_layernorm.weight",
}
_PHI3_LAYER = {
    **_LLAMA_LAYER,
    "q": "self_attn.qkv_proj.weight#q",
    "k": "self_attn.qkv_proj.weight#k",
    "v": "self_attn.qkv_proj.weight#v",
    "gate": "mlp.gate_up_proj.weight#gate",
    "up": "mlp.gate_up_proj.weight#up",
}
_NEOX_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "attn_norm_bias": "input_layernorm.bias",
    "mlp_norm": "post_attention_layernorm.weight",
    "mlp_norm_bias": "post_attention_layernorm.bias",
    **{
        f"{x}{part}": f"attention.query_key_value.{kind}#{x}"
        for x in "qkv"
        for part, kind in (("", "weight"), ("_bias", "bias"))
    },
    "o": "attention.dense.weight",
    "o_bias": "attention.dense.bias",
    "up": "mlp.dense_h_to_4h.weight",
    "up_bias": "mlp.dense_h_to_4h.bias",
    "down": "mlp.dense_4h_to_h.weight",
    "down_bias": "mlp.dense_4h_to_h.bias",
}
# GPT-2's Conv1D weights are stored [in, out]: '#T' views are them transposed.
_GPT2_LAYER = {
    "attn_norm": "ln_1.weight",
    "attn_norm_bias": "ln_1.bias",
    "mlp_norm": "ln_2.weight",
    "mlp_norm_bias": "ln_2.bias",
    **{f"{x}{part}": f"attn.c_attn.{kind}#{x}" for x in "qkv" for part, kind in (("", "weight"), ("_bias", "bias"))},
    "o": "attn.c_proj.weight#T",
    "o_bias": "attn.c_proj.bias",
    "up": "mlp.c_fc.weight#T",
    "up_bias": "mlp.c_fc.bias",
    "down": "mlp.c_proj.weight#T",
    "down_bias": "mlp.c_proj.bias",
}


def _names(top: Mapping[str, str], layer_prefix: str, layer: Mapping[str, str]) -> dict:
    return {**top, "layers": {key: f"{layer_prefix}{{i}}.{name}" for key, name in layer.items()}}


_LLAMA_TOP = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
_FAMILY_NAMES = {
    "llama": _names(_LLAMA_TOP, "model.layers.", _LLAMA_LAYER),
    "gemma": _names(_LLAMA_TOP, "model.layers.", _GEMMA_LAYER),
    "olmo2": _names(_LLAMA_TOP, "model.layers.", _OLMO2_LAYER),
    "phi3": _names(_LLAMA_TOP, "model.layers.", _PHI3_LAYER),
    "gpt_neox": _names(
        {
            "embed": "gpt_neox.embed_in.weight",
            "final_norm": "gpt_neox.final_layer_norm.weight",
            "final_norm_bias": "gpt_neox.final_layer_norm.bias",
            "lm_head": "embed_out.weight",
        },
        "gpt_neox.layers.",
        _NEOX_LAYER,
    ),
    "gpt2": _names(
        {
            "embed": "transformer.wte.weight",
            "pos_embed": "transformer.wpe.weight",
            "final_norm": "transformer.ln_f.weight",
            "final_norm_bias": "transformer.ln_f.bias",
            "lm_head": "lm_head.weight",
        },
        "transformer.h.",
        _GPT2_LAYER,
    ),
}
_FAMILY_OF = {
    "gemma2": "gemma",
    "gemma3_text": "gemma",
    "olmo2": "olmo2",
    "phi3": "phi3",
    "gpt2": "gpt2",
    "gpt_neox": "gpt_neox",
}

# HF names of the Llama layout, kept for the callers that read a Llama/Qwen checkpoint directly.
HF_NAMES = _FAMILY_NAMES["llama"]

# Buffers, not weights, that older checkpoints store: GPT-2's causal masks, GPT-NeoX's masks and
# rotary frequencies. jaxdepth computes them itself.
_BUFFERS = re.compile(r"(\.attn\.(masked_)?bias|\.attention\.(masked_)?bias|\.rotary_emb\.inv_freq)$")


def hf_names(config: ModelConfig) -> dict:
    """The jaxdepth param -> HF tensor name table of `config`'s family ('{i}' the layer)."""
    return _FAMILY_NAMES[_FAMILY_OF.get(config.model_type, "llama")]


def hf_source(config: ModelConfig, tensors: Mapping[str, np.ndarray]) -> tuple[set, Callable[[str], np.ndarray], dict]:
    """`(available, get, names)` for `assemble_params`: the checkpoint's tensor names with fused
    tensors replaced by their views, a reader of either, and the family's name table. GPT-2
    checkpoints saved without the LM head's `transformer.` prefix are read as well."""
    names = hf_names(config)
    if config.model_type == "gpt2" and not any(n.startswith("transformer.") for n in tensors):
        names = _strip_prefix(names, "transformer.")
    buffers = {n for n in tensors if _BUFFERS.search(n)}
    views: dict[str, Callable[[], np.ndarray]] = {}
    fused: set[str] = set()
    for name in _view_names(names, config):
        source, part = name.rsplit("#", 1)
        if source in tensors:
            fused.add(source)
            views[name] = _view(tensors[source], part, config)
    available = (set(tensors) - buffers - fused) | set(views)
    get = lambda n: views[n]() if n in views else tensors[n]  # noqa: E731
    return available, get, names


def _strip_prefix(names: dict, prefix: str) -> dict:
    strip = lambda n: n[len(prefix) :] if n.startswith(prefix) else n  # noqa: E731
    return {k: ({kk: strip(vv) for kk, vv in v.items()} if isinstance(v, dict) else strip(v)) for k, v in names.items()}


def _view_names(names: dict, config: ModelConfig) -> list[str]:
    templates = [v for v in names["layers"].values() if "#" in v]
    return [t.format(i=i) for t in templates for i in range(config.num_layers)]


def _view(fused: np.ndarray, part: str, config: ModelConfig) -> Callable[[], np.ndarray]:
    """A reader of the `part` of a fused tensor, in the `[out, in]` layout (a bias: `[out]`)."""
    H, K, Dh = config.num_heads, config.num_kv_heads, config.head_dim

    def cut():
        x = np.asarray(fused)
        if part == "T":
            return x.T
        if config.model_type == "phi3":  # rows [q | k | v] and [gate | up]
            if part in ("gate", "up"):
                half = x.shape[0] // 2
                return x[:half] if part == "gate" else x[half:]
            bounds = {"q": (0, H * Dh), "k": (H * Dh, (H + K) * Dh), "v": ((H + K) * Dh, (H + 2 * K) * Dh)}
            lo, hi = bounds[part]
            return x[lo:hi]
        j = "qkv".index(part)
        if config.model_type == "gpt_neox":  # rows per head: [q_h | k_h | v_h]
            per_head = x.reshape((H, 3, Dh) + x.shape[1:])
            return per_head[:, j].reshape((H * Dh,) + x.shape[1:])
        if config.model_type == "gpt2":  # Conv1D [in, 3 D]: columns [q | k | v]
            width = x.shape[-1] // 3
            return x[..., j * width : (j + 1) * width].T
        raise ConversionError(f"no fused layout for {config.model_type!r}")

    return cut
