"""Each family's Hugging Face tensor names, and how its fused tensors are cut into jaxdepth's.

The names are declared with the params (`jaxdepth.core.parameters`: each row's `hf` column,
`HF` its naming families); this module reads them.

`hf_source(config, tensors)` gives `assemble_params` (`conversion.layout`) the checkpoint as one
tensor per jaxdepth param, in the PyTorch `[out, in]` layout. Fused tensors are cut into named
views: Phi-3's fused q/k/v and gate/up projections, GPT-NeoX's per-head interleaved q/k/v,
GPT-2's fused `c_attn` (stored `[in, out]`, as every GPT-2 `Conv1D`), GPT-OSS's experts (stacked
`[E, in, out]`, gate and up columns interleaved) and Gemma 4's (stacked `[E, 2F, D]`, gate rows
then up rows). DeepSeek's interleaved rotary rows are reordered into halves (`#rope`,
`#rope_last`), and the buffers some checkpoints store beside the weights (causal masks, rotary
frequencies) are set aside by name, never silently.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping

import numpy as np

from conversion.errors import ConversionError
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.parameters import HF

__all__ = [
    "hf_names",
    "hf_source",
    "HF_NAMES",
]


# HF names of the Llama layout, kept for the callers that read a Llama/Qwen checkpoint directly.
HF_NAMES = HF.table("llama")

# Buffers, not weights, that older checkpoints store: GPT-2's causal masks, GPT-NeoX's masks and
# rotary frequencies. jaxdepth computes them itself.
_BUFFERS = re.compile(r"(\.attn\.(masked_)?bias|\.attention\.(masked_)?bias|\.rotary_emb\.inv_freq)$")

# The multimodal Gemma 4's towers and their projections into the text model, set aside by prefix.
_GEMMA4_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


def hf_names(config: ModelConfig) -> dict:
    """The jaxdepth param -> HF tensor name table of `config`'s family ('{i}' the layer), from the
    parameters' declaration (`jaxdepth.core.parameters.HF`)."""
    return HF.table(HF.family(config.model_type))


def hf_source(config: ModelConfig, tensors: Mapping[str, np.ndarray]) -> tuple[set, Callable[[str], np.ndarray], dict]:
    """`(available, get, names)` for `assemble_params`: the checkpoint's tensor names with fused
    tensors replaced by their views, a reader of either, and the family's name table. GPT-2
    checkpoints saved without the LM head's `transformer.` prefix are read as well."""
    names = hf_names(config)
    if config.model_type == "gpt2" and not any(n.startswith("transformer.") for n in tensors):
        names = _strip_prefix(names, "transformer.")
    buffers = {n for n in tensors if _BUFFERS.search(n)}
    if config.model_type == "gemma4":  # the multimodal Gemma 4's vision and audio towers: not its text model
        buffers |= {n for n in tensors if n.startswith(_GEMMA4_TOWERS)}
    if config.model_type == "deepseek_v3":  # its multi-token prediction layers, past the model's own
        beyond = re.compile(r"^model\.layers\.(\d+)\.")
        buffers |= {n for n in tensors if (m := beyond.match(n)) and int(m.group(1)) >= config.num_layers}
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
        if part in ("gated_q", "gated_gate"):  # Qwen3.5's q_proj: rows per head [query_h | gate_h]
            per_head = x.reshape((H, 2, Dh) + x.shape[1:])
            return per_head[:, 0 if part == "gated_q" else 1].reshape((H * Dh,) + x.shape[1:])
        if part == "conv":  # a depthwise Conv1d's [C, 1, K] -> [C, K]
            return x[:, 0, :]
        if part == "T":  # [in, out] (per expert in a stack of them) -> [out, in]
            return np.swapaxes(x, -1, -2)
        if part in ("rope", "rope_last"):  # DeepSeek's rotated dims: pairs -> halves
            group = config.head_dim if part == "rope" else x.shape[0]  # per head, or the last R rows
            return _rope_halves(x, group, config) if config.rope_interleaved else x
        if config.model_type == "gpt_oss":  # columns of gate_up interleaved: gate, up, gate, up, ...
            own = x[..., 0::2] if part == "gate" else x[..., 1::2]
            return np.swapaxes(own, -1, -2) if own.ndim == 3 else own  # weights [E, in, out], biases [E, out]
        if part in ("gate", "up") and config.model_type in ("phi3", "gemma4_text", "gemma4"):
            # rows [gate | up] (Phi-3's MLP; Gemma 4's experts, `[E, 2F, D]`, each its own)
            half = x.shape[-2] // 2
            return x[..., :half, :] if part == "gate" else x[..., half:, :]
        if config.model_type == "phi3":  # rows [q | k | v]
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


def _rope_halves(x: np.ndarray, group: int, config: ModelConfig) -> np.ndarray:
    """Rows `[out, in]` whose groups end in R rotated dims stored as interleaved pairs
    (x0, x1), (x2, x3), ..., reordered to the halves (x0, x2, ... | x1, x3, ...) that the layer
    rotates: the queries' rows per head (`group` = `head_dim`: part '#rope'), or the latent
    projection's last R rows (one group, its first rows the latent: '#rope_last').
    transformers' interleaved rotation produces the same halves, so the rotated queries and
    keys are its own."""
    R = config.rotated_dims
    rows = x.reshape((-1, group) + x.shape[1:])
    rotated = rows[:, group - R :]
    halves = np.concatenate([rotated[:, 0::2], rotated[:, 1::2]], axis=1)
    return np.concatenate([rows[:, : group - R], halves], axis=1).reshape(x.shape)
