"""`Model`: a loaded model, what `jaxdepth.load` returns: the converters' `ModelWeights` record
(params, config, tokenizer, source) with conveniences over the pure functions.

Its params are the plain pytree the pure functions take (`jaxdepth.core.model.forward` and every
analysis): device arrays after `jaxdepth.load`.
"""

from __future__ import annotations

import dataclasses
import functools
from functools import partial

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.core.batch import PromptArrays
from jaxdepth.core.compilation import jit
from jaxdepth.core.decoding import Decoding, generate, generate_orders
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import check_tokens, embed, forward, per_layer_inputs
from jaxdepth.core.weights import ModelWeights

__all__ = [
    "Model",
]


@dataclasses.dataclass
class Model(ModelWeights):
    """A loaded model: params pytree, config, tokenizer (None if the source had none), source;
    the fields of `jaxdepth.core.weights.ModelWeights`, which every converter returns
    (`Model.of(weights)` wraps one).

    The methods are conveniences over the pure functions, jitted once per shape and
    intervention structure, taking int token ids `[B, T]` (numpy or JAX) and checking them
    against the config (context length, vocabulary). `module` is the same weights as a Flax NNX
    `jaxdepth.core.module.Decoder` (no copy): the object to hand to NNX code."""

    @classmethod
    def of(cls, weights: ModelWeights) -> "Model":
        """The converted `weights` as a `Model` (the same arrays, no copy)."""
        return (
            weights
            if isinstance(weights, cls)
            else cls(**{f.name: getattr(weights, f.name) for f in dataclasses.fields(ModelWeights)})
        )

    @functools.cached_property
    def module(self):
        """The decoder as an NNX module over these params (`nnx.split(model.module)[1]
        .to_pure_dict()` is `model.params`, leaf for leaf the same arrays)."""
        from jaxdepth.core.module import Decoder

        return Decoder(self.params, self.config)

    def logits(self, token_ids, valid=None, *, interventions=None) -> np.ndarray:
        """float32 logits `[B, T, V]`, as a numpy array, for int token ids `[B, T]`.

        `valid` (bool `[B, T]`, default all true) marks the real tokens of right-padded prompts:
        no position attends to padding, and the logits at padded positions are meaningless.
        `interventions`: one `jaxdepth.sites.Intervention` or a list of them
        (`jaxdepth.core.sites.as_interventions`). Jitted once per shape and
        intervention structure; params are an argument, never closed over."""
        tokens, valid = self._checked(token_ids, valid)
        return np.asarray(_jit_forward(self.params, tokens, self.config, valid, interventions))

    def run(self, token_ids, *, tap=None, valid=None, interventions=None):
        """`(h_L [B, T, D], tapped)` as JAX arrays: every layer under `interventions`, and what
        `tap(record, None)` returns for each layer's `jaxdepth.core.model.LayerRecord`, stacked
        on a leading layer axis (None without a tap). `h_L` is the final residual, before the
        final norm. `tap` is static: define it once to reuse the compilation. `valid` and
        `interventions` as in `logits`."""
        tokens, valid = self._checked(token_ids, valid)
        return _jit_run(self.params, tokens, self.config, valid, interventions, tap)

    def integrated_gradients(self, token_ids, what, **options):
        """`jaxdepth.integrated_gradients` on this model: a `SiteIG` attributing `what`, a
        `Metric` or an `Attribution(metric, site=..., layers=..., baseline=...)`, to the value at
        a site of each layer (`token_ids` and the options as there: `rule`, `interventions`,
        `execution`)."""
        from jaxdepth.analyses.ig import integrated_gradients

        return integrated_gradients(self.params, token_ids, self.config, what, **options)

    def site_gradients(self, token_ids, metric, sites=("resid_pre",), *, valid=None, interventions=None):
        """`jaxdepth.analyses.attribution.site_gradients` on this model, jitted: a
        `SiteGradients` with the gradient of `metric` (a `jaxdepth.Metric`, one value per
        prompt, read at its declared positions only; summed over the prompts) at each of
        `sites` of every layer, and the values there, each `[L, B, T, ...]` (`resid_pre`: L+1
        rows, the last the final residual), from one forward and one backward pass. `metric`
        is static: define it once. A metric that reads a padded position (`valid` false) is
        refused first, naming the prompt (`jaxdepth.analyses.metric_inputs`)."""
        from jaxdepth.analyses.metrics import as_metric

        tokens, valid = self._checked(token_ids, valid)
        metric = as_metric(metric, "site gradients", clean_available=False, answers_available=False)
        prompts = PromptArrays(tokens, valid)
        if valid is not None:  # refused here: inside the jitted call nothing can raise on data
            from jaxdepth.analyses.ig.checks import clean_readout
            from jaxdepth.analyses.metric_inputs import refuse_readout_padding
            from jaxdepth.analyses.metrics import reads_at

            reads = reads_at(metric, valid)
            refuse_readout_padding(  # the one more forward only where a position read is padding
                metric,
                reads.real,
                lambda: clean_readout(self.params, prompts, self.config, metric, reads, interventions),
                analysis="site gradients",
                lengths=np.asarray(valid).sum(axis=1),
                hint="or read only real positions: reads='last' or 'answer' (its padding marked real=False)",
            )
        return _jit_site_gradients(self.params, prompts, self.config, metric, tuple(sites), interventions)

    def generate(
        self,
        prompts,
        max_new_tokens: int = 32,
        *,
        stop: Sequence[str] = (),
        interventions=None,
        order=None,
        orders=None,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> list:
        """The continuation of each prompt (a string, or a list of them), as text:
        `jaxdepth.core.decoding.generate` on this model, greedy by default (`temperature` > 0
        samples, seeded by `seed`), ending at the tokenizer's end-of-sequence token or after
        `max_new_tokens`, and cut before the first of the `stop` strings (the decoding itself
        runs on to its end). `interventions` and `order` (a `jaxdepth.core.structure.LayerOrder`)
        apply to every step. The prompts are right-padded to a `LengthBuckets` length, so
        batches of similar lengths share one compiled program.

        `orders` (a list of `LayerOrder`s, instead of `order`) decodes under each of them
        together, layer-major (`jaxdepth.core.decoding.generate_orders`; one compiled program
        per list of orders) and returns one list of continuations per order."""
        from jaxdepth.core.batch import make_batch
        from jaxdepth.core.decoding import check_prompt_mask

        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not texts:
            raise ValueError("no prompts to generate from")
        # padded no further than the context: each prompt's real length is what counts against it
        batch = make_batch([self.encode(text) for text in texts], max_length=self.config.max_position_embeddings)
        tokens, valid = batch.tokens, batch.valid
        check_tokens(tokens, self.config)
        check_prompt_mask(valid, max_new_tokens, self.config)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        common = dict(
            valid=jnp.asarray(valid),
            max_new_tokens=int(max_new_tokens),
            interventions=interventions,
            decoding=Decoding(
                eos_ids=() if eos is None else (int(eos),),
                temperature=float(temperature),
                key=jax.random.PRNGKey(seed) if temperature > 0 else None,
            ),
        )
        if orders is not None:
            from jaxdepth.core.structure import group_orders, stack_orders

            if order is not None:
                raise ValueError("give order (one) or orders (several), not both")
            grouped = group_orders(stack_orders(list(orders)), self.config.num_layers)
            out = _jit_generate_orders(self.params, jnp.asarray(tokens), self.config, grouped, **common)
            return [self._texts(rows, counts, eos, stop) for rows, counts in zip(out.tokens, out.lengths)]
        if order is not None:  # inside the jitted call it is traced and can no longer be checked
            from jaxdepth.core.structure import check_order

            order = check_order(order, self.config.num_layers)
        out = _jit_generate(self.params, jnp.asarray(tokens), self.config, order=order, **common)
        return self._texts(out.tokens, out.lengths, eos, stop)

    def _texts(self, tokens, lengths, eos, stop) -> list[str]:
        """Each row's new tokens as text, end-of-sequence left out, cut before the first stop."""
        results = []
        for row, n in zip(np.asarray(tokens), np.asarray(lengths)):
            kept = [int(t) for t in row[:n] if t != eos]
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            cut = min([text.find(s) for s in stop if s and s in text], default=len(text))
            results.append(text[:cut])
        return results

    def _checked(self, token_ids, valid):
        tokens = np.asarray(token_ids)
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"token_ids must be an int array [batch, seq], got {tokens.dtype} {tokens.shape}")
        check_tokens(tokens, self.config)
        return jnp.asarray(tokens, jnp.int32), None if valid is None else jnp.asarray(valid, bool)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text`, int32 `[T]` with no batch axis (`model.encode(text)[None]` is a
        batch of one), with the tokenizer's defaults: a BOS token only where the tokenizer adds
        one, no chat template. A `ValueError` when the model has no tokenizer."""
        if self.tokenizer is None:
            raise ValueError(f"the model from {self.source} has no tokenizer")
        return np.asarray(self.tokenizer(text)["input_ids"], np.int32)


@partial(jit, static_argnames="config")
def _jit_forward(params, tokens, config, valid, interventions=None):
    return forward(params, tokens, config, valid=valid, interventions=interventions)


_jit_generate = jit(generate, static_argnames=("config", "max_new_tokens"))
_jit_generate_orders = jit(generate_orders, static_argnames=("config", "grouped", "max_new_tokens"))


@partial(jit, static_argnames=("config", "tap"))
def _jit_run(params, tokens, config, valid, interventions, tap):
    h0 = embed(params, tokens, config)
    extra = per_layer_inputs(params, tokens, h0, config)  # Gemma 4's, where it has them
    return run_layers(params, h0, config, valid=valid, interventions=interventions, tap=tap, per_layer_inputs=extra)


@partial(jit, static_argnames=("config", "metric", "sites"))
def _jit_site_gradients(params, prompts, config, metric, sites, interventions):
    from jaxdepth.analyses.attribution import site_gradients

    return site_gradients(params, prompts, config, metric, sites, interventions=interventions)
