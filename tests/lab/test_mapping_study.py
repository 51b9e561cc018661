"""`jaxdepth map` end to end on tiny converted checkpoints sharing a trained tokenizer: result and
heatmap written, the inserted identity layer found, a rerun reusing the result, and clear errors
for tokenizers that disagree."""

import argparse
import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

import jaxdepth
from conftest import save_tiny_checkpoint, tiny_tokenizer, model_dir
from conversion.checkpoint import save_converted
from jaxdepth.lab import mapping_study
from jaxdepth.analyses.layer_mapping import LayerMappingResult
from jaxdepth.lab.mapping_study import (
    MappingPrompts,
    MappingRun,
    MappingSettings,
    map_models,
    mapping_figure,
    mapping_folder,
)
from jaxdepth.lab.prompts import load_prompts

INSERTED_AT = 1  # the large model is the small one with an identity layer before layer 1


def with_identity_layer(model, k: int):
    """`model` (3 layers) with a layer before layer k whose attention output projection and MLP
    down projection are zero: 4 layers, boundary k+1 equal to boundary k."""

    def insert(name, w):
        inserted = w[k][None] * (0.0 if name in ("o", "down") else 1.0)
        return jnp.concatenate([w[:k], inserted, w[k:]], axis=0)

    params = {**model.params, "layers": {n: insert(n, w) for n, w in model.params["layers"].items()}}
    return dataclasses.replace(
        model,
        params=params,
        source="tiny-deeper",
        config=dataclasses.replace(model.config, num_layers=model.config.num_layers + 1),
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Folders of the small tiny model and of its copy with an identity layer (same tokenizer)."""
    root = tmp_path_factory.mktemp("mapping")
    small = save_tiny_checkpoint(str(root / "small"), context=1024)
    large = save_converted(with_identity_layer(jaxdepth.load(small), INSERTED_AT), str(root / "large"))
    return small, large


def parser():
    p = argparse.ArgumentParser(prog="jaxdepth")
    mapping_study.add_parser(p.add_subparsers(dest="command", required=True))
    return p


def map_args(small, large, out, *extra):
    return [
        "map",
        small,
        large,
        "--dataset",
        "default",
        "--prompts",
        "9",
        "--train-prompts",
        "7",
        "--out",
        str(out),
        *extra,
    ]


def test_map_command_end_to_end_and_rerun(checkpoints, tmp_path, capsys):
    small, large = checkpoints
    args = parser().parse_args(map_args(small, large, tmp_path))
    assert args.func(args) == 0
    keys = [model_dir(tmp_path, source).name for source in (small, large)]
    folder = mapping_folder(str(tmp_path), *keys, "default")
    # each model named by its folder's name and its fingerprint
    assert folder == os.path.join(str(tmp_path), f"{keys[0]}__{keys[1]}", "default") and os.path.isdir(folder)
    assert [k.rsplit("-", 1)[0] for k in keys] == ["small", "large"]
    path = os.path.join(folder, "layer_mapping.npz")
    for name in ("layer_mapping.png", "layer_mapping.pdf"):
        assert os.path.getsize(os.path.join(folder, name)) > 1000
    printed = capsys.readouterr().out
    assert "best large boundary per small boundary m: 0:0 1:1 2:3 3:4" in printed

    result = LayerMappingResult.load(path)
    assert result.errors.shape == (4, 5) and (result.small_layers, result.large_layers) == (3, 4)
    m = np.arange(4)
    np.testing.assert_array_equal(result.best_match, np.where(m <= INSERTED_AT, m, m + 1))
    # ridge 1e-3 shrinks the exact copies a little; every other pair is far off
    assert np.all(result.errors[m, result.best_match] < 0.02), result.errors
    assert (result.train_prompts, result.heldout_prompts) == (7, 2)
    assert result.train_tokens > 200 and result.heldout_tokens > 30  # position 0 of each prompt left out
    assert result.settings["identity"]["settings"] == {"train_prompts": 7, "ridge": 1e-3, "first_position": 1}

    # the same command again: the saved result is reused, not recomputed
    mtime = os.path.getmtime(path)
    assert args.func(args) == 0
    assert f"layer mapping: reusing {path}" in capsys.readouterr().out
    assert os.path.getmtime(path) == mtime
    # another setting is another result
    args = parser().parse_args(map_args(small, large, tmp_path, "--ridge", "0.01"))
    assert args.func(args) == 0
    assert "reusing" not in capsys.readouterr().out
    assert LayerMappingResult.load(path).settings["ridge"] == 0.01


def test_the_split_must_leave_held_out_prompts(checkpoints, tmp_path):
    small, large = checkpoints
    args = parser().parse_args(map_args(small, large, tmp_path, "--train-prompts", "9"))
    with pytest.raises(ValueError, match="held out"):
        args.func(args)


@pytest.fixture(scope="module")
def small_model(checkpoints):
    return jaxdepth.load(checkpoints[0])


def test_tokenizers_must_agree(small_model, tmp_path):
    prompts = load_prompts("default", limit=4)
    run = lambda other: map_models(  # noqa: E731
        small_model,
        other,
        MappingPrompts("default", prompts),
        str(tmp_path),
        small_name="a",
        large_name="b",
        settings=MappingSettings(train_prompts=2),
        run=MappingRun(progress=False, log=lambda _: None),
    )
    extra = tiny_tokenizer()
    extra.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="tokenizers differ"):
        run(dataclasses.replace(small_model, tokenizer=extra))

    from tokenizers import processors

    with_bos = tiny_tokenizer()  # the same vocabulary, but every prompt gets a leading <pad>
    with_bos._tokenizer.post_processor = processors.TemplateProcessing(single="<pad> $A", special_tokens=[("<pad>", 0)])
    assert with_bos.get_vocab() == small_model.tokenizer.get_vocab()
    with pytest.raises(ValueError, match="encode to different token ids"):
        run(dataclasses.replace(small_model, tokenizer=with_bos))

    with pytest.raises(ValueError, match="no tokenizer"):
        run(dataclasses.replace(small_model, tokenizer=None))
    assert not os.listdir(tmp_path)  # nothing written


def test_figure_marks_best_matches_and_the_diagonal():
    errors = np.random.default_rng(0).uniform(0.2, 1.0, (3, 7)).astype(np.float32)
    result = LayerMappingResult(
        errors=errors,
        best_match=np.argmin(errors, axis=1),
        baseline_errors=np.ones(7),
        small_model="s",
        large_model="l",
        dataset="d",
        train_tokens=10,
        heldout_tokens=5,
        train_prompts=2,
        heldout_prompts=1,
        settings={},
    )
    ax = mapping_figure(result).axes[0]
    diagonal = next(line for line in ax.get_lines() if line.get_label() == "equal relative depth")
    np.testing.assert_array_equal(diagonal.get_xdata(), [0, 6])
    np.testing.assert_array_equal(diagonal.get_ydata(), [0, 2])
    marks = next(c for c in ax.collections if c.get_label() == "best match of each row")
    np.testing.assert_array_equal(marks.get_offsets(), np.column_stack([result.best_match, np.arange(3)]))


def test_settings_out_of_range_are_refused():
    from jaxdepth.lab.mapping_study import MappingSettings

    for bad in (dict(first_position=-1), dict(ridge=-0.1)):
        with pytest.raises(ValueError, match="must be >= 0"):
            MappingSettings(**bad)


def test_the_old_keywords_are_refused_with_the_values_that_hold_them(small_model, tmp_path):
    """map_models takes its prompts (`MappingPrompts`) and how it runs (`MappingRun`) as values,
    compute_mapping how it runs as an `Execution`: a keyword once taken on its own is refused
    with where it lives now, before anything is encoded or written."""
    from jaxdepth.analyses.layer_mapping import compute_mapping

    prompts = MappingPrompts("default", load_prompts("default", limit=4))
    common = dict(small_name="a", large_name="b", settings=MappingSettings(train_prompts=2))
    for old, where in (
        ({"progress": False}, r"progress in run=MappingRun\(progress=\.\.\.\)"),
        ({"mesh": None}, r"mesh in run=MappingRun\(mesh=\.\.\.\)"),
        ({"figures": False}, r"figures in run=MappingRun\(figures=\.\.\.\)"),
        ({"limit": 4}, r"limit in prompts=MappingPrompts\(dataset, prompts, limit=\.\.\.\)"),
        ({"dataset": "default"}, r"dataset in prompts=MappingPrompts\(dataset, prompts\)"),
    ):
        with pytest.raises(TypeError, match=where):
            map_models(small_model, small_model, prompts, str(tmp_path), **common, **old)
    with pytest.raises(TypeError, match=r"MappingPrompts\(dataset, prompts\), got list"):
        map_models(small_model, small_model, list(prompts.prompts), str(tmp_path), **common)
    with pytest.raises(TypeError, match=r"execution=jaxdepth\.Execution\(progress=False\)"):
        compute_mapping(small_model, small_model, None, None, progress=False)
    assert not os.listdir(tmp_path)  # nothing written
