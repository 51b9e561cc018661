"""Depth in what the model generates: the lens of each generated token, its settling depth,
the deep-thinking ratio of an answer (Chen et al. 2026, arXiv 2602.13517), Think@n selection
among samples, and the entropy lens (arXiv 2502.16570).

Definitions (docs/analyses.md says the same). For a token the model generated, P_l is the
lens distribution of the residual after layer l (h_l through the final norm and LM head, or a
tuned lens's translator first), l = 1..L, at the position whose output chose the token; P_L is
the distribution it was drawn from. Then

- D_l = JSD(P_l || P_L), the Jensen-Shannon divergence in bits (log base 2, so 0 <= D_l <= 1):
  symmetric, 0 exactly where the two distributions agree;
- the settling depth s = min{l in 1..L : D_l <= g}, the first layer at which the running
  minimum of D falls to the threshold g (it exists: D_L = 0);
- the token is deep-thinking when s >= ceil(rho * L): its prediction settles only in the
  deepest layers, the last 1 - rho of them (rho as in the paper: 0.85 keeps the last 15%);
- the deep-thinking ratio (DTR) of an answer is the share of its generated tokens that are
  deep-thinking (an end-of-sequence token counts; padding after it does not);
- the entropy lens H_l = H(P_l) in bits, l = 0..L (l = 0 the embeddings).

Think@n (`think_at_n`): of n sampled answers to a prompt, keep the `keep` share with the
highest DTR (at least one; ties to the earlier sample) and take the majority answer among the
kept; self-consistency (`majority_answer`) votes over all n. A tie between answers goes to the
one given first.

The lens of generated tokens is exact from one teacher-forced forward of prompt + answer (the
model is causal: the residuals at a position do not depend on later tokens), so an answer's
lens costs one forward, not one per token.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from functools import partial
from typing import TYPE_CHECKING, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.analyses.answers import cut_generation, final_answer, same_answer
from jaxdepth.analyses.decision_depth import decision_depths, lens_identity
from jaxdepth.analyses.layer_structure import generations, new_tokens_for
from jaxdepth.analyses.logit_lens import map_lens
from jaxdepth.analyses.suite import Analysis, DepthCurve, DepthReading, Settings, option
from jaxdepth.core.batch import PromptBatch
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.decoding import Decoding
from jaxdepth.core.execution import Execution
from jaxdepth.core.model import residual_stream, unembed
from jaxdepth.core.saved_result import SavedResult

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the analysis
    from matplotlib.figure import Figure

__all__ = [
    "jensen_shannon",
    "entropy_bits",
    "lens_trajectories",
    "settling_depths",
    "deep_thinking",
    "deep_thinking_ratio",
    "majority_answer",
    "think_at_n",
    "generated_depth",
    "GeneratedDepthResult",
    "Reading",
    "GeneratedDepthSettings",
    "generated_depth_figure",
    "depth_reading",
    "ANALYSIS",
    "DEFAULT_THRESHOLD",
    "DEFAULT_RHO",
    "DEFAULT_KEEP",
]

DEFAULT_THRESHOLD = 0.5  # g: a layer has settled once its JSD to the output is at most this, in bits
DEFAULT_RHO = 0.85  # deep-thinking: settling at or after layer ceil(rho * L)
DEFAULT_KEEP = 0.5  # Think@n keeps the half of the samples with the highest DTR

_LOG2 = math.log(2.0)


def _log_probs(logits):
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def jensen_shannon(p_logits, q_logits, axis: int = -1):
    """JSD(P || Q) in bits of the distributions of two logit arrays, over `axis`: 0.5 KL(P || M)
    + 0.5 KL(Q || M) with M = (P + Q) / 2. Symmetric, in [0, 1], exactly 0 where P = Q. Terms of
    zero probability contribute 0 (x log x -> 0), so a distribution with exact zeros is fine."""
    log_p, log_q = _log_probs(p_logits), _log_probs(q_logits)
    p, q = jnp.exp(log_p), jnp.exp(log_q)
    log_m = jnp.logaddexp(log_p, log_q) - _LOG2
    part = lambda x, log_x: jnp.where(x > 0, x * (log_x - log_m), 0.0)  # noqa: E731
    return 0.5 * jnp.sum(part(p, log_p) + part(q, log_q), axis=axis) / _LOG2


def entropy_bits(logits, axis: int = -1):
    """H(P) in bits of the distribution of `logits` over `axis`."""
    log_p = _log_probs(logits)
    return -jnp.sum(jnp.where(log_p > -jnp.inf, jnp.exp(log_p) * log_p, 0.0), axis=axis) / _LOG2


@partial(jit, static_argnames="config")
def lens_trajectories(params, tokens, valid, config: ModelConfig, translators=None):
    """The lens of every position of `tokens [B, T]`: `jsd [L, B, T]`, row l-1 the JSD in bits
    of the lens of h_l (after layer l, l = 1..L) to the output distribution (row L-1 is 0),
    `entropy [L+1, B, T]`, row l the entropy of the lens of h_l (l = 0..L), and `top1 [L+1,
    B, T]`, its top-1 token (what `jaxdepth.analyses.decision_depth.decision_depths` reads).
    With `translators` (a tuned lens's, one per boundary 0..L-1) h_0..h_{L-1} go through
    theirs first; h_L, the output, never does. One boundary's `[B, T, V]` logits exist at a
    time (`jaxdepth.analyses.logit_lens.map_lens`). Padded positions (`valid` false) hold
    numbers of no prompt: leave them out."""
    hs = residual_stream(params, tokens, config, valid=valid)
    final = unembed(params, hs[-1], config)

    def read(logits):
        return jensen_shannon(logits, final), entropy_bits(logits), jnp.argmax(logits, axis=-1).astype(jnp.int32)

    jsd, entropy, top1 = map_lens(read, params, hs[:-1], config, translators)
    # the rows are of h_0..h_{L-1}: the settling depth counts layers 1..L, so h_0's JSD goes and
    # the output's own 0 ends the rows
    jsd = jnp.concatenate([jsd[1:], jnp.zeros_like(jsd[:1])], axis=0)
    last = lambda x, y: jnp.concatenate([x, y[None]], axis=0)  # noqa: E731
    return jsd, last(entropy, entropy_bits(final)), last(top1, jnp.argmax(final, axis=-1).astype(jnp.int32))


def settling_depths(jsd, threshold: float = DEFAULT_THRESHOLD) -> np.ndarray:
    """The settling depth of each token, int `[...]`, from `jsd [L, ...]` (row l-1 the JSD of
    layer l to the output): the first layer l in 1..L with JSD <= `threshold` (module
    docstring); L where no earlier layer reaches it (row L-1 is 0 for a model's own output)."""
    jsd = np.asarray(jsd)
    settled = jsd <= threshold
    settled[-1] = True  # the output is its own distribution: nothing settles later than L
    return np.argmax(settled, axis=0) + 1


def deep_thinking(depths, num_layers: int, rho: float = DEFAULT_RHO) -> np.ndarray:
    """bool `[...]`: whether each settling depth is deep-thinking, `depth >= ceil(rho * L)`."""
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"rho must be in (0, 1], got {rho}")
    return np.asarray(depths) >= math.ceil(rho * num_layers)


def deep_thinking_ratio(deep, counted) -> np.ndarray:
    """DTR per answer `[N]`: the share of each answer's counted tokens (`counted [N, T]`, its
    generated tokens) that are deep-thinking (`deep [N, T]`); NaN for an answer with none."""
    deep, counted = np.asarray(deep, bool), np.asarray(counted, bool)
    n = counted.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, (deep & counted).sum(axis=-1) / n, np.nan)


def majority_answer(answers: Sequence[str]) -> Optional[str]:
    """The most frequent of `answers`, a tie going to the answer given first; None for none."""
    if not answers:
        return None
    counts = Counter(answers)
    best = max(counts.values())
    return next(a for a in answers if counts[a] == best)


def think_at_n(answers: Sequence[str], ratios: Sequence[float], keep: float = DEFAULT_KEEP) -> Optional[str]:
    """Think@n's answer among n samples: the majority (`majority_answer`) of the
    `max(1, round(keep * n))` samples with the highest DTR (`ratios`; ties, and NaN ratios
    last, to the earlier sample)."""
    if len(answers) != len(ratios):
        raise ValueError(f"{len(answers)} answers but {len(ratios)} ratios")
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    if not answers:
        return None
    r = np.nan_to_num(np.asarray(ratios, np.float64), nan=-np.inf)
    order = sorted(range(len(answers)), key=lambda i: (-r[i], i))
    kept = sorted(order[: max(1, round(keep * len(answers)))])
    return majority_answer([answers[i] for i in kept])


# ----------------------------------------------------------------------------- the analysis


@dataclasses.dataclass
class GeneratedDepthResult(SavedResult):
    """The depth of the answers a model generated to `N` prompts, `S` samples each, up to `G`
    new tokens. Per token: `settling [N, S, G]` (its settling depth, 0 where not `counted`),
    `decision [N, S, G]` (its decision depth, a boundary 0..L, as
    `jaxdepth.analyses.decision_depth` defines it) and `counted [N, S, G]` (a generated
    token, end-of-sequence included). Per prompt and layer, the mean over its generated tokens
    (and samples) of the JSD to the output `jsd [N, L]` (layers 1..L) and of the entropy lens
    `entropy [N, L+1]` (boundaries 0..L), and the teacher-forced entropy lens over the
    reference answer's positions `entropy_forced [N, L+1]`. Per answer: `dtr [N, S]`,
    `correct [N, S]` (its answer read as the dataset's evaluation reads it,
    `jaxdepth.analyses.answers.same_answer`) and `answers` (the final answers read, `[N][S]`,
    what Think@n votes on). `settings` holds threshold, rho, keep, samples, temperature,
    max_new_tokens and the lens."""

    settling: np.ndarray
    decision: np.ndarray
    counted: np.ndarray
    jsd: np.ndarray
    entropy: np.ndarray
    entropy_forced: np.ndarray
    dtr: np.ndarray
    correct: np.ndarray
    answers: list
    num_layers: int
    settings: dict

    def deep(self) -> np.ndarray:
        """bool `[N, S, G]`: the counted tokens that are deep-thinking (`deep_thinking`)."""
        return deep_thinking(self.settling, self.num_layers, self.settings["rho"]) & self.counted

    def accuracies(self) -> dict:
        """Accuracy over prompts of: 'mean' (each sample alone, averaged), 'majority' (the vote
        of all samples, self-consistency) and 'think@n' (the vote of the deepest `keep` share,
        `think_at_n`); a vote is right when a sample giving the voted answer is right."""
        mean = float(self.correct.mean())
        majority, think = [], []
        for answers, ratios, correct in zip(self.answers, self.dtr, self.correct):
            for chosen, out in (
                (majority_answer(answers), majority),
                (think_at_n(answers, ratios, self.settings["keep"]), think),
            ):
                out.append(bool(correct[answers.index(chosen)]))
        return {"mean": mean, "majority": float(np.mean(majority)), "think@n": float(np.mean(think))}


def _question_lengths(batch: PromptBatch) -> np.ndarray:
    return np.asarray(batch.answer_start, np.int64)


def _gathered(x, rows, positions):
    """`x [L, B, T]` at each row's `positions [B, G]`: `[B, G, L]` (host)."""
    return np.moveaxis(np.asarray(x)[:, rows[:, None], positions], 0, -1)


@dataclasses.dataclass(frozen=True)
class Reading:
    """How generated tokens are made and read: up to `max_new_tokens` per answer, `samples`
    answers per prompt (greedy for one, else sampled at `temperature`, sample s with the key of
    `seed + s`), ending at `eos_ids`; a token settles at JSD <= `threshold` bits, is
    deep-thinking from layer ceil(`rho` L), and Think@n keeps the `keep` share of samples."""

    max_new_tokens: int = 64
    samples: int = 1
    temperature: float = 0.7
    seed: int = 0
    eos_ids: tuple = ()
    threshold: float = DEFAULT_THRESHOLD
    rho: float = DEFAULT_RHO
    keep: float = DEFAULT_KEEP

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.samples < 1:
            raise ValueError(f"max_new_tokens and samples must be >= 1, got {self.max_new_tokens}, {self.samples}")
        if self.samples > 1 and not self.temperature > 0:
            raise ValueError(
                f"several samples need a temperature > 0 (greedy answers are all one), got {self.temperature}"
            )
        if not 0 <= self.threshold <= 1:
            raise ValueError(f"threshold is a JSD in bits, in [0, 1]; got {self.threshold}")
        for name in ("rho", "keep"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")


def generated_depth(
    params,
    batch: PromptBatch,
    config: ModelConfig,
    decode,
    reading: Reading = Reading(),
    *,
    translators=None,
    execution: Execution = Execution(),
) -> GeneratedDepthResult:
    """The depth of generated tokens (module docstring) for the prompts of `batch` (a
    `PromptBatch` whose answers, the tokens from `answer_start`, are the references): each
    question (the tokens before `answer_start`) is continued `reading.samples` times (greedy
    for one sample, else sampled at `reading.temperature`) for up to `max_new_tokens`, each
    answer's lens read from one teacher-forced forward of question and answer. `decode` turns
    token ids into text (a tokenizer's), for the answers' correctness; `reading` (a `Reading`)
    how answers are made and read; `translators` a tuned lens's (`TunedLens.translators()`;
    None: the logit lens); `execution.progress` counts the samples."""
    from jaxdepth.core.progress import track

    if (batch.answer_start >= batch.lengths).any():
        raise ValueError("every prompt needs a reference answer: answer_start is past a prompt's end")
    B = batch.tokens.shape[0]
    L, G, S = config.num_layers, reading.max_new_tokens, reading.samples
    questions = _question_lengths(batch)
    Q = int(questions.max())  # the questions alone, right-padded to the longest
    asked = np.arange(Q)[None, :] < questions[:, None]
    references = [
        decode([int(t) for t in row[a:n]]) for row, a, n in zip(batch.tokens, batch.answer_start, batch.lengths)
    ]
    eos = tuple(int(e) for e in reading.eos_ids)
    temperature = 0.0 if S == 1 else float(reading.temperature)
    rows = np.arange(B)
    width = int(questions.max()) + G
    out = {k: np.zeros((B, S) + s) for k, s in (("settling", (G,)), ("decision", (G,)), ("counted", (G,)))}
    jsd_sum, entropy_sum = np.zeros((B, L)), np.zeros((B, L + 1))
    dtr, correct, answers = np.zeros((B, S)), np.zeros((B, S), bool), [[None] * S for _ in range(B)]
    for s in track(range(S), execution.progress, "generating and reading the lens of each sample"):
        key = jax.random.key(reading.seed + s)
        decoding = Decoding(eos_ids=eos, temperature=temperature, key=key)
        new = generations(params, batch.tokens[:, :Q], asked, None, config, G, decoding)
        new_tokens, counts = np.asarray(new.tokens), np.asarray(new.lengths)
        sequence = np.zeros((B, width), np.int32)
        sequence[:, :Q] = np.where(asked, batch.tokens[:, :Q], 0)
        at = questions[:, None] + np.arange(G)[None, :]  # where new token j sits
        sequence[rows[:, None], at] = new_tokens
        counted = np.arange(G)[None, :] < counts[:, None]
        valid = np.arange(width)[None, :] < (questions + counts)[:, None]
        jsd, entropy, top1 = lens_trajectories(params, jnp.asarray(sequence), jnp.asarray(valid), config, translators)
        read_at = at - 1  # the output at the position before a token chose it
        token_jsd = _gathered(jsd, rows, read_at)  # [B, G, L]
        token_entropy = _gathered(entropy, rows, read_at)
        depths = settling_depths(np.moveaxis(token_jsd, -1, 0), reading.threshold)
        out["settling"][:, s] = np.where(counted, depths, 0)
        decided = decision_depths(np.moveaxis(_gathered(top1, rows, read_at), -1, 0))
        out["decision"][:, s] = np.where(counted, decided, 0)
        out["counted"][:, s] = counted
        n = np.maximum(counted.sum(axis=1), 1)[:, None]
        jsd_sum += (token_jsd * counted[..., None]).sum(axis=1) / n / S
        entropy_sum += (token_entropy * counted[..., None]).sum(axis=1) / n / S
        dtr[:, s] = deep_thinking_ratio(deep_thinking(depths, L, reading.rho), counted)
        for b in range(B):
            text = cut_generation(decode([int(t) for t in new_tokens[b, : counts[b]] if int(t) not in eos]))
            answers[b][s] = final_answer(text)
            correct[b, s] = same_answer(text, references[b])
    _, forced, _ = lens_trajectories(params, jnp.asarray(batch.tokens), jnp.asarray(batch.valid), config, translators)
    mask = batch.answer_prediction_mask()
    entropy_forced = np.einsum("lbt,bt->bl", np.asarray(forced), mask) / mask.sum(axis=1)[:, None]
    return GeneratedDepthResult(
        settling=out["settling"].astype(np.int32),
        decision=out["decision"].astype(np.int32),
        counted=out["counted"].astype(bool),
        jsd=jsd_sum,
        entropy=entropy_sum,
        entropy_forced=entropy_forced,
        dtr=dtr,
        correct=correct,
        answers=answers,
        num_layers=L,
        settings={
            "threshold": reading.threshold,
            "rho": reading.rho,
            "keep": reading.keep,
            "samples": S,
            "temperature": temperature,
            "max_new_tokens": G,
            "lens": "logit" if translators is None else "tuned",
        },
    )


# ----------------------------------------------------------------------------- figure, summary


def _prompt_means(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over prompts of `values [N, K]` and its 95% bootstrap band over prompts."""
    from jaxdepth.analyses.uncertainty import curve_band, resample_indices

    mean = values.mean(axis=0)
    if len(values) < 2:
        return mean, mean, mean
    band = curve_band(values[resample_indices(len(values))].mean(axis=1))
    return mean, band.low, band.high


def generated_depth_figure(result: GeneratedDepthResult) -> "Figure":
    """Left: the lens of generated tokens over relative depth, JSD to the output (bits) and
    entropy (bits), with the teacher-forced entropy lens, each a mean over prompts with a 95%
    bootstrap band. Middle: where generated tokens settle (their settling depths), the
    deep-thinking regime shaded. Right: each answer's DTR, right answers apart from wrong ones."""
    from jaxdepth.analyses import drawing as d

    d.expect(result, GeneratedDepthResult, "generated_depth_figure")
    L = result.num_layers
    fig = d.new_figure(14, 4.2)
    lens_ax, settle_ax, dtr_ax = fig.subplots(1, 3)
    entropy_ax = lens_ax.twinx()
    for ax, values, x, color, label in (
        (lens_ax, result.jsd, np.arange(1, L + 1) / L, "C0", "JSD to the output (generated)"),
        (entropy_ax, result.entropy, np.arange(L + 1) / L, "C1", "entropy (generated)"),
        (entropy_ax, result.entropy_forced, np.arange(L + 1) / L, "C2", "entropy (teacher-forced answers)"),
    ):
        mean, low, high = _prompt_means(values)
        ax.plot(x, mean, color=color, label=label)
        ax.fill_between(x, low, high, color=color, alpha=0.2, linewidth=0)
    lens_ax.set(xlabel="relative depth l / L", ylabel="JSD (bits)", xlim=(0, 1), title="the lens of generated tokens")
    entropy_ax.set_ylabel("entropy (bits)")
    handles = [h for ax in (lens_ax, entropy_ax) for h in ax.get_legend_handles_labels()[0]]
    lens_ax.legend(handles, [h.get_label() for h in handles], fontsize="small")
    deep_from = math.ceil(result.settings["rho"] * L)
    settle_ax.hist(result.settling[result.counted], bins=np.arange(1, L + 2) - 0.5, color="C0")
    settle_ax.axvspan(deep_from - 0.5, L + 0.5, color="C3", alpha=0.15, label=f"deep-thinking (from layer {deep_from})")
    settle_ax.set(
        xlabel="settling depth (layer)",
        ylabel="generated tokens",
        title=f"where each token settles (JSD <= {result.settings['threshold']:g} bits)",
    )
    settle_ax.legend(fontsize="small")
    for column, (name, mask, color) in enumerate((("right", result.correct, "C2"), ("wrong", ~result.correct, "C3"))):
        ratios = result.dtr[mask]
        ratios = ratios[np.isfinite(ratios)]
        jitter = np.random.default_rng(column).uniform(-0.12, 0.12, ratios.size)
        dtr_ax.scatter(column + jitter, ratios, s=14, color=color, alpha=0.7)
        if ratios.size:
            dtr_ax.hlines(ratios.mean(), column - 0.25, column + 0.25, color="k")
    accuracy = result.accuracies()
    dtr_ax.set_xticks([0, 1], [f"right ({int(result.correct.sum())})", f"wrong ({int((~result.correct).sum())})"])
    dtr_ax.set(
        xlim=(-0.6, 1.6),
        ylabel="deep-thinking ratio",
        title=(
            f"accuracy: one sample {100 * accuracy['mean']:.0f}%, majority {100 * accuracy['majority']:.0f}%, "
            f"Think@n {100 * accuracy['think@n']:.0f}%"
        ),
    )
    dtr_ax.title.set_fontsize("small")
    d.title_figure(fig, "Depth of the generated tokens", None, result.settings)
    return fig


def _summary(result: GeneratedDepthResult) -> list[str]:
    """Mean DTR with its interval, the settling depth, and the three accuracies."""
    per_prompt = np.nanmean(np.where(np.isfinite(result.dtr), result.dtr, np.nan), axis=1)
    mean, low, high = _prompt_means(per_prompt[np.isfinite(per_prompt), None])
    depth = result.settling[result.counted]
    accuracy = result.accuracies()
    return [
        f"deep-thinking ratio {mean[0]:.2f} [{low[0]:.2f}, {high[0]:.2f}]; mean settling depth "
        f"{depth.mean():.1f} of {result.num_layers}, decision depth {result.decision[result.counted].mean():.1f}",
        f"right {100 * accuracy['mean']:.0f}% (one sample), {100 * accuracy['majority']:.0f}% (majority), "
        f"{100 * accuracy['think@n']:.0f}% (Think@n)",
    ]


def depth_reading(result: GeneratedDepthResult) -> DepthReading:
    """The mean settling depth as a ratio of the depth, and the entropy lens of generated and of
    teacher-forced tokens, for the comparison on the relative-depth axis."""
    L = result.num_layers
    depth = result.settling[result.counted]
    x = np.arange(L + 1) / L
    return DepthReading(
        num_layers=L,
        ratios={
            "settling": ("mean settling depth of generated tokens", float(depth.mean()) / L if depth.size else None)
        },
        curves={
            "entropy_generated": DepthCurve("entropy lens, generated tokens", "bits", x, result.entropy.mean(axis=0)),
            "entropy_forced": DepthCurve(
                "entropy lens, teacher-forced answers", "bits", x, result.entropy_forced.mean(axis=0)
            ),
        },
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class GeneratedDepthSettings(Settings):
    """The depth of generated tokens in a study (`Settings` and its options)."""

    generated_new_tokens: int = option(
        -1, "generated depth: new tokens per answer (-1: the longest reference answer's length plus 8)"
    )
    generated_samples: int = option(1, "generated depth: answers per prompt (1: greedy; more: sampled, for Think@n)")
    generated_temperature: float = option(0.7, "generated depth: the sampling temperature of several samples")
    depth_threshold: float = option(
        DEFAULT_THRESHOLD, "generated depth: a token settles at a JSD to the output <= this (bits)"
    )
    depth_rho: float = option(DEFAULT_RHO, "generated depth: deep-thinking tokens settle at or after layer ceil(rho L)")
    think_keep: float = option(DEFAULT_KEEP, "generated depth: the share of samples Think@n keeps, deepest first")
    generated_lens: str = option(
        "", "generated depth: a tuned lens's folder (jaxdepth tuned-lens) to read instead of the logit lens"
    )

    def __post_init__(self):
        super().__post_init__()
        if self.generated_new_tokens < -1 or self.generated_new_tokens == 0:
            raise ValueError(f"--generated-new-tokens must be -1 (auto) or >= 1, got {self.generated_new_tokens}")
        self.reading(1)  # the reading's own checks, at once

    def reading(self, new_tokens: int, eos_ids: tuple = ()) -> Reading:
        """These settings as the `Reading` of `generated_depth`, `new_tokens` per answer."""
        return Reading(
            max_new_tokens=new_tokens,
            samples=self.generated_samples,
            temperature=self.generated_temperature,
            seed=self.seed,
            eos_ids=eos_ids,
            threshold=self.depth_threshold,
            rho=self.depth_rho,
            keep=self.think_keep,
        )


def _run(x) -> GeneratedDepthResult:
    if x.model.tokenizer is None:
        raise ValueError("the depth of generated tokens reads answers as text: the model needs a tokenizer")
    setting = x.settings.generated_new_tokens
    new_tokens = new_tokens_for(x.batch, setting)
    eos = getattr(x.model.tokenizer, "eos_token_id", None)
    reading = x.settings.reading(new_tokens, () if eos is None else (int(eos),))
    translators = None
    if x.settings.generated_lens:
        from jaxdepth.analyses.tuned_lens import load_tuned_lens

        translators = load_tuned_lens(x.settings.generated_lens, x.model.config).translators()
    return generated_depth(
        x.model.params,
        x.batch,
        x.model.config,
        x.model.tokenizer.decode,
        reading,
        translators=translators,
        execution=Execution(progress=x.progress, memory_budget=x.settings.memory_budget),
    )


ANALYSIS = Analysis(
    name="generated_depth",
    default=False,  # in the suite, run when named: `--analyses generated_depth`
    result_type=GeneratedDepthResult,
    settings=GeneratedDepthSettings,
    identity=lambda s: (
        {
            f: getattr(s, f)
            for f in (
                "generated_new_tokens",
                "generated_samples",
                "generated_temperature",
                "depth_threshold",
                "depth_rho",
                "think_keep",
            )
        }
        | {"generated_lens": lens_identity(s.generated_lens)}
    ),
    run=_run,
    figures=lambda r, tokenizer, n: {"": generated_depth_figure(r)},
    summary=_summary,
    depth=depth_reading,
    detail=True,
)
