"""Hugging Face checkpoints (a local folder or a hub id) -> jaxdepth params."""

from __future__ import annotations

import json
import os

import numpy as np

from conversion.errors import ConversionError
from conversion.hf_layouts import hf_source
from conversion.layout import assemble_params
from conversion.safetensors_io import read_safetensors
from conversion.transformers_import import import_transformers
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.weights import ModelWeights

__all__ = [
    "download_from_hub",
    "read_hf_config",
    "load_tokenizer",
    "convert_hf_folder",
    "convert_hf",
    "HUB_PATTERNS",
]


# What a hub download fetches: config, weights and tokenizer, nothing else (no .bin/.pt copies).
HUB_PATTERNS = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "generation_config.json",
]


def download_from_hub(repo_id: str, revision: str | None = None) -> str:
    """Fetch (or find in the local HF cache) a hub checkpoint; return its local folder."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS)
    except Exception as e:  # huggingface_hub raises many types for offline / missing / gated
        raise ConversionError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
            "Without network access, pass a local folder or a converted checkpoint instead."
        ) from e


def read_hf_config(folder: str) -> ModelConfig:
    """The `ModelConfig` of the Hugging Face folder `folder`, from its config.json (a
    `ConversionError` where there is none)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"no config.json in {folder}")
    try:
        with open(path) as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path} is not valid JSON: {e}") from None
    return ModelConfig.from_hf(hf)


def _weight_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, name) for name in files]
    if os.path.isfile(single):
        return [single]
    raise ConversionError(
        f"no model.safetensors or model.safetensors.index.json in {folder} (only safetensors checkpoints are supported)"
    )


def load_tokenizer(folder: str):
    """The folder's tokenizer, or None when it has no tokenizer files."""
    if not any(os.path.isfile(os.path.join(folder, n)) for n in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return import_transformers().AutoTokenizer.from_pretrained(folder)


def convert_hf_folder(folder: str, *, dtype=np.float32) -> ModelWeights:
    """Convert a local HF folder (`config.json` + safetensors + tokenizer files)."""
    if not os.path.isdir(folder):
        raise ConversionError(f"not a folder: {folder}")
    config = read_hf_config(folder)
    tensors: dict[str, np.ndarray] = {}
    for path in _weight_files(folder):
        for name, array in read_safetensors(path).items():
            if name in tensors:
                raise ConversionError(f"tensor {name!r} appears in more than one shard")
            tensors[name] = array
    available, get, names = hf_source(config, tensors)
    params = assemble_params(config, available, get, names, dtype=dtype)
    return ModelWeights(params=params, config=config, tokenizer=load_tokenizer(folder), source=os.path.abspath(folder))


def convert_hf(source: str, *, dtype=np.float32, revision: str | None = None) -> ModelWeights:
    """Convert a local HF folder or, when `source` is not a local path, a hub id."""
    if os.path.isdir(source):
        return convert_hf_folder(source, dtype=dtype)
    converted = convert_hf_folder(download_from_hub(source, revision), dtype=dtype)
    converted.source = source
    return converted
