"""Gemma 4 (`gemma4_text`, and the text model of the multimodal `gemma4`): its configs read as
transformers builds the layers (each layer's head shapes, which layers reuse whose keys and
values), what is not implemented refused by name, its rotary frequencies HF's bits, parity that
fails far beyond its tolerance when one of its features is switched off, the layers' keys and
values shared along a layer order, and the runs that cannot carry them refused."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_hf_config
from jaxdepth.core import sites
from jaxdepth.core.config import ModelConfig, UnsupportedConfigError
from jaxdepth.core.decoding import generate_orders
from jaxdepth.core.layer import rotary_frequencies, shared_kv_at
from jaxdepth.core.loops import LayerRun, clean_key_values, run_layers
from jaxdepth.core.model import embed, forward, per_layer_inputs, random_params, residual_stream
from jaxdepth.core.structure import group_orders, identity_order, layer_order, stack_orders

SHARED = "gemma4_shared_kv"

# A text config shaped as the hub's Gemma 4 E2B one (transformers 4 keys: `global_head_dim`, no
# `per_layer_config`), its layers cut to 10 and its widths to a few: 4 sliding layers in 5, the
# last 4 layers reusing keys and values.
E2B_LIKE = {
    "model_type": "gemma4_text",
    "architectures": ["Gemma4ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_k_eq_v": False,
    "bos_token_id": 2,
    "dtype": "bfloat16",
    "enable_moe_block": False,
    "eos_token_id": 1,
    "final_logit_softcapping": 30.0,
    "global_head_dim": 32,
    "head_dim": 16,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 64,
    "hidden_size_per_layer_input": 8,
    "initializer_range": 0.02,
    "intermediate_size": 96,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 2,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": None,
    "num_attention_heads": 8,
    "num_experts": None,
    "num_global_key_value_heads": None,
    "num_hidden_layers": 10,
    "num_key_value_heads": 1,
    "num_kv_shared_layers": 4,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
    "sliding_window": 512,
    "tie_word_embeddings": True,
    "top_k_experts": None,
    "use_bidirectional_attention": None,
    "use_cache": True,
    "use_double_wide_mlp": True,
    "vocab_size": 300,
    "vocab_size_per_layer_input": 300,
}


def _transformers_layers(hf: dict):
    """Per layer: (head_dim, key/value heads, kv sharing mode) as transformers builds them."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma4TextConfig(**{k: v for k, v in hf.items() if k not in ("model_type", "architectures")})
    return [
        (layer.head_dim, layer.num_key_value_heads, mode)
        for layer, mode in zip(config.per_layer_config, config.kv_sharing_modes)
    ], config


def _our_layers(config: ModelConfig):
    shapes = []
    for i, slides in enumerate(config.sliding_layers):
        dims = (config.head_dim, config.num_kv_heads) if slides else (config.full_head_dim, config.full_kv_heads)
        shapes.append((*dims, config.kv_source(i)))
    return shapes


@pytest.mark.parametrize("k_eq_v", [False, True])
def test_hub_and_transformers_5_configs_build_the_layers_transformers_builds(k_eq_v):
    hub = {**E2B_LIKE, "attention_k_eq_v": k_eq_v, "num_global_key_value_heads": 2 if k_eq_v else None}
    theirs, hf_config = _transformers_layers(hub)
    config = ModelConfig.from_hf(hub)
    written = ModelConfig.from_hf(hf_config.to_dict())  # transformers 5's own: `per_layer_config`
    assert written == config
    assert [(d, k) for d, k, _ in theirs] == [(d, k) for d, k, _ in _our_layers(config)]
    # each reusing layer reads the layer that stores its type's keys and values
    stores = {hf_config.layer_types[i]: i for i, (_, _, mode) in enumerate(theirs) if mode == "store"}
    for i, (_, _, mode) in enumerate(theirs):
        assert (mode == "reuse") == (i in config.shared_kv_layers)
        if mode == "reuse":
            assert config.kv_source(i) == stores[hf_config.layer_types[i]]
    assert config.wide_mlp_layers == config.shared_kv_layers == (6, 7, 8, 9)
    assert (config.keys_as_values, config.full_kv_heads) == (k_eq_v, 2 if k_eq_v else 1)
    assert (config.rope_type, config.rotary_dim, config.rope_theta, config.local_rope_theta) == (
        "proportional",
        8,
        1e6,
        1e4,
    )
    assert (config.attn_scale, config.norm_offset, config.final_softcap, config.per_layer_input_size) == (
        1.0,
        0.0,
        30.0,
        8,
    )


def test_the_multimodal_config_is_its_text_model():
    multimodal = {
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": E2B_LIKE,
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 768},
        "audio_config": None,
        "image_token_id": 258880,
        "audio_token_id": 258881,
        "video_token_id": 258884,
        "boi_token_id": 255999,
        "eoi_token_id": 258882,
        "boa_token_id": 256000,
        "eoa_token_index": 258883,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
    }
    config = ModelConfig.from_hf(multimodal)
    text = ModelConfig.from_hf(E2B_LIKE)
    assert config.model_type == "gemma4" and config.to_dict() == {**text.to_dict(), "model_type": "gemma4"}
    moe = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16)
    mixed = ModelConfig.from_hf({**multimodal, "text_config": {**E2B_LIKE, **moe, "use_double_wide_mlp": False}})
    assert (mixed.num_experts, mixed.experts_per_token, mixed.intermediate_size) == (8, 2, 16) and mixed.expert_norms
    assert mixed.shared_expert_size == E2B_LIKE["intermediate_size"]


@pytest.mark.parametrize(
    "changes, named",
    [
        (
            {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "use_double_wide_mlp": False},
            "moe_intermediate_size",
        ),
        ({"num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 16}, "num_experts"),
        (
            {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 16},
            "use_double_wide_mlp",
        ),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_kv_shared_layers": 10}, "num_kv_shared_layers"),
        ({"num_kv_shared_layers": 6}, "num_kv_shared_layers"),  # a full layer shares a layer no earlier full one
        ({"vocab_size_per_layer_input": 262144}, "vocab_size_per_layer_input"),
        ({"per_layer_config": {"0": {"head_dim": 32}}}, "per_layer_config"),
        ({"per_layer_config": {"4": {"intermediate_size": 32}}}, "per_layer_config"),
        ({"per_layer_config": {"4": {"head_dim": 32}, "9": {"head_dim": 64}}}, "per_layer_config"),
        (
            {"rope_parameters": {**E2B_LIKE["rope_parameters"], "full_attention": {"rope_type": "yarn"}}},
            "rope_parameters",
        ),
        (
            {"rope_parameters": {**E2B_LIKE["rope_parameters"], "sliding_attention": {"rope_type": "linear"}}},
            "rope_parameters",
        ),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ],
)
def test_what_is_not_implemented_is_refused_by_name(changes, named):
    with pytest.raises(UnsupportedConfigError, match=named):
        ModelConfig.from_hf({**E2B_LIKE, **changes})


def test_vision_only_bidirectional_attention_is_causal_for_text():
    assert ModelConfig.from_hf({**E2B_LIKE, "use_bidirectional_attention": "vision"}) == ModelConfig.from_hf(E2B_LIKE)


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_rotary_frequencies_are_hf_bits(layer_type):
    """The proportional frequencies (zeros past the rotated quarter) and the sliding layers' own."""
    hf_config, _ = tiny_hf_config(SHARED)
    transformers = pytest.importorskip("transformers")
    rotary = transformers.models.gemma4.modeling_gemma4.Gemma4TextRotaryEmbedding(hf_config)
    theirs = getattr(rotary, f"{layer_type}_inv_freq").numpy()
    ours = rotary_frequencies(ModelConfig.from_hf(hf_config.to_dict()), local=layer_type == "sliding_attention")
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)
    if layer_type == "full_attention":
        assert (ours[4:] == 0).all() and (ours[:4] > 0).all()


# ----------------------------------------------------------------------------- parity's sensitivity


def _converted(tiny):
    from conversion.hf import convert_hf_folder

    c = convert_hf_folder(tiny.folder)
    return jax.tree.map(jnp.asarray, c.params), c.config


def _logits(model, tokens):
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _ours(params, tokens, config):
    with jax.default_matmul_precision("highest"):
        return np.asarray(jax.jit(forward, static_argnames="config")(params, jnp.asarray(tokens, jnp.int32), config))


@pytest.fixture(scope="module")
def shared_model(tiny_model):
    tiny = tiny_model(SHARED)
    params, config = _converted(tiny)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, size=(1, 300))
    return tiny, params, config, tokens, _logits(tiny.model, tokens)


def _with(params, **layers):
    return {**params, "layers": {**params["layers"], **layers}}


def test_logits_are_as_close_to_float64_as_transformers_float32(shared_model):
    """Scores unscaled behind q/k norms make the tiny model's float32 logits noisy: transformers'
    own float32 run is 7e-5 from its float64 one. jaxdepth's is as close to float64 as it."""
    tiny, params, config, tokens, ref = shared_model
    torch = pytest.importorskip("torch")
    wide = copy.deepcopy(tiny.model).double()
    with torch.no_grad():
        reference = wide(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    ours_error = float(np.abs(_ours(params, tokens, config) - reference).max())
    their_error = float(np.abs(ref - reference).max())
    print(f"\n[parity] {SHARED} to float64: jaxdepth {ours_error:.3e}, transformers float32 {their_error:.3e}")
    assert ours_error <= 1.5 * their_error and ours_error <= 1e-4


def test_parity_fails_where_per_layer_inputs_or_layer_scalars_are_dropped(shared_model):
    tiny, params, config, tokens, ref = shared_model
    assert float(np.abs(_ours(params, tokens, config) - ref).max()) <= 1e-4
    mistakes = {
        "per-layer inputs dropped": _with(params, ple_proj=jnp.zeros_like(params["layers"]["ple_proj"])),
        "layer scalars taken as 1": _with(params, layer_scalar=jnp.ones_like(params["layers"]["layer_scalar"])),
    }
    for name, wrong in mistakes.items():
        e = float(np.abs(_ours(wrong, tokens, config) - ref).max())
        print(f"\n[parity] sensitivity, {SHARED} with {name}: max |logit diff| = {e:.3e}")
        assert e > 100 * 1e-4, name


def test_parity_fails_where_the_keys_are_shared_from_another_layer(shared_model):
    """transformers' model with layer 0, not 2, storing the sliding layers' keys and values for
    the reusing sliding layer 3: jaxdepth's logits are far from it (the reused keys matter)."""
    tiny, params, config, tokens, ref = shared_model
    assert config.kv_source(3) == 2 and config.kv_source(4) == config.kv_source(5) == 1
    wrong = copy.deepcopy(tiny.model)
    attention = [layer.self_attn for layer in wrong.model.layers]
    assert attention[2].store_full_length_kv and not attention[0].store_full_length_kv
    attention[2].store_full_length_kv, attention[0].store_full_length_kv = False, True
    e = float(np.abs(_ours(params, tokens, config) - _logits(wrong, tokens)).max())
    print(f"\n[parity] sensitivity, {SHARED} with keys shared from layer 0: max |logit diff| = {e:.3e}")
    assert e > 100 * 1e-4


def test_the_multimodal_checkpoint_converts_to_its_text_model(tmp_path):
    """A `Gemma4ForConditionalGeneration` (no vision or audio tower) saved by transformers: the
    text model's tensors under `model.language_model.`, its logits on text."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from conftest import build_tiny_model

    text = build_tiny_model("gemma4_plain", seed=7)
    config = transformers.Gemma4Config(text_config=text.config.to_dict(), vision_config=None, audio_config=None)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.language_model.load_state_dict(text.model.state_dict())
    model.save_pretrained(str(tmp_path))
    from conversion.hf import convert_hf_folder

    c = convert_hf_folder(str(tmp_path))
    assert c.config.model_type == "gemma4"
    tokens = np.random.default_rng(4).integers(0, c.config.vocab_size, size=(1, 120))
    e = float(np.abs(_ours(jax.tree.map(jnp.asarray, c.params), tokens, c.config) - _logits(model, tokens)).max())
    print(f"\n[parity] multimodal gemma4's text model: max |logit diff| = {e:.3e}")
    assert e <= 1e-4


def test_parity_fails_where_a_part_of_the_mixture_block_is_read_otherwise(tiny_model):
    """Gemma 4's experts beside its MLP (`gemma4_moe`): each of the block's own pieces, read
    otherwise, moves the logits far beyond the tolerance. (Not renormalising the chosen
    experts' weights moves them by 1e-3 only: the experts' post-norm undoes a common scale of
    the weights, so only their ratio, which the renormalisation keeps, is seen.)"""
    import dataclasses

    tiny = tiny_model("gemma4_moe")
    params, config = _converted(tiny)
    assert config.expert_norms and config.shared_expert_size == 2 * config.intermediate_size
    tokens = np.random.default_rng(6).integers(0, config.vocab_size, size=(1, 300))
    ref = _logits(tiny.model, tokens)
    assert float(np.abs(_ours(params, tokens, config) - ref).max()) <= 1e-4
    layers = params["layers"]
    mistakes = {
        "the per-expert scales taken as 1": (
            _with(params, router_expert_scale=jnp.ones_like(layers["router_expert_scale"])),
            config,
        ),
        "the router's scale taken as 1": (_with(params, router_scale=jnp.ones_like(layers["router_scale"])), config),
        "the experts reading the MLP's norm": (_with(params, expert_norm=layers["mlp_norm"]), config),
        "the two post-norms swapped": (
            _with(params, expert_post_norm=layers["shared_post_norm"], shared_post_norm=layers["expert_post_norm"]),
            config,
        ),
        "DeepSeek's shared experts (no norms of the block's own)": (
            params,
            dataclasses.replace(config, expert_norms=False),
        ),
    }
    for name, (wrong, wrong_config) in mistakes.items():
        e = float(np.abs(_ours(wrong, tokens, wrong_config) - ref).max())
        print(f"\n[parity] sensitivity, gemma4_moe with {name}: max |logit diff| = {e:.3e}")
        assert e > 100 * 1e-4, name


# ----------------------------------------------------------------------------- shared keys in the loops


@pytest.fixture(scope="module")
def random_shared():
    hf_config, _ = tiny_hf_config(SHARED)
    config = ModelConfig.from_hf(hf_config.to_dict())
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, config.vocab_size, size=(2, 24)), jnp.int32)
    return config, jax.tree.map(jnp.asarray, random_params(config, 2, scale=0.15)), tokens


def _run(params, tokens, config, **options):
    h0 = embed(params, tokens, config)
    return run_layers(params, h0, config, per_layer_inputs=per_layer_inputs(params, tokens, h0, config), **options)


def test_the_identity_order_is_the_forward_and_a_reused_layer_first_attends_to_nothing(random_shared):
    config, params, tokens = random_shared
    plain, _ = _run(params, tokens, config)
    ordered, _ = _run(params, tokens, config, run=LayerRun(order=identity_order(config.num_layers)))
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(ordered))
    # layer 3 (sliding) first: no sliding layer has computed keys before it, so it attends to
    # nothing; layer 4 after layer 1 (full) reads layer 1's keys, as in the forward
    order = layer_order(config.num_layers, [3, 1, 4])
    _, attn = _run(params, tokens, config, run=LayerRun(order=order), tap=lambda r, _: r.attn)
    assert float(jnp.abs(attn[0]).max()) == 0.0 and float(jnp.abs(attn[2]).max()) > 0.1
    _, forward_attn = _run(params, tokens, config, tap=lambda r, _: r.attn)
    assert not np.allclose(np.asarray(attn[2, 0]), np.asarray(forward_attn[4]))  # its input differs


def test_a_dropped_producer_leaves_the_last_layer_of_its_type_before_it(random_shared):
    """Dropping layer 2 (the sliding layers' last producer), reused layer 3 reads layer 0's keys:
    equal to the forward in which layer 2's keys are layer 0's (layer 2 run without writing)."""
    config, params, tokens = random_shared
    order = layer_order(config.num_layers, [0, 1, 3, 4, 5])
    _, keys = _run(params, tokens, config, run=LayerRun(order=order), tap=lambda r, _: r.k)
    _, clean = _run(params, tokens, config, tap=lambda r, _: r.k)
    np.testing.assert_array_equal(np.asarray(keys[2, 0]), np.asarray(clean[0]))  # layer 3 reads layer 0's
    np.testing.assert_array_equal(np.asarray(keys[3, 0]), np.asarray(keys[1, 0]))  # layer 4 reads layer 1's


def test_runs_that_cannot_carry_the_shared_keys_are_refused(random_shared):
    config, params, tokens = random_shared
    h0 = embed(params, tokens, config)
    with pytest.raises(ValueError, match="boundary other than 0"):
        _run(params, tokens, config, run=LayerRun(start=2))
    with pytest.raises(ValueError, match="parallel steps"):
        _run(params, tokens, config, run=LayerRun(order=layer_order(config.num_layers, [0, (1, 2), 3])))
    with pytest.raises(ValueError, match="per-layer inputs"):
        run_layers(params, h0, config)
    with pytest.raises(ValueError, match="without the keys and values shared at it"):
        _run(params, tokens, config, run=LayerRun(start=2, shared_kv=None))
    with pytest.raises(ValueError, match="split per head"):
        forward(params, tokens, config, interventions=sites.unchanged("q_in"))
    orders = group_orders(stack_orders([identity_order(config.num_layers)]), config.num_layers)
    with pytest.raises(ValueError, match="per-layer inputs"):
        generate_orders(params, tokens, config, orders, max_new_tokens=2)


def test_a_run_from_a_later_boundary_reads_the_clean_runs_shared_keys(random_shared):
    """`clean_key_values` holds every layer's keys as its record does (a reusing layer the row of
    the layer it reads), and a run from boundary l given the slot they hold at l
    (`shared_kv_at`) is the forward's rest; the slot at l is the last producer's of each type."""
    config, params, tokens = random_shared
    hs = residual_stream(params, tokens, config)
    _, (k, v) = _run(params, tokens, config, tap=lambda r, _: (r.k, r.v))
    keys, values = clean_key_values(params, hs, config)
    np.testing.assert_allclose(np.asarray(keys), np.asarray(k), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(values), np.asarray(v), rtol=1e-6, atol=1e-6)
    slot = shared_kv_at((keys, values), 3, config)  # layers 0, 2 sliding and 1 full before layer 3
    np.testing.assert_array_equal(np.asarray(slot["sliding"][0]), np.asarray(keys[2, ..., :2, :16]))
    np.testing.assert_array_equal(np.asarray(slot["full"][1]), np.asarray(values[1, ..., :1, :32]))
    assert float(jnp.abs(shared_kv_at((keys, values), 1, config)["full"][0]).max()) == 0.0  # none yet
    for l in (2, 4):
        h0 = embed(params, tokens, config)
        extra = per_layer_inputs(params, tokens, h0, config)
        run = LayerRun(start=l, shared_kv=shared_kv_at((keys, values), l, config))
        h, _ = run_layers(params, hs[l], config, run=run, per_layer_inputs=extra)
        np.testing.assert_allclose(np.asarray(h), np.asarray(hs[-1]), rtol=1e-5, atol=1e-5)


def test_a_layers_contribution_is_what_it_adds_to_the_residual(random_shared):
    """The contributions' layer statistics read h_{l+1} - h_l, which the layer scalar and the
    per-layer inputs make more than a_l + m_l."""
    from jaxdepth.analyses.contributions import contribution_stats
    from jaxdepth.analyses.stats import relative_norm

    config, params, tokens = random_shared
    valid = jnp.ones(tokens.shape, bool)
    stats = contribution_stats(params, tokens, valid, config)
    _, (h, out, a, m) = _run(params, tokens, config, tap=lambda r, _: (r.h, r.out, r.attn, r.mlp))
    np.testing.assert_allclose(stats[..., 2], relative_norm(out - h, h), rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(stats[..., 2] - relative_norm(a + m, h))).max() > 1e-2


def test_sites_of_every_layer_have_the_widest_layers_shape(random_shared):
    """Heads and hidden units as wide as the widest layer's, zero beyond a layer's own: an edit
    at `head_out` and `mlp_hidden` acts on each layer's own units."""
    config, params, tokens = random_shared
    tap = lambda r, _: (r.q, r.k, r.head_out, r.mlp_hidden, r.per_layer)  # noqa: E731
    _, (q, k, heads, hidden, per_layer) = _run(params, tokens, config, tap=tap)
    B, T = tokens.shape
    assert q.shape == heads.shape == (6, B, T, 4, 32) and k.shape == (6, B, T, 2, 32)
    assert hidden.shape == (6, B, T, 256) and per_layer.shape == (6, B, T, 64)
    sliding, full = 0, 1
    assert float(jnp.abs(heads[sliding, ..., 16:]).max()) == 0.0 and float(jnp.abs(heads[full, ..., 16:]).max()) > 0
    assert float(jnp.abs(k[full, :, :, 1:]).max()) == 0.0  # the full layers' one kv head
    assert float(jnp.abs(hidden[0, ..., 128:]).max()) == 0.0 and float(jnp.abs(hidden[3, ..., 128:]).max()) > 0
    skipped = _run(params, tokens, config, interventions=sites.skip("per_layer_out", 1, jnp.ones(1)))[0]
    assert not np.allclose(np.asarray(skipped), np.asarray(_run(params, tokens, config)[0]))
    with pytest.raises(sites.InterventionError, match="per_layer_out"):
        plain, _ = tiny_hf_config("gemma4_plain")
        plain_config = ModelConfig.from_hf(plain.to_dict())
        forward(random_params(plain_config), tokens, plain_config, interventions=sites.unchanged("per_layer_out"))


def test_a_loaded_model_runs_its_layers_with_their_per_layer_inputs(tiny_model):
    """`jaxdepth.load` of the Hugging Face folder: its logits are transformers', and its layers
    run by `run` read their per-layer inputs."""
    import jaxdepth

    tiny = tiny_model(SHARED)
    model = jaxdepth.load(tiny.folder)
    tokens = np.random.default_rng(6).integers(0, model.config.vocab_size, size=(1, 64))
    with jax.default_matmul_precision("highest"):
        logits = model.logits(tokens)
        h_last, added = model.run(tokens, tap=_per_layer_tap)
    assert float(np.abs(logits - _logits(tiny.model, tokens)).max()) <= 1e-4
    assert added.shape == (model.config.num_layers, 1, 64, model.config.hidden_size)
    assert bool((jnp.abs(added).max(axis=(1, 2, 3)) > 1e-3).all())  # every layer adds its own


def _per_layer_tap(record, _):
    return record.per_layer


@pytest.mark.parametrize("k_eq_v, experts", [(False, False), (True, False), (True, True)])
def test_every_tensor_of_a_full_size_model_has_its_param(k_eq_v, experts):
    """transformers' model of an E2B-sized config (and, with keys as values, a 31B-like one
    without per-layer inputs; with experts, a 26B-A4B-like one), built without weights: each of
    its tensors is one param's row of one layer, of the shape the params declare."""
    torch = pytest.importorskip("torch")
    from conversion.hf_layouts import hf_names
    from jaxdepth.core.parameters import PARAMETERS, param_shapes, row_layers, transposed_params

    sizes = dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, head_dim=256, global_head_dim=512)
    sizes.update(vocab_size=262144, vocab_size_per_layer_input=262144, num_kv_shared_layers=20)
    sizes.update(layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7, hidden_size_per_layer_input=256)
    if k_eq_v:
        sizes.update(num_key_value_heads=4, num_global_key_value_heads=2, hidden_size_per_layer_input=0)
        sizes.update(num_kv_shared_layers=0, use_double_wide_mlp=False)
    if experts:
        sizes.update(num_hidden_layers=10, layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2)
        sizes.update(enable_moe_block=True, num_experts=16, top_k_experts=8, moe_intermediate_size=704)
        sizes.update(intermediate_size=2112, hidden_size=2816)
    hub = {**E2B_LIKE, **sizes, "attention_k_eq_v": k_eq_v}
    _, hf_config = _transformers_layers(hub)
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.Gemma4ForCausalLM(hf_config)
    tensors = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tensors.pop("lm_head.weight")  # tied
    config = ModelConfig.from_hf(hub)
    names, shapes, rows = hf_names(config), param_shapes(config), {row.name: row for row in PARAMETERS}
    used, fused = [], set()
    for key, shape in {**{k: v for k, v in shapes.items() if k != "layers"}, **shapes["layers"]}.items():
        row = rows[key]
        layers = row_layers(row, config) if row.per_layer else [None]
        one = shape[1:] if row.per_layer else shape
        want = (*one[:-2], one[-1], one[-2]) if key in transposed_params() else one  # [out, in] per expert
        for i in layers:
            name = names["layers"][key].format(i=i) if row.per_layer else names[key]
            if "#" in name:  # the experts' gate and up: the halves of one `[E, 2F, D]` tensor
                name, part = name.split("#")
                assert part in ("gate", "up") and tensors.get(name) == (*want[:-2], 2 * want[-2], want[-1]), key
                fused.add(name)
                continue
            assert tensors.get(name) == want, (key, i, name)
            used.append(name)
    assert len(used) == len(set(used)) and set(used) | fused == set(tensors) and not fused & set(used)


def test_the_plain_model_runs_from_a_later_boundary_and_its_delta_is_the_scaled_layer():
    """`gemma4_plain` (the layer scalar alone: no per-layer inputs, no shared keys, one attention
    shape; the family tests run `gemma4_shared_kv`): a run from a later boundary needs no shared
    keys and is the forward's rest, and `delta` = (s - 1) h + s (a + m)."""
    hf_config, _ = tiny_hf_config("gemma4_plain")
    config = ModelConfig.from_hf(hf_config.to_dict())
    params = jax.tree.map(jnp.asarray, random_params(config, 3, scale=0.15))
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, config.vocab_size, size=(2, 20)), jnp.int32)
    hs = residual_stream(params, tokens, config)
    h, _ = run_layers(params, hs[1], config, run=LayerRun(start=1))
    np.testing.assert_allclose(np.asarray(h), np.asarray(hs[-1]), rtol=1e-5, atol=1e-5)
    _, (x, a, m, delta) = run_layers(params, hs[0], config, tap=lambda r, _: (r.h, r.attn, r.mlp, r.delta))
    s = params["layers"]["layer_scalar"].reshape(-1, 1, 1, 1)
    np.testing.assert_allclose(np.asarray(delta), np.asarray((s - 1) * x + s * (a + m)), rtol=1e-6, atol=1e-6)
