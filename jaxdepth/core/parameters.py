"""The decoder's parameters, declared once: one row per param of the params pytree.

A row (`Parameter`) says what the param is everywhere it matters: its name, whether it is per
layer (stacked on a leading layer axis) or top level, its shape rule (a function of the
`ModelConfig`: the shape of one layer's tensor, or None where the config has no such param), its
partition spec (of one layer's tensor; `model` is the mesh axis of tensor parallelism), whether
it is stored transposed relative to the checkpoints' `[out, in]` layout, and its checkpoint names:
Hugging Face's per naming family and llama.cpp's (GGUF). Everything else derives from the rows:
`param_shapes` (the params pytree's structure), `jaxdepth.core.sharding.PARTITION_RULES`, the
converters' name tables (`conversion.hf_layouts.hf_names`, `conversion.layout.gguf_names`) and
their transposes. A new param is one row, a new checkpoint naming one entry of `HF` or `GGUF`.

Checkpoint names are plain strings, as the converters read them: a per-layer name is relative to
the naming family's layer prefix; '{e}' in a name is an expert's index (a mixture of experts'
tensors stored one per expert, stacked by the converter on the expert axis that follows the
layer axis); `name#part` is a part of a fused tensor that the converter cuts
(`#q`, `#k`, `#v`, `#gate`, `#up`), `name#T` a tensor stored `[in, out]` (GPT-2's `Conv1D`), read
transposed. A naming family takes the names of its `base` where a row names none of its own;
None in a row says the family has no such tensor.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping, Optional

import numpy as np
from jax.sharding import PartitionSpec

from jaxdepth.core.config import ModelConfig

__all__ = [
    "Parameter",
    "Naming",
    "param_shapes",
    "row_layers",
    "kind_slots",
    "partition_rules",
    "transposed_params",
    "MODEL",
    "PARAMETERS",
    "HF",
    "GGUF",
]


# The mesh axis tensor parallelism splits parameters over (`jaxdepth.core.sharding`'s mesh).
MODEL = "model"

Shape = tuple[int, ...]
Names = Mapping[str, Optional[str]]


@dataclasses.dataclass(frozen=True)
class Parameter:
    """One param of the params pytree (see the module's docstring for the columns).

    `shape` and `spec` describe one layer's tensor for a per-layer param: the params stack it on a
    leading layer axis, which is never split. `kind` ('dense', 'wide' or 'experts', 'attention'
    or 'linear', 'keys', 'global' or 'global_keys', None for every layer) is the kind of MLP or
    mixer whose layers hold it: among layers of two kinds its stack has a row for each layer of
    its kind only (`row_layers`).
    `hf` and `gguf` map a naming family (`HF`, `GGUF`) to the checkpoint's name; a plain string
    is the name in the root family (`llama`)."""

    name: str
    per_layer: bool
    shape: Callable[[ModelConfig], Optional[Shape]]
    spec: tuple
    transposed: bool = False
    hf: Names | str = dataclasses.field(default_factory=dict)
    gguf: Names | str = dataclasses.field(default_factory=dict)
    kind: Optional[str] = None

    def __post_init__(self):
        for column in ("hf", "gguf"):
            if isinstance(getattr(self, column), str):
                object.__setattr__(self, column, {"llama": getattr(self, column)})

    def shape_in(self, config: ModelConfig) -> Optional[Shape]:
        """The param's shape in the params pytree of `config` (the layer axis first for a
        per-layer param), or None where `config` has no such param."""
        shape = self.shape(config)
        if shape is None:
            return None
        return (len(row_layers(self, config)), *shape) if self.per_layer else tuple(shape)

    @property
    def partition_spec(self) -> PartitionSpec:
        """The partition spec of the param as the params pytree holds it (the layer axis first,
        replicated, for a per-layer param)."""
        return PartitionSpec(None, *self.spec) if self.per_layer else PartitionSpec(*self.spec)


@dataclasses.dataclass(frozen=True)
class Naming:
    """How one checkpoint format names the params: the rows' column (`hf` or `gguf`), each naming
    family's layer prefix ('{i}' the layer) and base (the family whose names it takes where a row
    names none of its own), and the naming family of each model (Hugging Face `model_type` or
    llama.cpp architecture; `default` for the ones not listed)."""

    column: str
    layer_prefix: Mapping[str, str]
    base: Mapping[str, str]
    family_of: Mapping[str, str]
    default: Optional[str] = None

    def family(self, model: str) -> str:
        """The naming family of `model` (a `model_type` or an architecture)."""
        if model in self.family_of:
            return self.family_of[model]
        if self.default is None:
            raise KeyError(f"no {self.column} naming for {model!r}; known: {sorted(self.family_of)}")
        return self.default

    def name(self, row: Parameter, family: str) -> Optional[str]:
        """`row`'s checkpoint name in `family` (per layer: relative to its prefix), or None."""
        names = getattr(row, self.column)
        while family not in names and family in self.base:
            family = self.base[family]
        return names.get(family)

    def table(self, family: str) -> dict:
        """The param -> checkpoint name table of `family`, shaped like the params pytree:
        top-level names, and per-layer templates under 'layers' ('{i}' the layer)."""
        top, layers = {}, {}
        for row in PARAMETERS:
            name = self.name(row, family)
            if name is not None and row.per_layer:
                layers[row.name] = self.layer_prefix[family] + name
            elif name is not None:
                top[row.name] = name
        return {**top, "layers": layers}


def _when(present: bool, *shape: int) -> Optional[Shape]:
    return shape if present else None


def _q_width(c: ModelConfig) -> int:
    return c.num_heads * c.head_dim


def _kv_width(c: ModelConfig) -> int:
    return c.num_kv_heads * c.head_dim


def _full_kv_width(c: ModelConfig) -> int:
    return c.full_kv_heads * c.full_head_dim


def _linear_channels(c: ModelConfig) -> int:
    """The channels of linear attention's fused q/k/v projection and its convolution."""
    return 2 * c.linear_key_heads * c.linear_key_dim + c.linear_value_heads * c.linear_value_dim


def _latent(c: ModelConfig) -> bool:
    return c.kv_lora_rank > 0


def _qk_norm_width(c: ModelConfig, width: int) -> Optional[Shape]:
    # one weight per head dim, shared by the heads (Qwen3, Gemma 3), or over the projection (OLMo 2)
    return _when(c.qk_norm, c.head_dim if c.qk_norm_scope == "head" else width)


def _pre_norm(c: ModelConfig, bias: bool = False) -> Optional[Shape]:
    return _when(c.pre_norms and (not bias or c.norm == "layer"), c.hidden_size)


def _post_norm(c: ModelConfig, bias: bool = False) -> Optional[Shape]:
    return _when(c.post_norms and (not bias or c.norm == "layer"), c.hidden_size)


def _gated(c: ModelConfig) -> bool:
    return c.mlp != "plain" and bool(c.dense_mlp_layers)


def _dense(c: ModelConfig, *shape: int) -> Optional[Shape]:
    return _when(bool(c.dense_mlp_layers), *shape)


def _experts(c: ModelConfig, *shape: int) -> Optional[Shape]:
    return _when(c.is_moe, c.num_experts, *shape)


def _layer(name, shape, spec, transposed=False, hf=None, gguf=None, kind=None) -> Parameter:
    return Parameter(name, True, shape, spec, transposed, hf or {}, gguf or {}, kind)


def _top(name, shape, spec, transposed=False, hf=None, gguf=None) -> Parameter:
    return Parameter(name, False, shape, spec, transposed, hf or {}, gguf or {})


_COLUMN = (None, MODEL)  # [in, out] with the output split: each head / MLP unit on one device
_ROW = (MODEL, None)  # [in, out] with the input split: only the sublayer's output is reduced
_SPLIT, _WHOLE = (MODEL,), (None,)  # a bias on split outputs; one on the residual, or a norm

# In the order of the params pytree (`param_shapes`): the top-level params around the layers, and
# per layer the projections every layer has, its norms, then the optional weights.
PARAMETERS: tuple[Parameter, ...] = (
    _top(
        "embed",
        lambda c: (c.vocab_size, c.hidden_size),
        (MODEL, None),  # [V, D]: vocabulary split
        hf={
            "llama": "model.embed_tokens.weight",
            "gemma4_multimodal": "model.language_model.embed_tokens.weight",
            "gpt_neox": "gpt_neox.embed_in.weight",
            "gpt2": "transformer.wte.weight",
        },
        gguf="token_embd.weight",
    ),
    _layer(
        "q",
        lambda c: _when(not c.q_lora_rank, c.hidden_size, _q_width(c)),
        _COLUMN,
        transposed=True,
        hf={
            "llama": "self_attn.q_proj.weight",
            "phi3": "self_attn.qkv_proj.weight#q",
            "gpt_neox": "attention.query_key_value.weight#q",
            "gpt2": "attn.c_attn.weight#q",
            "deepseek": "self_attn.q_proj.weight#rope",
            "qwen3_5": "self_attn.q_proj.weight#gated_q",
        },
        gguf={"llama": "attn_q.weight", "phi3": "attn_qkv.weight#q", "gpt2": "attn_qkv.weight#q"},
        kind="attention",
    ),
    _layer(
        "k",
        lambda c: _when(not _latent(c), c.hidden_size, _kv_width(c)),
        _COLUMN,
        transposed=True,
        hf={
            "llama": "self_attn.k_proj.weight",
            "phi3": "self_attn.qkv_proj.weight#k",
            "gpt_neox": "attention.query_key_value.weight#k",
            "gpt2": "attn.c_attn.weight#k",
        },
        gguf={"llama": "attn_k.weight", "phi3": "attn_qkv.weight#k", "gpt2": "attn_qkv.weight#k"},
        kind="keys",
    ),
    _layer(
        "v",
        lambda c: _when(not _latent(c) and not (c.keys_as_values and not c.global_layers), c.hidden_size, _kv_width(c)),
        _COLUMN,
        transposed=True,
        hf={
            "llama": "self_attn.v_proj.weight",
            "phi3": "self_attn.qkv_proj.weight#v",
            "gpt_neox": "attention.query_key_value.weight#v",
            "gpt2": "attn.c_attn.weight#v",
        },
        gguf={"llama": "attn_v.weight", "phi3": "attn_qkv.weight#v", "gpt2": "attn_qkv.weight#v"},
        kind="keys",
    ),
    _layer(
        "o",
        lambda c: (c.num_heads * c.v_head_dim, c.hidden_size),
        _ROW,
        transposed=True,
        hf={"llama": "self_attn.o_proj.weight", "gpt_neox": "attention.dense.weight", "gpt2": "attn.c_proj.weight#T"},
        gguf="attn_output.weight",
        kind="attention",
    ),
    _layer(
        "up",
        lambda c: _dense(c, c.hidden_size, c.dense_width),
        _COLUMN,
        transposed=True,
        hf={
            "llama": "mlp.up_proj.weight",
            "phi3": "mlp.gate_up_proj.weight#up",
            "gpt_neox": "mlp.dense_h_to_4h.weight",
            "gpt2": "mlp.c_fc.weight#T",
        },
        gguf={"llama": "ffn_up.weight", "phi3": "ffn_up.weight#up"},
        kind="dense",
    ),
    _layer(
        "down",
        lambda c: _dense(c, c.dense_width, c.hidden_size),
        _ROW,
        transposed=True,
        hf={"llama": "mlp.down_proj.weight", "gpt_neox": "mlp.dense_4h_to_h.weight", "gpt2": "mlp.c_proj.weight#T"},
        gguf="ffn_down.weight",
        kind="dense",
    ),
    # Norms. Gemma 2/3 name the norm after attention `post_attention_layernorm`, Llama's name for
    # the norm before the MLP; OLMo 2 has only the norms after the sublayers. llama.cpp names a
    # norm by its place in the layer, whatever the architecture.
    _layer(
        "attn_norm",
        _pre_norm,
        _WHOLE,
        hf={
            "llama": "input_layernorm.weight",
            "olmo2": None,
            "gpt_neox": "input_layernorm.weight",
            "gpt2": "ln_1.weight",
        },
        gguf="attn_norm.weight",
    ),
    _layer(
        "attn_norm_bias",
        lambda c: _pre_norm(c, bias=True),
        _WHOLE,
        hf={"gpt_neox": "input_layernorm.bias", "gpt2": "ln_1.bias"},
        gguf="attn_norm.bias",
    ),
    _layer(
        "mlp_norm",
        _pre_norm,
        _WHOLE,
        hf={
            "llama": "post_attention_layernorm.weight",
            "gemma": "pre_feedforward_layernorm.weight",
            "olmo2": None,
            "gpt_neox": "post_attention_layernorm.weight",
            "gpt2": "ln_2.weight",
        },
        gguf={"llama": "ffn_norm.weight", "gpt_oss": "post_attention_norm.weight"},
    ),
    _layer(
        "mlp_norm_bias",
        lambda c: _pre_norm(c, bias=True),
        _WHOLE,
        hf={"gpt_neox": "post_attention_layernorm.bias", "gpt2": "ln_2.bias"},
        gguf="ffn_norm.bias",
    ),
    _layer(
        "attn_post_norm",
        _post_norm,
        _WHOLE,
        hf={"gemma": "post_attention_layernorm.weight", "olmo2": "post_attention_layernorm.weight"},
        gguf={"llama": "post_attention_norm.weight", "gpt_oss": None},
    ),
    # (no family has LayerNorms after its sublayers: no checkpoint names these two biases)
    _layer("attn_post_norm_bias", lambda c: _post_norm(c, bias=True), _WHOLE),
    _layer(
        "mlp_post_norm",
        _post_norm,
        _WHOLE,
        hf={"gemma": "post_feedforward_layernorm.weight", "olmo2": "post_feedforward_layernorm.weight"},
        gguf="post_ffw_norm.weight",
    ),
    _layer("mlp_post_norm_bias", lambda c: _post_norm(c, bias=True), _WHOLE),
    # The optional weights: the gated MLP's gate, the biases, the q/k norms.
    _layer(
        "gate",
        lambda c: _when(_gated(c), c.hidden_size, c.dense_width),
        _COLUMN,
        transposed=True,
        hf={"llama": "mlp.gate_proj.weight", "phi3": "mlp.gate_up_proj.weight#gate"},
        gguf={"llama": "ffn_gate.weight", "phi3": "ffn_up.weight#gate"},
        kind="dense",
    ),
    _layer(
        "up_bias",
        lambda c: _dense(c, c.dense_width) if c.mlp_bias else None,
        _SPLIT,
        hf={"llama": "mlp.up_proj.bias", "gpt_neox": "mlp.dense_h_to_4h.bias", "gpt2": "mlp.c_fc.bias"},
        gguf="ffn_up.bias",
        kind="dense",
    ),
    _layer(
        "down_bias",
        lambda c: _dense(c, c.hidden_size) if c.mlp_bias else None,
        _WHOLE,
        hf={"llama": "mlp.down_proj.bias", "gpt_neox": "mlp.dense_4h_to_h.bias", "gpt2": "mlp.c_proj.bias"},
        gguf="ffn_down.bias",
        kind="dense",
    ),
    _layer(
        "gate_bias",
        lambda c: _when(c.mlp_bias and _gated(c), c.dense_width),
        _SPLIT,
        hf="mlp.gate_proj.bias",
        gguf="ffn_gate.bias",
        kind="dense",
    ),
    _layer(
        "q_bias",
        lambda c: _when(c.qkv_bias, _q_width(c)),
        _SPLIT,
        hf={
            "llama": "self_attn.q_proj.bias",
            "gpt_neox": "attention.query_key_value.bias#q",
            "gpt2": "attn.c_attn.bias#q",
        },
        gguf={"llama": "attn_q.bias", "phi3": "attn_qkv.bias#q", "gpt2": "attn_qkv.bias#q"},
        kind="attention",
    ),
    _layer(
        "k_bias",
        lambda c: _when(c.qkv_bias, _kv_width(c)),
        _SPLIT,
        hf={
            "llama": "self_attn.k_proj.bias",
            "gpt_neox": "attention.query_key_value.bias#k",
            "gpt2": "attn.c_attn.bias#k",
        },
        gguf={"llama": "attn_k.bias", "phi3": "attn_qkv.bias#k", "gpt2": "attn_qkv.bias#k"},
        kind="keys",
    ),
    _layer(
        "v_bias",
        lambda c: _when(c.qkv_bias, _kv_width(c)),
        _SPLIT,
        hf={
            "llama": "self_attn.v_proj.bias",
            "gpt_neox": "attention.query_key_value.bias#v",
            "gpt2": "attn.c_attn.bias#v",
        },
        gguf={"llama": "attn_v.bias", "phi3": "attn_qkv.bias#v", "gpt2": "attn_qkv.bias#v"},
        kind="keys",
    ),
    _layer(
        "o_bias",
        lambda c: _when(c.o_bias, c.hidden_size),
        _WHOLE,
        hf={"llama": "self_attn.o_proj.bias", "gpt_neox": "attention.dense.bias", "gpt2": "attn.c_proj.bias"},
        gguf="attn_output.bias",
        kind="attention",
    ),
    # Multi-head latent attention (DeepSeek-V3): the queries' latent and its norm, the keys' and
    # values' latent with the shared rotary key beside it, its norm, and the per-head expansion.
    _layer(
        "q_a",
        lambda c: _when(c.q_lora_rank > 0, c.hidden_size, c.q_lora_rank),
        (None, None),
        transposed=True,
        hf={"deepseek": "self_attn.q_a_proj.weight"},
        gguf="attn_q_a.weight",
        kind="attention",
    ),
    _layer(
        "q_a_norm",
        lambda c: _when(c.q_lora_rank > 0, c.q_lora_rank),
        _WHOLE,
        hf={"deepseek": "self_attn.q_a_layernorm.weight"},
        gguf="attn_q_a_norm.weight",
        kind="attention",
    ),
    _layer(
        "q_b",
        lambda c: _when(c.q_lora_rank > 0, c.q_lora_rank, _q_width(c)),
        _COLUMN,
        transposed=True,
        hf={"deepseek": "self_attn.q_b_proj.weight#rope"},
        gguf="attn_q_b.weight",
        kind="attention",
    ),
    _layer(
        "kv_a",
        lambda c: _when(_latent(c), c.hidden_size, c.kv_lora_rank + c.rotated_dims),
        (None, None),
        transposed=True,
        hf={"deepseek": "self_attn.kv_a_proj_with_mqa.weight#rope_last"},
        gguf="attn_kv_a_mqa.weight",
        kind="attention",
    ),
    _layer(
        "kv_a_norm",
        lambda c: _when(_latent(c), c.kv_lora_rank),
        _WHOLE,
        hf={"deepseek": "self_attn.kv_a_layernorm.weight"},
        gguf="attn_kv_a_norm.weight",
        kind="attention",
    ),
    _layer(
        "kv_b",
        lambda c: _when(_latent(c), c.kv_lora_rank, c.num_heads * (c.head_dim - c.rotated_dims + c.v_head_dim)),
        _COLUMN,
        transposed=True,
        hf={"deepseek": "self_attn.kv_b_proj.weight"},
        gguf="attn_kv_b.weight",
        kind="attention",
    ),
    # A mixture of experts in place of the MLP: the router's weights [D, E] (small: replicated)
    # and each expert's gated MLP, stacked on an expert axis that the mesh's model axis splits
    # (each device holds whole experts).
    _layer(
        "router",
        lambda c: _when(c.is_moe, c.hidden_size, c.num_experts),
        (None, None),
        transposed=True,
        hf={
            "llama": "mlp.gate.weight",
            "mixtral": "block_sparse_moe.gate.weight",
            "gpt_oss": "mlp.router.weight",
            "gemma4": "router.proj.weight",
        },
        gguf="ffn_gate_inp.weight",
        kind="experts",
    ),
    # Gemma 4's router reads its own weightless norm of the MLP's input, scaled per dim, and
    # scales each chosen expert's weight (`ModelConfig.expert_norms`)
    _layer(
        "router_scale",
        lambda c: _when(c.expert_norms, c.hidden_size),
        _WHOLE,
        hf={"gemma4": "router.scale"},
        kind="experts",
    ),
    _layer(
        "router_expert_scale",
        lambda c: _when(c.expert_norms, c.num_experts),
        (None,),
        hf={"gemma4": "router.per_expert_scale"},
        kind="experts",
    ),
    # ... and its experts their own norm of it, each part of the MLP its own post-norm
    _layer(
        "expert_norm",
        lambda c: _when(c.expert_norms, c.hidden_size),
        _WHOLE,
        hf={"gemma4": "pre_feedforward_layernorm_2.weight"},
        kind="experts",
    ),
    _layer(
        "expert_post_norm",
        lambda c: _when(c.expert_norms, c.hidden_size),
        _WHOLE,
        hf={"gemma4": "post_feedforward_layernorm_2.weight"},
        kind="experts",
    ),
    _layer(
        "shared_post_norm",
        lambda c: _when(c.expert_norms, c.hidden_size),
        _WHOLE,
        hf={"gemma4": "post_feedforward_layernorm_1.weight"},
        kind="experts",
    ),
    _layer(
        "router_correction",
        lambda c: _when(c.router_correction, c.num_experts),
        (None,),
        hf={"deepseek": "mlp.gate.e_score_correction_bias"},
        gguf="exp_probs_b.bias",
        kind="experts",
    ),
    _layer(
        "shared_gate",
        lambda c: _when(c.shared_expert_size > 0, c.hidden_size, c.shared_expert_size),
        _COLUMN,
        transposed=True,
        hf={"deepseek": "mlp.shared_experts.gate_proj.weight", "gemma4": "mlp.gate_proj.weight"},
        gguf="ffn_gate_shexp.weight",
        kind="experts",
    ),
    _layer(
        "shared_up",
        lambda c: _when(c.shared_expert_size > 0, c.hidden_size, c.shared_expert_size),
        _COLUMN,
        transposed=True,
        hf={"deepseek": "mlp.shared_experts.up_proj.weight", "gemma4": "mlp.up_proj.weight"},
        gguf="ffn_up_shexp.weight",
        kind="experts",
    ),
    _layer(
        "shared_down",
        lambda c: _when(c.shared_expert_size > 0, c.shared_expert_size, c.hidden_size),
        _ROW,
        transposed=True,
        hf={"deepseek": "mlp.shared_experts.down_proj.weight", "gemma4": "mlp.down_proj.weight"},
        gguf="ffn_down_shexp.weight",
        kind="experts",
    ),
    _layer(
        "router_bias",
        lambda c: _when(c.router_bias, c.num_experts),
        (None,),
        hf={"gpt_oss": "mlp.router.bias"},
        gguf="ffn_gate_inp.bias",
        kind="experts",
    ),
    _layer(
        "expert_gate",
        lambda c: _experts(c, c.hidden_size, c.intermediate_size),
        (MODEL, None, None),
        transposed=True,
        hf={
            "llama": "mlp.experts.{e}.gate_proj.weight",
            "mixtral": "block_sparse_moe.experts.{e}.w1.weight",
            "gpt_oss": "mlp.experts.gate_up_proj#gate",
            "gemma4": "experts.gate_up_proj#gate",
        },
        gguf="ffn_gate_exps.weight",
        kind="experts",
    ),
    _layer(
        "expert_up",
        lambda c: _experts(c, c.hidden_size, c.intermediate_size),
        (MODEL, None, None),
        transposed=True,
        hf={
            "llama": "mlp.experts.{e}.up_proj.weight",
            "mixtral": "block_sparse_moe.experts.{e}.w3.weight",
            "gpt_oss": "mlp.experts.gate_up_proj#up",
            "gemma4": "experts.gate_up_proj#up",
        },
        gguf="ffn_up_exps.weight",
        kind="experts",
    ),
    _layer(
        "expert_down",
        lambda c: _experts(c, c.intermediate_size, c.hidden_size),
        (MODEL, None, None),
        transposed=True,
        hf={
            "llama": "mlp.experts.{e}.down_proj.weight",
            "mixtral": "block_sparse_moe.experts.{e}.w2.weight",
            "gpt_oss": "mlp.experts.down_proj#T",
            "gemma4": "experts.down_proj",
        },
        gguf="ffn_down_exps.weight",
        kind="experts",
    ),
    # GPT-OSS's experts have biases (`mlp_bias` in a mixture)
    _layer(
        "expert_gate_bias",
        lambda c: _experts(c, c.intermediate_size) if c.mlp_bias else None,
        (MODEL, None),
        hf={"gpt_oss": "mlp.experts.gate_up_proj_bias#gate"},
        gguf="ffn_gate_exps.bias",
        kind="experts",
    ),
    _layer(
        "expert_up_bias",
        lambda c: _experts(c, c.intermediate_size) if c.mlp_bias else None,
        (MODEL, None),
        hf={"gpt_oss": "mlp.experts.gate_up_proj_bias#up"},
        gguf="ffn_up_exps.bias",
        kind="experts",
    ),
    _layer(
        "expert_down_bias",
        lambda c: _experts(c, c.hidden_size) if c.mlp_bias else None,
        (MODEL, None),
        hf={"gpt_oss": "mlp.experts.down_proj_bias"},
        gguf="ffn_down_exps.bias",
        kind="experts",
    ),
    # GPT-OSS's attention sinks: a logit per head
    _layer(
        "sinks",
        lambda c: _when(c.attention_sinks, c.num_heads),
        _SPLIT,
        hf={"gpt_oss": "self_attn.sinks"},
        gguf="attn_sinks.weight",
        kind="attention",
    ),
    _layer(
        "q_norm",
        lambda c: _qk_norm_width(c, _q_width(c)),
        _WHOLE,
        hf="self_attn.q_norm.weight",
        gguf="attn_q_norm.weight",
        kind="attention",
    ),
    _layer(
        "k_norm",
        lambda c: _qk_norm_width(c, _kv_width(c)),
        _WHOLE,
        hf="self_attn.k_norm.weight",
        gguf="attn_k_norm.weight",
        kind="keys",
    ),
    # Qwen3.5's gate on each head's output, from the attention's input (cut from its q_proj)
    _layer(
        "attn_gate",
        lambda c: _when(c.attention_gate, c.hidden_size, c.num_heads * c.head_dim),
        _COLUMN,
        transposed=True,
        hf={"qwen3_5": "self_attn.q_proj.weight#gated_gate"},
        kind="attention",
    ),
    # Linear attention (Qwen3.5's gated DeltaNet, `jaxdepth.core.linear_attention`): the fused
    # q/k/v projection and its causal convolution, the output gate's, beta's and the decay's
    # projections, the decay's bias and log rate, the gated norm and the output projection
    _layer(
        "linear_qkv",
        lambda c: _when(c.mixed_mixers, c.hidden_size, _linear_channels(c)),
        _COLUMN,
        transposed=True,
        hf={"qwen3_5": "linear_attn.in_proj_qkv.weight"},
        kind="linear",
    ),
    _layer(
        "linear_conv",
        lambda c: _when(c.mixed_mixers, _linear_channels(c), c.linear_conv_kernel),
        (MODEL, None),
        hf={"qwen3_5": "linear_attn.conv1d.weight#conv"},
        kind="linear",
    ),
    _layer(
        "linear_z",
        lambda c: _when(c.mixed_mixers, c.hidden_size, c.linear_value_heads * c.linear_value_dim),
        _COLUMN,
        transposed=True,
        hf={"qwen3_5": "linear_attn.in_proj_z.weight"},
        kind="linear",
    ),
    _layer(
        "linear_b",
        lambda c: _when(c.mixed_mixers, c.hidden_size, c.linear_value_heads),
        (None, None),
        transposed=True,
        hf={"qwen3_5": "linear_attn.in_proj_b.weight"},
        kind="linear",
    ),
    _layer(
        "linear_a",
        lambda c: _when(c.mixed_mixers, c.hidden_size, c.linear_value_heads),
        (None, None),
        transposed=True,
        hf={"qwen3_5": "linear_attn.in_proj_a.weight"},
        kind="linear",
    ),
    _layer(
        "linear_dt_bias",
        lambda c: _when(c.mixed_mixers, c.linear_value_heads),
        _WHOLE,
        hf={"qwen3_5": "linear_attn.dt_bias"},
        kind="linear",
    ),
    _layer(
        "linear_A_log",
        lambda c: _when(c.mixed_mixers, c.linear_value_heads),
        _WHOLE,
        hf={"qwen3_5": "linear_attn.A_log"},
        kind="linear",
    ),
    _layer(
        "linear_norm",
        lambda c: _when(c.mixed_mixers, c.linear_value_dim),
        _WHOLE,
        hf={"qwen3_5": "linear_attn.norm.weight"},
        kind="linear",
    ),
    _layer(
        "linear_out",
        lambda c: _when(c.mixed_mixers, c.linear_value_heads * c.linear_value_dim, c.hidden_size),
        _ROW,
        transposed=True,
        hf={"qwen3_5": "linear_attn.out_proj.weight"},
        kind="linear",
    ),
    # Gemma 4's full-attention layers where their attention has shapes of its own
    # (`ModelConfig.global_layers`): heads `full_head_dim` wide, `full_kv_heads` of keys and
    # values, no value projection where the values are the keys'
    _layer(
        "global_q",
        lambda c: _when(bool(c.global_layers), c.hidden_size, c.num_heads * c.full_head_dim),
        _COLUMN,
        transposed=True,
        hf={"gemma4": "self_attn.q_proj.weight"},
        gguf={"gemma4": "attn_q.weight"},
        kind="global",
    ),
    _layer(
        "global_k",
        lambda c: _when(bool(c.global_layers), c.hidden_size, _full_kv_width(c)),
        _COLUMN,
        transposed=True,
        hf={"gemma4": "self_attn.k_proj.weight"},
        gguf={"gemma4": "attn_k.weight"},
        kind="global_keys",
    ),
    _layer(
        "global_v",
        lambda c: _when(bool(c.global_layers and not c.keys_as_values), c.hidden_size, _full_kv_width(c)),
        _COLUMN,
        transposed=True,
        hf={"gemma4": "self_attn.v_proj.weight"},
        gguf={"gemma4": "attn_v.weight"},
        kind="global_keys",
    ),
    _layer(
        "global_o",
        lambda c: _when(bool(c.global_layers), c.num_heads * c.full_head_dim, c.hidden_size),
        _ROW,
        transposed=True,
        hf={"gemma4": "self_attn.o_proj.weight"},
        gguf={"gemma4": "attn_output.weight"},
        kind="global",
    ),
    _layer(
        "global_q_norm",
        lambda c: _when(bool(c.global_layers) and c.qk_norm, c.full_head_dim),
        _WHOLE,
        hf={"gemma4": "self_attn.q_norm.weight"},
        gguf={"gemma4": "attn_q_norm.weight"},
        kind="global",
    ),
    _layer(
        "global_k_norm",
        lambda c: _when(bool(c.global_layers) and c.qk_norm, c.full_head_dim),
        _WHOLE,
        hf={"gemma4": "self_attn.k_norm.weight"},
        gguf={"gemma4": "attn_k_norm.weight"},
        kind="global_keys",
    ),
    # Gemma 4's double-wide MLPs (`ModelConfig.wide_mlp_layers`): 2 F hidden units
    _layer(
        "wide_gate",
        lambda c: _when(bool(c.wide_mlp_layers), c.hidden_size, 2 * c.intermediate_size),
        _COLUMN,
        transposed=True,
        hf={"gemma4": "mlp.gate_proj.weight"},
        gguf={"gemma4": "ffn_gate.weight"},
        kind="wide",
    ),
    _layer(
        "wide_up",
        lambda c: _when(bool(c.wide_mlp_layers), c.hidden_size, 2 * c.intermediate_size),
        _COLUMN,
        transposed=True,
        hf={"gemma4": "mlp.up_proj.weight"},
        gguf={"gemma4": "ffn_up.weight"},
        kind="wide",
    ),
    _layer(
        "wide_down",
        lambda c: _when(bool(c.wide_mlp_layers), 2 * c.intermediate_size, c.hidden_size),
        _ROW,
        transposed=True,
        hf={"gemma4": "mlp.down_proj.weight"},
        gguf={"gemma4": "ffn_down.weight"},
        kind="wide",
    ),
    # Gemma 4's per-layer inputs (`ModelConfig.per_layer_input_size` P): each layer's gate from its
    # residual [D, P], projection back [P, D] and norm; the per-layer embeddings of every layer
    # [V, L P], the projection of the embeddings to them [D, L P] and its norm [P]; each layer's
    # output scalar
    _layer(
        "ple_gate",
        lambda c: _when(c.per_layer_input_size > 0, c.hidden_size, c.per_layer_input_size),
        (None, None),
        transposed=True,
        hf={"gemma4": "per_layer_input_gate.weight"},
        gguf={"gemma4": "inp_gate.weight"},
    ),
    _layer(
        "ple_proj",
        lambda c: _when(c.per_layer_input_size > 0, c.per_layer_input_size, c.hidden_size),
        (None, None),
        transposed=True,
        hf={"gemma4": "per_layer_projection.weight"},
        gguf={"gemma4": "proj.weight"},
    ),
    _layer(
        "ple_norm",
        lambda c: _when(c.per_layer_input_size > 0, c.hidden_size),
        _WHOLE,
        hf={"gemma4": "post_per_layer_input_norm.weight"},
        gguf={"gemma4": "post_norm.weight"},
    ),
    _layer(
        "layer_scalar",
        lambda c: _when(c.layer_scalar, 1),
        _WHOLE,
        hf={"gemma4": "layer_scalar"},
        gguf={"gemma4": "layer_output_scale.weight"},
    ),
    _top(
        "ple_embed",
        lambda c: _when(c.per_layer_input_size > 0, c.vocab_size, c.num_layers * c.per_layer_input_size),
        (MODEL, None),  # [V, L P]: vocabulary split
        hf={
            "gemma4": "model.embed_tokens_per_layer.weight",
            "gemma4_multimodal": "model.language_model.embed_tokens_per_layer.weight",
        },
        gguf={"gemma4": "per_layer_token_embd.weight"},
    ),
    _top(
        "ple_model_proj",
        lambda c: _when(c.per_layer_input_size > 0, c.hidden_size, c.num_layers * c.per_layer_input_size),
        (None, None),
        transposed=True,
        hf={
            "gemma4": "model.per_layer_model_projection.weight",
            "gemma4_multimodal": "model.language_model.per_layer_model_projection.weight",
        },
        gguf={"gemma4": "per_layer_model_proj.weight"},
    ),
    _top(
        "ple_proj_norm",
        lambda c: _when(c.per_layer_input_size > 0, c.per_layer_input_size),
        _WHOLE,
        hf={
            "gemma4": "model.per_layer_projection_norm.weight",
            "gemma4_multimodal": "model.language_model.per_layer_projection_norm.weight",
        },
        gguf={"gemma4": "per_layer_proj_norm.weight"},
    ),
    _top(
        "final_norm",
        lambda c: (c.hidden_size,),
        _WHOLE,
        hf={
            "llama": "model.norm.weight",
            "gemma4_multimodal": "model.language_model.norm.weight",
            "gpt_neox": "gpt_neox.final_layer_norm.weight",
            "gpt2": "transformer.ln_f.weight",
        },
        gguf="output_norm.weight",
    ),
    _top(
        "final_norm_bias",
        lambda c: _when(c.norm == "layer", c.hidden_size),
        _WHOLE,
        hf={"gpt_neox": "gpt_neox.final_layer_norm.bias", "gpt2": "transformer.ln_f.bias"},
        gguf="output_norm.bias",
    ),
    _top(
        "pos_embed",
        lambda c: _when(c.positions == "learned", c.max_position_embeddings, c.hidden_size),
        (None, None),  # [positions, D] (GPT-2)
        hf={"gpt2": "transformer.wpe.weight"},
        gguf="position_embd.weight",
    ),
    _top(
        "lm_head",
        lambda c: _when(not c.tie_word_embeddings, c.hidden_size, c.vocab_size),
        (None, MODEL),  # [D, V]: vocabulary split
        transposed=True,
        hf={"llama": "lm_head.weight", "gpt_neox": "embed_out.weight", "gpt2": "lm_head.weight"},
        gguf="output.weight",
    ),
)

# Hugging Face's naming families: Llama's (Qwen, Mistral and any `model_type` not listed), those
# that rename some of its tensors or fuse them (Phi-3: q/k/v and gate/up), and GPT-NeoX's and
# GPT-2's own (GPT-NeoX interleaves q/k/v per head; GPT-2 fuses them in a `Conv1D`, `[in, out]`).
_LLAMA_LAYERS = "model.layers.{i}."
HF = Naming(
    column="hf",
    layer_prefix={
        "llama": _LLAMA_LAYERS,
        "gemma": _LLAMA_LAYERS,
        "gemma4": _LLAMA_LAYERS,
        "gemma4_multimodal": "model.language_model.layers.{i}.",
        "olmo2": _LLAMA_LAYERS,
        "mixtral": _LLAMA_LAYERS,
        "gpt_oss": _LLAMA_LAYERS,
        "deepseek": _LLAMA_LAYERS,
        "qwen3_5": _LLAMA_LAYERS,
        "phi3": _LLAMA_LAYERS,
        "gpt_neox": "gpt_neox.layers.{i}.",
        "gpt2": "transformer.h.{i}.",
    },
    base={
        "gemma": "llama",
        "gemma4": "gemma",
        "gemma4_multimodal": "gemma4",
        "olmo2": "llama",
        "mixtral": "llama",
        "gpt_oss": "llama",
        "deepseek": "llama",
        "qwen3_5": "llama",
        "phi3": "llama",
    },
    family_of={
        "gemma2": "gemma",
        "gemma3_text": "gemma",
        "gemma4_text": "gemma4",
        "gemma4": "gemma4_multimodal",
        "olmo2": "olmo2",
        "mixtral": "mixtral",
        "gpt_oss": "gpt_oss",
        "deepseek_v3": "deepseek",
        "qwen3_5_text": "qwen3_5",
        "phi3": "phi3",
        "gpt2": "gpt2",
        "gpt_neox": "gpt_neox",
    },
    default="llama",
)

# llama.cpp's names (gguf's `TensorNameMap`, which its converter writes them with): one naming
# serves every architecture with separate projections; Phi-3 and GPT-2 keep their fused tensors
# as the checkpoint has them, stacked by rows (GPT-2's `Conv1D` weights transposed to [out, in]
# by the converter): q/k/v in `attn_qkv`, Phi-3's gate and up in `ffn_up`. GPT-OSS's norm before
# the MLP is its `post_attention_norm` (the Hugging Face name), and it has no other. Gemma 4's
# own params (its full-attention layers' and wide MLPs' under the names of the layers' others, its
# per-layer inputs, its layer scalars) are named in its table alone.
GGUF = Naming(
    column="gguf",
    layer_prefix=dict.fromkeys(("llama", "phi3", "gpt2", "gpt_oss", "gemma4"), "blk.{i}."),
    base={"phi3": "llama", "gpt2": "llama", "gpt_oss": "llama", "gemma4": "llama"},
    family_of={
        **dict.fromkeys(("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3"), "llama"),
        "phi3": "phi3",
        "gpt2": "gpt2",
        "gpt-oss": "gpt_oss",
        "gemma4": "gemma4",
    },
)


def row_layers(row: Parameter, config: ModelConfig) -> tuple[int, ...]:
    """The layers whose weights per-layer param `row` holds, in its stack's order: every layer,
    or those of its `kind`: the dense ('dense'; 'wide' those twice as wide, Gemma 4's) or the
    sparse layers of a mixture of experts ('experts'), the layers of attention ('attention'; of
    them those that compute their own keys and values, 'keys') or of linear attention
    ('linear'), the full-attention layers of shapes of their own ('global'; 'global_keys' those
    of them that compute their own keys and values)."""
    own, shared = set(config.global_layers), set(config.shared_kv_layers)
    attention = tuple(i for i in config.attention_layers if i not in own)
    kinds = {
        None: tuple(range(config.num_layers)),
        "dense": tuple(i for i in config.dense_mlp_layers if i not in config.wide_mlp_layers),
        "wide": config.wide_mlp_layers,
        "experts": config.expert_layers,
        "attention": attention,
        "keys": tuple(i for i in attention if i not in shared),
        "global": config.global_layers,
        "global_keys": tuple(i for i in config.global_layers if i not in shared),
        "linear": config.linear_layers,
    }
    return kinds[row.kind]


@functools.lru_cache(maxsize=64)
def kind_slots(config: ModelConfig) -> dict[str, np.ndarray]:
    """The per-layer params of `config` that a layer reads in place from their stacks, with each
    layer's row in its stack `[L]` (int32; -1 where the layer has none): how a traced layer
    index reads them (`jaxdepth.core.layer.layer_params`). They are the params stacked over
    some layers only (layers of two kinds), and the experts' weights of every mixture: a scan
    over the stacks would copy a layer's E experts each layer (2.4 GB of float32 in a
    Qwen3-30B-A3B layer), where read in place each block of rows reads its one expert's. Empty
    for a dense model."""
    slots = {}
    for row in PARAMETERS:
        layers = row_layers(row, config) if row.per_layer else ()
        if (
            row.per_layer
            and row.shape(config) is not None
            and (len(layers) < config.num_layers or row.kind == "experts")
        ):
            table = np.full(config.num_layers, -1, np.int32)
            table[list(layers)] = np.arange(len(layers), dtype=np.int32)
            slots[row.name] = table
    return slots


def param_shapes(config: ModelConfig) -> dict:
    """The shape of every parameter, as a nested dict mirroring the params pytree: what the
    family's features (`ModelConfig`) ask for, nothing more (one entry per row of `PARAMETERS`
    whose shape rule gives a shape; the per-layer ones under 'layers', where the first of them sits)."""
    shapes: dict = {}
    for row in PARAMETERS:
        shape = row.shape_in(config)
        if row.per_layer:
            shapes.setdefault("layers", {})
            if shape is not None:
                shapes["layers"][row.name] = shape
        elif shape is not None:
            shapes[row.name] = shape
    return shapes


def partition_rules() -> dict[str, PartitionSpec]:
    """Param name -> partition spec of every row (`jaxdepth.core.sharding.PARTITION_RULES`)."""
    return {row.name: row.partition_spec for row in PARAMETERS}


def transposed_params() -> frozenset[str]:
    """The params stored transposed relative to the checkpoints' `[out, in]` layout."""
    return frozenset(row.name for row in PARAMETERS if row.transposed)
