"""How an analysis joins the suite: everything the shell needs, declared in the analysis's module.

An analysis of the suite is one module: its computation, its result type, its figures, and an
`Analysis` that declares them with its name, its settings, its cache identity, how it runs and
its summary. Its settings are a frozen dataclass that extends `Settings` (the settings every
analysis of a study sees) with fields made by `option`: a default and a help line, from which
`jaxdepth run` derives a command-line option (`--name-with-dashes`) and the study runner the
value the analysis gets. The shell (`jaxdepth.lab`) reads these declarations and nothing else:
the registry lists them, the command line offers their options, the study runner runs, caches
and resumes them, and their own functions draw their figures and sum them up. A plugin declares
the same, in its own module, and gets options and settings like a built-in analysis.

A settings class checks its values in `__post_init__` (a `ValueError` says what is wrong and
with which option), so that the Python API and the command line refuse the same things.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from jaxdepth.core.execution import Execution
from jaxdepth.core.progress import ProgressLike

__all__ = [
    "Analysis",
    "Settings",
    "option",
    "RunInputs",
    "per_prompt_figures",
    "DepthReading",
    "DepthCurve",
    "option_fields",
    "option_flag",
    "parse_option",
]


def option(
    default: Any,
    help: str,
    *,
    choices: Optional[tuple] = None,
    parse: Optional[Callable[[str], Any]] = None,
    metavar: Optional[str] = None,
):
    """A field of an analysis's settings that is also an option of `jaxdepth run`.

    `help`: one line for `--help` (and the reader of the settings class). `choices`: the allowed
    values. `parse`: command-line text -> value (raise `ValueError` with a message on bad text);
    default: the type of `default`, and for a tuple, comma-separated values. A field without a
    default (None) needs `parse`."""
    if parse is None and default is None:
        raise ValueError("an option whose default is None needs parse=")
    metadata = {"help": help, "choices": choices, "parse": parse, "metavar": metavar}
    return dataclasses.field(default=default, metadata={"option": metadata})


def option_fields(settings: type) -> list[dataclasses.Field]:
    """The fields of a settings class made by `option` (its own and those it inherits)."""
    return [f for f in dataclasses.fields(settings) if "option" in f.metadata]


def option_flag(name: str) -> str:
    """The command-line flag of the option field `name`: `ig_steps` -> `--ig-steps`."""
    return "--" + name.replace("_", "-")


def parse_option(field: dataclasses.Field, text: str) -> Any:
    """The value of the option `field` from its command-line text (`option`'s `parse`)."""
    spec = field.metadata["option"]
    if spec["parse"] is not None:
        return spec["parse"](text)
    if isinstance(field.default, tuple):
        return tuple(part.strip() for part in text.split(",") if part.strip())
    return type(field.default)(text)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """What every analysis of a study sees; an analysis's own settings extend it with `option`s.

    num_prompts: prompts per dataset. detail_prompts: the prompts of the per-position sweeps
    (the `detail` analyses: erasure, integrated gradients); None: all. seed: of every random
    choice. memory_budget: bytes a vmapped sweep may hold at once (None: from free memory)."""

    num_prompts: int = 10
    detail_prompts: Optional[int] = None
    seed: int = 123
    memory_budget: Optional[int] = None

    def __post_init__(self):
        for field in option_fields(type(self)):
            choices, value = field.metadata["option"]["choices"], getattr(self, field.name)
            if choices is not None and value not in choices:
                raise ValueError(
                    f"{option_flag(field.name)} must be one of {', '.join(map(str, choices))}; got {value!r}"
                )

    def warnings(self) -> list[str]:
        """Sentences about settings that are valid but will not act as one may expect (an option
        that the others make moot); the command line prints them. None here."""
        return []


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunInputs:
    """What an analysis runs on: the loaded model (`jaxdepth.Model`), the prompts (a
    `jaxdepth.core.batch.PromptBatch`, already cut to the detail prompts for a `detail`
    analysis), its settings (an instance of its declared settings class), the erasure baseline
    prompts (None: the prompts themselves) and how to show progress
    (`jaxdepth.core.progress`: True a tqdm bar, False none, or a tqdm-like callable).
    `execution` is how the analysis runs, from these: the progress and the settings'
    `memory_budget`, as every sweep and driver takes it."""

    model: Any
    batch: Any
    settings: Settings
    baseline_batch: Optional[Any] = None
    progress: ProgressLike = True

    @property
    def execution(self) -> Execution:
        """`Execution(progress=progress, memory_budget=settings.memory_budget)`: the how-to-run
        value an analysis hands its sweeps (its other fields at their defaults)."""
        return Execution(progress=self.progress, memory_budget=self.settings.memory_budget)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Analysis:
    """One analysis of the suite, declared in its own module.

    name: what `--analyses` and the result files call it.
    result_type: its result, a `jaxdepth.core.saved_result.SavedResult` subclass.
    run: `RunInputs` -> the result.
    identity: settings -> the settings that change the result (a cached result is reused when
        these, the model, the prompts and the dataset match).
    figures: (result, tokenizer, detail_prompts) -> `{figure name: matplotlib Figure}`.
    summary: result -> short phrases for the one-line summary of a run.
    settings: its settings class (`Settings` extended with `option` fields), or `Settings`.
    panel: (result, prompt, tokenizer) -> a `jaxdepth.analyses.drawing.TokenPanel` of one
        prompt, for figures that stack several analyses of one prompt (`jaxdepth case`); None
        when it has no per-token view.
    detail: runs on the first `detail_prompts` prompts only (the per-position sweeps).
    uses_baseline: reads the erasure baseline (its prompts enter the cache identity).
    feeds_table: its results enter the effective-depth table.
    default: run when a run names no analyses (`jaxdepth run` without `--analyses`); an analysis
        that is not is still in the suite, run when named. "Built in" is not "run by default":
        the main command does not grow with every analysis the package has.
    depth: result -> a `DepthReading`, what the result says about depth: its effective depths
        (the effective-depth table reads them where `feeds_table`), ratios of the depth and
        per-layer curves (`jaxdepth compare` puts them on one relative-depth axis); None when
        it says nothing of depth. The shell reads results through this, never their fields.
    """

    name: str
    result_type: type
    run: Callable[[RunInputs], Any]
    identity: Callable[[Any], dict]
    figures: Callable[[Any, Any, int], dict]
    summary: Callable[[Any], list]
    settings: type = Settings
    panel: Optional[Callable[..., Any]] = None
    detail: bool = False
    uses_baseline: bool = False
    feeds_table: bool = False
    default: bool = True
    depth: Optional[Callable[[Any], "DepthReading"]] = None

    def __post_init__(self):
        if not (isinstance(self.settings, type) and issubclass(self.settings, Settings)):
            raise TypeError(f"analysis {self.name!r}: settings must be Settings or a subclass of it")
        if self.feeds_table and self.depth is None:
            raise TypeError(f"analysis {self.name!r} feeds the effective-depth table: declare its `depth` reading")


@dataclasses.dataclass(frozen=True)
class DepthCurve:
    """A per-layer measure on the relative-depth axis: `x` the relative depth of each point (a
    boundary l at l / L, a layer l at (l + 0.5) / L), `y` its value (the mean over prompts), and
    how it is drawn: a panel `title`, its `ylabel`, a `log` scale or not."""

    title: str
    ylabel: str
    x: Any
    y: Any
    log: bool = False


@dataclasses.dataclass(frozen=True)
class DepthReading:
    """What a result says about depth, for the shell's tables and comparisons.

    num_layers: L. effective_depths: method -> `jaxdepth.analyses.effective_depth.EffectiveDepth`
    (the table's columns, `cosine`, `kl`, `overlap`); per-prompt depths and bootstrap intervals
    come from `per_prompt` (the result then defines `depth_series`, see
    `jaxdepth.analyses.uncertainty`). ratios: name -> (label, depth / L or None), each shown on
    the comparison's axis of ratios (the effective depths' are named by the analysis too).
    curves: name -> `DepthCurve`."""

    num_layers: int
    effective_depths: dict = dataclasses.field(default_factory=dict)
    ratios: dict = dataclasses.field(default_factory=dict)
    curves: dict = dataclasses.field(default_factory=dict)
    per_prompt: bool = False


def per_prompt_figures(draw: Callable[..., Any]) -> Callable[[Any, Any, int], dict]:
    """`figures` of a per-prompt analysis: `draw(result, i, tokenizer=...)` for each of the first
    `detail_prompts` prompts, named `prompt0`, `prompt1`, ..."""

    def figures(result, tokenizer, detail_prompts):
        count = min(detail_prompts, len(result.lengths))
        return {f"prompt{i}": draw(result, i, tokenizer=tokenizer) for i in range(count)}

    return figures
