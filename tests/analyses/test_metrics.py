"""The one metric protocol (`jaxdepth.analyses.metrics`) and the one execution value
(`jaxdepth.core.execution`): positions resolved as declared, the built-ins equal to hand
computations, the old forms refused with the new one shown."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdepth
from jaxdepth.analyses import metrics as M
from jaxdepth.core.execution import Execution, in_chunks, refuse_loose_options


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _kl(p_logits, q_logits):
    p, q = _softmax(np.float64(p_logits)), _softmax(np.float64(q_logits))
    return (p * (np.log(p) - np.log(q))).sum(axis=-1)


VALID = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], bool)


def test_reads_resolve_to_each_prompts_real_positions():
    last = M.reads_at(M.logit_difference, VALID)
    np.testing.assert_array_equal(last.positions, [[2], [4], [0]])
    assert bool(last.real.all())
    every = M.reads_at(M.mean_kl_clean_to_run, VALID)
    np.testing.assert_array_equal(every.real, VALID)
    np.testing.assert_array_equal(every.positions[1], np.arange(5))
    answer = M.reads_at(M.answer_probability, VALID[:1], np.array([1, 2]), np.array([True, False]), np.array([7, 9]))
    np.testing.assert_array_equal(answer.positions, [[1, 2]])
    np.testing.assert_array_equal(answer.targets, [[7, 9]])
    np.testing.assert_array_equal(answer.real, [[True, False]])
    with pytest.raises(ValueError, match="reads 'answer' positions, and none were given"):
        M.reads_at(M.answer_probability, VALID)


def test_builtins_equal_hand_computations():
    rng = np.random.default_rng(0)
    logits, clean = rng.normal(size=(2, 3, 11)).astype(np.float32), rng.normal(size=(2, 3, 11)).astype(np.float32)
    real = np.array([[True, True, False], [True, True, True]])
    targets = np.array([[1, 4, 4], [0, 10, 3]])
    labels = np.array([[3, 5], [7, 2]])
    r = M.Readout(jnp.asarray(logits), jnp.asarray(real), jnp.zeros((2, 3), jnp.int32), jnp.asarray(targets))
    p = _softmax(np.float64(logits))
    want = [sum(p[b, a, targets[b, a]] for a in range(3) if real[b, a]) for b in range(2)]
    np.testing.assert_allclose(M.answer_probability(r), want, rtol=1e-6)

    last = M.Readout(jnp.asarray(logits[:, :1]), jnp.ones((2, 1), bool), jnp.zeros((2, 1), jnp.int32), labels=labels)
    want = [logits[b, 0, labels[b, 0]] - logits[b, 0, labels[b, 1]] for b in range(2)]
    np.testing.assert_allclose(M.logit_difference(last), want, rtol=1e-6)

    one = (jnp.ones((2, 1), bool), jnp.zeros((2, 1), jnp.int32))
    both = M.Readout(jnp.asarray(logits[:, :1]), *one, clean=clean[:, :1])
    np.testing.assert_allclose(M.kl_clean_to_run(both), _kl(clean[:, 0], logits[:, 0]), rtol=1e-5)
    np.testing.assert_allclose(M.kl_run_to_clean(both), _kl(logits[:, 0], clean[:, 0]), rtol=1e-5)
    # the two directions differ: each is named for the one it computes
    assert not np.allclose(M.kl_clean_to_run(both), M.kl_run_to_clean(both))

    every = M.Readout(jnp.asarray(logits), jnp.asarray(real), jnp.zeros((2, 3), jnp.int32), clean=clean)
    kl = _kl(clean, logits)
    want = [(kl[b] * real[b]).sum() / real[b].sum() for b in range(2)]
    np.testing.assert_allclose(M.mean_kl_clean_to_run(every), want, rtol=1e-5)
    # exactly zero where the run is the clean run
    same = M.Readout(jnp.asarray(clean), jnp.asarray(real), jnp.zeros((2, 3), jnp.int32), clean=clean)
    assert np.all(np.asarray(M.mean_kl_clean_to_run(same)) == 0.0)


def test_readout_runs_the_head_at_the_declared_positions_only():
    """The readout's logits at position p equal the full logits' row p, prompt by prompt."""
    from jaxdepth.core.loops import run_layers
    from jaxdepth.core.model import embed, random_params, unembed
    from tiny_qwen import CONFIG as config

    params = random_params(config, 1, scale=0.2)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (3, 5)), jnp.int32)
    h, _ = run_layers(params, embed(params, tokens, config), config, valid=jnp.asarray(VALID))
    full = unembed(params, h, config)
    reads = M.reads_at(M.logit_difference, VALID)
    r = M.readout(params, h, config, reads, clean_final=h)
    for b, t in enumerate([2, 4, 0]):
        np.testing.assert_allclose(r.logits[b, 0], full[b, t], rtol=1e-6)
        np.testing.assert_allclose(r.clean[b, 0], full[b, t], rtol=1e-6)


def test_a_metric_returns_one_floating_value_per_prompt():
    r = M.Readout(jnp.ones((2, 1, 4)), jnp.ones((2, 1), bool), jnp.zeros((2, 1), jnp.int32))
    with pytest.raises(ValueError, match=r"one value per prompt, shape \(2,\)"):
        M.metric()(lambda r: r.logits.sum())(r)
    with pytest.raises(ValueError, match="floating point"):
        M.metric()(lambda r: jnp.argmax(r.logits[:, 0], axis=-1))(r)
    with pytest.raises(ValueError, match="reads one of"):
        M.metric(reads="first")


def test_old_forms_are_refused_showing_the_new_one():
    with pytest.raises(TypeError, match=r"@jaxdepth.metric\(reads='last'\)") as e:
        M.as_metric(lambda logits, labels: logits[:, 0], "edge attribution")
    assert "edge attribution" in str(e.value)
    with pytest.raises(ValueError, match="no clean run"):
        M.as_metric(M.kl_clean_to_run, "site gradients", clean_available=False)
    with pytest.raises(ValueError, match="knows no answer positions"):
        M.as_metric(M.answer_probability, "layer skip", answers_available=False)
    assert M.as_metric(M.logit_difference, "edges") is M.logit_difference
    assert jaxdepth.metric is M.metric and jaxdepth.metrics is M


def test_execution_checks_and_sizes_chunks():
    with pytest.raises(ValueError, match="chunk_size must be"):
        Execution(chunk_size=0)
    with pytest.raises(ValueError, match="backward must be one of"):
        Execution(backward="sometimes")
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        Execution(nonfinite="ignore")
    assert Execution(chunk_size=3).chunk(10, 1) == 3
    assert Execution(memory_budget=100).chunk(50, 7) == 14
    assert Execution(memory_budget=100).chunk(5, 7) == 5
    assert Execution(memory_budget=3).chunk(5, 7) == 1
    with pytest.raises(TypeError, match=r"execution=jaxdepth.Execution\(chunk_size=4, progress=True\)"):
        refuse_loose_options("layer_skip", {"chunk_size": 4, "progress": True})
    with pytest.raises(TypeError, match="unexpected keyword arguments: colour"):
        refuse_loose_options("layer_skip", {"colour": 1})


def test_in_chunks_equals_one_call_whatever_the_chunk():
    items = np.arange(11)
    run = jax.jit(lambda xs: jnp.stack([xs * 2.0, xs + 0.5], axis=1))
    whole = np.asarray(run(items))
    for chunk in (1, 3, 4, 11):
        np.testing.assert_array_equal(in_chunks(run, items, chunk, Execution(), "test"), whole)
