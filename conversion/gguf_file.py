"""llama.cpp GGUF files (llama or qwen2 architecture) -> jaxdepth params.

Quantized tensors are dequantized with `gguf`. llama.cpp's converter permutes the rows of the
llama q/k projections into its own rotary layout; we undo it exactly as transformers' GGUF
loader does, so the result matches `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`.
"""

from __future__ import annotations

import os

import numpy as np

from conversion.errors import ConversionError
from conversion.layout import GGUF_NAMES, assemble_params
from jaxdepth.core.config import ModelConfig, UnsupportedConfigError
from jaxdepth.core.weights import ModelWeights

# Per-architecture metadata keys (after the "<arch>." prefix) read or known to be inert.
_HANDLED_KEYS = {
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "rope.freq_base",
    "attention.layer_norm_rms_epsilon",
    "vocab_size",
    "rope.dimension_count",
    "attention.key_length",
    "attention.value_length",
}


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (`[out, in]` layout, `n_heads` heads)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise UnsupportedConfigError(f"GGUF key 'general.architecture' = {arch!r} is not supported (llama, qwen2 are)")
    for key in reader.fields:
        if key.startswith(arch + ".") and key[len(arch) + 1 :] not in _HANDLED_KEYS:
            raise UnsupportedConfigError(
                f"GGUF key {key!r} = {_field(reader, key)!r} is not handled by jaxdepth; refusing to ignore it"
            )
    get = lambda k, d=None: _field(reader, f"{arch}.{k}", d)
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedConfigError(
            f"GGUF key '{arch}.rope.dimension_count' = {get('rope.dimension_count')}: partial rotary "
            f"embeddings (head_dim {head_dim}) are not implemented"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(get("vocab_size", len(tokens) if tokens is not None else 0))
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        model_type=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),  # llama.cpp's default when absent
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias=arch == "qwen2",
    )


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
    by_name = {t.name: t for t in reader.tensors}

    def get(name: str) -> np.ndarray:
        t = by_name[name]
        w = gguf.dequantize(t.data, t.tensor_type)
        if config.model_type == "llama" and ".attn_q." in name:
            w = unpermute_rotary_rows(w, config.num_heads)
        elif config.model_type == "llama" and ".attn_k." in name:
            w = unpermute_rotary_rows(w, config.num_kv_heads)
        return w

    params = assemble_params(config, by_name, get, GGUF_NAMES, dtype=dtype)
    tokenizer = None
    if load_tokenizer:
        from conversion.gguf_tokenizer import gguf_tokenizer

        tokenizer = gguf_tokenizer(reader)
    return ModelWeights(params=params, config=config, tokenizer=tokenizer, source=os.path.abspath(path))
