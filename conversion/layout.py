"""Source tensor names to jaxdepth params: llama.cpp's GGUF names per architecture (declared with
the params, `jaxdepth.core.parameters`; `gguf_source` cuts its fused tensors), and
`assemble_params`, which every source format (the Hugging Face families, `conversion.hf_layouts`;
GGUF) goes through.

Sources give tensors in the PyTorch `nn.Linear` layout `[out, in]`; jaxdepth stores `[in, out]`.
`assemble_params` stacks per-layer tensors on a leading layer axis and checks that every
source tensor is used exactly once, so a renamed or extra tensor can never be dropped silently.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional

import numpy as np

from conversion.errors import ConversionError
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.parameters import GGUF, PARAMETERS, param_shapes, row_layers, transposed_params

__all__ = [
    "gguf_names",
    "gguf_source",
    "assemble_params",
    "GGUF_NAMES",
]


# Params stored transposed relative to the source's [out, in] layout.
_TRANSPOSED = transposed_params()


def gguf_names(arch: str) -> dict:
    """The jaxdepth param -> GGUF tensor name table of llama.cpp architecture `arch` ('{i}' the
    layer), from the parameters' declaration (`jaxdepth.core.parameters.GGUF`). llama.cpp names a
    tensor by its place in the layer, whatever the architecture (`ffn_norm` is the norm before the
    MLP, which Gemma's Hugging Face checkpoints call `pre_feedforward_layernorm` and Llama's
    `post_attention_layernorm`), so one table serves all with separate projections:
    `assemble_params` reads only the params the config has. Fused tensors, which llama.cpp keeps
    as the checkpoint has them, are named by part ('#q', '#gate', ...: `gguf_source` cuts them)."""
    return GGUF.table(GGUF.family(arch))


# Every architecture's table, by llama.cpp's architecture name.
GGUF_NAMES = {arch: gguf_names(arch) for arch in GGUF.family_of}


def gguf_source(
    config: ModelConfig, available: Iterable[str], get: Callable[[str], np.ndarray], names: Mapping
) -> tuple[set, Callable[[str], np.ndarray]]:
    """`(available, get)` for `assemble_params`, each fused tensor of `names` replaced by its
    parts ('#q', '#gate', ...), cut as llama.cpp stacks them: rows [q | k | v] of `attn_qkv` and
    its bias (grouped-query widths), rows [gate | up] of Phi-3's `ffn_up`."""
    H, K, Dh = config.num_heads, config.num_kv_heads, config.head_dim
    rows = {"q": (0, H * Dh), "k": (H * Dh, (H + K) * Dh), "v": ((H + K) * Dh, (H + 2 * K) * Dh)}
    available = set(available)
    views = {
        template.format(i=i)
        for template in names["layers"].values()
        if "#" in template
        for i in range(config.num_layers)
        if template.format(i=i).split("#")[0] in available
    }

    def cut(name: str) -> np.ndarray:
        source, part = name.split("#")
        x = np.asarray(get(source))
        if part in ("gate", "up"):
            half = x.shape[0] // 2
            return x[:half] if part == "gate" else x[half:]
        lo, hi = rows[part]
        if x.shape[0] != (H + 2 * K) * Dh:
            raise ConversionError(f"tensor {source!r} has {x.shape[0]} rows; q, k and v take {(H + 2 * K) * Dh}")
        return x[lo:hi]

    fused = {name.split("#")[0] for name in views}
    return (available - fused) | views, lambda name: cut(name) if "#" in name else get(name)


def _non_finite(x: np.ndarray) -> str:
    """How many of `x`'s values are NaN and how many infinite, said in words."""
    nan, inf = int(np.isnan(x).sum()), int(np.isinf(x).sum())
    return " and ".join(f"{n} {what} value{'s' if n > 1 else ''}" for n, what in ((nan, "NaN"), (inf, "infinite")) if n)


def assemble_params(
    config: ModelConfig, available: Iterable[str], get: Callable[[str], np.ndarray], names: Mapping, dtype=np.float32
) -> dict:
    """Build the params pytree for `config` from source tensors.

    `available` lists every tensor name in the source, `get(name)` returns it as an array in
    `[out, in]` layout. Raises `ConversionError` naming any missing, mis-shaped or unused tensor.
    A tied checkpoint that still stores the LM head must store a copy of the embeddings.
    """
    available = set(available)
    used: set[str] = set()
    shapes = param_shapes(config)

    def fetch(name: str, key: str, want_shape, layer: Optional[int] = None) -> np.ndarray:
        if name not in available:
            raise ConversionError(f"checkpoint has no tensor {name!r} (needed for {key!r})")
        if name in used:
            raise ConversionError(f"tensor {name!r} would be used twice")
        used.add(name)
        x = np.asarray(get(name))
        if key in _TRANSPOSED:  # [out, in] -> [in, out], per expert in a stack of them
            x = np.swapaxes(x, -1, -2)
        if tuple(x.shape) != tuple(want_shape):
            raise ConversionError(f"tensor {name!r} has shape {x.shape} (as {key!r}); expected {tuple(want_shape)}")
        # tensor by tensor, as it is read: a broken checkpoint is named before the rest is read
        # and converted, by the checkpoint's own name and the layer
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            where = f"layer {layer}'s {key!r}" if layer is not None else repr(key)
            raise ConversionError(
                f"checkpoint tensor {name.split('#')[0]!r} ({where}) contains {_non_finite(x)}: the checkpoint is "
                "damaged, or was saved from a diverged model"
            )
        return x.astype(dtype)

    params = {key: fetch(names[key], key, shape) for key, shape in shapes.items() if key != "layers"}

    def fetch_layer(template: str, key: str, shape, i: int) -> np.ndarray:
        if "{e}" not in template:
            return fetch(template.format(i=i), key, shape, i)
        # one tensor per expert: stacked on the expert axis
        return np.stack([fetch(template.format(i=i, e=e), key, shape[1:], i) for e in range(shape[0])])

    rows = {row.name: row for row in PARAMETERS}
    params["layers"] = {  # a kind's weights stacked over its own layers (`row_layers`)
        key: np.stack([fetch_layer(names["layers"][key], key, shape[1:], i) for i in row_layers(rows[key], config)])
        for key, shape in shapes["layers"].items()
    }
    if config.tie_word_embeddings and names["lm_head"] in available:
        head = np.asarray(get(names["lm_head"]))
        if head.shape != params["embed"].shape or not np.array_equal(head.astype(dtype), params["embed"]):
            raise ConversionError(
                f"config says tie_word_embeddings but {names['lm_head']!r} differs from the embeddings"
            )
        used.add(names["lm_head"])
    unused = sorted(available - used)
    if unused:
        shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        raise ConversionError(f"{len(unused)} checkpoint tensor(s) not used by the conversion: {shown}")
    return params
