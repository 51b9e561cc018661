"""Residual erasure (METHODS §4) on a tiny random model: the sweep equals the erasures run one at
a time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdepth.analyses import erasure
from jaxdepth.core import sites
from jaxdepth.core.execution import Execution
from jaxdepth.core.model import residual_stream

from progress_recorder import bar_recorder, record_chunks
from tiny_qwen import CONFIG, batch, deltas, params, probs  # noqa: F401  (fixtures)

# Compare at full float32 matmul precision (as the references compute).
pytestmark = pytest.mark.usefixtures("highest_precision")


# ----------------------------------------------------------------------------- §4


def test_erasure_sweep_equals_one_at_a_time(params, batch):
    baseline = erasure.mean_residuals(params, batch, CONFIG)
    hs = np.asarray(residual_stream(params, jnp.asarray(batch.tokens), CONFIG, valid=jnp.asarray(batch.valid)))
    np.testing.assert_allclose(
        baseline, (hs * batch.valid[None, :, :, None]).sum((1, 2)) / batch.valid.sum(), rtol=1e-5, atol=1e-6
    )
    result = erasure.residual_erasure(params, batch, CONFIG, baseline)
    # other chunks and pieces of 11 positions (the prompt padded to 33), or one piece: the same numbers
    chunked = erasure.residual_erasure(
        params, batch, CONFIG, baseline, erasure.Erasure(blocks=3), execution=Execution(chunk_size=7)
    )
    np.testing.assert_allclose(chunked.effects, result.effects, rtol=1e-5, atol=1e-7)
    chunked = erasure.residual_erasure(
        params, batch, CONFIG, baseline, erasure.Erasure(blocks=1), execution=Execution(chunk_size=5)
    )
    np.testing.assert_allclose(chunked.effects, result.effects, rtol=1e-5, atol=1e-7)
    i = 1
    one = batch.single(i)
    tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
    clean = probs(params, tokens, valid)
    answer = one.answer_prediction_mask()[0]
    length = int(one.lengths[0])
    for l in range(CONFIG.num_layers + 1):
        for t in range(length):
            iv = sites.replace("resid_pre", l, np.arange(one.tokens.shape[1]) == t, baseline[l])
            diff = np.linalg.norm(probs(params, tokens, valid, iv) - clean, axis=-1)[0]
            assert result.effects[i, l, t] == pytest.approx(diff[answer].max(), abs=2e-6)
    # after the last answer-predicting position nothing can change: exact zeros
    assert np.all(result.effects[i, :, length - 1 :] == 0.0)
    assert np.all(result.effects[0, :, int(batch.lengths[0]) - 1 :] == 0.0)


def test_the_analyses_of_a_run_compute_their_shared_baseline_once(params, batch, monkeypatch):
    """Erasure, attribution patching and gradient x activation of one run take one baseline:
    `baseline_residuals` computes it once for the same model and prompts, anew for other
    prompts or another model, and gives what `mean_residuals` gives."""
    from types import SimpleNamespace

    from jaxdepth.analyses.suite import RunInputs, Settings

    computed = []
    mean_residuals = erasure.mean_residuals
    monkeypatch.setattr(erasure, "mean_residuals", lambda *a, **k: computed.append(1) or mean_residuals(*a, **k))
    monkeypatch.setattr(erasure, "_last_baseline", [])
    model = SimpleNamespace(params=params, config=CONFIG)
    run = lambda model, prompts, baseline=None: RunInputs(
        model=model, batch=prompts, settings=Settings(), baseline_batch=baseline
    )
    first = erasure.baseline_residuals(run(model, batch))
    np.testing.assert_array_equal(first, mean_residuals(params, batch, CONFIG))
    assert erasure.baseline_residuals(run(model, batch.select([0, 1]), baseline=batch)) is first
    assert len(computed) == 1
    assert not first.flags.writeable  # shared by the analyses: none may change it
    erasure.baseline_residuals(run(model, batch.select([0])))  # other prompts
    other_params = jax.tree.map(lambda x: x, params)
    erasure.baseline_residuals(run(SimpleNamespace(params=other_params, config=CONFIG), batch.select([0])))
    assert len(computed) == 3


def test_the_execution_reaches_the_sweep(params, batch, monkeypatch):
    """An `Execution`'s chunk size is the erasures' chunk (a static argument: traced anew) and
    changes nothing but the chunking; its progress steps once per position piece."""
    chunks = record_chunks(monkeypatch, erasure)
    Recorder, bars = bar_recorder()
    one = batch.select([1])
    baseline = erasure.mean_residuals(params, batch, CONFIG)
    full = erasure.residual_erasure(params, one, CONFIG, baseline)
    chunked = erasure.residual_erasure(
        params, one, CONFIG, baseline, execution=Execution(chunk_size=2, progress=Recorder)
    )
    assert 2 in chunks
    pieces = erasure.pieces_to_run(one.prompt(0))
    assert [(b.total, b.done) for b in bars] == [(pieces, pieces)]
    np.testing.assert_allclose(chunked.effects, full.effects, rtol=1e-5, atol=1e-7)
