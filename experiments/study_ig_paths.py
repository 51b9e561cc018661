"""The studies' integrated gradients taken apart, for the IG experiments: one prompt's targets
and baselines, one layer's path, and the gradients along it at nodes the experiment chooses.

The studies' IG (`jaxdepth.analyses.integrated_gradients`) runs these steps inside the engine
(`jaxdepth.analyses.ig.engine.attribute`), a whole rule at a time. The experiments that time or
compare rules (`ig_accuracy.py`, `ig_default_rule.py`, `ig_chunk_width.py`) run them one by one:
the nodes of several rules evaluated once and shared, one layer timed at several vmap widths.
Each function calls the engine's own compiled pieces (`jaxdepth.analyses.ig.path`) with the
studies' F (`jaxdepth.analyses.metrics.answer_probability` at the answer span) and the static
arguments the engine passes, so
that what an experiment measures is what a study runs and shares its compilations.

    from study_ig_paths import ig_inputs, path_points  # experiments/ on the path, as a script has it
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.analyses.ig.checks import ig_baseline
from jaxdepth.analyses.ig.path import LayerPath, Objective, attribution_of, clean_values, weighted_gradient
from jaxdepth.analyses.ig.path import path_points as site_path_points
from jaxdepth.analyses.ig.engine import prompt_reads
from jaxdepth.analyses.integrated_gradients import TARGETS
from jaxdepth.analyses.metrics import answer_probability
from jaxdepth.core.batch import PromptArrays
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig


@partial(jit, static_argnames=("config", "baseline", "target"))
def ig_inputs(
    params,
    prompt: PromptArrays,
    config: ModelConfig,
    *,
    baseline: str = "channel_mean",
    interventions=None,
    target: str = "layer",
):
    """Each layer's target x `[L, T, D]` (float32: its output, or its attention or MLP output),
    its baseline b (broadcast to x), each layer's input before its interventions `[L, T, D]`
    (what a sublayer target recomputes the layer from) and F(x), all under `interventions`."""
    x, inputs, f_input, _ = clean_values(
        params, prompt.tokens, prompt.valid, config, _objective(prompt, target), interventions=interventions
    )
    b = jnp.broadcast_to(jax.vmap(lambda xl: ig_baseline(xl, prompt.valid, baseline))(x), x.shape)
    return x[:, 0], b[:, 0], inputs[:, 0], f_input[0]


def study_path(x, b, inputs, layer, target: str) -> LayerPath:
    """Layer `layer`'s path for a study target, from `ig_inputs`' `[L, T, D]` arrays (batch 1);
    its prompt's `valid` is set where it is evaluated (`ig_of_layer`, `path_points`)."""
    h_in = None if target == "layer" else inputs[layer][None]
    return LayerPath(x[layer][None], b[layer][None], np.int32(layer), None, h_in)


def ig_of_layer(
    params,
    prompt: PromptArrays,
    layer,
    path: LayerPath,
    config: ModelConfig,
    *,
    alphas,
    weights,
    chunk_size: Optional[int] = None,
    interventions=None,
    target: str = "layer",
    backward: str = "recompute",
):
    """IG of one layer along `path` (`study_path`) with the rule `alphas`, `weights`:
    `(attributions [T], F(b))`, the engine's `weighted_gradient` with the studies' F (the
    computation the engine compiles: `backward` passed on as it passes it)."""
    path = dataclasses.replace(path, layer=layer, valid=prompt.valid)
    g, f_base = weighted_gradient(
        params,
        path,
        (alphas, weights),
        config,
        _objective(prompt, target),
        chunk_size=chunk_size,
        interventions=interventions,
        backward=backward,
    )
    return attribution_of(path, g)[0], f_base[0]


def path_points(
    params,
    prompt: PromptArrays,
    x,
    b,
    inputs,
    *,
    layer: int,
    alphas,
    config: ModelConfig,
    interventions=None,
    target: str = "layer",
    grad: bool = True,
    chunk_size: Optional[int] = None,
    backward: str = "recompute",
):
    """The adaptive rule's evaluations (`jaxdepth.analyses.ig.path.path_points`) of layer `layer`
    for a study target with the studies' F (`x`, `b`, `inputs` `[L, T, D]` as from `ig_inputs`).
    `backward` is always passed on, as the engine passes it: a static argument given or left to
    its default would be two compilations."""
    return site_path_points(
        params,
        dataclasses.replace(study_path(x, b, inputs, layer, target), valid=prompt.valid),
        np.asarray(alphas, np.float32),
        config,
        _objective(prompt, target),
        interventions=interventions,
        chunk_size=chunk_size,
        backward=backward if grad else None,
    )


def _objective(prompt: PromptArrays, target: str) -> Objective:
    """The studies' F on `prompt` at a study target's site."""
    return Objective(TARGETS[target], answer_probability, prompt_reads(answer_probability, prompt))
