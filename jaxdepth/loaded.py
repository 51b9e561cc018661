"""`Model`: a loaded model, the one type every loader and converter returns.

Its params are the plain pytree the pure functions take (`jaxdepth.core.model.forward` and every
analysis): host numpy arrays straight from a converter, device arrays after `jaxdepth.load`.
"""

from __future__ import annotations

import dataclasses
import functools
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import Params, forward


@dataclasses.dataclass
class Model:
    """A loaded model: params pytree, config, tokenizer (None if the source had none).

    `module` is the same weights as a Flax NNX `jaxdepth.core.module.Decoder` (no copy): the object to
    hand to NNX code; `params` is what the pure functions and analyses take."""

    params: Params
    config: ModelConfig
    tokenizer: Optional[Any]
    source: str

    @functools.cached_property
    def module(self):
        """The decoder as an NNX module over these params (`nnx.split(model.module)[1]
        .to_pure_dict()` is `model.params`, leaf for leaf the same arrays)."""
        from jaxdepth.core.module import Decoder

        return Decoder(self.params, self.config)

    def logits(self, token_ids, valid=None) -> np.ndarray:
        """float32 logits `[B, T, V]` for int token ids `[B, T]` (right-padded if `valid` is given)."""
        tokens = np.asarray(token_ids)
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"token_ids must be an int array [batch, seq], got {tokens.dtype} {tokens.shape}")
        check_tokens(tokens, self.config)
        valid = None if valid is None else jnp.asarray(valid, bool)
        return np.asarray(_jit_forward(self.params, jnp.asarray(tokens, jnp.int32), self.config, valid))

    def astype(self, dtype) -> "Model":
        """The same model with params cast to `dtype` (e.g. 'bfloat16': weights and activations
        in bf16; norms, softmaxes, logits and every statistic stay float32)."""
        params = jax.tree.map(lambda x: jnp.asarray(x, dtype), self.params)
        return dataclasses.replace(self, params=params)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` with the tokenizer's defaults (BOS only where the tokenizer adds one)."""
        if self.tokenizer is None:
            raise ValueError(f"the model from {self.source} has no tokenizer")
        return np.asarray(self.tokenizer(text)["input_ids"], np.int32)


def check_tokens(tokens: np.ndarray, config: ModelConfig) -> None:
    """Clear errors for token ids the model cannot take."""
    if tokens.shape[-1] > config.max_position_embeddings:
        raise ValueError(f"sequence of {tokens.shape[-1]} tokens exceeds the model's context of "
                         f"{config.max_position_embeddings}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= config.vocab_size):
        raise ValueError(f"token ids must lie in [0, {config.vocab_size}), got [{tokens.min()}, {tokens.max()}]")


@partial(jit, static_argnames="config")
def _jit_forward(params, tokens, config, valid):
    return forward(params, tokens, config, valid=valid)
