"""Source tensor names to jaxdepth params: the GGUF table, and `assemble_params`, which every
source format (the Hugging Face families, `conversion.hf_layouts`; GGUF) goes through.

Sources give tensors in the PyTorch `nn.Linear` layout `[out, in]`; jaxdepth stores `[in, out]`.
`assemble_params` stacks per-layer tensors on a leading layer axis and checks that every
source tensor is used exactly once, so a renamed or extra tensor can never be dropped silently.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import numpy as np

from conversion.errors import ConversionError
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import param_shapes

# Params stored transposed relative to the source's [out, in] layout.
_TRANSPOSED = {"q", "k", "v", "o", "gate", "up", "down", "lm_head"}

GGUF_NAMES = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
    "layers": {
        "attn_norm": "blk.{i}.attn_norm.weight",
        "q": "blk.{i}.attn_q.weight",
        "k": "blk.{i}.attn_k.weight",
        "v": "blk.{i}.attn_v.weight",
        "q_bias": "blk.{i}.attn_q.bias",
        "k_bias": "blk.{i}.attn_k.bias",
        "v_bias": "blk.{i}.attn_v.bias",
        "o": "blk.{i}.attn_output.weight",
        "mlp_norm": "blk.{i}.ffn_norm.weight",
        "gate": "blk.{i}.ffn_gate.weight",
        "up": "blk.{i}.ffn_up.weight",
        "down": "blk.{i}.ffn_down.weight",
    },
}


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

    def fetch(name: str, key: str, want_shape) -> np.ndarray:
        if name not in available:
            raise ConversionError(f"checkpoint has no tensor {name!r} (needed for {key!r})")
        if name in used:
            raise ConversionError(f"tensor {name!r} would be used twice")
        used.add(name)
        x = np.asarray(get(name))
        if key in _TRANSPOSED:
            x = x.T
        if tuple(x.shape) != tuple(want_shape):
            raise ConversionError(f"tensor {name!r} has shape {x.shape} (as {key!r}); expected {tuple(want_shape)}")
        return x.astype(dtype)

    params = {key: fetch(names[key], key, shape) for key, shape in shapes.items() if key != "layers"}
    params["layers"] = {
        key: np.stack([fetch(names["layers"][key].format(i=i), key, shape[1:]) for i in range(config.num_layers)])
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
