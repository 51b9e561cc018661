"""Depth use by layer kind: each config's layers fall in the kinds they are (checked by index on
the tiny variants' Hugging Face configs), the split measures are the source curves at those
layers exactly (a curve of boundaries: its change across each layer), the refusals say why, and
`jaxdepth compare` on a tiny hybrid's run writes the figure and the table from what was saved."""

import json
import os

import numpy as np
import pytest

from conftest import model_dir, results_folder, save_tiny_checkpoint, tiny_config, tiny_hf_config, tiny_moe_config
from jaxdepth.analyses.suite import DepthCurve
from jaxdepth.core.config import ModelConfig
from jaxdepth.lab.cli import main
from jaxdepth.lab.depth_comparison import DepthProfile, depth_profiles
from jaxdepth.lab.kind_comparison import (
    kind_comparison,
    kind_figure,
    kinds_markdown,
    layer_kinds,
    layer_splits,
    split_by_kind,
)
from jaxdepth.lab.registry import ANALYSES
from jaxdepth.lab.results import MODEL_CONFIG, load_result, saved_model_config, save_model_config

LIN, FULL = "linear attention", "full attention"
LINEAR = dict(linear_key_heads=2, linear_value_heads=4, linear_key_dim=8, linear_value_dim=8, linear_conv_kernel=4)


def _from_hf(variant: str) -> ModelConfig:
    config, _ = tiny_hf_config(variant)
    return ModelConfig.from_hf(json.loads(config.to_json_string()))


@pytest.mark.parametrize(
    "variant, split, kinds",
    [
        ("qwen3_5_hybrid", "mixer", (LIN, LIN, FULL, LIN)),  # its layer_types
        ("gemma2_softcapped", "window", ("sliding window", FULL, "sliding window")),
        ("smollm3_nope", "positions", ("rotary positions", "no positions", "rotary positions")),  # interval 2
        ("deepseek_v3_latent", "mlp", ("dense MLP", "mixture of experts")),  # first_k_dense_replace 1
        ("qwen3_moe_experts", "mlp", ("dense MLP", "mixture of experts")),
    ],
)
def test_each_config_splits_its_layers_into_the_kinds_they_are(variant, split, kinds):
    config = _from_hf(variant)
    assert layer_splits(config) == {split: kinds}
    assert layer_kinds(config) == kinds == layer_kinds(config, split)


@pytest.mark.parametrize("variant", ["qwen2_gqa_untied", "mistral_window", "mixtral_experts"])
def test_layers_of_one_kind_are_refused(variant):
    config = _from_hf(variant)  # plain; every layer sliding; every layer sparse
    assert layer_splits(config) == {}
    with pytest.raises(ValueError, match="are of one kind .* there are no kinds to compare"):
        layer_kinds(config)


def test_layers_that_split_two_ways_must_be_told_which():
    config = tiny_moe_config(num_layers=4, dense_layers=(0,), dense_size=32, linear_layers=(1, 2), **LINEAR)
    with pytest.raises(ValueError) as refused:
        layer_kinds(config)
    message = str(refused.value)
    assert "split 2 ways" in message and "choose one (split='mixer' or 'mlp'; `jaxdepth compare --split`)" in message
    assert "(full attention: layers 0, 3; linear attention: layers 1, 2)" in message
    assert "(dense MLP: layer 0; mixture of experts: layers 1, 2, 3)" in message
    assert layer_kinds(config, "mixer") == (FULL, LIN, LIN, FULL)
    assert layer_kinds(config, "mlp") == ("dense MLP",) + ("mixture of experts",) * 3
    with pytest.raises(ValueError, match="do not split by attention window .* they split by mixer"):
        layer_kinds(config, "window")
    with pytest.raises(ValueError, match="no split 'heads'"):
        layer_kinds(config, "heads")


def test_linear_attention_keeps_its_own_kind_beside_sliding_and_full_attention():
    types = ("full", "sliding", "full", "full")
    config = tiny_config(num_layers=4, linear_layers=(0,), layer_types=types, sliding_window=8, **LINEAR)
    assert layer_splits(config) == {
        "mixer": (LIN, "attention", "attention", "attention"),
        "window": (LIN, "sliding window", FULL, FULL),
    }


def test_the_split_values_are_the_source_curves_at_each_kinds_layers():
    L, kinds = 6, (LIN, LIN, FULL, LIN, LIN, FULL)
    rng = np.random.default_rng(0)
    layers, boundaries, partial = rng.normal(size=L), rng.normal(size=L + 1), rng.normal(size=L)
    unmeasured = np.where(np.arange(L) == 3, np.nan, layers)  # layer 3: not measured
    curves = {
        "unmeasured": DepthCurve("not everywhere", "units", (np.arange(L) + 0.5) / L, unmeasured),
        "per_layer": DepthCurve("a layer's", "units", (np.arange(L) + 0.5) / L, layers, log=True),
        "skipped_last": DepthCurve("all but the last", "units", (np.arange(L - 1) + 0.5) / L, layers[:-1]),
        "stream": DepthCurve("the stream", "bits", np.arange(L + 1) / L, boundaries, log=True),
        "stream_to_l_minus_1": DepthCurve("h_0..h_{L-1}", "bits", np.arange(L) / L, partial),
        "elsewhere": DepthCurve("between", "units", (np.arange(L) + 0.25) / L, layers),
    }
    measures = split_by_kind(curves, kinds)
    assert list(measures) == ["unmeasured", "per_layer", "skipped_last", "stream", "stream_to_l_minus_1"]
    lin, full = [0, 1, 3, 4], [2, 5]
    assert measures["unmeasured"].series[LIN].layers == (0, 1, 4)
    np.testing.assert_array_equal(measures["unmeasured"].series[LIN].y, layers[[0, 1, 4]])
    m = measures["per_layer"]
    assert list(m.series) == [LIN, FULL] and not m.change and m.log and m.title == "a layer's"
    for kind, at in ((LIN, lin), (FULL, full)):
        assert m.series[kind].layers == tuple(at)
        np.testing.assert_array_equal(m.series[kind].y, layers[at])
        np.testing.assert_array_equal(m.series[kind].x, (np.array(at) + 0.5) / L)
    assert measures["skipped_last"].series[FULL].layers == (2,)
    s = measures["stream"]
    assert s.change and not s.log and s.title == "change across each layer: the stream" and s.ylabel == "change (bits)"
    np.testing.assert_array_equal(s.series[LIN].y, boundaries[np.array(lin) + 1] - boundaries[lin])
    np.testing.assert_array_equal(s.series[FULL].y, boundaries[np.array(full) + 1] - boundaries[full])
    p = measures["stream_to_l_minus_1"]  # no h_L: the last layer's change is unknown
    assert p.series[LIN].layers == (0, 1, 3, 4) and p.series[FULL].layers == (2,)
    np.testing.assert_array_equal(p.series[FULL].y, [partial[3] - partial[2]])
    # means over all of the depth, its first half ((l + 0.5) / L < 1/2: layers 0-2) and second
    assert m.means(LIN) == pytest.approx((layers[lin].mean(), layers[[0, 1]].mean(), layers[[3, 4]].mean()))
    assert m.means(FULL) == pytest.approx((layers[full].mean(), layers[2], layers[5]))
    assert measures["skipped_last"].means(FULL) == pytest.approx((layers[2], layers[2], None))
    with pytest.raises(ValueError, match="all of one kind"):
        split_by_kind(curves, (FULL,) * L)


def _profile(model_config, curves, **changes):
    fields = dict(model="m", dataset="d", num_layers=model_config.num_layers, ratios={}, curves=curves)
    return DepthProfile(**{**fields, "config": model_config, **changes})


def test_a_comparison_refuses_what_it_cannot_split():
    config = _from_hf("qwen3_5_hybrid")
    curve = {"c": DepthCurve("c", "u", (np.arange(4) + 0.5) / 4, np.arange(4.0))}
    c = kind_comparison(_profile(config, curve))
    assert (c.split, c.kinds, c.kind_names, c.layers_of(FULL)) == ("mixer", (LIN, LIN, FULL, LIN), [LIN, FULL], (2,))
    with pytest.raises(ValueError, match="m / d: no model config was saved .* a rerun of `jaxdepth run`"):
        kind_comparison(_profile(config, curve, config=None))
    with pytest.raises(ValueError, match="m / d: the results have 5 layers, the config 4"):
        kind_comparison(_profile(config, curve, num_layers=5))
    with pytest.raises(ValueError, match="m / d: the 2 layers of this qwen2 model are of one kind"):
        kind_comparison(_profile(_from_hf("qwen2_mha_untied"), curve, num_layers=2))
    with pytest.raises(ValueError, match="m / d: the results hold no per-layer curve"):
        kind_comparison(_profile(config, {}))


def test_the_saved_config_is_read_back_and_a_damaged_one_is_named(tmp_path):
    config = _from_hf("qwen3_5_hybrid")
    model = tmp_path / "m-0123abcd"
    (model / "default").mkdir(parents=True)
    assert saved_model_config(str(model / "default")) is None
    assert save_model_config(str(model), config) == str(model / MODEL_CONFIG)
    assert save_model_config(str(model), config) is None  # the same config: not written again
    assert saved_model_config(str(model / "default")) == config
    fields = json.loads((model / MODEL_CONFIG).read_text())
    (model / MODEL_CONFIG).write_text(json.dumps({**fields, "a_field_of_later_versions": 1}))
    assert saved_model_config(str(model / "default")) == config
    (model / MODEL_CONFIG).write_text("{not json")
    with pytest.raises(ValueError, match=f"{model / MODEL_CONFIG} is not a readable model config"):
        saved_model_config(str(model / "default"))


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    """`jaxdepth run` on a tiny converted hybrid (linear attention on layers 0, 1 and 3, full
    attention on layer 2) with the analyses that run on it."""
    root = tmp_path_factory.mktemp("kinds")
    model = save_tiny_checkpoint(str(root / "hybrid"), context=256, num_layers=4, linear_layers=(0, 1, 3), **LINEAR)
    out = root / "results"
    analyses = "contributions,logit_lens,layer_skip,geometry"
    args = ["run", "--model", model, "--analyses", analyses, "--skip-sublayers", "layer", "--prompts", "2"]
    assert main([*args, "--no-figures", "--out", str(out)]) == 0
    return model, out


def test_compare_draws_a_hybrids_measures_by_kind_from_its_saved_results(hybrid_run, tmp_path, capsys):
    model, out = hybrid_run
    folder = results_folder(out, model)
    config = saved_model_config(folder)
    assert (model_dir(out, model) / MODEL_CONFIG).is_file() and config.linear_layers == (0, 1, 3)
    capsys.readouterr()
    prefix = str(tmp_path / "cmp")
    assert main(["compare", str(out), "--out", prefix]) == 0
    printed = capsys.readouterr().out
    figure = f"{prefix}_kinds_hybrid_default"
    assert all(os.path.getsize(path) > 0 for path in (f"{figure}.png", f"{figure}.pdf", f"{prefix}_kinds.md"))
    assert "linear attention: layers 0, 1, 3; full attention: layer 2" in printed

    (profile,) = depth_profiles([str(out)])
    c = kind_comparison(profile)
    contributions = load_result(os.path.join(folder, "contributions.npz"))
    cosine = c.measures["cosine"]
    np.testing.assert_array_equal(cosine.series[LIN].y, contributions.mean_cosine[[0, 1, 3]])
    np.testing.assert_array_equal(cosine.series[FULL].y, contributions.mean_cosine[[2]])
    lens = load_result(os.path.join(folder, "logit_lens.npz"))
    kl = np.append(lens.kl, 0.0)  # h_L's lens is the output: KL 0
    np.testing.assert_array_equal(c.measures["kl"].series[LIN].y, kl[[1, 2, 4]] - kl[[0, 1, 3]])
    skip = load_result(os.path.join(folder, "layer_skip.npz")).part("layer")  # future mode: no last layer
    assert c.measures["skip_layer_output"].series[LIN].layers == (0, 1)
    np.testing.assert_array_equal(c.measures["skip_layer_output"].series[FULL].y, skip.output[[2]])
    sinks = c.measures["sink_rate"]  # measured on the attention layer only
    assert sinks.series[LIN].layers == () and sinks.series[FULL].layers == (2,)
    geometry = load_result(os.path.join(folder, "geometry.npz"))
    assert geometry.settings["attention_layers"] == [2]
    assert " in layer 2" in ANALYSES["geometry"].summary(geometry)[-2]  # where the sink rate peaks
    mean = c.measures["norm_attn"].means(FULL)[0]
    row = f"| attention's relative contribution | full attention | 1 | {mean:.4g} |  | {mean:.4g} |"
    assert row in printed and row in open(f"{prefix}_kinds.md").read()

    fig = kind_figure(c)
    assert len(fig.axes) == len(c.measures)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [
        "linear attention (3 layers)",
        "full attention (1 layer)",
    ]
    assert kinds_markdown([c]) == open(f"{prefix}_kinds.md").read()

    assert main(["compare", str(out), "--split", "mlp", "--out", str(tmp_path / "refused")]) == 2
    assert "--split mlp: no results here are of a model whose layers split by MLP" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "refused.png")  # refused before anything was written


def test_compare_of_a_model_of_one_kind_writes_no_figure_by_kind(hybrid_run, tmp_path, capsys):
    from jaxdepth.analyses.contributions import contributions
    from jaxdepth.core.batch import make_batch
    from jaxdepth.core.model import random_params

    _, out = hybrid_run
    config = tiny_config()
    plain = tmp_path / "plain" / "llama-00000000"
    (plain / "default").mkdir(parents=True)
    batch = make_batch([[5, 9, 2, 7, 1], [3, 8, 4]], [3, 2])
    contributions(random_params(config, 0, scale=0.5), batch, config).save(str(plain / "default" / "contributions.npz"))
    save_model_config(str(plain), config)
    capsys.readouterr()
    prefix = str(tmp_path / "cmp")
    assert main(["compare", str(plain), "--out", prefix]) == 0
    captured = capsys.readouterr()
    assert not os.path.exists(f"{prefix}_kinds.md") and "by layer kind" not in captured.err
    os.remove(plain / MODEL_CONFIG)  # results saved before the config was
    assert main(["compare", str(plain), str(out), "--out", prefix]) == 0
    err = capsys.readouterr().err
    assert "no figure by layer kind: llama-00000000 / default: no model config was saved" in err
    assert os.path.exists(f"{prefix}_kinds_hybrid_default.png")
