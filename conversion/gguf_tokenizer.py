"""The tokenizer a GGUF file describes, built without torch.

A GGUF file carries no `tokenizer.json`: its vocabulary, merges and special token ids are
metadata under llama.cpp's key names. transformers' own GGUF tokenizer path reads that metadata
with a reader that imports torch, which jaxdepth does not install. Here the metadata is read with
`gguf` (already needed for the weights) and handed to transformers' torch-free converter, the same
builder its GGUF loader uses, with the file's `general.architecture` as it passes it (the
architecture picks the builder of a sentencepiece vocabulary: Gemma's merges follow the pieces'
order, Phi-3's prefix space comes from a normalizer), so the token ids are the same
(`tests/conversion/test_gguf_tokenizer.py` compares them where torch is installed).
"""

from __future__ import annotations

from conversion.errors import ConversionError
from conversion.transformers_import import import_transformers

__all__ = [
    "tokenizer_metadata",
    "gguf_tokenizer",
]


# Special tokens named by id in the metadata: the tokenizer argument -> the GGUF key's suffix.
_SPECIAL_TOKEN_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def _contents(reader, key):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def tokenizer_metadata(reader) -> tuple[str, dict, dict]:
    """`(architecture, tokenizer_dict, tokenizer_config)` from a `gguf.GGUFReader`, named as
    transformers' GGUF converter expects them."""
    import_transformers()
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    def group(name):
        values = {}
        for suffix, renamed in GGUF_TOKENIZER_MAPPING[name].items():
            value = _contents(reader, f"tokenizer.{suffix}")
            if value is not None:
                values[renamed] = value
        return values

    tokenizer, config = group("tokenizer"), group("tokenizer_config")
    if "tokens" not in tokenizer:
        raise ConversionError("the GGUF file has no tokenizer (no 'tokenizer.ggml.tokens' metadata)")
    if tokenizer.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
        config.setdefault("add_bos_token", True)
    for name, suffix in _SPECIAL_TOKEN_IDS.items():
        token_id = _contents(reader, f"tokenizer.ggml.{suffix}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return _contents(reader, "general.architecture"), tokenizer, config


def gguf_tokenizer(reader):
    """A transformers fast tokenizer for the vocabulary stored in a GGUF file (`gguf.GGUFReader`)."""
    transformers = import_transformers()
    from transformers import PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError as e:
        if not (e.name or "").startswith("transformers"):
            raise  # a dependency of the converter is missing: its own error says which
        # older releases keep the converter elsewhere, or under another name
        raise ConversionError(
            f"building a GGUF file's tokenizer needs transformers >= 5.23 (installed: {transformers.__version__}), "
            "whose torch-free converter it uses: pip install 'transformers>=5.23'"
        ) from None

    architecture, tokenizer_dict, config = tokenizer_metadata(reader)
    try:
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except ValueError as e:
        raise ConversionError(f"cannot build the GGUF file's tokenizer: {e}") from None
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
