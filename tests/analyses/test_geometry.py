"""Geometry of the residual stream: matrix entropy, massive activations and attention sinks."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from jaxdepth.analyses.geometry import (
    ANALYSIS,
    GeometryResult,
    geometry,
    geometry_figure,
    massive_activations,
    matrix_entropy,
    sink_rate,
    sink_scores,
)
from jaxdepth.analyses.suite import RunInputs
from jaxdepth.core.batch import make_batch
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, random_params, residual_stream

CONFIG = tiny_config(num_layers=3)  # width 32, 4 query heads


def _padded(rows: list[np.ndarray], T: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Prompts' rows in a `[B, T, D]` array, the padding filled with large noise (which any
    leak would show) and the mask of the real rows."""
    D = rows[0].shape[1]
    h = 50 * rng.standard_normal((len(rows), T, D))
    valid = np.zeros((len(rows), T), bool)
    for b, z in enumerate(rows):
        h[b, : len(z)], valid[b, : len(z)] = z, True
    return h.astype(np.float32), valid


def _entropy(z: np.ndarray) -> float:
    """The definition, in float64: normalised entropy of the uncentred Gram's spectrum."""
    eigenvalues = np.clip(np.linalg.eigvalsh(z.astype(np.float64) @ z.astype(np.float64).T), 0, None)
    p = eigenvalues / eigenvalues.sum()
    p = p[p > 0]
    return float(-(p * np.log(p)).sum() / np.log(min(z.shape)))


@pytest.mark.parametrize("T, D", [(8, 16), (24, 8)])  # the T x T Gram, and the D x D one
def test_matrix_entropy_is_zero_for_rank_one_and_one_for_orthogonal_rows(T, D):
    rng = np.random.default_rng(0)
    n = min(T - 2, D)
    rank_one = np.outer(rng.standard_normal(n) * 10, rng.standard_normal(D))
    orthogonal = 3 * np.linalg.qr(rng.standard_normal((D, D)))[0][:n]  # n orthonormal rows, scaled
    h, valid = _padded([rank_one, orthogonal], T, rng)
    entropy = np.asarray(matrix_entropy(jnp.asarray(h), jnp.asarray(valid)))
    assert abs(entropy[0]) < 1e-6 and abs(entropy[1] - 1) < 1e-6, entropy


@pytest.mark.parametrize("T, D", [(10, 16), (20, 6)])
def test_matrix_entropy_of_padded_random_prompts_equals_the_definition(T, D):
    rng = np.random.default_rng(1)
    lengths = [T, 4, 7, 1]
    rows = [rng.standard_normal((n, D)) for n in lengths]
    rows[2][0] *= 100  # a massive first token: one direction dominates the spectrum
    h, valid = _padded(rows, T, rng)
    entropy = np.asarray(matrix_entropy(jnp.asarray(h), jnp.asarray(valid)))
    expected = [_entropy(z) for z in rows[:3]]
    assert np.allclose(entropy[:3], expected, atol=2e-5), (entropy, expected)
    assert 0 < expected[2] < 0.5 < expected[0] < 1
    assert np.isnan(entropy[3])  # one token: log(min(1, D)) = 0


def test_sink_scores_and_rate_on_hand_built_attention_equal_a_hand_count():
    # prompts of 4 and 3 tokens, 3 heads; column 0 of each query row is its attention to the
    # first token. Padding queries (prompt 1's row 3) attend only to it, which must not count.
    to_first = np.array(
        [
            [[1.0, 0.5, 0.2, 0.1], [1.0, 0.1, 0.1, 0.1], [1.0, 0.0, 0.0, 0.0]],
            [[1.0, 0.0, 0.0, 1.0], [1.0, 0.5, 0.5, 1.0], [1.0, 0.9, 0.8, 1.0]],
        ]
    )
    probs = np.zeros((2, 3, 4, 4))
    probs[..., 0] = to_first
    probs[..., 1] = 1 - to_first  # rows sum to 1
    valid = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], bool)
    scores = np.asarray(sink_scores(jnp.asarray(probs), jnp.asarray(valid)))
    hand = np.array([[1.8 / 4, 1.3 / 4, 1.0 / 4], [1.0 / 3, 2.0 / 3, 2.7 / 3]])
    assert np.allclose(scores, hand, atol=1e-6)
    # at 0.3: heads 0 and 1 of prompt 0 (0.45, 0.325), every head of prompt 1; at 0.5: head 2 of
    # prompt 1 (0.9) and head 1 (0.667)
    assert np.allclose(sink_rate(scores, 0.3), [2 / 3, 1.0])
    assert np.allclose(sink_rate(scores, 0.5), [0.0, 2 / 3])


def test_massive_activations_of_a_constructed_residual_equal_hand_values():
    rng = np.random.default_rng(2)
    prompt = np.array([[1, 12, 1], [3, 4, 2], [2, 1, -13], [1, 2, 2]], float)
    # prompt 1: the same rows, with a larger activation in its padding
    h, valid = _padded([prompt, prompt[:3]], 5, rng)
    h[1, 3:] = 1000.0
    stats = {k: np.asarray(v) for k, v in massive_activations(jnp.asarray(h), jnp.asarray(valid)).items()}
    # token norms sqrt(146), sqrt(29), sqrt(174), 3: median (sqrt(29) + sqrt(146)) / 2
    assert np.isclose(stats["first_norm_ratio"][0], np.sqrt(146) / ((np.sqrt(29) + np.sqrt(146)) / 2), rtol=1e-6)
    # |h| sorted: 1 1 1 1 2 2 2 2 3 4 12 13, median 2; the largest, 13, at token 2, dim 2
    assert stats["max_activation"][0] == 13 and stats["max_ratio"][0] == 6.5
    assert (stats["max_position"][0], stats["max_dimension"][0]) == (2, 2)
    # three tokens: norms median sqrt(146); |h| of 9 values median 2
    assert np.isclose(stats["first_norm_ratio"][1], 1.0) and stats["max_ratio"][1] == 6.5
    assert (stats["max_activation"][1], stats["max_position"][1]) == (13, 2)


def _brute_force(params, batch, config) -> dict:
    """Every quantity per prompt from the whole residual stream and the attention probabilities
    (read with a tap), in numpy, float64, from the definitions."""
    tokens, valid = jnp.asarray(batch.tokens), jnp.asarray(batch.valid)
    hs = np.asarray(residual_stream(params, tokens, config, valid=valid), np.float64)
    _, probs = run_layers(params, embed(params, tokens, config), config, valid=valid, tap=lambda r, _: r.attn_probs)
    probs = np.asarray(probs, np.float64)
    out = {k: [] for k in ("entropy", "first_norm_ratio", "max_activation", "where", "max_ratio", "sinks")}
    for b, n in enumerate(batch.lengths):
        z = hs[:, b, :n]  # [L + 1, n, D]
        norms = np.linalg.norm(z, axis=-1)
        out["entropy"].append([_entropy(x) if n > 1 else np.nan for x in z])
        out["first_norm_ratio"].append(norms[:, 0] / np.median(norms, axis=1))
        flat = np.abs(z).reshape(len(z), -1)
        out["max_activation"].append(flat.max(axis=1))
        out["where"].append(np.stack(np.unravel_index(flat.argmax(axis=1), z.shape[1:]), axis=1))
        out["max_ratio"].append(flat.max(axis=1) / np.median(flat, axis=1))
        out["sinks"].append(probs[:, b, :, :n, 0].mean(axis=-1))  # [L, H]
    return {k: np.array(v) for k, v in out.items()}


def _check(result: GeometryResult, expected: dict):
    assert np.allclose(result.entropy, expected["entropy"], atol=1e-5, equal_nan=True)
    for name in ("first_norm_ratio", "max_activation", "max_ratio"):
        assert np.allclose(getattr(result, name), expected[name], rtol=1e-5), name
    assert np.array_equal(np.stack([result.max_position, result.max_dimension], -1), expected["where"])
    assert np.allclose(result.sink_scores, expected["sinks"], atol=1e-6)


def test_the_model_run_equals_a_brute_force_and_each_prompt_alone():
    params = random_params(CONFIG, 0, scale=0.5)
    rng = np.random.default_rng(3)
    lengths = [9, 40, 5, 1]  # padded to 48 together (> width 32: the D x D Gram), to 16 alone
    batch = make_batch([rng.integers(1, CONFIG.vocab_size, n).tolist() for n in lengths])
    result = geometry(params, batch, CONFIG)
    _check(result, _brute_force(params, batch, CONFIG))
    assert result.entropy.shape == (4, 4) and result.sink_scores.shape == (4, 3, 4)
    assert np.isnan(result.entropy[3]).all() and np.isfinite(result.entropy[:3]).all()
    assert result.lengths.tolist() == lengths

    for i in range(len(lengths)):
        alone = geometry(params, batch.single(i), CONFIG)
        for name in ("entropy", "first_norm_ratio", "max_activation", "max_ratio", "sink_scores"):
            assert np.allclose(getattr(alone, name)[0], getattr(result, name)[i], atol=1e-5, equal_nan=True), name
        assert np.array_equal(alone.max_position[0], result.max_position[i])

    # other padding tokens: nothing changes, bit for bit
    repadded = _with_other_padding(batch, rng)
    again = geometry(params, repadded, CONFIG)
    for name in ("entropy", "first_norm_ratio", "max_activation", "max_position", "max_ratio", "sink_scores"):
        assert np.array_equal(getattr(again, name), getattr(result, name), equal_nan=True), name


def _with_other_padding(batch, rng):
    """The batch with random token ids at its padding."""
    tokens = np.where(batch.valid, batch.tokens, rng.integers(1, CONFIG.vocab_size, batch.tokens.shape))
    return dataclasses.replace(batch, tokens=tokens.astype(np.int32))


def test_the_suite_analysis_its_result_figure_and_summary(tmp_path):
    params = random_params(CONFIG, 1, scale=0.5)
    rng = np.random.default_rng(4)
    batch = make_batch([rng.integers(1, CONFIG.vocab_size, n).tolist() for n in (7, 12, 10)])
    model = SimpleNamespace(params=params, config=CONFIG)
    settings = ANALYSIS.settings(geometry_sink_threshold=0.2)
    result = ANALYSIS.run(RunInputs(model=model, batch=batch, settings=settings, progress=False))
    assert isinstance(result, GeometryResult) and result.threshold == 0.2
    assert np.array_equal(result.sink_rate(), sink_rate(result.sink_scores, 0.2))
    assert np.array_equal(result.sink_rate(0.5), np.mean(result.sink_scores > 0.5, axis=-1))
    assert result.sink_rate().shape == (3, CONFIG.num_layers)

    path = str(tmp_path / "geometry.npz")
    result.save(path)
    again = GeometryResult.load(path)
    for name in ("entropy", "first_norm_ratio", "max_position", "sink_scores", "lengths"):
        assert np.array_equal(getattr(again, name), getattr(result, name)), name
    assert again.num_layers == CONFIG.num_layers and again.threshold == 0.2

    fig = geometry_figure(result, resamples=20)
    assert len(fig.axes) == 3 and fig.axes[1].get_yscale() == "log"
    assert fig.axes[0].get_xlim() == (0, 1)

    top = result.largest_activation()
    assert top["value"] == result.max_activation.max()
    assert result.max_position[top["prompt"], top["boundary"]] == top["position"]
    lines = ANALYSIS.summary(result)
    assert lines[0].startswith("entropy valley") and "sink rate peaks" in lines[2], lines
    assert len(lines) == 4

    with pytest.raises(ValueError, match="--geometry-sink-threshold"):
        ANALYSIS.settings(geometry_sink_threshold=1.5)
