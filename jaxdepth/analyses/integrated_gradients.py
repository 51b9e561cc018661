"""The studies' integrated gradients: the answer probability attributed to each layer's output
(METHODS §5), or to its attention or MLP output (the first study's sublayer attributions).

For layer l, x = h_{l+1} over the whole prompt (target 'layer'; a_l for 'attn', m_l for 'mlp')
and F(x) = sum over answer tokens of their teacher-forced probabilities when x is set:

    IG_l[t] = sum_c (x - b)[t, c] * sum_k w_k dF/dx(b + α_k (x - b))[t, c]

This is the integrated-gradients engine (`jaxdepth.analyses.ig`) with F as the metric
(`jaxdepth.analyses.metrics.answer_probability`, read at each prompt's answer span), run
prompt by prompt: every rule (the published left rule, midpoint, Gauss-Legendre, the certified
adaptive rule), the same checks and the same refusal of non-finite values as
`jaxdepth.integrated_gradients`. The completeness gap `sum_t IG_l[t] - (F(x) - F(b))` says
whether the rule was accurate enough.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Union

import numpy as np

from jaxdepth.analyses.ig import rules
from jaxdepth.analyses.ig.checks import BASELINES, warn_if_zero_baseline_diverges
from jaxdepth.analyses.ig.engine import Attribution, attribute
from jaxdepth.analyses.ig.path import ig_memory_budget, prompt_seconds
from jaxdepth.analyses.metrics import answer_probability
from jaxdepth.core.execution import Execution
from jaxdepth.core.progress import progress_bar
from jaxdepth.core.batch import LengthBuckets, PromptArrays, PromptBatch
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.padding import ChosenLengths, DeviceSpeed, cheapest_lengths
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.analyses.suite import Analysis, Settings, option, per_prompt_figures

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the analysis
    from matplotlib.figure import Figure

    from jaxdepth.analyses.drawing import TokenPanel

__all__ = [
    "integrated_gradients_of_answers",
    "IntegratedGradientsResult",
    "ig_of_prompt",
    "ig_lengths",
    "PADDINGS",
    "TARGETS",
    "Target",
    "integrated_gradients_figure",
    "integrated_gradients_panel",
    "IGSettings",
    "ANALYSIS",
    "as_target",
    "relative_gaps",
]

# What a layer's attribution is taken with respect to, per study target: the site of its
# output h_{l+1}, or of one of its sublayers' outputs.
TARGETS = {"layer": "resid_post", "attn": "attn_out", "mlp": "mlp_out"}


@dataclasses.dataclass(frozen=True)
class Target:
    """What each layer's attribution is taken with respect to and where its path starts: `name`
    'layer' (the layer's output h_{l+1}), 'attn' (its attention output a_l) or 'mlp' (its MLP
    output m_l), one of `TARGETS`; `baseline`, one of `jaxdepth.analyses.ig.checks.BASELINES`.
    Where a function takes a target, a name alone is `Target(name)`."""

    name: str = "layer"
    baseline: str = "channel_mean"

    def __post_init__(self):
        _check_target(self.name)
        if self.baseline not in BASELINES:
            raise ValueError(f"baseline must be one of {BASELINES}, got {self.baseline!r}")

    @property
    def site(self) -> str:
        """The site whose value is attributed (`TARGETS`)."""
        return TARGETS[self.name]


def as_target(target: Union[str, Target]) -> Target:
    """`target` as a `Target` (a name is `Target(name)`)."""
    return target if isinstance(target, Target) else Target(target)


def _check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")


def ig_of_prompt(
    params,
    prompt: PromptArrays,
    config: ModelConfig,
    *,
    rule: Union[rules.Rule, str] = rules.FixedRule(),
    target: Union[str, Target] = "layer",
    interventions=None,
    execution: Execution = Execution(),
    label=None,
):
    """IG of every layer for one prompt (`PromptArrays`, batch 1): the engine's `SiteIG` with
    the studies' F, `jaxdepth.analyses.metrics.answer_probability` read at the prompt's answer
    span (`per_position [L, 1, T]`, `f_input [1]`, `f_baseline [L, 1]`, ...), per position only.

    `interventions` (`jaxdepth.core.sites`) act on the whole forward, before and after the
    attributed layer: IG of a model with, say, an earlier layer skipped. `target`: 'layer'
    (h_{l+1}), 'attn' (a_l) or 'mlp' (m_l), or a `Target` with its baseline. `rule`, `execution`
    as `jaxdepth.integrated_gradients`; `label` names the prompt in a non-finite report."""
    target = as_target(target)
    attribution = Attribution(
        answer_probability,
        site=target.site,
        layers=list(range(config.num_layers)),
        baseline=target.baseline,
        per_channel=False,
    )
    return attribute(
        params,
        prompt,
        config,
        attribution,
        rule=rules.as_rule(rule),
        interventions=interventions,
        execution=execution,
        label=label,
    )


@dataclasses.dataclass
class IntegratedGradientsResult(SavedResult):
    """`attributions [P, L, T]`, completeness `gap [P, L]`, `f_input [P]` = F(x), `f_baseline
    [P, L]` = F(b), with the prompts' tokens for labelling. From the adaptive rule also, per
    prompt and layer, the gradient `evaluations [P, L]` it used, whether it `converged [P, L]`
    to its tolerance, the certified `bound [P, L]` >= |gap| (in units of F) and whether the
    tolerance was relative to the floor (`floored [P, L]`, `jaxdepth.analyses.ig.rules`). A
    layer not converged ran out of `settings['max_evaluations']` (or met a non-finite value):
    its attributions are the best the budget gave, its gap says how far off they are."""

    attributions: np.ndarray
    gap: np.ndarray
    f_input: np.ndarray
    f_baseline: np.ndarray
    tokens: np.ndarray
    lengths: np.ndarray
    answer_start: np.ndarray
    settings: dict
    evaluations: Optional[np.ndarray] = None
    converged: Optional[np.ndarray] = None
    bound: Optional[np.ndarray] = None
    floored: Optional[np.ndarray] = None

    @property
    def rule(self) -> rules.Rule:
        """The quadrature that produced the attributions (`rules.rule_from_settings`); in words,
        `str(result.rule)`: "left rule, 256 steps", or "adaptive rule to 1%" (which layers got
        there: `converged`)."""
        return rules.rule_from_settings(self.settings)

    @property
    def relative_gap(self) -> np.ndarray:
        """`gap / (F(x) - F(b))` `[P, L]` (NaN where F(x) = F(b))."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.gap / (self.f_input[:, None] - self.f_baseline)


PADDINGS = ("cost", "buckets")  # `ig_lengths`' policies by name


def ig_lengths(
    batch: PromptBatch,
    config: ModelConfig,
    rule: rules.Rule,
    padding: Union[str, LengthBuckets, ChosenLengths] = "cost",
    memory_budget: Optional[int] = None,
):
    """The lengths the prompts of `batch` run IG at (anything with `padded(length)`, as
    `PromptBatch.prompt` takes it). 'cost': the cheapest for this device
    (`jaxdepth.core.padding.cheapest_lengths`): each prompt's estimated IG seconds at its padded
    length (`jaxdepth.analyses.ig.path.prompt_seconds`, `rule.evaluations` gradients per
    layer) plus a compilation per length, so a CPU pads to about each prompt's own length and a
    GPU shares lengths; 'buckets': the batch's `LengthBuckets`; or lengths given."""
    if isinstance(padding, str):
        if padding == "buckets":
            return batch.buckets
        if padding != "cost":
            raise ValueError(f"padding must be one of {PADDINGS} or lengths (LengthBuckets ...), got {padding!r}")
        speed = DeviceSpeed.estimate()
        budget = ig_memory_budget(memory_budget)  # read once for every length
        seconds = lambda T: prompt_seconds(config, T, rule.evaluations, speed, budget)  # noqa: E731
        return cheapest_lengths(batch.lengths, seconds, speed.compile_seconds)
    if not callable(getattr(padding, "padded", None)):
        raise TypeError(f"padding must be one of {PADDINGS} or lengths with a padded(length) method, got {padding!r}")
    return padding


def integrated_gradients_of_answers(
    params,
    batch: PromptBatch,
    config: ModelConfig,
    *,
    rule: Union[rules.Rule, str] = rules.FixedRule(),
    target: Union[str, Target] = "layer",
    interventions=None,
    execution: Execution = Execution(progress=True),
    padding: Union[str, LengthBuckets, ChosenLengths] = "cost",
) -> IntegratedGradientsResult:
    """Integrated gradients per layer and token for every prompt of `batch`, with respect to
    each layer's output (`target` 'layer', the default), attention output ('attn') or MLP
    output ('mlp'), from the channel mean or, with `Target(name, baseline)`, another baseline,
    optionally under `interventions` (see `ig_of_prompt`; each prompt runs at its own bucket
    length, `batch.single(i)`, so position masks in them must have that length).

    `rule`: `FixedRule(kind, steps)` ('left', the published rule and the default, with 256 steps;
    'midpoint', 'gauss' or 'right'), or `AdaptiveRule(tolerance, max_evaluations, ...)`: each
    layer refined until its certified completeness bound is at most its tolerance (one value,
    or one per layer) times max(|F(x) - F(b)|, FLOOR_SHARE |F(x)|, atol), or it has used
    `max_evaluations` gradient evaluations (then `converged` is False for it;
    `jaxdepth.analyses.ig.rules`). `execution` (a `jaxdepth.Execution`, with a progress bar by
    default): `nonfinite` 'raise' (default) stops at the first prompt with a NaN
    or infinite F or attribution, naming its layers and positions (`NonFiniteAttributionError`),
    'warn' warns and goes on; `on_layer()` is called as each layer of each prompt finishes;
    `backward` 'auto' (default), 'stored' or 'recompute', as `jaxdepth.integrated_gradients`,
    the numbers the same either way to float32 rounding; `chunk_size`, `memory_budget`.
    `padding`: the length each prompt runs at (`ig_lengths`): 'cost' (default) by what padding
    costs against the compilations it saves on this device, 'buckets' the batch's length
    buckets, or lengths of your own (a `LengthBuckets`, a `ChosenLengths`); the numbers the same
    to float32 rounding. The result's `settings` say the rule, the baseline and the target."""
    target = as_target(target)
    rule = rules.as_rule(rule)
    L, P, T = config.num_layers, len(batch), batch.tokens.shape[1]
    adaptive = isinstance(rule, rules.AdaptiveRule)
    if adaptive:
        rule.tolerances(L)  # a tolerance per layer: as many as the layers
    warn_if_zero_baseline_diverges(target.baseline, target.site)
    attributions = np.zeros((P, L, T), np.float32)
    f_input, f_baseline = np.zeros(P, np.float32), np.zeros((P, L), np.float32)
    evaluations, converged = np.zeros((P, L), np.int64), np.zeros((P, L), bool)
    bound, floored = np.zeros((P, L), np.float32), np.zeros((P, L), bool)
    desc = (
        "adaptive integrated gradients (layers)" if adaptive else f"integrated gradients ({rule.steps} steps, layers)"
    )
    with progress_bar(execution.progress, total=P * L, desc=desc) as bar:

        def layer_done():
            bar.update()
            execution.layer_done()

        each_prompt = execution.replace(progress=False, on_layer=layer_done)
        lengths = ig_lengths(batch, config, rule, padding, execution.memory_budget)
        for i in range(P):
            prompt = batch.prompt(i, lengths)
            Ti = prompt.tokens.shape[1]
            r = ig_of_prompt(
                params,
                prompt,
                config,
                rule=rule,
                target=target,
                interventions=interventions,
                execution=each_prompt,
                label=[i],
            )
            attributions[i, :, :Ti], f_input[i], f_baseline[i] = r.per_position[:, 0], r.f_input[0], r.f_baseline[:, 0]
            evaluations[i] = r.evaluations[:, 0]
            if adaptive:
                converged[i], bound[i], floored[i] = r.converged[:, 0], r.bound[:, 0], r.floored[:, 0]
    if adaptive:
        gap = attributions.astype(np.float64).sum(axis=-1) - (f_input[:, None].astype(np.float64) - f_baseline)
        extra = dict(evaluations=evaluations, converged=converged, bound=bound, floored=floored)
    else:
        gap = attributions.sum(axis=-1) - (f_input[:, None] - f_baseline)
        extra = {}
    return IntegratedGradientsResult(
        attributions=attributions,
        gap=gap.astype(np.float32),
        f_input=f_input,
        f_baseline=f_baseline,
        tokens=batch.tokens,
        lengths=batch.lengths,
        answer_start=batch.answer_start,
        settings={
            **rule.settings(),
            "baseline": target.baseline,
            **({} if target.name == "layer" else {"target": target.name}),
        },
        **extra,
    )


# ----------------------------------------------------------------------------- figures


_IG_ROWS = {
    "layer": r"layer l (output $h_{l+1}$)",
    "attn": r"layer l (attention output $a_l$)",
    "mlp": r"layer l (MLP output $m_l$)",
}


def relative_gaps(result: IntegratedGradientsResult, prompt: int = 0) -> np.ndarray:
    """`[L]` each layer's |completeness gap| / |F(x) - F(b_l)| of one prompt (NaN where F did not
    move): the share of the effect that the attributions fail to account for."""
    from jaxdepth.analyses import drawing as d

    p = d.prompt_index(result, prompt)
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = np.abs(result.gap[p]) / np.abs(result.f_input[p] - result.f_baseline[p])
    return np.where(np.isfinite(relative), relative, np.nan)


def _ig_caption(result: IntegratedGradientsResult, p: int, name: str = "integrated gradients") -> str:

    relative = relative_gaps(result, p)
    share = (
        f", up to {100 * np.nanmax(relative):.3g}% of |F(x) \N{MINUS SIGN} F(b)|" if np.isfinite(relative).any() else ""
    )
    gap = f"max |completeness gap| = {np.nanmax(np.abs(result.gap[p])):.3g}{share}"
    converged = getattr(result, "converged", None)  # the adaptive rule's result
    if converged is not None:
        return (
            f"{name}, {result.rule}: {int(converged[p].sum())} of {converged.shape[1]} layers converged, "
            f"{int(result.evaluations[p].sum())} gradient evaluations; {gap}"
        )
    return f"{name}, {result.rule}: {gap}"


def integrated_gradients_panel(result: IntegratedGradientsResult, prompt: int = 0, *, tokenizer=None) -> "TokenPanel":
    """The IG heatmap of one prompt as a `TokenPanel` (see `integrated_gradients_figure`)."""
    from jaxdepth.analyses import drawing as d

    d.expect(result, IntegratedGradientsResult, "integrated_gradients_panel")
    p = d.prompt_index(result, prompt)
    converged = getattr(result, "converged", None)  # the adaptive rule's result
    n = int(result.lengths[p])
    return d.TokenPanel(
        result.attributions[p, :, :n],
        d.token_labels(result.tokens[p, :n], tokenizer),
        row_label=_IG_ROWS[result.settings.get("target", "layer")],
        answer_start=int(result.answer_start[p]),
        cmap="RdBu_r",
        symmetric=True,
        colorbar_label="attribution to F (answer probability)",
        caption=_ig_caption(result, p),
        flagged_rows=tuple(np.flatnonzero(~converged[p])) if converged is not None else (),
        flag_label="not converged (budget spent)",
    )


def integrated_gradients_figure(
    result: IntegratedGradientsResult, prompt: int = 0, *, tokenizer=None, title: Optional[str] = None
) -> Figure:
    """Integrated-gradients attribution of the answer probability to each token of each layer's
    output, for one prompt (diverging colours centred at 0), and beside it each layer's
    completeness gap as a share of what F moved, |gap_l| / |F(x) - F(b_l)|: a layer whose gap is
    large had too few integration steps, and its attributions are not to be trusted. The title
    names the rule and steps and gives the largest |completeness gap| over layers."""
    from jaxdepth.analyses import drawing as d

    p = d.prompt_index(result, prompt)
    panel = dataclasses.replace(integrated_gradients_panel(result, p, tokenizer=tokenizer), caption="")
    width, height = d.panel_size(panel)
    fig = d.new_figure(width + _GAP_PANEL_WIDTH, height)
    grid = fig.add_gridspec(1, 2, width_ratios=[width, _GAP_PANEL_WIDTH])
    heatmap = fig.add_subplot(grid[0])
    d.draw_token_panel(fig, heatmap, panel)  # the heatmap and its colour bar come first in fig.axes
    _draw_gap_panel(fig.add_subplot(grid[1], sharey=heatmap), result, p)
    d.title_figure(fig, _ig_caption(result, p, f"Integrated gradients, prompt {p}"), title, result.settings)
    return fig


_GAP_PANEL_WIDTH = 1.8  # inches beside the IG heatmap


def _draw_gap_panel(ax, result: IntegratedGradientsResult, p: int):
    """Bars of `relative_gaps` in percent, one per layer, on the heatmap's layer axis; the worst
    is written out, and the adaptive rule's tolerance is a dashed line."""
    percent = 100 * relative_gaps(result, p)
    layers = np.arange(len(percent))
    rows = ax.get_ylim()  # the heatmap's: bars must not widen the shared layer axis
    ax.barh(layers, np.nan_to_num(percent), height=0.7, color="0.35")
    ax.set_ylim(rows)
    ax.set_xlabel("|completeness gap|\n% of |F(x) \N{MINUS SIGN} F(b)|")
    ax.tick_params(labelleft=False)
    ax.set_title("completeness", fontsize=10)
    rule = result.rule
    tolerance = rule.uniform_tolerance if isinstance(rule, rules.AdaptiveRule) else None
    if getattr(result, "converged", None) is not None and tolerance is not None:
        ax.axvline(100 * tolerance, color="C3", linestyle="--", linewidth=1, label="tolerance")
        ax.legend(loc="lower right", fontsize=7, framealpha=0.8)
    if np.isfinite(percent).any():
        worst = int(np.nanargmax(percent))
        ax.set_xlim(0, max(1.25 * percent[worst], 1.0))
        ax.annotate(
            f"{percent[worst]:.3g}%",
            (percent[worst], worst),
            xytext=(2, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
        )
    ax.grid(axis="x", alpha=0.3)


# ----------------------------------------------------------------------------- in the suite


def _check_budget(n: int) -> int:
    if n < 3:
        raise ValueError(f"{n} is too few: the adaptive rule needs at least 3 (one Simpson interval)")
    return n


def _evaluation_budget(text: str) -> int:
    """`--ig-max-evaluations`: an integer >= 3 (one Simpson interval)."""
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None
    return _check_budget(n)


@dataclasses.dataclass(frozen=True, kw_only=True)
class IGSettings(Settings):
    """The studies' integrated gradients in a study (`Settings` and its options). `ig_baseline`
    is a setting but not an option of the command line."""

    ig_steps: int = option(rules.DEFAULT_STEPS, "integration steps (default 256, the studies')")
    ig_rule: str = option(
        "left",
        "quadrature: left Riemann (default, the published rule), midpoint, Gauss-Legendre (all --ig-steps "
        "nodes), or adaptive: nodes placed per layer until a certified completeness bound is below "
        "--ig-tolerance (its figure marks layers that did not get there within the budget)",
        choices=rules.RULES,
    )
    ig_tolerance: float = option(
        rules.DEFAULT_TOLERANCE,
        "--ig-rule adaptive: the completeness bound to reach, relative to |F(x) - F(b)|, or to a tenth of "
        "|F(x)| where F moves less along the path (default 0.01)",
    )
    ig_max_evaluations: Optional[int] = option(
        None,
        "--ig-rule adaptive: gradient evaluations per layer at most; a layer that has not reached "
        "--ig-tolerance by then is reported as not converged (default: --ig-steps, never more than the fixed rule)",
        parse=_evaluation_budget,
        metavar="N",
    )
    ig_target: str = option(
        "layer",
        "integrated gradients with respect to each layer's output h_{l+1} (default), its attention output a_l "
        "or its MLP output m_l",
        choices=tuple(TARGETS),
    )
    ig_padding: str = option(
        "cost",
        "the length each prompt's integrated gradients run at: 'cost' (default) pads by what padding costs "
        "against the compilations it saves on this device (about each prompt's own length on a CPU), "
        "'buckets' to --length-buckets; the numbers are the same either way",
        choices=PADDINGS,
    )
    ig_baseline: str = "channel_mean"

    def __post_init__(self):
        super().__post_init__()
        if self.ig_baseline not in BASELINES:
            raise ValueError(f"ig_baseline must be one of {', '.join(BASELINES)}; got {self.ig_baseline!r}")
        if self.ig_max_evaluations is not None:
            _check_budget(self.ig_max_evaluations)
        self.rule  # the rule checks itself: a tolerance <= 0 is refused here, not when the study runs

    def warnings(self) -> list[str]:
        """A budget of evaluations given to a fixed rule, which ignores it."""
        if self.ig_max_evaluations is not None and self.ig_rule != "adaptive":
            return [f"--ig-max-evaluations applies to --ig-rule adaptive only; ignored with --ig-rule {self.ig_rule}"]
        return []

    @property
    def rule(self) -> rules.Rule:
        """The rule the options name: `--ig-rule` with `--ig-steps`, or the adaptive rule with
        `--ig-tolerance` and `--ig-max-evaluations` (by default `--ig-steps`, at least 3)."""
        if self.ig_rule != "adaptive":
            return rules.FixedRule(self.ig_rule, self.ig_steps)
        return rules.rule_of("adaptive", self.ig_steps, self.ig_tolerance, self.ig_max_evaluations)


def _ig_identity(s: IGSettings) -> dict:
    return {
        "detail_prompts": s.detail_prompts,
        # an adaptive rule's steps are its own: its tolerance and budget say what it ran
        **{f"ig_{name}": value for name, value in s.rule.identity().items()},
        "ig_baseline": s.ig_baseline,
        # only when not the default: earlier results stay valid
        **({} if s.ig_target == "layer" else {"ig_target": s.ig_target}),
    }


def _run_ig(x) -> IntegratedGradientsResult:
    s, m = x.settings, x.model
    return integrated_gradients_of_answers(
        m.params,
        x.batch,
        m.config,
        rule=s.rule,
        target=Target(s.ig_target, s.ig_baseline),
        execution=Execution(memory_budget=s.memory_budget, progress=x.progress),
        padding=s.ig_padding,
    )


PREVIEW_GAP = 0.05  # a larger completeness gap, as a share of |F(x) - F(b)|, is called a preview


def _ig_summary(r: IntegratedGradientsResult) -> list:
    """The run's summary of IG: the rule, and its largest completeness gap as a share of what F
    moved (as the figure gives it) with the layer it is in; above `PREVIEW_GAP` the attributions
    are called a preview, with the options that make them a measurement."""
    line = [f"IG ({r.rule}): {_worst_gap(r)}"]
    if r.converged is not None:
        line.append(
            f"adaptive IG: {int(r.converged.sum())} of {r.converged.size} layers converged, "
            f"{int(r.evaluations.sum())} gradient evaluations"
        )
    return line


def _worst_gap(r: IntegratedGradientsResult) -> str:
    """The largest |completeness gap| / |F(x) - F(b)| over prompts and layers, where it is, and
    whether the attributions are a preview (`_ig_summary`)."""
    with np.errstate(invalid="ignore"):
        relative = np.abs(r.relative_gap)
    if not np.isfinite(relative).any():  # F did not move along any path: no share to give
        return f"max |completeness gap| {np.abs(r.gap).max():.2g} (F(x) = F(b) on every path)"
    prompt, layer = np.unravel_index(np.nanargmax(np.where(np.isfinite(relative), relative, np.nan)), relative.shape)
    where = f"layer {layer}" + (f", prompt {prompt}" if len(relative) > 1 else "")
    text = f"completeness gap up to {100 * relative[prompt, layer]:.3g}% of |F(x)-F(b)| ({where})"
    if r.converged is not None:  # the adaptive rule certifies each layer it converged on; the others are in doubt
        if r.converged.all():
            return text
        return f"{text}, a preview where a layer did not converge (a larger --ig-max-evaluations)"
    if relative[prompt, layer] <= PREVIEW_GAP:
        return text
    return f"{text}: a preview, not a measurement (use --ig-rule adaptive or more --ig-steps)"


ANALYSIS = Analysis(
    name="integrated_gradients",
    result_type=IntegratedGradientsResult,
    settings=IGSettings,
    identity=_ig_identity,
    run=_run_ig,
    figures=per_prompt_figures(integrated_gradients_figure),
    summary=_ig_summary,
    panel=integrated_gradients_panel,
    detail=True,
)
