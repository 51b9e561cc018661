"""The analysis registry: a new analysis defined outside the package runs, caches, resumes and
draws through the study runner with no edit to it; layer skip is one result with a sublayer axis."""

from __future__ import annotations

import dataclasses

import os

import numpy as np
import pytest

from jaxdepth.analyses import layer_skip
from jaxdepth.core.batch import make_batch
from jaxdepth.core.config import ModelConfig
from jaxdepth.lab.loaded_model import Model
from jaxdepth.core.model import random_params
from jaxdepth.lab.registry import ANALYSES, Analysis, register
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.lab.results import load_result
from jaxdepth.lab.study import (
    StudyPrompts,
    StudyRun,
    StudySettings,
    model_results_key,
    result_folder,
    run_study,
    write_figures,
)

CONFIG = ModelConfig(
    model_type="llama",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=4,
    head_dim=8,
    rope_theta=1e4,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    qkv_bias=False,
)


@pytest.fixture(scope="module")
def model():
    return Model(params=random_params(CONFIG, 0, scale=0.2), config=CONFIG, tokenizer=None, source="tiny")


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    return make_batch([rng.integers(0, 97, 30).tolist(), rng.integers(0, 97, 23).tolist()], [20, 15])


@dataclasses.dataclass
class TokenCountResult(SavedResult):
    counts: np.ndarray
    settings: dict


@pytest.fixture
def token_count():
    """A user-defined analysis: valid tokens per prompt, times a setting that enters its identity."""
    calls = []

    def run(inputs):
        calls.append(len(inputs.batch))
        return TokenCountResult(counts=inputs.batch.valid.sum(axis=1) * inputs.settings.seed, settings={})

    def figures(result, tokenizer, detail_prompts):
        from jaxdepth.analyses.drawing import new_figure

        fig = new_figure(3, 2)
        fig.add_subplot().bar(np.arange(len(result.counts)), result.counts)
        return {"": fig}

    entry = register(
        Analysis(
            name="token_count",
            result_type=TokenCountResult,
            identity=lambda s: {"seed": s.seed},
            run=run,
            figures=figures,
            summary=lambda r: [f"tokens {int(r.counts.sum())}"],
        )
    )
    yield entry, calls
    ANALYSES.pop("token_count")


def test_a_registered_analysis_runs_caches_and_draws(model, batch, token_count, tmp_path):
    entry, calls = token_count
    with pytest.raises(ValueError, match="already registered"):
        register(entry)
    logs = []
    settings = StudySettings(seed=3)
    first = run_study(
        model,
        "tiny",
        StudyPrompts("toy", batch),
        str(tmp_path),
        analyses=["token_count"],
        settings=settings,
        run=StudyRun(log=logs.append),
    )
    np.testing.assert_array_equal(first["token_count"].counts, [30 * 3, 23 * 3])
    folder = result_folder(str(tmp_path), model_results_key(model, "tiny")[0], "toy")
    saved = load_result(os.path.join(folder, "token_count.npz"))
    assert isinstance(saved, TokenCountResult) and saved.settings["identity"]["seed"] == 3
    again = run_study(
        model,
        "tiny",
        StudyPrompts("toy", batch),
        str(tmp_path),
        analyses=["token_count"],
        settings=settings,
        run=StudyRun(log=logs.append),
    )
    assert calls == [2] and logs[-1].startswith("token_count: reusing")  # resumed, not recomputed
    np.testing.assert_array_equal(again["token_count"].counts, first["token_count"].counts)
    run_study(
        model,
        "tiny",
        StudyPrompts("toy", batch),
        str(tmp_path),
        analyses=["token_count"],
        settings=StudySettings(seed=4),
        run=StudyRun(log=logs.append),
    )
    assert calls == [2, 2]  # a setting in its identity changed: computed again
    paths = write_figures(again, str(tmp_path))
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["token_count.pdf", "token_count.png"]
    with pytest.raises(ValueError, match="unknown analysis 'nope'"):
        run_study(model, "tiny", StudyPrompts("toy", batch), str(tmp_path), analyses=["nope"])


def test_layer_skip_is_one_result_with_a_sublayer_axis(model, batch, tmp_path):
    both = layer_skip.layer_skip_sublayers(model.params, batch, CONFIG, sublayers=["attn", "layer"])
    assert both.later.shape == (2, 3, 3) and both.later_per_prompt.shape == (2, 2, 3, 3)
    for sublayer in ("attn", "layer"):
        alone = layer_skip.layer_skip(model.params, batch, CONFIG, layer_skip.Skip(sublayer=sublayer))
        part = both.part(sublayer)
        for name in ("later", "output", "later_per_prompt", "output_per_prompt", "split_positions"):
            np.testing.assert_array_equal(getattr(part, name), getattr(alone, name), err_msg=f"{sublayer} {name}")
        assert part.settings["sublayer"] == sublayer
    assert list(both.parts()) == ["attn", "layer"]
    with pytest.raises(KeyError, match="mlp"):
        both.part("mlp")
    back = load_result(both.save(str(tmp_path / "layer_skip.npz")))
    assert back.sublayers == ["attn", "layer"]
    np.testing.assert_array_equal(back.later, both.later)
    with pytest.raises(ValueError, match="distinct names"):
        layer_skip.layer_skip_sublayers(model.params, batch, CONFIG, sublayers=["attn", "attn"])


def test_every_analysis_of_the_package_is_in_the_suite_and_the_main_run_does_not_grow():
    """The package's own analyses are all registered (none only as a plugin); a run that names
    none runs those whose declaration says `default`, the studies' seven."""
    import importlib
    import pkgutil

    import jaxdepth.analyses
    from jaxdepth.analyses.suite import Analysis
    from jaxdepth.lab.registry import ANALYSES, BUILT_IN, default_analyses

    declared = set()
    for info in pkgutil.walk_packages(jaxdepth.analyses.__path__, "jaxdepth.analyses."):
        module = importlib.import_module(info.name)
        declared |= {value.name for value in vars(module).values() if isinstance(value, Analysis)}
    assert declared == set(BUILT_IN) and declared <= set(ANALYSES)
    assert default_analyses() == [
        "contributions",
        "logit_lens",
        "layer_skip",
        "erasure",
        "integrated_gradients",
        "attribution_patching",
        "grad_x_act",
    ]
    assert {"decision_depth", "geometry", "jacobians", "layer_structure"} <= set(BUILT_IN) - set(default_analyses())


def test_a_built_in_analysis_named_as_a_plugin_is_the_same_one(capsys):
    """`--plugin jaxdepth.analyses.geometry:ANALYSIS`, as commands wrote before it was built in,
    names the registered object itself: accepted, nothing registered twice."""
    from jaxdepth.analyses import geometry
    from jaxdepth.lab.plugins import load_plugins
    from jaxdepth.lab.registry import ANALYSES

    (plugin,) = load_plugins(["jaxdepth.analyses.geometry:ANALYSIS"])
    assert plugin.error is None and ANALYSES["geometry"] is geometry.ANALYSIS
