"""The declaration vocabulary (`jaxdepth.analyses.suite`): options, settings, and how the shell
reads them (`jaxdepth.lab.registry.declared_options`, `StudySettings`)."""

from __future__ import annotations

import dataclasses

import pytest

from jaxdepth.analyses.integrated_gradients import IGSettings
from jaxdepth.analyses.layer_skip import LayerSkipSettings
from jaxdepth.analyses.suite import Analysis, Settings, option, option_fields, option_flag, parse_option
from jaxdepth.lab.registry import ANALYSES, declared_options
from jaxdepth.lab.study import StudySettings


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToySettings(Settings):
    toy_mode: str = option("a", "toy: a or b", choices=("a", "b"))
    toy_sizes: tuple = option((1, 2), "toy: sizes", parse=lambda text: tuple(int(x) for x in text.split(",")))
    toy_names: tuple = option(("x", "y"), "toy: names")
    toy_scale: float = option(1.0, "toy: scale")
    plain: int = 3  # a setting, not an option


def _toy(name="toy", settings=ToySettings):
    return Analysis(
        name=name,
        result_type=object,
        settings=settings,
        run=lambda x: None,
        identity=lambda s: {},
        figures=lambda r, t, n: {},
        summary=lambda r: [],
    )


def test_options_are_the_option_fields_and_parse_as_declared():
    fields = {f.name: f for f in option_fields(ToySettings)}
    assert list(fields) == ["toy_mode", "toy_sizes", "toy_names", "toy_scale"]  # not `plain`, nor the common ones
    assert parse_option(fields["toy_sizes"], "4,5") == (4, 5)
    assert parse_option(fields["toy_names"], "p, q,") == ("p", "q")  # a tuple default: comma-separated
    assert parse_option(fields["toy_scale"], "2.5") == 2.5
    assert option_flag("toy_scale") == "--toy-scale"
    with pytest.raises(ValueError, match="needs parse="):
        option(None, "no way to read it")


def test_settings_refuse_a_value_outside_the_choices_and_their_own_checks():
    with pytest.raises(ValueError, match="--toy-mode must be one of a, b; got 'c'"):
        ToySettings(toy_mode="c")
    with pytest.raises(ValueError, match="--skip-sublayers takes layer, attn, mlp"):
        LayerSkipSettings(skip_sublayers=("heads",))
    with pytest.raises(ValueError, match="--skip-split applies to --skip-mode future"):
        LayerSkipSettings(skip_mode="current", skip_split="answer_start")
    with pytest.raises(ValueError, match="at least 3"):
        IGSettings(ig_rule="adaptive", ig_max_evaluations=2)
    assert IGSettings(ig_max_evaluations=9).warnings() == [
        "--ig-max-evaluations applies to --ig-rule adaptive only; ignored with --ig-rule left"
    ]
    assert IGSettings(ig_rule="adaptive", ig_max_evaluations=9).warnings() == []


def test_an_analysis_needs_a_settings_class_extending_settings():
    with pytest.raises(TypeError, match="settings must be Settings or a subclass"):
        _toy(settings=dict)


def test_two_declarations_of_one_option_name_are_refused_one_shared_is_not():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Other(Settings):
        toy_mode: str = option("a", "another toy_mode")

    assert list(declared_options([_toy("one"), _toy("two")])) == ["toy_mode", "toy_sizes", "toy_names", "toy_scale"]
    with pytest.raises(ValueError, match="the analyses 'one' and 'two' both declare an option 'toy_mode'"):
        declared_options([_toy("one"), _toy("two", Other)])
    assert {"ig_steps", "skip_mode", "lens_weighting"} <= set(declared_options(ANALYSES.values()))


def test_study_settings_give_each_analysis_its_own_and_refuse_unknown_options():
    study = StudySettings(seed=7, num_prompts=3, options={"ig_steps": 8, "skip_mode": "current"})
    ig = study.for_analysis(ANALYSES["integrated_gradients"])
    assert isinstance(ig, IGSettings) and (ig.ig_steps, ig.seed, ig.num_prompts) == (8, 7, 3)
    skip = study.for_analysis(ANALYSES["layer_skip"])
    assert isinstance(skip, LayerSkipSettings) and skip.skip_mode == "current" and not hasattr(skip, "ig_steps")
    plain = study.for_analysis(ANALYSES["erasure"])
    assert type(plain) is Settings and plain.seed == 7
    with pytest.raises(ValueError, match=r"unknown options \['ig_stepz'\]"):
        StudySettings(options={"ig_stepz": 8}).check([ANALYSES["integrated_gradients"]])
    with pytest.raises(ValueError, match=r"unknown options \['seed'\]"):  # a common setting, not an option
        StudySettings(options={"seed": 5}).check([ANALYSES["integrated_gradients"]])
    assert study.for_analysis(ANALYSES["integrated_gradients"]).ig_baseline == "channel_mean"
    assert StudySettings(options={"ig_baseline": "zero"}).check([ANALYSES["integrated_gradients"]])[0].ig_baseline == (
        "zero"
    )  # a setting that is not a command-line option is still one of the analysis's own
    with pytest.raises(ValueError, match="--skip-mode must be one of future, current"):
        StudySettings(options={"skip_mode": "past"}).check([ANALYSES["layer_skip"]])
