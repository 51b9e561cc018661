"""The mixture of experts (`jaxdepth.core.experts`): the blocks equal every expert run on every
token, one expert is its dense twin, each routing intervention does what it says against a
hand computation, a sweep over layers and experts equals its members one at a time, and what
cannot be computed is refused or NaN, never silently dropped."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_moe_config
from jaxdepth.core import experts
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.hf_config import UnsupportedConfigError
from jaxdepth.core.layer import layer_context, layer_step, norm
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, forward, random_params
from jaxdepth.core.primitives import ACTIVATIONS
from jaxdepth.core.sites import Intervention, InterventionError, skip, unchanged

pytestmark = pytest.mark.usefixtures("highest_precision")

CONFIG = tiny_moe_config()
PARAMS = random_params(CONFIG, 0, scale=0.3)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 20)))
E, K, L = CONFIG.num_experts, CONFIG.experts_per_token, CONFIG.num_layers

_forward = jax.jit(forward, static_argnames="config")
# float32 rounding of O(1) values summed in another order (numpy by hand, or XLA's batched
# products under vmap): measured up to 7e-6; a wrong expert or weight moves them by 1e-2 and more
ROUNDING = 1e-5


def _tap(record, _):
    return dict(
        mlp_in=record.mlp_in,
        mlp=record.mlp,
        probs=record.router_probs,
        weights=record.expert_weights,
        choice=record.expert_choice,
        outputs=record.expert_out,
    )


@jax.jit
def _records(interventions=None):
    return run_layers(PARAMS, embed(PARAMS, TOKENS, CONFIG), CONFIG, interventions=interventions, tap=_tap)[1]


def _expert(layer: int, e: int, x, hidden: bool = False):
    """Expert e of `layer` on `x`, written out (its hidden units where `hidden`)."""
    p = PARAMS["layers"]
    gate, up, down = (np.asarray(p[name][layer, e]) for name in ("expert_gate", "expert_up", "expert_down"))
    units = np.asarray(ACTIVATIONS["silu"](x @ gate)) * (x @ up)
    return units if hidden else units @ down


def _normed(records, layer: int):
    return np.asarray(norm(records["mlp_in"][layer], PARAMS["layers"]["mlp_norm"][layer], CONFIG))


@pytest.mark.parametrize("shape", [(1, 1), (2, 7), (3, 50)])
@pytest.mark.parametrize("pattern", ["random", "one expert", "two experts"])
def test_the_blocks_equal_every_expert_on_every_token(shape, pattern):
    """Whatever the choice (spread, or every token on the same experts: one block of padding
    after another), each slot holds its expert's output and hidden units on its token."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((*shape, CONFIG.hidden_size)).astype(np.float32)
    if pattern == "random":
        chosen = np.argsort(rng.random((*shape, E)), axis=-1)[..., :K]
    elif pattern == "one expert":
        chosen = np.broadcast_to(np.array([4, 1]), (*shape, K))
    else:
        chosen = np.where(rng.random((*shape, 1)) < 0.5, np.array([0, 5]), np.array([5, 0]))
    p = jax.tree.map(lambda w: w[1], PARAMS["layers"])
    got, hidden = jax.jit(experts.expert_outputs, static_argnums=3)(p, x, jnp.asarray(chosen), CONFIG)
    for value, units in ((got, False), (hidden, True)):
        want = np.stack([[_expert(1, e, x[b, t], units) for e in range(E)] for b, t in np.ndindex(shape)])
        want = np.take_along_axis(want, chosen.reshape(-1, K)[:, :, None], axis=1).reshape(value.shape)
        np.testing.assert_allclose(value, want, rtol=1e-5, atol=ROUNDING)
    tokens = shape[0] * shape[1]
    assert K * tokens <= experts.executed_rows(tokens, CONFIG) <= max(1.5 * K * tokens, K * tokens + 1)


def test_one_expert_is_its_dense_twin():
    config = dataclasses.replace(CONFIG, num_experts=1, experts_per_token=1)
    params = random_params(config, 2, scale=0.3)
    dense = dataclasses.replace(config, num_experts=0, experts_per_token=0)
    twin = dict(params, layers={k: v for k, v in params["layers"].items() if not k.startswith(("expert", "router"))})
    for name in ("gate", "up", "down"):
        twin["layers"][name] = params["layers"][f"expert_{name}"][:, 0]
    np.testing.assert_allclose(_forward(params, TOKENS, config), _forward(twin, TOKENS, dense), rtol=1e-5, atol=1e-5)


def test_the_clean_routing_is_the_routers():
    """The weights are the chosen experts' softmax scores (not renormalised in this config),
    the choice their top k, and the output their weighted sum."""
    records = _records()
    probs, weights, choice = (np.asarray(records[n]) for n in ("probs", "weights", "choice"))
    np.testing.assert_array_equal(choice, np.argsort(-probs, axis=-1)[..., :K])
    np.testing.assert_array_equal(np.take_along_axis(weights, choice, -1), np.take_along_axis(probs, choice, -1))
    assert np.all((weights != 0).sum(-1) == K)
    layer = 2
    x = _normed(records, layer)
    by_hand = np.stack(
        [
            sum(weights[layer, b, t, e] * _expert(layer, e, x[b, t]) for e in choice[layer, b, t])
            for b, t in np.ndindex(2, 20)
        ]
    ).reshape(x.shape)
    np.testing.assert_allclose(records["mlp"][layer], by_hand, rtol=1e-5, atol=ROUNDING)


def test_routing_by_hand_weights_equals_the_weighted_sum():
    """`route` with weights written by hand: the layer's output is their weighted sum of every
    expert, and the experts outside them do not run."""
    layer = 1
    weights = np.zeros((2, 20, E), np.float32)
    rng = np.random.default_rng(3)
    for b, t in np.ndindex(2, 20):
        picked = rng.choice(E, size=rng.integers(1, K + 1), replace=False)
        weights[b, t, picked] = rng.standard_normal(len(picked))
    records = _records(experts.route(layer, weights, CONFIG))
    x = _normed(records, layer)
    by_hand = np.stack(
        [sum(weights[b, t, e] * _expert(layer, e, x[b, t]) for e in range(E)) for b, t in np.ndindex(2, 20)]
    ).reshape(x.shape)
    np.testing.assert_allclose(records["mlp"][layer], by_hand, rtol=1e-5, atol=ROUNDING)
    np.testing.assert_array_equal(records["weights"][layer], weights)


def test_forced_and_forbidden_experts_change_the_choice_as_said():
    layer = 1
    clean = _records()
    probs = np.asarray(clean["probs"][layer])  # the routing's input is that of the clean run
    mask = np.eye(E, dtype=np.float32)[3]
    forced = _records(experts.force_experts(layer, mask, CONFIG))
    choice = np.asarray(forced["choice"][layer])
    assert np.all(choice[..., 0] == 3)
    others = np.where(mask > 0, -np.inf, probs)
    np.testing.assert_array_equal(choice[..., 1], np.argmax(others, axis=-1))
    np.testing.assert_array_equal(
        np.take_along_axis(forced["weights"][layer], choice, -1), np.take_along_axis(probs, choice, -1)
    )
    forbidden = _records(experts.forbid_experts(layer, mask, CONFIG))
    np.testing.assert_array_equal(forbidden["choice"][layer], np.argsort(-others, axis=-1)[..., :K])
    assert not np.any(forbidden["choice"][layer] == 3)
    # the layers before are untouched; the choice of the layers after follows their own residual
    np.testing.assert_array_equal(forbidden["choice"][0], clean["choice"][0])


def test_dropping_an_expert_removes_its_share_alone():
    layer, e = 2, 1
    clean = _records()
    dropped = _records(experts.drop_experts(layer, np.eye(E)[e]))
    share = np.asarray(clean["weights"][layer, ..., e : e + 1]) * np.stack(
        [_expert(layer, e, x) for x in _normed(clean, layer).reshape(-1, CONFIG.hidden_size)]
    ).reshape(_normed(clean, layer).shape)
    assert np.abs(share).max() > 1e-3
    np.testing.assert_allclose(dropped["mlp"][layer], np.asarray(clean["mlp"][layer]) - share, rtol=1e-5, atol=ROUNDING)


def test_a_sweep_over_layers_and_experts_equals_each_alone():
    layers = np.repeat(np.arange(L), E)
    masks = np.tile(np.eye(E, dtype=np.float32), (L, 1))
    sweep = jax.jit(jax.vmap(lambda l, m: _forward(PARAMS, TOKENS, CONFIG, interventions=experts.drop_experts(l, m))))
    swept = np.asarray(sweep(layers, masks))
    for i in range(len(layers)):
        alone = _forward(PARAMS, TOKENS, CONFIG, interventions=experts.drop_experts(int(layers[i]), masks[i]))
        np.testing.assert_allclose(swept[i], alone, rtol=1e-5, atol=ROUNDING)
    assert len({float(np.abs(s).sum()) for s in swept}) == len(layers)  # every member its own


def test_a_skipped_layer_changes_the_routing_after_it():
    clean = _records()
    skipped = _records(skip("delta", 0, np.ones(20, np.float32)))
    assert np.any(np.asarray(skipped["choice"][2]) != np.asarray(clean["choice"][2]))


def test_more_weights_than_experts_computed_is_nan_where_it_happens():
    weights = np.zeros((2, 20, E), np.float32)
    weights[..., :K] = 0.5
    traced = jax.jit(lambda w: _forward(PARAMS, TOKENS, CONFIG, interventions=experts.route(L - 1, w, CONFIG)))
    assert np.all(np.isfinite(traced(weights)))
    weights[1, 7, K] = 0.5
    logits = np.asarray(traced(weights))
    assert np.all(np.isnan(logits[1, 7])) and np.isfinite(np.delete(logits.reshape(40, -1), 27, axis=0)).all()
    with pytest.raises(InterventionError, match="at most 2"):
        experts.route(L - 1, weights, CONFIG)
    with pytest.raises(InterventionError, match="at most 2"):
        experts.force_experts(0, np.ones(E), CONFIG)


def test_sites_the_layers_do_not_have_are_refused():
    dense = dataclasses.replace(CONFIG, num_experts=0, experts_per_token=0)
    with pytest.raises(InterventionError, match="'router_logits'.*dense MLP"):
        forward(random_params(dense), TOKENS, dense, interventions=unchanged("router_logits"))
    with pytest.raises(InterventionError, match="'mlp_hidden'.*mixture of experts"):
        forward(PARAMS, TOKENS, CONFIG, interventions=unchanged("mlp_hidden"))


def test_each_feature_moves_the_logits():
    """Renormalising the weights, and k, change the model far beyond parity's tolerance."""
    clean = np.asarray(_forward(PARAMS, TOKENS, CONFIG))
    for change in (dict(normalize_expert_weights=True), dict(experts_per_token=3)):
        moved = np.asarray(_forward(PARAMS, TOKENS, dataclasses.replace(CONFIG, **change)))
        assert np.abs(moved - clean).max() > 1e-2, change


def _hf(**changes):
    return (
        dict(
            model_type="qwen3_moe",
            vocab_size=97,
            hidden_size=32,
            intermediate_size=40,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            rope_theta=1e4,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        )
        | changes
    )


def test_the_configs_read_and_refuse():
    config = ModelConfig.from_hf(_hf())
    assert (config.num_experts, config.experts_per_token, config.intermediate_size) == (6, 2, 16)
    assert config.normalize_expert_weights
    saved = _hf(num_local_experts=6)
    del saved["num_experts"]
    assert ModelConfig.from_hf(saved) == config  # transformers saves the count under this name
    with pytest.raises(UnsupportedConfigError, match="every layer is dense"):
        ModelConfig.from_hf(_hf(mlp_only_layers=[0, 1]))
    with pytest.raises(UnsupportedConfigError, match="clip_qkv"):
        ModelConfig.from_hf(_hf(model_type="olmoe", clip_qkv=8.0, intermediate_size=16))
    with pytest.raises(UnsupportedConfigError, match="experts_per_token"):
        dataclasses.replace(CONFIG, experts_per_token=7)


@pytest.mark.parametrize(
    "changes",
    [
        dict(mlp_only_layers=[1]),
        dict(mlp_only_layers=[0, 3]),
        dict(decoder_sparse_step=2),
        dict(decoder_sparse_step=3),
        dict(decoder_sparse_step=2, mlp_only_layers=[3]),
        dict(model_type="deepseek_v3", first_k_dense_replace=2),
        dict(model_type="deepseek_v3"),  # transformers' default: the first 3 layers dense
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_dense_layers_are_those_transformers_builds(changes):
    """Which layers have a dense MLP among the sparse ones: the layers transformers builds
    without experts, from the same config (one without `first_k_dense_replace` included)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = _hf(num_hidden_layers=5, **changes)
    if hf["model_type"] == "deepseek_v3":
        hf = {k: v for k, v in hf.items() if k not in ("num_experts", "head_dim")} | dict(
            n_routed_experts=6,
            kv_lora_rank=8,
            q_lora_rank=None,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            num_key_value_heads=4,
            n_group=1,
            topk_group=1,
        )
    config = ModelConfig.from_hf(hf)
    classes = {"qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3"}[hf["model_type"]]
    hf_config = getattr(transformers, f"{classes}Config")(**{k: v for k, v in hf.items() if k != "model_type"})
    with torch.device("meta"):
        model = getattr(transformers, f"{classes}ForCausalLM")(hf_config)
    built = tuple(i for i, layer in enumerate(model.model.layers) if not hasattr(layer.mlp, "experts"))
    assert config.dense_layers == built and 0 < len(built) < 5
    assert config.expert_layers == tuple(i for i in range(5) if i not in built)
    assert config.dense_size == hf["intermediate_size"] and config.intermediate_size == hf["moe_intermediate_size"]


MIXED = tiny_moe_config(dense_layers=(1,), dense_size=24)  # sparse, dense, sparse
MIXED_PARAMS = random_params(MIXED, 3, scale=0.3)


def _own_kind(layer: int):
    """Layer `layer` of `MIXED` as a model of one kind: the all-sparse or the all-dense config,
    and that layer's weights from the kinds' stacks."""
    dense = layer in MIXED.dense_layers
    config = (
        dataclasses.replace(
            MIXED, num_experts=0, experts_per_token=0, intermediate_size=24, dense_layers=(), dense_size=0
        )
        if dense
        else dataclasses.replace(MIXED, dense_layers=(), dense_size=0)
    )
    stacks = MIXED_PARAMS["layers"]
    rows = MIXED.dense_layers if dense else MIXED.expert_layers
    weights = {}
    for name, w in stacks.items():
        if w.shape[0] == L:
            weights[name] = w[layer]
        elif (name in ("up", "down", "gate")) == dense:
            weights[name] = w[rows.index(layer)]
    return config, weights


def test_layers_of_two_kinds_each_run_their_own_kind():
    """Qwen3-MoE's `mlp_only_layers`, DeepSeek-V3's first dense layers: the stacks hold each kind's
    layers only, and each layer's output equals that layer run as a model of its own kind."""
    assert MIXED.expert_layers == (0, 2) and MIXED.mixed_mlps
    assert MIXED_PARAMS["layers"]["up"].shape == (1, 32, 24)
    assert MIXED_PARAMS["layers"]["expert_up"].shape == (2, E, 32, 16)
    assert MIXED_PARAMS["layers"]["q"].shape[0] == L
    h = embed(MIXED_PARAMS, TOKENS, MIXED)
    tap = lambda r, _: dict(out=r.out, hidden=r.mlp_hidden, probs=r.router_probs)  # noqa: E731
    _, records = jax.jit(lambda h: run_layers(MIXED_PARAMS, h, MIXED, tap=tap))(h)
    for layer in range(L):
        config, weights = _own_kind(layer)
        r = layer_step(weights, h, layer, layer_context(h, None, config), config)
        # one jitted scan against the layer run op by op: float32 rounding of values up to 12
        np.testing.assert_allclose(records["out"][layer], r.out, rtol=1e-5, atol=ROUNDING)
        dense = layer in MIXED.dense_layers
        # the other kind's sites read zeros there
        assert np.all(np.asarray(records["probs"][layer]) == 0) == dense
        assert np.all(np.asarray(records["hidden"][layer]) == 0) != dense
        h = r.out


def test_a_layer_of_one_kind_computes_nothing_of_the_other():
    """The scan's body branches on the layer's kind (`lax.cond`): the dense branch multiplies by
    the dense MLP's three matrices and nothing else, the sparse one never by those."""
    jaxpr = jax.make_jaxpr(lambda p, h: run_layers(p, h, MIXED)[0])(MIXED_PARAMS, embed(MIXED_PARAMS, TOKENS, MIXED))

    def equations(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for sub in jax.core.jaxprs_in_params(eqn.params):
                yield from equations(sub)

    conds = [e for e in equations(jaxpr.jaxpr) if e.primitive.name == "cond"]
    assert len(conds) == 1
    sparse, dense = conds[0].params["branches"]

    def dots(branch):
        return sum(e.primitive.name == "dot_general" for e in equations(branch.jaxpr))

    assert dots(dense) == 3 and dots(sparse) > 3


def test_a_forward_never_copies_a_layers_experts():
    """The experts' stacks are read in place, block by block (`LayerWeights`): the compiled
    forward's temporary memory stays below one layer's expert weights, which a scan slicing
    the stacks would copy every layer."""
    config = tiny_moe_config(hidden_size=128, intermediate_size=64, num_experts=64, experts_per_token=4)
    params = random_params(config, 0)
    tokens = jnp.zeros((1, 16), jnp.int32)
    compiled = jax.jit(lambda p, t: forward(p, t, config)).lower(params, tokens).compile()
    one_layer = sum(params["layers"][name][0].nbytes for name in ("expert_gate", "expert_up", "expert_down"))
    assert compiled.memory_analysis().temp_size_in_bytes < one_layer / 2


def test_an_edit_of_an_experts_hidden_unit_moves_its_output_by_its_down_row():
    """Site `expert_hidden` (each chosen expert's gated units before its down projection): an
    edit of one unit of the best expert's slot at layer 1 moves that layer's MLP output by the
    weight times the change times that expert's down-projection row, and nothing before it."""

    f = 5

    def zero_unit(value, layer, _):
        return jnp.where((layer == 1) & (jnp.arange(K) == 0)[:, None] & (jnp.arange(value.shape[-1]) == f), 0.0, value)

    tap = lambda r, _: dict(mlp=r.mlp, hidden=r.expert_hidden, choice=r.expert_choice, weights=r.expert_weights)  # noqa: E731
    run = jax.jit(lambda ivs: run_layers(PARAMS, embed(PARAMS, TOKENS, CONFIG), CONFIG, interventions=ivs, tap=tap)[1])
    clean, edited = run(()), run(Intervention("expert_hidden", zero_unit))
    np.testing.assert_array_equal(edited["mlp"][0], clean["mlp"][0])
    best = np.asarray(clean["choice"][1, ..., 0])  # [B, T]
    weight = np.take_along_axis(np.asarray(clean["weights"][1]), best[..., None], -1)[..., 0]
    down = np.asarray(PARAMS["layers"]["expert_down"][1])[best, f]  # [B, T, D]
    want = clean["mlp"][1] - (weight * np.asarray(clean["hidden"][1, ..., 0, f]))[..., None] * down
    np.testing.assert_allclose(edited["mlp"][1], want, rtol=1e-5, atol=ROUNDING)
    assert np.all(np.asarray(edited["hidden"][1, ..., 0, f]) == 0)
