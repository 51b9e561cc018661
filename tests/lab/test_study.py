"""The study runner's cache: what enters a result's identity decides when a saved result is
reused, so a result of other weights is never taken for this one's."""

import jax
import jax.numpy as jnp
import pytest

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.batch import make_batch
from jaxdepth.core.model import random_params
from jaxdepth.lab.loaded_model import Model
from jaxdepth.lab.study import StudyPrompts, StudyRun, run_study, saved_model_name


def _tiny():
    config = ModelConfig(
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=1e4,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        qkv_bias=False,
    )
    return Model(random_params(config, 0, scale=0.3), config, None, "tiny")


def test_weights_of_another_dtype_are_not_reused(tmp_path):
    model = _tiny()
    batch = make_batch([[1, 5, 9, 13, 17, 21], [2, 4, 6, 8]])
    logs = []
    run_study(
        model,
        "tiny",
        StudyPrompts("d", batch),
        str(tmp_path),
        analyses=["contributions"],
        run=StudyRun(log=logs.append),
    )
    bf16 = Model(jax.tree.map(lambda p: jnp.asarray(p, jnp.bfloat16), model.params), model.config, None, "tiny")
    run_study(
        bf16, "tiny", StudyPrompts("d", batch), str(tmp_path), analyses=["contributions"], run=StudyRun(log=logs.append)
    )
    run_study(
        bf16, "tiny", StudyPrompts("d", batch), str(tmp_path), analyses=["contributions"], run=StudyRun(log=logs.append)
    )
    mixed = model.with_matmul_dtype("bfloat16")  # float32 activations, bf16 weight matrices
    run_study(
        mixed,
        "tiny",
        StudyPrompts("d", batch),
        str(tmp_path),
        analyses=["contributions"],
        run=StudyRun(log=logs.append),
    )
    assert ["reusing" in line for line in logs] == [False, False, True, False]


def test_saved_model_names():
    assert saved_model_name("org/m") == saved_model_name("org/m", "float32") == "org/m"
    assert saved_model_name("org/m", "bfloat16") == "org/m-bfloat16"
    assert saved_model_name("org/m", "bf16-matmuls") == "org/m-bf16-matmuls"


def test_the_old_keywords_are_refused_with_the_values_that_hold_them(tmp_path):
    """run_study takes its prompts (`StudyPrompts`) and how it runs (`StudyRun`) as values: a
    keyword it once took on its own is refused with where it lives now."""
    model = _tiny()
    batch = make_batch([[1, 5, 9, 13]])
    prompts = StudyPrompts("d", batch)
    for old, where in (
        ({"progress": False}, r"progress in run=StudyRun\(progress=\.\.\.\)"),
        ({"log": print}, r"log in run=StudyRun\(log=\.\.\.\)"),
        ({"baseline_batch": batch}, r"baseline_batch in prompts=StudyPrompts\(dataset, batch, baseline=\.\.\.\)"),
        ({"baseline_name": "x"}, r"baseline_name in prompts=StudyPrompts"),
    ):
        with pytest.raises(TypeError, match=where):
            run_study(model, "tiny", prompts, str(tmp_path), analyses=["contributions"], **old)
    with pytest.raises(TypeError, match=r"takes the prompts as one value: StudyPrompts\(dataset, batch\)"):
        run_study(model, "tiny", "d", str(tmp_path), analyses=["contributions"])


def test_run_inputs_give_the_execution_of_their_progress_and_memory_budget():
    """An analysis hands its sweeps `inputs.execution`: the run's progress and the settings'
    memory budget, the other fields at their defaults."""
    from jaxdepth.analyses.suite import RunInputs, Settings
    from jaxdepth.core.execution import Execution

    inputs = RunInputs(model=None, batch=None, settings=Settings(memory_budget=1 << 20), progress=False)
    assert inputs.execution == Execution(progress=False, memory_budget=1 << 20)
    assert inputs.progress is False and inputs.settings.memory_budget == 1 << 20  # still read by analyses
    assert RunInputs(model=None, batch=None, settings=Settings()).execution == Execution(progress=True)
