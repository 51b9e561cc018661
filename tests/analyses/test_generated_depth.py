"""The depth of generated tokens: JSD, settling depths, the deep-thinking ratio and Think@n
against hand computations, and the lens trajectories against the lens read layer by layer."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdepth.analyses import generated_depth as G
from jaxdepth.core.model import random_params, residual_stream, unembed
from tiny_qwen import CONFIG


def _jsd_bits(p, q):
    m = (p + q) / 2
    kl = lambda a, b: sum(x * math.log2(x / y) for x, y in zip(a, b) if x > 0)  # noqa: E731
    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def test_jsd_is_symmetric_bounded_and_zero_where_the_distributions_agree():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, 9)), rng.normal(size=(4, 9)) * 3
    ab, ba = np.asarray(G.jensen_shannon(a, b)), np.asarray(G.jensen_shannon(b, a))
    np.testing.assert_array_equal(ab, ba)
    assert np.all(np.asarray(G.jensen_shannon(a, a)) == 0.0)
    assert np.all((ab > 0) & (ab <= 1))
    p, q = jax.nn.softmax(a[0]), jax.nn.softmax(b[0])
    np.testing.assert_allclose(ab[0], _jsd_bits(np.float64(p), np.float64(q)), rtol=1e-5)
    # disjoint supports: the bound, 1 bit, with the zero terms counted as 0 (no NaN)
    one_hot = np.array([[0.0, -np.inf], [-np.inf, 0.0]])
    np.testing.assert_allclose(G.jensen_shannon(one_hot[0], one_hot[1]), 1.0, rtol=1e-6)


def test_entropy_in_bits():
    np.testing.assert_allclose(G.entropy_bits(np.zeros(8)), 3.0, rtol=1e-6)
    np.testing.assert_allclose(G.entropy_bits(np.array([0.0, -np.inf])), 0.0, atol=1e-7)


def test_settling_depth_and_dtr_by_hand():
    # L = 4 layers, three tokens: rows are layers 1..4
    jsd = np.array(
        [
            [0.9, 0.2, 0.9],
            [0.6, 0.1, 0.7],
            [0.4, 0.6, 0.6],
            [0.0, 0.0, 0.0],
        ]
    )
    depths = G.settling_depths(jsd, threshold=0.5)
    np.testing.assert_array_equal(depths, [3, 1, 4])  # the first layer at or under g, from 1
    # ceil(0.85 * 4) = 4: only a token settling at layer 4 is deep-thinking
    np.testing.assert_array_equal(G.deep_thinking(depths, 4, 0.85), [False, False, True])
    np.testing.assert_array_equal(G.deep_thinking(depths, 4, 0.5), [True, False, True])  # ceil(2) = 2
    deep = np.array([[True, False, True, True], [False, False, True, False]])
    counted = np.array([[True, True, True, False], [False, False, False, False]])
    ratios = G.deep_thinking_ratio(deep, counted)
    assert ratios[0] == 2 / 3 and np.isnan(ratios[1])  # padding uncounted; no tokens: NaN
    with pytest.raises(ValueError, match="rho"):
        G.deep_thinking(depths, 4, 0.0)


def test_think_at_n_equals_picking_by_hand():
    answers = ["7", "3", "3", "7", "5", "3"]
    ratios = [0.9, 0.1, 0.2, 0.8, 0.95, 0.3]
    assert G.majority_answer(answers) == "3"
    # keep 3 of 6: samples 4 (0.95), 0 (0.9), 3 (0.8) -> "5", "7", "7"
    assert G.think_at_n(answers, ratios, keep=0.5) == "7"
    assert G.think_at_n(answers, ratios, keep=1.0) == "3"  # all kept: self-consistency
    assert G.think_at_n(answers, ratios, keep=0.1) == "5"  # at least one: the deepest
    assert G.majority_answer(["a", "b", "b", "a"]) == "a"  # a tie to the answer given first
    assert G.think_at_n(["a", "b"], [float("nan"), 0.0], keep=0.5) == "b"  # NaN ratios last


def test_lens_trajectories_equal_the_lens_read_layer_by_layer():
    params = random_params(CONFIG, 3, scale=0.2)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (2, 7)), jnp.int32)
    valid = jnp.asarray(np.array([[1] * 7, [1] * 5 + [0] * 2], bool))
    jsd, entropy, top1 = G.lens_trajectories(params, tokens, valid, CONFIG)
    L = CONFIG.num_layers
    assert jsd.shape == (L, 2, 7) and entropy.shape == (L + 1, 2, 7) and top1.shape == (L + 1, 2, 7)
    hs = residual_stream(params, tokens, CONFIG, valid=valid)
    final = unembed(params, hs[-1], CONFIG)
    for layer in range(1, L + 1):
        np.testing.assert_allclose(
            jsd[layer - 1], G.jensen_shannon(unembed(params, hs[layer], CONFIG), final), rtol=1e-5, atol=1e-7
        )
    for layer in range(L + 1):
        lens = unembed(params, hs[layer], CONFIG)
        np.testing.assert_allclose(entropy[layer], G.entropy_bits(lens), rtol=1e-5)
        np.testing.assert_array_equal(top1[layer], np.argmax(lens, axis=-1))
    assert np.all(np.asarray(jsd[-1]) == 0.0)  # the output against itself


def _decode(ids):
    return " ".join(str(int(i)) for i in ids)


def test_generated_depth_equals_the_lens_read_at_each_generation_step():
    """Each generated token's JSD per layer, settling depth and each answer's DTR equal a hand
    computation from the model run on the question and the tokens generated so far, at the step
    that generated the token (the lens of generation itself, not of a teacher-forced pass)."""
    from jaxdepth.core.batch import make_batch
    from jaxdepth.core.decoding import generate

    params = random_params(CONFIG, 5, scale=0.6)
    rng = np.random.default_rng(2)
    batch = make_batch([rng.integers(0, 97, 9).tolist(), rng.integers(0, 97, 6).tolist()], [6, 4])
    reading = G.Reading(max_new_tokens=5, threshold=0.3, rho=0.5)
    result = G.generated_depth(params, batch, CONFIG, _decode, reading)
    L = CONFIG.num_layers
    for b in range(2):
        question = [int(t) for t in batch.tokens[b, : batch.answer_start[b]]]
        out = generate(params, jnp.asarray([question]), CONFIG, max_new_tokens=5)
        new = [int(t) for t in np.asarray(out.tokens[0, : int(out.lengths[0])])]
        depths, decisions = [], []
        for j, token in enumerate(new):
            seen = jnp.asarray([question + new[:j]], jnp.int32)
            hs = residual_stream(params, seen, CONFIG)
            final = np.asarray(unembed(params, hs[-1, 0, -1], CONFIG))
            jsd = [
                float(G.jensen_shannon(unembed(params, hs[layer, 0, -1], CONFIG), final)) for layer in range(1, L + 1)
            ]
            depths.append(next(layer for layer, v in enumerate(jsd, 1) if v <= 0.3 or layer == L))
            assert int(np.argmax(final)) == token  # greedy: the output at that step chose it
            top = [int(np.argmax(unembed(params, hs[layer, 0, -1], CONFIG))) for layer in range(L + 1)]
            decisions.append(min(d for d in range(L + 1) if all(t == token for t in top[d:])))
        np.testing.assert_array_equal(result.settling[b, 0, : len(new)], depths)
        np.testing.assert_array_equal(result.decision[b, 0, : len(new)], decisions)
        assert result.counted[b, 0].sum() == len(new)
        assert result.dtr[b, 0] == np.mean([d >= math.ceil(0.5 * L) for d in depths])


def test_think_at_n_over_samples_equals_the_vote_by_hand(tmp_path):
    from jaxdepth.core.batch import make_batch

    params = random_params(CONFIG, 6, scale=0.6)
    rng = np.random.default_rng(3)
    batch = make_batch([rng.integers(0, 97, 8).tolist() for _ in range(3)], [5, 6, 7])
    result = G.generated_depth(params, batch, CONFIG, _decode, G.Reading(max_new_tokens=3, samples=4, temperature=1.5))
    assert result.dtr.shape == (3, 4) and len(result.answers[0]) == 4
    majority, think = [], []
    for answers, ratios, correct in zip(result.answers, result.dtr, result.correct):
        kept = sorted(sorted(range(4), key=lambda i: (-np.nan_to_num(ratios[i], nan=-1), i))[:2])
        for pool, out in ((range(4), majority), (kept, think)):
            votes = [answers[i] for i in pool]
            best = max(votes.count(a) for a in votes)
            chosen = next(a for a in votes if votes.count(a) == best)
            out.append(correct[answers.index(chosen)])
    accuracy = result.accuracies()
    assert accuracy["majority"] == np.mean(majority) and accuracy["think@n"] == np.mean(think)
    assert accuracy["mean"] == result.correct.mean()
    again = G.GeneratedDepthResult.load(result.save(str(tmp_path / "generated.npz")))
    assert again.answers == result.answers and again.accuracies() == accuracy
    np.testing.assert_array_equal(again.settling, result.settling)
    with pytest.raises(ValueError, match="several samples need a temperature"):
        G.Reading(samples=2, temperature=0.0)
