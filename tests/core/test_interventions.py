"""Unit tier: interventions in the scanned forward equal a plain, unscanned reference.

The reference below is an explicit Python loop over layers built from the model's building
blocks, so it shares their numerics but none of `run_layers`' scan or keep-mask machinery: it
removes contributions and writes vectors with `where` on boolean masks, where the forward
multiplies by float keep-masks. No torch.
"""

from __future__ import annotations

import dataclasses
import functools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, assert_moved
from jaxdepth.core.config import ModelConfig
from jaxdepth.core import sites
from jaxdepth.core.layer import attention, attention_mask, LayerRecord, mlp, norm, rotary_tables
from jaxdepth.core.loops import LayerRun, clean_key_values, run_layers
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, forward, random_params, residual_stream, unembed

TOL = 1e-5
B, T = 2, 12
# Positions hit by an intervention: the same for every prompt ([T]) or per prompt ([B, T]).
P_SHARED = np.zeros(T, np.float32)
P_SHARED[[3, 7, 11]] = 1.0
P_PER_ROW = np.zeros((B, T), np.float32)
P_PER_ROW[0, [2, 9]] = 1.0
P_PER_ROW[1, [5, 6, 11]] = 1.0
POSITION_SETS = {"shared": P_SHARED, "per_row": P_PER_ROW}
# where each skip acts: the whole layer's contribution, or one sublayer's output
SUBLAYERS = {"layer": "delta", "attn": "attn_out", "mlp": "mlp_out"}

CONFIGS = {
    "qwen2_untied": ModelConfig(
        model_type="qwen2",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=12345.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        qkv_bias=True,
    ),
    "llama_tied": ModelConfig(
        model_type="llama",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        qkv_bias=False,
    ),
}


# Compare at full float32 matmul precision (as the references compute).
pytestmark = pytest.mark.usefixtures("highest_precision")


@functools.lru_cache(maxsize=None)
def _model(name):
    config = CONFIGS[name]
    # scale 0.2: sharp attention and sizeable sublayer outputs, so every intervention moves the
    # logits far more than TOL (checked in each test).
    params = random_params(config, sorted(CONFIGS).index(name), scale=0.2)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, size=(B, T)), jnp.int32)
    return params, tokens, config


@pytest.fixture(params=sorted(CONFIGS))
def setup(request):
    """Both configs (qkv biases or not, tied or not): for the core semantics. (They share
    shapes so that `random_params`' eager compilations are reused.)"""
    return _model(request.param)


@pytest.fixture
def setup_one():
    """One config, for the transformation tests (each costs several compilations)."""
    return _model("qwen2_untied")


@partial(jax.jit, static_argnames="config")
def jit_forward(params, tokens, config, interventions=None):
    return forward(params, tokens, config, interventions=interventions)


# ----------------------------------------------------------------------------- the reference


def _bt(mask) -> np.ndarray:
    """A [T] or [B, T] position mask as a boolean [B, T]."""
    return np.broadcast_to(np.asarray(mask) > 0, (B, T))


def _dense(pairs, L):
    """(layer, positions) pairs as a boolean [L, B, T] mask."""
    out = np.zeros((L, B, T), bool)
    for layer, pos in pairs:
        out[layer] |= _bt(pos)
    return out


def reference(params, tokens, config, *, skip=(), zero_attn=(), zero_mlp=(), writes=(), bump=None):
    """Plain forward. `skip`/`zero_attn`/`zero_mlp`: (layer, positions) pairs removing layer l's
    contribution / its attention output / its MLP output at those positions. `writes`:
    (boundary, positions, value) triples writing `value` into h_boundary at those positions.
    `bump` ([L+1, B, T, D] or None) is added to every boundary after the writes (for gradients).
    Returns (logits, [h_0..h_L], [(a_l, m_l)])."""
    L, D = config.num_layers, config.hidden_size
    write_mask = np.zeros((L + 1, B, T), bool)
    write_value = np.zeros((L + 1, B, T, D), np.float32)
    for boundary, pos, value in writes:
        hit = _bt(pos)
        write_mask[boundary] |= hit
        write_value[boundary] = np.where(hit[..., None], np.broadcast_to(value, (B, T, D)), write_value[boundary])
    bump = jnp.zeros((L + 1, B, T, D)) if bump is None else bump
    return _reference(
        params,
        tokens,
        config,
        _dense(skip, L),
        _dense(zero_attn, L),
        _dense(zero_mlp, L),
        write_mask,
        write_value,
        bump,
    )


@partial(jax.jit, static_argnames="config")
def _reference(params, tokens, config, skip, zero_attn, zero_mlp, write_mask, write_value, bump):
    # A Python loop (unrolled under jit, no scan); interventions by `where`, not by multiplying.
    L = config.num_layers
    mask = attention_mask(jnp.ones((B, T), bool))
    cos, sin = rotary_tables(T, config)

    def boundary(h, b):
        return jnp.where(write_mask[b][..., None], write_value[b], h) + bump[b]

    h = embed(params, tokens, config)
    hs, sub = [], []
    for l in range(L):
        h = boundary(h, l)
        hs.append(h)
        p = {name: w[l] for name, w in params["layers"].items()}
        a = attention(p, norm(h, p["attn_norm"], config), cos, sin, mask, config)
        a = jnp.where(zero_attn[l][..., None], 0.0, a)
        m = mlp(p, norm(h + a, p["mlp_norm"], config), config)
        m = jnp.where(zero_mlp[l][..., None], 0.0, m)
        sub.append((a, m))
        h = jnp.where(skip[l][..., None], h, h + (a + m))
    h = boundary(h, L)
    hs.append(h)
    return unembed(params, h, config), hs, sub


# ----------------------------------------------------------------------------- tests


def test_reference_equals_clean_forward(setup):
    params, tokens, config = setup
    ref, hs, _ = reference(params, tokens, config)
    assert_close(jit_forward(params, tokens, config), ref, "clean logits")
    stream = jax.jit(residual_stream, static_argnames="config")(params, tokens, config)
    assert stream.shape == (config.num_layers + 1, B, T, config.hidden_size)
    for l, h in enumerate(hs):
        assert_close(stream[l], h, f"h_{l}")


@pytest.mark.parametrize("positions", sorted(POSITION_SETS))
@pytest.mark.parametrize("sublayer", ["layer", "attn", "mlp"])
def test_skip_matches_reference(setup, sublayer, positions):
    params, tokens, config = setup
    P = POSITION_SETS[positions]
    clean = jit_forward(params, tokens, config)
    kind = {"layer": "skip", "attn": "zero_attn", "mlp": "zero_mlp"}[sublayer]
    first_hit = _bt(P).argmax(axis=1)  # per row, the first intervened position
    for s in range(config.num_layers):
        iv = sites.skip(SUBLAYERS[sublayer], s, P)
        got = jit_forward(params, tokens, config, iv)
        ref, _, _ = reference(params, tokens, config, **{kind: [(s, P)]})
        assert_close(got, ref, f"{sublayer} of layer {s} at {positions} positions")
        assert_moved(got, clean, f"{sublayer} of layer {s}")
        for b in range(B):  # causality: positions before the first hit are untouched
            np.testing.assert_allclose(got[b, : first_hit[b]], clean[b, : first_hit[b]], rtol=0, atol=TOL)


def test_several_keep_masks_at_once(setup):
    """Keep-masks of whole layers, attention and MLP outputs combined, on different layers and
    positions, with [L, B, T] masks."""
    params, tokens, config = setup
    L = config.num_layers
    keep_layer, keep_attn, keep_mlp = (np.ones((L, B, T), np.float32) for _ in range(3))
    keep_attn[0] = 1 - P_PER_ROW
    keep_layer[1] = 1 - _bt(P_SHARED)
    keep_mlp[2] = 1 - P_PER_ROW
    keep_mlp[0] = 1 - _bt(P_SHARED)
    iv = [sites.keep("delta", keep_layer), sites.keep("attn_out", keep_attn), sites.keep("mlp_out", keep_mlp)]
    ref, _, _ = reference(
        params,
        tokens,
        config,
        zero_attn=[(0, P_PER_ROW)],
        skip=[(1, P_SHARED)],
        zero_mlp=[(2, P_PER_ROW), (0, P_SHARED)],
    )
    assert_close(jit_forward(params, tokens, config, iv), ref, "combined keep masks")


def test_skipping_a_layer_everywhere_equals_deleting_it(setup_one):
    params, tokens, config = setup_one
    shorter_config = dataclasses.replace(config, num_layers=config.num_layers - 1)
    for s in range(config.num_layers):
        got = jit_forward(params, tokens, config, sites.skip("delta", s, np.ones(T, np.float32)))
        kept = np.array([l for l in range(config.num_layers) if l != s])
        shorter = {**params, "layers": {k: v[kept] for k, v in params["layers"].items()}}
        assert_close(got, jit_forward(shorter, tokens, shorter_config), f"layer {s} skipped everywhere vs removed")


@pytest.mark.parametrize("positions", sorted(POSITION_SETS))
def test_replace_residual_matches_writing_by_hand(setup, positions):
    params, tokens, config = setup
    P = POSITION_SETS[positions]
    clean = jit_forward(params, tokens, config)
    value = jax.random.normal(jax.random.key(7), (B, T, config.hidden_size))
    for boundary in range(config.num_layers + 1):
        got = jit_forward(params, tokens, config, sites.replace("resid_pre", boundary, P, value))
        ref, _, _ = reference(params, tokens, config, writes=[(boundary, P, value)])
        assert_close(got, ref, f"h_{boundary} replaced at {positions} positions")
        assert_moved(got, clean, f"h_{boundary} replaced")
    hit = jnp.asarray(_bt(P))[..., None]
    # Boundary 0 is the embeddings: same as running the layers on edited embeddings.
    h0 = jnp.where(hit, value, embed(params, tokens, config))
    by_hand = jax.jit(lambda p, h: unembed(p, run_layers(p, h, config)[0], config))(params, h0)
    assert_close(jit_forward(params, tokens, config, sites.replace("resid_pre", 0, P, value)), by_hand, "h_0")
    # Boundary L is the input of the final norm: the logits there are the lens of the value.
    got = jit_forward(params, tokens, config, sites.replace("resid_pre", config.num_layers, P, value))
    assert_close(got, jnp.where(hit, unembed(params, value, config), clean), "h_L")


def test_replace_residual_broadcasts_one_vector(setup_one):
    params, tokens, config = setup_one
    v = jax.random.normal(jax.random.key(8), (config.hidden_size,))
    got = jit_forward(params, tokens, config, sites.replace("resid_pre", 1, P_SHARED, v))
    ref, _, _ = reference(params, tokens, config, writes=[(1, P_SHARED, v)])
    assert_close(got, ref, "one vector broadcast to the hit positions")


def test_noop_interventions_are_exact(setup):
    params, tokens, config = setup
    L = config.num_layers
    ones = jnp.ones((L, T), jnp.float32)
    noop = [
        sites.keep("delta", ones),
        sites.keep("attn_out", ones),
        sites.keep("mlp_out", ones),
        sites.skip("delta", 1, np.zeros(T, np.float32)),
        sites.replace(
            "resid_pre", 1, jnp.zeros((B, T)), jax.random.normal(jax.random.key(9), (B, T, config.hidden_size))
        ),
    ]
    clean = jit_forward(params, tokens, config)
    assert np.array_equal(jit_forward(params, tokens, config, noop), clean)
    assert np.array_equal(jit_forward(params, tokens, config, []), clean)


def test_taps_see_the_intervened_sublayers(setup_one):
    params, tokens, config = setup_one
    iv = sites.skip(SUBLAYERS["attn"], 1, P_PER_ROW)
    _, hs, sub = reference(params, tokens, config, zero_attn=[(1, P_PER_ROW)])

    def tap(record: LayerRecord, _):
        return record.index, record.h, record.attn, record.mlp, record.out, record.delta

    h_last, (index, h, a, m, out, delta) = jax.jit(
        lambda p, t, iv: run_layers(p, embed(p, t, config), config, interventions=iv, tap=tap)
    )(params, tokens, iv)
    np.testing.assert_array_equal(index, np.arange(config.num_layers))
    assert_close(h_last, hs[-1], "h_L")
    for l in range(config.num_layers):
        assert_close(h[l], hs[l], f"record.h of layer {l}")
        assert_close(a[l], sub[l][0], f"record.attn of layer {l}")
        assert_close(m[l], sub[l][1], f"record.mlp of layer {l}")
        assert_close(out[l], hs[l + 1], f"record.out of layer {l}")
        assert_close(delta[l], hs[l + 1] - hs[l], f"record.delta of layer {l}")


# ----------------------------------------------------------------------------- transformations


def _stack(ivs):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *ivs)


def test_vmap_over_a_stack_of_interventions(setup_one):
    params, tokens, config = setup_one
    L = config.num_layers
    ivs = [sites.skip("delta", s, P) for s in range(L) for P in (P_SHARED, 1 - P_SHARED)]
    batched = jax.jit(jax.vmap(lambda iv, p, t: forward(p, t, config, interventions=iv), in_axes=(0, None, None)))(
        _stack(ivs), params, tokens
    )
    assert batched.shape == (len(ivs), B, T, config.vocab_size)
    for i, iv in enumerate(ivs):
        assert_close(batched[i], jit_forward(params, tokens, config, iv), f"vmapped member {i}")


def test_vmap_over_layers_and_boundaries_with_traced_indices(setup_one):
    params, tokens, config = setup_one
    L = config.num_layers
    value = jax.random.normal(jax.random.key(10), (B, T, config.hidden_size))

    @jax.jit
    def sweep(params, tokens, value):
        skips = jax.vmap(
            lambda s: forward(params, tokens, config, interventions=sites.skip(SUBLAYERS["mlp"], s, P_PER_ROW))
        )(jnp.arange(L))
        edits = jax.vmap(
            lambda b: forward(params, tokens, config, interventions=sites.replace("resid_pre", b, P_SHARED, value))
        )(jnp.arange(L + 1))
        return skips, edits

    skips, edits = sweep(params, tokens, value)
    for s in range(L):
        assert_close(skips[s], reference(params, tokens, config, zero_mlp=[(s, P_PER_ROW)])[0], f"mlp {s}")
    for b in range(L + 1):
        assert_close(edits[b], reference(params, tokens, config, writes=[(b, P_SHARED, value)])[0], f"h_{b}")


@pytest.mark.parametrize("start", [0, 2])
@pytest.mark.parametrize("prefix_len", [1, 5, 9])
def test_suffix_run_with_clean_prefix_keys_equals_the_full_forward(setup, start, prefix_len):
    """Writing h_start at positions >= P changes nothing before P, so running only rows P..T-1
    from boundary `start`, with the clean keys and values of positions < P, gives the full
    forward's logits at those rows."""
    params, tokens, config = setup
    value = jax.random.normal(jax.random.key(12), (B, T, config.hidden_size))
    where = P_SHARED * (np.arange(T) >= prefix_len)
    expected, hs, _ = reference(params, tokens, config, writes=[(start, where, value)])
    clean_hs = residual_stream(params, tokens, config)
    keys, values = clean_key_values(params, clean_hs, config)

    @jax.jit
    def suffix_logits(h_start, keys, values, where, value):
        h, _ = run_layers(
            params,
            h_start,
            config,
            interventions=sites.replace("resid_pre", start, where, value),
            run=LayerRun(start=start, prefix=(keys, values)),
        )
        return unembed(params, h, config)

    got = suffix_logits(
        clean_hs[start][:, prefix_len:],
        keys[:, :, :prefix_len],
        values[:, :, :prefix_len],
        where[prefix_len:],
        value[:, prefix_len:],
    )
    assert_close(got, expected[:, prefix_len:], f"suffix from {prefix_len} at boundary {start}")
    assert_moved(got, jit_forward(params, tokens, config)[:, prefix_len:], "suffix write")


def _loss(logits):
    w = jax.random.normal(jax.random.key(11), logits.shape)
    return jnp.sum(jax.nn.log_softmax(logits) * w)


@partial(jax.jit, static_argnames="config")
def _edit_value_grad(params, tokens, config, boundary, positions, value):
    return jax.grad(
        lambda v: _loss(
            forward(params, tokens, config, interventions=sites.replace("resid_pre", boundary, positions, v))
        )
    )(value)


@partial(jax.jit, static_argnames="config")
def _reference_boundary_grads(params, tokens, config):
    """d loss / d h_b for every boundary b, via an additive perturbation in the reference."""
    L, D = config.num_layers, config.hidden_size
    no = jnp.zeros((L, B, T), bool)

    def loss(bump):
        return _loss(
            _reference(
                params, tokens, config, no, no, no, jnp.zeros((L + 1, B, T), bool), jnp.zeros((L + 1, B, T, D)), bump
            )[0]
        )

    return jax.grad(loss)(jnp.zeros((L + 1, B, T, D)))


def test_grad_with_respect_to_edit_value(setup_one):
    params, tokens, config = setup_one
    _, hs, _ = reference(params, tokens, config)
    g_ref = np.asarray(_reference_boundary_grads(params, tokens, config))
    hit = _bt(P_PER_ROW)
    for boundary in range(config.num_layers + 1):
        # The replacement equals the clean residual, so the forward is the clean one and the
        # gradient wrt the value is the gradient wrt h_boundary, restricted to edited positions.
        g = np.asarray(_edit_value_grad(params, tokens, config, boundary, P_PER_ROW, hs[boundary]))
        assert g.shape == (B, T, config.hidden_size) and np.all(np.isfinite(g))
        assert np.all(g[~hit] == 0.0), f"h_{boundary}: gradient leaked to positions the edit mask excludes"
        assert np.all(np.abs(g[hit]).max(axis=-1) > 0), f"h_{boundary}: no gradient at an edited position"
        scale = max(float(np.abs(g_ref[boundary]).max()), 1.0)
        np.testing.assert_allclose(
            g[hit], g_ref[boundary][hit], rtol=0, atol=TOL * scale, err_msg=f"gradient wrt h_{boundary}"
        )


def test_new_intervention_values_do_not_recompile(setup_one):
    params, tokens, config = setup_one
    L = config.num_layers
    traces = []

    @jax.jit
    def run(params, tokens, iv):
        traces.append(1)  # runs only while tracing
        return forward(params, tokens, config, interventions=iv)

    value = jax.random.normal(jax.random.key(12), (B, T, config.hidden_size))
    first = sites.skip("delta", 0, P_SHARED), sites.replace("resid_pre", 0, P_SHARED, value)
    second = sites.skip("delta", 2, P_PER_ROW[0]), sites.replace("resid_pre", L, P_PER_ROW[1], 2 * value)
    outs = []
    for skip, edit in (first, second):
        outs.append(run(params, tokens, [skip, edit]))
    assert len(traces) == 1, f"traced {len(traces)} times for two intervention values"
    # ... and the second call really used the second values.
    ref0, _, _ = reference(params, tokens, config, skip=[(0, P_SHARED)], writes=[(0, P_SHARED, value)])
    ref1, _, _ = reference(params, tokens, config, skip=[(2, P_PER_ROW[0])], writes=[(L, P_PER_ROW[1], 2 * value)])
    assert_close(outs[0], ref0, "first call")
    assert_close(outs[1], ref1, "second call")


# ----------------------------------------------------------------------------- validation


def test_a_skip_at_an_unknown_site_is_refused():
    with pytest.raises(ValueError, match="unknown intervention site 'norm'"):
        sites.skip("norm", 0, P_SHARED)


def test_anything_but_interventions_is_refused_as_interventions(setup_one):
    params, tokens, config = setup_one
    with pytest.raises(TypeError, match="interventions must be None, an Intervention"):
        forward(params, tokens, config, interventions="skip")
