"""Figures from real result objects of tiny random models: they render, save (PNG and PDF,
atomically), carry labels, mark what they claim to mark, and refuse wrong inputs clearly."""

import dataclasses
import os

import jax
import matplotlib.image
import numpy as np
import pytest

from jaxdepth.analyses import contributions, drawing, erasure, integrated_gradients, layer_skip, logit_lens
from jaxdepth.analyses.ig import Execution, FixedRule
from jaxdepth.lab import plots
from jaxdepth.core.batch import make_batch
from jaxdepth.core.config import ModelConfig
from jaxdepth.analyses.effective_depth import kl_effective_depth, overlap_effective_depth
from jaxdepth.core.model import random_params


def _config(num_layers):
    # Few distinct parameter shapes (no biases, tied embeddings, q/k/v/o all D x D): random_params
    # compiles its sampling once per shape, seconds each on a busy CPU.
    return ModelConfig(
        model_type="llama",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=4,
        head_dim=8,
        rope_theta=1e4,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        qkv_bias=False,
    )


CONFIG = _config(4)
SHALLOW = _config(3)  # a second model of another depth, for the relative-depth overlay


class FakeTokenizer:
    """The one method of a Hugging Face tokenizer the plots use."""

    def convert_ids_to_tokens(self, ids):
        return [f"tok{i}" for i in ids]


class DecodeOnlyTokenizer:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    return make_batch([rng.integers(0, 97, 30).tolist(), rng.integers(0, 97, 23).tolist()], [20, 15])


@pytest.fixture(scope="module")
def results(batch):
    """One real result of every analysis (IG with few steps: only the picture is tested here)."""
    params = random_params(CONFIG, 1, scale=0.2)
    # The shallow model is the first layers of the deep one: a second random_params costs seconds.
    shallow = {**params, "layers": jax.tree.map(lambda x: np.asarray(x)[: SHALLOW.num_layers], params["layers"])}
    # A zero erasure baseline rather than mean_residuals: one compilation less, the same kind of picture.
    zero_baseline = np.zeros((CONFIG.num_layers + 1, CONFIG.hidden_size), np.float32)
    return {
        "contributions": contributions.contributions(params, batch, CONFIG),
        "logit_lens": logit_lens.logit_lens(params, batch, CONFIG),
        # Two rows; one sublayer, so one compilation (the sublayer is a static argument).
        "layer_skip": {
            name: layer_skip.layer_skip(params, prompts, CONFIG)
            for name, prompts in (("both prompts", batch), ("prompt 1", batch.select(slice(1, 2))))
        },
        "erasure": erasure.residual_erasure(params, batch, CONFIG, zero_baseline),
        "integrated_gradients": integrated_gradients.integrated_gradients_of_answers(
            params, batch.select(slice(0, 1)), CONFIG, rule=FixedRule(steps=2), execution=Execution(progress=False)
        ),
        "shallow_contributions": contributions.contributions(shallow, batch, SHALLOW),
        "shallow_logit_lens": logit_lens.logit_lens(shallow, batch, SHALLOW),
    }


# Every figure the module draws; the first RENDERED are saved and decoded, the rest (variants of
# the same drawing code) only checked for labels, to keep the file fast.
FIGURES = {
    "contributions": lambda r: contributions.contributions_figure(r["contributions"]),
    "logit_lens": lambda r: logit_lens.logit_lens_figure(r["logit_lens"]),
    "layer_skip_rows": lambda r: layer_skip.layer_skip_figure(r["layer_skip"]),
    "erasure": lambda r: erasure.erasure_figure(r["erasure"], 1, tokenizer=FakeTokenizer()),
    "integrated_gradients": lambda r: integrated_gradients.integrated_gradients_figure(
        r["integrated_gradients"], 0, tokenizer=FakeTokenizer()
    ),
    "relative_lens": lambda r: plots.relative_depth_figure(
        {"deep": r["logit_lens"], "shallow": r["shallow_logit_lens"]}
    ),
    "relative_cosine": lambda r: plots.relative_depth_figure(
        {"deep": r["contributions"], "shallow": r["shallow_contributions"]}
    ),
    "layer_skip_single": lambda r: layer_skip.layer_skip_figure(r["layer_skip"]["prompt 1"]),
    "erasure_positions": lambda r: erasure.erasure_figure(r["erasure"], 0),
    "relative_overlap": lambda r: plots.relative_depth_figure(
        {"deep": r["logit_lens"], "shallow": r["shallow_logit_lens"]}, "overlap"
    ),
}
RENDERED = list(FIGURES)[:6]


def _assert_labelled(fig):
    assert fig.get_suptitle()
    for ax in fig.axes:  # colorbars included: they carry their own label
        assert ax.get_xlabel() or ax.get_ylabel(), ax
    assert any(ax.get_xlabel() and ax.get_ylabel() for ax in fig.axes)


@pytest.mark.parametrize("name", FIGURES)
def test_figure_is_labelled(results, name):
    _assert_labelled(FIGURES[name](results))


@pytest.mark.parametrize("name", RENDERED)
def test_figure_renders_and_saves(results, tmp_path, name):
    import matplotlib.pyplot as plt

    fig = FIGURES[name](results)
    png, pdf = plots.save_figure(fig, tmp_path / "figs" / name, dpi=60)  # a low dpi: faster
    assert (png, pdf) == (str(tmp_path / "figs" / f"{name}.png"), str(tmp_path / "figs" / f"{name}.pdf"))
    for path in (png, pdf):
        assert os.path.getsize(path) > 0
    with open(pdf, "rb") as f:
        assert f.read(5) == b"%PDF-"
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
    assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 10  # not one flat colour
    assert sorted(os.listdir(tmp_path / "figs")) == [f"{name}.pdf", f"{name}.png"]  # no temp files left
    assert plt.get_fignums() == []  # nothing registered with pyplot's global state


def test_save_figure_default_dpi_and_extension(results, tmp_path):
    fig = logit_lens.logit_lens_figure(results["logit_lens"])
    png, pdf = plots.save_figure(fig, str(tmp_path / "lens.png"))  # a given extension is not doubled
    assert (png, pdf) == (str(tmp_path / "lens.png"), str(tmp_path / "lens.pdf"))
    assert sorted(os.listdir(tmp_path)) == ["lens.pdf", "lens.png"]
    width, height = fig.get_size_inches()
    assert matplotlib.image.imread(png).shape[:2] == (round(height * 150), round(width * 150))


def test_wrong_result_types_are_refused(results):
    lens, contrib = results["logit_lens"], results["contributions"]
    calls = [
        lambda: contributions.contributions_figure(lens),
        lambda: logit_lens.logit_lens_figure(contrib),
        lambda: layer_skip.layer_skip_figure(lens),
        lambda: layer_skip.layer_skip_figure({"layer": lens}),
        lambda: erasure.erasure_figure(results["integrated_gradients"]),
        lambda: integrated_gradients.integrated_gradients_figure(results["erasure"]),
        lambda: plots.relative_depth_figure({"a": lens, "b": contrib}),
        lambda: plots.relative_depth_figure({"a": results["erasure"]}),
        lambda: plots.relative_depth_figure({"a": lens}, "mean_cosine"),
    ]
    for call in calls:
        with pytest.raises(ValueError):
            call()
    with pytest.raises(TypeError, match="needs a ContributionResult, got LogitLensResult"):
        contributions.contributions_figure(lens)
    with pytest.raises(ValueError, match="at least one"):
        plots.relative_depth_figure({})


@pytest.mark.parametrize("prompt", [2, -1, 10])
def test_prompt_index_out_of_range(results, prompt):
    with pytest.raises(ValueError, match="out of range"):
        erasure.erasure_figure(results["erasure"], prompt)
    with pytest.raises(ValueError, match="out of range"):
        integrated_gradients.integrated_gradients_figure(results["integrated_gradients"], prompt)


def test_erasure_tick_labels_are_the_token_strings(results):
    result = results["erasure"]
    n = int(result.lengths[1])
    ids = result.tokens[1, :n]
    labels = lambda fig: [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels(erasure.erasure_figure(result, 1, tokenizer=FakeTokenizer())) == [f"tok{i}" for i in ids]
    assert labels(erasure.erasure_figure(result, 1, tokenizer=DecodeOnlyTokenizer())) == [f"<{i}>" for i in ids]
    assert labels(erasure.erasure_figure(result, 1)) == [str(p) for p in range(n)]
    # the heatmap holds exactly this prompt's effects, boundaries 0..L on the y axis
    np.testing.assert_array_equal(
        erasure.erasure_figure(result, 1).axes[0].images[0].get_array(), result.effects[1, :, :n]
    )


def test_token_labels_escape_mathtext_and_show_whitespace(results, tmp_path):
    class Dollars:
        def decode(self, ids):
            return "".join("$" if i % 2 else " a\nb\t" for i in ids)

    fig = erasure.erasure_figure(results["erasure"], 0, tokenizer=Dollars())
    texts = {t.get_text() for t in fig.axes[0].get_xticklabels()}
    assert texts <= {r"\$", "\u2423a\u21b5b\u21e5"}
    fig.canvas.draw()  # an unescaped odd number of '$' would fail here, as unbalanced mathtext


def _byte_level_tokenizer():
    """A real byte-level BPE tokenizer (GPT-2 / SmolLM2 / Qwen style), trained on a few lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = ["the cat sat on the mat\nthe end", "Janet\u2019s ducks lay 16 eggs per day.\n"] * 5
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    return tok


def test_token_labels_are_decoded_text_not_byte_level_symbols():
    tok = _byte_level_tokenizer()
    text = "the cat\nsat on the mat"
    ids = tok.encode(text).ids
    assert any("\u0120" in tok.id_to_token(i) or "\u010a" in tok.id_to_token(i) for i in ids)  # Ġ / Ċ inside

    class Adapter:  # the transformers tokenizer interface: decode a list of ids
        def decode(self, ids):
            return tok.decode(ids)

    labels = drawing.token_labels(ids, Adapter())
    assert not any(c in "".join(labels) for c in "\u0120\u010a")
    assert "".join(labels) == text.replace(" ", "\u2423").replace("\n", "\u21b5")
    assert "\u2423cat" in labels or "\u2423c" in labels


def test_robust_limit_clips_only_a_dominant_cell():
    rng = np.random.default_rng(0)
    values = rng.random((8, 50))
    assert drawing.robust_limit(values) == (values.max(), False)
    values[0, 0] = 1e3  # one cell dwarfs the rest: the scale follows the percentile
    limit, clipped = drawing.robust_limit(values, 99)
    assert clipped and limit == np.percentile(np.abs(values), 99) and limit < 1.0
    assert drawing.robust_limit(-values, 99)[0] == limit  # magnitudes: the same for negative cells
    assert drawing.robust_limit(np.zeros((3, 3))) == (1.0, False)


def test_heatmaps_with_one_dominant_cell_are_clipped_and_say_so(results):
    ig = results["integrated_gradients"]
    values = ig.attributions.copy()
    values[0, :, 0] = 1e3 * np.abs(values).max()  # IG at the first token, as on real models
    big = dataclasses.replace(ig, attributions=values)
    fig = integrated_gradients.integrated_gradients_figure(big, 0)
    vmin, vmax = fig.axes[0].images[0].get_clim()
    n = int(ig.lengths[0])
    assert vmax == -vmin == drawing.robust_limit(values[0, :, :n])[0] < np.abs(values[0, :, :n]).max()
    assert "clipped at the 95th percentile" in fig.axes[1].get_ylabel()
    plain = integrated_gradients.integrated_gradients_figure(ig, 0)
    assert "clipped" not in plain.axes[1].get_ylabel()

    L = 24
    later = np.triu(np.random.default_rng(1).random((L, L)), k=1)
    later[0, 1:] = 1e3  # skipping layer 0 changes every later layer: one dominant row
    skip = layer_skip.LayerSkipResult(
        later=later,
        output=np.ones(L),
        later_per_prompt=later[None],
        output_per_prompt=np.ones((1, L)),
        split_positions=np.zeros((1, 4)),
        settings={},
    )
    fig = layer_skip.layer_skip_figure(skip)
    assert fig.axes[0].images[0].get_clim()[1] < 1.0
    assert "clipped at the 90th percentile" in fig.axes[-1].get_ylabel()


def test_long_prompts_get_thinned_labels():
    n, L = 150, 3
    result = erasure.ErasureResult(
        effects=np.random.default_rng(0).random((1, L + 1, n), np.float32),
        tokens=np.arange(n)[None] % 97,
        lengths=np.array([n]),
        answer_start=np.array([100]),
        settings={},
    )
    ax = erasure.erasure_figure(result, 0, tokenizer=FakeTokenizer()).axes[0]
    ticks = ax.get_xticks()
    assert 30 <= len(ticks) <= drawing.MAX_TOKEN_LABELS
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"tok{int(t) % 97}" for t in ticks]
    assert "every 3 tokens" in ax.get_xlabel()
    answer_lines = [line for line in ax.lines if line.get_label() == "answer start"]
    assert len(answer_lines) == 1 and answer_lines[0].get_xdata()[0] == 99.5


def _vertical_line(ax, label_prefix):
    lines = [line for line in ax.lines if line.get_label().startswith(label_prefix)]
    assert len(lines) == 1, [line.get_label() for line in ax.lines]
    x = lines[0].get_xdata()
    assert x[0] == x[1]
    return x[0]


def test_logit_lens_marks_effective_depths_and_thresholds():
    result = logit_lens.LogitLensResult(kl=np.linspace(10, 0, 8), overlap=np.linspace(0, 1, 8), settings={})
    fig = logit_lens.logit_lens_figure(result)
    kl_ax, overlap_ax = fig.axes
    assert _vertical_line(kl_ax, "KL ED") == kl_effective_depth(result.kl).layer == 4
    assert _vertical_line(overlap_ax, "overlap ED") == overlap_effective_depth(result.overlap).layer == 3
    assert kl_ax.get_title() == "KL ED: 4 (ratio 0.62)"
    horizontal = lambda ax: {line.get_ydata()[0] for line in ax.lines if line.get_label().startswith(("0.5", "thr"))}
    assert horizontal(kl_ax) == {5.0} and horizontal(overlap_ax) == {0.3}


def test_contributions_mark_the_cosine_depth_only_when_found():
    curves = dict(norm_attn=np.ones(6), norm_mlp=np.ones(6), norm_layer=np.ones(6), num_tokens=1, settings={})
    crossing = np.array([0.2, -0.1, 0.1, -0.2, 0.3, 0.1])  # crossings after 1 and 3: the last one counts
    fig = contributions.contributions_figure(
        contributions.ContributionResult(cos_attn=crossing, cos_mlp=crossing, cos_layer=crossing, **curves)
    )
    assert all(_vertical_line(ax, "cosine ED") == 3 for ax in fig.axes)
    fig = contributions.contributions_figure(
        contributions.ContributionResult(cos_attn=np.ones(6), cos_mlp=np.ones(6), cos_layer=np.ones(6), **curves)
    )
    assert fig.axes[0].get_title() == "cosine ED: no crossing"
    assert not any(line.get_label().startswith("cosine ED") for ax in fig.axes for line in ax.lines)


def test_layer_skip_heatmap_orientation(results):
    result = results["layer_skip"]["both prompts"]
    fig = layer_skip.layer_skip_figure(result)
    heat = fig.axes[0]
    assert (heat.get_xlabel(), heat.get_ylabel()) == ("measured layer j", "skipped layer s")
    shown = heat.images[0].get_array()
    upper = np.triu(np.ones_like(result.later, bool), k=1)
    np.testing.assert_array_equal(shown[upper], result.later[upper])  # row s, column j
    assert np.all(np.ma.getmaskarray(shown)[~upper])  # zero by construction: drawn as masked
    np.testing.assert_array_equal([bar.get_width() for bar in fig.axes[1].patches], result.output)


def test_relative_depth_axis(results):
    fig = plots.relative_depth_figure({"deep": results["contributions"], "shallow": results["shallow_contributions"]})
    curves = [line for line in fig.axes[0].lines if line.get_label().startswith(("deep", "shallow"))]
    xs = {line.get_label(): line.get_xdata() for line in curves}
    np.testing.assert_allclose(xs["deep (L=4)"], [0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(xs["shallow (L=3)"], [1 / 3, 2 / 3, 1.0])
    assert fig.axes[0].get_xlim()[0] == 0


def _bands(ax):
    return [c for c in ax.collections if c.get_label().startswith("95% bootstrap band")]


def _per_prompt_lines(ax):
    return [c for c in ax.collections if c.get_label().startswith("per prompt")]


def _band_limits(band, layers):
    """(low, high) per layer of a filled band: its polygon's lowest and highest point at each x."""
    vertices = band.get_paths()[0].vertices
    return (
        np.array([vertices[vertices[:, 0] == x, 1].min() for x in layers]),
        np.array([vertices[vertices[:, 0] == x, 1].max() for x in layers]),
    )


def test_bootstrap_bands_and_per_prompt_curves(results):
    """With per-prompt curves, each aggregate curve the depth reads gets its 95% bootstrap band
    (the percentiles of `uncertainty.curve_bands`, same seed) and each prompt a faint curve; the
    titles give the interval. `resamples=0` drops the band and the interval, not the prompts."""
    from jaxdepth.analyses import uncertainty

    lens, contrib = results["logit_lens"], results["contributions"]
    layers = np.arange(CONFIG.num_layers)
    fig = logit_lens.logit_lens_figure(lens, seed=3)
    bands = uncertainty.curve_bands(lens, seed=3)
    intervals = uncertainty.effective_depth_intervals(lens, seed=3)
    for ax, name in zip(fig.axes, ("kl", "overlap")):
        (band,) = _bands(ax)
        low, high = _band_limits(band, layers)
        np.testing.assert_allclose(low, bands[name].low, rtol=1e-12)
        np.testing.assert_allclose(high, bands[name].high, rtol=1e-12)
        assert np.all(low <= getattr(lens, name) + 1e-12) and np.any(high > low)
        (lines,) = _per_prompt_lines(ax)
        segments = lines.get_segments()
        np.testing.assert_array_equal(np.stack([s[:, 1] for s in segments]), getattr(lens, f"{name}_per_prompt"))
        d = intervals[name]
        assert f" [{d.low}, {d.high}] " in ax.get_title()

    fig = contributions.contributions_figure(contrib)
    cos_ax, norm_ax = fig.axes
    (band,) = _bands(cos_ax)
    low, high = _band_limits(band, layers)
    np.testing.assert_allclose(low, uncertainty.curve_bands(contrib)["mean_cosine"].low, rtol=1e-12)
    assert len(_per_prompt_lines(cos_ax)[0].get_segments()) == len(contrib.tokens_per_prompt)
    assert len([c for c in norm_ax.collections if c.get_paths()]) == 3  # one band per norm curve

    plain = logit_lens.logit_lens_figure(lens, resamples=0)
    assert not any(_bands(ax) for ax in plain.axes) and all(_per_prompt_lines(ax) for ax in plain.axes)
    assert "[" not in plain.axes[0].get_title()


def test_results_without_per_prompt_curves_draw_as_before(results):
    lens = results["logit_lens"]
    old = dataclasses.replace(lens, kl_per_prompt=None, overlap_per_prompt=None, tokens_per_prompt=None)
    fig = logit_lens.logit_lens_figure(old)
    assert all(not ax.collections for ax in fig.axes)
    assert (
        fig.axes[0].get_title() == f"KL ED: {kl_effective_depth(lens.kl).layer} (ratio "
        f"{kl_effective_depth(lens.kl).ratio:.2f})"
    )
    contrib = results["contributions"]
    old = dataclasses.replace(
        contrib, **{f"{n}_per_prompt": None for n in contributions.STATISTICS}, tokens_per_prompt=None
    )
    assert all(not ax.collections for ax in contributions.contributions_figure(old).axes)


def test_current_mode_heatmap_draws_the_diagonal():
    L = 5
    later = np.triu(np.random.default_rng(2).random((L, L)) + 0.5)  # diagonal measured
    result = layer_skip.LayerSkipResult(
        later=later,
        output=np.ones(L),
        later_per_prompt=later[None],
        output_per_prompt=np.ones((1, L)),
        split_positions=np.full((1, 4), -1),
        settings={"mode": "current"},
    )
    shown = layer_skip.layer_skip_figure(result).axes[0].images[0].get_array()
    np.testing.assert_array_equal(np.diagonal(shown), np.diagonal(later))
    assert np.all(np.ma.getmaskarray(shown)[np.tril_indices(L, -1)])
    future = layer_skip.layer_skip_figure(dataclasses.replace(result, settings={"mode": "future"}))
    assert np.all(np.ma.getmaskarray(future.axes[0].images[0].get_array())[np.diag_indices(L)])


def _skip_result(L, seed):
    later = np.triu(np.random.default_rng(seed).random((L, L)), k=1)
    return layer_skip.LayerSkipResult(
        later=later,
        output=np.ones(L),
        later_per_prompt=later[None],
        output_per_prompt=np.ones((1, L)),
        split_positions=np.zeros((1, 4)),
        settings={"mode": "future"},
    )


@pytest.mark.parametrize("rows", [1, 2], ids=["one heat map", "two rows"])
def test_layer_skip_colour_bar_spans_its_heat_map(rows):
    """Each heat map's colour bar is beside it and exactly as tall: no blank band above or
    below it (a bar under the heat maps, shorter or taller than them, left one)."""
    results = {f"sublayer {k}": _skip_result(12, k) for k in range(rows)}
    fig = layer_skip.layer_skip_figure(results)
    fig.canvas.draw()
    heat_maps = [ax for ax in fig.axes if ax.images]
    colour_bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(heat_maps) == len(colour_bars) == rows
    for heat, bar in zip(heat_maps, colour_bars):
        heat_box, bar_box = heat.get_window_extent(), bar.get_window_extent()
        assert abs(bar_box.y0 - heat_box.y0) <= 1 and abs(bar_box.y1 - heat_box.y1) <= 1, (heat_box, bar_box)
        assert 0 <= bar_box.x0 - heat_box.x1 < 0.05 * heat_box.width  # beside it, to its right


def test_ig_figure_and_summary_name_the_rule_that_produced_the_result():
    from jaxdepth.analyses.integrated_gradients import IntegratedGradientsResult
    from jaxdepth.analyses.integrated_gradients import integrated_gradients_figure
    from jaxdepth.lab.registry import analysis

    P, L, T = 1, 3, 5
    for rule, steps in [("left", 256), ("gauss", 16)]:
        result = IntegratedGradientsResult(
            attributions=np.ones((P, L, T), np.float32),
            gap=np.full((P, L), 0.25, np.float32),
            f_input=np.ones(P, np.float32),
            f_baseline=np.zeros((P, L), np.float32),
            tokens=np.arange(T)[None],
            lengths=np.array([T]),
            answer_start=np.array([3]),
            settings={"rule": rule, "steps": steps},
        )
        assert f"{rule} rule, {steps} steps: max |completeness gap| = 0.25" in (
            integrated_gradients_figure(result)._suptitle.get_text()
        )
        assert analysis("integrated_gradients").summary(result) == [
            f"IG ({rule} rule, {steps} steps): completeness gap up to 25% of |F(x)-F(b)| (layer 0): a preview, "
            "not a measurement (use --ig-rule adaptive or more --ig-steps)"
        ]


def test_adaptive_ig_figure_marks_layers_that_did_not_converge():
    from jaxdepth.analyses.integrated_gradients import IntegratedGradientsResult
    from jaxdepth.analyses.integrated_gradients import integrated_gradients_figure

    P, L, T = 1, 4, 6
    converged = np.array([[True, False, True, False]])
    result = IntegratedGradientsResult(
        attributions=np.random.default_rng(0).normal(size=(P, L, T)).astype(np.float32),
        gap=np.zeros((P, L), np.float32),
        f_input=np.ones(P, np.float32),
        f_baseline=np.zeros((P, L), np.float32),
        tokens=np.arange(T)[None],
        lengths=np.array([T]),
        answer_start=np.array([4]),
        evaluations=np.full((P, L), 17),
        converged=converged,
        bound=np.zeros((P, L), np.float32),
        settings={"rule": "adaptive", "tolerance": 0.01},
    )
    fig = integrated_gradients_figure(result)
    ax = fig.axes[0]
    flagged = [patch for patch in ax.patches if patch.get_edgecolor()[:3] == (0.0, 1.0, 0.0)]
    assert sorted(patch.get_y() + 0.5 for patch in flagged) == [1, 3]
    assert "adaptive rule to 1%: 2 of 4 layers converged, 68 gradient evaluations" in fig._suptitle.get_text()
    assert "not converged (budget spent)" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_ig_figure_shows_each_layers_completeness_gap_beside_the_attributions():
    from jaxdepth.analyses.integrated_gradients import IntegratedGradientsResult
    from jaxdepth.analyses.integrated_gradients import integrated_gradients_figure

    P, L, T = 1, 4, 6
    gap = np.array([[14.5, 0.1, -2.0, 0.3]], np.float32)
    f_input, f_baseline = np.array([13.0], np.float32), np.array([[0.1, 0.2, 3.0, 13.0]], np.float32)
    result = IntegratedGradientsResult(
        attributions=np.random.default_rng(0).normal(size=(P, L, T)).astype(np.float32),
        gap=gap,
        f_input=f_input,
        f_baseline=f_baseline,
        tokens=np.arange(T)[None],
        lengths=np.array([T]),
        answer_start=np.array([4]),
        settings={"rule": "left", "steps": 8},
    )
    fig = integrated_gradients_figure(result)
    heatmap, colorbar, panel = fig.axes
    assert colorbar.get_ylabel().startswith("attribution to F")
    # one bar per layer, on the heatmap's rows: |gap| as a share of F(x) - F(b), none where F did not move
    assert [bar.get_y() + bar.get_height() / 2 for bar in panel.patches] == list(range(L))
    np.testing.assert_allclose(
        [bar.get_width() for bar in panel.patches],
        [100 * 14.5 / 12.9, 100 * 0.1 / 12.8, 100 * 2.0 / 10.0, 0.0],
        rtol=1e-5,
    )
    assert panel.get_ylim() == heatmap.get_ylim() == (-0.5, L - 0.5)
    assert "completeness gap" in panel.get_xlabel() and "% of |F(x)" in panel.get_xlabel()
    assert [t.get_text() for t in panel.texts] == ["112%"]  # the worst layer, written out
    assert (
        "Integrated gradients, prompt 0, left rule, 8 steps: max |completeness gap| = 14.5, up to 112% of "
        "|F(x) \N{MINUS SIGN} F(b)|"
    ) in fig.get_suptitle()
    _assert_labelled(fig)

    adaptive = IntegratedGradientsResult(
        **{
            f.name: getattr(result, f.name)
            for f in dataclasses.fields(result)
            if f.name not in ("settings", "evaluations", "converged", "bound")
        },
        evaluations=np.full((P, L), 17),
        converged=np.ones((P, L), bool),
        bound=np.zeros((P, L), np.float32),
        settings={"rule": "adaptive", "tolerance": 0.01},
    )
    panel = integrated_gradients_figure(adaptive).axes[2]
    assert [line.get_xdata()[0] for line in panel.lines] == [1.0]  # the tolerance, in percent
