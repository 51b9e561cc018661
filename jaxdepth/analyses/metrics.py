"""The one metric protocol: what every analysis that measures, differentiates or patches a
function of the model's output takes, and the built-in metrics, written once.

A metric is a `Metric`: a function of a `Readout` returning one floating value per prompt
`[B]`, and a declaration of the positions it reads (`reads`):

- 'last': each prompt's last real token, `[B, 1]`;
- 'answer': the positions whose next token is the answer (the study's answer span; an edge
  pair's last position, its answer the pair's right label), with `Readout.targets` the answer
  tokens and `Readout.real` false at a span's padding;
- 'all': every position `[B, T]`, `Readout.real` false at padding (which the metric must not
  read: `jaxdepth.analyses.metric_inputs` refuses one that does).

The analysis runs the final norm and the LM head at the declared positions only (the LM head
is the largest matmul of a small model), and gives the metric what it has besides: the clean
run's logits at the same positions (`Readout.clean`, where the metric says `clean=True`; an
analysis without a clean run refuses such a metric by name) and the task's labels
(`Readout.labels`, say the (right, wrong) answer tokens of a pair). Write one with the
`metric` decorator:

    @jaxdepth.metric(reads="last")
    def top_logit(r):
        return r.logits[:, 0].max(axis=-1)

A metric is static (part of a compilation's key): define it once, at module level. A plain
function of the logits, the forms analyses took before, is refused by `as_metric` with a
message that shows this one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import unembed

__all__ = [
    "Metric",
    "Readout",
    "Reads",
    "metric",
    "as_metric",
    "reads_at",
    "readout",
    "measure",
    "kl_divergence",
    "answer_probability",
    "logit_difference",
    "kl_clean_to_run",
    "kl_run_to_clean",
    "mean_kl_clean_to_run",
    "READS",
]

READS = ("last", "answer", "all")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Readout:
    """What a metric is given, a pytree: `logits [B, P, V]` (float32) at the `positions
    [B, P]` it declared, `real [B, P]` (false at padding), `targets [B, P]` (the answer token
    each 'answer' position predicts; None elsewhere), `clean [B, P, V]` (the clean run's logits
    there, for a metric with `clean=True`), `labels` (the task's labels, as the analysis holds
    them, or None) and `taps` (what a caller's tap read from the run, `site_gradients`)."""

    logits: jax.Array
    real: jax.Array
    positions: jax.Array
    targets: Optional[jax.Array] = None
    clean: Optional[jax.Array] = None
    labels: Any = None
    taps: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Reads:
    """A metric's positions resolved for one batch, a pytree: `positions [B, P]` int32,
    `real [B, P]` and, for 'answer', `targets [B, P]`. Made by `reads_at`."""

    positions: jax.Array
    real: jax.Array
    targets: Optional[jax.Array] = None


@dataclasses.dataclass(frozen=True, eq=False)
class Metric:
    """`fn(Readout) -> [B]`, one floating value per prompt, reading the positions `reads` (one
    of `READS`); `clean`: whether it reads the clean run's logits (`Readout.clean`). Hashed by
    identity: a static argument of the analyses' compiled programs."""

    fn: Callable[[Readout], Any]
    reads: str = "last"
    clean: bool = False

    def __post_init__(self):
        if self.reads not in READS:
            raise ValueError(f"a metric reads one of {READS}, got reads={self.reads!r}")
        if not callable(self.fn):
            raise TypeError(f"a metric's fn must be callable, got {type(self.fn).__name__}")

    @property
    def __name__(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))

    def __repr__(self) -> str:
        return f"Metric({self.__name__}, reads={self.reads!r}{', clean=True' if self.clean else ''})"

    def __call__(self, r: Readout) -> jax.Array:
        """F per prompt `[B]`, float32; refused at trace time unless `fn` returns floating
        values of shape `[B]`."""
        value = jnp.asarray(self.fn(r))
        B = r.logits.shape[0]
        if not jnp.issubdtype(value.dtype, jnp.floating):
            raise ValueError(
                f"the metric {self.__name__!r} returns {value.dtype} values: a metric must be floating point, "
                "since an integer or boolean one (an argmax, an accuracy) has a zero gradient everywhere and "
                "every score or attribution of it would be exactly 0. Return a float that moves with the "
                "logits (a logit difference, a probability) instead"
            )
        if value.shape != (B,):
            raise ValueError(
                f"the metric {self.__name__!r} must return one value per prompt, shape ({B},), for logits of "
                f"shape {tuple(r.logits.shape)}; it returned shape {value.shape} (sum or average afterwards)"
            )
        return value.astype(jnp.float32)


def metric(reads: str = "last", *, clean: bool = False) -> Callable[[Callable], Metric]:
    """Decorator: `fn(Readout) -> [B]` as a `Metric` reading `reads` ('last', 'answer' or
    'all'), with the clean run's logits where `clean` (module docstring)."""
    if reads not in READS:  # refused where it is written, not where it is first applied
        raise ValueError(f"a metric reads one of {READS}, got reads={reads!r}")

    def make(fn: Callable) -> Metric:
        made = Metric(fn, reads, clean)
        object.__setattr__(made, "__doc__", fn.__doc__)  # help(metric) shows the function's
        return made

    return make


NEW_FORM = (
    "a metric is now one form for every analysis: decorate a function of a Readout that returns one value per "
    "prompt, and say which positions it reads, e.g.\n\n"
    "    @jaxdepth.metric(reads='last')          # or 'answer', 'all'; clean=True for the clean run's logits\n"
    "    def my_metric(r):                        # r.logits [B, P, V] at those positions\n"
    "        return r.logits[:, 0, token]         # [B]\n\n"
    "the built-ins: jaxdepth.metrics.answer_probability, logit_difference, kl_clean_to_run, kl_run_to_clean, "
    "mean_kl_clean_to_run"
)


def as_metric(m, analysis: str, *, clean_available: bool = True, answers_available: bool = True) -> Metric:
    """`m` if it is a `Metric` the analysis can give what it reads, else a `TypeError` (a plain
    function, a form analyses took before: the message shows the new one) or a `ValueError`
    (a metric of the clean run's logits where `analysis` has no clean run; of 'answer'
    positions where it has no answers)."""
    if not isinstance(m, Metric):
        shown = getattr(m, "__name__", type(m).__name__)
        raise TypeError(f"{analysis}: the metric {shown!r} is a plain function; {NEW_FORM}")
    if m.clean and not clean_available:
        raise ValueError(f"{analysis} has no clean run to compare with: the metric {m.__name__!r} reads one")
    if m.reads == "answer" and not answers_available:
        raise ValueError(
            f"{analysis} knows no answer positions: the metric {m.__name__!r} reads 'answer'; read 'last' or 'all'"
        )
    return m


def reads_at(m: Metric, valid, answer_positions=None, answer_real=None, answer_targets=None) -> Reads:
    """The positions `m` reads in a batch whose real tokens are `valid [B, T]`: 'last' each
    prompt's last real token, 'all' every position, 'answer' `answer_positions [B, A]` (or
    `[A]`, shared) with `answer_real` and `answer_targets` alike. jit-traceable."""
    valid = jnp.asarray(valid, bool)
    B, T = valid.shape
    if m.reads == "last":
        last = jnp.sum(valid, axis=1).astype(jnp.int32) - 1
        return Reads(last[:, None], jnp.ones((B, 1), bool))
    if m.reads == "all":
        return Reads(jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)), valid)
    if answer_positions is None or answer_targets is None:
        raise ValueError(f"the metric {m.__name__!r} reads 'answer' positions, and none were given")
    shape = (B,) + jnp.shape(answer_positions)[-1:]
    real = jnp.ones(shape, bool) if answer_real is None else jnp.broadcast_to(answer_real, shape)
    return Reads(
        jnp.broadcast_to(answer_positions, shape).astype(jnp.int32),
        real,
        jnp.broadcast_to(answer_targets, shape).astype(jnp.int32),
    )


def _at(x, positions):
    """`x [B, T, ...]` at `positions [B, P]`: `[B, P, ...]`."""
    return jnp.take_along_axis(x, positions.reshape(positions.shape + (1,) * (x.ndim - 2)), axis=1)


def readout(
    params, h_final, config: ModelConfig, reads: Reads, *, clean=None, clean_final=None, labels=None, taps=None
) -> Readout:
    """The `Readout` of a run whose final residual is `h_final [B, T, D]`: the final norm and
    LM head at `reads.positions` only. The clean run, for a metric that reads it: its logits at
    the same positions `clean [B, P, V]`, or its final residual `clean_final [B, T, D]`."""
    logits = unembed(params, _at(h_final, reads.positions), config).astype(jnp.float32)
    if clean_final is not None:
        clean = unembed(params, _at(clean_final, reads.positions), config)
    if clean is not None:
        clean = clean.astype(jnp.float32)
    return Readout(logits, reads.real, reads.positions, reads.targets, clean, labels, taps)


def measure(m: Metric, params, h_final, config: ModelConfig, reads: Reads, **given) -> jax.Array:
    """F per prompt `[B]` of the run ending in `h_final`: `m(readout(...))`, `given` as `readout`."""
    return m(readout(params, h_final, config, reads, **given))


# ----------------------------------------------------------------------------- the built-ins


def kl_divergence(p_logits, q_logits, axis: int = -1):
    """KL(p || q) = sum_v p (log p - log q) of the distributions of two logit arrays, in nats,
    float32, over `axis`: the one KL of the package (the lenses' and the metrics')."""
    log_p = jax.nn.log_softmax(p_logits.astype(jnp.float32), axis=axis)
    log_q = jax.nn.log_softmax(q_logits.astype(jnp.float32), axis=axis)
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=axis)


@metric(reads="answer")
def answer_probability(r: Readout):
    """The studies' F: the summed teacher-forced probabilities of the answer tokens (each answer
    position's probability of its next token), per prompt. On edge pairs, the probability of
    the right answer at the last position."""
    probs = jax.nn.softmax(r.logits, axis=-1)
    picked = jnp.take_along_axis(probs, r.targets[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(r.real, picked, 0.0), axis=1)


@metric(reads="last")
def logit_difference(r: Readout):
    """The logit of the right answer minus that of the wrong one at the last position, per pair:
    `labels [B, 2]` (right, wrong) token ids, each answer's first token. The usual metric of
    IOI-style tasks."""
    rows = jnp.arange(r.logits.shape[0])
    last = r.logits[:, 0]
    return last[rows, r.labels[:, 0]] - last[rows, r.labels[:, 1]]


@metric(reads="last", clean=True)
def kl_clean_to_run(r: Readout):
    """KL(clean || run) of the next-token distributions at the last position, in nats: 0 in the
    clean run, positive as an intervention moves the prediction away from the clean one. (Its
    gradient at the clean run is zero: EAP scores of it are 0; score it along a path, EAP-IG.)"""
    return kl_divergence(r.clean[:, 0], r.logits[:, 0])


@metric(reads="last", clean=True)
def kl_run_to_clean(r: Readout):
    """KL(run || clean) of the next-token distributions at the last position, in nats."""
    return kl_divergence(r.logits[:, 0], r.clean[:, 0])


@metric(reads="all", clean=True)
def mean_kl_clean_to_run(r: Readout):
    """KL(clean || run) averaged over each prompt's real positions, in nats."""
    kl = kl_divergence(r.clean, r.logits)
    real = r.real.astype(kl.dtype)
    return jnp.sum(kl * real, axis=1) / jnp.sum(real, axis=1)
