"""Tuned lens (Belrose et al. 2023): the logit lens read through one learned affine translator
per layer.

The logit lens decodes h_l with the final norm and LM head, as if every layer already spoke the
final layer's basis; early layers do not, which biases the KL and overlap effective depths. A
tuned lens first maps h_l to `h_l + h_l W_l + b_l` (W_l, b_l start at zero, so an untrained lens
IS the logit lens) and is trained to make the decoded distribution match the model's final one.

- `TunedLens`: an NNX module holding the translators, stacked on a layer axis.
- `train_tuned_lens`: optax on the KL of the final distribution to the lens distribution
  (Belrose's objective), random minibatches of tokens with all layers each, deterministic per
  step, resumable from any `LensTrainingState` (`jaxdepth.lab.lens_study` checkpoints them with
  orbax, so a rerun resumes where a stopped one left off).
- `jaxdepth.analyses.logit_lens.logit_lens(..., translators=...)`: the KL / overlap curves read
  through it, in the same result type as the logit lens.
"""

from __future__ import annotations

import dataclasses
import os
from functools import partial
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from jaxdepth.core.execution import Execution
from jaxdepth.core.progress import progress_bar, track
from jaxdepth.core.batch import PromptBatch
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.model import residual_stream, unembed
from jaxdepth.analyses.metrics import kl_divergence

__all__ = [
    "WITH_PROGRESS",
    "TunedLens",
    "train_tuned_lens",
    "LensTrainingSettings",
    "LensTrainingState",
    "initial_state",
    "ResidualTokens",
    "residual_tokens",
    "identity_translators",
    "lens_kl",
    "load_tuned_lens",
    "translate",
]

Translators = dict  # {"weight": [L, D, D], "bias": [L, D]}


class TunedLens(nnx.Module):
    """One affine translator per layer l = 0..L-1, `h -> h + h @ weight[l] + bias[l]`, as
    `nnx.Param`s stacked on the layer axis. A new lens is the identity (the logit lens)."""

    def __init__(self, num_layers: int, hidden_size: int, *, translators: Optional[Translators] = None):
        if translators is None:
            translators = identity_translators(num_layers, hidden_size)
        self.weight = nnx.Param(translators["weight"])
        self.bias = nnx.Param(translators["bias"])

    def translators(self) -> Translators:
        """The pure pytree the functions below take (the same arrays)."""
        return nnx.state(self, nnx.Param).to_pure_dict()


def identity_translators(num_layers: int, hidden_size: int, dtype=jnp.float32) -> Translators:
    """Translators that change nothing, `{"weight": zeros [L, D, D], "bias": zeros [L, D]}`: the
    lens they make is the logit lens (`translate` is `h + h @ weight + bias`)."""
    return {
        "weight": jnp.zeros((num_layers, hidden_size, hidden_size), dtype),
        "bias": jnp.zeros((num_layers, hidden_size), dtype),
    }


def translate(h: Float[Array, "*b D"], weight: Float[Array, "D D"], bias: Float[Array, " D"]) -> Float[Array, "*b D"]:
    """One layer's translator, in float32, the result in h's dtype. Residual form: zero weight
    and bias give back h bit for bit (so an untrained lens decodes as the logit lens does)."""
    h32 = h.astype(jnp.float32)
    return (h32 + jnp.einsum("...d,de->...e", h32, weight) + bias).astype(h.dtype)


# ----------------------------------------------------------------------------- training


def lens_kl(
    translators: Translators,
    params,
    hs: Float[Array, "L N D"],
    final_logits: Float[Array, "N V"],
    config: ModelConfig,
) -> Float[Array, "L N"]:
    """KL(P || P_l^tuned) per layer and token, from the final logits `[N, V]` (log-probabilities
    serve too: the same distribution): the training objective (Belrose et al.: the final
    distribution first, so the lens is pulled to cover everything the model predicts), the
    KL of `jaxdepth.analyses.metrics.kl_divergence`. Layers are decoded one at a time
    (`lax.map`): one `[N, V]` logit buffer at once."""

    def one_layer(args):
        h, w, b = args
        return kl_divergence(final_logits, unembed(params, translate(h, w, b), config))

    return jax.lax.map(one_layer, (hs, translators["weight"], translators["bias"]))


@dataclasses.dataclass(frozen=True)
class LensTrainingSettings:
    """Everything that changes a trained lens. `tokens_per_step` tokens are drawn per step (all
    L layers of each); the learning rate warms up over the first `warmup` steps, then decays
    (cosine) to a tenth by the last."""

    steps: int = 200
    tokens_per_step: int = 64
    learning_rate: float = 1e-3
    warmup: int = 20
    seed: int = 0
    checkpoint_every: int = 25


def _optimizer(s: LensTrainingSettings):
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, s.learning_rate, min(s.warmup, s.steps - 1) or 1, s.steps, s.learning_rate / 10
    )
    return optax.adam(schedule)


@partial(jit, static_argnames=("config", "optimizer"))
def _train_step(translators, opt_state, params, hs, h_final, config: ModelConfig, optimizer):
    import optax

    final = unembed(params, h_final, config)
    loss, grads = jax.value_and_grad(lambda t: jnp.mean(lens_kl(t, params, hs, final, config)))(translators)
    updates, opt_state = optimizer.update(grads, opt_state, translators)
    return optax.apply_updates(translators, updates), opt_state, loss


@dataclasses.dataclass
class ResidualTokens:
    """The residuals of every valid token of a batch: `hs [L, N, D]` (h_0..h_{L-1}) and
    `final [N, D]` (h_L), N = the number of valid tokens. What a lens is trained on."""

    hs: np.ndarray
    final: np.ndarray

    def __len__(self) -> int:
        return self.final.shape[0]


# What the lens's own drivers show by default: a bar, since a training runs for minutes.
WITH_PROGRESS = Execution(progress=True)


def residual_tokens(
    params, batch: PromptBatch, config: ModelConfig, *, execution: Execution = WITH_PROGRESS
) -> ResidualTokens:
    """Run the model once per prompt (at its own length) and keep each valid token's residuals;
    `execution.progress` counts the prompts."""
    hs, final = [], []
    for i in track(range(len(batch)), execution.progress, "residual streams"):
        one = batch.single(i)
        h = np.asarray(_residual_stream(params, jnp.asarray(one.tokens), jnp.asarray(one.valid), config))
        n = int(one.valid.sum())
        hs.append(h[:-1, 0, :n])
        final.append(h[-1, 0, :n])
    return ResidualTokens(np.concatenate(hs, axis=1), np.concatenate(final, axis=0))


_residual_stream = jit(
    lambda params, tokens, valid, config: residual_stream(params, tokens, config, valid=valid), static_argnames="config"
)


def _draw(step: int, seed: int, n: int, k: int) -> np.ndarray:
    # A pure function of (seed, step): a resumed run draws exactly what an uninterrupted one does.
    return np.sort(np.random.default_rng([seed, step]).choice(n, size=min(k, n), replace=False))


@dataclasses.dataclass(frozen=True)
class LensTrainingState:
    """Where a training stands: the `step`s done, the `translators` and the optimizer state.
    `train_tuned_lens` starts from one (to resume) and hands one to `on_step` after each step
    (to checkpoint); `jaxdepth.lab.lens_study` keeps them on disk."""

    step: int
    translators: Translators
    opt_state: object


def initial_state(config: ModelConfig, settings: LensTrainingSettings) -> LensTrainingState:
    """Step 0: identity translators (the logit lens) and a fresh optimizer state."""
    translators = identity_translators(config.num_layers, config.hidden_size)
    return LensTrainingState(0, translators, _optimizer(settings).init(translators))


def train_tuned_lens(
    params,
    data: ResidualTokens,
    config: ModelConfig,
    settings: LensTrainingSettings = LensTrainingSettings(),
    *,
    state: Optional[LensTrainingState] = None,
    on_step: Optional[Callable[[LensTrainingState, float], None]] = None,
    stop_after: Optional[int] = None,
    execution: Execution = WITH_PROGRESS,
) -> tuple[TunedLens, np.ndarray]:
    """Train a tuned lens on `data` from `state` (default: `initial_state`) to `settings.steps`;
    returns it and the training loss per step run (`execution.progress` counts the steps).

    Each step's minibatch is a pure function of (seed, step), so a training resumed from a
    state equals an uninterrupted one. `on_step(state, loss)` is called after every step (the
    shell checkpoints there). `stop_after` ends the run after that step, as an interruption
    would (tests use it)."""
    L, D = config.num_layers, config.hidden_size
    if data.hs.shape[0] != L or data.hs.shape[2] != D:
        raise ValueError(f"residuals of shape {data.hs.shape} do not fit a model with L={L}, D={D}")
    optimizer = _optimizer(settings)
    state = initial_state(config, settings) if state is None else state
    translators, opt_state = state.translators, state.opt_state
    end = settings.steps if stop_after is None else min(stop_after, settings.steps)
    losses = []
    with progress_bar(execution.progress, total=settings.steps, initial=state.step, desc="tuned lens (steps)") as bar:
        for step in range(state.step, end):
            idx = _draw(step, settings.seed, len(data), settings.tokens_per_step)
            translators, opt_state, loss = _train_step(
                translators,
                opt_state,
                params,
                jnp.asarray(data.hs[:, idx]),
                jnp.asarray(data.final[idx]),
                config,
                optimizer,
            )
            losses.append(float(loss))
            bar.update(1)
            bar.set_postfix(kl=f"{losses[-1]:.3f}")
            if on_step is not None:
                on_step(LensTrainingState(step + 1, translators, opt_state), losses[-1])
    return TunedLens(L, D, translators=translators), np.asarray(losses, np.float32)


def load_tuned_lens(path: str, config: ModelConfig) -> TunedLens:
    """The lens of the latest checkpoint in `path`, a folder `jaxdepth tuned-lens` trains into
    (`jaxdepth.lab.lens_study.train_resumably`): a FileNotFoundError where there is none, a
    ValueError where its translators do not fit `config`'s model."""
    import orbax.checkpoint as ocp

    if not os.path.exists(os.path.join(path, "lens.json")):
        raise FileNotFoundError(f"{path}: no tuned lens here (no lens.json)")
    with ocp.CheckpointManager(os.path.abspath(path)) as manager:
        step = manager.latest_step()
        if step is None:
            raise FileNotFoundError(f"{path}: the lens has no checkpoint yet")
        state = manager.restore(step)
    w, b = np.asarray(state["translators"]["weight"]), np.asarray(state["translators"]["bias"])
    if w.shape != (config.num_layers, config.hidden_size, config.hidden_size):
        raise ValueError(
            f"{path}: translators of shape {w.shape} do not fit this model "
            f"(L={config.num_layers}, D={config.hidden_size})"
        )
    return TunedLens(
        config.num_layers, config.hidden_size, translators={"weight": jnp.asarray(w), "bias": jnp.asarray(b)}
    )
