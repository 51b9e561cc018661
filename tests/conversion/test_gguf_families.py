"""GGUF files of every llama.cpp architecture that transformers' GGUF loader reads and jaxdepth has a
family for, written as llama.cpp's converter writes them (`write_tiny_gguf`): jaxdepth's model of
each file is transformers' (`AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`), and a
file that transformers would read as another model than the one it states is refused, naming why.

The tiny models (`GGUF_VARIANTS`) have every feature transformers takes from its config classes
set to those defaults, so that transformers reads each file back whole: the parity tests check
jaxdepth against both transformers' model of the file and the model that was written (against the
latter alone for GPT-OSS and Gemma 4, whose files transformers cannot load: `LOADER_FAILS`).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conversion.gguf_file
from conftest import GGUF_VARIANTS, write_tiny_gguf
from conversion.gguf_file import convert_gguf
from conversion.hf import convert_hf_folder
from jaxdepth.core.config import ModelConfig, UnsupportedConfigError
from jaxdepth.core.model import forward

TOL = 1e-4  # float32 logits, as every tiny parity test (tests/core/test_parity.py)

_forward = jax.jit(forward, static_argnames="config")


def jax_logits(params, tokens, config) -> np.ndarray:
    with jax.default_matmul_precision("highest"):
        return np.asarray(_forward(jax.tree.map(jnp.asarray, params), jnp.asarray(tokens, jnp.int32), config))


def _tokens(config) -> np.ndarray:
    # 300 positions: past every tiny model's sliding window (40 in Gemma's)
    return np.random.default_rng(5).integers(0, config.vocab_size, size=(2, 300))


def _transformers_gguf_model(path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def _torch_logits(model, tokens) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


# ----------------------------------------------------------------------------- parity

# The architectures whose files transformers' GGUF loader cannot load (its error): their parity is
# checked against the model written alone (`test_transformers_cannot_load_a_gpt_oss_file`,
# `test_transformers_cannot_load_a_gemma4_file`).
LOADER_FAILS = {
    "gpt-oss": (TypeError, "only 0-dimensional arrays can be converted to Python scalars"),
    "gemma4": (RuntimeError, "You set `ignore_mismatched_sizes` to `False`"),
}


@pytest.mark.parity
@pytest.mark.parametrize("arch", sorted(GGUF_VARIANTS))
def test_gguf_matches_transformers_gguf_loader(tiny_gguf, arch):
    tiny, path = tiny_gguf(arch)
    converted = convert_gguf(path, load_tokenizer=False)
    tokens = _tokens(converted.config)
    ours = jax_logits(converted.params, tokens, converted.config)
    written = _torch_logits(tiny.model, tokens)
    if arch in LOADER_FAILS:
        theirs, against = written, "the model written (transformers' GGUF loader cannot load the file)"
    else:
        theirs, against = _torch_logits(_transformers_gguf_model(path), tokens), "transformers' GGUF loader"
    diff, diff_written = (float(np.abs(ours - x).max()) for x in (theirs, written))
    scale = float(np.abs(theirs).max())
    print(
        f"\n[parity] {arch} GGUF, T=300: max |logit diff| vs {against} = {diff:.3e}, "
        f"vs the model written = {diff_written:.3e} (logit scale {scale:.2f})"
    )
    assert ours.shape == theirs.shape == (2, 300, converted.config.vocab_size)
    assert diff <= TOL and diff <= TOL * scale
    np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))
    assert diff_written <= TOL, "transformers' model of the file is not the model written: the test model is wrong"


@pytest.mark.parity
def test_transformers_cannot_load_a_gpt_oss_file(tiny_gguf, monkeypatch):
    """transformers 5.24's GGUF loader fails on every GPT-OSS file llama.cpp writes: reading the
    rope scaling (`gpt-oss.rope.scaling.*`, which llama.cpp always writes for GPT-OSS) it takes
    `parts[0]` of gguf's field, the key's length, for the value, and `float()` of that array
    raises. With the values read instead, its config is jaxdepth's (its rope settings hold
    llama.cpp's `yarn_beta_*` under names its YaRN does not read: inert), but its model leaves the
    experts and the attention sinks of every layer unloaded, randomly initialised: its name map
    has no name for the fused `gate_up_proj` nor the biases, and names `down_proj` and `sinks`
    without the '.weight' llama.cpp writes; its `GptOssTensorProcessor` is registered under
    'gpt_oss', which is not the architecture a file states ('gpt-oss'). Should transformers learn
    to load such a file, `LOADER_FAILS` should lose it and the parity test compare with it."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    _, path = tiny_gguf("gpt-oss")
    error, message = LOADER_FAILS["gpt-oss"]
    with pytest.raises(error, match=message):
        _transformers_gguf_model(path)

    class ValuesRead(gguf.GGUFReader):
        """gguf's reader whose rope scaling fields give their value where the loader reads parts[0]."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for key, field in list(self.fields.items()):
                if key.startswith("gpt-oss.rope.scaling."):
                    value = field.contents()
                    value = value.encode() if isinstance(value, str) else value
                    self.fields[key] = field._replace(parts=[value, *field.parts[1:]])

    monkeypatch.setattr(gguf, "GGUFReader", ValuesRead)
    folder, name = os.path.split(path)
    theirs = AutoConfig.from_pretrained(folder, gguf_file=name).to_dict()
    assert {k for k in theirs["rope_parameters"] if k.startswith("yarn_")} == {"yarn_beta_fast", "yarn_beta_slow"}
    theirs["rope_parameters"] = {k: v for k, v in theirs["rope_parameters"].items() if not k.startswith("yarn_")}
    assert ModelConfig.from_hf(theirs) == convert_gguf(path, load_tokenizer=False).config
    _, info = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, output_loading_info=True
    )
    unloaded = ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj")
    unloaded += ("mlp.experts.down_proj_bias", "self_attn.sinks")
    assert set(info["missing_keys"]) == {
        f"model.layers.{i}.{t}" for i in range(theirs["num_hidden_layers"]) for t in unloaded
    }


@pytest.mark.parity
def test_transformers_cannot_load_a_gemma4_file(tiny_gguf):
    """transformers 5.24's GGUF loader fails on a Gemma 4 file of any vocabulary but Gemma 4's own:
    it builds the per-layer embeddings Gemma4TextConfig's 262144 tokens tall, whatever the file
    says. Told to ignore that, its config is jaxdepth's (the per-layer embeddings one row per token
    of the file's vocabulary), but its model leaves every layer's scalar unloaded, as it would in
    any Gemma 4 file: its name map names `layer_scalar` without the '.weight' llama.cpp writes.
    Should transformers learn to load such a file, `LOADER_FAILS` should lose it and the parity
    test compare with it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tiny, path = tiny_gguf("gemma4")
    error, message = LOADER_FAILS["gemma4"]
    with pytest.raises(error, match=message):
        _transformers_gguf_model(path)
    folder, name = os.path.split(path)
    theirs = AutoConfig.from_pretrained(folder, gguf_file=name).to_dict()
    assert theirs["vocab_size_per_layer_input"] == 262144 != theirs["vocab_size"]
    theirs["vocab_size_per_layer_input"] = theirs["vocab_size"]
    assert ModelConfig.from_hf(theirs) == convert_gguf(path, load_tokenizer=False).config
    model, info = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, output_loading_info=True, ignore_mismatched_sizes=True
    )
    layers = range(theirs["num_hidden_layers"])
    assert set(info["missing_keys"]) == {f"model.layers.{i}.layer_scalar" for i in layers}
    assert {key for key, *_ in info["mismatched_keys"]} == {"model.embed_tokens_per_layer.weight"}
    assert {float(layer.layer_scalar) for layer in model.model.layers} == {1.0}  # initialised, not read
    assert {float(layer.layer_scalar) for layer in tiny.model.model.layers} != {1.0}  # the file's


@pytest.mark.parametrize("arch", sorted(GGUF_VARIANTS))
def test_gguf_conversion_equals_the_hf_folder_conversion(tiny_gguf, arch):
    """The same params and config as the Hugging Face folder of the model written, but for the
    epsilon (float32 in a GGUF file) and Mistral, which a GGUF file holds as a Llama model; Gemma's
    norm weights round-trip through 1 + w, so it is 1 + w that is identical."""
    tiny, path = tiny_gguf(arch)
    g, h = convert_gguf(path, load_tokenizer=False), convert_hf_folder(tiny.folder)
    assert g.config.model_type == ("llama" if arch == "mistral" else h.config.model_type)
    assert g.config.rms_norm_eps == pytest.approx(h.config.rms_norm_eps, rel=1e-6)
    fields = lambda c: {**c.to_dict(), "model_type": None, "rms_norm_eps": None}  # noqa: E731
    assert fields(g.config) == fields(h.config)
    assert jax.tree.structure(g.params) == jax.tree.structure(h.params)
    for (where, x), y in zip(jax.tree_util.tree_flatten_with_path(g.params)[0], jax.tree.leaves(h.params)):
        offset = np.float32(g.config.norm_offset) if "norm'" in jax.tree_util.keystr(where) else np.float32(0)
        np.testing.assert_array_equal(offset + x, offset + y, err_msg=jax.tree_util.keystr(where))


# What each architecture's reading must get right and the file does not say, switched off: the
# settings transformers takes from its config classes (Gemma's query_pre_attn_scalar 256, Gemma 2's
# logit soft-cap 30, Gemma 3's local rotary base 10000 and layer pattern, GPT-OSS's alternating
# layers and, its rope scaling replaced by the file's, YaRN's truncated correction range) or its
# GGUF loader supplies (Qwen3-MoE's renormalised experts), and the changes
# llama.cpp made to the tensors (`fix`: Llama's q/k rows, Gemma's norms stored as 1 + w).
SWITCHED_OFF = [
    ("gemma2", dict(attn_scale=0.0)),
    ("gemma2", dict(final_softcap=0.0)),
    ("gemma3", dict(attn_scale=0.0)),
    ("gemma3", dict(local_rope_theta=0.0)),
    ("gemma3", dict(layer_types=("sliding",) * 6)),
    ("qwen3moe", dict(normalize_expert_weights=False)),
    ("gpt-oss", dict(layer_types=("full",) * 3)),
    ("gpt-oss", dict(rope_truncate=False)),
    ("llama", "fix"),
    ("gemma2", "fix"),
    ("gemma3", "fix"),
]


@pytest.mark.parametrize("arch, off", SWITCHED_OFF, ids=lambda x: x if isinstance(x, str) else "-".join(x))
def test_switching_off_what_the_file_does_not_say_breaks_parity(tiny_gguf, arch, off):
    _, path = tiny_gguf(arch)
    converted = convert_gguf(path, load_tokenizer=False)
    tokens = _tokens(converted.config)
    clean = jax_logits(converted.params, tokens, converted.config)
    if off == "fix":
        with pytest.MonkeyPatch.context() as patch:
            spec = conversion.gguf_file._ARCHS[arch]
            patch.setitem(conversion.gguf_file._ARCHS, arch, dataclasses.replace(spec, fix=None))
            unfixed = convert_gguf(path, load_tokenizer=False)
        moved = jax_logits(unfixed.params, tokens, converted.config)
    else:
        moved = jax_logits(converted.params, tokens, dataclasses.replace(converted.config, **off))
    diff = float(np.abs(moved - clean).max())
    print(f"\n[parity] {arch} GGUF with {off} switched off: max |logit diff| = {diff:.3e}")
    assert diff > 100 * TOL


@pytest.mark.parametrize("arch", sorted(conversion.gguf_file._ARCHS))
def test_the_keys_read_are_those_transformers_reads(arch):
    """Each architecture's table reads exactly the metadata keys transformers' GGUF loader reads,
    under the same Hugging Face names; the keys it renames to nothing are among those checked
    against the model it builds (`unread`), as is GPT-2's MLP width, which it renames to a key that
    GPT2Config does not have. The settings transformers' loader supplies for the architecture
    (Qwen3-MoE's renormalised experts) are among the defaults."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    spec = conversion.gguf_file._ARCHS[arch]
    # transformers looks the keys up under its own name of the architecture
    theirs_name = {"qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}.get(arch, arch)
    theirs = GGUF_CONFIG_MAPPING[theirs_name]
    unused = {("gpt2", "feed_forward_length")}
    assert spec.keys == {k: v for k, v in theirs.items() if v is not None and (arch, k) not in unused}
    assert {k for k, v in theirs.items() if v is None or (arch, k) in unused} <= set(spec.unread)
    assert GGUF_CONFIG_DEFAULTS_MAPPING.get(theirs_name, {}).items() <= spec.defaults.items()


# ----------------------------------------------------------------------------- refused


@pytest.mark.parametrize("arch", ["gptneox", "bloom", "falcon", "olmo2", "gemma", "mistral3"])
def test_an_architecture_transformers_does_not_read_or_jaxdepth_has_no_family_for_is_refused(tiny_gguf, tmp_path, arch):
    tiny, _ = tiny_gguf("llama")
    path = write_tiny_gguf(tiny, str(tmp_path / "other.gguf"), arch=arch)
    with pytest.raises(UnsupportedConfigError, match=rf"'general.architecture' = '{arch}'.*llama, qwen2, qwen3"):
        convert_gguf(path, load_tokenizer=False)


@pytest.mark.parity
def test_a_llama_file_named_mistral_is_refused(tiny_gguf, tmp_path):
    """transformers reads a 'llama' file whose `general.name` is exactly 'mistral' as Mistral (with
    MistralConfig's 4096-token window, which the file does not state) and then fails to load its
    weights. Should transformers learn to load it, jaxdepth should read it as transformers does."""
    tiny, _ = tiny_gguf("mistral")
    path = write_tiny_gguf(tiny, str(tmp_path / "mistral.gguf"), name="mistral")
    with pytest.raises(UnsupportedConfigError, match="'general.name' = 'mistral'"):
        convert_gguf(path, load_tokenizer=False)
    with pytest.raises(NotImplementedError, match="mistral"):
        _transformers_gguf_model(path)


# Features the file states and transformers does not read, at values other than those it builds
# the model with (the key named first in the file is the one refused).
@pytest.mark.parity
def test_a_llama_file_without_its_kv_head_count_is_refused(tiny_model, tmp_path):
    """Without `llama.attention.head_count_kv` transformers does not undo llama.cpp's permutation
    of the q/k rows: its model of a file with as many key/value heads as query heads (the count it
    then assumes) is not the model written."""
    tiny = tiny_model("llama_mha_tied")
    extra = lambda w: w.kv_data[0].pop("llama.attention.head_count_kv")  # noqa: E731
    path = write_tiny_gguf(tiny, str(tmp_path / "no_kv_heads.gguf"), extra=extra)
    with pytest.raises(UnsupportedConfigError, match="head_count_kv"):
        convert_gguf(path, load_tokenizer=False)
    tokens = np.arange(40)[None]
    assert np.abs(_torch_logits(_transformers_gguf_model(path), tokens) - _torch_logits(tiny.model, tokens)).max() > 1


# A `GGUF_VARIANTS` model with `extra` metadata, or a `TINY_VARIANTS` one (its features away from
# transformers' defaults: Gemma 2's soft-caps 3 and 5, Gemma 3's linear rope scaling, Qwen3's
# head_dim 24, GPT-OSS's YaRN beta_fast 8).
REFUSED = [
    ("gemma2_softcapped", None, "gemma2.attn_logit_softcapping"),  # 3, where transformers uses 50
    ("gemma3_local_rope", None, "gemma3.rope.scaling.type"),  # linear on the global layers
    ("gemma3", lambda w: w.add_rope_freq_base_swa(999.0), "gemma3.rope.freq_base_swa"),
    ("gemma3", lambda w: w.add_final_logit_softcapping(30.0), "gemma3.final_logit_softcapping"),
    ("phi3", lambda w: w.add_sliding_window(2047), "phi3.attention.sliding_window"),
    ("phi3", lambda w: w.add_rope_dimension_count(8), "phi3.rope.dimension_count"),
    ("qwen3_gqa", None, "qwen3.attention.key_length"),  # 24, where transformers uses 128
    ("qwen3moe", lambda w: w.add_expert_weights_norm(False), "qwen3moe.expert_weights_norm"),
    ("qwen3moe", lambda w: w.add_expert_shared_count(1), "qwen3moe.expert_shared_count"),  # read by neither
    ("gpt_oss_sinks", None, "gpt-oss.rope.scaling.yarn_beta_fast"),  # 8, where transformers' YaRN uses 32
    ("gpt-oss", lambda w: w.add_sliding_window(4096), "gpt-oss.attention.sliding_window"),  # 128 in transformers
    ("gpt-oss", lambda w: w.add_expert_feed_forward_length(256), "gpt-oss.expert_feed_forward_length"),
    # a rope scaling without its type, which transformers then does not read
    ("gpt-oss", lambda w: w.kv_data[0].pop("gpt-oss.rope.scaling.type"), "gpt-oss.rope.scaling.factor"),
    # Gemma 4's: shared keys and values, a soft-cap, no per-layer inputs, another layer pattern,
    # rotary base or sliding head width, than Gemma4TextConfig's; its per-layer lists (double-wide
    # MLPs, the full layers' own key/value heads); `gemma4_shared_kv` has them all
    ("gemma4", lambda w: w.add_shared_kv_layers(2), "gemma4.attention.shared_kv_layers"),
    ("gemma4", lambda w: w.add_final_logit_softcapping(30.0), "gemma4.final_logit_softcapping"),
    ("gemma4", lambda w: w.add_embedding_length_per_layer_input(0), "gemma4.embedding_length_per_layer_input"),
    ("gemma4", lambda w: w.add_sliding_window_pattern([True, False] * 3), "gemma4.attention.sliding_window_pattern"),
    ("gemma4", lambda w: w.add_rope_freq_base(12345.0), "gemma4.rope.freq_base"),
    ("gemma4", lambda w: w.add_key_length_swa(128), "gemma4.attention.key_length_swa"),
    ("gemma4", lambda w: w.add_feed_forward_length([128] * 3 + [256] * 3), "gemma4.feed_forward_length"),
    ("gemma4", lambda w: w.add_head_count_kv([1] * 5 + [2]), "gemma4.attention.head_count_kv"),
    ("gemma4_shared_kv", None, "gemma4.feed_forward_length"),
    ("gemma4", lambda w: w.add_expert_count(8), "gemma4.expert_count"),  # its experts: read by neither
    ("gpt2", lambda w: w.add_feed_forward_length(100), "gpt2.feed_forward_length"),
    ("llama", lambda w: w.add_expert_count(8), "llama.expert_count"),  # read by neither
]


@pytest.mark.parametrize("source, extra, key", REFUSED, ids=[r[2] for r in REFUSED])
def test_a_key_transformers_would_misread_is_refused(tiny_gguf, tiny_model, tmp_path, source, extra, key):
    model = tiny_gguf(source)[0] if source in GGUF_VARIANTS else tiny_model(source)
    path = write_tiny_gguf(model, str(tmp_path / "refused.gguf"), extra=extra)
    with pytest.raises(UnsupportedConfigError, match=key.replace(".", r"\.")):
        convert_gguf(path, load_tokenizer=False)


@pytest.mark.parity
def test_a_qwen3moe_file_of_another_expert_width_is_refused(tmp_path):
    """transformers does not read `expert_feed_forward_length` and builds experts 768 wide
    (Qwen3MoeConfig's), which Qwen3-235B-A22B's 1536 and this model's 48 are not: it then fails to
    load the file's experts. jaxdepth refuses the file, naming the key."""
    from conftest import TINY_VARIANTS, build_tiny_model

    base, changes, _ = GGUF_VARIANTS["qwen3moe"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(TINY_VARIANTS, "qwen3moe_narrow", {**TINY_VARIANTS[base], **changes, "moe_intermediate_size": 48})
        model = build_tiny_model("qwen3moe_narrow")
    path = write_tiny_gguf(model, str(tmp_path / "narrow.gguf"))
    refused = r"qwen3moe\.expert_feed_forward_length' = 48.*intermediate_size = 768"
    with pytest.raises(UnsupportedConfigError, match=refused):
        convert_gguf(path, load_tokenizer=False)
    with pytest.raises(RuntimeError, match="mismatched_sizes"):
        _transformers_gguf_model(path)


@pytest.mark.parametrize("tensor", ["rope_freqs.weight", "rope_factors_long.weight"])
def test_a_tensor_transformers_drops_is_refused(tiny_gguf, tmp_path, tensor):
    """Llama 3's rope scaling frequencies and Phi-3's long-context factors: transformers' model of
    the file has no place for them."""
    tiny, _ = tiny_gguf("llama")
    extra = lambda w: w.add_tensor(tensor, np.ones(8, np.float32))  # noqa: E731
    path = write_tiny_gguf(tiny, str(tmp_path / "dropped.gguf"), extra=extra)
    with pytest.raises(UnsupportedConfigError, match=tensor):
        convert_gguf(path, load_tokenizer=False)


@pytest.mark.parametrize("factors", ["other", "missing"])
def test_a_gemma4_file_rotating_otherwise_than_transformers_is_refused(tiny_gguf, tmp_path, monkeypatch, factors):
    """llama.cpp's `rope_freqs.weight` says which of the full-attention layers' frequencies rotate
    (a quarter of them in Gemma 4's 'proportional' rotary); transformers does not read it and
    rotates those Gemma4TextConfig says. Factors of another share (a half), or none, are refused."""
    import conftest

    tiny, _ = tiny_gguf("gemma4")
    freqs = conftest._gemma4_rope_freqs(tiny.config)
    half = np.where(np.arange(freqs.size) < freqs.size // 2, np.float32(1), freqs)
    original = conftest._llama_cpp_tensors

    def tensors(model, arch):
        for name, w in original(model, arch):
            if name != "rope_freqs.weight":
                yield name, w
            elif factors == "other":
                yield name, half

    monkeypatch.setattr(conftest, "_llama_cpp_tensors", tensors)
    path = write_tiny_gguf(tiny, str(tmp_path / "rotating.gguf"))
    with pytest.raises(UnsupportedConfigError, match="'rope_freqs.weight'.*rotates 16 of those layers' 64 dims"):
        convert_gguf(path, load_tokenizer=False)


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_jaxdepth_load_reads_a_gguf_file_of_the_architecture(tiny_gguf, tmp_path, monkeypatch, arch):
    """`jaxdepth.load` of the file (converted once into the cache, with its sentencepiece
    tokenizer): the params and config of `convert_gguf`, the logits of transformers' model."""
    import jaxdepth

    monkeypatch.setenv("JAXDEPTH_CACHE", str(tmp_path / "cache"))
    tiny, _ = tiny_gguf(arch)
    path = write_tiny_gguf(tiny, str(tmp_path / f"{arch}.gguf"), tokenizer="sentencepiece")
    model, converted = jaxdepth.load(path), convert_gguf(path, load_tokenizer=False)
    assert model.config == converted.config
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, model.params), converted.params)
    from transformers import AutoTokenizer

    folder, name = os.path.split(path)
    assert (
        model.encode(" the cat sat").tolist()
        == AutoTokenizer.from_pretrained(folder, gguf_file=name)(" the cat sat")["input_ids"]
    )
    tokens = _tokens(model.config)[:1, :64]
    theirs = _torch_logits(_transformers_gguf_model(path), tokens)
    np.testing.assert_allclose(model.logits(tokens), theirs, rtol=0, atol=TOL)
