"""The tuned lens on disk (`jaxdepth.lab.lens_study`): a training interrupted and resumed from its
orbax checkpoint equals an uninterrupted one, a finished lens is reused, and a folder holding a
lens of other settings, other data or another model is refused."""

import numpy as np
import pytest

from conftest import tiny_config
from jaxdepth.core.execution import Execution
from jaxdepth.analyses import tuned_lens
from jaxdepth.analyses.tuned_lens import LensTrainingSettings
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import random_params
from jaxdepth.lab.lens_study import load_tuned_lens, train_resumably, trained_lens

from jaxdepth.core.batch import make_batch

CONFIG = tiny_config(num_kv_heads=4)
SETTINGS = LensTrainingSettings(steps=6, tokens_per_step=32, learning_rate=1e-2, warmup=2, checkpoint_every=2)


def prompts(seed, count, length=24):
    rng = np.random.default_rng(seed)
    return make_batch([rng.integers(0, 97, length - i).tolist() for i in range(count)], [length // 2] * count)


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, 1, scale=0.2)


@pytest.fixture(scope="module")
def data(params):
    return tuned_lens.residual_tokens(params, prompts(0, 12), CONFIG, execution=Execution())


def test_resumed_training_equals_uninterrupted(params, data, tmp_path):
    whole, whole_losses = tuned_lens.train_tuned_lens(params, data, CONFIG, SETTINGS, execution=Execution())
    folder = str(tmp_path / "lens")
    # Interrupted after step 3: the last checkpoint is step 2 (every 2 steps), so step 3 is redone.
    _, first = train_resumably(params, data, CONFIG, SETTINGS, folder, stop_after=3, execution=Execution())
    assert trained_lens(folder, CONFIG, SETTINGS) is None  # unfinished
    resumed, rest = train_resumably(params, data, CONFIG, SETTINGS, folder, execution=Execution())
    assert len(first) == 3 and len(rest) == 4  # resumed at step 2, not from scratch
    np.testing.assert_array_equal(np.concatenate([first[:2], rest]), whole_losses)
    assert first[2] == rest[0]  # the redone step is the same step
    for key in ("weight", "bias"):
        np.testing.assert_array_equal(np.asarray(resumed.translators()[key]), np.asarray(whole.translators()[key]))
    loaded = trained_lens(folder, CONFIG, SETTINGS)  # finished: reused as it is
    for key in ("weight", "bias"):
        np.testing.assert_array_equal(np.asarray(loaded.translators()[key]), np.asarray(whole.translators()[key]))
    assert np.any(np.asarray(loaded.translators()["weight"]))  # trained, not the identity


def test_bad_inputs(params, data, tmp_path):
    folder = str(tmp_path / "lens")
    train_resumably(params, data, CONFIG, SETTINGS, folder, stop_after=2, execution=Execution())
    with pytest.raises(ValueError, match="other settings"):
        train_resumably(params, data, CONFIG, LensTrainingSettings(steps=7), folder, execution=Execution())
    with pytest.raises(ValueError, match="other data"):  # a lens is never reused on other prompts
        trained_lens(folder, CONFIG, SETTINGS, {"train_tokens_sha": "another"})
    with pytest.raises(FileNotFoundError, match="no tuned lens"):
        load_tuned_lens(str(tmp_path / "nowhere"), CONFIG)
    other = ModelConfig.from_dict({**CONFIG.to_dict(), "num_layers": 5})
    with pytest.raises(ValueError, match="do not fit"):
        load_tuned_lens(folder, other)


def test_the_decision_depth_reads_a_trained_lens_from_its_folder(params, data, tmp_path):
    """`--decision-lens FOLDER`: the suite's decision depth through the lens trained there equals
    `decision_depth` with its translators, differs from the logit lens's, and a lens retrained
    in the folder changes the result's identity."""
    from types import SimpleNamespace

    from jaxdepth.analyses.decision_depth import ANALYSIS, decision_depth, lens_identity
    from jaxdepth.analyses.suite import RunInputs

    folder = str(tmp_path / "lens")
    lens, _ = train_resumably(params, data, CONFIG, SETTINGS, folder, stop_after=2, execution=Execution())
    batch = prompts(3, 4)
    model = SimpleNamespace(params=params, config=CONFIG)
    settings = ANALYSIS.settings(decision_lens=folder)
    through = ANALYSIS.run(RunInputs(model=model, batch=batch, settings=settings, progress=False))
    expected = decision_depth(params, batch, CONFIG, translators=load_tuned_lens(folder, CONFIG).translators())
    assert np.array_equal(through.depth, expected.depth) and through.settings["lens"] == "tuned"
    assert not np.array_equal(through.depth, decision_depth(params, batch, CONFIG).depth)
    before = ANALYSIS.identity(settings)["decision_lens"]
    train_resumably(params, data, CONFIG, SETTINGS, folder, execution=Execution())  # trained on to its last step
    assert ANALYSIS.identity(settings)["decision_lens"] != before and lens_identity("") == ""
