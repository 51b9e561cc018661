"""Checkpoint conversion: HF folders (single / sharded safetensors), GGUF, orbax round trips,
`jaxdepth.load` on every source kind, and clear errors on bad input.

Torch is needed only to build the tiny HF models (the `tiny_model` fixture skips without it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

import jaxdepth
from conversion.checkpoint import is_converted_dir, restore_converted, save_converted
from conversion.errors import ConversionError
from conversion.gguf_file import convert_gguf
from conversion.hf import convert_hf_folder
from jaxdepth.core.config import UnsupportedConfigError
from conftest import FAMILY_VARIANTS, write_tiny_gguf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- helpers


def assert_params_identical(a, b):
    """Same tree, same dtypes, bit-identical values."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        where = jax.tree_util.keystr(path)
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype, f"{where}: dtype {x.dtype} != {y.dtype}"
        assert x.shape == y.shape, f"{where}: shape {x.shape} != {y.shape}"
        assert x.tobytes() == y.tobytes(), f"{where}: values differ"


def copy_folder(tiny, tmp_path, name="model") -> str:
    dst = os.path.join(tmp_path, name)
    shutil.copytree(tiny.folder, dst)
    return dst


def edit_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


def rewrite_safetensors(path, edit):
    from safetensors.numpy import load_file, save_file

    tensors = dict(load_file(path))
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# ----------------------------------------------------------------------------- imports


@pytest.mark.parametrize("module", ["conversion", "conversion.hf", "conversion.gguf_file"])
def test_conversion_package_imports_on_its_own(module):
    """`import conversion...` in a fresh interpreter, before anything imported jaxdepth."""
    proc = subprocess.run(
        [sys.executable, "-c", f"import {module}"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


# ----------------------------------------------------------------------------- HF folders


@pytest.mark.parametrize("variant", ["qwen2_gqa_untied", "qwen2_gqa_tied", "llama_gqa_untied"])
def test_hf_conversion_layout(tiny_model, variant):
    """Every param is the HF tensor, transposed to [in, out] and stacked over layers."""
    tiny = tiny_model(variant)
    c = convert_hf_folder(tiny.folder)
    sd = {k: v.detach().numpy() for k, v in tiny.model.state_dict().items()}
    L = tiny.config.num_hidden_layers
    np.testing.assert_array_equal(c.params["embed"], sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(c.params["final_norm"], sd["model.norm.weight"])
    if tiny.config.tie_word_embeddings:
        assert "lm_head" not in c.params
    else:
        np.testing.assert_array_equal(c.params["lm_head"], sd["lm_head.weight"].T)
    hf = {
        "q": "self_attn.q_proj.weight",
        "k": "self_attn.k_proj.weight",
        "v": "self_attn.v_proj.weight",
        "o": "self_attn.o_proj.weight",
        "gate": "mlp.gate_proj.weight",
        "up": "mlp.up_proj.weight",
        "down": "mlp.down_proj.weight",
        "attn_norm": "input_layernorm.weight",
        "mlp_norm": "post_attention_layernorm.weight",
    }
    if c.config.qkv_bias:
        hf.update(q_bias="self_attn.q_proj.bias", k_bias="self_attn.k_proj.bias", v_bias="self_attn.v_proj.bias")
    assert set(c.params["layers"]) == set(hf)
    for key, name in hf.items():
        stacked = np.stack([sd[f"model.layers.{i}.{name}"] for i in range(L)])
        if stacked.ndim == 3:
            stacked = stacked.transpose(0, 2, 1)
        np.testing.assert_array_equal(c.params["layers"][key], stacked, err_msg=key)
    assert c.tokenizer is None
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(c.params))


def test_sharded_checkpoint_equals_unsharded(tiny_model, tmp_path):
    tiny = tiny_model("qwen2_gqa_untied")
    sharded = str(tmp_path / "sharded")
    tiny.model.save_pretrained(sharded, max_shard_size="50KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert not os.path.exists(os.path.join(sharded, "model.safetensors"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    a, b = convert_hf_folder(sharded), convert_hf_folder(tiny.folder)
    assert_params_identical(a.params, b.params)
    assert a.config == b.config


def test_bfloat16_conversion(tiny_model):
    tiny = tiny_model("qwen2_gqa_tied")
    c = convert_hf_folder(tiny.folder, dtype=ml_dtypes.bfloat16)
    f32 = convert_hf_folder(tiny.folder)
    for x, y in zip(jax.tree.leaves(c.params), jax.tree.leaves(f32.params)):
        assert x.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(x, y.astype(ml_dtypes.bfloat16))


# ----------------------------------------------------------------------------- orbax


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
def test_orbax_round_trip_is_bit_identical(tiny_model, tmp_path, dtype):
    tiny = tiny_model("qwen2_gqa_untied")
    c = convert_hf_folder(tiny.folder, dtype=dtype)
    out = save_converted(c, str(tmp_path / "converted"))
    assert os.path.isabs(out) and is_converted_dir(out)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")], "temporary folder left behind"
    back = restore_converted(out)
    assert_params_identical(back.params, c.params)
    assert back.config == c.config
    assert back.source == c.source
    assert back.tokenizer is None


def test_save_converted_refuses_to_overwrite(tiny_model, tmp_path):
    c = convert_hf_folder(tiny_model("llama_mha_tied").folder)
    out = save_converted(c, str(tmp_path / "converted"))
    with pytest.raises(FileExistsError, match="already exists"):
        save_converted(c, out)
    other = convert_hf_folder(tiny_model("llama_gqa_untied").folder)
    save_converted(other, out, overwrite=True)
    assert restore_converted(out).config == other.config


def test_restore_rejects_a_folder_that_is_not_converted(tiny_model):
    with pytest.raises(ConversionError, match="not a converted"):
        restore_converted(tiny_model("llama_mha_tied").folder)


# ----------------------------------------------------------------------------- GGUF


@pytest.mark.parametrize("variant", ["llama_gqa_untied", "llama_mha_tied"])
def test_gguf_conversion_undoes_llama_cpp_permutation(tiny_model, tmp_path, variant):
    tiny = tiny_model(variant)
    path = write_tiny_gguf(tiny, str(tmp_path / "tiny.gguf"))
    g = convert_gguf(path, load_tokenizer=False)
    h = convert_hf_folder(tiny.folder)
    assert_params_identical(g.params, h.params)
    # GGUF stores the epsilon as float32; everything else is identical.
    assert g.config.rms_norm_eps == pytest.approx(h.config.rms_norm_eps, rel=1e-6)
    assert g.config == jaxdepth.ModelConfig.from_dict({**h.config.to_dict(), "rms_norm_eps": g.config.rms_norm_eps})


def test_gguf_bad_input(tiny_model, tmp_path):
    import gguf

    tiny = tiny_model("llama_gqa_untied")
    scaled = write_tiny_gguf(
        tiny, str(tmp_path / "scaled.gguf"), extra=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    )
    with pytest.raises(UnsupportedConfigError, match="llama.rope.scaling.type"):
        convert_gguf(scaled, load_tokenizer=False)
    other_arch = write_tiny_gguf(tiny, str(tmp_path / "other.gguf"), arch="gptneox")
    with pytest.raises(UnsupportedConfigError, match="general.architecture.*gptneox"):
        convert_gguf(other_arch, load_tokenizer=False)
    truncated = write_tiny_gguf(tiny, str(tmp_path / "truncated.gguf"))
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) // 2)
    with pytest.raises(ConversionError, match="truncated.gguf"):
        convert_gguf(truncated, load_tokenizer=False)
    with pytest.raises(ConversionError, match="missing.gguf"):
        jaxdepth.load(str(tmp_path / "missing.gguf"))


def test_load_every_source_kind_agrees(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDEPTH_CACHE", str(tmp_path / "cache"))
    tiny = tiny_model("llama_gqa_untied")
    converted_dir = save_converted(convert_hf_folder(tiny.folder), str(tmp_path / "converted"))
    gguf_path = write_tiny_gguf(tiny, str(tmp_path / "tiny.gguf"))

    from_hf = jaxdepth.load(tiny.folder)
    from_converted = jaxdepth.load(converted_dir)
    from_gguf = jaxdepth.load(gguf_path)
    cached = [d for d in os.listdir(tmp_path / "cache") if is_converted_dir(str(tmp_path / "cache" / d))]
    assert len(cached) == 1, "the GGUF conversion was not cached"
    from_gguf_again = jaxdepth.load(gguf_path)

    assert from_hf.tokenizer is None and from_converted.tokenizer is None
    assert from_gguf.tokenizer is not None and from_gguf_again.tokenizer is not None
    assert from_gguf.encode("the cat").tolist() == from_gguf_again.encode("the cat").tolist()
    for m in (from_converted, from_gguf, from_gguf_again):
        assert_params_identical(m.params, from_hf.params)
    assert from_converted.config == from_hf.config
    tokens = np.random.default_rng(0).integers(0, 300, size=(2, 40))
    ref = from_hf.logits(tokens)
    assert ref.shape == (2, 40, 300) and ref.dtype == np.float32
    for m in (from_converted, from_gguf):
        np.testing.assert_array_equal(m.logits(tokens), ref)


@pytest.mark.parametrize("variant", sorted(FAMILY_VARIANTS))
def test_every_family_loads_from_its_folder_and_from_a_converted_checkpoint(tiny_model, tmp_path, variant):
    """`jaxdepth.load` on a Hugging Face folder of each family; the converted checkpoint holds the
    family's config (every feature field) and params, and gives the same logits."""
    tiny = tiny_model(variant)
    from_hf = jaxdepth.load(tiny.folder)
    from_converted = jaxdepth.load(save_converted(convert_hf_folder(tiny.folder), str(tmp_path / "converted")))
    assert from_converted.config == from_hf.config and from_hf.config.model_type == tiny.config.model_type
    assert_params_identical(from_converted.params, from_hf.params)
    tokens = np.random.default_rng(0).integers(0, 300, size=(2, 40))
    np.testing.assert_array_equal(from_converted.logits(tokens), from_hf.logits(tokens))


def test_model_logits_checks_its_input(tiny_model):
    model = jaxdepth.load(tiny_model("qwen2_mha_untied").folder)
    ctx = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="context"):
        model.logits(np.zeros((1, ctx + 1), np.int32))
    with pytest.raises(ValueError, match=r"\[0, 300\)"):
        model.logits(np.array([[1, 2, 300]]))
    with pytest.raises(ValueError, match="token_ids"):
        model.logits(np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="token_ids"):
        model.logits(np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="no tokenizer"):
        model.encode("hello")


# ----------------------------------------------------------------------------- bad input


def test_missing_folder(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ConversionError, match="not a folder"):
        convert_hf_folder(missing)
    with pytest.raises(ConversionError, match="does/not/exist"):
        jaxdepth.load("./does/not/exist")
    with pytest.raises(ConversionError, match="nope"):
        jaxdepth.load(missing)


def test_missing_files(tiny_model, tmp_path):
    tiny = tiny_model("qwen2_gqa_tied")
    no_config = copy_folder(tiny, tmp_path, "no_config")
    os.remove(os.path.join(no_config, "config.json"))
    with pytest.raises(ConversionError, match="config.json"):
        convert_hf_folder(no_config)
    no_weights = copy_folder(tiny, tmp_path, "no_weights")
    os.remove(os.path.join(no_weights, "model.safetensors"))
    with pytest.raises(ConversionError, match="model.safetensors"):
        convert_hf_folder(no_weights)
    with pytest.raises(ConversionError, match="GGUF file not found"):
        convert_gguf(str(tmp_path / "missing.gguf"))


def test_missing_shard(tiny_model, tmp_path):
    sharded = str(tmp_path / "sharded")
    tiny_model("qwen2_gqa_untied").model.save_pretrained(sharded, max_shard_size="50KB")
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(os.path.join(sharded, shard))
    with pytest.raises(ConversionError, match=f"not found.*{shard}"):
        convert_hf_folder(sharded)


def _corrupt(tiny, tmp_path, name, damage):
    folder = copy_folder(tiny, tmp_path, name)
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as f:
        damage(f, os.path.getsize(path))
    return folder


@pytest.mark.parametrize("damage", ["truncated", "truncated_in_header", "header_length", "header_json"])
def test_corrupt_safetensors(tiny_model, tmp_path, damage):
    def truncated(f, size):
        f.truncate(size // 2)

    def truncated_in_header(f, size):
        f.truncate(4)

    def header_length(f, size):
        f.write(b"\xff" * 8)

    def header_json(f, size):
        f.seek(8)
        f.write(b"\x00garbage\xfe\xff{{" * 4)

    damages = dict(
        truncated=truncated,
        truncated_in_header=truncated_in_header,
        header_length=header_length,
        header_json=header_json,
    )
    folder = _corrupt(tiny_model("qwen2_gqa_tied"), tmp_path, damage, damages[damage])
    with pytest.raises(ConversionError, match="corrupt") as info:
        convert_hf_folder(folder)
    assert "model.safetensors" in str(info.value)


def test_unsupported_architecture(tiny_model, tmp_path):
    folder = copy_folder(tiny_model("qwen2_gqa_tied"), tmp_path)
    edit_config(folder, model_type="mamba")
    with pytest.raises(UnsupportedConfigError, match="model_type") as info:
        convert_hf_folder(folder)
    assert "mamba" in str(info.value) and "gemma2" in str(info.value)  # it names the supported ones


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 12345.0, "factor": 4.0}}, "rope_parameters"),
        ({"foo_bar": 1}, "foo_bar"),
        (
            {
                "use_sliding_window": True,
                "sliding_window": None,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            "sliding",
        ),
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ],
    ids=["rope_scaling", "rope_parameters_yarn", "unknown_key", "sliding_window", "hidden_act", "layer_types"],
)
def test_unhandled_config_is_refused(tiny_model, tmp_path, changes, named):
    folder = copy_folder(tiny_model("qwen2_gqa_tied"), tmp_path)
    edit_config(folder, **changes)
    with pytest.raises(UnsupportedConfigError, match=named):
        convert_hf_folder(folder)


def test_inactive_sliding_window_is_accepted(tiny_model, tmp_path):
    """Qwen2.5 checkpoints set sliding_window but use_sliding_window false: plain attention."""
    tiny = tiny_model("qwen2_gqa_tied")
    folder = copy_folder(tiny, tmp_path)
    edit_config(folder, use_sliding_window=False, sliding_window=16)
    assert_params_identical(convert_hf_folder(folder).params, convert_hf_folder(tiny.folder).params)


def test_extra_tensor_is_refused(tiny_model, tmp_path):
    folder = copy_folder(tiny_model("qwen2_gqa_tied"), tmp_path)
    rewrite_safetensors(
        os.path.join(folder, "model.safetensors"),
        lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}),
    )
    with pytest.raises(ConversionError, match="not used.*o_proj.bias"):
        convert_hf_folder(folder)


def test_missing_tensor_is_refused(tiny_model, tmp_path):
    folder = copy_folder(tiny_model("qwen2_gqa_tied"), tmp_path)
    rewrite_safetensors(os.path.join(folder, "model.safetensors"), lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ConversionError, match="model.layers.1.mlp.up_proj.weight"):
        convert_hf_folder(folder)


def test_mis_shaped_tensor_is_refused(tiny_model, tmp_path):
    folder = copy_folder(tiny_model("qwen2_gqa_tied"), tmp_path)
    edit_config(folder, intermediate_size=96)
    with pytest.raises(ConversionError, match="shape"):
        convert_hf_folder(folder)


def test_tied_config_with_a_different_lm_head_is_refused(tiny_model, tmp_path):
    folder = copy_folder(tiny_model("qwen2_gqa_tied"), tmp_path)

    def add_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1.0

    rewrite_safetensors(os.path.join(folder, "model.safetensors"), add_head)
    with pytest.raises(ConversionError, match="tie_word_embeddings"):
        convert_hf_folder(folder)


def test_unreachable_hub_id(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time
    with pytest.raises(ConversionError, match="nonexistent-org/nonexistent-model"):
        jaxdepth.load("nonexistent-org/nonexistent-model")


def test_a_gguf_conversion_under_way_in_another_process_is_waited_for_not_repeated(tiny_model, tmp_path, monkeypatch):
    """While another process converts a GGUF file (it holds the conversion's lock), a second load
    waits, then finds the model converted and does not convert it again."""
    import threading

    import filelock

    import conversion.gguf_file
    from jaxdepth.lab import sources

    monkeypatch.setenv("JAXDEPTH_CACHE", str(tmp_path / "cache"))
    gguf_path = write_tiny_gguf(tiny_model("llama_gqa_untied"), str(tmp_path / "tiny.gguf"))
    converted, out = convert_gguf(gguf_path), sources.converted_folder(gguf_path)
    os.makedirs(os.path.dirname(out))
    found = []
    with filelock.FileLock(out + ".lock"):  # the other process, converting
        waiting = threading.Thread(target=lambda: found.append(sources._cached_conversion(gguf_path)))
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive() and not found, "the second load did not wait for the conversion under way"
        save_converted(converted, out)

        def convert_again(path, **kwargs):
            raise AssertionError("converted a second time")

        monkeypatch.setattr(conversion.gguf_file, "convert_gguf", convert_again)
    waiting.join(timeout=60)
    assert found == [out]


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_weight_is_named_by_its_tensor_and_layer_before_the_rest_is_read(
    tiny_model, tmp_path, monkeypatch, value
):
    import conversion.hf

    folder = copy_folder(tiny_model("qwen2_gqa_tied"), tmp_path)
    name = "model.layers.1.mlp.down_proj.weight"

    def spoil(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name][3, 5] = value

    rewrite_safetensors(os.path.join(folder, "model.safetensors"), spoil)
    monkeypatch.setattr(conversion.hf, "load_tokenizer", lambda folder: pytest.fail("the tokenizer was read first"))
    what = "1 NaN value" if np.isnan(value) else "1 infinite value"
    with pytest.raises(ConversionError, match=rf"checkpoint tensor '{name}' \(layer 1's 'down'\) contains {what}"):
        convert_hf_folder(folder)


def test_a_non_finite_gguf_tensor_is_named_by_its_own_name(tiny_model, tmp_path):
    import copy
    import dataclasses

    import torch

    tiny = tiny_model("llama_gqa_untied")
    spoiled = dataclasses.replace(tiny, model=copy.deepcopy(tiny.model))  # the session's model stays as it is
    with torch.no_grad():
        spoiled.model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    path = write_tiny_gguf(spoiled, str(tmp_path / "tiny.gguf"))
    with pytest.raises(ConversionError, match=r"checkpoint tensor 'blk\.1\.ffn_down\.weight' \(layer 1's 'down'\)"):
        convert_gguf(path, load_tokenizer=False)


def test_a_non_finite_weight_after_loading_is_named_by_its_layer():
    """What a cast to a narrower dtype or a folder converted by an older version can bring: the
    check after loading names the parameter and the layers where it is not finite."""
    from conftest import tiny_config, tiny_moe_config
    from jaxdepth.core.model import random_params
    from jaxdepth.lab.sources import _check_finite_params

    config = tiny_config()
    params = random_params(config, 0)
    down = np.array(params["layers"]["down"])
    down[2, 0, 0] = np.inf
    spoiled = {**params, "layers": {**params["layers"], "down": down}}
    with pytest.raises(
        ValueError, match=r"src: parameter \['layers'\]\['down'\] contains NaN or infinite values at layer\(s\) \[2\]"
    ):
        _check_finite_params(spoiled, config, "src")
    _check_finite_params(params, config, "src")  # finite: nothing said
    # layers of two kinds: the dense MLP's stack holds layers 1 and 2 only, its row 1 is layer 2
    mixed = tiny_moe_config(dense_layers=(1, 2), dense_size=24)
    params = random_params(mixed, 0)
    down = np.array(params["layers"]["down"])
    down[1, 0, 0] = np.nan
    with pytest.raises(ValueError, match=r"\['down'\] contains NaN or infinite values at layer\(s\) \[2\]"):
        _check_finite_params({**params, "layers": {**params["layers"], "down": down}}, mixed, "src")
