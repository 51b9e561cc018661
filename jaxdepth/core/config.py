"""Model configuration: a frozen, keyword-only description of a decoder-only transformer.

`ModelConfig.from_hf` reads a Hugging Face `config.json` dictionary and refuses every
architecture or config feature this project does not implement, naming the offending key:
a silently ignored rope-scaling rule or sliding window would make every analysis wrong
without any visible symptom.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from jaxdepth.core.hf_config import SUPPORTED_MODEL_TYPES, UnsupportedConfigError, config_fields

__all__ = [
    "ModelConfig",
    "ROPE_TYPES",
    "NORMS",
    "ACTIVATIONS",
    "MLPS",
    "POSITIONS",
    "LAYER_TYPES",
    "QK_NORM_SCOPES",
    "ROUTERS",
]


ROPE_TYPES = ("default", "llama3", "linear", "longrope", "yarn", "proportional")
NORMS = ("rms", "layer")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
MLPS = ("gated", "plain", "clamped")
POSITIONS = ("rotary", "learned")
LAYER_TYPES = ("full", "sliding")
QK_NORM_SCOPES = ("head", "projection")
ROUTERS = ("softmax", "sigmoid")


def _layer_indices(layers: tuple, num_layers: int) -> bool:
    """Whether `layers` are layer indices, ascending, each once, among `num_layers` layers."""
    return list(layers) == sorted(set(layers)) and all(0 <= i < num_layers for i in layers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer: one layer body whose family features are
    the fields below (every family of `SUPPORTED_MODEL_TYPES` is a setting of them).

    Frozen, keyword-only and hashable: every jitted function takes it as a static argument, so a
    different config compiles anew. Build it with `from_hf` from a Hugging Face `config.json`;
    a loaded model carries its own (`Model.config`).

    Shapes, in the axis names of `jaxdepth.core.model`: `vocab_size` V, `hidden_size` D,
    `intermediate_size` F (the MLP), `num_layers` L, `num_heads` H query heads and
    `num_kv_heads` K key/value heads (query head h reads kv head h // (H // K)), `head_dim` Dh.
    `max_position_embeddings` is the longest context the checkpoint declares (`Model` and the
    analyses refuse longer token arrays). `tie_word_embeddings`: the LM head is the embedding
    matrix (no `lm_head` param).

    Norms: `norm` 'rms' (RMSNorm) or 'layer' (LayerNorm with a bias); `rms_norm_eps` is the
    epsilon of every norm; `norm_offset` is added to the weight (Gemma's `1 + w`);
    `norm_scale_in_float32` multiplies by the weight before casting back to the activations'
    dtype (Gemma, OLMo 2) instead of after (Llama, Qwen). `pre_norms`: norms before attention and
    the MLP (all but OLMo 2); `post_norms`: norms on their outputs, before the residual adds them
    (Gemma 2/3, OLMo 2). `parallel_residual`: attention and MLP both read h_l and
    `h_{l+1} = h_l + a + m` (GPT-NeoX); otherwise the MLP reads `h_l + a`.

    Attention: `qkv_bias` (q/k/v projection biases), `o_bias` (output projection bias),
    `qk_norm` (an RMSNorm on queries and keys before the rotation, over each head or, with
    `qk_norm_scope` 'projection', over the whole projection as OLMo 2 does), `attn_scale` (the
    score scale; 0 means Dh**-0.5), `attn_softcap` (scores become `c * tanh(s / c)`; 0: none),
    `sliding_window` W (a query sees the W latest keys, itself included) on the layers whose
    `layer_types` entry is 'sliding' (`layer_types` () means every layer attends fully).

    Positions: `positions` 'rotary' (rotate-half embeddings on the first `rotary_dim` dims of
    each head, 0 meaning all of them, base `rope_theta`; `rope_type` 'llama3' rescales the
    frequencies as Llama 3.1 / 3.2 do, with `rope_factor`, the low and high frequency factors
    and the original context; 'linear' divides them by `rope_factor`; 'longrope' (Phi-3's long
    context models) divides them per frequency by `rope_short_factor`, or by `rope_long_factor`
    in a prompt longer than `rope_original_max_position`, and scales cos and sin by
    `rope_attention_factor`; 'yarn' blends each frequency between itself and itself divided by
    `rope_factor` by a linear ramp between the correction dims of `rope_beta_fast` and
    `rope_beta_slow` rotations in the original context (floored and ceiled where
    `rope_truncate`), and scales cos and sin by `rope_attention_factor`; sliding layers use base
    `local_rope_theta` without scaling where it is not 0, as Gemma 3 does) or 'learned'
    (GPT-2's absolute position embeddings, param `pos_embed`).

    Embeddings and head: `embed_scale` multiplies the embeddings (Gemma: sqrt(D));
    `final_softcap` soft-caps the logits (0: none).

    MLP: `mlp` 'gated' (`act(x W_gate) * (x W_up)`, then `W_down`), 'plain' (`act(x W_up)`,
    then `W_down`) or 'clamped' (GPT-OSS: g = min(x W_gate, `glu_limit`), u = x W_up clipped
    to +-`glu_limit`, `(u + 1) * g * sigmoid(glu_alpha * g)`), `activation` 'silu',
    'gelu_tanh' (the tanh approximation) or 'gelu' (exact), `mlp_bias` (biases on the
    projections, each expert's in a mixture).

    Multi-head latent attention (`kv_lora_rank` > 0, DeepSeek-V3): keys and values are read
    from a latent of `kv_lora_rank` dims (`kv_a`, normed, then `kv_b`) and one rotary key of
    `rotary_dim` dims shared by the heads, queries from a latent of `q_lora_rank` dims (0: one
    projection); each head's query and key are `head_dim` wide, their last `rotary_dim` dims
    rotated (`rotary_last`), its value `value_head_dim` wide (0: `head_dim`). Every head has keys
    and values of its own (`num_kv_heads` = `num_heads`). `rope_interleaved`: the checkpoint
    holds the rotated dims as interleaved pairs, which the converters de-interleave into the
    halves the layer rotates.

    Attention sinks (`attention_sinks`, GPT-OSS): a learned logit per head joins every query's
    scores in the softmax and is dropped after it, so a head may attend to nothing.

    Mixture of experts: `num_experts` E > 0 replaces the MLP of every layer by E gated experts
    of width `intermediate_size` F each, of which a router picks `experts_per_token` k per
    token (`jaxdepth.core.experts`): `router` 'softmax' scores every expert by the softmax of
    its logits ('sigmoid': each expert by the sigmoid of its logit, DeepSeek-V3), the k best
    run, their weights the scores, renormalised to sum to 1 where `normalize_expert_weights`
    (Mixtral, GPT-OSS, and the others' `norm_topk_prob`) and multiplied by `expert_scale`
    (DeepSeek's `routed_scaling_factor`); the router's logits with a bias where `router_bias`
    (GPT-OSS). DeepSeek-V3 picks by its scores plus a learned correction
    (`router_correction`), among the experts of the `router_groups_kept` best of
    `router_groups` groups (a group's score the sum of its two best); `shared_expert_size` > 0
    adds an MLP of that width that every token runs. 0 experts: a dense MLP.
    `expert_norms` (Gemma 4's mixture block, beside its dense MLP, which is the shared MLP
    here): the experts read their own norm of the MLP's input (`expert_norm`), the router an
    RMSNorm without weight of it times `router_scale` / sqrt(D); the shared MLP's output and
    the experts' each pass a post-norm of their own (`shared_post_norm`, `expert_post_norm`)
    before they are summed, and each chosen expert's weight is scaled by its own
    `router_expert_scale` after the renormalisation.

    Layers without positions (`nope_layers`, SmolLM3's `no_rope_layers`): their queries and
    keys are not rotated; the other layers rotate as the rotary fields say.

    Linear attention (`linear_layers`, Qwen3.5's `linear_attention` layers): those layers mix
    positions by the gated delta rule (`jaxdepth.core.linear_attention`) in place of attention,
    `linear_key_heads` heads of keys `linear_key_dim` wide serving `linear_value_heads` of values
    `linear_value_dim` wide, after a causal convolution of `linear_conv_kernel` positions; their
    weights stack over those layers only, as the attention's over the others.
    `attention_gate` (Qwen3.5's full attention): each head's output is multiplied by the sigmoid
    of a gate projected from the attention's input, before the output projection.

    Dense layers among sparse ones (`dense_layers`: DeepSeek-V3's first `first_k_dense_replace`,
    Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step`): those layers have a dense gated
    MLP of width `dense_size` instead of the mixture. The layers then come in two kinds, whose
    MLP weights are stacked over their own layers only (`jaxdepth.core.parameters.row_layers`),
    and each layer runs its own kind's MLP alone (`jaxdepth.core.layer.layer_step`).

    Gemma 4's layers. Attention of two shapes: the full-attention layers' heads are
    `global_head_dim` wide with `global_kv_heads` key/value heads (0: `head_dim`,
    `num_kv_heads`), and their values are their keys' projection where `keys_as_values`
    (before the keys' norm and rotation); where either differs from the sliding layers', the
    full-attention layers' attention weights are rows of their own (`global_q`, ...,
    `global_layers`). `value_norm`: values pass an RMSNorm without a weight. Rope type
    'proportional' (the full-attention layers'): rotate-half over each head's whole width Dh,
    the first `rotary_dim` / 2 frequencies base^(-2i / Dh) (`rope_factor` dividing them), the
    others 0 (those dims pass through); the sliding layers rotate fully at base
    `local_rope_theta`. Key/value sharing (`shared_kv_layers`): those layers compute no keys
    and values of their own but attend to those of the last layer before them of the same
    layer type that computes its own (`kv_source`); in a layer order
    (`jaxdepth.core.structure`), to those of the last such layer run before them (none: such a
    layer attends to nothing and its attention writes zeros). `wide_mlp_layers`: layers whose
    MLP is twice `intermediate_size` wide (rows `wide_gate`, `wide_up`, `wide_down`).
    Per-layer inputs (`per_layer_input_size` P > 0): each layer l receives a vector of P dims
    per token, `(norm(h_0 W / sqrt(D))[l] + E[token][l] * sqrt(P)) / sqrt(2)` (`ple_embed`
    E, the projection `ple_model_proj` W and its norm; `jaxdepth.core.model.per_layer_inputs`),
    and after its MLP adds `norm(((act(x W_gate) * per-layer input) W_proj)` of its residual
    x = h + a + m (site `per_layer_out`). `layer_scalar`: each layer's output is
    `s_l (h + a + m + e)`, one learned `s_l` per layer (the site `delta` is then
    `(s_l - 1) h + s_l (a + m + e)`, so that `resid_post` = h + `delta` still).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 1.0
    rope_original_max_position: int = 0
    rope_short_factor: tuple = ()
    rope_long_factor: tuple = ()
    rope_attention_factor: float = 1.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_interleaved: bool = False
    rotary_last: bool = False
    norm: str = "rms"
    norm_offset: float = 0.0
    norm_scale_in_float32: bool = False
    pre_norms: bool = True
    post_norms: bool = False
    parallel_residual: bool = False
    o_bias: bool = False
    qk_norm_scope: str = "head"
    attn_scale: float = 0.0
    attn_softcap: float = 0.0
    sliding_window: int = 0
    layer_types: tuple = ()
    positions: str = "rotary"
    rotary_dim: int = 0
    local_rope_theta: float = 0.0
    embed_scale: float = 1.0
    final_softcap: float = 0.0
    mlp: str = "gated"
    activation: str = "silu"
    mlp_bias: bool = False
    glu_alpha: float = 0.0
    glu_limit: float = 0.0
    attention_sinks: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    value_head_dim: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    router: str = "softmax"
    normalize_expert_weights: bool = False
    router_bias: bool = False
    router_correction: bool = False
    router_groups: int = 1
    router_groups_kept: int = 1
    expert_scale: float = 1.0
    shared_expert_size: int = 0
    expert_norms: bool = False
    dense_layers: tuple = ()
    dense_size: int = 0
    nope_layers: tuple = ()
    linear_layers: tuple = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    attention_gate: bool = False
    global_head_dim: int = 0
    global_kv_heads: int = 0
    keys_as_values: bool = False
    value_norm: bool = False
    shared_kv_layers: tuple = ()
    wide_mlp_layers: tuple = ()
    per_layer_input_size: int = 0
    layer_scalar: bool = False

    def __post_init__(self):
        lists = (
            "layer_types",
            "rope_short_factor",
            "rope_long_factor",
            "dense_layers",
            "nope_layers",
            "linear_layers",
            "shared_kv_layers",
            "wide_mlp_layers",
        )
        for name in lists:  # JSON gives lists
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedConfigError(
                f"model_type {self.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        widest = self.full_head_dim if self.rope_type == "proportional" else self.head_dim
        if self.positions == "rotary" and (self.rotated_dims % 2 or not 0 < self.rotated_dims <= widest):
            raise UnsupportedConfigError(
                f"rotary_dim={self.rotary_dim} must be even and at most the head's {widest} dims (0: all of them)"
            )
        for field, allowed in (
            ("rope_type", ROPE_TYPES),
            ("norm", NORMS),
            ("activation", ACTIVATIONS),
            ("mlp", MLPS),
            ("positions", POSITIONS),
            ("qk_norm_scope", QK_NORM_SCOPES),
            ("router", ROUTERS),
        ):
            if getattr(self, field) not in allowed:
                raise UnsupportedConfigError(f"{field} {getattr(self, field)!r} is not supported; supported: {allowed}")
        if self.layer_types and (
            len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types)
        ):
            raise UnsupportedConfigError(
                f"layer_types must name {LAYER_TYPES} for each of the {self.num_layers} layers, got {self.layer_types}"
            )
        if any(self.sliding_layers) and self.sliding_window < 1:
            raise UnsupportedConfigError("sliding layers need sliding_window >= 1")
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts and self.mlp != "plain"):
            raise UnsupportedConfigError(
                f"a mixture of {self.num_experts} experts needs 0 < experts_per_token <= num_experts (got "
                f"{self.experts_per_token}) and gated experts (mlp {self.mlp!r})"
            )
        if self.dense_layers and not (
            self.num_experts
            and self.dense_size > 0
            and _layer_indices(self.dense_layers, self.num_layers)
            and len(self.dense_layers) < self.num_layers
        ):
            raise UnsupportedConfigError(
                f"dense_layers name the dense layers of a mixture of experts, ascending and among its "
                f"{self.num_layers} layers, some left sparse, with dense_size > 0; got {self.dense_layers} (dense_size "
                f"{self.dense_size}, {self.num_experts} experts)"
            )
        if self.nope_layers and not (self.positions == "rotary" and _layer_indices(self.nope_layers, self.num_layers)):
            raise UnsupportedConfigError(
                f"nope_layers name layers of a rotary model without rotary positions, ascending and among its "
                f"{self.num_layers} layers; got {self.nope_layers} (positions {self.positions!r})"
            )
        if self.linear_layers and not (
            _layer_indices(self.linear_layers, self.num_layers)
            and min(self.linear_key_heads, self.linear_key_dim, self.linear_value_dim, self.linear_conv_kernel) > 0
            and self.linear_value_heads % self.linear_key_heads == 0
        ):
            raise UnsupportedConfigError(
                f"linear_layers name the layers of linear attention, ascending and among the {self.num_layers} layers, "
                "with its key and value heads (value heads a multiple of key heads), their widths and its "
                f"convolution's kernel > 0; got {self.linear_layers}, heads {self.linear_key_heads} / "
                f"{self.linear_value_heads}, widths {self.linear_key_dim} / {self.linear_value_dim}, kernel "
                f"{self.linear_conv_kernel}"
            )
        self._check_gemma4_features()
        if self.dense_size and not self.dense_layers:
            raise UnsupportedConfigError("dense_size is the width of dense_layers: give them, or 0")
        if not self.num_experts and (
            self.experts_per_token or self.normalize_expert_weights or self.router_bias or self.expert_norms
        ):
            raise UnsupportedConfigError(
                "experts_per_token, normalize_expert_weights, router_bias and expert_norms need experts"
            )
        if self.expert_norms and not (self.shared_expert_size and self.pre_norms and self.post_norms):
            raise UnsupportedConfigError(
                "expert_norms (Gemma 4's mixture block) need the shared MLP beside the experts and norms before and "
                "after the sublayers"
            )
        if self.is_moe and self.wide_mlp_layers:
            raise UnsupportedConfigError("double-wide MLPs beside a mixture of experts are not implemented")
        if self.router_groups > 1 and not (
            self.num_experts % self.router_groups == 0
            and self.num_experts // self.router_groups >= 2
            and 0 < self.router_groups_kept <= self.router_groups
            and self.experts_per_token <= self.router_groups_kept * self.num_experts // self.router_groups
        ):
            raise UnsupportedConfigError(
                f"{self.router_groups} router groups of {self.num_experts} experts, {self.router_groups_kept} kept, "
                f"cannot give {self.experts_per_token} experts a token (groups of at least 2 experts each)"
            )
        if self.kv_lora_rank and (self.num_kv_heads != self.num_heads or self.qkv_bias or self.qk_norm):
            raise UnsupportedConfigError(
                "latent attention has keys and values per head, and no q/k/v biases or q/k norms"
            )
        if self.mlp == "clamped" and not (self.glu_alpha > 0 and self.glu_limit > 0):
            raise UnsupportedConfigError(
                f"a clamped GLU needs glu_alpha and glu_limit > 0, got {self.glu_alpha}, {self.glu_limit}"
            )
        if self.rope_type == "yarn" and not (
            self.rope_factor > 0 and self.rope_original_max_position > 0 and self.rope_attention_factor > 0
        ):
            raise UnsupportedConfigError(
                "yarn rope scaling needs factor, original_max_position_embeddings and attention_factor > 0; got "
                f"{self.rope_factor}, {self.rope_original_max_position}, {self.rope_attention_factor}"
            )
        if not (self.pre_norms or self.post_norms):
            raise UnsupportedConfigError("a layer needs norms before or after its sublayers")
        if self.qk_norm and self.norm != "rms":
            raise UnsupportedConfigError("q/k norms are RMSNorms: norm must be 'rms'")
        if self.rope_type == "linear" and not self.rope_factor > 0:
            raise UnsupportedConfigError(f"linear rope scaling needs factor > 0, got {self.rope_factor}")
        if self.rope_type == "llama3" and not (
            self.rope_factor > 0
            and self.rope_original_max_position > 0
            and self.rope_high_freq_factor > self.rope_low_freq_factor > 0
        ):
            raise UnsupportedConfigError(
                "llama3 rope scaling needs factor > 0, original_max_position_embeddings > 0 and "
                f"high_freq_factor > low_freq_factor > 0; got {self.rope_factor}, {self.rope_original_max_position}, "
                f"{self.rope_high_freq_factor}, {self.rope_low_freq_factor}"
            )

        if self.rope_type == "longrope" and not (
            self.rope_original_max_position > 0
            and len(self.rope_short_factor) == len(self.rope_long_factor) == self.rotated_dims // 2
            and self.rope_attention_factor > 0
        ):
            raise UnsupportedConfigError(
                f"longrope scaling needs original_max_position_embeddings > 0, short and long factors of "
                f"{self.rotated_dims // 2} (half the rotated dims) each and attention_factor > 0; got "
                f"{self.rope_original_max_position}, {len(self.rope_short_factor)}, {len(self.rope_long_factor)}, "
                f"{self.rope_attention_factor}"
            )

    @property
    def rotated_dims(self) -> int:
        """Dims of each head the rotary embedding rotates (the first ones; under 'proportional',
        those of the full-attention layers' frequencies that are not 0, two per frequency)."""
        return self.rotary_dim or (self.full_head_dim if self.rope_type == "proportional" else self.head_dim)

    @property
    def full_head_dim(self) -> int:
        """Each head's width in the full-attention layers (`global_head_dim`, or `head_dim`)."""
        return self.global_head_dim or self.head_dim

    @property
    def full_kv_heads(self) -> int:
        """Key/value heads of the full-attention layers (`global_kv_heads`, or `num_kv_heads`)."""
        return self.global_kv_heads or self.num_kv_heads

    @property
    def global_layers(self) -> tuple[int, ...]:
        """The full-attention layers whose attention weights are rows of their own (`global_q`,
        ...): where their heads' width or key/value heads differ from the sliding layers', or
        their values are their keys (`keys_as_values`); () otherwise."""
        full = tuple(i for i, slides in enumerate(self.sliding_layers) if not slides and i in self.attention_layers)
        own = (self.full_head_dim, self.full_kv_heads) != (self.head_dim, self.num_kv_heads) or self.keys_as_values
        return full if own and any(self.sliding_layers) else ()

    @property
    def widest_head_dim(self) -> int:
        """The widest head of any layer: the width of the per-head sites and records (`q`, `k`,
        `v`, `head_out`), zero beyond a narrower layer's own heads."""
        return max(self.head_dim, self.full_head_dim) if self.global_layers else self.head_dim

    @property
    def head_out_shape(self) -> tuple[int, int]:
        """Site `head_out`'s shape after the batch and position axes: (heads, width). Among
        linear-attention layers it holds their value heads' outputs too (`split_heads` rows, the
        widest of the attention's and the value heads' widths); zero beyond a layer's own."""
        if self.mixed_mixers:
            return self.split_heads, max(self.v_head_dim, self.linear_value_dim)
        return self.num_heads, self.widest_head_dim if self.global_layers else self.v_head_dim

    @property
    def most_kv_heads(self) -> int:
        """The most key/value heads of any layer: the records' (`k`, `v`), zero past a layer's own."""
        return max(self.num_kv_heads, self.full_kv_heads) if self.global_layers else self.num_kv_heads

    @property
    def split_heads(self) -> int:
        """The heads of a layer split per head (`jaxdepth.core.sites`): the query heads, or, among
        linear-attention layers, the most of the query heads and the linear layers' value heads
        (each split site holds this many rows, zero beyond a layer's own heads)."""
        return max(self.num_heads, self.linear_value_heads) if self.mixed_mixers else self.num_heads

    @property
    def widest_mlp(self) -> int:
        """The widest dense MLP of any layer: the width of `mlp_hidden`, zero beyond a narrower
        layer's own hidden units."""
        return 2 * self.intermediate_size if self.wide_mlp_layers else self.dense_width

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values layer `layer` attends to: itself, or for a layer of
        `shared_kv_layers` the last layer before it of its layer type that computes its own."""
        if layer not in self.shared_kv_layers:
            return layer
        slides = self.sliding_layers
        own = [i for i in range(layer) if slides[i] == slides[layer] and i not in self.shared_kv_layers]
        if not own:
            raise UnsupportedConfigError(f"layer {layer} shares the keys and values of no earlier layer of its type")
        return own[-1]

    def _check_gemma4_features(self) -> None:
        """Refuse impossible settings of Gemma 4's features (`__post_init__`)."""
        attention = set(self.attention_layers)
        if self.shared_kv_layers:
            if not (_layer_indices(self.shared_kv_layers, self.num_layers) and set(self.shared_kv_layers) <= attention):
                raise UnsupportedConfigError(
                    f"shared_kv_layers name attention layers, ascending and among the {self.num_layers} layers; got "
                    f"{self.shared_kv_layers}"
                )
            for layer in self.shared_kv_layers:
                self.kv_source(layer)
            if self.kv_lora_rank or self.attention_sinks or self.qkv_bias:
                raise UnsupportedConfigError(
                    "shared keys and values are implemented for attention without latents, sinks or q/k/v biases"
                )
        if self.wide_mlp_layers and not (
            _layer_indices(self.wide_mlp_layers, self.num_layers) and not self.is_moe and self.mlp != "plain"
        ):
            raise UnsupportedConfigError(
                f"wide_mlp_layers name layers of a dense gated MLP, ascending and among the {self.num_layers} layers; "
                f"got {self.wide_mlp_layers}"
            )
        if self.global_layers and (self.kv_lora_rank or self.attention_sinks or self.qkv_bias or self.o_bias):
            raise UnsupportedConfigError(
                "full-attention layers of their own shapes are implemented without latents, sinks or biases"
            )
        if self.global_kv_heads and self.num_heads % self.global_kv_heads:
            raise UnsupportedConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of the full-attention layers' "
                f"{self.global_kv_heads} key/value heads"
            )
        if self.rope_type == "proportional" and (self.local_rope_theta == 0.0 and any(self.sliding_layers)):
            raise UnsupportedConfigError("'proportional' rotary needs the sliding layers' own base (local_rope_theta)")
        if self.per_layer_input_size < 0 or (self.per_layer_input_size and self.mixed_mixers):
            raise UnsupportedConfigError("per-layer inputs are implemented in models of attention layers only")

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: does it attend through the sliding window?"""
        return tuple(t == "sliding" for t in self.layer_types) or (False,) * self.num_layers

    @property
    def v_head_dim(self) -> int:
        """Each head's value width (`value_head_dim`, or `head_dim` where 0)."""
        return self.value_head_dim or self.head_dim

    @property
    def is_moe(self) -> bool:
        """Whether the layers' MLP is a mixture of experts (`num_experts` > 0)."""
        return self.num_experts > 0

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers whose mixer is attention: all of them but `linear_layers`."""
        linear = set(self.linear_layers)
        return tuple(i for i in range(self.num_layers) if i not in linear)

    @property
    def mixed_mixers(self) -> bool:
        """Whether layers of linear attention and of attention make up the model."""
        return bool(self.linear_layers)

    @property
    def dense_mlp_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is dense: every layer of a dense model, `dense_layers` of a
        mixture of experts."""
        return self.dense_layers if self.is_moe else tuple(range(self.num_layers))

    @property
    def expert_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts (none in a dense model)."""
        dense = set(self.dense_layers)
        return tuple(i for i in range(self.num_layers) if i not in dense) if self.is_moe else ()

    @property
    def dense_width(self) -> int:
        """The width of the dense MLPs: `intermediate_size` in a dense model (an expert's width
        in a mixture), `dense_size` among sparse layers."""
        return self.dense_size if self.is_moe else self.intermediate_size

    @property
    def mixed_mlps(self) -> bool:
        """Whether layers of both kinds, dense and sparse, make up the model."""
        return bool(self.is_moe and self.dense_layers)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (this class's field names, not Hugging Face's keys)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """The config `to_dict` gave (checked as any new config is); not a Hugging Face
        `config.json`: that is `from_hf`."""
        return cls(**d)

    def to_json(self) -> str:
        """`to_dict` as JSON text, keys sorted (what a converted checkpoint folder stores)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Build a config from a Hugging Face `config.json` dict, refusing what is not handled.

        Every key must be one the family's reader (`jaxdepth.core.hf_config`) reads or knows to
        be inert (generation defaults, token ids, dropout, ...); any other key, and any feature
        not reproduced (another activation or rope scaling, quantization, ...), is an
        `UnsupportedConfigError` naming it."""
        return cls(**config_fields(hf))
