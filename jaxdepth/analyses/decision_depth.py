"""Decision depth per token: after how many layers does the lens already predict what the model
will, and keep predicting it (Gupta, Yeung, Anumanchipalli and Ivanova, "How Do LLMs Use Their
Depth?", arXiv 2510.18871).

At each valid position, the lens's top-1 token at residual boundary l is argmax unembed(h_l),
l = 0..L (h_0 the embeddings, h_L the final residual, whose top-1 is the model's prediction y).
The position's decision depth d is the first boundary from which top-1 equals y at every later
boundary: d = min {l : top1(h_k) = y for all k in l..L}, in 0..L. d = 0: the embeddings already
predict y; d = L: only the last layer does. With a tuned lens's translators, h_l goes through its
layer's translator first (h_L through none).

Grouped three ways; every average over prompts (the summary's, the figure's) is the mean over
prompts of each prompt's mean over its positions in the group (`DecisionDepthResult.prompt_mean`),
so that a long prompt counts as much as a short one, with a 95% bootstrap interval over prompts:
- by position in the answer: the position that predicts the answer's first token
  (`answer_start - 1`) against those that predict its later tokens;
- by the predicted token's frequency: quartiles of its rank, where a token's rank is its id
  ('id', the default: byte-level BPE vocabularies number tokens in the order they were merged,
  frequent pieces first) or its count in the prompt set ('count', from most to least frequent);
- per prompt, the mean over its positions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from functools import partial
from typing import TYPE_CHECKING, Optional

import jax.numpy as jnp
import numpy as np

from jaxdepth.analyses.suite import Analysis, DepthCurve, DepthReading, Settings, option
from jaxdepth.analyses.logit_lens import map_lens
from jaxdepth.analyses.tuned_lens import load_tuned_lens
from jaxdepth.analyses.uncertainty import DEFAULT_RESAMPLES, DEFAULT_SEED, curve_band, resample_indices
from jaxdepth.core.batch import PromptBatch
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import residual_stream, unembed
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.core.sharding import to_host

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "lens_top1",
    "decision_depths",
    "decision_depth",
    "DecisionDepthResult",
    "frequency_ranks",
    "decision_depth_figure",
    "decision_depth_panel",
    "DecisionDepthSettings",
    "lens_identity",
    "ANALYSIS",
    "depth_reading",
]

FREQUENCY_RANKS = ("id", "count")


@partial(jit, static_argnames="config")
def lens_top1(params, tokens, valid, config: ModelConfig, translators=None):
    """The lens's top-1 token id `[L + 1, B, T]` at every boundary h_0..h_L (row L: the model's
    own prediction), read one boundary at a time (`lax.map`: one `[B, T, V]` logit tensor at
    once). With `translators` (a tuned lens's), h_0..h_{L-1} go through their translators."""
    hs = residual_stream(params, tokens, config, valid=valid)
    top1 = lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32)  # noqa: E731
    early = map_lens(top1, params, hs[:-1], config, translators)
    return jnp.concatenate([early, top1(unembed(params, hs[-1], config))[None]], axis=0)


def decision_depths(top1) -> np.ndarray:
    """Decision depths `[...]` from top-1 ids `[L + 1, ...]` (boundary 0..L first): the first
    boundary from which every later one predicts what boundary L does (module docstring)."""
    top1 = np.asarray(top1)
    agrees = top1 == top1[-1]
    # the boundaries from which agreement holds to the end: a suffix of Trues
    settled = np.flip(np.logical_and.accumulate(np.flip(agrees, 0), axis=0), 0)
    return (top1.shape[0] - settled.sum(axis=0)).astype(np.int32)


def frequency_ranks(predicted, valid, how: str = "id") -> np.ndarray:
    """Each position's predicted token's frequency rank `[N, T]` (0: most frequent): its id
    ('id'), or its place when the predicted tokens of the valid positions are ordered by how
    often they occur there ('count', ties by id)."""
    if how == "id":
        return np.asarray(predicted).astype(np.int64)
    if how != "count":
        raise ValueError(f"frequency ranks are 'id' or 'count', got {how!r}")
    ids, counts = np.unique(np.asarray(predicted)[valid], return_counts=True)
    order = ids[np.lexsort((ids, -counts))]
    rank = {int(t): r for r, t in enumerate(order)}
    return np.vectorize(lambda t: rank.get(int(t), len(rank)))(predicted).astype(np.int64)


@dataclasses.dataclass
class DecisionDepthResult(SavedResult):
    """`depth [N, T]` (int; -1 at padding), each valid position's decision depth in 0..L;
    `predicted [N, T]` the model's top-1 token there; `rank [N, T]` its frequency rank
    (`settings['frequency']` says which); `answer_start [N]`, `lengths [N]`; `num_layers` L;
    `tokens [N, T]` the prompts' own tokens (`[0, 0]` in results saved before they were kept)."""

    depth: np.ndarray
    predicted: np.ndarray
    rank: np.ndarray
    answer_start: np.ndarray
    lengths: np.ndarray
    num_layers: int
    settings: dict
    tokens: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0), np.int32))

    @property
    def valid(self) -> np.ndarray:
        """`[N, T]`: the prompts' real positions (padding's depth is -1)."""
        return self.depth >= 0

    def answer_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """Masks `[N, T]` of the positions predicting the answer's first token, and its later ones."""
        T = self.depth.shape[1]
        t = np.arange(T)[None, :]
        first = (t == self.answer_start[:, None] - 1) & (self.answer_start[:, None] < self.lengths[:, None])
        later = (t >= self.answer_start[:, None]) & (t < self.lengths[:, None] - 1)
        return first & self.valid, later & self.valid

    def rank_quartiles(self) -> list[np.ndarray]:
        """Masks `[N, T]` of the valid positions in each quartile of the rank (most frequent first)."""
        ranks = self.rank[self.valid]
        edges = np.quantile(ranks, [0.25, 0.5, 0.75]) if ranks.size else np.zeros(3)
        bins = np.digitize(self.rank, edges, right=True)
        return [(bins == q) & self.valid for q in range(4)]

    def per_prompt(self, mask: Optional[np.ndarray] = None) -> np.ndarray:
        """Each prompt's mean decision depth `[N]` over its positions in `mask` (default: all
        valid ones); NaN where it has none."""
        mask = self.valid if mask is None else mask
        counts = mask.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(counts > 0, np.where(mask, self.depth, 0).sum(axis=1) / counts, np.nan)

    def prompt_mean(self, mask: Optional[np.ndarray] = None) -> float:
        """The mean over prompts of each prompt's mean decision depth over its positions in
        `mask` (`per_prompt`; prompts without such positions left out; NaN if none has any):
        the one average of the summary and the figure, every prompt weighing the same whatever
        its length."""
        values = self.per_prompt(mask)
        values = values[np.isfinite(values)]
        return float(values.mean()) if values.size else float("nan")

    def groups(self) -> dict[str, np.ndarray]:
        """The masks of the figure's groups, by name."""
        first, later = self.answer_positions()
        named = {"all positions": self.valid, "answer's first token": first, "later answer tokens": later}
        which = {0: " (most frequent)", 3: " (rarest)"}
        named.update({f"rank quartile {q + 1}{which.get(q, '')}": m for q, m in enumerate(self.rank_quartiles())})
        return named


def decision_depth(
    params,
    batch: PromptBatch,
    config: ModelConfig,
    *,
    frequency: str = "id",
    translators=None,
    settings: Optional[dict] = None,
) -> DecisionDepthResult:
    """Every valid position's decision depth over `batch` (module docstring): one forward per
    group of prompts of similar length, reading the lens at every boundary."""
    if frequency not in FREQUENCY_RANKS:
        raise ValueError(f"frequency must be one of {FREQUENCY_RANKS}, got {frequency!r}")
    N, T = batch.tokens.shape
    depth = np.full((N, T), -1, np.int32)
    predicted = np.zeros((N, T), np.int32)
    for index, group in batch.groups():
        top1 = to_host(lens_top1(params, group.tokens, group.valid, config, translators))[:, : len(index)]
        Tg = group.tokens.shape[1]
        depth[index, :Tg] = np.where(group.valid[: len(index)], decision_depths(top1), -1)
        predicted[index, :Tg] = top1[-1]
    valid = depth >= 0
    return DecisionDepthResult(
        depth=depth,
        predicted=predicted,
        rank=np.where(valid, frequency_ranks(predicted, valid, frequency), -1),
        answer_start=np.asarray(batch.answer_start, np.int64),
        lengths=np.asarray(batch.lengths, np.int64),
        num_layers=config.num_layers,
        tokens=np.asarray(batch.tokens, np.int32),
        settings={**(settings or {}), "frequency": frequency, "lens": "logit" if translators is None else "tuned"},
    )


# ----------------------------------------------------------------------------- figure


def _bootstrap_mean(values: np.ndarray, resamples: int, seed: int) -> tuple[float, float, float]:
    """The mean of per-prompt values (NaN ones left out) and its 95% percentile interval over
    bootstrap resamples of those prompts (`uncertainty.resample_indices`; NaN bounds without
    resamples or with a single prompt)."""
    values = values[np.isfinite(values)]
    if not values.size:
        return np.nan, np.nan, np.nan
    if resamples <= 0 or values.size < 2:
        return float(values.mean()), np.nan, np.nan
    means = values[resample_indices(values.size, resamples=resamples, seed=seed)].mean(axis=1)
    band = curve_band(means[:, None])
    return float(values.mean()), float(band.low[0]), float(band.high[0])


def decision_depth_figure(
    result: DecisionDepthResult, *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED
) -> Figure:
    """Left: the distribution of decision depths over all valid positions (relative depth d / L).
    Right: the mean decision depth of each group (answer's first token, later answer tokens,
    frequency quartiles), each over its prompts' means with a 95% bootstrap interval."""
    from jaxdepth.analyses import drawing as d

    d.expect(result, DecisionDepthResult, "decision_depth_figure")
    L = result.num_layers
    fig = d.new_figure(11, 4.2)
    hist_ax, group_ax = fig.subplots(1, 2)
    hist_ax.hist(result.depth[result.valid], bins=np.arange(L + 2) - 0.5, color="C0")
    hist_ax.set(xlabel="decision depth (boundary)", ylabel="positions", title="where the prediction settles")
    names, means, lows, highs = [], [], [], []
    for name, mask in result.groups().items():
        mean, low, high = _bootstrap_mean(result.per_prompt(mask), resamples, seed)
        names.append(name)
        means.append(mean / L)
        lows.append(mean / L - low / L if np.isfinite(low) else 0)
        highs.append(high / L - mean / L if np.isfinite(high) else 0)
    y = np.arange(len(names))
    group_ax.barh(y, means, xerr=[lows, highs], color="C1", capsize=3)
    group_ax.set_yticks(y, names)
    group_ax.invert_yaxis()
    group_ax.set(
        xlabel="mean of the prompts' mean depth / L",
        xlim=(0, 1),
        title=f"by group (frequency: {result.settings['frequency']})",
    )
    d.title_figure(fig, "Decision depth", None, result.settings)
    return fig


def decision_depth_panel(result: DecisionDepthResult, prompt: int = 0, *, tokenizer=None):
    """One prompt's decision depths as a `TokenPanel` (a case study's per-token view): cell
    (l, t) is 1 where boundary l already predicts, and keeps predicting, what position t's final
    prediction is (l >= the position's decision depth), else 0; the boundary where each column
    turns is its decision depth. Tokens are labelled by the prompt's own (by the prediction,
    after an arrow, in results saved without them)."""
    from jaxdepth.analyses import drawing as d

    d.expect(result, DecisionDepthResult, "decision_depth_panel")
    p = d.prompt_index(result, prompt)
    n = int(result.lengths[p])
    if result.tokens.size:
        labels = d.token_labels(result.tokens[p, :n], tokenizer)
    else:
        labels = ["→" + label for label in d.token_labels(result.predicted[p, :n], tokenizer)]
    boundaries = np.arange(result.num_layers + 1)[:, None]
    return d.TokenPanel(
        (boundaries >= result.depth[p, :n][None, :]).astype(np.float32),
        labels,
        row_label="lens boundary l (0 = embeddings)",
        answer_start=int(result.answer_start[p]),
        cmap="Greens",
        symmetric=False,
        colorbar_label="top-1 is the final prediction from here on",
        caption=f"decision depth ({result.settings.get('lens', 'logit')} lens)",
    )


# ----------------------------------------------------------------------------- in the suite


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecisionDepthSettings(Settings):
    """The decision depth's settings in a study (`Settings` and its options)."""

    decision_frequency: str = option(
        "id",
        "decision depth: rank predicted tokens by id (BPE merge order, the default) or by their count in the prompts",
        choices=FREQUENCY_RANKS,
    )
    decision_lens: str = option(
        "",
        "decision depth: read it through the tuned lens trained in this folder (`jaxdepth tuned-lens`; default: "
        "the logit lens)",
        metavar="FOLDER",
    )


def lens_identity(folder: str) -> str:
    """What a decision depth read through the tuned lens in `folder` depends on: the folder, its
    settings (`lens.json`) and its latest checkpoint, so that a lens retrained there is not
    taken for the old one ('' for the logit lens)."""
    if not folder:
        return ""
    path = os.path.abspath(folder)
    try:
        with open(os.path.join(path, "lens.json"), "rb") as f:
            settings = hashlib.sha256(f.read()).hexdigest()[:16]
    except FileNotFoundError:
        return path  # the run itself says there is no lens here
    steps = [int(name) for name in os.listdir(path) if name.isdigit()]
    return f"{path}:{settings}:step{max(steps, default=-1)}"


def _run(x) -> DecisionDepthResult:
    translators = None
    if x.settings.decision_lens:
        translators = load_tuned_lens(x.settings.decision_lens, x.model.config).translators()
    return decision_depth(
        x.model.params, x.batch, x.model.config, frequency=x.settings.decision_frequency, translators=translators
    )


def _summary(result: DecisionDepthResult) -> list[str]:
    first, later = result.answer_positions()
    return [
        f"mean decision depth {result.prompt_mean():.1f} of {result.num_layers} "
        "(mean over prompts of each prompt's mean)",
        f"answer's first token {result.prompt_mean(first):.1f}, later ones {result.prompt_mean(later):.1f}",
    ]


def depth_reading(result: DecisionDepthResult) -> DepthReading:
    """The mean decision depth as a ratio of the depth (the summary's average, `prompt_mean`),
    and the share of positions decided by each boundary, for the comparison on the
    relative-depth axis."""
    L = result.num_layers
    depths = result.depth[result.valid]
    decided = np.array([(depths <= l).mean() for l in range(L + 1)])
    mean = result.prompt_mean()
    return DepthReading(
        num_layers=L,
        ratios={"decision": ("mean decision depth", mean / L if np.isfinite(mean) else None)},
        curves={
            "decided": DepthCurve(
                "positions decided by boundary l", "share of positions", np.arange(L + 1) / L, decided
            )
        },
    )


ANALYSIS = Analysis(
    name="decision_depth",
    default=False,  # in the suite, run when named: `--analyses decision_depth`
    result_type=DecisionDepthResult,
    settings=DecisionDepthSettings,
    identity=lambda s: {"decision_frequency": s.decision_frequency, "decision_lens": lens_identity(s.decision_lens)},
    run=_run,
    figures=lambda r, tokenizer, n: {"": decision_depth_figure(r)},
    summary=_summary,
    panel=decision_depth_panel,
    depth=depth_reading,
)
