"""Tuned lens on a tiny random model: identity translators are the logit lens exactly, training
lowers the KL on held-out prompts, a resumed training equals an uninterrupted one, and the
orbax checkpoint loads back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdepth.analyses import logit_lens, tuned_lens
from jaxdepth.analyses.tuned_lens import LensTrainingSettings, TunedLens
from jaxdepth.core.batch import make_batch
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import random_params

CONFIG = ModelConfig(
    model_type="qwen2",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=1e4,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    qkv_bias=True,
)
SETTINGS = LensTrainingSettings(steps=6, tokens_per_step=32, learning_rate=1e-2, warmup=2, checkpoint_every=2)


@pytest.fixture(scope="module")
def params():
    return random_params(CONFIG, 1, scale=0.2)


def prompts(seed, count, length=24):
    rng = np.random.default_rng(seed)
    return make_batch([rng.integers(0, 97, length - i).tolist() for i in range(count)], [length // 2] * count)


@pytest.fixture(scope="module")
def data(params):
    return tuned_lens.residual_tokens(params, prompts(0, 12), CONFIG, progress=False)


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
    final_logp = jax.nn.log_softmax(tuned_lens.unembed(params, jnp.asarray(data.final), CONFIG), axis=-1)
    return np.asarray(tuned_lens.lens_kl(translators, params, jnp.asarray(data.hs), final_logp, CONFIG)).mean(axis=1)


def test_training_lowers_held_out_kl(params, data):
    held_out = tuned_lens.residual_tokens(params, prompts(99, 4), CONFIG, progress=False)
    settings = LensTrainingSettings(steps=60, tokens_per_step=64, learning_rate=1e-2, warmup=5)
    lens, losses = tuned_lens.train_tuned_lens(params, data, CONFIG, settings, progress=False)
    before = held_out_kl(params, TunedLens(CONFIG.num_layers, CONFIG.hidden_size).translators(), held_out)
    after = held_out_kl(params, lens.translators(), held_out)
    assert losses.shape == (60,) and losses[-10:].mean() < losses[:10].mean()
    # Every layer improves on prompts it never saw (60 steps: about 27% lower on average).
    assert np.all(after < before), (before, after)
    assert after.mean() < 0.9 * before.mean(), (before, after)


def test_resumed_training_equals_uninterrupted(params, data, tmp_path):
    whole, whole_losses = tuned_lens.train_tuned_lens(params, data, CONFIG, SETTINGS, progress=False)
    folder = str(tmp_path / "lens")
    # Interrupted after step 3: the last checkpoint is step 2 (every 2 steps), so step 3 is redone.
    _, first = tuned_lens.train_tuned_lens(
        params, data, CONFIG, SETTINGS, checkpoint_dir=folder, stop_after=3, progress=False
    )
    assert tuned_lens.trained_lens(folder, CONFIG, SETTINGS) is None  # unfinished
    resumed, rest = tuned_lens.train_tuned_lens(params, data, CONFIG, SETTINGS, checkpoint_dir=folder, progress=False)
    assert len(first) == 3 and len(rest) == 4  # resumed at step 2, not from scratch
    np.testing.assert_array_equal(np.concatenate([first[:2], rest]), whole_losses)
    assert first[2] == rest[0]  # the redone step is the same step
    for key in ("weight", "bias"):
        np.testing.assert_array_equal(np.asarray(resumed.translators()[key]), np.asarray(whole.translators()[key]))
    loaded = tuned_lens.trained_lens(folder, CONFIG, SETTINGS)  # finished: reused as it is
    for key in ("weight", "bias"):
        np.testing.assert_array_equal(np.asarray(loaded.translators()[key]), np.asarray(whole.translators()[key]))
    assert np.any(np.asarray(loaded.translators()["weight"]))  # trained, not the identity


def test_bad_inputs(params, data, tmp_path):
    folder = str(tmp_path / "lens")
    tuned_lens.train_tuned_lens(params, data, CONFIG, SETTINGS, checkpoint_dir=folder, stop_after=2, progress=False)
    with pytest.raises(ValueError, match="other settings"):
        tuned_lens.train_tuned_lens(
            params, data, CONFIG, LensTrainingSettings(steps=7), checkpoint_dir=folder, progress=False
        )
    with pytest.raises(ValueError, match="other data"):  # a lens is never reused on other prompts
        tuned_lens.trained_lens(folder, CONFIG, SETTINGS, {"train_tokens_sha": "another"})
    with pytest.raises(FileNotFoundError, match="no tuned lens"):
        tuned_lens.load_tuned_lens(str(tmp_path / "nowhere"), CONFIG)
    other = ModelConfig.from_dict({**CONFIG.to_dict(), "num_layers": 5})
    with pytest.raises(ValueError, match="do not fit"):
        tuned_lens.load_tuned_lens(folder, other)
