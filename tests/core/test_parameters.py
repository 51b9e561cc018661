"""The parameters' declaration: one row per param, and what derives from it (the params' shapes,
the partition rules, the checkpoints' name tables and the transposed set) consistent for every
family and every combination of the features that decide which params a config has."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from conftest import TINY_VARIANTS, tiny_hf_config
from conversion.hf_layouts import hf_names
from conversion.layout import GGUF_NAMES
from jaxdepth.core import parameters
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.hf_config import SUPPORTED_MODEL_TYPES
from jaxdepth.core.parameters import (
    GGUF,
    HF,
    MODEL,
    PARAMETERS,
    Parameter,
    param_shapes,
    partition_rules,
    row_layers,
    transposed_params,
)
from jaxdepth.core.sharding import PARTITION_RULES

ROWS = {row.name: row for row in PARAMETERS}
# The parts a converter cuts a fused tensor into, and GPT-2's transposed `Conv1D` weights.
FUSED_PARTS = {"q", "k", "v", "gate", "up", "T", "rope", "rope_last", "gated_q", "gated_gate", "conv"}
# Params no checkpoint names: no family has LayerNorms after its sublayers.
UNNAMED = {"attn_post_norm_bias", "mlp_post_norm_bias"}
# Params GGUF files do not name: transformers' GGUF loader reads no Qwen3.5 (llama.cpp's qwen35),
# nor Gemma 4's experts (a gemma4 file's expert keys are refused by name).
GEMMA4_EXPERTS = {"router_scale", "router_expert_scale", "expert_norm", "expert_post_norm", "shared_post_norm"}
NOT_IN_GGUF = {row.name for row in PARAMETERS if row.name.startswith("linear_")} | {"attn_gate"} | GEMMA4_EXPERTS
# Gemma 4's own (the layers' of its two attention shapes, its wide MLPs, per-layer inputs, scalars):
# named in its table alone.
GEMMA4_OWN = {row.name for row in PARAMETERS if row.name.startswith(("global_", "wide_", "ple_"))} | {"layer_scalar"}

BASE = ModelConfig(
    model_type="llama",
    vocab_size=50,
    hidden_size=16,
    intermediate_size=24,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=6,
    rope_theta=1e4,
    rms_norm_eps=1e-6,
    max_position_embeddings=40,
    tie_word_embeddings=False,
    qkv_bias=False,
)
# Every feature that decides whether a param exists or its shape.
FEATURES = dict(
    norm=["rms", "layer"],
    pre_norms=[True, False],
    post_norms=[True, False],
    mlp=["gated", "plain"],
    mlp_bias=[True, False],
    qkv_bias=[True, False],
    o_bias=[True, False],
    qk_norm=[True, False],
    qk_norm_scope=["head", "projection"],
    positions=["rotary", "learned"],
    tie_word_embeddings=[True, False],
)


def feature_configs():
    for values in itertools.product(*FEATURES.values()):
        changes = dict(zip(FEATURES, values))
        if (changes["pre_norms"] or changes["post_norms"]) and not (changes["qk_norm"] and changes["norm"] != "rms"):
            yield dataclasses.replace(BASE, **changes)
            if changes["mlp"] == "gated" and not changes["mlp_bias"]:  # its MLP a mixture of experts
                yield dataclasses.replace(BASE, **changes, num_experts=4, experts_per_token=2)
    # the mixtures' own features (GPT-OSS's biases and sinks, DeepSeek's latent attention, router
    # correction and shared experts)
    moe = dict(num_experts=4, experts_per_token=2)
    yield dataclasses.replace(BASE, **moe, mlp="clamped", glu_alpha=1.7, glu_limit=7.0, mlp_bias=True, router_bias=True)
    yield dataclasses.replace(BASE, **moe, attention_sinks=True, qkv_bias=True, o_bias=True)
    latent = dict(kv_lora_rank=8, rotary_dim=2, rotary_last=True, value_head_dim=4, num_kv_heads=BASE.num_heads)
    for q_lora_rank in (0, 5):
        yield dataclasses.replace(
            BASE,
            **moe,
            **latent,
            q_lora_rank=q_lora_rank,
            router="sigmoid",
            router_correction=True,
            shared_expert_size=6,
        )
    # Qwen3.5's hybrid: linear attention beside gated attention, dense layers among sparse ones
    linear = dict(linear_key_heads=2, linear_value_heads=4, linear_key_dim=4, linear_value_dim=3, linear_conv_kernel=4)
    yield dataclasses.replace(BASE, **linear, linear_layers=(0,), attention_gate=True)
    yield dataclasses.replace(BASE, **moe, dense_layers=(1,), dense_size=12)
    # Gemma 4's: full-attention layers of their own shapes (values their keys, or not), a layer
    # reusing an earlier one's keys and values with a double-wide MLP, per-layer inputs, scalars
    gemma4 = dict(
        layer_types=("sliding", "full", "full"),
        sliding_window=4,
        rope_type="proportional",
        rotary_dim=4,
        local_rope_theta=1e3,
        global_head_dim=8,
        global_kv_heads=1,
        value_norm=True,
        shared_kv_layers=(2,),
        wide_mlp_layers=(2,),
        per_layer_input_size=3,
        layer_scalar=True,
    )
    for keys_as_values, qk_norm in itertools.product((True, False), repeat=2):
        yield dataclasses.replace(BASE, **gemma4, keys_as_values=keys_as_values, qk_norm=qk_norm)
    # ... and its experts beside the MLP (no double-wide MLP beside them)
    yield dataclasses.replace(
        BASE, **{**gemma4, "wide_mlp_layers": ()}, **moe, shared_expert_size=6, expert_norms=True, post_norms=True
    )


def family_configs():
    """The `ModelConfig` of every tiny variant of the test suite (every family)."""
    return [ModelConfig.from_hf(tiny_hf_config(name)[0].to_dict()) for name in sorted(TINY_VARIANTS)]


def flat(shapes: dict) -> dict:
    return {**{k: v for k, v in shapes.items() if k != "layers"}, **shapes["layers"]}


def test_rows_are_named_once_and_name_known_families():
    assert len(ROWS) == len(PARAMETERS)
    assert "layers" not in ROWS
    for naming in (HF, GGUF):
        assert set(naming.family_of.values()) <= set(naming.layer_prefix)
        assert set(naming.base) | set(naming.base.values()) <= set(naming.layer_prefix)
        for row in PARAMETERS:
            assert set(getattr(row, naming.column)) <= set(naming.layer_prefix), (naming.column, row.name)


def test_every_family_has_a_naming():
    """Each GGUF architecture the converter reads has its naming; a `model_type` HF names is one
    the config readers know (the others take Llama's names)."""
    from conversion.gguf_file import _ARCHS

    assert set(GGUF.family_of) == set(_ARCHS)
    assert set(HF.family_of) <= set(SUPPORTED_MODEL_TYPES)


def test_every_param_of_every_config_has_exactly_one_row():
    for config in feature_configs():
        shapes = param_shapes(config)
        assert set(shapes) == {row.name for row in PARAMETERS if not row.per_layer and row.shape_in(config)} | {
            "layers"
        }
        for name, shape in flat(shapes).items():
            row = ROWS[name]
            assert row.per_layer == (name in shapes["layers"])
            assert shape == row.shape_in(config)
            assert shape[: row.per_layer] == (len(row_layers(row, config)),) * row.per_layer  # its kind's layers
            assert len(PARTITION_RULES[name]) == len(shape), name


def test_partition_rules_derive_from_the_rows():
    assert PARTITION_RULES == partition_rules()
    for row in PARAMETERS:
        spec = PARTITION_RULES[row.name]
        assert tuple(spec) == ((None,) if row.per_layer else ()) + tuple(row.spec)  # the layer axis is never split
        assert set(spec) <= {None, MODEL}


def test_transposed_params_are_the_projections():
    """Every weight matrix but the embedding tables (`[rows, D]` in the checkpoints too) is
    stored `[in, out]`, transposed from the checkpoints' `[out, in]`: each expert's of a stack of
    them too."""
    ranks = {name: len(shape) for config in feature_configs() for name, shape in flat(param_shapes(config)).items()}
    layer_ranks = {row.name: ranks[row.name] - row.per_layer for row in PARAMETERS}
    assert {name for name, rank in layer_ranks.items() if rank == 3} == {"expert_gate", "expert_up", "expert_down"}
    matrices = {name for name, rank in layer_ranks.items() if rank >= 2 and not name.endswith("_bias")}
    # (linear attention's convolution kernel [channels, width] is no projection: stored as it is;
    # Gemma 4's per-layer embeddings are an embedding table)
    assert transposed_params() == matrices - {"embed", "pos_embed", "linear_conv", "ple_embed"}


# Kinds of layers no layer has two of: a checkpoint name may be the template of one row of each
# (Gemma 4's full-attention layers' `q_proj` is `global_q` there, the sliding layers' `q`;
# Gemma 4's MLP `mlp.gate_proj` is a dense layer's `gate`, a double-wide one's `wide_gate`, or the
# shared MLP beside its experts, `shared_gate`: a layer is dense or sparse, and no double-wide
# MLP is beside experts).
DISJOINT_KINDS = ({"attention", "global"}, {"keys", "global_keys"}, {"dense", "wide"}, {"dense", "wide", "experts"})


@pytest.mark.parametrize("naming", [HF, GGUF], ids=["hf", "gguf"])
def test_each_tensor_of_a_naming_family_has_one_param(naming):
    for family in naming.layer_prefix:
        table = naming.table(family)
        names = [v for k, v in table.items() if k != "layers"] + list(table["layers"].values())
        for name in set(names):  # a name twice: rows of disjoint kinds of layers
            kinds = {ROWS[k].kind for k, v in table["layers"].items() if v == name}
            assert names.count(name) == 1 or (names.count(name) == len(kinds) and kinds in DISJOINT_KINDS), name
        for name in names:
            assert name.count("#") <= 1 and (("#" not in name) or name.split("#")[1] in FUSED_PARTS), name
        assert all("{i}" in template for template in table["layers"].values())


def test_every_family_names_every_param_it_has():
    for config in family_configs():
        names = hf_names(config)
        shapes = param_shapes(config)
        assert set(shapes) - {"layers"} <= set(names), config.model_type
        assert set(shapes["layers"]) <= set(names["layers"]), config.model_type
    # llama.cpp names GPT-OSS's norm before the MLP `post_attention_norm`: its files have no norm
    # after attention
    unnamed_in = {"gpt-oss": {"attn_post_norm"}}
    for arch, table in GGUF_NAMES.items():
        unnamed = NOT_IN_GGUF | (set() if arch == "gemma4" else GEMMA4_OWN)
        for config in feature_configs():
            shapes = param_shapes(config)
            assert set(shapes) - {"layers"} - unnamed <= set(table)
            assert set(shapes["layers"]) - UNNAMED - unnamed - unnamed_in.get(arch, set()) <= set(table["layers"])
    assert GEMMA4_OWN <= set(GGUF_NAMES["gemma4"]) | set(GGUF_NAMES["gemma4"]["layers"])
    assert not GEMMA4_OWN & (set(GGUF_NAMES["gemma3"]) | set(GGUF_NAMES["gemma3"]["layers"]))


def test_a_family_takes_its_base_names_where_a_row_names_none():
    assert HF.table("phi3")["layers"]["q_bias"] == "model.layers.{i}.self_attn.q_proj.bias"  # Llama's
    assert HF.table("phi3")["layers"]["q"] == "model.layers.{i}.self_attn.qkv_proj.weight#q"  # its own
    assert "mlp_norm" not in HF.table("olmo2")["layers"]  # None: OLMo 2 has no norm before the MLP
    assert GGUF_NAMES["qwen2"] == GGUF_NAMES["gemma3"] == GGUF.table("llama")
    with pytest.raises(KeyError, match="no gguf naming"):
        GGUF.family("falcon")
    assert HF.family("qwen3") == "llama"


def test_a_new_row_reaches_every_derived_table(monkeypatch):
    """A param is one row: its shape, spec and names follow (here mixture-of-experts weights
    `[L, E, D, F]`, which no config has yet, as every config has them)."""
    experts = Parameter(
        "expert_up",
        per_layer=True,
        shape=lambda c: (4, c.hidden_size, c.intermediate_size),
        spec=(None, None, MODEL),
        transposed=True,
        hf="mlp.experts.up_proj.weight",
        gguf="ffn_up_exps.weight",
    )
    monkeypatch.setattr(parameters, "PARAMETERS", PARAMETERS + (experts,))
    assert param_shapes(BASE)["layers"]["expert_up"] == (3, 4, 16, 24)
    assert partition_rules()["expert_up"] == parameters.PartitionSpec(None, None, None, MODEL)
    assert HF.table("gemma")["layers"]["expert_up"] == "model.layers.{i}.mlp.experts.up_proj.weight"
    assert "expert_up" not in HF.table("gpt2")["layers"]
    assert GGUF.table("phi3")["layers"]["expert_up"] == "blk.{i}.ffn_up_exps.weight"
