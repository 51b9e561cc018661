"""Tuned lens on a tiny random model: identity translators are the logit lens exactly, training
lowers the KL on held-out prompts, and a training resumed from a state equals an uninterrupted
one (the checkpoints on disk: tests/lab/test_lens_study.py)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdepth.core.execution import Execution
from jaxdepth.analyses import logit_lens, tuned_lens
from jaxdepth.analyses.tuned_lens import LensTrainingSettings, TunedLens
from jaxdepth.core.batch import make_batch
from jaxdepth.core.model import random_params

from tiny_qwen import CONFIG  # the tiny Qwen2 every analysis test runs on

SETTINGS = LensTrainingSettings(steps=6, tokens_per_step=32, learning_rate=1e-2, warmup=2, checkpoint_every=2)


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, 1, scale=0.2)


def prompts(seed, count, length=24):
    rng = np.random.default_rng(seed)
    return make_batch([rng.integers(0, 97, length - i).tolist() for i in range(count)], [length // 2] * count)


@pytest.fixture(scope="module")
def data(params):
    return tuned_lens.residual_tokens(params, prompts(0, 12), CONFIG, execution=Execution())


def test_identity_translators_are_the_logit_lens_exactly(params):
    batch = prompts(1, 3)
    plain = logit_lens.logit_lens(params, batch, CONFIG)
    lens = TunedLens(CONFIG.num_layers, CONFIG.hidden_size)
    tuned = logit_lens.logit_lens(params, batch, CONFIG, translators=lens.translators())
    for field in ("kl", "overlap", "kl_per_prompt", "overlap_per_prompt"):
        np.testing.assert_array_equal(getattr(tuned, field), getattr(plain, field), err_msg=field)
    assert (plain.settings["lens"], tuned.settings["lens"]) == ("logit", "tuned")


def test_module_state_is_the_translators_pytree():
    lens = TunedLens(3, 8)
    pure = nnx.split(lens)[1].to_pure_dict()
    assert pure["weight"] is lens.translators()["weight"] and pure["weight"].shape == (3, 8, 8)
    assert not np.any(np.asarray(pure["weight"])) and not np.any(np.asarray(pure["bias"]))


def held_out_kl(params, translators, data):
    final = tuned_lens.unembed(params, jnp.asarray(data.final), CONFIG)
    return np.asarray(tuned_lens.lens_kl(translators, params, jnp.asarray(data.hs), final, CONFIG)).mean(axis=1)


def test_training_lowers_held_out_kl(params, data):
    held_out = tuned_lens.residual_tokens(params, prompts(99, 4), CONFIG, execution=Execution())
    settings = LensTrainingSettings(steps=60, tokens_per_step=64, learning_rate=1e-2, warmup=5)
    lens, losses = tuned_lens.train_tuned_lens(params, data, CONFIG, settings, execution=Execution())
    before = held_out_kl(params, TunedLens(CONFIG.num_layers, CONFIG.hidden_size).translators(), held_out)
    after = held_out_kl(params, lens.translators(), held_out)
    assert losses.shape == (60,) and losses[-10:].mean() < losses[:10].mean()
    # Every layer improves on prompts it never saw (60 steps: about 27% lower on average).
    assert np.all(after < before), (before, after)
    assert after.mean() < 0.9 * before.mean(), (before, after)


def test_training_resumed_from_a_state_equals_uninterrupted(params, data):
    whole, whole_losses = tuned_lens.train_tuned_lens(params, data, CONFIG, SETTINGS, execution=Execution())
    states = []
    _, first = tuned_lens.train_tuned_lens(
        params,
        data,
        CONFIG,
        SETTINGS,
        on_step=lambda state, loss: states.append((state, loss)),
        stop_after=3,
        execution=Execution(),
    )
    assert [state.step for state, _ in states] == [1, 2, 3] and [loss for _, loss in states] == list(first)
    resumed, rest = tuned_lens.train_tuned_lens(
        params, data, CONFIG, SETTINGS, state=states[1][0], execution=Execution()
    )
    assert len(rest) == SETTINGS.steps - 2  # from step 2 on, not from scratch
    np.testing.assert_array_equal(np.concatenate([first[:2], rest]), whole_losses)
    for key in ("weight", "bias"):
        np.testing.assert_array_equal(np.asarray(resumed.translators()[key]), np.asarray(whole.translators()[key]))
