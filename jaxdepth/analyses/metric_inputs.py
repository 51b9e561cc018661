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

A `jaxdepth.Metric` (`jaxdepth.analyses.metrics`) is given the logits at the positions it
declares, a `Readout`: one of reads='last' sees no padding at all, one of reads='answer' only
its answer span's padding (`Readout.real` false there), one of reads='all' every position of
its prompt's padded length. The same rule holds for it on the readout's logits and `real` mask
(`refuse_readout_padding`; `refuse_prompt_padding` for the analyses that run one prompt at a
time), the readout's other fields held.

Where it runs: layer skip (on the clean run's readout, `clean_readout`, of the h_L its first call
of skipped runs computes, before any skipped run's metric), erasure (on the clean run's readout,
after the clean run, before any erasure), integrated gradients and
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

import dataclasses
from functools import partial
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import forward, unembed
from jaxdepth.core.sharding import to_host
from jaxdepth.core.batch import PromptArrays
from jaxdepth.analyses.metrics import Metric, Readout, Reads, reads_at, readout

__all__ = [
    "padding_reads",
    "refuse_padding_reads",
    "refuse_readout_padding",
    "refuse_prompt_padding",
    "prompt_reads",
    "clean_readout",
    "final_logits",
    "clean_logits",
    "ONE_PROMPT_HINT",
]

# What an analysis whose metric reads every position of one prompt padded to its length bucket
# (layer skip, erasure: a metric of reads='all') offers instead: the metric is static, so it cannot
# know each prompt's length, but it is given where the padding is.
ONE_PROMPT_HINT = (
    "a metric of reads='all' sees one prompt's logits [1, T, V] at its padded length T: declare reads='last' "
    "(each prompt's last real token) or reads='answer' (its answer positions), or read r.logits only where "
    "r.real is true"
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
    fn = getattr(metric, "fn", metric)  # a `Metric` by its user's function
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


@dataclasses.dataclass(frozen=True)
class _OfLogits:
    """A `Metric` as a function of a `Readout`'s logits, its other fields fixed (`r`): what
    `padding_reads` replaces the padded rows of. Hashed by its metric (static in `jit`)."""

    metric: Metric

    @property
    def fn(self):
        return self.metric.fn  # named by the user's function in a refusal

    def __call__(self, logits, r: Readout):
        return self.metric(dataclasses.replace(r, logits=logits))


def refuse_readout_padding(
    metric: Metric,
    real,
    readout,
    *,
    analysis: str,
    prompts: Optional[Sequence] = None,
    lengths: Optional[Sequence[int]] = None,
    hint: str = "",
) -> None:
    """`refuse_padding_reads` for a `Metric` on the `Readout` an analysis gives it: a
    `ValueError` if the metric's value moves with the logits at the positions where
    `real [B, P]` is false (the padding of a reads='all' readout, an answer span's padding),
    `readout.real` marking the same. `readout` may be a function of no argument computing it:
    nothing is computed where every read position is real (always, for reads='last').
    `prompts` labels the prompts and `lengths` gives their real lengths in the message
    (defaults: each prompt's index, and its count of real read positions)."""
    if np.asarray(to_host(real), bool).all():
        return
    r = readout() if callable(readout) else readout
    refuse_padding_reads(
        _OfLogits(metric),
        r.logits,
        r.real,
        analysis=analysis,
        args=(r,),
        prompts=prompts,
        lengths=lengths,
        hint=hint,
    )


def prompt_reads(metric: Metric, prompt: PromptArrays) -> Reads:
    """The positions `metric` reads of one prompt (`PromptArrays`, `[1, T]`), `[1, P]`:
    `reads_at` with its `valid` and, for reads='answer', its answer span (`answer_positions`,
    `answer_real`, `answer_targets`; a prompt without one is refused). jit-traceable."""
    if metric.reads != "answer":
        return reads_at(metric, prompt.valid)
    if prompt.answer_positions is None:
        raise ValueError(f"the metric {metric.__name__!r} reads 'answer' positions, and the prompt has no answer")
    return reads_at(metric, prompt.valid, prompt.answer_positions, prompt.answer_real, prompt.answer_targets)


def clean_readout(params, clean_final, prompt: PromptArrays, config: ModelConfig, metric: Metric) -> Readout:
    """The `Readout` `metric` is given of one prompt's clean run, whose final residual is
    `clean_final [1, T, D]`: its logits `[1, P, V]` at the positions the metric reads
    (`prompt_reads`), and the same as `clean` where the metric reads the clean run.
    jit-traceable (`jit` it to call it eagerly)."""
    r = readout(params, clean_final, config, prompt_reads(metric, prompt))
    return dataclasses.replace(r, clean=r.logits if metric.clean else None)


def _real_of(metric: Metric, prompt: PromptArrays) -> np.ndarray:
    """bool `[1, P]` on the host: which positions `metric` reads of `prompt` are real."""
    if metric.reads == "last":
        return np.ones((1, 1), bool)
    if metric.reads == "all":
        return np.asarray(to_host(prompt.valid), bool)
    real = prompt.answer_real
    return (
        np.ones((1, np.shape(prompt.answer_positions)[-1]), bool) if real is None else np.asarray(to_host(real))[None]
    )


# What an analysis offers a metric that reads an answer span's padding (the span is padded to a
# bucket of a static size by repeating its last position).
ANSWER_HINT = "an answer span is padded to a static size: read r.logits and r.targets only where r.real is true"


def refuse_prompt_padding(metric: Metric, prompt: PromptArrays, readout, *, analysis: str, label=0) -> None:
    """`refuse_readout_padding` for an analysis that runs one prompt (`PromptArrays`) at a
    time (layer skip, erasure): `readout` is the clean run's `Readout` (or a function of no
    argument computing it, `clean_readout`), `label` names the prompt. A reads='last' metric
    reads no padding by construction and is never checked."""
    hint = ONE_PROMPT_HINT if metric.reads == "all" else ANSWER_HINT
    real = _real_of(metric, prompt)
    refuse_readout_padding(metric, real, readout, analysis=analysis, prompts=[label], hint=hint)


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
