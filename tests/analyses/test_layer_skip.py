"""Layer skip (METHODS §3) on a tiny random model: the vmapped sweep equals the same skips run one
at a time, exact zeros, chunking, the split positions, the current mode, and new split
positions never recompile."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxdepth.analyses import layer_skip
from jaxdepth.core import sites
from jaxdepth.core.batch import PromptArrays
from jaxdepth.analyses.layer_skip import SUBLAYERS, Skip
from jaxdepth.core.execution import Execution

from progress_recorder import bar_recorder, record_chunks
from tiny_qwen import CONFIG, batch, deltas, params, probs  # noqa: F401  (fixtures)

# Compare at full float32 matmul precision (as the references compute).
pytestmark = pytest.mark.usefixtures("highest_precision")


# ----------------------------------------------------------------------------- §3


def _skip_reference(params, one, layer, split, sublayer):
    """The same skip intervention through the plain forward, one at a time, numpy statistics."""
    T = one.tokens.shape[1]
    length = int(one.lengths[0])
    pos = np.arange(T)
    tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
    iv = sites.skip(SUBLAYERS[sublayer], layer, ((pos >= 1) & (pos < split)).astype(np.float32))
    d_clean, d_skip = deltas(params, tokens, valid), deltas(params, tokens, valid, iv)
    ratio = np.linalg.norm(d_clean - d_skip, axis=-1) / np.maximum(np.linalg.norm(d_clean, axis=-1), 1e-6)
    future = (pos >= split) & (pos < length)
    later = ratio[:, 0, future].max(-1)
    out = np.linalg.norm(probs(params, tokens, valid) - probs(params, tokens, valid, iv), axis=-1)[0, future].max()
    return later, out


@pytest.mark.parametrize("sublayer", ["layer", "attn", "mlp"])
def test_layer_skip_sweep_equals_one_at_a_time(params, batch, sublayer):
    result = layer_skip.layer_skip(params, batch, CONFIG, Skip(sublayer=sublayer))
    L = CONFIG.num_layers
    for i in range(len(batch)):
        splits = [t for t in result.split_positions[i] if t >= 0]
        assert splits, "every test prompt is long enough for a split position"
        ref_later = np.zeros((L, L))
        ref_out = np.zeros(L)
        for s in range(L):
            for t in splits:
                later, out = _skip_reference(params, batch.single(i), s, t, sublayer)
                ref_later[s] = np.maximum(ref_later[s], np.where(np.arange(L) > s, later, 0))
                ref_out[s] = max(ref_out[s], out)
        np.testing.assert_allclose(result.later_per_prompt[i], ref_later, atol=2e-5)
        np.testing.assert_allclose(result.output_per_prompt[i], ref_out, atol=2e-6)
    np.testing.assert_array_equal(result.later, result.later_per_prompt.max(0))


def test_layer_skip_exact_zeros_and_chunking(params, batch):
    full = layer_skip.layer_skip(params, batch, CONFIG)
    chunked = layer_skip.layer_skip(params, batch, CONFIG, execution=Execution(chunk_size=3))
    lower = np.tril(np.ones((CONFIG.num_layers,) * 2, bool))
    assert np.all(full.later[lower] == 0.0) and np.all(full.later_per_prompt[:, lower] == 0.0)
    assert np.all(full.later[~lower] > 0)
    assert full.output[-1] == 0.0  # the last layer, skipped before t_s, cannot reach p >= t_s
    np.testing.assert_allclose(chunked.later, full.later, atol=1e-6)
    # The chunked and the full sweep are different programs (3 against 4 members in their batched
    # matmuls), whose float32 sums the CPU may order differently: on AVX-512 the output effects
    # (about 0.24) differ in their last bits (2e-7, 13 ulp; on AVX2 they were equal). A relative
    # bound of float32's rounding over such sums, not an absolute 1e-7 below its resolution.
    np.testing.assert_allclose(chunked.output, full.output, rtol=2e-6, atol=1e-7)
    # skipped layers in calls of 3 (the last call padded by repeating layer L-1), as a tight
    # memory budget makes them, give what one call over all L gives
    one, T = batch.single(0), batch.single(0).tokens.shape[1]
    pos = np.arange(T)
    masks = layer_skip.SkipMasks(
        np.asarray([(pos >= 1) & (pos < t) for t in (8, 12)], np.float32), np.asarray([pos >= t for t in (8, 12)])
    )
    args = (params, PromptArrays(jnp.asarray(one.tokens), jnp.asarray(one.valid)), masks, CONFIG)
    three = Execution(memory_budget=4 * 2 * T * CONFIG.hidden_size * 4 * 3)
    assert layer_skip.skipped_layer_groups(CONFIG, T, 2, three) == 3
    for whole, grouped in zip(
        layer_skip.skip_effects_of_prompt(*args), layer_skip.skip_effects_of_prompt(*args, execution=three)
    ):
        assert grouped.shape == whole.shape
        np.testing.assert_allclose(grouped, whole, atol=1e-7)


def test_split_positions_follow_the_reference_sampling():
    import random

    rng = random.Random(123)
    expected = []
    for length in (30, 50, 12):
        c = list(range(8, length - 4, 8))
        rng.shuffle(c)
        expected.append(sorted(c[:4]))
    assert layer_skip.sample_split_positions([30, 50, 12], seed=123) == expected
    assert expected[2] == []  # range(8, 8, 8) is empty: too short


@pytest.mark.parametrize("sublayer", ["layer", "attn", "mlp"])
def test_current_mode_equals_one_at_a_time_with_the_diagonal_measured(params, batch, sublayer):
    """'current': skip every position but 0, measure every position. Only j < s is zero by
    construction; the diagonal D[s, s] is the skipped layer's own change (1 for a whole layer)."""
    result = layer_skip.layer_skip(params, batch, CONFIG, Skip(sublayer=sublayer, mode="current"))
    L = CONFIG.num_layers
    for i in range(len(batch)):
        one = batch.single(i)
        T, length = one.tokens.shape[1], int(one.lengths[0])
        pos = np.arange(T)
        tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
        ref = np.zeros((L, L))
        for s in range(L):
            iv = sites.skip(SUBLAYERS[sublayer], s, ((pos >= 1) & (pos < length)).astype(np.float32))
            d_clean, d_skip = deltas(params, tokens, valid), deltas(params, tokens, valid, iv)
            ratio = np.linalg.norm(d_clean - d_skip, axis=-1) / np.maximum(np.linalg.norm(d_clean, axis=-1), 1e-6)
            ref[s] = np.where(np.arange(L) >= s, ratio[:, 0, :length].max(-1), 0.0)
        np.testing.assert_allclose(result.later_per_prompt[i], ref, atol=2e-5)
    upper = np.triu(np.ones((L, L), bool))
    assert np.all(result.later_per_prompt[:, ~upper] == 0.0)  # j < s: exactly zero
    diagonal = np.diagonal(result.later, axis1=-2, axis2=-1)
    assert np.all(diagonal > 0)
    if sublayer == "layer":
        np.testing.assert_allclose(diagonal, 1.0, atol=1e-6)


def test_current_mode_skips_all_but_position_zero(params, batch):
    result = layer_skip.layer_skip(params, batch.select(slice(0, 1)), CONFIG, Skip(mode="current"))
    one = batch.single(0)
    pos = np.arange(one.tokens.shape[1])
    tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
    iv = sites.skip("delta", 1, (pos >= 1).astype(np.float32))
    out = np.linalg.norm(probs(params, tokens, valid) - probs(params, tokens, valid, iv), axis=-1)[0, :30].max()
    np.testing.assert_allclose(result.output[1], out, atol=2e-6)


# ----------------------------------------------------------------------------- compilation


def test_new_intervention_values_do_not_recompile(params, batch):
    """New split positions are new mask values and new measured rows (within one padded row
    count): neither the skipped forwards nor the output shifts compile again."""
    one = batch.single(0)
    prompt = PromptArrays(jnp.asarray(one.tokens), jnp.asarray(one.valid))
    jitted = (layer_skip.skipped_runs, layer_skip.output_shifts)
    T = one.tokens.shape[1]
    assert T <= layer_skip.ROWS_MULTIPLE  # both splits' measured rows pad to one count
    sizes = []
    for t in (9, 17):
        pos = np.arange(T)
        masks = layer_skip.SkipMasks(np.asarray([(pos >= 1) & (pos < t)], np.float32), np.asarray([pos >= t]))
        layer_skip.skip_effects_of_prompt(params, prompt, masks, CONFIG, Skip(sublayer="layer"))
        sizes.append([f._cache_size() for f in jitted])
    assert sizes[1] == sizes[0]


def test_the_execution_reaches_the_sweep(params, batch, monkeypatch):
    """An `Execution`'s chunk size is the skipped runs' chunk (a static argument: traced anew)
    and changes nothing but the chunking; its progress counts the prompts."""
    chunks = record_chunks(monkeypatch, layer_skip)
    Recorder, bars = bar_recorder()
    two = batch.select([0, 1])
    full = layer_skip.layer_skip(params, two, CONFIG)
    chunked = layer_skip.layer_skip(params, two, CONFIG, execution=Execution(chunk_size=2, progress=Recorder))
    assert 2 in chunks
    assert [(b.total, b.done) for b in bars] == [(2, 2)]
    np.testing.assert_allclose(chunked.later, full.later, atol=1e-6)
    np.testing.assert_allclose(chunked.output, full.output, rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(chunked.split_positions, full.split_positions)
