"""What a user's metric may read: never a prompt's padding. Every analysis that takes a metric of
the logits runs `refuse_padding_reads` on the clean run's logits of each prompt before it measures
anything, and refuses a metric that reads padded positions (`ValueError` naming the analysis, the
prompt, its real and its padded length, and how to read real positions instead).

Prompts of different lengths run right-padded to a shared length (a length bucket), so a metric
written for one prompt's logits `[1, T, V]`, say `logits[0, -1]`, reads the model's output at a
padded position for every prompt shorter than T: a number of the padding, silently.

The rule (`padding_reads`), per prompt b, on the logits the metric is given: the metric reads b's
padding when
- its value changes (exactly; NaN equals NaN) as the logits at b's padded positions are replaced
  by other finite logits (each row reversed over the vocabulary, doubled and negated, plus one:
  a different argmax, maximum, spread and order), which catches integer and boolean metrics (an
  argmax, an accuracy) too;
- or, for a floating metric, its gradient with respect to b's padded logits is non-zero anywhere
  (finite entries): a dependence the replacement happens not to move.
A metric that selects real positions by indexing, by `jnp.where` or by multiplying with a 0/1
mask passes, and its numbers are untouched (the check only reads it).

Where it runs: layer skip (on the clean h_L its first call of skipped runs computes, before any
skipped run's metric), erasure (after the clean run, before any erasure), integrated gradients and
`Model.site_gradients` (one more forward, where a prompt is padded), `site_gradients` where its
logits are concrete (called outside `jit`), and edge attribution's sequence metrics (the run's
logits replaced; the clean logits it also receives are not) where the clean logits are concrete.

Limits, said honestly: the check is of the clean run's logits, not of every intervened run (a
metric whose choice of positions depends on the logits, the argmax over positions say, could read
padding in another run); a read whose value and gradient both stay the same under the replacement
(a comparison false for both rows, say) passes; inside a user's `jit` nothing can be refused. It
costs B + 1 evaluations of the metric and one gradient of it for B prompts, and nothing where no
position is padded; it compiles per padded shape, as the analyses do, never per real length (the
mask is data).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import forward, unembed
from jaxdepth.core.sharding import to_host

__all__ = ["padding_reads", "refuse_padding_reads", "final_logits", "clean_logits", "ONE_PROMPT_HINT"]

# What an analysis that hands a metric one prompt's padded logits (layer skip, erasure) offers
# instead: the metric is static, so it cannot know each prompt's length.
ONE_PROMPT_HINT = (
    "the metric sees one prompt's logits [1, T, V] at its padded length T and cannot know its length: read "
    "positions below the shortest prompt's length, which every prompt has, or give prompts of one length "
    "(a length bucket of their own)"
)


def _replaced(logits, padded):
    """`logits [B, T, V]` with the rows where `padded [B, T]` replaced by other finite logits:
    1 - 2 x (the row reversed over the vocabulary)."""
    other = 1.0 - 2.0 * jnp.flip(logits, axis=-1)
    return jnp.where(padded[..., None], other, logits)


def _same(a, b):
    """Whether two values of a metric are the same, entry for entry (NaN equal to NaN)."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    both_nan = jnp.isnan(a) & jnp.isnan(b) if jnp.issubdtype(a.dtype, jnp.floating) else False
    return jnp.all((a == b) | both_nan)


@partial(jit, static_argnames="metric")
def padding_reads(metric: Callable, logits, valid, args=()):
    """bool `[B]`: whether `metric(logits, *args)` reads prompt b's padded positions, by the
    module's rule, for `logits [B, T, V]` (or the logits at declared positions, `[B, A, V]`) and
    `valid [B, T]` (`[B, A]`) marking each prompt's real rows. The metric may return a scalar or
    one value per prompt; it is static (define it once), `args` (the metric's other inputs) traced."""
    B = logits.shape[0]
    value = lambda x: metric(x, *args)  # noqa: E731
    clean = value(logits)
    padded = ~jnp.asarray(valid, bool)

    def changed_by(b):
        return ~_same(value(_replaced(logits, padded & (jnp.arange(B) == b)[:, None])), clean)

    reads = jax.lax.map(changed_by, jnp.arange(B))
    if jnp.issubdtype(jnp.asarray(clean).dtype, jnp.floating):
        grad = jax.grad(lambda x: jnp.sum(jnp.asarray(value(x), jnp.float32)))(logits)
        # masked first: the gradient of a linear metric is a constant, which XLA would fold at
        # full size (seconds of compilation at a large vocabulary) were it compared on its own
        at_padding = jnp.where(padded[..., None], grad, 0.0)
        moved = (at_padding != 0) & jnp.isfinite(at_padding)
        reads = reads | jnp.any(moved, axis=tuple(range(1, grad.ndim)))
    return reads


def _name(metric) -> str:
    fn = getattr(metric, "fn", metric)  # a wrapped metric (`LogitsMetric`) by its user's function
    return getattr(fn, "__name__", repr(fn))


def refuse_padding_reads(
    metric: Callable,
    logits,
    valid,
    *,
    analysis: str,
    args=(),
    prompts: Optional[Sequence] = None,
    lengths: Optional[Sequence[int]] = None,
    hint: str = "",
) -> None:
    """Raise a `ValueError` if `metric(logits, *args)` reads a padded position of any prompt
    (`padding_reads`), naming `analysis`, the first such prompt (`prompts[b]`, default its index
    b), its real length (`lengths[b]`, default its `valid` count) and padded length (`valid`'s
    T), and how to read real positions (`hint`: what the analysis offers besides). `logits` may
    be a function of no argument that computes them (`clean_logits`): nothing is computed where
    no position of `valid` is padded."""
    valid_host = np.asarray(to_host(valid), bool)
    if valid_host.all():
        return
    if callable(logits):
        logits = logits()
    reads = np.asarray(to_host(padding_reads(metric, logits, jnp.asarray(valid_host), tuple(args))))
    if not reads.any():
        return
    b = int(np.flatnonzero(reads)[0])
    label = b if prompts is None else prompts[b]
    n = int(valid_host[b].sum()) if lengths is None else int(lengths[b])
    T = valid_host.shape[1]
    raise ValueError(
        f"{analysis}: the metric {_name(metric)!r} reads padded positions of prompt {label}, which has {n} real "
        f"tokens padded to {T}: what the model computes at a padded position is no part of the prompt, and a "
        f"number read there would be silently wrong. Read the prompt's real positions only: index below its "
        f"length (logits[0, {n - 1}], i.e. logits[0, length - 1], is its last token; logits[0, -1] is padding), "
        f"or select real positions with jnp.where on a mask{'; ' + hint if hint else ''}"
    )


@partial(jit, static_argnames="config")
def final_logits(params, h_final, config: ModelConfig):
    """float32 logits of a final residual `h_final [..., D]` (the final norm and the LM head):
    what a caller holding the clean run's h_L gives `refuse_padding_reads`."""
    return unembed(params, h_final, config)


@partial(jit, static_argnames="config")
def clean_logits(params, tokens, valid, config: ModelConfig, interventions=None, positions=None):
    """float32 logits `[B, T, V]` of the run of `tokens` under `interventions` (at `positions`
    `[A]` only where given, `[B, A, V]`): the clean run whose logits `refuse_padding_reads`
    checks a metric on, for analyses that keep no logits of their own."""
    logits = forward(params, tokens, config, valid=valid, interventions=interventions)
    return logits if positions is None else logits[:, positions]
