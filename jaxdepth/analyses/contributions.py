"""Relative contributions and residual cosine similarity of every layer (METHODS §1)."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import TYPE_CHECKING, Optional

import jax.numpy as jnp
import numpy as np

from jaxdepth.core.batch import PromptBatch
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.layer import LayerRecord
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, per_layer_inputs
from jaxdepth.core.sharding import to_host
from jaxdepth.core.sites import as_interventions
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.analyses.effective_depth import cosine_effective_depth
from jaxdepth.analyses.stats import cosine, per_prompt_mean, relative_norm, token_mean
from jaxdepth.analyses.suite import Analysis, DepthCurve, DepthReading
from jaxdepth.analyses.uncertainty import DEFAULT_RESAMPLES, DEFAULT_SEED

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the analysis
    from matplotlib.figure import Figure

__all__ = [
    "contributions",
    "ContributionResult",
    "contribution_stats",
    "contributions_figure",
    "STATISTICS",
    "ANALYSIS",
    "depth_reading",
]

# Order of the statistics on the last axis of `per_token`.
STATISTICS = ("norm_attn", "norm_mlp", "norm_layer", "cos_attn", "cos_mlp", "cos_layer")


# Sites acting after a_l + m_l is formed: an intervention there changes what the layer adds to the
# residual without changing a_l or m_l.
_AFTER_SUBLAYERS = ("delta", "resid_post")


def _tap_contributions(r: LayerRecord, _, *, layer_from_residual: bool = False):
    h_mid = r.h + r.attn
    # Without interventions after the sublayers, h_{l+1} - h_l is a_l + m_l (up to rounding):
    # the sum is what the studies compute.
    layer = r.delta if layer_from_residual else r.attn + r.mlp
    return jnp.stack(
        [
            relative_norm(r.attn, r.h),
            relative_norm(r.mlp, h_mid),
            relative_norm(layer, r.h),
            cosine(r.attn, r.h),
            cosine(r.mlp, h_mid),
            cosine(layer, r.h),
        ],
        axis=-1,
    )


@partial(jit, static_argnames="config")
def contribution_stats(params, tokens, valid, config: ModelConfig, interventions=None):
    """Per-token statistics `[L, B, T, 6]` in the order of `STATISTICS`, computed inside the scan.

    Under `interventions` (anything `jaxdepth.core.sites.as_interventions` takes) every quantity
    is the intervened run's, each site after its interventions: h_l (after those at `resid_pre`),
    a_l, m_l. The layer's contribution is a_l + m_l, or h_{l+1} - h_l where an intervention acts
    at `delta` or `resid_post` (after the sublayers: a whole-layer skip, say), so that it is what
    the layer really added to the residual; h_{l+1} - h_l too where a layer adds more than its
    sublayers' outputs (Gemma 4's per-layer inputs and its scalar per layer, which scales h_l)."""
    ivs = as_interventions(interventions)
    more = bool(config.layer_scalar or config.per_layer_input_size)
    tap = partial(_tap_contributions, layer_from_residual=more or any(iv.site in _AFTER_SUBLAYERS for iv in ivs))
    h0 = embed(params, tokens, config)
    extra = per_layer_inputs(params, tokens, h0, config)
    _, stats = run_layers(params, h0, config, valid=valid, interventions=ivs, tap=tap, per_layer_inputs=extra)
    return stats


@dataclasses.dataclass
class ContributionResult(SavedResult):
    """Per-layer curves `[L]`: the mean over every valid token of every prompt.

    With h_l the layer's input, a_l its attention output and m_l its MLP output (the MLP reads
    h_l + a_l), the relative contributions are `norm_attn` = ||a_l|| / ||h_l||, `norm_mlp` =
    ||m_l|| / ||h_l + a_l|| and `norm_layer` = ||a_l + m_l|| / ||h_l|| (denominators clamped
    at 1e-6), and `cos_attn`, `cos_mlp`, `cos_layer` the cosine similarities of the same pairs
    (negative: the sublayer removes part of what the residual holds). `mean_cosine` averages the
    three cosines. `num_tokens` counts the valid tokens; `settings` is what the caller passed.

    `<statistic>_per_prompt [N, L]` hold each prompt's mean over its own valid tokens and
    `tokens_per_prompt [N]` its number of valid tokens, so the curves are the token-weighted
    mean of the per-prompt curves (what a bootstrap over prompts re-aggregates). Results saved
    before per-prompt curves existed load with them None.
    """

    norm_attn: np.ndarray
    norm_mlp: np.ndarray
    norm_layer: np.ndarray
    cos_attn: np.ndarray
    cos_mlp: np.ndarray
    cos_layer: np.ndarray
    num_tokens: int
    settings: dict
    norm_attn_per_prompt: Optional[np.ndarray] = None
    norm_mlp_per_prompt: Optional[np.ndarray] = None
    norm_layer_per_prompt: Optional[np.ndarray] = None
    cos_attn_per_prompt: Optional[np.ndarray] = None
    cos_mlp_per_prompt: Optional[np.ndarray] = None
    cos_layer_per_prompt: Optional[np.ndarray] = None
    tokens_per_prompt: Optional[np.ndarray] = None

    @property
    def mean_cosine(self) -> np.ndarray:
        """The average of the three cosine curves (what cosine effective depth reads)."""
        return (self.cos_attn + self.cos_mlp + self.cos_layer) / 3

    @property
    def mean_cosine_per_prompt(self) -> Optional[np.ndarray]:
        """`[N, L]`: each prompt's average of its three cosine curves; None without per-prompt curves."""
        if self.cos_layer_per_prompt is None:
            return None
        return (self.cos_attn_per_prompt + self.cos_mlp_per_prompt + self.cos_layer_per_prompt) / 3


def contributions(
    params, batch: PromptBatch, config: ModelConfig, *, settings=None, interventions=None
) -> ContributionResult:
    """Relative norms and cosines of attention, MLP and whole-layer outputs, per layer, over all
    prompts and per prompt: a `ContributionResult` (definitions there) over every valid
    position of `batch` (a `PromptBatch`). `settings` (a dict) is stored in the result.

    `interventions` (`jaxdepth.core.sites`; default none) act on every forward, and the
    statistics are those of the intervened runs (see `contribution_stats`). The prompts run in
    groups at their own padded lengths (`PromptBatch.groups`), so intervention data indexed by
    position must broadcast to every length (`[L, 1]` keep-masks, head ablations, a vector added
    at every position); data that does not is refused at trace time."""
    # Prompts of similar length together, each group trimmed to its own padded length: a padded
    # batch of all prompts would spend a third of its work on padding when lengths differ as
    # much as GSM8K's, and one prompt at a time gives short prompts too few rows per matmul.
    L, T = config.num_layers, batch.tokens.shape[1]
    stats = np.zeros((L, len(batch), T, len(STATISTICS)), np.float32)
    for index, group in batch.groups():
        Tg = group.tokens.shape[1]
        group_stats = contribution_stats(params, group.tokens, group.valid, config, interventions)
        stats[:, index, :Tg] = to_host(group_stats)[:, : len(index)]
    values = np.moveaxis(stats, -1, 0)  # [6, L, N, T]
    curves = token_mean(values, batch.valid)  # [6, L]
    # Per-prompt means from the same per-token statistics (no second pass through the model).
    per_prompt = np.swapaxes(per_prompt_mean(values, batch.valid), -1, -2)  # [6, N, L]
    return ContributionResult(
        **dict(zip(STATISTICS, curves)),
        num_tokens=int(batch.valid.sum()),
        settings=dict(settings or {}),
        **{f"{name}_per_prompt": c for name, c in zip(STATISTICS, per_prompt)},
        tokens_per_prompt=batch.lengths.astype(np.int64),
    )


# ----------------------------------------------------------------------------- figures


def contributions_figure(
    result: ContributionResult,
    *,
    title: Optional[str] = None,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> Figure:
    """Cosine of the attention, MLP and layer outputs with the residual (and their mean, which the
    cosine effective depth reads) and their relative norms, per layer; the cosine ED is a vertical
    line in both panels. Where the result has per-prompt curves, each prompt's mean cosine is a
    faint line and, with `resamples > 0`, a shaded 95% bootstrap band over prompts (`seed` as in
    `uncertainty`) surrounds the mean cosine and the norms, and the title gives the ED's interval."""
    from jaxdepth.analyses import drawing as d

    d.expect(result, ContributionResult, "contributions_figure")
    L = len(result.cos_layer)
    layers = np.arange(L)
    ed = d.depth_or_none(cosine_effective_depth, result.mean_cosine)
    bands, intervals = d.bootstrap(result, resamples, seed)
    fig = d.new_figure(11, 4.2)
    cos_ax, norm_ax = fig.subplots(1, 2, sharex=True)
    d.draw_per_prompt(cos_ax, layers, result.mean_cosine_per_prompt, "0.5")
    for i, name in enumerate(("attn", "mlp", "layer")):
        cos_ax.plot(layers, getattr(result, f"cos_{name}"), marker=".", label=name)
        norm_ax.plot(layers, getattr(result, f"norm_{name}"), marker=".", label=name)
        d.draw_band(norm_ax, layers, bands.get(f"norm_{name}"), f"C{i}", label=i == 0)
    cos_ax.plot(layers, result.mean_cosine, color="k", linestyle="--", label="mean")
    d.draw_band(cos_ax, layers, bands.get("mean_cosine"), "k")
    cos_ax.axhline(0, color="grey", linewidth=0.8)
    for ax in (cos_ax, norm_ax):
        d.mark_depth(ax, ed, "cosine ED")
        d.layer_axis(ax, L)
        ax.legend(fontsize=8)
    cos_ax.set(ylabel="cosine with the residual", title=d.depth_text("cosine", ed, intervals.get("cosine")))
    norm_ax.set(ylabel="||contribution|| / ||residual||", title="relative norm")
    # The first layers' norms are often tens of times the rest: a log axis keeps both readable.
    norms = np.stack([result.norm_attn, result.norm_mlp, result.norm_layer])
    if np.all(norms[np.isfinite(norms)] > 0):
        norm_ax.set_yscale("log")
    d.title_figure(fig, "Layer contributions", title, result.settings)
    return fig


# ----------------------------------------------------------------------------- in the suite


def depth_reading(result: ContributionResult) -> DepthReading:
    """The cosine effective depth of `result`, for the table and the comparison, and its
    per-layer curves at (l + 0.5) / L: the mean of the three cosines (what the effective depth
    reads) and the three relative contributions."""
    depth = cosine_effective_depth(result.mean_cosine)
    L = depth.num_layers
    x = (np.arange(L) + 0.5) / L
    norms = (
        ("norm_attn", "attention's relative contribution", "||a_l|| / ||h_l||", result.norm_attn),
        ("norm_mlp", "MLP's relative contribution", "||m_l|| / ||h_l + a_l||", result.norm_mlp),
        ("norm_layer", "layer's relative contribution", "||a_l + m_l|| / ||h_l||", result.norm_layer),
    )
    curves = {"cosine": DepthCurve("residual cosine (mean of the three)", "cosine", x, np.asarray(result.mean_cosine))}
    curves.update({name: DepthCurve(title, label, x, np.asarray(y), log=True) for name, title, label, y in norms})
    return DepthReading(
        num_layers=L,
        effective_depths={"cosine": depth},
        ratios={"cosine": ("cosine ED", depth.ratio)},
        curves=curves,
        per_prompt=result.tokens_per_prompt is not None,
    )


ANALYSIS = Analysis(
    name="contributions",
    result_type=ContributionResult,
    identity=lambda s: {},
    run=lambda x: contributions(x.model.params, x.batch, x.model.config),
    figures=lambda r, tokenizer, n: {"": contributions_figure(r)},
    summary=lambda r: [f"cosine ED {cosine_effective_depth(r.mean_cosine)}"],
    feeds_table=True,
    depth=depth_reading,
)
