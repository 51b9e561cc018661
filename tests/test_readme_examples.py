"""The "Write your own" examples of docs/api.md (once the README's) run exactly as written on the
embedded model, and compute what they say they compute."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_docs import ROOT, python_blocks

API = os.path.join(ROOT, "docs", "api.md")


def _examples() -> list[str]:
    return python_blocks("docs/api.md", "Write your own")


def test_each_example_is_at_most_20_lines():
    blocks = _examples()
    assert len(blocks) == 3
    assert all(len(b.strip().splitlines()) <= 20 for b in blocks), [len(b.strip().splitlines()) for b in blocks]


@pytest.mark.slow(seconds=50)
def test_readme_examples_run_as_written(smollm2, capsys):
    from jaxdepth.core import sites
    from jaxdepth.core.loops import run_layers
    from jaxdepth.core.model import embed, forward

    namespace: dict = {}
    for block in _examples():  # in order, in one namespace, as a reader pastes them
        exec(compile(block, API, "exec"), namespace)
    printed = capsys.readouterr().out
    assert "P(' rain') when steering at layer l:" in printed and "heads whose patch" in printed
    p, config, L, H = namespace["p"], namespace["config"], namespace["L"], namespace["H"]

    # 1. steering: one probability per layer, each the same as a single steered forward
    p_rain, rain = np.asarray(namespace["p_rain"]), namespace["rain"]
    weather = jnp.asarray(smollm2.encode("The weather today is")[None])
    assert p_rain.shape == (L,) and np.all((p_rain >= 0) & (p_rain <= 1))
    for layer in (0, L // 2, L - 1):
        iv = sites.add("resid_pre", layer, namespace["vector"], jnp.ones(weather.shape[1]))
        one = jax.nn.softmax(forward(p, weather, config, interventions=iv)[0, -1])[rain]
        np.testing.assert_allclose(p_rain[layer], one, rtol=1e-4, atol=1e-6)
    unsteered = float(jax.nn.softmax(forward(p, weather, config)[0, -1])[rain])
    assert p_rain.max() > 10 * unsteered, (p_rain.max(), unsteered)

    # 2. patching: [L, H], member (l, h) equals patching that one head by hand
    log_p = np.asarray(namespace["log_p_paris"])
    assert log_p.shape == (L, H)
    clean, cached, paris = namespace["clean"], namespace["cached"], namespace["paris"]
    for layer, head in ((0, 0), (L - 1, H - 1), (L // 2, 3)):

        def write(value, index, data, layer=layer, head=head):
            return jnp.where(index == layer, value.at[:, :, head].set(data[layer, :, :, head]), value)

        logits = forward(p, clean, config, interventions=sites.Intervention("head_out", write, cached))
        np.testing.assert_allclose(log_p[layer, head], jax.nn.log_softmax(logits[0, -1])[paris], rtol=1e-4, atol=1e-4)
    assert np.ptp(log_p) > 1e-3  # some heads matter

    # 3. the tap: ||m_l|| per layer and position, as computed from the full MLP outputs
    tokens = namespace["tokens"]
    _, full = run_layers(p, embed(p, tokens, config), config, tap=lambda r, _: r.mlp)
    np.testing.assert_allclose(namespace["mlp_norms"], np.linalg.norm(np.asarray(full)[:, 0], axis=-1), rtol=1e-5)
