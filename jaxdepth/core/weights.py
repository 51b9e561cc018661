"""`ModelWeights`: a converted model as plain data (params, config, tokenizer, source).

Every converter (`conversion.hf`, `conversion.gguf_file`, `conversion.checkpoint`) returns one;
`jaxdepth.load` wraps it in the shell's `jaxdepth.Model`, which adds conveniences over the pure
functions. Defining the record here, below both, lets the converters depend on the core only.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.layer import Params


__all__ = [
    "ModelWeights",
    "derived_fingerprint",
]


@dataclasses.dataclass
class ModelWeights:
    """A converted model: params pytree, config, tokenizer (None if the source had none).

    `params`: the nested dict of arrays that the pure functions and every analysis take
    (`jaxdepth.core.model.param_shapes` gives its structure; per-layer weights are stacked on a
    leading layer axis): host numpy arrays straight from a converter, device arrays after
    `jaxdepth.load`. `config`: its `ModelConfig`. `tokenizer`: a Hugging Face tokenizer
    (`transformers`), or None. `source`: where it came from (the folder, `.gguf` file or hub id
    as resolved; for a converted folder, the source recorded when it was converted).
    `fingerprint`: what the model is, for its results (`jaxdepth.lab.model_identity`: the
    SHA-256 of the files it was loaded from, and the dtype it was loaded in); None for a model
    made in memory. A cast (`astype`, `with_matmul_dtype`) is another model: its fingerprint is
    derived (`derived_fingerprint`)."""

    params: Params
    config: ModelConfig
    tokenizer: Optional[Any]
    source: str
    fingerprint: Optional[str] = None

    def astype(self, dtype):
        """A copy (of the same class) with params cast to `dtype` (e.g. 'bfloat16': weights and
        activations in bf16; norms, softmaxes, logits and every statistic stay float32); this one
        is left as it is. The cast params are device arrays."""
        params = jax.tree.map(lambda x: jnp.asarray(x, dtype), self.params)
        return dataclasses.replace(self, params=params, fingerprint=derived_fingerprint(self.fingerprint, str(dtype)))

    def with_matmul_dtype(self, dtype):
        """A copy whose layers' weight matrices (q, k, v, o and the MLP's) are stored in `dtype`
        (e.g. 'bfloat16'), everything else as it is: the products of activations with those
        matrices then read the activations rounded to `dtype` and accumulate in float32
        (`jaxdepth.core.primitives.project`), while the embeddings, the residual stream, norms,
        softmaxes, the unembedding and every statistic stay in float32. On a CPU with AMX or
        avx512_bf16 those products run 3-4x faster than in float32; what it does to the
        analyses is measured in docs/precision.md. This one is left as it is."""
        # [L, in, out], and the experts' [L, E, in, out]
        matrices = {name for name, w in self.params["layers"].items() if w.ndim >= 3}
        layers = {name: jnp.asarray(w, dtype) if name in matrices else w for name, w in self.params["layers"].items()}
        fingerprint = derived_fingerprint(self.fingerprint, f"matmuls {dtype}")
        return dataclasses.replace(self, params={**self.params, "layers": layers}, fingerprint=fingerprint)


def derived_fingerprint(fingerprint: Optional[str], change: str) -> Optional[str]:
    """The fingerprint of a model made from the one of `fingerprint` by `change` (a dtype it is
    cast to: 'bfloat16'), a SHA-256 hex digest; None stays None (a model without files)."""
    if fingerprint is None:
        return None
    return hashlib.sha256(f"{fingerprint}:{change}".encode()).hexdigest()
