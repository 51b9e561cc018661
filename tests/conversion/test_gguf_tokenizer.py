"""The GGUF tokenizer jaxdepth builds without torch gives exactly the token ids (and character
offsets, which place the answer start) of transformers' own GGUF loader, which needs torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import SHARED_DATA, shared_data_path, write_tiny_gguf
from jaxdepth.lab.prompts import load_prompts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Text that tokenizers get wrong in different ways: runs of spaces and newlines, digits, unicode
# punctuation and accents, emoji (several bytes per character), a control token written inline.
TRICKY = [
    "",
    " ",
    "  two  spaces",
    "\n\nnewlines\n",
    "\ttab",
    "5 + 7 + 5 + 3 + 1 + 7 = 28",
    "1234567890 12,345.67 $8",
    "Janet\u2019s ducks \u2014 na\u00efve caf\u00e9",
    "emoji \U0001f600\U0001f680!",
    "<|im_start|>user\nhi<|im_end|>",
    "Ca\u00f1\u00f3n \u4e2d\u6587 \u0440\u0443\u0441\u0441\u043a\u0438\u0439",
    "<<24-15=9>>9 muffins left.\n#### 9",
]


def _texts() -> list[str]:
    texts = TRICKY + [p.text for p in load_prompts("default")]
    if os.path.isdir(SHARED_DATA) or os.environ.get("CI") == "true":
        texts += [p.text for p in load_prompts("gsm8k", shared_data_path("gsm8k_test_sample.jsonl"), limit=50)]
        texts += [p.text for p in load_prompts("hellaswag", shared_data_path("hellaswag_val_sample.jsonl"), limit=50)]
        texts += [p.text for p in load_prompts("aime24", shared_data_path("aime24_sample.jsonl"))]
    return texts


def _transformers_gguf_tokenizer(path: str):
    pytest.importorskip("torch")  # transformers' GGUF reader imports torch
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _assert_same_tokenization(ours, theirs, texts, label):
    tokens = 0
    for text in texts:
        a = ours(text, return_offsets_mapping=True)
        b = theirs(text, return_offsets_mapping=True)
        assert a["input_ids"] == b["input_ids"], f"{label}: token ids differ on {text[:60]!r}"
        assert a["offset_mapping"] == b["offset_mapping"], f"{label}: offsets differ on {text[:60]!r}"
        assert ours.decode(a["input_ids"]) == theirs.decode(b["input_ids"])
        tokens += len(a["input_ids"])
    for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs)
    print(f"\n[tokenizer] {label}: {len(texts)} texts, {tokens} tokens, identical ids and offsets")


def test_embedded_gguf_tokenizer_equals_transformers_gguf_loader(smollm2_gguf_path):
    import gguf

    from conversion.gguf_tokenizer import gguf_tokenizer

    theirs = _transformers_gguf_tokenizer(smollm2_gguf_path)
    ours = gguf_tokenizer(gguf.GGUFReader(smollm2_gguf_path))
    _assert_same_tokenization(ours, theirs, _texts(), "SmolLM2-135M-Instruct GGUF")


def test_tiny_gguf_tokenizer_equals_transformers_gguf_loader(tiny_model, tmp_path):
    import gguf

    from conversion.gguf_tokenizer import gguf_tokenizer

    path = write_tiny_gguf(tiny_model("llama_gqa_untied"), str(tmp_path / "tiny.gguf"))
    theirs = _transformers_gguf_tokenizer(path)
    ours = gguf_tokenizer(gguf.GGUFReader(path))
    _assert_same_tokenization(ours, theirs, TRICKY + ["the cat sat", "attack at dawn"], "tiny byte-level GGUF")


def test_gguf_model_loads_where_torch_cannot_be_imported(tiny_model, tmp_path):
    """`jaxdepth.load` of a GGUF file (conversion, tokenizer, cache) in a process where any
    `import torch` fails, as in the main install."""
    path = write_tiny_gguf(tiny_model("llama_gqa_untied"), str(tmp_path / "tiny.gguf"))
    script = (
        "import sys, json\n"
        "sys.modules['torch'] = None  # every `import torch` now raises ImportError\n"
        "import jaxdepth\n"
        f"model = jaxdepth.load({path!r})\n"
        "print(json.dumps(model.encode('the cat sat').tolist()))\n"
    )
    env = {**os.environ, "JAXDEPTH_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ids == _transformers_gguf_tokenizer(path)("the cat sat")["input_ids"]


def test_gguf_without_tokenizer_metadata_is_a_clear_error():
    from conversion.errors import ConversionError
    from conversion.gguf_tokenizer import tokenizer_metadata

    class NoTokenizer:
        fields = {}

    with pytest.raises(ConversionError, match="no tokenizer"):
        tokenizer_metadata(NoTokenizer())


def test_a_transformers_without_the_converter_is_named(monkeypatch):
    """An older transformers (no torch-free GGUF tokenizer converter) is refused with the version
    that is needed, not an ImportError from deep inside it."""
    import transformers.integrations.gguf.gguf_tokenizer_mapping as mapping

    from conversion.errors import ConversionError
    from conversion.gguf_tokenizer import gguf_tokenizer

    monkeypatch.delattr(mapping, "convert_gguf_tokenizer")
    with pytest.raises(ConversionError, match=r"transformers >= 5\.23"):
        gguf_tokenizer(reader=None)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3", "phi3"])
def test_sentencepiece_gguf_tokenizer_equals_transformers_gguf_loader(tiny_gguf, tmp_path, arch):
    """A sentencepiece vocabulary (llama.cpp's tokenizer model 'llama', as Gemma and Phi-3 files
    have it): transformers builds it by the file's architecture (Gemma's merges from the pieces'
    order, Phi-3's prefix space from a normalizer), and so does jaxdepth."""
    import gguf

    from conversion.gguf_tokenizer import gguf_tokenizer

    path = write_tiny_gguf(tiny_gguf(arch)[0], str(tmp_path / f"{arch}.gguf"), tokenizer="sentencepiece")
    theirs = _transformers_gguf_tokenizer(path)
    ours = gguf_tokenizer(gguf.GGUFReader(path))
    texts = TRICKY + ["the cat sat on the mat", " the cat", "  and then", "is it in?"]
    _assert_same_tokenization(ours, theirs, texts, f"tiny sentencepiece {arch} GGUF")
